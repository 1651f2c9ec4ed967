"""A subprocess's output read line by line, for tests and benchmarks that watch a log."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio


async def lines_of(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    """Each complete line of ``stream`` (without its newline, undecodable bytes replaced),
    until it ends; a last line without a newline is dropped, as it was never finished."""
    buffered = b""
    async for chunk in stream:
        buffered += chunk
        *lines, buffered = buffered.split(b"\n")
        for raw in lines:
            yield raw.decode(errors="replace")
