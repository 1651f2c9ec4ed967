"""The TCP listeners of the gateway and the console: one address's listener (a name with
several addresses, asked for any free port, would give each its own port), or — for the
workers of ``serve --workers`` (R-PERF-2) — a listener that shares its port with the other
workers' (``SO_REUSEPORT``: the kernel spreads new connections over them)."""

from __future__ import annotations

import socket

import trio

__all__ = ["BACKLOG", "open_listeners"]

BACKLOG = 4096
"""The accept queue of a shared port (the kernel caps it at ``somaxconn``)."""


async def open_listeners(
    port: int, host: str | None, *, reuse_port: bool = False
) -> list[trio.SocketListener]:
    """Listen on ``host:port``. Raises OSError when the address cannot be bound."""
    if reuse_port:
        return [await _shared_listener(port, host)]
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len(listeners) > 1:
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    return listeners


async def _shared_listener(port: int, host: str | None) -> trio.SocketListener:
    family, kind, proto, _, address = (
        await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    )[0]
    sock = trio.socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        await sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
