"""R-RUN-2: a partial chunk is what one network read brought of a block. The deltas a read
decodes to are joined per block (``coalesce_deltas``, applied by every wire decoder), so
the text, its order and every other event are the same whatever the reads, and a stream
that arrives all at once costs one partial output a block instead of one a token."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder
from greenroom.protocols.content import TextBlock
from greenroom.protocols.openai_codec import OpenAIStreamDecoder
from greenroom.protocols.openai_responses_codec import ResponsesStreamDecoder
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    MessageCompleted,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    TokenUsage,
    ToolArgumentsDelta,
    UsageReported,
    coalesce_deltas,
)


def args(index: int, delta: str, call_id: str = "c1") -> ToolArgumentsDelta:
    return ToolArgumentsDelta(index=index, call_id=call_id, name="lookup", delta=delta)


def test_runs_of_one_block_are_joined_in_order() -> None:
    started = BlockStarted(index=1, kind="tool_call", call_id="c1", name="lookup")
    usage = UsageReported(usage=TokenUsage(input=3, output=1))
    events: list[StreamEvent] = [
        ThinkingDelta(index=0, text="let "),
        ThinkingDelta(index=0, text="me see"),
        TextDelta(index=0, text="x"),  # another kind of delta: a run of its own
        started,
        args(1, '{"ke'),
        args(1, 'y": '),
        args(1, '"a"}'),
        usage,
        TextDelta(index=2, text="a "),
        TextDelta(index=2, text="b "),
        TextDelta(index=3, text="c"),  # another block
        TextDelta(index=3, text="d"),
    ]
    assert coalesce_deltas(events) == [
        ThinkingDelta(index=0, text="let me see"),
        TextDelta(index=0, text="x"),
        started,
        args(1, '{"key": "a"}'),
        usage,
        TextDelta(index=2, text="a b "),
        TextDelta(index=3, text="cd"),
    ]


def test_a_batch_with_nothing_to_join_is_returned_as_it_is() -> None:
    one: list[StreamEvent] = [TextDelta(index=0, text="a")]
    assert coalesce_deltas(one) is one
    apart: list[StreamEvent] = [
        TextDelta(index=0, text="a"),
        BlockCompleted(index=0, block=TextBlock(text="a")),
        TextDelta(index=1, text="b"),
    ]
    assert coalesce_deltas(apart) is apart
    assert coalesce_deltas([]) == []


# -- the decoders ----------------------------------------------------------------------


def _sse(events: list[tuple[str | None, dict[str, Any]]]) -> bytes:
    out = []
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        out.append(f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n")
    return "".join(out).encode()


TOKENS = ["The ", "answer ", "is ", "forty", "-two", ".", " \u00e9t\u00e9 ", "\U0001f600"]


def _block_deltas(
    index: int, kind: str, field: str, pieces: list[str]
) -> list[tuple[str | None, dict[str, Any]]]:
    """One Anthropic content_block_delta event of block ``index`` a piece."""
    return [
        ("content_block_delta",
         {"type": "content_block_delta", "index": index, "delta": {"type": kind, field: piece}})
        for piece in pieces
    ]


def anthropic_body() -> bytes:
    events: list[tuple[str | None, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": {
            "id": "m", "type": "message", "role": "assistant", "content": [], "model": "x",
            "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": ""}}),
    ]
    events += _block_deltas(0, "thinking_delta", "thinking", TOKENS)
    events += [
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "signature_delta", "signature": "s"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "text", "text": ""}}),
    ]
    events += _block_deltas(1, "text_delta", "text", TOKENS)
    events += [
        ("ping", {"type": "ping"}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}}),
    ]
    events += _block_deltas(2, "input_json_delta", "partial_json", ['{"ke', 'y": "', 'lyon"}'])
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                           "usage": {"output_tokens": 9}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return _sse(events)


def openai_body() -> bytes:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    events: list[tuple[str | None, dict[str, Any]]] = [
        (None, chunk({"role": "assistant", "reasoning_content": t})) for t in TOKENS
    ]
    events += [(None, chunk({"content": t})) for t in TOKENS]
    events += [(None, chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                             "function": {"name": "lookup", "arguments": ""}}]}))]
    events += [(None, chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}))
               for p in ['{"ke', 'y": "', 'lyon"}']]
    events += [(None, chunk({}, "tool_calls"))]
    return _sse(events) + b"data: [DONE]\n\n"


def responses_body() -> bytes:
    events: list[tuple[str | None, dict[str, Any]]] = [
        ("response.created", {"type": "response.created", "response": {
            "id": "r", "status": "in_progress", "output": []}}),
        ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                        "item": {"type": "message", "id": "msg", "role":
                                                 "assistant", "content": []}}),
    ]
    events += [("response.output_text.delta", {"type": "response.output_text.delta",
                                               "output_index": 0, "content_index": 0,
                                               "item_id": "msg", "delta": t})
               for t in TOKENS]
    text = "".join(TOKENS)
    events += [
        ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0,
                                       "item": {"type": "message", "id": "msg", "role":
                                                "assistant", "content": [
                                                    {"type": "output_text", "text": text}]}}),
        ("response.completed", {"type": "response.completed", "response": {
            "id": "r", "status": "completed", "output": [],
            "usage": {"input_tokens": 3, "output_tokens": 9}}}),
    ]
    return _sse(events)


DECODERS: dict[str, tuple[Any, Any]] = {
    "anthropic": (AnthropicStreamDecoder, anthropic_body),
    "openai": (OpenAIStreamDecoder, openai_body),
    "openai-responses": (ResponsesStreamDecoder, responses_body),
}


def _deltas(events: list[StreamEvent]) -> list[StreamEvent]:
    return [e for e in events if isinstance(e, TextDelta | ThinkingDelta | ToolArgumentsDelta)]


@pytest.mark.parametrize("wire", sorted(DECODERS))
def test_a_body_read_at_once_gives_one_delta_a_block(wire: str) -> None:
    make, body = DECODERS[wire]
    events = make().feed(body())
    assert isinstance(events[-1], MessageCompleted), events[-1]
    deltas = _deltas(events)
    pieces = {(type(d).__name__, d.index): d for d in deltas}
    assert len(deltas) == len(pieces), "two deltas of one block in one read"
    texts = [d.delta if isinstance(d, ToolArgumentsDelta) else d.text for d in deltas]
    assert "".join(TOKENS) in texts


@pytest.mark.parametrize("wire", sorted(DECODERS))
@pytest.mark.parametrize("seed", range(8))
def test_any_reads_give_the_same_events_once_joined(wire: str, seed: int) -> None:
    """Cut anywhere, the events differ only in where the deltas of a block are cut: joined
    over the whole stream they are the whole body's events, one by one."""
    make, body = DECODERS[wire]
    data = body()
    whole = make().feed(data)
    rng = random.Random(seed)
    decoder = make()
    events: list[StreamEvent] = []
    reads = 0
    pos = 0
    while pos < len(data):
        step = rng.choice([1, 3, 17, 64, 300])
        batch = decoder.feed(data[pos : pos + step])
        for before, after in itertools.pairwise(batch):
            assert not (
                isinstance(before, TextDelta | ThinkingDelta | ToolArgumentsDelta)
                and type(before) is type(after)
                and before.index == after.index  # type: ignore[union-attr]
            ), f"two deltas of one block in one read: {before!r}, {after!r}"
        events += batch
        pos += step
        reads += 1
    assert reads > 1
    assert coalesce_deltas(events) == whole
