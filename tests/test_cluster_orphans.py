"""Finding orphans without reading every session at every look, against a real nats-server
(R-CLUSTER-2: a lost host's sessions are found at the next look; R-PERF-2: nothing is read
a session while no host is lost)."""

from __future__ import annotations

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.orphans import OrphanFinder, orphan_trees
from greenroom.actors.cluster.ownership import OwnershipKeeper, SessionOwners
from greenroom.actors.cluster.registry import HostRecord, SessionDirectory
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)

TTL_S = 60.0


async def cluster(
    conn: Connection, runs_here: set[str]
) -> tuple[SessionDirectory, SessionOwners, OwnershipKeeper, OrphanFinder]:
    """Sessions a1, a2 owned by host-a; b1 by host-b (this host, runs ``runs_here``);
    loose has no owner."""
    directory = await SessionDirectory.open(conn)
    owners = await SessionOwners.open(conn, ttl_s=TTL_S)
    a = OwnershipKeeper(owners, "host-a", lambda *_: None)
    b = OwnershipKeeper(owners, "host-b", lambda *_: None)
    await a.take_lease()
    await b.take_lease()
    for sid, keeper in (("a1", a), ("a2", a), ("b1", b)):
        assert await keeper.claim(sid) is not None
    for sid in ("a1", "a2", "b1", "loose"):
        await directory.put(sid, {"meta": {"id": sid}})
    finder = OrphanFinder(directory, owners, runs_here.__contains__, full_every=4)
    return directory, owners, a, finder


def test_the_first_look_reads_every_session_this_host_does_not_run(
    nats_server: NatsProcess,
) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        *_, finder = await cluster(conn, {"b1"})
        found = await finder.look()
        return found, finder.full_reads

    found, reads = run_connected(nats_server.url, body)
    assert found == {"loose": {"meta": {"id": "loose"}}}
    assert reads == 1


def test_a_lost_hosts_sessions_are_found_at_the_next_look(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        _, owners, _, finder = await cluster(conn, {"b1"})
        first = sorted(await finder.look())
        quiet = sorted(await finder.look())  # no host lost: nothing read
        reads_while_quiet = finder.full_reads
        await owners.drop_host_lease("host-a")  # host-a is gone
        after_loss = sorted(await finder.look())
        return first, quiet, reads_while_quiet, after_loss, finder.full_reads

    first, quiet, quiet_reads, after_loss, reads = run_connected(nats_server.url, body)
    # The first look found "loose", so the second read again (others may have been left)
    # and found it again; the third read because host-a's lease went.
    assert first == ["loose"]
    assert after_loss == ["a1", "a2", "loose"]
    assert (quiet, quiet_reads, reads) == (["loose"], 2, 3)


def test_quiet_looks_read_nothing_until_the_periodic_full_read(
    nats_server: NatsProcess,
) -> None:
    """An owner entry released without a lease going (a hand-over no host took) is found
    by the periodic full read."""

    async def body(conn: Connection) -> list[tuple[list[str], int]]:
        directory, _, a, finder = await cluster(conn, {"b1"})
        await directory.delete("loose")
        looks = []
        looks.append((sorted(await finder.look()), finder.full_reads))  # reads: none found
        await a.release("a1")
        for _ in range(4):
            looks.append((sorted(await finder.look()), finder.full_reads))
        return looks

    assert run_connected(nats_server.url, body) == [
        ([], 1),
        ([], 1),
        ([], 1),
        ([], 1),
        (["a1"], 2),  # the fourth look since the last full read
    ]


def test_a_look_that_found_orphans_is_followed_by_a_full_read(
    nats_server: NatsProcess,
) -> None:
    async def body(conn: Connection) -> list[tuple[list[str], int]]:
        directory, _, _, finder = await cluster(conn, set())
        looks = [(sorted(await finder.look()), finder.full_reads)]
        await directory.delete("loose")  # taken care of, say by another host
        looks.append((sorted(await finder.look()), finder.full_reads))
        looks.append((sorted(await finder.look()), finder.full_reads))
        return looks

    # This host runs nothing, so b1 is read too; it is owned by a live host.
    assert run_connected(nats_server.url, body) == [(["loose"], 1), ([], 2), ([], 2)]


def test_a_suspected_orphan_is_read_at_the_next_look(nats_server: NatsProcess) -> None:
    """An adoption NATS failed half-way leaves the session without an owner; the host
    that gave it up says so, and its next look reads every session."""

    async def body(conn: Connection) -> list[tuple[list[str], int]]:
        directory, _, a, finder = await cluster(conn, {"b1"})
        await directory.delete("loose")
        looks = [(sorted(await finder.look()), finder.full_reads)]
        await a.release("a2")
        looks.append((sorted(await finder.look()), finder.full_reads))  # quiet: not read
        finder.suspect()
        looks.append((sorted(await finder.look()), finder.full_reads))
        return looks

    assert run_connected(nats_server.url, body) == [([], 1), ([], 1), (["a2"], 2)]


def test_an_orphans_tree_and_the_host_that_runs_its_parent_are_named(
    nats_server: NatsProcess,
) -> None:
    """R-TREE-2, R-CLUSTER-2: each orphan's tree is its root's id (a root's, its own);
    a tree whose topmost orphan's parent is open on a live host is named for that host,
    not for a host that is gone, nor for one its closed parent was last on."""

    def child(root: str, *origin: str) -> dict[str, object]:
        return {"meta": {"root_id": root, "parent_id": origin[-2], "origin": list(origin)}}

    async def body(conn: Connection) -> tuple[dict[str, str], dict[str, str]]:
        directory = await SessionDirectory.open(conn)
        await directory.put("r", {"meta": {}, "host": "host-a"})
        await directory.put("q", {"meta": {}, "host": "host-gone"})
        await directory.put("p", {"meta": {}, "host": "host-a", "closed": True})
        orphans = {
            "c1": child("r", "r", "c1"),
            "g1": child("r", "r", "c1", "g1"),
            "d1": child("q", "q", "d1"),
            "e1": child("p", "p", "e1"),
            "lone": {"meta": {}},
        }
        hosts = [HostRecord(host_id="host-a", load=5), HostRecord(host_id="host-b", load=0)]
        return await orphan_trees(directory, orphans, hosts)

    tree_of, preferred = run_connected(nats_server.url, body)
    assert tree_of == {"c1": "r", "g1": "r", "d1": "q", "e1": "p", "lone": "lone"}
    assert preferred == {"r": "host-a"}
