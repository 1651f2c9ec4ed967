"""Structured output (R-OUT-1) through the runtime, on the scripted model: the answer given
as text or through the final tool, tools before it, one repair round, the failure that
names the problems, and what the trace records (``task_start.output_schema``,
``task_end.output``) — folded back by the task machine as the live run had it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, last_user, of_type, texts_of

from greenroom import Host, OutputSchemaError, tool
from greenroom.actors.scripted import Reply, text, tool_call
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import (
    ApprovalDecision,
    ModelMsg,
    RequestBegin,
    RequestEnd,
    TaskEnd,
    TaskStart,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.structured import FINAL_ANSWER
from greenroom.protocols.task import fold


@attrs.frozen
class Weather:
    """A weather report."""

    city: str
    celsius: float
    sunny: bool


@tool(parallel=True)
async def thermometer(city: str) -> str:
    """Read the temperature of a city."""
    return f"{city}: 21.5 C"


GOOD = {"city": "Lyon", "celsius": 21.5, "sunny": True}


async def test_a_text_answer_is_validated_and_built_into_the_class(
    host: Host, workspace: Path, providers: Any
) -> None:
    seen: list[ModelRequest] = []

    def answer(request: ModelRequest) -> Reply:
        seen.append(request)
        return Reply(blocks=(text(json.dumps(GOOD)),))

    session = await host.create_session(provider=providers(answer), workspace_dir=workspace)
    stream = session.run("weather in Lyon?", output_schema=Weather)
    with trio.fail_after(RUN_TIMEOUT_S):
        result = await stream.result()
    assert result.status == "completed"
    assert result.output == Weather(city="Lyon", celsius=21.5, sunny=True)
    assert result.task_end.output == GOOD
    (request,) = seen
    assert request.output is not None and request.output.name == "Weather"
    assert request.output.schema["required"] == ["city", "celsius", "sunny"]
    records = [json.loads(line) for line in session.trace_path.read_text().splitlines()]
    start = next(r for r in records if r["type"] == "task_start")
    assert start["output_schema"]["title"] == "Weather"
    end = records[-1]
    assert end["type"] == "task_end" and end["output"] == GOOD


async def test_a_follow_up_has_a_schema_of_its_own(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-OUT-1, R-STEER-6: a follow-up queued with its own schema is held to it (its
    requests ask for it, its task_start records it); the stream's result is the
    follow-up's answer as a dict, the run's own was built into its class."""
    count = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
             "additionalProperties": False}
    seen: list[ModelRequest] = []

    def answer(request: ModelRequest) -> Reply:
        seen.append(request)
        return Reply(blocks=(text(json.dumps(GOOD if len(seen) == 1 else {"n": 2})),))

    session = await host.create_session(provider=providers(answer), workspace_dir=workspace)
    stream = session.run("weather in Lyon?", output_schema=Weather)
    assert session.follow_up("how many cities?", output_schema=count)
    with trio.fail_after(RUN_TIMEOUT_S):
        outputs = [output async for output in stream]
        result = await stream.result()
    ends = of_type(outputs, TaskEnd)
    assert [(e.status, e.output) for e in ends] == [("completed", GOOD), ("completed", {"n": 2})]
    starts = of_type(outputs, TaskStart)
    assert [s.output_schema is not None for s in starts] == [True, True]
    assert starts[0].output_schema["title"] == "Weather"  # type: ignore[index]
    assert starts[1].output_schema == count
    assert [r.output.schema if r.output else None for r in seen][1] == count
    assert result.output == {"n": 2}


async def test_tools_first_then_the_final_tool_even_when_every_call_is_denied(
    host: Host, workspace: Path, providers: Any
) -> None:
    """The model calls a tool, then answers through ``final_answer``: the answer is no
    tool, so it is allowed by default though the run denies every call, runs nothing,
    and ends the task after its turn."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "thermometer", city="Lyon"),)),
            Reply(blocks=(text("Done."), tool_call("c2", FINAL_ANSWER, **GOOD))),
        ]
    )
    session = await host.create_session(
        provider=provider, tools=[thermometer], workspace_dir=workspace
    )
    outputs = await collect(session.run("weather?", output_schema=Weather))
    decisions = {d.call_id: (d.decision, d.by) for d in of_type(outputs, ApprovalDecision)}
    assert decisions == {"c1": ("deny", "default"), "c2": ("allow", "default")}
    results = {r.call_id: r for r in of_type(outputs, ToolCallOutput)}
    assert results["c2"].status == "ok"
    assert results["c2"].content == (TextBlock(text="Answer recorded."),)
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed" and end.turns == 2
    assert end.output == GOOD


async def test_an_invalid_text_answer_is_sent_back_once_with_its_problems(
    host: Host, workspace: Path, providers: Any
) -> None:
    asked: list[ModelRequest] = []

    def second(request: ModelRequest) -> Reply:
        asked.append(request)
        return Reply(blocks=(text(json.dumps(GOOD)),))

    provider = providers([Reply(blocks=(text('{"city": "Lyon", "celsius": "warm"}'),)), second])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("weather?", output_schema=Weather))
    steering = [u for u in of_type(outputs, UserMsg) if u.kind == "steering"]
    assert len(steering) == 1
    (note,) = texts_of(last_user(asked[0]))
    # The model sees the recorded steering, in its steering marker.
    assert steering[0].content[0].text in note  # type: ignore[union-attr]
    assert "- $.celsius: expected number, got string" in note
    assert "- $.sunny: required property missing" in note
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed" and end.output == GOOD


async def test_a_second_invalid_answer_fails_the_task_naming_the_problems(
    host: Host, workspace: Path, providers: Any
) -> None:
    """The first answer is a bad final_answer call (its result lists the problems); the
    second, a text that is not JSON, fails the task."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", FINAL_ANSWER, city="Lyon"),)),
            Reply(blocks=(text("It is sunny in Lyon."),)),
        ]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    stream = session.run("weather?", output_schema=Weather, approve=allow_all)
    outputs = await collect(stream)
    (rejected,) = of_type(outputs, ToolCallOutput)
    assert rejected.status == "error" and rejected.is_error
    assert "- $.celsius: required property missing" in rejected.content[0].text  # type: ignore[union-attr]
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "failed" and end.output is None
    assert end.message is not None and end.message.startswith(
        "the answer does not match the output schema after 1 repair round: "
        "$: the answer is not JSON ("
    )
    result = await stream.result()
    assert result.output is None and result.status == "failed"


@attrs.frozen
class Row:
    """One row of a long extraction."""

    name: str
    n: int


@attrs.frozen
class Table:
    """A long extraction."""

    rows: list[Row]


async def test_a_long_answer_is_taken_whole_either_way(
    host: Host, workspace: Path, providers: Any
) -> None:
    """Answers of 12,000 rows (24,000 values, about 480 KB), through the final tool and as
    text: any answer whose check took more than 100,000 steps (about 25,000 checks of a
    value) failed as too costly, whatever the schema; now each is checked to its end and
    taken, and one bad value in the last row of the text answer is still found (R-OUT-1,
    R-SEC-1)."""
    table = {"rows": [{"name": f"item number {i}", "n": i} for i in range(12_000)]}
    bad = {"rows": [*table["rows"][:-1], {"name": "item number 11999", "n": "7999"}]}
    called = providers([Reply(blocks=(tool_call("c1", FINAL_ANSWER, **table),))])
    session = await host.create_session(provider=called, workspace_dir=workspace)
    with trio.fail_after(RUN_TIMEOUT_S):
        first = await session.run("list them", output_schema=Table).result()
    assert first.status == "completed"
    assert first.output == Table(rows=[Row(name=f"item number {i}", n=i) for i in range(12_000)])
    written = providers(
        [Reply(blocks=(text(json.dumps(bad)),)), Reply(blocks=(text(json.dumps(table)),))]
    )
    session = await host.create_session(provider=written, workspace_dir=workspace)
    outputs = await collect(session.run("list them, as text", output_schema=Table))
    steering = [u for u in of_type(outputs, UserMsg) if u.kind == "steering"]
    assert len(steering) == 1
    assert "$.rows[11999].n: expected integer, got string" in steering[0].content[0].text  # type: ignore[union-attr]
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed" and end.output == table


async def test_the_fold_of_the_trace_holds_the_answers(
    host: Host, workspace: Path, providers: Any
) -> None:
    """The answers are recorded facts (invariant 1 of the task machine): a fold of the
    trace knows the task's schema, its failed answer and its last answer, so a task taken
    up elsewhere holds the model to the same schema and the same one repair round."""
    provider = providers(
        [Reply(blocks=(text("no JSON here"),)), Reply(blocks=(text(json.dumps(GOOD)),))]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("weather?", output_schema=Weather))
    traced = [o for o in outputs if type(o).TRACED]
    failures_seen = []
    for k in range(1, len(traced) + 1):
        state = fold(traced[:k]).recorded()
        failures_seen.append(state.answer_failures)
        if isinstance(traced[k - 1], RequestEnd) and k < len(traced) - 1:
            assert state.answer is None
    assert max(failures_seen) == 1
    before_end = fold(traced[:-1]).recorded()
    assert before_end.answer == GOOD and before_end.answer_failures == 1
    assert isinstance(traced[1], TaskStart) and traced[1].output_schema is not None
    assert sum(isinstance(o, RequestBegin) for o in traced) == 2
    assert sum(isinstance(o, ModelMsg) for o in traced) == 2


async def test_a_session_tool_named_final_answer_is_refused_with_a_schema(
    host: Host, workspace: Path, providers: Any
) -> None:
    @tool(name=FINAL_ANSWER)
    async def final_answer(text: str) -> str:
        """A tool of the reserved name."""
        return text

    session = await host.create_session(
        provider=providers([Reply(blocks=(text("hi"),))]),
        tools=[final_answer],
        workspace_dir=workspace,
    )
    with pytest.raises(OutputSchemaError, match="rename it"):
        session.run("hi", output_schema=Weather)
    with pytest.raises(OutputSchemaError, match="must describe an object"):
        session.run("hi", output_schema={"type": "string"})
    assert not session.busy


async def test_the_gateway_runs_with_an_output_schema_and_refuses_a_bad_one(
    tmp_path: Path,
) -> None:
    """``run {…, output_schema}``: the answer reaches the subscriber in ``task_end.output``;
    a schema that is not an object's is -32602 naming it, and nothing starts."""
    from test_gateway import BOUND_S, connect, serving

    from greenroom.protocols import jsonrpc

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path, lambda: [Reply(blocks=(text('{"city": "Lyon"}'),))]
        ) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            refused = await client.error(
                "run", {"session_id": sid, "input": "x", "output_schema": {"type": "array"}}
            )
            assert refused["code"] == jsonrpc.INVALID_PARAMS
            assert refused["message"].startswith("$.output_schema: output_schema must describe")
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "city?",
                                        "output_schema": schema})
            outputs = client.take_outputs() + await client.outputs_until("task_end")
    start = next(o for o in outputs if o["type"] == "task_start")
    assert start["output_schema"] == schema
    assert outputs[-1]["status"] == "completed" and outputs[-1]["output"] == {"city": "Lyon"}
