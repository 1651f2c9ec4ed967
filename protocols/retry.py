"""The reconnect schedule (R-RETRY-2) as pure arithmetic.

The same function gives the wait announced in ``request_end.retry_in_ms`` and the wait the
streamer really sleeps, so the two can never disagree.
"""

from __future__ import annotations

from greenroom.protocols.stream import ErrorKind

MAX_RETRIES = 5
"""Retries after the first attempt: a turn has at most six attempts."""

BASE_DELAY_MS = 250
MAX_DELAY_MS = 30_000

RETRYABLE: frozenset[ErrorKind] = frozenset({"timeout", "malformed", "failed"})


def backoff_ms(retry_number: int, retry_after_s: float | None = None) -> int:
    """The wait before retry ``retry_number`` (0-based): 250 ms x 2^n capped at 30 s.

    A provider ``retry-after`` longer than the planned wait raises it (never lowers it).
    """
    planned: int = min(BASE_DELAY_MS << retry_number, MAX_DELAY_MS)
    if retry_after_s is not None and retry_after_s * 1000 > planned:
        return int(retry_after_s * 1000)
    return planned


def should_retry(kind: ErrorKind, attempt: int, *, permanent: bool = False) -> bool:
    """Whether a turn whose attempt ``attempt`` (1-based) failed with ``kind`` tries again.

    A ``permanent`` failure (:attr:`ModelError.permanent`: the provider rejected the request
    itself) never does: the same request would be rejected the same way."""
    return not permanent and kind in RETRYABLE and attempt <= MAX_RETRIES
