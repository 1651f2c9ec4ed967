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
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from greenroom.actors.cluster.errors import ClusterError, ClusterUnavailable
from greenroom.actors.cluster.leases import LeaseKeeper
from greenroom.actors.cluster.registry import HostRegistry
from greenroom.actors.cluster.router import HAND_OVER_METHOD
from greenroom.actors.cluster.routing import SessionRequests

__all__ = ["hand_over"]


async def hand_over(
    session_id: str,
    own_id: str,
    registry: HostRegistry,
    keeper: LeaseKeeper,
    requests: SessionRequests,
    give_up: Callable[[str], None],
    timeout_s: float,
) -> None:
    """Hand ``session_id`` from host ``own_id`` to another (see the module docstring).
    With no other host (or NATS unreachable) nothing changes here: the lease goes when
    the host stops, and any host's orphan scan takes the session then."""
    try:
        hosts = await registry.hosts()
    except ClusterUnavailable:
        return
    others = [h for h in hosts if h.host_id != own_id and h.placeable]
    if not others:
        return
    give_up(session_id)
    await keeper.release(session_id)
    message = {"method": HAND_OVER_METHOD, "params": {"session_id": session_id}, "principal": ""}
    # The least loaded first; one that does not take it (it left, it drains too) is passed.
    for target in sorted(others, key=lambda h: h.load):
        try:
            reply = await requests.request_host(target.host_id, message, timeout_s=timeout_s)
        except ClusterError as exc:
            _log(f"cannot hand session {session_id} to host {target.host_id}: {exc}")
            continue
        if (reply.get("result") or {}).get("taken"):
            _log(f"host {own_id} handed session {session_id} to host {target.host_id}")
            return
    _log(f"no host took session {session_id}; the next to scan for orphans will")


def _log(message: str) -> None:
    # The node's log line format, without importing the node (which imports this module).
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)
