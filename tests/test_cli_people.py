"""People answer from the command line (R-HITL-2, R-HITL-5), end to end: a task is left
waiting for a person through the Python API (``approve="people"``, then the host closes),
and real ``greenroom approvals`` / ``approve`` / ``answer`` processes list it, answer it
and run the task on to its end; ``run`` and ``chat`` ask the model's questions on the
terminal.

A loopback model server (tests/support/mock_model_server.py) plays the model for the
in-process host and for the CLI alike, so each reply is where the test expects it; the
``pay`` tool appends each payment to a file of the workspace, so that "ran exactly once"
is a line count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.runtime.host import Host
from greenroom.protocols.outputs import ApprovalRequest
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.mock_model_server import (  # noqa: E402
    RecordedRequest,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)
from tests.test_cli import CLI, TIMEOUT_S, cli_env  # noqa: E402

KEY = {"ANTHROPIC_API_KEY": "test-key"}

PAY_TOOLS = '''
from greenroom.protocols.tools import tool


@tool(parallel=False)
async def pay(amount: int, ctx) -> str:
    """Pay an amount (each payment is a line of payments.txt in the workspace)."""
    with open(ctx.workspace_dir / "payments.txt", "a", encoding="utf-8") as handle:
        handle.write(f"{amount}\\n")
    return f"paid {amount}"
'''

COLOR_QUESTION = {"question": "Which color?", "choices": ["red", "blue"]}


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    directory.mkdir()
    return directory


@pytest.fixture
def pay_tools(tmp_path: Path) -> Path:
    path = tmp_path / "pay_tools.py"
    path.write_text(PAY_TOOLS, encoding="utf-8")
    return path


async def greenroom(
    tmp_path: Path, *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[str]:
    """``greenroom ARGS`` with the model key set and ``stdin`` piped (no terminal)."""
    with trio.fail_after(TIMEOUT_S):
        result = await trio.run_process(
            [*CLI, *args], cwd=tmp_path, env={**cli_env(tmp_path), **KEY},
            stdin=stdin, capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


async def leave_waiting(
    data_dir: Path, workspace: Path, base_url: str, tools: list[Tool], prompt: str
) -> str:
    """Run ``prompt`` with people answering, until its task waits for one with nothing in
    memory; close the host, leaving the request in the trace. Returns the session id."""
    async with Host.open(data_dir) as host:
        session = await host.create_session(
            provider="anthropic", model="mock-model", base_url=base_url, tools=tools,
            workspace_dir=workspace, approval_timeout_s=None,
        )  # fmt: skip
        stream = session.run(prompt, approve=PEOPLE)
        with trio.fail_after(TIMEOUT_S):
            async for output in stream:
                if isinstance(output, ApprovalRequest):
                    break
            await session.wait_idle()  # parked: its supervisor has ended
        assert session.busy
        return session.id


def tool_results(request: RecordedRequest) -> dict[str, str]:
    """The tool results a model request carries, by call id."""
    found: dict[str, str] = {}
    for message in request.body["messages"]:
        content = message["content"]
        for block in content if isinstance(content, list) else ():
            if block.get("type") == "tool_result":
                inner = block["content"]
                found[block["tool_use_id"]] = (
                    inner if isinstance(inner, str) else "".join(b["text"] for b in inner)
                )
    return found


def trace_of(data_dir: Path, session_id: str) -> list[dict[str, Any]]:
    path = data_dir / "sessions" / session_id / "trace_001.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


async def test_run_asks_the_models_question_on_the_terminal(
    tmp_path: Path, workspace: Path
) -> None:
    """R-HITL-5: ``run --approve ask`` offers ``ask_user`` and asks its question where the
    approvals are asked: the question and its numbered choices, a hint for a line that
    names no choice, and the chosen text is the call's result."""
    script = (
        Reply([ToolUse("toolu_q", "ask_user", COLOR_QUESTION)], stop_reason="tool_use"),
        Reply([Text("Blue it is.")]),
    )
    async with open_mock_server(*script) as server:
        result = await greenroom(
            tmp_path, "run", "--provider", "anthropic", "--base-url", server.base_url,
            "--approve", "ask", "--workspace", str(workspace), "--data-dir",
            str(tmp_path / "data"), "paint it", stdin=b"green\n2\n",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        offered = [tool["name"] for tool in server.requests[0].body["tools"]]
        assert "ask_user" in offered
        assert tool_results(server.requests[1]) == {"toolu_q": "blue"}
    assert "The model asks: Which color?\n  1) red\n  2) blue\n" in result.stderr
    assert "answer with a number from 1 to 2 or one of the choices" in result.stderr
    assert "? ask_user answered" in result.stdout
    assert "Blue it is." in result.stdout


async def test_run_without_a_person_to_ask_offers_no_questions(
    tmp_path: Path, workspace: Path
) -> None:
    """Where nobody answers (``--approve none``, all), the model is not offered
    ``ask_user``."""
    async with open_mock_server(Reply([Text("Fine.")])) as server:
        result = await greenroom(
            tmp_path, "run", "--provider", "anthropic", "--base-url", server.base_url,
            "--approve", "all", "--workspace", str(workspace), "--data-dir",
            str(tmp_path / "data"), "hello",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        offered = [tool["name"] for tool in server.requests[0].body["tools"]]
    assert "ask_user" not in offered and "read_file" in offered
