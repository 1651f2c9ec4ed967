"""R-HOST-3: deleting a session interrupts its running task, waits until it has finished
writing, then removes its files: no late record lands after deletion."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from conftest import collect, of_type

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.protocols.outputs import TaskEnd
from greenroom.protocols.tools import tool

started = trio.Event()


@tool(parallel=True)
async def wait_forever() -> str:
    """Never returns on its own."""
    started.set()
    await trio.sleep_forever()
    return "unreachable"


async def test_delete_interrupts_then_removes_every_file(tmp_path: Path) -> None:
    provider = ScriptedProvider([Reply(blocks=(text("Waiting."), tool_call("c1", "wait_forever")))])
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=provider, tools=[wait_forever], workspace_dir=tmp_path
        )
        run = session.run("go", approve=lambda call: "allow")
        with trio.fail_after(10):
            await started.wait()
            await host.delete_session(session.id)
            outputs = await collect(run)
        assert of_type(outputs, TaskEnd)[0].status == "aborted"
        assert not session.directory.exists()
        assert session.id not in {info.session_id for info in await host.list_sessions()}
        with pytest.raises(SessionNotFound):
            await host.delete_session(session.id)
    assert not session.directory.exists()  # nothing was written after the deletion
