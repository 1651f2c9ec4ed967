"""Where sessions are stored: the :class:`TraceStore` interface and its file backend.

A host keeps every session it creates in one trace store: the session's metadata (what
``session.json`` holds) and its trace — the traced outputs in ``seq`` order, one record
each (R-TRACE), split into numbered traces at compactions (R-COMPACT-8). The actors reach
storage only through this interface, so a second backend (the cluster's, on JetStream)
replaces the files without touching them.

The rules every backend keeps:

- **Appends are fenced by ``seq``.** :meth:`TraceStore.append` names the ``seq`` of the
  record; it must come after every ``seq`` the store holds for that session, or the append is
  refused with :class:`StaleTraceWriter`. A host that lost a session to another one can
  therefore not add to its trace (R-CLUSTER-1); in one process it catches a bug that would
  duplicate a record. (A record its writer could not encode leaves its ``seq`` unused.)
- **Publication waits for the write.** :meth:`TraceStore.commit` hands a session's appended
  records on at once when it can (a file: always, one ``write(2)`` in the caller's task);
  when it cannot (a store that acknowledges late), it returns False, and
  :meth:`TraceStore.when_batch_done` sends ``TraceWritten`` on the emitter's inbox once the
  ticket :meth:`TraceStore.append` returned is done. A session publishes an output only then
  (R-TRACE-3, R-RUN-8).
- **Durability on request.** :meth:`TraceStore.sync` returns once everything appended for
  the session is durable (a file: fsynced), at the points R-TRACE-2 names.
- **Failures are per session and sticky** (:meth:`TraceStore.error`, cleared by
  :meth:`TraceStore.clear_error`); no record and no I/O error ends the store or the host.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import trio

from greenroom.actors.runtime.disk import DISK, Disk
from greenroom.actors.runtime.errors import GreenroomError
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
    TraceWriteError,
    latest_trace_file,
    read_trace,
)
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Output
from greenroom.protocols.text import repair_json
from greenroom.protocols.trace import UsageRow, trace_file_name, trace_file_number

__all__ = [
    "FileTraceStore",
    "LoadedTrace",
    "StaleTraceWriter",
    "StoredSessionMissing",
    "StoredSessionUnreadable",
    "TraceStore",
    "TraceStoreFactory",
]


class StaleTraceWriter(TraceWriteError):
    """An append whose ``seq`` is not the next one the store expects for the session: the
    writer's picture of the trace is stale (another host owns the session now, or a bug)."""


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


class TraceStore(Protocol):
    """The storage of one host's sessions; see the module docstring for the rules.

    Lifetime: an actor — ``await nursery.start(store.run)``, ready when that returns;
    :meth:`aclose` flushes and makes everything durable, then ``run`` ends.
    """

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`aclose` (or cancellation, which flushes first)."""
        ...

    async def aclose(self) -> None:
        """Stop accepting appends, make everything durable, end :meth:`run`. Idempotent."""
        ...

    async def create(self, session_id: str, meta: dict[str, Any]) -> None:
        """Store a new session's metadata; its trace starts empty at number 1."""
        ...

    async def read_meta(self, session_id: str) -> dict[str, Any]:
        """A stored session's metadata, checked for the shape readers rely on. Raises
        :class:`StoredSessionMissing` or :class:`StoredSessionUnreadable`."""
        ...

    async def exists(self, session_id: str) -> bool:
        """Whether the store holds session ``session_id``."""
        ...

    async def load(self, session_id: str) -> LoadedTrace:
        """The session's latest trace; from now on appends for it continue after its
        ``last_seq``."""
        ...

    async def read_after(self, session_id: str, after_seq: int = 0) -> list[Output]:
        """Every traced output with ``seq > after_seq``, across the session's traces,
        in order (replay for a client that reconnects: R-GW)."""
        ...

    async def delete(self, session_id: str) -> None:
        """Remove the session: metadata, traces and local files."""
        ...

    def release(self, session_id: str) -> None:
        """The host closed the session: forget what the store keeps in memory for it
        (appending again needs :meth:`load`). Its stored data stays."""
        ...

    def location(self, session_id: str) -> Path:
        """Where the session's current trace is, for people (a file's path)."""
        ...

    def trace_number(self, session_id: str) -> int:
        """The number of the session's current trace."""
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

    def record_usage(self, row: UsageRow) -> None:
        """Add a row to the usage ledger (R-TRACE-5). Never blocks."""
        ...


TraceStoreFactory = Callable[[Path], TraceStore]
"""Builds a host's trace store from its data dir (``Host.open(trace_store=…)``)."""


@attrs.define
class _Position:
    """What the file store knows of one session's trace."""

    number: int
    next_seq: int
    path: Path


class FileTraceStore:
    """The default :class:`TraceStore`: ``<data_dir>/sessions/<id>/`` with ``session.json``
    and ``trace_NNN.jsonl`` files, through one :class:`TraceSink`: records are appended
    from the session's own task, and its actor groups the fsyncs and keeps the SQLite
    usage ledger. Every byte goes through ``disk`` (the real one unless a test's)."""

    def __init__(self, data_dir: Path, *, disk: Disk = DISK) -> None:
        self.data_dir = data_dir
        self.disk = disk
        self.paths = SessionStore(data_dir)
        self.sink = TraceSink(data_dir, disk=disk)
        """The writer of the files (its batch counters are what tests observe)."""
        self._positions: dict[str, _Position] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the sink; ready when its ledger is open."""
        await self.sink.run(task_status=task_status)

    async def aclose(self) -> None:
        """Close the sink: flush, fsync, end ``run``."""
        await self.sink.aclose()

    # -- sessions -----------------------------------------------------------------------

    async def create(self, session_id: str, meta: dict[str, Any]) -> None:
        """Write ``session.json`` (0600, atomically) in a new 0700 session directory."""
        directory = self.paths.session_dir(session_id)
        await trio.to_thread.run_sync(_write_meta, self.disk, directory, meta)
        self._positions[session_id] = _Position(
            number=1, next_seq=1, path=self.paths.trace_path(session_id, 1)
        )

    async def read_meta(self, session_id: str) -> dict[str, Any]:
        """``session.json``, checked (see :func:`read_meta_file`)."""
        path = self.paths.meta_path(session_id)
        try:
            return await trio.to_thread.run_sync(read_meta_file, path, self.disk)
        except FileNotFoundError:
            raise StoredSessionMissing(
                f"no session {session_id!r} in {self.data_dir}"
            ) from None

    async def exists(self, session_id: str) -> bool:
        """Whether ``session.json`` is there."""
        return await trio.Path(self.paths.meta_path(session_id)).exists()

    async def load(self, session_id: str) -> LoadedTrace:
        """Tighten the directory's modes, read the latest trace file."""
        directory = self.paths.session_dir(session_id)
        await trio.to_thread.run_sync(_tighten_session_dir, directory)
        path = await trio.to_thread.run_sync(latest_trace_file, directory)
        if path is None:
            loaded = LoadedTrace(records=(), errors=(), number=1, last_seq=0)
            path = self.paths.trace_path(session_id, 1)
        else:
            result = await trio.to_thread.run_sync(read_trace, path)
            loaded = LoadedTrace(
                records=tuple(result.records),
                errors=tuple(str(e) for e in result.errors),
                number=trace_file_number(path.name) or 1,
                last_seq=max((r.seq or 0 for r in result.records), default=0),
            )
        self._positions[session_id] = _Position(
            number=loaded.number, next_seq=loaded.last_seq + 1, path=path
        )
        return loaded

    async def read_after(self, session_id: str, after_seq: int = 0) -> list[Output]:
        """Every trace file's records after ``after_seq``, oldest file first; a file that
        cannot be read is skipped."""
        directory = self.paths.session_dir(session_id)
        return await trio.to_thread.run_sync(
            lambda: read_session_records(directory, after_seq=after_seq)
        )

    async def delete(self, session_id: str) -> None:
        """Remove the session's directory (after its last records were synced)."""
        position = self._positions.pop(session_id, None)
        if position is not None:
            with contextlib.suppress(Exception):
                await self.sink.sync(position.path)
        await trio.to_thread.run_sync(
            shutil.rmtree, self.paths.session_dir(session_id), True
        )
        if position is not None:
            self.sink.forget(position.path)

    def release(self, session_id: str) -> None:
        """Drop the session's trace position (a host that opens many sessions over its
        life keeps only the open ones')."""
        position = self._positions.pop(session_id, None)
        if position is not None:
            self.sink.release(position.path)

    def location(self, session_id: str) -> Path:
        """The current trace file (of a released session: the latest one on disk)."""
        position = self._positions.get(session_id)
        if position is not None:
            return position.path
        latest = latest_trace_file(self.paths.session_dir(session_id))
        return latest or self.paths.trace_path(session_id, 1)

    def trace_number(self, session_id: str) -> int:
        """The current trace file's number."""
        return self._position(session_id).number

    # -- the trace ----------------------------------------------------------------------

    def append(self, session_id: str, seq: int, line: str) -> int:
        """Buffer the record in the sink (see :meth:`TraceStore.append`)."""
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

    def error(self, session_id: str) -> TraceWriteError | None:
        """The sink's sticky error for the current file."""
        return self.sink.error(self._position(session_id).path)

    def clear_error(self, session_id: str) -> None:
        """Forget the current file's error."""
        self.sink.clear_error(self._position(session_id).path)

    async def sync(self, session_id: str | None = None) -> None:
        """Fsync the current file (every file with None)."""
        await self.sink.sync(None if session_id is None else self._position(session_id).path)

    def rotate(self, session_id: str) -> str:
        """The next file, ``trace_<n+1>.jsonl``; seq numbers go on across files."""
        position = self._position(session_id)
        self.sink.release(position.path)
        position.number += 1
        position.path = self.paths.trace_path(session_id, position.number)
        return trace_file_name(position.number)

    def record_usage(self, row: UsageRow) -> None:
        """Into the sink's SQLite ledger."""
        self.sink.record_usage(row)

    def _position(self, session_id: str) -> _Position:
        position = self._positions.get(session_id)
        if position is None:
            # Only sessions this host created or loaded are written; anything else is a bug.
            raise KeyError(f"session {session_id!r} was not created or loaded in this store")
        return position


def _write_meta(disk: Disk, directory: Path, meta: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    tighten(directory, PRIVATE_DIR_MODE)
    disk.make_dir(directory / "scratch")
    tmp = directory / (SESSION_FILE + ".tmp")
    disk.write(tmp, json.dumps(meta, indent=2).encode("utf-8"))
    tighten(tmp, PRIVATE_FILE_MODE)
    disk.replace(tmp, directory / SESSION_FILE)


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


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (for errors that name a file)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def read_meta_file(meta_path: Path, disk: Disk = DISK) -> dict[str, Any]:
    """A ``session.json``, checked for the shape every reader relies on. Raises
    FileNotFoundError when it is missing and :class:`StoredSessionUnreadable` otherwise.
    Blocking."""
    try:
        raw = disk.read(meta_path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoredSessionUnreadable(f"{meta_path}: {exc.strerror or exc}") from None
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise StoredSessionUnreadable(f"{meta_path}: not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise StoredSessionUnreadable(f"{meta_path}: not JSON: {one_line(exc)}") from None
    if not isinstance(meta, dict):
        raise StoredSessionUnreadable(
            f"{meta_path}: expected a JSON object, got {type(meta).__name__}"
        )
    meta = cast(dict[str, Any], repair_json(meta))
    expected: tuple[tuple[str, type | tuple[type, ...]], ...] = (
        ("session_id", str),
        ("created_at", (int, float)),
        ("workspace_dir", str),
        ("settings", dict),
        ("parent_id", (str, type(None))),
    )
    for key, kind in expected:
        if key in meta and (not isinstance(meta[key], kind) or isinstance(meta[key], bool)):
            raise StoredSessionUnreadable(
                f"{meta_path}: {key}: wrong type {type(meta[key]).__name__}"
            )
    return meta
