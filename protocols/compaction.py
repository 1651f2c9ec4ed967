"""Compaction as pure logic: the request, the verdict on a response, the new context.

A summarize compaction sends the old context — with the SAME system prompt and tool list,
so the provider's prompt cache still hits (R-COMPACT-5) — plus the turn's pending input and
the compaction prompt. A response is a valid summary only if it has no tool call and the
extraction ladder (R-COMPACT-4) finds non-empty text; otherwise each stray call is answered
with a synthetic failure (pairing kept) and the retry appends a correction note before the
prompt, so history is only ever appended to (R-COMPACT-6).
"""

from __future__ import annotations

import attrs

from greenroom.protocols import markers
from greenroom.protocols.content import ModelBlock, TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, Message, ToolResult, UserMessage
from greenroom.protocols.retry import decide_retry
from greenroom.protocols.stream import ModelError, ResponseCollector, StreamEvent, TokenUsage

CORRECTION_NOTE = (
    "That was not a valid summary: do not call tools and do not answer with an empty "
    "summary. Reply with the summary only, between [summary] and [/summary]."
)
STRAY_CALL_TEXT = "Tool calls are not available while summarizing; no tool was run."


@attrs.frozen(kw_only=True, slots=True)
class Verdict:
    """The judgement on one compaction response: ``summary`` when valid, else ``error``
    and the messages the retry must append (the response and its repair)."""

    summary: str | None
    error: str | None = None
    repair: tuple[Message, ...] = ()


def prompt_message(prompt: str, *, correction: bool = False) -> UserMessage:
    """The user message that asks for the summary (with the correction note on retries)."""
    text = f"{CORRECTION_NOTE}\n\n{prompt}" if correction else prompt
    return UserMessage(content=(TextBlock(text=text),))


def judge(blocks: tuple[ModelBlock, ...]) -> Verdict:
    """Decide whether a compaction response is a valid summary (R-COMPACT-6)."""
    calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if calls:
        results = tuple(
            ToolResult(
                call_id=c.id,
                tool=c.name,
                status="error",
                is_error=True,
                content=(TextBlock(text=STRAY_CALL_TEXT),),
            )
            for c in calls
        )
        names = ", ".join(c.name for c in calls)
        return Verdict(
            summary=None,
            error=f"the summary response called tools ({names})",
            repair=(AssistantMessage(content=blocks), UserMessage(content=results)),
        )
    summary = markers.extract_summary(text)
    if not summary:
        repair: tuple[Message, ...] = (
            (AssistantMessage(content=blocks),) if any(True for _ in blocks) else ()
        )
        return Verdict(summary=None, error="the summary was empty", repair=repair)
    return Verdict(summary=summary)


def summary_message(summary: str) -> UserMessage:
    """The first message of the fresh context (R-COMPACT-3)."""
    return UserMessage(
        content=(TextBlock(text=markers.wrap(markers.CONTEXT_SUMMARY, summary)),)
    )


@attrs.frozen(kw_only=True, slots=True)
class Summarized:
    """The compaction's summary request succeeded with ``summary``."""

    summary: str
    attempt: int


@attrs.frozen(kw_only=True, slots=True)
class RetrySummary:
    """The attempt failed (transport or an invalid summary): try again after ``delay_ms``."""

    attempt: int
    delay_ms: int
    error: ModelError


@attrs.frozen(kw_only=True, slots=True)
class SummaryFailed:
    """The compaction failed: the retry budget is spent, or ``auth`` stopped it at once
    (R-COMPACT-7)."""

    attempt: int
    error: ModelError


SummaryOutcome = Summarized | RetrySummary | SummaryFailed


class SummaryRequests:
    """The summary requests of one ``summarize`` compaction, pure: what to send, and the
    verdict on each response (R-COMPACT-6) on the one retry policy (R-COMPACT-7).

    :meth:`next_messages` gives the next request's messages (the old context, then the
    prompt, with the failed responses and their repair before a corrected prompt);
    :meth:`feed` takes the attempt's stream events and, once it has ended, returns its
    outcome. ``usage`` of the attempt that just ended is kept for the caller to record;
    ``started``, what the attempt's stream reported first while it still runs (R-SHARE-3:
    the caller records it at once, then clears it)."""

    __slots__ = ("_collector", "_messages", "_prompt", "attempt", "started", "usage")

    def __init__(self, base: tuple[Message, ...], prompt: str) -> None:
        self._prompt = prompt
        self._messages: tuple[Message, ...] = (*base, prompt_message(prompt))
        self._collector = ResponseCollector()
        self.attempt = 0
        self.usage: TokenUsage | None = None
        self.started: TokenUsage | None = None

    def next_messages(self) -> tuple[Message, ...]:
        """Start the next attempt; the messages its request sends."""
        self.attempt += 1
        self._collector = ResponseCollector()
        self.usage = None
        self.started = None
        return self._messages

    def feed(self, events: list[StreamEvent]) -> SummaryOutcome | None:
        """One batch of the current attempt; its outcome once the stream ended."""
        collector = self._collector
        if collector.done:
            return None
        first_report = collector.usage is None
        if not collector.feed(events):
            if first_report:
                self.started = collector.usage
            return None
        self.usage = collector.usage
        failure = collector.error
        if failure is None:
            verdict = judge(tuple(collector.blocks))
            if verdict.summary is not None:
                return Summarized(summary=verdict.summary, attempt=self.attempt)
            failure = ModelError(kind="malformed", message=verdict.error or "bad summary")
            self._messages = (
                *self._messages,
                *verdict.repair,
                prompt_message(self._prompt, correction=True),
            )
        decision = decide_retry(failure, self.attempt)
        if decision.retry and decision.delay_ms is not None:
            return RetrySummary(attempt=self.attempt, delay_ms=decision.delay_ms, error=failure)
        return SummaryFailed(attempt=self.attempt, error=failure)
