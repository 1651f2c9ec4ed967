"""The turns of one task, carried out: the turn machine's effects reach the actors.

:class:`TurnRunner` holds the current turn's pure
:class:`~greenroom.protocols.turn.TurnMachine` (R-ACTOR-3) and the send sides of the task's
actors. The supervisor hands it what those actors report — stream batches, approval
decisions, tool results and progress — and it feeds them to the machine and carries out what
the machine returns, in order: outputs emitted through the
:class:`~greenroom.actors.runtime.emitter.OutputEmitter`, ``ApproveCall`` to the approval
broker (or decided at once by an earlier ``allow_session``, which the task machine holds:
R-APPROVE-4), ``RunToolCall`` / ``SkipToolCall`` to the tool pool, usage to the ledger. The
machine counts a request's tokens; the runner prices them at the session's model's price
before the ``token_usage`` is emitted (R-SHARE-3).
It holds no inbox and calls nothing back: the supervisor decides what comes next.

A running call may ask people a question (``QuestionAsked``: an MCP server's elicitation,
R-HITL-5). The runner records it as an ``approval_request`` of kind ``question`` under the
call's id and keeps the call's reply channel until a person answers (the answer is
recorded as the request's ``approval_decision``), the wait runs out, or the call ends —
its result settles the request in the trace, as any result settles its call's requests.

Every call it sends to the pool carries the call's idempotency key (R-EFFECT-1); the calls
a take-up finds in doubt are resolved by its
:class:`~greenroom.actors.runtime.in_doubt.CallsInDoubt` (R-EFFECT-2).

Tool hooks (R-HOOK-2): what a ``before_tool`` hook did reaches the runner with the broker's
decision, what an ``after_tool`` hook did with the pool's result; each is recorded as a
``tool_hook`` before the record it explains. A call the hook rewrote runs as rewritten —
and so does one a person approved, from the arguments of the ``approval_request`` they
saw; a task taken up after a restart knows the rewrite from its ``tool_hook`` record, so a
call in doubt is checked, asked about and run once more as rewritten. A call an earlier
``allow_session``
covers still goes to the broker while there is a ``before_tool`` hook, so that the hook
sees it.

A task that requires an output schema (R-OUT-1) may answer through the synthetic
``final_answer`` call: the runner decides it itself — allowed by ``default``, never sent
to the broker or the pool, for it runs nothing — and gives it its result at once: taken,
or the schema's problems for the model to correct.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import attrs
import trio

from greenroom.actors.runtime.emitter import OutputEmitter, repaired_blocks
from greenroom.actors.runtime.in_doubt import CallsInDoubt
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.tool_hooks import tool_hook_record
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.effects import idempotency_key
from greenroom.protocols.hooks import ToolHookAction, hook_denied_text
from greenroom.protocols.messages import (
    ApprovalAsked,
    ApprovalDecided,
    ApproveCall,
    BeginTurn,
    PersonAnswered,
    PoolCommand,
    QuestionAnswered,
    QuestionAsked,
    RunToolCall,
    SkipToolCall,
    ToolCallChecked,
    ToolCallFinished,
    ToolProgressed,
)
from greenroom.protocols.outputs import (
    ApprovalDecision,
    ApprovalRequest,
    PartialText,
    PartialThinking,
    PartialToolCall,
    TokenUsageOutput,
    ToolStatus,
)
from greenroom.protocols.people import answer_problem, arguments_digest
from greenroom.protocols.stream import ModelError, StreamEvent
from greenroom.protocols.structured import (
    ANSWER_ACCEPTED_TEXT,
    FINAL_ANSWER,
    answer_rejected_text,
    check_call,
)
from greenroom.protocols.task import Phase, TaskRecord
from greenroom.protocols.text import repair_json, repair_text
from greenroom.protocols.turn import CallState, Effect, RecordUsage, TurnMachine, resume_turn

__all__ = ["TurnRunner"]

_PARTIALS = frozenset({PartialText, PartialThinking, PartialToolCall})
_CANCELLED = QuestionAnswered(action="cancel")


class _Unserved:
    """The inbox of an actor that has stopped: what is sent there goes nowhere."""

    __slots__ = ()

    def send_nowait(self, command: object) -> None:
        return None


_UNSERVED: Any = _Unserved()


def _answer_result(port: SessionPort, call: ToolCallBlock) -> tuple[ToolStatus, str]:
    """The result of a ``final_answer`` call (R-OUT-1): taken when its arguments match the
    task's schema, else the problems, for the model to answer again."""
    answers = port.machine.record.answers
    assert answers is not None
    problems = check_call(call, answers.schema)
    if problems:
        return "error", answer_rejected_text(problems)
    return "ok", ANSWER_ACCEPTED_TEXT


def _rewritten_calls(record: TaskRecord) -> dict[str, ToolCallBlock] | None:
    """The calls of ``record``'s attempt that a ``before_tool`` hook rewrote (R-HOOK-2), as
    they were approved and ran: a task taken up after its host stopped runs a call in doubt
    once more with them, never with the model's arguments nobody approved."""
    rewrites = record.rewrites
    if not rewrites:
        return None
    return {
        c.id: attrs.evolve(c, arguments=rewrites[c.id], invalid_arguments=None)
        for c in record.calls
        if c.id in rewrites
    }


def _reply(reply: Any, answer: QuestionAnswered) -> None:
    """Send a question's one answer; the asker may have gone (its call ended)."""
    if reply is None:
        return
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        reply.send_nowait(answer)
    reply.close()


def _question_decided(request: ApprovalRequest, answer: PersonAnswered) -> str | dict[str, Any]:
    """How ``answer`` decides the model's own question (``ask_user``, R-HITL-5): the
    arguments of :meth:`TurnMachine.decide` besides who decided, or why it is refused. A
    person's text is their answer whatever it says, held to the question's choices; their
    ``deny`` declines it, a deny the trace keeps as such, whose result tells the model in
    words (:data:`~greenroom.protocols.markers.DECLINED_ANSWER`); the timeout's answer
    tells the model nobody answered."""
    if answer.by != "client":
        return {"allowed": True, "answer": markers.NO_ANSWER_TEXT}
    if answer.verdict == "deny":
        return {"allowed": False, "denied_text": markers.DECLINED_ANSWER}
    if answer.text is None:
        return "is a question: answer it with text, or deny it to decline"
    problem = answer_problem(request.arguments, answer.text)
    return problem if problem is not None else {"allowed": True, "answer": answer.text}


class TurnRunner:
    """The turns of one task of ``port`` (see the module docstring)."""

    __slots__ = (
        "_approvals",
        "_before_tool",
        "_check_errors",
        "_emitter",
        "_people",
        "_pool",
        "_port",
        "_questions",
        "_rewritten",
        "left_for_people",
        "machine",
        "run_id",
    )

    def __init__(
        self,
        *,
        port: SessionPort,
        emitter: OutputEmitter,
        run_id: str,
        approvals: trio.MemorySendChannel[ApproveCall],
        pool: trio.MemorySendChannel[PoolCommand],
        people: bool = False,
        before_tool: bool = False,
    ) -> None:
        """``people``: the task's requests go to people (``approve="people"``), who are
        then asked about calls in doubt too."""
        self._port = port
        self._before_tool = before_tool
        self._rewritten: dict[str, ToolCallBlock] | None = None
        """The calls that run with other arguments than the model's (R-HOOK-2), by id."""
        self._emitter = emitter
        self._approvals = approvals
        self._pool = pool
        self._check_errors: dict[str, str] = {}  # of calls in doubt: see CallsInDoubt
        self._questions: dict[str, Any] | None = None
        """The reply channels of running calls' open questions, by call id."""
        self.run_id = run_id
        self.machine = TurnMachine(session_id=port.id, run_id=run_id, turn=0)
        """The current turn's machine (a new one per turn)."""
        self._people = people
        self.left_for_people: tuple[ApprovalRequest, ...] = ()
        """The requests a person held when :meth:`resume` took the task up: asked of nobody."""

    @property
    def _doubts(self) -> CallsInDoubt:
        # Made when used, not kept: kept, it and the runner would hold each other, a cycle
        # only the cyclic collector frees (R-PERF-1).
        return CallsInDoubt(
            turns=self,
            port=self._port,
            emitter=self._emitter,
            pool=self._pool,
            run_id=self.run_id,
            people=self._people,
            check_errors=self._check_errors,
        )

    def actors_stopped(self) -> None:
        """The task's actors have stopped: its end drains what they reported before, and a
        report can still move the turn on (a decision, then the next call asked). The
        commands that follow go nowhere — sent to a stopped actor's closed inbox, they
        raised, and an interrupt ended the task as an internal error — and the task's end
        settles every call in flight."""
        self._approvals = self._pool = _UNSERVED

    @property
    def turn(self) -> int:
        """The current turn's number."""
        return self.machine.turn

    def begin_turn(self, turn: int) -> None:
        """Turn ``turn`` begins: a fresh machine, or the same turn again from attempt 1
        after an overflow compaction (R-COMPACT-9)."""
        self._end_questions()
        if turn == self.machine.turn:
            self.machine.restart()
        else:
            # A cluster's trace takes records of a limited size: the model's blocks are
            # made to fit it, measured once a block is complete (None on a file trace).
            self.machine = TurnMachine(
                session_id=self._port.id,
                run_id=self.run_id,
                turn=turn,
                largest_record=self._port.host.trace_log.largest_input(),
            )
        self._pool.send_nowait(BeginTurn())

    def begin_attempt(self, attempt: int) -> None:
        """Attempt ``attempt`` of the turn starts (``request_begin``). A retry's calls
        count from position 0 again in the pool; the failed attempt's calls are history
        (R-RETRY-4)."""
        machine = self.machine
        if attempt > 1:
            machine.discard_attempt()
            self._pool.send_nowait(BeginTurn())
        self.apply(machine.begin_attempt(attempt))

    def discard_attempt(self) -> None:
        """The failed attempt's calls are history (before an overflow compaction)."""
        self._end_questions()
        self.machine.discard_attempt()
        self._pool.send_nowait(BeginTurn())

    def feed(self, events: list[StreamEvent]) -> None:
        """Stream events of the current attempt: the hot path, one batch per network read."""
        self.apply(self.machine.feed(events))

    def fail_attempt(self, error: ModelError, retry_in_ms: int | None) -> None:
        """The attempt's stream failed: its ``request_end`` with the planned wait."""
        self.apply(self.machine.fail_attempt(error, retry_in_ms=retry_in_ms))

    def handle(
        self,
        message: ToolCallFinished
        | ToolProgressed
        | ApprovalDecided
        | ApprovalAsked
        | QuestionAsked
        | ToolCallChecked,
    ) -> None:
        """What the pool or the broker reported."""
        machine = self.machine
        match message:
            case ToolCallChecked():
                self._doubts.checked(message)
            case ToolCallFinished():
                # A question still open ends with its call (the result settles it).
                self._end_question(message.call_id)
                self._hooked(message.call_id, message.hook)
                # Tool output is outside text (R-SEC-1): repaired before anyone encodes it.
                self.apply(
                    machine.finish(
                        message.call_id,
                        status=message.status,
                        content=repaired_blocks(message.content),
                    )
                )
            case ApprovalDecided():
                hook = message.hook
                self._hooked(message.call.id, hook, message.call)
                self.apply(
                    machine.decide(
                        message.call.id,
                        allowed=message.verdict != "deny",
                        by=message.by,
                        # The interrupt came first (the decision was still in the inbox):
                        # the call never starts, and the abort reports it interrupted.
                        interrupted=self._port.machine.stopping,
                        remember=message.verdict == "allow_session",
                        denied_text=hook_denied_text(hook)
                        if hook is not None and message.by == "hook"
                        else markers.DENIED_TEXT,
                    )
                )
            case ApprovalAsked():
                # The request is the pending state (R-HITL-1): the answer comes back as
                # PersonAnswered, from whichever surface a person uses.
                asked = message.call
                self._hooked(asked.id, message.hook, asked)
                request = self._emitter.emit(
                    ApprovalRequest(
                        session_id=self._port.id,
                        run_id=self.run_id,
                        call_id=asked.id,
                        tool=asked.name,
                        arguments=asked.arguments,
                        kind=message.kind,
                        asked_at=time.time(),
                    )
                )
                self._port.host.watch_approval(self._port, asked.id, request.asked_at)
            case ToolProgressed():
                # Live only: progress notes never reach the trace (R-TRACE-1, R-TOOL-6).
                self.apply(machine.progress(message.call_id, repair_text(message.message)))
            case QuestionAsked():
                self._question(message)

    def _hooked(
        self, call_id: str, action: ToolHookAction | None, call: ToolCallBlock | None = None
    ) -> None:
        """Record what a tool hook did to ``call_id`` (R-HOOK-2); a rewritten ``call`` is
        the one that runs."""
        hooked = tool_hook_record(
            action, call, session_id=self._port.id, run_id=self.run_id, call_id=call_id,
            calls=self.machine.calls(), rewrites=self._port.machine.record.rewrites,
        )  # fmt: skip
        if hooked is None:
            return
        self._emitter.emit(hooked)
        if hooked.action == "rewrite" and call is not None:
            self._run_as(call)

    def _run_as(self, call: ToolCallBlock) -> None:
        if self._rewritten is None:
            self._rewritten = {}
        self._rewritten[call.id] = call

    def _question(self, asked: QuestionAsked) -> None:
        """A running call asks people a question: recorded (the pending state), its
        reply kept; one at a time per call, and only while the call runs."""
        call_id = asked.call_id
        questions = self._questions
        if self.machine.call_state(call_id) is not CallState.RUNNING or (
            questions is not None and call_id in questions
        ):
            _reply(asked.reply, _CANCELLED)
            return
        (call,) = (c for c in self.machine.calls() if c.id == call_id)
        request = self._emitter.emit(
            ApprovalRequest(
                session_id=self._port.id,
                run_id=self.run_id,
                call_id=call_id,
                tool=call.name,
                # Outside text (R-SEC-1), as the call's output is.
                arguments=repair_json(asked.arguments),
                kind="question",
                asked_at=time.time(),
            )
        )
        if questions is None:
            questions = self._questions = {}
        questions[call_id] = asked.reply
        self._port.host.watch_approval(self._port, call_id, request.asked_at)

    def _end_question(self, call_id: str, answer: QuestionAnswered | None = None) -> None:
        questions = self._questions
        if questions is not None and call_id in questions:
            _reply(questions.pop(call_id), answer or _CANCELLED)

    def _end_questions(self) -> None:
        """The calls are over (the task stops, the attempt is history): no question of
        theirs waits any more."""
        for call_id in list(self._questions or ()):
            self._end_question(call_id)

    def answer(self, answer: PersonAnswered) -> str | None:
        """A person's answer (or the timeout's deny) to a request of this turn: decided,
        or the question's text recorded as the call's result (R-HITL-5). Returns why it
        is refused, None when taken (R-HITL-2)."""
        port = self._port
        call_id = answer.call_id
        request = port.machine.record.pending(call_id)
        if request is not None and request.kind == "in_doubt":
            return self._doubts.answer(request, answer)
        if request is not None and call_id in (self._questions or ()):
            return self._answer_question(request, answer)
        if request is None or self.machine.call_state(call_id) is not CallState.APPROVING:
            return (
                f"call {call_id!r} of session {port.id} waits for no answer: it was "
                "answered, it timed out, or its task ended"
            )
        if answer.digest is not None and answer.digest != arguments_digest(request.arguments):
            return f"call {call_id!r} has other arguments than the ones that were shown"
        by, principal = answer.by, answer.principal
        if request.kind == "question":
            decided = _question_decided(request, answer)
            if isinstance(decided, str):
                return f"call {call_id!r} {decided}"
            self.apply(self.machine.decide(call_id, by=by, principal=principal, **decided))
            return None
        verdict = answer.verdict or ("deny" if answer.by == "default" else None)
        if verdict is None:
            return f"call {call_id!r} asks for a decision: allow, deny or allow_session"
        (call,) = (c for c in self.machine.calls() if c.id == call_id)
        if request.arguments != call.arguments:
            # What the person approved (a before_tool hook's rewrite, R-HOOK-2) is what runs.
            self._run_as(attrs.evolve(call, arguments=request.arguments, invalid_arguments=None))
        self.apply(
            self.machine.decide(
                call_id,
                allowed=verdict != "deny",
                remember=verdict == "allow_session",
                interrupted=port.machine.stopping,
                by=by,
                principal=principal,
            )
        )
        return None

    def _answer_question(self, request: ApprovalRequest, answer: PersonAnswered) -> str | None:
        """A person's answer to a running call's question (or the timeout's): recorded as
        the request's decision (``allow`` for an answer, ``deny`` for a decline or no
        answer), and the call gets it. Returns why it is refused, None when taken."""
        call_id = request.call_id
        if answer.digest is not None and answer.digest != arguments_digest(request.arguments):
            return f"call {call_id!r} has other arguments than the ones that were shown"
        reply: QuestionAnswered
        if answer.by == "default":
            reply = _CANCELLED
        elif answer.verdict == "deny":
            reply = QuestionAnswered(action="decline")
        elif answer.text is None:
            return (
                f"call {call_id!r} asks a question while it runs: answer it with text, "
                "or deny it to decline"
            )
        else:
            problem = answer_problem(request.arguments, answer.text)
            if problem is not None:
                return f"call {call_id!r}: the answer does not fit: {problem}"
            reply = QuestionAnswered(action="accept", text=answer.text)
        self._emitter.emit(
            ApprovalDecision(
                session_id=self._port.id,
                run_id=self.run_id,
                call_id=call_id,
                tool=request.tool,
                decision="allow" if reply.action == "accept" else "deny",
                by=answer.by,
                principal=answer.principal,
            )
        )
        self._end_question(call_id, reply)
        return None

    def resume(self, record: TaskRecord) -> tuple[bool, bool]:
        """Take up the attempt the trace left open (a task woken from parking, or loaded
        after its host stopped: R-HITL-4): the machine is rebuilt from the record and the
        transcript; the new pool learns which calls are terminal; a call that was running
        when the host stopped is in doubt and is resolved (R-EFFECT-2, R-CLUSTER-2); the
        call being decided is asked again unless a person has it (R-HITL-1) or the task
        is interrupted already. Returns whether the attempt's stream was cut (the
        supervisor ends it failed, to be retried) and whether a call is in doubt."""
        transcript = self._port.transcript
        results = {c.id: r for c in record.calls if (r := transcript.result_of(c.id))}
        cut = record.phase is Phase.MODEL
        machine = self.machine = resume_turn(
            session_id=self._port.id,
            run_id=self.run_id,
            turn=record.turn,
            attempt=record.attempt,
            calls=record.calls,
            results=results,
            allowed=record.allowed,
            stream_ended=not cut,
            largest_record=self._port.host.trace_log.largest_input(),
        )
        for position, call in enumerate(machine.calls()):
            if machine.call_state(call.id) is CallState.DONE:
                self._pool.send_nowait(SkipToolCall(position=position))
        # Asked of nobody here, whatever decides the task's calls: waiting only for them,
        # the task may park (R-HITL-3).
        self.left_for_people = record.pending_people
        self._rewritten = _rewritten_calls(record)
        lost_any = self._doubts.take_up(record)
        asking = None if self._port.machine.stopping else machine.asking
        if asking is not None and record.pending(asking) is None:
            (call,) = (c for c in machine.calls() if c.id == asking)
            # Asked anew: what the hooks and the approval decide now is what runs.
            (self._rewritten or {}).pop(asking, None)
            self._ask(ApproveCall(call=call))
        return cut, lost_any

    def abort(self, reason: str) -> None:
        """Settle every call and record the ``abort`` (R-ABORT-1..3, R-APPROVE-5)."""
        self._doubts.settle()
        self._end_questions()
        complete = self._port.transcript.message_complete
        self.apply(self.machine.abort(reason, message_complete=complete))

    def fail(self, message: str) -> None:
        """Settle every call of a task that fails on its own (a bug, the trace)."""
        self._doubts.settle()
        self._end_questions()
        complete = self._port.transcript.message_complete
        self.apply(self.machine.fail(message, message_complete=complete))

    def apply(self, effects: list[Effect]) -> None:
        """Carry out what the turn machine returned, in order."""
        emitter = self._emitter
        emit_live = emitter.emit_live
        for effect in effects:
            # The hot path: most effects are live partial outputs, one per token.
            if effect.__class__ in _PARTIALS:
                emit_live(effect)  # type: ignore[arg-type]
                continue
            match effect:
                case ApproveCall():
                    self._ask(effect)
                case RunToolCall() if self._is_answer(effect.call.name):
                    self._pool.send_nowait(SkipToolCall(position=effect.position))
                    status, text = _answer_result(self._port, effect.call)
                    content = (TextBlock(text=text),)
                    self.apply(self.machine.finish(effect.call.id, status=status, content=content))
                case RunToolCall():
                    call = self.running_call(effect.call)
                    key = self.idempotency_key(effect.call.id)
                    self._pool.send_nowait(attrs.evolve(effect, call=call, idempotency_key=key))
                case SkipToolCall():
                    self._pool.send_nowait(effect)
                case RecordUsage(usage=used, started=started):
                    self._port.record_usage(self.run_id, self.machine.turn, used, started=started)
                case TokenUsageOutput():
                    priced = self._port.account.priced(effect.request)
                    same = priced is effect.request
                    emitter.emit(effect if same else attrs.evolve(effect, request=priced))
                case _ if effect.TRACED:
                    emitter.emit(effect)
                case _:
                    emitter.emit_live(effect)

    def running_call(self, call: ToolCallBlock) -> ToolCallBlock:
        """``call`` as it runs: with the arguments a hook rewrote it to (R-HOOK-2)."""
        return (self._rewritten or {}).get(call.id, call)

    def idempotency_key(self, call_id: str) -> str:
        """The key of the current attempt's call ``call_id`` (R-EFFECT-1): from the
        session, the ``seq`` of the call's ``model_msg`` and the call id, so every host
        that reads the trace derives the same one."""
        port = self._port
        return idempotency_key(port.id, port.machine.record.call_seq(call_id), call_id)

    def _is_answer(self, tool: str) -> bool:
        return tool == FINAL_ANSWER and self._port.machine.record.answers is not None

    def _ask(self, command: ApproveCall) -> None:
        call = command.call
        if self._is_answer(call.name):
            # The answer, not a tool: nobody is asked and no hook sees it (R-OUT-1).
            stopping = self._port.machine.stopping
            self.apply(
                self.machine.decide(call.id, allowed=True, by="default", interrupted=stopping)
            )
            return
        if self._port.machine.allowed_for_session(call.name):
            if self._before_tool:
                # R-HOOK-2: the hook sees it first; the broker then allows it by the rule.
                self._approvals.send_nowait(ApproveCall(call=call, session_rule=True))
                return
            # R-APPROVE-4: an earlier allow_session decides it at once.
            self.apply(self.machine.decide(call.id, allowed=True, by="session_rule"))
            return
        self._approvals.send_nowait(command)  # R-TOOL-1
