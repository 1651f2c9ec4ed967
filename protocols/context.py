"""The model context: what a provider request is built from.

The context is a list of :data:`Message` values in conversation order. It is owned by the
session (one list per model context) and only ever appended to, so the request prefix stays
byte-identical from turn to turn and the provider's prompt cache keeps hitting.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from greenroom.protocols.content import ModelBlock, ToolContent, UserContent

ToolResultStatus = Literal["ok", "error", "denied", "interrupted", "truncated"]


@attrs.frozen(kw_only=True, slots=True)
class ToolResult:
    """The answer to one tool call, paired by ``call_id`` (R-TOOL-7)."""

    call_id: str
    tool: str
    status: ToolResultStatus
    is_error: bool
    content: tuple[ToolContent, ...]


@attrs.frozen(kw_only=True, slots=True)
class UserMessage:
    """A user turn of the context: prompt text and images, tool results, markers."""

    content: tuple[UserContent | ToolResult, ...]


@attrs.frozen(kw_only=True, slots=True)
class AssistantMessage:
    """One complete model response as it enters the context."""

    content: tuple[ModelBlock, ...]


Message = UserMessage | AssistantMessage


@attrs.frozen(kw_only=True, slots=True)
class ToolSchema:
    """How a tool is described to the model."""

    name: str
    description: str
    input_schema: dict[str, Any]


@attrs.frozen(kw_only=True, slots=True)
class ModelRequest:
    """Everything a provider codec needs to build one request body.

    ``messages`` is shared, not copied, between the session and the request for speed; it
    must not be mutated while the request is in flight (the supervisor only appends
    between requests).
    """

    model: str
    system: str | None
    tools: tuple[ToolSchema, ...]
    messages: tuple[Message, ...]
    max_tokens: int = 8192
    thinking_level: str | None = None
    supports_vision: bool = True
