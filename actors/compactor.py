"""The compactor: runs one compaction's model requests for the supervisor.

It sends the compaction request through the task's provider (same system prompt and
tools as a normal turn: R-COMPACT-5), judges each response (R-COMPACT-6), and retries
failures — transport failures and invalid summaries alike — on the shared reconnect budget
and backoff of R-RETRY (R-COMPACT-7). ``auth`` stops at once. The supervisor owns
everything that follows: outputs, the trace rotation, the new context.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from greenroom.actors.llm_streamer import Backoff, ProviderTask
from greenroom.protocols import compaction
from greenroom.protocols.content import ModelBlock
from greenroom.protocols.context import Message, ModelRequest
from greenroom.protocols.retry import decide_retry
from greenroom.protocols.stream import (
    BlockCompleted,
    MessageCompleted,
    ModelError,
    StreamEvent,
    StreamFailed,
    TokenUsage,
    UsageReported,
)


@attrs.frozen(kw_only=True, slots=True)
class CompactionOutcome:
    """How a compaction ended: ``summary`` on success, else the last error."""

    summary: str | None
    attempt: int
    error: ModelError | None = None


class Compactor:
    """One compaction at a time for one task; ``backoff.skip()`` ends a wait early."""

    __slots__ = ("_on_usage", "_provider", "attempt", "backoff")

    def __init__(
        self, provider: ProviderTask, on_usage: Callable[[TokenUsage], None]
    ) -> None:
        self._provider = provider
        self._on_usage = on_usage
        self.backoff = Backoff()
        self.attempt = 0
        """The attempt in flight or last made (1-based; 0 before the first)."""

    async def run(
        self, template: ModelRequest, base: tuple[Message, ...], prompt: str
    ) -> CompactionOutcome:
        """Summarize ``base`` (the old context plus the turn's pending input). Cancel-safe:
        an interrupt stops the request or the backoff at once."""
        messages: tuple[Message, ...] = (*base, compaction.prompt_message(prompt))
        attempt = 0
        while True:
            attempt += 1
            self.attempt = attempt
            request = attrs.evolve(template, messages=messages)
            blocks, failure = await self._attempt(request)
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
            self.backoff.plan()
            await self.backoff.sleep(decision.delay_ms / 1000)

    async def _attempt(
        self, request: ModelRequest
    ) -> tuple[tuple[ModelBlock, ...], ModelError | None]:
        blocks: list[ModelBlock] = []
        result: list[ModelError | None] = []
        usage: list[TokenUsage] = []

        async def deliver(events: list[StreamEvent]) -> None:
            for event in events:
                if isinstance(event, BlockCompleted):
                    blocks.append(event.block)
                elif isinstance(event, UsageReported):
                    usage[:] = [event.usage]
                elif isinstance(event, MessageCompleted):
                    usage[:] = [event.usage]
                    result.append(None)
                elif isinstance(event, StreamFailed):
                    result.append(event.error)

        try:
            await self._provider.stream(request, deliver)
        finally:
            if usage:
                self._on_usage(usage[0])
        if not result:
            return (), ModelError(kind="malformed", message="stream ended without a result")
        return tuple(blocks), result[0]
