"""The edges of a provider endpoint's admission (R-SHARE-1, R-SHARE-2): a provider's wait
that never ends, a "retry now" under configured limits, a minute that ends at a time the
floats round, a place granted as its wait is interrupted, and provider objects that name
one endpoint and key.

Every timed test runs on ``MockClock(autojump_threshold=0)``: pauses and windows pass at
once in virtual time, and the order of events is forced with ``wait_all_tasks_blocked``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import Recorder, collect, of_type, texts_of

from greenroom import ProviderLimits
from greenroom.actors.providers.anthropic import DEFAULT_BASE_URL, AnthropicProvider
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.admission import WINDOW_S, EndpointAdmission
from greenroom.actors.runtime.host import Host
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import Output, RequestEnd, TaskEnd
from greenroom.protocols.retry import RETRY_AFTER_CAP_S
from greenroom.protocols.stream import ModelError


def prompt_of(request: ModelRequest) -> str:
    return " ".join(texts_of(request.messages[0]))


@pytest.mark.parametrize("asked", [math.inf, 1e9])
async def test_a_provider_s_endless_retry_after_pauses_the_endpoint_an_hour_at_most(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, asked: float
) -> None:
    """R-SHARE-1: a program's own provider answers A's request with a 429 asking to wait
    for ever (or 30 years). The endpoint pauses for the longest wait a ``retry-after``
    may impose (an hour), as A's own retry waits: B's task, started meanwhile, reaches the
    provider an hour later and completes, and A's retry goes then too, announced as the
    hour it is. (Before, the pause was the wait asked: B never went, the endpoint blocked
    for good; and an endless wait was announced as the 250 ms backoff.)"""
    arrivals: list[tuple[str, float]] = []

    def answer(request: ModelRequest) -> Reply:
        arrivals.append((prompt_of(request), trio.current_time()))
        if len(arrivals) == 1:
            limited = ModelError(
                kind="timeout",
                message="rate limited (HTTP 429)",
                status_code=429,
                retry_after_s=asked,
            )
            return Reply(fail=limited)
        return Reply(blocks=(text("ok"),))

    provider = ScriptedProvider(answer)
    async with Host.open(tmp_path / "data") as host:
        a = await host.create_session(provider=provider, workspace_dir=tmp_path)
        b = await host.create_session(provider=provider, workspace_dir=tmp_path)
        recorder = Recorder(a)
        run_a = a.run("from a")
        await recorder.wait_for("request_end", attempt=1, bound_s=None)
        paused_at = trio.current_time()
        admission = host.port(a.id).admission
        assert isinstance(admission, EndpointAdmission)
        assert admission.pause_remaining() <= RETRY_AFTER_CAP_S
        outputs_b = await collect(b.run("from b"), bound_s=None)
        outputs_a = await collect(run_a, bound_s=None)
    times = dict(arrivals[1:])
    assert times["from b"] - paused_at == pytest.approx(RETRY_AFTER_CAP_S)
    assert times["from a"] - paused_at == pytest.approx(RETRY_AFTER_CAP_S)
    assert of_type(outputs_b, TaskEnd)[0].status == "completed"
    assert [(e.attempt, e.retry_in_ms) for e in of_type(outputs_a, RequestEnd)] == [
        (1, round(RETRY_AFTER_CAP_S * 1000)),
        (2, None),
    ]


async def test_a_pause_told_by_another_host_or_asked_for_nothing_is_bounded_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What another host tells (``pause_for``) and what ``on_pause`` tells the others are
    bounded as a pause learned here; a NaN or negative wait pauses nothing."""
    admission = EndpointAdmission()
    told: list[float] = []
    admission.on_pause = told.append
    admission.pause_for(math.inf)
    assert admission.pause_remaining() == RETRY_AFTER_CAP_S
    await trio.sleep(RETRY_AFTER_CAP_S)
    permit = await admission.admit("", "a")
    for asked in (math.nan, -5.0, 1e12):
        permit.rate_limited(asked)
    permit.release()
    assert told == [RETRY_AFTER_CAP_S]
    assert admission.pause_remaining() == RETRY_AFTER_CAP_S


async def test_retry_now_keeps_to_the_requests_per_minute(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """R-SHARE-1 with R-RETRY-5: ``requests_per_minute=1``; the first attempt fails (a
    503: no pause of the endpoint) and the person presses "retry now" the moment the
    backoff is announced. The retry ends the session's backoff, not the limit: it reaches
    the provider a minute after the first request, not at once. (Before, "retry now" sent
    it past the limit.)"""
    arrivals: list[float] = []

    def answer(request: ModelRequest) -> Reply:
        arrivals.append(trio.current_time())
        if len(arrivals) == 1:
            down = ModelError(
                kind="timeout", message="service unavailable (HTTP 503)", status_code=503
            )
            return Reply(fail=down)
        return Reply(blocks=(text("ok"),))

    provider = ScriptedProvider(answer)
    async with Host.open(tmp_path / "data", limits=ProviderLimits(requests_per_minute=1)) as host:
        session = await host.create_session(provider=provider, workspace_dir=tmp_path)
        skipped: list[bool] = []

        def on_batch(batch: list[Output]) -> None:
            for output in batch:
                if isinstance(output, RequestEnd) and output.retry_in_ms:
                    skipped.append(session.skip_reconnect_wait())

        session.subscribe(on_batch)
        outputs = await collect(session.run("hi"), bound_s=None)
    assert skipped == [True]
    assert arrivals[1] - arrivals[0] == pytest.approx(WINDOW_S)
    assert [(e.attempt, e.status) for e in of_type(outputs, RequestEnd)] == [
        (1, "timeout"),
        (2, "ok"),
    ]


async def test_retry_now_goes_past_a_pause_only_within_the_configured_limits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A "retry now" goes past the provider's pause, never past the limits you set: not
    past a full requests-per-minute window, not past a token limit (its estimate is
    needed: it waits its turn), and with no pause in force it has nothing to go past (it
    waits its turn behind the requests already waiting)."""
    paused = EndpointAdmission(ProviderLimits(requests_per_minute=2))
    first = await paused.admit("", "a")
    first.rate_limited(30.0)
    first.release()
    again = paused.admit_past_pause()  # the pause is gone past: one request of two
    assert again is not None
    again.release()
    assert paused.admit_past_pause() is None  # the minute's two requests are spent

    tokens = EndpointAdmission(ProviderLimits(input_tokens_per_minute=1000))
    held = await tokens.admit("", "a", input_tokens=1000)
    held.release()
    assert tokens.admit_past_pause() is None  # no pause: its turn, at its estimate
    start = trio.current_time()
    waited = await tokens.admit("", "b", input_tokens=10)
    assert trio.current_time() - start == WINDOW_S
    waited.release()


async def test_a_request_goes_the_moment_the_minute_before_it_is_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``requests_per_minute=1``, the first request admitted at a time whose minute
    later does not round back to it (``t + 60 - 60 < t`` in floats): at ``t + 60`` there
    is room again. (Before, there was none at that instant: a request waiting for it was
    woken at ``t + 60``, found no room, and slept until ``t + 60`` again, for ever on a
    mock clock, spinning on a real one.)"""
    first_at = 26.301035830228404
    assert first_at + WINDOW_S - WINDOW_S < first_at
    admission = EndpointAdmission(ProviderLimits(requests_per_minute=1))
    await trio.sleep_until(first_at)
    first = await admission.admit("", "a")
    first.release()
    await trio.sleep_until(first_at + WINDOW_S)
    second = admission.admit_now()
    assert second is not None
    second.release()


async def test_a_place_granted_as_its_wait_is_interrupted_counts_in_no_minute(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-SHARE-2: a waiting request is interrupted and, before it runs again, granted the
    place that frees. It gives the place back and its estimated tokens and its request
    with it: it was never sent. The next request of the same size goes at once. (Before,
    its estimate stayed counted and held the next one back a minute.)"""
    limits = ProviderLimits(
        max_concurrent_requests=1, requests_per_minute=2, output_tokens_per_minute=1000
    )
    admission = EndpointAdmission(limits)
    holder = await admission.admit("", "holder", output_tokens=100)
    scope = trio.CancelScope()

    async def waiting() -> None:
        with scope:
            await admission.admit("", "w", output_tokens=800)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        holder.release()  # granted to the waiter before it runs: given back
    assert admission.in_flight == 0 and admission.waiting == 0
    start = trio.current_time()
    after = await admission.admit("", "next", output_tokens=800)
    assert trio.current_time() == start
    after.release()


async def test_provider_objects_of_one_endpoint_and_key_share_one_admission_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SHARE-1: one endpoint and credential, one admission point on a host, however
    its clients were made: a program's two provider objects for one base URL and key
    (written with and without its trailing slash), and sessions the host gives its own
    client for that base URL, as written either way; and sessions given Anthropic's URL
    and sessions given none. Another key is another point.
    (Before, each client had a point of its own: ``max_concurrent_requests=1`` let one
    request of each through at once.)"""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    url = "http://127.0.0.1:9"
    mine = AnthropicProvider(base_url=url, api_key="k")
    also_mine = AnthropicProvider(base_url=url + "/", api_key="k")
    other_key = AnthropicProvider(base_url=url, api_key="another")
    try:
        limits = ProviderLimits(max_concurrent_requests=1)
        async with Host.open(tmp_path / "data", limits=limits) as host:
            sessions = [
                await host.create_session(provider=provider, workspace_dir=tmp_path)
                for provider in (mine, also_mine, other_key)
            ]
            for base_url in (url, url + "/"):
                sessions.append(
                    await host.create_session(
                        provider="anthropic", base_url=base_url, workspace_dir=tmp_path
                    )
                )
            points = [host.port(session.id).admission for session in sessions]
            assert points[0] is points[1] is points[3] is points[4]
            assert points[2] is not points[0]
            default = [
                await host.create_session(
                    provider="anthropic", base_url=base_url, workspace_dir=tmp_path
                )
                for base_url in (None, DEFAULT_BASE_URL)
            ]
            assert host.port(default[0].id).admission is host.port(default[1].id).admission
            assert host.port(default[0].id).admission is not points[0]
            permit = points[0].admit_now()
            assert permit is not None
            assert points[1].admit_now() is None  # the one place is taken
            assert points[2].admit_now() is not None  # another credential's place
            permit.release()
    finally:
        for provider in (mine, also_mine, other_key):
            await provider.aclose()
