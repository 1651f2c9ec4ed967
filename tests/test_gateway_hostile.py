"""Hostile clients (R-SEC-9, with R-SEC-1 and R-SEC-4): nothing a client sends grows the
server's memory without bound, and one principal cannot lock out another. Real
trio-websocket clients against the real gateway on 127.0.0.1 port 0; every test is bounded
by ``trio.fail_after`` and synchronised by messages and events, never sleeps. What the
server holds for a client is read from its outbox's counters (``Outbox.size``,
``Outbox.peak``), not from the process's memory."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from test_gateway import BOUND_S, TOKEN, connect, serving
from trio_websocket import ConnectionClosed

from greenroom.actors.gateway import GatewayLimits
from greenroom.protocols import jsonrpc

HUGE = 900_000
"""About the size of the values the report used (0.9 MB)."""


def call(request_id: Any, method: str, **params: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params:
        frame["params"] = params
    return frame


# -- every frame counts against the outbox -----------------------------------------------------


async def test_a_client_that_never_reads_is_cut_off_before_its_replies_pass_the_cap(
    tmp_path: Any,
) -> None:
    """R-SEC-9: a client that never reads sends batches of calls with long method names
    (each answered -32601). Its replies — not subscription outputs — fill the kernel's
    buffers, then its outbox: once a reply does not fit under ``max_pending_bytes`` the
    connection is closed (1008, naming the bound), and what the server held for it never
    passed the bound. The rate limit is lifted so that only the outbox bound stops it."""
    cap = 64 * 1024
    # The server waits close_timeout_s for the close reply this client never reads to.
    limits = GatewayLimits(
        rate_per_s=1e9, burst=10**9, max_pending_bytes=cap, close_timeout_s=0.1
    )
    name = "m" * 9_000  # 100 of them: a frame just under the 1 MiB frame limit
    with trio.fail_after(BOUND_S * 3):
        async with serving(tmp_path, limits=limits) as server, connect(server) as client:
            await client.result("session.list")
            [connection] = server.gateway._connections
            outbox = connection.outbox
            sent = 0
            with pytest.raises(ConnectionClosed):
                while connection.close_with is None:
                    batch = [call(f"{sent}-{i}", name) for i in range(100)]
                    await client.send(batch)
                    sent += 1
                    await trio.testing.wait_all_tasks_blocked()
                    assert outbox.size <= cap
                    assert sent < 2_000, "never cut off"
                # Cut off: the server has closed the socket under the client.
                while True:
                    await client.send(call("after", "session.list"))
                    await trio.testing.wait_all_tasks_blocked()
            assert connection.close_with == (
                1008,
                f"client too slow: more than {cap} bytes not read",
            )
            assert outbox.overflowed is not None
            assert 0 < outbox.peak <= cap
            assert connection not in server.gateway._connections
            # The server serves the next client as before.
            async with connect(server) as again:
                assert await again.result("session.list") == {"sessions": []}


# -- echoed values stay small ------------------------------------------------------------------


async def test_a_huge_id_before_authentication_gets_a_bounded_answer(tmp_path: Any) -> None:
    """R-SEC-9: before authenticating, a request whose id is 0.9 MB (or an integer of 200
    digits) is answered -32600 with a null id, in a few hundred bytes; an id of
    ``MAX_ID_CHARS`` characters is still answered with itself."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server, token=None) as client:
            for huge in ("i" * HUGE, 10**200):
                await client.send(json.dumps(call(huge, "session.list")))
                raw = await client.ws.get_message()
                assert len(raw) < 500
                answer = json.loads(raw)
                assert answer["id"] is None
                assert answer["error"]["code"] == jsonrpc.INVALID_REQUEST
                assert f"longer than {jsonrpc.MAX_ID_CHARS}" in answer["error"]["message"]
            longest = "j" * jsonrpc.MAX_ID_CHARS
            await client.send(call(longest, "session.list"))
            answer = await client.response(longest)
            assert answer["error"]["code"] == jsonrpc.UNAUTHORIZED
            # The connection carries on.
            assert (await client.result("initialize", {"token": TOKEN}))["client_id"]


async def test_values_an_error_repeats_are_clipped(tmp_path: Any) -> None:
    """R-SEC-9: a 0.9 MB method name, parameter name, setting name, setting value or
    block type is repeated in its error only up to ``MAX_ECHO_CHARS`` characters, with a
    note of how much was left out; every answer stays under a few hundred bytes."""
    big = "x" * HUGE
    frames: list[dict[str, Any]] = [
        call(1, big),
        call(2, "session.list", **{big: 1}),
        call(3, "session.create", settings={big: 1}),
        call(4, "session.create", settings={"compact_mode": big}),
        call(5, "run", session_id=None, input=[{"type": big}]),
        {"jsonrpc": "2.0", "id": 6, "method": "session.list", big: 1},
    ]
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            for frame in frames:
                if frame.get("params", {}).get("session_id", "") is None:
                    frame["params"]["session_id"] = sid
                await client.send(frame)
                raw = await client.ws.get_message()
                assert len(raw) < 600, raw[:300]
                answer = json.loads(raw)
                assert answer["id"] == frame["id"]
                message = answer["error"]["message"]
                assert "x" * (jsonrpc.MAX_ECHO_CHARS - 2) in message
                assert "more characters)" in message
            assert (await client.error("nothing"))["message"] == "method not found: 'nothing'"


def test_clip_and_error_messages_are_bounded() -> None:
    assert jsonrpc.clip("abc") == "abc"
    assert jsonrpc.clip("a" * 200, 10) == "a" * 10 + "… (190 more characters)"
    assert jsonrpc.echo("b" * 1000) == "'" + "b" * 127 + "… (874 more characters)"
    frame = jsonrpc.error_frame(1, jsonrpc.RpcError(jsonrpc.INTERNAL_ERROR, "c" * 50_000))
    assert len(frame["error"]["message"]) < jsonrpc.MAX_ERROR_CHARS + 40
    parsed = jsonrpc.parse_call({"jsonrpc": "2.0", "id": 10**jsonrpc.MAX_ID_CHARS, "method": "x"})
    assert isinstance(parsed, jsonrpc.FrameError) and parsed.id is None
    parsed = jsonrpc.parse_call(
        {"jsonrpc": "2.0", "id": 10**jsonrpc.MAX_ID_CHARS - 1, "method": "x"}
    )
    assert isinstance(parsed, jsonrpc.Request)
