"""The limits a cluster's hosts hold together (R-SHARE-1, R-SHARE-4 across hosts): a
cluster host's :class:`~greenroom.actors.runtime.shared_limits.SharedLimits`.

::

    ClusterLimits.run
    ├── SharedEndpoint.run   one per provider endpoint and credential this host sends to:
    │                        who admits its requests for the cluster (:mod:`.admission`)
    └── ClusterSpending.run  principals' spending over every host (:mod:`.spending`)

:func:`~greenroom.actors.cluster.node.open_cluster_host` makes one, runs it and gives it to
its host (``Host.open(shared=…)``). An adapter that cannot name its endpoint (the
scripted model, a program's own provider object) is admitted by its host alone.
"""

from __future__ import annotations

import trio

from greenroom.actors.cluster.admission import SharedEndpoint, endpoint_key
from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.leases import LeaseTable
from greenroom.actors.cluster.registry import HostRegistry
from greenroom.actors.cluster.spending import ClusterSpending
from greenroom.actors.providers.base import IdentifiedEndpoint
from greenroom.actors.runtime.admission import AdmissionPoint, EndpointAdmission
from greenroom.protocols.budgets import SpendLimit

__all__ = ["ClusterLimits"]


class ClusterLimits:
    """One cluster host's shared limits. Start :meth:`run` in a nursery before the host
    makes its first session; :meth:`aclose` before the connection closes."""

    def __init__(self, conn: Connection, host_id: str, *, lease_ttl_s: float) -> None:
        self._conn = conn
        self.host_id = host_id
        self._ttl_s = lease_ttl_s
        self._nursery: trio.Nursery | None = None
        self._leases: LeaseTable | None = None
        self._registry: HostRegistry | None = None
        self._spending: ClusterSpending | None = None
        self.endpoints: dict[str, SharedEndpoint] = {}
        """This host's admission point of each endpoint it sends to, by endpoint key."""

    @property
    def spending(self) -> ClusterSpending:
        """The principals' spending counters (once :meth:`run` is ready)."""
        assert self._spending is not None, "ClusterLimits.run has not started"
        return self._spending

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the admission leases and the spending counters, then serve until
        cancelled. Raises :class:`~greenroom.actors.cluster.errors.ClusterUnavailable`
        when NATS does not answer at the start."""
        conn = self._conn
        self._leases = await LeaseTable.open(
            conn, ttl_s=self._ttl_s, bucket=conn.names.admission_leases
        )
        self._registry = await HostRegistry.open(conn, ttl_s=self._leases.ttl_s)
        self._spending = await ClusterSpending.open(conn, self.host_id)
        async with trio.open_nursery() as nursery:
            await nursery.start(self._spending.run)
            self._nursery = nursery
            task_status.started()

    def admission(self, client: object, local: EndpointAdmission) -> AdmissionPoint:
        """The admission point of ``client`` on this host: the cluster's for its endpoint
        (one per endpoint, whichever client of this host sends to it), or ``local`` for an
        adapter that cannot name its endpoint."""
        if not isinstance(client, IdentifiedEndpoint):
            return local
        assert self._nursery is not None and self._leases is not None
        identity = client.endpoint_identity
        key = endpoint_key(identity)
        endpoint = self.endpoints.get(key)
        if endpoint is None:
            endpoint = SharedEndpoint(
                self._conn,
                self._leases,
                self._live_hosts,
                host_id=self.host_id,
                key=key,
                identity=identity,
                local=local,
            )
            self.endpoints[key] = endpoint
            self._nursery.start_soon(endpoint.run)
        return endpoint

    async def share_principal(self, principal: str, local: SpendLimit) -> SpendLimit:
        """The limit of ``principal`` counted over the cluster (see :mod:`.spending`)."""
        return await self.spending.share(principal, local)

    async def _live_hosts(self) -> set[str]:
        assert self._registry is not None
        return {record.host_id for record in await self._registry.hosts()}

    async def aclose(self) -> None:
        """Add what this host spent to the counters and give up the endpoints this host
        admits for, so the others need not wait for a lease TTL. Best effort: call it
        under a deadline."""
        if self._spending is not None:
            await self._spending.flushed()
        for endpoint in self.endpoints.values():
            await endpoint.close()
