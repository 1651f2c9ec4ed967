"""A drain (R-DRAIN-1) waits for work that a person's answer starts while it drains: the
call a parked task runs once answered — a payment in doubt a person says to run again
(R-EFFECT-2), a call a person allows — finishes and is recorded before the host stops,
and its task is held at its next turn boundary for the next start (R-EFFECT-3: a planned
stop puts no call in doubt). Before, the drain waited only for the sessions that had work
when it began, and returned while such a call ran: the stop that follows cut it off.

And a tree comes to rest on a host alone: the background child of a subagent, whose task
waits for its answer (R-TREE-2), runs on instead of being held.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, allow_all, open_host, trace_lines
from test_drain import SlowTool
from test_effects import PAY, crash_mid_call, of, take_up
from test_subagents import has_results, is_child, task_of

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, spawn_subagent
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool, ToolContext, make_tool


class HeldPayment:
    """``pay`` that pays once per key and then waits until the test lets it answer."""

    def __init__(self) -> None:
        self.paying = trio.Event()
        self.release = trio.Event()
        self.runs: list[str] = []

        async def pay(amount: int, ctx: ToolContext) -> str:
            """Pay an amount."""
            self.runs.append(ctx.idempotency_key)
            self.paying.set()
            await self.release.wait()
            return f"paid {amount}"

        self.tool: Tool = make_tool(pay, parallel=False)


async def _busy(host: Host, workspace: Path, slow: SlowTool) -> str:
    """A session whose call runs ``slow`` (started, not released): the drain waits for it."""
    provider = ScriptedProvider([Reply(blocks=(text("Working."), tool_call("c1", "slow", x=1)))])
    session = await host.create_session(provider=provider, tools=[slow.tool],
                                        workspace_dir=workspace)  # fmt: skip
    session.run("work on 1", approve=allow_all)
    with trio.fail_after(RUN_TIMEOUT_S):
        await slow.started.wait()
    return session.id


async def _drain_meanwhile(
    host: Host, busy: str, slow: SlowTool, payment: HeldPayment, answer: Any
) -> tuple[list[str], bool]:
    """Drain ``host``; meanwhile ``answer()`` a person's answer, which starts ``payment``;
    then let ``slow`` (session ``busy``'s call) finish. Returns the held sessions and
    whether the drain had returned while the payment still ran."""
    held: list[str] = []
    drained = trio.Event()

    async def drain() -> None:
        held.extend(await host.drain(grace_s=RUN_TIMEOUT_S))
        drained.set()

    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await trio.testing.wait_all_tasks_blocked()
            await answer()
            await payment.paying.wait()
            slow.release.set()
            await host.get_session(busy).wait_idle()
            await trio.testing.wait_all_tasks_blocked()
            returned_early = drained.is_set()
            payment.release.set()
    return held, returned_early


async def test_a_call_a_person_allows_while_the_host_drains_finishes_before_it_stops(
    data_dir: Path, workspace: Path
) -> None:
    """R-DRAIN-1, R-HITL-3: a task parked on a person's approval is woken by the answer
    during the drain; its payment runs, finishes and is recorded, and the task is held at
    its next boundary (before: the drain returned while the payment ran). The next start
    finishes the task without paying again."""
    slow, payment = SlowTool(), HeldPayment()
    provider = ScriptedProvider(PAY)
    async with open_host(data_dir) as host:
        busy = await _busy(host, workspace, slow)
        session = await host.create_session(provider=provider, tools=[payment.tool],
                                            workspace_dir=workspace)  # fmt: skip
        session.run("pay 7", approve=PEOPLE)
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        assert host.port(session.id).parked
        sid = session.id

        async def allow() -> None:
            await host.answer_approval(sid, "p1", "allow", "ana")

        held, returned_early = await _drain_meanwhile(host, busy, slow, payment, allow)
        assert not returned_early
        assert sorted(held) == sorted([busy, sid])
        lines = trace_lines(session)
    (result,) = of(lines, "tool_call_output")
    assert (result["status"], result["content"][0]["text"]) == ("ok", "paid 7")
    assert not of(lines, "task_end")  # held open for the next start

    again = ScriptedProvider([Reply(blocks=(text("Paid."),))])
    async with open_host(data_dir) as host:
        session = await host.resume(sid, provider=again, tools=[payment.tool])
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert len(payment.runs) == 1
    assert [end["status"] for end in of(lines, "task_end")] == ["completed"]


async def test_a_call_in_doubt_a_person_says_to_run_again_while_the_host_drains_finishes(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-DRAIN-1, R-EFFECT-2, R-EFFECT-3: the question about a payment in doubt waits in a
    session that is not even open when the drain begins; the answer "run again" loads it
    and runs the payment once more, with its key, during the drain. The drain waits for it:
    its result is recorded, ``ok``, and the task held (before: the drain had returned, and
    the host's stop cut the second run off as ``tool aborted by user``)."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)
    slow, payment = SlowTool(), HeldPayment()
    async with open_host(crashed) as second:
        await take_up(second, sid, providers([]), payment.tool, PEOPLE)
        assert second.port(sid).parked
        await second.close_session(sid)  # the question waits in the trace alone
        busy = await _busy(second, workspace, slow)

        async def run_again() -> None:
            await second.answer_question(sid, "p1", "run again", "ana", tools=[payment.tool])

        held, returned_early = await _drain_meanwhile(second, busy, slow, payment, run_again)
        assert not returned_early
        assert sorted(held) == sorted([busy, sid])
        lines = trace_lines(second.get_session(sid))
    assert payment.runs == [key]
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("person", "rerun")
    (result,) = of(lines, "tool_call_output")
    assert (result["status"], result["content"][0]["text"]) == ("ok", "paid 7")
    assert not of(lines, "task_end")


async def drain_releasing(host: Host, slow: SlowTool) -> list[str]:
    """Drain ``host`` with no bound on its grace and, once every task waits, let ``slow``
    finish: the sessions the drain held."""
    held: list[str] = []

    async def drain() -> None:
        held.extend(await host.drain(grace_s=math.inf))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        await trio.testing.wait_all_tasks_blocked()
        slow.release.set()
    return held


def _tree_brain(request: ModelRequest) -> Reply:
    """The root runs a subagent (``mid``) in the foreground; ``mid`` starts ``grand`` in
    the background and waits for its answer; ``grand`` calls ``slow``."""
    if is_child(request) and "grand" in task_of(request):
        if has_results(request):
            return Reply(blocks=(text("grand done"),))
        return Reply(blocks=(tool_call("g1", "slow", x=5),))
    if is_child(request):
        if "[subagent" in str(request.messages[-1]):
            return Reply(blocks=(text("mid done"),))
        if has_results(request):
            return Reply(blocks=(text("waiting for grand"),))
        return Reply(blocks=(tool_call("m1", SPAWN_SUBAGENT, task="grand", background=True),))
    if has_results(request):
        return Reply(blocks=(text("root done"),))
    return Reply(blocks=(tool_call("r1", SPAWN_SUBAGENT, task="mid"),))


async def test_a_subagents_background_child_runs_on_so_the_tree_comes_to_rest(
    data_dir: Path, workspace: Path
) -> None:
    """R-DRAIN-1, R-TREE-2: the drain begins while ``grand`` — the background child of a
    subagent, whose task waits for its answer — runs a call. ``grand`` runs on to its end
    (its parent waits for it), ``mid`` then ends, the root's call returns and the root is
    held at its boundary, well within the grace; the next start finishes the root with
    nothing run again. Before, ``grand`` was held: ``mid`` waited for it for the whole
    grace, and the stop then interrupted the root's call and ended every task aborted."""
    slow = SlowTool()
    provider = ScriptedProvider(_tree_brain)
    tools = [slow.tool, spawn_subagent]
    async with open_host(data_dir) as host:
        root = await host.create_session(provider=provider, tools=tools, workspace_dir=workspace)
        root.run("delegate", approve=allow_all)
        with trio.fail_after(RUN_TIMEOUT_S):
            await slow.started.wait()
            held = await drain_releasing(host, slow)
        assert held == [root.id]
        lines = trace_lines(root)
        (spawned,) = of(lines, "tool_call_output")
        assert spawned["status"] == "ok" and "mid done" in str(spawned["content"])
        assert not of(lines, "task_end")

    async with open_host(data_dir) as host:
        root = await host.resume(root.id, provider=provider, tools=tools)
        with trio.fail_after(RUN_TIMEOUT_S):
            await root.wait_idle()
        lines = trace_lines(root)
    assert slow.ran == [5]
    assert [end["status"] for end in of(lines, "task_end")] == ["completed"]
    ends = {
        path.parent.name: [json.loads(line)["status"] for line in path.read_text().splitlines()
                           if json.loads(line)["type"] == "task_end"]
        for path in (data_dir / "sessions").glob("*/trace_001.jsonl")
    }  # fmt: skip
    assert sorted(ends.values()) == [["completed"]] * 3
