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
