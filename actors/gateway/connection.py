"""One websocket client of the gateway: its reader, its writer and what lies between.

::

    Connection.run          the reader: the connection's handler task itself; reads frames
    │                       and answers requests in arrival order
    ├── writer              sends the outbox's frames (responses, notifications) in order
    ├── auth deadline       closes an unauthenticated connection after ``auth_timeout_s``
    └── detached calls      ``compact`` (it waits for a model request), answered when done

Frames are read and built by :mod:`greenroom.protocols.jsonrpc`; a method's work is done by
the handler the gateway's dispatch table names (:mod:`greenroom.actors.gateway.methods`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from greenroom.actors.gateway.config import GatewayLimits
from greenroom.actors.runtime.errors import (
    AuthLocked,
    Busy,
    ConfigurationError,
    GreenroomError,
    SessionNotFound,
)
from greenroom.actors.runtime.trace_sink import LedgerUnusable
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import Batch, FrameError, Notification, Request, RpcError

if TYPE_CHECKING:
    from greenroom.actors.gateway.hubs import Subscription

logger = logging.getLogger(__name__)

Handler = Callable[["Connection", dict[str, Any]], Awaitable[Any]]
"""A method's handler: the connection that called and the call's params; returns the
result (raising :class:`RpcError` or a :class:`GreenroomError` to answer an error)."""


@attrs.frozen
class AnswerLater:
    """What a handler returns when its work is done but its answer must wait (``run``: for
    the prompt to be durable). The connection goes on with the next call at once and sends
    the answer when ``wait()`` returns it (or raises); in a batch, and wherever a handler's
    result is awaited in place, ``wait()`` is awaited there."""

    wait: Callable[[], Awaitable[Any]]
    begun: Any = None
    """What is known already (``run``: its ``run_id``): a host that forwarded the call
    is told this at once and asks for the answer apart."""


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; one per call."""

    __slots__ = ("_last", "_rate", "_tokens", "burst")

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last: float | None = None

    def take(self, now: float) -> bool:
        """Spend one token at ``now``; False when none is left."""
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


class Outbox:
    """Frames waiting for the connection's writer: the connection's one channel, from its
    reader (answers), its subscriptions (outputs, replays) and the hubs (notices) to its
    writer, which alone takes from it.

    Nothing waits to be put: session listeners queue from the hub's loop, where waiting
    on a client would stall the session and every other client of it. Instead every
    frame counts against one bound, ``max_bytes`` (characters of JSON text queued or
    taken and not yet sent; R-SEC-9), and what does not fit is refused:

    * :meth:`offer` (a subscription's output) returns False, and the subscription is
      dropped with a notice the client can resume from;
    * :meth:`put_nowait` (an answer, an error, a notice: frames the client cannot do
      without) cuts the client off instead (:meth:`cut_off`). A client that never reads is
      disconnected rather than grow the server.

    Beside the bound on bytes, a bound on time: a client whose writer has been stuck in
    one send for ``send_timeout_s`` reads nothing, and is cut off too (the gateway looks
    at every connection each quarter of it: :meth:`cut_off_if_stuck`), so what waits for
    a client that stopped reading for good is let go without waiting for it to leave.

    A replay waits for room (:meth:`wait_below`). The writer takes every queued frame at
    once (:meth:`take_all`) and reports each send (:meth:`sending`, :meth:`sent`), and
    the frames it took and will not send (:meth:`let_go`).
    :meth:`behind` is the slow-client rule for subscriptions: frames the writer has not
    taken count only while the writer is stuck in one send, because a burst queued while
    the writer merely waits to be scheduled is sent as soon as it runs. After
    :meth:`close` frames are discarded.
    """

    def __init__(
        self, max_bytes: int = 64 << 20, on_overflow: Callable[[str], None] | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self._on_overflow = on_overflow
        self._queue: deque[str] = deque()
        self._taken = 0
        self.size = 0
        """Characters of the frames queued or taken and not yet sent (never more than
        ``max_bytes``)."""
        self.peak = 0
        """The largest :attr:`size` so far."""
        self.overflowed: str | None = None
        """Why the client was cut off (a frame that had to be sent did not fit, or the
        client read nothing for ``send_timeout_s``), or None."""
        self._closed = False
        self._send_began: float | None = None
        self._arrived = trio.Event()
        self._progress = trio.Event()

    @property
    def closed(self) -> bool:
        """Whether frames are discarded (the connection is gone or was cut off)."""
        return self._closed

    @property
    def pending(self) -> int:
        """Frames queued or taken and not yet sent."""
        return len(self._queue) + self._taken

    def offer(self, frame: str) -> bool:
        """Queue ``frame`` if it fits under ``max_bytes``; False (nothing queued) if it
        does not or the outbox is closed. Never blocks or raises."""
        if self._closed or self.size + len(frame) > self.max_bytes:
            return False
        self._queue.append(frame)
        self.size += len(frame)
        self.peak = max(self.peak, self.size)
        self._arrived.set()
        return True

    def put_nowait(self, frame: str) -> None:
        """Queue ``frame`` for the writer (dropped once closed); when it does not fit, cut
        the client off (see the class). Never blocks or raises."""
        if self.offer(frame) or self._closed:
            return
        self.cut_off(f"client too slow: more than {self.max_bytes} bytes not read")

    def cut_off(self, reason: str) -> None:
        """The client is cut off for ``reason``: the outbox closes, letting go of what
        waits, and ``on_overflow`` is called with the reason (once: nothing after the
        first)."""
        if self._closed:
            return
        self.overflowed = reason
        self.close()
        if self._on_overflow is not None:
            self._on_overflow(reason)

    async def take_all(self) -> list[str]:
        """Every queued frame, once there is one (the writer's side)."""
        while not self._queue:
            self._arrived = trio.Event()
            await self._arrived.wait()
        frames = list(self._queue)
        self._queue.clear()
        self._taken += len(frames)
        return frames

    def sending(self, now: float) -> None:
        """The writer began sending a frame at ``now``."""
        self._send_began = now

    def sent(self, frame: str) -> None:
        """The writer has sent ``frame``."""
        self._taken -= 1
        self.size -= len(frame)
        self._send_began = None
        self._progress.set()
        self._progress = trio.Event()

    def behind(self, now: float, limits: GatewayLimits) -> str | None:
        """Why this client is too far behind to keep its subscriptions, or None. (The
        bound on bytes is :meth:`offer`'s.)"""
        stuck = self._send_began is not None and now - self._send_began >= limits.stall_timeout_s
        if stuck and len(self._queue) > limits.max_pending_frames:
            return "client too slow: outputs not read"
        return None

    def cut_off_if_stuck(self, now: float, timeout_s: float) -> bool:
        """Cut the client off if the writer has been stuck in one send since ``timeout_s``
        before ``now`` (the client reads nothing); whether it was."""
        began = self._send_began
        if began is None or now - began < timeout_s or self._closed:
            return False
        self.cut_off(f"client too slow: nothing read for {timeout_s:g} s")
        return True

    async def wait_below(self, limit: int) -> None:
        """Return once fewer than ``limit`` frames are pending and at most half of
        ``max_bytes`` waits: room for a replayed output and for the answers that follow;
        or once the outbox is closed (nothing will be sent)."""
        while not self._closed and (self.pending >= limit or self.size > self.max_bytes // 2):
            await self._progress.wait()

    def close(self) -> None:
        """Discard what waits and whatever is put from now on."""
        self._closed = True
        self.size -= sum(len(frame) for frame in self._queue)
        self._queue.clear()
        self._progress.set()

    def let_go(self, frames: list[str]) -> None:
        """The writer will not send ``frames`` (taken, not sent yet): the client is cut
        off, or the outbox closed."""
        self._taken -= len(frames)
        self.size -= sum(len(frame) for frame in frames)
        self._send_began = None


class Connection:
    """One websocket client: its identity, limits, outbox and subscriptions, and the
    tasks that serve it (:meth:`run`).

    Channels: the :class:`Outbox` (never waits; bounded in bytes and in time, see there)
    is the only way frames reach the client; ``after_answer`` holds actions to run once
    the current frame's answer is queued (a subscription goes live there, so that its
    first live output follows the answer). Requests are answered in arrival order by the
    reader itself, so a ``steer`` sent after a ``run`` lands in that run; a method in
    ``detached`` runs in its own task when it is called alone (inside a batch it runs in
    line).
    """

    def __init__(
        self,
        ws: WebSocketConnection,
        identity: str | None,
        limits: GatewayLimits,
        *,
        methods: Mapping[str, Handler],
        detached: frozenset[str] = frozenset(),
        auth_timeout_s: float,
        claimed: str | None = None,
        address: str | None = None,
    ) -> None:
        self.ws = ws
        self.identity = identity
        """The principal, once authenticated."""
        self.claimed = claimed
        """The client id the handshake's ``X-Greenroom-Client`` header named."""
        self.address = address
        """The remote address wrong tokens are counted against (``access.address_key``)."""
        self.counted: str | None = None
        """The principal one of whose connection places this connection holds (given
        back when it ends)."""
        self.authenticated = trio.Event()
        if identity is not None:
            self.authenticated.set()
        self.limits = limits
        self.initialized = False
        self.calls = 0
        """Calls answered with a result (``initialize`` aside)."""
        self.auth_failures = 0
        self.close_with: tuple[int, str] | None = None
        """Set to close the connection with this code and reason after the current frame."""
        self.bucket = TokenBucket(limits.rate_per_s, limits.burst)
        self.outbox = Outbox(limits.max_pending_bytes, on_overflow=self._cut_off)
        self.subscriptions: dict[str, Subscription] = {}
        """The connection's subscriptions, by session id."""
        self.after_answer: list[Callable[[], None]] = []
        self._methods = methods
        self._detached = detached
        self._auth_timeout_s = auth_timeout_s
        self._nursery: trio.Nursery | None = None
        self._reading = trio.CancelScope()

    async def run(self) -> None:
        """Read and answer frames until the client closes, :attr:`close_with` is set, the
        auth deadline passes or the client is cut off (its outbox overflowed, or it read
        nothing for ``send_timeout_s``); then let the last answer out (briefly; not to a
        client cut off) and stop the writer.
        Raises what a handler's unexpected failure or the socket raise, but never
        :class:`ConnectionClosed` from reading."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._write_loop, nursery.cancel_scope)
            if self.identity is None:
                nursery.start_soon(self._auth_deadline, nursery.cancel_scope)
            try:
                while self.close_with is None:
                    # Only the wait for a frame is cut short by an overflow: a handler
                    # that has begun runs to its end.
                    self._reading = trio.CancelScope()
                    with self._reading:
                        message = await self.ws.get_message()
                    if self._reading.cancelled_caught:
                        break
                    await self._on_message(message)
            except ConnectionClosed:
                pass
            if self.close_with is not None and self.outbox.overflowed is None:
                # Let the last answer (why we close) reach the client first.
                with trio.move_on_after(self.limits.close_timeout_s):
                    await self.outbox.wait_below(1)
            nursery.cancel_scope.cancel()

    def drop_subscriptions(self) -> None:
        """The connection is gone: end its subscriptions and discard what waits."""
        for subscription in list(self.subscriptions.values()):
            subscription.close()
        self.outbox.close()

    def close_soon(self, code: int, reason: str) -> None:
        """Close with ``code`` and ``reason`` as soon as the current frame, if any, is
        handled (a close already decided keeps its own)."""
        if self.close_with is None:
            self.close_with = (code, reason)
        self._reading.cancel()

    def _cut_off(self, reason: str) -> None:
        """The client was cut off (:meth:`Outbox.cut_off`): close (1008) with ``reason``."""
        self.close_soon(1008, reason)

    def failed_auth(self) -> None:
        """Count a wrong token; after ``max_auth_failures`` the connection closes (1008)."""
        self.auth_failures += 1
        if self.auth_failures >= self.limits.max_auth_failures:
            self.close_with = (1008, "too many failed authentication attempts")

    async def _auth_deadline(self, scope: trio.CancelScope) -> None:
        with trio.move_on_after(self._auth_timeout_s):
            await self.authenticated.wait()
            return
        self.close_with = (1008, f"not authenticated within {self._auth_timeout_s:g} s")
        scope.cancel()

    async def _write_loop(self, scope: trio.CancelScope) -> None:
        """Send what the outbox holds, in order; frames taken and not sent (the client cut
        off, the writer stopped) are let go. A send stuck for good is the gateway's to
        cut off (:meth:`Outbox.cut_off_if_stuck`): a timer around every frame would cost
        more than the send itself."""
        outbox = self.outbox
        try:
            while True:
                # Everything queued is taken at once: frames a prompt reader will get as
                # soon as this task runs do not count against the slow-client rule.
                frames = await outbox.take_all()
                done = 0
                try:
                    for frame in frames:
                        if outbox.closed:  # cut off meanwhile: the rest is not sent
                            return
                        outbox.sending(trio.current_time())
                        await self.ws.send_message(frame)
                        outbox.sent(frame)
                        done += 1
                finally:
                    if done < len(frames):
                        outbox.let_go(frames[done:])
        except ConnectionClosed:
            scope.cancel()

    def _run_after_answer(self) -> None:
        actions, self.after_answer = self.after_answer, []
        for action in actions:
            action()

    async def _on_message(self, message: str | bytes) -> None:
        limits = self.limits
        frame = jsonrpc.parse_frame(
            message, max_bytes=limits.max_frame_bytes, max_batch=limits.max_batch
        )
        if isinstance(frame, Batch):
            answers: list[dict[str, Any]] = []
            for item in frame.items:
                answer = await self._answer(item, detach=False)
                if answer is not None:
                    answers.append(answer)
            if answers:
                self.outbox.put_nowait(jsonrpc.encode(answers))
        else:
            answer = await self._answer(frame, detach=True)
            if answer is not None:
                self.outbox.put_nowait(jsonrpc.encode(answer))
        self._run_after_answer()

    async def _answer(
        self, call: Request | Notification | FrameError, *, detach: bool
    ) -> dict[str, Any] | None:
        """The response to one call (None for a notification, or one answered later)."""
        request_id = call.id if isinstance(call, Request | FrameError) else None
        wants_answer = not isinstance(call, Notification)
        if not self.bucket.take(trio.current_time()):
            error = RpcError(
                jsonrpc.TOO_MANY_REQUESTS,
                f"too many requests: at most {self.limits.rate_per_s:g} per second "
                f"(bursts of {self.limits.burst})",
            )
            return jsonrpc.error_frame(request_id, error) if wants_answer else None
        if isinstance(call, FrameError):
            return call.response()
        if self.identity is None and call.method != "initialize":
            error = RpcError(
                jsonrpc.UNAUTHORIZED,
                "unauthorized: send Authorization: Bearer TOKEN on the handshake or call "
                "initialize {token} first",
            )
            return jsonrpc.error_frame(request_id, error) if wants_answer else None
        method = self._methods.get(call.method)
        if method is None:
            error = RpcError(
                jsonrpc.METHOD_NOT_FOUND, f"method not found: {jsonrpc.echo(call.method)}"
            )
            return jsonrpc.error_frame(request_id, error) if wants_answer else None
        if detach and call.method in self._detached:
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_later, call, method)
            return None
        answer = await self._call(call, lambda: method(self, call.params))
        if not isinstance(answer, AnswerLater):
            return answer
        if detach:
            # The call's work is done, in the order of the calls; only its answer waits,
            # and the calls after it are not held up by it.
            assert self._nursery is not None
            self._nursery.start_soon(self._send_when_ready, call, answer)
            return None
        return await self._settle(call, answer)

    async def _answer_later(self, call: Request | Notification, method: Handler) -> None:
        answer = await self._call(call, lambda: method(self, call.params))
        if isinstance(answer, AnswerLater):
            answer = await self._settle(call, answer)
        if answer is not None:
            self.outbox.put_nowait(jsonrpc.encode(answer))

    async def _send_when_ready(self, call: Request | Notification, later: AnswerLater) -> None:
        answer = await self._settle(call, later)
        if answer is not None:
            self.outbox.put_nowait(jsonrpc.encode(answer))

    async def _settle(
        self, call: Request | Notification, later: AnswerLater
    ) -> dict[str, Any] | None:
        answer = await self._call(call, later.wait, final=True)
        assert not isinstance(answer, AnswerLater)
        return answer

    async def _call(
        self,
        call: Request | Notification,
        invoke: Callable[[], Awaitable[Any]],
        *,
        final: bool = False,
    ) -> dict[str, Any] | AnswerLater | None:
        """The answer frame of ``invoke()`` (or the :class:`AnswerLater` it returned, unless
        ``final``: an answer that waits for another is a handler's bug)."""
        error: RpcError
        try:
            result = await invoke()
            if isinstance(result, AnswerLater):
                if not final:
                    return result
                raise TypeError(f"the answer of {call.method} waited for another answer")
        except RpcError as exc:
            error = exc
        except (Busy, AuthLocked, SessionNotFound) as exc:
            error = RpcError(exc.code, str(exc))
        except LedgerUnusable as exc:
            # The server's file, not the call: its operator reads where it is and what to
            # do in the log; the client is not shown the server's paths.
            logger.error("gateway: %s: %s", call.method, exc)
            error = RpcError(
                jsonrpc.INTERNAL_ERROR, "the server's usage ledger cannot be used (see its log)"
            )
        except ConfigurationError as exc:
            error = RpcError(jsonrpc.INVALID_PARAMS, str(exc))
        except GreenroomError as exc:
            error = RpcError(getattr(exc, "code", jsonrpc.INTERNAL_ERROR), str(exc))
        except Exception as exc:
            logger.exception("gateway: %s failed", call.method)
            error = RpcError(jsonrpc.INTERNAL_ERROR, f"internal error: {exc!r}")
        else:
            if call.method != "initialize":
                self.calls += 1
            if isinstance(call, Request):
                return jsonrpc.result_frame(call.id, result)
            return None
        if isinstance(call, Request):
            return jsonrpc.error_frame(call.id, error)
        return None


SHUTTING_DOWN = (1001, "server shutting down")
"""The close code and reason of every connection when the gateway stops."""


class OpenConnections:
    """The websocket connections one run of a gateway serves, those whose close is under
    way, and their close when the gateway stops."""

    def __init__(self) -> None:
        self._open: set[Connection] = set()
        self._closing: set[Connection] = set()
        self._closed = trio.lowlevel.ParkingLot()
        self.closed_by = math.inf
        """When the connections must be closed by: set as the gateway stops."""

    def __iter__(self) -> Iterator[Connection]:
        return iter(list(self._open))

    def __contains__(self, connection: object) -> bool:
        return connection in self._open

    def __len__(self) -> int:
        return len(self._open)

    def add(self, connection: Connection) -> None:
        """A connection accepted; closed at once if the gateway is stopping."""
        self._open.add(connection)
        if self.closed_by < math.inf:
            connection.close_soon(*SHUTTING_DOWN)

    def discard(self, connection: Connection) -> None:
        """A connection no longer served: its close handshake begins."""
        self._open.discard(connection)
        self._closing.add(connection)

    def closed(self, connection: Connection) -> None:
        """A connection's close is over (its handshake done, or given up)."""
        self._closing.discard(connection)
        self._closed.unpark_all()

    async def close_all(self, timeout_s: float) -> None:
        """Close every connection (1001) once the frame it handles is answered, and return
        when all are closed or ``timeout_s`` has passed."""
        self.closed_by = trio.current_time() + timeout_s
        with trio.move_on_at(self.closed_by):
            for connection in self:
                connection.close_soon(*SHUTTING_DOWN)
            while self._open or self._closing:
                await self._closed.park()
