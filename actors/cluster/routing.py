"""Requests to a session's owner: one NATS subject per session, answered only by the host
that holds the session's lease (R-CLUSTER-1: any host's gateway serves any session).

The owner runs :meth:`SessionRequests.serve` while it holds the lease; any host
sends with :meth:`SessionRequests.request`. Each host also answers on a subject of its own
(:meth:`SessionRequests.serve_host`, :meth:`SessionRequests.request_host`): a session placed
on it is created there. Both ends speak JSON objects: a request is
``{"method": …, "params": {…}}``, a reply ``{"result": …}`` or ``{"error": {"code", "message"}}``
(the gateway's JSON-RPC error, passed through). When no host answers in time — the owner is
gone and nobody has taken the session over yet — :class:`~.errors.OwnerUnreachable` says so
in words a gateway can hand to its client as a JSON-RPC error.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import trio
from nats.aio.msg import Msg

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable, OwnerUnreachable

__all__ = ["Handler", "SessionRequests"]

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Answers one request object with one reply object."""

_BAD_REQUEST = -32600
_INTERNAL = -32603


class SessionRequests:
    """Per-session request subjects on one connection."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def request(
        self, session_id: str, message: dict[str, Any], *, timeout_s: float = 5.0
    ) -> dict[str, Any]:
        """Send ``message`` to ``session_id``'s owner and return its reply. Raises
        :class:`OwnerUnreachable` when no host answers within ``timeout_s``."""
        subject = self._conn.names.request_subject(session_id)
        try:
            return await self._request(subject, message, timeout_s)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise OwnerUnreachable(session_id, timeout_s) from exc

    async def request_host(
        self, host_id: str, message: dict[str, Any], *, timeout_s: float = 5.0
    ) -> dict[str, Any]:
        """Send ``message`` to host ``host_id`` (:meth:`serve_host`) and return its reply.
        Raises :class:`ClusterUnavailable` when it does not answer within ``timeout_s``."""
        subject = self._conn.names.host_subject(host_id)
        try:
            return await self._request(subject, message, timeout_s)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise ClusterUnavailable(
                f"host {host_id} did not answer within {timeout_s:g} s"
            ) from exc

    async def _request(
        self, subject: str, message: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        payload = json.dumps(message).encode()

        async def ask() -> Msg | nats.errors.Error:
            # Caught here: nats' TimeoutError is an OSError, which ``call`` takes for a
            # lost connection.
            try:
                return await self._conn.client.request(subject, payload, timeout=timeout_s)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                return exc

        reply = await self._conn.call(ask())
        if isinstance(reply, nats.errors.Error):
            raise reply
        try:
            decoded = json.loads(reply.data)
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            return {"error": {"code": _INTERNAL, "message": "the owner sent an unreadable reply"}}
        return decoded

    async def serve(
        self,
        session_id: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer ``session_id``'s requests with ``handler`` until cancelled (each request in
        a task of its own; a handler that raises answers with an internal error, and the
        others go on). Ready once requests sent from then on reach it."""
        subject = self._conn.names.request_subject(session_id)
        await self._serve(subject, f"session {session_id}", handler, task_status)

    async def serve_host(
        self,
        host_id: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Answer the requests sent to host ``host_id`` with ``handler``, until cancelled
        (as :meth:`serve`)."""
        subject = self._conn.names.host_subject(host_id)
        await self._serve(subject, f"host {host_id}", handler, task_status)

    async def _serve(
        self, subject: str, what: str, handler: Handler, task_status: trio.TaskStatus[None]
    ) -> None:
        async def answer(msg: Msg) -> None:
            reply = await _handle(handler, msg.data)
            with contextlib.suppress(ClusterUnavailable, nats.errors.Error):
                await self._conn.call(msg.respond(json.dumps(reply).encode()))

        started = False
        try:
            async with self._conn.subscription(subject) as messages:
                task_status.started()
                started = True
                async with trio.open_nursery() as handlers:
                    async for msg in messages:
                        if msg.reply:
                            handlers.start_soon(answer, msg)
        except ClusterUnavailable as exc:
            if started:
                raise
            raise ClusterUnavailable(f"cannot serve {what}: {exc}") from exc


async def _handle(handler: Handler, data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        return {"error": {"code": _BAD_REQUEST, "message": "a request must be a JSON object"}}
    try:
        return await handler(message)
    except Exception as exc:
        return {"error": {"code": _INTERNAL, "message": f"the owner failed: {exc}"}}
