"""The gateway's configuration: what ``greenroom serve`` reads before it listens.

:class:`SessionDefaults` (how sessions are made), :class:`GatewayLimits` (what one connection
may do), the tokens files (R-SEC-4), the file descriptor budget of the connection cap, and the
confinement of clients' workspaces (R-SEC-5). Everything here is plain data
or blocking file work done before serving or in a worker thread; nothing here does network
I/O.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.port import Approval
from greenroom.actors.tools.workspace import WorkspaceError, identify_workspace
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.jsonrpc import invalid
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool, WorkspaceIdentity

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

CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
CLIENT_SETTABLE_FORBIDDEN = (
    "provider",
    "base_url",
    "sandbox",
    "shell_network",
    "max_image_bytes",
)
"""Settings a client may not choose: ``provider`` and ``base_url`` pick which endpoint gets
the server's API key; ``sandbox`` and ``shell_network`` are the server's confinement of
``run_shell`` (R-SEC-3), and ``max_image_bytes`` bounds what one image costs the server
(R-SEC-8): a client must not loosen either."""

CLIENT_LOWERABLE = ("max_cost_usd", "tree_cost_budget_usd")
"""Cost budgets (R-SHARE-4) a client may set for its sessions, but not above what the
server gives them (``serve --max-cost-usd``): a server's budget is a limit, not a default."""


def check_budgets(client: Mapping[str, Any], server: Mapping[str, Any]) -> None:
    """Refuse (-32602 naming the setting) a client's cost budget that lifts the server's:
    null, or more than it, where the server sets one."""
    for name in CLIENT_LOWERABLE:
        limit = server.get(name)
        if limit is None or name not in client:
            continue
        asked = client[name]
        if asked is None or asked > limit:
            raise invalid(f"$.settings.{name}", f"at most the server's {limit:g}")


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
    ``approve``: ``ask`` (tasks run with ``approve="people"``: each call waits in the trace
    for a person's answer, from any client, whenever they can: R-HITL), ``all`` (every
    call is allowed), ``none`` (every call is denied).
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
    workspace_per_principal: bool = False
    """Confine each principal to ``<workspace root>/<principal id>`` (made 0700 on first
    use), which is also its default workspace; False: the principals share the root and
    the default workspace."""

    def session_provider(self) -> str | ModelProvider | None:
        """The provider of a session the gateway creates or loads now: the factory's new
        object when there is a factory, else the provider's name (None: the default)."""
        if self.provider_factory is not None:
            return self.provider_factory()
        return self.provider

    def task_approval(self) -> Approval:
        """How the gateway's tasks decide their calls (``approve``, :func:`approve_for`)."""
        return approve_for(self.approve)

    def loading(self, principal: str) -> dict[str, Any]:
        """How the gateway loads a stored session for ``principal`` (the options of
        ``Host.load_session``): the server's tools, model and MCP servers, never the
        host's own, and its requests admitted in turn as ``principal``'s (R-SHARE-2); the
        task it takes up (its host stopped, or its callback went with its close) and the
        follow-ups queued under a callback decide their calls as the gateway's tasks do
        (R-HITL-4), not by people alone."""
        return {
            "tools": self.tools,
            "provider": self.session_provider(),
            "mcp_servers": self.mcp_servers,
            "principal": principal,
            "approve": self.task_approval(),
        }


def _allow_all(call: ToolCallBlock) -> str:
    return "allow"


@attrs.frozen(kw_only=True)
class GatewayLimits:
    """Per-connection limits. ``rate_per_s``/``burst``: a token bucket on calls (each batch
    entry and each bad frame is one); beyond it calls answer 429. ``max_frame_bytes``: a
    larger text frame answers -32600; ``max_message_bytes``: the websocket library closes
    the connection (1009) beyond it. ``max_pending_frames``: how many frames the
    connection's writer has not taken may wait while the writer is stuck (no send finished
    for ``stall_timeout_s``: the socket refuses bytes) before its subscriptions are
    dropped; ``max_pending_bytes``: the bound on everything that waits for one connection
    (counted in characters of JSON text), stuck or not (R-SEC-9): an output that would pass
    it drops its subscription, and any other frame (an answer, an error, a notice) that
    would pass it closes the connection (1008). ``send_timeout_s``: how long the writer may
    be stuck in one send (the client reads nothing) before the connection is closed
    (1008, ``client too slow: nothing read for N s``) and what waits for it is let go: the
    bound in time on what a client that stopped reading holds.
    ``settle_timeout_s``: how long ``run`` waits for a session that has emitted
    ``task_end`` to turn idle. ``max_queued_inputs``: per session, the steering its open
    task has not taken yet, and the follow-ups behind it, that clients may queue (each
    apart); ``steer`` and ``follow_up`` beyond it answer 429 (R-SEC-9: a task that waits
    for a person takes none meanwhile).

    Per principal (R-SEC-9), so that one principal cannot lock out another:
    ``max_connections_per_principal`` open connections (a handshake beyond it is refused
    with HTTP 429, an ``initialize`` beyond it answers 429 and closes the connection);
    ``max_sessions_per_principal`` sessions open in this host that it created or was
    granted (``session.create`` beyond it answers 429). Per remote address (IPv4, or the
    /64 of an IPv6 address): after ``max_auth_failures_per_address`` wrong tokens within
    ``auth_failure_window_s``, handshakes from that address are refused with HTTP 429
    (and ``initialize {token}`` answers 429) until the oldest of them is that old; wrong
    tokens are counted for at most ``max_throttled_addresses`` addresses."""

    rate_per_s: float = 50.0
    burst: int = 100
    max_frame_bytes: int = 1 << 20
    max_message_bytes: int = 16 << 20
    max_batch: int = 100
    max_pending_frames: int = 1000
    max_pending_bytes: int = 64 << 20
    stall_timeout_s: float = 2.0
    send_timeout_s: float = 30.0
    max_replay_buffer: int = 10_000
    max_auth_failures: int = 5
    max_connections_per_principal: int = 64
    max_sessions_per_principal: int = 1000
    max_auth_failures_per_address: int = 10
    auth_failure_window_s: float = 60.0
    max_throttled_addresses: int = 10_000
    handshake_timeout_s: float = 10.0
    close_timeout_s: float = 5.0
    settle_timeout_s: float = 2.0
    max_queued_inputs: int = 100


# -- the token -----------------------------------------------------------------------------------


MIN_TOKEN_CHARS = 16
"""The shortest token a token file may hold: the address throttle slows guessing, it does
not make a short token safe on a reachable port."""


def load_or_create_token(data_dir: str | Path, token_file: str | Path | None = None) -> str:
    """The bearer token of ``greenroom serve``.

    With ``token_file``: its content (stripped); a missing file is created with a new token.
    Without: ``<data_dir>/serve.token``, reused when it exists, else created. A created
    file holds ``secrets.token_urlsafe(32)`` and has mode 0600. Raises
    :class:`ConfigurationError` for an empty or unreadable file, or a token shorter than
    :data:`MIN_TOKEN_CHARS`. Blocking (call it before
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
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigurationError(
            f"the token file {path} holds a token shorter than {MIN_TOKEN_CHARS} characters"
        )
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
        if not CLIENT_ID.fullmatch(client_id):
            raise ConfigurationError(
                f"{where}: bad client id (letters, digits and ._:@- only, at most 64)"
            )
        if client_id in tokens:
            raise ConfigurationError(f"{where}: client id {client_id!r} given twice")
        if token in seen:
            raise ConfigurationError(f"{where}: this token is already another client's")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigurationError(f"{where}: token shorter than {MIN_TOKEN_CHARS} characters")
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


# -- workspaces and origins --------------------------------------------------------------------


def directory(value: str | Path) -> Path:
    """``value`` as a directory path; -32602 naming ``$.workspace`` when it is none."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise invalid("$.workspace", f"not a directory: {path}")
    return path


def resolved(value: str | Path) -> Path:
    """``value`` with ``~`` expanded and symlinks followed (blocking)."""
    return Path(value).expanduser().resolve()


PRINCIPAL_DIR_HASH_CHARS = 16
"""Hex digits of the hash of the exact client id in a principal directory's name."""


def principal_directory_name(principal: str) -> str:
    """The name of ``principal``'s own directory under the workspace root: the client id
    itself when it has no capital letter (``alice``), else the id in lower case, ``+`` and
    the first :data:`PRINCIPAL_DIR_HASH_CHARS` hex digits of the SHA-256 of the exact id
    (``Alice`` → ``alice+3bc5…``). Names differ whatever the file system does with case
    (R-SEC-5): on a case-insensitive one (macOS, Windows) ``Alice`` and ``alice`` were
    one directory, shared by two principals. ``+`` is no character of a client id, so a
    hashed name is never another id's plain one; client ids are ASCII, so lower case is
    all a file system folds."""
    if principal == principal.lower():
        return principal
    digest = hashlib.sha256(principal.encode("utf-8")).hexdigest()[:PRINCIPAL_DIR_HASH_CHARS]
    return f"{principal.lower()}+{digest}"


def principal_workspace_root(root: Path, principal: str) -> Path:
    """``principal``'s own workspace root under ``root`` (resolved already), named by
    :func:`principal_directory_name`, made 0700 when missing (blocking): under ``serve
    --workspace-per-principal`` its clients' workspaces must resolve there. -32602 naming
    ``$.workspace`` when the principal id could not name a directory of its own
    (:data:`CLIENT_ID` refuses those already) or the directory cannot be used; a symlink
    in its place is refused, since it could lead into another principal's directory."""
    if not CLIENT_ID.fullmatch(principal) or principal in (".", ".."):
        raise invalid("$.workspace", f"client id {principal!r} cannot name a directory")
    path = root / principal_directory_name(principal)
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        real = path.resolve(strict=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise invalid("$.workspace", f"cannot be used: {reason}") from None
    if real != path or not real.is_dir():
        raise invalid("$.workspace", f"{path} is not a directory of its own (a symlink?)")
    return real


def confined_workspace(value: str, root: Path, data_dir: Path) -> WorkspaceIdentity:
    """A client's workspace, fixed (R-SEC-7): a directory that resolves (symlinks
    followed) under ``root``, is not the file system root and does not hold the data dir
    (R-SEC-5). Relative paths are taken from ``root``. The checks hold for the identity
    returned, which the session is created with: a directory swapped for a symlink after
    them makes the creation fail rather than fix what the path names then. Raises -32602
    naming ``$.workspace``; never OSError."""
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
    try:
        identity = identify_workspace(path, (data_dir,))
    except WorkspaceError as exc:
        raise invalid("$.workspace", str(exc)) from None
    if identity.path != path:
        raise invalid(
            "$.workspace",
            f"{path} was replaced while it was checked (a symlink stands on its path now); "
            "the session was not created",
        )
    return identity


def normal_origin(origin: str) -> str:
    """A browser origin as it is compared: trimmed, no trailing slash, lower case."""
    return origin.strip().rstrip("/").lower()


def approve_for(mode: str) -> Approval:
    """How a task decides its calls under ``serve --approve``, whether a client started
    it, a call loaded it again, or it continues after a restart or a takeover: ``all``
    allows each (a callback), ``none`` leaves them with nobody to decide (denied by
    default), ``ask`` asks people (``"people"``: the request waits in the trace and any
    authorized client answers it, R-HITL-1)."""
    if mode == "all":
        return _allow_all
    return PEOPLE if mode == "ask" else None
