"""Every output, block, context and actor-message class survives the JSON converter
unchanged (STYLE habit 3): what a trace line or a websocket frame says is what was emitted."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from greenroom.protocols import content, context, messages, outputs, stream
from greenroom.protocols.converter import converter, describe_error, output_from_dict, to_json
from greenroom.protocols.trace import parse_trace

CALL = content.ToolCallBlock(id="toolu_1", name="lookup", arguments={"key": "ä", "n": [1, 2]})
BLOCKS: list[Any] = [
    content.TextBlock(text="héllo"),
    content.ImageBlock(path="/tmp/a.png", media_type="image/png"),
    content.ThinkingBlock(text="hmm", signature="sig=="),
    content.RedactedThinkingBlock(data="opaque"),
    CALL,
    content.ToolCallBlock(id="t2", name="x", arguments={}, invalid_arguments='{"a": '),
]
USAGE = stream.TokenUsage(input=10, output=5, cache_read=100, cache_write=7)
COMMON = {"session_id": "s1", "run_id": "r1", "seq": 3, "origin": ("root", "child")}

EXAMPLES: dict[type[Any], dict[str, Any]] = {
    outputs.UserMsg: {
        "kind": "steering", "content": (BLOCKS[0], BLOCKS[1]), "steering_ids": ("steer_1",)
    },
    outputs.TaskStart: {
        "input_seq": 2,
        "output_schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
    },
    outputs.RequestBegin: {"turn": 1, "attempt": 2},
    outputs.PartialText: {"index": 0, "text": "he"},
    outputs.PartialThinking: {"index": 1, "text": "h"},
    outputs.PartialToolCall: {"index": 2, "call_id": "t", "name": "n", "arguments_delta": '{"'},
    outputs.ModelMsg: {"turn": 1, "block": CALL},
    outputs.TokenUsageOutput: {"turn": 1, "request": USAGE},
    outputs.RequestEnd: {
        "turn": 1,
        "status": "timeout",
        "attempt": 2,
        "retry_in_ms": 500,
        "error_message": "overloaded",
        "stop_reason": None,
    },
    outputs.ApprovalRequest: {"call_id": "t", "tool": "lookup", "arguments": {"k": 1}},
    outputs.ApprovalDecision: {
        "call_id": "t",
        "tool": "lookup",
        "decision": "deny",
        "by": "default",
    },
    outputs.ToolHook: {
        "call_id": "t",
        "tool": "run_shell",
        "hook": "before_tool",
        "action": "rewrite",
        "arguments": {"command": "ls -l"},
    },
    outputs.ToolProgress: {"call_id": "t", "tool": "lookup", "message": "50%"},
    outputs.ToolCallOutput: {
        "call_id": "t",
        "tool": "lookup",
        "status": "denied",
        "is_error": True,
        "content": (content.TextBlock(text="Tool call denied by user."),),
    },
    outputs.Abort: {"reason": "user", "partial": tuple(BLOCKS[2:]), "message_complete": False},
    outputs.CompactionBegin: {"reason": "overflow"},
    outputs.CompactionEnd: {
        "status": "ok",
        "attempt": 1,
        "trace_file": "trace_002.jsonl",
        "summary": "s",
    },
    outputs.CallInDoubt: {"call_id": "t", "tool": "pay", "idempotency_key": "gr-00ff"},
    outputs.CallResolved: {
        "call_id": "t",
        "tool": "pay",
        "by": "person",
        "outcome": "rerun",
        "principal": "ana",
        "check_error": "TimeoutError: no answer within 30 s",
    },
    outputs.Rewind: {"to_seq": 2, "reason": "rewound by a client"},
    outputs.TaskQueuedOutput: {
        "queue_id": "queued_1",
        "content": (content.TextBlock(text="then this"),),
        "approve": "people",
        "thinking_level": "low",
        "output_schema": {"type": "object"},
        "late_steering": True,
    },
    outputs.TaskQueueDropped: {"queue_ids": ("queued_1",), "reason": "interrupted: stop"},
    outputs.SteeringQueuedOutput: {
        "steering_id": "steer_1",
        "content": (content.TextBlock(text="also check the logs"),),
    },
    outputs.TaskEnd: {"status": "aborted", "turns": 2, "usage": USAGE, "wall_ms": 12},
}


def test_every_output_class_has_an_example() -> None:
    assert set(EXAMPLES) == set(outputs.OUTPUT_CLASSES)


@pytest.mark.parametrize("cls", outputs.OUTPUT_CLASSES, ids=lambda c: c.TYPE)
def test_output_round_trips(cls: type[Any]) -> None:
    value = cls(**COMMON, **EXAMPLES[cls])
    line = to_json(value)
    data = json.loads(line)
    assert next(iter(data)) == "type" and data["type"] == cls.TYPE
    assert output_from_dict(data) == value
    bare = cls(session_id="s", run_id="r", **EXAMPLES[cls])
    assert "seq" not in json.loads(to_json(bare)) and "origin" not in json.loads(to_json(bare))


def test_optional_structured_and_hook_fields_are_left_out_when_none() -> None:
    """``task_start.output_schema``, ``task_end.output`` (R-OUT-1) and ``tool_hook``'s
    ``arguments`` and ``reason`` (R-HOOK-2) are written only when they hold something, so
    the records of runs without them are as before; each reads back."""
    start = json.loads(to_json(outputs.TaskStart(session_id="s", run_id="r", input_seq=1)))
    assert "output_schema" not in start
    end = outputs.TaskEnd(session_id="s", run_id="r", status="completed", turns=1, usage=USAGE,
                          wall_ms=3, output={"n": 1})
    data = json.loads(to_json(end))
    assert data["output"] == {"n": 1} and output_from_dict(data) == end
    assert "output" not in json.loads(to_json(attrs.evolve(end, output=None)))
    denied = outputs.ToolHook(session_id="s", run_id="r", call_id="t", tool="x",
                              hook="after_tool", action="replace")
    assert set(json.loads(to_json(denied))) == {
        "type", "session_id", "run_id", "call_id", "tool", "hook", "action"
    }


def test_request_end_names_the_response_only_when_the_provider_did() -> None:
    """``request_end.response_id`` and ``response_model`` (R-OBS-2: the id and the model
    the provider named) are written only when known, so a record without them is as
    before; each reads back."""
    end = outputs.RequestEnd(session_id="s", run_id="r", turn=1, status="ok", attempt=1,
                             stop_reason="end_turn", response_id="msg_1",
                             response_model="claude-sonnet-4-5-20250929")
    data = json.loads(to_json(end))
    assert data["response_id"] == "msg_1"
    assert data["response_model"] == "claude-sonnet-4-5-20250929"
    assert output_from_dict(data) == end
    bare = json.loads(to_json(attrs.evolve(end, response_id=None, response_model=None)))
    assert "response_id" not in bare and "response_model" not in bare


def test_task_queued_marks_late_steering_only_when_it_is_and_reads_back_strictly() -> None:
    """R-STEER-1, R-SEC-9: ``task_queued.late_steering`` is written only when true, so a
    follow-up's record is as before and one without it reads as a follow-up; a value that
    is not a JSON boolean makes the trace line a clear error, never a follow-up nor a
    steer taken from its truthiness."""
    queued = outputs.TaskQueuedOutput(
        session_id="s",
        run_id="r",
        seq=4,
        queue_id="queued_1",
        content=(content.TextBlock(text="STEER"),),
        late_steering=True,
    )
    data = json.loads(to_json(queued))
    assert data["late_steering"] is True and output_from_dict(data) == queued
    follow_up = json.loads(to_json(attrs.evolve(queued, late_steering=False)))
    assert "late_steering" not in follow_up
    assert output_from_dict(follow_up).late_steering is False  # type: ignore[union-attr]
    bad = json.dumps({**data, "late_steering": "no"})
    read = parse_trace(bad + "\n", file="trace_001.jsonl")
    assert read.records == []
    (error,) = read.errors
    assert str(error).startswith("trace_001.jsonl:1: invalid 'task_queued' record: ")
    assert "$.late_steering" in str(error)


def test_usage_carries_total_and_ignores_it_when_read() -> None:
    data = converter.unstructure(USAGE)
    assert data["total"] == 122
    data["total"] = 999
    assert converter.structure(data, stream.TokenUsage) == USAGE


def test_usage_carries_its_cost_or_null_and_reads_one_without() -> None:
    """R-SHARE-3: ``cost_usd`` is always written (null when unknown); a record from
    before costs reads as unknown; a sum is unknown once one term is."""
    priced = stream.TokenUsage(input=1, output=2, cost_usd=0.25)
    assert converter.unstructure(priced)["cost_usd"] == 0.25
    assert converter.unstructure(USAGE)["cost_usd"] is None
    assert converter.structure(converter.unstructure(priced), stream.TokenUsage) == priced
    old = {"input": 1, "output": 2, "cache_read": 0, "cache_write": 0, "total": 3}
    assert converter.structure(old, stream.TokenUsage).cost_usd is None
    assert (priced + priced).cost_usd == 0.5
    assert (priced + stream.TokenUsage(input=1)).cost_usd is None
    with pytest.raises(ValueError, match="cost_usd"):
        converter.structure({**old, "cost_usd": "0.1"}, stream.TokenUsage)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.TYPE)
def test_blocks_round_trip_through_unions(block: Any) -> None:
    data = converter.unstructure(block)
    union: Any = content.UserContent if block.TYPE == "image" else content.ModelBlock
    assert converter.structure(data, union) == block


def test_context_messages_round_trip() -> None:
    result = context.ToolResult(
        call_id="toolu_1",
        tool="lookup",
        status="ok",
        is_error=False,
        content=(content.TextBlock(text="v"),),
    )
    user = context.UserMessage(content=(result, content.TextBlock(text="next")))
    assistant = context.AssistantMessage(content=tuple(b for b in BLOCKS if b.TYPE != "image"))
    for message in (user, assistant):
        assert converter.structure(converter.unstructure(message), type(message)) == message


MESSAGE_EXAMPLES: list[Any] = [
    messages.StreamBatch(attempt=1, events=[stream.TextDelta(index=0, text="a")]),
    messages.ApprovalAsked(call=CALL),
    messages.ApprovalDecided(call=CALL, verdict="allow_session", by="host"),
    messages.ToolCallFinished(
        call_id="t", status="ok", is_error=False, content=(content.TextBlock(text="x"),)
    ),
    messages.ToolProgressed(call_id="t", message="half"),
    messages.QuestionAsked(call_id="t", arguments={"question": "Which size?"}),
    messages.QuestionAnswered(action="accept", text="M"),
    messages.SteeringQueued(content=(content.TextBlock(text="also"),)),
    messages.BackoffSkipped(),
    messages.InterruptTask(reason="interrupted by host"),
    messages.InterruptTask(reason="this node only", scope="node"),
    messages.SubagentFinished(
        session_id="c", content=(content.TextBlock(text="[subagent c finished] done"),),
        follow_up=None,
    ),
    messages.ApproveCall(call=CALL),
    messages.RunToolCall(call=CALL, position=3),
    messages.RunToolCall(call=CALL, position=3, idempotency_key="gr-00ff"),
    messages.CheckToolCall(call=CALL, position=1, idempotency_key="gr-00ff"),
    messages.ToolCallChecked(
        call_id="t", outcome="done", content=(content.TextBlock(text="paid 7"),)
    ),
    messages.ToolCallChecked(call_id="t", outcome="failed", error="ValueError: down"),
    messages.SubagentOutputs(
        outputs=(
            outputs.PartialText(session_id="c", run_id="r", index=0, text="hi"),
            outputs.ToolProgress(
                session_id="c", run_id="r", origin=("p",), call_id="t", tool="x", message="m"
            ),
        ),
        origin=("p", "c"),
    ),
]


@pytest.mark.parametrize("message", MESSAGE_EXAMPLES, ids=lambda m: type(m).__name__)
def test_actor_messages_round_trip(message: Any) -> None:
    cls = type(message)
    assert attrs.has(cls)
    if cls is messages.StreamBatch:
        return  # carries provider events in memory only; never serialised
    assert converter.structure(converter.unstructure(message), cls) == message


def test_bad_records_are_rejected_with_a_path() -> None:
    with pytest.raises(Exception) as info:
        output_from_dict({"type": "request_end", "session_id": "s", "run_id": "r", "turn": "x"})
    text = describe_error(info.value)
    assert "$.turn" in text or "turn" in text
    with pytest.raises(ValueError, match="unknown type"):
        output_from_dict({"type": "nope"})
