"""The console page of ``greenroom serve`` hands its token to the gateway alone (R-SEC-4).

The page connects to the websocket its URL's ``?ws=`` names and sends it the token (from
the URL's fragment, the tab's ``sessionStorage`` or the token box). A link to the real
console with ``?ws=`` naming a listener another principal runs on the same host (a port
of its own: a tool's process, a session's server) made the page send that listener the
token, and with it every session of the token's principal: the page's
Content-Security-Policy let it open websockets to any port of the host. Now the policy
``serve`` gives the page names the gateway's port alone, and the browser refuses the
rest.

Driven in a real headless Chromium (skipped without ``chromium`` on ``PATH``), against
``run_serve`` as the command runs it; the test waits for one of two events, whichever
comes first: the impostor's listener receives the page's first frame, or the browser
reports the policy's refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from test_console import BROWSER_BOUND_S, Page, chromium, get, needs_chromium, raw_request
from trio_websocket import WebSocketRequest, serve_websocket

from tests.support.serve_console import serve_console

RECORD_REFUSALS = """
window.__refused = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__refused.push(event.blockedURI);
});
"""
"""Installed in the page before its own script: the connections the policy refused."""


async def test_the_serve_console_policy_names_the_gateways_port_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's ``connect-src``: websockets to the gateway's port of the serving host
    (by either of its names), no other port."""
    with trio.fail_after(BROWSER_BOUND_S):
        async with trio.open_nursery() as nursery:
            gateway_port, console_port, _ = await serve_console(tmp_path, capsys, nursery)
            response = await raw_request(console_port, get(host=f"localhost:{console_port}"))
            assert response.status == 200
            policy = response.headers["content-security-policy"]
            directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
            assert directives["connect-src"] == (
                f"ws://127.0.0.1:{gateway_port} ws://localhost:{gateway_port}"
            )
            nursery.cancel_scope.cancel()


@needs_chromium
async def test_a_console_link_naming_another_listener_does_not_get_the_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    got: list[str] = []
    impostor_got = trio.Event()

    async def impostor(request: WebSocketRequest) -> None:
        ws = await request.accept()
        got.append(str(await ws.get_message()))
        impostor_got.set()

    with trio.fail_after(BROWSER_BOUND_S):
        async with trio.open_nursery() as nursery:
            _, console_port, token = await serve_console(tmp_path, capsys, nursery)
            listener = await nursery.start(serve_websocket, impostor, "127.0.0.1", 0, None)
            impostor_port = listener.port
            async with chromium(tmp_path) as page:
                await page.send("Page.enable")  # scripts added below run only with it
                await page.send(
                    "Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_REFUSALS}
                )
                bait = (
                    f"http://127.0.0.1:{console_port}/?ws=ws://127.0.0.1:{impostor_port}/v1"
                    f"#token={token}"
                )
                await page.send("Page.navigate", {"url": bait})
                refused = await first_of(page, impostor_got)
            assert got == [], f"the console sent the impostor on port {impostor_port}: {got}"
            assert refused == [f"ws://127.0.0.1:{impostor_port}/v1"]
            nursery.cancel_scope.cancel()


async def first_of(page: Page, impostor_got: trio.Event) -> list[str] | None:
    """What the browser refused, once it refused something; None when the impostor got
    a frame first."""
    outcome: list[str] | None = None
    async with trio.open_nursery() as race:

        async def refusal() -> None:
            nonlocal outcome
            found = await page.wait_for(
                "window.__refused && window.__refused.length && window.__refused",
                BROWSER_BOUND_S,
            )
            outcome = json.loads(json.dumps(found))
            race.cancel_scope.cancel()

        async def leak() -> None:
            await impostor_got.wait()
            race.cancel_scope.cancel()

        race.start_soon(refusal)
        race.start_soon(leak)
    return outcome
