"""How the streamer hands a network read's events to its supervisor: directly, in the
streamer's own task step, when the supervisor waits for them with nothing before them in
its inbox; added to the batch still waiting there otherwise; in order either way, and the
supervisor's wait still ends at the terminal event (R-ACTOR-1: the supervisor alone
decides what the events mean)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import Deliver
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import PartialText, TaskEnd
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    MessageCompleted,
    TextDelta,
    TokenUsage,
)

WORDS = [f"w{i} " for i in range(40)]
BOUND_S = 10.0


class ReadByRead:
    """A provider that delivers one word per simulated network read, each read after
    every other task has settled (``paced``), or all at once without a checkpoint."""

    name = "read-by-read"

    def __init__(self, *, paced: bool, whole_reads: bool = True) -> None:
        self.paced = paced
        self.whole_reads = whole_reads

    def open_task(self) -> ReadByRead:
        return self

    async def aclose(self) -> None:
        return None

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        await deliver([BlockStarted(index=0, kind="text")])
        for word in WORDS:
            if self.paced:
                await trio.testing.wait_all_tasks_blocked()
            await deliver([TextDelta(index=0, text=word)])
        await deliver(
            [
                BlockCompleted(index=0, block=TextBlock(text="".join(WORDS))),
                MessageCompleted(stop_reason="end_turn", usage=TokenUsage()),
            ]
        )


class Steps(trio.abc.Instrument):
    """Counts the task steps of the tasks whose name contains ``part``."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.part in task.name:
            self.count += 1


async def run_once(
    tmp_path: Path, *, paced: bool, whole_reads: bool = True
) -> tuple[list[Any], int]:
    steps = Steps("SessionSupervisor.run")
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=ReadByRead(paced=paced, whole_reads=whole_reads), workspace_dir=tmp_path
        )
        outputs: list[Any] = []
        trio.lowlevel.add_instrument(steps)
        try:
            with trio.fail_after(BOUND_S):
                async for out in session.run("hi"):
                    outputs.append(out)
        finally:
            trio.lowlevel.remove_instrument(steps)
    return outputs, steps.count


async def test_reads_reach_the_consumer_without_waking_the_supervisor(tmp_path: Path) -> None:
    outputs, supervisor_steps = await run_once(tmp_path, paced=True)
    assert [o.text for o in outputs if isinstance(o, PartialText)] == WORDS
    assert isinstance(outputs[-1], TaskEnd) and outputs[-1].status == "completed"
    # Forty reads: woken once per read, the supervisor would step forty times or more.
    assert supervisor_steps < len(WORDS) // 2


async def test_chunk_by_chunk_providers_wake_the_supervisor(tmp_path: Path) -> None:
    # Without whole_reads the supervisor handles each batch in its own step.
    outputs, supervisor_steps = await run_once(tmp_path, paced=True, whole_reads=False)
    assert [o.text for o in outputs if isinstance(o, PartialText)] == WORDS
    assert supervisor_steps >= len(WORDS)


@pytest.mark.parametrize("whole_reads", [True, False])
async def test_deliveries_without_a_checkpoint_arrive_whole_and_in_order(
    tmp_path: Path, whole_reads: bool
) -> None:
    # Every delivery after the first joins the batch still waiting in the inbox.
    outputs, _ = await run_once(tmp_path, paced=False, whole_reads=whole_reads)
    assert [o.text for o in outputs if isinstance(o, PartialText)] == WORDS
    assert isinstance(outputs[-1], TaskEnd) and outputs[-1].status == "completed"
