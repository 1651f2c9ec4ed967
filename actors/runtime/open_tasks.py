"""Which stored sessions a host has left with a task open — waiting for people, cut off
when a host stopped, or accepted and not yet started (a prompt without its ``task_start``)
— so that their requests can be listed and their tasks taken up
(R-HITL-2, R-HITL-4) without the host holding them open.

The store is read once per host (every session's latest trace, folded by the task
machine); from then on the index is kept as the host closes and deletes sessions.
"""

from __future__ import annotations

from collections.abc import Container

from greenroom.actors.runtime.trace_store import TraceStore
from greenroom.protocols.task import TaskMachine, fold

__all__ = ["OpenTaskIndex", "leaves_work"]


def leaves_work(machine: TaskMachine) -> bool:
    """Whether the session whose work ``machine`` holds leaves some for a take-up when
    nothing runs it: a task open, a run accepted and not yet started (a prompt without its
    ``task_start``), or follow-ups recorded as queued (R-STEER-6)."""
    record = machine.record
    return machine.run_id is not None or record.unstarted is not None or bool(record.queued)


class OpenTaskIndex:
    """See the module docstring."""

    __slots__ = ("_open", "_scanned", "_store")

    def __init__(self, store: TraceStore) -> None:
        self._store = store
        self._open: set[str] = set()
        self._scanned = False

    async def ids(self, open_here: Container[str]) -> list[str]:
        """The stored sessions, not in ``open_here``, whose trace leaves a task open."""
        if not self._scanned:
            found: set[str] = set()
            for entry in await self._store.catalog.list_sessions():
                if entry.meta is None or entry.session_id in open_here:
                    continue
                try:
                    loaded = await self._store.log.read_latest(entry.session_id)
                except OSError:
                    continue  # unreadable: listed by list_sessions, not resumed
                if leaves_work(fold(list(loaded.records))):
                    found.add(entry.session_id)
            self._open |= found
            self._scanned = True
        return sorted(s for s in self._open if s not in open_here)

    def closed(self, session_id: str, machine: TaskMachine | None) -> None:
        """The host closed ``session_id``, whose work ``machine`` holds (None: not open)."""
        if machine is not None and leaves_work(machine):
            self._open.add(session_id)
        else:
            self._open.discard(session_id)

    def deleted(self, session_id: str) -> None:
        """The session is gone from the store."""
        self._open.discard(session_id)
