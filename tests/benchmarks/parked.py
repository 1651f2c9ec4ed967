"""Memory per parked task next to memory per idle session, in one process (R-HITL-3).

    .venv/bin/python -m tests.benchmarks.parked [--quick] [--n N] [--running K]

R-HITL-3: a task waiting only for people holds no model connection and no tool slot, and
a host with many such tasks costs no more than as many idle sessions. Measured with the
``idle`` benchmark's script and method, all in one process and one host:

- idle: N sessions (10,000; quick: 1,000), each holding the reference workload's finished
  history (its calls allowed by a callback);
- parked: N more sessions, each running the same script with ``approve="people"``: its
  first tool call is recorded as an ``approval_request`` and the task parks (no
  supervisor, no actors). The run's stream is detached, as a gateway's run is once its
  reader has gone;
- parked, stream kept: N more, the run's stream kept by its caller, who read it up to the
  ``approval_request`` (the ``Parked`` record then keeps the run's output channel);
- running, for contrast (K = 1,000; quick: 200): the same script with its calls allowed
  and the tool waiting on an event — a task whose supervisor, actors and tool calls are
  alive: what parking saves.

Each set is built while the sets before it stay open, so that no set reuses memory that
another freed: RSS growth per session over the whole set (allocator included), and, in a
second host, tracemalloc's net allocation per session on a traced sample (1,000; quick:
150) with the top allocation sites. Ratios are to the idle figure of the same run. No
sleeps: a task has parked when its session's idle wait returns with the port parked.
Last, a sample of the parked tasks (100; quick: 20) is answered, call by call, with
``allow``; every one of them must complete, on its two answers. The sessions are
``Host.open``'s defaults: each request waits under ``approval_timeout_s`` (300 s), so the
host's timeout desk holds an entry for it, counted here.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing

from tests.benchmarks.common import (
    MAX_TOKENS,
    MODEL,
    PROMPT,
    TOOL_NAME,
    Meter,
    approve_all,
    arg_parser,
    greenroom_tool,
    pin_client,
    print_machine,
    print_table,
    rss_bytes,
    write_json,
)
from tests.benchmarks.idle import reference_script

KIB = 1024
BATCH = 200
"""Sessions built at once: the idle benchmark's concurrency."""


async def _settle() -> None:
    """Let every task that has work left finish it (the supervisors of runs that just
    ended, the trace sink), then collect: what remains is what the sessions keep."""
    await trio.testing.wait_all_tasks_blocked()
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


class Gate:
    """The running set's ``lookup``: each call waits until the gate opens, so that its
    task stays running with its calls in the pool; ``all_in`` is set once ``expected``
    calls have started."""

    def __init__(self, expected: int) -> None:
        from greenroom.protocols.tools import tool

        self.opened = trio.Event()
        self.all_in = trio.Event()
        self.started = 0
        self.expected = expected

        @tool(parallel=True, name=TOOL_NAME)
        async def lookup(key: str) -> str:
            """Look up a key."""
            self.started += 1
            if self.started >= self.expected:
                self.all_in.set()
            await self.opened.wait()
            return f"value-{key}"

        self.tool = lookup


class Builder:
    """Builds the sets of one host: its provider, its tool, its workspace."""

    def __init__(self, host: Any, provider: Any, workspace: Path) -> None:
        self.host = host
        self.provider = provider
        self.workspace = workspace

    async def _session(self, tool: Any) -> Any:
        return await self.host.create_session(
            tools=[tool], provider=self.provider, workspace_dir=self.workspace,
            model=MODEL, max_tokens=MAX_TOKENS,
        )

    @staticmethod
    async def _in_batches(n: int, one: Callable[[], Awaitable[None]]) -> None:
        for start in range(0, n, BATCH):
            async with trio.open_nursery() as nursery:
                for _ in range(min(BATCH, n - start)):
                    nursery.start_soon(one)

    async def idle(self, n: int) -> list[Any]:
        """N sessions with the reference history, their calls allowed by a callback."""
        sessions: list[Any] = []
        failed: list[str] = []
        tool = greenroom_tool()

        async def one() -> None:
            s = await self._session(tool)
            result = await s.run(PROMPT, approve=approve_all).result()
            if result.task_end is None or result.task_end.status != "completed":
                failed.append(repr(result.task_end)[:200])
            sessions.append(s)

        await self._in_batches(n, one)
        if failed:
            raise RuntimeError(f"{len(failed)} idle runs did not complete: {failed[:2]}")
        return sessions

    async def parked(self, n: int, *, keep_stream: bool) -> list[tuple[Any, Any]]:
        """N sessions whose task is parked on a person's answer to its first call, with
        the run's stream (kept and read up to the request) or None (detached)."""
        from greenroom.protocols.outputs import ApprovalRequest
        from greenroom.protocols.people import PEOPLE

        built: list[tuple[Any, Any]] = []
        tool = greenroom_tool()

        async def one() -> None:
            s = await self._session(tool)
            stream = s.run(PROMPT, approve=PEOPLE)
            if keep_stream:
                async for out in stream:
                    if isinstance(out, ApprovalRequest):
                        break
            else:
                stream.detach()
            await s.wait_idle()  # returns once the supervisor has ended
            if not self.host.port(s.id).parked:
                raise RuntimeError(f"session {s.id} did not park")
            built.append((s, stream if keep_stream else None))

        await self._in_batches(n, one)
        return built

    async def running(self, k: int, gate: Gate) -> list[Any]:
        """K sessions whose task runs its two calls, held by ``gate``; returns once every
        call has started (the runs' streams are detached)."""
        sessions: list[Any] = []

        async def one() -> None:
            s = await self._session(gate.tool)
            s.run(PROMPT, approve=approve_all).detach()
            sessions.append(s)

        await self._in_batches(k, one)
        await gate.all_in.wait()
        return sessions


async def measure(label: str, n: int, build: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    """RSS growth per session while ``build`` builds ``n`` sessions (kept in the row)."""
    await _settle()
    rss0 = rss_bytes()
    with Meter() as meter:
        kept = await build()
        await _settle()
    rss1 = rss_bytes()
    row: dict[str, Any] = {
        "set": label,
        "sessions": n,
        "rss_bytes_per_session": (rss1 - rss0) / n,
        "build_s": meter.wall_s,
        "kept": kept,
    }
    print(f"  {label}: {row['rss_bytes_per_session'] / KIB:.2f} KiB RSS/session over {n}",
          flush=True)
    return row


async def answer_sample(host: Any, parked: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Answer every request of the sampled parked tasks with ``allow`` (the first call,
    then the second, which is asked once the first is decided) until they end; count
    those that completed."""
    from greenroom.protocols.outputs import TaskEnd

    ids = {s.id for s, _ in parked}
    answered = 0
    with Meter() as meter:
        for _ in range(10):  # two requests a task; more rounds would be a bug
            pending = [p for p in await host.pending_approvals() if p.session_id in ids]
            if not pending:
                break
            async with trio.open_nursery() as nursery:
                for p in pending:

                    async def answer_one(p: Any = p) -> None:
                        await host.answer_approval(p.session_id, p.call_id, "allow",
                                                   by="benchmark", digest=p.digest)
                        await host.get_session(p.session_id).wait_idle()

                    nursery.start_soon(answer_one)
            answered += len(pending)
    statuses: dict[str, int] = {}
    for s, stream in parked:
        if stream is not None:
            ends = [o for o in await stream.collect() if isinstance(o, TaskEnd)]
            status = ends[-1].status if ends else "no task_end on the stream"
        else:
            status = host.port(s.id).machine.record.last_status or "still open"
        statuses[status] = statuses.get(status, 0) + 1
    return {"sample": len(parked), "answers": answered, "statuses": statuses,
            "wall_s": meter.wall_s}


async def measure_rss(n: int, k: int, sample: int, data_dir: Path) -> dict[str, Any]:
    from greenroom.actors.providers.scripted import ScriptedProvider
    from greenroom.actors.runtime.host import Host

    provider = ScriptedProvider(reference_script(), keep_requests=False)
    run_dir = Path(tempfile.mkdtemp(prefix="rss-", dir=data_dir))
    async with Host.open(run_dir) as host:
        build = Builder(host, provider, data_dir)
        # Warm-up: imports, caches, the first allocations of every path measured.
        await build.idle(20)
        await build.parked(20, keep_stream=False)
        await build.parked(20, keep_stream=True)
        warm_gate = Gate(40)
        await build.running(20, warm_gate)
        warm_gate.opened.set()
        for s in list(host.sessions):
            await s.wait_idle()
            await host.close_session(s.id)
        rows = [await measure("idle", n, lambda: build.idle(n))]
        rows.append(await measure("parked", n, lambda: build.parked(n, keep_stream=False)))
        rows.append(await measure("parked, stream kept", n,
                                  lambda: build.parked(n, keep_stream=True)))
        gate = Gate(2 * k)
        rows.append(await measure("running (tool waits)", k,
                                  lambda: build.running(k, gate)))
        gate.opened.set()
        for s in rows[-1]["kept"]:
            await s.wait_idle()
        # The sessions parked last: the requests wait under Host.open's default
        # approval_timeout_s (300 s), and an answer must come before it denies them.
        parked_sample = rows[1]["kept"][-(sample // 2):] + rows[2]["kept"][-(sample - sample // 2):]
        sanity = await answer_sample(host, parked_sample)
        for row in rows:
            row.pop("kept")
        print(f"  sanity: {sanity['sample']} parked tasks answered ({sanity['answers']} "
              f"answers): {sanity['statuses']}", flush=True)
    return {"rows": rows, "sanity": sanity}


async def measure_traced(m: int, data_dir: Path) -> list[dict[str, Any]]:
    """tracemalloc's net allocation per session: idle, then parked (stream detached),
    then parked with the stream kept, each a diff against the snapshot before it."""
    from greenroom.actors.providers.scripted import ScriptedProvider
    from greenroom.actors.runtime.host import Host

    provider = ScriptedProvider(reference_script(), keep_requests=False)
    run_dir = Path(tempfile.mkdtemp(prefix="traced-", dir=data_dir))
    rows: list[dict[str, Any]] = []
    async with Host.open(run_dir) as host:
        build = Builder(host, provider, data_dir)
        await build.idle(20)
        await build.parked(20, keep_stream=False)
        await build.parked(20, keep_stream=True)
        for s in list(host.sessions):
            await host.close_session(s.id)
        await _settle()
        tracemalloc.start(1)
        kept: list[Any] = []
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("idle", lambda: build.idle(m)),
            ("parked", lambda: build.parked(m, keep_stream=False)),
            ("parked, stream kept", lambda: build.parked(m, keep_stream=True)),
        ]
        before = tracemalloc.take_snapshot()
        for label, step in steps:
            kept.append(await step())
            await _settle()
            after = tracemalloc.take_snapshot()
            diff = after.compare_to(before, "lineno")
            rows.append(
                {
                    "set": label,
                    "sessions": m,
                    "traced_bytes_per_session": sum(s.size_diff for s in diff) / m,
                    "top_sites": _top_sites(diff, m, 12),
                }
            )
            print(f"  {label}: {rows[-1]['traced_bytes_per_session'] / KIB:.2f} KiB "
                  f"traced/session", flush=True)
            before = after
        tracemalloc.stop()
        del kept
    return rows


async def main_async(args: Any) -> dict[str, Any]:
    n = args.n or (1000 if args.quick else 10_000)
    k = args.running or (200 if args.quick else 1000)
    m = min(n, 150 if args.quick else 1000)
    sample = min(n, 20 if args.quick else 100)
    data_dir = Path(tempfile.mkdtemp(prefix="greenroom-parked-"))
    try:
        rss = await measure_rss(n, k, sample, data_dir)
        traced = await measure_traced(m, data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    rows = rss["rows"]
    idle_rss = rows[0]["rss_bytes_per_session"]
    idle_traced = traced[0]["traced_bytes_per_session"]
    traced_by_set = {t["set"]: t["traced_bytes_per_session"] for t in traced}
    table = []
    for row in rows:
        traced_bytes = traced_by_set.get(row["set"])
        table.append(
            {
                "set": row["set"],
                "sessions": row["sessions"],
                "rss_kib_per_session": row["rss_bytes_per_session"] / KIB,
                "rss_vs_idle": row["rss_bytes_per_session"] / idle_rss,
                "traced_kib_per_session": (
                    traced_bytes / KIB if traced_bytes is not None else float("nan")
                ),
                "traced_vs_idle": (
                    traced_bytes / idle_traced if traced_bytes is not None else float("nan")
                ),
                "build_s": row["build_s"],
            }
        )
    print_table(
        f"Parked tasks next to idle sessions, one host (RSS over the set; traced on "
        f"{m} a set) — R-HITL-3: parked ≈ idle",
        table,
    )
    for t in traced:
        print_table(f"Top allocation sites per session ({t['set']}, traced)",
                    t["top_sites"][:8])
    sanity = rss["sanity"]
    print(f"\nanswered {sanity['sample']} parked tasks ({sanity['answers']} answers, "
          f"{sanity['wall_s']:.2f} s): {sanity['statuses']}")
    if sanity["statuses"] != {"completed": sanity["sample"]} or (
        sanity["answers"] != 2 * sanity["sample"]
    ):
        raise SystemExit("the answered parked tasks did not all complete on their two answers")
    return {"quick": args.quick, "sets": table, "traced": traced, "sanity": sanity}


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", "-n", type=int, default=0,
                        help="sessions per idle and parked set (default 10,000)")
    parser.add_argument("--running", type=int, default=0,
                        help="running tasks for contrast (default 1,000)")
    args = parser.parse_args()
    pin_client()
    print_machine()
    with Meter() as total:
        result = trio.run(main_async, args)
    print(f"\ntotal wall {total.wall_s:.1f}s")
    write_json("parked", result)


if __name__ == "__main__":
    main()
