"""The model context: what a provider request is built from.

The context is a list of :data:`Message` values in conversation order. It is owned by the
session (one list per model context) and only ever appended to, so the request prefix stays
byte-identical from turn to turn and the provider's prompt cache keeps hitting.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from greenroom.protocols.content import ModelBlock, ToolContent, UserContent
from greenroom.protocols.settings import DEFAULT_MAX_IMAGE_BYTES

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
class ImageSource:
    """Where the provider reads the images of a request from (R-SEC-8).

    An accepted image (its block has ``sha256``) is the file of that name in
    ``attachments_dir``, the session's private copies; it is sent only when its bytes
    still have that hash. An image from an older trace (no ``sha256``) is read from its
    path as any named file is: beneath ``roots`` (the workspace, the scratchpad) without
    following a link out of them, never through a link as its last component, regular
    files only, at most ``max_bytes``, never inside ``private_dirs`` (the host's data dir,
    which the workspace may hold: R-SEC-7). An image that cannot be read so is sent as its
    ``[attached image: <path>]`` line."""

    attachments_dir: str
    roots: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    private_dirs: tuple[str, ...] = ()


@attrs.frozen(kw_only=True, slots=True)
class OutputFormat:
    """The answer a request must end with (R-OUT-1): JSON matching ``schema`` (an object
    root), named ``name`` for the provider. Each codec asks for it its own way: natively,
    or through the synthetic ``final_answer`` tool
    (:mod:`greenroom.protocols.structured`)."""

    name: str
    schema: dict[str, Any] = attrs.field(eq=False)


@attrs.frozen(kw_only=True, slots=True)
class ModelRequest:
    """Everything a provider codec needs to build one request body.

    ``messages`` is shared, not copied, between the session and the request for speed; it
    must not be mutated while the request is in flight (the supervisor only appends
    between requests). ``images`` says where its images are read from; without it they
    are read from their paths with the default limit. ``output``: the structured answer
    the task requires, if any (compaction and title requests never carry one).
    ``offered_output``: the answer a compaction's summary request does not ask for but
    whose tool it keeps: a codec that asks for ``output`` through the synthetic
    ``final_answer`` tool lists that tool still, without forcing it, so the request's
    tools are the turn's (R-COMPACT-5) and the history's ``final_answer`` calls name a
    tool the request defines.
    """

    model: str
    system: str | None
    tools: tuple[ToolSchema, ...]
    messages: tuple[Message, ...]
    max_tokens: int = 8192
    thinking_level: str | None = None
    supports_vision: bool = True
    images: ImageSource | None = None
    output: OutputFormat | None = None
    offered_output: OutputFormat | None = None
