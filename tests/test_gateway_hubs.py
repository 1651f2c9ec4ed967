"""The gateway's hubs and the session's client approvals: a gateway that stops makes its
sessions forget the approver it installed, and never one another watcher installed since
(R-ACTOR-1: through ``Session.clear_client_approvals``, not the session's fields)."""

from __future__ import annotations

import math
from pathlib import Path

import trio

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.gateway.hubs import Hubs
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from greenroom.protocols.messages import ClientApprovalMessage


def hubs() -> Hubs:
    return Hubs(approve="ask", on_task_end=None, limits=GatewayLimits())


async def test_a_stopped_gateway_forgets_only_its_own_approver(tmp_path: Path) -> None:
    with trio.fail_after(10):
        async with Host.open(tmp_path / "data") as host:
            provider = ScriptedProvider([Reply(blocks=(text("Hi."),))])
            session = await host.create_session(provider=provider, workspace_dir=tmp_path)
            first, second = hubs(), hubs()
            async with trio.open_nursery() as nursery:
                await nursery.start(first.run)
                await nursery.start(second.run)
                await first.adopt(session)
                later = await second.adopt(session)  # another gateway on the same host, since
                first.release_all()
                assert session.clear_client_approvals(later.approvals), "the later one was removed"

                again = await first.adopt(session)
                first.release_all()
                assert not session.clear_client_approvals(again.approvals), "the approver was kept"
                nursery.cancel_scope.cancel()


async def test_clear_client_approvals_leaves_another_watchers(tmp_path: Path) -> None:
    # Unbounded, like a hub's inbox: nothing is sent on them here.
    mine, _mine = trio.open_memory_channel[ClientApprovalMessage](math.inf)
    theirs, _theirs = trio.open_memory_channel[ClientApprovalMessage](math.inf)
    with trio.fail_after(10):
        async with Host.open(tmp_path / "data") as host:
            provider = ScriptedProvider([Reply(blocks=(text("Hi."),))])
            session = await host.create_session(provider=provider, workspace_dir=tmp_path)
            session.set_client_approvals(theirs)
            assert not session.clear_client_approvals(mine)
            assert session.clear_client_approvals(theirs)
            assert not session.clear_client_approvals(theirs)
