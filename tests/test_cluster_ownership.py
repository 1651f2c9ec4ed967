"""Session ownership through each host's own lease, against a real nats-server
(R-CLUSTER-1: one owner at a time; R-CLUSTER-2: a dead or stalled host's sessions become
claimable within the TTL, and the host itself learns it lost them)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.ownership import Ownership, OwnershipKeeper, SessionOwners
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)

TTL_S = 1.0


class Losses:
    def __init__(self) -> None:
        self.lost: list[tuple[str, str]] = []
        self.any = trio.Event()

    def __call__(self, session_id: str, reason: str) -> None:
        self.lost.append((session_id, reason))
        self.any.set()


async def until_unowned(owners: SessionOwners, sessions: list[str]) -> None:
    """Return once the server has expired the lease of the host owning ``sessions`` (it
    tells no one: the bucket is read until it shows)."""
    while True:
        if await owners.unowned(sessions) == sessions:
            return
        await trio.sleep(TTL_S / 10)


def test_one_claim_wins_while_its_host_lives(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        owners = await SessionOwners.open(conn, ttl_s=TTL_S)
        a = OwnershipKeeper(owners, "host-a", Losses())
        b = OwnershipKeeper(owners, "host-b", Losses())
        await a.take_lease()
        await b.take_lease()
        first = await a.claim("s1")
        second = await b.claim("s1")
        again = await a.claim("s1")  # this host owns it already
        return (
            first is not None,
            second,
            again,
            await owners.holder("s1"),
            await owners.unowned(["s1", "nobody"]),
            a.held(),
        )

    assert run_connected(nats_server.url, body) == (True, None, None, "host-a", ["nobody"], ("s1",))


def test_a_dead_hosts_sessions_are_claimable_after_its_lease_expires(
    nats_server: NatsProcess,
) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        owners = await SessionOwners.open(conn, ttl_s=TTL_S)
        a = OwnershipKeeper(owners, "host-a", Losses())
        b = OwnershipKeeper(owners, "host-b", Losses())
        await a.take_lease()
        async with trio.open_nursery() as nursery:
            await nursery.start(b.run)  # host-b lives on
            for sid in ("s1", "s2"):
                assert await a.claim(sid) is not None
            # host-a dies: nobody renews its one key. Its sessions stay its own until the
            # bucket's TTL removes that key, then both are claimable. (The claim is the
            # only probe: a check for both unowned before each claim would loop forever
            # once a claim made just after the expiry took s1.)
            refused = 0
            while (claimed := await b.claim("s1")) is None:
                refused += 1
                await trio.sleep(TTL_S / 10)
            holder = await owners.holder("s1")
            unowned = await owners.unowned(["s1", "s2"])
            nursery.cancel_scope.cancel()
        return refused > 0, claimed is not None, holder, unowned, b.held()

    assert run_connected(nats_server.url, body) == (True, True, "host-b", ["s2"], ("s1",))


class CountedRenewals(SessionOwners):
    """Counts the host's renewals and lets the test wait for the n-th."""

    renewals = 0
    wanted = 0
    reached = trio.Event()

    async def renew_host_lease(self, host_id: str, token: str, revision: int) -> int | None:
        renewed = await super().renew_host_lease(host_id, token, revision)
        type(self).renewals += 1
        if type(self).renewals >= type(self).wanted:
            type(self).reached.set()
        return renewed


def test_the_keeper_renews_one_key_for_all_its_sessions(nats_server: NatsProcess) -> None:
    """Fifty sessions, one renewal a tick; four ticks are more than a TTL, so without the
    renewals the sessions would be nobody's by then."""

    async def body(conn: Connection) -> tuple[object, ...]:
        opened = await SessionOwners.open(conn, ttl_s=TTL_S)
        owners = CountedRenewals(conn, opened._owners, opened._host_leases, opened.ttl_s)
        CountedRenewals.wanted, CountedRenewals.reached = 4, trio.Event()
        losses = Losses()
        keeper = OwnershipKeeper(owners, "host-a", losses)
        sessions = [f"s{i}" for i in range(50)]
        async with trio.open_nursery() as nursery:
            await nursery.start(keeper.run)
            for sid in sessions:
                assert await keeper.claim(sid) is not None
            await CountedRenewals.reached.wait()
            nursery.cancel_scope.cancel()
        return CountedRenewals.renewals, losses.lost, await owners.unowned(sessions)

    assert run_connected(nats_server.url, body) == (4, [], [])


def test_a_refused_renewal_loses_every_session_and_takes_a_new_lease(
    nats_server: NatsProcess,
) -> None:
    """Another process took the host id's lease (a restarted worker): this one learns at
    its next renewal that it owns nothing, and its sessions are claimable at once."""

    async def body(conn: Connection) -> tuple[object, ...]:
        owners = await SessionOwners.open(conn, ttl_s=TTL_S)
        losses = Losses()
        keeper = OwnershipKeeper(owners, "host-a", losses)
        await keeper.take_lease()
        first = keeper.incarnation
        for sid in ("s1", "s2"):
            assert await keeper.claim(sid) is not None
        await owners.take_host_lease("host-a", "another-process")
        unowned_at_once = await owners.unowned(["s1", "s2"])
        await keeper.renew()
        return (
            unowned_at_once,
            sorted(losses.lost),
            keeper.held(),
            keeper.incarnation not in (None, first, "another-process"),
        )

    unowned, lost, *rest = run_connected(nats_server.url, body)
    assert (unowned, rest) == (["s1", "s2"], [(), True])
    assert [sid for sid, _ in lost] == ["s1", "s2"]
    assert all(reason.startswith("the renewal was refused, ") for _, reason in lost)


def test_a_host_stalled_past_its_lease_learns_at_its_next_renewal(
    nats_server: NatsProcess,
) -> None:
    """The host was stopped (no renewal ran) until the server expired its lease: its next
    renewal is refused, every session it owned is reported lost, and they are claimable."""

    async def body(conn: Connection) -> tuple[object, ...]:
        owners = await SessionOwners.open(conn, ttl_s=TTL_S)
        losses = Losses()
        keeper = OwnershipKeeper(owners, "host-a", losses)
        other = OwnershipKeeper(owners, "host-b", Losses())
        await keeper.take_lease()
        assert await keeper.claim("s1") is not None
        await until_unowned(owners, ["s1"])
        await keeper.renew()
        await other.take_lease()
        taken = await other.claim("s1")
        return losses.lost, keeper.held(), keeper.incarnation is not None, taken is not None

    lost, *rest = run_connected(nats_server.url, body)
    assert rest == [(), True, True]
    assert [sid for sid, _ in lost] == ["s1"]
    assert lost[0][1].startswith("the renewal was refused, ")


class SlowAnswers(SessionOwners):
    """Renewals land at once and their answers take ``delay_s``, or they fail."""

    delay_s = 0.0
    unreachable = False

    async def renew_host_lease(self, host_id: str, token: str, revision: int) -> int | None:
        if type(self).unreachable:
            raise ClusterUnavailable("NATS is unavailable: test")
        renewed = await super().renew_host_lease(host_id, token, revision)
        await trio.sleep(type(self).delay_s)
        return renewed


def test_a_renewal_that_lands_late_loses_nothing(nats_server: NatsProcess) -> None:
    """Its compare-and-set succeeded, so the lease never lapsed before it: the answer
    arriving more than a TTL after the last renewal was sent is no reason to give up."""

    async def body(conn: Connection) -> tuple[object, ...]:
        opened = await SessionOwners.open(conn, ttl_s=TTL_S)
        owners = SlowAnswers(conn, opened._owners, opened._host_leases, opened.ttl_s)
        SlowAnswers.delay_s, SlowAnswers.unreachable = TTL_S * 1.2, False
        losses = Losses()
        warnings: list[str] = []
        keeper = OwnershipKeeper(owners, "host-a", losses, warn=warnings.append)
        await keeper.take_lease()
        assert await keeper.claim("s1") is not None
        await keeper.renew()
        return losses.lost, keeper.held(), warnings

    lost, held, warnings = run_connected(nats_server.url, body)
    assert (lost, held) == ([], ("s1",))
    # Renewed with nothing to spare: the operator is told the host is too busy.
    assert len(warnings) == 1 and "too busy to renew in time" in warnings[0]


def test_nats_unreachable_for_a_ttl_loses_every_session(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        opened = await SessionOwners.open(conn, ttl_s=TTL_S)
        owners = SlowAnswers(conn, opened._owners, opened._host_leases, opened.ttl_s)
        SlowAnswers.delay_s, SlowAnswers.unreachable = 0.0, True
        losses = Losses()
        keeper = OwnershipKeeper(owners, "host-a", losses)
        await keeper.take_lease()
        assert await keeper.claim("s1") is not None
        await keeper.renew()  # fails, within the TTL: nothing lost yet
        early = list(losses.lost)
        await trio.sleep(TTL_S)  # NATS stays out of reach for a whole TTL
        await keeper.renew()
        return early, [sid for sid, _ in losses.lost], losses.lost[-1][1]

    early, lost, reason = run_connected(nats_server.url, body)
    assert (early, lost) == ([], ["s1"])
    assert reason.startswith("no renewal for ") and reason.endswith("NATS is unavailable: test")


class HeldClaims(SessionOwners):
    """Holds every claim's answer until the test lets it through."""

    gate = trio.Event()
    sent = trio.Event()

    async def claim(
        self, session_id: str, host_id: str, token: str, *, left: Ownership | None = None
    ) -> Ownership | None:
        ownership = await super().claim(session_id, host_id, token, left=left)
        type(self).sent.set()
        await type(self).gate.wait()
        return ownership


def test_a_claim_that_lands_after_the_lease_was_lost_is_not_held(
    nats_server: NatsProcess,
) -> None:
    """The claim names the incarnation that was lost meanwhile: the session is nobody's,
    and the host must not believe it owns it."""

    async def body(conn: Connection) -> tuple[object, ...]:
        opened = await SessionOwners.open(conn, ttl_s=TTL_S)
        owners = HeldClaims(conn, opened._owners, opened._host_leases, opened.ttl_s)
        HeldClaims.gate, HeldClaims.sent = trio.Event(), trio.Event()
        keeper = OwnershipKeeper(owners, "host-a", Losses())
        await keeper.take_lease()
        outcome: list[str] = []

        async def claim() -> None:
            with pytest.raises(ClusterUnavailable) as raised:
                await keeper.claim("s1")
            outcome.append(str(raised.value))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(claim)
            await HeldClaims.sent.wait()
            await owners.take_host_lease("host-a", "another-process")
            await keeper.renew()  # refused: lost, and a new lease taken
            HeldClaims.gate.set()
        return outcome, keeper.held(), await owners.unowned(["s1"])

    held, unowned = (), ["s1"]
    outcome, *rest = run_connected(nats_server.url, body)
    assert rest == [held, unowned]
    assert outcome == ["host host-a lost its lease during the claim"]


async def _two_leased_hosts(
    conn: Connection,
) -> tuple[SessionOwners, OwnershipKeeper, OwnershipKeeper]:
    """Hosts a and b, each with its lease (60 s: none expires during a test)."""
    owners = await SessionOwners.open(conn, ttl_s=60.0)
    a = OwnershipKeeper(owners, "host-a", Losses())
    b = OwnershipKeeper(owners, "host-b", Losses())
    await a.take_lease()
    await b.take_lease()
    return owners, a, b


def test_released_sessions_are_claimable_at_once(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[object, ...]:
        _, a, b = await _two_leased_hosts(conn)
        for sid in ("s1", "s2", "s3"):
            assert await a.claim(sid) is not None
        await a.release("s1")  # a drain's hand-over: one session
        one = await b.claim("s1")
        await a.release_all()  # a clean shutdown: every session at once
        rest = [await b.claim(sid) for sid in ("s2", "s3")]
        return one is not None, all(r is not None for r in rest), a.held(), b.held()

    assert run_connected(nats_server.url, body) == (True, True, (), ("s1", "s2", "s3"))


def test_a_release_nats_did_not_take_is_taken_back_here_or_made_at_the_next_renewal(
    nats_server: NatsProcess,
) -> None:
    # A release NATS did not take (unreachable for a moment) left the owner entry naming
    # this host's live incarnation: no host could claim the session again, this one
    # included ("owned by a live host"), until its lease changed: owned, served by none.
    async def body(conn: Connection) -> tuple[object, ...]:
        owners, a, b = await _two_leased_hosts(conn)
        assert await a.claim("s1") is not None and await a.claim("s2") is not None
        release = owners.release

        async def unreachable(ownership: Ownership) -> None:
            raise ClusterUnavailable("NATS away for a moment")

        owners.release = unreachable  # type: ignore[method-assign]
        await a.release("s1")
        await a.release("s2")
        owners.release = release  # type: ignore[method-assign]
        again = await a.claim("s1")  # its own entry, still as it left it: taken back
        await a.renew()  # s2's release is made now
        other = await b.claim("s2")
        return again is not None, a.held(), other is not None, await owners.holder("s2")

    assert run_connected(nats_server.url, body) == (True, ("s1",), True, "host-b")


def test_a_release_does_not_take_a_session_another_host_claimed(
    nats_server: NatsProcess,
) -> None:
    async def body(conn: Connection) -> str | None:
        owners = await SessionOwners.open(conn, ttl_s=60.0)
        a = OwnershipKeeper(owners, "host-a", Losses())
        b = OwnershipKeeper(owners, "host-b", Losses())
        await a.take_lease()
        stale = await a.claim("s1")
        assert stale is not None
        await a.release_all()
        await b.take_lease()
        assert await b.claim("s1") is not None
        await owners.release(stale)  # names host-a's revision: refused, nothing changes
        return await owners.holder("s1")

    assert run_connected(nats_server.url, body) == "host-b"


def test_a_claim_before_the_host_has_its_lease_waits_for_it(nats_server: NatsProcess) -> None:
    """Sessions a host resumes as it opens are adopted while its lease is being taken:
    they are claimed once it is, not given up."""

    async def body(conn: Connection) -> tuple[object, ...]:
        owners = await SessionOwners.open(conn, ttl_s=TTL_S)
        keeper = OwnershipKeeper(owners, "host-a", Losses())
        claimed: list[Ownership | None] = []
        done = trio.Event()

        async def claim() -> None:
            claimed.append(await keeper.claim("s1"))
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(claim)
            await trio.testing.wait_all_tasks_blocked()
            waited = claimed == []
            await nursery.start(keeper.run)
            await done.wait()
            nursery.cancel_scope.cancel()
        return waited, claimed[0] is not None, keeper.held()

    assert run_connected(nats_server.url, body) == (True, True, ("s1",))
