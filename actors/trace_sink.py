"""The TraceSink actor: append-only trace files and the usage ledger, with group commit.

One sink per Host, shared by all its sessions. Sessions hand it finished lines
(:func:`greenroom.protocols.trace.encode_record`) with :meth:`TraceSink.write`, which only
appends to an in-memory buffer, and ask for durability with :meth:`TraceSink.sync` at the
points R-TRACE-2 names (turn boundaries, before a tool with side effects starts).

The writer task drains continuously: each batch takes every buffered line of every file and
every pending usage row, and does all the blocking work in ONE worker-thread call — append to
each file (opened and closed again in the batch, so thousands of sessions do not hold
thousands of descriptors), fsync the files somebody is waiting on, insert the ledger rows
with one ``executemany`` and one commit. Callers of ``sync`` that arrive while a batch is in
flight share the next one (group commit), so the fsync rate is bounded by the disk, not by
the number of sessions. A line is never held back for more than one batch.

Exceptions (the public tree)::

    Exception
    ├── TraceSinkClosed   write() or record_usage() after the sink was closed (our own doing)
    └── TraceWriteError   a file or the ledger could not be written (disk full, permission, …)

I/O errors never crash the sink or the host: a failed file is recorded and the others go on.
The failure is sticky per file (lines were lost, the file has a hole): every later
``sync(path)`` for that file, and every ``sync()``, raises :class:`TraceWriteError` until
:meth:`TraceSink.clear_error` acknowledges it. Ledger failures are reported the same way
under the ledger's path.

Usage-ledger table ``usage`` in ``<data_dir>/usage.sqlite``: ``id, at, session_id, run_id,
turn, kind, provider, model, input, output, cache_read, cache_write, total, status,
error_message`` (see :class:`greenroom.protocols.trace.UsageRow`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import trio

from greenroom.protocols.trace import (
    TraceReadResult,
    UsageRow,
    parse_trace,
    trace_file_number,
)

__all__ = [
    "LEDGER_FILE_NAME",
    "TraceSink",
    "TraceSinkClosed",
    "TraceWriteError",
    "latest_trace_file",
    "read_trace",
    "usage_totals",
]

LEDGER_FILE_NAME = "usage.sqlite"

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
)
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
    error_message TEXT
)
"""
_INSERT_USAGE = (
    f"INSERT INTO usage ({', '.join(_USAGE_COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in _USAGE_COLUMNS)})"
)


class TraceSinkClosed(Exception):
    """The sink was closed (by its owner) and accepts no more lines or usage rows."""


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

    lines: dict[Path, list[str]]
    fsync: frozenset[Path]
    dir_syncs: dict[Path, frozenset[Path]]
    """For each file to fsync: directories created earlier whose entries still need fsync."""
    usage: list[UsageRow]
    close_ledger: bool


@attrs.frozen(kw_only=True, slots=True)
class _BatchResult:
    errors: dict[Path, str]
    new_dirs: dict[Path, frozenset[Path]]
    """Files written but not fsynced in this batch -> directories whose entries they changed."""
    ledger_error: str | None


class TraceSink:
    """Append-only JSONL trace files and the SQLite usage ledger of one Host.

    Lifetime: ``await nursery.start(sink.run)``; the sink is ready (ledger opened) when that
    returns. It ends either by :meth:`aclose` or by cancelling ``run``; both flush every
    buffered line and usage row and fsync every file before ``run`` returns (shielded,
    bounded by ``close_timeout`` seconds). After that, :meth:`write` and
    :meth:`record_usage` raise :class:`TraceSinkClosed`.

    ``batches_written`` counts worker-thread batches (one ``to_thread`` call each); it lets
    tests prove that concurrent syncs share batches.
    """

    def __init__(
        self,
        data_dir: Path | str,
        *,
        ledger_path: Path | str | None = None,
        close_timeout: float = 5.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.ledger_path = (
            Path(ledger_path) if ledger_path is not None else self.data_dir / LEDGER_FILE_NAME
        )
        self.close_timeout = close_timeout
        self.batches_written = 0

        self._buffers: dict[Path, list[str]] = {}
        self._usage: list[UsageRow] = []
        self._fsync_requested: set[Path] = set()
        self._fsync_all = False
        # Files written by finished batches and not fsynced since, with the new directories
        # whose entries must be fsynced along with them.
        self._not_fsynced: dict[Path, frozenset[Path]] = {}
        self._inflight_lines: frozenset[Path] = frozenset()
        self._inflight_fsync: frozenset[Path] = frozenset()
        self._inflight_usage = False
        self._errors: dict[Path, TraceWriteError] = {}

        self._batches_taken = 0
        self._batches_done = 0
        self._batch_done = trio.Event()
        self._wakeup: trio.Event | None = None
        self._started = False
        self._closed = False
        self._finished = trio.Event()
        self._close_error: TraceWriteError | None = None
        self._ledger: sqlite3.Connection | None = None

    # -- the actor -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer loop. Signals ready once the ledger is open (its errors propagate).

        Returns after :meth:`aclose`; on cancellation it flushes, then lets Cancelled
        through. Either way everything written before the close is on disk when it ends
        (unless the disk fails or ``close_timeout`` runs out: then ``sync`` callers still
        waiting get :class:`TraceWriteError`). May be started once.
        """
        if self._started:
            raise RuntimeError("TraceSink.run may be started only once")
        self._started = True
        try:
            self._ledger = await trio.to_thread.run_sync(_open_ledger, self.ledger_path)
            task_status.started()
            await self._writer_loop()
        finally:
            self._closed = True
            with trio.CancelScope(shield=True):
                await self._final_flush()
            self._finished.set()
            self._wake_waiters()

    async def aclose(self) -> None:
        """Stop accepting lines, flush and fsync everything, and wait for ``run`` to end.

        Idempotent. Safe to call before ``run`` was started (then nothing is written: the
        buffered lines are dropped). Cancel-safe: cancelling the caller does not stop the
        flush, which ``run`` completes.
        """
        self._closed = True
        if not self._started:
            self._finished.set()
            self._wake_waiters()
            await trio.lowlevel.checkpoint()
            return
        self._wake_writer()
        await self._finished.wait()

    # -- the API for sessions ---------------------------------------------------------------

    def write(self, path: Path, line: str) -> None:
        """Append ``line`` (one record ending in ``"\\n"``) to the file at ``path``.

        Synchronous and O(1): it only buffers; the writer appends soon after. Files are keyed
        by ``Path`` equality, so give each file one spelling (``sync`` uses it). Never blocks
        and never raises for I/O (failures surface from :meth:`sync`). Raises
        :class:`TraceSinkClosed` once the sink is closed and ValueError for a line without
        its newline (it would merge with the next record).
        """
        if self._closed:
            raise TraceSinkClosed(f"trace sink is closed; cannot write to {path}")
        if not line.endswith("\n"):
            raise ValueError("a trace line must end with a newline")
        buffer = self._buffers.get(path)
        if buffer is None:
            self._buffers[path] = [line]
        else:
            buffer.append(line)
        if self._wakeup is not None:
            self._wake_writer()

    def record_usage(self, row: UsageRow) -> None:
        """Queue one usage-ledger row (R-TRACE-5); inserted with the next batch.

        Never blocks, never raises for I/O (see :meth:`sync` with no path). Raises
        :class:`TraceSinkClosed` once the sink is closed.
        """
        if self._closed:
            raise TraceSinkClosed("trace sink is closed; cannot record usage")
        self._usage.append(row)
        if self._wakeup is not None:
            self._wake_writer()

    async def sync(self, path: Path | None = None) -> None:
        """Durability barrier: return once every line written to ``path`` before this call
        (with no path: every line of every file, and every usage row) is written, flushed
        and fsynced (R-TRACE-2).

        Concurrent callers share batches. Returns at once (after a checkpoint) when nothing
        is pending. Raises :class:`TraceWriteError` when a covered file has lost lines (see
        the module docstring: the error is sticky until :meth:`clear_error`). Cancel-safe:
        a cancelled caller just stops waiting; the fsync it asked for still happens. Works
        after close too (waits for the final flush).
        """
        target = self._request_sync(path)
        if target is not None:
            while self._batches_done < target and not self._finished.is_set():
                await self._batch_done.wait()
        else:
            await trio.lowlevel.checkpoint()
        self._raise_errors(path)

    def clear_error(self, path: Path) -> None:
        """Acknowledge a file's write failure so ``sync`` stops raising it."""
        self._errors.pop(path, None)

    @property
    def errors(self) -> dict[Path, TraceWriteError]:
        """The unacknowledged write failures, by file (a copy)."""
        return dict(self._errors)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals ---------------------------------------------------------------------------

    def _request_sync(self, path: Path | None) -> int | None:
        """Register a sync request; the batch number that satisfies it, or None if none is
        needed."""
        next_batch = self._batches_taken + 1
        if self._finished.is_set():
            return None
        if path is None:
            if (
                self._buffers
                or self._usage
                or self._inflight_lines
                or self._inflight_usage
                or self._not_fsynced
            ):
                self._fsync_all = True
                self._wake_writer()
                return next_batch
            return None
        if path in self._buffers:
            self._fsync_requested.add(path)
            self._wake_writer()
            return next_batch
        if path in self._inflight_fsync:
            # The batch in flight took this file's last lines and fsyncs it.
            return self._batches_taken
        if path in self._inflight_lines or path in self._not_fsynced:
            self._fsync_requested.add(path)
            self._wake_writer()
            return next_batch
        return None

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

    def _wake_writer(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def _wake_waiters(self) -> None:
        self._batch_done.set()
        self._batch_done = trio.Event()

    def _has_work(self) -> bool:
        return bool(self._buffers or self._usage or self._fsync_requested or self._fsync_all)

    async def _writer_loop(self) -> None:
        while not self._closed:
            if not self._has_work():
                wakeup = self._wakeup = trio.Event()
                await wakeup.wait()
                continue
            job = self._take_batch(final=False)
            if not (job.lines or job.fsync or job.usage):
                # Only syncs of files that were already durable: nothing for a thread to do.
                self._finish_batch(job, _BatchResult(errors={}, new_dirs={}, ledger_error=None))
                await trio.lowlevel.checkpoint()
                continue
            # Shielded: once taken, a batch is written and its results applied even if we are
            # cancelled (to_thread would otherwise raise Cancelled before starting the thread,
            # dropping the lines). The thread call is not abandonable anyway.
            with trio.CancelScope(shield=True):
                result = await trio.to_thread.run_sync(_run_batch, job, self._ledger)
            self._finish_batch(job, result)

    async def _final_flush(self) -> None:
        job = self._take_batch(final=True)
        result: _BatchResult | None = None
        with trio.move_on_after(self.close_timeout):
            # Abandonable so a hung disk cannot hang the host's shutdown; the abandoned thread
            # owns the ledger connection and closes it itself.
            result = await trio.to_thread.run_sync(
                _run_batch, job, self._ledger, abandon_on_cancel=True
            )
        self._ledger = None
        if result is None:
            self._close_error = TraceWriteError(
                self.data_dir, f"final flush did not finish within {self.close_timeout}s"
            )
            self._batches_done = self._batches_taken
            self._inflight_lines = self._inflight_fsync = frozenset()
            self._inflight_usage = False
            return
        self._finish_batch(job, result)

    def _take_batch(self, *, final: bool) -> _BatchJob:
        lines, self._buffers = self._buffers, {}
        usage, self._usage = self._usage, []
        written = set(lines)
        if final or self._fsync_all:
            fsync = written | set(self._not_fsynced)
        else:
            fsync = self._fsync_requested & (written | set(self._not_fsynced))
        self._fsync_requested = set()
        self._fsync_all = False
        self._batches_taken += 1
        self._inflight_lines = frozenset(written)
        self._inflight_fsync = frozenset(fsync)
        self._inflight_usage = bool(usage)
        return _BatchJob(
            lines=lines,
            fsync=frozenset(fsync),
            dir_syncs={p: self._not_fsynced[p] for p in fsync if p in self._not_fsynced},
            usage=usage,
            close_ledger=final,
        )

    def _finish_batch(self, job: _BatchJob, result: _BatchResult) -> None:
        if job.lines or job.fsync or job.usage or job.close_ledger:
            self.batches_written += 1
        for path in job.fsync:
            if path not in result.errors:
                self._not_fsynced.pop(path, None)
        for path in job.lines.keys() - job.fsync:
            dirs = result.new_dirs.get(path, frozenset())
            self._not_fsynced[path] = self._not_fsynced.get(path, frozenset()) | dirs
        for path, message in result.errors.items():
            self._errors[path] = TraceWriteError(path, message)
            # Failed lines are dropped (the error says so), so there is nothing left to fsync.
            self._not_fsynced.pop(path, None)
        if result.ledger_error is not None:
            self._errors[self.ledger_path] = TraceWriteError(self.ledger_path, result.ledger_error)
        self._inflight_lines = self._inflight_fsync = frozenset()
        self._inflight_usage = False
        self._batches_done = self._batches_taken
        self._wake_waiters()


# -- the worker-thread side: blocking I/O only, no trio, no sink state ----------------------


def _open_ledger(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Used by one worker thread at a time (batches never overlap), but not always the same
    # thread, hence check_same_thread=False.
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        # WAL lets a CLI report read while the host writes; FULL makes each commit durable.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(_CREATE_USAGE)
        conn.execute("CREATE INDEX IF NOT EXISTS usage_session ON usage (session_id)")
    except BaseException:
        conn.close()
        raise
    return conn


def _run_batch(job: _BatchJob, ledger: sqlite3.Connection | None) -> _BatchResult:
    errors: dict[Path, str] = {}
    new_dirs: dict[Path, frozenset[Path]] = {}
    for path in job.lines.keys() | job.fsync:
        lines = job.lines.get(path)
        try:
            created = _append(path, lines, fsync=path in job.fsync)
        except OSError as exc:
            errors[path] = _describe(exc)
            continue
        if path in job.fsync:
            try:
                _fsync_dirs(created | job.dir_syncs.get(path, frozenset()))
            except OSError as exc:
                errors[path] = _describe(exc)
        elif created:
            new_dirs[path] = created
    ledger_error: str | None = None
    if ledger is not None:
        try:
            if job.usage:
                _insert_usage(ledger, job.usage)
        except sqlite3.Error as exc:
            ledger_error = str(exc)
        finally:
            if job.close_ledger:
                with contextlib.suppress(sqlite3.Error):
                    ledger.close()
    elif job.usage:
        ledger_error = "the usage ledger is not open"
    return _BatchResult(errors=errors, new_dirs=new_dirs, ledger_error=ledger_error)


def _append(path: Path, lines: list[str] | None, *, fsync: bool) -> frozenset[Path]:
    """Append ``lines`` to ``path`` (creating it and its parents), fsync if asked; return the
    directories whose entries changed (the file's parent if the file is new, and the parent
    of every new directory)."""
    if not lines:
        # Only an fsync was asked for. Never re-create a file that is gone (its session may
        # have been deleted): nothing of ours is left in it to make durable.
        if fsync:
            with contextlib.suppress(FileNotFoundError), open(path, "rb+") as f:
                os.fsync(f.fileno())
        return frozenset()
    changed: set[Path] = set()
    missing: list[Path] = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        changed.add(directory.parent)
    if not path.exists():
        changed.add(path.parent)
    data = "".join(lines).encode("utf-8")
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                # A torn last line (a crash or a failed write mid-line): end it, so our first
                # record does not merge with it and only the torn line reads as corrupt.
                data = b"\n" + data
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return frozenset(changed)


def _fsync_dirs(directories: Iterable[Path]) -> None:
    if os.name != "posix":
        return  # directories cannot be opened for fsync elsewhere; NTFS journals entries
    for directory in directories:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


def _describe(exc: OSError) -> str:
    return f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)


# -- readers (blocking; call them from a worker thread inside trio) --------------------------


def read_trace(path: Path | str) -> TraceReadResult:
    """Read one trace file with :func:`~greenroom.protocols.trace.parse_trace`.

    Corrupt lines are reported in the result, not raised. Raises OSError if the file cannot
    be read at all (missing, permission). Blocking: inside trio, use ``trio.to_thread``.
    """
    path = Path(path)
    return parse_trace(path.read_bytes(), file=str(path))


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
    has no rows). A missing ledger gives ``{}``. Opens the database read-only; blocking.
    """
    path = Path(db_path)
    if not path.exists():
        return {}
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
        rows = conn.execute(query, params).fetchall()
    finally:
        conn.close()
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

