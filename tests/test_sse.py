"""SSE decoder: field rules, line endings, and input split at every byte offset."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from greenroom.protocols.sse import SSEDecoder, SSEEvent

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SSE_FILES = sorted(FIXTURES.glob("**/*.sse"))


def decode(*chunks: bytes) -> tuple[list[SSEEvent], bool]:
    dec = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += dec.feed(chunk)
    events += dec.close()
    return events, dec.truncated


def ev(data: str, event: str | None = None) -> SSEEvent:
    return SSEEvent(event=event, data=data)


def test_event_and_data_fields() -> None:
    events, truncated = decode(b"event: greet\ndata: hello\n\ndata: second\n\n")
    assert events == [ev("hello", "greet"), ev("second")]
    assert not truncated


def test_multiple_data_lines_are_joined_with_newline() -> None:
    events, _ = decode(b"data: a\ndata:\ndata: c\n\n")
    assert events == [ev("a\n\nc")]


def test_only_one_space_after_colon_is_removed() -> None:
    events, _ = decode(b"data:x\n\ndata:  two spaces\n\nevent:  e\ndata: y\n\n")
    assert events == [ev("x"), ev(" two spaces"), ev("y", " e")]


def test_comments_and_unknown_fields_are_ignored() -> None:
    events, _ = decode(b": keep-alive\nretry: 10\nfoo: bar\ndata: d\n: mid\n\n: only a comment\n\n")
    assert events == [ev("d")]


def test_field_without_colon_is_a_field_name_with_empty_value() -> None:
    events, _ = decode(b"data\n\nevent\ndata: z\n\n")
    assert events == [ev(""), ev("z")]


def test_event_without_data_is_not_dispatched_and_type_resets() -> None:
    events, _ = decode(b"event: lonely\n\ndata: next\n\n")
    assert events == [ev("next")]


def test_id_field_is_kept() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"id: 42\ndata: x\n\n") == [ev("x")]
    assert dec.last_event_id == "42"


@pytest.mark.parametrize(
    "body",
    [
        b"event: e\r\ndata: a\r\ndata: b\r\n\r\n",
        b"event: e\rdata: a\rdata: b\r\r",
        b"event: e\r\ndata: a\rdata: b\n\r\n",
    ],
    ids=["crlf", "cr", "mixed"],
)
def test_line_endings(body: bytes) -> None:
    events, truncated = decode(body)
    assert events == [ev("a\nb", "e")]
    assert not truncated


def test_cr_then_lf_in_next_chunk_is_one_line_end() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\n") == []  # the LF completes the CRLF; no blank line yet
    assert dec.feed(b"\r") == [ev("a")]
    assert dec.feed(b"\ndata: b\r\n\r\n") == [ev("b")]


def test_two_crs_are_two_line_ends() -> None:
    events, _ = decode(b"data: a\r", b"\rdata: b\r\r")
    assert events == [ev("a"), ev("b")]


def test_leading_bom_is_stripped_even_when_split() -> None:
    events, _ = decode(b"\xef", b"\xbb", b"\xbfdata: x\n\n")
    assert events == [ev("x")]


def test_leading_bom_is_stripped_before_whole_events_in_the_first_chunk() -> None:
    """A whole body in one chunk (the first): the BOM goes, every event is decoded."""
    events, truncated = decode(b"\xef\xbb\xbfevent: a\ndata: x\n\ndata: y\n\nevent: b\ndata: z\n\n")
    assert events == [ev("x", "a"), ev("y"), ev("z", "b")]
    assert not truncated


def test_a_bom_after_the_start_is_not_stripped() -> None:
    """Only the stream's first bytes may be a BOM: later, it is part of a field name."""
    events, _ = decode(b"data: a\n\n", b"\xef\xbb\xbfdata: b\n\ndata: c\n\n")
    assert events == [ev("a"), ev("c")]


def test_invalid_utf8_is_replaced() -> None:
    events, _ = decode(b"data: a\xffb\n\n")
    assert events == [ev("a\ufffdb")]


def test_incomplete_trailing_event_is_discarded_and_reported() -> None:
    events, truncated = decode(b"data: done\n\ndata: half")
    assert events == [ev("done")]
    assert truncated

    events, truncated = decode(b"data: done\n\ndata: whole line but no blank line\n")
    assert events == [ev("done")]
    assert truncated

    events, truncated = decode(b"data: done\n\nevent: x\n")
    assert truncated


def test_clean_end_and_trailing_comment_are_not_truncation() -> None:
    assert decode(b"data: a\n\n") == ([ev("a")], False)
    assert decode(b"data: a\n\n: bye") == ([ev("a")], False)
    assert decode(b"") == ([], False)


def test_feed_after_close_is_an_error() -> None:
    dec = SSEDecoder()
    dec.close()
    with pytest.raises(RuntimeError):
        dec.feed(b"data: x\n\n")


def test_feed_raw_matches_feed() -> None:
    body = b"event: a\ndata: 1\n\ndata: 2\n\n"
    assert SSEDecoder().feed_raw(body) == [("a", "1"), (None, "2")]


TRICKY = (
    "\ufeffevent: first\r\ndata: Grüße — 👋\r\n\r\n"
    ": comment 😀\n"
    "data: line one\rdata:line two\r\r"
    "event: third\ndata: São\n\n"
    "data: tail 🎉"
).encode()
TRICKY_EVENTS = [ev("Grüße — 👋", "first"), ev("line one\nline two"), ev("São", "third")]


def test_tricky_stream_whole() -> None:
    assert decode(TRICKY) == (TRICKY_EVENTS, True)


def test_tricky_stream_split_in_two_at_every_offset() -> None:
    for cut in range(len(TRICKY) + 1):
        assert decode(TRICKY[:cut], TRICKY[cut:]) == (TRICKY_EVENTS, True), cut


def test_tricky_stream_split_in_three_at_many_offsets() -> None:
    n = len(TRICKY)
    for a in range(0, n + 1, 3):
        for b in range(a, n + 1, 5):
            assert decode(TRICKY[:a], TRICKY[a:b], TRICKY[b:])[0] == TRICKY_EVENTS, (a, b)


def test_tricky_stream_one_byte_at_a_time() -> None:
    assert decode(*(TRICKY[i : i + 1] for i in range(len(TRICKY)))) == (TRICKY_EVENTS, True)


@pytest.mark.parametrize("path", SSE_FILES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_fixture_files_decode_the_same_in_random_chunks(path: Path) -> None:
    body = path.read_bytes()
    whole = decode(body)
    assert whole[0], "fixture produced no events"
    rng = random.Random(1234)
    for _ in range(30):
        chunks, pos = [], 0
        while pos < len(body):
            size = rng.randint(1, 17)
            chunks.append(body[pos : pos + size])
            pos += size
        assert decode(*chunks) == whole


@pytest.mark.parametrize(
    "path",
    sorted(FIXTURES.glob("anthropic/*.sse")),
    ids=lambda p: p.name,
)
def test_anthropic_fixture_event_names_match_json_type(path: Path) -> None:
    events, truncated = decode(path.read_bytes())
    for event in events:
        assert json.loads(event.data)["type"] == event.event
    assert truncated == (path.name == "truncated_no_message_stop.sse")


def test_ping_count_of_ping_fixture() -> None:
    events, _ = decode((FIXTURES / "anthropic" / "ping_interleaved.sse").read_bytes())
    assert sum(e.event == "ping" for e in events) == 9


def test_at_event_boundary_only_between_complete_events() -> None:
    """What a caller may skip the decoder for: nothing pending, after the start."""
    dec = SSEDecoder()
    assert not dec.at_event_boundary  # the start (a BOM) is the decoder's to handle
    dec.feed(b"event: a\ndata: 1\n\n")
    assert dec.at_event_boundary
    dec.feed(b"event: b\ndata")
    assert not dec.at_event_boundary
    dec.feed(b": 2\n\n")
    assert dec.at_event_boundary
    dec.feed(b"data: 3\r\n\r")
    assert not dec.at_event_boundary  # a LF may still belong to that CR
    dec.feed(b"\n")
    assert dec.at_event_boundary
    dec.close()
    assert not dec.at_event_boundary
