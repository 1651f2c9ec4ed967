"""A tree a lost host ran, taken over (R-TREE-2, R-TREE-4, R-CLUSTER-2): in-process hosts on
a real nats-server, as in :mod:`tests.test_cluster_tree_nodes` (whose cluster, waits and
tree these tests share).

* A tree taken over by one host behaves as a tree there: the root's ``scope="tree"``
  interrupt ends the background subagents taken over with it, and their answers go to
  nobody.
* A subagent's background child, lost with its host while the subagent runs on another,
  is taken over by the subagent's host — not by the least loaded one — and its answer
  comes into the subagent's open task.

Every host's tools hold a ``hold`` call until the test lets it go (:class:`Holds`), so a
taken-over subagent runs on its new host for as long as the test needs it to. Takeovers
are the test's (a lease TTL so long that no orphan scan runs by itself): by hand, or one
look of each live host's orphan scan.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from conftest import allow_all

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.outputs import ModelMsg, TaskEnd, UserMsg
from greenroom.protocols.tools import Tool, make_tool
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
)
from tests.test_cluster_tree_nodes import (
    FINISHED,
    TOOLS,
    Cluster,
    Member,
    _lose,
    _merged_report,
    _task_ended,
    _tasks_of,
    _traced_through,
    _until_the_payer_waits,
    in_cluster,
    until,
)

COLLECTOR_FINISHED = "[subagent collector finished]"


class Holds:
    """A ``hold`` tool shared by every host of a test: its call of ``key`` sets
    ``started[key]`` and returns ``3`` once the test sets ``gates[key]``. A call in doubt
    (its host lost) is found over by its check, not run again nor asked about."""

    def __init__(self) -> None:
        self.started: defaultdict[str, trio.Event] = defaultdict(trio.Event)
        self.gates: defaultdict[str, trio.Event] = defaultdict(trio.Event)

    def tool(self) -> Tool:
        """The ``hold`` tool."""

        async def hold(key: str) -> str:
            """Hold until the test lets the call go."""
            self.started[key].set()
            await self.gates[key].wait()
            return "3"

        async def lost(idempotency_key: str) -> str:
            # A call its host was lost in is over: the task taken over goes on at once.
            return "lost with its host"

        return make_tool(hold, parallel=True, check=lost)


def _brain_holding(pays: int, collects: int, counts: int = 0) -> Callable[[ModelRequest], Reply]:
    """The tree of :func:`~tests.test_cluster_tree_nodes._waiting_brain` — the root spawns
    the payer in the background, the payer the collector — whose payer first holds
    ``pays`` calls (``pay-1``, ``pay-2``, …) before it says that it waits for the
    collector, and whose collector holds ``collects`` calls (``collect-1``, …) before it
    answers ``collected 3``. With ``counts``, the collector first spawns the counter in
    the background, which holds ``counts`` calls (``count-1``, …) before it answers, and
    the collector answers once the counter's answer has come. A call its host was lost in
    has its result all the same (:class:`Holds`), so a taken-over node holds its next
    call, under the next key, on its new host."""

    def brain(request: ModelRequest) -> Reply:
        said = [str(m.content) for m in request.messages if isinstance(m, UserMessage)]
        results = sum(
            isinstance(b, ToolResult)
            for m in request.messages
            if isinstance(m, UserMessage)
            for b in m.content
        )
        if not (request.system or "").startswith(SUBAGENT_SYSTEM):
            if FINISHED in said[-1]:
                return Reply(blocks=(text("merged: the payer is done"),))
            if results:
                return Reply(blocks=(text("the payer works on it"),))
            spawn = {"task": "pay 3", "background": True, "name": "payer"}
            return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))
        if "count 3" in said[0]:
            return _node(said, results, ("count", counts), None, "counted 3")
        if "collect 3" in said[0]:
            counter = ("counter", "count 3") if counts else None
            return _node(said, results, ("collect", collects), counter, "collected 3")
        collector = ("collector", "collect 3")
        return _node(said, results, ("pay", pays), collector, "merged: collected 3")

    return brain


def _node(
    said: list[str],
    results: int,
    holds: tuple[str, int],
    child: tuple[str, str] | None,
    answer: str,
) -> Reply:
    """One subagent of :func:`_brain_holding`: it spawns ``child`` (its name, its task) in
    the background first, when it has one; it holds ``holds`` calls (their key's prefix,
    how many: ``pay-1``, ``pay-2``…); then it says that it waits for its child, or gives
    ``answer`` when it has none; it gives ``answer`` once its child's answer came."""
    key, count = holds
    spawned = 0
    if child is not None:
        name, task = child
        if any(f"[subagent {name} finished]" in s for s in said):
            return Reply(blocks=(text(answer),))
        if results == 0:
            spawn = {"task": task, "background": True, "name": name}
            return Reply(blocks=(ToolCallBlock(id=name, name="spawn_subagent", arguments=spawn),))
        spawned = 1
    held = results - spawned
    if held < count:
        return Reply(blocks=(tool_call(f"{key}{held}", "hold", key=f"{key}-{held + 1}"),))
    if child is not None:
        return Reply(blocks=(text(f"waiting for the {child[0]}"),))
    return Reply(blocks=(text(answer),))


async def _scan_once(*members: Member) -> dict[str, list[str]]:
    """Each of ``members`` looks for orphans once, all at once, and takes its share over:
    what each took (the hosts that took nothing are left out)."""
    taken: dict[str, list[str]] = {}

    async def take(member: Member, share: dict[str, dict[str, Any]]) -> None:
        taken[member.host_id] = await member.node._take_entries(share)

    async with trio.open_nursery() as nursery:
        for member in members:
            node = member.node
            assert node._finder is not None and node._registry is not None
            scan = (node._registry, member.host_id, functools.partial(take, member))
            nursery.start_soon(node._finder.take_share, *scan, lambda: False)
    return taken


def _holding(brain: Callable[[ModelRequest], Reply], holds: Holds) -> dict[str, Any]:
    """The hosts of :func:`in_cluster` whose sessions think with ``brain`` and hold
    ``holds``' calls, which the hosts allow in the tasks they take over."""
    return {"brain": brain, "tools": (*TOOLS, holds.tool()), "approve": allow_all}


async def _lost_with_the_counter(
    cluster: Cluster, holds: Holds, brain: Callable[[ModelRequest], Reply], tmp_path: Path
) -> tuple[tuple[str, str, str, str], dict[str, dict[str, Any]]]:
    """Host a runs ``brain``'s tree until the payer waits for its background collector,
    and the payer, the collector and the collector's background counter each hold their
    first call; then a is lost. The tree (root, payer, collector, counter) and each
    node's entry as a left it."""
    a = cluster.members["a"]
    held = (holds.tool(), holds.started["collect-1"])
    root, payer, collector = await _until_the_payer_waits(a, tmp_path, held, brain)
    (counter,) = [s.id for s in await a.host.get_session(collector).children()]
    tree = (root, payer, collector, counter)
    await holds.started["pay-1"].wait()
    await holds.started["count-1"].wait()
    await _lose(cluster, a, *tree)
    return tree, {sid: await cluster.entry(sid) or {} for sid in tree}


def _ends(records: list[Any]) -> list[str]:
    return [r.status for r in records if isinstance(r, TaskEnd)]


def test_a_tree_interrupt_on_the_host_that_took_the_tree_over_ends_its_subagents(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-CLUSTER-2: a runs the tree (the root idle, the payer's task
    answered and waiting for its background collector, whose call runs) and is lost; b
    and c each take their share: one takes the whole tree, and the collector holds a call
    there. The root's ``scope="tree"`` interrupt on that host (the root idle) ends the
    payer's task and the collector's, whose call it cuts short; neither answer reaches
    anyone: both subagents leave the host, and the root takes no report and starts no
    task. Had the root not counted the taken-over payer as its running child, the
    interrupt would have found nothing to end."""
    holds = Holds()

    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b, c = (cluster.members[h] for h in ("a", "b", "c"))
        held = (holds.tool(), holds.started["collect-1"])
        tree = await _until_the_payer_waits(a, tmp_path, held, brain, root_id="zzzz-root")
        root, payer, collector = tree
        await _lose(cluster, a, *tree)
        taken = await _scan_once(b, c)
        if len(taken) != 1:
            return {"taken": taken}
        ((host_id, served),) = taken.items()
        member = cluster.members[host_id]
        await holds.started["collect-2"].wait()  # the collector runs on its new host
        found: dict[str, Any] = {"taken": taken, "served": served}
        found["interrupted"] = member.host.get_session(root).interrupt(
            "stop the tree", scope="tree"
        )
        if not found["interrupted"]:
            return found  # the root knew no subagent running here
        for session_id in (collector, payer):
            await until(lambda: _task_ended(cluster, session_id))  # noqa: B023
            # Its answer, had it one to give, is on its way before it leaves the host.
            await until(lambda: cluster.released(session_id))  # noqa: B023
        await member.host.get_session(root).wait_idle()
        last = member.host.port(root).last_seq
        await until(lambda: _traced_through(cluster, root, last))
        records = {sid: list((await cluster.traces.read(sid)).records) for sid in tree}
        found["ends"] = {sid: _ends(records[sid]) for sid in tree}
        found["root_reports"] = [
            r for r in records[root] if isinstance(r, UserMsg) and FINISHED in str(r.content)
        ]
        return found

    brain = _brain_holding(pays=0, collects=2)
    found = in_cluster(nats_server, tmp_path, ("a", "b", "c"), body, **_holding(brain, holds))
    assert len(found["taken"]) == 1, found["taken"]
    assert found["interrupted"] is True
    assert sorted(found["served"]) == sorted(found["ends"])
    root_ends, payer_ends, collector_ends = found["ends"].values()
    assert root_ends == ["completed"]  # its own task only: no follow-up for a report
    assert payer_ends == ["aborted"], payer_ends
    assert collector_ends == ["aborted"], collector_ends
    assert found["root_reports"] == []


def test_a_subagents_background_child_lost_with_its_host_is_taken_over_by_the_subagents(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-CLUSTER-2: a runs the tree (root, payer, collector, the
    collector's background counter) and is lost; d takes the root and the payer over, c
    the collector and the counter (the test's choice, as the split a takeover one by one
    made). The payer holds a call on d, the collector and the counter one each on c; c is
    lost. Of the live hosts b (idle, its id first) and d (it runs the root and the payer),
    each looking once for orphans, d takes the collector and the counter: the payer's
    host, not the least loaded one. Let go in turn, the payer answers and waits for the
    collector taken over beside it, the collector for the counter; the counter's answer
    comes into the collector's open task, the collector's into the payer's, each as
    steering; the payer's merged answer reaches the root once. Spread by load, both went
    to b: the payer's task, let go, ended without the collector's answer (which could
    come only as a second task)."""
    holds = Holds()

    async def body(cluster: Cluster) -> dict[str, Any]:
        b, c, d = (cluster.members[h] for h in ("b", "c", "d"))
        tree, entries = await _lost_with_the_counter(cluster, holds, brain, tmp_path)
        root, payer, collector, counter = tree
        assert await d.node._take_entries({sid: entries[sid] for sid in (root, payer)})
        assert await c.node._take_entries({sid: entries[sid] for sid in (collector, counter)})
        for key in ("pay-2", "collect-2", "count-2"):
            await holds.started[key].wait()

        async def payer_on_d() -> bool:
            return (await cluster.entry(payer) or {}).get("host") == "d"

        await until(payer_on_d)
        await _lose(cluster, c, collector, counter)
        found: dict[str, Any] = {"taken": await _scan_once(b, d), "tree": tree}
        if not found["taken"]:
            return found
        await holds.started["collect-3"].wait()
        await holds.started["count-3"].wait()
        # Let go one by one, each waits for its child: the parent first.
        for key, session_id in (("pay-2", payer), ("collect-3", collector)):
            holds.gates[key].set()
            await until(lambda: _waits(cluster, session_id))  # noqa: B023
        holds.gates["count-3"].set()
        for session_id in (counter, collector, payer):
            await until(lambda: _task_ended(cluster, session_id))  # noqa: B023
        found["tasks"] = [
            _tasks_of(list((await cluster.traces.read(sid)).records)) for sid in (payer, collector)
        ]
        if found["tasks"] != [["task_start", "report", "task_end"]] * 2:
            return found
        await until(lambda: _merged_report(cluster, root))
        root_records = (await cluster.traces.read(root)).records
        said = [str(r.content) for r in root_records if isinstance(r, UserMsg)]
        found["root_reports"] = [s for s in said if FINISHED in s]
        return found

    brain = _brain_holding(pays=2, collects=3, counts=3)
    hosts = ("a", "b", "c", "d")
    found = in_cluster(nats_server, tmp_path, hosts, body, **_holding(brain, holds))
    collector, counter = found["tree"][2:]
    assert {h: sorted(ids) for h, ids in found["taken"].items()} == {
        "d": sorted([collector, counter])
    }
    # The payer's task and the collector's each took its child's answer.
    assert found["tasks"] == [["task_start", "report", "task_end"]] * 2, found["tasks"]
    reports = found["root_reports"]
    assert len(reports) == 1 and "merged: collected 3" in reports[0], reports


async def _waits(cluster: Cluster, session_id: str) -> bool:
    """Whether ``session_id`` has said (JetStream holds it) that it waits for its child,
    or its task has ended."""
    records = (await cluster.traces.read(session_id)).records
    said = [r.block for r in records if isinstance(r, ModelMsg)]
    waits = any(isinstance(b, TextBlock) and "waiting for" in b.text for b in said)
    return waits or await _task_ended(cluster, session_id)
