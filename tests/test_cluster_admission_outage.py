"""A host that loses NATS keeps admitting (R-SHARE-1 across hosts): two hosts' admission
points of one endpoint on a real nats-server, which is then killed. The host that asked
the owner admits its request alone, under its own limits, and says so in its log; a
principal's spending read while NATS is out of reach starts from the host's own ledger,
and says so too."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import trio

from greenroom import ProviderLimits
from greenroom.actors.cluster.admission import Mode, SharedEndpoint, endpoint_key
from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import ClusterNames, Connection, connect
from greenroom.actors.cluster.leases import LeaseTable
from greenroom.actors.cluster.spending import ClusterSpending, SharedSpendLimit
from greenroom.actors.runtime.admission import EndpointAdmission
from greenroom.protocols.budgets import SpendLimit, period_start
from tests.support.nats import start_nats

TTL_S = 1.0
BOUND_S = 45.0
IDENTITY = "anthropic http://127.0.0.1:9 0123456789abcdef"


async def endpoint_of(conn: Connection, host_id: str) -> SharedEndpoint:
    leases = await LeaseTable.open(conn, ttl_s=TTL_S, bucket=conn.names.admission_leases)

    async def live_hosts() -> set[str]:
        return {"a", "b"}

    return SharedEndpoint(
        conn,
        leases,
        live_hosts,
        host_id=host_id,
        key=endpoint_key(IDENTITY),
        identity=IDENTITY,
        local=EndpointAdmission(ProviderLimits(max_concurrent_requests=1)),
    )


def test_a_host_that_loses_nats_admits_alone_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_nats(tmp_path / "nats")
    names = ClusterNames(prefix=f"t{uuid.uuid4().hex[:10]}")

    async def body(bridge: Bridge) -> dict[str, object]:
        conn_a = await connect(bridge, server.url, name="a", names=names)
        conn_b = await connect(bridge, server.url, name="b", names=names)
        try:
            a = await endpoint_of(conn_a, "a")
            b = await endpoint_of(conn_b, "b")
            spending = await ClusterSpending.open(conn_b, "b")
            async with trio.open_nursery() as nursery:
                await nursery.start(a.run)
                modes = [await a.known()]
                await nursery.start(b.run)
                modes.append(await b.known())
                # a holds the cluster's one place; b's request waits for it at a.
                held = await a.admit("p", "s-a")
                waiting = trio.Event()
                granted = trio.Event()
                got: list[Mode] = []

                async def ask_b() -> None:
                    waiting.set()
                    permit = await b.admit("p", "s-b")
                    got.append(b.mode)
                    permit.release()
                    granted.set()

                nursery.start_soon(ask_b)
                await waiting.wait()
                server.stop()
                await granted.wait()
                held.release()
                since = period_start("day", time.time())
                local = SpendLimit(
                    "budget of principal 'carol'", 1.0, spent_usd=0.25, period="day", since=since
                )
                shared = await spending.share("carol", local)
                shared.spend(0.5, time.time())
                nursery.cancel_scope.cancel()
            return {"modes": modes, "got": got, "shared": shared}
        finally:
            with trio.CancelScope(shield=True):
                await conn_a.aclose()
                await conn_b.aclose()

    try:
        found = run(lambda bridge: _bounded(body(bridge)))
    finally:
        server.stop()
    assert found["modes"] == [Mode.OWNER, Mode.REMOTE]
    assert found["got"] == [Mode.LOCAL]
    shared = found["shared"]
    assert isinstance(shared, SharedSpendLimit)
    assert shared.spent_usd == pytest.approx(0.75)  # the ledger's 0.25 and what b spent since
    log = capsys.readouterr().err
    assert (
        f"host b admits its own requests to {IDENTITY} alone, under its own limits, "
        "until NATS answers"
    ) in log
    assert "host b cannot reach the cluster's spending counters" in log


async def _bounded(work: object) -> dict[str, object]:
    with trio.fail_after(BOUND_S):
        return await work  # type: ignore[misc, no-any-return]
