"""The ``greenroom`` command line end to end (subprocesses), and the demo brain in-process.

Every subprocess runs with a data dir under ``tmp_path``, without API keys (so the
scripted model answers) and with a timeout, so a hang fails the test instead of the suite.
Command lines that run to their end by themselves go through :func:`greenroom`, whose
processes are forked from one that has loaded the command line; those sent signals or
read while they run start ``python -m greenroom`` (``CLI``).
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.apps.demo import SALES, write_demo_workspace
from greenroom.actors.providers.scripted import ScriptedProvider
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT, make_demo_brain
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.builtin import builtin_tools
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd, ToolCallOutput

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.forked_cli import shared_forked_cli  # noqa: E402
from tests.support.mock_model_server import (  # noqa: E402
    ErrorReply,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)

CLI = [sys.executable, "-m", "greenroom"]
TIMEOUT_S = 60
LIVE_ONLY = {"partial_text", "partial_thinking", "partial_tool_call", "tool_progress"}


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")
    }
    env["GREENROOM_HOME"] = str(tmp_path / "home")
    env["TMPDIR"] = str(tmp_path)  # the demo's temp dirs land here, not in /tmp
    env["NO_COLOR"] = "1"
    return env


def greenroom(
    tmp_path: Path, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``greenroom ARGS`` in its own process, forked from one that has loaded the command
    line (``support/forked_cli.py``): a fresh process but for the imports."""
    return shared_forked_cli().run(
        list(args), cwd=tmp_path, env=cli_env(tmp_path), timeout=TIMEOUT_S, stdin=stdin or ""
    )


def json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines()]


def expected_totals(workspace: Path) -> dict[str, str]:
    """Revenue per region computed here from the CSV files the demo wrote."""
    totals: dict[str, Decimal] = {}
    for path in sorted(workspace.glob("*.csv")):
        for row in csv.DictReader(path.read_text(encoding="utf-8").splitlines()):
            revenue = Decimal(row["units"]) * Decimal(row["unit_price"])
            totals[row["region"]] = totals.get(row["region"], Decimal(0)) + revenue
    return {region: f"{value.quantize(Decimal('0.01')):,}" for region, value in totals.items()}


def assert_table_has_totals(text: str, totals: dict[str, str]) -> None:
    """The Markdown table's row for each region ends with its revenue, as the model wrote it
    or as a terminal shows it (columns padded to one width)."""
    assert totals, "no CSV data to check against"
    for region, money in totals.items():
        row = re.compile(
            rf"^\| {re.escape(region)} *\|.*\| *{re.escape(money)} \|$", re.MULTILINE
        )
        assert row.search(text), f"no table row '{region} … {money}' in:\n{text}"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    write_demo_workspace(directory)
    return directory


def run_json(tmp_path: Path, workspace: Path, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    result = greenroom(
        tmp_path, "run", "--json", "--workspace", str(workspace),
        "--data-dir", str(tmp_path / "data"), *args,
    )  # fmt: skip
    return result.returncode, json_lines(result.stdout), result.stderr


# -- greenroom demo ---------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["demo", "run"])
def test_a_damaged_usage_ledger_is_one_line_naming_it_and_exit_2(
    tmp_path: Path, workspace: Path, command: str
) -> None:
    """R-SEC-1: a data dir whose usage.sqlite is not a database (cut, overwritten) stops
    the command before anything runs, with the file, the reason and what to do on one
    line — not a traceback."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "usage.sqlite").write_bytes(b"not a database at all, and long enough to read")
    args = ["--workspace", str(workspace), "--data-dir", str(data)]
    if command == "run":
        args = [*args, "--provider", "scripted", "hello"]
    result = greenroom(tmp_path, command, *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith(f"greenroom {command}: the usage ledger {data / 'usage.sqlite'}")
    assert "move it aside" in line


def test_demo_exits_0_says_scripted_and_answers_with_correct_totals(tmp_path: Path) -> None:
    result = greenroom(
        tmp_path, "demo", "--workspace", str(tmp_path / "ws"), "--data-dir", str(tmp_path / "d")
    )
    assert result.returncode == 0, result.stderr
    assert "No ANTHROPIC_API_KEY is set" in result.stdout
    assert "scripted model" in result.stdout
    assert sorted(p.name for p in (tmp_path / "ws").glob("*.csv")) == sorted(SALES)
    assert_table_has_totals(result.stdout, expected_totals(tmp_path / "ws"))
    # streaming, parallel slots, the trace location and how to look at it
    assert result.stdout.count("▸ read_file") == 3
    assert "3 of 5 slots busy" in result.stdout
    session_id = re.search(r"session: (\S+)", result.stderr)
    assert session_id is not None
    assert f"greenroom trace {session_id.group(1)} --data-dir" in result.stdout
    trace = tmp_path / "d" / "sessions" / session_id.group(1) / "trace_001.jsonl"
    assert trace.is_file()
    assert "✓ completed · 3 turns" in result.stderr


def test_demo_without_arguments_uses_a_fresh_temp_dir_and_removes_it(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "demo")
    assert result.returncode == 0, result.stderr
    shown = re.search(r"workspace  (\S+)", result.stdout)
    assert shown is not None, result.stdout
    workspace = Path(shown.group(1))
    assert workspace.parent.parent == tmp_path  # cli_env: TMPDIR is tmp_path
    assert workspace.parent.name.startswith("greenroom-demo-")
    assert not list(tmp_path.glob("greenroom-demo-*"))  # removed when the demo ended
    assert "removed when the demo ends" in result.stdout
    assert "--data-dir DIR" in result.stdout  # how to keep a trace, not a path that is gone
    write_demo_workspace(tmp_path / "same")
    assert_table_has_totals(result.stdout, expected_totals(tmp_path / "same"))
    assert not (tmp_path / "home").exists()  # the user's data dir is left alone


def test_demo_removes_its_temp_dir_after_ctrl_c_and_after_a_usage_error(tmp_path: Path) -> None:
    """Ctrl-C at the first approval question (the task is interrupted, exit 130) and a
    workspace it cannot write (exit 2) leave no ``greenroom-demo-*`` directory behind."""
    process = subprocess.Popen(
        [*CLI, "demo", "--approve", "ask"], cwd=tmp_path, env=cli_env(tmp_path),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        asked = b""
        while b"Allow list_dir" not in asked:  # the question ends without a newline
            chunk = process.stderr.read1(4096)
            assert chunk, asked
            asked += chunk
        assert len(list(tmp_path.glob("greenroom-demo-*"))) == 1  # there while it runs
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    assert b"Traceback" not in err
    assert not list(tmp_path.glob("greenroom-demo-*"))

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    failed = greenroom(tmp_path, "demo", "--workspace", str(blocker / "ws"))
    assert failed.returncode == 2, failed.stderr
    assert "--workspace: cannot write the demo files" in failed.stderr
    assert not list(tmp_path.glob("greenroom-demo-*"))


# -- greenroom run --json -----------------------------------------------------------------


def test_run_json_prints_only_json_outputs(tmp_path: Path, workspace: Path) -> None:
    code, lines, stderr = run_json(tmp_path, workspace, "--approve", "all", DEMO_PROMPT)
    assert code == 0, stderr
    assert lines, "no output"
    session_id = lines[0]["session_id"]
    assert f"session: {session_id}" in stderr
    seqs = []
    for line in lines:
        assert {"type", "session_id", "run_id"} <= line.keys(), line
        assert line["session_id"] == session_id
        if line["type"] not in LIVE_ONLY:
            seqs.append(line["seq"])
        else:
            assert "seq" not in line
    assert seqs == sorted(set(seqs)), "seq must increase strictly"
    assert seqs[0] == 1
    assert [line["type"] for line in lines].count("task_end") == 1
    assert lines[-1]["type"] == "task_end"
    assert lines[-1]["status"] == "completed"
    final_text = [
        line["block"]["text"]
        for line in lines
        if line["type"] == "model_msg" and line["block"]["type"] == "text"
    ][-1]
    assert_table_has_totals(final_text, expected_totals(workspace))


def test_run_reads_the_prompt_from_stdin(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "run", "--json", stdin="what is the weather like?\n")
    assert result.returncode == 0, result.stderr
    texts = [
        line["block"]["text"]
        for line in json_lines(result.stdout)
        if line["type"] == "model_msg" and line["block"]["type"] == "text"
    ]
    assert 'You asked: "what is the weather like?"' in texts[0]
    assert "scripted model" in texts[0]


def test_run_session_continues_with_the_history(tmp_path: Path, workspace: Path) -> None:
    code, first, stderr = run_json(tmp_path, workspace, "--approve", "all", DEMO_PROMPT)
    assert code == 0, stderr
    session_id = first[0]["session_id"]
    code, second, stderr = run_json(
        tmp_path, workspace, "--session", session_id, "--max-turns", "3", "And what next?"
    )
    assert code == 0, stderr
    assert f"session: {session_id}" in stderr
    assert {line["session_id"] for line in second} == {session_id}
    assert second[0]["run_id"] != first[0]["run_id"]
    # the session's seq continues where the first run stopped
    assert second[0]["seq"] == first[-1]["seq"] + 1
    # the model saw the first run: its first request held the earlier prompt
    reply = next(
        line["block"]["text"]
        for line in second
        if line["type"] == "model_msg" and line["block"]["type"] == "text"
    )
    assert "This session already holds 1 earlier prompt" in reply
    trace = tmp_path / "data" / "sessions" / session_id / "trace_001.jsonl"
    prompts = [
        json.loads(line)["content"][0]["text"]
        for line in trace.read_text(encoding="utf-8").splitlines()
        if json.loads(line)["type"] == "user_msg"
    ]
    assert prompts == [DEMO_PROMPT, "And what next?"]


def test_approve_none_denies_every_call_and_the_task_completes(
    tmp_path: Path, workspace: Path
) -> None:
    code, lines, stderr = run_json(tmp_path, workspace, "--approve", "none", DEMO_PROMPT)
    assert code == 0, stderr
    decisions = [line for line in lines if line["type"] == "approval_decision"]
    outputs = [line for line in lines if line["type"] == "tool_call_output"]
    assert decisions and all(d["decision"] == "deny" and d["by"] == "default" for d in decisions)
    assert outputs and all(o["status"] == "denied" for o in outputs)
    assert all(o["content"] == [{"type": "text", "text": "Tool call denied by user."}]
               for o in outputs)  # fmt: skip
    assert lines[-1]["type"] == "task_end"
    assert lines[-1]["status"] == "completed"


def test_approve_is_none_by_default_without_a_terminal(tmp_path: Path, workspace: Path) -> None:
    code, lines, _ = run_json(tmp_path, workspace, DEMO_PROMPT)
    assert code == 0
    assert {line["decision"] for line in lines if line["type"] == "approval_decision"} == {"deny"}


def test_approve_ask_reads_answers(tmp_path: Path, workspace: Path) -> None:
    # list_dir: yes; the three reads: no, then always (the third by session rule)
    result = subprocess.run(
        [*CLI, "run", "--json", "--approve", "ask", "--workspace", str(workspace), DEMO_PROMPT],
        cwd=tmp_path, env=cli_env(tmp_path), input="y\nn\na\n",
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = json_lines(result.stdout)
    decisions = [(d["decision"], d["by"]) for d in lines if d["type"] == "approval_decision"]
    assert decisions == [
        ("allow", "host"),
        ("deny", "host"),
        ("allow", "host"),
        ("allow", "session_rule"),
    ]
    assert result.stderr.count("[y]es / [n]o / [a]lways for this session:") == 3
    assert "Allow read_file" in result.stderr


def test_max_turns_ends_with_exit_1(tmp_path: Path, workspace: Path) -> None:
    code, lines, _ = run_json(tmp_path, workspace, "--approve", "all", "--max-turns", "1",
                              DEMO_PROMPT)  # fmt: skip
    assert code == 1
    assert lines[-1]["status"] == "max_turns"


def test_sigint_interrupts_the_task_and_exits_130(tmp_path: Path, workspace: Path) -> None:
    process = subprocess.Popen(
        [*CLI, "run", "--json", "--approve", "all", "--workspace", str(workspace), DEMO_PROMPT],
        cwd=tmp_path, env=cli_env(tmp_path), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    lines: list[dict[str, Any]] = []
    try:
        for raw in process.stdout:
            lines.append(json.loads(raw))
            if lines[-1]["type"] == "partial_text":  # the model is streaming: interrupt now
                process.send_signal(signal.SIGINT)
                break
        rest, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    lines.extend(json_lines(rest))
    assert process.returncode == 130
    types = [line["type"] for line in lines]
    assert "abort" in types
    assert lines[-1]["type"] == "task_end"
    assert lines[-1]["status"] == "aborted"


def test_tools_flag_loads_a_tool_file(tmp_path: Path) -> None:
    tool_file = tmp_path / "my_tools.py"
    tool_file.write_text(
        "from greenroom.protocols.tools import tool\n\n"
        "@tool(parallel=True)\n"
        "async def shout(text: str) -> str:\n"
        '    """Shout."""\n'
        "    return text.upper()\n",
        encoding="utf-8",
    )
    result = greenroom(
        tmp_path, "run", "--tools", str(tool_file), "--no-builtin-tools", "--json", "hi"
    )
    assert result.returncode == 0, result.stderr
    sid = json_lines(result.stdout)[0]["session_id"]
    meta = json.loads((tmp_path / "home" / "sessions" / sid / "session.json").read_text())
    assert meta["tools"] == ["shout"]


# -- usage errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["run", "--bogus", "x", "hi"], "--bogus"),
        (["run", "--max-turns", "0", "hi"], "--max-turns"),
        (["run", "--max-turns", "-3", "hi"], "--max-turns"),
        (["run", "--max-turns", "abc", "hi"], "--max-turns"),
        (["run", "--max-context-length", "lots", "hi"], "--max-context-length"),
        (["run", "--approve", "maybe", "hi"], "--approve"),
        (["run", "--provider", "gpt", "hi"], "--provider"),
        (["run", "--compact-mode", "shrink", "hi"], "--compact-mode"),
        (["run", "--tools", "no_such_file.py", "hi"], "--tools"),
        (["run", "--workspace", "no/such/dir", "hi"], "--workspace"),
        (["serve", "--port", "99999"], "--port"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(tmp_path: Path, args: list[str], flag: str) -> None:
    result = greenroom(tmp_path, *args)
    assert result.returncode == 2, result.stderr
    assert flag in result.stderr
    assert result.stdout == ""


def test_unknown_session_exits_2(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "run", "--session", "20990101-000000-abcdef", "hi")
    assert result.returncode == 2
    assert "no session '20990101-000000-abcdef'" in result.stderr
    result = greenroom(tmp_path, "run", "--session", "../../etc", "hi")
    assert result.returncode == 2
    assert "not a session id" in result.stderr


def test_anthropic_without_a_key_exits_2(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "run", "--provider", "anthropic", "hi")
    assert result.returncode == 2
    assert "ANTHROPIC_API_KEY" in result.stderr


def test_empty_prompt_exits_2(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "run", stdin="  \n")
    assert result.returncode == 2
    assert "prompt" in result.stderr


async def test_serve_answers_json_rpc_and_stops_on_sigint(tmp_path: Path) -> None:
    """`greenroom serve` end to end: a real websocket client authenticates with the token
    the server wrote (mode 0600), creates a session and runs a task on the scripted
    model; SIGINT stops the server cleanly."""
    import signal

    from trio_websocket import open_websocket_url

    data_dir = tmp_path / "serve-data"
    (tmp_path / "ws").mkdir()  # the data dir may not be inside the workspace (R-SEC-5)
    process = await trio.lowlevel.open_process(
        [
            *CLI,
            "serve",
            "--port",
            "0",
            "--data-dir",
            str(data_dir),
            "--workspace",
            str(tmp_path / "ws"),
            "--approve",
            "all",
        ],
        env=cli_env(tmp_path),
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        with trio.fail_after(TIMEOUT_S):
            seen = b""
            while b"/v1" not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            url = re.search(rb"ws://[\w.:]+/v1", seen).group().decode()  # type: ignore[union-attr]
            token_file = data_dir / "serve.token"
            assert token_file.stat().st_mode & 0o777 == 0o600
            headers = [("Authorization", f"Bearer {token_file.read_text().strip()}")]
            async with open_websocket_url(url, extra_headers=headers) as ws:

                async def call(method: str, params: dict[str, Any], ident: int) -> Any:
                    await ws.send_message(
                        json.dumps(
                            {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
                        )
                    )
                    while True:
                        frame = json.loads(await ws.get_message())
                        if frame.get("id") == ident:
                            return frame

                created = await call("session.create", {}, 1)
                session_id = created["result"]["session_id"]
                await call("session.subscribe", {"session_id": session_id}, 2)
                started = await call("run", {"session_id": session_id, "input": "hello"}, 3)
                assert started["result"]["run_id"]
                while True:
                    frame = json.loads(await ws.get_message())
                    params = frame.get("params", {})
                    if frame.get("method") == "output" and params.get("type") == "task_end":
                        assert params["status"] == "completed"
                        break
                bad = await call("no.such.method", {}, 4)
                assert bad["error"]["code"] == -32601
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


# -- greenroom sessions / trace ---------------------------------------------------------------


def test_sessions_lists_the_created_session(tmp_path: Path, workspace: Path) -> None:
    code, lines, _ = run_json(tmp_path, workspace, "hello")
    assert code == 0
    session_id = lines[0]["session_id"]
    result = greenroom(tmp_path, "sessions", "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if session_id in line)
    assert "scripted/scripted" in row
    assert str(workspace) in row
    listed = json_lines(
        greenroom(tmp_path, "sessions", "--json", "--data-dir", str(tmp_path / "data")).stdout
    )
    assert [s["session_id"] for s in listed] == [session_id]


def test_trace_prints_records_and_reports_a_corrupt_line(tmp_path: Path, workspace: Path) -> None:
    code, lines, _ = run_json(tmp_path, workspace, "--approve", "all", DEMO_PROMPT)
    assert code == 0
    session_id = lines[0]["session_id"]
    data = str(tmp_path / "data")
    traced = [line for line in lines if line["type"] not in LIVE_ONLY]

    result = greenroom(tmp_path, "trace", session_id, "--data-dir", data)
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert len(printed) == len(traced)
    assert re.match(r"^\s+1\s+user_msg\s+prompt: Summarize the sales", printed[0])
    assert any(
        re.search(r"model_msg\s+turn 2 tool_call call_2_1 read_file .*sales_north", p)
        for p in printed
    )
    assert re.match(rf"^\s+{len(traced)}\s+task_end\s+completed turns=3", printed[-1])

    trace = tmp_path / "data" / "sessions" / session_id / "trace_001.jsonl"
    records = trace.read_text(encoding="utf-8").splitlines(keepends=True)
    records.insert(2, '{"type": "model_msg", "oops\n')
    trace.write_text("".join(records), encoding="utf-8")
    result = greenroom(tmp_path, "trace", session_id, "--data-dir", data)
    assert result.returncode == 0
    assert f"{trace}:3: " in result.stderr
    assert len(result.stdout.splitlines()) == len(traced)

    as_json = json_lines(greenroom(tmp_path, "trace", session_id, "--json", "--data-dir",
                                   data).stdout)  # fmt: skip
    assert [r["seq"] for r in as_json] == [t["seq"] for t in traced]


def test_run_session_warns_about_corrupt_trace_lines_and_continues(
    tmp_path: Path, workspace: Path
) -> None:
    code, lines, _ = run_json(tmp_path, workspace, "hello")
    session_id = lines[0]["session_id"]
    trace = tmp_path / "data" / "sessions" / session_id / "trace_001.jsonl"
    with trace.open("a", encoding="utf-8") as f:
        f.write("not json at all\n")
    code, lines, stderr = run_json(tmp_path, workspace, "--session", session_id, "again")
    assert code == 0, stderr
    assert f"warning: corrupt trace line skipped: {trace}:" in stderr
    assert lines[-1]["status"] == "completed"


def test_trace_of_an_unknown_session_exits_2(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "trace", "nope", "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2
    assert "no session 'nope'" in result.stderr


# -- against a loopback model server (the real provider clients) ---------------------------


async def greenroom_async(
    tmp_path: Path, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(TIMEOUT_S):
        return await trio.run_process(
            [*CLI, *args], cwd=tmp_path, env={**cli_env(tmp_path), **env},
            stdin=b"", capture_stdout=True, capture_stderr=True, check=False,
        )  # fmt: skip


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_run_json_against_a_model_server(
    tmp_path: Path, workspace: Path, provider: str
) -> None:
    script = (
        Reply([Text("Let me look."), ToolUse("toolu_1", "list_dir", {"path": "."})],
              stop_reason="tool_use"),
        Reply([Text("There are three sales files.")]),
    )  # fmt: skip
    async with open_mock_server(*script) as server:
        base_url = server.base_url + ("/v1" if provider == "openai" else "")
        result = await greenroom_async(
            tmp_path, "run", "--json", "--provider", provider, "--model", "mock-model",
            "--base-url", base_url, "--approve", "all", "--workspace", str(workspace),
            "What is here?",
            env={"ANTHROPIC_API_KEY": "test-key", "OPENAI_API_KEY": "test-key"},
        )  # fmt: skip
        server.assert_clean()
        assert len(server.requests) == 2
    assert result.returncode == 0, result.stderr.decode()
    lines = json_lines(result.stdout.decode())
    outputs = [line for line in lines if line["type"] == "tool_call_output"]
    assert [(o["call_id"], o["status"]) for o in outputs] == [("toolu_1", "ok")]
    assert "sales_north.csv" in outputs[0]["content"][0]["text"]
    assert lines[-1]["type"] == "task_end"
    assert lines[-1]["status"] == "completed"
    assert lines[-1]["turns"] == 2


async def test_terminal_controls_from_the_model_never_reach_the_terminal(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SEC-1: a model's text, tool name, call id and arguments, and a tool's output, went
    to the terminal as they came, so a hostile model service could write the user's
    clipboard (OSC 52), retitle or clear the screen. Control characters now show as
    ``\\xNN`` escapes, the text's line ends kept."""
    osc52 = "\x1b]52;c;aGk=\x07"
    script = (
        Reply([Text(f"Look{osc52}\x1b[2J here.\n"),
               ToolUse(f"toolu_{osc52}", f"list_dir{osc52}", {"path": f".{osc52}"})],
              stop_reason="tool_use"),
        Reply([Text("Done\x9b2J.")]),
    )  # fmt: skip
    async with open_mock_server(*script) as server:
        result = await greenroom_async(
            tmp_path, "run", "--provider", "anthropic", "--model", "mock-model",
            "--base-url", server.base_url, "--approve", "all", "--workspace", str(workspace),
            "What is here?", env={"ANTHROPIC_API_KEY": "test-key"},
        )  # fmt: skip
    shown = result.stdout.decode() + result.stderr.decode()
    assert result.returncode == 0, shown
    assert not any(c in shown for c in "\x1b\x07\x9b"), repr(shown)
    assert "Look\\x1b]52;c;aGk=\\x07\\x1b[2J here." in shown
    assert "list_dir\\x1b]52" in shown


async def test_auth_failure_exits_3(tmp_path: Path) -> None:
    bad_key = ErrorReply.anthropic(401, "authentication_error", "invalid x-api-key")
    async with open_mock_server(bad_key) as server:
        result = await greenroom_async(
            tmp_path, "run", "--json", "--provider", "anthropic", "--base-url",
            server.base_url, "hi", env={"ANTHROPIC_API_KEY": "wrong"},
        )  # fmt: skip
        assert len(server.requests) == 1  # never retried (R-RETRY-6)
    assert result.returncode == 3, result.stderr.decode()
    lines = json_lines(result.stdout.decode())
    assert lines[-1]["type"] == "task_end"
    assert lines[-1]["status"] == "auth"


TABLE_ANSWER = (
    "Revenue per region:\n\n"
    "| Region | Units | Revenue |\n"
    "|:---|---:|---:|\n"
    "| South | 52 | 2,212.24 |\n"
    "| West | 3 | 905.91 |\n"
    "| Nord-Ost 北 | 145 | 15.00 |\n"
    "\nSouth leads. A line | with a bar is no table.\n"
    "| neither | is this |"
)
TABLE_SHOWN = [
    "| Region      | Units |  Revenue |",
    "|-------------|-------|----------|",
    "| South       |    52 | 2,212.24 |",
    "| West        |     3 |   905.91 |",
    "| Nord-Ost 北 |   145 |    15.00 |",
]
"""How a terminal shows TABLE_ANSWER's table: columns padded to one width (北 takes two
columns), numbers aligned as its delimiter row says, a rule under the header."""


async def test_run_shows_a_markdown_table_aligned(tmp_path: Path) -> None:
    """A table the model streams (split across deltas mid-row) is shown aligned once it is
    whole; the text around it, and a line that only contains a bar, stay as written."""
    async with open_mock_server(Reply([Text(TABLE_ANSWER)])) as server:
        result = await greenroom_async(
            tmp_path, "run", "--provider", "anthropic", "--base-url", server.base_url,
            "--approve", "none", "--no-builtin-tools", "the revenue, please",
            env={"ANTHROPIC_API_KEY": "test-key"},
        )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    shown = result.stdout.decode().splitlines()
    start = shown.index(TABLE_SHOWN[0])
    assert shown[start - 2 : start] == ["Revenue per region:", ""]
    assert shown[start : start + len(TABLE_SHOWN) + 3] == [
        *TABLE_SHOWN, "", "South leads. A line | with a bar is no table.",
        "| neither | is this |",
    ]  # fmt: skip


# -- the example ------------------------------------------------------------------------------


def test_embed_minimal_example_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_minimal.py")],
        cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "send_email [denied]: Tool call denied by user." in result.stdout
    assert "task_end: completed" in result.stdout


# -- the demo brain, in-process ---------------------------------------------------------------


async def run_brain(
    tmp_path: Path, workspace: Path, prompt: str, approve: Any = "allow"
) -> tuple[list[Output], ScriptedProvider]:
    provider = ScriptedProvider(make_demo_brain(0))
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host:
            session = await host.create_session(
                provider=provider, tools=builtin_tools(), workspace_dir=workspace
            )
            decide = approve if callable(approve) else (lambda call: approve)
            outputs = await session.run(prompt, approve=decide).collect()
    assert provider.violations == []
    return outputs, provider


def final_text(outputs: list[Output]) -> str:
    texts = [o.block.text for o in outputs if isinstance(o, ModelMsg)
             and isinstance(o.block, TextBlock)]  # fmt: skip
    return texts[-1]


async def test_demo_brain_lists_reads_in_parallel_and_totals(
    tmp_path: Path, workspace: Path
) -> None:
    outputs, provider = await run_brain(tmp_path, workspace, DEMO_PROMPT)
    calls = [(o.turn, o.block) for o in outputs
             if isinstance(o, ModelMsg) and isinstance(o.block, ToolCallBlock)]  # fmt: skip
    assert [(turn, c.name, c.arguments) for turn, c in calls] == [
        (1, "list_dir", {"path": "."}),
        *[(2, "read_file", {"path": name}) for name in sorted(SALES)],
    ]
    assert [c.id for _, c in calls] == ["call_1_1", "call_2_1", "call_2_2", "call_2_3"]
    # the three reads were ONE model message (so they could share the pool's slots)
    assert len(provider.requests) == 3
    assistant = [m for m in provider.requests[2].messages if isinstance(m, AssistantMessage)]
    assert [sum(isinstance(b, ToolCallBlock) for b in m.content) for m in assistant] == [1, 3]
    end = outputs[-1]
    assert isinstance(end, TaskEnd)
    assert end.status == "completed"
    assert end.turns == 3
    assert_table_has_totals(final_text(outputs), expected_totals(workspace))


async def test_demo_brain_reports_a_denied_read_honestly(tmp_path: Path, workspace: Path) -> None:
    def approve(call: ToolCallBlock) -> str:
        return "deny" if call.arguments.get("path") == "sales_west.csv" else "allow"

    outputs, _ = await run_brain(tmp_path, workspace, DEMO_PROMPT, approve)
    text = final_text(outputs)
    assert 'sales_west.csv: the call was denied ("Tool call denied by user.")' in text
    totals = expected_totals(workspace)
    west = totals.pop("West")
    assert_table_has_totals(text, totals)
    assert west not in text


async def test_demo_brain_without_csv_files_says_so(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("nothing here\n")
    outputs, _ = await run_brain(tmp_path, empty, DEMO_PROMPT)
    assert "no CSV files" in final_text(outputs)
    assert [o.block.name for o in outputs if isinstance(o, ModelMsg)
            and isinstance(o.block, ToolCallBlock)] == ["list_dir"]  # fmt: skip


async def test_demo_brain_reports_a_tool_error(tmp_path: Path, workspace: Path) -> None:
    (workspace / "sales_broken.csv").write_bytes(b"date,region\0binary")
    outputs, _ = await run_brain(tmp_path, workspace, DEMO_PROMPT)
    errors = [o for o in outputs if isinstance(o, ToolCallOutput) and o.is_error]
    assert len(errors) == 1
    text = final_text(outputs)
    assert "sales_broken.csv: the tool failed (error:" in text
    clean = tmp_path / "clean"  # the totals of the readable files only
    write_demo_workspace(clean)
    assert_table_has_totals(text, expected_totals(clean))


async def test_demo_brain_answers_other_prompts_without_tools(
    tmp_path: Path, workspace: Path
) -> None:
    outputs, _ = await run_brain(tmp_path, workspace, "Write me a poem about trio.")
    assert not any(isinstance(o, ModelMsg) and isinstance(o.block, ToolCallBlock)
                   for o in outputs)  # fmt: skip
    text = final_text(outputs)
    assert 'You asked: "Write me a poem about trio."' in text
    assert "scripted model" in text


async def test_demo_brain_acknowledges_steering(tmp_path: Path, workspace: Path) -> None:
    provider = ScriptedProvider(make_demo_brain(0))
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host:
            session = await host.create_session(
                provider=provider, tools=builtin_tools(), workspace_dir=workspace
            )
            stream = session.run(DEMO_PROMPT, approve=lambda call: "allow")
            # queued before the first input assembly: it goes with the first request
            assert session.steer("Only the North region, please.")
            outputs = await stream.collect()
    texts = [o.block.text for o in outputs if isinstance(o, ModelMsg)
             and isinstance(o.block, TextBlock)]  # fmt: skip
    assert texts[0] == 'Noted: "Only the North region, please.".'
    assert isinstance(outputs[-1], TaskEnd)
    assert outputs[-1].status == "completed"
