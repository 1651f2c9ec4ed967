"""Interrupt latency: from ``session.interrupt()`` to the end of the run's iterator.

    .venv/bin/python -m tests.benchmarks.interrupt [--quick]

Two situations, ``--trials`` each (200; quick: 50), one fresh session per trial, the
``anthropic`` provider against the mock server in a subprocess:

* ``streaming``: the mock streams the reference workload at 5 ms per token; the host reads
  outputs and interrupts after the 20th ``partial_text`` (mid-text, the HTTP stream open).
* ``tools``: no pacing; the ``lookup`` tool sleeps 60 s; the host interrupts once both tool
  calls are running.

The clock starts just before ``interrupt()`` and stops when ``async for`` over the run ends
(after ``abort`` and ``task_end`` were emitted and the trace synced, fsync included).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from tests.benchmarks.common import (
    MAX_TOKENS,
    MODEL,
    PROMPT,
    Meter,
    MockServer,
    approve_all,
    arg_parser,
    median,
    p99,
    percentile,
    pin_client,
    print_machine,
    print_table,
    write_json,
)

MID_TEXT_AFTER = 20


async def trials(kind: str, base_url: str, data_dir: Path, count: int) -> dict[str, Any]:
    from greenroom.actors.providers.anthropic import AnthropicProvider
    from greenroom.actors.runtime.host import Host
    from greenroom.protocols.outputs import PartialText, TaskEnd
    from greenroom.protocols.tools import tool

    started_tools = 0
    both_running = trio.Event()

    @tool(parallel=True, name="lookup")
    async def lookup(key: str) -> str:
        """Look up a key (slowly)."""
        nonlocal started_tools
        started_tools += 1
        if started_tools == 2:
            both_running.set()
        await trio.sleep(60)
        return f"value-{key}"

    provider = AnthropicProvider(base_url=base_url, api_key="bench")
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    run_dir = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=data_dir))
    async with Host.open(run_dir) as host:
        for trial in range(count + 2):  # two warm-up trials
            started_tools = 0
            both_running = trio.Event()
            session = await host.create_session(
                tools=[lookup],
                provider=provider,
                workspace_dir=run_dir.parent,
                model=MODEL,
                max_tokens=MAX_TOKENS,
            )
            stream = session.run(PROMPT, approve=approve_all)
            t0 = 0.0
            last = None
            if kind == "streaming":
                seen = 0
                async for out in stream:
                    last = out
                    if type(out) is PartialText and t0 == 0.0:
                        seen += 1
                        if seen == MID_TEXT_AFTER:
                            t0 = time.perf_counter()
                            session.interrupt("benchmark")
                t1 = time.perf_counter()
            else:
                async with trio.open_nursery() as nursery:

                    async def interrupter(
                        session: Any = session, both_running: trio.Event = both_running
                    ) -> None:
                        nonlocal t0
                        await both_running.wait()
                        t0 = time.perf_counter()
                        session.interrupt("benchmark")

                    nursery.start_soon(interrupter)
                    async for out in stream:
                        last = out
                    t1 = time.perf_counter()
            status = last.status if isinstance(last, TaskEnd) else f"no task_end: {last!r}"[:80]
            if trial >= 2:
                statuses[status] = statuses.get(status, 0) + 1
                if t0:
                    latencies.append((t1 - t0) * 1000)
            await host.close_session(session.id)
    await provider.aclose()
    return {
        "situation": kind,
        "trials": len(latencies),
        "statuses": statuses,
        "median_ms": median(latencies),
        "p90_ms": percentile(latencies, 90),
        "p99_ms": p99(latencies),
        "max_ms": max(latencies) if latencies else float("nan"),
        "latencies_ms": [round(x, 3) for x in latencies],
    }


async def main_async(args: Any) -> dict[str, Any]:
    count = args.trials or (50 if args.quick else 200)
    data_dir = Path(tempfile.mkdtemp(prefix="greenroom-interrupt-"))
    rows = []
    try:
        with MockServer("--workload", "reference", "--token-delay-ms", "5") as server:
            rows.append(await trials("streaming", server.base_url, data_dir, count))
        with MockServer("--workload", "reference") as server:
            rows.append(await trials("tools", server.base_url, data_dir, count))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print_table(
        "Interrupt -> end of the run's iterator (target: median <= 20 ms, p99 <= 100 ms)",
        [{k: v for k, v in r.items() if k != "latencies_ms"} for r in rows],
    )
    return {"quick": args.quick, "rows": rows}


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--trials", type=int, default=0)
    args = parser.parse_args()
    pin_client()
    print_machine()
    with Meter() as total:
        result = trio.run(main_async, args)
    print(f"\ntotal wall {total.wall_s:.1f}s")
    write_json("interrupt", result)


if __name__ == "__main__":
    main()
