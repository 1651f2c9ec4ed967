"""``greenroom serve --nats URL``: the gateway on a host that joins a cluster.

The process runs under :func:`greenroom.actors.cluster.bridge.run` (trio as the guest of the
asyncio loop that drives the NATS client) instead of :func:`trio.run`; everything else is
the single-host ``serve``: the same gateway, the same flags, the same data dir (which holds
this host's copy of the traces of the sessions it owns and its usage ledger).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.node import ClusterConfig, ClusterNode, open_cluster_host
from greenroom.actors.gateway.config import approve_for
from greenroom.actors.gateway.server import Gateway
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.actors.runtime.admission import ProviderLimits
from greenroom.actors.runtime.host import Host, SessionObserver
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.port import Approval
from greenroom.protocols.tools import Tool

__all__ = ["approve_for", "default_host_id", "serve_in_cluster"]


def default_host_id() -> str:
    """This machine's name and this process's id: unique among the hosts of a cluster."""
    return f"{socket.gethostname().split('.')[0] or 'host'}-{os.getpid()}"


def serve_in_cluster(
    config: ClusterConfig,
    serve: Callable[..., Awaitable[None]],
    *,
    tools: Iterable[Tool],
    approve: Approval,
    mcp_servers: Mapping[str, Any] | None = None,
    provider: Callable[[], ModelProvider] | None = None,
    prices: Mapping[str, Any] | None = None,
    principal_budget: PrincipalBudget | None = None,
    provider_limits: ProviderLimits | None = None,
    **serve_kwargs: Any,
) -> None:
    """Run ``serve(open_host=…, **serve_kwargs)`` (the gateway's ``run_serve``) on a host
    of the cluster ``config`` names; sessions taken over (and every session the host loads
    on its own) get ``tools``, ``mcp_servers`` (``--mcp-config``) and a provider from
    ``provider()`` (else the one their settings name). ``prices`` are the host's;
    ``principal_budget`` holds over every host's spending and ``provider_limits`` for
    every host's requests to each endpoint together (R-SHARE, :mod:`.limits`: give every
    host the same). Raises ClusterUnavailable when NATS is unreachable."""
    tool_list = tuple(tools)

    async def main(bridge: Bridge) -> None:
        nodes: list[ClusterNode] = []

        def open_host(
            data_dir: Path, observers: Iterable[SessionObserver]
        ) -> AbstractAsyncContextManager[Host]:
            return open_cluster_host(
                bridge,
                config,
                data_dir,
                observers=observers,
                tools=tool_list,
                mcp_servers=mcp_servers,
                approve=approve,
                provider=provider,
                on_node=nodes.append,
                prices=prices,
                principal_budget=principal_budget,
                limits=provider_limits,
            )

        def on_gateway(gateway: Gateway) -> None:
            for node in nodes:
                node.bind_gateway(gateway)

        await serve(open_host=open_host, on_gateway=on_gateway, **serve_kwargs)

    run(main)
