"""The nodes of an agent tree in a cluster (R-TREE-1, R-TREE-4, R-CLUSTER-1..2): in-process
hosts (``open_cluster_host``, each with its gateway bound to the cluster as ``serve --nats``
binds it) on a real nats-server, one scripted brain for every node.

* A finished subagent leaves its host as a closed session does: out of the host's load at
  once; once its trace is in JetStream, no longer replicated nor served there, its
  directory entry closed and its claim released; no orphan scan takes it over. Opened
  again (``session.children()``) it is adopted again; deleted while closed it leaves the
  cluster; a root its user closed leaves its host the same way. Before, a finished child
  stayed owned, counted and replicated by its host for ever, and opening it again wedged
  it: "owned by another host", closed, owned by its host and served by none.
* Every node of a tree is reached by its root's principal through any host's gateway,
  whichever hosts run the root and the node — on the root's host, or after a takeover on
  two others — as on one host: steer, approve, subscribe; ``run`` stays on the root; another
  principal is refused. Before, 403: the gateway read only the node's own directory entry,
  and the node's owner only its own grants.
* A finished subagent reached through another host's gateway is opened there, from its
  trace in JetStream, and answered as one host answers for a closed session.

Takeovers are driven by hand (``_take_entry``, what the orphan scan calls), with a lease
TTL so long that no scan runs meanwhile: which host takes which session over is the test's
choice, not a race. Waits are on outputs and, for the cluster's state, on bounded reads of
NATS.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
import trio
import trio.testing
from conftest import Gates, allow_all, collect
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import ClusterNames, Connection, connect
from greenroom.actors.cluster.node import ClusterConfig, ClusterNode, open_cluster_host
from greenroom.actors.cluster.orphans import OrphanFinder
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.gateway.config import SessionDefaults
from greenroom.actors.gateway.server import Gateway
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime import subagents
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import Approval
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols import jsonrpc
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.outputs import (
    ModelMsg,
    Output,
    RequestEnd,
    TaskEnd,
    TaskStart,
    UserMsg,
)
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool, make_tool
from greenroom.protocols.trace import input_size, parse_trace
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    running_nats,
)
from tests.test_gateway import Client
from tests.test_recovery import blocking_tool

LONG_TTL_S = 60.0
"""No orphan scan runs within a test (every TTL / 2): takeovers are the test's."""
BOUND_S = 60.0
"""A bound on a whole test against a hang: a cluster of hosts over a real NATS server takes
seconds on a busy machine (15 s ran out for one test under three test runs at once)."""
POLL_S = 0.02
TOKENS = {"alice": "alice-token-0123456789", "mallory": "mallory-token-0123456789"}
FINISHED = "[subagent payer finished]"


def _brain(request: ModelRequest) -> Reply:
    """The root spawns a child: ``pay`` in the background (the payer pays, once allowed),
    ``quick`` in the foreground (the child answers at once); the root merges a background
    child's answer when it comes in as input."""
    last = request.messages[-1]
    results = isinstance(last, UserMessage) and any(isinstance(b, ToolResult) for b in last.content)
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if results:
            return Reply(blocks=(text("paid, as far as I know"),))
        if "pay" in str(request.messages[0].content):
            return Reply(blocks=(tool_call("p1", "pay", amount=7),))
        return Reply(blocks=(text("the child is done"),))
    if FINISHED in str(last.content):
        return Reply(blocks=(text("merged: the payer is done"),))
    if results:
        return Reply(blocks=(text("the root is done"),))
    if "pay" in str(last.content):
        spawn = {"task": "pay 7", "background": True, "name": "payer"}
        return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))
    return Reply(blocks=(tool_call("s1", "spawn_subagent", task="answer at once"),))


async def _pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}"


TOOLS: tuple[Tool, ...] = (make_tool(_pay, parallel=False, name="pay"), spawn_subagent)


@attrs.define
class Member:
    """One host of the cluster: its host, node and gateway; ``stop`` ends it (a clean
    stop: its lease is dropped, every session it owned is an orphan at once)."""

    host_id: str
    host: Host
    node: ClusterNode
    gateway: Gateway
    stop: trio.Event
    stopped: trio.Event


async def _member(
    bridge: Bridge,
    url: str,
    prefix: str,
    data: Path,
    host_id: str,
    *,
    brain: Callable[[ModelRequest], Reply] = _brain,
    tools: tuple[Tool, ...] = TOOLS,
    approve: Approval = PEOPLE,
    task_status: trio.TaskStatus[Member],
) -> None:
    config = ClusterConfig(url=url, host_id=host_id, lease_ttl_s=LONG_TTL_S, prefix=prefix)
    nodes: list[ClusterNode] = []
    stop, stopped = trio.Event(), trio.Event()
    workspace = data / "ws"
    workspace.mkdir(parents=True, exist_ok=True)
    try:
        async with (
            open_cluster_host(
                bridge,
                config,
                data / host_id,
                tools=tools,
                approve=approve,
                provider=lambda: ScriptedProvider(brain),
                on_node=nodes.append,
            ) as host,
            trio.open_nursery() as nursery,
        ):
            defaults = SessionDefaults(
                provider_factory=lambda: ScriptedProvider(brain),
                tools=tools,
                workspace_dir=workspace,
                approve="ask",
            )
            gateway = Gateway(host, tokens=TOKENS, port=0, defaults=defaults)
            nodes[0].bind_gateway(gateway)
            await nursery.start(gateway.run)
            task_status.started(Member(host_id, host, nodes[0], gateway, stop, stopped))
            await stop.wait()
            nursery.cancel_scope.cancel()  # the gateway; then the host closes cleanly
    finally:
        stopped.set()


@attrs.define
class Cluster:
    """The hosts of one test, and a NATS connection of its own to read the cluster."""

    members: dict[str, Member]
    conn: Connection
    owners: SessionOwners
    directory: SessionDirectory
    traces: TraceStream

    async def holder(self, session_id: str) -> str | None:
        return await self.owners.holder(session_id)

    async def entry(self, session_id: str) -> dict[str, Any] | None:
        return await self.directory.get(session_id)

    async def closed(self, session_id: str) -> bool:
        return bool((await self.entry(session_id) or {}).get("closed"))

    async def released(self, session_id: str) -> bool:
        """Whether its host has released the session it closed: its entry closed first,
        then its claim released (the host answers for it until then)."""
        return await self.closed(session_id) and await self.holder(session_id) is None


def in_cluster(
    nats_server: NatsProcess,
    tmp_path: Path,
    host_ids: tuple[str, ...],
    body: Callable[[Cluster], Awaitable[Any]],
    *,
    brain: Callable[[ModelRequest], Reply] = _brain,
    tools: tuple[Tool, ...] = TOOLS,
    approve: Approval = PEOPLE,
) -> Any:
    """Run ``body`` with hosts ``host_ids`` of a cluster of its own, bounded; ``brain``
    is the model of every session a host creates or takes over, ``tools`` its tools,
    ``approve`` what decides the calls of the tasks a host takes over."""
    names = ClusterNames(prefix=f"t{uuid.uuid4().hex[:10]}")

    async def main(bridge: Bridge) -> Any:
        with trio.fail_after(BOUND_S):
            conn = await connect(bridge, nats_server.url, name="test", names=names)
            try:
                async with trio.open_nursery() as nursery:
                    members = {}
                    for host_id in host_ids:
                        member = functools.partial(
                            _member, brain=brain, tools=tools, approve=approve
                        )
                        members[host_id] = await nursery.start(
                            member, bridge, nats_server.url, names.prefix, tmp_path, host_id
                        )
                    cluster = Cluster(
                        members,
                        conn,
                        await SessionOwners.open(conn, ttl_s=LONG_TTL_S),
                        await SessionDirectory.open(conn),
                        await TraceStream.open(conn),
                    )
                    try:
                        return await body(cluster)
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await conn.aclose()

    return run(main)


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Return once ``check()`` holds: the cluster's state, read again and again (bounded by
    the test's deadline)."""
    # NATS tells nobody when a key changes here: the state is read until it holds.
    while not await check():  # noqa: ASYNC110
        await trio.sleep(POLL_S)


@asynccontextmanager
async def client(member: Member, principal: str) -> AsyncIterator[Client]:
    headers = [(b"Authorization", f"Bearer {TOKENS[principal]}".encode())]
    url = member.gateway.url
    async with open_websocket_url(url, extra_headers=headers) as ws:
        yield Client(ws)


def _trace_file_records(member: Member, session_id: str) -> list[str]:
    directory = member.host.data_dir / "sessions" / session_id
    records = []
    for path in sorted(directory.glob("trace_*.jsonl")):
        records += parse_trace(path.read_text(), file=str(path)).records
    return [f"{r.seq}:{r.TYPE}" for r in records]


# -- a finished subagent leaves its host ----------------------------------------------------------


def test_a_finished_subagent_leaves_its_host_and_is_taken_up_again_when_opened(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(cluster: Cluster) -> None:
        a = cluster.members["a"]
        root = await a.host.create_session(
            provider=ScriptedProvider(_brain), tools=TOOLS, workspace_dir=tmp_path
        )
        first = await _child_of_a_run(root, "quick")
        second = await _child_of_a_run(root, "quick, again")

        # Out of the host's load and no longer run there, at once.
        node = a.node
        assert node.load == 1 and node.serves(root.id)
        assert not node.serves(first) and not node.serves(second)
        # Once its trace is in JetStream: closed in the directory, its claim released,
        # no longer replicated; its whole trace is in the cluster.
        await until(lambda: cluster.released(second))
        assert node.store is not None and not node.store.log.replicated(second)
        assert await cluster.holder(second) is None
        entry = await cluster.entry(second)
        assert entry is not None and entry["host"] == "a" and entry["running"] is False
        traced = (await cluster.traces.read(second)).records
        assert [f"{r.seq}:{r.TYPE}" for r in traced] == _trace_file_records(a, second)
        assert traced[-1].TYPE == "task_end"
        # No orphan: no host is to take a closed session over.
        finder = OrphanFinder(cluster.directory, cluster.owners, lambda _sid: False)
        assert await finder.look() == {}

        # Opened again (children() loads the finished ones): adopted again.
        await until(lambda: cluster.released(first))
        assert {c.id for c in await root.children()} == {first, second}
        assert node.load == 3 and node.serves(first) and node.store.log.replicated(first)
        for child in (first, second):
            await until(lambda: _open_entry(cluster, child))  # noqa: B023
            assert await cluster.holder(child) == "a"

        # Deleted while closed: it leaves the cluster (its trace and its entries).
        await a.host.close_session(second)
        await until(lambda: cluster.released(second))
        await a.host.delete_session(second)
        await until(lambda: _gone(cluster, second))
        assert (await cluster.traces.read(second)).records == ()
        assert await cluster.holder(second) is None

        # A root its user closed leaves the host the same way.
        await a.host.close_session(root.id)
        await until(lambda: cluster.released(root.id))
        assert await cluster.holder(root.id) is None and not node.serves(root.id)
        # Opened, closed and opened again at once (its adoption, release and adoption in
        # flight together): it is this host's, and what it records reaches the cluster.
        await a.host.load_session(root.id)
        await a.host.close_session(root.id)
        again = await a.host.load_session(root.id, tools=TOOLS, provider=ScriptedProvider(_brain))
        await _child_of_a_run(again, "quick, once more")
        await until(lambda: _open_entry(cluster, root.id))
        assert await cluster.holder(root.id) == "a" and node.serves(root.id)
        traced = (await cluster.traces.read(root.id)).records
        assert [f"{r.seq}:{r.TYPE}" for r in traced] == _trace_file_records(a, root.id)

    in_cluster(nats_server, tmp_path, ("a",), body)


async def _child_of_a_run(root: Session, prompt: str) -> str:
    """Run ``prompt`` on ``root`` (which spawns a foreground child); the child's id."""
    outputs = await collect(root.run(prompt, approve=allow_all))
    assert isinstance(outputs[-1], TaskEnd) and outputs[-1].status == "completed"
    (child,) = {o.session_id for o in outputs if o.session_id != root.id}
    return child


async def _open_entry(cluster: Cluster, session_id: str) -> bool:
    entry = await cluster.entry(session_id)
    return entry is not None and not entry.get("closed")


async def _gone(cluster: Cluster, session_id: str) -> bool:
    return await cluster.entry(session_id) is None


# -- every node through any host ------------------------------------------------------------------


async def _run_root(alice: Client, prompt: str) -> str:
    """Create a root through ``alice``'s host (subscribed), run ``prompt`` and allow its
    spawn (``serve --approve ask``: people decide); the root's id."""
    root: str = (await alice.result("session.create"))["session_id"]
    await alice.result("session.subscribe", {"session_id": root})
    await alice.result("run", {"session_id": root, "input": prompt})
    outputs = await alice.outputs_until("approval_request", tool="spawn_subagent")
    spawn = {"session_id": root, "call_id": outputs[-1]["call_id"], "decision": "allow"}
    assert await alice.result("approve", spawn) == {}
    return root


async def _until_the_payer_asks(alice: Client) -> tuple[str, dict[str, Any], int]:
    """Run a root that spawns the payer in the background, through ``alice``'s host, until
    the root's task has ended and the payer asks for a person: the root's id, the payer's
    ``approval_request`` and the ``seq`` of the root's ``task_end``."""
    root = await _run_root(alice, "pay through a subagent")
    outputs: list[dict[str, Any]] = []
    while not (_of(outputs, "approval_request") and _of(outputs, "task_end")):
        outputs.append(await alice.output())
    (asked,) = _of(outputs, "approval_request")
    ended = _of(outputs, "task_end")[0]
    assert asked["tool"] == "pay" and ended["session_id"] == root
    return root, asked, ended["seq"]


async def finished_tree(cluster: Cluster, member: Member) -> tuple[str, str]:
    """Through ``member``'s gateway, alice's root runs a foreground child to its end; once
    the child's host has released it (closed, its claim given up): the root's id and the
    child's."""
    async with client(member, "alice") as alice:
        root = await _run_root(alice, "quick")
        outputs = await alice.outputs_until("task_end", session_id=root)
        (child,) = {o["session_id"] for o in outputs if o["session_id"] != root}
    await until(lambda: cluster.released(child))
    return root, child


def _of(outputs: list[dict[str, Any]], type_name: str) -> list[dict[str, Any]]:
    return [o for o in outputs if o["type"] == type_name]


def test_every_node_of_a_tree_is_reached_through_any_host_by_its_roots_principal(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b, c = (cluster.members[h] for h in ("a", "b", "c"))
        found: dict[str, Any] = {}
        async with client(a, "alice") as alice_a:
            root, asked, root_done = await _until_the_payer_asks(alice_a)
            child, call_id = asked["session_id"], asked["call_id"]
            assert asked["origin"] == [root, child]
            # The payer waits for a person; host a runs the root and the payer. Through
            # host b, as through a.
            async with client(b, "alice") as alice_b, client(b, "mallory") as mallory_b:
                listed = await alice_b.result("approvals.list", {"session_id": child})
                found["listed_via_b"] = [p["call_id"] for p in listed["approvals"]]
                found["run_child_via_b"] = await alice_b.error(
                    "run", {"session_id": child, "input": "hi"}
                )
                found["mallory_via_b"] = await mallory_b.error(
                    "approvals.list", {"session_id": child}
                )
        # Host a stops: the root goes to b, the payer to c.
        a.stop.set()
        await a.stopped.wait()
        for member, session_id in ((b, root), (c, child)):
            entry = await cluster.entry(session_id)
            assert entry is not None
            assert await member.node._take_entry(session_id, entry)
        assert (await cluster.holder(root), await cluster.holder(child)) == ("b", "c")
        async with (
            client(b, "alice") as alice_b,
            client(c, "alice") as alice_c,
            client(b, "mallory") as mallory_b,
            client(c, "mallory") as mallory_c,
        ):
            await alice_b.result("session.subscribe", {"session_id": root, "after_seq": root_done})
            # Through c, which runs the payer but was granted nothing of the tree.
            subscribed = await alice_c.result("session.subscribe", {"session_id": child})
            found["replayed"] = subscribed["replayed"] > 0
            alice_c.take_outputs()
            listed = await alice_c.result("approvals.list", {"session_id": child})
            found["listed_via_c"] = [p["call_id"] for p in listed["approvals"]]
            found["mallory_refused"] = [
                await mallory_c.error("steer", {"session_id": child, "input": "mine"}),
                await mallory_b.error(
                    "approve", {"session_id": child, "call_id": call_id, "decision": "allow"}
                ),
            ]
            # Through b, which runs the root: forwarded to c.
            allow = {"session_id": child, "call_id": call_id, "decision": "allow"}
            found["approved_via_b"] = await alice_b.result("approve", allow)
            ended = (await alice_c.outputs_until("task_end", session_id=child))[-1]
            found["child_end"] = ended["status"]
            found["steer_via_c"] = await alice_c.result(
                "steer", {"session_id": child, "input": "anything else?"}
            )
            found["run_child_via_c"] = await alice_c.error(
                "run", {"session_id": child, "input": "hi"}
            )
            # The payer's answer reached the root, on b; so did what it wrote on c.
            merged = await alice_b.outputs_until("task_end", session_id=root)
            texts = [
                (o["session_id"], o.get("origin"), o["block"]["text"])
                for o in merged
                if o["type"] == "model_msg" and o["block"]["type"] == "text"
            ]
            found["root_follow_up"] = [t for sid, _, t in texts if sid == root]
            found["payer_via_b"] = [
                (origin == [root, child], t) for sid, origin, t in texts if sid == child
            ]
        return found

    found = in_cluster(nats_server, tmp_path, ("a", "b", "c"), body)
    assert found["listed_via_b"] == ["p1"]
    assert found["run_child_via_b"]["code"] == jsonrpc.INVALID_PARAMS  # run is the root's
    assert found["mallory_via_b"]["code"] == jsonrpc.FORBIDDEN
    assert found["replayed"]
    assert found["listed_via_c"] == ["p1"]
    assert [e["code"] for e in found["mallory_refused"]] == [jsonrpc.FORBIDDEN] * 2
    assert found["approved_via_b"] == {}
    assert found["child_end"] == "completed"
    assert found["steer_via_c"] == {"queued": False}
    assert found["run_child_via_c"]["code"] == jsonrpc.INVALID_PARAMS
    assert found["root_follow_up"] == ["merged: the payer is done"]
    assert found["payer_via_b"] == [(True, "paid, as far as I know")]


def test_a_finished_subagent_is_opened_where_a_call_reaches_it(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b = cluster.members["a"], cluster.members["b"]
        found: dict[str, Any] = {}
        _, child = await finished_tree(cluster, a)
        async with client(b, "alice") as alice_b, client(b, "mallory") as mallory_b:
            found["mallory"] = await mallory_b.error(
                "steer", {"session_id": child, "input": "mine"}
            )
            found["steer"] = await alice_b.result(
                "steer", {"session_id": child, "input": "anything else?"}
            )
            found["holder"] = await cluster.holder(child)
            found["serves"] = (a.node.serves(child), b.node.serves(child))
            found["interrupt"] = await alice_b.result("interrupt", {"session_id": child})
            subscribed = await alice_b.result("session.subscribe", {"session_id": child})
            found["replayed"] = [o["type"] for o in alice_b.take_outputs()]
            found["subscribed"] = subscribed
        async with client(a, "alice") as alice_a:
            # Through a, its first host: forwarded to b, which runs it now.
            found["steer_via_a"] = await alice_a.result(
                "steer", {"session_id": child, "input": "and now?"}
            )
        return found

    found = in_cluster(nats_server, tmp_path, ("a", "b"), body)
    assert found["mallory"]["code"] == jsonrpc.FORBIDDEN
    assert found["steer"] == {"queued": False}
    assert found["holder"] == "b" and found["serves"] == (False, True)
    assert found["interrupt"] == {"interrupted": False}
    assert found["replayed"][-1] == "task_end"
    assert found["subscribed"]["replayed"] == len(found["replayed"])
    assert found["steer_via_a"] == {"queued": False}


def test_a_call_forwarded_as_its_host_releases_the_session_is_carried_out(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-CLUSTER-1, R-TREE-4: a ``steer`` forwarded through b to a session's host a (its
    entry names a) is under way there when a begins releasing the session it closed (a
    subagent that has just reported, say): the release waits for it, the call opens the
    session on a again and is answered, and the release then ends with the session kept
    on a. Before, the release's stop cut the call short: a 503 whose ``data.outcome`` said
    it may have been done. The release is held as it closes the entry, the call as a's
    gateway method begins: which comes first is the test's, not a race."""

    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b = cluster.members["a"], cluster.members["b"]
        found: dict[str, Any] = {}
        async with client(a, "alice") as alice_a:
            session_id = (await alice_a.result("session.create"))["session_id"]
        await until(lambda: _named(cluster, session_id, "alice"))
        assert a.node.serves(session_id)

        closing, close_now = trio.Event(), trio.Event()
        close = a.node._entries.close

        async def close_when_told(closed_id: str) -> None:
            closing.set()
            await close_now.wait()
            await close(closed_id)

        monkeypatch.setattr(a.node._entries, "close", close_when_told)
        methods = cast(dict[str, Any], a.gateway.methods)
        steer = methods["steer"]
        serving, serve_now = trio.Event(), trio.Event()

        async def steer_when_told(connection: Any, params: dict[str, Any]) -> Any:
            serving.set()
            await serve_now.wait()
            return await steer(connection, params)

        monkeypatch.setitem(methods, "steer", steer_when_told)
        await a.host.close_session(session_id)
        await closing.wait()
        async with client(b, "alice") as alice_b, trio.open_nursery() as nursery:

            async def steer_through_b() -> None:
                params = {"session_id": session_id, "input": "anything else?"}
                found["steer"] = await alice_b.call("steer", params)

            nursery.start_soon(steer_through_b)
            await serving.wait()  # on a, forwarded: the release begins now
            close_now.set()
            await until(lambda: cluster.closed(session_id))
            # The release waits for the call: a still holds the session.
            found["holder_meanwhile"] = await cluster.holder(session_id)
            serve_now.set()
        if "result" not in found["steer"]:
            return found  # cut short: nothing opened it again
        # Opened on a again by the call, the release leaves it there.
        await until(lambda: _open_entry(cluster, session_id))
        found["after"] = (await cluster.holder(session_id), a.node.serves(session_id))
        return found

    found = in_cluster(nats_server, tmp_path, ("a", "b"), body)
    assert found["steer"].get("result") == {"queued": False}, found["steer"]
    assert found["holder_meanwhile"] == "a"
    assert found["after"] == ("a", True)


async def _named(cluster: Cluster, session_id: str, principal: str) -> bool:
    """Whether the directory entry of ``session_id`` lists ``principal``."""
    return principal in ((await cluster.entry(session_id) or {}).get("principals") or ())


# -- a taken-up child's answer for a closed parent ------------------------------------------------


def test_a_taken_up_childs_answer_opens_its_closed_parent(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-4: host a stops while its payer waits for a person; b takes the root and the
    payer over, and the root's user closes the root there (it leaves b: closed, no owner).
    Answered, the payer reports: the closed root is opened again for the answer, as one
    host loads a closed parent for a taken-up child's report, and merges it; the payer
    then leaves b (R-TREE-4: a child is a session like any other). Before, the report was
    offered to a root no host owned, again and again, then given up."""

    async def body(cluster: Cluster) -> str | None:
        a, b = cluster.members["a"], cluster.members["b"]
        async with client(a, "alice") as alice_a:
            root, asked, _ = await _until_the_payer_asks(alice_a)
            child, call_id = asked["session_id"], asked["call_id"]
        a.stop.set()
        await a.stopped.wait()
        for session_id in (root, child):
            entry = await cluster.entry(session_id)
            assert entry is not None
            assert await b.node._take_entry(session_id, entry)
        await b.host.close_session(root)
        await until(lambda: cluster.released(root))
        assert await cluster.holder(root) is None and not b.node.serves(root)

        await b.host.answer_approval(child, call_id, "allow")
        await until(lambda: _merged(cluster, root))
        # Its report made, the taken-up payer leaves b as a live child leaves its host:
        # released in the cluster, no longer open there (it stayed open before).
        await until(lambda: cluster.released(child))
        assert not b.node.serves(child) and child not in [s.id for s in b.host.sessions]
        return await cluster.holder(root)

    assert in_cluster(nats_server, tmp_path, ("a", "b"), body) == "b"


async def _merged(cluster: Cluster, root: str) -> bool:
    """Whether ``root``'s trace in JetStream holds a completed task that merged the payer's
    answer, which came in as its prompt."""
    records = (await cluster.traces.read(root)).records
    prompts = [r for r in records if isinstance(r, UserMsg) and r.kind == "prompt"]
    blocks = [r.block for r in records if isinstance(r, ModelMsg)]
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    ends = [r.status for r in records if isinstance(r, TaskEnd)]
    return (
        any(FINISHED in str(p.content) for p in prompts)
        and "merged: the payer is done" in texts
        and ends[-1:] == ["completed"]
    )


async def _left_behind(node: Any, cluster: Any, sid: str) -> tuple[bool, bool, bool, bool]:
    """What a deleted session left on its host and in the cluster once its lane is done:
    its trace stream, its replication, its directory entry, its lease holder."""

    async def lane_done() -> bool:
        return not node._lanes.has(sid)

    await until(lane_done)
    assert node.store is not None
    return (
        sid in node._stream_scopes,
        node.store.log.replicated(sid),
        await cluster.entry(sid) is not None,
        await cluster.holder(sid) is not None,
    )


def test_a_session_deleted_while_it_is_adopted_leaves_nothing_running(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-CLUSTER-1, R-HOST-3: a session deleted at once after its creation, its adoption
    (claim, fence, entry, replication) still under way: once its lane is done, nothing of
    it is replicated, streamed or served on its host, and the cluster holds nothing of it.
    Before, the adoption started its trace stream after the deletion, and it ran on."""

    async def body(cluster: Cluster) -> tuple[bool, bool, bool, bool]:
        a = cluster.members["a"]
        node = a.node
        session = await a.host.create_session(
            provider=ScriptedProvider(_brain), tools=TOOLS, workspace_dir=tmp_path
        )
        sid = session.id
        await a.host.delete_session(sid)
        return await _left_behind(node, cluster, sid)

    assert in_cluster(nats_server, tmp_path, ("a",), body) == (False, False, False, False)


def test_a_session_deleted_before_its_trace_stream_runs_is_not_replicated_again(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-CLUSTER-1, R-HOST-3: a session deleted once its adoption has started its trace
    stream, before the stream's task first ran (held here until the deletion is done, the
    order a loaded machine now and then gives): it is not replicated, streamed or served
    on its host, and the cluster holds nothing of it. Before, the stream's task replicated
    it again as it began, and the session stayed replicated here for ever."""

    async def body(cluster: Cluster) -> tuple[bool, bool, bool, bool]:
        a = cluster.members["a"]
        node = a.node
        streams = node._streams
        assert streams is not None
        held, deleted, ran = trio.Event(), trio.Event(), trio.Event()
        start_soon = streams.start_soon

        def start_held(fn: Callable[..., Awaitable[None]], *args: Any) -> None:
            async def after_the_deletion() -> None:
                held.set()
                await deleted.wait()
                try:
                    await fn(*args)
                finally:
                    ran.set()

            start_soon(after_the_deletion)

        monkeypatch.setattr(streams, "start_soon", start_held)
        session = await a.host.create_session(
            provider=ScriptedProvider(_brain), tools=TOOLS, workspace_dir=tmp_path
        )
        sid = session.id
        await held.wait()  # adopted: its stream started, its task not run yet
        await a.host.delete_session(sid)
        deleted.set()
        await ran.wait()
        return await _left_behind(node, cluster, sid)

    assert in_cluster(nats_server, tmp_path, ("a",), body) == (False, False, False, False)


def test_a_session_deleted_while_its_entry_is_updated_leaves_no_entry(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-CLUSTER-1, R-HOST-3: a session deleted while the update of its directory entry
    its adoption queued is being written (held here until the deletion has removed the
    entry, or waits to): once its lane is done and the update written, the cluster holds
    no entry of it. Before, the update landed after the removal and the entry of a
    deleted session stayed in the directory."""

    async def body(cluster: Cluster) -> tuple[bool, bool]:
        a = cluster.members["a"]
        node = a.node
        directory = node._directory
        assert directory is not None
        put, delete = directory.put, directory.delete
        remove = getattr(node._entries, "remove", None)
        puts: list[str] = []
        held, removed, written = trio.Event(), trio.Event(), trio.Event()

        async def put_held(session_id: str, meta: Any) -> None:
            puts.append(session_id)
            if len(puts) != 2:  # the adoption's own write; then the update it queued
                await put(session_id, meta)
                return
            held.set()
            await removed.wait()
            try:
                await put(session_id, meta)
            finally:
                written.set()

        async def delete_seen(session_id: str) -> None:
            await delete(session_id)
            removed.set()

        async def remove_queued(session_id: str) -> None:
            removed.set()  # it waits behind the update: the update goes first
            assert remove is not None
            await remove(session_id)

        monkeypatch.setattr(directory, "put", put_held)
        monkeypatch.setattr(directory, "delete", delete_seen)
        monkeypatch.setattr(node._entries, "remove", remove_queued, raising=False)
        session = await a.host.create_session(
            provider=ScriptedProvider(_brain), tools=TOOLS, workspace_dir=tmp_path
        )
        sid = session.id
        await held.wait()
        await a.host.delete_session(sid)

        async def lane_done() -> bool:
            return not node._lanes.has(sid)

        await until(lane_done)
        await written.wait()
        return (await cluster.entry(sid) is not None, await cluster.holder(sid) is not None)

    assert in_cluster(nats_server, tmp_path, ("a",), body) == (False, False)


def test_a_session_taken_over_here_while_its_release_runs_stays_this_hosts(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-CLUSTER-1: a session closed here is released in its lane, its entry closed first;
    a call that reads that entry takes the session over — on this host too — while the
    release still runs. The takeover waits for the release: the session is then this
    host's, claimed, streamed and replicated, its entry open again. Before, the takeover
    ran beside the release, which stopped the new stream or released the new claim."""

    async def body(cluster: Cluster) -> tuple[bool, bool, str | None, bool]:
        a = cluster.members["a"]
        node = a.node
        session = await a.host.create_session(
            provider=ScriptedProvider(_brain), tools=TOOLS, workspace_dir=tmp_path
        )
        sid = session.id
        await until(lambda: _open_entry(cluster, sid))
        entry = await cluster.entry(sid)
        assert entry is not None
        await a.host.close_session(sid)
        assert node._lanes.has(sid)  # its release is under way
        assert await node._take_entry(sid, entry)

        async def lane_done() -> bool:
            return not node._lanes.has(sid)

        await until(lane_done)
        await until(lambda: _open_entry(cluster, sid))
        assert node.store is not None
        return (
            node.serves(sid),
            node.store.log.replicated(sid),
            await cluster.holder(sid),
            sid in node._stream_scopes,
        )

    assert in_cluster(nats_server, tmp_path, ("a",), body) == (True, True, "a", True)


# -- a tree taken over together -------------------------------------------------------------------


def _waiting_brain(request: ModelRequest) -> Reply:
    """The root spawns the payer in the background; the payer spawns the collector in the
    background and says it waits for it; the collector holds a call (``hold``) and, once
    the call has a result, answers ``collected 3``; the payer merges the collector's
    answer, the root the payer's."""
    last = request.messages[-1]
    said = str(last.content) if isinstance(last, UserMessage) else ""
    results = any(
        isinstance(b, ToolResult)
        for m in request.messages
        if isinstance(m, UserMessage)
        for b in m.content
    )
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        if "collect 3" in str(request.messages[0].content):
            if results:
                return Reply(blocks=(text("collected 3"),))
            return Reply(blocks=(tool_call("h1", "hold", key="collecting"),))
        if "[subagent collector finished]" in said:
            return Reply(blocks=(text("merged: collected 3"),))
        if results:
            return Reply(blocks=(text("waiting for the collector"),))
        collect = {"task": "collect 3", "background": True, "name": "collector"}
        return Reply(blocks=(ToolCallBlock(id="s2", name="spawn_subagent", arguments=collect),))
    if FINISHED in said:
        return Reply(blocks=(text("merged: the payer is done"),))
    if results:
        return Reply(blocks=(text("the payer works on it"),))
    spawn = {"task": "pay 3", "background": True, "name": "payer"}
    return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))


async def _until_the_payer_waits(
    a: Member,
    tmp_path: Path,
    held: tuple[Tool, trio.Event] | None = None,
    brain: Callable[[ModelRequest], Reply] = _waiting_brain,
    root_id: str | None = None,
) -> tuple[str, str, str]:
    """On host ``a``, run the tree of ``brain`` (:func:`_waiting_brain`) until the root's
    task has ended, the payer's has answered and waits for its background collector, and
    the collector's ``hold`` call runs (``held``: that tool and the event it sets once
    called; by default one that never returns): the ids of the root (``root_id`` when
    given), the payer and the collector."""
    hold, holding = held or blocking_tool()
    root = await a.host.create_session(
        provider=ScriptedProvider(brain),
        tools=[hold, spawn_subagent],
        workspace_dir=tmp_path,
        session_id=root_id,
    )
    send, inbox = trio.open_memory_channel[list[Output]](math.inf)
    root.watch(send)
    root.run("collect and pay through a subagent", approve=allow_all).detach()
    root_ended = payer_answered = False
    async for batch in inbox:
        for o in batch:
            root_ended = root_ended or (isinstance(o, TaskEnd) and o.origin is None)
            if isinstance(o, RequestEnd) and o.origin is not None and o.turn == 2:
                payer_answered = payer_answered or len(o.origin) == 2
        if root_ended and payer_answered:
            break
    await holding.wait()
    (payer,) = await root.children()
    (collector,) = await payer.children()
    return root.id, payer.id, collector.id


def _tasks_of(records: list[Any]) -> list[str]:
    """The kinds of a trace's task records and of the subagents' reports it took."""
    return [
        "report" if isinstance(r, UserMsg) else r.TYPE
        for r in records
        if r.TYPE in ("task_start", "task_end")
        or (isinstance(r, UserMsg) and "[subagent" in str(r.content))
    ]


def test_a_tree_taken_over_together_lets_a_subagent_wait_for_its_running_child(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-TREE-4, R-CLUSTER-2: host a is lost (its lease, every session it owns)
    while the payer's task, answered, waits for its background collector, whose call
    runs. Host b takes the three over as its orphan scan takes its share, the payer
    before the collector, and the collector's takeover held until the payer's task has
    taken its first step if it was taken up alone: all are loaded before any task is taken
    up, so the payer waits for the collector, whose answer comes in as steering of the
    same task, and the root gets the payer's merged answer. Before, each was taken up
    as it was loaded: the payer's task ended at once, and the collector's answer came as a
    second task."""
    fence = TraceStream.fence

    async def body(cluster: Cluster) -> tuple[list[str], list[str]]:
        a, b = cluster.members["a"], cluster.members["b"]
        root, payer, collector = await _until_the_payer_waits(a, tmp_path)
        # Its sessions' tasks stay open there.
        await _lose(cluster, a, root, payer, collector)

        async def fence_after_the_payers_step(
            self: TraceStream, session_id: str, host_id: str
        ) -> Any:
            # Its task taken up already (open, or ended and gone: taken up alone, it
            # ended at once), the payer takes its first step before the collector is
            # loaded. Loaded only, it waits for the collector's load.
            open_now = {s.id for s in b.host.sessions}
            if session_id == collector and payer in open_now:
                port = b.host.port(payer)
                if port.idle is not None:
                    await port.idle.wait()
            return await fence(self, session_id, host_id)

        monkeypatch.setattr(TraceStream, "fence", fence_after_the_payers_step)
        entries = {sid: await cluster.entry(sid) for sid in (root, payer, collector)}
        assert await b.node._take_entries(
            {sid: entry for sid, entry in entries.items() if entry is not None}
        ) == [root, payer, collector]
        for session_id in (collector, payer):
            await until(lambda: _task_ended(cluster, session_id))  # noqa: B023
        tasks = _tasks_of(list((await cluster.traces.read(payer)).records))
        if tasks != ["task_start", "report", "task_end"]:
            return tasks, []
        await until(lambda: _merged_report(cluster, root))
        root_records = (await cluster.traces.read(root)).records
        said = [str(r.content) for r in root_records if isinstance(r, UserMsg)]
        return tasks, [text for text in said if FINISHED in text]

    tasks, reports = in_cluster(nats_server, tmp_path, ("a", "b"), body, brain=_waiting_brain)
    assert tasks == ["task_start", "report", "task_end"]
    assert len(reports) == 1 and "merged: collected 3" in reports[0], reports


def test_a_lost_hosts_tree_goes_to_one_host_whose_subagent_waits_for_its_child(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-CLUSTER-2: of three hosts, a runs the tree (the payer's task,
    answered, waits for its background collector, whose call runs) and is lost; b and c,
    equally idle, each take their share of the orphans at once. The root's id sorts after
    its children's, so that spread one by one the payer and the collector went to
    different hosts: the payer's task ended at once, not knowing its child, and the
    collector's answer came as a second task. Now the tree goes to one host, which takes
    the three up together: the payer's task waits for the collector, whose answer comes in
    as its steering, and the root gets the payer's merged answer."""

    async def body(
        cluster: Cluster,
    ) -> tuple[tuple[str, ...], dict[str, list[str]], list[str], list[str]]:
        a, b, c = (cluster.members[h] for h in ("a", "b", "c"))
        tree = await _until_the_payer_waits(a, tmp_path, root_id="zzzz-root")
        await _lose(cluster, a, *tree)
        taken: dict[str, list[str]] = {}

        async def take(member: Member, share: dict[str, dict[str, Any]]) -> None:
            taken[member.host_id] = await member.node._take_entries(share)

        async with trio.open_nursery() as nursery:
            for member in (b, c):
                node = member.node
                assert node._finder is not None and node._registry is not None
                share = functools.partial(take, member)
                scan = (node._registry, member.host_id, share, lambda: False)
                nursery.start_soon(node._finder.take_share, *scan)
        if len(taken) != 1:
            return tree, taken, [], []
        root, payer, collector = tree
        for session_id in (collector, payer):
            await until(lambda: _task_ended(cluster, session_id))  # noqa: B023
        tasks = _tasks_of(list((await cluster.traces.read(payer)).records))
        if tasks != ["task_start", "report", "task_end"]:
            return tree, taken, tasks, []
        await until(lambda: _merged_report(cluster, root))
        root_records = (await cluster.traces.read(root)).records
        said = [str(r.content) for r in root_records if isinstance(r, UserMsg)]
        return tree, taken, tasks, [text for text in said if FINISHED in text]

    hosts = ("a", "b", "c")
    tree, taken, tasks, reports = in_cluster(
        nats_server, tmp_path, hosts, body, brain=_waiting_brain
    )
    # One host took the whole tree (the other found no share), each session once.
    assert len(taken) == 1, taken
    (served,) = taken.values()
    assert sorted(served) == sorted(tree)
    assert tasks == ["task_start", "report", "task_end"]
    assert len(reports) == 1 and "merged: collected 3" in reports[0], reports


async def _lose(cluster: Cluster, member: Member, *session_ids: str) -> None:
    """Once JetStream holds what ``member`` recorded of ``session_ids``, lose it as a host
    whose lease went (nothing it writes from then on reaches the cluster) and stop it."""
    for session_id in session_ids:
        last = member.host.port(session_id).last_seq
        await until(lambda: _traced_through(cluster, session_id, last))  # noqa: B023
    keeper = member.node._keeper
    assert keeper is not None
    keeper._lose_all("the test's loss")
    member.stop.set()
    await member.stopped.wait()


async def _traced_through(cluster: Cluster, session_id: str, seq: int) -> bool:
    """Whether JetStream holds ``session_id``'s records up to ``seq``."""
    records = (await cluster.traces.read(session_id)).records
    return bool(records) and (records[-1].seq or 0) >= seq


async def _task_ended(cluster: Cluster, session_id: str) -> bool:
    """Whether ``session_id``'s last task in JetStream has ended."""
    records = (await cluster.traces.read(session_id)).records
    tasks = [r for r in records if isinstance(r, TaskStart | TaskEnd)]
    return bool(tasks) and isinstance(tasks[-1], TaskEnd)


async def _merged_report(cluster: Cluster, root: str) -> bool:
    """Whether ``root``'s trace in JetStream holds a completed task that took the payer's
    report of ``merged: collected 3``."""
    records = (await cluster.traces.read(root)).records
    reports = [r for r in records if isinstance(r, UserMsg) and FINISHED in str(r.content)]
    ends = [r.status for r in records if isinstance(r, TaskEnd)]
    return any("merged: collected 3" in str(r.content) for r in reports) and ends[-1:] == [
        "completed"
    ]


# -- a background child's answer larger than a record -------------------------------------------

SMALL_PAYLOAD = 128 * 1024
"""The NATS server's max_payload of the test below: a record carries about 124 KiB."""
ANSWER_PART = 50_000
"""One text block of the bulky child's answer: each block's record fits, three joined do not."""
BULKY = "[subagent bulky finished]"


def _bulky_brain(request: ModelRequest) -> Reply:
    """The root spawns ``bulky`` in the background and holds a call (``wait``, key ``a``);
    the child answers in three blocks of :data:`ANSWER_PART` characters; the root merges
    the child's answer when it comes in as steering."""
    last = request.messages[-1]
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=tuple(text(c * ANSWER_PART) for c in "abc"))
    if BULKY in str(last.content):
        return Reply(blocks=(text("merged the bulky answer"),))
    spawn = {"task": "write a lot", "background": True, "name": "bulky"}
    return Reply(
        blocks=(
            ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),
            tool_call("w1", "wait", key="a"),
        )
    )


def test_a_background_childs_answer_past_what_nats_carries_is_cut_and_the_parent_goes_on(
    tmp_path: Path, gates: Gates, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-9, R-CLUSTER-1, R-TREE-1: with NATS at 128 KiB, a background child answers
    150 KB (three model blocks, each record of which fits); its answer reaches the root as
    steering of the root's open task. The root's ``user_msg`` holds the answer's start and
    a marker saying how much was cut and that the whole is in the child's trace, which
    holds it; the root's task completes and its records reach JetStream (before: that
    ``user_msg`` could not be replicated and the root stopped on its host). So is a report
    another host hands over (a child taken up there), which starts a follow-up task."""

    real_tell = subagents.tell

    def tell_then_release(parent: Any, message: Any) -> bool:
        told = real_tell(parent, message)
        gates.release("a")  # the answer is in the root's inbox before the call's result
        return told

    monkeypatch.setattr(subagents, "tell", tell_then_release)

    async def body(cluster: Cluster) -> dict[str, Any]:
        a = cluster.members["a"]
        root = await a.host.create_session(
            provider=ScriptedProvider(_bulky_brain),
            tools=[*TOOLS, gates.tool()],
            workspace_dir=tmp_path,
        )
        outputs = await collect(root.run("spawn bulky", approve=allow_all))
        (child,) = {o.session_id for o in outputs if o.session_id != root.id}
        if root.id not in {s.id for s in a.host.sessions}:
            return {"stopped": True}
        # A report handed over by another host (a child taken up there), the root idle:
        # it starts a follow-up task, cut the same way.
        far = f"{BULKY} " + "d" * 3 * ANSWER_PART
        await a.host.child_reports.take(root.id, "taken-up-elsewhere", far, allow_all)
        await root.wait_idle()
        if root.id not in {s.id for s in a.host.sessions}:
            return {"stopped": True}
        last = a.host.port(root.id).last_seq
        await until(lambda: _traced_through(cluster, root.id, last))
        assert a.node.store is not None
        return {
            "end": outputs[-1],
            "child": child,
            "replicated": await a.node.store.log.settled(root.id),
            "root": (await cluster.traces.read(root.id)).records,
            "child_records": (await cluster.traces.read(child)).records,
            "most": a.host.trace_log.largest_input(),
        }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = in_cluster(server, tmp_path, ("a",), body, brain=_bulky_brain)
    assert "stopped" not in found, "the root stopped on its host"
    end = found["end"]
    assert isinstance(end, TaskEnd) and end.status == "completed", end
    assert found["replicated"], "the root stopped on its host"
    reports = [r for r in found["root"] if isinstance(r, UserMsg) and BULKY in str(r.content)]
    (report, far) = reports
    assert report.kind == "steering"
    (block,) = report.content
    assert isinstance(block, TextBlock)
    whole = "\n".join(c * ANSWER_PART for c in "abc")
    assert block.text.startswith(f"{BULKY} {'a' * ANSWER_PART}\n{'b' * 1000}")
    total = len(f"{BULKY} {whole}")
    marker = block.text[block.text.rindex("\n[cut: ") :]
    cut = total - (len(block.text) - len(marker))
    assert marker == (
        f"\n[cut: {cut} of {total} characters left out to fit one record of this session's "
        f"trace ({found['most']} bytes); the whole text is in the trace of subagent session "
        f"{found['child']}]"
    )
    assert found["most"] - 200 < input_size(report.content) <= found["most"]
    said = [r.block.text for r in found["child_records"] if isinstance(r, ModelMsg)]
    assert "\n".join(said) == whole  # the whole answer, where the marker says
    (far_block,) = far.content
    assert isinstance(far_block, TextBlock) and far_block.text.startswith(f"{BULKY} ddd")
    assert far_block.text.endswith(
        "the whole text is in the trace of subagent session taken-up-elsewhere]"
    )
    assert found["most"] - 200 < input_size(far.content) <= found["most"]
    ends = [r.status for r in found["root"] if isinstance(r, TaskEnd)]
    assert ends == ["completed", "completed"]


# -- a tree handed over by a draining host --------------------------------------------------------

DRAIN_GRACE_S = 5.0
"""Within the test's bound; the tree comes to rest at once once its calls are let go."""


def _keyed_hold() -> tuple[Tool, dict[str, trio.Event], dict[str, trio.Event]]:
    """A ``hold`` tool whose call of ``key`` returns ``3`` once the test sets
    ``gates[key]``; ``started[key]`` is set once it is called."""
    started: dict[str, trio.Event] = {}
    gates: dict[str, trio.Event] = {}
    for key in ("collecting", "paying"):
        started[key], gates[key] = trio.Event(), trio.Event()

    async def hold(key: str) -> str:
        """Hold until the test lets the call go."""
        started[key].set()
        await gates[key].wait()
        return "3"

    return make_tool(hold, parallel=True), started, gates


def _paying_brain(request: ModelRequest) -> Reply:
    """:func:`_waiting_brain`, but the payer, once it has spawned the collector, pays (a
    ``hold`` call of its own, ``paying``) before it says that it waits."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM) and "pay 3" in str(
        request.messages[0].content
    ):
        results = [
            b
            for m in request.messages
            if isinstance(m, UserMessage)
            for b in m.content
            if isinstance(b, ToolResult)
        ]
        if len(results) == 1:
            return Reply(blocks=(tool_call("h2", "hold", key="paying"),))
    return _waiting_brain(request)


async def _drained_tree(
    cluster: Cluster, tree: tuple[str, str, str]
) -> tuple[list[str], list[str], dict[str, Any]]:
    """Once host a has drained and stopped: the kinds of the payer's task records
    (:func:`_tasks_of`) once its and the collector's tasks have ended, the payer's reports
    that the root took once it has merged one, and the host each of the tree's sessions
    was last run by (its directory entry's)."""
    a = cluster.members["a"]
    root, payer, collector = tree
    a.stop.set()
    await a.stopped.wait()
    for session_id in (collector, payer):
        await until(lambda: _task_ended(cluster, session_id))  # noqa: B023
    tasks = _tasks_of(list((await cluster.traces.read(payer)).records))
    hosts = {sid: (await cluster.entry(sid) or {}).get("host") for sid in tree}
    if tasks != ["task_start", "report", "task_end"]:
        return tasks, [], hosts
    await until(lambda: _merged_report(cluster, root))
    root_records = (await cluster.traces.read(root)).records
    said = [str(r.content) for r in root_records if isinstance(r, UserMsg)]
    return tasks, [text for text in said if FINISHED in text], hosts


def test_a_subagent_held_while_its_child_runs_is_handed_over_with_it(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-DRAIN-2: host a drains while the payer's own call and its
    background collector's call run. The payer's call is let go first: its task is held
    at its boundary while the collector still runs; the collector's is let go only once
    the payer's hand-over is under way (before: b had taken the payer up alone, and its
    task, answered, had ended) or waits for the collector (the tree's hand-over). Handed
    over with its tree, the payer is taken up on b with the collector: it waits for the
    collector's answer, which comes as steering of the same task, and the root gets the
    payer's merged answer once. Before, ['task_start', 'task_end', 'task_start', 'report',
    'task_end']: the collector's answer came as a second task."""

    async def body(cluster: Cluster) -> tuple[list[str], list[str], dict[str, Any]]:
        a = cluster.members["a"]
        hold, started, gates = _keyed_hold()
        collecting = (hold, started["collecting"])
        tree = await _until_the_payer_waits(a, tmp_path, collecting, _paying_brain)
        payer = tree[1]
        await started["paying"].wait()

        async def payer_handed() -> bool:
            gathered = bool(getattr(a.node, "_gathering", ()))
            return gathered or await _task_ended(cluster, payer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.host.drain, DRAIN_GRACE_S)
            await trio.testing.wait_all_tasks_blocked()
            assert a.host.draining
            gates["paying"].set()
            await until(payer_handed)
            gates["collecting"].set()
        return await _drained_tree(cluster, tree)

    tasks, reports, hosts = in_cluster(nats_server, tmp_path, ("a", "b"), body, brain=_paying_brain)
    assert tasks == ["task_start", "report", "task_end"]
    assert len(reports) == 1 and "merged: collected 3" in reports[0], reports
    assert list(hosts.values()) == ["b", "b", "b"]


def test_a_subagent_that_waits_for_its_held_child_is_handed_over_with_it(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-2, R-TREE-4, R-DRAIN-2: host a drains while the payer's task, answered, waits
    for its background collector, whose call runs; the call is let go, the collector is
    held, and the tree (the idle root, the waiting payer, the held collector) is handed to
    host b in one request: the payer's task takes the collector's answer as steering and
    the root, on b, gets the payer's merged answer once. Before, the collector went alone,
    its answer reached the payer on a, which was held and handed on, and the payer's
    answer reached the root on a as a stopped: refused ("the host is closed"), lost."""

    async def body(cluster: Cluster) -> tuple[list[str], list[str], dict[str, Any]]:
        a = cluster.members["a"]
        hold, started, gates = _keyed_hold()
        tree = await _until_the_payer_waits(a, tmp_path, (hold, started["collecting"]))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.host.drain, DRAIN_GRACE_S)
            await trio.testing.wait_all_tasks_blocked()
            assert a.host.draining
            gates["collecting"].set()
        return await _drained_tree(cluster, tree)

    tasks, reports, hosts = in_cluster(
        nats_server, tmp_path, ("a", "b"), body, brain=_waiting_brain
    )
    assert tasks == ["task_start", "report", "task_end"]
    assert len(reports) == 1 and "merged: collected 3" in reports[0], reports
    assert list(hosts.values()) == ["b", "b", "b"]
