"""Leases in a JetStream KV bucket with a TTL (a provider endpoint's admission), against a
real nats-server: one holder at a time, a dead holder's lease expires."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, cast

import nats.errors
import nats.js.errors
import nats.js.kv
import pytest
import trio

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable, LeaseLost
from greenroom.actors.cluster.leases import Lease, LeaseTable
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)

TTL_S = 1.0



def test_one_claim_wins_and_the_holder_is_known(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[bool, bool, str | None]:
        table = await LeaseTable.open(conn, ttl_s=TTL_S, bucket=conn.names.admission_leases)
        first = await table.claim("s1", "host-a")
        second = await table.claim("s1", "host-b")
        return first is not None, second is None, await table.holder("s1")

    assert run_connected(nats_server.url, body) == (True, True, "host-a")


def test_renewal_is_compare_and_set_on_the_revision(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> str:
        table = await LeaseTable.open(conn, ttl_s=TTL_S, bucket=conn.names.admission_leases)
        lease = await table.claim("s1", "host-a")
        assert lease is not None
        renewed = await table.renew(lease)
        assert renewed.revision > lease.revision
        try:
            await table.renew(lease)  # the old revision: someone else wrote since
        except LeaseLost as exc:
            return exc.session_id
        return "renewed twice from one revision"

    assert run_connected(nats_server.url, body) == "s1"


def test_an_unrenewed_lease_expires_and_another_host_claims_it(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[str | None, str | None, bool]:
        table = await LeaseTable.open(conn, ttl_s=TTL_S, bucket=conn.names.admission_leases)
        lease = await table.claim("s1", "host-a")
        assert lease is not None
        # host-a dies: nobody renews. Try to claim until the TTL removes the lease.
        claimed = None
        tries = 0
        while claimed is None:
            claimed = await table.claim("s1", "host-b")
            if claimed is None:
                tries += 1
                await trio.sleep(TTL_S / 10)
        holder = await table.holder("s1")
        try:
            await table.renew(lease)
            stale_renewed = True
        except LeaseLost:
            stale_renewed = False
        return claimed.host_id, holder, stale_renewed and tries > 0

    assert run_connected(nats_server.url, body) == ("host-b", "host-b", False)


def test_a_lease_that_expires_while_it_is_claimed_is_claimed() -> None:
    """The KV's ``create`` finds the lease, then looks it up to see whether it was deleted,
    and it has expired in between (more likely on a busy machine): nobody holds it, so the
    claim succeeds instead of reporting the cluster unreachable (R-CLUSTER-2)."""

    class Bucket:
        creates = 0

        async def create(self, key: str, value: bytes) -> int:
            Bucket.creates += 1
            if Bucket.creates == 1:
                raise nats.js.errors.KeyNotFoundError
            return 7

    class Direct:
        async def call(self, coro: Awaitable[Any]) -> Any:
            return await coro

    table = LeaseTable(cast(Connection, Direct()), cast(nats.js.kv.KeyValue, Bucket()), TTL_S)
    assert trio.run(table.claim, "s1", "host-b") == Lease(
        session_id="s1", host_id="host-b", revision=7
    )


def test_a_released_lease_is_claimable_at_once(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> str | None:
        table = await LeaseTable.open(conn, ttl_s=60.0, bucket=conn.names.admission_leases)
        lease = await table.claim("s1", "host-a")
        assert lease is not None
        await table.release(lease)
        again = await table.claim("s1", "host-b")
        return again.host_id if again else None

    assert run_connected(nats_server.url, body) == "host-b"


def test_a_release_after_a_renewal_it_did_not_wait_for_releases(
    nats_server: NatsProcess,
) -> None:
    """A renewal that was on its way when the keeper released the lease lands first and
    moves the revision on: the lease is still this host's, and goes (a drain hands the
    session over at once instead of after the TTL)."""

    async def body(conn: Connection) -> tuple[str | None, str | None]:
        table = await LeaseTable.open(conn, ttl_s=60.0, bucket=conn.names.admission_leases)
        lease = await table.claim("s1", "host-a")
        assert lease is not None
        await table.renew(lease)  # landed before the release, which names the old revision
        await table.release(lease)
        again = await table.claim("s1", "host-b")
        taken = await table.claim("s2", "host-b")
        assert taken is not None
        await table.release(lease_of("s2", "host-a", taken.revision))  # not host-a's
        return (again.host_id if again else None), await table.holder("s2")

    assert run_connected(nats_server.url, body) == ("host-b", "host-b")


def lease_of(session_id: str, host_id: str, revision: int) -> Lease:
    return Lease(session_id=session_id, host_id=host_id, revision=revision - 1)


def test_a_subscription_that_cannot_be_confirmed_leaves_no_subscriber(
    nats_server: NatsProcess,
) -> None:
    # The flush that confirms a subscription failed (or was cancelled): the subscription
    # stayed, taking the subject's requests and answering none, so that an asker waited
    # out its whole timeout instead of hearing at once that nobody serves it.
    async def body(conn: Connection) -> tuple[int, int]:
        before = len(conn.client._subs)
        client: Any = conn.client
        flush = client.flush

        async def failing_flush(*args: Any, **kwargs: Any) -> None:
            raise nats.errors.TimeoutError

        client.flush = failing_flush
        try:
            with pytest.raises(ClusterUnavailable):
                async with conn.subscription(conn.names.admission_subject("endpoint")):
                    pass
        finally:
            client.flush = flush
        return before, len(conn.client._subs)

    before, after = run_connected(nats_server.url, body)
    assert after == before
