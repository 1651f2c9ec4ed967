"""A loopback TCP proxy whose connections a test cuts, for a client that must lose its
server while the others keep theirs (one NATS connection down, the cluster up).

:meth:`CutProxy.cut` closes every connection through the proxy and turns new ones away
until :meth:`CutProxy.mend`: the client sees its server go and comes back through the
proxy once it is mended, and nothing the server sends meanwhile reaches it.
"""

from __future__ import annotations

import trio

__all__ = ["CutProxy"]


class CutProxy:
    """Forwards each connection made to :attr:`port` (127.0.0.1) to ``target_port``."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._cut = False
        self._links: set[trio.CancelScope] = set()
        self._none_left = trio.Event()
        self.port = 0

    @property
    def url(self) -> str:
        """The proxy's ``nats://`` URL."""
        return f"nats://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[CutProxy]) -> None:
        """Forward connections until cancelled; started once it listens."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._link, listeners)

    async def cut(self) -> None:
        """Close every connection through the proxy and turn new ones away; returns once
        every one is closed."""
        self._cut = True
        for scope in self._links:
            scope.cancel()
        if self._links:
            self._none_left = trio.Event()
            await self._none_left.wait()

    def mend(self) -> None:
        """Forward new connections again."""
        self._cut = False

    async def _link(self, client: trio.SocketStream) -> None:
        scope = trio.CancelScope()
        self._links.add(scope)
        try:
            with scope:
                if self._cut:
                    return
                server = await trio.open_tcp_stream("127.0.0.1", self._target_port)
                async with server, trio.open_nursery() as nursery:
                    nursery.start_soon(_pipe, client, server, nursery.cancel_scope)
                    nursery.start_soon(_pipe, server, client, nursery.cancel_scope)
        finally:
            await client.aclose()
            self._links.discard(scope)
            if not self._links:
                self._none_left.set()


async def _pipe(source: trio.SocketStream, sink: trio.SocketStream, link: trio.CancelScope) -> None:
    """Copy ``source`` to ``sink`` until either ends, then end the link."""
    try:
        async for chunk in source:
            await sink.send_all(chunk)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        link.cancel()
