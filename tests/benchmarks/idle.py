"""Memory per idle open session, and per active session.

    .venv/bin/python -m tests.benchmarks.idle [--quick]

Idle: open N sessions (10,000; quick: 1,000) in one Host, each holding a finished
reference-workload history (prompt, 200-token text + 2 tool calls, 2 tool results, 200-token
text: 4 model messages, 17 trace records). The histories are built by running the task
against the in-process ``ScriptedProvider`` with a script equivalent to the reference
workload (same blocks, tokens and tool-argument fragments, unique tool ids per request), so
that 10,000 sessions are cheap to build; a smaller sample built against the mock server
over HTTP (the ``anthropic`` provider) cross-checks the figure. Reported: RSS growth per
session (process-level, allocator overhead included) and tracemalloc's net allocation per
session (Python objects kept alive, on a traced sample), plus the top allocation sites.

Active: K sessions (1,000; quick: 200) each with a task running, parked on a stream the
mock holds before the first token (``--first-token-ms`` 10 minutes): the extra memory a
running task costs over an idle session (supervisor, actors, channels, the HTTP connection
and its buffers, the trio tasks).
"""

from __future__ import annotations

import gc
import itertools
import shutil
import tempfile
import tracemalloc
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
    greenroom_tool,
    pin_client,
    print_machine,
    print_table,
    rss_bytes,
    write_json,
)

TEXT_TOKENS = 200
KIB = 1024


def reference_script() -> Any:
    """A ScriptedProvider step equivalent to the mock's reference workload."""
    from greenroom.protocols.content import ToolCallBlock
    from greenroom.protocols.context import ToolResult, UserMessage
    from greenroom.protocols.stream import TokenUsage

    text = "".join(f"tok{i} " for i in range(TEXT_TOKENS))
    counter = itertools.count(1)

    async def step(request: Any, stream: Any) -> None:
        n = next(counter)
        last = request.messages[-1] if request.messages else None
        final = isinstance(last, UserMessage) and any(
            isinstance(p, ToolResult) for p in last.content
        )
        await stream.text(text)
        if final:
            await stream.end("end_turn", TokenUsage(input=100, output=TEXT_TOKENS))
            return
        for k in (1, 2):
            await stream.tool_call(
                ToolCallBlock(
                    id=f"toolu_mock{n:08d}_{k}", name="lookup", arguments={"key": str(k)}
                ),
                fragments=3,
            )
        await stream.end("tool_use", TokenUsage(input=100, output=TEXT_TOKENS + 6))

    return step


async def build_sessions(
    host: Any, provider: Any, n: int, data_dir: Path, concurrency: int = 200
) -> list[Any]:
    tools = [greenroom_tool()]
    sessions: list[Any] = []
    failures: list[str] = []

    async def one() -> None:
        s = await host.create_session(
            tools=tools,
            provider=provider,
            workspace_dir=data_dir,
            model=MODEL,
            max_tokens=MAX_TOKENS,
        )
        last = None
        async for out in s.run(PROMPT, approve=approve_all):
            last = out
        if getattr(last, "status", None) != "completed":
            failures.append(repr(last)[:200])
        sessions.append(s)

    for start in range(0, n, concurrency):
        async with trio.open_nursery() as nursery:
            for _ in range(min(concurrency, n - start)):
                nursery.start_soon(one)
    if failures:
        print(f"  !! {len(failures)} runs failed: {failures[:2]}")
    return sessions


def _settle() -> None:
    for _ in range(3):
        gc.collect()


def _top_sites(diff: list[Any], n: int, count: int) -> list[dict[str, Any]]:
    rows = []
    for stat in diff[:count]:
        frame = stat.traceback[0]
        rows.append(
            {
                "site": f"{Path(frame.filename).name}:{frame.lineno}",
                "bytes_per_session": stat.size_diff / n,
                "blocks_per_session": stat.count_diff / n,
            }
        )
    return rows


async def measure_idle(
    label: str, make_provider: Any, n: int, traced: bool, data_dir: Path
) -> dict[str, Any]:
    from greenroom.actors.runtime.host import Host

    provider = make_provider()
    run_dir = Path(tempfile.mkdtemp(prefix="idle-", dir=data_dir))
    async with Host.open(run_dir) as host:
        await build_sessions(host, provider, 20, run_dir.parent)  # warm-up: imports, caches, pools
        for s in list(host.sessions):
            await host.close_session(s.id)
        _settle()
        if traced:
            tracemalloc.start(1)
            snap0 = tracemalloc.take_snapshot()
        rss0 = rss_bytes()
        with Meter() as meter:
            sessions = await build_sessions(host, provider, n, run_dir.parent)
            await trio.sleep(0.2)  # let the trace sink finish its last batch
            _settle()
        rss1 = rss_bytes()
        row: dict[str, Any] = {
            "history_from": label,
            "sessions": len(sessions),
            "tracemalloc": traced,
            "rss_bytes_per_session": (rss1 - rss0) / n,
            "build_s": meter.wall_s,
            "records_per_session": host.port(sessions[0].id).last_seq,
            "messages_per_session": len(sessions[0].transcript.messages),
        }
        if traced:
            snap1 = tracemalloc.take_snapshot()
            tracemalloc.stop()
            diff = snap1.compare_to(snap0, "lineno")
            total = sum(s.size_diff for s in diff)
            row["traced_bytes_per_session"] = total / n
            row["top_sites"] = _top_sites(diff, n, 12)
        del sessions
    await provider.aclose()
    return row


async def measure_active(base_url: str, k: int, data_dir: Path) -> dict[str, Any]:
    from greenroom.actors.providers.anthropic import AnthropicProvider
    from greenroom.actors.runtime.host import Host
    from greenroom.protocols.outputs import RequestBegin

    provider = AnthropicProvider(base_url=base_url, api_key="bench", max_connections=4000)
    run_dir = Path(tempfile.mkdtemp(prefix="active-", dir=data_dir))
    tools = [greenroom_tool()]
    async with Host.open(run_dir) as host:
        sessions = [
            await host.create_session(
                tools=tools, provider=provider, workspace_dir=run_dir.parent, model=MODEL
            )
            for _ in range(k)
        ]
        _settle()
        tracemalloc.start(1)
        snap0 = tracemalloc.take_snapshot()
        rss0 = rss_bytes()
        begun = 0
        all_begun = trio.Event()

        async def drive(s: Any) -> None:
            nonlocal begun
            async for out in s.run(PROMPT, approve=approve_all):
                if type(out) is RequestBegin:
                    begun += 1
                    if begun == k:
                        all_begun.set()

        async with trio.open_nursery() as nursery:
            for s in sessions:
                nursery.start_soon(drive, s)
            with trio.move_on_after(60):
                await all_begun.wait()
            await trio.sleep(3.0)  # requests sent, message_start received, streams parked
            _settle()
            rss1 = rss_bytes()
            snap1 = tracemalloc.take_snapshot()
            tracemalloc.stop()
            parked = sum(1 for s in sessions if s.busy)
            for s in sessions:
                s.interrupt("benchmark done")
        diff = snap1.compare_to(snap0, "lineno")
        total = sum(st.size_diff for st in diff)
    await provider.aclose()
    return {
        "active_sessions": k,
        "parked": parked,
        "rss_bytes_per_active": (rss1 - rss0) / k,
        "traced_bytes_per_active": total / k,
        "top_sites": _top_sites(diff, k, 12),
    }


async def main_async(args: Any) -> dict[str, Any]:
    from greenroom.actors.providers.anthropic import AnthropicProvider
    from greenroom.actors.providers.scripted import ScriptedProvider

    n = args.n or (1000 if args.quick else 10_000)
    sample = 150 if args.quick else 1000
    http_sample = 80 if args.quick else 500
    k = args.active or (200 if args.quick else 1000)
    data_dir = Path(tempfile.mkdtemp(prefix="greenroom-idle-"))
    result: dict[str, Any] = {"quick": args.quick}
    try:
        rows = []

        def scripted() -> Any:
            return ScriptedProvider(reference_script(), keep_requests=False)

        rows.append(await measure_idle("scripted", scripted, n, False, data_dir))
        print(
            f"  idle RSS: {rows[-1]['rss_bytes_per_session'] / KIB:.2f} KiB/session "
            f"over {n} sessions",
            flush=True,
        )
        rows.append(await measure_idle("scripted", scripted, sample, True, data_dir))
        print(
            f"  idle traced: {rows[-1]['traced_bytes_per_session'] / KIB:.2f} KiB/session",
            flush=True,
        )
        with MockServer("--workload", "reference") as server:

            def http() -> Any:
                return AnthropicProvider(
                    base_url=server.base_url, api_key="bench", max_connections=4000
                )

            rows.append(await measure_idle("mock-http", http, http_sample, True, data_dir))
            print(
                f"  idle traced (HTTP-built): "
                f"{rows[-1]['traced_bytes_per_session'] / KIB:.2f} KiB/session",
                flush=True,
            )
        with MockServer("--workload", "reference", "--first-token-ms", "600000") as server:
            active = await measure_active(server.base_url, k, data_dir)
        result["idle"] = rows
        result["active"] = active
        table = [
            {
                "history_from": r["history_from"],
                "sessions": r["sessions"],
                "records": r["records_per_session"],
                "messages": r["messages_per_session"],
                "rss_kib_per_session": r["rss_bytes_per_session"] / KIB,
                "traced_kib_per_session": r.get("traced_bytes_per_session", float("nan")) / KIB,
                "build_s": r["build_s"],
            }
            for r in rows
        ]
        print_table(
            "Idle sessions with a finished reference-workload history (target <= 8 KiB)", table
        )
        for r in rows:
            if r.get("top_sites"):
                print_table(
                    f"Top allocation sites per idle session ({r['history_from']})",
                    r["top_sites"][:8],
                )
        print_table(
            "Active sessions (task running, stream parked before the first token)",
            [
                {
                    "active": active["active_sessions"],
                    "parked": active["parked"],
                    "rss_kib_per_active": active["rss_bytes_per_active"] / KIB,
                    "traced_kib_per_active": active["traced_bytes_per_active"] / KIB,
                }
            ],
        )
        print_table("Top allocation sites per active session", active["top_sites"][:10])
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, default=0, help="idle sessions (default 10,000)")
    parser.add_argument("--active", type=int, default=0, help="active sessions (default 1,000)")
    args = parser.parse_args()
    pin_client()
    print_machine()
    with Meter() as total:
        result = trio.run(main_async, args)
    print(f"\ntotal wall {total.wall_s:.1f}s")
    write_json("idle", result)


if __name__ == "__main__":
    main()
