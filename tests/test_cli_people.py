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

import getpass
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.runtime.host import Host
from greenroom.actors.tools import ask_user, load_tools
from greenroom.protocols.outputs import ApprovalRequest
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool, ToolContext, make_tool

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
from tests.test_chat import Terminal, chat_env  # noqa: E402
from tests.test_cli import CLI, TIMEOUT_S, cli_env, json_lines  # noqa: E402
from tests.test_recovery import copy_session  # noqa: E402

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


async def test_a_waiting_call_is_listed_then_approved_and_run_once_by_the_cli(
    tmp_path: Path, workspace: Path, pay_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HITL-2: ``approvals`` lists the call that waits (arguments, the command that
    answers); ``approve … allow`` runs it once and the task on, until it asks again: with
    no terminal that request is left waiting (exit 0, how to answer it); ``approve …
    deny`` then runs the task to its end and prints the final answer. A stale answer is
    refused with a line and exit 1."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    data = tmp_path / "data"
    payments = workspace / "payments.txt"
    script = (
        Reply([Text("Paying 7."), ToolUse("toolu_1", "pay", {"amount": 7})],
              stop_reason="tool_use"),
        Reply([Text("Now 8."), ToolUse("toolu_2", "pay", {"amount": 8})],
              stop_reason="tool_use"),
        Reply([Text("Paid 7; the 8 was refused.")]),
    )  # fmt: skip
    async with open_mock_server(*script) as server:
        sid = await leave_waiting(
            data, workspace, server.base_url, load_tools(str(pay_tools)), "pay 7 then 8"
        )
        assert not payments.exists()
        busy = await greenroom(
            tmp_path, "run", "--session", sid, "--data-dir", str(data), "--tools",
            str(pay_tools), "something else",
        )  # fmt: skip
        assert busy.returncode == 1
        assert f"'greenroom approvals --data-dir {data}' lists what waits" in busy.stderr

        listed = await greenroom(tmp_path, "approvals", "--data-dir", str(data))
        assert listed.returncode == 0, listed.stderr
        assert f"session {sid} · call toolu_1 · approval of pay · asked " in listed.stdout
        assert '"amount": 7' in listed.stdout
        assert f"greenroom approve --data-dir {data} {sid} toolu_1 allow" in listed.stdout
        as_json = await greenroom(tmp_path, "approvals", "--data-dir", str(data), "--json")
        (row,) = json_lines(as_json.stdout)
        assert (row["session_id"], row["call_id"], row["tool"]) == (sid, "toolu_1", "pay")
        assert (row["arguments"], row["kind"], row["origin"]) == ({"amount": 7}, "approval", [sid])

        other = await greenroom(
            tmp_path, "approve", sid, "toolu_1", "allow", "--data-dir", str(data),
            "--tools", str(pay_tools), "--digest", "0" * 16,
        )  # fmt: skip
        assert other.returncode == 1
        assert "other arguments than the ones that were shown" in other.stderr
        assert not payments.exists() and len(server.requests) == 1

        first = await greenroom(
            tmp_path, "approve", sid, "toolu_1", "allow", "--data-dir", str(data),
            "--tools", str(pay_tools), "--digest", row["digest"],
        )  # fmt: skip
        assert first.returncode == 0, first.stderr
        assert payments.read_text() == "7\n"
        assert "pay allowed by a person" in first.stdout and "paid 7" in first.stdout
        assert "Now 8." in first.stdout
        assert "waiting for a person: pay (call toolu_2)" in first.stderr
        assert f"greenroom approve --data-dir {data} {sid} toolu_2 allow" in first.stderr
        assert tool_results(server.requests[1]) == {"toolu_1": "paid 7"}

        listed = await greenroom(tmp_path, "approvals", "--data-dir", str(data), "--json")
        assert [row["call_id"] for row in json_lines(listed.stdout)] == ["toolu_2"]

        second = await greenroom(
            tmp_path, "approve", sid, "toolu_2", "deny", "--data-dir", str(data),
            "--tools", str(pay_tools),
        )  # fmt: skip
        assert second.returncode == 0, second.stderr
        assert "Paid 7; the 8 was refused." in second.stdout
        assert "✓ completed" in second.stderr
        assert payments.read_text() == "7\n"

        stale = await greenroom(
            tmp_path, "approve", sid, "toolu_1", "allow", "--data-dir", str(data),
            "--tools", str(pay_tools),
        )  # fmt: skip
        assert stale.returncode == 1
        assert "call 'toolu_1'" in stale.stderr and "waits for no answer" in stale.stderr
        assert "Traceback" not in stale.stderr
        assert len(server.requests) == 3

        none = await greenroom(tmp_path, "approvals", "--data-dir", str(data))
        assert none.returncode == 0 and none.stdout == ""
        assert "no approvals or questions wait for a person" in none.stderr

    lines = trace_of(data, sid)
    types = [line["type"] for line in lines]
    assert types.count("task_start") == 1 and types.count("task_end") == 1
    assert lines[-1]["status"] == "completed"
    decisions = [line for line in lines if line["type"] == "approval_decision"]
    assert [(d["call_id"], d["decision"], d["by"]) for d in decisions] == [
        ("toolu_1", "allow", "client"), ("toolu_2", "deny", "client"),
    ]  # fmt: skip
    assert {d["principal"] for d in decisions} == {getpass.getuser()}


async def test_answer_gives_the_models_question_its_text_and_runs_the_task_on(
    tmp_path: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HITL-5: a question waits like an approval and is listed with its choices;
    ``answer`` takes a choice (by its number too) and its text is the call's result. A
    decision for a question, or an answer outside its choices, is a usage error that
    changes nothing."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    data = tmp_path / "data"
    script = (
        Reply([ToolUse("toolu_q", "ask_user", COLOR_QUESTION)], stop_reason="tool_use"),
        Reply([Text("Blue it is.")]),
    )
    async with open_mock_server(*script) as server:
        sid = await leave_waiting(data, workspace, server.base_url, [ask_user], "paint it")

        listed = await greenroom(tmp_path, "approvals", "--data-dir", str(data))
        assert f"session {sid} · call toolu_q · question" in listed.stdout
        assert "The model asks: Which color?" in listed.stdout
        assert "    2) blue" in listed.stdout
        assert f"greenroom answer --data-dir {data} {sid} toolu_q TEXT" in listed.stdout

        decided = await greenroom(
            tmp_path, "approve", sid, "toolu_q", "allow", "--data-dir", str(data)
        )
        assert decided.returncode == 2
        assert "is a question of the model" in decided.stderr
        assert "greenroom answer" in decided.stderr
        outside = await greenroom(tmp_path, "answer", sid, "toolu_q", "green",
                                  "--data-dir", str(data))  # fmt: skip
        assert outside.returncode == 2
        assert "answer with a number from 1 to 2 or one of the choices" in outside.stderr
        assert len(server.requests) == 1

        answered = await greenroom(tmp_path, "answer", sid, "toolu_q", "2",
                                   "--data-dir", str(data))  # fmt: skip
        assert answered.returncode == 0, answered.stderr
        assert "? ask_user answered" in answered.stdout
        assert "Blue it is." in answered.stdout
        assert tool_results(server.requests[1]) == {"toolu_q": "blue"}


async def test_answer_resolves_a_call_in_doubt_and_runs_it_once_more(
    tmp_path: Path, workspace: Path, pay_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-EFFECT-2, R-HITL-2: a host lost in the middle of a payment (the copy of its
    files, taken while the call ran); the next host asks a person what became of the
    call and stops. ``approvals`` lists the question with its choices, the call's
    arguments and key; a decision is a usage error; ``answer … 3`` (run again) runs the
    call once, with its key, and the task on to its end."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    started = trio.Event()

    async def pay(amount: int, ctx: ToolContext) -> str:
        """Pay an amount (killed with its host before it ends)."""
        started.set()
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    script = (
        Reply([Text("Paying 7."), ToolUse("toolu_1", "pay", {"amount": 7})],
              stop_reason="tool_use"),
        Reply([Text("Paid 7 after all.")]),
    )  # fmt: skip
    data = tmp_path / "crashed"
    async with open_mock_server(*script) as server:
        async with Host.open(tmp_path / "first") as first:
            session = await first.create_session(
                provider="anthropic", model="mock-model", base_url=server.base_url,
                tools=[make_tool(pay, parallel=False)], workspace_dir=workspace,
                approval_timeout_s=None,
            )  # fmt: skip
            session.run("pay 7", approve=lambda call: "allow")
            with trio.fail_after(TIMEOUT_S):
                await started.wait()
            await first.port(session.id).sync_trace()
            copy_session(session, data)
            sid = session.id
        async with Host.open(data) as second:
            resumed = await second.resume(sid, tools=load_tools(str(pay_tools)))
            with trio.fail_after(TIMEOUT_S):
                await resumed.wait_idle()
            assert resumed.busy  # parked on the question
        key = trace_of(data, sid)[-1]["arguments"]["idempotency_key"]

        listed = await greenroom(tmp_path, "approvals", "--data-dir", str(data))
        assert listed.returncode == 0, listed.stderr
        assert f"session {sid} · call toolu_1 · pay in doubt" in listed.stdout
        assert "A call is in doubt: The host running this call of pay was lost" in listed.stdout
        assert "    3) run again" in listed.stdout and '"amount": 7' in listed.stdout
        assert f"idempotency key: {key}" in listed.stdout
        assert f"greenroom answer --data-dir {data} {sid} toolu_1 done" in listed.stdout

        decided = await greenroom(tmp_path, "approve", sid, "toolu_1", "allow",
                                  "--data-dir", str(data))  # fmt: skip
        assert decided.returncode == 2 and "is in doubt" in decided.stderr
        assert len(server.requests) == 1

        answered = await greenroom(tmp_path, "answer", sid, "toolu_1", "3", "--data-dir",
                                   str(data), "--tools", str(pay_tools))  # fmt: skip
        assert answered.returncode == 0, answered.stderr
        assert "has it run again" in answered.stdout and "Paid 7 after all." in answered.stdout
        assert tool_results(server.requests[1]) == {"toolu_1": "paid 7"}
    assert (workspace / "payments.txt").read_text() == "7\n"
    lines = trace_of(data, sid)
    (resolved,) = [line for line in lines if line["type"] == "call_resolved"]
    assert (resolved["by"], resolved["outcome"], resolved["principal"]) == (
        "person", "rerun", getpass.getuser()
    )
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"


async def test_approve_on_a_terminal_asks_the_next_request_at_once(
    tmp_path: Path, workspace: Path, pay_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal the resumed task's next request is asked there, as ``run --approve
    ask`` asks, and the task runs to its end."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    data = tmp_path / "data"
    script = (
        Reply([ToolUse("toolu_1", "pay", {"amount": 7})], stop_reason="tool_use"),
        Reply([ToolUse("toolu_2", "pay", {"amount": 8})], stop_reason="tool_use"),
        Reply([Text("Paid both.")]),
    )
    async with open_mock_server(*script) as server:
        sid = await leave_waiting(
            data, workspace, server.base_url, load_tools(str(pay_tools)), "pay 7 then 8"
        )

        def drive() -> int:
            terminal = Terminal(
                ["approve", sid, "toolu_1", "allow", "--data-dir", str(data),
                 "--tools", str(pay_tools)],
                cwd=tmp_path, env=chat_env(tmp_path, **KEY),
            )  # fmt: skip
            try:
                terminal.expect('Allow pay {"amount": 8}?')
                terminal.line("y")
                terminal.expect("Paid both.")
                terminal.expect("✓ completed")
                return terminal.wait_exit()
            finally:
                terminal.close()

        assert await trio.to_thread.run_sync(drive) == 0
        assert len(server.requests) == 3
    assert (workspace / "payments.txt").read_text() == "7\n8\n"


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


async def test_unknown_sessions_and_bad_ids_are_usage_errors(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    unknown = await greenroom(tmp_path, "approve", "no-such", "c1", "allow", "--data-dir", data)
    assert unknown.returncode == 2
    assert "no session 'no-such'" in unknown.stderr and "Traceback" not in unknown.stderr
    bad = await greenroom(tmp_path, "answer", "../x", "c1", "yes", "--data-dir", data)
    assert bad.returncode == 2
    assert "is not a session id" in bad.stderr and "Traceback" not in bad.stderr


async def test_approve_while_another_host_has_the_session_open_is_refused(
    tmp_path: Path, workspace: Path, pay_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TRACE-1, R-HITL-2: a host (a server, here this test's) has the session open,
    parked on a payment; ``greenroom approve`` from another process loaded it as well,
    paid, and the open host then took a second answer and paid again, the trace holding
    each seq twice. The command is refused with one line (the session is open in another
    host) and writes nothing; the open host's answer pays once."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    data = tmp_path / "data"
    payments = workspace / "payments.txt"
    script = (
        Reply([Text("Paying 7."), ToolUse("toolu_1", "pay", {"amount": 7})],
              stop_reason="tool_use"),
        Reply([Text("Paid 7.")]),
    )  # fmt: skip
    async with open_mock_server(*script) as server:
        sid = await leave_waiting(
            data, workspace, server.base_url, load_tools(str(pay_tools)), "pay 7"
        )
        async with Host.open(data, tools=load_tools(str(pay_tools))) as host:
            session = await host.load_session(sid)
            before = trace_of(data, sid)
            refused = await greenroom(
                tmp_path, "approve", sid, "toolu_1", "allow", "--data-dir", str(data),
                "--tools", str(pay_tools),
            )  # fmt: skip
            assert refused.returncode == 2, refused.stderr
            assert refused.stderr.splitlines() == [
                f"greenroom approve: session {sid} is open in another host on this data dir "
                "(another process?): answer, steer or run it through that host"
            ]
            assert trace_of(data, sid) == before and not payments.exists()
            await host.answer_approval(sid, "toolu_1", "allow", by="alice")
            with trio.fail_after(TIMEOUT_S):
                await session.wait_idle()
    assert payments.read_text().split() == ["7"]
