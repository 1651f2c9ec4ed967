"""Cluster mode: hosts that share a NATS JetStream server form one service (R-CLUSTER-1..2).

::

    bridge      trio as the guest of an asyncio loop: the only asyncio, for nats-py
    connection  one host's NATS connection; the names of the buckets, stream and subjects
    leases      a key → the host that holds it, KV with a TTL: claim, renew, expire
    ownership   session → owning host, valid while that host's own lease lives;
                OwnershipKeeper renews it and reports its sessions lost with it
    traces      the fenced trace stream: one subject per session, replay, follow
    registry    live hosts and their load (placement), session metadata
    listing     ``session.list`` over the whole cluster, from the session directory
    routing     requests that only a session's owner answers
    admission   one admission point per provider endpoint for every host: a lease holder
    spending    principals' spending per period over every host: KV counters
    limits      both, as the host's SharedLimits
    store       the TraceStore backend that replicates a host's records to JetStream
    node        one host of the cluster: adoption, loss, takeover; open_cluster_host
    serve       ``greenroom serve --nats``
    server      finding and starting a local ``nats-server``

Importing this package imports nats-py (the ``cluster`` extra); single-host greenroom never
does.
"""

from greenroom.actors.cluster.bridge import Bridge, BridgeClosed, run
from greenroom.actors.cluster.errors import (
    ClusterError,
    ClusterUnavailable,
    Fenced,
    LeaseLost,
    OwnerUnreachable,
)
from greenroom.actors.cluster.node import ClusterConfig, ClusterNode, open_cluster_host

__all__ = [
    "Bridge",
    "BridgeClosed",
    "ClusterConfig",
    "ClusterError",
    "ClusterNode",
    "ClusterUnavailable",
    "Fenced",
    "LeaseLost",
    "OwnerUnreachable",
    "open_cluster_host",
    "run",
]
