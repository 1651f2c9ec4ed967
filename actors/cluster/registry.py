"""Hosts and sessions of a cluster, in JetStream KV buckets.

* :class:`HostRegistry`: host id → :class:`HostRecord` (its load and gateway URL), in a
  bucket with the lease TTL. Each host re-publishes its record every third of the TTL
  (:meth:`HostRegistry.announce_every`), so a dead host drops out of the registry as its
  leases expire, and at once when it changes (:meth:`HostRegistry.changed`), so other
  gateways place sessions by the load it has, not the load it had a tick ago.
* :class:`SessionDirectory`: session id → the session's metadata (settings, workspace, tool
  names, its current host), without TTL: a session outlives every host it ran on.

:func:`least_loaded` is the placement rule: new sessions, and orphans after a host is lost,
go to the live host with the fewest sessions (ties: the lowest id, so every host computes the
same answer from the same registry). :func:`assign` keeps an orphaned tree whole, with the
host that runs the rest of it unless that host is far above the least loaded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import nats.js.errors
import nats.js.kv
import trio

from greenroom.actors.cluster.connection import Connection, check_session_id
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.leases import (
    bucket_entries,
    bucket_keys,
    bucket_prefix,
    open_bucket,
)

__all__ = [
    "STAY_SHARE",
    "TREE_STAY_FACTOR",
    "TREE_STAY_SLACK",
    "DirectoryPass",
    "HostRecord",
    "HostRegistry",
    "SessionDirectory",
    "assign",
    "least_loaded",
    "place_elsewhere",
]

STAY_SHARE = 4
"""A new session stays on the host its client asked unless another host carries fewer
sessions by more than this host's load divided by this (a quarter): its client's calls and
outputs then cross no NATS, and hosts that share one port (``serve --workers``) are given
clients evenly already."""


TREE_STAY_FACTOR = 2
TREE_STAY_SLACK = 16
"""An orphaned tree goes to the host that runs the rest of it unless that host, with the
tree, would carry more than ``TREE_STAY_FACTOR`` times the sessions the least loaded host
would carry with it, and more than ``TREE_STAY_SLACK`` sessions more. Kept there, a parent
knows its taken-up background children and its task waits for them (R-TREE-2); moved, it
hears of them only as their answers come. So locality wins while the hosts stay within a
factor of two of each other, and always for small loads; a host that runs many trees'
parents is not piled with every lost host's children while another idles."""


@attrs.frozen(kw_only=True)
class HostRecord:
    """One live host: ``load`` is how many sessions it runs, ``gateway`` its websocket URL
    (None when it serves none), ``at`` when it last announced itself (epoch seconds).
    ``placeable``: it takes the sessions other gateways place on it (it answers on its
    host subject and has loaded its provider); a host that has just joined, or serves no
    gateway, is not, and placement passes it by instead of waiting for it. ``draining``: it
    stops (R-DRAIN-2): it is not placeable, and no orphan is assigned to it."""

    host_id: str
    load: int
    gateway: str | None = None
    at: float = 0.0
    placeable: bool = False
    draining: bool = False

    def to_json(self) -> bytes:
        """The record as stored in the bucket."""
        return json.dumps(
            {
                "host_id": self.host_id,
                "load": self.load,
                "gateway": self.gateway,
                "at": self.at,
                "placeable": self.placeable,
                "draining": self.draining,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | None) -> HostRecord | None:
        """The record in ``data``, or None when it is not one."""
        try:
            raw = json.loads(data or b"")
            return cls(
                host_id=str(raw["host_id"]),
                load=int(raw["load"]),
                gateway=raw.get("gateway") if isinstance(raw.get("gateway"), str) else None,
                at=float(raw.get("at", 0.0)),
                placeable=raw.get("placeable") is True,
                draining=raw.get("draining") is True,
            )
        except (ValueError, KeyError, TypeError):
            return None


def least_loaded(hosts: Iterable[HostRecord]) -> HostRecord | None:
    """The host with the lowest load (ties: the lowest id), or None when there is none."""
    return min(hosts, key=lambda h: (h.load, h.host_id), default=None)


def place_elsewhere(own_load: int, others: Iterable[HostRecord]) -> HostRecord | None:
    """The host to place a new session on instead of the one asked (whose load is
    ``own_load``), or None to keep it there: the least loaded of ``others`` when it carries
    fewer than ``own_load - own_load // STAY_SHARE`` sessions. Small loads are balanced
    exactly (one session against none moves); large ones within a quarter."""
    best = least_loaded(others)
    if best is None or best.load >= own_load - own_load // STAY_SHARE:
        return None
    return best


def assign(
    session_ids: Sequence[str],
    hosts: Iterable[HostRecord],
    *,
    tree_of: Mapping[str, str] | None = None,
    preferred: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Spread ``session_ids`` over ``hosts`` by tree: the sessions ``tree_of`` names one
    tree (absent: a tree of its own) go to one host, so that a parent taken up there knows
    its background children (R-TREE-2); a tree is never split. A tree goes to the host
    ``preferred`` names for it (the one that runs the rest of the tree) when that host is
    among ``hosts`` and not far above the least loaded (:data:`TREE_STAY_FACTOR`,
    :data:`TREE_STAY_SLACK`), counting the trees assigned before it: preferred trees
    first, then the others, each largest first. Every other tree goes to the host that is
    least loaded then. Deterministic: the same inputs give the same answer on every host,
    so no two hosts take one tree and together they take every session."""
    trees: dict[str, list[str]] = {}
    for session_id in sorted(session_ids):
        trees.setdefault((tree_of or {}).get(session_id, session_id), []).append(session_id)
    loads = {h.host_id: h.load for h in hosts}
    named = {
        tree: host_id
        for tree, host_id in (preferred or {}).items()
        if tree in trees and host_id in loads
    }
    chosen: dict[str, str] = {}
    # Largest first: a large tree stays with its parent while the host is still light,
    # and the small trees even out what the large ones leave uneven.
    for tree in sorted(trees, key=lambda t: (t not in named, -len(trees[t]), t)):
        if not loads:
            break
        size = len(trees[tree])
        host_id = least = min(loads, key=lambda h: (loads[h], h))
        if tree in named:
            stay, other = loads[named[tree]] + size, loads[least] + size
            if stay <= TREE_STAY_FACTOR * other or stay - other <= TREE_STAY_SLACK:
                host_id = named[tree]
        chosen[tree] = host_id
        loads[host_id] += size
    return {
        session_id: chosen[tree]
        for tree, members in trees.items()
        if tree in chosen
        for session_id in members
    }


class HostRegistry:
    """The live hosts. Use :meth:`open`."""

    def __init__(self, conn: Connection, kv: nats.js.kv.KeyValue, ttl_s: float) -> None:
        self._conn = conn
        self._kv = kv
        self.ttl_s = ttl_s
        self._due = trio.Event()

    @classmethod
    async def open(cls, conn: Connection, *, ttl_s: float) -> HostRegistry:
        """Bind the host bucket (created with TTL ``ttl_s`` when missing)."""
        return cls(conn, await open_bucket(conn, conn.names.hosts, ttl_s=ttl_s), ttl_s)

    async def announce(self, record: HostRecord) -> None:
        """Publish ``record`` (stamped with the current time)."""
        stamped = attrs.evolve(record, at=time.time())
        await self._conn.call_api(
            self._kv.put(check_session_id(record.host_id), stamped.to_json()),
            f"announce host {record.host_id}",
        )

    async def withdraw(self, host_id: str) -> None:
        """Remove ``host_id`` now (a clean shutdown)."""
        await self._conn.call_api(self._kv.delete(host_id), f"withdraw host {host_id}")

    async def hosts(self) -> list[HostRecord]:
        """Every host that announced itself within the TTL."""
        found = await bucket_entries(self._conn, self._conn.names.hosts)
        records = (HostRecord.from_json(v) for v in found.values())
        return sorted((r for r in records if r is not None), key=lambda r: r.host_id)

    def changed(self) -> None:
        """The record :meth:`announce_every` announces has changed: announce it now, not at
        the next tick (changes made during an announcement make one more)."""
        self._due.set()

    async def announce_every(
        self,
        record: Callable[[], HostRecord],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Announce ``record()`` now, every third of the TTL and after each
        :meth:`changed`, until cancelled; a failed announcement is retried at the next
        tick."""
        await self.announce(record())
        task_status.started()
        while True:
            with trio.move_on_after(self.ttl_s / 3):
                await self._due.wait()
            self._due = trio.Event()
            try:
                await self.announce(record())
            except ClusterUnavailable:
                continue


class SessionDirectory:
    """Session metadata (JSON objects) by session id. Use :meth:`open`."""

    def __init__(self, conn: Connection, kv: nats.js.kv.KeyValue) -> None:
        self._conn = conn
        self._kv = kv

    @classmethod
    async def open(cls, conn: Connection) -> SessionDirectory:
        """Bind the session bucket (created without TTL when missing)."""
        return cls(conn, await open_bucket(conn, conn.names.sessions, ttl_s=None))

    async def put(self, session_id: str, meta: Mapping[str, Any]) -> None:
        """Store ``meta`` for ``session_id`` (replacing what was there)."""
        await self._conn.call_api(
            self._kv.put(check_session_id(session_id), json.dumps(dict(meta)).encode()),
            f"store session {session_id}",
        )

    async def get(self, session_id: str) -> dict[str, Any] | None:
        """The metadata of ``session_id``, or None when the cluster does not know it."""
        try:
            entry = await self._conn.call(self._kv.get(check_session_id(session_id)))
        except nats.js.errors.KeyNotFoundError:
            return None
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot read session {session_id}: {exc}") from exc
        return _object(entry.value)

    async def delete(self, session_id: str) -> None:
        """Forget ``session_id``."""
        await self._conn.call_api(
            self._kv.delete(check_session_id(session_id)), f"delete session {session_id}"
        )

    async def ids(self) -> list[str]:
        """The id of every session the cluster knows."""
        return await bucket_keys(self._conn, self._conn.names.sessions)

    async def entries(self, *, limit: int) -> DirectoryPass:
        """The metadata of every session the cluster knows and the ids of those it deleted,
        as of one pass over the bucket that reads at most ``limit`` entries. Raises
        :class:`ClusterUnavailable`."""
        read = await bucket_prefix(self._conn, self._conn.names.sessions, limit)
        decoded: dict[str, dict[str, Any]] = {}
        for count, (session_id, data) in enumerate(read.live.items(), start=1):
            if count % _DECODED_PER_CHECKPOINT == 0:
                # Thousands of entries are decoded in steps: the host's other tasks run.
                await trio.lowlevel.checkpoint()
            entry = _object(data)
            if entry is not None:
                decoded[session_id] = entry
        return DirectoryPass(entries=decoded, deleted=read.removed, whole=read.whole)


@attrs.frozen(kw_only=True)
class DirectoryPass:
    """One pass over the session directory: ``entries``, each known session's metadata;
    ``deleted``, the sessions whose entry was removed (the bucket keeps a delete marker
    where a key was removed: a session deleted in the cluster); ``whole``, whether the
    pass read the whole directory."""

    entries: dict[str, dict[str, Any]]
    deleted: frozenset[str] = frozenset()
    whole: bool = True


_DECODED_PER_CHECKPOINT = 200


def _object(data: bytes | None) -> dict[str, Any] | None:
    try:
        decoded = json.loads(data or b"")
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None
