"""DNS rebinding (R-SEC-4): the gateway and the console answer only to their own names.

A page of ``evil.example`` whose name the attacker points at 127.0.0.1 once it is loaded is,
for the browser, of the same origin as ``http://evil.example:PORT`` — which is then the
gateway or the console. Its plain GETs carry no ``Origin``, so the origin checks let them
through: the console served its page under the attacker's name (with a policy letting it
open websockets to that name), and the gateway looked at the page's guessed tokens, each a
wrong token of the loopback address, until the address's own clients were throttled too.
Now a request whose ``Host`` header names neither ``localhost``, the listen host, an IP
address nor a name the owner allowed (``serve --allow-host``) is answered 421, before
anything else, on the websocket, the HTTP endpoints and the console alike.

Real clients: trio-websocket over a real TCP stream (the ``Host`` it sends is the one given
to it), httpx, raw HTTP bytes to the console; real gateways on port 0.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from test_console import console_server, get, raw_request
from test_gateway import BOUND_S, TOKEN, Client, serving
from test_gateway_ag_ui import posted, run_input
from trio_websocket import ConnectionRejected, WebSocketConnection, wrap_client_stream

from greenroom.actors.apps.parser import build_parser
from greenroom.actors.gateway import GatewayLimits
from tests.support.serve_console import serve_console

EVIL = "evil.example"


@asynccontextmanager
async def websocket(
    port: int, host: str, headers: list[tuple[bytes, bytes]] | None = None
) -> AsyncIterator[WebSocketConnection]:
    """A websocket to the gateway on 127.0.0.1:``port`` whose handshake's ``Host`` header
    is ``host`` (what a browser sends for a page reached by that name)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with trio.open_nursery() as nursery:
        ws = await wrap_client_stream(
            nursery, stream, host, "/v1", extra_headers=headers or [], message_queue_size=64
        )
        try:
            yield ws
        finally:
            await ws.aclose()


def bearer(token: str = TOKEN) -> list[tuple[bytes, bytes]]:
    return [(b"Authorization", f"Bearer {token}".encode())]


async def rejected(port: int, host: str, headers: list[tuple[bytes, bytes]]) -> ConnectionRejected:
    """The refusal of a handshake (raised in the client's reader task, so in a group)."""
    found: list[ConnectionRejected] = []
    try:
        async with websocket(port, host, headers):
            pass
    except* ConnectionRejected as group:
        found.extend(_leaves(group))
    assert len(found) == 1, f"not refused: {host}"
    return found[0]


def _leaves(group: BaseExceptionGroup[ConnectionRejected]) -> list[ConnectionRejected]:
    leaves: list[ConnectionRejected] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


async def test_a_websocket_handshake_for_another_host_name_is_refused_421(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server:
            port = server.gateway.port
            for host in (f"{EVIL}:{port}", EVIL, f"127.0.0.1.{EVIL}:{port}", "localhost.evil"):
                refused = await rejected(port, host, bearer())
                assert refused.status_code == 421, host
                assert refused.body is not None and b"misdirected request" in refused.body
                assert b"--allow-host" in refused.body
            # The names the gateway is reached by, and any IP address, are its own.
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "[::1]:1"):
                async with websocket(port, host, bearer()) as ws:
                    assert await Client(ws).result("session.list") == {"sessions": []}
            # The owner adds a name of its own.
            server.gateway.allow_host("Greenroom.Test")
            async with websocket(port, f"greenroom.test:{port}", bearer()) as ws:
                assert await Client(ws).result("session.list") == {"sessions": []}


async def test_a_rebound_pages_wrong_tokens_do_not_throttle_loopback(tmp_path: Path) -> None:
    """Refused for its name before its token is looked at: the page cannot spend the
    loopback address's wrong-token budget and lock its clients out."""
    limits = GatewayLimits(max_auth_failures_per_address=2)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits) as server:
            port = server.gateway.port
            for guess in range(4):
                refused = await rejected(port, f"{EVIL}:{port}", bearer(f"guess-{guess}"))
                assert refused.status_code == 421
            async with websocket(port, f"127.0.0.1:{port}", bearer()) as ws:
                assert await Client(ws).result("session.list") == {"sessions": []}


async def test_an_http_endpoint_request_for_another_host_name_is_refused_421(
    tmp_path: Path,
) -> None:
    limits = GatewayLimits(max_auth_failures_per_address=2)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, ag_ui=True, limits=limits) as server:
            port = server.gateway.port
            url = f"http://127.0.0.1:{port}/ag-ui"
            foreign = {"Host": f"{EVIL}:{port}"}
            refused = await posted(url, run_input("t1", "r1", "hi"), headers=foreign)
            assert refused.status == 421
            assert "misdirected request" in refused.body["error"]["message"]
            for guess in range(4):
                wrong = await posted(url, run_input("t1", "r1"), token=f"g{guess}", headers=foreign)
                assert wrong.status == 421
            assert server.providers == []  # nothing was run
            mine = await posted(
                url, run_input("t1", "r1", "hi"), headers={"Host": f"localhost:{port}"}
            )
            assert mine.status == 200 and mine.events[-1][1]["type"] == "RUN_FINISHED"


async def test_the_console_is_not_served_under_another_host_name() -> None:
    with trio.fail_after(BOUND_S):
        async with console_server(ws_port=4321) as server:
            refused = await raw_request(server.port, get(host=f"{EVIL}:{server.port}"))
            assert refused.status == 421
            assert b"misdirected request" in refused.body and EVIL.encode() in refused.body
            assert "content-security-policy" not in refused.headers
            for host in (f"127.0.0.1:{server.port}", "localhost", "[::1]"):
                served = await raw_request(server.port, get(host=host))
                assert served.status == 200, host
            server.host_names.add("greenroom.test")
            served = await raw_request(server.port, get(host=f"greenroom.test:{server.port}"))
            assert served.status == 200
            assert "ws://greenroom.test:4321" in served.headers["content-security-policy"]


async def test_serve_allow_host_names_the_gateway_and_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run_serve(allowed_hosts=…)`` (``--allow-host``): both servers answer to the name,
    and the console's page reached by it may open the gateway's websocket."""
    (tmp_path / "ws").mkdir()
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            gateway, console, token = await serve_console(
                tmp_path, capsys, nursery, allowed_hosts=["greenroom.test"]
            )
            page = await raw_request(console, get(host=f"greenroom.test:{console}"))
            assert page.status == 200
            assert (await raw_request(console, get(host=f"{EVIL}:{console}"))).status == 421
            origin = [(b"Origin", f"http://greenroom.test:{console}".encode())]
            async with websocket(
                gateway, f"greenroom.test:{gateway}", bearer(token) + origin
            ) as ws:
                assert await Client(ws).result("session.list") == {"sessions": []}
            evil_origin = [(b"Origin", f"http://{EVIL}:{console}".encode())]
            refused = await rejected(gateway, f"{EVIL}:{gateway}", bearer(token) + evil_origin)
            assert refused.status_code == 421
            nursery.cancel_scope.cancel()


def test_the_allow_host_flag_takes_names_without_a_port(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--allow-host", "a.lan", "--allow-host", "b"])
    assert args.allow_host == ["a.lan", "b"]
    for bad in ("a.lan:8765", "http://a.lan", "*", "a/b"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--allow-host", bad])
        assert "--allow-host: expected a host name" in capsys.readouterr().err
