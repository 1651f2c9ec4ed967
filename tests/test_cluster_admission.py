"""The limits hold for every host of a cluster together (R-SHARE-1, R-SHARE-4 across
hosts): two in-process hosts (``open_cluster_host``) on a real nats-server, their sessions
sending to one loopback model server through the anthropic provider (one endpoint, one
key). The first host to send to the endpoint admits for both; the other asks it.

* with ``max_concurrent_requests=2`` on each host, the model server never has more than
  2 requests in flight from the two hosts together;
* a 429 with ``retry-after`` seen by one host pauses the other host's requests (the
  other direction, a host's report of its 429 to the host that admits, is
  ``test_cluster_limits``'s);
* a principal's budget spent on one host stops the principal's next task on the other;
* a place granted while nobody waits is kept by the host that asked, for its next request
  (no round trip), and given back once idle; with a per-minute limit nothing is kept.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import attrs
import pytest
import trio
import trio.testing
from conftest import Recorder, collect, of_type

from greenroom import ProviderLimits
from greenroom.actors.cluster import admission
from greenroom.actors.cluster.admission import Mode, SharedEndpoint
from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import ClusterNames
from greenroom.actors.cluster.leases import Lease
from greenroom.actors.cluster.limits import ClusterLimits
from greenroom.actors.cluster.node import ClusterConfig, open_cluster_host
from greenroom.actors.cluster.spending import SharedSpendLimit
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.actors.runtime.admission import EndpointAdmission
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.outputs import RequestEnd, TaskEnd
from tests.support.mock_model_server import (
    MockModelServer,
    RecordedRequest,
    Reply,
    Text,
    WireError,
)
from tests.support.mock_model_server import open_mock_server as open_model
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
)

LEASE_TTL_S = 2.0
BOUND_S = 60.0
MODEL = "mock-model"

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _anthropic_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # One key for both hosts: the same endpoint and credential.
    monkeypatch.setenv("ANTHROPIC_API_KEY", "cluster-test-key")
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)


def in_cluster(body: Callable[[Bridge], Awaitable[T]]) -> T:
    """Run ``body`` under trio as the NATS bridge's guest, bounded."""

    async def main(bridge: Bridge) -> T:
        with trio.fail_after(BOUND_S):
            return await body(bridge)

    return run(main)


@asynccontextmanager
async def two_hosts(
    bridge: Bridge, url: str, tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[tuple[Host, ClusterLimits], tuple[Host, ClusterLimits]]]:
    """Hosts ``a`` and ``b`` of a cluster of their own (a fresh prefix), each with
    ``options`` (``open_cluster_host``'s), and their shared limits."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    found: list[tuple[Host, ClusterLimits]] = []
    async with AsyncExitStack() as stack:
        for host_id in ("a", "b"):
            limits: list[ClusterLimits] = []
            config = ClusterConfig(
                url=url, host_id=host_id, lease_ttl_s=LEASE_TTL_S, prefix=prefix
            )
            host = await stack.enter_async_context(
                open_cluster_host(
                    bridge, config, tmp_path / host_id, on_limits=limits.append, **options
                )
            )
            found.append((host, limits[0]))
        yield found[0], found[1]


async def session_on(
    host: Host, limits: ClusterLimits, base_url: str, workspace: Path, **options: Any
) -> tuple[Session, SharedEndpoint]:
    """A session of ``host`` on the model server, and its endpoint's admission point
    once it knows who admits."""
    session = await host.create_session(
        provider="anthropic", base_url=base_url, model=MODEL, workspace_dir=workspace,
        max_tokens=100, **options,
    )
    endpoint = host.port(session.id).admission
    assert isinstance(endpoint, SharedEndpoint)
    await endpoint.known()
    return session, endpoint


def test_two_hosts_never_have_more_requests_in_flight_than_the_limit_together(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """Three sessions on each host run at once, each request streaming for 150 ms. Each
    host alone would send its three together; the cluster sends 2 at a time."""

    async def body(bridge: Bridge) -> dict[str, Any]:
        limits = ProviderLimits(max_concurrent_requests=2)
        async with (
            open_model(fallback=lambda _: Reply([Text("done")]), first_token_ms=150) as model,
            two_hosts(bridge, nats_server.url, tmp_path, limits=limits) as (a, b),
        ):
            sessions: list[Session] = []
            endpoints: list[SharedEndpoint] = []
            for host, shared in (a, a, a, b, b, b):
                session, endpoint = await session_on(host, shared, model.base_url, tmp_path)
                sessions.append(session)
                endpoints.append(endpoint)
            ends: list[TaskEnd] = []

            async def one(session: Session) -> None:
                ends.extend(of_type(await collect(session.run("hello"), BOUND_S), TaskEnd))

            async with trio.open_nursery() as nursery:
                for session in sessions:
                    nursery.start_soon(one, session)
            return {
                "modes": sorted({e.mode for e in endpoints}, key=str),
                "asked": endpoints[-1].asked,
                "statuses": [end.status for end in ends],
                "peak": model.peak_streams,
                "requests": model.request_count,
            }

    found = in_cluster(body)
    assert found["peak"] == 2  # never 3 or 4: the two hosts' 2 at once are one 2
    assert found["statuses"] == ["completed"] * 6
    assert found["requests"] == 6
    assert found["modes"] == [Mode.OWNER, Mode.REMOTE]  # a admits for both
    assert found["asked"] == 3  # b's requests were admitted by a


def test_a_429_seen_by_one_host_pauses_the_other_hosts_requests(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """No limits configured. Host a's first request gets a 429 with ``retry-after: 2``;
    host b starts a task once a has seen it. b's request reaches the model server only
    when the endpoint's pause ends (as does a's retry), and b's wait is no failed attempt
    of its own. (a admits for both: the pause is learned where b's request is admitted,
    before a's session hears of the 429, so b's request cannot slip in ahead of it.)"""
    retry_after_s = 2.0

    def model_answer(request: RecordedRequest) -> Reply | WireError:
        if "from a" in str(request.messages) and not refused:
            refused.append(request.received_at)
            return WireError(
                429, "rate_limit_error", "slow down", headers={"retry-after": f"{retry_after_s:g}"}
            )
        arrived.append((str(request.messages), request.received_at))
        return Reply([Text("ok")])

    refused: list[float] = []
    arrived: list[tuple[str, float]] = []

    async def body(bridge: Bridge) -> dict[str, Any]:
        async with (
            open_model(fallback=model_answer) as model,
            two_hosts(bridge, nats_server.url, tmp_path) as (a, b),
        ):
            on_a, endpoint_a = await session_on(*a, model.base_url, tmp_path)
            on_b, endpoint_b = await session_on(*b, model.base_url, tmp_path)
            watch_a = Recorder(on_a)
            ran: dict[str, Any] = {}

            async def run_task(name: str, session: Session, prompt: str) -> None:
                ran[name] = await collect(session.run(prompt), BOUND_S)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_task, "a", on_a, "from a")
                await watch_a.wait_for("request_end", attempt=1, bound_s=BOUND_S)
                nursery.start_soon(run_task, "b", on_b, "from b")
            return {
                "modes": (endpoint_a.mode, endpoint_b.mode),
                "asked": endpoint_b.asked,
                "ran": ran,
            }

    found = in_cluster(body)
    (refused_at,) = refused
    from_a = [at for text, at in arrived if "from a" in text]
    from_b = [at for text, at in arrived if "from b" in text]
    assert len(from_a) == 1 and len(from_b) == 1
    # Not before the pause ends (minus the clock's grain), on either host.
    assert from_b[0] >= refused_at + retry_after_s - 0.05
    assert from_a[0] >= refused_at + retry_after_s - 0.05
    # b's wait was no failed attempt of its own.
    assert [(e.attempt, e.status) for e in of_type(found["ran"]["b"], RequestEnd)] == [(1, "ok")]
    attempts = [(e.attempt, e.status) for e in of_type(found["ran"]["a"], RequestEnd)]
    assert attempts == [(1, "timeout"), (2, "ok")]
    assert found["modes"] == (Mode.OWNER, Mode.REMOTE) and found["asked"] == 1


def test_a_principal_budget_spent_on_one_host_stops_its_next_task_on_another(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """Alice may spend $0.005 a day. Her task on host a costs $0.01 (10,000 input tokens
    at $1 per million); her next task, on host b, where she had spent nothing, ends
    ``budget_exceeded`` before its first request. Bob, on b, is not stopped."""
    budget = PrincipalBudget(usd=0.005, period="day")
    prices = {MODEL: {"input": 1.0, "output": 1.0}}

    async def body(bridge: Bridge) -> dict[str, Any]:
        async with (
            open_model(fallback=lambda _: Reply([Text("ok")], usage=(10_000, 1))) as model,
            two_hosts(
                bridge, nats_server.url, tmp_path, principal_budget=budget, prices=prices
            ) as (a, b),
        ):
            alice_a, _ = await session_on(*a, model.base_url, tmp_path, principal="alice")
            # Her limit on b starts before she spends anything (its later total is heard).
            alice_b, _ = await session_on(*b, model.base_url, tmp_path, principal="alice")
            bob_b, _ = await session_on(*b, model.base_url, tmp_path, principal="bob")
            limit = b[0].port(alice_b.id).account.limits[-1]
            assert isinstance(limit, SharedSpendLimit)
            spent_before = limit.spent_usd
            first = of_type(await collect(alice_a.run("spend"), BOUND_S), TaskEnd)
            # What a spent reaches b through the counter's watch.
            await limit.wait_spent(0.01)
            second = of_type(await collect(alice_b.run("spend again"), BOUND_S), TaskEnd)
            bob = of_type(await collect(bob_b.run("hello"), BOUND_S), TaskEnd)
            return {
                "first": first,
                "second": second,
                "bob": bob,
                "before": spent_before,
                "requests": model.request_count,
            }

    found = in_cluster(body)
    assert [end.status for end in found["first"]] == ["completed"]
    assert found["before"] == 0.0
    (second,) = found["second"]
    assert second.status == "budget_exceeded"
    assert second.turns == 0
    assert "budget of principal 'alice'" in (second.message or ""), second
    assert [end.status for end in found["bob"]] == ["completed"]
    assert found["requests"] == 2  # alice on a, bob on b: none for alice on b


@asynccontextmanager
async def b_asks_a(
    bridge: Bridge, url: str, tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[SharedEndpoint, Session, SharedEndpoint, MockModelServer]]:
    """Hosts a and b (``options`` as :func:`two_hosts`') on a model server that answers
    "ok": a admits for the endpoint (its session knew first); b's session asks a. Yields
    a's admission point, b's session, b's admission point and the model server."""
    async with (
        open_model(fallback=lambda _: Reply([Text("ok")])) as model,
        two_hosts(bridge, url, tmp_path, **options) as (a, b),
    ):
        _, owner = await session_on(*a, model.base_url, tmp_path)
        on_b, endpoint = await session_on(*b, model.base_url, tmp_path)
        yield owner, on_b, endpoint, model


async def observed(condition: Callable[[], bool]) -> None:
    """Return once ``condition`` holds: it is a state another host changes through NATS,
    looked at every 20 ms (bounded by the test's own bound)."""
    while not condition():  # noqa: ASYNC110 (another host changes it: no event here)
        await trio.sleep(0.02)


def test_a_remote_host_keeps_a_place_for_its_next_request(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SHARE-1, R-PERF-2. No limits configured: a admits for both. The places b asks a
    for are kept when their requests end (a still counts them in flight), and b's next
    task takes them without asking. (Kept here for as long as the test runs.)"""
    monkeypatch.setattr(admission, "KEEP_IDLE_S", 600.0)
    monkeypatch.setattr(admission, "KEEP_FOR_S", 600.0)

    async def body(bridge: Bridge) -> dict[str, Any]:
        async with b_asks_a(bridge, nats_server.url, tmp_path) as (owner, on_b, endpoint, model):
            found: dict[str, Any] = {"modes": (owner.mode, endpoint.mode)}
            ends = of_type(await collect(on_b.run("one"), BOUND_S), TaskEnd)
            found["first"] = (model.request_count, endpoint.asked, endpoint.kept_taken)
            found["kept"] = (endpoint.kept, owner.local.in_flight)
            ends += of_type(await collect(on_b.run("two"), BOUND_S), TaskEnd)
            found["second"] = (model.request_count, endpoint.asked, endpoint.kept_taken)
            found["statuses"] = [end.status for end in ends]
            return found

    found = in_cluster(body)
    assert found["modes"] == (Mode.OWNER, Mode.REMOTE)
    assert found["statuses"] == ["completed", "completed"]
    requests, asked, taken = found["first"]
    assert asked >= 1 and requests == asked + taken
    assert found["kept"] == (asked, asked)  # every place kept, and counted by a
    requests_after, asked_after, taken_after = found["second"]
    assert requests_after > requests
    assert asked_after == asked  # the second task asked a nothing
    assert taken_after - taken == requests_after - requests


def test_a_kept_place_goes_back_to_the_owner_once_idle(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SHARE-1: a kept place idle for ``KEEP_IDLE_S`` is given back, and the owner no
    longer counts it."""
    monkeypatch.setattr(admission, "KEEP_IDLE_S", 0.3)

    async def body(bridge: Bridge) -> dict[str, Any]:
        async with b_asks_a(bridge, nats_server.url, tmp_path) as (owner, on_b, endpoint, _):
            await collect(on_b.run("one"), BOUND_S)
            await observed(lambda: endpoint.kept == 0 and owner.local.in_flight == 0)
            return {"asked": endpoint.asked, "mode": endpoint.mode}

    found = in_cluster(body)
    assert found["asked"] >= 1 and found["mode"] is Mode.REMOTE


def test_nothing_is_kept_under_a_per_minute_limit(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-SHARE-1: with ``requests_per_minute`` every request is counted where it is
    admitted, so each of b's requests asks a and its place goes back at its end."""

    async def body(bridge: Bridge) -> dict[str, Any]:
        limits = ProviderLimits(requests_per_minute=1000)
        async with b_asks_a(bridge, nats_server.url, tmp_path, limits=limits) as (
            owner, on_b, endpoint, model
        ):
            for prompt in ("one", "two"):
                await collect(on_b.run(prompt), BOUND_S)
            found = {
                "asked": endpoint.asked,
                "kept": endpoint.kept,
                "taken": endpoint.kept_taken,
                "requests": model.request_count,
            }
            await observed(lambda: owner.local.in_flight == 0)
            return found

    found = in_cluster(body)
    assert found["kept"] == 0 and found["taken"] == 0
    assert found["asked"] == found["requests"] >= 2


class _LeasesRenewedBy:
    """A lease table whose renewals wait for ``renewal_may_land`` (when given), so that a
    test can give the lease up while one is on its way; it records what was released."""

    def __init__(self, renewal_may_land: trio.Event | None = None) -> None:
        self.ttl_s = LEASE_TTL_S
        self.renewal_may_land = renewal_may_land
        self.renewing = trio.Event()
        self.released: list[Lease] = []
        self.claiming = trio.Event()
        self.claim_may_land = trio.Event()

    async def renew(self, lease: Lease) -> Lease:
        revision = lease.revision + 1  # as the table does: the lease's own fields
        self.renewing.set()
        if self.renewal_may_land is not None:
            await self.renewal_may_land.wait()
        return Lease(session_id=lease.session_id, host_id=lease.host_id, revision=revision)

    async def release(self, lease: Lease) -> None:
        self.released.append(lease)

    async def claim(self, session_id: str, host_id: str) -> Lease | None:
        self.claiming.set()
        await self.claim_may_land.wait()
        return Lease(session_id=session_id, host_id=host_id, revision=1)



@asynccontextmanager
async def _quiet_subscription(subject: str) -> AsyncIterator[AsyncIterator[Any]]:
    """A subscription on which no other host ever asks."""

    async def nothing() -> AsyncIterator[Any]:
        await trio.sleep_forever()
        yield

    yield nothing()


def _endpoint_on(leases: _LeasesRenewedBy) -> SharedEndpoint:
    conn = SimpleNamespace(
        names=ClusterNames(), connected=True, subscription=_quiet_subscription
    )
    return SharedEndpoint(
        conn,  # type: ignore[arg-type]
        leases,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        host_id="a", key="endpoint", identity="anthropic", local=EndpointAdmission(),
    )


def test_a_lease_given_up_while_its_owner_waits_to_renew_it_is_not_renewed() -> None:
    # The host closes (close() gives the lease up) while the owner's keeper sleeps
    # between renewals: the keeper wakes to no lease and ends, renewing nothing. It
    # renewed "None" before, and the host's close failed with an AttributeError
    # (R-SHARE-1).
    leases = _LeasesRenewedBy()
    endpoint = _endpoint_on(leases)
    held = Lease(session_id="endpoint", host_id="a", revision=1)
    endpoint._held.lease = held
    why: list[str] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def keep() -> None:
                why.append(await endpoint._held.keep())

            nursery.start_soon(keep)
            await trio.testing.wait_all_tasks_blocked()
            await endpoint.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert why == ["its lease was given up"]
    assert leases.released == [held]
    assert not leases.renewing.is_set()


def test_a_lease_given_up_while_a_renewal_is_on_its_way_stays_given_up() -> None:
    # The lease is given up while a renewal is in flight: when the renewal lands, the
    # keeper does not take the renewed lease back as its own (the host would go on
    # admitting after its close); it gives the renewed revision up too, and ends.
    land = trio.Event()
    leases = _LeasesRenewedBy(land)
    endpoint = _endpoint_on(leases)
    held = Lease(session_id="endpoint", host_id="a", revision=1)
    endpoint._held.lease = held
    why: list[str] = []

    async def main() -> None:
        # Bounded: a keeper that takes the renewed lease back renews it for ever.
        with trio.fail_after(10 * LEASE_TTL_S), trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def keep() -> None:
                    why.append(await endpoint._held.keep())
                    scope.cancel()

                nursery.start_soon(keep)
                await leases.renewing.wait()
                await endpoint.close()
                land.set()
                await trio.sleep_forever()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert why == ["its lease was given up"]
    assert endpoint._held.lease is None
    assert leases.released == [held, attrs.evolve(held, revision=2)]


def test_a_lease_claimed_while_the_host_closes_is_given_up_at_once() -> None:
    # The host's close runs while its claim of the endpoint's lease is on its way: the
    # lease it then gets is given up at once, and the closed host does not start to
    # admit for the others (they would wait a TTL for it).
    leases = _LeasesRenewedBy()
    endpoint = _endpoint_on(leases)

    async def main() -> None:
        # Bounded: a closed host that admits for the others does so for ever.
        with trio.fail_after(10 * LEASE_TTL_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(endpoint._find_owner)
                await leases.claiming.wait()
                await endpoint.close()
                leases.claim_may_land.set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert leases.released == [Lease(session_id="endpoint", host_id="a", revision=1)]
    assert endpoint.mode is not Mode.OWNER
    assert endpoint._held.lease is None


def test_a_host_that_closes_stops_admitting_for_the_others_at_once() -> None:
    # Closing while this host admits for the cluster ends its admitting then, not when
    # its keeper next wakes to renew the lease (a third of a TTL later).
    leases = _LeasesRenewedBy()
    endpoint = _endpoint_on(leases)
    held = Lease(session_id="endpoint", host_id="a", revision=1)
    ended_after: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def own() -> None:
                await endpoint._own(held)
                ended_after.append(trio.current_time() - closed_at)

            nursery.start_soon(own)
            assert await endpoint.known() is Mode.OWNER
            closed_at = trio.current_time()
            await endpoint.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ended_after == [0.0]
    assert leases.released == [held]
    assert not leases.renewing.is_set()
