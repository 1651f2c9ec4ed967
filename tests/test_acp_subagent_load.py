"""An editor that loads a subagent whose host stopped (R-TREE-1, R-HITL-4, R-ACP-1): the
work the runtime takes up streams, and nothing else is waited for. A foreground child's
open task was its parent's call, settled with its parent's task (R-CLUSTER-2): it is not
taken up, and a prompt to the child runs as a task of its own. The ACP agent in-process,
with a scripted model."""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import allow_all, cut_after, trace_lines

from greenroom.actors.apps.acp import AcpConfig
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.scripted import ScriptedProvider, ScriptedStream
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from tests.test_acp_agent import TIMEOUT_S, agent_on, said


async def counting_tree(request: ModelRequest, stream: ScriptedStream) -> None:
    """A root that has a foreground subagent count the notes, and the subagent."""
    users = [m for m in request.messages if isinstance(m, UserMessage)]
    last = "".join(p.text for p in users[-1].content if isinstance(p, TextBlock))
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        await stream.text("Four notes." if last.endswith("count again") else "Three notes.")
    elif any(isinstance(p, ToolResult) for p in users[-1].content):
        await stream.text("The scout counted.")
    else:
        arguments = {"task": "count the notes", "name": "scout"}
        await stream.tool_call(ToolCallBlock(id="p1", name="spawn_subagent", arguments=arguments))


async def stopped_foreground_child(tmp_path: Path, *, cut: bool) -> tuple[Path, Path, str]:
    """A root whose foreground child counted the notes (its workspace, data dir and the
    child's id); with ``cut``, the child's trace ends after its ``task_start``: its host
    stopped while the child worked."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    data = tmp_path / "data"
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=data) as host:
            root = await host.create_session(
                provider=ScriptedProvider(counting_tree),
                tools=[spawn_subagent],
                workspace_dir=workspace,
            )
            await root.run("count the notes", approve=allow_all).result()
            (child,) = await root.children()
    if cut:
        cut_after(child.trace_path, lambda record: record["type"] == "task_start")
    return workspace, data, child.id


async def test_a_foreground_child_its_host_stopped_in_answers_the_editors_prompt(
    tmp_path: Path,
) -> None:
    """R-TREE-1, R-HITL-4, R-ACP-1: the runtime leaves a foreground child's open task to its
    parent's call; loading the child waited for that task's end all the same, so the
    editor's prompt (and any follow-up after it) was never answered. Now each runs as a
    task of the child's."""
    workspace, data, child_id = await stopped_foreground_child(tmp_path, cut=True)
    provider = ScriptedProvider(counting_tree)
    config = AcpConfig(provider=provider, tools=(spawn_subagent,), approve="all")
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(data, config) as (host, client):
            load = {"sessionId": child_id, "cwd": str(workspace), "mcpServers": []}
            assert "result" in await client.call("session/load", load)
            assert not host.get_session(child_id).busy  # nothing was taken up
            prompt = [{"type": "text", "text": "count again"}]
            answer = await client.call("session/prompt", {"sessionId": child_id, "prompt": prompt})
            assert answer.get("result", {}).get("stopReason") == "end_turn", answer
            assert said(client).endswith("Four notes.")
            params = {"sessionId": child_id, "prompt": prompt}
            answer = await client.call("_greenroom/follow_up", params)
            assert answer.get("result", {}).get("stopReason") == "end_turn", answer
            child = host.get_session(child_id)
    records = trace_lines(child)
    assert [r["type"] for r in records].count("task_start") == 3
    ends = [r["status"] for r in records if r["type"] == "task_end"]
    assert ends == ["completed", "completed"]
    assert provider.violations == []


async def test_a_foreground_child_whose_task_ended_answers_the_editors_prompt(
    tmp_path: Path,
) -> None:
    """R-TREE-1, R-ACP-1: the same child with its trace whole answers the prompt too."""
    workspace, data, child_id = await stopped_foreground_child(tmp_path, cut=False)
    provider = ScriptedProvider(counting_tree)
    config = AcpConfig(provider=provider, tools=(spawn_subagent,), approve="all")
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(data, config) as (_, client):
            load = {"sessionId": child_id, "cwd": str(workspace), "mcpServers": []}
            assert "result" in await client.call("session/load", load)
            prompt = [{"type": "text", "text": "count again"}]
            answer = await client.call("session/prompt", {"sessionId": child_id, "prompt": prompt})
            assert answer.get("result", {}).get("stopReason") == "end_turn", answer
            assert said(client).endswith("Four notes.")
