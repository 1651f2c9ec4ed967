"""The one retry policy of R-RETRY as pure functions (R-ACTOR-4).

Two questions, each answered in one place:

* :func:`parse_retry_after` — how long a provider asks us to wait, from its response
  headers. Every codec's ``classify_error`` uses it, so the same headers give the same
  ``ModelError.retry_after_s`` whichever provider sent them; for a 429 without it,
  :func:`parse_rate_limit_reset` reads when the exhausted rate limit resets.
* :func:`decide_retry` — whether a failed attempt is retried and after how long. Every
  caller that retries a model request (a turn's attempts, a compaction's) asks it, and the
  wait it returns is both the one announced in ``request_end.retry_in_ms`` and the one
  really slept, so the two can never disagree.

:func:`transient_status_text` says in words what a retried HTTP status means (``rate limited
(HTTP 429)``), so that a ``timeout`` failure's message tells what happened rather than its
class (R-RETRY-1, R-RETRY-3).

Invariants of :func:`decide_retry`: at most :data:`MAX_RETRIES` retries; the wait before
retry ``n`` (0-based) is never below ``250 ms x 2^n`` capped at 30 s, never decreases from
one retry to the next for the same error, and never exceeds :data:`RETRY_AFTER_CAP_S` when a
provider asks for longer.
"""

from __future__ import annotations

import calendar
import datetime
import math
import re
from collections.abc import Mapping

import attrs

from greenroom.protocols.stream import ErrorKind, ModelError

MAX_RETRIES = 5
"""Retries after the first attempt: a turn has at most six attempts."""

BASE_DELAY_MS = 250
MAX_DELAY_MS = 30_000

RETRY_AFTER_CAP_S = 3600.0
"""The longest wait a provider's ``retry-after`` can impose (one hour): a longer value is
clamped to it, so a server cannot park a session for a day. ``skip_reconnect_wait`` ends
any wait early (R-RETRY-5)."""

RETRYABLE: frozenset[ErrorKind] = frozenset({"timeout", "malformed", "failed"})
"""The kinds retried within the turn. ``auth`` never is (R-RETRY-6); ``context_overflow``
is answered by a compaction and a rerun of the turn, which its caller does (R-COMPACT-9)."""


# ------------------------------------------------------------------------ retry-after


def parse_retry_after(headers: Mapping[str, str], now: float | None) -> float | None:
    """The wait in seconds a provider asks for, or None when it asks for none we can use.

    ``retry-after-ms`` (milliseconds, an OpenAI extension) comes first; when it is absent or
    unusable, ``retry-after`` as seconds or as an HTTP date (RFC 9110). A date is turned into
    a wait relative to ``now`` (seconds since the epoch, the wall clock); with ``now`` None
    dates are ignored, since this module reads no clock. A date already past is a wait of 0.
    Negative, NaN and infinite values are ignored; waits longer than
    :data:`RETRY_AFTER_CAP_S` are clamped to it. Header names are matched case-insensitively.
    Never raises.
    """
    raw_ms = _header(headers, "retry-after-ms")
    if raw_ms is not None:
        value = _number(raw_ms)
        if value is not None:
            return min(value / 1000.0, RETRY_AFTER_CAP_S)
    raw = _header(headers, "retry-after")
    if raw is None:
        return None
    value = _number(raw)
    if value is None and now is not None:
        value = _until(raw, now)
    return None if value is None else min(value, RETRY_AFTER_CAP_S)


_RESET_HEADERS: tuple[tuple[str, str], ...] = (
    *(
        (f"anthropic-ratelimit-{limit}-remaining", f"anthropic-ratelimit-{limit}-reset")
        for limit in ("requests", "tokens", "input-tokens", "output-tokens")
    ),
    *(
        (f"x-ratelimit-remaining-{limit}", f"x-ratelimit-reset-{limit}")
        for limit in ("requests", "tokens")
    ),
)
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_rate_limit_reset(headers: Mapping[str, str], now: float | None) -> float | None:
    """How long until the provider's exhausted rate limit resets, from the rate-limit
    headers of a 429 that has no ``retry-after``: the latest reset among the limits whose
    remaining count is 0 — Anthropic's ``anthropic-ratelimit-<limit>-remaining`` and
    ``-reset`` (an RFC 3339 time, counted from ``now``, the wall clock; ignored without
    it), OpenAI's ``x-ratelimit-remaining-<limit>`` and ``x-ratelimit-reset-<limit>`` (a
    duration: ``1s``, ``6m0s``, ``250ms``). None when no limit says it is exhausted or
    none of their resets can be read; capped at :data:`RETRY_AFTER_CAP_S`. Never raises.
    """
    latest: float | None = None
    for remaining_name, reset_name in _RESET_HEADERS:
        remaining = _header(headers, remaining_name)
        reset = _header(headers, reset_name)
        if remaining is None or reset is None or remaining.strip() != "0":
            continue
        wait = _duration(reset.strip())
        if wait is None and now is not None and math.isfinite(now):
            wait = _until_rfc3339(reset.strip(), now)
        if wait is not None and (latest is None or wait > latest):
            latest = wait
    return None if latest is None else min(latest, RETRY_AFTER_CAP_S)


def _duration(raw: str) -> float | None:
    """A Go-style duration (``1h2m3.5s``, ``250ms``) in seconds, else None."""
    parts = _DURATION_PART.findall(raw)
    if not parts or "".join(number + unit for number, unit in parts) != raw:
        return None
    total = sum(float(number) * _DURATION_UNIT_S[unit] for number, unit in parts)
    return total if math.isfinite(total) else None


def _until_rfc3339(raw: str, now: float) -> float | None:
    """Seconds from ``now`` to the RFC 3339 time ``raw`` (0 when past), None when not one."""
    try:
        when = datetime.datetime.fromisoformat(raw)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    try:
        return max(when.timestamp() - now, 0.0)
    except (OverflowError, ValueError):
        return None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        # Plain dicts are case-sensitive; httpx's Headers are not.
        for key, candidate in headers.items():
            if key.lower() == name:
                return candidate
    return value


def _number(raw: str) -> float | None:
    """A finite, non-negative number, else None."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _until(raw: str, now: float) -> float | None:
    """Seconds from ``now`` to the HTTP date ``raw`` (0 when past), None when not a date."""
    import email.utils  # rare, and a start-up's few ms: loaded when a date comes

    try:
        parts = email.utils.parsedate_tz(raw)
        if parts is None:
            return None
        # HTTP dates are always GMT (RFC 9110); a missing zone is read as GMT, never as the
        # machine's local time.
        when = calendar.timegm(parts[:6]) - (parts[9] or 0)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if not math.isfinite(now):
        return None
    return max(when - now, 0.0)


# ------------------------------------------------------------------------ words

_STATUS_WORDS: dict[int, str] = {
    408: "request timeout",
    429: "rate limited",
    500: "server error",
    502: "bad gateway",
    503: "service unavailable",
    504: "gateway timeout",
    529: "overloaded",
}


def transient_status_text(status: int, detail: str = "") -> str:
    """A transient HTTP status in words, with the provider's ``detail`` after it when there
    is one: ``rate limited (HTTP 429): Rate limit reached``, ``overloaded (HTTP 529)``; any
    other 5xx is a ``server error``."""
    words = _STATUS_WORDS.get(status) or ("server error" if 500 <= status <= 599 else "error")
    text = f"{words} (HTTP {status})"
    return f"{text}: {detail}" if detail else text


# ------------------------------------------------------------------------ the policy


@attrs.frozen(kw_only=True, slots=True)
class RetryDecision:
    """What to do after a failed attempt: ``retry`` it after ``delay_ms`` milliseconds, or
    not (then ``delay_ms`` is None)."""

    retry: bool
    delay_ms: int | None = None


GIVE_UP = RetryDecision(retry=False)


def decide_retry(error: ModelError, attempt: int) -> RetryDecision:
    """Whether the attempt ``attempt`` (1-based) that failed with ``error`` is retried, and
    the wait before the retry (R-RETRY-2).

    Retried: ``timeout``, ``malformed`` and ``failed``, for at most :data:`MAX_RETRIES`
    retries, unless the error is ``permanent`` (the provider rejected the request itself: the
    same request would be rejected the same way). Never retried: ``auth`` (R-RETRY-6) and
    ``context_overflow``, which the caller answers with a compaction (R-COMPACT-9). The wait
    is :func:`backoff_ms` for retry ``attempt - 1``. Raises ValueError for ``attempt < 1``.
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, got {attempt}")
    if error.permanent or error.kind not in RETRYABLE or attempt > MAX_RETRIES:
        return GIVE_UP
    return RetryDecision(retry=True, delay_ms=backoff_ms(attempt - 1, error.retry_after_s))


def backoff_ms(retry_number: int, retry_after_s: float | None = None) -> int:
    """The wait before retry ``retry_number`` (0-based): 250 ms x 2^n capped at 30 s.

    A provider ``retry-after`` longer than the planned wait raises it (never lowers it), up
    to :data:`RETRY_AFTER_CAP_S`; a negative, NaN or infinite one is ignored.
    """
    # The shift is bounded so that a large ``retry_number`` costs nothing.
    planned: int = min(BASE_DELAY_MS << min(retry_number, 16), MAX_DELAY_MS)
    if retry_after_s is None or not math.isfinite(retry_after_s) or retry_after_s < 0:
        return planned
    return max(planned, round(min(retry_after_s, RETRY_AFTER_CAP_S) * 1000))


def should_retry(kind: ErrorKind, attempt: int, *, permanent: bool = False) -> bool:
    """:func:`decide_retry`'s answer for an error known only by its ``kind``: whether a turn
    whose attempt ``attempt`` (1-based) failed with ``kind`` tries again."""
    return decide_retry(ModelError(kind=kind, message="", permanent=permanent), attempt).retry
