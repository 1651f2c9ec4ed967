"""The asyncio bridge when a NATS call fails just as its trio caller is cancelled (R-PERF-2:
the workers of ``serve --workers`` stopped because their nats-server died printed a
"Task exception was never retrieved" traceback of ``nats: timeout`` each, where the
supervisor's one line said it all)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import trio
import trio.lowlevel

from greenroom.actors.cluster.bridge import Bridge, run

BOUND_S = 10.0


class _NatsTimeout(Exception):
    pass


def test_a_call_that_fails_as_its_caller_is_cancelled_reports_nothing_to_asyncio() -> None:
    reported: list[dict[str, Any]] = []

    async def main(bridge: Bridge) -> bool:
        token = trio.lowlevel.current_trio_token()
        caller = trio.CancelScope()

        async def fails_as_the_caller_is_cancelled() -> None:
            asyncio.get_running_loop().set_exception_handler(
                lambda _loop, context: reported.append(context)
            )
            # Queued before the wake-up the task's end queues: trio sees the cancellation
            # first, then the call's end (the stop of a worker whose request timed out).
            token.run_sync_soon(caller.cancel)
            raise _NatsTimeout("nats: timeout")

        with trio.fail_after(BOUND_S), caller:
            await bridge.call(fails_as_the_caller_is_cancelled)
        return caller.cancelled_caught

    assert run(main) is True
    gc.collect()  # asyncio reports an unretrieved exception as the task is collected
    assert [context.get("message") for context in reported] == []
