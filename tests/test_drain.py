"""Draining a host before it stops (R-DRAIN-1), with the scripted model: running tasks go
on until their next turn boundary — the call in flight finishes, no next request is sent —
and stop there open in their traces, steering given meanwhile recorded; users get no new
task; the next host takes each held task up with nothing re-run, nothing lost, no
host-lost note and no request wasted."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, allow_all, open_host, trace_lines

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.errors import HostClosed
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols import markers
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.task import TaskMachine
from greenroom.protocols.tools import make_tool


class SlowTool:
    """``slow(x)``: runs until the test releases it, and records each run."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.ran: list[int] = []

        async def slow(x: int) -> str:
            """Work slowly on x."""
            self.started.set()
            await self.release.wait()
            self.ran.append(x)
            return f"worked on {x}"

        self.tool = make_tool(slow, parallel=False)


def _start_drain(nursery: trio.Nursery, host: Host) -> list[str]:
    """Drain ``host`` in ``nursery``; the list returned gets the ids of the held sessions."""
    held: list[str] = []

    async def drain() -> None:
        held.extend(await host.drain(grace_s=RUN_TIMEOUT_S))

    nursery.start_soon(drain)
    return held


async def _working(
    host: Host, workspace: Path, provider: ScriptedProvider, slow: SlowTool
) -> Session:
    """A session whose task ``work on 1`` runs ``slow`` (started, not released)."""
    session = await host.create_session(
        provider=provider, tools=[slow.tool], workspace_dir=workspace
    )
    session.run("work on 1", approve=allow_all)
    with trio.fail_after(RUN_TIMEOUT_S):
        await slow.started.wait()
    return session


def _said(request: ModelRequest) -> str:
    last = request.messages[-1]
    return str(last.content) if isinstance(last, UserMessage) else ""


async def test_a_drained_task_stops_at_its_turn_boundary_and_the_next_host_finishes_it(
    data_dir: Path, workspace: Path
) -> None:
    slow = SlowTool()
    first = ScriptedProvider([Reply(blocks=(text("Working."), tool_call("c1", "slow", x=1)))])
    async with open_host(data_dir) as host:
        session = await _working(host, workspace, first, slow)
        with trio.fail_after(RUN_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                held = _start_drain(nursery, host)
                await trio.testing.wait_all_tasks_blocked()
                assert host.draining
                with pytest.raises(HostClosed, match="draining"):
                    session.run("something new")
                assert session.steer("and mind the edges")
                slow.release.set()
        assert held == [session.id]
        assert len(first.requests) == 1  # the boundary sent no request
        assert slow.ran == [1]
        sid = session.id

    again = ScriptedProvider([Reply(blocks=(text("Done, edges minded."),))])
    async with open_host(data_dir) as host:
        session = await host.resume(sid, provider=again, tools=[slow.tool])
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert slow.ran == [1]  # not run again
    types = [line["type"] for line in lines]
    assert types.count("task_start") == 1 and types.count("task_end") == 1
    assert lines[-1]["status"] == "completed"
    steering = [line for line in lines if line["type"] == "user_msg" and line["kind"] == "steering"]
    assert [s["content"][0]["text"] for s in steering] == ["and mind the edges"]
    assert not any(markers.HOST_LOST_CONTINUATION in str(line) for line in lines)
    (request,) = again.requests
    assert "and mind the edges" in _said(request) and "worked on 1" in str(request.messages)


async def test_a_drain_leaves_idle_and_parked_sessions_as_they_are(
    data_dir: Path, workspace: Path
) -> None:
    """Nothing to hold: a drain of a host with only idle sessions returns at once."""
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=ScriptedProvider([Reply(blocks=(text("Hi."),))]), workspace_dir=workspace
        )
        await session.run("hello", approve=allow_all).result()
        with trio.fail_after(RUN_TIMEOUT_S):
            assert await host.drain(grace_s=RUN_TIMEOUT_S) == []


def _hold_sync_waits(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """Make the drain hold's sync of the trace wait: set the first event once it waits,
    the second to let it go on."""
    holding, syncing, synced = trio.Event(), trio.Event(), trio.Event()
    hold, sync = TaskMachine.hold, OutputEmitter.sync

    def hold_and_tell(self: TaskMachine) -> None:
        hold(self)
        holding.set()

    async def held_sync(self: OutputEmitter) -> None:
        if holding.is_set() and not syncing.is_set():  # the hold's own sync
            syncing.set()
            with trio.CancelScope(shield=True):  # ends when the test says, even cancelled
                await synced.wait()
        await sync(self)

    monkeypatch.setattr(TaskMachine, "hold", hold_and_tell)
    monkeypatch.setattr(OutputEmitter, "sync", held_sync)
    return syncing, synced


async def test_an_interrupt_while_the_drain_holds_a_task_ends_it(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The user interrupts while the held task's trace is made durable at its boundary:
    # the task ends aborted. The hold went on and parked it, the interrupt only in
    # memory, and the next host took the task up as if it had never come.
    slow = SlowTool()
    first = ScriptedProvider([Reply(blocks=(text("Working."), tool_call("c1", "slow", x=1)))])
    syncing, synced = _hold_sync_waits(monkeypatch)
    async with open_host(data_dir) as host:
        session = await _working(host, workspace, first, slow)
        with trio.fail_after(RUN_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                held = _start_drain(nursery, host)
                await trio.testing.wait_all_tasks_blocked()
                slow.release.set()
                await syncing.wait()
                session.interrupt()
            synced.set()  # after the drain: the cancelled sync ends after the hold's step
            await session.wait_idle()
        lines = trace_lines(session)
    assert held == []
    assert len(first.requests) == 1
    ends = [line for line in lines if line["type"] == "task_end"]
    assert [end["status"] for end in ends] == ["aborted"]


async def test_steering_while_the_drain_holds_a_task_is_recorded_for_the_next_host(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Steering given while the held task's trace is made durable reaches the next host:
    # it was kept only in the memory of the host that stopped.
    slow = SlowTool()
    first = ScriptedProvider([Reply(blocks=(text("Working."), tool_call("c1", "slow", x=1)))])
    syncing, synced = _hold_sync_waits(monkeypatch)
    async with open_host(data_dir) as host:
        session = await _working(host, workspace, first, slow)
        with trio.fail_after(RUN_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                held = _start_drain(nursery, host)
                await trio.testing.wait_all_tasks_blocked()
                assert session.steer("mind the edges")
                slow.release.set()
                await syncing.wait()
                assert session.steer("and the corners")
                synced.set()
        assert held == [session.id]
        sid = session.id

    again = ScriptedProvider([Reply(blocks=(text("Done."),))])
    async with open_host(data_dir) as host:
        session = await host.resume(sid, provider=again, tools=[slow.tool])
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"
    steering = [line for line in lines if line["type"] == "user_msg" and line["kind"] == "steering"]
    assert [s["content"][0]["text"] for s in steering] == ["mind the edges", "and the corners"]
    (request,) = again.requests
    assert "and the corners" in str(request.messages)


async def test_a_task_with_a_follow_up_queued_is_held_and_the_next_host_runs_both(
    data_dir: Path, workspace: Path
) -> None:
    """R-DRAIN-1, R-STEER-6: the follow-up is in the trace (``task_queued``), so the task
    it waits behind is held at its boundary like any other, sending no request; the next
    host takes the task up, then runs the follow-up, each once."""
    slow = SlowTool()
    first = ScriptedProvider([Reply(blocks=(text("Working."), tool_call("c1", "slow", x=1)))])
    async with open_host(data_dir) as host:
        session = await _working(host, workspace, first, slow)
        with trio.fail_after(RUN_TIMEOUT_S):
            assert session.follow_up("then do 2")
            async with trio.open_nursery() as nursery:
                held = _start_drain(nursery, host)
                await trio.testing.wait_all_tasks_blocked()
                slow.release.set()
        assert held == [session.id]
        assert len(first.requests) == 1  # the boundary sent no request
        sid = session.id

    again = ScriptedProvider([
        Reply(blocks=(text("Done with 1."),)),
        Reply(blocks=(text("Done with 2."),)),
    ])  # fmt: skip
    async with open_host(data_dir) as host:
        session = await host.resume(sid, provider=again, tools=[slow.tool])
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert slow.ran == [1]  # not run again
    assert [line["status"] for line in lines if line["type"] == "task_end"] == [
        "completed", "completed",
    ]
    first_turn, follow_up = again.requests
    assert "worked on 1" in str(first_turn.messages) and "then do 2" not in str(first_turn.messages)
    assert "then do 2" in _said(follow_up)
    assert not any(markers.HOST_LOST_CONTINUATION in str(line) for line in lines)


async def test_a_task_whose_request_fails_during_a_drain_with_steering_queued_holds_it_recorded(
    data_dir: Path, workspace: Path
) -> None:
    # Steering came while a request streamed, then the host began to drain, then the
    # request failed: held at its retry (which takes no steering: the turn's next input
    # assembly does), the task left the steering in this host's memory alone, and the
    # next host took the task up without it. (A hold that let the task go on to record
    # it came back to the same retry for ever, the host's loop spinning.) Now the retry is
    # sent and the boundary after it holds, the steering recorded.
    from conftest import model_error

    from greenroom.actors.providers.scripted import ScriptedStream

    streaming, fail_now = trio.Event(), trio.Event()

    async def fails_when_told(request: ModelRequest, stream: ScriptedStream) -> None:
        streaming.set()
        await fail_now.wait()
        await stream.fail(model_error("timeout"))

    first = ScriptedProvider([fails_when_told, Reply(blocks=(text("Hi."),))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=first, workspace_dir=workspace)
        session.run("hi", approve=allow_all)
        with trio.fail_after(RUN_TIMEOUT_S):
            await streaming.wait()
            assert session.steer("mind the edges")
            async with trio.open_nursery() as nursery:
                held = _start_drain(nursery, host)
                await trio.testing.wait_all_tasks_blocked()
                fail_now.set()
        lines = trace_lines(session)
    assert held == [session.id]
    assert len(first.requests) == 2  # the retry was sent, nothing after it
    steering = [line for line in lines if line.get("kind") == "steering"]
    assert [line["content"][0]["text"] for line in steering] == ["mind the edges"]
    assert not [line for line in lines if line["type"] == "task_end"]
