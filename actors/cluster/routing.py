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

A request is always answered by the host that took it, even when that host stops serving
the subject while it answers (the session handed over, drained, its lease lost or closed;
the host stopping): the handler is cancelled and the sender is told at once, with
:data:`OWNER_UNREACHABLE` and ``data.outcome`` (:data:`NOT_DONE` or :data:`IN_DOUBT`, as
the handler reported its progress through its :class:`Answering`), instead of waiting out
its timeout. A reply made just as the host stops is sent all the same.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import trio
from nats.aio.msg import Msg

from greenroom.actors.cluster.bridge import Inbox
from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import CallTooLarge, ClusterUnavailable, OwnerUnreachable

__all__ = [
    "IN_DOUBT",
    "NOT_DONE",
    "OWNER_UNREACHABLE",
    "Answering",
    "Handler",
    "SessionRequests",
    "answer_payload",
    "forwarded_payload",
    "outcome_of",
    "unreachable",
]

OWNER_UNREACHABLE = 503
"""The JSON-RPC error code of a call that no owner carried out to its end: none answered in
time, or the one that took it gave the session up (or stopped) first."""

NOT_DONE = "not_done"
"""``data.outcome`` of an :data:`OWNER_UNREACHABLE` error: nothing the call asks was done;
sending it again is safe."""

IN_DOUBT = "unknown"
"""``data.outcome`` of an :data:`OWNER_UNREACHABLE` error: the call may have been carried
out, in part or whole; sending it again may do it twice."""

ANSWER_BOUND_S = 2.0
"""How long a host that stops serving a subject tries to send the answers it owes."""

_BAD_REQUEST = -32600
_INTERNAL = -32603


class Answering:
    """What the handler of one request says of its progress, for the answer its sender gets
    if the handler is cancelled before it answers (:data:`OWNER_UNREACHABLE`).
    ``in_doubt`` is True — the default, for a handler that says nothing — while what the
    request asks may have been done; a handler sets it False while nothing has been done
    yet (the sender may then send the request again, to the session's next owner)."""

    __slots__ = ("in_doubt",)

    def __init__(self, *, in_doubt: bool = True) -> None:
        self.in_doubt = in_doubt


Handler = Callable[[dict[str, Any], Answering], Awaitable[dict[str, Any]]]
"""Answers one request object with one reply object, reporting its progress on the
:class:`Answering` in case it is cancelled first."""


def outcome_of(reply: dict[str, Any]) -> str | None:
    """A reply's ``data.outcome`` (:data:`NOT_DONE`, :data:`IN_DOUBT`), None when it has
    none (a result, or an error that says nothing of it)."""
    error = reply.get("error")
    data = error.get("data") if isinstance(error, dict) else None
    outcome = data.get("outcome") if isinstance(data, dict) else None
    return outcome if outcome in (NOT_DONE, IN_DOUBT) else None


def unreachable(message: str, outcome: str, **data: Any) -> dict[str, Any]:
    """An :data:`OWNER_UNREACHABLE` reply object with ``data.outcome`` (and ``data``)."""
    return {
        "error": {
            "code": OWNER_UNREACHABLE,
            "message": message,
            "data": {"outcome": outcome, **data},
        }
    }


def forwarded_payload(message: dict[str, Any]) -> bytes:
    """``message`` as a request to another host carries it: JSON in UTF-8, as the client's
    frame came (ASCII escapes made a call of non-Latin text up to six times its frame's
    size); a lone surrogate (none comes from a client's frame: R-SEC-1) is sent as its
    JSON escape, never an encoding error."""
    return json.dumps(message, ensure_ascii=False).encode("utf-8", "backslashreplace")


def answer_payload(reply: dict[str, Any], most: int) -> bytes:
    """``reply`` as the owner sends it back (:func:`forwarded_payload`), or, when it is
    larger than ``most`` bytes (the NATS server's ``max_payload``), an error saying so: NATS
    refused the answer, and its caller waited out its whole timeout for a "no host
    answered" that was not so."""
    payload = forwarded_payload(reply)
    if len(payload) <= most:
        return payload
    too_large = {
        "error": {
            "code": _INTERNAL,
            "message": f"the call was carried out on the session's host, but its answer "
            f"({len(payload)} bytes) is larger than the NATS server carries between hosts "
            f"({most} bytes, its max_payload); ask through that host's gateway",
        }
    }
    return forwarded_payload(too_large)


class SessionRequests:
    """Per-session request subjects on one connection."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def request(
        self, session_id: str, message: dict[str, Any], *, timeout_s: float = 5.0
    ) -> dict[str, Any]:
        """Send ``message`` to ``session_id``'s owner and return its reply. Raises
        :class:`OwnerUnreachable` when no host answers within ``timeout_s`` (in doubt
        unless no host served the session when it was sent); :class:`CallTooLarge` when
        ``message`` is larger than NATS carries (nothing was sent)."""
        subject = self._conn.names.request_subject(session_id)
        try:
            return await self._request(subject, message, timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise OwnerUnreachable(session_id, timeout_s, in_doubt=False) from exc
        except nats.errors.TimeoutError as exc:
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
        payload = forwarded_payload(message)

        async def ask() -> Msg | nats.errors.Error:
            # Caught here: nats' TimeoutError is an OSError, which ``call`` takes for a
            # lost connection.
            try:
                return await self._conn.client.request(subject, payload, timeout=timeout_s)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                return exc

        try:
            reply = await self._conn.call(ask())
        except nats.errors.MaxPayloadError as exc:
            # Refused by the client before anything was sent: it escaped as an internal
            # error before.
            raise CallTooLarge(len(payload), self._conn.client.max_payload) from exc
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
        others go on; a handler still at work when this is cancelled is cancelled too, and
        its request answered as cut short). Ready once requests sent from then on reach
        it."""
        subject = self._conn.names.request_subject(session_id)
        gone = f"session {session_id} left the host that took this call"
        await self._serve(subject, f"session {session_id}", gone, handler, task_status)

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
        gone = f"host {host_id} stopped"
        await self._serve(subject, f"host {host_id}", gone, handler, task_status)

    async def _serve(
        self,
        subject: str,
        what: str,
        gone: str,
        handler: Handler,
        task_status: trio.TaskStatus[None],
    ) -> None:
        async def answer(msg: Msg) -> None:
            answering = Answering()
            reply: dict[str, Any] | None = None
            try:
                reply = await _handle(handler, msg.data, answering)
            finally:
                # Cancelled (this host stops serving the subject): the sender is told now,
                # not after its whole timeout; and a reply made just before is not lost to
                # the same cancellation (a run whose task has started says so).
                if reply is None:
                    reply = _cut_short(gone, answering)
                with trio.CancelScope(shield=True), trio.move_on_after(ANSWER_BOUND_S):
                    await self._respond(msg, reply)

        started = False
        inbox: Inbox[Msg] | None = None
        # Requests that came while this stopped (the subscription drained, its last
        # messages in the inbox; or, a drain cut short going on in the background, after
        # it: the late reply) were never handled: their senders may send them again at
        # once.
        turned_away = _cut_short(gone, Answering(in_doubt=False))
        late_reply = answer_payload(turned_away, self._conn.client.max_payload)
        try:
            async with self._conn.subscription(subject, late_reply=late_reply) as messages:
                inbox = messages
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
        finally:
            if inbox is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(ANSWER_BOUND_S):
                    async for msg in inbox:
                        if msg.reply:
                            await self._respond(msg, turned_away)

    async def _respond(self, msg: Msg, reply: dict[str, Any]) -> None:
        payload = answer_payload(reply, self._conn.client.max_payload)
        with contextlib.suppress(ClusterUnavailable, nats.errors.Error):
            await self._conn.call(msg.respond(payload))


async def _handle(handler: Handler, data: bytes, answering: Answering) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        return {"error": {"code": _BAD_REQUEST, "message": "a request must be a JSON object"}}
    try:
        return await handler(message, answering)
    except Exception as exc:
        return {"error": {"code": _INTERNAL, "message": f"the owner failed: {exc}"}}


def _cut_short(gone: str, answering: Answering) -> dict[str, Any]:
    """The answer to a request whose handler was cancelled because ``gone`` (the session
    left this host, the host stopped)."""
    if answering.in_doubt:
        return unreachable(
            f"{gone} while the call was being carried out: it may have been done; "
            "look before sending it again",
            IN_DOUBT,
        )
    return unreachable(
        f"{gone} before the call was carried out: nothing was done, try again shortly",
        NOT_DONE,
    )
