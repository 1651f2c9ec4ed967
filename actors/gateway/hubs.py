"""The gateway's side of each session: one actor that fans its outputs out to the
connections subscribed to it, with gapless replay.

::

    Hubs.run                  the hubs' nursery, started by the gateway
    └── SessionHub.run        one per adopted session: drains its inbox, a Session.watch

Invariants:

* A session's supervisor never waits on a client, and no gateway code runs in its task
  (R-ACTOR-1). Each session has one :class:`SessionHub`, a task of its own whose inbox the
  session watches (``Session.watch``): the hub encodes every output once and queues the
  frame on each subscribed connection's outbox without blocking. A client is
  dropped only when it is really behind (:meth:`Outbox.behind`) or an output would take its
  outbox past its bound (:meth:`Outbox.offer`); a dropped subscription gets
  a ``subscription_dropped`` notification ``{session_id, reason, last_seq}`` and the client
  resubscribes with ``after_seq: last_seq`` and misses nothing. Other clients and the
  session are never slowed down.
* A subscription goes live first (buffering) and replays the trace second: an output
  emitted meanwhile is in the buffer, in the trace, or in both (deduplicated by seq), never
  in neither. "Live" starts at a marker the subscription puts in its hub's inbox: the
  inbox is FIFO, so the subscription gets exactly the batches published after it was made,
  however far behind the hub is; one published before it and still in the inbox is in the
  trace (it is published only once traced, R-TRACE-3) and never reaches it live. A traced
  output the hub drains after the subscription went live and that the replay already
  sent is skipped by its seq.
* A hub holds no approval: a request waits in the session's trace for a person, whoever
  watches (R-HITL-1), and is answered through the host. The hub only notes which requests
  are open, for the state ``session.list`` reports.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Literal, assert_never

import attrs
import trio

from greenroom.actors.gateway.config import GatewayLimits
from greenroom.actors.gateway.connection import Connection
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.people import pending_of
from greenroom.actors.runtime.session import Session
from greenroom.protocols import jsonrpc
from greenroom.protocols.converter import to_dict
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
    TokenUsageOutput,
    ToolCallOutput,
    ToolHook,
    ToolProgress,
    UserMsg,
)

logger = logging.getLogger(__name__)

SessionState = Literal["idle", "running", "waiting_for_approval"]


class Subscription:
    """One connection watching one session. It gets the batches its hub drains after its
    marker (:meth:`SessionHub.join`); until :meth:`go_live` it buffers them (the replay is
    being sent); then it queues them on the connection's outbox.

    The buffer is bounded by ``max_replay_buffer`` frames: beyond it the subscription is
    dropped (with a notice) rather than make the session's listener wait.
    """

    def __init__(
        self, connection: Connection, hub: SessionHub, after_seq: int, limits: GatewayLimits
    ) -> None:
        self.connection = connection
        self.hub = hub
        self.last_seq = after_seq
        """The seq of the last output this subscription queued for its client."""
        self.closed = False
        self.joined = False
        """The hub has reached this subscription's marker: what it drains from now on was
        published after the subscription was made."""
        self._limits = limits
        self._buffer: list[tuple[int | None, str]] | None = []
        self._replayed = after_seq
        hub.subscriptions.append(self)
        connection.subscriptions[hub.session.id] = self

    def deliver(self, frames: list[tuple[int | None, str]]) -> None:
        """Called from the hub's loop: must not block or raise."""
        if self.closed or not self.joined:
            return
        if self._buffer is not None:
            self._buffer.extend(frames)
            if len(self._buffer) > self._limits.max_replay_buffer:
                self.drop("too many live outputs while replaying")
            return
        outbox = self.connection.outbox
        reason = outbox.behind(trio.current_time(), self._limits)
        if reason is not None:
            self.drop(reason)
            return
        for seq, frame in frames:
            if seq is not None and seq <= self._replayed:
                continue  # traced before the replay ended: the replay sent it
            if not outbox.offer(frame):
                self.drop(f"client too slow: more than {outbox.max_bytes} bytes not read")
                return
            if seq is not None:
                self.last_seq = seq

    def go_live(self, last_replayed: int) -> None:
        """The replay has been queued up to ``last_replayed``: queue what was buffered
        after it, and from now on every live output."""
        buffered, self._buffer = self._buffer or [], None
        self._replayed = max(self._replayed, last_replayed)
        self.deliver(buffered)

    def drop(self, reason: str) -> None:
        """End the subscription and tell the client why and where to resume."""
        self.close()
        notice = {"session_id": self.hub.session.id, "reason": reason, "last_seq": self.last_seq}
        self.connection.outbox.put_nowait(
            jsonrpc.encode(jsonrpc.notification_frame("subscription_dropped", notice))
        )

    def close(self) -> None:
        """End the subscription quietly."""
        self.closed = True
        with contextlib.suppress(ValueError):
            self.hub.subscriptions.remove(self)
        if self.connection.subscriptions.get(self.hub.session.id) is self:
            del self.connection.subscriptions[self.hub.session.id]


@attrs.frozen
class _Join:
    """A subscription's marker in its hub's inbox: deliver to it from here on."""

    subscription: Subscription


_HubMessage = list[Output] | _Join
"""What a hub's inbox carries: the session's batches (its watch) and subscription
markers."""


class SessionHub:
    """The gateway's actor for one session: watches it from its own task (:meth:`run`),
    encodes each output once and hands it to every subscription; keeps the state
    ``session.list`` reports.

    Its loop never blocks on a client: it hands frames to :meth:`Subscription.deliver`.
    """

    def __init__(
        self, session: Session, on_task_end: Callable[[Session], None] | None = None
    ) -> None:
        self.session = session
        self.subscriptions: list[Subscription] = []
        self.finishing = False
        """The last task (or compaction) has emitted its end and nothing is queued: the
        session is only syncing its trace before it turns idle."""
        self.open_approvals: set[tuple[str, str]] = set()
        """``(origin, call_id)`` of the requests asked since the hub watches and not
        answered (a subagent's too)."""
        self.last_output_at = 0.0
        self._on_task_end = on_task_end
        self._inbox: trio.MemorySendChannel[_HubMessage] | None = None
        self._scope = trio.CancelScope()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the session and fan its batches out until the session closes (then the
        subscriptions are dropped with a notice), :meth:`close` is called or the task is
        cancelled. Ready once the watch is open: every batch published after
        ``nursery.start`` returns reaches the hub."""
        # Unbounded: the session publishes with send_nowait and must neither wait nor
        # lose a batch; this loop waits on nothing but this inbox (it encodes and queues
        # without blocking), so the inbox holds only what was published since its last turn.
        send, inbox = trio.open_memory_channel[_HubMessage](math.inf)
        with inbox:
            with self._scope:
                self._inbox = send
                self.session.watch(send)
                task_status.started()
                async for message in inbox:
                    try:
                        self._handle(message)
                    except Exception:
                        # A bug of the gateway's: it must not end the hub (or the gateway).
                        logger.exception("gateway: hub of session %s", self.session.id)
                self.close("session closed")

    def _handle(self, message: _HubMessage) -> None:
        match message:
            case list():
                self._fan_out(message)
            case _Join():
                message.subscription.joined = True
            case _:
                assert_never(message)

    def join(self, subscription: Subscription) -> None:
        """Deliver to ``subscription`` the batches published from now on: its marker goes
        into the hub's inbox behind every batch published before it. A hub that is not
        running (or has ended) delivers nothing more, so the subscription is joined now."""
        if self._inbox is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                self._inbox.send_nowait(_Join(subscription))
                return
        subscription.joined = True

    def _fan_out(self, batch: list[Output]) -> None:
        self.last_output_at = time.time()
        for output in batch:
            match output:
                case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                    pass  # the most frequent outputs, tested first: live only
                case TaskEnd(origin=None):
                    self.finishing = True
                    self.open_approvals.clear()
                    if self._on_task_end is not None:
                        self._on_task_end(self.session)
                case CompactionEnd(origin=None):
                    self.finishing = True
                case UserMsg(origin=None) | CompactionBegin(origin=None):
                    self.finishing = False
                case ApprovalRequest():
                    self.open_approvals.add(("/".join(output.origin or ()), output.call_id))
                case ApprovalDecision() | CallResolved() | ToolCallOutput():
                    # A request ends with its decision, an in-doubt question with the
                    # call's resolution, any of them with the call's result.
                    self.open_approvals.discard(("/".join(output.origin or ()), output.call_id))
                case TaskEnd() | CompactionEnd() | UserMsg() | CompactionBegin():
                    pass  # a subagent's: the root session's state is unchanged
                case (
                    TaskStart()
                    | RequestBegin()
                    | ModelMsg()
                    | TokenUsageOutput()
                    | RequestEnd()
                    | ToolHook()
                    | Abort()
                    | CallInDoubt()
                    | Rewind()
                    | TaskQueuedOutput()
                    | TaskQueueDropped()
                    | SteeringQueuedOutput()
                ):
                    pass  # forwarded to the subscriptions, nothing more
                case _:
                    assert_never(output)
        if not self.subscriptions:
            return
        # Forwarded subagent outputs carry their own session's seq: never deduplicated.
        frames = [(o.seq if o.origin is None else None, output_frame(o)) for o in batch]
        for subscription in list(self.subscriptions):
            subscription.deliver(frames)

    def close(self, reason: str = "session reloaded") -> None:
        """Stop watching (the loop of :meth:`run` ends): subscriptions are dropped with a
        notice giving ``reason``. Requests waiting for a person stay pending (R-HITL-1)."""
        self._scope.cancel()
        for subscription in list(self.subscriptions):
            subscription.drop(reason)


class Hubs:
    """The hubs of the sessions the gateway serves, one per session id, each a task of
    the nursery :meth:`run` holds (the gateway starts it before it serves).

    ``on_task_end`` is called from a hub's loop when a task has ended (it must not
    block). A replay runs in the task of the connection that subscribes, and waits for
    room in that connection's outbox.
    """

    def __init__(
        self, *, on_task_end: Callable[[Session], None] | None, limits: GatewayLimits
    ) -> None:
        self._on_task_end = on_task_end
        self._limits = limits
        self._hubs: dict[str, SessionHub] = {}
        self._nursery: trio.Nursery | None = None
        self._running = trio.Event()
        self._adopting = trio.Lock()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the hubs' nursery until cancelled; ready at once. When it ends every hub's
        loop has ended and the hubs are forgotten."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._running.set()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.close_all()

    def get(self, session_id: str) -> SessionHub | None:
        """The hub of ``session_id``, when the gateway has adopted that session."""
        return self._hubs.get(session_id)

    async def adopt(self, session: Session) -> SessionHub:
        """The session's hub, started on first use; once it returns, every batch the
        session publishes reaches the hub. A reloaded
        session (a new object with the id) gets a new hub. Waits for :meth:`run` to be
        serving; raises ``RuntimeError`` once it has stopped."""
        hub = self._hubs.get(session.id)
        if hub is not None and hub.session is session:
            return hub  # without a checkpoint: callers rely on it (see subscribe)
        await self._running.wait()
        async with self._adopting:
            hub = self._hubs.get(session.id)
            if hub is not None and hub.session is session:
                return hub
            if hub is not None:
                del self._hubs[session.id]
                hub.close()
            if self._nursery is None:
                raise RuntimeError("the gateway has stopped")
            # A subagent is not titled: it is named by its spawning call, and a title
            # would cost its tree a model request it did not ask for.
            on_task_end = self._on_task_end if session.parent_id is None else None
            hub = SessionHub(session, on_task_end=on_task_end)
            await self._nursery.start(hub.run)
            self._hubs[session.id] = hub
            return hub

    async def settled(self, session: Session) -> Session:
        """``session``, after letting a task that has already emitted its ``task_end``
        finish syncing its trace (briefly), so that a client reacting to ``task_end`` is
        not told 409 Busy, and its steering or follow-up is not taken by a task that
        is ending."""
        hub = await self.adopt(session)
        if session.busy and hub.finishing and not session.has_follow_ups:
            with trio.move_on_after(self._limits.settle_timeout_s):
                await session.wait_idle()
        return session

    async def subscribe(
        self, connection: Connection, session: Session, after_seq: int
    ) -> tuple[int, int]:
        """Subscribe ``connection`` to ``session`` (replacing its subscription there, if
        any): queue the traced outputs after ``after_seq``, then, once the connection has
        queued its answer, the live ones. Returns ``(replayed, last_seq)``."""
        hub = await self.adopt(session)
        old = connection.subscriptions.get(session.id)
        if old is not None:
            old.close()
        # Live first (buffered), then the replay: an output emitted meanwhile is in the
        # buffer, in the trace, or in both (deduplicated by seq): never in neither. No
        # checkpoint between the subscription and its marker.
        subscription = Subscription(connection, hub, after_seq, self._limits)
        hub.join(subscription)
        try:
            records = await replay_records(session, after_seq)
            last_seq = after_seq
            replayed = 0
            # What the replay queues stays under half the slow-client bound: a long
            # trace neither fills memory nor counts against a client that reads.
            room = max(1, self._limits.max_pending_frames // 2)
            for record in records:
                if subscription.closed:
                    break
                await connection.outbox.wait_below(room)
                if not connection.outbox.offer(output_frame(record)):
                    if connection.outbox.closed:
                        break  # the connection is gone: nobody to tell
                    # Larger than half the bound by itself: the client cannot take it.
                    subscription.drop(
                        f"an output larger than {connection.outbox.max_bytes // 2} bytes"
                    )
                    break
                last_seq = record.seq or last_seq
                subscription.last_seq = last_seq
                replayed += 1
        except BaseException:
            subscription.close()
            raise
        # The answer marks the end of the replay: what follows it is live.
        connection.after_answer.append(lambda: subscription.go_live(last_seq))
        return replayed, last_seq

    def close_all(self) -> None:
        """The gateway stopped: the hubs' loops end. The sessions keep running, and their
        requests keep waiting for a person (R-HITL-1)."""
        for hub in self._hubs.values():
            hub.close("the gateway stopped")
        self._hubs.clear()


def session_state(session: Session | None, hub: SessionHub | None) -> SessionState:
    """What ``session.list`` says a session is doing: a task waits for a person's answer,
    a task runs, or nothing runs (a task that has emitted its end counts as done)."""
    if session is None or not session.busy:
        return "idle"
    if (hub is not None and hub.open_approvals) or _asks_people(session):
        return "waiting_for_approval"
    if hub is not None and hub.finishing:
        return "idle"
    return "running"


def _asks_people(session: Session) -> bool:
    """Whether the session's task waits for a person, whenever it asked (before the
    gateway watched too: a restarted server, a loaded session)."""
    try:
        port = session.host.port(session.id)
    except SessionNotFound:
        return False  # closed meanwhile: nothing waits here
    return bool(pending_of(port))


def output_frame(output: Output) -> str:
    """The ``output`` notification of one output, as text."""
    return jsonrpc.encode(jsonrpc.notification_frame("output", to_dict(output)))


async def replay_records(session: Session, after_seq: int) -> list[Output]:
    """The session's traced outputs with ``seq > after_seq``, from all its trace files in
    order. Nothing is published before its record is written to the file (R-TRACE-3), so
    the files hold everything published before this call."""
    return await session.host.trace_store.log.read_after(session.id, after_seq)
