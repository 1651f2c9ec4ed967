"""Sans-IO codec for OpenAI Chat Completions and OpenAI-compatible servers.

Covers ``POST /v1/chat/completions`` with ``stream: true`` as spoken by OpenAI, vLLM,
llama.cpp's ``llama-server`` and Ollama's ``/v1``. Three pieces, none of which does I/O:

* :func:`build_request` / :class:`RequestEncoder` turn a :class:`ModelRequest` into the JSON
  body. The encoding is deterministic (same context, same dicts, same JSON), so the prefix of
  turn N+1 is byte-identical to turn N and the server's prompt cache keeps hitting.
* :class:`OpenAIStreamDecoder` turns the raw response body into the typed events of
  :mod:`greenroom.protocols.stream`.
* :func:`classify_error` turns a non-200 response into a :class:`ModelError` (R-RETRY-1).

Decoder invariants (what the supervisor may rely on):

* Block indices are the decoder's own, assigned in order of appearance. At most one text or
  thinking block is open at a time: a block of another kind opening completes it, so a text
  that resumes after a tool call opened is a new block.
* A tool call is completed only when the message is known to be complete: at a
  ``finish_reason`` other than ``length``, or at ``data: [DONE]``. With ``length`` every
  open tool call becomes :class:`ToolCallTruncated` instead and must never run (R-TOOL-5).
  Tool calls complete in the order of their wire ``index`` (the model's call order).
* Exactly one terminal event, after which all input is ignored. ``MessageCompleted`` comes at
  ``[DONE]``; a stream that ends without ``[DONE]`` but after a ``finish_reason`` is accepted
  too, because the finish reason already proves the model finished (llama.cpp and gateways
  are known to drop the sentinel, and only the usage chunk can be lost). A stream that ends
  without any finish reason is ``StreamFailed(malformed)``: a dropped connection must never
  look like an answer, and its half-streamed tool calls are never completed.
* An empty ``finish_reason`` (sent on every chunk by some servers) is "not finished".
* ``MessageCompleted`` carries the chunks' ``id`` and ``model`` as ``response_id`` and
  ``response_model`` (None when the server sends none).
* ``delta.content`` may be a string or a list of typed parts (``text``; ``thinking``, as
  Mistral sends it); ``reasoning_content`` and ``reasoning`` are thinking; a legacy
  ``delta.function_call`` is one tool call with an id derived from the response id.
* Two tool calls with one id in a message are ``StreamFailed(malformed)`` (R-SEC-6);
  arguments nested deeper than ``MAX_ARGUMENT_DEPTH`` are that call's invalid arguments.
  Lone UTF-16 surrogates in every string passed on (text, thinking, arguments, ids, the
  model, the finish reason, an error's words) become U+FFFD (R-SEC-1).
* A body past :data:`~greenroom.protocols.sse.MAX_RESPONSE_BYTES` is
  ``StreamFailed(malformed)`` (a server that never ends its answer).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from greenroom.protocols.content import (
    ImageBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from greenroom.protocols.context import (
    AssistantMessage,
    Message,
    ModelRequest,
    OutputFormat,
    ToolResult,
    ToolSchema,
    UserMessage,
)
from greenroom.protocols.retry import (
    parse_rate_limit_reset,
    parse_retry_after,
    transient_status_text,
)
from greenroom.protocols.sse import (
    MAX_RESPONSE_BYTES,
    EventTooLarge,
    SSEDecoder,
    response_too_large,
)
from greenroom.protocols.stream import (
    MAX_TOOL_CALLS,
    BlockCompleted,
    BlockStarted,
    ErrorKind,
    MessageCompleted,
    ModelError,
    StreamEvent,
    StreamFailed,
    TextDelta,
    ThinkingDelta,
    TokenUsage,
    ToolArgumentsDelta,
    ToolCallTruncated,
    UsageReported,
    coalesce_deltas,
    token_count,
)
from greenroom.protocols.structured import openai_strict
from greenroom.protocols.text import repair_text
from greenroom.protocols.tools import json_error_reason, parse_tool_arguments

__all__ = [
    "ImageLoader",
    "JsonEventDecoder",
    "OpenAIStreamDecoder",
    "RequestEncoder",
    "build_request",
    "classify_error",
    "encode_message",
]

ImageLoader = Callable[[ImageBlock], dict[str, Any] | None]
"""Turns an image block into one complete content part, usually
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``, or None when
the image cannot be loaded (it then folds to text). It is the only place where reading the
file happens, and it belongs to the caller: this module does no I/O."""

REASONING_EFFORTS = frozenset({"minimal", "low", "medium", "high"})
"""``thinking_level`` values passed on as ``reasoning_effort``; others are not sent."""

# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def image_as_text(image: ImageBlock) -> str:
    """An image named in text, for places that carry text only."""
    return f"[attached image: {image.path}]"


def tool_result_text(result: ToolResult) -> str:
    """A tool result as text, its images named."""
    # Tool messages carry text only; images are named here (and, with vision, shown in the
    # user message that follows).
    return "\n".join(
        block.text if isinstance(block, TextBlock) else image_as_text(block)
        for block in result.content
    )


def _encode_user(
    message: UserMessage, image_loader: ImageLoader | None, vision: bool
) -> list[dict[str, Any]]:
    loader = image_loader if vision else None
    encoded: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    shown_tool_images: list[dict[str, Any]] = []
    only_text = True
    for item in message.content:
        if isinstance(item, ToolResult):
            # Results first and in their own order: OpenAI requires the tool messages to
            # follow the assistant message that made the calls, with nothing in between.
            encoded.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": tool_result_text(item)}
            )
            if loader is not None:
                # Tool messages cannot carry images: a model with vision sees them in the
                # user message that follows (they are already named in the tool text).
                for block in item.content:
                    if isinstance(block, ImageBlock) and (part := loader(block)) is not None:
                        shown_tool_images.append(part)
        elif isinstance(item, TextBlock):
            parts.append({"type": "text", "text": item.text})
        else:
            image_part = loader(item) if loader is not None else None
            if image_part is None:
                parts.append({"type": "text", "text": image_as_text(item)})
            else:
                parts.append(image_part)
                only_text = False
    if shown_tool_images:
        parts.extend(shown_tool_images)
        only_text = False
    if not parts:
        if not encoded:
            encoded.append({"role": "user", "content": ""})
    elif only_text:
        encoded.append({"role": "user", "content": "\n".join(p["text"] for p in parts)})
    else:
        encoded.append({"role": "user", "content": parts})
    return encoded


def _encode_assistant(message: AssistantMessage) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            # Invalid argument text is not resent: some servers parse the arguments of the
            # history for their chat template and would reject the request. The paired tool
            # result already tells the model what went wrong.
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {
                        "name": block.name,
                        "arguments": json.dumps(block.arguments, ensure_ascii=False),
                    },
                }
            )
        # Thinking and redacted thinking are never resent to OpenAI-style servers (R-RUN-9).
    encoded: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        encoded["tool_calls"] = calls
    elif encoded["content"] is None:
        # An assistant message needs content or tool calls (e.g. a reply that was all thinking).
        encoded["content"] = ""
    return encoded


def encode_message(
    message: Message, *, image_loader: ImageLoader | None = None, vision: bool = True
) -> list[dict[str, Any]]:
    """The wire messages for one context message (a user message with tool results becomes
    several). Pure apart from calling ``image_loader``."""
    if isinstance(message, UserMessage):
        return _encode_user(message, image_loader, vision)
    return [_encode_assistant(message)]


def _encode_tool(schema: ToolSchema) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": schema.name,
            "description": schema.description,
            "parameters": schema.input_schema,
        },
    }


class RequestEncoder:
    """Builds request bodies for one model context, reusing earlier work.

    Each context message's encoding is kept together with the message object itself and
    reused while the same object sits at the same position, so a turn costs only the new
    messages (and ``image_loader`` runs once per image, not once per turn). The context is
    append-only (see :mod:`greenroom.protocols.context`); any other change just re-encodes
    the positions whose object differs. Keeping the objects (not their ``id()``) means an id
    can never be recycled into a false hit.

    The returned body shares its message dicts with the cache and with earlier bodies:
    callers serialise it and must not mutate it.
    """

    def __init__(self, *, image_loader: ImageLoader | None = None) -> None:
        self._image_loader = image_loader
        self._vision: bool | None = None
        self._cache: list[tuple[Message, list[dict[str, Any]]]] = []
        self._tools_key: tuple[ToolSchema, ...] | None = None
        self._tools: list[dict[str, Any]] = []

    def build(self, request: ModelRequest) -> dict[str, Any]:
        """The body for ``POST /v1/chat/completions`` (streaming, usage included)."""
        if self._vision is not request.supports_vision:
            self._cache.clear()
            self._vision = request.supports_vision
        cache = self._cache
        messages: list[dict[str, Any]] = []
        if request.system:
            messages.append({"role": "system", "content": request.system})
        for position, message in enumerate(request.messages):
            if position < len(cache) and cache[position][0] is message:
                encoded = cache[position][1]
            else:
                encoded = encode_message(
                    message, image_loader=self._image_loader, vision=request.supports_vision
                )
                if position < len(cache):
                    cache[position] = (message, encoded)
                else:
                    cache.append((message, encoded))
            messages.extend(encoded)
        del cache[len(request.messages) :]

        body: dict[str, Any] = {
            "model": request.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            # max_tokens, not max_completion_tokens: every compatible server accepts it.
            "max_tokens": request.max_tokens,
            "messages": messages,
        }
        if request.tools:
            if self._tools_key is not request.tools:
                self._tools = [_encode_tool(t) for t in request.tools]
                self._tools_key = request.tools
            body["tools"] = self._tools
        if request.thinking_level in REASONING_EFFORTS:
            body["reasoning_effort"] = request.thinking_level
        if request.output is not None:
            body["response_format"] = response_format(request.output)
        return body


def response_format(output: OutputFormat) -> dict[str, Any]:
    """The chat completions ``response_format`` of a structured answer (R-OUT-1): a JSON
    Schema, ``strict`` when OpenAI's strict mode can hold it (else the runtime's own
    validation does). The model may still call tools first: the format binds its answer."""
    return {
        "type": "json_schema",
        "json_schema": {
            "name": output.name,
            "schema": output.schema,
            "strict": openai_strict(output.schema),
        },
    }


def build_request(
    request: ModelRequest, *, image_loader: ImageLoader | None = None
) -> dict[str, Any]:
    """The body for ``POST /v1/chat/completions`` without caching (see :class:`RequestEncoder`).

    System prompt first; tool results as ``role: tool`` messages in their order, before the
    rest of their user message; images as parts from ``image_loader`` when the model has
    vision, else ``[attached image: <path>]`` text; thinking never sent (R-RUN-9).
    """
    return RequestEncoder(image_loader=image_loader).build(request)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

_OVERFLOW_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_OVERFLOW_PHRASES = ("maximum context length", "exceeds the available context size")
_QUOTA_CODES = frozenset({"insufficient_quota"})
_TRANSIENT_CODES = frozenset(
    {
        "server_error",
        "service_unavailable_error",
        "server_is_overloaded",
        "overloaded_error",
        "rate_limit_exceeded",
    }
)
_PERMANENT_STATUSES = frozenset({400, 404, 413, 422})
_MESSAGE_LIMIT = 500


def _error_fields(payload: Any) -> tuple[str, str, str, int | None]:
    """``(message, type, code, integer code)`` of an error payload in any known shape.

    Shapes: OpenAI ``{"error": {message, type, code}}``, Ollama ``{"error": "text"}``, vLLM's
    flat ``{"object": "error", message, type, code: 400}``, or the inner error object itself
    (a mid-stream ``data: {"error": ...}``)."""
    if isinstance(payload, dict) and "error" in payload:
        payload = payload["error"]
    if isinstance(payload, str):
        return payload, "", "", None
    if not isinstance(payload, dict):
        return "", "", "", None
    message = payload.get("message")
    etype = payload.get("type")
    code = payload.get("code")
    int_code = code if isinstance(code, int) and not isinstance(code, bool) else None
    return (
        message if isinstance(message, str) else "",
        etype if isinstance(etype, str) else "",
        code if isinstance(code, str) else "",
        int_code,
    )


def _classify(
    status: int | None,
    message: str,
    etype: str,
    code: str,
    headers: Mapping[str, str],
    now: float | None,
) -> ModelError:
    text = message[:_MESSAGE_LIMIT] or (f"HTTP {status}" if status else "model error")
    kind: ErrorKind
    retry_after: float | None = None
    permanent = False
    lowered = message.lower()
    if status in (401, 403):
        kind = "auth"
    elif code in _QUOTA_CODES or etype in _QUOTA_CODES:
        kind = "failed"
        permanent = True
        text = f"quota exhausted: {text}"
    elif status == 429:
        # Checked before overflow: a rate limit must never trigger compaction (R-COMPACT-9).
        kind = "timeout"
        retry_after = parse_retry_after(headers, now)
        if retry_after is None:
            retry_after = parse_rate_limit_reset(headers, now)
    elif (
        code in _OVERFLOW_CODES
        or etype in _OVERFLOW_CODES
        or any(phrase in lowered for phrase in _OVERFLOW_PHRASES)
    ):
        kind = "context_overflow"
    elif status is not None and (status == 408 or status >= 500):
        kind = "timeout"
        retry_after = parse_retry_after(headers, now)
    elif status is None and (code in _TRANSIENT_CODES or etype in _TRANSIENT_CODES):
        kind = "timeout"
    else:
        kind = "failed"
        # The server rejected the request itself (unknown model, invalid, too large): the
        # same request fails the same way, so it is not retried (R-RETRY-2).
        permanent = status in _PERMANENT_STATUSES
    return ModelError(
        kind=kind,
        message=text,
        status_code=status,
        retry_after_s=retry_after,
        permanent=permanent,
    )


def classify_error(
    status: int, body: bytes | str, headers: Mapping[str, str], *, now: float | None = None
) -> ModelError:
    """Classify a non-200 response (R-RETRY-1). Never raises, whatever the body.

    401/403 → ``auth``; ``insufficient_quota`` (even as a 429) → ``failed`` with a message
    saying the quota is exhausted, since waiting will not help; other 429 → ``timeout`` with
    ``retry_after_s`` from ``retry-after-ms`` / ``retry-after`` (seconds, or an HTTP date
    relative to ``now``, the wall clock; dates are ignored without it:
    :func:`~greenroom.protocols.retry.parse_retry_after`), else from the reset of its
    exhausted rate limit (:func:`~greenroom.protocols.retry.parse_rate_limit_reset`);
    context too long (OpenAI
    ``context_length_exceeded``, llama.cpp ``exceed_context_size_error``, vLLM's message
    text) → ``context_overflow``; 408 and every 5xx → ``timeout``; anything else ``failed``,
    ``permanent`` (never retried) for 400, 404, 413 and 422 and for an exhausted quota.
    A ``timeout`` names its status in words first (``rate limited (HTTP 429): …``:
    :func:`~greenroom.protocols.retry.transient_status_text`).
    """
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    try:
        payload: Any = json.loads(text)
    except (ValueError, RecursionError):
        payload = None
    message, etype, code, _ = _error_fields(payload)
    if not message and payload is None:
        message = text.strip()
    error = _classify(status, message, etype, code, headers, now)
    if error.kind == "timeout":
        # The kind is the retry class; the words say which transient failure it was.
        error = attrs.evolve(error, message=transient_status_text(status, message[:_MESSAGE_LIMIT]))
    if not error.message.isascii():
        # The server's words are traced with the attempt: a lone surrogate its JSON
        # spells is repaired here (R-SEC-1).
        error = attrs.evolve(error, message=repair_text(error.message))
    return error


def _classify_stream_error(error: Any) -> ModelError:
    """A ``data: {"error": ...}`` chunk inside a 200 stream. There is no HTTP status, so the
    error's own integer ``code`` (llama.cpp) stands in for it when it looks like one."""
    message, etype, code, int_code = _error_fields(error)
    status = int_code if int_code is not None and 400 <= int_code <= 599 else None
    # The response's status was 200; the payload's code only guides the classification.
    return attrs.evolve(_classify(status, message, etype, code, {}, None), status_code=None)


# ---------------------------------------------------------------------------------------------
# Stream decoding
# ---------------------------------------------------------------------------------------------

_STOP_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}


# The bound method of one decoder: json.loads minus its per-call argument handling.
_decode_json = json.JSONDecoder().decode


class _ToolCall:
    __slots__ = ("block", "call_id", "name", "parts", "wire_index")

    def __init__(self, wire_index: int, block: int, call_id: str, name: str) -> None:
        self.wire_index = wire_index
        self.block = block
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []


class _Malformed(Exception):
    """Raised inside the decoder for a chunk whose shape is wrong; becomes StreamFailed
    (with the exception's text when it has one)."""


_LEGACY_FUNCTION_CALL = -1
"""Wire index of a legacy ``delta.function_call``: at most one per message, before any
``tool_calls`` entry."""


class JsonEventDecoder:
    """What the OpenAI-compatible stream decoders share: the body's SSE framing, one JSON
    object an event, the usage reported so far, and a terminal event returned once.

    A subclass handles each event's data in ``_on_data`` (False once its terminal event is
    out) and says in ``_body_ended`` how a body that ended without one ends: completed
    from what arrived, or failed.
    """

    def __init__(self) -> None:
        self._sse = SSEDecoder()
        self._out: list[StreamEvent] = []
        self._terminal = False
        self._usage: TokenUsage | None = None
        self._room = MAX_RESPONSE_BYTES  # bytes of the body still taken

    @property
    def usage(self) -> TokenUsage:
        """The latest usage the server reported (zeros until it reports any)."""
        return self._usage or TokenUsage()

    @property
    def finished(self) -> bool:
        """True once the terminal event has been returned."""
        return self._terminal

    def feed(self, data: bytes) -> list[StreamEvent]:
        """Events completed by ``data`` (possibly none). Empty after the terminal event."""
        if self._terminal:
            return []
        out: list[StreamEvent] = []
        self._out = out
        self._room -= len(data)
        if self._room < 0:
            self._fail(ModelError(kind="malformed", message=response_too_large()))
            return out
        # feed_raw gives (event, data) tuples: one object less per chunk on the hot path.
        try:
            events = self._sse.feed_raw(data)
        except EventTooLarge as exc:
            self._fail(ModelError(kind="malformed", message=str(exc)))
            return out
        for _event, text in events:
            if not self._on_data(text):
                break
        return coalesce_deltas(out)

    def end_of_stream(self) -> list[StreamEvent]:
        """The body ended: the remaining events, always ending with the terminal event
        (unless it was already returned)."""
        if self._terminal:
            return []
        out: list[StreamEvent] = []
        self._out = out
        for event in self._sse.close():
            if not self._on_data(event.data):
                return out
        self._body_ended()
        return out

    def _on_data(self, data: str) -> bool:
        raise NotImplementedError

    def _body_ended(self) -> None:
        raise NotImplementedError

    def _ended_early(self, missing: str) -> None:
        """Fail the stream: it ended before ``missing`` came."""
        reason = "connection closed mid-event" if self._sse.truncated else missing
        self._fail(ModelError(kind="malformed", message=f"stream ended early ({reason})"))

    def _fail(self, error: ModelError) -> None:
        message = error.message
        if not message.isascii():
            # The words may quote the stream (a server's error message): they are traced
            # with the attempt, so a lone surrogate is repaired here (R-SEC-1).
            error = attrs.evolve(error, message=repair_text(message))
        self._out.append(StreamFailed(error=error))
        self._terminal = True

    def _decoded(self, data: str) -> Any:
        """The event's JSON value. When ``data`` is not JSON the stream fails here (the
        decoder is then ``finished``) and the value is None."""
        try:
            return _decode_json(data)
        except (ValueError, RecursionError) as exc:
            message = f"malformed JSON in the model stream: {json_error_reason(exc)}"
            self._fail(ModelError(kind="malformed", message=f"{message} (data: {data[:100]})"))
            return None


class OpenAIStreamDecoder(JsonEventDecoder):
    """Turns a Chat Completions SSE body into :data:`StreamEvent` values.

    Feed raw body bytes in any chunking; each call returns the events those bytes completed,
    in stream order. Call :meth:`end_of_stream` once when the body ends (cleanly or not).
    Never raises on any input; see the module docstring for the guarantees. One decoder per
    attempt.
    """

    def __init__(self) -> None:
        super().__init__()
        self._next_block = 0
        self._text_block: int | None = None
        self._text_parts: list[str] = []
        self._thinking_block: int | None = None
        self._thinking_parts: list[str] = []
        self._tools: dict[int, _ToolCall] = {}
        self._last_wire_index: int | None = None
        self._completed_tool_calls = 0
        self._finish_reason: str | None = None
        self._response_id: str | None = None
        self._response_model: str | None = None

    # -- internals --------------------------------------------------------------------------

    def _body_ended(self) -> None:
        if self._finish_reason is not None:
            self._complete_message()
        else:
            self._ended_early("no finish_reason")

    def _on_data(self, data: str) -> bool:
        """Handle one SSE event's data; False once the terminal event is out."""
        if data[:1] != "{":
            stripped = data.strip()
            if stripped == "[DONE]":
                self._complete_message()
                return False
            if not stripped:
                return True
        chunk = self._decoded(data)
        if self._terminal:
            return False
        try:
            if chunk.__class__ is not dict:
                raise _Malformed
            error = chunk.get("error")
            if error is not None:
                self._fail(_classify_stream_error(error))
                return False
            if self._response_id is None:
                # Every chunk repeats the response's id and model: read them until the
                # first chunk that names the response, not on every chunk.
                # Both are traced with the request's end: repaired (R-SEC-1).
                response_id = chunk.get("id")
                if response_id and response_id.__class__ is str:
                    self._response_id = repair_text(response_id)
                model = chunk.get("model")
                if model and model.__class__ is str:
                    self._response_model = repair_text(model)
            choices = chunk.get("choices")
            # Anything but usage after the finish reason is ignored: the message is complete.
            if choices and self._finish_reason is None:
                choice = choices[0]
                delta = choice.get("delta")
                if delta:
                    self._on_delta(delta)
                finish_reason = choice.get("finish_reason")
                # Some servers send "finish_reason": "" on every chunk before the last:
                # only a non-empty reason ends the message.
                if finish_reason:
                    self._on_finish(repair_text(str(finish_reason)))
            usage = chunk.get("usage")
            if usage:
                self._on_usage(usage)
        except _Malformed as exc:
            message = str(exc) or f"bad chunk shape: {data[:200]}"
            self._fail(ModelError(kind="malformed", message=message))
            return False
        except (AttributeError, TypeError, KeyError, IndexError, ValueError, RecursionError):
            self._fail(ModelError(kind="malformed", message=f"bad chunk shape: {data[:200]}"))
            return False
        return True

    def _on_delta(self, delta: dict[str, Any]) -> None:
        # vLLM >= 0.11 and Ollama say "reasoning", older vLLM and llama.cpp
        # "reasoning_content"; a server sending both sends the same text twice.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            if reasoning.__class__ is not str:
                raise _Malformed
            self._thinking(reasoning)
        content = delta.get("content")
        if content:
            if content.__class__ is str:
                self._text(content)
            elif content.__class__ is list:
                self._content_parts(content)
            else:
                raise _Malformed
        refusal = delta.get("refusal")
        if refusal:
            # A refusal is what the model said instead of an answer: show it as text.
            if refusal.__class__ is not str:
                raise _Malformed
            self._text(refusal)
        tool_calls = delta.get("tool_calls")
        if tool_calls:
            for fragment in tool_calls:
                self._tool_fragment(fragment)
        function_call = delta.get("function_call")
        if function_call:
            # The legacy single-call form (``functions`` API, still sent by some servers):
            # one call with no id; ours is derived from the response id, so it is the same
            # on every event of the call.
            if function_call.__class__ is not dict:
                raise _Malformed
            call_id = f"call_{self._response_id or 'function'}"
            self._tool_fragment(
                {"index": _LEGACY_FUNCTION_CALL, "id": call_id, "function": function_call}
            )

    def _content_parts(self, parts: list[Any]) -> None:
        """``delta.content`` as typed parts (Mistral): text parts are text, thinking parts
        (a string or a list of text parts) are thinking; other part types carry nothing
        shown."""
        for part in parts:
            if part.__class__ is not dict:
                raise _Malformed
            ptype = part.get("type")
            if ptype == "text":
                text = part.get("text")
                if text.__class__ is not str:
                    raise _Malformed
                if text:
                    self._text(text)
            elif ptype == "thinking":
                thinking = part.get("thinking")
                if thinking.__class__ is str:
                    if thinking:
                        self._thinking(thinking)
                elif thinking.__class__ is list:
                    for sub in thinking:
                        if sub.__class__ is not dict:
                            raise _Malformed
                        text = sub.get("text")
                        if text and text.__class__ is str:
                            self._thinking(text)
                elif thinking is not None:
                    raise _Malformed

    def _close_text(self) -> None:
        if self._text_block is not None:
            self._out.append(
                BlockCompleted(
                    index=self._text_block, block=TextBlock(text="".join(self._text_parts))
                )
            )
            self._text_block = None
            self._text_parts = []

    def _close_thinking(self) -> None:
        if self._thinking_block is not None:
            self._out.append(
                BlockCompleted(
                    index=self._thinking_block,
                    block=ThinkingBlock(text="".join(self._thinking_parts)),
                )
            )
            self._thinking_block = None
            self._thinking_parts = []

    def _text(self, text: str) -> None:
        text = repair_text(text)
        index = self._text_block
        if index is None:
            self._close_thinking()
            index = self._text_block = self._next_block
            self._next_block += 1
            self._out.append(BlockStarted(index=index, kind="text"))
        self._text_parts.append(text)
        self._out.append(TextDelta(index=index, text=text))

    def _thinking(self, text: str) -> None:
        text = repair_text(text)
        index = self._thinking_block
        if index is None:
            self._close_text()
            index = self._thinking_block = self._next_block
            self._next_block += 1
            self._out.append(BlockStarted(index=index, kind="thinking"))
        self._thinking_parts.append(text)
        self._out.append(ThinkingDelta(index=index, text=text))

    def _tool_fragment(self, fragment: dict[str, Any]) -> None:
        wire_index = fragment.get("index")
        call_id = fragment.get("id")
        if wire_index is None:
            # Some servers omit the index: a new id opens the next call, otherwise the
            # fragment continues the last one.
            known = any(t.call_id == call_id for t in self._tools.values())
            if (call_id and not known) or self._last_wire_index is None:
                wire_index = max(self._tools, default=-1) + 1
            else:
                wire_index = self._last_wire_index
        elif wire_index.__class__ is not int:
            raise _Malformed
        self._last_wire_index = wire_index
        function = fragment.get("function") or {}
        call = self._tools.get(wire_index)
        if call is None:
            if len(self._tools) >= MAX_TOOL_CALLS:
                raise _Malformed(f"more than {MAX_TOOL_CALLS} tool calls in one message")
            self._close_text()
            self._close_thinking()
            name = function.get("name") or ""
            taken = {t.call_id for t in self._tools.values()}
            if call_id:
                call_id = repair_text(str(call_id))
                if call_id in taken:
                    # Two calls sharing an id cannot both be answered (R-SEC-6).
                    raise _Malformed(f"tool call id {call_id[:100]!r} repeated in one message")
            else:
                # Pairing needs a non-empty id (R-TOOL-7); ours only has to be unique here.
                call_id = f"call_{wire_index}"
                while call_id in taken:
                    call_id += "_"
            call = _ToolCall(wire_index, self._next_block, call_id, repair_text(str(name)))
            self._next_block += 1
            self._tools[wire_index] = call
            self._out.append(
                BlockStarted(
                    index=call.block, kind="tool_call", call_id=call.call_id, name=call.name
                )
            )
        elif not call.name and function.get("name"):
            call.name = repair_text(str(function["name"]))
        arguments = function.get("arguments")
        if arguments:
            if arguments.__class__ is not str:
                # A few servers send the arguments as an object rather than JSON text.
                arguments = json.dumps(arguments, ensure_ascii=False)
            arguments = repair_text(arguments)
            call.parts.append(arguments)
            self._out.append(
                ToolArgumentsDelta(
                    index=call.block, call_id=call.call_id, name=call.name, delta=arguments
                )
            )

    def _on_finish(self, finish_reason: str) -> None:
        self._finish_reason = finish_reason
        self._complete_blocks(truncate_tools=finish_reason == "length")

    def _complete_blocks(self, *, truncate_tools: bool) -> None:
        calls = sorted(self._tools.values(), key=lambda c: c.wire_index)
        self._tools = {}
        open_block = self._text_block if self._text_block is not None else self._thinking_block
        # Keep stream order where it is known: text/thinking that began before the first
        # open call completes before the calls.
        if open_block is not None and (not calls or open_block < min(c.block for c in calls)):
            self._close_text()
            self._close_thinking()
        out = self._out
        for call in calls:
            raw = "".join(call.parts)
            if truncate_tools:
                out.append(
                    ToolCallTruncated(
                        index=call.block,
                        call_id=call.call_id,
                        name=call.name,
                        partial_arguments=raw,
                    )
                )
                continue
            arguments, invalid = parse_tool_arguments(raw)
            out.append(
                BlockCompleted(
                    index=call.block,
                    block=ToolCallBlock(
                        id=call.call_id,
                        name=call.name,
                        arguments=arguments,
                        invalid_arguments=invalid,
                    ),
                )
            )
            self._completed_tool_calls += 1
        self._close_text()
        self._close_thinking()

    def _on_usage(self, usage: dict[str, Any]) -> None:
        prompt = token_count(usage.get("prompt_tokens")) or 0
        details = usage.get("prompt_tokens_details")
        cached = (token_count(details.get("cached_tokens")) or 0) if details else 0
        reported = TokenUsage(
            input=max(prompt - cached, 0),
            output=token_count(usage.get("completion_tokens")) or 0,
            cache_read=cached,
        )
        if reported != self._usage:
            self._usage = reported
            self._out.append(UsageReported(usage=reported))

    def _complete_message(self) -> None:
        if self._finish_reason is None:
            # [DONE] without a finish_reason: the server says the stream ended properly.
            self._complete_blocks(truncate_tools=False)
            stop_reason = "tool_use" if self._completed_tool_calls else "end_turn"
        else:
            stop_reason = _STOP_REASONS.get(self._finish_reason, self._finish_reason)
            if stop_reason == "end_turn" and self._completed_tool_calls:
                # gpt-4o and older Ollama say "stop" after tool calls; the calls decide.
                stop_reason = "tool_use"
        self._out.append(
            MessageCompleted(
                stop_reason=stop_reason,
                usage=self._usage or TokenUsage(),
                response_id=self._response_id,
                response_model=self._response_model,
            )
        )
        self._terminal = True
