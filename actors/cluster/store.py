"""A host's trace store in cluster mode: the file store, and every record of a cluster
session also appended, fenced, to the session's JetStream subject (R-CLUSTER-1, R-TRACE-2).

:class:`ReplicatingTraceStore` is a :class:`~greenroom.actors.runtime.trace_store.TraceStore`
that keeps the host's files as in single-host mode (a :class:`FileTraceStore` inside) and
replaces one of its three parts: its session catalog and usage ledger are the file store's
(deleting a session it replicates, or replicated until it was closed here, also tells the
node, ``on_deleted``), its trace log is a
:class:`ReplicatingTraceLog`. That log writes the files as the file log does (the gateway's
replay and loading work as they do there) and queues each record of a *replicated* session
for the session's :class:`~greenroom.actors.cluster.traces.TraceWriter`. A ticket is done
(:meth:`~ReplicatingTraceLog.batch_done`, :meth:`~ReplicatingTraceLog.when_batch_done`) only
once its records are in the file *and* acknowledged by JetStream,
:meth:`~ReplicatingTraceLog.commit` says False until then, and
:meth:`~ReplicatingTraceLog.sync` returns only then: a client never sees a record, and a tool
with side effects never starts, before the record is in the cluster and survives this host.

When JetStream refuses an append (another host fenced the trace: this host lost the
session), nothing more of that session is appended, :meth:`~ReplicatingTraceLog.error`
reports a :class:`~greenroom.actors.runtime.trace_store.StaleTraceWriter`, and
``on_fenced(session_id)`` is called so the host stops the session. So too for a record
NATS cannot carry in one message (over its ``max_payload``: :class:`UnreplicableRecord`).
A session that is not replicated (yet, or any more: closed here,
:meth:`~ReplicatingTraceLog.stop`) is stored in files only.

A fork (R-FORK-1) is copied in files as the file log copies it; its records go to JetStream
when the session is replicated, first in its stream, as if they had been appended then.
Lines queued together go as one message of at most :data:`MAX_MESSAGE_BYTES` in UTF-8,
and never more than the NATS server takes with the message's headers (a fork's prefix can
be megabytes; NATS refuses a message over its ``max_payload``, 1 MiB by default), so
records that each fit in a message are never refused together. A message NATS failed
(unreachable, or its acknowledgement lost) is sent again exactly as it was, and only it
and those after it: the writer recognises a retried message that was stored
(:class:`~greenroom.actors.cluster.traces.TraceWriter`), so no record reaches the stream
twice and a lost acknowledgement is no fence (R-CLUSTER-2).

A session given up (its lease lost: :meth:`~ReplicatingTraceLog.forget`; the store closed)
loses the records it never sent. The message on its way then, sent and not acknowledged,
may be stored: the session's stream finds out, within :data:`_DOUBT_S`, before its tickets
are done — it is the first message after the writer's last, or, when nothing follows that
yet, it goes again with its id and is stored once now or refused for good (another host's
fence came first). NATS silent, those records are in doubt (:class:`RecordInDoubt`),
neither acknowledged nor lost.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from greenroom.actors.cluster.errors import ClusterUnavailable, Fenced, RecordTooLarge
from greenroom.actors.cluster.traces import TraceWriter
from greenroom.actors.runtime.disk import DISK, Disk
from greenroom.actors.runtime.emitter import DURABLE_WAIT_S
from greenroom.actors.runtime.trace_sink import TraceWriteError
from greenroom.actors.runtime.trace_store import (
    FileSessionCatalog,
    FileTraceLog,
    FileTraceStore,
    FileUsageLedger,
    LoadedTrace,
    RecordInDoubt,
    RecordsGivenUp,
    StaleTraceWriter,
    StoredSession,
)
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Output

__all__ = [
    "ClusterCatalog",
    "ReplicatingTraceLog",
    "ReplicatingTraceStore",
    "UnreplicableRecord",
]

_RETRY_S = 0.5
"""Wait before appending again after NATS was unreachable."""

_DOUBT_S = 5.0
"""How long a session given up with a message on its way waits for NATS to say whether
it stored it, before its records are left in doubt (:class:`RecordInDoubt`)."""

_FIRST_TICKET = 2
"""The first ticket of a replicated record; the file log's tickets (1) are below, and are
done as soon as their records are written."""

_LOST_KEPT_S = 2 * DURABLE_WAIT_S
"""How long the store still answers :meth:`ReplicatingTraceLog.lost` for a session it gave
up once it no longer holds its replica (released, or replicated again): a receipt asks at
most DURABLE_WAIT_S after its wait began, which was while the session was open here."""

MAX_MESSAGE_BYTES = 256 * 1024
"""The most bytes of trace lines one JetStream message carries (a longer line goes alone),
when the NATS server takes that many (:meth:`TraceWriter.largest_append`)."""


class _Message:
    """One JetStream message planned from queued records: a rotation to trace file
    ``rotate``, or the lines of ``records`` (ticket, trace number, line)."""

    def __init__(self, records: list[tuple[int, int, str]], rotate: int | None = None) -> None:
        self.records = records
        self.rotate = rotate
        self.sent = False
        """Whether an attempt went out: JetStream may hold it, acknowledged or not."""


class _Replica:
    """The records of one session waiting for JetStream, in order."""

    def __init__(self, session_id: str, since: int) -> None:
        self.session_id = session_id
        self.since = since
        """A ticket below every ticket the replica gives (tickets are global and grow):
        which replica of the session a ticket was given by."""
        self.queue: list[tuple[int, int, str]] = []  # (ticket, trace number, line)
        self.unsent: list[_Message] = []
        """The messages planned from the records taken off the queue that JetStream has
        not acknowledged yet, first to go first. Kept as they are until acknowledged: a
        failed one may have been stored, and only the same message is recognised."""
        self.number: int | None = None
        """The trace file of the last record planned into a message."""
        self.error: TraceWriteError | None = None
        """Why records of the session never reach JetStream, once one does not (fenced, or
        given up unacknowledged, or appended after it was given up): its syncs raise it."""
        self.given_up: TraceWriteError | None = None
        """Why the store stopped replicating the session, once it did. The records
        JetStream acknowledged before stay acknowledged: a sync that covers only them
        succeeds, and only a record lost then or appended since sets :attr:`error`."""
        self.lost_from: int | None = None
        """Once given up, its first ticket that never reaches JetStream: the first given
        up unacknowledged, else the one after the last it gave. Its tickets grow in the
        session's order, and a record appended since gets one above, so those from it on
        are lost and those before it were acknowledged (:meth:`ReplicatingTraceLog.lost`)."""
        self.in_doubt: list[tuple[int, int, str]] = []
        """Once given up, the records of the message that was on its way then (sent, not
        acknowledged): JetStream may hold them. Their tickets are done once the session's
        stream finds out (:meth:`ReplicatingTraceLog.stream_to`), not before."""
        self.unknown: RecordInDoubt | None = None
        """Why the records given up on their way stay in doubt, when NATS did not tell in
        time; their tickets are from :attr:`doubted_from` to :attr:`lost_from`."""
        self.doubted_from = 0
        self.streaming = False
        """Whether a :meth:`ReplicatingTraceLog.stream_to` task sends its records."""
        self.sending: trio.CancelScope | None = None
        """The scope of the message being sent, cancelled when the session is given up:
        the stream stops waiting for its acknowledgement and finds out instead."""
        self.wakeup = trio.Event()
        self.idle = trio.Event()
        self.idle.set()

    def busy(self) -> bool:
        return bool(self.queue or self.unsent)


class UnreplicableRecord(StaleTraceWriter):
    """A record of the session is larger than NATS takes in one message: it never reaches
    the cluster, and the session stops on this host as a fenced one does."""


class ReplicatingTraceStore:
    """The file store with a replicating trace log (see the module docstring).

    ``on_fenced(session_id)`` and ``on_deleted(session_id)`` (a session deleted through
    this host) must not block or raise. ``disk`` is the file store's. ``largest_input``
    gives the log's :meth:`~ReplicatingTraceLog.largest_input` (the cluster's NATS
    server's; none without it).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        on_fenced: Callable[[str], None],
        on_deleted: Callable[[str], None] = lambda _session_id: None,
        disk: Disk = DISK,
        largest_input: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.files = FileTraceStore(data_dir, disk=disk)
        self.data_dir = data_dir
        self.log = ReplicatingTraceLog(
            self.files.log, data_dir, on_fenced=on_fenced, largest_input=largest_input
        )
        self.catalog = ClusterCatalog(self.files.catalog, self.log, on_deleted=on_deleted)
        self.ledger: FileUsageLedger = self.files.ledger
        """The host's own ledger: each host counts the requests it made."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the file store."""
        await self.files.run(task_status=task_status)

    async def aclose(self) -> None:
        """Close the file store; records JetStream has not acknowledged by then are given
        up (their tickets count as done, their sessions report that they were lost, but
        for those on their way, whose fate the sessions' streams find out first) —
        also when the close is cut short (the host's shutdown bound): whoever waits for
        them (a receipt, a sync) is answered then, not at its own bound."""
        try:
            await self.files.aclose()
        finally:
            self.log.give_up_all()


class ClusterCatalog:
    """The file store's session catalog; deleting a replicated session (or one replicated
    until it was closed here, :meth:`ReplicatingTraceLog.stop`) also stops its replication
    and tells the node (``on_deleted``), which removes it from the cluster."""

    def __init__(
        self,
        files: FileSessionCatalog,
        log: ReplicatingTraceLog,
        *,
        on_deleted: Callable[[str], None],
    ) -> None:
        self._files = files
        self._log = log
        self._on_deleted = on_deleted

    async def create(self, session_id: str, meta: dict[str, Any]) -> None:
        """As the file catalog."""
        await self._files.create(session_id, meta)

    async def read_meta(self, session_id: str) -> dict[str, Any]:
        """As the file catalog."""
        return await self._files.read_meta(session_id)

    async def exists(self, session_id: str) -> bool:
        """As the file catalog."""
        return await self._files.exists(session_id)

    async def list_sessions(self) -> list[StoredSession]:
        """As the file catalog (the sessions this host's data dir holds)."""
        return await self._files.list_sessions()

    async def delete(self, session_id: str) -> None:
        """As the file catalog; the session stops being replicated and the cluster forgets
        it (``on_deleted``)."""
        replicated = self._log.replicated(session_id) or self._log.closed_here(session_id)
        await self._files.delete(session_id)
        self._log.forget(session_id)
        if replicated:
            self._on_deleted(session_id)


class ReplicatingTraceLog:
    """The file log plus fenced JetStream appends for replicated sessions.

    ``on_fenced(session_id)`` must not block or raise. Replication of a session starts
    with :meth:`replicate` (records are queued from then on); its appends run in
    :meth:`stream_to`, one task per session, started once its lease is held and its trace
    fenced.
    """

    def __init__(
        self,
        files: FileTraceLog,
        data_dir: Path,
        *,
        on_fenced: Callable[[str], None],
        largest_input: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.files = files
        self.data_dir = data_dir
        self._on_fenced = on_fenced
        self._largest_input = largest_input
        self._replicas: dict[str, _Replica] = {}
        self._stopped: dict[str, _Replica] = {}
        """The replicas of the sessions that stopped being replicated here (fenced, or
        given up), until they are replicated again: their later records reach no cluster,
        and the session says so instead of passing them for durable."""
        self._past: deque[tuple[float, _Replica, int]] = deque()
        """Replicas given up that the log no longer holds (released, or replicated again),
        when they went and the ticket above their last, kept :data:`_LOST_KEPT_S` for the
        receipts still asking about their records (:meth:`lost`)."""
        self._closed: set[str] = set()
        """The sessions replicated until they were closed here (:meth:`stop`)."""
        self._forked: dict[str, list[tuple[int, str]]] = {}
        """The copied records of forks not replicated yet: (trace number, line)."""
        self._tickets = itertools.count(_FIRST_TICKET)
        self._unacknowledged: set[int] = set()
        """The tickets of queued records JetStream has not acknowledged: one a record, so
        each session's tickets are done in its own order, whatever the other sessions'."""
        self._waiters: dict[int, list[trio.MemorySendChannel[TraceWritten]]] = {}

    # -- replication --------------------------------------------------------------------

    def replicate(self, session_id: str) -> None:
        """Queue every later record of ``session_id`` for JetStream (after the records a
        fork copied into it, if it is one)."""
        if session_id in self._replicas:
            return
        self._retire(self._stopped.pop(session_id, None))
        self._closed.discard(session_id)
        replica = self._replicas[session_id] = _Replica(session_id, next(self._tickets))
        for number, line in self._forked.pop(session_id, ()):
            self._queue(replica, number, line)

    def replicated(self, session_id: str) -> bool:
        """Whether ``session_id``'s records go to JetStream too."""
        return session_id in self._replicas

    def closed_here(self, session_id: str) -> bool:
        """Whether ``session_id`` was replicated until it was closed here (:meth:`stop`)."""
        return session_id in self._closed

    def forget(self, session_id: str) -> None:
        """Stop replicating ``session_id``; records still queued are given up (their
        tickets count as done, and the session reports the error), and those on their way
        are settled by what JetStream holds (:meth:`_give_up`)."""
        self._forked.pop(session_id, None)
        self._closed.discard(session_id)
        replica = self._replicas.pop(session_id, None)
        if replica is not None:
            self._give_up(replica, replica.given_up or self._lost(session_id))
            self._stopped[session_id] = replica

    async def settled(self, session_id: str) -> bool:
        """Return once JetStream has acknowledged every record of ``session_id`` queued so
        far: True, or False when it is not replicated, or was fenced or given up meanwhile
        (:meth:`sync` without the file log, which may have forgotten a closed session)."""
        replica = self._replicas.get(session_id)
        if replica is None:
            return False
        await replica.idle.wait()
        return replica.given_up is None and self._replicas.get(session_id) is replica

    def stop(self, session_id: str) -> None:
        """Stop replicating ``session_id``, closed here once JetStream acknowledged all its
        records (:meth:`settled`): its stream ends and nothing is reported. A record queued
        since is given up as by :meth:`forget` (the session reports it)."""
        self._forked.pop(session_id, None)
        replica = self._replicas.get(session_id)
        if replica is None:
            return
        if replica.busy():
            self.forget(session_id)
        else:
            del self._replicas[session_id]
            self._closed.add(session_id)
            replica.wakeup.set()  # its stream_to loop ends

    def give_up_all(self) -> None:
        """The store is closed: records JetStream has not acknowledged are given up as by
        :meth:`forget`."""
        for replica in list(self._replicas.values()):
            self._give_up(replica, replica.given_up or self._lost(replica.session_id))

    async def stream_to(
        self,
        session_id: str,
        writer: TraceWriter,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Append ``session_id``'s queued records with ``writer`` (all that are queued at
        once, in as few messages as rotations and :data:`MAX_MESSAGE_BYTES` allow) until
        cancelled or fenced. When NATS fails a message, the ones acknowledged before it
        are done and the rest go again, unchanged, once it can be reached."""
        self.replicate(session_id)
        replica = self._replicas[session_id]
        replica.streaming = True
        task_status.started()
        try:
            await self._stream(replica, writer)
        finally:
            replica.streaming = False
            if replica.in_doubt:
                await self._find_out(replica, writer)

    async def _find_out(self, replica: _Replica, writer: TraceWriter) -> None:
        """Settle the records given up on their way by what JetStream holds: shielded, as
        the session's stream is cancelled when it is given up, and bounded (:data:`_DOUBT_S`):
        NATS silent, they stay in doubt."""
        stored: bool | None = None
        with trio.CancelScope(shield=True), trio.move_on_after(_DOUBT_S):
            with contextlib.suppress(ClusterUnavailable):
                stored = await writer.holds([line for _, _, line in replica.in_doubt])
        self._settle_doubt(replica, stored)

    def _settle_doubt(self, replica: _Replica, stored: bool | None) -> None:
        """``replica``'s records :attr:`~_Replica.in_doubt` are done: JetStream holds them
        (``stored``), or they are lost, or (None) nobody knows."""
        doubtful, replica.in_doubt = replica.in_doubt, []
        if stored is None:
            replica.unknown = RecordInDoubt(
                self._where(replica.session_id),
                "the session stopped being replicated while its record was on its way to "
                "the cluster, and NATS did not say whether it stored it",
            )
            replica.doubted_from = doubtful[0][0]
            replica.error = replica.error or replica.unknown
        elif not stored:
            replica.lost_from = doubtful[0][0]
            replica.error = replica.error or replica.given_up
        self._acknowledge(doubtful)
        replica.idle.set()

    async def _stream(self, replica: _Replica, writer: TraceWriter) -> None:
        session_id = replica.session_id
        while self._replicas.get(session_id) is replica:
            if replica.in_doubt:  # given up (the store closed) with a message on its way
                await self._find_out(replica, writer)
            if not replica.unsent:
                if not replica.queue:
                    replica.idle.set()
                    replica.wakeup = trio.Event()
                    await replica.wakeup.wait()
                    continue
                replica.unsent = _plan(replica, min(MAX_MESSAGE_BYTES, writer.largest_append()))
            try:
                await self._send(writer, replica)
            except (Fenced, RecordTooLarge) as exc:
                # Refused: it is not in the stream.
                if replica.in_doubt:
                    self._settle_doubt(replica, stored=False)
                elif replica.unsent:
                    replica.unsent[0].sent = False
                # A record NATS cannot carry (a client's input of a megabyte) can never be
                # in the cluster: the session stops here as a fenced one does, and goes on
                # from its trace in the cluster, without it. Raised on, it ended the host.
                error = (
                    StaleTraceWriter(
                        self._where(session_id),
                        "another host took this session over: its trace is fenced",
                    )
                    if isinstance(exc, Fenced)
                    else UnreplicableRecord(
                        self._where(session_id),
                        f"{exc}; the session goes on from its trace in the cluster",
                    )
                )
                self._replicas.pop(session_id, None)
                self._give_up(replica, error)
                self._stopped[session_id] = replica
                self._on_fenced(session_id)
                return
            except ClusterUnavailable:
                # The unacknowledged messages stay as they are, to go again unchanged
                # (after the same sequence, with the same id): the one that failed may
                # be stored, and the writer recognises it only so. Given up meanwhile,
                # it goes again at once, to find out whether it was stored.
                if not replica.in_doubt:
                    await trio.sleep(_RETRY_S)

    async def _send(self, writer: TraceWriter, replica: _Replica) -> None:
        """Send the replica's unsent messages, acknowledging each one's records as soon
        as JetStream has it, so that a retry sends only the rest."""
        while replica.unsent:
            message = replica.unsent[0]
            message.sent = True
            with trio.CancelScope() as sending:
                replica.sending = sending
                try:
                    if message.rotate is not None:
                        await writer.rotate(message.rotate)
                    else:
                        await writer.append([line for _, _, line in message.records])
                finally:
                    replica.sending = None
            if sending.cancelled_caught:
                return  # given up on its way: the stream finds out what became of it
            if replica.in_doubt and replica.in_doubt is message.records:
                self._settle_doubt(replica, stored=True)  # given up on its way, and stored
            # Given up meanwhile (forgotten, the store closed): its records were done then.
            elif replica.unsent and replica.unsent[0] is message:
                replica.unsent.pop(0)
                self._acknowledge(message.records)

    def _acknowledge(self, done: list[tuple[int, int, str]]) -> None:
        unacknowledged, waiters = self._unacknowledged, self._waiters
        for ticket, _, _ in done:
            unacknowledged.discard(ticket)
            if waiters:
                for reply in waiters.pop(ticket, ()):
                    _tell(reply, ticket)

    def _give_up(self, replica: _Replica, error: TraceWriteError) -> None:
        """Stop replicating ``replica`` for ``error``: its records never sent count as
        done, and lost. Those of a message on its way (sent, not acknowledged) may be in
        JetStream: they are done once the session's stream found out (:meth:`_find_out`),
        lost only if they are not there. Given up with none lost, the session fails no sync
        until it appends a record, which then reaches no cluster (a fence refuses it)."""
        replica.given_up = error
        unsent = replica.unsent
        if unsent and unsent[0].sent and unsent[0].records:
            replica.in_doubt, unsent = unsent[0].records, unsent[1:]
        lost = [record for message in unsent for record in message.records] + replica.queue
        if lost or isinstance(error, StaleTraceWriter):
            replica.error = error
        if replica.lost_from is None:
            replica.lost_from = lost[0][0] if lost else next(self._tickets)
        replica.unsent, replica.queue = [], []
        self._acknowledge(lost)
        if replica.in_doubt and not replica.streaming:
            self._settle_doubt(replica, None)  # no stream is left to find out
        elif not replica.in_doubt:
            replica.idle.set()
        if replica.sending is not None:
            replica.sending.cancel()
        replica.wakeup.set()

    def _retire(self, replica: _Replica | None) -> None:
        """Keep what ``replica``, given up and no longer held, lost, for :meth:`lost`."""
        if replica is None:
            return
        now = trio.current_time()
        past = self._past
        # Bounded by the give-ups of the last _LOST_KEPT_S: no receipt asks after it.
        while past and past[0][0] < now - _LOST_KEPT_S:
            past.popleft()
        past.append((now, replica, next(self._tickets)))

    def _lost(self, session_id: str) -> TraceWriteError:
        return RecordsGivenUp(
            self._where(session_id),
            "the session stopped being replicated before its trace reached the cluster",
        )

    def _where(self, session_id: str) -> Path:
        try:
            return self.files.location(session_id)
        except KeyError:
            return self.data_dir / session_id

    # -- the TraceLog API -----------------------------------------------------------------

    def start(self, session_id: str) -> None:
        """As the file log."""
        self.files.start(session_id)

    async def load(self, session_id: str) -> LoadedTrace:
        """As the file log (a session taken over was written to files first)."""
        return await self.files.load(session_id)

    async def read_latest(self, session_id: str) -> LoadedTrace:
        """As the file log."""
        return await self.files.read_latest(session_id)

    async def read_after(self, session_id: str, after_seq: int = 0) -> list[Output]:
        """As the file log."""
        return await self.files.read_after(session_id, after_seq)

    def release(self, session_id: str) -> None:
        """Forget the closed session's file position (its replication is the node's)."""
        self._retire(self._stopped.pop(session_id, None))
        self.files.release(session_id)

    def cut_short(self, session_id: str) -> trio.Event | None:
        """As the file log (a close cut short: the release comes later)."""
        return self.files.cut_short(session_id)

    def location(self, session_id: str) -> Path:
        """As the file log."""
        return self.files.location(session_id)

    def trace_number(self, session_id: str) -> int:
        """As the file log."""
        return self.files.trace_number(session_id)

    def largest_input(self) -> int | None:
        """The most bytes of a client's input a record JetStream takes may hold (a larger
        one stops its session on its host: :class:`UnreplicableRecord`)."""
        return self._largest_input()

    def append(self, session_id: str, seq: int, line: str) -> int:
        """As the file log; a replicated session's record is also queued for JetStream,
        under a ticket of its own. A fenced session's appends are refused."""
        replica = self._replicas.get(session_id) or self._stopped.get(session_id)
        if replica is not None and isinstance(replica.error, StaleTraceWriter):
            raise replica.error
        ticket = self.files.append(session_id, seq, line)
        if replica is None:
            return ticket
        if replica.given_up is not None:
            replica.error = replica.error or replica.given_up  # it reaches no cluster
            # A ticket of its own, above lost_from: lost() knows it after the release too.
            return next(self._tickets)
        return self._queue(replica, self.files.trace_number(session_id), line)

    def _queue(self, replica: _Replica, number: int, line: str) -> int:
        ticket = next(self._tickets)
        replica.queue.append((ticket, number, line))
        if replica.idle.is_set():
            replica.idle = trio.Event()
        self._unacknowledged.add(ticket)
        replica.wakeup.set()
        return ticket

    async def fork(self, source_id: str, session_id: str, through_seq: int | None) -> int:
        """As the file log; the copied records wait for the session to be replicated
        (:meth:`replicate`), then go to JetStream before any later one."""
        copied = await self.files.copy_prefix(source_id, session_id, through_seq)
        self._forked[session_id] = [
            (number, line)
            for number, data in copied.files
            # Split on "\n" only: a record may hold U+2028 and friends.
            for line in _lines(data.decode("utf-8", "replace"))
        ]
        return copied.seq

    def commit(self, session_id: str) -> bool:
        """As the file log, and False while JetStream has not acknowledged every record
        of the session (wait for the ticket then)."""
        written = self.files.commit(session_id)
        replica = self._replicas.get(session_id)
        return written and (replica is None or not replica.busy())

    def batch_done(self, ticket: int) -> bool:
        """As the file log (whose records are written once committed, whatever the
        ticket), and JetStream acknowledged the ticket's record: a replicated session's
        records are acknowledged in its order, so its earlier ones are too."""
        return ticket not in self._unacknowledged and self.files.batch_done(ticket)

    def when_batch_done(self, ticket: int, reply: trio.MemorySendChannel[TraceWritten]) -> None:
        """As the file log, once JetStream acknowledged the ticket's record too."""
        if self.batch_done(ticket):
            _tell(reply, ticket)
        else:
            self._waiters.setdefault(ticket, []).append(reply)

    def error(self, session_id: str) -> TraceWriteError | None:
        """As the file log, or the fencing of a replicated session."""
        local = self.files.error(session_id)
        if local is not None:
            return local
        replica = self._replicas.get(session_id) or self._stopped.get(session_id)
        return None if replica is None else replica.error

    def lost(self, session_id: str, ticket: int) -> TraceWriteError | None:
        """Why the record of ``ticket``, done, never reaches the cluster (or may not:
        :class:`RecordInDoubt`), or None once JetStream holds it (or the session is not
        replicated: as the file log). Its own fate, whatever became of the session's other
        records: given up unsent or refused (fenced, forgotten, the store closed), or
        appended once the session was given up — also
        once the session is released or replicated again, for :data:`_LOST_KEPT_S`, as
        long as a receipt may ask. O(1) while the log holds the ticket's replica (it keeps
        only its first lost ticket); after, a look through the replicas given up since."""
        replica = self._replicas.get(session_id) or self._stopped.get(session_id)
        if replica is None or ticket <= replica.since:
            # A file log's ticket (appended while the session was not replicated), or
            # one of a replica the log no longer holds.
            replica = _giver(self._past, session_id, ticket)
        if replica is None or replica.lost_from is None:
            return None
        if ticket < replica.lost_from:
            doubted = replica.unknown is not None and ticket >= replica.doubted_from
            return replica.unknown if doubted else None
        return replica.error or replica.given_up

    def clear_error(self, session_id: str) -> None:
        """As the file log (a fencing stays: the session is someone else's)."""
        self.files.clear_error(session_id)

    async def sync(self, session_id: str | None = None) -> None:
        """As the file log, and every record appended before is acknowledged by
        JetStream (R-TRACE-2 in the cluster). Raises the fencing's StaleTraceWriter, or
        RecordsGivenUp when the session was given up with records JetStream had not
        acknowledged, or appended one since; records acknowledged before it was given up
        stay acknowledged."""
        await self.files.sync(session_id)
        replicas = (
            list(self._replicas.values())
            if session_id is None
            else [
                r
                for r in [self._replicas.get(session_id) or self._stopped.get(session_id)]
                if r is not None
            ]
        )
        for replica in replicas:
            await replica.idle.wait()
            if replica.error is not None:
                raise replica.error

    def rotate(self, session_id: str) -> str:
        """As the file log; the next records go to JetStream after a rotation marker."""
        return self.files.rotate(session_id)


def _plan(replica: _Replica, most: int) -> list[_Message]:
    """Take the replica's queued records off its queue as messages: a rotation before the
    first record of each new trace file, lines together up to ``most`` bytes in UTF-8 (a
    longer line alone)."""
    messages: list[_Message] = []
    lines: list[tuple[int, int, str]] = []
    size = 0
    for record in replica.queue:
        _, number, line = record
        # Sent as UTF-8; isascii() is a flag on the string, so text costs no encoding here.
        length = len(line) if line.isascii() else len(line.encode())
        if replica.number is not None and number != replica.number:
            if lines:
                messages.append(_Message(lines))
                lines, size = [], 0
            messages.append(_Message([], rotate=number))
        elif lines and size + length > most:
            messages.append(_Message(lines))
            lines, size = [], 0
        replica.number = number
        lines.append(record)
        size += length
    if lines:
        messages.append(_Message(lines))
    replica.queue = []
    return messages


def _giver(
    past: deque[tuple[float, _Replica, int]], session_id: str, ticket: int
) -> _Replica | None:
    """The replica of ``session_id`` in ``past`` that gave ``ticket``, if any."""
    for _, replica, above in reversed(past):
        if replica.session_id == session_id and replica.since < ticket < above:
            return replica
    return None


def _tell(reply: trio.MemorySendChannel[TraceWritten], ticket: int) -> None:
    # An emitter whose task has ended closed its inbox: nobody waits for the ticket.
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        reply.send_nowait(TraceWritten(ticket=ticket))


def _lines(text: str) -> list[str]:
    return [line + "\n" for line in text.split("\n")[:-1]]
