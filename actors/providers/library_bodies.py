"""The library paths' response bodies, bounded as the lean transport bounds its own
(R-SEC-1, R-SEC-9).

httpx (the OpenAI providers' library path) inflates each network read of a ``gzip`` or
``deflate`` body whole: 64 KiB of compressed newlines became 64 MiB, whose lines the codec
then held at once, 600 MiB for a body of 256 KiB. httpx2 (the anthropic SDK's) inflates in
pieces of 1 MiB, but the SDK reads an error response's body whole before greenroom sees
it, so a small compressed error body, or a long plain one, held whatever the server made
of it.

Both libraries ask for ``gzip`` and ``deflate`` (their default ``Accept-Encoding``) and a
legitimate server, or a proxy on the way, may use them: a compressed body is therefore read,
not refused. A response hook (:class:`BodyBounds`, installed on the library's client) takes
the body over before the library decodes it: it removes ``content-encoding`` (and the
length of the compressed body) so that the library hands the bytes on as they are, and
inflates them here at most :data:`~greenroom.actors.providers.lean_http.MAX_INFLATED`
bytes a piece, the lean transport's own code; an error response's body ends after
:data:`~greenroom.actors.providers.lean_wire.MAX_ERROR_BODY` bytes, and after the read
timeout and its slack from its first read, as on the lean path: each byte starts the
library's read timeout again, so a body trickled a byte at a time would otherwise hold
the request for ever (R-SEC-10); the bytes that came by then are classified.
An encoding zlib cannot read (``br``, ``zstd``, several stacked), which neither library
asks for, fails the attempt as a protocol error naming it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from typing import Any, Protocol

import trio

from greenroom.actors.providers.lean_http import (
    DEADLINE_SLACK,
    READABLE_ENCODINGS,
    inflated,
    unreadable_encoding,
)
from greenroom.actors.providers.lean_wire import MAX_ERROR_BODY


class _Headers(Protocol):
    def get_list(self, key: str, split_commas: bool = ...) -> list[str]: ...

    def __delitem__(self, key: str) -> None: ...

    def __contains__(self, key: Any) -> bool: ...


class _Response(Protocol):
    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> _Headers: ...

    stream: Any


def body_encoding(response: _Response) -> str:
    """The response's content coding: ``""`` for none (or ``identity``), else the codings
    it names, lower-cased and joined with ``", "``."""
    values = response.headers.get_list("content-encoding", split_commas=True)
    codings = [value.strip().lower() for value in values]
    return ", ".join(coding for coding in codings if coding and coding != "identity")


async def bounded_body(
    raw: AsyncIterable[bytes],
    encoding: str,
    limit: int | None,
    error: Callable[[str], Exception],
    *,
    within: float | None = None,
) -> AsyncGenerator[bytes, None]:
    """The pieces of a body as a library reads them (``raw``, still encoded with
    ``encoding``), inflated a bounded piece at a time, and cut after ``limit`` bytes when
    given, and ``within`` seconds after its first read when given. An encoding that is not
    one of :data:`READABLE_ENCODINGS` raises ``error(message)`` before anything is read."""
    if encoding and encoding not in READABLE_ENCODINGS:
        raise error(unreadable_encoding(encoding))
    reads = aiter(raw)
    inflating = inflated(reads, encoding, error) if encoding else reads
    pieces = inflating if within is None else _ended_after(inflating, within)
    size = 0
    try:
        async for piece in pieces:
            if limit is not None and size + len(piece) >= limit:
                yield piece[: limit - size]
                return
            size += len(piece)
            yield piece
    finally:
        # A cut, or a reader that stops, closes the reads below in this task.
        for generator in (pieces, inflating, reads):
            if isinstance(generator, AsyncGenerator):
                await generator.aclose()


async def _ended_after(pieces: AsyncIterator[bytes], seconds: float) -> AsyncGenerator[bytes, None]:
    """``pieces`` until they end, or until ``seconds`` after the first was asked for: what
    came by then is the whole body. Each wait has a cancel scope of its own, none held
    across a ``yield``; a wait cut short ends the library's reads (its connection is then
    closed, not reused)."""
    deadline = trio.current_time() + seconds
    while True:
        piece = None
        with trio.move_on_at(deadline):
            piece = await anext(pieces, None)
        if piece is None:
            return
        yield piece


class BodyBounds:
    """A response hook for an httpx or httpx2 client (``event_hooks={"response":
    [BodyBounds(...)]}``) that takes each response's body over as the module docstring
    says. ``wrap(inner, pieces)`` builds the library's byte stream that yields ``pieces``
    and closes ``inner``; ``error(message)`` is the library's protocol error, which its
    caller treats as a connection that failed mid-body. A response whose status is
    ``error_from`` or above is an error response, its body bounded in size and, with a
    ``read_timeout``, read within that and ``DEADLINE_SLACK`` of it (the lean path's
    window)."""

    __slots__ = ("_error", "_error_from", "_within", "_wrap")

    def __init__(
        self,
        wrap: Callable[[Any, AsyncGenerator[bytes, None]], Any],
        error: Callable[[str], Exception],
        *,
        read_timeout: float | None = None,
        error_from: int = 400,
    ) -> None:
        self._wrap = wrap
        self._error = error
        self._error_from = error_from
        self._within = None if read_timeout is None else read_timeout * (1 + DEADLINE_SLACK)

    async def __call__(self, response: _Response) -> None:
        """Replace ``response``'s body by its bounded reading, before anything reads it."""
        encoding = body_encoding(response)
        failed = response.status_code >= self._error_from
        limit = MAX_ERROR_BODY if failed else None
        if not encoding and limit is None:
            return
        if "content-encoding" in response.headers:
            del response.headers["content-encoding"]
        if encoding and "content-length" in response.headers:
            del response.headers["content-length"]
        inner = response.stream
        within = self._within if failed else None
        pieces = bounded_body(inner, encoding, limit, self._error, within=within)
        response.stream = self._wrap(inner, pieces)


__all__ = ["READABLE_ENCODINGS", "BodyBounds", "body_encoding", "bounded_body"]
