"""Scale: many concurrent paced sessions on one core.

    .venv/bin/python -m tests.benchmarks.scale [--quick]

The mock server paces the reference workload at 20 ms per token and 500 ms to the first
token. N sessions (1,000; quick: 200) each run one task at once through greenroom. Reported:
how many completed, wall time vs the pacing ideal, client CPU, peak RSS. Then N grows
(x2 by default) until a run fails, the ratio passes 1.5, or the time limit is reached.

The ideal is the pacing alone, computed from the workload the mock sends: request 1 is
500 ms to the first content event plus 205 gaps of 20 ms between its 206 deltas (200 text
tokens, 2 calls x 3 argument fragments); the tools sleep 10 ms (concurrently); request 2 is
500 ms + 199 x 20 ms. Total 9.09 s.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from tests.benchmarks.common import (
    TOOL_SLEEP_S,
    Meter,
    MockServer,
    arg_parser,
    pin_client,
    print_machine,
    print_table,
    write_json,
)
from tests.benchmarks.workloads import GreenroomBench, run_sdk

TOKEN_MS = 20.0
FIRST_MS = 500.0
TEXT_TOKENS = 200
TOOL_CALLS = 2
FRAGMENTS = 3
TARGET_RATIO = 1.5


def ideal_s(token_ms: float = TOKEN_MS, first_ms: float = FIRST_MS) -> float:
    first = first_ms + (TEXT_TOKENS + TOOL_CALLS * FRAGMENTS - 1) * token_ms
    second = first_ms + (TEXT_TOKENS - 1) * token_ms
    return (first + second) / 1000 + TOOL_SLEEP_S


async def main_async(args: Any) -> dict[str, Any]:
    ideal = ideal_s(args.token_ms, args.first_ms)
    start_n = args.n or (200 if args.quick else 1000)
    limit_s = args.time_limit or (45.0 if args.quick else 300.0)
    data_dir = Path(tempfile.mkdtemp(prefix="greenroom-scale-"))
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        with MockServer(
            "--workload",
            "reference",
            "--token-delay-ms",
            str(args.token_ms),
            "--first-token-ms",
            str(args.first_ms),
        ) as server:
            bench = GreenroomBench(server.base_url, data_dir)
            n = start_n
            while True:
                server_cpu0 = server.cpu_s()
                if args.variant == "sdk":
                    run = await run_sdk(server.base_url, n)
                else:
                    run = await bench.run(n)
                server_cpu = server.cpu_s() - server_cpu0
                m = run.meter
                assert m is not None
                ratio = m.wall_s / ideal
                row = {
                    "N": n,
                    "completed": run.completed,
                    "wall_s": m.wall_s,
                    "ideal_s": ideal,
                    "ratio": ratio,
                    "cpu_s": m.cpu_s,
                    "cpu_util": m.cpu_s / m.wall_s,
                    "cpu_ms_per_task": 1000 * m.cpu_s / n,
                    "peak_rss_mib": m.peak_rss / 2**20,
                    "rss_kib_per_session": (m.peak_rss - m.rss_start) / 1024 / n,
                    "outputs": run.outputs,
                    "server_cpu_s": server_cpu,
                }
                rows.append(row)
                print(
                    f"  N={n}: {run.completed}/{n} completed, wall {m.wall_s:.2f}s "
                    f"(ideal {ideal:.2f}s, x{ratio:.2f}), cpu {m.cpu_s:.1f}s, "
                    f"peak rss {m.peak_rss / 2**20:.0f} MiB, server cpu {server_cpu:.1f}s",
                    flush=True,
                )
                if run.errors:
                    print(f"    errors: {run.errors[:2]}")
                elapsed = time.monotonic() - started
                next_n = int(n * args.growth)
                # Stop when broken, past the target, or the next run would not fit.
                if (
                    run.completed < n
                    or ratio > TARGET_RATIO
                    or args.no_grow
                    or elapsed + m.wall_s * args.growth * 1.2 > limit_s
                ):
                    break
                n = next_n
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print_table(
        f"Paced sessions ({args.token_ms:g} ms/token, {args.first_ms:g} ms first "
        f"token; ideal {ideal:.2f}s; target ratio <= {TARGET_RATIO})",
        rows,
    )
    first = rows[0]
    return {
        "quick": args.quick,
        "variant": args.variant,
        "token_ms": args.token_ms,
        "first_ms": args.first_ms,
        "ideal_s": ideal,
        "rows": rows,
        "target_met_at_first_n": first["completed"] == first["N"]
        and first["ratio"] <= TARGET_RATIO,
        "largest_n_within_target": max(
            (r["N"] for r in rows if r["completed"] == r["N"] and r["ratio"] <= TARGET_RATIO),
            default=None,
        ),
    }


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, default=0, help="first N (default 1000; quick 200)")
    parser.add_argument("--growth", type=float, default=2.0)
    parser.add_argument("--no-grow", action="store_true")
    parser.add_argument("--time-limit", type=float, default=0.0, help="seconds (default 300)")
    parser.add_argument("--token-ms", type=float, default=TOKEN_MS)
    parser.add_argument("--first-ms", type=float, default=FIRST_MS)
    parser.add_argument(
        "--variant",
        choices=["greenroom", "sdk"],
        default="greenroom",
        help="sdk: the hand-written anthropic SDK loop, for comparison",
    )
    args = parser.parse_args()
    pin_client()
    print_machine()
    with Meter() as total:
        result = trio.run(main_async, args)
    print(f"\ntotal wall {total.wall_s:.1f}s")
    write_json("scale" if args.variant == "greenroom" else f"scale-{args.variant}", result)


if __name__ == "__main__":
    main()
