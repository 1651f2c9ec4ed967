"""Sessions: the public handle of a long-lived conversation, and the run iterator.

A :class:`Session` holds data only — settings, tools, the model context
(:class:`~greenroom.protocols.transcript.Transcript`), the trace position — so an idle
session costs its history and little more. ``run()`` starts a
:class:`~greenroom.actors.runtime.supervisor.SessionSupervisor` in the host's nursery; it ends
with the work.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import attrs
import trio

from greenroom.actors.runtime.approval_broker import ApproveFn, ClientApprovals
from greenroom.actors.runtime.errors import AuthLocked, Busy, SessionClosed
from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.actors.runtime.supervisor import SessionSupervisor, TaskInput
from greenroom.actors.runtime.trace_sink import TraceSinkClosed, TraceWriteError
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, UserContent
from greenroom.protocols.context import ModelRequest, ToolSchema, UserMessage
from greenroom.protocols.hooks import Hooks
from greenroom.protocols.messages import (
    BackoffSkipped,
    InterruptTask,
    SessionControl,
    StartAttempt,
    SteeringQueued,
    StreamBatch,
    StreamerCommand,
    SupervisorMessage,
)
from greenroom.protocols.outputs import (
    CompactionEnd,
    ModelMsg,
    Output,
    RequestBegin,
    TaskEnd,
    TaskStart,
    TaskStatus,
)
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.stream import MessageCompleted, StreamFailed, TextDelta, TokenUsage
from greenroom.protocols.tools import Tool, WorkspaceIdentity
from greenroom.protocols.trace import UsageKind, UsageRow, encode_record
from greenroom.protocols.transcript import Transcript

if TYPE_CHECKING:
    from greenroom.actors.runtime.host import Host
    from greenroom.actors.runtime.llm_streamer import ModelProvider

NO_HOOKS = Hooks()
"""The hooks of a session that was given none (shared: Hooks is frozen)."""

Listener = Callable[[list[Output]], None]
"""A subscriber: called with every batch of outputs, in order. Must not block or raise."""

Compactability = Literal["ok", "unsupported", "empty", "just_compacted"]


def _as_content(messages: Sequence[UserContent] | str) -> tuple[UserContent, ...]:
    if isinstance(messages, str):
        return (TextBlock(text=messages),)
    return tuple(messages)


def _title_material(transcript: Transcript, limit: int = 2000) -> str:
    """The first user texts of the context: what a title is made from."""
    texts: list[str] = []
    for message in transcript.request_messages():
        if isinstance(message, UserMessage):
            texts.extend(p.text for p in message.content if isinstance(p, TextBlock))
        if sum(len(t) for t in texts) >= limit:
            break
    return "\n".join(texts)[:limit]


TRIO_REQUIRED = "greenroom runs on trio: use trio.run(...)"


def require_trio() -> None:
    """Raise ``RuntimeError(TRIO_REQUIRED)`` unless called from a trio task: under
    asyncio (or any other event loop) the actor tree cannot run, and failing at the entry
    point says why instead of failing deep inside trio."""
    if not trio.lowlevel.in_trio_task():
        raise RuntimeError(TRIO_REQUIRED)


@attrs.frozen(kw_only=True)
class RunResult:
    """How a run ended, for hosts that want the answer rather than the stream.

    Fields:
        text: the text of the model's last message (its text blocks joined by newlines;
            ``""`` when that message had none, e.g. a task that ended on tool calls).
        task_end: the run's last ``task_end`` (of the last follow-up, when there were
            any): its ``status``, ``turns``, ``usage`` and ``wall_ms``.
    """

    text: str
    task_end: TaskEnd

    @property
    def status(self) -> TaskStatus:
        """``task_end.status``: ``completed`` when the task ran to its answer."""
        return self.task_end.status


class RunStream:
    """The outputs of one ``Session.run``: an async iterator that ends after the last
    ``task_end`` (of the task and of any follow-ups queued behind it).

    Outputs arrive from the supervisor in batches over a memory channel; iterating hands
    them out one by one. ``aclose()`` (or leaving ``async with``) interrupts the work if it
    is still running. Breaking out of the loop without closing leaves the task running to
    its end; its outputs still reach the trace and subscribers.

    While iterating, the stream keeps what most hosts would otherwise track by hand:
    :attr:`final_text` (the text of the model's last message) and :attr:`task_end`.
    ``await stream.result()`` reads whatever is left and returns both as a
    :class:`RunResult`. Outputs forwarded from subagents (``origin`` set) never count.
    """

    __slots__ = (
        "_batch",
        "_control",
        "_index",
        "_receive",
        "_run_id",
        "_task_end",
        "_texts",
    )

    def __init__(
        self,
        receive: trio.MemoryReceiveChannel[list[Output]],
        control: trio.MemorySendChannel[SessionControl],
        first_run_id: str = "",
    ) -> None:
        self._receive = receive
        self._control = control
        self._run_id = first_run_id
        self._batch: list[Output] = []
        self._index = 0
        self._texts: list[str] = []
        self._task_end: TaskEnd | None = None

    def __aiter__(self) -> RunStream:
        return self

    async def __anext__(self) -> Output:
        while self._index >= len(self._batch):
            try:
                self._batch = await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise StopAsyncIteration from None
            self._index = 0
        output = self._batch[self._index]
        self._index += 1
        if output.origin is None:
            self._note(output)
        return output

    def _note(self, output: Output) -> None:
        self._run_id = output.run_id
        if isinstance(output, RequestBegin | TaskStart):
            self._texts = []  # the answer is the last model message's text
        elif isinstance(output, ModelMsg):
            if isinstance(output.block, TextBlock):
                self._texts.append(output.block.text)
        elif isinstance(output, TaskEnd):
            self._task_end = output

    @property
    def run_id(self) -> str:
        """The id of the task whose outputs are being read (follow-ups get their own);
        known as soon as ``Session.run`` returns, before the supervisor has started."""
        return self._run_id

    @property
    def final_text(self) -> str:
        """The text of the model's last complete message among the outputs read so far
        (``""`` before there is one). Once the stream has ended it is the answer."""
        return "\n".join(t for t in self._texts if t)

    @property
    def task_end(self) -> TaskEnd | None:
        """The last ``task_end`` read so far; None while the first task runs."""
        return self._task_end

    async def result(self) -> RunResult:
        """Read every remaining output and return the answer and the ``task_end``.

        The outputs read here are not returned (they are in the trace, and subscribers
        saw them); iterate instead to watch them. Raises ``RuntimeError`` when the
        stream ended without a ``task_end``, which happens only after :meth:`detach`.
        """
        async for _ in self:
            pass
        if self._task_end is None:
            raise RuntimeError("the run's outputs ended without a task_end (detached?)")
        return RunResult(text=self.final_text, task_end=self._task_end)

    async def collect(self) -> list[Output]:
        """Every remaining output, once the run has ended."""
        return [output async for output in self]

    def detach(self) -> None:
        """Stop receiving without interrupting: the task (and its follow-ups) runs on,
        its outputs still reach the trace and subscribers, and none pile up here. For
        hosts that watch through ``Session.subscribe`` (the websocket gateway)."""
        self._receive.close()

    async def aclose(self) -> None:
        """Interrupt the run if it is still going, and stop receiving."""
        _send(self._control, InterruptTask(reason="run closed by host"))
        await self._receive.aclose()

    async def __aenter__(self) -> RunStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Watch:
    """One :meth:`Session.watch`: forwards each batch to the watcher's inbox, never
    waiting and never raising into the publisher; ends (closes the inbox and leaves
    ``watchers``) when the inbox is closed, broken or full."""

    __slots__ = ("inbox", "watchers")

    def __init__(
        self, inbox: trio.MemorySendChannel[list[Output]], watchers: list[Listener]
    ) -> None:
        self.inbox = inbox
        self.watchers = watchers

    def __call__(self, batch: list[Output]) -> None:
        try:
            self.inbox.send_nowait(batch)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.end()

    def end(self) -> None:
        """Close the inbox and leave the session's watchers."""
        self.inbox.close()
        with contextlib.suppress(ValueError):
            self.watchers.remove(self)


class SessionCore:
    """A session's data and its runtime seam: what the session's supervisor, its output
    emitter, compaction, subagents and tool sources work on while a task runs — the model
    context, the trace position, the tool table, the approval rules, the listeners.
    :class:`Session` adds the public API; hosts and clients never need these.

    Ownership: the data belongs to the one supervisor running a task (``Busy`` keeps it
    to one) and to no actor while the session is idle, when an idle session is data
    only (R-HOST-1). The public API never writes it while a task runs: control goes to the
    supervisor's control inbox (R-ACTOR-1)."""


    # An idle session should cost its history and little more (thousands of sessions
    # live in one host): slots, no trio objects until work arrives, containers created
    # on first use, and the tool table shared by the sessions that use the same tools.
    __slots__ = (
        "_client_approvals",
        "_closed",
        "_control",
        "_follow_ups",
        "_host",
        "_idle",
        "_listeners",
        "_next_run_id",
        "_path",
        "_provider",
        "_seq",
        "_session_rules",
        "_tool_schemas",
        "_tools",
        "_transcript",
        "auth_locked",
        "directory",
        "hooks",
        "id",
        "load_errors",
        "parent_id",
        "settings",
        "workspace_dir",
        "workspace_identity",
    )

    def __init__(
        self,
        *,
        host: Host,
        session_id: str,
        directory: Path,
        settings: SessionSettings,
        workspace_dir: Path,
        tools: Iterable[Tool],
        provider: ModelProvider,
        transcript: Transcript,
        last_seq: int = 0,
        parent_id: str | None = None,
        workspace_identity: WorkspaceIdentity | None = None,
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
        self.auth_locked: str | None = None
        self.load_errors: Sequence[str] = ()
        self._host = host
        self._tools, self._tool_schemas = host.tool_table(tools)
        self._provider = provider
        self._transcript = transcript
        self._seq = last_seq
        self._session_rules: set[str] | None = None
        # The running supervisor's control inbox: the one way into a running task.
        self._control: trio.MemorySendChannel[SessionControl] | None = None
        self._follow_ups: list[TaskInput] | None = None
        self._listeners: list[Listener] | None = None
        self._client_approvals: ClientApprovals | None = None
        self._next_run_id: str | None = None
        self._idle: trio.Event | None = None  # exists only while busy
        self._closed = False
        self._path: tuple[str, ...] | None = None  # set on a running subagent
        self.hooks = NO_HOOKS
        """Host hooks at the loop's checkpoints (R-HOOK-1); replace to change them."""

    @property
    def scratchpad_dir(self) -> Path:
        """The session's scratch directory, inside its session directory."""
        return self.directory / "scratch"

    @property
    def trace_path(self) -> Path:
        """The current trace file (one model context: R-COMPACT-8)."""
        return self._host.trace_store.location(self.id)

    @property
    def origin_path(self) -> tuple[str, ...]:
        """The path of session ids from the root to this session (R-HOST-4): ``(id,)``
        for a session the host runs, ``(root_id, …, id)`` for a running subagent. Its
        outputs reach its ancestors' streams with this as their ``origin``."""
        return self._path or (self.id,)

    @property
    def transcript(self) -> Transcript:
        """The model context as a pure function of the traced outputs (the runtime feeds
        it; read it, never change it)."""
        return self._transcript

    @property
    def host(self) -> Host:
        """The host that runs this session."""
        return self._host

    @property
    def provider(self) -> ModelProvider:
        """The model provider adapter this session's requests go through."""
        return self._provider

    @property
    def tool_by_name(self) -> dict[str, Tool]:
        """The session's tools by name (shared with other sessions: read only)."""
        return self._tools

    @property
    def tool_schemas(self) -> tuple[ToolSchema, ...]:
        """How the session's tools are described to the model, in order."""
        return self._tool_schemas

    @property
    def client_approvals(self) -> ClientApprovals | None:
        """Where approvals go when a run has no ``approve`` callback (see
        :meth:`set_client_approvals`)."""
        return self._client_approvals

    def set_tool_table(self, tools: dict[str, Tool], schemas: tuple[ToolSchema, ...]) -> None:
        """Replace the session's tools (MCP servers whose tool lists changed): the next
        request describes ``schemas`` and calls run ``tools`` (R-MCP-4)."""
        self._tools = tools
        self._tool_schemas = schemas

    def set_origin_path(self, path: tuple[str, ...]) -> None:
        """Make this session a subagent whose outputs carry ``origin`` = ``path`` (the
        session ids from the root to it, R-HOST-4)."""
        self._path = path

    def mark_closed(self) -> None:
        """The session accepts no more work (a finished subagent the host forgot)."""
        self._closed = True
        self.end_watches()


    def check_open(self) -> None:
        """Raise :class:`SessionClosed` when the session is closed, :class:`HostClosed` when its
        host is."""
        if self._closed:
            raise SessionClosed(f"session {self.id} is closed")
        self._host.check_open()

    def new_run_id(self) -> str:
        """The run id reserved for the next task when there is one (see :meth:`run`),
        else a new one; the reservation is used up either way."""
        reserved, self._next_run_id = self._next_run_id, None
        return reserved or "run_" + uuid.uuid4().hex[:12]

    def next_seq(self) -> int:
        """The ``seq`` of the session's next traced output (one more than the last)."""
        self._seq += 1
        return self._seq

    def write_record(self, output: Output) -> int:
        """Write the record; returns the trace sink's batch that will hold it."""
        assert output.seq is not None  # traced outputs carry their seq
        return self._host.trace_store.append(self.id, output.seq, encode_record(output))

    async def sync_trace(self) -> None:
        """Wait until the session's trace is durable on disk (R-TRACE-2). Raises
        :class:`TraceWriteError` for a write failure, :class:`TraceSinkClosed` once the sink is
        closed."""
        await self._host.trace_store.sync(self.id)

    async def sync_trace_quietly(self) -> str | None:
        """Sync for teardown paths that must finish whatever the disk does: a write
        failure is returned (and stays recorded in the sink), never raised."""
        try:
            await self.sync_trace()
        except (TraceWriteError, TraceSinkClosed) as exc:
            return str(exc)
        return None

    def record_usage(
        self,
        run_id: str,
        turn: int,
        usage: TokenUsage,
        *,
        kind: UsageKind = "request",
        status: str = "ok",
        error_message: str | None = None,
    ) -> None:
        """Record the token usage of one request (or compaction) of run ``run_id`` in the host's
        usage table, with the session's provider and model."""
        self._host.trace_store.record_usage(
            UsageRow(
                at=time.time(),
                session_id=self.id,
                run_id=run_id,
                turn=turn,
                kind=kind,
                provider=self._provider.name,
                model=self.settings.model,
                usage=usage,
                status=status,
                error_message=error_message,
            )
        )

    def rotate_trace(self) -> str:
        """Start the next trace file (after a successful compaction); returns its name."""
        return self._host.trace_store.rotate(self.id)

    def publish(self, batch: list[Output]) -> None:
        """Hand an emitted batch to every subscriber and watch, synchronously and in the order
        they were added. A subscriber that raises is ignored; it cannot reach the task that
        publishes. A watch only receives the batch on its inbox (:meth:`Session.watch`)."""
        if self._listeners:
            # A copy: a listener may unsubscribe itself. A listener that raises is a bug
            # of its owner; it must not take the session (or the host) down.
            for listener in tuple(self._listeners):
                with contextlib.suppress(Exception):
                    listener(batch)

    def end_watches(self) -> None:
        """Close the inbox of every watch (:meth:`Session.watch`): the session publishes
        nothing more, and each watcher's receive side ends after the batches it holds."""
        for listener in tuple(self._listeners or ()):
            if isinstance(listener, _Watch):
                listener.end()

    def take_follow_up(self) -> TaskInput | None:
        """The next queued follow-up task, removed from the queue, or None when none is queued."""
        return self._follow_ups.pop(0) if self._follow_ups else None

    def approval_rules(self) -> frozenset[str]:
        """The tools allowed "for this session" (R-APPROVE-4): a running task's approval
        broker starts from these and keeps its own copy."""
        return frozenset(self._session_rules or ())

    def allow_for_session(self, tool: str) -> None:
        """Allow ``tool`` without asking for the rest of the session (R-APPROVE-4); the
        supervisor records each ``allow_session`` decision here."""
        if self._session_rules is None:
            self._session_rules = set()
        self._session_rules.add(tool)

    def task_finished(self, control: trio.MemorySendChannel[SessionControl]) -> None:
        """The supervisor of ``control`` is done: the session becomes idle (:meth:`wait_idle`
        returns) unless another task has taken it over since."""
        if self._control is control:
            self._control = None
            self._follow_ups = None
            if self._idle is not None:
                self._idle.set()
                self._idle = None
            if not self._session_rules:
                self._session_rules = None

    def lock_auth(self, message: str) -> None:
        """Lock the session after an auth failure: no task starts until :meth:`retry_auth`
        (R-RETRY-6)."""
        self.auth_locked = message



class Session(SessionCore):
    """A conversation: model, workspace, tools, approval rules, history and trace.

    Create or load sessions through :class:`~greenroom.actors.runtime.host.Host`. Methods that
    start work are synchronous and return at once; they raise :class:`Busy`,
    :class:`AuthLocked` or :class:`SessionClosed` instead of queueing silently.
    """

    __slots__ = ()

    @property
    def has_follow_ups(self) -> bool:
        """Whether tasks are queued behind the running one (R-STEER-6)."""
        return bool(self._follow_ups)

    @property
    def busy(self) -> bool:
        """Whether a task (or a manual compaction) is running."""
        return self._control is not None

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The session's tools, in order."""
        return tuple(self._tools.values())

    def run(
        self,
        new_messages: Sequence[UserContent] | str,
        *,
        approve: ApproveFn | None = None,
        cancel: trio.Event | None = None,
        thinking_level: str | None = None,
    ) -> RunStream:
        """Start a task on ``new_messages`` (R-RUN-1) and return its outputs.

        ``approve`` decides each tool call (R-APPROVE); without it, and without a client
        able to answer, calls are denied. Setting ``cancel`` interrupts the task, like
        :meth:`interrupt`. Raises :class:`Busy` when a task or compaction is running
        (R-HOST-2), :class:`AuthLocked` after an auth failure (R-RETRY-6), and
        ``RuntimeError`` when called outside a trio task.
        """
        require_trio()
        self.check_open()
        if self.auth_locked is not None:
            raise AuthLocked(
                f"session {self.id} is locked by an auth failure ({self.auth_locked}); "
                "update its credentials or call retry_auth()"
            )
        if self._control is not None:
            raise Busy(f"session {self.id} is already running a task; use follow_up()")
        task = TaskInput(
            content=_as_content(new_messages), approve=approve, thinking_level=thinking_level
        )
        # Unbounded: a slow reader never stalls the model stream or the tools; outputs
        # are small and a run's count is bounded by its work.
        send, receive = trio.open_memory_channel[list[Output]](float("inf"))
        supervisor = SessionSupervisor(self, task, send, cancel)
        self._control = supervisor.control
        self._idle = trio.Event()
        # Reserved now so that callers (the websocket gateway's ``run``) can report the
        # run id before the supervisor task has started; its first task takes it.
        run_id = self._next_run_id = self.new_run_id()
        self._host.start_task(supervisor.run)
        return RunStream(receive, supervisor.control, run_id)

    def steer(self, messages: Sequence[UserContent] | str) -> bool:
        """Queue user input for the running task without interrupting it (R-STEER-1).
        Returns False when no task is running (start a normal task instead)."""
        if self._control is None:
            return False
        _send(self._control, SteeringQueued(content=_as_content(messages)))
        return True

    def follow_up(
        self,
        messages: Sequence[UserContent] | str,
        *,
        approve: ApproveFn | None = None,
        thinking_level: str | None = None,
    ) -> bool:
        """Queue a whole new task to run after the current one, FIFO (R-STEER-6). Its
        outputs continue the running ``RunStream``. Returns False when idle."""
        if self._control is None:
            return False
        if self._follow_ups is None:
            self._follow_ups = []
        self._follow_ups.append(
            TaskInput(content=_as_content(messages), approve=approve, thinking_level=thinking_level)
        )
        return True

    def interrupt(self, reason: str = "interrupted by host") -> bool:
        """Interrupt the running task (R-ABORT-1). Returns False when idle."""
        if self._control is None:
            return False
        self._follow_ups = None
        _send(self._control, InterruptTask(reason=reason))
        return True

    def skip_reconnect_wait(self) -> bool:
        """End the current reconnect backoff early (R-RETRY-5). False when idle."""
        if self._control is None:
            return False
        _send(self._control, BackoffSkipped())
        return True

    def retry_auth(self) -> None:
        """Unlock a session locked by an auth failure (R-RETRY-6)."""
        self.auth_locked = None

    def compactability(self) -> Compactability:
        """Whether a manual compaction could do anything now (R-COMPACT-10): ``empty``
        (nothing to summarize), ``just_compacted`` (the context is a fresh summary),
        ``unsupported`` (the session's model cannot be asked: locked by an auth failure),
        else ``ok``."""
        transcript = self._transcript
        if self.auth_locked is not None:
            return "unsupported"
        if (
            not transcript.messages
            and not transcript.has_pending_input()
            and not (transcript.carry_over)
        ):
            return "empty"
        if transcript.just_compacted:
            return "just_compacted"
        return "ok"

    async def compact(self) -> CompactionEnd | None:
        """Compact the context now (R-COMPACT-2 ``manual``) and return the
        ``compaction_end`` output; None when :meth:`compactability` is not ``ok``. Its
        outputs also reach subscribers and the trace. Raises :class:`Busy` while a task
        or another compaction runs (R-COMPACT-11)."""
        self.check_open()
        if self._control is not None:
            raise Busy(f"session {self.id} is busy; compact when the task has ended")
        if self.compactability() != "ok":
            return None
        # Unbounded, as for run(): a slow reader never stalls the summary request.
        send, receive = trio.open_memory_channel[list[Output]](float("inf"))
        supervisor = SessionSupervisor(self, None, send, None)
        self._control = supervisor.control
        self._idle = trio.Event()
        self._host.start_task(supervisor.run)
        end: CompactionEnd | None = None
        async for output in RunStream(receive, supervisor.control):
            if isinstance(output, CompactionEnd):
                end = output
        return end

    async def generate_title(self, *, max_chars: int = 60) -> str:
        """A short title for the conversation from a separate one-shot model call: no
        tools, no system prompt, never written to history or trace, and independent of
        any running task (R-HOST-5). Its usage is recorded in the ledger as ``title``.
        Returns "" when there is nothing to title or the call fails."""
        excerpt = _title_material(self._transcript)
        if not excerpt:
            return ""
        request = ModelRequest(
            model=self.settings.model,
            system=None,
            tools=(),
            messages=(
                UserMessage(
                    content=(
                        TextBlock(text=f"{markers.TITLE_PROMPT}\n\n{excerpt}"),
                    )
                ),
            ),
            max_tokens=64,
        )
        parts: list[str] = []
        usage: TokenUsage | None = None
        # The one path to the model (R-ACTOR-4): a streamer of its own, so the title never
        # waits for a task's attempts. Unbounded: both sides send with send_nowait.
        batches_send, batches = trio.open_memory_channel[SupervisorMessage](math.inf)
        commands_send, commands = trio.open_memory_channel[StreamerCommand](math.inf)
        streamer = LLMStreamer(self._provider.open_task(), batches_send)
        async with trio.open_nursery() as nursery:
            await nursery.start(streamer.run, commands)
            commands_send.send_nowait(StartAttempt(request=request, attempt=1, delay_ms=0))
            completed = False
            async for batch in batches:
                assert isinstance(batch, StreamBatch)
                for event in batch.events:
                    if isinstance(event, TextDelta):
                        parts.append(event.text)
                    elif isinstance(event, MessageCompleted):
                        usage, completed = event.usage, True
                    elif isinstance(event, StreamFailed):
                        completed = True
                if completed:
                    break
            nursery.cancel_scope.cancel()
        if usage is not None:
            self.record_usage("", 0, usage, kind="title")
        title = " ".join("".join(parts).split()).strip().strip("\"'")
        return title[:max_chars]

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every batch of outputs from now on; returns the
        function that unsubscribes. The listener runs inside the publishing task, so it
        must neither block nor raise; a watcher that is a task of its own uses
        :meth:`watch` instead."""
        if self._listeners is None:
            self._listeners = []
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if self._listeners is not None and listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def watch(self, inbox: trio.MemorySendChannel[list[Output]]) -> None:
        """Send every batch published from now on to ``inbox``, in order (R-ACTOR-1): the
        watcher is a task of its own that opens the channel, hands the session its send
        side and drains the receive side. The publisher never waits: each batch is sent
        with ``send_nowait``, so the buffer the watcher chooses says what happens when it
        falls behind.

        The session owns ``inbox`` from now on and closes it when the watch ends: when
        the watcher closes its receive side (noticed at the next batch, then forgotten),
        when ``inbox`` is full (the watcher is cut off rather than grow: its receive side
        ends after the batches it holds; the trace has the rest), and when the session
        closes (:meth:`end_watches`). The watcher may send its own markers on ``inbox``
        while the watch lasts; they keep their place among the batches (it is FIFO)."""
        if self._listeners is None:
            self._listeners = []
        self._listeners.append(_Watch(inbox, self._listeners))

    def set_client_approvals(self, approvals: ClientApprovals | None) -> None:
        """Where approvals go when a run has no ``approve`` callback: the inbox of the
        actor that asks this session's clients (the gateway's hub for it). The broker
        sends it :class:`~greenroom.protocols.messages.AskClients` for each call and
        :class:`~greenroom.protocols.messages.AskWithdrawn` when it stops waiting; see
        those messages for the answers it expects."""
        self._client_approvals = approvals

    async def wait_idle(self) -> None:
        """Return when no task is running."""
        if self._idle is not None:
            await self._idle.wait()

    async def aclose(self) -> None:
        """Interrupt any running task and wait until it has finished writing
        (R-HOST-3). The session accepts no more work."""
        self._closed = True
        self.interrupt("session closed")
        if self._idle is not None:
            await self._idle.wait()
        await self.sync_trace_quietly()
        self.end_watches()

    async def run_as_child(
        self,
        content: Sequence[UserContent] | str,
        *,
        approve: ApproveFn | None,
        outputs: trio.MemorySendChannel[list[Output]],
        reason: str = "parent task interrupted",
    ) -> None:
        """Run one task as a subagent in the calling task — a tool call of the parent
        session's task — instead of the host's nursery, and return when it has ended.

        Every batch of its outputs, from the first, is sent on ``outputs`` (there is no
        ``RunStream``), which is closed when the task has ended; the caller drains it
        concurrently. Cancelling the caller interrupts the subagent with ``reason``: the
        subagent runs shielded, so it settles and records its own ``abort`` and
        ``task_end(aborted)`` in its trace (bounded by the supervisor's teardown grace)
        before the cancellation goes on to the caller."""
        self.check_open()
        if self._control is not None:
            raise Busy(f"session {self.id} is already running a task")
        task = TaskInput(content=_as_content(content), approve=approve, thinking_level=None)
        supervisor = SessionSupervisor(self, task, outputs, None)
        self._control = control = supervisor.control
        self._idle = trio.Event()
        finished = trio.Event()

        async def run_shielded() -> None:
            try:
                with trio.CancelScope(shield=True):
                    await supervisor.run()
            finally:
                finished.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_shielded)
            try:
                await finished.wait()
            except trio.Cancelled:
                _send(control, InterruptTask(reason=reason))
                raise

    def clear_client_approvals(self, approvals: ClientApprovals) -> bool:
        """Forget ``approvals`` if they are still where approvals go (a watcher that stops
        never removes the one another watcher installed since); True when they were."""
        if self._client_approvals is not approvals:
            return False
        self._client_approvals = None
        return True


def _send(control: trio.MemorySendChannel[SessionControl], message: SessionControl) -> None:
    # A supervisor that has just ended closed its control inbox: nothing is left to steer.
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        control.send_nowait(message)
