"""Where sessions are stored: the :class:`TraceStore` and its three parts, and the file backend.

A host keeps every session it creates in one trace store, made of three parts, each an
interface of its own job:

- the **session catalog** (:class:`SessionCatalog`): which sessions are stored, and the
  metadata of each (what ``session.json`` holds) — create, read, exists, list, delete;
- the **trace log** (:class:`TraceLog`): each session's traced outputs in ``seq`` order,
  one record each (R-TRACE), split into numbered traces at compactions (R-COMPACT-8) —
  load, replay, append fenced by ``seq``, commit and batch tickets, sync, errors, rotate;
- the **usage ledger** (:class:`UsageLedger`): one row per model request, compaction
  failure and title (R-TRACE-5), with its cost (R-SHARE-3), and the totals and reports
  read from them.

The store is one object with the three parts as attributes — ``store.catalog``,
``store.log``, ``store.ledger`` — plus the lifetime they share (``run``, ``aclose``). This
shape keeps the call sites simple: a host is opened with one store
(``Host.open(trace_store=factory)``) and starts and closes it as one actor (the file
backend's one sink writes the traces and the ledger); each caller names the part it uses
and takes nothing else (a session's running work the log and the ledger, through its port;
the gateway the catalog and the log's replay; ``greenroom sessions`` the catalog); and a
backend replaces only the part it changes — the cluster's store is the file catalog and
ledger around a log that also replicates to JetStream. The actors reach storage only
through these interfaces, so a backend replaces the files without touching them.

The rules every backend keeps (``tests/test_store_conformance.py`` runs them against the
file, memory and JetStream backends):

- **Appends are fenced by ``seq``.** :meth:`TraceLog.append` names the ``seq`` of the
  record; it must come after every ``seq`` the log holds for that session, or the append
  is refused with :class:`StaleTraceWriter`. A host that lost a session to another one can
  therefore not add to its trace (R-CLUSTER-1); in one process it catches a bug that would
  duplicate a record. (A record its writer could not encode leaves its ``seq`` unused.)
- **Publication waits for the write.** :meth:`TraceLog.commit` hands a session's appended
  records on at once when it can (a file: always, one ``write(2)`` in the caller's task);
  when it cannot (a log that acknowledges late), it returns False, and
  :meth:`TraceLog.when_batch_done` sends ``TraceWritten`` on the emitter's inbox once the
  ticket :meth:`TraceLog.append` returned is done. A session publishes an output only then
  (R-TRACE-3, R-RUN-8).
- **Durability on request.** :meth:`TraceLog.sync` returns once everything appended for
  the session is durable (a file: fsynced), at the points R-TRACE-2 names.
- **Failures are per session and sticky** (:meth:`TraceLog.error`, cleared by
  :meth:`TraceLog.clear_error`); no record and no I/O error ends the store or the host.
- **A trace is one model context.** :meth:`TraceLog.rotate` starts the session's next
  numbered trace; :meth:`TraceLog.load` returns the latest one, :meth:`TraceLog.read_after`
  reads across all of them.
- **A fork is a copy.** :meth:`TraceLog.fork` gives a new session the records of another
  up to a ``seq``, in the same numbered traces, each moved to the new session's id
  (R-FORK-1); the source is not touched (its bytes stay the same) and the two share
  nothing afterwards. A ``seq`` past the source's last is refused with ``SeqRefused``.
- **Metadata is checked.** :meth:`SessionCatalog.read_meta` raises
  :class:`StoredSessionMissing` for a session the store does not hold and
  :class:`StoredSessionUnreadable` for metadata that cannot be used; deleting a session
  removes all of it (metadata, traces, its files).

Exceptions (with the trace sink's)::

    Exception
    ├── TraceSinkClosed          an append or a sync after the store was closed
    ├── TraceWriteError          a session's records could not be written or made durable
    │   └── StaleTraceWriter     an append whose seq the log holds already (fenced)
    └── GreenroomError
        ├── StoredSessionMissing     no such session in the catalog
        └── StoredSessionUnreadable  its metadata cannot be used (where and why)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import trio

from greenroom.actors.runtime.disk import DISK, Disk
from greenroom.actors.runtime.errors import (
    GreenroomError,
    SeqRefused,
    SessionExists,
    SessionOpenElsewhere,
)
from greenroom.actors.runtime.storage import (
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    SESSION_FILE,
    SessionStore,
    read_session_records,
    tighten,
)
from greenroom.actors.runtime.trace_sink import (
    TraceSink,
    TraceSinkClosed,
    TraceWriteError,
    latest_trace_file,
    read_trace,
    usage_report,
    usage_totals,
)
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Output
from greenroom.protocols.text import repair_json
from greenroom.protocols.trace import (
    UsageLine,
    UsageQuery,
    UsageRow,
    copy_records,
    trace_file_name,
    trace_file_number,
)
from greenroom.protocols.wording import special_file_words

logger = logging.getLogger(__name__)

__all__ = [
    "WRITER_LOCK_FILE",
    "FileSessionCatalog",
    "FileTraceLog",
    "FileTraceStore",
    "FileUsageLedger",
    "LoadedTrace",
    "RecordInDoubt",
    "RecordsGivenUp",
    "SessionCatalog",
    "StaleTraceWriter",
    "StoredSession",
    "StoredSessionMissing",
    "StoredSessionUnreadable",
    "TraceLog",
    "TraceStore",
    "TraceStoreFactory",
    "UsageLedger",
    "check_meta",
    "one_line",
    "read_meta_file",
]


WRITER_LOCK_FILE = "writer.lock"
"""In each session's directory: the file whose ``flock`` the host writing the session's
trace holds while the session is open in it (:class:`FileTraceLog`)."""


class StaleTraceWriter(TraceWriteError):
    """An append whose ``seq`` is not the next one the store expects for the session: the
    writer's picture of the trace is stale (another host owns the session now, or a bug)."""


class RecordsGivenUp(TraceWriteError):
    """The store stopped keeping the session's records durable before it held them all
    (a cluster host gave the session up, or closed, before JetStream acknowledged them):
    those records, and any written after, never become durable, however often synced."""


class RecordInDoubt(TraceWriteError):
    """The store stopped keeping the session's records durable while one was on its way
    (a cluster host gave the session up with a message sent to JetStream and not yet
    acknowledged), and could not find out whether it was stored: the record may survive
    the host (and run on the one that takes the session up), or not."""


class StoredSessionMissing(GreenroomError):
    """The store holds no session with that id."""


class StoredSessionUnreadable(GreenroomError):
    """The store holds the session, but its metadata cannot be used; the message says
    where and why."""


@attrs.frozen(kw_only=True)
class LoadedTrace:
    """The latest trace of a stored session (the model context since its last compaction)."""

    records: tuple[Output, ...]
    errors: tuple[str, ...]
    """Records that could not be read, one line each (skipped; R-SEC-1)."""
    number: int
    """The trace's number (1 for a session never compacted)."""
    last_seq: int
    """The highest ``seq`` in the session's trace (0: none yet)."""


@attrs.frozen(kw_only=True)
class StoredSession:
    """One session of a catalog's list: its metadata (checked, as :meth:`read_meta` gives
    it), or why that cannot be read."""

    session_id: str
    """The id the session is stored under."""
    meta: dict[str, Any] | None
    """The metadata; None when it cannot be used (see ``problem``)."""
    problem: str | None
    """Why the metadata cannot be used (it names where), else None."""
    where: str
    """Where the metadata is, for people (a file's path)."""
    updated_at: float
    """When the session last changed (unix time): its latest record, else its creation."""
    traces: int
    """How many numbered traces it has."""


class SessionCatalog(Protocol):
    """The sessions a store holds and their metadata; see the module docstring."""

    async def create(self, session_id: str, meta: dict[str, Any]) -> None:
        """Store a new session's metadata (a JSON object); :class:`SessionExists` when the
        catalog holds a session of that id."""
        ...

    async def read_meta(self, session_id: str) -> dict[str, Any]:
        """A stored session's metadata, checked for the shape readers rely on
        (:func:`check_meta`). Raises :class:`StoredSessionMissing` or
        :class:`StoredSessionUnreadable`."""
        ...

    async def exists(self, session_id: str) -> bool:
        """Whether the catalog holds session ``session_id``."""
        ...

    async def list_sessions(self) -> list[StoredSession]:
        """Every stored session, in no particular order; one whose metadata cannot be read
        is listed with the reason, never hides the others (R-SEC-1)."""
        ...

    async def delete(self, session_id: str) -> None:
        """Remove the session and everything the store keeps of it: metadata, traces,
        files. The log forgets it (what it still writes for it is finished first); a
        session the store does not hold is no error."""
        ...


class TraceLog(Protocol):
    """Each session's trace; see the module docstring for the rules.

    Appending needs the session's position: :meth:`start` for a new session, :meth:`load`
    for a stored one; :meth:`release` forgets it. Appending for any other session is a
    bug (KeyError). A log that keeps a writer lock on each session it writes (the file
    log) also offers ``cut_short(session_id)`` (:meth:`FileTraceLog.cut_short`): a close
    of the session was cut short, and its :meth:`release` comes once its work has ended.
    """

    def start(self, session_id: str) -> None:
        """A new session (just created in the catalog): its trace is empty, number 1, and
        appends start at ``seq`` 1."""
        ...

    async def load(self, session_id: str) -> LoadedTrace:
        """The session's latest trace; from now on appends for it continue after its
        ``last_seq``."""
        ...

    async def read_latest(self, session_id: str) -> LoadedTrace:
        """The session's latest trace as :meth:`load` reads it, for a reader: the log
        takes no position and changes nothing (``greenroom trace`` reads a data dir it
        cannot write). Raises OSError when the trace cannot be read at all, or when an
        older one of the session's traces cannot be (a history without it is no history:
        R-TRACE)."""
        ...

    async def read_after(self, session_id: str, after_seq: int = 0) -> list[Output]:
        """Every traced output with ``seq > after_seq``, across the session's traces,
        in order (replay for a client that reconnects: R-GW). Raises OSError when one
        of them cannot be read, never gives the others as if they were all."""
        ...

    def append(self, session_id: str, seq: int, line: str) -> int:
        """Append one record (``line``: :func:`~greenroom.protocols.trace.encode_record`,
        ending in a newline) with sequence number ``seq``; returns the ticket for
        :meth:`batch_done`. Never blocks, never raises for I/O. Raises ValueError for a line
        that cannot be stored (no newline, not encodable), :class:`StaleTraceWriter` for a
        ``seq`` out of order, and ``TraceSinkClosed`` once the store is closed."""
        ...

    def commit(self, session_id: str) -> bool:
        """Hand the session's appended records on now if that can be done at once; True
        when none is left unwritten (or its write failed: see :meth:`error`)."""
        ...

    def batch_done(self, ticket: int) -> bool:
        """Whether the records of ``ticket`` are written (or failed)."""
        ...

    def when_batch_done(self, ticket: int, reply: trio.MemorySendChannel[TraceWritten]) -> None:
        """Send ``TraceWritten(ticket)`` on ``reply`` once ``ticket`` is done (at once if it
        is); never blocks (``reply`` has room)."""
        ...

    def lost(self, session_id: str, ticket: int) -> TraceWriteError | None:
        """Why the record of ``ticket`` (appended for ``session_id``; asked once the
        ticket is done) will never be durable, however often synced: a store that gives
        records up (a cluster host's, for records JetStream never stored) says so of each
        record, whatever became of the session's others; :class:`RecordInDoubt` when it
        could not find out. None when the record is durable, or becomes so once synced
        (:meth:`sync` reports its failures)."""
        ...

    def error(self, session_id: str) -> TraceWriteError | None:
        """The sticky write failure of the session's current trace, if any."""
        ...

    def clear_error(self, session_id: str) -> None:
        """Acknowledge :meth:`error` (the next task may try again)."""
        ...

    async def sync(self, session_id: str | None = None) -> None:
        """Make the session's appended records durable (every session's with None).
        Raises ``TraceWriteError`` or ``TraceSinkClosed``."""
        ...

    def rotate(self, session_id: str) -> str:
        """Start the session's next trace (after a compaction); returns its name."""
        ...

    async def fork(self, source_id: str, session_id: str, through_seq: int | None) -> int:
        """Store, as the trace of the new session ``session_id`` (no records yet; its
        metadata may come after: a host stores it last, so that a fork whose copy failed
        is no session), the records of ``source_id`` with ``seq <= through_seq`` (None:
        all of them; 0: none): the same numbered traces, each record moved to
        ``session_id``, made durable. Returns the seq the fork ends at. Appending for it
        then needs :meth:`load`, which continues after it. Raises ``StoredSessionMissing``
        for an unknown source and ``SeqRefused`` when ``through_seq`` is past its last
        record; nothing is stored then."""
        ...

    def location(self, session_id: str) -> Path:
        """Where the session's current trace is, for people (a file's path)."""
        ...

    def trace_number(self, session_id: str) -> int:
        """The number of the session's current trace."""
        ...

    def largest_input(self) -> int | None:
        """The most bytes of a client's input
        (:func:`~greenroom.protocols.trace.input_size`) one record may hold, or None when
        a record has no limit (a file). The session refuses larger input when it is given
        (:class:`~greenroom.protocols.errors.InputTooLarge`) and delivers queued steering
        a record at a time within it (R-STEER-2)."""
        ...

    def release(self, session_id: str) -> None:
        """The host closed the session: forget what the log keeps in memory for it
        (appending again needs :meth:`load`). Its stored records stay."""
        ...


class UsageLedger(Protocol):
    """The host's usage ledger (R-TRACE-5): the raw data for cost reports.

    A ledger that writes its rows later may also offer ``async def commit()``, which
    returns once every row recorded before it is durable: the runtime waits for it
    before a stream's first events are handed on, so that a host that dies after a
    client saw them leaves the request's ``started`` row (R-SHARE-3). Without it,
    :meth:`record_usage` is taken as durable when it returns."""

    def record_usage(self, row: UsageRow) -> None:
        """Add a row — or, when a row of the same ``request_key`` is stored already (the
        ``started`` row of a request whose end this is), replace that one: one row a
        request, its last usage (rows without a key are always added). Never blocks; never
        raises for I/O (a ledger that cannot be written is reported by ``log.sync()``).
        Raises ``TraceSinkClosed`` once the store is closed."""
        ...

    async def totals(self, session_id: str | None = None) -> dict[str, dict[str, int]]:
        """Token totals per session over every row recorded so far:
        ``{session_id: {input, output, cache_read, cache_write, total, requests,
        compaction_failures, titles}}`` (only ``session_id``'s with it; a session without
        rows is absent)."""
        ...

    async def report(self, query: UsageQuery) -> list[UsageLine]:
        """The rows recorded so far that ``query`` covers, added up per group with their
        cost, as :func:`~greenroom.protocols.trace.summarize_usage` defines it (the
        ``greenroom usage`` report; a budget's spending since a point in time)."""
        ...


class TraceStore(Protocol):
    """The storage of one host's sessions: its three parts and their one lifetime.

    Lifetime: an actor — ``await nursery.start(store.run)``, ready when that returns;
    :meth:`aclose` flushes and makes everything durable, then ``run`` ends.
    """

    @property
    def catalog(self) -> SessionCatalog:
        """The sessions and their metadata."""
        ...

    @property
    def log(self) -> TraceLog:
        """The sessions' traces."""
        ...

    @property
    def ledger(self) -> UsageLedger:
        """The usage ledger."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`aclose` (or cancellation, which flushes first)."""
        ...

    async def aclose(self) -> None:
        """Stop accepting appends, make everything durable, end :meth:`run`. Idempotent."""
        ...


TraceStoreFactory = Callable[[Path], TraceStore]
"""Builds a host's trace store from its data dir (``Host.open(trace_store=…)``)."""


# -- the file backend --------------------------------------------------------------------


class FileTraceStore:
    """The default :class:`TraceStore`: ``<data_dir>/sessions/<id>/`` with ``session.json``
    and ``trace_NNN.jsonl`` files (:class:`FileSessionCatalog`, :class:`FileTraceLog`) and
    ``<data_dir>/usage.sqlite`` (:class:`FileUsageLedger`), all written through one
    :class:`TraceSink`: records are appended from the session's own task, and its actor
    groups the fsyncs and keeps the ledger. Every record and ``session.json`` goes through
    ``disk`` (the real one unless a test's: :mod:`~greenroom.actors.runtime.disk`)."""

    def __init__(self, data_dir: Path, *, disk: Disk = DISK) -> None:
        self.data_dir = data_dir
        self.disk = disk
        self.paths = SessionStore(data_dir)
        self.sink = TraceSink(data_dir, disk=disk)
        """The writer of the files (its batch counters are what tests observe)."""
        self.log = FileTraceLog(self.paths, self.sink)
        self.catalog = FileSessionCatalog(self.paths, self.log)
        self.ledger = FileUsageLedger(self.sink)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the sink; ready when its ledger is open."""
        await self.sink.run(task_status=task_status)

    async def aclose(self) -> None:
        """Close the sink: flush, fsync, end ``run``; then let go of every session's writer
        lock (the sessions a host closes with it are written no more)."""
        try:
            await self.sink.aclose()
        finally:
            self.log.let_go_all()


class FileSessionCatalog:
    """The :class:`SessionCatalog` of a data dir: one directory per session with its
    ``session.json`` (0600, replaced atomically) and ``scratch/`` (0700)."""

    def __init__(self, paths: SessionStore, log: FileTraceLog) -> None:
        self.paths = paths
        self._log = log
        self._disk = log.disk

    async def create(self, session_id: str, meta: dict[str, Any]) -> None:
        """Write ``session.json`` in a new 0700 session directory; :class:`SessionExists`
        when the directory already holds one (a stored session is never written over)."""
        directory = self.paths.session_dir(session_id)
        if not await trio.to_thread.run_sync(_write_new_meta, self._disk, directory, meta):
            raise SessionExists(f"a session {session_id!r} is stored in {self.paths.data_dir}")

    async def read_meta(self, session_id: str) -> dict[str, Any]:
        """``session.json``, checked (see :func:`read_meta_file`)."""
        path = self.paths.meta_path(session_id)
        try:
            return await trio.to_thread.run_sync(read_meta_file, path, self._disk)
        except FileNotFoundError:
            raise StoredSessionMissing(
                f"no session {session_id!r} in {self.paths.data_dir}"
            ) from None

    async def exists(self, session_id: str) -> bool:
        """Whether ``session.json`` is there."""
        return await trio.Path(self.paths.meta_path(session_id)).exists()

    async def list_sessions(self) -> list[StoredSession]:
        """Every ``sessions/*/session.json``, read in one worker thread."""
        return await trio.to_thread.run_sync(_scan, self.paths.sessions_dir, self._disk)

    async def delete(self, session_id: str) -> None:
        """Remove the session's directory, once the log has made its last records durable
        and forgotten it."""
        await self._log.discard(session_id)
        await trio.to_thread.run_sync(
            shutil.rmtree, self.paths.session_dir(session_id), True
        )


@attrs.define
class _Position:
    """What the file log knows of one session's trace."""

    number: int
    next_seq: int
    path: Path


class FileTraceLog:
    """The :class:`TraceLog` of a data dir: ``trace_001.jsonl``, ``trace_002.jsonl``, … in
    each session's directory, appended and fsynced by the :class:`TraceSink`."""

    def __init__(self, paths: SessionStore, sink: TraceSink) -> None:
        self.paths = paths
        self.sink = sink
        self.disk = sink.disk
        self._positions: dict[str, _Position] = {}
        self._writing: dict[str, int] = {}
        """The lock (:data:`WRITER_LOCK_FILE`) held on each session this log writes."""
        self._cut_short: dict[str, trio.Event] = {}
        """Sessions whose close was cut short, kept until their work can write no more
        (:meth:`cut_short`); set as the log lets them go."""
        self._warned_unlocked = False

    def start(self, session_id: str) -> None:
        """Appends go to ``trace_001.jsonl`` from ``seq`` 1."""
        self._hold(session_id)
        self._positions[session_id] = _Position(
            number=1, next_seq=1, path=self.paths.trace_path(session_id, 1)
        )

    async def load(self, session_id: str) -> LoadedTrace:
        """Tighten the directory's modes, read the latest trace file. Raises
        :class:`SessionOpenElsewhere` while another log writes the session. A session
        whose close was cut short is loaded once its work has ended and it was let go
        (:meth:`cut_short`): its trace then holds all that work wrote, and it has one
        writer."""
        while (cut := self._cut_short.get(session_id)) is not None:
            await cut.wait()
            if self.sink.closed:  # woken by the store's close: its locks are let go
                raise TraceSinkClosed(f"the trace store closed; cannot load {session_id}")
        directory = self.paths.session_dir(session_id)
        await trio.to_thread.run_sync(_tighten_session_dir, directory)
        await trio.to_thread.run_sync(self._hold, session_id)
        try:
            loaded, path = await trio.to_thread.run_sync(self._latest, session_id)
        except BaseException:
            if session_id not in self._positions:
                self._let_go(session_id)
            raise
        self._positions[session_id] = _Position(
            number=loaded.number, next_seq=loaded.last_seq + 1, path=path
        )
        return loaded

    async def read_latest(self, session_id: str) -> LoadedTrace:
        """The latest trace file, read in a worker thread."""
        loaded, _ = await trio.to_thread.run_sync(self._latest, session_id)
        return loaded

    def _latest(self, session_id: str) -> tuple[LoadedTrace, Path]:
        path = latest_trace_file(self.paths.session_dir(session_id))
        if path is None:
            empty = LoadedTrace(records=(), errors=(), number=1, last_seq=0)
            return empty, self.paths.trace_path(session_id, 1)
        number = trace_file_number(path.name) or 1
        result = read_trace(path, disk=self.disk)
        errors = tuple(str(e) for e in result.errors)
        while not result.records and number > 1:
            # A rotation creates the new file, then writes its first record
            # (compaction_end): a crash in between leaves it empty or holding half of
            # that record. The compaction did not happen; the previous file, which ends
            # in its compaction_begin, is still the context, so the open task is taken
            # up as a compaction in flight and seq goes on after that file's last
            # (R-TRACE-1, R-TRACE-4, R-COMPACT-8). Nothing here changes a file: the next
            # rotation appends to the newer one again, after ending a torn line.
            previous = self.paths.trace_path(session_id, number - 1)
            try:
                earlier = read_trace(previous, disk=self.disk)
            except FileNotFoundError:
                break  # no older context to go back to: the newest file is all there is
            number, path, result = number - 1, previous, earlier
            errors = (*(str(e) for e in earlier.errors), *errors)  # in file order
        _check_older_traces(self.paths.session_dir(session_id), number, self.disk)
        loaded = LoadedTrace(
            records=tuple(result.records),
            errors=errors,
            number=number,
            last_seq=max((r.seq or 0 for r in result.records), default=0),
        )
        return loaded, path

    async def read_after(self, session_id: str, after_seq: int = 0) -> list[Output]:
        """Every trace file's records after ``after_seq``, oldest file first. A file that
        cannot be read raises its OSError: what reads the history rebuilds from it, and
        a history without that file's records would be taken as the whole one."""
        directory = self.paths.session_dir(session_id)
        return await trio.to_thread.run_sync(
            lambda: read_session_records(
                directory, after_seq=after_seq, on_unreadable=_refuse_unreadable, disk=self.disk
            )
        )

    def append(self, session_id: str, seq: int, line: str) -> int:
        """Buffer the record in the sink (see :meth:`TraceLog.append`)."""
        position = self._position(session_id)
        if seq < position.next_seq:
            raise StaleTraceWriter(
                position.path,
                f"record seq {seq} out of order: the trace already holds seq {seq} "
                f"(it expects {position.next_seq} or later)",
            )
        ticket = self.sink.write(position.path, line)
        position.next_seq = seq + 1
        return ticket

    def commit(self, session_id: str) -> bool:
        """Append the buffered lines of the current file now (no fsync)."""
        return self.sink.commit(self._position(session_id).path)

    def batch_done(self, ticket: int) -> bool:
        """True: the sink writes a file's records when they are committed, at once."""
        return True

    def when_batch_done(self, ticket: int, reply: trio.MemorySendChannel[TraceWritten]) -> None:
        """At once (see :meth:`batch_done`)."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            reply.send_nowait(TraceWritten(ticket=ticket))

    def lost(self, session_id: str, ticket: int) -> TraceWriteError | None:
        """None: a file gives no record up; its write and fsync failures are
        :meth:`sync`'s to report."""
        return None

    def error(self, session_id: str) -> TraceWriteError | None:
        """The sink's sticky error for the current file."""
        return self.sink.error(self._position(session_id).path)

    def clear_error(self, session_id: str) -> None:
        """Forget the current file's error."""
        self.sink.clear_error(self._position(session_id).path)

    async def sync(self, session_id: str | None = None) -> None:
        """Fsync the current file (every file, and the ledger, with None). A session closed
        meanwhile (a receipt's sync may start after) has its last file synced: the sink
        keeps a released file until what was written to it is durable."""
        await self.sink.sync(None if session_id is None else self.location(session_id))

    def rotate(self, session_id: str) -> str:
        """The next file, ``trace_<n+1>.jsonl``; seq numbers go on across files."""
        position = self._position(session_id)
        self.sink.release(position.path)
        position.number += 1
        position.path = self.paths.trace_path(session_id, position.number)
        return trace_file_name(position.number)

    async def fork(self, source_id: str, session_id: str, through_seq: int | None) -> int:
        """Copy the source's trace files up to ``through_seq`` (see :meth:`copy_prefix`)."""
        return (await self.copy_prefix(source_id, session_id, through_seq)).seq

    async def copy_prefix(
        self, source_id: str, session_id: str, through_seq: int | None
    ) -> CopiedPrefix:
        """:meth:`TraceLog.fork` for files: each of the source's trace files that starts
        at or before ``through_seq`` is copied under the same number, the last one cut
        after ``through_seq``, its lines moved to ``session_id`` as they are
        (:func:`~greenroom.protocols.trace.copy_records`: no record is decoded), then
        fsynced with the directory (made 0700 if new), in a worker thread. Returns the
        files written, for a log that also replicates them."""
        return await trio.to_thread.run_sync(
            _copy_prefix, self.paths, self.disk, source_id, session_id, through_seq
        )

    def location(self, session_id: str) -> Path:
        """The current trace file (of a session not open here: the latest one on disk)."""
        position = self._positions.get(session_id)
        if position is not None:
            return position.path
        latest = latest_trace_file(self.paths.session_dir(session_id))
        return latest or self.paths.trace_path(session_id, 1)

    def trace_number(self, session_id: str) -> int:
        """The current trace file's number."""
        return self._position(session_id).number

    def largest_input(self) -> int | None:
        """None: a trace file takes a record of any size."""
        return None

    def release(self, session_id: str) -> None:
        """Drop the session's trace position (a host that opens many sessions over its
        life keeps only the open ones'), and its writer's lock."""
        position = self._positions.pop(session_id, None)
        if position is not None:
            self.sink.release(position.path)
        self._let_go(session_id)

    def cut_short(self, session_id: str) -> trio.Event | None:
        """The host's close of the session was cut short (its caller was cancelled) while
        the session's ending work may still write its trace: the position and the writer
        lock stay until :meth:`release`, which comes once that work can write no more
        (``Session.aclose``). Until then a :meth:`load` of the session waits: a second
        position of it in this log would be a second writer, and the release would take
        its position and its lock from under it. Returns the event set once the log lets
        the session go (its release, or the store's close); None when it holds nothing of
        it."""
        if session_id not in self._positions:
            return None
        return self._cut_short.setdefault(session_id, trio.Event())

    async def discard(self, session_id: str) -> None:
        """The session is being deleted: make what was written for it durable (a failure
        is of no use any more), then forget it, in the sink too."""
        position = self._positions.pop(session_id, None)
        if position is not None:
            try:
                with contextlib.suppress(Exception):
                    await self.sink.sync(position.path)
            finally:
                # Cancelled or not, the position is gone: so is what the sink keeps of it.
                self.sink.forget(position.path)
        self._let_go(session_id)

    def _hold(self, session_id: str) -> None:
        """Take the session's writer lock (an exclusive ``flock`` on
        :data:`WRITER_LOCK_FILE` in its directory), kept until :meth:`release`: two hosts
        on one data dir — a server and ``greenroom approve``, say — would both append
        (one seq twice) and run a call each. Raises :class:`SessionOpenElsewhere` when
        another one holds it. A file system without locks is written as before, and the
        log says so once (:meth:`_unlocked`)."""
        if session_id in self._writing:
            return
        path = self.paths.session_dir(session_id) / WRITER_LOCK_FILE
        fd = _open_writer_lock(path)
        if fd is None:
            return  # no directory yet, or none we may write: nothing to share it with
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SessionOpenElsewhere(
                f"session {session_id} is open in another host on this data dir (another "
                "process?): answer, steer or run it through that host"
            ) from None
        except OSError as exc:
            os.close(fd)  # locks not supported here (some network file systems)
            self._unlocked(exc)
            return
        self._writing[session_id] = fd

    def _unlocked(self, exc: OSError) -> None:
        """A session is written without its lock: the host's log says so, once (every
        session of the data dir is then): nothing else tells its user that another host
        on the data dir would not be kept out."""
        if self._warned_unlocked:
            return
        self._warned_unlocked = True
        logger.warning(
            "data dir %s: its file system does not lock files (%s): sessions open in this "
            "host are written without their writer lock, so another host on the data dir "
            "is not kept from writing them too",
            self.paths.data_dir,
            exc.strerror or exc,
        )

    def let_go_all(self) -> None:
        """Let go of every session's writer lock: the store closes (its sink wrote all)."""
        for session_id in list(self._writing):
            self._let_go(session_id)
        for cut in self._cut_short.values():  # a load waiting for one goes on, and ends
            cut.set()
        self._cut_short.clear()

    def _let_go(self, session_id: str) -> None:
        fd = self._writing.pop(session_id, None)
        if fd is not None:
            os.close(fd)  # which drops the lock
        if (cut := self._cut_short.pop(session_id, None)) is not None:
            cut.set()

    def _position(self, session_id: str) -> _Position:
        position = self._positions.get(session_id)
        if position is None:
            # Only sessions this host created or loaded are written; anything else is a bug.
            raise KeyError(f"session {session_id!r} was not created or loaded in this store")
        return position


class FileUsageLedger:
    """The :class:`UsageLedger` in ``<data_dir>/usage.sqlite``: rows go to the sink's actor,
    which inserts them with its next batch (R-TRACE-5)."""

    def __init__(self, sink: TraceSink) -> None:
        self.sink = sink

    def record_usage(self, row: UsageRow) -> None:
        """Into the sink's SQLite ledger."""
        self.sink.record_usage(row)

    async def commit(self) -> None:
        """Return once every row recorded before the call is committed (or refused: that
        is reported by ``log.sync()``). Optional for a ledger (see :class:`UsageLedger`)."""
        await self.sink.flush_usage()

    async def totals(self, session_id: str | None = None) -> dict[str, dict[str, int]]:
        """The rows queued so far are inserted first (while the sink runs), then the
        ledger is read (:func:`~greenroom.actors.runtime.trace_sink.usage_totals`)."""
        await self.sink.flush_usage()
        path = self.sink.ledger_path
        return await trio.to_thread.run_sync(
            lambda: usage_totals(path, session_id=session_id)
        )

    async def report(self, query: UsageQuery) -> list[UsageLine]:
        """The rows queued so far are inserted first (while the sink runs), then the
        ledger is read (:func:`~greenroom.actors.runtime.trace_sink.usage_report`)."""
        await self.sink.flush_usage()
        path = self.sink.ledger_path
        return await trio.to_thread.run_sync(usage_report, path, query)


def _open_writer_lock(path: Path) -> int | None:
    """A descriptor of the lock file ``path`` (created if missing), or None where it cannot
    be opened (no directory, no permission). One that is not a regular file raises an
    OSError naming it: a directory or a link loop cannot be locked (the session would be
    written unlocked), a link is not followed (it could make a file anywhere), a FIFO is
    no lock file; opened ``O_NONBLOCK``, a FIFO is never waited on."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, PRIVATE_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path)) from None
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW's answer for a link, whatever it names
            raise OSError(errno.ELOOP, _LINK_WORDS, str(path)) from None
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, special_file_words(mode), str(path))
    return fd


_LINK_WORDS = "it is a symbolic link, not a regular file"


def _refuse_unreadable(path: Path, exc: OSError) -> None:
    if not isinstance(exc, FileNotFoundError):  # one gone since the listing: deleted
        raise exc


def _check_older_traces(directory: Path, below: int, disk: Disk) -> None:
    """Raise the OSError of the first trace file of ``directory`` numbered below ``below``
    that cannot be read (each checked, none read): a session is loaded from its latest
    trace, but a rewind into an earlier context, a history replayed to a client or a
    child's answer read later need the older ones, and would go on without them."""
    for entry in sorted(directory.iterdir()):
        number = trace_file_number(entry.name)
        if number is not None and number < below:
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                disk.check_readable(entry)


def _scan(root: Path, disk: Disk) -> list[StoredSession]:
    found: list[StoredSession] = []
    if not root.is_dir():
        return found
    for meta_path in root.glob(f"*/{SESSION_FILE}"):
        session_id = meta_path.parent.name
        try:
            meta = read_meta_file(meta_path, disk)
            traces = list(meta_path.parent.glob("trace_*.jsonl"))
            # Each trace checked, none read: one that cannot be read makes the session
            # unreadable (loading it fails), said here rather than listed as usable.
            updated = max(
                (disk.check_readable(t).st_mtime for t in traces),
                default=meta_path.stat().st_mtime,
            )
        except FileNotFoundError:
            continue  # deleted while we looked
        except (StoredSessionUnreadable, OSError) as exc:
            found.append(
                StoredSession(
                    session_id=session_id,
                    meta=None,
                    problem=_problem(exc),
                    where=str(meta_path),
                    updated_at=0.0,
                    traces=0,
                )
            )
            continue
        found.append(
            StoredSession(
                session_id=session_id,
                meta=meta,
                problem=None,
                where=str(meta_path),
                updated_at=updated,
                traces=len(traces),
            )
        )
    return found


@attrs.frozen(kw_only=True)
class CopiedPrefix:
    """What :meth:`FileTraceLog.copy_prefix` wrote: the fork's ``seq`` (its last record) and
    its trace files, each as (number, bytes)."""

    seq: int
    files: tuple[tuple[int, bytes], ...]


def _copy_prefix(
    paths: SessionStore, disk: Disk, source_id: str, session_id: str, through_seq: int | None
) -> CopiedPrefix:
    source = paths.session_dir(source_id)
    if not (source / SESSION_FILE).is_file():
        raise StoredSessionMissing(f"no session {source_id!r} in {paths.data_dir}")
    numbered = sorted(
        (number, entry)
        for entry in source.iterdir()
        if (number := trace_file_number(entry.name))
    )
    limit = through_seq if through_seq is not None else float("inf")
    copies: list[tuple[int, bytes]] = []
    last_seq = 0
    for number, path in numbered:
        copied = copy_records(
            disk.read(path),
            source_id=source_id,
            session_id=session_id,
            through_seq=through_seq if through_seq is not None else 1 << 62,
        )
        if copied.first_seq is not None and copied.first_seq > limit:
            break  # this trace and the later ones start after the fork point
        if copied.last_seq is not None:
            last_seq = copied.last_seq
            copies.append((number, copied.data))
    seq = last_seq if through_seq is None else through_seq
    if seq > last_seq or seq < 0:
        raise SeqRefused(
            f"seq {seq} is out of range: session {source_id!r} has records 0..{last_seq}"
        )
    target = paths.session_dir(session_id)
    disk.make_dir(target)
    tighten(target, PRIVATE_DIR_MODE)
    for number, data in copies:
        path = target / trace_file_name(number)
        disk.write(path, data)
        disk.fsync(path)
    disk.fsync(target)
    disk.fsync(target.parent)
    return CopiedPrefix(seq=seq, files=tuple(copies))


def _meta_text(meta: dict[str, Any]) -> str:
    """``session.json``'s text: a key a line. ``json.dumps(indent=…)`` would do it with the
    pure-Python encoder, whose closures are a cycle left to the cyclic collector for every
    session created."""
    rows = ",\n".join(f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in meta.items())
    return "{\n" + rows + "\n}\n"


def _write_new_meta(disk: Disk, directory: Path, meta: dict[str, Any]) -> bool:
    """Write a new session's ``session.json``, durable (fsynced, with the entries of the
    directories it is in) when this returns true; false, writing nothing, when there is
    one (a directory without it is what a creation that failed left, and is used). Two
    creators of one id, in two processes, cannot both succeed: the file is put in place
    only where there is none, in one step."""
    made_sessions_dir = not directory.parent.exists()
    directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    target = directory / SESSION_FILE
    if target.exists():
        return False
    tighten(directory, PRIVATE_DIR_MODE)
    disk.make_dir(directory / "scratch")
    # A name of its own, so that another creator of the same id never writes into it.
    tmp = directory / f"{SESSION_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        disk.write(tmp, _meta_text(meta).encode("utf-8"))
        tighten(tmp, PRIVATE_FILE_MODE)
        # Its content is durable before its name: a power cut leaves no empty session.json.
        disk.fsync(tmp)
        if not disk.place_new(tmp, target):
            return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    # The new name (and scratch/), then the directory's own entry (and the sessions
    # directory's, when it is new too): a created session survives a power cut, whether
    # or not it ever runs.
    try:
        disk.fsync(directory)
        disk.fsync(directory.parent)
        if made_sessions_dir:
            disk.fsync(directory.parent.parent)
    except BaseException:
        # A creation that failed leaves no session behind (the id stays free).
        with contextlib.suppress(OSError):
            target.unlink()
        raise
    return True


def _tighten_session_dir(directory: Path) -> None:
    """A stored session's directory, scratchpad and files made private (written before
    the host made them so); a missing one is left to the caller to report."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    tighten(directory, PRIVATE_DIR_MODE)
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_symlink():
                continue
            tighten(entry, PRIVATE_DIR_MODE if entry.is_dir() else PRIVATE_FILE_MODE)


def _problem(exc: BaseException) -> str:
    """Why a session is unreadable: an OSError as ``PATH: REASON``."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (for errors that name a file)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def read_meta_file(meta_path: Path, disk: Disk = DISK) -> dict[str, Any]:
    """A ``session.json``, checked (:func:`check_meta`). Raises FileNotFoundError when it
    is missing and :class:`StoredSessionUnreadable` otherwise. Blocking."""
    try:
        raw = disk.read(meta_path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoredSessionUnreadable(f"{meta_path}: {exc.strerror or exc}") from None
    return check_meta(raw, str(meta_path))


_META_FIELDS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("session_id", str),
    ("created_at", (int, float)),
    ("workspace_dir", str),
    ("settings", dict),
    ("parent_id", (str, type(None))),
    ("root_id", (str, type(None))),
)


def check_meta(raw: bytes, where: str) -> dict[str, Any]:
    """Stored session metadata (``session.json``'s bytes), checked for the shape every
    reader relies on: a JSON object (lone surrogates repaired) whose known fields have
    their types. Raises :class:`StoredSessionUnreadable` naming ``where`` and the reason.
    Every backend's catalog reads metadata through it."""
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise StoredSessionUnreadable(f"{where}: not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise StoredSessionUnreadable(f"{where}: not JSON: {one_line(exc)}") from None
    if not isinstance(meta, dict):
        raise StoredSessionUnreadable(
            f"{where}: expected a JSON object, got {type(meta).__name__}"
        )
    meta = cast(dict[str, Any], repair_json(meta))
    for key, kind in _META_FIELDS:
        if key in meta and (not isinstance(meta[key], kind) or isinstance(meta[key], bool)):
            raise StoredSessionUnreadable(
                f"{where}: {key}: wrong type {type(meta[key]).__name__}"
            )
    return meta
