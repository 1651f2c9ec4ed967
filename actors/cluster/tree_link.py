"""A tree across hosts (R-TREE-4): a background subagent's answer for a parent that another
host owns. The child's host sends it on the parent's request subject
(:data:`~.router.REPORT_METHOD`); the parent's owner takes it as input of the parent
(:meth:`~greenroom.actors.runtime.child_reports.ChildReports.take`).

A parent that no host owns because it was closed (its directory entry says ``closed``: its
user closed it while the child, taken up elsewhere, worked on) is opened by the child's
host for the answer, as a call on a closed session opens it where the call arrives, and
as one host loads a closed parent for a taken-up child's report. Before, the report was
offered to no owner again and again, then given up.

An owner that refuses the answer for now — its host closes (the parent runs again where
the orphan scan takes it), or the parent's work is ending — answers as a host that owns
the parent no more (:data:`~.routing.OWNER_UNREACHABLE`, nothing done), and the answer is
offered again (:meth:`~greenroom.actors.runtime.child_reports.ChildReports.deliver`), to
the parent's next owner. Before, that refusal was logged and the answer lost. A refusal
for good (the parent deleted, a malformed report) is logged."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.registry import SessionDirectory
from greenroom.actors.cluster.router import OWNER_UNREACHABLE, REPORT_METHOD
from greenroom.actors.cluster.routing import NOT_DONE, SessionRequests, unreachable
from greenroom.actors.runtime.errors import HostClosed, SessionClosed, SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import Approval

__all__ = ["ParentLink", "reopen_if_closed"]

_INVALID_PARAMS = -32602


class ParentLink:
    """One host's end of the link: :meth:`send` (the child's side), :meth:`take` (the
    parent's side, with ``approve`` deciding the calls of a follow-up task it starts).
    ``reopen(session_id)`` opens a closed session here (True once it runs here; False when
    it is not closed)."""

    __slots__ = ("_approve", "_host", "_reopen", "_requests", "_timeout_s")

    def __init__(
        self,
        requests: SessionRequests,
        host: Host,
        approve: Approval,
        *,
        timeout_s: float = 5.0,
        reopen: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self._requests = requests
        self._host = host
        self._approve = approve
        self._timeout_s = timeout_s
        self._reopen = reopen

    async def send(self, parent_id: str, child_id: str, text: str) -> bool:
        """Hand ``child_id``'s answer to the host that owns ``parent_id``, or, when it is
        closed, to ``parent_id`` opened here: True once a host took it (or refused it for
        good: logged), False while no host owns it or its owner refuses it for now (see
        the module docstring)."""
        message = {
            "method": REPORT_METHOD,
            "params": {"child_id": child_id, "text": text},
            "principal": "",
        }
        try:
            reply = await self._requests.request(parent_id, message, timeout_s=self._timeout_s)
        except ClusterError:
            return await self._to_reopened(parent_id, child_id, text)
        error = reply.get("error")
        if isinstance(error, dict):
            if error.get("code") == OWNER_UNREACHABLE:
                return await self._to_reopened(parent_id, child_id, text)
            _log(
                f"session {parent_id} refused the answer of its subagent {child_id}: "
                f"{error.get('message')}"
            )
        return True

    async def _to_reopened(self, parent_id: str, child_id: str, text: str) -> bool:
        if self._reopen is None or not await self._reopen(parent_id):
            return False
        try:
            await self._host.child_reports.take(parent_id, child_id, text, self._approve)
        except (HostClosed, SessionClosed):
            return False  # it runs again, reopened or taken over: offered again then
        except SessionNotFound as exc:  # deleted meanwhile: refused for good, as its owner's
            _log(f"session {parent_id} refused the answer of its subagent {child_id}: {exc}")
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
        except (HostClosed, SessionClosed) as exc:
            # The parent runs again, where it is taken over or here: offered again then.
            return unreachable(
                f"session {session_id} takes no report now ({exc}): nothing was done, "
                "try again shortly",
                NOT_DONE,
            )
        except SessionNotFound as exc:
            return {"error": {"code": _INVALID_PARAMS, "message": str(exc)}}
        return {"result": {}}


async def reopen_if_closed(
    directory: SessionDirectory,
    take_entry: Callable[[str, dict[str, Any]], Awaitable[bool]],
    session_id: str,
) -> bool:
    """Open ``session_id`` here with ``take_entry`` (a takeover from its directory entry)
    when its entry says it is closed; False when it is not, or cannot be read."""
    try:
        entry = await directory.get(session_id)
    except ClusterError:
        return False
    if entry is None or not entry.get("closed"):
        return False
    return await take_entry(session_id, entry)


def _log(message: str) -> None:
    # The node's log line format, without importing the node (which imports this module).
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)
