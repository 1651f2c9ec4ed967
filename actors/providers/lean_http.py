"""A lean HTTP/1.1 transport for the anthropic SDK's client: one body chunk per network read.

The SDK's own stack (httpx2 → httpcore2 → h11) hands a streamed body on one HTTP chunk at a
time, and a model's server sends one chunk per event: every event then climbs the whole
stack (h11's event machine, httpcore2's exception mapping and timeout scope, httpx2's and
the SDK's iterators) before greenroom's decoder sees it. :class:`LeanTransport` sits behind
the SDK's own seam (``DefaultAsyncHttpxClient(transport=…)``): the SDK still builds and
authenticates requests, applies the base URL, routes proxied URLs to its own transports and
turns HTTP statuses into its error types, while this transport reads the socket and hands
on, per read, every body byte that read completed — all its events at once.

Scope: HTTP/1.1 over trio TCP streams (TLS with the client's SSL context; a plain
connection's responses are read with ``os.read`` on its descriptor, and a streamed body's
reads share one cancel scope, see :meth:`RawBody.read_deadline`), keep-alive connections
reused per origin (an idle connection is dropped after
:data:`KEEPALIVE_EXPIRY_S` or when the server has closed it), bodies framed by
``transfer-encoding: chunked``, ``content-length`` or the connection's end. Failures are
httpx2's exceptions (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
``WriteTimeout``, ``PoolTimeout``, ``ReadError``, ``WriteError``, ``RemoteProtocolError``)
with httpcore's wording, so the provider reports them as it reports the SDK stack's.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import ssl
import sys
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import httpx2
import trio

KEEPALIVE_EXPIRY_S = 5.0
"""An idle connection older than this is closed instead of reused (httpcore's default)."""

READ_SIZE = 65536
RAW_BODY = "greenroom.raw_body"
"""The response extension that holds this transport's body stream (see :func:`raw_body`)."""
MAX_HEAD_BYTES = 65536
_CRLF = b"\r\n"
# A plain TCP connection is read with os.read on its descriptor, waiting for readiness
# only after a read that drained the socket: a streamed event then costs one system call
# and no trio socket wrapper (Windows cannot read a socket with os.read).
_DIRECT_READS = sys.platform != "win32"
_read = os.read
# Reads in a row that found data without waiting before the reader yields anyway.
_UNWAITED_READS = 16
# A body's read deadline is moved on only once this fraction of the timeout is used up:
# a stall still ends after between 1 and 1 + DEADLINE_SLACK read timeouts of silence.
DEADLINE_SLACK = 0.25


class _Connection:
    __slots__ = ("fd", "idle_since", "key", "socket", "stream")

    def __init__(
        self, key: tuple[bytes, str, int], stream: trio.abc.Stream, sock: Any, *, direct: bool
    ) -> None:
        self.key = key
        self.stream = stream
        self.socket = sock
        # The descriptor to read directly, or -1 to read through ``stream`` (TLS).
        self.fd: int = sock.fileno() if direct else -1
        self.idle_since = 0.0

    def is_readable(self) -> bool:
        """Whether the server has sent something (an end) on an idle connection."""
        try:
            fd = self.socket.fileno()
            if fd < 0:
                return True
            if not hasattr(select, "poll"):  # Windows
                return bool(select.select([fd], [], [], 0)[0])
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


class LeanTransport(httpx2.AsyncBaseTransport):
    """HTTP/1.1 for ``httpx2.AsyncClient(transport=…)`` on trio; see the module docstring.
    ``max_connections`` bounds the connections in use at once (a request beyond it waits
    up to the pool timeout); ``ssl_context`` is used for ``https`` URLs."""

    def __init__(
        self, *, ssl_context: ssl.SSLContext | None = None, max_connections: int = 1000
    ) -> None:
        self._ssl = ssl_context
        self._idle: dict[tuple[bytes, str, int], list[_Connection]] = {}
        self._limiter = trio.CapacityLimiter(max(1, max_connections))
        self._closed = False

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        """Send ``request`` on a kept-alive or new connection and return once the response
        head is read; its body streams one network read at a time. Raises httpx2's
        transport errors (connect, read and write failures and timeouts, a bad head)."""
        timeouts = request.extensions.get("timeout", {})
        url = request.url
        scheme = url.raw_scheme
        if scheme not in (b"http", b"https"):
            raise httpx2.UnsupportedProtocol(f"unsupported URL scheme {scheme!r}", request=request)
        port = url.port or (443 if scheme == b"https" else 80)
        key = (scheme, url.host, port)
        body = await request.aread()
        head = _request_head(request, body)
        limiter = self._limiter
        # The response may be closed by another task than this one: the slot is held on
        # behalf of the exchange, not of the task.
        token = object()
        with trio.move_on_after(_seconds(timeouts.get("pool"))) as waited:
            await limiter.acquire_on_behalf_of(token)
        if waited.cancelled_caught:
            raise httpx2.PoolTimeout("timed out waiting for a connection", request=request)
        try:
            reused = self._take_idle(key)
            conn = reused or await self._connect(key, request, timeouts)
            try:
                await _send(conn, head + body if len(body) < 65536 else head, request, timeouts)
                if len(body) >= 65536:
                    await _send(conn, body, request, timeouts)
                reader = _Reader(conn, request, _seconds(timeouts.get("read")))
                status, reason, headers = await reader.read_head()
            except (httpx2.RemoteProtocolError, httpx2.ReadError, httpx2.WriteError):
                await _close(conn)
                if reused is None:
                    raise
                # A kept-alive connection the server had closed: once more, on a new one.
                conn = await self._connect(key, request, timeouts)
                await _send(conn, head + body, request, timeouts)
                reader = _Reader(conn, request, _seconds(timeouts.get("read")))
                status, reason, headers = await reader.read_head()
        except BaseException:
            limiter.release_on_behalf_of(token)
            raise
        stream = RawBody(self, token, reader, request.method, status, headers)
        return httpx2.Response(
            status,
            headers=headers,
            stream=stream,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason, RAW_BODY: stream},
        )

    def _take_idle(self, key: tuple[bytes, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < KEEPALIVE_EXPIRY_S and not conn.is_readable():
                return conn
            _close_now(conn)
        return None

    async def _connect(
        self, key: tuple[bytes, str, int], request: httpx2.Request, timeouts: dict[str, Any]
    ) -> _Connection:
        scheme, host, port = key
        try:
            with trio.fail_after(_seconds(timeouts.get("connect"))):
                tcp = await trio.open_tcp_stream(host, port)
                stream: trio.abc.Stream = tcp
                if scheme == b"https":
                    context = self._ssl or ssl.create_default_context()
                    tls = trio.SSLStream(tcp, context, server_hostname=host, https_compatible=True)
                    await tls.do_handshake()
                    stream = tls
        except trio.TooSlowError:
            raise httpx2.ConnectTimeout("timed out connecting", request=request) from None
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        return _Connection(key, stream, tcp.socket, direct=_DIRECT_READS and stream is tcp)

    def release(self, token: object, conn: _Connection | None) -> None:
        """Called by a response's body stream when it is done: the exchange's slot is freed
        and ``conn`` (None: it was closed) is kept for the next request to its origin."""
        self._limiter.release_on_behalf_of(token)
        if conn is None:
            return
        if self._closed:
            _close_now(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    async def aclose(self) -> None:
        """Close every idle connection; responses still streaming close theirs at the end."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await _close(conn)


def raw_body(response: httpx2.Response) -> RawBody | None:
    """The body of a response this transport read, to iterate directly: per network read,
    the body bytes it completed, without httpx2's and the SDK's iterators around it (about
    a fifth of a streamed event's client CPU when every read holds one event). None when
    another transport read the response, or when its body is compressed (``content-encoding``
    other than ``identity``: httpx2's iterators decode it). Closing the response still
    closes the stream, and a stream read to its end has already released its connection."""
    stream = response.extensions.get(RAW_BODY)
    if not isinstance(stream, RawBody):
        return None
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return None
    return stream


def _seconds(value: Any) -> float:
    return float("inf") if value is None else float(value)


def _request_head(request: httpx2.Request, body: bytes) -> bytes:
    url = request.url
    target = url.raw_path or b"/"
    lines = [request.method.encode("ascii") + b" " + target + b" HTTP/1.1"]
    has_length = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"content-length" or lower == b"transfer-encoding":
            has_length = True
        lines.append(name + b": " + value)
    if not has_length and (body or request.method not in ("GET", "HEAD")):
        lines.append(b"Content-Length: " + str(len(body)).encode("ascii"))
    return _CRLF.join(lines) + _CRLF + _CRLF


async def _send(
    conn: _Connection, data: bytes, request: httpx2.Request, timeouts: dict[str, Any]
) -> None:
    try:
        with trio.fail_after(_seconds(timeouts.get("write"))):
            await conn.stream.send_all(data)
    except trio.TooSlowError:
        raise httpx2.WriteTimeout("timed out writing the request", request=request) from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise httpx2.WriteError(str(exc) or type(exc).__name__, request=request) from exc


async def _close(conn: _Connection) -> None:
    with trio.CancelScope(shield=True):
        with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(conn.stream)


def _close_now(conn: _Connection) -> None:
    with contextlib.suppress(OSError):
        conn.socket.close()


class _Reader:
    """The response side of one exchange: the head, then the body one read at a time.

    Each wait for the socket has the read timeout; while a :class:`BodyDeadline` holds the
    body's reads, that one cancel scope times them instead of a scope per read."""

    __slots__ = (
        "_buffer",
        "_conn",
        "_deadline",
        "_drained",
        "_eof",
        "_request",
        "_timeout",
        "_unwaited",
        "http_11",
    )

    def __init__(self, conn: _Connection, request: httpx2.Request, timeout: float) -> None:
        self._conn = conn
        self._request = request
        self._timeout = timeout
        self._deadline: BodyDeadline | None = None
        self._buffer = b""
        self._eof = False
        self._drained = False  # the last read emptied the socket: wait before the next
        self._unwaited = 0
        self.http_11 = True

    @property
    def conn(self) -> _Connection:
        return self._conn

    @property
    def request(self) -> httpx2.Request:
        return self._request

    @property
    def timeout(self) -> float:
        return self._timeout

    def hold_deadline(self, deadline: BodyDeadline | None) -> None:
        """Time the reads with ``deadline``'s scope (None: a scope per wait again)."""
        self._deadline = deadline

    async def receive(self) -> bytes:
        """One network read (b"" at the end of the connection)."""
        fd = self._conn.fd
        try:
            data = await (self._receive_stream() if fd < 0 else self._receive_fd(fd))
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__, request=self._request) from exc
        if not data:
            self._eof = True
        return data

    async def _receive_fd(self, fd: int) -> bytes:
        waited = False
        if self._drained:
            await self._timed(trio.lowlevel.wait_readable, fd)
            waited = True
        while True:
            try:
                data = _read(fd, READ_SIZE)
            except BlockingIOError:
                await self._timed(trio.lowlevel.wait_readable, fd)
                waited = True
                continue
            break
        self._drained = len(data) < READ_SIZE
        if waited:
            self._unwaited = 0
        else:
            # Data kept coming without a wait: a checkpoint now and then, so that one
            # fast stream neither starves the other tasks nor defers a cancellation.
            self._unwaited += 1
            if self._unwaited >= _UNWAITED_READS:
                self._unwaited = 0
                self._move_deadline()
                await trio.lowlevel.checkpoint()
        return data

    async def _receive_stream(self) -> bytes:
        data = await self._timed(self._conn.stream.receive_some, READ_SIZE)
        return bytes(data)

    def _move_deadline(self) -> None:
        # Before every wait and checkpoint (the only places a deadline can strike) the
        # held scope has at least a read timeout left after the last progress: now, unless
        # the body's reader marks progress itself (R-SEC-10).
        held = self._deadline
        if held is not None:
            now = trio.current_time()
            if held.progressed:
                held.progressed = held.every_read
                held.progress_at = now
            scope = held.scope
            if scope.deadline - now < self._timeout:
                deadline = held.progress_at + self._timeout * (1 + DEADLINE_SLACK)
                if deadline > scope.deadline:
                    scope.deadline = deadline

    async def _timed(self, wait: Any, arg: Any) -> Any:
        if self._deadline is not None:
            self._move_deadline()
            return await wait(arg)
        if self._timeout == math.inf:
            return await wait(arg)
        with trio.CancelScope(deadline=trio.current_time() + self._timeout) as own:
            return await wait(arg)
        assert own.cancelled_caught
        raise httpx2.ReadTimeout("timed out reading", request=self._request)

    async def read_head(self) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            while end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise self.protocol_error("response head too long")
                data = await self.receive()
                if not data:
                    raise self.protocol_error("Server disconnected without sending a response.")
                self._buffer += data
                end = self._buffer.find(b"\r\n\r\n")
            head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
            status, reason, headers = self._parse_head(head)
            if not 100 <= status < 200 or status == 101:
                return status, reason, headers

    def _parse_head(self, head: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        lines = head.split(_CRLF)
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise self.protocol_error(f"illegal status line: {lines[0][:100]!r}")
        headers: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise self.protocol_error(f"illegal header line: {line[:100]!r}")
            headers.append((name, value.strip(b" \t")))
        self.http_11 = parts[0] == b"HTTP/1.1"
        return int(parts[1]), parts[2] if len(parts) > 2 else b"", headers

    def protocol_error(self, message: str) -> httpx2.RemoteProtocolError:
        return httpx2.RemoteProtocolError(message, request=self._request)

    def take_buffer(self) -> bytes:
        data, self._buffer = self._buffer, b""
        return data

    def push_back(self, data: bytes) -> None:
        self._buffer = data + self._buffer


class RawBody(httpx2.AsyncByteStream):
    """A response body read by :class:`LeanTransport`: per network read, the body bytes it
    completed; then the connection goes back to the pool when the body ended cleanly and
    may be reused, else it is closed. Read it inside :meth:`read_deadline` to time all its
    reads with one cancel scope."""

    def __init__(
        self,
        transport: LeanTransport,
        token: object,
        reader: _Reader,
        method: str,
        status: int,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self._transport = transport
        self._token = token
        self._reader: _Reader | None = reader
        self._keep_alive = reader.http_11
        self._length: int | None = None
        self._chunked = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif lower == b"content-length" and value.isdigit():
                self._length = int(value)
            elif lower == b"connection" and b"close" in value.lower():
                self._keep_alive = False
        self._empty = method == "HEAD" or status in (204, 304)
        if not self._chunked and self._length is None and not self._empty:
            self._keep_alive = False  # the body ends with the connection

    def read_deadline(self, *, progress: bool = False) -> BodyDeadline:
        """A context manager that times every read of this body, inside it, with one cancel
        scope instead of one per read: ``with body.read_deadline(): async for chunk in
        body: …``. A stall still ends after the read timeout (at most ``DEADLINE_SLACK``
        of it later), as :class:`httpx2.ReadTimeout` raised by the ``with`` statement.

        With ``progress=True`` only the reads its reader counts as progress keep the body
        alive: ``with body.read_deadline(progress=True) as deadline:`` and
        ``deadline.progressed = True`` after each such read. A body that sends only what the
        reader ignores (keep-alives) then times out like a silent one (R-SEC-10)."""
        return BodyDeadline(self._reader, every_read=not progress)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if reader is None:
            return
        if self._empty:
            await self._finish(reuse=self._keep_alive)
            return
        if self._chunked:
            body = _ChunkedBody(reader)
            while True:
                data = await body.next_bytes()
                last = body.done
                if last:
                    # Back to the pool before the last bytes are handed on: a reader
                    # that stops at its own end of message leaves a reusable connection.
                    await self._finish(reuse=self._keep_alive)
                if data:
                    yield data
                if last:
                    break
        elif self._length is not None:
            remaining = self._length
            data = reader.take_buffer()
            while True:
                if data:
                    data = data[:remaining]
                    remaining -= len(data)
                    if remaining == 0:
                        await self._finish(reuse=self._keep_alive)
                    yield data
                if remaining == 0:
                    break
                data = await reader.receive()
                if not data:
                    raise reader.protocol_error(
                        "peer closed connection without sending complete message body "
                        f"(received {self._length - remaining} bytes, expected {self._length})"
                    )
            await self._finish(reuse=self._keep_alive)
        else:
            data = reader.take_buffer()
            while True:
                if data:
                    yield data
                data = await reader.receive()
                if not data:
                    break
            await self._finish(reuse=False)

    async def _finish(self, *, reuse: bool) -> None:
        reader, self._reader = self._reader, None
        if reader is None:
            return
        if reuse:
            self._transport.release(self._token, reader.conn)
        else:
            await _close(reader.conn)
            self._transport.release(self._token, None)

    async def aclose(self) -> None:
        """Give the exchange up: a body not read to its end (or that failed) leaves the
        connection in an unknown state, so it is closed, not reused."""
        await self._finish(reuse=False)


class BodyDeadline:
    """See :meth:`RawBody.read_deadline`. The scope's deadline is moved on only when a wait
    begins with less than a read timeout left, to a timeout and ``DEADLINE_SLACK`` after the
    last progress: a read costs no cancel scope of its own, and marking progress costs one
    attribute store (the next wait or checkpoint notes the time).

    ``progressed``: set it after a read that made progress (with ``progress=True``; every
    read counts otherwise). ``progress_at``: when progress was last noted."""

    __slots__ = ("_reader", "every_read", "progress_at", "progressed", "scope")

    def __init__(self, reader: _Reader | None, *, every_read: bool = True) -> None:
        self._reader = reader
        self.every_read = every_read
        self.progressed = every_read
        self.progress_at = 0.0
        self.scope = trio.CancelScope()

    def __enter__(self) -> BodyDeadline:
        reader = self._reader
        if reader is None or reader.timeout == math.inf:
            self._reader = None
            return self
        self.progress_at = now = trio.current_time()
        scope = self.scope
        scope.deadline = now + reader.timeout * (1 + DEADLINE_SLACK)
        scope.__enter__()
        reader.hold_deadline(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        reader, self._reader = self._reader, None
        if reader is None:
            return False
        reader.hold_deadline(None)
        scope = self.scope
        handled = scope.__exit__(kind, exc, traceback)
        if scope.cancelled_caught:
            raise httpx2.ReadTimeout("timed out reading", request=reader.request) from None
        return handled


class _ChunkedBody:
    """``transfer-encoding: chunked`` decoding over a :class:`_Reader`: each call returns
    the payload bytes of the next network read that held some (``done`` once the last
    chunk and its trailers have arrived; bytes after them are left to the reader)."""

    __slots__ = ("_buffer", "_reader", "_remaining", "done")

    def __init__(self, reader: _Reader) -> None:
        self._reader = reader
        self._buffer = reader.take_buffer()
        self._remaining = 0  # payload bytes of the current chunk still to come
        self.done = False

    async def next_bytes(self) -> bytes:
        while True:
            if self._buffer:
                data = self._decode()
                if data or self.done:
                    return data
            more = await self._reader.receive()
            if not more:
                raise self._reader.protocol_error(
                    "peer closed connection without sending complete message body "
                    "(incomplete chunked read)"
                )
            self._buffer += more

    def _decode(self) -> bytes:
        buffer = self._buffer
        pieces: list[bytes] = []
        pos = 0
        size = len(buffer)
        while pos < size:
            if self._remaining:
                take = min(self._remaining, size - pos)
                pieces.append(buffer[pos : pos + take])
                pos += take
                self._remaining -= take
                continue
            line_end = buffer.find(_CRLF, pos)
            if line_end < 0:
                break
            line = buffer[pos:line_end]
            if not line:  # the CRLF that ends a chunk's payload
                pos = line_end + 2
                continue
            size_text = line.split(b";", 1)[0].strip()
            if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                raise self._reader.protocol_error(f"illegal chunk size: {line[:100]!r}")
            chunk_size = int(size_text, 16)
            if chunk_size == 0:
                # The last chunk, then trailers (ignored) up to a blank line.
                end = buffer.find(b"\r\n\r\n", line_end)
                if end < 0:
                    break
                self.done = True
                self._buffer = b""
                self._reader.push_back(buffer[end + 4 :])
                return b"".join(pieces)
            self._remaining = chunk_size
            pos = line_end + 2
        self._buffer = buffer[pos:]
        return b"".join(pieces)


__all__ = [
    "DEADLINE_SLACK",
    "KEEPALIVE_EXPIRY_S",
    "RAW_BODY",
    "BodyDeadline",
    "LeanTransport",
    "RawBody",
    "raw_body",
]
