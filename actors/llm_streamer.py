"""The LLM streamer: provider I/O for one session task, one request at a time.

The supervisor starts one :meth:`LLMStreamer.stream_attempt` per attempt of a turn. The
streamer sleeps the planned backoff first (a sleep that ``skip_wait`` ends early, R-RETRY-5),
then drives the provider adapter and forwards every parsed batch of stream events to the
supervisor's inbox. Providers translate their own and their libraries' errors into a
``StreamFailed`` event at one boundary, so the streamer never sees an exception other than
cancellation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from greenroom.protocols.context import ModelRequest
from greenroom.protocols.messages import StreamBatch, SupervisorMessage
from greenroom.protocols.stream import ModelError, StreamEvent, StreamFailed

Deliver = Callable[[list[StreamEvent]], Awaitable[None]]


class ProviderTask(Protocol):
    """A provider bound to one task: holds per-task state such as the request encoder
    that reuses earlier turns' encodings (dropped with the task, so idle sessions keep no
    copy of their history in wire form).

    ``stream`` sends ``request`` and delivers the parsed events in batches (one batch per
    network read: it amortises the cost per event). It delivers exactly one terminal
    event (``MessageCompleted`` or ``StreamFailed``) as the last event and never raises,
    except ``trio.Cancelled`` when the task is interrupted.
    """

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None: ...


class ModelProvider(Protocol):
    """A model service adapter, shared by the sessions of a host (one client, one pool)."""

    name: str

    def open_task(self) -> ProviderTask: ...

    async def aclose(self) -> None: ...


class LLMStreamer:
    """Runs attempts for one task and forwards their events to the supervisor."""

    __slots__ = ("_backoff_scope", "_inbox", "_provider", "_skip_pending")

    def __init__(
        self, provider: ProviderTask, inbox: trio.MemorySendChannel[SupervisorMessage]
    ) -> None:
        self._provider = provider
        self._inbox = inbox
        self._backoff_scope: trio.CancelScope | None = None
        # A skip that arrives while no sleep is in progress — typically right after the
        # request_end that announces the wait, before the next attempt's task has begun
        # its sleep — applies to the next sleep; each stream start clears it.
        self._skip_pending = False

    def skip_wait(self) -> bool:
        """End the current backoff sleep early; when none is in progress (yet), the next
        one is skipped unless a stream starts first. False when no sleep was running."""
        if self._backoff_scope is None:
            self._skip_pending = True
            return False
        self._backoff_scope.cancel()
        return True

    async def stream_attempt(self, request: ModelRequest, attempt: int, delay_ms: int) -> None:
        """Wait ``delay_ms``, then stream one attempt. Cancel-safe: cancellation stops the
        sleep or the stream at once and delivers nothing more."""
        if delay_ms > 0 and not self._skip_pending:
            with trio.CancelScope() as scope:
                self._backoff_scope = scope
                await trio.sleep(delay_ms / 1000)
            self._backoff_scope = None
        inbox = self._inbox

        async def deliver(events: list[StreamEvent]) -> None:
            inbox.send_nowait(StreamBatch(attempt=attempt, events=events))

        self._skip_pending = False
        try:
            await self._provider.stream(request, deliver)
        except trio.Cancelled:
            raise
        except Exception as exc:  # a provider bug must not take the session down
            failure = ModelError(kind="failed", message=f"provider error: {exc!r}")
            await deliver([StreamFailed(error=failure)])
