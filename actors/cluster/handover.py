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
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from greenroom.actors.cluster.errors import ClusterError, ClusterUnavailable
from greenroom.actors.cluster.ownership import OwnershipKeeper
from greenroom.actors.cluster.registry import HostRecord, HostRegistry
from greenroom.actors.cluster.router import HAND_OVER_METHOD
from greenroom.actors.cluster.routing import SessionRequests

__all__ = ["HandedSince", "hand_over"]


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
) -> None:
    """Hand ``session_id`` from host ``own_id`` to another (see the module docstring),
    counting it in ``handed`` (this host's: its hand-overs run concurrently). With no other
    host (or NATS unreachable) nothing changes here: the lease goes when the host stops,
    and any host's orphan scan takes the session then."""
    handed = handed if handed is not None else HandedSince()
    try:
        hosts = await registry.hosts()
    except ClusterUnavailable as exc:
        _log(f"cannot hand session {session_id} over ({exc}); the next to scan for orphans will")
        return
    others = [h for h in hosts if h.host_id != own_id and h.placeable]
    if not others:
        _log(f"no other host takes session {session_id}; the next to scan for orphans will")
        return
    give_up(session_id)
    await keeper.release(session_id)
    message = {"method": HAND_OVER_METHOD, "params": {"session_id": session_id}, "principal": ""}
    # The least loaded first; one that does not take it (it left, it drains too) is passed.
    # Counted as soon as it is chosen: the other hand-overs of the burst choose meanwhile.
    for target in sorted(others, key=handed.load):
        handed.add(target, 1)
        try:
            reply = await requests.request_host(target.host_id, message, timeout_s=timeout_s)
        except ClusterError as exc:
            handed.add(target, -1)
            _log(f"cannot hand session {session_id} to host {target.host_id}: {exc}")
            continue
        if (reply.get("result") or {}).get("taken"):
            _log(f"host {own_id} handed session {session_id} to host {target.host_id}")
            return
        handed.add(target, -1)
    _log(f"no host took session {session_id}; the next to scan for orphans will")


def _log(message: str) -> None:
    # The node's log line format, without importing the node (which imports this module).
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)
