"""``greenroom acp``: an Agent Client Protocol agent on stdin and stdout (R-ACP-1).

An editor (Zed, or any ACP client) starts ``greenroom acp`` and speaks newline-delimited
JSON-RPC 2.0 with it: ``initialize``, ``session/new``, ``session/load``, ``session/fork``,
``session/prompt``, ``session/cancel``, ``session/list``, ``session/set_mode``,
``session/close``; greenroom answers (a prompt with its task's usage), streams
``session/update`` notifications and asks ``session/request_permission`` before tool
calls. The frames and the mapping of outputs to updates are
:mod:`greenroom.protocols.acp`; this module does the I/O and drives sessions through their
public API only.

An editor that offers its files and terminal (R-ACP-2) gives each session an
:class:`~greenroom.actors.apps.acp_editor.EditorSession`, through which the built-in tools
read, write and (sandbox ``off``) run; the session list and the modes (the approval
policy) are :mod:`greenroom.actors.apps.acp_sessions`.

People answer when they can (R-HITL): with ``--approve ask`` tasks run with
``approve="people"``, and each request a task records is asked of the editor by
:mod:`greenroom.actors.apps.acp_people`; ``session/load`` asks again what still waits and
streams the updates of the task it takes up.

Concurrency: one task reads frames and dispatches them; each request that waits (a prompt,
a load) is answered from a task of its own, so ``session/cancel`` and the answers to
permission requests are read while a prompt runs. Each session with a task has one pump
task draining its run's own channel (R-ACTOR-1); it queues the updates and answers the
prompts when the task ends, so a prompt's answer always follows its last update. Every
frame leaves through one outbox, written whole and in order by one writer task.

Agent trees (R-TREE): a background subagent outlives its spawning call and the task that
spawned it, so each session also has a watch of its own, a task that drains what the
session publishes (:mod:`greenroom.actors.apps.acp_tree`): it shows the background
children, asks the editor about their approvals and hands a task no request of this
connection started (a child's ``[subagent NAME finished]`` follow-up) to a pump like any
other. A pump handles an output only once that watch has, as both use the session's one
mapper. ``_greenroom/steer`` with a ``nodeId`` steers any running node of the session's tree.

The pumps never wait on the client, so a client that reads slowly never holds up a task;
what waits to be written is bounded (:data:`MAX_PENDING_BYTES`): a client that has left
that much unread is not reading, and the agent stops as if its stdout had closed (the
traces hold everything; ``session/load`` shows it again). Answers, requests and a loaded
session's replay wait for room instead, so they never push a reading client over it.

stdout carries frames and nothing else: fd 1 points at stderr while the agent runs (the
frames go to a private duplicate), and fd 0 at ``/dev/null`` (frames are read from a
private duplicate), so neither a tool's ``print`` nor a process it starts can write into
the protocol or read from it. When stdin closes (or on SIGTERM / SIGINT) every running task
is interrupted, its trace written to the end, and the process exits 0 — but a task that
waits only for a person is left parked, its request pending in the trace.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import stat
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from greenroom.actors.apps.acp_editor import EditorSession
from greenroom.actors.apps.acp_people import Asked, EditorPeople, OnAnswer
from greenroom.actors.apps.acp_sessions import (
    AskEditor,
    InputOrder,
    InputTurn,
    WatchedWork,
    approval_of,
    list_sessions,
)
from greenroom.actors.apps.acp_tree import TreeWatch, steer, steer_answer
from greenroom.actors.providers import read_image
from greenroom.actors.runtime import (
    Approval,
    AuthLocked,
    Busy,
    ConfigurationError,
    Host,
    ImageRefused,
    InputReceipt,
    RunStream,
    SeqRefused,
    Session,
    SessionClosed,
    SessionNotFound,
)
from greenroom.actors.tools import (
    AttachmentError,
    PromptCommandError,
    attach_to_input,
    expand_prompt_command,
    prompt_usage,
    read_linked_resource,
)
from greenroom.protocols import acp
from greenroom.protocols.content import ImageBlock, TextBlock, UserContent
from greenroom.protocols.history import live_records
from greenroom.protocols.jsonrpc import (
    BUSY,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    FrameError,
    Notification,
    Request,
    RpcError,
    encode,
    error_frame,
    notification_frame,
    result_frame,
)
from greenroom.protocols.outputs import (
    ApprovalRequest,
    Output,
    SteeringQueuedOutput,
    TaskEnd,
    TaskQueuedOutput,
    TaskQueueDropped,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.prices import Price
from greenroom.protocols.task import fold
from greenroom.protocols.tools import Tool

if TYPE_CHECKING:
    from greenroom.actors.runtime import ModelProvider

__all__ = ["AcpAgent", "AcpConfig", "serve_stdio"]

SHUTDOWN_GRACE_S = 5.0
"""How long the running tasks have to end and write their last records at shutdown."""

_Outputs = RunStream | WatchedWork
"""What a session's pump reads: a run of this connection, or work it did not start (taken
up on load, or the task a background child's answer started), read from its watch."""

MAX_PENDING_BYTES = 16 * 1024 * 1024
"""How many bytes of frames may wait for the client to read them: past it the client is
taken as not reading and the agent stops. Far beyond what a reading client leaves
unread (the pumps queue per network read of the model, the writer takes all at once)."""


@attrs.frozen(kw_only=True)
class AcpConfig:
    """What the sessions the client creates get: the ``run`` flags of ``greenroom acp``.

    ``settings`` are :class:`~greenroom.protocols.settings.SessionSettings` overrides;
    ``approve`` is ``ask`` (the client answers ``session/request_permission``), ``all`` or
    ``none``. ``mcp_config`` holds the servers of ``--mcp-config`` files, in the shape
    :func:`greenroom.protocols.acp.mcp_servers_config` gives the client's ``mcpServers``.
    """

    provider: str | ModelProvider | None = None
    model: str | None = None
    system: str | None = None
    tools: tuple[Tool, ...] = ()
    settings: dict[str, Any] = attrs.Factory(dict)
    approve: str = "ask"
    mcp_config: dict[str, dict[str, Any]] = attrs.Factory(dict)
    prices: Mapping[str, Price] | None = None
    """Model prices over the built-in table (``--prices``: R-SHARE-3)."""
    observers: tuple[Callable[[Any], None], ...] = ()
    """Host observers given every session (``--hooks``' tool hooks, ``--otel``)."""

    def mcp_servers_with(self, servers: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
        """The MCP servers of a session: those of ``--mcp-config``, then the client's
        ``servers`` (a client's server replaces a configured one of the same name)."""
        return {**self.mcp_config, **acp.mcp_servers_config(servers)}

    def stored_overrides(self) -> dict[str, Any]:
        """The settings a loaded or forked session is given: the flags' over its own."""
        overrides: dict[str, Any] = dict(self.settings)
        if self.model is not None:
            overrides["model"] = self.model
        if self.system is not None:
            overrides["system"] = self.system
        return overrides


class _Answer:
    """A request's answer that another task gives: a result, or an error. ``receipt`` is
    that of the input the request gave a running session (steering, a follow-up)."""

    __slots__ = ("_error", "_event", "_result", "receipt")

    def __init__(self, receipt: InputReceipt | None = None) -> None:
        self._event = trio.Event()
        self._result: Any = None
        self._error: RpcError | None = None
        self.receipt = receipt

    def give(self, result: Any = None, error: RpcError | None = None) -> None:
        if not self._event.is_set():
            self._result, self._error = result, error
            self._event.set()

    async def wait(self) -> Any:
        """The answer; for input not run here ("cancelled") whose record may or may not
        have survived the host, the error that says so (R-STEER-6, R-CLUSTER-2)."""
        await self._event.wait()
        if self._error is not None:
            raise self._error
        receipt = self.receipt
        if receipt is not None and self._result.get("stopReason") == "cancelled":
            # The host taking the session up may run it: "cancelled" would have the
            # editor send it again. Its receipt settles within the emitter's own bound.
            await receipt.settled.wait()
            if receipt.in_doubt is not None:
                raise acp.in_doubt(receipt.in_doubt)
        return self._result


class _Outbox:
    """The frames for the client, in order, until the writer takes them: the agent's one
    way out. :meth:`put` never waits, and says False when the frame would leave more than
    ``limit`` bytes unwritten (one frame alone always fits); :meth:`wait_for_room` waits
    until less than half the limit waits. After :meth:`close` frames are discarded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0
        """Bytes queued or being written."""
        self.closed = False
        self._queue: list[bytes] = []
        self._arrived = trio.Event()
        self._changed = trio.Event()

    def put(self, data: bytes) -> bool:
        """Queue ``data``; False (and nothing queued) when it would go over the limit."""
        if self.closed:
            return True
        if self.pending and self.pending + len(data) > self.limit:
            return False
        self._queue.append(data)
        self.pending += len(data)
        self._arrived.set()
        return True

    async def wait_for_room(self) -> None:
        """Return once less than half the limit waits (at once, without a checkpoint,
        when it already does)."""
        while not self.closed and self.pending >= self.limit // 2:
            await self.changed()

    async def take(self) -> bytes:
        """Everything queued, once there is something (the writer's side)."""
        while not self._queue:
            self._arrived = trio.Event()
            await self._arrived.wait()
        data = b"".join(self._queue)
        self._queue.clear()
        return data

    def written(self, size: int) -> None:
        """The writer has sent ``size`` bytes."""
        self.pending = max(0, self.pending - size)
        self.nudge()

    async def changed(self) -> None:
        """Return at the next :meth:`nudge`."""
        await self._changed.wait()

    def nudge(self) -> None:
        """Wake whoever waits in :meth:`changed` (something was written or finished)."""
        self._changed.set()
        self._changed = trio.Event()

    def close(self) -> None:
        """Discard what waits and whatever is put from now on."""
        self.closed = True
        self._queue.clear()
        self.pending = 0
        self.nudge()


class _Wire:
    """The connection's way out: the frames for the client, queued in order in one
    :class:`_Outbox` and written by one writer (:meth:`run`), and the requests to the
    client waiting for their answers. ``lost`` is called once when nothing more can be
    said to the client (its stdout closed, or it reads nothing)."""

    def __init__(
        self, send: trio.abc.SendStream, max_pending_bytes: int, lost: Callable[[], None]
    ) -> None:
        self.outbox = _Outbox(max_pending_bytes)
        self.gone = False
        """Nothing more reaches the client: every frame is discarded."""
        self._send_stream = send
        self._lost = lost
        self._pending: dict[int, tuple[trio.Event, list[acp.Response], OnAnswer | None]] = {}
        self._next_id = 0

    async def run(self) -> None:
        """The writer: the one task that waits on the client."""
        outbox = self.outbox
        while True:
            data = await outbox.take()
            try:
                await self._send_stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self._output_lost("the client closed its end of stdout; stopping")
                return
            outbox.written(len(data))

    def _output_lost(self, why: str) -> None:
        # Nothing more can be said to the client: discard what waits and stop.
        if not self.gone:
            self.gone = True
            self.outbox.close()
            _log(why)
            self._lost()

    async def send(self, frame: dict[str, Any]) -> None:
        """Queue a frame that may wait for room: an answer, a request, a replayed update."""
        if self.gone:
            return
        await self.outbox.wait_for_room()
        self.outbox.put(_frame_bytes(frame))

    def push(self, frame: dict[str, Any]) -> None:
        """Queue a frame of a pump, which never waits on the client."""
        if self.gone:
            return
        if not self.outbox.put(_frame_bytes(frame)):
            self._output_lost(
                f"the client has left {self.outbox.limit} bytes of output unread; stopping"
            )

    async def notify(self, session_id: str, update: dict[str, Any]) -> None:
        """Queue a ``session/update`` of ``session_id`` (waiting for room)."""
        await self.send(_update_frame(session_id, update))

    async def too_long(self, piece: acp.TooLong) -> None:
        """A line over the frame limit was dropped: answer the request it was, or fail
        the request of ours it answered (:func:`~greenroom.protocols.acp.too_long_error`)."""
        dropped = acp.too_long_error(piece)
        if isinstance(dropped, acp.Response):
            self.resolve(dropped)  # an answer is not replied to
        else:
            await self.send(dropped.response())

    def resolve(self, response: acp.Response) -> None:
        """The client answered one of our requests: wake it."""
        slot = self._pending.get(response.id) if isinstance(response.id, int) else None
        if slot is None:
            _log(f"ignored an answer to no pending request (id {response.id!r})")
            return
        event, box, on_answer = slot
        box.append(response)
        event.set()
        if on_answer is not None:
            on_answer(response)

    async def request(
        self, method: str, params: dict[str, Any], on_answer: OnAnswer | None = None
    ) -> acp.Response:
        """Send a request to the client and wait for its answer (cancellable).
        ``on_answer`` sees the answer as it is read, before the next frame is: what it
        changes holds for every frame the client sent after its answer."""
        self._next_id += 1
        request_id = self._next_id
        event = trio.Event()
        box: list[acp.Response] = []
        self._pending[request_id] = (event, box, on_answer)
        try:
            await self.send(acp.request_frame(request_id, method, params))
            await event.wait()
        finally:
            del self._pending[request_id]
        return box[0]


class _AcpSession:
    """One session this connection created or loaded, and its running task. ``watch``
    starts the watch of its tree, given the session once the rest is set up."""

    def __init__(
        self,
        session: Session,
        mcp_servers: dict[str, dict[str, Any]],
        watch: Callable[[_AcpSession], TreeWatch],
        mode: str,
        ask_editor: AskEditor,
    ) -> None:
        self.session = session
        self.mcp_servers = mcp_servers
        """The MCP servers the client named, kept with the session."""
        self.images = _OutputImages(session)
        self.mapper = acp.UpdateMapper(
            live=True, workspace=str(session.workspace_dir), load_image=self.images.get
        )
        self.waiters: list[_Answer] = []
        """The prompts answered when the running task ends (its prompt, steering prompts)."""
        self.follow_ups: list[_Answer] = []
        """The answers of the follow-ups accepted whose ``task_queued`` was not read yet,
        FIFO (the session records them in the order it accepts them)."""
        self.queued: dict[str, _Answer] = {}
        """The answers of the follow-ups recorded as queued, by queue id, until their task
        starts: other tasks may run first (queued by a host that stopped, or a background
        child's answer), so each answer waits for its own task (R-STEER-6). Steering that
        came too late for its task waits here too, for the task of its own it became."""
        self.steering: list[tuple[InputReceipt, _Answer | None]] = []
        """The steering the connection gave the session whose record was not read yet, in
        the order given (the session records it in that order): each becomes steering of
        the task running then (``steering_queued``) or, too late for it, a task of its own
        (``task_queued``, late steering: R-STEER-1), and a prompt's answer is given at the
        end of that task. None for ``_greenroom/steer``, which is answered once the
        steering's record is durable (:func:`~greenroom.actors.apps.acp_tree.steer_answer`)."""
        self.pumping = False
        self.idle = trio.Event()
        self.idle.set()
        self.reading: _Outputs | None = None
        """What the pump reads: the run of this connection, or the watched open task."""
        self.asked = Asked(session, self.mapper, mode)
        """What the editor is asked about this session (R-HITL), and its mode (R-ACP-2)."""
        self._ask_editor = ask_editor
        self.tree = watch(self)
        """The watch of the session's tree (R-TREE), which a pump never gets ahead of."""

    async def joined(self) -> dict[str, Any]:
        """Answer a prompt that joined the running task when that task ends."""
        if not self.pumping:
            return {"stopReason": "end_turn"}
        answer = _Answer()
        self.waiters.append(answer)
        joined: dict[str, Any] = await answer.wait()
        return joined

    def steered(self, content: tuple[UserContent, ...]) -> _Answer | None:
        """A prompt sent while the connection reads work of the session that it answers —
        a prompt's task, the editor's follow-ups or steering not yet ended — steers that
        work (R-STEER-1): the answer, given at the end of the task that takes the
        steering (the running one, the next follow-up's, or, too late for those, a task
        of its own after them). None when there is no such work: run a task instead."""
        # Only while a pump reads on to an end it answers: after its last task_end the
        # session may still look busy for a moment, and steering would reach no task.
        unanswered = self.waiters or self.follow_ups or self.queued or self.steering
        if not (self.pumping and unanswered):
            return None
        answer = _Answer()
        return answer if self.steer(content, answer) is not None else None

    def steer(
        self, content: tuple[UserContent, ...], answer: _Answer | None = None
    ) -> InputReceipt | None:
        """Hand ``content`` to the session as steering, ``answer`` to be given at the end
        of the task that takes it (:attr:`steering`): the steering's receipt, None when no
        task runs."""
        reading = self.reading
        # Work taken up reads on until the steering's record, which may follow an end.
        receipt = reading.receipt() if isinstance(reading, WatchedWork) else InputReceipt()
        counted = receipt.on_taken

        def taken() -> None:
            if counted is not None:
                counted()
            if receipt.dropped is not None:
                self._steering_dropped(receipt)

        receipt.on_taken = taken
        if answer is not None:
            answer.receipt = receipt
        self.steering.append((receipt, answer))
        if not self.session.steer(content, recorded=receipt):
            self.steering.pop()
            return None
        if isinstance(reading, WatchedWork):
            reading.accepted(receipt)
        return receipt

    def _steering_dropped(self, receipt: InputReceipt) -> None:
        """Steering the session accepted will not run (it stopped or closed before
        recording it): no task takes it, so its prompt is answered "cancelled"."""
        for given in self.steering:
            if given[0] is receipt:
                self.steering.remove(given)
                if given[1] is not None:
                    given[1].give({"stopReason": "cancelled"})
                return

    def followed(self, output: Output) -> None:
        """Match the editor's follow-ups and steering to their tasks as the session's
        ``output`` is read: a follow-up's answer waits for its ``task_queued`` (its queue
        id), then for the ``user_msg`` that starts its task, and is given at that task's
        end; one dropped is answered by the end that follows (its own, refused, or the
        interrupted task's). A steering prompt's answer is given at the end of the task
        its ``steering_queued`` names, or, recorded as a task of its own (late steering),
        as a follow-up's is."""
        match output:
            case SteeringQueuedOutput() if self.steering:
                answer = self.steering.pop(0)[1]
                if answer is not None:
                    self.waiters.append(answer)
            case TaskQueuedOutput(late_steering=True) if self.steering:
                answer = self.steering.pop(0)[1]
                if answer is not None:
                    self.queued[output.queue_id] = answer
            case TaskQueuedOutput(late_steering=False) if self.follow_ups:
                self.queued[output.queue_id] = self.follow_ups.pop(0)
            case TaskQueueDropped():
                dropped = (self.queued.pop(queue_id, None) for queue_id in output.queue_ids)
                self.waiters.extend(answer for answer in dropped if answer is not None)
            case UserMsg() if output.queued_id in self.queued:
                self.waiters.append(self.queued.pop(output.queued_id))
            case TaskEnd():
                self._ended(output)
            case _:
                pass

    def _ended(self, end: TaskEnd) -> None:
        """Answer the prompts of the task that ``end`` ends."""
        waiters, self.waiters = self.waiters, []
        try:
            reason = acp.stop_reason(end, self.mapper.last_stop_reason)
        except RpcError as error:
            for answer in waiters:
                answer.give(error=error)
        else:
            for answer in waiters:
                answer.give({"stopReason": reason, "usage": acp.prompt_usage(end.usage)})

    def cancel_all(self) -> None:
        """Answer every prompt still waiting "cancelled": its task will not be read (an
        interrupt dropped the follow-ups, or the reading stopped)."""
        steering = (answer for _, answer in self.steering if answer is not None)
        for answer in (*self.waiters, *self.follow_ups, *self.queued.values(), *steering):
            answer.give({"stopReason": "cancelled"})
        self.waiters, self.follow_ups, self.queued, self.steering = [], [], {}, []

    def stop_reading(self) -> None:
        """End the pump without interrupting the task (it waits in the trace)."""
        if isinstance(self.reading, RunStream):
            self.reading.detach()
        elif self.reading is not None:
            self.reading.close()

    def approval(self) -> Approval:
        """How a task started now decides its calls: by the session's mode (R-ACP-2)."""
        return approval_of(self.asked, self._ask_editor)

    def updates(self, output: Output) -> list[dict[str, Any]]:
        """The ``session/update`` payloads of an output of the session's task: the
        mapper's, and a ``usage_update`` after each of its model requests (R-ACP-2)."""
        size = self.session.settings.max_context_length
        return [*self.mapper.map(output), *acp.usage_update(output, size)]

    async def compact(self) -> dict[str, Any]:
        """``_greenroom/compact``: a manual compaction of the session."""
        session = self.session
        try:
            end = await session.compact()
        except Busy as exc:
            raise RpcError(BUSY, str(exc)) from None
        if end is None:
            return {"status": "skipped", "compactability": session.compactability()}
        return {"status": end.status, "errorMessage": end.error_message}


@attrs.frozen
class _Then:
    """A handler's result, and what to do once it is sent (``session/load``: ask the
    editor about what waits, after the answer that ends the replay)."""

    result: Any
    after: Callable[[], None]


class AcpAgent:
    """One ACP connection: reads frames from ``receive``, writes frames to ``send``, on
    sessions of ``host``. ``serve`` returns when the input ends (or :meth:`stop` is called),
    after interrupting the running tasks and letting them write their last records.
    ``max_pending_bytes``: how much output the client may leave unread before the agent
    stops (:data:`MAX_PENDING_BYTES`)."""

    def __init__(
        self,
        host: Host,
        config: AcpConfig,
        send: trio.abc.SendStream,
        *,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ) -> None:
        self._host = host
        self._config = config
        self._wire = _Wire(send, max_pending_bytes, self.stop)
        self._answering = 0
        self._sessions: dict[str, _AcpSession] = {}
        self._order = InputOrder()
        self._initialized = False
        self._editor = acp.EditorCapabilities()
        self._read_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._people = EditorPeople(host, self._wire.request, self._wire.notify)

    # -- the connection ---------------------------------------------------------------------

    async def serve(self, receive: trio.abc.ReceiveStream) -> None:
        """Serve the connection until ``receive`` ends (a broken stream counts as its end) or
        :meth:`stop` is called; then interrupt the running tasks and wait (bounded) for their
        last records. Frames are read in order; ``initialize`` is answered before the next is
        read, other requests concurrently."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._wire.run)
            with trio.CancelScope() as scope:
                self._read_scope = scope
                await self._read_frames(receive)
            await self._shutdown()
            nursery.cancel_scope.cancel()

    def stop(self) -> None:
        """End the connection as if its input had closed."""
        if self._read_scope is not None:
            self._read_scope.cancel()

    async def _read_frames(self, receive: trio.abc.ReceiveStream) -> None:
        splitter = acp.LineSplitter()
        while True:
            try:
                data = await receive.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            pieces = splitter.feed(bytes(data)) if data else splitter.close()
            for piece in pieces:
                await self._handle(piece)
            if not data:
                return

    async def _shutdown(self) -> None:
        """Interrupt every running task and wait (bounded) for its pump to see it end, for
        the requests to be answered and for the answers to be written. A task that waits
        for the editor's answer is not interrupted: once it is parked its request waits in
        the trace, asked again when the session is loaded (R-HITL-1)."""
        # Copies: requests still being answered open and close sessions meanwhile.
        entries = list(self._sessions.values())
        waiting = [e for e in entries if await e.asked.waits_for_people()]
        for entry in list(self._sessions.values()):
            if entry not in waiting:
                entry.session.interrupt("the ACP client went away")
        with trio.move_on_after(SHUTDOWN_GRACE_S):
            for entry in waiting:
                await entry.session.wait_idle()  # parked
                entry.stop_reading()
            for entry in list(self._sessions.values()):
                await entry.idle.wait()
            while self._answering or self._wire.outbox.pending:
                await self._wire.outbox.changed()

    async def _handle(self, piece: bytes | acp.TooLong) -> None:
        if isinstance(piece, acp.TooLong):
            await self._wire.too_long(piece)
            return
        if not piece.strip():
            return
        message = acp.parse_message(piece)
        if isinstance(message, FrameError):
            await self._wire.send(message.response())
        elif isinstance(message, acp.BadNotification):
            _log(f"dropped a notification {message.method!r}: {message.error.message}")
        elif isinstance(message, acp.Response):
            self._wire.resolve(message)
        elif isinstance(message, Notification):
            await self._notification(message)
        elif message.method == "initialize":
            await self._answer(message, InputTurn(None, 0))  # at once: what follows may rely on it
        else:
            assert self._nursery is not None
            # Its place among the session's input is taken as it is read, in frame order.
            turn = _input_turn(self._order, message)
            self._nursery.start_soon(self._answer, message, turn)

    async def _answer(self, request: Request, turn: InputTurn) -> None:
        self._answering += 1
        try:
            await self._answer_request(request, turn)
        finally:
            turn.end()  # refused or failed, it holds up no input sent after it
            self._answering -= 1
            self._wire.outbox.nudge()

    async def _answer_request(self, request: Request, turn: InputTurn) -> None:
        ordered = self._input_handlers().get(request.method)
        handler = self._handlers().get(request.method)
        try:
            if handler is None and ordered is None:
                raise RpcError(METHOD_NOT_FOUND, f"method not found: {request.method}")
            if not self._initialized and request.method != "initialize":
                raise RpcError(INVALID_REQUEST, "not initialized: call initialize first")
            if ordered is not None:
                result = await ordered(request.params, turn)
            else:
                assert handler is not None
                result = await handler(request.params)
        except RpcError as exc:
            await self._wire.send(error_frame(request.id, exc))
            return
        except SessionClosed as exc:
            await self._wire.send(error_frame(request.id, _closed_answer(request.method, exc)))
            return
        except Exception as exc:  # never let one request end the connection
            _log(f"{request.method} failed: {type(exc).__name__}: {exc}")
            await self._wire.send(error_frame(request.id, RpcError(INTERNAL_ERROR, str(exc))))
            return
        if isinstance(result, _Then):
            await self._wire.send(result_frame(request.id, result.result))
            result.after()
            return
        await self._wire.send(result_frame(request.id, result))

    def _handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]:
        return {
            "initialize": self._initialize,
            "session/new": self._new_session,
            "session/load": self._load_session,
            "session/fork": self._fork_session,
            "session/list": lambda params: list_sessions(self._host, params),
            "session/set_mode": self._set_mode,
            "session/close": self._close_session,
            "_greenroom/compact": lambda params: self._session(params).compact(),
            "_greenroom/skip_reconnect_wait": lambda params: _skip_wait(self._session(params)),
        }

    def _input_handlers(
        self,
    ) -> dict[str, Callable[[dict[str, Any], InputTurn], Awaitable[Any]]]:
        # The requests that give a session input, each handing it over in its turn.
        return {
            "session/prompt": self._prompt,
            "_greenroom/steer": self._steer,
            "_greenroom/follow_up": self._follow_up,
        }

    async def _notification(self, note: Notification) -> None:
        if note.method == "session/cancel":
            sid = note.params.get("sessionId")
            entry = self._sessions.get(sid) if isinstance(sid, str) else None
            if entry is None:
                _log(f"session/cancel for an unknown session {sid!r}: ignored")
                return
            # The prompts read before it and not handed over yet have no task to interrupt.
            self._order.cancel(entry.session.id)
            # It cancels the prompt turn: background subagents are not part of it (R-TREE-2).
            entry.session.interrupt("cancelled by the client (session/cancel)", scope="node")
        # Other notifications (extensions this agent does not know) are ignored, as ACP asks.

    # -- methods ----------------------------------------------------------------------------

    async def _initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        acp.negotiate_version(params)
        self._initialized = True
        self._people.configure(params)
        self._editor = acp.editor_capabilities(params)
        return acp.initialize_result(_version())

    async def _new_session(self, params: dict[str, Any]) -> _Then:
        request = acp.parse_new_session(params)
        if not await trio.to_thread.run_sync(os.path.isdir, request.cwd):
            raise acp.invalid("$.cwd", f"{request.cwd} is not a directory")
        config = self._config
        mcp_servers = self._config.mcp_servers_with(request.mcp_servers)
        try:
            session = await self._host.create_session(
                model=config.model,
                tools=config.tools,
                workspace_dir=request.cwd,
                provider=config.provider,
                system=config.system,
                mcp_servers=mcp_servers,
                **config.settings,
            )
        except ConfigurationError as exc:
            raise RpcError(INTERNAL_ERROR, f"cannot set up the session: {exc}") from None
        entry = self._add_session(session, mcp_servers)
        _log(f"session {session.id} in {session.workspace_dir}")
        return _opened(entry, {"sessionId": session.id}, self._wire.push)

    def _add_session(self, session: Session, mcp_servers: dict[str, dict[str, Any]]) -> _AcpSession:
        existing = self._sessions.get(session.id)
        if existing is not None:
            existing.mcp_servers = mcp_servers
            return existing
        entry = self._sessions[session.id] = _AcpSession(
            session, mcp_servers, self._watch_tree, self._config.approve, self._people.ask_now
        )
        if self._editor.any:  # R-ACP-2: its files and terminal are the editor's
            assert self._nursery is not None
            session.editor = EditorSession(
                self._editor, session.id, self._wire.request, entry.mapper, self._nursery.start_soon
            )
        if mcp_servers:
            _log(f"session {session.id}: MCP servers {', '.join(sorted(mcp_servers))}")
        return entry

    async def _load_session(self, params: dict[str, Any]) -> _Then:
        session_id = acp.session_id_of(params)
        request = acp.parse_new_session(params)
        overrides = self._config.stored_overrides()
        try:
            session = await self._host.load_session(
                session_id,
                tools=self._config.tools,
                provider=self._config.provider,
                mcp_servers=self._config.mcp_servers_with(request.mcp_servers),
                **overrides,
            )
        except SessionNotFound as exc:
            raise RpcError(acp.RESOURCE_NOT_FOUND, str(exc)) from None
        except Busy as exc:  # open in another host on this data dir
            raise RpcError(BUSY, str(exc)) from None
        except ConfigurationError as exc:
            raise RpcError(INTERNAL_ERROR, f"cannot set up the session: {exc}") from None
        for problem in session.load_errors:
            _log(f"session {session_id}: corrupt trace line skipped: {problem}")
        if Path(request.cwd) != session.workspace_dir:
            _log(
                f"session {session_id} works in {session.workspace_dir}, not in the cwd "
                f"{request.cwd} the client gave"
            )
        entry = self._add_session(session, self._config.mcp_servers_with(request.mcp_servers))
        records = await _replay(session, self._wire.notify)
        left = fold(records)
        queued = tuple(follow_up.queue_id for follow_up in left.record.queued)
        # Work with no task open is work too: follow-ups queued (their host stopped between
        # a task's end and the next start), which a prompt would drop (R-STEER-6), and a
        # prompt accepted and not started, which a prompt would swallow (R-CLUSTER-2).
        unstarted = left.record.unstarted is not None
        if not entry.pumping and (left.run_id is not None or unstarted or queued):
            await self._take_up(entry, queued)
        pending = left.record.pending_people

        def ask_again() -> None:
            # After the answer that ends the replay, so the editor knows the session.
            assert self._nursery is not None
            for request in pending:
                self._people.ask_soon(self._nursery, entry.asked, request)

        return _opened(entry, {}, self._wire.push, ask_again)

    async def _fork_session(self, params: dict[str, Any]) -> _Then:
        request = acp.parse_fork_session(params)
        servers = self._config.mcp_servers_with(request.new.mcp_servers)
        session = await _forked(self._host, self._config, request, servers)
        entry = self._add_session(session, servers)
        _log(f"session {session.id} forked from {request.session_id} in {request.new.cwd}")
        return _opened(entry, {"sessionId": session.id}, self._wire.push)

    async def _set_mode(self, params: dict[str, Any]) -> dict[str, Any]:
        entry = self._session(params)  # an unknown session first, as every method says
        entry.asked.mode = acp.parse_set_mode(params)
        return {}

    async def _close_session(self, params: dict[str, Any]) -> dict[str, Any]:
        # R-ACP-2: the session leaves memory as host.close_session leaves it (its task
        # interrupted unless it waits for people); its trace stays, session/load reopens it.
        entry = self._session(params)
        del self._sessions[entry.session.id]
        entry.asked.closed = True
        await self._host.close_session(entry.session.id)
        await entry.idle.wait()
        _log(f"session {entry.session.id} closed")
        return {}

    async def _take_up(self, entry: _AcpSession, follow_ups: tuple[str, ...]) -> None:
        """Take up the work the loaded session's trace leaves (R-HITL-4) and stream its
        updates: the open task — a parked one waits on for its answer, one its host lost
        goes on (its running calls get host-lost results and are not run again), a prompt
        its host accepted and had not started gets its task (R-CLUSTER-2) — then
        the ``follow_ups`` it holds as queued, in order (R-STEER-6), their calls decided
        by the session's mode (R-ACP-2) unless they were recorded for people. Only what
        the runtime takes up is waited for: a foreground subagent's open task was its
        parent's call, which its parent's task settles (R-CLUSTER-2), so it is not taken
        up, and the child's next task recovers it as interrupted (R-TRACE-4)."""
        # Unbounded: the pump never waits on the client, so it drains the watch at once.
        send, receive = trio.open_memory_channel[list[Output]](math.inf)
        entry.session.watch(send)
        work = WatchedWork(receive, follow_ups)
        # Pumping already, so a prompt sent meanwhile waits for the work's end.
        self._pump_soon(entry, work)
        await self._host.resume(entry.session.id, approve=entry.approval())
        if not entry.session.busy:
            work.close()  # nothing runs, no task_end will come: prompts run at once

    async def _prompt(self, params: dict[str, Any], turn: InputTurn) -> dict[str, Any]:
        entry = self._session(params)
        content = await _prompt_content(entry.session, params)
        async with turn:
            if turn.cancelled:
                answer: _Answer | None = _cancelled()
            elif await self._people.answer_with(entry.asked, content):
                answer = None
            else:
                answer = entry.steered(content) or await self._start(entry, content, turn)
        answered: dict[str, Any] = await (entry.joined() if answer is None else answer.wait())
        return answered

    async def _start(
        self, entry: _AcpSession, content: tuple[UserContent, ...], turn: InputTurn
    ) -> _Answer:
        """Run ``content`` as a task of its own; its answer comes when the task ends.
        Cancelled (``session/cancel`` read after the request that gave it) while it waited
        for the session, it never runs: answered "cancelled"."""
        # A task ending right now still holds the session for a moment: wait it out.
        await entry.idle.wait()
        if turn.cancelled:
            return _cancelled()
        try:
            stream = entry.session.run(content, approve=entry.approval())
        except AuthLocked as exc:
            raise RpcError(acp.AUTH_REQUIRED, str(exc)) from None
        except Busy as exc:
            raise RpcError(BUSY, str(exc)) from None
        answer = _Answer()
        entry.waiters = [answer]
        entry.follow_ups, entry.queued, entry.steering = [], {}, []
        self._pump_soon(entry, stream)
        return answer

    def _watch_tree(self, entry: _AcpSession) -> TreeWatch:
        """Watch the tree of ``entry``'s session from now on, from a task of the agent."""
        assert self._nursery is not None
        nursery, session_id = self._nursery, entry.session.id
        tree = TreeWatch(
            entry.session,
            entry.mapper,
            live=lambda: not self._wire.gone,
            pumping=lambda: entry.pumping,
            show=lambda update: self._wire.push(_update_frame(session_id, update)),
            ask=lambda request: self._people.ask_soon(nursery, entry.asked, request),
            settled=entry.asked.settled,
            pump=lambda task: self._pump_soon(entry, task),
        )
        nursery.start_soon(tree.run)
        return tree

    def _pump_soon(self, entry: _AcpSession, outputs: _Outputs) -> None:
        entry.pumping = True
        entry.idle = trio.Event()
        entry.reading = outputs
        assert self._nursery is not None
        self._nursery.start_soon(self._pump, entry, outputs)

    async def _steer(self, params: dict[str, Any], turn: InputTurn) -> dict[str, Any]:
        async def content_in_turn(node: Session, params: dict[str, Any]) -> Any:
            content = await _prompt_content(node, params)
            await turn.wait()  # handed over once returned: no checkpoint between
            return content

        if "text" in params:
            await turn.wait()
        entry = self._session(params)
        recorded = await steer(self._host, entry.session, params, content_in_turn, entry.steer)
        turn.end()  # handed over: steering sent after it need not wait for its record
        return await steer_answer(recorded)

    async def _follow_up(self, params: dict[str, Any], turn: InputTurn) -> Any:
        entry = self._session(params)
        content = await _prompt_content(entry.session, params)
        session = entry.session
        async with turn:
            reading = entry.reading
            # Work taken up stops reading at the task_end after which it counts no
            # follow-up: it counts this one from its acceptance, as its task_queued may
            # follow that end.
            receipt = reading.receipt() if isinstance(reading, WatchedWork) else InputReceipt()
            approve = entry.approval()
            if turn.cancelled:  # as an interrupt drops the follow-ups it finds queued
                answer = _cancelled()
            elif entry.pumping and session.follow_up(content, approve=approve, recorded=receipt):
                if isinstance(reading, WatchedWork):
                    reading.accepted(receipt)
                answer = _Answer(receipt)
                entry.follow_ups.append(answer)
            else:
                answer = await self._start(entry, content, turn)
        return await answer.wait()

    # -- sessions and tasks -----------------------------------------------------------------

    def _session(self, params: dict[str, Any]) -> _AcpSession:
        session_id = acp.session_id_of(params)
        entry = self._sessions.get(session_id)
        if entry is None:
            raise RpcError(
                acp.RESOURCE_NOT_FOUND,
                f"no session {session_id!r} on this connection: create it with session/new "
                "or open it with session/load",
            )
        return entry

    async def _pump(self, entry: _AcpSession, stream: _Outputs) -> None:
        session_id = entry.session.id
        try:
            async for output in stream:
                await entry.tree.caught_up()  # the tree watch first, as inside publish
                await entry.images.read(output)
                try:
                    updates = entry.updates(output)
                except Exception as exc:  # one output the mapping cannot show loses no other
                    _log(f"cannot show a {output.type} output: {type(exc).__name__}: {exc}")
                    updates = []
                for update in updates:
                    self._wire.push(_update_frame(session_id, update))
                if (
                    isinstance(output, ApprovalRequest)
                    and self._nursery is not None
                    and not entry.mapper.is_background(output)  # the tree watch asks those
                ):
                    self._people.ask_soon(self._nursery, entry.asked, output)
                entry.asked.settled(output)  # after asking: a batch may ask and settle
                if output.origin is None:  # a subagent's tasks are not this session's
                    entry.followed(output)
        finally:
            entry.cancel_all()
            entry.pumping = False
            entry.reading = None
            entry.idle.set()


_CLOSED_BEFORE = {
    "session/prompt": "the prompt",
    "_greenroom/steer": "the steering",
    "_greenroom/follow_up": "the follow-up",
    "_greenroom/compact": "the compaction",
}
"""What each request that starts work on a session sends it, for :func:`_closed_answer`."""


_INPUT_LINES = {
    "session/prompt": "tasks",
    "_greenroom/follow_up": "tasks",
    "_greenroom/steer": "steering",
}
"""The line of a session's input each request that gives it some waits in: prompts and
follow-ups become tasks in the order sent; steering is for the task running now, in the
order sent too, and never waits behind a prompt that waits for that task to end."""


def _cancelled() -> _Answer:
    """The answer of input that ``session/cancel`` dropped before it was handed over."""
    answer = _Answer()
    answer.give({"stopReason": "cancelled"})
    return answer


def _input_turn(order: InputOrder, request: Request) -> InputTurn:
    """``request``'s turn in its session's line (:data:`_INPUT_LINES`); for a request that
    gives no input, or names no session (refused anyway), a turn that waits for nothing."""
    line = _INPUT_LINES.get(request.method)
    session_id = request.params.get("sessionId") if isinstance(request.params, dict) else None
    if line is None or not isinstance(session_id, str):
        return InputTurn(None, 0)
    return order.turn(session_id, line)


def _closed_answer(method: str, closed: SessionClosed) -> RpcError:
    """-32002, as for a session this connection does not have, for a request that found its
    session open and met it closing (``session/close`` came meanwhile): the client's input
    never ran and the session is gone from the connection, which is no internal error."""
    what = _CLOSED_BEFORE.get(method, "the request")
    return RpcError(
        acp.RESOURCE_NOT_FOUND,
        f"{closed}: its close began before {what} reached it, so nothing was sent; "
        "session/load opens it again",
    )


async def _prompt_content(session: Session, params: dict[str, Any]) -> tuple[UserContent, ...]:
    """The prompt as session input; its inline images are attached (R-SEC-8): checked
    against the session's ``max_image_bytes`` before they are decoded, stored in its
    private attachments off the event loop. Its MCP parts (R-MCP-5): a first text block
    ``/server:prompt …`` naming one of the session's MCP servers is that prompt, expanded
    by the server; ``@server:uri`` in a text and a ``resource_link`` to a resource a
    server lists are attached, read through that server. A refused image, prompt or
    attachment is -32602 naming it, and nothing is sent."""
    parts = acp.parse_prompt(params)
    content: list[UserContent] = []
    for i, part in enumerate(parts):
        if isinstance(part, TextBlock | acp.LinkedResource):
            try:
                content += await _mcp_input(session, part, i)
            except (PromptCommandError, AttachmentError) as exc:
                raise acp.invalid(f"$.prompt[{i}]", str(exc)) from None
            continue
        try:
            image = await session.attach_image_data(part.data, part.mime_type)
        except ImageRefused as exc:
            raise RpcError(INVALID_PARAMS, f"$.prompt[{i}]: {exc.reason}") from None
        content.append(image)
    return tuple(content)


async def _mcp_input(
    session: Session, part: TextBlock | acp.LinkedResource, index: int
) -> list[UserContent]:
    """A text or linked part of a prompt with its MCP prompt or resources (R-MCP-5)."""
    if isinstance(part, acp.LinkedResource):
        read = await read_linked_resource(part.uri, session.mcp, session.tools, index)
        return [read or TextBlock(text=part.text)]
    if index == 0:
        prompt = await expand_prompt_command(part.text, session.mcp, only_known=True)
        if prompt is not None:
            return [TextBlock(text=prompt)]
    return await attach_to_input([part], session.tools)


def _opened(
    entry: _AcpSession,
    result: dict[str, Any],
    push: Callable[[dict[str, Any]], None],
    after: Callable[[], None] | None = None,
) -> _Then:
    """The answer to ``session/new``, ``load`` or ``fork`` (with the session's MCP servers
    in ``_meta``), then, once the editor knows the session, its MCP prompts offered as
    slash commands (R-MCP-5: ``available_commands_update``), then ``after``."""
    mcp = entry.session.mcp
    commands = [
        acp.SlashCommand(
            name=f"{server}:{prompt.name}",
            description=" ".join((prompt.description or f"MCP prompt of {server}").split()),
            hint=prompt_usage(server, prompt).partition(" ")[2] or None,
        )
        for server, prompts in (mcp.prompts() if mcp is not None else {}).items()
        for prompt in prompts
    ]

    def then() -> None:
        if commands:
            push(_update_frame(entry.session.id, acp.commands_update(commands)))
        if after is not None:
            after()

    modes = {"modes": acp.modes_state(entry.asked.mode)}
    return _Then({**result, **modes, **_mcp_meta(entry)}, then)


async def _replay(
    session: Session, notify: Callable[[str, dict[str, Any]], Awaitable[None]]
) -> list[Output]:
    """Show a loaded session's trace again (``session/load``), each update through
    ``notify``, with a mapper of its own that knows the trace is no live task; the
    records read. What a rewind cut is not shown: the editor sees the history the
    session continues from (R-FORK-2)."""
    records = live_records(await session.host.trace_store.log.read_after(session.id))
    images = _OutputImages(session)
    replay = acp.UpdateMapper(
        live=False, workspace=str(session.workspace_dir), load_image=images.get
    )
    for record in records:
        await images.read(record)
        for update in replay.map(record):
            await notify(session.id, update)
    return records


async def _forked(
    host: Host, config: AcpConfig, request: acp.ForkSession, servers: dict[str, dict[str, Any]]
) -> Session:
    """``session/fork`` (R-FORK-1): a new session with the history of
    ``request.session_id`` up to ``atSeq``, working in the editor's ``cwd``, with the
    connection's tools, provider and settings (as a loaded session gets them)."""
    cwd = request.new.cwd
    if not await trio.to_thread.run_sync(os.path.isdir, cwd):
        raise acp.invalid("$.cwd", f"{cwd} is not a directory")
    try:
        return await host.fork_session(
            request.session_id,
            request.at_seq,
            tools=config.tools,
            provider=config.provider,
            mcp_servers=servers,
            workspace_dir=cwd,
            **config.stored_overrides(),
        )
    except SessionNotFound as exc:
        raise RpcError(acp.RESOURCE_NOT_FOUND, str(exc)) from None
    except SeqRefused as exc:
        raise acp.invalid(f"$._meta.{acp.META_KEY}.atSeq", str(exc)) from None
    except ConfigurationError as exc:
        raise RpcError(INTERNAL_ERROR, f"cannot set up the session: {exc}") from None


async def _skip_wait(entry: _AcpSession) -> dict[str, Any]:
    return {"skipped": entry.session.skip_reconnect_wait()}


def _frame_bytes(frame: dict[str, Any]) -> bytes:
    return (encode(frame) + "\n").encode("utf-8")


def _update_frame(session_id: str, update: dict[str, Any]) -> dict[str, Any]:
    return notification_frame("session/update", {"sessionId": session_id, "update": update})


def _mcp_meta(entry: _AcpSession) -> dict[str, Any]:
    if not entry.mcp_servers:
        return {}
    return {
        "_meta": {acp.META_KEY: {"mcpServers": sorted(entry.mcp_servers), "mcpConnected": True}}
    }


class _OutputImages:
    """The images of the output about to be shown, read off the event loop (the mapper's
    loader is synchronous): the session's private copies of attached images, or — in a
    trace written before attachments — the files, read as any named file is (R-SEC-8).
    Holds one output's images at a time."""

    __slots__ = ("_current", "_source")

    def __init__(self, session: Session) -> None:
        self._source = session.attachments.source
        self._current: dict[int, tuple[str, str] | None] = {}

    async def read(self, output: Output) -> None:
        """Read the images of ``output``, replacing those of the previous one."""
        blocks = _images_of(output)
        if not blocks:
            self._current = {}
            return
        source = self._source
        self._current = await trio.to_thread.run_sync(
            lambda: {id(b): read_image(b, source) for b in blocks}, abandon_on_cancel=True
        )

    def get(self, block: ImageBlock) -> tuple[str, str] | None:
        """An image of the output last read; None for any other."""
        return self._current.get(id(block))


def _images_of(output: Output) -> list[ImageBlock]:
    content = output.content if isinstance(output, UserMsg | ToolCallOutput) else ()
    return [b for b in content if isinstance(b, ImageBlock)]


def _log(message: str) -> None:
    print(f"greenroom acp: {message}", file=sys.stderr, flush=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("greenroom")
    except PackageNotFoundError:
        return "unknown"


# -- the command ----------------------------------------------------------------------------


def serve_stdio(config: AcpConfig, data_dir: Path, stdout_fd: int) -> None:
    """Serve one ACP client on stdin and ``stdout_fd`` (a private duplicate of stdout: fd 1
    already points at stderr) until stdin closes; fd 0 points at ``/dev/null`` meanwhile.
    ``greenroom acp`` (actors/apps/serve_command.py) prepares the config from its flags."""
    with _private_stdin() as stdin_fd:
        trio.run(_serve_stdio, config, data_dir, stdin_fd, stdout_fd)


async def _serve_stdio(config: AcpConfig, data_dir: Path, stdin_fd: int, stdout_fd: int) -> None:
    async with Host.open(
        data_dir=data_dir, prices=config.prices, observers=config.observers
    ) as host:
        output = _fd_stream(os.dup(stdout_fd))
        receive = _fd_stream(os.dup(stdin_fd))
        agent = AcpAgent(host, config, output)
        _log(f"ready (protocol version {acp.PROTOCOL_VERSION}, data dir {host.data_dir})")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signals, agent)
            try:
                await agent.serve(receive)
            finally:
                nursery.cancel_scope.cancel()
                with contextlib.suppress(OSError, trio.ClosedResourceError):
                    await output.aclose()
                with contextlib.suppress(OSError, trio.ClosedResourceError):
                    await receive.aclose()


async def _stop_on_signals(agent: AcpAgent) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            _log("signal received: interrupting the running tasks and leaving")
            agent.stop()


@contextlib.contextmanager
def _private_stdin() -> Iterator[int]:
    """Yield a private duplicate of fd 0 and point fd 0 (and ``sys.stdin``) at
    ``/dev/null`` until the block ends: the protocol's input is the agent's alone."""
    private = os.dup(0)
    saved = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    real_stdin = sys.stdin
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 -- closed below
    try:
        yield private
    finally:
        sys.stdin.close()
        sys.stdin = real_stdin
        os.dup2(saved, 0)
        os.close(saved)
        os.close(private)


class _ThreadFdStream(trio.abc.Stream):
    """A file descriptor read and written by worker threads: for a terminal or a file,
    which trio's non-blocking ``FdStream`` would switch to non-blocking mode for every
    process that shares them."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await trio.to_thread.run_sync(
            os.read, self._fd, max_bytes or 1 << 16, abandon_on_cancel=True
        )

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        def write_all() -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]

        await trio.to_thread.run_sync(write_all)

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def _fd_stream(fd: int) -> trio.abc.Stream:
    """A trio stream on ``fd``: non-blocking for pipes and sockets (what editors give),
    worker threads for anything else (a terminal, when tried by hand)."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return trio.lowlevel.FdStream(fd)
    return _ThreadFdStream(fd)
