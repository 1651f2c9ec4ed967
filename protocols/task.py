"""The task machine: what a session's work does next, as a pure function of what happened.

A session runs one task at a time (R-HOST-2): a ``run`` and the follow-ups queued behind it
(R-STEER-6), or a manual compaction (R-COMPACT-2). Inside a task the model is asked turn
after turn until it answers without tool calls (R-RUN-5). Between those requests lie the
decisions this machine makes, and nothing else makes them: retry an attempt or give up
(R-RETRY), compact before a request or after an overflow (R-COMPACT-2, R-COMPACT-9), deliver
steering (R-STEER-2..5), ask the stop hook (R-HOOK-1), stop at ``max_turns`` (R-RUN-6), on
a loop (R-GUARD-1) or at a cost budget (R-SHARE-4), lock the session after an auth failure
(R-RETRY-6), hold the answer to the task's output schema and send an invalid one back once
(R-OUT-1), and end with exactly one ``task_end`` (R-RUN-7). The turn's own mechanics —
blocks, tool calls, approvals — are the turn machine's (:mod:`greenroom.protocols.turn`).

Two kinds of input, kept apart on purpose:

* **Recorded facts.** :meth:`TaskMachine.observe` takes every traced output of the session,
  in ``seq`` order, as the trace holds it. Everything the machine keeps about the session's
  work in progress — the open task, its turn and attempt, the planned retry, the calls of
  the turn and their results, compaction, the loop guard, the auth lock, the tools allowed
  for the session — changes only here. So :func:`fold` over a trace rebuilds exactly the
  state the live run had at any ``seq`` (:meth:`TaskMachine.recorded`), which is what lets a
  task be resumed after a restart or on another host.
* **Live inputs** that the trace records only once they take effect: steering waiting for
  the next input assembly, tasks queued behind the running one, an interrupt, a failure to
  write the trace, a cost budget the next request would pass, a hook's answer, how many
  background subagents of the session run. They
  live in memory and are lost with the process, as the rules allow (R-STEER-5, R-STEER-6)
  — except a user's steering and follow-ups, which the supervisor records as it queues
  them (``steering_queued``, ``task_queued``): the record keeps those not yet taken, and a
  host that takes the session up queues them again.

:meth:`TaskMachine.next_step` answers "what now?" with one :data:`Step`. A step that starts
something (a task, a turn, an attempt, a compaction, the end) is issued once: until the
record that confirms it is observed the machine answers :class:`Wait`, so a caller that asks
again never does the work twice. The caller carries each step out by emitting outputs — and
the machine learns the result by observing them, exactly as :func:`fold` would.

Invariants, each kept on every path (``tests/test_task_machine.py`` checks them):

1. Recorded state changes only in :meth:`TaskMachine.observe`; ``fold(trace[:k])`` equals the
   live machine's :meth:`~TaskMachine.recorded` state after the record with ``seq`` k (a
   ``rewind`` is folded by leaving out what it cut, and a session that rewinds replaces
   its live machine with that fold: R-FORK-2).
2. A task ends with exactly one ``task_end``; after it no step of that task is issued.
3. A new attempt or turn is issued only once every tool call of the current attempt has its
   result (R-RUN-4, R-RETRY-4).
4. An interrupt ends the running task and drops the queued ones; an interrupt between two
   tasks starts none (R-ABORT-1, R-STEER-6).
5. An overflow is answered by at most one compaction per turn (R-COMPACT-9); an automatic
   compaction is tried at most once before each turn (R-COMPACT-7: the next trigger tries
   again).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Literal, assert_never

import attrs

from greenroom.protocols.content import TextBlock, ToolCallBlock, UserContent
from greenroom.protocols.guards import LoopGuard
from greenroom.protocols.history import live_records
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
    CompactionReason,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    Rewind,
    SteeringQueuedOutput,
    TaskEnd,
    TaskQueuedOutput,
    TaskQueueDropped,
    TaskStart,
    TaskStatus,
    TokenUsageOutput,
    ToolCallOutput,
    ToolHook,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.retry import decide_retry
from greenroom.protocols.stream import ModelError, TokenUsage
from greenroom.protocols.structured import FINAL_ANSWER, AnswerCheck, repair_note
from greenroom.protocols.trace import cut_to_fit, input_size

__all__ = [
    "BeginAttempt",
    "BeginTurn",
    "CallHook",
    "Compact",
    "EndTask",
    "Finish",
    "HookName",
    "Phase",
    "RecordedState",
    "StartTask",
    "Step",
    "TaskKind",
    "TaskLimits",
    "TaskMachine",
    "TaskRecord",
    "Wait",
    "fold",
]

TaskKind = Literal["task", "compaction"]
"""``task``: a prompt and its turns (``task_start`` … ``task_end``); ``compaction``: a
manual compaction on its own (``compaction_begin`` … ``compaction_end``, no task records)."""

HookName = Literal["after_tool_results", "on_stop"]


class Phase(enum.Enum):
    """Where the session's work stands, as its trace says."""

    IDLE = "idle"
    """No task is open."""
    STARTED = "started"
    """A task is open and its next turn has not begun (its first, or the next after a
    compaction or a finished turn)."""
    MODEL = "model"
    """An attempt streams: ``request_begin`` without its ``request_end``."""
    TOOLS = "tools"
    """The attempt ended; some of its tool calls have no result yet."""
    TURN_DONE = "turn_done"
    """The attempt ended ``ok`` and every call has its result."""
    RETRY = "retry"
    """The attempt failed and will be tried again after ``retry_in_ms`` (its calls are
    terminal)."""
    FAILED = "failed"
    """The attempt failed for good (or it overflowed the context): the turn is over, and
    what comes next depends on the failure."""
    COMPACTING = "compacting"
    """``compaction_begin`` without its ``compaction_end``."""


@attrs.frozen(kw_only=True, slots=True)
class TaskLimits:
    """The settings the machine decides by, taken from the session's settings and hooks
    when a task starts."""

    max_turns: int = -1
    max_context_length: int = 128_000
    max_session_turns: int = -1
    loop_repeat_threshold: int = 3
    loop_no_progress_threshold: int = 5
    has_stop_hook: bool = False
    max_stop_continuations: int = 1
    has_results_hook: bool = False
    wait_for_children: bool = False
    """A subagent's task (R-TREE-2): it does not end while background children of its
    session run — their answers arrive as steering, and its answer is its last message
    after them. A root's task ends; its children's answers come as follow-ups."""
    largest_steering: int | None = None
    """The most bytes of input (:func:`~greenroom.protocols.trace.input_size`, with the
    ids it names) one ``user_msg`` of steering may hold: what the session's trace carries
    in one record (a cluster's NATS server), or None where a record has no limit."""


@attrs.frozen(kw_only=True, slots=True)
class _Steering:
    """One input queued as steering: its blocks, the ``steering_queued`` that recorded it
    (a user's), the task a background child's answer becomes when no turn takes it
    (R-TREE-2), and the bytes it adds to the ``user_msg`` that delivers it."""

    content: tuple[UserContent, ...]
    steering_id: str | None
    follow_up: Any = attrs.field(eq=False)
    size: int


def _steering_of(
    content: Iterable[UserContent], steering_id: str | None, follow_up: Any
) -> _Steering:
    blocks = tuple(content)
    # A steering_ids entry in the record: the id, its quotes and a comma.
    size = input_size(blocks) + (len(steering_id) + 3 if steering_id is not None else 0)
    return _Steering(content=blocks, steering_id=steering_id, follow_up=follow_up, size=size)


def _without_answers(queued: list[_Steering] | None) -> list[_Steering] | None:
    """``queued`` without the tasks the children's answers in it would become."""
    if not queued:
        return queued
    return [attrs.evolve(s, follow_up=None) for s in queued]


def _hook_steering(answer: str, limits: TaskLimits) -> tuple[UserContent, ...]:
    """An ``on_stop`` hook's answer as steering, cut (marked) to what one record of the
    session's trace carries: it alone is one ``user_msg``, which in a cluster stopped the
    session on its host when NATS could not carry it (R-SEC-9, R-CLUSTER-1)."""
    return (TextBlock(text=cut_to_fit(answer, limits.largest_steering, None)),)


def _fitting(queued: list[_Steering], most: int | None) -> int:
    """How many of ``queued`` (at least one) one ``user_msg`` takes, in order, within
    ``most`` bytes. Each input alone fits (the session refuses a larger one when it is
    given), but several merged may not: a record the trace cannot carry stopped the
    session on its host, so the rest wait, in order, for the next input assembly."""
    if most is None:
        return len(queued)
    total = 0
    for taken, piece in enumerate(queued):
        total += piece.size
        if taken and total > most:
            return taken
    return len(queued)


# -- steps ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True, slots=True)
class StartTask:
    """Start the next queued task: for ``kind`` ``task``, record its prompt and
    ``task_start``; for ``compaction``, start the manual compaction."""

    task: Any = attrs.field(eq=False)
    kind: TaskKind


@attrs.frozen(kw_only=True, slots=True)
class Compact:
    """Compact the context now (``compaction_begin`` … ``compaction_end``)."""

    reason: CompactionReason


@attrs.frozen(kw_only=True, slots=True)
class BeginTurn:
    """Begin turn ``turn`` (attempt 1). ``steering`` is the input queued since the last
    input assembly: record it as one ``user_msg`` of kind ``steering`` first (R-STEER-2),
    unless it is empty; that ``user_msg`` names ``steering_ids``, the recorded
    ``steering_queued`` it delivers. ``turn`` repeats the current turn after an overflow
    compaction (R-COMPACT-9)."""

    turn: int
    steering: tuple[UserContent, ...]
    steering_ids: tuple[str, ...] = ()


@attrs.frozen(kw_only=True, slots=True)
class BeginAttempt:
    """Try the turn's request again as attempt ``attempt`` after ``delay_ms`` (the wait
    announced in the failed attempt's ``request_end``: R-RETRY-3)."""

    attempt: int
    delay_ms: int


@attrs.frozen(kw_only=True, slots=True)
class CallHook:
    """Call the host's hook ``hook`` and report its answer with
    :meth:`TaskMachine.hook_answered` (``on_stop``: a non-empty text continues the task
    as steering; ``after_tool_results``: the answer is ignored)."""

    hook: HookName
    continuations: int


@attrs.frozen(kw_only=True, slots=True)
class EndTask:
    """End the task with ``status``: settle whatever is in flight (for ``aborted``,
    with the ``abort`` record: R-ABORT-1..3) and record ``task_end``. For a compaction
    task, end the compaction ``failed`` with ``message`` instead (no ``task_end``)."""

    status: TaskStatus
    message: str | None


@attrs.frozen(kw_only=True, slots=True)
class Wait:
    """Nothing to do until something happens (an output, a live input)."""


@attrs.frozen(kw_only=True, slots=True)
class Finish:
    """No task is open and none is queued: the session goes idle."""


Step = StartTask | Compact | BeginTurn | BeginAttempt | CallHook | EndTask | Wait | Finish

_WAIT = Wait()
_FINISH = Finish()
_NO_USAGE = TokenUsage()
_NOTHING_SPENT = TokenUsage(cost_usd=0.0)
# One shared empty set: every ``frozenset()`` call makes a new 216-byte object, and an idle
# session's record holds three of them.
_NO_NAMES: frozenset[str] = frozenset()
"""A new task's usage: no tokens yet, and no cost (its first unpriced request makes the
sum unknown)."""


# -- recorded state ---------------------------------------------------------------------


@attrs.frozen(kw_only=True, slots=True)
class RecordedState:
    """The machine's state as the trace determines it (invariant 1): what :func:`fold`
    rebuilds and the live run keeps identically.

    ``turn_calls`` are the tool calls of the current attempt (call order) and
    ``turn_call_seqs`` the ``seq`` of each one's ``model_msg`` (what its idempotency key
    is derived from: R-EFFECT-1), ``turn_errors`` whether each result so far is an error,
    by call id, ``allowed`` the calls allowed and still without a result, ``in_doubt``
    those of them recorded in doubt and not yet resolved (R-EFFECT-2), ``rewrites`` the
    arguments a ``before_tool`` hook rewrote calls of the attempt to (R-HOOK-2), by call id;
    ``pending_people`` the ``approval_request`` records that wait for a person
    (R-HITL-1)."""

    phase: Phase
    run_id: str | None
    kind: TaskKind | None
    turn: int
    attempt: int
    usage: TokenUsage
    retry_in_ms: int | None
    failure: tuple[str, str | None] | None
    overflow_compacted: bool
    compacted_before_turn: bool
    rerun_turn: bool
    compaction_reason: CompactionReason | None
    turn_calls: tuple[str, ...]
    turn_call_seqs: tuple[int | None, ...]
    turn_errors: tuple[tuple[str, bool], ...]
    allowed: frozenset[str]
    in_doubt: frozenset[str]
    rewrites: tuple[tuple[str, dict[str, Any]], ...]
    pending_people: tuple[ApprovalRequest, ...]
    loop_reason: str | None
    loop_streaks: tuple[tuple[str, int], ...]
    loop_no_progress: int
    session_turns: int
    last_request_total: int | None
    auth_locked: str | None
    session_rules: frozenset[str]
    last_status: TaskStatus | None
    answer: dict[str, Any] | None
    answer_failures: int
    queued: tuple[str, ...]
    steering: tuple[str, ...]



class TaskRecord:
    """The session's work as its trace records it: a fold of the traced outputs
    (invariant 1). Its state changes only in :meth:`observe`, so :func:`fold` rebuilds it
    exactly; the loop guard decides by ``limits`` (the same for the live run and a fold)."""

    __slots__ = (
        "_guard",
        "_limits",
        "_results",
        "aborting",
        "allowed",
        "answers",
        "attempt",
        "attempt_aborted",
        "auth_locked",
        "call_seqs",
        "calls",
        "compacted_before_turn",
        "compaction_reason",
        "failure",
        "in_doubt",
        "kind",
        "last_request_total",
        "last_status",
        "loop_reason",
        "overflow_compacted",
        "pending_people",
        "phase",
        "queued",
        "request_ok",
        "rerun_turn",
        "retry_in_ms",
        "rewrites",
        "run_id",
        "session_rules",
        "session_turns",
        "steering",
        "turn",
        "unstarted",
        "usage",
    )

    def __init__(self, limits: TaskLimits) -> None:
        self._limits = limits
        self.phase = Phase.IDLE
        self.run_id: str | None = None
        self.kind: TaskKind | None = None
        self.turn = 0
        self.attempt = 0
        self.usage = _NO_USAGE
        self.retry_in_ms: int | None = None
        self.failure: tuple[str, str | None] | None = None
        """``(request status, message)`` of the attempt that failed for good."""
        self.overflow_compacted = False
        self.compacted_before_turn = False
        self.rerun_turn = False
        self.compaction_reason: CompactionReason | None = None
        # An idle session keeps one of these (thousands per host): containers are
        # immutable and shared until a task fills them.
        self.calls: tuple[ToolCallBlock, ...] = ()
        self.call_seqs: tuple[int | None, ...] = ()
        """The ``seq`` of each call's ``model_msg``, in the order of :attr:`calls`."""
        self._results: dict[str, bool] | None = None
        self.request_ok = False
        self.aborting = False
        """The open task's ``abort`` is recorded; its ``task_end`` is not yet."""
        self.attempt_aborted = False
        """The current attempt's ``request_end`` is recorded ``aborted``: the task's
        ``abort`` follows (the phase stays :attr:`Phase.MODEL` until it does)."""
        self.allowed: frozenset[str] = _NO_NAMES
        self.in_doubt: frozenset[str] = _NO_NAMES
        """Allowed calls recorded in doubt (``call_in_doubt``) and not resolved yet."""
        self.rewrites: dict[str, dict[str, Any]] | None = None
        """The arguments a ``before_tool`` hook rewrote calls of the attempt to, by call id:
        what was approved and runs, also when a host that takes the task up runs it again."""
        self.pending_people: tuple[ApprovalRequest, ...] = ()
        self.loop_reason: str | None = None
        self._guard: LoopGuard | None = None
        self.session_turns = 0
        self.last_request_total: int | None = None
        self.auth_locked: str | None = None
        self.session_rules: frozenset[str] = _NO_NAMES
        self.last_status: TaskStatus | None = None
        self.answers: AnswerCheck | None = None
        """The answers of an open task that requires an output schema (R-OUT-1)."""
        self.unstarted: UserMsg | None = None
        """The last prompt, while no ``task_start`` (nor anything else) follows it: a run
        accepted whose task its host had not started when it stopped."""
        self.queued: tuple[TaskQueuedOutput, ...] = ()
        """The follow-ups recorded as queued (``task_queued``) that no prompt has started
        and nothing has dropped, in order: what a host that takes the session up queues
        again (R-STEER-6). A task that ends on an auth failure drops them, as the live
        queue is dropped (R-RETRY-6)."""
        self.steering: tuple[SteeringQueuedOutput, ...] = ()
        """The user's steering recorded as queued (``steering_queued``) for the open (or
        starting) task that no ``user_msg`` has delivered yet, in order: what a host that
        takes the task up queues again (R-STEER-1). The task's end drops it (R-STEER-5)."""

    def configure(self, limits: TaskLimits) -> None:
        """Decide the loop guard of the next task by ``limits``."""
        self._limits = limits

    def _new_guard(self) -> LoopGuard:
        limits = self._limits
        return LoopGuard(
            repeat_threshold=limits.loop_repeat_threshold,
            no_progress_threshold=limits.loop_no_progress_threshold,
        )

    def unfinished_calls(self) -> list[str]:
        """The calls of the current attempt without a result, in call order."""
        results = self._results or {}
        return [c.id for c in self.calls if c.id not in results]

    def call_seq(self, call_id: str) -> int | None:
        """The ``seq`` of the ``model_msg`` of the current attempt's call ``call_id``
        (None for a call the trace does not hold)."""
        for call, seq in zip(self.calls, self.call_seqs, strict=True):
            if call.id == call_id:
                return seq
        return None

    def waits_for_person(self, call_id: str) -> bool:
        """Whether ``call_id`` is in doubt and waits for a person to say what became of
        it: it runs nothing meanwhile (R-EFFECT-2, R-HITL-3)."""
        if call_id not in self.in_doubt:
            return False
        request = self.pending(call_id)
        return request is not None and request.kind == "in_doubt"

    def state(self) -> RecordedState:
        """The recorded state, as a value."""
        return RecordedState(
            phase=self.phase,
            run_id=self.run_id,
            kind=self.kind,
            turn=self.turn,
            attempt=self.attempt,
            usage=self.usage,
            retry_in_ms=self.retry_in_ms,
            failure=self.failure,
            overflow_compacted=self.overflow_compacted,
            compacted_before_turn=self.compacted_before_turn,
            rerun_turn=self.rerun_turn,
            compaction_reason=self.compaction_reason,
            turn_calls=tuple(c.id for c in self.calls),
            turn_call_seqs=self.call_seqs,
            turn_errors=tuple(sorted((self._results or {}).items())),
            allowed=self.allowed,
            in_doubt=self.in_doubt,
            rewrites=tuple((self.rewrites or {}).items()),
            pending_people=self.pending_people,
            loop_reason=self.loop_reason,
            loop_streaks=self._guard.streaks if self._guard is not None else (),
            loop_no_progress=self._guard.no_progress if self._guard is not None else 0,
            session_turns=self.session_turns,
            last_request_total=self.last_request_total,
            auth_locked=self.auth_locked,
            session_rules=frozenset(self.session_rules),
            last_status=self.last_status,
            answer=self.answers.answer if self.answers is not None else None,
            answer_failures=self.answers.failures if self.answers is not None else 0,
            queued=tuple(q.queue_id for q in self.queued),
            steering=tuple(s.steering_id for s in self.steering),
        )

    def observe(self, output: Output) -> None:
        """Take one traced output into account. Live-only outputs are ignored."""
        match output:
            case ToolCallOutput():
                self._call_finished(output)
            case ModelMsg():
                block = output.block
                if isinstance(block, ToolCallBlock) and self.phase is Phase.MODEL:
                    self.calls = (*self.calls, block)
                    self.call_seqs = (*self.call_seqs, output.seq)
                elif self.answers is not None and isinstance(block, TextBlock):
                    self.answers.text(block)
            case TokenUsageOutput():
                self.usage = self.usage + output.request
                self.last_request_total = output.request.total
            case RequestBegin():
                self._request_begun(output)
            case RequestEnd():
                self._request_ended(output)
            case ApprovalRequest():
                self._answered(output.call_id)
                self.pending_people = (*self.pending_people, output)
            case ApprovalDecision():
                self._answered(output.call_id)
                if output.decision == "allow":
                    self.allowed = self.allowed | {output.call_id}
                if output.remember:
                    self.session_rules = self.session_rules | {output.tool}
            case CallInDoubt():
                if output.call_id in self.allowed:
                    self.in_doubt = self.in_doubt | {output.call_id}
            case CallResolved():
                # Its question (if a person was asked) is answered; a rerun makes it a
                # running call again, any other outcome's result follows.
                self._answered(output.call_id)
                self.in_doubt = self.in_doubt - {output.call_id}
            case TaskStart():
                self.start(output.run_id, "task", output.output_schema)
                self.unstarted = None
            case CompactionBegin():
                self.unstarted = None
                self._compaction_begun(output)
            case CompactionEnd():
                self._compaction_ended(output)
            case TaskEnd():
                if output.status == "auth":
                    self.auth_locked = output.message or "authentication failed"
                    self.queued = ()
                self.end(output.status)
                self.unstarted = None
            case UserMsg():
                # A prompt's task_start follows (R-TRACE-3), steering's request_begin.
                if output.kind == "prompt" and self.run_id is None:
                    self.unstarted = output
                if output.queued_id is not None:
                    self._unqueue((output.queued_id,))
                if output.steering_ids and self.steering:
                    taken = output.steering_ids
                    self.steering = tuple(s for s in self.steering if s.steering_id not in taken)
            case TaskQueuedOutput():
                # Recorded again after a compaction started the next trace file (one id,
                # one follow-up): it keeps its place among those recorded again.
                self._unqueue((output.queue_id,))
                self.queued = (*self.queued, output)
            case TaskQueueDropped():
                self._unqueue(output.queue_ids)
            case SteeringQueuedOutput():
                # Recorded again after a compaction started the next trace file: one id,
                # one steering, in its place among those recorded again.
                kept = tuple(s for s in self.steering if s.steering_id != output.steering_id)
                self.steering = (*kept, output)
            case Abort():
                self.aborting = True  # its task_end follows
            case ToolHook():
                # A deny or a replacement shows in the decision or the result that follows;
                # a rewrite only here, and the call runs with it (R-HOOK-2).
                if output.action == "rewrite" and output.arguments is not None:
                    self.rewrites = {**(self.rewrites or {}), output.call_id: output.arguments}
            case Rewind():
                self.unstarted = None  # fold() leaves out what a rewind cut (live_records)
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                pass  # live only
            case _:
                assert_never(output)

    def _unqueue(self, queue_ids: tuple[str, ...]) -> None:
        if self.queued:
            self.queued = tuple(q for q in self.queued if q.queue_id not in queue_ids)

    def start(
        self, run_id: str, kind: TaskKind, output_schema: dict[str, Any] | None = None
    ) -> None:
        """A task opens (its ``task_start``, or a manual compaction's begin); its answers
        are held to ``output_schema`` when it has one (R-OUT-1). Steering recorded for
        another task is not this one's: its host stopped before that task started, and
        the task went with it."""
        if self.steering:
            self.steering = tuple(s for s in self.steering if s.run_id == run_id)
        self.phase = Phase.STARTED
        self.run_id = run_id
        self.kind = kind
        self.turn = 0
        self.attempt = 0
        self.usage = _NOTHING_SPENT
        self.retry_in_ms = None
        self.failure = None
        self.overflow_compacted = False
        self.compacted_before_turn = False
        self.rerun_turn = False
        self.calls = ()
        self.call_seqs = ()
        self._results = None
        self.request_ok = False
        self.allowed = _NO_NAMES
        self.in_doubt = _NO_NAMES
        self.rewrites = None
        self.pending_people = ()
        self.loop_reason = None
        self._guard = None
        self.last_status = None
        self.answers = AnswerCheck(output_schema) if output_schema is not None else None

    def end(self, status: TaskStatus | None) -> None:
        """The open task is over (``task_end``, or a manual compaction's end): steering
        it had not taken goes with it (R-STEER-5)."""
        self.steering = ()
        self.phase = Phase.IDLE
        self.run_id = None
        self.kind = None
        self.last_status = status
        self.calls = ()
        self.call_seqs = ()
        self._results = None
        self._guard = None
        self.request_ok = False
        self.aborting = False
        self.attempt_aborted = False
        self.allowed = _NO_NAMES
        self.in_doubt = _NO_NAMES
        self.rewrites = None
        self.pending_people = ()
        self.retry_in_ms = None
        self.failure = None
        self.compaction_reason = None
        self.compacted_before_turn = False
        self.rerun_turn = False
        self.answers = None

    def _request_begun(self, output: RequestBegin) -> None:
        if output.turn != self.turn:
            # A new turn (a rerun after an overflow keeps its number, R-COMPACT-9).
            self.overflow_compacted = False
        self.turn = output.turn
        self.attempt = output.attempt
        self.phase = Phase.MODEL
        self.retry_in_ms = None
        self.failure = None
        self.compacted_before_turn = False
        self.rerun_turn = False
        self.calls = ()
        self.call_seqs = ()
        self._results = {}
        self.request_ok = False
        self.attempt_aborted = False
        self.allowed = _NO_NAMES
        self.in_doubt = _NO_NAMES
        self.rewrites = None
        self.pending_people = ()
        if self.answers is not None:
            self.answers.begin_attempt()

    def _request_ended(self, output: RequestEnd) -> None:
        self.attempt_aborted = output.status == "aborted"
        if output.status == "ok":
            self.request_ok = True
            self.session_turns += 1
            if self.answers is not None:
                self.answers.message_ended(with_calls=bool(self.calls))
        elif output.status == "aborted":
            return  # the abort's task_end follows
        elif output.retry_in_ms is not None:
            self.retry_in_ms = output.retry_in_ms
        else:
            self.failure = (output.status, output.error_message)
        self.phase = Phase.TOOLS
        self._calls_settled()

    def _answered(self, call_id: str) -> None:
        if any(r.call_id == call_id for r in self.pending_people):
            self.pending_people = tuple(r for r in self.pending_people if r.call_id != call_id)

    def pending(self, call_id: str) -> ApprovalRequest | None:
        """The request of ``call_id`` that waits for a person, if any."""
        for request in self.pending_people:
            if request.call_id == call_id:
                return request
        return None

    def _call_finished(self, output: ToolCallOutput) -> None:
        self._answered(output.call_id)
        if self.answers is not None and output.tool == FINAL_ANSWER and output.status in (
            "ok", "error"
        ):
            for call in self.calls:
                if call.id == output.call_id:
                    self.answers.call_result(call, ok=output.status == "ok")
        if output.call_id in self.allowed:
            self.allowed = self.allowed - {output.call_id}
            self.in_doubt = self.in_doubt - {output.call_id}
        if self._results is not None and any(c.id == output.call_id for c in self.calls):
            self._results[output.call_id] = output.is_error
            if self.phase is Phase.TOOLS:
                self._calls_settled()

    def _calls_settled(self) -> None:
        """After a ``request_end`` or a result: once every call of the attempt has its
        result, the turn (or the failed attempt) is over."""
        if self.unfinished_calls():
            return
        if self.request_ok:
            self.phase = Phase.TURN_DONE
            if self.calls:
                # R-GUARD-1, once per turn with calls.
                if self._guard is None:
                    self._guard = self._new_guard()
                results = self._results or {}
                self.loop_reason = self._guard.observe_turn(
                    self.calls, (results[c.id] for c in self.calls)
                )
        elif self.retry_in_ms is not None:
            self.phase = Phase.RETRY
        else:
            self.phase = Phase.FAILED

    def _compaction_begun(self, output: CompactionBegin) -> None:
        if self.run_id is None:
            self.start(output.run_id, "compaction")
        self.phase = Phase.COMPACTING
        self.compaction_reason = output.reason
        if output.reason == "overflow":
            self.overflow_compacted = True

    def _compaction_ended(self, output: CompactionEnd) -> None:
        if self.run_id is None:
            # The first record of a trace file that a compaction started, read on its own
            # (R-COMPACT-8): the task that compacted goes on here, held to its schema,
            # with the turns, tokens and invalid answers it had (R-RUN-6, R-RUN-7, R-OUT-1).
            self.start(output.run_id, "task", output.output_schema)
            if self.answers is not None:
                self.answers.carry(output.answer_failures)
            self.turn = output.turn
            self.usage = self.usage if output.usage is None else output.usage
        reason = self.compaction_reason
        self.compaction_reason = None
        if output.session_rules:
            # A file a compaction started is read on its own: the rules it carries are
            # the session's so far (R-APPROVE-4), however long ago they were decided.
            self.session_rules = self.session_rules | set(output.session_rules)
        if output.status == "ok":
            self.session_turns = 0
            self.last_request_total = None
        elif output.error_kind == "auth":
            self.auth_locked = output.error_message or "authentication failed"
        if self.kind == "compaction":
            self.end(None)
            return
        if reason == "overflow":
            if output.status == "ok":
                # R-COMPACT-9: the same turn runs again from attempt 1.
                self.phase = Phase.STARTED
                self.rerun_turn = True
                self.failure = None
            else:
                self.phase = Phase.FAILED
                if self.auth_locked is not None:
                    self.failure = ("auth", self.auth_locked)
                elif self.failure is not None:
                    self.failure = _compaction_failed(self.failure, output.error_message)
            return
        self.phase = Phase.STARTED
        self.compacted_before_turn = True
        if output.status != "ok" and output.error_kind == "auth":
            self.phase = Phase.FAILED
            self.failure = ("auth", self.auth_locked)


def _compaction_failed(
    failure: tuple[str, str | None], error: str | None
) -> tuple[str, str | None]:
    """The failure of a turn whose overflow compaction failed with ``error``: the task's
    end says why the turn could not go on, not only that it overflowed."""
    if not error:
        return failure
    said = failure[1] or "the context overflowed"
    return failure[0], f"{said}; compacting the context failed: {error}"


class TaskMachine:
    """The work of one session: its :class:`TaskRecord` (what the trace says) and the live
    inputs, and the decision of what to do next (see the module docstring). One per
    session; its recorded state continues across tasks (the session's turns, the auth
    lock, its rules)."""

    __slots__ = (
        "_budget_message",
        "_children",
        "_fail_message",
        "_hook_answer",
        "_hook_pending",
        "_interrupt",
        "_issued",
        "_limits",
        "_queued",
        "_steering",
        "_stop_continuations",
        "_turn_hooked",
        "record",
    )

    def __init__(self, limits: TaskLimits | None = None) -> None:
        self._limits = limits or TaskLimits()
        self.record = TaskRecord(self._limits)
        """The recorded state (invariant 1)."""
        self._queued: list[tuple[Any, TaskKind]] | None = None
        self._steering: list[_Steering] | None = None
        self._interrupt: str | None = None
        self._fail_message: str | None = None
        self._budget_message: str | None = None
        self._issued: Step | None = None
        self._hook_pending = False
        self._hook_answer: str | None = None
        self._turn_hooked = False
        self._stop_continuations = 0
        self._children = 0

    # -- reading --------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Where the work stands (recorded)."""
        return self.record.phase

    @property
    def run_id(self) -> str | None:
        """The open task's run id; None when idle."""
        return self.record.run_id

    @property
    def kind(self) -> TaskKind | None:
        """The open task's kind; None when idle."""
        return self.record.kind

    @property
    def turn(self) -> int:
        """The open task's turn (0 before its first request)."""
        return self.record.turn

    @property
    def usage(self) -> TokenUsage:
        """The open task's token usage so far (the last task's once it ended)."""
        return self.record.usage

    @property
    def auth_locked(self) -> str | None:
        """Why the session refuses new tasks after an auth failure (R-RETRY-6), or None."""
        return self.record.auth_locked

    @property
    def busy(self) -> bool:
        """Whether a task is open or queued."""
        return self.record.run_id is not None or bool(self._queued)

    @property
    def has_queued_tasks(self) -> bool:
        """Whether tasks wait behind the open one (R-STEER-6)."""
        return bool(self._queued)

    @property
    def queued_tasks(self) -> tuple[Any, ...]:
        """The tasks that wait behind the open one, in order (R-STEER-6)."""
        return tuple(task for task, _ in self._queued or ())

    @property
    def stopping(self) -> bool:
        """Whether the open task was told to stop (an interrupt, a failure or a budget)."""
        stops = (self._interrupt, self._fail_message, self._budget_message)
        return stops != (None, None, None)

    @property
    def takes_steering(self) -> bool:
        """Whether steering queued now reaches the open task: a task (not a manual
        compaction) is open or starting, and it is neither told to stop nor ending."""
        if isinstance(self._issued, StartTask):
            return self._issued.kind == "task"  # its first input assembly takes it
        return (
            self.record.run_id is not None
            and self.record.kind == "task"
            and not self.stopping
            and not isinstance(self._issued, EndTask)
        )

    @property
    def steering_queued(self) -> bool:
        """Whether steering waits for the open task's next input assembly."""
        return bool(self._steering)

    @property
    def stop_reason(self) -> str | None:
        """Why the open task was told to stop, if it was."""
        return self._interrupt or self._fail_message or self._budget_message

    @property
    def waiting_for(
        self,
    ) -> Literal["model", "tools", "people", "compaction", "hook", "children"] | None:
        """What the open task waits for now, if anything: the model (an attempt streams or
        its retry is due), tools (calls run), people (only approvals that a person must
        answer are open), a compaction, a hook, or background children (a subagent's
        answered task holds for them: :attr:`TaskLimits.wait_for_children`)."""
        if self._hook_pending:
            return "hook"
        record = self.record
        phase = record.phase
        if phase is Phase.TURN_DONE and self._holds_for_children():
            return "children"
        if phase is Phase.MODEL or phase is Phase.RETRY:
            return "model"
        if phase is Phase.COMPACTING:
            return "compaction"
        if phase is Phase.TOOLS:
            # The calls not yet asked wait behind the one a person is asked about
            # (approvals are asked one at a time); an allowed call is a tool running —
            # or, in doubt, a check asking about it — unless a person is asked what
            # became of it (R-EFFECT-2).
            unfinished = record.unfinished_calls()
            if record.pending_people and not any(
                c in record.allowed and not record.waits_for_person(c) for c in unfinished
            ):
                return "people"
            return "tools"
        return None

    def allowed_for_session(self, tool: str) -> bool:
        """Whether an earlier ``allow_session`` decision allows ``tool`` (R-APPROVE-4)."""
        return tool in self.record.session_rules

    def compaction_due(self) -> CompactionReason | None:
        """R-COMPACT-2's automatic triggers, as they stand: ``context`` when the last
        request's total reached ``max_context_length``, ``turns`` when the context holds
        ``max_session_turns`` turns."""
        limits = self._limits
        record = self.record
        if 0 < limits.max_context_length <= (record.last_request_total or 0):
            return "context"
        if 0 < limits.max_session_turns <= record.session_turns:
            return "turns"
        return None

    def recorded(self) -> RecordedState:
        """The recorded state (invariant 1)."""
        return self.record.state()

    # -- live inputs ---------------------------------------------------------------------

    def configure(self, limits: TaskLimits) -> None:
        """The limits to decide by from now on (the supervisor passes the session's when
        a task starts)."""
        self._limits = limits
        self.record.configure(limits)

    def queue_task(self, task: Any, kind: TaskKind = "task") -> None:
        """Queue a task to start once the open one has ended (FIFO: R-STEER-6)."""
        self._queued = [*(self._queued or ()), (task, kind)]

    def children_running(self, count: int) -> None:
        """How many background subagents of the session run now (R-TREE-2); the
        supervisor tells the machine before each step."""
        self._children = count

    def _holds_for_children(self) -> bool:
        waits = self._limits.wait_for_children and self._children > 0
        return waits and not self.record.calls and not self._steering

    def hold(self) -> None:
        """The host drains (R-DRAIN-1): the step just issued — a turn's first request,
        or a retry — is not carried out here. The task stays open at this boundary, as
        its trace has it, for whoever takes it up; the steering the turn took is the
        caller's to record."""
        if isinstance(self._issued, BeginTurn | BeginAttempt):
            self._issued = None

    def queue_steering(
        self, content: Iterable[UserContent], follow_up: Any = None, steering_id: str | None = None
    ) -> None:
        """Queue steering for the next input assembly of the open task (R-STEER-1); a
        user's names the ``steering_queued`` that recorded it. A background child's answer
        gives its ``follow_up`` too: queued as a task of its own if the task ends without
        taking the steering (an interrupt: R-TREE-2)."""
        self._steering = [*(self._steering or ()), _steering_of(content, steering_id, follow_up)]

    def interrupt(self, reason: str, *, keep_answers: bool = False) -> None:
        """Interrupt the open task and drop the queued ones (R-ABORT-1, R-STEER-6), and
        the children's answers in its steering unless ``keep_answers`` (a node's own)."""
        self._queued = None
        if not keep_answers:
            self._steering = _without_answers(self._steering)
        if self._open_or_starting() and not self.stopping:
            self._interrupt = reason

    def fail(self, message: str) -> None:
        """The open task cannot go on (its trace cannot be written, or a bug): it ends
        ``failed`` with ``message``; the queued tasks still run."""
        if self._open_or_starting() and not self.stopping:
            self._fail_message = message

    def exceed_budget(self, message: str) -> None:
        """The open task's next request would pass a cost budget (R-SHARE-4): it ends
        ``budget_exceeded`` with ``message``, which names the budget, instead of sending
        it; the queued tasks still run (each meets the budget before its first request).
        The caller has not carried out the step it was given (the request is not sent)."""
        if self._open_or_starting() and not self.stopping:
            self._budget_message = message

    def _open_or_starting(self) -> bool:
        return self.record.run_id is not None or isinstance(self._issued, StartTask)

    def hook_answered(self, answer: str | None) -> None:
        """The hook of the last :class:`CallHook` answered; for ``on_stop`` a non-empty
        ``answer`` continues the task with it as steering."""
        self._hook_pending = False
        issued, self._issued = self._issued, None
        continues = answer is not None and answer.strip()
        if isinstance(issued, CallHook) and issued.hook == "on_stop" and continues:
            self._stop_continuations += 1
            self._hook_answer = answer

    def retry_auth(self) -> None:
        """Unlock the session after an auth failure (R-RETRY-6)."""
        self.record.auth_locked = None

    def recover(self) -> None:
        """The trace ends inside a task (its process stopped): the task is over, as the
        transcript treats it (R-TRACE-4: interrupted). Loading a session calls it; the
        next task starts afresh."""
        if self.record.run_id is not None:
            self.record.end("aborted")

    def abandon(self) -> None:
        """The session's work ended on a failure outside any task's records (a bug in a
        manual compaction, say): nothing issued is awaited any more, and a compaction left
        open is over. A task left open stays so, as in a trace its host stopped in."""
        record = self.record
        if record.run_id is not None and record.kind == "compaction":
            record.end(None)
        self._closed()

    def adopt_unstarted(self) -> bool:
        """Open the task of a prompt its host recorded but stopped before starting (the
        trace ends in it: :attr:`TaskRecord.unstarted`), so that it is taken up like any
        task left open; its ``task_start`` is still to be written. False when there is
        none, or a task is open."""
        record = self.record
        prompt = record.unstarted
        if prompt is None or record.run_id is not None:
            return False
        record.start(prompt.run_id, "task", prompt.output_schema)
        return True

    def plan_failure(self, error: ModelError) -> int | None:
        """The wait to announce in the ``request_end`` of the current attempt, which failed
        with ``error``: the retry policy's (R-RETRY-2), or None when it is not retried."""
        return decide_retry(error, max(1, self.record.attempt)).delay_ms

    # -- the decision ---------------------------------------------------------------------

    def next_step(self) -> Step:
        """What to do now (see the module docstring)."""
        record = self.record
        if record.run_id is None:
            if self._issued is not None:
                return _WAIT
            if self._queued:
                task, kind = self._queued.pop(0)
                self._interrupt = self._fail_message = self._budget_message = None
                self._steering = None  # the steering of a task that ended is not this one's
                return self._issue(StartTask(task=task, kind=kind))
            return _FINISH
        if isinstance(self._issued, EndTask):
            return _WAIT
        if self._interrupt is not None:
            return self._issue(EndTask(status="aborted", message=self._interrupt))
        if self._fail_message is not None:
            return self._issue(EndTask(status="failed", message=self._fail_message))
        if self._budget_message is not None:
            return self._issue(EndTask(status="budget_exceeded", message=self._budget_message))
        if self._issued is not None or self._hook_pending:
            return _WAIT
        phase = record.phase
        if phase is Phase.STARTED:
            return self._next_turn()
        if phase is Phase.TURN_DONE:
            return self._after_turn()
        if phase is Phase.RETRY:
            delay_ms = record.retry_in_ms or 0
            return self._issue(BeginAttempt(attempt=record.attempt + 1, delay_ms=delay_ms))
        if phase is Phase.FAILED:
            return self._after_failure()
        return _WAIT  # MODEL, TOOLS, COMPACTING: the work reports through outputs

    def _issue(self, step: Step) -> Step:
        self._issued = step
        return step

    def _next_turn(self) -> Step:
        record = self.record
        if record.rerun_turn:
            # R-COMPACT-9: the turn that overflowed runs again, from attempt 1.
            return self._issue(self._turn(record.turn))
        limits = self._limits
        if limits.max_turns >= 0 and record.turn >= limits.max_turns:
            return self._issue(
                EndTask(
                    status="max_turns",
                    message=f"stopped after max_turns={limits.max_turns} turns",
                )
            )
        if not record.compacted_before_turn:
            reason = self.compaction_due()
            if reason is not None:
                return self._issue(Compact(reason=reason))
        return self._issue(self._turn(record.turn + 1))

    def _turn(self, turn: int) -> BeginTurn:
        queued = self._steering or []
        count = _fitting(queued, self._limits.largest_steering)
        taken, self._steering = queued[:count], queued[count:] or None
        ids = tuple(s.steering_id for s in taken if s.steering_id is not None)
        blocks = tuple(block for s in taken for block in s.content)
        return BeginTurn(turn=turn, steering=blocks, steering_ids=ids)

    def _after_turn(self) -> Step:
        limits = self._limits
        record = self.record
        answers = record.answers
        if record.calls:
            if limits.has_results_hook and not self._turn_hooked:
                return self._call_hook("after_tool_results")
            # A final_answer call that was taken ends the turn as an answer does (R-OUT-1).
            if answers is None or not answers.answered:
                if record.loop_reason is not None:
                    return self._issue(
                        EndTask(status="loop_detected", message=record.loop_reason)
                    )
                if answers is not None and answers.exhausted:
                    return self._issue(EndTask(status="failed",
                                               message=answers.failure_message()))
                return self._next_turn()
        if self._hook_answer is not None:
            self.queue_steering(_hook_steering(self._hook_answer, limits))
            self._hook_answer = None
        if self._steering:
            return self._next_turn()  # R-STEER-3
        if self._holds_for_children():
            # Not issued: the answer of a child arrives as steering, and the turn goes on.
            return _WAIT
        if (
            limits.has_stop_hook
            and not self._turn_hooked
            and self._stop_continuations < limits.max_stop_continuations
        ):
            return self._call_hook("on_stop")
        return self._answered()

    def _answered(self) -> Step:
        """The model has answered: the task is complete — unless it requires an output
        schema (R-OUT-1) and the answer does not match. The first such answer is sent back
        with its problems (steering, recorded as such); the next one fails the task."""
        answers = self.record.answers
        if answers is None or answers.answered:
            return self._issue(EndTask(status="completed", message=None))
        if answers.exhausted:
            return self._issue(EndTask(status="failed", message=answers.failure_message()))
        self.queue_steering((TextBlock(text=repair_note(answers.problems)),))
        return self._next_turn()

    def _call_hook(self, hook: HookName) -> Step:
        self._turn_hooked = True
        self._hook_pending = True
        return self._issue(CallHook(hook=hook, continuations=self._stop_continuations))

    def _after_failure(self) -> Step:
        record = self.record
        assert record.failure is not None
        status, message = record.failure
        if status == "context_overflow" and not record.overflow_compacted:
            return self._issue(Compact(reason="overflow"))
        if status == "auth":
            return self._issue(EndTask(status="auth", message=message))
        return self._issue(EndTask(status="failed", message=message))

    # -- recorded facts -------------------------------------------------------------------

    def observe(self, output: Output) -> None:
        """Take one traced output into account (invariant 1): the record folds it, and a
        step it confirms is no longer awaited."""
        record = self.record
        turn = record.turn
        self.record.observe(output)
        match output:
            case TaskStart():
                self._opened()
            case CompactionBegin():
                if isinstance(self._issued, StartTask):
                    self._opened()
                self._confirm(Compact)
            case RequestBegin():
                self._confirm(BeginTurn)
                self._confirm(BeginAttempt)
                if output.turn != turn:
                    self._turn_hooked = False
            case TaskEnd():
                if output.status == "auth":
                    self._queued = None  # R-RETRY-6: no task runs on a rejected key
                self._closed()
            case CompactionEnd():
                if record.run_id is None:
                    self._closed()
            case _:
                pass  # nothing awaited: the record alone changes

    def _confirm(self, kind: type[Step]) -> None:
        if isinstance(self._issued, kind):
            self._issued = None

    def _opened(self) -> None:
        self._confirm(StartTask)
        self._turn_hooked = False
        self._stop_continuations = 0
        self._hook_answer = None

    def _closed(self) -> None:
        untaken = [s.follow_up for s in self._steering or () if s.follow_up is not None]
        self._issued = self._steering = self._hook_answer = None
        self._interrupt = self._fail_message = self._budget_message = None
        self._hook_pending = False
        for follow_up in untaken:
            self.queue_task(follow_up)


def fold(records: Iterable[Output], limits: TaskLimits | None = None) -> TaskMachine:
    """A machine that has observed ``records`` (a session's trace, in ``seq`` order):
    its :meth:`~TaskMachine.recorded` state is the live run's at the last record
    (invariant 1). What a ``rewind`` cut is left out
    (:func:`~greenroom.protocols.history.live_records`, R-FORK-2)."""
    machine = TaskMachine(limits)
    for record in live_records(list(records)):
        machine.observe(record)
    return machine
