"""Approvals answered by clients (the websocket gateway's path): with no ``approve``
callback, the session's client approver is asked, an ``approval_request`` output is
emitted for clients first, and its answer is recorded ``by: host`` (R-APPROVE-1); when no
client answers, the call is denied by default (R-APPROVE-2)."""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import collect, of_type

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.messages import Verdict
from greenroom.protocols.outputs import ApprovalDecision, ApprovalRequest, ToolCallOutput
from greenroom.protocols.tools import tool


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    return f"value of {key}"


def script() -> ScriptedProvider:
    return ScriptedProvider(
        [
            Reply(blocks=(text("Checking."), tool_call("c1", "lookup", key="a"))),
            Reply(blocks=(text("Done."),)),
        ]
    )


async def test_client_answer_is_requested_then_recorded(tmp_path: Path) -> None:
    asked: list[str] = []
    provider = script()

    async def clients(call: ToolCallBlock) -> Verdict | None:
        asked.append(call.id)
        return "allow"

    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=provider, tools=[lookup], workspace_dir=tmp_path
        )
        session.set_client_approver(clients)
        outputs = await collect(session.run("go"))
    assert asked == ["c1"]
    (request,) = of_type(outputs, ApprovalRequest)
    (decision,) = of_type(outputs, ApprovalDecision)
    assert request.call_id == "c1" and request.arguments == {"key": "a"}
    assert request.seq is not None and decision.seq is not None and request.seq < decision.seq
    assert (decision.decision, decision.by) == ("allow", "host")
    assert of_type(outputs, ToolCallOutput)[0].status == "ok"
    assert provider.violations == []


async def test_no_client_answer_denies_by_default(tmp_path: Path) -> None:
    async def nobody(call: ToolCallBlock) -> Verdict | None:
        await trio.lowlevel.checkpoint()
        return None

    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=script(), tools=[lookup], workspace_dir=tmp_path
        )
        session.set_client_approver(nobody)
        outputs = await collect(session.run("go"))
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("deny", "default")
    assert of_type(outputs, ToolCallOutput)[0].status == "denied"


async def test_no_client_present_means_no_request_and_default_deny(tmp_path: Path) -> None:
    """CONTRACT: `approval_request` only where a client is asked. With nobody there to
    answer, the call is denied by default and the approver is never awaited."""
    asked: list[str] = []

    async def clients(call: ToolCallBlock) -> Verdict | None:
        asked.append(call.id)
        return "allow"

    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=script(), tools=[lookup], workspace_dir=tmp_path
        )
        session.set_client_approver(clients, present=lambda: False)
        outputs = await collect(session.run("go"))
    assert asked == [] and of_type(outputs, ApprovalRequest) == []
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("deny", "default")
