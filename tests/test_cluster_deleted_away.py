"""A session deleted in the cluster while a host that once ran it was away stays deleted
(R-CLUSTER-1, R-CLUSTER-2, R-SEC-9): two in-process cluster hosts, each with its gateway,
on a real nats-server. Host a runs the session and stops (cleanly, or dies: its leases
left to expire), b takes it over and deletes it; a, started again on its data dir, lists
none of it, holds no copy of it, and a client's call on it finds no session. A session
the cluster never knew, or whose trace JetStream still holds, is kept. A running host
whose connection to NATS was down while another deleted such a session deletes its copy
once the connection is back.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from greenroom.actors.cluster import deleted_copies
from greenroom.actors.cluster.connection import Connection, connect
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.node import ClusterNode
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.providers.scripted import ScriptedProvider
from greenroom.actors.runtime.host import Host
from greenroom.protocols import jsonrpc
from tests.support.cut_proxy import CutProxy
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_cluster_forwarding import (
    ANSWERED_S,
    BOUND_S,
    _client,
    _member,
    _session_on,
    _sessions_in_cluster,
    _until,
)


async def _no_release(self: ClusterNode) -> None:
    """A host that dies releases nothing: its sessions wait for its lease to expire."""


@pytest.mark.parametrize("stop", ["cleanly", "dies"])
def test_a_session_deleted_while_its_old_host_was_away_stays_deleted(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """a runs the session and stops; b takes it over and deletes it. a, started again on
    its data dir, deletes its copy: neither a's session.list nor b's lists it, a's data dir
    holds none of it, a call on it through a is a 404 and the cluster does not learn of it
    again. Before, a listed the deleted session as its own (R-CLUSTER-1, R-SEC-9)."""
    if stop == "dies":
        monkeypatch.setattr(ClusterNode, "release_all", _no_release)

    async def body(conn: Connection) -> dict[str, Any]:
        url = nats_server.url
        async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
            sid = await _session_on(a, conn)
            async with _client(a) as client:
                await client.result("run", {"session_id": sid, "input": "hello"})
        directory = await SessionDirectory.open(conn)
        async with _member(conn, url, tmp_path, "b", request_timeout_s=ANSWERED_S) as b:

            async def taken_over() -> bool:
                # b's entry is written once the takeover is done, not while under way.
                entry = await directory.get(sid)
                return b.node.serves(sid) and (entry or {}).get("host") == "b"

            await _until(taken_over)
            await b.host.delete_session(sid)
            deleted = await _sessions_in_cluster(conn, set())
            async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
                async with _client(a) as client:
                    listed_by_a = await client.result("session.list")
                    called = await client.call("session.fork", {"session_id": sid})
                async with _client(b) as client:
                    listed_by_b = await client.result("session.list")
                stored_on_a = [s.session_id for s in await a.host.list_sessions()]
                entry = await directory.get(sid)
        return {
            "sid": sid,
            "deleted": deleted,
            "listed_by_a": [s["session_id"] for s in listed_by_a["sessions"]],
            "listed_by_b": [s["session_id"] for s in listed_by_b["sessions"]],
            "stored_on_a": stored_on_a,
            "called": called,
            "entry": entry,
        }

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert found["sid"] not in found["deleted"], found
    assert found["listed_by_a"] == [] and found["listed_by_b"] == [], found
    assert found["stored_on_a"] == [], found
    assert found["called"].get("error", {}).get("code") == jsonrpc.NOT_FOUND, found
    assert found["entry"] is None, found


def test_a_session_the_cluster_never_knew_or_still_traces_is_kept(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """What a starting host keeps of its data dir: a session the cluster never knew (made
    on this data dir outside the cluster here; as one whose adoption failed before its
    entry was written), and one whose entry is gone while its trace is still in JetStream
    (a purge that failed). Neither is deleted on a guess (R-CLUSTER-1, R-SEC-9); the
    second, deleted in the cluster, is not listed as the host's by ``Host.list_sessions``."""

    async def body(conn: Connection) -> dict[str, Any]:
        url = nats_server.url
        (tmp_path / "ws").mkdir()
        async with Host.open(tmp_path / "a") as alone:
            unknown = await alone.create_session(
                provider=ScriptedProvider([]), workspace_dir=tmp_path / "ws"
            )
        async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
            traced = await _session_on(a, conn)
            async with _client(a) as client:
                await client.result("run", {"session_id": traced, "input": "hello"})
        await (await SessionDirectory.open(conn)).delete(traced)
        async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
            catalog = a.host.trace_store.catalog
            stored = {s.session_id for s in await catalog.list_sessions()}
            listed = {s.session_id for s in await a.host.list_sessions()}
        return {"unknown": unknown.id, "traced": traced, "stored": stored, "listed": listed}

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert {found["unknown"], found["traced"]} <= found["stored"], found
    # The one the cluster deleted is kept in the data dir, not listed as the host's own.
    assert found["unknown"] in found["listed"] and found["traced"] not in found["listed"], found


def _data_dir_of(count: int) -> Any:
    """A host whose data dir holds ``count`` sessions, for the start's pass alone."""
    sessions = [SimpleNamespace(session_id=f"s{i:05d}") for i in range(count)]

    async def list_sessions() -> list[Any]:
        return sessions

    catalog = SimpleNamespace(list_sessions=list_sessions)
    return SimpleNamespace(trace_store=SimpleNamespace(catalog=catalog))


@pytest.mark.parametrize("nats", ["answers slowly", "does not answer"])
async def test_the_start_pass_over_the_data_dir_is_bounded(
    nats: str, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A host with 5,000 sessions in its data dir, NATS open but each read slow (a second,
    or a read timeout of 5 s): its start waited for every read, 16 at a time (over five
    minutes, or 26); the pass stops at the first read NATS does not answer and after
    PASS_BOUND_S in all, keeping every copy it did not look at."""
    reads: list[str] = []

    async def opened(*args: Any, **kwargs: Any) -> object:
        return object()

    async def read(conn: Any, directory: Any, traces: Any, session_id: str) -> bool:
        reads.append(session_id)
        if nats == "does not answer":
            await trio.sleep(5.0)
            raise ClusterUnavailable("NATS is unavailable: timeout")
        await trio.sleep(1.0)
        return False

    monkeypatch.setattr(deleted_copies, "open_bucket", opened)
    monkeypatch.setattr(deleted_copies, "_deleted_in_cluster", read)
    start = trio.current_time()
    conn = SimpleNamespace(names=SimpleNamespace(sessions="greenroom_sessions"))
    await deleted_copies.drop_deleted_copies(conn, None, _data_dir_of(5000))  # type: ignore[arg-type]
    took = trio.current_time() - start
    if nats == "does not answer":
        assert took == 5.0 and len(reads) == deleted_copies.READS_AT_ONCE
    else:
        assert took == deleted_copies.PASS_BOUND_S and len(reads) < 5000


RECONNECTED_S = 15.0
"""nats-py tries again every second once its connection is lost: a copy still here this
long after the connection could be made again was never going to be deleted."""


def test_a_deletion_made_while_the_connection_was_down_is_acted_on_once_it_is_back(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running host's connection to NATS (through a proxy the test cuts) is down while
    another host deletes a session the host holds a copy of: the delete marker reaches
    no subscription of the host. Once the connection is back, the host deletes its copy,
    and keeps a session it runs. Before, the copy stayed until the host's next start
    (R-CLUSTER-1, R-SEC-9)."""
    deleted = trio.Event()
    delete_copy = deleted_copies.delete_copy

    async def noted(host: Host, session_id: str, why: str) -> None:
        await delete_copy(host, session_id, why)
        deleted.set()

    monkeypatch.setattr(deleted_copies, "delete_copy", noted)

    async def body(conn: Connection) -> dict[str, Any]:
        (tmp_path / "ws").mkdir()
        directory = await SessionDirectory.open(conn)
        found: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            proxy = await nursery.start(CutProxy(nats_server.port).serve)
            watched = await connect(conn.bridge, proxy.url, name="a", names=conn.names)
            try:
                async with Host.open(tmp_path / "a") as host, trio.open_nursery() as watching:
                    copy, served = [
                        await host.create_session(
                            provider=ScriptedProvider([]), workspace_dir=tmp_path / "ws"
                        )
                        for _ in range(2)
                    ]
                    await host.close_session(copy.id)
                    for session in (copy, served):
                        await directory.put(session.id, {"host": "b"})  # b took it over
                    traces = await TraceStream.open(watched)
                    watch = deleted_copies.watch_deleted_copies
                    await watching.start(watch, watched, traces, host, {served.id}.__contains__)
                    reconnections = watched.reconnections
                    await proxy.cut()
                    for session in (copy, served):
                        await directory.delete(session.id)  # b deleted it: no trace was replicated
                    found["kept_meanwhile"] = await host.trace_store.catalog.exists(copy.id)
                    proxy.mend()
                    with trio.fail_after(RECONNECTED_S):
                        await deleted.wait()
                    found["reconnected"] = watched.reconnections > reconnections
                    found["stored"] = {
                        s.session_id for s in await host.trace_store.catalog.list_sessions()
                    }
                    found["copy"], found["served"] = copy.id, served.id
                    watching.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await watched.aclose()
                nursery.cancel_scope.cancel()
        return found

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert found["kept_meanwhile"] and found["reconnected"], found
    # The one it runs (here: says it runs) is its own to delete, not the cluster's.
    assert found["stored"] == {found["served"]}, found


CLOSED_S = 5.0
"""A connection's close is bounded at 2 s: more on a busy machine."""


def test_the_watcher_ends_when_its_connection_is_closed(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """The watcher's hearing ends when its connection is closed for good (the host's
    shutdown), as it did before it waited for reconnections too: it does not wait for a
    reconnection that cannot come (R-CLUSTER-1)."""

    async def body(conn: Connection) -> bool:
        watched = await connect(conn.bridge, nats_server.url, name="a", names=conn.names)
        ended = trio.Event()
        async with Host.open(tmp_path / "a") as host, trio.open_nursery() as nursery:
            traces = await TraceStream.open(watched)

            async def watch(task_status: trio.TaskStatus[None]) -> None:
                serves = lambda sid: False  # noqa: E731
                await deleted_copies.watch_deleted_copies(
                    watched, traces, host, serves, task_status=task_status
                )
                ended.set()

            await nursery.start(watch)
            await watched.aclose()
            with trio.move_on_after(CLOSED_S):
                await ended.wait()
            nursery.cancel_scope.cancel()
        return ended.is_set()

    assert run_connected(nats_server.url, body, timeout_s=BOUND_S)
