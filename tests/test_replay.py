"""Replay a recorded session on another model (R-FORK-3) against the scripted model: the
recorded prompts, steering and follow-ups run again in a fork; an equal call gets the
recorded result and runs zero times, another side-effecting call is denied unless asked,
a read-only one runs; the report puts both sides next to each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import Recorder, allow_all, collect, texts_of

from greenroom.actors.apps.replay import denied_note, replay_session
from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ToolResult, UserMessage
from greenroom.protocols.replay import (
    RecordedCall,
    RecordedResults,
    call_key,
    recorded_tasks,
    render_report,
)
from greenroom.protocols.tools import Tool, make_tool


class Payments:
    """A side-effecting ``pay`` (not parallel-safe) and a read-only ``lookup``, counting
    every run."""

    def __init__(self) -> None:
        self.paid: list[str] = []
        self.looked_up: list[str] = []

        async def pay(invoice: str) -> str:
            """Pay an invoice."""
            self.paid.append(invoice)
            return f"paid {invoice}"

        async def lookup(key: str) -> str:
            """Look a key up."""
            self.looked_up.append(key)
            return f"value of {key}"

        self.tools: list[Tool] = [make_tool(pay, parallel=False), make_tool(lookup, parallel=True)]


async def recorded_session(host: Host, workspace: Path, providers: Any, pay: Payments) -> Session:
    """Two tasks: the first pays A and looks a up; the second looks b up and is steered
    while its first turn runs."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "pay", invoice="A"), tool_call("c2", "lookup", key="a"))),
            Reply(blocks=(text("paid A"),)),
            Reply(blocks=(tool_call("c3", "lookup", key="b"),)),
            Reply(blocks=(text("b is value of b, and C noted"),)),
        ]
    )
    session = await host.create_session(provider=provider, tools=pay.tools, workspace_dir=workspace)
    await collect(session.run("pay invoice A", approve=allow_all))
    recorder = Recorder(session)
    stream = session.run("what is b?", approve=allow_all)
    await recorder.wait_for("request_begin", turn=1)
    assert session.steer("also note C")
    await collect(stream)
    return session


def replay_script() -> list[Reply]:
    return [
        Reply(
            blocks=(
                tool_call("r1", "pay", invoice="A"),
                tool_call("r2", "pay", invoice="B"),
                tool_call("r3", "lookup", key="z"),
            )
        ),
        Reply(blocks=(text("replayed: A paid"),)),
        Reply(blocks=(text("looking"), tool_call("r4", "lookup", key="b"))),
        Reply(blocks=(text("b, and C"),)),
    ]


async def test_a_replay_answers_equal_calls_from_the_record_and_denies_side_effects(
    host: Host, workspace: Path, providers: Any
) -> None:
    pay = Payments()
    source = await recorded_session(host, workspace, providers, pay)
    assert (pay.paid, pay.looked_up) == (["A"], ["a", "b"])
    source_bytes = source.trace_path.read_bytes()
    replay = providers(replay_script())
    report = await replay_session(host, source.id, tools=pay.tools, provider=replay)
    assert pay.paid == ["A"]  # the recorded payment was not made again, B was not made
    assert pay.looked_up == ["a", "b", "z"]  # a read-only call that matched nothing ran
    first, second = report.tasks
    assert [(c.name, c.outcome) for c in first.replay.calls] == [
        ("pay", "same"),
        ("pay", "denied"),
        ("lookup", "different"),
    ]
    assert [(c.name, c.outcome) for c in second.replay.calls] == [("lookup", "same")]
    assert report.outcomes() == {"same": 2, "different": 1, "denied": 1}
    # The model read the recorded result, and the note for the denied call.
    results = replay.requests[1].messages[-1]
    assert isinstance(results, UserMessage)
    assert any("paid A" in t for t in _result_texts(results))
    assert any(denied_note("pay") in t for t in _result_texts(results))
    # The steering of the recorded task's first turn reached the replay's second request.
    assert "also note C" in " ".join(texts_of(replay.requests[3].messages[-1]))
    assert second.undelivered == 0
    assert (first.original.answer, first.replay.answer) == ("paid A", "replayed: A paid")
    assert first.original.status == first.replay.status == "completed"
    assert source.trace_path.read_bytes() == source_bytes
    fork = host.get_session(report.replay_id)
    assert fork.forked_from == (source.id, 0)
    shown = render_report(report)
    assert "replayed: A paid" in shown and 'pay {"invoice":"B"} [denied]' in shown
    assert "1 denied" in shown
    assert json.loads(json.dumps(report.to_dict()))["tool_calls"]["same"] == 2


async def test_run_tools_runs_side_effecting_calls_that_match_nothing(
    host: Host, workspace: Path, providers: Any
) -> None:
    pay = Payments()
    source = await recorded_session(host, workspace, providers, pay)
    report = await replay_session(
        host, source.id, tools=pay.tools, provider=providers(replay_script()), run_tools=True
    )
    assert pay.paid == ["A", "B"]  # A still from the record; B ran because it was asked
    assert report.outcomes() == {"same": 2, "different": 2, "denied": 0}


def test_recorded_results_are_taken_in_order_by_canonical_arguments() -> None:
    calls = [
        RecordedCall(name="pay", arguments={"a": 1, "b": [1, "é"]}, status="ok"),
        RecordedCall(name="pay", arguments={"b": [1, "é"], "a": 1}, status="error", is_error=True),
        RecordedCall(name="pay", arguments={"a": 2}),  # no result: never answers
    ]
    results = RecordedResults(calls)
    assert call_key("pay", {"b": [1, "é"], "a": 1}) == 'pay\n{"a":1,"b":[1,"é"]}'
    assert results.take("pay", {"b": [1, "é"], "a": 1}) == calls[0]
    assert results.take("pay", {"a": 1, "b": [1, "é"]}) == calls[1]
    assert results.take("pay", {"a": 1, "b": [1, "é"]}) is None
    assert results.take("pay", {"a": 2}) is None
    assert recorded_tasks([]) == []


def _result_texts(message: UserMessage) -> list[str]:
    return [
        b.text
        for part in message.content
        if isinstance(part, ToolResult)
        for b in part.content
        if isinstance(b, TextBlock)
    ]
