"""The TraceSink actor: append-only trace files and the usage ledger, with group commit.

One sink per Host, shared by all its sessions. Sessions hand it finished lines
(:func:`greenroom.protocols.trace.encode_record`) with :meth:`TraceSink.write`, which only
appends to an in-memory buffer, and ask for durability with :meth:`TraceSink.sync` at the
points R-TRACE-2 names (turn boundaries, before a tool with side effects starts).

A session publishes a traced output only once its record is *written*: handed to the
operating system (``write(2)`` returned), so that it survives the death of the process —
SIGKILL, a crash — though not yet a power cut, which only the fsyncs above cover. To keep
that cheap, :meth:`TraceSink.commit` appends a file's buffered lines at once, in the calling
thread (one small append to the page cache, no fsync), unless the writer thread holds
lines of that file at that moment; then the caller waits for that batch instead
(:meth:`TraceSink.write` returns its number; :meth:`TraceSink.batch_done` and
:meth:`TraceSink.when_batch_done` tell when it is done: written and its fsyncs returned,
or failed, which :meth:`TraceSink.error` then reports for the file). So a client never sees
a record that a crash of the host can still take out of the trace (R-RUN-8).

Exceptions (the public tree)::

    Exception
    ├── TraceSinkClosed   write() or record_usage() after the sink was closed (our own doing)
    └── TraceWriteError   a file or the ledger could not be written (disk full, permission, …)

No record and no I/O error ends the sink or the host: a line that cannot be encoded is refused
by :meth:`TraceSink.write` (ValueError, before it is buffered), and any failure while a batch is
written — an OSError, or anything else — is recorded for the files of that batch while the
others go on. The failure is sticky per file (lines were lost, the file has a hole): every later
``sync(path)`` for that file, and every ``sync()``, raises :class:`TraceWriteError` until
:meth:`TraceSink.clear_error` acknowledges it. Ledger failures are reported the same way
under the ledger's path. Once the sink is closed (or its writer has stopped), ``sync``
raises :class:`TraceSinkClosed`: nothing written after that point can be made durable.

Files and modes: trace files and the ledger are created 0600 (they hold tool output such
as file contents), directories the sink creates 0700.

Usage-ledger table ``usage`` in ``<data_dir>/usage.sqlite``: ``id, at, session_id, run_id,
turn, kind, provider, model, input, output, cache_read, cache_write, total, status,
error_message`` (see :class:`greenroom.protocols.trace.UsageRow`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterable
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

    lines: dict[Path, list[bytes]]
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

        self._buffers: dict[Path, list[bytes]] = {}
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
        self._callbacks: dict[int, list[Callable[[], None]]] = {}
        # Files whose last write was ours and whole: they end in a newline, so a commit
        # appends without the torn-tail check or the directory checks.
        self._clean_tails: set[Path] = set()
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
            try:
                await self._writer_loop()
            except Exception as exc:
                # Only a bug gets here (batch failures are recorded, not raised). It must
                # not end the host with every session in it: the sink closes, so every
                # later write and sync raises TraceSinkClosed and each session ends its
                # task with that error; no waiting sync may pretend its lines are durable.
                self._close_error = TraceWriteError(
                    self.data_dir, f"the trace writer failed: {exc!r}"
                )
        finally:
            self._closed = True
            with trio.CancelScope(shield=True):
                try:
                    await self._final_flush()
                except Exception as exc:  # a bug, as above: the sink ends, the host goes on
                    self._close_error = TraceWriteError(
                        self.data_dir, f"the trace writer failed: {exc!r}"
                    )
            self._finished.set()
            self._wake_waiters()
            self._run_callbacks(all_of_them=True)

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

    def write(self, path: Path, line: str) -> int:
        """Append ``line`` (one record ending in ``"\\n"``) to the file at ``path``; returns
        the number of the batch that will write it (see :meth:`batch_done`).

        Synchronous and O(1): it encodes and buffers; the writer appends soon after. Files
        are keyed by ``Path`` equality, so give each file one spelling (``sync`` uses it).
        Never blocks and never raises for I/O (failures surface from :meth:`sync` and
        :meth:`error`). Raises :class:`TraceSinkClosed` once the sink is closed, and
        ValueError for a line without its newline (it would merge with the next record) or
        one that UTF-8 cannot encode (a lone surrogate): such a line is not buffered, so it
        costs its caller that record and nothing else.
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
        if self._wakeup is not None:
            self._wake_writer()
        return self._batches_taken + 1

    def commit(self, path: Path) -> bool:
        """Hand the buffered lines of ``path`` to the operating system now, from the
        calling thread: one append, no fsync (that stays with the group commit). Returns
        True when no line written to ``path`` is still unwritten — or its write failed,
        which :meth:`error` reports — and False when the writer thread holds lines of
        ``path`` right now (wait for the batch of the last :meth:`write` then). Never
        raises for I/O. Blocks the caller for one small append; a session calls it when it
        publishes a batch of outputs, so that no client sees a record before it is written.
        """
        if path in self._inflight_lines:
            return False
        lines = self._buffers.pop(path, None)
        if not lines:
            return True
        try:
            if path in self._clean_tails and _append_known(path, lines):
                created: frozenset[Path] = frozenset()
            else:
                created = _append(path, lines, fsync=False)
        except Exception as exc:
            self._errors[path] = TraceWriteError(path, _describe(exc))
            self._not_fsynced.pop(path, None)
            self._clean_tails.discard(path)
            return True
        self._clean_tails.add(path)
        self._not_fsynced[path] = self._not_fsynced.get(path, frozenset()) | created
        return True

    def batch_done(self, batch: int) -> bool:
        """Whether batch ``batch`` (a number from :meth:`write`)
        is done: its lines handed to the OS and its fsyncs returned, or failed (see
        :meth:`error`). Always true once the sink has finished."""
        return self._batches_done >= batch or self._finished.is_set()

    def when_batch_done(self, batch: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once batch ``batch`` is done — at once if it already is,
        otherwise from the sink's task right after the batch (every registered callback
        is called exactly once, at the latest when the sink finishes). It must not block;
        an exception it raises is the callback's own bug and is ignored."""
        if self.batch_done(batch):
            _call_quietly(callback)
            return
        waiting = self._callbacks.get(batch)
        if waiting is None:
            self._callbacks[batch] = [callback]
        else:
            waiting.append(callback)

    def error(self, path: Path) -> TraceWriteError | None:
        """The unacknowledged write failure of ``path`` (see :meth:`clear_error`), or the
        failure that stopped the sink with lines of any file unwritten; None if neither."""
        return self._errors.get(path) or self._close_error

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
        the module docstring: the error is sticky until :meth:`clear_error`), and
        :class:`TraceSinkClosed` when the sink is closed or its writer has stopped: a
        return is a promise that the lines are on disk. A sync that was already waiting
        when the sink closed ends with the final flush and reports its outcome.
        Cancel-safe: a cancelled caller just stops waiting; the fsync it asked for still
        happens.
        """
        if self._closed:
            raise TraceSinkClosed("trace sink is closed; cannot make the trace durable")
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

    def _run_callbacks(self, *, all_of_them: bool = False) -> None:
        done = self._batches_done
        ready = [b for b in self._callbacks if all_of_them or b <= done]
        for batch in sorted(ready):
            for callback in self._callbacks.pop(batch):
                _call_quietly(callback)

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
                try:
                    result = await trio.to_thread.run_sync(_run_batch, job, self._ledger)
                except Exception as exc:
                    result = _failed_batch(job, f"the trace writer failed: {exc!r}")
            self._finish_batch(job, result)

    async def _final_flush(self) -> None:
        job = self._take_batch(final=True)
        result: _BatchResult | None = None
        with trio.move_on_after(self.close_timeout):
            # Abandonable so a hung disk cannot hang the host's shutdown; the abandoned thread
            # owns the ledger connection and closes it itself.
            try:
                result = await trio.to_thread.run_sync(
                    _run_batch, job, self._ledger, abandon_on_cancel=True
                )
            except Exception as exc:
                result = _failed_batch(job, f"the trace writer failed: {exc!r}")
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
        for path in job.lines:
            if path in result.errors:
                self._clean_tails.discard(path)
            else:
                self._clean_tails.add(path)
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
        self._run_callbacks()


def _call_quietly(callback: Callable[[], None]) -> None:
    # A callback that raises is its owner's bug; it must not take the sink (and with it
    # every session of the host) down.
    with contextlib.suppress(Exception):
        callback()


def _failed_batch(job: _BatchJob, message: str) -> _BatchResult:
    """The result of a batch whose worker call itself failed: every file in it failed."""
    return _BatchResult(
        errors={path: message for path in job.lines.keys() | job.fsync},
        new_dirs={},
        ledger_error=message if job.usage else None,
    )


# -- the worker-thread side: blocking I/O only, no trio, no sink state ----------------------


def _open_ledger(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Created (or tightened) 0600 before SQLite opens it: its -wal and -shm files take the
    # database file's mode.
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for companion in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            _tighten(companion, 0o600)
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
        except Exception as exc:
            errors[path] = _describe(exc)
            continue
        if path in job.fsync:
            try:
                _fsync_dirs(created | job.dir_syncs.get(path, frozenset()))
            except Exception as exc:
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


def _append(path: Path, lines: list[bytes] | None, *, fsync: bool) -> frozenset[Path]:
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
        directory.mkdir(exist_ok=True, mode=0o700)
        changed.add(directory.parent)
    if not path.exists():
        changed.add(path.parent)
    data = b"".join(lines)
    with open(path, "a+b", opener=_private_opener) as f:
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


def _append_known(path: Path, lines: list[bytes]) -> bool:
    """Append to a file this sink wrote last (it ends in a newline): open, write, close.
    False when the file is gone (then :func:`_append` creates it again)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except FileNotFoundError:
        return False
    try:
        data = memoryview(b"".join(lines))
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
    return True


def _private_opener(path: str, flags: int) -> int:
    """``open``'s opener for files only their owner may read (a new file is 0600)."""
    return os.open(path, flags, 0o600)


def _tighten(path: Path, mode: int) -> None:
    """Take away every permission beyond ``mode`` (never adds one)."""
    current = path.stat().st_mode & 0o777
    if current & ~mode:
        os.chmod(path, current & mode)


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


def _describe(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
    return f"internal error: {exc!r}"


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
