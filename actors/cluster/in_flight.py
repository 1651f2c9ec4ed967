"""The calls other gateways forward to a session's owner, counted while it carries them out
(R-CLUSTER-1), so that a host that releases a session it closed (:mod:`.node`) stops the
session's request stream only once no call is under way there.

Cut short by that stop, a call — say a ``steer`` on a subagent that had just finished,
routed to its host by an entry that still named it, opening the session there again — was
answered in doubt (``data.outcome`` ``unknown``: it may have been done). Now the release
waits for the calls under way (at most a forwarded call's bound, the lease TTL: a call
still at work then is cut short, as before). A call that comes once the release has begun
waits for its end (as long), then is carried out when the session stayed on this host (a
call under way opened it again) or else turned away with nothing done (``not_done``),
which its gateway retries by opening the session where the call arrived (the session's
claim is released by then).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import trio

from greenroom.actors.cluster.routing import NOT_DONE, Answering, Handler, unreachable

__all__ = ["CallsInFlight", "Release"]


class CallsInFlight:
    """The forwarded calls under way on one host, per session; ``bound_s`` bounds each
    wait (the module docstring)."""

    __slots__ = ("_bound_s", "_in_flight", "_releases")

    def __init__(self, bound_s: float) -> None:
        self._bound_s = bound_s
        self._in_flight: dict[str, _Counted] = {}
        self._releases: dict[str, Release] = {}

    def counted(self, session_id: str, handler: Handler) -> Handler:
        """``handler`` of ``session_id``'s request subject, its calls counted while they
        are under way, and those that come during a release held for its end."""

        async def handle(message: dict[str, Any], answering: Answering) -> dict[str, Any]:
            release = self._releases.get(session_id)
            if release is not None:
                answering.in_doubt = False
                if not await release.kept(self._bound_s):
                    return unreachable(
                        f"session {session_id} was closed and left this host before the "
                        "call was carried out: nothing was done, try again",
                        NOT_DONE,
                    )
            counted = self._in_flight.setdefault(session_id, _Counted())
            counted.calls += 1
            try:
                return await handler(message, answering)
            finally:
                counted.calls -= 1
                if not counted.calls:
                    counted.none.set()
                    if self._in_flight.get(session_id) is counted:
                        del self._in_flight[session_id]

        return handle

    @contextlib.asynccontextmanager
    async def releasing(self, session_id: str) -> AsyncIterator[Release]:
        """Release ``session_id`` within this: from now on its calls wait for the release's
        end, and the body runs once the calls under way are done (or after the bound). The
        body says on the :class:`Release` whether the session left this host."""
        release = self._releases[session_id] = Release()
        try:
            counted = self._in_flight.get(session_id)
            if counted is not None:
                with trio.move_on_after(self._bound_s):
                    await counted.none.wait()
            yield release
        finally:
            if self._releases.get(session_id) is release:
                del self._releases[session_id]
            release.ended.set()

    def releases(self, session_id: str) -> bool:
        """Whether a release of ``session_id`` is under way (its calls wait for its end)."""
        return session_id in self._releases


class Release:
    """One release of a session: ``left`` once its request stream is stopped (it left this
    host); ``ended`` once its claim is released too, or it stayed."""

    __slots__ = ("ended", "left")

    def __init__(self) -> None:
        self.left = False
        self.ended = trio.Event()

    async def kept(self, bound_s: float) -> bool:
        """Whether the session stayed this host's, once the release has ended (within
        ``bound_s``; else it is taken for gone). Shielded: the stream's stop cancels the
        calls that wait, whose answer then reached their gateway before the claim was
        released, and the session, opened there, was still claimed here."""
        with trio.CancelScope(shield=True), trio.move_on_after(bound_s):
            await self.ended.wait()
        return self.ended.is_set() and not self.left


class _Counted:
    """The calls under way on one session; ``none`` once they are done."""

    __slots__ = ("calls", "none")

    def __init__(self) -> None:
        self.calls = 0
        self.none = trio.Event()
