"""The streamer's door into its supervisor (actors/runtime/stream_door.py), the hot path of
a streaming session (R-PERF-1): a batch is handled in the streamer's task when the
supervisor waits on an empty inbox, and never ahead of a message sent before it (R-RUN-8:
outputs in the order things happened); a batch that may have changed the task makes the
supervisor look at its next step again; a handler that fails ends the task, not the
streamer (R-SEC-1)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import collect, of_type

from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.running_task import RunningTask
from greenroom.actors.runtime.stream_door import StreamDoor
from greenroom.protocols.messages import (
    InterruptTask,
    Replan,
    StreamBatch,
    SupervisorMessage,
)
from greenroom.protocols.outputs import PartialText, TaskEnd
from greenroom.protocols.stream import BlockStarted, TextDelta


class _Port:
    """What the door reads of the session: its last seq (a handler that traces moves it)."""

    def __init__(self) -> None:
        self.last_seq = 0


class _Supervisor:
    """The supervisor's side of the door: a task parked on the inbox as the real one is
    (``waiting`` set around the receive), recording what it receives and what the door
    handed it directly."""

    def __init__(self) -> None:
        self.inbox, self.receive = trio.open_memory_channel[SupervisorMessage](math.inf)
        self.port = _Port()
        self.handled: list[Any] = []
        self.received: list[Any] = []
        self.flushes = 0
        self.fail_with: Exception | None = None
        self.trace_on_handle = False
        self.door = StreamDoor(self.inbox, self.receive, self._handle, self._flush, self.port)  # type: ignore[arg-type]

    def _handle(self, message: SupervisorMessage) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        if self.trace_on_handle:
            self.port.last_seq += 1
        self.handled.append(message)

    def _flush(self) -> None:
        self.flushes += 1

    async def serve(self, count: int) -> None:
        for _ in range(count):
            self.door.waiting = True
            try:
                message = await self.receive.receive()
            finally:
                self.door.waiting = False
            self.received.append(message)


def _deltas(*words: str) -> StreamBatch:
    return StreamBatch(attempt=1, events=[TextDelta(index=0, text=w) for w in words], request=1)


async def test_a_delta_batch_for_a_waiting_supervisor_is_handled_at_once() -> None:
    """R-PERF-1: the supervisor waits on an empty inbox: the batch is handled in the
    sender's task, before ``send_nowait`` returns, and flushed; nothing goes through the
    inbox (no task switch), not even a replan, as deltas change no step."""
    supervisor = _Supervisor()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.serve, 1)
        await trio.testing.wait_all_tasks_blocked()
        batch = _deltas("a", "b")
        supervisor.door.send_nowait(batch)
        assert supervisor.handled == [batch]
        assert supervisor.flushes == 1
        await trio.testing.wait_all_tasks_blocked()
        assert supervisor.received == []
        assert supervisor.receive.statistics().tasks_waiting_receive == 1
        nursery.cancel_scope.cancel()


async def test_a_batch_never_overtakes_a_message_sent_before_it() -> None:
    """R-RUN-8: a message handed to the waiting supervisor but not yet taken (its task is
    scheduled, not run) comes first: the batch queues behind it in the inbox."""
    supervisor = _Supervisor()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.serve, 2)
        await trio.testing.wait_all_tasks_blocked()
        interrupt = InterruptTask(reason="stop")
        supervisor.inbox.send_nowait(interrupt)
        batch = _deltas("late")
        supervisor.door.send_nowait(batch)
        assert supervisor.handled == []
    assert supervisor.received == [interrupt, batch]


async def test_a_batch_while_the_supervisor_is_busy_goes_through_the_inbox() -> None:
    """Not waiting (carrying out a step): the batch waits in the inbox for it."""
    supervisor = _Supervisor()
    batch = _deltas("x")
    supervisor.door.send_nowait(batch)
    assert supervisor.handled == []
    assert supervisor.receive.receive_nowait() is batch


@pytest.mark.parametrize("why", ["not only deltas", "traced an output"])
async def test_a_batch_that_may_change_the_task_makes_the_supervisor_replan(why: str) -> None:
    """A batch that holds more than deltas (a block starts or ends, the message ends), or
    whose handling traced an output, may change the next step: handled at once, then a
    ``Replan`` wakes the supervisor to look at it."""
    supervisor = _Supervisor()
    if why == "not only deltas":
        batch = StreamBatch(attempt=1, events=[BlockStarted(index=0, kind="text")], request=1)
    else:
        supervisor.trace_on_handle = True
        batch = _deltas("x")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.serve, 1)
        await trio.testing.wait_all_tasks_blocked()
        supervisor.door.send_nowait(batch)
        assert supervisor.handled == [batch]
    assert len(supervisor.received) == 1
    replan = supervisor.received[0]
    assert isinstance(replan, Replan) and replan.error is None


async def test_a_handler_that_raises_reaches_the_supervisor_not_the_streamer() -> None:
    """R-SEC-1: the sender (the streamer) never sees the handler's exception; the
    supervisor gets it in a ``Replan`` and raises it in its own task."""
    supervisor = _Supervisor()
    supervisor.fail_with = RuntimeError("bug in a handler")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor.serve, 1)
        await trio.testing.wait_all_tasks_blocked()
        supervisor.door.send_nowait(_deltas("x"))
    (replan,) = supervisor.received
    assert isinstance(replan, Replan) and replan.error is supervisor.fail_with


async def test_a_closed_inbox_drops_the_batch_quietly() -> None:
    """After the supervisor has gone (its inbox closed), a late batch is stale: dropped,
    not raised into the streamer."""
    supervisor = _Supervisor()
    await supervisor.receive.aclose()
    supervisor.door.send_nowait(_deltas("x"))  # must not raise
    assert supervisor.handled == []


async def test_a_session_whose_batch_handling_fails_ends_the_task_failed_and_goes_on(
    host: Host,
    workspace: Path,
    providers: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R-SEC-1 through the real supervisor: a handler that raises on a batch handled in
    the streamer's task (a paced stream, 1 ms between words: the supervisor waits between
    its reads) ends that task ``failed`` with an internal error (one task_end), and the
    session runs its next task."""
    real = RunningTask.on_batch
    in_streamer: list[StreamBatch] = []

    def failing(self: RunningTask, batch: StreamBatch) -> None:
        if "_stream_attempt" in trio.lowlevel.current_task().name:
            in_streamer.append(batch)
            if len(in_streamer) == 2:
                raise RuntimeError("handler bug")
        real(self, batch)

    provider = providers(
        [
            Reply(blocks=(text("one two three four five six"),), chunk_delay_s=0.001),
            Reply(blocks=(text("fine again"),), chunk_delay_s=0.001),
        ]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    monkeypatch.setattr(RunningTask, "on_batch", failing)
    first = await collect(session.run("hi"))
    assert len(in_streamer) == 2
    (end,) = of_type(first, TaskEnd)
    assert end.status == "failed"
    assert end.message == "internal error: RuntimeError('handler bug')"
    monkeypatch.setattr(RunningTask, "on_batch", real)
    second = await collect(session.run("again"))
    assert of_type(second, TaskEnd)[0].status == "completed"
    assert "".join(p.text for p in of_type(second, PartialText)) == "fine again"
