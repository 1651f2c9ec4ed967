"""A host's trace sink in cluster mode: the local trace files, and every record of a cluster
session also appended, fenced, to the session's JetStream subject (R-CLUSTER-1, R-TRACE-2).

:class:`ReplicatingTraceSink` is a :class:`~greenroom.actors.runtime.trace_sink.TraceSink`
(the host writes its files as in single-host mode) that also queues each line of a
*replicated* session for that session's :class:`~greenroom.actors.cluster.traces.TraceWriter`.
A batch counts as done (:meth:`batch_done`, :meth:`when_batch_done`) only once its lines are
on disk *and* acknowledged by JetStream, and :meth:`sync` returns only then: so a client never
sees a record, and a tool with side effects never starts, before the record is in the cluster
and survives this host.

When JetStream refuses an append (another host fenced the trace: this host lost the session),
the session's lines are no longer appended, :meth:`error` reports a
:class:`~greenroom.actors.runtime.trace_sink.TraceWriteError` for its trace files, and
``on_fenced(session_id)`` is called so the host stops the session. Sessions that are not
replicated (subagents, say) write their files only.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import trio

from greenroom.actors.cluster.errors import ClusterUnavailable, Fenced
from greenroom.actors.cluster.traces import TraceWriter
from greenroom.actors.runtime.trace_sink import TraceSink, TraceWriteError
from greenroom.protocols.trace import trace_file_number

__all__ = ["ReplicatingTraceSink"]

_RETRY_S = 0.5
"""Wait before appending again after NATS was unreachable."""


class _Replica:
    """The lines of one session waiting for JetStream, in order."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.queue: list[tuple[int, int, str]] = []  # (ticket, file number, line)
        self.in_flight: list[tuple[int, int, str]] = []
        self.file: int | None = None
        self.error: TraceWriteError | None = None
        self.wakeup = trio.Event()
        self.idle = trio.Event()
        self.idle.set()

    def busy(self) -> bool:
        return bool(self.queue or self.in_flight)


class ReplicatingTraceSink(TraceSink):
    """The local trace sink plus fenced JetStream appends for replicated sessions.

    ``on_fenced(session_id)`` must not block or raise. Replication of a session starts with
    :meth:`replicate` (lines are queued from then on) and its appends run in
    :meth:`stream_to`, one task per session, started once its lease is held and its trace
    fenced.
    """

    def __init__(self, data_dir: Path | str, *, on_fenced: Callable[[str], None]) -> None:
        super().__init__(data_dir)
        self._on_fenced = on_fenced
        self._replicas: dict[str, _Replica] = {}
        self._pending: Counter[int] = Counter()
        self._waiters: list[tuple[int, Callable[[], None]]] = []

    # -- replication --------------------------------------------------------------------

    def replicate(self, session_id: str) -> None:
        """Queue every later line of ``session_id`` for JetStream."""
        self._replicas.setdefault(session_id, _Replica(session_id))

    def replicated(self, session_id: str) -> bool:
        """Whether ``session_id``'s lines go to JetStream too."""
        return session_id in self._replicas

    def forget(self, session_id: str) -> None:
        """Stop replicating ``session_id``; lines still queued are given up (their batches
        count as done, and the session's files report the error)."""
        replica = self._replicas.pop(session_id, None)
        if replica is not None:
            self._give_up(replica, replica.error or _lost(session_id))

    async def stream_to(
        self,
        session_id: str,
        writer: TraceWriter,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Append ``session_id``'s queued lines with ``writer`` (all that are queued at once,
        as one message) until cancelled or fenced."""
        self.replicate(session_id)
        replica = self._replicas[session_id]
        task_status.started()
        while self._replicas.get(session_id) is replica:
            if not replica.queue:
                replica.idle.set()
                replica.wakeup = trio.Event()
                await replica.wakeup.wait()
                continue
            replica.in_flight, replica.queue = replica.queue, []
            try:
                await self._append(writer, replica)
            except Fenced:
                error = TraceWriteError(
                    self.data_dir / session_id,
                    "another host took this session over: its trace is fenced",
                )
                replica.error = error
                self._replicas.pop(session_id, None)
                self._give_up(replica, error)
                self._on_fenced(session_id)
                return
            except ClusterUnavailable:
                # Keep the lines and their order; try again shortly.
                replica.queue = replica.in_flight + replica.queue
                replica.in_flight = []
                await trio.sleep(_RETRY_S)
                continue
            done = replica.in_flight
            replica.in_flight = []
            self._acknowledge(done)

    async def _append(self, writer: TraceWriter, replica: _Replica) -> None:
        lines: list[str] = []
        for _, number, line in replica.in_flight:
            if replica.file is not None and number != replica.file:
                if lines:
                    await writer.append(lines)
                    lines = []
                await writer.rotate(number)
            replica.file = number
            lines.append(line)
        if lines:
            await writer.append(lines)

    def _acknowledge(self, done: list[tuple[int, int, str]]) -> None:
        for ticket, _, _ in done:
            self._pending[ticket] -= 1
            if self._pending[ticket] <= 0:
                del self._pending[ticket]
        self._run_waiters()

    def _give_up(self, replica: _Replica, error: TraceWriteError) -> None:
        replica.error = error
        lost = replica.in_flight + replica.queue
        replica.in_flight, replica.queue = [], []
        self._acknowledge(lost)
        replica.idle.set()
        replica.wakeup.set()

    def _js_done(self, batch: int) -> bool:
        return not any(ticket <= batch for ticket in self._pending)

    def _run_waiters(self) -> None:
        ready = [(b, cb) for b, cb in self._waiters if self._js_done(b)]
        if not ready:
            return
        self._waiters = [(b, cb) for b, cb in self._waiters if not self._js_done(b)]
        for _, callback in ready:
            with contextlib.suppress(Exception):
                callback()

    def _replica_of(self, path: Path) -> _Replica | None:
        return self._replicas.get(path.parent.name) if self._replicas else None

    # -- the TraceSink API, extended ------------------------------------------------------

    def write(self, path: Path, line: str) -> int:
        """As :meth:`TraceSink.write`; a replicated session's line is also queued for
        JetStream under the same batch number."""
        ticket = super().write(path, line)
        replica = self._replica_of(path)
        if replica is not None and replica.error is None:
            replica.queue.append((ticket, trace_file_number(path.name) or 1, line))
            replica.idle = trio.Event() if replica.idle.is_set() else replica.idle
            self._pending[ticket] += 1
            replica.wakeup.set()
        return ticket

    def commit(self, path: Path) -> bool:
        """As :meth:`TraceSink.commit`, and False while JetStream has not acknowledged
        every line of the session (wait for the batch then)."""
        written = super().commit(path)
        replica = self._replica_of(path)
        return written and (replica is None or not replica.busy())

    def batch_done(self, batch: int) -> bool:
        """As :meth:`TraceSink.batch_done`, and JetStream acknowledged its lines."""
        return super().batch_done(batch) and self._js_done(batch)

    def when_batch_done(self, batch: int, callback: Callable[[], None]) -> None:
        """As :meth:`TraceSink.when_batch_done`, once JetStream acknowledged its lines too."""

        def after_local() -> None:
            if self._js_done(batch):
                callback()
            else:
                self._waiters.append((batch, callback))

        if TraceSink.batch_done(self, batch):
            after_local()
        else:
            super().when_batch_done(batch, after_local)

    def error(self, path: Path) -> TraceWriteError | None:
        """As :meth:`TraceSink.error`, or the fencing of a replicated session."""
        local = super().error(path)
        if local is not None:
            return local
        replica = self._replicas.get(path.parent.name)
        return replica.error if replica is not None else None

    async def sync(self, path: Path | None = None) -> None:
        """As :meth:`TraceSink.sync`, and every line written before is acknowledged by
        JetStream (R-TRACE-2 in the cluster). Raises TraceWriteError once fenced."""
        await super().sync(path)
        replicas = (
            list(self._replicas.values())
            if path is None
            else [r for r in [self._replica_of(path)] if r is not None]
        )
        for replica in replicas:
            await replica.idle.wait()
            if replica.error is not None:
                raise replica.error

    async def aclose(self) -> None:
        """As :meth:`TraceSink.aclose`; lines JetStream has not acknowledged by then are
        given up (their batches count as done)."""
        await super().aclose()
        for replica in list(self._replicas.values()):
            self._give_up(replica, replica.error or _lost(replica.session_id))


def _lost(session_id: str) -> TraceWriteError:
    return TraceWriteError(
        Path(session_id), "the session stopped being replicated before its trace was appended"
    )
