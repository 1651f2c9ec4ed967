"""The copies a host's data dir holds of sessions the cluster deleted while the host was
away (R-CLUSTER-1, R-SEC-9).

A session leaves the cluster through the host that runs it when it is deleted: its
directory entry removed, its trace purged (``node._forget``) — a host that took it over
from one that stopped or died, say, or the host that took up a session made for a
withdrawn placement (:mod:`.placements`). The host that ran it before may still hold a
copy in its data dir. Started again there, it listed the session as its own (its gateway
grants what its data dir holds) and a load of it adopted it: published to the cluster
again.

A cluster host starting deletes those copies (:func:`drop_deleted_copies`): each session
of its data dir whose directory entry the cluster removed — the session bucket keeps a
delete marker where a key was removed (no TTL, and nothing purges the markers) — and
whose trace JetStream no longer holds. Kept:

* a session the cluster never knew (its key was never written): a host whose adoption
  of it failed, or that died before it published its entry, holds the only copy, and a
  call on it adopts it;
* a session whose entry was removed while its trace is still in JetStream (a purge that
  failed): it is not deleted on a guess.

Cost: once, when the host starts, one read of the session bucket per session of its data
dir (and one of the trace stream per removed one), :data:`READS_AT_ONCE` at a time; none
per request. Bounded: the pass stops at the first read NATS does not answer, and after
:data:`PASS_BOUND_S` in all, keeping what it did not look at (the log says how many), so
a slow NATS or a large data dir never holds the host's start for long.
"""

from __future__ import annotations

import contextlib
import sys

import nats.js.errors
import nats.js.kv
import trio

from greenroom.actors.cluster.connection import Connection, check_session_id
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.leases import open_bucket
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.host import Host

__all__ = ["PASS_BOUND_S", "READS_AT_ONCE", "delete_copy", "drop_deleted_copies"]

READS_AT_ONCE = 16
"""How many sessions of the data dir :func:`drop_deleted_copies` asks the cluster about at
a time: a data dir of thousands of sessions is read in parallel, never all at once."""

PASS_BOUND_S = 10.0
"""How long a host's start looks for deleted copies at most (about 10,000 sessions' reads
on a healthy NATS); the copies not looked at stay until a later start."""


async def drop_deleted_copies(conn: Connection, traces: TraceStream, host: Host) -> None:
    """Delete the copies ``host``'s data dir holds of sessions the cluster deleted while it
    was away (the module docstring). One the cluster cannot be asked about is kept and the
    log says so."""
    try:
        directory = await open_bucket(conn, conn.names.sessions, ttl_s=None)
    except ClusterUnavailable as exc:
        _log(f"cannot tell which sessions were deleted elsewhere ({exc}); copies of them may stay")
        return
    stored = await host.trace_store.catalog.list_sessions()
    deleted: list[str] = []
    looked: set[str] = set()
    limiter = trio.CapacityLimiter(READS_AT_ONCE)
    why = f"the pass's {PASS_BOUND_S:g} s ran out"

    async def check(session_id: str, nursery: trio.Nursery) -> None:
        nonlocal why
        async with limiter:
            try:
                if await _deleted_in_cluster(conn, directory, traces, session_id):
                    deleted.append(session_id)
            except ClusterUnavailable as exc:
                why = f"NATS did not answer: {exc}"
                nursery.cancel_scope.cancel()  # the next reads would wait as long
                return
            looked.add(session_id)

    with trio.move_on_after(PASS_BOUND_S):
        async with trio.open_nursery() as nursery:
            for session in stored:
                nursery.start_soon(check, session.session_id, nursery)
    if (left := len(stored) - len(looked)) > 0:
        _log(
            f"did not tell whether {left} session(s) of this data dir were deleted elsewhere "
            f"({why}); kept until a later start"
        )
    for session_id in deleted:
        await delete_copy(host, session_id, "deleted in the cluster while this host was away")


async def delete_copy(host: Host, session_id: str, why: str) -> None:
    """Delete ``session_id`` from ``host``'s data dir, when it is there (``why``: for the
    log)."""
    with contextlib.suppress(SessionNotFound):
        if await host.trace_store.catalog.exists(session_id):
            await host.delete_session(session_id)
            _log(f"deleted session {session_id} here: {why}")


async def _deleted_in_cluster(
    conn: Connection, directory: nats.js.kv.KeyValue, traces: TraceStream, session_id: str
) -> bool:
    """Whether the cluster removed ``session_id``'s directory entry and holds no trace of
    it. Raises :class:`ClusterUnavailable`."""
    try:
        key = check_session_id(session_id)
    except ValueError:
        return False  # not an id the cluster holds: never replicated
    try:
        await conn.call(directory.get(key))
    except nats.js.errors.KeyNotFoundError as exc:
        # nats-py says both so; only a delete marker (the key was there) names its op.
        if exc.op is None:
            return False  # never in the directory
    except nats.js.errors.APIError as exc:
        raise ClusterUnavailable(f"cannot read session {session_id}: {exc}") from exc
    else:
        return False
    return await traces.last_sequence(session_id) == 0


def _log(message: str) -> None:
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)
