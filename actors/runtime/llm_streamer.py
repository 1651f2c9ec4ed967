"""The LLM streamer: provider I/O for one session task, one request at a time.

The supervisor starts one :meth:`LLMStreamer.stream_attempt` per attempt of a turn. The
streamer sleeps the planned backoff first (a sleep that ``backoff.skip()`` ends early, R-RETRY-5),
then drives the provider adapter and forwards every parsed batch of stream events to the
supervisor's inbox. Providers translate their own and their libraries' errors into a
``StreamFailed`` event at one boundary, so the streamer never sees an exception other than
cancellation.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, assert_never

import attrs
import trio

from greenroom.protocols.context import ModelRequest
from greenroom.protocols.messages import (
    PlanBackoff,
    SkipBackoff,
    StartAttempt,
    StreamBatch,
    StreamerCommand,
    SupervisorMessage,
)
from greenroom.protocols.stream import ModelError, StreamEvent, StreamFailed

Deliver = Callable[[list[StreamEvent]], Awaitable[None]]

logger = logging.getLogger(__name__)

_CONNECT_REASONS: tuple[tuple[type[OSError], str], ...] = (
    (ConnectionRefusedError, "connection refused by {where}"),
    (ConnectionResetError, "connection reset by {where}"),
    (TimeoutError, "connecting to {where} timed out"),
)

# What an HTTP library's transport error (httpx's and httpx2's share their class names)
# means to someone reading a failed request, most specific class first along the MRO.
_TRANSPORT_WORDS: dict[str, str] = {
    "ReadError": "connection dropped while reading the response",
    "WriteError": "connection dropped while sending the request",
    "RemoteProtocolError": "bad HTTP from the server",
    "LocalProtocolError": "the request could not be sent as HTTP",
    "ProxyError": "the proxy refused the request",
    "UnsupportedProtocol": "unsupported URL scheme",
    "ConnectError": "cannot connect to the server",
    "ReadTimeout": "timed out reading the response",
    "WriteTimeout": "timed out sending the request",
    "ConnectTimeout": "timed out connecting to the server",
    "PoolTimeout": "timed out waiting for a free connection",
    "NetworkError": "network error",
    "TimeoutException": "timed out",
}
_ERRNO_PREFIX = re.compile(r"^\[Errno -?\d+\] ")
_DROPPED = ("peer closed connection", "Server disconnected")


def _detail(exc: BaseException) -> str:
    """An exception's own words, without an ``[Errno N]`` prefix; "" when it has none."""
    return _ERRNO_PREFIX.sub("", " ".join(str(exc).split()))


def transport_failure(exc: BaseException) -> str:
    """What a reader of a failed request is told about a transport error of an HTTP
    library: what happened in words (``connection dropped while reading the response``),
    then the library's own detail in parentheses when it has one — never a class name
    alone, never a repr."""
    words = "connection failed"
    for cls in type(exc).__mro__:
        found = _TRANSPORT_WORDS.get(cls.__name__)
        if found is not None:
            words = found
            break
    detail = _detail(exc)
    if detail.startswith(_DROPPED):
        # httpcore's words for a body or response the server cut off.
        words = "connection dropped by the server"
    return f"{words} ({detail})" if detail and detail.lower() != words else words


def cut_short(events: list[StreamEvent], exc: BaseException) -> list[StreamEvent]:
    """The decoder's final events for a body the connection dropped part-way
    (``decoder.end_of_stream()``): a stream cut short is ``malformed`` (R-RETRY-1) unless it
    had already proven complete; the failure names the drop."""
    if events and isinstance(events[-1], StreamFailed):
        error = events[-1].error
        failed = StreamFailed(
            error=attrs.evolve(error, message=f"{error.message}; {transport_failure(exc)}")
        )
        return [*events[:-1], failed]
    return events


def _where(url: str) -> str:
    """``host:port`` of ``url`` (the scheme's port when it names none), IPv6 in brackets."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:
        return url
    if not host:
        return url
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}" if port else host


def connect_failure(url: str, exc: BaseException) -> str:
    """What the user reads when a connection to ``url`` could not be opened: what happened,
    naming the operating system's reason found anywhere in the exception's causes (exception
    groups included), then the URL: ``connection refused by 127.0.0.1:8080 (cannot connect
    to http://127.0.0.1:8080/v1/messages)``; else the library's own words. Such a failure
    stays retryable: a server may be starting up."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    gai = False
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for cls, reason in _CONNECT_REASONS:
            if isinstance(current, cls):
                return f"{reason.format(where=_where(url))} (cannot connect to {url})"
        if current.__class__.__name__ == "gaierror":
            gai = True
        pending.extend(getattr(current, "exceptions", ()) or ())
        for link in (current.__cause__, current.__context__):
            if link is not None:
                pending.append(link)
    if gai:
        host = urllib.parse.urlsplit(url).hostname or url
        return f"unknown host {host} (cannot connect to {url})"
    return f"cannot connect to {url} ({_detail(exc) or 'connection failed'})"


class ProviderTask(Protocol):
    """A provider bound to one task: holds per-task state such as the request encoder
    that reuses earlier turns' encodings (dropped with the task, so idle sessions keep no
    copy of their history in wire form).

    ``stream`` sends ``request`` and delivers the parsed events in batches (one batch per
    network read: it amortises the cost per event). It delivers exactly one terminal
    event (``MessageCompleted`` or ``StreamFailed``) as the last event and never raises,
    except ``trio.Cancelled`` when the task is interrupted.
    """

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        """Send ``request`` and deliver its events through ``deliver`` (see the class docstring)."""


class ModelProvider(Protocol):
    """A model service adapter, shared by the sessions of a host (one client, one pool)."""

    name: str

    def open_task(self) -> ProviderTask:
        """A new per-task adapter; the task drops it when it ends."""

    async def aclose(self) -> None:
        """Close the provider's clients; the host does when it shuts down."""


class Backoff:
    """One reconnect wait at a time that ``skip`` can end early (R-RETRY-5), shared by
    the streamer and the compactor so both follow one rule: a skip counts from the moment
    a wait is planned (announced in ``request_end.retry_in_ms``) until that wait ends — a
    skip pressed before its sleep has begun still ends it — and is ignored otherwise."""

    __slots__ = ("_planned", "_scope", "_skipped")

    def __init__(self) -> None:
        self._planned = False
        self._skipped = False
        self._scope: trio.CancelScope | None = None

    def plan(self) -> None:
        """A wait has been decided (and announced); the next :meth:`sleep` is it."""
        self._planned = True
        self._skipped = False

    def skip(self) -> bool:
        """End the planned or running wait; False when there is none."""
        if self._scope is not None:
            self._scope.cancel()
            return True
        if self._planned:
            self._skipped = True
            return True
        return False

    async def sleep(self, seconds: float) -> None:
        """The planned wait. Cancel-safe."""
        try:
            if seconds > 0 and not self._skipped:
                with trio.CancelScope() as scope:
                    self._scope = scope
                    await trio.sleep(seconds)
        finally:
            self._scope = None
            self._planned = False
            self._skipped = False


class LLMStreamer:
    """The LLM streamer of one task: an actor that owns the provider task (its request
    encoder) and the reconnect backoff, and runs one attempt at a time on command.

    Start it with ``await nursery.start(streamer.run, commands)``; it serves
    :data:`~greenroom.protocols.messages.StreamerCommand` messages until the channel is
    closed or the task is cancelled, and reports to the supervisor's inbox only."""

    __slots__ = ("_backoff", "_inbox", "_provider")

    def __init__(
        self, provider: ProviderTask, inbox: trio.MemorySendChannel[SupervisorMessage]
    ) -> None:
        self._provider = provider
        self._inbox = inbox
        self._backoff = Backoff()

    async def run(
        self,
        commands: trio.MemoryReceiveChannel[StreamerCommand],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve commands: each attempt in a task of its own, so that a skip reaches a
        wait while it runs. Cancel-safe."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            async with commands:
                async for command in commands:
                    match command:
                        case StartAttempt():
                            nursery.start_soon(
                                self._stream_attempt,
                                command.request,
                                command.attempt,
                                command.delay_ms,
                                command.number,
                                command.reply or self._inbox,
                            )
                        case PlanBackoff():
                            self._backoff.plan()
                        case SkipBackoff():
                            self._backoff.skip()
                        case _:
                            assert_never(command)

    async def _stream_attempt(
        self, request: ModelRequest, attempt: int, delay_ms: int, number: int, inbox: Any
    ) -> None:
        """Wait ``delay_ms`` (the planned backoff), then stream one attempt into ``inbox``.
        Cancel-safe: cancellation stops the sleep or the stream at once and delivers
        nothing more."""
        if delay_ms > 0:
            await self._backoff.sleep(delay_ms / 1000)

        async def deliver(events: list[StreamEvent]) -> None:
            inbox.send_nowait(StreamBatch(attempt=attempt, events=events, request=number))

        try:
            await self._provider.stream(request, deliver)
        except trio.Cancelled:
            raise
        except Exception as exc:  # a provider bug must not take the session down
            # The traceback goes to the log for whoever fixes the bug; the request's reader
            # gets words, not a repr.
            logger.exception("provider failed unexpectedly")
            detail = "" if isinstance(exc, LookupError) else _detail(exc)
            failure = ModelError(
                kind="failed",
                message="the provider failed unexpectedly"
                + (f": {detail}" if detail else "")
                + " (the traceback is in the log)",
            )
            await deliver([StreamFailed(error=failure)])
