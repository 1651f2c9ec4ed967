"""Sans-IO codec for the OpenAI Responses API (``POST /v1/responses``, streamed).

The Responses API is OpenAI's current interface (vLLM and Ollama serve it too), and the
only one through which reasoning models keep their reasoning across turns: with
``store: false`` and ``include: ["reasoning.encrypted_content"]`` each reasoning item comes
back encrypted, and sending it back in the next request's ``input`` lets the model continue
the same line of thought after a tool call. Three pieces, none of which does I/O:

* :class:`RequestEncoder` turns a :class:`ModelRequest` into the JSON body. The system
  prompt is ``instructions``; context messages become input items (user messages, then
  ``function_call_output`` items paired by ``call_id`` (R-TOOL-7); assistant messages
  become ``reasoning``, ``message`` and ``function_call`` items in block order, adjacent
  text blocks one ``message`` joined by line breaks as every reader joins them). The
  encoding is deterministic and append-only, so the prefix of turn N+1 is byte-identical to
  turn N; ``prompt_cache_key`` is derived from the context's first item and the tools, so it
  is stable for the whole model context.
* :class:`ResponsesStreamDecoder` turns the SSE body into the typed events of
  :mod:`greenroom.protocols.stream`.
* :func:`classify_error` turns a non-200 response into a :class:`ModelError` (R-RETRY-1);
  the error bodies are OpenAI's, so the Chat Completions classifier is reused.

Reasoning (R-RUN-9's provider exception): a reasoning item arrives as a
:class:`ThinkingBlock` whose ``text`` is the readable summary, ``signature`` the encrypted
content and ``item_id`` the item's id. Like Anthropic's thinking, reasoning items are sent
back only for the assistant messages of the current tool-use chain (from the last user
message without tool results), and only when they carry encrypted content; the rest of the
history is sent without them.

Decoder invariants (what the supervisor may rely on):

* Block indices are the decoder's own, one per output item (text parts of one message item
  share its block), assigned in order of appearance.
* A tool call completes at its ``response.output_item.done`` (the API says the call is
  whole there), so it can be approved while the model still streams (R-TOOL-1). A call
  still open when the response ends ``incomplete`` (``max_output_tokens``) becomes
  :class:`ToolCallTruncated` and never runs (R-TOOL-5); so does an item done with status
  ``incomplete``.
* Two function calls with one ``call_id`` in a response make the attempt ``malformed``
  (R-SEC-6).
* Exactly one terminal event: ``MessageCompleted`` at ``response.completed`` or
  ``response.incomplete``; ``StreamFailed`` at ``response.failed``, an ``error`` event, bad
  JSON, a body that ends before either (a dropped connection is never an answer), or one
  past :data:`~greenroom.protocols.sse.MAX_RESPONSE_BYTES`.
* Lone UTF-16 surrogates in every string passed on (text, arguments, call and item ids,
  the model, encrypted reasoning, an error's words) become U+FFFD (R-SEC-1).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

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
    ToolResult,
    ToolSchema,
    UserMessage,
)
from greenroom.protocols.openai_codec import (
    REASONING_EFFORTS,
    ImageLoader,
    JsonEventDecoder,
    image_as_text,
    tool_result_text,
)
from greenroom.protocols.openai_codec import classify_error as classify_error
from greenroom.protocols.stream import (
    MAX_TOOL_CALLS,
    BlockCompleted,
    BlockStarted,
    ErrorKind,
    MessageCompleted,
    ModelError,
    TextDelta,
    ThinkingDelta,
    TokenUsage,
    ToolArgumentsDelta,
    ToolCallTruncated,
    UsageReported,
    token_count,
)
from greenroom.protocols.structured import openai_strict
from greenroom.protocols.text import repair_text
from greenroom.protocols.tools import parse_tool_arguments

__all__ = [
    "REASONING_EFFORTS",
    "RequestEncoder",
    "ResponsesStreamDecoder",
    "build_request",
    "classify_error",
    "encode_message",
]


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def _encode_user(
    message: UserMessage, image_loader: ImageLoader | None, vision: bool
) -> list[dict[str, Any]]:
    loader = image_loader if vision else None
    items: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for item in message.content:
        if isinstance(item, ToolResult):
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": tool_result_text(item),
                }
            )
            if loader is not None:
                # Function outputs carry text; a model with vision sees the images in the
                # user message that follows (they are already named in the output text).
                for block in item.content:
                    if isinstance(block, ImageBlock):
                        part = _image_part(loader, block)
                        if part is not None:
                            parts.append(part)
        elif isinstance(item, TextBlock):
            parts.append({"type": "input_text", "text": item.text})
        else:
            part = _image_part(loader, item) if loader is not None else None
            parts.append(part or {"type": "input_text", "text": image_as_text(item)})
    if parts:
        items.append({"type": "message", "role": "user", "content": parts})
    elif not items:
        items.append({"type": "message", "role": "user", "content": ""})
    return items


def _image_part(loader: ImageLoader, block: ImageBlock) -> dict[str, Any] | None:
    # The loader speaks Chat Completions' part shape; Responses wants the URL flat.
    part = loader(block)
    if part is None:
        return None
    url = part.get("image_url", {}).get("url") if isinstance(part, dict) else None
    if not isinstance(url, str):
        return None
    return {"type": "input_image", "image_url": url}


def _encode_assistant(message: AssistantMessage, *, reasoning: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    text: dict[str, Any] | None = None  # where the message's text blocks so far went
    for block in message.content:
        if isinstance(block, TextBlock):
            if text is None:
                text = {"type": "output_text", "text": block.text}
                items.append({"type": "message", "role": "assistant", "content": [text]})
            elif block.text:
                # Adjacent text blocks are one text in lines, as every reader joins them:
                # the model's text split to fit a cluster's records (trace.fit_model_block)
                # is sent back as it wrote it, not as messages apart (R-TRACE).
                text["text"] = f"{text['text']}\n{block.text}" if text["text"] else block.text
            continue
        text = None
        if isinstance(block, ToolCallBlock):
            # Invalid argument text is not resent; the paired output says what went wrong.
            items.append(
                {
                    "type": "function_call",
                    "call_id": block.id,
                    "name": block.name,
                    "arguments": json.dumps(block.arguments, ensure_ascii=False),
                }
            )
        elif (
            reasoning
            and isinstance(block, ThinkingBlock)
            and block.signature
            and block.item_id
        ):
            items.append(
                {
                    "type": "reasoning",
                    "id": block.item_id,
                    "summary": (
                        [{"type": "summary_text", "text": block.text}] if block.text else []
                    ),
                    "encrypted_content": block.signature,
                }
            )
        # Thinking without encrypted content and redacted thinking are never resent.
    if not items:
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": ""}],
            }
        )
    return items


def encode_message(
    message: Message,
    *,
    image_loader: ImageLoader | None = None,
    vision: bool = True,
    reasoning: bool = False,
) -> list[dict[str, Any]]:
    """The input items for one context message. ``reasoning`` sends the message's reasoning
    items back (only for the current tool-use chain; see the module docstring)."""
    if isinstance(message, UserMessage):
        return _encode_user(message, image_loader, vision)
    return _encode_assistant(message, reasoning=reasoning)


def _encode_tool(schema: ToolSchema) -> dict[str, Any]:
    return {
        "type": "function",
        "name": schema.name,
        "description": schema.description,
        "parameters": schema.input_schema,
        # Our schemas are not written for strict mode (optional fields, open objects).
        "strict": False,
    }


def _chain_start(messages: tuple[Message, ...]) -> int:
    """Index of the first message of the current tool-use chain: after the last user
    message that carries no tool result."""
    for position in range(len(messages) - 1, -1, -1):
        message = messages[position]
        if isinstance(message, UserMessage) and not any(
            isinstance(item, ToolResult) for item in message.content
        ):
            return position + 1
    return 0


class RequestEncoder:
    """Builds request bodies for one model context, reusing earlier work.

    Each message's items are cached with the message object and reused while the same object
    sits at the same position with the same reasoning choice, so a turn costs only the new
    messages. The returned body shares its item dicts with the cache: callers serialise it
    and must not mutate it.
    """

    def __init__(self, *, image_loader: ImageLoader | None = None) -> None:
        self._image_loader = image_loader
        self._vision: bool | None = None
        self._cache: list[tuple[Message, bool, list[dict[str, Any]]]] = []
        self._tools_key: tuple[ToolSchema, ...] | None = None
        self._tools: list[dict[str, Any]] = []
        self._tools_digest = ""

    def build(self, request: ModelRequest) -> dict[str, Any]:
        """The body for ``POST /v1/responses`` (streaming, stateless, reasoning included)."""
        if self._vision is not request.supports_vision:
            self._cache.clear()
            self._vision = request.supports_vision
        cache = self._cache
        chain = _chain_start(request.messages)
        items: list[dict[str, Any]] = []
        for position, message in enumerate(request.messages):
            reasoning = position >= chain and isinstance(message, AssistantMessage)
            if (
                position < len(cache)
                and cache[position][0] is message
                and cache[position][1] is reasoning
            ):
                encoded = cache[position][2]
            else:
                encoded = encode_message(
                    message,
                    image_loader=self._image_loader,
                    vision=request.supports_vision,
                    reasoning=reasoning,
                )
                entry = (message, reasoning, encoded)
                if position < len(cache):
                    cache[position] = entry
                else:
                    cache.append(entry)
            items.extend(encoded)
        del cache[len(request.messages) :]

        if self._tools_key is not request.tools:
            self._tools = [_encode_tool(t) for t in request.tools]
            self._tools_key = request.tools
            self._tools_digest = json.dumps(self._tools, sort_keys=True)
        body: dict[str, Any] = {
            "model": request.model,
            "stream": True,
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "max_output_tokens": request.max_tokens,
            "input": items,
            "prompt_cache_key": self._cache_key(request, items),
        }
        if request.system:
            body["instructions"] = request.system
        if self._tools:
            body["tools"] = self._tools
        if request.thinking_level in REASONING_EFFORTS:
            body["reasoning"] = {"effort": request.thinking_level, "summary": "auto"}
        output = request.output
        if output is not None:
            # R-OUT-1: the Responses API's native structured output binds the answer;
            # tools may still be called before it.
            body["text"] = {
                "format": {
                    "type": "json_schema",
                    "name": output.name,
                    "schema": output.schema,
                    "strict": openai_strict(output.schema),
                }
            }
        return body

    def _cache_key(self, request: ModelRequest, items: list[dict[str, Any]]) -> str:
        # Stable for the whole model context (the first item never changes in an
        # append-only context), distinct between conversations.
        digest = hashlib.sha256()
        digest.update(request.model.encode())
        digest.update((request.system or "").encode("utf-8", "replace"))
        digest.update(self._tools_digest.encode("utf-8", "replace"))
        if items:
            digest.update(json.dumps(items[0], sort_keys=True).encode("utf-8", "replace"))
        return "greenroom-" + digest.hexdigest()[:32]


def build_request(
    request: ModelRequest, *, image_loader: ImageLoader | None = None
) -> dict[str, Any]:
    """The body for ``POST /v1/responses`` without caching (see :class:`RequestEncoder`)."""
    return RequestEncoder(image_loader=image_loader).build(request)


# ---------------------------------------------------------------------------------------------
# Stream decoding
# ---------------------------------------------------------------------------------------------

_OVERFLOW_CODES = frozenset({"context_length_exceeded"})
_TRANSIENT_CODES = frozenset(
    {"server_error", "rate_limit_exceeded", "server_is_overloaded", "service_unavailable"}
)


class _Malformed(Exception):
    """An event whose shape is wrong; becomes ``StreamFailed(malformed)`` with the reason
    given, or a generic one naming the event."""


class _Item:
    __slots__ = ("block", "call_id", "done", "item_id", "kind", "name", "parts")

    def __init__(self, kind: str, block: int, item_id: str) -> None:
        self.kind = kind
        self.block = block
        self.item_id = item_id
        self.call_id = ""
        self.name = ""
        self.parts: list[str] = []
        self.done = False


def _classify_failure(error: Any, *, status: int | None = None) -> ModelError:
    """A ``response.failed`` error object or an ``error`` event (R-RETRY-1)."""
    code = message = ""
    if isinstance(error, dict):
        raw_code = error.get("code") or error.get("type") or ""
        code = raw_code if isinstance(raw_code, str) else str(raw_code)
        raw_message = error.get("message") or ""
        message = raw_message if isinstance(raw_message, str) else str(raw_message)
    text = repair_text(message[:500]) or code or "the response failed"
    kind: ErrorKind
    if code in _OVERFLOW_CODES or "context window" in message.lower():
        kind = "context_overflow"
    elif code in _TRANSIENT_CODES:
        kind = "timeout"
    elif code == "invalid_api_key":
        kind = "auth"
    else:
        kind = "failed"
    return ModelError(kind=kind, message=text, status_code=status)


class ResponsesStreamDecoder(JsonEventDecoder):
    """Turns a Responses API SSE body into :data:`StreamEvent` values.

    Feed raw body bytes in any chunking; each call returns the events those bytes completed,
    in stream order. Call :meth:`end_of_stream` once when the body ends. Never raises on any
    input (see the module docstring for the guarantees). One decoder per attempt.
    """

    def __init__(self) -> None:
        super().__init__()
        self._next_block = 0
        self._items: dict[int, _Item] = {}
        self._call_ids: set[str] = set()
        self._completed_calls = 0
        self.response_model: str | None = None
        """The model the server says answered (``response.model``), once known."""
        self.response_id: str | None = None
        """The response's id (``response.id``, ``resp_…``), once known."""

    # -- internals --------------------------------------------------------------------------

    def _body_ended(self) -> None:
        self._ended_early("no response.completed")

    def _on_data(self, data: str) -> bool:
        """Handle one SSE event's data; False once the terminal event is out."""
        stripped = data.strip()
        if not stripped or stripped == "[DONE]":
            return True
        event = self._decoded(data)
        if self._terminal:
            return False
        try:
            if event.__class__ is not dict:
                raise _Malformed
            return self._on_event(event)
        except _Malformed as exc:
            reason = str(exc) or f"bad event shape: {data[:200]}"
            self._fail(ModelError(kind="malformed", message=reason))
            return False
        except (AttributeError, TypeError, KeyError, IndexError, ValueError):
            self._fail(ModelError(kind="malformed", message=f"bad event shape: {data[:200]}"))
            return False

    def _on_event(self, event: dict[str, Any]) -> bool:
        etype = event.get("type")
        if etype == "response.output_text.delta" or etype == "response.refusal.delta":
            self._delta(event, "message", TextDelta)
        elif etype in (
            "response.reasoning_summary_text.delta",
            "response.reasoning_text.delta",
        ):
            self._delta(event, "reasoning", ThinkingDelta)
        elif etype == "response.function_call_arguments.delta":
            item = self._item(event)
            if item.kind != "function_call":
                raise _Malformed
            delta = event["delta"]
            if delta.__class__ is not str:
                raise _Malformed
            if delta:
                delta = repair_text(delta)
                item.parts.append(delta)
                self._out.append(
                    ToolArgumentsDelta(
                        index=item.block, call_id=item.call_id, name=item.name, delta=delta
                    )
                )
        elif etype == "response.output_item.added":
            self._item_added(event)
        elif etype == "response.output_item.done":
            self._item_done(event)
        elif etype == "response.reasoning_summary_part.added":
            item = self._item(event)
            if item.kind == "reasoning" and item.parts:
                # Summary parts are paragraphs: keep them apart in the shown text.
                item.parts.append("\n\n")
                self._out.append(ThinkingDelta(index=item.block, text="\n\n"))
        elif etype in ("response.created", "response.in_progress"):
            self._note_model(event.get("response"))
        elif etype == "response.completed":
            self._finish(event.get("response"), incomplete_reason=None)
            return False
        elif etype == "response.incomplete":
            response = event.get("response")
            details = response.get("incomplete_details") if isinstance(response, dict) else None
            reason = details.get("reason") if isinstance(details, dict) else None
            self._finish(response, incomplete_reason=repair_text(str(reason or "incomplete")))
            return False
        elif etype == "response.failed":
            response = event.get("response")
            error = response.get("error") if isinstance(response, dict) else None
            self._fail(_classify_failure(error))
            return False
        elif etype == "error":
            self._fail(_classify_failure(event.get("error", event)))
            return False
        # Other events (content_part.added/done, output_text.done, *.done summaries,
        # annotations, web search progress, unknown future events) carry nothing new.
        return True

    def _note_model(self, response: Any) -> None:
        if isinstance(response, dict):
            # Both are traced with the request's end: repaired (R-SEC-1).
            model = response.get("model")
            if isinstance(model, str) and model:
                self.response_model = repair_text(model)
            response_id = response.get("id")
            if isinstance(response_id, str) and response_id:
                self.response_id = repair_text(response_id)

    def _item(self, event: dict[str, Any]) -> _Item:
        item = self._items.get(event["output_index"])
        if item is None or item.done:
            raise _Malformed
        return item

    def _delta(
        self, event: dict[str, Any], kind: str, cls: type[TextDelta | ThinkingDelta]
    ) -> None:
        item = self._item(event)
        if item.kind != kind:
            raise _Malformed
        delta = event["delta"]
        if delta.__class__ is not str:
            raise _Malformed
        if delta:
            delta = repair_text(delta)
            item.parts.append(delta)
            self._out.append(cls(index=item.block, text=delta))

    def _item_added(self, event: dict[str, Any]) -> None:
        output_index = event["output_index"]
        raw = event["item"]
        if output_index.__class__ is not int or raw.__class__ is not dict:
            raise _Malformed
        if output_index in self._items:
            # Another item at an index already in use: a spliced stream (R-SEC-6's kin).
            raise _Malformed
        kind = raw.get("type")
        item_id = repair_text(str(raw.get("id") or ""))
        if kind == "message":
            item = _Item("message", self._new_block(), item_id)
            self._out.append(BlockStarted(index=item.block, kind="text"))
        elif kind == "reasoning":
            item = _Item("reasoning", self._new_block(), item_id)
            self._out.append(BlockStarted(index=item.block, kind="thinking"))
        elif kind == "function_call":
            item = _Item("function_call", self._new_block(), item_id)
            call_id = raw.get("call_id") or item_id or f"call_{output_index}"
            name = raw.get("name") or ""
            if call_id.__class__ is not str or name.__class__ is not str:
                raise _Malformed
            if len(self._call_ids) >= MAX_TOOL_CALLS:
                raise _Malformed(f"more than {MAX_TOOL_CALLS} tool calls in one response")
            call_id = repair_text(call_id)
            if call_id in self._call_ids:
                raise _Malformed(f"tool call id {call_id!r} repeated in one response")
            self._call_ids.add(call_id)
            item.call_id = call_id
            item.name = repair_text(name)
            self._out.append(
                BlockStarted(
                    index=item.block, kind="tool_call", call_id=item.call_id, name=item.name
                )
            )
            initial = raw.get("arguments")
            if isinstance(initial, str) and initial:
                item.parts.append(repair_text(initial))
        else:
            # Server-side tool items (web search, file search…) are not ours to run or show.
            item = _Item("other", -1, item_id)
        self._items[output_index] = item

    def _new_block(self) -> int:
        block = self._next_block
        self._next_block += 1
        return block

    def _item_done(self, event: dict[str, Any]) -> None:
        item = self._item(event)
        raw = event["item"]
        if raw.__class__ is not dict:
            raise _Malformed
        item.done = True
        if item.kind == "message":
            text = "".join(item.parts)
            if not text:
                # Some servers send only the done item: take the text from it.
                text = repair_text(_message_text(raw))
            self._out.append(BlockCompleted(index=item.block, block=TextBlock(text=text)))
        elif item.kind == "reasoning":
            text = "".join(item.parts) or repair_text(_summary_text(raw))
            encrypted = raw.get("encrypted_content")
            if isinstance(encrypted, str):
                encrypted = repair_text(encrypted)
            self._out.append(
                BlockCompleted(
                    index=item.block,
                    block=ThinkingBlock(
                        text=text,
                        signature=encrypted if isinstance(encrypted, str) and encrypted else None,
                        item_id=item.item_id or None,
                    ),
                )
            )
        elif item.kind == "function_call":
            final = raw.get("arguments")
            raw_arguments = repair_text(final) if isinstance(final, str) else "".join(item.parts)
            if raw.get("status") == "incomplete":
                self._out.append(
                    ToolCallTruncated(
                        index=item.block,
                        call_id=item.call_id,
                        name=item.name,
                        partial_arguments=raw_arguments,
                    )
                )
                return
            arguments, invalid = parse_tool_arguments(raw_arguments)
            self._out.append(
                BlockCompleted(
                    index=item.block,
                    block=ToolCallBlock(
                        id=item.call_id,
                        name=item.name,
                        arguments=arguments,
                        invalid_arguments=invalid,
                    ),
                )
            )
            self._completed_calls += 1

    def _finish(self, response: Any, *, incomplete_reason: str | None) -> None:
        self._note_model(response)
        if isinstance(response, dict):
            usage = response.get("usage")
            if isinstance(usage, dict):
                self._on_usage(usage)
        for item in self._items.values():
            if item.done or item.kind == "other":
                continue
            item.done = True
            if item.kind == "function_call":
                # A call never closed by the server: cut by the token limit, never run.
                self._out.append(
                    ToolCallTruncated(
                        index=item.block,
                        call_id=item.call_id,
                        name=item.name,
                        partial_arguments="".join(item.parts),
                    )
                )
            elif item.kind == "message":
                self._out.append(
                    BlockCompleted(index=item.block, block=TextBlock(text="".join(item.parts)))
                )
            else:
                self._out.append(
                    BlockCompleted(
                        index=item.block, block=ThinkingBlock(text="".join(item.parts))
                    )
                )
        if incomplete_reason is None:
            stop_reason = "tool_use" if self._completed_calls else "end_turn"
        elif incomplete_reason == "max_output_tokens":
            stop_reason = "max_tokens"
        elif incomplete_reason == "content_filter":
            stop_reason = "refusal"
        else:
            stop_reason = incomplete_reason
        self._out.append(
            MessageCompleted(
                stop_reason=stop_reason,
                usage=self.usage,
                response_id=self.response_id,
                response_model=self.response_model,
            )
        )
        self._terminal = True

    def _on_usage(self, usage: dict[str, Any]) -> None:
        total_input = token_count(usage.get("input_tokens")) or 0
        details = usage.get("input_tokens_details")
        cached = token_count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        cached = cached or 0
        reported = TokenUsage(
            input=max(total_input - cached, 0),
            output=token_count(usage.get("output_tokens")) or 0,
            cache_read=cached,
        )
        if reported != self._usage:
            self._usage = reported
            self._out.append(UsageReported(usage=reported))


def _message_text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if not isinstance(content, list):
        return ""
    return "".join(
        part.get("text") or part.get("refusal") or ""
        for part in content
        if isinstance(part, dict)
    )


def _summary_text(item: dict[str, Any]) -> str:
    summary = item.get("summary")
    if not isinstance(summary, list):
        return ""
    return "\n\n".join(
        part["text"]
        for part in summary
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    )
