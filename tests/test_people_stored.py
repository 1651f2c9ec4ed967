"""The requests waiting in stored sessions, as approvals.list reads them per request
(R-HITL-2, R-PROTO): a stored session's trace is read again only once it changed, and
what it lists is never older than its trace."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
from conftest import RUN_TIMEOUT_S
from test_people import Ledger, until_parked

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.people import StoredPending
from greenroom.actors.runtime.trace_store import LoadedTrace
from greenroom.protocols.people import PEOPLE


def pay_twice() -> list[Reply]:
    """Two payments, each asked of a person, then the answer."""
    return [
        Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7))),
        Reply(blocks=(text("Once more."), tool_call("p2", "pay", amount=8))),
        Reply(blocks=(text("Done."),)),
    ]


def count_trace_reads(host: Host, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The session ids of every latest-trace read the host's store makes from now on."""
    reads: list[str] = []
    read_latest: Callable[[str], Awaitable[LoadedTrace]] = host.trace_store.log.read_latest

    async def counted(session_id: str) -> LoadedTrace:
        reads.append(session_id)
        return await read_latest(session_id)

    monkeypatch.setattr(host.trace_store.log, "read_latest", counted)
    return reads


async def parked_and_closed(host: Host, workspace: Path, ledger: Ledger) -> str:
    """A stored session whose task waits for a person to allow call p1."""
    session = await host.create_session(
        provider=ScriptedProvider(pay_twice()[:1]), tools=[ledger.tool], workspace_dir=workspace
    )
    session.run("pay", approve=PEOPLE).detach()
    await until_parked(host, session.id)
    await host.close_session(session.id)
    return session.id


async def test_a_stored_sessions_trace_is_read_again_only_once_it_changed(
    host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HITL-2, R-PROTO: listing read-only twice with nothing changed reads no trace the
    second time; an answer recorded drops its request, a new one recorded shows, and a
    session deleted lists nothing."""
    with trio.fail_after(RUN_TIMEOUT_S):
        ledger = Ledger()
        sid = await parked_and_closed(host, workspace, ledger)
        reads = count_trace_reads(host, monkeypatch)
        assert [p.call_id for p in await host.pending_approvals(read_only=True)] == ["p1"]
        reads.clear()
        assert [p.call_id for p in await host.pending_approvals(read_only=True)] == ["p1"]
        assert reads == []

        await host.load_session(
            sid, tools=[ledger.tool], provider=ScriptedProvider(pay_twice()[1:])
        )
        await host.answer_approval(sid, "p1", "allow")
        await until_parked(host, sid)
        await host.close_session(sid)
        assert ledger.paid == [7]
        assert [p.call_id for p in await host.pending_approvals(read_only=True)] == ["p2"]
        reads.clear()
        assert [p.call_id for p in await host.pending_approvals(read_only=True)] == ["p2"]
        assert reads == []

        await host.delete_session(sid)
        assert await host.pending_approvals(read_only=True) == []


async def test_what_is_remembered_follows_the_trace_and_the_sessions_asked_for(
    host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HITL-2: the trace of a session changed while it was remembered (here by the host
    that loaded it) is read again, an answered request gone and the new one shown; a
    session deleted, or no longer asked for, is forgotten."""
    with trio.fail_after(RUN_TIMEOUT_S):
        ledger = Ledger()
        sid = await parked_and_closed(host, workspace, ledger)
        other = await parked_and_closed(host, workspace, Ledger())
        store, stored = host.trace_store, StoredPending()
        reads = count_trace_reads(host, monkeypatch)
        assert [p.call_id for p in await stored.read(store, [sid])] == ["p1"]
        assert reads == [sid]

        await host.load_session(
            sid, tools=[ledger.tool], provider=ScriptedProvider(pay_twice()[1:])
        )
        await host.answer_approval(sid, "p1", "allow")
        await until_parked(host, sid)
        assert [(p.session_id, p.call_id) for p in await stored.read(store, [sid, other])] == [
            (sid, "p2"),
            (other, "p1"),
        ]
        reads.clear()
        await stored.read(store, [sid, other])
        assert reads == [] and len(stored) == 2

        await host.answer_approval(sid, "p2", "allow")
        await host.get_session(sid).wait_idle()
        assert ledger.paid == [7, 8]
        assert [p.session_id for p in await stored.read(store, [sid, other])] == [other]

        await host.delete_session(other)
        assert await stored.read(store, [sid, other]) == [] and len(stored) == 1
        assert await stored.read(store, []) == [] and len(stored) == 0
