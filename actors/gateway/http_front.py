"""Plain HTTP on the gateway's port, beside the websocket gateway: the A2A and AG-UI
endpoints (``serve --a2a``, ``serve --ag-ui``: R-PROTO-1, R-PROTO-2).

::

    HttpFront.run                 the accept loop (trio.serve_listeners), until cancelled
    └── one task per connection: read the first request's head (h11), then either
        ├── hand the connection over to trio-websocket, every byte read given back
        │   (HandedOverListener), and wait until it is closed; or
        └── serve HTTP requests to the endpoints (h11, keep-alive) until it closes

Routing: a request for one of the endpoints' paths that is not an upgrade is HTTP; every
other connection — a websocket handshake, another path, bytes that are not HTTP — goes to
trio-websocket exactly as it arrived, so the websocket gateway answers it as it always
did. The front is in place only when an endpoint is served; the websocket path then costs
one read of the handshake's head and one task hop, nothing per frame.

Admission per request, as for a websocket handshake (R-SEC-4, R-SEC-9): a ``Host`` header
naming no name of the gateway is refused first (421, DNS rebinding: ``HostNames``); a foreign
``Origin`` is refused (403), and so is its CORS preflight; an address that sent too many
wrong tokens waits (429 with ``Retry-After``) before its token is looked at; a missing or
wrong ``Authorization: Bearer`` token is 401 (a wrong one counts against the address);
an ``X-Greenroom-Client`` header may only repeat the token's principal (403 when it names
another, 400 when it names no client id: the handshake's own check);
each HTTP connection takes one of the gateway's seats (503 when none is left) and each
request one of its principal's connections (429 beyond them) for as long as it is
answered — an event stream holds its place like a websocket does — and a kept-alive
connection one while it waits for its next request (:class:`IdlePlaces`: at its cap, a
principal's request closes its longest-idle connection instead of being refused), so
that idle connections cannot hold the seats beyond the cap either. A connection none of
whose requests brought a valid token by the handshake timeout (from its start) is closed
then, whatever it was answered meanwhile, as a websocket that does not authenticate is
(a request whose body it cuts short is answered 400 first).

CORS: web front ends are served from an origin of their own, so the endpoints answer a
browser's preflight (``OPTIONS`` with an ``Origin``) for the gateway's allowed origins —
the websocket's list, one list for both sides — and every answer to a request from such an
origin, errors and event streams too, carries ``Access-Control-Allow-Origin`` with that
origin. A request from any other origin gets no CORS header (the browser hides the answer
from the page) and is refused; a request without ``Origin`` (not a browser) is answered
exactly as before. No ``Access-Control-Allow-Credentials``: the token travels in the
``Authorization`` header the page sets, never in a cookie, so a page can use the
endpoints only with a token it was given.

Bad input never ends more than its connection: a malformed request is 400, a head larger
than :data:`MAX_HEAD_BYTES` 431, a body larger than the gateway's frame cap
(``max_frame_bytes``) or its path's own :class:`BodyLimit` (an AG-UI run's makes room for
an image) 413, an unknown method on a path 405; a head not complete within
the handshake timeout closes the connection, and a body not complete within it (or by the
unauthenticated connection's deadline above, when that comes first) is answered 400
before the close. An endpoint that fails answers 500 and is logged. A client that takes
no answer (or event) within the write timeout (``close_timeout_s`` + 10 s) loses its
connection: its doing, logged in one line without a traceback (:class:`TooSlow`). An
answer that waits for work (a blocking A2A send waits for its task:
:meth:`Reply.unless_gone`) stops waiting when the client closes the connection.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs
import h11
import trio

from greenroom.actors.gateway.access import (
    Admission,
    ClaimRefused,
    HostNames,
    Principals,
    Seats,
    address_key,
    check_claim,
    claimed_client,
)
from greenroom.actors.gateway.config import GatewayLimits
from greenroom.actors.gateway.sockets import CountedStream
from greenroom.protocols import jsonrpc

__all__ = [
    "CORS_ALLOW_HEADERS",
    "CORS_EXPOSE_HEADERS",
    "CORS_MAX_AGE_S",
    "MAX_HEAD_BYTES",
    "BodyLimit",
    "EventSink",
    "HttpFront",
    "HttpRequest",
    "Reply",
    "Route",
]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
"""The largest request head read (a websocket handshake's too)."""

CORS_MAX_AGE_S = 600
"""How long a browser may reuse a preflight's answer (``Access-Control-Max-Age``)."""

CORS_ALLOW_HEADERS = "Authorization, Content-Type, Accept, Last-Event-ID"
"""The request headers a page may set (``Access-Control-Allow-Headers``): the token, the
JSON body's type, the event stream's ``Accept`` and the AG-UI reconnect's last id."""

CORS_EXPOSE_HEADERS = "Retry-After, WWW-Authenticate, Allow"
"""The answers' headers a page may read besides the safelisted ones: why and for how long
a request was refused."""

KEEPALIVE_S = 15.0
"""How long an event stream may stay silent before a comment line keeps proxies from
timing it out (and finds a client that went away)."""

_REASONS = {
    204: b"No Content",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    409: b"Conflict",
    413: b"Content Too Large",
    415: b"Unsupported Media Type",
    421: b"Misdirected Request",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


@attrs.frozen(kw_only=True)
class HttpRequest:
    """One HTTP request to an endpoint, admitted: its ``principal`` is the bearer token's."""

    method: str
    path: str
    headers: Mapping[str, str]
    """Names in lower case; values decoded as latin-1."""
    body: bytes
    principal: str
    host: str
    """The ``Host`` header (empty without one)."""


class Endpoint(Protocol):
    """What answers the requests of a path."""

    async def respond(self, request: HttpRequest, reply: Reply) -> None:
        """Answer ``request`` through ``reply`` (once). Raises nothing but Cancelled for a
        request it can answer; an exception is answered 500."""
        ...


@attrs.frozen(kw_only=True)
class BodyLimit:
    """The largest body a path's requests may have (``max_bytes``), and what it makes room
    for (``room_for``, said in the 413 that refuses a larger one)."""

    max_bytes: int
    room_for: str


@attrs.frozen(kw_only=True)
class Route:
    """A path's endpoint, the methods it takes and the largest body its requests may have
    (``body``; None: the gateway's frame cap, a request being one JSON-RPC frame)."""

    endpoint: Endpoint
    methods: frozenset[str]
    body: BodyLimit | None = None


class Gone(Exception):
    """The client went away (or stopped reading) while it was being answered."""


class TooSlow(Gone):
    """The client took no answer within the write timeout: its doing, not the server's
    (logged in one line, without a traceback)."""


class EventSink:
    """The events of one ``text/event-stream`` answer: :meth:`send` writes one event (it
    waits for the client to take it, at most the write timeout). When the client has
    gone, the stream's scope is cancelled: the producer is cancelled at its next
    checkpoint."""

    def __init__(self, stream: CountedStream, conn: h11.Connection, write_timeout_s: float) -> None:
        self._stream = stream
        self._conn = conn
        self._write_timeout_s = write_timeout_s
        self._lock = trio.Lock()
        self.scope = trio.CancelScope()
        self.last_write = trio.current_time()
        self.gone = False

    async def send(self, data: str, *, event_id: str | None = None) -> None:
        """One event whose ``data`` is ``data`` (one line: JSON), with an ``id`` line."""
        head = f"id: {event_id}\n" if event_id is not None else ""
        await self._write(f"{head}data: {data}\n\n".encode())

    async def comment(self, text: str) -> None:
        """A comment line (ignored by clients)."""
        await self._write(f": {text}\n\n".encode())

    async def _write(self, payload: bytes) -> None:
        if self.gone:
            return
        async with self._lock:
            try:
                with trio.fail_after(self._write_timeout_s):
                    await self._stream.send_all(self._conn.send(h11.Data(data=payload)) or b"")
            except trio.TooSlowError:
                logger.info(
                    "gateway: HTTP client %s too slow: took no event for %g s; stream ended",
                    self._stream.peer,
                    self._write_timeout_s,
                )
                self.gone = True
                self.scope.cancel()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.gone = True
                self.scope.cancel()
            self.last_write = trio.current_time()


class Reply:
    """How an endpoint answers a request: once, with a whole body (:meth:`json`,
    :meth:`error`), with none (:meth:`empty`) or with an event stream (:meth:`events`).
    Every answer carries ``cors``, the request's CORS headers (none for a request that is
    not from an allowed browser origin)."""

    def __init__(
        self,
        stream: CountedStream,
        conn: h11.Connection,
        limits: GatewayLimits,
        cors: Iterable[tuple[str, str]] = (),
    ) -> None:
        self._stream = stream
        self._conn = conn
        self._limits = limits
        self._cors = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in cors]
        self.sent = False

    async def json(self, status: int, body: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        """A JSON answer."""
        data = jsonrpc.encode(body).encode("utf-8")
        await self._whole(status, b"application/json", data, headers)

    async def error(
        self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        """An error answer: ``{"error": {"code": status, "message": message}}``, the
        message cut to :data:`~greenroom.protocols.jsonrpc.MAX_ERROR_CHARS` (it may quote
        what the client sent: R-SEC-9)."""
        body = {"code": status, "message": jsonrpc.clip(message, jsonrpc.MAX_ERROR_CHARS)}
        await self.json(status, {"error": body}, headers)

    async def empty(self, headers: Iterable[tuple[str, str]] = ()) -> None:
        """A 204 answer (no body)."""
        await self._whole(204, None, b"", headers)

    async def _whole(
        self, status: int, kind: bytes | None, data: bytes, headers: Iterable[tuple[str, str]]
    ) -> None:
        self.sent = True
        framing = (
            []
            if kind is None
            else [
                (b"Content-Type", kind),
                (b"Content-Length", str(len(data)).encode()),
            ]
        )
        response = h11.Response(
            status_code=status,
            reason=_REASONS.get(status, b""),
            headers=[
                *framing,
                (b"Cache-Control", b"no-store"),
                (b"X-Content-Type-Options", b"nosniff"),
                *self._cors,
                *((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers),
            ],
        )
        conn = self._conn
        payload = conn.send(response) or b""
        if data:
            payload += conn.send(h11.Data(data=data)) or b""
        payload += conn.send(h11.EndOfMessage()) or b""
        timeout = self._limits.close_timeout_s + 10
        try:
            with trio.fail_after(timeout):
                await self._stream.send_all(payload)
        except trio.TooSlowError:
            raise TooSlow(f"took no answer for {timeout:g} s") from None

    async def events(self, produce: Callable[[EventSink], Awaitable[None]]) -> None:
        """Answer with a ``text/event-stream``: ``produce`` sends the events; the answer
        ends when it returns. The connection closes after it. When the client goes away
        (closes, or takes nothing for the write timeout) ``produce`` is cancelled."""
        self.sent = True
        conn = self._conn
        head = conn.send(
            h11.Response(
                status_code=200,
                headers=[
                    (b"Content-Type", b"text/event-stream; charset=utf-8"),
                    (b"Cache-Control", b"no-store"),
                    (b"X-Accel-Buffering", b"no"),
                    (b"Connection", b"close"),
                    *self._cors,
                ],
            )
        )
        sink = EventSink(self._stream, conn, self._limits.close_timeout_s + 10)
        await self._stream.send_all(head or b"")
        with sink.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._hang_up, sink)
                nursery.start_soon(self._keep_alive, sink)
                await produce(sink)
                nursery.cancel_scope.cancel()
        if not sink.gone:
            with trio.move_on_after(self._limits.close_timeout_s):
                await self._stream.send_all(conn.send(h11.EndOfMessage()) or b"")

    async def unless_gone(self, work: Callable[[], Awaitable[None]]) -> bool:
        """Run ``work`` (what a whole answer waits for: a blocking A2A send waits for its
        task) while watching the connection: when the client closes it first, ``work`` is
        cancelled and False is returned, and nothing is to be answered. Bytes the client
        sends meanwhile (a pipelined request) are given back for the next request; the
        watch ends there."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_for_close, scope)
                await work()
                nursery.cancel_scope.cancel()
        return not scope.cancelled_caught

    async def _watch_for_close(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the client closes the connection (or it breaks)."""
        try:
            data = await self._stream.receive_some(16384)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if data:
            self._stream.unread(bytes(data))  # the next request's: not a hang-up
            return
        scope.cancel()

    async def _hang_up(self, sink: EventSink) -> None:
        """Cancel the stream when the client closes its side (it sends nothing more)."""
        try:
            while await self._stream.receive_some(4096):
                pass  # a client sends nothing on an event stream: dropped
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        sink.gone = True
        sink.scope.cancel()

    async def _keep_alive(self, sink: EventSink) -> None:
        while True:
            await trio.sleep_until(sink.last_write + KEEPALIVE_S)
            if trio.current_time() >= sink.last_write + KEEPALIVE_S:
                await sink.comment("keep-alive")


class IdlePlaces:
    """The kept-alive HTTP connections that wait for their next request, each holding a
    place of the principal its requests came from (R-SEC-9): a principal's idle
    connections count against its connections as its requests do, so it cannot keep the
    gateway's seats with them and lock other principals out. A request of a principal
    with no place left closes its longest-idle connection to take that place
    (:meth:`evict`). No I/O."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._waiting: dict[str, dict[trio.CancelScope, None]] = {}

    def hold(self, principal: str, deadline: float) -> trio.CancelScope | None:
        """A place of ``principal`` for a connection's wait until ``deadline``: the scope
        to wait in (:meth:`evict` cancels it), or None when it has no place left (the
        connection is then not kept alive). Give it back with :meth:`end`."""
        if not self._admission.admit(principal):
            return None
        scope = trio.CancelScope(deadline=deadline)
        self._waiting.setdefault(principal, {})[scope] = None
        return scope

    def end(self, principal: str, scope: trio.CancelScope) -> None:
        """The wait in ``scope`` is over: its place is given back (unless evicted)."""
        waiting = self._waiting.get(principal, {})
        if scope in waiting:
            self._forget(principal, scope)
            self._admission.release(principal)

    def evict(self, principal: str) -> bool:
        """Close ``principal``'s longest-idle connection and give its place back at once;
        False when none of its connections waits."""
        waiting = self._waiting.get(principal)
        if not waiting:
            return False
        scope = next(iter(waiting))
        self._forget(principal, scope)
        scope.cancel()
        self._admission.release(principal)
        return True

    def _forget(self, principal: str, scope: trio.CancelScope) -> None:
        waiting = self._waiting[principal]
        del waiting[scope]
        if not waiting:
            del self._waiting[principal]


class HttpFront:
    """The HTTP side of the gateway's port: routes each connection (HTTP to ``routes``,
    everything else to trio-websocket through ``handoff``) and admits each request.

    ``principals``, ``admission`` and ``seats`` are the gateway's own (one set of
    tokens, caps and wrong-token counts for both sides); ``origin_allowed`` says whether
    a browser ``Origin`` may call.

    Channels: ``handoff`` (given to :meth:`run`) carries the connections for
    trio-websocket; it is the front's to close.
    """

    def __init__(
        self,
        routes: Mapping[str, Route],
        *,
        principals: Principals,
        admission: Admission,
        seats: Seats,
        origin_allowed: Callable[[bytes], bool],
        limits: GatewayLimits,
        host_names: HostNames | None = None,
    ) -> None:
        self.routes = dict(routes)
        self._principals = principals
        self._admission = admission
        self._seats = seats
        self._origin_allowed = origin_allowed
        self._limits = limits
        self._host_names = host_names  # None: any Host header (the gateway gives its own)
        self._idle = IdlePlaces(admission)
        self._handoff: trio.MemorySendChannel[CountedStream] | None = None

    async def run(
        self,
        listeners: list[trio.abc.Listener[CountedStream]],
        handoff: trio.MemorySendChannel[CountedStream],
        handlers: trio.Nursery | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept and route connections until cancelled; ready once accepting. Each
        connection is served in ``handlers`` (default: this task's own nursery), which may
        outlive the accepting: a stopping gateway stops accepting first, then closes the
        connections it handed over to trio-websocket."""
        self._handoff = handoff
        serve = functools.partial(trio.serve_listeners, handler_nursery=handlers)
        async with handoff, trio.open_nursery() as nursery:
            await nursery.start(serve, self._route, listeners)
            task_status.started()

    # -- routing ---------------------------------------------------------------------------

    async def _route(self, stream: CountedStream) -> None:
        """One connection. Never raises but Cancelled (that would stop the listener)."""
        try:
            await self._route_connection(stream)
        # except*: a failure that comes grouped with a cancellation (the gateway stopping)
        # is logged; only the cancellation goes on.
        except* TooSlow as slow:
            # The client's doing: one line, no traceback.
            logger.info(
                "gateway: HTTP client %s too slow: %s; connection closed",
                stream.peer,
                slow.exceptions[0],
            )
        except* (trio.BrokenResourceError, trio.ClosedResourceError, Gone):
            pass  # the client went away
        except* Exception:
            logger.exception("gateway: HTTP connection failed")

    async def _route_connection(self, stream: CountedStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        read = bytearray()
        request: h11.Request | None = None
        started = trio.current_time()
        with trio.move_on_after(self._limits.handshake_timeout_s) as timer:
            request = await self._first_head(stream, conn, read)
        if timer.cancelled_caught or (request is None and not read):
            # Nothing whole in time (the handshake timeout holds for both sides: a slow
            # head is not given a second one), or closed: nothing to answer.
            return
        if request is None or not self._is_http(request):
            await self._hand_over(stream, bytes(read))
            return
        if self._seats.full:
            await Reply(stream, conn, self._limits, self._cors(_headers(request))).error(
                503, f"too many connections (at most {self._seats.cap})"
            )
            return
        self._seats.take()
        try:
            # Until a request brings a valid token the connection holds a seat as a
            # stranger: closed at the deadline whatever else it sends and is answered
            # (a 401, a 405), as a websocket that does not authenticate is (R-SEC-4).
            with trio.CancelScope(deadline=started + self._limits.handshake_timeout_s) as until:
                await self._serve(stream, conn, request, until)
        finally:
            self._seats.give_back()

    async def _first_head(
        self, stream: CountedStream, conn: h11.Connection, read: bytearray
    ) -> h11.Request | None:
        """The first request's head; None when the bytes are not HTTP or the connection
        closed first. Every byte read is kept in ``read``."""
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return None
            if isinstance(event, h11.Request):
                return event
            if event is not h11.NEED_DATA:
                return None
            chunk = await stream.receive_some(16384)
            read += chunk
            conn.receive_data(bytes(chunk))
            if not chunk:
                return None

    def _is_http(self, request: h11.Request) -> bool:
        path = request.target.split(b"?", 1)[0].decode("latin-1")
        if path not in self.routes:
            return False
        return not any(name.lower() == b"upgrade" for name, _ in request.headers)

    async def _hand_over(self, stream: CountedStream, read: bytes) -> None:
        """Give the connection to trio-websocket and wait until it is closed (the listener
        loop closes what its handler was given when the handler returns)."""
        assert self._handoff is not None
        stream.unread(read)
        await self._handoff.send(stream)
        await stream.closed.wait()

    # -- HTTP ------------------------------------------------------------------------------

    async def _serve(
        self,
        stream: CountedStream,
        conn: h11.Connection,
        first: h11.Request,
        unauthenticated: trio.CancelScope,
    ) -> None:
        """Answer requests on the connection until it closes (keep-alive between them).
        ``unauthenticated`` ends it at its deadline unless a request brings a valid token
        first (then its deadline is lifted)."""
        request: h11.Request | None = first
        principal: str | None = None  # whose requests the connection carried last
        while request is not None:
            headers = _headers(request)
            reply = Reply(stream, conn, self._limits, self._cors(headers))
            route = self.routes.get(request.target.split(b"?", 1)[0].decode("latin-1"))
            limit = None if route is None else route.body
            body = await self._body(stream, conn, reply, unauthenticated, limit)
            if body is None:
                return
            answered = await self._answer(request, headers, body, reply, stream, unauthenticated)
            principal = answered or principal
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return
            request = None
            deadline = trio.current_time() + self._limits.handshake_timeout_s
            if principal is None:
                with trio.move_on_at(deadline):
                    request = await self._next_head(stream, conn)
                continue
            idle = self._idle.hold(principal, deadline)
            if idle is None:
                return  # its principal has no place left: not kept alive
            try:
                with idle:
                    request = await self._next_head(stream, conn)
            finally:
                self._idle.end(principal, idle)

    async def _next_head(self, stream: CountedStream, conn: h11.Connection) -> h11.Request | None:
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                # No head, so no origin to answer to: no CORS headers.
                reply = Reply(stream, conn, self._limits)
                await reply.error(exc.error_status_hint, f"malformed request: {exc}")
                return None
            if isinstance(event, h11.Request):
                return event
            if event is not h11.NEED_DATA:
                return None
            chunk = await stream.receive_some(16384)
            conn.receive_data(bytes(chunk))

    async def _body(
        self,
        stream: CountedStream,
        conn: h11.Connection,
        reply: Reply,
        unauthenticated: trio.CancelScope,
        limit: BodyLimit | None,
    ) -> bytes | None:
        """The request's body, or None once an error was answered (or the connection
        closed first). A body larger than ``limit`` (None: the frame cap) is answered 413,
        one not complete within the handshake timeout, or by the ``unauthenticated``
        deadline when that comes first, 400."""
        closing = unauthenticated.deadline
        # The connection's deadline is held back while the body is read and taken as the
        # body's own when it is the earlier: the client whose body it cuts is answered
        # before the close, not dropped mid-request.
        unauthenticated.deadline = math.inf
        try:
            deadline = min(trio.current_time() + self._limits.handshake_timeout_s, closing)
            return await self._body_until(stream, conn, reply, deadline, limit)
        finally:
            unauthenticated.deadline = closing

    async def _body_until(
        self,
        stream: CountedStream,
        conn: h11.Connection,
        reply: Reply,
        deadline: float,
        limit: BodyLimit | None,
    ) -> bytes | None:
        # A request is one JSON-RPC frame (R-SEC-9), unless its path makes room for more.
        cap = self._limits.max_frame_bytes if limit is None else limit.max_bytes
        too_large = f"request body larger than {cap} bytes"
        if limit is not None:
            too_large += f" ({limit.room_for})"
        body = bytearray()
        with trio.move_on_at(deadline) as timer:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    await reply.error(exc.error_status_hint, f"malformed request: {exc}")
                    return None
                if isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > cap:
                        await reply.error(413, too_large)
                        return None
                elif isinstance(event, h11.EndOfMessage):
                    return bytes(body)
                elif event is h11.NEED_DATA:
                    chunk = await stream.receive_some(16384)
                    conn.receive_data(bytes(chunk))
                else:
                    return None  # closed before the end of the body
        if timer.cancelled_caught:
            await reply.error(400, "request body not complete in time")
        return None

    def _cors(self, headers: Mapping[str, str]) -> list[tuple[str, str]]:
        """The CORS headers of every answer to a request with ``headers``: none unless it
        comes from an allowed browser origin, which is named back as the browser sent it
        (the browser compares it with its own, exactly)."""
        origin = headers.get("origin")
        if origin is None or not self._origin_allowed(origin.encode("latin-1")):
            return []
        return [
            ("Access-Control-Allow-Origin", origin),
            ("Access-Control-Expose-Headers", CORS_EXPOSE_HEADERS),
            ("Vary", "Origin"),
        ]

    async def _preflight(self, route: Route, origin: str, reply: Reply) -> None:
        """A browser's CORS preflight: what a page of an allowed origin may send (the
        answer needs no token: a preflight never carries one). The browser checks the
        method and headers it asked for against these."""
        if not self._origin_allowed(origin.encode("latin-1")):
            await reply.error(403, "forbidden: this origin may not call")
            return
        await reply.empty(
            [
                ("Access-Control-Allow-Methods", ", ".join(sorted(route.methods | {"OPTIONS"}))),
                ("Access-Control-Allow-Headers", CORS_ALLOW_HEADERS),
                ("Access-Control-Max-Age", str(CORS_MAX_AGE_S)),
            ]
        )

    async def _answer(
        self,
        head: h11.Request,
        headers: Mapping[str, str],
        body: bytes,
        reply: Reply,
        stream: CountedStream,
        unauthenticated: trio.CancelScope,
    ) -> str | None:
        """Answer one request; the principal it was admitted as (None: refused first)."""
        host = headers.get("host")
        if self._host_names is not None and not self._host_names.allows(host):
            # First: a DNS rebinding page's wrong tokens would throttle loopback's clients.
            await reply.error(421, self._host_names.refusal(host))
            return None
        method = head.method.decode("latin-1")
        path = head.target.split(b"?", 1)[0].decode("latin-1")
        route = self.routes.get(path)
        if route is None:
            await reply.error(404, f"not found: the endpoints are {', '.join(sorted(self.routes))}")
            return None
        origin = headers.get("origin")
        if method == "OPTIONS" and origin is not None:
            await self._preflight(route, origin, reply)
            return None
        if method not in route.methods:
            allowed = ", ".join(sorted(route.methods))
            await reply.error(405, f"{path} takes {allowed}", [("Allow", allowed)])
            return None
        if origin is not None and not self._origin_allowed(origin.encode("latin-1")):
            await reply.error(403, "forbidden: this origin may not call")
            return None
        principal = await self._principal(headers, stream, reply)
        if principal is None:
            return None
        try:
            check_claim(claimed_client(headers.get("x-greenroom-client")), principal)
        except ClaimRefused as refused:
            await reply.error(refused.status, refused.reason)
            return None
        unauthenticated.deadline = math.inf
        if not self._admission.admit(principal) and not (
            self._idle.evict(principal) and self._admission.admit(principal)
        ):
            cap = self._limits.max_connections_per_principal
            await reply.error(429, f"too many connections for client {principal!r} (at most {cap})")
            return None
        request = HttpRequest(
            method=method,
            path=path,
            headers=headers,
            body=body,
            principal=principal,
            host=headers.get("host", ""),
        )
        try:
            await route.endpoint.respond(request, reply)
        except Gone:
            raise
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise Gone from None
        except Exception:
            logger.exception("gateway: %s %s failed", method, path)
            if not reply.sent:
                await reply.error(500, "internal error")
        finally:
            self._admission.release(principal)
        return principal

    async def _principal(
        self, headers: Mapping[str, str], stream: CountedStream, reply: Reply
    ) -> str | None:
        """The bearer token's principal, or None once a refusal was answered."""
        address = address_key(stream.peer)
        now = trio.current_time()
        wait = self._admission.throttled(address, now)
        if wait is not None:
            seconds = math.ceil(wait)
            await reply.error(
                429,
                f"too many failed authentication attempts from this address; retry in {seconds} s",
                [("Retry-After", str(seconds))],
            )
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        principal = None
        if scheme.lower() == "bearer" and token.strip():
            principal = self._principals.of(token.strip().encode("latin-1"))
            if principal is None:
                self._admission.failed(address, now)
        if principal is None:
            await reply.error(
                401,
                "unauthorized: send the gateway's token as Authorization: Bearer TOKEN",
                [("WWW-Authenticate", 'Bearer realm="greenroom"')],
            )
        return principal


def _headers(request: h11.Request) -> dict[str, str]:
    """A request's headers by lower-case name (the last of repeated ones), decoded as
    latin-1."""
    return {
        name.decode("latin-1").lower(): value.decode("latin-1") for name, value in request.headers
    }
