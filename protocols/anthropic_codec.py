"""Anthropic Messages API codec: request bodies out, typed stream events in. No I/O.

Three parts:

* :class:`RequestEncoder` / :func:`build_request` turn a :class:`ModelRequest` into the JSON
  body of ``POST /v1/messages`` (streaming), keeping the prompt-cache prefix stable.
* :class:`AnthropicStreamDecoder` turns the raw SSE response body into the events of
  :mod:`greenroom.protocols.stream`.
* :func:`classify_error` turns an HTTP error response into a :class:`ModelError`
  (R-RETRY-1).

Prompt-cache prefix (R-COMPACT-5): the provider caches by exact prefix, in the order tools,
system, messages, up to each ``cache_control`` breakpoint. Breakpoints sit on the system
block, the last tool, and the last content block of the LAST message only. Every message
before the last one is encoded from the message alone (plus the thinking rule below), so
the request for turn N+1 repeats turn N's system, tools and messages byte for byte except
the final message of turn N, which loses its breakpoint (and, if the next message is of the
same role, gets merged with it).

Thinking (R-RUN-9): thinking blocks are sent only when the request has thinking enabled,
and only for the assistant messages of the current tool-use chain: walking back from the
end, every assistant message answered by a later user message that carries tool results,
up to the first user message without tool results. Anthropic requires the thinking of the
assistant message whose tool calls are being answered; keeping the whole chain (rather
than only its last message) keeps earlier chain messages byte-identical from one turn to
the next, so the message cache keeps hitting within a task. When a new user prompt ends
the chain, the chain's thinking is dropped and the cache prefix changes once from the
first of those messages (Anthropic ignores earlier-turn thinking anyway). Thinking blocks
without a signature (e.g. from another provider) are never sent: Anthropic rejects them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from greenroom.protocols.content import (
    ImageBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from greenroom.protocols.context import (
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
    text_delta,
    token_count,
)
from greenroom.protocols.structured import (
    FINAL_ANSWER,
    anthropic_native_model,
    anthropic_schema,
    final_answer_tool,
)
from greenroom.protocols.text import repair_text
from greenroom.protocols.tools import (
    MAX_ARGUMENT_DEPTH,
    json_error_reason,
    parse_tool_arguments,
)

ImageLoader = Callable[[ImageBlock], "dict[str, Any] | None"]
"""Turns an image block into an Anthropic ``image`` content block, or None when it cannot
(missing file, unsupported type). It runs outside this module's no-I/O rule: the caller
supplies it."""

THINKING_BUDGETS: dict[str, int] = {"low": 1024, "medium": 4096, "high": 16384}
"""``budget_tokens`` per ``ModelRequest.thinking_level``."""

NO_CONTENT = "(no content)"
"""Text sent for a message that has nothing Anthropic accepts (it rejects empty content)."""

NO_OUTPUT = "(no output)"
"""Text sent for a tool result without content (Anthropic rejects empty error results)."""


# --------------------------------------------------------------------------- requests


class _UserEnc:
    __slots__ = ("others", "results")

    def __init__(self, results: list[dict[str, Any]], others: list[dict[str, Any]]) -> None:
        self.results = results
        self.others = others


class _AssistantEnc:
    __slots__ = ("full", "plain")

    def __init__(self, full: list[dict[str, Any]], plain: list[dict[str, Any]]) -> None:
        self.full = full
        self.plain = plain


def _ephemeral() -> dict[str, str]:
    return {"type": "ephemeral"}


def _thinking_config(level: str | None) -> int | None:
    if level is None or level in ("", "off", "none"):
        return None
    budget = THINKING_BUDGETS.get(level)
    if budget is None:
        raise ValueError(
            f"unknown thinking_level {level!r}; expected one of {sorted(THINKING_BUDGETS)}"
        )
    return budget


class RequestEncoder:
    """Builds request bodies for one model context, reusing the encoding of every message
    object it has already seen at the same position.

    The session's context is append-only, so from one turn to the next every earlier
    message is the same object at the same index and only the new ones are encoded. A
    history that changed (compaction, another session) is detected by identity and
    re-encoded from the first differing position. The returned body shares sub-dicts with
    this cache: treat it as read-only (serialize it, don't edit it).
    """

    __slots__ = (
        "_answer",
        "_entries",
        "_image_loader",
        "_tools_enc",
        "_tools_key",
        "_vision",
    )

    def __init__(self, image_loader: ImageLoader | None = None) -> None:
        self._image_loader = image_loader
        self._entries: list[tuple[Message, _UserEnc | _AssistantEnc]] = []
        self._vision = image_loader is not None
        self._tools_key: tuple[ToolSchema, ...] | None = None
        self._tools_enc: list[dict[str, Any]] = []
        self._answer: tuple[Any, ...] | None = None
        """``(output, tools, model, native schema, tools with final_answer)`` of the
        last structured request: the same objects every turn of a task, so the encoding
        (and the tools' identity the tool cache goes by) is worked out once."""

    def build(self, request: ModelRequest) -> dict[str, Any]:
        """The Messages API body for ``request`` (see the module docstring for the cache
        and thinking rules).

        Keys, in this order: ``model``, ``max_tokens``, ``stream`` (always true),
        ``thinking`` (only with a thinking level; ``max_tokens`` is then raised to
        ``max_tokens + budget`` unless it already exceeds the budget), ``system`` (only when
        non-empty), ``tools`` (only when any), ``output_config`` or ``tool_choice`` (a
        structured answer, see :meth:`_answer_form`; an ``offered_output`` adds its tool
        to ``tools`` and neither of them), ``messages``. Consecutive messages of
        one role are merged; tool results come first in a user message, in their order;
        empty text is dropped; adjacent text blocks of an assistant message are one text
        block, joined by line breaks as every reader joins them (the model's text split to
        fit a cluster's records is sent back whole). Raises ``ValueError`` for an unknown
        thinking level.
        """
        budget = _thinking_config(request.thinking_level)
        max_tokens = request.max_tokens
        if budget is not None and max_tokens <= budget:
            max_tokens += budget
        body: dict[str, Any] = {"model": request.model, "max_tokens": max_tokens, "stream": True}
        if budget is not None:
            body["thinking"] = {"type": "enabled", "budget_tokens": budget}
        if request.system:
            body["system"] = [
                {"type": "text", "text": request.system, "cache_control": _ephemeral()}
            ]
        tools = request.tools
        native: dict[str, Any] | None = None
        if request.output is not None:
            native, tools = self._answer_form(request, request.output)
        elif request.offered_output is not None:
            # A summary request: the turn's tools, final_answer included, and nothing
            # that forces an answer (R-COMPACT-5).
            _, tools = self._answer_form(request, request.offered_output)
        if tools:
            body["tools"] = self._tools(tools)
        if native is not None:
            body["output_config"] = {"format": {"type": "json_schema", "schema": native}}
        elif request.output is not None and budget is None:
            # Anthropic refuses a forced tool choice with extended thinking: with thinking
            # on the model is only offered the tool, and an answer given as text is taken
            # (or sent back) as any is.
            only_answer = len(tools) == 1
            body["tool_choice"] = (
                {"type": "tool", "name": FINAL_ANSWER} if only_answer else {"type": "any"}
            )
        body["messages"] = self._messages(request, thinking=budget is not None)
        return body

    def _answer_form(
        self, request: ModelRequest, output: OutputFormat
    ) -> tuple[dict[str, Any] | None, tuple[ToolSchema, ...]]:
        """How the structured answer ``output`` is asked for (R-OUT-1): the native
        ``output_config.format`` schema for the models that have it and a schema it can
        say (every object closed), else None and the tools with the synthetic
        ``final_answer`` tool last: ``tool_choice`` names it when it is the only tool,
        and asks for any tool otherwise, so the model may call the others first."""
        memo = self._answer
        if (
            memo is not None
            and memo[0] is output
            and memo[1] is request.tools
            and memo[2] == request.model
        ):
            return memo[3], memo[4]
        native = anthropic_schema(output.schema) if anthropic_native_model(request.model) else None
        tools = request.tools if native is not None else (
            *request.tools, final_answer_tool(output.schema)
        )
        self._answer = (output, request.tools, request.model, native, tools)
        return native, tools

    def _tools(self, tools: tuple[ToolSchema, ...]) -> list[dict[str, Any]]:
        if tools is not self._tools_key:
            encoded: list[dict[str, Any]] = [
                {"name": t.name, "description": t.description, "input_schema": t.input_schema}
                for t in tools
            ]
            encoded[-1] = {**encoded[-1], "cache_control": _ephemeral()}
            self._tools_key = tools
            self._tools_enc = encoded
        return self._tools_enc

    def _messages(self, request: ModelRequest, *, thinking: bool) -> list[dict[str, Any]]:
        vision = request.supports_vision and self._image_loader is not None
        entries = self._entries
        if vision != self._vision:
            entries.clear()
            self._vision = vision
        msgs = request.messages
        same = 0
        limit = min(len(entries), len(msgs))
        while same < limit and entries[same][0] is msgs[same]:
            same += 1
        del entries[same:]
        for msg in msgs[same:]:
            entries.append((msg, self._encode(msg)))

        # Runs of consecutive same-role messages become one wire message (Anthropic
        # requires strict alternation).
        runs: list[list[_UserEnc | _AssistantEnc]] = []
        previous: type | None = None
        for _, enc in entries:
            if type(enc) is previous:
                runs[-1].append(enc)
            else:
                runs.append([enc])
                previous = type(enc)

        keep_thinking: set[int] = set()
        if thinking:
            answered = False
            for r in range(len(runs) - 1, -1, -1):
                run = runs[r]
                if isinstance(run[0], _UserEnc):
                    if not any(e.results for e in run if isinstance(e, _UserEnc)):
                        break
                    answered = True
                elif answered:
                    keep_thinking.add(r)

        out: list[dict[str, Any]] = []
        for r, run in enumerate(runs):
            content: list[dict[str, Any]] = []
            if isinstance(run[0], _UserEnc):
                role = "user"
                for e in run:
                    if isinstance(e, _UserEnc):
                        content += e.results
                for e in run:
                    if isinstance(e, _UserEnc):
                        content += e.others
            else:
                role = "assistant"
                full = r in keep_thinking
                for e in run:
                    if isinstance(e, _AssistantEnc):
                        content += e.full if full else e.plain
            if not content:
                content.append({"type": "text", "text": NO_CONTENT})
            out.append({"role": role, "content": content})

        if out:
            last = out[-1]["content"]
            for j in range(len(last) - 1, -1, -1):
                # Anthropic does not accept cache_control on thinking blocks.
                if last[j]["type"] not in ("thinking", "redacted_thinking"):
                    last[j] = {**last[j], "cache_control": _ephemeral()}
                    break
        return out

    def _encode(self, msg: Message) -> _UserEnc | _AssistantEnc:
        if isinstance(msg, UserMessage):
            results: list[dict[str, Any]] = []
            others: list[dict[str, Any]] = []
            for part in msg.content:
                if isinstance(part, ToolResult):
                    results.append(self._tool_result(part))
                elif isinstance(part, TextBlock):
                    if part.text:
                        others.append({"type": "text", "text": part.text})
                else:
                    others.append(self._image(part))
            return _UserEnc(results, others)
        full: list[dict[str, Any]] = []
        plain: list[dict[str, Any]] = []
        text: dict[str, Any] | None = None  # where the message's text blocks so far went
        for block in msg.content:
            if isinstance(block, TextBlock):
                if text is not None and block.text:
                    # Adjacent text blocks are one text in lines, as every reader joins
                    # them: the model's text split to fit a cluster's records
                    # (trace.fit_model_block) is sent back as it wrote it. Sent apart,
                    # Anthropic would join them with nothing between (R-TRACE).
                    text["text"] += "\n" + block.text
                elif block.text:
                    text = {"type": "text", "text": block.text}
                    full.append(text)
                    plain.append(text)
                continue
            text = None
            if isinstance(block, ToolCallBlock):
                d: dict[str, Any] = {"type": "tool_use", "id": block.id, "name": block.name,
                     "input": block.arguments}
                full.append(d)
                plain.append(d)
            elif isinstance(block, ThinkingBlock):
                if block.signature:
                    full.append(
                        {"type": "thinking", "thinking": block.text,
                         "signature": block.signature}
                    )
            else:
                full.append({"type": "redacted_thinking", "data": block.data})
        return _AssistantEnc(full, plain)

    def _tool_result(self, result: ToolResult) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        for part in result.content:
            if isinstance(part, TextBlock):
                if part.text:
                    content.append({"type": "text", "text": part.text})
            else:
                content.append(self._image(part))
        if not content:
            content.append({"type": "text", "text": NO_OUTPUT})
        return {
            "type": "tool_result",
            "tool_use_id": result.call_id,
            "content": content,
            "is_error": result.is_error,
        }

    def _image(self, image: ImageBlock) -> dict[str, Any]:
        if self._vision and self._image_loader is not None:
            loaded = self._image_loader(image)
            if loaded is not None:
                return loaded
        return {"type": "text", "text": f"[attached image: {image.path}]"}


def build_request(
    request: ModelRequest, *, image_loader: ImageLoader | None = None
) -> dict[str, Any]:
    """One-shot :meth:`RequestEncoder.build` (no cache kept between calls).

    ``image_loader`` gives the ``image`` block of an image; without it, when it returns
    None, or when ``request.supports_vision`` is false, an image becomes the text
    ``[attached image: <path>]``.
    """
    return RequestEncoder(image_loader).build(request)


# --------------------------------------------------------------------------- errors

_CONTEXT_OVERFLOW_WORDING = (
    "prompt is too long",
    "exceed context limit",
    "input is too long",
)


def _is_context_overflow(message: str) -> bool:
    lowered = message.lower()
    return any(w in lowered for w in _CONTEXT_OVERFLOW_WORDING)


def _kind_for_error_type(error_type: str | None, message: str) -> ErrorKind:
    if error_type in ("overloaded_error", "api_error", "rate_limit_error", "timeout_error"):
        return "timeout"
    if error_type in ("authentication_error", "permission_error"):
        return "auth"
    if error_type == "invalid_request_error" and _is_context_overflow(message):
        return "context_overflow"
    return "failed"


_PERMANENT_TYPES = frozenset({"invalid_request_error", "not_found_error", "request_too_large"})
_PERMANENT_STATUSES = frozenset({400, 404, 413, 422})


def _is_permanent(status: int | None, error_type: str | None) -> bool:
    """The provider rejected the request itself (wrong model, invalid or too large): the
    same request fails the same way, so it is not retried (R-RETRY-2)."""
    return status in _PERMANENT_STATUSES or error_type in _PERMANENT_TYPES


def _error_text(error_type: str | None, message: str | None) -> str:
    if error_type and message:
        return f"{error_type}: {message}"
    return error_type or message or "unknown error"


def _parse_error_body(body: bytes | str) -> tuple[str | None, str]:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return None, text.strip()[:1000]
    if not isinstance(data, dict):
        return None, text.strip()[:1000]
    err = data.get("error")
    if isinstance(err, dict):
        etype = err.get("type")
        msg = err.get("message")
        return (
            etype if isinstance(etype, str) else None,
            msg if isinstance(msg, str) else json.dumps(err, ensure_ascii=False)[:1000],
        )
    if isinstance(err, str):
        return None, err
    msg = data.get("message")
    return None, msg if isinstance(msg, str) else text.strip()[:1000]


def classify_error(
    status: int,
    body: bytes | str,
    headers: Mapping[str, str],
    *,
    now: float | None = None,
) -> ModelError:
    """Classify an HTTP error response of the Messages API (R-RETRY-1). Never raises.

    * 401, 403 (or an ``authentication_error``/``permission_error`` body) -> ``auth``;
    * 400 whose message says the prompt is too long / input plus ``max_tokens`` exceed the
      context limit -> ``context_overflow``;
    * 408, 429, every 5xx (529 overloaded included) -> ``timeout`` (transient), with
      ``retry_after_s`` from ``retry-after-ms`` or ``retry-after`` (seconds, or an HTTP date
      relative to ``now``, the wall clock; dates are ignored without it) when present
      (:func:`~greenroom.protocols.retry.parse_retry_after`), for a 429 without them
      when its exhausted rate limit resets
      (:func:`~greenroom.protocols.retry.parse_rate_limit_reset`);
    * every other status -> ``failed``; ``permanent`` (not retried) for 400, 404 (unknown
      model), 413 (request too large) and 422, and for an ``invalid_request_error``,
      ``not_found_error`` or ``request_too_large`` body whatever the status.

    ``message`` is the provider's error text, prefixed by its error type when known; a
    non-JSON body is used as text. A transient status is named first, in words
    (``rate limited (HTTP 429): …``, ``overloaded (HTTP 529): …``:
    :func:`~greenroom.protocols.retry.transient_status_text`). ``status_code`` is ``status``.
    """
    try:
        error_type, message = _parse_error_body(body)
    except Exception:  # a classifier must classify, whatever the body is
        error_type, message = None, ""
    text = _error_text(error_type, message) if (error_type or message) else f"HTTP {status}"
    retry_after = parse_retry_after(headers, now)
    if retry_after is None and status == 429:
        retry_after = parse_rate_limit_reset(headers, now)
    kind: ErrorKind
    if status in (401, 403) or error_type in ("authentication_error", "permission_error"):
        kind = "auth"
    elif status == 400 and _is_context_overflow(message):
        kind = "context_overflow"
    elif status in (408, 429) or status >= 500:
        kind = "timeout"
        # The kind is the retry class; the words say which transient failure it was.
        text = transient_status_text(status, _error_text(error_type, message)
                                     if (error_type or message) else "")
    else:
        kind = "failed"
        if status == 413:
            text = f"request too large (HTTP 413; shrink the request): {text}"
    permanent = kind == "failed" and _is_permanent(status, error_type)
    # The provider's words are traced with the attempt: a lone surrogate its JSON spells is
    # repaired here (R-SEC-1).
    return ModelError(kind=kind, message=repair_text(text), status_code=status,
                      retry_after_s=retry_after, permanent=permanent)


# --------------------------------------------------------------------------- stream


class _Block:
    """Accumulator of one open client-visible content block (a plain class: hot path)."""

    __slots__ = ("call_id", "index", "kind", "name", "parts", "signature", "start_input")

    def __init__(self, index: int, kind: str, call_id: str = "", name: str = "",
                 start_input: Any = None) -> None:
        self.index = index
        self.kind = kind
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []
        self.signature = ""
        self.start_input = start_input


def _completed(blk: _Block) -> BlockCompleted:
    if blk.kind == "text":
        return BlockCompleted(index=blk.index, block=TextBlock(text="".join(blk.parts)))
    if blk.kind == "thinking":
        return BlockCompleted(
            index=blk.index,
            block=ThinkingBlock(text="".join(blk.parts), signature=blk.signature or None),
        )
    raw = "".join(blk.parts)
    if not raw.strip():
        # No argument text: the whole input may have come in content_block_start. It goes
        # through the same checks as argument text (depth, NaN, surrogates).
        start = blk.start_input
        if not isinstance(start, dict) or not start:
            return BlockCompleted(
                index=blk.index, block=ToolCallBlock(id=blk.call_id, name=blk.name, arguments={})
            )
        try:
            # Repaired as argument text is: an input that is not valid arguments is kept
            # as its text, which is traced (R-SEC-1).
            raw = repair_text(json.dumps(start, ensure_ascii=False))
        except (RecursionError, ValueError):
            # Deeper than the encoder goes: the text stands for "too deep" (R-SEC-6).
            raw = "[" * (MAX_ARGUMENT_DEPTH + 1)
    arguments, invalid = parse_tool_arguments(raw)
    call = ToolCallBlock(id=blk.call_id, name=blk.name, arguments=arguments,
                         invalid_arguments=invalid)
    return BlockCompleted(index=blk.index, block=call)


def _text_field(delta: Any, key: str) -> str:
    value = delta[key]
    if value.__class__ is not str:
        raise _Malformed(f"{key} is not a string")
    return value if value.isascii() else repair_text(value)


def _int(value: Any) -> int:
    return token_count(value) or 0


# The hot path. json.loads costs four Python calls and two regex matches per event before
# the C scanner runs; the scanner alone is enough for one JSON object per SSE ``data``
# (anything it does not fully consume goes through json.loads for the exact error).
_scan_once: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def _loads(text: str) -> Any:
    try:
        value, end = _scan_once(text, 0)
    except (StopIteration, ValueError):
        return json.loads(text)
    if end != len(text):
        return json.loads(text)
    return value


class _Malformed(ValueError):
    """An event whose shape breaks the stream's rules; its text says how."""


def _shape_problem(exc: BaseException) -> str:
    """What was wrong with an event's shape, in words rather than Python's: the rule an
    event broke, a missing field, or a field of the wrong type or value."""
    if isinstance(exc, _Malformed):
        return str(exc)
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}" if exc.args else "a field is missing"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, ValueError):
        return "a field has an invalid value"
    return "a field has the wrong type"


_DELTA_PREFIX = '{"type":"content_block_delta","index":'
_DELTA_START = len(_DELTA_PREFIX)
_DELTA_MIDDLES: tuple[tuple[str, int, str], ...] = tuple(
    (middle, len(middle), kind)
    for middle, kind in (
        (',"delta":{"type":"text_delta","text":"', "text"),
        (',"delta":{"type":"input_json_delta","partial_json":"', "tool_call"),
        (',"delta":{"type":"thinking_delta","thinking":"', "thinking"),
    )
)


# Faster still, for the bulk of a network read: a whole delta event (SSE framing and the
# JSON around its one string) matched on the raw bytes by one expression. The string may
# hold escapes but no raw quote, backslash or control character; anything else, or an
# escape the JSON scanner refuses, goes to the SSE decoder and the paths below.
_DELTA_EVENT = re.compile(
    rb'event: content_block_delta\ndata: \{"type":"content_block_delta","index":'
    rb'(0|[1-9][0-9]{0,8}),"delta":\{"type":"'
    rb'(text_delta","text|input_json_delta","partial_json|thinking_delta","thinking)":"'
    rb'([^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*)"\}\}\n\n'
)
_DELTA_EVENT_KINDS: dict[bytes, str] = {
    b'text_delta","text': "text",
    b'input_json_delta","partial_json': "tool_call",
    b'thinking_delta","thinking': "thinking",
}


def _fast_delta(text: str) -> tuple[int, str, str] | None:
    """``(index, block kind, value)`` of a compact ``content_block_delta`` carrying exactly
    one text/partial_json/thinking string (the shape the API sends), else None. The caller
    has checked the prefix."""
    comma = text.find(",", _DELTA_START)
    digits = text[_DELTA_START:comma]
    if not (digits.isascii() and digits.isdigit()) or (digits[0] == "0" and len(digits) > 1):
        return None  # also when comma < 0: digits is then not all digits or empty
    for middle, size, kind in _DELTA_MIDDLES:
        if text.startswith(middle, comma):
            try:
                value, end = _scanstring(text, comma + size)
            except ValueError:
                return None
            if end != len(text) - 2 or not text.endswith("}}"):
                return None
            return int(digits), kind, value
    return None


class AnthropicStreamDecoder:
    """Decodes one streamed Messages API response body into stream events.

    Contract (the events and their order are those of :mod:`greenroom.protocols.stream`):

    * :meth:`feed` takes raw HTTP body bytes split anywhere; :meth:`end_of_stream` is
      called once when the body ends. Each returns the events produced.
    * Exactly one terminal event is produced: ``MessageCompleted`` at ``message_stop``, or
      ``StreamFailed`` (an ``error`` event, ``model_context_window_exceeded``, invalid JSON
      or an unexpected event shape, or the body ending before ``message_stop``). Input
      after the terminal event is ignored.
    * Text and thinking blocks complete at ``content_block_stop``. A ``tool_use`` block
      completes only once it cannot have been cut by ``max_tokens``: at the next event
      after its ``content_block_stop`` other than ``message_delta`` (``ping`` and unknown
      events don't count), or at a ``message_delta`` whose stop reason is not
      ``max_tokens``. With ``max_tokens``, the last tool call (stopped or not) becomes
      ``ToolCallTruncated`` and never completes; other open blocks complete there.
    * ``server_tool_use`` and other non-client block types produce no events;
      ``redacted_thinking`` completes at its ``content_block_start``.
    * Usage is cumulative: ``message_delta`` values replace earlier ones.
      ``UsageReported`` is produced when usage changes.
    * ``MessageCompleted`` carries the ``id`` and ``model`` of ``message_start``'s message
      as ``response_id`` and ``response_model`` (None when it has none).
    * One message per stream: a second ``message_start`` with another id, a
      ``content_block_start`` at an index already started, or two ``tool_use`` blocks with
      one id (R-SEC-6) are ``StreamFailed(malformed)``. An empty ``stop_reason`` is no
      verdict. The last ``signature_delta`` of a thinking block stands.
    * Every string passed on (text, thinking, arguments, ids, names, the model, the stop
      reason, signatures, an error's words) has lone UTF-16 surrogates replaced (R-SEC-1);
      a signature or redacted thinking that is not a string is ``StreamFailed(malformed)``;
      arguments nested deeper than ``MAX_ARGUMENT_DEPTH`` are invalid arguments.
    * A body past :data:`~greenroom.protocols.sse.MAX_RESPONSE_BYTES` is
      ``StreamFailed(malformed)`` (a server that never ends its answer).
    """

    __slots__ = ("_blocks", "_cache_read", "_cache_write", "_call_ids", "_deferred", "_done",
                 "_input", "_last_event", "_message_id", "_model", "_output", "_room", "_seen",
                 "_skipped", "_sse", "_started", "_stop_reason", "_usage")

    def __init__(self) -> None:
        self._sse = SSEDecoder()
        self._blocks: dict[int, _Block] = {}
        self._skipped: set[int] = set()
        self._seen: set[int] = set()
        self._call_ids: set[str] = set()
        self._message_id: Any = None
        self._model: str | None = None
        self._deferred: _Block | None = None
        self._input = 0
        self._output = 0
        self._cache_read = 0
        self._cache_write = 0
        self._usage = TokenUsage()
        self._stop_reason: str | None = None
        self._started = False
        self._done = False
        self._last_event: str | None = None
        self._room = MAX_RESPONSE_BYTES  # bytes of the body still taken

    @property
    def usage(self) -> TokenUsage:
        """The latest cumulative usage of this response."""
        return self._usage

    @property
    def finished(self) -> bool:
        """Whether the terminal event has been produced."""
        return self._done

    def feed(self, data: bytes) -> list[StreamEvent]:
        """Decode one chunk of the response body."""
        if self._done:
            return []
        out: list[StreamEvent] = []
        self._room -= len(data)
        if self._room < 0:
            self._fail(out, "malformed", response_too_large())
            return out
        if self._sse.at_event_boundary:
            taken = self._feed_delta_events(data, out)
            if taken == len(data):
                return coalesce_deltas(out)
            if taken:
                data = data[taken:]
        blocks = self._blocks
        try:
            names, texts = self._sse.feed_columns(data)
        except EventTooLarge as exc:
            self._fail(out, "malformed", str(exc))
            return out
        for name, text in zip(names, texts, strict=True):
            # Fast path for the bulk of a stream: a delta of an open block, in the compact
            # shape the API sends. Anything else (or any surprise) takes the full parse.
            if name == "content_block_delta" and text.startswith(_DELTA_PREFIX):
                fast = _fast_delta(text)
                if fast is not None:
                    idx, kind, value = fast
                    blk = blocks.get(idx)
                    if blk is not None and blk.kind == kind:
                        self._add_delta(out, blk, idx, value)
                        continue
            if name == "ping":
                continue
            try:
                payload = _loads(text)
            except (ValueError, RecursionError) as exc:
                self._fail(out, "malformed", f"malformed JSON in the model stream: "
                                             f"{json_error_reason(exc)} (in {name or 'an'} event)")
                break
            try:
                self._handle(payload, name, out)
            except (KeyError, TypeError, AttributeError, ValueError, RecursionError) as exc:
                self._fail(out, "malformed",
                           f"unexpected {name or 'event'} shape: {_shape_problem(exc)}")
            # A method call, because mypy would keep self._done narrowed to False here.
            if self._terminal():
                break
        return coalesce_deltas(out)

    def end_of_stream(self) -> list[StreamEvent]:
        """The body ended. Without ``message_stop`` this is ``StreamFailed(malformed)``,
        naming what was missing; a tool call not yet certain to be complete is dropped."""
        if self._done:
            return []
        self._sse.close()
        if not self._started:
            what = "stream ended before message_start"
        elif self._stop_reason is None:
            what = "stream ended before message_delta/message_stop"
        else:
            what = "stream ended before message_stop"
        if self._sse.truncated:
            what += "; the final event was cut off"
        if self._last_event:
            what += f" (last event: {self._last_event})"
        out: list[StreamEvent] = []
        self._fail(out, "malformed", what)
        return out

    def _feed_delta_events(self, data: bytes, out: list[StreamEvent]) -> int:
        """Decode the whole delta events ``data`` begins with (see ``_DELTA_EVENT``) for
        blocks that are open; returns how many bytes they took. Stops at the first event
        it cannot take, which the general path then decodes, as it would all of them."""
        match = _DELTA_EVENT.match
        blocks = self._blocks
        pos = 0
        size = len(data)
        while pos < size:
            found = match(data, pos)
            if found is None:
                break
            digits, shape, raw = found.groups()
            kind = _DELTA_EVENT_KINDS[shape]
            idx = int(digits)
            blk = blocks.get(idx)
            if blk is None or blk.kind != kind:
                break
            value = raw.decode("utf-8", "replace")
            if b"\\" in raw:
                try:
                    value = _scanstring(value + '"', 0)[0]
                except ValueError:
                    break
            self._add_delta(out, blk, idx, value)
            pos = found.end()
        return pos

    def _add_delta(self, out: list[StreamEvent], blk: _Block, idx: int, value: str) -> None:
        """A delta of open block ``blk`` (its kind checked by the caller), from a fast path."""
        if self._deferred is not None:
            self._flush_deferred(out)
        self._last_event = "content_block_delta"
        if not value:
            return
        if not value.isascii():
            value = repair_text(value)
        blk.parts.append(value)
        kind = blk.kind
        if kind == "text":
            out.append(text_delta(idx, value))
        elif kind == "tool_call":
            out.append(ToolArgumentsDelta(index=idx, call_id=blk.call_id, name=blk.name,
                                          delta=value))
        else:
            out.append(ThinkingDelta(index=idx, text=value))

    def _terminal(self) -> bool:
        return self._done

    def _fail(self, out: list[StreamEvent], kind: ErrorKind, message: str, *,
              permanent: bool = False) -> None:
        # The words may quote the stream (an error event's message, a bad index): they are
        # traced with the attempt, so a lone surrogate is repaired here (R-SEC-1).
        out.append(StreamFailed(error=ModelError(kind=kind, message=repair_text(message),
                                                 permanent=permanent)))
        self._done = True

    def _flush_deferred(self, out: list[StreamEvent]) -> None:
        blk = self._deferred
        if blk is not None:
            self._deferred = None
            out.append(_completed(blk))

    def _handle(self, payload: Any, sse_event: str | None, out: list[StreamEvent]) -> None:
        etype = payload.get("type", sse_event)
        self._last_event = etype
        if etype == "content_block_delta":
            if self._deferred is not None:
                self._flush_deferred(out)
            idx = payload["index"]
            blk = self._blocks.get(idx)
            if blk is None:
                if idx in self._skipped:
                    return
                raise _Malformed(f"delta for unknown block index {idx}")
            delta = payload["delta"]
            dtype = delta["type"]
            kind = blk.kind
            if dtype == "text_delta" and kind == "text":
                text = _text_field(delta, "text")
                if text:
                    blk.parts.append(text)
                    out.append(TextDelta(index=idx, text=text))
            elif dtype == "input_json_delta" and kind == "tool_call":
                part = _text_field(delta, "partial_json")
                if part:
                    blk.parts.append(part)
                    out.append(ToolArgumentsDelta(index=idx, call_id=blk.call_id,
                                                  name=blk.name, delta=part))
            elif dtype == "thinking_delta" and kind == "thinking":
                text = _text_field(delta, "thinking")
                if text:
                    blk.parts.append(text)
                    out.append(ThinkingDelta(index=idx, text=text))
            elif dtype == "signature_delta" and kind == "thinking":
                # Each signature_delta carries the whole signature: the last one stands.
                blk.signature = _text_field(delta, "signature")
            elif dtype in ("text_delta", "input_json_delta", "thinking_delta",
                           "signature_delta"):
                raise _Malformed(f"{dtype} for a {kind} block")
            # Other delta types (citations_delta, future ones) carry nothing we keep.
        elif etype == "content_block_start":
            self._flush_deferred(out)
            idx = payload["index"]
            if idx in self._seen:
                # Two blocks at one index: two responses spliced together, or a replay.
                raise _Malformed(f"content_block_start for index {idx} already started")
            cb = payload["content_block"]
            btype = cb["type"]
            if idx.__class__ is not int:
                raise _Malformed("block index is not an integer")
            self._seen.add(idx)
            if btype == "text":
                blk = _Block(idx, "text")
                self._blocks[idx] = blk
                out.append(BlockStarted(index=idx, kind="text"))
                text = cb.get("text")
                if text:
                    text = repair_text(text)
                    blk.parts.append(text)
                    out.append(TextDelta(index=idx, text=text))
            elif btype == "tool_use":
                call_id = cb["id"]
                if not call_id or call_id.__class__ is not str:
                    raise _Malformed("tool_use block without an id")
                if len(self._call_ids) >= MAX_TOOL_CALLS:
                    raise _Malformed(f"more than {MAX_TOOL_CALLS} tool calls in one message")
                if call_id in self._call_ids:
                    # Two calls sharing an id cannot both be answered (R-SEC-6).
                    raise _Malformed(f"tool_use id {call_id[:100]!r} repeated in one message")
                self._call_ids.add(call_id)
                blk = _Block(idx, "tool_call", repair_text(call_id), repair_text(cb["name"]),
                             cb.get("input"))
                self._blocks[idx] = blk
                out.append(BlockStarted(index=idx, kind="tool_call", call_id=blk.call_id,
                                        name=blk.name))
            elif btype == "thinking":
                blk = _Block(idx, "thinking")
                self._blocks[idx] = blk
                out.append(BlockStarted(index=idx, kind="thinking"))
                text = cb.get("thinking")
                if text:
                    text = repair_text(text)
                    blk.parts.append(text)
                    out.append(ThinkingDelta(index=idx, text=text))
                signature = cb.get("signature")
                if signature:
                    blk.signature = _opaque(signature, "signature")
            elif btype == "redacted_thinking":
                data = _opaque(cb["data"], "redacted_thinking data")
                self._skipped.add(idx)
                out.append(BlockStarted(index=idx, kind="redacted_thinking"))
                out.append(BlockCompleted(index=idx, block=RedactedThinkingBlock(data=data)))
            else:
                # server_tool_use, web_search_tool_result, …: run by the provider, not us.
                self._skipped.add(idx)
        elif etype == "content_block_stop":
            self._flush_deferred(out)
            idx = payload["index"]
            blk = self._blocks.pop(idx, None)
            if blk is None:
                if idx in self._skipped:
                    return
                raise _Malformed(f"content_block_stop for unknown block index {idx}")
            if blk.kind == "tool_call":
                self._deferred = blk
            else:
                out.append(_completed(blk))
        elif etype == "message_delta":
            self._message_delta(payload, out)
        elif etype == "message_start":
            self._flush_deferred(out)
            message = payload["message"]
            message_id = message.get("id")
            if self._started:
                if message_id != self._message_id:
                    # A second message inside one response: two streams spliced together.
                    raise _Malformed(f"second message_start (message {message_id!r} after "
                                     f"{self._message_id!r})")
                return
            self._started = True
            self._message_id = message_id
            self._model = _str_or_none(message.get("model"))
            usage = message.get("usage")
            if isinstance(usage, dict):
                self._input = _int(usage.get("input_tokens"))
                self._cache_write = _int(usage.get("cache_creation_input_tokens"))
                self._cache_read = _int(usage.get("cache_read_input_tokens"))
                self._output = _int(usage.get("output_tokens"))
            self._report_usage(out)
        elif etype == "message_stop":
            self._flush_deferred(out)
            if self._stop_reason is None:
                self._fail(out, "malformed", "message_stop without a stop_reason "
                                             "(no message_delta)")
                return
            for blk in sorted(self._blocks.values(), key=lambda b: b.index):
                out.append(_completed(blk))
            self._blocks.clear()
            out.append(MessageCompleted(stop_reason=self._stop_reason, usage=self._usage,
                                        response_id=_str_or_none(self._message_id),
                                        response_model=self._model))
            self._done = True
        elif etype == "error":
            self._flush_deferred(out)
            err = payload.get("error")
            etype_s: str | None = None
            message = ""
            if isinstance(err, dict):
                raw_type = err.get("type")
                etype_s = raw_type if isinstance(raw_type, str) else None
                raw_msg = err.get("message")
                message = raw_msg if isinstance(raw_msg, str) else ""
            elif isinstance(err, str):
                message = err
            kind = _kind_for_error_type(etype_s, message)
            self._fail(out, kind, _error_text(etype_s, message),
                       permanent=kind == "failed" and _is_permanent(None, etype_s))
        # ping and unknown event types: ignored, and they don't settle a deferred tool call.

    def _report_usage(self, out: list[StreamEvent]) -> None:
        usage = TokenUsage(input=self._input, output=self._output,
                           cache_read=self._cache_read, cache_write=self._cache_write)
        if usage != self._usage:
            self._usage = usage
            out.append(UsageReported(usage=usage))

    def _message_delta(self, payload: Any, out: list[StreamEvent]) -> None:
        usage = payload.get("usage")
        if isinstance(usage, dict):
            # Cumulative counts: replace, never add. Absent/null input fields keep theirs.
            value = token_count(usage.get("output_tokens"))
            if value is not None:
                self._output = value
            value = token_count(usage.get("input_tokens"))
            if value is not None:
                self._input = value
            value = token_count(usage.get("cache_creation_input_tokens"))
            if value is not None:
                self._cache_write = value
            value = token_count(usage.get("cache_read_input_tokens"))
            if value is not None:
                self._cache_read = value
        delta = payload.get("delta")
        stop = delta.get("stop_reason") if isinstance(delta, dict) else None
        if not isinstance(stop, str) or not stop:
            # No verdict yet: a stopped tool call stays deferred.
            self._report_usage(out)
            return
        self._stop_reason = stop = repair_text(stop)
        if stop == "model_context_window_exceeded":
            self._report_usage(out)
            self._fail(out, "context_overflow",
                       "model_context_window_exceeded: the context window is full")
            return
        pending = sorted(self._blocks.values(), key=lambda b: b.index)
        self._blocks.clear()
        if self._deferred is not None:
            pending.insert(0, self._deferred)
            self._deferred = None
        truncated: _Block | None = None
        if stop == "max_tokens":
            for blk in pending:
                if blk.kind == "tool_call" and (truncated is None or blk.index > truncated.index):
                    truncated = blk
        for blk in pending:
            if blk is truncated:
                out.append(ToolCallTruncated(index=blk.index, call_id=blk.call_id,
                                             name=blk.name, partial_arguments="".join(blk.parts)))
            else:
                out.append(_completed(blk))
        self._report_usage(out)


def _str_or_none(value: Any) -> str | None:
    """``value`` when the server sent a string there (lone surrogates repaired: it is
    traced, R-SEC-1), else None."""
    return repair_text(value) if isinstance(value, str) and value else None


def _opaque(value: Any, what: str) -> str:
    """A signature or encrypted data the provider wants back as it sent it: a string, or
    the event is malformed (kept in the transcript and traced, so never another type nor
    a lone surrogate, R-SEC-1)."""
    if value.__class__ is not str:
        raise _Malformed(f"{what} is not a string")
    return repair_text(value)
