"""A host that closes while a load of a session is under way closes that session too once
the load ends (R-HOST-3): the close listed only the sessions open when it began, so one
whose load passed ``check_open`` just before was left open — its writer lock taken after
the store let every lock go, kept by the process, and the next host in it could not load
the session (``SessionOpenElsewhere``). The order is forced with events."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio
from conftest import RUN_TIMEOUT_S, open_host
from test_x15_close_answers import hold_loads_until_close

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.errors import HostClosed
from greenroom.actors.runtime.host import Host


async def a_saved_session(data_dir: Path, workspace: Path) -> tuple[ScriptedProvider, str]:
    """A session that ran one task, its host closed since: the provider that answers
    ``hello``, and the session's id."""
    hello = ScriptedProvider(lambda request: Reply(blocks=(text("hello"),)))
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=hello, workspace_dir=workspace)
        await session.run("hello").collect()
    return hello, session.id


async def test_a_session_loading_as_its_host_closes_is_closed_with_it(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hello, session_id = await a_saved_session(data_dir, workspace)

    async def load(host: Host) -> None:
        # A host may refuse it as well; what it must not do is leave it open.
        with contextlib.suppress(HostClosed):
            await host.load_session(session_id, provider=hello)

    closed: list[str] = []
    loading = hold_loads_until_close(monkeypatch)
    async with open_host(data_dir) as host:
        host.on_closed = closed.append
        host.start_task(lambda: load(host))
        with trio.fail_after(RUN_TIMEOUT_S):
            await loading.wait()
    assert closed == [session_id]
    monkeypatch.undo()

    async with open_host(data_dir) as host:  # its lock was let go: it loads here
        again = await host.load_session(session_id, provider=hello)
        assert again.id == session_id
