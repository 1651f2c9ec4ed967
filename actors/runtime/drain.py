"""Draining a host before it stops (R-DRAIN-1): what :meth:`Host.drain
<greenroom.actors.runtime.host.Host.drain>` does with the sessions open in it.

Every running task goes on — a streaming answer completes, its tool calls finish — to its
next turn boundary, where its supervisor holds it (the task stays open in its trace with
the steering it took recorded, and holds nothing; see ``SessionSupervisor._hold``). A
foreground subagent is not held: it is part of its parent's tool call, which finishes;
nor, without a hand-over, a subagent's background child (see :func:`holds_for_drain`).
Without one, a subagent's answered task that waits for background children which all
rest — parked on people, or held — is held too (:func:`rests_with_children`): it would
wait for them for the whole grace. A session whose task is held, or parked on people,
is then handed over when a hand-over is given (a cluster host hands it to another host
at once: R-DRAIN-2); else the next host to open the data dir takes it up
(``resume_tasks``), with the follow-ups queued behind it (recorded as ``task_queued``:
R-STEER-6). Work that starts during the drain — a parked task a person's answer wakes —
is waited for as well (:func:`drain_sessions`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

import trio

from greenroom.actors.runtime.port import SessionPort, TaskInput
from greenroom.protocols.messages import SubagentOutputs

__all__ = ["HandOver", "drain_sessions", "holds_for_drain", "rests_with_children"]

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
    subagents_parent = port.parent_id is not None and port.parent_id != port.root_id
    return _may_hold(port) and (port.host.hand_over is not None or not subagents_parent)


def rests_with_children(port: SessionPort) -> bool:
    """Whether ``port``'s task, a subagent's that has answered and waits for nothing but
    its background children's answers (R-TREE-2), stops where it is because its host
    drains: every one of those children rests — parked on a person's answer, or held —
    so no answer comes within the grace, and waiting for it kept the tree from coming to
    rest until the stop interrupted it. Held, the task stays open in its trace, waiting
    as before, for the next host, which takes the children up with it; an answer during
    the drain (a person allows a parked child's call) wakes it as it wakes a parked
    task. Any of its ancestors that waits for it rests in turn, so a subagent's task is
    held here whoever its parent is (unlike :func:`holds_for_drain`). Only on a host that
    hands nothing over: a cluster host hands such a tree over as it waits (R-DRAIN-2).

    Never a foreground subagent's task: it runs inside its parent's call, which no record
    lets another host take up waiting for this task's answer. Held, it would end that
    call without an answer; taken up, the call would be in doubt (R-EFFECT-2), and run
    again it repeats this subagent's work and its children's. The parent's call runs on,
    and the stop that follows the grace interrupts it."""
    children = port.children
    if children is None or not children.live or port.machine.waiting_for != "children":
        return False
    return _may_hold(port) and port.host.hand_over is None and all(
        child.background and child.port.inbox is None and (child.port.parked or child.port.held)
        for child in children.live.values()
    )


def _may_hold(port: SessionPort) -> bool:
    """The host drains, ``port`` is no foreground subagent, and its queued tasks are all
    in its trace (see :func:`holds_for_drain`)."""
    return (
        port.host.draining
        and (port.parent_id is None or port.report_as is not None)
        and all(isinstance(t, TaskInput) and t.queued_id for t in port.machine.queued_tasks)
    )


def _tell_parent(port: SessionPort, open_ports: dict[str, SessionPort]) -> None:
    """``port`` has come to rest: its parent, open here, looks again at whether its
    task rests with its children (:func:`rests_with_children`). Nothing else would make
    it look: a resting child sends it nothing. An empty batch of the child's outputs
    emits nothing; its supervisor takes a step after it (as ``tree.stopped_running``)."""
    parent = open_ports.get(port.parent_id) if port.parent_id is not None else None
    if parent is not None:
        parent.send(SubagentOutputs(outputs=(), origin=port.origin_path))


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
    open_ports: dict[str, SessionPort] = {}

    async def settle(port: SessionPort) -> None:
        await port.wait_idle()
        if port.held:
            held[port.id] = None
        elif port.id not in handed:
            held.pop(port.id, None)  # woken since, and ended here
        resting = port.held or port.parked
        if resting:
            _tell_parent(port, open_ports)
        if hand_over is not None and resting and not port.closed and port.id not in handed:
            handed.add(port.id)
            await hand_over(port.id)

    with trio.move_on_after(grace_s):
        while True:
            open_ports = {port.id: port for port in list(ports)}
            async with trio.open_nursery() as nursery:
                for port in open_ports.values():
                    nursery.start_soon(settle, port)
            if all(port.idle is None for port in list(ports)):
                break
    return list(held)
