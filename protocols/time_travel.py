"""Fork and rewind, the pure parts (R-FORK-1, R-FORK-2): where a history may be cut, and
what closes a task the cut leaves open.

A fork copies a session's trace up to a ``seq``; a rewind cuts the history back to one. Either
way the history may end inside a task — a request streaming, calls running or waiting for a
person. Such a task is settled exactly as an interrupt settles it (R-ABORT-1..3): every call
without a result gets ``[interrupted: tool aborted by user]`` (a request waiting for a person
is denied by default first, R-APPROVE-5), a cut stream ends ``aborted``, then one ``abort``
(with the partial output, so carry-over is rebuilt from the trace) and one
``task_end(aborted)``. A history cut between a cut stream's ``request_end(aborted)`` and
the task's ``abort`` gets that ``abort`` (with the partial output the stream had
produced) and the ``task_end``: the stream is not ended twice. A history cut after a
failed attempt's ``request_end`` and before its retry's ``request_begin`` (the call it made
may be running, or the retry waiting) is a cut stream too, as a live interrupt there
records it: its calls are settled, the ``abort`` carries the failed attempt's output
(:func:`failed_output`) and says the message incomplete, and no second ``request_end`` is
written. A history cut between a task's ``abort`` and its ``task_end`` gets the
``task_end`` alone: its calls are settled and its carry-over is the abort's.
:func:`settlement` gives those records; the caller numbers and writes them. A manual
compaction in flight ends ``failed``. A history that ends in a prompt whose task had not
started (the cut fell between the two) gets the ``task_start``, then the
``abort`` and ``task_end(aborted)``, as an interrupt that came while the prompt was made
durable leaves it: no one takes that prompt up later as a run to start. Follow-ups the
history leaves queued (``task_queued`` not yet started) are dropped
(``task_queue_dropped``): a fork or a rewound session carries no queue.

:func:`rewind_problem` says why a rewind cannot go to a ``seq``, in words for the person who
asked: out of range, or cut by an earlier rewind (a fork reaches those too).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from greenroom.protocols import markers
from greenroom.protocols.content import ModelBlock, TextBlock
from greenroom.protocols.history import cut_by, live_records
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    RequestBegin,
    RequestEnd,
    TaskEnd,
    TaskQueueDropped,
    TaskStart,
    ToolCallOutput,
)
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.task import Phase, TaskRecord
from greenroom.protocols.trace import fit_partial, record_size

__all__ = ["failed_output", "interrupt_rest", "rewind_problem", "settlement"]


def settlement(
    record: TaskRecord,
    partial: Sequence[ModelBlock],
    *,
    session_id: str,
    reason: str,
    most: int | None = None,
    failed: Sequence[ModelBlock] | None = None,
) -> list[Output]:
    """The records (without ``seq``) that close the task a history leaves open, as an
    interrupt with ``reason`` would, and drop the follow-ups it leaves queued (an
    interrupt drops the queue: R-ABORT-1; a fork or rewind carries no queue, so no host
    runs them later); none when nothing is open or queued. ``record`` is the task state
    folded from that history (:func:`~greenroom.protocols.task.fold`), ``partial`` what
    the model request in flight had produced
    (:attr:`~greenroom.protocols.transcript.Transcript.attempt_blocks`), ``failed`` what
    :func:`failed_output` gives for that history (None: it does not end after a failed
    attempt); either is fitted to one record of ``most`` bytes (a cluster's trace; None:
    no limit) as an interrupt fits it (:func:`~greenroom.protocols.trace.fit_partial`)."""
    streaming = record.phase is Phase.MODEL
    if not streaming and failed is not None:
        partial = failed
    out = _settled_task(record, partial, session_id=session_id, reason=reason, most=most,
                        cut=streaming or failed is not None)  # fmt: skip
    if record.queued:
        out.append(
            TaskQueueDropped(session_id=session_id, run_id=record.run_id or "",
                             queue_ids=tuple(q.queue_id for q in record.queued), reason=reason)
        )
    return out


def interrupt_rest(
    record: TaskRecord,
    partial: Sequence[ModelBlock],
    *,
    session_id: str,
    reason: str,
    most: int | None = None,
) -> list[Output]:
    """What an interrupt of the open task still had to record when its host stopped
    between its records (R-ABORT-1, R-TRACE-4), without the ``task_end`` (the task's end
    writes it): after the cut stream's ``request_end(aborted)``, the ``abort`` with
    ``partial`` (:attr:`~greenroom.protocols.transcript.Transcript.attempt_blocks`);
    after the ``abort``, nothing; nothing either when no interrupt was under way.

    A host that takes such a task up ends it so: the user interrupted it, and nothing of
    it runs again. The follow-ups it leaves queued were queued after the interrupt (which
    recorded the queue dropped first): they stay queued."""
    if not (record.aborting or record.attempt_aborted) or record.run_id is None:
        return []
    settled = _settled_task(record, partial, session_id=session_id, reason=reason, most=most,
                            cut=record.phase is Phase.MODEL)  # fmt: skip
    return [output for output in settled if not isinstance(output, TaskEnd)]


def _settled_task(
    record: TaskRecord,
    partial: Sequence[ModelBlock],
    *,
    session_id: str,
    reason: str,
    most: int | None,
    cut: bool,
) -> list[Output]:
    run_id = started = record.run_id
    out: list[Output] = []
    prompt = record.unstarted
    if started is None and prompt is not None:
        run_id = prompt.run_id
        out.append(
            TaskStart(session_id=session_id, run_id=run_id, input_seq=prompt.seq,
                      output_schema=prompt.output_schema)
        )
    if run_id is None:
        return []
    if record.phase is Phase.COMPACTING:
        out.append(
            CompactionEnd(
                session_id=session_id,
                run_id=run_id,
                status="failed",
                attempt=1,
                error_message=reason,
            )
        )
        if record.kind == "compaction":
            return out  # a manual compaction has no task records
    task_end = TaskEnd(
        session_id=session_id,
        run_id=run_id,
        status="aborted",
        turns=record.turn if started is not None else 0,
        usage=record.usage if started is not None else TokenUsage(),
        wall_ms=0,
        message=reason,
    )
    if record.aborting:
        # The cut fell between the task's abort and its task_end: everything is settled
        # already. A second abort would replace the first one's carry-over (the calls'
        # results) with nothing, and the next request would leave the calls unpaired.
        return [*out, task_end]
    streaming = record.phase is Phase.MODEL
    asked = {r.call_id for r in record.pending_people if r.call_id not in record.allowed}
    unfinished = set(record.unfinished_calls())
    for call in record.calls:
        if call.id not in unfinished:
            continue
        if call.id in record.in_doubt:
            # Its host was lost before its result was recorded: whether it took effect is
            # unknown, and "aborted by user" would say it did not. Resolved by the note, as
            # an interrupt of the live task resolves it (R-EFFECT-2).
            out.extend(_resolved_by_the_note(session_id, run_id, call.id, call.name))
            continue
        if call.id in asked:
            out.append(
                ApprovalDecision(
                    session_id=session_id,
                    run_id=run_id,
                    call_id=call.id,
                    tool=call.name,
                    decision="deny",
                    by="default",
                )
            )
        out.append(
            ToolCallOutput(
                session_id=session_id,
                run_id=run_id,
                call_id=call.id,
                tool=call.name,
                status="interrupted",
                is_error=True,
                content=(TextBlock(text=markers.INTERRUPTED_TEXT),),
            )
        )
    if streaming and not record.attempt_aborted:
        # A cut after the attempt's request_end(aborted) and before its abort has the
        # stream ended already: only the abort, with what the stream had produced, is due;
        # so has a failed attempt's, whose output is the partial (``cut``).
        out.append(
            RequestEnd(
                session_id=session_id,
                run_id=run_id,
                turn=record.turn,
                status="aborted",
                attempt=record.attempt,
                error_message=reason,
            )
        )
    abort = Abort(session_id=session_id, run_id=run_id, reason=reason, partial=(),
                  message_complete=not cut)  # fmt: skip
    if cut and partial:
        blocks = tuple(partial)
        if most is not None:
            blocks = fit_partial(blocks, most, record_size(abort))
        abort = attrs.evolve(abort, partial=blocks)
    out.append(abort)
    out.append(task_end)
    return out


def _resolved_by_the_note(
    session_id: str, run_id: str, call_id: str, tool: str
) -> tuple[CallResolved, ToolCallOutput]:
    """A call in doubt that a cut settles: one ``call_resolved`` (the note, outcome
    unknown) and the host-lost result."""
    return (
        CallResolved(session_id=session_id, run_id=run_id, call_id=call_id, tool=tool,
                     by="note", outcome="unknown"),
        ToolCallOutput(session_id=session_id, run_id=run_id, call_id=call_id, tool=tool,
                       status="interrupted", is_error=True,
                       content=(TextBlock(text=markers.HOST_LOST_TEXT),)),
    )  # fmt: skip


def failed_output(records: Sequence[Output]) -> tuple[ModelBlock, ...] | None:
    """When ``records`` (a history, in ``seq`` order) end inside a task after a failed
    attempt's ``request_end`` — its calls may still run, its retry has not begun — the
    output an interrupt there records as the abort's partial (R-ABORT-2 case B,
    R-RETRY-4): the failed attempt's, or, when it wrote nothing, that of the turn's latest
    earlier attempt that did (what the retry note told the model). None otherwise: a
    failed stream's message is never committed, so an abort that called it complete would
    carry none of its text and calls."""
    blocks: list[ModelBlock] = []
    retried: tuple[ModelBlock, ...] = ()
    failed: tuple[ModelBlock, ...] | None = None
    for output in live_records(records):
        match output:
            case RequestBegin():
                if output.attempt == 1:
                    retried = ()  # a new turn, or one run again after an overflow
                blocks, failed = [], None
            case ModelMsg():
                blocks.append(output.block)
            case RequestEnd() if output.status not in ("ok", "aborted"):
                retried = tuple(blocks) or retried
                failed = retried
            case RequestEnd() | TaskStart() | TaskEnd() | Abort() | CompactionBegin():
                blocks, retried, failed = [], (), None
            case _:
                pass  # calls settled, questions asked: the retry has not begun
    return failed


def rewind_problem(records: Sequence[Output], to_seq: int, *, last_seq: int) -> str | None:
    """Why the session whose trace holds ``records`` (every file, or the current one when
    ``to_seq`` lies in it) cannot rewind to ``to_seq``, or None when it can. ``last_seq``
    is the session's last ``seq``."""
    if not 0 <= to_seq <= last_seq:
        return f"seq {to_seq} is out of range: the session's records are 0..{last_seq}"
    cut = cut_by(records, to_seq)
    if cut is not None:
        return (
            f"seq {to_seq} was cut from the history by the rewind at seq {cut.seq}; fork "
            f"at seq {to_seq} to continue from there"
        )
    return None
