"""The session directory's entries of the sessions one host owns, kept up to date: the
host that runs each, whether its task runs, the principals that may see it (the gateway's
grants, R-SEC-4) and its ``session.json``. Another host that takes a session over, or
routes a call to it, reads them (R-CLUSTER-1, R-CLUSTER-2).

Updates are queued without blocking and one task sends them in order, so the last one
sent holds the session's latest state.

A session closed on its host with no work left for a take-up (a finished subagent, a
session its user closed: no task open, run accepted and not started, or follow-up
queued) leaves the host: its entry is written a last time with ``"closed": true`` (the
host it was last on stays named), through the same queue, so no update sent before it
lands after it. No host runs a closed session and the orphan scan leaves it alone; a call
on it through any gateway opens it again there (:mod:`.router`), and a host that opens it
again writes its entry anew.

A deleted session's entry is removed through the same queue (:meth:`DirectoryEntries.remove`):
an update sent when the session was deleted lands before the removal, never after it.

A session made for a ``session.create`` another gateway placed here names its placement in
its entry (``placement``) until its first task starts, so that whichever host takes it up
learns whether that gateway withdrew it (:mod:`.placements`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.placements import PLACEMENT_FIELD, placement_of
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.trace_store import StoredSessionMissing, StoredSessionUnreadable
from greenroom.protocols.outputs import Output, TaskEnd, TaskStart

__all__ = ["DirectoryEntries", "Grantor"]


class Grantor(Protocol):
    """Who may see a session, at one gateway (the gateway's grants, R-SEC-4)."""

    def grant(self, client_id: str, session_id: str) -> None:
        """Let principal ``client_id`` see and steer session ``session_id``."""

    def holders(self, session_id: str) -> frozenset[str]:
        """The principals that may see session ``session_id``."""
        ...


class DirectoryEntries:
    """The entries of host ``host_id``'s sessions. ``owns`` says whether the host still
    owns a session (an update of one it gave up is dropped); ``warn`` hears of an update
    that could not be sent. :meth:`bind` before :meth:`publish`, then run
    :meth:`send_updates`."""

    def __init__(
        self, host_id: str, owns: Callable[[str], bool], warn: Callable[[str], None]
    ) -> None:
        self.host_id = host_id
        self._owns = owns
        self._warn = warn
        self.grants: Grantor | None = None
        self.running: dict[str, bool] = {}
        """Whether each session's task runs, as its last task_start or task_end said."""
        self._placements: dict[str, str] = {}
        """Session id → the placement it was made for, until its first task starts."""
        self._host: Host | None = None
        self._directory: SessionDirectory | None = None
        # Bounded: an update only names a session (its state is read when it is sent); a
        # full channel drops one, and the next task_start or task_end sends it again.
        self._send, self._receive = trio.open_memory_channel[str](1000)
        self._closing: dict[str, trio.Event] = {}
        """The sessions whose closed entry is queued, and the event set once it is sent."""
        self._removing: dict[str, _Removal] = {}
        """The deleted sessions whose entry's removal is queued."""

    def bind(self, host: Host, directory: SessionDirectory) -> None:
        """The host whose sessions these are, and the directory to write to."""
        self._host, self._directory = host, directory

    def note_placement(self, session_id: str) -> None:
        """Name in ``session_id``'s entries the placement it is being made for, if any
        (:func:`~.placements.placement_of`): from its first entry on, before the session
        is answered for."""
        placement = placement_of(session_id)
        if placement is not None:
            self._placements[session_id] = placement

    async def follow(self, session_id: str, inbox: trio.MemoryReceiveChannel[list[Output]]) -> None:
        """Announce each task_start and task_end of ``session_id`` read from ``inbox``."""
        # The session's watcher, a task of the host's (R-ACTOR-1); ends when the session
        # closes. Its work cannot fail: it records a flag and queues an update.
        with inbox:
            async for batch in inbox:
                for output in batch:
                    if isinstance(output, TaskStart | TaskEnd):
                        self.running[session_id] = isinstance(output, TaskStart)
                        # Its client knows it: its placement was not withdrawn, and a
                        # host that takes it up need not ask.
                        self._placements.pop(session_id, None)
                        self.announce(session_id)

    def announce(self, session_id: str) -> None:
        """Queue an update of ``session_id``'s entry."""
        with contextlib.suppress(trio.WouldBlock):
            self._send.send_nowait(session_id)

    async def publish(self, session_id: str, *, closed: bool = False) -> None:
        """Write ``session_id``'s entry now (``closed``: as a closed session's). Raises
        :class:`ClusterUnavailable`."""
        assert self._directory is not None and self._host is not None
        holders = sorted(self.grants.holders(session_id)) if self.grants else []
        running = self.running.get(session_id, False) and not closed
        entry = await _entry(self._host, self._directory, session_id, holders, running)
        marks: dict[str, Any] = {"closed": True} if closed else {}
        placement = self._placements.get(session_id)
        if placement is not None:
            marks[PLACEMENT_FIELD] = placement
        await self._directory.put(session_id, {**entry, "host": self.host_id, **marks})

    async def close(self, session_id: str) -> None:
        """Write ``session_id``'s entry as a closed session's, after the updates queued
        before (the host gave it up: later ones are dropped); return once it is sent, or
        could not be (warned)."""
        sent = self._closing.setdefault(session_id, trio.Event())
        await self._send.send(session_id)
        await sent.wait()

    async def remove(self, session_id: str) -> None:
        """Remove ``session_id``'s entry from the directory (the session was deleted), after
        the updates queued before: one sent meanwhile lands before the removal, never after
        it, and later ones are dropped (the host owns it no more). Return once it is
        removed. Raises :class:`ClusterUnavailable`."""
        removal = self._removing.setdefault(session_id, _Removal())
        await self._send.send(session_id)
        await removal.done.wait()
        if removal.error is not None:
            raise removal.error

    async def send_updates(self) -> None:
        """Send the queued updates in order, until cancelled."""
        async for session_id in self._receive:
            removal = self._removing.pop(session_id, None)
            if removal is not None:
                await self._remove(session_id, removal)
                continue
            closing = self._closing.pop(session_id, None)
            if closing is None and not self._owns(session_id):
                continue
            try:
                await self.publish(session_id, closed=closing is not None)
            except ClusterUnavailable as exc:
                self._warn(f"cannot update session {session_id} in the directory: {exc}")
            finally:
                if closing is not None:
                    closing.set()
                    self.running.pop(session_id, None)
                    self._placements.pop(session_id, None)

    async def _remove(self, session_id: str, removal: _Removal) -> None:
        assert self._directory is not None
        try:
            await self._directory.delete(session_id)
        except ClusterUnavailable as exc:
            removal.error = exc
        finally:
            removal.done.set()
            self.running.pop(session_id, None)
            self._placements.pop(session_id, None)


@attrs.define
class _Removal:
    """A queued removal of a deleted session's entry: ``done`` once tried, ``error`` when
    NATS failed it."""

    done: trio.Event = attrs.Factory(trio.Event)
    error: ClusterUnavailable | None = None


async def _entry(
    host: Host, directory: SessionDirectory, session_id: str, principals: list[str], running: bool
) -> dict[str, Any]:
    """``session_id``'s directory entry: its ``session.json`` (the one the directory has
    when this host's cannot be read), whether it runs, who may see it."""
    try:
        meta = await host.trace_store.catalog.read_meta(session_id)
    except (StoredSessionMissing, StoredSessionUnreadable):
        known = await directory.get(session_id)
        meta = (known or {}).get("meta", {})
    return {"meta": meta, "running": running, "principals": principals}
