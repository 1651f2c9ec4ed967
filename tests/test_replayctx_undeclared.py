"""A replay (R-FORK-3) hands an MCP tool every argument as the model gave it, ``ctx`` too
when the tool's schema does not declare it (R-MCP-3): its wrapper took the pool's context
under that name, so the model's ``ctx`` was replaced by the runtime's object — the call
equal to the recorded one matched nothing, and a new call reached the server without it.
Real MCP server (the official SDK's low-level server), scripted models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import trace_lines
from test_m14_mcp_questions import ARGUMENTS_SERVER, stdio
from test_ttfix_replay_ctx_argument import recorded_call

from greenroom.actors.apps.replay import replay_session
from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host


def output_of(lines: list[dict[str, Any]], call_id: str) -> dict[str, Any]:
    (line,) = [r for r in lines if r["type"] == "tool_call_output" and r["call_id"] == call_id]
    assert not line.get("is_error"), line
    seen = json.loads(line["content"][0]["text"])
    assert isinstance(seen, dict)
    return seen


async def test_a_replay_passes_an_undeclared_ctx_argument_as_the_model_gave_it(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    script = tmp_path / "arguments_server.py"
    script.write_text(ARGUMENTS_SERVER, encoding="utf-8")
    servers = {"t": stdio(script)}
    call = tool_call("c1", "mcp__t__undeclared", text="a", ctx="home")
    source = await recorded_call(host, workspace, servers, providers, call, "say what arrives")
    recorded = output_of(trace_lines(source), "c1")
    assert recorded["arguments"] == {"text": "a", "ctx": "home"}
    replay = providers(
        [
            Reply(
                blocks=(
                    tool_call("r1", "mcp__t__undeclared", text="a", ctx="home"),
                    tool_call("r2", "mcp__t__undeclared", text="b", ctx="work"),
                )
            ),
            Reply(blocks=(text("done"),)),
        ]
    )
    report = await replay_session(
        host, source.id, tools=[], provider=replay, mcp_servers=servers, run_tools=True
    )
    assert [(c.name, c.arguments, c.outcome) for c in report.tasks[0].replay.calls] == [
        ("mcp__t__undeclared", {"text": "a", "ctx": "home"}, "same"),
        ("mcp__t__undeclared", {"text": "b", "ctx": "work"}, "different"),
    ]
    lines = trace_lines(host.get_session(report.replay_id))
    assert output_of(lines, "r1") == recorded  # answered from the record
    ran = output_of(lines, "r2")  # run: the model's ctx reached the server, with a key
    assert ran["arguments"] == {"text": "b", "ctx": "work"}
    assert isinstance(ran["key"], str) and ran["key"].startswith("gr-")
