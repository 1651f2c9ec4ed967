"""``greenroom chat`` with an MCP server (R-MCP-5): ``/server:prompt arg=value`` sends the
server's prompt as the line, ``/help`` lists the prompts with their arguments, and
``@server:uri`` attaches a resource — at the prompt, as steering and after ``/follow``. The
server is a real one built with the official SDK (``tests/support/mcp_server.py``); the chat
runs as a subprocess, piped or on a pseudo-terminal, as in ``tests/test_chat.py``, on the
scripted model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_chat import (
    GATED_TOOLS,
    SUMMARY_COMPLETED,
    WAIT_S,
    WORKING_PROMPT,
    Terminal,
    chat_env,
    hold_in_list_dir,
    open_chat,
    release,
)
from tests.test_mcp import STDIO

NOTES = (
    '<attachment source="@t:greenroom://notes">\n'
    "[resource greenroom://notes of MCP server 't']\n"
    "the notes say: ship on Friday\n</attachment>"
)
USAGE = "/t:review path=… [tone=…]"


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


@pytest.fixture
def servers(tmp_path: Path) -> Path:
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"mcpServers": {"t": STDIO}}), encoding="utf-8")
    return path


def prompts_in_trace(data_dir: Path, stderr: str) -> list[tuple[str, list[str]]]:
    """The user messages of the chat's session, in order: (kind, texts)."""
    session_id = re.search(r"session: (\S+)", stderr)
    assert session_id is not None, stderr
    trace = data_dir / "sessions" / session_id.group(1) / "trace_001.jsonl"
    records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
    return [(r["kind"], [b["text"] for b in r["content"]]) for r in records
            if r["type"] == "user_msg"]  # fmt: skip


def run_piped(tmp_path: Path, workspace: Path, servers: Path, text: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "greenroom", "chat", "--data-dir", str(tmp_path / "data"),
         "--workspace", str(workspace), "--mcp-config", str(servers)],
        input=text, capture_output=True, text=True, cwd=tmp_path, env=chat_env(tmp_path),
        timeout=WAIT_S * 2,
    )  # fmt: skip


def test_prompt_commands_and_attachments_at_the_prompt(
    tmp_path: Path, workspace: Path, servers: Path
) -> None:
    """R-MCP-5: ``/help`` lists the server's prompt as its command with its arguments;
    a command missing a required argument, with an unknown one, naming an unknown prompt
    or server, and an unreadable ``@server:uri``, are each one line saying why, and
    nothing is sent; the chat goes on. A good command sends the prompt's text; a good
    attachment follows the line, delimited."""
    lines = [
        "/help",
        "/t:review",
        "/t:review path=a.py mood=grim",
        "/t:nope",
        "/x:y",
        "see @t:greenroom://nope",
        '/t:review path=a.py tone="very dry"',
        "see @t:greenroom://notes",
    ]
    result = run_piped(tmp_path, workspace, servers, "\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert re.search(rf"\n  {re.escape(USAGE)} +Review a file, in the given tone\n", err), err
    assert "@SERVER:URI attaches a resource of: t" in err
    for refusal in [
        f"[not sent] /t:review: path=… is required (usage: {USAGE})",
        f"[not sent] /t:review: no argument 'mood' (usage: {USAGE})",
        "[not sent] /t:nope: MCP server 't' has no prompt 'nope' (its prompts: review)",
        "[not sent] /x:y: no MCP server 'x' in this session (its servers: t)",
        "[not sent] @t:greenroom://nope: MCP server 't' refused reading greenroom://nope",
    ]:
        assert refusal in err, (refusal, err)
    assert "[MCP prompt] Review a.py in a very dry tone." in err
    assert "[attached @t:greenroom://notes]" in err
    assert err.count(SUMMARY_COMPLETED) == 2, err
    assert 'You asked: "Review a.py in a very dry tone."' in result.stdout
    assert prompts_in_trace(tmp_path / "data", err) == [
        ("prompt", ["Review a.py in a very dry tone."]),
        ("prompt", ["see @t:greenroom://notes", NOTES]),
    ]


def test_follow_takes_a_prompt_command_and_attachments(
    tmp_path: Path, workspace: Path, servers: Path
) -> None:
    """R-MCP-5: ``/follow /t:review …`` and ``/follow … @t:uri`` are prepared as a line
    is (at the prompt a follow-up just runs); ``/follow`` with a bad command sends
    nothing."""
    lines = ["/follow /t:review path=c.py", "/follow /t:review", "/follow read @t:greenroom://notes"]
    result = run_piped(tmp_path, workspace, servers, "\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    assert f"[not sent] /t:review: path=… is required (usage: {USAGE})" in result.stderr
    assert prompts_in_trace(tmp_path / "data", result.stderr) == [
        ("prompt", ["Review c.py in a kind tone."]),
        ("prompt", ["read @t:greenroom://notes", NOTES]),
    ]


@pytest.fixture
def mcp_chat(
    tmp_path: Path, workspace: Path, gated_tools: Path, servers: Path
) -> Iterator[Terminal]:
    terminal = open_chat(
        tmp_path, workspace, "--approve", "all", "--tools", str(gated_tools),
        "--mcp-config", str(servers),
    )  # fmt: skip
    try:
        terminal.expect_prompt()
        yield terminal
    finally:
        terminal.close()


def test_steering_attaches_and_a_command_runs_on_the_terminal(
    mcp_chat: Terminal, tmp_path: Path, workspace: Path
) -> None:
    """R-MCP-5 on a terminal: a line with ``@t:uri`` typed while a task runs is steering
    with the resource attached; an unreadable one steers nothing; at the prompt again a
    ``/t:review`` command runs the prompt as a task."""
    chat = mcp_chat
    hold_in_list_dir(chat)
    chat.line("also @t:greenroom://nope")
    chat.expect("[not sent] @t:greenroom://nope: MCP server 't' refused reading")
    chat.line("also @t:greenroom://notes")
    chat.expect("[attached @t:greenroom://notes]")
    chat.expect("[steering queued]")
    release(workspace)
    chat.expect("[steering] also @t:greenroom://notes")
    chat.expect(SUMMARY_COMPLETED)
    chat.expect_prompt()
    chat.line("/t:review path=b.py")
    chat.expect("[MCP prompt] Review b.py in a kind tone.")
    chat.expect('You asked: "Review b.py in a kind tone."')
    chat.expect(SUMMARY_COMPLETED)
    chat.expect_prompt()
    chat.line("/quit")
    assert chat.wait_exit() == 0
    stderr = chat.screen
    kinds = prompts_in_trace(tmp_path / "data", stderr)
    assert [k for k, _ in kinds] == ["prompt", "steering", "prompt"]
    assert kinds[1][1] == ["also @t:greenroom://notes", NOTES]
    assert kinds[2][1] == ["Review b.py in a kind tone."]


def test_ctrl_c_stops_an_attachment_being_read(
    mcp_chat: Terminal, tmp_path: Path, workspace: Path
) -> None:
    """R-MCP-5, R-ABORT-1: while a line's attachment is being read (a server that does
    not answer) the chat waits for it; Ctrl-C stops it, nothing is sent, and the prompt
    returns at once for the next line."""
    chat = mcp_chat
    chat.line("look at @t:greenroom://slow")
    chat.expect_prompt(WORKING_PROMPT)
    chat.type("\x03")
    chat.expect("[stopped: nothing was sent]")
    chat.expect_prompt()
    chat.line("hello")
    chat.expect('You asked: "hello"')
    chat.expect(SUMMARY_COMPLETED)
    chat.expect_prompt()
    chat.line("/quit")
    assert chat.wait_exit() == 0
    assert prompts_in_trace(tmp_path / "data", chat.screen) == [("prompt", ["hello"])]
