"""Ctrl-C and ``greenroom run``: at an approval question on a real terminal, and twice in a
row while a tool ignores the interrupt.

The terminal test runs the CLI on the slave side of a pseudo-terminal that is its
controlling terminal, so typing Ctrl-C (``\\x03``) there sends SIGINT as a real terminal
does. The double-interrupt test uses a ``--tools`` file whose ``list_dir`` reports progress
and then blocks in a worker thread that cannot be cancelled: the first SIGINT cannot end
the task, the second must end the process at once. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.apps.demo import write_demo_workspace  # noqa: E402
from greenroom.actors.providers.scripted import ScriptedProvider  # noqa: E402
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT, make_demo_brain  # noqa: E402
from greenroom.actors.runtime.host import Host  # noqa: E402
from greenroom.protocols.context import ToolResult, UserMessage  # noqa: E402
from greenroom.protocols.wording import INTERRUPTED_APPROVAL  # noqa: E402
from tests.test_cli import CLI, TIMEOUT_S, cli_env, greenroom  # noqa: E402

WAIT_S = 20.0
EXIT_ABORTED = 130

# Makes the pty (fd 0) the controlling terminal of the new session, then runs the CLI.
CTTY_SHIM = (
    "import fcntl, os, sys, termios; "
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'greenroom', *sys.argv[1:]])"
)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    write_demo_workspace(directory)
    return directory


class Terminal:
    """The CLI on a pseudo-terminal, driven through the master side."""

    def __init__(self, args: list[str], *, cwd: Path, env: dict[str, str]) -> None:
        master, slave = os.openpty()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", CTTY_SHIM, *args],
                stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
        finally:
            os.close(slave)
        self.master = master
        self.screen = ""
        self._eof = False

    def expect(self, text: str, timeout: float = WAIT_S) -> None:
        """Wait (bounded) until ``text`` is on the screen."""
        deadline = time.monotonic() + timeout
        while text not in self.screen:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._eof:
                raise AssertionError(f"no {text!r} within {timeout} s; screen:\n{self.screen}")
            ready, _, _ = select.select([self.master], [], [], remaining)
            if not ready:
                continue
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the child closed the terminal (it exited)
                data = b""
            self._eof = not data
            self.screen += data.decode("utf-8", errors="replace")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.master)


def test_ctrl_c_at_an_approval_question_denies_it_and_interrupts_the_task(
    tmp_path: Path, workspace: Path
) -> None:
    data = tmp_path / "data"
    terminal = Terminal(
        ["run", "--approve", "ask", "--workspace", str(workspace), "--data-dir", str(data),
         DEMO_PROMPT],
        cwd=tmp_path, env=cli_env(tmp_path),
    )  # fmt: skip
    try:
        terminal.expect("[a]lways for this session: ")
        terminal.type("\x03")  # Ctrl-C
        terminal.expect("✗ aborted")
        assert terminal.process.wait(timeout=WAIT_S) == EXIT_ABORTED
    finally:
        terminal.close()
    screen = terminal.screen
    question_end = screen.index("[a]lways for this session: ")
    after = screen[question_end:]
    # the question is answered on screen, then the call's decision line says the same
    assert re.match(rf"\[a\]lways for this session: (\^C)?\r?\n{INTERRUPTED_APPROVAL}\r?\n", after)
    assert f"✗ list_dir {INTERRUPTED_APPROVAL}" in after
    assert "no one to ask" not in screen
    assert "read_file" not in after  # the task did not go on
    session_id = re.search(r"session: (\S+)", screen).group(1)  # type: ignore[union-attr]
    trace = data / "sessions" / session_id / "trace_001.jsonl"
    records = [json.loads(line) for line in trace.read_text(encoding="utf-8").splitlines()]
    decisions = [r for r in records if r["type"] == "approval_decision"]
    assert [(d["call_id"], d["decision"]) for d in decisions] == [("call_1_1", "deny")]
    assert [r["type"] for r in records][-2:] == ["abort", "task_end"]
    assert records[-1]["status"] == "aborted"


STUCK_TOOLS = '''
import threading

import trio

from greenroom.protocols.tools import tool


@tool(parallel=True)
async def list_dir(path: str, ctx) -> str:
    """List a directory (this one says so, then blocks where no interrupt reaches it)."""
    ctx.report_progress("blocked")
    await trio.to_thread.run_sync(threading.Event().wait, abandon_on_cancel=False)
    return "never"
'''


def read_until(stream: Any, needle: bytes) -> bytes:
    """Lines from ``stream`` up to and including the first that holds ``needle``."""
    seen = b""
    while True:
        line = stream.readline()
        assert line, f"the stream ended before {needle!r}: {seen!r}"
        seen += line
        if needle in line:
            return seen


def start_stuck_run(tmp_path: Path) -> subprocess.Popen[bytes]:
    """``greenroom run --json`` (data in ``tmp_path/data``) whose ``list_dir`` reports
    progress, then blocks where no cancellation reaches it."""
    tools = tmp_path / "stuck_tools.py"
    tools.write_text(STUCK_TOOLS, encoding="utf-8")
    return subprocess.Popen(
        [*CLI, "run", "--json", "--approve", "all", "--tools", str(tools),
         "--data-dir", str(tmp_path / "data"), DEMO_PROMPT],
        cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def interrupt_stuck_run(
    process: subprocess.Popen[bytes], then: bytes, again: bool
) -> tuple[int, bytes, bytes]:
    """One SIGINT once the tool blocks; once stderr shows ``then``, a second one if
    ``again``. The exit code and all the process printed (stdout, stderr); the process is
    killed if it has not ended."""
    assert process.stdout is not None and process.stderr is not None
    try:
        out = read_until(process.stdout, b'"tool_progress"')  # the tool is blocked now
        process.send_signal(signal.SIGINT)
        err = read_until(process.stderr, then)
        if again:
            process.send_signal(signal.SIGINT)
        code = process.wait(timeout=WAIT_S)
        out += process.stdout.read()
        err += process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return code, out, err


def test_a_second_sigint_exits_at_once_and_leaves_a_loadable_trace(tmp_path: Path) -> None:
    data = tmp_path / "data"
    process = start_stuck_run(tmp_path)
    # The second SIGINT comes while the first one is still being handled.
    code, out, err = interrupt_stuck_run(process, b"interrupting the task", again=True)
    assert code == EXIT_ABORTED, err
    assert b"Traceback" not in err
    for line in out.splitlines():
        json.loads(line)  # stdout holds whole JSON lines only
    session_id = json.loads(out.splitlines()[0])["session_id"]

    trace = data / "sessions" / session_id / "trace_001.jsonl"
    assert trace.read_bytes().endswith(b"\n")
    shown = greenroom(tmp_path, "trace", session_id, "--data-dir", str(data))
    assert shown.returncode == 0, shown.stderr
    assert shown.stderr.splitlines() == [f"trace: {trace}"]  # no corrupt line reported
    assert "approval_decision call_1_1 list_dir allowed by you" in shown.stdout

    # Loading the session pairs the call that never finished (R-TRACE-4, R-TOOL-7).
    provider = ScriptedProvider(make_demo_brain(0))

    async def reload() -> None:
        with trio.fail_after(TIMEOUT_S):
            async with Host.open(data_dir=data) as host:
                session = await host.load_session(session_id, provider=provider)
                assert session.load_errors == []
                await session.run("and now?", approve=lambda call: "allow").collect()

    trio.run(reload)
    assert provider.violations == []
    results = [
        part
        for message in provider.requests[0].messages
        if isinstance(message, UserMessage)
        for part in message.content
        if isinstance(part, ToolResult)
    ]
    assert [(r.call_id, r.status) for r in results] == [("call_1_1", "interrupted")]


# -- Ctrl-C while the command line loads --------------------------------------------------------

GREENROOM_SCRIPT = str(Path(sys.executable).parent / "greenroom")
"""The console script, as a user runs it."""

LOAD_ATTEMPTS = 8

# Starts the command with SIGINT's default action, as a shell on a terminal does: a test
# run that is itself a background job ignores SIGINT, its children inherit that, and the
# command rightly leaves an ignored SIGINT alone (see ``greenroom/__main__.py``).
DEFAULT_SIGINT_SHIM = (
    "import os, signal, sys; "
    "signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _maps_ssl(pid: int) -> bool | None:
    """Whether the process has loaded the ssl extension (None once it is gone). trio
    imports ``ssl`` while the command line loads, and several tenths of a second of imports
    follow it: a SIGINT sent when it appears lands in the middle of loading."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            return any("libssl" in line or "/_ssl." in line for line in maps)
    except (FileNotFoundError, ProcessLookupError):
        return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/PID/maps")
@pytest.mark.parametrize("command", [CLI, [GREENROOM_SCRIPT]], ids=["python -m", "script"])
def test_ctrl_c_while_the_command_line_loads_exits_130_without_a_traceback(
    tmp_path: Path, command: list[str]
) -> None:
    """Ctrl-C in the first moments of ``greenroom run`` (while its modules load, before the
    task handles SIGINT) ends it with exit code 130 and no KeyboardInterrupt traceback.
    Each attempt sends SIGINT as soon as the process is seen loading its modules, so it
    lands there, not after; several attempts cover different points of the loading."""
    outcomes: list[tuple[int, str]] = []
    for attempt in range(LOAD_ATTEMPTS):
        process = subprocess.Popen(
            [sys.executable, "-c", DEFAULT_SIGINT_SHIM,
             *command, "run", "--data-dir", str(tmp_path / "data"), f"hello {attempt}"],
            cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + WAIT_S
            while not (seen := _maps_ssl(process.pid)):
                if seen is None or process.poll() is not None:
                    pytest.skip("this Python loads ssl without a shared library to see")
                assert time.monotonic() < deadline, "the command never loaded ssl"
                time.sleep(0.0005)  # polling /proc: there is no event to wait on
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=WAIT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        outcomes.append((process.returncode, err.decode(errors="replace")))
    for code, err in outcomes:
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert code == EXIT_ABORTED, (code, err)
