"""A replay wraps every tool (R-FORK-3): an argument of any name reaches the recorded
results and the tool — ``ctx`` too, the name the tool pool gives a tool's context."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from conftest import allow_all, collect, trace_lines

from greenroom.actors.apps.replay import denied_note, replay_session
from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import ToolCallBlock

SERVER = textwrap.dedent(
    '''
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations

    server = MCPServer("ctx-arguments")
    called = []

    @server.tool()
    def note(ctx: str, text: str) -> str:
        """Note a text under a context (side effects)."""
        called.append(f"note {ctx}/{text}")
        return f"noted {text} in {ctx}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def where(ctx: str) -> str:
        """Say which context was asked about (read-only)."""
        called.append(f"where {ctx}")
        return f"asked about {ctx}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def calls() -> str:
        """The calls so far."""
        return ",".join(called)

    server.run()
    '''
)


def output_text(lines: list[dict[str, Any]], call_id: str) -> str:
    (line,) = [r for r in lines if r["type"] == "tool_call_output" and r["call_id"] == call_id]
    return str(line["content"][0]["text"])


async def recorded_call(
    host: Host,
    workspace: Path,
    servers: dict[str, Any],
    providers: Any,
    call: ToolCallBlock,
    task: str,
) -> Session:
    """A session on the MCP ``servers`` that ran ``task`` to its end, its model making
    ``call`` and then saying "noted": the source of a replay."""
    source = await host.create_session(
        provider=providers([Reply(blocks=(call,)), Reply(blocks=(text("noted"),))]),
        workspace_dir=workspace,
        mcp_servers=servers,
    )
    await collect(source.run(task, approve=allow_all))
    return source


async def test_an_mcp_tools_ctx_argument_passes_through_a_replay(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """The replay's wrapper took the pool's context as ``ctx``, which is also an argument
    of these MCP tools: the pool put its context in the argument's place, so the call equal
    to the recorded one lost ``ctx``, matched nothing and was denied, and the read-only
    call reached the server without it (an error). Now the recorded call is answered from
    the record (the server runs it once, for the recording), another one is denied, the
    read-only one runs with its ``ctx``; the report says so call by call."""
    script = tmp_path / "ctx_server.py"
    script.write_text(SERVER, encoding="utf-8")
    servers = {"t": {"command": sys.executable, "args": [str(script)]}}
    call = tool_call("c1", "mcp__t__note", ctx="home", text="a")
    source = await recorded_call(host, workspace, servers, providers, call, "note a at home")
    assert output_text(trace_lines(source), "c1") == "noted a in home"
    replay = providers(
        [
            Reply(
                blocks=(
                    tool_call("r1", "mcp__t__note", ctx="home", text="a"),
                    tool_call("r2", "mcp__t__note", ctx="work", text="b"),
                    tool_call("r3", "mcp__t__where", ctx="garden"),
                )
            ),
            Reply(blocks=(tool_call("r4", "mcp__t__calls"),)),
            Reply(blocks=(text("done"),)),
        ]
    )
    report = await replay_session(host, source.id, tools=[], provider=replay, mcp_servers=servers)
    assert [(c.name, c.arguments, c.outcome) for c in report.tasks[0].replay.calls] == [
        ("mcp__t__note", {"ctx": "home", "text": "a"}, "same"),
        ("mcp__t__note", {"ctx": "work", "text": "b"}, "denied"),
        ("mcp__t__where", {"ctx": "garden"}, "different"),
        ("mcp__t__calls", {}, "different"),
    ]
    lines = trace_lines(host.get_session(report.replay_id))
    assert output_text(lines, "r1") == "noted a in home"
    assert denied_note("mcp__t__note") in output_text(lines, "r2")
    assert output_text(lines, "r3") == "asked about garden"
    assert output_text(lines, "r4") == "note home/a,where garden"
    assert json.dumps(report.to_dict())  # the report is still JSON
