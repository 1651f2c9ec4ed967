"""``greenroom serve --workers`` (R-PERF-2): a nats-server given up before it chose a port
leaves nothing running, and ``serve --help`` states the supervisor's limits."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from greenroom.actors.apps.parser import build_parser
from greenroom.actors.cluster import server, workers
from tests.test_workersfix_serve_workers import _wait_gone

BOUND_S = 30.0
"""A guard on the wait for a process to end: it ends at once, or the test fails."""


@contextlib.contextmanager
def _killed_at_the_end(pid_file: Path) -> Iterator[None]:
    try:
        yield
    finally:  # what a failing run leaves behind
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd, /proc: Linux")
def test_a_nats_server_given_up_before_it_chose_a_port_does_not_outlive_its_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in nats-server that says it is ready but never which port it listens on, then
    # hangs: the supervisor gives it up by killing its launcher, which then could not end
    # it; it ran on, holding the JetStream store, after the supervisor had exited.
    pid_file = tmp_path / "nats.pid"
    fake = tmp_path / "nats-server"
    fake.write_text(
        "#!/bin/sh\n"
        f"echo $$ > '{pid_file}'\n"
        'echo "[$$] [INF] Server is ready" >&2\n'
        "exec sleep 3600\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(server, "nats_server_binary", lambda: fake)
    said: list[str] = []
    monkeypatch.setattr(workers, "say", said.append)
    config = workers.WorkersConfig(
        workers=1, argv=(), host="127.0.0.1", port=0, data_dir=tmp_path / "data", nats=None,
        token_file=None, tokens_file=None, console_port=None, lease_ttl_s=2.0,
    )  # fmt: skip

    async def scenario() -> int:
        code = await workers.serve_workers(config)
        with trio.fail_after(BOUND_S):  # a guard: the server is killed before the return
            await _wait_gone([int(pid_file.read_text())])
        return code

    with _killed_at_the_end(pid_file):
        assert trio.run(scenario) == 2
    assert said == ["nats-server did not start"]


def test_serve_help_states_the_worker_cap_and_when_a_crashing_worker_is_given_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The supervisor's two limits were in its code only: --workers past 4 per core is
    # refused, and a worker that keeps failing is not started again after 5 restarts in a
    # row; an operator reading `serve --help` learned neither.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    words = " ".join(capsys.readouterr().out.split())
    assert f"at most {workers.WORKERS_PER_CORE} per core" in words
    assert f"after {workers.RESTART_LIMIT} restarts in a row" in words
