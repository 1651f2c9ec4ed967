"""The outputs of a subagent that runs on another host than its parent reach the
parent's watchers, and so the root's, with their ``origin`` (R-TREE-1, R-TREE-4,
R-CLUSTER-2): in-process hosts on a real nats-server, as in
:mod:`tests.test_cluster_tree_takeover` (whose tree and ``hold`` tool these tests share).

A lost host's tree is split by hand, as a takeover one host at a time may split it: b
takes the root and the payer over, c the collector (and its own background child). A
watcher of the root on b sees the records of the subagents that run on c as c writes
them — each once, none of those written before the takeover, with each one's own path
from the root — through b's relay of their traces in JetStream; and each once still when
the collector comes to b. Before, it saw nothing of them until the collector's answer
came to the payer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.traces import Records, TraceStream
from greenroom.actors.providers.scripted import Reply
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd, ToolCallOutput, UserMsg
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
)
from tests.test_cluster_tree_nodes import (
    Cluster,
    _lose,
    _task_ended,
    _until_the_payer_waits,
    in_cluster,
    until,
)
from tests.test_cluster_tree_takeover import (
    COLLECTOR_FINISHED,
    Holds,
    _brain_holding,
    _holding,
    _lost_with_the_counter,
)


async def _lost_with_a(
    cluster: Cluster, holds: Holds, brain: Callable[[ModelRequest], Reply], tmp_path: Path
) -> tuple[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """Host a runs ``brain``'s tree until the payer waits for its background collector,
    whose first call holds; then a is lost. The tree (root, payer, collector) and each
    node's entry as a left it."""
    a = cluster.members["a"]
    held = (holds.tool(), holds.started["collect-1"])
    tree = await _until_the_payer_waits(a, tmp_path, held, brain)
    await _lose(cluster, a, *tree)
    return tree, {sid: await cluster.entry(sid) or {} for sid in tree}


async def _root_and_payer_to_b(
    cluster: Cluster, holds: Holds, root: str, payer: str, entries: dict[str, dict[str, Any]]
) -> None:
    """b takes the root and the payer over from their ``entries``, and the payer's task
    runs there, open throughout: its second call holds."""
    b = cluster.members["b"]
    assert await b.node._take_entries({sid: entries[sid] for sid in (root, payer)})
    await holds.started["pay-2"].wait()


def _watched_on_b(cluster: Cluster, root: str) -> trio.MemoryReceiveChannel[list[Output]]:
    """What a watcher of the root on b gets."""
    # Unbounded: the test reads it to the end, and the root's publisher never waits.
    send, inbox = trio.open_memory_channel[list[Output]](math.inf)
    cluster.members["b"].host.get_session(root).watch(send)
    return inbox


async def _collector_to_c(
    cluster: Cluster, holds: Holds, collector: str, entries: dict[str, dict[str, Any]]
) -> int:
    """c takes the collector over from its ``entries``, where it holds its second call:
    the seq of the last record it wrote on a."""
    written_on_a = (await cluster.traces.read(collector)).records[-1].seq or 0
    assert await cluster.members["c"].node._take_entries({collector: entries[collector]})
    await holds.started["collect-2"].wait()
    return written_on_a


async def _split_and_watched(
    cluster: Cluster, holds: Holds, brain: Callable[[ModelRequest], Reply], tmp_path: Path
) -> tuple[tuple[str, str, str], trio.MemoryReceiveChannel[list[Output]], int]:
    """a's tree, a lost, split as a takeover one host at a time may split it: b runs the
    root and the payer, c the collector, each holding its second call. The tree, what a
    watcher of the root on b gets (from before c took the collector over) and the seq of
    the collector's last record written on a."""
    tree, entries = await _lost_with_a(cluster, holds, brain, tmp_path)
    root, payer, collector = tree
    await _root_and_payer_to_b(cluster, holds, root, payer, entries)
    inbox = _watched_on_b(cluster, root)
    return tree, inbox, await _collector_to_c(cluster, holds, collector, entries)


def test_a_watcher_of_the_root_sees_a_subagent_that_runs_on_another_host(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-1, R-TREE-4: a runs the tree (the payer and its background collector each
    hold a call) and is lost; b takes the root and the payer over (the payer holds its
    next call there), then c the collector, which holds its next call there and answers
    once let go. A watcher of the root on b gets the collector's records from c, tagged
    with the collector's path from the root: its ``hold`` call, its answer and its
    ``task_end``, every record c wrote, in order, each once, and none it wrote on a.
    Before, the watcher got none of them: b knew nothing of a subagent running on c, and
    the test ran out of time waiting."""
    holds = Holds()

    async def body(cluster: Cluster) -> dict[str, Any]:
        tree, inbox, written_on_a = await _split_and_watched(cluster, holds, brain, tmp_path)
        collector = tree[-1]
        holds.gates["collect-2"].set()
        seen: list[Output] = []
        async for batch in inbox:
            seen += [o for o in batch if o.origin == tree]
            if any(isinstance(o, TaskEnd) for o in seen):
                break
        traced = (await cluster.traces.read(collector, after_seq=written_on_a)).records
        return {"seen": seen, "written_on_a": written_on_a, "traced": traced}

    brain = _brain_holding(pays=2, collects=2)
    found = in_cluster(nats_server, tmp_path, ("a", "b", "c"), body, **_holding(brain, holds))
    seen: list[Output] = found["seen"]
    seqs = [o.seq or 0 for o in seen]
    assert seqs == sorted(set(seqs)), seqs  # in order, each once
    assert min(seqs) > found["written_on_a"], (seqs, found["written_on_a"])
    assert seqs == [r.seq for r in found["traced"]]  # every record written on c
    blocks = [o.block for o in seen if isinstance(o, ModelMsg)]
    calls = [b.arguments for b in blocks if isinstance(b, ToolCallBlock)]
    assert calls == [{"key": "collect-2"}], calls
    assert len([o for o in seen if isinstance(o, ToolCallOutput)]) == 2, seen  # both results
    said = [b.text for b in blocks if isinstance(b, TextBlock)]
    assert said == ["collected 3"], said
    ends = [o.status for o in seen if isinstance(o, TaskEnd)]
    assert ends == ["completed"], ends


def test_a_subagent_that_comes_to_its_parents_host_is_seen_once(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-1, R-CLUSTER-2: as above, the collector runs on c while b runs the root and
    the payer, and holds a call there; then c is lost too and b, the payer's host, takes
    the collector over, where it holds a third call and answers. The root's watcher on b
    sees every record the collector wrote on c and on b, in order, each once: b's relay
    of its trace hands up what it wrote before it came to b, and its own forwarder what
    it writes on b. Had the relay gone on, every record written on b came twice."""
    holds = Holds()

    async def body(cluster: Cluster) -> dict[str, Any]:
        tree, inbox, written_on_a = await _split_and_watched(cluster, holds, brain, tmp_path)
        collector = tree[-1]
        seen: list[Output] = []

        async def until_seen(key: str) -> None:
            async for batch in inbox:
                seen.extend(o for o in batch if o.origin == tree and o.seq is not None)
                blocks = [o.block for o in seen if isinstance(o, ModelMsg)]
                if {"key": key} in [b.arguments for b in blocks if isinstance(b, ToolCallBlock)]:
                    return

        await until_seen("collect-2")  # relayed from c
        b, c = (cluster.members[h] for h in ("b", "c"))
        await _lose(cluster, c, collector)
        entry = await cluster.entry(collector) or {}
        assert await b.node._take_entries({collector: entry})
        await holds.started["collect-3"].wait()
        holds.gates["collect-3"].set()
        async for batch in inbox:
            seen.extend(o for o in batch if o.origin == tree and o.seq is not None)
            if any(isinstance(o, TaskEnd) for o in seen):
                break
        traced = (await cluster.traces.read(collector, after_seq=written_on_a)).records
        return {"seen": seen, "traced": traced}

    brain = _brain_holding(pays=2, collects=3)
    found = in_cluster(nats_server, tmp_path, ("a", "b", "c"), body, **_holding(brain, holds))
    seqs = [o.seq for o in found["seen"]]
    assert seqs == [r.seq for r in found["traced"]], seqs  # in order, each once, no gap
    ends = [o.status for o in found["seen"] if isinstance(o, TaskEnd)]
    assert ends == ["completed"], ends


def test_a_grandchild_that_runs_on_another_host_reaches_the_root_through_its_parent(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-TREE-1, R-TREE-4: a runs the tree with the collector's background counter, and is
    lost; b takes the root and the payer over, c the collector and the counter, each of
    which holds a call there and answers once let go (the counter's answer comes into the
    collector's task on c). The root's watcher on b gets every record both wrote on c,
    each with its own path from the root, in order, each once: b relays each of them to
    the payer, the node open on b whose child runs elsewhere; c's forwarding of the
    counter's outputs to the collector is live only and never reaches b. Before, none."""
    holds = Holds()

    async def body(cluster: Cluster) -> dict[str, Any]:
        c = cluster.members["c"]
        tree, entries = await _lost_with_the_counter(cluster, holds, brain, tmp_path)
        root, payer, collector, counter = tree
        await _root_and_payer_to_b(cluster, holds, root, payer, entries)
        inbox = _watched_on_b(cluster, root)
        written_on_a = {
            sid: (await cluster.traces.read(sid)).records[-1].seq or 0
            for sid in (collector, counter)
        }
        assert await c.node._take_entries({sid: entries[sid] for sid in (collector, counter)})
        await holds.started["collect-2"].wait()
        await holds.started["count-2"].wait()
        holds.gates["count-2"].set()
        holds.gates["collect-2"].set()
        paths = {collector: (root, payer, collector), counter: tree}
        seen: dict[str, list[Output]] = {collector: [], counter: []}
        async for batch in inbox:
            for sid, path in paths.items():
                seen[sid] += [o for o in batch if o.origin == path]
            if all(any(isinstance(o, TaskEnd) for o in outs) for outs in seen.values()):
                break
        traced = {
            sid: (await cluster.traces.read(sid, after_seq=written_on_a[sid])).records
            for sid in seen
        }
        return {"seen": seen, "traced": traced}

    brain = _brain_holding(pays=2, collects=2, counts=2)
    found = in_cluster(nats_server, tmp_path, ("a", "b", "c"), body, **_holding(brain, holds))
    for sid, outputs in found["seen"].items():
        seqs = [o.seq for o in outputs]
        assert seqs == [r.seq for r in found["traced"][sid]], (sid, seqs)
        assert [o.status for o in outputs if isinstance(o, TaskEnd)] == ["completed"]


def test_a_relay_that_nats_fails_is_logged_and_the_tree_goes_on(
    tmp_path: Path,
    nats_server: NatsProcess,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """R-TREE-1, R-CLUSTER-2: as in the first test, but b cannot read the collector's
    trace (NATS fails the relay as it begins). b logs that it cannot relay the
    collector's outputs and goes on: the collector's answer still comes into the payer's
    task on b (taken in by its request after its held call), and the root runs on there.
    Before, the failure left the relay in an exception group that no handler caught, and
    b's cluster side stopped with it."""
    holds = Holds()

    @contextlib.asynccontextmanager
    async def failing_follow(
        self: TraceStream, session_id: str, *, after_seq: int = 0
    ) -> AsyncIterator[Records]:
        raise ClusterUnavailable(f"the test's failure to read {session_id}")
        yield  # an async generator, as the real one is

    async def body(cluster: Cluster) -> bool:
        b, c = (cluster.members[h] for h in ("b", "c"))
        tree, entries = await _lost_with_a(cluster, holds, brain, tmp_path)
        root, payer, collector = tree
        await _root_and_payer_to_b(cluster, holds, root, payer, entries)
        monkeypatch.setattr(TraceStream, "follow", failing_follow)
        assert await c.node._take_entries({collector: entries[collector]})
        await holds.started["collect-2"].wait()
        holds.gates["collect-2"].set()
        await until(lambda: _task_ended(cluster, collector))
        holds.gates["pay-2"].set()  # the payer's next request takes the answer in

        async def reported() -> bool:
            records = (await cluster.traces.read(payer)).records
            return any(
                isinstance(r, UserMsg) and COLLECTOR_FINISHED in str(r.content) for r in records
            )

        await until(reported)
        return root in {s.id for s in b.host.sessions}

    brain = _brain_holding(pays=2, collects=2)
    root_open_on_b = in_cluster(
        nats_server, tmp_path, ("a", "b", "c"), body, **_holding(brain, holds)
    )
    assert root_open_on_b
    assert "cannot relay the outputs of subagent" in capsys.readouterr().err
