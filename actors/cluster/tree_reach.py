"""A tree interrupt's reach into the nodes of the tree that no host runs (R-TREE-2, R-TREE-4,
R-ABORT-1).

A host ends the nodes of a tree that are open on it (:meth:`~greenroom.actors.runtime.
child_reports.ChildReports.end_unreached`). A background subagent stored in the cluster and
run by no host — its host lost, and no host has taken it over yet — is found in the session
directory: an entry not closed, of a background child of the tree, whose owner entry names no
live host. The interrupting host takes it over as it takes an orphan over (claimed, its trace
fenced, read and written here, :meth:`~.node.ClusterNode.take_over`) but does not take its
task up: loaded, it is ended at once, ``aborted`` in its own trace, and its calls in flight
end interrupted, none checked, run again or put to a person. Its trace then holds its end,
so no host that takes it up later (after a loss of this host too) runs it on.

Not reached: a node that another host claims between the read and the claim (its orphan
scan takes it up); any while this host drains, as it takes nothing over (R-DRAIN-2); one
past the :data:`~.listing.MAX_DIRECTORY_ENTRIES` entries the pass reads.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from greenroom.actors.cluster.listing import MAX_DIRECTORY_ENTRIES
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.runtime.accounting import stored_origin
from greenroom.actors.runtime.child_reports import StoredNode

__all__ = ["unowned_below"]


async def unowned_below(
    directory: SessionDirectory,
    owners: SessionOwners,
    serves: Callable[[str], bool],
    load_over: Callable[[str, dict[str, Any]], Awaitable[bool]],
    node_id: str,
) -> list[StoredNode]:
    """The nodes below ``node_id`` that no host runs, shallow first (a
    :data:`~greenroom.actors.runtime.child_reports.StoredBelow` of a cluster host, one pass
    over the directory): each opened here by ``load_over(session_id, meta)``, which claims
    and loads it without taking its task up (False when another host claimed it first).
    ``serves`` says which sessions this host runs: those it ends as open ones. Raises
    :class:`~.errors.ClusterUnavailable`."""
    entries = (await directory.entries(limit=MAX_DIRECTORY_ENTRIES)).entries
    below: dict[str, tuple[int, dict[str, Any]]] = {}
    for session_id, entry in entries.items():
        meta = entry.get("meta")
        meta = meta if isinstance(meta, dict) else {}
        origin = stored_origin(meta, session_id) or ()
        if entry.get("closed") or serves(session_id) or meta.get("background") is not True:
            continue  # closed with no task open, or ended here as an open node
        if node_id in origin[:-1]:
            below[session_id] = (len(origin), meta)
    unowned = sorted(await owners.unowned(sorted(below)), key=lambda s: (below[s][0], s))
    return [(sid, functools.partial(load_over, sid, below[sid][1])) for sid in unowned]
