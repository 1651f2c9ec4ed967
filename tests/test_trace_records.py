"""What the turn loop writes down: trace lines and usage-ledger rows (R-TRACE-1, R-TRACE-3,
R-TRACE-5, R-RUN-8)."""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import (
    LIVE_ONLY,
    Gates,
    Lookup,
    allow_all,
    collect,
    ledger_rows,
    of_type,
    open_host,
    trace_lines,
    traced,
)

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.protocols.converter import to_dict
from greenroom.protocols.outputs import TaskEnd, TokenUsageOutput
from greenroom.protocols.stream import ModelError, TokenUsage


async def test_trace_holds_every_traced_output_with_gapless_seq(
    data_dir: Path, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-TRACE-1, R-RUN-8: the trace file holds exactly the traced outputs of the run, in
    emission order, as their JSON; no partial_* or tool_progress; seq runs 1, 2, 3, …
    without gaps, across two tasks."""
    provider = providers(
        [
            Reply(blocks=(text("Looking."), tool_call("c1", "lookup", key="a"))),
            Reply(blocks=(text("a is value-a."),)),
            Reply(blocks=(text("Bye."),)),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[lookup.tool], provider=provider, workspace_dir=workspace
        )
        first = await collect(session.run("look up a", approve=allow_all))
        second = await collect(session.run("thanks"))
        lines = trace_lines(session)

    outputs = first + second
    assert any(o.TYPE in LIVE_ONLY for o in outputs)  # partials were emitted live...
    assert not any(line["type"] in LIVE_ONLY for line in lines)  # ...but never traced
    assert lines == [to_dict(o) for o in traced(outputs)]
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert all(line["session_id"] == session.id for line in lines)
    assert [line["type"] for line in lines].count("task_end") == 2


async def test_user_input_is_traced_before_task_start(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-TRACE-3: user_msg is written before task_start, and task_start.input_seq names
    it."""
    provider = providers([Reply(blocks=(text("hi"),))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("hello"))
        lines = trace_lines(session)

    assert [line["type"] for line in lines[:2]] == ["user_msg", "task_start"]
    user, start = lines[0], lines[1]
    assert user["kind"] == "prompt"
    assert user["content"] == [{"type": "text", "text": "hello"}]
    assert start["input_seq"] == user["seq"]
    assert start["run_id"] == user["run_id"]


async def test_input_is_a_fact_even_when_the_model_request_fails(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-TRACE-3: the model request fails (auth, not retried): the input and task_start
    are in the trace anyway, before the failed request_end and task_end(auth)."""
    provider = providers([Reply(fail=ModelError(kind="auth", message="bad key", status_code=401))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        outputs = await collect(session.run("hello"))
        lines = trace_lines(session)

    assert of_type(outputs, TaskEnd)[0].status == "auth"
    assert [line["type"] for line in lines] == [
        "user_msg",
        "task_start",
        "request_begin",
        "request_end",
        "task_end",
    ]
    assert lines[3]["status"] == "auth"
    assert lines[1]["input_seq"] == lines[0]["seq"]


async def test_steering_is_traced_as_a_user_msg(
    data_dir: Path, workspace: Path, providers, gates: Gates
) -> None:
    """R-STEER-4: steering input is a real user message in the trace (kind steering)."""
    provider = providers(
        [Reply(blocks=(tool_call("c1", "wait", key="a"),)), Reply(blocks=(text("ok"),))]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[gates.tool()], provider=provider, workspace_dir=workspace
        )
        stream = session.run("start", approve=allow_all)
        await gates.started("a")
        session.steer("change of plan")
        gates.release("a")
        await collect(stream)
        lines = trace_lines(session)

    steering = [line for line in lines if line["type"] == "user_msg" and line["kind"] == "steering"]
    assert len(steering) == 1
    assert steering[0]["content"] == [{"type": "text", "text": "change of plan"}]


async def test_every_token_usage_is_a_ledger_row(
    data_dir: Path, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-TRACE-5: each token_usage output is also a row of table usage in
    <data_dir>/usage.sqlite, with the same figures, run and turn."""
    provider = providers(
        [
            Reply(
                blocks=(tool_call("c1", "lookup", key="a"),),
                usage=TokenUsage(input=120, output=15, cache_read=40, cache_write=8),
            ),
            Reply(blocks=(text("done"),), usage=TokenUsage(input=160, output=4)),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[lookup.tool], provider=provider, workspace_dir=workspace, model="m-1"
        )
        outputs = await collect(session.run("go", approve=allow_all))
    # The host is closed: every row is committed.
    rows = ledger_rows(data_dir, session.id)

    usages = of_type(outputs, TokenUsageOutput)
    assert len(usages) == 2
    assert len(rows) == len(usages)
    for row, usage in zip(rows, usages, strict=True):
        assert row["kind"] == "request"
        assert row["session_id"] == session.id
        assert row["run_id"] == usage.run_id
        assert row["turn"] == usage.turn
        assert row["provider"] == "scripted"
        assert row["model"] == "m-1"
        got = TokenUsage(
            input=row["input"],
            output=row["output"],
            cache_read=row["cache_read"],
            cache_write=row["cache_write"],
        )
        assert got == usage.request
        assert row["total"] == usage.request.total
    assert [r["turn"] for r in rows] == [1, 2]


async def test_ledger_rows_are_per_session(data_dir: Path, workspace: Path, providers) -> None:
    """R-TRACE-5, R-HOST-1: two sessions of one host share the ledger; their rows keep
    their session ids (the sessions run at the same time)."""
    async with open_host(data_dir) as host:
        a = await host.create_session(
            provider=providers([Reply(blocks=(text("a"),), usage=TokenUsage(input=1))]),
            workspace_dir=workspace,
        )
        b = await host.create_session(
            provider=providers([Reply(blocks=(text("b"),), usage=TokenUsage(input=2))]),
            workspace_dir=workspace,
        )
        streams = [a.run("x"), b.run("y")]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(collect, stream)
    assert [r["input"] for r in ledger_rows(data_dir, a.id)] == [1]
    assert [r["input"] for r in ledger_rows(data_dir, b.id)] == [2]
