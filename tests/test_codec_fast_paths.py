"""The hot-path shortcuts of the SSE decoder and the Anthropic stream decoder must give
exactly what the general paths give, whatever the chunking and the string contents."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest

from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder, _fast_delta
from greenroom.protocols.sse import SSEDecoder
from greenroom.protocols.stream import coalesce_deltas

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
    # The reads decide only where the text is cut (R-RUN-2): read at once, it is one delta.
    assert coalesce_deltas(pieces) == whole
    texts = [e.text for e in whole if type(e).__name__ == "TextDelta"]
    assert texts == ["".join(TEXTS)]
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


def _event(name: str, payload: Any) -> bytes:
    """One SSE event in the API's compact shape; a str payload is sent as it is."""
    data = payload if isinstance(payload, str) else json.dumps(
        payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode("utf-8", "surrogatepass")


def _delta(index: int, kind: str, value: str) -> bytes:
    key = {"text_delta": "text", "input_json_delta": "partial_json",
           "thinking_delta": "thinking"}[kind]
    return _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                          "delta": {"type": kind, key: value}})


def _raw_delta(index: int, raw_string: bytes) -> bytes:
    """A text delta whose JSON string is ``raw_string`` byte for byte (maybe invalid)."""
    return (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
            b'"delta":{"type":"text_delta","text":"%s"}}\n\n' % (index, raw_string))


_START = _event("message_start", {"type": "message_start", "message": {
    "id": "m", "type": "message", "role": "assistant", "content": [], "model": "x",
    "usage": {"input_tokens": 3, "output_tokens": 1}}})


def _block(index: int, block: dict[str, Any]) -> bytes:
    return _event("content_block_start",
                  {"type": "content_block_start", "index": index, "content_block": block})


def _stop(index: int) -> bytes:
    return _event("content_block_stop", {"type": "content_block_stop", "index": index})


_END = _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                                "usage": {"output_tokens": 9}}) + _event(
    "message_stop", {"type": "message_stop"})
_TEXT = {"type": "text", "text": ""}
_TOOL = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}
_THINK = {"type": "thinking", "thinking": ""}

READS: dict[str, list[list[bytes]]] = {
    # Each scenario is a list of network reads, each a list of events.
    "text": [[_START, _block(0, _TEXT)],
             [_delta(0, "text_delta", t) for t in TEXTS],
             [_delta(0, "text_delta", "more"), _event("ping", {"type": "ping"}),
              _delta(0, "text_delta", "after ping")],
             [_stop(0), _END]],
    "escapes and bad strings": [
        [_START, _block(0, _TEXT)],
        [_delta(0, "text_delta", "lone \ud800 surrogate"), _raw_delta(0, b"esc \\u00e9\\n"),
         _raw_delta(0, b"bad \xff\xfe utf-8"), _raw_delta(0, b"\\ud83d\\ude00 pair"),
         _raw_delta(0, b"escaped lone \\udc00 surrogate")],
        [_raw_delta(0, b"an invalid \\q escape"), _delta(0, "text_delta", "never")],
        [_stop(0), _END]],
    "raw control character": [
        [_START, _block(0, _TEXT)], [_raw_delta(0, b"tab\there")], [_stop(0), _END]],
    "tools and thinking": [
        [_START, _block(0, _THINK), _delta(0, "thinking_delta", "hmm")],
        [_delta(0, "thinking_delta", " é"), _stop(0), _block(1, _TOOL)],
        [_delta(1, "input_json_delta", '{"key":'), _delta(1, "input_json_delta", ' "v\\"1"}')],
        [_stop(1), _END]],
    "a block that is not open, a kind that does not match": [
        [_START, _block(0, _TEXT)],
        [_delta(0, "text_delta", "ok"), _delta(0, "input_json_delta", "{}")],
        [_delta(4, "text_delta", "nobody")], [_stop(0), _END]],
    "a stopped call waits for the next event": [
        [_START, _block(1, _TEXT), _block(0, _TOOL), _delta(0, "input_json_delta", "{}"),
         _stop(0)],
        [_delta(1, "text_delta", "this delta completes call 0 first")],
        [_stop(1), _END]],
}


def _decode(reads: list[bytes]) -> list[Any]:
    decoder = AnthropicStreamDecoder()
    events: list[Any] = []
    for data in reads:
        events += decoder.feed(data)
    return events


@pytest.mark.parametrize("scenario", sorted(READS))
def test_whole_delta_events_decode_as_the_general_path_does(scenario: str) -> None:
    """The byte-level path for a read that begins with whole delta events gives exactly
    what the SSE decoder and the per-event paths give: the same reads with CRLF line ends
    (which only the general path takes), the body in one piece, one event per read. Lone
    surrogates, escaped or raw, come out replaced on every path (R-SEC-1)."""
    reads = READS[scenario]
    by_read = _decode([b"".join(events) for events in reads])
    crlf = _decode([b"".join(events).replace(b"\n", b"\r\n") for events in reads])
    whole = _decode([b"".join(b"".join(events) for events in reads)])
    one_by_one = _decode([event for events in reads for event in events])
    assert by_read == crlf
    assert coalesce_deltas(by_read) == coalesce_deltas(whole) == coalesce_deltas(one_by_one)
    assert type(by_read[-1]).__name__ in ("MessageCompleted", "StreamFailed")


def test_a_read_of_whole_delta_events_never_reaches_the_sse_decoder() -> None:
    """The path exists: a read of deltas at an event boundary is decoded without the
    SSE decoder, and a read that is not goes through it."""
    decoder = AnthropicStreamDecoder()
    decoder.feed(_START + _block(0, _TEXT))
    deltas = b"".join(_delta(0, "text_delta", t) for t in ("a", " b", " \u00e9"))
    with mock.patch.object(SSEDecoder, "feed_columns", side_effect=AssertionError):
        events = decoder.feed(deltas)
    assert [e.text for e in events] == ["a b \u00e9"]  # one read, one delta (R-RUN-2)
    with mock.patch.object(SSEDecoder, "feed_columns", side_effect=AssertionError), \
            pytest.raises(AssertionError):
        decoder.feed(_event("ping", {"type": "ping"}))
