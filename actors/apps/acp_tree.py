"""``greenroom acp``: the agent tree of each session, shown through the editor (R-TREE).

A background subagent outlives its spawning call and the task that spawned it, so each
session of the connection has a :class:`TreeWatch`: a task of the agent that drains the
session's watch (R-ACTOR-1) and sees every batch the session publishes, whether or not a
prompt of the client runs. It shows the background children on calls of their own
(:meth:`~greenroom.protocols.acp.UpdateMapper.note`), has the editor asked about their
approvals, and, when the session starts a task no request of the connection started (a
child's ``[subagent NAME finished]`` follow-up), hands that task to a pump like any other.

The pumps map what the session published with the same mapper, which must have noted it
first (a background child's outputs are shown by :meth:`note` alone, and its approvals
asked by the watch alone): a pump calls :meth:`TreeWatch.caught_up` before it handles an
output. :func:`steer` hands over the steering of ``_greenroom/steer``, which steers any
running node of the session's tree, and :func:`steer_answer` answers it once the
steering's record is durable.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from greenroom.actors.apps.acp_sessions import WatchedWork
from greenroom.actors.runtime import (
    Host,
    InputReceipt,
    Session,
    SessionNotFound,
    queued_once_recorded,
)
from greenroom.protocols import acp
from greenroom.protocols.content import TextBlock, UserContent
from greenroom.protocols.jsonrpc import RpcError
from greenroom.protocols.outputs import ApprovalRequest, Output, TaskStart

__all__ = ["PromptContent", "TreeWatch", "steer", "steer_answer", "tree_node"]

PromptContent = Callable[[Session, dict[str, Any]], Awaitable[tuple[UserContent, ...]]]
"""The agent's way to make a request's ``prompt`` input of a session (its images attached)."""


class _CaughtUp:
    """A marker a pump puts in the watch's inbox: set once the watch reaches it, so every
    batch published before it has been handled."""

    __slots__ = ("reached",)

    def __init__(self) -> None:
        self.reached = trio.Event()


class TreeWatch:
    """The watch of one session of the connection (see the module docstring). The watch
    starts when it is made, so it sees every batch published from then on; :meth:`run`
    drains it. What it sees goes to the agent: ``show`` queues an update of the session
    (never waiting), ``ask`` has the editor asked about a background child's request,
    ``settled`` is told every output (what the editor is asked may be settled meanwhile),
    ``pump`` streams a task nobody of the connection started, and the follow-ups queued
    behind it; ``pumping`` says whether a pump already reads the session's task, ``live``
    whether the client still reads."""

    def __init__(
        self,
        session: Session,
        mapper: acp.UpdateMapper,
        *,
        live: Callable[[], bool],
        pumping: Callable[[], bool],
        show: Callable[[dict[str, Any]], None],
        ask: Callable[[ApprovalRequest], None],
        settled: Callable[[Output], None],
        pump: Callable[[WatchedWork], None],
    ) -> None:
        self._mapper = mapper
        self._settled = settled
        self._live = live
        self._pumping = pumping
        self._show = show
        self._ask = ask
        self._pump = pump
        # Unbounded: the session publishes with send_nowait and must neither wait nor lose
        # a batch; this task waits on nothing but its inbox (it queues frames and starts
        # tasks without blocking), so the inbox holds only what was published since its
        # last turn.
        self._send, self._inbox = trio.open_memory_channel[list[Output] | _CaughtUp](math.inf)
        self._forward: trio.MemorySendChannel[list[Output]] | None = None
        """The inbox of the pump of a task this watch handed over, while it reads."""
        session.watch(self._send)

    async def run(self) -> None:
        """Handle each batch the session publishes, in order, until the session ends the
        watch (or the task is cancelled)."""
        try:
            with self._inbox:
                async for message in self._inbox:
                    if isinstance(message, _CaughtUp):
                        message.reached.set()
                    else:
                        self._published(message)
        finally:
            # Nothing more is handled: no pump waits for this watch, and the one this watch
            # feeds ends after what it holds.
            while True:
                try:
                    message = self._inbox.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                if isinstance(message, _CaughtUp):
                    message.reached.set()
            if self._forward is not None:
                self._forward.close()

    async def caught_up(self) -> None:
        """Return once every batch published so far has been handled: at once when the
        watch waits on an empty inbox (each batch is handled without a checkpoint, so
        nothing is half done), else when it reaches a marker put behind them."""
        stats = self._inbox.statistics()
        if stats.current_buffer_used == 0 and stats.tasks_waiting_receive:
            return
        marker = _CaughtUp()
        try:
            self._send.send_nowait(marker)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the watch has ended: nothing more is published or handled
        await marker.reached.wait()

    def _published(self, batch: list[Output]) -> None:
        """A batch the session published, in its turn (it must neither wait nor raise):
        background children shown and asked about; a task that no request of this
        connection started (a background child's finished message) pumped from its start."""
        live, mapper = self._live(), self._mapper
        for output in batch:
            if live:
                for update in mapper.note(output):
                    self._show(update)
                if isinstance(output, ApprovalRequest) and mapper.is_background(output):
                    self._ask(output)
            # Whether or not a pump reads: a request may be settled with no task running
            # (a parked one answered elsewhere, or timed out).
            self._settled(output)
        if self._forward is not None:
            try:
                self._forward.send_nowait(batch)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._forward = None  # its pump has read its task to the end
        if not self._live() or self._pumping():
            return
        if any(isinstance(o, TaskStart) and o.origin is None for o in batch):
            # Unbounded: the pump never waits on the client, so it drains its inbox at once.
            send, receive = trio.open_memory_channel[list[Output]](math.inf)
            send.send_nowait(batch)  # then each batch this watch handles
            if self._forward is not None:
                self._forward.close()
            self._forward = send
            # Read on past its end to the follow-ups the editor sends meanwhile (R-STEER-6).
            self._pump(WatchedWork(receive))


def tree_node(host: Host, root: Session, node_id: Any) -> Session:
    """The session ``node_id`` names in ``root``'s tree (``root`` itself when None): a
    running node whose ``root_id`` is ``root`` (R-TREE-1). An id that names no running
    node of the tree is -32002."""
    if node_id is None or node_id == root.id:
        return root
    if not isinstance(node_id, str):
        raise acp.invalid("$.nodeId", f"expected a string, got {type(node_id).__name__}")
    try:
        node = host.get_session(node_id)
    except SessionNotFound:
        node = None
    # Only a node of this session's tree: another session's subagent is not found.
    if node is None or node.root_id != root.id:
        raise RpcError(
            acp.RESOURCE_NOT_FOUND,
            f"no running node {node_id[:100]!r} in the tree of session {root.id}",
        )
    return node


async def steer(
    host: Host,
    root: Session,
    params: dict[str, Any],
    prompt_content: PromptContent,
    steer_root: Callable[[tuple[UserContent, ...]], InputReceipt | None],
) -> InputReceipt | None:
    """Hand over the steering of ``_greenroom/steer {sessionId, nodeId?, text | prompt}``
    to the running task of ``root``, the session, or of ``nodeId``, a running node of its
    tree (:func:`tree_node`): the steering's receipt, None when that node runs no task.
    The root's steering goes through ``steer_root``, which keeps count of the
    connection's steering of the session in the order the session records it."""
    node = tree_node(host, root, params.get("nodeId"))
    if "text" in params:
        content: tuple[UserContent, ...] = (TextBlock(text=acp.require_str(params, "text")),)
    else:
        content = await prompt_content(node, params)
    if node is root:
        return steer_root(content)
    recorded = InputReceipt()
    return recorded if node.steer(content, recorded=recorded) else None


async def steer_answer(recorded: InputReceipt | None) -> dict[str, Any]:
    """The answer to ``_greenroom/steer`` whose steering :func:`steer` handed over with
    ``recorded``: ``{queued: false}`` when no task took it; ``{queued: true}`` only once
    its record survives the host, as the gateway's ``steer`` (R-STEER-1, R-STEER-6,
    R-CLUSTER-2) — ``durable: false`` too when the store has not said so in time, an
    error when it was dropped unrun (:func:`~greenroom.protocols.acp.dropped`) or nobody
    knows whether its record survived (:func:`~greenroom.protocols.acp.in_doubt`)."""
    if recorded is None:
        return {"queued": False}
    return await queued_once_recorded(recorded, dropped=acp.dropped, in_doubt=acp.in_doubt)
