"""A close that interrupts a user's task keeps the background children's answers the
session has taken (R-TREE-2, R-HOST-3): each is recorded as a queued follow-up
(``task_queued``) that the next host's ``resume`` runs.

Before: an answer queued as a task behind the user's task (it came while the session ran a
manual compaction, which takes no steering, with the user's follow-up queued first) went
with the close's interrupt (``TaskMachine.interrupt`` dropped the queue before anything
recorded it), and ``close_session`` (scope ``tree``) dropped an answer in the task's
steering too: the child's task had ended, so the answer was lost for good. An interrupt a
user asks for still drops the queue (R-ABORT-1). The model is the scripted one; the order of
the answer, the follow-up and the close is forced with trio events."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import trio
from conftest import RUN_TIMEOUT_S, allow_all, open_host, trace_lines
from test_recovery import blocking_tool
from test_tree_takeup import _collect, _until_task_end

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import Output, UserMsg

ANSWER = "[subagent summer finished] the sum is 5"


class _Script:
    """The root spawns the child in the background, then (``go on``) waits in a call that
    only an interrupt ends; the child answers once ``child_go`` is set; a compaction
    answers once ``compact_go`` is set. Taken up by the next host, the root merges the
    answer."""

    def __init__(self) -> None:
        self.child_go = trio.Event()
        self.compacting = trio.Event()
        self.compact_go = trio.Event()
        self.provider = ScriptedProvider(self._step)

    async def _step(self, request: ModelRequest, stream: ScriptedStream) -> None:
        said = _said(request)
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            await self.child_go.wait()
            await stream.text("the sum is 5")
        elif "Summarize the conversation" in said:
            self.compacting.set()
            await self.compact_go.wait()
            await stream.text("[summary]the summer adds 2 and 3[/summary]")
        elif "[subagent summer finished]" in said:
            await stream.text("merged: the sum is 5")
        elif said == "sum it up":
            spawn = {"task": "add 2 and 3", "background": True, "name": "summer"}
            await stream.tool_call(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn))
            await stream.end("tool_use")
        elif "go on" in said:
            await stream.tool_call(tool_call("h1", "hold", key="k"))
            await stream.end("tool_use")
        else:
            await stream.text("the summer works on it")


def _said(request: ModelRequest) -> str:
    last = request.messages[-1]
    if not isinstance(last, UserMessage):
        return ""
    return "".join(b.text for b in last.content if isinstance(b, TextBlock))


def _prompts(outputs: list[Output]) -> list[str]:
    return [
        block.text
        for o in outputs
        if isinstance(o, UserMsg) and o.origin is None and o.kind == "prompt"
        for block in o.content
        if isinstance(block, TextBlock)
    ]


async def _answer_queued_behind_a_user_task(host: Host, script: _Script, workspace: Path,
                                            tools: list[Any], held: trio.Event) -> Session:
    """A root whose user task (``go on``) waits in its call, with its background child's
    answer queued as a task behind it: the answer came while a manual compaction ran (no
    steering), after ``go on`` was queued as a follow-up."""
    told = trio.Event()
    # The child leaves the host's open sessions just before its follower hands its answer
    # to the root, in the same step: once this is set, the root's inbox has it.
    host.on_closed = lambda session_id: told.set()
    root = await host.create_session(provider=script.provider, tools=tools,
                                     workspace_dir=workspace)
    await root.run("sum it up", approve=allow_all).collect()
    host.start_task(root.compact)
    await script.compacting.wait()
    assert root.follow_up("go on", approve=allow_all)
    script.child_go.set()
    await told.wait()
    script.compact_go.set()
    await held.wait()
    return root


async def _resumed(data_dir: Path, root: Session, provider: ScriptedProvider,
                   tools: list[Any]) -> tuple[list[Output], list[dict[str, Any]]]:
    """The root's outputs up to its task's end and its trace, taken up by the next host."""
    async with open_host(data_dir) as host:
        loaded = await host.load_session(root.id, provider=provider, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        loaded.watch(send)
        await host.resume(root.id, provider=provider, tools=tools, approve=allow_all)
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
        return seen, trace_lines(loaded)


def _queued_answer(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        line for line in lines
        if line["type"] == "task_queued"
        and line["content"] == [{"type": "text", "text": ANSWER}]
    ]


async def test_s15close2_an_answer_queued_behind_a_user_task_survives_the_hosts_close(
    data_dir: Path, workspace: Path
) -> None:
    """The host closes while the user's follow-up waits in its call, the child's answer
    queued behind it: the follow-up ends aborted and the answer is recorded queued (before:
    nowhere in the root's trace); the next host's ``resume`` runs it."""
    script = _Script()
    hold, held = blocking_tool()
    tools = [hold, spawn_subagent]
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            root = await _answer_queued_behind_a_user_task(host, script, workspace, tools, held)
    lines = trace_lines(root)
    ends = [line["status"] for line in lines if line["type"] == "task_end"]
    assert ends == ["aborted"]  # the compaction started the trace's next file
    (queued,) = _queued_answer(lines)

    seen, lines = await _resumed(data_dir, root, script.provider, tools)
    assert _prompts(seen) == [ANSWER]
    (prompt,) = [o for o in seen if isinstance(o, UserMsg) and o.kind == "prompt"]
    assert prompt.queued_id == queued["queue_id"]
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"


async def test_s15close2_an_answer_queued_behind_a_user_task_survives_close_session(
    data_dir: Path, workspace: Path
) -> None:
    """As above, the root closed alone (``close_session``, scope ``tree``) while its host
    stays open."""
    script = _Script()
    hold, held = blocking_tool()
    tools = [hold, spawn_subagent]
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            root = await _answer_queued_behind_a_user_task(host, script, workspace, tools, held)
            await host.close_session(root.id)
            lines = trace_lines(root)
    ends = [line["status"] for line in lines if line["type"] == "task_end"]
    assert ends == ["aborted"]  # the compaction started the trace's next file
    assert len(_queued_answer(lines)) == 1
    seen, lines = await _resumed(data_dir, root, script.provider, tools)
    assert _prompts(seen) == [ANSWER]


async def test_s15close2_a_users_interrupt_still_drops_the_answer_queued_behind_its_task(
    data_dir: Path, workspace: Path
) -> None:
    """R-ABORT-1, unchanged: the user's own interrupt (scope ``node``) of that task drops
    the queue, the child's answer with it; nothing of it is recorded, and the host's close
    that follows records nothing either."""
    script = _Script()
    hold, held = blocking_tool()
    tools = [hold, spawn_subagent]
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            root = await _answer_queued_behind_a_user_task(host, script, workspace, tools, held)
            assert root.interrupt("stop", scope="node")
            await root.wait_idle()
    lines = trace_lines(root)
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "aborted"
    assert _queued_answer(lines) == []


def _steering_model(request: ModelRequest) -> Reply:
    """The root spawns the child in the background and waits in a call that only an
    interrupt ends (the answer comes as its steering); taken up, it merges the answer."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=(text("the sum is 5"),))
    if "[subagent summer finished]" in _said(request):
        return Reply(blocks=(text("merged: the sum is 5"),))
    spawn = {"task": "add 2 and 3", "background": True, "name": "summer"}
    return Reply(
        blocks=(
            ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),
            tool_call("h1", "hold", key="k"),
        )
    )


async def test_s15close2_an_answer_in_the_steering_of_a_user_task_survives_close_session(
    data_dir: Path, workspace: Path
) -> None:
    """The answer came as steering of the root's task, which waits in its call; the root is
    closed alone (scope ``tree``): the task ends aborted and the answer is recorded queued
    (before: dropped with the steering), and the next host runs it."""
    hold, _ = blocking_tool()
    model = ScriptedProvider(_steering_model)
    tools = [hold, spawn_subagent]
    told = trio.Event()
    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery, open_host(data_dir) as host:
            host.on_closed = lambda session_id: told.set()
            root = await host.create_session(provider=model, tools=tools,
                                             workspace_dir=workspace)
            nursery.start_soon(_collect, root.run("sum it up", approve=allow_all))
            await told.wait()
            await host.close_session(root.id)
            lines = trace_lines(root)
    assert [line["type"] for line in lines[-2:]] == ["task_end", "task_queued"]
    assert lines[-2]["status"] == "aborted"
    assert lines[-1]["content"] == [{"type": "text", "text": ANSWER}]
    seen, lines = await _resumed(data_dir, root, model, tools)
    assert _prompts(seen) == [ANSWER]
