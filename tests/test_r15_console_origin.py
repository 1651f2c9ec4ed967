"""R-SEC-4: a name allowed with ``Gateway.allow_host`` once the console serves admits the
console's page reached by that name, as a name given before it served does. Real servers
(``run_serve`` on port 0), a real websocket handshake carrying the page's ``Origin``."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_g14_host_header import bearer, rejected, websocket
from test_gateway import BOUND_S, Client

from greenroom.actors.gateway.server import Gateway
from tests.support.serve_console import serve_console


async def test_r15_a_host_allowed_after_the_console_serves_admits_its_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the console's origins were fixed as it started: the page reached by a name
    allowed later was answered (200) but its handshake was refused (403)."""
    (tmp_path / "ws").mkdir()
    gateways: list[Gateway] = []
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            gateway, console, token = await serve_console(
                tmp_path, capsys, nursery, on_gateway=gateways.append
            )
            other = [(b"Origin", f"http://late.test:{console + 1}".encode())]
            gateways[0].allow_host("Late.Test.")
            origin = [(b"Origin", f"http://late.test:{console}".encode())]
            async with websocket(gateway, f"late.test:{gateway}", bearer(token) + origin) as ws:
                assert await Client(ws).result("session.list") == {"sessions": []}
            # Only the console's own port under the new name, not any origin of the name.
            refused = await rejected(gateway, f"late.test:{gateway}", bearer(token) + other)
            assert refused.status_code == 403
            nursery.cancel_scope.cancel()
