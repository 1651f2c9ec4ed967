"""The web console (``actors/gateway/console/index.html``) and its HTTP server
(``actors/gateway/console.py``).

The server is tested with a raw socket client (exact bytes in, exact status out). The page
is tested in a real headless Chromium driven over the Chrome DevTools Protocol: a gateway
with scripted-model sessions and the console server run in this process on free ports, the
browser loads the console, and the test reads the DOM and clicks its buttons. Every wait is
bounded by ``trio.fail_after`` (polling the DOM in short ``trio.sleep`` steps).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from conftest import Gates, Lookup, last_user, texts_of
from trio_websocket import WebSocketConnection, open_websocket_url

from greenroom.actors.apps.parser import build_parser
from greenroom.actors.apps.serve_command import console_port
from greenroom.actors.gateway import Gateway, SessionDefaults
from greenroom.actors.gateway.console import (
    CONSOLE_SLACK,
    PAGE_PATH,
    ConsoleServer,
    console_url,
    content_security_policy,
)
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, ScriptStep, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.stream import ModelError
from greenroom.protocols.tools import Tool
from tests.support.serve_console import start_serve

BOUND_S = 10.0
BROWSER_BOUND_S = 60.0
TOKEN = "console-test-token-0123456789"
CHROMIUM = shutil.which("chromium")
SCREENSHOT_COPY = os.environ.get("GREENROOM_CONSOLE_SCREENSHOT")

# -- the HTTP server ----------------------------------------------------------------------------


@asynccontextmanager
async def console_server(**options: Any) -> AsyncIterator[ConsoleServer]:
    async with trio.open_nursery() as nursery:
        server = ConsoleServer(listen_host="127.0.0.1", port=0, **options)
        port = await nursery.start(server.run)
        assert port == server.port and port > 0
        yield server
        nursery.cancel_scope.cancel()


@attrs.frozen
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


async def raw_request(port: int, data: bytes, *, then_wait: bool = True) -> RawResponse:
    """Send ``data`` as is and read the answer until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        chunks: list[bytes] = []
        while chunk := await stream.receive_some(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    match = re.fullmatch(r"HTTP/1\.1 (\d{3}) .*", status_line)
    assert match, raw[:200]
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return RawResponse(int(match.group(1)), headers, body)


def get(path: str = "/", method: str = "GET", host: str = "127.0.0.1") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: test\r\n\r\n".encode()


async def test_get_serves_the_page_with_security_headers() -> None:
    page = PAGE_PATH.read_bytes()
    with trio.fail_after(BOUND_S):
        async with console_server() as server:
            response = await raw_request(server.port, get(host=f"localhost:{server.port}"))
    assert response.status == 200
    assert response.body == page
    headers = response.headers
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert headers["content-length"] == str(len(page))
    assert headers["cache-control"] == "no-store"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["connection"] == "close"
    policy = headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["default-src"] == "'none'"
    # Websockets to the listening host and to the name the browser used, any port.
    assert directives["connect-src"] == "ws://127.0.0.1:* ws://localhost:*"
    assert directives["frame-ancestors"] == "'none'"
    # Exactly the page's own inline script and style, by hash: no 'unsafe-inline'.
    script = re.search(rb"<script>(.*?)</script>", page, re.DOTALL)
    style = re.search(rb"<style>(.*?)</style>", page, re.DOTALL)
    assert script and style
    for directive, match in (("script-src", script), ("style-src", style)):
        digest = base64.b64encode(hashlib.sha256(match.group(1)).digest()).decode()
        assert directives[directive] == f"'sha256-{digest}'"
    assert "unsafe" not in policy


def test_the_page_is_self_contained() -> None:
    page = PAGE_PATH.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script src" not in page and '<link rel="stylesheet"' not in page
    for testid in ('id="prompt"', 'id="send"', 'id="interrupt"', 'id="compact"', 'id="log"'):
        assert testid in page
    assert 'role="log"' in page and 'aria-live="polite"' in page


async def test_head_answers_headers_only() -> None:
    with trio.fail_after(BOUND_S):
        async with console_server() as server:
            response = await raw_request(server.port, get(method="HEAD"))
            index = await raw_request(server.port, get("/index.html?x=1"))
    assert response.status == 200
    assert response.body == b""
    assert int(response.headers["content-length"]) == len(PAGE_PATH.read_bytes())
    assert "content-security-policy" in response.headers
    assert index.status == 200 and index.body == PAGE_PATH.read_bytes()


async def test_other_paths_methods_and_bad_requests() -> None:
    with trio.fail_after(BOUND_S):
        async with console_server(max_request_bytes=2048) as server:
            port = server.port
            nope = await raw_request(port, get("/nope"))
            assert nope.status == 404 and b"not found" in nope.body
            assert "content-security-policy" not in nope.headers
            post = await raw_request(port, get(method="POST"))
            assert post.status == 405 and post.headers["allow"] == "GET, HEAD"
            for bad in (
                b"garbage\r\n\r\n",
                b"GET / HTTP/2.0\r\nHost: x\r\n\r\n",
                b"GET /\r\n\r\n",
                b"GET / HTTP/1.1\r\n\r\n",  # HTTP/1.1 needs a Host
                b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\nbad name: 1\r\n\r\n",
                b"\x00\xff\r\n\r\n",
            ):
                response = await raw_request(port, bad)
                assert response.status == 400, bad
            http10 = await raw_request(port, b"GET / HTTP/1.0\r\n\r\n")
            assert http10.status == 200
            huge = get().replace(b"\r\n\r\n", b"\r\nX-Pad: " + b"a" * 10_000 + b"\r\n\r\n")
            assert (await raw_request(port, huge)).status == 431
            endless = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-More: 1\r\n" * 500
            assert (await raw_request(port, endless)).status == 431
            # The server survived all of it.
            assert (await raw_request(port, get())).status == 200


async def test_slow_and_vanishing_clients_do_not_stop_the_server() -> None:
    with trio.fail_after(BOUND_S):
        async with console_server(read_timeout_s=0.3) as server:
            port = server.port
            slow = await raw_request(port, b"GET / HTTP/1.1\r\nHost: x\r\n")
            assert slow.status == 408
            for _ in range(5):  # connect and leave at once, or mid-request
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(b"GET / HT")
                await stream.aclose()
            streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
            ok = await raw_request(port, get())  # served while others hang
            assert ok.status == 200
            for stream in streams:
                await stream.aclose()


async def test_too_many_connections_answer_503() -> None:
    with trio.fail_after(BOUND_S):
        async with console_server(max_connections=2, read_timeout_s=5.0) as server:
            idle = [await trio.open_tcp_stream("127.0.0.1", server.port) for _ in range(2)]
            await trio.sleep(0.1)  # let the server accept them
            busy = await raw_request(server.port, get())
            assert busy.status == 503
            for stream in idle:
                await stream.aclose()


def test_console_url_keeps_the_token_in_the_fragment() -> None:
    url = console_url("127.0.0.1", 8766, "ws://127.0.0.1:8765/v1", "tok")
    assert url == "http://127.0.0.1:8766/?ws=ws://127.0.0.1:8765/v1#token=tok"
    assert console_url("0.0.0.0", 1, "ws://127.0.0.1:2/v1", None).startswith("http://127.0.0.1:1/")
    assert console_url("::1", 1, "ws://[::1]:2/v1", None).startswith("http://[::1]:1/")
    policy = content_security_policy(b"<p>no script</p>", ("::1",))
    assert "script-src 'none'" in policy and "connect-src ws://[::1]:*" in policy


def test_serve_flags_choose_the_console_port() -> None:
    parser = build_parser()

    def port_of(*argv: str) -> int | None:
        return console_port(parser.parse_args(["serve", *argv]))

    assert port_of() == 8766
    assert port_of("--port", "9000") == 9001
    assert port_of("--port", "0") == 0
    assert port_of("--port", "65535") == 0
    assert port_of("--console-port", "7000") == 7000
    assert port_of("--console-port", "0") == 0
    assert port_of("--no-console") is None


async def test_run_serve_prints_the_console_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            await start_serve(tmp_path, nursery)
            err = capsys.readouterr().err
            token = (tmp_path / "data" / "serve.token").read_text().strip()
            match = re.search(r"console: (http://127\.0\.0\.1:(\d+)/\?ws=(\S+)#token=(\S+))", err)
            assert match, err
            gateway = re.search(r"listening on (\S+)", err)
            assert gateway and match.group(3) == gateway.group(1)
            assert match.group(4) == token
            response = await raw_request(int(match.group(2)), get())
            assert response.status == 200
            nursery.cancel_scope.cancel()


async def test_run_serve_without_a_free_console_port_still_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with trio.fail_after(BOUND_S):
        taken = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        async with taken, trio.open_nursery() as nursery:
            busy_port = taken.socket.getsockname()[1]
            await start_serve(tmp_path, nursery, console_port=busy_port)
            err = capsys.readouterr().err
            assert f"console: cannot listen on 127.0.0.1:{busy_port}" in err
            assert "listening on ws://127.0.0.1:" in err
            nursery.cancel_scope.cancel()


# -- the page in a real browser --------------------------------------------------------------------


@attrs.define
class Stack:
    host: Host
    gateway: Gateway
    console: ConsoleServer
    providers: list[ScriptedProvider]
    nursery: trio.Nursery
    gateway_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    @property
    def page_url(self) -> str:
        return self.console.url(self.gateway.url, TOKEN)

    async def start_gateway(self) -> None:
        self.gateway_scope = trio.CancelScope()
        await self.nursery.start(self._run_gateway, self.gateway_scope)

    async def _run_gateway(
        self, scope: trio.CancelScope, *, task_status: trio.TaskStatus[int]
    ) -> None:
        with scope:
            await self.gateway.run(task_status=task_status)

    async def restart_gateway(self) -> None:
        """Stop the gateway (every connection closes with 1001) and serve again on the
        same port; the gateway object keeps who owns which session."""
        self.gateway_scope.cancel()
        await self.start_gateway()


@asynccontextmanager
async def stack(
    tmp_path: Path,
    script: Callable[[], Sequence[ScriptStep] | ScriptStep],
    *,
    tools: Sequence[Tool] = (),
    approve: str = "ask",
    titles: bool = False,
    mcp_servers: Mapping[str, Any] | None = None,
) -> AsyncIterator[Stack]:
    """A host, its gateway and the console server on free ports; each session the page
    creates plays ``script()`` on its own scripted provider. ``titles`` turns on the
    gateway's session titles (``greenroom serve`` has them on); ``mcp_servers`` are every
    session's."""
    made: list[ScriptedProvider] = []

    def factory() -> ScriptedProvider:
        made.append(ScriptedProvider(script()))
        return made[-1]

    workspace = tmp_path / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
        gateway = Gateway(
            host,
            token=TOKEN,
            port=0,
            defaults=SessionDefaults(
                provider_factory=factory,
                tools=tools,
                workspace_dir=workspace,
                approve=approve,  # type: ignore[arg-type]
                mcp_servers=mcp_servers or {},
            ),
            titles=titles,
        )
        console = ConsoleServer(listen_host="127.0.0.1", port=0)
        await nursery.start(console.run)
        gateway.allow_origin(f"http://127.0.0.1:{console.port}")  # the page's origin
        server = Stack(host, gateway, console, made, nursery)
        await server.start_gateway()
        yield server
        nursery.cancel_scope.cancel()
    for provider in made:
        assert provider.violations == []


class Page:
    """One browser tab over the DevTools protocol: evaluate JavaScript, poll the DOM."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._ids = 0

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._ids += 1
        await self.ws.send_message(
            json.dumps({"id": self._ids, "method": method, "params": params or {}})
        )
        while True:  # events (none are enabled, but) are skipped
            message = json.loads(await self.ws.get_message())
            if message.get("id") == self._ids:
                assert "error" not in message, message
                result: dict[str, Any] = message["result"]
                return result

    async def js(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        assert "exceptionDetails" not in result, (expression, result["exceptionDetails"])
        return result["result"].get("value")

    async def wait_for(self, expression: str, bound_s: float = BOUND_S) -> Any:
        """Poll until ``expression`` is truthy (an exception counts as not yet: the page
        may be loading); on timeout fail with the log's text."""
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (_) {{ return false; }} }})()"
        with trio.move_on_after(bound_s):
            while True:
                value = await self.js(guarded)
                if value:
                    return value
                await trio.sleep(0.05)
        log = await self.js("document.querySelector('#log').innerText")
        error = await self.js("document.querySelector('#error').textContent")
        status = await self.js("document.querySelector('#status').textContent")
        raise AssertionError(
            f"timed out waiting for {expression}\nstatus: {status}\nerror: {error}\nlog:\n{log}"
        )

    async def type_and_send(self, text_value: str, *, enter: bool = False) -> None:
        await self.js(f"document.querySelector('#prompt').value = {json.dumps(text_value)}")
        if enter:
            await self.js(
                "document.querySelector('#prompt').dispatchEvent(new KeyboardEvent('keydown',"
                " {key: 'Enter', bubbles: true, cancelable: true}))"
            )
        else:
            await self.click("#send")

    async def click(self, selector: str) -> None:
        await self.wait_for(
            f"(() => {{ const b = document.querySelector({json.dumps(selector)});"
            " return !!b && !b.disabled; })()"
        )
        await self.js(f"document.querySelector({json.dumps(selector)}).click()")

    async def count(self, selector: str) -> int:
        value = await self.js(f"document.querySelectorAll({json.dumps(selector)}).length")
        return int(value)

    async def texts(self, selector: str) -> list[str]:
        value = await self.js(
            f"[...document.querySelectorAll({json.dumps(selector)})].map(e => e.textContent)"
        )
        return [str(v) for v in value]


def _kill_group(process: trio.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


@asynccontextmanager
async def chromium(tmp_path: Path) -> AsyncIterator[Page]:
    """A headless Chromium on a blank tab, in its own process group (killed at exit)."""
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    log_path = tmp_path / "chromium.log"
    with log_path.open("wb") as log:
        process = await trio.lowlevel.open_process(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--window-size=1100,760",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        with trio.fail_after(BOUND_S * 3):
            port_file = profile / "DevToolsActivePort"
            while True:
                assert process.returncode is None, log_path.read_text(errors="replace")
                lines = port_file.read_text().splitlines() if port_file.exists() else []
                if lines and lines[0].strip().isdigit():
                    break
                await trio.sleep(0.05)
            port = int(lines[0])
            async with httpx.AsyncClient(timeout=BOUND_S) as http:
                while True:
                    targets = (await http.get(f"http://127.0.0.1:{port}/json/list")).json()
                    pages = [t for t in targets if t.get("type") == "page"]
                    if pages:
                        break
                    await trio.sleep(0.05)
        async with open_websocket_url(
            pages[0]["webSocketDebuggerUrl"],
            max_message_size=64 << 20,
            connect_timeout=BOUND_S,
            disconnect_timeout=BOUND_S,
        ) as ws:
            yield Page(ws)
    finally:
        with trio.CancelScope(shield=True):
            _kill_group(process, signal.SIGTERM)
            with trio.move_on_after(5):
                await process.wait()
            _kill_group(process, signal.SIGKILL)  # the leader and whatever it left behind
            with trio.move_on_after(5):
                await process.wait()


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no `chromium` on PATH (Debian: apt-get install chromium; .ci/run installs it)",
)

SUBSCRIBED = "document.querySelector('#log').dataset.subscribed"


LISTED = "document.querySelector('#sessions').dataset.loaded === 'true'"


async def open_console(page: Page, server: Stack) -> None:
    """Load the console and wait until it is connected and has listed the sessions."""
    await page.send("Page.navigate", {"url": server.page_url})
    await page.wait_for(
        f"{LISTED} && document.querySelector('#status').textContent.startsWith('connected')"
    )


async def first_prompt(page: Page, server: Stack, prompt: str, *, enter: bool = False) -> str:
    """Send the first prompt of a console with no session: it creates one, subscribes to
    it and runs the prompt there. Returns the session's id."""
    assert server.gateway.owned("default") == frozenset()
    await page.type_and_send(prompt, enter=enter)
    session_id = str(await page.wait_for(SUBSCRIBED))
    assert server.gateway.owned("default") == {session_id}
    assert await page.js("document.querySelector('#session-id').textContent") == session_id
    return session_id


def task_end_rows(status: str) -> str:
    return f"[data-type=task_end][data-status={status}]"


@needs_chromium
async def test_browser_runs_a_prompt_and_approves_a_tool_call(
    tmp_path: Path, lookup: Lookup
) -> None:
    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(text("Hello from the scripted model, streamed word by word."),)),
            Reply(blocks=(text("Let me look that up."), tool_call("c1", "lookup", key="a"))),
            Reply(blocks=(text("The value of a is value-a."),)),
        ]

    started = time.monotonic()
    with trio.fail_after(BROWSER_BOUND_S):
        async with (
            stack(tmp_path, script, tools=[lookup.tool], approve="ask") as server,
            chromium(tmp_path) as page,
        ):
            await open_console(page, server)
            # The token left the address bar; the page's own style applies (CSP hashes).
            assert await page.js("location.hash") == ""
            assert (
                await page.js("getComputedStyle(document.querySelector('#send')).backgroundColor")
                == "rgb(31, 122, 77)"
            )
            assert await page.js("document.querySelector('#send').textContent") == "Run"
            assert await page.js("document.querySelector('#log').getAttribute('role')") == "log"

            # A prompt (sent with Enter): its streamed reply, then the task's summary line.
            session_id = await first_prompt(page, server, "Say hello", enter=True)
            await page.wait_for(
                f"document.querySelectorAll('{task_end_rows('completed')}').length === 1"
            )
            assert await page.texts("[data-type=user_msg]") == ["YouSay hello"]
            assert await page.texts("[data-type=model_msg]") == [
                "Hello from the scripted model, streamed word by word."
            ]
            assert await page.count("[data-type=partial_text]") == 0  # replaced by model_msg
            summary = (await page.texts("[data-type=task_end]"))[0]
            assert re.fullmatch(r"Task completed · 1 turn · \d+ tokens · \d+\.\d\d s", summary)
            assert await page.js("document.querySelector('#prompt').value") == ""

            # A tool call under --approve ask: Allow / Deny / Always; Allow runs it.
            await page.type_and_send("Look up a")
            allow = "[data-type=approval_request] [data-testid=approve-allow]"
            await page.wait_for(f"!!document.querySelector('{allow}')")
            buttons = await page.texts("[data-type=approval_request] button")
            assert buttons == ["Allow", "Deny", "Always"]
            assert lookup.calls == []
            assert await page.js("document.querySelector('#send').textContent") == "Steer"
            await page.click(allow)
            await page.wait_for(
                f"document.querySelectorAll('{task_end_rows('completed')}').length === 2"
            )
            assert lookup.calls == ["a"]
            # The answer in plain words (protocols.wording), on the request and as its row.
            assert await page.texts("[data-type=approval_decision]") == ["lookup: allowed by you"]
            answered = "[data-type=approval_request][data-decision=allow]"
            assert await page.texts(f"{answered} .approval-answer") == ["— allowed by you"]
            assert await page.count(allow) == 0  # the buttons gave way to the answer
            outputs = await page.texts("[data-type=tool_call_output][data-status=ok]")
            assert outputs == ["lookup → okvalue-a"]
            calls = await page.texts("[data-type=model_msg][data-call-id=c1]")
            assert calls == ['Tool call lookup{"key":"a"}']
            assert (await page.texts("[data-type=model_msg]"))[-1] == "The value of a is value-a."
            assert await page.js("document.querySelector('#send').textContent") == "Run"
            assert await page.js("document.querySelector('#interrupt').disabled") is True

            # The session is listed; a new page load replays the same conversation.
            listed = await page.texts("#sessions button .sid")
            assert listed == [session_id]
            log_before = await page.js("document.querySelector('#log').innerText")

            # The gateway goes away and comes back: the page reconnects by itself and
            # resubscribes after the last seq it saw (nothing shown twice).
            await page.js("document.querySelector('#log').dataset.subscribed = ''")
            await server.restart_gateway()
            await page.wait_for(SUBSCRIBED)  # Chromium notices the close after about 2 s
            assert (await page.js("document.querySelector('#status').textContent")).startswith(
                "connected"
            )
            assert await page.js("document.querySelector('#log').innerText") == log_before
            await page.send("Page.reload")
            await page.wait_for(
                f"{SUBSCRIBED} && document.querySelectorAll("
                f"'{task_end_rows('completed')}').length === 2"
            )
            assert await page.js("document.querySelector('#log').innerText") == log_before

            shot = await page.send("Page.captureScreenshot", {"format": "png"})
            png = base64.b64decode(shot["data"])
            await trio.Path(tmp_path / "console.png").write_bytes(png)
            if SCREENSHOT_COPY:  # to look at it: GREENROOM_CONSOLE_SCREENSHOT=/tmp/console.png
                await trio.Path(SCREENSHOT_COPY).write_bytes(png)

            # A phone-sized screen: one column, nothing wider than the screen.
            await page.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": 390, "height": 800, "deviceScaleFactor": 1, "mobile": True},
            )
            await page.wait_for("innerWidth === 390")
            assert await page.js("document.documentElement.scrollWidth <= innerWidth") is True
            aside_bottom = await page.js(
                "document.querySelector('aside').getBoundingClientRect().bottom"
            )
            log_top = await page.js("document.querySelector('#log').getBoundingClientRect().top")
            assert aside_bottom <= log_top  # the session list sits above the conversation
            narrow = await page.send("Page.captureScreenshot", {"format": "png"})
            if SCREENSHOT_COPY:
                await trio.Path(SCREENSHOT_COPY + ".narrow.png").write_bytes(
                    base64.b64decode(narrow["data"])
                )
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    print(f"browser test took {time.monotonic() - started:.1f} s")


@needs_chromium
async def test_browser_steers_and_interrupts_a_running_task(tmp_path: Path, gates: Gates) -> None:
    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(tool_call("c1", "wait", key="a"),)),
            Reply(blocks=(text("Done, with your note."),)),
            Reply(blocks=(text("Waiting again."), tool_call("c2", "wait", key="b"))),
        ]

    with trio.fail_after(BROWSER_BOUND_S):
        async with (
            stack(tmp_path, script, tools=[gates.tool()], approve="all") as server,
            chromium(tmp_path) as page,
        ):
            await open_console(page, server)
            await first_prompt(page, server, "Start waiting")
            await gates.started("a")
            # The page knows a task runs: the button steers.
            await page.wait_for("document.querySelector('#send').textContent === 'Steer'")
            await page.wait_for("!document.querySelector('#interrupt').disabled")
            await page.type_and_send("also consider this")
            # At once a queued row (the tool still blocks: nothing can have been delivered)...
            queued = "[data-type=user_msg].steering[data-state=queued]"
            await page.wait_for(f"!!document.querySelector('{queued}')")
            assert await page.texts(queued) == ["Steeringqueuedalso consider this"]
            await page.wait_for("document.querySelector('#prompt').value === ''")  # answered
            await page.type_and_send("and this too")
            await page.wait_for("document.querySelector('#prompt').value === ''")
            assert await page.texts(queued) == [
                "Steeringqueuedalso consider this",
                "Steeringqueuedand this too",
            ]
            assert await page.count("[data-state=delivered]") == 0
            gates.release("a")
            await page.wait_for(f"!!document.querySelector('{task_end_rows('completed')}')")
            request = server.providers[0].requests[1]
            assert any(
                "[user_steering]" in t and "also consider this" in t
                for t in texts_of(last_user(request))
            )
            # ...then delivered, when their one user_msg (kind steering) arrived.
            steering = await page.texts("[data-type=user_msg].steering")
            assert steering == ["Steeringdeliveredalso consider this\nand this too"]
            assert await page.count(queued) == 0
            assert await page.texts("[data-type=tool_call_output]") == ["wait → okdone a"]

            # Interrupt: the blocked tool is cancelled and the task ends aborted.
            await page.wait_for("document.querySelector('#send').textContent === 'Run'")
            await page.type_and_send("Wait again")
            await gates.started("b")
            await page.click("#interrupt")
            await page.wait_for(f"!!document.querySelector('{task_end_rows('aborted')}')")
            assert gates.cancelled == ["b"]
            assert await page.count("[data-type=abort]") == 1
            interrupted = await page.texts("[data-type=tool_call_output][data-status=interrupted]")
            assert interrupted == ["wait → interrupted[interrupted: tool aborted by user]"]
            await page.wait_for("document.querySelector('#interrupt').disabled")
            assert await page.js("document.querySelector('#session-state').textContent") == "idle"


@needs_chromium
async def test_browser_counts_down_a_retry_and_retries_now_or_stops(tmp_path: Path) -> None:
    overloaded = ModelError(
        kind="failed", message="overloaded", status_code=529, retry_after_s=60.0
    )

    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(text("Half an answer"),), fail=overloaded, fail_after_blocks=1),
            Reply(blocks=(text("Recovered."),)),
            Reply(blocks=(text("Again half"),), fail=overloaded, fail_after_blocks=1),
        ]

    failed = "[data-type=request_end][data-status=failed]"
    with trio.fail_after(BROWSER_BOUND_S):
        async with stack(tmp_path, script) as server, chromium(tmp_path) as page:
            await open_console(page, server)
            await first_prompt(page, server, "Try it")
            # The failure, its attempt and a live countdown from the 60 s retry-after.
            await page.wait_for(f"!!document.querySelector('{failed} [data-testid=retry-now]')")
            row = (await page.texts(failed))[0]
            assert row.startswith("Request failed (failed), attempt 1overloaded")
            first = await page.js(f"document.querySelector('{failed} .countdown').textContent")
            assert re.fullmatch(r" — retrying in (59|60)\.\d s", first), first
            await page.wait_for(
                f"document.querySelector('{failed} .countdown').textContent !== {json.dumps(first)}"
            )
            await page.click(f"{failed} [data-testid=retry-now]")
            await page.wait_for(f"!!document.querySelector('{task_end_rows('completed')}')")
            assert (await page.texts("[data-type=model_msg]"))[-1] == "Recovered."
            assert await page.js(f"document.querySelector('{failed} .countdown').textContent") == ""
            assert await page.js(
                f"[...document.querySelectorAll('{failed} button')].every(b => b.disabled)"
            )
            # Stop ends the wait with an interrupt.
            await page.wait_for("document.querySelector('#send').textContent === 'Run'")
            await page.type_and_send("Once more")
            await page.wait_for(f"document.querySelectorAll('{failed}').length === 2")
            await page.js(
                f"[...document.querySelectorAll('{failed} [data-testid=retry-stop]')].at(-1)"
                ".click()"
            )
            await page.wait_for(f"!!document.querySelector('{task_end_rows('aborted')}')")
            assert len(server.providers[0].requests) == 3


async def test_connections_beyond_the_cap_wait_in_the_backlog() -> None:
    """The console holds at most ``max_connections`` connections, and a few more it
    answers 503 (``CONSOLE_SLACK``); further connections are not accepted at all (they
    wait in the kernel's backlog, spending no file descriptor) until a place is free.
    No sleeps: after ``wait_all_tasks_blocked`` the server has accepted what it will."""
    cap = 2
    with trio.fail_after(BOUND_S):
        async with console_server(max_connections=cap, read_timeout_s=BOUND_S) as server:
            idle = [await trio.open_tcp_stream("127.0.0.1", server.port) for _ in range(cap)]
            await trio.testing.wait_all_tasks_blocked()
            crowd = [
                await trio.open_tcp_stream("127.0.0.1", server.port)
                for _ in range(CONSOLE_SLACK + 20)
            ]
            await trio.testing.wait_all_tasks_blocked()
            assert server.open_connections == cap + CONSOLE_SLACK
            # Refused cleanly: the first of the crowd is answered 503 and closed.
            answer = b""
            while chunk := await crowd[0].receive_some(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503 ") and b"too many connections" in answer
            for stream in crowd + idle:
                await stream.aclose()
            # Every place is given back (the crowd's waiting connections are accepted,
            # answered and closed in turn), and the page is served again.
            await trio.testing.wait_all_tasks_blocked()
            assert server.open_connections == 0
            assert (await raw_request(server.port, get())).status == 200
