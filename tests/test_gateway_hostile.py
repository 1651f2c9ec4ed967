"""Hostile clients (R-SEC-9, with R-SEC-1 and R-SEC-4): nothing a client sends grows the
server's memory without bound, and one principal cannot lock out another. Real
trio-websocket clients against the real gateway on 127.0.0.1 port 0; every test is bounded
by ``trio.fail_after`` and synchronised by messages and events, never sleeps. What the
server holds for a client is read from its outbox's counters (``Outbox.size``,
``Outbox.peak``), not from the process's memory."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from conftest import Lookup, port_of
from test_gateway import BOUND_S, TOKEN, Client, Server, connect, lookup_script, serving
from test_gateway_people import until_asked
from trio_websocket import ConnectionClosed, ConnectionRejected, wrap_client_stream

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.gateway.access import Admission, address_key
from greenroom.actors.runtime.session import Session
from greenroom.protocols import jsonrpc
from greenroom.protocols.outputs import PartialText

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"
WRONG = "wrong-token-0123456789"

HUGE = 900_000
"""About the size of the values the report used (0.9 MB)."""


def call(request_id: Any, method: str, **params: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params:
        frame["params"] = params
    return frame


@asynccontextmanager
async def connect_from(
    server: Server, source: str, token: str | None = TOKEN
) -> AsyncIterator[Client]:
    """A websocket client whose socket is bound to ``source`` (another loopback address
    than 127.0.0.1 is another remote address to the server). A refused handshake raises
    :class:`ConnectionRejected`."""
    headers = [] if token is None else [(b"Authorization", b"Bearer " + token.encode())]
    stream = await trio.open_tcp_stream("127.0.0.1", server.gateway.port, local_address=source)
    try:
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(
                nursery, stream, "127.0.0.1", "/v1", extra_headers=headers
            )
            yield Client(ws)
            await ws.aclose()
    except* ConnectionRejected as group:
        [rejected] = group.exceptions
        raise rejected from None


async def refusal(server: Server, source: str, token: str | None) -> ConnectionRejected | None:
    """How a handshake from ``source`` with ``token`` is refused (None: it was accepted)."""
    try:
        async with connect_from(server, source, token):
            return None
    except ConnectionRejected as rejected:
        return rejected


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
            [connection] = server.gateway.connections
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
            assert connection not in server.gateway.connections
            # The server serves the next client as before.
            async with connect(server) as again:
                assert await again.result("session.list") == {"sessions": []}


async def test_outputs_that_would_pass_the_cap_drop_the_subscription_not_the_connection(
    tmp_path: Any,
) -> None:
    """R-SEC-9: a burst of outputs larger than ``max_pending_bytes`` (published without a
    checkpoint, so the writer cannot send any of it first) never takes the outbox past the
    bound: the output that would is refused and the subscription dropped with a notice
    naming the bound; the connection stays and answers the next call."""
    cap = 64 * 1024
    limits = GatewayLimits(max_pending_bytes=cap)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            [connection] = server.gateway.connections
            session = server.host.get_session(sid)
            for i in range(40):  # 160 KiB
                text = f"{i:04d}".ljust(4096, "x")
                port_of(session).publish(
                    [PartialText(session_id=sid, run_id="run_burst", index=0, text=text)]
                )
            while True:
                note = await client.notification()
                if note["method"] == "subscription_dropped":
                    break
            assert note["params"]["reason"] == f"client too slow: more than {cap} bytes not read"
            assert 0 < connection.outbox.peak <= cap
            assert connection.close_with is None
            assert await client.result("session.list")
            assert sid not in connection.subscriptions


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


# -- one principal cannot lock out another -------------------------------------------------------


async def test_one_principal_at_its_connection_cap_does_not_lock_out_another(
    tmp_path: Any,
) -> None:
    """R-SEC-9, R-SEC-4: alice holds her two places; a third handshake of hers is refused
    with HTTP 429 naming the cap (an ``initialize`` beyond it answers 429 and closes with
    1008) while the server still has room, which bob takes. A closed connection gives its
    place back."""
    limits = GatewayLimits(max_connections_per_principal=2)
    tokens = {"alice": ALICE, "bob": BOB}
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits, tokens=tokens, max_connections=4) as server:
            async with connect(server, token=ALICE) as first, connect(server, token=ALICE):
                with pytest.raises(ConnectionRejected) as rejected:
                    async with connect(server, token=ALICE):
                        pass
                assert rejected.value.status_code == 429
                assert rejected.value.body is not None
                assert b"too many connections for client 'alice' (at most 2)" in (
                    rejected.value.body
                )
                async with connect(server, token=None) as late:
                    error = await late.error("initialize", {"token": ALICE})
                    assert error["code"] == jsonrpc.TOO_MANY_REQUESTS
                    assert "at most 2" in error["message"]
                    with pytest.raises(ConnectionClosed) as closed:
                        await late.ws.get_message()
                    assert closed.value.reason is not None
                    assert closed.value.reason.code == 1008
                async with connect(server, token=BOB) as bob:
                    assert await bob.result("session.list") == {"sessions": []}
                assert await first.result("session.list") == {"sessions": []}
            async with connect(server, token=ALICE) as again:
                assert await again.result("session.list") == {"sessions": []}


async def test_a_principal_at_its_session_cap_gets_429_naming_the_cap(tmp_path: Any) -> None:
    """R-SEC-9: alice may hold two open sessions; a third ``session.create`` answers 429
    naming the cap and the flag, creates nothing, and bob still creates his."""
    limits = GatewayLimits(max_sessions_per_principal=2)
    tokens = {"alice": ALICE, "bob": BOB}
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits, tokens=tokens) as server:
            async with connect(server, token=ALICE) as alice, connect(server, token=BOB) as bob:
                for _ in range(2):
                    await alice.result("session.create")
                error = await alice.error("session.create")
                assert error["code"] == jsonrpc.TOO_MANY_REQUESTS
                assert error["message"] == (
                    "too many sessions: client 'alice' holds 2 open sessions "
                    "(at most 2, --max-sessions-per-principal)"
                )
                assert len((await alice.result("session.list"))["sessions"]) == 2
                assert len(server.host.sessions) == 2
                await bob.result("session.create")
                assert len((await bob.result("session.list"))["sessions"]) == 1


async def test_forks_made_at_once_do_not_pass_the_session_cap(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-9: a fork counts against its principal's sessions from the moment it is
    asked, as a ``session.create`` does: alice holds one of her two sessions, and while
    a fork of hers is being made, another (from another connection) answers 429."""
    limits = GatewayLimits(max_sessions_per_principal=2)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, limits=limits) as server,
            connect(server) as first,
            connect(server) as second,
        ):
            sid = (await first.result("session.create"))["session_id"]
            real_fork = server.host.fork_session
            first_in, decided, release = trio.Event(), trio.Event(), trio.Event()
            entered = 0

            async def held_fork(*args: Any, **options: Any) -> Any:
                nonlocal entered
                entered += 1
                (first_in if entered == 1 else decided).set()
                await release.wait()
                return await real_fork(*args, **options)

            monkeypatch.setattr(server.host, "fork_session", held_fork)
            await first.send(call(1, "session.fork", session_id=sid))
            await first_in.wait()
            answers: dict[int, dict[str, Any]] = {}

            async def second_fork() -> None:
                await second.send(call(2, "session.fork", session_id=sid))
                answers[2] = await second.response(2)
                decided.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(second_fork)
                await decided.wait()  # answered, or let through to be made as well
                release.set()
            answers[1] = await first.response(1)
            assert "result" in answers[1], answers[1]
            assert answers[2]["error"]["code"] == jsonrpc.TOO_MANY_REQUESTS, answers[2]
            assert len((await first.result("session.list"))["sessions"]) == 2


async def test_steering_and_follow_ups_queued_in_a_session_are_capped(
    tmp_path: Any, lookup: Lookup
) -> None:
    """R-SEC-9: a task that waits for a person takes no steering and starts no follow-up,
    so what a client queues meanwhile stays in memory: at most ``max_queued_inputs`` of
    each (0.9 MB apiece here); beyond, ``steer`` and ``follow_up`` answer 429 and queue
    nothing."""
    limits = GatewayLimits(max_queued_inputs=3)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool], limits=limits) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await until_asked(client, sid)
            big = "x" * HUGE
            for method, kind in (("steer", "steering"), ("follow_up", "follow-ups")):
                for _ in range(3):
                    queued = await client.result(method, {"session_id": sid, "input": big})
                    assert queued == {"queued": True}
                refused = await client.error(method, {"session_id": sid, "input": big})
                assert refused["code"] == jsonrpc.TOO_MANY_REQUESTS, refused
                assert f"too many {kind} queued in session {sid!r} (at most 3)" in (
                    refused["message"]
                )
            machine = server.host.port(sid).machine
            assert (len(machine.record.steering), len(machine.queued_tasks)) == (3, 3)
            assert lookup.calls == []


def held_reading(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, trio.Event], trio.Event]:
    """From now on, every call's input waits, read, until the test sets the event returned
    second; as each one starts waiting, ``entered["now"]`` is set (the test puts a new
    event there for each call it sends), and ``entered["left"]`` as it stops waiting (let
    go, or cancelled)."""
    entered = {"now": trio.Event(), "left": trio.Event()}
    let_go = trio.Event()
    attach = Session.attach

    async def read_then_wait(self: Session, blocks: Any, *, confine: bool = False) -> Any:
        attached = await attach(self, blocks, confine=confine)
        entered["now"].set()
        try:
            await let_go.wait()
        finally:
            entered["left"].set()
        return attached

    monkeypatch.setattr(Session, "attach", read_then_wait)
    return entered, let_go


def queued_in(server: Server, session_id: str, kind: str) -> int:
    """How many of ``kind`` the session's task machine holds."""
    machine = server.host.port(session_id).machine
    return len(machine.record.steering) if kind == "steering" else len(machine.queued_tasks)


@pytest.mark.parametrize(("method", "kind"), [("steer", "steering"), ("follow_up", "follow-ups")])
async def test_calls_racing_from_several_connections_never_pass_the_queue_cap(
    tmp_path: Any, lookup: Lookup, monkeypatch: pytest.MonkeyPatch, method: str, kind: str
) -> None:
    """R-SEC-9, R-STEER-1, R-STEER-6: the cap counted only what the session's task machine
    held, so calls from four connections, each of them checked while the others' input was
    still being read, all passed it: four queued where the cap is two. Input accepted and
    not yet held by the machine counts now: the first two are queued, the other two
    answered 429 at once, and the machine holds exactly two."""
    limits = GatewayLimits(max_queued_inputs=2)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool], limits=limits) as server,
            connect(server) as owner,
            connect(server) as a,
            connect(server) as b,
            connect(server) as c,
            connect(server) as d,
        ):
            sid = (await owner.result("session.create"))["session_id"]
            await until_asked(owner, sid)
            entered, let_go = held_reading(monkeypatch)
            answers: dict[int, dict[str, Any]] = {}

            async def send(index: int, client: Client, decided: trio.Event) -> None:
                answers[index] = await client.call(method, {"session_id": sid, "input": "more"})
                decided.set()

            async with trio.open_nursery() as nursery:
                for index, client in enumerate((a, b, c, d)):
                    # Each call is checked before the next is sent: its input is being
                    # read (past the check), or it was answered.
                    decided = entered["now"] = trio.Event()
                    nursery.start_soon(send, index, client, decided)
                    await decided.wait()
                let_go.set()
            assert [answers[i].get("result") for i in range(2)] == [{"queued": True}] * 2
            for i in (2, 3):
                assert answers[i]["error"]["code"] == jsonrpc.TOO_MANY_REQUESTS, answers[i]
                assert f"too many {kind} queued in session {sid!r} (at most 2)" in (
                    answers[i]["error"]["message"]
                )
            assert queued_in(server, sid, kind) == 2
            assert server.gateway._calls.queue_room.pending(sid, kind) == 0
            assert lookup.calls == []


@pytest.mark.parametrize(("method", "kind"), [("steer", "steering"), ("follow_up", "follow-ups")])
async def test_a_call_that_queues_nothing_leaves_no_place_taken(
    tmp_path: Any, lookup: Lookup, monkeypatch: pytest.MonkeyPatch, method: str, kind: str
) -> None:
    """R-SEC-9: a call holds a place in the session's queue from its check until the
    session's task machine takes its input. One that hands nothing over gives its place
    back: answered ``queued: false`` (no task), refused for its input (-32602), or cut off
    by its connection closing while its input is read. With a cap of one, the next call
    is queued after all three, and the one after it refused."""
    limits = GatewayLimits(max_queued_inputs=1)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool], limits=limits) as server,
            connect(server) as client,
        ):
            room = server.gateway._calls.queue_room
            sid = (await client.result("session.create"))["session_id"]
            params = {"session_id": sid, "input": "more"}
            assert await client.result(method, params) == {"queued": False}
            assert room.pending(sid, kind) == 0
            await until_asked(client, sid)
            bad = {"session_id": sid, "input": [{"type": "image", "path": "../outside.png"}]}
            assert (await client.error(method, bad))["code"] == jsonrpc.INVALID_PARAMS
            assert room.pending(sid, kind) == 0
            entered, _ = held_reading(monkeypatch)
            async with connect(server) as leaving:
                await leaving.result("session.subscribe", {"session_id": sid})
                await leaving.send(call("cut", method, **params))
                await entered["now"].wait()
            # The next output for the closed connection finds it gone: its call is cut off.
            port_of(server.host.get_session(sid)).publish(
                [PartialText(session_id=sid, run_id="run_x", index=0, text="x")]
            )
            await entered["left"].wait()
            monkeypatch.undo()
            assert room.pending(sid, kind) == 0
            assert await client.result(method, params) == {"queued": True}
            refused = await client.error(method, params)
            assert refused["code"] == jsonrpc.TOO_MANY_REQUESTS, refused
            assert (queued_in(server, sid, kind), room.pending(sid, kind)) == (1, 0)


@pytest.mark.parametrize(("method", "kind"), [("steer", "steering"), ("follow_up", "follow-ups")])
async def test_calls_pipelined_on_one_connection_never_pass_the_queue_cap(
    tmp_path: Any, lookup: Lookup, method: str, kind: str
) -> None:
    """R-SEC-9: a client sends four calls, a frame each, without waiting for their
    answers, to a session whose task is parked, waiting for a person. Each call handed
    its input to the session's inbox and the next was checked before the session (woken
    by the first) had taken any of it: four were queued where the cap is two. Now two are
    queued and two answered 429."""
    limits = GatewayLimits(max_queued_inputs=2)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool], limits=limits) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await until_asked(client, sid)
            for i in range(4):
                await client.send(call(f"q{i}", method, session_id=sid, input="more"))
            answers: dict[str, dict[str, Any]] = {}
            while len(answers) < 4:
                message = await client.receive()
                if "id" in message:  # not an output of the subscription
                    answers[message["id"]] = message
            assert [answers[f"q{i}"].get("result") for i in range(2)] == [{"queued": True}] * 2
            for i in (2, 3):
                assert answers[f"q{i}"]["error"]["code"] == jsonrpc.TOO_MANY_REQUESTS
            assert queued_in(server, sid, kind) == 2
            assert server.gateway._calls.queue_room.pending(sid, kind) == 0


# -- wrong tokens are throttled per address ----------------------------------------------------


async def test_wrong_token_handshakes_are_throttled_per_address(tmp_path: Any) -> None:
    """R-SEC-9, R-SEC-4: after three wrong tokens from 127.0.0.1 within the window, every
    handshake from it — the right token too — is refused with HTTP 429 and a Retry-After
    before its token is looked at. 127.0.0.2 still connects, and its wrong token is a
    plain 401. Wrong tokens sent with ``initialize`` count the same way (127.0.0.3)."""
    limits = GatewayLimits(max_auth_failures_per_address=3, auth_failure_window_s=60.0)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits) as server:
            for _ in range(3):
                wrong = await refusal(server, "127.0.0.1", WRONG)
                assert wrong is not None and wrong.status_code == 401
            for token in (TOKEN, None, WRONG):
                throttled = await refusal(server, "127.0.0.1", token)
                assert throttled is not None and throttled.status_code == 429
                assert (b"retry-after", b"60") in [
                    (name.lower(), value) for name, value in throttled.headers
                ]
                assert throttled.body is not None
                assert b"too many failed authentication attempts" in throttled.body
            async with connect_from(server, "127.0.0.2") as other:
                assert await other.result("session.list") == {"sessions": []}
            wrong = await refusal(server, "127.0.0.2", WRONG)
            assert wrong is not None and wrong.status_code == 401
            async with connect_from(server, "127.0.0.3", token=None) as guesser:
                for _ in range(3):
                    error = await guesser.error("initialize", {"token": WRONG})
                    assert error["code"] == jsonrpc.UNAUTHORIZED
                error = await guesser.error("initialize", {"token": TOKEN})
                assert error["code"] == jsonrpc.TOO_MANY_REQUESTS
                assert error["message"].startswith("too many failed authentication attempts")
            throttled = await refusal(server, "127.0.0.3", TOKEN)
            assert throttled is not None and throttled.status_code == 429


def test_the_throttle_window_slides_and_its_table_is_bounded() -> None:
    """R-SEC-9: an address gets ``max_auth_failures_per_address`` guesses per window:
    refused attempts are not counted, and each failure leaving the window frees one
    guess. At most ``max_throttled_addresses`` addresses are remembered. IPv6 addresses
    are counted by their /64."""
    limits = GatewayLimits(
        max_auth_failures_per_address=2, auth_failure_window_s=10.0, max_throttled_addresses=3
    )
    admission = Admission(limits)
    admission.failed("a", 0.0)
    assert admission.throttled("a", 1.0) is None
    admission.failed("a", 5.0)
    assert admission.throttled("a", 6.0) == pytest.approx(4.0)
    assert admission.throttled("b", 6.0) is None
    assert admission.throttled("a", 10.0) is None  # the first left the window
    admission.failed("a", 10.0)
    assert admission.throttled("a", 11.0) == pytest.approx(4.0)
    assert admission.throttled("a", 15.0) is None
    for name in ("b", "c", "d"):
        admission.failed(name, 20.0)
        admission.failed(name, 20.0)
    assert admission.throttled("a", 20.0) is None  # forgotten: the oldest counted
    assert all(admission.throttled(name, 20.0) is not None for name in "bcd")
    assert address_key("2001:db8:1:2:3:4:5:6") == address_key("2001:db8:1:2::9") == (
        "2001:db8:1:2::/64"
    )
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_key("127.0.0.2") == "127.0.0.2"
    admission.release("nobody")
    assert all(admission.admit("p") for _ in range(limits.max_connections_per_principal))
    assert not admission.admit("p")
    assert admission.admit("q")
    admission.release("p")
    assert admission.connections_of("p") == limits.max_connections_per_principal - 1
