"""A tree interrupt in a cluster reaches the nodes of the tree that no host runs (R-TREE-2,
R-TREE-4, R-ABORT-1, R-CLUSTER-2): in-process hosts on a real nats-server, as in
:mod:`tests.test_cluster_tree_nodes` (whose cluster, waits and tree these tests share).

* A background subagent whose host was lost, not taken over by any host, ends ``aborted``
  in its own trace when its root's ``scope="tree"`` interrupt is made on another host: its
  call in flight is neither checked nor run again, no model request is sent for it, and
  its answer reaches nobody. The gateway's answer comes once JetStream holds those ends.
  No host that takes the tree up later (after a loss of the interrupting host too) runs
  it on.
* So does one that waits for a person: its request is pending no more, and nothing is
  paid.

* A background subagent that another live host runs ends there, ``aborted`` in its trace,
  its held call interrupted, when its root's ``scope="tree"`` interrupt is made on the
  root's host: the gateway's answer comes once that host has written its end, and the
  root takes no report.

Takeovers are the test's (a lease TTL so long that no orphan scan runs by itself): by
hand, or one look of a live host's orphan scan.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import allow_all

from greenroom.actors.cluster.directory_entries import DirectoryEntries
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.cluster.router import TREE_END_METHOD
from greenroom.actors.cluster.routing import SessionRequests
from greenroom.actors.providers.scripted import Reply, ScriptedProvider
from greenroom.actors.runtime.subagents import spawn_subagent
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import TaskEnd, TaskStart, ToolCallOutput, UserMsg
from greenroom.protocols.tools import Tool, make_tool
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
)
from tests.test_cluster_tree_nodes import (
    FINISHED,
    TOOLS,
    Cluster,
    _lose,
    _traced_through,
    _until_the_payer_asks,
    _until_the_payer_waits,
    client,
    in_cluster,
    until,
)
from tests.test_cluster_tree_takeover import Holds, _brain_holding, _scan_once


class Watched:
    """A ``hold`` tool and a model shared by every host: each ``hold`` call sets
    ``started[key]`` and waits for ever; each check of a call in doubt is noted in
    ``checked``; once ``lost`` is set, every model request is noted in ``asked``."""

    def __init__(self, brain: Any) -> None:
        self.started: defaultdict[str, trio.Event] = defaultdict(trio.Event)
        self.checked: list[str] = []
        self.asked: list[ModelRequest] = []
        self.lost = False
        self._brain = brain

    def tool(self) -> Tool:
        """The ``hold`` tool."""

        async def hold(key: str) -> str:
            """Hold until cancelled."""
            self.started[key].set()
            await trio.sleep_forever()
            return "3"  # pragma: no cover

        async def check(idempotency_key: str) -> str:
            self.checked.append(idempotency_key)
            return "lost with its host"

        return make_tool(hold, parallel=True, check=check)

    def brain(self, request: ModelRequest) -> Reply:
        """The tree's model (:func:`~tests.test_cluster_tree_takeover._brain_holding`)."""
        if self.lost:
            self.asked.append(request)
        reply: Reply = self._brain(request)
        return reply


def _ends(records: Any) -> list[str]:
    return [r.status for r in records if isinstance(r, TaskEnd)]


def _starts(records: Any) -> int:
    return sum(isinstance(r, TaskStart) for r in records)


def test_a_tree_interrupt_ends_the_subagents_no_host_runs_and_none_runs_them_later(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-ABORT-1, R-CLUSTER-2: a runs the tree (the root idle, the
    payer's task answered and waiting for its background collector, whose ``hold`` call
    runs) and is lost. b takes the root over, alone: the payer and the collector are in
    JetStream, run by no host. The root's ``scope="tree"`` interrupt through b's gateway
    answers ``interrupted`` once JetStream holds the payer's and the collector's ends,
    ``aborted``: the collector's call is not checked, no model request is sent, the root
    takes no report. Then b is lost too and c takes every orphan over: nothing of the
    tree runs again. Before, the interrupt found nothing to end (``interrupted`` false),
    their traces left their tasks open, and the next host to take them over ran them on."""
    watched = Watched(_brain_holding(pays=0, collects=2))

    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b, c = (cluster.members[h] for h in ("a", "b", "c"))
        held = (watched.tool(), watched.started["collect-1"])
        tree = await _until_the_payer_waits(a, tmp_path, held, watched.brain)
        root, payer, collector = tree
        await _lose(cluster, a, *tree)
        watched.lost = True
        assert await b.node._take_entry(root, await cluster.entry(root) or {})
        b.gateway.grant("alice", root)
        async with client(b, "alice") as alice:
            answer = await alice.result("interrupt", {"session_id": root, "scope": "tree"})
        found: dict[str, Any] = {"answer": answer}
        records = {sid: (await cluster.traces.read(sid)).records for sid in tree}
        found["ends"] = {sid: _ends(records[sid]) for sid in tree}
        found["tree"] = tree
        if found["ends"] != {root: ["completed"], payer: ["aborted"], collector: ["aborted"]}:
            return found  # taken up, they would run on
        await _lose(cluster, b, root)
        found["taken"] = await _scan_once(c)
        for session_id in found["taken"].get("c", []):
            await c.host.get_session(session_id).wait_idle()
        records = {sid: (await cluster.traces.read(sid)).records for sid in tree}
        found["later_ends"] = {sid: _ends(records[sid]) for sid in tree}
        found["starts"] = {sid: _starts(records[sid]) for sid in tree}
        found["root_reports"] = [
            r for r in records[root] if isinstance(r, UserMsg) and FINISHED in str(r.content)
        ]
        return found

    tools = (*TOOLS, watched.tool())
    hosts = ("a", "b", "c")
    found = in_cluster(
        nats_server, tmp_path, hosts, body, brain=watched.brain, tools=tools, approve=allow_all
    )
    root, payer, collector = found["tree"]
    assert found["ends"] == {root: ["completed"], payer: ["aborted"], collector: ["aborted"]}
    assert found["answer"] == {"interrupted": True}
    assert found["later_ends"] == found["ends"]
    assert found["starts"] == {root: 1, payer: 1, collector: 1}
    assert root in found["taken"].get("c", [])
    assert not watched.started["collect-2"].is_set()
    assert watched.checked == []
    assert watched.asked == []
    assert found["root_reports"] == []


def test_a_tree_interrupt_ends_a_subagent_no_host_runs_that_waits_for_a_person(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-HITL-1, R-CLUSTER-2: through a's gateway alice's root spawns
    the payer in the background, whose ``pay`` waits for a person; a is lost. b takes the
    root over, alone. The root's ``scope="tree"`` interrupt through b's gateway answers
    ``interrupted`` once JetStream holds the payer's end, ``aborted``: its request is
    listed no more, answering it is refused, nothing is paid. Before, the interrupt found
    nothing to end and the payer stayed pending, for a person's answer to run its call."""
    paid: list[int] = []

    async def pay(amount: int) -> str:
        """Pay an amount."""
        paid.append(amount)
        return f"paid {amount}"

    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b = cluster.members["a"], cluster.members["b"]
        async with client(a, "alice") as alice:
            root, asked, _ = await _until_the_payer_asks(alice)
        payer = asked["session_id"]
        await _lose(cluster, a, root, payer)
        assert await b.node._take_entry(root, await cluster.entry(root) or {})
        found: dict[str, Any] = {}
        async with client(b, "alice") as alice:
            found["answer"] = await alice.result("interrupt", {"session_id": root, "scope": "tree"})
            found["ends"] = _ends((await cluster.traces.read(payer)).records)
            found["listed"] = await alice.result("approvals.list", {"session_id": root})
            decision = {"session_id": payer, "call_id": asked["call_id"], "decision": "allow"}
            found["refused"] = await alice.error("approve", decision)
        return found

    tools = (make_tool(pay, parallel=False), spawn_subagent)
    found = in_cluster(nats_server, tmp_path, ("a", "b"), body, tools=tools)
    assert found["ends"] == ["aborted"]
    assert found["answer"] == {"interrupted": True}
    assert found["listed"] == {"approvals": []}
    assert found["refused"]["code"] == 409, found["refused"]
    assert paid == []


def test_a_tree_interrupt_ends_the_subagents_another_live_host_runs(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-ABORT-1, R-CLUSTER-2: a runs the tree (the root idle, the
    payer's task answered and waiting for its background collector, whose ``hold`` call
    runs) and is lost. b takes the root over, c the payer and the collector, which holds
    its next call there. The root's ``scope="tree"`` interrupt through b's gateway answers
    ``interrupted`` once c has written the payer's and the collector's ends, ``aborted``:
    the collector's held call ends interrupted, and the root takes no report and starts no
    task. Before, b ended only what it ran: the answer was ``interrupted`` false and the
    subagents ran on, on c."""
    holds = Holds()

    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b, c = (cluster.members[h] for h in ("a", "b", "c"))
        held = (holds.tool(), holds.started["collect-1"])
        tree = await _until_the_payer_waits(a, tmp_path, held, brain)
        root, payer, collector = tree
        await _lose(cluster, a, *tree)
        assert await b.node._take_entry(root, await cluster.entry(root) or {})
        entries = {sid: await cluster.entry(sid) or {} for sid in (payer, collector)}
        assert await c.node._take_entries(entries) == [payer, collector]
        await holds.started["collect-2"].wait()  # the collector runs on c
        b.gateway.grant("alice", root)
        async with client(b, "alice") as alice:
            answer = await alice.result("interrupt", {"session_id": root, "scope": "tree"})
        records = {sid: (await cluster.traces.read(sid)).records for sid in tree}
        found: dict[str, Any] = {"answer": answer, "tree": tree}
        found["ends"] = {sid: _ends(records[sid]) for sid in tree}
        found["held"] = [
            r.status
            for r in records[collector]
            if isinstance(r, ToolCallOutput) and r.call_id == "collect1"
        ]
        if found["ends"] != {root: ["completed"], payer: ["aborted"], collector: ["aborted"]}:
            return found  # running on c still
        for session_id in (collector, payer):
            # Its answer, had it one to give, is on its way before it leaves the host.
            await until(lambda: cluster.released(session_id))  # noqa: B023
        await b.host.get_session(root).wait_idle()
        last = b.host.port(root).last_seq
        await until(lambda: _traced_through(cluster, root, last))
        records = {sid: (await cluster.traces.read(sid)).records for sid in tree}
        found["later_ends"] = {sid: _ends(records[sid]) for sid in tree}
        found["root_reports"] = [
            r for r in records[root] if isinstance(r, UserMsg) and FINISHED in str(r.content)
        ]
        return found

    brain = _brain_holding(pays=0, collects=2)
    tools = (*TOOLS, holds.tool())
    hosts = ("a", "b", "c")
    found = in_cluster(
        nats_server, tmp_path, hosts, body, brain=brain, tools=tools, approve=allow_all
    )
    root, payer, collector = found["tree"]
    assert found["ends"] == {root: ["completed"], payer: ["aborted"], collector: ["aborted"]}
    assert found["answer"] == {"interrupted": True}
    assert found["held"] == ["interrupted"]
    assert found["later_ends"] == found["ends"]  # no follow-up task at the root
    assert found["root_reports"] == []
    assert not holds.started["collect-3"].is_set()


def test_a_hosts_end_of_a_node_it_runs_needs_a_reason(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-CLUSTER-2: the request that ends a node on its host for another host's
    tree interrupt is refused with a clear error when it carries no reason; with one, an
    idle node is left as it is and the answer says it had no work to end."""

    async def body(cluster: Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
        a = cluster.members["a"]
        session = await a.host.create_session(
            provider=ScriptedProvider(watched_brain), workspace_dir=tmp_path
        )
        await a.node._serving.setdefault(session.id, trio.Event()).wait()
        requests = SessionRequests(cluster.conn)
        ask = {"method": TREE_END_METHOD, "principal": ""}
        refused = await requests.request(session.id, {**ask, "params": {}})
        ended = await requests.request(session.id, {**ask, "params": {"reason": "stop"}})
        return refused, ended

    watched_brain = Watched(_brain_holding(pays=0, collects=0)).brain
    refused, ended = in_cluster(nats_server, tmp_path, ("a",), body)
    assert refused["error"]["code"] == -32602, refused
    assert "reason" in refused["error"]["message"]
    assert ended == {"result": {"interrupted": False}}


def test_a_tree_interrupt_does_not_open_again_the_nodes_it_ended_here(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-CLUSTER-2: b has taken the whole tree over (the collector's ``hold``
    call runs there). The root's ``scope="tree"`` interrupt on b ends the payer and the
    collector there; they leave b (closed, released) while the interrupt's look into the
    directory runs: the test holds their closed entries until that look has read the
    directory, that read until b runs them no more, and its read of their owners until
    they are released. They are not taken for nodes no host runs: neither is claimed
    and opened on b again. Before, both were, and stayed open on b."""
    live_owners, entries_of, publish = (
        SessionOwners.live_owners,
        SessionDirectory.entries,
        DirectoryEntries.publish,
    )
    read = trio.Event()

    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b = cluster.members["a"], cluster.members["b"]
        held = (watched.tool(), watched.started["collect-1"])
        tree = await _until_the_payer_waits(a, tmp_path, held, watched.brain)
        root, payer, collector = tree
        await _lose(cluster, a, *tree)
        entries = {sid: await cluster.entry(sid) or {} for sid in tree}
        assert await b.node._take_entries(entries) == list(tree)
        await watched.started["collect-2"].wait()  # the collector runs on b

        async def after_their_release(self: SessionOwners, session_ids: Any, **kw: Any) -> Any:
            session_ids = list(session_ids)
            if payer in session_ids:
                for session_id in (payer, collector):
                    await until(lambda: cluster.released(session_id))  # noqa: B023
            return await live_owners(self, session_ids, **kw)

        async def run_nowhere() -> bool:
            return not (b.node.serves(payer) or b.node.serves(collector))

        async def entries_read(self: SessionDirectory, **kw: Any) -> Any:
            found = await entries_of(self, **kw)
            await until(run_nowhere)  # closed on b, their entries not yet
            read.set()
            return found

        async def closed_after_the_read(
            self: DirectoryEntries, session_id: str, *, closed: bool = False
        ) -> None:
            if closed and session_id in (payer, collector):
                await read.wait()
            await publish(self, session_id, closed=closed)

        monkeypatch.setattr(SessionOwners, "live_owners", after_their_release)
        monkeypatch.setattr(SessionDirectory, "entries", entries_read)
        monkeypatch.setattr(DirectoryEntries, "publish", closed_after_the_read)
        interrupted = b.host.get_session(root).interrupt("stop the tree", scope="tree")
        await b.host.child_reports.reached(root)
        records = {sid: (await cluster.traces.read(sid)).records for sid in tree}
        return {
            "interrupted": interrupted,
            "tree": tree,
            "ends": {sid: _ends(records[sid]) for sid in tree},
            "open_on_b": sorted(s.id for s in b.host.sessions if s.id in (payer, collector)),
            "holders": {sid: await cluster.holder(sid) for sid in (payer, collector)},
        }

    watched = Watched(_brain_holding(pays=0, collects=2))
    tools = (*TOOLS, watched.tool())
    found = in_cluster(
        nats_server, tmp_path, ("a", "b"), body, brain=watched.brain, tools=tools, approve=allow_all
    )
    root, payer, collector = found["tree"]
    assert found["interrupted"] is True
    assert found["ends"] == {root: ["completed"], payer: ["aborted"], collector: ["aborted"]}
    assert found["open_on_b"] == []
    assert found["holders"] == {payer: None, collector: None}
