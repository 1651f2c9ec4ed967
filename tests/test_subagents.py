"""Subagents (R-HOST-4): ``spawn_subagent`` runs a child session inside the parent's task;
its outputs are forwarded with ``origin``; its limits (concurrency, per task, token
budget, depth); interrupting the parent interrupts the child.

One scripted provider serves the parent and its children: the script tells them apart by
the system prompt (a child's starts with :data:`SUBAGENT_SYSTEM`) and reads a child's task
from its first user message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing
from conftest import (
    RUN_TIMEOUT_S,
    Lookup,
    Recorder,
    allow_all,
    assert_trace_seq_without_gaps,
    collect,
    of_type,
    port_of,
    result_text,
    results_of,
)

from greenroom.actors.providers.scripted import Reply, ScriptedStream, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.tools.builtin import read_file
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ModelMsg,
    Output,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.stream import TokenUsage

Step = Callable[[ModelRequest], Reply]


def is_child(request: ModelRequest) -> bool:
    return (request.system or "").startswith(SUBAGENT_SYSTEM)


def task_of(request: ModelRequest) -> str:
    """The child's task: the text of its first user message."""
    first = request.messages[0]
    assert isinstance(first, UserMessage)
    return "".join(p.text for p in first.content if isinstance(p, TextBlock))


def last_text(request: ModelRequest) -> str:
    return "".join(p.text for p in request.messages[-1].content if isinstance(p, TextBlock))


def has_results(request: ModelRequest) -> bool:
    last = request.messages[-1]
    return isinstance(last, UserMessage) and bool(results_of(last))


def spawn(call_id: str, task: str) -> ToolCallBlock:
    return tool_call(call_id, SPAWN_SUBAGENT, task=task)


def parent_then_done(*calls: ToolCallBlock) -> Step:
    """A parent that makes ``calls`` in its first turn, then answers ``parent done``."""

    def step(request: ModelRequest) -> Reply:
        if has_results(request):
            return Reply(blocks=(text("parent done"),))
        return Reply(blocks=calls)

    return step


def outputs_from(outputs: list[Output], session_id: str) -> list[Output]:
    return [o for o in outputs if o.session_id == session_id]


def child_ids(outputs: list[Output], parent_id: str) -> list[str]:
    """The ids of the children whose outputs reached the parent, in order of appearance."""
    ids: list[str] = []
    for output in outputs:
        if output.origin is not None and output.session_id not in ids:
            ids.append(output.session_id)
    return [i for i in ids if i != parent_id]


def spawn_outputs(outputs: list[Output], parent_id: str) -> list[ToolCallOutput]:
    return [
        o
        for o in of_type(outputs, ToolCallOutput)
        if o.origin is None and o.tool == SPAWN_SUBAGENT and o.session_id == parent_id
    ]


def child_trace(data_dir: Path, child_id: str) -> list[dict[str, Any]]:
    path = data_dir / "sessions" / child_id / "trace_001.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def output_text(output: ToolCallOutput) -> str:
    return "".join(b.text for b in output.content if isinstance(b, TextBlock))


async def test_child_answer_is_the_result_and_its_outputs_are_forwarded_with_origin(
    host: Host, workspace: Path, data_dir: Path, providers
) -> None:
    """The child is a real session (own directory, session.json with parent_id, own
    trace); its final answer is the tool result; its outputs reach the parent's stream
    and subscribers tagged with origin (parent, child) and never the parent's trace."""
    parent_step = parent_then_done(spawn("s1", "count the files"))

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            return Reply(blocks=(text(f"child answer to: {task_of(request)}"),))
        return parent_step(request)

    provider = providers(brain)
    session = await host.create_session(
        tools=[read_file, spawn_subagent],
        provider=provider,
        workspace_dir=workspace,
        system="Be brief.",
    )
    recorder = Recorder(session)
    outputs = await collect(session.run("delegate it", approve=allow_all))

    (spawned,) = spawn_outputs(outputs, session.id)
    assert spawned.status == "ok"
    assert output_text(spawned) == "child answer to: count the files"
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    # The model saw the answer as the call's result.
    final = provider.requests[-1]
    assert not is_child(final)
    (result,) = results_of(final.messages[-1])
    assert result_text(result) == "child answer to: count the files"

    (child_id,) = child_ids(outputs, session.id)
    forwarded = outputs_from(outputs, child_id)
    assert forwarded and all(o.origin == (session.id, child_id) for o in forwarded)
    assert [o.TYPE for o in forwarded if type(o).TRACED] == [
        "user_msg",
        "task_start",
        "request_begin",
        "model_msg",
        "token_usage",
        "request_end",
        "task_end",
    ]
    assert of_type(forwarded, TaskEnd)[0].status == "completed"
    # The parent's own outputs are untagged; subscribers saw exactly the stream.
    assert all(o.origin is None for o in outputs_from(outputs, session.id))
    assert recorder.outputs == outputs
    # Forwarded outputs come between the spawn call's approval and its output.
    start = outputs.index(forwarded[0])
    assert outputs.index(spawned) > outputs.index(forwarded[-1]) > start
    assert any(isinstance(o, ApprovalDecision) and o.call_id == "s1" for o in outputs[:start])

    # The parent's trace: its own records only, seq without gaps.
    lines = await assert_trace_seq_without_gaps(session)
    assert {line["session_id"] for line in lines} == {session.id}
    assert all("origin" not in line for line in lines)
    assert [line["type"] for line in lines].count("tool_call_output") == 1

    # The child's own session directory, session.json and trace.
    meta = json.loads((data_dir / "sessions" / child_id / "session.json").read_text())
    assert meta["parent_id"] == session.id
    assert meta["root_id"] == session.id
    assert meta["origin"] == [session.id, child_id]
    assert meta["workspace_dir"] == str(session.workspace_dir)
    # max_subagent_depth=3 by default: a child may spawn too (R-TREE-1).
    assert meta["tools"] == ["read_file", SPAWN_SUBAGENT]
    assert meta["settings"]["system"] == f"{SUBAGENT_SYSTEM}\n\nBe brief."
    await host.trace_store.log.sync()
    child_lines = child_trace(data_dir, child_id)
    assert [line["seq"] for line in child_lines] == list(range(1, len(child_lines) + 1))
    assert {line["session_id"] for line in child_lines} == {child_id}
    assert child_lines[0]["type"] == "user_msg"
    assert child_lines[0]["content"] == [{"type": "text", "text": "count the files"}]
    assert child_lines[-1]["type"] == "task_end" and child_lines[-1]["status"] == "completed"
    child_requests = [r for r in provider.requests if is_child(r)]
    assert len(child_requests) == 1
    assert [t.name for t in child_requests[0].tools] == ["read_file", SPAWN_SUBAGENT]
    assert child_requests[0].model == session.settings.model

    # A finished child is no longer open in the host; it can be loaded again.
    assert [s.id for s in host.sessions] == [session.id]
    loaded = await host.load_session(child_id)
    assert loaded.parent_id == session.id
    assert (loaded.root_id, loaded.origin) == (session.id, (session.id, child_id))


async def test_a_finished_child_leaves_no_trace_position_in_its_host(
    host: Host, workspace: Path, providers
) -> None:
    """A host keeps the trace position (where its file log writes) of its open sessions
    only. A finished subagent's was kept for the host's life: one more for every subagent
    it ever ran. Loaded again, the child appends after its last record."""
    parent_step = parent_then_done(spawn("s1", "count the files"))

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            return Reply(blocks=(text("three"),))
        return parent_step(request)

    session = await host.create_session(
        tools=[spawn_subagent], provider=providers(brain), workspace_dir=workspace
    )
    positions: Any = host.trace_log
    outputs = await collect(session.run("delegate it", approve=allow_all))
    (child_id,) = child_ids(outputs, session.id)
    assert session.id in positions._positions
    assert child_id not in positions._positions
    await host.load_session(child_id)
    assert child_id in positions._positions
    traced = [o.seq for o in outputs_from(outputs, child_id) if type(o).TRACED]
    assert host.port(child_id).last_seq == traced[-1] == len(traced)


async def test_two_children_of_one_turn_run_side_by_side(
    host: Host, workspace: Path, providers
) -> None:
    """spawn_subagent is parallel-safe: each child answers only once both have started,
    so the run ends only if they overlap."""
    started: list[str] = []
    both = trio.Event()
    parent_step = parent_then_done(spawn("s1", "task A"), spawn("s2", "task B"))

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if not is_child(request):
            for block in parent_step(request).blocks:
                await stream.block(block)
            return
        started.append(task_of(request))
        if len(started) == 2:
            both.set()
        await both.wait()
        await stream.text(f"done {task_of(request)}")

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("two things", approve=allow_all))

    assert sorted(started) == ["task A", "task B"]
    by_call = {o.call_id: output_text(o) for o in spawn_outputs(outputs, session.id)}
    assert by_call == {"s1": "done task A", "s2": "done task B"}
    assert len(child_ids(outputs, session.id)) == 2
    assert of_type(outputs, TaskEnd)[-1].status == "completed"


async def test_concurrency_limit_makes_the_second_child_wait_for_a_slot(
    host: Host, workspace: Path, providers
) -> None:
    """max_subagents_concurrent=1: the second child starts only after the first ended."""
    release = {"task A": trio.Event(), "task B": trio.Event()}
    started = {"task A": trio.Event(), "task B": trio.Event()}
    any_started = trio.Event()
    running = 0
    peak = 0
    parent_step = parent_then_done(spawn("s1", "task A"), spawn("s2", "task B"))

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        nonlocal running, peak
        if not is_child(request):
            for block in parent_step(request).blocks:
                await stream.block(block)
            return
        task = task_of(request)
        running += 1
        peak = max(peak, running)
        started[task].set()
        any_started.set()
        try:
            await release[task].wait()
        finally:
            running -= 1
        await stream.text(f"done {task}")

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent],
        provider=provider,
        workspace_dir=workspace,
        max_subagents_concurrent=1,
    )
    stream = session.run("two things", approve=allow_all)
    with trio.fail_after(RUN_TIMEOUT_S):
        await any_started.wait()
    # Either call may take the one slot first.
    first_task = "task A" if started["task A"].is_set() else "task B"
    second_task = "task B" if first_task == "task A" else "task A"
    await trio.testing.wait_all_tasks_blocked()
    assert not started[second_task].is_set()  # waiting for the slot
    assert sum(1 for r in provider.requests if is_child(r)) == 1
    release[first_task].set()
    with trio.fail_after(RUN_TIMEOUT_S):
        await started[second_task].wait()
    release[second_task].set()
    outputs = await collect(stream)

    assert peak == 1
    assert [o.status for o in spawn_outputs(outputs, session.id)] == ["ok", "ok"]
    assert of_type(outputs, TaskEnd)[-1].status == "completed"


async def test_per_task_limit_makes_the_extra_call_an_error(
    host: Host, workspace: Path, providers
) -> None:
    """max_subagents_per_task=1: the second spawn of the task is an error output naming
    the limit, and no child runs for it; the task goes on."""

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            return Reply(blocks=(text("child done"),))
        if has_results(request):
            (result,) = results_of(request.messages[-1])
            if result.call_id == "s1":
                return Reply(blocks=(spawn("s2", "second"),))
            return Reply(blocks=(text("parent done"),))
        if last_text(request) == "again":
            return Reply(blocks=(spawn("s3", "third"),))
        return Reply(blocks=(spawn("s1", "first"),))

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent],
        provider=provider,
        workspace_dir=workspace,
        max_subagents_per_task=1,
    )
    outputs = await collect(session.run("go", approve=allow_all))

    first, second = spawn_outputs(outputs, session.id)
    assert (first.status, output_text(first)) == ("ok", "child done")
    assert second.status == "error" and second.is_error
    assert "max_subagents_per_task=1" in output_text(second)
    assert len(child_ids(outputs, session.id)) == 1
    assert [task_of(r) for r in provider.requests if is_child(r)] == ["first"]
    assert of_type(outputs, TaskEnd)[-1].status == "completed"

    # The limit is per task: the next task may spawn again.
    again = await collect(session.run("again", approve=allow_all))
    assert spawn_outputs(again, session.id)[0].status == "ok"


async def test_token_budget_interrupts_the_child_and_fails_the_call(
    host: Host, workspace: Path, data_dir: Path, providers, lookup: Lookup
) -> None:
    """subagent_token_budget=50: the child's first request reports 60 tokens, so the
    child is interrupted (abort, task_end aborted in its trace) and the call is an error
    naming the child and the budget; the parent's task goes on."""
    parent_step = parent_then_done(spawn("s1", "big job"))

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            if has_results(request):
                return Reply(blocks=(text("never reached"),))
            return Reply(
                blocks=(tool_call("c1", "lookup", key="k"),),
                usage=TokenUsage(input=40, output=20),
            )
        return parent_step(request)

    provider = providers(brain)
    session = await host.create_session(
        tools=[lookup.tool, spawn_subagent],
        provider=provider,
        workspace_dir=workspace,
        subagent_token_budget=50,
    )
    outputs = await collect(session.run("go", approve=allow_all))

    (spawned,) = spawn_outputs(outputs, session.id)
    (child_id,) = child_ids(outputs, session.id)
    message = output_text(spawned)
    assert spawned.status == "error"
    assert child_id in message and "budget of 50" in message and "60 tokens" in message
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    assert [r for r in provider.requests if is_child(r)][1:] == []  # no second request

    await host.trace_store.log.sync()
    lines = child_trace(data_dir, child_id)
    assert [line["type"] for line in lines[-2:]] == ["abort", "task_end"]
    assert "budget" in lines[-2]["reason"]
    assert lines[-1]["status"] == "aborted"
    forwarded_end = of_type(outputs_from(outputs, child_id), TaskEnd)
    assert [e.status for e in forwarded_end] == ["aborted"]


async def test_interrupting_the_parent_interrupts_the_running_child(
    host: Host, workspace: Path, data_dir: Path, providers
) -> None:
    """Cancelling the parent cancels the child: the child's trace ends with abort and
    task_end(aborted), forwarded before the parent's own abort; the spawn call is
    interrupted; every request stays paired, the next task too."""
    child_streaming = trio.Event()
    parent_step = parent_then_done(spawn("s1", "slow job"))

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        if is_child(request):
            await stream.text_delta("working on it")
            child_streaming.set()
            await trio.sleep_forever()  # ended by the interrupt
        if has_results(request):
            await stream.text("parent done")
            return
        for block in parent_step(request).blocks:
            await stream.block(block)

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace
    )
    stream = session.run("go", approve=allow_all)
    with trio.fail_after(RUN_TIMEOUT_S):
        await child_streaming.wait()
    assert session.interrupt("stop everything")
    outputs = await collect(stream)

    (child_id,) = child_ids(outputs, session.id)
    own = outputs_from(outputs, session.id)
    assert [o.TYPE for o in own if type(o).TRACED][-3:] == ["tool_call_output", "abort", "task_end"]
    (spawned,) = spawn_outputs(outputs, session.id)
    assert spawned.status == "interrupted"
    assert of_type(own, TaskEnd)[-1].status == "aborted"
    child = outputs_from(outputs, child_id)
    assert [o.TYPE for o in child if type(o).TRACED][-2:] == ["abort", "task_end"]
    assert of_type(child, Abort)[0].reason == "parent task interrupted"
    assert outputs.index(of_type(child, TaskEnd)[0]) < outputs.index(of_type(own, Abort)[0])

    await host.trace_store.log.sync()
    lines = child_trace(data_dir, child_id)
    assert [line["type"] for line in lines[-2:]] == ["abort", "task_end"]
    assert lines[-1]["status"] == "aborted"
    assert lines[-2]["partial"] == [{"type": "text", "text": "working on it"}]
    assert session.busy is False

    # The next task carries the interrupted call, paired (the providers fixture checks).
    again = await collect(session.run("carry on", approve=allow_all))
    assert of_type(again, TaskEnd)[-1].status == "completed"
    assert provider.violations == []


async def test_approvals_in_the_child_come_from_the_parent_run_not_its_rules(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """The parent run's approve callback decides the child's calls (by host); the
    parent's allow_session rules do not widen the child."""

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            if has_results(request):
                return Reply(blocks=(text("child saw the denial"),))
            return Reply(blocks=(tool_call("c9", "lookup", key="secret"),))
        if has_results(request):
            return Reply(blocks=(text("parent done"),))
        if last_text(request) == "look":
            return Reply(blocks=(tool_call("p1", "lookup", key="open"),))
        return Reply(blocks=(spawn("s1", "look it up"),))

    provider = providers(brain)
    session = await host.create_session(
        tools=[lookup.tool, spawn_subagent], provider=provider, workspace_dir=workspace
    )
    first = await collect(session.run("look", approve=lambda call: "allow_session"))
    assert of_type(first, TaskEnd)[-1].status == "completed"
    assert lookup.calls == ["open"]

    def only_spawn(call: ToolCallBlock) -> str:
        return "allow" if call.name == SPAWN_SUBAGENT else "deny"

    outputs = await collect(session.run("delegate", approve=only_spawn))

    (child_id,) = child_ids(outputs, session.id)
    decisions = of_type(outputs_from(outputs, child_id), ApprovalDecision)
    assert [(d.tool, d.decision, d.by) for d in decisions] == [("lookup", "deny", "host")]
    assert lookup.calls == ["open"]  # the child's call never ran
    (spawned,) = spawn_outputs(outputs, session.id)
    assert output_text(spawned) == "child saw the denial"


async def test_without_an_approve_callback_the_child_denies_by_default(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """A parent whose spawn call was allowed by a session rule, run without a callback:
    the child's calls are denied by default, like the parent's would be."""

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            if has_results(request):
                return Reply(blocks=(text("child done"),))
            return Reply(blocks=(tool_call("c1", "lookup", key="k"),))
        if has_results(request):
            return Reply(blocks=(text("parent done"),))
        return Reply(blocks=(spawn("s1", "look"),))

    provider = providers(brain)
    session = await host.create_session(
        tools=[lookup.tool, spawn_subagent], provider=provider, workspace_dir=workspace
    )
    # An earlier "allow for this session" of the parent, as its trace would hold it.
    port_of(session).machine.observe(
        ApprovalDecision(session_id=session.id, run_id="earlier", call_id="c0",
                         tool=SPAWN_SUBAGENT, decision="allow", by="host", remember=True)
    )
    outputs = await collect(session.run("delegate"))

    (child_id,) = child_ids(outputs, session.id)
    decisions = of_type(outputs_from(outputs, child_id), ApprovalDecision)
    assert [(d.decision, d.by) for d in decisions] == [("deny", "default")]
    assert lookup.calls == []


async def test_depth_limit_withholds_the_tool_and_deeper_outputs_keep_their_origin(
    host: Host, workspace: Path, providers
) -> None:
    """max_subagent_depth=2: the child may spawn a grandchild (whose outputs reach the
    root tagged (root, child, grandchild)); the grandchild is not offered spawn_subagent.
    With depth 0 a session may not spawn at all."""

    def brain(request: ModelRequest) -> Reply:
        task = task_of(request)
        if has_results(request):
            (result,) = results_of(request.messages[-1])
            return Reply(blocks=(text(f"{task} got: {result_text(result)}"),))
        if task == "grandchild job":
            return Reply(blocks=(text("leaf answer"),))
        if task == "child job":
            return Reply(blocks=(spawn("g1", "grandchild job"),))
        return Reply(blocks=(spawn("c1", "child job"),))

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace, max_subagent_depth=2
    )
    outputs = await collect(session.run("root job", approve=allow_all))

    (spawned,) = spawn_outputs(outputs, session.id)
    assert output_text(spawned) == "child job got: leaf answer"
    child_id, grandchild_id = child_ids(outputs, session.id)
    assert {o.origin for o in outputs_from(outputs, child_id)} == {(session.id, child_id)}
    assert {o.origin for o in outputs_from(outputs, grandchild_id)} == {
        (session.id, child_id, grandchild_id)
    }
    offered = {task_of(r): [t.name for t in r.tools] for r in provider.requests}
    assert offered == {
        "root job": [SPAWN_SUBAGENT],
        "child job": [SPAWN_SUBAGENT],
        "grandchild job": [],
    }
    # The grandchild's outputs came through the child, then the root: all before the
    # child's own task_end.
    child_end = of_type(outputs_from(outputs, child_id), TaskEnd)[0]
    last_grandchild = outputs_from(outputs, grandchild_id)[-1]
    assert outputs.index(last_grandchild) < outputs.index(child_end)

    flat = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace, max_subagent_depth=0
    )
    refused = await collect(flat.run("root job", approve=allow_all))
    (denied,) = spawn_outputs(refused, flat.id)
    assert denied.status == "error" and "max_subagent_depth=0" in output_text(denied)
    assert child_ids(refused, flat.id) == []


async def test_a_failing_child_gives_an_error_naming_it(
    host: Host, workspace: Path, providers
) -> None:
    """A child that ends max_turns (here: max_turns inherited as 1 and it calls a tool)
    makes the call an error naming the child and its status."""
    parent_step = parent_then_done(spawn("s1", "loop"))

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            return Reply(blocks=(tool_call("x1", "nothing_here"),))
        return parent_step(request)

    provider = providers(brain)
    session = await host.create_session(
        tools=[spawn_subagent], provider=provider, workspace_dir=workspace, max_turns=2
    )
    outputs = await collect(session.run("go", approve=allow_all))

    (spawned,) = spawn_outputs(outputs, session.id)
    (child_id,) = child_ids(outputs, session.id)
    assert spawned.status == "error"
    assert f"subagent {child_id} ended with status max_turns" in output_text(spawned)
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    assert of_type(outputs, ModelMsg)[-1].block == TextBlock(text="parent done")
