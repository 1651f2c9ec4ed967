"""``session.list`` through any host of a cluster lists the caller's sessions of the whole
cluster (R-CLUSTER-1, R-TREE-1): in-process hosts with their gateways on a real
nats-server (the scaffolding of :mod:`tests.test_cluster_tree_nodes`), real websocket
clients.

* Through host b, alice sees the root she made through host a and its subagent (with
  ``host``, ``parent_id`` and ``root_id``), after her sessions of b, which keep the local
  fields; mallory sees none of them. Through a, the sessions a holds are listed once, as
  on one host, and b's follow. Before, each host listed only its own data dir.
* A directory that cannot be read leaves the local listing whole, with ``cluster`` saying
  why; one longer than the cap is listed in part, and ``cluster`` says so.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from greenroom.actors.cluster import listing
from greenroom.actors.cluster.registry import DirectoryPass, SessionDirectory
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
)
from tests.test_cluster_tree_nodes import Cluster, client, finished_tree, in_cluster, until

LOCAL_FIELDS = {
    "session_id",
    "created_at",
    "updated_at",
    "workspace_dir",
    "provider",
    "model",
    "trace_files",
    "parent_id",
    "root_id",
    "open",
    "busy",
    "auth_locked",
    "title",
    "last_activity_at",
    "state",
    "usage",
}
"""The fields of a session this host's data dir holds, as on one host."""


async def _granted_to(cluster: Cluster, session_id: str, principal: str) -> bool:
    entry = await cluster.entry(session_id)
    return entry is not None and principal in entry["principals"]


def _by_id(listed: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["session_id"]: s for s in listed["sessions"]}


def test_session_list_through_any_host_lists_the_callers_sessions_of_the_cluster(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(cluster: Cluster) -> dict[str, Any]:
        a, b = cluster.members["a"], cluster.members["b"]
        found: dict[str, Any] = {}
        root, child = await finished_tree(cluster, a)
        await until(lambda: _granted_to(cluster, root, "alice"))
        found["ids"] = {"root": root, "child": child}
        async with client(b, "alice") as alice_b, client(b, "mallory") as mallory_b:
            # Host a carries the root: a session created through b stays on b.
            mine_b = (await alice_b.result("session.create"))["session_id"]
            found["ids"]["mine_b"] = mine_b
            await until(lambda: _granted_to(cluster, mine_b, "alice"))
            found["alice_via_b"] = await alice_b.result("session.list")
            found["mallory_via_b"] = await mallory_b.result("session.list")
        async with client(a, "alice") as alice_a:
            found["alice_via_a"] = await alice_a.result("session.list")
        return found

    found = in_cluster(nats_server, tmp_path, ("a", "b"), body)
    root, child, mine_b = (found["ids"][k] for k in ("root", "child", "mine_b"))

    via_b = found["alice_via_b"]
    assert via_b["sessions"][0]["session_id"] == mine_b  # its own first
    assert Counter(s["session_id"] for s in via_b["sessions"]) == {mine_b: 1, root: 1, child: 1}
    assert "cluster" not in via_b
    listed = _by_id(via_b)
    assert set(listed[mine_b]) == LOCAL_FIELDS  # held here: as on one host
    assert listed[mine_b]["usage"] == {"tokens": 0, "cost_usd": 0.0}
    for session_id, parent_id in ((root, None), (child, root)):
        remote = listed[session_id]
        assert remote["host"] == "a"
        assert (remote["parent_id"], remote["root_id"]) == (parent_id, root)
        assert (remote["open"], remote["busy"], remote["state"]) == (False, False, "idle")
        assert remote["usage"] is None
        assert remote["provider"] == "scripted" and isinstance(remote["created_at"], float)
    assert found["mallory_via_b"] == {"sessions": []}

    via_a = found["alice_via_a"]
    assert Counter(s["session_id"] for s in via_a["sessions"]) == {mine_b: 1, root: 1, child: 1}
    listed = _by_id(via_a)
    for session_id in (root, child):  # held by a's data dir and the directory: a's entry
        assert set(listed[session_id]) == LOCAL_FIELDS
    assert listed[child]["parent_id"] == root and listed[child]["root_id"] == root
    assert listed[mine_b]["host"] == "b"
    assert via_a["sessions"][-1]["session_id"] == mine_b  # other hosts' last


def test_session_list_says_when_the_cluster_was_not_read_whole(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(cluster: Cluster) -> dict[str, Any]:
        b = cluster.members["b"]
        found: dict[str, Any] = {}
        async with client(b, "alice") as alice_b:
            made = [(await alice_b.result("session.create"))["session_id"] for _ in range(2)]
            for session_id in made:
                await until(lambda: _granted_to(cluster, session_id, "alice"))  # noqa: B023
            found["made"] = made
            monkeypatch.setattr(listing, "PASS_REUSE_S", 0.0)  # each call its own pass
            monkeypatch.setattr(listing, "MAX_DIRECTORY_ENTRIES", 1)
            found["capped"] = await alice_b.result("session.list")
            monkeypatch.setattr(listing, "MAX_DIRECTORY_ENTRIES", 10_000)
            names = cluster.conn.names
            await cluster.conn.call(cluster.conn.js.delete_key_value(names.sessions))
            found["unavailable"] = await alice_b.result("session.list")
        return found

    found = in_cluster(nats_server, tmp_path, ("b",), body)
    for answer in ("capped", "unavailable"):
        listed = found[answer]
        assert sorted(s["session_id"] for s in listed["sessions"]) == sorted(found["made"])
        assert all(set(s) == LOCAL_FIELDS for s in listed["sessions"])
    assert found["capped"]["cluster"].startswith("partial: only the first 1 entries")
    assert found["unavailable"]["cluster"].startswith("unavailable: cannot list bucket")


class _CountedDirectory:
    """A directory whose every pass is counted, and held until the test lets it end."""

    def __init__(self) -> None:
        self.passes = 0
        self.release = trio.Event()

    async def entries(self, *, limit: int) -> DirectoryPass:
        self.passes += 1
        await self.release.wait()
        return DirectoryPass(entries={f"s{self.passes}": {"principals": ["alice"]}})


def test_one_directory_pass_answers_a_gateways_calls_for_a_second() -> None:
    """A console asks for its list at each burst of outputs, and each pass over the
    directory reads every entry of the cluster: the calls during a pass wait for it, a
    pass answers the calls of the next :data:`PASS_REUSE_S`, then a new one is made."""

    async def main() -> list[Any]:
        directory = _CountedDirectory()
        passes = listing.DirectoryPasses(cast(SessionDirectory, directory))
        read: list[Any] = []

        async def one() -> None:
            read.append(sorted((await passes.read()).entries))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            directory.release.set()
        await trio.sleep(listing.PASS_REUSE_S / 2)
        await one()
        await trio.sleep(listing.PASS_REUSE_S)
        await one()
        return [*read, directory.passes]

    clock = trio.testing.MockClock(autojump_threshold=0)
    assert trio.run(main, clock=clock) == [["s1"], ["s1"], ["s1"], ["s1"], ["s2"], 2]
