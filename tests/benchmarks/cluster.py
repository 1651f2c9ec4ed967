"""Cluster mode's costs: takeover time, request round trip, CPU per task, NATS memory.

    .venv/bin/python -m tests.benchmarks.cluster [--quick] [--trials N] [--tasks N]

* **takeover** after SIGKILL and after SIGSTOP of the owner while its tool call is in
  flight: from the signal to the new owner's first record in JetStream (the call's
  interrupted result), median and p99 over ``--trials`` (lease TTL 2 s, the default scan).
* **round trip** of a request to a session's owner over NATS (``SessionRequests``: the hop a
  non-owner gateway adds), median and p99 over 500 requests.
* **gateway round trip**: a websocket call (``interrupt`` of an idle session) from a client
  to the gateway of the session's owner, and to the gateway of another host, which forwards
  it (R-CLUSTER-1), median and p99 over 500 calls each.
* **CPU per task** of a ``serve`` host process with and without ``--nats`` on the same
  workload (``--tasks`` sessions, each one task: a prompt, one text reply; 10 at a time),
  from ``/proc/<pid>/stat`` (utime + stime) around the run.
* **NATS memory**: the nats-server's resident set (VmRSS) at the end.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import ClusterNames, connect
from greenroom.actors.cluster.routing import Answering, SessionRequests
from greenroom.actors.cluster.traces import TraceStream
from greenroom.protocols.outputs import ToolCallOutput
from tests.benchmarks.common import arg_parser, p99, print_machine, print_table, write_json
from tests.support.cluster_hosts import HostProcess, start_host
from tests.support.mock_model_server import (
    RecordedRequest,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)
from tests.support.nats import start_nats

LEASE_TTL_S = 2.0
PHASE_BOUND_S = 240.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _tool_model(request: RecordedRequest) -> Reply:
    body = request.body if isinstance(request.body, dict) else {}
    if not body.get("tools"):
        return Reply([Text("A title")])
    if "tool_result" in str(request.messages):
        return Reply([Text("done")])
    return Reply([ToolUse(id="call-1", name="side_effect", input={"note": "x"})], "tool_use")


def _text_model(request: RecordedRequest) -> Reply:
    return Reply([Text("a short answer of a few words for the benchmark")])


class _Starts:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        self.changed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(str(self.path))
        sock.listen()
        listener = trio.SocketListener(sock)
        task_status.started()
        async with listener:
            while True:
                stream = await listener.accept()
                await stream.receive_some()
                self.count += 1
                self.changed.set()
                self.changed = trio.Event()


async def _call(ws: Any, ids: list[int], method: str, params: dict[str, Any]) -> Any:
    ids[0] += 1
    await ws.send_message(json.dumps({"jsonrpc": "2.0", "id": ids[0], "method": method,
                                      "params": params}))
    while True:
        message = json.loads(await ws.get_message())
        if message.get("id") == ids[0]:
            return message.get("result")


async def _run_tasks(host: HostProcess, tasks: int, concurrency: int = 10) -> None:
    headers = [(b"Authorization", f"Bearer {host.token}".encode())]
    limit = trio.Semaphore(concurrency)

    async def one() -> None:
        async with limit, open_websocket_url(host.url, extra_headers=headers) as ws:
            ids = [0]
            sid = (await _call(ws, ids, "session.create", {}))["session_id"]
            await _call(ws, ids, "session.subscribe", {"session_id": sid})
            await _call(ws, ids, "run", {"session_id": sid, "input": "hello"})
            while True:
                message = json.loads(await ws.get_message())
                params = message.get("params") or {}
                if message.get("method") == "output" and params.get("type") == "task_end":
                    return

    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(one)


async def _takeover(
    tmp: Path, nats_url: str, conn: Any, kind: str, trials: int
) -> list[float]:
    starts = _Starts(tmp / f"starts-{kind}.sock")
    times: list[float] = []
    stream = await TraceStream.open(conn)
    async with open_mock_server(fallback=_tool_model) as model, trio.open_nursery() as nursery:
        await nursery.start(starts.serve)
        made = 0

        async def new_host() -> HostProcess:
            nonlocal made
            made += 1
            return await start_host(
                nursery, tmp / f"{kind}-{made}", f"{kind}{made}", nats_url=nats_url,
                model_url=model.base_url, effects=starts.path, lease_ttl_s=LEASE_TTL_S,
            )

        hosts = [await new_host(), await new_host()]
        try:
            for _ in range(trials):
                owner = hosts[0]
                headers = [(b"Authorization", f"Bearer {owner.token}".encode())]
                before = starts.count
                async with open_websocket_url(owner.url, extra_headers=headers) as ws:
                    ids = [0]
                    sid = (await _call(ws, ids, "session.create", {}))["session_id"]
                    await _call(ws, ids, "run", {"session_id": sid, "input": "go"})
                while starts.count == before:
                    await starts.changed.wait()
                began = trio.current_time()
                owner.process.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                async with stream.follow(sid) as records:
                    async for record in records:
                        if isinstance(record, ToolCallOutput):
                            times.append(trio.current_time() - began)
                            break
                if kind == "stop":
                    owner.process.send_signal(signal.SIGCONT)
                    await owner.wait_logged("lost the lease", "was fenced")
                    hosts = [hosts[1], owner]
                else:
                    await owner.process.wait()
                    hosts = [hosts[1], await new_host()]
        finally:
            with trio.CancelScope(shield=True):
                for host in hosts:
                    if host.process.returncode is None:
                        host.process.send_signal(signal.SIGCONT)
                        host.process.kill()
                        await host.process.wait()
            nursery.cancel_scope.cancel()
    return times


async def _round_trip(bridge: Bridge, nats_url: str, count: int) -> list[float]:
    names = ClusterNames(prefix="bench")
    owner = await connect(bridge, nats_url, name="owner", names=names)
    sender = await connect(bridge, nats_url, name="sender", names=names)
    times: list[float] = []
    try:

        async def answer(message: dict[str, Any], _answering: Answering) -> dict[str, Any]:
            return {"result": message.get("params")}

        async with trio.open_nursery() as nursery:
            await nursery.start(SessionRequests(owner).serve, "s1", answer)
            requests = SessionRequests(sender)
            for n in range(count):
                began = trio.current_time()
                await requests.request("s1", {"method": "ping", "params": {"n": n}})
                times.append(trio.current_time() - began)
            nursery.cancel_scope.cancel()
    finally:
        await owner.aclose()
        await sender.aclose()
    return times


async def _gateway_round_trip(tmp: Path, nats_url: str, count: int) -> dict[str, list[float]]:
    """Milliseconds per call through the owner's gateway and through another host's."""
    found: dict[str, list[float]] = {}
    async with open_mock_server(fallback=_text_model) as model, trio.open_nursery() as nursery:
        hosts = [
            await start_host(
                nursery, tmp / "gw", host_id, nats_url=nats_url, model_url=model.base_url,
                effects=tmp / "unused.sock", lease_ttl_s=LEASE_TTL_S,
            )
            for host_id in ("gw-a", "gw-b")
        ]
        try:
            owner, other = hosts
            headers = [(b"Authorization", f"Bearer {owner.token}".encode())]
            async with open_websocket_url(owner.url, extra_headers=headers) as ws:
                ids = [0]
                sid = (await _call(ws, ids, "session.create", {}))["session_id"]
            # Both hosts idle: placed on the lowest id, the owner's own gateway.
            await owner.wait_logged(f"host {owner.host_id} joined")
            for label, host in (("owner", owner), ("non-owner", other)):
                headers = [(b"Authorization", f"Bearer {host.token}".encode())]
                async with open_websocket_url(host.url, extra_headers=headers) as ws:
                    ids = [0]
                    times: list[float] = []
                    for _ in range(count):
                        began = trio.current_time()
                        await _call(ws, ids, "interrupt", {"session_id": sid})
                        times.append((trio.current_time() - began) * 1000)
                    found[label] = times
        finally:
            with trio.CancelScope(shield=True):
                for host in hosts:
                    host.process.kill()
                    await host.process.wait()
            nursery.cancel_scope.cancel()
    return found


async def _cpu_per_task(tmp: Path, nats_url: str, tasks: int) -> dict[str, float]:
    found: dict[str, float] = {}
    async with open_mock_server(fallback=_text_model) as model, trio.open_nursery() as nursery:
        for variant in ("single-host", "--nats"):
            host = await start_host(
                nursery, tmp / f"cpu-{variant.strip('-')}", f"cpu{len(found)}",
                nats_url=nats_url if variant == "--nats" else None, model_url=model.base_url,
                effects=tmp / "unused.sock", lease_ttl_s=LEASE_TTL_S,
            )
            try:
                await _run_tasks(host, min(20, tasks))  # warm up
                before = _cpu_seconds(host.process.pid)
                await _run_tasks(host, tasks)
                found[variant] = (_cpu_seconds(host.process.pid) - before) / tasks * 1000
            finally:
                host.process.kill()
                await host.process.wait()
        nursery.cancel_scope.cancel()
    return found


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--trials", type=int, default=None, help="takeovers of each kind")
    parser.add_argument("--tasks", type=int, default=None, help="tasks for CPU per task")
    args = parser.parse_args()
    trials = args.trials or (2 if args.quick else 7)
    tasks = args.tasks or (50 if args.quick else 300)
    print_machine()
    with tempfile.TemporaryDirectory(prefix="greenroom-bench-cluster-") as tmp_name:
        tmp = Path(tmp_name)
        server = start_nats(tmp / "nats")
        try:

            async def bench(bridge: Bridge) -> dict[str, Any]:
                conn = await connect(bridge, server.url, name="bench")
                try:
                    with trio.fail_after(PHASE_BOUND_S):
                        kill = await _takeover(tmp, server.url, conn, "kill", trials)
                    print(f"takeover after SIGKILL: {kill}", flush=True)
                    with trio.fail_after(PHASE_BOUND_S):
                        stop = await _takeover(tmp, server.url, conn, "stop", trials)
                    print(f"takeover after SIGSTOP: {stop}", flush=True)
                finally:
                    await conn.aclose()
                with trio.fail_after(PHASE_BOUND_S):
                    rtt = await _round_trip(bridge, server.url, 100 if args.quick else 500)
                with trio.fail_after(PHASE_BOUND_S):
                    gateway = await _gateway_round_trip(
                        tmp, server.url, 100 if args.quick else 500
                    )
                with trio.fail_after(PHASE_BOUND_S):
                    cpu = await _cpu_per_task(tmp, server.url, tasks)
                return {"kill": kill, "stop": stop, "rtt": rtt, "gateway": gateway, "cpu": cpu}

            results = run(bench)
            rss = _rss_mib(server.process.pid)
        finally:
            server.stop()
    rows = [
        {"measure": f"takeover after {kind} (s)", "n": len(values),
         "median": statistics.median(values), "p99": p99(values)}
        for kind, values in (("SIGKILL", results["kill"]), ("SIGSTOP", results["stop"]))
    ]
    rtt_ms = [t * 1000 for t in results["rtt"]]
    rows.append({"measure": "owner round trip over NATS (ms)", "n": len(rtt_ms),
                 "median": statistics.median(rtt_ms), "p99": p99(rtt_ms)})
    for label, values in results["gateway"].items():
        rows.append({"measure": f"websocket call through the {label} gateway (ms)",
                     "n": len(values), "median": statistics.median(values),
                     "p99": p99(values)})
    print_table(f"cluster (lease TTL {LEASE_TTL_S:g} s)", rows)
    cpu = results["cpu"]
    print_table(
        "host CPU per task (ms)",
        [{"variant": k, "cpu_ms_per_task": v} for k, v in cpu.items()]
        + [{"variant": "ratio --nats / single", "cpu_ms_per_task":
            cpu["--nats"] / cpu["single-host"]}],
    )
    print(f"\nnats-server resident memory at the end: {rss:.1f} MiB")
    write_json("cluster", {
        "lease_ttl_s": LEASE_TTL_S, "takeover_kill_s": results["kill"],
        "takeover_stop_s": results["stop"], "round_trip_ms": rtt_ms,
        "gateway_round_trip_ms": results["gateway"], "cpu_ms_per_task": cpu,
        "nats_rss_mib": rss, "tasks": tasks,
    })


if __name__ == "__main__":
    sys.exit(main())
