"""The pure parts of fork and rewind (R-FORK-1, R-FORK-2): which records a rewind leaves
in the history, how a trace file is copied for a fork without decoding its records, where
a rewind may go, and what settles a task the cut leaves open."""

from __future__ import annotations

from typing import Any

import attrs

from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.history import context_at, cut_by, live_records
from greenroom.protocols.outputs import (
    Abort,
    CompactionEnd,
    ModelMsg,
    Output,
    RequestBegin,
    RequestEnd,
    Rewind,
    TaskStart,
    UserMsg,
)
from greenroom.protocols.task import fold
from greenroom.protocols.time_travel import rewind_problem, settlement
from greenroom.protocols.trace import (
    copy_records,
    encode_record,
    fit_model_block,
    parse_trace,
    record_seq,
    record_size,
)
from greenroom.protocols.transcript import rebuild


def msg(seq: int, session_id: str = "s1", **more: Any) -> UserMsg:
    return UserMsg(
        session_id=session_id,
        run_id="r1",
        seq=seq,
        kind="prompt",
        content=(TextBlock(text=f"record {seq}"),),
        **more,
    )


def rewind(seq: int, to_seq: int) -> Rewind:
    return Rewind(session_id="s1", run_id="r9", seq=seq, to_seq=to_seq)


def seqs(records: list[Output]) -> list[int | None]:
    return [r.seq for r in records]


def test_live_records_leave_out_what_each_rewind_cut() -> None:
    records: list[Output] = [msg(1), msg(2), msg(3), msg(4), msg(5), rewind(6, 2), msg(7)]
    records += [rewind(8, 6)]
    assert seqs(live_records(records)) == [1, 2, 6, 8]
    assert cut_by(records, 4) == records[5]
    assert cut_by(records, 7) == records[7]
    assert cut_by(records, 2) is None and cut_by(records, 6) is None
    assert seqs(live_records(records[:5])) == [1, 2, 3, 4, 5]


def test_a_record_cut_once_is_never_brought_back() -> None:
    """A later rewind to a seq after an earlier cut keeps only what was live then."""
    records: list[Output] = [msg(1), msg(2), msg(3), rewind(4, 1), msg(5), rewind(6, 5)]
    assert seqs(live_records(records)) == [1, 4, 5, 6]
    assert cut_by(records, 2) == records[3]


def test_record_seq_reads_the_envelope_without_decoding() -> None:
    call = ToolCallBlock(id="c1", name="lookup", arguments={"seq": 99, "session_id": "s1"})
    line = encode_record(ModelMsg(session_id="s1", run_id="r1", seq=7, turn=1, block=call))
    assert record_seq(line.rstrip("\n").encode()) == 7
    forwarded = encode_record(msg(8, origin=("root", "s1"))).rstrip("\n").encode()
    assert record_seq(forwarded) == 8
    assert record_seq(b'{"type":"user_msg","seq":') is None
    assert record_seq(b"not json") is None


def test_copy_records_moves_each_line_to_the_new_session_and_cuts_it() -> None:
    call = ToolCallBlock(id="c1", name="lookup", arguments={"session_id": "src"})
    records: list[Output] = [
        msg(1, "src"),
        ModelMsg(session_id="src", run_id="r1", seq=2, turn=1, block=call),
        msg(3, "src"),
    ]
    data = "".join(encode_record(r) for r in records).encode() + b'{"type":"user_ms'
    copied = copy_records(data, source_id="src", session_id="new", through_seq=2)
    assert (copied.first_seq, copied.last_seq) == (1, 3)
    moved = parse_trace(copied.data, file="copy").records
    assert [r.session_id for r in moved] == ["new", "new"]
    assert moved[1] == ModelMsg(session_id="new", run_id="r1", seq=2, turn=1, block=call)
    assert copied.data.count(b'"session_id":"src"') == 1  # the argument is untouched
    everything = copy_records(data, source_id="src", session_id="new", through_seq=10)
    assert seqs(parse_trace(everything.data, file="copy").records) == [1, 2, 3]


def test_copy_records_takes_a_line_of_another_shape_by_decoding_it() -> None:
    line = b'{"session_id":"src","type":"user_msg","run_id":"r1","kind":"prompt",'
    line += b'"content":[{"type":"text","text":"x"}],"seq":1}\n'
    copied = copy_records(line, source_id="src", session_id="new", through_seq=1)
    (record,) = parse_trace(copied.data, file="copy").records
    assert record.session_id == "new"


def test_the_context_at_a_record_spans_compactions_and_rewinds() -> None:
    """A compaction starts a context; a rewind goes back to the context of its point, in
    this file or an earlier one."""
    start = CompactionEnd(session_id="s1", run_id="r1", seq=3, status="ok", attempt=1)
    records: list[Output] = [msg(1), msg(2), start, msg(4), rewind(5, 1), msg(6)]
    assert seqs(context_at(records)) == [1, 5, 6]
    assert seqs(context_at(records, 4)) == [3, 4]
    assert seqs(context_at(records, 2)) == [1, 2]
    assert seqs(context_at([*records, rewind(7, 4)])) == [3, 4, 7]
    assert rewind_problem(records, 2, last_seq=6) is not None  # cut by the rewind at 5
    assert rewind_problem(records, 4, last_seq=6) is not None
    assert rewind_problem(records, 3, last_seq=6) is not None
    assert rewind_problem(records, 1, last_seq=6) is None
    assert rewind_problem(records, 7, last_seq=6) is not None
    assert rewind_problem([msg(1)], 0, last_seq=1) is None


def test_a_fork_into_a_long_message_settles_it_in_one_record() -> None:
    """R-FORK-1, R-ABORT-2, R-SEC-9: a fork or rewind into a model message whose text was
    recorded in pieces (each fitting one record of a cluster's trace) settled it with an
    ``abort`` holding every piece, larger than one record: the new session stopped on its
    host. The partial is fitted as an interrupt's is."""
    most = 2000
    text = "\n".join(f"line {i:04d} " + "x" * 90 for i in range(60))
    pieces = fit_model_block(TextBlock(text=text), most)
    assert isinstance(pieces, tuple) and len(pieces) > 2
    records: list[Output] = [
        msg(1),
        TaskStart(session_id="s1", run_id="r1", seq=2, input_seq=1),
        RequestBegin(session_id="s1", run_id="r1", seq=3, turn=1, attempt=1),
        *(
            ModelMsg(session_id="s1", run_id="r1", seq=4 + i, turn=1, block=piece)
            for i, piece in enumerate(pieces)
        ),
    ]
    blocks = rebuild(records, recover=False).attempt_blocks
    for limit in (most, None):
        out = settlement(fold(records).record, blocks, session_id="s1", reason="x", most=limit)
        (abort,) = [o for o in out if isinstance(o, Abort)]
        if limit is None:
            assert abort.partial == pieces
            continue
        assert record_size(abort) <= most
        *kept, marker = abort.partial
        assert isinstance(kept[0], TextBlock) and "\n[cut: " in kept[0].text
        assert pieces[0].text.startswith(kept[0].text.split("\n[cut: ")[0])
        assert isinstance(marker, TextBlock)
        assert marker.text.startswith(f"[cut: {len(pieces)} of {len(pieces)} blocks")


def test_a_streaming_attempt_is_settled_as_a_cut_message() -> None:
    """R-ABORT-2 case B: the stream ends aborted, the abort carries what the model had
    produced, and the carry-over is the marked partial turn."""
    records: list[Output] = [
        msg(1),
        TaskStart(session_id="s1", run_id="r1", seq=2, input_seq=1),
        RequestBegin(session_id="s1", run_id="r1", seq=3, turn=1, attempt=1),
        ModelMsg(session_id="s1", run_id="r1", seq=4, turn=1, block=TextBlock(text="half")),
    ]
    transcript = rebuild(records, recover=False)
    out = settlement(
        fold(records).record, transcript.attempt_blocks, session_id="s1", reason="forked"
    )
    assert [o.TYPE for o in out] == ["request_end", "abort", "task_end"]
    abort = out[1]
    assert isinstance(abort, Abort)
    assert abort.partial == (TextBlock(text="half"),) and not abort.message_complete
    after = rebuild([*records, *_numbered(out, 5)])
    (carried,) = after.carry_over
    assert isinstance(carried, TextBlock) and "[turn_aborted]" in carried.text
    assert fold([*records, *_numbered(out, 5)]).run_id is None
    # Nothing to settle once the task has ended (a prompt alone: tests/test_accepted_runs.py).
    ended = [*records, *_numbered(out, 5)]
    assert settlement(fold(ended).record, (), session_id="s1", reason="x") == []


def test_a_cut_after_a_cut_streams_request_end_records_only_its_abort() -> None:
    """R-FORK-1, R-FORK-2, R-ABORT-2 case B: an interrupt records the cut stream's
    ``request_end(aborted)``, then the ``abort`` with the partial output. A history cut
    between the two got a second ``request_end`` and an ``abort`` with nothing in it (the
    transcript had dropped the stream's output at the first), so the carry-over lost what
    the model had said. Now the settlement is that abort, partial and all, and the task's
    end; the carry-over is the one the interrupt gave."""
    half = TextBlock(text="half")
    records: list[Output] = [
        msg(1),
        TaskStart(session_id="s1", run_id="r1", seq=2, input_seq=1),
        RequestBegin(session_id="s1", run_id="r1", seq=3, turn=1, attempt=1),
        ModelMsg(session_id="s1", run_id="r1", seq=4, turn=1, block=half),
        RequestEnd(session_id="s1", run_id="r1", seq=5, turn=1, attempt=1, status="aborted"),
    ]
    transcript = rebuild(records, recover=False)
    assert transcript.attempt_blocks == (half,)
    out = settlement(fold(records).record, transcript.attempt_blocks, session_id="s1", reason="x")
    assert [o.TYPE for o in out] == ["abort", "task_end"]
    abort = out[0]
    assert isinstance(abort, Abort)
    assert abort.partial == (half,) and not abort.message_complete
    interrupted = [*records, Abort(session_id="s1", run_id="r1", seq=6, reason="stop",
                                   partial=(half,))]  # fmt: skip
    assert rebuild([*records, *_numbered(out, 6)]).carry_over == rebuild(interrupted).carry_over
    assert rebuild(interrupted).attempt_blocks == ()


def _numbered(outputs: list[Output], first: int) -> list[Output]:
    return [attrs.evolve(o, seq=first + i) for i, o in enumerate(outputs)]


def test_copy_records_takes_whole_file_passes_and_lines_alike() -> None:
    """A file in encode_record's shape is renamed in whole-file passes; the same file with
    one line in another shape goes line by line; both give the same records."""
    records: list[Output] = [msg(seq, "src") for seq in range(1, 6)]
    standard = "".join(encode_record(r) for r in records).encode()
    odd = standard.replace(
        b'{"type":"user_msg","session_id":"src",', b'{"session_id":"src","type":"user_msg",', 1
    )
    for data in (standard, odd):
        copied = copy_records(data, source_id="src", session_id="new", through_seq=3)
        assert (copied.first_seq, copied.last_seq) == (1, 5)
        assert parse_trace(copied.data, file="copy").records == [
            attrs.evolve(r, session_id="new") for r in records[:3]
        ]
    fast = copy_records(standard, source_id="src", session_id="new", through_seq=3)
    moved = [attrs.evolve(r, session_id="new") for r in records[:3]]
    assert fast.data == "".join(encode_record(r) for r in moved).encode()


def test_a_seq_of_more_than_nineteen_digits_is_a_damaged_line() -> None:
    """Reading a 5,000-digit ``seq`` raised ValueError out of ``record_seq`` (a fork's
    traceback). Past :data:`MAX_SEQ_DIGITS` a line is damaged, for a fork (left out,
    whether its envelope is read in place or decoded) as for a load (reported by line, not
    kept)."""
    good = "".join(encode_record(msg(seq, "src")) for seq in (1, 2)).encode()
    for digits in (5000, 20):
        damaged = encode_record(msg(3, "src")).replace('"seq":3}', '"seq":%s}' % ("9" * digits))
        line = damaged.encode()
        spaced = line.replace(b'"seq":', b'"seq": ')  # not encode_record's: decoded
        for text in (line, spaced):
            assert record_seq(text.rstrip(b"\n")) is None
            copied = copy_records(good + text, source_id="src", session_id="new", through_seq=10)
            assert (copied.first_seq, copied.last_seq) == (1, 2)
            assert seqs(parse_trace(copied.data, file="copy").records) == [1, 2]
        read = parse_trace(good + line, file="t.jsonl")
        assert seqs(read.records) == [1, 2]
        assert [e.line for e in read.errors] == [3]
    assert record_seq(encode_record(msg(9 * 10**18, "src")).rstrip("\n").encode()) == 9 * 10**18
