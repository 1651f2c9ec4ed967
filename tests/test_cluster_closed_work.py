"""A session closed on a cluster host while its trace leaves work for a take-up — a run
accepted and not started (a prompt without its ``task_start``), follow-ups recorded as
queued — stays that host's, as one closed while its task waits for people does
(R-CLUSTER-2, R-STEER-6, R-HITL-4): once the host is lost it is an orphan, and the host
that takes it over runs that work. In-process hosts on a real nats-server
(:mod:`tests.test_cluster_tree_nodes`); the takeover is driven by hand, as there.

The trace is one a host left when it stopped right after a record (``cut_after``), written
to JetStream as that host's, fenced (host ``x``); host b holds a copy of it, as a host that
took it over would, and a program there loads it (nothing is taken up by a load) and
closes it. Before, the close was reported to the cluster as that of a session with no
work (only an open task counted): its entry written closed and its claim released, so no
orphan scan and no takeover ever ran the accepted run or the queued follow-up."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, Gates, allow_all, cut_after, open_host

from greenroom.actors.cluster.orphans import OrphanFinder
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import TaskEnd, UserMsg
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
)
from tests.test_cluster_tree_nodes import Cluster, in_cluster, until

Cut = Callable[[dict[str, Any]], bool]


def _answer(request: ModelRequest) -> Reply:
    """The model of every session the cluster's hosts run: it answers at once."""
    return Reply(blocks=(text("done"),))


async def _stored_with_work_left(data_dir: Path, workspace: Path, cut: Cut) -> Path:
    """On a single host, a task (held in the tool call ``wait``) and a follow-up queued
    during it, both run to their end; then the trace is cut after the first record for
    which ``cut`` holds. Returns the session's directory."""
    gates = Gates()
    replies = [
        Reply(blocks=(tool_call("c1", "wait", key="a"),)),
        Reply(blocks=(text("first done"),)),
        Reply(blocks=(text("second done"),)),
    ]
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=ScriptedProvider(replies), tools=[gates.tool()], workspace_dir=workspace
        )
        with trio.fail_after(RUN_TIMEOUT_S):
            session.run("first", approve=allow_all).detach()
            await gates.started("a")
            assert session.follow_up("second")
            gates.release("a")
            await session.wait_idle()
    cut_after(session.trace_path, cut)
    return session.directory


def _accepted_run(record: dict[str, Any]) -> bool:
    return record["type"] == "user_msg"


def _queued_follow_up(record: dict[str, Any]) -> bool:
    return record["type"] == "task_end"


@pytest.mark.parametrize(
    ("cut", "prompts"),
    [(_accepted_run, ["first"]), (_queued_follow_up, ["first", "second"])],
    ids=["accepted-run", "queued-follow-up"],
)
def test_work_a_closed_session_left_is_taken_up_after_its_host_is_lost(
    tmp_path: Path, nats_server: NatsProcess, cut: Cut, prompts: list[str]
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    stored = trio.run(_stored_with_work_left, tmp_path / "single", workspace, cut)
    session_id = stored.name

    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b = cluster.members["a"], cluster.members["b"]
        writer = await cluster.traces.fence(session_id, "x")
        trace = next(stored.glob("trace_*.jsonl"))
        await writer.append(trace.read_text("utf-8").splitlines(keepends=True))
        shutil.copytree(stored, b.host.data_dir / "sessions" / session_id)

        await b.host.load_session(session_id)
        await until(lambda: _owned_by(cluster, session_id, "b"))
        await b.host.close_session(session_id)
        kept_by_b = b.node.serves(session_id)
        b.stop.set()
        await b.stopped.wait()

        finder = OrphanFinder(cluster.directory, cluster.owners, lambda _sid: False)
        orphans = await finder.look()
        taken = session_id in orphans and await a.node._take_entry(session_id, orphans[session_id])
        if taken:
            await a.host.get_session(session_id).wait_idle()
            assert a.node.store is not None and await a.node.store.log.settled(session_id)
        records = (await cluster.traces.read(session_id)).records
        return {"kept_by_b": kept_by_b, "orphan": session_id in orphans, "records": records}

    found = in_cluster(nats_server, tmp_path, ("a", "b"), body, brain=_answer)
    assert found["kept_by_b"], "the close released a session that left work"
    assert found["orphan"], "the session was closed in the cluster: no host takes it over"
    records = found["records"]
    started = [r for r in records if isinstance(r, UserMsg) and r.kind == "prompt"]
    texts = [b.text for r in started for b in r.content if isinstance(b, TextBlock)]
    assert texts == prompts
    ends = [r.status for r in records if isinstance(r, TaskEnd)]
    assert ends == ["completed"] * len(prompts)
    assert isinstance(records[-1], TaskEnd)


async def _owned_by(cluster: Cluster, session_id: str, host_id: str) -> bool:
    """Whether ``host_id`` holds ``session_id`` and its directory entry is open."""
    entry = await cluster.entry(session_id)
    open_entry = entry is not None and not entry.get("closed")
    return open_entry and await cluster.holder(session_id) == host_id
