"""What a host lists of a session it holds a copy of but no longer runs is the cluster's
view (R-CLUSTER-1, R-CLUSTER-2, R-SEC-9): two in-process cluster hosts, each with its
gateway, on a real nats-server.

* a runs a session and closes it; a client's run through b opens it on b, and b deletes
  it, a running all along. a's ``session.list`` and ``Host.list_sessions`` leave it out at
  once, and a deletes its copy: a's data dir holds none of it. Before, a listed its copy
  until it restarted, and ``Host.list_sessions`` until the copy was deleted.
* a runs a session and stops; b takes it over and runs it further. a, started again on
  its data dir, lists it once, as b's (``host``), from the directory, not from its own
  stale copy, and its ``Host.list_sessions`` leaves it out (b's, not a's). Before, a
  listed its copy as its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from greenroom.actors.cluster import deleted_copies, listing
from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.runtime.host import Host
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_cluster_forwarding import (
    ANSWERED_S,
    BOUND_S,
    LEASE_TTL_S,
    Member,
    _client,
    _member,
    _session_on,
    _until,
)


class _HeldDeletions:
    """Deletions of copies through :func:`deleted_copies.delete_copy`, held until the test
    lets them go: ``asked`` once one is asked for, ``done`` once it was carried out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.asked = trio.Event()
        self.go = trio.Event()
        self.done = trio.Event()
        self.deleted: list[str] = []
        delete_copy = deleted_copies.delete_copy

        async def held(host: Host, session_id: str, why: str) -> None:
            self.asked.set()
            await self.go.wait()
            await delete_copy(host, session_id, why)
            self.deleted.append(session_id)
            self.done.set()

        monkeypatch.setattr(deleted_copies, "delete_copy", held)


async def _entry_names(directory: SessionDirectory, sid: str, member: Member) -> None:
    """Return once ``member`` runs ``sid`` and its directory entry says so."""

    async def there() -> bool:
        entry = await directory.get(sid)
        return member.node.serves(sid) and (entry or {}).get("host") == member.node.host_id

    await _until(there)


def test_a_session_deleted_on_another_host_leaves_the_running_host_that_held_a_copy(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listing, "PASS_REUSE_S", 0.0)  # each listing reads the directory
    held = _HeldDeletions(monkeypatch)

    async def body(conn: Connection) -> dict[str, Any]:
        url = nats_server.url
        directory = await SessionDirectory.open(conn)
        found: dict[str, Any] = {}
        async with (
            _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a,
            _member(conn, url, tmp_path, "b", request_timeout_s=ANSWERED_S) as b,
        ):
            sid = found["sid"] = await _session_on(a, conn)
            async with _client(a) as client:
                await client.result("run", {"session_id": sid, "input": "hello"})
            await a.host.close_session(sid)

            async def closed() -> bool:
                return bool((await directory.get(sid) or {}).get("closed"))

            await _until(closed)
            async with _client(b) as client:
                await client.result("run", {"session_id": sid, "input": "again"})
            await _entry_names(directory, sid, b)
            found["listed_before"] = await _listed_by(a)
            await b.host.delete_session(sid)
            with trio.fail_after(2 * LEASE_TTL_S):
                await held.asked.wait()  # a heard of it: the entry is gone
            found["listed_meanwhile"] = await _listed_by(a)
            found["host_listed_meanwhile"] = [s.session_id for s in await a.host.list_sessions()]
            found["stored_meanwhile"] = await a.host.trace_store.catalog.exists(sid)
            held.go.set()
            with trio.fail_after(2 * LEASE_TTL_S):
                await held.done.wait()
            found["listed_after"] = await _listed_by(a)
            found["stored_on_a"] = [s.session_id for s in await a.host.list_sessions()]
            found["dir_on_a"] = (tmp_path / "a" / "sessions" / sid).exists()
            found["entry"] = await directory.get(sid)
        return found

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    sid = found["sid"]
    assert found["listed_before"] == {sid: "b"}, found
    assert found["listed_meanwhile"] == {} and found["listed_after"] == {}, found
    # Its copy is still in a's data dir, not a's session: the cluster deleted it.
    assert found["stored_meanwhile"] and found["host_listed_meanwhile"] == [], found
    assert sid not in found["stored_on_a"] and not found["dir_on_a"], found
    assert found["entry"] is None, found


def test_a_restarted_host_lists_a_session_taken_over_from_it_as_the_cluster_has_it(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(conn: Connection) -> dict[str, Any]:
        url = nats_server.url
        directory = await SessionDirectory.open(conn)
        found: dict[str, Any] = {}
        async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
            sid = found["sid"] = await _session_on(a, conn)
            async with _client(a) as client:
                await client.result("run", {"session_id": sid, "input": "hello"})
        async with _member(conn, url, tmp_path, "b", request_timeout_s=ANSWERED_S) as b:
            await _entry_names(directory, sid, b)
            async with _client(b) as client:
                await client.result("run", {"session_id": sid, "input": "again"})
            async with _member(conn, url, tmp_path, "a", request_timeout_s=ANSWERED_S) as a:
                found["copy_on_a"] = await a.host.trace_store.catalog.exists(sid)
                found["host_lists"] = [s.session_id for s in await a.host.list_sessions()]
                async with _client(a) as client:
                    found["via_a"] = (await client.result("session.list"))["sessions"]
                async with _client(b) as client:
                    found["via_b"] = (await client.result("session.list"))["sessions"]
        return found

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    sid = found["sid"]
    assert found["copy_on_a"], found  # the copy is kept: the session lives on
    assert found["host_lists"] == [], found  # on b: not a's session
    via_a = [s for s in found["via_a"] if s["session_id"] == sid]
    assert len(via_a) == 1 and via_a[0].get("host") == "b", found
    from_b = next(s for s in found["via_b"] if s["session_id"] == sid)
    # The directory's view, as any session of another host: not a's copy's.
    assert "updated_at" not in via_a[0] and "title" not in via_a[0], found
    assert via_a[0]["created_at"] == from_b["created_at"], found
    assert via_a[0]["usage"] is None and via_a[0]["open"] is False, found


async def _listed_by(member: Member) -> dict[str, str | None]:
    """Session id → the ``host`` of each session ``member``'s ``session.list`` lists (None:
    its own)."""
    async with _client(member) as client:
        sessions = (await client.result("session.list"))["sessions"]
    return {s["session_id"]: s.get("host") for s in sessions}


async def test_a_deletion_that_meets_the_unexpected_leaves_the_host_hearing_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each copy is deleted in a task of the node's nursery: whatever one deletion meets
    (here a failure that is neither NATS's nor the disk's), it is logged and the copy
    kept, never raised into the node, which would end the host (R-SEC-1, R-CLUSTER-1)."""

    class _Catalog:
        async def exists(self, session_id: str) -> bool:
            return True

    class _Store:
        catalog = _Catalog()

    class _Host:
        trace_store = _Store()

    class _Traces:
        async def last_sequence(self, session_id: str) -> int:
            return 0  # purged: the copy is to go

    async def failing(host: Host, session_id: str, why: str) -> None:
        raise RuntimeError("the session is busy again")

    monkeypatch.setattr(deleted_copies, "delete_copy", failing)
    monkeypatch.setattr(deleted_copies, "PURGE_WAITS_S", (0.0,))
    looking = {"s1"}
    await deleted_copies._drop_once_purged(
        _Traces(), _Host(), "s1", lambda session_id: False, looking  # type: ignore[arg-type]
    )
    assert looking == set()


@pytest.mark.parametrize("directory", ["unreachable", "too slow"])
async def test_a_cluster_host_that_cannot_read_the_directory_lists_its_data_dir_as_it_is(
    directory: str, autojump_clock: trio.testing.MockClock
) -> None:
    """``Host.list_sessions`` of a cluster host whose directory cannot be read (NATS down,
    or no answer within the bound) lists every copy, as ``session.list`` then lists the
    data dir: none is left out on a guess, and the call never hangs nor raises."""

    class _Directory:
        async def entries(self, *, limit: int) -> Any:
            if directory == "unreachable":
                raise ClusterUnavailable("NATS is unavailable: no servers")
            await trio.sleep_forever()

    passes = listing.DirectoryPasses(_Directory())  # type: ignore[arg-type]
    stale = await listing.stale_copies(
        passes, frozenset({"s1"}), bound_s=LEASE_TTL_S, host_id="a", serves=lambda sid: False
    )
    assert stale == frozenset()
    assert trio.current_time() <= LEASE_TTL_S
