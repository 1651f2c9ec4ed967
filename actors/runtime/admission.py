"""The admission point of a provider endpoint: every model request passes it before it is
sent (R-SHARE-1, R-SHARE-2).

A host keeps one :class:`EndpointAdmission` per endpoint and credential in its
:class:`ProviderAdmissions`: the provider clients that name the same endpoint
(``endpoint_identity``: provider, base URL, a hash of the key) share one, whether the
host made them (:class:`~greenroom.actors.runtime.provider_clients.ProviderClients`, one
per provider and base URL as written) or a program passed them; a client that names none
(the scripted model, a program's own adapter) has one of its own. Every session,
subagent, compaction and title request that uses the client asks it, through the
session's :class:`Requester`, in the LLM streamer: after the attempt's backoff sleep,
before the request goes out. The :class:`RequestPermit` it gives is held until the
request has ended.

What holds for all of an endpoint's requests together:

* **Configured limits** (:class:`ProviderLimits`): requests in flight, and requests, input
  tokens and output tokens in any :data:`WINDOW_S` seconds. A request's tokens are
  estimated when it is admitted — input at 4 characters a token, output at its
  ``max_tokens`` (as Anthropic counts output tokens until the response ends) — and the
  estimate is replaced by the usage the response reports; a request the provider refused
  before reading it counts no tokens. A request larger than a whole token limit is admitted
  when nothing else is counted in the window, so that it is never starved.
* **Limits learned from the provider**, configured limits or not. A 429 or 529 answer
  pauses the endpoint for the wait the provider asked (``retry-after``, or a rate-limit
  reset header: :func:`~greenroom.protocols.retry.parse_retry_after`; never longer than
  its cap, :data:`~greenroom.protocols.retry.RETRY_AFTER_CAP_S`), so that the other
  sessions wait instead of each retrying into it, and sets the endpoint's concurrency
  window to what it was seen to bear: the most requests it accepted at once since its last
  such answer, or, when more, the requests still in flight beside the refused one. Before
  its first such answer an endpoint is opened gradually, as TCP opens a connection:
  :data:`INITIAL_WINDOW` requests at once, and one more for each request it accepts while
  at least half the window is in use, which doubles the window every round trip.
  :data:`LEARNED_FOR_S` after the last rate-limit answer the window grows that way again.
* **Fairness**: requests that wait are admitted round-robin across principals, then
  across the sessions of a principal, then in arrival order; so a principal with 900
  sessions waiting does not starve one with 3. A long request (a compaction) holds one
  place while it runs, like any other.

A wait is the caller's: it ends when the caller is cancelled (an interrupt ends the task
at once) and nothing is left behind — a request admitted just as its caller was cancelled
gives its place back, and counts in no per-minute limit. Waiting never fails; the
streamer's own rules decide what a failed attempt is (R-RETRY).

Hosts that share limits (a cluster's, R-SHARE-1 across hosts) give
:class:`ProviderAdmissions` a :class:`SharedEndpoints`: each endpoint's admission point is
then theirs (an :class:`AdmissionPoint`), with this module's :class:`EndpointAdmission` as
the host's own part of it. Without one — a single host — nothing here changes.

Invariants: ``in_flight`` counts the permits not yet released; a permit is admitted only
while ``in_flight`` is below the window and the configured cap, no pause is in force, and
every configured window has room; the learned window is never below one. The module reads
the trio clock and sets trio events, and does nothing else.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Final, Protocol

import attrs
import trio

from greenroom.protocols.content import TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.retry import RETRY_AFTER_CAP_S
from greenroom.protocols.stream import (
    MessageCompleted,
    ModelError,
    StreamEvent,
    StreamFailed,
    TokenUsage,
)

__all__ = [
    "INITIAL_WINDOW",
    "LEARNED_FOR_S",
    "RATE_LIMIT_STATUSES",
    "WINDOW_S",
    "AdmissionPoint",
    "EndpointAdmission",
    "PermitReports",
    "ProviderAdmissions",
    "ProviderLimits",
    "RequestPermit",
    "Requester",
    "SharedEndpoints",
    "estimate_input_tokens",
]

WINDOW_S: Final = 60.0
"""The span of the per-minute limits."""

INITIAL_WINDOW: Final = 32
"""Requests an endpoint takes at once before it has accepted any."""

LEARNED_FOR_S: Final = 60.0
"""How long a window learned from a rate-limit answer holds before it grows again."""

RATE_LIMIT_STATUSES: Final = frozenset({429, 529})
"""The answers that say the endpoint has more than it takes: rate limited, overloaded."""

_CHARS_PER_TOKEN = 4


def _at_least_one(name: str) -> Any:
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(
                f"ProviderLimits.{name} must be a whole number of at least 1, or None for "
                f"no limit; got {value!r}"
            )

    return check


@attrs.frozen(kw_only=True)
class ProviderLimits:
    """Limits that hold for every model request of a host to one provider endpoint and
    credential, whichever session, subagent, compaction or title sends it (R-SHARE-1):
    requests in flight at once, and requests, input tokens and output tokens per minute.
    None is no limit. Limits the provider makes known (429 / 529 with ``retry-after``)
    apply as well, with or without these. ``Host.open(limits=…)``; the command line's
    ``--max-concurrent-requests`` and ``--requests-per-minute``. Raises
    :class:`ConfigurationError` for a value that is not a whole number of at least 1."""

    max_concurrent_requests: int | None = attrs.field(
        default=None, validator=_at_least_one("max_concurrent_requests")
    )
    requests_per_minute: int | None = attrs.field(
        default=None, validator=_at_least_one("requests_per_minute")
    )
    input_tokens_per_minute: int | None = attrs.field(
        default=None, validator=_at_least_one("input_tokens_per_minute")
    )
    output_tokens_per_minute: int | None = attrs.field(
        default=None, validator=_at_least_one("output_tokens_per_minute")
    )


NO_LIMITS = ProviderLimits()


def estimate_input_tokens(request: ModelRequest) -> int:
    """A request's input size before the provider counts it: 4 characters a token over
    the system prompt, the tool descriptions and every message's text, thinking, tool
    calls and tool results. Rough, and replaced by the real count when it arrives."""
    size = len(request.system or "")
    for schema in request.tools:
        size += len(schema.name) + len(schema.description) + len(str(schema.input_schema))
    for message in request.messages:
        for part in message.content:
            if isinstance(part, TextBlock | ThinkingBlock):
                size += len(part.text)
            elif isinstance(part, ToolCallBlock):
                size += len(part.name) + len(str(part.arguments))
            elif isinstance(part, ToolResult):
                size += sum(len(b.text) for b in part.content if isinstance(b, TextBlock))
    return max(1, size // _CHARS_PER_TOKEN)


class _Counted:
    """One request's amount in a per-minute window; ``live`` while it is counted."""

    __slots__ = ("amount", "at", "live")

    def __init__(self, at: float, amount: int) -> None:
        self.at = at
        self.amount = amount
        self.live = True


class _MinuteWindow:
    """What was admitted in the last :data:`WINDOW_S` seconds, against ``limit``."""

    __slots__ = ("entries", "limit", "total")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: deque[_Counted] = deque()
        self.total = 0

    def has_room(self, amount: int, now: float) -> bool:
        entries = self.entries
        # ``at + WINDOW_S``, as :meth:`room_at` says it: ``now - WINDOW_S`` rounds apart
        # from it, and a waiter woken at ``room_at`` would find no room and sleep until
        # that same instant again, for ever.
        while entries and entries[0].at + WINDOW_S <= now:
            gone = entries.popleft()
            gone.live = False
            self.total -= gone.amount
        # A request larger than the whole limit goes when nothing else is counted.
        return self.total + amount <= self.limit or not entries

    def room_at(self) -> float:
        """When the oldest amount leaves the window (call when there is no room)."""
        return self.entries[0].at + WINDOW_S

    def add(self, amount: int, now: float) -> _Counted:
        counted = _Counted(now, amount)
        self.entries.append(counted)
        self.total += amount
        return counted

    def settle(self, counted: _Counted, amount: int) -> None:
        """Replace an estimate with the real amount (nothing once it has left)."""
        if counted.live:
            self.total += amount - counted.amount
            counted.amount = amount


class _Waiter:
    """A request waiting for admission; ``permit`` is set when it is admitted."""

    __slots__ = ("event", "input_tokens", "output_tokens", "permit", "principal", "scope",
                 "session")

    def __init__(self, principal: str, session: str, input_tokens: int, output_tokens: int):
        self.principal = principal
        self.session = session
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.event = trio.Event()
        self.permit: RequestPermit | None = None
        self.scope = trio.CancelScope()


class PermitReports(Protocol):
    """Whom a :class:`RequestPermit` tells what became of its request: the admission point
    that granted it (:class:`EndpointAdmission`, or a cluster's, which passes the reports
    on to the host that admits for the whole cluster)."""

    def accepted(self) -> None:
        """The provider accepted a request of this grantor's (its response began)."""

    def settle(self, permit: RequestPermit, input_tokens: int, output_tokens: int) -> None:
        """``permit``'s real token counts replace its estimates."""

    def rate_limited(self, permit: RequestPermit, retry_after_s: float | None) -> None:
        """``permit``'s request got a 429 or 529 asking for ``retry_after_s``."""

    def release(self, permit: RequestPermit) -> None:
        """``permit``'s request has ended."""

    def pause_remaining(self) -> float:
        """Seconds until the endpoint's pause ends; 0 when none is in force."""
        ...

    def lift_pause(self) -> None:
        """A request sent past the pause was accepted: the pause is over."""


class RequestPermit:
    """An admitted request's place at its endpoint, held until :meth:`release`.

    The streamer hands it the request's first batch of events and its terminal batch
    (:meth:`observe`); from them the endpoint learns that the request was accepted, its real
    usage, and a rate-limit answer. Unit tests may call :meth:`accepted`, :meth:`settle` and
    :meth:`rate_limited` directly."""

    __slots__ = ("_admission", "_released", "input_counted", "is_accepted", "output_counted",
                 "past_pause", "request_counted", "watching")

    def __init__(self, admission: PermitReports) -> None:
        self._admission = admission
        self._released = False
        self.is_accepted = False
        self.past_pause = False
        """Sent while the provider's pause was in force, because a person asked to."""
        self.watching = True
        """True until the request's first batch has been observed."""
        self.input_counted: _Counted | None = None
        """Its estimated input tokens as counted in the endpoint's window, if counted."""
        self.output_counted: _Counted | None = None
        """Its estimated output tokens as counted in the endpoint's window, if counted."""
        self.request_counted: _Counted | None = None
        """It, as counted in the endpoint's requests-per-minute window, if counted."""

    def observe(self, events: list[StreamEvent]) -> list[StreamEvent]:
        """The request's first batch, or a batch that ends it: what the endpoint learns
        from it. Returns the batch to deliver: a failure while the endpoint is paused
        carries the pause as its ``retry_after_s``, so that the session's retry is planned
        (and announced in ``request_end.retry_in_ms``) to follow the endpoint's pause."""
        if not events:
            return events
        last = events[-1]
        if self.watching:
            self.watching = False
            if events[0].__class__ is not StreamFailed:
                self.accepted()
        if last.__class__ is MessageCompleted:
            if self.input_counted is not None or self.output_counted is not None:
                self.settle(last.usage)
        elif last.__class__ is StreamFailed:
            error = last.error
            raised = self.failed(error)
            if raised is not error:
                events = [*events[:-1], StreamFailed(error=raised)]
        return events

    def accepted(self) -> None:
        """The provider accepted the request (its response began)."""
        if not self.is_accepted and not self._released:
            self.is_accepted = True
            self._admission.accepted()
            if self.past_pause:
                # Sent past the pause and accepted: the provider's pause is over.
                self._admission.lift_pause()

    def settle(self, usage: TokenUsage) -> None:
        """The request's real usage replaces its estimate in the per-minute windows (input
        is fresh input plus cache writes: what providers count against input limits)."""
        self._admission.settle(self, usage.input + usage.cache_write, usage.output)

    def failed(self, error: ModelError) -> ModelError:
        """The request failed with ``error``: a rate-limit answer teaches the endpoint; a
        request refused before it was read counts no tokens. Returns ``error``, with the
        endpoint's pause as its wait when that is longer."""
        # An exhausted quota comes as a 429 too, but no wait cures it: it teaches nothing.
        if error.status_code in RATE_LIMIT_STATUSES and not error.permanent:
            self.rate_limited(error.retry_after_s)
        if not self.is_accepted:
            self._admission.settle(self, 0, 0)
        pause = self._admission.pause_remaining()
        asked = error.retry_after_s
        # An endless or NaN wait is no wait to the retry policy: the pause replaces it.
        if pause > 0 and not (asked is not None and math.isfinite(asked) and asked >= pause):
            return attrs.evolve(error, retry_after_s=pause)
        return error

    def rate_limited(self, retry_after_s: float | None) -> None:
        """The provider answered 429 or 529, asking for ``retry_after_s`` (or nothing)."""
        self._admission.rate_limited(self, retry_after_s)

    def release(self) -> None:
        """The request has ended: its place is free. Idempotent."""
        if not self._released:
            self._released = True
            self._admission.release(self)


# principal -> session -> that session's waiting requests, each level in serving order.
_Queue = OrderedDict[str, OrderedDict[str, deque[_Waiter]]]


class EndpointAdmission:
    """The admission point of one provider endpoint and credential (see the module
    docstring). Not thread-safe: it lives on the host's trio loop."""

    __slots__ = (
        "_accepted",
        "_cap",
        "_growing",
        "_in_flight",
        "_input",
        "_learned_at",
        "_limit",
        "_output",
        "_paused_until",
        "_peak",
        "_queue",
        "_ready_at",
        "_requests",
        "_timed",
        "_waiting",
        "_window",
        "limits",
        "on_pause",
        "rate_limit_answers",
    )

    def __init__(self, limits: ProviderLimits = NO_LIMITS) -> None:
        self.limits = limits
        self._cap = limits.max_concurrent_requests or math.inf
        self._window = INITIAL_WINDOW
        self._limit = min(self._cap, self._window)
        self._growing = True
        self._learned_at = -math.inf
        self._in_flight = 0
        self._accepted = 0
        self._peak = 0
        self._paused_until = 0.0
        self._requests = _window_of(limits.requests_per_minute)
        self._input = _window_of(limits.input_tokens_per_minute)
        self._output = _window_of(limits.output_tokens_per_minute)
        self._timed = self._has_windows()
        self._queue: _Queue = OrderedDict()
        self._waiting = 0
        self._ready_at = math.inf
        self.rate_limit_answers = 0
        """How many 429 / 529 answers the endpoint has given."""
        self.on_pause: Callable[[float], None] | None = None
        """Called with the seconds a rate-limit answer pauses the endpoint for, when one
        does (a cluster tells its other hosts); must not block or raise."""

    # -- what it is like now ---------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet ended."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests waiting to be admitted."""
        return self._waiting

    @property
    def window(self) -> int:
        """The concurrency the endpoint is trusted with now (learned, or opening)."""
        return self._window

    @property
    def counts_tokens(self) -> bool:
        """Whether requests' tokens are counted (a token limit is configured)."""
        return self._input is not None or self._output is not None

    @property
    def counts_minutes(self) -> bool:
        """Whether a per-minute limit is configured (requests or tokens): then every
        request must be counted here as it is admitted."""
        return self._has_windows()

    def pause_remaining(self) -> float:
        """Seconds until the pause the provider asked for ends; 0 when none is in force."""
        until = self._paused_until
        if not until:
            return 0.0
        left = until - trio.current_time()
        if left > 0:
            return left
        self._paused_until = 0.0
        self._timed = self._has_windows()
        return 0.0

    # -- admission -------------------------------------------------------------------------

    async def admit(
        self, principal: str, session: str, *, input_tokens: int = 0, output_tokens: int = 0
    ) -> RequestPermit:
        """A place for one request of ``session`` (of ``principal``; "" for none), whose
        estimated tokens are ``input_tokens`` and ``output_tokens``: at once when it fits
        and nobody waits, else when its turn comes. Cancel-safe: cancelled, it leaves the
        queue (or gives back a place granted meanwhile). The caller must
        :meth:`~RequestPermit.release` the permit when the request ends."""
        if not self._waiting and self._fits(input_tokens, output_tokens):
            return self._grant(input_tokens, output_tokens)
        return await self._wait(_Waiter(principal, session, input_tokens, output_tokens))

    def admit_now(self) -> RequestPermit | None:
        """A place at once for a request whose tokens are not counted, when nobody waits
        and it fits; else None (nothing taken)."""
        if self._waiting or self._input is not None or self._output is not None:
            return None
        if not self._fits(0, 0):
            return None
        return self._grant(0, 0)

    def admit_past_pause(self) -> RequestPermit | None:
        """A place at once for a request a person asked to send now (R-RETRY-5: "retry
        now"), whatever pause the provider asked for, within the concurrency cap and the
        per-minute limits; else None (nothing taken): then the request waits its turn.
        Only the provider's pause is gone past: with none in force there is nothing to go
        past, and with a token limit the request's estimate is needed, which only
        :meth:`admit` takes."""
        if self.pause_remaining() <= 0 or self._input is not None or self._output is not None:
            return None
        if self._in_flight >= self._limit:
            return None
        requests = self._requests
        if requests is not None and not requests.has_room(1, trio.current_time()):
            return None
        permit = self._grant(0, 0)
        permit.past_pause = True
        return permit

    def lift_pause(self) -> None:
        """The provider's pause is over before the time it said (it accepted a request)."""
        if self._paused_until:
            self._paused_until = 0.0
            self._timed = self._has_windows()
            if self._waiting:
                self._dispatch()

    async def _wait(self, waiter: _Waiter) -> RequestPermit:
        self._enqueue(waiter)
        try:
            while True:
                waiter.scope = trio.CancelScope()
                # The head of the queue keeps the time: _dispatch sets its deadline to
                # when a pause or a window ends.
                self._dispatch()
                permit = waiter.permit
                if permit is not None:
                    return permit
                with waiter.scope:
                    await waiter.event.wait()
        except BaseException:
            granted = waiter.permit
            if granted is None:
                self._leave(waiter)
                self._dispatch()
            else:
                self._give_back(granted)
            raise

    def _give_back(self, permit: RequestPermit) -> None:
        """Release a place granted to a request that will never be sent (its caller was
        cancelled as it was granted): it counts in no per-minute window either, or its
        estimate would hold others back for a minute."""
        for window, counted in (
            (self._requests, permit.request_counted),
            (self._input, permit.input_counted),
            (self._output, permit.output_counted),
        ):
            if window is not None and counted is not None:
                window.settle(counted, 0)
        permit.release()

    def _fits(self, input_tokens: int, output_tokens: int) -> bool:
        """Whether a request with these estimates may go now; when not, ``_ready_at`` is
        when time alone could change that (inf: only a release can)."""
        if self._in_flight >= self._limit:
            self._ready_at = math.inf
            return False
        if not self._timed:
            return True
        now = trio.current_time()
        ready = 0.0
        if self._paused_until:
            if self._paused_until > now:
                ready = self._paused_until
            else:
                self._paused_until = 0.0
                self._timed = self._has_windows()
        for window, amount in (
            (self._requests, 1),
            (self._input, input_tokens),
            (self._output, output_tokens),
        ):
            if window is not None and not window.has_room(amount, now):
                ready = max(ready, window.room_at())
        if ready:
            self._ready_at = ready
            return False
        return True

    def _grant(self, input_tokens: int, output_tokens: int) -> RequestPermit:
        self._in_flight += 1
        permit = RequestPermit(self)
        if self._timed:
            now = trio.current_time()
            if self._requests is not None:
                permit.request_counted = self._requests.add(1, now)
            if self._input is not None:
                permit.input_counted = self._input.add(input_tokens, now)
            if self._output is not None:
                permit.output_counted = self._output.add(output_tokens, now)
        return permit

    def _dispatch(self) -> None:
        """Admit waiting requests, in turn, while they fit; then give the head of the
        queue the deadline at which time alone may admit it."""
        queue = self._queue
        while queue:
            principal, sessions = next(iter(queue.items()))
            session, waiters = next(iter(sessions.items()))
            head = waiters[0]
            if not self._fits(head.input_tokens, head.output_tokens):
                head.scope.deadline = self._ready_at
                return
            waiters.popleft()
            self._waiting -= 1
            # Round robin: the session, then the principal, go to the back of their line.
            if waiters:
                sessions.move_to_end(session)
            else:
                del sessions[session]
            if sessions:
                queue.move_to_end(principal)
            else:
                del queue[principal]
            head.permit = self._grant(head.input_tokens, head.output_tokens)
            head.event.set()

    def _enqueue(self, waiter: _Waiter) -> None:
        sessions = self._queue.get(waiter.principal)
        if sessions is None:
            sessions = self._queue[waiter.principal] = OrderedDict()
        waiters = sessions.get(waiter.session)
        if waiters is None:
            waiters = sessions[waiter.session] = deque()
        waiters.append(waiter)
        self._waiting += 1

    def _leave(self, waiter: _Waiter) -> None:
        sessions = self._queue.get(waiter.principal)
        waiters = None if sessions is None else sessions.get(waiter.session)
        if sessions is None or waiters is None or waiter not in waiters:
            return
        waiters.remove(waiter)
        self._waiting -= 1
        if not waiters:
            del sessions[waiter.session]
            if not sessions:
                del self._queue[waiter.principal]

    # -- what permits report ---------------------------------------------------------------

    def accepted(self) -> None:
        """A request was accepted: while the window opens and is half in use, it grows
        by one."""
        self._accepted += 1
        if self._accepted > self._peak:
            self._peak = self._accepted
        if not self._growing and trio.current_time() - self._learned_at >= LEARNED_FOR_S:
            self._growing = True
        if self._growing and 2 * self._in_flight >= self._window:
            self._window += 1
            self._limit = min(self._cap, self._window)
            if self._waiting:
                self._dispatch()

    def settle(self, permit: RequestPermit, input_tokens: int, output_tokens: int) -> None:
        """``permit``'s real token counts replace its estimates."""
        entry_in, entry_out = permit.input_counted, permit.output_counted
        if entry_in is not None and self._input is not None:
            self._input.settle(entry_in, input_tokens)
        if entry_out is not None and self._output is not None:
            self._output.settle(entry_out, output_tokens)
        if self._waiting and (entry_in is not None or entry_out is not None):
            self._dispatch()

    def rate_limited(self, permit: RequestPermit, retry_after_s: float | None) -> None:
        """``permit``'s request got a 429 or 529 asking for ``retry_after_s``: the
        endpoint pauses for that long and its window becomes what it was seen to bear."""
        self.rate_limit_answers += 1
        now = trio.current_time()
        beside = self._in_flight - 1
        self._window = max(1, self._peak, min(self._window, beside))
        self._limit = min(self._cap, self._window)
        self._growing = False
        self._learned_at = now
        self._peak = self._accepted - (1 if permit.is_accepted else 0)
        seconds = _pause_of(retry_after_s)
        if seconds:
            self._paused_until = max(self._paused_until, now + seconds)
            self._timed = True
            if self.on_pause is not None:
                self.on_pause(seconds)

    def pause_for(self, seconds: float) -> None:
        """Pause the endpoint for ``seconds`` from now (unless a longer pause is in force),
        as a rate-limit answer would, without learning a window from it: another host of
        a cluster got the answer."""
        seconds = _pause_of(seconds)
        if seconds:
            self._paused_until = max(self._paused_until, trio.current_time() + seconds)
            self._timed = True
            if self._waiting:
                self._dispatch()

    def release(self, permit: RequestPermit) -> None:
        """``permit``'s request has ended (use :meth:`RequestPermit.release`)."""
        self._in_flight -= 1
        if permit.is_accepted:
            self._accepted -= 1
        if self._waiting:
            self._dispatch()

    def _has_windows(self) -> bool:
        return self._requests is not None or self._input is not None or self._output is not None


def _pause_of(seconds: float | None) -> float:
    """The pause a rate-limit answer's wait makes: at most :data:`~greenroom.protocols.
    retry.RETRY_AFTER_CAP_S`, as a session's own retry waits; 0 (none) for no wait, a
    negative one or NaN. The codecs' waits are already so; a program's own provider may
    pass anything, and an endless pause would stop every session of the endpoint."""
    if seconds is None or not seconds > 0:
        return 0.0
    return min(seconds, RETRY_AFTER_CAP_S)


def _window_of(limit: int | None) -> _MinuteWindow | None:
    return None if limit is None else _MinuteWindow(limit)


class AdmissionPoint(Protocol):
    """Where one endpoint's requests are admitted, as a session sees it: a host's
    :class:`EndpointAdmission`, or a cluster's point that holds for every host."""

    @property
    def counts_tokens(self) -> bool:
        """Whether requests' tokens are counted (a token limit is configured)."""
        ...

    def admit_now(self) -> RequestPermit | None:
        """A place at once, without waiting, or None (then :meth:`admit`)."""

    def admit_past_pause(self) -> RequestPermit | None:
        """A place at once for a request a person asked to send now, whatever pause the
        provider asked for (R-RETRY-5), or None (then :meth:`admit`)."""

    async def admit(
        self, principal: str, session: str, *, input_tokens: int = 0, output_tokens: int = 0
    ) -> RequestPermit:
        """A place for one request, when its turn comes (see
        :meth:`EndpointAdmission.admit`)."""
        ...


class SharedEndpoints(Protocol):
    """Admission points that several hosts share (a cluster's, R-SHARE-1): one for each
    endpoint and credential, whichever host's client sends to it."""

    def admission(self, client: object, local: EndpointAdmission) -> AdmissionPoint:
        """The admission point of provider client ``client`` on this host; ``local`` is
        the host's own admission for it under the host's limits (what the shared point
        admits with when it cannot reach the others, and what it returns for a client
        whose endpoint it cannot tell)."""
        ...


class Requester:
    """Who asks an endpoint's admission: a session (``session_id``) of a principal ("" for
    none), bound to the :class:`AdmissionPoint` of its provider client."""

    __slots__ = ("admission", "principal", "session_id")

    def __init__(self, admission: AdmissionPoint, principal: str, session_id: str) -> None:
        self.admission = admission
        self.principal = principal
        self.session_id = session_id

    def admit_now(self) -> RequestPermit | None:
        """A place at once, without waiting, when nobody waits, it fits and no tokens are
        counted (no estimate needed); else None: then :meth:`admit`. The common case with
        no limits configured, without a coroutine."""
        return self.admission.admit_now()

    async def admit(self, request: ModelRequest) -> RequestPermit:
        """A place for ``request`` (see :meth:`EndpointAdmission.admit`)."""
        admission = self.admission
        if not admission.counts_tokens:
            return await admission.admit(self.principal, self.session_id)
        return await admission.admit(
            self.principal,
            self.session_id,
            input_tokens=estimate_input_tokens(request),
            output_tokens=request.max_tokens,
        )


class ProviderAdmissions:
    """A host's admission points, one per endpoint and credential, all under ``limits``;
    with ``shared``, the points that hold for the hosts that share them (a cluster's).
    Provider objects that name their endpoint (``endpoint_identity``: provider, base URL,
    a hash of the key) share one point when they name the same — the host's clients made
    for ``base_url`` None and for the provider's default URL, a program's own objects
    for one endpoint and key; another object is a point of its own."""

    __slots__ = ("_by_client", "_by_endpoint", "limits", "shared")

    def __init__(
        self, limits: ProviderLimits | None = None, shared: SharedEndpoints | None = None
    ) -> None:
        self.limits = limits or NO_LIMITS
        self.shared = shared
        self._by_client: dict[int, tuple[object, AdmissionPoint]] = {}
        self._by_endpoint: dict[str, AdmissionPoint] = {}

    def of(self, client: object) -> AdmissionPoint:
        """The admission point of ``client`` (a provider object), made on first use."""
        found = self._by_client.get(id(client))
        if found is not None and found[0] is client:
            return found[1]
        identity = getattr(client, "endpoint_identity", None)
        endpoint = identity if isinstance(identity, str) else None
        admission = None if endpoint is None else self._by_endpoint.get(endpoint)
        if admission is None:
            local = EndpointAdmission(self.limits)
            admission = local if self.shared is None else self.shared.admission(client, local)
            if endpoint is not None:
                self._by_endpoint[endpoint] = admission
        # The client is kept with its admission so that its id cannot be reused meanwhile.
        self._by_client[id(client)] = (client, admission)
        return admission
