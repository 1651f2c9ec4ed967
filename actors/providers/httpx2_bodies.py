"""A bounded response body for httpx2 clients (the anthropic SDK's, and the one greenroom
builds for the MCP SDK's streamable HTTP): :class:`BoundedStream`, what a response hook puts
in place of the library's own body (:mod:`~greenroom.actors.providers.library_bodies`)."""

from __future__ import annotations

import datetime
from collections.abc import AsyncGenerator, AsyncIterator

import httpx2

__all__ = ["BoundedStream"]


class BoundedStream(httpx2.AsyncByteStream):
    """A response body read through :func:`~greenroom.actors.providers.library_bodies.
    bounded_body`: yields ``pieces``, and closing it closes the library's own ``inner``."""

    def __init__(self, inner: httpx2.AsyncByteStream, pieces: AsyncGenerator[bytes, None]) -> None:
        self._inner = inner
        self._pieces = pieces

    @property
    def elapsed(self) -> datetime.timedelta | None:
        """The library's own body's ``elapsed``, which ``httpx2.Response.elapsed`` reads."""
        elapsed: datetime.timedelta | None = getattr(self._inner, "elapsed", None)
        return elapsed

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self._pieces:
            yield piece

    async def aclose(self) -> None:
        """Stop reading and give the connection back (closed when the body was cut)."""
        await self._pieces.aclose()
        await self._inner.aclose()
