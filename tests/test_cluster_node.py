"""What a host writes when it takes a session over (R-CLUSTER-2): an interrupted result
for each call of the open task that has none, seq continuing the trace; the result of an
idempotent tool's call says a new call is safe; a finished task gets nothing."""

from __future__ import annotations

from greenroom.actors.cluster.node import HOST_LOST, HOST_LOST_IDEMPOTENT, host_lost_results
from greenroom.actors.cluster.traces import TraceRead
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd, TaskStart, ToolCallOutput
from greenroom.protocols.stream import TokenUsage

SID = "20260101-120000-abcdef"


def _read(records: list[Output]) -> TraceRead:
    return TraceRead(
        records=tuple(records), current=tuple(records), file=1, last_sequence=len(records)
    )


def _call(seq: int, call_id: str, name: str) -> ModelMsg:
    block = ToolCallBlock(id=call_id, name=name, arguments={})
    return ModelMsg(session_id=SID, run_id="r1", seq=seq, turn=1, block=block)


def test_open_calls_get_interrupted_results_after_the_last_seq() -> None:
    records: list[Output] = [
        TaskStart(session_id=SID, run_id="r1", seq=1, input_seq=None),
        _call(2, "c1", "pay"),
        _call(3, "c2", "fetch"),
        _call(4, "c3", "pay"),
        ToolCallOutput(
            session_id=SID, run_id="r1", seq=5, call_id="c3", tool="pay", status="ok",
            is_error=False, content=(TextBlock(text="paid"),),
        ),
    ]
    results = host_lost_results(_read(records), {"fetch"})
    assert [(r.seq, r.call_id, r.status, r.run_id) for r in results] == [
        (6, "c1", "interrupted", "r1"),
        (7, "c2", "interrupted", "r1"),
    ]
    assert [r.content for r in results] == [
        (TextBlock(text=HOST_LOST),),
        (TextBlock(text=HOST_LOST_IDEMPOTENT),),
    ]


def test_a_finished_task_gets_nothing() -> None:
    records: list[Output] = [
        TaskStart(session_id=SID, run_id="r1", seq=1, input_seq=None),
        _call(2, "c1", "pay"),
        TaskEnd(
            session_id=SID, run_id="r1", seq=3, status="aborted", turns=1,
            usage=TokenUsage(), wall_ms=1, message="interrupted",
        ),
    ]
    assert host_lost_results(_read(records), set()) == []
