"""A session's outputs for one reader that is not a websocket connection (an A2A or AG-UI
stream): the traced outputs after a seq, then the live ones, with no gap and no
duplicate, for as long as the reader wants them.

Invariants (those of the hubs' subscriptions, :mod:`greenroom.actors.gateway.hubs`):

* Live first, replay second: the feed watches the session (``Session.watch``) before it
  reads the trace, so an output published meanwhile is in the watch, in the trace, or in
  both, never in neither; a traced output the replay gave is skipped by its seq.
* A reader that falls behind never holds up the session: the watch's buffer is bounded
  (:data:`FEED_BATCHES`), and a watch the session cut off is opened again and the gap read
  from the trace. Only live-only outputs (``partial_*``, ``tool_progress``) of the gap are
  lost, and the complete blocks that follow them carry everything they did.
* Outputs forwarded from subagents (``origin`` set) are not given: these protocols show
  the session's own task.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.session import Session
from greenroom.protocols.outputs import Output

__all__ = ["FEED_BATCHES", "SessionFeed"]

FEED_BATCHES = 256
"""Batches a feed's watch holds for a reader that has not taken them: beyond, the session
cuts the watch off and the feed reads the gap from the trace."""


class SessionFeed:
    """The outputs of ``session`` after ``after_seq``; with ``replay`` false, only those
    published from now on (a task the reader is about to start).

    Use it as a context manager (``with SessionFeed(...) as feed``) and take batches with
    :meth:`next_batch`; leaving it ends the watch. Not for use by two tasks at once.
    """

    def __init__(self, session: Session, after_seq: int = 0, *, replay: bool = True) -> None:
        self.session = session
        self.last_seq = after_seq
        """The seq of the last traced output given."""
        self._replay = replay
        self._pending: list[Output] = []
        self._receive: trio.MemoryReceiveChannel[list[Output]] | None = None
        self._unwatch: Callable[[], None] | None = None
        self._watch()

    def __enter__(self) -> SessionFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the watch now: the session keeps nothing of it."""
        if self._unwatch is not None:
            self._unwatch()
        if self._receive is not None:
            self._receive.close()

    @property
    def caught_up(self) -> bool:
        """Whether everything published so far has been given (the replay read, no batch
        waiting)."""
        if self._replay or self._receive is None:
            return False
        return self._receive.statistics().current_buffer_used == 0

    def skip_replay(self, last_seq: int) -> None:
        """The caller has read the trace up to ``last_seq`` itself (after the feed began to
        watch): give only what follows."""
        self._replay = False
        self.last_seq = max(self.last_seq, last_seq)

    def _watch(self) -> None:
        self.close()
        # Bounded (FEED_BATCHES): the session sends with send_nowait and cuts a full
        # watch off; the feed then reads what it missed from the trace.
        send, self._receive = trio.open_memory_channel[list[Output]](FEED_BATCHES)
        self._unwatch = self.session.watch(send)

    async def next_batch(self) -> list[Output] | None:
        """The next outputs, in order (waits for them; the replay's may be none); None
        once the session has closed and everything published before has been given."""
        while True:
            if self._replay:
                self._replay = False
                records = await replay_records(self.session, self.last_seq)
                return self._fresh(records)  # empty when the trace holds nothing after
            assert self._receive is not None
            try:
                published = await self._receive.receive()
                # What waits with it: a live piece (never traced) published before a
                # record the replay gave already is stale, even in an earlier batch.
                while True:
                    try:
                        published = published + self._receive.receive_nowait()
                    except trio.WouldBlock:
                        break
            except (trio.EndOfChannel, trio.ClosedResourceError):
                if not self._session_open():
                    return None
                # Cut off for falling behind: watch again, then read the gap.
                self._watch()
                self._replay = True
                continue
            batch = self._fresh(published)
            if batch:
                return batch

    def _fresh(self, outputs: list[Output]) -> list[Output]:
        """``outputs`` less what was given already: traced ones up to :attr:`last_seq`,
        and the live pieces published before the last of those (their block is whole in
        what the replay gave)."""
        given = self.last_seq
        stale_before = 0
        for position, output in enumerate(outputs):
            if output.seq is not None and output.seq <= given:
                stale_before = position
        fresh: list[Output] = []
        for position, output in enumerate(outputs):
            if output.origin is not None:
                continue
            if output.seq is not None:
                if output.seq <= self.last_seq:
                    continue  # given by the replay already
                self.last_seq = output.seq
            elif position < stale_before:
                continue
            fresh.append(output)
        return fresh

    def _session_open(self) -> bool:
        try:
            return self.session.host.get_session(self.session.id) is self.session
        except (SessionNotFound, RuntimeError):
            return False
