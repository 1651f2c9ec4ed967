"""Draining a host before it stops (R-DRAIN-1): what :meth:`Host.drain
<greenroom.actors.runtime.host.Host.drain>` does with the sessions open in it.

Every running task goes on — a streaming answer completes, its tool calls finish — to its
next turn boundary, where its supervisor holds it (the task stays open in its trace with
the steering it took recorded, and holds nothing; see ``SessionSupervisor._hold``). A
foreground subagent is not held: it is part of its parent's tool call, which finishes. A
session whose task is held, or parked on people, is then handed over when a hand-over is
given (a cluster host hands it to another host at once: R-DRAIN-2); else the next host
to open the data dir takes it up (``resume_tasks``), with the follow-ups queued behind it
(recorded as ``task_queued``: R-STEER-6)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import trio

from greenroom.actors.runtime.port import SessionPort, TaskInput

__all__ = ["HandOver", "drain_sessions", "holds_for_drain"]

HandOver = Callable[[str], Awaitable[None]]
"""Hands a held or parked session, by id, to another host."""


def holds_for_drain(port: SessionPort) -> bool:
    """Whether ``port``'s task stops at its next turn boundary: its host drains, it is no
    foreground subagent (whose parent's call must finish), and every task queued behind it
    is one the trace holds (``task_queued``: a user's follow-up, or steering that came too
    late for its task): the host that takes the task up runs them after it (R-STEER-6). A
    background child's report queued as a task (or a compaction) is in this host's memory
    alone: such a task runs on, within the drain's grace, and a later boundary holds."""
    return (
        port.host.draining
        and (port.parent_id is None or port.report_as is not None)
        and all(isinstance(t, TaskInput) and t.queued_id for t in port.machine.queued_tasks)
    )


async def drain_sessions(
    ports: Iterable[SessionPort], grace_s: float, hand_over: HandOver | None
) -> list[str]:
    """Wait, within ``grace_s``, for every session of ``ports`` to have no work running;
    hand each held or parked one over as it comes to rest. Returns the held ones' ids."""
    held: list[str] = []

    async def settle(port: SessionPort) -> None:
        await port.wait_idle()
        if port.held:
            held.append(port.id)
        if hand_over is not None and (port.held or port.parked) and not port.closed:
            await hand_over(port.id)

    with trio.move_on_after(grace_s):
        async with trio.open_nursery() as nursery:
            for port in ports:
                nursery.start_soon(settle, port)
    return held
