"""Every process a tool starts ends with its call (R-SEC-11).

A ``run_shell`` command leaves behind every kind of process a shell can: a plain ``&``
job, one under ``nohup``, one in a session of its own (``setsid``), and one orphaned at
once by a double fork. Each records its pid and carries a marker unique to the test in
its command line. After the call ends — normally, by interrupt, by timeout, or because
its host was killed with SIGKILL — none of them may be left. In ``sandbox=off`` (the
launcher, a child subreaper, kills them) and under bubblewrap (its PID namespace ends
with the command, and the sandbox with its parent).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type, open_host

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.tools.builtin import ShellTimeoutError, run_shell
from greenroom.actors.tools.sandbox import sandbox_status
from greenroom.protocols.outputs import ToolCallOutput
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.tools import ToolContext

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")

STATUS = sandbox_status()
if not STATUS.available:
    print(f"tool process tests in sandbox=required skipped: {STATUS.reason}")
MODES = [
    "off",
    pytest.param(
        "required", marks=pytest.mark.skipif(not STATUS.available, reason=STATUS.reason)
    ),
]
KINDS = 4  # &, nohup, setsid, double fork


def command_lines() -> Iterator[tuple[int, bytes]]:
    """Each process's id and command line, from ``/proc``; a process gone meanwhile, or a
    zombie (its command line is empty), is left out."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline:
            yield int(name), cmdline


class Leftovers:
    """The processes of one test: ``command`` starts them (each writes its pid to
    ``pids``) and then runs ``then``; :meth:`running` finds those still alive."""

    def __init__(self, workspace: Path) -> None:
        self.marker = f"greenroom-leftover-{uuid.uuid4().hex}"
        self.pids = workspace / "pids"

    def command(self, then: str = "true") -> str:
        # Each records its own pid ($$ of the bash that then becomes sleep) and carries
        # the marker as sleep's argv[0].
        keep = f"bash -c 'echo $$ >> pids; exec -a {self.marker} sleep 1000'"
        return textwrap.dedent(
            f"""\
            : > pids
            {keep} &
            nohup {keep} > /dev/null 2>&1 &
            setsid {keep} &
            ( {keep} & ) &
            while [ "$(wc -l < pids)" -lt {KINDS} ]; do sleep 0.01; done
            echo started
            {then}
            """
        )

    def recorded(self) -> list[int]:
        try:
            return [int(line) for line in self.pids.read_text().split()]
        except FileNotFoundError:
            return []

    def running(self) -> list[int]:
        """Live (not zombie) processes that carry the marker."""
        return [pid for pid, cmdline in command_lines() if self.marker.encode() in cmdline]

    def alive(self, pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return False
        return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"

    async def wait_started(self) -> None:
        await until(lambda: len(self.recorded()) == KINDS)

    async def wait_all_gone(self, off_mode: bool) -> None:
        """Every marked process ends (bounded); in off mode the recorded pids too."""
        await until(
            lambda: not self.running()
            and not (off_mode and any(map(self.alive, self.recorded())))
        )


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` about other processes, bounded: they send no event, so it
    is checked every 10 ms."""
    with trio.fail_after(RUN_TIMEOUT_S):
        while not condition():  # noqa: ASYNC110 (no event to wait for: see above)
            await trio.sleep(0.01)


def context(workspace: Path, tmp_path: Path, mode: str) -> ToolContext:
    return ToolContext(
        call_id="c1",
        workspace_dir=workspace,
        scratchpad_dir=tmp_path / "scratch",
        report_progress=lambda message: None,
        sandbox=mode,  # type: ignore[arg-type]
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "ws"
    path.mkdir()
    return path


@pytest.mark.parametrize("mode", MODES)
async def test_a_normal_end_leaves_no_process(tmp_path: Path, workspace: Path, mode: str) -> None:
    """R-SEC-11: bash exits; everything it left running is killed before the call ends."""
    leftovers = Leftovers(workspace)
    with trio.fail_after(RUN_TIMEOUT_S):
        result = await run_shell.function(
            command=leftovers.command(), ctx=context(workspace, tmp_path, mode)
        )
    assert result == "exit code: 0\nstarted\n"
    assert len(leftovers.recorded()) == KINDS
    await leftovers.wait_all_gone(mode == "off")


@pytest.mark.parametrize("mode", MODES)
async def test_a_timeout_leaves_no_process(tmp_path: Path, workspace: Path, mode: str) -> None:
    """R-SEC-11: on timeout the command and every process it started are killed."""
    leftovers = Leftovers(workspace)
    with trio.fail_after(RUN_TIMEOUT_S), pytest.raises(ShellTimeoutError) as timed_out:
        await run_shell.function(
            command=leftovers.command(then="sleep 1000"),
            timeout_s=3,
            ctx=context(workspace, tmp_path, mode),
        )
    # The processes were there before the kill: the command said so.
    assert "started" in str(timed_out.value)
    await leftovers.wait_all_gone(mode == "off")


@pytest.mark.parametrize("mode", MODES)
async def test_an_interrupt_leaves_no_process(
    tmp_path: Path, workspace: Path, providers: Any, mode: str
) -> None:
    """R-SEC-11, R-ABORT-1: interrupting the task kills what the command started."""
    leftovers = Leftovers(workspace)
    provider = providers(
        [
            Reply(
                blocks=(
                    tool_call("c1", "run_shell", command=leftovers.command(then="sleep 1000")),
                )
            ),
            Reply(blocks=(text("never"),)),
        ]
    )
    async with open_host(tmp_path / "data") as host:
        session = await host.create_session(
            tools=[run_shell],
            provider=provider,
            workspace_dir=workspace,
            settings=SessionSettings(sandbox=mode),  # type: ignore[arg-type]
        )
        async with trio.open_nursery() as nursery:
            outputs: list[Any] = []

            async def run() -> None:
                outputs.extend(await collect(session.run("go", approve=allow_all)))

            nursery.start_soon(run)
            await leftovers.wait_started()
            assert leftovers.running()
            assert session.interrupt() is True
        (output,) = of_type(outputs, ToolCallOutput)
        assert output.status == "interrupted"
    await leftovers.wait_all_gone(mode == "off")


HOST_SCRIPT = """\
import sys

import trio

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.builtin import run_shell


async def main(data_dir, workspace, mode, command):
    async with Host.open(data_dir) as host:
        provider = ScriptedProvider(
            [Reply(blocks=(tool_call("c1", "run_shell", command=command),)),
             Reply(blocks=(text("never"),))]
        )
        session = await host.create_session(
            tools=[run_shell], provider=provider, workspace_dir=workspace, sandbox=mode
        )
        await session.run("go", approve=lambda call: "allow").collect()


trio.run(main, *sys.argv[1:])
"""


@pytest.mark.parametrize("mode", MODES)
async def test_a_host_killed_with_sigkill_leaves_no_process(
    tmp_path: Path, workspace: Path, mode: str
) -> None:
    """R-SEC-11: SIGKILL of the host process (no cleanup code of its runs) still ends
    every process its tool call started."""
    leftovers = Leftovers(workspace)
    script = tmp_path / "host.py"
    script.write_text(HOST_SCRIPT)
    argv = [
        sys.executable,
        str(script),
        str(tmp_path / "data"),
        str(workspace),
        mode,
        leftovers.command(then="sleep 1000"),
    ]
    host = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL)
    try:
        await leftovers.wait_started()
        assert leftovers.running()
        host.send_signal(signal.SIGKILL)
        with trio.fail_after(RUN_TIMEOUT_S):
            await host.wait()
        await leftovers.wait_all_gone(mode == "off")
    finally:
        host.kill()
        await host.wait()


@pytest.mark.parametrize("mode", MODES)
async def test_a_command_outlives_the_thread_that_started_it(
    tmp_path: Path, workspace: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-11 the other way round: a command ends with its call, not before. trio
    starts processes from a worker thread that exits when it has been idle a while
    (10 s); bubblewrap's --die-with-parent follows the thread, not the process, and
    killed sandboxed commands then. The launcher, a process of its own, is bwrap's
    parent instead. Here idle threads exit after 50 ms."""
    import trio._core._thread_cache as thread_cache

    monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.05)
    with trio.fail_after(RUN_TIMEOUT_S):
        result = await run_shell.function(
            command="sleep 1; echo survived", ctx=context(workspace, tmp_path, mode)
        )
    assert result == "exit code: 0\nsurvived\n"


@pytest.mark.skipif(os.environ.get("GREENROOM_MEASURE") is None, reason="a measurement")
async def test_measure_what_the_launcher_adds(tmp_path: Path, workspace: Path) -> None:
    """Not a test: ``GREENROOM_MEASURE=1`` prints the median time of a ``run_shell``
    call (``true``) next to a bare ``bash -c true``."""
    ctx = context(workspace, tmp_path, "off")
    calls, bare = [], []
    for _ in range(40):
        start = time.perf_counter()
        await run_shell.function(command="true", ctx=ctx)
        calls.append(time.perf_counter() - start)
        start = time.perf_counter()
        await trio.run_process(["bash", "-c", "true"])
        bare.append(time.perf_counter() - start)
    calls.sort()
    bare.sort()
    print(f"\nrun_shell(true): {calls[20] * 1000:.1f} ms; bash -c true: {bare[20] * 1000:.1f} ms")


SEARCH_HOST_SCRIPT = """\
import sys
from pathlib import Path

import trio

from greenroom.actors.tools.builtin import search_files
from greenroom.protocols.tools import ToolContext


def progress(message):
    print(message, flush=True)


async def main(workspace):
    ctx = ToolContext(call_id="c1", workspace_dir=Path(workspace),
                      scratchpad_dir=Path(workspace) / ".scratch", report_progress=progress)
    await search_files.function(pattern=r"(a+)+$", ctx=ctx)


trio.run(main, sys.argv[1])
"""


def search_workers_in(directory: Path) -> list[int]:
    """Live search workers whose working directory is ``directory`` (the host's: each
    test's host starts in a directory of its own)."""
    found = []
    for pid, cmdline in command_lines():
        if b"search_worker.py" not in cmdline:
            continue
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(directory):
                found.append(pid)
        except OSError:
            continue  # gone meanwhile
    return found


async def test_a_host_killed_during_a_search_leaves_no_worker(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SEC-11: ``search_files``' worker process ends with its call when the host is
    killed with SIGKILL in the middle of a match that backtracks for ever (it ran on,
    reparented to init, before)."""
    (workspace / "a-first.txt").write_text("aaaa\n")
    (workspace / "b-long.txt").write_text("a" * 60 + "!\n")
    script = tmp_path / "search_host.py"
    script.write_text(SEARCH_HOST_SCRIPT)
    home = (tmp_path / "host-home").resolve()
    home.mkdir()
    host = await trio.lowlevel.open_process(
        [sys.executable, str(script), str(workspace)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        cwd=home,
    )
    try:
        assert host.stdout is not None
        seen = b""
        with trio.fail_after(RUN_TIMEOUT_S):
            # The first file's match is reported: the worker is in the second one's.
            while b"1 match so far" not in seen:
                chunk = await host.stdout.receive_some()
                assert chunk, seen
                seen += chunk
        assert search_workers_in(home)
        host.send_signal(signal.SIGKILL)
        with trio.fail_after(RUN_TIMEOUT_S):
            await host.wait()
        await until(lambda: not search_workers_in(home))
    finally:
        host.kill()
        await host.wait()
        for pid in search_workers_in(home):
            os.kill(pid, signal.SIGKILL)
