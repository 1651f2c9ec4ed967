"""Agent trees (R-TREE-1..3): subagents to the default depth of 3, every node a session
reached through its own handle, children in the background whose answers come back as
input, interrupt scopes, and token budgets that hold for a whole subtree.

One scripted provider serves every node of a tree: the script tells the nodes apart by the
task in their first user message (a subagent's system prompt starts with
:data:`SUBAGENT_SYSTEM`). Children that must stay running wait on ``trio.Event``s inside
their model stream; the test waits for what it needs to see (outputs through a
:class:`Recorder`, or the host's open sessions) with the other tasks run to a standstill,
never for a length of time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import (
    RUN_TIMEOUT_S,
    Gates,
    Lookup,
    Recorder,
    allow_all,
    collect,
    of_type,
    open_host,
    port_of,
    result_text,
    results_of,
    texts_of,
    trace_lines,
)
from test_subagents import (
    child_ids,
    child_trace,
    has_results,
    is_child,
    output_text,
    outputs_from,
    spawn_outputs,
    task_of,
)

from greenroom.actors.apps.asking import TerminalApprover
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ModelMsg,
    Output,
    TaskEnd,
    UserMsg,
)
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.stream import TokenUsage


def spawn(
    call_id: str, task: str, *, background: bool = False, name: str | None = None
) -> ToolCallBlock:
    arguments: dict[str, object] = {"task": task}
    if background:
        arguments["background"] = True
    if name is not None:
        arguments["name"] = name
    # Built by hand: tool_call() takes the tool's name as its own ``name``.
    return ToolCallBlock(id=call_id, name=SPAWN_SUBAGENT, arguments=arguments)


def last_texts(request: ModelRequest) -> str:
    """Every text of the last user message (a prompt, or steering sent with results)."""
    last = request.messages[-1]
    return "\n".join(texts_of(last)) if isinstance(last, UserMessage) else ""


def open_ids(host: Host) -> set[str]:
    return {s.id for s in host.sessions}


async def until(condition: Callable[[], bool]) -> None:
    """Let every other task run until ``condition`` holds (bounded, no timed waits)."""
    with trio.fail_after(RUN_TIMEOUT_S):
        while not condition():
            await trio.testing.wait_all_tasks_blocked()


def ended(recorder: Recorder, session_id: str) -> list[TaskEnd]:
    return [o for o in of_type(recorder.outputs, TaskEnd) if o.session_id == session_id]


def spawned_id(outputs: list[Output], root: Session, call_id: str) -> str:
    """The session id a background spawn call returned."""
    (call,) = [o for o in spawn_outputs(outputs, root.id) if o.call_id == call_id]
    assert call.status == "ok", output_text(call)
    return str(json.loads(output_text(call))["session_id"])


class Waiting:
    """Children whose model waits for the test before it answers."""

    def __init__(self) -> None:
        self.go: dict[str, trio.Event] = {}
        self.started: dict[str, trio.Event] = {}

    def _event(self, table: dict[str, trio.Event], task: str) -> trio.Event:
        return table.setdefault(task, trio.Event())

    async def answer(self, request: ModelRequest, stream: ScriptedStream, reply: str) -> None:
        task = task_of(request)
        self._event(self.started, task).set()
        await self._event(self.go, task).wait()
        await stream.text(reply)

    async def wait_started(self, *tasks: str) -> None:
        with trio.fail_after(RUN_TIMEOUT_S):
            for task in tasks:
                await self._event(self.started, task).wait()

    def release(self, task: str) -> None:
        self._event(self.go, task).set()


# -- depth (R-TREE-1) ----------------------------------------------------------------------


async def test_three_levels_below_the_root_by_default_the_last_may_not_spawn(
    host: Host, workspace: Path, data_dir: Path, providers, lookup: Lookup
) -> None:
    """max_subagent_depth defaults to 3: root → child → grandchild → great-grandchild,
    each offered spawn_subagent but the last; each node's outputs reach the root with its
    full path; the leaf's call is decided by the root run's approve callback, which is
    told which node asks (its ``origin`` keyword), and its decision reaches the root
    marked with the leaf's origin."""
    chain = {"root job": "child job", "child job": "grandchild job", "grandchild job": "leaf"}
    asked: list[tuple[str, tuple[str, ...]]] = []

    def approve(call: ToolCallBlock, origin: tuple[str, ...] = ()) -> str:
        asked.append((call.name, origin))
        return "allow"

    def brain(request: ModelRequest) -> Reply:
        task = task_of(request)
        if has_results(request):
            (result,) = results_of(request.messages[-1])
            return Reply(blocks=(text(f"{task} < {result_text(result)}"),))
        if task == "leaf":
            return Reply(blocks=(tool_call("l1", "lookup", key="deep"),))
        return Reply(blocks=(spawn(f"s-{task}", chain[task]),))

    provider = providers(brain)
    session = await host.create_session(
        tools=[lookup.tool, spawn_subagent], provider=provider, workspace_dir=workspace
    )
    assert session.settings.max_subagent_depth == 3
    outputs = await collect(session.run("root job", approve=approve))

    (spawned,) = spawn_outputs(outputs, session.id)
    assert output_text(spawned) == "child job < grandchild job < leaf < value-deep"
    child, grandchild, leaf = child_ids(outputs, session.id)
    path = (session.id, child, grandchild, leaf)
    for depth, node in enumerate((child, grandchild, leaf), start=2):
        assert {o.origin for o in outputs_from(outputs, node)} == {path[:depth]}
    offered = {task_of(r): [t.name for t in r.tools] for r in provider.requests}
    assert offered == {
        "root job": ["lookup", SPAWN_SUBAGENT],
        "child job": ["lookup", SPAWN_SUBAGENT],
        "grandchild job": ["lookup", SPAWN_SUBAGENT],
        "leaf": ["lookup"],
    }
    (decision,) = of_type(outputs_from(outputs, leaf), ApprovalDecision)
    assert (decision.tool, decision.by, decision.origin) == ("lookup", "host", path)
    assert asked == [(SPAWN_SUBAGENT, path[:depth]) for depth in (1, 2, 3)] + [("lookup", path)]
    meta = json.loads((data_dir / "sessions" / leaf / "session.json").read_text())
    assert (meta["parent_id"], meta["root_id"], meta["origin"]) == (
        grandchild,
        session.id,
        list(path),
    )


class _ShownRenderer:
    """A renderer that has shown everything already (the terminal question comes next)."""

    def break_line(self) -> None:
        pass

    async def wait_shown(self, key: str) -> None:
        pass


async def test_the_terminal_question_names_the_subagent_that_asks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--approve ask``: a subagent's call is asked with the node it comes from."""
    answers = iter(["y", "n"])

    async def read_line() -> str | None:
        return next(answers)

    read_end, write_end = os.pipe()  # the approver's fd; answers come from read_line
    approver = TerminalApprover(_ShownRenderer(), read_end, read_line=read_line)  # type: ignore[arg-type]
    os.close(write_end)
    call = ToolCallBlock(id="c1", name="lookup", arguments={"key": "k"})
    assert await approver(call, origin=("root-id", "child-id")) == "allow"
    assert await approver(call, origin=("root-id",)) == "deny"
    asked = capsys.readouterr().err
    assert "subagent child-id: Allow lookup" in asked
    assert asked.count("subagent") == 1  # the root's own call names no node
    os.close(read_end)


# -- every node a session (R-TREE-1) -----------------------------------------------------


async def test_steering_a_grandchild_through_its_own_handle(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """A running grandchild is open in the host: steering its handle reaches its
    supervisor (the next request carries the steering), and its answer climbs the tree."""

    def brain(request: ModelRequest) -> Reply:
        task = task_of(request)
        if has_results(request):
            (result,) = results_of(request.messages[-1])
            if task == "grandchild job":
                return Reply(blocks=(text(f"heard: {last_texts(request)}"),))
            return Reply(blocks=(text(result_text(result)),))
        if task == "grandchild job":
            return Reply(blocks=(tool_call("w1", "wait", key="gc"),))
        nxt = "child job" if task == "root job" else "grandchild job"
        return Reply(blocks=(spawn(f"s-{task}", nxt),))

    provider = providers(brain)
    session = await host.create_session(
        tools=[gates.tool(), spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("root job", approve=allow_all)
    await gates.started("gc")

    def deepest() -> list[Output]:
        return [o for o in recorder.outputs if o.origin is not None and len(o.origin) == 3]

    await until(lambda: bool(deepest()))
    grandchild = host.get_session(deepest()[0].session_id)
    assert grandchild.busy and grandchild.root_id == session.id
    assert grandchild.steer("look in the attic")
    gates.release("gc")
    outputs = await collect(stream)

    (spawned,) = spawn_outputs(outputs, session.id)
    assert "heard:" in output_text(spawned) and "look in the attic" in output_text(spawned)
    steering = [
        o
        for o in outputs_from(outputs, grandchild.id)
        if isinstance(o, UserMsg) and o.kind == "steering"
    ]
    assert len(steering) == 1 and steering[0].origin == grandchild.origin
    assert grandchild.id not in open_ids(host)  # finished: forgotten, loadable


async def test_children_lists_running_and_finished_nodes_and_the_store_knows_the_tree(
    tmp_path: Path, workspace: Path, providers
) -> None:
    """session.children(): a finished foreground child (loaded) and a running background
    one, oldest first; the child's own children; list_sessions entries carry parent_id
    and root_id; after a restart the children come from the store."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        task = task_of(request)
        if task == "slow":
            await waiting.answer(request, stream, "slow done")
        elif "[subagent" in last_texts(request):
            await stream.text("noted")
        elif has_results(request) or task == "leaf":
            await stream.text(f"{task} done")
        elif task == "root job":
            await stream.block(spawn("f1", "fast"))
            await stream.block(spawn("b1", "slow", background=True))
        else:
            await stream.block(spawn("g1", "leaf"))

    provider = providers(brain)
    data_dir = tmp_path / "tree-data"
    async with open_host(data_dir) as host:
        root = await host.create_session(
            tools=[spawn_subagent], provider=provider, workspace_dir=workspace
        )
        outputs = await collect(root.run("root job", approve=allow_all))
        background = spawned_id(outputs, root, "b1")
        fast, leaf = [c for c in child_ids(outputs, root.id) if c != background]
        await waiting.wait_started("slow")

        # The two calls of one turn create their children side by side: either may be
        # the older.
        children = {c.id: c for c in await root.children()}
        assert set(children) == {fast, background}
        assert (children[fast].busy, children[background].busy) == (False, True)
        assert [c.id for c in await children[fast].children()] == [leaf]
        assert await children[background].children() == []
        infos = {i.session_id: i for i in await host.list_sessions()}
        assert (infos[root.id].parent_id, infos[root.id].root_id) == (None, root.id)
        assert (infos[leaf].parent_id, infos[leaf].root_id) == (fast, root.id)
        assert (infos[background].parent_id, infos[background].root_id) == (root.id, root.id)
        waiting.release("slow")
        await until(lambda: background not in open_ids(host))
        await root.wait_idle()  # the follow-up the background answer started

    async with open_host(data_dir) as host:
        root = await host.load_session(root.id, provider=provider)
        assert {c.id for c in await root.children()} == {fast, background}
        (reloaded_fast,) = [s for s in host.sessions if s.id == fast]
        assert [c.id for c in await reloaded_fast.children()] == [leaf]
        (reloaded_leaf,) = [s for s in host.sessions if s.id == leaf]
        assert reloaded_leaf.origin == (root.id, fast, leaf)


# -- background children (R-TREE-2) ------------------------------------------------------


async def test_a_background_answer_reaches_the_running_parent_as_steering(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """spawn_subagent(background=true) returns {session_id} at once; the parent goes on
    (its own call runs meanwhile); the child's answer arrives as steering of the same
    task, ``[subagent scout finished] …``, and the task ends once."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "found 42")
        elif has_results(request):
            await stream.text(f"parent saw: {last_texts(request)}")
        else:
            await stream.block(spawn("b1", "find it", background=True, name="scout"))
            await stream.block(tool_call("w1", "wait", key="root"))

    provider = providers(brain)
    session = await host.create_session(
        tools=[gates.tool(), spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await gates.started("root")
    await waiting.wait_started("find it")
    # The spawn call has returned while the child still works.
    returned = await recorder.wait_for("tool_call_output", call_id="b1")
    child_id = spawned_id([returned], session, "b1")
    assert child_id in open_ids(host) and host.get_session(child_id).busy

    waiting.release("find it")
    await until(lambda: child_id not in open_ids(host))
    assert session.busy  # the parent's own call still runs
    gates.release("root")
    outputs = await collect(stream)

    root_ends = [o for o in of_type(outputs, TaskEnd) if o.origin is None]
    assert [e.status for e in root_ends] == ["completed"]
    (steering,) = [
        o for o in outputs if isinstance(o, UserMsg) and o.origin is None and o.kind == "steering"
    ]
    assert "[subagent scout finished] found 42" in output_texts(steering)
    final = provider.requests[-1]
    assert not is_child(final) and "[subagent scout finished] found 42" in last_texts(final)
    assert of_type(outputs, ModelMsg)[-1].block == text(f"parent saw: {last_texts(final)}")
    # The child's outputs reached the run with their origin, its task_end among them.
    assert [e.status for e in of_type(outputs_from(outputs, child_id), TaskEnd)] == ["completed"]


def output_texts(message: UserMsg) -> str:
    return "".join(getattr(b, "text", "") for b in message.content)


async def test_a_background_answer_starts_a_follow_up_when_the_parent_is_idle(
    host: Host, workspace: Path, providers
) -> None:
    """The parent's task ends while its background child works; the child's answer then
    starts a follow-up task of the parent whose prompt is ``[subagent NAME finished] …``;
    the follow-up's outputs reach the parent's watchers."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "the sources agree")
            return
        prompt = last_texts(request)
        if prompt.startswith("[subagent"):
            await stream.text(f"merged: {prompt}")
        elif has_results(request):
            await stream.text("started a researcher")
        else:
            await stream.block(spawn("b1", "research", background=True, name="researcher"))

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    first = await collect(session.run("go", approve=allow_all))
    child_id = spawned_id(first, session, "b1")
    assert [e.status for e in of_type(first, TaskEnd) if e.origin is None] == ["completed"]
    await waiting.wait_started("research")
    assert not session.busy and child_id in open_ids(host)

    waiting.release("research")
    await until(lambda: len(ended(recorder, session.id)) == 2)
    await session.wait_idle()

    follow_up = [o for o in recorder.outputs if o.origin is None]
    prompts = [o for o in follow_up if isinstance(o, UserMsg)]
    assert [output_texts(p) for p in prompts] == [
        "go",
        "[subagent researcher finished] the sources agree",
    ]
    assert [p.kind for p in prompts] == ["prompt", "prompt"]
    answer = of_type(follow_up, ModelMsg)[-1]
    assert answer.block == text("merged: [subagent researcher finished] the sources agree")
    assert [e.status for e in ended(recorder, session.id)] == ["completed", "completed"]


async def root_parked_beside_its_child(
    host: Host, provider: Any, tools: list[Any], workspace: Path, waiting: Waiting
) -> Session:
    """A root that runs ``go`` with people answering: allowed to spawn its background
    child k (``b1``), it parks asking about ``w1`` while k still works."""
    root = await host.create_session(provider=provider, tools=tools, workspace_dir=workspace)
    root.run("go", approve=PEOPLE).detach()
    await until(lambda: host.port(root.id).parked)
    await host.answer_approval(root.id, "b1", "allow")
    await waiting.wait_started("keep going")
    await until(lambda: host.port(root.id).parked)  # asking for w1, k still at work
    return root


async def test_a_background_answer_for_a_parent_closed_meanwhile_reaches_it_loaded_again(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-TREE-2: the root's task waits for a person (parked) while its background child
    works; the root is closed (a parked task is not interrupted, and its background child
    goes on) and loaded again; the child's answer then reaches the root as loaded again,
    as steering its task takes once the person has answered. Before, the answer went to
    the closed root's port, which took nothing: lost, the root answered without it."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "k is done")
            return
        said = str(request.messages)
        if "[subagent k finished] k is done" in said:
            await stream.text("merged what k found")
        elif "w1" in said:
            await stream.text("nothing from k")
        elif "b1" in said:
            await stream.block(tool_call("w1", "wait", key="root"))
        else:
            await stream.block(spawn("b1", "keep going", background=True, name="k"))

    provider = providers(brain)
    tools = [gates.tool(), spawn_subagent]
    root = await root_parked_beside_its_child(host, provider, tools, workspace, waiting)
    await host.close_session(root.id)
    again = await host.load_session(root.id, provider=provider, tools=tools)

    waiting.release("keep going")
    await until(lambda: len(open_ids(host)) == 1)  # k reported and left
    gates.release("root")
    await host.answer_approval(root.id, "w1", "allow")
    await until(lambda: not host.port(root.id).busy)
    answers = [line["block"] for line in trace_lines(again) if line["type"] == "model_msg"]
    assert answers[-1] == {"type": "text", "text": "merged what k found"}, answers


async def test_a_background_childs_outputs_reach_its_parent_closed_and_loaded_again(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-TREE-1: outputs of every node reach the root's watchers, with ``origin``. The
    root, parked while its background child works, is closed and loaded again; a client
    watching the root as loaded again sees the child's outputs, each once. Before, the
    child's forwarder held the closed root's port, which nobody watches any more."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "k is done")
        elif "b1" in str(request.messages):
            await stream.block(tool_call("w1", "wait", key="root"))
        else:
            await stream.block(spawn("b1", "keep going", background=True, name="k"))

    provider = providers(brain)
    tools = [gates.tool(), spawn_subagent]
    root = await root_parked_beside_its_child(host, provider, tools, workspace, waiting)
    (child_id,) = open_ids(host) - {root.id}
    await host.close_session(root.id)
    recorder = Recorder(await host.load_session(root.id, provider=provider, tools=tools))

    waiting.release("keep going")
    await until(lambda: child_id not in open_ids(host))  # k answered and left
    from_child = [o for o in recorder.outputs if o.session_id == child_id]
    assert {o.origin for o in from_child} == {(root.id, child_id)}
    assert [e.status for e in of_type(from_child, TaskEnd)] == ["completed"]
    answers = [o.block for o in of_type(from_child, ModelMsg)]
    assert answers == [text("k is done")]


async def test_a_background_answer_for_a_parent_deleted_meanwhile_is_refused_in_one_line(
    host: Host,
    workspace: Path,
    providers,
    gates: Gates,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """R-TREE-2: the root, parked while its background child works, is deleted; the
    child's answer then has no parent to reach: a refusal for good, logged as one line
    that says so, with no traceback, and the host goes on. Before, the parent's
    SessionNotFound was logged as an unexpected failure to reach it, with its traceback."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "k is done")
        elif "b1" in str(request.messages):
            await stream.block(tool_call("w1", "wait", key="root"))
        else:
            await stream.block(spawn("b1", "keep going", background=True, name="k"))

    tools = [gates.tool(), spawn_subagent]
    root = await host.create_session(
        provider=providers(brain), tools=tools, workspace_dir=workspace
    )
    root.run("go", approve=PEOPLE).detach()
    await until(lambda: host.port(root.id).parked)
    await host.answer_approval(root.id, "b1", "allow")
    await waiting.wait_started("keep going")
    await until(lambda: host.port(root.id).parked)  # asking for w1, k still at work
    (child_id,) = open_ids(host) - {root.id}
    await host.delete_session(root.id)

    caplog.set_level(logging.INFO, logger="greenroom")
    waiting.release("keep going")
    await until(lambda: any(child_id in r.getMessage() for r in caplog.records))
    (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.getMessage().startswith(
        f"session {root.id} refused the answer of its subagent {child_id}: "
    ), line.getMessage()
    assert line.exc_info is None and "Traceback" not in caplog.text
    assert host.is_open() and open_ids(host) == set()


async def test_a_subagent_waits_for_its_background_children_before_it_answers(
    host: Host, workspace: Path, providers
) -> None:
    """A subagent that answers while its own background child works does not end: the
    grandchild's answer arrives as its steering, and its answer (the spawn's result) comes
    after it. The root, meanwhile, simply waits for its foreground call."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        task = task_of(request)
        if task == "dig":
            await waiting.answer(request, stream, "gold")
        elif task == "delegate":
            texts = last_texts(request)
            if "[subagent digger finished]" in texts:
                await stream.text(f"child answer after: {texts}")
            elif has_results(request):
                await stream.text("waiting for the digger")
            else:
                await stream.block(spawn("b1", "dig", background=True, name="digger"))
        elif has_results(request):
            (result,) = results_of(request.messages[-1])
            await stream.text(f"root got: {result_text(result)}")
        else:
            await stream.block(spawn("s1", "delegate"))

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await waiting.wait_started("dig")
    # The child has answered, its background child still digging: it holds.
    await recorder.wait_for("model_msg", block=text("waiting for the digger"))
    await trio.testing.wait_all_tasks_blocked()
    child_id = child_ids(recorder.outputs, session.id)[0]
    assert ended(recorder, child_id) == [] and host.get_session(child_id).busy
    waiting.release("dig")
    outputs = await collect(stream)

    (spawned,) = spawn_outputs(outputs, session.id)
    assert output_text(spawned).startswith("child answer after: ")
    assert "[subagent digger finished] gold" in output_text(spawned)
    assert len([r for r in provider.requests if task_of(r) == "delegate"]) == 3
    child_ends = of_type(outputs_from(outputs, child_id), TaskEnd)
    assert [e.status for e in child_ends] == ["completed"]


# -- interrupt scopes (R-TREE-2) ---------------------------------------------------------


async def test_a_node_scoped_interrupt_of_a_child_leaves_its_sibling_and_the_root_running(
    host: Host, workspace: Path, data_dir: Path, providers, gates: Gates
) -> None:
    """Interrupting one background child through its handle with scope node ends it
    alone: its sibling and the root go on, and the root hears of both ends as steering."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        task = task_of(request)
        if is_child(request):
            await waiting.answer(request, stream, f"{task} done")
        elif has_results(request):
            await stream.text("root done")
        else:
            await stream.block(spawn("a1", "alpha", background=True, name="a"))
            await stream.block(spawn("b1", "beta", background=True, name="b"))
            await stream.block(tool_call("w1", "wait", key="root"))

    provider = providers(brain)
    session = await host.create_session(
        tools=[gates.tool(), spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await waiting.wait_started("alpha", "beta")
    await gates.started("root")
    alpha = spawned_id([await recorder.wait_for("tool_call_output", call_id="a1")], session, "a1")
    beta = spawned_id([await recorder.wait_for("tool_call_output", call_id="b1")], session, "b1")

    assert host.get_session(alpha).interrupt("enough of alpha", scope="node")
    await until(lambda: alpha not in open_ids(host))
    assert session.busy and host.get_session(beta).busy
    waiting.release("beta")
    await until(lambda: beta not in open_ids(host))
    gates.release("root")
    outputs = await collect(stream)

    assert [e.status for e in of_type(outputs, TaskEnd) if e.origin is None] == ["completed"]
    steering = "\n".join(
        output_texts(o)
        for o in outputs
        if isinstance(o, UserMsg) and o.origin is None and o.kind == "steering"
    )
    assert f"[subagent a finished] subagent {alpha} ended with status aborted: enough" in steering
    assert "[subagent b finished] beta done" in steering
    await host.trace_store.log.sync()
    assert child_trace(data_dir, alpha)[-1]["status"] == "aborted"
    assert child_trace(data_dir, beta)[-1]["status"] == "completed"


async def test_a_node_scoped_interrupt_of_the_root_leaves_its_background_children_running(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """session.interrupt(scope="node") ends the root's task; its background child runs on
    and its answer later starts a follow-up of the root."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "still here")
            return
        if "[subagent k finished] still here" in last_texts(request):
            await stream.text("after the interrupt: k is still here")
        else:
            await stream.block(spawn("b1", "keep going", background=True, name="k"))
            await stream.block(tool_call("w1", "wait", key="root"))

    provider = providers(brain)
    session = await host.create_session(
        tools=[gates.tool(), spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await waiting.wait_started("keep going")
    await gates.started("root")
    assert session.interrupt("stop the root only", scope="node")
    first = await collect(stream)
    assert [e.status for e in of_type(first, TaskEnd) if e.origin is None] == ["aborted"]
    child_id = spawned_id(first, session, "b1")
    assert host.get_session(child_id).busy

    waiting.release("keep going")
    await until(lambda: len(ended(recorder, session.id)) == 2)
    assert [e.status for e in ended(recorder, session.id)] == ["aborted", "completed"]
    answer = [o for o in of_type(recorder.outputs, ModelMsg) if o.origin is None][-1]
    assert answer.block == text("after the interrupt: k is still here")


async def test_a_tree_scoped_interrupt_ends_background_children_even_of_an_idle_root(
    host: Host, workspace: Path, data_dir: Path, providers
) -> None:
    """The default scope, tree, ends the whole subtree: background children of a root
    whose task has ended are interrupted, and their ends start no follow-up."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "never")
        elif has_results(request):
            await stream.text("both started")
        else:
            await stream.block(spawn("a1", "alpha", background=True))
            await stream.block(spawn("b1", "beta", background=True))

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    outputs = await collect(session.run("go", approve=allow_all))
    children = [spawned_id(outputs, session, "a1"), spawned_id(outputs, session, "b1")]
    await waiting.wait_started("alpha", "beta")
    assert not session.busy

    assert session.interrupt("everything stops")
    await until(lambda: not open_ids(host) & set(children))
    await trio.testing.wait_all_tasks_blocked()
    assert not session.busy
    assert len(ended(recorder, session.id)) == 1  # no follow-up
    await host.trace_store.log.sync()
    for child in children:
        lines = child_trace(data_dir, child)
        assert [line["type"] for line in lines[-2:]] == ["abort", "task_end"]
        assert lines[-2]["reason"] == "parent interrupted: everything stops"
    forwarded = [o for o in of_type(recorder.outputs, Abort) if o.origin is not None]
    assert sorted(o.session_id for o in forwarded) == sorted(children)
    # Idle and childless: nothing left to interrupt.
    assert not session.interrupt("again")


async def test_a_tree_scoped_interrupt_of_a_running_root_ends_its_background_children(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await waiting.answer(request, stream, "never")
        else:
            await stream.block(spawn("b1", "beta", background=True))
            await stream.block(tool_call("w1", "wait", key="root"))

    provider = providers(brain)
    session = await host.create_session(
        tools=[gates.tool(), spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await waiting.wait_started("beta")
    await gates.started("root")
    assert session.interrupt("stop")
    outputs = await collect(stream)
    child_id = spawned_id(outputs, session, "b1")
    await until(lambda: child_id not in open_ids(host))
    await trio.testing.wait_all_tasks_blocked()

    assert [e.status for e in ended(recorder, session.id)] == ["aborted"]
    assert [e.status for e in ended(recorder, child_id)] == ["aborted"]
    assert not session.busy


@pytest.mark.parametrize("background", [True, False])
async def test_a_tree_interrupt_while_a_child_is_created_starts_no_child(
    host: Host,
    workspace: Path,
    data_dir: Path,
    providers,
    monkeypatch: pytest.MonkeyPatch,
    background: bool,
) -> None:
    """R-TREE-2: ``scope="tree"`` ends the whole subtree, a child being created included.
    Its ``session.json`` is written in a thread no cancellation reaches; the interrupt
    came meanwhile and found it among no live children. Before, the child started a task
    once written; in the background it asked the model, and its answer started a
    follow-up of the interrupted root."""
    catalog = host.trace_store.catalog
    create = catalog.create
    writing, written = trio.Event(), trio.Event()
    children: list[str] = []

    async def held_for_a_child(session_id: str, meta: dict[str, Any]) -> None:
        await create(session_id, meta)
        if meta.get("parent_id") is not None:
            children.append(session_id)
            writing.set()
            # Shielded: the write goes on, past any cancellation, until the test lets it.
            with trio.CancelScope(shield=True), trio.fail_after(RUN_TIMEOUT_S):
                await written.wait()

    monkeypatch.setattr(catalog, "create", held_for_a_child)

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await stream.text("beta result")
        elif has_results(request) or "[subagent" in last_texts(request):
            await stream.text("the root went on")
        else:
            await stream.block(spawn("b1", "beta", background=background, name="beta"))

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    with trio.fail_after(RUN_TIMEOUT_S):
        await writing.wait()
    assert session.interrupt("stop everything", scope="tree")
    await until(lambda: port_of(session).machine.stopping)  # the root took it
    written.set()
    await collect(stream)
    await until(lambda: open_ids(host) == {session.id})
    await trio.testing.wait_all_tasks_blocked()
    await session.wait_idle()

    assert [r for r in provider.requests if is_child(r)] == []
    (child_id,) = children
    await host.trace_store.log.sync()
    # Its session is stored, with no record: it never had a task.
    assert not (data_dir / "sessions" / child_id / "trace_001.jsonl").exists()
    assert [e.status for e in ended(recorder, session.id)] == ["aborted"]  # no follow-up
    slots = port_of(session).children
    assert slots is not None and not slots.live
    assert slots.slots.value == session.settings.max_subagents_concurrent


# -- limits and budgets (R-TREE-3) -------------------------------------------------------


async def test_background_children_hold_a_concurrency_slot_until_they_end(
    host: Host, workspace: Path, providers
) -> None:
    """max_subagents_concurrent=1: a second spawn waits while the first background child
    runs, and starts once it has ended."""
    waiting = Waiting()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        task = task_of(request)
        if is_child(request):
            await waiting.answer(request, stream, f"{task} done")
            return
        results = results_of(request.messages[-1]) if has_results(request) else []
        if not results and "beta done" in last_texts(request):
            # Beta's report: steering of the root's task, or a task of its own queued
            # behind it when the task ended first (R-TREE-2): either way, noted.
            await stream.text("noted")
        elif not results:
            await stream.block(spawn("a1", "alpha", background=True))
        elif results[0].call_id == "a1":
            await stream.block(spawn("b1", "beta", background=True))
        else:
            await stream.text("root done")

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent],
        provider=provider,
        workspace_dir=workspace,
        max_subagents_concurrent=1,
    )
    stream = session.run("go", approve=allow_all)
    await waiting.wait_started("alpha")
    slots = port_of(session).children
    await until(lambda: slots is not None and slots.slots.statistics().tasks_waiting == 1)
    assert "beta" not in waiting.started  # its call waits for alpha's slot
    waiting.release("alpha")
    await waiting.wait_started("beta")
    waiting.release("beta")
    outputs = await collect(stream)
    assert [o.status for o in spawn_outputs(outputs, session.id)] == ["ok", "ok"]


async def test_a_token_budget_holds_for_a_whole_subtree(
    host: Host, workspace: Path, data_dir: Path, providers, lookup: Lookup
) -> None:
    """subagent_token_budget=100: the child uses 30 tokens and its grandchild 80 (under
    its own budget); together they pass the child's, so the child is interrupted with its
    subtree and the root's call fails naming the budget."""

    def brain(request: ModelRequest) -> Reply:
        task = task_of(request)
        if task == "root job":
            if has_results(request):
                return Reply(blocks=(text("root done"),))
            return Reply(blocks=(spawn("s1", "child job"),))
        if task == "child job":
            return Reply(
                blocks=(spawn("g1", "grandchild job"),), usage=TokenUsage(input=20, output=10)
            )
        return Reply(
            blocks=(tool_call(f"l{len(request.messages)}", "lookup", key="k"),),
            usage=TokenUsage(input=30, output=10),
        )

    provider = providers(brain)
    session = await host.create_session(
        tools=[lookup.tool, spawn_subagent],
        provider=provider,
        workspace_dir=workspace,
        subagent_token_budget=100,
    )
    outputs = await collect(session.run("root job", approve=allow_all))

    (spawned,) = spawn_outputs(outputs, session.id)
    child, grandchild = child_ids(outputs, session.id)
    message = output_text(spawned)
    assert spawned.status == "error"
    assert child in message and "budget of 100" in message and "110 tokens" in message
    assert "subagent_token_budget" in message
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    await host.trace_store.log.sync()
    for node in (child, grandchild):
        lines = child_trace(data_dir, node)
        assert [line["type"] for line in lines[-2:]] == ["abort", "task_end"]
        assert lines[-1]["status"] == "aborted"
    assert "budget" in child_trace(data_dir, child)[-2]["reason"]
    assert child_trace(data_dir, grandchild)[-2]["reason"] == "parent task interrupted"


async def test_a_child_created_while_a_loaded_sessions_children_are_read_is_among_them(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R-TREE-1: the children of a session loaded from the store are read from the
    # catalog once, then kept. A child created while they were read was missed, by that
    # answer and by every later one while the session stayed open.
    async with open_host(data_dir) as host:
        parent = await host.create_session(provider="scripted", workspace_dir=workspace)
        parent_id = parent.id
        await host.close_session(parent_id)
        parent = await host.load_session(parent_id)
        catalog = host.trace_store.catalog
        list_sessions = catalog.list_sessions
        listed, may_answer = trio.Event(), trio.Event()

        async def listed_then_wait() -> Any:
            found = await list_sessions()
            listed.set()
            await may_answer.wait()
            return found

        monkeypatch.setattr(catalog, "list_sessions", listed_then_wait)
        answers: list[list[str]] = []

        async def children() -> None:
            answers.append([c.id for c in await parent.children()])

        with trio.fail_after(RUN_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(children)
                await listed.wait()
                child = await host.create_session(
                    provider="scripted", workspace_dir=workspace, parent_id=parent_id
                )
                may_answer.set()
            monkeypatch.undo()
            answers.append([c.id for c in await parent.children()])
        assert answers == [[child.id], [child.id]]


@pytest.mark.parametrize("scope", ["node", "tree"])
async def test_a_childs_answer_waiting_as_steering_survives_an_interrupt_of_its_parent(
    data_dir: Path, workspace: Path, scope: str, gates: Gates
) -> None:
    # R-TREE-2: a background child's answer that came while its parent's turn ran waits
    # as steering for the parent's next turn. An interrupt of the parent alone (scope
    # node: its background children go on, their answers still reach it) dropped it with
    # the task's steering; the child had reported once, and its answer was lost.
    from greenroom.actors.runtime.port import TaskInput
    from greenroom.actors.runtime.tree import tell
    from greenroom.protocols.content import TextBlock
    from greenroom.protocols.messages import SubagentFinished

    provider = ScriptedProvider([
        Reply(blocks=(text("Working."), tool_call("c1", "wait", key="a"))),
        Reply(blocks=(text("Noted what the child found."),)),
    ])  # fmt: skip
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=provider, tools=[gates.tool()], workspace_dir=workspace
        )
        stream = session.run("work", approve=allow_all)
        with trio.fail_after(RUN_TIMEOUT_S):
            await gates.started("a")  # and never released
            content = (TextBlock(text="[subagent kid finished] CHILD ANSWER"),)
            answer = TaskInput(content=content, approve=allow_all, thinking_level=None)
            assert tell(
                host.port(session.id),
                SubagentFinished(session_id="kid", content=content, follow_up=answer),
            )
            await trio.testing.wait_all_tasks_blocked()
            assert session.interrupt("stop", scope=scope)  # type: ignore[arg-type]
            await collect(stream)
            await session.wait_idle()
        lines = trace_lines(session)
    ends = [line["status"] for line in lines if line["type"] == "task_end"]
    if scope == "tree":  # the whole tree stops: nothing is taken up
        assert ends == ["aborted"] and len(provider.requests) == 1
        return
    assert ends == ["aborted", "completed"]
    assert "CHILD ANSWER" in str(provider.requests[-1].messages)
