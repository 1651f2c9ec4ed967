"""Many sessions, one provider (R-SHARE-1, R-SHARE-2): 200 sessions at once against a
provider that takes 8 requests at once and answers 429 with ``retry-after: 1`` beyond.

    python tests/benchmarks/shared_provider.py [--quick] [--n 200] [--k 8]
    .venv/bin/python -m tests.benchmarks.shared_provider [--quick]

The mock model server (a subprocess, pinned to its own core) plays a short paced task:
three rounds of one ``lookup`` tool call, then the answer — four requests, each
``--tokens`` text tokens (10) at ``--token-ms`` (10 ms) after ``--first-ms`` (50 ms) to
the first one. It writes at most ``--k`` responses at once; a request beyond gets 429
``rate_limit_error`` with ``retry-after: 1``. A fresh server per run counts the requests
it answered and the ones it refused.

Runs, one after the other in this process, each with fresh sessions:

* ``greenroom``: ``Host.open()`` with no limits configured (what a user gets), one session
  per task, the ``anthropic`` provider from the registry (one client, one admission point);
* ``sdk-loop``: the same task written by hand with the anthropic SDK (``messages.stream``,
  tools in a nursery), one client, with the SDK's own retries (``max_retries=5``: it
  honours ``retry-after``), as many attempts as greenroom's retry ladder;
* ``greenroom-limited``: ``Host.open(limits=ProviderLimits(max_concurrent_requests=K))``.

Printed per run: tasks that failed, requests accepted and refused (429) by the server,
429s per accepted request, 429s against the SDK loop's, wall time against the ideal under
the cap (every one of the K places busy from the first request to the last:
``N * request time per task / K``), client CPU. Targets: no failed task; greenroom's 429s
at most 10 % of its accepted requests and at most half the SDK loop's; wall at most 1.3 times
the ideal; no 429 with the limit configured. Figures only: nothing here asserts.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root holds `tests`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trio

from tests.benchmarks.common import (
    MAX_TOKENS,
    MODEL,
    PROMPT,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_SCHEMA,
    TOOL_SLEEP_S,
    Meter,
    MockServer,
    approve_all,
    arg_parser,
    greenroom_tool,
    pin_client,
    print_machine,
    print_table,
    write_json,
)

ROUNDS = 3
TOOLS = [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}]
TARGET_429_SHARE = 0.10
TARGET_429_VS_SDK = 0.5
TARGET_WALL = 1.3
SDK_MAX_RETRIES = 5


def request_s(args: Any) -> float:
    """Server-side pacing of one task's requests, summed: each takes the first-token wait
    and a token gap between its deltas (a tool request's deltas: its text tokens and the
    call's one argument fragment; the answer's: its text tokens)."""
    tool_request = args.first_ms + args.tokens * args.token_ms
    answer = args.first_ms + (args.tokens - 1) * args.token_ms
    return (ROUNDS * tool_request + answer) / 1000


def ideal_s(args: Any, n: int) -> float:
    """The wall time if the server's K places were busy from the first request to the last,
    and never shorter than one task alone."""
    alone = request_s(args) + ROUNDS * TOOL_SLEEP_S
    return max(n * request_s(args) / args.k, alone)


def server_counts(server: MockServer) -> tuple[int, int]:
    """Requests the server answered and refused, from its STATS line."""
    requests = re.search(r"requests=(\d+)", server.stats)
    limited = re.search(r"rate_limited=(\d+)", server.stats)
    if requests is None or limited is None:
        raise RuntimeError(f"the mock server printed no statistics: {server.stats!r}")
    return int(requests.group(1)), int(limited.group(1))


def mock_server(args: Any) -> MockServer:
    return MockServer(
        "--workload", "reference", "--text-tokens", str(args.tokens), "--tool-calls", "1",
        "--fragments", "1", "--tool-rounds", str(ROUNDS), "--token-delay-ms",
        str(args.token_ms), "--first-token-ms", str(args.first_ms), "--max-streams",
        str(args.k), "--limit-retry-after", "1",
    )


# -- greenroom ----------------------------------------------------------------------------------


async def run_greenroom(base_url: str, n: int, limits: Any) -> dict[str, Any]:
    from greenroom import Host
    from greenroom.protocols.outputs import RequestEnd, TaskEnd

    root = Path(tempfile.mkdtemp(prefix="greenroom-shared-"))
    data_dir = root / "data"
    tool = greenroom_tool()
    failed: list[str] = []
    failed_attempts = 0
    async with Host.open(data_dir, limits=limits) as host:
        sessions = [
            await host.create_session(
                provider="anthropic", base_url=base_url, model=MODEL, tools=[tool],
                workspace_dir=root, max_tokens=MAX_TOKENS,
            )
            for _ in range(n)
        ]

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
    return {"failed": len(failed), "failed_attempts": failed_attempts, "meter": meter,
            "examples": failed[:2]}


# -- the anthropic SDK by hand ------------------------------------------------------------------


async def sdk_task(client: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    for _turn in range(ROUNDS + 2):
        async with client.messages.stream(
            model=MODEL, max_tokens=MAX_TOKENS, messages=messages, tools=TOOLS
        ) as stream:
            async for _event in stream:
                pass
            message = await stream.get_final_message()
        messages.append(
            {"role": "assistant",
             "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        calls = [b for b in message.content if b.type == "tool_use"]
        if not calls:
            return
        results: list[dict[str, Any]] = [{} for _ in calls]

        async def run_call(i: int, call: Any, results: list[dict[str, Any]] = results) -> None:
            await trio.sleep(TOOL_SLEEP_S)
            results[i] = {"type": "tool_result", "tool_use_id": call.id,
                          "content": [{"type": "text", "text": f"value-{call.input['key']}"}]}

        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(run_call, i, call)
        messages.append({"role": "user", "content": results})
    raise RuntimeError("no final answer")


async def run_sdk(base_url: str, n: int) -> dict[str, Any]:
    import anthropic
    import httpx2

    from tests.benchmarks.workloads import sdk_timeout

    timeout = sdk_timeout()
    client = anthropic.AsyncAnthropic(
        base_url=base_url, api_key="bench", max_retries=SDK_MAX_RETRIES, timeout=timeout,
        http_client=anthropic.DefaultAsyncHttpxClient(
            limits=httpx2.Limits(max_connections=2000, max_keepalive_connections=2000),
            timeout=timeout,
        ),
    )
    failed: list[str] = []

    async def one() -> None:
        try:
            await sdk_task(client)
        except Exception as exc:  # a failed task is counted, not fatal to the benchmark
            failed.append(f"{type(exc).__name__}: {exc}"[:200])

    try:
        with Meter() as meter:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(one)
    finally:
        await client.close()
    return {"failed": len(failed), "failed_attempts": None, "meter": meter,
            "examples": failed[:2]}


# -- the runs -------------------------------------------------------------------------------------


async def measure(name: str, args: Any, n: int) -> dict[str, Any]:
    from greenroom import ProviderLimits

    with mock_server(args) as server:
        if name == "sdk-loop":
            outcome = await run_sdk(server.base_url, n)
        else:
            limits = ProviderLimits(max_concurrent_requests=args.k) if name.endswith(
                "limited") else None
            outcome = await run_greenroom(server.base_url, n, limits)
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
          f"ideal {ideal:.1f}s), cpu {meter.cpu_s:.1f}s", flush=True)
    for example in outcome["examples"]:
        print(f"    failed: {example}", flush=True)
    return row


async def main_async(args: Any) -> dict[str, Any]:
    n = args.n or (40 if args.quick else 200)
    # The registry's anthropic provider (what `serve` and `Host.open()` users get) needs
    # a key; the mock takes any.
    os.environ.setdefault("ANTHROPIC_API_KEY", "bench")
    rows = [await measure(name, args, n)
            for name in ("greenroom", "sdk-loop", "greenroom-limited")]
    by_run = {row["run"]: row for row in rows}
    greenroom, sdk = by_run["greenroom"], by_run["sdk-loop"]
    vs_sdk = greenroom["429s"] / sdk["429s"] if sdk["429s"] else math.nan
    print_table(
        f"N = {n} sessions, the provider takes K = {args.k} at once (429, retry-after: 1 "
        f"beyond); {ROUNDS + 1} requests a task",
        rows,
    )
    print(
        f"\ngreenroom, no limits configured: {greenroom['failed']} failed tasks (target 0); "
        f"429s {greenroom['429/accepted']:.1%} of accepted (target <= "
        f"{TARGET_429_SHARE:.0%}), {vs_sdk:.2f}x the SDK loop's (target <= "
        f"{TARGET_429_VS_SDK}); wall {greenroom['wall/ideal']:.2f}x the ideal (target <= "
        f"{TARGET_WALL})"
    )
    limited = by_run["greenroom-limited"]
    print(f"greenroom, max_concurrent_requests={args.k}: {limited['429s']} 429s (target 0), "
          f"{limited['failed']} failed tasks, wall {limited['wall/ideal']:.2f}x the ideal")
    return {"n": n, "k": args.k, "rows": rows, "greenroom_429_vs_sdk": vs_sdk,
            "request_s_per_task": request_s(args)}


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, default=0, help="sessions (default 200; quick 40)")
    parser.add_argument("--k", type=int, default=8, help="requests the provider takes at once")
    parser.add_argument("--tokens", type=int, default=10, help="text tokens per response")
    parser.add_argument("--token-ms", type=float, default=10.0)
    parser.add_argument("--first-ms", type=float, default=50.0)
    args = parser.parse_args()
    pin_client()
    print_machine()
    started = time.perf_counter()
    result = trio.run(main_async, args)
    print(f"\ntotal wall {time.perf_counter() - started:.1f}s")
    write_json("shared_provider", result)


if __name__ == "__main__":
    main()
