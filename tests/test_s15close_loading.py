"""A load of a session that waits for another load of the same session, and goes on only
once the host's close has begun (R-HOST-3): the close listed the session (the first load
was under way) and closed what that load opened; the second load then found the session
closed and opened it again — in a closing host, where nothing closes it and its writer
lock stays taken, so the next host on the data dir could not load it. Now such a load
raises ``HostClosed`` and opens nothing. The order is forced with events: trio may wake
the close or the second load first, and the second must come last."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, open_host
from test_hostclose_loading import a_saved_session
from test_x15_close_answers import hold_loads_until_close

from greenroom.actors.runtime.errors import HostClosed
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session_ids import OpeningSessions


def _second_load_goes_on_last(
    monkeypatch: pytest.MonkeyPatch, closed: trio.Event
) -> tuple[list[trio.lowlevel.Task], trio.Event]:
    """The wait of the load made in a task of the returned list for a load of the same
    session under way goes on only once ``closed`` is set and the close has let the session
    go. Returns that list and the event set as that load begins to wait."""
    settled = OpeningSessions.settled
    second: list[trio.lowlevel.Task] = []
    waiting = trio.Event()

    async def settled_after_the_close(self: OpeningSessions[Any], *args: Any) -> Any:
        if trio.lowlevel.current_task() not in second:
            return await settled(self, *args)
        waiting.set()
        found = await settled(self, *args)
        await closed.wait()  # the close closed what the first load opened
        return found if found is None else await settled(self, *args)

    monkeypatch.setattr(OpeningSessions, "settled", settled_after_the_close)
    return second, waiting


async def test_s15close_a_load_waiting_for_another_as_its_host_closes_is_refused(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hello, session_id = await a_saved_session(data_dir, workspace)

    closed_ids: list[str] = []
    closed = trio.Event()
    outcomes: list[str] = []
    loading = hold_loads_until_close(monkeypatch)  # the first load: until the close began
    second, waiting = _second_load_goes_on_last(monkeypatch, closed)

    async def first_load(host: Host) -> None:
        with contextlib.suppress(HostClosed):  # the close may refuse it too
            await host.load_session(session_id, provider=hello)

    async def second_load(host: Host) -> None:
        second.append(trio.lowlevel.current_task())
        try:
            await host.load_session(session_id, provider=hello)
        except Exception as exc:  # what it raised is the test's to check
            outcomes.append(type(exc).__name__)
        else:
            outcomes.append("loaded")

    def on_closed(closed_id: str) -> None:
        closed_ids.append(closed_id)
        closed.set()

    async with open_host(data_dir) as host:
        host.on_closed = on_closed
        host.start_task(lambda: first_load(host))
        with trio.fail_after(RUN_TIMEOUT_S):
            await loading.wait()
            host.start_task(lambda: second_load(host))
            await waiting.wait()  # it passed check_open; the close begins now
    monkeypatch.undo()
    assert outcomes == ["HostClosed"]
    assert closed_ids == [session_id]  # the first load's session, closed by the close

    async with open_host(data_dir) as host:  # nothing kept its lock: it loads here
        again = await host.load_session(session_id, provider=hello)
        assert again.id == session_id
