"""A background subagent's answer is its LAST task's (R-TREE-1, R-TREE-2, R-TREE-4): a
child with a follow-up queued behind its task reports what the follow-up answered once
both have run, whether the run that spawned it follows it (live) or its task was taken
up by the next host (held by a drain, then ``resume_tasks``)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
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


def scout_model(answer: str, then: str, later: str) -> Callable[[ModelRequest], Reply]:
    """The root starts the scout in the background; the scout works (``slow``) and
    answers ``answer``; a run on it whose prompt says ``then`` answers ``later``."""

    def model(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        said = str(last.content) if isinstance(last, UserMessage) else ""
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            if then in said:
                return Reply(blocks=(text(later),))
            if _results(request):
                return Reply(blocks=(text(answer),))
            return Reply(blocks=(tool_call("w1", "slow", x=1),))
        if "[subagent scout finished]" in said:
            return Reply(blocks=(text("the root merged it"),))
        if _results(request):
            return Reply(blocks=(text("the scout works on it"),))
        scout = {"task": "scout the notes", "background": True, "name": "scout"}
        return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=scout),))

    return model


_model = scout_model("first answer", "then say bye", "second answer")
"""The scout answers ``first answer``; its follow-up ``then say bye`` answers ``second
answer``."""


async def _started_scout(root: Session, slow: SlowTool, follow_up: str | None) -> Session:
    """Run the root's task until the scout's ``slow`` runs, and queue the scout's
    ``follow_up`` (when there is one) behind its task."""
    root.run("scout through a subagent", approve=allow_all).detach()
    with trio.fail_after(RUN_TIMEOUT_S):
        await slow.started.wait()
        (scout,) = await root.children()
    if follow_up is not None:
        assert scout.follow_up(follow_up, approve=allow_all)
    return scout


async def drained_scout(
    data_dir: Path,
    workspace: Path,
    script: Callable[[ModelRequest], Reply],
    slow: SlowTool,
    follow_up: str | None = None,
) -> tuple[str, str]:
    """Start the scout (with ``follow_up`` queued behind its task, when given), then drain
    the host while the scout's call runs: the drain holds the scout at its boundary. The
    ids of the root and the scout."""
    model = ScriptedProvider(script)
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=model, tools=[slow.tool, spawn_subagent], workspace_dir=workspace
        )
        scout = await _started_scout(root, slow, follow_up)
        with trio.fail_after(RUN_TIMEOUT_S):
            await root.wait_idle()
            held = await drain_releasing(host, slow)
        assert held == [scout.id]
    return root.id, scout.id


@asynccontextmanager
async def taken_up(
    data_dir: Path,
    script: Callable[[ModelRequest], Reply],
    slow: SlowTool,
    ids: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    observers: Sequence[Callable[[Session], None]] = (),
) -> AsyncIterator[tuple[Session, trio.MemoryReceiveChannel[list[Output]]]]:
    """The next host on the data dir (its ``observers`` given), with the root of ``ids``
    (root, scout) loaded and watched, once it has taken up the scout's held task
    (``resume_tasks``): the root, and what it publishes from then on."""
    root_id, scout_id = ids
    tools: list[Any] = [slow.tool, spawn_subagent]
    # The host loads the taken-up sessions with the provider their session.json names.
    monkeypatch.setattr(scripted_brain, "demo_brain", script)
    async with Host.open(data_dir, tools=tools, observers=list(observers)) as host:
        root = await host.load_session(root_id, provider=ScriptedProvider(script), tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        assert await host.resume_tasks(approve=allow_all) == [scout_id]
        yield root, inbox


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
        await _started_scout(root, slow, "then say bye")
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
    ids = await drained_scout(data_dir, workspace, _model, slow, follow_up="then say bye")
    async with taken_up(data_dir, _model, slow, ids, monkeypatch) as (_, inbox):
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
    assert _reports(seen) == ["[subagent scout finished] second answer"]
