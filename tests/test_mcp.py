"""Tools from MCP servers (R-MCP-1…4) against real servers written with the SDK's server API
(``tests/support/mcp_server.py``), over stdio and streamable HTTP, through real sessions
driven by the scripted model."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import (
    RUN_TIMEOUT_S,
    Recorder,
    allow_all,
    collect,
    last_user,
    of_type,
    port_of,
    results_of,
    trace_lines,
)
from test_people import until_parked
from trio_websocket import open_websocket_url

from greenroom.actors.gateway import Gateway, SessionDefaults, run_serve
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedStream,
    model_error,
    text,
    tool_call,
)
from greenroom.actors.runtime.errors import ConfigurationError, NotPending
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.tools import mcp as mcp_module
from greenroom.actors.tools.mcp import McpConnection, McpServerError, load_config_files
from greenroom.protocols.content import ImageBlock, TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.effects import idempotency_key
from greenroom.protocols.mcp_config import (
    DEFAULT_TIMEOUT_S,
    McpConfigError,
    McpServerConfig,
    merge_configs,
    parse_acp_servers,
    parse_config_text,
    schema_problem,
)
from greenroom.protocols.outputs import (
    ApprovalDecision,
    ApprovalRequest,
    TaskEnd,
    ToolCallOutput,
    ToolProgress,
)
from greenroom.protocols.people import PEOPLE, PendingApproval
from greenroom.protocols.tools import validate_json

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.mock_model_server import Reply as WireReply  # noqa: E402
from tests.support.mock_model_server import Text, ToolUse, open_mock_server  # noqa: E402

SERVER = ROOT / "tests" / "support" / "mcp_server.py"
GREENROOM = str(Path(sys.executable).parent / "greenroom")
"""The console script (``python -m greenroom.actors.apps.cli`` would load the CLI module twice
when ``chat`` imports it, and its errors would not be the ones ``main`` looks for)."""
STDIO = {"command": sys.executable, "args": [str(SERVER)]}


def stdio(**extra: Any) -> dict[str, Any]:
    return {**STDIO, **extra}


def connection(host: Host, name: str) -> McpConnection:
    return next(c for c in host._builder.mcp.connections() if c.name == name)


def outputs_by_call(outputs: list[Any]) -> dict[str, ToolCallOutput]:
    return {o.call_id: o for o in of_type(outputs, ToolCallOutput)}


def content_text(output: ToolCallOutput) -> str:
    return "\n".join(b.text for b in output.content if isinstance(b, TextBlock))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped: it counts as gone only once reaped.
    return Path(f"/proc/{pid}").exists()


@contextlib.contextmanager
def http_server(transport: str = "http", *options: str) -> Iterator[str]:
    """The test server over streamable HTTP (or ``"sse"``: the legacy HTTP+SSE transport)
    on 127.0.0.1 (port 0), with the server's ``options`` (``--json``); yields its URL."""
    process = subprocess.Popen(
        [sys.executable, str(SERVER), f"--{transport}", *options],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("PORT "), line
        path = "sse" if transport == "sse" else "mcp"
        yield f"http://127.0.0.1:{int(line.split()[1])}/{path}"
    finally:
        process.terminate()
        process.wait(timeout=10)


# -- configuration (pure) ------------------------------------------------------------------


def test_config_parses_stdio_and_http_servers() -> None:
    text_ = json.dumps({
        "other": "ignored",
        "mcpServers": {
            "files": {"command": "npx", "args": ["-y", "srv"], "env": {"K": "v"}},
            "web": {"type": "http", "url": "http://127.0.0.1:1/mcp",
                    "headers": {"Authorization": "Bearer t"}, "parallel": ["get"],
                    "timeout_s": 5, "scope": "session"},
            "inferred": {"url": "https://example.test/mcp"},
        },
    })  # fmt: skip
    servers = parse_config_text(text_, "servers.json")
    assert servers["files"] == McpServerConfig(
        name="files", transport="stdio", command="npx", args=("-y", "srv"), env=(("K", "v"),)
    )
    web = servers["web"]
    assert (web.transport, web.url, web.headers) == (
        "http", "http://127.0.0.1:1/mcp", (("Authorization", "Bearer t"),)
    )
    assert (web.parallel, web.timeout_s, web.scope) == (("get",), 5.0, "session")
    assert servers["inferred"].transport == "http"


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ({"x": {"command": 3}}, "$.mcpServers.x.command: expected a string"),
        ({"x": {}}, "$.mcpServers.x.command: expected a string"),
        ({"x": {"command": "c", "args": ["a", 1]}}, "$.mcpServers.x.args[1]: expected a string"),
        ({"x": {"command": "c", "env": {"A": 1}}}, "$.mcpServers.x.env.A: expected a string"),
        ({"x": {"command": "c", "timeout_s": 0}}, "$.mcpServers.x.timeout_s: expected a positive"),
        ({"x": {"command": "c", "parallel": "yes"}}, "$.mcpServers.x.parallel: expected true"),
        ({"x": {"command": "c", "scope": "all"}}, "$.mcpServers.x.scope: expected"),
        ({"x": {"command": "c", "comand": "c"}}, "$.mcpServers.x.comand: unknown key"),
        ({"x": {"type": "ws", "url": "u"}}, "$.mcpServers.x.type: expected \"stdio\", \"http\""),
        ({"x": {"command": "c", "disabled": "yes"}}, "$.mcpServers.x.disabled: expected true"),
        ({"x": {"type": "http", "url": "ftp://h"}}, "$.mcpServers.x.url: expected an http"),
        ({"x": {"type": "http", "url": "http://h", "command": "c"}}, "$.mcpServers.x.command"),
        ({"a__b": {"command": "c"}}, "$.mcpServers.a__b: server name 'a__b' must be"),
        ({"a.b": {"command": "c"}}, "$.mcpServers.a.b: server name 'a.b' must be"),
        ([], "$.mcpServers: expected an object"),
    ],
)
def test_bad_config_names_file_and_json_path(servers: Any, message: str) -> None:
    with pytest.raises(McpConfigError) as caught:
        parse_config_text(json.dumps({"mcpServers": servers}), "servers.json")
    assert str(caught.value).startswith("servers.json: ")
    assert message in str(caught.value)


def test_config_file_problems_are_named() -> None:
    with pytest.raises(McpConfigError, match=r"^f\.json: not JSON: .*line 1"):
        parse_config_text("{", "f.json")
    with pytest.raises(McpConfigError, match=r"^f\.json: \$\.mcpServers: required"):
        parse_config_text("{}", "f.json")
    with pytest.raises(McpConfigError, match=r"no such file"):
        load_config_files(["/nonexistent/servers.json"])
    one = parse_config_text('{"mcpServers": {"x": {"command": "c"}}}', "a.json")
    with pytest.raises(McpConfigError, match=r"^b\.json: .*also configured in a\.json"):
        merge_configs([("a.json", one), ("b.json", one)])


def test_the_configurations_of_common_clients_load() -> None:
    """R-MCP-6: Claude's ``mcpServers`` with ``"type": "sse"``, Cline's ``disabled``,
    ``transportType`` and ``autoApprove``, VS Code's ``servers`` with ``inputs``."""
    claude = parse_config_text(json.dumps({"mcpServers": {
        "legacy": {"type": "sse", "url": "http://127.0.0.1:1/sse", "headers": {"A": "b"}},
        "off": {"command": "c", "disabled": True},
        "on": {"command": "c", "disabled": False, "autoApprove": ["x"], "alwaysAllow": []},
        "cline": {"transportType": "sse", "url": "http://127.0.0.1:1/sse"},
    }}), "claude.json")  # fmt: skip
    assert claude["legacy"] == McpServerConfig(
        name="legacy", transport="sse", url="http://127.0.0.1:1/sse", headers=(("A", "b"),)
    )
    assert set(claude) == {"legacy", "on", "cline"}
    assert claude["cline"].transport == "sse"
    notes: list[str] = []
    vscode = parse_config_text(json.dumps({
        "inputs": [{"type": "promptString", "id": "key"}],
        "servers": {
            "files": {"type": "stdio", "command": "npx", "args": ["srv"]},
            "web": {"type": "http", "url": "https://example.test/mcp"},
            "old": {"type": "sse", "url": "https://example.test/sse"},
        },
    }), "mcp.json", notes.append)  # fmt: skip
    assert {n: c.transport for n, c in vscode.items()} == {
        "files": "stdio", "web": "http", "old": "sse"}
    assert notes == [
        "mcp.json: $.inputs: ignored (VS Code input variables are not supported; a "
        "${input:…} in a value is passed as written)"
    ]
    settings = parse_config_text(
        json.dumps({"editor.fontSize": 12, "mcp": {"servers": {"a": {"command": "c"}}}}),
        "settings.json",
    )
    assert set(settings) == {"a"}


def test_one_bad_entry_is_reported_and_skipped(tmp_path: Path) -> None:
    """R-MCP-6: with a reporter, a bad entry is named with why and skipped, the others
    load; so is a server given again in a second file. Without one it raises."""
    first = tmp_path / "a.json"
    first.write_text(json.dumps({"mcpServers": {
        "good": {"command": "c"},
        "bad": {"command": 3},
        "worse": {"type": "ws", "url": "u"},
        "bad.name": {"command": "c"},
    }}))  # fmt: skip
    second = tmp_path / "b.json"
    second.write_text(json.dumps({"servers": {"good": {"command": "d"}, "more": {"command": "e"}}}))
    notes: list[str] = []
    servers = load_config_files([first, second], notes.append)
    assert set(servers) == {"good", "more"}
    assert servers["good"].command == "c"
    assert notes == [
        f"{first}: $.mcpServers.bad.command: expected a string; server 'bad' skipped, "
        "the others load",
        f"{first}: $.mcpServers.worse.type: expected \"stdio\", \"http\" or \"sse\", got "
        "'ws'; server 'worse' skipped, the others load",
        f"{first}: $.mcpServers.bad.name: server name 'bad.name' must be letters, digits, "
        "'_' and '-', without '__' (it becomes part of the tool names "
        "mcp__<server>__<tool>); server 'bad.name' skipped, the others load",
        f"{second}: $.mcpServers.good: server 'good' is also configured in {first}; the "
        f"one in {first} is used",
    ]
    with pytest.raises(McpConfigError, match=r"bad\.command: expected a string"):
        load_config_files([first])


def test_parallel_is_declared_never_guessed() -> None:
    """R-MCP-2: readOnlyHint or the configuration; the configuration wins when given."""
    base = McpServerConfig(name="s", transport="stdio", command="c")
    assert base.is_parallel("t", True) and not base.is_parallel("t", None)
    assert not base.is_parallel("t", False)
    assert McpServerConfig(name="s", transport="stdio", command="c", parallel=True
                           ).is_parallel("t", None)  # fmt: skip
    assert not McpServerConfig(name="s", transport="stdio", command="c", parallel=False
                               ).is_parallel("t", True)  # fmt: skip
    listed = McpServerConfig(name="s", transport="stdio", command="c", parallel=("a",))
    assert listed.is_parallel("a", None) and not listed.is_parallel("b", True)


def test_schema_problems() -> None:
    assert schema_problem({"type": "object", "properties": {"type": {"type": "string"}}}) is None
    assert schema_problem({"type": "object", "properties": {"x": {"type": ["string", "null"]}}}
                          ) is None  # fmt: skip
    assert "unknown type 'file'" in (
        schema_problem({"type": "object", "properties": {"x": {"type": "file"}}}) or ""
    )
    assert "not 'object'" in (schema_problem({"type": "string"}) or "")
    assert schema_problem([]) is not None


def test_a_server_schema_the_argument_check_cannot_read_is_a_schema_problem() -> None:
    """R-TOOL-5, R-MCP-1: boolean subschemas (``true``: any value) are JSON Schema a server
    may list, and every call of such a tool failed with ``TypeError("argument of type
    'bool' is not iterable")`` from the argument check; they are checked now. A keyword
    the check iterates that is not a list (``enum: 5``, ``required`` naming a property by
    an object, a schema ``5``) failed each call alike; the tool is skipped when listed."""
    any_value = {"type": "object", "properties": {"a": True, "b": {"type": "array",
                 "items": True, "prefixItems": [True, False]}}}  # fmt: skip
    assert schema_problem(any_value) is None
    assert validate_json({"a": {"x": 1}}, any_value) == []
    assert validate_json({"b": [1, 2]}, any_value) == ["$.b[1]: no value is allowed here"]
    unreadable = {
        "enum": {"type": "object", "properties": {"a": {"enum": 5}}},
        "required": {"type": "object", "properties": {}, "required": ["a", {"x": 1}]},
        "anyOf[0]": {"type": "object", "properties": {"a": {"anyOf": [5]}}},
        # A map of named schemas that is no map: the check reads its items by name.
        "$.properties.a.properties": {"type": "object", "properties": {"a": {"properties": 5}}},
        "$.properties.a.$defs": {"type": "object", "properties": {"a": {"$defs": [1]}}},
    }
    for key, schema in unreadable.items():
        assert key in (schema_problem(schema) or ""), key


def test_acp_server_list_converts() -> None:
    servers = parse_acp_servers([
        {"name": "a", "command": "c", "args": [], "env": [{"name": "K", "value": "v"}]},
        {"type": "http", "name": "b", "url": "http://h/mcp",
         "headers": [{"name": "H", "value": "1"}]},
    ])  # fmt: skip
    assert servers["a"].env == (("K", "v"),)
    assert servers["b"].headers == (("H", "1"),)
    with pytest.raises(McpConfigError, match=r"\$\.mcpServers\[0\]\.command"):
        parse_acp_servers([{"name": "a", "command": 1}])


# -- through sessions ------------------------------------------------------------------------


@pytest.fixture
async def mcp_host(data_dir: Path) -> AsyncIterator[Host]:
    async with Host.open(data_dir) as host:
        yield host


async def test_tools_are_listed_with_schemas_and_called_end_to_end(
    mcp_host: Host, workspace: Path, providers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """R-MCP-1, R-MCP-3: names, schemas, text, structured content, images, resources,
    isError; an unusable schema skips that tool alone with a warning."""
    provider = providers([
        Reply(blocks=(
            tool_call("c1", "mcp__t__echo", text="hello"),
            tool_call("c2", "mcp__t__structured", a=2, b=3),
            tool_call("c3", "mcp__t__image"),
            tool_call("c4", "mcp__t__resource"),
            tool_call("c5", "mcp__t__fail", message="it broke"),
        )),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    names = {t.name for t in session.tools}
    assert {"mcp__t__echo", "mcp__t__structured", "mcp__t__hang"} <= names
    assert "mcp__t__bad_schema" not in names
    assert any("bad_schema" in r.getMessage() and "unknown type" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    echo = next(t for t in session.tools if t.name == "mcp__t__echo")
    assert echo.input_schema["properties"]["text"]["type"] == "string"
    assert echo.description == "Echo the text back."
    outputs = await collect(session.run("go", approve=allow_all))
    assert outputs[-1].status == "completed"  # type: ignore[attr-defined]
    by_call = outputs_by_call(outputs)
    assert (by_call["c1"].status, content_text(by_call["c1"])) == ("ok", "hello")
    assert json.loads(by_call["c2"].content[-1].text) == {"sum": 5}  # type: ignore[union-attr]
    images = [b for b in by_call["c3"].content if isinstance(b, ImageBlock)]
    assert len(images) == 1 and images[0].media_type == "image/png"
    assert Path(images[0].path).parent == session.scratchpad_dir
    assert (await trio.Path(images[0].path).read_bytes()).startswith(b"\x89PNG")
    assert "the notes" in content_text(by_call["c4"])
    assert by_call["c5"].is_error and "it broke" in content_text(by_call["c5"])
    assert [r.is_error for r in results_of(last_user(provider.requests[-1]))] == [
        False, False, False, False, True
    ]


async def test_an_mcp_call_carries_its_idempotency_key_in_meta(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-EFFECT-1: the server receives the call's key in the ``tools/call`` request's
    ``_meta`` (``greenroom/idempotency_key``): the key the trace gives the call."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__t__sent_key"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    outputs = await collect(session.run("go", approve=allow_all))
    (call,) = [
        line for line in trace_lines(session)
        if line["type"] == "model_msg" and line["block"]["type"] == "tool_call"
    ]  # fmt: skip
    sent = content_text(outputs_by_call(outputs)["c1"])
    assert sent == idempotency_key(session.id, call["seq"], "c1")


async def test_approval_decides_mcp_calls(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-1: MCP calls go through approval; a denied call never reaches the server."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__t__echo", text="yes"),
                      tool_call("c2", "mcp__t__structured", a=1, b=1))),
        Reply(blocks=(tool_call("c3", "mcp__t__calls"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    asked: list[str] = []

    def approve(call: ToolCallBlock) -> str:
        asked.append(call.name)
        return "deny" if call.name == "mcp__t__structured" else "allow"

    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    by_call = outputs_by_call(await collect(session.run("go", approve=approve)))
    assert asked == ["mcp__t__echo", "mcp__t__structured", "mcp__t__calls"]
    assert by_call["c2"].status == "denied"
    assert json.loads(content_text(by_call["c3"])) == ["echo"]


async def test_read_only_tools_share_slots_and_others_run_alone(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-2: readOnlyHint tools run together; other tools are exclusive."""
    provider = providers([
        Reply(blocks=(tool_call("r1", "mcp__t__ro_block", key="a"),
                      tool_call("r2", "mcp__t__ro_block", key="b"))),
        Reply(blocks=(tool_call("w1", "mcp__t__block", key="c"),
                      tool_call("w2", "mcp__t__block", key="d"))),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    tools = {t.name: t for t in session.tools}
    assert tools["mcp__t__ro_block"].parallel and not tools["mcp__t__block"].parallel
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    server = connection(mcp_host, "t")
    # Both read-only calls are running at once before either is released.
    await recorder.wait_for("tool_progress", call_id="r1")
    await recorder.wait_for("tool_progress", call_id="r2")
    await server.call("release", {"key": "a"}, None)
    await server.call("release", {"key": "b"}, None)
    await recorder.wait_for("tool_progress", call_id="w1")
    # The second exclusive call has not reached the server while the first runs.
    started = await server.call("calls", {}, None)
    assert json.loads(started[0].text)[-1] == "block:c"  # type: ignore[union-attr]
    assert not recorder.seen("tool_progress", call_id="w2")
    await server.call("release", {"key": "c"}, None)
    await recorder.wait_for("tool_progress", call_id="w2")
    await server.call("release", {"key": "d"}, None)
    outputs = await collect(stream)
    assert [o.status for o in of_type(outputs, ToolCallOutput)] == ["ok"] * 4
    assert outputs[-1].status == "completed"  # type: ignore[attr-defined]
    progress = of_type(outputs, ToolProgress)
    assert any(p.message.startswith("started a") for p in progress)


async def test_a_crash_mid_call_is_an_error_output_and_the_next_call_restarts_it(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-4: the crashed call gets an error output, the task goes on, the next call
    starts the server again."""
    provider = providers([
        Reply(blocks=(tool_call("p1", "mcp__t__pid"),)),
        Reply(blocks=(tool_call("c1", "mcp__t__crash"),)),
        Reply(blocks=(tool_call("p2", "mcp__t__pid"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    outputs = await collect(session.run("go", approve=allow_all))
    by_call = outputs_by_call(outputs)
    assert by_call["c1"].is_error
    assert "stopped during crash" in content_text(by_call["c1"])
    assert by_call["p2"].status == "ok"
    first, second = (int(content_text(by_call[c]).splitlines()[0]) for c in ("p1", "p2"))
    assert first != second
    assert not alive(first)
    assert outputs[-1].status == "completed"  # type: ignore[attr-defined]


async def test_a_server_that_cannot_start_gives_error_outputs(
    mcp_host: Host, workspace: Path, providers: Any, tmp_path: Path
) -> None:
    """R-MCP-4: no tools from it, no failed task; its calls (by name) are error outputs."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__gone__echo", text="x"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace,
        mcp_servers={"gone": {"command": str(tmp_path / "no-such-server")}},
    )  # fmt: skip
    assert not [t for t in session.tools if t.name.startswith("mcp__gone__")]
    outputs = await collect(session.run("go", approve=allow_all))
    assert outputs_by_call(outputs)["c1"].is_error
    assert outputs[-1].status == "completed"  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="could not be started"):
        await connection(mcp_host, "gone").list_tools()


async def test_interrupting_a_hanging_call_sends_the_cancellation(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-3: interrupt → task_end aborted promptly, and the server sees the MCP
    cancellation of its request."""
    provider = providers([Reply(blocks=(tool_call("h1", "mcp__t__hang", key="k1"),))])
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await recorder.wait_for("tool_progress", call_id="h1")
    session.interrupt()
    with trio.fail_after(1.0):
        outputs = await stream.collect()
    end = of_type(outputs, TaskEnd)[-1]
    assert end.status == "aborted"
    server = connection(mcp_host, "t")
    cancelled: list[str] = []
    for _ in range(50):  # the server handles the notification in its own time
        result = await server.call("cancelled", {}, None)
        cancelled = json.loads(result[0].text)  # type: ignore[union-attr]
        if cancelled:
            break
    assert cancelled == ["k1"]


async def test_a_call_past_its_timeout_is_an_error_and_is_cancelled(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-4: a hanging server gives an error output (timeout_s), never a hung task."""
    provider = providers([
        Reply(blocks=(tool_call("h1", "mcp__t__hang", key="k2"),)),
        Reply(blocks=(tool_call("e1", "mcp__t__echo", text="still here"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio(timeout_s=0.5)}
    )
    outputs = await collect(session.run("go", approve=allow_all))
    by_call = outputs_by_call(outputs)
    assert by_call["h1"].is_error and "did not answer hang within 0.5 s" in content_text(
        by_call["h1"]
    )
    assert content_text(by_call["e1"]) == "still here"  # pinged, answered, kept
    assert outputs[-1].status == "completed"  # type: ignore[attr-defined]


async def test_a_changed_tool_list_is_picked_up_at_the_next_turn(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-4: the server adds a tool during turn 1; turn 1's requests keep the old list,
    turn 2's request has the new tool, and calling it works."""
    seen: list[set[str]] = []

    def step(request: ModelRequest) -> Reply:
        seen.append({t.name for t in request.tools})
        if len(seen) == 1:
            return Reply(blocks=(tool_call("a1", "mcp__t__add_tool", tool="extra"),))
        if len(seen) == 2:
            return Reply(blocks=(tool_call("x1", "mcp__t__extra"),))
        return Reply(blocks=(text("done"),))

    provider = providers([step, step, step])
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    outputs = await collect(session.run("go", approve=allow_all))
    assert "mcp__t__extra" not in seen[0]
    assert "mcp__t__extra" in seen[1]
    assert content_text(outputs_by_call(outputs)["x1"]) == "I am extra"


async def test_a_retry_within_a_turn_keeps_the_tool_list(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-4: a list that changes between two attempts of one turn is not in the retry
    (the request prefix stays the same); the next turn has it."""
    seen: list[set[str]] = []

    async def failing_attempt(request: ModelRequest, stream: ScriptedStream) -> None:
        seen.append({t.name for t in request.tools})
        server = connection(mcp_host, "t")
        listed = trio.Event()
        server.listeners.add(listed.set)
        await server.call("add_tool", {"tool": "mid"}, None)
        await listed.wait()
        await stream.fail(model_error("timeout", "the model timed out"))

    def step(request: ModelRequest) -> Reply:
        seen.append({t.name for t in request.tools})
        if len(seen) == 2:
            return Reply(blocks=(tool_call("e1", "mcp__t__echo", text="x"),))
        return Reply(blocks=(text("done"),))

    provider = providers([failing_attempt, step, step])
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    outputs = await collect(session.run("go", approve=allow_all))
    assert outputs[-1].status == "completed"  # type: ignore[attr-defined]
    assert [("mcp__t__mid" in names) for names in seen] == [False, False, True]


async def test_a_change_while_idle_is_applied_at_once(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-4: between tasks is a turn boundary too: an idle session's table changes as
    soon as the new list is in, and its next request offers the new tool."""
    provider = providers([Reply(blocks=(text("done"),))])
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    server = connection(mcp_host, "t")
    listed = trio.Event()
    server.listeners.add(listed.set)
    await server.call("add_tool", {"tool": "later"}, None)
    with trio.fail_after(RUN_TIMEOUT_S):
        await listed.wait()
    assert "mcp__t__later" in {t.name for t in session.tools}
    await collect(session.run("go", approve=allow_all))
    assert "mcp__t__later" in {t.name for t in provider.requests[0].tools}


async def test_a_flood_of_list_changes_is_one_fetch_at_a_time(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-4, R-SEC-1: every ``notifications/tools/list_changed`` started a fetch of the
    whole list of its own, so a server that sent a flood of them had the host run as many
    fetches at once (tasks, requests, listings held) as it sent notifications. Fetches now
    run one at a time, one more after a change announced during one (about 15 here)."""
    await mcp_host.create_session(
        provider=providers([]), workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    server = connection(mcp_host, "t")
    with trio.fail_after(RUN_TIMEOUT_S):
        [before] = await server.call("listings", {}, None)
        await server.call("flood", {"count": 200}, None)
        while server.refreshing is not None:
            await server.refreshing.wait()
        [after] = await server.call("listings", {}, None)
    assert isinstance(before, TextBlock) and isinstance(after, TextBlock)
    assert int(after.text) - int(before.text) <= 50  # 200 before: one per notification


async def test_sessions_share_one_process_and_close_leaves_no_orphans(
    data_dir: Path, workspace: Path, providers: Any
) -> None:
    """One process per host per configured server, one per session with scope session;
    closing the host stops every server process."""
    pids: list[int] = []
    async with Host.open(data_dir) as host:
        servers = {"t": stdio(), "own": stdio(scope="session")}
        for _ in range(3):
            provider = providers([
                Reply(blocks=(tool_call("p1", "mcp__t__pid"), tool_call("p2", "mcp__own__pid"))),
                Reply(blocks=(text("done"),)),
            ])  # fmt: skip
            session = await host.create_session(
                provider=provider, workspace_dir=workspace, mcp_servers=servers
            )
            by_call = outputs_by_call(await collect(session.run("go", approve=allow_all)))
            pids += [int(content_text(by_call[c]).splitlines()[0]) for c in ("p1", "p2")]
        shared, own = set(pids[0::2]), set(pids[1::2])
        assert len(shared) == 1 and len(own) == 3
        closed = pids[1]
        await host.close_session(host.sessions[0].id)
        assert not alive(closed)
        assert all(alive(pid) for pid in {*shared, *own} - {closed})
    assert not [pid for pid in pids if alive(pid)]


async def test_streamable_http_server(mcp_host: Host, workspace: Path, providers: Any) -> None:
    """R-MCP-1 over streamable HTTP: listed, called, progress, isError."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__h__echo", text="over http"),
                      tool_call("c2", "mcp__h__fail", message="nope"))),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    with http_server() as url:
        session = await mcp_host.create_session(
            provider=provider, workspace_dir=workspace,
            mcp_servers={"h": {"type": "http", "url": url, "headers": {"X-Test": "1"}}},
        )  # fmt: skip
        outputs = await collect(session.run("go", approve=allow_all))
    by_call = outputs_by_call(outputs)
    assert content_text(by_call["c1"]) == "over http"
    assert by_call["c2"].is_error and "nope" in content_text(by_call["c2"])


@pytest.mark.parametrize("options", [(), ("--json",)], ids=["sse", "json"])
async def test_an_oversized_http_message_fails_its_call_and_the_session_goes_on(
    mcp_host: Host, workspace: Path, providers: Any, options: tuple[str, ...]
) -> None:
    """R-SEC-1, R-MCP-4: a tool result of 3 MiB over streamable HTTP. As an SSE event the
    SDK stops reading it at its event bound; as a JSON body the SDK read it whole, however
    large, before greenroom cut it: now reading stops at the same bound
    (``mcp_bounds.MAX_MESSAGE_BYTES``) and that call gets an error naming it. The next
    call on the same connection works."""
    provider = providers([
        # Three times the bound: the server makes and sends it within the run's bound
        # even on a busy machine (64 MiB took 6-13 s there), and either transport, unbounded,
        # reads it whole (the call succeeds with its text).
        Reply(blocks=(tool_call("c1", "mcp__h__big", mebibytes=3),)),
        Reply(blocks=(tool_call("c2", "mcp__h__echo", text="still here"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    with http_server("http", *options) as url:
        session = await mcp_host.create_session(
            provider=provider, workspace_dir=workspace,
            mcp_servers={"h": {"type": "http", "url": url}},
        )  # fmt: skip
        outputs = await collect(session.run("go", approve=allow_all))
    by_call = outputs_by_call(outputs)
    assert by_call["c1"].is_error, content_text(by_call["c1"])[:200]
    assert "xxxx" not in content_text(by_call["c1"])
    if options:
        assert "larger than 1 MiB" in content_text(by_call["c1"])
    assert content_text(by_call["c2"]) == "still here"


async def test_an_oversized_stdio_message_fails_its_call_and_the_connection_goes_on(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-SEC-1, R-SEC-9, R-MCP-4: a tool result of 3 MiB on one line over stdio. The SDK's
    stdio_client joined it whole and the call succeeded with all of it; greenroom's own
    transport keeps 1 MiB of a line (``mcp_bounds.MAX_MESSAGE_BYTES``), so that call gets
    an error naming the bound, and the next call goes to the same server process."""
    provider = providers([
        Reply(blocks=(tool_call("c0", "mcp__t__pid"),)),
        Reply(blocks=(tool_call("c1", "mcp__t__big", mebibytes=3),)),
        Reply(blocks=(tool_call("c2", "mcp__t__echo", text="still here"),
                      tool_call("c3", "mcp__t__pid"))),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    outputs = await collect(session.run("go", approve=allow_all))
    by_call = outputs_by_call(outputs)
    assert by_call["c1"].is_error, content_text(by_call["c1"])[:200]
    assert "larger than 1 MiB" in content_text(by_call["c1"])
    assert "xxxx" not in content_text(by_call["c1"])
    assert content_text(by_call["c2"]) == "still here"
    assert content_text(by_call["c3"]) == content_text(by_call["c0"])


async def test_legacy_sse_server(mcp_host: Host, workspace: Path, providers: Any) -> None:
    """R-MCP-6: a server on the legacy HTTP+SSE transport (``"type": "sse"``) is listed
    and called like any other."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__old__echo", text="over sse"),
                      tool_call("c2", "mcp__old__fail", message="nope"))),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    with http_server("sse") as url:
        session = await mcp_host.create_session(
            provider=provider, workspace_dir=workspace,
            mcp_servers={"old": {"type": "sse", "url": url}},
        )  # fmt: skip
        outputs = await collect(session.run("go", approve=allow_all))
    by_call = outputs_by_call(outputs)
    assert content_text(by_call["c1"]) == "over sse"
    assert by_call["c2"].is_error and "nope" in content_text(by_call["c2"])


@pytest.mark.parametrize(
    ("tool", "answered"),
    [
        ("http_500", "HTTP 500 Internal Server Error"),
        ("redirect_loop", "HTTP 307 Temporary Redirect after 20 redirects"),
    ],
)
async def test_a_legacy_sse_post_that_fails_fails_its_call_at_once(
    mcp_host: Host, workspace: Path, tool: str, answered: str
) -> None:
    """R-MCP-4, R-SEC-9: over the legacy HTTP+SSE transport a message's POST answered with
    HTTP 500, or redirected within its origin past the ``max_redirects`` the SDK follows,
    stopped the SDK's sender silently, so that call and every later one waited out its
    timeout_s. It ends the connection now: the call fails at once naming the status, and
    the next call connects again."""
    with http_server("sse") as url:
        await mcp_host.create_session(
            workspace_dir=workspace,
            mcp_servers={"old": {"type": "sse", "url": url, "timeout_s": 600}},
        )
        server = connection(mcp_host, "old")
        with trio.fail_after(RUN_TIMEOUT_S):
            with pytest.raises(McpServerError) as caught:
                await server.call(tool, {}, None)
            (again,) = await server.call("echo", {"text": "again"}, None)
    assert str(caught.value) == (
        f"MCP server 'old' stopped during {tool}: the connection failed: 127.0.0.1 "
        f"answered a message with {answered}; it is started again on its next use"
    )
    assert again == TextBlock(text="again")


async def serve_events_then_refuse(*, task_status: trio.TaskStatus[str]) -> None:
    """A legacy HTTP+SSE server that opens one event stream naming its message endpoint,
    and stops listening first: every POST of a message is refused."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(f"http://127.0.0.1:{listener.socket.getsockname()[1]}/sse")
    stream = await listener.accept()
    await listener.aclose()
    request = b""
    while b"\r\n\r\n" not in request:
        request += await stream.receive_some()
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
        b"event: endpoint\r\ndata: /messages\r\n\r\n"
    )
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.receive_some()  # open until the client leaves


async def test_a_legacy_sse_server_whose_posts_are_refused_fails_to_start_at_once(
    mcp_host: Host, workspace: Path
) -> None:
    """R-MCP-4: a POST of a message whose connection is refused stopped the SDK's sender
    silently, and the start waited out its 30 s. It fails at once now, saying so."""
    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_events_then_refuse)
            await mcp_host.create_session(
                workspace_dir=workspace, mcp_servers={"old": {"type": "sse", "url": url}}
            )
            with pytest.raises(McpServerError) as caught:
                await connection(mcp_host, "old").list_tools()
            nursery.cancel_scope.cancel()
    assert str(caught.value).startswith(
        "MCP server 'old' could not be started: a message could not be sent to 127.0.0.1: "
    )


async def test_gateway_sessions_get_the_servers_of_its_defaults(
    mcp_host: Host, workspace: Path
) -> None:
    """``serve --mcp-config``: every session a client creates has the servers' tools, and
    they share one process."""
    gateway = Gateway(
        mcp_host, token="t" * 24, listen_host="127.0.0.1", port=0,
        defaults=SessionDefaults(provider="scripted", workspace_dir=workspace,
                                 mcp_servers={"t": stdio()}),
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        port = await nursery.start(gateway.run)
        with trio.fail_after(RUN_TIMEOUT_S):
            async with open_websocket_url(
                f"ws://127.0.0.1:{port}/v1",
                extra_headers=[(b"Authorization", b"Bearer " + b"t" * 24)],
            ) as ws:
                for number in (1, 2):
                    await ws.send_message(json.dumps(
                        {"jsonrpc": "2.0", "id": number, "method": "session.create",
                         "params": {}}))  # fmt: skip
                    reply = json.loads(await ws.get_message())
                    assert "session_id" in reply["result"], reply
        nursery.cancel_scope.cancel()
    assert len(mcp_host.sessions) == 2
    for session in mcp_host.sessions:
        assert "mcp__t__echo" in {t.name for t in session.tools}
    assert len(mcp_host._builder.mcp.connections()) == 1


async def test_bad_mcp_servers_argument_is_a_configuration_error(
    mcp_host: Host, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match=r"\$\.x\.command: expected a string"):
        await mcp_host.create_session(provider="scripted", mcp_servers={"x": {"command": 1}})
    with pytest.raises(ConfigurationError, match=r"\$\.x\.command: expected a string"):
        async with Host.open(tmp_path / "other", mcp_servers={"x": {"command": 1}}):
            pass  # pragma: no cover


async def left_waiting_on_an_mcp_call(data_dir: Path, workspace: Path, providers: Any) -> str:
    """A session on ``data_dir`` with the test server as ``t``, its task waiting on a person
    for its call ``c1`` of ``mcp__t__echo`` when its host closed; its id."""
    async with Host.open(data_dir) as first:
        session = await first.create_session(
            provider=providers([Reply(blocks=(tool_call("c1", "mcp__t__echo", text="again"),))]),
            workspace_dir=workspace,
            mcp_servers={"t": stdio()},
        )
        session.run("echo", approve=PEOPLE).detach()
        await until_parked(first, session.id)
    return session.id


async def test_a_task_the_host_takes_up_on_its_own_keeps_its_mcp_servers(
    data_dir: Path, workspace: Path, providers: Any
) -> None:
    """R-MCP-4, R-HITL-4, R-HOST-3: a task left waiting on a person for an MCP call, its host
    stopped, is taken up by the next host (``resume_tasks``) with the MCP servers of
    ``Host.open``: answered, the call runs on the server (before: the session was loaded
    with none, and the call failed as an unknown tool)."""
    session_id = await left_waiting_on_an_mcp_call(data_dir, workspace, providers)
    async with Host.open(data_dir, resume_tasks=True, mcp_servers={"t": stdio()}) as second:
        resumed = second.get_session(session_id)
        assert "mcp__t__echo" in {t.name for t in resumed.tools}
        port_of(resumed).provider = providers([Reply(blocks=(text("done"),))])
        await second.answer_approval(session_id, "c1", "allow")
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        lines = trace_lines(resumed)
    (output,) = [line for line in lines if line["type"] == "tool_call_output"]
    assert (output["status"], output["is_error"]) == ("ok", False), output
    assert "again" in json.dumps(output["content"])
    assert [e["status"] for e in lines if e["type"] == "task_end"] == ["completed"]


async def test_serve_takes_up_a_task_left_open_with_the_servers_of_its_mcp_config(
    data_dir: Path, workspace: Path, providers: Any
) -> None:
    """R-MCP-4, R-HITL-4: ``serve --mcp-config`` (``SessionDefaults.mcp_servers``): the task
    its last run left open is taken up, as it opens, with those servers' tools (before:
    with none)."""
    session_id = await left_waiting_on_an_mcp_call(data_dir, workspace, providers)
    loaded: list[Session] = []
    ready = trio.Event()
    defaults = SessionDefaults(
        provider="scripted", workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(
                run_serve, host="127.0.0.1", port=0, data_dir=data_dir, defaults=defaults,
                observers=[loaded.append], ready=lambda _port: ready.set(),
            ))  # fmt: skip
            await ready.wait()
            (resumed,) = loaded
            assert resumed.id == session_id and resumed.busy
            assert "mcp__t__echo" in {t.name for t in resumed.tools}
            nursery.cancel_scope.cancel()


# -- the command line ---------------------------------------------------------------------


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")}
    env["GREENROOM_HOME"] = str(tmp_path / "home")
    env["NO_COLOR"] = "1"
    return env  # fmt: skip


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
def test_cli_unreadable_config_exits_2_naming_file_and_path(tmp_path: Path, command: str) -> None:
    """A file that is not a configuration at all is a usage error (a bad entry is not: R-MCP-6,
    see test_cli_run_with_stdio_and_http_servers)."""
    config = tmp_path / "servers.json"
    config.write_text(json.dumps({"servers_typo": {"x": {"command": "npx"}}}))
    result = subprocess.run(
        [GREENROOM, command, "--mcp-config", str(config),
         *(["hi"] if command == "run" else [])],
        cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S * 3, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"{config}: $.mcpServers: required property missing" in result.stderr
    assert "Traceback" not in result.stderr


async def test_cli_run_with_stdio_and_http_servers(tmp_path: Path, workspace: Path) -> None:
    """``greenroom run --mcp-config servers.json`` end to end: an OpenAI-compatible mock
    model calls one tool of each server. A bad entry beside them is a warning naming it and
    why, and a disabled one is left out; the run goes on (R-MCP-6)."""
    script = [
        WireReply([ToolUse("call_1", "mcp__s__echo", {"text": "from stdio"}),
                   ToolUse("call_2", "mcp__h__echo", {"text": "from http"})],
                  stop_reason="tool_use"),
        WireReply([Text("Both answered.")]),
    ]  # fmt: skip
    with http_server() as url:
        config = tmp_path / "servers.json"
        config.write_text(json.dumps({"mcpServers": {
            "s": stdio(), "h": {"type": "http", "url": url},
            "broken": {"command": ["npx"]}, "off": {**stdio(), "disabled": True},
        }}))  # fmt: skip
        async with open_mock_server(*script) as model:
            env = {**cli_env(tmp_path), "OPENAI_API_KEY": "test-key"}
            with trio.fail_after(RUN_TIMEOUT_S * 3):
                result = await trio.run_process(
                    [sys.executable, "-m", "greenroom", "run", "--json",
                     "--provider", "openai", "--model", "mock-model",
                     "--base-url", model.base_url + "/v1", "--approve", "all",
                     "--workspace", str(workspace), "--mcp-config", str(config), "use them"],
                    cwd=tmp_path, env=env, capture_stdout=True, capture_stderr=True,
                    check=False, stdin=b"",
                )  # fmt: skip
            model.assert_clean()
            tool_names = {t["function"]["name"] for t in model.requests[0].body["tools"]}
    assert result.returncode == 0, result.stderr.decode()
    assert (f"warning: --mcp-config: {config}: $.mcpServers.broken.command: expected a "
            "string; server 'broken' skipped, the others load") in result.stderr.decode()
    assert {"mcp__s__echo", "mcp__h__echo"} <= tool_names
    assert not any(name.startswith("mcp__off__") for name in tool_names)
    lines = [json.loads(line) for line in result.stdout.decode().splitlines()]
    outputs = {o["call_id"]: o for o in lines if o["type"] == "tool_call_output"}
    assert outputs["call_1"]["content"][0]["text"] == "from stdio"
    assert outputs["call_2"]["content"][0]["text"] == "from http"
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"


async def test_the_model_sees_what_the_server_said_never_a_python_class_name(
    mcp_host: Host, workspace: Path, providers: Any, tmp_path: Path
) -> None:
    """R-MCP-3, R-MCP-4, R-TOOL-4: an ``isError`` result reaches the model as the server's
    own text; a lost server as ``MCP server 'NAME' …``; a server that cannot start in
    words. None of them is dressed as ``McpToolError: …`` or ``FileNotFoundError: …``."""
    provider = providers([
        Reply(blocks=(tool_call("f1", "mcp__t__fail", message="the disk is full"),)),
        Reply(blocks=(tool_call("c1", "mcp__t__crash"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace,
        mcp_servers={"t": stdio(), "gone": {"command": str(tmp_path / "no-such-server")}},
    )  # fmt: skip
    outputs = await collect(session.run("go", approve=allow_all))
    by_call = outputs_by_call(outputs)
    failed = content_text(by_call["f1"])  # the SDK's server words it "Error executing tool …"
    assert by_call["f1"].is_error and failed.endswith("the disk is full")
    assert "McpToolError" not in failed
    assert by_call["c1"].is_error
    assert content_text(by_call["c1"]).startswith("MCP server 't' stopped during crash: ")
    seen = [content_text(r) for r in results_of(last_user(provider.requests[-1]))]
    assert seen == [content_text(by_call["c1"])]
    with pytest.raises(Exception) as caught:
        await connection(mcp_host, "gone").call("echo", {}, None)
    message = str(caught.value)
    assert message.startswith("MCP server 'gone' could not be started: command not found: ")
    assert "Error" not in message


# -- elicitation: a server's question is a question to people (R-HITL-5) ---------------------


def order_then(*replies: Reply) -> list[Reply]:
    return [Reply(blocks=(tool_call("o1", "mcp__t__order", item="shirt"),)), *replies]


async def asked_during_call(host: Host, session: Any, recorder: Recorder) -> PendingApproval:
    """Allow the ``order`` call o1 (a person decides it), and wait until the server's
    elicitation is the question pending on it."""
    await recorder.wait_for("approval_request", call_id="o1", kind="approval")
    await host.answer_approval(session.id, "o1", "allow", by="alice")
    await recorder.wait_for("approval_request", call_id="o1", kind="question")
    (pending,) = await host.pending_approvals()
    return pending


@contextlib.contextmanager
def server_config(transport: str) -> Iterator[dict[str, Any]]:
    if transport == "stdio":
        yield stdio()
        return
    with http_server() as url:
        yield {"type": "http", "url": url}


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_an_elicitation_is_a_question_people_answer_while_the_call_runs(
    mcp_host: Host, workspace: Path, providers: Any, transport: str
) -> None:
    """R-HITL-5, R-MCP-5: the server's elicitation/create during a call is recorded as an
    approval_request of kind question on that call (its message, the requested schema,
    the server), listed by pending_approvals while the call holds its slot (the task is
    not parked); an answer that does not fit the schema is refused and the question stays;
    the answer that fits reaches the server as the accepted content, and the tool's result
    says what it was told. Over stdio and streamable HTTP."""
    provider = providers(order_then(Reply(blocks=(text("done"),))))
    with server_config(transport) as config:
        session = await mcp_host.create_session(
            provider=provider, workspace_dir=workspace, mcp_servers={"t": config}
        )
        await answer_the_order(mcp_host, session)


async def answer_the_order(mcp_host: Host, session: Any) -> None:
    recorder = Recorder(session)
    stream = session.run("order a shirt", approve=PEOPLE)
    pending = await asked_during_call(mcp_host, session, recorder)
    assert (pending.call_id, pending.tool, pending.kind) == ("o1", "mcp__t__order", "question")
    assert pending.arguments["question"] == "Which size of shirt?"
    assert pending.arguments["server"] == "t"
    schema = pending.arguments["requested_schema"]
    assert schema["properties"]["size"]["enum"] == ["S", "M", "L"]
    port = mcp_host.port(session.id)
    assert session.busy and not port.parked and port.inbox is not None

    with pytest.raises(NotPending, match="JSON object of the fields"):
        await mcp_host.answer_question(session.id, "o1", "M")
    with pytest.raises(NotPending, match="size: choose one of"):
        await mcp_host.answer_question(session.id, "o1", '{"size": "XL"}')
    assert [p.call_id for p in await mcp_host.pending_approvals()] == ["o1"]
    await mcp_host.answer_question(session.id, "o1", '{"size": "M", "quantity": 2}', by="bob")

    outputs = await collect(stream)
    result = outputs_by_call(outputs)["o1"]
    assert (result.status, content_text(result)) == ("ok", "ordered 2 M shirt")
    decisions = [(d.decision, d.by, d.principal) for d in of_type(outputs, ApprovalDecision)]
    assert decisions == [("allow", "client", "alice"), ("allow", "client", "bob")]
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    assert await mcp_host.pending_approvals() == []


async def test_a_declined_or_interrupted_elicitation_reaches_the_server(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-HITL-5: a person's deny declines the elicitation (the server says so); an
    interrupt while the question waits ends the task aborted, the server's call is
    cancelled, and nothing is left pending."""
    provider = providers([
        *order_then(Reply(blocks=(tool_call("o2", "mcp__t__order", item="hat"),))),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    recorder = Recorder(session)
    stream = session.run("order", approve=PEOPLE)
    await asked_during_call(mcp_host, session, recorder)
    await mcp_host.answer_approval(session.id, "o1", "deny", by="alice")
    declined = await recorder.wait_for("tool_call_output", call_id="o1")
    assert content_text(declined) == "declined"  # type: ignore[arg-type]

    await recorder.wait_for("approval_request", call_id="o2", kind="approval")
    await mcp_host.answer_approval(session.id, "o2", "allow")
    await recorder.wait_for("approval_request", call_id="o2", kind="question")
    session.interrupt()
    outputs = await stream.collect()
    assert of_type(outputs, TaskEnd)[-1].status == "aborted"
    assert outputs_by_call(outputs)["o2"].status == "interrupted"
    assert await mcp_host.pending_approvals() == []
    server = connection(mcp_host, "t")
    cancelled: list[str] = []
    for _ in range(50):  # the server handles the cancellation in its own time
        result = await server.call("cancelled", {}, None)
        cancelled = json.loads(result[0].text)  # type: ignore[union-attr]
        if cancelled:
            break
    assert cancelled == ["order:hat"]


async def test_an_elicitation_nobody_can_answer_is_declined_and_one_unanswered_cancelled(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-HITL-5, R-APPROVE-4: where a callback decides the calls, nobody answers
    questions: the elicitation is declined at once. Where people do, a question nobody
    answers within approval_timeout_s is cancelled, and the call's own timeout_s does not
    count the wait. (Real time: the wait is the product's own, as in test_people.)"""
    provider = providers(order_then(Reply(blocks=(text("ok"),))))
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    outputs = await collect(session.run("order", approve=allow_all))
    assert content_text(outputs_by_call(outputs)["o1"]) == "declined"
    assert not of_type(outputs, ApprovalRequest)

    provider = providers(order_then(Reply(blocks=(text("ok"),))))
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace,
        mcp_servers={"t": stdio(timeout_s=0.5)}, approval_timeout_s=1.0,
    )
    recorder = Recorder(session)
    stream = session.run("order", approve=PEOPLE)
    await asked_during_call(mcp_host, session, recorder)
    outputs = await stream.collect()
    result = outputs_by_call(outputs)["o1"]
    assert (result.status, content_text(result)) == ("ok", "cancelled")
    (_, unanswered) = of_type(outputs, ApprovalDecision)
    assert (unanswered.decision, unanswered.by) == ("deny", "default")


# -- servers that misbehave as real ones do (tests/support/mcp_odd_server.py) ----------------

ODD_SERVER = ROOT / "tests" / "support" / "mcp_odd_server.py"


def odd(*options: str, **extra: Any) -> dict[str, Any]:
    """The odd server over stdio, with its ``options`` and the entry's ``extra`` keys."""
    return {"command": sys.executable, "args": [str(ODD_SERVER), *options], **extra}


@contextlib.contextmanager
def odd_sse_server_without_endpoint() -> Iterator[str]:
    """The odd server over legacy HTTP+SSE, whose stream never names its endpoint; its URL."""
    process = subprocess.Popen(
        [sys.executable, str(ODD_SERVER), "--sse-no-endpoint"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}/sse"
    finally:
        process.terminate()
        process.wait(timeout=10)


async def test_a_server_stuck_in_initialize_fails_to_start_in_words(
    mcp_host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-MCP-4, R-MCP-6: a server that never answers ``initialize`` fails its start at
    START_TIMEOUT_S, saying so. The bound fired inside the SDK's task groups and came back
    wrapped in an exception group, so the start was reported as ``TooSlowError``: a class
    name, not words."""
    monkeypatch.setattr(mcp_module, "START_TIMEOUT_S", 0.5)  # not 30 s of the test's time
    with trio.fail_after(RUN_TIMEOUT_S):
        await mcp_host.create_session(
            workspace_dir=workspace, mcp_servers={"h": odd("--hang-init")}
        )
        with pytest.raises(McpServerError) as caught:
            await connection(mcp_host, "h").list_tools()
    message = str(caught.value)
    assert message.startswith(
        "MCP server 'h' could not be started: it did not answer initialize and tools/list "
        "within 0.5 s"
    ), message
    assert "Error" not in message


async def test_a_legacy_sse_server_that_never_names_its_endpoint_fails_to_start_in_time(
    mcp_host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-MCP-4, R-SEC-10: a start is bounded by START_TIMEOUT_S from the connection on.
    Over legacy HTTP+SSE the transport was entered outside that bound, and the SDK waits
    for the ``endpoint`` event with a read timeout that each keep-alive starts again: a
    stream that never names it held the start, and the session's creation, unbounded."""
    monkeypatch.setattr(mcp_module, "START_TIMEOUT_S", 0.5)
    with odd_sse_server_without_endpoint() as url, trio.fail_after(RUN_TIMEOUT_S):
        await mcp_host.create_session(
            workspace_dir=workspace, mcp_servers={"s": {"type": "sse", "url": url}}
        )
        with pytest.raises(McpServerError) as caught:
            await connection(mcp_host, "s").list_tools()
    assert str(caught.value).startswith(
        "MCP server 's' could not be started: it did not answer initialize and tools/list "
        "within 0.5 s"
    ), caught.value


async def test_structured_content_that_breaks_its_output_schema_is_an_error_in_words(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-3, R-MCP-4: the SDK checks structured content against the tool's listed
    output schema and raises a bare RuntimeError when it does not match, which reached the
    model as ``RuntimeError: Invalid structured content …``. It is an error output of that
    call starting ``MCP server 'NAME'``, saying what is wrong, and the task goes on."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__o__total", a=2, b=3),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"o": odd()}
    )
    outputs = await collect(session.run("go", approve=allow_all))
    result = outputs_by_call(outputs)["c1"]
    assert result.is_error
    assert content_text(result) == (
        "MCP server 'o' gave total an invalid result: its structured content does not match "
        "its output schema: 'total' is a required property"
    )
    assert outputs[-1].status == "completed"  # type: ignore[attr-defined]


def test_the_argument_check_reads_draft07_tuples_and_boolean_choices() -> None:
    """R-TOOL-5, R-MCP-1: draft-07's tuple form ``items: [...]`` (zod-to-json-schema's
    ``z.tuple``) passes the schema check, and the argument check then failed every call
    with AttributeError (``'list' object has no attribute 'get'``); so did an ``anyOf``
    with a boolean choice when no choice matched."""
    pair = {"type": "array", "items": [{"type": "integer"}, {"type": "string"}]}
    assert schema_problem({"type": "object", "properties": {"p": pair}}) is None
    assert validate_json([1, "a", None], pair) == []  # no additionalItems: more may follow
    assert validate_json([1], pair) == []  # fewer: minItems says how many are needed
    assert validate_json(["a", 1], pair) == [
        "$[0]: expected integer, got string", "$[1]: expected string, got integer"
    ]
    assert validate_json([1, "a", 2], {**pair, "additionalItems": {"type": "string"}}) == [
        "$[2]: expected string, got integer"
    ]
    assert validate_json([1, "a", 2], {**pair, "additionalItems": False}) == [
        "$: expected at most 2 items, got 3"
    ]
    choice = {"anyOf": [False, {"type": ["string", "null"], "enum": ["a", None]},
                        {"enum": [1]}, True]}  # fmt: skip
    assert validate_json(2.5, choice) == []
    assert validate_json(2.5, {"anyOf": choice["anyOf"][:3]}) == [
        "$: expected one of: string or null, value"
    ]
    assert validate_json(2.5, {"anyOf": [False]}) == ["$: no value is allowed here"]


async def test_a_tool_listed_with_draft07_tuple_items_is_called(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-1, R-TOOL-5: a tool whose input schema uses draft-07's tuple ``items`` is
    offered, and its calls are checked against the tuple and reach the server (each one
    failed in the argument check before)."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__o__span", p=[1, 4]),
                      tool_call("c2", "mcp__o__span", p=[1, "x"]),
                      tool_call("c3", "mcp__o__span", p=[1, 4, 9]))),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"o": odd()}
    )
    assert "mcp__o__span" in {t.name for t in session.tools}
    by_call = outputs_by_call(await collect(session.run("go", approve=allow_all)))
    assert (by_call["c1"].status, content_text(by_call["c1"])) == ("ok", "3")
    assert by_call["c2"].is_error
    assert "$.p[1]: expected number, got string" in content_text(by_call["c2"])
    assert by_call["c3"].is_error
    assert "$.p: expected at most 2 items, got 3" in content_text(by_call["c3"])


def test_entries_as_cline_roo_code_and_vscode_write_them_load_with_notes() -> None:
    """R-MCP-6: "Configurations of the common clients load". Cline writes a server's
    ``timeout``, Roo Code ``watchPaths``, ``disabledTools`` and ``networkTimeout``, VS Code
    ``envFile`` and ``dev``: each such entry was skipped as having an unknown key. They
    load; a key greenroom does without is a note saying why (``disabledTools`` is
    honoured: tests/test_mcpfix_mcp.py); ``envFile`` is resolved
    against the file's workspace; a misspelt key is still an error."""
    notes: list[str] = []
    cline = parse_config_text(json.dumps({"mcpServers": {
        "git": {"command": "uvx", "args": ["mcp-server-git"], "disabled": False,
                "autoApprove": [], "timeout": 60},
        "roo": {"command": "c", "alwaysAllow": [], "watchPaths": ["src"],
                "disabledTools": ["rm"], "networkTimeout": 30},
    }}), "cline.json", notes.append)  # fmt: skip
    assert set(cline) == {"git", "roo"}
    assert cline["git"].timeout_s == DEFAULT_TIMEOUT_S
    assert notes == [
        "cline.json: $.mcpServers.git.timeout: ignored (greenroom's limit on one call is "
        '"timeout_s")',
        "cline.json: $.mcpServers.roo.watchPaths: ignored (greenroom does not restart a "
        "server when files change)",
        "cline.json: $.mcpServers.roo.networkTimeout: ignored (greenroom's limit on one "
        'call is "timeout_s")',
    ]
    notes.clear()
    vscode = parse_config_text(json.dumps({"servers": {
        "files": {"type": "stdio", "command": "npx", "args": ["srv"],
                  "envFile": "${workspaceFolder}/.env", "dev": {"watch": "src/**"}},
        "rel": {"command": "c", "envFile": "conf/.env"},
    }}), "/w/.vscode/mcp.json", notes.append)  # fmt: skip
    assert (vscode["files"].env_file, vscode["rel"].env_file) == ("/w/.env", "/w/conf/.env")
    assert notes == ["/w/.vscode/mcp.json: $.servers.files.dev: ignored (VS Code's "
                     "development mode (watch, debug) is not supported)"]
    with pytest.raises(McpConfigError, match=r"\$\.mcpServers\.h\.envFile: only for a stdio"):
        parse_config_text(json.dumps({"mcpServers": {"h": {"url": "http://h/mcp",
                                                           "envFile": ".env"}}}), "h.json")
    with pytest.raises(McpConfigError, match=r"\$\.mcpServers\.x\.timout: unknown key"):
        parse_config_text(json.dumps({"mcpServers": {"x": {"command": "c", "timout": 1}}}),
                          "x.json")


async def test_an_env_file_gives_the_server_its_variables_when_it_starts(
    mcp_host: Host, workspace: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """R-MCP-6: VS Code's ``envFile`` of simple ``KEY=VALUE`` lines is read when the server
    starts and put under ``env`` (which wins); one that is not simple (escapes in a quoted
    value) is noted, and its server starts without it rather than with guessed values."""
    project = tmp_path / "project"
    (project / ".vscode").mkdir(parents=True)
    (project / ".env").write_text("# secrets\nexport TOKEN='from the file'\nMODE=file\n\n")
    (project / "odd.env").write_text('MODE=file\nMULTI="a\\nb"\n')
    config = project / ".vscode" / "mcp.json"
    config.write_text(json.dumps({"servers": {
        "e": odd(envFile="${workspaceFolder}/.env", env={"MODE": "env"}),
        "f": odd(envFile="odd.env"),
    }}))  # fmt: skip
    servers = load_config_files([config])
    with trio.fail_after(RUN_TIMEOUT_S):
        await mcp_host.create_session(workspace_dir=workspace, mcp_servers=servers)
        e, f = connection(mcp_host, "e"), connection(mcp_host, "f")
        assert await e.call("env", {"name": "TOKEN"}, None) == (TextBlock(text="from the file"),)
        assert await e.call("env", {"name": "MODE"}, None) == (TextBlock(text="env"),)
        assert await f.call("env", {"name": "MODE"}, None) == (TextBlock(text=""),)
    assert any(
        f"its envFile {project / 'odd.env'} is not loaded (line 2 has a quoted value" in m
        for m in caplog.messages
    ), caplog.messages


def test_a_vscode_settings_file_with_comments_and_trailing_commas_loads() -> None:
    """R-MCP-6: VS Code writes its settings file and ``mcp.json`` as JSON with comments
    and trailing commas, and such a file was refused as not JSON. Comments and trailing
    commas are read past outside strings; what a string holds is kept as written; an error
    still names its line."""
    settings = r"""{
    // Editor
    "editor.fontSize": 12, /* a block
       over two lines */
    "mcp": {
        "servers": {
            "files": {"command": "npx", "args": ["http://x//y", "/* kept */", "a,}",
                                                 "say \"hi\" // too",],},
        },
    },
}"""
    servers = parse_config_text(settings, "settings.json")
    assert servers["files"].args == ("http://x//y", "/* kept */", "a,}", 'say "hi" // too')
    with pytest.raises(McpConfigError, match=r"^settings\.json: not JSON: .*\(line 3, column"):
        parse_config_text('{\n  // a comment\n  "mcp": nope\n}', "settings.json")


async def test_a_working_directory_that_does_not_exist_is_named_as_such(
    mcp_host: Host, workspace: Path, tmp_path: Path
) -> None:
    """R-MCP-4: a server whose ``cwd`` does not exist was reported as ``command not found:
    <the directory>`` (the child's chdir fails with the cwd as the missing file), pointing
    at the wrong setting."""
    missing = tmp_path / "no-such-dir"
    await mcp_host.create_session(
        workspace_dir=workspace, mcp_servers={"c": odd(cwd=str(missing))}
    )
    with pytest.raises(McpServerError) as caught:
        await connection(mcp_host, "c").list_tools()
    assert str(caught.value).startswith(
        f"MCP server 'c' could not be started: working directory not found: {missing} ("
    ), caught.value
