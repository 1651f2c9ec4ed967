"""MCP beyond tools (R-MCP-5): how greenroom introduces itself in ``initialize``, the
roots it gives, resources and prompts, against the SDK-built test server
(``tests/support/mcp_server.py``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import allow_all, collect

import greenroom
from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from tests.test_mcp import content_text, outputs_by_call, stdio


@pytest.fixture
async def mcp_host(data_dir: Path) -> AsyncIterator[Host]:
    async with Host.open(data_dir) as host:
        yield host


async def test_initialize_names_greenroom_and_gives_the_workspace_as_root(
    mcp_host: Host, workspace: Path, providers: Any, tmp_path: Path
) -> None:
    """R-MCP-5: ``clientInfo`` is greenroom and its version; the capabilities declare
    ``roots`` and ``elicitation``; ``roots/list`` answers the sessions' workspaces, and
    another session sharing the server adds its own."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__t__client"), tool_call("c2", "mcp__t__roots"))),
        Reply(blocks=(text("done"),)),
        Reply(blocks=(tool_call("c3", "mcp__t__roots"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    by_call = outputs_by_call(await collect(session.run("who", approve=allow_all)))
    client = json.loads(content_text(by_call["c1"]))
    assert (client["name"], client["version"]) == ("greenroom", greenroom.__version__)
    assert client["capabilities"]["roots"] == {"listChanged": True}
    assert "elicitation" in client["capabilities"]
    assert json.loads(content_text(by_call["c2"])) == [
        {"uri": workspace.as_uri(), "name": workspace.name}
    ]
    other_workspace = tmp_path / "other"
    other_workspace.mkdir()
    other = await mcp_host.create_session(
        provider=provider, workspace_dir=other_workspace, mcp_servers={"t": stdio()}
    )
    by_call = outputs_by_call(await collect(other.run("roots", approve=allow_all)))
    assert [r["uri"] for r in json.loads(content_text(by_call["c3"]))] == [
        workspace.as_uri(), other_workspace.as_uri()
    ]
