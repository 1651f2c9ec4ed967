"""MCP configuration keys honoured and reported as the user expects (R-MCP-1, R-MCP-6), and
an MCP server's question that a stopped host left behind (R-HITL-5, R-HITL-4), against real
servers written with the SDK's server API (``tests/support/mcp_server.py``,
``tests/support/mcp_odd_server.py``)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.mcp import load_config_files
from greenroom.protocols.content import TextBlock
from greenroom.protocols.mcp_config import McpConfigError, parse_acp_servers, parse_config_text
from greenroom.protocols.outputs import ToolCallOutput

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.mock_model_server import Reply as WireReply  # noqa: E402
from tests.support.mock_model_server import Text, ToolUse, open_mock_server  # noqa: E402

SERVER = ROOT / "tests" / "support" / "mcp_server.py"
ODD_SERVER = ROOT / "tests" / "support" / "mcp_odd_server.py"


def stdio(**extra: Any) -> dict[str, Any]:
    """The test server over stdio, with the entry's ``extra`` keys."""
    return {"command": sys.executable, "args": [str(SERVER)], **extra}


def odd(**extra: Any) -> dict[str, Any]:
    """The odd server (its ``env`` tool reads a variable) over stdio, with ``extra`` keys."""
    return {"command": sys.executable, "args": [str(ODD_SERVER)], **extra}


@pytest.fixture
async def mcp_host(data_dir: Path) -> AsyncIterator[Host]:
    async with Host.open(data_dir) as host:
        yield host


def content_text(output: ToolCallOutput) -> str:
    return "\n".join(b.text for b in output.content if isinstance(b, TextBlock))


# -- disabledTools -------------------------------------------------------------------------


def test_disabled_tools_load_as_tool_names_and_anything_else_is_a_bad_entry() -> None:
    """R-MCP-6: Cline's and Roo Code's ``disabledTools`` was read past with a note saying
    greenroom offers every tool; it is now the set of tools not offered, with no note. A
    value that is not a list of tool names is a bad entry naming its JSON path (reported
    and skipped with a report, raised without one; in an ACP server list too)."""
    notes: list[str] = []
    servers = parse_config_text(json.dumps({"mcpServers": {
        "roo": {"command": "c", "disabledTools": ["rm", "write_file"]},
        "web": {"url": "https://example.test/mcp", "disabledTools": []},
        "text": {"command": "c", "disabledTools": "rm"},
        "number": {"command": "c", "disabledTools": ["rm", 1]},
    }}), "cline.json", notes.append)  # fmt: skip
    assert set(servers) == {"roo", "web"}
    assert servers["roo"].disabled_tools == frozenset({"rm", "write_file"})
    assert servers["web"].disabled_tools == frozenset()
    assert notes == [
        "cline.json: $.mcpServers.text.disabledTools: expected an array of strings; server "
        "'text' skipped, the others load",
        "cline.json: $.mcpServers.number.disabledTools[1]: expected a string; server "
        "'number' skipped, the others load",
    ]
    with pytest.raises(McpConfigError, match=r"\$\.mcpServers\.x\.disabledTools: expected an "):
        parse_config_text(json.dumps({"mcpServers": {"x": {"command": "c",
                                                           "disabledTools": {"rm": True}}}}),
                          "x.json")  # fmt: skip
    (acp,) = parse_acp_servers([{"name": "a", "command": "c", "disabledTools": ["rm"]}]).values()
    assert acp.disabled_tools == frozenset({"rm"})


async def test_a_disabled_tool_is_not_offered_and_a_call_of_it_is_an_unknown_tool(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-1, R-MCP-6: a tool the entry disables (``disabledTools``) is not among the
    session's tools nor in the model's request; the model calling it anyway gets the
    unknown-tool error, and the server never sees the call. Greenroom's own
    ``read_resource`` of the server is disabled by its name too; the other tools stay."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__t__echo", text="hello"),)),
        Reply(blocks=(tool_call("c2", "mcp__t__calls"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace,
        mcp_servers={"t": stdio(disabledTools=["echo", "read_resource"])},
    )  # fmt: skip
    names = {t.name for t in session.tools}
    assert {"mcp__t__calls", "mcp__t__structured"} <= names
    assert not names & {"mcp__t__echo", "mcp__t__read_resource"}
    outputs = await collect(session.run("go", approve=allow_all))
    offered = {schema.name for schema in provider.requests[0].tools}
    assert "mcp__t__calls" in offered and "mcp__t__echo" not in offered
    by_call = {o.call_id: o for o in of_type(outputs, ToolCallOutput)}
    assert by_call["c1"].is_error
    assert content_text(by_call["c1"]).startswith("Unknown tool 'mcp__t__echo'")
    assert json.loads(content_text(by_call["c2"])) == []  # echo never reached the server


async def test_a_disabled_tool_name_the_server_does_not_list_is_warned_about(
    mcp_host: Host, workspace: Path, providers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """R-MCP-6: a ``disabledTools`` name the server does not list (a typo) disables
    nothing; it is a warning naming the server and the name, not silence."""
    with caplog.at_level(logging.WARNING, logger="greenroom.mcp"):
        session = await mcp_host.create_session(
            provider=providers([]), workspace_dir=workspace,
            mcp_servers={"t": stdio(disabledTools=["echo", "ecoh"])},
        )  # fmt: skip
    assert "mcp__t__echo" not in {t.name for t in session.tools}
    warned = [r.getMessage() for r in caplog.records if "disabledTools" in r.getMessage()]
    assert warned == [
        "MCP server 't': disabledTools names 'ecoh', which the server does not list: it "
        "disables nothing"
    ]


# -- envFile problems ----------------------------------------------------------------------


async def test_env_file_problems_are_reported_with_the_configuration_naming_server_and_file(
    mcp_host: Host, workspace: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """R-MCP-6: an ``envFile`` that is missing, a directory, not UTF-8 or not simple
    ``KEY=VALUE`` lines went only to the log when its server started; it is reported among
    the configuration's warnings (``--mcp-config``), naming the server and the file and
    why, in one line. The server still loads and starts without it, and that start does
    not report the same problem again; a file that goes bad after the configuration was
    read is still noted when the server starts (it is read at each start)."""
    project = tmp_path / "project"
    (project / "dir.env").mkdir(parents=True)
    (project / "latin1.env").write_bytes(b"NAME=caf\xe9\n")
    (project / "bad.env").write_text("MODE=file\nMULTI=\"a\\nb\"\n")
    (project / "later.env").write_text("MODE=file\n")
    config = project / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "missing": odd(envFile="missing.env"),
        "dir": odd(envFile="dir.env"),
        "latin1": odd(envFile="latin1.env"),
        "bad": odd(envFile="bad.env"),
        "later": odd(envFile="later.env"),
    }}))  # fmt: skip
    notes: list[str] = []
    servers = load_config_files([config], notes.append)
    assert set(servers) == {"missing", "dir", "latin1", "bad", "later"}
    assert notes == [
        f"{config}: server 'missing': its envFile {project / 'missing.env'} is not loaded "
        "(No such file or directory); it starts without it",
        f"{config}: server 'dir': its envFile {project / 'dir.env'} is not loaded (Is a "
        "directory); it starts without it",
        f"{config}: server 'latin1': its envFile {project / 'latin1.env'} is not loaded (it "
        "is not UTF-8 text); it starts without it",
        f"{config}: server 'bad': its envFile {project / 'bad.env'} is not loaded (line 2 has "
        "a quoted value this does not read); it starts without it",
    ]
    (project / "later.env").write_text("MODE='unterminated\n")
    caplog.set_level(logging.DEBUG, logger="greenroom.mcp")
    with trio.fail_after(RUN_TIMEOUT_S):
        session = await mcp_host.create_session(workspace_dir=workspace, mcp_servers=servers)
    assert {f"mcp__{name}__env" for name in servers} <= {t.name for t in session.tools}
    env_notes = [r for r in caplog.records if "its envFile" in r.getMessage()]
    assert sorted((r.levelno, r.getMessage()) for r in env_notes) == [
        (logging.DEBUG, f"MCP server {name!r}: its envFile {project / file} is not loaded "
                        f"({why}); it starts without it")
        for name, file, why in sorted([
            ("bad", "bad.env", "line 2 has a quoted value this does not read"),
            ("dir", "dir.env", "Is a directory"),
            ("latin1", "latin1.env", "it is not UTF-8 text"),
            ("missing", "missing.env", "No such file or directory"),
        ])
    ] + [
        (logging.WARNING, f"MCP server 'later': its envFile {project / 'later.env'} is not "
                          "loaded (line 1 has a value this does not read); it starts without it")
    ]  # fmt: skip


async def test_cli_run_reports_env_file_problems_once_and_offers_no_disabled_tool(
    tmp_path: Path, workspace: Path
) -> None:
    """``greenroom run --mcp-config``: a missing ``envFile`` is one warning on stderr with
    the configuration's others (``warning: --mcp-config: FILE: server 'e': …``), not a
    second line when the server starts, and no traceback; the entry's ``disabledTools``
    are not in the model's tools (R-MCP-6, R-MCP-1)."""
    script = [
        WireReply([ToolUse("call_1", "mcp__e__env", {"name": "MODE"})], stop_reason="tool_use"),
        WireReply([Text("Done.")]),
    ]
    config = tmp_path / "servers.json"
    config.write_text(json.dumps({"mcpServers": {
        "e": odd(envFile="gone.env", env={"MODE": "env"}),
        "t": stdio(disabledTools=["echo", "crash"]),
    }}))  # fmt: skip
    env = {k: v for k, v in os.environ.items()
           if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")}
    env.update(GREENROOM_HOME=str(tmp_path / "home"), NO_COLOR="1", OPENAI_API_KEY="test-key")
    async with open_mock_server(*script) as model:
        with trio.fail_after(RUN_TIMEOUT_S * 3):
            result = await trio.run_process(
                [sys.executable, "-m", "greenroom", "run", "--json",
                 "--provider", "openai", "--model", "mock-model",
                 "--base-url", model.base_url + "/v1", "--approve", "all",
                 "--workspace", str(workspace), "--mcp-config", str(config), "go"],
                cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True,
                check=False, stdin=b"",
            )  # fmt: skip
        model.assert_clean()
        tool_names = {t["function"]["name"] for t in model.requests[0].body["tools"]}
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    warning = (f"warning: --mcp-config: {config}: server 'e': its envFile {tmp_path / 'gone.env'}"
               " is not loaded (No such file or directory); it starts without it")
    assert warning in stderr.splitlines(), stderr
    assert stderr.count("its envFile") == 1, stderr
    assert "Traceback" not in stderr
    assert {"mcp__e__env", "mcp__t__structured"} <= tool_names
    assert not tool_names & {"mcp__t__echo", "mcp__t__crash"}
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    (output,) = [o for o in lines if o["type"] == "tool_call_output"]
    assert output["content"][0]["text"] == "env"


# -- a question whose server went with its host ----------------------------------------------

ASKING_HOST = textwrap.dedent(
    """
    import sys, trio
    from greenroom.actors.providers.scripted import Reply, ScriptedProvider, tool_call
    from greenroom.actors.runtime.host import Host
    from greenroom.protocols.people import PEOPLE

    data_dir, workspace, server = sys.argv[1:4]

    def on_batch(batch):
        for out in batch:  # published once written: the question is in the trace
            if out.TYPE == "approval_request" and out.kind == "question":
                print("asked", flush=True)

    async def main():
        async with Host.open(data_dir) as host:
            order = tool_call("o1", "mcp__t__order", item="shirt")
            session = await host.create_session(
                provider=ScriptedProvider([Reply(blocks=(order,))]), workspace_dir=workspace,
                mcp_servers={"t": {"command": sys.executable, "args": [server]}},
            )
            print(session.id, flush=True)
            session.subscribe(on_batch)
            session.run("order a shirt", approve=PEOPLE).detach()
            await session.wait_idle()  # parked on the call's approval
            await host.answer_approval(session.id, "o1", "allow")
            await trio.sleep_forever()  # killed while the server's question waits

    trio.run(main)
    """
)


async def test_a_servers_question_is_never_listed_once_the_host_that_ran_it_is_gone(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-HITL-5, R-HITL-4: an MCP server asks a question during a call (elicitation), and
    its host is killed. The next host, opened with ``resume_tasks``, listed that question as
    answerable from the moment it took the task up until the call was settled as in doubt:
    the server process that asked is dead, and nobody can answer it. It is never listed;
    the question about the call in doubt follows, and is."""
    script = tmp_path / "ask.py"
    script.write_text(ASKING_HOST)
    process = await trio.lowlevel.open_process(
        [sys.executable, str(script), str(data_dir), str(workspace), str(SERVER)],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        lines = b""
        with trio.fail_after(RUN_TIMEOUT_S):
            while b"asked" not in lines:
                lines += await process.stdout.receive_some()
        sid = lines.split()[0].decode()
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()

    async with Host.open(data_dir, resume_tasks=True, mcp_servers={"t": stdio()}) as host:
        port = host.port(sid)
        assert port.inbox is not None  # taken up: a supervisor runs the task
        assert [p.kind for p in await host.pending_approvals()] == []
        with trio.fail_after(RUN_TIMEOUT_S):
            await port.wait_idle()  # parked: it waits for a person to say what became of o1
        listed = await host.pending_approvals()
        assert [(p.call_id, p.kind) for p in listed] == [("o1", "in_doubt")]
