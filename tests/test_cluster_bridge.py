"""The asyncio bridge (actors/cluster/bridge.py): trio as the guest of an asyncio loop, the
only place asyncio runs (R-CLUSTER-1's hosts talk to NATS through it)."""

from __future__ import annotations

import asyncio

import pytest
import trio
import trio.lowlevel

from greenroom.actors.cluster.bridge import Bridge, BridgeClosed, Inbox, run

BOUND_S = 10.0


async def _double(value: int) -> int:
    await asyncio.sleep(0)
    return 2 * value


def test_a_coroutine_result_crosses_to_trio() -> None:
    async def main(bridge: Bridge) -> int:
        with trio.fail_after(BOUND_S):
            return await bridge.call(_double, 21)

    assert run(main) == 42


class _Boom(Exception):
    pass


async def _fail() -> None:
    await asyncio.sleep(0)
    raise _Boom("from asyncio")


def test_an_exception_crosses_unchanged() -> None:
    async def main(bridge: Bridge) -> str:
        with trio.fail_after(BOUND_S):
            try:
                await bridge.call(_fail)
            except _Boom as exc:
                return str(exc)
        return "no exception"

    assert run(main) == "from asyncio"


def test_trio_cancellation_cancels_the_asyncio_task() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main(bridge: Bridge) -> bool:
        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:

                async def caller() -> None:
                    await bridge.call(forever)

                nursery.start_soon(caller)
                await bridge.call(started.wait)
                nursery.cancel_scope.cancel()
            await bridge.call(cancelled.wait)
            return cancelled.is_set()

    assert run(main) is True


def test_an_asyncio_side_cancellation_is_bridge_closed() -> None:
    async def main(bridge: Bridge) -> str:
        async def cancel_self() -> None:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)

        with trio.fail_after(BOUND_S):
            try:
                await bridge.call(cancel_self)
            except BridgeClosed:
                return "closed"
        return "no exception"

    assert run(main) == "closed"


def test_messages_are_pulled_one_at_a_time_and_end() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()

    async def next_item() -> int:
        item = await queue.get()
        if item < 0:
            raise StopAsyncIteration
        return item

    async def main(bridge: Bridge) -> list[int]:
        with trio.fail_after(BOUND_S):
            for item in (1, 2, 3, -1):
                queue.put_nowait(item)
            return [item async for item in bridge.messages(next_item)]

    assert run(main) == [1, 2, 3]


def test_an_inbox_hands_items_to_trio_in_order_and_ends_after_them() -> None:
    """What an asyncio callback puts reaches trio in order, however many come between two
    looks of the trio side, and the end comes after the items put before it."""
    loop_put: list[int] = []

    async def main(bridge: Bridge) -> list[int]:
        inbox: Inbox[int] = bridge.inbox()

        async def producer() -> None:
            for item in range(1000):
                await inbox.put(item)
                loop_put.append(item)
            inbox.end()
            await inbox.put(-1)  # dropped: the inbox has ended

        with trio.fail_after(BOUND_S):
            await bridge.call(producer)
            return [item async for item in inbox]

    assert run(main) == list(range(1000))
    assert loop_put == list(range(1000))  # never held up: below the limit


def test_a_full_inbox_holds_the_callback_until_trio_has_taken_half() -> None:
    """With a limit of 4 the put of the fourth item waits (the client keeps the next
    messages in its own buffer) until the trio side has left no more than 2."""
    putting: list[int] = []

    async def main(bridge: Bridge) -> tuple[list[int], list[int], list[int], list[int]]:
        inbox: Inbox[int] = bridge.inbox(limit=4)

        async def producer() -> None:
            for item in range(6):
                putting.append(item)
                await inbox.put(item)
            inbox.end()

        with trio.fail_after(BOUND_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(bridge.call, producer)
                while len(putting) < 4:
                    await trio.lowlevel.checkpoint()
                for _ in range(10):  # turns of both loops: the producer stays held
                    await trio.lowlevel.checkpoint()
                held = list(putting)
                taken = [await inbox.__anext__(), await inbox.__anext__()]
                while len(putting) < 6:  # room again: it goes on
                    await trio.lowlevel.checkpoint()
                after = list(putting)
                rest = [item async for item in inbox]
            return held, taken, after, rest

    held, taken, after, rest = run(main)
    assert held == [0, 1, 2, 3]
    assert taken == [0, 1]
    assert after == list(range(6))
    assert rest == [2, 3, 4, 5]


def test_trio_errors_come_out_of_run() -> None:
    async def main(bridge: Bridge) -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError("trio side")

    with pytest.raises(ValueError, match="trio side"):
        run(main)


def test_trio_timeouts_work_in_guest_mode() -> None:
    async def main(bridge: Bridge) -> bool:
        with trio.move_on_after(0.01) as scope:
            await trio.sleep_forever()
        return scope.cancelled_caught

    assert run(main) is True


def test_only_the_bridge_runs_asyncio_and_single_host_mode_never_imports_nats() -> None:
    import re
    import subprocess
    import sys
    from pathlib import Path

    cluster = Path(__file__).resolve().parents[1] / "actors" / "cluster"
    users = sorted(
        str(path.relative_to(cluster))
        for path in cluster.rglob("*.py")
        if re.search(r"^\s*(import asyncio|from asyncio)", path.read_text(), re.MULTILINE)
    )
    assert users == ["bridge.py"]
    probe = (
        "import sys, greenroom.actors.apps.cli, greenroom.actors.gateway; "
        "print(sorted(m for m in sys.modules if m == 'nats' or m.startswith('nats.')"
        " or m.startswith('greenroom.actors.cluster')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
