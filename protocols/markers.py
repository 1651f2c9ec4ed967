"""Markers in model-visible text and the summary-extraction ladder.

System markers are written ``[tag]…[/tag]``. When reading (old traces, old compaction
prompts) the legacy angle-bracket form ``<tag>…</tag>`` is recognised too (R-COMPACT-4).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

from greenroom.protocols.content import (
    ImageBlock,
    ModelBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    UserContent,
)

USER_STEERING = "user_steering"
TURN_ABORTED = "turn_aborted"
TURN_RETRIED = "turn_retried"
CONTEXT_SUMMARY = "context_summary"
SUMMARY = "summary"

DENIED_TEXT = "Tool call denied by user."
INTERRUPTED_TEXT = "[interrupted: tool aborted by user]"

HOST_LOST_TEXT = (
    "interrupted: the host running this call was lost before its result was recorded; "
    "it was not run again"
)
"""The result of a tool call whose host stopped mid-call (R-CLUSTER-2, R-HITL-4)."""

HOST_LOST_IDEMPOTENT_TEXT = (
    "interrupted: the host running this call was lost before its result was recorded; "
    "the tool is idempotent, so calling it again is safe"
)
"""The same for a tool declared ``@tool(idempotent=True)``."""

IN_DOUBT_FOUND_TEXT = (
    "the host running this call was lost before its result was recorded; the tool's "
    "check found that it had taken effect, and reported:"
)
"""The start of the result of a call in doubt whose ``check`` found its effect
(R-EFFECT-2); what the check reported follows."""

IN_DOUBT_DONE_TEXT = (
    "the host running this call was lost before its result was recorded; a person "
    "confirmed that it took effect (its own result is not known)"
)
"""The result of a call in doubt that a person said took effect (R-EFFECT-2)."""

IN_DOUBT_NOT_DONE_TEXT = (
    "the host running this call was lost before its result was recorded; a person "
    "confirmed that it did not take effect, and it was not run again"
)
"""The result of a call in doubt that a person said did not take effect (R-EFFECT-2)."""

HOST_LOST_CONTINUATION = (
    "[host lost] The host running this task stopped; the task continues now. "
    "Tool calls that had not finished say in their results what became of them: not run "
    "again, found done, or run again. "
    "Continue the task from where it stopped."
)
"""The steering a resumed task gets when its host stopped with work in flight."""

NO_ANSWER_TEXT = "No one answered the question in time; go on without the answer."
"""The result of an ``ask_user`` call whose wait for a person ran out (R-HITL-5)."""

DECLINED_ANSWER = "(the person declined to answer)"
"""The result of an ``ask_user`` call a person declined (a ``deny``: AG-UI's ``cancelled``
resume, an A2A ``{"decision": "deny"}`` data part, ``host.answer_approval``): the model is
told in words. The decline is the ``approval_decision`` ``deny`` the trace keeps, never these
words: a person's answer that says them is an answer like any other (R-HITL-5)."""

HOST_LOST_STREAM = "the host stopped while the model was answering; the request is sent again"
"""The ``request_end`` message of an attempt its host lost (it is retried, R-RETRY-4)."""

HOST_LOST_COMPACTION = "the host stopped during the compaction"
"""The ``compaction_end`` message of a compaction its host lost."""


def wrap(tag: str, body: str) -> str:
    """``[tag]body[/tag]``."""
    return f"[{tag}]{body}[/{tag}]"


def steering_text(
    blocks: Iterable[UserContent], *, supports_vision: bool
) -> tuple[TextBlock, tuple[ImageBlock, ...]]:
    """One ``[user_steering]`` text for queued steering input, and the images that follow
    it (R-STEER-2). Without vision, images fold into ``[attached image: <path>]`` lines
    inside the block, so the block stays one whole text."""
    lines: list[str] = []
    images: list[ImageBlock] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            lines.append(block.text)
        elif supports_vision:
            images.append(block)
        else:
            lines.append(f"[attached image: {block.path}]")
    return TextBlock(text=wrap(USER_STEERING, "\n".join(lines))), tuple(images)


def render_partial(blocks: Iterable[ModelBlock], results: Mapping[str, str] | None = None) -> str:
    """A plain-text rendering of (partial) model output, for ``[turn_aborted]`` and
    ``[turn_retried]`` blocks. Tool calls show their arguments and, when known, the result
    they already produced, so the model does not run them again (R-RETRY-4)."""
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            if block.text:
                parts.append(block.text)
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            continue
        elif isinstance(block, ToolCallBlock):
            args = block.invalid_arguments or json.dumps(
                block.arguments, ensure_ascii=False, sort_keys=True
            )
            line = f"[tool call {block.name} {args}]"
            if results is not None and block.id in results:
                line += f"\n[tool result {block.name}: {results[block.id]}]"
            parts.append(line)
    return "\n".join(parts)


def _tag_pattern(tag: str) -> re.Pattern[str]:
    t = re.escape(tag)
    return re.compile(rf"\[{t}\](.*?)\[/{t}\]|<{t}>(.*?)</{t}>", re.DOTALL)


_SUMMARY_PAIR = _tag_pattern(SUMMARY)
_SUMMARY_TAGS = re.compile(r"\[/?summary\]|</?summary>")


def extract_summary(output: str) -> str:
    """The summary in a compaction response, by the ladder of R-COMPACT-4: the first
    non-empty ``[summary]`` pair; if every pair is empty, the text left after stripping
    the tags; with no tags at all, the whole output. Returns "" for an empty summary."""
    pairs = list(_SUMMARY_PAIR.finditer(output))
    for match in pairs:
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        if body:
            return body
    if pairs or _SUMMARY_TAGS.search(output):
        return _SUMMARY_TAGS.sub("", output).strip()
    return output.strip()


def unwrap(tag: str, text: str) -> str | None:
    """The body of the first ``[tag]…[/tag]`` (or legacy ``<tag>…</tag>``) in ``text``."""
    match = _tag_pattern(tag).search(text)
    if match is None:
        return None
    return match.group(1) if match.group(1) is not None else match.group(2)


TITLE_PROMPT = (
    "Give a short title (at most eight words) for a conversation that starts like this. "
    "Answer with the title only."
)
"""The instruction of a title request (R-HOST-5); the conversation's opening follows it
after a blank line."""
