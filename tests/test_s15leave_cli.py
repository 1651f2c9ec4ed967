"""Leaving ``greenroom chat`` and ``greenroom run`` while a tool ignores the interrupt
(R-SEC-2): the task ends ``aborted`` at once, and the process then ends too, with the exit
code the command documents, instead of waiting for ever for the tool it abandoned.

The chat runs on a real pseudo-terminal (``tests/test_chat.py``'s :class:`Terminal`), its
``list_dir`` holding the chat's trio thread while the test types (:class:`TrioThreadHold`),
then blocking in a worker thread no cancellation reaches. ``run`` runs as a child process
whose ``list_dir`` reports progress, then blocks the same way
(``tests/test_cli_interrupt.py``). Every wait is bounded.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.apps.chat import PROMPT  # noqa: E402
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT  # noqa: E402
from tests.test_chat import Terminal, TrioThreadHold, open_chat  # noqa: E402
from tests.test_cli import greenroom  # noqa: E402
from tests.test_cli_interrupt import interrupt_stuck_run, start_stuck_run  # noqa: E402

EXIT_OK = 0
EXIT_ABORTED = 130


def assert_whole_trace(data: Path, session_id: str) -> list[dict[str, object]]:
    """The session's trace: whole JSON lines only, the task's end recorded."""
    trace = data / "sessions" / session_id / "trace_001.jsonl"
    text = trace.read_text(encoding="utf-8")
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["type"] for r in records][-2:] == ["abort", "task_end"]
    assert records[-1]["status"] == "aborted"
    return records


# -- chat ---------------------------------------------------------------------------------


def quit_during_the_task(terminal: Terminal, hold: TrioThreadHold) -> None:
    terminal.type("/quit\r")
    hold.release()  # the tool now blocks where the interrupt cannot reach it
    terminal.expect("[leaving: interrupting the task…]")


def ctrl_c_then_quit_at_the_prompt(terminal: Terminal, hold: TrioThreadHold) -> None:
    terminal.type("\x03")
    hold.release()  # before or after the key reaches the chat: either way it meets the block
    terminal.expect("aborted")
    terminal.expect_prompt(PROMPT)
    terminal.line("/quit")


@pytest.mark.parametrize(
    "leave",
    [quit_during_the_task, ctrl_c_then_quit_at_the_prompt],
    ids=["quit-during-the-task", "ctrl-c-then-quit-at-the-prompt"],
)
def test_the_chat_leaves_with_0_while_a_tool_ignores_the_interrupt(
    leave: object, tmp_path: Path, workspace: Path
) -> None:
    """``/quit`` (during the task, or at the prompt after Ctrl-C ended it) exits 0 with the
    resume hint, and the trace is whole, though the abandoned tool never ends."""
    hold = TrioThreadHold(tmp_path, "ignores-the-interrupt")
    terminal = open_chat(tmp_path, workspace, "--approve", "all", "--tools", str(hold.tools))
    try:
        session_id = terminal.expect(re.compile(r"session: (\S+)")).group(1)
        terminal.expect_prompt()
        terminal.line(DEMO_PROMPT)
        hold.wait_held()
        assert callable(leave)
        leave(terminal, hold)
        assert terminal.wait_exit() == EXIT_OK
        assert f"to resume: greenroom chat --session {session_id}" in terminal.screen
    finally:
        terminal.close()
        hold.close()
    assert_whole_trace(tmp_path / "data", session_id)


# -- run ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sigints", [1, 2], ids=["one-sigint", "a-second-after-the-summary"])
def test_run_interrupted_once_ends_with_130_while_a_tool_ignores_the_interrupt(
    sigints: int, tmp_path: Path
) -> None:
    """One SIGINT ends the task ``aborted`` and then the process (exit 130, everything it
    printed whole), although the tool it abandoned never ends; a second one after the
    summary line, while the process would wait for that tool, leaves too (exit 130)."""
    process = start_stuck_run(tmp_path)
    # the second SIGINT, if any, after the summary line
    code, out, err = interrupt_stuck_run(process, b"aborted \xc2\xb7", again=sigints == 2)
    assert code == EXIT_ABORTED, err
    assert b"Traceback" not in err
    outputs = [json.loads(line) for line in out.splitlines()]  # whole JSON lines only
    assert outputs[-1]["type"] == "task_end" and outputs[-1]["status"] == "aborted"
    session_id = outputs[0]["session_id"]
    assert isinstance(session_id, str)
    assert_whole_trace(tmp_path / "data", session_id)
    shown = greenroom(tmp_path, "trace", session_id, "--data-dir", str(tmp_path / "data"))
    assert shown.returncode == 0, shown.stderr
    assert "corrupt" not in shown.stderr
