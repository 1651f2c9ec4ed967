"""The gateway's sockets: a listener that caps how many accepted sockets are open at once,
the streams it hands out, and a listener fed by another task (the HTTP front hands the
websocket handshakes it routed to trio-websocket through one).

A :class:`CountedStream` can be given back bytes already read from it
(:meth:`CountedStream.unread`): the HTTP front reads a request's head to route it, and a
websocket handshake must reach trio-websocket whole. Reading them back costs one
attribute test per read, so the websocket path keeps its one wrapper layer.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

__all__ = ["CappedListener", "CountedStream", "HandedOverListener"]


class CappedListener(trio.abc.Listener["CountedStream"]):
    """A listener that holds at most ``sockets.total_tokens`` accepted sockets open at once:
    beyond that, connections wait in the kernel's backlog (no file descriptor spent)."""

    def __init__(self, inner: trio.SocketListener, sockets: trio.CapacityLimiter) -> None:
        self._inner = inner
        self._sockets = sockets

    async def accept(self) -> CountedStream:
        """The next connection, once fewer than the cap are open."""
        holder = object()
        await self._sockets.acquire_on_behalf_of(holder)
        try:
            stream = await self._inner.accept()
        except BaseException:
            self._sockets.release_on_behalf_of(holder)
            raise
        try:
            peer = str(stream.socket.getpeername()[0])
        except (OSError, IndexError, TypeError):
            peer = "unknown"  # gone already, or not an IP socket
        return CountedStream(stream, lambda: self._sockets.release_on_behalf_of(holder), peer=peer)

    async def aclose(self) -> None:
        """Stop listening."""
        await self._inner.aclose()


class CountedStream(trio.abc.HalfCloseableStream):
    """A socket stream that gives its slot back when it is closed (trio's listener loop
    closes every stream its handler was given); :attr:`closed` is set then."""

    def __init__(self, inner: trio.SocketStream, release: Callable[[], None], *, peer: str) -> None:
        self._inner = inner
        self._release: Callable[[], None] | None = release
        self._unread = b""
        self.peer = peer
        """The address of the peer (an IP address, without the port)."""
        self.closed = trio.Event()
        """Set once the stream is closed (whoever closed it)."""

    def __repr__(self) -> str:
        # What trio-websocket reports as a request's remote end for a stream that is not a
        # bare socket stream (``WebSocketRequest.remote``): the gateway counts wrong
        # tokens by it.
        return self.peer

    def unread(self, data: bytes) -> None:
        """Put ``data`` (read from this stream) back: the next read returns it first."""
        self._unread = data + self._unread

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of ``data`` (trio's ``SendStream.send_all``)."""
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        """Wait until sending might not block (trio's)."""
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Close the sending side (trio's ``HalfCloseableStream.send_eof``)."""
        await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """The bytes given back first (:meth:`unread`), then what arrives."""
        if self._unread:
            data, self._unread = self._unread, b""
            if max_bytes is not None and len(data) > max_bytes:
                data, self._unread = data[:max_bytes], data[max_bytes:]
            return data
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        """Close the socket and give its slot back (once)."""
        try:
            await self._inner.aclose()
        finally:
            self.closed.set()
            release, self._release = self._release, None
            if release is not None:
                release()


class HandedOverListener(trio.abc.Listener[CountedStream]):
    """A listener whose connections another task accepted and hands over on a channel
    (the HTTP front, for the websocket handshakes it routes). Closing it closes the
    channel; a stream handed over is the receiver's to close."""

    def __init__(self, streams: trio.MemoryReceiveChannel[CountedStream]) -> None:
        self._streams = streams

    async def accept(self) -> CountedStream:
        """The next connection handed over."""
        try:
            return await self._streams.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError("the HTTP front has stopped") from None

    async def aclose(self) -> None:
        """Close the channel: nothing more is handed over."""
        await self._streams.aclose()
