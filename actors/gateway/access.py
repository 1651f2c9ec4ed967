"""Who a client is and what it may see (R-SEC-4): the principals' tokens, and the sessions
each principal created or was granted; and who may connect (R-SEC-9): each principal's
open connections, and the wrong tokens of each remote address.

The principal that creates a session through the gateway is kept in ``owner.txt`` next to
the session's ``session.json`` (:func:`store_owner`): a gateway that starts again on the
data dir (after a restart, a crash) grants each stored session to its owner again
(:func:`stored_owners`), so a client finds its sessions, and the requests waiting in them
for a person, whatever happened to the process (R-SEC-4, R-HITL-2).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import re
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

from greenroom.actors.gateway.config import CLIENT_ID, DEFAULT_CLIENT, GatewayLimits
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError

OWNER_FILE = "owner.txt"
"""The principal that created a session through the gateway, next to its ``session.json``."""


class Principals:
    """The known tokens and the principal each names. ``token`` is the one token of the
    principal ``default``; ``tokens`` maps client ids to their tokens (give one or both).
    Raises :class:`ConfigurationError` when no usable token is given, when a client id is
    not one (:data:`CLIENT_ID`: its stored owner would be read back as another, or as
    none) and when one token is given to two principals (R-SEC-4: a token names one
    client), as ``load_tokens_file`` does for a file."""

    def __init__(self, *, token: str | None, tokens: Mapping[str, str] | None) -> None:
        principals = dict(tokens or {})
        if token is not None:
            principals.setdefault(DEFAULT_CLIENT, token)
        if not principals or not all(principals.values()):
            raise ConfigurationError("the gateway needs a non-empty token")
        for client_id in principals:
            if not isinstance(client_id, str) or not CLIENT_ID.fullmatch(client_id):
                raise ConfigurationError(
                    f"bad client id {client_id!r}: letters, digits and ._:@- only, at most 64"
                )
        holders: dict[str, str] = {}
        for client_id, secret in principals.items():
            # Stripped, as a header's token is: "t" and "t " are one token on a handshake.
            other = holders.setdefault(secret.strip(), client_id)
            if other != client_id:
                # Never the token itself: the message may reach a log.
                raise ConfigurationError(
                    f"the clients {other!r} and {client_id!r} have the same token: "
                    "each token names one client"
                )
        self._secrets = tuple(
            (secret.encode("utf-8"), client_id) for client_id, secret in principals.items()
        )

    def of(self, token: bytes) -> str | None:
        """The principal whose token this is. Every known token is compared, in constant
        time, so the time taken says nothing about which (if any) matched."""
        found: str | None = None
        for secret, principal in self._secrets:
            if hmac.compare_digest(token, secret):
                found = principal
        return found


class Grants:
    """The sessions each principal created or was granted. In memory: what outlives the
    gateway is each session's owner, stored apart (:func:`store_owner`) and granted again
    when a gateway starts (:func:`stored_owners`)."""

    def __init__(self) -> None:
        self._grants: dict[str, set[str]] = {}

    def grant(self, client_id: str, session_id: str) -> None:
        """Let ``client_id`` see and steer ``session_id``."""
        self._grants.setdefault(client_id, set()).add(session_id)

    def revoke(self, client_id: str, session_id: str) -> None:
        """Forget that ``client_id`` holds ``session_id`` (a session deleted again)."""
        owned = self._grants.get(client_id)
        if owned is not None:
            owned.discard(session_id)
            if not owned:
                del self._grants[client_id]

    def owned(self, client_id: str) -> frozenset[str]:
        """The sessions ``client_id`` created or was granted."""
        return frozenset(self._grants.get(client_id, ()))

    def holds(self, client_id: str, session_id: str) -> bool:
        """Whether ``client_id`` created or was granted ``session_id`` (without copying its
        sessions, as :meth:`owned` does: this is asked at every call)."""
        return session_id in self._grants.get(client_id, ())

    def count(self, client_id: str) -> int:
        """How many sessions ``client_id`` created or was granted."""
        return len(self._grants.get(client_id, ()))

    def holders(self, session_id: str) -> frozenset[str]:
        """The principals that created or were granted ``session_id``."""
        return frozenset(c for c, owned in self._grants.items() if session_id in owned)

    def anyone_owns(self, session_id: str) -> bool:
        """Whether some principal created or was granted ``session_id``."""
        return any(session_id in owned for owned in self._grants.values())


def no_such_session(session_id: str) -> RpcError:
    """404 for ``session_id``, a session nobody has."""
    return RpcError(jsonrpc.NOT_FOUND, f"no session {jsonrpc.echo(session_id)}")


class NotYours(RpcError):
    """403 for a session that exists but is another principal's (CONTRACT's "403
    forbidden"): the AG-UI endpoint creates a thread for an unknown id, never for this
    one."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            jsonrpc.FORBIDDEN, f"session {jsonrpc.echo(session_id)} belongs to another client"
        )


def store_owner(session_dir: Path, principal: str) -> None:
    """Keep ``principal`` as the owner of the session stored in ``session_dir`` (mode
    0600, replaced at once: a reader sees the old file or the new one). Blocking; raises
    OSError when the directory cannot be written."""
    path = session_dir / OWNER_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (principal + "\n").encode("utf-8"))
    finally:
        os.close(fd)
    tmp.replace(path)


def stored_owners(sessions_dir: Path) -> dict[str, str]:
    """Session id → the owner stored for it, for every session under ``sessions_dir`` that
    has one. A file that is unreadable or names no valid principal is skipped: that session
    stays hidden from every client rather than be given to the wrong one. Blocking."""
    owners: dict[str, str] = {}
    try:
        entries = list(os.scandir(sessions_dir))
    except OSError:
        return owners
    for entry in entries:
        try:
            with open(os.path.join(entry.path, OWNER_FILE), encoding="utf-8") as file:
                principal = file.read(200).strip()
        except (OSError, UnicodeDecodeError):
            continue
        if CLIENT_ID.fullmatch(principal):
            owners[entry.name] = principal
    return owners


WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Listen hosts that bind every address (no name of their own to answer to)."""

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))(?::(\d{1,5}))?")
_MAX_ECHOED_HOST = 100


def host_header_name(value: str | bytes) -> str | None:
    """The host name a ``Host`` header (``host[:port]``) names: lower case, without its
    port, an IPv6 address without its brackets, without a final dot; None when the value
    is no ``host[:port]``."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    match = _HOST.fullmatch(text.strip())
    if match is None:
        return None
    return match.group(1).strip("[]").rstrip(".").lower()


def normal_host_name(text: str) -> str:
    """A host name an owner allows (``serve --allow-host NAME``), as it is compared: lower
    case, no final dot, an IPv6 address without brackets. Raises
    :class:`ConfigurationError` for anything else (a port, a scheme, a path, ``*``), which
    would match no ``Host`` header and allow nothing."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(text.strip().strip("[]")))
    match = _HOST.fullmatch(text.strip())
    if match is None or match.group(2) is not None:
        raise ConfigurationError(
            f"expected a host name without a port or scheme (myhost.lan), got {text!r}"
        )
    return match.group(1).strip("[]").rstrip(".").lower()


class HostNames:
    """The names the gateway and its console answer to, checked against each request's
    ``Host`` header before anything else (R-SEC-4: DNS rebinding). A page of
    ``evil.example`` whose name the attacker then points at 127.0.0.1 is, for the
    browser, of the same origin as ``http://evil.example:PORT``, which is this server:
    the browser sends it no foreign ``Origin`` on a plain GET, but its ``Host`` header
    names ``evil.example``. Allowed: ``localhost``, the listen host (unless it binds
    every address), the names given (:meth:`add`; ``serve --allow-host``), and any IP
    address — a page reached by an address is that address's own, never a rebinding.
    A request without a ``Host`` header (HTTP/1.0, not a browser) is let through. No
    I/O."""

    def __init__(self, listen_host: str, names: Iterable[str] = ()) -> None:
        self._names = {"localhost"}
        if listen_host not in WILDCARD_HOSTS and not _is_address(listen_host):
            self.add(listen_host)
        for name in names:
            self.add(name)

    @property
    def names(self) -> tuple[str, ...]:
        """The names allowed besides IP addresses, sorted."""
        return tuple(sorted(self._names))

    def add(self, name: str) -> None:
        """Allow ``name`` (:func:`normal_host_name`; raises ConfigurationError)."""
        self._names.add(normal_host_name(name))

    def allows(self, header: str | bytes | None) -> bool:
        """Whether a request whose ``Host`` header is ``header`` (None: none) is for this
        server."""
        if header is None:
            return True
        name = host_header_name(header)
        if name is None:
            return False
        return name in self._names or _is_address(name)

    def refusal(self, header: str | bytes | None) -> str:
        """Why a request with this ``Host`` header is refused (421), naming it (cut)."""
        text = header.decode("latin-1") if isinstance(header, bytes) else str(header)
        if len(text) > _MAX_ECHOED_HOST:
            text = text[:_MAX_ECHOED_HOST] + "…"
        return (
            f"misdirected request: this server does not answer to the host {text!r} "
            f"(it answers to {', '.join(self.names)} and IP addresses; a name of its "
            "own is allowed with serve --allow-host NAME)"
        )


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


class ClaimRefused(Exception):
    """An ``X-Greenroom-Client`` header refused: the answer's ``status`` and ``reason``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def claimed_client(named: str | None) -> str | None:
    """The client id an ``X-Greenroom-Client`` header's value ``named`` claims (None
    without the header). Raises :class:`ClaimRefused` (400) when it is no client id."""
    if named is None:
        return None
    claimed = named.strip()
    if not CLIENT_ID.fullmatch(claimed):
        raise ClaimRefused(400, "bad X-Greenroom-Client header")
    return claimed


def check_claim(claimed: str | None, principal: str) -> None:
    """Raises :class:`ClaimRefused` (403) when ``claimed`` (:func:`claimed_client`) names
    another principal than the token's ``principal``: the header may only repeat it, on
    the websocket handshake and the HTTP endpoints alike (R-SEC-4)."""
    if claimed is not None and claimed != principal:
        raise ClaimRefused(403, "forbidden: X-Greenroom-Client names another principal")


def address_key(address: str) -> str:
    """The remote address wrong tokens are counted against: an IPv4 address itself (also
    when written as IPv4-mapped IPv6), an IPv6 address's /64 (one host or site usually
    holds a whole /64, and could otherwise try from each address of it); anything that
    is not an IP address as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Admission:
    """Who may connect, beyond the gateway's cap on all connections (R-SEC-9).

    Connections: each principal holds at most ``limits.max_connections_per_principal``
    open connections; :meth:`admit` takes a place, :meth:`release` gives it back (once
    per successful :meth:`admit`).

    Wrong tokens: :meth:`failed` counts one against a remote address (an
    :func:`address_key`); once an address has ``max_auth_failures_per_address`` of them
    within the last ``auth_failure_window_s`` seconds, :meth:`throttled` says how long it
    must wait before the oldest of them leaves the window. Refused attempts are not
    counted: an address gets that many guesses per window, however fast it tries.
    Addresses are counted apart, so one address cannot throttle another; at most
    ``max_throttled_addresses`` are remembered (the one counted least recently is
    forgotten first). Times are the caller's clock (``trio.current_time()``). No I/O.
    """

    def __init__(self, limits: GatewayLimits) -> None:
        self._limits = limits
        self._connections: dict[str, int] = {}
        self._failures: dict[str, deque[float]] = {}

    def connections_of(self, principal: str) -> int:
        """How many connections ``principal`` holds."""
        return self._connections.get(principal, 0)

    def admit(self, principal: str) -> bool:
        """Take one of ``principal``'s places; False (nothing taken) when it has none left."""
        held = self._connections.get(principal, 0)
        if held >= self._limits.max_connections_per_principal:
            return False
        self._connections[principal] = held + 1
        return True

    def release(self, principal: str) -> None:
        """Give back a place :meth:`admit` took."""
        held = self._connections.get(principal, 0) - 1
        if held > 0:
            self._connections[principal] = held
        else:
            self._connections.pop(principal, None)

    def throttled(self, address: str, now: float) -> float | None:
        """Seconds until ``address`` may try a token again, or None when it may now."""
        failures = self._failures.get(address)
        if failures is None:
            return None
        window = self._limits.auth_failure_window_s
        while failures and failures[0] <= now - window:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        if len(failures) < self._limits.max_auth_failures_per_address:
            return None
        return failures[0] + window - now

    def failed(self, address: str, now: float) -> None:
        """Count a wrong token from ``address`` at ``now``."""
        failures = self._failures.pop(address, None)
        if failures is None:
            failures = deque(maxlen=max(1, self._limits.max_auth_failures_per_address))
            while self._failures and len(self._failures) >= self._limits.max_throttled_addresses:
                del self._failures[next(iter(self._failures))]
        failures.append(now)
        self._failures[address] = failures  # last in order: counted most recently


class Seats:
    """The gateway's open connections against its cap (``max_connections``), websocket
    and HTTP alike (R-SEC-4): :meth:`take` one for each connection admitted,
    :meth:`give_back` it when the connection ends. No I/O."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.taken = 0

    @property
    def full(self) -> bool:
        """Whether every seat is taken."""
        return self.taken >= self.cap

    def take(self) -> None:
        """Take a seat (the caller checked :attr:`full`)."""
        self.taken += 1

    def give_back(self) -> None:
        """Give back a seat :meth:`take` took."""
        self.taken -= 1
