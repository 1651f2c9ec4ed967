"""Draining a host before it stops (R-DRAIN-1): what :meth:`Host.drain
<greenroom.actors.runtime.host.Host.drain>` does with the sessions open in it.

Every running task goes on — a streaming answer completes, its tool calls finish — to its
next turn boundary, where its supervisor holds it (the task stays open in its trace with
the steering it took recorded, and holds nothing; see ``SessionSupervisor._hold``). A
foreground subagent is not held: it is part of its parent's tool call, which finishes;
nor, without a hand-over, a subagent's background child (see :func:`holds_for_drain`). A
session whose task is held, or parked on people, is then handed over when a hand-over is
given (a cluster host hands it to another host at once: R-DRAIN-2); else the next host
to open the data dir takes it up (``resume_tasks``), with the follow-ups queued behind it
(recorded as ``task_queued``: R-STEER-6). Work that starts during the drain — a parked
task a person's answer wakes — is waited for as well (:func:`drain_sessions`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

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
    alone: such a task runs on, within the drain's grace, and a later boundary holds.

    Nor is a background child held whose parent is a subagent on a host that hands
    nothing over: the parent's task waits for the child's answer (R-TREE-2), so held, the
    child kept the parent — and the call of the root that runs it, or the parent's own
    boundary — from coming to rest: the drain lasted its whole grace, and the stop then
    interrupted them all. It runs on, as a foreground subagent does. A cluster host hands
    the tree over together, the held child with it (R-DRAIN-2)."""
    host = port.host
    subagents_parent = port.parent_id is not None and port.parent_id != port.root_id
    return (
        host.draining
        and (port.parent_id is None or port.report_as is not None)
        and (host.hand_over is not None or not subagents_parent)
        and all(isinstance(t, TaskInput) and t.queued_id for t in port.machine.queued_tasks)
    )


async def drain_sessions(
    ports: Collection[SessionPort], grace_s: float, hand_over: HandOver | None
) -> list[str]:
    """Wait, within ``grace_s``, until no session of ``ports`` has work running; hand each
    held or parked one over (once) as it comes to rest. ``ports`` is read again each time
    they have come to rest: a parked task a person's answer woke meanwhile — its call now
    runs — or a session opened meanwhile is waited for in its turn, to its boundary, and
    not cut off by the stop that follows the drain. Returns the held ones' ids."""
    held: dict[str, None] = {}
    handed: set[str] = set()

    async def settle(port: SessionPort) -> None:
        await port.wait_idle()
        if port.held:
            held[port.id] = None
        elif port.id not in handed:
            held.pop(port.id, None)  # woken since, and ended here
        resting = port.held or port.parked
        if hand_over is not None and resting and not port.closed and port.id not in handed:
            handed.add(port.id)
            await hand_over(port.id)

    with trio.move_on_after(grace_s):
        while True:
            async with trio.open_nursery() as nursery:
                for port in list(ports):
                    nursery.start_soon(settle, port)
            if all(port.idle is None for port in list(ports)):
                break
    return list(held)
