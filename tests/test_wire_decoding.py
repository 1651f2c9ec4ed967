"""Stream shapes servers really send, decoded by the pure codecs (no I/O).

Each case is a minimal stream: an OpenAI-compatible quirk (empty ``finish_reason``, the legacy
``function_call``, typed content parts, usage on every chunk), an Anthropic one (repeated
``signature_delta``), or a hostile/broken stream (two responses spliced together, a repeated
tool call id, arguments nested 100,000 deep, lone UTF-16 surrogates).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder
from greenroom.protocols.anthropic_codec import classify_error as anthropic_classify
from greenroom.protocols.content import TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.openai_codec import OpenAIStreamDecoder
from greenroom.protocols.openai_codec import classify_error as openai_classify
from greenroom.protocols.retry import should_retry
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    MessageCompleted,
    StreamEvent,
    StreamFailed,
    TokenUsage,
    ToolArgumentsDelta,
)
from greenroom.protocols.tools import MAX_ARGUMENT_DEPTH, json_text_too_deep, make_tool

# --------------------------------------------------------------------------- helpers


def openai_body(*chunks: Any, done: bool = True) -> bytes:
    body = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def anthropic_body(*events: dict[str, Any]) -> bytes:
    return b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events
    )


def decode_openai(body: bytes, *, step: int = 0) -> list[StreamEvent]:
    decoder = OpenAIStreamDecoder()
    pieces = [body[i : i + step] for i in range(0, len(body), step)] if step else [body]
    events = [e for piece in pieces for e in decoder.feed(piece)]
    return events + decoder.end_of_stream()


def decode_anthropic(body: bytes, *, step: int = 0) -> list[StreamEvent]:
    decoder = AnthropicStreamDecoder()
    pieces = [body[i : i + step] for i in range(0, len(body), step)] if step else [body]
    events = [e for piece in pieces for e in decoder.feed(piece)]
    return events + decoder.end_of_stream()


def blocks(events: list[StreamEvent]) -> list[Any]:
    return [e.block for e in events if isinstance(e, BlockCompleted)]


def text_of(events: list[StreamEvent]) -> str:
    return "".join(b.text for b in blocks(events) if isinstance(b, TextBlock))


def thinking_of(events: list[StreamEvent]) -> str:
    return "".join(b.text for b in blocks(events) if isinstance(b, ThinkingBlock))


def calls_of(events: list[StreamEvent]) -> list[ToolCallBlock]:
    return [b for b in blocks(events) if isinstance(b, ToolCallBlock)]


def chunk(delta: dict[str, Any], finish: Any = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta,
                                             "finish_reason": finish}], **extra}


START = {"type": "message_start", "message": {"id": "msg_1", "type": "message",
         "role": "assistant", "content": [], "model": "m", "stop_reason": None,
         "usage": {"input_tokens": 3, "output_tokens": 1}}}
STOP = {"type": "message_stop"}


def a_delta(stop: str) -> dict[str, Any]:
    return {"type": "message_delta", "delta": {"stop_reason": stop},
            "usage": {"output_tokens": 5}}


def a_text(index: int, text: str) -> list[dict[str, Any]]:
    return [
        {"type": "content_block_start", "index": index,
         "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": index,
         "delta": {"type": "text_delta", "text": text}},
        {"type": "content_block_stop", "index": index},
    ]


def a_tool(index: int, call_id: str, arguments: str) -> list[dict[str, Any]]:
    return [
        {"type": "content_block_start", "index": index,
         "content_block": {"type": "tool_use", "id": call_id, "name": "lookup", "input": {}}},
        {"type": "content_block_delta", "index": index,
         "delta": {"type": "input_json_delta", "partial_json": arguments}},
        {"type": "content_block_stop", "index": index},
    ]


# --------------------------------------------------------------------------- finish_reason ""

EMPTY_FINISH = openai_body(
    chunk({"content": "Hel"}, ""),
    chunk({"content": "lo"}, ""),
    chunk({}, "stop"),
)


@pytest.mark.parametrize("step", [0, 1, 7])
def test_empty_finish_reason_is_not_the_end(step: int) -> None:
    """Some servers send ``"finish_reason": ""`` on every chunk but the last."""
    events = decode_openai(EMPTY_FINISH, step=step)
    assert text_of(events) == "Hello"
    assert isinstance(events[-1], MessageCompleted) and events[-1].stop_reason == "end_turn"


def test_empty_finish_reason_then_a_dropped_connection_is_malformed() -> None:
    events = decode_openai(openai_body(chunk({"content": "Hel"}, ""), done=False))
    assert isinstance(events[-1], StreamFailed)
    assert events[-1].error.kind == "malformed" and should_retry("malformed", 1)


def test_empty_anthropic_stop_reason_is_no_verdict() -> None:
    """An empty ``stop_reason`` is "not finished" on the Anthropic wire too: the stream still
    needs its real verdict."""
    body = anthropic_body(START, *a_text(0, "hi"), a_delta(""), STOP)
    events = decode_anthropic(body)
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"
    body = anthropic_body(START, *a_text(0, "hi"), a_delta(""), a_delta("end_turn"), STOP)
    events = decode_anthropic(body)
    assert isinstance(events[-1], MessageCompleted) and events[-1].stop_reason == "end_turn"


# --------------------------------------------------------------------------- function_call


def test_legacy_function_call_is_one_tool_call() -> None:
    body = openai_body(
        chunk({"role": "assistant", "content": None,
               "function_call": {"name": "lookup", "arguments": ""}}),
        chunk({"function_call": {"arguments": '{"key": '}}),
        chunk({"function_call": {"arguments": '"x"}'}}),
        chunk({}, "function_call"),
    )
    for step in (0, 5):
        events = decode_openai(body, step=step)
        (call,) = calls_of(events)
        assert call.name == "lookup" and call.arguments == {"key": "x"}
        assert call.id  # synthesised, non-empty (R-TOOL-7)
        started = [e for e in events if isinstance(e, BlockStarted)]
        assert [s.call_id for s in started] == [call.id]
        assert {e.call_id for e in events if isinstance(e, ToolArgumentsDelta)} == {call.id}
        assert isinstance(events[-1], MessageCompleted) and events[-1].stop_reason == "tool_use"
        # Stable: the same stream gives the same id.
        assert calls_of(decode_openai(body))[0].id == call.id


# --------------------------------------------------------------------------- signatures


def test_repeated_signature_delta_keeps_the_last() -> None:
    body = anthropic_body(
        START,
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "hmm"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "AAA"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "BBB"}},
        {"type": "content_block_stop", "index": 0},
        a_delta("end_turn"), STOP,
    )
    (block,) = blocks(decode_anthropic(body))
    assert isinstance(block, ThinkingBlock) and block.signature == "BBB"


# --------------------------------------------------------------------------- spliced streams


def test_second_message_start_with_another_id_is_malformed() -> None:
    other = {**START, "message": {**START["message"], "id": "msg_2"}}
    body = anthropic_body(START, *a_text(0, "one"), other, *a_text(1, "two"),
                          a_delta("end_turn"), STOP)
    events = decode_anthropic(body)
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"
    assert "message_start" in events[-1].error.message


def test_content_block_start_at_an_open_index_is_malformed() -> None:
    opened = a_text(0, "one")[:2]
    body = anthropic_body(START, *opened, *a_text(0, "two"), a_delta("end_turn"), STOP)
    events = decode_anthropic(body)
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"
    assert text_of(events) == ""


# --------------------------------------------------------------------------- typed parts


def test_content_as_typed_parts_gives_text_and_thinking() -> None:
    body = openai_body(
        chunk({"role": "assistant", "content": [
            {"type": "thinking", "thinking": [{"type": "text", "text": "Let me "}]}]}),
        chunk({"content": [{"type": "thinking", "thinking": [{"type": "text",
                                                               "text": "think."}]}]}),
        chunk({"content": [{"type": "text", "text": "The answer"}]}),
        chunk({"content": " is 4."}),
        chunk({}, "stop"),
    )
    events = decode_openai(body)
    assert thinking_of(events) == "Let me think."
    assert text_of(events) == "The answer is 4."
    assert isinstance(events[-1], MessageCompleted)


def test_content_part_that_is_not_an_object_is_malformed() -> None:
    events = decode_openai(openai_body(chunk({"content": ["text"]}), chunk({}, "stop")))
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"


# --------------------------------------------------------------------------- usage, reasoning


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@pytest.mark.parametrize("where", ["every-chunk", "finish-chunk", "final-empty-choices"])
def test_usage_last_report_wins(where: str) -> None:
    if where == "every-chunk":
        chunks = [chunk({"content": "a"}, usage=usage(10, 1)),
                  chunk({"content": "b"}, usage=usage(10, 2)),
                  chunk({}, "stop", usage=usage(10, 3))]
    elif where == "finish-chunk":
        chunks = [chunk({"content": "a"}), chunk({"content": "b"}),
                  chunk({}, "stop", usage=usage(10, 3))]
    else:
        chunks = [chunk({"content": "a"}, usage=usage(10, 1)), chunk({"content": "b"}),
                  chunk({}, "stop"),
                  {"id": "chatcmpl-1", "choices": [], "usage": usage(10, 3)}]
    events = decode_openai(openai_body(*chunks))
    assert isinstance(events[-1], MessageCompleted)
    assert events[-1].usage == TokenUsage(input=10, output=3)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_both_reasoning_names_are_thinking(field: str) -> None:
    body = openai_body(chunk({field: "Think"}), chunk({field: "ing."}),
                       chunk({"content": "Done."}), chunk({}, "stop"))
    events = decode_openai(body)
    assert thinking_of(events) == "Thinking." and text_of(events) == "Done."


# --------------------------------------------------------------------------- R-SEC-6


def test_openai_repeated_tool_call_id_is_malformed() -> None:
    body = openai_body(
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "lookup", "arguments": '{"key":"1"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_a", "type": "function",
                               "function": {"name": "lookup", "arguments": '{"key":"2"}'}}]}),
        chunk({}, "tool_calls"),
    )
    events = decode_openai(body)
    assert calls_of(events) == []
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"
    assert "call_a" in events[-1].error.message and should_retry("malformed", 1)


def test_anthropic_repeated_tool_use_id_is_malformed() -> None:
    body = anthropic_body(START, *a_tool(0, "toolu_a", '{"key":"1"}'),
                          *a_tool(1, "toolu_a", '{"key":"2"}'), a_delta("tool_use"), STOP)
    events = decode_anthropic(body)
    assert isinstance(events[-1], StreamFailed) and events[-1].error.kind == "malformed"
    assert "toolu_a" in events[-1].error.message


DEEP = '{"key": ' + "[" * 100_000 + "]" * 100_000 + "}"


def test_deep_arguments_are_invalid_arguments_of_that_call() -> None:
    """R-SEC-6/R-TOOL-5: 100,000 levels of nesting give that call invalid arguments; the
    stream itself is fine and the other call is untouched."""
    body = openai_body(
        chunk({"tool_calls": [{"index": 0, "id": "call_deep", "type": "function",
                               "function": {"name": "lookup", "arguments": DEEP}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_ok", "type": "function",
                               "function": {"name": "lookup", "arguments": '{"key":"k"}'}}]}),
        chunk({}, "tool_calls"),
    )
    events = decode_openai(body)
    assert isinstance(events[-1], MessageCompleted)
    deep, ok = calls_of(events)
    assert deep.invalid_arguments == DEEP and deep.arguments == {}
    assert ok.arguments == {"key": "k"}
    events = decode_anthropic(anthropic_body(START, *a_tool(0, "toolu_deep", DEEP),
                                             a_delta("tool_use"), STOP))
    assert isinstance(events[-1], MessageCompleted)
    (deep,) = calls_of(events)
    assert deep.invalid_arguments == DEEP


def test_nesting_limit_is_exact_and_ignores_brackets_in_strings() -> None:
    at_limit = "[" * MAX_ARGUMENT_DEPTH + "]" * MAX_ARGUMENT_DEPTH
    assert not json_text_too_deep('{"a": ' + at_limit[1:-1] + "}")
    assert json_text_too_deep('{"a": ' + at_limit + "}")
    assert not json_text_too_deep(json.dumps({"a": "[{" * 1000 + '\\"['}))


async def lookup(key: Any) -> str:
    """Look up."""
    return "x"


def test_validation_reports_deep_values_instead_of_recursing() -> None:
    value: Any = 1
    for _ in range(100_000):
        value = [value]
    problems = make_tool(lookup, parallel=True).validate({"key": value})
    assert problems == [f"$: nested deeper than {MAX_ARGUMENT_DEPTH} levels"]


# --------------------------------------------------------------------------- permanent errors


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, {"type": "error", "error": {"type": "not_found_error", "message": "model: x"}}),
        (400, {"type": "error", "error": {"type": "invalid_request_error",
                                          "message": "max_tokens: Field required"}}),
        (413, {"error": {"type": "request_too_large", "message": "Request exceeds the max"}}),
    ],
)
def test_anthropic_request_rejections_are_permanent(status: int, body: Any) -> None:
    error = anthropic_classify(status, json.dumps(body), {})
    assert error.kind == "failed" and error.permanent
    assert body["error"]["message"] in error.message
    assert not should_retry(error.kind, 1, permanent=error.permanent)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (404, {"error": {"message": "The model `gpt-x` does not exist", "type":
                         "invalid_request_error", "code": "model_not_found"}}),
        (400, {"error": {"message": "Invalid value for 'temperature'", "type":
                         "invalid_request_error", "code": None}}),
        (413, {"error": {"message": "Request too large", "type": "invalid_request_error"}}),
    ],
)
def test_openai_request_rejections_are_permanent(status: int, body: Any) -> None:
    error = openai_classify(status, json.dumps(body), {})
    assert error.kind == "failed" and error.permanent
    assert body["error"]["message"] in error.message


@pytest.mark.parametrize("status", [429, 500, 503, 529])
def test_transient_errors_stay_retryable(status: int) -> None:
    for classify in (anthropic_classify, openai_classify):
        error = classify(status, "{}", {})
        assert not error.permanent and should_retry(error.kind, 1, permanent=error.permanent)


def test_context_overflow_is_not_a_permanent_failure() -> None:
    body = {"type": "error", "error": {"type": "invalid_request_error",
                                       "message": "prompt is too long: 210000 tokens"}}
    error = anthropic_classify(400, json.dumps(body), {})
    assert error.kind == "context_overflow" and not error.permanent


# --------------------------------------------------------------------------- surrogates

LONE = "\\ud800"  # a JSON escape of a lone high surrogate


def test_openai_lone_surrogates_are_repaired() -> None:
    raw = ('data: {"choices":[{"index":0,"delta":{"reasoning_content":"r' + LONE + '",'
           '"content":"t' + LONE + '","tool_calls":[{"index":0,"id":"c","function":'
           '{"name":"lookup","arguments":"{\\"key\\":\\"a' + "\\" + LONE + '\\"}"}}]},'
           '"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n').encode()
    events = decode_openai(raw)
    assert isinstance(events[-1], MessageCompleted)
    assert thinking_of(events) == "r\ufffd" and text_of(events) == "t\ufffd"
    assert calls_of(events)[0].arguments == {"key": "a\ufffd"}
    for event in events:
        json.dumps(repr(event)).encode("utf-8")  # everything is encodable


def test_anthropic_lone_surrogates_are_repaired() -> None:
    raw = anthropic_body(START).decode() + (
        'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        '"content_block":{"type":"text","text":""}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"a' + LONE + 'b"}}\n\n'
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
        '"content_block":{"type":"tool_use","id":"t","name":"lookup","input":{}}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        '"delta":{"type":"input_json_delta","partial_json":"{\\"key\\":\\"' + "\\" + LONE
        + '\\"}"}}\n\n'
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
    ) + anthropic_body(a_delta("tool_use"), STOP).decode()
    events = decode_anthropic(raw.encode())
    assert isinstance(events[-1], MessageCompleted)
    assert text_of(events) == "a\ufffdb"
    assert calls_of(events)[0].arguments == {"key": "\ufffd"}


def test_synthesised_ids_never_collide_with_the_servers() -> None:
    body = openai_body(
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "lookup", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 1, "type": "function",
                               "function": {"name": "lookup", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    )
    events = decode_openai(body)
    assert isinstance(events[-1], MessageCompleted)
    ids = [c.id for c in calls_of(events)]
    assert ids[0] == "call_1" and len(set(ids)) == 2 and all(ids)
