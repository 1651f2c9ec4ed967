"""The one place where asyncio runs: trio as a guest on an asyncio loop, for nats-py.

greenroom is a trio program; the NATS client (``nats-py``) is written for asyncio and keeps
its connection, its reader and its subscriptions on an asyncio event loop. Rather than run
a second loop in a thread (two schedulers, locks, cross-thread wake-ups), a cluster host runs
trio in *guest mode* on an asyncio loop (:func:`trio.lowlevel.start_guest_run`): both run
on the main thread, trio keeps its own scheduling, cancellation and nurseries, and asyncio
only drives the NATS client. No other module of the cluster touches asyncio.

:func:`run` is the entry point (in place of :func:`trio.run`); the trio code it runs gets a
:class:`Bridge`, which awaits an asyncio coroutine from trio (:meth:`Bridge.call`) and turns
a NATS subscription into an async iterator for trio (:meth:`Bridge.inbox`, fed by the
subscription's callback; :meth:`Bridge.messages`, pulled through a coroutine).

Exceptions::

    Exception
    └── BridgeClosed   the asyncio side is gone (its loop stopped, or the coroutine was
                       cancelled from the asyncio side): nothing more can cross

An exception raised by the coroutine itself crosses unchanged; translating the client's
errors is the business of the module that calls it (:mod:`.leases`, :mod:`.traces`, …).
Cancellation crosses the other way: when the trio caller is cancelled, the asyncio task is
cancelled too, and the caller does not wait for it to finish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, ParamSpec, TypeVar

import outcome
import trio

__all__ = ["Behind", "Bridge", "BridgeClosed", "Inbox", "Messages", "run", "within_else_behind"]

T = TypeVar("T")
P = ParamSpec("P")


class BridgeClosed(Exception):
    """The asyncio side of the bridge is gone: its loop stopped or the awaited coroutine was
    cancelled by someone other than the trio caller."""


class Bridge:
    """Lets trio code (running as the guest of ``loop``) await asyncio coroutines.

    Only usable from the trio run that :func:`run` started; every method is to be called
    from trio tasks of that run.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken) -> None:
        self._loop = loop
        self._token = token

    async def call(
        self, fn: Callable[P, Coroutine[Any, Any, T]], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run ``fn(*args, **kwargs)`` as an asyncio task and return its result (or raise its
        exception). Cancel-safe: if the calling trio task is cancelled, the asyncio task is
        cancelled and its outcome ignored."""
        if self._loop.is_closed():
            raise BridgeClosed("the asyncio loop is closed")
        task = self._loop.create_task(fn(*args, **kwargs))
        done = trio.Event()
        task.add_done_callback(lambda _: self.wake(done))
        try:
            await done.wait()
        except BaseException:
            task.cancel()  # nothing, for a task that ended as the caller was cancelled
            # Retrieve the outcome once it exists, so asyncio does not report an exception
            # "never retrieved" (a traceback) for a call nobody waits for any more.
            task.add_done_callback(_swallow)
            raise
        if task.cancelled():
            raise BridgeClosed("the call was cancelled on the asyncio side")
        return task.result()

    def messages(self, next_message: Callable[[], Awaitable[T]]) -> Messages[T]:
        """The items that ``next_message`` (a coroutine function such as a KV watcher's
        ``__anext__``) gives, one crossing of the bridge each, as a trio async iterator.
        Items are pulled only when the consumer asks for more. A subscription uses
        :meth:`inbox` instead."""
        return Messages(self, next_message)

    def inbox(self, limit: int = 4 * 1024) -> Inbox[T]:
        """An :class:`Inbox`: items an asyncio callback puts (a nats-py subscription's
        ``cb``), taken by trio as an async iterator. The cheap way for a busy subject: a
        callback takes each message as the client parses it, where ``next_msg`` costs an
        asyncio task and two turns of the loop a message, and each turn waits for trio's
        own (a desk with hundreds of messages at hand took seconds to drain). ``limit``:
        the most items held; a callback that finds it full waits, leaving the next messages
        in the client's own pending buffer (with its limits)."""
        return Inbox(self, limit)

    def wake(self, event: trio.Event) -> None:
        """Set ``event`` of the trio run from the asyncio side (through the run's token)."""
        # A call that finishes after the trio run ended has nobody to wake.
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(event.set)


class Messages(Generic[T]):
    """An async iterator over the items of an asyncio coroutine function, called through
    the bridge; it ends when the coroutine raises StopAsyncIteration."""

    def __init__(self, bridge: Bridge, next_message: Callable[[], Awaitable[T]]) -> None:
        self._bridge = bridge
        self._next = next_message

    def __aiter__(self) -> Messages[T]:
        return self

    async def __anext__(self) -> T:
        return await self._bridge.call(self._one)

    async def _one(self) -> T:
        return await self._next()


class Inbox(Generic[T]):
    """Items handed from asyncio to trio, in order (see :meth:`Bridge.inbox`).
    :meth:`put` and :meth:`end` are for the asyncio side, iteration for trio; the
    iterator ends after the items put before :meth:`end`."""

    def __init__(self, bridge: Bridge, limit: int) -> None:
        self._bridge = bridge
        self._limit = max(1, limit)
        self._items: collections.deque[T] = collections.deque()
        self._ended = False
        self._taker: trio.Event | None = None
        self._room: asyncio.Event | None = None
        self._holding_all = False

    async def put(self, item: T) -> None:
        """Hand ``item`` to trio (an asyncio coroutine); waits while the inbox is full.
        Dropped once the inbox has ended."""
        if self._ended:
            return
        self._items.append(item)
        self._wake_taker()
        if len(self._items) >= self._limit and not self._holding_all:
            room = self._room = asyncio.Event()
            await room.wait()

    def hold_all(self) -> None:
        """Hold every item put from now on, however many: trio takes none until the
        inbox has ended (a subscription being drained, whose last messages are few and
        must all be put before the drain is done)."""
        self._holding_all = True
        self._make_room()

    def end(self) -> None:
        """No more items (asyncio side): the iterator ends after those held."""
        self._ended = True
        self._wake_taker()
        self._make_room()

    def __aiter__(self) -> Inbox[T]:
        return self

    async def __anext__(self) -> T:
        while not self._items:
            if self._ended:
                raise StopAsyncIteration
            taker = self._taker = trio.Event()
            await taker.wait()
        item = self._items.popleft()
        if self._room is not None and len(self._items) <= self._limit // 2:
            self._make_room()
        return item

    def _wake_taker(self) -> None:
        # Once per wait of the trio side, however many items come meanwhile.
        taker, self._taker = self._taker, None
        if taker is not None:
            self._bridge.wake(taker)

    def _make_room(self) -> None:
        room, self._room = self._room, None
        if room is not None:
            room.set()


class Behind:
    """Work its caller stopped waiting for, going on in the asyncio loop until it ends or
    is cut short (:func:`within_else_behind`). Its methods are for the asyncio side."""

    def __init__(self, task: asyncio.Future[Any], cut_short: Callable[[], Awaitable[object]]):
        self._task = task
        self._cut_short = cut_short
        self._stopping: asyncio.Future[None] | None = None

    @property
    def ended(self) -> bool:
        """Whether the work has ended (done, failed, or cut short)."""
        return self._task.done()

    async def stop(self) -> None:
        """Cut the work short now, unless it has ended: ``cut_short()`` is awaited while
        it is still under way, then it is cancelled. Shielded: a cancellation of the
        caller leaves the undo to run to its end."""
        await asyncio.shield(self._begin_stop())

    def _begin_stop(self) -> asyncio.Future[None]:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        return self._stopping

    async def _stop(self) -> None:
        if self._task.done():
            return
        try:
            await self._cut_short()
        finally:
            self._task.cancel()
            self._task.add_done_callback(_swallow)

    def stop_after(self, delay_s: float) -> None:
        """:meth:`stop` once ``delay_s`` has passed, unless the work has ended by then."""
        loop = asyncio.get_running_loop()
        timer = loop.call_later(delay_s, self._begin_stop)
        self._task.add_done_callback(lambda _: timer.cancel())

    def on_end(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the work has ended (at once if it has)."""
        self._task.add_done_callback(lambda _: fn())

    async def wait(self) -> None:
        """Return once the work has ended, however it ended."""
        await asyncio.wait({self._task})


async def within_else_behind(
    work: Coroutine[Any, Any, T],
    bound_s: float,
    behind_s: float,
    cut_short: Callable[[], Awaitable[object]],
    keep_behind: Callable[[Behind], bool],
) -> T:
    """An asyncio coroutine (for :meth:`Bridge.call`): ``work``'s result, when it is done
    within ``bound_s``. When it is not (the bound, or this coroutine cancelled: its trio
    caller's own bound ran out first), ``keep_behind`` is called at once with the
    :class:`Behind` it leaves: True leaves ``work`` going on in the background, cut short
    (as by :meth:`Behind.stop`) when ``behind_s`` has passed since it began; False cuts it
    short now. Then TimeoutError (or the cancellation) is raised. For work whose
    cancellation half way leaves something behind that only an undo made before it is
    cancelled can clear (a nats-py drain), and whose end is worth waiting for longer than
    its caller can (the messages a drain still brings)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task}, timeout=bound_s)
    finally:
        if not task.done():
            behind = Behind(task, cut_short)
            if keep_behind(behind):
                behind.stop_after(max(0.0, behind_s - bound_s))
            else:
                await behind.stop()
    if not task.done():
        raise TimeoutError(f"not done within {bound_s:g} s")
    return task.result()


def _swallow(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def run(main: Callable[[Bridge], Awaitable[T]]) -> T:
    """Run ``main(bridge)`` under trio, as the guest of a new asyncio loop, and return its
    result (or raise its exception). Use it in place of :func:`trio.run` for a process that
    talks to NATS. KeyboardInterrupt is delivered to trio as usual."""
    # Not asyncio.run: its own SIGINT handler would cancel the host task under trio's feet,
    # while trio, as the guest, turns Ctrl-C into KeyboardInterrupt in the right task.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_host(main))
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


async def _host(main: Callable[[Bridge], Awaitable[T]]) -> T:
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[outcome.Outcome[T]] = loop.create_future()

    async def guest() -> T:
        return await main(Bridge(loop, trio.lowlevel.current_trio_token()))

    def on_done(result: outcome.Outcome[T]) -> None:
        if not finished.done():
            finished.set_result(result)

    trio.lowlevel.start_guest_run(
        guest,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=loop.call_soon,
        done_callback=on_done,
    )
    result = await finished
    return result.unwrap()
