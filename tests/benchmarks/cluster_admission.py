"""What admitting a request costs in a cluster (R-SHARE-1 across hosts), against a real
nats-server on loopback.

    .venv/bin/python -m tests.benchmarks.cluster_admission [--quick] [--requests N]

Two hosts' admission points of one endpoint (``SharedEndpoint``, each on its own NATS
connection, as two hosts have): host a holds the endpoint's lease and admits for both,
host b asks it. A request here is what the streamer does with a permit: admit, report
the response begun (``accepted``), release. Measured, one request at a time:

* **single host**: ``EndpointAdmission.admit_now`` + release, no cluster (the baseline);
* **owner host**: the same through host a's ``SharedEndpoint`` (no NATS on the path);
* **other host, place kept** (the default without a per-minute limit): through host b's,
  whose requests take the place its first one was granted: latency of the admit (median,
  p99), and the NATS messages per request from both connections' counters
  (``client.stats``);
* **other host, asks the owner**: the same with a requests-per-minute limit (set far
  above what is sent), under which b asks a for every request;
* **other host, 32 at once**: requests per second the owner admits for b when b asks;
* **counters in KV instead** (the design not chosen): a compare-and-set increment of a KV
  counter to admit (read, write with the revision) and a decrement to release, one host
  alone and two hosts on one counter (their conflicts retried).

Figures only: nothing here asserts.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root holds `tests`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats.js.errors
import trio

from greenroom import ProviderLimits
from greenroom.actors.cluster.admission import Mode, SharedEndpoint, endpoint_key
from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import ClusterNames, Connection, connect
from greenroom.actors.cluster.leases import LeaseTable, open_bucket
from greenroom.actors.runtime.admission import EndpointAdmission
from tests.benchmarks.common import arg_parser, p99, print_machine, print_table, write_json
from tests.support.nats import start_nats

IDENTITY = "anthropic http://127.0.0.1:9 0123456789abcdef"
BY_MINUTE = "anthropic http://127.0.0.1:9 fedcba9876543210"
LEASE_TTL_S = 5.0


async def endpoint(
    conn: Connection, host_id: str, identity: str = IDENTITY, limits: ProviderLimits | None = None
) -> SharedEndpoint:
    leases = await LeaseTable.open(conn, ttl_s=LEASE_TTL_S, bucket=conn.names.admission_leases)

    async def live_hosts() -> set[str]:
        return {"a", "b"}

    return SharedEndpoint(
        conn, leases, live_hosts, host_id=host_id, key=endpoint_key(identity),
        identity=identity, local=EndpointAdmission(limits or ProviderLimits()),
    )


def messages(conn: Connection) -> int:
    """Messages the connection sent and received so far."""
    stats = conn.client.stats
    return int(stats["in_msgs"]) + int(stats["out_msgs"])


async def timed_requests(point: Any, n: int) -> list[float]:
    """``n`` requests one after the other: the seconds each admit took."""
    took: list[float] = []
    for i in range(n):
        began = time.perf_counter()
        permit = point.admit_now()
        if permit is None:
            permit = await point.admit("p", f"s{i % 8}")
        took.append(time.perf_counter() - began)
        permit.accepted()
        permit.release()
    return took


async def settle(conn: Connection) -> None:
    """Until everything published has reached the server and been answered."""
    await conn.call(conn.client.flush())


def row(name: str, took: list[float], per_request: float | None, rtt: float) -> dict[str, Any]:
    return {
        "path": name,
        "median_us": statistics.median(took) * 1e6,
        "p99_us": p99(took) * 1e6,
        "nats_msgs/request": per_request,
        "round_trips": rtt,
    }


async def kv_counter(conns: list[Connection], n: int) -> list[float]:
    """Admit and release through a counter in KV (compare-and-set), ``n`` requests per
    connection, the connections at once: the seconds of each admit + release."""
    bucket = f"{conns[0].names.prefix}_bench_counter"
    kvs = [await open_bucket(conn, bucket, ttl_s=None) for conn in conns]
    await conns[0].call(kvs[0].put("k", b"0"))
    took: list[float] = []

    async def change(conn: Connection, kv: Any, delta: int) -> None:
        while True:
            entry = await conn.call(kv.get("k"))
            value = int(entry.value or b"0") + delta
            try:
                await conn.call(kv.update("k", str(value).encode(), last=entry.revision))
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                continue

    async def host(conn: Connection, kv: Any) -> None:
        for _ in range(n):
            began = time.perf_counter()
            await change(conn, kv, +1)
            await change(conn, kv, -1)
            took.append(time.perf_counter() - began)

    async with trio.open_nursery() as nursery:
        for conn, kv in zip(conns, kvs, strict=True):
            nursery.start_soon(host, conn, kv)
    return took


async def measure(bridge: Bridge, url: str, n: int) -> dict[str, Any]:
    names = ClusterNames(prefix=f"b{uuid.uuid4().hex[:10]}")
    conn_a = await connect(bridge, url, name="a", names=names)
    conn_b = await connect(bridge, url, name="b", names=names)
    rows: list[dict[str, Any]] = []
    try:
        alone = EndpointAdmission(ProviderLimits())
        await timed_requests(alone, 1000)
        rows.append(row("single host (no cluster)", await timed_requests(alone, n), 0, 0))

        by_minute = ProviderLimits(requests_per_minute=10**9)
        a = await endpoint(conn_a, "a")
        b = await endpoint(conn_b, "b")
        a_asked = await endpoint(conn_a, "a", BY_MINUTE, by_minute)
        b_asks = await endpoint(conn_b, "b", BY_MINUTE, by_minute)
        async with trio.open_nursery() as nursery:
            for owner, other in ((a, b), (a_asked, b_asks)):
                await nursery.start(owner.run)
                assert await owner.known() is Mode.OWNER
                await nursery.start(other.run)
                assert await other.known() is Mode.REMOTE
            await timed_requests(a, 1000)
            rows.append(row("owner host", await timed_requests(a, n), 0, 0))

            for point, name, trips in (
                (b, "other host, place kept (the default)", 0),
                (b_asks, "other host, asks the owner (a per-minute limit)", 1),
            ):
                await timed_requests(point, 200)  # warm: the owner's window opens
                await settle(conn_b)
                before = messages(conn_a) + messages(conn_b)
                took = await timed_requests(point, n)
                await settle(conn_b)
                await settle(conn_a)
                # Each connection counts a message once sent and once received, and a
                # flush is a PING the server answers: neither is a message.
                per_request = (messages(conn_a) + messages(conn_b) - before) / n / 2
                rows.append(row(name, took, per_request, trips))

            b = b_asks
            began = time.perf_counter()
            async with trio.open_nursery() as many:
                for _ in range(32):
                    many.start_soon(timed_requests, b, n // 32)
            rate = (n // 32) * 32 / (time.perf_counter() - began)
            nursery.cancel_scope.cancel()

        before = messages(conn_a)
        one_host = await kv_counter([conn_a], n // 2)
        per_request = (messages(conn_a) - before) / (n // 2)
        rows.append(row("KV counter, one host (not chosen)", one_host, per_request, 4))
        before = messages(conn_a) + messages(conn_b)
        two_hosts = await kv_counter([conn_a, conn_b], n // 2)
        per_request = (messages(conn_a) + messages(conn_b) - before) / n
        rows.append(row("KV counter, two hosts at once (not chosen)", two_hosts, per_request,
                        per_request / 2))
    finally:
        with trio.CancelScope(shield=True):
            await conn_a.aclose()
            await conn_b.aclose()
    return {"rows": rows, "owner_admits_per_s_for_32_waiting": rate, "requests": n}


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--requests", type=int, default=0, help="requests per path (2000)")
    args = parser.parse_args()
    n = args.requests or (400 if args.quick else 2000)
    print_machine()
    with tempfile.TemporaryDirectory(prefix="greenroom-admission-") as tmp:
        server = start_nats(Path(tmp) / "nats")
        try:
            result = run(lambda bridge: measure(bridge, server.url, n))
        finally:
            server.stop()
    print_table(f"admitting one request in a cluster ({n} requests one at a time)",
                result["rows"])
    print(f"\nthe owner admits {result['owner_admits_per_s_for_32_waiting']:,.0f} requests/s "
          "for another host with 32 of its requests at once")
    write_json("cluster_admission", result)


if __name__ == "__main__":
    main()
