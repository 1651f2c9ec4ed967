"""The trace file format (pure): encoding, forgiving parsing, seq checks, file names."""

from __future__ import annotations

import json

import pytest

from greenroom.protocols import converter
from greenroom.protocols.content import (
    ImageBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from greenroom.protocols.outputs import (
    ModelMsg,
    Output,
    PartialText,
    TaskEnd,
    TaskStart,
    TokenUsageOutput,
    UserMsg,
)
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import (
    TraceLineError,
    UsageRow,
    cut_to_fit,
    encode_record,
    fit_images,
    fit_model_block,
    fit_partial,
    input_size,
    parse_trace,
    record_size,
    trace_file_name,
    trace_file_number,
)

S, R = "s1", "r1"


def sample_records() -> list[Output]:
    return [
        UserMsg(session_id=S, run_id=R, seq=1, kind="prompt", content=(TextBlock(text="hi"),)),
        TaskStart(session_id=S, run_id=R, seq=2, input_seq=1),
        ModelMsg(
            session_id=S,
            run_id=R,
            seq=3,
            turn=1,
            block=ToolCallBlock(id="c1", name="lookup", arguments={"key": "k\u2028v"}),
        ),
        TokenUsageOutput(
            session_id=S, run_id=R, seq=4, turn=1, request=TokenUsage(input=10, output=5)
        ),
        TaskEnd(
            session_id=S,
            run_id=R,
            seq=5,
            status="completed",
            turns=1,
            usage=TokenUsage(input=10, output=5),
            wall_ms=12,
        ),
    ]


def encode_all(records: list[Output]) -> list[str]:
    return [encode_record(r) for r in records]


def test_encode_record_is_converter_json_plus_newline() -> None:
    for record in sample_records():
        line = encode_record(record)
        assert line == converter.to_json(record) + "\n"
        assert line.count("\n") == 1
        assert json.loads(line)["type"] == type(record).TYPE


def test_encode_refuses_live_only_and_seqless_outputs() -> None:
    with pytest.raises(ValueError, match="live-only"):
        encode_record(PartialText(session_id=S, run_id=R, index=0, text="x"))
    with pytest.raises(ValueError, match="seq"):
        encode_record(TaskStart(session_id=S, run_id=R, input_seq=None))


@pytest.mark.parametrize("as_bytes", [False, True])
def test_round_trip(as_bytes: bool) -> None:
    records = sample_records()
    text = "".join(encode_all(records))
    result = parse_trace(text.encode() if as_bytes else text, file="t.jsonl")
    assert result.errors == []
    assert result.records == records


def test_corrupt_line_in_the_middle_is_reported_and_skipped() -> None:
    lines = encode_all(sample_records())
    lines.insert(2, '{"type": "task_start", "session_id": \n')
    result = parse_trace("".join(lines), file="sess/trace_001.jsonl")
    assert [r.seq for r in result.records] == [1, 2, 3, 4, 5]
    assert len(result.errors) == 1
    error = result.errors[0]
    assert (error.file, error.line) == ("sess/trace_001.jsonl", 3)
    assert "invalid JSON" in error.message
    assert str(error).startswith("sess/trace_001.jsonl:3: ")


def test_torn_final_line_is_reported_and_the_rest_read() -> None:
    lines = encode_all(sample_records())
    torn = lines[-1][: len(lines[-1]) // 2]
    result = parse_trace("".join(lines[:-1]) + torn, file="t.jsonl")
    assert [r.seq for r in result.records] == [1, 2, 3, 4]
    assert [(e.line, "torn final line" in e.message) for e in result.errors] == [(5, True)]


def test_complete_final_record_without_newline_is_accepted() -> None:
    text = "".join(encode_all(sample_records()))
    result = parse_trace(text.rstrip("\n"), file="t.jsonl")
    assert result.errors == []
    assert len(result.records) == 5


def test_torn_multibyte_character_spoils_only_its_line() -> None:
    data = "".join(encode_all(sample_records()[:2])).encode()
    last = encode_record(
        UserMsg(session_id=S, run_id=R, seq=3, kind="prompt", content=(TextBlock(text="é"),))
    ).encode()
    cut = last.index("é".encode()) + 1  # inside the two-byte character
    result = parse_trace(data + last[:cut], file="t.jsonl")
    assert [r.seq for r in result.records] == [1, 2]
    assert len(result.errors) == 1
    assert result.errors[0].line == 3
    assert "invalid UTF-8" in result.errors[0].message


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"type":"no_such_thing","session_id":"s1","run_id":"r1","seq":9}', "unknown type"),
        ('{"session_id":"s1","run_id":"r1","seq":9}', "unknown type"),
        ('{"type":"partial_text","session_id":"s1","run_id":"r1","index":0,"text":"x"}',
         "live-only"),
        ('{"type":"task_start","session_id":"s1","seq":9,"input_seq":1}', "run_id"),
        ('{"type":"request_begin","session_id":"s1","run_id":"r1","seq":9,"turn":"x",'
         '"attempt":1}', "invalid 'request_begin' record"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_records_are_reported_by_line(line: str, fragment: str) -> None:
    lines = encode_all(sample_records()[:2])
    text = lines[0] + line + "\n" + lines[1]
    result = parse_trace(text, file="t.jsonl")
    assert [r.seq for r in result.records] == [1, 2]
    assert len(result.errors) == 1
    assert result.errors[0].line == 2
    assert fragment in result.errors[0].message


def test_blank_lines_are_skipped_silently() -> None:
    lines = encode_all(sample_records()[:2])
    result = parse_trace(lines[0] + "\n  \n" + lines[1], file="t.jsonl")
    assert result.errors == []
    assert len(result.records) == 2


def test_seq_must_strictly_increase_but_records_are_kept() -> None:
    records = sample_records()
    reordered = [records[0], records[2], records[1], records[3], records[3]]
    result = parse_trace("".join(encode_all(reordered)), file="t.jsonl")
    assert [r.seq for r in result.records] == [1, 3, 2, 4, 4]
    assert [e.line for e in result.errors] == [3, 5]
    assert "seq 2 does not increase (previous record has seq 3)" in result.errors[0].message


def test_record_without_seq_is_reported_but_kept() -> None:
    line = converter.to_json(TaskStart(session_id=S, run_id=R, input_seq=None)) + "\n"
    result = parse_trace(line, file="t.jsonl")
    assert len(result.records) == 1
    assert result.errors == [TraceLineError(file="t.jsonl", line=1, message="record has no seq")]


def test_rotated_file_may_start_at_any_seq() -> None:
    records = [*sample_records()][2:]
    result = parse_trace("".join(encode_all(records)), file="trace_002.jsonl")
    assert result.errors == []


def test_trace_file_names() -> None:
    assert trace_file_name(1) == "trace_001.jsonl"
    assert trace_file_name(42) == "trace_042.jsonl"
    assert trace_file_name(1234) == "trace_1234.jsonl"
    for n in (1, 2, 99, 999, 1000, 123456):
        assert trace_file_number(trace_file_name(n)) == n
    for name in ("trace_000.jsonl", "trace_01.jsonl", "trace_001.json", "trace_abc.jsonl",
                 "xtrace_001.jsonl", "trace_001.jsonl.tmp", "usage.sqlite", ""):
        assert trace_file_number(name) is None
    with pytest.raises(ValueError):
        trace_file_name(0)


def test_usage_row_for_request() -> None:
    out = TokenUsageOutput(
        session_id=S, run_id=R, seq=4, turn=2, request=TokenUsage(input=3, cache_read=4)
    )
    row = UsageRow.for_request(out, at=1.5, provider="scripted", model="m")
    assert row == UsageRow(
        at=1.5,
        session_id=S,
        run_id=R,
        turn=2,
        kind="request",
        provider="scripted",
        model="m",
        usage=TokenUsage(input=3, cache_read=4),
    )


def test_cut_to_fit_keeps_the_most_of_a_text_whose_characters_take_several_bytes() -> None:
    """R-SEC-9: what fits is kept whole; a text of characters that take two to four bytes
    each in the record (``é``, a quote, an emoji) is cut where its block, with the marker,
    takes at most the limit and one more character would not fit."""
    assert cut_to_fit("short", 1000, "elsewhere") == "short"
    assert cut_to_fit("é" * 5000, None, None) == "é" * 5000
    text = 'é"😀' * 2000
    cut = cut_to_fit(text, 1000, "the trace of session s1")
    assert input_size((TextBlock(text=cut),)) <= 1000
    kept = cut.index("\n[cut: ")
    assert cut[:kept] == text[:kept]
    marker = cut[kept:]
    assert marker == (
        f"\n[cut: {len(text) - kept} of {len(text)} characters left out to fit one record of "
        "this session's trace (1000 bytes); the whole text is in the trace of session s1]"
    )
    one_more = text[: kept + 1] + marker.replace(str(len(text) - kept), str(len(text) - kept - 1))
    assert input_size((TextBlock(text=one_more),)) > 1000


def _image(i: int) -> ImageBlock:
    return ImageBlock(path=f"shot-{i:03d}.png", media_type="image/png", sha256="0" * 64)


def test_fit_images_shares_a_record_between_a_results_text_and_its_images() -> None:
    """R-SEC-9, R-TOOL-8: a result that fits is kept as it is; a short text with more images
    than fit keeps its text and its first images, in place, and a line saying how many
    were left out, within the limit, one more image not fitting; a long text beside a few
    images keeps them all and is given the rest to be cut to; both long, the text gets
    half of the record and the images, in order, the rest."""
    fits = (TextBlock(text="a"), _image(0))
    assert fit_images(fits, 1000).content == fits
    assert fit_images(fits, 1000).left_out is None

    many = (TextBlock(text="Shots:"), *(_image(i) for i in range(100)), TextBlock(text="end"))
    fit = fit_images(many, 4000)
    assert fit.text_room is None and fit.left_out is not None
    kept = fit.content[1:-1]
    assert 0 < len(kept) < 100 and kept == many[1 : 1 + len(kept)]
    assert (fit.content[0], fit.content[-1]) == (many[0], many[-1])
    assert fit.left_out.text == (
        f"[images cut: {100 - len(kept)} of 100 images left out, the last ones, to fit one "
        "record of this session's trace (4000 bytes)]"
    )
    assert input_size((*fit.content, fit.left_out)) <= 4000
    assert input_size((*fit.content, many[1 + len(kept)], fit.left_out)) > 4000

    long_text = (TextBlock(text="x" * 10_000), _image(0), _image(1))
    fit = fit_images(long_text, 4000)
    assert (fit.content, fit.left_out) == (long_text, None)
    assert fit.text_room is not None
    cut = TextBlock(text=cut_to_fit("x" * 10_000, fit.text_room, "a file"))
    assert 3900 < input_size((cut, *long_text[1:])) <= 4000

    both = (TextBlock(text="x" * 10_000), *(_image(i) for i in range(100)))
    fit = fit_images(both, 4000)
    assert fit.left_out is not None and fit.text_room is not None
    assert 2000 <= fit.text_room < 2200
    images = fit.content[1:]
    cut = TextBlock(text=cut_to_fit("x" * 10_000, fit.text_room, "a file"))
    assert input_size((cut, *images, fit.left_out)) <= 4000


def test_fit_model_block_splits_text_at_line_breaks_and_refuses_what_cannot_be_split() -> None:
    """R-SEC-9, R-CLUSTER-1: a block of the model's message that fits one record is kept
    as it is; text (and unsigned thinking) too large is split at line breaks, each piece
    within the record, the pieces joined by line breaks the whole text — escapes measured
    as the record holds them, an empty line and a last line break kept; a line longer than
    a record, signed or redacted thinking and a tool call are refused, naming the size."""
    fits = TextBlock(text="short")
    assert fit_model_block(fits, 100) == (fits,)

    text = "\n".join(["a" * 300, "", "\x01" * 100, "é" * 300, ""])
    pieces = fit_model_block(TextBlock(text=text), 800)
    assert isinstance(pieces, tuple) and len(pieces) == 3, pieces
    assert all(isinstance(b, TextBlock) and record_size(b) <= 800 for b in pieces)
    assert "\n".join(b.text for b in pieces if isinstance(b, TextBlock)) == text

    thought = ThinkingBlock(text=text)
    split = fit_model_block(thought, 800)
    assert isinstance(split, tuple) and all(type(b) is ThinkingBlock for b in split)
    assert "\n".join(b.text for b in split if isinstance(b, ThinkingBlock)) == text

    limit = "bytes one record of this session's trace carries"
    refused = {
        "text": TextBlock(text="a" * 1000),
        "thinking": ThinkingBlock(text=text, signature="s"),
        "redacted thinking": RedactedThinkingBlock(data="d" * 1000),
        "call of write": ToolCallBlock(id="c1", name="write", arguments={"text": text}),
    }
    for what, block in refused.items():
        assert fit_model_block(block, 800) == (
            f"the model's {what} takes {record_size(block)} bytes in the trace, more than "
            f"the 800 {limit}"
        )


def test_fit_partial_leaves_thinking_out_first_and_keeps_the_text_the_carry_over_shows() -> None:
    """R-ABORT-2, R-SEC-9: an interrupted message's partial output past one record kept its
    blocks in order, so thinking (which the carry-over never shows) took the room and the
    answer's text was cut, and a block past the room ended the rest. Thinking goes first
    now; a call that does not fit is left out, and a later text that does is kept."""
    thinking = ThinkingBlock(text="t" * 3000, signature="sig")
    answer = TextBlock(text="a" * 1500)
    assert fit_partial((thinking, answer), 4000) == (
        answer,
        TextBlock(
            text="[cut: 1 of 2 blocks of the interrupted message left out or cut to fit one "
            "record of this session's trace (4000 bytes)]"
        ),
    )
    call = ToolCallBlock(id="c1", name="w", arguments={"x": "z" * 3000})
    fitted = fit_partial((call, TextBlock(text="after")), 1000)
    assert fitted[0] == TextBlock(text="after") and fitted[-1].text.startswith("[cut: 1 of 2")
    assert record_size(fitted) <= 1000
    assert fit_partial((answer,), 4000) == (answer,)
    cut, marker = fit_partial((TextBlock(text="b" * 5000),), 4000, 300)  # beside an abort
    assert record_size((cut, marker)) <= 3700
    assert isinstance(cut, TextBlock) and isinstance(marker, TextBlock)
    assert cut.text.endswith("(4000 bytes); the rest is not kept]")  # both name the record
    assert marker.text.endswith("(4000 bytes)]")


ROOM = 800 - record_size(TextBlock(text=""))
"""The bytes of text one record of 800 bytes holds in a text block."""


@pytest.mark.parametrize(
    "lines",
    [
        ["a" * 300, "b" * (ROOM - 305), "", "", "c" * ROOM],
        ["a" * 300, "b" * (ROOM - 306), "  ", "\t", "c" * ROOM],
        ["a" * 300, "b" * (ROOM - 330), *[""] * 20, "c" * (ROOM - 10)],
    ],
    ids=["empty-lines", "whitespace-lines", "run-of-blank-lines"],
)
def test_fit_model_block_makes_no_blank_piece(lines: list[str]) -> None:
    """R-SEC-9, R-CLUSTER-1, R-TRACE: text split to fit records is never split into a
    piece of whitespace alone (providers refuse such a text block: Anthropic's "text
    content blocks must contain non-whitespace text"; a reader skipping empty blocks loses
    its line break): blank lines the piece before has no room for and that leave no room
    for the line after them make that piece end earlier; the pieces, each within a record,
    joined by line breaks are the whole text (before: the blank lines were a piece of
    their own)."""
    text = "\n".join(lines)
    pieces = fit_model_block(TextBlock(text=text), 800)
    assert isinstance(pieces, tuple) and len(pieces) == 3, pieces
    assert all(isinstance(b, TextBlock) and b.text.strip() for b in pieces), pieces
    assert all(record_size(b) <= 800 for b in pieces)
    assert "\n".join(b.text for b in pieces if isinstance(b, TextBlock)) == text


def test_fit_model_block_refuses_blank_lines_no_piece_has_room_for() -> None:
    """R-SEC-9: a blank line between two lines that each fill a record has no piece to go
    in (one of its own would be whitespace alone, and pieces are joined by line breaks):
    the text cannot be recorded, and the sentence says so (before: a piece ``""``)."""
    block = TextBlock(text="\n".join(["a" * ROOM, "", "b" * ROOM]))
    assert fit_model_block(block, 800) == (
        f"the model's text takes {record_size(block)} bytes in the trace, more than the "
        "800 bytes one record of this session's trace carries"
    )
