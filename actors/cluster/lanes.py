"""A cluster host's work on one session, one piece at a time, in the order it was asked for.

A session is adopted when the host opens it (claimed, its trace fenced, its entry written),
released when the host closes it (its last records in JetStream, a closed entry, its
claim given up) and forgotten when it is deleted (:mod:`.node`). Run at once, a release
could give up a claim that an adoption still in flight takes a moment later, or stop the
replication of a session opened again meanwhile, and a deletion could be undone by a
closed entry written after it. Each session's pieces of work wait in its own lane
instead; a lane's order is the order of :meth:`SessionLanes.start_soon` calls (made
synchronously, where the host tells the node), and a lane is gone once empty.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable

import trio

__all__ = ["SessionLanes"]

Work = Callable[[], Awaitable[None]]


class SessionLanes:
    """The lanes of one host's sessions. A piece of work must not raise: like any task of
    the nursery that runs it, it would end the nursery."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[str, deque[Work]] = {}

    def start_soon(self, nursery: trio.Nursery, session_id: str, work: Work) -> None:
        """Run ``work`` in ``session_id``'s lane once the work queued there before it is
        done, in a task of ``nursery``. Raises RuntimeError (nothing queued) when the
        lane must start and ``nursery`` is closed."""
        queued = self._waiting.get(session_id)
        if queued is not None:
            queued.append(work)
            return
        nursery.start_soon(self._run, session_id)
        self._waiting[session_id] = deque([work])

    def has(self, session_id: str) -> bool:
        """Whether work on ``session_id`` is queued or running."""
        return session_id in self._waiting

    async def _run(self, session_id: str) -> None:
        queued = self._waiting[session_id]
        try:
            while queued:
                await queued[0]()
                queued.popleft()
        finally:
            del self._waiting[session_id]
