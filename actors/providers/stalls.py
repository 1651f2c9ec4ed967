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

The head of a response comes before any of that: the libraries time it read by read as
well, so a head trickled a byte at a time would hold the request for ever.
:class:`HeadDeadline` gives it one read timeout in all on the library paths, as the lean
transport's own head reading does; the library's bounded error bodies
(:mod:`~greenroom.actors.providers.library_bodies`) get a read timeout and its slack, as
the lean transport's do.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, Awaitable, Callable
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Protocol

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


_HEAD: ContextVar[HeadDeadline | None] = ContextVar("greenroom_head_deadline", default=None)
"""The :class:`HeadDeadline` around the current task's request: the library runs the
request, and its hooks and traces, in the task that asked for it."""

_HEAD_STARTED = "receive_response_headers.started"
_HEAD_ENDED = ("receive_response_headers.complete", "receive_response_headers.failed")


class HeadDeadline:
    """The deadline of a request's response head on a library path (R-SEC-10): ``with
    HeadDeadline(read_timeout, library.ReadTimeout):`` around a request sent by a client
    with :func:`time_heads` among its request hooks. From when the library begins to read
    a head (after the request was sent, each redirect's and a proxy's ``CONNECT`` alike)
    until it has it whole, the scope's deadline is one read timeout away: a head trickled a
    byte at a time, or informational responses one after another, fail the request as
    ``error(message)`` (the library's read timeout, so that it is reported as one) once
    that has passed, as on the lean path. The body is not timed here. A read timeout of
    ``None`` or infinity sets no deadline. Not reusable."""

    __slots__ = ("_error", "_scope", "_timeout", "_token")

    def __init__(self, timeout: float | None, error: Callable[[str], Exception]) -> None:
        self._timeout = math.inf if timeout is None else float(timeout)
        self._error = error
        self._scope = trio.CancelScope()
        self._token: Token[HeadDeadline | None] | None = None

    def __enter__(self) -> HeadDeadline:
        self._scope.__enter__()
        if self._timeout != math.inf:
            self._token = _HEAD.set(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        token, self._token = self._token, None
        if token is not None:
            _HEAD.reset(token)
        scope = self._scope
        handled = scope.__exit__(kind, exc, traceback)
        if scope.cancelled_caught:
            raise self._error(f"no response head within {self._timeout:g} s") from None
        return handled

    async def trace(self, name: str, info: dict[str, Any]) -> None:
        """httpcore's ``trace`` extension: the deadline runs while a head is read."""
        if name.endswith(_HEAD_STARTED):
            self._scope.deadline = trio.current_time() + self._timeout
        elif name.endswith(_HEAD_ENDED):
            self._scope.deadline = math.inf


async def time_heads(request: Any) -> None:
    """A request hook for an httpx or httpx2 client (``event_hooks={"request":
    [time_heads]}``): a request sent inside a :class:`HeadDeadline` has its response
    head timed by it, through httpcore's ``trace`` extension; any other is left alone.
    Idempotent: a redirected request, built with the extensions of the one before it,
    arrives with the hook already there, and keeps it once."""
    head = _HEAD.get()
    if head is None:
        return
    other = _without_head_timing(request.extensions.get("trace"))
    request.extensions["trace"] = head.trace if other is None else _HeadThen(head, other)


_Trace = Callable[[str, dict[str, Any]], Awaitable[None]]


class _HeadThen:
    """A ``trace`` extension that gives each event to a head deadline, then to the trace
    that was there before it."""

    __slots__ = ("head", "other")

    def __init__(self, head: HeadDeadline, other: _Trace) -> None:
        self.head = head
        self.other = other

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        await self.head.trace(name, info)
        await self.other(name, info)


def _without_head_timing(trace: _Trace | None) -> _Trace | None:
    """``trace`` without what :func:`time_heads` put in it (a head deadline's hook, alone
    or in front of another): what was there before it."""
    if isinstance(trace, _HeadThen):
        return trace.other
    if isinstance(getattr(trace, "__self__", None), HeadDeadline):
        return None
    return trace


__all__ = [
    "BodyDecoder",
    "HeadDeadline",
    "ProgressDeadline",
    "no_response_message",
    "read_library_body",
    "stalled_message",
    "time_heads",
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
