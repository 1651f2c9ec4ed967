"""Differential test: greenroom's stream decoders against the official SDKs' accumulators.

A seeded generator builds model responses (text, thinking, tool calls with unicode
arguments), renders them in each wire format with the awkward parts servers produce —
argument JSON cut at any character (inside ``\\uXXXX`` escapes too), tool calls interleaved
by index, keep-alive comments and pings, an error mid-stream, the body cut at any byte — and
splits the body at random byte offsets (inside multi-byte characters). The same bytes go to
greenroom's decoder and to the SDK's own SSE decoder and accumulator (``anthropic``'s
``accumulate_event``, ``openai``'s ``ChatCompletionStreamState``), the oracle.

Where the two must differ, the difference is greenroom's documented choice (README,
"Provider streams"): a stream that ends without its terminal event is a failure (the SDKs
hand back what they have), and a tool call cut by the output limit is reported truncated,
never parsed. Everything the two both accept must agree exactly.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest
from anthropic._models import construct_type as anthropic_construct
from anthropic._streaming import SSEDecoder as AnthropicSSE
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai._models import construct_type as openai_construct
from openai._streaming import SSEDecoder as OpenAISSE
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder
from greenroom.protocols.content import TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.openai_codec import OpenAIStreamDecoder
from greenroom.protocols.stream import (
    BlockCompleted,
    MessageCompleted,
    StreamEvent,
    StreamFailed,
    TextDelta,
    ThinkingDelta,
    ToolCallTruncated,
)

CASES = 1500
"""Cases per wire format (each decoded in one random chunking): the trial's bound. No
wall-clock limit: on a busy machine the same cases take longer, and every one still runs."""

ALPHABET = (
    "abcdefghij klmnop qrstuvwxyz ABCXYZ 0123456789 .,;:!? \"'\\/ {}[] \n\t"
    "éüßñøç — \u201c\u201d\u2018\u2019 … 中文字 日本語 한국어 Ωπ∑ 😀👋🏽🎉 ͡ ‍"
)


def random_text(rng: random.Random, low: int = 0, high: int = 40) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(low, high)))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 3 and roll < 0.2:
        return {random_text(rng, 1, 8): random_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if depth < 3 and roll < 0.35:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if roll < 0.7:
        return random_text(rng)
    if roll < 0.8:
        return rng.randint(-(10**6), 10**6)
    if roll < 0.88:
        return rng.choice([True, False, None])
    return rng.choice([0.5, -2.25, 1e10, 3.0])


def random_arguments(rng: random.Random) -> dict[str, Any]:
    return {random_text(rng, 1, 10): random_value(rng) for _ in range(rng.randint(0, 4))}


def cut_pieces(rng: random.Random, text: str, most: int = 6) -> list[str]:
    """``text`` split at random character positions (anywhere: inside escapes too)."""
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(0, most), len(text) - 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def rechunk(rng: random.Random, body: bytes) -> list[bytes]:
    """``body`` split at random byte offsets (inside UTF-8 sequences and CRLF-free lines)."""
    pieces, pos = [], 0
    while pos < len(body):
        size = rng.choice([1, 2, 3, 7, 16, 64, 512, 4096])
        pieces.append(body[pos : pos + size])
        pos += size
    return pieces


def random_blocks(rng: random.Random) -> list[tuple[str, Any]]:
    blocks: list[tuple[str, Any]] = []
    if rng.random() < 0.3:
        blocks.append(("thinking", (random_text(rng, 1), f"sig-{rng.randint(0, 10**9)}")))
    if rng.random() < 0.8:
        blocks.append(("text", random_text(rng, 0, 60)))
    for n in range(rng.choice([0, 0, 1, 2, 3])):
        blocks.append(("tool", (f"call_{n}_{rng.randint(0, 10**6)}", f"tool_{n}",
                                random_arguments(rng))))
    return blocks


def greenroom_decode(decoder: Any, pieces: list[bytes]) -> list[StreamEvent]:
    events: list[StreamEvent] = []
    for piece in pieces:
        events.extend(decoder.feed(piece))
    events.extend(decoder.end_of_stream())
    return events


def completed_blocks(events: list[StreamEvent]) -> list[Any]:
    return [e.block for e in sorted(
        (e for e in events if isinstance(e, BlockCompleted)), key=lambda e: e.index)]


def streamed_text(events: list[StreamEvent]) -> tuple[str, str]:
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    thinking = "".join(e.text for e in events if isinstance(e, ThinkingDelta))
    return text, thinking


# --------------------------------------------------------------------------- Anthropic


def anthropic_events(rng: random.Random) -> list[bytes]:
    """One response as SSE events (bytes each), with pings and comments between them."""
    blocks = random_blocks(rng)
    stop = "tool_use" if any(k == "tool" for k, _ in blocks) else rng.choice(
        ["end_turn", "end_turn", "stop_sequence", "max_tokens"])
    if rng.random() < 0.1:
        stop = "max_tokens"
    out: list[dict[str, Any]] = [{"type": "message_start", "message": {
        "id": "msg_x", "type": "message", "role": "assistant", "content": [], "model": "m",
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": rng.randint(1, 10**5), "output_tokens": 1,
                  "cache_read_input_tokens": rng.randint(0, 999),
                  "cache_creation_input_tokens": rng.randint(0, 999)}}}]
    for index, (kind, payload) in enumerate(blocks):
        if kind == "text":
            out.append({"type": "content_block_start", "index": index,
                        "content_block": {"type": "text", "text": ""}})
            out += [{"type": "content_block_delta", "index": index,
                     "delta": {"type": "text_delta", "text": p}}
                    for p in cut_pieces(rng, payload) if p]
        elif kind == "thinking":
            text, signature = payload
            out.append({"type": "content_block_start", "index": index,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
            out += [{"type": "content_block_delta", "index": index,
                     "delta": {"type": "thinking_delta", "thinking": p}}
                    for p in cut_pieces(rng, text) if p]
            if rng.random() < 0.3:  # a superseded signature first: the last one stands
                out.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": "signature_delta", "signature": "stale"}})
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": signature}})
        else:
            call_id, name, arguments = payload
            raw = json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
            out.append({"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": call_id, "name": name, "input": {}}})
            out += [{"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": p}}
                    for p in cut_pieces(rng, raw, 12) if p]
        out.append({"type": "content_block_stop", "index": index})
    out.append({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": rng.randint(1, 5000)}})
    out.append({"type": "message_stop"})
    if rng.random() < 0.1:
        cut = rng.randint(1, len(out) - 1)
        out[cut:] = [{"type": "error", "error": {"type": "overloaded_error",
                                                   "message": "Overloaded"}}]
    body: list[bytes] = []
    for event in out:
        if rng.random() < 0.1:
            body.append(b'event: ping\ndata: {"type": "ping"}\n\n')
        if rng.random() < 0.05:
            body.append(b": keep-alive\n\n")
        body.append(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    return body


def anthropic_oracle(pieces: list[bytes]) -> tuple[Any, bool, bool]:
    """(snapshot, saw message_stop, saw an error event) from the SDK's own decoding."""
    snapshot: Any = None
    bufs: dict[int, bytes] = {}
    stopped = errored = False
    for sse in AnthropicSSE().iter_bytes(iter(pieces)):
        if sse.event == "error":
            errored = True  # the SDK's stream raises here
            break
        if sse.event == "ping":
            continue
        event = anthropic_construct(type_=RawMessageStreamEvent, value=json.loads(sse.data))
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
        if sse.event == "message_stop":
            stopped = True
            break
    return snapshot, stopped, errored


def compare_anthropic(rng: random.Random) -> None:
    events_bytes = anthropic_events(rng)
    body = b"".join(events_bytes)
    if rng.random() < 0.25:
        body = body[: rng.randint(0, len(body))]
    pieces = rechunk(rng, body)
    ours = greenroom_decode(AnthropicStreamDecoder(), pieces)
    snapshot, stopped, errored = anthropic_oracle(pieces)
    last = ours[-1]
    if errored:
        assert isinstance(last, StreamFailed) and last.error.kind == "timeout"
    if not stopped:
        # Choice: a stream without message_stop is a failure, never an answer.
        assert isinstance(last, StreamFailed)
        text, thinking = streamed_text(ours)
        if snapshot is not None:
            want = "".join(b.text for b in snapshot.content if b.type == "text")
            assert text == want
            assert thinking == "".join(
                b.thinking for b in snapshot.content if b.type == "thinking")
        return
    assert isinstance(last, MessageCompleted), last
    assert last.stop_reason == snapshot.stop_reason
    usage = snapshot.usage
    assert (last.usage.input, last.usage.output, last.usage.cache_read,
            last.usage.cache_write) == (usage.input_tokens, usage.output_tokens,
                                        usage.cache_read_input_tokens,
                                        usage.cache_creation_input_tokens)
    truncated = [e for e in ours if isinstance(e, ToolCallTruncated)]
    expected: list[Any] = []
    for block in snapshot.content:
        if block.type == "text":
            expected.append(TextBlock(text=block.text))
        elif block.type == "thinking":
            expected.append(ThinkingBlock(text=block.thinking, signature=block.signature or None))
        elif block.type == "tool_use":
            if truncated and truncated[0].call_id == block.id:
                # Choice: with max_tokens the last call is truncated and never runs.
                assert json.loads(truncated[0].partial_arguments or "{}") == block.input
                continue
            expected.append(ToolCallBlock(id=block.id, name=block.name, arguments=block.input))
    assert completed_blocks(ours) == expected


# --------------------------------------------------------------------------- OpenAI


def openai_chunks(rng: random.Random) -> list[bytes]:
    blocks = random_blocks(rng)
    tools = [payload for kind, payload in blocks if kind == "tool"]
    finish = "tool_calls" if tools else rng.choice(["stop", "stop", "length"])
    if tools and rng.random() < 0.15:
        finish = "length"  # the output limit struck while the calls were streaming
    # The one call sent as a legacy ``function_call``.
    legacy = len(tools) == 1 and finish != "length" and rng.random() < 0.3
    if legacy:
        finish = "function_call"
    reasoning_key = rng.choice(["reasoning_content", "reasoning"])
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    empty_finish: Any = "" if rng.random() < 0.3 else None
    every_usage = rng.random() < 0.2
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    for kind, payload in blocks:
        if kind == "text":
            deltas += [{"content": p} for p in cut_pieces(rng, payload) if p]
        elif kind == "thinking":
            deltas += [{reasoning_key: p} for p in cut_pieces(rng, payload[0]) if p]
    # Tool call fragments, interleaved by index while keeping each call's own order.
    queues: list[list[dict[str, Any]]] = []
    for index, (call_id, name, arguments) in enumerate(tools):
        raw = json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
        parts = cut_pieces(rng, raw, 12)
        if legacy:
            queues.append([{"function_call": {"name": name, "arguments": parts[0]}}]
                          + [{"function_call": {"arguments": p}} for p in parts[1:]])
            continue
        queue = [{"index": index, "id": call_id, "type": "function",
                  "function": {"name": name, "arguments": parts[0]}}]
        queue += [{"index": index, "function": {"arguments": p}} for p in parts[1:]]
        queues.append(queue)
    started = 0
    while any(queues):
        # Calls open in index order (as servers send them); their fragments interleave.
        open_queues = [q for q in queues[: started + 1] if q]
        queue = rng.choice(open_queues)
        if queue is queues[min(started, len(queues) - 1)] and started < len(queues):
            started += 1
        fragment = queue.pop(0)
        deltas.append(fragment if legacy else {"tool_calls": [fragment]})
    prompt = rng.randint(1, 10**5)
    chunks: list[dict[str, Any]] = []
    for n, delta in enumerate(deltas):
        chunk: dict[str, Any] = {**base, "choices": [
            {"index": 0, "delta": delta, "finish_reason": empty_finish}]}
        if every_usage:
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": n,
                              "total_tokens": prompt + n}
        chunks.append(chunk)
    completion = rng.randint(len(deltas), 5000)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": rng.randint(0, prompt)}}
    where = rng.choice(["finish", "final"])
    finish_chunk: dict[str, Any] = {**base, "choices": [
        {"index": 0, "delta": {}, "finish_reason": finish}]}
    if where == "finish" or every_usage:
        finish_chunk["usage"] = usage
    chunks.append(finish_chunk)
    if where == "final":
        chunks.append({**base, "choices": [], "usage": usage})
    body = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks]
    body.append(b"data: [DONE]\n\n")
    if rng.random() < 0.1:
        cut = rng.randint(1, len(body) - 1)
        body[cut:] = [b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n']
    for _ in range(rng.choice([0, 0, 1, 3])):
        body.insert(rng.randint(0, len(body)), b": keep-alive\n\n")
    return body


def openai_oracle(pieces: list[bytes]) -> tuple[Any, bool, bool]:
    """(final completion or None, saw [DONE], saw an error chunk)."""
    state = ChatCompletionStreamState()
    seen = done = errored = False
    for sse in OpenAISSE().iter_bytes(iter(pieces)):
        if sse.data.startswith("[DONE]"):
            done = True
            break
        data = json.loads(sse.data)
        if data.get("error"):
            errored = True  # the SDK's stream raises here
            break
        state.handle_chunk(openai_construct(type_=ChatCompletionChunk, value=data))
        seen = True
    return (state.current_completion_snapshot if seen else None), done, errored


def reasoning_of(message: Any) -> str:
    extra = message.model_extra or {}
    return str(extra.get("reasoning_content") or extra.get("reasoning") or "")


def compare_openai(rng: random.Random) -> None:
    body = b"".join(openai_chunks(rng))
    if rng.random() < 0.25:
        body = body[: rng.randint(0, len(body))]
    pieces = rechunk(rng, body)
    ours = greenroom_decode(OpenAIStreamDecoder(), pieces)
    snapshot, done, errored = openai_oracle(pieces)
    last = ours[-1]
    if errored:
        assert isinstance(last, StreamFailed) and last.error.kind == "timeout"
        return
    choice = snapshot.choices[0] if snapshot is not None and snapshot.choices else None
    finish = choice.finish_reason if choice is not None else None
    if not done and not finish:
        # Choice: no [DONE] and no finish reason is a failure (a dropped connection).
        assert isinstance(last, StreamFailed)
        text, thinking = streamed_text(ours)
        if choice is not None:
            assert text == (choice.message.content or "")
            assert thinking == reasoning_of(choice.message)
        return
    assert isinstance(last, MessageCompleted), last
    assert choice is not None
    message = choice.message
    stop = {"stop": "end_turn", "tool_calls": "tool_use", "function_call": "tool_use",
            "length": "max_tokens"}[finish]
    calls = message.tool_calls or []
    if stop == "end_turn" and calls:
        stop = "tool_use"
    assert last.stop_reason == stop
    if snapshot.usage is not None:
        cached = snapshot.usage.prompt_tokens_details
        cached_tokens = cached.cached_tokens if cached is not None else 0
        assert last.usage.output == snapshot.usage.completion_tokens
        assert last.usage.input + last.usage.cache_read == snapshot.usage.prompt_tokens
        assert last.usage.cache_read == (cached_tokens or 0)
    expected: list[Any] = []
    reasoning = reasoning_of(message)
    if reasoning:
        expected.append(ThinkingBlock(text=reasoning))
    if message.content:
        expected.append(TextBlock(text=message.content))
    if message.function_call is not None:
        # Choice: the legacy call gets an id (the SDK's has none), derived from the response.
        (block,) = [b for b in completed_blocks(ours) if isinstance(b, ToolCallBlock)]
        assert block.id == "call_chatcmpl-x"
        function = message.function_call
        expected.append(ToolCallBlock(id=block.id, name=function.name,
                                      arguments=json.loads(function.arguments or "{}")))
    truncated = [e for e in ours if isinstance(e, ToolCallTruncated)]
    if finish == "length":
        # Choice: every call open at the output limit is truncated and never runs.
        assert [(t.call_id, t.partial_arguments) for t in truncated] == [
            (c.id, c.function.arguments) for c in calls]
    else:
        expected += [ToolCallBlock(id=c.id, name=c.function.name,
                                   arguments=json.loads(c.function.arguments or "{}"))
                     for c in calls]
    assert completed_blocks(ours) == expected


# --------------------------------------------------------------------------- the runs


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
def test_decoders_agree_with_the_sdk_accumulators(wire: str) -> None:
    compare = compare_anthropic if wire == "anthropic" else compare_openai
    for seed in range(CASES):
        rng = random.Random(f"{wire}-{seed}")
        try:
            compare(rng)
        except AssertionError as exc:
            raise AssertionError(f"{wire} case {seed} diverges: {exc}") from exc
