"""``leaving_in_bounded_time``: how a command's trio run ends when tasks are left behind
(tools abandoned because they ignore the interrupt, R-SEC-2), on a mock clock.

A left-behind task is a system task shielded from cancellation, as a tool blocked in a
thread is; ``os._exit`` is replaced by one that records the code, lets that task go (so
the trio run can end) and raises :class:`Exited`."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable, Iterator

import pytest
import trio
import trio.testing

from greenroom.actors.apps.run import LEAVE_GRACE_S, LEAVE_POLL_S, leaving_in_bounded_time


class Exited(BaseException):
    """What the replaced ``os._exit`` raises."""


class Leaving:
    """A trio run on a mock clock whose main task ends through ``leaving_in_bounded_time``."""

    def __init__(self) -> None:
        self.exit_code: int | None = None
        self.elapsed: float | None = None
        self.released: trio.Event | None = None
        self.started = 0.0

    def fake_exit(self, code: int) -> None:
        self.exit_code = code
        self.elapsed = trio.current_time() - self.started
        assert self.released is not None
        self.released.set()
        raise Exited

    async def left_behind(self, ends_after_s: float, then: Callable[[], None] | None) -> None:
        assert self.released is not None
        with trio.CancelScope(shield=True):  # as a tool blocked in a thread: not cancellable
            with trio.move_on_after(ends_after_s):
                await self.released.wait()
            if then is not None:
                then()
                await self.released.wait()

    def run(
        self,
        work: Callable[[], Awaitable[int]],
        *,
        ends_after_s: float | None = None,
        then: Callable[[], None] | None = None,
    ) -> int | None:
        """Run ``work`` with a task left behind (ending after ``ends_after_s``, then calling
        ``then``, if given); what the leave returned, None when it exited."""

        async def main() -> int | None:
            self.released = trio.Event()
            self.started = trio.current_time()
            if ends_after_s is not None:
                trio.lowlevel.spawn_system_task(self.left_behind, ends_after_s, then)
            try:
                result = await leaving_in_bounded_time(work(), lambda code: code)
            except Exited:
                return None
            self.elapsed = trio.current_time() - self.started
            return result

        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.fixture
def leaving(monkeypatch: pytest.MonkeyPatch) -> Iterator[Leaving]:
    state = Leaving()
    monkeypatch.setattr(os, "_exit", state.fake_exit)
    # trio turns SIGINT into KeyboardInterrupt only over Python's default handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)


async def returns_3() -> int:
    await trio.lowlevel.checkpoint()
    return 3


def test_nothing_left_behind_returns_the_result_at_once(leaving: Leaving) -> None:
    assert leaving.run(returns_3) == 3
    assert leaving.exit_code is None
    assert leaving.elapsed == 0


def test_a_task_that_ends_within_the_grace_is_waited_for(leaving: Leaving) -> None:
    assert leaving.run(returns_3, ends_after_s=LEAVE_GRACE_S / 4) == 3
    assert leaving.exit_code is None
    assert leaving.elapsed == pytest.approx(LEAVE_GRACE_S / 4, abs=LEAVE_POLL_S)


def test_a_task_left_behind_past_the_grace_exits_with_the_commands_code(
    leaving: Leaving,
) -> None:
    assert leaving.run(returns_3, ends_after_s=LEAVE_GRACE_S * 100) is None
    assert leaving.exit_code == 3
    assert leaving.elapsed == pytest.approx(LEAVE_GRACE_S, abs=LEAVE_POLL_S)


def test_a_ctrl_c_while_it_waits_leaves_at_once_with_130(
    leaving: Leaving, capsys: pytest.CaptureFixture[str]
) -> None:
    def ctrl_c() -> None:
        signal.raise_signal(signal.SIGINT)

    assert leaving.run(returns_3, ends_after_s=LEAVE_GRACE_S / 4, then=ctrl_c) is None
    assert leaving.exit_code == 130
    assert leaving.elapsed == pytest.approx(LEAVE_GRACE_S / 4, abs=LEAVE_POLL_S)
    assert "interrupted: leaving now" in capsys.readouterr().err


def test_an_interrupt_that_ends_the_work_leaves_at_once_with_130(
    leaving: Leaving, capsys: pytest.CaptureFixture[str]
) -> None:
    async def interrupted() -> int:
        await trio.lowlevel.checkpoint()
        raise KeyboardInterrupt

    assert leaving.run(interrupted, ends_after_s=LEAVE_GRACE_S * 100) is None
    assert leaving.exit_code == 130
    assert leaving.elapsed == 0
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted"


def test_a_reader_gone_exits_141_after_the_grace(leaving: Leaving) -> None:
    async def reader_gone() -> int:
        async with trio.open_nursery():  # raised as a nursery raises it: in a group
            raise BrokenPipeError

    assert leaving.run(reader_gone, ends_after_s=LEAVE_GRACE_S * 100) is None
    assert leaving.exit_code == 141
    assert leaving.elapsed == pytest.approx(LEAVE_GRACE_S, abs=LEAVE_POLL_S)


def test_without_a_task_left_behind_an_error_is_raised_as_it_was(leaving: Leaving) -> None:
    async def reader_gone() -> int:
        await trio.lowlevel.checkpoint()
        raise BrokenPipeError

    with pytest.raises(BrokenPipeError):
        leaving.run(reader_gone)
    assert leaving.exit_code is None
