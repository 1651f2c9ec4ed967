"""The HTTP front of the gateway's port (``serve --a2a`` / ``--ag-ui``): a front end that
goes away mid-run loses nothing (R-PROTO-2), and the HTTP side admits as the websocket
side does (R-SEC-4, R-SEC-9): browser origins, wrong-token throttling, each principal's
connections, bodies and heads that are too large or malformed — none of which ends the
server."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing
from conftest import Gates, Lookup
from test_gateway import TOKEN, connect, lookup_script, serving
from test_gateway_ag_ui import post, posted, run_input

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.providers.scripted import Reply, ScriptStep, text, tool_call

BOUND_S = 20.0
BEARER = f"Authorization: Bearer {TOKEN}"


def gated_script() -> list[ScriptStep]:
    return [
        Reply(blocks=(text("Waiting."), tool_call("c1", "wait", key="a"))),
        Reply(blocks=(text("finished"),)),
    ]


def read_until(url: str, body: Any, kind: str) -> list[tuple[str | None, dict[str, Any]]]:
    """Stream ``body``'s run until an event of ``kind``, then drop the connection."""
    seen: list[tuple[str | None, dict[str, Any]]] = []
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream"}
    with (
        httpx.Client(timeout=BOUND_S) as client,
        client.stream("POST", url, json=body, headers=headers) as response,
    ):
        event_id = None
        for line in response.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                seen.append((event_id, json.loads(line[6:])))
                if seen[-1][1]["type"] == kind:
                    break
    return seen


async def test_a_front_end_that_goes_away_mid_run_picks_it_up_from_its_last_event(
    tmp_path: Path, gates: Gates
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path, gated_script, tools=[gates.tool()], approve="all", ag_ui=True
        ) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            body = run_input("t1", "r1", "go")
            seen = await trio.to_thread.run_sync(lambda: read_until(url, body, "TOOL_CALL_END"))
            await gates.started("a")  # the task runs on without its front end
            busy = await posted(url, run_input("t1", "r9", "and this?"))
            assert busy.status == 409 and "already running" in busy.body["error"]["message"]
            gates.release("a")
            last_id = seen[-1][0]
            assert last_id is not None
            again = await posted(url, body, headers={"Last-Event-ID": last_id})
            assert again.types[0] == "RUN_STARTED"
            (result,) = again.of("TOOL_CALL_RESULT")
            assert result["content"] == "done a"
            assert "".join(e["delta"] for e in again.of("TEXT_MESSAGE_CONTENT")) == "finished"
            assert again.events[-1][1]["type"] == "RUN_FINISHED"
            assert gates.cancelled == []


async def test_http_admission_is_the_websocket_s(tmp_path: Path, gates: Gates) -> None:
    limits = GatewayLimits(max_connections_per_principal=1, max_auth_failures_per_address=2)
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path, gated_script, tools=[gates.tool()], approve="all", ag_ui=True, limits=limits
        ) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            foreign = await posted(
                url, run_input("t0", "r0", "hi"), headers={"Origin": "http://evil.example"}
            )
            assert foreign.status == 403
            # An open event stream holds its principal's one place.
            done = threading.Event()
            results: list[Any] = []

            def hold() -> None:
                results.append(post(url, run_input("t1", "r1", "go")))
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, hold)
                await gates.started("a")
                crowded = await posted(url, run_input("t2", "r2", "hi"))
                assert crowded.status == 429
                assert "too many connections" in crowded.body["error"]["message"]
                gates.release("a")
            assert results[0].events[-1][1]["type"] == "RUN_FINISHED"
            # Wrong tokens from an address: refused, then throttled whatever the token.
            wrong = [await posted(url, {}, token="wrong-0123456789") for _ in range(2)]
            assert [w.status for w in wrong] == [401, 401]
            throttled = await posted(url, run_input("t3", "r3", "hi"))
            assert throttled.status == 429


async def keep_alive_request(stream: trio.SocketStream, request: bytes) -> int | None:
    """Send one request on a kept-alive connection and read its whole answer: its status,
    or None when the server closed the connection instead."""
    client = h11.Connection(h11.CLIENT)
    try:
        await stream.send_all(request)
    except trio.BrokenResourceError:
        return None
    status = None
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            try:
                client.receive_data(await stream.receive_some(65536))
            except trio.BrokenResourceError:
                return None
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.EndOfMessage):
            return status
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def test_a_connection_that_never_authenticates_is_closed_after_the_deadline(
    tmp_path: Path,
) -> None:
    """R-SEC-4, R-SEC-9: requests without a token (each answered) do not keep an HTTP
    connection, and the seat it holds, past the deadline, as a websocket that does not
    authenticate is closed; one whose request carried the token keeps going. The
    authenticated one connects first, so once the other is closed its deadline is over."""
    limits = GatewayLimits(handshake_timeout_s=3.0)  # room for a busy machine
    untokened = b"GET /a2a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {"id": "x"}})
    tokened = (
        f"POST /a2a HTTP/1.1\r\nHost: 127.0.0.1\r\n{BEARER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, a2a=True, limits=limits) as server:
            port = server.gateway.port
            async with await trio.open_tcp_stream("127.0.0.1", port) as known:
                assert await keep_alive_request(known, tokened) == 200
                async with await trio.open_tcp_stream("127.0.0.1", port) as stranger:
                    answered = 0
                    while await keep_alive_request(stranger, untokened) == 405:
                        answered += 1
                        # Never idle for the keep-alive timeout, which is the deadline here.
                        assert await keep_alive_request(known, tokened) == 200
                    assert answered >= 1
                assert await keep_alive_request(known, tokened) == 200


async def test_idle_kept_alive_connections_count_against_their_principal(
    tmp_path: Path,
) -> None:
    """R-SEC-9: a kept-alive connection that waits for its next request holds a place of
    the principal its requests came from, so a principal cannot hold the gateway's seats
    with idle connections beyond its cap (locking other principals out): at its cap, its
    next request is served and its longest-idle connection is closed for it. Another
    principal's idle connection is left alone."""
    limits = GatewayLimits(max_connections_per_principal=1)
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {"id": "x"}})

    def tasks_get(token: str) -> bytes:
        return (
            f"POST /a2a HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, a2a=True, limits=limits, tokens=tokens) as server:
            port = server.gateway.port
            async with (
                await trio.open_tcp_stream("127.0.0.1", port) as first,
                await trio.open_tcp_stream("127.0.0.1", port) as second,
                await trio.open_tcp_stream("127.0.0.1", port) as bobs,
            ):
                assert await keep_alive_request(bobs, tasks_get(tokens["bob"])) == 200
                assert await keep_alive_request(first, tasks_get(tokens["alice"])) == 200
                assert await keep_alive_request(second, tasks_get(tokens["alice"])) == 200
                assert await keep_alive_request(first, tasks_get(tokens["alice"])) is None
                assert await keep_alive_request(second, tasks_get(tokens["alice"])) == 200
                assert await keep_alive_request(bobs, tasks_get(tokens["bob"])) == 200


async def test_malformed_http_never_ends_the_server(tmp_path: Path) -> None:
    limits = GatewayLimits(max_frame_bytes=1000)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, ag_ui=True, a2a=True, limits=limits) as server:
            port = server.gateway.port

            async def raw(data: bytes) -> bytes:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(data)
                    answer = b""
                    while chunk := await stream.receive_some(65536):
                        answer += chunk
                        if b"\r\n\r\n" in answer:
                            break
                    return answer

            auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
            bad_length = b"POST /ag-ui HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n" + auth
            assert (await raw(bad_length + b"\r\n")).startswith(b"HTTP/1.1 400")
            big = b"POST /a2a HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000\r\n" + auth
            assert (await raw(big + b"\r\n" + b"x" * 5000)).startswith(b"HTTP/1.1 413")
            long_head = b"GET /a2a HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n"
            assert (await raw(long_head)).startswith(b"HTTP/1.1 4")
            garbage = await raw(b"\x16\x03\x01 not http at all\r\n\r\n")
            assert not garbage or garbage.startswith(b"HTTP/1.1 4")
            # Still serving, on both sides of the port.
            card = await trio.to_thread.run_sync(
                lambda: httpx.get(
                    f"http://127.0.0.1:{port}/.well-known/agent-card.json",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                )
            )
            assert card.status_code == 200
            async with connect(server) as client:
                assert (await client.result("session.create"))["session_id"]


APP = "http://app.example:3000"
"""The origin of a web front end served elsewhere, allowed with ``allowed_origins``."""

PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type,last-event-id",
}


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {
        name: value
        for name, value in response.headers.items()
        if name.startswith("access-control-") or name == "vary"
    }


async def test_allowed_browser_origins_get_cors_answers(tmp_path: Path, lookup: Lookup) -> None:
    """R-SEC-4, R-PROTO-1, R-PROTO-2: a page of an allowed origin may call the endpoints
    from another origin: its preflight is answered with what it may send, and every
    answer — an event stream, the card, an error — names its origin, so the browser lets
    the page read it. The console's origin is on the same list."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(
                tmp_path, lookup_script, tools=[lookup.tool], ag_ui=True, a2a=True,
                allowed_origins=[APP + "/"],
            ) as server,
            httpx.AsyncClient(timeout=BOUND_S) as http,
        ):  # fmt: skip
            base = f"http://127.0.0.1:{server.gateway.port}"
            server.gateway.allow_origin("http://127.0.0.1:9999")
            for path, methods in (
                ("/ag-ui", "OPTIONS, POST"),
                ("/a2a", "OPTIONS, POST"),
                ("/.well-known/agent-card.json", "GET, OPTIONS"),
            ):
                for origin in (APP, "http://127.0.0.1:9999"):
                    answer = await http.options(
                        base + path, headers={"Origin": origin, **PREFLIGHT}
                    )
                    assert answer.status_code == 204, (path, origin)
                    assert answer.content == b""
                    assert cors_headers(answer) == {
                        "access-control-allow-origin": origin,
                        "access-control-allow-methods": methods,
                        "access-control-allow-headers": (
                            "Authorization, Content-Type, Accept, Last-Event-ID"
                        ),
                        "access-control-max-age": "600",
                        "access-control-expose-headers": "Retry-After, WWW-Authenticate, Allow",
                        "vary": "Origin",
                    }
            auth = {"Authorization": f"Bearer {TOKEN}", "Origin": APP}
            # The event stream itself.
            async with http.stream(
                "POST",
                base + "/ag-ui",
                json=run_input("t1", "r1", "go"),
                headers={**auth, "Accept": "text/event-stream"},
            ) as stream:
                assert stream.status_code == 200
                assert stream.headers["content-type"].startswith("text/event-stream")
                assert stream.headers["access-control-allow-origin"] == APP
                assert stream.headers["vary"] == "Origin"
                lines = [line async for line in stream.aiter_lines()]
            finished = json.loads([line for line in lines if line.startswith("data: ")][-1][6:])
            assert finished["type"] == "RUN_FINISHED"
            assert finished["outcome"]["type"] == "interrupt"
            card = await http.get(base + "/.well-known/agent-card.json", headers=auth)
            assert card.status_code == 200 and card.json()["name"]
            assert card.headers["access-control-allow-origin"] == APP
            # Refusals are readable by the page too, with their reasons' headers exposed.
            unauthorized = await http.post(base + "/ag-ui", json={}, headers={"Origin": APP})
            assert unauthorized.status_code == 401
            assert unauthorized.headers["access-control-allow-origin"] == APP
            assert "WWW-Authenticate" in unauthorized.headers["access-control-expose-headers"]
            busy = await http.post(base + "/ag-ui", json=run_input("t1", "r2", "hi"), headers=auth)
            assert busy.status_code == 409
            assert busy.headers["access-control-allow-origin"] == APP
            wrong_method = await http.get(base + "/a2a", headers=auth)
            assert wrong_method.status_code == 405
            assert wrong_method.headers["access-control-allow-origin"] == APP
            assert lookup.calls == []


async def test_other_origins_get_no_cors_and_plain_clients_no_change(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-SEC-4: a page of another origin is refused, preflight and request alike, and gets
    no CORS header (its browser hides even the refusal); a client that sends no
    ``Origin`` (not a browser) is answered as it always was."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(
                tmp_path, lookup_script, tools=[lookup.tool], ag_ui=True, a2a=True,
                allowed_origins=[APP],
            ) as server,
            httpx.AsyncClient(timeout=BOUND_S) as http,
        ):  # fmt: skip
            base = f"http://127.0.0.1:{server.gateway.port}"
            for origin in ("http://evil.example", "http://app.example:3001", "null"):
                preflight = await http.options(
                    base + "/ag-ui", headers={"Origin": origin, **PREFLIGHT}
                )
                assert preflight.status_code == 403
                assert cors_headers(preflight) == {}
                called = await http.post(
                    base + "/ag-ui",
                    json=run_input("t1", "r1", "go"),
                    headers={"Authorization": f"Bearer {TOKEN}", "Origin": origin},
                )
                assert called.status_code == 403
                assert cors_headers(called) == {}
            # No Origin: no CORS, and OPTIONS is a method the path does not take.
            options = await http.options(base + "/ag-ui", headers=PREFLIGHT)
            assert options.status_code == 405 and options.headers["allow"] == "POST"
            assert cors_headers(options) == {}
            plain = await http.post(
                base + "/ag-ui",
                json=run_input("t1", "r1", "go"),
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert plain.status_code == 200
            assert plain.headers["content-type"].startswith("text/event-stream")
            assert cors_headers(plain) == {}
            card = await http.get(
                base + "/.well-known/agent-card.json",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert card.status_code == 200 and cors_headers(card) == {}
            assert lookup.calls == []


async def test_a_client_too_slow_to_take_its_answers_is_logged_in_one_line(
    tmp_path: Path, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that sends requests on one keep-alive connection and reads none of the
    answers fills the socket; the answer that cannot be written within the write timeout
    ends that connection. A client's slowness is the client's doing: it is logged in one
    line, without a traceback, and the server serves the next client. The clock is
    virtual."""
    caplog.set_level(logging.DEBUG, logger="greenroom.actors.gateway")
    async with serving(tmp_path, a2a=True) as server:
        port = server.gateway.port
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        # With the token: a connection that never authenticates is closed at the
        # handshake deadline, before the write timeout.
        card = f"GET /.well-known/agent-card.json HTTP/1.1\r\nHost: 127.0.0.1\r\n{BEARER}\r\n\r\n"
        requests = card.encode() * 20_000

        async def send_all() -> None:
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(requests)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_all)
            # Both sides are stuck: the server writing the answers nobody reads, the
            # client writing the requests the server no longer reads.
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(server.gateway.limits.close_timeout_s + 10)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        await stream.aclose()
        async with connect(server) as client:
            assert (await client.result("session.create"))["session_id"]
    records = [r for r in caplog.records if r.name.startswith("greenroom.actors.gateway")]
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    [slow] = [r for r in records if "too slow" in r.getMessage()]
    assert "\n" not in slow.getMessage()


async def test_a_client_header_naming_another_principal_is_refused_as_in_the_handshake(
    tmp_path: Path,
) -> None:
    """R-SEC-4, R-PROTO-1, R-PROTO-2: ``X-Greenroom-Client`` may only repeat the token's
    principal on the HTTP endpoints too: naming another is refused 403 with the websocket
    handshake's words, and nothing is done for it; naming the token's own is served."""
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
    a2a_send = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "message/send",
        "params": {
            "message": {
                "kind": "message",
                "messageId": "m1",
                "role": "user",
                "parts": [{"kind": "text", "text": "go"}],
            }
        },
    }
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, a2a=True, ag_ui=True, tokens=tokens) as server:
            base = f"http://127.0.0.1:{server.gateway.port}"
            requests = {"/a2a": a2a_send, "/ag-ui": run_input("t1", "r1", "go")}
            for path, body in requests.items():
                refused = await posted(
                    base + path, body, token=tokens["alice"], headers={"X-Greenroom-Client": "bob"}
                )
                assert refused.status == 403, (path, refused.body)
                assert refused.body["error"]["message"] == (
                    "forbidden: X-Greenroom-Client names another principal"
                )
            assert server.gateway.owned("alice") == server.gateway.owned("bob") == frozenset()
            served = [
                await posted(
                    base + path,
                    body,
                    token=tokens["alice"],
                    headers={"X-Greenroom-Client": "alice"},
                )
                for path, body in requests.items()
            ]
            assert [answer.status for answer in served] == [200, 200]
            assert served[0].body["result"]["status"]["state"] == "completed"
            assert served[1].types[-1] == "RUN_FINISHED"
            assert len(server.gateway.owned("alice")) == 2
            assert server.gateway.owned("bob") == frozenset()


async def test_a_body_not_complete_by_either_deadline_is_answered_before_the_close(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """R-SEC-9, R-PROTO-1: a request whose body never completes is answered 400 before
    its connection closes, whichever deadline ends it: the body's own (the handshake
    timeout from its head) or, for a connection no request authenticated yet, the
    connection's (the handshake timeout from its start), which comes first. Declared
    lengths under and over the body cap alike. The clock is virtual."""
    timeout = GatewayLimits().handshake_timeout_s
    cap = GatewayLimits().max_frame_bytes
    tasks_get = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {}})
    tokened = (
        f"POST /a2a HTTP/1.1\r\nHost: 127.0.0.1\r\n{BEARER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(tasks_get)}\r\n\r\n{tasks_get}"
    ).encode()

    def cut_short(length: int) -> bytes:
        return (
            f"POST /a2a HTTP/1.1\r\nHost: 127.0.0.1\r\n{BEARER}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            '{"jsonrpc": "2.0", '
        ).encode()

    async def answer_after(stream: trio.SocketStream, request: bytes, wait_s: float) -> bytes:
        """Send ``request``, let ``wait_s`` pass, and read until the server closes."""
        await stream.send_all(request)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(wait_s)
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
        return answer

    def assert_refused(answer: bytes) -> None:
        assert answer.startswith(b"HTTP/1.1 400"), answer
        assert b"request body not complete in time" in answer

    async with serving(tmp_path, a2a=True) as server:
        port = server.gateway.port
        for length in (1000, 2 * cap):  # on a connection's first request
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                assert_refused(await answer_after(stream, cut_short(length), timeout))
        # Half the timeout into a connection whose first request had no token, the
        # connection's deadline comes before the body's.
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            untokened = b"GET /a2a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            assert await keep_alive_request(stream, untokened) == 405
            mock_clock.jump(timeout / 2)
            assert_refused(await answer_after(stream, cut_short(1000), timeout / 2))
        # Authenticated, the connection has no deadline: the body's holds.
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            assert await keep_alive_request(stream, tokened) == 200
            assert_refused(await answer_after(stream, cut_short(1000), timeout))
