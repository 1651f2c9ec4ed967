"""The no-progress deadline of a model stream (R-SEC-10).

An HTTP client's read timeout starts again with every byte, so a server that sends only
keep-alives — SSE comment lines (``: keep-alive``), Anthropic's ``ping`` events, empty lines,
Chat Completions chunks with an empty delta, repeated ``response.in_progress`` events — would
hold a request open for ever. Progress is what the codec makes of the bytes: a read that
decodes to at least one stream event. A stream with no progress for longer than the read
timeout fails that attempt as ``timeout``, retried like any other (R-RETRY-1, R-RETRY-2).

The lean transport enforces this with its body's own read deadline
(:meth:`~greenroom.actors.providers.lean_http.RawBody.read_deadline` with ``progress=True``);
streams read through httpx or the SDK's httpx2 stack use :class:`ProgressDeadline`, a
cancel scope around the reads whose deadline the reader moves on when a read decodes to
events. Either way the deadline strikes between one read timeout and ``1 + DEADLINE_SLACK``
of them after the last progress, and is moved only when less than a read timeout is left,
so progress on the hot path costs a clock read at most.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, Callable
from types import TracebackType
from typing import Protocol

import trio

from greenroom.actors.providers.base import Deliver, cut_short
from greenroom.actors.providers.lean_http import DEADLINE_SLACK
from greenroom.protocols.stream import ModelError, StreamEvent, StreamFailed


def stalled_message(timeout: float, *, keepalives: bool) -> str:
    """What a stream that stopped making progress is reported as: ``stream stalled: no
    progress for 180 s (only keep-alives)`` when bytes kept coming that decoded to nothing,
    ``stream stalled: read timed out (nothing received for 180 s)`` when nothing came."""
    if keepalives:
        return f"stream stalled: no progress for {timeout:g} s (only keep-alives)"
    return f"stream stalled: read timed out (nothing received for {timeout:g} s)"


def no_response_message(timeout: float | None) -> str:
    """What a request whose response never began within the read timeout is reported as."""
    if timeout is None or timeout == math.inf:
        return "no response from the server (read timeout)"
    return f"no response from the server within {timeout:g} s (read timeout)"


class ProgressDeadline:
    """A cancel scope around the reads of one stream body, whose deadline :meth:`progress`
    moves on: ``with ProgressDeadline(read_timeout) as deadline:`` and ``deadline.progress()``
    after each read that decoded to events; ``deadline.expired`` afterwards says whether it
    ended the reads (the ``with`` statement swallows that cancellation). A read timeout of
    ``None`` or infinity sets no deadline. Not reusable."""

    __slots__ = ("_at", "_now", "_scope", "_timeout", "_window")

    def __init__(self, timeout: float | None) -> None:
        self._timeout = math.inf if timeout is None else float(timeout)
        self._window = self._timeout * (1 + DEADLINE_SLACK)
        self._scope = trio.CancelScope()
        self._at = math.inf
        self._now: Callable[[], float] = trio.current_time

    def __enter__(self) -> ProgressDeadline:
        scope = self._scope
        if self._timeout != math.inf:
            # The clock's own method: progress reads it once per read, without trio's
            # lookups around it.
            self._now = now = trio.lowlevel.current_clock().current_time
            self._at = scope.deadline = now() + self._window
        scope.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        return self._scope.__exit__(kind, exc, traceback)

    @property
    def timeout(self) -> float:
        """The read timeout this deadline enforces, in seconds (infinity: none)."""
        return self._timeout

    @property
    def expired(self) -> bool:
        """Whether the deadline struck: no progress for a read timeout or more."""
        return self._scope.cancelled_caught

    def progress(self) -> None:
        """A read made progress: the deadline is at least a read timeout away again. Moved
        (a change to trio's deadline heap) only when less than a read timeout is left."""
        now = self._now()
        if self._at - now < self._timeout:
            self._at = self._scope.deadline = now + self._window


__all__ = [
    "BodyDecoder",
    "ProgressDeadline",
    "no_response_message",
    "read_library_body",
    "stalled_message",
]


class BodyDecoder(Protocol):
    """A codec's stream decoder, as :func:`read_library_body` feeds it."""

    @property
    def finished(self) -> bool:
        """True once the terminal event has been returned."""

    def feed(self, data: bytes) -> list[StreamEvent]:
        """The events completed by the next bytes of the body."""

    def end_of_stream(self) -> list[StreamEvent]:
        """What the end of the body means for what it holds."""


async def read_library_body(
    chunks: AsyncIterable[bytes],
    decoder: BodyDecoder,
    deliver: Deliver,
    read_timeout: float | None,
    *,
    timeout_error: type[Exception],
    transport_error: type[Exception],
) -> bool:
    """Feed a body an HTTP library streams (the SDK's httpx2, httpx: the library paths;
    ``timeout_error`` and ``transport_error`` are its exceptions) to ``decoder`` and
    deliver what each piece completes. True when the stream has ended (its terminal
    event, a cut or a stall delivered as such); False when the body ended first. Pieces
    that decode to nothing (keep-alives) do not keep the stream alive past the read
    timeout (R-SEC-10)."""
    keepalives = False
    with ProgressDeadline(read_timeout) as deadline:
        try:
            async for chunk in chunks:
                events = decoder.feed(chunk)
                if events:
                    deadline.progress()
                    keepalives = False
                    await deliver(events)
                    if decoder.finished:
                        return True
                else:
                    keepalives = True
        except timeout_error:
            await deliver([_stalled(stalled_message(deadline.timeout, keepalives=False))])
            return True
        except transport_error as exc:
            # The body had begun: a stream cut short, judged by what arrived.
            await deliver(cut_short(decoder.end_of_stream(), exc))
            return True
        return False
    await deliver([_stalled(stalled_message(deadline.timeout, keepalives=keepalives))])
    return True


def _stalled(message: str) -> StreamFailed:
    return StreamFailed(error=ModelError(kind="timeout", message=message))
