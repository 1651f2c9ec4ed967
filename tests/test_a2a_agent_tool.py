"""A remote A2A agent as a tool (R-PROTO-1, ``--a2a-agent URL``): a session calls the A2A
server of another greenroom (``serve --a2a``, a real gateway on 127.0.0.1 with scripted
models) through the tool :func:`load_a2a_agent` makes from its agent card — streamed
(progress notes), continued in the same remote context, a remote approval answered by the
model or by this session's people, an interrupt that cancels the remote task — and what a
card that cannot be used does. The pure fold (``protocols/a2a_client.py``) at the end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import Lookup, allow_all, collect, of_type, result_text, results_of
from test_gateway import TOKEN, lookup_script, serving

from greenroom import Host, tool
from greenroom.actors.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.tools.a2a_agent import A2aAgentError, a2a_tools, load_a2a_agent
from greenroom.protocols.a2a_client import (
    CardError,
    RemoteCall,
    card_url,
    remote_agent,
    request,
    tool_name,
)
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import ApprovalRequest, TaskEnd, ToolCallOutput, ToolProgress

BOUND_S = 30.0
CONTEXT = re.compile(r"context_id=(\S+?)[,\]]")
TASK = re.compile(r"task_id=(\S+?)[,\]]")


def base_url(server: Any) -> str:
    return f"http://127.0.0.1:{server.gateway.port}"


def caller(name: str, *turns: dict[str, Any]) -> Any:
    """A caller's model: one call of the agent tool per turn (``turns`` give the
    arguments; a value ``"$context"`` / ``"$task"`` is taken from the last result), then
    the answer ``done``."""

    def step(request: ModelRequest) -> Reply:
        results = [r for m in request.messages for r in results_of(m)]
        if len(results) == len(turns):
            return Reply(blocks=(text("done"),))
        last = result_text(results[-1]) if results else ""
        arguments = dict(turns[len(results)])
        for key, pattern in (("context_id", CONTEXT), ("task_id", TASK)):
            if arguments.get(key) in ("$context", "$task"):
                found = pattern.search(last)
                assert found is not None, last
                arguments[key] = found.group(1)
        return Reply(blocks=(tool_call(f"c{len(results) + 1}", name, **arguments),))

    return step


async def test_a_remote_agent_answers_streams_and_goes_on_in_its_context(
    tmp_path: Path,
) -> None:
    """The tool is named after the card; the first call's answer comes back with the
    remote context and task ids and state completed, its statuses as progress notes on
    the way; a second call with that context_id is the same remote session's next task."""
    remote_script = lambda: [  # noqa: E731
        Reply(blocks=(text("It is sunny in Lyon."),)),
        Reply(blocks=(text("Tomorrow too."),)),
    ]
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path / "remote", remote_script, approve="all", a2a=True) as server,
            Host.open(tmp_path / "caller") as host,
        ):
            agent = await load_a2a_agent(base_url(server), token=TOKEN)
            assert agent.name == "a2a_greenroom"
            provider = ScriptedProvider(caller(agent.name, {"message": "weather in Lyon?"},
                                               {"message": "and tomorrow?",
                                                "context_id": "$context"}))
            session = await host.create_session(provider=provider, tools=[agent],
                                                workspace_dir=tmp_path)
            outputs = await collect(session.run("ask the weather agent", approve=allow_all))
    first, second = of_type(outputs, ToolCallOutput)
    assert first.status == second.status == "ok"
    answer, again = result_text(first), result_text(second)
    assert answer.startswith("It is sunny in Lyon.") and "state=completed" in answer
    assert again.startswith("Tomorrow too.")
    assert CONTEXT.search(answer).group(1) == CONTEXT.search(again).group(1)  # type: ignore[union-attr]
    assert any(p.call_id == "c1" for p in of_type(outputs, ToolProgress))
    (remote_provider,) = server.providers  # one remote session, two tasks
    assert len(remote_provider.requests) == 2
    assert of_type(outputs, TaskEnd)[-1].status == "completed"


async def test_the_model_answers_a_remote_approval_with_the_task_id(
    tmp_path: Path, lookup: Lookup
) -> None:
    """Without people deciding this session's calls, a remote approval comes back as the
    agent's question (input-required) with the ids; the model answers ``allow`` in a
    second call on that task, and the remote task completes."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path / "remote", lookup_script, tools=[lookup.tool], a2a=True) as server,
            Host.open(tmp_path / "caller") as host,
        ):
            agent = await load_a2a_agent(base_url(server), token=TOKEN)
            provider = ScriptedProvider(caller(
                agent.name, {"message": "look a up"},
                {"message": "allow", "context_id": "$context", "task_id": "$task"},
            ))
            session = await host.create_session(provider=provider, tools=[agent],
                                                workspace_dir=tmp_path)
            outputs = await collect(session.run("go", approve=allow_all))
    first, second = (result_text(o) for o in of_type(outputs, ToolCallOutput))
    assert "state=input-required" in first and "lookup" in first
    assert f"call {agent.name} again" in first
    assert second.startswith("Done.") and "state=completed" in second
    assert lookup.calls == ["a"]


async def test_people_answer_the_remote_agents_question_within_the_call(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-HITL-5: when people decide this session's calls, the agent's question is asked
    to them during the call; their answer goes to the remote task, which completes, and
    the call returns its answer — one call."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path / "remote", lookup_script, tools=[lookup.tool], a2a=True) as server,
            Host.open(tmp_path / "caller") as host,
        ):
            agent = await load_a2a_agent(base_url(server), token=TOKEN)
            provider = ScriptedProvider(caller(agent.name, {"message": "look a up"}))
            session = await host.create_session(provider=provider, tools=[agent],
                                                workspace_dir=tmp_path)
            outputs = []
            async for output in session.run("go", approve="people"):
                outputs.append(output)
                if isinstance(output, ApprovalRequest) and output.kind == "approval":
                    await host.answer_approval(session.id, output.call_id, "allow")
                elif isinstance(output, ApprovalRequest) and output.kind == "question":
                    assert "lookup" in output.arguments["question"]
                    await host.answer_question(session.id, output.call_id, "allow")
    (result,) = of_type(outputs, ToolCallOutput)
    assert result_text(result).startswith("Done.") and "state=completed" in result_text(result)
    assert [r.kind for r in of_type(outputs, ApprovalRequest)] == ["approval", "question"]
    assert lookup.calls == ["a"]


async def test_an_interrupt_cancels_the_remote_task(tmp_path: Path) -> None:
    """R-ABORT-1 across agents: interrupting the caller while the remote agent's tool runs
    ends the caller's task and sends tasks/cancel: the remote task ends aborted."""
    started = trio.Event()

    @tool(parallel=True)
    async def slow(key: str) -> str:
        """Take forever."""
        started.set()
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    remote_script = lambda: [Reply(blocks=(tool_call("r1", "slow", key="k"),))]  # noqa: E731
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path / "remote", remote_script, tools=[slow], approve="all",
                    a2a=True) as server,
            Host.open(tmp_path / "caller") as host,
        ):
            agent = await load_a2a_agent(base_url(server), token=TOKEN)
            provider = ScriptedProvider(caller(agent.name, {"message": "be slow"}))
            session = await host.create_session(provider=provider, tools=[agent],
                                                workspace_dir=tmp_path)
            stream = session.run("go", approve=allow_all)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, stream)
                await started.wait()
                session.interrupt("stop")
            (remote,) = server.host.sessions
            await remote.wait_idle()
            lines = [line for line in remote.trace_path.read_text().splitlines() if line]
    assert '"status":"aborted"' in lines[-1].replace(" ", "")


async def test_a_card_that_cannot_be_used_is_a_clear_error(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, a2a=False) as server:
            with pytest.raises(A2aAgentError, match="agent card answered HTTP"):
                await load_a2a_agent(base_url(server))
        with pytest.raises(A2aAgentError, match="cannot read the agent card"):
            await load_a2a_agent(base_url(server))  # nothing listens there any more


def test_the_command_line_reports_an_unreachable_agent_and_runs_on(tmp_path: Path) -> None:
    """R-MCP-6's rule for agents too: ``--a2a-agent`` whose card cannot be read is one
    line on stderr, and the run goes on."""
    done = subprocess.run(
        [sys.executable, "-m", "greenroom", "run", "--provider", "scripted", "--data-dir",
         str(tmp_path / "data"), "--workspace", str(tmp_path), "--a2a-agent",
         "http://127.0.0.1:9/", "--approve", "none", "hello"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--a2a-agent http://127.0.0.1:9/: cannot read the agent card" in done.stderr
    assert "Traceback" not in done.stderr
    warned: list[str] = []
    assert a2a_tools(["http://127.0.0.1:9"], warn=warned.append) == []
    assert len(warned) == 1


# -- the fold, pure ----------------------------------------------------------------------------


CARD = {"name": "Weather Desk", "url": "http://x/a2a", "description": "Weather.",
        "capabilities": {"streaming": True},
        "skills": [{"id": "w", "name": "forecast", "description": "a forecast"}]}


def test_a_card_gives_the_tool_its_name_and_description() -> None:
    agent = remote_agent(CARD, "card")
    assert (tool_name(agent), agent.streaming, agent.url) == ("a2a_weather_desk", True,
                                                              "http://x/a2a")
    assert "forecast: a forecast" in agent.tool_description()
    assert card_url("http://x/") == "http://x/.well-known/agent-card.json"
    assert card_url("http://x/card.json") == "http://x/card.json"
    for bad, why in (([], "not a JSON object"), ({"url": "http://x"}, "no name"),
                     ({"name": "n", "url": "ftp://x"}, "not an http")):
        with pytest.raises(CardError, match=why):
            remote_agent(bad, "card")


def test_the_fold_of_a_stream_keeps_ids_notes_and_the_answer() -> None:
    agent = remote_agent(CARD, "card")
    call = RemoteCall(agent, "a2a_weather_desk")
    task = {"kind": "task", "id": "t1", "contextId": "ctx", "status": {"state": "submitted"}}
    notes = [
        call.apply(task),
        call.apply({"kind": "status-update", "taskId": "t1", "contextId": "ctx",
                    "status": {"state": "working", "message": {
                        "parts": [{"kind": "data", "data": {"tool_call": {"name": "x"}}}]}}}),
        call.apply({"kind": "artifact-update", "taskId": "t1",
                    "artifact": {"artifactId": "a", "parts": [{"kind": "text", "text": "rain"}]}}),
        call.apply({"kind": "status-update", "taskId": "t1", "final": True,
                    "status": {"state": "completed",
                               "message": {"parts": [{"kind": "text", "text": "Wet."}]}}}),
        call.apply("garbage"),
        call.apply({"kind": "status-update", "status": "not an object"}),
    ]
    assert notes[0] is None and notes[1] == '{"tool_call":{"name":"x"}}'
    assert notes[2:4] == ["rain", "Wet."] and notes[4] is None
    assert call.outcome() == (
        "Wet.\n\nrain\n\n[a2a Weather Desk: state=completed, context_id=ctx, task_id=t1]"
    )
    sent = request(1, "hi", message_id="k-0", context_id="ctx", task_id=None, stream=False)
    assert sent["method"] == "message/send"
    assert sent["params"]["message"]["contextId"] == "ctx"
    assert "taskId" not in sent["params"]["message"]
