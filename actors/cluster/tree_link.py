"""A tree across hosts (R-TREE-4): a background subagent's answer for a parent that another
host owns. The child's host sends it on the parent's request subject
(:data:`~.router.REPORT_METHOD`); the parent's owner takes it as input of the parent
(:meth:`~greenroom.actors.runtime.child_reports.ChildReports.take`)."""

from __future__ import annotations

import sys
from typing import Any

from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.router import OWNER_UNREACHABLE, REPORT_METHOD
from greenroom.actors.cluster.routing import SessionRequests
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import Approval

__all__ = ["ParentLink"]

_INVALID_PARAMS = -32602


class ParentLink:
    """One host's end of the link: :meth:`send` (the child's side), :meth:`take` (the
    parent's side, with ``approve`` deciding the calls of a follow-up task it starts)."""

    __slots__ = ("_approve", "_host", "_requests", "_timeout_s")

    def __init__(
        self, requests: SessionRequests, host: Host, approve: Approval, *, timeout_s: float = 5.0
    ) -> None:
        self._requests = requests
        self._host = host
        self._approve = approve
        self._timeout_s = timeout_s

    async def send(self, parent_id: str, child_id: str, text: str) -> bool:
        """Hand ``child_id``'s answer to the host that owns ``parent_id``: True once that
        host took it (or refused it for good: logged), False while no host owns it."""
        message = {
            "method": REPORT_METHOD,
            "params": {"child_id": child_id, "text": text},
            "principal": "",
        }
        try:
            reply = await self._requests.request(parent_id, message, timeout_s=self._timeout_s)
        except ClusterError:
            return False
        error = reply.get("error")
        if isinstance(error, dict):
            if error.get("code") == OWNER_UNREACHABLE:
                return False
            _log(
                f"session {parent_id} refused the answer of its subagent {child_id}: "
                f"{error.get('message')}"
            )
        return True

    async def take(self, session_id: str, params: dict[str, Any]) -> dict[str, Any]:
        """The owner's side of :meth:`send`: ``session_id`` takes the answer as input."""
        child_id, text = params.get("child_id"), params.get("text")
        if not isinstance(child_id, str) or not isinstance(text, str):
            return {
                "error": {"code": _INVALID_PARAMS, "message": "a report needs child_id and text"}
            }
        try:
            await self._host.child_reports.take(session_id, child_id, text, self._approve)
        except SessionNotFound as exc:
            return {"error": {"code": _INVALID_PARAMS, "message": str(exc)}}
        return {"result": {}}


def _log(message: str) -> None:
    # The node's log line format, without importing the node (which imports this module).
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)
