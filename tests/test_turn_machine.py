"""The pure turn state machine (R-ACTOR-3), without trio: rules and properties."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.messages import ApproveCall, RunToolCall
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ModelMsg,
    PartialText,
    RequestBegin,
    RequestEnd,
    TokenUsageOutput,
    ToolCallOutput,
    ToolProgress,
)
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    MessageCompleted,
    ModelError,
    StreamFailed,
    TextDelta,
    TokenUsage,
    ToolArgumentsDelta,
    ToolCallTruncated,
    UsageReported,
)
from greenroom.protocols.trace import record_size
from greenroom.protocols.turn import (
    CALL_TRANSITIONS,
    TRUNCATED_TEXT,
    CallEvent,
    CallState,
    IllegalTransition,
    RecordUsage,
    SkipToolCall,
    TurnMachine,
    resume_turn,
)

OK = (TextBlock(text="ok"),)


def machine() -> TurnMachine:
    m = TurnMachine(session_id="s", run_id="r", turn=1)
    (begin,) = m.begin_attempt(1)
    assert isinstance(begin, RequestBegin) and begin.attempt == 1
    return m


def call_block(n: int) -> ToolCallBlock:
    return ToolCallBlock(id=f"c{n}", name="t", arguments={"n": n})


def stream_calls(m: TurnMachine, n: int, *, complete: bool = True) -> list[Any]:
    events: list[Any] = []
    for i in range(n):
        events += [
            BlockStarted(index=i, kind="tool_call", call_id=f"c{i}", name="t"),
            ToolArgumentsDelta(index=i, call_id=f"c{i}", name="t", delta='{"n":'),
            BlockCompleted(index=i, block=call_block(i)),
        ]
    if complete:
        events.append(MessageCompleted(stop_reason="tool_use", usage=TokenUsage(input=3)))
    return m.feed(events)


def of(kind: type, effects: list[Any]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


# -- the table --------------------------------------------------------------------------------


def test_every_pair_outside_the_table_raises() -> None:
    for state in CallState:
        for event in CallEvent:
            if (state, event) in CALL_TRANSITIONS or event is CallEvent.INTERRUPTED:
                # Only settle() interrupts, and it never touches a call that is done.
                continue
            m = machine()
            stream_calls(m, 1)
            if state is CallState.RUNNING:
                m.decide("c0", allowed=True, by="host")
            elif state is CallState.DONE:
                m.decide("c0", allowed=False, by="host")
            with pytest.raises(IllegalTransition):
                if event is CallEvent.ALLOWED:
                    m.decide("c0", allowed=True, by="host")
                elif event is CallEvent.DENIED:
                    m.decide("c0", allowed=False, by="host")
                else:
                    m.finish("c0", status="ok", content=OK)


def test_an_unknown_call_is_illegal_but_a_discarded_one_is_stale() -> None:
    m = machine()
    with pytest.raises(IllegalTransition):
        m.decide("nope", allowed=True, by="host")
    stream_calls(m, 1, complete=False)
    m.feed([StreamFailed(error=ModelError(kind="timeout", message="x"))])
    m.decide("c0", allowed=False, by="host")
    m.discard_attempt()
    assert m.decide("c0", allowed=True, by="host") == []
    assert m.finish("c0", status="ok", content=OK) == []


# -- the rules --------------------------------------------------------------------------------


def test_stream_gives_partials_blocks_usage_and_request_end_in_order() -> None:
    m = machine()
    effects = m.feed(
        [
            BlockStarted(index=0, kind="text"),
            TextDelta(index=0, text="Hel"),
            TextDelta(index=0, text="lo"),
            BlockCompleted(index=0, block=TextBlock(text="Hello")),
            UsageReported(usage=TokenUsage(input=5, output=2)),
            MessageCompleted(stop_reason="end_turn", usage=TokenUsage(input=5, output=2)),
        ]
    )
    assert [type(e) for e in effects] == [
        PartialText, PartialText, ModelMsg, RecordUsage, TokenUsageOutput, RecordUsage, RequestEnd
    ]
    # The stream's first report is recorded as it comes (for a host that dies mid-stream:
    # R-SHARE-3), its last as the request's usage.
    started, last = of(RecordUsage, effects)
    assert started == RecordUsage(usage=TokenUsage(input=5, output=2), started=True)
    assert last == RecordUsage(usage=TokenUsage(input=5, output=2))
    end = effects[-1]
    assert end.status == "ok" and end.stop_reason == "end_turn" and end.attempt == 1
    assert m.feed([TextDelta(index=0, text="late")]) == []


def test_calls_are_sent_for_approval_at_once_one_at_a_time_and_run_only_when_allowed() -> None:
    """R-TOOL-1: the first call is asked about as soon as its block completes, while the
    model streams; the next one with the decision on the first, in call order."""
    m = machine()
    effects = stream_calls(m, 2, complete=False)
    assert [e.call.id for e in of(ApproveCall, effects)] == ["c0"]
    allowed = m.decide("c0", allowed=True, by="host")
    assert [type(e) for e in allowed] == [ApprovalDecision, RunToolCall, ApproveCall]
    assert allowed[-1].call.id == "c1"
    denied = m.decide("c1", allowed=False, by="session_rule")
    assert [type(e) for e in denied] == [ApprovalDecision, SkipToolCall, ToolCallOutput]
    assert denied[-1].status == "denied" and denied[-1].content == (
        TextBlock(text=markers.DENIED_TEXT),
    )


def test_an_allow_after_the_interrupt_never_starts_the_call() -> None:
    m = machine()
    stream_calls(m, 1)
    effects = m.decide("c0", allowed=True, by="host", interrupted=True)
    assert not of(RunToolCall, effects)
    settled = m.abort("interrupted", message_complete=True)
    assert [o.status for o in of(ToolCallOutput, settled)] == ["interrupted"]


def test_a_deny_after_the_interrupt_sends_nothing_to_the_pool() -> None:
    """R-APPROVE-5: Ctrl-C at an approval question denies the call and interrupts the task;
    when the deny is handled while the abort settles, the pool has stopped: the decision
    and the denied result are recorded, and no pool command comes of it (sending one to
    the closed pool failed the task with BrokenResourceError)."""
    m = machine()
    stream_calls(m, 1)
    effects = m.decide("c0", allowed=False, by="host", interrupted=True)
    assert [type(e) for e in effects] == [ApprovalDecision, ToolCallOutput]
    assert effects[-1].status == "denied"
    settled = m.abort("interrupted", message_complete=True)
    assert not of(ToolCallOutput, settled)  # paired once, by the deny


def test_results_are_in_call_order_whatever_the_completion_order() -> None:
    m = machine()
    stream_calls(m, 3)
    for i in range(3):
        m.decide(f"c{i}", allowed=True, by="host")
    for i in (2, 0, 1):
        m.finish(f"c{i}", status="ok", content=(TextBlock(text=str(i)),))
    assert m.all_calls_terminal
    assert [r.call_id for r in m.results()] == ["c0", "c1", "c2"]


def test_a_truncated_call_is_paired_without_a_decision_and_never_runs() -> None:
    m = machine()
    effects = m.feed(
        [
            ToolCallTruncated(index=0, call_id="c9", name="write", partial_arguments='{"p'),
            MessageCompleted(stop_reason="max_tokens", usage=TokenUsage()),
        ]
    )
    assert not of(ApproveCall, effects) and not of(ApprovalDecision, effects)
    (output,) = of(ToolCallOutput, effects)
    assert output.status == "truncated" and output.content == (TextBlock(text=TRUNCATED_TEXT),)
    assert of(SkipToolCall, effects) == [SkipToolCall(position=0)]
    assert m.all_calls_terminal


def test_progress_only_while_running() -> None:
    m = machine()
    stream_calls(m, 1)
    assert m.progress("c0", "x") == []
    m.decide("c0", allowed=True, by="host")
    assert of(ToolProgress, m.progress("c0", "half")) != []
    m.finish("c0", status="ok", content=OK)
    assert m.progress("c0", "late") == []


def test_a_failed_attempt_becomes_the_retry_note_and_its_calls_history() -> None:
    m = machine()
    stream_calls(m, 1, complete=False)
    m.decide("c0", allowed=True, by="host")
    m.feed([StreamFailed(error=ModelError(kind="timeout", message="dropped"))])
    (end,) = m.fail_attempt(ModelError(kind="timeout", message="dropped"), retry_in_ms=250)
    assert end.status == "timeout" and end.retry_in_ms == 250
    with pytest.raises(IllegalTransition):
        m.discard_attempt()  # the call that ran must report first (R-RETRY-4)
    m.finish("c0", status="ok", content=OK)
    m.discard_attempt()
    m.begin_attempt(2)
    assert not m.has_calls
    aborted = m.abort("interrupted", message_complete=False)
    (abort,) = of(Abort, aborted)
    assert [b.id for b in abort.partial if isinstance(b, ToolCallBlock)] == ["c0"]


def test_attempts_count_up_and_wait_for_the_stream_and_the_calls() -> None:
    m = machine()
    with pytest.raises(IllegalTransition):
        m.begin_attempt(2)  # still streaming
    m.feed([StreamFailed(error=ModelError(kind="timeout", message="x"))])
    with pytest.raises(IllegalTransition):
        m.begin_attempt(3)
    m.begin_attempt(2)


def test_abort_mid_stream_reports_the_cut_message() -> None:
    m = machine()
    m.feed([BlockStarted(index=0, kind="text"), TextDelta(index=0, text="half")])
    effects = m.abort("interrupted", message_complete=False)
    assert [type(e) for e in effects] == [RequestEnd, Abort]
    assert effects[0].status == "aborted"
    assert effects[1].partial == (TextBlock(text="half"),)


# -- properties -------------------------------------------------------------------------------

ACTIONS = st.lists(
    st.tuples(st.sampled_from(["allow", "deny", "finish", "progress"]), st.integers(0, 5)),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    n_calls=st.integers(0, 5),
    truncated=st.integers(0, 2),
    complete=st.booleans(),
    actions=ACTIONS,
    end=st.sampled_from(["abort", "finish_all"]),
)
def test_every_call_is_paired_exactly_once_on_every_path(
    n_calls: int, truncated: int, complete: bool, actions: list[tuple[str, int]], end: str
) -> None:
    m = machine()
    effects = stream_calls(m, n_calls, complete=False)
    effects += m.feed(
        [
            ToolCallTruncated(index=10 + k, call_id=f"t{k}", name="t", partial_arguments="{")
            for k in range(truncated)
        ]
    )
    if complete:
        effects += m.feed([MessageCompleted(stop_reason="tool_use", usage=TokenUsage())])
    for action, index in actions:
        call_id = f"c{index}"
        state = m.call_state(call_id)
        if state is None:
            continue
        if action in ("allow", "deny") and state is CallState.APPROVING:
            effects += m.decide(call_id, allowed=action == "allow", by="host")
        elif action == "finish" and state is CallState.RUNNING:
            effects += m.finish(call_id, status="ok", content=OK)
        elif action == "progress":
            effects += m.progress(call_id, "p")
    if end == "abort":
        effects += m.abort("interrupted", message_complete=complete)
    else:
        for block in m.calls():
            if m.call_state(block.id) is CallState.APPROVING:
                effects += m.decide(block.id, allowed=True, by="host")
            if m.call_state(block.id) is CallState.RUNNING:
                effects += m.finish(block.id, status="ok", content=OK)

    ids = [f"c{i}" for i in range(n_calls)] + [f"t{k}" for k in range(truncated)]
    outputs = of(ToolCallOutput, effects)
    assert sorted(o.call_id for o in outputs) == sorted(ids)  # one result each
    decisions = of(ApprovalDecision, effects)
    assert sorted(d.call_id for d in decisions) == sorted(f"c{i}" for i in range(n_calls))
    runs = [r.call.id for r in of(RunToolCall, effects)]
    assert len(runs) == len(set(runs))
    allowed = {d.call_id for d in decisions if d.decision == "allow"}
    assert set(runs) <= allowed
    for run_id in runs:  # a call runs only after its allow
        allow_at = next(i for i, e in enumerate(effects)
                        if isinstance(e, ApprovalDecision) and e.call_id == run_id)
        run_at = next(i for i, e in enumerate(effects)
                      if isinstance(e, RunToolCall) and e.call.id == run_id)
        assert allow_at < run_at
    assert m.all_calls_terminal
    order = [b.id for b in m.calls()]
    assert [r.call_id for r in m.results()] == order  # call order (R-RUN-4)
    if end == "abort":
        assert len(of(Abort, effects)) == 1
        assert all(o.status in ("ok", "denied", "interrupted", "truncated") for o in outputs)


def test_a_block_no_record_holds_ends_the_attempt_unretried_and_nothing_after_it_runs() -> None:
    """R-SEC-9, R-CLUSTER-1: with records of at most 400 bytes (a cluster's trace), a text
    of many lines completed as the message ends is recorded in pieces; a call whose
    arguments no record holds ends the attempt with a failure that is not retried, before
    it or a call after it is asked about or recorded, and later events are ignored. With
    no limit (a file trace) the same call is recorded and asked about. A call cut by the
    token limit whose partial arguments no record holds ends the attempt so too."""
    lines = "\n".join(["x" * 100] * 10)
    m = TurnMachine(session_id="s", run_id="r", turn=1, largest_record=400)
    m.begin_attempt(1)
    out = m.feed(
        [
            BlockStarted(index=0, kind="text"),
            TextDelta(index=0, text=lines),
            MessageCompleted(stop_reason="end_turn", usage=TokenUsage(input=3)),
        ]
    )
    texts = [e.block.text for e in of(ModelMsg, out)]
    assert len(texts) == 4 and "\n".join(texts) == lines

    big = ToolCallBlock(id="c0", name="t", arguments={"text": "y" * 500})
    for most, recorded in ((400, False), (None, True)):
        m = TurnMachine(session_id="s", run_id="r", turn=1, largest_record=most)
        m.begin_attempt(1)
        out = m.feed(
            [BlockCompleted(index=0, block=big), BlockCompleted(index=1, block=call_block(1))]
        )
        out += m.feed([MessageCompleted(stop_reason="tool_use", usage=TokenUsage(input=3))])
        if recorded:
            assert [e.block for e in of(ModelMsg, out)] == [big, call_block(1)]
            assert [e.call for e in of(ApproveCall, out)] == [big]
            continue
        assert of(ModelMsg, out) == of(ApproveCall, out) == of(RequestEnd, out) == []
        assert m.calls() == () and m.all_calls_terminal
        failed = m.stream_result
        assert isinstance(failed, StreamFailed) and failed.error.permanent
        assert failed.error.message.startswith("the model's call of t takes 565 bytes in the")
        (end,) = m.fail_attempt(failed.error, retry_in_ms=None)
        assert isinstance(end, RequestEnd) and end.status == "failed"
    m = TurnMachine(session_id="s", run_id="r", turn=1, largest_record=400)
    m.begin_attempt(1)
    out = m.feed([ToolCallTruncated(index=0, call_id="c0", name="t", partial_arguments="z" * 500)])
    assert out == [] and m.calls() == ()  # no record, no result: the attempt ends
    m.feed([MessageCompleted(stop_reason="max_tokens", usage=TokenUsage())])  # with its stream
    assert isinstance(m.stream_result, StreamFailed) and m.stream_result.error.permanent


def test_an_interrupted_message_whose_blocks_fit_alone_but_not_together_is_cut_to_fit() -> None:
    """R-ABORT-2, R-SEC-9, R-CLUSTER-1: with records of at most 1,000 bytes, each of six
    text blocks of 400 characters fits a record alone, but an interrupt before the
    message's end recorded the ``abort`` with all of them as its partial output, which
    one record did not hold (it would stop the session on its cluster host). The partial
    is cut to fit: the blocks in order while they fit, the next one cut, and a line saying
    what was left out. With no limit (a file trace) it is whole."""
    blocks = [TextBlock(text=f"{i}" * 400) for i in range(6)]
    for most in (1_000, None):
        m = TurnMachine(session_id="s", run_id="r", turn=1, largest_record=most)
        m.begin_attempt(1)
        out = m.feed([BlockCompleted(index=i, block=b) for i, b in enumerate(blocks)])
        assert [e.block for e in of(ModelMsg, out)] == blocks
        (abort,) = of(Abort, m.abort("stop", message_complete=False))
        if most is None:
            assert abort.partial == tuple(blocks)
            continue
        budget = most - record_size(attrs.evolve(abort, partial=()))
        assert record_size(abort.partial) <= budget
        *whole, cut, marker = abort.partial
        assert whole == blocks[: len(whole)] and whole
        assert isinstance(cut, TextBlock)
        assert cut.text.startswith(blocks[len(whole)].text[:10]) and "\n[cut: " in cut.text
        assert cut.text.endswith(f"trace ({most} bytes); the rest is not kept]")
        assert marker == TextBlock(  # both name the record, not the room the abort left
            text=f"[cut: {len(blocks) - len(whole)} of {len(blocks)} blocks of the interrupted "
            f"message left out or cut to fit one record of this session's trace ({most} "
            "bytes)]"
        )


def test_a_request_ended_by_a_block_no_record_holds_counts_the_usage_its_stream_ends_with() -> None:
    """R-TRACE-5, R-SHARE-3, R-SHARE-4, R-SEC-9: a call no record holds ends the attempt,
    but its stream is read to its end, where the provider reports what the request is
    billed: the usage of the read that held the call (input only, before the output was
    known) was counted, the stream's end dropped. Nothing after the call is recorded or
    shown, and the attempt's result, its failure not retried, comes with the stream's
    end, whether in the same read or a later one. A provider's failure in the rest keeps
    the call's failure and counts the usage so far; so does an interrupt."""
    big = ToolCallBlock(id="c1", name="w", arguments={"x": "a" * 1000})
    start = [UsageReported(usage=TokenUsage(input=100)), BlockCompleted(index=0, block=big)]
    after = [BlockStarted(index=1, kind="text"), TextDelta(index=1, text="more")]
    whole = TokenUsage(input=100, output=5000)
    end = MessageCompleted(stop_reason="tool_use", usage=whole)
    for reads in ([[*start, *after, end]], [start, after, [end]], [start, [*after, end]]):
        m = TurnMachine(session_id="s", run_id="r", turn=1, largest_record=400)
        m.begin_attempt(1)
        out: list[Any] = []
        for read in reads:
            assert m.stream_result is None  # the stream is still read
            out += m.feed(read)
        assert isinstance(m.stream_result, StreamFailed) and m.stream_result.error.permanent
        assert "call of w" in m.stream_result.error.message
        assert of(ModelMsg, out) == of(RequestEnd, out) == []
        assert [(e.usage, e.started) for e in of(RecordUsage, out)] == [
            (TokenUsage(input=100), True),
            (whole, False),
        ]
        assert [e.request for e in of(TokenUsageOutput, out)] == [whole]
        assert len(reads) > 1 or of(PartialText, out) != []  # that read's were shown
        assert m.partial_blocks() == []
    cut = StreamFailed(error=ModelError(kind="network", message="reset"))
    for ending in ([cut], "interrupt"):
        m = TurnMachine(session_id="s", run_id="r", turn=1, largest_record=400)
        m.begin_attempt(1)
        assert m.feed(start) == [RecordUsage(usage=TokenUsage(input=100), started=True)]
        if ending == "interrupt":
            out = m.abort("stop", message_complete=False)
            (abort,) = of(Abort, out)
            assert abort.partial == () and of(RequestEnd, out)[0].status == "aborted"
        else:
            out = m.feed([*after, *ending])
            assert isinstance(m.stream_result, StreamFailed)
            assert m.stream_result.error.permanent  # the call's failure, not the reset
        assert [e.usage for e in of(RecordUsage, out)] == [TokenUsage(input=100)]  # so far


def test_a_turn_taken_up_replays_its_recorded_calls_whatever_a_record_holds_now() -> None:
    """R-HITL-4, R-CLUSTER-2: the calls of a turn taken up from its trace are recorded
    already. Replayed through the record limit of the host that takes it up (a NATS server
    of a smaller max_payload), a call past it ended the replay, and deciding the next
    call raised. They are replayed as recorded; the limit holds for the attempts after."""
    c1 = ToolCallBlock(id="c1", name="w", arguments={"x": "a" * 300})
    c2 = ToolCallBlock(id="c2", name="w", arguments={"x": "b"})
    m = resume_turn(
        session_id="s", run_id="r", turn=1, attempt=1, calls=[c1, c2], results={},
        allowed={"c1", "c2"}, stream_ended=True, largest_record=200,
    )  # fmt: skip
    assert [c.id for c in m.calls()] == ["c1", "c2"]
    assert m.stream_result is not None and not isinstance(m.stream_result, StreamFailed)


def test_a_stream_that_fails_with_an_open_block_no_record_holds_is_retried() -> None:
    """R-RETRY-1, R-SEC-9: a stream failed (overloaded) while a text block of one line
    longer than a record was open: closing the block for the trace replaced the stream's
    retryable failure by a permanent one, and the task ended instead of being retried.
    The block is left out and the stream's own failure stands."""
    m = TurnMachine(session_id="s", run_id="r", turn=1, largest_record=400)
    m.begin_attempt(1)
    overloaded = ModelError(kind="overloaded", message="overloaded")
    out = m.feed(
        [
            BlockStarted(index=0, kind="text"),
            TextDelta(index=0, text="x" * 1000),
            StreamFailed(error=overloaded),
        ]
    )
    assert of(ModelMsg, out) == []
    assert isinstance(m.stream_result, StreamFailed) and m.stream_result.error == overloaded
