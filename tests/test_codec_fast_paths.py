"""The hot-path shortcuts of the SSE decoder and the Anthropic stream decoder must give
exactly what the general paths give, whatever the chunking and the string contents."""

from __future__ import annotations

import json

import pytest

from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder, _fast_delta
from greenroom.protocols.sse import SSEDecoder

TEXTS = ["plain ", "", 'quote " and \\ backslash', "tab\tnew\nline", "é中文😀", "\u2028",
         '":"', "}}"]


def _body(texts: list[str], index: int = 0) -> bytes:
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "m", "type": "message", "role": "assistant", "content": [],
            "model": "x", "usage": {"input_tokens": 3, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": index,
                                 "content_block": {"type": "text", "text": ""}}),
    ]
    events += [("content_block_delta", {"type": "content_block_delta", "index": index,
                                        "delta": {"type": "text_delta", "text": t}})
               for t in texts]
    events += [
        ("ping", {"type": "ping"}),
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 9}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(
        f"event: {n}\ndata: {json.dumps(d, separators=(',', ':'), ensure_ascii=False)}\n\n"
        .encode() for n, d in events)


@pytest.mark.parametrize("index", [0, 12])
@pytest.mark.parametrize("step", [1, 7, 64, 100_000])
def test_chunking_does_not_change_events(index: int, step: int) -> None:
    body = _body(TEXTS, index)
    whole = AnthropicStreamDecoder().feed(body)
    dec = AnthropicStreamDecoder()
    pieces = []
    for i in range(0, len(body), step):
        pieces += dec.feed(body[i:i + step])
    assert pieces == whole
    texts = [e.text for e in whole if type(e).__name__ == "TextDelta"]
    assert texts == [t for t in TEXTS if t]
    assert type(whole[-1]).__name__ == "MessageCompleted"


@pytest.mark.parametrize("text", [
    '{"type":"content_block_delta","index":01,"delta":{"type":"text_delta","text":"a"}}',
    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}x',
    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a","x":1}}',
    '{"type":"content_block_delta","index":0,"delta":{"type":"citations_delta","text":"a"}}',
    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\\q"}}',
    '{"type":"content_block_delta","index":',
    '{"type":"content_block_delta","index":0',
])
def test_fast_delta_declines_what_it_does_not_know(text: str) -> None:
    assert _fast_delta(text) is None


def test_fast_delta_unescapes() -> None:
    raw = json.dumps({"type": "content_block_delta", "index": 3,
                      "delta": {"type": "input_json_delta", "partial_json": '{"k": "\\u00e9'}},
                     separators=(",", ":"))
    assert _fast_delta(raw) == (3, "tool_call", '{"k": "\\u00e9')


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_sse_block_path_matches_line_path(step: int) -> None:
    stream = (b"\xef\xbb\xbfevent: a\ndata: 1\n\n: comment\ndata: 2\n\nevent: b\ndata: x\ndata: y"
              b"\n\nid: 7\nevent:c\ndata:z\n\n\n\nevent: ev:il\ndata: q\n\ndata: tail")
    expected = SSEDecoder()
    want = []
    for line in stream.split(b"\n"):  # one line per feed: never the block path
        want += expected.feed_raw(line + b"\n")
    dec = SSEDecoder()
    got = []
    for i in range(0, len(stream), step):
        got += dec.feed_raw(stream[i:i + step])
    got += dec.feed_raw(b"\n")
    assert got == want
    assert dec.last_event_id == "7"
