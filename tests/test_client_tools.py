"""Client-side tools (R-PROTO-2's front-end tools, in the runtime): a tool a client runs
itself is offered to the model like any tool, and a call of one is never run here — it
waits, durable, for the client's result, given as the answer to the call's question,
whoever decides the session's other calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, Lookup, allow_all, collect, of_type, open_host, trace_lines
from test_people import until_parked

from greenroom import Host
from greenroom.actors.runtime.client_tools_file import CLIENT_TOOLS_FILE, keep_client_tools
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.outputs import ApprovalDecision, ApprovalRequest, TaskEnd, ToolCallOutput
from greenroom.protocols.tools import client_tool

PICK = client_tool("pick_color", "Let the user pick a color.",
                   {"type": "object", "properties": {"hint": {"type": "string"}}})


async def test_a_client_tools_call_waits_for_the_clients_result(
    host: Host, workspace: Path, lookup: Lookup
) -> None:
    """Under a callback that allows everything, the client tool's call is still asked
    (kind question) and never run; the answer is its result and the task goes on."""
    provider = ScriptedProvider([
        Reply(blocks=(tool_call("c1", "pick_color", hint="warm"),)),
        Reply(blocks=(text("orange it is"),)),
    ])
    session = await host.create_session(provider=provider, tools=[lookup.tool],
                                        workspace_dir=workspace)
    session.set_client_tools([PICK])
    assert [t.name for t in session.tools] == ["lookup", "pick_color"]
    outputs: list[Any] = []
    with trio.fail_after(RUN_TIMEOUT_S):
        async for output in session.run("pick a color", approve=allow_all):
            outputs.append(output)
            if isinstance(output, ApprovalRequest):
                (pending,) = await host.pending_approvals()
                assert (pending.kind, pending.tool) == ("question", "pick_color")
                await host.answer_question(session.id, "c1", "orange", by="front-end")
    (request,) = of_type(outputs, ApprovalRequest)
    assert request.kind == "question" and request.arguments == {"hint": "warm"}
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by, decision.principal) == ("allow", "client", "front-end")
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.content[0].text == "orange"  # type: ignore[union-attr]
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert [t.name for t in provider.requests[0].tools][-1] == "pick_color"


async def test_client_tools_are_checked_and_replaced(
    host: Host, workspace: Path, lookup: Lookup
) -> None:
    session = await host.create_session(provider=ScriptedProvider([]), tools=[lookup.tool],
                                        workspace_dir=workspace)
    with pytest.raises(ConfigurationError, match="not a client-side tool"):
        session.set_client_tools([lookup.tool])
    with pytest.raises(ConfigurationError, match="the session has one"):
        session.set_client_tools([client_tool("lookup", "", {"type": "object"})])
    with pytest.raises(ConfigurationError, match="two client tools"):
        session.set_client_tools([PICK, PICK])
    session.set_client_tools([PICK])
    session.set_client_tools([])
    assert [t.name for t in session.tools] == ["lookup"]


def pick_then_look_up() -> list[Reply]:
    """A call of the client tool, then (its result given) an ordinary call, then the end."""
    return [
        Reply(blocks=(tool_call("c1", "pick_color", hint="warm"),)),
        Reply(blocks=(tool_call("l1", "lookup", key="orange"),)),
        Reply(blocks=(text("orange it is"),)),
    ]


async def test_a_client_tools_call_under_a_callback_parks_and_the_callback_decides_the_rest(
    host: Host, workspace: Path, lookup: Lookup
) -> None:
    """R-HITL-3: a task whose only wait is a client tool's call holds nothing, whatever
    decides its other calls: under a callback that allows everything it parks too (it
    held its supervisor and actors), and once the result wakes it the callback still
    decides its ordinary calls (``by: host``)."""
    session = await host.create_session(provider=ScriptedProvider(pick_then_look_up()),
                                        tools=[lookup.tool], workspace_dir=workspace)
    session.set_client_tools([PICK])
    stream = session.run("pick a color", approve=allow_all)
    await until_parked(host, session.id)
    await host.answer_question(session.id, "c1", "orange", by="front-end")
    outputs = await collect(stream)
    assert [(d.call_id, d.by) for d in of_type(outputs, ApprovalDecision)] == [
        ("c1", "client"), ("l1", "host")
    ]
    assert lookup.calls == ["orange"]
    assert of_type(outputs, TaskEnd)[-1].status == "completed"


@pytest.mark.parametrize("again", ["closed", "restarted"])
async def test_a_client_tools_call_under_a_callback_waits_across_a_close_and_a_restart(
    data_dir: Path, workspace: Path, again: str
) -> None:
    """R-HITL-1, R-HOST-3: the client's result is a durable question whoever decides the
    session's other calls: under a callback that allows everything, closing the session
    (or the host) aborted the task and denied the call (``by: default``), and the result
    found nothing pending. The call waits on: the session loaded again (or the host
    opened again) takes the result, and the task completes."""
    script = [Reply(blocks=(tool_call("c1", "pick_color", hint="warm"),)),
              Reply(blocks=(text("orange it is"),))]
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=ScriptedProvider(script[:1]),
                                            workspace_dir=workspace)
        session.set_client_tools([PICK])
        asked = trio.Event()

        def on_batch(batch: list[Any]) -> None:
            if any(isinstance(output, ApprovalRequest) for output in batch):
                asked.set()

        session.subscribe(on_batch)
        session.run("pick a color", approve=allow_all).detach()
        with trio.fail_after(RUN_TIMEOUT_S):
            await asked.wait()
        if again == "closed":
            await host.close_session(session.id)
            await answer_loaded_again(host, session.id, ScriptedProvider(script[1:]))
    if again == "restarted":
        async with open_host(data_dir) as host:
            # Taken up as serve --approve all's host takes each: it parks again.
            await host.resume(session.id, approve=allow_all,
                              provider=ScriptedProvider(script[1:]))
            await until_parked(host, session.id)
            await answer_loaded_again(host, session.id, ScriptedProvider([]))


@pytest.mark.parametrize("kept", ["whole", "unreadable"])
async def test_kept_client_tools_reach_the_session_whatever_loads_it(
    host: Host, workspace: Path, kept: str
) -> None:
    """R-PROTO-2, R-HITL-4: a session's kept client tools came back only when the AG-UI
    endpoint loaded it; a session the host loads (``Host.load_session``, as an answer,
    a gateway call or ``resume_tasks`` does) has them now. A kept file that cannot be
    read leaves them out — the session loads whole — and ``load_errors`` says why."""
    session = await host.create_session(
        provider=ScriptedProvider([Reply(blocks=(text("hi"),))]), workspace_dir=workspace
    )
    await collect(session.run("hello"))
    session.set_client_tools([PICK])
    await keep_client_tools(host.port(session.id))
    assert (session.directory / CLIENT_TOOLS_FILE).stat().st_mode & 0o777 == 0o600
    await host.close_session(session.id)
    if kept == "unreadable":
        (session.directory / CLIENT_TOOLS_FILE).write_text("[{", encoding="utf-8")
    loaded = await host.load_session(session.id, provider=ScriptedProvider([]))
    assert len(loaded.transcript.messages) == 2  # its conversation, whatever the file
    if kept == "whole":
        assert [t.name for t in loaded.tools] == ["pick_color"]
        assert list(loaded.load_errors) == []
    else:
        assert loaded.tools == ()
        (problem,) = loaded.load_errors
        assert CLIENT_TOOLS_FILE in problem and "left out" in problem


async def answer_loaded_again(host: Host, session_id: str, provider: ScriptedProvider) -> None:
    """Give ``c1`` its result in ``session_id`` loaded again (with ``provider`` unless it is
    open) with the client tool: the task takes it up and completes."""
    loaded = await host.load_session(session_id, provider=provider)
    loaded.set_client_tools([PICK])
    assert [(p.call_id, p.kind) for p in await host.pending_approvals()] == [("c1", "question")]
    await host.answer_question(session_id, "c1", "orange", by="front-end")
    with trio.fail_after(RUN_TIMEOUT_S):
        await loaded.wait_idle()
    (result,) = [line for line in trace_lines(loaded) if line["type"] == "tool_call_output"]
    assert result["call_id"] == "c1" and "orange" in json.dumps(result["content"])
    ends = [line["status"] for line in trace_lines(loaded) if line["type"] == "task_end"]
    assert ends == ["completed"]


class SlowTerminal:
    """An approve callback that allows every call and answers the model's questions
    (``answer_question``) with ``blue`` once ``let_answer`` is set."""

    def __init__(self) -> None:
        self.let_answer = trio.Event()

    def __call__(self, call: object) -> str:
        return "allow"

    async def answer_question(self, call: ToolCallBlock) -> str:
        await self.let_answer.wait()
        return "blue"


async def test_a_task_whose_callback_asks_its_own_person_does_not_park(
    host: Host, workspace: Path
) -> None:
    """R-HITL-3, R-HITL-5: only questions answered from outside the task let a task under a
    callback park: an ``ask_user`` question the callback asks its own person (a terminal)
    waits in the task's broker, which parking would cancel — its answer then came to
    nobody and the task waited for ever."""
    provider = ScriptedProvider([Reply(blocks=(tool_call("q1", "ask_user", question="?"),)),
                                 Reply(blocks=(text("Noted."),))])
    session = await host.create_session(provider=provider, tools=[ask_user],
                                        workspace_dir=workspace)
    asked = trio.Event()

    def on_batch(batch: list[Any]) -> None:
        if any(isinstance(output, ApprovalRequest) for output in batch):
            asked.set()

    session.subscribe(on_batch)
    terminal = SlowTerminal()
    stream = session.run("ask me", approve=terminal)
    with trio.fail_after(RUN_TIMEOUT_S):
        await asked.wait()
        await trio.testing.wait_all_tasks_blocked()  # the supervisor has settled its wait
    assert not host.port(session.id).parked
    terminal.let_answer.set()
    outputs = await collect(stream)
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.content[0].text == "blue"  # type: ignore[union-attr]
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
