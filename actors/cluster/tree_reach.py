"""A tree interrupt's reach into the nodes of the tree that this host does not run
(R-TREE-2, R-TREE-4, R-ABORT-1, R-CLUSTER-2).

A host ends the nodes of a tree that are open on it (:meth:`~greenroom.actors.runtime.
child_reports.ChildReports.end_unreached`). The others are found in one pass over the
session directory: the entries, not closed, of background children of the tree that this
host does not run. Then:

* **Run by another live host** (its owner entry names it): that host is asked to end it
  (:data:`~.router.TREE_END_METHOD` on the node's request subject), as the interrupt
  ends a node open here (:meth:`~greenroom.actors.runtime.child_reports.ChildReports.
  end_here`): ``aborted`` in its trace, its pending requests answered interrupted,
  nothing run after, its answer for nobody. The host answers once its end is written;
  the interrupting host waits for that answer up to the request timeout. A host that
  does not answer in time, or no longer runs the node, is logged, not an error of the
  interrupt.
* **Run by no host** — its host lost, and no host has taken it over yet: the interrupting
  host takes it over as it takes an orphan over (claimed, its trace fenced, read and
  written here, :meth:`~.node.ClusterNode.take_over`) but does not take its task up:
  loaded, it is ended at once, ``aborted`` in its own trace, and its calls in flight end
  interrupted, none checked, run again or put to a person. Its trace then holds its end,
  so no host that takes it up later (after a loss of this host too) runs it on.

Not reached: a node that another host claims between the read and the claim (its orphan
scan takes it up), or that moves to another host between the read and the request (its
new owner takes it over with the trace as it was); any node no host runs while this host
drains, as it takes nothing over (R-DRAIN-2); one past the
:data:`~.listing.MAX_DIRECTORY_ENTRIES` entries the pass reads.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.listing import MAX_DIRECTORY_ENTRIES
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.cluster.router import TREE_END_METHOD, log
from greenroom.actors.cluster.routing import SessionRequests
from greenroom.actors.runtime.accounting import stored_origin
from greenroom.actors.runtime.child_reports import NodesBelow

__all__ = ["ReachParts", "TreeReach"]

ReachParts = tuple[
    SessionDirectory,
    SessionOwners,
    Callable[[str], bool],
    Callable[[str, dict[str, Any]], Awaitable[bool]],
    SessionRequests,
]
"""What a :class:`TreeReach` reads and asks through: the session directory, the owner
entries, which sessions this host runs (``serves``), what claims and loads a node no host
runs without taking its task up (``load_over(session_id, meta)``: False when another host
claimed it first), and the requests to other hosts."""


class TreeReach:
    """One cluster host's reach into the trees it interrupts (see the module docstring):
    :meth:`below` is its host's :data:`~greenroom.actors.runtime.child_reports.StoredBelow`.
    ``host_id`` is this host's; another host's answer is waited for ``timeout_s`` at
    most."""

    __slots__ = (
        "_directory",
        "_host_id",
        "_load_over",
        "_owners",
        "_requests",
        "_serves",
        "_timeout_s",
    )

    def __init__(self, parts: ReachParts, *, host_id: str, timeout_s: float) -> None:
        self._directory, self._owners, self._serves, self._load_over, self._requests = parts
        self._host_id = host_id
        self._timeout_s = timeout_s

    async def below(self, node_id: str) -> NodesBelow:
        """The nodes below ``node_id`` that this host does not run, shallow first, from one
        pass over the directory: those no host runs, to open here, and those another live
        host runs, to end there. Raises :class:`~.errors.ClusterUnavailable`."""
        entries = (await self._directory.entries(limit=MAX_DIRECTORY_ENTRIES)).entries
        below: dict[str, tuple[int, dict[str, Any]]] = {}
        for session_id, entry in entries.items():
            meta = entry.get("meta")
            meta = meta if isinstance(meta, dict) else {}
            origin = stored_origin(meta, session_id) or ()
            if (
                entry.get("closed")
                or self._serves(session_id)
                or meta.get("background") is not True
            ):
                continue  # closed with no task open, or ended here as an open node
            if node_id in origin[:-1]:
                below[session_id] = (len(origin), meta)
        owners = await self._owners.live_owners(sorted(below))
        ids = sorted(below, key=lambda s: (below[s][0], s))
        return NodesBelow(
            stored=[
                (sid, functools.partial(self._load_over, sid, below[sid][1]))
                for sid in ids
                if sid not in owners
            ],
            # One this host owns and does not run is closing here, its work ended.
            elsewhere=[
                (sid, functools.partial(self._end_there, sid))
                for sid in ids
                if owners.get(sid, self._host_id) != self._host_id
            ],
        )

    async def _end_there(self, session_id: str, reason: str) -> bool:
        """Ask the host that runs ``session_id`` to end it (:data:`TREE_END_METHOD`);
        whether it had work to end. Never raises: a host that does not answer in time, or
        refuses, is logged."""
        message = {"method": TREE_END_METHOD, "params": {"reason": reason}, "principal": ""}
        try:
            reply = await self._requests.request(session_id, message, timeout_s=self._timeout_s)
        except ClusterError as exc:
            log(f"a tree interrupt could not reach session {session_id} on its host: {exc}")
            return False
        result, error = reply.get("result"), reply.get("error")
        if isinstance(result, dict):
            return result.get("interrupted") is True
        why = error.get("message") if isinstance(error, dict) else reply
        log(f"the host of session {session_id} did not end it for a tree interrupt: {why}")
        return False
