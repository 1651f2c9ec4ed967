"""Where a session id stands in the host's trees, for the gateway's authorization: a
subagent at any depth is reached through its root (R-TREE-1), and an answer names the node
whose request waits for it (R-HOST-4, R-HITL-2)."""

from __future__ import annotations

from greenroom.actors.gateway.access import Grants
from greenroom.actors.gateway.config import SESSION_ID
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.host import Host, stored_root
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.trace_store import StoredSessionMissing, StoredSessionUnreadable

__all__ = ["Nodes"]


class Nodes:
    """Reads a host's sessions and a gateway's grants; holds nothing of its own."""

    __slots__ = ("_grants", "_host")

    def __init__(self, host: Host, grants: Grants) -> None:
        self._host = host
        self._grants = grants

    async def root_of(self, session_id: str) -> str | None:
        """The root of ``session_id``'s tree (its own id for a root), from the open session
        or its stored ``session.json``; None when there is no such session."""
        try:
            return self._host.get_session(session_id).root_id
        except SessionNotFound:
            pass
        if not SESSION_ID.fullmatch(session_id):
            return None
        try:
            meta = await self._host.trace_store.catalog.read_meta(session_id)
        except (StoredSessionMissing, StoredSessionUnreadable):
            return None
        return stored_root(meta, session_id)

    async def exists(self, session_id: str) -> bool:
        """Whether any principal, the host or its store knows ``session_id``."""
        if self._grants.anyone_owns(session_id):
            return True
        if any(s.id == session_id for s in self._host.sessions):
            return True
        if not SESSION_ID.fullmatch(session_id):
            return False
        return await self._host.trace_store.catalog.exists(session_id)

    async def asked_in(self, session: Session, call_id: str) -> str:
        """The session of ``session``'s tree (itself or a subagent) where the request
        ``call_id`` waits for a person; ``session``'s own id when none does (the host then
        refuses the answer as not pending)."""
        # Read only: a stored subagent is loaded by the answer, with the gateway's tools.
        pending = await self._host.pending_approvals(read_only=True)
        if any(p.session_id == session.id and p.call_id == call_id for p in pending):
            return session.id
        for request in pending:
            if request.call_id == call_id and session.id in request.origin:
                return request.session_id
        return session.id
