"""The people desk: the host's one clock for requests that wait for people (R-HITL-1).

A request waits in the trace (``approval_request``) whether its task runs or is parked
(R-HITL-3). When the session's settings give waits a limit (``approval_timeout_s``), the
desk holds the request's deadline — counted from when it was first asked, across restarts —
and when it passes calls ``expire(session_id, call_id)``; the host then resolves the
request by the session's ``approval_timeout_action`` if it is still pending. One actor per
host whatever the number of waiting requests, one heap entry each; with no limit (the
default for ``serve``) nothing is held at all. A request watched twice (a session loaded,
then its task taken up) expires once, at its earliest deadline.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import attrs
import trio

__all__ = ["PeopleDesk", "WatchRequest"]


@attrs.frozen(kw_only=True, slots=True)
class WatchRequest:
    """Command to the desk: call ``expire`` with this request at ``deadline`` (trio time)
    for the request about ``call_id`` of ``session_id`` asked at ``asked_at`` (wall time;
    None: whichever is asked then). One call can be asked about twice, an approval then a
    question: each wait has its own deadline."""

    session_id: str
    call_id: str
    deadline: float
    asked_at: float | None = None


class PeopleDesk:
    """See the module docstring. Start it with ``nursery.start(desk.run, inbox)``; it
    serves :class:`WatchRequest` until the inbox closes or it is cancelled. ``expire`` runs
    in the desk's task and must not block or raise."""

    __slots__ = ("_expire",)

    def __init__(self, expire: Callable[[WatchRequest], None]) -> None:
        self._expire = expire

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[WatchRequest],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve watch requests; expire each at its deadline. Cancel-safe."""
        task_status.started()
        heap: list[tuple[float, int, WatchRequest]] = []
        order = itertools.count()
        # The deadline each request expires at: a second watch of it would otherwise
        # resolve it twice (both expire before the first answer is taken).
        deadlines: dict[tuple[str, str, float | None], float] = {}
        async with inbox:
            while True:
                deadline = heap[0][0] if heap else math.inf
                with trio.move_on_at(deadline):
                    try:
                        request = await inbox.receive()
                    except trio.EndOfChannel:
                        return
                    key = (request.session_id, request.call_id, request.asked_at)
                    if deadlines.get(key, math.inf) > request.deadline:
                        deadlines[key] = request.deadline
                        heapq.heappush(heap, (request.deadline, next(order), request))
                    continue
                now = trio.current_time()
                while heap and heap[0][0] <= now:
                    due, _, request = heapq.heappop(heap)
                    key = (request.session_id, request.call_id, request.asked_at)
                    if deadlines.get(key) == due:
                        del deadlines[key]
                        self._expire(request)
