"""Admission in a running host (R-SHARE-1, R-SHARE-2): the sessions of a host that share a
provider endpoint share its admission — a 429 with ``retry-after`` pauses the others'
requests (over the real anthropic SDK and the loopback mock server, no limits
configured), a wait before an attempt is never a failed attempt, an interrupt ends a wait
at once, a long compaction holds one place only, and subagents are admitted for their
parent's principal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, Recorder, collect, last_user, of_type, texts_of

from greenroom import ProviderLimits
from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, ScriptedStream, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.supervisor import ABORT_GRACE_S
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import (
    CompactionEnd,
    Output,
    RequestBegin,
    RequestEnd,
    TaskEnd,
)
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.stream import ModelError
from tests.support.mock_model_server import Reply as WireReply
from tests.support.mock_model_server import Text, WireError, open_mock_server


def prompt_of(request: ModelRequest) -> str:
    return " ".join(texts_of(request.messages[0]))


@asynccontextmanager
async def host_with(data_dir: Path, limits: ProviderLimits | None = None) -> AsyncIterator[Host]:
    async with Host.open(data_dir, limits=limits) as host:
        yield host


async def test_a_429_with_retry_after_pauses_the_other_sessions_of_the_endpoint(
    tmp_path: Path,
) -> None:
    """R-SHARE-1, with no limits configured: session A's request gets a 429 with
    ``retry-after: 1``; session B starts a task after it. B's request reaches the server
    only when the endpoint's pause ends, as does A's retry; B's wait is no failed attempt
    (one request, attempt 1, ok) and the server refuses nothing else."""
    limited = WireError(429, "rate_limit_error", "slow down", headers={"retry-after": "1"})
    async with open_mock_server(limited, WireReply([Text("a")]), WireReply([Text("b")])) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key="k")
        try:
            async with host_with(tmp_path / "data") as host:
                a = await host.create_session(provider=provider, workspace_dir=tmp_path)
                b = await host.create_session(provider=provider, workspace_dir=tmp_path)
                recorder = Recorder(a)
                with trio.fail_after(RUN_TIMEOUT_S):
                    async with trio.open_nursery() as nursery:
                        ran: dict[str, list[Output]] = {}

                        async def run(name: str, session: Session, prompt: str) -> None:
                            ran[name] = await collect(session.run(prompt))

                        nursery.start_soon(run, "a", a, "from a")
                        await recorder.wait_for("request_end", attempt=1)
                        nursery.start_soon(run, "b", b, "from b")
        finally:
            await provider.aclose()
    refused, *later = server.requests
    assert len(later) == 2
    assert all(r.received_at >= refused.received_at + 1.0 for r in later)
    assert [(e.attempt, e.status, e.retry_in_ms) for e in of_type(ran["a"], RequestEnd)] == [
        (1, "timeout", 1000), (2, "ok", None)
    ]
    assert [(e.attempt, e.status) for e in of_type(ran["b"], RequestEnd)] == [(1, "ok")]
    assert [e.status for e in of_type(ran["b"], TaskEnd)] == ["completed"]


async def test_a_wait_before_an_attempt_is_no_failed_attempt_however_long(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """R-SHARE-2: the endpoint is paused for 100 s (a 429 of another session) — longer
    than the whole retry ladder. A task started meanwhile waits, its request goes when
    the pause ends, and it completes in attempt 1: the wait used up no retry."""
    arrivals: list[tuple[str, float]] = []

    def answer(request: ModelRequest) -> Reply:
        arrivals.append((prompt_of(request), trio.current_time()))
        if len(arrivals) == 1:
            limited = ModelError(kind="timeout", message="rate limited (HTTP 429)",
                                 status_code=429, retry_after_s=100.0)
            return Reply(fail=limited)
        return Reply(blocks=(text("ok"),))

    provider = ScriptedProvider(answer)
    async with host_with(tmp_path / "data") as host:
        a = await host.create_session(provider=provider, workspace_dir=tmp_path)
        b = await host.create_session(provider=provider, workspace_dir=tmp_path)
        recorder = Recorder(a)
        run_a = a.run("from a")
        await recorder.wait_for("request_end", attempt=1, bound_s=None)
        paused_at = trio.current_time()
        outputs_b = await collect(b.run("from b"), bound_s=None)
        outputs_a = await collect(run_a, bound_s=None)
    times = dict(arrivals[1:])
    assert times["from b"] - paused_at >= 100.0
    assert times["from a"] - paused_at >= 100.0
    assert [(e.attempt, e.status) for e in of_type(outputs_b, RequestEnd)] == [(1, "ok")]
    assert [b.attempt for b in of_type(outputs_b, RequestBegin)] == [1]
    assert of_type(outputs_b, TaskEnd)[0].status == "completed"
    assert [(e.attempt, e.retry_in_ms) for e in of_type(outputs_a, RequestEnd)] == [
        (1, 100_000), (2, None)
    ]


def holding(release: trio.Event) -> ScriptedProvider:
    """A model whose answers to prompts starting with "hold" wait for ``release``."""

    async def step(request: ModelRequest, stream: ScriptedStream) -> None:
        if prompt_of(request).startswith("hold") or "[summary]" in " ".join(
            texts_of(last_user(request))
        ):
            await release.wait()
            await stream.text("[summary]held[/summary]")
            return
        await stream.text("quick")

    return ScriptedProvider(step)


async def test_an_interrupt_ends_a_wait_for_admission_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """``max_concurrent_requests=1``: A's request holds the place; B's task waits for it.
    Interrupting B ends its task at once (no virtual time passes), aborted, and leaves nothing
    waiting; A's request then finishes, and nothing holds a place."""
    release = trio.Event()
    provider = holding(release)
    async with host_with(tmp_path / "data", ProviderLimits(max_concurrent_requests=1)) as host:
        a = await host.create_session(provider=provider, workspace_dir=tmp_path)
        b = await host.create_session(provider=provider, workspace_dir=tmp_path)
        admission = host.port(a.id).admission
        assert host.port(b.id).admission is admission
        recorders = Recorder(a), Recorder(b)
        run_a = a.run("hold on")
        await recorders[0].wait_for("request_begin", bound_s=None)
        run_b = b.run("quick one")
        await recorders[1].wait_for("request_begin", bound_s=None)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.in_flight == 1 and admission.waiting == 1
        before = trio.current_time()
        b.interrupt("changed my mind")
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting == 0 and trio.current_time() == before
        outputs_b = await collect(run_b, bound_s=None)
        assert trio.current_time() - before <= ABORT_GRACE_S  # the trace's last sync
        assert admission.in_flight == 1
        assert of_type(outputs_b, TaskEnd)[0].status == "aborted"
        assert of_type(outputs_b, RequestEnd)[-1].status == "aborted"
        release.set()
        assert of_type(await collect(run_a, bound_s=None), TaskEnd)[0].status == "completed"
        assert admission.in_flight == 0
    assert len(provider.requests) == 1


async def test_a_long_compaction_holds_one_place_while_short_turns_go_on(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """``max_concurrent_requests=2``: A's manual compaction streams for as long as the test
    likes; meanwhile B runs three tasks one after the other through the other place."""
    release = trio.Event()
    provider = holding(release)
    async with host_with(tmp_path / "data", ProviderLimits(max_concurrent_requests=2)) as host:
        a = await host.create_session(provider=provider, workspace_dir=tmp_path)
        b = await host.create_session(provider=provider, workspace_dir=tmp_path)
        await collect(a.run("first"), bound_s=None)
        ends: list[CompactionEnd | None] = []
        async with trio.open_nursery() as nursery:

            async def compact() -> None:
                ends.append(await a.compact())

            recorder = Recorder(a)
            nursery.start_soon(compact)
            await recorder.wait_for("compaction_begin", bound_s=None)
            await trio.testing.wait_all_tasks_blocked()
            assert host.port(a.id).admission.in_flight == 1
            for n in range(3):
                outputs = await collect(b.run(f"quick {n}"), bound_s=None)
                assert of_type(outputs, TaskEnd)[0].status == "completed"
            assert ends == []
            release.set()
    assert ends[0] is not None and ends[0].status == "ok"


async def test_subagents_are_admitted_for_their_parent_s_principal(tmp_path: Path) -> None:
    """R-SHARE-2: a session's principal is who created it (the gateway's client); its
    subagents count as that principal's sessions and share its endpoint's admission."""
    provider = ScriptedProvider(Reply(blocks=(text("ok"),)))
    async with host_with(tmp_path / "data") as host:
        parent = await host.create_session(provider=provider, workspace_dir=tmp_path,
                                           principal="alice")
        port = host.port(parent.id)
        child = await host.create_child(port, settings=SessionSettings(), tools=[])
        alone = await host.create_session(provider=provider, workspace_dir=tmp_path)
        assert (port.principal, child.principal) == ("alice", "alice")
        assert host.port(alone.id).principal == ""
        assert child.admission is port.admission is host.port(alone.id).admission
        requester = child.requester()
        assert (requester.principal, requester.session_id) == ("alice", child.id)


async def test_the_gateway_admits_a_session_s_requests_for_the_client_that_owns_it(
    tmp_path: Path,
) -> None:
    """R-SHARE-2: sessions created through the gateway are their client's (principal)
    for admission; one the gateway loads again is the loading client's."""
    from test_gateway import BOUND_S, connect, serving

    alice_token, bob_token = "alice-token-0123456789", "bob-token-0123456789ab"
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, tokens={"alice": alice_token, "bob": bob_token}) as server:
            async with connect(server, token=alice_token) as alice:
                sid_alice = (await alice.result("session.create"))["session_id"]
            async with connect(server, token=bob_token) as bob:
                sid_bob = (await bob.result("session.create"))["session_id"]
                await server.host.close_session(sid_bob)
                await bob.result("session.subscribe", {"session_id": sid_bob})
            assert server.host.port(sid_alice).principal == "alice"
            assert server.host.port(sid_bob).principal == "bob"
