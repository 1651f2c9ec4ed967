"""The reference workload written three ways, each a coroutine running N tasks at once.

* :func:`run_greenroom`: Host + one session per task (tool ``lookup``, approve all, the
  ``anthropic`` provider pointed at the mock, traces in a temporary data dir).
* :func:`run_sdk`: the same task written by hand with the anthropic SDK under trio, the way
  its documentation shows it: ``client.messages.stream(...)``, iterate the events, take
  ``get_final_message()``, run the tool calls concurrently in a nursery, send the results.
* :func:`run_raw`: a raw ``httpx.AsyncClient`` loop (``aiter_lines`` + ``json.loads`` per
  ``data:`` line), the floor of what a Python client can cost.

Each returns a :class:`Run` with the number of tasks completed and outputs consumed;
CPU/wall/RSS are measured by the caller around the ``run_*`` call. Clients are created
before (and closed after) the measured part; connections are opened inside it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    approve_all,
    greenroom_tool,
)

POOL = 4000  # connection pool size of every client (same for all three variants)
TOOLS = [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}]


@dataclass
class Run:
    variant: str
    n: int
    completed: int = 0
    outputs: int = 0
    text_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    meter: Meter | None = None
    setup_cpu_s: float = 0.0
    timings: list[dict[str, float]] = field(default_factory=list)
    """Per task (greenroom's): when its run began and its requests' records came, for
    :func:`~tests.benchmarks.common.phase_medians`."""


# -- greenroom --------------------------------------------------------------------------------


class GreenroomBench:
    """A Host and a provider kept open across repetitions; fresh sessions per run."""

    def __init__(
        self,
        base_url: str,
        data_dir: Path,
        tools: bool = True,
        gc_tuning: bool | None = None,
        lean_http: bool | None = None,
    ) -> None:
        self.base_url = base_url
        self.data_dir = data_dir
        self.tools = [greenroom_tool()] if tools else []
        self.gc_tuning = gc_tuning
        self.lean_http = lean_http

    async def run(self, n: int, *, measure: bool = True) -> Run:
        import time

        from greenroom.actors.providers.anthropic import AnthropicProvider
        from greenroom.actors.providers.registry import lean_http_enabled
        from greenroom.actors.runtime.host import Host
        from greenroom.protocols.outputs import PartialText, RequestBegin, RequestEnd, TaskEnd

        result = Run("greenroom", n)
        # None: what a session of Host.open() gets from the provider registry (the defaults).
        lean = lean_http_enabled() if self.lean_http is None else self.lean_http
        provider = AnthropicProvider(
            base_url=self.base_url, api_key="bench", max_connections=POOL, lean_http=lean
        )
        data_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self.data_dir))
        try:
            async with Host.open(data_dir, gc_tuning=self.gc_tuning) as host:
                cpu0 = time.process_time()
                sessions = [
                    await host.create_session(
                        tools=self.tools,
                        provider=provider,
                        workspace_dir=data_dir.parent,
                        model=MODEL,
                        max_tokens=MAX_TOKENS,
                    )
                    for _ in range(n)
                ]
                result.setup_cpu_s = time.process_time() - cpu0

                async def one(session: Any) -> None:
                    outputs = tokens = 0
                    last = None
                    times = {"sent": time.perf_counter()}
                    async for out in session.run(PROMPT, approve=approve_all):
                        outputs += 1
                        if type(out) is PartialText:
                            # A piece may hold several of the mock's tokens ("tokN "):
                            # pieces are joined when the reader is behind.
                            tokens += out.text.count("tok")
                        elif type(out) is RequestBegin or type(out) is RequestEnd:
                            kind = "begin" if type(out) is RequestBegin else "end"
                            times.setdefault(f"{kind}{out.turn}", time.perf_counter())
                        last = out
                    times["ended"] = time.perf_counter()
                    result.timings.append(times)
                    result.outputs += outputs
                    result.text_tokens += tokens
                    if isinstance(last, TaskEnd) and last.status == "completed":
                        result.completed += 1
                    else:
                        result.errors.append(repr(last)[:300])

                meter = Meter()
                with meter:
                    async with trio.open_nursery() as nursery:
                        for s in sessions:
                            nursery.start_soon(one, s)
                result.meter = meter
        finally:
            await provider.aclose()
        return result


# -- the anthropic SDK by hand ------------------------------------------------------------------


async def _sdk_tool(key: str) -> str:
    await trio.sleep(TOOL_SLEEP_S)
    return f"value-{key}"


async def sdk_task(client: Any, result: Run) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    outputs = tokens = 0
    for _turn in range(10):
        async with client.messages.stream(
            model=MODEL, max_tokens=MAX_TOKENS, messages=messages, tools=TOOLS
        ) as stream:
            async for event in stream:
                outputs += 1
                if event.type == "text":
                    tokens += 1
            message = await stream.get_final_message()
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in message.content],
            }
        )
        calls = [b for b in message.content if b.type == "tool_use"]
        if not calls:
            break
        results: list[dict[str, Any]] = [{} for _ in calls]

        async def run_call(i: int, call: Any, results: list[dict[str, Any]] = results) -> None:
            text = await _sdk_tool(**call.input)
            results[i] = {
                "type": "tool_result",
                "tool_use_id": call.id,
                "content": [{"type": "text", "text": text}],
            }

        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(run_call, i, call)
        messages.append({"role": "user", "content": results})
    result.outputs += outputs
    result.text_tokens += tokens
    if message.stop_reason == "end_turn":
        result.completed += 1
    else:
        result.errors.append(f"stop_reason {message.stop_reason}")


def sdk_timeout() -> Any:
    """greenroom's provider timeouts as the SDK takes them (an ``httpx2.Timeout``)."""
    import httpx2

    from greenroom.actors.providers.anthropic import DEFAULT_TIMEOUT as T

    return httpx2.Timeout(connect=T.connect, read=T.read, write=T.write, pool=T.pool)


def make_sdk_client(base_url: str) -> Any:
    import anthropic
    import httpx2  # the SDK's bundled HTTP client

    # Same limits and timeouts as greenroom's provider (the SDK's default connect timeout of
    # 5 s fails when 1,000 tasks share one core).
    timeout = sdk_timeout()
    return anthropic.AsyncAnthropic(
        base_url=base_url,
        api_key="bench",
        max_retries=0,
        timeout=timeout,
        http_client=anthropic.DefaultAsyncHttpxClient(
            limits=httpx2.Limits(max_connections=POOL, max_keepalive_connections=POOL),
            timeout=timeout,
        ),
    )


def _guarded(task: Callable[[Any, Run], Awaitable[None]]) -> Callable[[Any, Run], Awaitable[None]]:
    async def run(client: Any, result: Run) -> None:
        try:
            await task(client, result)
        except Exception as exc:  # a failed task is counted, not fatal to the benchmark
            result.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    return run


async def run_sdk(
    base_url: str, n: int, task: Callable[[Any, Run], Awaitable[None]] = sdk_task
) -> Run:
    task = _guarded(task)
    result = Run("sdk", n)
    client = make_sdk_client(base_url)
    try:
        meter = Meter()
        with meter:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(task, client, result)
        result.meter = meter
    finally:
        await client.close()
    return result


# -- raw httpx --------------------------------------------------------------------------------


async def raw_task(client: Any, result: Run) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    outputs = tokens = 0
    stop = None
    for _turn in range(10):
        body = {
            "model": MODEL,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "tools": TOOLS,
            "messages": messages,
        }
        blocks: dict[int, dict[str, Any]] = {}
        async with client.stream("POST", "/v1/messages", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                outputs += 1
                etype = event["type"]
                if etype == "content_block_delta":
                    delta = event["delta"]
                    if delta["type"] == "text_delta":
                        tokens += 1
                        blocks[event["index"]]["parts"].append(delta["text"])
                    elif delta["type"] == "input_json_delta":
                        blocks[event["index"]]["parts"].append(delta["partial_json"])
                elif etype == "content_block_start":
                    blocks[event["index"]] = {"block": event["content_block"], "parts": []}
                elif etype == "message_delta":
                    stop = event["delta"].get("stop_reason")
        content: list[dict[str, Any]] = []
        calls = []
        for index in sorted(blocks):
            b = blocks[index]
            if b["block"]["type"] == "text":
                content.append({"type": "text", "text": "".join(b["parts"])})
            else:
                call = {
                    "type": "tool_use",
                    "id": b["block"]["id"],
                    "name": b["block"]["name"],
                    "input": json.loads("".join(b["parts"]) or "{}"),
                }
                content.append(call)
                calls.append(call)
        messages.append({"role": "assistant", "content": content})
        if not calls:
            break
        results: list[dict[str, Any]] = [{} for _ in calls]

        async def run_call(
            i: int, call: dict[str, Any], results: list[dict[str, Any]] = results
        ) -> None:
            text = await _sdk_tool(**call["input"])
            results[i] = {
                "type": "tool_result",
                "tool_use_id": call["id"],
                "content": [{"type": "text", "text": text}],
            }

        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(run_call, i, call)
        messages.append({"role": "user", "content": results})
    result.outputs += outputs
    result.text_tokens += tokens
    if stop == "end_turn":
        result.completed += 1
    else:
        result.errors.append(f"stop_reason {stop}")


def make_raw_client(base_url: str) -> Any:
    import httpx

    return httpx.AsyncClient(
        base_url=base_url,
        headers={"x-api-key": "bench", "anthropic-version": "2023-06-01"},
        limits=httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL),
        timeout=httpx.Timeout(180.0, connect=15.0, write=60.0, pool=60.0),
    )


async def run_raw(base_url: str, n: int) -> Run:
    result = Run("raw-httpx", n)
    client = make_raw_client(base_url)
    try:
        meter = Meter()
        with meter:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(_guarded(raw_task), client, result)
        result.meter = meter
    finally:
        await client.aclose()
    return result


def summarize(run: Run) -> dict[str, Any]:
    m = run.meter
    assert m is not None
    return {
        "variant": run.variant,
        "N": run.n,
        "completed": run.completed,
        "cpu_s": m.cpu_s,
        "wall_s": m.wall_s,
        "peak_rss_mib": m.peak_rss / 2**20,
        "outputs": run.outputs,
        "outputs_per_s": run.outputs / m.wall_s if m.wall_s else 0.0,
        "cpu_ms_per_task": 1000 * m.cpu_s / max(1, run.n),
        "text_tokens": run.text_tokens,
        "setup_cpu_s": run.setup_cpu_s,
        "errors": run.errors[:3],
    }


__all__ = ["GreenroomBench", "Run", "run_raw", "run_sdk", "summarize"]
