"""An MCP server that asks for OAuth, written with the SDK's own server API: ``MCPServer``
with its authorization server (``auth_server_provider``) and protected resource (``auth``).

    python tests/support/mcp_oauth_server.py        # streamable HTTP on 127.0.0.1, port 0:
                                                    # prints "PORT <n>" first on stdout
    python tests/support/mcp_oauth_server.py --sse  # the legacy HTTP+SSE transport, likewise

The MCP endpoint is ``/mcp`` (``/sse`` with ``--sse``); without a valid access token it
answers 401 with a ``WWW-Authenticate`` naming its protected resource metadata (RFC 9728),
which names the authorization server (the same origin: RFC 8414 metadata, RFC 7591 registration,
``/authorize`` with PKCE, ``/token``). Scope ``mcp`` is required; tokens are bound to the
resource (RFC 8707). The authorization endpoint consents at once: it redirects to the
client's redirect URI with a code, so a test plays the browser by following redirects.

Tools: ``echo`` (read-only) and ``whoami`` (the client id of the token the call came with).
Routes for the tests, outside the protection: ``GET /test/state`` (JSON: counts of
registrations, authorizations, code exchanges and refreshes, and the live access tokens),
``POST /test/expire`` (every access token issued so far stops working: the next request
with one gets 401) and ``POST /test/forget`` (the refresh tokens too).
"""

from __future__ import annotations

import secrets
import socket
import sys
import time
from typing import Any

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    RefreshToken,
    construct_redirect_uri,
)
from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions
from mcp.server.mcpserver import MCPServer
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken
from mcp.types import ToolAnnotations
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

ACCESS_TTL_S = 3600


class Provider:
    """An authorization server that keeps everything in memory and consents at once."""

    def __init__(self) -> None:
        self.clients: dict[str, OAuthClientInformationFull] = {}
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}
        self.counts = {"registrations": 0, "authorizations": 0, "exchanges": 0, "refreshes": 0}

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        assert client_info.client_id is not None
        self.clients[client_info.client_id] = client_info
        self.counts["registrations"] += 1

    async def authorize(
        self, client: OAuthClientInformationFull, params: AuthorizationParams
    ) -> str:
        code = secrets.token_urlsafe(32)
        self.codes[code] = AuthorizationCode(
            code=code, scopes=params.scopes or [], expires_at=time.time() + 300,
            client_id=client.client_id or "", code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource,
        )  # fmt: skip
        self.counts["authorizations"] += 1
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    async def load_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: str
    ) -> AuthorizationCode | None:
        code = self.codes.get(authorization_code)
        return code if code is not None and code.client_id == client.client_id else None

    def _issue(self, client_id: str, scopes: list[str], resource: str | None) -> OAuthToken:
        access, refresh = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        self.access[access] = AccessToken(
            token=access, client_id=client_id, scopes=scopes,
            expires_at=int(time.time()) + ACCESS_TTL_S, resource=resource,
        )  # fmt: skip
        self.refresh[refresh] = RefreshToken(
            token=refresh, client_id=client_id, scopes=scopes, resource=resource
        )
        return OAuthToken(access_token=access, expires_in=ACCESS_TTL_S,
                          scope=" ".join(scopes), refresh_token=refresh)  # fmt: skip

    async def exchange_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: AuthorizationCode
    ) -> OAuthToken:
        del self.codes[authorization_code.code]
        self.counts["exchanges"] += 1
        return self._issue(client.client_id or "", authorization_code.scopes,
                           authorization_code.resource)  # fmt: skip

    async def load_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: str
    ) -> RefreshToken | None:
        token = self.refresh.get(refresh_token)
        return token if token is not None and token.client_id == client.client_id else None

    async def exchange_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: RefreshToken, scopes: list[str]
    ) -> OAuthToken:
        del self.refresh[refresh_token.token]  # rotated, as the specification asks
        self.counts["refreshes"] += 1
        return self._issue(client.client_id or "", scopes, refresh_token.resource)

    async def load_access_token(self, token: str) -> AccessToken | None:
        return self.access.get(token)

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)


def build(port: int, path: str = "/mcp") -> MCPServer:
    """The server, for the origin ``http://127.0.0.1:<port>``, its endpoint at ``path``
    (the protected resource)."""
    origin = f"http://127.0.0.1:{port}"
    provider = Provider()
    server = MCPServer(
        "greenroom-oauth-test",
        auth_server_provider=provider,
        auth=AuthSettings(
            issuer_url=origin,  # type: ignore[arg-type]
            resource_server_url=f"{origin}{path}",  # type: ignore[arg-type]
            client_registration_options=ClientRegistrationOptions(enabled=True),
            required_scopes=["mcp"],
            validate_token_resource=True,
        ),
    )

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def echo(text: str) -> str:
        """Echo the text back."""
        return text

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def whoami() -> str:
        """The client id of the access token this call came with."""
        token = get_access_token()
        return token.client_id if token is not None else "nobody"

    @server.custom_route("/test/state", methods=["GET"])
    async def state(request: Request) -> Response:
        body: dict[str, Any] = {**provider.counts, "access_tokens": sorted(provider.access)}
        return JSONResponse(body)

    @server.custom_route("/test/expire", methods=["POST"])
    async def expire(request: Request) -> Response:
        provider.access.clear()
        return JSONResponse({"ok": True})

    @server.custom_route("/test/forget", methods=["POST"])
    async def forget(request: Request) -> Response:
        provider.access.clear()
        provider.refresh.clear()
        return JSONResponse({"ok": True})

    return server


def main() -> None:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    if "--sse" in sys.argv:
        app = build(port, "/sse").sse_app()
    else:
        app = build(port).streamable_http_app()
    print(f"PORT {port}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
