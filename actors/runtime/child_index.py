"""Which sessions each open session spawned (R-TREE-1: ``Session.children``), without a
scan of the store for the usual case.

A session created in this process has no children but those created after it, so the
index knows them all from its birth: a list of ids, filled as its subagents are created.
For a session loaded from the store the children are read once from the catalog (each
stored ``session.json``'s ``parent_id``) and kept from then on, with the children
created while they were read. An entry goes when its session closes.
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
    loaded from the store (``Host.load_session``); it raises :class:`SessionNotFound`.
    ``is_open`` says whether a session is open here (its children are kept)."""

    __slots__ = ("_catalog", "_ids", "_is_open", "_load", "_reading")

    def __init__(
        self,
        catalog: SessionCatalog,
        load: Callable[[str], Awaitable[S]],
        is_open: Callable[[str], bool],
    ) -> None:
        self._catalog = catalog
        self._load = load
        self._is_open = is_open
        self._ids: dict[str, list[str]] = {}
        self._reading: dict[str, list[list[str]]] = {}
        """For each session whose children are being read: each reading's children
        created meanwhile (the catalog may list them or not)."""

    def created(self, session_id: str, parent_id: str | None) -> None:
        """The host created ``session_id`` (a subagent of ``parent_id``, when given)."""
        self._ids[session_id] = []
        if parent_id is not None:
            if parent_id in self._ids:
                self._ids[parent_id].append(session_id)
            for meanwhile in self._reading.get(parent_id, ()):
                meanwhile.append(session_id)

    async def ids(self, session_id: str) -> list[str]:
        """The ids of ``session_id``'s children, oldest first; read from the catalog when
        they are not known, and kept while the session is open."""
        ids = self._ids.get(session_id)
        if ids is None:
            meanwhile: list[str] = []
            self._reading.setdefault(session_id, []).append(meanwhile)
            try:
                listed = await self._catalog.list_sessions()
            finally:
                readings = self._reading[session_id]
                readings.remove(meanwhile)
                if not readings:
                    del self._reading[session_id]
            found = sorted(
                (float(entry.meta.get("created_at", 0.0)), entry.session_id)
                for entry in listed
                if entry.meta is not None and entry.meta.get("parent_id") == session_id
            )
            ids = [child_id for _, child_id in found]
            ids += [child_id for child_id in meanwhile if child_id not in ids]
            # Known by now (another reading) or not open any more: nothing to keep.
            if session_id not in self._ids and self._is_open(session_id):
                self._ids[session_id] = ids
        return list(ids)

    async def sessions(self, session_id: str) -> list[S]:
        """``session_id``'s children (see :meth:`ids`), each open or loaded; one that
        cannot be loaded (deleted, unreadable) is left out: it hides no other (R-SEC-1)."""
        found: list[S] = []
        for child_id in await self.ids(session_id):
            try:
                found.append(await self._load(child_id))
            except SessionNotFound:
                continue
        return found

    def closed(self, session_id: str) -> None:
        """``session_id`` is no longer open here: its entry goes (read again if needed)."""
        self._ids.pop(session_id, None)
