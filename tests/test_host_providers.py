"""The provider clients a host shares among its sessions (R-HOST-1, R-SHARE-1)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio
import trio.testing

import greenroom.actors.runtime.provider_clients as host_module
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime import Host
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.settings import SessionSettings

SLOW_IMPORT_S = 5.0
"""How long the stand-in for a provider library's import waits for the event loop."""


def _brain(_request: ModelRequest) -> Reply:
    return Reply(blocks=(text("hi"),))


async def test_making_a_provider_leaves_the_event_loop_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first session of a provider makes its client, which imports the provider's
    library (the anthropic SDK: seconds on a busy machine). The event loop runs meanwhile:
    the stand-in import returns only once a task of the loop has run, and both sessions
    created together get the one client, made once (R-HOST-1: a host's other sessions,
    connections and lease renewals do not stall behind it)."""
    loop_ran = threading.Event()
    made: list[bool] = []

    def slow_make(settings: SessionSettings) -> ScriptedProvider:
        made.append(loop_ran.wait(timeout=SLOW_IMPORT_S))
        return ScriptedProvider(_brain)

    monkeypatch.setattr(host_module, "make_provider", slow_make)
    with trio.fail_after(30):
        async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
            sessions = []

            async def create() -> None:
                sessions.append(await host.create_session(provider="scripted"))

            nursery.start_soon(create)
            nursery.start_soon(create)
            await trio.testing.wait_all_tasks_blocked()
            loop_ran.set()
    assert made == [True]
    assert len(sessions) == 2
    assert sessions[0].provider is sessions[1].provider
