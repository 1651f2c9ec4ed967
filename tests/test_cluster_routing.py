"""Host registry, placement, session metadata and per-session requests answered only by the
owner, against a real nats-server (R-CLUSTER-1)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from pathlib import Path
from typing import Any

import trio

from greenroom.actors.cluster.connection import Connection, connect
from greenroom.actors.cluster.errors import ClusterUnavailable, OwnerUnreachable
from greenroom.actors.cluster.registry import (
    TREE_STAY_FACTOR,
    TREE_STAY_SLACK,
    HostRecord,
    HostRegistry,
    SessionDirectory,
    assign,
    least_loaded,
    place_elsewhere,
)
from greenroom.actors.cluster.routing import (
    IN_DOUBT,
    NOT_DONE,
    OWNER_UNREACHABLE,
    Answering,
    SessionRequests,
)
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
    running_nats,
)


async def publish_numbers(conn: Connection, subject: str, count: int) -> None:
    """Publish 0 … ``count - 1`` on ``subject`` (an asyncio coroutine, for ``conn.call``),
    then flush: the server holds them all once it returns."""
    for n in range(count):
        await conn.client.publish(subject, str(n).encode())
    await conn.client.flush()


def test_placement_is_the_least_loaded_host_and_spreads_orphans() -> None:
    hosts = [
        HostRecord(host_id="b", load=2),
        HostRecord(host_id="a", load=2),
        HostRecord(host_id="c", load=5),
    ]
    assert least_loaded(hosts) == HostRecord(host_id="a", load=2)
    assert least_loaded([]) is None
    assert assign(["s3", "s1", "s2"], hosts) == {"s1": "a", "s2": "b", "s3": "a"}
    assert assign(["s1"], []) == {}


def test_orphans_are_assigned_by_tree_each_once_and_the_load_evened() -> None:
    """R-CLUSTER-2, R-TREE-2: 300 trees of 1 to 6 orphans over 12 hosts of unequal load:
    every orphan goes to exactly one host, a tree's orphans to the same one, each host
    ends within a tree's size of every other, and the answer does not depend on the
    order the orphans and hosts are listed in (every host computes the same)."""
    rng = random.Random(7)
    hosts = [HostRecord(host_id=f"h{n:02}", load=rng.randrange(6)) for n in range(12)]
    tree_of = {
        f"t{tree:03}-{node}": f"t{tree:03}"
        for tree in range(300)
        for node in range(rng.randrange(1, 7))
    }
    orphans = list(tree_of)
    placed = assign(orphans, hosts, tree_of=tree_of)
    rng.shuffle(orphans)
    rng.shuffle(hosts)
    assert assign(orphans, hosts, tree_of=tree_of) == placed
    assert sorted(placed) == sorted(orphans)
    trees: dict[str, set[str]] = {}
    for session_id, host_id in placed.items():
        trees.setdefault(tree_of[session_id], set()).add(host_id)
    assert all(len(owners) == 1 for owners in trees.values())
    loads = {h.host_id: h.load for h in hosts}
    for host_id in placed.values():
        loads[host_id] += 1
    assert max(loads.values()) - min(loads.values()) <= 6, loads


def test_a_tree_goes_to_the_live_host_named_for_it() -> None:
    """R-TREE-2: a tree whose parent runs on a live host goes there, more loaded than
    another as it is; named for a host that is not among the live ones, it goes by load."""
    hosts = [HostRecord(host_id="a", load=0), HostRecord(host_id="b", load=9)]
    tree_of = {"c1": "r", "c2": "r", "x1": "x", "x2": "x"}
    preferred = {"r": "b", "x": "gone"}
    placed = assign(list(tree_of), hosts, tree_of=tree_of, preferred=preferred)
    assert placed == {"c1": "b", "c2": "b", "x1": "a", "x2": "a"}


def test_the_host_named_for_a_tree_takes_it_unless_far_above_the_least_loaded() -> None:
    """R-TREE-2, R-CLUSTER-2: host a runs the parents of 120 trees whose children were on
    a lost host, c idles. Every tree stays whole, but a does not take them all: it keeps
    trees while it carries at most twice what c would (or 16 more), so the two end within
    that bound, and most trees still go to the host of their parent. Small loads keep
    every tree with its parent, and the bound holds at its edges exactly."""
    hosts = [HostRecord(host_id="a", load=100), HostRecord(host_id="c", load=0)]
    tree_of = {f"t{tree:03}-{node}": f"t{tree:03}" for tree in range(120) for node in range(2)}
    preferred = {f"t{tree:03}": "a" for tree in range(120)}
    placed = assign(list(tree_of), hosts, tree_of=tree_of, preferred=preferred)
    assert sorted(placed) == sorted(tree_of)
    owners: dict[str, set[str]] = {}
    for session_id, host_id in placed.items():
        owners.setdefault(tree_of[session_id], set()).add(host_id)
    assert all(len(hosts_of_tree) == 1 for hosts_of_tree in owners.values())
    loads = {"a": 100, "c": 0}
    for host_id in placed.values():
        loads[host_id] += 1
    assert loads["a"] <= TREE_STAY_FACTOR * (loads["c"] + 2), loads  # 2: one tree
    assert loads["c"] > 0
    assert sum(1 for h in owners.values() if h == {"a"}) > 60  # most stay with their parent

    small = [HostRecord(host_id="a", load=3), HostRecord(host_id="c", load=0)]
    three = {"k1": "r", "k2": "r", "k3": "r"}
    assert set(assign(list(three), small, tree_of=three, preferred={"r": "a"}).values()) == {"a"}

    def host_for_one(load_a: int, load_c: int) -> str:
        edge = [HostRecord(host_id="a", load=load_a), HostRecord(host_id="c", load=load_c)]
        return assign(["k"], edge, tree_of={"k": "r"}, preferred={"r": "a"})["k"]

    # Within the slack, however many times c's load: a 16 sessions above c with the tree.
    assert host_for_one(TREE_STAY_SLACK, 0) == "a"
    assert host_for_one(TREE_STAY_SLACK + 1, 0) == "c"
    # Past the slack, within the factor: a carries twice c with the tree, not more.
    assert host_for_one(41, 20) == "a"
    assert host_for_one(42, 20) == "c"


def test_a_new_session_stays_on_the_host_asked_unless_another_is_a_quarter_lighter() -> None:
    """R-CLUSTER-1, R-PERF-2: placement prefers the host the client asked (no NATS on its
    calls and outputs), balances small loads exactly and large ones within a quarter."""
    light = HostRecord(host_id="b", load=0)
    assert place_elsewhere(0, [light]) is None
    assert place_elsewhere(1, [light]) == light  # one session against none moves
    assert place_elsewhere(1, [HostRecord(host_id="b", load=1)]) is None  # a tie stays
    assert place_elsewhere(100, [HostRecord(host_id="b", load=76)]) is None
    assert place_elsewhere(100, [HostRecord(host_id="b", load=74)]) == HostRecord(
        host_id="b", load=74
    )
    assert place_elsewhere(100, [HostRecord(host_id="c", load=10), light]) == light
    assert place_elsewhere(100, []) is None


def test_a_subscription_brings_a_burst_in_order_and_ends_when_the_client_closes(
    nats_server: NatsProcess,
) -> None:
    """R-CLUSTER-1: 6,000 messages published at once (more than the inbox holds, so its
    callback waits for trio) all arrive in order; closing the client ends the iteration."""

    async def body(conn: Connection) -> tuple[list[int], list[int]]:
        subject = f"{conn.names.prefix}.burst"
        got: list[int] = []
        after_close: list[int] = []
        async with conn.subscription(subject) as messages:
            await conn.call(publish_numbers(conn, subject, 6000))
            async for msg in messages:
                got.append(int(msg.data))
                if len(got) == 6000:
                    break
            await conn.call(conn.client.publish(subject, b"-1"))
            await conn.aclose()
            async for msg in messages:
                after_close.append(int(msg.data))
        return got, after_close

    got, after_close = run_connected(nats_server.url, body)
    assert got == list(range(6000))
    assert after_close in ([], [-1])  # ended: at most the message sent before the close


def test_hosts_announce_themselves_and_drop_out_after_the_ttl(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[list[str], list[str]]:
        registry = await HostRegistry.open(conn, ttl_s=1.0)
        await registry.announce(HostRecord(host_id="a", load=1, gateway="ws://x/v1"))
        await registry.announce(HostRecord(host_id="b", load=0))
        before = [h.host_id for h in await registry.hosts()]
        # Only "b" keeps announcing; "a" died.
        with trio.move_on_after(2.0):
            await registry.announce_every(lambda: HostRecord(host_id="b", load=0))
        after = [h.host_id for h in await registry.hosts()]
        return before, after

    assert run_connected(nats_server.url, body) == (["a", "b"], ["b"])


def test_a_changed_record_is_announced_before_the_next_tick(nats_server: NatsProcess) -> None:
    """A host's load reaches the registry when it changes, not a third of the TTL later:
    other gateways place new sessions by the load it has (R-CLUSTER-1). The tick here is
    far beyond the test's bound, so only the change can announce the new load."""
    announced: list[int] = []
    news = [trio.Event()]

    class Registry(HostRegistry):
        async def announce(self, record: HostRecord) -> None:
            await super().announce(record)
            announced.append(record.load)
            news[0].set()

    async def body(conn: Connection) -> list[HostRecord]:
        registry = await Registry.open(conn, ttl_s=600.0)
        load = 0
        async with trio.open_nursery() as nursery:
            await nursery.start(registry.announce_every, lambda: HostRecord(host_id="a", load=load))
            load = 1
            news[0] = trio.Event()
            registry.changed()
            await news[0].wait()
            nursery.cancel_scope.cancel()
        return await registry.hosts()

    hosts = run_connected(nats_server.url, body)
    assert announced == [0, 1]
    assert [(h.host_id, h.load) for h in hosts] == [("a", 1)]


def test_session_metadata_round_trips(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[Any, Any, Any]:
        directory = await SessionDirectory.open(conn)
        await directory.put("s1", {"workspace": "/w", "tools": ["bash"]})
        got = await directory.get("s1")
        missing = await directory.get("nope")
        return got, missing, sorted(await directory.ids())

    assert run_connected(nats_server.url, body) == (
        {"workspace": "/w", "tools": ["bash"]},
        None,
        ["s1"],
    )


def test_requests_reach_the_owner_and_time_out_without_one(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[dict[str, Any], dict[str, Any], str]:
        requests = SessionRequests(conn)

        async def owner(message: dict[str, Any], _answering: Answering) -> dict[str, Any]:
            if message.get("method") == "fail":
                raise RuntimeError("broken tool table")
            return {"result": {"echo": message["params"]}}

        async with trio.open_nursery() as nursery:
            await nursery.start(requests.serve, "s1", owner)
            answered = await requests.request("s1", {"method": "run", "params": {"x": 1}})
            failed = await requests.request("s1", {"method": "fail", "params": {}})
            nursery.cancel_scope.cancel()
        try:
            await requests.request("s1", {"method": "run", "params": {}}, timeout_s=0.3)
            unreachable = "answered"
        except OwnerUnreachable as exc:
            unreachable = str(exc)
        return answered, failed, unreachable

    answered, failed, unreachable = run_connected(nats_server.url, body)
    assert answered == {"result": {"echo": {"x": 1}}}
    assert failed["error"]["code"] == -32603
    assert "broken tool table" in failed["error"]["message"]
    assert "no host answered for session s1" in unreachable


CUT_SHORT_BOUND_S = 5.0
"""Far below the senders' timeout: an answer within it is the cut-short one."""


def _serving_s1(
    requests: SessionRequests, serving: trio.CancelScope, owner: Any, replies: dict[str, Any]
) -> tuple[Any, Any]:
    """``serve`` (session s1's requests, answered by ``owner``, until ``serving`` is
    cancelled) and ``ask(method)`` (its reply put in ``replies``, asked with 60 s to wait)."""

    async def serve(task_status: trio.TaskStatus[None]) -> None:
        with serving:
            await requests.serve("s1", owner, task_status=task_status)

    async def ask(method: str) -> None:
        replies[method] = await requests.request(
            "s1", {"method": method, "params": {}}, timeout_s=60.0
        )

    return serve, ask


def test_requests_cut_short_by_the_owner_giving_the_session_up_are_answered_at_once(
    nats_server: NatsProcess,
) -> None:
    """R-CLUSTER-1: the owner stops serving a session (hand-over, drain, lease lost, close)
    while it answers two requests, one that has done nothing yet and one that has begun
    what it asks. Each sender hears so at once, with a 503 whose ``data.outcome`` says
    whether the call may have been carried out, instead of waiting out its timeout (60 s
    here). A reply made as the owner stops (the third request's handler stops serving,
    then answers) is sent all the same."""

    async def body(conn: Connection) -> dict[str, Any]:
        requests = SessionRequests(conn)
        entered = {"waiting": trio.Event(), "begun": trio.Event()}
        never = trio.Event()
        serving = trio.CancelScope()

        async def owner(message: dict[str, Any], answering: Answering) -> dict[str, Any]:
            method = message["method"]
            if method == "replied":
                serving.cancel()
                return {"result": {"made": True}}
            answering.in_doubt = method == "begun"
            entered[method].set()
            await never.wait()
            return {"result": {}}

        replies: dict[str, Any] = {}
        serve, ask = _serving_s1(requests, serving, owner, replies)

        with trio.fail_after(CUT_SHORT_BOUND_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve)
                nursery.start_soon(ask, "waiting")
                nursery.start_soon(ask, "begun")
                await entered["waiting"].wait()
                await entered["begun"].wait()
                nursery.start_soon(ask, "replied")
        return replies

    replies = run_connected(nats_server.url, body)
    assert replies["replied"] == {"result": {"made": True}}
    waiting, begun = replies["waiting"]["error"], replies["begun"]["error"]
    assert waiting["code"] == begun["code"] == OWNER_UNREACHABLE
    assert waiting["data"] == {"outcome": NOT_DONE}
    assert "nothing was done" in waiting["message"]
    assert begun["data"] == {"outcome": IN_DOUBT}
    assert "may have been done" in begun["message"]


def test_requests_that_arrive_as_the_owner_stops_serving_are_turned_away_at_once(
    nats_server: NatsProcess,
) -> None:
    """A request that reaches the owner after it began to stop serving the session (while
    a handler still finishes) is never handled: its sender is told at once that nothing
    was done, instead of waiting out its timeout (60 s here)."""

    async def body(conn: Connection) -> dict[str, Any]:
        requests = SessionRequests(conn)
        entered, finish = trio.Event(), trio.Event()
        serving = trio.CancelScope()
        handled: list[str] = []

        async def owner(message: dict[str, Any], answering: Answering) -> dict[str, Any]:
            handled.append(message["method"])
            entered.set()
            with trio.CancelScope(shield=True):  # a handler that ends its work first
                await finish.wait()
            return {"result": {}}

        replies: dict[str, Any] = {}
        serve, ask = _serving_s1(requests, serving, owner, replies)

        with trio.fail_after(CUT_SHORT_BOUND_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve)
                nursery.start_soon(ask, "first")
                await entered.wait()
                serving.cancel()
                nursery.start_soon(ask, "late")
                (inbox,) = conn.inboxes
                while not inbox._items:  # noqa: ASYNC110 (put there from asyncio: no event)
                    await trio.sleep(0.01)
                finish.set()
        replies["handled"] = handled
        return replies

    replies = run_connected(nats_server.url, body)
    assert replies["handled"] == ["first"]
    assert replies["first"] == {"result": {}}
    late = replies["late"]["error"]
    assert late["code"] == OWNER_UNREACHABLE
    assert late["data"] == {"outcome": NOT_DONE}


IN_FLIGHT_BOUND_S = 15.0
"""Far below the senders' timeout (60 s): a call answered within it was not lost."""


def test_calls_forwarded_as_the_owner_stops_serving_all_hear_at_once(
    nats_server: NatsProcess,
) -> None:
    """R-CLUSTER-1: another host's gateway forwards a stream of calls to a session (64 at a
    time) while its owner stops serving it. Every call hears at once — its reply, a 503
    saying it was cut short or turned away, or no host serving the session — and none
    waits out its timeout (60 s here): the owner takes in the calls the server sent it
    before it stopped, which an unsubscription alone would drop on arrival."""
    lanes = 64

    async def body(conn: Connection) -> tuple[set[int], dict[str, int]]:
        gateway_conn = await connect(conn.bridge, nats_server.url, name="gw", names=conn.names)
        gateway = SessionRequests(gateway_conn)
        serving = trio.CancelScope()
        heard = {"result": 0, "cut short": 0, "no host": 0}
        unanswered: set[int] = set()
        flowing = trio.Event()
        sent = 0

        async def owner(_message: dict[str, Any], _answering: Answering) -> dict[str, Any]:
            return {"result": {}}

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            with serving:
                await SessionRequests(conn).serve("s1", owner, task_status=task_status)

        async def lane() -> None:
            nonlocal sent
            while True:
                call, sent = sent, sent + 1
                unanswered.add(call)
                try:
                    reply = await gateway.request("s1", {"method": "run"}, timeout_s=60.0)
                except OwnerUnreachable:
                    heard["no host"] += 1
                    unanswered.discard(call)
                    return  # the owner has stopped serving: the stream ends
                unanswered.discard(call)
                heard["result" if "result" in reply else "cut short"] += 1
                if heard["result"] >= 4 * lanes:
                    flowing.set()

        try:
            with trio.move_on_after(IN_FLIGHT_BOUND_S):
                async with trio.open_nursery() as nursery:
                    await nursery.start(serve)
                    for _ in range(lanes):
                        nursery.start_soon(lane)
                    await flowing.wait()
                    serving.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await gateway_conn.aclose()
        return unanswered, heard

    unanswered, heard = run_connected(nats_server.url, body, timeout_s=IN_FLIGHT_BOUND_S + 15)
    assert unanswered == set(), heard
    assert heard["no host"] == lanes


def test_messages_left_in_a_subscription_as_it_ends_are_all_there_after_it(
    nats_server: NatsProcess,
) -> None:
    """R-CLUSTER-1: the messages the server sent a subscription before its block ended and
    that nobody took yet — more than its inbox holds — are all in the inbox after the
    block, in order, and the block ends at once (a host that stops serving a session
    answers the requests among them)."""

    async def body(conn: Connection) -> list[int]:
        subject = f"{conn.names.prefix}.left"
        with trio.fail_after(CUT_SHORT_BOUND_S):
            async with conn.subscription(subject) as messages:
                await conn.call(publish_numbers(conn, subject, 6000))
        return [int(msg.data) async for msg in messages]

    assert run_connected(nats_server.url, body) == list(range(6000))


async def stopped(server: NatsProcess) -> None:
    """Stop ``server`` (SIGSTOP); return once it has stopped. The signal takes effect
    a moment later: meanwhile the server may still answer what it is sent."""
    server.process.send_signal(signal.SIGSTOP)
    await trio.to_thread.run_sync(os.waitpid, server.process.pid, os.WUNTRACED)


SUBSCRIPTION_END_BOUND_S = 5.0
"""A subscription's block is bounded at 2 s; 3 s more for a busy machine, and still below
what is left of a drain's 8 s in the background once the block has ended (a drain that
settled within it was settled by the server's answer)."""


def test_a_shutdown_during_a_drain_the_server_leaves_unanswered_leaves_no_subscription(
    nats_server: NatsProcess,
) -> None:
    """R-CLUSTER-1: a host shuts down while the server does not answer (stopped): the drain
    that ends its subscription waits for a round trip that does not come. The block ends
    within its bound, the drain going on in the background, and once the server answers
    the client holds the subscription no more: held, it would be subscribed again when
    the client reconnects and drop what came to it, every request waiting out its
    timeout. (Before the drain went on in the background it was unsubscribed as it was
    cut short, and a request the server had sent before it was lost.)"""

    async def body(conn: Connection) -> tuple[float, set[int], set[int]]:
        subject = f"{conn.names.prefix}.stalled"
        before = set(conn.client._subs)
        with trio.CancelScope() as shutdown:
            async with conn.subscription(subject):
                made = set(conn.client._subs) - before
                await stopped(nats_server)
                started = trio.current_time()
                shutdown.cancel()
                await trio.sleep_forever()
        took = trio.current_time() - started
        draining = {sub._id for sub in conn.lingering.drains}
        nats_server.process.send_signal(signal.SIGCONT)
        with trio.fail_after(SUBSCRIPTION_END_BOUND_S):
            await conn.settled()
        return took, made - draining, made & set(conn.client._subs)

    try:
        took, not_draining, left = run_connected(nats_server.url, body)
    finally:
        nats_server.process.send_signal(signal.SIGCONT)
    assert took < SUBSCRIPTION_END_BOUND_S
    assert not_draining == set()
    assert left == set()


def test_a_drain_cut_short_ends_its_subscription_when_the_connection_is_lost(
    tmp_path: Path,
) -> None:
    """R-CLUSTER-1: a drain cut short goes on in the background only while the connection
    holds: the connection lost (its server killed while it did not answer), the client
    holds the subscription no more, at once rather than at the drain's bound. Held, it
    would be subscribed again on the server the client reconnects to, where it would take
    the subject's next server's requests."""
    with running_nats(tmp_path / "nats") as server:

        async def body(conn: Connection) -> set[int]:
            subject = f"{conn.names.prefix}.lost"
            before = set(conn.client._subs)
            with trio.CancelScope() as shutdown:
                async with conn.subscription(subject):
                    made = set(conn.client._subs) - before
                    await stopped(server)
                    shutdown.cancel()
                    await trio.sleep_forever()
            assert conn.lingering.drains
            server.stop()
            with trio.fail_after(CONNECTION_LOSS_BOUND_S):
                await conn.settled()
            return made & set(conn.client._subs)

        assert run_connected(server.url, body) == set()


CONNECTION_LOSS_BOUND_S = 4.0
"""Far below what is left of a drain's 8 s once its block has ended (1 s): a drain ended
within it was ended by the lost connection."""


def test_a_request_sent_before_a_drain_the_server_answers_late_is_turned_away_at_once(
    nats_server: NatsProcess,
) -> None:
    """R-CLUSTER-1: the owner stops serving a session while a request the server
    sent it before the UNSUB is held up on its way in (the client's reader stalls on it,
    and the drain's PONG behind it): the drain is not done within its 1 s, and the
    serving ends. When the request arrives it is turned away at once, ``not_done`` (the
    drain goes on in the background), and the subscription is gone once the drain ends.
    Before, the drain cut short unsubscribed, nats-py dropped the request on arrival, and
    its sender waited out its whole timeout (60 s here)."""

    async def body(conn: Connection) -> tuple[dict[str, Any], set[int]]:
        requests = SessionRequests(conn)
        subject = conn.names.request_subject("s1")
        arrived = trio.Event()
        release = asyncio.Event()
        read = conn.client._process_msg

        async def held_up(sid: int, subj: bytes, reply: bytes, data: bytes, hdr: Any) -> None:
            if subj.decode() == subject:
                conn.bridge.wake(arrived)
                await release.wait()
            await read(sid, subj, reply, data, hdr)

        conn.client._process_msg = held_up  # type: ignore[method-assign]

        async def owner(_message: dict[str, Any], _answering: Answering) -> dict[str, Any]:
            return {"result": {}}

        serving = trio.CancelScope()
        replies: dict[str, Any] = {}
        serve, ask = _serving_s1(requests, serving, owner, replies)

        async def serve_then_release(task_status: trio.TaskStatus[None]) -> None:
            await serve(task_status)
            release.set()

        before = set(conn.client._subs)
        with trio.fail_after(CUT_SHORT_BOUND_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_then_release)
                made = set(conn.client._subs) - before
                nursery.start_soon(ask, "late")
                await arrived.wait()
                serving.cancel()
            await conn.settled()
        return replies["late"], made & set(conn.client._subs)

    late, left = run_connected(nats_server.url, body)
    assert late["error"]["code"] == OWNER_UNREACHABLE
    assert late["error"]["data"] == {"outcome": NOT_DONE}
    assert left == set()


ROUND_TRIP_BOUND_S = 10.0
"""A message's round trip through a server that answers: seconds at most, on a busy
machine; a deaf client never makes it."""


def test_a_flush_that_timed_out_leaves_the_connection_reading_when_its_pong_comes(
    nats_server: NatsProcess,
) -> None:
    """R-CLUSTER-1: a flush (a PING, waiting for its PONG) that times out while the server
    does not answer, as a drain or a subscription's confirmation can. nats-py cancels the
    flush's future but keeps it queued, and when the PONG comes at last it set the result
    of that cancelled future: the read loop died on InvalidStateError and the connection,
    still "connected", received nothing more until a reconnect, minutes later. The late
    PONG is now taken for the flush it answers, and messages go on arriving."""

    async def body(conn: Connection) -> bytes:
        subject = f"{conn.names.prefix}.after_pong"
        async with conn.subscription(subject) as messages:
            await stopped(nats_server)
            try:
                with contextlib.suppress(ClusterUnavailable):  # its flush timed out
                    await conn.call(conn.client.flush(timeout=1))
            finally:
                nats_server.process.send_signal(signal.SIGCONT)
            with trio.fail_after(ROUND_TRIP_BOUND_S):
                await conn.call(conn.client.publish(subject, b"still reading"))
                async for msg in messages:
                    return bytes(msg.data)
        raise AssertionError("the subscription ended")

    assert run_connected(nats_server.url, body) == b"still reading"
