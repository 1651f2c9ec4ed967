"""OpenAI Chat Completions codec: fixture replay, stream edge cases, errors, request bodies."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from greenroom.protocols.content import ImageBlock, TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.context import (
    AssistantMessage,
    Message,
    ModelRequest,
    ToolResult,
    ToolSchema,
    UserMessage,
)
from greenroom.protocols.openai_codec import (
    OpenAIStreamDecoder,
    RequestEncoder,
    build_request,
    classify_error,
)
from greenroom.protocols.retry import should_retry
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

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "manifest.json").read_text(encoding="utf-8"))
SSE_FIXTURES = sorted(k for k in MANIFEST if k.startswith("openai/") and k.endswith(".sse"))
ERROR_FIXTURES = sorted(k for k in MANIFEST if k.startswith("openai/") and k.endswith(".json"))


def test_every_openai_fixture_file_is_in_the_manifest() -> None:
    on_disk = {
        p.relative_to(FIXTURES).as_posix()
        for p in (FIXTURES / "openai").rglob("*")
        if p.suffix in (".sse", ".json")
    }
    assert on_disk == set(SSE_FIXTURES) | set(ERROR_FIXTURES)
    assert len(SSE_FIXTURES) >= 11 and len(ERROR_FIXTURES) >= 10


# --- replay helpers ---------------------------------------------------------------------------


def replay(pieces: list[bytes]) -> list[StreamEvent]:
    decoder = OpenAIStreamDecoder()
    events: list[StreamEvent] = []
    for piece in pieces:
        events.extend(decoder.feed(piece))
    events.extend(decoder.end_of_stream())
    check_invariants(events)
    assert decoder.feed(b"data: [DONE]\n\n") == []
    assert decoder.end_of_stream() == []
    return events


def check_invariants(events: list[StreamEvent]) -> None:
    """The contract of protocols/stream.py, checked on every replay."""
    terminal = [e for e in events if isinstance(e, MessageCompleted | StreamFailed)]
    assert len(terminal) == 1 and events[-1] is terminal[0]
    started: dict[int, BlockStarted] = {}
    streamed: dict[int, list[str]] = {}
    finished: set[int] = set()
    for event in events:
        if isinstance(event, BlockStarted):
            assert event.index not in started
            started[event.index] = event
            streamed[event.index] = []
        elif isinstance(event, TextDelta | ThinkingDelta | ToolArgumentsDelta):
            assert event.index in started and event.index not in finished
            kind = {TextDelta: "text", ThinkingDelta: "thinking"}.get(type(event), "tool_call")
            assert started[event.index].kind == kind
            streamed[event.index].append(
                event.delta if isinstance(event, ToolArgumentsDelta) else event.text
            )
        elif isinstance(event, BlockCompleted | ToolCallTruncated):
            assert event.index in started and event.index not in finished
            finished.add(event.index)
            block = event.block if isinstance(event, BlockCompleted) else None
            if isinstance(block, TextBlock | ThinkingBlock):
                assert block.text == "".join(streamed[event.index])
            elif isinstance(block, ToolCallBlock):
                assert started[event.index].call_id == block.id
                assert started[event.index].name == block.name
            elif isinstance(event, ToolCallTruncated):
                assert event.partial_arguments == "".join(streamed[event.index])
    assert sorted(started) == list(range(len(started)))
    if isinstance(events[-1], MessageCompleted):
        assert finished == set(started), "a completed message leaves no block open"


def summarise(events: list[StreamEvent]) -> dict[str, Any]:
    blocks = [e.block for e in events if isinstance(e, BlockCompleted)]
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    thinking = [b.text for b in blocks if isinstance(b, ThinkingBlock)]
    usage = [e.usage for e in events if isinstance(e, UsageReported)]
    last = events[-1]
    return {
        "text": "".join(texts) if texts else None,
        "reasoning": "".join(thinking) if thinking else None,
        "partial_text": "".join(e.text for e in events if isinstance(e, TextDelta)),
        "tool_calls": [
            {"id": b.id, "name": b.name, "arguments": b.arguments, "invalid": b.invalid_arguments}
            for b in blocks
            if isinstance(b, ToolCallBlock)
        ],
        "truncated": [e for e in events if isinstance(e, ToolCallTruncated)],
        "usage": usage[-1] if usage else None,
        "stop_reason": last.stop_reason if isinstance(last, MessageCompleted) else None,
        "error": last.error if isinstance(last, StreamFailed) else None,
    }


STOP_REASON = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}
FAILURE_KIND = {"server_error": "timeout", "incomplete_stream": "malformed"}


def check_expectations(path: str, events: list[StreamEvent]) -> None:
    expect: dict[str, Any] = MANIFEST[path]["expect"]
    unknown = set(expect) - {
        "text",
        "reasoning",
        "partial_text",
        "tool_calls",
        "tool_calls_executable",
        "truncated_tool_call",
        "finish_reason",
        "usage",
        "complete",
        "classification",
        "retryable",
        "error",
        "note",
    }
    assert not unknown, f"manifest keys this test does not check: {unknown}"
    got = summarise(events)
    assert expect["complete"] == (got["stop_reason"] is not None)
    assert expect["complete"] == (got["error"] is None)
    if "text" in expect:
        assert got["text"] == expect["text"]
    if "reasoning" in expect:
        assert got["reasoning"] == expect["reasoning"]
        assert expect["reasoning"] not in (got["text"] or "")
    if "partial_text" in expect:
        assert got["partial_text"] == expect["partial_text"]
    if "tool_calls" in expect:
        assert got["tool_calls"] == [{**c, "invalid": None} for c in expect["tool_calls"]]
    if "tool_calls_executable" in expect:
        executable = [c for c in got["tool_calls"] if c["invalid"] is None]
        assert executable == expect["tool_calls_executable"]
    if "truncated_tool_call" in expect:
        want = expect["truncated_tool_call"]
        [truncated] = got["truncated"]
        assert (truncated.call_id, truncated.name, truncated.partial_arguments) == (
            want["id"],
            want["name"],
            want["arguments_raw"],
        )
        assert got["tool_calls"] == []
    else:
        assert got["truncated"] == []
    if "finish_reason" in expect:
        want_stop = STOP_REASON[expect["finish_reason"]]
        if got["tool_calls"]:
            want_stop = "tool_use"  # finish_reason "stop" after tool calls (quirk fixture)
        assert got["stop_reason"] == want_stop
    if "usage" in expect:
        usage = got["usage"]
        assert usage is not None
        assert usage.input + usage.cache_read == expect["usage"]["prompt_tokens"]
        assert usage.output == expect["usage"]["completion_tokens"]
        last = events[-1]
        assert isinstance(last, MessageCompleted) and last.usage == usage
    classification = expect.get("classification")
    if classification == "content_filter":
        assert got["stop_reason"] == "refusal"
    elif classification is not None:
        assert got["error"] is not None and got["error"].kind == FAILURE_KIND[classification]
    if "retryable" in expect and got["error"] is not None:
        assert should_retry(got["error"].kind, 1) == expect["retryable"]


def fixture_bytes(path: str) -> bytes:
    return (FIXTURES / path).read_bytes()


# --- fixture replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", SSE_FIXTURES)
def test_fixture_whole(path: str) -> None:
    check_expectations(path, replay([fixture_bytes(path)]))


@pytest.mark.parametrize("path", SSE_FIXTURES)
def test_fixture_rechunked_randomly_gives_identical_events(path: str) -> None:
    body = fixture_bytes(path)
    # The reads decide only where a block's text is cut (R-RUN-2): joined, it is the same.
    expected = coalesce_deltas(replay([body]))
    rng = random.Random(f"openai-codec:{path}")
    for _ in range(20):
        pieces, pos = [], 0
        while pos < len(body):
            size = rng.randint(1, 24)
            pieces.append(body[pos : pos + size])
            pos += size
        assert coalesce_deltas(replay(pieces)) == expected
    assert coalesce_deltas(replay([body[i : i + 1] for i in range(len(body))])) == expected


@pytest.mark.parametrize(
    "path", ["openai/text_only.sse", "openai/parallel_tool_calls_interleaved.sse"]
)
def test_fixture_every_two_piece_split(path: str) -> None:
    body = fixture_bytes(path)
    expected = replay([body])
    check_expectations(path, expected)
    for cut in range(1, len(body)):
        assert coalesce_deltas(replay([body[:cut], body[cut:]])) == coalesce_deltas(expected), cut


def test_text_only_events_exactly() -> None:
    body = fixture_bytes("openai/text_only.sse")
    events = replay([body])
    assert events[0] == BlockStarted(index=0, kind="text")
    # Read at once, the three deltas are one (R-RUN-2); read chunk by chunk, three.
    assert [e.text for e in events if isinstance(e, TextDelta)] == [
        "Hello! Grüße 👋 How can I help?"
    ]
    chunks = [line + b"\n\n" for line in body.split(b"\n\n") if line]
    assert [e.text for e in replay(chunks) if isinstance(e, TextDelta)] == [
        "Hello",
        "! Grüße 👋",
        " How can I help?",
    ]
    tail = events[-3:]
    assert tail == [
        BlockCompleted(index=0, block=TextBlock(text="Hello! Grüße 👋 How can I help?")),
        UsageReported(usage=TokenUsage(input=19, output=10)),
        MessageCompleted(
            stop_reason="end_turn",
            usage=TokenUsage(input=19, output=10),
            response_id="chatcmpl-FixtureTextOnly0000000000001",  # the chunks' id (R-OBS-2)
            response_model="gpt-4o-2024-08-06",  # the chunks' model (R-OBS-2)
        ),
    ]


def test_interleaved_tool_calls_complete_in_index_order_with_their_own_blocks() -> None:
    events = replay([fixture_bytes("openai/parallel_tool_calls_interleaved.sse")])
    starts = [e for e in events if isinstance(e, BlockStarted)]
    assert [(s.index, s.call_id) for s in starts] == [
        (0, "call_FixtureWeather00000000001"),
        (1, "call_FixtureStock0000000000002"),
    ]
    completed = [e for e in events if isinstance(e, BlockCompleted)]
    assert [c.index for c in completed] == [0, 1]
    # Both calls complete only at finish_reason, after every argument fragment.
    last_delta = max(i for i, e in enumerate(events) if isinstance(e, ToolArgumentsDelta))
    assert all(events.index(c) > last_delta for c in completed)


def test_reasoning_is_its_own_block_before_the_text() -> None:
    events = replay([fixture_bytes("openai/local/vllm_reasoning_content.sse")])
    starts = [e for e in events if isinstance(e, BlockStarted)]
    assert [(s.index, s.kind) for s in starts] == [(0, "thinking"), (1, "text")]
    completed = [e for e in events if isinstance(e, BlockCompleted)]
    # The thinking block completes as soon as the text opens (stream order, R-RUN-2).
    assert events.index(completed[0]) < events.index(starts[1])
    assert completed[0].block == ThinkingBlock(text="9.11 vs 9.8: compare tenths, 1 < 8.")


def test_truncated_stream_fails_without_completing_the_tool_call() -> None:
    events = replay([fixture_bytes("openai/truncated_no_done.sse")])
    assert not any(isinstance(e, BlockCompleted | ToolCallTruncated) for e in events)
    last = events[-1]
    assert isinstance(last, StreamFailed) and last.error.kind == "malformed"


# --- stream edge cases ------------------------------------------------------------------------


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
) -> bytes:
    choices = (
        []
        if delta is None and finish is None
        else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    body = {"object": "chat.completion.chunk", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def call(
    index: int, args: str, call_id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    fragment: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if call_id is not None:
        fragment["id"] = call_id
        fragment["type"] = "function"
        fragment["function"]["name"] = name
    return {"tool_calls": [fragment]}


def test_text_interrupted_by_tool_call_resumes_in_a_new_block() -> None:
    events = replay(
        [
            chunk({"content": "Let me look."}),
            chunk(call(0, '{"path":', "c1", "read_file")),
            chunk({"content": " (working)"}),
            chunk(call(0, '"a.txt"}')),
            chunk(finish="tool_calls"),
            DONE,
        ]
    )
    starts = [(e.index, e.kind) for e in events if isinstance(e, BlockStarted)]
    assert starts == [(0, "text"), (1, "tool_call"), (2, "text")]
    completed = [e for e in events if isinstance(e, BlockCompleted)]
    assert [c.index for c in completed] == [0, 1, 2]
    assert completed[1].block == ToolCallBlock(
        id="c1", name="read_file", arguments={"path": "a.txt"}
    )
    assert completed[2].block == TextBlock(text=" (working)")
    assert events[-1] == MessageCompleted(stop_reason="tool_use", usage=TokenUsage())


def test_tool_calls_complete_in_wire_index_order_even_when_opened_out_of_order() -> None:
    events = replay(
        [
            chunk(call(1, "{}", "second", "b")),
            chunk(call(0, "{}", "first", "a")),
            chunk(finish="tool_calls"),
            DONE,
        ]
    )
    ids = [
        e.block.id
        for e in events
        if isinstance(e, BlockCompleted) and isinstance(e.block, ToolCallBlock)
    ]
    assert ids == ["first", "second"]


def test_argument_text_edge_cases() -> None:
    events = replay(
        [
            chunk(call(0, "", "empty", "now")),
            chunk(call(1, "[1, 2]", "array", "x")),
            chunk(call(2, '{"a": tru', "broken", "y")),
            chunk(call(3, '{"whole": "call in one chunk"}', "whole", "z")),
            chunk(finish="tool_calls"),
            DONE,
        ]
    )
    calls = [e.block for e in events if isinstance(e, BlockCompleted)]
    assert calls == [
        ToolCallBlock(id="empty", name="now", arguments={}),
        ToolCallBlock(id="array", name="x", arguments={}, invalid_arguments="[1, 2]"),
        ToolCallBlock(id="broken", name="y", arguments={}, invalid_arguments='{"a": tru'),
        ToolCallBlock(id="whole", name="z", arguments={"whole": "call in one chunk"}),
    ]


def test_length_truncates_every_open_call_and_completes_the_text() -> None:
    events = replay(
        [
            chunk({"content": "Writing."}),
            chunk(call(0, '{"a": 1}', "c0", "w")),
            chunk(call(1, '{"b": "unfini', "c1", "w")),
            chunk(finish="length"),
            DONE,
        ]
    )
    assert [type(e) for e in events if isinstance(e, BlockCompleted | ToolCallTruncated)] == [
        BlockCompleted,
        ToolCallTruncated,
        ToolCallTruncated,
    ]
    assert events[-1] == MessageCompleted(stop_reason="max_tokens", usage=TokenUsage())


def test_finish_reason_without_done_is_accepted() -> None:
    events = replay([chunk({"content": "Hi"}), chunk(finish="stop")])
    assert events[-1] == MessageCompleted(stop_reason="end_turn", usage=TokenUsage())


def test_done_without_finish_reason_completes_the_calls() -> None:
    events = replay([chunk(call(0, '{"x": 1}', "c", "t")), DONE])
    assert isinstance(events[-2], BlockCompleted)
    assert events[-1] == MessageCompleted(stop_reason="tool_use", usage=TokenUsage())


def test_end_without_finish_reason_is_malformed() -> None:
    events = replay([chunk({"content": "Hi"})])
    last = events[-1]
    assert isinstance(last, StreamFailed) and last.error.kind == "malformed"
    assert not any(isinstance(e, BlockCompleted) for e in events)


def test_unknown_finish_reason_is_passed_through() -> None:
    events = replay([chunk({"content": "x"}, finish="eos_token"), DONE])
    assert events[-1] == MessageCompleted(stop_reason="eos_token", usage=TokenUsage())


def test_cached_tokens_are_split_from_input_and_usage_is_reported_once_per_change() -> None:
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 800},
    }
    events = replay(
        [
            chunk({"content": "a"}, usage=usage),
            chunk({"content": "b"}, usage=usage),
            chunk(finish="stop", usage={**usage, "completion_tokens": 6}),
            DONE,
        ]
    )
    reported = [e.usage for e in events if isinstance(e, UsageReported)]
    assert reported == [
        TokenUsage(input=200, output=5, cache_read=800),
        TokenUsage(input=200, output=6, cache_read=800),
    ]
    assert reported[-1].total == 1006


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        ({"error": {"message": "boom", "type": "server_error", "code": None}}, "timeout"),
        ({"error": "model crashed"}, "failed"),
        (
            {
                "error": {
                    "code": 400,
                    "type": "exceed_context_size_error",
                    "message": "the request exceeds the available context size",
                }
            },
            "context_overflow",
        ),
        ({"error": {"code": "context_length_exceeded", "message": "too long"}}, "context_overflow"),
        ({"error": {"code": 500, "message": "internal"}}, "timeout"),
    ],
)
def test_midstream_error_chunk_is_classified(payload: dict[str, Any], kind: str) -> None:
    body = b"data: " + json.dumps(payload).encode() + b"\n\n"
    events = replay([chunk({"content": "par"}), body, chunk({"content": "ignored"}), DONE])
    last = events[-1]
    assert isinstance(last, StreamFailed) and last.error.kind == kind
    assert last.error.status_code is None  # the response itself was a 200
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "par"


@pytest.mark.parametrize(
    "line",
    [
        b"data: {not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: {"choices": [{"delta": {"content": 7}}]}\n\n',
        b'data: {"choices": "nope"}\n\n',
    ],
)
def test_bad_chunks_fail_as_malformed_and_later_input_is_ignored(line: bytes) -> None:
    decoder = OpenAIStreamDecoder()
    events = decoder.feed(chunk({"content": "a"}) + line + chunk({"content": "b"}))
    last = events[-1]
    assert isinstance(last, StreamFailed) and last.error.kind == "malformed"
    assert decoder.finished and decoder.usage == TokenUsage()
    assert decoder.feed(chunk(finish="stop") + DONE) == []
    assert decoder.end_of_stream() == []


def test_comments_and_event_names_are_tolerated() -> None:
    events = replay(
        [
            b": keep-alive\n\n",
            b"event: message\n" + chunk({"content": "ok"}),
            chunk(finish="stop"),
            DONE,
        ]
    )
    assert summarise(events)["text"] == "ok"


# --- classify_error -------------------------------------------------------------------------------

CLASSIFICATION_KIND = {
    "context_overflow": "context_overflow",
    "auth": "auth",
    "rate_limit": "timeout",
    "quota_exhausted": "failed",
    "server_error": "timeout",
    "overloaded": "timeout",
}


@pytest.mark.parametrize("path", ERROR_FIXTURES)
def test_error_fixture_classification(path: str) -> None:
    entry = MANIFEST[path]
    body = fixture_bytes(path)
    error = classify_error(entry["status"], body, entry["headers"])
    assert classify_error(entry["status"], body.decode(), entry["headers"]) == error
    expect = entry["expect"]
    assert error.kind == CLASSIFICATION_KIND[expect["classification"]]
    assert error.status_code == entry["status"]
    assert error.message
    if error.kind != "context_overflow":  # compacted and rerun instead (R-COMPACT-9)
        assert should_retry(error.kind, 1, permanent=error.permanent) == expect["retryable"]


def test_rate_limit_is_transient_with_retry_after() -> None:
    entry = MANIFEST["openai/errors/429_rate_limit_exceeded.json"]
    body = fixture_bytes("openai/errors/429_rate_limit_exceeded.json")
    error = classify_error(429, body, entry["headers"])
    assert (error.kind, error.retry_after_s) == ("timeout", 4.0)
    assert (
        classify_error(429, body, {"Retry-After-Ms": "1500", "retry-after": "9"}).retry_after_s
        == 1.5
    )
    assert (
        classify_error(429, body, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}).retry_after_s
        is None
    )


def test_insufficient_quota_is_not_transient() -> None:
    body = fixture_bytes("openai/errors/429_insufficient_quota.json")
    error = classify_error(429, body, {"retry-after": "1"})
    assert error.kind == "failed"
    assert "quota" in error.message.lower()
    assert error.retry_after_s is None


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (502, b"<html><body>502 Bad Gateway</body></html>", "timeout"),
        (504, b"", "timeout"),
        (408, b"timeout", "timeout"),
        (400, b"\xff\xfe not utf-8 {", "failed"),
        (
            400,
            b'{"error": {"message": "Invalid value for tools", "type": "invalid_request_error"}}',
            "failed",
        ),
        (404, b'{"error": "model \\"x\\" not found, try pulling it first"}', "failed"),
        (403, b"forbidden", "auth"),
        (
            500,
            b'{"error": {"message": "request (9000 tokens) exceeds the available context size '
            b'(8192 tokens), try increasing it"}}',
            "context_overflow",
        ),
        (
            429,
            b'{"error": {"message": "This model\'s maximum context length is ... (rate limit)",'
            b' "code": "rate_limit_exceeded"}}',
            "timeout",
        ),
        (400, b"[1, 2, 3]", "failed"),
        (400, b'{"error": null}', "failed"),
        (400, b'{"error": {"message": 5, "code": [1]}}', "failed"),
    ],
)
def test_classify_error_never_raises(status: int, body: bytes, kind: str) -> None:
    error = classify_error(status, body, {})
    assert error.kind == kind
    assert error.message


def test_non_json_body_text_becomes_the_message() -> None:
    error = classify_error(502, b"<html>502 Bad Gateway</html>", {})
    assert "502 Bad Gateway" in error.message


# --- build_request --------------------------------------------------------------------------------

TOOLS = (
    ToolSchema(
        name="read_file",
        description="Read a file.",
        input_schema={"type": "object", "properties": {"path": {"type": "string"}}},
    ),
)


def request(*messages: Message, **kwargs: Any) -> ModelRequest:
    return ModelRequest(
        model="gpt-4o",
        system=kwargs.pop("system", "Be brief."),
        tools=kwargs.pop("tools", TOOLS),
        messages=messages,
        **kwargs,
    )


def tool_turn() -> tuple[Message, ...]:
    return (
        UserMessage(content=(TextBlock(text="Read a and b."),)),
        AssistantMessage(
            content=(
                ThinkingBlock(text="SECRET REASONING", signature="sig"),
                TextBlock(text="Reading both."),
                ToolCallBlock(id="call_a", name="read_file", arguments={"path": "a"}),
                ToolCallBlock(id="call_b", name="read_file", arguments={"path": "b"}),
            )
        ),
        UserMessage(
            content=(
                TextBlock(text="[user_steering]also c[/user_steering]"),
                ToolResult(
                    call_id="call_a",
                    tool="read_file",
                    status="ok",
                    is_error=False,
                    content=(TextBlock(text="A"),),
                ),
                ToolResult(
                    call_id="call_b",
                    tool="read_file",
                    status="error",
                    is_error=True,
                    content=(TextBlock(text="no such file"),),
                ),
            )
        ),
    )


def test_body_shape() -> None:
    body = build_request(request(UserMessage(content=(TextBlock(text="hi"),)), max_tokens=100))
    assert body == {
        "model": "gpt-4o",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 100,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "read_file",
                    "description": "Read a file.",
                    "parameters": TOOLS[0].input_schema,
                },
            }
        ],
    }
    bare = build_request(
        request(UserMessage(content=(TextBlock(text="hi"),)), tools=(), system=None)
    )
    assert "tools" not in bare
    assert bare["messages"] == [{"role": "user", "content": "hi"}]


def test_tool_results_follow_their_calls_in_order_and_thinking_is_never_sent() -> None:
    messages = build_request(request(*tool_turn()))["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant = messages[2]
    assert assistant["content"] == "Reading both."
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_a", "call_b"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"path": "a"}
    assert assistant["tool_calls"][0]["type"] == "function"
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:5]] == [
        ("call_a", "A"),
        ("call_b", "no such file"),
    ]
    assert messages[5] == {"role": "user", "content": "[user_steering]also c[/user_steering]"}
    dumped = json.dumps(messages)
    assert "SECRET REASONING" not in dumped and "sig" not in dumped


def test_every_call_has_exactly_one_result_right_after_it() -> None:
    messages = build_request(request(*tool_turn()))["messages"]
    for i, message in enumerate(messages):
        calls = [c["id"] for c in message.get("tool_calls", [])]
        if calls:
            following = messages[i + 1 : i + 1 + len(calls)]
            assert [m.get("tool_call_id") for m in following] == calls


def test_assistant_with_only_calls_or_only_thinking() -> None:
    only_call = AssistantMessage(content=(ToolCallBlock(id="c", name="t", arguments={}),))
    only_thinking = AssistantMessage(content=(ThinkingBlock(text="hmm"),))
    messages = build_request(request(only_call, only_thinking, system=None))["messages"]
    assert (
        messages[0]["content"] is None
        and messages[0]["tool_calls"][0]["function"]["arguments"] == "{}"
    )
    assert messages[1] == {"role": "assistant", "content": ""}


def test_images_fold_to_text_without_a_loader_or_without_vision() -> None:
    message = UserMessage(content=(TextBlock(text="Look:"), ImageBlock(path="shots/a.png")))
    folded = build_request(request(message, system=None))["messages"]
    assert folded == [{"role": "user", "content": "Look:\n[attached image: shots/a.png]"}]

    calls: list[ImageBlock] = []

    def loader(image: ImageBlock) -> dict[str, Any]:
        calls.append(image)
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image.path}"}}

    no_vision = build_request(
        request(message, system=None, supports_vision=False), image_loader=loader
    )
    assert no_vision["messages"] == folded and calls == []

    shown = build_request(request(message, system=None), image_loader=loader)["messages"]
    assert shown == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,shots/a.png"}},
            ],
        }
    ]
    assert (
        build_request(request(message, system=None), image_loader=lambda _: None)["messages"]
        == folded
    )


def test_images_in_tool_results() -> None:
    result = ToolResult(
        call_id="c",
        tool="shot",
        status="ok",
        is_error=False,
        content=(TextBlock(text="taken"), ImageBlock(path="s.png")),
    )
    messages = build_request(
        request(
            AssistantMessage(content=(ToolCallBlock(id="c", name="shot", arguments={}),)),
            UserMessage(content=(result,)),
            system=None,
        ),
        image_loader=lambda img: {"type": "image_url", "image_url": {"url": img.path}},
    )["messages"]
    assert messages[1] == {
        "role": "tool",
        "tool_call_id": "c",
        "content": "taken\n[attached image: s.png]",
    }
    assert messages[2] == {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "s.png"}}],
    }


def test_prefix_is_identical_from_turn_to_turn_and_encoding_is_cached() -> None:
    loads: list[str] = []

    def loader(image: ImageBlock) -> dict[str, Any]:
        loads.append(image.path)
        return {"type": "image_url", "image_url": {"url": image.path}}

    history = (UserMessage(content=(TextBlock(text="see"), ImageBlock(path="x.png"))), *tool_turn())
    encoder = RequestEncoder(image_loader=loader)
    turn_n = encoder.build(request(*history))
    messages_n = json.dumps(turn_n["messages"])
    more = (
        AssistantMessage(content=(TextBlock(text="Done."),)),
        UserMessage(content=(TextBlock(text="thanks"),)),
    )
    turn_n1 = encoder.build(request(*history, *more))
    assert loads == ["x.png"]  # the image is loaded once, not once per turn
    # The earlier messages are byte-identical (prompt cache prefix); the rest of the body too.
    assert json.dumps(turn_n1["messages"]).startswith(messages_n[:-1] + ", ")
    assert len(turn_n1["messages"]) == len(turn_n["messages"]) + 2
    assert {k: v for k, v in turn_n1.items() if k != "messages"} == {
        k: v for k, v in turn_n.items() if k != "messages"
    }
    # The cached body equals a fresh, uncached encoding of equal (not identical) objects.
    fresh = build_request(request(*tool_turn(), *more))
    cached = encoder.build(request(*history[1:], *more))
    assert json.dumps(fresh) == json.dumps(cached)


def test_encoder_reencodes_a_replaced_message() -> None:
    encoder = RequestEncoder()
    first = UserMessage(content=(TextBlock(text="one"),))
    encoder.build(request(first))
    replaced = UserMessage(content=(TextBlock(text="two"),))
    body = encoder.build(request(replaced))
    assert body["messages"][-1]["content"] == "two"
    assert encoder.build(request(first, replaced))["messages"][1:] == [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ]


def test_thinking_level_becomes_reasoning_effort_only_when_known() -> None:
    hi = UserMessage(content=(TextBlock(text="hi"),))
    assert build_request(request(hi, thinking_level="high"))["reasoning_effort"] == "high"
    assert "reasoning_effort" not in build_request(request(hi, thinking_level="ultra"))
    assert "reasoning_effort" not in build_request(request(hi))


def test_fragments_that_repeat_the_id_continue_the_same_call() -> None:
    # Some compatible servers repeat id and name on every fragment of a call.
    events = replay(
        [
            chunk(call(0, '{"q": ', "c0", "search")),
            chunk(call(0, '"x"}', "c0", "search")),
            chunk(finish="tool_calls"),
            DONE,
        ]
    )
    assert [e.kind for e in events if isinstance(e, BlockStarted)] == ["tool_call"]
    [completed] = [e.block for e in events if isinstance(e, BlockCompleted)]
    assert completed == ToolCallBlock(id="c0", name="search", arguments={"q": "x"})


def test_fragments_without_index_are_grouped_by_id() -> None:
    fragments = [
        {"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": '{"n": '}}]},
        {"tool_calls": [{"function": {"arguments": "1}"}}]},
        {"tool_calls": [{"id": "b", "function": {"name": "g", "arguments": "{}"}}]},
    ]
    events = replay([*(chunk(f) for f in fragments), chunk(finish="tool_calls"), DONE])
    blocks = [e.block for e in events if isinstance(e, BlockCompleted)]
    assert blocks == [
        ToolCallBlock(id="a", name="f", arguments={"n": 1}),
        ToolCallBlock(id="b", name="g", arguments={}),
    ]


def test_tool_result_image_that_cannot_be_loaded_is_only_named_once() -> None:
    result = ToolResult(
        call_id="c",
        tool="shot",
        status="ok",
        is_error=False,
        content=(ImageBlock(path="gone.png"),),
    )
    messages = build_request(
        request(
            AssistantMessage(content=(ToolCallBlock(id="c", name="shot", arguments={}),)),
            UserMessage(content=(result,)),
            system=None,
        ),
        image_loader=lambda _: None,
    )["messages"]
    assert messages[1:] == [
        {"role": "tool", "tool_call_id": "c", "content": "[attached image: gone.png]"}
    ]
