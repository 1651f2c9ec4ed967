"""``greenroom chat`` under a real pseudo-terminal, plus its input router in-process.

Each terminal test starts ``python -m greenroom chat`` on the slave side of a
fresh pty that is the child's controlling terminal (so typing Ctrl-C there sends SIGINT,
as in a real terminal) and talks to it through the master side: it types lines and control
characters and reads the screen until the expected text appears. The bytes also feed a
small model of a terminal (:class:`Screen`), which answers cursor position requests as a
real one does and tells which line holds what: that is how the tests see that output is
printed above the input line and never into it. Every wait is bounded; the child is
killed when a test fails.

The scripted model answers (no API key in the environment). A ``--tools`` file replaces
``list_dir`` by one that blocks until the test creates a ``go`` file in the workspace, so
a task can be held in its tool phase for as long as the test needs: steering, follow-ups
and Ctrl-C then land at a known moment, never by timing luck. Where keys must all reach the
chat before the task can react to the first (Ctrl-C twice), list_dir holds the chat's trio
thread itself while they are typed (:class:`TrioThreadHold`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from greenroom.actors.apps.chat import (
    APPROVAL_HINT,
    PROMPT,
    STEERED_AT_QUESTION,
    WORKING_PROMPT,
    LineRouter,
)
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT
from greenroom.protocols.wording import INTERRUPTED_APPROVAL, decision_words

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.mock_model_server import (  # noqa: E402
    ErrorReply,
    Paused,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)
from tests.test_cli import TABLE_ANSWER, TABLE_SHOWN  # noqa: E402

WAIT_S = 20.0

# Makes the pty (fd 0) the controlling terminal of the new session, then runs the CLI.
CTTY_SHIM = (
    "import fcntl, os, sys, termios; "
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'greenroom', *sys.argv[1:]])"
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

# read_file for two CSV files: it waits for a "go" file, then reports progress and answers.
NOISY_READ_TOOLS = '''
import trio
from greenroom.protocols.tools import tool


@tool(parallel=True)
async def read_file(path: str, ctx) -> str:
    """Read a file (this one waits until a file named "go" is in the workspace)."""
    gate = ctx.workspace_dir / "go"
    while not gate.exists():
        await trio.sleep(0.01)
    ctx.report_progress(f"reading {path}")
    return "     1\\tregion,units,unit_price\\n     2\\tnorth,2,3"
'''

# list_dir that holds the chat's trio thread itself (a blocking read, no await) until the
# test lets it go. Keys typed meanwhile are handed over by the screen's thread and wait
# for the trio side, which then takes them all before the task can move on: what they do
# cannot depend on how the two threads are scheduled. Then it waits on, either honouring
# the interrupt or ignoring it (a worker thread that no cancellation reaches).
HOLDING_TOOLS = '''
import os
import threading

import trio
from greenroom.protocols.tools import tool


@tool(parallel=True)
async def list_dir(path: str, ctx) -> str:
    """List a directory (this one holds the chat until the test lets it go)."""
    gate = os.open({gate!r}, os.O_RDONLY)
    with open({ready!r}, "wb") as ready:
        ready.write(b"held")
    os.read(gate, 1)  # until the test closes its end: the trio thread waits here
    os.close(gate)
    {then}
    return "notes.txt  (5 bytes)"
'''

HOLDING_TOOLS_THEN = {
    "honours-the-interrupt": "await trio.sleep_forever()",
    "ignores-the-interrupt": (
        "await trio.to_thread.run_sync(threading.Event().wait, abandon_on_cancel=False)"
    ),
}

SUMMARY_COMPLETED = "✓ completed"


class Screen:
    """What a terminal of ``rows`` x ``columns`` shows after the bytes fed to it: enough of
    a VT100 for prompt_toolkit's renderer and plain output (cursor moves, erasing, line
    wrap, scrolling; colours and modes are ignored). Scrolled-off lines are kept above.
    ``replies`` collects what the terminal answers (cursor position reports)."""

    _CSI = re.compile(r"\x1b\[([0-?]*)([ -/]*)([@-~])")
    _OSC = re.compile(r"\x1b\][^\x07\x1b]*(\x07|\x1b\\)")

    def __init__(self, rows: int, columns: int) -> None:
        self.rows = rows
        self.columns = columns
        self.lines: list[list[str]] = [[]]
        self.top = 0  # the first line on the screen
        self.y = 0  # absolute line of the cursor
        self.x = 0
        self.autowrap = True
        self.replies = ""
        self._pending = ""

    def feed(self, text: str) -> None:
        text = self._pending + text
        self._pending = ""
        i = 0
        while i < len(text):
            char = text[i]
            if char == "\x1b":
                if i + 1 >= len(text):
                    self._pending = text[i:]
                    return
                if text[i + 1] == "[":
                    match = self._CSI.match(text, i)
                    if match is None:
                        if re.fullmatch(r"\x1b\[[0-?]*[ -/]*", text[i:]):
                            self._pending = text[i:]
                            return
                        i += 2
                        continue
                    self._csi(match.group(1), match.group(3))
                    i = match.end()
                elif text[i + 1] == "]":
                    match = self._OSC.match(text, i)
                    if match is None:
                        self._pending = text[i:]
                        return
                    i = match.end()
                else:
                    i += 2  # ESC = , ESC > and the like
                continue
            if char == "\r":
                self.x = 0
            elif char == "\n":
                self._line_feed()
            elif char == "\b":
                self.x = max(0, self.x - 1)
            elif char == "\t":
                self.x = min(self.columns - 1, (self.x // 8 + 1) * 8)
            elif char >= " ":
                self._put(char)
            i += 1

    def _put(self, char: str) -> None:
        if self.x >= self.columns:
            if self.autowrap:
                self.x = 0
                self._line_feed()
            else:
                self.x = self.columns - 1
        line = self.lines[self.y]
        if len(line) <= self.x:
            line.extend(" " * (self.x - len(line) + 1))
        line[self.x] = char
        self.x += 1

    def _line_feed(self) -> None:
        self.y += 1
        if self.y >= len(self.lines):
            self.lines.append([])
        if self.y >= self.top + self.rows:
            self.top = self.y - self.rows + 1

    def _csi(self, params: str, final: str) -> None:
        private = params.startswith("?")
        numbers = [int(p) if p.isdigit() else 0 for p in params.lstrip("?").split(";")]
        n = numbers[0] or 1
        if private:
            if numbers[0] == 7 and final in "hl":
                self.autowrap = final == "h"
            return
        if final == "A":
            self.y = max(self.top, self.y - n)
        elif final == "B":
            self.y = min(self.top + self.rows - 1, self.y + n)
            while len(self.lines) <= self.y:
                self.lines.append([])
        elif final == "C":
            self.x = min(self.columns - 1, self.x + n)
        elif final == "D":
            self.x = max(0, self.x - n)
        elif final == "G":
            self.x = min(self.columns - 1, n - 1)
        elif final in "Hf":
            row = numbers[0] or 1
            column = numbers[1] if len(numbers) > 1 and numbers[1] else 1
            self.y = self.top + min(self.rows, row) - 1
            while len(self.lines) <= self.y:
                self.lines.append([])
            self.x = min(self.columns, column) - 1
        elif final == "J":
            if numbers[0] == 0:
                del self.lines[self.y][self.x :]
                del self.lines[self.y + 1 :]
            elif numbers[0] == 2:
                for y in range(self.top, len(self.lines)):
                    self.lines[y] = []
        elif final == "K":
            line = self.lines[self.y]
            if numbers[0] == 0:
                del line[self.x :]
            elif numbers[0] == 1:
                line[: self.x + 1] = " " * min(len(line), self.x + 1)
            else:
                line.clear()
        elif final == "n" and numbers[0] == 6:
            self.replies += f"\x1b[{self.y - self.top + 1};{self.x + 1}R"

    def line(self, y: int) -> str:
        return "".join(self.lines[y]).rstrip() if y < len(self.lines) else ""

    @property
    def cursor_line(self) -> str:
        """The line the cursor is on: the input line of a prompt."""
        return self.line(self.y)

    def text(self) -> str:
        """Every line, the scrolled-off ones included."""
        return "\n".join(self.line(y) for y in range(len(self.lines)))


class Terminal:
    """A child process on a pseudo-terminal, driven through the master side.

    :meth:`expect` reads the raw output (what was written, escape sequences and all);
    :attr:`display` is what a terminal would show, for the questions of layout (which
    line holds what) and for text that prompt_toolkit redraws in place. Like a real
    terminal it answers cursor position requests."""

    ROWS = 40
    COLUMNS = 200  # wide enough that no test line wraps

    def __init__(
        self, args: list[str], *, cwd: Path, env: dict[str, str], keep_slave: bool = False
    ) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", self.ROWS, self.COLUMNS, 0, 0))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", CTTY_SHIM, *args],
                stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
        finally:
            if not keep_slave:
                os.close(slave)
        # Kept open, the slave side lets a test read the terminal's mode after the child's
        # exit (the master then sees no end of file: waits end on the exit status instead).
        self.slave = slave if keep_slave else None
        self.master = master
        self.screen = ""
        self.display = Screen(self.ROWS, self.COLUMNS)
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
        text = data.decode("utf-8", errors="replace")
        self.screen += text
        self.display.feed(text)
        if self.display.replies:
            replies, self.display.replies = self.display.replies, ""
            with contextlib.suppress(OSError):
                os.write(self.master, replies.encode())

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

    def wait_display(
        self, check: Callable[[Screen], bool], what: str, timeout: float = WAIT_S
    ) -> Screen:
        """Wait until what the terminal shows passes ``check``."""
        deadline = time.monotonic() + timeout
        while not check(self.display):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self._eof and self.process.poll() is not None):
                raise AssertionError(
                    f"the terminal never showed {what}; it shows:\n{self.display.text()[-3000:]}"
                )
            self._read(min(remaining, 0.05))
        return self.display

    def expect_prompt(self, label: str = PROMPT, typed: str = "") -> None:
        """Wait until the input line is ``label`` followed by ``typed``."""
        self.wait_display(
            lambda d: d.cursor_line == (label + typed).rstrip(), f"the prompt {label!r}"
        )

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
        # The last words (a resume hint, an error) may still be unread: with no slave side
        # left open here, the end of file comes after them. A kept one never ends: expect().
        while self.slave is None and not self._eof and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())
        return self.process.returncode

    def lflag(self) -> int:
        """The terminal's local modes now (ECHO, ICANON, …)."""
        assert self.slave is not None
        return int(termios.tcgetattr(self.slave)[3])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=WAIT_S)
        os.close(self.master)
        if self.slave is not None:
            os.close(self.slave)


class TrioThreadHold:
    """The test's side of :data:`HOLDING_TOOLS`: a ``tools`` file whose list_dir holds the
    chat's trio thread, and the two FIFOs it talks through. The test keeps a reader and a
    writer of ``ready`` and a writer of ``gate`` open from the start, so none of the tool's
    opens waits and ``ready`` has no end of file before the tool writes to it."""

    def __init__(self, directory: Path, then: str) -> None:
        gate, ready = directory / "gate", directory / "ready"
        os.mkfifo(gate)
        os.mkfifo(ready)
        self.tools = directory / "holding_tools.py"
        self.tools.write_text(
            HOLDING_TOOLS.format(gate=str(gate), ready=str(ready), then=HOLDING_TOOLS_THEN[then]),
            encoding="utf-8",
        )
        self._fds: list[int] = []
        self._ready = self._open(ready, os.O_RDONLY | os.O_NONBLOCK)
        self._open(ready, os.O_WRONLY)
        gate_reader = os.open(gate, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer open
        self._gate = self._open(gate, os.O_WRONLY)
        os.close(gate_reader)

    def _open(self, path: Path, flags: int) -> int:
        fd = os.open(path, flags)
        self._fds.append(fd)
        return fd

    def wait_held(self, timeout: float = WAIT_S) -> None:
        """Wait until the tool holds the trio thread."""
        ready, _, _ = select.select([self._ready], [], [], timeout)
        assert ready, f"the tool did not start within {timeout} s"
        assert os.read(self._ready, 16) == b"held"

    def release(self) -> None:
        """Let the tool go on (its read meets the end of file)."""
        self._fds.remove(self._gate)
        os.close(self._gate)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


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


def open_chat(
    tmp_path: Path, workspace: Path, *args: str, keep_slave: bool = False, **env: str
) -> Terminal:
    return Terminal(
        ["chat", "--data-dir", str(tmp_path / "data"), "--workspace", str(workspace), *args],
        cwd=tmp_path,
        env=chat_env(tmp_path, **env),
        keep_slave=keep_slave,
    )


@pytest.fixture
def chat(tmp_path: Path, workspace: Path, gated_tools: Path) -> Iterator[Terminal]:
    terminal = open_chat(tmp_path, workspace, "--approve", "all", "--tools", str(gated_tools))
    try:
        terminal.expect_prompt()
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
    chat.expect_prompt()
    chat.line("and again")  # same session: the scripted model counts the earlier prompt
    chat.expect("This session already holds 1 earlier prompt.")
    chat.expect_prompt()
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
    chat.expect_prompt()
    chat.type("\x04")  # Ctrl-D at the prompt
    assert chat.wait_exit() == 0


def test_ctrl_c_interrupts_the_task_and_the_prompt_returns(chat: Terminal) -> None:
    hold_in_list_dir(chat)
    chat.type("\x03")
    chat.expect("[interrupting…")
    chat.expect("✗ aborted")
    chat.expect_prompt()
    chat.line("are you still there?")  # the REPL goes on, on the same session
    chat.expect('You asked: "are you still there?"')
    chat.expect(SUMMARY_COMPLETED)
    chat.expect_prompt()
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_ctrl_c_twice_at_the_prompt_exits(chat: Terminal) -> None:
    chat.type("\x03")
    chat.expect("Ctrl-C again")
    chat.expect_prompt()
    chat.type("\x03")
    assert chat.wait_exit() == 0


def test_a_line_between_two_ctrl_c_keeps_the_chat_open(chat: Terminal) -> None:
    chat.type("\x03")
    chat.expect_prompt()
    chat.expect("Ctrl-C again")
    chat.line("")
    chat.expect_prompt()
    chat.type("\x03")
    chat.expect("Ctrl-C again")  # said again: this Ctrl-C is a first one, not a second
    chat.expect_prompt()
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
    chat.expect_prompt()
    chat.line("/follow at the prompt it just runs")
    chat.expect('You asked: "at the prompt it just runs"')
    chat.expect_prompt()
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_commands_at_the_prompt(chat: Terminal) -> None:
    chat.line("/retry")
    chat.expect("[retry] no task is running")
    chat.expect_prompt()
    chat.line("/compact")
    chat.expect(re.compile(r"\[compact\] (nothing to do: the context is empty|compaction is not)"))
    chat.expect_prompt()
    chat.line("/bogus")
    chat.expect("unknown command /bogus")
    chat.expect_prompt()
    chat.line("/help")
    chat.expect("/follow TEXT")
    chat.expect_prompt()
    chat.line("/quit")
    assert chat.wait_exit() == 0


def test_compact_after_a_task(chat: Terminal) -> None:
    chat.line("remember the number 42")
    chat.expect(SUMMARY_COMPLETED)
    chat.expect_prompt()
    chat.line("/compact")
    chat.expect(re.compile(r"compaction (ok|failed)|compaction is not available"))
    chat.expect_prompt()
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
        terminal.expect_prompt()
        terminal.line(DEMO_PROMPT)
        terminal.expect("Allow list_dir")
        terminal.line("n")  # an answer, not steering
        terminal.expect("list_dir denied by you")
        terminal.expect("couldn't list the workspace")
        terminal.expect(SUMMARY_COMPLETED)
        terminal.expect_prompt()
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
                terminal.expect_prompt()
                terminal.line("hi")
                countdown = re.compile(r"\[retry\] attempt 2/6 in (\d+\.\d) s — .*Overloaded")

                def seconds_left(display: Screen) -> float | None:
                    match = countdown.search(display.text())
                    return None if match is None else float(match.group(1))

                terminal.wait_display(lambda d: seconds_left(d) is not None, "the retry line")
                first = seconds_left(terminal.display)
                assert first is not None
                # Redrawn in place (one line, not one per tick) with a smaller number.
                terminal.wait_display(
                    lambda d: (left := seconds_left(d)) is not None and left < first,
                    "the countdown going down",
                )
                assert len(countdown.findall(terminal.display.text())) == 1
                terminal.line("/retry")  # a 20 s wait: the test would time out without it
                terminal.expect("[retry] wait skipped")
                terminal.expect("Back online.")
                terminal.expect(SUMMARY_COMPLETED)
                terminal.expect_prompt()
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
        [sys.executable, "-m", "greenroom", "chat", "--data-dir",
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


# -- the screen: output above, the input line below -------------------------------------------


def lines_but_the_input_line(display: Screen) -> list[str]:
    return [display.line(y) for y in range(len(display.lines)) if y != display.y]


def test_keys_typed_while_output_arrives_stay_on_the_input_line(
    chat: Terminal, workspace: Path
) -> None:
    hold_in_list_dir(chat)
    chat.type("only the north")  # no Enter: half a line of steering, typed mid-task
    chat.wait_display(lambda d: "only the north" in d.text(), "the typed text")
    release(workspace)  # the tool's result prints, then the model streams its answer
    chat.expect("no CSV files")
    chat.expect(SUMMARY_COMPLETED)
    chat.wait_display(lambda d: SUMMARY_COMPLETED in d.text(), "the summary")
    shown = lines_but_the_input_line(chat.display)
    assert not [line for line in shown if "only the north" in line], shown
    assert [line for line in shown if line.startswith("  ◂ list_dir ok")], shown
    assert [line for line in shown if line.startswith("The workspace has no CSV files")], shown
    chat.expect_prompt(PROMPT, "only the north")  # still on the input line, still unsent
    chat.type("\r")  # the typed line is a prompt now: it starts the next task
    chat.expect('You asked: "only the north"')
    chat.expect(SUMMARY_COMPLETED)
    chat.expect_prompt()
    chat.line("/quit")
    assert chat.wait_exit() == 0


async def test_a_steer_sent_while_the_model_writes_a_line_goes_above_that_line(
    tmp_path: Path, workspace: Path
) -> None:
    """R-STEER-1: a steer submitted in the middle of the model's line starts on a line of its
    own, above the unfinished line, and the model's line goes on whole after it."""
    sentence = "The regions differ a lot, and the north sells the most widgets of all."
    head = ["The regions ", "differ a lot, "]
    resume = trio.Event()
    held = Paused(
        Reply([Text(sentence, chunks=[*head, sentence.removeprefix("".join(head))])]),
        after_events=4,  # message_start, content_block_start and the first two deltas
        resume=resume,
    )
    async with open_mock_server(held, Reply([Text("Only the north, then.")])) as server:

        def drive() -> None:
            terminal = open_chat(
                tmp_path, workspace, "--provider", "anthropic", "--base-url", server.base_url,
                "--approve", "none", ANTHROPIC_API_KEY="test-key",
            )  # fmt: skip
            try:
                terminal.expect_prompt()
                terminal.line("compare the regions")
                terminal.wait_display(
                    lambda d: "The regions differ a lot," in d.text(), "the first words"
                )
                terminal.line("only the north")  # Enter while the line is unfinished
                terminal.expect("[steering queued]")
                terminal.wait_display(lambda d: "[steering queued]" in d.text(), "the notice")
                shown = lines_but_the_input_line(terminal.display)
                typed = [line for line in shown if "only the north" in line]
                assert typed == [WORKING_PROMPT + "only the north"], shown
                assert not [line for line in shown if "queued" in line and "The" in line], shown
                trio.from_thread.run_sync(resume.set)
                terminal.expect("Only the north, then.")
                terminal.expect(SUMMARY_COMPLETED)
                terminal.wait_display(lambda d: SUMMARY_COMPLETED in d.text(), "the summary")
                shown = lines_but_the_input_line(terminal.display)
                assert sentence in shown, shown  # one line, whole
                assert shown.index(typed[0]) < shown.index(sentence), shown
                assert [line for line in shown if line == "[steering] only the north"], shown
                terminal.line("/quit")
                assert terminal.wait_exit() == 0
            finally:
                terminal.close()

        await trio.to_thread.run_sync(drive)
        assert len(server.requests) == 2


async def test_a_markdown_table_is_shown_aligned_once_it_is_whole(
    tmp_path: Path, workspace: Path
) -> None:
    """The chat shows a streamed Markdown table with its columns aligned: the words before
    it stream as usual, its rows wait until the table is whole."""
    first = "Revenue per region:\n\n| Region | Units | Revenue |\n|:---|"
    assert TABLE_ANSWER.startswith(first)
    resume = trio.Event()
    held = Paused(
        Reply([Text(TABLE_ANSWER, chunks=[first, TABLE_ANSWER.removeprefix(first)])]),
        after_events=3,  # message_start, content_block_start, the first delta
        resume=resume,
    )
    async with open_mock_server(held) as server:

        def drive() -> None:
            terminal = open_chat(
                tmp_path, workspace, "--provider", "anthropic", "--base-url", server.base_url,
                "--approve", "none", "--no-builtin-tools", ANTHROPIC_API_KEY="test-key",
            )  # fmt: skip
            try:
                terminal.expect_prompt()
                terminal.line("the revenue, please")
                terminal.wait_display(lambda d: "Revenue per region:" in d.text(), "the words")
                # The same delta carried the table's first lines: held, not shown raw.
                assert "Region" not in terminal.display.text().replace("Revenue per region", "")
                trio.from_thread.run_sync(resume.set)
                terminal.expect(SUMMARY_COMPLETED)
                terminal.wait_display(lambda d: SUMMARY_COMPLETED in d.text(), "the summary")
                shown = lines_but_the_input_line(terminal.display)
                start = shown.index(TABLE_SHOWN[0])
                assert shown[start : start + len(TABLE_SHOWN)] == TABLE_SHOWN, shown
                assert "| neither | is this |" in shown
                terminal.line("/quit")
                assert terminal.wait_exit() == 0
            finally:
                terminal.close()

        await trio.to_thread.run_sync(drive)


def test_leaving_gives_the_terminal_back_in_its_usual_mode(
    tmp_path: Path, workspace: Path, gated_tools: Path
) -> None:
    terminal = open_chat(
        tmp_path, workspace, "--approve", "all", "--tools", str(gated_tools), keep_slave=True
    )
    try:
        terminal.expect_prompt()
        usual = termios.ECHO | termios.ICANON | termios.ISIG
        assert terminal.lflag() & usual == 0  # raw while the chat runs: it echoes keys itself
        hold_in_list_dir(terminal)
        terminal.line("/quit")  # leaving mid-task, with a tool still running
        assert terminal.wait_exit() == 0
        assert terminal.lflag() & usual == usual
    finally:
        terminal.close()


@pytest.mark.parametrize("tool", sorted(HOLDING_TOOLS_THEN))
def test_ctrl_c_twice_during_a_task_leaves_at_once_and_gives_the_terminal_back(
    tool: str, tmp_path: Path, workspace: Path
) -> None:
    """R-SEC-2: a second Ctrl-C while the task is being interrupted leaves at once (exit
    130), also when its tool ignores the interrupt, and gives the terminal back in its
    usual mode. Both keys are typed while the tool holds the chat's trio thread, so both
    reach the chat before the interrupt can end the task, however loaded the machine."""
    hold = TrioThreadHold(tmp_path, tool)
    terminal = open_chat(
        tmp_path, workspace, "--approve", "all", "--tools", str(hold.tools), keep_slave=True
    )
    try:
        session_id = terminal.expect(re.compile(r"session: (\S+)")).group(1)
        terminal.expect_prompt()
        terminal.line(DEMO_PROMPT)
        hold.wait_held()
        terminal.type("\x03\x03x")
        # The screen's thread takes keys in order: once it shows the x, it has handed both
        # Ctrl-C to the trio side.
        terminal.expect_prompt(WORKING_PROMPT, "x")
        hold.release()
        assert terminal.wait_exit() == 130
        usual = termios.ECHO | termios.ICANON | termios.ISIG
        assert terminal.lflag() & usual == usual
        terminal.expect(f"to resume: greenroom chat --session {session_id}")
    finally:
        terminal.close()
        hold.close()
    trace = tmp_path / "data" / "sessions" / session_id / "trace_001.jsonl"
    text = trace.read_text(encoding="utf-8")
    assert text.endswith("\n")
    for line in text.splitlines():
        json.loads(line)  # whole records only: the trace stays loadable


def test_an_open_approval_question_stays_whole_below_output_hints_and_denies_on_ctrl_c(
    tmp_path: Path, workspace: Path
) -> None:
    for name in ("a.csv", "b.csv"):
        (workspace / name).write_text("region,units,unit_price\nnorth,2,3\n", encoding="utf-8")
    tools = tmp_path / "noisy_read.py"
    tools.write_text(NOISY_READ_TOOLS, encoding="utf-8")
    terminal = open_chat(tmp_path, workspace, "--approve", "ask", "--tools", str(tools))
    question_b = 'Allow read_file {"path": "b.csv"}? [y]es / [n]o / [a]lways for this session:'
    try:
        terminal.expect_prompt()
        terminal.line(DEMO_PROMPT)
        terminal.expect("Allow list_dir")
        terminal.line("y")
        terminal.expect("list_dir allowed")
        terminal.expect('Allow read_file {"path": "a.csv"}')
        terminal.line("y")  # a.csv runs (and waits); the question for b.csv opens
        terminal.expect_prompt(question_b + " ")
        release(workspace)  # a.csv reports progress and ends while b.csv's question is open
        terminal.expect("read_file: reading a.csv")
        terminal.expect("◂ read_file ok")
        terminal.wait_display(lambda d: "◂ read_file ok" in d.text(), "the tool's result")
        shown = lines_but_the_input_line(terminal.display)
        assert [line for line in shown if line.startswith("  … read_file: reading a.csv")], shown
        assert not [line for line in shown if "Allow read_file" in line and "b.csv" in line], shown
        terminal.expect_prompt(question_b + " ")

        terminal.type("maybe later")  # not an answer: a hint, and the same question again
        terminal.expect_prompt(question_b + " ", "maybe later")
        terminal.type("\r")
        terminal.expect(APPROVAL_HINT)
        terminal.expect_prompt(question_b + " ")
        shown = lines_but_the_input_line(terminal.display)
        assert shown.count(APPROVAL_HINT) == 1, shown
        assert "[steering queued]" not in terminal.screen

        terminal.type("\x03")  # Ctrl-C at the question denies this call, not the task
        terminal.expect(f"read_file {INTERRUPTED_APPROVAL}")
        terminal.expect(SUMMARY_COMPLETED)
        terminal.expect_prompt()
        assert "aborted" not in terminal.screen
        assert f"list_dir {decision_words('allow', 'host')}" in terminal.display.text()
        terminal.line("/quit")
        assert terminal.wait_exit() == 0
    finally:
        terminal.close()


def test_a_steer_typed_at_an_open_approval_question_is_queued_and_the_question_stays(
    tmp_path: Path, workspace: Path
) -> None:
    """R-STEER-1, R-APPROVE-1: a line that is not an answer, typed while a question is open,
    is steering: it is queued (and the user is told so), never thrown away, and the
    question stays open for its answer."""
    terminal = open_chat(tmp_path, workspace, "--approve", "ask")
    question = 'Allow list_dir {"path": "."}? [y]es / [n]o / [a]lways for this session:'
    try:
        terminal.expect_prompt()
        terminal.line(DEMO_PROMPT)
        terminal.expect_prompt(question + " ")
        terminal.line("only the north region, please")
        terminal.expect(STEERED_AT_QUESTION)
        terminal.expect(APPROVAL_HINT)
        terminal.expect_prompt(question + " ")  # still open, still this call's
        terminal.line("y")
        terminal.expect(f"list_dir {decision_words('allow', 'host')}")
        terminal.expect("[steering] only the north region, please")
        terminal.expect(SUMMARY_COMPLETED)
        terminal.expect_prompt()
        steered = [line for line in terminal.display.text().splitlines()
                   if line == "[steering] only the north region, please"]  # fmt: skip
        assert len(steered) == 1, terminal.display.text()
        terminal.line("/quit")
        assert terminal.wait_exit() == 0
    finally:
        terminal.close()


def test_always_allows_the_tool_for_the_rest_of_the_session(
    tmp_path: Path, workspace: Path
) -> None:
    terminal = open_chat(tmp_path, workspace, "--approve", "ask")
    try:
        terminal.expect_prompt()
        terminal.line(DEMO_PROMPT)
        terminal.expect("Allow list_dir")
        terminal.line("a")
        terminal.expect(f"list_dir {decision_words('allow', 'host')}")
        terminal.expect(SUMMARY_COMPLETED)
        terminal.expect_prompt()
        terminal.line(DEMO_PROMPT)  # asked no more: the session's rule answers
        terminal.expect(f"list_dir {decision_words('allow', 'session_rule')}")
        terminal.expect(SUMMARY_COMPLETED)
        terminal.expect_prompt()
        asked = [line for line in terminal.display.text().splitlines() if "Allow list_dir" in line]
        assert len(asked) == 1, asked
        terminal.type("\x04")
        assert terminal.wait_exit() == 0
    finally:
        terminal.close()


def test_quit_and_ctrl_d_say_how_to_resume(tmp_path: Path, workspace: Path) -> None:
    first = open_chat(tmp_path, workspace)
    try:
        session_id = first.expect(re.compile(r"session: (\S+)")).group(1)
        first.expect_prompt()
        first.line("/quit")
        first.expect(f"to resume: greenroom chat --session {session_id} --data-dir")
        assert first.wait_exit() == 0
    finally:
        first.close()
    second = open_chat(tmp_path, workspace, "--session", session_id)
    try:
        second.expect_prompt()
        second.type("\x04")  # Ctrl-D
        second.expect(f"to resume: greenroom chat --session {session_id} --data-dir")
        assert second.wait_exit() == 0
    finally:
        second.close()


def test_resuming_recaps_the_last_exchange(tmp_path: Path, workspace: Path) -> None:
    long_prompt = "remember the number 42 " + "then keep going " * 12 + "THE END"
    first = open_chat(tmp_path, workspace)
    try:
        session_id = first.expect(re.compile(r"session: (\S+)")).group(1)
        first.expect_prompt()
        first.line(long_prompt)
        first.expect(SUMMARY_COMPLETED)
        first.expect_prompt()
        first.line("/quit")
        assert first.wait_exit() == 0
    finally:
        first.close()

    second = open_chat(tmp_path, workspace, "--session", session_id)
    try:
        second.expect("last exchange:")
        recap_you = second.expect(re.compile(r"you: (remember the number 42 [^\r\n]*)"))
        recap_model = second.expect(re.compile(r"model: (You asked: [^\r\n]*)"))
        second.expect_prompt()
        for recap in (recap_you.group(1), recap_model.group(1)):
            assert recap.endswith("…") and len(recap) <= 160, recap  # clipped to one line
        assert "THE END" not in recap_you.group(1)
        second.line("/quit")
        assert second.wait_exit() == 0
    finally:
        second.close()


def run_piped_chat(tmp_path: Path, workspace: Path, text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "greenroom", "chat", "--data-dir",
         str(tmp_path / "data"), "--workspace", str(workspace), "--approve", "ask"],
        input=text, capture_output=True, text=True, cwd=tmp_path, env=chat_env(tmp_path),
        timeout=WAIT_S,
    )  # fmt: skip


def test_piped_approval_answers_get_the_hint_and_the_same_words(
    tmp_path: Path, workspace: Path
) -> None:
    result = run_piped_chat(tmp_path, workspace, f"{DEMO_PROMPT}\nmaybe\nn\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("Allow list_dir") == 2, result.stderr  # asked again
    assert APPROVAL_HINT in result.stderr
    assert f"list_dir {decision_words('deny', 'host')}" in result.stdout

    result = run_piped_chat(tmp_path, workspace, f"{DEMO_PROMPT}\n")  # no answer: end of input
    assert result.returncode == 0, result.stderr
    assert f"list_dir {decision_words('deny', 'default')}" in result.stdout


COLOR_QUESTION = {"question": "Which color?", "choices": ["red", "blue"]}


def asks_a_color() -> tuple[Reply, Reply]:
    """A model that asks the person a question (ask_user), then answers."""
    return (
        Reply([ToolUse("toolu_q", "ask_user", COLOR_QUESTION)], stop_reason="tool_use"),
        Reply([Text("Blue it is.")]),
    )


def answers_of(request: object) -> list[object]:
    """The tool results a model request to the mock server carries."""
    messages = request.body["messages"]  # type: ignore[attr-defined]
    return [
        block["content"]
        for message in messages
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]


async def test_the_models_question_is_asked_on_the_terminal_and_answered_by_number(
    tmp_path: Path, workspace: Path
) -> None:
    """R-HITL-5: with --approve ask the model may ask the person (ask_user): the question
    and its numbered choices are shown above the input line, the question's prompt is the
    input line, a line that names no choice gets a hint, and a choice's number answers."""
    async with open_mock_server(*asks_a_color()) as server:

        def drive() -> None:
            terminal = open_chat(
                tmp_path, workspace, "--provider", "anthropic", "--base-url", server.base_url,
                "--approve", "ask", ANTHROPIC_API_KEY="test-key",
            )  # fmt: skip
            try:
                terminal.expect_prompt()
                terminal.line("paint it")
                terminal.expect("The model asks: Which color?")
                terminal.expect("2) blue")
                terminal.expect_prompt("answer: ")
                terminal.line("green")
                terminal.expect("answer with a number from 1 to 2")
                terminal.expect_prompt("answer: ")
                terminal.line("2")
                terminal.expect("ask_user answered")
                terminal.expect("Blue it is.")
                terminal.expect(SUMMARY_COMPLETED)
                terminal.expect_prompt()
                terminal.line("/quit")
                assert terminal.wait_exit() == 0
            finally:
                terminal.close()

        await trio.to_thread.run_sync(drive)
        assert len(server.requests) == 2
        assert "blue" in str(answers_of(server.requests[1]))


async def test_a_piped_answer_answers_the_models_question_and_end_of_input_none(
    tmp_path: Path, workspace: Path
) -> None:
    """Piped, the line after the prompt answers the question; at end of input the question
    is left without an answer and the model is told so."""
    for text, expected in (("paint it\nblue\n", "blue"), ("paint it\n", "No one answered")):
        async with open_mock_server(*asks_a_color()) as server:
            with trio.fail_after(WAIT_S):
                result = await trio.run_process(
                    [sys.executable, "-m", "greenroom", "chat", "--data-dir",
                     str(tmp_path / "data"), "--workspace", str(workspace), "--approve", "ask",
                     "--provider", "anthropic", "--base-url", server.base_url],
                    stdin=text.encode(), capture_stdout=True, capture_stderr=True,
                    cwd=tmp_path, env=chat_env(tmp_path, ANTHROPIC_API_KEY="test-key"),
                    check=False,
                )  # fmt: skip
            stderr = result.stderr.decode()
            assert result.returncode == 0, stderr
            assert "The model asks: Which color?" in stderr
            assert expected in str(answers_of(server.requests[1]))
            assert "Blue it is." in result.stdout.decode()


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


@pytest.mark.parametrize("echoes", [True, False])
async def test_a_piped_answer_is_shown_once_and_a_replaced_stdin_is_no_error(
    echoes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renderer shows an approval answer only when the input does not echo it, and
    decides that from the chat's input, not from ``sys.stdin`` (here replaced by a
    stream without a file descriptor, which must not raise)."""
    import io

    from greenroom.actors.apps.chat import ChatRenderer

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    out, err = io.StringIO(), io.StringIO()
    renderer = ChatRenderer(out, err, live=False, input_echoes=echoes)

    async def read_answer() -> str:
        return "y"

    assert await renderer.ask("Allow? ", read_answer) == "y"
    assert err.getvalue() == ("Allow? " if echoes else "Allow? y\n")
