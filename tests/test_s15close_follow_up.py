"""A background subagent's answer that starts a follow-up task in its idle parent just
before the parent's close — the host's or its own — (R-TREE-2, R-DRAIN-1, R-HITL-4): the
answer's prompt is in the parent's trace, so the close must not end that task for good.
Before: the close interrupted it (``task_end`` aborted, a call it ran cut off), and the
next host found nothing to take up — the answer sat in the parent's trace, never
answered. Now the close holds the task at its next turn boundary (a call it runs
finishes first), open in its trace, and the next host's ``resume_tasks`` answers it, once,
running nothing again. The model is the scripted one; the order of the answer and the
close is forced with events."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, allow_all, open_host, port_of, trace_lines
from test_tree_takeup import _until_task_end

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime import supervisor
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import Output
from greenroom.protocols.tools import Tool, make_tool

ANSWER = "[subagent summer finished] the sum is 5"
MERGED = "merged: the sum is 5"


def _model(look: bool) -> ScriptedProvider:
    """The root spawns ``summer`` in the background and its task ends; the child waits in
    ``gate``, then answers; the root merges the answer — after a call of ``note`` when
    ``look``, so that its follow-up has two turns."""

    def reply(request: ModelRequest) -> Reply:
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            if len(request.messages) == 1:
                return Reply(blocks=(tool_call("g1", "gate"),))
            return Reply(blocks=(text("the sum is 5"),))
        last = request.messages[-1]
        if isinstance(last, UserMessage) and ANSWER in str(last.content):
            return Reply(blocks=(tool_call("n1", "note"),) if look else (text(MERGED),))
        if "noted" in str(last):
            return Reply(blocks=(text(MERGED),))
        if len(request.messages) > 1:
            return Reply(blocks=(text("the summer works on it"),))
        spawn = {"task": "add 2 and 3", "background": True, "name": "summer"}
        return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))

    return ScriptedProvider(reply)


class _Order:
    """The events that force the order: the child answers once ``let_child`` is set; the
    root's follow-up makes its prompt durable (``prompted``) or starts its ``note`` call
    (``noting``); the close then begins (``close_begun``), and that sync or call returns
    only once the close has reached the root (everything else waits)."""

    def __init__(self) -> None:
        self.let_child = trio.Event()
        self.prompted = trio.Event()
        self.noting = trio.Event()
        self.close_begun = trio.Event()
        self.notes: list[str] = []

    async def gate(self) -> str:
        """Waits until the test lets the child answer."""
        await self.let_child.wait()
        return "open"

    async def note(self) -> str:
        """A note to look at."""
        self.notes.append("noted")
        self.noting.set()
        await self.close_begun.wait()
        await trio.testing.wait_all_tasks_blocked()  # the close's interrupt has come
        return "noted"

    def tools(self) -> list[Tool]:
        return [make_tool(self.gate, parallel=True), make_tool(self.note, parallel=True)]

    def hold_the_prompts_sync(self, monkeypatch: pytest.MonkeyPatch, root_id: str) -> None:
        """The first sync of ``root_id``'s trace once the child may answer — its
        follow-up's prompt's (R-TRACE-3) — returns once the close has reached the root."""
        sync_trace = SessionPort.sync_trace

        async def held(port: SessionPort) -> None:
            await sync_trace(port)
            if port.id == root_id and self.let_child.is_set() and not self.prompted.is_set():
                self.prompted.set()
                await self.close_begun.wait()
                await trio.testing.wait_all_tasks_blocked()  # the close's interrupt has come

        monkeypatch.setattr(SessionPort, "sync_trace", held)

    async def close_after_the_answer(
        self, close: Callable[[], Awaitable[None]], *, look: bool
    ) -> None:
        self.let_child.set()  # its answer reaches the idle root: a follow-up task starts
        with trio.fail_after(RUN_TIMEOUT_S):
            await (self.noting if look else self.prompted).wait()
        self.close_begun.set()
        await close()


def _prompts(lines: list[dict[str, Any]]) -> list[str]:
    return [
        block["text"]
        for line in lines
        if line["type"] == "user_msg" and line["kind"] == "prompt"
        for block in line["content"]
    ]


def _merged(lines: list[dict[str, Any]]) -> int:
    return sum(
        1
        for line in lines
        if line["type"] == "model_msg" and line["block"] == {"type": "text", "text": MERGED}
    )


def _statuses(lines: list[dict[str, Any]]) -> list[str]:
    return [line["status"] for line in lines if line["type"] == "task_end"]


async def _answer_meets_the_close(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, order: _Order, *,
    look: bool, closer: str,
) -> Session:
    """Host 1: the root's task ends, its child waits; the child answers, and the close of
    the host (``closer`` ``"host"``) or of the root (``"session"``) begins once the root's
    follow-up has begun. Returns the root."""
    aclose = Host.aclose

    async def close_after_the_answer(self: Host) -> None:
        await order.close_after_the_answer(lambda: aclose(self), look=look)

    if closer == "host":
        monkeypatch.setattr(Host, "aclose", close_after_the_answer)
    tools = [*order.tools(), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=_model(look), tools=tools, workspace_dir=workspace
        )
        await root.run("sum it up", approve=allow_all).collect()
        if not look:
            order.hold_the_prompts_sync(monkeypatch, root.id)
        if closer == "session":
            await order.close_after_the_answer(
                lambda: host.close_session(root.id), look=look
            )
    monkeypatch.undo()
    return root


async def _resumed(
    data_dir: Path, root_id: str, order: _Order, *, look: bool
) -> list[dict[str, Any]]:
    """Host 2 opens the data dir with ``resume_tasks``: the root's trace once the task it
    took up has ended."""
    model = _model(look)
    send, inbox = trio.open_memory_channel[list[Output]](math.inf)

    def observe(session: Session) -> None:
        if session.id == root_id:
            port_of(session).provider = model
            port_of(session).watch(send)

    order.close_begun.set()  # nothing waits in ``note`` any more
    tools = [*order.tools(), spawn_subagent]
    async with Host.open(
        data_dir, resume_tasks=True, tools=tools, approve=allow_all, observers=[observe]
    ) as host:
        assert root_id in [session.id for session in host.sessions]  # it had work left
        root = host.get_session(root_id)
        with trio.fail_after(RUN_TIMEOUT_S):
            await _until_task_end(inbox)
            await root.wait_idle()
        return trace_lines(root)


@pytest.mark.parametrize("closer", ["host", "session"])
@pytest.mark.parametrize("stage", ["starting", "in_a_call"])
async def test_s15close_an_answer_taken_just_before_a_close_is_answered_once_after_it(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, stage: str, closer: str
) -> None:
    look = stage == "in_a_call"
    order = _Order()
    root = await _answer_meets_the_close(
        data_dir, workspace, monkeypatch, order, look=look, closer=closer
    )
    before = trace_lines(root)
    assert _prompts(before).count(ANSWER) == 1
    # Held open: the follow-up's task has no end (the root's first task has its own).
    assert _statuses(before) == ["completed"]
    assert before[-1]["type"] in {"task_start", "tool_call_output"}
    assert order.notes == (["noted"] if look else [])

    after = await _resumed(data_dir, root.id, order, look=look)
    assert _prompts(after).count(ANSWER) == 1  # the answer is input once
    assert _merged(after) == 1  # and answered once
    assert _statuses(after) == ["completed", "completed"]
    assert order.notes == (["noted"] if look else [])  # nothing run again


class _StuckOrder(_Order):
    async def note(self) -> str:
        """A note that never comes."""
        self.notes.append("noted")
        self.noting.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_s15close_a_held_follow_up_that_reaches_no_boundary_is_interrupted_in_time(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close holds the follow-up for :data:`CLOSE_HOLD_S` at most (here none): a call
    that never returns keeps it from its boundary, and the close then interrupts it as it
    interrupts any task — the call cut, the task ``aborted`` — instead of waiting for it
    for ever."""
    monkeypatch.setattr(supervisor, "CLOSE_HOLD_S", 0.0)
    order = _StuckOrder()
    with trio.fail_after(RUN_TIMEOUT_S):
        root = await _answer_meets_the_close(
            data_dir, workspace, monkeypatch, order, look=True, closer="host"
        )
    lines = trace_lines(root)
    assert _statuses(lines) == ["completed", "aborted"]
    assert lines[-1]["message"] == "session closed"
    (output,) = [line for line in lines if line["type"] == "tool_call_output"][-1:]
    assert output["call_id"] == "n1" and output["status"] != "ok"
