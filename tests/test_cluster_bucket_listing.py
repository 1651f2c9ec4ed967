"""Listing a KV bucket and reading a trace, against a real nats-server (R-CLUSTER-2: the
orphan finder, the router and the limits act on these listings, so a listing must hold
every live key every time; R-PERF-2: a burst of reads must not fill the stream with
consumers, which the server bounds at 1,000 a stream)."""

from __future__ import annotations

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.leases import bucket_entries, bucket_keys, open_bucket
from greenroom.actors.cluster.traces import TraceStream
from greenroom.protocols.outputs import TaskStart
from greenroom.protocols.trace import encode_record
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)

SID = "20260101-120000-abcdef"


async def _consumers(conn: Connection, stream: str) -> int:
    info = await conn.call(conn.js.stream_info(stream))
    return int(info.state.consumer_count)


def test_an_empty_bucket_lists_nothing(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        await open_bucket(conn, conn.names.sessions, ttl_s=None)
        return await bucket_keys(conn, conn.names.sessions), await bucket_entries(
            conn, conn.names.sessions
        )

    assert run_connected(nats_server.url, body) == ([], {})


def test_a_listing_holds_the_last_value_of_every_live_key_and_no_removed_one(
    nats_server: NatsProcess,
) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        kv = await open_bucket(conn, conn.names.sessions, ttl_s=None)
        for key in ("kept", "deleted", "purged", "back"):
            await conn.call(kv.put(key, key.encode()))
        await conn.call(kv.put("kept", b"kept again"))
        await conn.call(kv.delete("deleted"))
        await conn.call(kv.purge("purged"))
        await conn.call(kv.delete("back"))
        await conn.call(kv.put("back", b"back again"))
        await conn.call(kv.put("empty", b""))
        return (
            sorted(await bucket_keys(conn, conn.names.sessions)),
            await bucket_entries(conn, conn.names.sessions),
        )

    keys, entries = run_connected(nats_server.url, body)
    assert keys == ["back", "empty", "kept"]
    assert entries == {"kept": b"kept again", "back": b"back again", "empty": b""}


def test_a_bucket_of_many_keys_is_listed_whole(nats_server: NatsProcess) -> None:
    """More keys than nats-py's watcher queue (256) and than one flow-control window."""

    async def body(conn: Connection) -> tuple[int, bool]:
        kv = await open_bucket(conn, conn.names.hosts, ttl_s=60.0)
        for i in range(1500):
            await conn.call(kv.put(f"k{i}", str(i).encode()))
        entries = await bucket_entries(conn, conn.names.hosts)
        return len(entries), all(entries[f"k{i}"] == str(i).encode() for i in range(1500))

    assert run_connected(nats_server.url, body, timeout_s=120.0) == (1500, True)


def test_listings_leave_no_consumer_behind(nats_server: NatsProcess) -> None:
    """Each listing is one consumer; left to the server's idle timeout, a thousand
    listings within seconds (a thousand placements) refused the next one."""

    async def body(conn: Connection) -> tuple[list[int], list[list[str]]]:
        kv = await open_bucket(conn, conn.names.hosts, ttl_s=60.0)
        await conn.call(kv.put("host-a", b"{}"))
        stream = f"KV_{conn.names.hosts}"
        left, listed = [], []
        for _ in range(3):
            listed.append(await bucket_keys(conn, conn.names.hosts))
            left.append(await _consumers(conn, stream))
        return left, listed

    left, listed = run_connected(nats_server.url, body)
    assert listed == [["host-a"]] * 3
    assert left == [0, 0, 0]


def test_a_thousand_listings_in_a_row_all_hold_every_key(nats_server: NatsProcess) -> None:
    """nats-py's own ``keys()`` came back empty about once in three hundred listings (the
    server's "nothing pending" answer overtook the entries it had sent) and refused the
    thousand-and-first; bounded at 1,100 listings, about a second."""

    async def body(conn: Connection) -> list[int]:
        kv = await open_bucket(conn, conn.names.host_leases, ttl_s=60.0)
        for host in ("host-a", "host-b", "host-c"):
            await conn.call(kv.put(host, b"token"))
        sizes = []
        for _ in range(1100):
            sizes.append(len(await bucket_keys(conn, conn.names.host_leases)))
        return sizes

    assert set(run_connected(nats_server.url, body, timeout_s=120.0)) == {3}


def test_trace_reads_leave_no_consumer_behind(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[list[int], int]:
        stream = await TraceStream.open(conn)
        writer = await stream.fence(SID, "host-a")
        line = encode_record(TaskStart(session_id=SID, run_id="r1", seq=1, input_seq=None))
        await writer.append([line])
        counts = []
        for _ in range(3):
            counts.append(len((await stream.read(SID)).records))
        return counts, await _consumers(conn, conn.names.trace_stream)

    assert run_connected(nats_server.url, body) == ([1, 1, 1], 0)
