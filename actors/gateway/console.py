"""The web console's HTTP server: one static page (``console/index.html``) over HTTP/1.1.

``greenroom serve`` runs it next to the gateway (``--console-port``, default the gateway's
port + 1). The page is a plain websocket JSON-RPC client of the gateway: this server only
hands it out and knows nothing of sessions or tokens (the token travels in the URL
fragment, which browsers never send to a server).

::

    ConsoleServer.run           the listener (trio.serve_listeners), until cancelled
    └── one task per connection: read one request, answer it, close

Invariants:

* One request per connection (``Connection: close``): no keep-alive, no pipelining, no
  request bodies. ``GET`` and ``HEAD`` of ``/`` (or ``/index.html``) answer the page;
  another path answers 404, another method 405, a request that is not HTTP/1.x 400, a
  head larger than ``max_request_bytes`` 431, a head not complete within
  ``read_timeout_s`` 408; beyond ``max_connections`` at once a connection gets 503. A
  request whose ``Host`` header names no name of the server (``host_names``: ``localhost``,
  the listen host, IP addresses and the names the owner allowed) is answered 421 (a DNS
  rebinding page, R-SEC-4): the page is never served under an attacker's name, whose
  policy would let it open websockets to that name.
* At most ``max_connections + CONSOLE_SLACK`` sockets are open at once (the slack: room to
  answer 503): the listener accepts no more until one closes, so a flood of connections
  waits in the kernel's backlog instead of taking the process's file descriptors, as the
  gateway's listener does (R-SEC-4).
* A connection's failure (reset, timeout, garbage) ends that connection only: the handler
  never raises anything but ``Cancelled``, so the listener keeps serving.
* The page is served with ``Cache-Control: no-store`` and a Content-Security-Policy that
  allows nothing but the page's own inline script and style (by their SHA-256 hashes) and
  websocket connections to the listening host: to the gateway's port alone when the server
  knows it (``ws_port``, as ``serve`` gives it: ``connect-src ws://HOST:PORT``), so a link
  whose ``?ws=`` names another listener of the host cannot take the page's token there
  (R-SEC-4); else to any of its ports (``connect-src ws://HOST:*``).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from pathlib import Path

import trio

from greenroom.actors.gateway.access import HostNames
from greenroom.actors.gateway.listeners import open_listeners
from greenroom.actors.gateway.sockets import CappedListener, CountedStream

__all__ = [
    "PAGE_PATH",
    "ConsoleServer",
    "console_url",
    "content_security_policy",
    "display_host",
    "load_page",
    "url_host",
]

logger = logging.getLogger(__name__)

PAGE_PATH = Path(__file__).with_name("console") / "index.html"
"""The console page, shipped as package data of ``greenroom.actors.gateway``."""

_REQUEST_LINE = re.compile(rb"([A-Z]{1,16}) (\S{1,4096}) HTTP/1\.([01])")
_HEADER_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252})(?::\d{1,5})?")
_INLINE = re.compile(rb"<(script|style)>(.*?)</\1>", re.DOTALL)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_NONE = "'none'"
_LINGER_S = 1.0
_LINGER_BYTES = 1 << 16
CONSOLE_SLACK = 8
"""Connections the console accepts beyond ``max_connections``, to answer them 503; beyond
those, connections wait in the kernel's backlog until a place is free."""

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def load_page(path: Path = PAGE_PATH) -> bytes:
    """The page's bytes (blocking: call it before serving or in a worker thread)."""
    return path.read_bytes()


def url_host(host: str) -> str:
    """``host`` as the host part of a URL: an IPv6 address gets its brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def display_host(listen_host: str) -> str:
    """The host a local browser should use for ``listen_host`` (a wildcard bind is reached
    through the loopback address)."""
    return "127.0.0.1" if listen_host in _WILDCARD_HOSTS else listen_host


def console_url(listen_host: str, port: int, ws_url: str, token: str | None) -> str:
    """``http://HOST:PORT/?ws=WS_URL#token=TOKEN``: the token is in the fragment, which a
    browser keeps to itself (it never reaches a server or its logs)."""
    url = f"http://{url_host(display_host(listen_host))}:{port}/?ws={ws_url}"
    return f"{url}#token={token}" if token else url


def content_security_policy(
    page: bytes, ws_hosts: tuple[str, ...], ws_port: int | None = None
) -> str:
    """The page's policy: its own inline ``<script>`` and ``<style>`` elements (hashed),
    websocket connections to ``ws_hosts`` on ``ws_port`` (None: any port), nothing else."""
    hashes: dict[bytes, list[str]] = {b"script": [], b"style": []}
    for match in _INLINE.finditer(page):
        digest = base64.b64encode(hashlib.sha256(match.group(2)).digest()).decode("ascii")
        hashes[match.group(1)].append(f"'sha256-{digest}'")
    port = "*" if ws_port is None else str(ws_port)
    connect = " ".join(f"ws://{url_host(host)}:{port}" for host in dict.fromkeys(ws_hosts))
    return "; ".join(
        (
            "default-src 'none'",
            f"script-src {' '.join(hashes[b'script']) or _NONE}",
            f"style-src {' '.join(hashes[b'style']) or _NONE}",
            f"connect-src {connect}",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ConsoleServer:
    """Serves the console page on ``listen_host:port`` (``port=0``: any free port).

    Start it with ``port = await nursery.start(server.run)``; cancel the nursery to stop.
    ``page`` defaults to :data:`PAGE_PATH`'s content, read when the server starts.

    Channels: none. Each connection is one task of ``trio.serve_listeners`` that reads one
    request head (at most ``max_request_bytes``), answers it and closes; beyond
    ``max_connections`` at once a connection is answered 503 at once, and beyond
    ``max_connections + CONSOLE_SLACK`` none is accepted until one closes.
    """

    def __init__(
        self,
        *,
        listen_host: str = "127.0.0.1",
        port: int = 8766,
        page: bytes | None = None,
        max_request_bytes: int = 8192,
        read_timeout_s: float = 10.0,
        write_timeout_s: float = 10.0,
        max_connections: int = 64,
        reuse_port: bool = False,
        ws_port: int | None = None,
        host_names: HostNames | None = None,
    ) -> None:
        self.host_names = host_names or HostNames(listen_host)
        """The names a request's ``Host`` header may give (default: ``localhost``, the
        listen host and IP addresses); another is answered 421."""
        self.reuse_port = reuse_port
        """Share the port with other processes (``serve --workers``: ``SO_REUSEPORT``)."""
        self.ws_port = ws_port
        """The gateway's port: the only one the page may open websockets to (None: any
        port of the host). The page sends its token wherever its ``?ws=`` points, and a
        link can point it at another listener of the host."""
        self.listen_host = listen_host
        self.port = port
        self.page = page
        self.max_request_bytes = max_request_bytes
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_connections = max_connections
        self._active = 0

    @property
    def open_connections(self) -> int:
        """The connections accepted and not closed yet."""
        return self._active

    def url(self, ws_url: str, token: str | None = None) -> str:
        """The page's URL for a gateway at ``ws_url`` (:func:`console_url`)."""
        return console_url(self.listen_host, self.port, ws_url, token)

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; reports the bound port once listening."""
        if self.page is None:
            self.page = await trio.to_thread.run_sync(load_page)
        listeners = await open_listeners(
            self.port, self.listen_host or None, reuse_port=self.reuse_port
        )
        self.port = listeners[0].socket.getsockname()[1]
        sockets = trio.CapacityLimiter(self.max_connections + CONSOLE_SLACK)
        capped = [CappedListener(listener, sockets) for listener in listeners]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, capped)
            task_status.started(self.port)

    # -- one connection --------------------------------------------------------------------

    async def _handle(self, stream: CountedStream) -> None:
        """One connection: never raises but Cancelled (that would stop the listener)."""
        self._active += 1
        try:
            if self._active > self.max_connections:
                await self._send(stream, self._error(503, "too many connections"))
                return
            try:
                with trio.fail_after(self.read_timeout_s):
                    head = await self._read_head(stream)
                response = self._respond(head)
            except trio.TooSlowError:
                response = self._error(408, "request not complete in time")
            except _BadRequest as exc:
                response = self._error(exc.status, str(exc))
            await self._send(stream, response)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away
        except Exception:
            logger.exception("console: connection failed")
        finally:
            self._active -= 1
            await trio.aclose_forcefully(stream)

    async def _read_head(self, stream: CountedStream) -> bytes:
        """The request head without its final blank line; the rest is never read."""
        data = bytearray()
        while True:
            chunk = await stream.receive_some(4096)
            if not chunk:
                raise _BadRequest(400, "connection closed before the end of the request head")
            data += chunk
            end = data.find(b"\r\n\r\n")
            if 0 <= end <= self.max_request_bytes:
                return bytes(data[:end])
            if len(data) > self.max_request_bytes:
                raise _BadRequest(431, "request head too large")

    def _respond(self, head: bytes) -> bytes:
        lines = head.split(b"\r\n")
        match = _REQUEST_LINE.fullmatch(lines[0])
        if match is None:
            raise _BadRequest(400, "malformed request line")
        method, target, minor = match.groups()
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not _HEADER_NAME.fullmatch(name):
                raise _BadRequest(400, "malformed header line")
            headers[name.lower()] = value.strip(b" \t")
        host_header = headers.get(b"host")
        if minor == b"1" and host_header is None:
            raise _BadRequest(400, "HTTP/1.1 request without a Host header")
        if not self.host_names.allows(host_header):
            refusal = self.host_names.refusal(host_header)
            return self._error(421, refusal, head_only=method == b"HEAD")
        if method not in (b"GET", b"HEAD"):
            return self._error(405, "only GET and HEAD", extra=(("Allow", "GET, HEAD"),))
        path = target.split(b"?", 1)[0]
        if path not in (b"/", b"/index.html"):
            return self._error(404, "not found: the console is at /", head_only=method == b"HEAD")
        assert self.page is not None
        policy = content_security_policy(self.page, self._ws_hosts(host_header), self.ws_port)
        return self._build(
            200,
            "text/html; charset=utf-8",
            self.page,
            extra=(
                ("Content-Security-Policy", policy),
                ("Referrer-Policy", "no-referrer"),
                ("X-Frame-Options", "DENY"),
            ),
            head_only=method == b"HEAD",
        )

    def _ws_hosts(self, host_header: bytes | None) -> tuple[str, ...]:
        """Where the page may open websockets: the listening host, and the host name the
        browser used to reach this page (``localhost`` for 127.0.0.1, or a name of a
        wildcard bind) when the Host header holds a plain host[:port]."""
        hosts = [display_host(self.listen_host)]
        if host_header is not None:
            text = host_header.decode("latin-1")
            match = _HOST_HEADER.fullmatch(text)
            if match is not None:
                hosts.append(match.group(1).strip("[]"))
        return tuple(hosts)

    def _error(
        self,
        status: int,
        message: str,
        *,
        extra: tuple[tuple[str, str], ...] = (),
        head_only: bool = False,
    ) -> bytes:
        body = f"{status} {_REASONS.get(status, '')}: {message}\n".encode()
        return self._build(
            status, "text/plain; charset=utf-8", body, extra=extra, head_only=head_only
        )

    @staticmethod
    def _build(
        status: int,
        content_type: str,
        body: bytes,
        *,
        extra: tuple[tuple[str, str], ...] = (),
        head_only: bool = False,
    ) -> bytes:
        headers = [
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Cache-Control: no-store",
            "X-Content-Type-Options: nosniff",
            "Connection: close",
            *(f"{name}: {value}" for name, value in extra),
        ]
        head = ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1")
        return head if head_only else head + body

    async def _send(self, stream: CountedStream, response: bytes) -> None:
        with trio.move_on_after(self.write_timeout_s):
            await stream.send_all(response)
            await stream.send_eof()
        # Closing a socket with unread input resets it, and a reset can destroy the answer
        # before the client reads it: read (and drop) what it still sends, briefly.
        with trio.move_on_after(_LINGER_S):
            drained = 0
            while drained < _LINGER_BYTES and (chunk := await stream.receive_some(4096)):
                drained += len(chunk)
