"""The gateway's ``steer`` answers ``queued: true`` only for input that survives the host,
and tells a client whose input was dropped unrun so (R-STEER-1, R-STEER-6): a real server
and websocket clients (``test_gateway``'s harness), the orders forced with trio events."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import Gates
from test_gateway import BOUND_S, connect, serving

from greenroom.actors.providers.scripted import Reply, ScriptStep, text, tool_call
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.session import Session
from greenroom.protocols import jsonrpc


def steered_event(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """Set once ``Session.steer`` has handed its input to the session (or refused it)."""
    steered = trio.Event()
    steer = Session.steer

    def handed_over(self: Session, messages: Any, **options: Any) -> bool:
        try:
            return steer(self, messages, **options)
        finally:
            steered.set()

    monkeypatch.setattr(Session, "steer", handed_over)
    return steered


def hold_task_end(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """The first task's end waits, once written, until the test lets it go: while it
    waits, its supervisor reads no message. Returns (ending, let_end)."""
    ending, let_end = trio.Event(), trio.Event()
    sync_task_end = OutputEmitter.sync_task_end

    async def held(self: OutputEmitter, *, completed: bool) -> None:
        if not ending.is_set():
            ending.set()
            await let_end.wait()
        await sync_task_end(self, completed=completed)

    monkeypatch.setattr(OutputEmitter, "sync_task_end", held)
    return ending, let_end


async def test_steering_a_closing_session_is_told_it_was_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gates: Gates
) -> None:
    # R-STEER-1: steering that reaches a session being closed never runs (its task is
    # interrupted, and a closed session starts none). The client was answered queued:
    # true all the same; it now gets error 410 saying the input was dropped.
    ending, let_end = hold_task_end(monkeypatch)
    steered = steered_event(monkeypatch)
    read, let_input_go = trio.Event(), trio.Event()
    attach: Callable[..., Awaitable[Any]] = Session.attach

    async def read_then_wait(self: Session, messages: Any, *, confine: bool = False) -> Any:
        # The input is read before the session closes; the call goes on after.
        attached = await attach(self, messages, confine=confine)
        if not read.is_set():
            read.set()
            await let_input_go.wait()
        return attached

    def script() -> list[ScriptStep]:
        return [Reply(blocks=(tool_call("c1", "wait", key="a"),)), Reply(blocks=(text("ok"),))]

    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, script, tools=[gates.tool()], approve="all") as server,
            connect(server) as client,
            trio.open_nursery() as nursery,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("run", {"session_id": sid, "input": "work"})
            await gates.started("a")
            monkeypatch.setattr(Session, "attach", read_then_wait)
            await client.send(
                {"jsonrpc": "2.0", "id": "dropped", "method": "steer",
                 "params": {"session_id": sid, "input": "TOO LATE"}}
            )
            await read.wait()
            # The host closes the session (as a cluster node that hands it over does).
            nursery.start_soon(server.host.close_session, sid)
            await ending.wait()  # interrupted by the close: its task is ending
            let_input_go.set()
            # The steering waits in the inbox of the supervisor whose task is ending.
            await steered.wait()
            let_end.set()
            answer = await client.response("dropped")
            assert answer["error"]["code"] == jsonrpc.GONE == 410, answer
            assert "dropped" in answer["error"]["message"]
            assert len(server.providers[0].requests) == 1  # the words reached no model
