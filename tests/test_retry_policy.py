"""The one retry policy, pure (R-RETRY-2, R-RETRY-6, R-ACTOR-4): which failed attempts are
retried, after which wait, and for how long; and the compactor following it (R-COMPACT-7)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from greenroom.actors.providers.base import Deliver
from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.protocols.compaction import RetrySummary, Summarized, SummaryRequests
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.messages import (
    StartAttempt,
    StreamBatch,
    StreamerCommand,
    SupervisorMessage,
)
from greenroom.protocols.retry import (
    MAX_RETRIES,
    RETRY_AFTER_CAP_S,
    RetryDecision,
    decide_retry,
    should_retry,
)
from greenroom.protocols.stream import (
    BlockCompleted,
    ErrorKind,
    MessageCompleted,
    ModelError,
    StreamFailed,
    TokenUsage,
)

SCHEDULE_MS = [250, 500, 1000, 2000, 4000]
KINDS: list[ErrorKind] = ["auth", "timeout", "malformed", "failed", "context_overflow"]


def error(kind: ErrorKind, retry_after_s: float | None = None, **fields: bool) -> ModelError:
    return ModelError(kind=kind, message=f"{kind} failure", retry_after_s=retry_after_s, **fields)


def retry_in(ms: int) -> RetryDecision:
    return RetryDecision(retry=True, delay_ms=ms)


GIVE_UP = RetryDecision(retry=False, delay_ms=None)

TABLE: list[tuple[ModelError, int, RetryDecision]] = [
    # The schedule: 250 ms x 2^n for the five retries, then no more.
    *((error("timeout"), n + 1, retry_in(ms)) for n, ms in enumerate(SCHEDULE_MS)),
    (error("timeout"), 6, GIVE_UP),
    (error("malformed"), 1, retry_in(250)),
    (error("failed"), 3, retry_in(1000)),
    (error("failed"), 6, GIVE_UP),
    (error("failed"), 99, GIVE_UP),
    # auth never (R-RETRY-6), permanent failures never, overflow is its caller's.
    (error("auth"), 1, GIVE_UP),
    (error("auth", retry_after_s=1.0), 1, GIVE_UP),
    (error("failed", permanent=True), 1, GIVE_UP),
    (error("context_overflow"), 1, GIVE_UP),
    # A longer retry-after wins; a shorter one never lowers the wait.
    (error("timeout", retry_after_s=3.0), 1, retry_in(3000)),
    (error("timeout", retry_after_s=3.0), 5, retry_in(4000)),
    (error("timeout", retry_after_s=0.1), 2, retry_in(500)),
    (error("timeout", retry_after_s=0.0), 1, retry_in(250)),
    (error("timeout", retry_after_s=1.2345), 1, retry_in(1234)),
    (error("timeout", retry_after_s=30.0), 6, GIVE_UP),
    # Capped at one hour; unusable values ignored.
    (error("timeout", retry_after_s=86_400.0), 1, retry_in(3_600_000)),
    (error("timeout", retry_after_s=math.inf), 1, retry_in(250)),
    (error("timeout", retry_after_s=math.nan), 2, retry_in(500)),
    (error("timeout", retry_after_s=-5.0), 1, retry_in(250)),
]


@pytest.mark.parametrize(("failure", "attempt", "expected"), TABLE)
def test_decide_retry(failure: ModelError, attempt: int, expected: RetryDecision) -> None:
    assert decide_retry(failure, attempt) == expected


def test_attempts_are_one_based() -> None:
    with pytest.raises(ValueError, match="1-based"):
        decide_retry(error("timeout"), 0)


def test_should_retry_agrees_with_decide_retry() -> None:
    for kind in KINDS:
        for permanent in (False, True):
            for attempt in range(1, MAX_RETRIES + 3):
                decision = decide_retry(error(kind, permanent=permanent), attempt)
                assert should_retry(kind, attempt, permanent=permanent) == decision.retry


errors = st.builds(
    ModelError,
    kind=st.sampled_from(KINDS),
    message=st.just("boom"),
    retry_after_s=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    permanent=st.booleans(),
)


@settings(max_examples=500, deadline=None)
@given(errors)
def test_policy_invariants(failure: ModelError) -> None:
    """For any error: at most five retries, made in a row from the first attempt; the
    wait never below the schedule, never decreasing, never beyond the retry-after cap."""
    decisions = [decide_retry(failure, attempt) for attempt in range(1, 3 * MAX_RETRIES)]
    retried = [d for d in decisions if d.retry]
    assert len(retried) <= MAX_RETRIES
    assert decisions[: len(retried)] == retried  # once it gives up, it stays given up
    waits = [d.delay_ms for d in retried if isinstance(d.delay_ms, int)]
    assert len(waits) == len(retried)
    assert all(d.delay_ms is None for d in decisions if not d.retry)
    for n, wait in enumerate(waits):
        assert SCHEDULE_MS[n] <= wait <= max(SCHEDULE_MS[n], RETRY_AFTER_CAP_S * 1000)
    assert waits == sorted(waits)
    if failure.kind in ("timeout", "malformed", "failed") and not failure.permanent:
        assert len(retried) == MAX_RETRIES
    else:
        assert retried == []


# -- the compactor follows it -----------------------------------------------------------------


class Script:
    """A provider task that answers each compaction request with the next scripted result
    and notes when (virtual time) each request arrived."""

    def __init__(self, results: Sequence[ModelError | str]) -> None:
        self._results = list(results)
        self.arrivals: list[float] = []

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        self.arrivals.append(trio.current_time())
        result = self._results.pop(0)
        if isinstance(result, ModelError):
            await deliver([StreamFailed(error=result)])
            return
        block = TextBlock(text=f"[summary]{result}[/summary]")
        await deliver(
            [
                BlockCompleted(index=0, block=block),
                MessageCompleted(stop_reason="end_turn", usage=TokenUsage()),
            ]
        )


def template() -> ModelRequest:
    return ModelRequest(model="m", system=None, tools=(), messages=())


async def compact(script: Script) -> tuple[str | None, int, list[int]]:
    """Summarize through a real LLM streamer around the script, as a compaction does: the
    pure summary requests decide, the streamer waits — the one path to the model
    (R-ACTOR-4)."""
    # Unbounded, both: the streamer and this loop send with send_nowait.
    inbox_send, inbox = trio.open_memory_channel[SupervisorMessage](math.inf)
    commands_send, commands = trio.open_memory_channel[StreamerCommand](math.inf)
    base = (UserMessage(content=(TextBlock(text="hello"),)),)
    requests = SummaryRequests(base, "Summarize.")
    summary: str | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(LLMStreamer(script, inbox_send).run, commands)
        delay_ms = 0
        while True:
            messages = requests.next_messages()
            commands_send.send_nowait(
                StartAttempt(
                    request=attrs.evolve(template(), messages=messages),
                    attempt=requests.attempt,
                    delay_ms=delay_ms,
                )
            )
            outcome = None
            while outcome is None:
                batch = await inbox.receive()
                assert isinstance(batch, StreamBatch)
                outcome = requests.feed(batch.events)
            if isinstance(outcome, RetrySummary):
                delay_ms = outcome.delay_ms
                continue
            if isinstance(outcome, Summarized):
                summary = outcome.summary
            break
        nursery.cancel_scope.cancel()
    gaps = [round((b - a) * 1000) for a, b in itertools.pairwise(script.arrivals)]
    return summary, outcome.attempt, gaps


async def test_compactor_waits_what_the_policy_says(autojump_clock: trio.abc.Clock) -> None:
    """R-COMPACT-7: a compaction's retries are the policy's: a longer retry-after wins, a
    day-long one is capped at an hour, an unusable one leaves the schedule."""
    script = Script(
        [
            error("timeout", retry_after_s=3.0),
            error("timeout", retry_after_s=86_400.0),
            error("malformed", retry_after_s=math.nan),
            "the gist",
        ]
    )
    summary, attempt, gaps = await compact(script)
    assert (summary, attempt) == ("the gist", 4)
    assert gaps == [3000, 3_600_000, 1000]


@pytest.mark.parametrize(
    "failure", [error("auth"), error("failed", permanent=True), error("context_overflow")]
)
async def test_compactor_stops_at_once_when_the_policy_gives_up(
    failure: ModelError, autojump_clock: trio.abc.Clock
) -> None:
    summary, attempt, gaps = await compact(Script([failure, "unused"]))
    assert (summary, attempt, gaps) == (None, 1, [])
