"""The admission point of a provider endpoint (R-SHARE-1, R-SHARE-2), as a unit: fair
turns across principals and sessions, the concurrency cap, the per-minute windows with
estimates settled by real usage, what a 429 teaches the endpoint (a pause and a window),
the gradual opening of a fresh endpoint, and a wait that is cancelled.

Every test runs on ``MockClock(autojump_threshold=0)``: windows and pauses pass at once in
virtual time, and the order of events is forced with ``wait_all_tasks_blocked``."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from greenroom import ProviderLimits
from greenroom.actors.runtime.admission import (
    INITIAL_WINDOW,
    LEARNED_FOR_S,
    WINDOW_S,
    EndpointAdmission,
    Requester,
    RequestPermit,
    estimate_input_tokens,
)
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.stream import (
    MessageCompleted,
    ModelError,
    StreamFailed,
    TextDelta,
    TokenUsage,
)


async def queue_up(
    nursery: trio.Nursery,
    admission: EndpointAdmission,
    principal: str,
    session: str,
    admitted: list[str],
    *,
    hold: trio.Event | None = None,
    input_tokens: int = 0,
) -> None:
    """A request of ``session`` that waits its turn, notes it in ``admitted``, holds its
    place until ``hold`` is set (at once without one) and ends. Returns once it waits or
    has been admitted, so requests queue in the order they are started."""

    async def one() -> None:
        permit = await admission.admit(principal, session, input_tokens=input_tokens)
        admitted.append(session)
        try:
            if hold is not None:
                await hold.wait()
        finally:
            permit.release()

    nursery.start_soon(one)
    await trio.testing.wait_all_tasks_blocked()


async def test_a_principal_with_two_sessions_is_served_in_turn_with_one_with_fifty(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-SHARE-2: 50 sessions of principal "big" queue first, then 2 of "small": one place
    at a time, the small principal's requests are admitted second and fourth, not after
    the fifty."""
    admission = EndpointAdmission(ProviderLimits(max_concurrent_requests=1))
    holder = await admission.admit("", "holder")
    admitted: list[str] = []
    async with trio.open_nursery() as nursery:
        for n in range(50):
            await queue_up(nursery, admission, "big", f"big-{n}", admitted)
        for n in range(2):
            await queue_up(nursery, admission, "small", f"small-{n}", admitted)
        assert admission.waiting == 52 and admitted == []
        holder.release()
    assert admitted[:5] == ["big-0", "small-0", "big-1", "small-1", "big-2"]
    assert admitted[5:] == [f"big-{n}" for n in range(3, 50)]
    assert admission.in_flight == 0 and admission.waiting == 0


async def test_sessions_of_one_principal_take_turns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Within a principal, sessions take turns; a session's own requests keep their
    order. Requests without a principal count as the principal ""."""
    admission = EndpointAdmission(ProviderLimits(max_concurrent_requests=1))
    holder = await admission.admit("", "holder")
    admitted: list[str] = []
    async with trio.open_nursery() as nursery:
        for session in ("a", "a", "a", "b", "c"):
            await queue_up(nursery, admission, "", session, admitted)
        holder.release()
    assert admitted == ["a", "b", "c", "a", "a"]


async def test_the_concurrency_cap_holds_and_every_request_goes_in_the_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``max_concurrent_requests=3``: ten requests that each hold their place until told
    to end; never more than three hold one at once, and all ten get one."""
    admission = EndpointAdmission(ProviderLimits(max_concurrent_requests=3))
    admitted: list[str] = []
    holds = [trio.Event() for _ in range(10)]
    async with trio.open_nursery() as nursery:
        for n in range(10):
            await queue_up(nursery, admission, "", f"s{n}", admitted, hold=holds[n])
        assert admitted == ["s0", "s1", "s2"] and admission.in_flight == 3
        for n in range(10):
            holds[n].set()
            await trio.testing.wait_all_tasks_blocked()
            assert admission.in_flight <= 3
            assert len(admitted) == min(10, n + 4)
    assert admission.in_flight == 0


async def test_requests_per_minute_hold_over_a_sliding_minute(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``requests_per_minute=2``: the third request of a minute goes when the first
    leaves the window, 60 s after it, not before."""
    admission = EndpointAdmission(ProviderLimits(requests_per_minute=2))
    start = trio.current_time()
    times: list[float] = []

    async def one() -> None:
        permit = await admission.admit("", "s")
        times.append(trio.current_time() - start)
        permit.release()

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert times == [0.0, 0.0, WINDOW_S]


async def test_input_tokens_per_minute_are_settled_by_the_real_usage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An estimate of 800 input tokens of a 1,000-token minute leaves no room for another
    800; once the first request reports that it used 100, the second goes at once — no
    time passes. Unsettled, it would have waited the whole minute."""
    admission = EndpointAdmission(ProviderLimits(input_tokens_per_minute=1000))
    first = await admission.admit("", "a", input_tokens=800)
    admitted: list[str] = []
    async with trio.open_nursery() as nursery:
        await queue_up(nursery, admission, "", "b", admitted, input_tokens=800)
        assert admitted == []
        before = trio.current_time()
        first.observe(
            [
                MessageCompleted(
                    stop_reason="end_turn", usage=TokenUsage(input=60, cache_write=40, output=5)
                )
            ]
        )
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == ["b"] and trio.current_time() == before
    first.release()

    unsettled = EndpointAdmission(ProviderLimits(input_tokens_per_minute=1000))
    held = await unsettled.admit("", "a", input_tokens=800)
    start = trio.current_time()
    waited = await unsettled.admit("", "b", input_tokens=800)
    assert trio.current_time() - start == WINDOW_S
    waited.release()
    held.release()


async def test_output_tokens_count_max_tokens_until_the_response_says(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Through a session's :class:`Requester`: output tokens are counted at the request's
    ``max_tokens`` until its response reports the real count; a request the provider
    refused before reading it counts none."""
    admission = EndpointAdmission(ProviderLimits(output_tokens_per_minute=1000))
    requester = Requester(admission, "p", "s")
    hello = UserMessage(content=(TextBlock(text="hi " * 40),))
    request = ModelRequest(
        model="m", system="be brief", tools=(), messages=(hello,), max_tokens=600
    )
    first = await requester.admit(request)
    admitted: list[str] = []
    async with trio.open_nursery() as nursery:

        async def second() -> None:
            permit = await requester.admit(request)
            admitted.append("second")
            permit.release()

        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == []
        refused = ModelError(kind="timeout", message="service unavailable", status_code=503)
        first.observe([StreamFailed(error=refused)])
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == ["second"]
    first.release()
    assert estimate_input_tokens(request) == (len("be brief") + len("hi " * 40)) // 4


async def test_retry_now_goes_past_the_pause_and_an_accepted_one_lifts_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-RETRY-5 with R-SHARE-1: a person's "retry now" sends one request past the pause
    the provider asked for; when the provider accepts it, the pause is over for everyone;
    one the provider refuses again leaves the endpoint paused."""
    admission = EndpointAdmission()
    refused = await admission.admit("", "a")
    error = ModelError(kind="timeout", message="overloaded", status_code=529, retry_after_s=60.0)
    refused.observe([StreamFailed(error=error)])
    refused.release()
    assert admission.admit_now() is None  # paused for everyone

    again = admission.admit_past_pause()
    assert again is not None
    again.observe([StreamFailed(error=error)])  # refused again: still paused
    again.release()
    assert admission.pause_remaining() == 60.0

    retried = admission.admit_past_pause()
    assert retried is not None
    retried.observe([TextDelta(index=0, text="x")])  # accepted
    assert admission.pause_remaining() == 0.0
    retried.release()  # (the 529 also taught the endpoint to send one at a time)
    other = admission.admit_now()
    assert other is not None
    other.release()


async def test_a_429_pauses_everyone_for_the_wait_the_provider_asked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-SHARE-1: a 429 with ``retry-after: 5`` and no limit configured: a request of
    another session waits 5 s; the refused request's own failure is handed on with that
    wait, and a failure of a third session during the pause is raised to what remains
    of it (its retry follows the endpoint's pause)."""
    admission = EndpointAdmission()
    refused = await admission.admit("", "a")
    other = await admission.admit("", "c")
    error = ModelError(kind="timeout", message="rate limited", status_code=429, retry_after_s=5.0)
    start = trio.current_time()
    batch = refused.observe([StreamFailed(error=error)])
    assert batch == [StreamFailed(error=error)]
    refused.release()
    assert admission.rate_limit_answers == 1
    assert admission.pause_remaining() == 5.0

    await trio.sleep(2.0)
    dropped = ModelError(kind="timeout", message="connection reset")
    (failure,) = other.observe([TextDelta(index=0, text="x"), StreamFailed(error=dropped)])[1:]
    assert isinstance(failure, StreamFailed) and failure.error.retry_after_s == 3.0
    other.release()

    permit = await admission.admit("", "b")
    assert trio.current_time() - start == 5.0
    permit.release()
    assert admission.pause_remaining() == 0.0


async def test_a_fresh_endpoint_opens_gradually_and_learns_what_it_bears(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No limits configured, an endpoint that bears 8 requests at once: 40 requests come
    together; 32 go at first. 8 are accepted, and while the window is in use each
    acceptance opens one more place. The other 32 are refused (429, ``retry-after: 1``)
    one after the other: the window falls to the 8 the endpoint bore at once, so that
    after the pause no more than 8 go."""
    admission = EndpointAdmission()
    permits: list[RequestPermit] = []

    async def one() -> None:
        permits.append(await admission.admit("", f"s{len(permits)}"))

    async with trio.open_nursery() as nursery:
        for _ in range(40):
            nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        assert len(permits) == INITIAL_WINDOW and admission.waiting == 8
        for permit in permits[:8]:
            permit.observe([TextDelta(index=0, text="accepted")])
        await trio.testing.wait_all_tasks_blocked()
        assert len(permits) == 40 and admission.window == INITIAL_WINDOW + 8
        limited = ModelError(kind="timeout", message="429", status_code=429, retry_after_s=1.0)
        for permit in permits[8:]:
            permit.observe([StreamFailed(error=limited)])
            permit.release()
    assert admission.window == 8 and admission.in_flight == 8

    later: list[RequestPermit] = []

    async def again() -> None:
        later.append(await admission.admit("", "again"))

    async with trio.open_nursery() as nursery:
        for _ in range(12):
            nursery.start_soon(again)
        await trio.testing.wait_all_tasks_blocked()
        assert later == []  # the endpoint's pause (1 s)
        for permit in permits[:8]:
            permit.release()
        await trio.sleep(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert len(later) == 8 and admission.waiting == 4
        for permit in list(later):
            permit.release()
    for permit in later[8:]:
        permit.release()


async def test_a_learned_window_grows_again_a_minute_after_the_last_429(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A window learned from a 429 holds; :data:`LEARNED_FOR_S` later each acceptance
    while it is in use opens one more place again."""
    admission = EndpointAdmission()
    first, second = await admission.admit("", "a"), await admission.admit("", "b")
    first.observe([TextDelta(index=0, text="ok")])
    second.observe([StreamFailed(error=ModelError(kind="timeout", message="529", status_code=529))])
    second.release()
    assert admission.window == 1 and admission.pause_remaining() == 0.0
    first.release()
    third = await admission.admit("", "c")
    third.observe([TextDelta(index=0, text="ok")])
    assert admission.window == 1
    third.release()
    await trio.sleep(LEARNED_FOR_S)
    fourth = await admission.admit("", "d")
    fourth.observe([TextDelta(index=0, text="ok")])
    assert admission.window == 2
    fourth.release()


async def test_a_cancelled_wait_leaves_the_queue_and_takes_no_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-SHARE-2: a wait ends at once when its caller is cancelled (an interrupt), leaves
    nothing in the queue, and the place it would have had goes to the next request."""
    admission = EndpointAdmission(ProviderLimits(max_concurrent_requests=1))
    holder = await admission.admit("", "holder")
    admitted: list[str] = []
    interrupted = trio.CancelScope()

    async def waiting() -> None:
        with interrupted:
            await admission.admit("", "interrupted")
            admitted.append("interrupted")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting)
        await trio.testing.wait_all_tasks_blocked()
        await queue_up(nursery, admission, "", "next", admitted)
        assert admission.waiting == 2
        before = trio.current_time()
        interrupted.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting == 1 and trio.current_time() == before
        holder.release()
    assert admitted == ["next"] and admission.in_flight == 0


async def test_a_place_granted_as_the_wait_is_cancelled_is_given_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The waiter is cancelled and, before it has run again, granted the place that
    frees: the place is given back, not lost."""
    admission = EndpointAdmission(ProviderLimits(max_concurrent_requests=1))
    holder = await admission.admit("", "holder")
    scope = trio.CancelScope()
    admitted: list[str] = []

    async def waiting() -> None:
        with scope:
            await admission.admit("", "w")
            admitted.append("w")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # the waiter is told to stop...
        holder.release()  # ...and is granted the place before it runs
        assert admission.in_flight == 1
    assert admitted == [] and admission.in_flight == 0 and admission.waiting == 0


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_limits_are_whole_numbers_of_at_least_one(value: object) -> None:
    with pytest.raises(ConfigurationError, match="max_concurrent_requests must be a whole"):
        ProviderLimits(max_concurrent_requests=value)  # type: ignore[arg-type]
    assert ProviderLimits(requests_per_minute=None).requests_per_minute is None


async def test_an_exhausted_quota_teaches_the_endpoint_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 429 that says the quota is exhausted (permanent: no wait cures it) neither pauses
    the endpoint nor narrows its window."""
    admission = EndpointAdmission()
    permits = [await admission.admit("", f"s{n}") for n in range(3)]
    quota = ModelError(
        kind="failed",
        message="quota exhausted",
        status_code=429,
        retry_after_s=30.0,
        permanent=True,
    )
    permits[0].observe([StreamFailed(error=quota)])
    assert admission.rate_limit_answers == 0
    assert admission.window == INITIAL_WINDOW and admission.pause_remaining() == 0.0
    for permit in permits:
        permit.release()


async def test_another_hosts_pause_holds_here_and_a_learned_pause_is_told(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-SHARE-1 across a cluster's hosts: ``pause_for`` (a pause another host learned)
    holds the requests that wait here, without teaching a window; a pause learned here is
    handed to ``on_pause`` (for the other hosts), a 429 without ``retry-after`` is not."""
    admission = EndpointAdmission()
    told: list[float] = []
    admission.on_pause = told.append
    start = trio.current_time()
    admission.pause_for(3.0)
    admission.pause_for(1.0)  # a shorter pause does not shorten the longer one
    assert admission.window == INITIAL_WINDOW
    permit = await admission.admit("", "a")
    assert trio.current_time() - start == 3.0
    assert told == []
    permit.rate_limited(None)
    permit.rate_limited(2.0)
    permit.release()
    assert told == [2.0]
    assert admission.pause_remaining() == 2.0
