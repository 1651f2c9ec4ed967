"""Trace files and the usage ledger: appends in the writer's task, fsyncs by the TraceSyncer.

One sink per Host, shared by all its sessions. Sessions hand it finished lines
(:func:`greenroom.protocols.trace.encode_record`) with :meth:`TraceSink.write`, which only
appends to an in-memory buffer, and ask for durability with :meth:`TraceSink.sync` at the
points R-TRACE-2 names (turn boundaries, before a tool with side effects starts).

A session publishes a traced output only once its record is *written*: handed to the
operating system (``write(2)`` returned), so that it survives the death of the process —
SIGKILL, a crash — though not yet a power cut, which only the fsyncs cover.
:meth:`TraceSink.commit` does that append in the calling task (one small append to the
page cache, no fsync), so publication never waits for another task and a client never sees
a record that a crash of the host can still take out of the trace (R-RUN-8). Only the
fsyncs and the ledger are the :class:`TraceSyncer` actor's: :meth:`TraceSink.sync` sends
it a :class:`~greenroom.protocols.messages.SyncTraceFiles` (the files written since their
last fsync, with the directories created for them) and waits for its answer, and
:meth:`TraceSink.record_usage` sends a :class:`~greenroom.protocols.messages.LedgerRow`.
The actor serves every request waiting in its inbox with one worker-thread batch (group
commit), and answers each as soon as its own files are durable; a file's ``write(2)`` and
another file's fsync never wait for each other.

Exceptions (the public tree)::

    Exception
    ├── TraceSinkClosed   write() or record_usage() after the sink was closed (our own doing)
    └── TraceWriteError   a file or the ledger could not be written (disk full, permission, …)

No record and no I/O error ends the sink or the host: a line that cannot be encoded is
refused by :meth:`TraceSink.write` (ValueError, before it is buffered), a failure to append
(whatever it is) and an fsync the disk refuses (an OSError) are recorded for that file
while the others go on. The failure is sticky per file (lines were lost, the file has a
hole): every later ``sync(path)`` for that file, and every ``sync()``, raises
:class:`TraceWriteError` until :meth:`TraceSink.clear_error` acknowledges it. Ledger
failures, whatever they are (SQLite refusing a row included), are reported the same way
under the ledger's path. Anything else that goes wrong in the actor's batch — an fsync
raising something that is not an OSError: a bug in the writer or the disk below it — stops
the actor: it answers every waiting sync with the failure, and the sink closes. Once the
sink is closed (or its actor has stopped), ``sync`` raises :class:`TraceSinkClosed`:
nothing written after that point can be made durable.

Every append and fsync goes through one :class:`~greenroom.actors.runtime.disk.Disk` (the
real one unless the sink is given another: a test's disk that refuses or stalls).

The sink keeps a file it appends to open between its commits (at most
:func:`most_open_trace_files` of them, the least recently written closed first): a task's
records are a dozen small appends, and opening and closing the file for each cost more
than the write itself while many sessions run. A file is closed when its session is
closed, deleted or moves to its next file, when an append to it fails, and when the sink
closes. The fsyncs open the file by its path in their worker thread.

Files and modes: trace files and the ledger are created 0600 (they hold tool output such
as file contents), directories the sink creates 0700.

Usage-ledger table ``usage`` in ``<data_dir>/usage.sqlite``: ``id, at, session_id, run_id,
turn, kind, provider, model, input, output, cache_read, cache_write, total, status,
error_message, cost_usd, principal, root_id, request_key, estimated`` (see
:class:`greenroom.protocols.trace.UsageRow`). The last five came later (cost accounting,
R-SHARE-3; the request's key of a ``started`` row, unique where set; 1 where the usage is
the runtime's estimate of the request's input): opening an older ledger adds them (``ALTER
TABLE``; its rows keep NULL there, an unknown cost), and the readers take a ledger that
was never opened since as having NULL in them.
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, assert_never

import attrs
import trio

from greenroom.actors.runtime.disk import DISK, PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, Disk
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.messages import (
    LedgerRow,
    SyncTraceFiles,
    TraceErrorAcknowledged,
    TraceFilesSynced,
    TraceSinkMessage,
)
from greenroom.protocols.trace import (
    STARTED,
    TraceReadResult,
    UsageLine,
    UsageQuery,
    UsageRow,
    parse_trace,
    trace_file_number,
)

__all__ = [
    "LEDGER_FILE_NAME",
    "MOST_OPEN_TRACE_FILES",
    "LedgerUnusable",
    "TraceSink",
    "TraceSinkClosed",
    "TraceSyncer",
    "TraceWriteError",
    "latest_trace_file",
    "most_open_trace_files",
    "read_trace",
    "usage_report",
    "usage_totals",
]

LEDGER_FILE_NAME = "usage.sqlite"

MOST_OPEN_TRACE_FILES = 4096
"""The most trace files a sink keeps open for appending, whatever the process may open."""


def most_open_trace_files() -> int:
    """How many trace files a sink keeps open: an eighth of the process's soft limit on
    open files (the rest is the sessions' connections, tools and listeners), at most
    :data:`MOST_OPEN_TRACE_FILES`; 0 (every append opens its file) where there is no
    such limit to read."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return MOST_OPEN_TRACE_FILES
    return max(0, min(MOST_OPEN_TRACE_FILES, soft // 8))


_USAGE_COLUMNS = (
    "at",
    "session_id",
    "run_id",
    "turn",
    "kind",
    "provider",
    "model",
    "input",
    "output",
    "cache_read",
    "cache_write",
    "total",
    "status",
    "error_message",
    "cost_usd",
    "principal",
    "root_id",
    "request_key",
    "estimated",
)
_ADDED_COLUMNS = (
    ("cost_usd", "REAL"),
    ("principal", "TEXT"),
    ("root_id", "TEXT"),
    ("request_key", "TEXT"),
    ("estimated", "INTEGER"),
)
"""Columns an older ledger lacks (cost accounting, then the rows written as a request
starts, then estimates), with their types (all NULL-able)."""
_CREATE_USAGE = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    session_id TEXT NOT NULL,
    run_id TEXT,
    turn INTEGER,
    kind TEXT NOT NULL CHECK (kind IN ('request', 'compaction_failed', 'title')),
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    input INTEGER NOT NULL DEFAULT 0,
    output INTEGER NOT NULL DEFAULT 0,
    cache_read INTEGER NOT NULL DEFAULT 0,
    cache_write INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0,
    status TEXT,
    error_message TEXT,
    cost_usd REAL,
    principal TEXT,
    root_id TEXT,
    request_key TEXT,
    estimated INTEGER
)
"""
_INSERT_USAGE = (
    f"INSERT INTO usage ({', '.join(_USAGE_COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in _USAGE_COLUMNS)}) "
    # A request's last row replaces the one written as it started (same key); rows
    # without a key never conflict (NULLs are distinct in a unique index).
    "ON CONFLICT (request_key) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _USAGE_COLUMNS if c != "request_key")
)


class TraceSinkClosed(Exception):
    """The sink was closed (by its owner) and accepts no more lines or usage rows."""


class LedgerUnusable(ConfigurationError):
    """The usage ledger cannot be opened — a damaged file, or one the host may not use —
    so the host does not open; the message names the file, why, and what to do."""


class TraceWriteError(Exception):
    """Lines for ``path`` (a trace file, or the usage ledger) could not be written or synced.

    Some lines were lost; ``message`` says why (the operating system's error).
    """

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"cannot write {path}: {message}")
        self.path = path
        self.message = message


@attrs.frozen(kw_only=True, slots=True)
class _BatchJob:
    """What one worker-thread call does. Plain data: the thread never touches the sink."""

    fsync: dict[Path, frozenset[Path]]
    """Files to fsync -> directories whose entries they changed (fsynced with them)."""
    usage: list[UsageRow]
    close_ledger: bool
    groups: tuple[tuple[Path, ...], ...] = ()
    """The files of each request of the batch, in the order they came (none: one group of
    every file)."""
    synced: Callable[[int, dict[Path, str]], None] | None = None
    """Told, from a worker thread, as soon as ``groups[i]``'s files and their directories
    are durable, with their failures: the caller answers that request at once instead of
    when the whole batch ends. Never called for a group with no files."""


@attrs.frozen(kw_only=True, slots=True)
class _BatchResult:
    errors: dict[Path, str]
    ledger_error: str | None


class TraceSink:
    """Append-only JSONL trace files and the SQLite usage ledger of one Host.

    The handle sessions use (through the trace store) and the actor behind it:

    - **Appending is the caller's own I/O.** :meth:`write` buffers a line, :meth:`commit`
      hands a file's buffered lines to the operating system from the calling task (one
      ``write(2)``, no fsync): publication never waits for another task.
    - **Durability is a message.** :meth:`sync` sends :class:`SyncTraceFiles` (the files
      written since their last fsync, and the new directories) to the :class:`TraceSyncer`
      actor's inbox and waits for its :class:`TraceFilesSynced`; :meth:`record_usage`
      sends a :class:`LedgerRow`. The actor groups whatever waits in its inbox into one
      worker-thread batch (group commit), whose fsyncs overlap (:data:`SYNC_THREADS`);
      each request is answered as soon as its own files are durable (one that covers the
      ledger, once the batch has inserted its rows).

    Lifetime: ``await nursery.start(sink.run)``; the sink is ready (ledger opened) when that
    returns. It ends either by :meth:`aclose` or by cancelling ``run``; both write every
    buffered line and usage row and fsync every file before ``run`` returns (shielded,
    bounded by ``close_timeout`` seconds). After that, :meth:`write` and
    :meth:`record_usage` raise :class:`TraceSinkClosed`.
    """

    def __init__(
        self,
        data_dir: Path | str,
        *,
        ledger_path: Path | str | None = None,
        close_timeout: float = 5.0,
        disk: Disk = DISK,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.ledger_path = (
            Path(ledger_path) if ledger_path is not None else self.data_dir / LEDGER_FILE_NAME
        )
        self.close_timeout = close_timeout
        self.disk = disk
        """Where the files are written and fsynced (the real disk unless a test's)."""
        self.syncer = TraceSyncer(self.ledger_path, close_timeout=close_timeout, disk=disk)
        """The actor that fsyncs and keeps the ledger (its batch count is what tests see)."""
        # Unbounded: sessions send with send_nowait and must never block on the sink; a
        # session has at most a sync or two and a usage row per request in it.
        self._inbox, self._inbox_receive = trio.open_memory_channel[TraceSinkMessage](math.inf)
        self._buffers: dict[Path, list[bytes]] = {}
        # Per file: how many commits wrote to it, and how many of those are known durable.
        self._written: dict[Path, int] = {}
        self._durable: dict[Path, int] = {}
        # Directories created for a file since its last fsync: their entries are synced with it.
        self._new_dirs: dict[Path, frozenset[Path]] = {}
        # Files whose last write was ours and whole: they end in a newline, so a commit
        # appends without the torn-tail check or the directory checks.
        self._clean_tails: set[Path] = set()
        # Descriptors of clean-tailed files kept open between commits, least recently
        # written first (a dict keeps its order: a write moves its file to the end).
        self._appending: dict[Path, int] = {}
        self._most_appending = most_open_trace_files()
        self._errors: dict[Path, TraceWriteError] = {}
        self._started = False
        self._closed = False
        self._finished = trio.Event()
        self._close_error: TraceWriteError | None = None

    @property
    def batches_written(self) -> int:
        """Worker-thread batches of the actor (one ``to_thread`` call each)."""
        return self.syncer.batches_written

    # -- lifetime ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actor. Signals ready once the ledger is open (its errors propagate).

        Returns after :meth:`aclose`; on cancellation it flushes, then lets Cancelled
        through. Either way everything written before the close is on disk when it ends
        (unless the disk fails or ``close_timeout`` runs out: then ``sync`` callers still
        waiting get :class:`TraceWriteError`). May be started once.
        """
        if self._started:
            raise RuntimeError("TraceSink.run may be started only once")
        self._started = True
        try:
            failure = await self.syncer.run(self._inbox_receive, task_status=task_status)
            if failure is not None:
                self._close_error = TraceWriteError(self.data_dir, failure)
        finally:
            self._closed = True
            with trio.CancelScope(shield=True):
                await self._final_flush()
            self._finished.set()

    async def aclose(self) -> None:
        """Stop accepting lines, flush and fsync everything, and wait for ``run`` to end.

        Idempotent. Safe to call before ``run`` was started (then nothing is written: the
        buffered lines are dropped). Cancel-safe: cancelling the caller does not stop the
        flush, which ``run`` completes.
        """
        if not self._started:
            self._closed = True
            self._close_appending()  # commits need no run: their descriptors are kept
            self._finished.set()
            await trio.lowlevel.checkpoint()
            return
        if not self._closed:
            self._closed = True
            self._commit_all()
            # The actor serves what is queued (usage rows included), then ends: its inbox
            # is closed. run's final flush fsyncs every file written since its last fsync.
            self._inbox.close()
        await self._finished.wait()

    # -- the API for sessions ---------------------------------------------------------------

    def write(self, path: Path, line: str) -> int:
        """Append ``line`` (one record ending in ``"\\n"``) to the file at ``path``; the
        line is handed to the OS by the next :meth:`commit` (or :meth:`sync`). Returns 1:
        the lines of every ticket are written once committed, which is at once.

        Synchronous and O(1): it encodes and buffers. Files are keyed by ``Path``
        equality, so give each file one spelling (``sync`` uses it). Never raises for
        I/O (failures surface from :meth:`sync` and :meth:`error`). Raises
        :class:`TraceSinkClosed` once the sink is closed, and ValueError for a line without
        its newline (it would merge with the next record) or one that UTF-8 cannot encode
        (a lone surrogate): such a line is not buffered, so it costs its caller that
        record and nothing else.
        """
        if self._closed:
            raise TraceSinkClosed(f"trace sink is closed; cannot write to {path}")
        if not line.endswith("\n"):
            raise ValueError("a trace line must end with a newline")
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"a trace line must be encodable as UTF-8: {exc.reason} at offset {exc.start}"
            ) from None
        buffer = self._buffers.get(path)
        if buffer is None:
            self._buffers[path] = [data]
        else:
            buffer.append(data)
        return 1

    def commit(self, path: Path) -> bool:
        """Hand the buffered lines of ``path`` to the operating system now, from the
        calling task: one append, no fsync (that is :meth:`sync`'s). Always True: no line
        is left unwritten (a failed write is reported by :meth:`error`). Never raises for
        I/O. Blocks the caller for one small append; a session calls it when it publishes
        a batch of outputs, so that no client sees a record before it is written.
        """
        lines = self._buffers.pop(path, None)
        if not lines:
            return True
        try:
            if path in self._clean_tails and self._append_known(path, lines):
                created: frozenset[Path] = frozenset()
            else:
                created = _append(self.disk, path, lines)
        except Exception as exc:
            self._errors[path] = TraceWriteError(path, _describe(exc))
            self._clean_tails.discard(path)
            self._stop_appending(path)
            return True
        self._clean_tails.add(path)
        self._written[path] = self._written.get(path, 0) + 1
        if created:
            self._new_dirs[path] = self._new_dirs.get(path, frozenset()) | created
        return True

    def error(self, path: Path) -> TraceWriteError | None:
        """The unacknowledged write failure of ``path`` (see :meth:`clear_error`), or the
        failure that stopped the sink; None if neither."""
        return self._errors.get(path) or self._close_error

    def record_usage(self, row: UsageRow) -> None:
        """Queue one usage-ledger row (R-TRACE-5); inserted with the actor's next batch.

        Never blocks, never raises for I/O (see :meth:`sync` with no path). Raises
        :class:`TraceSinkClosed` once the sink is closed.
        """
        if self._closed:
            raise TraceSinkClosed("trace sink is closed; cannot record usage")
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._inbox.send_nowait(LedgerRow(row=row))

    async def sync(self, path: Path | None = None) -> None:
        """Durability barrier: return once every line written to ``path`` before this call
        (with no path: every line of every file, and every usage row) is written, flushed
        and fsynced (R-TRACE-2).

        Concurrent callers share batches. Returns at once (after a checkpoint) when nothing
        is pending. Raises :class:`TraceWriteError` when a covered file has lost lines (the
        error is sticky until :meth:`clear_error`), and :class:`TraceSinkClosed` when the
        sink is closed or its actor has stopped: a return is a promise that the lines are
        on disk. A sync that was already waiting when the sink closed ends with the final
        flush and reports its outcome. Cancel-safe: a cancelled caller just stops waiting;
        the fsync it asked for still happens.
        """
        if self._closed:
            raise TraceSinkClosed("trace sink is closed; cannot make the trace durable")
        # Lines never wait for a sync: whatever is buffered, of any file, goes out now.
        self._commit_all()
        request = self._request(path, ledger=path is None)
        if request is None:
            await trio.lowlevel.checkpoint()
        else:
            answers, covered = request
            try:
                answer = await answers.receive()
            except trio.EndOfChannel:
                raise TraceSinkClosed("the trace sink stopped before the sync") from None
            self._take_answer(answer, covered)
        self._raise_errors(path)

    async def flush_usage(self) -> None:
        """Return once every usage row recorded before this call has been through the
        ledger (inserted, or refused: that is reported by ``sync()``), so that a reader of
        the ledger sees it. At once when the sink is closed: its rows were flushed then."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        # One slot: the actor's one answer never waits for this reader.
        reply, answers = trio.open_memory_channel[TraceFilesSynced](1)
        try:
            self._send(SyncTraceFiles(files=(), dirs=(), ledger=True, reply=reply))
        except TraceSinkClosed:
            await trio.lowlevel.checkpoint()
            return
        with contextlib.suppress(trio.EndOfChannel):
            await answers.receive()

    def clear_error(self, path: Path) -> None:
        """Acknowledge a file's write failure so ``sync`` stops raising it."""
        self._errors.pop(path, None)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._inbox.send_nowait(TraceErrorAcknowledged(path=str(path)))

    def release(self, path: Path) -> None:
        """The session of ``path`` was closed: forget what is kept for the file once
        nothing of it is left to write or fsync (a host that runs many sessions over its
        life keeps only the open ones')."""
        # Its last lines go out now, through the kept descriptor, which is then closed:
        # nothing is written to the file later to open it again.
        self.commit(path)
        self._stop_appending(path)
        if not self._unsynced(path):
            self.forget(path)

    def forget(self, path: Path) -> None:
        """``path`` is gone (its session was deleted): nothing of it is left to write or
        fsync."""
        for table in (self._buffers, self._written, self._durable, self._new_dirs):
            table.pop(path, None)
        self._clean_tails.discard(path)
        self._stop_appending(path)

    @property
    def errors(self) -> dict[Path, TraceWriteError]:
        """The unacknowledged write failures, by file (a copy)."""
        return dict(self._errors)

    @property
    def closed(self) -> bool:
        """Whether the sink is closed (then ``sync`` raises :class:`TraceSinkClosed`)."""
        return self._closed

    # -- internals ---------------------------------------------------------------------------

    def _commit_all(self) -> None:
        for path in list(self._buffers):
            self.commit(path)

    def _append_known(self, path: Path, lines: list[bytes]) -> bool:
        """Append to a file this sink wrote last (it ends in a newline), through its kept
        descriptor (opened now if it has none). False when the file is gone (then
        :func:`_append` creates it again)."""
        fd = self._appending.pop(path, None)
        if fd is not None and not self.disk.still_named(fd):
            # Removed or replaced under the sink (a delete cancelled before it forgot the
            # file, a trace a takeover wrote again): the lines go where the path is now.
            with contextlib.suppress(OSError):
                self.disk.close(fd)
            fd = None
        if fd is None:
            try:
                fd = self.disk.open_appending(path)
            except FileNotFoundError:
                return False
        try:
            self.disk.append_to(fd, path, b"".join(lines))
        except BaseException:
            with contextlib.suppress(OSError):
                self.disk.close(fd)
            raise
        if not self._most_appending:
            self.disk.close(fd)
            return True
        self._appending[path] = fd
        if len(self._appending) > self._most_appending:
            oldest = next(iter(self._appending))
            self._close_kept(oldest, self._appending.pop(oldest))
        return True

    def _stop_appending(self, path: Path) -> None:
        """Close the descriptor kept for ``path``, if any."""
        fd = self._appending.pop(path, None)
        if fd is not None:
            self._close_kept(path, fd)

    def _close_appending(self) -> None:
        """Close every kept descriptor (the sink is closing)."""
        while self._appending:
            path, fd = self._appending.popitem()
            self._close_kept(path, fd)

    def _close_kept(self, path: Path, fd: int) -> None:
        """Close a kept descriptor. A network file system may report a failed write only
        now: that is the file's failure, as it would have been its append's."""
        try:
            self.disk.close(fd)
        except OSError as exc:
            if path in self._written:
                self._errors[path] = TraceWriteError(path, _describe(exc))
                self._clean_tails.discard(path)

    def _unsynced(self, path: Path | None) -> dict[Path, int]:
        """Files written since their last known fsync -> the commit count to reach."""
        paths = self._written if path is None else [path] if path in self._written else []
        return {
            p: self._written[p] for p in paths if self._durable.get(p, 0) < self._written[p]
        }

    def _request(
        self, path: Path | None, *, ledger: bool
    ) -> tuple[trio.MemoryReceiveChannel[TraceFilesSynced], dict[Path, int]] | None:
        """Ask the actor to fsync what ``path`` (all with None) needs; None when nothing
        does. Raises :class:`TraceSinkClosed` when the actor no longer listens."""
        covered = self._unsynced(path)
        if not covered and not ledger:
            return None
        dirs = frozenset().union(*(self._new_dirs.get(p, frozenset()) for p in covered))
        # One slot: the actor's one answer never waits for this reader.
        reply, answers = trio.open_memory_channel[TraceFilesSynced](1)
        message = SyncTraceFiles(
            files=tuple(str(p) for p in covered),
            dirs=tuple(str(d) for d in sorted(dirs)),
            ledger=ledger,
            reply=reply,
        )
        self._send(message)
        return answers, covered

    def _send(self, message: SyncTraceFiles) -> None:
        try:
            self._inbox.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The actor has stopped (a bug, or the host is closing): nothing written from
            # now on could be made durable, so nothing more is accepted.
            self._closed = True
            self._close_error = self._close_error or TraceWriteError(
                self.data_dir, "the trace writer has stopped"
            )
            raise TraceSinkClosed("trace sink is closed; cannot make the trace durable") from None

    def _take_answer(self, answer: TraceFilesSynced, covered: dict[Path, int]) -> None:
        failed = {Path(p): why for p, why in answer.failures}
        for failed_path, why in failed.items():
            self._errors[failed_path] = TraceWriteError(failed_path, why)
        for path, count in covered.items():
            if path not in failed:
                self._durable[path] = max(self._durable.get(path, 0), count)
                self._new_dirs.pop(path, None)

    def _raise_errors(self, path: Path | None) -> None:
        if path is None:
            if self._errors:
                first = next(iter(self._errors.values()))
                if len(self._errors) == 1:
                    raise first
                names = ", ".join(str(p) for p in self._errors)
                raise TraceWriteError(first.path, f"{first.message} (failed files: {names})")
        else:
            error = self._errors.get(path)
            if error is not None:
                raise error
        if self._close_error is not None:
            raise self._close_error

    async def _final_flush(self) -> None:
        """Everything committed and not known durable is fsynced now (the actor has
        ended: cancellation, or a bug), bounded by ``close_timeout``."""
        self._commit_all()
        self._close_appending()
        covered = self._unsynced(None)
        if not covered:
            return
        job = _BatchJob(
            fsync={p: self._new_dirs.get(p, frozenset()) for p in covered},
            usage=[],
            close_ledger=False,
        )
        result: _BatchResult | None = None
        with trio.move_on_after(self.close_timeout):
            try:
                result = await trio.to_thread.run_sync(
                    _run_batch, job, None, self.disk, abandon_on_cancel=True
                )
            except Exception as exc:
                result = _failed_batch(job, f"the trace writer failed: {exc!r}")
        if result is None:
            self._close_error = TraceWriteError(
                self.data_dir, f"final flush did not finish within {self.close_timeout}s"
            )
            return
        self._take_answer(
            TraceFilesSynced(failures=tuple((str(p), m) for p, m in result.errors.items())),
            covered,
        )


class TraceSyncer:
    """The trace sink's actor: fsyncs trace files and keeps the usage ledger, in
    worker-thread batches that group every request waiting in its inbox.

    Started by :meth:`TraceSink.run`; it serves until its inbox closes or it is
    cancelled, and then serves what is still queued in one last batch (shielded, bounded
    by ``close_timeout``) and closes the ledger. A failure to fsync a file is sticky: it
    is repeated in every answer that covers the file until acknowledged.

    ``batches_written`` counts worker-thread batches; it lets tests prove that concurrent
    syncs share batches.
    """

    def __init__(self, ledger_path: Path, *, close_timeout: float, disk: Disk = DISK) -> None:
        self.ledger_path = ledger_path
        self.close_timeout = close_timeout
        self.disk = disk
        self.batches_written = 0
        self._ledger: sqlite3.Connection | None = None
        self._pending: list[SyncTraceFiles] = []
        self._usage: list[UsageRow] = []
        # Whether the batch being gathered holds work that may not wait: a sync, or a row
        # other than a started request's.
        self._urgent = False
        self._errors: dict[str, str] = {}

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[TraceSinkMessage],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> str | None:
        """Serve ``inbox``; ready once the ledger is open. Returns None, or what stopped
        the actor early (a bug: the batch it had taken is answered as failed)."""
        self._ledger = await trio.to_thread.run_sync(_open_ledger, self.ledger_path)
        task_status.started()
        failure: str | None = None
        try:
            async with inbox:
                try:
                    async for message in inbox:
                        self._take_queued(message, inbox)
                        if self._usage and not self._urgent:
                            await self._gather_started(inbox)
                        try:
                            await self._serve(final=False)
                        except Exception as exc:
                            # Only a bug gets here, in the writer or the disk below it (what
                            # the disk refuses is answered, not raised). It must not end the
                            # host with every session in it: the actor stops, so every later
                            # sync raises TraceSinkClosed and no waiting sync may pretend its
                            # lines are durable.
                            failure = f"the trace writer failed: {exc!r}"
                            self._answer_all(failure)
                            break
                finally:
                    # Requests still queued as the actor stops (cancelled with its host while
                    # a session's close asks for a sync) would go with the inbox, and their
                    # callers would wait for an answer for ever: the last batch serves them.
                    self._take_queued(None, inbox)
                    if failure is not None:
                        self._answer_all(failure)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self._serve(final=True)
                except Exception as exc:  # a bug, as above: the actor ends, the host goes on
                    failure = failure or f"the trace writer failed: {exc!r}"
                    self._answer_all(failure)
                finally:
                    self._ledger = None
        return failure

    def _take_queued(
        self, first: TraceSinkMessage | None, inbox: trio.MemoryReceiveChannel[TraceSinkMessage]
    ) -> None:
        """Take ``first`` and every message waiting in ``inbox`` now: one batch for all."""
        if first is not None:
            self._take(first)
        while True:
            try:
                self._take(inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break

    async def _gather_started(self, inbox: trio.MemoryReceiveChannel[TraceSinkMessage]) -> None:
        """The rows of requests whose streams just began wait up to
        :data:`STARTED_ROWS_WAIT_S` for company: each batch is a commit of the ledger (an
        fsync), and a thousand streams that begin together share a few instead of one
        each. Anything else that comes ends the wait."""
        with trio.move_on_after(STARTED_ROWS_WAIT_S):
            async for message in inbox:
                self._take_queued(message, inbox)
                if self._urgent:
                    return

    def _take(self, message: TraceSinkMessage) -> None:
        match message:
            case SyncTraceFiles():
                self._pending.append(message)
                self._urgent = True
            case LedgerRow():
                self._usage.append(message.row)
                self._urgent = self._urgent or message.row.status != STARTED
            case TraceErrorAcknowledged():
                self._errors.pop(message.path, None)
            case _:
                assert_never(message)

    def _take_batch(self, *, final: bool, early: _EarlyAnswers | None) -> _BatchJob:
        fsync: dict[Path, frozenset[Path]] = {}
        for request in self._pending:
            dirs = frozenset(Path(d) for d in request.dirs)
            for file in request.files:
                fsync[Path(file)] = fsync.get(Path(file), frozenset()) | dirs
        usage, self._usage = self._usage, []
        self._urgent = False
        groups = tuple(tuple(Path(file) for file in request.files) for request in self._pending)
        synced = None if early is None else early.from_thread
        return _BatchJob(
            fsync=fsync, usage=usage, close_ledger=final, groups=groups, synced=synced
        )

    async def _serve(self, *, final: bool) -> None:
        # A thousand sessions reach a turn boundary together and share one batch: each is
        # answered once its own files are durable, so that it goes on (its request out,
        # its tools started) while the batch's other fsyncs are still under way.
        early = None if final else _EarlyAnswers(self, list(self._pending))
        job = self._take_batch(final=final, early=early)
        result = _BatchResult(errors={}, ledger_error=None)
        if job.fsync or job.usage or job.close_ledger:
            # Counted as it begins: its first requests are answered before it ends.
            self.batches_written += 1
            try:
                # Raises only for a bug; the requests stay pending then, for run to answer:
                # those not answered early (a second answer would not fit their channel).
                result = await self._run(job, final=final)
            except BaseException:
                if early is not None:
                    self._pending = early.close()
                raise
        requests, self._pending = self._pending, []
        if early is not None:
            requests = early.close()
        for path, why in result.errors.items():
            self._errors[str(path)] = why
        if result.ledger_error is not None:
            self._errors[str(self.ledger_path)] = result.ledger_error
        for request in requests:
            covered = set(request.files)
            if request.ledger:
                covered = set(self._errors)
            failures = tuple((p, why) for p, why in self._errors.items() if p in covered)
            with contextlib.suppress(trio.BrokenResourceError):
                request.reply.send_nowait(TraceFilesSynced(failures=failures))

    async def _run(self, job: _BatchJob, *, final: bool) -> _BatchResult:
        if not final:
            # Shielded: once taken, a batch is written and answered even if we are cancelled
            # (to_thread would otherwise raise Cancelled before starting the thread). What
            # the disk refuses comes back in the result; anything raised is a bug, and run
            # stops the actor on it.
            with trio.CancelScope(shield=True):
                return await trio.to_thread.run_sync(_run_batch, job, self._ledger, self.disk)
        result: _BatchResult | None = None
        with trio.move_on_after(self.close_timeout):
            # Abandonable so a hung disk cannot hang the host's shutdown; the abandoned
            # thread owns the ledger connection and closes it itself.
            try:
                result = await trio.to_thread.run_sync(
                    _run_batch, job, self._ledger, self.disk, abandon_on_cancel=True
                )
            except Exception as exc:
                result = _failed_batch(job, f"the trace writer failed: {exc!r}")
        if result is None:
            message = f"final flush did not finish within {self.close_timeout}s"
            result = _failed_batch(job, message)
        return result

    def answer_early(self, request: SyncTraceFiles, failures: dict[Path, str]) -> None:
        """Answer ``request``, whose files (and their directories) a batch still running
        has made durable or failed (``failures``), with every failure known for them."""
        for path, why in failures.items():
            self._errors[str(path)] = why
        covered = set(request.files)
        answer = tuple((p, why) for p, why in self._errors.items() if p in covered)
        with contextlib.suppress(trio.BrokenResourceError):
            request.reply.send_nowait(TraceFilesSynced(failures=answer))

    def _answer_all(self, failure: str) -> None:
        requests, self._pending = self._pending, []
        for request in requests:
            failures = tuple((file, failure) for file in request.files) or (
                (str(self.ledger_path), failure),
            )
            with contextlib.suppress(trio.BrokenResourceError):
                request.reply.send_nowait(TraceFilesSynced(failures=failures))


class _EarlyAnswers:
    """The requests of one batch that are answered as their own files become durable,
    from the worker threads through the run's token; what is left when the batch ends
    (a request for the ledger, whose rows are inserted at its end, and any not yet told)
    is answered by the batch as before."""

    def __init__(self, syncer: TraceSyncer, requests: list[SyncTraceFiles]) -> None:
        self._syncer = syncer
        self._requests: dict[int, SyncTraceFiles] = dict(enumerate(requests))
        self._token = trio.lowlevel.current_trio_token()

    def from_thread(self, index: int, failures: dict[Path, str]) -> None:
        """A worker thread's news that request ``index``'s files are done."""
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._answer, index, failures)

    def _answer(self, index: int, failures: dict[Path, str]) -> None:
        # Runs as the run's own callback, where an exception would end the host: whatever
        # goes wrong, the request is left to the batch's end, which answers as before.
        request = self._requests.get(index)
        if request is None or request.ledger:
            return
        try:
            self._syncer.answer_early(request, failures)
        except Exception:
            return
        del self._requests[index]

    def close(self) -> list[SyncTraceFiles]:
        """The requests not answered yet; none is answered early from now on."""
        left, self._requests = list(self._requests.values()), {}
        return left


def _failed_batch(job: _BatchJob, message: str) -> _BatchResult:
    """The result of a batch whose worker call itself failed: every file in it failed."""
    return _BatchResult(
        errors=dict.fromkeys(job.fsync, message),
        ledger_error=message if job.usage else None,
    )


# -- the worker-thread side: blocking I/O only, no trio, no sink state ----------------------


def _open_ledger(path: Path) -> sqlite3.Connection:
    try:
        return _open_ledger_file(path)
    except (sqlite3.Error, OSError) as exc:
        raise _unusable(path, exc) from None


def _unusable(path: Path, exc: Exception) -> LedgerUnusable:
    return LedgerUnusable(
        f"the usage ledger {path} cannot be used ({exc}): move it aside and a new one is "
        "made (the cost history then starts empty), or restore it from a backup"
    )


def _open_ledger_file(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    # Created (or tightened) 0600 before SQLite opens it: its -wal and -shm files take the
    # database file's mode.
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE))
    for companion in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            _tighten(companion, PRIVATE_FILE_MODE)
    # Used by one worker thread at a time (batches never overlap), but not always the same
    # thread, hence check_same_thread=False.
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        # WAL lets a CLI report read while the host writes; FULL makes each commit durable.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(_CREATE_USAGE)
        present = _columns(conn)
        for name, kind in _ADDED_COLUMNS:
            if name not in present:
                conn.execute(f"ALTER TABLE usage ADD COLUMN {name} {kind}")
        conn.execute("CREATE INDEX IF NOT EXISTS usage_session ON usage (session_id)")
        # Reports by time, and a principal's spending since the start of its period.
        conn.execute("CREATE INDEX IF NOT EXISTS usage_at ON usage (at)")
        conn.execute("CREATE INDEX IF NOT EXISTS usage_principal ON usage (principal, at)")
        conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS usage_request ON usage (request_key)")
    except BaseException:
        conn.close()
        raise
    return conn


def _run_batch(job: _BatchJob, ledger: sqlite3.Connection | None, disk: Disk) -> _BatchResult:
    errors: dict[Path, str] = {}
    # Every file once, then every directory once (the entries of all its new files are
    # made durable by one fsync of it, after they were all created): a directory's failure
    # is the failure of each file that needed it.
    needing: dict[Path, list[Path]] = {}
    for path, dirs in job.fsync.items():
        # Directories cannot be opened for fsync but on POSIX; NTFS journals entries.
        for directory in dirs if os.name == "posix" else ():
            needing.setdefault(directory, []).append(path)
    errors = _GroupSync(job, needing).run(disk)
    ledger_error: str | None = None
    if ledger is not None:
        try:
            if job.usage:
                _insert_usage(ledger, job.usage)
        except Exception as exc:
            # A row SQLite refuses (an integer past 64 bits: OverflowError) fails the
            # ledger, not the trace files of the sessions that synced in this batch.
            ledger_error = str(exc) or repr(exc)
        finally:
            if job.close_ledger:
                with contextlib.suppress(sqlite3.Error):
                    ledger.close()
    elif job.usage:
        ledger_error = "the usage ledger is not open"
    return _BatchResult(errors=errors, ledger_error=ledger_error)


STARTED_ROWS_WAIT_S = 0.25
"""The longest a usage row written as a request's stream began waits for other work before
the ledger commits it, when nobody waits for it (a host that dies meanwhile loses that
row). A task's streamer does wait, before it hands the stream's first events on
(:class:`~greenroom.actors.runtime.accounting.RequestBilling`): its rows go at once."""

SYNC_THREADS = 8
"""The most fsyncs of one batch that run at once. The filesystem and the device take
concurrent fsyncs together (ext4 commits them in one journal transaction), so a thousand
sessions at a turn boundary wait for about half the time they would one after another
(``tests/benchmarks/README.md``)."""

_SYNC_ALONE = 8
"""Fewer paths than this are synced in the batch's own thread: starting threads would
cost more than the overlap saves."""


class _GroupSync:
    """fsync a batch's files and directories in the order of its requests, up to
    :data:`SYNC_THREADS` at once, and tell ``job.synced`` of each request as soon as the
    last of its paths is done. Each path is synced once, however many requests need it:
    a directory once for all its new files, which were all made before the batch began.
    A directory's failure is the failure of each file that needed it; a path that is gone
    is skipped (never re-create a file whose session was deleted: nothing of ours is left
    in it to make durable)."""

    def __init__(self, job: _BatchJob, needing: dict[Path, list[Path]]) -> None:
        self._job = job
        self._needing = needing
        self._groups = job.groups or (tuple(job.fsync),)
        order: dict[Path, None] = {}
        self._waiting: dict[Path, list[int]] = {}
        self._left: list[int] = []
        for index, files in enumerate(self._groups):
            dirs = {d for file in files for d in job.fsync[file] if d in needing}
            paths = [*dict.fromkeys(files), *sorted(dirs)]
            for path in paths:
                order[path] = None
                self._waiting.setdefault(path, []).append(index)
            self._left.append(len(paths))
        self._order = list(order)
        self._errors: dict[Path, str] = {}
        self._bugs: list[BaseException] = []
        self._lock = threading.Lock()

    def run(self, disk: Disk) -> dict[Path, str]:
        """Sync every path; the files' failures. Raises what is not an OSError (a bug
        below), once every thread has ended."""
        paths = iter(self._order)
        if len(self._order) < _SYNC_ALONE:
            self._sync(disk, paths)
        else:
            # Daemon threads, like trio's own workers: a disk that hangs cannot hold the
            # interpreter's exit, as the final batch may be abandoned on a hung disk. They
            # share one iterator, each taking the batch's next path: first come, first done.
            threads = [
                threading.Thread(target=self._sync, args=(disk, paths), daemon=True)
                for _ in range(min(SYNC_THREADS, len(self._order)))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if self._bugs:
            raise self._bugs[0]
        return {path: why for path, why in self._errors.items() if path in self._job.fsync}

    def _sync(self, disk: Disk, paths: Iterator[Path]) -> None:
        while True:
            with self._lock:
                path = next(paths, None)
            if path is None:
                return
            why: str | None = None
            try:
                with contextlib.suppress(FileNotFoundError):
                    disk.fsync(path)
            except OSError as exc:
                why = _describe(exc)
            except BaseException as exc:
                self._bugs.append(exc)
                return
            self._done(path, why)

    def _done(self, path: Path, why: str | None) -> None:
        told: list[tuple[int, dict[Path, str]]] = []
        with self._lock:
            if why is not None:
                if path in self._job.fsync:
                    self._errors[path] = why
                for file in self._needing.get(path, ()):
                    self._errors.setdefault(file, why)
            for index in self._waiting.get(path, ()):
                self._left[index] -= 1
                if self._left[index] == 0:
                    files = self._groups[index]
                    told.append((index, {f: self._errors[f] for f in files if f in self._errors}))
        synced = self._job.synced
        if synced is not None:
            for index, failures in told:
                synced(index, failures)


def _append(disk: Disk, path: Path, lines: list[bytes]) -> frozenset[Path]:
    """Append ``lines`` to ``path`` (creating it and its parents); return the directories
    whose entries changed (the file's parent if the file is new, and the parent of every
    new directory)."""
    changed: set[Path] = set()
    missing: list[Path] = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        disk.make_dir(directory)
        changed.add(directory.parent)
    data = b"".join(lines)
    try:
        last = disk.last_byte(path)
    except FileNotFoundError:
        changed.add(path.parent)
        last = b""
    if last not in (b"", b"\n"):
        # A torn last line (a crash or a failed write mid-line): end it, so our first record
        # does not merge with it and only the torn line reads as corrupt.
        data = b"\n" + data
    disk.append(path, data, create=True)
    return frozenset(changed)


def _tighten(path: Path, mode: int) -> None:
    """Take away every permission beyond ``mode`` (never adds one)."""
    current = path.stat().st_mode & 0o777
    if current & ~mode:
        os.chmod(path, current & mode)


def _insert_usage(ledger: sqlite3.Connection, rows: list[UsageRow]) -> None:
    values = [
        (
            row.at,
            row.session_id,
            row.run_id,
            row.turn,
            row.kind,
            row.provider,
            row.model,
            row.usage.input,
            row.usage.output,
            row.usage.cache_read,
            row.usage.cache_write,
            row.usage.total,
            row.status,
            row.error_message,
            row.usage.cost_usd,
            row.principal,
            row.root_id,
            row.request_key,
            int(row.estimated),
        )
        for row in rows
    ]
    ledger.execute("BEGIN")
    try:
        ledger.executemany(_INSERT_USAGE, values)
        ledger.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            ledger.execute("ROLLBACK")
        raise


def _describe(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
    return f"internal error: {exc!r}"


# -- readers (blocking; call them from a worker thread inside trio) --------------------------


def read_trace(path: Path | str, *, disk: Disk = DISK) -> TraceReadResult:
    """Read one trace file with :func:`~greenroom.protocols.trace.parse_trace`.

    Corrupt lines are reported in the result, not raised. Raises OSError if the file cannot
    be read at all (missing, permission). Blocking: inside trio, use ``trio.to_thread``.
    """
    path = Path(path)
    return parse_trace(disk.read(path), file=str(path))


def latest_trace_file(session_dir: Path | str) -> Path | None:
    """The session's trace file with the highest number, or None if it has none (or the
    directory does not exist). Blocking."""
    best: tuple[int, Path] | None = None
    try:
        entries = list(Path(session_dir).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in entries:
        number = trace_file_number(entry.name)
        if number is not None and (best is None or number > best[0]):
            best = (number, entry)
    return None if best is None else best[1]


def usage_totals(db_path: Path | str, *, session_id: str | None = None) -> dict[str, Any]:
    """Token totals per session from a usage ledger: ``{session_id: {input, output,
    cache_read, cache_write, total, requests, compaction_failures, titles}}``.

    ``requests`` counts ``request`` rows, ``compaction_failures`` and ``titles`` the other
    kinds; token sums cover every row. With ``session_id``, only that session (absent if it
    has no rows). A missing ledger gives ``{}``; a damaged one raises
    :class:`LedgerUnusable`. Opens the database read-only; blocking.
    """
    path = Path(db_path)
    if not path.exists():
        return {}
    try:
        rows = _session_totals(path, session_id)
    except sqlite3.Error as exc:
        raise _unusable(path, exc) from None
    keys = (
        "input",
        "output",
        "cache_read",
        "cache_write",
        "total",
        "requests",
        "compaction_failures",
        "titles",
    )
    return {row[0]: {k: int(v or 0) for k, v in zip(keys, row[1:], strict=True)} for row in rows}


def _session_totals(path: Path, session_id: str | None) -> list[Any]:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        query = (
            "SELECT session_id, SUM(input), SUM(output), SUM(cache_read), SUM(cache_write),"
            " SUM(total), SUM(kind = 'request'), SUM(kind = 'compaction_failed'),"
            " SUM(kind = 'title') FROM usage"
        )
        params: tuple[str, ...] = ()
        if session_id is not None:
            query += " WHERE session_id = ?"
            params = (session_id,)
        query += " GROUP BY session_id ORDER BY session_id"
        return conn.execute(query, params).fetchall()
    finally:
        conn.close()


def _columns(conn: sqlite3.Connection) -> set[str]:
    return {str(row[1]) for row in conn.execute("PRAGMA table_info(usage)")}


_GROUP_COLUMNS = {"session": "session_id", "principal": "principal", "model": "model"}
_REPORTED_COLUMNS = (
    "at", "session_id", "kind", "model", "input", "output", "cache_read", "cache_write", "total"
)


def usage_report(db_path: Path | str, query: UsageQuery) -> list[UsageLine]:
    """The report of ``query`` over a usage ledger (as
    :func:`~greenroom.protocols.trace.summarize_usage` adds up rows): one line per group,
    sorted by key (NULL first). A missing ledger has no rows; one written before cost
    accounting reads as if its rows had no cost, principal or root; a damaged one raises
    :class:`LedgerUnusable`. Opens the database read-only; blocking."""
    path = Path(db_path)
    rows: list[Any] = []
    if path.exists():
        try:
            rows = _report_rows(path, query)
        except sqlite3.Error as exc:
            raise _unusable(path, exc) from None
    if query.by is None and not rows:
        return [UsageLine(key=None)]
    return [
        UsageLine(
            key=row[0],
            requests=int(row[1] or 0),
            input=int(row[2] or 0),
            output=int(row[3] or 0),
            cache_read=int(row[4] or 0),
            cache_write=int(row[5] or 0),
            total=int(row[6] or 0),
            cost_usd=float(row[7] or 0.0),
            unpriced=int(row[8] or 0),
        )
        for row in rows
    ]


def _report_rows(path: Path, query: UsageQuery) -> list[Any]:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        present = _columns(conn)
        added = (name if name in present else f"NULL AS {name}" for name, _ in _ADDED_COLUMNS)
        columns = ", ".join((*_REPORTED_COLUMNS, *added))
        key = _GROUP_COLUMNS[query.by] if query.by is not None else "NULL"
        where, params = _report_filter(query)
        return conn.execute(
            f"SELECT {key}, SUM(kind != 'compaction_failed'), SUM(input), SUM(output),"
            " SUM(cache_read), SUM(cache_write), SUM(total), TOTAL(cost_usd),"
            " SUM(kind != 'compaction_failed' AND cost_usd IS NULL)"
            f" FROM (SELECT {columns} FROM usage) {where} GROUP BY {key} ORDER BY {key}",
            params,
        ).fetchall()
    finally:
        conn.close()


def _report_filter(query: UsageQuery) -> tuple[str, tuple[Any, ...]]:
    clauses: list[str] = []
    params: list[Any] = []
    if query.since is not None:
        clauses.append("at >= ?")
        params.append(query.since)
    if query.until is not None:
        clauses.append("at < ?")
        params.append(query.until)
    if query.principal is not None:
        clauses.append("principal = ?")
        params.append(query.principal)
    if query.tree is not None:
        clauses.append("(session_id = ? OR root_id = ?)")
        params.extend((query.tree, query.tree))
    return ("WHERE " + " AND ".join(clauses) if clauses else ""), tuple(params)
