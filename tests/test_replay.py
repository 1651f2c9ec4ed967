"""Replay a recorded session on another model (R-FORK-3) against the scripted model: the
recorded prompts, steering and follow-ups run again in a fork; an equal call gets the
recorded result and runs zero times, another side-effecting call is denied unless asked,
a read-only one runs; the report puts both sides next to each other."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import trio
from conftest import (
    RUN_TIMEOUT_S,
    Recorder,
    allow_all,
    collect,
    last_user,
    texts_of,
    trace_lines,
)

from greenroom.actors.apps.replay import denied_note, replay_session
from greenroom.actors.providers.scripted import Reply, ScriptedStream, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
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


MCP_SERVER = {
    "command": sys.executable,
    "args": [str(Path(__file__).resolve().parent / "support" / "mcp_server.py")],
}


def tool_output(session: Session, call_id: str) -> dict[str, Any]:
    """The ``tool_call_output`` record of ``call_id`` in ``session``'s trace."""
    lines = trace_lines(session)
    return next(r for r in lines if r["type"] == "tool_call_output" and r["call_id"] == call_id)


async def test_a_replay_decides_the_calls_of_mcp_tools_as_it_decides_its_own(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-FORK-3 (``greenroom replay --mcp-config``): the MCP servers reached the fork past
    the replay's wrapper, so an equal call of the side-effecting ``structured`` ran on the
    server again instead of taking the recorded result, and a call with other arguments
    ran instead of being denied. Now only the recorded call ever ran; a read-only MCP tool
    still runs."""
    source = await host.create_session(
        provider=providers(
            [
                Reply(blocks=(tool_call("c1", "mcp__t__structured", a=1, b=2),)),
                Reply(blocks=(text("3"),)),
            ]
        ),
        workspace_dir=workspace,
        mcp_servers={"t": MCP_SERVER},
    )
    await collect(source.run("add 1 and 2", approve=allow_all))
    replay = providers(
        [
            Reply(
                blocks=(
                    tool_call("r1", "mcp__t__structured", a=1, b=2),
                    tool_call("r2", "mcp__t__structured", a=5, b=5),
                )
            ),
            Reply(blocks=(tool_call("r3", "mcp__t__calls"),)),
            Reply(blocks=(text("done"),)),
        ]
    )
    report = await replay_session(
        host, source.id, tools=[], provider=replay, mcp_servers={"t": MCP_SERVER}
    )
    assert [(c.name, c.outcome) for c in report.tasks[0].replay.calls] == [
        ("mcp__t__structured", "same"),
        ("mcp__t__structured", "denied"),
        ("mcp__t__calls", "different"),
    ]
    fork = host.get_session(report.replay_id)
    ran = json.loads(tool_output(fork, "r3")["content"][0]["text"])
    assert ran.count("structured") == 1  # the recording's call alone
    assert denied_note("mcp__t__structured") in tool_output(fork, "r2")["content"][0]["text"]


async def test_an_mcp_tool_a_server_lists_during_a_replay_is_decided_too(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-FORK-3, R-MCP-4: a tool list that changes while the replay runs is swapped in at
    the next turn boundary; the tools it brings are decided by the replay like the others,
    so a call of the new side-effecting tool is denied, not run."""
    source = await host.create_session(
        provider=providers(
            [
                Reply(blocks=(tool_call("c1", "mcp__t__echo", text="hi"),)),
                Reply(blocks=(text("hi"),)),
            ]
        ),
        workspace_dir=workspace,
        mcp_servers={"t": MCP_SERVER},
    )
    await collect(source.run("echo hi", approve=allow_all))

    async def add_a_tool_then_echo(request: ModelRequest, stream: ScriptedStream) -> None:
        server = next(c for c in host._builder.mcp.connections() if c.name == "t")
        listed = trio.Event()
        server.listeners.add(listed.set)
        await server.call("add_tool", {"tool": "later"}, None)
        with trio.fail_after(RUN_TIMEOUT_S):
            await listed.wait()
        await stream.block(tool_call("r1", "mcp__t__echo", text="hi"))
        await stream.end("tool_use")

    replay = providers(
        [
            add_a_tool_then_echo,
            Reply(blocks=(tool_call("r2", "mcp__t__later"),)),
            Reply(blocks=(text("done"),)),
        ]
    )
    report = await replay_session(
        host, source.id, tools=[], provider=replay, mcp_servers={"t": MCP_SERVER}
    )
    assert "mcp__t__later" in {t.name for t in replay.requests[1].tools}
    assert [(c.name, c.outcome) for c in report.tasks[0].replay.calls] == [
        ("mcp__t__echo", "same"),
        ("mcp__t__later", "denied"),
    ]
    later = tool_output(host.get_session(report.replay_id), "r2")
    assert denied_note("mcp__t__later") in later["content"][0]["text"]


async def test_a_parallel_safe_tool_with_side_effects_is_denied_in_a_replay(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-FORK-3: the replay took ``parallel`` for "read-only", so a tool declared
    ``side_effects=True`` yet parallel-safe (as the A2A agent tool and spawn_subagent
    are) ran for a call the record did not answer. A tool with side effects is denied
    whatever its ``parallel``; one without them runs."""
    sent: list[str] = []

    async def send_mail(to: str) -> str:
        """Send a mail."""
        sent.append(to)
        return f"sent to {to}"

    mail = make_tool(send_mail, parallel=True, side_effects=True)
    source = await host.create_session(
        provider=providers(
            [Reply(blocks=(tool_call("c1", "send_mail", to="ann"),)), Reply(blocks=(text("sent"),))]
        ),
        tools=[mail],
        workspace_dir=workspace,
    )
    await collect(source.run("mail ann", approve=allow_all))
    replay = providers(
        [Reply(blocks=(tool_call("r1", "send_mail", to="bob"),)), Reply(blocks=(text("sent"),))]
    )
    report = await replay_session(host, source.id, tools=[mail], provider=replay)
    assert sent == ["ann"]  # the recording's mail alone
    assert [c.outcome for c in report.tasks[0].replay.calls] == ["denied"]
    assert any(denied_note("send_mail") in t for t in _result_texts(last_user(replay.requests[1])))


async def test_a_replay_holds_each_task_to_its_recorded_output_schema(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-FORK-3, R-OUT-1: a replay runs the recorded task's inputs, its output schema
    among them. The replay asked for free text and took a non-JSON answer as
    ``completed``; now its request asks for the schema, its ``task_start`` records it,
    and an answer that never matches fails the task as it would have failed the
    recorded one."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    source = await host.create_session(
        provider=providers([Reply(blocks=(text(json.dumps({"n": 2})),))]), workspace_dir=workspace
    )
    recorded = await source.run("how many?", output_schema=schema).result()
    assert recorded.task_end.output == {"n": 2}
    replay = providers(lambda request: Reply(blocks=(text("two, I think"),)))
    report = await replay_session(host, source.id, tools=[], provider=replay)
    assert all(request.output is not None for request in replay.requests)
    fork = host.get_session(report.replay_id)
    (start,) = [r for r in trace_lines(fork) if r["type"] == "task_start"]
    assert start["output_schema"] == schema
    assert report.tasks[0].replay.status == "failed"
    assert report.tasks[0].original.status == "completed"


def _result_texts(message: UserMessage) -> list[str]:
    return [
        b.text
        for part in message.content
        if isinstance(part, ToolResult)
        for b in part.content
        if isinstance(b, TextBlock)
    ]
