"""Calling code the runtime does not own — a provider's stream, an approval or question
callback, a tool hook, a host hook — so that what it raises is the caller's to handle and
never more (R-SEC-1).

Such code can fail in its clean-up as a cancellation (an interrupt, a timeout) unwinds
it; trio then raises the failure and the ``Cancelled`` together in one exception group,
which ``except Exception`` does not catch. :func:`call_user_code` catches with
``except*``: the failure is returned (logged, when a cancellation goes on instead).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import trio

from greenroom.actors.providers.base import sole_exception

__all__ = ["call_user_code"]

logger = logging.getLogger(__name__)


async def call_user_code(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Any, BaseException | None]:
    """``fn(*args, **kwargs)``, awaited when it returns an awaitable: ``(answer, None)``,
    or ``(None, failure)`` when it raised (the one exception of a group). A cancellation is
    raised as it came; a failure that came with it is logged."""
    answer: Any = None
    failure: BaseException | None = None
    try:
        answer = fn(*args, **kwargs)
        if inspect.isawaitable(answer):
            answer = await answer
    except* Exception as group:
        failure = sole_exception(group)
        if trio.current_effective_deadline() == -math.inf:
            # Cancelled: the cancellation goes on and nobody gets the failure but the log.
            logger.warning("%r failed as it was cancelled", fn, exc_info=failure)
    return (None, failure) if failure is not None else (answer, None)
