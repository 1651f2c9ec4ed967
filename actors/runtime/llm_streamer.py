"""The LLM streamer: provider I/O for one session task, one request at a time.

The supervisor starts one :meth:`LLMStreamer.stream_attempt` per attempt of a turn. The
streamer sleeps the planned backoff first (a sleep that ``backoff.skip()`` ends early, R-RETRY-5),
then waits for the endpoint's admission (:mod:`~greenroom.actors.runtime.admission`,
R-SHARE-1), then drives the provider adapter and forwards every parsed batch of stream events
to the supervisor's inbox. Providers translate their own and their libraries' errors into a
``StreamFailed`` event at one boundary, so the streamer never sees an exception other than
cancellation.

The admission wait is part of the attempt, after its ``request_begin``: it is never a failed
attempt and spends none of the retries, and an interrupt ends it at once, as it ends a
backoff. A skip ends the session's own backoff only: a pause the provider asked of the
endpoint, and the configured limits, hold for every session alike. After a failed attempt
the planned backoff already covers the endpoint's pause (the failure carries it as its
``retry_after_s``), so the wait shows in ``request_end.retry_in_ms``; a wait before an
attempt that follows no failure shows as a later first token.

A task's streamer bills what a stream has begun (R-SHARE-3, given a
:class:`~greenroom.actors.runtime.accounting.RequestBilling`): the first batch of a
stream that goes on, unless it is only the request's refusal, is handed on once the
request's ``started`` row is committed to the usage ledger. A provider task whose
``usage_at_end`` is true (OpenAI's: usage comes with a stream's last events) has its first
batch begin with a ``UsageReported`` of the request's estimated input, so that a stream cut
before its end is counted at that estimate wherever a cut stream's usage is (the task's
``token_usage``, the ledger, the budgets). Nothing of this touches the batches after it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, assert_never

import trio

from greenroom.actors.providers.base import ModelProvider, ProviderTask, exception_words
from greenroom.actors.runtime.admission import EndpointAdmission, Requester
from greenroom.actors.runtime.user_code import call_user_code
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.messages import (
    PlanBackoff,
    SkipBackoff,
    StartAttempt,
    StreamBatch,
    StreamerCommand,
    SupervisorMessage,
)
from greenroom.protocols.stream import (
    MessageCompleted,
    ModelError,
    StreamEvent,
    StreamFailed,
    UsageReported,
)

if TYPE_CHECKING:
    from greenroom.actors.runtime.accounting import RequestBilling

__all__ = ["Backoff", "LLMStreamer", "ModelProvider", "ProviderTask"]

logger = logging.getLogger(__name__)

_ENDINGS = frozenset({MessageCompleted, StreamFailed})


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

    async def sleep(self, seconds: float) -> bool:
        """The planned wait; True when a skip ended it (or came before it). Cancel-safe."""
        try:
            if self._skipped:
                return True
            if seconds > 0:
                with trio.CancelScope() as scope:
                    self._scope = scope
                    await trio.sleep(seconds)
                return scope.cancelled_caught
            return False
        finally:
            self._scope = None
            self._planned = False
            self._skipped = False


class LLMStreamer:
    """The LLM streamer of one task: an actor that owns the provider task (its request
    encoder) and the reconnect backoff, and runs one attempt at a time on command.

    Start it with ``await nursery.start(streamer.run, commands)``; it serves
    :data:`~greenroom.protocols.messages.StreamerCommand` messages until the channel is
    closed or the task is cancelled, and reports to the supervisor's inbox only.
    ``requester`` is the session's place at its endpoint's admission; without one the
    streamer has an admission point of its own. ``billing``: the ledger rows of a task's
    requests as their streams begin (see the module docstring); None bills nothing here."""

    __slots__ = ("_backoff", "_billing", "_estimates", "_inbox", "_provider", "_requester")

    def __init__(
        self,
        provider: ProviderTask,
        inbox: trio.MemorySendChannel[SupervisorMessage],
        requester: Requester | None = None,
        billing: RequestBilling | None = None,
    ) -> None:
        self._provider = provider
        self._inbox = inbox
        self._backoff = Backoff()
        self._requester = requester or Requester(EndpointAdmission(), "", "")
        self._billing = billing
        self._estimates = billing is not None and getattr(provider, "usage_at_end", False) is True

    async def run(
        self,
        commands: trio.MemoryReceiveChannel[StreamerCommand],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve commands: each attempt in a task of its own, so that a skip reaches a
        wait while it runs. Cancel-safe. Once ``commands`` is closed an attempt still
        running is stale: it is cancelled."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            with commands:
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
            nursery.cancel_scope.cancel()

    async def _stream_attempt(
        self, request: ModelRequest, attempt: int, delay_ms: int, number: int, inbox: Any
    ) -> None:
        """Wait ``delay_ms`` (the planned backoff) and the endpoint's admission, then stream
        one attempt into ``inbox``. Cancel-safe: cancellation stops the sleep, the wait or
        the stream at once and delivers nothing more."""
        billing = self._billing
        if billing is not None:
            billing.next_request()
        skipped = delay_ms > 0 and await self._backoff.sleep(delay_ms / 1000)
        permit = self._requester.admit_now()
        if permit is None and skipped:
            # A person asked to retry now (R-RETRY-5): the provider's pause does not hold
            # this one request back; a new refusal pauses the endpoint again.
            permit = self._requester.admission.admit_past_pause()
        if permit is None:
            permit = await self._requester.admit(request)
        observe = permit.observe
        first = billing is not None

        async def deliver(events: list[StreamEvent]) -> None:
            nonlocal first
            # The endpoint learns from a request's first batch and from its last, before
            # the supervisor sees them (a rate limit pauses the endpoint first).
            if permit.watching or (events and events[-1].__class__ in _ENDINGS):
                events = observe(events)
            if first and events:
                first = False
                assert billing is not None
                events = await self._bill(billing, request, events)
            inbox.send_nowait(StreamBatch(attempt=attempt, events=events, request=number))

        try:
            _, failed = await call_user_code(self._provider.stream, request, deliver)
            if failed is not None:  # a provider bug must not take the session down
                # The traceback goes to the log for whoever fixes the bug; the request's
                # reader gets words, not a repr. (A failure that came with a cancellation
                # is not returned: the attempt is stale, nothing more is delivered.)
                logger.error("provider failed unexpectedly", exc_info=failed)
                detail = "" if isinstance(failed, LookupError) else exception_words(failed)
                failure = ModelError(
                    kind="failed",
                    message="the provider failed unexpectedly"
                    + (f": {detail}" if detail else "")
                    + " (the traceback is in the log)",
                )
                await deliver([StreamFailed(error=failure)])
        finally:
            permit.release()

    async def _bill(
        self, billing: RequestBilling, request: ModelRequest, events: list[StreamEvent]
    ) -> list[StreamEvent]:
        """The stream's first batch, once what it bills is in the ledger (see the module
        docstring); returns the batch to hand on."""
        if events[0].__class__ is StreamFailed:
            return events  # refused before its response began: not billed
        reported = next((e.usage for e in events if isinstance(e, UsageReported)), None)
        if reported is None:
            if not self._estimates:
                return events  # its usage comes with its end, and is recorded then
            reported = billing.estimate(request)
            events = [UsageReported(usage=reported), *events]
        if events[-1].__class__ in _ENDINGS:
            return events  # its last row follows at once: no row to write first
        try:
            await billing.began(reported)
        except BaseException:
            # Cancelled before the batch went on: the supervisor never sees the request
            # begin, so nobody else records it.
            billing.cut(reported)
            raise
        return events
