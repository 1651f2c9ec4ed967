"""A background subagent's answer handed to its parent as the host closes (R-TREE-2,
R-STEER-6, R-DRAIN-1): once the parent has taken it, it is in the parent's trace before
the close ends — a queued follow-up (``task_queued``) that the next host takes up — or the
parent never took it, and the one line the deliverer logs says where the answer is.
Before: the root, busy when a live child's answer came, dropped it with the close's
interrupt; a root that a taken-up child's report loaded while the close began ran its
follow-up where nothing wrote it; either way nothing of the answer was in the root's
trace and nothing was logged. The model is the scripted one; the order of the report
and the close is forced with trio events."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, open_host, port_of, trace_lines
from test_recovery import blocking_tool
from test_tree_takeup import _collect, _until_task_end

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port_builder import PortBuilder
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import Output, TaskEnd, UserMsg
from greenroom.protocols.people import PEOPLE

ANSWER = "[subagent summer finished] the sum is 5"


def _model(request: ModelRequest) -> Reply:
    """The child answers at once; the root spawns it in the background and waits in a
    call that only an interrupt ends; taken up by the next host, it merges the answer."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=(text("the sum is 5"),))
    last = request.messages[-1]
    said = str(last.content) if isinstance(last, UserMessage) else ""
    if "[subagent summer finished]" in said:
        return Reply(blocks=(text("merged: the sum is 5"),))
    spawn = {"task": "add 2 and 3", "background": True, "name": "summer"}
    return Reply(
        blocks=(
            ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),
            tool_call("h1", "hold", key="k"),
        )
    )


def _prompts(outputs: list[Output]) -> list[str]:
    return [
        block.text
        for o in outputs
        if isinstance(o, UserMsg) and o.origin is None and o.kind == "prompt"
        for block in o.content
        if isinstance(block, TextBlock)
    ]


@asynccontextmanager
async def _open_answer_taken_as_steering(
    data_dir: Path, workspace: Path
) -> AsyncIterator[tuple[Host, Session, ScriptedProvider, list[Any]]]:
    """A host (closed on leaving, within the run's time limit) with a root whose task waits
    in its call, its background child's answer taken as the task's steering; the root's
    model and tools."""
    hold, _ = blocking_tool()
    model = ScriptedProvider(_model)
    tools = [hold, spawn_subagent]
    told = trio.Event()
    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery, open_host(data_dir) as host:
            # The child leaves the host's open sessions just before its follower hands its
            # answer to the root, in the same step: once this is set, the root has it.
            host.on_closed = lambda session_id: told.set()
            root = await host.create_session(provider=model, tools=tools, workspace_dir=workspace)
            nursery.start_soon(_collect, root.run("sum it up", approve=allow_all))
            await told.wait()
            yield host, root, model, tools


async def _resumed(
    data_dir: Path, root: Session, provider: ScriptedProvider, tools: list[Any]
) -> tuple[list[Output], list[dict[str, Any]]]:
    """The root's outputs up to its task's end and its trace, taken up by the next host."""
    async with open_host(data_dir) as host:
        loaded = await host.load_session(root.id, provider=provider, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        loaded.watch(send)
        await host.resume(root.id, provider=provider, tools=tools, approve=allow_all)
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
        return seen, trace_lines(loaded)


async def test_x15_a_live_childs_answer_taken_by_a_busy_root_as_the_host_closes_runs_next_time(
    data_dir: Path, workspace: Path
) -> None:
    """The root's task waits in a call when its background child's answer comes (taken as
    steering), then the host closes: the root's task ends aborted and the answer is
    recorded as a queued follow-up (before: dropped with the close's interrupt, nowhere in
    the root's trace). The next host takes it up (``resume``): the root answers it."""
    async with _open_answer_taken_as_steering(data_dir, workspace) as opened:
        _, root, model, tools = opened
        # The host closes now, the root's task still waiting in its call.
    lines = trace_lines(root)
    assert [line["type"] for line in lines[-2:]] == ["task_end", "task_queued"]
    assert lines[-2]["status"] == "aborted"
    assert lines[-1]["content"] == [{"type": "text", "text": ANSWER}]
    queue_id = lines[-1]["queue_id"]

    seen, lines = await _resumed(data_dir, root, model, tools)
    assert _prompts(seen) == [ANSWER]
    (prompt,) = [o for o in seen if isinstance(o, UserMsg) and o.kind == "prompt"]
    assert prompt.queued_id == queue_id
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"
    answers = [line for line in lines if line["type"] == "model_msg"]
    assert answers[-1]["block"] == {"type": "text", "text": "merged: the sum is 5"}


def hold_loads_until_close(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """Make every session load (``PortBuilder.stored``) wait until a host's close has begun;
    the returned event is set once a load has started."""
    loading, closing = trio.Event(), trio.Event()
    stored, aclose = PortBuilder.stored, Host.aclose

    async def slow_load(self: PortBuilder, *args: Any, **kwargs: Any) -> Any:
        loading.set()
        await closing.wait()  # the close has begun: the host is closed, its sessions listed
        return await stored(self, *args, **kwargs)

    async def closing_host(self: Host) -> None:
        closing.set()
        await aclose(self)

    monkeypatch.setattr(PortBuilder, "stored", slow_load)
    monkeypatch.setattr(Host, "aclose", closing_host)
    return loading


async def test_x15_a_report_whose_parent_loads_as_the_host_closes_is_refused_and_logged(
    data_dir: Path,
    workspace: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A taken-up child's report loads its root (not open) and the host's close begins
    before that load ends: the root is opened where the close no longer looks, so it takes
    nothing — one WARNING line says where the answer is, no traceback (before: the root ran
    the answer as a follow-up nothing wrote, and nothing was logged)."""
    async with open_host(data_dir) as host:
        hello = ScriptedProvider(lambda request: Reply(blocks=(text("hello"),)))
        root = await host.create_session(provider=hello, workspace_dir=workspace)
        await root.run("hello").collect()
    before = trace_lines(root)

    loading = hold_loads_until_close(monkeypatch)
    caplog.set_level(logging.INFO)
    async with open_host(data_dir) as host:
        host.start_task(lambda: host.child_reports.deliver(root.id, "child1", ANSWER, PEOPLE))
        with trio.fail_after(RUN_TIMEOUT_S):
            await loading.wait()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
    (said,) = [r for r in caplog.records if r.name.endswith("child_reports")]
    assert said.levelno == logging.WARNING and "stays in its trace" in said.getMessage()
    assert trace_lines(root) == before


def _idle_root_model(request: ModelRequest) -> Reply:
    """The root spawns the child in the background and its task ends; the child answers."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=(text("the sum is 5"),))
    if len(request.messages) > 1:
        return Reply(blocks=(text("the summer works on it"),))
    spawn = {"task": "add 2 and 3", "background": True, "name": "summer"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))


async def test_x15_a_live_childs_answer_after_its_host_closed_is_logged_once(
    data_dir: Path,
    workspace: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A live background child ends ``completed`` just as its host is closed: its parent
    takes nothing, and one WARNING line says where the answer is (before: nothing said).
    The host counts as closed from the moment the child's ``task_end`` is published."""
    closed = trio.Event()
    monkeypatch.setattr(Host, "is_open", lambda self: not closed.is_set())

    def close_at_the_childs_end(batch: list[Output]) -> None:
        if any(isinstance(o, TaskEnd) and o.origin is None for o in batch):
            closed.set()

    def observe(session: Session) -> None:
        if session.parent_id is not None:
            port_of(session).subscribe(close_at_the_childs_end)

    forgotten = trio.Event()
    caplog.set_level(logging.INFO)
    model = ScriptedProvider(_idle_root_model)
    async with Host.open(data_dir, observers=[observe]) as host:
        # The child leaves the host's open sessions just before its follower decides where
        # its answer goes, in the same step.
        host.on_closed = lambda session_id: forgotten.set()
        root = await host.create_session(
            provider=model, tools=[spawn_subagent], workspace_dir=workspace
        )
        await root.run("sum it up", approve=allow_all).collect()
        with trio.fail_after(RUN_TIMEOUT_S):
            await forgotten.wait()
        lines = trace_lines(root)
    (said,) = [r for r in caplog.records if r.name.endswith("subagents")]
    assert said.levelno == logging.WARNING and said.exc_info is None
    assert "stays in its trace" in said.getMessage() and root.id in said.getMessage()
    assert ANSWER not in str(lines)
