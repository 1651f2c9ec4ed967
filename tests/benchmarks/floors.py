"""Floors: what reading the paced reference streams costs below greenroom's runtime.

    .venv/bin/python -m tests.benchmarks.floors [--quick] [--n 1000 250] [--reps 3]

The same paced setup as ``scale`` (mock server on its own core, 20 ms per token, 500 ms to
the first token, N tasks at once, each sending the reference task's two requests with a
10 ms pause between them), read by successively larger client stacks, alternately:

* ``trio-h11``: trio sockets and h11 (the chunked decoding), one connection per task kept
  alive for both requests; events are found by splitting on blank lines. The floor of a
  Python client on trio.
* ``httpx-trio``: ``httpx.AsyncClient.stream`` + ``aiter_raw`` (httpx / httpcore 1.x on
  trio), the same split.
* ``sdk-raw``: the anthropic SDK's ``messages.with_streaming_response.create`` +
  ``iter_bytes`` (httpx2 / httpcore2, what greenroom's provider reads through with
  ``--no-lean-http``), the same split.
* ``sdk-raw+codec``: the same, each chunk fed to greenroom's
  :class:`~greenroom.protocols.anthropic_codec.AnthropicStreamDecoder` (the provider's work
  without the runtime above it).
* ``lean+codec``: greenroom's own HTTP client
  (:class:`~greenroom.actors.providers.lean_http.ConnectionPool`, what the anthropic
  provider sends through by default) with greenroom's decoder: the provider's work without
  the runtime above it, and without the SDK.

Reported per variant: wall and its ratio to the pacing ideal, client CPU, CPU per wire
event, wire events per socket read. The difference between two rows is the cost of the
layer the second adds; ``scale`` gives the full runtime in the same setup.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any
from urllib.parse import urlsplit

import trio

from tests.benchmarks.common import (
    MAX_TOKENS,
    MODEL,
    PROMPT,
    TOOL_SLEEP_S,
    Meter,
    MockServer,
    ReadCounter,
    arg_parser,
    median,
    pin_client,
    print_machine,
    print_table,
    wire_events_per_task,
    write_json,
)
from tests.benchmarks.scale import FIRST_MS, TOKEN_MS, ideal_s
from tests.benchmarks.workloads import POOL, TOOLS, make_raw_client, make_sdk_client

VARIANTS = ("trio-h11", "httpx-trio", "sdk-raw", "sdk-raw+codec", "lean+codec")
HTTPX_MAX_N = 250
"""httpx-trio is skipped above this N: httpcore 1.x's pool scans make it quadratic (about
135 µs per event at N = 1,000, and a minute per run)."""


def _bodies() -> tuple[dict[str, Any], dict[str, Any]]:
    first = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    calls = [
        {"type": "tool_use", "id": f"toolu_{k}", "name": "lookup", "input": {"key": str(k)}}
        for k in (1, 2)
    ]
    results = [
        {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": f"value-{k}"}
        for k in (1, 2)
    ]
    second = dict(first)
    second["messages"] = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": [{"type": "text", "text": "..."}, *calls]},
        {"role": "user", "content": results},
    ]
    return first, second


class _Counts:
    def __init__(self) -> None:
        self.events = 0
        self.completed = 0
        self.errors: list[str] = []


def _split(buffer: bytes, chunk: bytes, counts: _Counts) -> bytes:
    buffer += chunk
    parts = buffer.split(b"\n\n")
    counts.events += len(parts) - 1
    return parts[-1]


async def _trio_h11_task(host: str, port: int, counts: _Counts) -> None:
    import h11

    stream = await trio.open_tcp_stream(host, port)
    conn = h11.Connection(h11.CLIENT)
    try:
        for body in _bodies():
            data = json.dumps(body).encode()
            request = h11.Request(
                method="POST",
                target="/v1/messages",
                headers=[
                    ("host", f"{host}:{port}"),
                    ("content-type", "application/json"),
                    ("content-length", str(len(data))),
                    ("x-api-key", "bench"),
                    ("anthropic-version", "2023-06-01"),
                ],
            )
            await stream.send_all(conn.send(request) + conn.send(h11.Data(data=data)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            buffer = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    buffer = _split(buffer, bytes(event.data), counts)
                elif isinstance(event, h11.EndOfMessage):
                    break
            conn.start_next_cycle()
            await trio.sleep(TOOL_SLEEP_S)
        counts.completed += 1
    finally:
        await stream.aclose()


async def _httpx_task(client: Any, counts: _Counts) -> None:
    for body in _bodies():
        async with client.stream("POST", "/v1/messages", json=body) as response:
            buffer = b""
            async for chunk in response.aiter_raw():
                buffer = _split(buffer, chunk, counts)
        await trio.sleep(TOOL_SLEEP_S)
    counts.completed += 1


async def _sdk_task(client: Any, counts: _Counts, codec: bool) -> None:
    from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder

    for body in _bodies():
        kwargs = {k: v for k, v in body.items() if k != "stream"}
        decoder = AnthropicStreamDecoder() if codec else None
        async with client.messages.with_streaming_response.create(
            stream=True, **kwargs
        ) as response:
            buffer = b""
            async for chunk in response.iter_bytes():
                buffer = _split(buffer, chunk, counts)
                if decoder is not None:
                    decoder.feed(chunk)
        await trio.sleep(TOOL_SLEEP_S)
    counts.completed += 1


async def _lean_task(pool: Any, base_url: str, counts: _Counts) -> None:
    from greenroom.actors.providers.lean_http import Timeouts, parse_url
    from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder

    url = parse_url(base_url + "/v1/messages")
    headers = [
        (b"x-api-key", b"bench"), (b"anthropic-version", b"2023-06-01"),
        (b"content-type", b"application/json"),
    ]  # fmt: skip
    timeouts = Timeouts()
    for body in _bodies():
        decoder = AnthropicStreamDecoder()
        response = await pool.request(b"POST", url, headers, json.dumps(body).encode(), timeouts)
        try:
            buffer = b""
            with response.body.read_deadline():
                async for chunk in response.body:
                    buffer = _split(buffer, chunk, counts)
                    decoder.feed(chunk)
        finally:
            await response.aclose()
        await trio.sleep(TOOL_SLEEP_S)
    counts.completed += 1


async def _guarded(counts: _Counts, fn: Any, *args: Any) -> None:
    try:
        await fn(*args)
    except Exception as exc:  # a failed task is counted, not fatal to the benchmark
        counts.errors.append(f"{type(exc).__name__}: {exc}"[:300])


async def run_variant(variant: str, base_url: str, n: int) -> tuple[Meter, _Counts]:
    counts = _Counts()
    gc.collect()
    client: Any = None
    if variant == "httpx-trio":
        client = make_raw_client(base_url)
    elif variant.startswith("sdk-raw"):
        client = make_sdk_client(base_url)
    elif variant == "lean+codec":
        from greenroom.actors.providers.lean_http import ConnectionPool

        client = ConnectionPool(max_connections=POOL)
    url = urlsplit(base_url)
    meter = Meter()
    try:
        with meter:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    if variant == "trio-h11":
                        args: tuple[Any, ...] = (_trio_h11_task, url.hostname, url.port, counts)
                    elif variant == "httpx-trio":
                        args = (_httpx_task, client, counts)
                    elif variant == "lean+codec":
                        args = (_lean_task, client, base_url, counts)
                    else:
                        args = (_sdk_task, client, counts, variant.endswith("+codec"))
                    nursery.start_soon(_guarded, counts, *args)
    finally:
        if variant in ("httpx-trio", "lean+codec"):
            await client.aclose()
        elif client is not None:
            await client.close()
    return meter, counts


async def main_async(args: Any) -> dict[str, Any]:
    ideal = ideal_s(TOKEN_MS, FIRST_MS)
    ns: list[int] = args.n or [200 if args.quick else 1000]
    reps = args.reps or (1 if args.quick else 3)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    expected = wire_events_per_task()
    reads = ReadCounter.install()
    rows: list[dict[str, Any]] = []
    try:
        with MockServer(
            "--workload",
            "reference",
            "--token-delay-ms",
            str(TOKEN_MS),
            "--first-token-ms",
            str(FIRST_MS),
        ) as server:
            for n in ns:
                samples: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
                for rep in range(reps):
                    vs = tuple(v for v in variants if v != "httpx-trio" or n <= HTTPX_MAX_N)
                    order = vs[rep % len(vs) :] + vs[: rep % len(vs)]
                    for v in order:
                        reads.reset()
                        meter, counts = await run_variant(v, server.base_url, n)
                        s = {
                            "completed": counts.completed,
                            "events_per_task": counts.events / max(1, n),
                            "wall_s": meter.wall_s,
                            "ratio": meter.wall_s / ideal,
                            "cpu_s": meter.cpu_s,
                            "sys_s": meter.sys_s,
                            "us_per_event": 1e6 * meter.cpu_s / max(1, counts.events),
                            "events_per_read": counts.events / max(1, reads.reads),
                            "peak_rss_mib": meter.peak_rss / 2**20,
                        }
                        samples[v].append(s)
                        print(
                            f"  N={n} rep {rep + 1}/{reps} {v:>14}: {counts.completed}/{n}, "
                            f"wall {meter.wall_s:.2f}s (x{s['ratio']:.2f}), cpu "
                            f"{meter.cpu_s:.2f}s, {s['us_per_event']:.1f} us/event, "
                            f"{s['events_per_read']:.1f} events/read",
                            flush=True,
                        )
                        if counts.errors:
                            print(f"    errors: {counts.errors[:2]}")
                for v in variants:
                    ss = samples[v]
                    if not ss:
                        continue
                    row: dict[str, Any] = {"N": n, "variant": v, "reps": len(ss)}
                    row["completed"] = min(s["completed"] for s in ss)
                    for key in ss[0]:
                        if key != "completed":
                            row[key] = median(s[key] for s in ss)
                    rows.append(row)
    finally:
        reads.uninstall()
    print_table(
        f"Floors: reading the paced reference streams ({TOKEN_MS:g} ms/token, "
        f"{FIRST_MS:g} ms first token; ideal {ideal:.2f}s; {expected} wire events per "
        "task; medians)",
        rows,
    )
    return {"ideal_s": ideal, "pool": POOL, "wire_events_per_task": expected, "rows": rows}


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, nargs="*", help="task counts (default 1000; quick 200)")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default 3; quick 1)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    args = parser.parse_args()
    pin_client()
    print_machine()
    started = time.perf_counter()
    result = trio.run(main_async, args)
    print(f"\ntotal wall {time.perf_counter() - started:.1f}s")
    write_json("floors", result)


if __name__ == "__main__":
    main()
