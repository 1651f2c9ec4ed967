"""A web front end on another origin drives ``serve --ag-ui`` with the real AG-UI client
(R-PROTO-2, R-SEC-4): ``HttpAgent`` of npm's ``@ag-ui/client``, bundled for the browser
with esbuild, in a page that headless Chromium loads from a small HTTP server of its own
on 127.0.0.1 — a different origin than the gateway's, admitted through the gateway's
allowed origins (CORS). The page runs a task whose scripted model calls a tool that needs
an approval (``--approve ask``: the run ends on an interrupt), then a second run that
resumes it with an ``allow``, ending with the tool's result and the answer; a page of an
origin that is not allowed is stopped by its browser before anything runs.

The packages come from the npm registry once and are kept in ``build/ag-ui-client/``
(pinned versions, installed without their install scripts; npm and esbuild run under a
timeout); without Chromium, npm or the registry the test is skipped with the reason.
Chromium is driven over the DevTools protocol on a websocket, as the console's tests do;
every wait is for an event (the browser's ``DevTools listening`` line, the page's load
event, the page's promise), each bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import Lookup
from test_gateway import TOKEN, lookup_script, serving
from trio_websocket import WebSocketConnection, open_websocket_url

ROOT = Path(__file__).resolve().parent.parent
CLIENT_PACKAGE = "@ag-ui/client@1.0.0"
ESBUILD_PACKAGE = "esbuild@0.28.2"
CACHE = ROOT / "build" / "ag-ui-client"
"""Where the installed packages and the bundle are kept between runs (git ignores
``build/``)."""

INSTALL_BOUND_S = 180.0
"""How long npm may take to fetch the packages; longer (no registry) skips the test."""

BUNDLE_BOUND_S = 60.0
BROWSER_BOUND_S = 60.0
CHROMIUM = shutil.which("chromium")
NPM = shutil.which("npm")

ENTRY = """\
import { HttpAgent } from "@ag-ui/client";
window.AgUi = { HttpAgent };
"""


# -- the client, from npm -------------------------------------------------------------------


def _cache_key() -> str:
    return f"{CLIENT_PACKAGE}+{ESBUILD_PACKAGE}".replace("@", "").replace("/", "-")


@pytest.fixture(scope="session")
def client_bundle() -> bytes:
    """The AG-UI client bundled for the browser (an IIFE that sets ``window.AgUi``):
    built once into :data:`CACHE`, then read from there. Skips the test, saying why, when
    npm or the registry cannot give it. (A fixture that runs before the test's trio loop,
    so its blocking work blocks nothing, and its skip keeps its reason.)"""
    cached = _cached_bundle()
    if cached is not None:
        return cached
    assert NPM is not None  # the test's skipif marks say why when it is missing
    # Built aside and renamed into place whole, so a run that stops halfway (or another
    # one at the same time) never leaves a half-built cache behind.
    work = _workdir()
    try:
        env = {
            **os.environ,
            "npm_config_update_notifier": "false",
            "npm_config_fund": "false",
            "npm_config_audit": "false",
        }
        try:
            installed = subprocess.run(
                [
                    NPM, "install", "--ignore-scripts", "--no-save", "--fetch-retries=1",
                    "--fetch-timeout=30000", CLIENT_PACKAGE, ESBUILD_PACKAGE,
                ],
                cwd=work,
                env=env,
                capture_output=True,
                timeout=INSTALL_BOUND_S,
                check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm install {CLIENT_PACKAGE} did not finish in {INSTALL_BOUND_S:.0f} s")
        if installed.returncode != 0:
            lines = installed.stderr.decode(errors="replace").strip().splitlines()
            pytest.skip(f"npm install {CLIENT_PACKAGE} failed: {' / '.join(lines[:3])}")
        bundled = subprocess.run(
            [
                str(work / "node_modules" / ".bin" / "esbuild"), "entry.js", "--bundle",
                "--format=iife", "--platform=browser", "--log-level=warning",
                "--outfile=bundle.js",
            ],
            cwd=work,
            capture_output=True,
            timeout=BUNDLE_BOUND_S,
            check=False,
        )  # fmt: skip
        assert bundled.returncode == 0, bundled.stderr.decode(errors="replace")
        return _keep(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cached_bundle() -> bytes | None:
    done = CACHE / _cache_key() / "bundle.js"
    return done.read_bytes() if done.is_file() else None


def _workdir() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="building-", dir=CACHE))
    (work / "package.json").write_text('{"name": "ag-ui-browser-test", "private": true}\n')
    (work / "entry.js").write_text(ENTRY)
    return work


def _keep(work: Path) -> bytes:
    """The bundle built in ``work``, which becomes the cache (unless another run's is
    there already: the same packages)."""
    bundle = (work / "bundle.js").read_bytes()
    with contextlib.suppress(OSError):
        work.rename(CACHE / _cache_key())
    return bundle


# -- the page's server, another origin ------------------------------------------------------


PAGE = """\
<!doctype html>
<meta charset="utf-8">
<title>AG-UI front end</title>
<script src="/bundle.js"></script>
<script>
const config = CONFIG;
// What the client delivers, for the test to read: one record per run.
window.agui = { runs: [], console: [] };
for (const level of ["warn", "error"]) {
  const original = console[level].bind(console);
  console[level] = (...args) => {
    window.agui.console.push(level + ": " + args.map(String).join(" "));
    original(...args);
  };
}
let agent = null;

async function run(parameters) {
  const record = { runId: parameters.runId, events: [], outcomes: [], error: null };
  window.agui.runs.push(record);
  try {
    await agent.runAgent(parameters, {
      onEvent({ event }) { record.events.push(event); },
      onRunFinishedEvent({ outcome, interrupts }) {
        record.outcomes.push({ outcome, interrupts: interrupts || [] });
      },
    });
  } catch (error) {
    record.error = String((error && error.message) || error);
  }
  record.pendingInterrupts = agent.pendingInterrupts;
  record.messages = agent.messages;
  return true;
}

window.start = (threadId) => {
  agent = new AgUi.HttpAgent({
    url: config.url,
    headers: { Authorization: "Bearer " + config.token },
    threadId,
  });
  agent.addMessage({ id: "user-1", role: "user", content: "look up a" });
  return run({ runId: "run-1" });
};

// Answers every interrupt the last run ended on: allow.
window.resume = () => run({
  runId: "run-2",
  resume: agent.pendingInterrupts.map((interrupt) => ({
    interruptId: interrupt.id,
    status: "resolved",
    payload: { decision: "allow" },
  })),
});
</script>
"""


@asynccontextmanager
async def page_server(files: dict[str, tuple[str, bytes]]) -> AsyncIterator[int]:
    """Serves ``files`` (path → content type, body) on 127.0.0.1 at a port of its own,
    one request per connection; yields the port. Anything else is 404."""

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            with trio.move_on_after(BROWSER_BOUND_S):  # a browser's idle preconnect
                while b"\r\n\r\n" not in head:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    head += chunk
            if b"\r\n\r\n" not in head:
                return
            _, _, rest = head.partition(b" ")
            target = rest.split(b" ", 1)[0].split(b"?", 1)[0].decode("latin-1")
            kind, body = files.get(target, ("text/plain", b"not found"))
            status = "200 OK" if target in files else "404 Not Found"
            response = (
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                "Connection: close\r\n\r\n"
            ).encode() + body
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(response)

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve, answer, 0)
        yield int(listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


# -- the browser ----------------------------------------------------------------------------


class DevTools:
    """The DevTools protocol over the browser's websocket, one tab attached (flat
    sessions). One caller at a time: :meth:`send` reads until its answer and keeps the
    events it reads meanwhile for :meth:`event`."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.session: str | None = None
        self._ids = 0
        self._events: list[dict[str, Any]] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._ids += 1
        frame: dict[str, Any] = {"id": self._ids, "method": method, "params": params}
        if self.session is not None:
            frame["sessionId"] = self.session
        await self.ws.send_message(json.dumps(frame))
        while True:
            message = json.loads(await self.ws.get_message())
            if message.get("id") == self._ids:
                assert "error" not in message, (method, message)
                result: dict[str, Any] = message["result"]
                return result
            if "method" in message:
                self._events.append(message)

    async def event(self, method: str) -> dict[str, Any]:
        """The tab's next event ``method`` (one that came while :meth:`send` waited for
        an answer counts)."""
        while True:
            for index, message in enumerate(self._events):
                if message["method"] == method and message.get("sessionId") == self.session:
                    del self._events[index]
                    params: dict[str, Any] = message.get("params", {})
                    return params
            self._events.append(json.loads(await self.ws.get_message()))

    async def open_tab(self) -> None:
        target = await self.send("Target.createTarget", url="about:blank")
        attached = await self.send(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        self.session = attached["sessionId"]
        await self.send("Page.enable")

    async def load(self, url: str) -> None:
        """Navigate the tab and wait for the new page's load event."""
        self._events.clear()  # the last page's
        await self.send("Page.navigate", url=url)
        await self.event("Page.loadEventFired")

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page, once its promise settles."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        assert "exceptionDetails" not in result, (expression, result["exceptionDetails"])
        return result["result"].get("value")

    async def agui(self) -> dict[str, Any]:
        """What the page collected (``window.agui``)."""
        collected: dict[str, Any] = json.loads(await self.evaluate("JSON.stringify(window.agui)"))
        return collected


async def _read_log(
    stderr: trio.abc.ReceiveStream, log: bytearray, *, task_status: trio.TaskStatus[str]
) -> None:
    """Keep Chromium's stderr in ``log`` (so it never fills its pipe); ready with the
    browser's DevTools URL once Chromium has printed it."""
    listening = False
    async for chunk in stderr:
        log += chunk
        match = None if listening else re.search(rb"DevTools listening on (ws://\S+)", log)
        if match is not None:
            listening = True
            task_status.started(match.group(1).decode())
    if not listening:
        raise AssertionError(f"chromium ended before listening:\n{log.decode(errors='replace')}")


def _kill_group(process: trio.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


@asynccontextmanager
async def chromium(tmp_path: Path) -> AsyncIterator[DevTools]:
    """A headless Chromium in its own process group (killed at exit), a blank tab
    attached."""
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    process = await trio.lowlevel.open_process(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-extensions", f"--user-data-dir={profile}", "--remote-debugging-port=0",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    assert process.stderr is not None
    log = bytearray()
    try:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(_read_log, process.stderr, log)
            async with open_websocket_url(
                url, max_message_size=64 << 20, connect_timeout=10, disconnect_timeout=10
            ) as ws:
                devtools = DevTools(ws)
                await devtools.open_tab()
                yield devtools
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            _kill_group(process, signal.SIGTERM)
            with trio.move_on_after(5):
                await process.wait()
            _kill_group(process, signal.SIGKILL)  # the leader and whatever it left behind
            with trio.move_on_after(5):
                await process.wait()


# -- the test ---------------------------------------------------------------------------------


def of(run: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [event for event in run["events"] if event["type"] == kind]


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no `chromium` on PATH (Debian: apt-get install chromium; .ci/run installs it)",
)
@pytest.mark.skipif(
    NPM is None, reason="no `npm` on PATH: the AG-UI client comes from the npm registry"
)
async def test_the_npm_ag_ui_client_in_a_browser_runs_is_interrupted_and_resumes(
    tmp_path: Path, lookup: Lookup, client_bundle: bytes
) -> None:
    with trio.fail_after(BROWSER_BOUND_S):
        async with serving(tmp_path, lookup_script, tools=[lookup.tool], ag_ui=True) as server:
            config = {"url": f"http://127.0.0.1:{server.gateway.port}/ag-ui", "token": TOKEN}
            html = PAGE.replace("CONFIG", json.dumps(config)).encode()
            files = {
                "/": ("text/html; charset=utf-8", html),
                "/bundle.js": ("text/javascript; charset=utf-8", client_bundle),
            }
            async with (
                page_server(files) as port,
                page_server(files) as foreign_port,
                chromium(tmp_path) as browser,
            ):
                # The front end's origin is allowed the way the console's is.
                server.gateway.allow_origin(f"http://127.0.0.1:{port}")
                await browser.load(f"http://127.0.0.1:{port}/")
                assert await browser.evaluate("typeof AgUi.HttpAgent") == "function"

                await browser.evaluate("start('browser-thread')")
                (first,) = (await browser.agui())["runs"]
                assert first["error"] is None, first
                assert lookup.calls == []  # waits for a person
                types = [event["type"] for event in first["events"]]
                assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED", types
                assert "".join(e["delta"] for e in of(first, "TEXT_MESSAGE_CONTENT")) == (
                    "Checking."
                )
                (start,) = of(first, "TOOL_CALL_START")
                assert (start["toolCallId"], start["toolCallName"]) == ("c1", "lookup")
                arguments = "".join(e["delta"] for e in of(first, "TOOL_CALL_ARGS"))
                assert json.loads(arguments) == {"key": "a"}
                assert of(first, "TOOL_CALL_END")
                (outcome,) = first["outcomes"]
                assert outcome["outcome"] == "interrupt"
                (interrupt,) = first["pendingInterrupts"]
                assert (interrupt["id"], interrupt["toolCallId"]) == ("c1", "c1")
                assert interrupt["reason"] == "tool_approval"

                await browser.evaluate("resume()")
                _, second = (await browser.agui())["runs"]
                assert second["error"] is None, second
                assert lookup.calls == ["a"]
                (result,) = of(second, "TOOL_CALL_RESULT")
                assert (result["toolCallId"], result["content"]) == ("c1", "value-a")
                assert "".join(e["delta"] for e in of(second, "TEXT_MESSAGE_CONTENT")) == "Done."
                assert second["events"][-1]["type"] == "RUN_FINISHED"
                assert [o["outcome"] for o in second["outcomes"]] == ["success"]
                assert second["pendingInterrupts"] == []
                # The client's own picture of the thread: the call, its result, the answer.
                said = [(m["role"], m.get("content")) for m in second["messages"]]
                assert said[0] == ("user", "look up a")
                assert ("tool", "value-a") in said and said[-1] == ("assistant", "Done.")
                calls = [m for m in second["messages"] if m.get("toolCalls")]
                assert [c["id"] for m in calls for c in m["toolCalls"]] == ["c1"]
                # The thread is the gateway's session; the client took every event as it
                # was (no warning about a shape it had to translate).
                assert server.gateway.owned("default") == {"browser-thread"}
                assert (await browser.agui())["console"] == []

                # A page of an origin that is not allowed: its browser stops it at the
                # preflight, and nothing reaches the gateway's sessions.
                await browser.load(f"http://127.0.0.1:{foreign_port}/")
                await browser.evaluate("start('foreign-thread')")
                (refused,) = (await browser.agui())["runs"]
                assert refused["error"] is not None and refused["events"] == [], refused
                assert server.gateway.owned("default") == {"browser-thread"}
                assert lookup.calls == ["a"]
