"""Content blocks: the pieces of user input, model output and tool output.

Every block is a frozen, slotted, keyword-only attrs class whose JSON form carries a
``type`` tag (see :mod:`greenroom.protocols.converter`). The same classes appear in
outputs, trace records and the model context, so a block read back from a trace is
the block that was emitted.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs


@attrs.frozen(kw_only=True, slots=True)
class TextBlock:
    """Plain text, from the user, the model or a tool."""

    TYPE: ClassVar[str] = "text"
    text: str


@attrs.frozen(kw_only=True, slots=True)
class ImageBlock:
    """An image given by a path (inside the workspace or the session scratchpad).

    The file is read once, when the block is accepted (R-SEC-8): its bytes are copied into
    the session's private attachments, named by their SHA-256, and the accepted block
    carries that hash in ``sha256`` (and the media type it was sent as). Every later
    request sends that copy, never the file at ``path`` again; ``path`` stays the name the
    user gave. A block without ``sha256`` has not been accepted yet (or comes from a trace
    written before attachments existed)."""

    TYPE: ClassVar[str] = "image"
    path: str
    media_type: str | None = None
    sha256: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class ThinkingBlock:
    """Model reasoning. ``signature`` is the provider's opaque proof, kept byte-exact
    because the provider requires it when the thinking is sent back (R-RUN-9): Anthropic's
    signature, or the OpenAI Responses API's encrypted reasoning content, whose reasoning
    item id is ``item_id``."""

    TYPE: ClassVar[str] = "thinking"
    text: str
    signature: str | None = None
    item_id: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class RedactedThinkingBlock:
    """Encrypted reasoning: never shown, passed back unchanged where required."""

    TYPE: ClassVar[str] = "redacted_thinking"
    data: str


@attrs.frozen(kw_only=True, slots=True)
class ToolCallBlock:
    """A complete tool call from the model.

    ``arguments`` is the parsed JSON object. When the model's argument text was not a
    JSON object, ``arguments`` is empty and ``invalid_arguments`` holds the raw text, so
    the call can be answered with an error without running the tool (R-TOOL-5).
    """

    TYPE: ClassVar[str] = "tool_call"
    id: str
    name: str
    arguments: dict[str, Any]
    invalid_arguments: str | None = None


UserContent = TextBlock | ImageBlock
"""What a user (prompt or steering) may send."""

ModelBlock = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolCallBlock
"""What one model response is made of."""

ToolContent = TextBlock | ImageBlock
"""What a tool may return."""


def user_text(text: str) -> TextBlock:
    """A user text block, the usual input of :meth:`Session.run`."""
    return TextBlock(text=text)


def user_image(path: str, media_type: str | None = None) -> ImageBlock:
    """A user image block referring to a file."""
    return ImageBlock(path=path, media_type=media_type)
