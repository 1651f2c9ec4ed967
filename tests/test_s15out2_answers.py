"""Structured output (R-OUT-1) across a compaction and a lost host, and the model told why
its ``final_answer`` arguments could not be read.

Before:

* a compaction's ``compaction_end`` carried the task's schema but not how many invalid
  answers it had had, so a task taken up from the new trace file (read on its own) after a
  restart counted from 0 and got a second repair round;
* a ``final_answer`` call whose arguments held ``NaN`` or nested too deep got
  ``$: the arguments are not a JSON object``, which says nothing of what is wrong;
* a host lost between a ``final_answer`` call's ``approval_decision`` and its result left
  the call in doubt (R-EFFECT-2) on take-up: the note replaced the valid answer and the
  model was asked again, or, with ``approve="people"``, a person was asked whether a call
  that runs nothing took effect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import (
    RUN_TIMEOUT_S,
    Lookup,
    allow_all,
    collect,
    cut_after,
    of_type,
    open_host,
    port_of,
    trace_lines,
)
from test_compaction import BIG, new_session, records, summary_step
from test_recovery import blocking_tool, copy_session

from greenroom.actors.providers.scripted import Reply, invalid_tool_call, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.converter import converter
from greenroom.protocols.outputs import CompactionEnd, TaskEnd, ToolCallOutput
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.structured import ANSWER_ACCEPTED_TEXT, FINAL_ANSWER

SCHEMA = {
    "type": "object",
    "properties": {"key": {"type": "string"}},
    "required": ["key"],
    "additionalProperties": False,
}


async def test_a_task_taken_up_after_a_compaction_keeps_its_one_repair_round(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """The first answer is invalid and sent back; the context then compacts before the
    repair turn, whose call runs when the host stops. Taken up from the new trace file
    alone, the task's next invalid answer is its second: the task fails naming it."""
    hold, hold_started = blocking_tool()
    provider = providers(
        [
            Reply(blocks=(text(json.dumps({"key": 1})),), usage=BIG),
            summary_step("the summary"),
            Reply(blocks=(tool_call("c2", "hold", key="b"),)),
        ]
    )
    session = await new_session(host, workspace, provider, [hold])
    session.run("go", approve=allow_all, output_schema=SCHEMA).detach()
    with trio.fail_after(RUN_TIMEOUT_S):
        await hold_started.wait()
    await port_of(session).sync_trace()
    assert session.trace_path.name == "trace_002.jsonl"
    copy_session(session, tmp_path / "crashed")

    again = providers(
        [Reply(blocks=(text(json.dumps({"key": 2})),)), Reply(blocks=(text('{"key": "b"}'),))]
    )
    async with open_host(tmp_path / "crashed") as other:
        with trio.fail_after(RUN_TIMEOUT_S):
            taken = await other.resume(session.id, provider=again, tools=[hold], approve=allow_all)
            await taken.wait_idle()
        lines = records(taken.trace_path)
    end = lines[-1]
    assert isinstance(end, TaskEnd)
    assert end.status == "failed" and end.output is None
    assert end.message is not None and "$.key: expected string" in end.message
    assert len(again.requests) == 1
    first = lines[0]
    assert isinstance(first, CompactionEnd) and first.answer_failures == 1


def test_a_compaction_end_without_invalid_answers_leaves_the_count_out() -> None:
    """A trace written before the count reads as none; none is not written."""
    end = CompactionEnd(session_id="s", run_id="r", status="ok", attempt=1)
    assert "answer_failures" not in converter.unstructure(end)
    line = {"type": "compaction_end", "session_id": "s", "run_id": "r", "status": "ok",
            "attempt": 1}  # fmt: skip
    assert converter.structure(line, CompactionEnd).answer_failures == 0
    counted = converter.unstructure(CompactionEnd(
        session_id="s", run_id="r", status="ok", attempt=1, answer_failures=1
    ))  # fmt: skip
    assert counted["answer_failures"] == 1


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ('{"key": NaN}', "$: the arguments are malformed JSON: NaN is not a JSON number"),
        ('{"key": 1e999}', "$: the arguments are malformed JSON: number too large"),
        ('{"key": ' + "[" * 100 + "]" * 100 + "}",
         "$: the arguments are nested deeper than 64 levels"),
        ("[1]", "$: the arguments are not a JSON object (got array)"),
    ],
    ids=["nan", "infinite", "deep", "array"],
)
async def test_unreadable_final_answer_arguments_are_sent_back_with_the_reason(
    host: Host, workspace: Path, providers: Any, raw: str, reason: str
) -> None:
    provider = providers(
        [
            Reply(blocks=(invalid_tool_call("a1", FINAL_ANSWER, raw),)),
            Reply(blocks=(tool_call("a2", FINAL_ANSWER, key="b"),)),
        ]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("a key?", output_schema=SCHEMA))
    end = outputs[-1]
    assert isinstance(end, TaskEnd)
    assert (end.status, end.output) == ("completed", {"key": "b"})
    first, second = of_type(outputs, ToolCallOutput)
    assert first.status == "error"
    assert f"- {reason}" in first.content[0].text  # type: ignore[union-attr]
    assert second.status == "ok"


def _deny_lookups(call: ToolCallBlock) -> str:
    return "deny" if call.name == "lookup" else "allow"


@pytest.mark.parametrize("approve", [allow_all, PEOPLE], ids=["callback", "people"])
async def test_a_final_answer_left_without_its_result_is_the_answer_on_take_up(
    data_dir: Path, workspace: Path, providers: Any, lookup: Lookup, approve: Any
) -> None:
    """The model calls a tool (denied) and answers in the same message: the answer is
    decided after the message's request_end, once the call before it is. The host stopped
    right after the answer's approval_decision (the trace cut there). Taken up, the call is
    not in doubt: its recorded arguments are the answer, the task completes with them,
    nobody is asked and the model is not asked again."""
    first = providers(
        [Reply(blocks=(tool_call("c1", "lookup", key="a"), tool_call("a1", FINAL_ANSWER, key="b")))]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=first, tools=[lookup.tool], workspace_dir=workspace
        )
        outputs = await collect(session.run("a key?", approve=_deny_lookups, output_schema=SCHEMA))
    assert of_type(outputs, TaskEnd)[0].output == {"key": "b"}
    sid = session.id
    kept = cut_after(
        session.trace_path,
        lambda r: r["type"] == "approval_decision" and r["tool"] == FINAL_ANSWER,
    )
    assert [r["type"] for r in kept[-4:]] == [
        "request_end", "approval_decision", "tool_call_output", "approval_decision"
    ]
    never = providers([Reply(blocks=(text('{"key": "other"}'),))])
    async with open_host(data_dir) as second:
        with trio.fail_after(RUN_TIMEOUT_S):
            taken = await second.resume(sid, provider=never, tools=[lookup.tool], approve=approve)
            await taken.wait_idle()
        assert await second.pending_approvals() == []
        lines = trace_lines(taken)
    assert never.requests == []
    assert lookup.calls == []
    kinds = [line["type"] for line in lines]
    assert "call_in_doubt" not in kinds and "call_resolved" not in kinds
    result = [line for line in lines if line["type"] == "tool_call_output"][-1]
    assert result["call_id"] == "a1"
    assert (result["status"], result["content"][0]["text"]) == ("ok", ANSWER_ACCEPTED_TEXT)
    end = lines[-1]
    assert (end["type"], end["status"], end["output"]) == ("task_end", "completed", {"key": "b"})
