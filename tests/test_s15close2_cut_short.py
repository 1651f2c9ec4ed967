"""A ``close_session`` cut short — its caller's cancel scope ends it while the session's
work still ends — ends the close all the same once that work has ended (R-HOST-3): the
session's private MCP connections (``"scope": "session"``) close and ``Host.on_closed`` is
told, as after a close that ran to its end; meanwhile a load of the session in the same
host waits, as it waits for a close.

Before: the host forgot the session and skipped the rest of its close: its own MCP server
ran until the host closed, and ``on_closed`` (a cluster node's way to let the session go)
never heard of it. The close is cut while the disk holds an fsync of the session's trace
(``FaultyDisk.stall``); the real MCP test server stands in for a session's own server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect
from support.disks import FaultyDisk
from test_mcp import alive, content_text, outputs_by_call, stdio
from test_s15lock_cancelled_close import _close_cut_short, _hello, _on

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session


async def _own_server(host: Host, workspace: Path) -> tuple[Session, int]:
    """A session with a server of its own, and the process id of that server."""
    provider = ScriptedProvider([
        Reply(blocks=(tool_call("p1", "mcp__own__pid"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"own": stdio(scope="session")}
    )
    by_call = outputs_by_call(await collect(session.run("go", approve=allow_all)))
    return session, int(content_text(by_call["p1"]).splitlines()[0])


async def test_s15close2_a_close_cut_short_closes_the_sessions_servers_and_tells_on_closed(
    data_dir: Path, workspace: Path
) -> None:
    disk = FaultyDisk()
    told: list[str] = []
    async with Host.open(data_dir, trace_store=_on(disk)) as host:
        host.on_closed = told.append
        session, pid = await _own_server(host, workspace)
        disk.stall(session.trace_path)  # its task_end is written, not yet fsynced
        await _close_cut_short(host, session.id, disk)
        assert host.sessions == ()
        # Its work may still write: nothing of the close's end has happened yet.
        assert told == [] and alive(pid)
        loaded: list[Session] = []

        async def load() -> None:
            loaded.append(await host.load_session(session.id, provider=ScriptedProvider(_hello)))

        with trio.fail_after(RUN_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load)
                disk.release()
        # The load waited for the close's end: the server is gone, on_closed told.
        assert told == [session.id]
        assert not alive(pid)
        (again,) = loaded
        await collect(again.run("again"))


async def test_s15close2_a_delete_cut_short_closes_the_sessions_servers_and_tells_nobody(
    data_dir: Path, workspace: Path, monkeypatch: Any
) -> None:
    """A ``delete_session`` cut short as well: the session's own server closes once its
    work has ended (a load waits for it); ``on_closed``, which no deletion tells, stays
    silent."""
    disk = FaultyDisk()
    told: list[str] = []
    async with Host.open(data_dir, trace_store=_on(disk)) as host:
        host.on_closed = told.append
        session, pid = await _own_server(host, workspace)
        disk.stall(session.trace_path)
        monkeypatch.setattr(host, "close_session", host.delete_session)
        await _close_cut_short(host, session.id, disk)
        assert alive(pid)
        with trio.fail_after(RUN_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: host.load_session(session.id, provider=ScriptedProvider(_hello))
                )
                disk.release()
        assert told == []
        assert not alive(pid)
