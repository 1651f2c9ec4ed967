"""A background subagent's answer on its way to a parent whose host closes or drains
(R-TREE-2, R-TREE-4, R-DRAIN-2): in-process hosts on a real nats-server, as in
:mod:`tests.test_cluster_tree_nodes` (whose cluster, brains and waits these tests share).

Takeovers are driven by hand (the lease TTL is too long for an orphan scan to run within
a test), so which host takes which session is the test's choice."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio
import trio.testing

from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.routing import SessionRequests
from greenroom.actors.cluster.tree_link import ParentLink
from greenroom.actors.runtime.errors import SessionClosed, SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.protocols.people import PEOPLE
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
)
from tests.test_cluster_tree_nodes import (
    BOUND_S,
    Cluster,
    _keyed_hold,
    _merged,
    _paying_brain,
    _until_the_payer_asks,
    _until_the_payer_waits,
    client,
    in_cluster,
    until,
)
from tests.test_subagents_tree import open_ids

REPORT_RETRY_S = 0.5
"""The longest wait between two offers of a report (a cluster host's is TTL / 2): the
offers go on for about 8 s, well past the closing host's stop and the takeover."""


async def test_an_answer_for_a_reopened_parent_that_closes_meanwhile_is_offered_again() -> None:
    """R-TREE-2, R-TREE-4: a parent no host owns is opened here for its child's answer;
    when its close (or its work's end) began meanwhile, it refuses the answer for now.
    That refusal left the link and the answer was lost, logged; the link now says the
    answer is to be offered again, as for a parent with no owner."""
    taken: list[str] = []

    class NoOwner:
        async def request(self, session_id: str, message: Any, *, timeout_s: float) -> Any:
            raise ClusterUnavailable("no host owns it")

    class ClosingParent:
        async def take(self, parent_id: str, child_id: str, text: str, approve: Any) -> None:
            taken.append(parent_id)
            raise SessionClosed(f"session {parent_id} takes no work while its close ends")

    async def reopened(session_id: str) -> bool:
        return True

    host = cast(Host, SimpleNamespace(child_reports=ClosingParent()))
    link = ParentLink(cast(SessionRequests, NoOwner()), host, PEOPLE, reopen=reopened)
    assert await link.send("parent", "child", "the answer") is False
    assert taken == ["parent"]

    class DeletedParent:
        async def take(self, parent_id: str, child_id: str, text: str, approve: Any) -> None:
            raise SessionNotFound(f"no session {parent_id}")

    # Deleted meanwhile: refused for good, logged as its owner's refusal is (not raised).
    host = cast(Host, SimpleNamespace(child_reports=DeletedParent()))
    link = ParentLink(cast(SessionRequests, NoOwner()), host, PEOPLE, reopen=reopened)
    assert await link.send("parent", "child", "the answer") is True


def test_an_answer_refused_by_its_parents_closing_host_reaches_the_parents_next_owner(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-TREE-4: the root (idle) runs on host c, its background payer on host b
    (each taken over there from host a, which stopped). c stops; once c's host has closed,
    while c still answers the root's requests (before it releases its leases), the payer
    is answered and sends its answer to the root there: c refuses it, the host closed. c
    then stops and b takes the root over: the answer is offered again, reaches the root
    on b, and the root merges it. Before, c's refusal ('the owner failed: the host is
    closed') was logged and the answer lost."""
    take = ParentLink.take

    async def body(cluster: Cluster) -> list[Any]:
        a, b, c = (cluster.members[host_id] for host_id in ("a", "b", "c"))
        async with client(a, "alice") as alice_a:
            root, asked, _ = await _until_the_payer_asks(alice_a)
        payer, call_id = asked["session_id"], asked["call_id"]
        a.stop.set()
        await a.stopped.wait()
        for member, session_id in ((c, root), (b, payer)):
            entry = await cluster.entry(session_id)
            assert entry is not None
            assert await member.node._take_entry(session_id, entry)
        b.host.child_reports.retry_s = REPORT_RETRY_S

        host_closed, refused = trio.Event(), trio.Event()
        replies: list[Any] = []
        release_all = c.node.release_all

        async def release_once_refused() -> None:
            host_closed.set()
            await refused.wait()
            await release_all()

        async def take_on_c_recorded(
            self: ParentLink, session_id: str, params: dict[str, Any]
        ) -> dict[str, Any]:
            if self._host is not c.host:
                return await take(self, session_id, params)
            try:
                reply = await take(self, session_id, params)
            except Exception as exc:  # what the request's server answers for it
                replies.append(f"raised {exc!r}")
                raise
            finally:
                refused.set()
            replies.append(reply)
            return reply

        monkeypatch.setattr(c.node, "release_all", release_once_refused)
        monkeypatch.setattr(ParentLink, "take", take_on_c_recorded)
        c.stop.set()
        await host_closed.wait()
        assert not c.host.is_open()
        await b.host.answer_approval(payer, call_id, "allow")
        await c.stopped.wait()
        entry = await cluster.entry(root)
        assert entry is not None
        assert await b.node._take_entry(root, entry)
        await until(lambda: _merged(cluster, root))
        return replies

    (reply,) = in_cluster(nats_server, tmp_path, ("a", "b", "c"), body)
    assert reply["error"]["data"] == {"outcome": "not_done"}, reply
    assert "the host is closed" in reply["error"]["message"], reply


def test_a_tree_not_at_rest_within_the_grace_stays_until_its_host_stops(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-DRAIN-2, R-TREE-2: host a drains while the payer's own call and its background
    collector's call run; the payer's call is let go and its task is held at its
    boundary, the collector's never is. The payer's hand-over waits for its tree to come
    to rest; the grace ends first (the drain cancelled, as its grace's end cancels it):
    nothing is handed over, the payer alone least of all, and the three stay a's, open
    there. Once a stops, the orphan scan of b takes the whole tree over."""

    async def body(cluster: Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
        a, b = cluster.members["a"], cluster.members["b"]
        hold, started, gates = _keyed_hold()
        collecting = (hold, started["collecting"])
        tree = await _until_the_payer_waits(a, tmp_path, collecting, _paying_brain)
        root, payer, _ = tree
        await started["paying"].wait()

        async def payer_held_and_gathered() -> bool:
            if payer not in open_ids(a.host):
                return True  # handed over (alone): the assertions below say so
            return a.host.port(payer).held and root in a.node._gathering

        async with trio.open_nursery() as nursery:
            grace = trio.CancelScope()

            async def drain() -> None:
                with grace:
                    await a.host.drain(BOUND_S)

            nursery.start_soon(drain)
            await trio.testing.wait_all_tasks_blocked()
            assert a.host.draining
            gates["paying"].set()
            await until(payer_held_and_gathered)
            grace.cancel()
        at_the_graces_end = {
            sid: (await cluster.holder(sid), a.node.serves(sid), sid in open_ids(a.host))
            for sid in tree
        }
        a.stop.set()
        await a.stopped.wait()
        orphans = await b.node._finder.look()
        await b.node._take_entries(orphans)
        after_the_scan = {sid: (await cluster.holder(sid), sorted(orphans)) for sid in tree}
        return at_the_graces_end, after_the_scan

    at_the_graces_end, after_the_scan = in_cluster(
        nats_server, tmp_path, ("a", "b"), body, brain=_paying_brain
    )
    assert list(at_the_graces_end.values()) == [("a", True, True)] * 3, at_the_graces_end
    taken = sorted(after_the_scan)
    assert list(after_the_scan.values()) == [("b", taken)] * 3, after_the_scan
