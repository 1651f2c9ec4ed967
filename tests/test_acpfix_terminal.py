"""The editor's terminal (R-ACP-2, R-ABORT-1): the ACP agent in a subprocess
(``tests/support/acp_editor_agent.py``), the official ACP SDK's client side as an editor
that runs commands in terminals of its own (``tests/test_acp_editor.py``).

A terminal is always released, which kills its command — also one the editor creates
after the call that asked for it was cancelled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from acp.schema import CreateTerminalResponse

from tests.test_acp import PROMPT_CANCEL_S, run, text
from tests.test_acp_editor import TERMINAL, FilesEditor, editor_agent, open_session


class SlowTerminalEditor(FilesEditor):
    """An editor that starts a terminal's command only once ``go`` is set (``creating``
    says a ``terminal/create`` waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.creating = asyncio.Event()
        self.go = asyncio.Event()

    async def create_terminal(self, *args: Any, **kwargs: Any) -> CreateTerminalResponse:
        self.creating.set()
        await self.go.wait()
        return await super().create_terminal(*args, **kwargs)


def test_a_terminal_created_after_its_call_was_cancelled_is_released(tmp_path: Path) -> None:
    """session/cancel while the editor creates the command's terminal: the prompt is
    answered ``cancelled`` at once. The editor then creates the terminal and answers
    with its id: the agent had stopped waiting and forgot it — never released, the
    command ran on in the editor, unseen, though the person had cancelled it. The late
    terminal is released, which kills its command."""
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def scenario() -> None:
        editor = SlowTerminalEditor()
        async with editor_agent(tmp_path, sandbox="off", editor=editor) as agent:
            sid = await open_session(agent, workspace, TERMINAL)
            prompt = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text("run sleep 600"))
            )
            await editor.creating.wait()
            await agent.conn.cancel(session_id=sid)
            assert (await asyncio.wait_for(prompt, PROMPT_CANCEL_S)).stop_reason == "cancelled"
            editor.go.set()
            await asyncio.wait_for(editor.released.wait(), PROMPT_CANCEL_S)
            assert editor.methods() == ["terminal/create", "terminal/release"]
            terminal = editor.terminals["term-1"]
            assert terminal.released and terminal.process.returncode is not None
            end = editor.ends()[-1]
            assert end.status == "failed" and end.field_meta == {
                "greenroom": {"status": "interrupted"}
            }
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())
