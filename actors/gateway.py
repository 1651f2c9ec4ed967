"""The gateway actor: JSON-RPC 2.0 over websockets at ``ws://HOST:PORT/v1`` (CONTRACT.md).

::

    Gateway.run                     the listener (trio-websocket), until cancelled
    └── one handler per connection
        ├── reader   the handler task itself: reads frames, answers requests in order
        ├── writer   sends the connection's queued frames (responses, notifications)
        └── compact  a detached call (it waits for a model request), answered when done

Frames are read and built by :mod:`greenroom.protocols.jsonrpc`; this module does the I/O.

Invariants:

* A session's supervisor never waits on a client. The gateway watches each session through
  one ``Session.subscribe`` listener (a :class:`_SessionHub`) that encodes every output once
  and queues the frame on each subscribed connection's outbox without blocking. A client is
  dropped only when it is really behind: its writer has not finished a send for
  ``stall_timeout_s`` (the socket refuses bytes: the client does not read) while more than
  ``max_pending_frames`` frames wait that the writer has not taken, or the frames waiting
  exceed ``max_pending_bytes`` whatever the reason. A burst of outputs on a busy server,
  which a prompt reader gets as soon as its writer runs, never counts. A dropped
  subscription gets a ``subscription_dropped`` notification ``{session_id, reason,
  last_seq}``; the client resubscribes with ``after_seq: last_seq`` and misses nothing.
  Other clients and the session are never slowed down.
* Runs are not read through their ``RunStream``: the gateway detaches it at once
  (``RunStream.detach``) and every output reaches clients through the subscription, so
  nothing piles up for a run nobody reads.
* Requests of one connection are executed in arrival order by its reader (a ``steer``
  sent after a ``run`` lands in that run). ``compact`` alone runs in its own task, so the
  connection keeps reading while the model summarizes (inside a batch it runs in line).
* A bad frame is answered with an error and the connection stays open: not JSON (-32700);
  binary, wrong shape, too large (-32600); unknown method (-32601); bad params (-32602,
  naming the ``$.path``). The one exception is a message larger than
  ``max_message_bytes``, which the websocket library refuses by closing (1009).
* Batches are supported (JSON-RPC 2.0 §6); each entry counts against the rate limit.
* Sessions outlive the gateway: stopping it closes each connection with code 1001 and a
  reason, and leaves running tasks to the host.

Authentication and identity (R-SEC-4): a connection is authenticated by ``Authorization:
Bearer TOKEN`` on the handshake (a wrong token is refused with HTTP 401 before the upgrade)
or by an ``initialize {token, client_id?}`` first call; until then every other method
answers 401 and the connection stays open, for at most ``auth_timeout_s`` (10 s: then it is
closed with 1008; after ``max_auth_failures`` wrong tokens it is closed at once). Each token
names one *principal* (``--tokens-file``: one ``CLIENT_ID TOKEN`` per line; ``--token-file``
or the generated token: the principal ``default``). Tokens are compared in constant time,
every known token each time. ``initialize {client_id}`` and the ``X-Greenroom-Client``
header may only repeat the token's principal: naming another is refused (403). A
principal sees only the sessions it created or was granted (:meth:`Gateway.grant`):
another principal's session answers 403, an unknown one 404. Every connection of one
principal sees the same sessions (a reconnecting client keeps its sessions).

Admission, before any of that: a browser handshake (one with an ``Origin`` header) whose
origin is not allowed (the console's, or one given with ``allowed_origins`` /
:meth:`Gateway.allow_origin`) is refused with HTTP 403; beyond ``max_connections`` open
connections the handshake is refused with HTTP 503; and the listener stops accepting
sockets at ``max_connections + HANDSHAKE_SLACK``, so a flood of half-open connections
waits in the kernel's backlog instead of taking the file descriptors sessions need for
their traces. ``greenroom serve`` raises the process's soft ``RLIMIT_NOFILE`` to its hard
limit and keeps ``FD_RESERVE`` descriptors out of the cap (:func:`connection_cap`).

Workspaces (R-SEC-5): a client's ``session.create {workspace}`` must resolve (symlinks
followed) to a directory under the workspace root (:attr:`SessionDefaults.workspace_root`,
default: the default workspace) that is not the file system root; relative paths are
taken from the root. The gateway refuses to start when the data dir (tokens, traces,
ledger) lies under the workspace root or the default workspace: no session's tools could
then reach it.

Approvals (``approve="ask"``, the default of ``greenroom serve``): every session the
gateway creates or loads gets a client approver. A tool call then emits an
``approval_request`` output and waits for an ``approve {session_id, call_id, decision}``
call from any connection of an owning identity; when no connection is subscribed to the
session the call is denied at once (``by: default``), and after the session's
``approval_timeout_s`` it is denied too. A pending request survives a client's
disconnection, so a client that reconnects and resubscribes can still answer it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, WebSocketServer

from greenroom.actors.errors import (
    AuthLocked,
    Busy,
    ConfigurationError,
    GreenroomError,
    SessionNotFound,
)
from greenroom.actors.host import SESSION_FILE, Host, default_data_dir
from greenroom.actors.llm_streamer import ModelProvider
from greenroom.actors.session import Session
from greenroom.actors.trace_sink import TraceWriteError, read_trace
from greenroom.protocols import jsonrpc
from greenroom.protocols.content import ImageBlock, ToolCallBlock, UserContent
from greenroom.protocols.converter import to_dict
from greenroom.protocols.jsonrpc import (
    Batch,
    FrameError,
    Notification,
    Request,
    RpcError,
    invalid,
)
from greenroom.protocols.messages import Verdict
from greenroom.protocols.outputs import ApprovalDecision, ApprovalRequest, Output
from greenroom.protocols.text import repair_text
from greenroom.protocols.tools import Tool
from greenroom.protocols.trace import trace_file_number

__all__ = [
    "AUTH_TIMEOUT_S",
    "DEFAULT_CLIENT",
    "DEFAULT_MAX_CONNECTIONS",
    "FD_RESERVE",
    "PATH",
    "TOKEN_FILE_NAME",
    "Gateway",
    "GatewayLimits",
    "SessionDefaults",
    "check_data_dir_private",
    "connection_cap",
    "load_or_create_token",
    "load_tokens_file",
    "raise_fd_limit",
    "run_serve",
    "token_file_path",
]

logger = logging.getLogger(__name__)

PATH = "/v1"
TOKEN_FILE_NAME = "serve.token"
DEFAULT_CLIENT = "default"
"""The principal of the one token of ``--token-file`` (or the generated token)."""
CLIENT_HEADER = b"x-greenroom-client"
AUTH_TIMEOUT_S = 10.0
"""How long a connection may stay unauthenticated before it is closed (1008)."""
DEFAULT_MAX_CONNECTIONS = 1024
HANDSHAKE_SLACK = 32
"""Sockets accepted beyond ``max_connections``: enough to answer 503 to a few at a time."""
FD_RESERVE = 256
"""File descriptors the connection cap leaves to sessions (traces, ledger, tools)."""

ApproveMode = Literal["ask", "all", "none"]

_CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CLIENT_SETTABLE_FORBIDDEN = ("provider", "base_url", "sandbox", "shell_network")
"""Settings a client may not choose: ``provider`` and ``base_url`` pick which endpoint gets
the server's API key; ``sandbox`` and ``shell_network`` are the server's confinement of
``run_shell`` (R-SEC-3), which a client must not loosen."""
TITLE_FILE = "title.txt"
"""A session's generated title, next to its ``session.json`` (never in its trace)."""


def _tool_tuple(tools: Iterable[Tool]) -> tuple[Tool, ...]:
    return tuple(tools)


# -- configuration -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SessionDefaults:
    """How the gateway creates sessions (``greenroom serve`` fills it from its flags).

    A client's ``session.create {workspace?, model?, settings?}`` overrides ``workspace_dir``,
    ``model`` and any :class:`SessionSettings` field but ``provider`` and ``base_url``.
    ``provider_factory``, when given, makes the provider object of each new or loaded
    session (tests pass scripted providers this way) and wins over ``provider``.
    ``approve``: ``ask`` (clients answer ``approval_request`` outputs), ``all`` (every call
    is allowed), ``none`` (every call is denied).
    """

    provider: str | None = None
    provider_factory: Callable[[], ModelProvider] | None = None
    model: str | None = None
    tools: tuple[Tool, ...] = attrs.field(default=(), converter=_tool_tuple)
    mcp_servers: Mapping[str, Any] = attrs.field(factory=dict)
    """MCP servers whose tools every session gets (``host.create_session(mcp_servers=…)``)."""
    workspace_dir: str | Path = "."
    system: str | None = None
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    approve: ApproveMode = "ask"
    workspace_root: str | Path | None = None
    """Where a client's ``session.create {workspace}`` must resolve; None: under
    ``workspace_dir``."""


@attrs.frozen(kw_only=True)
class GatewayLimits:
    """Per-connection limits. ``rate_per_s``/``burst``: a token bucket on calls (each batch
    entry and each bad frame is one); beyond it calls answer 429. ``max_frame_bytes``: a
    larger text frame answers -32600; ``max_message_bytes``: the websocket library closes
    the connection (1009) beyond it. ``max_pending_frames``: how many frames the
    connection's writer has not taken may wait while the writer is stuck (no send finished
    for ``stall_timeout_s``: the socket refuses bytes) before its subscriptions are
    dropped; ``max_pending_bytes``: the bound on what waits for one connection (counted in
    characters), stuck or not.
    ``settle_timeout_s``: how long ``run`` waits for a session that has emitted
    ``task_end`` to turn idle."""

    rate_per_s: float = 50.0
    burst: int = 100
    max_frame_bytes: int = 1 << 20
    max_message_bytes: int = 16 << 20
    max_batch: int = 100
    max_pending_frames: int = 1000
    max_pending_bytes: int = 64 << 20
    stall_timeout_s: float = 2.0
    max_replay_buffer: int = 10_000
    max_auth_failures: int = 5
    handshake_timeout_s: float = 10.0
    close_timeout_s: float = 5.0
    settle_timeout_s: float = 2.0


# -- the token -----------------------------------------------------------------------------------


def load_or_create_token(data_dir: str | Path, token_file: str | Path | None = None) -> str:
    """The bearer token of ``greenroom serve``.

    With ``token_file``: its content (stripped); a missing file is created with a new token.
    Without: ``<data_dir>/serve.token``, reused when it exists, else created. A created
    file holds ``secrets.token_urlsafe(32)`` and has mode 0600. Raises
    :class:`ConfigurationError` for an empty or unreadable file. Blocking (call it before
    ``trio.run`` or in a worker thread).
    """
    path = token_file_path(data_dir, token_file)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        token = secrets.token_urlsafe(32)
        _write_private(path, token + "\n")
        return token
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read the token file {path}: {exc}") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigurationError(f"the token file {path} holds no usable token")
    return token


def token_file_path(data_dir: str | Path, token_file: str | Path | None = None) -> Path:
    """Where the token is read from: ``token_file``, else ``<data_dir>/serve.token``."""
    return Path(token_file).expanduser() if token_file else Path(data_dir) / TOKEN_FILE_NAME


def load_tokens_file(path: str | Path) -> dict[str, str]:
    """The principals of ``serve --tokens-file``: ``{client_id: token}`` from a file of
    ``CLIENT_ID TOKEN`` lines (``#`` starts a comment; blank lines are skipped). Raises
    :class:`ConfigurationError` naming the file and line of a bad line, a repeated client
    id or token, or an unreadable or empty file. Blocking."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read the tokens file {file}: {exc}") from None
    tokens: dict[str, str] = {}
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{file}:{number}"
        if len(fields) != 2:
            raise ConfigurationError(
                f"{where}: expected CLIENT_ID TOKEN, got {len(fields)} field(s)"
            )
        client_id, token = fields
        if not _CLIENT_ID.fullmatch(client_id):
            raise ConfigurationError(
                f"{where}: bad client id (letters, digits and ._:@- only, at most 64)"
            )
        if client_id in tokens:
            raise ConfigurationError(f"{where}: client id {client_id!r} given twice")
        if token in seen:
            raise ConfigurationError(f"{where}: this token is already another client's")
        if len(token) < 16:
            raise ConfigurationError(f"{where}: token shorter than 16 characters")
        tokens[client_id] = token
        seen.add(token)
    if not tokens:
        raise ConfigurationError(f"the tokens file {file} names no client")
    return tokens


def connection_cap(requested: int, fd_soft_limit: int | None) -> int:
    """The connection cap that leaves ``FD_RESERVE`` descriptors (and the handshake
    slack) free under ``fd_soft_limit`` (None: no limit known); at least 1."""
    if fd_soft_limit is None or fd_soft_limit < 0:
        return requested
    return max(1, min(requested, fd_soft_limit - FD_RESERVE - HANDSHAKE_SLACK))


def raise_fd_limit() -> int | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (where the platform has one) and
    return the soft limit now in force (None: unknown or unlimited)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return None if soft == resource.RLIM_INFINITY else soft


def check_data_dir_private(data_dir: str | Path, *workspaces: str | Path) -> None:
    """Raise :class:`ConfigurationError` when the data dir lies under one of
    ``workspaces`` (the workspace root, the default workspace): a session's tools would
    reach the tokens and every other session's traces (R-SEC-5). Blocking."""
    data = Path(data_dir).expanduser().resolve()
    for workspace in workspaces:
        root = Path(workspace).expanduser().resolve()
        if data.is_relative_to(root):
            raise ConfigurationError(
                f"the data dir {data} is inside the workspace {root}, where sessions' tools "
                f"could read it; choose a --data-dir outside {root} or another "
                "--workspace-root/--workspace"
            )


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)


# -- the gateway -----------------------------------------------------------------------------------


class Gateway:
    """The websocket JSON-RPC server of one :class:`Host`.

    Start it with ``port = await nursery.start(gateway.run)``; cancel the nursery to stop.
    ``port=0`` binds a free port (reported by ``start`` and kept in :attr:`port`).
    With ``titles``, a session whose first task through the gateway has ended is named once
    by :meth:`Session.generate_title` (R-HOST-5, in the background: it never holds up a
    task); the title is kept in ``title.txt`` in the session's directory and listed by
    ``session.list``.

    Principals: ``token`` is the one token of the principal ``default``; ``tokens`` maps
    client ids to their tokens (give one or both). ``allowed_origins``: browser origins
    (``http://host:port``) allowed besides the ones added with :meth:`allow_origin`.
    ``auth_timeout_s``: how long a connection may stay unauthenticated.
    """

    def __init__(
        self,
        host: Host,
        *,
        token: str | None = None,
        tokens: Mapping[str, str] | None = None,
        listen_host: str = "127.0.0.1",
        port: int = 8765,
        defaults: SessionDefaults | None = None,
        approval_timeout_s: float = 300.0,
        limits: GatewayLimits | None = None,
        titles: bool = False,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        allowed_origins: Iterable[str] = (),
        auth_timeout_s: float = AUTH_TIMEOUT_S,
    ) -> None:
        principals = dict(tokens or {})
        if token is not None:
            principals.setdefault(DEFAULT_CLIENT, token)
        if not principals or not all(principals.values()):
            raise ConfigurationError("the gateway needs a non-empty token")
        if max_connections < 1:
            raise ConfigurationError("max_connections must be at least 1")
        self.host = host
        self.listen_host = listen_host
        self.port = port
        self.defaults = defaults or SessionDefaults()
        self.approval_timeout_s = approval_timeout_s
        self.limits = limits or GatewayLimits()
        self.max_connections = max_connections
        self.auth_timeout_s = auth_timeout_s
        self._principals = tuple(
            (secret.encode("utf-8"), client_id) for client_id, secret in principals.items()
        )
        self._origins = {_normal_origin(origin) for origin in allowed_origins}
        self._admitted = 0
        self._workspace_root: Path | None = None
        self._grants: dict[str, set[str]] = {}
        self._hubs: dict[str, _SessionHub] = {}
        self._connections: set[_Connection] = set()
        self.titles = titles
        self._titled: set[str] = set()
        self._title_of: dict[str, str] = {}
        self._nursery: trio.Nursery | None = None
        self._methods: dict[str, Callable[[_Connection, dict[str, Any]], Any]] = {
            "initialize": self._initialize,
            "session.create": self._session_create,
            "session.list": self._session_list,
            "session.subscribe": self._session_subscribe,
            "session.unsubscribe": self._session_unsubscribe,
            "run": self._run,
            "steer": self._steer,
            "follow_up": self._follow_up,
            "approve": self._approve,
            "interrupt": self._interrupt,
            "compact": self._compact,
            "skip_reconnect_wait": self._skip_reconnect_wait,
            "retry_auth": self._retry_auth,
        }

    # -- public ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; reports the bound port when it accepts
        connections. Cancelling closes every connection (1001, with a reason); sessions
        keep running in the host."""
        defaults = self.defaults
        root = defaults.workspace_root or defaults.workspace_dir
        self._workspace_root = await trio.to_thread.run_sync(_resolved, root)
        await trio.to_thread.run_sync(
            check_data_dir_private, self.host.data_dir, root, defaults.workspace_dir
        )
        listeners = await trio.open_tcp_listeners(self.port, host=self.listen_host)
        if self.port == 0 and len(listeners) > 1:
            # Port 0 on a name with several addresses gives each listener its own port;
            # serve one so that the reported port is the port.
            for extra in listeners[1:]:
                await extra.aclose()
            listeners = listeners[:1]
        sockets = trio.CapacityLimiter(self.max_connections + HANDSHAKE_SLACK)
        capped = [_CappedListener(listener, sockets) for listener in listeners]
        limits = self.limits
        server = WebSocketServer(
            self._handle,
            cast(list[trio.SocketListener], capped),  # any trio Listener serves
            max_message_size=limits.max_message_bytes,
            connect_timeout=limits.handshake_timeout_s,
            disconnect_timeout=limits.close_timeout_s,
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                self.port = listeners[0].socket.getsockname()[1]
                self._nursery = nursery
                task_status.started(self.port)
        finally:
            self._nursery = None
            self._release_sessions()

    def _release_sessions(self) -> None:
        """The gateway stopped: no client can answer any more. Pending approvals are
        denied and the sessions forget their client approver (they keep running)."""
        for hub in self._hubs.values():
            hub.close()
            if hub.session._client_approver() == hub.ask:
                hub.session.set_client_approver(None)
        self._hubs.clear()

    @property
    def url(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"ws://{host}:{self.port}{PATH}"

    def allow_origin(self, origin: str) -> None:
        """Admit browser handshakes from ``origin`` (``scheme://host[:port]``)."""
        self._origins.add(_normal_origin(origin))

    def grant(self, client_id: str, session_id: str) -> None:
        """Let ``client_id`` see and steer ``session_id`` (created elsewhere or by another
        client). Grants live as long as the gateway."""
        self._grants.setdefault(client_id, set()).add(session_id)

    def owned(self, client_id: str) -> frozenset[str]:
        """The sessions ``client_id`` created or was granted."""
        return frozenset(self._grants.get(client_id, ()))

    # -- connections ---------------------------------------------------------------------------

    async def _handle(self, request: WebSocketRequest) -> None:
        """One connection, from handshake to close. Never raises but Cancelled: an
        exception here would end the listener and every other connection."""
        try:
            await self._handshake_and_serve(request)
        except ConnectionClosed:
            pass
        except Exception:
            logger.exception("gateway: connection failed")

    async def _handshake_and_serve(self, request: WebSocketRequest) -> None:
        if request.path.split("?", 1)[0] != PATH:
            await request.reject(404, body=f"not found: the endpoint is {PATH}\n".encode())
            return
        headers = {name.lower(): value for name, value in request.headers}
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin):
            await request.reject(403, body=b"forbidden: this origin may not connect\n")
            return
        if self._admitted >= self.max_connections:
            await request.reject(
                503, body=f"too many connections (at most {self.max_connections})\n".encode()
            )
            return
        claimed: str | None = None
        named = headers.get(CLIENT_HEADER)
        if named is not None:
            claimed = named.decode("latin-1").strip()
            if not _CLIENT_ID.fullmatch(claimed):
                await request.reject(400, body=b"bad X-Greenroom-Client header\n")
                return
        identity: str | None = None
        authorization = headers.get(b"authorization")
        if authorization is not None:
            scheme, _, token = authorization.partition(b" ")
            identity = self._principal_of(token.strip()) if scheme.lower() == b"bearer" else None
            if identity is None:
                await request.reject(
                    401,
                    extra_headers=[(b"WWW-Authenticate", b'Bearer realm="greenroom"')],
                    body=b"unauthorized: bad bearer token\n",
                )
                return
            if claimed is not None and claimed != identity:
                await request.reject(
                    403, body=b"forbidden: X-Greenroom-Client names another principal\n"
                )
                return
        self._admitted += 1
        try:
            ws = await request.accept()
            await self._serve_accepted(ws, identity, claimed)
        finally:
            self._admitted -= 1

    async def _serve_accepted(
        self, ws: WebSocketConnection, identity: str | None, claimed: str | None
    ) -> None:
        connection = _Connection(ws, identity, self.limits)
        connection.claimed = claimed
        self._connections.add(connection)
        close_code, close_reason = 1000, "bye"
        try:
            await self._serve(connection)
            if connection.close_with is not None:
                close_code, close_reason = connection.close_with
        except trio.Cancelled:
            close_code, close_reason = 1001, "server shutting down"
            raise
        except Exception:
            close_code, close_reason = 1011, "internal error"
            raise
        finally:
            self._connections.discard(connection)
            connection.drop_subscriptions()
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + self.limits.close_timeout_s
                with contextlib.suppress(ConnectionClosed, trio.BrokenResourceError):
                    await ws.aclose(close_code, close_reason)

    def _principal_of(self, token: bytes) -> str | None:
        """The principal whose token this is. Every known token is compared, in constant
        time, so the time taken says nothing about which (if any) matched."""
        found: str | None = None
        for secret, principal in self._principals:
            if hmac.compare_digest(token, secret):
                found = principal
        return found

    def _origin_allowed(self, origin: bytes) -> bool:
        return _normal_origin(origin.decode("latin-1")) in self._origins

    async def _serve(self, connection: _Connection) -> None:
        async with trio.open_nursery() as nursery:
            connection.nursery = nursery
            nursery.start_soon(self._write_loop, connection, nursery.cancel_scope)
            if connection.identity is None:
                nursery.start_soon(self._auth_deadline, connection, nursery.cancel_scope)
            try:
                while connection.close_with is None:
                    message = await connection.ws.get_message()
                    await self._on_message(connection, message)
            except ConnectionClosed:
                pass
            if connection.close_with is not None:
                # Let the last answer (why we close) reach the client first.
                with trio.move_on_after(self.limits.close_timeout_s):
                    await connection.outbox.wait_below(1)
            nursery.cancel_scope.cancel()

    async def _auth_deadline(self, connection: _Connection, scope: trio.CancelScope) -> None:
        with trio.move_on_after(self.auth_timeout_s):
            await connection.authenticated.wait()
            return
        connection.close_with = (1008, f"not authenticated within {self.auth_timeout_s:g} s")
        scope.cancel()

    async def _write_loop(self, connection: _Connection, scope: trio.CancelScope) -> None:
        outbox = connection.outbox
        try:
            while True:
                # Everything queued is taken at once: frames a prompt reader will get as
                # soon as this task runs do not count against the slow-client rule.
                for frame in await outbox.take_all():
                    outbox.sending(trio.current_time())
                    await connection.ws.send_message(frame)
                    outbox.sent(frame)
        except ConnectionClosed:
            scope.cancel()

    async def _on_message(self, connection: _Connection, message: str | bytes) -> None:
        limits = self.limits
        frame = jsonrpc.parse_frame(
            message, max_bytes=limits.max_frame_bytes, max_batch=limits.max_batch
        )
        if isinstance(frame, Batch):
            answers: list[dict[str, Any]] = []
            for item in frame.items:
                answer = await self._answer(connection, item, detach=False)
                if answer is not None:
                    answers.append(answer)
            if answers:
                connection.outbox.put_nowait(jsonrpc.encode(answers))
        else:
            answer = await self._answer(connection, frame, detach=True)
            if answer is not None:
                connection.outbox.put_nowait(jsonrpc.encode(answer))
        connection.run_after_answer()

    async def _answer(
        self, connection: _Connection, call: Request | Notification | FrameError, *, detach: bool
    ) -> dict[str, Any] | None:
        """The response to one call (None for a notification, or one answered later)."""
        request_id = call.id if isinstance(call, Request | FrameError) else None
        wants_answer = not isinstance(call, Notification)
        if not connection.bucket.take(trio.current_time()):
            error = RpcError(
                jsonrpc.TOO_MANY_REQUESTS,
                f"too many requests: at most {self.limits.rate_per_s:g} per second "
                f"(bursts of {self.limits.burst})",
            )
            return jsonrpc.error_frame(request_id, error) if wants_answer else None
        if isinstance(call, FrameError):
            return call.response()
        if connection.identity is None and call.method != "initialize":
            error = RpcError(
                jsonrpc.UNAUTHORIZED,
                "unauthorized: send Authorization: Bearer TOKEN on the handshake or call "
                "initialize {token} first",
            )
            return jsonrpc.error_frame(request_id, error) if wants_answer else None
        method = self._methods.get(call.method)
        if method is None:
            error = RpcError(jsonrpc.METHOD_NOT_FOUND, f"method not found: {call.method!r}")
            return jsonrpc.error_frame(request_id, error) if wants_answer else None
        if detach and call.method == "compact":
            assert connection.nursery is not None
            connection.nursery.start_soon(self._answer_later, connection, call, method)
            return None
        return await self._call(connection, call, method)

    async def _answer_later(
        self,
        connection: _Connection,
        call: Request | Notification,
        method: Callable[[_Connection, dict[str, Any]], Any],
    ) -> None:
        answer = await self._call(connection, call, method)
        if answer is not None:
            connection.outbox.put_nowait(jsonrpc.encode(answer))

    async def _call(
        self,
        connection: _Connection,
        call: Request | Notification,
        method: Callable[[_Connection, dict[str, Any]], Any],
    ) -> dict[str, Any] | None:
        error: RpcError
        try:
            result = await method(connection, call.params)
        except RpcError as exc:
            error = exc
        except (Busy, AuthLocked, SessionNotFound) as exc:
            error = RpcError(exc.code, str(exc))
        except ConfigurationError as exc:
            error = RpcError(jsonrpc.INVALID_PARAMS, str(exc))
        except GreenroomError as exc:
            error = RpcError(getattr(exc, "code", jsonrpc.INTERNAL_ERROR), str(exc))
        except Exception as exc:
            logger.exception("gateway: %s failed", call.method)
            error = RpcError(jsonrpc.INTERNAL_ERROR, f"internal error: {exc!r}")
        else:
            if call.method != "initialize":
                connection.calls += 1
            if isinstance(call, Request):
                return jsonrpc.result_frame(call.id, result)
            return None
        if isinstance(call, Request):
            return jsonrpc.error_frame(call.id, error)
        return None

    # -- sessions and ownership ------------------------------------------------------------------

    def _identity(self, connection: _Connection) -> str:
        assert connection.identity is not None  # checked before any method but initialize
        return connection.identity

    async def _owned_session(self, connection: _Connection, params: Mapping[str, Any]) -> Session:
        session_id = jsonrpc.require_str(params, "session_id", max_len=200)
        if session_id not in self._grants.get(self._identity(connection), ()):
            if await self._exists(session_id):
                raise RpcError(
                    jsonrpc.FORBIDDEN, f"session {session_id!r} belongs to another client"
                )
            raise RpcError(jsonrpc.NOT_FOUND, f"no session {session_id!r}")
        try:
            session = self.host.get_session(session_id)
        except SessionNotFound:
            # Closed by the host since (or granted from the data dir): load it again.
            session = await self.host.load_session(
                session_id,
                tools=self.defaults.tools,
                provider=self._provider(),
                mcp_servers=self.defaults.mcp_servers,
            )
        self._adopt(session)
        return session

    async def _exists(self, session_id: str) -> bool:
        if any(session_id in owned for owned in self._grants.values()):
            return True
        if any(s.id == session_id for s in self.host.sessions):
            return True
        if not _SESSION_ID.fullmatch(session_id):
            return False
        meta = self.host.data_dir / "sessions" / session_id / SESSION_FILE
        return await trio.Path(meta).exists()

    def _provider(self) -> str | ModelProvider | None:
        if self.defaults.provider_factory is not None:
            return self.defaults.provider_factory()
        return self.defaults.provider

    def _adopt(self, session: Session) -> _SessionHub:
        """The session's hub, made (and its client approver installed) on first use."""
        hub = self._hubs.get(session.id)
        if hub is not None and hub.session is session:
            return hub
        if hub is not None:
            hub.close()
        hub = _SessionHub(session, on_task_end=self._title_once)
        self._hubs[session.id] = hub
        if self.defaults.approve == "ask":
            session.set_client_approver(hub.ask, present=hub.has_subscribers)
        return hub

    async def _settled(self, session: Session) -> Session:
        """``session``, after letting a task that has already emitted its ``task_end``
        finish syncing its trace (briefly), so that a client reacting to ``task_end`` is
        not told 409 Busy, and its steering or follow-up is not taken by a task that
        is ending."""
        hub = self._adopt(session)
        if session.busy and hub.finishing and not session.has_follow_ups:
            with trio.move_on_after(self.limits.settle_timeout_s):
                await session.wait_idle()
        return session

    def _title_once(self, session: Session) -> None:
        """After a task of ``session`` ended: give it a title unless it has one."""
        if not self.titles or session.id in self._titled or self._nursery is None:
            return
        self._titled.add(session.id)
        self._nursery.start_soon(self._make_title, session)

    async def _make_title(self, session: Session) -> None:
        path = session.directory / TITLE_FILE
        title = ""
        try:
            title = (await trio.to_thread.run_sync(_read_titles, [path]))[0]
            if not title:
                try:
                    made = repair_text(await session.generate_title())
                except Exception:
                    logger.exception("gateway: cannot title session %s", session.id)
                    made = ""
                if made:
                    await trio.to_thread.run_sync(_write_title, path, made)
                title = made
        finally:
            if title:
                self._title_of[session.id] = title
            else:  # failed, empty or cancelled: try again after the next task
                self._titled.discard(session.id)

    def _run_approver(self) -> Callable[[ToolCallBlock], str] | None:
        return _allow_all if self.defaults.approve == "all" else None

    async def _input(self, session: Session, params: Mapping[str, Any]) -> tuple[UserContent, ...]:
        if "input" not in params:
            raise invalid("$.input", "required")
        blocks = jsonrpc.parse_input(params["input"])
        if not any(isinstance(b, ImageBlock) for b in blocks):
            return blocks
        roots = (session.workspace_dir, session.scratchpad_dir)
        return await trio.to_thread.run_sync(_confine_images, blocks, roots)

    # -- methods ----------------------------------------------------------------------------------

    async def _initialize(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "initialize")
        if connection.initialized or connection.calls:
            raise RpcError(jsonrpc.INVALID_REQUEST, "initialize must be the first call, once")
        token = jsonrpc.optional_str(params, "token", max_len=1000)
        client_id = jsonrpc.optional_str(params, "client_id", max_len=64)
        if client_id is not None and not _CLIENT_ID.fullmatch(client_id):
            raise invalid("$.client_id", "letters, digits and ._:@- only, at most 64")
        principal = connection.identity
        if token is not None:
            principal = self._principal_of(token.encode("utf-8"))
            if connection.identity is not None and principal != connection.identity:
                principal = None  # the handshake's token said otherwise
        if principal is None:
            self._failed_auth(connection)
            raise RpcError(jsonrpc.UNAUTHORIZED, "unauthorized: bad or missing token")
        claimed = client_id or connection.claimed
        if claimed is not None and claimed != principal:
            self._failed_auth(connection)
            raise RpcError(
                jsonrpc.FORBIDDEN,
                f"forbidden: client_id {claimed!r} is not this token's principal",
            )
        connection.initialized = True
        connection.identity = principal
        connection.authenticated.set()
        return {"client_id": principal, "server": "greenroom", "path": PATH}

    def _failed_auth(self, connection: _Connection) -> None:
        connection.auth_failures += 1
        if connection.auth_failures >= self.limits.max_auth_failures:
            connection.close_with = (1008, "too many failed authentication attempts")

    async def _session_create(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "session.create")
        workspace_param = jsonrpc.optional_str(params, "workspace", max_len=4096)
        model = jsonrpc.optional_str(params, "model", max_len=200)
        raw_settings = jsonrpc.optional_object(params, "settings")
        client_settings = (
            jsonrpc.parse_settings(raw_settings, forbidden=_CLIENT_SETTABLE_FORBIDDEN)
            if raw_settings is not None
            else {}
        )
        defaults = self.defaults
        if workspace_param is None:
            workspace = await trio.to_thread.run_sync(_directory, defaults.workspace_dir)
        else:
            root = self._workspace_root
            assert root is not None  # set when the gateway starts
            workspace = await trio.to_thread.run_sync(
                _confined_workspace, workspace_param, root, self.host.data_dir
            )
        overrides: dict[str, Any] = {
            **defaults.settings,
            "approval_timeout_s": self.approval_timeout_s,
            **client_settings,
        }
        # create_session takes these two as arguments (its default model would override
        # one given in the settings).
        model = model or overrides.pop("model", None) or defaults.model
        system = overrides.pop("system", None) or defaults.system
        session = await self.host.create_session(
            model=model,
            tools=defaults.tools,
            workspace_dir=workspace,
            provider=self._provider(),
            system=system,
            mcp_servers=defaults.mcp_servers,
            **overrides,
        )
        self.grant(self._identity(connection), session.id)
        self._adopt(session)
        return {"session_id": session.id}

    async def _session_list(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "session.list")
        owned = self._grants.get(self._identity(connection), set())
        if not owned:
            return {"sessions": []}
        open_sessions = {s.id: s for s in self.host.sessions}
        scan = await self.host.scan_sessions()
        infos = [i for i in scan.sessions if i.session_id in owned]
        untitled = [i.session_id for i in infos if i.session_id not in self._title_of]
        sessions_dir = self.host.data_dir / "sessions"
        read = await trio.to_thread.run_sync(
            _read_titles, [sessions_dir / sid / TITLE_FILE for sid in untitled]
        )
        titles = {**dict(zip(untitled, read, strict=True)), **self._title_of}
        sessions: list[dict[str, Any]] = []
        for info in scan.sessions:
            if info.session_id not in owned:
                continue
            session = open_sessions.get(info.session_id)
            hub = self._hubs.get(info.session_id)
            sessions.append(
                {
                    **attrs.asdict(info),
                    "open": session is not None,
                    "busy": session is not None and session.busy,
                    "auth_locked": session is not None and session.auth_locked is not None,
                    "title": titles.get(info.session_id, ""),
                    "last_activity_at": max(
                        info.updated_at, hub.last_output_at if hub is not None else 0.0
                    ),
                    "state": _state(session, hub),
                }
            )
        # The reason names a path of the server's data dir: the session id is enough.
        unreadable = [
            {"session_id": bad.session_id, "reason": bad.reason.removeprefix(f"{bad.path}: ")}
            for bad in scan.unreadable
            if bad.session_id in owned
        ]
        if unreadable:
            return {"sessions": sessions, "unreadable": unreadable}
        return {"sessions": sessions}

    async def _session_subscribe(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "session.subscribe")
        session = await self._owned_session(connection, params)
        after_seq = jsonrpc.optional_int(params, "after_seq", minimum=0) or 0
        hub = self._adopt(session)
        old = connection.subscriptions.get(session.id)
        if old is not None:
            old.close()
        # Live first (buffered), then the replay: an output emitted meanwhile is in the
        # buffer, in the trace, or in both (deduplicated by seq): never in neither.
        subscription = _Subscription(connection, hub, after_seq, self.limits)
        try:
            records = await _replay_records(session, after_seq)
            last_seq = after_seq
            replayed = 0
            room = max(1, self.limits.max_pending_frames // 2)
            for record in records:
                if subscription.closed:
                    break
                await connection.outbox.wait_below(room)
                connection.outbox.put_nowait(_output_frame(record))
                last_seq = record.seq or last_seq
                subscription.last_seq = last_seq
                replayed += 1
        except BaseException:
            subscription.close()
            raise
        # The answer marks the end of the replay: what follows it is live.
        connection.after_answer.append(lambda: subscription.go_live(last_seq))
        return {"session_id": session.id, "replayed": replayed, "last_seq": last_seq}

    async def _session_unsubscribe(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "session.unsubscribe")
        session = await self._owned_session(connection, params)
        subscription = connection.subscriptions.get(session.id)
        if subscription is not None:
            subscription.close()
        return {"unsubscribed": subscription is not None}

    async def _run(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "run")
        session = await self._settled(await self._owned_session(connection, params))
        content = await self._input(session, params)
        stream = session.run(content, approve=self._run_approver())
        stream.detach()  # clients read the outputs through their subscriptions
        return {"run_id": stream.run_id}

    async def _steer(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "steer")
        session = await self._settled(await self._owned_session(connection, params))
        content = await self._input(session, params)
        return {"queued": session.steer(content)}

    async def _follow_up(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "follow_up")
        session = await self._settled(await self._owned_session(connection, params))
        content = await self._input(session, params)
        return {"queued": session.follow_up(content, approve=self._run_approver())}

    async def _approve(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "approve")
        session = await self._owned_session(connection, params)
        call_id = jsonrpc.require_str(params, "call_id", max_len=500)
        decision = cast(
            Verdict, jsonrpc.require_choice(params, "decision", ("allow", "deny", "allow_session"))
        )
        if not self._adopt(session).answer(call_id, decision):
            raise invalid("$.call_id", f"no pending approval request {call_id!r}")
        return {}

    async def _interrupt(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "interrupt")
        session = await self._owned_session(connection, params)
        return {"interrupted": session.interrupt("interrupted by client")}

    async def _compact(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "compact")
        session = await self._settled(await self._owned_session(connection, params))
        end = await session.compact()
        return None if end is None else to_dict(end)

    async def _skip_reconnect_wait(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "skip_reconnect_wait")
        session = await self._owned_session(connection, params)
        return {"skipped": session.skip_reconnect_wait()}

    async def _retry_auth(self, connection: _Connection, params: dict[str, Any]) -> Any:
        jsonrpc.check_params(params, "retry_auth")
        session = await self._owned_session(connection, params)
        session.retry_auth()
        return {}


def _directory(value: str | Path) -> Path:
    path = Path(value).expanduser()
    if not path.is_dir():
        raise invalid("$.workspace", f"not a directory: {path}")
    return path


def _resolved(value: str | Path) -> Path:
    return Path(value).expanduser().resolve()


def _confined_workspace(value: str, root: Path, data_dir: Path) -> Path:
    """A client's workspace: a directory that resolves (symlinks followed) under ``root``,
    is not the file system root and does not hold the data dir (R-SEC-5). Relative paths
    are taken from ``root``. Raises -32602 naming ``$.workspace``; never OSError."""
    try:
        path = (root / Path(value).expanduser()).resolve(strict=True)
        is_dir = path.is_dir()
        data = data_dir.resolve()
    except FileNotFoundError:
        raise invalid("$.workspace", "no such directory") from None
    except (OSError, ValueError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise invalid("$.workspace", f"cannot be used: {reason}") from None
    if path == Path(path.anchor):
        raise invalid("$.workspace", "the file system root is never a workspace")
    if not is_dir:
        raise invalid("$.workspace", "not a directory")
    if not path.is_relative_to(root):
        raise invalid("$.workspace", f"outside the server's workspace root {root}")
    if data.is_relative_to(path):
        raise invalid("$.workspace", "holds the server's data dir")
    return path


def _normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def _allow_all(call: ToolCallBlock) -> str:
    return "allow"


SessionState = Literal["idle", "running", "waiting_for_approval"]


def _state(session: Session | None, hub: _SessionHub | None) -> SessionState:
    """What ``session.list`` says a session is doing: a task waits on a client's answer,
    a task runs, or nothing runs (a task that has emitted its end counts as done)."""
    if session is None or not session.busy:
        return "idle"
    if hub is not None and hub.open_approvals:
        return "waiting_for_approval"
    if hub is not None and hub.finishing:
        return "idle"
    return "running"


def _read_titles(paths: list[Path]) -> list[str]:
    titles: list[str] = []
    for path in paths:
        try:
            titles.append(" ".join(path.read_text(encoding="utf-8").split())[:200])
        except (OSError, UnicodeDecodeError):
            titles.append("")
    return titles


def _write_title(path: Path, title: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(title + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # the session may have been deleted meanwhile
        logger.warning("gateway: cannot store the title of %s: %s", path.parent.name, exc)


def _output_frame(output: Output) -> str:
    return jsonrpc.encode(jsonrpc.notification_frame("output", to_dict(output)))


def _confine_images(
    blocks: tuple[UserContent, ...], roots: Iterable[Path]
) -> tuple[UserContent, ...]:
    """Image paths resolved against the first root (the workspace) and kept inside one of
    the roots: a client must not make the server read (and send to a model) any file."""
    bases = [r.resolve() for r in roots]
    confined: list[UserContent] = []
    for i, block in enumerate(blocks):
        if isinstance(block, ImageBlock):
            try:
                path = (bases[0] / Path(block.path).expanduser()).resolve()
            except (OSError, ValueError, RuntimeError) as exc:
                raise invalid(f"$.input[{i}].path", f"cannot be used: {exc}") from None
            if not any(path.is_relative_to(base) for base in bases):
                raise invalid(f"$.input[{i}].path", "outside the session's workspace")
            block = attrs.evolve(block, path=str(path))
        confined.append(block)
    return tuple(confined)


async def _replay_records(session: Session, after_seq: int) -> list[Output]:
    """The session's traced outputs with ``seq > after_seq``, from all its trace files in
    order. The current file is synced first, so everything published before this call is
    on disk."""
    with contextlib.suppress(TraceWriteError):
        # A file with a write failure has a hole already; replay what is there.
        await session._sync_trace()
    return await trio.to_thread.run_sync(_read_records, session.directory, after_seq)


def _read_records(directory: Path, after_seq: int) -> list[Output]:
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    numbered = sorted(
        (number, entry)
        for entry in entries
        if (number := trace_file_number(entry.name)) is not None
    )
    records: list[Output] = []
    for _, path in numbered:
        try:
            result = read_trace(path)
        except OSError:
            continue
        records.extend(r for r in result.records if r.seq is not None and r.seq > after_seq)
    return records


# -- per-connection and per-session state ------------------------------------------------------


class _CappedListener(trio.abc.Listener["_CountedStream"]):
    """A listener that holds at most ``sockets.total_tokens`` accepted sockets open at once:
    beyond that, connections wait in the kernel's backlog (no file descriptor spent)."""

    def __init__(self, inner: trio.SocketListener, sockets: trio.CapacityLimiter) -> None:
        self._inner = inner
        self._sockets = sockets

    async def accept(self) -> _CountedStream:
        holder = object()
        await self._sockets.acquire_on_behalf_of(holder)
        try:
            stream = await self._inner.accept()
        except BaseException:
            self._sockets.release_on_behalf_of(holder)
            raise
        return _CountedStream(stream, lambda: self._sockets.release_on_behalf_of(holder))

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CountedStream(trio.abc.HalfCloseableStream):
    """A socket stream that gives its slot back when it is closed (trio's listener loop
    closes every stream its handler was given)."""

    def __init__(self, inner: trio.SocketStream, release: Callable[[], None]) -> None:
        self._inner = inner
        self._release: Callable[[], None] | None = release

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


class _TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; one per call."""

    __slots__ = ("_last", "_rate", "_tokens", "burst")

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last: float | None = None

    def take(self, now: float) -> bool:
        if self._last is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


class _Outbox:
    """Frames waiting for the connection's writer.

    ``put_nowait`` never blocks (session listeners call it from the supervisor's flush).
    The writer takes every queued frame at once (:meth:`take_all`) and reports each send
    (:meth:`sending`, :meth:`sent`). :meth:`behind` is the slow-client rule: frames the
    writer has not taken count only while the writer is stuck in one send, because a
    burst queued while the writer merely waits to be scheduled is sent as soon as it runs.
    Unbounded on purpose: its growth is bounded by that rule.
    """

    def __init__(self) -> None:
        self._queue: deque[str] = deque()
        self._taken = 0
        self.size = 0
        """Characters of the frames queued or taken and not yet sent."""
        self._closed = False
        self._send_began: float | None = None
        self._arrived = trio.Event()
        self._progress = trio.Event()

    @property
    def pending(self) -> int:
        """Frames queued or taken and not yet sent."""
        return len(self._queue) + self._taken

    def put_nowait(self, frame: str) -> None:
        if self._closed:
            return
        self._queue.append(frame)
        self.size += len(frame)
        self._arrived.set()

    async def take_all(self) -> list[str]:
        while not self._queue:
            self._arrived = trio.Event()
            await self._arrived.wait()
        frames = list(self._queue)
        self._queue.clear()
        self._taken += len(frames)
        return frames

    def sending(self, now: float) -> None:
        self._send_began = now

    def sent(self, frame: str) -> None:
        self._taken -= 1
        self.size -= len(frame)
        self._send_began = None
        self._progress.set()
        self._progress = trio.Event()

    def behind(self, now: float, limits: GatewayLimits) -> str | None:
        """Why this client is too far behind to keep its subscriptions, or None."""
        if self.size > limits.max_pending_bytes:
            return f"client too slow: more than {limits.max_pending_bytes} bytes not read"
        stuck = self._send_began is not None and now - self._send_began >= limits.stall_timeout_s
        if stuck and len(self._queue) > limits.max_pending_frames:
            return "client too slow: outputs not read"
        return None

    async def wait_below(self, limit: int) -> None:
        while self.pending >= limit:
            await self._progress.wait()

    def close(self) -> None:
        self._closed = True
        self._queue.clear()


class _Connection:
    """One websocket client: its identity, limits, outbox and subscriptions."""

    def __init__(
        self, ws: WebSocketConnection, identity: str | None, limits: GatewayLimits
    ) -> None:
        self.ws = ws
        self.identity = identity
        """The principal, once authenticated."""
        self.claimed: str | None = None
        """The client id the handshake's ``X-Greenroom-Client`` header named."""
        self.authenticated = trio.Event()
        if identity is not None:
            self.authenticated.set()
        self.limits = limits
        self.initialized = False
        self.calls = 0
        self.auth_failures = 0
        self.close_with: tuple[int, str] | None = None
        self.bucket = _TokenBucket(limits.rate_per_s, limits.burst)
        self.outbox = _Outbox()
        self.subscriptions: dict[str, _Subscription] = {}
        self.after_answer: list[Callable[[], None]] = []
        self.nursery: trio.Nursery | None = None

    def run_after_answer(self) -> None:
        actions, self.after_answer = self.after_answer, []
        for action in actions:
            action()

    def drop_subscriptions(self) -> None:
        for subscription in list(self.subscriptions.values()):
            subscription.close()
        self.outbox.close()


class _Subscription:
    """One connection watching one session. Until :meth:`go_live` it buffers live outputs
    (the replay is being sent); then it queues them on the connection's outbox."""

    def __init__(
        self, connection: _Connection, hub: _SessionHub, after_seq: int, limits: GatewayLimits
    ) -> None:
        self.connection = connection
        self.hub = hub
        self.last_seq = after_seq
        self.closed = False
        self._limits = limits
        self._buffer: list[tuple[int | None, str]] | None = []
        hub.subscriptions.append(self)
        connection.subscriptions[hub.session.id] = self

    def deliver(self, frames: list[tuple[int | None, str]]) -> None:
        """Called from the session's listener: must not block or raise."""
        if self.closed:
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
            outbox.put_nowait(frame)
            if seq is not None:
                self.last_seq = seq

    def go_live(self, last_replayed: int) -> None:
        buffered, self._buffer = self._buffer or [], None
        self.deliver([(s, f) for s, f in buffered if s is None or s > last_replayed])

    def drop(self, reason: str) -> None:
        self.close()
        notice = {"session_id": self.hub.session.id, "reason": reason, "last_seq": self.last_seq}
        self.connection.outbox.put_nowait(
            jsonrpc.encode(jsonrpc.notification_frame("subscription_dropped", notice))
        )

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(ValueError):
            self.hub.subscriptions.remove(self)
        if self.connection.subscriptions.get(self.hub.session.id) is self:
            del self.connection.subscriptions[self.hub.session.id]


@attrs.define
class _PendingApproval:
    event: trio.Event = attrs.field(factory=trio.Event)
    verdict: Verdict | None = None


class _SessionHub:
    """The gateway's one listener on a session: encodes each output once and hands it to
    every subscription; holds the session's pending client approvals."""

    def __init__(
        self, session: Session, on_task_end: Callable[[Session], None] | None = None
    ) -> None:
        self.session = session
        self.subscriptions: list[_Subscription] = []
        self.pending: dict[str, _PendingApproval] = {}
        self.finishing = False
        """The last task (or compaction) has emitted its end and nothing is queued: the
        session is only syncing its trace before it turns idle."""
        self.open_approvals: set[tuple[str, str]] = set()
        """``(origin, call_id)`` of approval requests clients were sent and not answered."""
        self.last_output_at = 0.0
        self._on_task_end = on_task_end
        self._unsubscribe = session.subscribe(self._on_batch)

    def _on_batch(self, batch: list[Output]) -> None:
        # Called inside the supervisor's flush: a failure here must not reach it.
        try:
            self._fan_out(batch)
        except Exception:
            logger.exception("gateway: cannot forward outputs of session %s", self.session.id)

    def _fan_out(self, batch: list[Output]) -> None:
        self.last_output_at = time.time()
        for output in batch:
            if output.origin is None and output.TYPE in ("task_end", "compaction_end"):
                self.finishing = True
            elif output.origin is None and output.TYPE in ("user_msg", "compaction_begin"):
                self.finishing = False
            if isinstance(output, ApprovalRequest | ApprovalDecision):
                key = ("/".join(output.origin or ()), output.call_id)
                if isinstance(output, ApprovalRequest):
                    self.open_approvals.add(key)
                else:
                    self.open_approvals.discard(key)
            elif output.origin is None and output.TYPE == "task_end":
                self.open_approvals.clear()
                if self._on_task_end is not None:
                    self._on_task_end(self.session)
        if not self.subscriptions:
            return
        # Forwarded subagent outputs carry their own session's seq: never deduplicated.
        frames = [(o.seq if o.origin is None else None, _output_frame(o)) for o in batch]
        for subscription in list(self.subscriptions):
            subscription.deliver(frames)

    def has_subscribers(self) -> bool:
        """Whether a client could answer an approval now."""
        return bool(self.subscriptions)

    async def ask(self, call: ToolCallBlock) -> Verdict | None:
        """The session's client approver: None at once when nobody watches; else the
        answer of an ``approve`` call (the broker's timeout bounds the wait)."""
        if not self.subscriptions:
            return None
        pending = _PendingApproval()
        self.pending[call.id] = pending
        try:
            await pending.event.wait()
        finally:
            if self.pending.get(call.id) is pending:
                del self.pending[call.id]
        return pending.verdict

    def answer(self, call_id: str, verdict: Verdict | None) -> bool:
        """Resolve a pending request (None: nobody answers, the broker denies by default);
        False when there is none with this id."""
        pending = self.pending.pop(call_id, None)
        if pending is None:
            return False
        pending.verdict = verdict
        pending.event.set()
        return True

    def close(self) -> None:
        self._unsubscribe()
        for subscription in list(self.subscriptions):
            subscription.drop("session reloaded")
        for call_id in list(self.pending):
            self.answer(call_id, None)


# -- greenroom serve ---------------------------------------------------------------------------


async def run_serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    data_dir: str | Path | None = None,
    token_file: str | Path | None = None,
    defaults: SessionDefaults | None = None,
    approval_timeout_s: float = 300.0,
    limits: GatewayLimits | None = None,
    ready: Callable[[int], None] | None = None,
    console_port: int | None = None,
    tokens_file: str | Path | None = None,
    allowed_origins: Iterable[str] = (),
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> None:
    """``greenroom serve``: open a host on ``data_dir``, serve the gateway on it, print
    ``listening on ws://HOST:PORT/v1`` and the token file on stderr, and serve until
    cancelled or until SIGINT/SIGTERM, then close connections (1001) and the host (which
    interrupts running tasks and flushes their traces). ``ready`` gets the bound port.
    Raises :class:`ConfigurationError` for an unusable token file and OSError when the
    address cannot be bound.

    ``console_port`` (None: no console; 0: any free port) also serves the web console on
    the same host (:mod:`greenroom.actors.console_server`) and prints ``console:
    http://HOST:PORT/?ws=…#token=…`` on stderr. The console is an extra: when its port
    cannot be bound, a warning is printed and the gateway serves without it; when it is
    served its origin is allowed to connect.

    ``tokens_file`` (instead of ``token_file``) gives one principal per line
    (:func:`load_tokens_file`); the console URL then carries no token (the page asks for
    one). ``allowed_origins``: more browser origins allowed to connect.
    ``max_connections`` is lowered, with a notice, to what the file descriptor limit
    allows after the soft limit is raised to the hard one (:func:`connection_cap`)."""
    if tokens_file is not None and token_file is not None:
        raise ConfigurationError("give --token-file or --tokens-file, not both")
    fd_limit = raise_fd_limit()
    cap = connection_cap(max_connections, fd_limit)
    if cap < max_connections:
        print(
            f"greenroom serve: at most {cap} connections (the file descriptor limit is "
            f"{fd_limit}; {FD_RESERVE} are kept for sessions)",
            file=sys.stderr,
            flush=True,
        )
    # Configuration is checked before the host opens: a mistake is one clear error.
    data = await trio.to_thread.run_sync(_resolved, data_dir or default_data_dir())
    session_defaults = defaults or SessionDefaults()
    await trio.to_thread.run_sync(
        check_data_dir_private,
        data,
        session_defaults.workspace_root or session_defaults.workspace_dir,
        session_defaults.workspace_dir,
    )
    token: str | None = None
    tokens: dict[str, str] | None = None
    if tokens_file is not None:
        tokens = await trio.to_thread.run_sync(load_tokens_file, tokens_file)
        token_path = await trio.to_thread.run_sync(token_file_path, data, tokens_file)
    else:
        token_path = await trio.to_thread.run_sync(token_file_path, data, token_file)
        token = await trio.to_thread.run_sync(load_or_create_token, data, token_path)
    async with Host.open(data) as opened:
        gateway = Gateway(
            opened,
            token=token,
            tokens=tokens,
            listen_host=host,
            port=port,
            defaults=defaults,
            approval_timeout_s=approval_timeout_s,
            limits=limits,
            titles=True,
            max_connections=cap,
            allowed_origins=allowed_origins,
        )
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(gateway.run)
            print(f"listening on {gateway.url}", file=sys.stderr, flush=True)
            kind = "tokens" if tokens else "token"
            print(f"{kind} file: {token_path}", file=sys.stderr, flush=True)
            if console_port is not None:
                await _start_console(nursery, gateway, host, console_port, token)
            if ready is not None:
                ready(bound)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    print(
                        f"greenroom serve: {signal.Signals(signum).name}, shutting down",
                        file=sys.stderr,
                        flush=True,
                    )
                    break
            nursery.cancel_scope.cancel()


def _console_hosts(host: str) -> tuple[str, ...]:
    """The names a local browser may use for the console's host: a loopback address is
    also reached as ``localhost`` and the other loopback spelling."""
    loopback = ("127.0.0.1", "localhost", "::1")
    return loopback if host in loopback else (host,)


async def _start_console(
    nursery: trio.Nursery, gateway: Gateway, host: str, port: int, token: str | None
) -> None:
    from greenroom.actors.console_server import ConsoleServer, display_host, url_host

    gateway_port = gateway.port
    console = ConsoleServer(listen_host=host, port=port)
    try:
        await nursery.start(console.run)
    except OSError as exc:
        print(
            f"console: cannot listen on {host}:{port} ({exc}); serving without the console",
            file=sys.stderr,
            flush=True,
        )
        return
    # The page connects from the browser: a wildcard bind is reached through loopback.
    ws_url = f"ws://{url_host(display_host(host))}:{gateway_port}{PATH}"
    for name in _console_hosts(display_host(host)):
        gateway.allow_origin(f"http://{url_host(name)}:{console.port}")
    print(f"console: {console.url(ws_url, token)}", file=sys.stderr, flush=True)
