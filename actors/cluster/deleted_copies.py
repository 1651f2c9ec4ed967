"""The copies a host's data dir holds of sessions the cluster deleted elsewhere: while the
host was away, or while it runs (R-CLUSTER-1, R-SEC-9).

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

Cost: once when the host starts (and again each time its connection to NATS is back: below),
one read of the session bucket per session of its data dir (and one of the trace stream per
removed one), :data:`READS_AT_ONCE` at a time; none per request. Bounded: the pass stops at
the first read NATS does not answer, and after :data:`PASS_BOUND_S` in all, keeping what it
did not look at (the log says how many), so a slow NATS or a large data dir never holds the
host's start for long.

A running host deletes those copies as the cluster deletes the sessions
(:func:`watch_deleted_copies`): it hears every delete marker written to the
session bucket, and deletes its copy of a session it does not run once JetStream holds no
trace of it (the deleting host removes the entry first, then purges the trace: the copy
waits up to :data:`PURGE_WAITS_S` for that). A marker written while this host's
connection to NATS was down is not heard: each time the connection is back, the start's
pass runs again (over the sessions the host does not run), once the client has
subscribed again, so no marker falls between the two. Until then its gateway's
``session.list`` and its ``Host.list_sessions`` leave the copy out (:mod:`.listing`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import nats.js.errors
import nats.js.kv
import trio

from greenroom.actors.cluster.connection import Connection, check_session_id
from greenroom.actors.cluster.errors import ClusterError, ClusterUnavailable
from greenroom.actors.cluster.leases import open_bucket, removed_entry
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.host import Host

__all__ = [
    "PASS_BOUND_S",
    "PURGE_WAITS_S",
    "READS_AT_ONCE",
    "delete_copy",
    "drop_deleted_copies",
    "watch_deleted_copies",
]

READS_AT_ONCE = 16
"""How many sessions of the data dir :func:`drop_deleted_copies` asks the cluster about at
a time: a data dir of thousands of sessions is read in parallel, never all at once."""

PASS_BOUND_S = 10.0
"""How long a host's start looks for deleted copies at most (about 10,000 sessions' reads
on a healthy NATS); the copies not looked at stay until a later start."""


async def drop_deleted_copies(
    conn: Connection,
    traces: TraceStream,
    host: Host,
    serves: Callable[[str], bool] = lambda session_id: False,
) -> None:
    """Delete the copies ``host``'s data dir holds of sessions the cluster deleted while it
    was away (the module docstring), but for those it runs (``serves``: none at a start).
    One the cluster cannot be asked about is kept and the log says so."""
    try:
        directory = await open_bucket(conn, conn.names.sessions, ttl_s=None)
    except ClusterUnavailable as exc:
        _log(f"cannot tell which sessions were deleted elsewhere ({exc}); copies of them may stay")
        return
    listed = await host.trace_store.catalog.list_sessions()
    stored = [session.session_id for session in listed if not serves(session.session_id)]
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
            for session_id in stored:
                nursery.start_soon(check, session_id, nursery)
    if (left := len(stored) - len(looked)) > 0:
        _log(
            f"did not tell whether {left} session(s) of this data dir were deleted elsewhere "
            f"({why}); kept until a later pass"
        )
    for session_id in deleted:
        if not serves(session_id):  # opened here meanwhile: its deletion is this host's
            await delete_copy(host, session_id, "deleted in the cluster while this host was away")


PURGE_WAITS_S = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
"""The waits before each look at the trace of a session deleted elsewhere while this host
runs: its host purges the trace just after it removes the entry, and a copy is deleted
only once the trace is gone. A trace still there after the last look (a purge that
failed) keeps the copy, as at a start."""


async def watch_deleted_copies(
    conn: Connection,
    traces: TraceStream,
    host: Host,
    serves: Callable[[str], bool],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Delete ``host``'s copies of the sessions deleted in the cluster: those deleted while
    it was away (:func:`drop_deleted_copies`, before it is ready), then each one another
    host deletes, until cancelled (``serves``: the sessions this host runs, whose deletion
    is its own). The bucket's writes are heard from before the start's pass, so none
    falls between the two; after each reconnection the pass runs again, for the writes
    made while the connection was down. NATS failing ends the hearing, with a line in the
    log (the next start's pass does its work)."""
    prefix = f"$KV.{conn.names.sessions}."
    looking: set[str] = set()
    started = False
    try:
        async with conn.subscription(f"{prefix}>") as writes, trio.open_nursery() as nursery:
            reconnections = conn.reconnections
            await drop_deleted_copies(conn, traces, host)
            task_status.started()
            started = True
            passes = trio.CancelScope()
            again = (conn, traces, host, serves, reconnections, passes)
            nursery.start_soon(_drop_after_reconnects, *again)
            async for message in writes:
                session_id = message.subject.removeprefix(prefix)
                if not (removed_entry(message.headers) and _cluster_id(session_id)):
                    continue
                if serves(session_id):
                    continue
                # One look per session at a time, and few at once: a burst of deletions
                # (a user clearing thousands) never piles up tasks here.
                if session_id in looking or len(looking) >= READS_AT_ONCE * 64:
                    continue
                looking.add(session_id)
                nursery.start_soon(_drop_once_purged, traces, host, session_id, serves, looking)
            passes.cancel()  # the connection is closed for good: it never comes back
    except ClusterError as exc:
        _log(f"cannot hear of sessions deleted by other hosts ({exc}); copies may stay")
        if not started:
            await drop_deleted_copies(conn, traces, host)
            task_status.started()


async def _drop_after_reconnects(
    conn: Connection,
    traces: TraceStream,
    host: Host,
    serves: Callable[[str], bool],
    reconnections: int,
    scope: trio.CancelScope,
) -> None:
    """After each reconnection of ``conn`` past the ``reconnections`` it had made, the
    start's pass again (:func:`drop_deleted_copies`, but for the sessions this host runs):
    a delete marker written while the connection was down was not heard. The client has
    subscribed again first, so a marker written during the pass is heard. Until
    ``scope`` is cancelled."""
    with scope:
        while True:
            await conn.reconnected(after=reconnections)
            reconnections = conn.reconnections
            try:
                await drop_deleted_copies(conn, traces, host, serves)
            except Exception as exc:
                # A task of the node's nursery: whatever a pass meets (the disk, the host
                # closing, a session busy again), the host and its hearing go on.
                _log(f"cannot delete the copies of sessions deleted elsewhere ({exc!r}); kept")


async def _drop_once_purged(
    traces: TraceStream,
    host: Host,
    session_id: str,
    serves: Callable[[str], bool],
    looking: set[str],
) -> None:
    """Delete ``host``'s copy of ``session_id`` once JetStream holds no trace of it."""
    try:
        if not await host.trace_store.catalog.exists(session_id):
            return
        for wait_s in PURGE_WAITS_S:
            await trio.sleep(wait_s)
            if serves(session_id):
                return  # opened here again: its host's to delete
            if await traces.last_sequence(session_id) == 0:
                await delete_copy(host, session_id, "deleted in the cluster by another host")
                return
        _log(f"kept session {session_id}: deleted from the directory, its trace is still there")
    except ClusterUnavailable as exc:
        _log(f"cannot tell whether session {session_id} was deleted ({exc}); its copy stays")
    except OSError as exc:
        _log(f"cannot delete session {session_id} here ({exc}); its copy stays")
    except Exception as exc:
        # A task of the node's nursery: whatever one deletion meets (the host closing, a
        # session busy again), the host and its hearing of the others go on.
        _log(f"cannot delete session {session_id} here ({exc!r}); its copy stays")
    finally:
        looking.discard(session_id)


def _cluster_id(session_id: str) -> bool:
    try:
        check_session_id(session_id)
    except ValueError:
        return False  # a key no host writes: not a session of the cluster
    return True


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
