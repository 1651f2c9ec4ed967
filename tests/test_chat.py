"""``greenroom chat`` under a real pseudo-terminal, plus its input router in-process.

Each terminal test starts ``python -m greenroom.actors.cli chat`` on the slave side of a
fresh pty that is the child's controlling terminal (so typing Ctrl-C there sends SIGINT,
as in a real terminal) and talks to it through the master side: it types lines and control
characters and reads the screen until the expected text appears. Every wait is bounded;
the child is killed when a test fails.

The scripted model answers (no API key in the environment). A ``--tools`` file replaces
``list_dir`` by one that blocks until the test creates a ``go`` file in the workspace, so
a task can be held in its tool phase for as long as the test needs: steering, follow-ups
and Ctrl-C then land at a known moment, never by timing luck.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from greenroom.actors.chat import PROMPT, LineRouter
from greenroom.actors.scripted_brain import DEMO_PROMPT

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.mock_model_server import ErrorReply, Reply, Text, open_mock_server  # noqa: E402

WAIT_S = 20.0

# Makes the pty (fd 0) the controlling terminal of the new session, then runs the CLI.
CTTY_SHIM = (
    "import fcntl, os, sys, termios; "
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'greenroom.actors.cli', *sys.argv[1:]])"
)

GATED_TOOLS = '''
import trio
from greenroom.protocols.tools import tool


@tool(parallel=True)
async def list_dir(path: str, ctx) -> str:
    """List a directory (this one waits until a file named "go" is in the workspace)."""
    gate = ctx.workspace_dir / "go"
    while not gate.exists():
        await trio.sleep(0.01)
    gate.unlink()
    return "notes.txt  (5 bytes)"
'''

SUMMARY_COMPLETED = "✓ completed"


class Terminal:
    """A child process on a pseudo-terminal, driven through the master side."""

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
        self._seen = 0
        self._eof = False

    def _read(self, timeout: float) -> None:
        if self._eof:
            time.sleep(min(timeout, 0.05))
            return
        ready, _, _ = select.select([self.master], [], [], max(0.0, timeout))
        if not ready:
            return
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every slave fd is closed (the child exited)
            data = b""
        if not data:
            self._eof = True
        self.screen += data.decode("utf-8", errors="replace")

    def expect(self, pattern: str | re.Pattern[str], timeout: float = WAIT_S) -> re.Match[str]:
        """Wait for ``pattern`` (text or regex) in the output after the last match."""
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(pattern))
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.screen, self._seen)
            if match is not None:
                self._seen = match.end()
                return match
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self._eof and self.process.poll() is not None):
                raise AssertionError(
                    f"no {regex.pattern!r} within {timeout} s; the terminal shows:\n"
                    + self.screen[self._seen - 200 if self._seen > 200 else 0 :]
                )
            self._read(remaining)

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def line(self, text: str) -> None:
        self.type(text + "\r")  # Enter, as a terminal sends it

    def wait_exit(self, timeout: float = WAIT_S) -> int:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("the chat did not exit; the terminal shows:\n" + self.screen)
            self._read(min(remaining, 0.05))
        return self.process.returncode

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=WAIT_S)
        os.close(self.master)


def chat_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")
    }
    env["GREENROOM_HOME"] = str(tmp_path / "home")
    env["NO_COLOR"] = "1"
    env.update(extra)
    return env


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    directory.mkdir()
    return directory


@pytest.fixture
def gated_tools(tmp_path: Path) -> Path:
    path = tmp_path / "gated_tools.py"
    path.write_text(GATED_TOOLS, encoding="utf-8")
    return path


def open_chat(tmp_path: Path, workspace: Path, *args: str, **env: str) -> Terminal:
    return Terminal(
        ["chat", "--data-dir", str(tmp_path / "data"), "--workspace", str(workspace), *args],
        cwd=tmp_path,
        env=chat_env(tmp_path, **env),
    )


@pytest.fixture
def chat(tmp_path: Path, workspace: Path, gated_tools: Path) -> Iterator[Terminal]:
    terminal = open_chat(tmp_path, workspace, "--approve", "all", "--tools", str(gated_tools))
    try:
        terminal.expect(PROMPT)
        yield terminal
    finally:
        terminal.close()


def hold_in_list_dir(chat: Terminal) -> None:
    """Start the sales task; return once the gated list_dir call is running."""
    chat.line(DEMO_PROMPT)
    chat.expect("I'll look at the workspace first.")
    chat.expect("list_dir allowed")


def release(workspace: Path) -> None:
    (workspace / "go").write_text("", encoding="utf-8")


# -- the terminal -------------------------------------------------------------------------


def test_a_prompt_streams_the_reply_then_quit_exits_0(chat: Terminal) -> None:
    chat.line("hello there")
    chat.expect('You asked: "hello there"')
    chat.expect(SUMMARY_COMPLETED)
    chat.expect(PROMPT)
    chat.line("and again")  # same session: the scripted model counts the earlier prompt
    chat.expect("This session already holds 1 earlier prompt.")
    chat.expect(PROMPT)
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_text_typed_while_a_task_runs_steers_it(chat: Terminal, workspace: Path) -> None:
    hold_in_list_dir(chat)
    chat.line("only count the north region")
    chat.expect("[steering queued]")
    release(workspace)
    chat.expect("[steering] only count the north region")
    chat.expect('Noted: "only count the north region".')
    chat.expect("no CSV files")
    chat.expect(SUMMARY_COMPLETED)
    chat.expect(PROMPT)
    chat.type("\x04")  # Ctrl-D at the prompt
    assert chat.wait_exit() == 0


def test_ctrl_c_interrupts_the_task_and_the_prompt_returns(chat: Terminal) -> None:
    hold_in_list_dir(chat)
    chat.type("\x03")
    chat.expect("[interrupting…")
    chat.expect("✗ aborted")
    chat.expect(PROMPT)
    chat.line("are you still there?")  # the REPL goes on, on the same session
    chat.expect('You asked: "are you still there?"')
    chat.expect(SUMMARY_COMPLETED)
    chat.expect(PROMPT)
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_ctrl_c_twice_at_the_prompt_exits(chat: Terminal) -> None:
    chat.type("\x03")
    chat.expect("Ctrl-C again")
    chat.expect(PROMPT)
    chat.type("\x03")
    assert chat.wait_exit() == 0


def test_a_line_between_two_ctrl_c_keeps_the_chat_open(chat: Terminal) -> None:
    chat.type("\x03")
    chat.expect(PROMPT)
    chat.line("")
    chat.expect(PROMPT)
    chat.type("\x03")
    chat.expect("Ctrl-C again")
    chat.expect(PROMPT)
    assert chat.process.poll() is None
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_follow_queues_a_task_after_the_running_one(chat: Terminal, workspace: Path) -> None:
    hold_in_list_dir(chat)
    chat.line("/follow then say goodbye")
    chat.expect("[follow-up queued]")
    release(workspace)
    chat.expect("no CSV files")
    chat.expect(SUMMARY_COMPLETED)
    chat.expect('You asked: "then say goodbye"')
    chat.expect(SUMMARY_COMPLETED)
    chat.expect(PROMPT)
    chat.line("/follow at the prompt it just runs")
    chat.expect('You asked: "at the prompt it just runs"')
    chat.expect(PROMPT)
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_commands_at_the_prompt(chat: Terminal) -> None:
    chat.line("/retry")
    chat.expect("[retry] no task is running")
    chat.expect(PROMPT)
    chat.line("/compact")
    chat.expect(re.compile(r"\[compact\] (nothing to do: the context is empty|compaction is not)"))
    chat.expect(PROMPT)
    chat.line("/bogus")
    chat.expect("unknown command /bogus")
    chat.expect(PROMPT)
    chat.line("/help")
    chat.expect("/follow TEXT")
    chat.expect(PROMPT)
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_compact_after_a_task(chat: Terminal) -> None:
    chat.line("remember the number 42")
    chat.expect(SUMMARY_COMPLETED)
    chat.expect(PROMPT)
    chat.line("/compact")
    chat.expect(re.compile(r"compaction (ok|failed)|compaction is not available"))
    chat.expect(PROMPT)
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_quit_during_a_task_interrupts_it_and_exits_0(chat: Terminal) -> None:
    hold_in_list_dir(chat)
    chat.line("/quit")
    chat.expect("[leaving")
    assert chat.wait_exit() == 0
    assert "aborted" in chat.screen


def test_approval_questions_take_the_next_line(
    tmp_path: Path, workspace: Path, gated_tools: Path
) -> None:
    terminal = open_chat(tmp_path, workspace, "--approve", "ask", "--tools", str(gated_tools))
    try:
        terminal.expect(PROMPT)
        terminal.line(DEMO_PROMPT)
        terminal.expect("Allow list_dir")
        terminal.line("n")  # an answer, not steering
        terminal.expect("list_dir denied")
        terminal.expect("couldn't list the workspace")
        terminal.expect(SUMMARY_COMPLETED)
        terminal.expect(PROMPT)
        assert "[steering queued]" not in terminal.screen
        terminal.line("/quit")
        assert terminal.wait_exit() == 0
    finally:
        terminal.close()


def test_unknown_session_exits_2(tmp_path: Path, workspace: Path) -> None:
    terminal = open_chat(tmp_path, workspace, "--session", "no-such-session")
    try:
        assert terminal.wait_exit() == 2
        assert "no-such-session" in terminal.screen
    finally:
        terminal.close()


async def test_retry_line_counts_down_and_retry_skips_the_wait(
    tmp_path: Path, workspace: Path
) -> None:
    overloaded = ErrorReply.anthropic(
        529, "overloaded_error", "Overloaded", headers={"retry-after": "20"}
    )
    async with open_mock_server(overloaded, Reply([Text("Back online.")])) as server:

        def drive() -> None:
            terminal = open_chat(
                tmp_path, workspace, "--provider", "anthropic", "--base-url", server.base_url,
                "--approve", "none", ANTHROPIC_API_KEY="test-key",
            )  # fmt: skip
            try:
                terminal.expect(PROMPT)
                terminal.line("hi")
                first = terminal.expect(
                    re.compile(r"\[retry\] attempt 2/6 in (\d+\.\d) s — .*Overloaded")
                )
                redraw = re.compile(r"\r\[retry\] attempt 2/6 in (\d+\.\d) s — .*Overloaded")
                # Redrawn in place with a smaller number (expect() bounds the wait).
                while float(terminal.expect(redraw).group(1)) >= float(first.group(1)):
                    pass
                terminal.line("/retry")  # a 20 s wait: the test would time out without it
                terminal.expect("[retry] wait skipped")
                terminal.expect("Back online.")
                terminal.expect(SUMMARY_COMPLETED)
                terminal.expect(PROMPT)
                terminal.line("/quit")
                assert terminal.wait_exit() == 0
            finally:
                terminal.close()

        await trio.to_thread.run_sync(drive)
        assert len(server.requests) == 2


def test_piped_lines_run_one_task_each_then_end_of_input_exits_0(
    tmp_path: Path, workspace: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "greenroom.actors.cli", "chat", "--data-dir",
         str(tmp_path / "data"), "--workspace", str(workspace)],
        input="first task\n/follow second task\n", capture_output=True, text=True,
        cwd=tmp_path, env=chat_env(tmp_path), timeout=WAIT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert 'You asked: "first task".' in result.stdout
    assert 'You asked: "second task". This session already holds 1 earlier prompt.' in (
        result.stdout
    )
    assert result.stderr.count(SUMMARY_COMPLETED) == 2
    assert "[steering queued]" not in result.stderr


# -- the input router ------------------------------------------------------------------------


async def test_router_hands_lines_to_open_questions_in_order() -> None:
    router = LineRouter()
    assert not router.answer("nobody asked")
    answers: dict[str, str | None] = {}

    async def ask(who: str) -> None:
        answers[who] = await router.ask()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "first")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(ask, "second")
        await trio.testing.wait_all_tasks_blocked()
        assert router.waiting
        assert router.answer("y")
        assert router.answer("n")
    assert answers == {"first": "y", "second": "n"}
    assert not router.waiting


async def test_router_forgets_a_cancelled_question_and_answers_none_after_close() -> None:
    router = LineRouter()
    with trio.move_on_after(0.01):
        await router.ask()
    assert not router.waiting
    assert not router.answer("y")
    answers: list[str | None] = []

    async def ask() -> None:
        answers.append(await router.ask())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        router.close()
    assert answers == [None]
    assert await router.ask() is None
