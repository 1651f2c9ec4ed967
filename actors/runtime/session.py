"""Sessions: the public handle of a long-lived conversation, and the run iterator.

A :class:`Session` is the user's API and nothing else. Its data — settings, tools, the
model context, the task state, the trace position — is held by its
:class:`~greenroom.actors.runtime.port.SessionPort`, which the runtime's work uses; so an
idle session costs its history and little more. ``run()`` starts a
:class:`~greenroom.actors.runtime.supervisor.SessionSupervisor` in the host's nursery, which
ends with the work; while it runs, every method reaches it by sending a message to its
inbox (R-ACTOR-1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, assert_never, cast

import attrs
import trio

from greenroom.actors.runtime.attachments import Attachments, accept_data, attach
from greenroom.actors.runtime.errors import (
    AuthLocked,
    Busy,
    ConfigurationError,
    HostClosed,
    InputTooLarge,
    SessionClosed,
)
from greenroom.actors.runtime.llm_streamer import LLMStreamer, ModelProvider
from greenroom.actors.runtime.port import (
    Approval,
    Listener,
    SessionPort,
    TaskInput,
)
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.runtime.supervisor import end_left_work, start
from greenroom.actors.runtime.time_travel import rewind_to
from greenroom.actors.runtime.tree import end_subtree
from greenroom.protocols import markers
from greenroom.protocols.content import ImageBlock, TextBlock, UserContent
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.errors import OutputSchemaError
from greenroom.protocols.hooks import Hooks
from greenroom.protocols.messages import (
    AuthRetried,
    BackoffSkipped,
    InterruptScope,
    InterruptTask,
    StartAttempt,
    SteeringQueued,
    StreamBatch,
    StreamerCommand,
    SupervisorMessage,
    TaskQueued,
)
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
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
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.stream import ResponseCollector
from greenroom.protocols.structured import FINAL_ANSWER, OutputSpec, output_spec
from greenroom.protocols.tools import Editor, Tool, WorkspaceIdentity
from greenroom.protocols.trace import input_size
from greenroom.protocols.transcript import Transcript
from greenroom.protocols.wording import clip_words

if TYPE_CHECKING:
    from greenroom.actors.runtime.host import Host
    from greenroom.actors.tools.mcp_commands import McpView

__all__ = [
    "Compactability",
    "RunResult",
    "RunStream",
    "Session",
    "client_tools_problem",
    "require_trio",
    "settled",
]

Compactability = Literal["ok", "unsupported", "empty", "just_compacted"]


def _as_content(messages: Sequence[UserContent] | str) -> tuple[UserContent, ...]:
    if isinstance(messages, str):
        return (TextBlock(text=messages),)
    return tuple(messages)


def _recordable(
    port: SessionPort, messages: Sequence[UserContent] | str, output: OutputSpec | None = None
) -> tuple[UserContent, ...]:
    """``messages`` as input, or :class:`InputTooLarge` when their record (with the
    task's output schema) is larger than the session's trace carries: recorded, it
    stopped the session on its host (a cluster's); refused here, nothing is recorded
    (R-SEC-9, R-CLUSTER-2)."""
    content = _as_content(messages)
    most = port.host.trace_log.largest_input()
    if most is not None:
        size = input_size(content, output.schema if output is not None else None)
        if size > most:
            raise InputTooLarge(size, most)
    return content


def _title_material(transcript: Transcript, limit: int = 2000) -> str:
    """The first user texts of the context: what a title is made from."""
    texts: list[str] = []
    for message in transcript.request_messages():
        if isinstance(message, UserMessage):
            texts.extend(p.text for p in message.content if isinstance(p, TextBlock))
        if sum(len(t) for t in texts) >= limit:
            break
    return "\n".join(texts)[:limit]


def _output_spec(port: SessionPort, schema: Any) -> OutputSpec | None:
    """The answer a run requires (R-OUT-1), or None; :class:`OutputSchemaError` when
    ``schema`` cannot be one, or the session has a tool of the final answer's name."""
    if schema is None:
        return None
    spec = output_spec(schema)
    if FINAL_ANSWER in port.tool_by_name:
        raise OutputSchemaError(
            f"the session has a tool named {FINAL_ANSWER!r}, the name structured answers "
            "are given through: rename it to run with an output_schema"
        )
    return spec


TRIO_REQUIRED = "greenroom runs on trio: use trio.run(...)"


Recorded = InputReceipt | None
"""What ``Session.steer`` and ``follow_up`` fill in once their input's record survives the
host, or it is dropped unrun."""


def _follow_up_task(
    port: SessionPort,
    messages: Sequence[UserContent] | str,
    approve: Approval,
    thinking_level: str | None,
    output_schema: Any,
) -> TaskInput:
    """The task a follow-up queues (its ``output_schema`` checked: R-OUT-1)."""
    output = _output_spec(port, output_schema)
    return TaskInput(
        content=_recordable(port, messages, output),
        approve=approve,
        thinking_level=thinking_level,
        output=output,
    )


def _queue_input(port: SessionPort, message: SteeringQueued | TaskQueued) -> bool:
    """Hand a caller's steering or follow-up to the session's work (``Session.steer``,
    ``follow_up``). :class:`SessionClosed` once the session's close has begun, also while
    its interrupted task still ends: every caller then gets the answer a closed session
    gives, never a False that tells it to start a task the session refuses."""
    if port.closed:
        raise SessionClosed(f"session {port.id} is closed")
    return port.deliver(message)


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
        output: for a run with an ``output_schema`` that completed, the validated answer
            (R-OUT-1): a dict, or an instance of the attrs class given; else None.
    """

    text: str
    task_end: TaskEnd
    output: Any = None

    @property
    def status(self) -> TaskStatus:
        """``task_end.status``: ``completed`` when the task ran to its answer."""
        return self.task_end.status


class RunStream:
    """The outputs of one ``Session.run``: an async iterator that ends after the last
    ``task_end`` (of the task and of any follow-ups queued behind it).

    Outputs arrive from the supervisor in batches over a memory channel; iterating hands
    them out one by one. ``aclose()`` (or leaving ``async with``) interrupts the work if it
    is still running (the session's task, not its background subagents). Breaking out of
    the loop without closing leaves the task running to its end; its outputs still reach
    the trace and subscribers.

    While iterating, the stream keeps what most hosts would otherwise track by hand:
    :attr:`final_text` (the text of the model's last message) and :attr:`task_end`.
    ``await stream.result()`` reads whatever is left and returns both as a
    :class:`RunResult`. Outputs forwarded from subagents (``origin`` set) never count.
    """

    __slots__ = (
        "_batch",
        "_deliver",
        "_first_run_id",
        "_index",
        "_output",
        "_receive",
        "_run_id",
        "_task_end",
        "_texts",
    )

    def __init__(
        self,
        receive: trio.MemoryReceiveChannel[list[Output]],
        deliver: Callable[[SupervisorMessage], bool],
        first_run_id: str = "",
        output: OutputSpec | None = None,
    ) -> None:
        self._receive = receive
        self._output = output
        # The session's way to its work (``SessionPort.deliver``), not one supervisor's
        # inbox: a run that parks on people is taken up by another supervisor (R-HITL-3),
        # and a reader holding the first one's inbox would keep that dead channel alive
        # and could no longer interrupt its own run.
        self._deliver = deliver
        self._run_id = self._first_run_id = first_run_id
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
        if output.__class__ is not PartialText and output.origin is None:
            self._note(output)
        return output

    def _note(self, output: Output) -> None:
        self._run_id = output.run_id
        match output:
            case PartialText() | PartialThinking() | PartialToolCall():
                pass  # first: nearly every output of a run is one of these
            case RequestBegin() | TaskStart():
                self._texts = []  # the answer is the last model message's text
            case ModelMsg():
                if isinstance(output.block, TextBlock):
                    self._texts.append(output.block.text)
            case TaskEnd():
                self._task_end = output
            case (
                UserMsg()
                | TokenUsageOutput()
                | RequestEnd()
                | ApprovalRequest()
                | ApprovalDecision()
                | ToolHook()
                | ToolProgress()
                | ToolCallOutput()
                | Abort()
                | CompactionBegin()
                | CompactionEnd()
                | CallInDoubt()
                | CallResolved()
                | Rewind()
                | TaskQueuedOutput()
                | TaskQueueDropped()
                | SteeringQueuedOutput()
            ):
                pass
            case _:
                assert_never(output)

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
        stream ended without a ``task_end``: after :meth:`detach`, or when the session
        closed while the task waited for people (the task stays pending in its trace);
        :class:`OutputSchemaError` when the attrs class of ``output_schema`` refuses an
        answer that matches its schema (its own validators are stricter).
        """
        async for _ in self:
            pass
        end = self._task_end
        if end is None:
            raise RuntimeError(
                "the run's outputs ended without a task_end (detached, or the session "
                "closed while the task waited for people)"
            )
        output: Any = end.output
        if output is not None and self._output is not None and end.run_id == self._first_run_id:
            output = self._output.build(output)
        return RunResult(text=self.final_text, task_end=end, output=output)

    async def collect(self) -> list[Output]:
        """Every remaining output, once the run has ended."""
        return [output async for output in self]

    async def accepted(self) -> None:
        """Return once the run's task has started — its prompt is durable, so whoever
        takes the session up after this host stops starts the run if this host did not
        (R-TRACE-3, R-CLUSTER-2) — or has ended without starting (a refused image, an
        interrupt). What is read meanwhile is still handed out by iteration."""
        ahead = self._batch = self._batch[self._index :]
        self._index = 0
        while not any(_opens_or_ends(output) for output in ahead):
            try:
                ahead.extend(await self._receive.receive())
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return

    def detach(self) -> None:
        """Stop receiving without interrupting: the task (and its follow-ups) runs on,
        its outputs still reach the trace and subscribers, and none pile up here. For
        hosts that watch through ``Session.subscribe`` (the websocket gateway)."""
        self._receive.close()

    async def aclose(self) -> None:
        """Interrupt the run if it is still going — running, or parked on a person's
        answer (it wakes to end) — and stop receiving. The run is its task (with its
        foreground subagents) and the follow-ups queued behind it: the interrupt has scope
        ``node``, so background subagents run on, and their answers still reach the
        session as follow-up tasks (``Session.interrupt(scope="tree")`` ends them)."""
        if self._receive.statistics().open_send_channels:
            # The run's work still holds the other end (its supervisor, or the parked
            # task: R-HITL-3), so the session's work is this run's. A background child
            # is not (R-TREE-2: its spawning call returned), whichever run started it.
            self._deliver(InterruptTask(reason="run closed by host", scope="node"))
        await self._receive.aclose()

    async def __aenter__(self) -> RunStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _opens_or_ends(output: Output) -> bool:
    return output.origin is None and isinstance(output, TaskStart | TaskEnd)


def client_tools_problem(own: frozenset[str], tools: Sequence[Tool]) -> str | None:
    """Why ``tools`` cannot be a session's client tools: one is not client-side, takes
    the name of one of the session's own tools (``own``), or two share a name."""
    names: set[str] = set()
    for given in tools:
        if not given.client_side:
            return f"tool {given.name!r} is not a client-side tool"
        if given.name in own:
            return f"a client tool may not be named {given.name!r}: the session has one"
        if given.name in names:
            return f"two client tools are named {given.name!r}"
        names.add(given.name)
    return None


async def _compaction_end(stream: RunStream) -> CompactionEnd | None:
    """The ``compaction_end`` of a manual compaction's ``stream``, read until the session
    is idle again or a task queued meanwhile starts."""
    end: CompactionEnd | None = None
    try:
        async for output in stream:
            if output.origin is not None:
                continue
            if isinstance(output, CompactionEnd) and end is None:
                end = output
            elif isinstance(output, TaskStart) and end is not None:
                # A follow-up queued meanwhile is a task of its own, which may wait long
                # (for a person's answer); the compaction's caller does not wait for it.
                break
    finally:
        # Also when the caller is cancelled: the outputs of what runs on pile up nowhere.
        stream.detach()
    return end


class Session:
    """A conversation: model, workspace, tools, approval rules, history and trace.

    Create or load sessions through :class:`~greenroom.actors.runtime.host.Host`. Methods that
    start work are synchronous and return at once; they raise :class:`Busy`,
    :class:`AuthLocked` or :class:`SessionClosed` instead of queueing silently. While a task
    runs, every method reaches it by a message to its supervisor's inbox.
    """

    __slots__ = ("_host_open", "_port")

    def __init__(self, port: SessionPort, host_open: Callable[[], bool]) -> None:
        self._port = port
        self._host_open = host_open

    # -- what the session is ----------------------------------------------------------------

    @property
    def id(self) -> str:
        """The session's id."""
        return self._port.id

    @property
    def host(self) -> Host:
        """The host that runs this session."""
        return cast("Host", self._port.host)

    @property
    def parent_id(self) -> str | None:
        """The session that spawned this one as a subagent (R-HOST-4), else None."""
        return self._port.parent_id

    @property
    def root_id(self) -> str:
        """The root of this session's tree: its own id unless it is a subagent
        (R-TREE-1)."""
        return self._port.root_id

    @property
    def origin(self) -> tuple[str, ...]:
        """The session ids from the root of its tree to this session (the ``origin`` its
        outputs carry in its ancestors' streams)."""
        return self._port.origin_path

    @property
    def forked_from(self) -> tuple[str, int] | None:
        """The session and the seq this one was forked from (R-FORK-1), else None."""
        return self._port.forked_from

    async def children(self) -> list[Session]:
        """The subagents this session spawned, running and finished, oldest first
        (R-TREE-1): each a session of its own — steer, interrupt, watch or answer it like
        any. A finished one is loaded (it stays open in the host until closed); one that
        cannot be read is left out."""
        return await self.host.children_of(self.id)

    @property
    def settings(self) -> SessionSettings:
        """The session's settings (stored with it)."""
        return self._port.settings

    @property
    def workspace_dir(self) -> Path:
        """The directory the session's tools work in."""
        return self._port.workspace_dir

    @property
    def workspace_identity(self) -> WorkspaceIdentity | None:
        """The directory the workspace was when the session was created (R-SEC-7): its
        tools work there only, whatever later stands at its path."""
        return self._port.workspace_identity

    @property
    def directory(self) -> Path:
        """The session's directory in the data dir (``session.json``, traces, scratch)."""
        return self._port.directory

    @property
    def scratchpad_dir(self) -> Path:
        """The session's scratch directory, inside its session directory."""
        return self._port.scratchpad_dir

    @property
    def attachments(self) -> Attachments:
        """Where the session keeps its private copies of images and which directories
        named files are walked beneath (R-SEC-8)."""
        return self._port.attachments

    @property
    def trace_path(self) -> Path:
        """The current trace file (one model context: R-COMPACT-8)."""
        return self._port.trace_path

    @property
    def transcript(self) -> Transcript:
        """The model context as a pure function of the traced outputs (read it, never
        change it)."""
        return self._port.transcript

    @property
    def provider(self) -> ModelProvider:
        """The model provider adapter this session's requests go through."""
        return self._port.provider

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The session's tools, in order."""
        return tuple(self._port.tool_by_name.values())

    def set_client_tools(self, tools: Sequence[Tool]) -> None:
        """Offer the next tasks ``tools`` that a client runs (:func:`~greenroom.protocols.
        tools.client_tool`: an AG-UI front end's, R-PROTO-2) instead of those given before;
        a call waits for the client's result (``host.answer_question``). Raises
        :class:`ConfigurationError` (:func:`client_tools_problem`)."""
        if (problem := client_tools_problem(self._port.own_tool_names(), tools)) is not None:
            raise ConfigurationError(problem)
        self._port.set_client_tools(tuple(tools))

    @property
    def mcp(self) -> McpView | None:
        """The prompts and resources of the session's MCP servers (R-MCP-5); None without."""
        return self._port.mcp

    @property
    def hooks(self) -> Hooks:
        """Host hooks at the loop's checkpoints (R-HOOK-1) and around tool calls (R-HOOK-2);
        assign to change them (a task takes them when it starts)."""
        return self._port.hooks

    @hooks.setter
    def hooks(self, hooks: Hooks) -> None:
        """Replace the session's hooks (the next task takes them)."""
        self._port.hooks = hooks

    @property
    def editor(self) -> Editor | None:
        """The editor that drives the session when it offers its files and terminal
        (R-ACP-2: :attr:`~greenroom.protocols.tools.ToolContext.editor`); None: the disk."""
        return self._port.editor

    @editor.setter
    def editor(self, editor: Editor | None) -> None:
        """Set the session's editor (a task takes it when it starts)."""
        self._port.editor = editor

    @property
    def load_errors(self) -> Sequence[str]:
        """The trace lines that could not be read when the session was loaded."""
        return self._port.load_errors

    @property
    def auth_locked(self) -> str | None:
        """Why the session refuses new tasks after an auth failure (R-RETRY-6), or None."""
        return self._port.machine.auth_locked

    @property
    def busy(self) -> bool:
        """Whether a task (or a manual compaction) is running — or waits for a person's
        answer with nothing in memory (parked: R-HITL-3)."""
        return self._port.busy

    @property
    def has_follow_ups(self) -> bool:
        """Whether tasks are queued behind the running one (R-STEER-6)."""
        return self.busy and self._port.machine.has_queued_tasks

    # -- work ---------------------------------------------------------------------------------

    def check_open(self) -> None:
        """Raise :class:`SessionClosed` when the session is closed, :class:`HostClosed`
        when its host is."""
        if self._port.closed:
            raise SessionClosed(f"session {self.id} is closed")
        if not self._host_open():
            raise HostClosed("the host is closed")

    def _check_takes_tasks(self) -> None:
        """:meth:`check_open`, and :class:`HostClosed` while the host drains (R-DRAIN-1)."""
        self.check_open()
        if self._port.host.draining:
            raise HostClosed(
                "the host is shutting down (draining): run the task again once it is back, "
                "or on another host"
            )

    def _start(
        self, task: TaskInput | None, cancel: trio.Event | None
    ) -> tuple[trio.MemoryReceiveChannel[list[Output]], str]:
        port = self._port
        # Unbounded: a slow reader never stalls the model stream or the tools; outputs
        # are small and a run's count is bounded by its work.
        send, receive = trio.open_memory_channel[list[Output]](math.inf)
        # Reserved now so that callers (the websocket gateway's ``run``) can report the
        # run id before the supervisor task has started; its first task takes it.
        run_id = port.reserve_run_id()
        start(port, task, send, cancel)
        return receive, run_id

    def run(
        self,
        new_messages: Sequence[UserContent] | str,
        *,
        approve: Approval = None,
        cancel: trio.Event | None = None,
        thinking_level: str | None = None,
        output_schema: Any = None,
    ) -> RunStream:
        """Start a task on ``new_messages`` (R-RUN-1) and return its outputs.

        ``approve`` decides each tool call (R-APPROVE): a callback, or ``"people"`` (each
        call waits for a person's answer, from any surface: R-HITL); without it calls are
        denied. Setting ``cancel`` interrupts the task, like :meth:`interrupt` — a task
        parked on people when something wakes it, since nothing watches the event
        meanwhile. Raises :class:`Busy` when a task or compaction is running (R-HOST-2),
        :class:`AuthLocked` after an auth failure (R-RETRY-6), :class:`InputTooLarge` for
        input a record of the session's trace cannot carry (a cluster's: R-SEC-9; so do
        :meth:`steer` and :meth:`follow_up`), and ``RuntimeError`` outside a trio task.

        Images not yet attached (:meth:`attach`) are attached by the task before its
        input is recorded; one that is refused ends the task ``failed`` at once, its
        ``task_end`` message naming the file and why, with nothing recorded or sent. The
        same holds for :meth:`follow_up`; in :meth:`steer` input a refused image becomes
        the text ``[image refused: <path>: <reason>]``.

        ``output_schema`` (a JSON Schema dict, an attrs class or a ``TypedDict``) makes the
        answer structured (R-OUT-1): ``result().output`` and ``task_end.output``; an
        unusable one raises :class:`OutputSchemaError` (a ``ValueError``).
        """
        require_trio()
        self._check_takes_tasks()
        locked = self.auth_locked
        if locked is not None:
            raise AuthLocked(
                f"session {self.id} is locked by an auth failure ({locked}); "
                "update its credentials or call retry_auth()"
            )
        port = self._port
        if port.parked:
            raise Busy(
                f"session {self.id} has a task waiting for a person's answer "
                "(listed with the pending approvals); answer or interrupt it first"
            )
        if self.busy:
            raise Busy(f"session {self.id} is already running a task; use follow_up()")
        output = _output_spec(port, output_schema)
        port.recover_open_task()
        task = TaskInput(
            content=_recordable(port, new_messages, output),
            approve=approve,
            thinking_level=thinking_level,
            output=output,
        )
        receive, run_id = self._start(task, cancel)
        return RunStream(receive, self._port.deliver, run_id, output)

    async def attach(
        self, messages: Sequence[UserContent] | str, *, confine: bool = False
    ) -> tuple[UserContent, ...]:
        """Read the images of ``messages`` now, once, and return the input ready for
        :meth:`run`, :meth:`steer` or :meth:`follow_up` (R-SEC-8).

        Each image file is read off the event loop — never through a symbolic link as its
        last component nor through one that leads out of the workspace or scratchpad,
        regular files only, at most ``max_image_bytes`` — and its bytes are copied into the
        session's private attachments; the returned blocks carry their hash, and every
        request of the session sends those bytes, whatever becomes of the file. Relative
        paths are taken from the workspace. With ``confine``, paths outside the workspace
        and the scratchpad are refused too (what a remote client may name).

        Raises :class:`ImageRefused` naming the first image that cannot be attached and
        why; nothing is queued or started then. Input given to ``run`` and the others
        without this step is attached by the task when it takes it (see :meth:`run`)."""
        self.check_open()
        return await attach(_as_content(messages), self._port.attachments, confine=confine)

    async def attach_image_data(self, data: bytes | str, media_type: str) -> ImageBlock:
        """An image given as its bytes, or as base64 text (an editor's inline image),
        attached like a file's (R-SEC-8): stored in the session's private attachments off
        the event loop, the base64 text measured against ``max_image_bytes`` before it is
        decoded. Returns the block (its path is ``inline-<hash prefix>.<ext>``); raises
        :class:`ImageRefused` when it is not base64, empty, over the limit or not of an
        ``image/`` type."""
        self.check_open()
        return await trio.to_thread.run_sync(accept_data, data, media_type, self._port.attachments)

    def steer(self, messages: Sequence[UserContent] | str, *, recorded: Recorded = None) -> bool:
        """Queue user input for the running task without interrupting it (R-STEER-1);
        recorded (``steering_queued``), it reaches the task on a host that takes it up:
        ``recorded``, an :class:`InputReceipt`, settles once that record survives this host
        (fsynced; in a cluster, acknowledged by JetStream), or as dropped if it never runs.
        Returns False when no task is running (start a normal task instead); raises
        :class:`SessionClosed` once the session is closed (or closing)."""
        message = SteeringQueued(content=_recordable(self._port, messages), recorded=recorded)
        return _queue_input(self._port, message)

    def follow_up(
        self,
        messages: Sequence[UserContent] | str,
        *,
        approve: Approval = None,
        thinking_level: str | None = None,
        output_schema: Any = None,
        recorded: Recorded = None,
    ) -> bool:
        """Queue a whole new task to run after the current one, FIFO (R-STEER-6). Its
        outputs continue the running ``RunStream``. The trace records it (``task_queued``;
        ``recorded`` as for :meth:`steer`): a host that takes the session up after this
        one stopped runs it, in its place in the queue (``Host.resume``); an interrupt
        drops it. Returns False when idle; raises :class:`SessionClosed` as :meth:`steer`,
        :class:`HostClosed` while the host drains (R-DRAIN-1). ``output_schema`` as for
        :meth:`run` (R-OUT-1): the follow-up's answer is its ``task_end.output``, a dict
        (the stream's :meth:`RunStream.result` builds the run's own schema's class only)."""
        if self._port.host.draining:
            self._check_takes_tasks()
        task = _follow_up_task(self._port, messages, approve, thinking_level, output_schema)
        return _queue_input(self._port, TaskQueued(task=task, follow_up=True, recorded=recorded))

    def interrupt(
        self, reason: str = "interrupted by host", *, scope: InterruptScope = "tree"
    ) -> bool:
        """Interrupt the task, running or left open by a host that stopped under it, and
        drop the queued ones (R-ABORT-1). False when there was nothing to interrupt here.

        ``scope`` (R-TREE-2): ``tree`` (the default) also ends the session's running
        subagents and theirs, background children included — even while the session
        itself is idle, and after a restart: a descendant the trace leaves running or
        waiting for people ends too, open in this host or not (read from the store, it
        ends a moment later); ``node`` ends this session's task and its foreground
        children (their calls are interrupted), and leaves its background children
        running: their answers still reach this session, as follow-ups."""
        return _interrupt(self._port, reason, scope, asked=True)

    def skip_reconnect_wait(self) -> bool:
        """End the current reconnect backoff early (R-RETRY-5). False when idle."""
        return self._port.send(BackoffSkipped())

    def retry_auth(self) -> None:
        """Unlock a session locked by an auth failure (R-RETRY-6)."""
        if not self._port.deliver(AuthRetried()):
            self._port.machine.retry_auth()

    def compactability(self) -> Compactability:
        """Whether a manual compaction could do anything now (R-COMPACT-10): ``empty``
        (nothing to summarize), ``just_compacted`` (the context is a fresh summary),
        ``unsupported`` (the session's model cannot be asked: locked by an auth failure),
        else ``ok``."""
        transcript = self._port.transcript
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
        outputs also reach subscribers and the trace. Returns when it ends, or once a
        task queued meanwhile (:meth:`follow_up`) starts: that task runs on. Raises
        :class:`Busy` while a task or another compaction runs (R-COMPACT-11)."""
        self._check_takes_tasks()
        if self.busy:
            raise Busy(f"session {self.id} is busy; compact when the task has ended")
        if self.compactability() != "ok":
            return None
        receive, _ = self._start(None, None)
        return await _compaction_end(RunStream(receive, self._port.deliver))

    async def rewind(self, to_seq: int, *, reason: str | None = None) -> Rewind:
        """Rewind the session to ``to_seq`` (R-FORK-2): it continues from the history it
        had at that record (0: an empty one); the later records stay in the trace behind
        the ``rewind`` record returned, which subscribers see like any output. A task the
        point leaves open ends aborted, as an interrupt ends it. Workspace files are not
        rewound. Raises :class:`Busy` while a task runs, and :class:`SeqRefused` for a
        point the history does not have (out of range, or cut by an earlier rewind: fork
        there instead). A point before a compaction brings back the full context the
        session had there, not the summary."""
        self._check_takes_tasks()
        if self.busy:
            raise Busy(f"session {self.id} is running a task; rewind it once the task has ended")
        return await rewind_to(self._port, to_seq, reason)

    async def generate_title(self, *, max_chars: int = 60) -> str:
        """A short title for the conversation from a separate one-shot model call: no
        tools, no system prompt, never written to history or trace, and independent of
        any running task (R-HOST-5). Its usage is recorded in the ledger as ``title``.
        Returns "" when there is nothing to title or the call fails; a title longer than
        ``max_chars`` is cut at a word and ends with ``…``."""
        return await _title(self._port, max_chars)

    # -- watching -------------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every batch of outputs from now on; returns the
        function that unsubscribes. The listener runs inside the publishing task, so it
        must neither block nor raise; a watcher that is a task of its own uses
        :meth:`watch` instead."""
        return self._port.subscribe(listener)

    def watch(
        self, inbox: trio.MemorySendChannel[list[Output]], *,
        kinds: tuple[type[Output], ...] | None = None,
    ) -> Callable[[], None]:
        """Send every batch published from now on to ``inbox``, in order (R-ACTOR-1): the
        watcher is a task of its own that opens the channel, hands the session its send
        side and drains the receive side. The publisher never waits: each batch is sent
        with ``send_nowait``, so the buffer the watcher chooses says what happens when it
        falls behind.

        The session owns ``inbox`` from now on and closes it when the watch ends: when
        the watcher closes its receive side (noticed at the next batch, then forgotten),
        when ``inbox`` is full (the watcher is cut off rather than grow: its receive side
        ends after the batches it holds; the trace has the rest), and when the session
        closes. The watcher may send its own markers on ``inbox`` while the watch lasts;
        they keep their place among the batches (it is FIFO).

        With ``kinds``, a batch is cut down to its outputs of those types, and one that
        has none is not sent: a watcher that acts on a few kinds of output (a task's start
        and end, say) is then not woken for each partial output. Returns what ends the
        watch at once (closing ``inbox``): a watcher that stops leaves nothing behind."""
        return self._port.watch(inbox, kinds=kinds)

    async def wait_idle(self) -> None:
        """Return when no task is running."""
        idle = self._port.idle
        if idle is not None:
            await idle.wait()

    async def aclose(self) -> None:
        """Interrupt any running task (one a child's answer started is held at its next
        turn boundary: R-TREE-2) and wait until it has finished writing (R-HOST-3); accept
        no more work. A task that waits only for people (parked) is not interrupted: its
        request stays pending in the trace, asked again when the session is loaded (R-HITL-1)."""
        port = self._port
        if not (port.parked or port.held):
            # A closing host closes every node on its own (a parked one stays pending);
            # closing one session ends its whole subtree with it.
            _interrupt(port, "session closed", "tree" if self._host_open() else "node")
        elif port.parked_task is not None and port.parked_task.output is not None:
            # Whoever reads the parked run (a caller's RunStream, a background subagent's
            # follower) stops here: the task goes on only where the session is loaded again.
            port.parked_task.output.close()
        port.closed = True
        await _settle_then_end_watches(port)


def _interrupt(
    port: SessionPort, reason: str, scope: InterruptScope, *, asked: bool = False
) -> bool:
    """Interrupt ``port``'s task. Scope ``tree`` ends its live children's trees. ``asked``
    (:meth:`Session.interrupt`) also ends a task its host stopped under, and with scope
    ``tree`` the descendants the live trees leave out. A close ends the live trees alone:
    a taken-up child that waits for people stays pending, a task its host stopped under
    stays open in its trace, and one a child's answer started is held (``closing``)."""
    interrupt = InterruptTask(reason=reason, scope=scope, closing=not asked)
    hit = port.deliver(interrupt)
    if not hit and asked and port.host.is_open():
        # Its trace leaves a task running, or input recorded and not started, as its host
        # stopped: ended in its trace (R-ABORT-1, R-TRACE-4).
        hit = end_left_work(port, interrupt)
    if scope != "tree":
        return hit
    # Its supervisor, when one took the interrupt, ends the live subtree itself.
    hit = hit or end_subtree(port, f"parent interrupted: {reason}")
    if asked:
        hit = port.host.child_reports.end_unreached(port, reason) or hit
    return hit


async def _settle_then_end_watches(port: SessionPort) -> None:
    """A closing session's last step: once its task is idle and its trace synced, its
    watches end — also when the host's shutdown bound cuts that short, or a watcher (a
    task of the host's) would hold the host's nursery open. Cut short, its trace is let
    go later (:func:`_release_once_settled`)."""
    try:
        await port.wait_idle()
        await port.sync_trace_quietly()
    except BaseException:
        _release_once_settled(port)
        raise
    finally:
        port.end_watches()


def _release_once_settled(port: SessionPort) -> None:
    """The close of ``port``'s session was cut short (its caller was cancelled): the host
    forgets the session without releasing its trace, which its ending task may still
    write. A task of the host's releases it — the trace log's position and the writer
    lock that keeps other hosts on the data dir out (R-TRACE) — as the close would have:
    once that task has ended and the trace is synced, never before (two writers). That
    is for a log that keeps writer locks (``cut_short``: the file log), which holds a load
    of the session here until then; another one keeps the session until it closes."""
    log = port.host.trace_log
    cut_short: Callable[[str], trio.Event | None] | None = getattr(log, "cut_short", None)
    if cut_short is None:
        return
    let_go: trio.Event | None = None

    async def settle_then_release() -> None:
        if await settled(port, let_go):
            log.release(port.id)

    try:
        port.host.start_task(settle_then_release)
    except RuntimeError:
        return  # the host's nursery has ended: its store closed, letting every lock go
    let_go = cut_short(port.id)


async def settled(port: SessionPort, let_go: trio.Event | None) -> bool:
    """Wait until the work of ``port``'s session, closed, has ended and its trace is
    synced (True), or ``let_go`` is set first (False): the host's store closed, which lets
    every lock go — a sync that hangs past the host's shutdown bound must not hold the
    host's nursery open for ever — or, for a close cut short, the session's trace was let
    go (:func:`_release_once_settled`)."""
    done = False
    async with trio.open_nursery() as nursery:
        if let_go is not None:
            nursery.start_soon(_cancel_when_set, let_go, nursery.cancel_scope)
        await port.wait_idle()
        await port.sync_trace_quietly()
        done = True
        nursery.cancel_scope.cancel()
    return done


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _title(port: SessionPort, max_chars: int) -> str:
    """:meth:`Session.generate_title` of the session of ``port``."""
    excerpt = _title_material(port.transcript)
    if not excerpt:
        return ""
    request = ModelRequest(
        model=port.settings.model,
        system=None,
        tools=(),
        messages=(UserMessage(content=(TextBlock(text=f"{markers.TITLE_PROMPT}\n\n{excerpt}"),)),),
        max_tokens=64,
    )
    response = ResponseCollector()
    # The one path to the model (R-ACTOR-4): a streamer of its own, so the title never
    # waits for a task's attempts. Unbounded: both sides send with send_nowait.
    batches_send, batches = trio.open_memory_channel[SupervisorMessage](math.inf)
    commands_send, commands = trio.open_memory_channel[StreamerCommand](math.inf)
    streamer = LLMStreamer(port.provider.open_task(), batches_send, port.requester())
    async with trio.open_nursery() as nursery:
        await nursery.start(streamer.run, commands)
        try:
            commands_send.send_nowait(StartAttempt(request=request, attempt=1, delay_ms=0))
        except trio.BrokenResourceError:
            # The streamer stopped as soon as it started (cancelled with its host's
            # shutdown): no title, and nothing to raise into whoever asked for one.
            batches_send.close()
        async for batch in batches:
            assert isinstance(batch, StreamBatch)
            if response.feed(batch.events):
                break
        nursery.cancel_scope.cancel()
    if response.usage is not None:
        port.record_usage("", 0, response.usage, kind="title")
    title = " ".join(response.text.split()).strip().strip("\"'")
    return clip_words(title, max_chars)
