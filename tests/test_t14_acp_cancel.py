"""``session/cancel`` cancels the prompt turn (R-ACP-1, R-TREE-2): on a session whose
prompt was answered, it ends no background subagent that prompt started. The child,
held in its tool, goes on once released, closes its own call ``completed``, and its
answer reaches the session as a follow-up the editor sees. Before, the cancel
interrupted with scope ``tree``: the child ended too, its call ``failed``."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.test_acp import run
from tests.test_acp_tree import (
    meta,
    prompt_research,
    shown,
    subagent_closed,
    subagent_opened,
    tree_agent,
)


def test_a_cancel_of_an_idle_session_leaves_its_background_child_running(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def scenario() -> None:
        async with tree_agent(tmp_path) as agent:
            editor = agent.editor
            sid = await prompt_research(agent, workspace)
            opened = await subagent_opened(editor)
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
            closed = await subagent_closed(editor, opened)
            assert closed.status == "completed", shown(closed)
            while "Merged: [subagent scout finished] Scout report:" not in editor.text():
                editor.changed.clear()
                await editor.changed.wait()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())
