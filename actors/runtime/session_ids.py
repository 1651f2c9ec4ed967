"""Which session ids a host is opening (R-HOST-1: each session has its own files).

A creation or a load awaits (the workspace, ``session.json``, the trace) before its session
is open; its id is taken before the first await, so that two creations at once never share
an id and two loads of one stored session open it once.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import trio

from greenroom.actors.runtime.errors import SessionExists

T = TypeVar("T")
S = TypeVar("S")

ID_DRAWS = 8
"""New ids drawn for one session before giving up (each draw that is taken is another
session's: 24 random bits within one second)."""


def new_session_id() -> str:
    """A timestamp and 24 random bits: ``20261205-120000-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


class OpeningSessions(Generic[S]):
    """The ids of the sessions a host is creating or loading, beside those it has open."""

    def __init__(self, open_sessions: Mapping[str, S]) -> None:
        self._open = open_sessions
        self._opening: dict[str, trio.Event] = {}

    async def create(
        self,
        session_id: str | None,
        create: Callable[..., Awaitable[T]],
        *args: Any,
        **kwargs: Any,
    ) -> T:
        """``create(*args, session_id=…, **kwargs)`` a session under ``session_id`` (or a
        new id), the id held against every other creation and load meanwhile.
        :class:`SessionExists` when ``session_id`` is open, being opened or (from
        ``create``) stored; a drawn id that is taken is drawn again."""
        for _ in range(ID_DRAWS):
            new_id = session_id or new_session_id()
            if new_id in self._open or new_id in self._opening:
                if session_id is not None:
                    raise SessionExists(f"a session {session_id!r} is open in this host")
                continue
            with self.opening(new_id):
                try:
                    return await create(*args, session_id=new_id, **kwargs)
                except SessionExists:
                    if session_id is not None:
                        raise
        raise SessionExists(f"no free session id after {ID_DRAWS} draws")

    def every_id(self) -> list[str]:
        """The ids of the open sessions, then of those being created, loaded or closed:
        what a host that closes must close (a load under way as the close began adds its
        session after the close looked at the open ones)."""
        return [*self._open, *(i for i in self._opening if i not in self._open)]

    async def settled(
        self, session_id: str, still_open: Callable[[], None] | None = None
    ) -> S | None:
        """The open session ``session_id`` once no creation or load of it is under way;
        None when it is not open (then none was, or that attempt failed). ``still_open``
        (a host's ``check_open``) is called then, and raises to refuse: a load that waited
        for another may go on only while its host is open — once the host's close has
        listed what it closes (:meth:`every_id`), a session it opened would stay open."""
        while (opening := self._opening.get(session_id)) is not None:
            await opening.wait()
        if still_open is not None:
            still_open()
        return self._open.get(session_id)

    @contextlib.asynccontextmanager
    async def held(self, session_id: str) -> AsyncIterator[None]:
        """``session_id`` held (as :meth:`opening`) until the block ends, once no creation,
        load or close of it is under way."""
        await self.settled(session_id)
        with self.opening(session_id):
            yield

    @contextlib.contextmanager
    def opening(self, session_id: str) -> Iterator[None]:
        """``session_id`` is being opened (or closed: :meth:`settled` waits for it too)
        until the block ends."""
        done = self._opening[session_id] = trio.Event()
        try:
            yield
        finally:
            del self._opening[session_id]
            done.set()
