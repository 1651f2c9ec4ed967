"""Client-side tools (R-PROTO-2's front-end tools, in the runtime): a tool a client runs
itself is offered to the model like any tool, and a call of one is never run here — it
waits, durable, for the client's result, given as the answer to the call's question,
whoever decides the session's other calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, Lookup, allow_all, of_type

from greenroom import Host
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.scripted import Reply, ScriptedProvider, text, tool_call
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
