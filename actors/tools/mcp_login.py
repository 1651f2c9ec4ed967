"""Logging in to an HTTP MCP server that asks for OAuth (R-MCP-5): the authorization code
flow with PKCE and dynamic client registration, as the MCP authorization specification
says, done by the SDK's client (``mcp.client.auth.OAuthClientProvider``, anyio on trio).

:func:`login` connects to the server as a session would; its 401 starts the flow: the
protected resource metadata (RFC 9728, from the ``WWW-Authenticate`` header or the
``.well-known`` URLs), the authorization server's metadata (RFC 8414), a registration
(RFC 7591) whose redirect URI is a loopback listener on ``127.0.0.1`` (RFC 8252), the
authorization URL (PKCE S256, a random ``state``, the RFC 8707 ``resource``) handed to
``show`` for a person to open, the code read from the browser's redirect, and the token
exchange. The connection then initializes with the new token (proof that it works) and
the registered client, the token endpoint and the tokens are kept in the data dir's token
store (:mod:`~greenroom.actors.tools.mcp_auth`), where sessions take them from.

Every failure is a :class:`McpLoginError` saying what went wrong in words.
"""

from __future__ import annotations

import contextlib
import html
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import h11
import httpx2
import trio
from mcp import ClientSession
from mcp.client.auth import (
    AuthorizationCodeResult,
    OAuthClientProvider,
    OAuthFlowError,
)
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientInformationFull, OAuthClientMetadata, OAuthToken
from mcp.shared.exceptions import MCPError

from greenroom.actors.tools.mcp_auth import (
    OAuthEntry,
    TokenStore,
    TokenStoreError,
    sends_own_authorization,
    store_path,
)
from greenroom.actors.tools.mcp_bounds import login_http_client
from greenroom.protocols.mcp_config import McpServerConfig

__all__ = [
    "CALLBACK_PATH",
    "LOGIN_WAIT_S",
    "LoginResult",
    "McpLoginError",
    "login_to_mcp_server",
    "mcp_login_problem",
]

LOGIN_WAIT_S = 600.0
"""How long :func:`login` waits for the browser to come back to the redirect URI."""

CALLBACK_PATH = "/callback"
"""The path of the loopback redirect URI."""

REQUEST_READ_S = 10.0
"""How long one connection to the loopback listener may take to send its request."""

MAX_REQUEST_BYTES = 16 * 1024
"""The largest request the loopback listener reads (a redirect is a few hundred bytes)."""


class McpLoginError(Exception):
    """The login did not complete; the message says why."""


@attrs.frozen(kw_only=True)
class LoginResult:
    """What :func:`login` did."""

    stored: bool
    """Whether tokens were stored: False when the server never asked for authorization."""
    path: Path
    """The token store."""
    tools: int | None
    """How many tools the server listed with the new token; None when listing failed."""
    problem: str | None = None
    """Why the session opened with the new tokens failed (they are stored all the same)."""


def mcp_login_problem(config: McpServerConfig) -> str | None:
    """Why no login is used for the server ``config`` (a stdio server, one configured with
    its own ``Authorization`` header), or None."""
    if config.transport == "stdio" or config.url is None:
        return (f"server {config.name!r} runs as a command (stdio): OAuth is for servers "
                "reached over HTTP")  # fmt: skip
    if sends_own_authorization(config.headers):
        return (f"server {config.name!r} is configured with its own Authorization header: "
                "it is sent as it is, and no login is used")  # fmt: skip
    return None


async def login_to_mcp_server(
    config: McpServerConfig,
    data_dir: Path,
    show: Callable[[str, str], Awaitable[None]],
    *,
    wait_s: float = LOGIN_WAIT_S,
) -> LoginResult:
    """Run the flow for the HTTP server ``config`` and keep its outcome in the token store
    of the data dir ``data_dir``. ``show(url, redirect_uri)`` is awaited with the
    authorization URL for a person to open (and the loopback address the browser comes
    back to). Waits at most ``wait_s`` for the browser. Raises :class:`McpLoginError`."""
    problem = mcp_login_problem(config)
    if problem is not None or config.url is None:
        raise McpLoginError(problem or "no URL")
    store = TokenStore(store_path(data_dir))
    # The SDK logs a failed flow with its traceback; the failure is reported here instead.
    sdk_log = logging.getLogger("mcp")
    if not any(isinstance(h, logging.NullHandler) for h in sdk_log.handlers):
        sdk_log.addHandler(logging.NullHandler())
    async with _Loopback.open() as loopback:
        storage = _Received()

        async def redirect(url: str) -> None:
            loopback.expect(url)
            await show(url, loopback.redirect_uri)

        async def callback() -> AuthorizationCodeResult:
            with trio.move_on_after(wait_s):
                return await loopback.answer()
            raise McpLoginError(
                f"the browser did not come back to {loopback.redirect_uri} within "
                f"{wait_s:g} s"
            )

        provider = OAuthClientProvider(
            server_url=config.url,
            client_metadata=OAuthClientMetadata(
                redirect_uris=[loopback.redirect_uri],  # type: ignore[list-item]
                client_name="greenroom",
                grant_types=["authorization_code", "refresh_token"],
                response_types=["code"],
            ),
            storage=storage,
            redirect_handler=redirect,
            callback_handler=callback,
        )
        tools, problem = await _connect(config, provider)
    if storage.tokens is None:
        if problem is not None:
            raise McpLoginError(problem)
        return LoginResult(stored=False, path=store.path, tools=tools)
    entry = _entry(config, provider, storage)
    try:
        await trio.to_thread.run_sync(store.save, entry)
    except TokenStoreError as exc:
        raise McpLoginError(str(exc)) from None
    return LoginResult(stored=True, path=store.path, tools=tools, problem=problem)


async def _connect(
    config: McpServerConfig, provider: OAuthClientProvider
) -> tuple[int | None, str | None]:
    """Initialize a session with the server through ``provider`` (whose flow runs on the
    server's 401) and count its tools: (tools, None), or (None, why not)."""
    assert config.url is not None
    headers = dict(config.headers) or None
    try:
        async with contextlib.AsyncExitStack() as stack:
            # The flow reads each answer of the authorization server whole: every one is
            # bounded, as a session's messages are (R-SEC-1).
            if config.transport == "sse":
                streams = await stack.enter_async_context(
                    sse_client(config.url, headers=headers, auth=provider,
                               httpx_client_factory=login_http_client)
                )  # fmt: skip
            else:
                client = await stack.enter_async_context(
                    login_http_client(headers=headers, auth=provider)
                )
                streams = await stack.enter_async_context(
                    streamable_http_client(config.url, http_client=client)
                )
            session = await stack.enter_async_context(ClientSession(*streams))
            await session.initialize()
            listed = await session.list_tools()
            return len(listed.tools), None
    except (Exception, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and exc.subgroup(
            (KeyboardInterrupt, SystemExit)
        ):
            raise
        return None, _describe(exc, config.url)


def _describe(exc: BaseException, url: str) -> str:
    """What went wrong, in words: the first cause inside exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        leaves = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)]
        exc = (leaves or list(exc.exceptions))[0]
    if isinstance(exc, McpLoginError):
        return str(exc)
    if isinstance(exc, OAuthFlowError):
        return f"the OAuth flow failed: {exc}"
    if isinstance(exc, httpx2.TimeoutException):
        return f"{url} did not answer in time"
    if isinstance(exc, httpx2.HTTPError):
        reason = str(exc) or type(exc).__name__
        return f"cannot reach {url}: {reason}"
    if isinstance(exc, MCPError):
        return f"the server refused the session: {exc.message} (code {exc.code})"
    if isinstance(exc, OSError):
        return f"cannot reach {url}: {exc.strerror or exc}"
    return " ".join(str(exc).split()) or type(exc).__name__


def _entry(
    config: McpServerConfig, provider: OAuthClientProvider, storage: _Received
) -> OAuthEntry:
    """The store's entry for what the flow got."""
    assert config.url is not None and storage.tokens is not None
    context = provider.context
    metadata = context.oauth_metadata
    client = storage.client or context.client_info
    if client is None:
        raise McpLoginError("the authorization server gave tokens but no client registration")
    token_endpoint = (
        str(metadata.token_endpoint)
        if metadata is not None
        else context.get_authorization_base_url(config.url) + "/token"
    )
    resource = (
        context.get_resource_url()
        if context.should_include_resource_param(context.protocol_version)
        else None
    )
    tokens = storage.tokens
    return OAuthEntry(
        server_url=config.url,
        name=config.name,
        token_endpoint=token_endpoint,
        resource=resource,
        issuer=str(metadata.issuer) if metadata is not None else None,
        client=client.model_dump(mode="json", exclude_none=True),
        access_token=tokens.access_token,
        refresh_token=tokens.refresh_token,
        scope=tokens.scope,
        expires_at=storage.expires_at,
    )


class _Received:
    """The SDK's token storage for one login: it starts empty (a login always registers
    and authorizes afresh: the loopback port, hence the redirect URI, is new each time)
    and keeps what the flow gives, for :func:`login` to store."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.expires_at: float | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens
        expires_in = tokens.expires_in
        self.expires_at = None if expires_in is None else time.time() + float(expires_in)

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>greenroom</title></head>
<body style="font-family: sans-serif; margin: 3em"><h1>{title}</h1><p>{text}</p></body></html>
"""


class _Loopback:
    """The redirect URI: an HTTP listener on ``127.0.0.1`` (a port of the system's
    choosing) that takes the one redirect carrying the ``state`` of the authorization URL
    and answers every other request with an error page, so that nothing but the browser
    the person used can end the wait."""

    def __init__(self, listener: trio.SocketListener) -> None:
        port = listener.socket.getsockname()[1]
        self.redirect_uri = f"http://127.0.0.1:{port}{CALLBACK_PATH}"
        self._listener = listener
        self._state: str | None = None
        self._answer: AuthorizationCodeResult | McpLoginError | None = None
        self._answered = trio.Event()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls) -> AsyncIterator[_Loopback]:
        """Listen until the block ends."""
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        loopback = cls(listener)
        async with listener, trio.open_nursery() as nursery:
            nursery.start_soon(loopback.serve, nursery)
            try:
                yield loopback
            finally:
                nursery.cancel_scope.cancel()

    def expect(self, authorization_url: str) -> None:
        """The flow is about to show ``authorization_url``: only a redirect with its
        ``state`` is its answer."""
        self._state = parse_qs(urlsplit(authorization_url).query).get("state", [""])[0]

    async def answer(self) -> AuthorizationCodeResult:
        """The code the browser brought back; raises :class:`McpLoginError` for an error
        the authorization server sent instead."""
        await self._answered.wait()
        answer = self._answer
        if isinstance(answer, McpLoginError):
            raise answer
        assert answer is not None
        return answer

    async def serve(self, nursery: trio.Nursery) -> None:
        """Take connections until cancelled, each in a task of ``nursery``."""
        while True:
            stream = await self._listener.accept()
            nursery.start_soon(self._handle, stream)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(REQUEST_READ_S):
                connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
                target = await _read_target(stream, connection)
                if target is None:
                    return
                status, title, text = self._take(target)
                body = _PAGE.format(title=html.escape(title), text=html.escape(text)).encode()
                with contextlib.suppress(h11.LocalProtocolError, trio.BrokenResourceError):
                    await stream.send_all(connection.send(h11.Response(
                        status_code=status,
                        headers=[("Content-Type", "text/html; charset=utf-8"),
                                 ("Content-Length", str(len(body))),
                                 ("Cache-Control", "no-store"), ("Connection", "close")],
                    )) or b"")  # fmt: skip
                    await stream.send_all(connection.send(h11.Data(data=body)) or b"")
                    await stream.send_all(connection.send(h11.EndOfMessage()) or b"")

    def _take(self, target: str) -> tuple[int, str, str]:
        """The answer to a request for ``target``: (status, title, text)."""
        parts = urlsplit(target)
        if parts.path != CALLBACK_PATH:
            return 404, "Not found", "This address only takes greenroom's login redirect."
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        if self._state is None or query.get("state") != self._state or self._answered.is_set():
            return 400, "Not this login", "This is not the answer greenroom is waiting for."
        error = query.get("error")
        if error is not None:
            detail = query.get("error_description")
            self._answer = McpLoginError(
                f"the authorization server refused: {error}" + (f": {detail}" if detail else "")
            )
            self._answered.set()
            return 200, "Not authorized", f"The authorization server said: {error}."
        code = query.get("code")
        if not code:
            return 400, "No code", "The redirect carries no authorization code."
        self._answer = AuthorizationCodeResult(code=code, state=query["state"],
                                               iss=query.get("iss"))  # fmt: skip
        self._answered.set()
        return 200, "greenroom is authorized", "You can close this tab and go back."


async def _read_target(stream: trio.SocketStream, connection: h11.Connection) -> str | None:
    """The target of the request on ``stream``, or None for one that is not a GET."""
    while True:
        try:
            event: Any = connection.next_event()
        except h11.RemoteProtocolError:  # not HTTP, or larger than a redirect can be
            return None
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(4096)
            except trio.BrokenResourceError:
                return None
            connection.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            if event.method != b"GET":
                return None
            return bytes(event.target).decode("ascii", "replace")
        return None
