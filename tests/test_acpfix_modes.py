"""``session/set_mode`` (R-ACP-2) through the official ACP SDK's client side, the agent in a
subprocess (``tests/support/acp_editor_agent.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from acp import RequestError

from tests.test_acp import run
from tests.test_acp_editor import FILES, editor_agent, open_session


def test_set_mode_of_a_session_the_connection_does_not_have_is_32002(tmp_path: Path) -> None:
    """A session id this connection has not created or loaded is -32002 for every method:
    session/set_mode naming one with a mode that is not one of the three was answered
    -32602 about the mode, telling the editor to fix the mode of a session it cannot use.
    The session comes first; an unknown mode of a known session stays -32602."""
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def scenario() -> None:
        async with editor_agent(tmp_path) as agent:
            sid = await open_session(agent, workspace, FILES)
            with pytest.raises(RequestError) as unknown_session:
                await agent.conn.set_session_mode(
                    session_id="20990101-000000-abcdef", mode_id="yolo"
                )
            assert unknown_session.value.code == -32002
            with pytest.raises(RequestError) as unknown_mode:
                await agent.conn.set_session_mode(session_id=sid, mode_id="yolo")
            assert unknown_mode.value.code == -32602
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())
