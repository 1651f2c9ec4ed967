"""Outputs: everything the runtime emits to a host, a trace file or a websocket client.

One frozen class per ``type`` of CONTRACT.md, each a subclass of :class:`Envelope`, which
declares once the fields they all carry: every output has ``session_id`` and ``run_id``;
traced outputs carry the session's ``seq`` (strictly increasing, no gaps within
a session: R-TRACE-1); outputs forwarded from a subagent carry ``origin``, the path of
session ids from the root (R-HOST-4). Live-only outputs (``partial_*``, ``tool_progress``)
have ``seq`` None and never reach a trace.

:data:`Output` is the closed union of the output classes. Code that reacts to each kind
of output dispatches with ``match`` and ends with ``case _: assert_never(output)``, so the
type checker names every dispatcher that does not handle a newly added class.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeAlias, TypeVar, get_args

import attrs

from greenroom.protocols.content import ModelBlock, ToolContent, UserContent
from greenroom.protocols.stream import TokenUsage

RequestStatus = Literal[
    "ok", "failed", "timeout", "malformed", "auth", "context_overflow", "aborted"
]
TaskStatus = Literal[
    "completed", "aborted", "failed", "auth", "max_turns", "loop_detected", "budget_exceeded"
]
ToolStatus = Literal["ok", "error", "denied", "interrupted", "truncated"]
Decision = Literal["allow", "deny"]
DecidedBy = Literal["host", "client", "session_rule", "default", "hook"]
ToolHookName = Literal["before_tool", "after_tool"]
ToolHookActionKind = Literal["deny", "rewrite", "replace", "error"]
PeopleKind = Literal["approval", "question", "in_doubt"]
CompactionReason = Literal["context", "turns", "manual", "overflow"]
ResolvedBy = Literal["check", "person", "note"]
Resolution = Literal["done", "not_done", "rerun", "unknown"]

COMMON_FIELDS = """
    Every output also has:
        type: its JSON ``type`` tag (the class's ``TYPE``).
        session_id: the session that produced it.
        run_id: the task it belongs to (each follow-up task has its own).
        seq: its place in the session's trace, strictly increasing with no gaps
            (R-TRACE-1); None for live-only outputs and before it is traced.
        origin: for an output forwarded from a subagent, the session ids from the root
            session down to the one that produced it (R-HOST-4); else None.
"""


_C = TypeVar("_C", bound=type)


def _documented(cls: _C) -> _C:
    """Appends the fields every output shares to the class docstring, so ``help()`` on
    any output class lists all of its fields."""
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + COMMON_FIELDS
    return cls


@_documented
@attrs.frozen(kw_only=True, slots=True)
class Envelope:
    """The envelope of every output: the fields all of them carry, declared once.

    Each output class inherits it and adds its own fields after these (the JSON puts
    ``type`` first and leaves ``seq`` and ``origin`` out when None). The envelope is no
    output itself: only its subclasses have a ``TYPE`` and a place in :data:`Output`.
    """

    TYPE: ClassVar[str]
    TRACED: ClassVar[bool]
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None

    @property
    def type(self) -> str:
        """The output's JSON ``type``, the same string as the class's ``TYPE``."""
        return self.TYPE


@_documented
@attrs.frozen(kw_only=True, slots=True)
class UserMsg(Envelope):
    """Input from the user: the prompt that starts a task, or steering given while it runs.

    Fields:
        kind: ``prompt`` (starts a task) or ``steering`` (delivered to the running task
            at its next request).
        content: the input blocks, text (``{type: text, text}``) and images
            (``{type: image, path}``), as the model will see them.
        output_schema: a prompt's ``output_schema`` (R-OUT-1), as its ``task_start`` will
            record it: a prompt whose host stopped before its task started is started by
            whoever takes the session up, held to the same schema. Left out when None.
        queued_id: the ``queue_id`` of the ``task_queued`` follow-up this prompt starts
            (R-STEER-6): it is no longer queued. Left out when None.
        steering_ids: the ``steering_id`` of each ``steering_queued`` this steering
            delivers (R-STEER-2): they are no longer queued. Left out when empty (input
            of the host's own, a background child's answer, or a trace written before).
    """

    TYPE: ClassVar[str] = "user_msg"
    TRACED: ClassVar[bool] = True
    kind: Literal["prompt", "steering"]
    content: tuple[UserContent, ...]
    output_schema: dict[str, Any] | None = None
    queued_id: str | None = None
    steering_ids: tuple[str, ...] = ()


QueuedApproval = Literal["people", "deny", "host"]
"""How a queued follow-up's tool calls are decided: by ``people`` (R-HITL), denied
(``deny``: no ``approve`` was given), or by the ``host``'s callback — which a process
that takes the follow-up up after its host stopped does not have: it decides as for a
task whose host stopped (``Host.resume(approve=…)``)."""


@_documented
@attrs.frozen(kw_only=True, slots=True)
class TaskQueuedOutput(Envelope):
    """A follow-up was queued behind the running task (R-STEER-6): recorded so that it
    survives its host. It runs once its ``user_msg`` (naming ``queue_id``) starts it,
    and not at all once a ``task_queue_dropped`` names it. ``run_id`` is the task it was
    queued behind.

    Fields:
        queue_id: names the follow-up in the records that start or drop it.
        content: its input blocks, as for ``user_msg``.
        approve: how its tool calls are decided: ``people``, ``deny`` or ``host``.
        thinking_level: its thinking level, when given.
        output_schema: the JSON Schema its answer must match (R-OUT-1). Left out when None.
        late_steering: true when it is steering that came after its task stopped taking
            steering (R-STEER-1), so that whoever takes the session up still counts it as
            the steering its client sent (R-SEC-9). Left out when false.
    """

    TYPE: ClassVar[str] = "task_queued"
    TRACED: ClassVar[bool] = True
    queue_id: str
    content: tuple[UserContent, ...]
    approve: QueuedApproval = "deny"
    thinking_level: str | None = None
    output_schema: dict[str, Any] | None = None
    late_steering: bool = False


@_documented
@attrs.frozen(kw_only=True, slots=True)
class SteeringQueuedOutput(Envelope):
    """A user's steering was queued for the running task ``run_id`` (R-STEER-1): recorded
    so that it survives its host. The ``user_msg`` of kind ``steering`` that delivers it
    names ``steering_id``; the task's end (``task_end``) drops it undelivered (R-STEER-5).

    Fields:
        steering_id: names the steering in the ``user_msg`` that delivers it.
        content: its input blocks, as for ``user_msg``.
    """

    TYPE: ClassVar[str] = "steering_queued"
    TRACED: ClassVar[bool] = True
    steering_id: str
    content: tuple[UserContent, ...]


@_documented
@attrs.frozen(kw_only=True, slots=True)
class TaskQueueDropped(Envelope):
    """Queued follow-ups will not run (R-ABORT-1, R-STEER-6): an interrupt dropped the
    queue, a follow-up's image was refused, a fork or rewind cut the history, or a new
    task started on a session whose stopped host left them and nobody took them up.

    Fields:
        queue_ids: the ``queue_id`` of each ``task_queued`` dropped.
        reason: why, in words.
    """

    TYPE: ClassVar[str] = "task_queue_dropped"
    TRACED: ClassVar[bool] = True
    queue_ids: tuple[str, ...]
    reason: str | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class TaskStart(Envelope):
    """A task began (R-RUN-1); the first output of every task after its prompt.

    Fields:
        input_seq: the ``seq`` of the ``user_msg`` that started the task (None when the
            prompt was not traced).
        output_schema: the JSON Schema the task's answer must match (R-OUT-1), when the
            run asked for one; recorded so that whoever takes the task up holds its
            answer to it. Left out when None.
    """

    TYPE: ClassVar[str] = "task_start"
    TRACED: ClassVar[bool] = True
    input_seq: int | None
    output_schema: dict[str, Any] | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class RequestBegin(Envelope):
    """One attempt of a model request is about to be sent.

    Fields:
        turn: the task's turn, counted from 1; a turn is one model request and the tool
            calls it makes.
        attempt: which try of the turn's request this is, from 1 (R-RETRY-3).
    """

    TYPE: ClassVar[str] = "request_begin"
    TRACED: ClassVar[bool] = True
    turn: int
    attempt: int


@_documented
@attrs.frozen(kw_only=True, slots=True)
class PartialText(Envelope):
    """A piece of text as the model streams it (live only: never traced).

    The complete block follows as a ``model_msg``; hosts that only want the answer can
    ignore these.

    Fields:
        index: the block's position in the model's message, shared by its pieces.
        text: the new text, to append to what the block's earlier pieces gave.
    """

    TYPE: ClassVar[str] = "partial_text"
    TRACED: ClassVar[bool] = False
    index: int
    text: str


_new = object.__new__
_set_session_id = Envelope.__dict__["session_id"].__set__
_set_run_id = Envelope.__dict__["run_id"].__set__
_set_seq = Envelope.__dict__["seq"].__set__
_set_origin = Envelope.__dict__["origin"].__set__
_set_index = PartialText.__dict__["index"].__set__
_set_text = PartialText.__dict__["text"].__set__


def partial_text(session_id: str, run_id: str, index: int, text: str) -> PartialText:
    """``PartialText(session_id=..., run_id=..., index=..., text=...)`` for the hot path,
    one per streamed token: the same object, made without attrs' ``__init__``, which sets
    each field of a frozen class through ``object.__setattr__`` (twice the cost)."""
    out = _new(PartialText)
    _set_session_id(out, session_id)
    _set_run_id(out, run_id)
    _set_seq(out, None)
    _set_origin(out, None)
    _set_index(out, index)
    _set_text(out, text)
    return out


@_documented
@attrs.frozen(kw_only=True, slots=True)
class PartialThinking(Envelope):
    """A piece of the model's reasoning as it streams (live only: never traced).

    Fields:
        index: the block's position in the model's message, shared by its pieces.
        text: the new reasoning text, to append to the block's earlier pieces.
    """

    TYPE: ClassVar[str] = "partial_thinking"
    TRACED: ClassVar[bool] = False
    index: int
    text: str


@_documented
@attrs.frozen(kw_only=True, slots=True)
class PartialToolCall(Envelope):
    """A fragment of a tool call's JSON arguments as the model streams them (live only).

    Fields:
        index: the block's position in the model's message, shared by its fragments.
        call_id: the tool call's id, the same in its ``model_msg`` and ``tool_call_output``.
        name: the tool the model is calling.
        arguments_delta: the next characters of the arguments' JSON text (not valid JSON
            on its own).
    """

    TYPE: ClassVar[str] = "partial_tool_call"
    TRACED: ClassVar[bool] = False
    index: int
    call_id: str
    name: str
    arguments_delta: str


@_documented
@attrs.frozen(kw_only=True, slots=True)
class ModelMsg(Envelope):
    """One complete block of the model's message: text, thinking or a tool call.

    Fields:
        turn: the turn whose request produced the block.
        block: ``{type: text, text}``, ``{type: thinking, text}`` or ``{type: tool_call,
            id, name, arguments}`` (a :data:`~greenroom.protocols.content.ModelBlock`).
    """

    TYPE: ClassVar[str] = "model_msg"
    TRACED: ClassVar[bool] = True
    turn: int
    block: ModelBlock


@_documented
@attrs.frozen(kw_only=True, slots=True)
class TokenUsageOutput(Envelope):
    """The tokens one model request used, as the provider reported them.

    Fields:
        turn: the turn whose request used them.
        request: ``{input, output, cache_read, cache_write, total, cost_usd}`` for this
            request alone (a :class:`~greenroom.protocols.stream.TokenUsage`); ``cost_usd``
            is its cost in USD at the model's price, null when the price is unknown
            (R-SHARE-3).
    """

    TYPE: ClassVar[str] = "token_usage"
    TRACED: ClassVar[bool] = True
    turn: int
    request: TokenUsage


@_documented
@attrs.frozen(kw_only=True, slots=True)
class RequestEnd(Envelope):
    """One attempt of a model request ended (its stream did; tools may still run).

    Fields:
        turn: the turn of the request.
        status: ``ok``, or why the attempt failed: ``failed``, ``timeout``, ``malformed``,
            ``auth``, ``context_overflow``, ``aborted``.
        attempt: which try of the turn's request this was, from 1.
        retry_in_ms: the wait before the next attempt when the runtime retries (R-RETRY-3),
            else None.
        error_message: what went wrong, for a failed attempt.
        stop_reason: the provider's reason the message ended (``end_turn``, ``tool_use``,
            ``max_tokens``…), for a completed stream.
        response_id: the id the provider gave the response, for a completed stream whose
            provider gave one. Left out when None.
        response_model: the model the provider says answered (often a dated snapshot of
            the one requested, ``claude-sonnet-4-5-20250929`` for ``claude-sonnet-4-5``),
            for a completed stream whose provider named one. Left out when None.
        http_status: the HTTP status the provider answered a failed attempt with (``429``
            for a rate limit that ``status`` calls ``timeout``), when there was one. Left
            out when None.
    """

    TYPE: ClassVar[str] = "request_end"
    TRACED: ClassVar[bool] = True
    turn: int
    status: RequestStatus
    attempt: int
    retry_in_ms: int | None = None
    error_message: str | None = None
    stop_reason: str | None = None
    response_id: str | None = None
    response_model: str | None = None
    http_status: int | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class ApprovalRequest(Envelope):
    """A person is asked about a tool call: to decide it, or (``kind`` ``question``) to
    answer the model's question. The record is the pending state (R-HITL-1): it stays
    pending across restarts, reloads and takeovers until its ``approval_decision``.

    Fields:
        call_id: the tool call's id; the person answers with it.
        tool: the tool's name.
        arguments: the call's arguments, as the model gave them.
        kind: ``approval`` (decide the call), ``question`` (the ``ask_user`` tool: the
            answer is its result) or ``in_doubt`` (did a call that was running when its
            host stopped take effect? ``arguments`` are then the question's: ``question``,
            ``choices``, the call's ``arguments`` and its ``idempotency_key``: R-EFFECT-2).
            Left out of the JSON for ``approval``.
        asked_at: when it was asked (seconds since the epoch); the timeout policy counts
            from it. Left out when None.
    """

    TYPE: ClassVar[str] = "approval_request"
    TRACED: ClassVar[bool] = True
    call_id: str
    tool: str
    arguments: dict[str, Any]
    kind: PeopleKind = "approval"
    asked_at: float | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class ApprovalDecision(Envelope):
    """How a tool call was decided: exactly one per call (R-APPROVE-1).

    Fields:
        call_id: the tool call's id.
        tool: the tool's name.
        decision: ``allow`` or ``deny``.
        by: who decided: ``host`` (the approve callback), ``client`` (a person, through
            the gateway, the API, the CLI or an editor: ``principal`` names them),
            ``session_rule`` (an earlier ``allow_session``), ``default`` (no one could
            answer, or the wait ran out: deny; or a structured task's ``final_answer``,
            which runs nothing: allow) or ``hook`` (a ``before_tool`` hook denied it, or
            failed: the ``tool_hook`` record before says which).
        remember: the decision was ``allow_session``: the tool is allowed without asking
            for the rest of the session (R-APPROVE-4). Left out of the JSON when false.
        principal: who answered, for ``by: client`` (R-HITL-2). Left out when None.
    """

    TYPE: ClassVar[str] = "approval_decision"
    TRACED: ClassVar[bool] = True
    call_id: str
    tool: str
    decision: Decision
    by: DecidedBy
    remember: bool = False
    principal: str | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class ToolHook(Envelope):
    """What a tool hook did to a call (R-HOOK-2); nothing is recorded for a hook that let
    the call (or its result) be.

    Fields:
        call_id: the tool call's id.
        tool: the tool's name.
        hook: ``before_tool`` (before the call is decided) or ``after_tool`` (after it ran,
            before the model sees the result).
        action: ``deny`` (the ``approval_decision`` ``deny`` by ``hook`` follows),
            ``rewrite`` (the call is approved and run with ``arguments``: the
            ``approval_request``, if any, shows them), ``replace`` (the
            ``tool_call_output`` that follows is the hook's content, not the tool's; what
            it replaced is not recorded) or ``error`` (the hook raised, answered nonsense
            or timed out; ``before_tool`` then denied the call, ``after_tool`` kept the
            result).
        arguments: for ``rewrite``, the arguments the call goes on with. Left out when None.
        reason: for ``deny``, the hook's reason; for ``error``, what went wrong. Left out
            when None.
    """

    TYPE: ClassVar[str] = "tool_hook"
    TRACED: ClassVar[bool] = True
    call_id: str
    tool: str
    hook: ToolHookName
    action: ToolHookActionKind
    arguments: dict[str, Any] | None = None
    reason: str | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class ToolProgress(Envelope):
    """A tool's progress note (live only; dropped once the call is terminal: R-TOOL-6).

    Fields:
        call_id: the tool call that reports it.
        tool: the tool's name.
        message: the note the tool gave ``ToolContext.report_progress``.
    """

    TYPE: ClassVar[str] = "tool_progress"
    TRACED: ClassVar[bool] = False
    call_id: str
    tool: str
    message: str


@_documented
@attrs.frozen(kw_only=True, slots=True)
class ToolCallOutput(Envelope):
    """The result of one tool call, in completion order (R-TOOL-3).

    Fields:
        call_id: the tool call's id.
        tool: the tool's name.
        status: ``ok``, ``error`` (the tool raised, timed out or got bad arguments),
            ``denied``, ``interrupted`` or ``truncated`` (the call was cut off by the
            output-token limit and never ran).
        is_error: whether the model is told the call failed (every status but ``ok``).
        content: what the model receives: text and image blocks.
    """

    TYPE: ClassVar[str] = "tool_call_output"
    TRACED: ClassVar[bool] = True
    call_id: str
    tool: str
    status: ToolStatus
    is_error: bool
    content: tuple[ToolContent, ...]


@_documented
@attrs.frozen(kw_only=True, slots=True)
class Abort(Envelope):
    """The task was interrupted (R-ABORT-1); a ``task_end`` with status ``aborted`` follows.

    Fields:
        reason: why, as given to ``interrupt`` (or the host's own reason).
        partial: what the model had produced in the turn in flight.
        message_complete: whether that message was complete, which decides the
            carry-over of the next task (R-ABORT-2), so it can be rebuilt from the trace
            after a restart (R-ABORT-3).
    """

    TYPE: ClassVar[str] = "abort"
    TRACED: ClassVar[bool] = True
    reason: str
    partial: tuple[ModelBlock, ...] = ()
    message_complete: bool = False


@_documented
@attrs.frozen(kw_only=True, slots=True)
class CompactionBegin(Envelope):
    """A compaction of the model context started (R-COMPACT).

    Fields:
        reason: what triggered it: ``context`` (the last request reached
            ``max_context_length``), ``turns`` (``max_session_turns``), ``manual``
            (``session.compact()``) or ``overflow`` (the provider said the prompt is too
            long).
    """

    TYPE: ClassVar[str] = "compaction_begin"
    TRACED: ClassVar[bool] = True
    reason: CompactionReason


@_documented
@attrs.frozen(kw_only=True, slots=True)
class CompactionEnd(Envelope):
    """A compaction ended (R-COMPACT).

    Fields:
        status: ``ok`` or ``failed``.
        attempt: the attempt that ended it, from 1.
        error_message: why it failed, for status ``failed``.
        trace_file: the trace file the new context is written to, for status ``ok``.
        summary: the summary that starts the new context (``summarize`` mode, status
            ``ok``). A successful ``compaction_end`` is the first record of the new trace
            file, so the file alone rebuilds its context (R-COMPACT-8).
        kept_input: a new prompt that was pending when the compaction ran: not
            summarized, it is the first input of the new context.
        error_kind: for status ``failed`` after a model error, its kind (``auth``,
            ``timeout``…); ``auth`` locks the session (R-RETRY-6). Left out when None.
        output_schema: the ``output_schema`` of the task that compacted (R-OUT-1), for
            status ``ok``: the new trace file alone holds the task to it. Left out when
            None.
        session_rules: the tools an ``allow_session`` decision allowed for the rest of the
            session (R-APPROVE-4), sorted, for status ``ok``: the new trace file alone
            keeps them (a trace written before it carried them reads as empty).
        turn: for status ``ok`` in a task, the turns the task had taken (a turn that
            overflowed, to run again, not counted: R-COMPACT-9), and ``usage`` the tokens
            its requests had used, the summary's included: the new trace file alone
            keeps the task's ``max_turns`` count and its ``task_end`` usage (R-RUN-6,
            R-RUN-7). Left out when 0 and None (a trace written before them reads so).
        usage: see ``turn`` (a :class:`~greenroom.protocols.stream.TokenUsage`).
        answer_failures: for status ``ok`` in a task with an ``output_schema``, the invalid
            answers it had had: the new trace file alone keeps the task to its one repair
            round (R-OUT-1). Left out when 0 (a trace written before it reads so).
    """

    TYPE: ClassVar[str] = "compaction_end"
    TRACED: ClassVar[bool] = True
    status: Literal["ok", "failed"]
    attempt: int
    error_message: str | None = None
    trace_file: str | None = None
    summary: str | None = None
    kept_input: tuple[UserContent, ...] = ()
    error_kind: str | None = None
    output_schema: dict[str, Any] | None = None
    session_rules: tuple[str, ...] = ()
    turn: int = 0
    usage: TokenUsage | None = None
    answer_failures: int = 0


@_documented
@attrs.frozen(kw_only=True, slots=True)
class CallInDoubt(Envelope):
    """A tool call that was allowed but has no recorded result when its task was taken up
    — its host was lost, killed or crashed while the call ran or was about to: whether it
    took effect is not known (R-EFFECT-2). A ``call_resolved`` follows, once.

    Fields:
        call_id: the tool call's id.
        tool: the tool's name.
        idempotency_key: the call's key (R-EFFECT-1), the one it was run with: what its
            check, and a person, look the effect up by.
    """

    TYPE: ClassVar[str] = "call_in_doubt"
    TRACED: ClassVar[bool] = True
    call_id: str
    tool: str
    idempotency_key: str


@_documented
@attrs.frozen(kw_only=True, slots=True)
class CallResolved(Envelope):
    """How a call in doubt (``call_in_doubt``) was resolved (R-EFFECT-2): exactly one per
    ``call_in_doubt``, followed by the call's ``tool_call_output`` or, for ``rerun``, by
    the call running once more with the same key.

    Fields:
        call_id: the tool call's id.
        tool: the tool's name.
        by: ``check`` (the tool's ``check`` asked the outside world), ``person`` (someone
            answered the in-doubt question: ``principal`` names them) or ``note`` (nothing
            could tell: the model is told the call was lost and not run again).
        outcome: ``done`` (it took effect), ``not_done`` (it did not; not run again),
            ``rerun`` (it did not, or a person chose so: it runs again) or ``unknown``
            (the note's).
        principal: who answered, for ``by: person``. Left out when None.
        check_error: why the tool's check gave no answer (it raised or ran out of time),
            when it was asked and another resolved the call. Left out when None.
    """

    TYPE: ClassVar[str] = "call_resolved"
    TRACED: ClassVar[bool] = True
    call_id: str
    tool: str
    by: ResolvedBy
    outcome: Resolution
    principal: str | None = None
    check_error: str | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class TaskEnd(Envelope):
    """The task ended: the last output of every task (R-RUN-7).

    Fields:
        status: ``completed``, ``aborted``, ``failed``, ``auth``, ``max_turns``,
            ``loop_detected`` or ``budget_exceeded`` (its next request would have passed
            a cost budget: R-SHARE-4; ``message`` names the budget).
        turns: how many turns the task took.
        usage: the tokens of all its requests added up
            (a :class:`~greenroom.protocols.stream.TokenUsage`), with their ``cost_usd``
            (null when one request's price is unknown).
        wall_ms: how long it ran, in milliseconds.
        message: why it ended other than ``completed``, in words (else None); for a
            task whose answer did not match its ``output_schema``, the problems.
        output: the validated answer, for a ``completed`` task that had an
            ``output_schema`` (R-OUT-1). Left out when None.
    """

    TYPE: ClassVar[str] = "task_end"
    TRACED: ClassVar[bool] = True
    status: TaskStatus
    turns: int
    usage: TokenUsage
    wall_ms: int
    message: str | None = None
    output: dict[str, Any] | None = None


@_documented
@attrs.frozen(kw_only=True, slots=True)
class Rewind(Envelope):
    """The session was rewound to ``to_seq`` (R-FORK-2): its history is again what it
    was at that record, and the records between ``to_seq`` and this one stay in the trace
    behind it, cut from the history (the model context and the task state are folded
    without them). Workspace files are not rewound.

    Fields:
        to_seq: the last record of the history the session continues from (0: none,
            an empty history).
        reason: why, in words (who asked), when given.
    """

    TYPE: ClassVar[str] = "rewind"
    TRACED: ClassVar[bool] = True
    to_seq: int
    reason: str | None = None


Output: TypeAlias = (
    UserMsg
    | TaskStart
    | RequestBegin
    | PartialText
    | PartialThinking
    | PartialToolCall
    | ModelMsg
    | TokenUsageOutput
    | RequestEnd
    | ApprovalRequest
    | ApprovalDecision
    | ToolHook
    | ToolProgress
    | ToolCallOutput
    | Abort
    | CompactionBegin
    | CompactionEnd
    | CallInDoubt
    | CallResolved
    | TaskQueuedOutput
    | TaskQueueDropped
    | SteeringQueuedOutput
    | Rewind
    | TaskEnd
)
"""Every output: the closed union to ``match`` on (exhaustively, ending with
``assert_never``)."""

OUTPUT_CLASSES: tuple[type[Output], ...] = get_args(Output)
"""The classes of :data:`Output`, in the union's order."""
