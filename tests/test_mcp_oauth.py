"""OAuth for HTTP MCP servers (R-MCP-5, R-MCP-6, R-SEC-5) against a real OAuth-protected
server built with the SDK's own server auth (``tests/support/mcp_oauth_server.py``: an
authorization server with dynamic registration and PKCE, and a protected resource): the
``greenroom mcp login`` command as a real subprocess, the test playing the browser by
fetching the printed authorization URL with httpx and following its redirect to the
loopback; then sessions and ``greenroom run`` with the stored tokens."""

from __future__ import annotations

import contextlib
import json
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import httpx
import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.mcp import McpServerError
from greenroom.actors.tools.mcp_auth import OAuthEntry, TokenStore, store_path
from greenroom.actors.tools.mcp_bounds import MAX_MESSAGE_BYTES
from greenroom.actors.tools.mcp_login import McpLoginError, login_to_mcp_server
from greenroom.protocols.mcp_config import McpServerConfig
from tests.support.mock_model_server import Reply as WireReply
from tests.support.mock_model_server import Text, ToolUse, open_mock_server
from tests.test_mcp import (
    GREENROOM,
    cli_env,
    connection,
    content_text,
    http_server,
    outputs_by_call,
    stdio,
)

ROOT = Path(__file__).resolve().parents[1]
OAUTH_SERVER = ROOT / "tests" / "support" / "mcp_oauth_server.py"
LOGIN_BOUND_S = RUN_TIMEOUT_S * 3


@contextlib.contextmanager
def oauth_server(transport: str = "http") -> Iterator[str]:
    """The OAuth-protected test server on 127.0.0.1 (port 0), over streamable HTTP (or
    ``"sse"``: the legacy HTTP+SSE transport); yields its MCP URL."""
    process = subprocess.Popen(
        [sys.executable, str(OAUTH_SERVER), *(["--sse"] if transport == "sse" else [])],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("PORT "), line
        path = "sse" if transport == "sse" else "mcp"
        yield f"http://127.0.0.1:{int(line.split()[1])}/{path}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


async def server_state(url: str) -> dict[str, Any]:
    """The test server's counts: registrations, authorizations, exchanges, refreshes."""
    async with httpx.AsyncClient() as client:
        response = await client.get(origin(url) + "/test/state")
    state: dict[str, Any] = response.json()
    return state


async def server_test_action(url: str, action: str) -> None:
    """``expire`` (access tokens stop working) or ``forget`` (refresh tokens too)."""
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{origin(url)}/test/{action}")
    assert response.status_code == 200


def write_config(tmp_path: Path, servers: dict[str, Any]) -> Path:
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def stored(data_dir: Path) -> dict[str, Any]:
    servers: dict[str, Any] = json.loads(store_path(data_dir).read_text())["servers"]
    return servers


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class Browser:
    """The person's browser: opens the authorization URL and follows its redirects (the
    authorization server consents at once and sends it to the loopback redirect URI)."""

    def __init__(self) -> None:
        self.final: httpx.Response | None = None

    async def open(self, url: str) -> None:
        async with httpx.AsyncClient(follow_redirects=True) as client:
            self.final = await client.get(url)


async def cli_login(
    tmp_path: Path, config: Path, data_dir: Path, name: str = "o"
) -> tuple[str, Browser, int, str, str]:
    """``greenroom mcp login NAME`` as a subprocess, its printed URL opened by a
    :class:`Browser`: (the authorization URL, the browser, exit code, stdout, stderr)."""
    browser = Browser()
    output = b""
    url = ""
    with trio.fail_after(LOGIN_BOUND_S):
        async with trio.open_nursery() as nursery:
            process = await trio.lowlevel.open_process(
                [GREENROOM, "mcp", "login", name, "--mcp-config", str(config),
                 "--data-dir", str(data_dir)],
                cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            assert process.stdout is not None and process.stderr is not None
            errors = bytearray()

            async def drain_stderr() -> None:
                assert process.stderr is not None
                async for chunk in process.stderr:
                    errors.extend(chunk)

            try:
                nursery.start_soon(drain_stderr)
                async for chunk in process.stdout:
                    output += chunk
                    lines = [line.strip() for line in output.decode().splitlines()]
                    found = [line for line in lines if line.startswith("http") and "?" in line]
                    if found and not url:
                        url = found[0]
                        nursery.start_soon(browser.open, url)
                code = await process.wait()
            finally:
                if process.returncode is None:
                    process.kill()
    return url, browser, code, output.decode(), errors.decode()


# -- the login command --------------------------------------------------------------------


async def test_login_runs_the_authorization_code_flow_and_keeps_the_tokens_private(
    tmp_path: Path,
) -> None:
    """R-MCP-5, R-SEC-5: ``greenroom mcp login o`` discovers the authorization server from
    the server's 401, registers a client (RFC 7591) whose redirect URI is a 127.0.0.1
    loopback, prints an authorization URL with PKCE S256, a state and the resource, takes
    the code the browser brings back, exchanges it, and keeps client and tokens in
    ``<data dir>/mcp/oauth.json``, 0600 in a 0700 directory, under the server's URL."""
    with oauth_server() as url:
        config = write_config(tmp_path, {"o": {"type": "http", "url": url}})
        data_dir = tmp_path / "data"
        auth_url, browser, code, out, err = await cli_login(tmp_path, config, data_dir)
        state = await server_state(url)
    assert code == 0, err
    assert "Traceback" not in err
    query = {k: v[0] for k, v in parse_qs(urlsplit(auth_url).query).items()}
    assert auth_url.startswith(origin(url) + "/authorize?")
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) >= 43
    assert query["state"] and query["resource"] == url and query["scope"] == "mcp"
    redirect = urlsplit(query["redirect_uri"])
    assert (redirect.scheme, redirect.hostname, redirect.path) == ("http", "127.0.0.1", "/callback")
    assert browser.final is not None and browser.final.status_code == 200
    assert str(browser.final.url).startswith(query["redirect_uri"] + "?code=")
    assert "greenroom is authorized" in browser.final.text
    assert "Logged in to MCP server 'o'; it offers 2 tools" in out
    assert state["registrations"] == state["authorizations"] == state["exchanges"] == 1
    entry = stored(data_dir)[url]
    assert entry["client"]["client_id"] == query["client_id"]
    assert entry["tokens"]["access_token"] in state["access_tokens"]
    assert entry["tokens"]["refresh_token"] and entry["tokens"]["expires_at"] > time.time()
    assert entry["token_endpoint"] == origin(url) + "/token" and entry["resource"] == url
    assert mode(store_path(data_dir)) == 0o600
    assert mode(store_path(data_dir).parent) == 0o700
    assert mode(data_dir) == 0o700


def test_login_usage_errors_name_the_problem(tmp_path: Path) -> None:
    """An unknown server, a stdio server and one with its own ``Authorization`` header
    are usage errors (exit 2) saying so, before any network."""
    config = write_config(tmp_path, {
        "s": stdio(),
        "h": {"type": "http", "url": "http://127.0.0.1:9/mcp",
              "headers": {"Authorization": "Bearer x"}},
    })  # fmt: skip
    expected = {
        "nope": "no server 'nope' in",
        "s": "server 's' runs as a command (stdio): OAuth is for servers reached over HTTP",
        "h": "server 'h' is configured with its own Authorization header",
    }
    for name, message in expected.items():
        result = subprocess.run(
            [GREENROOM, "mcp", "login", name, "--mcp-config", str(config),
             "--data-dir", str(tmp_path / "data")],
            cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True,
            timeout=LOGIN_BOUND_S, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert result.returncode == 2, (name, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr
    assert not store_path(tmp_path / "data").exists()


async def test_the_loopback_takes_only_its_own_redirect_and_reports_a_refusal(
    tmp_path: Path,
) -> None:
    """A request to the redirect URI without the authorization URL's ``state`` (another
    page on the machine) is refused and does not end the wait; an ``error`` the
    authorization server sends back ends the login with its words; nothing is stored."""
    with oauth_server() as url:
        config = McpServerConfig(name="o", transport="http", url=url)
        strays: list[int] = []

        async def deny(auth_url: str, redirect_uri: str) -> None:
            async with httpx.AsyncClient() as client:
                forged = await client.get(redirect_uri + "?code=x&state=forged")
                elsewhere = await client.get(redirect_uri.replace("/callback", "/x"))
                strays.extend((forged.status_code, elsewhere.status_code))
                state = parse_qs(urlsplit(auth_url).query)["state"][0]
                await client.get(f"{redirect_uri}?error=access_denied&error_description="
                                 f"the+person+said+no&state={state}")  # fmt: skip

        with trio.fail_after(LOGIN_BOUND_S), pytest.raises(McpLoginError) as caught:
            await login_to_mcp_server(config, tmp_path / "data", deny)
    assert strays == [400, 404]
    assert str(caught.value) == (
        "the authorization server refused: access_denied: the person said no"
    )
    assert not store_path(tmp_path / "data").exists()


async def test_a_server_that_asks_for_nothing_needs_no_login(tmp_path: Path) -> None:
    """A login to a server that never answers 401 shows no URL and stores nothing."""
    async def show(url: str, redirect_uri: str) -> None:
        raise AssertionError(f"asked to open {url}")

    with http_server() as url, trio.fail_after(LOGIN_BOUND_S):
        config = McpServerConfig(name="h", transport="http", url=url)
        result = await login_to_mcp_server(config, tmp_path / "data", show)
    assert not result.stored and result.tools is not None and result.tools > 5
    assert not store_path(tmp_path / "data").exists()


HOSTILE_BODY_BYTES = 64 << 20
"""The metadata body the hostile authorization server offers: 64 times the bound."""


class HostileAuthorizationServer:
    """An MCP server on 127.0.0.1 that asks for OAuth (401, then its protected resource
    metadata naming itself as the authorization server), whose answer at ``flood_path``
    (its authorization server metadata unless given) is a body of
    :data:`HOSTILE_BODY_BYTES` of ``content_type``. ``sent`` counts what of that body the
    client took before it closed the connection; ``done`` is set then, or once all was
    sent. At ``/sse`` it is a legacy HTTP+SSE server whose message endpoint is
    ``flood_path``."""

    def __init__(
        self, content_type: str, flood_path: str = "/.well-known/oauth-authorization-server"
    ) -> None:
        self.content_type = content_type
        self.flood_path = flood_path
        self.sent = 0
        self.done = trio.Event()
        self.url = ""

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}/mcp"
        task_status.started(self.url)
        await trio.serve_listeners(self._answer, [listener])

    async def _answer(self, stream: trio.SocketStream) -> None:
        async with stream:
            connection = h11.Connection(h11.SERVER)
            while (event := connection.next_event()) is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
            assert isinstance(event, h11.Request)
            path = event.target.decode().partition("?")[0]
            if path == self.flood_path:
                return await self._flood(stream, connection)
            if path == "/sse":
                return await self._events(stream, connection)
            status, headers, body = 404, [], b""
            if path == "/mcp":
                metadata = origin(self.url) + "/.well-known/oauth-protected-resource"
                status = 401
                headers = [("WWW-Authenticate", f'Bearer resource_metadata="{metadata}"')]
            elif path == "/.well-known/oauth-protected-resource":
                body = json.dumps({"resource": self.url,
                                   "authorization_servers": [origin(self.url) + "/"]}).encode()
                status, headers = 200, [("Content-Type", "application/json")]
            headers += [("Content-Length", str(len(body))), ("Connection", "close")]
            await _send_head(stream, connection, status, headers)
            await stream.send_all(connection.send(h11.Data(data=body)) or b"")

    async def _events(self, stream: trio.SocketStream, connection: h11.Connection) -> None:
        headers = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-store")]
        await _send_head(stream, connection, 200, headers)
        endpoint = f"event: endpoint\ndata: {self.flood_path}\n\n".encode()
        await stream.send_all(connection.send(h11.Data(data=endpoint)) or b"")
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.receive_some()  # open until the client leaves

    async def _flood(self, stream: trio.SocketStream, connection: h11.Connection) -> None:
        headers = [("Content-Type", self.content_type), ("Connection", "close"),
                   ("Content-Length", str(HOSTILE_BODY_BYTES))]
        await _send_head(stream, connection, 200, headers)
        piece = b" " * 65536
        try:
            while self.sent < HOSTILE_BODY_BYTES:
                await stream.send_all(piece)
                self.sent += len(piece)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.done.set()


async def _send_head(
    stream: trio.SocketStream, connection: h11.Connection, status: int,
    headers: list[tuple[str, str]],
) -> None:
    await stream.send_all(connection.send(h11.Response(status_code=status, headers=headers)) or b"")


@pytest.mark.parametrize(
    ("transport", "content_type"),
    [("http", "application/json"), ("http", "text/html"), ("sse", "text/html")],
)
async def test_an_authorization_server_that_answers_without_end_is_read_only_to_the_bound(
    tmp_path: Path, transport: str, content_type: str
) -> None:
    """R-SEC-1, R-MCP-5: the login's client read each answer of the authorization server
    whole, however large: metadata of 64 MiB was taken in full (and held) before the flow
    looked at it. The login's client now bounds every answer as a session's messages are
    (``mcp_bounds.MAX_MESSAGE_BYTES``, 1 MiB): reading stops there, the connection is
    closed, and the login fails saying so; nothing is stored. Over either transport."""
    hostile = HostileAuthorizationServer(content_type)

    async def show(url: str, redirect_uri: str) -> None:
        raise AssertionError(f"asked to open {url}")

    with trio.fail_after(LOGIN_BOUND_S):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(hostile.serve)
            config = McpServerConfig(name="o", transport=transport, url=url)
            with pytest.raises(McpLoginError) as caught:
                await login_to_mcp_server(config, tmp_path / "data", show)
            await hostile.done.wait()
            nursery.cancel_scope.cancel()
    assert str(caught.value) == (
        "127.0.0.1 answered with more than 1 MiB (greenroom reads no more of one answer)"
    )
    # What the socket buffers took on the way is all that left the server past the bound.
    assert MAX_MESSAGE_BYTES <= hostile.sent < HOSTILE_BODY_BYTES // 4
    assert not store_path(tmp_path / "data").exists()


async def test_a_legacy_sse_server_that_answers_a_message_without_end_is_read_to_the_bound(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SEC-1, R-MCP-4: over the legacy HTTP+SSE transport the SDK read the answer to a
    POST of a message whole, however large and whatever its type (64 MiB of HTML to the
    initialize request), then waited out the start's 30 s for an answer that never came.
    Reading stops at the bound now (``mcp_bounds.MAX_MESSAGE_BYTES``, 1 MiB) and the
    server cannot be started, saying why."""
    hostile = HostileAuthorizationServer("text/html", flood_path="/messages")
    with trio.fail_after(LOGIN_BOUND_S):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(hostile.serve)
            async with Host.open(tmp_path / "data") as host:
                await host.create_session(
                    workspace_dir=workspace,
                    mcp_servers={"s": {"type": "sse", "url": origin(url) + "/sse"}},
                )
                with pytest.raises(McpServerError) as caught:
                    await connection(host, "s").list_tools()
            await hostile.done.wait()
            nursery.cancel_scope.cancel()
    assert str(caught.value).startswith(
        "MCP server 's' could not be started: 127.0.0.1 answered with more than 1 MiB "
        "(greenroom reads no more of one answer)"
    )
    assert MAX_MESSAGE_BYTES <= hostile.sent < HOSTILE_BODY_BYTES // 4


@pytest.mark.parametrize("transport", ["http", "sse"])
async def test_a_refresh_answered_without_end_is_read_only_to_the_bound(
    tmp_path: Path, workspace: Path, transport: str
) -> None:
    """R-SEC-1, R-MCP-5: a session's expired token is refreshed before its first request;
    the authorization server's answer was read whole when it was not JSON (64 MiB of
    HTML). Reading stops at the bound now, whatever its type, and the server cannot be
    started, saying why; the stored entry is left as it was."""
    hostile = HostileAuthorizationServer("text/html", flood_path="/token")
    data_dir = tmp_path / "data"
    with trio.fail_after(LOGIN_BOUND_S):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(hostile.serve)
            server_url = url if transport == "http" else origin(url) + "/sse"
            entry = OAuthEntry(
                server_url=server_url, name="o", token_endpoint=origin(url) + "/token",
                resource=None, issuer=None, client={"client_id": "c"}, access_token="old",
                refresh_token="r", scope=None, expires_at=time.time() - 60,
            )  # fmt: skip
            TokenStore(store_path(data_dir)).save(entry)
            async with Host.open(data_dir) as host:
                await host.create_session(
                    workspace_dir=workspace,
                    mcp_servers={"o": {"type": transport, "url": server_url}},
                )
                with pytest.raises(McpServerError) as caught:
                    await connection(host, "o").list_tools()
            await hostile.done.wait()
            nursery.cancel_scope.cancel()
    assert str(caught.value).startswith(
        "MCP server 'o' could not be started: 127.0.0.1 answered with more than 1 MiB "
        "(greenroom reads no more of one answer)"
    ), str(caught.value)
    assert MAX_MESSAGE_BYTES <= hostile.sent < HOSTILE_BODY_BYTES // 4
    assert stored(data_dir)[server_url]["tokens"]["access_token"] == "old"


# -- sessions use the stored tokens --------------------------------------------------------


async def logged_in(tmp_path: Path, url: str, data_dir: Path) -> dict[str, Any]:
    """Log in to the server at ``url`` through the command; its stored entry."""
    config = write_config(tmp_path, {"o": {"type": "http", "url": url}})
    _, _, code, _, err = await cli_login(tmp_path, config, data_dir)
    assert code == 0, err
    entry: dict[str, Any] = stored(data_dir)[url]
    return entry


async def test_a_run_calls_a_tool_of_the_server_with_the_stored_token(tmp_path: Path) -> None:
    """R-MCP-5: after a login, ``greenroom run`` (an OpenAI-compatible mock model) calls
    a tool of the OAuth server; the server saw the registered client's token."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    data_dir = tmp_path / "data"
    script = [
        WireReply([ToolUse("call_1", "mcp__o__whoami", {})], stop_reason="tool_use"),
        WireReply([Text("It knows us.")]),
    ]
    with oauth_server() as url:
        entry = await logged_in(tmp_path, url, data_dir)
        config = write_config(tmp_path, {"o": {"type": "http", "url": url}})
        async with open_mock_server(*script) as model:
            env = {**cli_env(tmp_path), "OPENAI_API_KEY": "test-key"}
            with trio.fail_after(RUN_TIMEOUT_S * 3):
                result = await trio.run_process(
                    [GREENROOM, "run", "--json", "--provider", "openai", "--model", "m",
                     "--base-url", model.base_url + "/v1", "--approve", "all",
                     "--workspace", str(workspace), "--data-dir", str(data_dir),
                     "--mcp-config", str(config), "who am I"],
                    cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True,
                    check=False, stdin=b"",
                )  # fmt: skip
            model.assert_clean()
    assert result.returncode == 0, result.stderr.decode()
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    outputs = {o["call_id"]: o for o in lines if o["type"] == "tool_call_output"}
    assert outputs["call_1"]["status"] == "ok"
    assert outputs["call_1"]["content"][0]["text"] == entry["client"]["client_id"]


async def test_a_legacy_sse_server_gets_its_token_too(
    tmp_path: Path, workspace: Path, providers: Any
) -> None:
    """R-MCP-5, R-MCP-6: OAuth works the same over the legacy HTTP+SSE transport: the
    login, and a session's call with the stored token."""
    browser = Browser()
    provider = providers([
        Reply(blocks=(tool_call("w1", "mcp__o__whoami"),)), Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    with oauth_server("sse") as url:
        config = McpServerConfig(name="o", transport="sse", url=url)

        async def show(auth_url: str, redirect_uri: str) -> None:
            nursery.start_soon(browser.open, auth_url)

        with trio.fail_after(LOGIN_BOUND_S):
            async with trio.open_nursery() as nursery:
                result = await login_to_mcp_server(config, tmp_path / "data", show)
            async with Host.open(tmp_path / "data") as host:
                session = await host.create_session(
                    provider=provider, workspace_dir=workspace,
                    mcp_servers={"o": {"type": "sse", "url": url}},
                )  # fmt: skip
                by_call = outputs_by_call(await collect(session.run("go", approve=allow_all)))
    assert result.stored and result.tools == 2
    client_id = stored(tmp_path / "data")[url]["client"]["client_id"]
    assert content_text(by_call["w1"]) == client_id


async def test_an_expired_or_refused_token_is_refreshed_and_the_new_one_stored(
    tmp_path: Path, workspace: Path, providers: Any
) -> None:
    """R-MCP-5: an access token past its stored ``expires_at`` is refreshed before it is
    sent (the server would still have taken it: the refresh comes from the expiry alone);
    one the server refuses mid-session (401) is refreshed and the request sent again.
    Each new token is stored (0600) for the next process; no new authorization."""
    data_dir = tmp_path / "data"
    with oauth_server() as url:
        entry = await logged_in(tmp_path, url, data_dir)
        first_client = entry["client"]["client_id"]
        store = json.loads(store_path(data_dir).read_text())
        store["servers"][url]["tokens"]["expires_at"] = time.time() - 60
        store_path(data_dir).write_text(json.dumps(store))
        provider = providers([
            Reply(blocks=(tool_call("w1", "mcp__o__whoami"),)),
            Reply(blocks=(text("done"),)),
            Reply(blocks=(tool_call("w2", "mcp__o__whoami"),)),
            Reply(blocks=(text("done"),)),
        ])  # fmt: skip
        with trio.fail_after(RUN_TIMEOUT_S * 3):
            async with Host.open(data_dir) as host:
                session = await host.create_session(
                    provider=provider, workspace_dir=workspace,
                    mcp_servers={"o": {"type": "http", "url": url}},
                )  # fmt: skip
                by_call = outputs_by_call(await collect(session.run("1", approve=allow_all)))
                assert content_text(by_call["w1"]) == first_client
                after_expiry = await server_state(url)
                refreshed = stored(data_dir)[url]["tokens"]
                # Refused: the stored token looks valid, but the server took it back.
                await server_test_action(url, "expire")
                by_call = outputs_by_call(await collect(session.run("2", approve=allow_all)))
                assert not by_call["w2"].is_error, content_text(by_call["w2"])
                assert content_text(by_call["w2"]) == first_client
                after_refusal = await server_state(url)
    assert after_expiry["refreshes"] == 1 and after_expiry["authorizations"] == 1
    assert refreshed["access_token"] != entry["tokens"]["access_token"]
    assert refreshed["access_token"] in after_expiry["access_tokens"]
    assert refreshed["expires_at"] > time.time()
    assert after_refusal["refreshes"] == 2 and after_refusal["authorizations"] == 1
    final = stored(data_dir)[url]["tokens"]
    assert final["access_token"] in after_refusal["access_tokens"]
    assert final["refresh_token"] not in (
        refreshed["refresh_token"], entry["tokens"]["refresh_token"]
    )
    assert mode(store_path(data_dir)) == 0o600


async def test_without_a_token_the_server_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    """R-MCP-6: a server that asks for OAuth when no token is stored is one bad entry: a
    line on stderr saying to run ``greenroom mcp login o``, never a traceback; the run
    goes on with the other server's tools and completes."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    script = [
        WireReply([ToolUse("call_1", "mcp__s__echo", {"text": "still here"})],
                  stop_reason="tool_use"),
        WireReply([Text("Done without o.")]),
    ]  # fmt: skip
    with oauth_server() as url:
        config = write_config(tmp_path, {"o": {"type": "http", "url": url}, "s": stdio()})
        async with open_mock_server(*script) as model:
            env = {**cli_env(tmp_path), "OPENAI_API_KEY": "test-key"}
            with trio.fail_after(RUN_TIMEOUT_S * 3):
                result = await trio.run_process(
                    [GREENROOM, "run", "--json", "--provider", "openai", "--model", "m",
                     "--base-url", model.base_url + "/v1", "--approve", "all",
                     "--workspace", str(workspace), "--mcp-config", str(config), "go"],
                    cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True,
                    check=False, stdin=b"",
                )  # fmt: skip
            model.assert_clean()
            tool_names = {t["function"]["name"] for t in model.requests[0].body["tools"]}
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert (f"MCP server 'o' could not be started: it asks for OAuth authorization (HTTP "
            f"401) and no token is stored for {url}: run `greenroom mcp login o`") in stderr
    assert "Traceback" not in stderr
    assert "mcp__s__echo" in tool_names
    assert not any(name.startswith("mcp__o__") for name in tool_names)
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    outputs = {o["call_id"]: o for o in lines if o["type"] == "tool_call_output"}
    assert outputs["call_1"]["content"][0]["text"] == "still here"
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"


async def test_a_refused_refresh_asks_for_a_login_again(
    tmp_path: Path, workspace: Path, providers: Any
) -> None:
    """R-MCP-5, R-MCP-6: when the authorization server refuses the refresh (the grants
    were revoked), a call in flight is an error output saying why and to run
    ``greenroom mcp login o``; the next start of the server fails with the same words,
    and a session is still created with its other tools."""
    data_dir = tmp_path / "data"
    login_again = (
        "its OAuth access token is no longer valid and the authorization server refused "
        "to refresh it (invalid_grant: refresh token does not exist): run `greenroom mcp "
        "login o`"
    )
    provider = providers([
        Reply(blocks=(tool_call("w1", "mcp__o__whoami"),)), Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    with oauth_server() as url:
        await logged_in(tmp_path, url, data_dir)
        with trio.fail_after(RUN_TIMEOUT_S * 3):
            async with Host.open(data_dir) as host:
                session = await host.create_session(
                    provider=provider, workspace_dir=workspace,
                    mcp_servers={"o": {"type": "http", "url": url}},
                )  # fmt: skip
                await server_test_action(url, "forget")
                by_call = outputs_by_call(await collect(session.run("go", approve=allow_all)))
            async with Host.open(data_dir) as host:
                session = await host.create_session(
                    workspace_dir=workspace,
                    mcp_servers={"o": {"type": "http", "url": url}, "s": stdio()},
                )
                names = {t.name for t in session.tools}
                with pytest.raises(McpServerError) as caught:
                    await connection(host, "o").call("whoami", {}, None)
    assert by_call["w1"].is_error
    assert content_text(by_call["w1"]) == (
        f"MCP server 'o' stopped during whoami: {login_again}; it is started again on its "
        "next use"
    )
    assert "mcp__s__echo" in names and not any(n.startswith("mcp__o__") for n in names)
    assert str(caught.value).startswith(f"MCP server 'o' could not be started: {login_again}")
