"""A taken-up background child reports the answer of the task its parent spawned
(R-TREE-2, R-TREE-4), never that of a run someone starts on its session as that task
ends: the host takes the scout up after a drain held it (``resume_tasks``), and an
observer of the host starts a new run on the scout as it sees the taken-up task's
``task_end``. That run is the observer's, run to its end in the scout's open session, as
a live child's would be; the parent hears the taken-up task's answer once."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, open_host
from test_drain import SlowTool
from test_effectfix_drain import drain_releasing
from test_tree_takeup import _reports, _results, _until_task_end

from greenroom.actors.providers import scripted_brain
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import RunStream, Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd


def _model(request: ModelRequest) -> Reply:
    """The root starts the scout in the background; the scout works (``slow``) and
    answers ``the task's answer``; a run ``and again`` on it answers ``a later run's``."""
    last = request.messages[-1]
    said = str(last.content) if isinstance(last, UserMessage) else ""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if "and again" in said:
            return Reply(blocks=(text("a later run's answer"),))
        if _results(request):
            return Reply(blocks=(text("the task's answer"),))
        return Reply(blocks=(tool_call("w1", "slow", x=1),))
    if "[subagent scout finished]" in said:
        return Reply(blocks=(text("the root merged it"),))
    if _results(request):
        return Reply(blocks=(text("the scout works on it"),))
    scout = {"task": "scout the notes", "background": True, "name": "scout"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=scout),))


async def test_a_taken_up_child_run_again_as_its_task_ends_reports_that_tasks_answer(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-TREE-4: before, the follower of the taken-up scout read on into the
    observer's run, started as the task's ``task_end`` was published, and the root was
    told ``a later run's answer``; now it is told the task's own answer, once, and the
    observer's run still ends with its answer."""
    slow = SlowTool()
    model = ScriptedProvider(_model)
    tools: list[Any] = [slow.tool, spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(provider=model, tools=tools, workspace_dir=workspace)
        root.run("scout through a subagent", approve=allow_all).detach()
        with trio.fail_after(RUN_TIMEOUT_S):
            await slow.started.wait()
            (scout,) = await root.children()
            await root.wait_idle()
            held = await drain_releasing(host, slow)
        assert held == [scout.id]

    runs: list[RunStream] = []

    def run_again(session: Session) -> None:
        def listen(batch: list[Output]) -> None:
            ends = any(isinstance(o, TaskEnd) and o.origin is None for o in batch)
            if ends and session.id == scout.id and not runs:
                runs.append(session.run("and again", approve=allow_all))

        session.subscribe(listen)

    # The host loads the taken-up sessions with the provider their session.json names.
    monkeypatch.setattr(scripted_brain, "demo_brain", _model)
    async with Host.open(data_dir, tools=tools, observers=[run_again]) as host:
        root = await host.load_session(root.id, provider=model, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        assert await host.resume_tasks(approve=allow_all) == [scout.id]
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
            again = await collect(runs[0])
            await root.wait_idle()
    assert _reports(seen) == ["[subagent scout finished] the task's answer"]
    answers = [o.block for o in again if isinstance(o, ModelMsg) and o.origin is None]
    assert [getattr(block, "text", None) for block in answers] == ["a later run's answer"]
    assert [o.status for o in again if isinstance(o, TaskEnd)] == ["completed"]
