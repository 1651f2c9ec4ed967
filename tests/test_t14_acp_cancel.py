"""``session/cancel`` cancels the prompt turn (R-ACP-1, R-TREE-2): on a session whose
prompt was answered, it ends no background subagent that prompt started. The child,
held in its tool, goes on once released, closes its own call ``completed``, and its
answer reaches the session as a follow-up the editor sees. Before, the cancel
interrupted with scope ``tree``: the child ended too, its call ``failed``."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.test_acp import run, text
from tests.test_acp_tree import meta, shown, tree_agent


def test_a_cancel_of_an_idle_session_leaves_its_background_child_running(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def scenario() -> None:
        async with tree_agent(tmp_path) as agent:
            editor = agent.editor
            await agent.conn.initialize(protocol_version=1)
            created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])
            sid = created.session_id
            answer = await agent.conn.prompt(session_id=sid, prompt=text("research"))
            assert answer.stop_reason == "end_turn"
            opened = await editor.wait_for(
                lambda u: u.session_update == "tool_call" and u.tool_call_id.startswith("subagent:")
            )
            node = meta(opened)["nodeId"]
            await editor.wait_for(
                lambda u: u.session_update == "tool_call_update" and "hold" in shown(u)
            )
            await agent.conn.cancel(session_id=sid)
            # Frames are handled in order: once this is answered, the cancel was handled.
            queued = await agent.conn.ext_method(
                "greenroom/steer", {"sessionId": sid, "nodeId": node, "text": "still there?"}
            )
            assert queued == {"queued": True}
            await asyncio.to_thread((tmp_path / "hold").write_text, "go\n")
            closed = await editor.wait_for(
                lambda u: (
                    u.session_update == "tool_call_update"
                    and u.tool_call_id == opened.tool_call_id
                    and u.status in ("completed", "failed")
                )
            )
            assert closed.status == "completed", shown(closed)
            while "Merged: [subagent scout finished] Scout report:" not in editor.text():
                editor.changed.clear()
                await editor.changed.wait()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())
