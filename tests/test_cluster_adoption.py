"""What a cluster host adopts and takes over, found by the chaos benchmark.

A session a cluster host creates is in the session directory before any of its records
is in the cluster's trace (R-CLUSTER-2). The orphan scan finds sessions through the
directory only: a host lost between a session's first replicated record (a task's prompt,
its ``task_start``) and its directory entry left a trace in JetStream that no host would
ever take over (found by the chaos benchmark: tasks SIGKILLed right after ``run`` was
answered never ended). In-process host on a real nats-server; the directory is made slow
for the session's first entry, the window in which the records used to reach the cluster
first.

A draining host takes nothing over (R-DRAIN-2), even when its orphan scan began before
the drain: the sessions the drain hands over are orphans for a moment (given up, their
leases released), and the scan took them back, so the hand-over's target found them
claimed and they waited for the draining host to stop (20 s in the benchmark).

A session whose ownership is lost (the host's lease) while it is adopted or taken over is
neither replicated nor taken up: the loss gave it up, and nothing would stop it after.

A session one of whose appends was stored but not acknowledged goes on where it is: the
retry is no fence (R-CLUSTER-2). A session fenced while this host still holds its claim is
given up, so the orphan scan takes it over."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect
from test_mcp import stdio

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.node import (
    ClusterConfig,
    ClusterNode,
    _lane_done,
    open_cluster_host,
)
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.registry import HostRecord, HostRegistry, SessionDirectory
from greenroom.actors.cluster.traces import TraceStream, TraceWriter
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.session import Session
from greenroom.protocols.outputs import TaskEnd
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)

SLOW_DIRECTORY_S = 1.0
"""How long the session's first directory entry takes: far longer than a short task."""


def test_a_new_session_is_in_the_directory_before_its_first_record_is_in_the_cluster(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    records_at_first_entry: list[int] = []
    checked = trio.Event()
    put = SessionDirectory.put

    async def slow_first_put(self: SessionDirectory, session_id: str, meta: Any) -> None:
        if not records_at_first_entry:
            await trio.sleep(SLOW_DIRECTORY_S)  # the fault: a slow directory
            read = await TraceStream(self._conn).read(session_id)
            records_at_first_entry.append(len(read.records))
            checked.set()
        await put(self, session_id, meta)

    monkeypatch.setattr(SessionDirectory, "put", slow_first_put)

    async def body(conn: Connection) -> list[str]:
        config = ClusterConfig(url=nats_server.url, host_id="a", prefix=conn.names.prefix)
        async with open_cluster_host(
            conn.bridge, config, tmp_path / "a", approve=allow_all
        ) as host:
            session = await host.create_session(
                provider=ScriptedProvider([Reply(blocks=(text("hello"),))]),
                workspace_dir=tmp_path,
            )
            with trio.fail_after(RUN_TIMEOUT_S + SLOW_DIRECTORY_S):
                outputs = [o async for o in session.run("hi", approve=allow_all)]
                await checked.wait()
            assert isinstance(outputs[-1], TaskEnd) and outputs[-1].status == "completed"
            read = await TraceStream.open(conn)
            return [r.TYPE for r in (await read.read(session.id)).records]

    types = run_connected(nats_server.url, body, timeout_s=30.0)
    assert types[:2] == ["user_msg", "task_start"] and types[-1] == "task_end"
    # About to be written, and nothing of the session in the cluster's trace yet.
    assert records_at_first_entry == [0]


def test_a_draining_host_takes_no_orphan_over(tmp_path: Path, nats_server: NatsProcess) -> None:
    orphan = "20261204-121741-0b9825"

    async def body(conn: Connection) -> tuple[bool, str | None]:
        config = ClusterConfig(url=nats_server.url, host_id="a", prefix=conn.names.prefix)
        nodes: list[ClusterNode] = []
        async with open_cluster_host(
            conn.bridge, config, tmp_path / "a", approve=allow_all, on_node=nodes.append
        ) as host:
            # Known to the cluster, no lease: its host has just handed it over.
            await (await SessionDirectory.open(conn)).put(orphan, {"meta": {}, "host": "a"})
            assert await host.drain(0.0) == []
            taken = await nodes[0].take_over(orphan, {})
            leases = await SessionOwners.open(conn, ttl_s=config.lease_ttl_s)
            return taken, await leases.holder(orphan)

    # Not taken, and its lease free for the host the drain hands it to.
    assert run_connected(nats_server.url, body, timeout_s=30.0) == (False, None)


def _losing_the_lease_once_fenced(
    monkeypatch: pytest.MonkeyPatch, nodes: list[ClusterNode]
) -> list[str]:
    """Make the host lose its lease (every session it owns) right after its next fence of
    a session's trace: the window between a claim and the replication. The fenced ids."""
    fence = TraceStream.fence
    fenced: list[str] = []

    async def fence_then_lose(self: TraceStream, session_id: str, host_id: str) -> Any:
        writer = await fence(self, session_id, host_id)
        if not fenced:
            fenced.append(session_id)
            keeper = nodes[0]._keeper
            assert keeper is not None
            keeper._lose_all("the test's stall")
        return writer

    monkeypatch.setattr(TraceStream, "fence", fence_then_lose)
    return fenced


def test_a_session_lost_while_it_is_adopted_is_not_replicated(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host's lease was lost between its claim of a new session and the start of its
    # replication: the adoption went on and replicated a session it no longer owned (the
    # loss had given it up and closed it), with a stream nothing would stop.
    adopted = trio.Event()
    adopt = ClusterNode._adopt

    async def adopt_then_tell(self: ClusterNode, session_id: str) -> None:
        await adopt(self, session_id)
        adopted.set()

    monkeypatch.setattr(ClusterNode, "_adopt", adopt_then_tell)

    async def body(conn: Connection) -> tuple[int, bool, bool]:
        config = ClusterConfig(url=nats_server.url, host_id="a", prefix=conn.names.prefix)
        nodes: list[ClusterNode] = []
        fenced = _losing_the_lease_once_fenced(monkeypatch, nodes)
        async with open_cluster_host(
            conn.bridge, config, tmp_path / "a", approve=allow_all, on_node=nodes.append
        ) as host:
            session = await host.create_session(
                provider=ScriptedProvider([Reply(blocks=(text("hello"),))]),
                workspace_dir=tmp_path,
            )
            with trio.fail_after(RUN_TIMEOUT_S):
                await adopted.wait()
            node = nodes[0]
            assert node.store is not None
            streaming = session.id in node._stream_scopes
            return fenced.count(session.id), node.store.log.replicated(session.id), streaming

    assert run_connected(nats_server.url, body, timeout_s=30.0) == (1, False, False)


def test_a_session_lost_while_it_is_taken_over_is_not_taken_up(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host's lease was lost while it took a session over (after its claim): the
    # takeover went on and took the session's task up unowned (nobody's claim, the host
    # that lost it had given it up), running it until another host fenced it.
    async def body(conn: Connection) -> tuple[bool, bool, bool]:
        config = ClusterConfig(url=nats_server.url, host_id="a", prefix=conn.names.prefix)
        nodes: list[ClusterNode] = []
        async with open_cluster_host(
            conn.bridge, config, tmp_path / "a", approve=allow_all, on_node=nodes.append
        ) as host:
            session = await host.create_session(
                provider=ScriptedProvider([Reply(blocks=(text("hello"),))]),
                workspace_dir=tmp_path,
            )
            with trio.fail_after(RUN_TIMEOUT_S):
                outputs = [o async for o in session.run("hi", approve=allow_all)]
            assert isinstance(outputs[-1], TaskEnd) and outputs[-1].status == "completed"
            node = nodes[0]
            assert node._keeper is not None and node.store is not None
            # An orphan: closed here, its claim given up.
            await host.close_session(session.id)
            await _release_done(node, session.id)
            await node._keeper.release(session.id)
            entry = await (await SessionDirectory.open(conn)).get(session.id)
            assert entry is not None
            fenced = _losing_the_lease_once_fenced(monkeypatch, nodes)
            taken = await node.take_over(session.id, entry["meta"])
            assert fenced == [session.id]
            opened = session.id in {s.id for s in host.sessions}
            return taken, opened, node.store.log.replicated(session.id)

    assert run_connected(nats_server.url, body, timeout_s=30.0) == (False, False, False)


def test_a_session_taken_over_gets_the_mcp_servers_of_its_host(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-MCP-4, R-CLUSTER-2: ``open_cluster_host(mcp_servers=…)`` (``serve --nats
    --mcp-config``): an orphan the host takes over is loaded with those servers' tools
    (before: with none, its next MCP call an unknown tool)."""

    async def body(conn: Connection) -> tuple[bool, bool]:
        config = ClusterConfig(url=nats_server.url, host_id="a", prefix=conn.names.prefix)
        nodes: list[ClusterNode] = []
        async with open_cluster_host(
            conn.bridge, config, tmp_path / "a", mcp_servers={"t": stdio()},
            approve=allow_all, on_node=nodes.append,
        ) as host:  # fmt: skip
            session = await host.create_session(
                provider=ScriptedProvider([Reply(blocks=(text("hello"),))]),
                workspace_dir=tmp_path,
                mcp_servers={"t": stdio()},
            )
            with trio.fail_after(RUN_TIMEOUT_S):
                await collect(session.run("hi", approve=allow_all))
            node = nodes[0]
            assert node._keeper is not None
            # An orphan: closed here, its claim given up.
            await host.close_session(session.id)
            await _release_done(node, session.id)
            await node._keeper.release(session.id)
            entry = await (await SessionDirectory.open(conn)).get(session.id)
            assert entry is not None
            taken = await node.take_over(session.id, entry["meta"])
            tools = {t.name for t in host.get_session(session.id).tools}
            return taken, "mcp__t__echo" in tools

    assert run_connected(nats_server.url, body, timeout_s=30.0) == (True, True)


async def _release_done(node: ClusterNode, session_id: str) -> None:
    """Wait for the release the close began in the session's lane, as the node's own
    takeovers do (``_lane_done``): a release still under way when the test takes the
    session over would release the new claim under it ("lost while this host took it
    over"), which a loaded machine made happen."""
    await _lane_done(node._lanes, node._work, session_id, node.serves)


LEASE_TTL_S = 1.0


@contextlib.asynccontextmanager
async def _host_a_after_a_task(
    conn: Connection, nats_server: NatsProcess, tmp_path: Path
) -> AsyncIterator[tuple[ClusterNode, Session]]:
    """Host ``a`` with one session whose first task has run; its node and the session."""
    config = ClusterConfig(
        url=nats_server.url, host_id="a", prefix=conn.names.prefix, lease_ttl_s=LEASE_TTL_S
    )
    nodes: list[ClusterNode] = []
    async with open_cluster_host(
        conn.bridge, config, tmp_path / "a", approve=allow_all, on_node=nodes.append
    ) as host:
        session = await host.create_session(
            provider=ScriptedProvider([Reply(blocks=(text("one"),)), Reply(blocks=(text("two"),))]),
            workspace_dir=tmp_path,
        )
        with trio.fail_after(RUN_TIMEOUT_S):
            await collect(session.run("hi", approve=allow_all))
        yield nodes[0], session


def test_a_session_whose_append_ack_was_lost_goes_on_here(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An append reached the stream but its acknowledgement was lost (a reconnect): the
    # retry found the stream moved on and took it for a fence by another host, so the
    # session was closed here and taken over, its task interrupted, though nobody else
    # wrote. The retry now finds its own message and the task goes on.
    append = TraceWriter.append
    lost: list[str] = []

    async def ack_lost_once(self: TraceWriter, lines: Any) -> int:
        expected = self.expected
        sequence = await append(self, lines)
        if armed and not lost:
            lost.append(self.session_id)
            self.expected = expected  # the writer never heard of the new sequence
            raise ClusterUnavailable("the acknowledgement was lost")
        return sequence

    armed = False
    monkeypatch.setattr(TraceWriter, "append", ack_lost_once)

    async def body(conn: Connection) -> dict[str, object]:
        nonlocal armed
        async with _host_a_after_a_task(conn, nats_server, tmp_path) as (node, session):
            armed = True
            with trio.fail_after(RUN_TIMEOUT_S):
                outputs = await collect(session.run("again", approve=allow_all))
            owners = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
            seqs = [r.seq for r in (await TraceStream(conn).read(session.id)).records]
            end = outputs[-1]  # the task goes on to its end, not interrupted
            return {
                "lost": lost == [session.id],
                "end": end.status if isinstance(end, TaskEnd) else type(end).__name__,
                "served": node.serves(session.id),
                "holder": await owners.holder(session.id),
                "seqs once": sorted(set(seqs)) == seqs,
            }

    assert run_connected(nats_server.url, body, timeout_s=60.0) == {
        "lost": True,
        "end": "completed",
        "served": True,
        "holder": "a",
        "seqs once": True,
    }


def test_a_session_fenced_while_its_claim_is_this_hosts_is_not_left_served_by_nobody(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trace was fenced while this host still held the session's claim (a host that
    # fenced it and lost its own claim before taking it up): the session was closed here
    # and its claim kept, so it stayed owned by this host and served by none, and no scan
    # would take it over. A fenced session's claim is given up as an abandoned one's is.
    taken_over = trio.Event()
    take_entries = ClusterNode._take_entries  # what the orphan scan takes its share with

    async def take_over_and_tell(self: ClusterNode, entries: dict[str, Any]) -> list[str]:
        taken = await take_entries(self, entries)
        if taken:
            taken_over.set()
        return taken

    monkeypatch.setattr(ClusterNode, "_take_entries", take_over_and_tell)

    async def body(conn: Connection) -> tuple[bool, str | None]:
        async with _host_a_after_a_task(conn, nats_server, tmp_path) as (node, session):
            await (await TraceStream.open(conn)).fence(session.id, "b")
            session.run("again", approve=allow_all)
            owners = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
            # The orphan scan takes the session over again (the first time it looks).
            with trio.fail_after(RUN_TIMEOUT_S):
                await taken_over.wait()
            return node.serves(session.id), await owners.holder(session.id)

    assert run_connected(nats_server.url, body, timeout_s=60.0) == (True, "a")


def test_a_draining_host_announces_itself_so_and_is_placed_nothing(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    # R-DRAIN-2: as a draining host hands its sessions over its load falls, and it was
    # announced as the least loaded placeable host: new sessions were placed on it (and
    # refused, it drains), orphans assigned to it (and never taken, its scan has ended).
    async def body(conn: Connection) -> tuple[HostRecord, HostRecord, HostRecord | None]:
        config = ClusterConfig(url=nats_server.url, host_id="a", prefix=conn.names.prefix)
        nodes: list[ClusterNode] = []
        async with open_cluster_host(
            conn.bridge, config, tmp_path / "a", approve=allow_all, on_node=nodes.append
        ) as host:
            before = nodes[0]._record()
            assert await host.drain(0.0) == []
            after = nodes[0]._record()
            registry = await HostRegistry.open(conn, ttl_s=config.lease_ttl_s)
            await registry.announce(after)
            (announced,) = await registry.hosts()
            return before, after, HostRecord.from_json(announced.to_json())

    before, after, read_back = run_connected(nats_server.url, body, timeout_s=30.0)
    assert not before.draining
    assert after.draining and not after.placeable
    assert read_back is not None and read_back.draining and not read_back.placeable
