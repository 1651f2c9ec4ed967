"""A background subagent's answer is its LAST task's (R-TREE-1, R-TREE-2, R-TREE-4): a
child with a follow-up queued behind its task reports what the follow-up answered once
both have run, whether the run that spawned it follows it (live) or its task was taken
up by the next host (held by a drain, then ``resume_tasks``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, open_host
from test_drain import SlowTool
from test_effectfix_drain import drain_releasing
from test_tree_takeup import _reports, _results, _until_task_end

from greenroom.actors.providers import scripted_brain
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import Output


def _model(request: ModelRequest) -> Reply:
    """The root starts the scout in the background; the scout works (``slow``) and
    answers ``first answer``; its follow-up ``then say bye`` answers ``second answer``."""
    last = request.messages[-1]
    said = str(last.content) if isinstance(last, UserMessage) else ""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if "then say bye" in said:
            return Reply(blocks=(text("second answer"),))
        if _results(request):
            return Reply(blocks=(text("first answer"),))
        return Reply(blocks=(tool_call("w1", "slow", x=1),))
    if "[subagent scout finished]" in said:
        return Reply(blocks=(text("the root merged it"),))
    if _results(request):
        return Reply(blocks=(text("the scout works on it"),))
    scout = {"task": "scout the notes", "background": True, "name": "scout"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=scout),))


async def _scout_with_a_follow_up(host: Host, root: Session, slow: SlowTool) -> Session:
    """Run the root's task until the scout's ``slow`` runs, and queue the scout's
    follow-up behind its task."""
    root.run("scout through a subagent", approve=allow_all).detach()
    with trio.fail_after(RUN_TIMEOUT_S):
        await slow.started.wait()
        (scout,) = await root.children()
    assert scout.follow_up("then say bye", approve=allow_all)
    return scout


async def test_a_live_child_reports_its_follow_ups_answer(data_dir: Path, workspace: Path) -> None:
    """R-TREE-2: the run that spawned it follows the scout through its follow-up."""
    slow = SlowTool()
    model = ScriptedProvider(_model)
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=model, tools=[slow.tool, spawn_subagent], workspace_dir=workspace
        )
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        await _scout_with_a_follow_up(host, root, slow)
        slow.release.set()
        with trio.fail_after(RUN_TIMEOUT_S):
            seen: list[Output] = []
            while not _reports(seen):
                seen += await _until_task_end(inbox)
    assert _reports(seen) == ["[subagent scout finished] second answer"]


async def test_a_taken_up_child_reports_its_follow_ups_answer(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-4: the host drains while the scout's call runs, with its follow-up queued:
    the scout is held at its boundary, both tasks open in its trace. The next host takes
    it up: it answers, runs its follow-up, and reports the follow-up's answer. Before,
    the report was the first task's answer, sent once the follow-up had run."""
    slow = SlowTool()
    model = ScriptedProvider(_model)
    tools: list[Any] = [slow.tool, spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(provider=model, tools=tools, workspace_dir=workspace)
        scout = await _scout_with_a_follow_up(host, root, slow)
        with trio.fail_after(RUN_TIMEOUT_S):
            await root.wait_idle()
            held = await drain_releasing(host, slow)
        assert held == [scout.id]

    # The host loads the taken-up sessions with the provider their session.json names.
    monkeypatch.setattr(scripted_brain, "demo_brain", _model)
    async with Host.open(data_dir, tools=tools) as host:
        root = await host.load_session(root.id, provider=model, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        assert await host.resume_tasks(approve=allow_all) == [scout.id]
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
    assert _reports(seen) == ["[subagent scout finished] second answer"]
