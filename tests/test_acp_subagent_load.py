"""An editor that loads a subagent whose host stopped (R-TREE-1, R-HITL-4, R-ACP-1): the
work the runtime takes up streams, and nothing else is waited for. A foreground child's
open task was its parent's call, settled with its parent's task (R-CLUSTER-2): it is not
taken up, and a prompt to the child runs as a task of its own. The ACP agent in-process,
with a scripted model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from conftest import allow_all, cut_after, open_host, trace_lines

from greenroom.actors.apps.acp import AcpConfig
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.scripted import ScriptedProvider, ScriptedStream
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from tests.test_acp_agent import TIMEOUT_S, Client, agent_on, said


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


async def stopped_foreground_child(data_dir: Path, workspace: Path, *, cut: bool) -> str:
    """A root whose foreground child counted the notes, on a host of ``data_dir`` that
    stopped: the child's id. With ``cut``, the child's trace ends after its
    ``task_start``: its host stopped while the child worked."""
    with trio.fail_after(TIMEOUT_S):
        async with open_host(data_dir) as host:
            root = await host.create_session(
                provider=ScriptedProvider(counting_tree),
                tools=[spawn_subagent],
                workspace_dir=workspace,
            )
            await root.run("count the notes", approve=allow_all).result()
            (child,) = await root.children()
    if cut:
        cut_after(child.trace_path, lambda record: record["type"] == "task_start")
    return child.id


@asynccontextmanager
async def loaded_by_an_editor(
    data_dir: Path, workspace: Path, child_id: str, provider: ScriptedProvider
) -> AsyncIterator[tuple[Host, Client]]:
    """The ACP agent over ``provider`` (spawn_subagent, every call allowed) on a host of
    ``data_dir``, whose client has loaded the child, for the block, which fails after
    TIMEOUT_S."""
    config = AcpConfig(provider=provider, tools=(spawn_subagent,), approve="all")
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(data_dir, config) as (host, client):
            load = {"sessionId": child_id, "cwd": str(workspace), "mcpServers": []}
            assert "result" in await client.call("session/load", load)
            yield host, client


async def prompt_to_count_again(client: Client, child_id: str) -> list[dict[str, str]]:
    """Prompt the child to count again: it answers end_turn, the editor shown its new
    count. The prompt's content."""
    prompt = [{"type": "text", "text": "count again"}]
    answer = await client.call("session/prompt", {"sessionId": child_id, "prompt": prompt})
    assert answer.get("result", {}).get("stopReason") == "end_turn", answer
    assert said(client).endswith("Four notes.")
    return prompt


async def test_a_foreground_child_its_host_stopped_in_answers_the_editors_prompt(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-1, R-HITL-4, R-ACP-1: the runtime leaves a foreground child's open task to its
    parent's call; loading the child waited for that task's end all the same, so the
    editor's prompt (and any follow-up after it) was never answered. Now each runs as a
    task of the child's."""
    child_id = await stopped_foreground_child(data_dir, workspace, cut=True)
    provider = ScriptedProvider(counting_tree)
    async with loaded_by_an_editor(data_dir, workspace, child_id, provider) as (host, client):
        assert not host.get_session(child_id).busy  # nothing was taken up
        prompt = await prompt_to_count_again(client, child_id)
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
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-1, R-ACP-1: the same child with its trace whole answers the prompt too."""
    child_id = await stopped_foreground_child(data_dir, workspace, cut=False)
    provider = ScriptedProvider(counting_tree)
    async with loaded_by_an_editor(data_dir, workspace, child_id, provider) as (_, client):
        await prompt_to_count_again(client, child_id)


async def test_resume_tasks_lists_no_foreground_child_whose_task_it_leaves(
    data_dir: Path, workspace: Path
) -> None:
    """R-HITL-4, R-TREE-1: a foreground child's open task is its parent's call's, and
    taking the stored tasks up leaves it (the child is loaded, idle). Before, the child was
    listed among the sessions resumed all the same; now only those taken up are."""
    child_id = await stopped_foreground_child(data_dir, workspace, cut=True)
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=data_dir) as host:
            assert await host.resume_tasks() == []
            assert not host.get_session(child_id).busy  # loaded, and nothing runs it
