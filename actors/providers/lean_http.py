"""greenroom's own HTTP/1.1 client for model streams: a connection pool on trio that hands a
streamed body on once per network read.

A model's server sends one HTTP chunk per event. A general HTTP stack (httpx → httpcore →
h11) hands a streamed body on one chunk at a time, so every event climbs its whole event
machine, exception mapping, timeout scope and iterators before a decoder sees it; this
client hands on, per read, every body byte that read completed — all its events at once —
and imports nothing beyond trio and the standard library, so a provider that uses it loads
no HTTP library at all.

Scope: HTTP/1.1 over trio TCP streams (TLS with :func:`default_ssl_context` or a given
context; a connection's responses are read with ``os.read`` on its descriptor, TLS through
memory BIOs so that one read hands on every record that arrived, and a streamed body's
reads share one cancel scope, see :meth:`RawBody.read_deadline`; many bodies at once read
on one shared tick, see :data:`READS_PER_SECOND`),
keep-alive connections reused per origin (an idle connection is dropped after
:data:`KEEPALIVE_EXPIRY_S` or when the server has closed it), bodies framed by
``transfer-encoding: chunked``, ``content-length`` or the connection's end, ``gzip`` and
``deflate`` bodies decoded (another content coding is refused, naming it). Heads are read
as h11 reads them: CRLF or bare LF line breaks, obsolete folded header lines unfolded.
No proxies, no HTTP/2, and no redirects here (:mod:`~greenroom.actors.providers.lean_wire`
follows 307 and 308): the providers fall back to their SDK or httpx when a proxy applies.

Failures, each with the wording of httpcore's equivalent, so that
:func:`~greenroom.actors.providers.base.transport_failure` (which reads class names) words
them as it words httpx's::

    TransportError
    ├── TimeoutException
    │   ├── ConnectTimeout    the connection was not open within the connect timeout
    │   ├── ReadTimeout       the server was silent for the read timeout
    │   ├── WriteTimeout      the request was not sent within the write timeout
    │   └── PoolTimeout       no connection slot was free within the pool timeout
    ├── NetworkError
    │   ├── ConnectError      the connection could not be opened (the OS error is the cause)
    │   ├── ReadError         the connection failed while reading
    │   └── WriteError        the connection failed while sending
    ├── ProtocolError
    │   └── RemoteProtocolError  the server's bytes are not HTTP/1.1 (or were cut short)
    └── UnsupportedProtocol   a URL that is not http or https
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import select
import ssl
import sys
import time
import urllib.parse
import zlib
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

import attrs
import trio

KEEPALIVE_EXPIRY_S = 5.0
"""An idle connection older than this is closed instead of reused (httpcore's default)."""

READ_SIZE = 65536
MAX_HEAD_BYTES = 65536
MAX_INFLATED = 1 << 20
"""The most bytes of a compressed body one piece hands on: a read of a few kilobytes can
inflate a thousandfold, and the decoder's lines of a piece would all be held at once."""
_CRLF = b"\r\n"
_URL_SAFE = "/%:@!$&'()*+,;=?~[]"
# A plain TCP connection is read with os.read on its descriptor, waiting for readiness
# only after a read that drained the socket: a streamed event then costs one system call
# and no trio socket wrapper (Windows cannot read a socket with os.read).
_DIRECT_READS = sys.platform != "win32"
_read = os.read
_write = os.write
# Reads in a row that found data without waiting before the reader yields anyway.
_UNWAITED_READS = 16
# A body's read deadline is moved on only once this fraction of the timeout is used up:
# a stall still ends after between 1 and 1 + DEADLINE_SLACK read timeouts of silence.
DEADLINE_SLACK = 0.25
READS_PER_SECOND = 10_000
"""The process's budget of body reads a second once many bodies stream at once: each
body then waits ``streams / READS_PER_SECOND`` after a read that emptied its socket
before it reads again, so that one read carries several events instead of one."""
PACED_FROM_STREAMS = 64
"""Below this many bodies streaming in the process every read is made as its data comes."""
MAX_READ_PAUSE = 0.25
"""The longest a body waits for its next read, however many stream (past about 2,500 the
budget is exceeded rather than a token held longer)."""


class _StreamCount:
    """How many response bodies the process is reading now (one core serves them all)."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = 0

    def pause(self) -> float:
        # A read with its events costs tens of microseconds (the wakes of the streamer,
        # the supervisor and the run's reader), most of it per read, not per event. With
        # a thousand bodies at 50 tokens a second that is more than one core can do: it
        # saturates, every token waits its turn in the run queue anyway, and the CPU goes
        # on reads of two or three events. Spacing each body's reads keeps the total under
        # the budget, so the core keeps up, at the price of a token held at most one pause
        # (0.1 s with a thousand bodies).
        streams = self.open
        if streams < PACED_FROM_STREAMS:
            return 0.0
        return min(streams / READS_PER_SECOND, MAX_READ_PAUSE)


_streams = _StreamCount()


class _ReadTicks:
    """One timer for every paced body of a trio run: the bodies that wait for their next
    read park here and one system task wakes them all every pause. A sleep per body
    would cost each read a cancel scope, a deadline and a raised ``Cancelled``."""

    __slots__ = ("_lot", "_ticking")

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()
        self._ticking = False

    async def wait(self) -> bool:
        """Park until the next tick; False at once when the run is ending and no tick
        can be started any more (the caller then waits for its socket instead)."""
        if not self._ticking:
            try:
                trio.lowlevel.spawn_system_task(self._tick, name="greenroom read ticks")
            except RuntimeError:
                return False
            self._ticking = True
        await self._lot.park()
        return True

    async def _tick(self) -> None:
        try:
            while self._lot:
                await trio.sleep(_streams.pause() or 1 / READS_PER_SECOND)
                self._lot.unpark_all()
        finally:
            self._ticking = False


_read_ticks: trio.lowlevel.RunVar[_ReadTicks] = trio.lowlevel.RunVar("greenroom_read_ticks")


def _ticks() -> _ReadTicks:
    try:
        return _read_ticks.get()
    except LookupError:
        ticks = _ReadTicks()
        _read_ticks.set(ticks)
        return ticks


# Where Linux distributions keep their CA bundle, for a Python whose OpenSSL was built
# with paths that do not exist on this system.
_CA_BUNDLES = (
    "/etc/ssl/cert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/pki/tls/cert.pem",
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/ssl/ca-bundle.pem",
)


# -- failures ---------------------------------------------------------------------------


class TransportError(Exception):
    """A request that failed below HTTP: see the module docstring for the tree. ``url``:
    the URL of the request that failed, when :meth:`ConnectionPool.request` raised it."""

    url: str | None = None


class TimeoutException(TransportError):
    """A phase of the exchange ran out of time."""


class ConnectTimeout(TimeoutException):
    """The connection was not open within the connect timeout."""


class ReadTimeout(TimeoutException):
    """The server sent nothing for the read timeout (or, for a body read within
    :meth:`RawBody.read_deadline`, made no progress for it)."""


class WriteTimeout(TimeoutException):
    """The request was not sent within the write timeout."""


class PoolTimeout(TimeoutException):
    """Every connection slot stayed taken for the pool timeout."""


class NetworkError(TransportError):
    """The connection failed."""


class ConnectError(NetworkError):
    """The connection could not be opened; the operating system's error is the cause."""


class ReadError(NetworkError):
    """The connection failed while the response was read."""


class WriteError(NetworkError):
    """The connection failed while the request was sent."""


class ProtocolError(TransportError):
    """The exchange broke HTTP/1.1's rules."""


class RemoteProtocolError(ProtocolError):
    """The server's bytes are not a valid HTTP/1.1 response, or stopped before its end."""


class UnsupportedProtocol(TransportError):
    """A URL whose scheme is neither http nor https, or that names no host."""


# -- settings ---------------------------------------------------------------------------


class TimeoutSettings(Protocol):
    """The four timeouts of a request in seconds, None for none: :class:`Timeouts`, and
    also httpx's and httpx2's ``Timeout`` (the same four attributes)."""

    @property
    def connect(self) -> float | None:
        """Opening a connection (TCP and TLS)."""

    @property
    def read(self) -> float | None:
        """The longest silence while a response is read; for a model stream, the longest
        time without progress (R-SEC-10)."""

    @property
    def write(self) -> float | None:
        """Sending the request."""

    @property
    def pool(self) -> float | None:
        """Waiting for a connection slot."""


@attrs.frozen(kw_only=True)
class Timeouts:
    """The four timeouts of a request (see :class:`TimeoutSettings`), seconds or None."""

    connect: float | None = 15.0
    read: float | None = 180.0
    write: float | None = 60.0
    pool: float | None = 60.0


@attrs.frozen
class URL:
    """An ``http`` or ``https`` URL, taken apart once for every request sent to it.
    ``text`` is the URL as given (for messages), ``target`` the request target (path and
    query), ``authority`` the ``Host`` header's value."""

    text: str
    scheme: str
    host: str
    port: int
    target: bytes
    authority: bytes


def parse_url(text: str) -> URL:
    """``text`` taken apart; :class:`UnsupportedProtocol` when it is not an http or https
    URL with a host."""
    try:
        parts = urllib.parse.urlsplit(text)
        scheme = parts.scheme.lower()
        host = parts.hostname
        explicit = parts.port
    except ValueError as exc:
        raise UnsupportedProtocol(f"cannot use URL {text!r}: {exc}") from None
    if scheme not in ("http", "https"):
        raise UnsupportedProtocol(f"Request URL has an unsupported protocol '{scheme}://'.")
    if not host:
        raise UnsupportedProtocol(f"Request URL {text!r} has no host.")
    default = 443 if scheme == "https" else 80
    port = explicit or default
    try:
        name = host.encode("ascii")
    except UnicodeEncodeError:
        try:
            name = host.encode("idna")
        except UnicodeError:
            raise UnsupportedProtocol(f"Request URL {text!r} has an invalid host.") from None
    if ":" in host:
        name = b"[" + name + b"]"
    authority = name if port == default else name + b":" + str(port).encode()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # Percent-encoded as a URL's path and query are sent: no space, line break or other
    # byte outside URL syntax reaches the request line.
    target = urllib.parse.quote(target, safe=_URL_SAFE)
    return URL(text, scheme, host, port, target.encode("ascii"), authority)


def default_ssl_context() -> ssl.SSLContext:
    """The system's certificate store, as the anthropic SDK's client uses it:
    ``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` when set; the operating system's store through
    ``truststore`` on macOS and Windows; OpenSSL's own paths on Linux, else the bundle
    file the distribution keeps. Offers HTTP/1.1 alone by ALPN."""
    context: ssl.SSLContext | None = None
    if cafile := os.environ.get("SSL_CERT_FILE"):
        context = ssl.create_default_context(cafile=cafile)
    elif capath := os.environ.get("SSL_CERT_DIR"):
        context = ssl.create_default_context(capath=capath)
    elif sys.platform in ("darwin", "win32"):
        try:
            import truststore
        except ImportError:
            context = ssl.create_default_context()
        else:
            context = truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        paths = ssl.get_default_verify_paths()
        cafile = paths.openssl_cafile if os.path.isfile(paths.openssl_cafile) else None
        capath = paths.openssl_capath if os.path.isdir(paths.openssl_capath) else None
        if cafile is None and capath is None:
            cafile = next((path for path in _CA_BUNDLES if os.path.isfile(path)), None)
        if cafile is not None or capath is not None:
            context.load_verify_locations(cafile, capath)
    context.set_alpn_protocols(["http/1.1"])
    return context


def environment_proxy(url: URL) -> str | None:
    """The proxy the environment names for ``url``, read as httpx and the anthropic SDK
    read it (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY`` in either case, the lower-case
    one first; the system's settings too on macOS and Windows), or None when none applies
    or ``NO_PROXY`` excludes the host. This client sends nothing through a proxy: its
    users fall back to their library when this says one applies. ``NO_PROXY`` entries it
    cannot match exactly (a port, an address range, a URL) exclude nothing here, so such a
    host counts as proxied and keeps the library's own handling."""
    settings = _proxy_settings()
    proxy = settings.get(url.scheme) or settings.get("all")
    if not proxy or _excluded(url.host.lower(), settings.get("no", "")):
        return None
    return proxy


def _proxy_settings() -> dict[str, str]:
    if sys.platform in ("darwin", "win32"):
        import urllib.request  # the system's proxy settings as well as the environment's

        return urllib.request.getproxies()
    found: dict[str, str] = {}
    for name, value in os.environ.items():
        if value and name[-6:].lower() == "_proxy":
            found[name[:-6].lower()] = value
    if "REQUEST_METHOD" in os.environ:
        # Under CGI, HTTP_PROXY may come from a request's Proxy header: not trusted.
        found.pop("http", None)
    for name, value in os.environ.items():
        if name[-6:] == "_proxy":
            if value:
                found[name[:-6].lower()] = value
            else:
                found.pop(name[:-6].lower(), None)
    return found


def _excluded(host: str, no_proxy: str) -> bool:
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if entry == "*":
            return True
        if entry.startswith("[") and entry.endswith("]"):
            entry = entry[1:-1]
        if not entry or "/" in entry:
            continue
        if entry.startswith("."):
            if host.endswith(entry):
                return True
        elif host == entry or (":" not in entry and host.endswith("." + entry)):
            return True
    return False


# -- the pool ---------------------------------------------------------------------------


class _Tls:
    """TLS on a plain connection whose descriptor is read directly: the records go
    through memory BIOs. One read of the socket takes every record that has arrived and
    hands on their plaintext joined, where a TLS stream hands on one record (one
    streamed event) a read; and a TLS body is paced like a plain one (the read tick).
    Like trio's ``https_compatible`` streams it accepts an end without ``close_notify``
    and sends none (HTTP frames its own bodies)."""

    __slots__ = ("_incoming", "_object", "_outgoing", "closed")

    def __init__(self, context: ssl.SSLContext, host: str) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._object = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)
        self.closed = False

    async def handshake(self, tcp: trio.SocketStream) -> None:
        """Negotiate on ``tcp``; a refusal is the ``ssl.SSLError`` (an OSError) that says
        why, an end of the connection a :class:`ConnectError`."""
        while True:
            try:
                self._object.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush(tcp)
                data = await tcp.receive_some(READ_SIZE)
                if not data:
                    raise ConnectError(
                        "the server closed the connection during the TLS handshake"
                    ) from None
                self._incoming.write(data)
                continue
            await self._flush(tcp)
            return

    async def _flush(self, tcp: trio.SocketStream) -> None:
        data = self._outgoing.read()
        if data:
            await tcp.send_all(data)

    def encrypt(self, data: bytes) -> bytes:
        """``data`` as the records to send."""
        self._object.write(data)
        return self._outgoing.read()

    def decrypt(self, raw: bytes) -> bytes:
        """The plaintext of every whole record in what was received so far plus ``raw``
        (b"" for the end of the connection, after which :attr:`closed` is set). An
        ``ssl.SSLError`` (an OSError) for a record that does not decrypt."""
        if raw:
            self._incoming.write(raw)
        else:
            self._incoming.write_eof()
        pieces: list[bytes] = []
        read = self._object.read
        while True:
            try:
                piece = read(READ_SIZE)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                self.closed = True
                break
            if not piece:
                self.closed = True
                break
            pieces.append(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def pending_output(self) -> bytes:
        """What TLS itself has to send after a read (a key update's answer), if anything."""
        return self._outgoing.read() if self._outgoing.pending else b""


class _Connection:
    __slots__ = ("fd", "idle_since", "key", "socket", "stream", "tls")

    def __init__(
        self,
        key: tuple[str, str, int],
        stream: trio.abc.Stream,
        sock: Any,
        *,
        direct: bool,
        tls: _Tls | None = None,
    ) -> None:
        self.key = key
        self.stream = stream
        self.socket = sock
        # The descriptor to read directly, or -1 to read through ``stream`` (trio's TLS,
        # where reads cannot be direct).
        self.fd: int = sock.fileno() if direct else -1
        self.tls = tls
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


class ConnectionPool:
    """HTTP/1.1 requests on trio with keep-alive connections per origin.

    ``max_connections`` bounds the exchanges in flight at once (a request beyond it waits
    up to the pool timeout); ``ssl_context`` is used for ``https`` URLs (default:
    :func:`default_ssl_context`, made on the first https connection, in a worker thread).
    One pool serves any number of tasks; :meth:`aclose` closes its idle connections."""

    def __init__(
        self, *, ssl_context: ssl.SSLContext | None = None, max_connections: int = 1000
    ) -> None:
        self._ssl = ssl_context
        self._ssl_lock: trio.Lock | None = None
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._limiter = trio.CapacityLimiter(max(1, max_connections))
        self._closed = False

    async def request(
        self,
        method: bytes,
        url: URL,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        timeouts: TimeoutSettings,
    ) -> Response:
        """Send one request on a kept-alive or new connection and return once the response
        head is read; its body streams one network read at a time (:class:`RawBody`).
        ``headers`` are sent as given after ``Host``, then ``Content-Length``. Raises the
        module's :class:`TransportError` kinds. The caller closes the response
        (:meth:`Response.aclose`) unless it read the body to its end."""
        key = (url.scheme, url.host, url.port)
        head = _request_head(method, url, headers, body)
        limiter = self._limiter
        # The response may be closed by another task than this one: the slot is held on
        # behalf of the exchange, not of the task.
        token = object()
        try:
            limiter.acquire_on_behalf_of_nowait(token)  # the usual case: a slot is free
        except trio.WouldBlock:
            with trio.move_on_after(_seconds(timeouts.pool)) as waited:
                await limiter.acquire_on_behalf_of(token)
            if waited.cancelled_caught:
                failure = PoolTimeout()
                failure.url = url.text
                raise failure from None
        read_timeout = _seconds(timeouts.read)
        try:
            reused = self._take_idle(key)
            conn = reused or await self._connect(key, timeouts)
            try:
                reader, status, reason, response_headers = await _exchange(
                    conn, head, body, timeouts, read_timeout
                )
            except (RemoteProtocolError, ReadError, WriteError):
                if reused is None:
                    raise
                # A kept-alive connection the server had closed: once more, on a new one.
                conn = await self._connect(key, timeouts)
                reader, status, reason, response_headers = await _exchange(
                    conn, head, body, timeouts, read_timeout
                )
        except BaseException as exc:
            limiter.release_on_behalf_of(token)
            if isinstance(exc, TransportError):
                exc.url = url.text
            raise
        stream = RawBody(self, token, reader, method, status, response_headers)
        return Response(status, reason, response_headers, stream)

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < KEEPALIVE_EXPIRY_S and not conn.is_readable():
                return conn
            _close_now(conn)
        return None

    async def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            if self._ssl_lock is None:
                self._ssl_lock = trio.Lock()
            async with self._ssl_lock:
                if self._ssl is None:
                    # Reading the certificate store takes a few ms: not on the event loop.
                    self._ssl = await trio.to_thread.run_sync(default_ssl_context)
        return self._ssl

    async def _connect(self, key: tuple[str, str, int], timeouts: TimeoutSettings) -> _Connection:
        scheme, host, port = key
        try:
            with trio.fail_after(_seconds(timeouts.connect)):
                context = await self._context() if scheme == "https" else None
                tcp = await trio.open_tcp_stream(host, port)
                stream: trio.abc.Stream = tcp
                direct_tls: _Tls | None = None
                if context is not None:
                    try:
                        if _DIRECT_READS:
                            direct_tls = _Tls(context, host)
                            await direct_tls.handshake(tcp)
                        else:
                            tls = trio.SSLStream(
                                tcp, context, server_hostname=host, https_compatible=True
                            )
                            await tls.do_handshake()
                            stream = tls
                    except BaseException:
                        with trio.CancelScope(shield=True):
                            await trio.aclose_forcefully(tcp)
                        raise
        except trio.TooSlowError:
            raise ConnectTimeout() from None
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            # A failed TLS handshake is a BrokenResourceError whose cause says why.
            reason = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else None
            raise ConnectError(str(reason or exc) or type(exc).__name__) from exc
        return _Connection(
            key, stream, tcp.socket, direct=_DIRECT_READS and stream is tcp, tls=direct_tls
        )

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


class Response:
    """A response whose head has been read: ``status``, ``reason``, ``headers`` (as
    received) and ``body``, the :class:`RawBody` to iterate."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(
        self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], body: RawBody
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        """The first header named ``name`` (lower case), None when there is none."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def header_map(self) -> dict[str, str]:
        """The headers by lower-cased name, repeated ones joined with ``", "`` (as httpx's
        ``dict(response.headers)`` gives them)."""
        merged: dict[str, str] = {}
        for name, value in self.headers:
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            merged[key] = f"{merged[key]}, {text}" if key in merged else text
        return merged

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body (decoded when compressed); with ``limit``, at most that many
        bytes: a longer body is cut there and the connection closed, not reused."""
        pieces: list[bytes] = []
        size = 0
        reads = aiter(self.body)
        try:
            async for piece in reads:
                pieces.append(piece)
                size += len(piece)
                if limit is not None and size >= limit:
                    await self.body.aclose()
                    return b"".join(pieces)[:limit]
        finally:
            await reads.aclose()
        return b"".join(pieces)

    async def aclose(self) -> None:
        """Give the exchange up (see :meth:`RawBody.aclose`); nothing after its end."""
        await self.body.aclose()


def _seconds(value: float | None) -> float:
    return math.inf if value is None else float(value)


def _request_head(
    method: bytes, url: URL, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> bytes:
    lines = [method + b" " + url.target + b" HTTP/1.1", b"Host: " + url.authority]
    lines.extend(name + b": " + value for name, value in headers)
    lines.append(b"Content-Length: " + str(len(body)).encode("ascii"))
    return _CRLF.join(lines) + _CRLF + _CRLF


async def _exchange(
    conn: _Connection, head: bytes, body: bytes, timeouts: TimeoutSettings, read_timeout: float
) -> tuple[_Reader, int, bytes, list[tuple[bytes, bytes]]]:
    """Send the request on ``conn`` and read the response head; ``conn`` is closed when
    that fails or is cancelled (its state is unknown then)."""
    try:
        await _send(conn, head, body, timeouts)
        reader = _Reader(conn, read_timeout)
        status, reason, headers = await reader.read_head()
    except BaseException:
        await _close(conn)
        raise
    return reader, status, reason, headers


async def _send(conn: _Connection, head: bytes, body: bytes, timeouts: TimeoutSettings) -> None:
    try:
        if conn.tls is not None:
            head, body = conn.tls.encrypt(head + body), b""
        if len(body) < 65536:
            data = head + body
            if conn.fd >= 0:
                # A plain TCP connection takes a request this size at once, in the usual
                # case: written straight to its descriptor, with no timeout scope and no
                # task step; what the socket does not take goes the stream's way.
                try:
                    written = _write(conn.fd, data)
                except BlockingIOError:
                    written = 0
                data = data[written:]
                if not data:
                    return
            with trio.fail_after(_seconds(timeouts.write)):
                await conn.stream.send_all(data)
        else:
            with trio.fail_after(_seconds(timeouts.write)):
                await conn.stream.send_all(head)
                await conn.stream.send_all(body)
    except trio.TooSlowError:
        raise WriteTimeout() from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise WriteError(str(exc) or type(exc).__name__) from exc


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

    __slots__ = ("_buffer", "_conn", "_deadline", "_drained", "_timeout", "_unwaited", "http_11")

    def __init__(self, conn: _Connection, timeout: float) -> None:
        self._conn = conn
        self._timeout = timeout
        self._deadline: BodyDeadline | None = None
        self._buffer = b""
        self._drained = False  # the last read emptied the socket: wait before the next
        self._unwaited = 0
        self.http_11 = True

    @property
    def conn(self) -> _Connection:
        return self._conn

    @property
    def timeout(self) -> float:
        return self._timeout

    def hold_deadline(self, deadline: BodyDeadline | None) -> None:
        """Time the reads with ``deadline``'s scope (None: a scope per wait again)."""
        self._deadline = deadline

    async def receive(self) -> bytes:
        """One network read (b"" at the end of the connection)."""
        conn = self._conn
        fd = conn.fd
        if conn.tls is not None and conn.tls.closed:
            return b""  # the server ended TLS; what follows on the socket is not ours
        try:
            return await (self._receive_stream() if fd < 0 else self._receive_fd(fd))
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ReadError(str(exc) or type(exc).__name__) from exc

    async def _receive_fd(self, fd: int) -> bytes:
        waited = False
        if self._drained:
            # Past PACED_FROM_STREAMS what came until the tick is read at once, and a
            # wait for the socket follows only if nothing did.
            if _streams.open < PACED_FROM_STREAMS or not await self._next_tick():
                await self._timed(trio.lowlevel.wait_readable, fd)
            waited = True
        tls = self._conn.tls
        while True:
            try:
                raw = _read(fd, READ_SIZE)
            except BlockingIOError:
                await self._timed(trio.lowlevel.wait_readable, fd)
                waited = True
                continue
            if tls is None:
                data = raw
            else:
                data = tls.decrypt(raw)
                answer = tls.pending_output()
                if answer:
                    await self._conn.stream.send_all(answer)
                if not data and raw:
                    continue  # part of a record, or only TLS's own messages
            break
        self._drained = len(raw) < READ_SIZE
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

    async def _next_tick(self) -> bool:
        self._move_deadline()  # the tick's wait is a point where the deadline can strike
        return await _ticks().wait()

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
        raise ReadTimeout()

    async def read_head(self) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        # The whole head within the read timeout: a head trickled a byte at a time, or
        # informational responses (100 Continue) one after another, are no answer and,
        # like keep-alives, never hold a request longer (R-SEC-10).
        with trio.CancelScope(deadline=trio.current_time() + self._timeout) as scope:
            return await self._read_head()
        assert scope.cancelled_caught
        raise ReadTimeout()

    async def _read_head(self) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        while True:
            # A blank line ends the head, its line breaks CRLF or a bare LF: h11 (the
            # library paths' parser) reads both, and a server behind a lax proxy works
            # on both paths alike (R-SEC-1).
            end = _BLANK_LINE.search(self._buffer)
            while end is None:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise RemoteProtocolError("response head too long")
                data = await self.receive()
                if not data:
                    raise RemoteProtocolError("Server disconnected without sending a response.")
                self._buffer += data
                end = _BLANK_LINE.search(self._buffer)
            head, self._buffer = self._buffer[: end.start()], self._buffer[end.end() :]
            status, reason, headers = self._parse_head(head)
            if status == 101:
                # No request of this client asks to switch protocols: what follows is not
                # HTTP, and is not a model's answer (h11 refuses it alike).
                raise RemoteProtocolError("the server switched protocols (101) unasked")
            if not 100 <= status < 200:
                return status, reason, headers

    def _parse_head(self, head: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        lines = _head_lines(head)
        parts = lines[0].split(b" ", 2)
        # A status is three digits from 100 (as h11, the library paths' parser, reads it).
        if (
            len(parts) < 2
            or not parts[0].startswith(b"HTTP/1.")
            or len(parts[1]) != 3
            or not parts[1].isdigit()
            or parts[1] < b"100"
            or b"\r" in lines[0]
        ):
            raise RemoteProtocolError(f"illegal status line: {lines[0][:100]!r}")
        headers: list[tuple[bytes, bytes]] = []
        length: bytes | None = None
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            # A CR or NUL left inside a line is refused, as h11 refuses it: a line break
            # that one reader sees and another does not splits a response in two.
            if not colon or not name or name != name.strip() or b"\r" in line or b"\0" in line:
                raise RemoteProtocolError(f"illegal header line: {line[:100]!r}")
            value = value.strip(b" \t")
            lower = name.lower()
            if lower == b"content-length":
                length = _content_length(value, length)
            elif lower == b"transfer-encoding" and value.lower() != b"chunked":
                # Another coding would leave the body's end unknown or its bytes encoded:
                # refused as h11 refuses it, so both paths fail such a response alike.
                raise RemoteProtocolError("Only Transfer-Encoding: chunked is supported")
            headers.append((name, value))
        self.http_11 = parts[0] == b"HTTP/1.1"
        return int(parts[1]), parts[2] if len(parts) > 2 else b"", headers

    def take_buffer(self) -> bytes:
        data, self._buffer = self._buffer, b""
        return data

    def push_back(self, data: bytes) -> None:
        self._buffer = data + self._buffer


_BLANK_LINE = re.compile(rb"\n\r?\n")
"""The blank line that ends a head (or a body's trailers): CRLF or bare LF line breaks."""
_HEX_DIGITS = b"0123456789abcdefABCDEF"


def _chunk_size(line: bytes) -> int | None:
    """The size a chunk's size line (without its CRLF) gives, as h11 reads one: 1 to 20
    hex digits, then extensions (``;…``, ignored) or optional blanks; None for anything
    else. (A regular expression costs half again as much, once a chunk.)"""
    digits, extension, _ = line.partition(b";")
    if not extension:
        digits = digits.rstrip(b" \t")
    if not 0 < len(digits) <= 20 or digits.strip(_HEX_DIGITS):
        return None
    return int(digits, 16)


def _head_lines(head: bytes) -> list[bytes]:
    """The status line and header lines of ``head`` (without its blank line), as h11
    reads them: lines end with CRLF or a bare LF, and an obsolete folded line (one that
    begins with a space or a tab) continues the header line before it, joined with one
    space; a :class:`RemoteProtocolError` when the first header line is one."""
    lines = [line[:-1] if line[-1:] == b"\r" else line for line in head.split(b"\n")]
    unfolded = lines[:1]
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            if len(unfolded) == 1:
                raise RemoteProtocolError("continuation line at start of headers")
            unfolded[-1] += b" " + line.lstrip(b" \t")
        else:
            unfolded.append(line)
    return unfolded


def _trailers_end(buffer: bytes, start: int) -> int:
    """Where the trailers that begin at ``start`` of ``buffer`` (after the last chunk's
    size line) end, past their blank line; -1 while they have not all arrived. Read as
    h11 reads them: no trailers, or lines ending with CRLF or a bare LF."""
    if buffer.startswith(b"\n", start):
        return start + 1
    if buffer.startswith(_CRLF, start):
        return start + 2
    end = _BLANK_LINE.search(buffer, start)
    return -1 if end is None else end.end()


def _content_length(value: bytes, seen: bytes | None) -> bytes:
    """The length a ``content-length`` header's ``value`` gives (one number, or a list of
    one number repeated), the same as the length ``seen`` before, if any; else a
    :class:`RemoteProtocolError`: a body of two lengths has no known end (h11 refuses it
    alike)."""
    lengths = {one.strip() for one in value.split(b",")}
    if len(lengths) != 1:
        raise RemoteProtocolError("conflicting Content-Length headers")
    length = lengths.pop()
    if not length.isdigit():
        raise RemoteProtocolError(f"bad Content-Length: {value[:100]!r}")
    if seen is not None and seen != length:
        raise RemoteProtocolError("conflicting Content-Length headers")
    return length


class RawBody:
    """A response body: iterated, per network read, the body bytes it completed (decoded
    when the body is ``gzip`` or ``deflate``); then the connection goes back to the pool
    when the body ended cleanly and may be reused, else it is closed. Read it inside
    :meth:`read_deadline` to time all its reads with one cancel scope."""

    def __init__(
        self,
        pool: ConnectionPool,
        token: object,
        reader: _Reader,
        method: bytes,
        status: int,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self._pool = pool
        self._token = token
        self._reader: _Reader | None = reader
        self._keep_alive = reader.http_11
        self._length: int | None = None
        self._chunked = False
        codings: list[bytes] = []
        for name, value in headers:
            lower = name.lower()
            if lower == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif lower == b"content-length":
                # Checked when the head was read: one number, maybe repeated in a list.
                self._length = int(value.split(b",", 1)[0])
            elif lower == b"connection" and b"close" in value.lower():
                self._keep_alive = False
            elif lower == b"content-encoding":
                codings.extend(coding.strip().lower() for coding in value.split(b","))
        # Every coding named, in order, as the library paths read them (``body_encoding``).
        self._encoding = b", ".join(c for c in codings if c and c != b"identity")
        self._empty = method == b"HEAD" or status in (204, 304)
        if not self._chunked and self._length is None and not self._empty:
            self._keep_alive = False  # the body ends with the connection

    def read_deadline(self, *, progress: bool = False) -> BodyDeadline:
        """A context manager that times every read of this body, inside it, with one cancel
        scope instead of one per read: ``with body.read_deadline(): async for chunk in
        body: …``. A stall still ends after the read timeout (at most ``DEADLINE_SLACK``
        of it later), as :class:`ReadTimeout` raised by the ``with`` statement.

        With ``progress=True`` only the reads its reader counts as progress keep the body
        alive: ``with body.read_deadline(progress=True) as deadline:`` and
        ``deadline.progressed = True`` after each such read. A body that sends only what the
        reader ignores (keep-alives) then times out like a silent one (R-SEC-10)."""
        return BodyDeadline(self._reader, every_read=not progress)

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        if not self._encoding:
            return self._pieces()
        return self._decoded(self._encoding.decode("latin-1"))

    async def _decoded(self, encoding: str) -> AsyncGenerator[bytes, None]:
        # Sent only when a server ignores ``accept-encoding: identity``. An encoding zlib
        # cannot read (``br``, ``zstd``, several stacked) fails the body before a byte of
        # it is read, naming it, as on the library paths: handed on as it is, the
        # decoder found it malformed and said nothing of why (R-SEC-1).
        if encoding not in READABLE_ENCODINGS:
            raise RemoteProtocolError(unreadable_encoding(encoding))
        pieces = inflated(self._pieces(), encoding, RemoteProtocolError)
        async with contextlib.aclosing(pieces):
            async for data in pieces:
                yield data

    async def _pieces(self) -> AsyncGenerator[bytes, None]:
        reader = self._reader
        if reader is None:
            return
        _streams.open += 1
        try:
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
                        raise RemoteProtocolError(
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
        finally:
            _streams.open -= 1

    async def _finish(self, *, reuse: bool) -> None:
        reader, self._reader = self._reader, None
        if reader is None:
            return
        if reuse:
            self._pool.release(self._token, reader.conn)
        else:
            await _close(reader.conn)
            self._pool.release(self._token, None)

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
            raise ReadTimeout() from None
        return handled


class _ChunkedBody:
    """``transfer-encoding: chunked`` decoding over a :class:`_Reader`: each call returns
    the payload bytes of the next network read that held some (``done`` once the last
    chunk and its trailers have arrived; bytes after them are left to the reader)."""

    __slots__ = ("_buffer", "_footer", "_reader", "_remaining", "done")

    def __init__(self, reader: _Reader) -> None:
        self._reader = reader
        self._buffer = reader.take_buffer()
        self._remaining = 0  # payload bytes of the current chunk still to come
        self._footer = b""  # what is still to come of the CRLF that ends a chunk's payload
        self.done = False

    async def next_bytes(self) -> bytes:
        while True:
            if self._buffer:
                data = self._decode()
                if data or self.done:
                    return data
            more = await self._reader.receive()
            if not more:
                raise RemoteProtocolError(
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
                if not self._remaining:
                    self._footer = _CRLF
                continue
            footer = self._footer
            if footer:
                # Exactly CRLF, as h11 (the library paths' parser) wants it: a payload one
                # byte longer than its size said, or a bare LF, splits the body differently
                # on each path (R-SEC-1).
                seen = buffer[pos : pos + len(footer)]
                if not footer.startswith(seen):
                    if pieces:
                        break  # the payload before it first, as h11 hands it on
                    raise RemoteProtocolError(f"malformed chunk footer: {seen!r} (expected CRLF)")
                pos += len(seen)
                self._footer = footer[len(seen) :]
                continue
            line_end = buffer.find(_CRLF, pos)
            if line_end < 0:
                # A size line without end would be held for as long as the server sends it.
                if size - pos > MAX_HEAD_BYTES:
                    raise RemoteProtocolError("chunk size line too long")
                break
            line = buffer[pos:line_end]
            chunk_size = _chunk_size(line)
            if chunk_size is None:
                if pieces:
                    break  # the payload before it first, as h11 hands it on
                raise RemoteProtocolError(f"illegal chunk size: {line[:100]!r}")
            if chunk_size == 0:
                # The last chunk, then trailers (ignored) up to a blank line.
                end = _trailers_end(buffer, line_end + 2)
                if end < 0:
                    if size - pos > MAX_HEAD_BYTES:
                        raise RemoteProtocolError("chunked trailers too long")
                    break
                self.done = True
                self._buffer = b""
                self._reader.push_back(buffer[end:])
                return b"".join(pieces)
            self._remaining = chunk_size
            pos = line_end + 2
        self._buffer = buffer[pos:]
        return b"".join(pieces)


READABLE_ENCODINGS = ("gzip", "deflate")
"""The content codings a body may come in (zlib's): the libraries ask for these, the lean
path for none; a server that sends another has its body refused (:func:`unreadable_encoding`)."""


def unreadable_encoding(encoding: str) -> str:
    """The words for a body in a content coding not in :data:`READABLE_ENCODINGS`
    (``encoding``: the codings it names, ``", "``-joined), the same on every path."""
    return (
        f"the server sent a body with content-encoding {encoding!r}, "
        "which greenroom does not read (it asks for gzip, deflate or none)"
    )


async def inflated(
    pieces: AsyncIterable[bytes], encoding: str, error: Callable[[str], Exception]
) -> AsyncGenerator[bytes, None]:
    """The pieces of a ``gzip`` or ``deflate`` body (``encoding``), inflated at most
    :data:`MAX_INFLATED` bytes at a time: a read of a few kilobytes can inflate a
    thousandfold, so one read may become many pieces. A body zlib cannot read raises
    ``error(message)``. ``deflate`` without its zlib wrapper, as some servers send it, is
    read too. Also used by the library paths (:mod:`~greenroom.actors.providers.
    library_bodies`)."""
    if encoding == "gzip":
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    else:
        inflate = zlib.decompressobj()
    first = True
    async for piece in pieces:
        try:
            data = inflate.decompress(piece, MAX_INFLATED)
        except zlib.error as exc:
            if not (first and encoding == "deflate"):
                raise error(f"bad {encoding} body: {exc}") from None
            inflate = zlib.decompressobj(-zlib.MAX_WBITS)
            try:
                data = inflate.decompress(piece, MAX_INFLATED)
            except zlib.error as again:
                raise error(f"bad deflate body: {again}") from None
        first = False
        if data:
            yield data
        while inflate.unconsumed_tail:
            try:
                data = inflate.decompress(inflate.unconsumed_tail, MAX_INFLATED)
            except zlib.error as exc:
                raise error(f"bad {encoding} body: {exc}") from None
            if data:
                yield data
    rest = inflate.flush()
    if rest:
        yield rest


__all__ = [
    "DEADLINE_SLACK",
    "KEEPALIVE_EXPIRY_S",
    "READABLE_ENCODINGS",
    "URL",
    "BodyDeadline",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionPool",
    "NetworkError",
    "PoolTimeout",
    "ProtocolError",
    "RawBody",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "Response",
    "TimeoutException",
    "TimeoutSettings",
    "Timeouts",
    "TransportError",
    "UnsupportedProtocol",
    "WriteError",
    "WriteTimeout",
    "default_ssl_context",
    "environment_proxy",
    "inflated",
    "parse_url",
    "unreadable_encoding",
]
