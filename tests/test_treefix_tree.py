"""Agent trees and people's timeouts at their edges (R-TREE-2, R-HITL-1): what a request's
``abort`` timeout ends, what a parent hears of a taken-up background child interrupted
alone, and a child given a task again as its answer goes up. Scripted model, real host."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, Recorder, allow_all, collect, of_type, open_host, trace_lines
from test_subagents import has_results, is_child
from test_subagents_tree import ended, last_texts, open_ids, output_texts, spawn, until
from test_tree_takeup import (
    _after_the_crash,
    _crash_while_the_payer_waits,
    _payer_model,
    _payer_parked_on_a_closed_host,
    _reports,
    _task_of,
    _tools_after_the_crash,
    _until_task_end,
)

from greenroom.actors.providers import scripted_brain
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, ScriptedStream, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import RunStream, Session
from greenroom.actors.runtime.subagents import spawn_subagent
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd, UserMsg
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import make_tool


def _child_of(host_sessions: list[Session], root: Session) -> Session:
    (child,) = [s for s in host_sessions if s.parent_id == root.id]
    return child


async def test_an_abort_timeout_ends_that_task_and_leaves_its_background_child_running(
    host: Host, workspace: Path, providers
) -> None:
    """R-HITL-1, R-TREE-2: a root's background scout works while the root's next task waits
    for a person about a payment, ``approval_timeout_action: abort``. Nobody answers: the
    root's task ends aborted, naming the request, and nothing is paid; the scout, whose
    work the request is not about, runs on, and its answer reaches the root as a follow-up
    task, as after an interrupt of scope node. Before, the abort was an interrupt of scope
    tree: the scout ended aborted with it, and its answer went to nobody."""
    paid: list[int] = []

    async def pay(amount: int) -> str:
        """Pay an amount."""
        paid.append(amount)
        return "paid"

    scouting = trio.Event()
    go = trio.Event()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            scouting.set()
            await go.wait()
            await stream.text("the coast is clear")
        elif last_texts(request).startswith("[subagent scout finished]"):
            await stream.text("merged the scout's answer")
        elif "pay 7" in last_texts(request):
            await stream.block(tool_call("p1", "pay", amount=7))
        elif has_results(request):
            await stream.text("the scout is out")
        else:
            await stream.block(spawn("s1", "scout the coast", background=True, name="scout"))

    root = await host.create_session(
        provider=providers(brain),
        tools=[make_tool(pay, parallel=False), spawn_subagent],
        workspace_dir=workspace,
        approval_timeout_s=0.2,
        approval_timeout_action="abort",
    )
    recorder = Recorder(root)
    await collect(root.run("send a scout", approve=allow_all))
    with trio.fail_after(RUN_TIMEOUT_S):
        await scouting.wait()
    scout = _child_of(host.sessions, root)

    second = await collect(root.run("pay 7", approve=PEOPLE))
    (end,) = [e for e in of_type(second, TaskEnd) if e.origin is None]
    assert end.status == "aborted" and "within 0.2 s" in (end.message or ""), end
    await trio.testing.wait_all_tasks_blocked()
    assert scout.busy  # the request's limit is the root task's, not the scout's

    go.set()
    await until(lambda: scout.id not in open_ids(host))
    await root.wait_idle()
    scout_lines = trace_lines(await host.load_session(scout.id))
    assert scout_lines[-1]["type"] == "task_end" and scout_lines[-1]["status"] == "completed"
    prompts = [output_texts(o) for o in of_type(recorder.outputs, UserMsg) if o.origin is None]
    assert prompts == [
        "send a scout",
        "pay 7",
        "[subagent scout finished] the coast is clear",
    ]
    assert [e.status for e in ended(recorder, root.id)] == ["completed", "aborted", "completed"]
    assert paid == []


async def test_a_taken_up_parked_child_interrupted_alone_tells_its_parent_it_was_aborted(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-2: after a restart, the root's background payer, waiting for a person, is
    interrupted with scope node. The root hears of it as of a live child interrupted so:
    ``[subagent payer finished]`` naming the abort and its reason — not an answer of the
    payer's, nor as if the root had been interrupted — as a follow-up task of its own.
    Nothing is paid."""
    paid, model, tools, root_id, child_id = await _payer_parked_on_a_closed_host(
        data_dir, workspace, _payer_model
    )
    async with open_host(data_dir) as host:
        root = await host.load_session(root_id, provider=model, tools=tools)
        payer = await host.load_session(child_id, provider=model, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        assert payer.interrupt("the payer may stop", scope="node")
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
        root_lines = trace_lines(root)
    assert paid == []
    assert _reports(seen) == [
        f"[subagent payer finished] subagent {child_id} ended with status aborted: "
        "the payer may stop"
    ]
    (end,) = [o for o in seen if isinstance(o, TaskEnd) and o.origin is None]
    assert end.status == "completed"
    assert [line["type"] for line in root_lines].count("task_start") == 2


async def test_a_taken_up_running_child_interrupted_alone_tells_its_waiting_parent(
    data_dir: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2: after a crash the next host takes up the payer, whose task waits for its
    background collector, and the collector, which holds a new call. The collector
    interrupted with scope node ends aborted, and the payer's same task takes that end as
    its steering (``[subagent collector finished] … aborted: <reason>``) and answers the
    root once."""
    crash_dir = tmp_path / "crashed"
    root_id, payer_id, collector_id = await _crash_while_the_payer_waits(
        data_dir, crash_dir, workspace
    )
    model = _after_the_crash(Reply(blocks=(tool_call("h2", "hold", key="again"),)))
    monkeypatch.setattr(scripted_brain, "demo_brain", model)
    tools, holding = _tools_after_the_crash([])
    async with Host.open(crash_dir, tools=tools) as host:
        root = await host.load_session(root_id, provider=ScriptedProvider(model))
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        await host.resume_tasks(approve=lambda call: "allow")
        with trio.fail_after(RUN_TIMEOUT_S):
            await holding.wait()
            assert host.get_session(collector_id).interrupt("enough", scope="node")
            seen = await _until_task_end(inbox)
        payer_lines = trace_lines(await host.load_session(payer_id))
    (steering,) = [
        line["content"][0]["text"]
        for line in payer_lines
        if line["type"] == "user_msg" and line.get("kind") == "steering"
    ]
    assert steering == (
        f"[subagent collector finished] subagent {collector_id} ended with status aborted: enough"
    )
    assert _task_of(payer_lines) == ["task_start", "report", "task_end"]
    assert _reports(seen) == ["[subagent payer finished] merged: collected 3"]


async def test_a_child_given_a_task_as_its_answer_goes_up_stays_open_to_run_it(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-TREE-1, R-TREE-2: a host that reacts to a background child's ``task_end`` by
    starting its next task (it finds the child idle by then) gets that task run to its
    end in the child's open session: the child stays open while it runs, the run ends
    with its answer, and the parent hears the child's first answer once and nothing more.
    Before, the child's follower took it out of the host as it reported the first answer,
    with the new task running: the session was no longer open, and the run never ended."""
    runs: list[RunStream] = []

    def run_again(session: Session) -> None:
        def listen(batch: list[Output]) -> None:
            ends = any(isinstance(o, TaskEnd) and o.origin is None for o in batch)
            if ends and session.parent_id is not None and not runs:
                runs.append(session.run("and again", approve=allow_all))

        session.subscribe(listen)

    go = trio.Event()

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await go.wait()
            await stream.text(f"answered: {last_texts(request)}")
        elif last_texts(request).startswith("[subagent"):
            await stream.text("merged")
        elif has_results(request):
            await stream.text("started a researcher")
        else:
            await stream.block(spawn("b1", "research", background=True, name="researcher"))

    async with Host.open(data_dir, observers=[run_again]) as host:
        root = await host.create_session(
            tools=[spawn_subagent], provider=providers(brain), workspace_dir=workspace
        )
        recorder = Recorder(root)
        await collect(root.run("go", approve=allow_all))
        child = _child_of(host.sessions, root)
        go.set()
        await until(lambda: len(ended(recorder, root.id)) == 2)  # the answer's follow-up
        assert child.id in open_ids(host) and host.get_session(child.id) is child
        again = await collect(runs[0])
        assert [e.status for e in of_type(again, TaskEnd) if e.origin is None] == ["completed"]
        (answer,) = [o for o in of_type(again, ModelMsg) if o.origin is None]
        assert answer.block.text == "answered: and again"  # type: ignore[union-attr]
        await trio.testing.wait_all_tasks_blocked()
        assert not root.busy
    prompts = [output_texts(o) for o in of_type(recorder.outputs, UserMsg) if o.origin is None]
    assert prompts == ["go", "[subagent researcher finished] answered: research"]
