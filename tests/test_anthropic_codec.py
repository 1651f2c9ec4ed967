"""Anthropic codec: fixture replay (whole and re-chunked), error classification, requests."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from greenroom.protocols.anthropic_codec import (
    NO_CONTENT,
    NO_OUTPUT,
    THINKING_BUDGETS,
    AnthropicStreamDecoder,
    RequestEncoder,
    build_request,
    classify_error,
)
from greenroom.protocols.content import (
    ImageBlock,
    RedactedThinkingBlock,
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
from greenroom.protocols.retry import RETRYABLE, should_retry
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    MessageCompleted,
    StreamEvent,
    StreamFailed,
    TextDelta,
    ThinkingDelta,
    TokenUsage,
    ToolArgumentsDelta,
    ToolCallTruncated,
    UsageReported,
    coalesce_deltas,
)
from greenroom.protocols.trace import fit_model_block

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "manifest.json").read_text())
STREAMS = sorted(k for k in MANIFEST if k.startswith("anthropic/") and k.endswith(".sse"))
ERRORS = sorted(k for k in MANIFEST if k.startswith("anthropic/errors/"))

# The manifest's words for a failure, in R-RETRY-1 kinds.
KIND_OF_CLASSIFICATION = {
    "overloaded": "timeout",
    "server_error": "timeout",
    "rate_limit": "timeout",
    "incomplete_stream": "malformed",
    "context_overflow": "context_overflow",
    "auth": "auth",
    "permission": "auth",
    "not_found": "failed",
    "invalid_request": "failed",
    "request_too_large": "failed",
}

TERMINAL = (MessageCompleted, StreamFailed)


# --------------------------------------------------------------------------- helpers


def decode(chunks: list[bytes]) -> list[StreamEvent]:
    dec = AnthropicStreamDecoder()
    events: list[StreamEvent] = []
    for chunk in chunks:
        events += dec.feed(chunk)
    events += dec.end_of_stream()
    return events


def random_chunks(body: bytes, seed: int, max_size: int = 23) -> list[bytes]:
    rng = random.Random(seed)
    chunks, pos = [], 0
    while pos < len(body):
        size = rng.randint(1, max_size)
        chunks.append(body[pos : pos + size])
        pos += size
    return chunks


def check_invariants(events: list[StreamEvent]) -> None:
    """What every decoded stream must satisfy, whatever the fixture."""
    terminals = [e for e in events if isinstance(e, TERMINAL)]
    assert len(terminals) == 1 and events[-1] is terminals[0]
    started: dict[int, BlockStarted] = {}
    deltas: dict[int, list[str]] = {}
    finished: set[int] = set()
    for e in events:
        if isinstance(e, BlockStarted):
            assert e.index not in started
            started[e.index] = e
        elif isinstance(e, (TextDelta, ThinkingDelta, ToolArgumentsDelta)):
            assert e.index in started and e.index not in finished
            deltas.setdefault(e.index, []).append(e.text if not isinstance(
                e, ToolArgumentsDelta) else e.delta)
        elif isinstance(e, (BlockCompleted, ToolCallTruncated)):
            assert e.index in started and e.index not in finished
            finished.add(e.index)
            streamed = "".join(deltas.get(e.index, []))
            if isinstance(e, ToolCallTruncated):
                assert e.partial_arguments == streamed
            elif isinstance(e.block, (TextBlock, ThinkingBlock)):
                assert e.block.text == streamed


def summarize(events: list[StreamEvent]) -> dict[str, Any]:
    blocks = [e.block for e in events if isinstance(e, BlockCompleted)]
    usage = [e.usage for e in events if isinstance(e, UsageReported)]
    done = [e for e in events if isinstance(e, MessageCompleted)]
    failed = [e for e in events if isinstance(e, StreamFailed)]
    return {
        "text": "".join(b.text for b in blocks if isinstance(b, TextBlock)),
        "partial_text": "".join(e.text for e in events if isinstance(e, TextDelta)),
        "thinking": [
            {"thinking": b.text, "signature": b.signature}
            for b in blocks if isinstance(b, ThinkingBlock)
        ],
        "redacted_thinking": [
            {"data": b.data} for b in blocks if isinstance(b, RedactedThinkingBlock)
        ],
        "content_types": [b.TYPE for b in blocks],
        "tool_calls": [
            {"id": b.id, "name": b.name, "input": b.arguments}
            for b in blocks if isinstance(b, ToolCallBlock)
        ],
        "truncated": [e for e in events if isinstance(e, ToolCallTruncated)],
        "started_ids": {e.call_id for e in events if isinstance(e, BlockStarted)},
        "stop_reason": done[0].stop_reason if done else None,
        "usage": usage[-1] if usage else None,
        "completed": bool(done),
        "error": failed[0].error if failed else None,
    }


def check_expect(events: list[StreamEvent], expect: dict[str, Any]) -> None:
    check_invariants(events)
    got = summarize(events)
    error = got["error"]
    if expect["complete"] and expect.get("classification") != "context_overflow":
        assert got["completed"], error
        assert expect["stop_reason"] == got["stop_reason"]
    else:
        assert not got["completed"]
        assert error is not None
    if "text" in expect:
        assert got["text"] == expect["text"]
    if "partial_text" in expect:
        assert got["partial_text"] == expect["partial_text"]
    if "thinking" in expect:
        assert got["thinking"] == expect["thinking"]
    if "redacted_thinking" in expect:
        assert got["redacted_thinking"] == expect["redacted_thinking"]
    if "content_types" in expect:
        assert got["content_types"] == expect["content_types"]
    if "tool_calls" in expect:
        assert got["tool_calls"] == expect["tool_calls"]
    for key in ("tool_calls_executable", "client_tool_calls"):
        if key in expect:
            assert got["tool_calls"] == expect[key]
    if "truncated_tool_call" in expect:
        want = expect["truncated_tool_call"]
        [cut] = got["truncated"]
        assert (cut.call_id, cut.name, cut.partial_arguments) == (
            want["id"], want["name"], want["partial_json"])
        # Never offered for execution, never completed.
        assert all(call["id"] != want["id"] for call in got["tool_calls"])
    else:
        assert got["truncated"] == []
    for server_call in expect.get("server_tool_use", []):
        assert server_call["id"] not in got["started_ids"]
    if "usage" in expect:
        u = expect["usage"]
        assert got["usage"] == TokenUsage(
            input=u["input_tokens"],
            output=u["output_tokens"],
            cache_write=u["cache_creation_input_tokens"],
            cache_read=u["cache_read_input_tokens"],
        )
        done = [e for e in events if isinstance(e, MessageCompleted)]
        assert done[0].usage == got["usage"]
    if "classification" in expect and expect["classification"] != "refusal":
        assert error is not None
        assert error.kind == KIND_OF_CLASSIFICATION[expect["classification"]]
    if expect.get("retryable") and error is not None:
        assert error.kind in RETRYABLE
    if "error" in expect:
        assert error is not None
        assert expect["error"]["type"] in error.message
        assert expect["error"]["message"] in error.message


# --------------------------------------------------------------------------- fixture replay


@pytest.mark.parametrize("name", STREAMS)
def test_fixture_whole_body(name: str) -> None:
    events = decode([(FIXTURES / name).read_bytes()])
    check_expect(events, MANIFEST[name]["expect"])


@pytest.mark.parametrize("name", STREAMS)
def test_fixture_random_chunks_give_identical_events(name: str) -> None:
    body = (FIXTURES / name).read_bytes()
    # The reads decide only where a block's text is cut (R-RUN-2): joined, it is the same.
    whole = coalesce_deltas(decode([body]))
    for seed in range(8):
        assert coalesce_deltas(decode(random_chunks(body, seed))) == whole, seed
    assert coalesce_deltas(decode([body[i : i + 1] for i in range(len(body))])) == whole


@pytest.mark.parametrize(
    "name",
    [
        "anthropic/thinking_then_tool_use.sse",
        "anthropic/max_tokens_truncated_tool_use.sse",
        "anthropic/truncated_no_message_stop.sse",
        "anthropic/text_only.sse",
    ],
)
def test_fixture_split_in_two_at_every_offset(name: str) -> None:
    body = (FIXTURES / name).read_bytes()
    whole = decode([body])
    check_expect(whole, MANIFEST[name]["expect"])
    for cut in range(len(body) + 1):
        assert coalesce_deltas(decode([body[:cut], body[cut:]])) == coalesce_deltas(whole), cut


def test_tool_call_completes_only_when_the_next_block_starts() -> None:
    body = (FIXTURES / "anthropic/thinking_then_tool_use.sse").read_bytes()
    marker = b'event: content_block_start\ndata: {"type":"content_block_start","index":3'
    head, tail = body.split(marker)
    dec = AnthropicStreamDecoder()
    first = dec.feed(head)
    # index 2's content_block_stop has been read, but a max_tokens verdict could still come.
    assert not any(isinstance(e, BlockCompleted) and e.index == 2 for e in first)
    second = dec.feed(marker + tail)
    assert isinstance(second[0], BlockCompleted) and second[0].index == 2
    assert isinstance(second[1], BlockStarted) and second[1].index == 3


def test_feed_after_terminal_is_ignored() -> None:
    body = (FIXTURES / "anthropic/text_only.sse").read_bytes()
    dec = AnthropicStreamDecoder()
    assert isinstance(dec.feed(body)[-1], MessageCompleted)
    assert dec.finished
    assert dec.feed(body) == []
    assert dec.end_of_stream() == []


# --------------------------------------------------------------------------- synthetic streams


def sse(*payloads: dict[str, Any]) -> bytes:
    return b"".join(
        f"event: {p['type']}\ndata: {json.dumps(p)}\n\n".encode() for p in payloads
    )


START = {"type": "message_start",
         "message": {"usage": {"input_tokens": 10, "cache_creation_input_tokens": 3,
                               "cache_read_input_tokens": 4, "output_tokens": 1}}}
STOP = {"type": "message_stop"}
PING = {"type": "ping"}


def tool_start(index: int, call_id: str = "t1", name: str = "f",
               input: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": call_id, "name": name,
                              "input": input or {}}}


def args(index: int, text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": text}}


def text_start(index: int) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index,
            "content_block": {"type": "text", "text": ""}}


def text(index: int, value: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index,
            "delta": {"type": "text_delta", "text": value}}


def stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


def delta(reason: str | None, **usage: int) -> dict[str, Any]:
    return {"type": "message_delta", "delta": {"stop_reason": reason},
            "usage": {"output_tokens": 5, **usage}}


def completed_calls(events: list[StreamEvent]) -> list[ToolCallBlock]:
    return [e.block for e in events
            if isinstance(e, BlockCompleted) and isinstance(e.block, ToolCallBlock)]


def test_ping_between_tool_stop_and_max_tokens_does_not_complete_the_call() -> None:
    events = decode([sse(START, tool_start(0), args(0, '{"a": 1}'), stop(0), PING,
                         {"type": "fixture_unknown"}, delta("max_tokens"), STOP)])
    check_invariants(events)
    assert completed_calls(events) == []
    [cut] = [e for e in events if isinstance(e, ToolCallTruncated)]
    assert cut.partial_arguments == '{"a": 1}'
    assert isinstance(events[-1], MessageCompleted) and events[-1].stop_reason == "max_tokens"


def test_the_message_id_and_model_are_the_response_id_and_model() -> None:
    """R-OBS-2: the id and model of ``message_start``'s message end the stream as its
    ``response_id`` and ``response_model`` (exported as gen_ai.response.id and .model); a
    message without them has None."""
    fixture = (FIXTURES / "anthropic" / "refusal.sse").read_bytes()
    end = decode([fixture])[-1]
    assert isinstance(end, MessageCompleted)
    assert end.response_id == "msg_01FixtureRefusal000000001"
    assert end.response_model == "claude-sonnet-4-5-20250929"
    end = decode([sse(START, text_start(0), text(0, "hi"), stop(0), delta("end_turn"), STOP)])[-1]
    assert isinstance(end, MessageCompleted)
    assert end.response_id is None and end.response_model is None


def test_only_the_last_tool_call_is_truncated_at_max_tokens() -> None:
    events = decode([sse(START, tool_start(0, "a"), args(0, "{}"), stop(0),
                         tool_start(1, "b"), args(1, '{"x":'), delta("max_tokens"), STOP)])
    check_invariants(events)
    assert [c.id for c in completed_calls(events)] == ["a"]
    assert [e.call_id for e in events if isinstance(e, ToolCallTruncated)] == ["b"]


def test_tool_call_completes_at_message_delta_tool_use() -> None:
    events = decode([sse(START, tool_start(0), args(0, '{"q": "x"}'), stop(0),
                         delta("tool_use"), STOP)])
    check_invariants(events)
    assert completed_calls(events) == [ToolCallBlock(id="t1", name="f", arguments={"q": "x"})]


def test_message_delta_without_stop_reason_keeps_the_call_pending() -> None:
    dec = AnthropicStreamDecoder()
    events = dec.feed(sse(START, tool_start(0), args(0, "{}"), stop(0), delta(None)))
    assert completed_calls(events) == []
    events = dec.feed(sse(delta("max_tokens"), STOP))
    assert completed_calls(events) == []
    assert any(isinstance(e, ToolCallTruncated) for e in events)


def test_text_block_left_open_at_max_tokens_is_completed() -> None:
    events = decode([sse(START, text_start(0), text(0, "partial"), delta("max_tokens"), STOP)])
    check_invariants(events)
    assert [e.block for e in events if isinstance(e, BlockCompleted)] == [
        TextBlock(text="partial")]


@pytest.mark.parametrize(
    ("raw", "arguments", "invalid"),
    [
        ("", {}, None),
        ("  ", {}, None),
        ('{"k": [1, 2]}', {"k": [1, 2]}, None),
        ("[1, 2]", {}, "[1, 2]"),
        ('"text"', {}, '"text"'),
        ('{"k": ', {}, '{"k": '),
    ],
)
def test_tool_arguments_parsing(raw: str, arguments: dict[str, Any], invalid: str | None) -> None:
    parts = [args(0, raw)] if raw else []
    events = decode([sse(START, tool_start(0), *parts, stop(0), delta("tool_use"), STOP)])
    [call] = completed_calls(events)
    assert call.arguments == arguments
    assert call.invalid_arguments == invalid


def test_input_given_whole_in_block_start_is_used() -> None:
    events = decode([sse(START, tool_start(0, input={"path": "a"}), stop(0),
                         delta("tool_use"), STOP)])
    assert completed_calls(events)[0].arguments == {"path": "a"}


def test_usage_is_replaced_not_added() -> None:
    events = decode([sse(START, text_start(0), text(0, "x"), stop(0),
                         delta(None, output_tokens=7),
                         delta("end_turn", output_tokens=9, input_tokens=12,
                               cache_read_input_tokens=40), STOP)])
    reports = [e.usage for e in events if isinstance(e, UsageReported)]
    assert reports == [
        TokenUsage(input=10, output=1, cache_read=4, cache_write=3),
        TokenUsage(input=10, output=7, cache_read=4, cache_write=3),
        TokenUsage(input=12, output=9, cache_read=40, cache_write=3),
    ]
    assert isinstance(events[-1], MessageCompleted)
    assert events[-1].usage == reports[-1]
    assert events[-1].usage.total == 12 + 9 + 40 + 3


def test_unchanged_usage_is_not_reported_again() -> None:
    events = decode([sse(START, delta(None, output_tokens=1), delta("end_turn", output_tokens=1),
                         STOP)])
    assert sum(isinstance(e, UsageReported) for e in events) == 1


@pytest.mark.parametrize(
    ("error_type", "message", "kind"),
    [
        ("overloaded_error", "Overloaded", "timeout"),
        ("api_error", "Internal server error", "timeout"),
        ("rate_limit_error", "slow down", "timeout"),
        ("timeout_error", "took too long", "timeout"),
        ("authentication_error", "invalid x-api-key", "auth"),
        ("permission_error", "Permission denied", "auth"),
        ("invalid_request_error", "prompt is too long: 201000 tokens > 200000 maximum",
         "context_overflow"),
        ("invalid_request_error", "max_tokens: Field required", "failed"),
        ("billing_error", "no credit", "failed"),
        ("some_new_error", "who knows", "failed"),
    ],
)
def test_midstream_error_classification(error_type: str, message: str, kind: str) -> None:
    events = decode([sse(START, text_start(0), text(0, "a"),
                         {"type": "error", "error": {"type": error_type, "message": message}})])
    check_invariants(events)
    assert isinstance(events[-1], StreamFailed)
    assert events[-1].error.kind == kind
    assert error_type in events[-1].error.message and message in events[-1].error.message


def test_invalid_json_is_malformed_and_ends_the_stream() -> None:
    dec = AnthropicStreamDecoder()
    events = dec.feed(sse(START) + b"event: content_block_start\ndata: {not json}\n\n"
                      + sse(text_start(0)))
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"
    assert not any(isinstance(e, BlockStarted) for e in events)
    assert dec.feed(sse(STOP)) == [] and dec.end_of_stream() == []


def test_unexpected_shape_is_malformed() -> None:
    events = decode([sse(START, {"type": "content_block_delta", "index": 5,
                                 "delta": {"type": "text_delta", "text": "x"}})])
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"


def test_empty_body_is_malformed_naming_message_start() -> None:
    [event] = decode([b""])
    assert isinstance(event, StreamFailed) and event.error.kind == "malformed"
    assert "message_start" in event.error.message


def test_end_without_message_stop_names_what_is_missing() -> None:
    events = decode([sse(START, text_start(0), text(0, "hi"), stop(0), delta("end_turn"))])
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"
    assert "message_stop" in events[-1].error.message
    events = decode([sse(START, text_start(0)) + b"event: content_block_delta\ndata: {\"ty"])
    assert "cut off" in events[-1].error.message


def test_message_stop_without_message_delta_is_malformed() -> None:
    events = decode([sse(START, text_start(0), text(0, "hi"), stop(0), STOP)])
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"


def test_context_window_exceeded_stop_reason_fails_with_usage_first() -> None:
    events = decode([sse(START, text_start(0), text(0, "x"), stop(0),
                         delta("model_context_window_exceeded"), STOP)])
    assert isinstance(events[-2], UsageReported) and events[-2].usage.output == 5
    assert isinstance(events[-1], StreamFailed)
    assert events[-1].error.kind == "context_overflow"


# --------------------------------------------------------------------------- classify_error


@pytest.mark.parametrize("name", ERRORS)
def test_error_fixtures(name: str) -> None:
    entry = MANIFEST[name]
    body = (FIXTURES / name).read_bytes()
    error = classify_error(entry["status"], body, entry["headers"])
    assert error.kind == KIND_OF_CLASSIFICATION[entry["expect"]["classification"]]
    assert error.status_code == entry["status"]
    assert (error.kind in RETRYABLE) or not entry["expect"]["retryable"]
    if error.kind != "context_overflow":  # compacted and rerun instead (R-COMPACT-9)
        retried = should_retry(error.kind, 1, permanent=error.permanent)
        assert retried == entry["expect"]["retryable"]
    inner = json.loads(body)["error"]
    assert inner["message"] in error.message and inner["type"] in error.message
    # The same body as text gives the same answer.
    assert classify_error(entry["status"], body.decode(), entry["headers"]) == error


def test_rate_limit_retry_after_seconds() -> None:
    entry = MANIFEST["anthropic/errors/429_rate_limit_error.json"]
    body = (FIXTURES / "anthropic/errors/429_rate_limit_error.json").read_bytes()
    error = classify_error(429, body, entry["headers"])
    assert error.retry_after_s == 7.0
    # The rate-limit message says "reduce the prompt length": still not an overflow.
    assert error.kind == "timeout"


def test_overflow_wording_on_other_statuses_is_not_an_overflow() -> None:
    body = b'{"type":"error","error":{"type":"rate_limit_error","message":"prompt is too long'\
           b' for your tier"}}'
    assert classify_error(429, body, {}).kind == "timeout"
    assert classify_error(529, body, {}).kind == "timeout"


def test_retry_after_variants() -> None:
    assert classify_error(429, b"", {"Retry-After-Ms": "1500", "retry-after": "9"}
                          ).retry_after_s == 1.5
    assert classify_error(503, b"", {"retry-after": "2.5"}).retry_after_s == 2.5
    now = 1_767_225_600.0  # 2026-01-01T00:00:00Z
    dated = classify_error(429, b"", {"retry-after": "Thu, 01 Jan 2026 00:00:30 GMT"}, now=now)
    assert dated.retry_after_s == pytest.approx(30.0)
    assert classify_error(429, b"", {"retry-after": "soon"}).retry_after_s is None
    assert classify_error(429, b"", {}).retry_after_s is None


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (408, b"", "timeout"),
        (502, b"<html><body>Bad gateway</body></html>", "timeout"),
        (504, b'{"type":"error","error":{"type":"timeout_error","message":"Timeout"}}',
         "timeout"),
        (529, b"\xff\xfe not utf8", "timeout"),
        (418, b"[1, 2, 3]", "failed"),
        (409, b'{"error": "conflict"}', "failed"),
        (400, b'{"message": "prompt is too long: 5 tokens > 4 maximum"}', "context_overflow"),
        (413, b"Request Entity Too Large", "failed"),
        (401, b"", "auth"),
    ],
)
def test_classify_error_never_raises(status: int, body: bytes, kind: str) -> None:
    error = classify_error(status, body, {})
    assert error.kind == kind
    assert error.message


def test_classify_error_messages() -> None:
    assert "Bad gateway" in classify_error(502, b"<html>Bad gateway</html>", {}).message
    assert classify_error(500, b"", {}).message == "server error (HTTP 500)"
    big = classify_error(413, b'{"error":{"type":"request_too_large","message":"Request exceeds'
                              b' the maximum size"}}', {})
    assert "too large" in big.message.lower() and "413" in big.message


# --------------------------------------------------------------------------- requests

TOOLS = (
    ToolSchema(name="read_file", description="Read a file.",
               input_schema={"type": "object", "properties": {"path": {"type": "string"}}}),
    ToolSchema(name="run_shell", description="Run a command.",
               input_schema={"type": "object", "properties": {"command": {"type": "string"}}}),
)


def request(messages: tuple[Message, ...] | list[Message], *, thinking: str | None = None,
            max_tokens: int = 8192, vision: bool = True) -> ModelRequest:
    return ModelRequest(model="claude-sonnet-4-5", system="You are helpful.", tools=TOOLS,
                        messages=tuple(messages), max_tokens=max_tokens,
                        thinking_level=thinking, supports_vision=vision)


def user(*parts: Any) -> UserMessage:
    return UserMessage(content=tuple(TextBlock(text=p) if isinstance(p, str) else p
                                     for p in parts))


def assistant(*blocks: Any) -> AssistantMessage:
    return AssistantMessage(content=tuple(TextBlock(text=b) if isinstance(b, str) else b
                                          for b in blocks))


def think(text: str, signature: str | None = "sig") -> ThinkingBlock:
    return ThinkingBlock(text=text, signature=signature)


def call(call_id: str, name: str = "read_file", **arguments: Any) -> ToolCallBlock:
    return ToolCallBlock(id=call_id, name=name, arguments=arguments)


def result(call_id: str, text: str = "ok", *, is_error: bool = False) -> ToolResult:
    return ToolResult(call_id=call_id, tool="read_file", status="error" if is_error else "ok",
                      is_error=is_error, content=(TextBlock(text=text),))


def count_cache_control(value: Any) -> int:
    return json.dumps(value).count('"cache_control"')


def without_cache_control(message: dict[str, Any]) -> dict[str, Any]:
    return {**message, "content": [{k: v for k, v in b.items() if k != "cache_control"}
                                   for b in message["content"]]}


def test_body_shape_and_cache_breakpoints() -> None:
    body = build_request(request([user("hi")]))
    assert list(body) == ["model", "max_tokens", "stream", "system", "tools", "messages"]
    assert body["stream"] is True and body["max_tokens"] == 8192
    assert body["system"] == [{"type": "text", "text": "You are helpful.",
                               "cache_control": {"type": "ephemeral"}}]
    assert body["tools"][0] == {"name": "read_file", "description": "Read a file.",
                                "input_schema": TOOLS[0].input_schema}
    assert body["tools"][1]["cache_control"] == {"type": "ephemeral"}
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]
    assert count_cache_control(body) == 3


def test_no_system_no_tools() -> None:
    req = ModelRequest(model="m", system=None, tools=(), messages=(user("x"),))
    assert list(build_request(req)) == ["model", "max_tokens", "stream", "messages"]


@pytest.mark.parametrize("level", ["low", "medium", "high"])
def test_thinking_levels(level: str) -> None:
    budget = THINKING_BUDGETS[level]
    body = build_request(request([user("x")], thinking=level, max_tokens=4096))
    assert body["thinking"] == {"type": "enabled", "budget_tokens": budget}
    assert body["max_tokens"] > budget
    # Raised by the budget only when the budget would otherwise not fit.
    assert body["max_tokens"] == (4096 if budget < 4096 else 4096 + budget)
    big = build_request(request([user("x")], thinking=level, max_tokens=64000))
    assert big["max_tokens"] == 64000


def test_unknown_thinking_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="thinking_level"):
        build_request(request([user("x")], thinking="extreme"))


def test_tool_results_come_first_in_order_and_paired() -> None:
    msgs = [
        user("do it"),
        assistant("sure", call("a"), call("b")),
        user("[user_steering]stop soon[/user_steering]", result("a", "A"),
             result("b", "B", is_error=True)),
    ]
    content = build_request(request(msgs))["messages"][2]["content"]
    assert [b["type"] for b in content] == ["tool_result", "tool_result", "text"]
    assert content[0] == {"type": "tool_result", "tool_use_id": "a",
                          "content": [{"type": "text", "text": "A"}], "is_error": False}
    assert content[1]["tool_use_id"] == "b" and content[1]["is_error"] is True
    tool_use = build_request(request(msgs))["messages"][1]["content"][1]
    assert tool_use == {"type": "tool_use", "id": "a", "name": "read_file", "input": {}}


def test_consecutive_messages_of_one_role_are_merged() -> None:
    msgs = [
        user("first"),
        user("second"),
        assistant("one"),
        assistant("two"),
        user("steer"),
        user(result("x")),
    ]
    out = build_request(request(msgs))["messages"]
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert [b["text"] for b in out[0]["content"]] == ["first", "second"]
    assert [b["text"] for b in out[1]["content"]] == ["one", "two"]
    assert [b["type"] for b in out[2]["content"]] == ["tool_result", "text"]


def test_empty_text_is_dropped_and_empty_messages_get_placeholder() -> None:
    out = build_request(request([user("", "q"), assistant("", think("t", None)),
                                 user("ok")]))["messages"]
    assert out[0]["content"] == [{"type": "text", "text": "q"}]
    assert out[1]["content"] == [{"type": "text", "text": NO_CONTENT}]
    empty = ToolResult(call_id="c", tool="t", status="ok", is_error=False,
                       content=(TextBlock(text=""),))
    tr = build_request(request([user(empty)]))["messages"][0]["content"][0]
    assert tr["content"][0]["text"] == NO_OUTPUT


def test_a_text_split_to_fit_records_is_sent_back_as_the_model_wrote_it() -> None:
    """R-TRACE, R-SEC-9, R-CLUSTER-1: the model's text split at line breaks to fit a
    cluster's records (trace.fit_model_block) is sent back as one text block, its pieces
    joined by the line breaks left out between them (before: one block a piece, which
    Anthropic joins with nothing between, the model's history without those breaks); a
    text after a tool call stays a block of its own."""
    text = "\n".join(f"line {i}: " + "y" * 90 for i in range(40))
    pieces = fit_model_block(TextBlock(text=text), 1000)
    assert isinstance(pieces, tuple) and len(pieces) >= 3
    msgs = [user("go"), assistant(*pieces, call("a"), "after"), user(result("a"))]
    content = build_request(request(msgs))["messages"][1]["content"]
    assert content == [
        {"type": "text", "text": text},
        {"type": "tool_use", "id": "a", "name": "read_file", "input": {}},
        {"type": "text", "text": "after"},
    ]


def test_image_fallback_and_loader() -> None:
    img = ImageBlock(path="shots/a.png", media_type="image/png")
    msgs = [user("look", img)]
    fallback = {"type": "text", "text": "[attached image: shots/a.png]"}
    assert build_request(request(msgs))["messages"][0]["content"][1] == {
        **fallback, "cache_control": {"type": "ephemeral"}}
    assert build_request(request(msgs), image_loader=lambda _: None
                         )["messages"][0]["content"][1]["text"] == fallback["text"]
    loaded = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "AAAA"}}
    seen: list[ImageBlock] = []

    def loader(block: ImageBlock) -> dict[str, Any]:
        seen.append(block)
        return loaded

    content = build_request(request(msgs), image_loader=loader)["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "look"}
    assert {k: v for k, v in content[1].items() if k != "cache_control"} == loaded
    assert seen == [img]
    assert "cache_control" not in loaded  # the loader's dict was not mutated
    no_vision = build_request(request(msgs, vision=False), image_loader=loader)
    assert no_vision["messages"][0]["content"][1]["text"] == fallback["text"]


def test_image_in_tool_result() -> None:
    tr = ToolResult(call_id="c", tool="shot", status="ok", is_error=False,
                    content=(TextBlock(text="took it"), ImageBlock(path="s.png")))
    out = build_request(request([user(tr)]))["messages"][0]["content"][0]
    assert out["content"] == [{"type": "text", "text": "took it"},
                              {"type": "text", "text": "[attached image: s.png]"}]


def history_with_thinking() -> list[Message]:
    return [
        user("task one"),
        assistant(think("plan 1", "s1"), call("c1")),
        user(result("c1")),
        assistant(think("wrap up", "s2"), "done one"),
        user("task two"),
        assistant(think("plan 2", "s3"), RedactedThinkingBlock(data="opaque"), "checking",
                  call("c2")),
        user(result("c2")),
    ]


def block_types(message: dict[str, Any]) -> list[str]:
    return [b["type"] for b in message["content"]]


def test_thinking_sent_only_for_the_tool_chain_being_answered() -> None:
    out = build_request(request(history_with_thinking(), thinking="low"))["messages"]
    assert block_types(out[1]) == ["tool_use"]  # earlier task: dropped
    assert block_types(out[3]) == ["text"]  # a final answer: dropped
    assert block_types(out[5]) == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert out[5]["content"][0] == {"type": "thinking", "thinking": "plan 2", "signature": "s3"}
    assert out[5]["content"][1] == {"type": "redacted_thinking", "data": "opaque"}


def test_thinking_dropped_when_not_answered_by_tool_results() -> None:
    msgs = [*history_with_thinking()[:6], user("never mind, something else")]
    out = build_request(request(msgs, thinking="low"))["messages"]
    assert all(b["type"] not in ("thinking", "redacted_thinking")
               for m in out for b in m["content"])


def test_thinking_dropped_when_thinking_disabled() -> None:
    out = build_request(request(history_with_thinking()))["messages"]
    assert block_types(out[5]) == ["text", "tool_use"]


def test_unsigned_thinking_is_never_sent() -> None:
    msgs = [user("x"), assistant(think("no sig", None), call("c")), user(result("c"))]
    out = build_request(request(msgs, thinking="high"))["messages"]
    assert block_types(out[1]) == ["tool_use"]


def prefix_parts(body: dict[str, Any]) -> tuple[str, str]:
    return json.dumps(body["system"]), json.dumps(body["tools"])


@pytest.mark.parametrize("thinking", [None, "medium"])
def test_prefix_is_byte_identical_between_turns(thinking: str | None) -> None:
    msgs: list[Message] = [user("task"), assistant(think("p1", "s1"), call("c1")),
                           user(result("c1"))]
    encoder = RequestEncoder()
    turn_n = encoder.build(request(msgs, thinking=thinking))
    snapshot = json.dumps(turn_n)  # what went on the wire at turn N
    msgs += [assistant(think("p2", "s2"), "text", call("c2")), user(result("c2"))]
    turn_n1 = encoder.build(request(msgs, thinking=thinking))
    fresh = build_request(request(msgs, thinking=thinking))
    assert fresh == turn_n1  # the cache never changes the answer
    assert json.dumps(turn_n) == snapshot  # building turn N+1 did not touch turn N's body
    assert prefix_parts(turn_n) == prefix_parts(turn_n1)
    k = len(turn_n["messages"])
    assert json.dumps(turn_n["messages"][: k - 1]) == json.dumps(turn_n1["messages"][: k - 1])
    # The former last message differs only by the moving breakpoint.
    assert "cache_control" in json.dumps(turn_n["messages"][k - 1])
    assert "cache_control" not in json.dumps(turn_n1["messages"][k - 1])
    assert without_cache_control(turn_n["messages"][k - 1]) == turn_n1["messages"][k - 1]
    assert count_cache_control(turn_n1) == 3
    last = turn_n1["messages"][-1]["content"][-1]
    assert last["cache_control"] == {"type": "ephemeral"}
    if thinking:
        # Within one tool chain every answered assistant message keeps its thinking.
        assert block_types(turn_n1["messages"][1])[0] == "thinking"
        assert block_types(turn_n1["messages"][3])[0] == "thinking"


def test_encoder_reuses_cached_encodings_by_identity() -> None:
    msgs: list[Message] = [user("a"), assistant("b", call("c")), user(result("c"))]
    encoder = RequestEncoder()
    first = encoder.build(request(msgs))
    msgs += [assistant("d"), user("e")]
    second = encoder.build(request(msgs))
    # Same message object at the same position: the very same block dicts are reused.
    assert first["messages"][1]["content"][0] is second["messages"][1]["content"][0]
    assert first["tools"] is second["tools"]


def test_encoder_reencodes_a_changed_history() -> None:
    encoder = RequestEncoder()
    encoder.build(request([user("old"), assistant("old answer"), user("q")]))
    replaced = [user("[context_summary]s[/context_summary]"), assistant("new"), user("q")]
    assert encoder.build(request(replaced)) == build_request(request(replaced))
    shorter = replaced[:1]
    assert encoder.build(request(shorter)) == build_request(request(shorter))


def test_breakpoint_skips_trailing_thinking_block() -> None:
    msgs = [user("x"), assistant("answer", call("c")), user(result("c")),
            assistant(think("t", "s"))]
    out = build_request(request(msgs, thinking="low"))["messages"]
    # The final assistant message is not answered by tool results: its thinking is dropped.
    assert out[-1]["content"] == [{"type": "text", "text": NO_CONTENT,
                                   "cache_control": {"type": "ephemeral"}}]
