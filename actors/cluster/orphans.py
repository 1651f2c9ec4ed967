"""Finding orphans — sessions that no live host owns — at a cost that does not grow with the
cluster's sessions while nothing happens (R-CLUSTER-2, R-PERF-2).

A session becomes an orphan when its host's lease goes (the host died, stalled past its
TTL or stopped), or when it is left without an owner entry (a hand-over that no host took,
an adoption NATS refused). Reading every session's owner entry is one NATS request a
session; done every half TTL on every host, that cost more than a core at 10,000 sessions.
So each look reads the host leases only (one key a host) and reads the sessions when:

* it is this finder's first look, or
* a host's lease is gone or holds another incarnation since the last look (its sessions
  are orphans now), or
* the last full read found orphans (some may be left: another host's share that it could
  not take, a claim that lost a race), or
* this host left a session without an owner itself (:meth:`OrphanFinder.suspect`: an
  adoption NATS refused), or
* ``full_every`` looks have passed since the last full read (the other causes, which no
  lease shows).

A full read lists the session directory's keys, reads the owner entry of each session this
host does not run, and the directory entry of the orphans alone. A session whose entry says
it was closed (``"closed": true``: closed on its host with no work left for a take-up, a
finished subagent say, :mod:`.directory_entries`) has no owner and needs none: it is no
orphan.

:meth:`OrphanFinder.scan` looks every half TTL and takes over this host's share of the
orphans (:func:`~.registry.assign`: by tree, each tree's orphans to one host — the host
that runs the rest of the tree unless it is far above the least loaded, else the least
loaded — the same answer on every host).
The host loads a tree's orphans together before it takes any task up, so a parent taken
up knows the background children taken up beside it (R-TREE-2, R-TREE-4).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.registry import HostRecord, HostRegistry, SessionDirectory, assign

__all__ = ["OrphanFinder", "orphan_trees"]


class OrphanFinder:
    """Looks for orphans for one host; ``runs(session_id)`` says whether this host runs
    the session (those are not read)."""

    def __init__(
        self,
        directory: SessionDirectory,
        owners: SessionOwners,
        runs: Callable[[str], bool],
        *,
        full_every: int = 20,
    ) -> None:
        self._directory = directory
        self._owners = owners
        self._runs = runs
        self._full_every = full_every
        self._live: dict[str, str] | None = None
        self._since_full = 0
        self._found_last = False
        self._suspected = False
        self.full_reads = 0

    def suspect(self) -> None:
        """A session may have been left without an owner: read them all at the next look."""
        self._suspected = True

    async def look(self) -> dict[str, dict[str, Any]]:
        """The orphans found by this look, with their directory entries (none when the
        look did not need to read the sessions). Raises ``ClusterUnavailable``."""
        live = await self._owners.live_hosts()
        lost = self._live is None or any(live.get(h) != t for h, t in self._live.items())
        self._since_full += 1
        due = self._found_last or self._suspected or self._since_full >= self._full_every
        if not (lost or due):
            self._live = live
            return {}
        candidates = [sid for sid in await self._directory.ids() if not self._runs(sid)]
        orphans = await self._owners.unowned(candidates, live=live)
        found: dict[str, dict[str, Any]] = {}
        for session_id in orphans:
            entry = await self._directory.get(session_id)
            if entry is not None and not entry.get("closed"):  # deleted, closed meanwhile
                found[session_id] = entry
        # Only now: a look that failed half-way reads everything again next time.
        self._live, self._since_full, self._found_last = live, 0, bool(found)
        self._suspected = False
        self.full_reads += 1
        return found

    async def scan(
        self,
        registry: HostRegistry,
        host_id: str,
        every_s: float,
        take: Callable[[dict[str, dict[str, Any]]], Awaitable[object]],
        draining: Callable[[], bool],
    ) -> None:
        """Look every ``every_s`` seconds and :meth:`take_share`; until cancelled. Return
        once the host is ``draining`` (a draining host takes nothing over, R-DRAIN-2)."""
        while True:
            await trio.sleep(every_s)
            if draining():
                return
            await self.take_share(registry, host_id, take, draining)

    async def take_share(
        self,
        registry: HostRegistry,
        host_id: str,
        take: Callable[[dict[str, dict[str, Any]]], Awaitable[object]],
        draining: Callable[[], bool],
    ) -> None:
        """Look once and ``take`` over the orphans assigned to host ``host_id`` (each id →
        its directory entry), together: a tree's orphans are assigned to one host
        (:func:`orphan_trees`), which takes its nodes up knowing each other (R-TREE-2).
        Nothing while the host is ``draining``."""
        try:
            orphans = await self.look()
            if not orphans:
                return
            hosts = [h for h in await registry.hosts() if not h.draining]
            tree_of, preferred = await orphan_trees(self._directory, orphans, hosts)
        except ClusterUnavailable:
            return
        share = {
            session_id: orphans[session_id]
            for session_id, owner in assign(
                list(orphans), hosts, tree_of=tree_of, preferred=preferred
            ).items()
            if owner == host_id
        }
        if share and not draining():  # it may have begun draining during this look
            await take(share)


async def orphan_trees(
    directory: SessionDirectory, orphans: Mapping[str, Mapping[str, Any]], hosts: list[HostRecord]
) -> tuple[dict[str, str], dict[str, str]]:
    """The tree of each orphan (its root's id, from its directory entry's ``meta``), and
    the host each tree is best assigned to: the one of ``hosts`` the directory names for
    the parent of the tree's topmost orphan (the nearest its root; ties: the lowest id)
    when that parent is no orphan and its entry is open — the host that runs the rest of
    the tree, so that the parent there knows its children. Raises
    :class:`ClusterUnavailable`."""
    tree_of: dict[str, str] = {}
    tops: dict[str, tuple[int, str, str]] = {}
    for session_id, entry in sorted(orphans.items()):
        meta = entry.get("meta")
        meta = meta if isinstance(meta, dict) else {}
        root, parent = meta.get("root_id"), meta.get("parent_id")
        tree = tree_of[session_id] = root if isinstance(root, str) else session_id
        if isinstance(parent, str) and parent not in orphans:
            origin = meta.get("origin")
            depth = len(origin) if isinstance(origin, list) else 0
            tops[tree] = min(
                tops.get(tree, (depth, session_id, parent)), (depth, session_id, parent)
            )
    live = {h.host_id for h in hosts}
    preferred: dict[str, str] = {}
    for tree, (_, _, parent) in sorted(tops.items()):
        parent_entry = await directory.get(parent) or {"closed": True}  # deleted: none
        host_id = parent_entry.get("host")
        if isinstance(host_id, str) and host_id in live and not parent_entry.get("closed"):
            preferred[tree] = host_id
    return tree_of, preferred
