"""Scale: many concurrent paced sessions on one core, greenroom against the SDK loop.

    .venv/bin/python -m tests.benchmarks.scale [--quick] [--n 1000 250] [--reps 3]
        [--variants greenroom,greenroom-gc,greenroom-nogc,greenroom-lean,
                    greenroom-gc-lean,greenroom-sdk-http,sdk] [--tls]

The mock server paces the reference workload at 20 ms per token and 500 ms to the first
token. For each N (1,000; quick: 200) the variants (default: greenroom, greenroom-gc-lean,
sdk) run N tasks at once, alternately (the order rotates every repetition), ``--reps``
times (3; quick: 1); figures are medians.
Variants: ``greenroom`` (Host, one session per task, the defaults: the provider as the
registry makes it, greenroom's own HTTP client unless ``GREENROOM_LEAN_HTTP=0``; the
collector tuned, as ``Host.open()`` does in a process that kept CPython's thresholds),
``greenroom-gc`` (``Host.open(gc_tuning=True)``), ``greenroom-nogc``
(``gc_tuning=False``: the collector as CPython runs it), ``greenroom-lean``
(``AnthropicProvider(lean_http=True)``), ``greenroom-gc-lean`` (both),
``greenroom-sdk-http`` (``lean_http=False``: the anthropic SDK's client and HTTP stack,
what ``--no-lean-http`` gives), ``sdk`` (the anthropic SDK's documented streaming loop by
hand). Reported per variant:
tasks completed, wall time and its ratio to the pacing ideal,
client CPU, CPU per task and per wire event, socket reads and wire events per read (how
many events the client finds at each read: about one when it keeps up, more when it
saturates), peak RSS; then each variant's CPU as a multiple of the SDK loop's.
``--tls``: the mock serves HTTPS with a certificate made for the run (greenroom's variants
only: the SDK loop's client does not read ``SSL_CERT_FILE``).

The ideal is the pacing alone, computed from the workload the mock sends: request 1 is
500 ms to the first content event plus 205 gaps of 20 ms between its 206 deltas (200 text
tokens, 2 calls x 3 argument fragments); the tools sleep 10 ms (concurrently); request 2 is
500 ms + 199 x 20 ms. Total 9.09 s.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from tests.benchmarks.common import (
    TOOL_SLEEP_S,
    GcMeter,
    MockServer,
    ReadCounter,
    arg_parser,
    median,
    phase_medians,
    phases_text,
    pin_client,
    print_machine,
    print_table,
    wire_events_per_task,
    write_json,
)
from tests.benchmarks.workloads import GreenroomBench, Run, run_sdk

TOKEN_MS = 20.0
FIRST_MS = 500.0
TEXT_TOKENS = 200
TOOL_CALLS = 2
FRAGMENTS = 3
# R-PERF-1's paced targets for the defaults at N = 1,000 (issue "Fast by default").
TARGET_RATIO = 1.3
TARGET_CPU_VS_SDK = 0.35
VARIANTS = (
    "greenroom",
    "greenroom-gc",
    "greenroom-nogc",
    "greenroom-lean",
    "greenroom-gc-lean",
    "greenroom-sdk-http",
    "sdk",
)


def _gc_tuning(variant: str) -> bool | None:
    """``Host.open(gc_tuning=…)`` of ``variant``: forced (``-gc``), refused (``-nogc``),
    else the default's (on in a process that has not chosen its own thresholds)."""
    if "-nogc" in variant:
        return False
    return True if "-gc" in variant else None


def _transport(variant: str) -> bool | None:
    """The anthropic provider's path of ``variant``: lean, the SDK's (``-sdk-http``), else
    the defaults' (the registry's)."""
    if "-lean" in variant:
        return True
    if "-sdk-http" in variant:
        return False
    return None


def paced_requests_s(token_ms: float = TOKEN_MS, first_ms: float = FIRST_MS) -> tuple[float, float]:
    """The pacing of the reference workload's two requests, in seconds."""
    first = first_ms + (TEXT_TOKENS + TOOL_CALLS * FRAGMENTS - 1) * token_ms
    second = first_ms + (TEXT_TOKENS - 1) * token_ms
    return first / 1000, second / 1000


def ideal_s(token_ms: float = TOKEN_MS, first_ms: float = FIRST_MS) -> float:
    return sum(paced_requests_s(token_ms, first_ms)) + TOOL_SLEEP_S


async def _run(variant: str, benches: dict[str, GreenroomBench], url: str, n: int) -> Run:
    if variant == "sdk":
        return await run_sdk(url, n)
    return await benches[variant].run(n)


async def main_async(args: Any) -> dict[str, Any]:
    ideal = ideal_s(args.token_ms, args.first_ms)
    ns: list[int] = args.n or [200 if args.quick else 1000]
    reps = args.reps or (1 if args.quick else 3)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for v in variants:
        if v not in VARIANTS:
            choices = ", ".join(VARIANTS)
            raise SystemExit(f"--variants: unknown variant {v!r} (choose from {choices})")
    events_per_task = wire_events_per_task()
    data_dir = Path(tempfile.mkdtemp(prefix="greenroom-scale-"))
    reads = ReadCounter.install()
    rows: list[dict[str, Any]] = []
    tls: list[str] = []
    if args.tls:
        if "sdk" in variants:
            raise SystemExit("--tls: the sdk variant cannot be run over the run's certificate")
        from tests.support.tls import self_signed

        cert, key = self_signed(data_dir)
        os.environ["SSL_CERT_FILE"] = str(cert)
        tls = ["--tls", str(cert), str(key)]
    try:
        with MockServer(
            "--workload",
            "reference",
            "--token-delay-ms",
            str(args.token_ms),
            "--first-token-ms",
            str(args.first_ms),
            *tls,
        ) as server:
            benches = {
                v: GreenroomBench(
                    server.base_url, data_dir, gc_tuning=_gc_tuning(v), lean_http=_transport(v)
                )
                for v in VARIANTS
                if v != "sdk"
            }
            for n in ns:
                samples: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
                for rep in range(reps):
                    order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
                    for v in order:
                        server_cpu0 = server.cpu_s()
                        reads.reset()
                        gc.collect()  # the previous run's garbage is not this one's
                        with GcMeter() as gcm:
                            run = await _run(v, benches, server.base_url, n)
                        server_cpu = server.cpu_s() - server_cpu0
                        m = run.meter
                        assert m is not None
                        events = events_per_task * run.completed
                        s = {
                            "completed": run.completed,
                            "wall_s": m.wall_s,
                            "ratio": m.wall_s / ideal,
                            "cpu_s": m.cpu_s,
                            "sys_s": m.sys_s,
                            "cpu_ms_per_task": 1000 * m.cpu_s / n,
                            "us_per_event": 1e6 * m.cpu_s / max(1, events),
                            "reads": reads.reads,
                            "events_per_read": events / max(1, reads.reads),
                            "gc_s": gcm.seconds,
                            "gc_full": gcm.collections[2],
                            "gc_full_s": gcm.seconds_by_generation[2],
                            "peak_rss_mib": m.peak_rss / 2**20,
                            "server_cpu_s": server_cpu,
                        }
                        samples[v].append(s)
                        print(
                            f"  N={n} rep {rep + 1}/{reps} {v:>12}: {run.completed}/{n} "
                            f"completed, wall {m.wall_s:.2f}s (x{s['ratio']:.2f}), "
                            f"cpu {m.cpu_s:.1f}s ({s['us_per_event']:.1f} us/event, "
                            f"{s['events_per_read']:.1f} events/read), gc {gcm.seconds:.1f}s "
                            f"({gcm.collections[2]} full), "
                            f"peak rss {s['peak_rss_mib']:.0f} MiB, server cpu {server_cpu:.1f}s",
                            flush=True,
                        )
                        if run.timings:
                            spans = phase_medians(
                                run.timings, paced_requests_s(args.token_ms, args.first_ms)
                            )
                            s["phases"] = spans
                            print(f"    where a task's time goes: {phases_text(spans)}")
                        if run.errors:
                            print(f"    errors: {run.errors[:2]}")
                for v in variants:
                    ss = samples[v]
                    row: dict[str, Any] = {"N": n, "variant": v, "reps": len(ss)}
                    row["completed"] = min(s["completed"] for s in ss)
                    for key in ss[0]:
                        if key == "phases":
                            row[key] = {p: median(s[key][p] for s in ss) for p in ss[0][key]}
                        elif key != "completed":
                            row[key] = median(s[key] for s in ss)
                    row["ratios"] = [round(s["ratio"], 2) for s in ss]
                    rows.append(row)
                sdk = next((r for r in rows if r["N"] == n and r["variant"] == "sdk"), None)
                for r in rows:
                    if r["N"] == n and sdk is not None:
                        r["cpu_vs_sdk"] = r["cpu_s"] / sdk["cpu_s"]
    finally:
        reads.uninstall()
        shutil.rmtree(data_dir, ignore_errors=True)
    print_table(
        f"Paced sessions ({args.token_ms:g} ms/token, {args.first_ms:g} ms first token; "
        f"ideal {ideal:.2f}s; {events_per_task} wire events per task; medians; target "
        f"ratio <= {TARGET_RATIO}, cpu <= {TARGET_CPU_VS_SDK}x sdk)",
        rows,
        [
            "N",
            "variant",
            "reps",
            "completed",
            "wall_s",
            "ratio",
            "ratios",
            "cpu_s",
            "sys_s",
            "cpu_vs_sdk",
            "cpu_ms_per_task",
            "us_per_event",
            "events_per_read",
            "gc_s",
            "gc_full",
            "gc_full_s",
            "peak_rss_mib",
            "server_cpu_s",
        ],
    )
    print(
        "\nWhere a greenroom task's time goes (medians, seconds; a request's figure is what "
        "it took beyond its pacing; as its run's reader sees the outputs):"
    )
    for r in rows:
        if "phases" in r:
            print(f"  N={r['N']} {r['variant']}: {phases_text(r['phases'])}")
    verdict = {}
    for r in rows:
        if r["variant"] != "sdk":
            cpu_vs_sdk = r.get("cpu_vs_sdk")
            met = (
                r["completed"] == r["N"]
                and r["ratio"] <= TARGET_RATIO
                and cpu_vs_sdk is not None
                and cpu_vs_sdk <= TARGET_CPU_VS_SDK
            )
            verdict[f"{r['variant']} N={r['N']}"] = met
            unmeasured = " (CPU against the SDK loop not measured)" if cpu_vs_sdk is None else ""
            print(f"  {r['variant']} N={r['N']}: target {'met' if met else 'not met'}{unmeasured}")
    return {
        "quick": args.quick,
        "variants": variants,
        "token_ms": args.token_ms,
        "first_ms": args.first_ms,
        "ideal_s": ideal,
        "wire_events_per_task": events_per_task,
        "rows": rows,
        "target_met": verdict,
    }


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, nargs="*", help="session counts (default 1000; quick 200)")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default 3; quick 1)")
    parser.add_argument(
        "--variants",
        default="greenroom,greenroom-gc-lean,sdk",
        help=f"comma-separated, from {', '.join(VARIANTS)} (default: %(default)s)",
    )
    parser.add_argument("--token-ms", type=float, default=TOKEN_MS)
    parser.add_argument("--first-ms", type=float, default=FIRST_MS)
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the mock serves HTTPS with a certificate made for the run (trusted through "
        "SSL_CERT_FILE; greenroom variants only: the SDK loop's client does not read it)",
    )
    args = parser.parse_args()
    pin_client()
    print_machine()
    started = time.perf_counter()
    result = trio.run(main_async, args)
    print(f"\ntotal wall {time.perf_counter() - started:.1f}s")
    write_json("scale", result)


if __name__ == "__main__":
    main()
