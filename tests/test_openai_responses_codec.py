"""The OpenAI Responses API codec: requests, stream decoding, and the SDK as the oracle.

Fixtures are in ``tests/fixtures/openai_responses/``. The differential test generates
streams the way servers send them (deltas, then the whole output again in
``response.completed``), cuts them at random byte offsets, and checks that what greenroom
assembles from the deltas equals what the official ``openai`` SDK's own stream state
reports as the final response.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from openai import omit
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from greenroom.protocols.content import TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.context import (
    AssistantMessage,
    ModelRequest,
    ToolResult,
    ToolSchema,
    UserMessage,
)
from greenroom.protocols.openai_responses_codec import (
    RequestEncoder,
    ResponsesStreamDecoder,
    build_request,
    classify_error,
)
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    MessageCompleted,
    StreamEvent,
    StreamFailed,
    TextDelta,
    ThinkingDelta,
    ToolArgumentsDelta,
    ToolCallTruncated,
    UsageReported,
    coalesce_deltas,
)
from greenroom.protocols.tools import MAX_ARGUMENT_DEPTH
from greenroom.protocols.trace import fit_model_block

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "openai_responses"


def decode(*chunks: bytes) -> list[StreamEvent]:
    decoder = ResponsesStreamDecoder()
    events: list[StreamEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.end_of_stream()
    return events


def completed_blocks(events: list[StreamEvent]) -> list[Any]:
    return [e.block for e in events if isinstance(e, BlockCompleted)]


def terminal(events: list[StreamEvent]) -> StreamEvent:
    ends = [e for e in events if isinstance(e, MessageCompleted | StreamFailed)]
    assert len(ends) == 1, events
    assert events[-1] is ends[0]
    return ends[0]


def sse(events: list[dict[str, Any]]) -> bytes:
    return "".join(
        f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events
    ).encode()


# -- fixtures --------------------------------------------------------------------------------


def test_text_stream() -> None:
    events = decode((FIXTURES / "text_only.sse").read_bytes())
    assert completed_blocks(events) == [TextBlock(text="Hello! Grüße — 👋")]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello! Grüße — 👋"
    end = terminal(events)
    assert isinstance(end, MessageCompleted)
    assert end.stop_reason == "end_turn"
    assert end.usage.input == 20 and end.usage.cache_read == 10 and end.usage.output == 8
    assert end.response_id == "resp_Fixture0001"  # exported as gen_ai.response.id (R-OBS-2)
    assert end.response_model == "gpt-5-mini-2026-08-07"  # and as gen_ai.response.model


def test_reasoning_then_tool_call_keeps_the_encrypted_reasoning() -> None:
    events = decode((FIXTURES / "reasoning_tool_call.sse").read_bytes())
    thinking, call = completed_blocks(events)
    assert thinking == ThinkingBlock(
        text="**Checking the weather**\n\nI need the weather tool.\n\nThen answer.",
        signature="gAAAAABFixtureEncryptedReasoning0001==",
        item_id="rs_Fixture0001",
    )
    assert call == ToolCallBlock(
        id="call_FixtureWeather0001",
        name="get_weather",
        arguments={"city": "São Paulo", "units": "c"},
    )
    started = [e for e in events if isinstance(e, BlockStarted)]
    assert [s.kind for s in started] == ["thinking", "tool_call"]
    assert any(isinstance(e, ToolArgumentsDelta) for e in events)
    assert any(isinstance(e, ThinkingDelta) for e in events)
    end = terminal(events)
    assert isinstance(end, MessageCompleted) and end.stop_reason == "tool_use"


def test_tool_call_completes_before_the_response_ends() -> None:
    """R-TOOL-1: the call can be approved at its output_item.done, while the model streams."""
    body = (FIXTURES / "reasoning_tool_call.sse").read_bytes()
    cut = body.index(b"event: response.completed")
    decoder = ResponsesStreamDecoder()
    early = decoder.feed(body[:cut])
    assert any(
        isinstance(e, BlockCompleted) and isinstance(e.block, ToolCallBlock) for e in early
    )
    assert not decoder.finished


def test_incomplete_at_max_output_tokens_truncates_the_open_call() -> None:
    events = decode((FIXTURES / "incomplete_max_output_tokens.sse").read_bytes())
    assert completed_blocks(events) == [TextBlock(text="Writing the report.")]
    truncated = [e for e in events if isinstance(e, ToolCallTruncated)]
    assert [t.call_id for t in truncated] == ["call_FixtureTruncated0001"]
    end = terminal(events)
    assert isinstance(end, MessageCompleted) and end.stop_reason == "max_tokens"


def test_failed_response_is_a_retryable_failure() -> None:
    end = terminal(decode((FIXTURES / "failed_server_error.sse").read_bytes()))
    assert isinstance(end, StreamFailed)
    assert end.error.kind == "timeout"
    assert "server had an error" in end.error.message


def test_a_stream_cut_before_completion_is_malformed() -> None:
    events = decode((FIXTURES / "truncated_no_completed.sse").read_bytes())
    end = terminal(events)
    assert isinstance(end, StreamFailed) and end.error.kind == "malformed"
    assert not completed_blocks(events)


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.sse")), ids=lambda p: p.name)
def test_fixtures_decode_the_same_in_any_chunking(path: Path) -> None:
    body = path.read_bytes()
    whole = coalesce_deltas(decode(body))
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(body)), k=min(12, len(body) - 1)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        assert coalesce_deltas(decode(*pieces)) == whole  # R-RUN-2: cut only elsewhere


# -- malformed and hostile streams -----------------------------------------------------------


def _call_added(index: int, call_id: str) -> dict[str, Any]:
    return {
        "type": "response.output_item.added",
        "output_index": index,
        "item": {"type": "function_call", "id": f"fc_{index}", "call_id": call_id,
                 "name": "t", "arguments": ""},
    }


def _call_done(index: int, call_id: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "response.output_item.done",
        "output_index": index,
        "item": {"type": "function_call", "id": f"fc_{index}", "call_id": call_id,
                 "name": "t", "arguments": arguments, "status": "completed"},
    }


def test_a_repeated_call_id_is_malformed() -> None:
    """R-SEC-6: two calls sharing an id would pair the wrong result."""
    events = decode(
        sse([
            _call_added(0, "call_1"),
            _call_done(0, "call_1", "{}"),
            _call_added(1, "call_1"),
            _call_done(1, "call_1", "{}"),
            {"type": "response.completed", "response": {}},
        ])
    )
    end = terminal(events)
    assert isinstance(end, StreamFailed) and end.error.kind == "malformed"
    assert "repeated" in end.error.message


def test_a_second_item_at_an_open_index_is_malformed() -> None:
    events = decode(
        sse([
            _call_added(0, "call_1"),
            _call_added(0, "call_2"),
            {"type": "response.completed", "response": {}},
        ])
    )
    end = terminal(events)
    assert isinstance(end, StreamFailed) and end.error.kind == "malformed"


def test_deeply_nested_arguments_are_invalid_arguments_of_that_call() -> None:
    """R-SEC-6: the call gets an error output; the attempt is not failed."""
    deep = "[" * 100_000 + "]" * 100_000
    shallow_enough = json.dumps({"a": _nest(MAX_ARGUMENT_DEPTH - 2)})
    events = decode(
        sse([
            _call_added(0, "call_deep"),
            _call_done(0, "call_deep", '{"a":' + deep + "}"),
            _call_added(1, "call_ok"),
            _call_done(1, "call_ok", shallow_enough),
            {"type": "response.completed", "response": {}},
        ])
    )
    deep_call, ok_call = completed_blocks(events)
    assert deep_call.arguments == {} and deep_call.invalid_arguments is not None
    assert ok_call.invalid_arguments is None
    end = terminal(events)
    assert isinstance(end, MessageCompleted) and end.stop_reason == "tool_use"


def _nest(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_lone_surrogates_in_deltas_are_repaired() -> None:
    """R-SEC-1: a delta spelling a lone surrogate cannot reach the trace writer."""
    body = sse([
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"type": "message", "id": "m", "content": []}},
        {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
         "item_id": "m", "delta": "x"},
    ]) + (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"output_index":0,"content_index":0,"item_id":"m","delta":"\\ud800"}\n\n'
    ) + sse([
        {"type": "response.output_item.done", "output_index": 0,
         "item": {"type": "message", "id": "m", "content": []}},
        {"type": "response.completed", "response": {}},
    ])
    (block,) = completed_blocks(decode(body))
    assert block == TextBlock(text="x\ufffd")
    block.text.encode("utf-8")


@pytest.mark.parametrize(
    ("code", "kind"),
    [("context_length_exceeded", "context_overflow"), ("rate_limit_exceeded", "timeout"),
     ("invalid_prompt", "failed")],
)
def test_error_events_are_classified(code: str, kind: str) -> None:
    events = decode(sse([{"type": "error", "code": code, "message": "nope", "param": None}]))
    end = terminal(events)
    assert isinstance(end, StreamFailed) and end.error.kind == kind


def test_http_errors_use_the_openai_classifier() -> None:
    body = json.dumps({"error": {"message": "bad key", "type": "invalid_request_error",
                                 "code": "invalid_api_key"}})
    assert classify_error(401, body, {}).kind == "auth"
    assert classify_error(503, "{}", {"retry-after": "2"}).retry_after_s == 2.0


# -- requests --------------------------------------------------------------------------------

TOOLS = (ToolSchema(name="get_weather", description="Weather.",
                    input_schema={"type": "object", "properties": {}}),)
REASONING = ThinkingBlock(text="plan", signature="ENC1", item_id="rs_1")
CALL = ToolCallBlock(id="call_1", name="get_weather", arguments={"city": "Oslo"})
RESULT = ToolResult(call_id="call_1", tool="get_weather", status="ok", is_error=False,
                    content=(TextBlock(text="4°C"),))


def request(*messages: Any, thinking: str | None = "medium") -> ModelRequest:
    return ModelRequest(model="gpt-5-mini", system="Be brief.", tools=TOOLS,
                        messages=tuple(messages), thinking_level=thinking)


def test_request_shape_pairs_outputs_by_call_id_and_carries_reasoning_in_the_chain() -> None:
    prompt = UserMessage(content=(TextBlock(text="Weather in Oslo?"),))
    body = build_request(request(prompt, AssistantMessage(content=(REASONING, CALL)),
                                 UserMessage(content=(RESULT,))))
    assert body["store"] is False
    assert body["include"] == ["reasoning.encrypted_content"]
    assert body["instructions"] == "Be brief."
    assert body["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert body["tools"][0]["name"] == "get_weather"
    assert body["input"] == [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "plan"}],
         "encrypted_content": "ENC1"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4°C"},
    ]


def test_a_text_split_to_fit_records_is_sent_back_as_the_model_wrote_it() -> None:
    """R-TRACE, R-SEC-9, R-CLUSTER-1: the model's text split at line breaks to fit a
    cluster's records (trace.fit_model_block) is sent back as one message, its pieces
    joined by the line breaks left out between them (before: one assistant message a
    piece, the model's history without those breaks); a text after a call stays apart."""
    text = "\n".join(f"line {i}: " + "y" * 90 for i in range(40))
    pieces = fit_model_block(TextBlock(text=text), 1000)
    assert isinstance(pieces, tuple) and len(pieces) >= 3
    prompt = UserMessage(content=(TextBlock(text="Weather in Oslo?"),))
    answer = AssistantMessage(content=(*pieces, CALL, TextBlock(text="after")))
    items = build_request(request(prompt, answer, UserMessage(content=(RESULT,))))["input"]
    assert items[1:4] == [
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": text}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "after"}]},
    ]


def test_reasoning_of_finished_exchanges_is_not_resent() -> None:
    """R-RUN-9: only the current tool-use chain's reasoning goes back."""
    first = UserMessage(content=(TextBlock(text="q1"),))
    answer = AssistantMessage(content=(REASONING, TextBlock(text="a1")))
    second = UserMessage(content=(TextBlock(text="q2"),))
    body = build_request(request(first, answer, second))
    assert [item["type"] for item in body["input"]] == ["message", "message", "message"]


def test_prefix_and_cache_key_are_stable_across_turns() -> None:
    encoder = RequestEncoder()
    prompt = UserMessage(content=(TextBlock(text="Weather in Oslo?"),))
    turn1 = encoder.build(request(prompt))
    reply = AssistantMessage(content=(REASONING, CALL))
    turn2 = encoder.build(request(prompt, reply, UserMessage(content=(RESULT,))))
    assert turn2["input"][: len(turn1["input"])] == turn1["input"]
    assert turn1["prompt_cache_key"] == turn2["prompt_cache_key"]
    other = RequestEncoder().build(request(UserMessage(content=(TextBlock(text="other"),))))
    assert other["prompt_cache_key"] != turn1["prompt_cache_key"]


# -- differential: the SDK's stream state as the oracle --------------------------------------


def _generated_stream(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(events, final output items) in the shape servers send."""
    alphabet = ["a", "é", "—", "👋", " ", "\n", '"', "\\", "{", "ü", "x"]
    events: list[dict[str, Any]] = [{"type": "response.created", "response": {"id": "r"}}]
    output: list[dict[str, Any]] = []
    for index in range(rng.randint(1, 4)):
        kind = rng.choice(["message", "reasoning", "function_call"])
        if kind == "message":
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            item = {"type": "message", "id": f"msg_{index}", "role": "assistant",
                    "status": "in_progress", "content": []}
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": item})
            events.append({"type": "response.content_part.added", "output_index": index,
                           "item_id": item["id"], "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})
            for piece in _pieces(rng, text):
                events.append({"type": "response.output_text.delta", "output_index": index,
                               "item_id": item["id"], "content_index": 0, "delta": piece,
                               "logprobs": []})
            done = {**item, "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}
        elif kind == "reasoning":
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
            item = {"type": "reasoning", "id": f"rs_{index}", "summary": []}
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": item})
            events.append({"type": "response.reasoning_summary_part.added",
                           "output_index": index, "item_id": item["id"], "summary_index": 0,
                           "part": {"type": "summary_text", "text": ""}})
            for piece in _pieces(rng, text):
                events.append({"type": "response.reasoning_summary_text.delta",
                               "output_index": index, "item_id": item["id"],
                               "summary_index": 0, "delta": piece})
            done = {**item, "summary": [{"type": "summary_text", "text": text}],
                    "encrypted_content": f"ENC{index}"}
        else:
            arguments = json.dumps({"k": "".join(rng.choice(alphabet) for _ in range(8)),
                                    "n": rng.randint(0, 99)}, ensure_ascii=rng.random() < 0.5)
            item = {"type": "function_call", "id": f"fc_{index}", "call_id": f"call_{index}",
                    "name": "tool", "arguments": "", "status": "in_progress"}
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": item})
            for piece in _pieces(rng, arguments):
                events.append({"type": "response.function_call_arguments.delta",
                               "output_index": index, "item_id": item["id"], "delta": piece})
            done = {**item, "arguments": arguments, "status": "completed"}
        events.append({"type": "response.output_item.done", "output_index": index, "item": done})
        output.append(done)
    events.append({"type": "response.completed",
                   "response": {"id": "r", "object": "response", "created_at": 0,
                                "model": "m", "status": "completed", "output": output,
                                "parallel_tool_calls": True, "tool_choice": "auto",
                                "tools": [], "usage": {"input_tokens": 5,
                                                       "output_tokens": 3,
                                                       "total_tokens": 8}}})
    return events, output


def _pieces(rng: random.Random, text: str) -> list[str]:
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 5)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


def _sdk_final(events: list[dict[str, Any]]) -> list[Any]:
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))
    final = state._completed_response
    assert final is not None
    blocks: list[Any] = []
    for item in final.output:
        if item.type == "message":
            blocks.append(TextBlock(text="".join(p.text for p in item.content)))
        elif item.type == "reasoning":
            blocks.append(ThinkingBlock(text="\n\n".join(s.text for s in item.summary),
                                        signature=item.encrypted_content, item_id=item.id))
        elif item.type == "function_call":
            blocks.append(ToolCallBlock(id=item.call_id, name=item.name,
                                        arguments=json.loads(item.arguments)))
    return blocks


def test_generated_streams_agree_with_the_sdk_in_any_chunking() -> None:
    rng = random.Random(20261201)
    for _ in range(400):
        events, _ = _generated_stream(rng)
        body = sse(events)
        cuts = sorted(rng.sample(range(1, len(body)), k=min(rng.randint(1, 20), len(body) - 1)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        ours = decode(*pieces)
        assert isinstance(terminal(ours), MessageCompleted)
        assert completed_blocks(ours) == _sdk_final(events)
        assert any(isinstance(e, UsageReported) for e in ours)


def test_generated_streams_cut_short_never_complete() -> None:
    rng = random.Random(99)
    for _ in range(200):
        events, _ = _generated_stream(rng)
        body = sse(events)
        end_at = body.index(b"event: response.completed")
        cut = rng.randint(0, end_at)
        ours = decode(body[:cut])
        end = terminal(ours)
        assert isinstance(end, StreamFailed) and end.error.kind == "malformed"
