"""A planned hand-over (R-DRAIN-2): a draining host gives each session it holds at a turn
boundary (or that waits parked for people) to another host at once, instead of leaving it
for the orphan scan after its lease expires.

The draining host stops replicating the session (nothing it writes from then on reaches
the cluster's trace), gives its lease up, and asks the least loaded other host that takes
placed sessions to take it over (``session.take`` on that host's subject). That host
takes it over as it would an orphan: it claims the lease, fences the trace, rebuilds the
session and takes its open task up — held at a boundary, the task goes on with nothing
re-run; parked, it waits on for its answer. A client resubscribes through any gateway
with the last seq it saw, as after a host loss.

A drain hands its held sessions over in a burst (every running task reaches its boundary
within a turn), faster than the other hosts announce their new loads: each host is
counted with the sessions handed to it since its last announcement
(:class:`HandedSince`), so the burst is spread over the hosts as placement spreads new
sessions, instead of every session going to the one that last announced the least load.

A session is handed over with its tree as this host has it (:func:`gather_tree`): its
topmost ancestor open here and every descendant of that one open here, to one host in one
request, once none of them has work running but a task that waits for its background
children. The taking host loads them all before it takes any task up, as it takes a lost
host's sessions up (R-TREE-2, R-TREE-4): a subagent's task takes its first step there
knowing its background children that run again beside it. Handed alone, a subagent held
while its background child's call ran was taken up knowing no running child: answered,
its task ended at once, and the child's answer came later as a second task. An idle
session of the tree goes with it: the answers its children send up reach it there, not
on a host that is about to stop.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import trio

from greenroom.actors.cluster.errors import ClusterError, ClusterUnavailable
from greenroom.actors.cluster.ownership import OwnershipKeeper
from greenroom.actors.cluster.registry import HostRecord, HostRegistry, SessionDirectory
from greenroom.actors.cluster.router import HAND_OVER_METHOD
from greenroom.actors.cluster.routing import SessionRequests
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import SessionPort
from greenroom.protocols.outputs import Output

__all__ = ["HandedSince", "gather_tree", "hand_over", "take_handed"]


class HandedSince:
    """The sessions this host handed to each other host since that host last announced
    its load (its record's ``at``): a later announcement counts them itself."""

    def __init__(self) -> None:
        self._handed: dict[str, tuple[float, int]] = {}

    def count(self, record: HostRecord) -> int:
        """How many were handed to ``record``'s host since it announced ``record``."""
        at, count = self._handed.get(record.host_id, (record.at, 0))
        return count if at == record.at else 0

    def load(self, record: HostRecord) -> int:
        """``record``'s load with the sessions handed to its host since."""
        return record.load + self.count(record)

    def add(self, record: HostRecord, sessions: int) -> None:
        """``sessions`` more (fewer, when negative) handed to ``record``'s host."""
        self._handed[record.host_id] = (record.at, max(0, self.count(record) + sessions))


async def hand_over(
    session_id: str,
    own_id: str,
    registry: HostRegistry,
    keeper: OwnershipKeeper,
    requests: SessionRequests,
    give_up: Callable[[str], None],
    timeout_s: float,
    handed: HandedSince | None = None,
    *,
    with_ids: Sequence[str] = (),
) -> None:
    """Hand ``session_id`` from host ``own_id`` to another (see the module docstring),
    counting it in ``handed`` (this host's: its hand-overs run concurrently), with the
    sessions ``with_ids`` of its tree: one host takes them all in one request. With no
    other host (or NATS unreachable) nothing changes here: the leases go when the host
    stops, and any host's orphan scan takes the sessions then."""
    handed = handed if handed is not None else HandedSince()
    session_ids = [session_id, *with_ids]
    shown = f"session {session_id}" if not with_ids else "sessions " + ", ".join(session_ids)
    try:
        hosts = await registry.hosts()
    except ClusterUnavailable as exc:
        _log(f"cannot hand {shown} over ({exc}); the next to scan for orphans will")
        return
    others = [h for h in hosts if h.host_id != own_id and h.placeable]
    if not others:
        _log(f"no other host takes {shown}; the next to scan for orphans will")
        return
    # Every one stops replicating before any closes here: closing a subagent's parent
    # writes nothing that reaches the cluster's trace.
    for each in session_ids:
        give_up(each)
    for each in session_ids:
        await keeper.release(each)
    params: dict[str, object] = {"session_id": session_id}
    if with_ids:
        params["with"] = list(with_ids)
    message = {"method": HAND_OVER_METHOD, "params": params, "principal": ""}
    # The least loaded first; one that does not take it (it left, it drains too) is passed.
    # Counted as soon as it is chosen: the other hand-overs of the burst choose meanwhile.
    for target in sorted(others, key=handed.load):
        handed.add(target, len(session_ids))
        try:
            reply = await requests.request_host(target.host_id, message, timeout_s=timeout_s)
        except ClusterError as exc:
            handed.add(target, -len(session_ids))
            _log(f"cannot hand {shown} to host {target.host_id}: {exc}")
            continue
        if (reply.get("result") or {}).get("taken"):
            _log(f"host {own_id} handed {shown} to host {target.host_id}")
            return
        handed.add(target, -len(session_ids))
    _log(f"no host took {shown}; the next to scan for orphans will")


async def take_handed(
    directory: SessionDirectory,
    host: Host,
    take: Callable[[dict[str, dict[str, Any]]], Awaitable[list[str]]],
    session_ids: list[str],
) -> bool:
    """The taking host's side of :func:`hand_over`: take ``session_ids`` (the handed
    session, then the rest of its tree) over from their directory entries with ``take``
    (which loads them all, then takes their tasks up together); whether the handed one
    was taken. Nothing while ``host`` drains too."""
    with contextlib.suppress(ClusterUnavailable):
        handed = [] if host.draining else session_ids
        entries = {session_id: await directory.get(session_id) for session_id in handed}
        found = {sid: entry for sid, entry in entries.items() if entry is not None}
        return session_ids[0] in found and session_ids[0] in await take(found)
    return False


async def gather_tree(
    host: Host, session_id: str, adopted: Collection[str], gathering: set[str]
) -> list[str]:
    """The tree of ``session_id`` on ``host`` to hand over together (see the module
    docstring), its topmost session first and parents before children, those that
    ``adopted`` (this host owns them) names, once none has work running but a task that
    waits for its background children. Empty when another call gathers the same tree
    (``gathering``: the topmost sessions of the trees gathered now), which hands this
    session with it, or when this host does not own ``session_id``. Bounded by its caller
    (the drain's grace)."""
    top = _topmost(host, session_id, adopted)
    if session_id not in adopted or top in gathering:
        return []
    gathering.add(top)
    try:
        while True:
            tree = _tree(host, top, adopted)
            working = [port for port in tree if not _at_rest(port)]
            if not working:
                return [port.id for port in tree]
            await _until_one_moves(working)
    finally:
        gathering.discard(top)


def _open_port(host: Host, session_id: str | None) -> SessionPort | None:
    if session_id is None:
        return None
    with contextlib.suppress(SessionNotFound):
        return host.port(session_id)
    return None


def _topmost(host: Host, session_id: str, adopted: Collection[str]) -> str:
    """``session_id``'s topmost ancestor that this host owns and has open, through an
    unbroken line of such ancestors (itself when its parent is not here)."""
    top = session_id
    while (port := _open_port(host, top)) is not None:
        parent = _open_port(host, port.parent_id)
        if parent is None or parent.id not in adopted:
            break
        top = parent.id
    return top


def _tree(host: Host, top: str, adopted: Collection[str]) -> list[SessionPort]:
    """``top`` and its descendants that this host owns and has open, parents first."""
    children: dict[str, list[SessionPort]] = {}
    for session in host.sessions:
        port = _open_port(host, session.id)
        if port is not None and port.parent_id is not None and port.id in adopted:
            children.setdefault(port.parent_id, []).append(port)
    root = _open_port(host, top)
    tree = [] if root is None or root.closed or top not in adopted else [root]
    for port in tree:  # grows as it is read: breadth first
        tree += [child for child in children.get(port.id, ()) if not child.closed]
    return tree


def _at_rest(port: SessionPort) -> bool:
    """Whether ``port`` has no work running here, or only a task that waits for its
    background children (which the tree's hand-over takes along)."""
    return port.closed or port.inbox is None or port.machine.waiting_for == "children"


async def _until_one_moves(ports: list[SessionPort]) -> None:
    """Return once one of ``ports`` publishes outputs or its work ends: its state, read
    again, may have come to rest (a task that waits for its children publishes the turn
    that led there)."""
    # Unbounded and read once: the publishers never wait on it, and it is closed at the
    # end (the watches with it).
    send, moved = trio.open_memory_channel[list[Output]](math.inf)
    ends = [port.watch(send.clone()) for port in ports]
    try:
        async with trio.open_nursery() as nursery:

            async def until_idle(port: SessionPort) -> None:
                await port.wait_idle()
                nursery.cancel_scope.cancel()

            async def until_published() -> None:
                with contextlib.suppress(trio.EndOfChannel):
                    await moved.receive()
                nursery.cancel_scope.cancel()

            for port in ports:
                nursery.start_soon(until_idle, port)
            nursery.start_soon(until_published)
    finally:
        for end in ends:
            end()
        send.close()
        moved.close()


def _log(message: str) -> None:
    # The node's log line format, without importing the node (which imports this module).
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)
