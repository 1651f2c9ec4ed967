"""A ``close_session`` cut short — its caller's cancel scope ends it mid-close — lets the
session's writer lock (``writer.lock``) go exactly when the session's trace can no longer be
written by its host: once its task has ended and its trace is synced, as the close would
have, never before (R-TRACE: one writer a trace).

Before the fix: the host had forgotten the session but its trace log kept it, lock and all,
until the host itself closed; another host on the data dir (``greenroom approve`` beside a
server) was refused the session with ``SessionOpenElsewhere`` although it was open nowhere.

The close is cut while the disk holds an fsync of the session's trace (``FaultyDisk.stall``):
the close's own sync, or the one of the interrupted task's end.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, Gates, allow_all, collect, open_host, port_of, trace_lines
from support.disks import FaultyDisk

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import SessionOpenElsewhere
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.trace_store import FileTraceStore
from greenroom.protocols.context import ModelRequest


def _hello(request: ModelRequest) -> Reply:
    return Reply(blocks=(text("hello"),))


def _on(disk: FaultyDisk) -> Callable[[Path], FileTraceStore]:
    return lambda data_dir: FileTraceStore(data_dir, disk=disk)


class _Releases:
    """Each release of ``session_id`` by ``host``'s trace log, with what ``seen`` says then;
    ``count(n)`` waits for the n-th."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, host: Host, session_id: str,
        seen: Callable[[], Any],
    ) -> None:
        self.seen: list[Any] = []
        self._events: dict[int, trio.Event] = {}
        log = host.trace_store.log
        original = log.release

        def release(released: str) -> None:
            original(released)
            if released == session_id:
                self.seen.append(seen())
                self._event(len(self.seen)).set()

        monkeypatch.setattr(log, "release", release)

    def _event(self, n: int) -> trio.Event:
        return self._events.setdefault(n, trio.Event())

    async def count(self, n: int) -> None:
        with trio.fail_after(RUN_TIMEOUT_S):
            await self._event(n).wait()


async def _close_cut_short(host: Host, session_id: str, disk: FaultyDisk) -> None:
    """``host.close_session(session_id)``, cancelled once the disk holds an fsync."""
    closed = False
    with trio.CancelScope() as scope:

        async def cut() -> None:
            await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cut)
            await host.close_session(session_id)
            closed = True
    assert scope.cancelled_caught and not closed
    assert disk.stalled.is_set()


async def _refused(data_dir: Path, session_id: str) -> None:
    async with open_host(data_dir) as other:
        with pytest.raises(SessionOpenElsewhere):
            await other.load_session(session_id, provider=ScriptedProvider(_hello))


async def test_a_close_cut_short_while_its_trace_syncs_lets_the_lock_go_once_synced(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FaultyDisk()
    async with Host.open(data_dir, trace_store=_on(disk)) as host:
        session = await host.create_session(provider=ScriptedProvider(_hello),
                                            workspace_dir=workspace)
        await collect(session.run("hello"))  # its task_end is written, not yet fsynced
        releases = _Releases(monkeypatch, host, session.id, lambda: None)
        disk.stall(session.trace_path)
        await _close_cut_short(host, session.id, disk)
        assert host.sessions == ()
        await _refused(data_dir, session.id)  # its trace is not synced yet
        disk.release()
        await releases.count(1)
        # Host A is still open; the session is open nowhere, and another host takes it.
        async with open_host(data_dir) as other:
            loaded = await other.load_session(session.id, provider=ScriptedProvider(_hello))
            await collect(loaded.run("again"))
            lines = trace_lines(loaded)
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert [line["type"] for line in lines].count("task_end") == 2


async def test_a_close_cut_short_while_its_task_ends_keeps_the_lock_until_the_task_wrote_all(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, gates: Gates
) -> None:
    """The close interrupts a running task and is cut while that task's end waits for the
    disk: the task can still write, so the lock stays (another host is refused) until it
    has ended; then it is let go, and not before."""
    disk = FaultyDisk()
    provider = ScriptedProvider([Reply(blocks=(tool_call("c1", "wait", key="a"),))])
    async with Host.open(data_dir, trace_store=_on(disk)) as host:
        session = await host.create_session(provider=provider, tools=[gates.tool()],
                                            workspace_dir=workspace)
        port = port_of(session)
        session.run("wait", approve=allow_all).detach()
        await gates.started("a")

        def at_release() -> tuple[bool, str]:
            return port.busy, trace_lines(session)[-1]["type"]

        releases = _Releases(monkeypatch, host, session.id, at_release)
        disk.stall(session.trace_path)
        await _close_cut_short(host, session.id, disk)
        await _refused(data_dir, session.id)
        assert releases.seen == []
        disk.release()
        await releases.count(1)
        # Let go with the task ended and its last record written.
        assert releases.seen == [(False, "task_end")]
        async with open_host(data_dir) as other:
            loaded = await other.load_session(session.id, provider=ScriptedProvider(_hello))
            await collect(loaded.run("again"))
            lines = trace_lines(loaded)
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    ends = [line["status"] for line in lines if line["type"] == "task_end"]
    assert ends == ["aborted", "completed"]


async def test_a_load_in_the_same_host_after_a_close_cut_short_waits_for_its_release(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same host loads the session again while the cut-short close still waits for the
    disk: the load waits until the session is let go, then opens it with the whole trace
    and takes its lock again — never a second writer in the host, whose late release
    would take the position and the lock from under the new one."""
    disk = FaultyDisk()
    order: list[str] = []
    async with Host.open(data_dir, trace_store=_on(disk)) as host:
        session = await host.create_session(provider=ScriptedProvider(_hello),
                                            workspace_dir=workspace)
        await collect(session.run("hello"))
        releases = _Releases(monkeypatch, host, session.id, lambda: order.append("released"))
        disk.stall(session.trace_path)
        await _close_cut_short(host, session.id, disk)
        loaded: list[Session] = []

        async def load() -> None:
            loaded.append(await host.load_session(session.id, provider=ScriptedProvider(_hello)))
            order.append("loaded")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load)
            disk.release()
            await releases.count(1)
        assert order == ["released", "loaded"]
        (again,) = loaded
        await _refused(data_dir, session.id)
        await collect(again.run("again"))  # its trace position is its own
        await _refused(data_dir, session.id)
        await host.close_session(session.id)
        assert len(releases.seen) == 2
        async with open_host(data_dir) as other:
            reloaded = await other.load_session(session.id, provider=ScriptedProvider(_hello))
            lines = trace_lines(reloaded)
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    ends = [line["status"] for line in lines if line["type"] == "task_end"]
    assert ends == ["completed", "completed"]
