"""The task port: the parts of a session that its running work needs, and nothing else.

A :class:`SessionPort` holds a session's data — settings, tools, the model context
(:class:`~greenroom.protocols.transcript.Transcript`), the task state
(:class:`~greenroom.protocols.task.TaskMachine`), the trace position, the watchers — and the
narrow surface the runners of its work use: the next ``seq``, the trace (through the trace
log of the host's :class:`~greenroom.actors.runtime.trace_store.TraceStore`), publication,
the usage ledger (the store's too).
The supervisor, the emitter, compaction, subagents and tool sources take a port; none of them
sees the user's :class:`~greenroom.actors.runtime.session.Session` handle, which keeps only
the public API and reaches running work by sending messages to the supervisor's inbox
(R-ACTOR-1).

Ownership: while a task runs, the data belongs to the session's one supervisor (``Busy``
keeps it to one); while the session is idle it belongs to no actor, and the handle may read
it and start work. Host services a port needs (creating a subagent's session, starting a
task in the host's nursery) come through :class:`HostServices`, so that no runtime module
needs the host or the session handle.

An idle session costs its history and little more (thousands live in one host): slots,
no trio objects until work arrives, and containers created on first use.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs
import trio

from greenroom.actors.runtime.accounting import Account
from greenroom.actors.runtime.admission import AdmissionPoint, EndpointAdmission, Requester
from greenroom.actors.runtime.attachments import Attachments
from greenroom.actors.runtime.storage import ATTACHMENTS_DIR
from greenroom.actors.runtime.trace_sink import TraceSinkClosed, TraceWriteError
from greenroom.protocols.content import UserContent
from greenroom.protocols.context import ToolSchema
from greenroom.protocols.hooks import Hooks
from greenroom.protocols.messages import SupervisorMessage, TraceWritten
from greenroom.protocols.outputs import Output
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.structured import OutputSpec
from greenroom.protocols.task import TaskLimits, TaskMachine
from greenroom.protocols.tools import Editor, Tool, WorkspaceIdentity
from greenroom.protocols.trace import STARTED, UsageKind, UsageRow, encode_record
from greenroom.protocols.transcript import Transcript

if TYPE_CHECKING:
    from greenroom.actors.runtime.llm_streamer import ModelProvider
    from greenroom.actors.runtime.trace_store import TraceLog, UsageLedger
    from greenroom.actors.runtime.tree import Children
    from greenroom.actors.tools.mcp_commands import McpView

__all__ = [
    "NO_HOOKS",
    "ApproveFn",
    "HostServices",
    "Listener",
    "SessionPort",
    "TaskInput",
    "TreeReach",
    "left_open",
    "left_unstarted",
]

ApproveFn = Callable[[Any], "Awaitable[Any] | Any"]
"""A host's approval callback: given the :class:`~greenroom.protocols.content.ToolCallBlock`,
returns ``"allow"``, ``"deny"``, ``"allow_session"``, or a bool; may be sync or async."""

Approval = ApproveFn | Literal["people"] | None
"""How a task's tool calls are decided: a host callback, ``"people"`` (each call waits
for a person's answer from any surface, durably: R-HITL), or None (denied by default,
R-APPROVE-2)."""

Listener = Callable[[list[Output]], None]
"""A subscriber: called with every batch of outputs, in order. Must not block or raise."""

NO_HOOKS = Hooks()
"""The hooks of a session that was given none (shared: Hooks is frozen)."""


@attrs.frozen(kw_only=True, slots=True)
class TaskInput:
    """One task to run: the prompt and the run options that apply to it. ``approve`` is a
    callback, ``"people"`` (calls wait for a person: R-HITL) or None (denied by default);
    ``output`` the answer it requires (R-OUT-1), if any: its schema is recorded in the
    task's ``task_start``. ``queued_id`` names the ``task_queued`` record of a follow-up
    (R-STEER-6): its prompt says it started it. ``late_steering``: the task is steering
    that came after its task stopped taking it (R-STEER-1), which the cap on what
    clients queue counts as the steering they sent (R-SEC-9). ``report``: the prompt is
    a background child's answer (R-TREE-2), which a close does not end (see
    :class:`~greenroom.protocols.messages.InterruptTask`)."""

    content: tuple[UserContent, ...]
    approve: Approval
    thinking_level: str | None
    output: OutputSpec | None = None
    queued_id: str | None = None
    late_steering: bool = False
    report: bool = False


@attrs.frozen(kw_only=True, slots=True)
class Parked:
    """What a task that waits only for people keeps while no supervisor runs it
    (R-HITL-3): its run options, its run's output channel (None when nobody reads it),
    when it started (its ``task_end.wall_ms`` counts from there), and its run's
    ``cancel`` event, if any: no task watches it while the task is parked; set by then,
    it interrupts the task as soon as something wakes it."""

    task: TaskInput
    output: trio.MemorySendChannel[list[Output]] | None
    started_at: float
    cancel: trio.Event | None = None


class TreeReach(Protocol):
    """How a host's tree interrupt reaches the nodes below a session that no interrupt
    of a live child reaches (the host's ``child_reports``, R-TREE-2)."""

    def end_unreached(self, node: SessionPort, reason: str) -> bool:
        """End every descendant of ``node`` that the trees of live children leave out;
        True when one open here had work to interrupt (those read from the store end
        later)."""
        ...


class HostServices(Protocol):
    """What a session's running work asks of its host."""

    data_dir: Path

    trace_log: TraceLog
    """The trace log of the host's store: every record of every session goes through it."""

    usage_ledger: UsageLedger
    """The usage ledger of the host's store."""

    draining: bool
    """Whether the host drains (R-DRAIN-1): running tasks stop at their next turn
    boundary, open in their traces, and no new task is taken from users."""

    hand_over: Callable[[str], Awaitable[None]] | None
    """How a draining host gives a held or parked session to another host (a cluster
    host's, R-DRAIN-2: with its tree); None on a host alone."""

    @property
    def child_reports(self) -> TreeReach:
        """The host's reports of subagents taken up here, and its reach into their trees."""
        ...

    def start_task(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` in the host's nursery (it must not raise)."""

    def is_open(self) -> bool:
        """Whether the host still takes work (False while it closes)."""
        ...

    async def create_child(
        self,
        parent: SessionPort,
        *,
        settings: SessionSettings,
        tools: Iterable[Tool],
        name: str | None = None,
        background: bool = False,
    ) -> SessionPort:
        """Create a subagent's session under ``parent`` (R-HOST-4, R-TREE-1), named
        ``name`` if given, run in the ``background`` or not, and return its port."""

    def start_work(
        self,
        port: SessionPort,
        task: TaskInput | None,
        output: trio.MemorySendChannel[list[Output]],
    ) -> None:
        """Start a supervisor for ``port`` in the host's nursery on ``task`` (None: a
        manual compaction), publishing on ``output``; ``port`` must be idle."""

    def forget_child(self, child: SessionPort) -> None:
        """A finished subagent's session leaves the host's open sessions (its files stay)."""

    def wake(self, port: SessionPort, message: SupervisorMessage | None) -> None:
        """Start a supervisor for ``port``'s open task (parked, or loaded after its host
        stopped), with ``message`` first in its inbox (R-HITL-2, R-HITL-4)."""

    def watch_approval(self, port: SessionPort, call_id: str, asked_at: float | None) -> None:
        """Hold the wait of ``call_id``'s request to the session's timeout policy
        (``approval_timeout_s``, ``approval_timeout_action``); none when it is None."""


class _Watch:
    """One ``Session.watch``: forwards each batch (or its outputs of the ``kinds`` asked
    for, when any) to the watcher's inbox, never waiting and never raising into the
    publisher; ends (closes the inbox and leaves ``watchers``) when the inbox is closed,
    broken or full."""

    __slots__ = ("inbox", "kinds", "watchers")

    def __init__(
        self,
        inbox: trio.MemorySendChannel[list[Output]],
        watchers: list[Listener],
        kinds: tuple[type[Output], ...] | None,
    ) -> None:
        self.inbox = inbox
        self.watchers = watchers
        self.kinds = kinds

    def __call__(self, batch: list[Output]) -> None:
        if self.kinds is not None:
            batch = [output for output in batch if isinstance(output, self.kinds)]
            if not batch:
                return
        try:
            self.inbox.send_nowait(batch)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.end()

    def end(self) -> None:
        """Close the inbox and leave the session's watchers."""
        self.inbox.close()
        with contextlib.suppress(ValueError):
            self.watchers.remove(self)


class SessionPort:
    """A session's data and the surface its running work uses; see the module docstring."""

    __slots__ = (
        "_client_tools",
        "_host",
        "_listeners",
        "_next_run_id",
        "_own_tools",
        "_path",
        "_seq",
        "_tool_schemas",
        "_tools",
        "_watches_ended",
        "account",
        "admission",
        "children",
        "closed",
        "directory",
        "editor",
        "forked_from",
        "held",
        "hooks",
        "id",
        "idle",
        "inbox",
        "load_errors",
        "lost_approve",
        "machine",
        "mcp",
        "parent_id",
        "parked_task",
        "principal",
        "provider",
        "report_as",
        "settings",
        "transcript",
        "workspace_dir",
        "workspace_identity",
    )

    def __init__(
        self,
        *,
        host: HostServices,
        session_id: str,
        directory: Path,
        settings: SessionSettings,
        workspace_dir: Path,
        tools: tuple[dict[str, Tool], tuple[ToolSchema, ...]],
        provider: ModelProvider,
        transcript: Transcript,
        machine: TaskMachine | None = None,
        last_seq: int = 0,
        parent_id: str | None = None,
        workspace_identity: WorkspaceIdentity | None = None,
        origin: tuple[str, ...] | None = None,
        account: Account | None = None,
        admission: AdmissionPoint | None = None,
        principal: str = "",
    ) -> None:
        self.id = session_id
        self.parent_id = parent_id
        """The session that spawned this one as a subagent (R-HOST-4), else None."""
        self.directory = directory
        self.settings = settings
        self.workspace_dir = workspace_dir
        self.workspace_identity = workspace_identity
        """The directory the workspace was when the session was created (R-SEC-7); its
        tools work only there. None only for a session built by hand."""
        self.provider = provider
        """The model provider adapter this session's requests go through."""
        self.account = account if account is not None else Account()
        """The price of the session's model, its principal and the cost budgets its
        requests count against (R-SHARE-3, R-SHARE-4)."""
        self.admission: AdmissionPoint = admission or EndpointAdmission()
        """The admission point of the provider's endpoint, shared with every session of
        the host (and, in a cluster, of every host) that uses it (R-SHARE-1); a port built
        by hand has one of its own."""
        self.principal = principal
        """Who the session's requests are admitted for, in turn with other principals
        (R-SHARE-2): the gateway client that owns it, its root's for a subagent; "" for
        none."""
        self.transcript = transcript
        """The model context, a pure function of the traced outputs (the emitter feeds it)."""
        self.machine = machine or TaskMachine()
        """The task state, a pure function of the traced outputs (the emitter feeds it)."""
        self.hooks = NO_HOOKS
        """Host hooks at the loop's checkpoints (R-HOOK-1)."""
        self.load_errors: Sequence[str] = ()
        """Where approvals go when a run has no ``approve`` callback."""
        self.inbox: trio.MemorySendChannel[SupervisorMessage] | None = None
        """The running supervisor's inbox; None while the session is idle."""
        self.idle: trio.Event | None = None
        """Set when the running supervisor ends; exists only while busy."""
        self.parked_task: Parked | None = None
        """The open task's run options while it waits for people with no supervisor."""
        self.held = False
        """The open task stopped at a turn boundary because the host drains (R-DRAIN-1):
        its run options are kept as a parked task's are, a message wakes it, and closing
        the session leaves it open in its trace for the next host."""
        self.lost_approve: Approval = PEOPLE
        """How the calls of an open task its host lost are decided once it is taken up:
        its own callback went with the process (``Host.resume(approve=…)`` sets it)."""
        self.closed = False
        self.editor: Editor | None = None
        """The editor that drives the session, when it offers its files and terminal
        (R-ACP-2): its tools read, write and run through it; a subagent gets its parent's."""
        self.report_as: str | None = None
        """For a background subagent, the name its answer goes to its parent under (its
        ``name``, else its id: ``[subagent NAME finished]``, R-TREE-2); None for a root
        or a foreground subagent."""
        self.children: Children | None = None
        """The subagents running now and the slots they share (R-TREE); None until the
        session first spawns."""
        self.forked_from: tuple[str, int] | None = None
        """The session and seq this one was forked from (R-FORK-1), else None."""
        self.mcp: McpView | None = None
        """The prompts and resources of the session's MCP servers (R-MCP-5); None
        without MCP servers."""
        self._host = host
        self._tools, self._tool_schemas = tools
        self._own_tools = tools
        self._client_tools: tuple[Tool, ...] = ()
        self._seq = last_seq
        self._listeners: list[Listener] | None = None
        self._watches_ended = False
        self._next_run_id: str | None = None
        self._path = origin

    # -- identity and tools ---------------------------------------------------------------

    @property
    def host(self) -> HostServices:
        """The services of the host that runs this session."""
        return self._host

    @property
    def scratchpad_dir(self) -> Path:
        """The session's scratch directory, inside its session directory."""
        return self.directory / "scratch"

    @property
    def attachments(self) -> Attachments:
        """Where the session keeps its private copies of images and which directories
        named files are walked beneath (R-SEC-8)."""
        return Attachments(
            directory=self.directory / ATTACHMENTS_DIR,
            roots=(self.workspace_dir, self.scratchpad_dir),
            max_bytes=self.settings.max_image_bytes,
            workspace=None
            if (identity := self.workspace_identity) is None
            else (identity.device, identity.inode),
            private_dirs=(self.host.data_dir,),
        )

    @property
    def origin_path(self) -> tuple[str, ...]:
        """The session ids from the root to this session (R-HOST-4): ``(id,)`` for a
        session the host runs, ``(root_id, …, id)`` for a subagent."""
        return self._path or (self.id,)

    @property
    def root_id(self) -> str:
        """The id of the root of this session's tree (its own for a root: R-TREE-1)."""
        return self.origin_path[0]

    def requester(self) -> Requester:
        """The session's place at its endpoint's admission (for its LLM streamers)."""
        return Requester(self.admission, self.principal, self.id)

    def set_origin_path(self, path: tuple[str, ...]) -> None:
        """Make this session a subagent whose outputs carry ``origin`` = ``path``."""
        self._path = path

    @property
    def tool_by_name(self) -> dict[str, Tool]:
        """The session's tools by name (shared with other sessions: read only)."""
        return self._tools

    @property
    def tool_schemas(self) -> tuple[ToolSchema, ...]:
        """How the session's tools are described to the model, in order."""
        return self._tool_schemas

    def set_tool_table(self, tools: dict[str, Tool], schemas: tuple[ToolSchema, ...]) -> None:
        """Replace the session's tools (MCP servers whose tool lists changed): the next
        request describes ``schemas`` and calls run ``tools`` (R-MCP-4)."""
        self._own_tools = (tools, schemas)
        self._merge_tools()

    @property
    def client_tools(self) -> tuple[Tool, ...]:
        """The tools a client runs itself, beside the session's own (R-PROTO-2)."""
        return self._client_tools

    def set_client_tools(self, tools: tuple[Tool, ...]) -> None:
        """Replace the client's tools; the caller has checked that none takes the name of
        one of the session's own tools."""
        self._client_tools = tools
        self._merge_tools()

    def _merge_tools(self) -> None:
        own, schemas = self._own_tools
        client = self._client_tools
        if not client:
            self._tools, self._tool_schemas = own, schemas  # shared, as built
            return
        self._tools = {**own, **{t.name: t for t in client}}
        self._tool_schemas = (*schemas, *(t.schema for t in client))

    def own_tool_names(self) -> frozenset[str]:
        """The names of the session's own tools (not a client's)."""
        return frozenset(self._own_tools[0])

    def task_limits(self) -> TaskLimits:
        """What the task machine decides by: the settings and hooks as they are now."""
        settings = self.settings
        hooks = self.hooks
        return TaskLimits(
            max_turns=settings.max_turns,
            max_context_length=settings.max_context_length,
            max_session_turns=settings.max_session_turns,
            loop_repeat_threshold=settings.loop_repeat_threshold,
            loop_no_progress_threshold=settings.loop_no_progress_threshold,
            has_stop_hook=hooks.on_stop is not None,
            max_stop_continuations=hooks.max_stop_continuations,
            has_results_hook=hooks.after_tool_results is not None,
            wait_for_children=self.parent_id is not None,
            largest_steering=self._host.trace_log.largest_input(),
        )

    # -- runs -----------------------------------------------------------------------------

    @property
    def parked(self) -> bool:
        """Whether the session's open task waits for people with no supervisor (parked
        in this process, or loaded from a trace that left it so: R-HITL-3)."""
        machine = self.machine
        if self.inbox is not None or machine.run_id is None:
            return False
        record = machine.record
        # A question of a call that was running (allowed, no result) went with the host
        # that ran the call: resuming settles the call; it is nobody's to answer. A
        # call in doubt asks what became of it, and that question waits (R-EFFECT-2).
        return any(
            r.call_id not in record.allowed or record.waits_for_person(r.call_id)
            for r in record.pending_people
        )

    @property
    def busy(self) -> bool:
        """Whether the session has work: a supervisor runs it, or it is parked."""
        return self.inbox is not None or self.parked

    def deliver(self, message: SupervisorMessage) -> bool:
        """Send ``message`` to the session's work: to the running supervisor, or to one
        started for a parked task (it wakes: R-HITL-3). False when the session has no
        work."""
        if self.send(message):
            return True
        if not (self.parked or self.held) or self.closed:
            return False
        self._host.wake(self, message)
        return True

    def recover_open_task(self) -> None:
        """A task the trace leaves open from a host that stopped, and that nobody took up,
        is over: recovered as interrupted (R-TRACE-4), as a new task starts."""
        machine = self.machine
        run_id = machine.run_id
        if self.inbox is None and run_id is not None and not (self.parked or self.held):
            self.transcript.recover(session_id=self.id, run_id=run_id)
            machine.recover()

    async def wait_idle(self) -> None:
        """Return when no supervisor runs the session's work."""
        idle = self.idle
        if idle is not None:
            await idle.wait()

    def reserve_run_id(self) -> str:
        """Reserve the run id of the next task (so that a caller can report it before the
        supervisor has started); its first task takes it."""
        run_id = self._next_run_id = "run_" + uuid.uuid4().hex[:12]
        return run_id

    def new_run_id(self) -> str:
        """The reserved run id when there is one (see :meth:`reserve_run_id`), else a new
        one; the reservation is used up either way."""
        reserved, self._next_run_id = self._next_run_id, None
        return reserved or "run_" + uuid.uuid4().hex[:12]

    def send(self, message: SupervisorMessage) -> bool:
        """Send ``message`` to the running supervisor's inbox; False when none runs (or
        it has just closed its inbox: nothing is left to steer)."""
        inbox = self.inbox
        if inbox is None:
            return False
        try:
            inbox.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    # -- the trace: one route to the store's log --------------------------------------------

    def next_seq(self) -> int:
        """The ``seq`` of the session's next traced output (one more than the last)."""
        self._seq += 1
        return self._seq

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the session's last traced output (0 before any)."""
        return self._seq

    def append(self, output: Output) -> int:
        """Append the record of a traced output; returns the store's batch holding it."""
        assert output.seq is not None
        return self._host.trace_log.append(self.id, output.seq, encode_record(output))

    def commit(self) -> bool:
        """Hand the appended records on now; False when the store acknowledges late."""
        return self._host.trace_log.commit(self.id)

    def batch_done(self, ticket: int) -> bool:
        """Whether the store is done with batch ``ticket``."""
        return self._host.trace_log.batch_done(ticket)

    def when_batch_done(self, ticket: int, inbox: trio.MemorySendChannel[TraceWritten]) -> None:
        """Ask the store for ``TraceWritten(ticket)`` on ``inbox``."""
        self._host.trace_log.when_batch_done(ticket, inbox)

    def trace_error(self) -> str | None:
        """The session's sticky trace failure, if any."""
        error = self._host.trace_log.error(self.id)
        return None if error is None else str(error)

    def clear_trace_error(self) -> None:
        """Forget the session's trace failure (reported to its task)."""
        self._host.trace_log.clear_error(self.id)

    async def sync_trace(self) -> None:
        """Wait until the session's trace is durable (R-TRACE-2). Raises
        :class:`TraceWriteError`, or :class:`TraceSinkClosed` once the store is closed."""
        await self._host.trace_log.sync(self.id)

    async def sync_trace_quietly(self) -> str | None:
        """Sync for teardown paths that must finish whatever the disk does: a failure is
        returned (and stays recorded in the store), never raised."""
        try:
            await self.sync_trace()
        except (TraceWriteError, TraceSinkClosed) as exc:
            return str(exc)
        return None

    def rotate_trace(self) -> str:
        """Start the next trace file (after a successful compaction); returns its name."""
        return self._host.trace_log.rotate(self.id)

    @property
    def trace_path(self) -> Path:
        """The current trace file (one model context: R-COMPACT-8)."""
        return self._host.trace_log.location(self.id)

    def record_usage(
        self,
        run_id: str,
        turn: int,
        usage: TokenUsage,
        *,
        kind: UsageKind = "request",
        status: str = "ok",
        error_message: str | None = None,
        started: bool = False,
    ) -> None:
        """Record one request's token usage in the host's usage ledger (R-TRACE-5), priced
        at the session's model's price when it is not yet, and count its cost against the
        session's budgets (R-SHARE-3, R-SHARE-4). ``started``: what its stream reported
        first, for the ledger alone (status ``started``; its bound is held against the
        budgets already), so that a host that dies mid-stream leaves it counted; the
        request's last row replaces it."""
        account = self.account
        estimated = account.is_estimate(usage, kind)
        usage = account.priced(usage)
        if not started:
            account.spend(usage.cost_usd, settles=kind != "title")  # a title runs beside a task
        key = account.request_key(kind, started=started)
        if started and key is None:
            return  # its streamer wrote it as the stream began (RequestBilling)
        status = STARTED if started else status
        row = _usage_row(self, run_id, turn, usage, kind, status, error_message, key)
        if estimated:
            row = attrs.evolve(row, estimated=True)
        self._host.usage_ledger.record_usage(row)

    # -- publication ------------------------------------------------------------------------

    def publish(self, batch: list[Output]) -> None:
        """Hand an emitted batch to every subscriber and watch, synchronously and in the
        order they were added. A subscriber that raises is ignored."""
        if self._listeners:
            # A copy: a listener may unsubscribe itself. A listener that raises is a bug
            # of its owner; it must not take the session (or the host) down.
            for listener in tuple(self._listeners):
                with contextlib.suppress(Exception):
                    listener(batch)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Add ``listener``; returns the function that removes it."""
        if self._listeners is None:
            self._listeners = []
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if self._listeners is not None and listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def watch(
        self,
        inbox: trio.MemorySendChannel[list[Output]],
        *,
        kinds: tuple[type[Output], ...] | None = None,
    ) -> Callable[[], None]:
        """Send every batch published from now on to ``inbox`` with ``send_nowait`` (only
        its outputs of ``kinds``, and only when it has some, when ``kinds`` is given).
        After :meth:`end_watches` the inbox is closed at once: nothing is published.
        Returns what ends the watch now (closing ``inbox``)."""
        if self._watches_ended:
            inbox.close()
            return inbox.close
        if self._listeners is None:
            self._listeners = []
        watch = _Watch(inbox, self._listeners, kinds)
        self._listeners.append(watch)
        return watch.end

    def end_watches(self) -> None:
        """Close the inbox of every watch: nothing more is published."""
        self._watches_ended = True
        for listener in tuple(self._listeners or ()):
            if isinstance(listener, _Watch):
                listener.end()


def _usage_row(
    port: SessionPort,
    run_id: str,
    turn: int,
    usage: TokenUsage,
    kind: UsageKind,
    status: str,
    error_message: str | None,
    request_key: str | None,
) -> UsageRow:
    """A usage-ledger row of ``port``'s session: its provider, model, principal and root."""
    return UsageRow(
        at=time.time(),
        session_id=port.id,
        run_id=run_id,
        turn=turn,
        kind=kind,
        provider=port.provider.name,
        model=port.settings.model,
        usage=usage,
        status=status,
        error_message=error_message,
        principal=port.account.principal,
        root_id=port.root_id,
        request_key=request_key,
    )


def left_open(port: SessionPort) -> bool:
    """Whether ``port``'s task is open with nobody to run it: no supervisor runs it, it
    is not parked, held for a drain's hand-over, or closing. Its host stopped under it
    (R-HITL-4): only a take-up (``Host.resume``) or an interrupt that takes it up to end
    at once (R-ABORT-1) moves it on."""
    return _unattended(port) and port.machine.run_id is not None


def left_unstarted(port: SessionPort) -> bool:
    """Whether ``port``'s trace holds input that its host recorded and stopped before
    starting a task for, with nobody to start it (unattended as for :func:`left_open`,
    no task open): a prompt without its ``task_start`` (R-TRACE-3), or follow-ups
    recorded as queued (R-STEER-6). Only a take-up runs it, or an interrupt ends it."""
    record = port.machine.record
    left = record.unstarted is not None or bool(record.queued)
    return left and _unattended(port) and port.machine.run_id is None


def _unattended(port: SessionPort) -> bool:
    """No supervisor runs ``port``'s work, and it is not parked, held for a drain's
    hand-over, or closing."""
    return port.inbox is None and not (port.parked or port.held or port.closed)
