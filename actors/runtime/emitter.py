"""The output emitter of one running session: seq, trace, transcript, publication.

Every output of a task goes through it (R-RUN-8). A traced output gets the session's next
``seq``, its record goes to the trace store and it is fed to the session's transcript and
task machine (both are folds of the trace, fed here and nowhere else); then
the batch is published — to the run's channel and to subscribers — only once the trace
store's batch holding its last record is done (written to the OS, so a crash of the host
cannot take it out of the trace), batches in order (R-TRACE-3). A record that cannot be
written — or encoded, despite the repairs at the boundaries — is reported once through
``on_failure`` (the supervisor ends the task ``failed``); the host and the other sessions
go on (R-SEC-1).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import trio

from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.runtime.trace_sink import TraceSinkClosed, TraceWriteError
from greenroom.actors.runtime.trace_store import (
    RecordInDoubt,
    RecordsGivenUp,
    StaleTraceWriter,
)
from greenroom.protocols import converter
from greenroom.protocols.content import TextBlock
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Output
from greenroom.protocols.text import repair_json, repair_text


class OutputEmitter:
    """Emits, traces and publishes the outputs of one session's run; see the module
    docstring. ``output`` is the run's channel (closed by the supervisor); ``on_failure``
    is called once, synchronously, with the message of the first trace failure of a task
    (the supervisor's: it sends itself ``TraceFailed``)."""

    def __init__(
        self,
        port: SessionPort,
        output: trio.MemorySendChannel[list[Output]],
        on_failure: Callable[[str], None],
    ) -> None:
        self._port = port
        self._output = output
        self._on_failure = on_failure
        self._batch: list[Output] = []
        # The trace store's batch that holds the last record of ``_batch`` (0: none), and
        # the batches flushed but not yet published, in order, with theirs.
        self._batch_ticket = 0
        self._unpublished: deque[tuple[int, list[Output]]] = deque()
        # Receipts to settle once a batch of ``_unpublished`` is published (set_when_durable),
        # each with the ticket of its own record.
        self._written_receipts: deque[tuple[list[Output], InputReceipt, int | None]] = deque()
        # The ticket of the last batch flushed with records, and the seq of the last output
        # whose record could not be appended: a receipt asks the store about its own record.
        self._flushed_ticket = 0
        self._unappended_seq = 0
        self._awaiting_store = False
        self._published: trio.Event | None = None
        # Made when a store first answers late (the cluster's): the file store never does,
        # so a session on files pays for neither the channel nor the task.
        self._nursery: trio.Nursery | None = None
        self._written: trio.MemorySendChannel[TraceWritten] | None = None
        self._durable_seq = 0  # every record up to this seq is known durable
        self._written_at_once = False  # the last commit() was written, not acknowledged late
        self.trace_error: str | None = None
        """Why the current task could not write its trace, once it could not."""

    def serve_in(self, nursery: trio.Nursery) -> None:
        """The nursery (the supervisor's, for the whole call, teardown included) in which
        the emitter starts its task for a store that acknowledges records late."""
        self._nursery = nursery

    def _when_written(self, ticket: int) -> None:
        """Ask the store for ``TraceWritten(ticket)`` on the emitter's inbox; the
        emitter's own task publishes what waited when it comes."""
        if self._written is None:
            assert self._nursery is not None, "serve_in() before the first output"
            # Unbounded: the trace store answers with send_nowait and must never wait; it
            # holds at most one answer, as one ticket is awaited at a time.
            self._written, answers = trio.open_memory_channel[TraceWritten](math.inf)
            self._nursery.start_soon(self._publish_written, answers)
        self._port.when_batch_done(ticket, self._written)

    async def _publish_written(self, answers: trio.MemoryReceiveChannel[TraceWritten]) -> None:
        async for _ in answers:
            self._on_trace_written()

    def begin_task(self) -> None:
        """A new task starts: its trace failures are its own."""
        self.trace_error = None

    def commit(self) -> None:
        """Write the session's buffered records to its trace file now (no fsync)."""
        self._written_at_once = self._port.commit()

    async def sync_quietly(self) -> None:
        """Fsync for teardown: a failure stays reported by the task's ``task_end`` and the
        next task may try the file again."""
        failure = await self._port.sync_trace_quietly()
        if failure is not None or self.trace_error is not None:
            self._port.clear_trace_error()

    async def sync_task_end(self, *, completed: bool) -> None:
        """After a task's ``task_end`` is committed: fsync it as :meth:`sync_quietly` does
        — unless the task completed, the trace store wrote it at once (the file store),
        and every record before it is durable already (its last turn boundary was synced:
        R-TRACE-2). That ``task_end`` is then only written (it survives the host's
        crash), and its fsync is the session's next one (its next prompt's) or the host's
        close: one fsync less for every task, and its end is not held for the disk. A
        power cut before then leaves the task open at its last turn boundary with all it
        said durable: :meth:`Host.resume` ends it completed without a request, and a new
        task recovers it as interrupted with its context whole (R-TRACE-4)."""
        port = self._port
        if (
            completed
            and self._durable_seq == port.last_seq - 1
            and self._written_at_once
            and not self._unpublished
            and self.trace_error is None
            and port.trace_error() is None
        ):
            return
        await self.sync_quietly()

    def emit_live(self, output: Output) -> None:
        """Add a live-only output (no seq, never traced) to the current batch."""
        self._batch.append(output)

    def emit(self, output: Any) -> Any:
        """Emit a traced output: assign its seq, trace it, feed the transcript. It is
        published with its batch once the trace holds it (see :meth:`flush`)."""
        port = self._port
        output = attrs.evolve(output, seq=port.next_seq())
        try:
            self._batch_ticket = port.append(output)
        except (TraceSinkClosed, StaleTraceWriter) as exc:
            # The host is going down under us, or the store holds a later record (another
            # writer took the session over): the output still reaches the live stream,
            # and the task ends failed.
            self._unappended_seq = output.seq
            self.trace_failed(f"cannot write the trace: {exc}")
        except Exception as exc:
            kept = self._trace_repaired(output, exc)
            if kept is None:
                return output
            output = kept
        port.transcript.apply(output)
        port.machine.observe(output)
        self._batch.append(output)
        return output

    def _trace_repaired(self, output: Any, error: Exception) -> Any:
        """A record that could not be encoded (text past every boundary repair): the trace
        holds it with its text repaired, if that encodes, and the task ends failed. Returns
        the output as traced, or None when even the repaired one could not be."""
        name = type(output).TYPE
        try:
            repaired = converter.output_from_dict(repair_json(converter.to_dict(output)))
            self._batch_ticket = self._port.append(repaired)
        except Exception:
            self._unappended_seq = output.seq
            self.trace_failed(
                f"cannot write the trace: the {name} record (seq {output.seq}) could not be "
                f"encoded and was lost: {error}"
            )
            return None
        self.trace_failed(
            f"cannot write the trace: the {name} record (seq {output.seq}) could not be "
            f"encoded ({error}); it was stored with the bad text replaced by U+FFFD"
        )
        return repaired

    def trace_failed(self, message: str) -> None:
        """End the task failed with ``message`` (R-SEC-1): the first failure names it."""
        if self.trace_error is None:
            self.trace_error = message
            self._on_failure(message)

    async def sync(self) -> None:
        """R-TRACE-2 for the task: a sync that fails ends the task (failed) — inside its
        scope at once, before it at the first checkpoint inside."""
        self.flush()
        through = self._port.last_seq
        try:
            await self._port.sync_trace()
        except (TraceWriteError, TraceSinkClosed) as exc:
            self.trace_failed(f"cannot write the trace: {exc}")
        else:
            self._durable_seq = max(self._durable_seq, through)

    def forward(self, outputs: Iterable[Output], origin: tuple[str, ...]) -> None:
        """Emit a subagent's outputs as live outputs of this run (R-HOST-4): its own get
        ``origin`` (root first, the subagent last); a grandchild's keep theirs. Never
        traced here: they are in the subagent's trace (and sent on by it only once they
        are). The supervisor calls it for each ``SubagentOutputs`` in its inbox."""
        append = self._batch.append
        for output in outputs:
            append(output if output.origin is not None else attrs.evolve(output, origin=origin))
        self.flush()

    def flush(self) -> None:
        """Hand the outputs emitted so far on as one batch: its records are written to
        the trace (committed) and it is published — unless the store cannot write them at
        once (it acknowledges late), or a batch before it still waits: then it is queued
        until the store's ``TraceWritten``. Never waits."""
        if not self._batch:
            return
        batch = self._batch
        ticket = self._batch_ticket
        self._batch = []
        self._batch_ticket = 0
        if ticket:
            self._flushed_ticket = ticket
        written = not ticket or self._port.commit()
        if not self._unpublished and (written or self._port.batch_done(ticket)):
            if ticket:
                self._check_trace()
            self._publish(batch)
            return
        self._unpublished.append((ticket, batch))
        if not self._awaiting_store:
            self._awaiting_store = True
            self._when_written(ticket)

    def set_when_durable(self, receipt: InputReceipt) -> None:
        """Settle ``receipt`` once every record flushed so far survives this host, a power
        cut included. A store that acknowledges late (the cluster's JetStream) has that
        once it is done with them, as when they are published. A store that writes them at
        once (the file store) has them only written then: ``receipt`` waits for the fsync
        that covers them, asked of the store's group-committed sync in a task of the
        host's, so a supervisor that ends meanwhile does not cancel it. Only a receipt
        (steering, a follow-up: rare) pays that fsync; publication waits for none. At the
        host's shutdown the receipt still settles, with what the store's last fsync made
        of the records (:func:`_settle_once_durable`).

        The receipt is for the input's record, the last one flushed, and is settled by
        what became of it: its ticket's :meth:`~TraceLog.lost`, not whether the session
        lost any record (a cluster host that gives the session up keeps what JetStream
        acknowledged: a steer's record acknowledged is in the cluster and runs, whatever
        became of the records after it). A record that could not be appended has no
        ticket: the session's trace failure answers for it."""
        port = self._port
        ticket = None if self._unappended_seq == port.last_seq else self._flushed_ticket or None
        if self._unpublished:
            self._written_receipts.append((self._unpublished[-1][1], receipt, ticket))
        else:
            port.host.start_task(functools.partial(_settle_once_durable, port, receipt, ticket))

    def _publish_first_unpublished(self) -> None:
        batch = self._unpublished.popleft()[1]
        self._publish(batch)
        waiting = self._written_receipts
        if waiting and waiting[0][0] is batch:
            _settle_published(self._port, batch, waiting)

    def _on_trace_written(self) -> None:
        # The store's answer came: publish what it covers, and wait for the next ticket.
        self._awaiting_store = False
        # The writer is done with the file's lines it held: the rest can be written now,
        # and then every queued batch is (they all hold records of this one file).
        written = self._port.commit()
        self._check_trace()
        unpublished = self._unpublished
        batch_done = self._port.batch_done
        while unpublished and (written or batch_done(unpublished[0][0])):
            self._publish_first_unpublished()
        if unpublished:
            self._awaiting_store = True
            self._when_written(unpublished[0][0])
        elif self._published is not None:
            self._published.set()

    def _check_trace(self) -> None:
        error = self._port.trace_error()
        if error is not None:
            # Its outputs are published all the same: the task_end that follows says
            # that the trace lacks them.
            self.trace_failed(f"cannot write the trace: {error}")

    async def wait_published(self) -> None:
        """Wait until every flushed batch has been published, which it is once the trace
        store is done with its records. The current, unflushed batch is not waited for."""
        while self._unpublished:
            self._published = trio.Event()
            await self._published.wait()
        self._published = None

    def publish_unwritten(self) -> None:
        """Publish at once the flushed batches still waiting for the trace, in order: teardown
        uses it when the trace store does not answer within the bound, so readers still get
        every output (the task's ``task_end`` above all)."""
        # Their records are not acknowledged yet, and this emitter stops listening for the
        # store: each receipt waiting for them asks the store itself, in a task of the
        # host's, so that it settles with the truth however the store ends.
        start_task = self._port.host.start_task
        while self._written_receipts:
            _, receipt, ticket = self._written_receipts.popleft()
            start_task(functools.partial(_settle_once_durable, self._port, receipt, ticket))
        while self._unpublished:
            self._publish(self._unpublished.popleft()[1])

    def _publish(self, batch: list[Output]) -> None:
        self._port.publish(batch)
        # A host that stopped reading this run loses nothing: subscribers and the trace
        # still get every output.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._output.send_nowait(batch)


def _settle_published(
    port: SessionPort,
    batch: list[Output],
    waiting: deque[tuple[list[Output], InputReceipt, int | None]],
) -> None:
    """Settle the receipts waiting for ``batch``, which the store is done with: durable,
    unless the store gave the receipt's record up rather than stored it (the cluster's
    store, once the session's trace was fenced by another host, or its replication
    stopped, before JetStream acknowledged it): it never reached the trace a host taking
    the session up reads, so the input will not run, and a receipt said durable would
    have its client told ``queued: true``. A record the store could not say either of
    (:class:`RecordInDoubt`) leaves the receipt in doubt: neither ``queued`` nor 410."""
    while waiting and waiting[0][0] is batch:
        _, receipt, ticket = waiting.popleft()
        error = port.trace_error() if ticket is None else _record_lost(port, ticket)
        if error is None:
            receipt.durable()
        elif isinstance(error, RecordInDoubt):
            receipt.doubt(_in_doubt(error))
        else:
            receipt.drop(f"its record did not reach the cluster's trace ({error})")


def _in_doubt(error: RecordInDoubt) -> str:
    """A receipt's reason for a record that may or may not be in the cluster's trace."""
    return f"its record may or may not have reached the cluster's trace ({error})"


def _record_lost(port: SessionPort, ticket: int) -> TraceWriteError | None:
    """Why the record of ``ticket``, done, will never be durable (None: it is, once synced)."""
    return port.host.trace_log.lost(port.id, ticket)


DURABLE_WAIT_S = 30.0
"""How long a receipt waits, at most, for the store to say whether its record is durable
once the host shuts down (as long as the host's own shutdown may take)."""


async def _settle_once_durable(
    port: SessionPort, receipt: InputReceipt, ticket: int | None
) -> None:
    # Shielded: the host's shutdown cancels its tasks, and a receipt cancelled here would
    # never settle (its caller waiting its whole bound); the store's final fsync answers
    # this sync with whether it covered the record. Bounded, should a store's close be
    # cut short and never answer.
    failure: Exception | None = None
    with trio.CancelScope(shield=True) as waiting:
        waiting.deadline = trio.current_time() + DURABLE_WAIT_S
        try:
            await port.sync_trace()
        except (TraceWriteError, TraceSinkClosed) as exc:
            failure = exc
    if ticket is not None and (
        failure is None or isinstance(failure, StaleTraceWriter | RecordsGivenUp | RecordInDoubt)
    ):
        # Whether the receipt's own record was given up is its ticket's to say (one
        # JetStream acknowledged is in the cluster, and runs), whatever the sync said:
        # released meanwhile (or replicated again), the session's sync knows nothing of it.
        failure = _record_lost(port, ticket)
    if waiting.cancelled_caught:
        # Written and handed to the running session, only not known fsynced: it runs unless
        # the host dies first, so a client told "dropped" and sending it again would have
        # it run twice.
        receipt.doubt(f"its record was not known durable within {DURABLE_WAIT_S:g} s")
    elif isinstance(failure, RecordInDoubt):
        receipt.doubt(_in_doubt(failure))
    elif isinstance(failure, StaleTraceWriter | RecordsGivenUp):
        # Given up unacknowledged (fenced, the session or the host's store given up): no
        # later sync makes it durable, open session or not.
        receipt.drop(f"its record did not reach the cluster's trace ({failure})")
    elif failure is not None and port.closed:
        # No next sync will report it: the session is gone, its record not durable.
        receipt.drop(f"session {port.id} closed before its record was durable ({failure})")
    else:
        # A sync that fails in a running session leaves the failure sticky in the store:
        # the task's next sync raises it and the task ends failed naming it, as after a
        # prompt's failed sync.
        receipt.durable()


def repaired_blocks(blocks: tuple[Any, ...]) -> tuple[Any, ...]:
    """User or tool content with every lone surrogate replaced (R-SEC-1); the same tuple
    when nothing needed it (the usual case costs one ASCII check per text)."""
    repaired: list[Any] | None = None
    for i, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text = repair_text(block.text)
            new = block if text is block.text else TextBlock(text=text)
        else:
            new = _repaired_value(block)
        if new is not block and repaired is None:
            repaired = list(blocks[:i])
        if repaired is not None:
            repaired.append(new)
    return blocks if repaired is None else tuple(repaired)


def _repaired_value(block: Any) -> Any:
    fields = attrs.asdict(block, recurse=False)
    changed = {k: v for k, v in fields.items() if repair_json(v) is not v}
    if not changed:
        return block
    return attrs.evolve(block, **{k: repair_json(v) for k, v in changed.items()})
