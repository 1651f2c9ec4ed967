"""The one teardown of a task's actors (R-ACTOR-2, R-RUN-7): a completed task's actors end
because their inboxes close, with no cancellation unwinding through them; any other end
cancels them; an actor that closing does not end is cancelled after
``FINISHED_GRACE_S``; the streamer cancels an attempt still running once its inbox is
closed (the attempt's late batches are stale)."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import trio
import trio.testing
from conftest import allow_all, collect, of_type, open_host, port_of

import greenroom.actors.runtime.running_task as running_task_module
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.actors.runtime.port import TaskInput
from greenroom.actors.runtime.running_task import FINISHED_GRACE_S, TaskWork
from greenroom.actors.runtime.tool_pool import ToolPool
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.messages import (
    ApprovalDecided,
    ApproveCall,
    PoolCommand,
    RunToolCall,
    StartAttempt,
    StreamerCommand,
    SupervisorMessage,
)
from greenroom.protocols.outputs import TaskEnd
from greenroom.protocols.tools import tool


@tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return f"value-{key}"


def record_stops(monkeypatch: Any) -> list[tuple[bool, bool]]:
    """Every ``TaskWork.stop``: whether it was a finished task's, and whether the work's
    scope was cancelled by the time it returned."""
    stops: list[tuple[bool, bool]] = []
    original = TaskWork.stop

    async def stop(self: TaskWork, *, finished: bool = False) -> None:
        await original(self, finished=finished)
        stops.append((finished, self.scope.cancel_called))

    monkeypatch.setattr(running_task_module.TaskWork, "stop", stop)
    return stops


async def test_a_completed_task_ends_its_actors_by_closing_their_inboxes(
    data_dir: Path, workspace: Path, providers: Any, monkeypatch: Any
) -> None:
    """R-ACTOR-2: after a task with a tool call completes, its broker, pool and streamer
    have ended on their closed inboxes; nothing was cancelled."""
    stops = record_stops(monkeypatch)
    script = [
        Reply(blocks=(tool_call("call_1", "lookup", key="a"),)),
        Reply(blocks=(text("done"),)),
    ]
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=providers(script), tools=[lookup], workspace_dir=workspace
        )
        outputs = await collect(session.run("look a up", approve=allow_all))
    end = of_type(outputs, TaskEnd)[0]
    assert end.status == "completed", end.message
    assert stops == [(True, False)]


async def test_an_interrupted_task_cancels_its_actors(
    data_dir: Path, workspace: Path, providers: Any, monkeypatch: Any
) -> None:
    """R-ABORT-1, R-ACTOR-2: an interrupt is a cancellation of the task's actors, the
    stream that runs among them included."""
    stops = record_stops(monkeypatch)
    streaming = trio.Event()

    async def forever(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text_delta("Half a sen")
        streaming.set()
        await trio.sleep_forever()

    async with open_host(data_dir) as host:
        session = await host.create_session(provider=providers([forever]), workspace_dir=workspace)
        run = session.run("write")
        with trio.fail_after(10):
            await streaming.wait()
        assert session.interrupt() is True
        outputs = await collect(run)
    assert of_type(outputs, TaskEnd)[0].status == "aborted"
    assert stops == [(False, True)]


async def test_a_finished_stop_cancels_an_actor_that_does_not_end_within_the_grace(
    data_dir: Path, workspace: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A broker still waiting on an approve callback when a finished task's inboxes close
    (a bug: a completed task has no call waiting) is cancelled after FINISHED_GRACE_S,
    so the teardown stays bounded."""
    asked = trio.Event()

    async def never(call: ToolCallBlock) -> str:
        asked.set()
        await trio.sleep_forever()
        return "allow"  # pragma: no cover - never reached

    async with open_host(data_dir) as host:
        session = await host.create_session(workspace_dir=workspace)
        port = port_of(session)
        inbox_send, inbox = trio.open_memory_channel[SupervisorMessage](math.inf)
        work = TaskWork(
            port,
            TaskInput(content=(TextBlock(text="x"),), approve=never, thinking_level=None),
            inbox_send,
            run_child=None,  # type: ignore[arg-type]
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(work.run)
            work.approvals.send_nowait(
                ApproveCall(call=ToolCallBlock(id="call_1", name="lookup", arguments={}))
            )
            await asked.wait()
            began = trio.current_time()
            await work.stop(finished=True)
            assert trio.current_time() - began == FINISHED_GRACE_S
            assert work.scope.cancel_called
        with inbox:
            assert not [m for m in iter_ready(inbox) if isinstance(m, ApprovalDecided)]


def iter_ready(channel: trio.MemoryReceiveChannel[SupervisorMessage]) -> list[SupervisorMessage]:
    """What is waiting in ``channel`` now."""
    ready: list[SupervisorMessage] = []
    while True:
        try:
            ready.append(channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return ready


class _Endless:
    """A provider task whose one stream never ends; it notes its start and its end."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.cancelled = False

    async def stream(self, request: ModelRequest, deliver: Any) -> None:
        self.started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled = True
            raise


async def test_the_streamer_ends_when_its_inbox_closes_cancelling_a_stale_attempt() -> None:
    """R-ACTOR-2: closing the streamer's inbox ends it; an attempt still streaming is
    stale (its task is over) and is cancelled rather than waited for."""
    provider = _Endless()
    inbox_send, _inbox = trio.open_memory_channel[SupervisorMessage](math.inf)
    commands_send, commands = trio.open_memory_channel[StreamerCommand](math.inf)
    request = ModelRequest(model="m", system=None, tools=(), messages=())
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(LLMStreamer(provider, inbox_send).run, commands)  # type: ignore[arg-type]
            commands_send.send_nowait(
                StartAttempt(request=request, attempt=1, delay_ms=0, number=1)
            )
            await provider.started.wait()
            commands_send.close()
    assert provider.cancelled


async def test_the_pool_ends_when_its_inbox_closes_ending_a_call_still_running(
    tmp_path: Path,
) -> None:
    """R-ACTOR-2: closing the pool's inbox ends it; a call still running is ended with it
    (cancelled) rather than waited for, and reports nothing more."""
    started = trio.Event()
    ended: list[str] = []

    @tool
    async def forever() -> str:
        """Never returns."""
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            ended.append("cancelled")
        return "never"  # pragma: no cover - never reached

    async def nothing_to_sync() -> None:
        await trio.lowlevel.checkpoint()

    inbox_send, inbox = trio.open_memory_channel[SupervisorMessage](math.inf)
    commands_send, commands = trio.open_memory_channel[PoolCommand](math.inf)
    pool = ToolPool(
        tools={"forever": forever},
        inbox=inbox_send,
        workspace_dir=tmp_path,
        scratchpad_dir=tmp_path,
        sync_trace=nothing_to_sync,
        result_budget=10_000,
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run, commands)
            commands_send.send_nowait(
                RunToolCall(call=ToolCallBlock(id="call_1", name="forever", arguments={}),
                            position=0)
            )
            await started.wait()
            commands_send.close()
    assert ended == ["cancelled"]
    with inbox:
        assert iter_ready(inbox) == []


def _lookup_then_answer() -> ScriptedProvider:
    return ScriptedProvider(
        [
            Reply(blocks=(text("looking"), tool_call("c1", "lookup", key="a"))),
            Reply(blocks=(text("a is found"),)),
        ],
        keep_requests=False,
    )


async def test_a_session_created_and_run_to_completion_leaves_no_cyclic_garbage(
    tmp_path: Path,
) -> None:
    # R-PERF-1: what a finished task and a new session leave is freed by reference counting.
    # A cycle (the supervisor and its emitter, the turn runner and its calls in doubt,
    # session.json's pure-Python encoder) kept the run's channels, machines and trio task
    # until a full collection, and the memory they held pinned in the allocator's pools.
    async with open_host(tmp_path / "data") as host:

        async def one_session() -> str:
            session = await host.create_session(
                provider=_lookup_then_answer(), tools=[lookup], workspace_dir=tmp_path
            )
            outputs = await collect(session.run("look a up", approve=allow_all))
            return of_type(outputs, TaskEnd)[-1].status

        assert await one_session() == "completed"  # imports, caches, pools
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            assert await one_session() == "completed"
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            left = [type(o).__qualname__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if was_enabled:
                gc.enable()
    assert left == []

