"""R-COMPACT-9, the pure parts: what a summary request sends after an overflow
(:func:`~greenroom.protocols.compaction.fit_base`), what a provider's overflow error says
fits (:func:`~greenroom.protocols.compaction.overflow_share`), and the bounded retries of
:class:`~greenroom.protocols.compaction.SummaryRequests` on a smaller base. The same against
a real window: ``test_compact9_overflow_window.py``."""

from __future__ import annotations

from test_compact9_overflow_window import LOG, LOG_LINES

from greenroom.protocols.compaction import (
    FIRST_CUT_FLOOR,
    RetrySummary,
    SummaryFailed,
    SummaryRequests,
    base_size,
    fit_base,
    overflow_share,
    summary_message,
)
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, Message, ToolResult, UserMessage
from greenroom.protocols.retry import MAX_RETRIES
from greenroom.protocols.settings import DEFAULT_COMPACT_PROMPT
from greenroom.protocols.stream import ModelError, StreamEvent, StreamFailed


def big_context(result: str = LOG) -> tuple[Message, ...]:
    return (
        UserMessage(content=(TextBlock(text="Read the log."),)),
        AssistantMessage(content=(ToolCallBlock(id="c1", name="read_log", arguments={}),)),
        UserMessage(
            content=(
                ToolResult(
                    call_id="c1",
                    tool="read_log",
                    status="ok",
                    is_error=False,
                    content=(TextBlock(text=result),),
                ),
            )
        ),
        AssistantMessage(content=(TextBlock(text="It looks fine."),)),
        UserMessage(content=(TextBlock(text="And the errors?"),)),
    )


def overflow(message: str = "prompt is too long") -> list[StreamEvent]:
    return [StreamFailed(error=ModelError(kind="context_overflow", message=message))]


def test_overflow_share_reads_the_providers_numbers() -> None:
    """The share of an overflowed input that fits, from each provider's own words, less a
    10% margin; half when the words give no numbers."""
    cases = {
        "prompt is too long: 208310 tokens > 200000 maximum": 200000 / 208310,
        "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000, "
        "decrease input length or `max_tokens` and try again": 136000 / 178959,
        "This model's maximum context length is 128000 tokens. However, your messages "
        "resulted in 130412 tokens. Please reduce the length of the messages.": 128000 / 130412,
        "This model's maximum context length is 32768 tokens. However, you requested 41648 "
        "tokens (37552 in the messages, 4096 in the completion).": 28672 / 37552,
    }
    for message, fits in cases.items():
        assert abs(overflow_share(message) - fits * 0.9) < 1e-9, message
    assert overflow_share("the request exceeds the available context size") == 0.5
    # Numbers that say nothing could fit are no guide: halve.
    assert (
        overflow_share("input length and `max_tokens` exceed context limit: 10 + 300 > 200") == 0.5
    )


def test_fit_base_cuts_the_largest_tool_result_first_and_keeps_the_rest() -> None:
    base = big_context()
    most = base_size(base) // 2
    fitted = fit_base(base, most)
    assert base_size(fitted) <= most
    assert fitted[:2] == base[:2] and fitted[3:] == base[3:]
    (result,) = fitted[2].content
    assert isinstance(result, ToolResult) and result.call_id == "c1"
    text = "".join(b.text for b in result.content if isinstance(b, TextBlock))
    assert text.startswith(LOG_LINES[0]) and text.endswith(LOG_LINES[-1])
    assert f"of {len(LOG)} characters left out here" in text
    assert fit_base(base, base_size(base)) == base  # what fits is sent as it is


def test_fit_base_leaves_out_the_oldest_messages_keeping_the_summary_and_pairing() -> None:
    """Below what cutting parts can reach, the oldest messages go (a marker says how many),
    a leading context summary stays, and no tool result is left without its call."""
    summary = summary_message("Earlier work.")
    base = (
        summary,
        *big_context(),
        AssistantMessage(content=(TextBlock(text="x" * 9000),)),
        UserMessage(content=(TextBlock(text="Go on."),)),
    )
    fitted = fit_base(base, FIRST_CUT_FLOOR)
    assert fitted[0] == summary
    head = fitted[1]
    assert isinstance(head, UserMessage)
    first = head.content[0]
    assert (
        isinstance(first, TextBlock)
        and "earlier messages of this context are left out" in first.text
    )
    for message in fitted:
        assert not any(isinstance(p, ToolResult) for p in message.content)  # no orphan
    assert base_size(fitted) <= FIRST_CUT_FLOOR
    assert len(fitted) == 2 and head.content[1:] == base[-1].content  # the latest, whole


def test_summary_requests_shrink_on_each_overflow_and_end_after_the_budget() -> None:
    """A summary request that overflows is retried at once on a smaller base; after the
    retry budget the compaction fails saying the summary request still overflows."""
    base = tuple(m for i in range(40) for m in big_context(f"{i} " + LOG[: 20_000 - i]))
    requests = SummaryRequests(base, DEFAULT_COMPACT_PROMPT)
    sizes: list[int] = []
    outcome: object = None
    for _ in range(MAX_RETRIES + 1):
        messages = requests.next_messages()
        sizes.append(base_size(messages))
        outcome = requests.feed(overflow())
        if isinstance(outcome, SummaryFailed):
            break
        assert isinstance(outcome, RetrySummary) and outcome.delay_ms == 0
    assert sizes[0] > base_size(base)  # not an overflow compaction: the first is whole
    assert sizes == sorted(set(sizes), reverse=True)
    assert isinstance(outcome, SummaryFailed)
    assert outcome.attempt == MAX_RETRIES + 1
    assert outcome.error.kind == "context_overflow"
    assert outcome.error.message.startswith(
        f"the summary request still overflowed the model's context window after "
        f"{MAX_RETRIES + 1} attempts"
    )


def test_summary_requests_after_a_turn_overflow_start_cut_and_stop_when_nothing_is_left() -> None:
    base = big_context()
    requests = SummaryRequests(
        base, DEFAULT_COMPACT_PROMPT, overflowed="prompt is too long: 12000 tokens > 6000 maximum"
    )
    first = requests.next_messages()
    assert base_size(first) < base_size(base)
    tiny = (UserMessage(content=(TextBlock(text="hi"),)),)
    requests = SummaryRequests(tiny, DEFAULT_COMPACT_PROMPT, overflowed="prompt is too long")
    assert requests.next_messages()[:1] == tiny
    outcome = requests.feed(overflow())
    assert isinstance(outcome, SummaryFailed) and outcome.attempt == 1
    assert "cannot be cut below 2 characters: prompt is too long" in outcome.error.message
