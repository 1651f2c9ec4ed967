"""The one retry-after parser (R-RETRY-2, R-ACTOR-4): ``retry-after-ms`` first, then
``retry-after`` as seconds or an HTTP date relative to the wall clock the provider passes;
unusable values ignored, long ones capped. Every codec gives the same ``retry_after_s`` for
the same headers, and every provider passes the clock so that HTTP dates count."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.protocols import anthropic_codec, openai_codec, openai_responses_codec
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.retry import (
    RETRY_AFTER_CAP_S,
    parse_rate_limit_reset,
    parse_retry_after,
)
from greenroom.protocols.stream import StreamEvent, StreamFailed
from tests.support.mock_model_server import WireError, open_mock_server

NOW = 1_767_225_600.0  # 2026-01-01T00:00:00Z
IN_30_S = "Thu, 01 Jan 2026 00:00:30 GMT"

CASES: list[tuple[dict[str, str], float | None, float | None]] = [
    # headers, now, expected seconds
    ({}, NOW, None),
    ({"retry-after": "7"}, None, 7.0),
    ({"retry-after": "2.5"}, None, 2.5),
    ({"retry-after": " 3 "}, None, 3.0),
    ({"retry-after": "0"}, None, 0.0),
    ({"Retry-After": "4"}, None, 4.0),
    ({"retry-after-ms": "1500", "retry-after": "9"}, None, 1.5),
    ({"Retry-After-Ms": "1500"}, None, 1.5),
    # An unusable retry-after-ms falls back to retry-after.
    ({"retry-after-ms": "soon", "retry-after": "9"}, None, 9.0),
    ({"retry-after-ms": "-5", "retry-after": "2"}, None, 2.0),
    ({"retry-after-ms": "nan", "retry-after": IN_30_S}, NOW, 30.0),
    # Negative, NaN, infinite and unparsable values are ignored.
    ({"retry-after": "-1"}, None, None),
    ({"retry-after": "nan"}, None, None),
    ({"retry-after": "inf"}, None, None),
    ({"retry-after": "-inf"}, None, None),
    ({"retry-after": "1e400"}, None, None),
    ({"retry-after": "soon"}, NOW, None),
    ({"retry-after": ""}, NOW, None),
    ({"retry-after-ms": "inf"}, None, None),
    # A server cannot park a session for a day: one hour at most.
    ({"retry-after": "86400"}, None, RETRY_AFTER_CAP_S),
    ({"retry-after-ms": "86400000"}, None, RETRY_AFTER_CAP_S),
    ({"retry-after": "Fri, 02 Jan 2026 00:00:00 GMT"}, NOW, RETRY_AFTER_CAP_S),
    # HTTP dates: relative to `now`, ignored without it, 0 once past, GMT when zoneless.
    ({"retry-after": IN_30_S}, NOW, 30.0),
    ({"retry-after": IN_30_S}, None, None),
    ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, NOW, 0.0),
    ({"retry-after": "Thu, 01 Jan 2026 00:00:30"}, NOW, 30.0),
    ({"retry-after": "Thu, 01 Jan 2026 01:00:30 +0100"}, NOW, 30.0),
    ({"retry-after": "Thu Jan  1 00:00:30 2026"}, NOW, 30.0),
    ({"retry-after": IN_30_S}, float("nan"), None),
]


@pytest.mark.parametrize(("headers", "now", "expected"), CASES)
def test_parse_retry_after(
    headers: dict[str, str], now: float | None, expected: float | None
) -> None:
    assert parse_retry_after(headers, now) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["retry-after", "retry-after-ms", "Retry-After", "x-other"]),
        st.one_of(
            st.text(max_size=40),
            st.floats().map(str),
            st.integers(-(10**12), 10**12).map(str),
            st.datetimes().map(lambda d: email.utils.format_datetime(d, usegmt=False)),
        ),
    ),
    st.one_of(st.none(), st.floats()),
)
def test_parse_retry_after_never_raises_and_stays_in_range(
    headers: dict[str, str], now: float | None
) -> None:
    value = parse_retry_after(headers, now)
    assert value is None or 0.0 <= value <= RETRY_AFTER_CAP_S


CLASSIFIERS = {
    "anthropic": anthropic_codec.classify_error,
    "openai": openai_codec.classify_error,
    "openai-responses": openai_responses_codec.classify_error,
}


@pytest.mark.parametrize("status", [408, 429, 500, 503, 529])
@pytest.mark.parametrize(("headers", "now", "expected"), CASES)
def test_every_codec_gives_the_parser_s_answer(
    status: int, headers: dict[str, str], now: float | None, expected: float | None
) -> None:
    """The same transient error with the same headers: the same retry-after, whichever
    codec classified it (the two used to disagree on HTTP dates)."""
    got = {
        name: classify(status, b"", headers, now=now).retry_after_s
        for name, classify in CLASSIFIERS.items()
    }
    assert got == dict.fromkeys(CLASSIFIERS, expected)


def http_date(epoch: float) -> str:
    return email.utils.formatdate(epoch, usegmt=True)


def request() -> ModelRequest:
    hello = UserMessage(content=(TextBlock(text="hi"),))
    return ModelRequest(model="m", system=None, tools=(), messages=(hello,), max_tokens=64)


PROVIDERS: dict[str, Any] = {
    "anthropic": lambda url: AnthropicProvider(base_url=url, api_key="k"),
    "anthropic-sdk": lambda url: AnthropicProvider(base_url=url, api_key="k", lean_http=False),
    "openai": lambda url: OpenAIProvider(base_url=url + "/v1", api_key="k"),
    "openai-httpx": lambda url: OpenAIProvider(base_url=url + "/v1", api_key="k", lean_http=False),
    "openai-responses": lambda url: OpenAIResponsesProvider(base_url=url + "/v1", api_key="k"),
    "openai-responses-httpx": lambda url: OpenAIResponsesProvider(
        base_url=url + "/v1", api_key="k", lean_http=False
    ),
}
"""Every provider on its lean path (the default) and on its library path."""


@pytest.mark.parametrize("name", sorted(PROVIDERS))
async def test_providers_pass_the_clock_so_http_dates_count(name: str, tmp_path: Path) -> None:
    """A 503 whose retry-after is an HTTP date two minutes ahead: every real provider (over
    its real HTTP client) reports a wait of about two minutes, not None."""
    headers: Mapping[str, str] = {"retry-after": http_date(time.time() + 120)}
    failures: list[StreamFailed] = []

    async def deliver(events: list[StreamEvent]) -> None:
        failures.extend(e for e in events if isinstance(e, StreamFailed))

    async with open_mock_server(WireError(503, "overloaded_error", "busy", headers)) as server:
        provider = PROVIDERS[name](server.base_url)
        try:
            with trio.fail_after(10):
                await provider.open_task().stream(request(), deliver)
        finally:
            await provider.aclose()
    [failure] = failures
    assert failure.error.kind == "timeout"
    assert failure.error.retry_after_s is not None
    assert 60.0 < failure.error.retry_after_s <= 120.0


AT_30_S = "2026-01-01T00:00:30Z"

RESET_CASES: list[tuple[dict[str, str], float | None, float | None]] = [
    # Anthropic: RFC 3339 times, counted from the wall clock; only exhausted limits count.
    ({"anthropic-ratelimit-requests-remaining": "0",
      "anthropic-ratelimit-requests-reset": AT_30_S}, NOW, 30.0),
    ({"anthropic-ratelimit-requests-remaining": "0",
      "anthropic-ratelimit-requests-reset": AT_30_S}, None, None),
    ({"anthropic-ratelimit-requests-remaining": "12",
      "anthropic-ratelimit-requests-reset": AT_30_S}, NOW, None),
    ({"anthropic-ratelimit-input-tokens-remaining": "0",
      "anthropic-ratelimit-input-tokens-reset": "2026-01-01T00:00:10+00:00",
      "anthropic-ratelimit-output-tokens-remaining": "0",
      "anthropic-ratelimit-output-tokens-reset": "2026-01-01T00:00:45Z"}, NOW, 45.0),
    ({"anthropic-ratelimit-tokens-remaining": "0",
      "anthropic-ratelimit-tokens-reset": "2025-12-31T23:00:00Z"}, NOW, 0.0),
    ({"anthropic-ratelimit-tokens-remaining": "0",
      "anthropic-ratelimit-tokens-reset": "next tuesday"}, NOW, None),
    # OpenAI: durations.
    ({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1s"}, None, 1.0),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0s"}, None, 360.0),
    ({"X-RateLimit-Remaining-Tokens": "0", "X-RateLimit-Reset-Tokens": "250ms"}, None, 0.25),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "2m3.5s"}, None, 123.5),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "2h"}, None,
     RETRY_AFTER_CAP_S),
    ({"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1x"}, None, None),
    ({"x-ratelimit-remaining-tokens": "5", "x-ratelimit-reset-tokens": "9s"}, None, None),
    ({}, NOW, None),
]


@pytest.mark.parametrize(("headers", "now", "expected"), RESET_CASES)
def test_parse_rate_limit_reset(
    headers: dict[str, str], now: float | None, expected: float | None
) -> None:
    assert parse_rate_limit_reset(headers, now) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([
            "anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset",
            "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
        ]),
        st.one_of(st.just("0"), st.text(max_size=30), st.floats().map(str),
                  st.datetimes().map(lambda d: d.isoformat())),
    ),
    st.one_of(st.none(), st.floats()),
)
def test_parse_rate_limit_reset_never_raises_and_stays_in_range(
    headers: dict[str, str], now: float | None
) -> None:
    value = parse_rate_limit_reset(headers, now)
    assert value is None or 0.0 <= value <= RETRY_AFTER_CAP_S


@pytest.mark.parametrize("name", sorted(CLASSIFIERS))
def test_a_429_without_retry_after_waits_for_its_rate_limit_to_reset(name: str) -> None:
    """Every codec: a 429 that names no wait but says which limit is exhausted waits
    until it resets; a ``retry-after`` still comes first; a 500 does not read them."""
    headers = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": AT_30_S,
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "20s",
    }
    classify = CLASSIFIERS[name]
    assert classify(429, b"", headers, now=NOW).retry_after_s == 30.0
    assert classify(429, b"", {**headers, "retry-after": "3"}, now=NOW).retry_after_s == 3.0
    assert classify(500, b"", headers, now=NOW).retry_after_s is None
