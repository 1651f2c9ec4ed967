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

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from conftest import RUN_TIMEOUT_S, allow_all, open_host, trace_lines
from test_recovery import blocking_tool
from test_x15_close_answers import ANSWER, _open_answer_taken_as_steering, _prompts, _resumed

from greenroom.actors.providers.scripted import ScriptedProvider, ScriptedStream, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import UserMsg


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


@asynccontextmanager
async def _open_answer_queued_behind_a_user_task(
    data_dir: Path, workspace: Path
) -> AsyncIterator[tuple[Host, Session, _Script, list[Any]]]:
    """A host (closed on leaving) with such a root (within the run's time limit), its
    script and its tools."""
    script = _Script()
    hold, held = blocking_tool()
    tools = [hold, spawn_subagent]
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            root = await _answer_queued_behind_a_user_task(host, script, workspace, tools, held)
            yield host, root, script, tools


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
    async with _open_answer_queued_behind_a_user_task(data_dir, workspace) as opened:
        _, root, script, tools = opened
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
    async with _open_answer_queued_behind_a_user_task(data_dir, workspace) as opened:
        host, root, script, tools = opened
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
    async with _open_answer_queued_behind_a_user_task(data_dir, workspace) as opened:
        _, root, _, _ = opened
        assert root.interrupt("stop", scope="node")
        await root.wait_idle()
    lines = trace_lines(root)
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "aborted"
    assert _queued_answer(lines) == []


async def test_s15close2_an_answer_in_the_steering_of_a_user_task_survives_close_session(
    data_dir: Path, workspace: Path
) -> None:
    """The answer came as steering of the root's task, which waits in its call; the root is
    closed alone (scope ``tree``): the task ends aborted and the answer is recorded queued
    (before: dropped with the steering), and the next host runs it."""
    async with _open_answer_taken_as_steering(data_dir, workspace) as opened:
        host, root, model, tools = opened
        await host.close_session(root.id)
        lines = trace_lines(root)
    assert [line["type"] for line in lines[-2:]] == ["task_end", "task_queued"]
    assert lines[-2]["status"] == "aborted"
    assert lines[-1]["content"] == [{"type": "text", "text": ANSWER}]
    seen, lines = await _resumed(data_dir, root, model, tools)
    assert _prompts(seen) == [ANSWER]
