"""Compaction (R-COMPACT): one compaction's lifecycle, and its model requests.

:class:`Compactor` sends the compaction request through the task's provider (same system
prompt and tools as a normal turn: R-COMPACT-5), judges each response (R-COMPACT-6), and
retries failures — transport failures and invalid summaries alike — on the shared
reconnect budget and backoff of R-RETRY (R-COMPACT-7). ``auth`` stops at once.

:class:`Compaction` is one compaction of a session for its supervisor: the
``compaction_begin`` / ``compaction_end`` outputs, the summary requests (or the discard),
the trace rotation that starts the new context (R-COMPACT-8), the ledger row of a failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

import attrs
import trio

from greenroom.protocols import compaction
from greenroom.protocols.content import ModelBlock
from greenroom.protocols.context import Message, ModelRequest
from greenroom.protocols.messages import (
    CompactorCommand,
    PlanBackoff,
    SkipBackoff,
    StartAttempt,
    StreamBatch,
    StreamerCommand,
    Summarize,
    SupervisorMessage,
)
from greenroom.protocols.outputs import (
    CompactionBegin,
    CompactionEnd,
    CompactionReason,
    TokenUsageOutput,
)
from greenroom.protocols.retry import decide_retry
from greenroom.protocols.stream import (
    BlockCompleted,
    MessageCompleted,
    ModelError,
    StreamFailed,
    TokenUsage,
    UsageReported,
)

if TYPE_CHECKING:
    from greenroom.actors.runtime.emitter import OutputEmitter
    from greenroom.actors.runtime.session import Session


@attrs.frozen(kw_only=True, slots=True)
class CompactionOutcome:
    """How a compaction ended: ``summary`` on success, else the last error."""

    summary: str | None
    attempt: int
    error: ModelError | None = None


class Compactor:
    """The compactor of one compaction: an actor that owns the summary requests and their
    backoff. Start it with ``await nursery.start(compactor.run, commands)``; it serves
    :data:`~greenroom.protocols.messages.CompactorCommand` messages (``Summarize``, whose
    outcome goes to the command's reply channel, and ``SkipBackoff``) until the channel
    closes or the task is cancelled. :meth:`summarize` is the same work as a call."""

    __slots__ = ("_on_usage", "_streamer", "attempt")

    def __init__(
        self,
        streamer: trio.MemorySendChannel[StreamerCommand],
        on_usage: Callable[[TokenUsage], None],
    ) -> None:
        self._streamer = streamer
        self._on_usage = on_usage
        self.attempt = 0
        """The attempt in flight or last made (1-based; 0 before the first)."""

    async def run(
        self,
        commands: trio.MemoryReceiveChannel[CompactorCommand],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve commands; each summary in a task of its own, so that a skip reaches its
        wait while it runs. Cancel-safe."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async with commands:
                async for command in commands:
                    match command:
                        case Summarize():
                            nursery.start_soon(self._serve_summary, command)
                        case SkipBackoff():
                            self._streamer.send_nowait(command)
                        case _:
                            assert_never(command)

    async def _serve_summary(self, command: Summarize) -> None:
        outcome = await self.summarize(command.template, command.base, command.prompt)
        command.reply.send_nowait(outcome)

    async def summarize(
        self, template: ModelRequest, base: tuple[Message, ...], prompt: str
    ) -> CompactionOutcome:
        """Summarize ``base`` (the old context plus the turn's pending input). Cancel-safe:
        an interrupt stops the request or the backoff at once."""
        messages: tuple[Message, ...] = (*base, compaction.prompt_message(prompt))
        attempt = 0
        delay_ms = 0
        while True:
            attempt += 1
            # During the backoff before it, the attempt that counts is the one that
            # failed; it becomes this one when its stream answers (see _attempt).
            self.attempt = attempt if delay_ms == 0 else attempt - 1
            request = attrs.evolve(template, messages=messages)
            blocks, failure = await self._attempt(request, attempt, delay_ms)
            if failure is None:
                verdict = compaction.judge(blocks)
                if verdict.summary is not None:
                    return CompactionOutcome(summary=verdict.summary, attempt=attempt)
                failure = ModelError(kind="malformed", message=verdict.error or "bad summary")
                messages = (
                    *messages,
                    *verdict.repair,
                    compaction.prompt_message(prompt, correction=True),
                )
            decision = decide_retry(failure, attempt)
            if not decision.retry or decision.delay_ms is None:
                return CompactionOutcome(summary=None, attempt=attempt, error=failure)
            delay_ms = decision.delay_ms
            self._streamer.send_nowait(PlanBackoff())

    async def _attempt(
        self, request: ModelRequest, attempt: int, delay_ms: int
    ) -> tuple[tuple[ModelBlock, ...], ModelError | None]:
        """One summary request through the LLM streamer (its backoff first, R-ACTOR-4)."""
        blocks: list[ModelBlock] = []
        usage: TokenUsage | None = None
        # Unbounded: the streamer delivers with send_nowait, one batch per network read.
        send, batches = trio.open_memory_channel[SupervisorMessage](math.inf)
        self._streamer.send_nowait(
            StartAttempt(request=request, attempt=attempt, delay_ms=delay_ms, reply=send)
        )
        try:
            async for batch in batches:
                assert isinstance(batch, StreamBatch)
                self.attempt = attempt
                for event in batch.events:
                    if isinstance(event, BlockCompleted):
                        blocks.append(event.block)
                    elif isinstance(event, UsageReported):
                        usage = event.usage
                    elif isinstance(event, MessageCompleted):
                        usage = event.usage
                        return tuple(blocks), None
                    elif isinstance(event, StreamFailed):
                        return tuple(blocks), event.error
        finally:
            if usage is not None:
                self._on_usage(usage)
        return (), ModelError(kind="malformed", message="stream ended without a result")


def compaction_due(session: Session) -> CompactionReason | None:
    """R-COMPACT-2: the automatic triggers, checked before each request."""
    settings = session.settings
    transcript = session.transcript
    if transcript.just_compacted:
        return None
    total = transcript.last_request_total
    if 0 < settings.max_context_length <= (total or 0):
        return "context"
    if 0 < settings.max_session_turns <= transcript.session_turns:
        return "turns"
    return None


class Compaction:
    """One compaction of ``session`` during run ``run_id`` (see the module docstring).
    ``add_usage`` adds the summary requests' usage to the task's total."""

    __slots__ = (
        "_add_usage",
        "_attempt",
        "_commands",
        "_emitter",
        "_run_id",
        "_running",
        "_session",
        "_streamer",
        "_turn",
    )

    def __init__(
        self,
        *,
        session: Session,
        emitter: OutputEmitter,
        streamer: trio.MemorySendChannel[StreamerCommand],
        run_id: str,
        turn: int,
        add_usage: Callable[[TokenUsage], None],
    ) -> None:
        self._session = session
        self._emitter = emitter
        self._streamer = streamer
        self._run_id = run_id
        self._turn = turn
        self._add_usage = add_usage
        self._commands: trio.MemorySendChannel[CompactorCommand] | None = None
        self._running = False
        self._attempt = 1

    async def run(self, reason: CompactionReason, template: ModelRequest) -> bool:
        """Compact; on success rotate the trace and start the new context. Returns whether
        it succeeded. A failure keeps the old context and trace file; the next trigger tries
        again (R-COMPACT-7). ``template`` is the task's request, whose settings the summary
        request keeps."""
        session = self._session
        emitter = self._emitter
        settings = session.settings
        self._running = True
        emitter.emit(CompactionBegin(session_id=session.id, run_id=self._run_id, reason=reason))
        emitter.flush()
        base, kept = session.transcript.compaction_base(keep_prompt=reason != "overflow")
        summary: str | None = None
        attempt = 1
        if settings.compact_mode == "summarize":
            compactor = Compactor(self._streamer, self._usage)
            # Unbounded: a summary command and skips, sent with send_nowait.
            send, commands = trio.open_memory_channel[CompactorCommand](math.inf)
            # One slot: the compactor's one reply never waits for the reader.
            reply_send, reply = trio.open_memory_channel[CompactionOutcome](1)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(compactor.run, commands)
                    self._commands = send
                    send.send_nowait(
                        Summarize(
                            template=template,
                            base=base,
                            prompt=settings.compact_prompt,
                            reply=reply_send,
                        )
                    )
                    outcome = await reply.receive()
                    send.close()
            finally:
                self._commands = None
                self._attempt = compactor.attempt
            attempt = outcome.attempt
            if outcome.summary is None:
                self._failed(outcome.error, attempt)
                return False
            summary = outcome.summary
        emitter.flush()  # no batch straddles two trace files
        await emitter.sync()
        trace_file = session.rotate_trace()  # R-COMPACT-8: one file, one context
        self._running = False
        emitter.emit(
            CompactionEnd(
                session_id=session.id,
                run_id=self._run_id,
                status="ok",
                attempt=attempt,
                trace_file=trace_file,
                summary=summary,
                kept_input=kept,
            )
        )
        emitter.flush()
        await emitter.sync()
        return True

    def end_interrupted(self, reason: str) -> None:
        """The task was interrupted (or failed) during the compaction: it ends failed."""
        if not self._running:
            return
        self._running = False
        self._emitter.emit(
            CompactionEnd(
                session_id=self._session.id,
                run_id=self._run_id,
                status="failed",
                attempt=max(1, self._attempt),
                error_message=reason,
            )
        )

    def _failed(self, error: ModelError | None, attempt: int) -> None:
        session = self._session
        message = error.message if error is not None else "no summary"
        if error is not None and error.kind == "auth":
            session.lock_auth(error.message)
        self._running = False
        self._emitter.emit(
            CompactionEnd(
                session_id=session.id,
                run_id=self._run_id,
                status="failed",
                attempt=attempt,
                error_message=message,
            )
        )
        session.record_usage(
            self._run_id,
            self._turn,
            TokenUsage(),
            kind="compaction_failed",
            status="failed",
            error_message=message,
        )
        self._emitter.flush()

    def _usage(self, usage: TokenUsage) -> None:
        self._add_usage(usage)
        self._emitter.emit(
            TokenUsageOutput(
                session_id=self._session.id,
                run_id=self._run_id,
                turn=self._turn,
                request=usage,
            )
        )
        self._session.record_usage(self._run_id, self._turn, usage)
        self._emitter.flush()
