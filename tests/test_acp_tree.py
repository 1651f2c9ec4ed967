"""Agent trees through an editor (R-TREE-1, R-TREE-2, R-ACP-1): the ACP agent in a
subprocess (``tests/support/acp_tree_agent.py``: a root that spawns one background
subagent, which holds in a tool until the test releases it), the official ACP SDK's client
side as the editor, every frame checked against the SDK's schema.

A background child has a tool call of its own (``subagent:<node id>``) that keeps showing
its activity after its spawning call returned and the prompt was answered, and closes
when it ends; ``_greenroom/steer`` with its ``nodeId`` steers it; the parent's follow-up
on the child's answer streams to the editor although no prompt of the editor started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from acp import RequestError

from tests.test_acp import ROOT, Agent, Editor, run, spawned_agent, text

AGENT = ROOT / "tests" / "support" / "acp_tree_agent.py"


@contextlib.asynccontextmanager
async def tree_agent(tmp_path: Path) -> AsyncIterator[Agent]:
    fifo = tmp_path / "hold"
    os.mkfifo(fifo)
    async with spawned_agent(
        tmp_path, Editor(), sys.executable, str(AGENT), str(tmp_path / "data"), str(fifo)
    ) as agent:
        yield agent


def meta(update: Any) -> dict[str, Any]:
    return (update.field_meta or {}).get("greenroom", {})


def shown(update: Any) -> str:
    return "".join(getattr(c.content, "text", "") for c in update.content or [])


async def prompt_research(agent: Agent, workspace: Path) -> str:
    """Open a session in ``workspace`` and prompt it to research (the root starts the
    background scout and answers): the session's id."""
    await agent.conn.initialize(protocol_version=1)
    created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])
    sid = created.session_id
    answer = await agent.conn.prompt(session_id=sid, prompt=text("research"))
    assert answer.stop_reason == "end_turn"
    return sid


async def subagent_opened(editor: Editor) -> Any:
    """The update that opened the background child's own tool call."""
    return await editor.wait_for(
        lambda u: u.session_update == "tool_call" and u.tool_call_id.startswith("subagent:")
    )


async def subagent_closed(editor: Editor, opened: Any) -> Any:
    """The update that closed the call ``opened`` opened, completed or failed."""
    return await editor.wait_for(
        lambda u: (
            u.session_update == "tool_call_update"
            and u.tool_call_id == opened.tool_call_id
            and u.status in ("completed", "failed")
        )
    )


def test_a_background_child_has_its_own_call_is_steered_by_node_and_its_answer_streams(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def scenario() -> None:
        async with tree_agent(tmp_path) as agent:
            editor = agent.editor
            sid = await prompt_research(agent, workspace)
            assert "Started the scout." in editor.text()
            opened = await subagent_opened(editor)
            node = meta(opened)["nodeId"]
            assert opened.tool_call_id == f"subagent:{node}" and meta(opened)["background"]
            assert opened.raw_input == {"task": "scout the notes", "sessionId": node}
            assert opened.title == "Subagent scout (background)"

            # The prompt was answered; the child still runs (held in its tool): steer it.
            queued = await agent.conn.ext_method(
                "greenroom/steer", {"sessionId": sid, "nodeId": node, "text": "check the dates"}
            )
            assert queued == {"queued": True}
            # Another session's tree does not hold the node; an unknown id names none.
            other = await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])
            for params in (
                {"sessionId": other.session_id, "nodeId": node, "text": "x"},
                {"sessionId": sid, "nodeId": "no-such-node", "text": "x"},
            ):
                with pytest.raises(RequestError) as refused:
                    await agent.conn.ext_method("greenroom/steer", params)
                assert refused.value.code == -32002

            await asyncio.to_thread((tmp_path / "hold").write_text, "go\n")
            closed = await subagent_closed(editor, opened)
            assert closed.status == "completed" and meta(closed)["nodeId"] == node
            assert "◂ hold ok" in shown(closed)
            # The steering reached the child's model (marked as steering by the runtime).
            assert "Scout report: [user_steering]check the dates" in shown(closed)
            # Its answer reached the idle parent, whose follow-up streams to the editor.
            while "Merged: [subagent scout finished] Scout report: [user_steering]check" not in (
                editor.text()
            ):
                editor.changed.clear()
                await editor.changed.wait()
            progress = [
                u
                for _, u in editor.updates
                if u.session_update == "tool_call_update" and u.tool_call_id == opened.tool_call_id
            ]
            assert all(meta(u)["origin"] == [sid, node] for u in progress)
            assert [u.status for u in progress].count("completed") == 1
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())
