"""Many sessions, one provider, two hosts (R-SHARE-1 across a cluster's hosts):
``shared_provider``'s benchmark with its 200 sessions split over two clustered hosts.

    python tests/benchmarks/shared_provider_cluster.py [--quick] [--n 200] [--k 8]
    .venv/bin/python -m tests.benchmarks.shared_provider_cluster [--quick]

The same provider (the mock model server in a subprocess: K = 8 requests at once, 429
with ``retry-after: 1`` beyond) and the same short paced task (three rounds of one
``lookup`` tool call, then the answer). Two hosts of one cluster run in this process
(``open_cluster_host``, each with its own data dir and NATS connection, sharing one
nats-server that this benchmark starts), half the sessions on each; the first host to
send admits for both (its requests cost nothing more, the other host's one NATS round
trip each).

Runs, each with fresh sessions, a fresh mock server and a fresh cluster prefix:

* ``cluster``: no limits configured (what a user gets);
* ``cluster-limited``: ``max_concurrent_requests=K`` on both hosts.

Printed per run as ``shared_provider`` prints them: failed tasks, requests accepted and
refused (429) by the server, 429s per accepted request, wall time against the ideal under
the cap, client CPU, and the requests each host sent and how many of them were admitted
by asking the other host. Targets: no failed task, 429s at most 10 % of accepted, wall at
most 1.3 times the ideal, no 429 with the limit configured. Figures only: nothing here
asserts.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root holds `tests`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trio

from tests.benchmarks.common import (
    MAX_TOKENS,
    MODEL,
    PROMPT,
    Meter,
    approve_all,
    arg_parser,
    greenroom_tool,
    pin_client,
    print_machine,
    print_table,
    write_json,
)
from tests.benchmarks.shared_provider import (
    ROUNDS,
    TARGET_429_SHARE,
    TARGET_WALL,
    ideal_s,
    mock_server,
    server_counts,
)

LEASE_TTL_S = 5.0


async def run_cluster(bridge: Any, nats_url: str, base_url: str, n: int,
                      limits: Any) -> dict[str, Any]:
    from greenroom.actors.cluster.limits import ClusterLimits
    from greenroom.actors.cluster.node import ClusterConfig, open_cluster_host
    from greenroom.protocols.outputs import RequestEnd, TaskEnd

    root = Path(tempfile.mkdtemp(prefix="greenroom-shared-cluster-"))
    prefix = f"b{uuid.uuid4().hex[:10]}"
    tool = greenroom_tool()
    failed: list[str] = []
    failed_attempts = 0
    shared: list[ClusterLimits] = []
    async with (
        open_cluster_host(
            bridge, ClusterConfig(url=nats_url, host_id="a", lease_ttl_s=LEASE_TTL_S,
                                  prefix=prefix),
            root / "a", limits=limits, on_limits=shared.append,
        ) as host_a,
        open_cluster_host(
            bridge, ClusterConfig(url=nats_url, host_id="b", lease_ttl_s=LEASE_TTL_S,
                                  prefix=prefix),
            root / "b", limits=limits, on_limits=shared.append,
        ) as host_b,
    ):
        sessions = []
        for i in range(n):
            host = host_a if i % 2 == 0 else host_b
            sessions.append(await host.create_session(
                provider="anthropic", base_url=base_url, model=MODEL, tools=[tool],
                workspace_dir=root, max_tokens=MAX_TOKENS,
            ))
        for limits_of_host in shared:
            for endpoint in limits_of_host.endpoints.values():
                await endpoint.known()

        async def one(session: Any) -> None:
            nonlocal failed_attempts
            last = None
            async for out in session.run(PROMPT, approve=approve_all):
                if isinstance(out, RequestEnd) and out.status != "ok":
                    failed_attempts += 1
                last = out
            if not (isinstance(last, TaskEnd) and last.status == "completed"):
                failed.append(repr(last)[:200])

        with Meter() as meter:
            async with trio.open_nursery() as nursery:
                for session in sessions:
                    nursery.start_soon(one, session)
        modes = {
            limits_of_host.host_id: [(e.mode.value, e.asked, e.local.window)
                                     for e in limits_of_host.endpoints.values()]
            for limits_of_host in shared
        }
    return {"failed": len(failed), "failed_attempts": failed_attempts, "meter": meter,
            "examples": failed[:2], "modes": modes}


async def measure(bridge: Any, name: str, args: Any, n: int, nats_url: str) -> dict[str, Any]:
    from greenroom import ProviderLimits

    limits = ProviderLimits(max_concurrent_requests=args.k) if name.endswith("limited") else None
    with mock_server(args) as server:
        outcome = await run_cluster(bridge, nats_url, server.base_url, n, limits)
    requests, refused = server_counts(server)
    accepted = requests - refused
    meter = outcome["meter"]
    ideal = ideal_s(args, n)
    row = {
        "run": name,
        "tasks": n,
        "failed": outcome["failed"],
        "accepted": accepted,
        "429s": refused,
        "429/accepted": refused / max(1, accepted),
        "failed attempts": outcome["failed_attempts"],
        "wall_s": meter.wall_s,
        "ideal_s": ideal,
        "wall/ideal": meter.wall_s / ideal,
        "cpu_s": meter.cpu_s,
    }
    print(f"  {name}: {n - outcome['failed']}/{n} completed, {accepted} accepted, "
          f"{refused} refused (429), wall {meter.wall_s:.1f}s (x{row['wall/ideal']:.2f} the "
          f"ideal {ideal:.1f}s), cpu {meter.cpu_s:.1f}s; admission (mode, asked, window) by host: "
          f"{outcome['modes']}", flush=True)
    for example in outcome["examples"]:
        print(f"    failed: {example}", flush=True)
    return row


async def main_async(bridge: Any, args: Any, nats_url: str) -> dict[str, Any]:
    n = args.n or (40 if args.quick else 200)
    # The registry's anthropic provider needs a key; the mock takes any.
    os.environ.setdefault("ANTHROPIC_API_KEY", "bench")
    rows = [await measure(bridge, name, args, n, nats_url)
            for name in ("cluster", "cluster-limited")]
    by_run = {row["run"]: row for row in rows}
    print_table(
        f"N = {n} sessions over two clustered hosts, the provider takes K = {args.k} at once "
        f"(429, retry-after: 1 beyond); {ROUNDS + 1} requests a task",
        rows,
    )
    cluster, limited = by_run["cluster"], by_run["cluster-limited"]
    print(
        f"\ntwo hosts, no limits configured: {cluster['failed']} failed tasks (target 0); "
        f"429s {cluster['429/accepted']:.1%} of accepted (target <= {TARGET_429_SHARE:.0%}); "
        f"wall {cluster['wall/ideal']:.2f}x the ideal (target <= {TARGET_WALL})"
    )
    print(f"two hosts, max_concurrent_requests={args.k}: {limited['429s']} 429s (target 0), "
          f"{limited['failed']} failed tasks, wall {limited['wall/ideal']:.2f}x the ideal")
    return {"n": n, "k": args.k, "rows": rows}


def main() -> None:
    from greenroom.actors.cluster.bridge import run
    from tests.support.nats import start_nats

    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, default=0, help="sessions (default 200; quick 40)")
    parser.add_argument("--k", type=int, default=8, help="requests the provider takes at once")
    parser.add_argument("--tokens", type=int, default=10, help="text tokens per response")
    parser.add_argument("--token-ms", type=float, default=10.0)
    parser.add_argument("--first-ms", type=float, default=50.0)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="greenroom-nats-") as tmp:
        # Started before this process is pinned, so that the server is not pinned with it.
        server = start_nats(Path(tmp) / "nats")
        pin_client()
        print_machine()
        try:
            result = run(lambda bridge: main_async(bridge, args, server.url))
        finally:
            server.stop()
    print(f"\ntotal wall {time.perf_counter() - started:.1f}s")
    write_json("shared_provider_cluster", result)


if __name__ == "__main__":
    main()
