"""Compaction as pure logic: the request, the verdict on a response, the new context.

A summarize compaction sends the old context — with the SAME system prompt and tool list,
so the provider's prompt cache still hits (R-COMPACT-5) — plus the turn's pending input and
the compaction prompt. A response is a valid summary only if it has no tool call and the
extraction ladder (R-COMPACT-4) finds non-empty text; otherwise each stray call is answered
with a synthetic failure (pairing kept) and the retry appends a correction note before the
prompt, so history is only ever appended to (R-COMPACT-6).

A summary request cannot send a context the provider refused as too long (R-COMPACT-9): after
a turn's overflow, and whenever a summary request overflows itself, the next one sends a
smaller copy of the old context (:func:`fit_base`: the largest tool results cut first, then
the largest texts, then the oldest messages left out), aimed at what the provider's error
says fits (:func:`overflow_share`). The history itself is never cut: only what the request
sends. A summary request that overflows once nothing more can be cut, or after the retry
budget, ends the compaction failed with a message that says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable

import attrs

from greenroom.protocols import markers
from greenroom.protocols.content import (
    ImageBlock,
    ModelBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    ToolContent,
    UserContent,
)
from greenroom.protocols.context import AssistantMessage, Message, ToolResult, UserMessage
from greenroom.protocols.retry import MAX_RETRIES, decide_retry
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
    the caller records it at once, then clears it).

    ``overflowed``, the provider's message when the compaction answers a turn's context
    overflow (R-COMPACT-9): that context did not fit, so the first request already sends
    it cut (:func:`fit_base`) to the share the message says fits (:func:`overflow_share`).
    A summary request that overflows is retried at once, without a wait, on a base cut
    smaller again the same way; its attempts count in the one retry budget, and it fails
    — with a message that says why — when the budget is spent or nothing more can be
    cut."""

    __slots__ = (
        "_base",
        "_collector",
        "_most",
        "_prompt",
        "_sent",
        "_tail",
        "attempt",
        "started",
        "usage",
    )

    def __init__(
        self, base: tuple[Message, ...], prompt: str, *, overflowed: str | None = None
    ) -> None:
        self._prompt = prompt
        self._base = base
        self._tail: tuple[Message, ...] = (prompt_message(prompt),)
        self._most: int | None = None
        """The most characters (:func:`base_size`) the base may send; None: all of it."""
        self._sent = base
        if overflowed is not None:
            self._most = int(base_size(base) * overflow_share(overflowed)) - base_size(self._tail)
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
        most = self._most
        self._sent = self._base if most is None else fit_base(self._base, most)
        return (*self._sent, *self._tail)

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
            self._tail = (
                *self._tail,
                *verdict.repair,
                prompt_message(self._prompt, correction=True),
            )
        elif failure.kind == "context_overflow":
            return self._overflowed(failure)
        decision = decide_retry(failure, self.attempt)
        if decision.retry and decision.delay_ms is not None:
            return RetrySummary(attempt=self.attempt, delay_ms=decision.delay_ms, error=failure)
        return SummaryFailed(attempt=self.attempt, error=failure)

    def _overflowed(self, failure: ModelError) -> SummaryOutcome:
        """The summary request was too long for the model: retry at once on a smaller
        base, or fail saying why (R-COMPACT-9, R-COMPACT-7)."""
        sent = base_size(self._sent)
        tail = base_size(self._tail)
        most = max(int((sent + tail) * overflow_share(failure.message)) - tail, 0)
        if self.attempt > MAX_RETRIES:
            message = (
                f"the summary request still overflowed the model's context window after "
                f"{self.attempt} attempts, the last with the old context cut to {sent} "
                f"characters: {failure.message}"
            )
        elif base_size(fit_base(self._base, most)) >= sent:
            message = (
                f"the summary request overflowed the model's context window and the old "
                f"context cannot be cut below {sent} characters: {failure.message}"
            )
        else:
            self._most = most
            # An overflow is an answer, not a hiccup: the smaller request goes at once.
            return RetrySummary(attempt=self.attempt, delay_ms=0, error=failure)
        error = attrs.evolve(failure, message=message)
        return SummaryFailed(attempt=self.attempt, error=error)


# -- a base that fits the model's window (R-COMPACT-9) ------------------------------------------

IMAGE_CHARS = 6000
"""What an image counts for in :func:`base_size`: about what a provider bills for a
screenshot, in characters of text at 4 a token."""

FIRST_CUT_FLOOR = 2000
"""No part is cut below this many characters before older messages are left out."""

LAST_CUT_FLOOR = 200
"""The fewest characters a cut part keeps once older messages are left out."""

OVERFLOW_MARGIN = 0.9
"""The share of what a provider's numbers say fits that the next request aims at: the
numbers count the system prompt and tools too, which are never cut."""

UNKNOWN_OVERFLOW_SHARE = 0.5
"""The share of an overflowed input the next request sends when the provider's error
gives no numbers."""

_CUT_ROOM = 120  # a cut's marker, near enough: a part this much over its cap is left whole

# Anthropic: "prompt is too long: 208310 tokens > 200000 maximum" and "input length and
# `max_tokens` exceed context limit: 178959 + 64000 > 200000"; OpenAI and vLLM: "maximum
# context length is 128000 tokens. However, your messages resulted in 130412 tokens" or
# "... you requested 132096 tokens (128000 in the messages, 4096 in the completion)".
_TOKENS_OVER = re.compile(r"(\d+) tokens? > (\d+)")
_PLUS_OVER = re.compile(r"(\d+) \+ (\d+) > (\d+)")
_MAXIMUM = re.compile(r"maximum context length is (\d+) tokens")
_IN_MESSAGES = re.compile(r"(\d+) in the messages, (\d+) in the completion")
_RESULTED = re.compile(r"resulted in (\d+) tokens")


def overflow_share(message: str) -> float:
    """The share of an input the provider refused as too long (its error ``message``) that
    the next, smaller request sends: what the error's token counts say fits, less
    :data:`OVERFLOW_MARGIN`; :data:`UNKNOWN_OVERFLOW_SHARE` when it gives none."""
    fits = _fitting_share(message)
    return UNKNOWN_OVERFLOW_SHARE if fits is None else fits * OVERFLOW_MARGIN


def _fitting_share(message: str) -> float | None:
    room: int
    used: int
    if plus := _PLUS_OVER.search(message):
        used, output, limit = (int(n) for n in plus.groups())
        room = limit - output
    elif over := _TOKENS_OVER.search(message):
        used, room = (int(n) for n in over.groups())
    elif maximum := _MAXIMUM.search(message):
        room = int(maximum.group(1))
        if parts := _IN_MESSAGES.search(message):
            used, output = (int(n) for n in parts.groups())
            room -= output
        elif resulted := _RESULTED.search(message):
            used = int(resulted.group(1))
        else:
            return None
    else:
        return None
    return room / used if 0 < room < used else None


def base_size(messages: Iterable[Message]) -> int:
    """The size of ``messages`` as a request's input, in characters: texts, thinking and a
    call's arguments as they are, an image as :data:`IMAGE_CHARS`. The model's tokenizer is
    not known here; this is the measure :func:`fit_base` aims with."""
    return sum(_part_size(part) for message in messages for part in message.content)


def _part_size(part: UserContent | ToolResult | ModelBlock | ToolContent) -> int:
    match part:
        case TextBlock(text=text) | ThinkingBlock(text=text):
            return len(text)
        case ImageBlock():
            return IMAGE_CHARS
        case ToolResult():
            return len(part.tool) + sum(_part_size(b) for b in part.content)
        case ToolCallBlock():
            arguments = part.invalid_arguments or json.dumps(part.arguments)
            return len(part.name) + len(arguments)
        case RedactedThinkingBlock(data=data):
            return len(data)


@attrs.frozen(kw_only=True, slots=True)
class _Cut:
    """How a base is cut: messages before ``start`` (after a leading context summary) left
    out; tool results above ``results`` characters and texts and images above ``texts``
    cut to them (None: not cut)."""

    start: int
    results: int | None = None
    texts: int | None = None


def fit_base(base: tuple[Message, ...], most: int) -> tuple[Message, ...]:
    """``base``, the old context a summary request sends, cut to at most ``most`` characters
    (:func:`base_size`) as far as it can be, largest parts first (R-COMPACT-9): tool results
    above a cap are cut to it — their start and end kept around a marker that says how much
    was left out — then texts too, and images become a line naming them, with the cap as
    high as fits but not below :data:`FIRST_CUT_FLOOR`; then the oldest messages are left
    out (a marker says how many), keeping a leading ``[context_summary]`` and the last user
    message on; then every part is cut down to :data:`LAST_CUT_FLOOR` at the least. Call
    arguments and thinking are never cut (a provider checks them); a tool result whose call
    was left out becomes text. Only what the request sends is cut, never the history."""
    if not base or base_size(base) <= most:
        return base
    first = 1 if _is_summary(base[0]) else 0
    largest = max((_part_size(p) for m in base for p in m.content), default=0)

    def fits(cut: _Cut) -> bool:
        return base_size(_render(base, first, cut)) <= most

    cap = _highest(FIRST_CUT_FLOOR, largest, lambda c: fits(_Cut(start=first, results=c)))
    if cap is not None:
        return _render(base, first, _Cut(start=first, results=cap))
    floor = _Cut(start=first, results=FIRST_CUT_FLOOR, texts=FIRST_CUT_FLOOR)
    cap = _highest(FIRST_CUT_FLOOR, largest, lambda c: fits(attrs.evolve(floor, texts=c)))
    if cap is not None:
        return _render(base, first, attrs.evolve(floor, texts=cap))
    # Where the kept messages may start: at a user message, so no call loses its result.
    starts = [i for i in range(first + 1, len(base)) if isinstance(base[i], UserMessage)]
    low, high = 0, len(starts)
    while low < high:  # the earliest start that fits; a later one never sends more
        middle = (low + high) // 2
        if fits(attrs.evolve(floor, start=starts[middle])):
            high = middle
        else:
            low = middle + 1
    if low < len(starts):
        return _render(base, first, attrs.evolve(floor, start=starts[low]))
    start = starts[-1] if starts else first
    cap = _highest(
        LAST_CUT_FLOOR, FIRST_CUT_FLOOR, lambda c: fits(_Cut(start=start, results=c, texts=c))
    )
    final = LAST_CUT_FLOOR if cap is None else cap
    return _render(base, first, _Cut(start=start, results=final, texts=final))


def _highest(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The highest cap in ``[low, high]`` that ``fits``, None when not even ``low`` does; a
    lower cap never sends more, so halving finds it."""
    if high < low or not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _is_summary(message: Message) -> bool:
    head = message.content[0] if message.content else None
    return (
        isinstance(message, UserMessage)
        and isinstance(head, TextBlock)
        and head.text.startswith(f"[{markers.CONTEXT_SUMMARY}]")
    )


def _render(base: tuple[Message, ...], first: int, cut: _Cut) -> tuple[Message, ...]:
    kept = [*base[:first], *base[cut.start :]]
    left_out = cut.start - first
    messages: list[Message] = []
    for index, message in enumerate(kept):
        if isinstance(message, AssistantMessage):
            blocks = tuple(
                TextBlock(text=_cut_text(b.text, cut.texts)) if isinstance(b, TextBlock) else b
                for b in message.content
            )
            messages.append(AssistantMessage(content=blocks))
            continue
        orphans = left_out > 0 and index == first
        parts: list[UserContent | ToolResult] = []
        if orphans:
            parts.append(TextBlock(text=_left_out_text(left_out)))
        for part in message.content:
            if isinstance(part, ToolResult):
                result = _cut_result(part, cut.results)
                # Its call was left out: a result without one is refused by the provider.
                parts.append(_result_as_text(result) if orphans else result)
            else:
                parts.append(_cut_user_part(part, cut.texts))
        messages.append(UserMessage(content=tuple(parts)))
    return tuple(messages)


def _left_out_text(count: int) -> str:
    return (
        f"[{count} earlier messages of this context are left out here so that the summary "
        f"request fits the model's context window]"
    )


def _cut_text(text: str, cap: int | None) -> str:
    """``text`` cut to about ``cap`` characters: its start and end around a marker."""
    if cap is None or len(text) <= cap + _CUT_ROOM:
        return text
    head = cap * 2 // 3
    tail = cap - head
    return (
        f"{text[:head]}\n[… {len(text) - cap} of {len(text)} characters left out here so "
        f"that the summary request fits the model's context window …]\n"
        f"{text[len(text) - tail :] if tail else ''}"
    )


def _image_line(image: ImageBlock) -> TextBlock:
    return TextBlock(text=f"[image left out to fit the model's context window: {image.path}]")


def _cut_user_part(part: UserContent, cap: int | None) -> UserContent:
    if isinstance(part, ImageBlock):
        return part if cap is None or cap >= IMAGE_CHARS else _image_line(part)
    return TextBlock(text=_cut_text(part.text, cap))


def _cut_result(result: ToolResult, cap: int | None) -> ToolResult:
    if cap is None or _part_size(result) <= cap + _CUT_ROOM:
        return result
    text = "\n".join(b.text for b in result.content if isinstance(b, TextBlock))
    images = [_image_line(b).text for b in result.content if isinstance(b, ImageBlock)]
    content = _cut_text("\n".join([text, *images]) if images else text, cap)
    return attrs.evolve(result, content=(TextBlock(text=content),))


def _result_as_text(result: ToolResult) -> TextBlock:
    body = "\n".join(
        b.text if isinstance(b, TextBlock) else _image_line(b).text for b in result.content
    )
    return TextBlock(text=f"[result of an earlier {result.tool} call, {result.status}]\n{body}")
