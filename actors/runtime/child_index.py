"""Which sessions each open session spawned (R-TREE-1: ``Session.children``), without a
scan of the store for the usual case.

A session created in this process has no children but those created after it, so the
index knows them all from its birth: a list of ids, filled as its subagents are created.
For a session loaded from the store the children are read once from the catalog (each
stored ``session.json``'s ``parent_id``) and kept from then on. An entry goes when its
session closes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.trace_store import SessionCatalog

__all__ = ["ChildIndex"]

S = TypeVar("S")


class ChildIndex(Generic[S]):
    """See the module docstring. ``load`` gives the session of an id: the open one, else
    loaded from the store (``Host.load_session``); it raises :class:`SessionNotFound`."""

    __slots__ = ("_catalog", "_ids", "_load")

    def __init__(self, catalog: SessionCatalog, load: Callable[[str], Awaitable[S]]) -> None:
        self._catalog = catalog
        self._load = load
        self._ids: dict[str, list[str]] = {}

    def created(self, session_id: str, parent_id: str | None) -> None:
        """The host created ``session_id`` (a subagent of ``parent_id``, when given)."""
        self._ids[session_id] = []
        if parent_id is not None and parent_id in self._ids:
            self._ids[parent_id].append(session_id)

    async def ids(self, session_id: str, *, keep: bool) -> list[str]:
        """The ids of ``session_id``'s children, oldest first; read from the catalog when
        they are not known, and kept when ``keep`` (the session is open)."""
        ids = self._ids.get(session_id)
        if ids is None:
            found = sorted(
                (float(entry.meta.get("created_at", 0.0)), entry.session_id)
                for entry in await self._catalog.list_sessions()
                if entry.meta is not None and entry.meta.get("parent_id") == session_id
            )
            ids = [child_id for _, child_id in found]
            if keep:
                self._ids[session_id] = ids
        return list(ids)

    async def sessions(self, session_id: str, *, keep: bool) -> list[S]:
        """``session_id``'s children (see :meth:`ids`), each open or loaded; one that
        cannot be loaded (deleted, unreadable) is left out: it hides no other (R-SEC-1)."""
        found: list[S] = []
        for child_id in await self.ids(session_id, keep=keep):
            try:
                found.append(await self._load(child_id))
            except SessionNotFound:
                continue
        return found

    def closed(self, session_id: str) -> None:
        """``session_id`` is no longer open here: its entry goes (read again if needed)."""
        self._ids.pop(session_id, None)
