"""greenroom against the MCP reference server ``@modelcontextprotocol/server-everything``,
run through ``npx -y`` as users configure it (R-MCP-1, R-MCP-3, R-MCP-5): every tool it
offers a client with greenroom's capabilities, a call, a resource, prompts, and the roots.

The package comes from npm's registry (or npm's cache). When ``npx`` is missing or the
package cannot be fetched and started within ``FETCH_BOUND_S``, the test is skipped with
the reason; the run through greenroom is bounded on its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import allow_all, collect

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.mcp_config import tool_name
from tests.test_mcp import connection, content_text, outputs_by_call

PACKAGE = "@modelcontextprotocol/server-everything"
FETCH_BOUND_S = 120.0
"""How long fetching (when npm's cache lacks it) and starting the package may take."""
RUN_BOUND_S = 90.0

INITIALIZE = {
    "jsonrpc": "2.0", "id": 1, "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {},
               "clientInfo": {"name": "greenroom-test", "version": "0"}},
}  # fmt: skip


@pytest.fixture(scope="module")
def everything() -> None:
    """Skip (with the reason) unless ``npx -y PACKAGE`` answers ``initialize`` within
    ``FETCH_BOUND_S``; this fetches it into npm's cache when it is not there yet. (A sync
    fixture: a skip raised inside a trio test loses its reason.)"""
    npx = shutil.which("npx")
    if npx is None:
        pytest.skip("npx is not installed (Node.js is needed for this test)")
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false"}
    try:
        result = subprocess.run(
            [npx, "-y", PACKAGE], input=json.dumps(INITIALIZE).encode() + b"\n",
            capture_output=True, timeout=FETCH_BOUND_S, env=env, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip(f"npx -y {PACKAGE} was not fetched and started within {FETCH_BOUND_S:g} s")
    if b'"serverInfo"' not in result.stdout:
        tail = " ".join(result.stderr.decode(errors="replace").split())[-300:]
        pytest.skip(f"npx -y {PACKAGE} did not start (exit {result.returncode}): {tail}")


async def test_server_everything_through_npx(
    everything: None, data_dir: Path, workspace: Path, providers: Any
) -> None:
    """R-MCP-1, R-MCP-5: every tool the server lists reaches the model (those it offers
    only to clients that declare ``roots`` and ``elicitation`` among them), none skipped;
    a tool call, a resource read by the model, the workspace as the root it sees, and
    its prompts expanded."""
    with trio.fail_after(RUN_BOUND_S):
        async with Host.open(data_dir) as host:
            config = {"command": "npx", "args": ["-y", PACKAGE]}
            session = await host.create_session(
                provider=providers([]), workspace_dir=workspace, mcp_servers={"e": config}
            )
            server = connection(host, "e")
            listed = [info.name for info in server.tools or ()]
            offered = {t.name for t in session.tools if t.name.startswith("mcp__e__")}
            resource = server.resources[0].uri
            prompts = {p.name: p for p in server.prompts}
            simple = await server.get_prompt("simple-prompt", {})
            with_args = await server.get_prompt("args-prompt", {"city": "Paris"})
            provider = providers([
                Reply(blocks=(
                    tool_call("s1", "mcp__e__get-sum", a=2, b=3),
                    tool_call("r1", "mcp__e__read_resource", uri=resource),
                    tool_call("g1", "mcp__e__get-roots-list"),
                )),
                Reply(blocks=(text("done"),)),
            ])  # fmt: skip
            session = await host.create_session(
                provider=provider, workspace_dir=workspace, mcp_servers={"e": config}
            )
            by_call = outputs_by_call(await collect(session.run("go", approve=allow_all),
                                                    bound_s=None))  # fmt: skip
    assert server.warnings == []
    assert offered == {tool_name("e", name) for name in listed} | {"mcp__e__read_resource"}
    assert {"echo", "get-sum", "get-roots-list", "trigger-elicitation-request"} <= set(listed)
    assert {"simple-prompt", "args-prompt"} <= set(prompts)
    assert simple.strip() and "Paris" in with_args
    assert not any(o.is_error for o in by_call.values()), by_call
    assert "5" in content_text(by_call["s1"])
    read = content_text(by_call["r1"])
    assert resource in read and len(read) > len(resource) + 40
    assert workspace.as_uri() in content_text(by_call["g1"])
