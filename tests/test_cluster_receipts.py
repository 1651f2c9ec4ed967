"""What a steer is answered on a cluster host whose JetStream has not acknowledged its
record (R-STEER-1, R-STEER-6, R-CLUSTER-1, R-HOST-3): ``queued: true`` only once the
record is in the cluster, so a host that takes the session over delivers the input; a
record the host gave up unacknowledged (its session's trace fenced by another host) is a
dropped input, answered 410. In-process host on a real nats-server; the appends of the
session's trace are held, so JetStream withholds the acknowledgement."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, Gates, allow_all

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.node import ClusterConfig, ClusterNode, open_cluster_host
from greenroom.actors.cluster.store import ReplicatingTraceLog, ReplicatingTraceStore
from greenroom.actors.cluster.traces import TraceStream, TraceWriter
from greenroom.actors.gateway.methods import once_recorded
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, tool_call
from greenroom.actors.runtime import emitter as emitter_module
from greenroom.actors.runtime import host as host_module
from greenroom.actors.runtime import supervisor as supervisor_module
from greenroom.actors.runtime.emitter import DURABLE_WAIT_S
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.trace_sink import TraceSink
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)


class Withheld:
    """JetStream withholds the acknowledgement of every append of a session's trace from
    ``withhold.set()`` until ``release.set()``; then each goes to the server as it was.
    ``holding`` is set once one is held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.withhold = trio.Event()
        self.release = trio.Event()
        self.holding = trio.Event()
        append = TraceWriter.append

        async def held_append(writer: TraceWriter, lines: Sequence[str]) -> int:
            if self.withhold.is_set():
                self.holding.set()
                await self.release.wait()
            return await append(writer, lines)

        monkeypatch.setattr(TraceWriter, "append", held_append)


async def _waiting_in_its_call(host: Host, workspace: Path) -> Session:
    """A session of ``host`` whose task waits in its tool call (the prompt and the call are
    in the cluster)."""
    gates = Gates()
    session = await host.create_session(
        provider=ScriptedProvider([Reply(blocks=(tool_call("c1", "wait", key="k"),))]),
        workspace_dir=workspace,
        tools=[gates.tool()],
    )
    session.run("go", approve=allow_all)
    await gates.started("k")  # the prompt and the call are in the cluster
    return session


async def _all_in_the_cluster(host: Host, session: Session) -> None:
    """Return once JetStream acknowledged every record of ``session`` so far: a record
    held from now on is the next one's alone (the tool call may start before the records
    of the request that made it are acknowledged)."""
    store = host.trace_store
    assert isinstance(store, ReplicatingTraceStore)
    with trio.fail_after(RUN_TIMEOUT_S):
        assert await store.log.settled(session.id)


async def _steered_unacknowledged(
    host: Host, workspace: Path, withheld: Withheld, recorded: InputReceipt
) -> Session:
    """A session of ``host`` whose task waits in its tool call, steered with ``recorded``
    once every earlier record is in the cluster: the steer's record waits for JetStream."""
    session = await _waiting_in_its_call(host, workspace)
    await _all_in_the_cluster(host, session)
    withheld.withhold.set()
    assert session.steer("mind the gap", recorded=recorded)
    await trio.testing.wait_all_tasks_blocked()
    assert not recorded.settled.is_set()  # written, not acknowledged
    return session


async def _answer(recorded: InputReceipt) -> str:
    """What the gateway's steer answers for ``recorded``: its result, or its error's
    message."""
    try:
        return str(await once_recorded(recorded))
    except RpcError as refused:
        assert refused.code == jsonrpc.GONE
        return refused.message


async def _cluster_lines(conn: Connection, session_id: str) -> str:
    read = await (await TraceStream.open(conn)).read(session_id)
    return "".join(str(record) for record in read.records)


FENCED = "another host took this session over: its trace is fenced"
NOT_REPLICATED = "the session stopped being replicated before its trace reached the cluster"


def assert_not_in_cluster(answer: str, why: str) -> None:
    """``answer`` is the 410 of a steer whose record never reached the cluster's trace,
    for ``why``."""
    assert answer.startswith(
        "the input was dropped, not queued: its record did not reach the cluster's trace"
        " (cannot write "
    )
    assert answer.endswith(f"{why})")


def host_a(
    conn: Connection, nats_server: NatsProcess, tmp_path: Path, **options: Any
) -> AbstractAsyncContextManager[Host]:
    """Cluster host a on ``nats_server``, its data dir in ``tmp_path``, every call allowed
    (``options`` as for ``open_cluster_host``)."""
    config = ClusterConfig(url=nats_server.url, host_id="a", prefix=conn.names.prefix)
    return open_cluster_host(conn.bridge, config, tmp_path / "a", approve=allow_all, **options)


def _lease_lost_once_acknowledged(
    marker: str, monkeypatch: pytest.MonkeyPatch
) -> list[ClusterNode]:
    """The nodes a test's host appends to (``on_node``): the first loses its lease the
    moment JetStream acknowledges a record whose line holds ``marker``."""
    nodes: list[ClusterNode] = []
    acknowledge = ReplicatingTraceLog._acknowledge

    def acknowledged_then_lost(log: ReplicatingTraceLog, done: list[tuple[int, int, str]]) -> None:
        acknowledge(log, done)
        if any(marker in line for _, _, line in done):
            _lose_the_lease(nodes[0])

    monkeypatch.setattr(ReplicatingTraceLog, "_acknowledge", acknowledged_then_lost)
    return nodes


def _lose_the_lease(node: ClusterNode) -> None:
    """``node``'s lease lost in an outage: every session it owned given up."""
    keeper = node._keeper
    assert keeper is not None
    keeper._lose_all("the test's outage")


def test_a_steer_whose_trace_another_host_fenced_before_jetstream_had_it_is_dropped(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the fence gave the steer's record up and counted it as done: the receipt
    settled durable, the client was told ``queued: true``, and the host that fenced the
    trace never saw the input."""
    withheld = Withheld(monkeypatch)
    recorded = InputReceipt()

    async def body(conn: Connection) -> tuple[str, str]:
        async with host_a(conn, nats_server, tmp_path) as host:
            session = await _steered_unacknowledged(host, tmp_path, withheld, recorded)
            await (await TraceStream.open(conn)).fence(session.id, "b")  # b takes it over
            withheld.release.set()
            with trio.fail_after(RUN_TIMEOUT_S):
                await recorded.settled.wait()
            return await _answer(recorded), await _cluster_lines(conn, session.id)

    answer, in_cluster = run_connected(nats_server.url, body, timeout_s=60.0)
    assert "mind the gap" not in in_cluster
    assert_not_in_cluster(answer, FENCED)


def test_a_steer_whose_session_the_host_lost_before_jetstream_had_it_is_dropped(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's lease lost (every session it owned given up to the orphan scan) and
    another host's fence written while the steer's record waits for JetStream. Before,
    giving the session up counted the record as done: ``queued: true``, for input no host
    would ever run. (Without that fence, a record on its way when the session is given up
    goes again and is stored: see the store's tests.)"""
    withheld = Withheld(monkeypatch)
    recorded = InputReceipt()
    nodes: list[ClusterNode] = []

    async def body(conn: Connection) -> tuple[str, str]:
        async with host_a(conn, nats_server, tmp_path, on_node=nodes.append) as host:
            session = await _steered_unacknowledged(host, tmp_path, withheld, recorded)
            await (await TraceStream.open(conn)).fence(session.id, "b")  # b takes it over
            _lose_the_lease(nodes[0])
            with trio.fail_after(RUN_TIMEOUT_S):
                await recorded.settled.wait()
            answer = await _answer(recorded)
            withheld.release.set()  # too late: the record was given up
            return answer, await _cluster_lines(conn, session.id)

    answer, in_cluster = run_connected(nats_server.url, body, timeout_s=60.0)
    assert "mind the gap" not in in_cluster
    assert_not_in_cluster(answer, NOT_REPLICATED)


def test_a_steer_on_its_way_when_the_host_close_is_cut_short_is_answered_at_once(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-DRAIN-2, R-CLUSTER-2: the host closes while the steer's record is on
    its way to JetStream, unacknowledged, and its shutdown bound (shortened here) cuts the
    close of its session and of its store short. Before, the cut-short store close skipped
    giving its records up: the receipt waited its own DURABLE_WAIT_S (30 s) and held the
    host's close that long; then it counted the record lost without asking JetStream (a
    410 for input the cluster's trace may hold). Now the store gives it up however its
    close ends, and finds out at once what JetStream holds: the message that was on its
    way goes again with its id, so it is stored once, and the steer is ``queued``."""
    # The receipt waits for the store from the end of its supervisor's wait for the
    # record (ABORT_GRACE_S), well before the host's close is cut short.
    monkeypatch.setattr(supervisor_module, "ABORT_GRACE_S", 0.2)
    monkeypatch.setattr(host_module, "SHUTDOWN_GRACE_S", 2.0)
    withheld = Withheld(monkeypatch)
    recorded = InputReceipt()

    async def body(conn: Connection) -> tuple[str, str]:
        # Well before a receipt's own bound, which the close waited for before.
        with trio.fail_after(DURABLE_WAIT_S / 2):
            async with host_a(conn, nats_server, tmp_path) as host:
                session = await _waiting_in_its_call(host, tmp_path)
                await _all_in_the_cluster(host, session)
                withheld.withhold.set()
                assert session.steer("mind the gap", recorded=recorded)
                await withheld.holding.wait()
            assert recorded.settled.is_set()
        withheld.release.set()  # the held attempt, never sent
        return await _answer(recorded), await _cluster_lines(conn, session.id)

    answer, in_cluster = run_connected(nats_server.url, body, timeout_s=60.0)
    assert answer == str({"queued": True})
    assert in_cluster.count("mind the gap") == 1


def test_a_steer_on_its_way_whose_fate_nats_does_not_tell_is_answered_in_doubt(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-CLUSTER-2: the host's lease is lost while the steer's record is on its
    way to JetStream, and NATS does not answer whether it stored it. Before, the record
    counted as lost: 410 "dropped, not queued" for input the next host may run, which a
    client would send again. Now the answer says it may have been queued: a 503 whose
    ``data.outcome`` is ``unknown``, as a cluster answers any call in doubt."""
    withheld = Withheld(monkeypatch)

    async def unanswered(writer: TraceWriter, lines: Sequence[str]) -> bool:
        raise ClusterUnavailable("NATS is unavailable: the test's outage")

    monkeypatch.setattr(TraceWriter, "holds", unanswered)
    recorded = InputReceipt()
    nodes: list[ClusterNode] = []

    async def body(conn: Connection) -> RpcError:
        async with host_a(conn, nats_server, tmp_path, on_node=nodes.append) as host:
            session = await _waiting_in_its_call(host, tmp_path)
            await _all_in_the_cluster(host, session)
            withheld.withhold.set()
            assert session.steer("mind the gap", recorded=recorded)
            with trio.fail_after(RUN_TIMEOUT_S):
                await withheld.holding.wait()
            _lose_the_lease(nodes[0])
            with trio.fail_after(RUN_TIMEOUT_S):
                await recorded.settled.wait()
            with pytest.raises(RpcError) as answered:
                await once_recorded(recorded)
            return answered.value

    answer = run_connected(nats_server.url, body, timeout_s=60.0)
    assert (answer.code, answer.data) == (jsonrpc.UNAVAILABLE, {"outcome": "unknown"})
    assert answer.message.startswith(
        "the input may have been queued: its record may or may not have reached the "
        "cluster's trace (cannot write "
    )
    assert answer.message.endswith("sending it again may queue it twice")


def test_a_steer_after_the_store_gave_the_session_up_is_dropped_while_it_is_open(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-CLUSTER-1: the store gave the session's replication up (as when the
    host lost its lease) and the session is still open here: a steer's record reaches
    only this host's files, never the cluster's trace. Before, the failed sync of its
    receipt in an open session settled it durable (``queued: true``)."""
    recorded = InputReceipt()

    async def body(conn: Connection) -> tuple[str, str]:
        async with host_a(conn, nats_server, tmp_path) as host:
            session = await _waiting_in_its_call(host, tmp_path)
            store = host.trace_store
            assert isinstance(store, ReplicatingTraceStore)
            store.log.forget(session.id)  # nothing was pending: every record acknowledged
            assert session.steer("mind the gap", recorded=recorded)
            with trio.fail_after(RUN_TIMEOUT_S):
                await recorded.settled.wait()
            assert not host.port(session.id).closed  # still open here
            return await _answer(recorded), await _cluster_lines(conn, session.id)

    answer, in_cluster = run_connected(nats_server.url, body, timeout_s=60.0)
    assert "mind the gap" not in in_cluster
    assert_not_in_cluster(answer, NOT_REPLICATED)


def test_a_steer_jetstream_acknowledged_before_the_host_lost_its_session_is_queued(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-CLUSTER-1: the host's lease is lost the moment JetStream acknowledges
    the steer's record, before the session hears of it. Before, giving the session up
    marked its every record lost, the acknowledged one too: the steer was answered 410
    though the cluster's trace holds it (and the host taking the session up runs it)."""
    withheld = Withheld(monkeypatch)
    recorded = InputReceipt()
    # At the steer's own acknowledgement: an earlier record's may come first.
    nodes = _lease_lost_once_acknowledged('"steering_queued"', monkeypatch)

    async def body(conn: Connection) -> tuple[str, str]:
        async with host_a(conn, nats_server, tmp_path, on_node=nodes.append) as host:
            session = await _steered_unacknowledged(host, tmp_path, withheld, recorded)
            withheld.release.set()
            with trio.fail_after(RUN_TIMEOUT_S):
                await recorded.settled.wait()
            return await _answer(recorded), await _cluster_lines(conn, session.id)

    answer, in_cluster = run_connected(nats_server.url, body, timeout_s=60.0)
    assert "mind the gap" in in_cluster
    assert answer == str({"queued": True})


def test_a_steer_jetstream_acknowledged_is_queued_though_a_later_one_was_given_up(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-CLUSTER-1, R-CLUSTER-2: a second steer's record waits for JetStream
    behind the first's; the host's lease is lost the moment JetStream acknowledges the
    first, so the second is given up unacknowledged. Each receipt is settled by its own
    record: the first is in the cluster's trace (the host taking the session up runs it),
    ``queued: true``; the second never reached it, 410. Before, the first asked whether
    the whole session had lost a record and was answered 410 too."""
    withheld = Withheld(monkeypatch)
    first, second = InputReceipt(), InputReceipt()
    nodes = _lease_lost_once_acknowledged("mind the gap", monkeypatch)

    async def body(conn: Connection) -> tuple[str, str, str]:
        async with host_a(conn, nats_server, tmp_path, on_node=nodes.append) as host:
            session = await _steered_unacknowledged(host, tmp_path, withheld, first)
            with trio.fail_after(RUN_TIMEOUT_S):
                await withheld.holding.wait()
            # The first's message is held at JetStream: the second queues behind it.
            assert session.steer("and the second step", recorded=second)
            await trio.testing.wait_all_tasks_blocked()
            assert not second.settled.is_set()
            withheld.release.set()
            with trio.fail_after(RUN_TIMEOUT_S):
                await first.settled.wait()
                await second.settled.wait()
            answers = await _answer(first), await _answer(second)
            return *answers, await _cluster_lines(conn, session.id)

    first_answer, second_answer, in_cluster = run_connected(
        nats_server.url, body, timeout_s=60.0
    )
    assert "mind the gap" in in_cluster
    assert first_answer == str({"queued": True})
    assert "and the second step" not in in_cluster
    assert_not_in_cluster(second_answer, NOT_REPLICATED)


def test_a_steer_the_host_lost_is_dropped_though_its_session_is_released_before_it_asks(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-CLUSTER-1: the host's lease is lost (the session given up, as
    ``ClusterNode._give_up`` does: its replication forgotten, then the session closed
    here) as a steer comes; the steer's record reaches only this host's files, and its
    receipt's fsync is slow (held here) until the session is closed and released. Before,
    the receipt then asked the store about a session it no longer knew: its sync raised
    nothing, and the client was told ``queued: true`` for input no host runs."""
    receipt_tasks: set[trio.lowlevel.Task] = set()
    holding, released = trio.Event(), trio.Event()
    settle, file_sync, release = (
        emitter_module._settle_once_durable,
        TraceSink.sync,
        ReplicatingTraceLog.release,
    )

    async def receipt_settled(*args: Any) -> None:
        receipt_tasks.add(trio.lowlevel.current_task())
        await settle(*args)

    async def slow_for_the_receipt(sink: TraceSink, path: Path | None = None) -> None:
        if trio.lowlevel.current_task() in receipt_tasks:
            holding.set()
            await released.wait()
        await file_sync(sink, path)

    def released_here(log: ReplicatingTraceLog, session_id: str) -> None:
        release(log, session_id)
        released.set()

    monkeypatch.setattr(emitter_module, "_settle_once_durable", receipt_settled)
    monkeypatch.setattr(TraceSink, "sync", slow_for_the_receipt)
    monkeypatch.setattr(ReplicatingTraceLog, "release", released_here)
    recorded = InputReceipt()

    async def body(conn: Connection) -> tuple[str, str]:
        async with host_a(conn, nats_server, tmp_path) as host:
            session = await _waiting_in_its_call(host, tmp_path)
            store = host.trace_store
            assert isinstance(store, ReplicatingTraceStore)
            # Every record so far in the cluster and published: the steer's receipt, the
            # record done at once, waits only for its sync.
            assert await store.log.settled(session.id)
            await trio.testing.wait_all_tasks_blocked()
            store.log.forget(session.id)  # the lease lost
            assert session.steer("mind the gap", recorded=recorded)
            with trio.fail_after(RUN_TIMEOUT_S):
                await holding.wait()
                await host.close_session(session.id)
                await recorded.settled.wait()
            assert released.is_set()
            return await _answer(recorded), await _cluster_lines(conn, session.id)

    answer, in_cluster = run_connected(nats_server.url, body, timeout_s=60.0)
    assert "mind the gap" not in in_cluster
    assert_not_in_cluster(answer, NOT_REPLICATED)
