"""Closing one run's stream interrupts that run, not the session's tree (R-TREE-2,
R-ABORT-1): ``RunStream.aclose()`` ends the task it reads — and its foreground
children — as ``interrupt(scope="node")`` does; a background subagent an earlier run
started runs on, and its answer still reaches the session (a follow-up task). Before,
the close interrupted with scope ``tree``, which ended the background child too."""

from __future__ import annotations

import math
from pathlib import Path

import trio
from conftest import RUN_TIMEOUT_S, Gates, allow_all, open_host, trace_lines
from test_tree_takeup import _reports, _results, _until_task_end

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import Output


def _model(request: ModelRequest) -> Reply:
    """The first run starts the scout in the background (it waits on ``wait("scout")``);
    the second run waits on ``wait("root")``; the scout's answer is merged."""
    first = request.messages[0]
    task = str(first.content) if isinstance(first, UserMessage) else ""
    last = request.messages[-1]
    said = str(last.content) if isinstance(last, UserMessage) else ""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if _results(request):
            return Reply(blocks=(text("scouted"),))
        return Reply(blocks=(tool_call("w1", "wait", key="scout"),))
    if "[subagent scout finished]" in said:
        return Reply(blocks=(text("merged the scout's answer"),))
    if "wait a while" in said:
        return Reply(blocks=(tool_call("w2", "wait", key="root"),))
    if _results(request) and "scout" in task:
        return Reply(blocks=(text("the scout works on it"),))
    scout = {"task": "scout the notes", "background": True, "name": "scout"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=scout),))


async def test_closing_a_runs_stream_leaves_an_earlier_background_child_running(
    data_dir: Path, workspace: Path, gates: Gates
) -> None:
    model = ScriptedProvider(_model)
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=model, tools=[gates.tool(), spawn_subagent], workspace_dir=workspace
        )
        with trio.fail_after(RUN_TIMEOUT_S):
            root.run("scout the notes", approve=allow_all).detach()
            await gates.started("scout")
            await root.wait_idle()
            (scout,) = await root.children()
            send, inbox = trio.open_memory_channel[list[Output]](math.inf)
            root.watch(send)
            async with root.run("wait a while", approve=allow_all):
                await gates.started("root")
            await root.wait_idle()
            # Closed: the second run ended aborted; the scout worked on, to its end.
            (ended,) = [line for line in trace_lines(root) if line["type"] == "task_end"][1:]
            assert ended["status"] == "aborted"
            gates.release("scout")
            await scout.wait_idle()
            scout_ends = [line["status"] for line in trace_lines(scout)
                          if line["type"] == "task_end"]  # fmt: skip
            assert scout_ends == ["completed"]
            seen: list[Output] = []
            while not _reports(seen):
                seen += await _until_task_end(inbox)
    assert _reports(seen) == ["[subagent scout finished] scouted"]
