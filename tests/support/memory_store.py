"""A trace store in memory, written against the interfaces alone (R-TRACE, R-CLUSTER-1).

:class:`MemoryTraceStore` is the three parts of a
:class:`~greenroom.actors.runtime.trace_store.TraceStore` — :class:`MemoryCatalog`,
:class:`MemoryTraceLog`, :class:`MemoryLedger` — keeping everything in dicts. Its log
acknowledges appends only when the test says so (``auto_ack=False``: as a networked store
would, later than the append), so tests can show that the actors need nothing of the file
backend and publish nothing before its record is stored (R-TRACE-3); with
``late_acks=True`` its own task acknowledges them, a checkpoint after they were appended.
The conformance suite (``tests/test_store_conformance.py``) runs it with the other
backends.

Stored metadata is kept as JSON bytes and read back through
:func:`~greenroom.actors.runtime.trace_store.check_meta`, as the file catalog reads
``session.json``, so ``corrupt`` can make it unreadable.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import trio

from greenroom.actors.runtime.errors import SeqRefused, SessionExists
from greenroom.actors.runtime.trace_sink import TraceSinkClosed, TraceWriteError
from greenroom.actors.runtime.trace_store import (
    LoadedTrace,
    StaleTraceWriter,
    StoredSession,
    StoredSessionMissing,
    StoredSessionUnreadable,
    check_meta,
)
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Output
from greenroom.protocols.trace import (
    UsageLine,
    UsageQuery,
    UsageRow,
    copy_records,
    parse_trace,
    summarize_usage,
)

__all__ = ["MemoryCatalog", "MemoryLedger", "MemoryTraceLog", "MemoryTraceStore"]


class MemoryTraceLog:
    """Traces in memory: ``traces[session_id]`` is the list of its traces, each a list of
    stored lines. Appends wait in ``pending`` until :meth:`acknowledge` (at once with
    ``auto_ack``); ``durable[session_id]`` counts the lines a :meth:`sync` covered."""

    def __init__(self, *, auto_ack: bool = True) -> None:
        self.auto_ack = auto_ack
        self.traces: dict[str, list[list[str]]] = {}
        self.pending: list[tuple[str, str]] = []
        self.durable: dict[str, int] = {}
        self.updated: dict[str, float] = {}
        self.syncs = 0
        self.released: list[str] = []
        self.refused: set[str] = set()
        """Sessions whose writes fail (their records are lost) while they are in it."""
        self.closed = False
        self._errors: dict[str, TraceWriteError] = {}
        self._next_seq: dict[str, int] = {}
        self._tickets_taken = 0
        self._tickets_done = 0
        self._waiting: list[tuple[int, trio.MemorySendChannel[TraceWritten]]] = []
        self._stored = trio.Event()
        self.appended = trio.Event()
        """Set by each append (the late acknowledger waits for it)."""

    async def acknowledge_late(self) -> None:
        """Acknowledge appended records from this task, one checkpoint after each append
        (as a store that writes elsewhere would), until cancelled."""
        while True:
            await self.appended.wait()
            self.appended = trio.Event()
            await trio.lowlevel.checkpoint()
            self.acknowledge()

    def start(self, session_id: str) -> None:
        self.traces[session_id] = [[]]
        self._next_seq[session_id] = 1
        self.updated[session_id] = time.time()

    async def load(self, session_id: str) -> LoadedTrace:
        loaded = await self.read_latest(session_id)
        self._next_seq[session_id] = loaded.last_seq + 1
        return loaded

    async def read_latest(self, session_id: str) -> LoadedTrace:
        await trio.lowlevel.checkpoint()
        traces = self.traces.get(session_id) or [[]]
        result = parse_trace("".join(traces[-1]), file="memory")
        every = [r for lines in traces for r in parse_trace("".join(lines), file="memory").records]
        last = max((r.seq or 0 for r in every), default=0)
        return LoadedTrace(
            records=tuple(result.records),
            errors=tuple(str(e) for e in result.errors),
            number=len(traces),
            last_seq=last,
        )

    async def read_after(self, session_id: str, after_seq: int = 0) -> list[Output]:
        await trio.lowlevel.checkpoint()
        return [
            r
            for lines in self.traces.get(session_id, [])
            for r in parse_trace("".join(lines), file="memory").records
            if (r.seq or 0) > after_seq
        ]

    def append(self, session_id: str, seq: int, line: str) -> int:
        if self.closed:
            raise TraceSinkClosed("closed")
        if not line.endswith("\n"):
            raise ValueError("a trace line must end with a newline")
        line.encode("utf-8")  # a lone surrogate raises (a ValueError) before anything is kept
        if seq < self._next_seq[session_id]:
            raise StaleTraceWriter(self.location(session_id), f"seq {seq} is stale")
        self._next_seq[session_id] = seq + 1
        self.pending.append((session_id, line))
        self.appended.set()
        return self._tickets_taken + 1

    def commit(self, session_id: str) -> bool:
        if self.auto_ack:
            self.acknowledge()
            return True
        return not any(sid == session_id for sid, _ in self.pending)

    def acknowledge(self) -> None:
        """Store every pending record and complete its ticket."""
        if not self.pending:
            return
        for session_id, line in self.pending:
            if session_id in self.refused:
                self._errors[session_id] = TraceWriteError(
                    self.location(session_id), "the memory refused the record"
                )
            elif session_id in self.traces:
                self.traces[session_id][-1].append(line)
                self.updated[session_id] = time.time()
        self.pending.clear()
        self._tickets_taken += 1
        self._tickets_done = self._tickets_taken
        due = [(t, reply) for t, reply in self._waiting if t <= self._tickets_done]
        self._waiting = [(t, reply) for t, reply in self._waiting if t > self._tickets_done]
        for ticket, reply in due:
            reply.send_nowait(TraceWritten(ticket=ticket))
        self._stored.set()

    def batch_done(self, ticket: int) -> bool:
        return ticket <= self._tickets_done

    def when_batch_done(self, ticket: int, reply: trio.MemorySendChannel[TraceWritten]) -> None:
        if self.batch_done(ticket):
            reply.send_nowait(TraceWritten(ticket=ticket))
        else:
            self._waiting.append((ticket, reply))

    def lost(self, session_id: str, ticket: int) -> TraceWriteError | None:
        return None  # as the file log: a failure is the sync's to report

    def error(self, session_id: str) -> TraceWriteError | None:
        return self._errors.get(session_id)

    def clear_error(self, session_id: str) -> None:
        self._errors.pop(session_id, None)

    async def sync(self, session_id: str | None = None) -> None:
        if self.closed:
            raise TraceSinkClosed("closed")
        self.syncs += 1
        if self.auto_ack:
            self.acknowledge()
        while self.pending:  # durable only once stored
            self._stored = trio.Event()
            await self._stored.wait()
        await trio.lowlevel.checkpoint()
        for sid in [session_id] if session_id is not None else list(self.traces):
            self.durable[sid] = sum(len(lines) for lines in self.traces.get(sid, []))
        failed = self._errors if session_id is None else {
            k: v for k, v in self._errors.items() if k == session_id
        }
        if failed:
            raise next(iter(failed.values()))

    async def fork(self, source_id: str, session_id: str, through_seq: int | None) -> int:
        await trio.lowlevel.checkpoint()
        source = self.traces.get(source_id)
        if source is None:
            raise StoredSessionMissing(f"no session {source_id!r} in memory")
        if through_seq is None:
            through_seq = (await self.read_latest(source_id)).last_seq
        copies: list[list[str]] = []
        last_seq = 0
        for lines in source:
            copied = copy_records(
                "".join(lines).encode(),
                source_id=source_id,
                session_id=session_id,
                through_seq=through_seq,
            )
            if copied.first_seq is not None and copied.first_seq > through_seq:
                break
            if copied.last_seq is not None:
                last_seq = copied.last_seq
                copies.append([line + "\n" for line in copied.data.decode().split("\n")[:-1]])
        if not 0 <= through_seq <= last_seq:
            raise SeqRefused(f"seq {through_seq} is out of range: records 0..{last_seq}")
        self.traces[session_id] = copies or [[]]
        self.durable[session_id] = sum(len(lines) for lines in copies)
        self.updated[session_id] = time.time()
        return through_seq

    def rotate(self, session_id: str) -> str:
        self.traces[session_id].append([])
        return f"memory trace {len(self.traces[session_id])}"

    def location(self, session_id: str) -> Path:
        return Path(f"memory:{session_id}/{len(self.traces.get(session_id) or [[]])}")

    def trace_number(self, session_id: str) -> int:
        return len(self.traces[session_id])

    def largest_input(self) -> int | None:
        return None

    def release(self, session_id: str) -> None:
        self.released.append(session_id)
        self._next_seq.pop(session_id, None)

    def drop(self, session_id: str) -> None:
        """The session was deleted: nothing of its trace is kept."""
        self.traces.pop(session_id, None)
        self.durable.pop(session_id, None)
        self.updated.pop(session_id, None)
        self._errors.pop(session_id, None)
        self._next_seq.pop(session_id, None)
        self.pending = [(sid, line) for sid, line in self.pending if sid != session_id]

    def durable_lines(self, session_id: str) -> list[str]:
        """The stored lines a sync covered, in order."""
        lines = [line for trace in self.traces.get(session_id, []) for line in trace]
        return lines[: self.durable.get(session_id, 0)]


class MemoryCatalog:
    """Session metadata in memory, as JSON bytes (``meta[session_id]``)."""

    def __init__(self, log: MemoryTraceLog) -> None:
        self.meta: dict[str, bytes] = {}
        self._log = log

    async def create(self, session_id: str, meta: dict[str, Any]) -> None:
        await trio.lowlevel.checkpoint()
        if session_id in self.meta:
            raise SessionExists(f"a session {session_id!r} is stored in memory")
        self.meta[session_id] = json.dumps(meta).encode("utf-8")

    async def read_meta(self, session_id: str) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        raw = self.meta.get(session_id)
        if raw is None:
            raise StoredSessionMissing(f"no session {session_id!r} in memory")
        return check_meta(raw, f"memory:{session_id}")

    async def exists(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return session_id in self.meta

    async def list_sessions(self) -> list[StoredSession]:
        await trio.lowlevel.checkpoint()
        found: list[StoredSession] = []
        for session_id, raw in self.meta.items():
            where = f"memory:{session_id}"
            try:
                meta: dict[str, Any] | None = check_meta(raw, where)
                problem = None
            except StoredSessionUnreadable as exc:
                meta, problem = None, str(exc)
            found.append(
                StoredSession(
                    session_id=session_id,
                    meta=meta,
                    problem=problem,
                    where=where,
                    updated_at=self._log.updated.get(session_id, 0.0),
                    traces=sum(1 for trace in self._log.traces.get(session_id, []) if trace),
                )
            )
        return found

    async def delete(self, session_id: str) -> None:
        self.meta.pop(session_id, None)
        self._log.drop(session_id)
        await trio.lowlevel.checkpoint()

    def corrupt(self, session_id: str) -> None:
        """Make the session's stored metadata unreadable (not JSON)."""
        self.meta[session_id] = b"{not json"


class MemoryLedger:
    """Usage rows in a list."""

    def __init__(self, log: MemoryTraceLog) -> None:
        self.rows: list[UsageRow] = []
        self._log = log

    def record_usage(self, row: UsageRow) -> None:
        if self._log.closed:
            raise TraceSinkClosed("closed")
        if row.request_key is not None:
            # A request's last row replaces the one written as it started, as in SQLite.
            for i, kept in enumerate(self.rows):
                if kept.request_key == row.request_key:
                    self.rows[i] = row
                    return
        self.rows.append(row)

    async def totals(self, session_id: str | None = None) -> dict[str, dict[str, int]]:
        await trio.lowlevel.checkpoint()
        totals: dict[str, dict[str, int]] = {}
        for row in self.rows:
            if session_id is not None and row.session_id != session_id:
                continue
            entry = totals.setdefault(
                row.session_id,
                dict.fromkeys(
                    ("input", "output", "cache_read", "cache_write", "total", "requests",
                     "compaction_failures", "titles"),
                    0,
                ),
            )
            for key in ("input", "output", "cache_read", "cache_write", "total"):
                entry[key] += getattr(row.usage, key)
            kind = {"request": "requests", "compaction_failed": "compaction_failures",
                    "title": "titles"}[row.kind]  # fmt: skip
            entry[kind] += 1
        return dict(sorted(totals.items()))

    async def report(self, query: UsageQuery) -> list[UsageLine]:
        await trio.lowlevel.checkpoint()
        return summarize_usage(self.rows, query)


class MemoryTraceStore:
    """A :class:`~greenroom.actors.runtime.trace_store.TraceStore` in memory whose writes
    complete when ``log.acknowledge()`` runs (or at once with ``auto_ack``, or from the
    store's own task with ``late_acks``)."""

    def __init__(
        self, data_dir: Path, *, auto_ack: bool = True, late_acks: bool = False
    ) -> None:
        self.data_dir = data_dir
        self.log = MemoryTraceLog(auto_ack=auto_ack and not late_acks)
        self.catalog = MemoryCatalog(self.log)
        self.ledger = MemoryLedger(self.log)
        self.late_acks = late_acks
        self._closed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.late_acks:
                nursery.start_soon(self.log.acknowledge_late)
            task_status.started()
            await self._closed.wait()
            nursery.cancel_scope.cancel()

    async def aclose(self) -> None:
        self.log.acknowledge()
        self.log.closed = True
        self._closed.set()
        await trio.lowlevel.checkpoint()
