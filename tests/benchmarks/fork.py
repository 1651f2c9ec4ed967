"""What forking a long session costs (R-FORK-1), against what writing its session.json costs.

    .venv/bin/python -m tests.benchmarks.fork [--quick] [--records N] [--reps R]

A session with N trace records (10,000; quick: 2,000) in the reference workload's shape —
each task a prompt, a 200-token text, two tool calls and their results, a 200-token answer:
17 records — is made in a temporary data dir (its ``session.json`` by ``create_session``, its
trace written as the runtime writes one, without running 590 tasks). Then, R times (9; quick
3), each in turn (order rotated every time), medians of wall time:

* ``session.json``: writing the fork's metadata (``catalog.create``), the floor;
* ``copy``: the store's part of a fork (``log.fork``): the trace's bytes copied with each
  line moved to the new id, no record decoded, then fsynced;
* ``fork_session``: the whole ``Host.fork_session`` at the last record (copy, session.json,
  load: the new session's context and task state folded from its trace);
* ``fork_session mid-task``: the same at a seq inside a task (the open task is settled);
* ``load_session``: loading the source itself (the same fold), for comparison.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from greenroom.actors.runtime.host import Host
from greenroom.actors.scripted import ScriptedProvider
from greenroom.protocols import outputs as o
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import encode_record
from tests.benchmarks.common import arg_parser, print_machine, print_table, write_json

TEXT = "tok " * 200


def task_records(session_id: str, run: int, seq: int) -> tuple[list[o.Output], int]:
    """The 17 records of one reference task, numbered after ``seq``."""
    out: list[o.Output] = []
    run_id = f"run_{run:08d}"

    def add(cls: Any, **fields: Any) -> None:
        nonlocal seq
        seq += 1
        out.append(cls(session_id=session_id, run_id=run_id, seq=seq, **fields))

    calls = [
        ToolCallBlock(id=f"t{run}_{k}", name="lookup", arguments={"key": str(k)}) for k in (1, 2)
    ]
    add(o.UserMsg, kind="prompt", content=(TextBlock(text=f"question {run}: look the keys up"),))
    add(o.TaskStart, input_seq=seq)
    add(o.RequestBegin, turn=1, attempt=1)
    add(o.ModelMsg, turn=1, block=TextBlock(text=TEXT))
    for call in calls:
        add(o.ModelMsg, turn=1, block=call)
    add(o.TokenUsageOutput, turn=1, request=TokenUsage(input=100, output=206))
    add(o.RequestEnd, turn=1, status="ok", attempt=1, stop_reason="tool_use")
    for call in calls:
        add(o.ApprovalDecision, call_id=call.id, tool="lookup", decision="allow", by="host")
    for call in calls:
        add(o.ToolCallOutput, call_id=call.id, tool="lookup", status="ok", is_error=False,
            content=(TextBlock(text=f"value of {call.arguments['key']}"),))  # fmt: skip
    add(o.RequestBegin, turn=2, attempt=1)
    add(o.ModelMsg, turn=2, block=TextBlock(text=TEXT))
    add(o.TokenUsageOutput, turn=2, request=TokenUsage(input=100, output=200))
    add(o.RequestEnd, turn=2, status="ok", attempt=1, stop_reason="end_turn")
    add(o.TaskEnd, status="completed", turns=2, usage=TokenUsage(input=200, output=406), wall_ms=10)
    return out, seq


async def alternated(
    reps: int, actions: dict[str, Callable[[], Awaitable[Any]]]
) -> dict[str, float]:
    """The median wall time of each action in milliseconds, the actions run in turn (the
    order rotated every repetition) so that the machine's other work hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in actions}
    names = list(actions)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            started = time.perf_counter()
            await actions[name]()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


async def measure(records: int, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="greenroom-fork-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        workspace = Path(tmp) / "ws"
        workspace.mkdir()
        async with Host.open(data_dir) as host:
            source = await host.create_session(
                provider=ScriptedProvider(()), workspace_dir=workspace
            )
            source_id = source.id
            await host.close_session(source_id)
        lines: list[str] = []
        seq = run = 0
        while len(lines) < records:
            batch, seq = task_records(source_id, run, seq)
            lines.extend(encode_record(r) for r in batch)
            run += 1
        lines = lines[:records]
        trace = data_dir / "sessions" / source_id / "trace_001.jsonl"
        trace.write_text("".join(lines), encoding="utf-8")
        mid_task = records - 5  # inside the last task: between its calls and its end
        no_model = ScriptedProvider(())
        async with Host.open(data_dir) as host:
            store = host.trace_store
            meta = await store.catalog.read_meta(source_id)
            count = iter(range(10**6))

            async def write_meta() -> None:
                await store.catalog.create(f"meta-{next(count)}", meta)

            async def copy() -> None:
                await store.log.fork(source_id, f"copy-{next(count)}", None)

            async def fork() -> None:
                forked = await host.fork_session(source_id, provider=no_model)
                await host.close_session(forked.id)

            async def fork_mid_task() -> None:
                forked = await host.fork_session(source_id, mid_task, provider=no_model)
                await host.close_session(forked.id)

            async def load() -> None:
                await host.load_session(source_id, provider=no_model)
                await host.close_session(source_id)

            results = await alternated(
                reps,
                {
                    "session.json": write_meta,
                    "copy": copy,
                    "fork_session": fork,
                    "fork_session mid-task": fork_mid_task,
                    "load_session": load,
                },
            )
        return {
            "records": records,
            "trace_bytes": trace.stat().st_size,
            "reps": reps,
            "median_ms": results,
        }


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--records", type=int, help="trace records of the source session")
    parser.add_argument("--reps", type=int, help="repetitions of each measurement")
    args = parser.parse_args()
    records = args.records or (2_000 if args.quick else 10_000)
    reps = args.reps or (3 if args.quick else 9)
    print_machine()
    result = trio.run(measure, records, reps)
    floor = result["median_ms"]["session.json"]
    rows = [
        {"what": name, "median ms": round(ms, 2), "x session.json": round(ms / floor, 1)}
        for name, ms in result["median_ms"].items()
    ]
    print_table(
        f"forking a {result['records']:,}-record session ({result['trace_bytes']:,} bytes of "
        f"trace), median of {result['reps']}",
        rows,
    )
    write_json("fork", result)


if __name__ == "__main__":
    main()
