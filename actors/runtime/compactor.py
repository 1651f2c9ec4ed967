"""One compaction (R-COMPACT) as its supervisor carries it out.

:class:`CompactionRun` emits ``compaction_begin``, sends the summary requests through the
task's LLM streamer — the same system prompt and tools as a normal turn (R-COMPACT-5), on
the one retry policy (R-COMPACT-6, R-COMPACT-7, decided by the pure
:class:`~greenroom.protocols.compaction.SummaryRequests`) — and ends with ``compaction_end``:
``ok`` after the trace rotation that starts the new context (R-COMPACT-8), or ``failed``
with the old context kept. Its stream batches reach it through the supervisor's inbox like a
turn's (one consumer of stream batches, R-ACTOR-4); it never waits itself: the supervisor
awaits :meth:`CompactionRun.finish` once the summary is there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.port import SessionPort
from greenroom.protocols.compaction import (
    RetrySummary,
    Summarized,
    SummaryFailed,
    SummaryRequests,
)
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.messages import PlanBackoff, StartAttempt, StreamerCommand
from greenroom.protocols.outputs import (
    CompactionBegin,
    CompactionEnd,
    CompactionReason,
    TokenUsageOutput,
)
from greenroom.protocols.stream import ModelError, StreamEvent, TokenUsage
from greenroom.protocols.trace import cut_to_fit, record_size

__all__ = ["CompactionRun"]


class CompactionRun:
    """One compaction of ``port``'s context during run ``run_id``; see the module
    docstring. ``number`` gives each summary request its number (the supervisor's
    numbering of model requests). ``refused`` checks a retry of the summary request
    against the session's cost budgets before it is sent, as the task checked the first
    (R-SHARE-4; None: a manual compaction's, not checked): True when the request could
    pass one, and the task was told to end ``budget_exceeded`` — the compaction then
    stays open, without a request, until the task's end ends it failed."""

    __slots__ = (
        "_billed",
        "_emitter",
        "_kept",
        "_number",
        "_port",
        "_refused",
        "_reported_attempt",
        "_requests",
        "_run_id",
        "_streamer",
        "_template",
        "_turn",
        "ready",
        "reason",
        "request",
        "running",
        "summary",
    )

    def __init__(
        self,
        *,
        port: SessionPort,
        emitter: OutputEmitter,
        streamer: trio.MemorySendChannel[StreamerCommand] | None,
        run_id: str,
        turn: int,
        reason: CompactionReason,
        template: ModelRequest,
        number: Callable[[], int],
        refused: Callable[[ModelRequest], bool] | None = None,
    ) -> None:
        self._port = port
        self._refused = refused
        self._emitter = emitter
        self._streamer = streamer
        self._run_id = run_id
        self._turn = turn
        self._template = template
        self._number = number
        self._requests: SummaryRequests | None = None
        self._kept: tuple[object, ...] = ()
        self._reported_attempt = 1
        self._billed: TokenUsage | None = None
        """What the summary request in flight reported first, until its last report."""
        self.reason = reason
        self.request = 0
        """The number of the summary request in flight (0: none)."""
        self.running = False
        self.ready = False
        """The summary is there (or none is needed): :meth:`finish` ends the compaction."""
        self.summary: str | None = None

    def start(self) -> None:
        """Emit ``compaction_begin`` and send the first summary request (``discard``: none;
        the compaction is :attr:`ready` at once)."""
        port = self._port
        emitter = self._emitter
        self.running = True
        emitter.emit(CompactionBegin(session_id=port.id, run_id=self._run_id, reason=self.reason))
        emitter.flush()
        base, self._kept = port.transcript.compaction_base(keep_prompt=self.reason != "overflow")
        if port.settings.compact_mode != "summarize" or self._streamer is None:
            self.ready = True
            return
        overflowed: str | None = None
        if self.reason == "overflow":
            # The context the turn sent did not fit: the summary request sends it cut to
            # what the provider's error says fits (R-COMPACT-9).
            failure = port.machine.record.failure
            overflowed = (failure[1] if failure is not None else None) or ""
        self._requests = SummaryRequests(base, port.settings.compact_prompt, overflowed=overflowed)
        self._send(self._summary_request(), delay_ms=0)

    def _summary_request(self) -> ModelRequest:
        assert self._requests is not None
        messages = self._requests.next_messages()
        # The summary is text: a structured task's answer format is not asked of it, but
        # its final_answer tool stays offered (R-COMPACT-5: the turn's tools, byte for
        # byte; and the history's final_answer calls need it defined).
        template = self._template
        return attrs.evolve(
            template, messages=messages, output=None, offered_output=template.output
        )

    def _send(self, request: ModelRequest, *, delay_ms: int) -> None:
        assert self._requests is not None and self._streamer is not None
        self.request = self._number()
        self._streamer.send_nowait(
            StartAttempt(
                request=request,
                attempt=self._requests.attempt,
                delay_ms=delay_ms,
                number=self.request,
            )
        )

    def feed(self, events: list[StreamEvent]) -> None:
        """One batch of the summary request in flight."""
        requests = self._requests
        assert requests is not None
        self._reported_attempt = requests.attempt
        outcome = requests.feed(events)
        if outcome is None:
            if requests.started is not None:
                # The summary's input is the whole context: a host that dies before its
                # end must leave it in the ledger (R-SHARE-3), as a turn's request does.
                self._billed, requests.started = requests.started, None
                self._port.record_usage(self._run_id, self._turn, self._billed, started=True)
            return
        self.request = 0
        if requests.usage is not None:
            self._usage(requests.usage)
        match outcome:
            case Summarized(summary=summary):
                self.summary = summary
                self.ready = True
            case RetrySummary(delay_ms=delay_ms):
                assert self._streamer is not None
                request = self._summary_request()
                # The failed attempt's cost is spent and its bound released: the retry
                # holds a bound of its own, or is not sent.
                if self._refused is not None and self._refused(request):
                    return
                # Skippable from the moment it is decided (R-RETRY-5).
                self._streamer.send_nowait(PlanBackoff())
                self._send(request, delay_ms=delay_ms)
            case SummaryFailed(error=error, attempt=attempt):
                self._failed(error, attempt)

    async def finish(self, sync: Callable[[], Awaitable[bool]]) -> None:
        """End the compaction ``ok``: the trace is made durable, rotated (R-COMPACT-8:
        one file, one context), and the new file starts with ``compaction_end``. ``sync``
        returns False when the task was told to stop meanwhile: the compaction is then
        left running, for the task's end to end it failed."""
        port = self._port
        emitter = self._emitter
        self.ready = False
        emitter.flush()  # no batch straddles two trace files
        if not await sync():
            return
        trace_file = port.rotate_trace()
        self.running = False
        record = port.machine.record
        answers = record.answers
        schema = answers.schema if answers is not None else None
        # The new file is read on its own when the session is loaded: its first record
        # keeps the session's allow_session rules (R-APPROVE-4), and the follow-ups and
        # the steering queued so far are recorded in it again (R-STEER-6, R-STEER-1).
        rules = tuple(sorted(record.session_rules))
        # ... and it keeps the task's count of turns and its usage (R-RUN-6, R-RUN-7); a
        # turn that overflowed runs again after this, so it is not counted (R-COMPACT-9).
        # A manual compaction is no task: nothing to keep.
        in_task = record.kind == "task"
        turn = max(0, record.turn - 1) if self.reason == "overflow" else record.turn
        if self.summary is not None:
            most = port.host.trace_log.largest_input()
            self.summary = _summary_in_a_record(self.summary, self._kept, schema, most, rules)
        emitter.emit(
            CompactionEnd(
                session_id=port.id,
                run_id=self._run_id,
                status="ok",
                attempt=self._requests.attempt if self._requests is not None else 1,
                trace_file=trace_file,
                summary=self.summary,
                kept_input=self._kept,  # type: ignore[arg-type]
                output_schema=schema,
                session_rules=rules,
                turn=turn if in_task else 0,
                usage=record.usage if in_task else None,
                # ... and the invalid answers it had: one repair round in all (R-OUT-1).
                answer_failures=answers.failures if answers is not None else 0,
            )
        )
        for queued in (*record.queued, *record.steering):
            emitter.emit(attrs.evolve(queued, seq=None))
        emitter.flush()
        await sync()

    def end_interrupted(self, reason: str) -> None:
        """The task was interrupted (or failed) during the compaction: it ends failed."""
        if not self.running:
            return
        self.running = False
        self.ready = False
        if self._billed is not None:
            # The summary request cut: billed for what it reported (its input at least).
            self._usage(self._billed)
        self._emitter.emit(
            CompactionEnd(
                session_id=self._port.id,
                run_id=self._run_id,
                status="failed",
                attempt=max(1, self._reported_attempt),
                error_message=reason,
            )
        )

    def _failed(self, error: ModelError, attempt: int) -> None:
        port = self._port
        self.running = False
        self._emitter.emit(
            CompactionEnd(
                session_id=port.id,
                run_id=self._run_id,
                status="failed",
                attempt=attempt,
                error_message=error.message,
                error_kind=error.kind,
            )
        )
        port.record_usage(
            self._run_id,
            self._turn,
            TokenUsage(),
            kind="compaction_failed",
            status="failed",
            error_message=error.message,
        )
        self._emitter.flush()

    def _usage(self, usage: TokenUsage) -> None:
        self._billed = None
        port = self._port
        usage = port.account.priced(usage)  # R-SHARE-3: a summary request costs too
        self._emitter.emit(
            TokenUsageOutput(session_id=port.id, run_id=self._run_id, turn=self._turn,
                             request=usage)
        )
        port.record_usage(self._run_id, self._turn, usage)
        self._emitter.flush()


def _summary_in_a_record(
    summary: str,
    kept: tuple[object, ...],
    schema: dict[str, Any] | None,
    most: int | None,
    rules: tuple[str, ...] = (),
) -> str:
    """``summary`` as the ``compaction_end`` record that starts the new context carries it
    beside the ``kept`` input, the task's output ``schema`` and the session's ``rules``, in
    a trace whose records hold at most ``most`` bytes of input (None: a file, no limit):
    whole when it fits, else its start and a marker saying what was left out. The
    compaction's token limit bounds a summary, but a cluster's NATS server may take less,
    and a record it cannot carry would stop the session on its host (R-SEC-9, R-CLUSTER-1,
    R-COMPACT-8). It is cut rather than split: the one record alone must rebuild the
    context, and a summary is already a cut."""
    if most is None:
        return summary
    # What the record carries beside it; the marker names the record's bytes, as every
    # cut's does, not the room those leave.
    room = most - sum(record_size(value) for value in (kept, schema, rules) if value)
    return cut_to_fit(summary, max(room, 0), None, record=most)
