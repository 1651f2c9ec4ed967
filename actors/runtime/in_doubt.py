"""Calls in doubt, resolved (R-EFFECT-2): the runtime's side of
:mod:`greenroom.protocols.effects`.

When a task is taken up after its host stopped — ``Host.resume``, ``resume_tasks``, a
cluster takeover: all of them through :mod:`~greenroom.actors.runtime.resumption` — every
call that was allowed and has no recorded result is in doubt. :class:`CallsInDoubt`
records it (``call_in_doubt``, with the call's idempotency key) and resolves it by the
first that can (:func:`~greenroom.protocols.effects.first_resolver`):

- the tool's ``check``, asked through the pool (``CheckToolCall`` → ``ToolCallChecked``):
  what it found is the call's result, marked as found by the check; nothing found runs
  the call once more, with the same key; a check that fails falls through;
- a person, where the task's requests go to people: an ``approval_request`` of kind
  ``in_doubt`` that waits in the trace like any (R-HITL-1: across restarts, parked while
  nothing else runs) and is answered as ``ask_user`` is — ``host.answer_question``, the
  gateway's ``answer``, ``greenroom answer`` — with *done*, *not done* or *run again*
  (refused where the session has no such tool: it could not run again); nobody
  answering within the session's timeout leaves the model the note;
- the note: the host-lost result, not run again.

A task's ``final_answer`` call (R-OUT-1) is never in doubt: it runs nothing, so a take-up
gives it its result from the arguments the trace records (taken, or the schema's problems),
as the host that stopped would have; a valid answer completes the task.

A call a ``before_tool`` hook rewrote is checked, shown to a person and run once more as
rewritten (R-HOOK-2): those arguments were approved and ran, and the task record keeps
them from the call's ``tool_hook`` record. What a check found is the call's result: the
session's ``after_tool`` hook sees it (in the pool), and what it did is recorded first.

Every resolution is one ``call_resolved`` record, and then the call's result, or the
call run once more with the same key: its second ``RunToolCall``, after the record that
says why. Meanwhile the turn machine holds the call as running — it has no result yet —
and the session's task record knows it is in doubt (``in_doubt``: the fold of
``call_in_doubt`` and ``call_resolved``), which is the only state kept: an answer (a
check's, a person's) for a call no longer in doubt is stale. A call whose question already
waits in the trace keeps waiting; one recorded in doubt and not resolved (its host stopped
again, during the check) is resolved anew. A task that ends first (an interrupt, the
timeout policy's ``abort``) resolves what is left by the note.
"""

from __future__ import annotations

import time
from typing import Protocol

import trio

from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.tool_hooks import tool_hook_record
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, ToolCallBlock, ToolContent
from greenroom.protocols.effects import (
    IN_DOUBT_CHOICES,
    first_resolver,
    in_doubt_question,
    outcome_of_answer,
)
from greenroom.protocols.messages import (
    CheckToolCall,
    PersonAnswered,
    PoolCommand,
    RunToolCall,
    SkipToolCall,
    ToolCallChecked,
)
from greenroom.protocols.outputs import (
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    Resolution,
    ResolvedBy,
    ToolHook,
    ToolStatus,
)
from greenroom.protocols.people import arguments_digest
from greenroom.protocols.structured import FINAL_ANSWER
from greenroom.protocols.task import TaskRecord
from greenroom.protocols.turn import CallState, Effect, TurnMachine

__all__ = ["CallsInDoubt", "Turns"]


class Turns(Protocol):
    """What resolving needs of the task's turn runner: the current turn's machine, the
    carrying out of its effects, the calls as they run, and the calls' keys."""

    @property
    def machine(self) -> TurnMachine:
        """The current turn's machine."""
        ...

    def apply(self, effects: list[Effect]) -> None:
        """Carry out what the machine returned."""
        ...

    def running_call(self, call: ToolCallBlock) -> ToolCallBlock:
        """``call`` as it runs: with the arguments a ``before_tool`` hook rewrote it to
        (R-HOOK-2), which were approved, else as the model made it."""
        ...

    def idempotency_key(self, call_id: str) -> str:
        """The key of the current attempt's call ``call_id`` (R-EFFECT-1)."""
        ...


class CallsInDoubt:
    """The calls in doubt of one task (see the module docstring). ``people``: the task's
    requests go to people (``approve="people"``), who may then be asked;
    ``check_errors``: why each call's check failed, kept across the task's turns."""

    __slots__ = ("_check_errors", "_emitter", "_people", "_pool", "_port", "_run_id", "_turns")

    def __init__(
        self,
        *,
        turns: Turns,
        port: SessionPort,
        emitter: OutputEmitter,
        pool: trio.MemorySendChannel[PoolCommand],
        run_id: str,
        people: bool,
        check_errors: dict[str, str] | None = None,
    ) -> None:
        self._turns = turns
        self._port = port
        self._emitter = emitter
        self._pool = pool
        self._run_id = run_id
        self._people = people
        self._check_errors = {} if check_errors is None else check_errors
        """Why each call's check gave no answer, kept by the task's runner (this object
        is made when used): the note an interrupt gives the call records it too, as
        every resolution after a failed check does."""

    def take_up(self, record: TaskRecord) -> bool:
        """Resolve the calls in doubt of the turn just rebuilt from ``record`` (a call
        running there has no result: its host was lost): recorded in doubt now unless an
        earlier take-up did, and resolved unless a person has the question already.
        Returns whether any call is in doubt. A task interrupted before it is taken up
        resolves none now: it ends at once, and ending it gives each the note."""
        machine = self._turns.machine
        stopping = self._port.machine.stopping
        in_doubt = False
        for position, call in enumerate(machine.calls()):
            if machine.call_state(call.id) is not CallState.RUNNING:
                continue
            if _is_answer(call, record):
                # Runs nothing: "run" again, its result is its recorded arguments checked
                # once more, and a valid answer is the task's (R-OUT-1), never lost. A task
                # told to stop starts no call: its end settles this one as interrupted.
                if not stopping:
                    self._turns.apply([RunToolCall(call=call, position=position)])
                continue
            in_doubt = True
            if call.id not in record.in_doubt:
                key = self._turns.idempotency_key(call.id)
                self._record(
                    CallInDoubt(
                        session_id=self._port.id,
                        run_id=self._run_id,
                        call_id=call.id,
                        tool=call.name,
                        idempotency_key=key,
                    )
                )
            if not (stopping or record.waits_for_person(call.id)):
                self._resolve(self._turns.running_call(call), position, check_error=None)
        return in_doubt

    def _record(self, output: CallInDoubt | CallResolved | ToolHook) -> None:
        self._turns.apply([output])

    def _doubted(self, call_id: str) -> tuple[int, ToolCallBlock] | None:
        """The position of ``call_id`` and the call as it ran (a hook's rewrite: what was
        approved) while it is in doubt; None once it is resolved (or its task settled it)."""
        if call_id not in self._port.machine.record.in_doubt:
            return None
        turns = self._turns
        for position, call in enumerate(turns.machine.calls()):
            if call.id == call_id:
                return position, turns.running_call(call)
        return None

    def _resolved(
        self,
        call_id: str,
        *,
        by: ResolvedBy,
        outcome: Resolution,
        status: ToolStatus = "interrupted",
        content: tuple[ToolContent, ...] | str = (),
        principal: str | None = None,
        check_error: str | None = None,
        pool: bool = True,
    ) -> None:
        """Record how ``call_id`` was resolved, then carry it out: run it once more
        (``rerun``), or give it its result (the pool, when ``pool``, learns it will not
        run)."""
        found = self._doubted(call_id)
        if found is None:
            return
        position, call = found
        self._record(
            CallResolved(
                session_id=self._port.id,
                run_id=self._run_id,
                call_id=call_id,
                tool=call.name,
                by=by,
                outcome=outcome,
                principal=principal,
                check_error=check_error,
            )
        )
        if outcome == "rerun":
            # The call's second run, after the record that says why; same position, key.
            self._turns.apply([RunToolCall(call=call, position=position)])
            return
        if pool:
            self._pool.send_nowait(SkipToolCall(position=position))
        blocks = (TextBlock(text=content),) if isinstance(content, str) else content
        self._turns.apply(self._turns.machine.finish(call_id, status=status, content=blocks))

    def settle(self) -> None:
        """The task ends (interrupted, failed) with calls still in doubt: each is resolved
        as the note does, before the turn machine settles the rest. The pool is gone."""
        record = self._port.machine.record
        for call_id in list(record.in_doubt):
            self._resolved(
                call_id,
                by="note",
                outcome="unknown",
                content=markers.HOST_LOST_TEXT,
                check_error=self._check_errors.get(call_id) or _asked_check_error(record, call_id),
                pool=False,
            )

    def _resolve(self, call: ToolCallBlock, position: int, *, check_error: str | None) -> None:
        """Start resolving ``call``: ask its check, ask a person, or give the note."""
        tool = self._port.tool_by_name.get(call.name)
        resolver = first_resolver(tool, people=self._people, check_failed=check_error is not None)
        key = self._turns.idempotency_key(call.id)
        if resolver == "check":
            self._pool.send_nowait(CheckToolCall(call=call, position=position, idempotency_key=key))
        elif resolver == "person":
            self._ask(call, key, check_error)
        else:
            idempotent = tool is not None and tool.idempotent
            note = markers.HOST_LOST_IDEMPOTENT_TEXT if idempotent else markers.HOST_LOST_TEXT
            self._note(call.id, note, check_error)

    def _note(self, call_id: str, note: str, check_error: str | None) -> None:
        self._resolved(
            call_id, by="note", outcome="unknown", content=note, check_error=check_error
        )

    def _ask(self, call: ToolCallBlock, key: str, check_error: str | None) -> None:
        """Ask the session's people what became of ``call``: the request is the pending
        state, held to the session's timeout policy (R-HITL-1)."""
        port = self._port
        request = self._emitter.emit(
            ApprovalRequest(
                session_id=port.id,
                run_id=self._run_id,
                call_id=call.id,
                tool=call.name,
                arguments=in_doubt_question(call.name, call.arguments, key, check_error),
                kind="in_doubt",
                asked_at=time.time(),
            )
        )
        port.host.watch_approval(port, call.id, request.asked_at)

    def checked(self, answer: ToolCallChecked) -> None:
        """The check of an in-doubt call answered: what it found is the call's result; not
        done runs it once more; a failure passes the call to the next resolver — unless the
        task was told to stop meanwhile: then only a found effect is taken, and the end
        gives the rest the note. An answer for a call settled meanwhile is dropped."""
        call_id = answer.call_id
        found = self._doubted(call_id)
        if found is None:
            return
        if answer.outcome == "failed":
            self._check_errors[call_id] = answer.error or "the check failed"
        if answer.outcome != "done" and self._port.machine.stopping:
            # Told to stop while the check ran: no call starts now, nor is anyone asked;
            # the task's end gives the call the note (settle).
            return
        if answer.outcome == "done":
            hooked = tool_hook_record(
                answer.hook, None, session_id=self._port.id, run_id=self._run_id,
                call_id=call_id, calls=self._turns.machine.calls(), rewrites=None,
            )  # fmt: skip
            if hooked is not None:  # R-HOOK-2: before the result it explains
                self._record(hooked)
            content = (TextBlock(text=markers.IN_DOUBT_FOUND_TEXT), *answer.content)
            self._resolved(
                call_id, by="check", outcome="done", status=answer.status, content=content
            )
        elif answer.outcome == "not_done":
            self._resolved(call_id, by="check", outcome="rerun")
        else:
            position, call = found
            self._resolve(call, position, check_error=self._check_errors[call_id])

    def answer(self, request: ApprovalRequest, answer: PersonAnswered) -> str | None:
        """A person's answer to ``request``, the in-doubt question of its call (or the
        timeout's, which leaves the note): resolved, or why it is refused (R-HITL-2)."""
        call_id = request.call_id
        if self._doubted(call_id) is None:
            return f"call {call_id!r} of session {self._port.id} is not in doubt any more"
        if answer.digest is not None and answer.digest != arguments_digest(request.arguments):
            return f"call {call_id!r} has other arguments than the ones that were shown"
        check_error = request.arguments.get("check_error")
        if not isinstance(check_error, str):
            check_error = None
        if answer.by == "default":
            self._note(call_id, markers.HOST_LOST_TEXT, check_error)
            return None
        choices = ", ".join(IN_DOUBT_CHOICES)
        outcome = outcome_of_answer(answer.text) if answer.text is not None else None
        if outcome is None:
            return (
                f"call {call_id!r} is in doubt: answer whether it took effect with one of "
                f"{choices}"
            )
        if outcome == "rerun" and request.tool not in self._port.tool_by_name:
            # Taken, the record said it ran again while the model got "unknown tool": the
            # first run's effect, still unknown, hidden behind an error that says nothing.
            return (
                f"call {call_id!r} cannot run again here: session {self._port.id} has no "
                f"tool {request.tool!r} (open it with that tool, or answer done or not done)"
            )
        status: ToolStatus = "ok" if outcome == "done" else "interrupted"
        note = markers.IN_DOUBT_DONE_TEXT if outcome == "done" else markers.IN_DOUBT_NOT_DONE_TEXT
        self._resolved(
            call_id,
            by="person",
            outcome=outcome,
            status=status,
            content=note,
            principal=answer.principal,
            check_error=check_error,
        )
        return None


def _is_answer(call: ToolCallBlock, record: TaskRecord) -> bool:
    """Whether ``call`` is the task's ``final_answer`` (R-OUT-1): no tool, never in doubt.
    One an earlier host recorded in doubt (before this rule) is resolved as any other, so
    that its ``call_in_doubt`` has its ``call_resolved``."""
    return call.name == FINAL_ANSWER and record.answers is not None and (
        call.id not in record.in_doubt
    )


def _asked_check_error(record: TaskRecord, call_id: str) -> str | None:
    """The check's error the pending in-doubt question of ``call_id`` carries (asked by
    an earlier host, perhaps), None when it has none."""
    for request in record.pending_people:
        if request.call_id == call_id and request.kind == "in_doubt":
            error = request.arguments.get("check_error")
            return error if isinstance(error, str) else None
    return None
