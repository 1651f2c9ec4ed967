"""What the HTTP front (``serve --a2a`` / ``--ag-ui``) costs the websocket gateway on the
same port: the same gateway with and without the front, measured alternately in one
process, on a loopback socket.

    .venv/bin/python -m tests.benchmarks.http_front [--connections N] [--calls N]

Prints the medians of 7 rounds: ms per websocket connection (handshake, ``session.list``,
close) and µs per call on an open connection (``session.list`` round trips). The front
reads a connection's first request head and hands the connection over; after that it is
not on the path, so calls should cost the same."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import trio
from trio_websocket import open_websocket_url

from greenroom.actors.gateway import Gateway, SessionDefaults
from greenroom.actors.runtime.host import Host

TOKEN = "bench-token-0123456789"
HEADERS = [(b"Authorization", f"Bearer {TOKEN}".encode())]
LIST = b'{"jsonrpc":"2.0","id":1,"method":"session.list","params":{}}'


async def measure(url: str, connections: int, calls: int) -> tuple[float, float]:
    """(ms per connection, µs per call)."""
    start = time.perf_counter()
    for _ in range(connections):
        async with open_websocket_url(url, extra_headers=HEADERS) as ws:
            await ws.send_message(LIST)
            await ws.get_message()
    per_connection = (time.perf_counter() - start) / connections * 1e3
    async with open_websocket_url(url, extra_headers=HEADERS) as ws:
        start = time.perf_counter()
        for _ in range(calls):
            await ws.send_message(LIST)
            await ws.get_message()
        per_call = (time.perf_counter() - start) / calls * 1e6
    return per_connection, per_call


async def main(connections: int, calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "ws").mkdir()
        async with Host.open(root / "data") as host, trio.open_nursery() as nursery:
            gateways = {}
            for name, front in (("websocket alone", False), ("with the HTTP front", True)):
                gateway = Gateway(
                    host,
                    token=TOKEN,
                    port=0,
                    defaults=SessionDefaults(provider="scripted", workspace_dir=root / "ws"),
                    a2a=front,
                    ag_ui=front,
                )
                await nursery.start(gateway.run)
                gateways[name] = gateway.url
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in gateways}
            for _ in range(7):
                for name, url in gateways.items():
                    results[name].append(await measure(url, connections, calls))
            for name, rounds in results.items():
                per_connection = statistics.median(r[0] for r in rounds)
                per_call = statistics.median(r[1] for r in rounds)
                print(f"{name:22} {per_connection:7.3f} ms/connection {per_call:8.1f} µs/call")
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--calls", type=int, default=2000)
    options = parser.parse_args()
    trio.run(main, options.connections, options.calls)
