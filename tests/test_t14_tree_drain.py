"""A drain on a host alone (R-DRAIN-1, R-TREE-2, R-HITL-3): a background subagent whose
task has answered and waits for its own background child, parked on a person's
approval, comes to rest with it. The child stays parked (its request pending in its
trace), the waiting subagent is held open in its trace, and the drain returns at once,
not when its grace runs out; the next host takes the subagent up, waiting for the child
as before, and the person's answer still completes the tree."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, open_host, trace_lines
from test_tree_takeup import _reports, _results, _until_task_end

from greenroom.actors.providers import scripted_brain
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import ApprovalRequest, ModelMsg, Output
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool, make_tool


def _model(request: ModelRequest) -> Reply:
    """The root starts the payer in the background; the payer starts the collector in
    the background and says it waits; the collector pays (a person must allow it)."""
    last = request.messages[-1]
    said = str(last.content) if isinstance(last, UserMessage) else ""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if "collect 3" in str(request.messages[0].content):
            if _results(request):
                return Reply(blocks=(text("collected 3"),))
            return Reply(blocks=(tool_call("c1", "pay", amount=3),))
        if "[subagent collector finished]" in said:
            return Reply(blocks=(text("merged: collected 3"),))
        if _results(request):
            return Reply(blocks=(text("waiting for the collector"),))
        collect = {"task": "collect 3", "background": True, "name": "collector"}
        return Reply(blocks=(ToolCallBlock(id="s2", name="spawn_subagent", arguments=collect),))
    if "[subagent payer finished]" in said:
        return Reply(blocks=(text("the payer reported"),))
    if _results(request):
        return Reply(blocks=(text("the payer works on it"),))
    spawn = {"task": "pay through a collector", "background": True, "name": "payer"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))


def _pay_tool(paid: list[int]) -> Tool:
    async def pay(amount: int) -> str:
        """Pay an amount."""
        paid.append(amount)
        return f"paid {amount}"

    return make_tool(pay, parallel=False)


async def _until_the_collector_parks(host: Host, root: Session) -> tuple[str, str]:
    """Run the root's task (a person allows each spawn) until the collector waits for a
    person with nothing running; the ids of the payer and the collector."""
    send, inbox = trio.open_memory_channel[list[Output]](math.inf)
    root.watch(send)
    with trio.fail_after(RUN_TIMEOUT_S):
        root.run("pay 3 through subagents", approve=PEOPLE).detach()
        asked_to_pay = payer_waits = False
        async for batch in inbox:
            asked = [o for o in batch if isinstance(o, ApprovalRequest)]
            for spawn in (o for o in asked if o.tool == "spawn_subagent"):
                node = root.id if spawn.origin is None else spawn.origin[-1]
                await host.answer_approval(node, spawn.call_id, "allow")
            asked_to_pay = asked_to_pay or any(o.tool == "pay" for o in asked)
            payer_waits = payer_waits or any(
                isinstance(o, ModelMsg) and "waiting for the collector" in str(o.block)
                for o in batch
            )
            if asked_to_pay and payer_waits:
                break
        (payer,) = await root.children()
        (collector,) = await payer.children()
        await collector.wait_idle()
        await root.wait_idle()
        await trio.testing.wait_all_tasks_blocked()
    inbox.close()
    assert host.port(collector.id).parked
    assert host.port(payer.id).machine.waiting_for == "children"
    return payer.id, collector.id


async def test_a_subagent_waiting_for_its_parked_child_is_held_and_the_drain_returns(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-DRAIN-1, R-TREE-2: before, the payer's task waited for its parked collector for
    the drain's whole grace (here: for ever), and the stop that followed ended it
    aborted. Now the drain returns with the payer held, its task open in its trace, the
    collector's request pending; the next host takes the tree up, a person allows the
    pay call, and the collector's answer reaches the payer's same task, whose merged
    answer reaches the root."""
    paid: list[int] = []
    model = ScriptedProvider(_model)
    tools: list[Any] = [_pay_tool(paid), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(provider=model, tools=tools, workspace_dir=workspace)
        payer_id, collector_id = await _until_the_collector_parks(host, root)
        with trio.fail_after(RUN_TIMEOUT_S):
            held = await host.drain(grace_s=math.inf)
        assert held == [payer_id]
        payer_lines = trace_lines(host.get_session(payer_id))
    assert [line["type"] for line in payer_lines].count("task_start") == 1
    assert not [line for line in payer_lines if line["type"] == "task_end"]

    # The host loads the taken-up sessions with the provider their session.json names.
    monkeypatch.setattr(scripted_brain, "demo_brain", _model)
    async with Host.open(data_dir, tools=tools) as host:
        root = await host.load_session(root.id, provider=model, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        await host.resume_tasks()
        (pending,) = await host.pending_approvals()
        assert (pending.session_id, pending.call_id) == (collector_id, "c1")
        await host.answer_approval(collector_id, "c1", "allow")
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
        payer_lines = trace_lines(await host.load_session(payer_id))
    assert paid == [3]
    assert _reports(seen) == ["[subagent payer finished] merged: collected 3"]
    ends = [line["status"] for line in payer_lines if line["type"] == "task_end"]
    assert ends == ["completed"]
