"""Messages between actors.

Commands are imperatives, events are facts. Every message that crosses an actor boundary
is one of these frozen classes; the supervisor's inbox carries :data:`SupervisorMessage`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from greenroom.protocols.content import ToolCallBlock, ToolContent, UserContent
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.hooks import ToolHookAction
from greenroom.protocols.outputs import Output, ToolStatus
from greenroom.protocols.stream import StreamEvent
from greenroom.protocols.trace import UsageRow

Verdict = Literal["allow", "deny", "allow_session"]


@attrs.frozen(kw_only=True, slots=True)
class StreamBatch:
    """Stream events parsed from one network read of the model request ``request`` (the
    number its :class:`StartAttempt` gave), attempt ``attempt``."""

    attempt: int
    events: list[StreamEvent]
    request: int = 0


@attrs.frozen(kw_only=True, slots=True)
class ApprovalDecided:
    """Broker → supervisor: the verdict on ``call``. ``by`` is ``host`` for the host's callback or
    a client, ``session_rule`` for an earlier "allow for this session", ``default`` for the deny
    given when no one decided (callback raised or timed out, no one to ask), ``hook`` for a
    ``before_tool`` hook's deny (R-HOOK-2). ``hook`` is what that hook did, to be recorded
    first; after a rewrite ``call`` carries the arguments it was decided with (and runs with)."""

    call: ToolCallBlock
    verdict: Verdict
    by: Literal["host", "session_rule", "default", "hook"]
    hook: ToolHookAction | None = None


@attrs.frozen(kw_only=True, slots=True)
class ApprovalAsked:
    """The broker hands this call to people (not a host callback): the supervisor records
    an ``approval_request`` of ``kind`` (the pending state, R-HITL-1), and the answer
    comes back as :class:`PersonAnswered`."""

    call: ToolCallBlock
    kind: Literal["approval", "question"] = "approval"
    hook: ToolHookAction | None = None
    """What a ``before_tool`` hook did first (R-HOOK-2): ``call`` is then as rewritten."""


@attrs.frozen(kw_only=True, slots=True)
class ToolCallFinished:
    """Pool → supervisor: call ``call_id`` is terminal; ``content`` is the result the model sees.
    ``hook`` is what an ``after_tool`` hook did to it, if anything (R-HOOK-2)."""

    call_id: str
    status: ToolStatus
    is_error: bool
    content: tuple[ToolContent, ...]
    hook: ToolHookAction | None = None


@attrs.frozen(kw_only=True, slots=True)
class ToolCallChecked:
    """Pool → supervisor: the ``check`` of call ``call_id``, in doubt, has answered
    (R-EFFECT-2): ``done`` with what it found (``status`` and ``content``: the call's
    result), ``not_done`` (the call runs again), or ``failed`` with ``error`` (the check
    raised or ran out of time, or the tool has none now: another resolves the call).
    ``hook`` is what an ``after_tool`` hook did to what it found, if anything (R-HOOK-2)."""

    call_id: str
    outcome: Literal["done", "not_done", "failed"]
    status: ToolStatus = "ok"
    content: tuple[ToolContent, ...] = ()
    error: str | None = None
    hook: ToolHookAction | None = None


@attrs.frozen(kw_only=True, slots=True)
class ToolProgressed:
    """Pool → supervisor: a progress note of running call ``call_id`` (live only, never traced)."""

    call_id: str
    message: str


@attrs.frozen(kw_only=True, slots=True)
class SteeringQueued:
    """Command to the supervisor: user input for the running task, taken into the next request
    without interrupting it (R-STEER-1). ``recorded`` (an ``InputReceipt``, or None) is
    settled once its record survives the host, or as dropped (see :class:`TaskQueued`)."""

    content: tuple[UserContent, ...]
    recorded: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True, slots=True)
class BackoffSkipped:
    """The host asked to end the current reconnect wait (R-RETRY-5)."""


@attrs.frozen(kw_only=True, slots=True)
class TaskQueued:
    """Command to the supervisor: run ``task`` (a ``TaskInput``; None for a manual
    compaction) after the running one, FIFO (R-STEER-6). The first task of a run reaches
    the supervisor this way too. ``follow_up``: a user's follow-up (``Session.follow_up``),
    which the supervisor records (``task_queued``) so that it survives its host.
    ``recorded`` (an ``InputReceipt``, or None) is settled once the trace store is done
    with that record — written, and in a cluster acknowledged by JetStream — or as
    dropped when the input will never run (its session closed before it was recorded)."""

    task: Any = attrs.field(eq=False)
    kind: Literal["task", "compaction"] = "task"
    follow_up: bool = False
    recorded: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True, slots=True)
class PersonAnswered:
    """A person's answer to a request of the session's open task (R-HITL-2): ``verdict``
    for an approval, ``text`` for a question (``ask_user``). ``by`` is ``client`` with
    ``principal`` naming who, or ``default`` when the wait ran out (R-APPROVE-4).
    ``digest``, when given, must be the call's arguments digest. ``reply`` (a one-shot
    channel's send side, or None) gets None once the answer is taken, else why it was
    refused."""

    call_id: str
    verdict: Verdict | None = None
    text: str | None = None
    by: Literal["client", "default"] = "client"
    principal: str | None = None
    digest: str | None = None
    reply: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True, slots=True)
class QuestionAsked:
    """A running call → the supervisor: the tool asks the session's people a question
    while it runs (an MCP server's elicitation: R-HITL-5), ``arguments`` as a person is
    shown them (``question``, and what else the tool gives: ``requested_schema``,
    ``server``). The supervisor records an ``approval_request`` of kind ``question`` for
    the call, which holds its slot meanwhile (it is not parked: R-HITL-3). ``reply`` (a
    one-shot channel's send side) gets exactly one :class:`QuestionAnswered`: the
    person's answer, a decline, or a cancel when the wait ran out, the call has a
    question open already, or it is not running."""

    call_id: str
    arguments: dict[str, Any]
    reply: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True, slots=True)
class QuestionAnswered:
    """The supervisor → the call that asked (:class:`QuestionAsked`): ``accept`` with the
    person's ``text``, ``decline`` (a person said no: a ``deny`` answer), or ``cancel``
    (nobody answered: the wait ran out, the call or its task ended first)."""

    action: Literal["accept", "decline", "cancel"]
    text: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class AuthRetried:
    """Command to the supervisor: the session's credentials were updated; unlock it
    (R-RETRY-6)."""


@attrs.frozen(kw_only=True, slots=True)
class HookAnswered:
    """A host hook the supervisor called has returned ``answer`` (None when it raised or
    returned nothing usable)."""

    hook: Literal["before_request", "after_tool_results", "on_stop"]
    answer: Any = attrs.field(eq=False, default=None)


@attrs.frozen(kw_only=True, slots=True)
class WorkDone:
    """A piece of the supervisor's own work that it ran in a task of its own, so as to
    keep serving its inbox meanwhile (a trace sync, the reading of a prompt's images),
    number ``token``, has ended."""

    token: int


@attrs.frozen(kw_only=True, slots=True)
class TraceFailed:
    """The session's trace cannot be written: the running task ends ``failed`` with
    ``message`` (R-SEC-1)."""

    message: str


@attrs.frozen(kw_only=True, slots=True)
class ActorFailed:
    """An actor of the running task failed (a bug, its own or in code it called, such as
    a provider, a callback or a hook): the task ends ``failed`` with ``message``; the
    session and the host go on (R-SEC-1)."""

    message: str


InterruptScope = Literal["tree", "node"]
"""What an interrupt ends (R-TREE-2): ``tree`` the node's task and its whole subtree,
background children included; ``node`` the node's task and its foreground children (whose
own background children keep running)."""


@attrs.frozen(kw_only=True, slots=True)
class InterruptTask:
    """Command to the supervisor: interrupt the running task and drop its follow-ups
    (R-ABORT-1); ``reason`` goes into its ``abort`` record. ``scope`` ``tree`` (the
    default) also interrupts the session's background children, and theirs (R-TREE-2).
    ``closing``: the session's close sends it, which holds a task that a background
    child's answer started at its next turn boundary instead of ending it (R-TREE-2)."""

    reason: str
    scope: InterruptScope = "tree"
    closing: bool = False


@attrs.frozen(kw_only=True, slots=True)
class SubagentOutputs:
    """A subagent → the supervisor of its parent's task: outputs the subagent published
    (in its trace already), to be emitted as live outputs of the parent's run with
    ``origin``, the path of session ids from the root to the subagent (R-HOST-4)."""

    outputs: tuple[Output, ...]
    origin: tuple[str, ...]


@attrs.frozen(kw_only=True, slots=True)
class SubagentFinished:
    """A background subagent → the supervisor of its parent (R-TREE-2): the subagent
    ``session_id`` has ended, and ``content`` (``[subagent NAME finished] …``: its answer
    or why it failed) is input for the parent — steering of the open task, or, when no
    task is open or it is stopping, ``follow_up`` (a ``TaskInput`` with that content),
    queued as a new task."""

    session_id: str
    content: tuple[UserContent, ...]
    follow_up: Any = attrs.field(eq=False, repr=False)


SessionControl = (
    InterruptTask | SteeringQueued | BackoffSkipped | TaskQueued | AuthRetried | PersonAnswered
)
"""What the session handle sends to its running supervisor: its only way in."""


SupervisorMessage = (
    StreamBatch
    | ApprovalAsked
    | ApprovalDecided
    | ToolCallFinished
    | ToolCallChecked
    | ToolProgressed
    | QuestionAsked
    | SubagentOutputs
    | SubagentFinished
    | HookAnswered
    | WorkDone
    | TraceFailed
    | ActorFailed
    | SessionControl
)
"""What the supervisor's one inbox carries."""


@attrs.frozen(kw_only=True, slots=True)
class ApproveCall:
    """Command to the approval broker: decide on this call (one at a time, in order).
    ``session_rule``: an earlier ``allow_session`` covers its tool, so nobody is asked; it
    comes to the broker only for the ``before_tool`` hook to see it first (R-HOOK-2)."""

    call: ToolCallBlock
    session_rule: bool = False


@attrs.frozen(kw_only=True, slots=True)
class BeginTurn:
    """Command to the tool pool: a new turn (or a retry's fresh call order) begins; call
    positions count from 0 again."""


@attrs.frozen(kw_only=True, slots=True)
class SkipToolCall:
    """Command to the tool pool: the call at ``position`` will never run (denied or
    truncated), so exclusive calls after it need not wait for it."""

    position: int


@attrs.frozen(kw_only=True, slots=True)
class RunToolCall:
    """Command to the tool pool: execute this approved call. ``position`` is the call's
    place in the turn's call order (exclusive tools wait for every earlier call);
    ``idempotency_key`` is the call's (R-EFFECT-1), given to the tool in its context."""

    call: ToolCallBlock
    position: int
    idempotency_key: str = ""


@attrs.frozen(kw_only=True, slots=True)
class CheckToolCall:
    """Command to the tool pool: ask the tool's ``check`` whether this call, in doubt,
    took effect (R-EFFECT-2), by its ``idempotency_key``; the answer comes back as
    :class:`ToolCallChecked`. The call keeps its ``position``: exclusive calls after it
    wait until it runs again or is skipped."""

    call: ToolCallBlock
    position: int
    idempotency_key: str


@attrs.frozen(kw_only=True, slots=True)
class StartAttempt:
    """Command to the LLM streamer: wait ``delay_ms`` (the planned backoff, skippable),
    then stream ``request`` as attempt ``attempt`` of the turn, reporting every parsed batch
    to the supervisor as a :class:`StreamBatch`."""

    request: ModelRequest
    attempt: int
    delay_ms: int
    number: int = 0
    """The request's number, copied into its batches (``StreamBatch.request``), so that
    the supervisor tells a turn's request from a compaction's and drops stale ones."""
    reply: Any = attrs.field(default=None, eq=False, repr=False)
    """Where the batches go (a channel's send side); None: the supervisor's inbox. Title
    requests name their own, so every model request takes this path (R-ACTOR-4)."""


@attrs.frozen(kw_only=True, slots=True)
class PlanBackoff:
    """Command to the LLM streamer: a reconnect wait has been announced; a skip from now on
    ends it, even one that arrives before the wait begins (R-RETRY-5)."""


@attrs.frozen(kw_only=True, slots=True)
class SkipBackoff:
    """Command to the LLM streamer: end the planned or running reconnect wait now."""


StreamerCommand = StartAttempt | PlanBackoff | SkipBackoff
"""What the LLM streamer's inbox carries."""


PoolCommand = BeginTurn | RunToolCall | SkipToolCall | CheckToolCall
"""What the tool pool's inbox carries."""


@attrs.frozen(kw_only=True, slots=True)
class SyncTraceFiles:
    """Command to the trace sink: make ``files`` durable (fsync each, and the directories
    in ``dirs`` whose entries they changed), then send :class:`TraceFilesSynced` on
    ``reply``. ``ledger``: the request also covers every usage row sent before it and
    reports the ledger's failure (a sync of the whole host). Requests that wait together
    share one batch (group commit)."""

    files: tuple[str, ...]
    dirs: tuple[str, ...]
    ledger: bool = False
    reply: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True, slots=True)
class TraceFilesSynced:
    """The trace sink's answer to :class:`SyncTraceFiles`: the files (or the ledger) that
    could not be made durable, ``(path, why)``; empty when everything is on disk. A
    failure is repeated in every later answer covering that path until it is
    acknowledged (:class:`TraceErrorAcknowledged`)."""

    failures: tuple[tuple[str, str], ...]


@attrs.frozen(kw_only=True, slots=True)
class LedgerRow:
    """Command to the trace sink: insert ``row`` into the usage ledger with the next batch
    (R-TRACE-5)."""

    row: UsageRow


@attrs.frozen(kw_only=True, slots=True)
class TraceErrorAcknowledged:
    """The failure of ``path`` was reported to its task: the sink stops repeating it."""

    path: str


@attrs.frozen(kw_only=True, slots=True)
class TraceWritten:
    """A trace store → the emitter that asked (``when_batch_done``): the records of
    ``ticket`` are written (or failed: the store's ``error`` says), so the batches waiting
    for them may be published (R-TRACE-3)."""

    ticket: int


TraceSinkMessage = SyncTraceFiles | LedgerRow | TraceErrorAcknowledged
"""What the trace sink's inbox carries."""
