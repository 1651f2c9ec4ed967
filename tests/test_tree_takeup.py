"""A tree whose host is killed (R-TREE-2, R-TREE-4, R-HITL-4), with the scripted model: a
background subagent taken up by the next host goes on — its call in flight gets its
host-lost result and is not run again — and its answer reaches its parent as input; a
foreground subagent is not taken up (its parent's call ended with the host). The same over
a cluster with a real nats-server is in tests/test_cluster_tree.py."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, Gates, allow_all, open_host, port_of, trace_lines
from test_gateway import ALICE, connect
from test_recovery import blocking_tool, copy_session

from greenroom.actors.gateway.config import SessionDefaults
from greenroom.actors.gateway.server import Gateway
from greenroom.actors.providers import scripted_brain
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import NotPending
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import RunStream, Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.outputs import (
    ApprovalRequest,
    ModelMsg,
    Output,
    RequestEnd,
    TaskEnd,
    UserMsg,
)
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.tools import make_tool

MODEL = textwrap.dedent(
    """
    from greenroom.actors.providers.scripted import Reply, text
    from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM
    from greenroom.protocols.content import ToolCallBlock
    from greenroom.protocols.context import ToolResult, UserMessage

    def model(request, background):
        results = [
            b for m in request.messages if isinstance(m, UserMessage)
            for b in m.content if isinstance(b, ToolResult)
        ]
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            if results:
                return Reply(blocks=(text("paid, as far as I know"),))
            return Reply(blocks=(ToolCallBlock(id="p1", name="pay", arguments={"amount": 7}),))
        if results:
            return Reply(blocks=(text("the payer works on it"),))
        spawn = {"task": "pay 7", "background": background, "name": "payer"}
        return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))
    """
)

CRASHING_HOST = MODEL + textwrap.dedent(
    """
    import sys, trio
    from greenroom.actors.providers.scripted import ScriptedProvider
    from greenroom.actors.runtime.host import Host
    from greenroom.actors.runtime.subagents import spawn_subagent
    from greenroom.protocols.tools import make_tool

    data_dir, workspace, marks, background = sys.argv[1:5]

    async def pay(amount: int) -> str:
        \"\"\"Pay an amount.\"\"\"
        with open(marks, "a") as handle:
            handle.write(f"{amount}\\n")
        print("paying", flush=True)
        await trio.sleep_forever()  # the host is killed while the call runs
        return "never"

    async def main():
        async with Host.open(data_dir) as host:
            session = await host.create_session(
                provider=ScriptedProvider(lambda r: model(r, background == "yes")),
                tools=[make_tool(pay, parallel=False), spawn_subagent],
                workspace_dir=workspace,
            )
            print(session.id, flush=True)
            await session.run("pay 7 through a subagent", approve=lambda call: "allow").collect()
            print("answered", flush=True)
            await trio.sleep_forever()

    trio.run(main)
    """
)


def _results(request: ModelRequest) -> list[ToolResult]:
    return [
        b
        for m in request.messages
        if isinstance(m, UserMessage)
        for b in m.content
        if isinstance(b, ToolResult)
    ]


def _after_takeup(request: ModelRequest) -> Reply:
    """The model once the host is back: the child sums up its host-lost call; the root
    merges the child's answer when it arrives as input."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=(text("paid, as far as I know"),))
    last = request.messages[-1]
    said = str(last.content) if isinstance(last, UserMessage) else ""
    if "[subagent payer finished]" in said:
        return Reply(blocks=(text("merged: the payer is done"),))
    return Reply(blocks=(text("unexpected request"),))


async def _crash_mid_child_call(
    data_dir: Path, workspace: Path, tmp_path: Path, *, background: bool
) -> str:
    """Run the crashing host until the child's ``pay`` runs (and, for a background child,
    the root's task has ended), SIGKILL it; the root's id."""
    marks = tmp_path / "marks"
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_HOST)
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            str(script),
            str(data_dir),
            str(workspace),
            str(marks),
            "yes" if background else "no",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        lines = b""
        with trio.fail_after(RUN_TIMEOUT_S):
            # The root's id, then the child's call starts; a background child's root
            # answers meanwhile, and its task ends before the host is killed.
            while b"paying" not in lines or (background and b"answered" not in lines):
                lines += await process.stdout.receive_some()
        return lines.split()[0].decode()
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()


def _pay_tool(paid: list[int]) -> object:
    async def pay(amount: int) -> str:
        """Pay an amount."""
        paid.append(amount)
        return "paid"

    return make_tool(pay, parallel=False)


async def _child_of(host: Host, root_id: str) -> str:
    (child_id,) = [i.session_id for i in await host.list_sessions() if i.parent_id == root_id]
    return child_id


async def _until_task_end(inbox: trio.MemoryReceiveChannel[list[Output]]) -> list[Output]:
    seen: list[Output] = []
    async for batch in inbox:
        seen.extend(batch)
        if any(isinstance(o, TaskEnd) and o.origin is None for o in batch):
            return seen
    raise AssertionError("the session closed before its task ended")


async def test_a_background_child_taken_up_after_a_crash_reports_to_its_parent(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-TREE-2, R-TREE-4: the host dies while a background child's side-effecting call
    runs (its root's task has ended). The next host takes the child up: its call gets the
    host-lost result and is not run again, the child answers, leaves the host's open
    sessions, and its answer reaches the root as a follow-up task that the root answers."""
    root_id = await _crash_mid_child_call(data_dir, workspace, tmp_path, background=True)
    paid: list[int] = []
    model = ScriptedProvider(_after_takeup)
    tools = [_pay_tool(paid), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.load_session(root_id, provider=model, tools=tools)
        child_id = await _child_of(host, root_id)
        meta = json.loads((data_dir / "sessions" / child_id / "session.json").read_text())
        assert meta["background"] is True and meta["parent_id"] == root_id
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        await host.resume(child_id, provider=model, tools=tools, approve=lambda call: "allow")
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
        # Reported, it left the host's open sessions, as a live child does.
        assert child_id not in {s.id for s in host.sessions}
        child_lines = trace_lines(await host.load_session(child_id))
        root_lines = trace_lines(root)
    assert paid == [] and (tmp_path / "marks").read_text() == "7\n"  # run once, never again
    (lost,) = [line for line in child_lines if line["type"] == "tool_call_output"]
    assert lost["status"] == "interrupted" and "was not run again" in lost["content"][0]["text"]
    assert child_lines[-1]["type"] == "task_end" and child_lines[-1]["status"] == "completed"
    prompts = [o for o in seen if isinstance(o, UserMsg) and o.origin is None]
    assert [p.content[0].text for p in prompts] == [  # type: ignore[union-attr]
        "[subagent payer finished] paid, as far as I know"
    ]
    assert root_lines[-1]["type"] == "task_end" and root_lines[-1]["status"] == "completed"
    assert [line["type"] for line in root_lines].count("task_start") == 2


async def test_a_childs_report_taken_up_after_a_crash_is_delivered_once_across_restarts(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-TREE-2, R-STEER-6: a report reaches its parent as a follow-up that is not
    recorded as ``task_queued`` (the child's own trace makes it durable: recording it too
    would deliver it twice), so a host opened after the report ran finds no work left and
    runs it no second time."""
    root_id = await _crash_mid_child_call(data_dir, workspace, tmp_path, background=True)
    model = ScriptedProvider(_after_takeup)
    tools = [_pay_tool([]), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.load_session(root_id, provider=model, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        child_id = await _child_of(host, root_id)
        await host.resume(child_id, provider=model, tools=tools, approve=lambda call: "allow")
        with trio.fail_after(RUN_TIMEOUT_S):
            await _until_task_end(inbox)
        reported = trace_lines(root)
    assert "task_queued" not in [line["type"] for line in reported]
    asked = len(model.requests)

    async with Host.open(data_dir, resume_tasks=True, tools=tools) as host:
        assert await host.resume_tasks() == []
        root = await host.load_session(root_id, provider=model, tools=tools)
        assert not root.busy
        assert trace_lines(root) == reported
    assert len(model.requests) == asked
    prompts = [line for line in reported if line["type"] == "user_msg"]
    assert sum("[subagent payer finished]" in str(p["content"]) for p in prompts) == 1


async def test_a_foreground_child_is_not_taken_up_after_a_crash(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-TREE-4: a foreground child's call ended with its parent's task, so the next host
    does not take the child up: nothing of it runs again, its task is left to its trace."""
    root_id = await _crash_mid_child_call(data_dir, workspace, tmp_path, background=False)
    paid: list[int] = []
    model = ScriptedProvider(_after_takeup)
    tools = [_pay_tool(paid), spawn_subagent]
    async with open_host(data_dir) as host:
        await host.load_session(root_id, provider=model, tools=tools)
        child = await host.resume(await _child_of(host, root_id), provider=model, tools=tools)
        assert not child.busy
        assert model.requests == []
    assert paid == [] and (tmp_path / "marks").read_text() == "7\n"


def _payer_model(request: ModelRequest) -> Reply:
    """The root spawns the payer in the background and merges its answer; the payer pays
    (a call that needs a person's approval) and says so."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if _results(request):
            return Reply(blocks=(text("paid 7"),))
        return Reply(blocks=(tool_call("p1", "pay", amount=7),))
    last = request.messages[-1]
    if isinstance(last, UserMessage) and "[subagent payer finished]" in str(last.content):
        return Reply(blocks=(text("merged: the payer is done"),))
    if _results(request):
        return Reply(blocks=(text("the payer works on it"),))
    spawn = {"task": "pay 7", "background": True, "name": "payer"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))


async def _run_until_child_parked(host: Host, root: Session, *, pays: int = 1) -> str:
    """Run the root's first task with ``approve="people"`` (a person allows each spawn in
    the tree); return its one child's id once the root's task has ended, ``pays`` ``pay``
    calls of the tree were asked about, and the child's waits for a person with no
    supervisor left."""
    send, inbox = trio.open_memory_channel[list[Output]](math.inf)
    root.watch(send)
    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_collect, root.run("pay 7 through a subagent", approve=PEOPLE))
            async for batch in inbox:
                asked = [o for o in batch if isinstance(o, ApprovalRequest)]
                for spawn in (o for o in asked if o.tool == "spawn_subagent"):
                    node = root.id if spawn.origin is None else spawn.origin[-1]
                    await host.answer_approval(node, spawn.call_id, "allow")
                pays -= sum(o.tool == "pay" for o in asked)
                if pays <= 0:
                    break
        (child,) = await root.children()
        await child.wait_idle()
    inbox.close()
    port = host.port(child.id)
    assert port.parked and port.inbox is None  # R-HITL-3: it holds nothing
    return child.id


async def _collect(run: RunStream) -> None:
    await run.collect()


async def _answer_the_parked_child(
    host: Host, model: ScriptedProvider, tools: list[Any], root_id: str, child_id: str
) -> tuple[Session, list[Output]]:
    """Load the root and its parked child in ``host`` (started again), allow the child's
    pending call, and return the root with its outputs up to its task's end."""
    root = await host.load_session(root_id, provider=model, tools=tools)
    await host.load_session(child_id, provider=model, tools=tools)
    (pending,) = await host.pending_approvals()
    send, inbox = trio.open_memory_channel[list[Output]](math.inf)
    root.watch(send)
    await host.answer_approval(child_id, pending.call_id, "allow")
    with trio.fail_after(RUN_TIMEOUT_S):
        return root, await _until_task_end(inbox)


class _Parked(NamedTuple):
    """A tree left on a closed host with its background payer waiting for a person: the
    amounts paid, the model and tools of the tree, the ids of the root and the payer."""

    paid: list[int]
    model: ScriptedProvider
    tools: list[Any]
    root_id: str
    child_id: str


async def _payer_parked_on_a_closed_host(
    data_dir: Path, workspace: Path, reply: Callable[[ModelRequest], Reply]
) -> _Parked:
    """A host of ``data_dir`` runs a new root, its model ``reply``, until its background
    payer waits for a person, and closes."""
    paid: list[int] = []
    model = ScriptedProvider(reply)
    tools = [_pay_tool(paid), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(provider=model, tools=tools, workspace_dir=workspace)
        root_id, child_id = root.id, await _run_until_child_parked(host, root)
    return _Parked(paid, model, tools, root_id, child_id)


def _assert_the_payer_stopped_by_its_tree_budget(
    seen: list[Output], paid: list[int], requests_since: int
) -> None:
    """The payer, answered on the next host, paid once and then was refused by
    ``tree_cost_budget_usd=0.5``: its one report names it, and the only request after the
    restart is the root's merge, not the payer's answer."""
    assert paid == [7]
    (report,) = _reports(seen)
    assert report.startswith("[subagent payer finished]"), report
    assert "budget_exceeded" in report and "tree_cost_budget_usd=0.5" in report, report
    assert requests_since == 1


def _reports(seen: list[Output]) -> list[str]:
    return [
        o.content[0].text  # type: ignore[union-attr]
        for o in seen
        if isinstance(o, UserMsg) and o.origin is None and "[subagent" in str(o.content)
    ]


async def test_a_background_child_waiting_for_a_person_parks_and_reports_once_answered(
    data_dir: Path, workspace: Path
) -> None:
    """R-HITL-3, R-TREE-2: a background child whose call waits for a person parks (no
    supervisor, no slot of its parent's task); answered, it runs the call once and its
    answer reaches the root, idle by then, as a follow-up task."""
    paid: list[int] = []
    model = ScriptedProvider(_payer_model)
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=model, tools=[_pay_tool(paid), spawn_subagent], workspace_dir=workspace
        )
        child_id = await _run_until_child_parked(host, root)
        (pending,) = await host.pending_approvals()
        assert pending.session_id == child_id and pending.origin == (root.id, child_id)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        await host.answer_approval(child_id, pending.call_id, "allow")
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
    assert paid == [7]
    assert _reports(seen) == ["[subagent payer finished] paid 7"]


async def test_a_parked_background_child_answered_after_a_restart_reports_once(
    data_dir: Path, workspace: Path
) -> None:
    """R-HITL-1, R-TREE-4: the host closes while a background child waits for a person;
    the next host answers it: the call runs once and the child's answer reaches the root
    once (the close reported nothing)."""
    paid, model, tools, root_id, child_id = await _payer_parked_on_a_closed_host(
        data_dir, workspace, _payer_model
    )
    async with open_host(data_dir) as host:
        root, seen = await _answer_the_parked_child(host, model, tools, root_id, child_id)
        root_lines = trace_lines(root)
    assert paid == [7]
    assert _reports(seen) == ["[subagent payer finished] paid 7"]
    prompts = [line for line in root_lines if line["type"] == "user_msg"]
    assert len(prompts) == 2  # the first task's prompt and the one report


async def test_the_last_level_loaded_again_is_not_offered_spawn(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-1: with ``max_subagent_depth=1`` the child is the last level, offered no
    ``spawn_subagent``, and so it stays when the next host loads it with the tools of the
    tree; its root, loaded alike, still is. Before, a subagent loaded again was offered
    whatever tools it was loaded with."""
    model = ScriptedProvider(_payer_model)
    tools = [_pay_tool([]), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=model, tools=tools, workspace_dir=workspace, max_subagent_depth=1
        )
        root_id, child_id = root.id, await _run_until_child_parked(host, root)
    before = len(model.requests)
    async with open_host(data_dir) as host:
        await _answer_the_parked_child(host, model, tools, root_id, child_id)
    offered = [
        ("child" if (r.system or "").startswith(SUBAGENT_SYSTEM) else "root", r.tools)
        for r in model.requests
    ]
    # The root and the child each ask before the restart, and after it (the child's
    # answer, the root's merge), in no fixed order.
    asked = [sorted(node for node, _ in part) for part in (offered[:before], offered[before:])]
    assert asked == [["child", "root", "root"], ["child", "root"]]
    tools_of = {"root": ["pay", "spawn_subagent"], "child": ["pay"]}
    assert [[t.name for t in tools] for _, tools in offered] == [
        tools_of[node] for node, _ in offered
    ]


def _payer_model_paying_after_the_report(request: ModelRequest) -> Reply:
    """As :func:`_payer_model`, but the root, told that the payer finished, pays 1 itself
    (a call that needs a decision) before it merges."""
    root = not (request.system or "").startswith(SUBAGENT_SYSTEM)
    if root and any(result.call_id == "p2" for result in _results(request)):
        return Reply(blocks=(text("merged, and paid 1"),))
    last = request.messages[-1]
    if root and isinstance(last, UserMessage) and "[subagent payer finished]" in str(last.content):
        return Reply(blocks=(tool_call("p2", "pay", amount=1),))
    return _payer_model(request)


async def test_a_closed_parent_loaded_for_its_childs_answer_decides_as_its_host_says(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HITL-4, R-TREE-2: the host closes while a background child waits for a person;
    the next host is opened with ``approve`` allowing every call (as ``serve --approve
    all`` opens its host) and a person allows the child's call. The child's answer reaches
    the root, which the host loads on its own for it (closed: nobody opened it), and the
    follow-up task it starts pays at once. Before, the host's own loads took ``"people"``:
    that call waited for a person nobody was asking."""
    paid, _, tools, root_id, child_id = await _payer_parked_on_a_closed_host(
        data_dir, workspace, _payer_model_paying_after_the_report
    )
    # The host loads the root and the child with the provider their session.json names.
    monkeypatch.setattr(scripted_brain, "demo_brain", _payer_model_paying_after_the_report)
    send, inbox = trio.open_memory_channel[list[Output]](math.inf)

    def watch_the_root(session: Session) -> None:
        if session.id == root_id:
            session.watch(send)

    async with Host.open(
        data_dir, tools=tools, approve=allow_all, observers=[watch_the_root]
    ) as host:
        (pending,) = await host.pending_approvals(read_only=True)
        await host.answer_approval(child_id, pending.call_id, "allow")
        seen: list[Output] = []
        with trio.fail_after(RUN_TIMEOUT_S):
            async for batch in inbox:
                seen.extend(o for o in batch if o.origin is None)
                if any(isinstance(o, ApprovalRequest | TaskEnd) for o in seen):
                    break
        asked = [o.tool for o in seen if isinstance(o, ApprovalRequest)]
    assert asked == [] and paid == [7, 1]
    assert _reports(seen) == ["[subagent payer finished] paid 7"]
    (end,) = [o for o in seen if isinstance(o, TaskEnd)]
    assert end.status == "completed"


def _dear_payer_model(request: ModelRequest) -> Reply:
    """As :func:`_payer_model`, and each request of the payer uses 40,000 tokens ($0.40
    at $10 per million), the root's 10."""
    reply = _payer_model(request)
    tokens = 40_000 if (request.system or "").startswith(SUBAGENT_SYSTEM) else 10
    return Reply(blocks=reply.blocks, usage=TokenUsage(input=tokens))


async def test_a_subtree_budget_holds_for_a_background_child_answered_after_a_restart(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-3, R-SHARE-4: the payer may spend tree_cost_budget_usd=0.5 with its
    subagents; it spent $0.40 and parked, and the host restarted. Answered on the next
    host, its call runs, and its next request — bound to $0.501 by its context of 40,000
    tokens — could pass the budget: it is not sent, the payer ends budget_exceeded and
    its report says why (the loaded child counted against no tree budget before)."""
    paid: list[int] = []
    model = ScriptedProvider(_dear_payer_model)
    tools = [_pay_tool(paid), spawn_subagent]
    prices = {"scripted": {"input": 10.0, "output": 10.0, "cache_write": 12.5}}
    async with Host.open(data_dir, prices=prices) as host:
        root = await host.create_session(
            provider=model, tools=tools, workspace_dir=workspace, tree_cost_budget_usd=0.5,
            max_tokens=100,
        )
        root_id, child_id = root.id, await _run_until_child_parked(host, root)
    requests = len(model.requests)
    async with Host.open(data_dir, prices=prices) as host:
        root, seen = await _answer_the_parked_child(host, model, tools, root_id, child_id)
    _assert_the_payer_stopped_by_its_tree_budget(seen, paid, len(model.requests) - requests)


async def test_a_token_budget_holds_for_a_background_child_answered_after_a_restart(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-3: the payer may use subagent_token_budget=50,000 tokens; it used 40,000
    and parked, and the host restarted. Answered on the next host, its next request uses
    40,000 more: past the budget, counted from what its task used before the restart, so
    its report is the budget's error (the taken-up child had no token budget before)."""
    paid: list[int] = []
    model = ScriptedProvider(_dear_payer_model)
    tools = [_pay_tool(paid), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=model, tools=tools, workspace_dir=workspace,
            subagent_token_budget=50_000,
        )
        root_id, child_id = root.id, await _run_until_child_parked(host, root)
    async with open_host(data_dir) as host:
        root, seen = await _answer_the_parked_child(host, model, tools, root_id, child_id)
    assert paid == [7]
    (report,) = _reports(seen)
    assert report.startswith("[subagent payer finished]"), report
    assert "over its budget of 50000 (subagent_token_budget)" in report, report


def _scouting_payer_model(request: ModelRequest) -> Reply:
    """As :func:`_payer_model`, and the payer first has a foreground subagent, the scout,
    look around: the scout's request uses 30,000 tokens ($0.30 at $10 per million); the
    payer's use 10 (its spawn), then 10,000 (its pay call), then 15,000 (its answer); the
    root's 10."""
    results = _results(request)
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if "look around" in str(request.messages[0].content):
            return Reply(blocks=(text("all clear"),), usage=TokenUsage(input=30_000))
        if not results:
            scout = {"task": "look around", "name": "scout"}
            call = ToolCallBlock(id="s2", name="spawn_subagent", arguments=scout)
            return Reply(blocks=(call,), usage=TokenUsage(input=10))
        if len(results) == 1:
            return Reply(blocks=(tool_call("p1", "pay", amount=7),), usage=TokenUsage(input=10_000))
        return Reply(blocks=(text("paid 7"),), usage=TokenUsage(input=15_000))
    return Reply(blocks=_payer_model(request).blocks, usage=TokenUsage(input=10))


async def _scout_then_park(
    host: Host, model: ScriptedProvider, tools: list[Any], workspace: Path, **settings: Any
) -> tuple[str, str]:
    """A root whose background payer had its scout spend, then parked on its pay call;
    the ids of the root and the payer."""
    root = await host.create_session(
        provider=model, tools=tools, workspace_dir=workspace, **settings
    )
    child_id = await _run_until_child_parked(host, root)
    (scout,) = await host.get_session(child_id).children()
    assert scout.root_id == root.id and not scout.busy
    return root.id, child_id


async def test_a_subtree_budget_counts_a_reloaded_childs_subagents_from_before_a_restart(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-3, R-SHARE-4: the payer may spend tree_cost_budget_usd=0.5 with its
    subagents; its scout spent $0.30 and it $0.1001, then it parked and the host
    restarted. Answered on the next host, its next request — bound to $0.126 by its
    context of 10,000 tokens — could pass the budget with the scout's spending: it is not
    sent and the payer reports budget_exceeded (the loaded payer's subtree counted only
    what it spent itself, $0.1001, before: it answered, paid 7)."""
    paid: list[int] = []
    model = ScriptedProvider(_scouting_payer_model)
    tools = [_pay_tool(paid), spawn_subagent]
    prices = {"scripted": {"input": 10.0, "output": 10.0, "cache_write": 12.5}}
    async with Host.open(data_dir, prices=prices) as host:
        root_id, child_id = await _scout_then_park(
            host, model, tools, workspace, tree_cost_budget_usd=0.5, max_tokens=100
        )
    requests = len(model.requests)
    async with Host.open(data_dir, prices=prices) as host:
        _, seen = await _answer_the_parked_child(host, model, tools, root_id, child_id)
    _assert_the_payer_stopped_by_its_tree_budget(seen, paid, len(model.requests) - requests)


async def test_a_token_budget_counts_a_reloaded_childs_subagents_from_before_a_restart(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-3: the payer may use subagent_token_budget=50,000 tokens with its subagents;
    its scout used 30,000 and it 10,010, then it parked and the host restarted. Answered
    on the next host, its answer uses 15,000 more: 55,010, past the budget, so its report
    is the budget's error (counted from its own 10,010 alone, it reported paid 7 before)."""
    paid: list[int] = []
    model = ScriptedProvider(_scouting_payer_model)
    tools = [_pay_tool(paid), spawn_subagent]
    async with open_host(data_dir) as host:
        root_id, child_id = await _scout_then_park(
            host, model, tools, workspace, subagent_token_budget=50_000
        )
    async with open_host(data_dir) as host:
        _, seen = await _answer_the_parked_child(host, model, tools, root_id, child_id)
    assert paid == [7]
    (report,) = _reports(seen)
    assert report.startswith("[subagent payer finished]"), report
    assert "used 55010 tokens, over its budget of 50000" in report, report


def _collecting_payer_model(request: ModelRequest) -> Reply:
    """As :func:`_payer_model`, and the payer first spawns a background subagent of its
    own, the collector, then pays: its requests use 10 (the spawn), 20,000 (its pay call),
    then 10 (its answer). The collector pays too (a person allows it) and says so: 10
    tokens, then 35,000. The root's requests use 10."""
    results = _results(request)
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if "collect 7" in str(request.messages[0].content):
            if results:
                return Reply(blocks=(text("collected 7"),), usage=TokenUsage(input=35_000))
            return Reply(blocks=(tool_call("c1", "pay", amount=3),), usage=TokenUsage(input=10))
        if not results:
            collect = {"task": "collect 7", "background": True, "name": "collector"}
            call = ToolCallBlock(id="s2", name="spawn_subagent", arguments=collect)
            return Reply(blocks=(call,), usage=TokenUsage(input=10))
        if len(results) == 1:
            return Reply(blocks=(tool_call("p1", "pay", amount=7),), usage=TokenUsage(input=20_000))
        return Reply(blocks=(text("paid 7"),), usage=TokenUsage(input=10))
    return Reply(blocks=_payer_model(request).blocks, usage=TokenUsage(input=10))


async def _collector_then_park(
    host: Host, model: ScriptedProvider, tools: list[Any], workspace: Path, **settings: Any
) -> tuple[str, str, str]:
    """A root whose background payer spawned its background collector, both parked on
    their pay calls; the ids of the root, the payer and the collector."""
    root = await host.create_session(
        provider=model, tools=tools, workspace_dir=workspace, **settings
    )
    payer_id = await _run_until_child_parked(host, root, pays=2)
    (collector,) = await host.get_session(payer_id).children()
    with trio.fail_after(RUN_TIMEOUT_S):
        await collector.wait_idle()
    assert host.port(collector.id).parked
    return root.id, payer_id, collector.id


async def _load_the_parked_tree(
    host: Host, model: ScriptedProvider, tools: list[Any], ids: tuple[str, str, str]
) -> tuple[Session, Session, Session, dict[str, str]]:
    """Load the root, the payer and the collector of :func:`_collector_then_park` in
    ``host``: the three sessions, and the call each parked one waits on, by session id."""
    root, payer, collector = [
        await host.load_session(session_id, provider=model, tools=tools) for session_id in ids
    ]
    asked = {p.session_id: p.call_id for p in await host.pending_approvals()}
    return root, payer, collector, asked


def _outputs_of(session: Session) -> trio.MemoryReceiveChannel[list[Output]]:
    """``session``'s outputs from now on, a batch at a time."""
    send, outputs = trio.open_memory_channel[list[Output]](math.inf)
    session.watch(send)
    return outputs


async def _answer_the_parked_grandchild(
    host: Host,
    model: ScriptedProvider,
    tools: list[Any],
    ids: tuple[str, str, str],
    *,
    answer_payer: bool = True,
) -> list[Output]:
    """Load the tree of :func:`_collector_then_park` in ``host`` (started again, or the
    same), allow the collector's pay call, then once its task has ended the payer's (unless
    not ``answer_payer``); the root's outputs up to its task's end."""
    _, payer_id, collector_id = ids
    root, _, collector, asked = await _load_the_parked_tree(host, model, tools, ids)
    inbox, collector_outputs = _outputs_of(root), _outputs_of(collector)
    with trio.fail_after(RUN_TIMEOUT_S):
        await host.answer_approval(collector_id, asked[collector_id], "allow")
        await _until_task_end(collector_outputs)
        if answer_payer:
            await host.answer_approval(payer_id, asked[payer_id], "allow")
        return await _until_task_end(inbox)


@pytest.mark.parametrize("restart", [True, False], ids=["after_a_restart", "same_host"])
async def test_a_parked_node_is_interrupted_when_its_subtree_passes_its_token_budget(
    data_dir: Path, workspace: Path, restart: bool
) -> None:
    """R-TREE-3, R-HITL-3: the payer may use subagent_token_budget=50,000 tokens with its
    subagents; it used 20,010 and its background collector 10, both parked (and the host
    restarted, or not). The collector, answered, uses 35,000 more, which brings the
    payer's subtree to 55,020 while the payer still waits for a person: the payer is
    interrupted there — its pay call is not run and nobody is asked about it any more —
    and its report names the budget. Before, the payer waited on and would have paid 7
    once allowed: after a restart its watch's interrupt reached no supervisor and was
    lost; in the same host its watch did not even see the collector's tokens (a parked
    run's reader got none of its subtree's outputs)."""
    paid: list[int] = []
    model = ScriptedProvider(_collecting_payer_model)
    tools = [_pay_tool(paid), spawn_subagent]

    async def answer_the_collector(host: Host, ids: tuple[str, str, str]) -> list[Output]:
        seen = await _answer_the_parked_grandchild(host, model, tools, ids, answer_payer=False)
        assert await host.pending_approvals() == []
        return seen

    async with open_host(data_dir) as host:
        ids = await _collector_then_park(
            host, model, tools, workspace, subagent_token_budget=50_000
        )
        if not restart:
            seen = await answer_the_collector(host, ids)
    async with open_host(data_dir) as host:
        if restart:
            seen = await answer_the_collector(host, ids)
        payer_lines = trace_lines(await host.load_session(ids[1]))
    assert paid == [3]
    (report,) = _reports(seen)
    assert report.startswith("[subagent payer finished]"), report
    assert "used 55020 tokens, over its budget of 50000" in report, report
    end = next(line for line in payer_lines if line["type"] == "task_end")
    assert end["status"] == "aborted" and "subagent token budget exceeded" in end["message"], end
    (pay,) = [
        line for line in payer_lines
        if line["type"] == "tool_call_output" and line["call_id"] == "p1"
    ]
    assert pay["status"] == "interrupted", pay


async def test_the_roots_watch_sees_a_grandchild_taken_up_after_a_restart_once(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-1: the payer and its background collector parked, and the host restarted.
    Answered on the next host, the collector's outputs reach the root's watchers with the
    collector's origin, and the payer's with the payer's, each once (no forwarder took a
    loaded subagent's outputs to its parent before)."""
    model = ScriptedProvider(_collecting_payer_model)
    tools = [_pay_tool([]), spawn_subagent]
    async with open_host(data_dir) as host:
        ids = await _collector_then_park(host, model, tools, workspace)
    async with open_host(data_dir) as host:
        seen = await _answer_the_parked_grandchild(host, model, tools, ids)
    root_id, payer_id, collector_id = ids
    ends = [o.origin for o in seen if isinstance(o, TaskEnd) and o.origin is not None]
    assert ends == [(root_id, payer_id, collector_id), (root_id, payer_id)]
    answers = [
        (o.origin, o.block.text)  # type: ignore[union-attr]
        for o in seen
        if isinstance(o, ModelMsg) and o.origin is not None and isinstance(o.block, TextBlock)
    ]
    assert answers == [
        ((root_id, payer_id, collector_id), "collected 7"),
        ((root_id, payer_id), "paid 7"),
    ]


def _merging_payer_model(request: ModelRequest) -> Reply:
    """As :func:`_collecting_payer_model`, and the payer, told the collector's answer,
    merges it into its own."""
    last = request.messages[-1]
    told = isinstance(last, UserMessage) and "[subagent collector finished]" in str(last.content)
    if told and (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=(text("paid 7, and the collector: collected 7"),))
    return _collecting_payer_model(request)


@pytest.mark.parametrize("restart", [True, False], ids=["after_a_restart", "same_host"])
async def test_a_subagent_answered_first_waits_for_its_parked_background_child(
    data_dir: Path, workspace: Path, restart: bool
) -> None:
    """R-TREE-2, R-HITL-3, R-HITL-4: the payer and its background collector both wait
    for a person (parked), and the host is closed and opened again on the same data dir
    (or not). The payer, allowed first, pays and answers, then waits for the collector,
    still parked; the collector, allowed, answers, and its answer reaches the payer as
    steering of the same task: the payer's answer, which reaches the root, merges it.
    Before, after a restart the collector, loaded parked, counted among no running
    children of the payer, whose task could end as soon as it had answered: the root got
    the payer's answer without the collector's, which came as a second task."""
    model = ScriptedProvider(_merging_payer_model)
    tools = [_pay_tool([]), spawn_subagent]

    async def answer_the_payer_first(
        host: Host, ids: tuple[str, str, str]
    ) -> tuple[list[Output], list[dict[str, Any]]]:
        _, payer_id, collector_id = ids
        root, payer, _, asked = await _load_the_parked_tree(host, model, tools, ids)
        inbox, payer_outputs = _outputs_of(root), _outputs_of(payer)
        with trio.fail_after(RUN_TIMEOUT_S):
            await host.answer_approval(payer_id, asked[payer_id], "allow")
            async for batch in payer_outputs:  # the payer has paid and answered
                if any(isinstance(o, ModelMsg) and o.origin is None for o in batch):
                    break
            # Its task holds for the collector: it counts among its running children
            # (when the answer below wins a race with the payer's end, that alone would
            # not show it).
            children = port_of(payer).children
            assert children is not None and list(children.live) == [collector_id]
            await host.answer_approval(collector_id, asked[collector_id], "allow")
            return await _until_task_end(inbox), trace_lines(payer)

    async with open_host(data_dir) as host:
        ids = await _collector_then_park(host, model, tools, workspace)
        if not restart:
            seen, payer_lines = await answer_the_payer_first(host, ids)
    if restart:
        async with open_host(data_dir) as host:
            seen, payer_lines = await answer_the_payer_first(host, ids)
    assert _reports(seen) == ["[subagent payer finished] paid 7, and the collector: collected 7"]
    assert _task_of(payer_lines) == ["task_start", "report", "task_end"]
    assert payer_lines[-1]["status"] == "completed", payer_lines[-1]


def _before_the_crash(request: ModelRequest) -> Reply:
    """The root spawns the payer in the background (:func:`_payer_model`); the payer
    spawns the collector in the background and says it waits for it; the collector holds
    a call (``hold``, running until its host stops)."""
    if not (request.system or "").startswith(SUBAGENT_SYSTEM):
        return _payer_model(request)
    if "collect 3" in str(request.messages[0].content):
        return Reply(blocks=(tool_call("h1", "hold", key="collecting"),))
    if _results(request):
        return Reply(blocks=(text("waiting for the collector"),))
    collect = {"task": "collect 3", "background": True, "name": "collector"}
    return Reply(blocks=(ToolCallBlock(id="s2", name="spawn_subagent", arguments=collect),))


async def _crash_while_the_payer_waits(
    data_dir: Path, crash_dir: Path, workspace: Path
) -> tuple[str, str, str]:
    """Run the tree of :func:`_before_the_crash` until the root's task has ended, the
    payer's has answered and waits for its background collector, and the collector's
    ``hold`` call runs; copy the three sessions' files, durable, into ``crash_dir``: what
    a host killed there leaves. The ids of the root, the payer and the collector."""
    hold, holding = blocking_tool()
    model = ScriptedProvider(_before_the_crash)
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=model, tools=[hold, spawn_subagent], workspace_dir=workspace
        )
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        root.run("collect and pay through a subagent", approve=lambda call: "allow").detach()
        root_ended = payer_answered = False
        with trio.fail_after(RUN_TIMEOUT_S):
            async for batch in inbox:
                for o in batch:
                    root_ended = root_ended or (isinstance(o, TaskEnd) and o.origin is None)
                    if isinstance(o, RequestEnd) and o.origin is not None and o.turn == 2:
                        payer_answered = len(o.origin) == 2
                if root_ended and payer_answered:
                    break
            await holding.wait()
        (payer,) = await root.children()
        (collector,) = await payer.children()
        assert port_of(payer).machine.waiting_for == "children"
        for session in (root, payer, collector):
            await port_of(session).sync_trace()
            copy_session(session, crash_dir)
    return root.id, payer.id, collector.id


def _after_the_crash(collector: Reply) -> Callable[[ModelRequest], Reply]:
    """The model on the next host: the collector replies ``collector`` (then, with its
    call's result, ``collected 3``); the payer merges the collector's answer; the root
    merges the payer's (:func:`_payer_model`)."""

    def model(request: ModelRequest) -> Reply:
        if not (request.system or "").startswith(SUBAGENT_SYSTEM):
            return _payer_model(request)
        if "collect 3" in str(request.messages[0].content):
            if len(_results(request)) > 1:
                return Reply(blocks=(text("collected 3"),))
            return collector
        last = request.messages[-1]
        if isinstance(last, UserMessage) and "[subagent collector finished]" in str(last.content):
            return Reply(blocks=(text("merged: collected 3"),))
        return Reply(blocks=(text("unexpected request"),))

    return model


def _tools_after_the_crash(paid: list[int]) -> tuple[list[Any], trio.Event]:
    """The tools of the next host: ``hold`` (its event set once a call runs), ``pay``
    and ``spawn_subagent``."""
    hold, holding = blocking_tool()
    return [hold, _pay_tool(paid), spawn_subagent], holding


def _task_of(lines: list[dict[str, Any]]) -> list[str]:
    """The kinds of a trace's task records and of the subagents' reports it took."""
    return [
        "report" if line["type"] == "user_msg" and "[subagent" in str(line["content"])
        else line["type"]
        for line in lines
        if line["type"] in ("task_start", "task_end", "user_msg")
        and not (line["type"] == "user_msg" and line.get("kind") == "prompt")
    ]


async def test_a_subagent_taken_up_after_a_crash_waits_for_its_running_background_child(
    data_dir: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-HITL-4: the host dies while the payer's task, answered, waits for its
    background collector, whose call runs. The next host takes both up (resume_tasks):
    the collector's call gets its host-lost result, the collector answers, and its answer
    reaches the payer as steering of the same task, which answers with it; the root gets
    the payer's merged answer, once. (Before, the loaded payer knew no running child: its
    task ended at once, with its old answer, and the collector's came as a second task.)"""
    crash_dir = tmp_path / "crashed"
    root_id, payer_id, collector_id = await _crash_while_the_payer_waits(
        data_dir, crash_dir, workspace
    )
    # The host loads the taken-up sessions with the provider their session.json names.
    model = _after_the_crash(Reply(blocks=(text("collected 3"),)))
    monkeypatch.setattr(scripted_brain, "demo_brain", model)
    tools, _ = _tools_after_the_crash([])
    async with Host.open(crash_dir, tools=tools) as host:
        root = await host.load_session(root_id, provider=ScriptedProvider(model))
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        resumed = await host.resume_tasks(approve=lambda call: "allow")
        assert sorted(resumed) == sorted([payer_id, collector_id])
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
        payer_lines = trace_lines(await host.load_session(payer_id))
    assert _reports(seen) == ["[subagent payer finished] merged: collected 3"]
    assert _task_of(payer_lines) == ["task_start", "report", "task_end"]
    assert payer_lines[-1]["status"] == "completed"


async def test_a_subagent_taken_up_alone_does_not_wait_for_a_child_nobody_runs(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-TREE-2, R-HITL-4: after the same crash, a host opened without taking tasks up
    resumes the payer alone: its collector, left open in its trace, runs nowhere, so the
    payer's task ends at once and reports to the root. The collector, resumed later,
    still answers: its answer reaches the payer as a follow-up task."""
    crash_dir = tmp_path / "crashed"
    root_id, payer_id, collector_id = await _crash_while_the_payer_waits(
        data_dir, crash_dir, workspace
    )
    model = ScriptedProvider(_after_the_crash(Reply(blocks=(text("collected 3"),))))
    tools, _ = _tools_after_the_crash([])
    allow = {"provider": model, "tools": tools, "approve": lambda call: "allow"}
    async with Host.open(crash_dir, tools=tools) as host:
        root = await host.load_session(root_id, provider=model)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        await host.resume(payer_id, **allow)
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
            # Its answer, given before the crash, is its report (R-TREE-4).
            assert _reports(seen) == ["[subagent payer finished] waiting for the collector"]
            payer = await host.load_session(payer_id)
            answered, payer_outputs = trio.open_memory_channel[list[Output]](math.inf)
            payer.watch(answered)
            await host.resume(collector_id, **allow)
            await _until_task_end(payer_outputs)
        payer_lines = trace_lines(payer)
    assert _task_of(payer_lines) == ["task_start", "task_end", "task_start", "task_end"]
    (report_prompt,) = [line for line in payer_lines if line.get("kind") == "prompt"][1:]
    assert "[subagent collector finished] collected 3" in str(report_prompt["content"])


async def test_a_subagent_taken_up_waits_for_a_child_that_parks(
    data_dir: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-HITL-3: after the same crash, the next host takes the tree up with its
    calls decided by people: the collector goes on and asks a person to allow a pay call,
    so it parks, holding nothing. The payer's task waits for it still, as it would for a
    parked child spawned on this host: allowed, the collector pays and its answer reaches
    the payer as steering of the same task, which merges it, and the root gets the merged
    answer once. (Before, the collector parking let the payer's task end with its old
    answer, and the collector's came as a second task of the payer.)"""
    crash_dir = tmp_path / "crashed"
    root_id, payer_id, collector_id = await _crash_while_the_payer_waits(
        data_dir, crash_dir, workspace
    )
    model = _after_the_crash(Reply(blocks=(tool_call("c2", "pay", amount=3),)))
    monkeypatch.setattr(scripted_brain, "demo_brain", model)
    paid: list[int] = []
    tools, _ = _tools_after_the_crash(paid)
    async with Host.open(crash_dir, tools=tools) as host:
        root = await host.load_session(root_id, provider=ScriptedProvider(model))
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        await host.resume_tasks()
        collector = host.get_session(collector_id)
        asking, collector_outputs = trio.open_memory_channel[list[Output]](math.inf)
        collector.watch(asking)
        with trio.fail_after(RUN_TIMEOUT_S):
            async for batch in collector_outputs:
                if any(isinstance(o, ApprovalRequest) for o in batch):
                    break
            await collector.wait_idle()
            assert host.port(collector_id).parked  # R-HITL-3: it holds nothing
            await trio.testing.wait_all_tasks_blocked()  # what follows its parking, done
            children = host.port(payer_id).children
            assert children is not None and list(children.live) == [collector_id]
            await host.answer_approval(collector_id, "c2", "allow")
            seen = await _until_task_end(inbox)
        payer_lines = trace_lines(await host.load_session(payer_id))
    assert paid == [3]
    assert _reports(seen) == ["[subagent payer finished] merged: collected 3"]
    assert _task_of(payer_lines) == ["task_start", "report", "task_end"]
    assert payer_lines[-1]["status"] == "completed", payer_lines[-1]


async def test_a_tree_interrupt_of_a_subagent_taken_up_ends_its_running_child(
    data_dir: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2: after the same crash, the next host takes the tree up and the collector,
    going on, holds a new call. The payer interrupted with scope tree ends it too: its task
    ends aborted, and its answer goes to nobody (no follow-up task of the payer). Before,
    the taken-up payer knew no running child: the collector held on."""
    crash_dir = tmp_path / "crashed"
    root_id, payer_id, collector_id = await _crash_while_the_payer_waits(
        data_dir, crash_dir, workspace
    )
    model = _after_the_crash(Reply(blocks=(tool_call("h2", "hold", key="again"),)))
    monkeypatch.setattr(scripted_brain, "demo_brain", model)
    tools, holding = _tools_after_the_crash([])
    async with Host.open(crash_dir, tools=tools) as host:
        await host.load_session(root_id, provider=ScriptedProvider(model))
        await host.resume_tasks(approve=lambda call: "allow")
        collector = host.get_session(collector_id)
        send, collector_outputs = trio.open_memory_channel[list[Output]](math.inf)
        collector.watch(send)
        with trio.fail_after(RUN_TIMEOUT_S):
            await holding.wait()
            assert host.get_session(payer_id).interrupt("enough", scope="tree")
            seen = await _until_task_end(collector_outputs)
            await trio.testing.wait_all_tasks_blocked()  # its report, dropped, is gone
        # Told to the payer, the report would have made it busy with a follow-up task.
        open_now = {session.id: session for session in host.sessions}
        assert payer_id not in open_now or not open_now[payer_id].busy
        payer_lines = trace_lines(await host.load_session(payer_id))
    (end,) = [o for o in seen if isinstance(o, TaskEnd) and o.origin is None]
    assert end.status == "aborted", end
    assert _task_of(payer_lines) == ["task_start", "task_end"]
    last = payer_lines[-1]
    assert last["type"] == "task_end" and last["status"] == "aborted", last


def _summer_model(request: ModelRequest) -> Reply:
    """The root spawns the summer in the background and merges its answer; the summer
    waits for the test (``wait``), then answers ``the sum is 10``."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if _results(request):
            return Reply(blocks=(text("the sum is 10"),))
        return Reply(blocks=(tool_call("w1", "wait", key="adding"),))
    last = request.messages[-1]
    if isinstance(last, UserMessage) and "[subagent summer finished]" in str(last.content):
        return Reply(blocks=(text("merged: the sum is 10"),))
    if _results(request):
        return Reply(blocks=(text("the summer works on it"),))
    spawn = {"task": "add 3 and 7", "background": True, "name": "summer"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))


async def test_a_background_child_whose_end_was_lost_reports_the_answer_it_gave(
    data_dir: Path,
    workspace: Path,
    tmp_path: Path,
    gates: Gates,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R-TREE-4, R-TREE-2: the host dies after the summer's last model message (its
    answer) was written and before its ``task_end`` was: the root's files as they were
    while the summer ran, the summer's trace without its end. Taken up, the summer's task
    ends without asking the model again, and the root gets the answer it gave before the
    crash (before, the report said it finished without a text answer)."""
    crash_dir = tmp_path / "crashed"
    model = ScriptedProvider(_summer_model)
    tools = [gates.tool(), spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(provider=model, tools=tools, workspace_dir=workspace)
        await root.run("add through a subagent", approve=lambda call: "allow").collect()
        await gates.started("adding")
        (summer,) = await root.children()
        await port_of(root).sync_trace()
        copy_session(root, crash_dir)  # no report yet: it comes after the summer's end
        send, summer_outputs = trio.open_memory_channel[list[Output]](math.inf)
        summer.watch(send)
        gates.release("adding")
        with trio.fail_after(RUN_TIMEOUT_S):
            await _until_task_end(summer_outputs)
        await host.trace_store.log.sync()  # the summer, ended, may have left the host
        trace = copy_session(summer, crash_dir)
    lines = trace.read_text(encoding="utf-8").splitlines(keepends=True)
    (end,) = [i for i, line in enumerate(lines) if json.loads(line)["type"] == "task_end"]
    assert json.loads(lines[end - 1])["type"] == "request_end"
    trace.write_text("".join(lines[:end]), encoding="utf-8")  # what the crash left
    asked: list[ModelRequest] = []

    def model_after(request: ModelRequest) -> Reply:
        asked.append(request)
        return _summer_model(request)

    # The host loads the summer with the provider its session.json names.
    monkeypatch.setattr(scripted_brain, "demo_brain", model_after)
    async with Host.open(crash_dir, tools=tools) as host:
        root = await host.load_session(root.id, provider=ScriptedProvider(model_after))
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        assert await host.resume_tasks(approve=lambda call: "allow") == [summer.id]
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
        summer_lines = trace_lines(await host.load_session(summer.id))
    assert _reports(seen) == ["[subagent summer finished] the sum is 10"]
    assert summer_lines[-1]["type"] == "task_end" and summer_lines[-1]["status"] == "completed"
    # One request, the root's merge: the summer asked nothing again.
    assert [(r.system or "").startswith(SUBAGENT_SYSTEM) for r in asked] == [False]


async def _until_ended(
    inbox: trio.MemoryReceiveChannel[list[Output]], *origins: tuple[str, ...]
) -> list[Output]:
    """The root's outputs until the task of each node of ``origins`` has ended."""
    seen: list[Output] = []
    waiting = set(origins)
    async for batch in inbox:
        seen.extend(batch)
        waiting -= {o.origin for o in batch if isinstance(o, TaskEnd) and o.origin is not None}
        if not waiting:
            return seen
    raise AssertionError("the root closed before its subtree ended")


def _ended_aborted(lines: list[dict[str, Any]]) -> bool:
    last = lines[-1]
    return last["type"] == "task_end" and last["status"] == "aborted"


@pytest.mark.parametrize("child", ["loaded", "stored"])
async def test_a_tree_interrupt_after_a_restart_ends_a_parked_background_child(
    data_dir: Path, workspace: Path, child: str
) -> None:
    """R-TREE-2, R-HITL-3, R-ABORT-1: the host closes while the root's background payer
    waits for a person. On the next host the root, loaded (the payer loaded too, or left
    in its trace), is interrupted with scope tree: the payer's task ends aborted, its
    request is pending no more (answering it is refused, nothing is paid), and its end
    starts no follow-up of the root — as the same interrupt does before a restart.
    Before, the interrupt reached no child the root had not spawned on this host: the
    payer stayed pending, and a person's answer later ran the call."""
    paid, model, tools, root_id, child_id = await _payer_parked_on_a_closed_host(
        data_dir, workspace, _payer_model
    )
    async with open_host(data_dir) as host:
        root = await host.load_session(root_id, provider=model, tools=tools)
        if child == "loaded":
            await host.load_session(child_id, provider=model, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        hit = root.interrupt("enough", scope="tree")
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_ended(inbox, (root_id, child_id))
            await trio.testing.wait_all_tasks_blocked()  # its report, dropped, is gone
        assert hit == (child == "loaded")  # a stored child is read first: ended later
        assert not root.busy
        assert await host.pending_approvals() == []
        with pytest.raises(NotPending):
            await host.answer_approval(child_id, "p1", "allow")
    async with open_host(data_dir) as host:
        assert await host.pending_approvals() == []
        root_lines = trace_lines(await host.load_session(root_id))
        child_lines = trace_lines(await host.load_session(child_id))
    assert paid == []
    (end,) = [o for o in seen if isinstance(o, TaskEnd) and o.origin is not None]
    assert end.status == "aborted" and "enough" in (end.message or ""), end
    assert _reports(seen) == []
    assert [line["type"] for line in root_lines].count("task_start") == 1  # no follow-up
    assert _ended_aborted(child_lines), child_lines[-1]
    (pay,) = [line for line in child_lines if line.get("call_id") == "p1"
              and line["type"] == "tool_call_output"]
    assert pay["status"] == "interrupted", pay


async def test_the_gateways_tree_interrupt_answers_once_a_stored_nodes_end_is_written(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-2, R-ABORT-1, R-TRACE-2: the same restart, the payer left in its trace; the
    root's ``scope: "tree"`` interrupt through the gateway answers ``interrupted: true``
    once the payer's end, aborted, is in its trace file, and nothing is paid. Before, the
    answer came at once, ``interrupted: false``: the payer was still open in its trace,
    and a host lost then left it to be taken up."""
    paid, model, tools, root_id, child_id = await _payer_parked_on_a_closed_host(
        data_dir, workspace, _payer_model
    )
    defaults = SessionDefaults(
        provider_factory=lambda: model, tools=tools, workspace_dir=workspace, approve="ask"
    )
    async with open_host(data_dir) as host, trio.open_nursery() as nursery:
        gateway = Gateway(host, tokens={"alice": ALICE}, port=0, defaults=defaults)
        await nursery.start(gateway.run)
        gateway.grant("alice", root_id)
        with trio.fail_after(RUN_TIMEOUT_S):
            async with connect(gateway, token=ALICE) as alice:
                answer = await alice.result("interrupt", {"session_id": root_id, "scope": "tree"})
        child_trace = sorted((data_dir / "sessions" / child_id).glob("trace_*.jsonl"))[-1]
        child_lines = [json.loads(line) for line in child_trace.read_text().splitlines()]
        nursery.cancel_scope.cancel()
    assert _ended_aborted(child_lines), child_lines[-1]
    assert answer == {"interrupted": True}
    assert paid == []


async def test_a_node_interrupt_after_a_restart_leaves_a_parked_background_child_pending(
    data_dir: Path, workspace: Path
) -> None:
    """R-TREE-2: the same restart, and the root interrupted with scope node: its
    background payer is left waiting for its person, as before a restart; answered, it
    pays once and its answer reaches the root."""
    paid, model, tools, root_id, child_id = await _payer_parked_on_a_closed_host(
        data_dir, workspace, _payer_model
    )
    async with open_host(data_dir) as host:
        root = await host.load_session(root_id, provider=model, tools=tools)
        assert not root.interrupt("only the root", scope="node")
        await trio.testing.wait_all_tasks_blocked()
        _, seen = await _answer_the_parked_child(host, model, tools, root_id, child_id)
    assert paid == [7]
    assert _reports(seen) == ["[subagent payer finished] paid 7"]


class TaskEnds:
    """Subscribed to every session a host opens: an event per session id, set when its
    task ends there."""

    def __init__(self) -> None:
        self.ended: dict[str, trio.Event] = {}

    def of(self, session_id: str) -> trio.Event:
        return self.ended.setdefault(session_id, trio.Event())

    def __call__(self, session: Session) -> None:
        def listen(batch: list[Output]) -> None:
            if any(isinstance(o, TaskEnd) and o.origin is None for o in batch):
                self.of(session.id).set()

        session.subscribe(listen)


@pytest.mark.parametrize("payer", ["loaded", "stored"])
async def test_a_tree_interrupt_after_a_restart_ends_parked_nodes_at_every_depth(
    data_dir: Path, workspace: Path, payer: str
) -> None:
    """R-TREE-2, R-HITL-4: the payer and its background collector both wait for a person
    and the host restarts. The root, loaded (the payer too, or not; the collector left
    in its trace), is interrupted with scope tree: both tasks end aborted, nobody is asked
    any more, nothing is paid and no answer reaches the payer or the root. Before, both
    stayed pending."""
    paid: list[int] = []
    model = ScriptedProvider(_collecting_payer_model)
    tools = [_pay_tool(paid), spawn_subagent]
    async with open_host(data_dir) as host:
        root_id, payer_id, collector_id = await _collector_then_park(host, model, tools, workspace)
    ends = TaskEnds()
    async with Host.open(data_dir, tools=tools, observers=[ends]) as host:
        root = await host.load_session(root_id, provider=model)
        if payer == "loaded":
            await host.load_session(payer_id, provider=model)
        root.interrupt("enough", scope="tree")
        with trio.fail_after(RUN_TIMEOUT_S):
            await ends.of(payer_id).wait()
            await ends.of(collector_id).wait()
            await trio.testing.wait_all_tasks_blocked()
        assert not root.busy and not ends.of(root_id).is_set()  # no follow-up
        assert await host.pending_approvals() == []
    async with open_host(data_dir) as host:
        assert await host.pending_approvals() == []
        root_lines = trace_lines(await host.load_session(root_id))
        payer_lines = trace_lines(await host.load_session(payer_id))
        collector_lines = trace_lines(await host.load_session(collector_id))
    assert paid == []
    assert [line["type"] for line in root_lines].count("task_start") == 1
    assert _task_of(payer_lines) == ["task_start", "task_end"]
    assert _ended_aborted(payer_lines) and _ended_aborted(collector_lines)


def _recording(model: Callable[[ModelRequest], Reply], asked: list[ModelRequest]) -> Callable[
    [ModelRequest], Reply
]:
    def recorded(request: ModelRequest) -> Reply:
        asked.append(request)
        return model(request)

    return recorded


def _call_output(lines: list[dict[str, Any]], call_id: str) -> dict[str, Any]:
    (output,) = [
        line for line in lines
        if line["type"] == "tool_call_output" and line.get("call_id") == call_id
    ]
    return output


class _Crashed(NamedTuple):
    """A tree whose host was killed mid ``pay``, and what the next host runs it with."""

    root_id: str
    asked: list[ModelRequest]  # every request of ``model``
    model: Callable[[ModelRequest], Reply]  # the demo brain: :func:`_after_takeup`
    paid: list[int]  # every amount ``tools`` pay
    tools: list[object]
    ends: TaskEnds


async def _crashed_mid_pay(
    data_dir: Path,
    workspace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    background: bool,
) -> _Crashed:
    """Kill the crashing host while the root's payer (``background`` or foreground) runs
    its ``pay`` call, and make ready the model, the tools and the task ends of the next."""
    root_id = await _crash_mid_child_call(data_dir, workspace, tmp_path, background=background)
    asked: list[ModelRequest] = []
    model = _recording(_after_takeup, asked)
    monkeypatch.setattr(scripted_brain, "demo_brain", model)
    paid: list[int] = []
    return _Crashed(root_id, asked, model, paid, [_pay_tool(paid), spawn_subagent], TaskEnds())


async def test_a_tree_interrupt_after_a_crash_ends_a_background_child_left_running(
    data_dir: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-ABORT-1, R-HITL-4: the host is killed while the root's background
    payer runs its pay call. On the next host the root, loaded alone, is interrupted with
    scope tree: the payer's task, left running in its trace, ends aborted there, its call
    settled interrupted, with no model request and nothing paid, and its answer reaches
    nobody; a host opened after finds no task to take up. Before, the interrupt ended
    nothing: the next ``resume_tasks`` took the payer up, ran it to its end and its
    answer reached the root as a follow-up."""
    crashed = await _crashed_mid_pay(data_dir, workspace, tmp_path, monkeypatch, background=True)
    root_id, asked, model, paid, tools, ends = crashed
    async with Host.open(data_dir, tools=tools, observers=[ends]) as host:
        root = await host.load_session(root_id, provider=ScriptedProvider(model))
        child_id = await _child_of(host, root_id)
        root.interrupt("enough", scope="tree")
        with trio.fail_after(RUN_TIMEOUT_S):
            await ends.of(child_id).wait()
            await trio.testing.wait_all_tasks_blocked()  # its report, dropped, is gone
        assert not root.busy and not ends.of(root_id).is_set()  # no follow-up
    async with Host.open(data_dir, tools=tools, observers=[ends]) as host:
        assert await host.resume_tasks(approve=allow_all) == []
        root_lines = trace_lines(await host.load_session(root_id))
        child_lines = trace_lines(await host.load_session(child_id))
    assert asked == [] and paid == [] and (tmp_path / "marks").read_text() == "7\n"
    assert [line["type"] for line in root_lines].count("task_start") == 1
    assert _task_of(child_lines) == ["task_start", "task_end"]
    assert _ended_aborted(child_lines) and "enough" in child_lines[-1]["message"]
    assert _call_output(child_lines, "p1")["status"] == "interrupted"


async def test_a_tree_interrupt_after_a_crash_ends_running_nodes_at_every_depth(
    data_dir: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-ABORT-1, R-HITL-4: the host is killed while the payer's task waits for
    its background collector, whose call runs. On the next host the root, loaded alone,
    is interrupted with scope tree: both tasks, left running in their traces, end aborted
    there, the collector's call settled interrupted, with no model request and no answer
    reaching the payer or the root; a host opened after takes nothing up. Before, both
    stayed open, and ``resume_tasks`` ran them to their ends."""
    crash_dir = tmp_path / "crashed"
    root_id, payer_id, collector_id = await _crash_while_the_payer_waits(
        data_dir, crash_dir, workspace
    )
    asked: list[ModelRequest] = []
    model = _recording(_after_the_crash(Reply(blocks=(text("collected 3"),))), asked)
    monkeypatch.setattr(scripted_brain, "demo_brain", model)
    tools, _ = _tools_after_the_crash([])
    ends = TaskEnds()
    async with Host.open(crash_dir, tools=tools, observers=[ends]) as host:
        root = await host.load_session(root_id, provider=ScriptedProvider(model))
        root.interrupt("enough", scope="tree")
        with trio.fail_after(RUN_TIMEOUT_S):
            await ends.of(payer_id).wait()
            await ends.of(collector_id).wait()
            await trio.testing.wait_all_tasks_blocked()
        assert not root.busy and not ends.of(root_id).is_set()
    async with Host.open(crash_dir, tools=tools) as host:
        assert await host.resume_tasks(approve=allow_all) == []
        root_lines = trace_lines(await host.load_session(root_id))
        payer_lines = trace_lines(await host.load_session(payer_id))
        collector_lines = trace_lines(await host.load_session(collector_id))
    assert asked == []
    assert [line["type"] for line in root_lines].count("task_start") == 1
    assert _task_of(payer_lines) == ["task_start", "task_end"]
    assert _task_of(collector_lines) == ["task_start", "task_end"]
    assert _ended_aborted(payer_lines) and _ended_aborted(collector_lines)
    assert _call_output(collector_lines, "h1")["status"] == "interrupted"
