"""OAuth tokens of HTTP MCP servers (R-MCP-5): where they are kept, and how a session's
requests carry them.

``greenroom mcp login NAME`` (:mod:`greenroom.actors.tools.mcp_login`) runs the
authorization code flow once and keeps what it got in the data dir:
``<data dir>/mcp/oauth.json`` (:data:`STORE_NAME`), mode 0600 in a directory of mode 0700
(R-SEC-5), one entry per server URL — the registered client, the authorization server's
token endpoint, the resource the tokens are for (RFC 8707), and the tokens with the time
the access token expires.

Every connection to an HTTP server (streamable or legacy SSE) whose configuration gives no
``Authorization`` header of its own sends its requests through :class:`StoredTokenAuth`:
the stored access token as a bearer token, refreshed first when it has expired, and
refreshed once more when the server answers 401 (the new tokens are stored at once, so the
next process starts from them). When there is no usable token — none stored and the server
answers 401, or a refresh the authorization server refuses — the request fails with
:class:`McpLoginNeeded`, whose message tells the user to run ``greenroom mcp login NAME``;
the connection reports it as a server that could not be started (R-MCP-4, R-MCP-6). A
server that never answers 401 never needs a token: its requests go out as they are.

Blocking file work (:class:`TokenStore`) runs in worker threads; writes hold an ``flock``
on a lock file beside the store, so two processes that refresh at once keep each other's
entries.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs
import httpx2
import trio

from greenroom.actors.runtime.disk import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE
from greenroom.actors.tools.mcp_bounds import bound_answers

__all__ = [
    "STORE_NAME",
    "McpLoginNeeded",
    "OAuthEntry",
    "StoredTokenAuth",
    "TokenStore",
    "TokenStoreError",
    "auth_for",
    "sends_own_authorization",
    "store_path",
]

STORE_NAME = "oauth.json"
"""The token store's file name, in ``<data dir>/mcp/``."""

REFRESH_MARGIN_S = 30.0
"""An access token this close to its expiry is refreshed before it is sent, so it does not
expire on the way."""

_STORE_VERSION = 1

log = logging.getLogger("greenroom.mcp")


def store_path(data_dir: Path) -> Path:
    """The token store of the data dir ``data_dir``."""
    return data_dir / "mcp" / STORE_NAME


class TokenStoreError(Exception):
    """The token store cannot be read or written; the message names it and says why."""


class McpLoginNeeded(Exception):
    """An HTTP MCP server asks for OAuth authorization and there is no usable token: the
    message (which begins with what happened, in words, and ends with the command to run)
    is what the user and the model see after ``MCP server 'NAME' could not be started: ``."""


@attrs.frozen(kw_only=True)
class OAuthEntry:
    """What the store keeps for one server URL."""

    server_url: str
    name: str
    """The server's name in the configuration it was logged in with (informational: the
    entry belongs to the URL, whatever a configuration calls the server)."""
    token_endpoint: str
    resource: str | None
    """The RFC 8707 resource indicator the tokens were asked for (sent again on refresh)."""
    issuer: str | None
    client: Mapping[str, Any]
    """The registration as the authorization server answered it (RFC 7591): ``client_id``,
    and ``client_secret`` with ``token_endpoint_auth_method`` when it gave one."""
    access_token: str
    refresh_token: str | None
    scope: str | None
    expires_at: float | None
    """Seconds since the epoch; None when the server gave no lifetime."""

    def expired(self, now: float) -> bool:
        """Whether the access token is past (or within :data:`REFRESH_MARGIN_S` of) its
        expiry."""
        return self.expires_at is not None and now >= self.expires_at - REFRESH_MARGIN_S

    def to_json(self) -> dict[str, Any]:
        """The entry as the store's file holds it."""
        return {
            "name": self.name,
            "token_endpoint": self.token_endpoint,
            "resource": self.resource,
            "issuer": self.issuer,
            "client": dict(self.client),
            "tokens": {
                "access_token": self.access_token,
                "token_type": "Bearer",
                "refresh_token": self.refresh_token,
                "scope": self.scope,
                "expires_at": self.expires_at,
            },
        }

    @classmethod
    def from_json(cls, server_url: str, data: Any) -> OAuthEntry:
        """An entry read back; raises ValueError saying what is wrong with it."""
        if not isinstance(data, dict):
            raise ValueError("not an object")
        tokens = data.get("tokens")
        client = data.get("client")
        if not isinstance(tokens, dict) or not isinstance(client, dict):
            raise ValueError("no tokens or no client")
        if not isinstance(client.get("client_id"), str):
            raise ValueError("the client has no client_id")
        expires_at = tokens.get("expires_at")
        if expires_at is not None and not isinstance(expires_at, int | float):
            raise ValueError("expires_at is not a number")
        return cls(
            server_url=server_url,
            name=_text(data, "name") or "",
            token_endpoint=_required(data, "token_endpoint"),
            resource=_text(data, "resource"),
            issuer=_text(data, "issuer"),
            client=client,
            access_token=_required(tokens, "access_token"),
            refresh_token=_text(tokens, "refresh_token"),
            scope=_text(tokens, "scope"),
            expires_at=None if expires_at is None else float(expires_at),
        )


def _text(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} is not a string")
    return value


def _required(data: Mapping[str, Any], key: str) -> str:
    value = _text(data, key)
    if not value:
        raise ValueError(f"{key} is missing")
    return value


class TokenStore:
    """The token file (blocking calls: run them in a worker thread). Its directory is made
    0700 and the file 0600, whatever the umask; the file is replaced whole, so a reader
    never sees half of it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, server_url: str) -> OAuthEntry | None:
        """The entry of ``server_url``, or None when there is none. Raises
        :class:`TokenStoreError` for a store (or an entry) that cannot be used."""
        servers = self._servers()
        if server_url not in servers:
            return None
        try:
            return OAuthEntry.from_json(server_url, servers[server_url])
        except ValueError as exc:
            raise TokenStoreError(
                f"{self.path}: the entry of {server_url} is unusable ({exc})"
            ) from None

    def save(self, entry: OAuthEntry) -> None:
        """Put ``entry`` in place of the server URL's entry; the others stay as they are.
        Raises :class:`TokenStoreError`."""
        with self._locked():
            servers = self._servers()
            servers[entry.server_url] = entry.to_json()
            self._write({"version": _STORE_VERSION, "servers": servers})

    def _servers(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenStoreError(f"{self.path}: cannot be read: {_reason(exc)}") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise TokenStoreError(f"{self.path}: not a token store (not JSON: {exc})") from None
        servers = data.get("servers") if isinstance(data, dict) else None
        if not isinstance(servers, dict):
            raise TokenStoreError(f"{self.path}: not a token store (no servers object)")
        return servers

    def _directory(self) -> Path:
        directory = self.path.parent
        try:
            # The data dir too, when this makes it (R-SEC-5).
            directory.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
            directory.mkdir(exist_ok=True, mode=PRIVATE_DIR_MODE)
            if directory.stat().st_mode & 0o077:  # made earlier, or by a wider umask
                directory.chmod(PRIVATE_DIR_MODE)
        except OSError as exc:
            raise TokenStoreError(f"{directory}: cannot be made private: {_reason(exc)}") from None
        return directory

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock_path = self._directory() / f"{self.path.name}.lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
        except OSError as exc:
            raise TokenStoreError(f"{lock_path}: cannot be opened: {_reason(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _write(self, data: dict[str, Any]) -> None:
        raw = json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"
        temporary = self.path.with_name(f".{self.path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
            try:
                os.fchmod(fd, PRIVATE_FILE_MODE)  # whatever the umask
                view = memoryview(raw)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise TokenStoreError(f"{self.path}: cannot be written: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def sends_own_authorization(headers: Iterable[tuple[str, str]]) -> bool:
    """Whether a configuration's ``headers`` hold an ``Authorization`` header: that server
    is given its credentials by hand, and no stored OAuth token is sent in their place."""
    return any(key.lower() == "authorization" for key, _ in headers)


def auth_for(name: str, server_url: str, headers: Iterable[tuple[str, str]],
             store_file: Path) -> StoredTokenAuth | None:  # fmt: skip
    """The OAuth of a connection to the HTTP server ``server_url`` (configured as ``name``
    with ``headers``), through the token store ``store_file``; None when the configuration
    gives its own ``Authorization`` header."""
    if sends_own_authorization(headers):
        return None
    return StoredTokenAuth(name, server_url, TokenStore(store_file))


def _login_hint(name: str) -> str:
    return f"run `greenroom mcp login {name}`"


class StoredTokenAuth(httpx2.Auth):
    """The requests of one connection to an HTTP MCP server, with its stored OAuth token
    (see the module docstring). Reads the store when the connection starts and again
    before any refresh (another process may have refreshed or logged in meanwhile); one
    refresh at a time per connection. Raises :class:`McpLoginNeeded` from a request that
    cannot be authorized, :class:`TokenStoreError` when the store cannot be used."""

    def __init__(self, name: str, server_url: str, store: TokenStore) -> None:
        self._name = name
        self._url = server_url
        self._store = store
        self._entry: OAuthEntry | None = None
        self._loaded = False
        self._lock = trio.Lock()
        self.problem: str | None = None
        """Why the last request could not be authorized (the message of the
        :class:`McpLoginNeeded` or :class:`TokenStoreError` it raised), or None."""

    async def _load(self) -> OAuthEntry | None:
        self._entry = await trio.to_thread.run_sync(self._store.load, self._url)
        self._loaded = True
        return self._entry

    async def async_auth_flow(
        self, request: httpx2.Request
    ) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        """Send ``request`` with the token (see the class docstring); remember in
        :attr:`problem` why it could not be authorized before raising."""
        flow = self._flow(request)
        try:
            outgoing = await flow.__anext__()
            while True:
                response = yield outgoing
                outgoing = await flow.asend(response)
        except StopAsyncIteration:
            return
        except (McpLoginNeeded, TokenStoreError) as exc:
            self.problem = str(exc)  # for the calls the closing transport fails
            raise
        finally:
            await flow.aclose()

    async def _flow(
        self, request: httpx2.Request
    ) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        entry = self._entry if self._loaded else await self._load()
        refused: str | None = None  # the token the server answered 401 to

        def stale(candidate: OAuthEntry | None) -> bool:
            return candidate is not None and (
                candidate.access_token == refused or candidate.expired(time.time())
            )

        while True:
            if stale(entry):
                async with self._lock:
                    entry = self._entry
                    if stale(entry):  # nobody here refreshed it while this request waited
                        entry = await self._load()  # another process may have
                    if entry is not None and stale(entry):
                        response = yield _refresh_request(entry, self._name)
                        # Whatever its type (the client bounds only what MCP servers send).
                        await bound_answers(response)
                        await response.aread()
                        entry = self._entry = _refreshed(entry, response, self._name)
                        try:
                            await trio.to_thread.run_sync(self._store.save, entry)
                        except TokenStoreError as exc:
                            # This connection goes on with the new token; the next
                            # process may have to log in again.
                            log.warning("MCP server %r: its refreshed OAuth token could not "
                                        "be stored: %s", self._name, exc)  # fmt: skip
            if entry is None:
                response = yield request
                if response.status_code == 401:
                    raise McpLoginNeeded(
                        f"it asks for OAuth authorization (HTTP 401) and no token is stored "
                        f"for {self._url}: {_login_hint(self._name)}"
                    )
                return
            request.headers["Authorization"] = f"Bearer {entry.access_token}"
            response = yield request
            if response.status_code != 401:
                return
            if refused is not None:
                raise McpLoginNeeded(
                    f"it refused its OAuth token even after a refresh (HTTP 401): "
                    f"{_login_hint(self._name)}"
                )
            refused = entry.access_token


def _refresh_request(entry: OAuthEntry, name: str) -> httpx2.Request:
    """The refresh-token grant for ``entry`` (RFC 6749 §6), authenticated as the client
    was registered (RFC 7591): no secret, ``client_secret_post`` or ``client_secret_basic``.
    Raises :class:`McpLoginNeeded` (naming the server ``name``) when there is nothing to
    refresh with."""
    if entry.refresh_token is None:
        raise McpLoginNeeded(
            f"its OAuth access token is no longer valid and there is no refresh token: "
            f"{_login_hint(name)}"
        )
    client_id = str(entry.client["client_id"])
    data = {"grant_type": "refresh_token", "refresh_token": entry.refresh_token,
            "client_id": client_id}  # fmt: skip
    if entry.resource:
        data["resource"] = entry.resource
    headers = {"Accept": "application/json"}
    secret = entry.client.get("client_secret")
    method = entry.client.get("token_endpoint_auth_method")
    if isinstance(secret, str) and secret:
        if method == "client_secret_basic":
            pair = f"{quote(client_id, safe='')}:{quote(secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            data["client_secret"] = secret
    return httpx2.Request("POST", entry.token_endpoint, data=data, headers=headers)


def _refreshed(entry: OAuthEntry, response: httpx2.Response, name: str) -> OAuthEntry:
    """``entry`` with the tokens of a refresh response; raises :class:`McpLoginNeeded`
    saying why when the authorization server refused."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200 or not isinstance(body, dict):
        reason = f"HTTP {response.status_code}"
        if isinstance(body, dict) and isinstance(body.get("error"), str):
            reason = str(body["error"])
            if isinstance(body.get("error_description"), str):
                reason += f": {body['error_description']}"
        raise McpLoginNeeded(
            f"its OAuth access token is no longer valid and the authorization server "
            f"refused to refresh it ({reason}): {_login_hint(name)}"
        )
    access = body.get("access_token")
    token_type = body.get("token_type", "Bearer")
    if not isinstance(access, str) or not access or str(token_type).lower() != "bearer":
        raise McpLoginNeeded(
            f"the authorization server answered the refresh of its OAuth token without a "
            f"bearer access token: {_login_hint(name)}"
        )
    expires_in = body.get("expires_in")
    refresh = body.get("refresh_token")
    scope = body.get("scope")
    return attrs.evolve(
        entry,
        access_token=access,
        # RFC 6749 §6: a server that does not rotate the refresh token leaves it out.
        refresh_token=refresh if isinstance(refresh, str) and refresh else entry.refresh_token,
        scope=scope if isinstance(scope, str) else entry.scope,
        expires_at=time.time() + float(expires_in)
        if isinstance(expires_in, int | float) and not isinstance(expires_in, bool)
        else None,
    )
