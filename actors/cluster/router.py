"""Any host's gateway serves any session (R-CLUSTER-1): the gateway's :class:`Router` in a
cluster, and the owner's side of the requests it forwards.

::

    client ── gateway of host B ── ClusterRouter ──► request subject of the session ──┐
                 │                                                                     │
                 └── RemoteSubscription ◄── the session's trace subject (JetStream)    │
                                                                                       ▼
                            host A (the owner) ── OwnerDesk ── A's gateway methods ────┘

* A call on a session this host does not run (``run``, ``steer``, ``follow_up``, ``approve``,
  ``interrupt``, ``compact``, ``skip_reconnect_wait``, ``retry_auth``) is checked against the
  principals the session directory records (and this gateway's own grants) — for a
  subagent, those of its tree's root too, as on one host (R-TREE-1) — then sent to the
  owner, which runs it through its own gateway method code as the same principal (and
  checks it so again: :meth:`ClusterRouter.holds`); its result or JSON-RPC error is the
  client's answer, unchanged. No answer in time, or an owner that gave the session up
  while it answered: a ``503`` error saying so, whose ``data.outcome`` says whether the
  call may have been carried out (a ``run`` that may have started is never reported as
  one that did not: sending it again could run it twice).
* Such a call on a session closed on its host (its entry says ``closed``: a finished
  subagent, a session its user closed; no host runs it) opens it here first, from its
  trace in JetStream (``reopen``, a takeover), and is answered here, as one host loads a
  closed session for a call on it.
* ``session.subscribe`` replays the session's trace subject after ``after_seq`` and then
  follows it: the same ``output`` notifications as a local subscription, each traced seq
  once. The subscription tells the owner it watches (``watch``, renewed every third of the
  lease TTL, so a new owner after a takeover learns of it and a gateway that died is
  forgotten after a TTL), so the owner asks this client's approvals too; the
  ``approval_request`` arrives through the trace and the ``approve`` is forwarded like any
  call. Live-only outputs (partial text, tool progress) stay on the owner.
* ``session.list`` adds the caller's sessions this host does not hold, from the session
  directory (:mod:`.listing`).
* ``session.create`` is placed on the least loaded host: this host's own load as it is, the
  others' as last announced plus what this gateway placed on them since (ties: this host,
  then the lowest id), among the hosts that announce themselves placeable (ready to answer
  on their subject). On another host it is created there by a request to that host's
  subject, which gives it ``within_s`` to answer and waits a margin longer: a host that
  cannot create it in time undoes what it made and says so, and one that does not answer
  at all leaves the session here (one create, one session). Giving up on that host, the
  gateway withdraws the placement (``session.create.withdrawn``), so a host that made the
  session in time but stalled before its answer arrived deletes it when it wakes. The
  withdrawal is recorded in the cluster first (:mod:`.placements`): a host that takes the
  session up after that host died or stalled past its lease deletes it instead, and one
  that took it up before makes it the client's session. No gateway's ``session.list``
  lists a session of a withdrawn placement meanwhile (:mod:`.listing`).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from greenroom.actors.cluster.errors import (
    CallTooLarge,
    ClusterError,
    ClusterUnavailable,
    OwnerUnreachable,
)
from greenroom.actors.cluster.listing import DirectoryPasses, sessions_elsewhere
from greenroom.actors.cluster.placements import PlacementRecords, placing
from greenroom.actors.cluster.registry import (
    HostRecord,
    HostRegistry,
    SessionDirectory,
    place_elsewhere,
)
from greenroom.actors.cluster.routing import (
    IN_DOUBT,
    NOT_DONE,
    OWNER_UNREACHABLE,
    Answering,
    SessionRequests,
    outcome_of,
    unreachable,
)
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.gateway.access import NotYours
from greenroom.actors.gateway.connection import AnswerLater, Handler
from greenroom.actors.gateway.connection import Connection as GatewayConnection
from greenroom.actors.gateway.hubs import Subscription, output_frame
from greenroom.actors.gateway.methods import ROUTED
from greenroom.actors.runtime.errors import (
    AuthLocked,
    Busy,
    ConfigurationError,
    GreenroomError,
    HostClosed,
    SessionNotFound,
)
from greenroom.actors.runtime.host import Host, stored_root
from greenroom.actors.runtime.receipts import ACCEPT_WAIT_S
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError

if TYPE_CHECKING:
    from greenroom.actors.gateway.server import Gateway

__all__ = [
    "ACCEPTED_METHOD",
    "HAND_OVER_METHOD",
    "OWNER_UNREACHABLE",
    "REPORT_METHOD",
    "RUNNING_METHOD",
    "TREE_END_METHOD",
    "WITHDRAWN_METHOD",
    "ClusterRouter",
    "OwnerDesk",
    "RemoteSubscription",
]

HAND_OVER_METHOD = "session.take"
"""The request a draining host sends the host it hands a session to (R-DRAIN-2): params
``{"session_id"}``; the reply's ``taken`` says whether that host took it over."""

WITHDRAWN_METHOD = "session.create.withdrawn"
"""The request a gateway sends the host it placed a ``session.create`` on once it gave up
waiting for its answer: params ``{"placement"}``, the id the create carried. That host
makes no session for it, or deletes the one it made (the gateway made the client's own)."""

REPORT_METHOD = "subagent.finished"
"""The request a host sends a parent's owner with a background subagent's answer:
params ``{"child_id", "text"}`` (R-TREE-4)."""

RUNNING_METHOD = "subagent.running"
"""The request a host sends the owner of a subagent's nearest ancestor that runs elsewhere
once the subagent runs on it: params ``{"child_id", "origin", "after_seq"}``; that owner
relays the subagent's records after ``after_seq`` from its trace to the ancestor's
watchers (R-TREE-1, :mod:`.remote_children`)."""

TREE_END_METHOD = "tree.end"
"""The request a host sends the owner of a node below a session it interrupts with scope
``tree``: params ``{"reason"}``. That owner ends the node as the interrupt would have
ended it open there (:meth:`~greenroom.actors.runtime.child_reports.ChildReports.
end_here`) and answers ``{"interrupted"}`` once its end is written (R-TREE-2,
:mod:`.tree_reach`)."""

MAX_REASON_CHARS = 1000
"""The longest reason a :data:`TREE_END_METHOD` request carries into a trace."""

ACCEPTED_METHOD = "run.accepted"
"""The second request of a forwarded ``run``: params ``{"token"}`` from the first one's
reply; answered as ``run`` is, once the prompt is durable. The first request (``run``
with ``"answer": "begun"``) is answered as soon as the owner has started the task, so the
forwarding connection goes on with its next call (whose effects then follow the run's)."""

FORWARDED = ROUTED - {"session.subscribe", "session.unsubscribe"}
"""The calls a gateway forwards to a session's owner."""

COMPACT_TIMEOUT_S = 300.0
"""How long a forwarded ``compact`` may take (it waits for a model request)."""

PLACE_MARGIN_S = 1.0
"""How much longer a gateway waits for the answer of a ``session.create`` it placed on
another host than that host may take (the ``within_s`` it is given): the time the answer
takes to arrive. A placed host past its ``within_s`` undoes the session it made, so a
gateway that gives up and creates the session itself never leaves a second one there."""

_PLACEMENTS_KEPT = 1024
"""How many placed creates a host remembers for a withdrawal: far more than can be under
way between a create and its withdrawal, which follows it within a few seconds."""

_UNWATCH_S = 2.0


def log(message: str) -> None:
    """One line on stderr (the serve process's log)."""
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)


class _Forwarded:
    """The caller of a request forwarded from another host's gateway: only a principal
    (the forwarding gateway authenticated it)."""

    forwarded = True

    def __init__(self, principal: str) -> None:
        self.identity: str | None = principal
        self.initialized = True
        self.calls = 0
        self.subscriptions: dict[str, Subscription] = {}


def _as_caller(principal: str) -> GatewayConnection:
    # A forwarded call runs the gateway's handlers, which read only the caller's identity.
    return cast(GatewayConnection, _Forwarded(principal))


def _is_forwarded(connection: GatewayConnection) -> bool:
    return getattr(connection, "forwarded", False) is True


async def _reply(call: Awaitable[Any], *, later: list[AnswerLater] | None = None) -> dict[str, Any]:
    """A handler's result or error as a reply object (the errors a gateway connection
    would answer, with the same codes). A result that answers later is awaited, unless
    ``later`` is given and it says what it has begun: then that is the result, and the
    :class:`AnswerLater` is put in ``later``."""
    error: RpcError
    try:
        result = await call
        if isinstance(result, AnswerLater):
            if later is not None and result.begun is not None:
                later.append(result)
                return {"result": result.begun}
            result = await result.wait()
    except RpcError as exc:
        error = exc
    except (Busy, AuthLocked, SessionNotFound) as exc:
        error = RpcError(exc.code, str(exc))
    except ConfigurationError as exc:
        error = RpcError(jsonrpc.INVALID_PARAMS, str(exc))
    except GreenroomError as exc:
        error = RpcError(getattr(exc, "code", jsonrpc.INTERNAL_ERROR), str(exc))
    else:
        return {"result": result}
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.data is not None:
        body["data"] = error.data
    return {"error": body}


def _raise_reply(reply: dict[str, Any]) -> Any:
    """The result of a reply object, or its error (with its ``data``) raised as the
    client's answer."""
    if "result" in reply:
        return reply["result"]
    error = reply.get("error")
    if isinstance(error, dict) and isinstance(error.get("code"), int):
        raise RpcError(error["code"], str(error.get("message", "")), error.get("data"))
    raise RpcError(jsonrpc.INTERNAL_ERROR, "the owner sent an unreadable reply")


def _outcome(error: RpcError) -> str | None:
    """An :data:`OWNER_UNREACHABLE` error's ``data.outcome``, None for any other error."""
    if error.code != OWNER_UNREACHABLE:
        return None
    return outcome_of({"error": {"data": error.data}})


class OwnerDesk:
    """The owner's side: answers the requests other gateways forward, through this host's
    gateway methods, and counts the subscriptions other gateways hold (``watch``) so that
    client approvals are asked when a client watches through another host."""

    def __init__(
        self,
        gateway: Gateway,
        serves: Callable[[str], bool],
        until_serving: Callable[[str], Awaitable[None]],
        *,
        bound_s: float,
        reports: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]] | None = None,
        takes: Callable[[str, list[str]], Awaitable[bool]] | None = None,
        running: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self._methods = gateway.methods
        self._gateway = gateway
        self._accepting: dict[str, _Accepting] = {}
        """Token → a forwarded run whose sender will ask when its prompt is durable."""
        self._reports = reports
        self._takes = takes
        self._running = running
        self._serves = serves
        self._until_serving = until_serving
        self._bound_s = bound_s
        self._watchers: dict[str, dict[str, float]] = {}
        """Session id → watch id → when that watch expires unless renewed."""
        self._placements = _Placements()

    def watched(self, session_id: str) -> bool:
        """Whether a client of another host's gateway subscribes to ``session_id``."""
        watches = self._watchers.get(session_id)
        if not watches:
            return False
        now = trio.current_time()
        for watch_id, expires in list(watches.items()):
            if expires <= now:
                del watches[watch_id]
        if not watches:
            del self._watchers[session_id]
        return bool(watches)

    def for_session(
        self, session_id: str
    ) -> Callable[[dict[str, Any], Answering], Awaitable[dict[str, Any]]]:
        """The handler of ``session_id``'s request subject. What it reports on its
        :class:`Answering`, for a request cut short by this host giving the session up: a
        call is in doubt once its gateway method has been called, except ``run``, whose
        task starts in the very step its method returns (``rpc_run`` starts it and returns
        with no checkpoint between), so a ``run`` cut short has not started; a ``run``
        whose method returned is answered with what it began, even as the host stops."""

        async def handle(
            message: dict[str, Any], answering: Answering | None = None
        ) -> dict[str, Any]:
            answering = answering or Answering()
            answering.in_doubt = False
            method = message.get("method")
            params = message.get("params")
            principal = message.get("principal")
            if not isinstance(params, dict) or not isinstance(principal, str):
                return _error(
                    jsonrpc.INVALID_REQUEST, "a forwarded call needs params and a principal"
                )
            if method == REPORT_METHOD:
                # Between hosts only (a gateway forwards none but FORWARDED): a background
                # subagent's answer for this session, its parent (R-TREE-4).
                if self._reports is None or not self._serves(session_id):
                    return _error(OWNER_UNREACHABLE, f"session {session_id} takes no reports here")
                answering.in_doubt = True
                return await self._reports(session_id, params)
            if method == RUNNING_METHOD:
                # Between hosts only: a subagent of this session runs on the sender.
                if self._running is None or not self._serves(session_id):
                    return _error(OWNER_UNREACHABLE, f"session {session_id} relays nothing here")
                return self._running(session_id, params)
            if method == TREE_END_METHOD:
                # Between hosts only: a tree interrupt made on another host reaches this
                # session, a node of the tree.
                if not self._serves(session_id):
                    return _error(OWNER_UNREACHABLE, f"session {session_id} is not open here")
                answering.in_doubt = True
                return await _end_node(self._gateway.host, session_id, params)
            if method == "watch":
                watch_id = str(params.get("watch_id", ""))[:100]
                watches = self._watchers.setdefault(session_id, {})
                if params.get("watching") is True:
                    watches[watch_id] = trio.current_time() + self._bound_s
                else:
                    watches.pop(watch_id, None)
                if not watches:
                    del self._watchers[session_id]
                return {"result": {}}
            if method == ACCEPTED_METHOD:
                answering.in_doubt = True  # its run has begun here
                return await self._accepted(params.get("token"))
            if method not in FORWARDED:
                return _error(jsonrpc.METHOD_NOT_FOUND, f"method not found: {method!r}")
            if not self._serves(session_id):
                # Lost between the request and now: the sender tries again later.
                return unreachable(
                    f"session {session_id} is moving to another host: nothing was done, "
                    "try again shortly",
                    NOT_DONE,
                )
            params = {**params, "session_id": session_id}
            # Cut short before its method is called (the handler's first checkpoint), a
            # call has done nothing.
            await trio.lowlevel.checkpoint_if_cancelled()
            call = self._methods[str(method)](_as_caller(principal), params)
            if method != "run" or message.get("answer") != "begun":
                answering.in_doubt = True
                return await _reply(call)
            later: list[AnswerLater] = []
            reply = await _reply(call, later=later)
            if later:
                reply["accepted"] = self._settle(later[0])
            return reply

        return handle

    def _settle(self, later: AnswerLater) -> str:
        """Await ``later`` apart; the token under which its reply is asked for."""
        token = uuid.uuid4().hex
        accepting = self._accepting[token] = _Accepting()

        async def settle() -> None:
            try:
                accepting.reply = await _reply(later.wait())
            except Exception as exc:  # a task of the host's: it must not end the host
                accepting.reply = _error(jsonrpc.INTERNAL_ERROR, f"internal error: {exc!r}")
            accepting.done.set()
            # Kept while the sender may still ask (a forwarded call's bound), no longer.
            with accepting.linger:
                await trio.sleep(self._bound_s)
            self._accepting.pop(token, None)

        self._gateway.host.start_task(settle)
        return token

    async def _accepted(self, token: object) -> dict[str, Any]:
        accepting = self._accepting.pop(token, None) if isinstance(token, str) else None
        if accepting is None:
            return unreachable(
                "the session changed hosts while its run was being accepted: its trace "
                "says whether the run was taken up",
                IN_DOUBT,
            )
        await accepting.done.wait()
        accepting.linger.cancel()
        return accepting.reply

    async def for_host(
        self, message: dict[str, Any], answering: Answering | None = None
    ) -> dict[str, Any]:
        """The handler of this host's own subject: a ``session.create`` placed here, or
        a session another host hands over as it drains (``session.take``, R-DRAIN-2), or
        the withdrawal of a placed create whose gateway gave up (:data:`WITHDRAWN_METHOD`).

        A placed create is answered with the new session's id only within its
        ``within_s`` (at most the lease TTL), once the session's calls reach this host;
        the gateway that placed it waits :data:`PLACE_MARGIN_S` longer, then creates the
        session itself. So a session made too late is undone here (deleted: it leaves the
        cluster) and the answer says nothing was kept: one create never leaves two
        sessions. An answer made in time can still arrive late (this host stalled): the
        gateway then withdraws the placement, and the session is deleted here too.
        Cut short (this host stopping) while it creates, it is in doubt."""
        answering = answering or Answering()
        answering.in_doubt = False
        params = message.get("params")
        principal = message.get("principal")
        if message.get("method") == HAND_OVER_METHOD and isinstance(params, dict):
            session_id, with_ids = params.get("session_id"), params.get("with", [])
            if self._takes is None or not isinstance(session_id, str):
                return _error(jsonrpc.INVALID_REQUEST, "session.take needs a session_id")
            # The sessions of its tree handed with it, taken up together (R-TREE-2).
            if not (isinstance(with_ids, list) and all(isinstance(i, str) for i in with_ids)):
                return _error(jsonrpc.INVALID_REQUEST, "session.take's with is a list of ids")
            answering.in_doubt = True
            return {"result": {"taken": await self._takes(session_id, with_ids)}}
        if message.get("method") == WITHDRAWN_METHOD and isinstance(params, dict):
            placement = params.get("placement")
            if not isinstance(placement, str):
                return _error(jsonrpc.INVALID_REQUEST, f"{WITHDRAWN_METHOD} needs a placement")
            made = self._placements.withdraw(placement)
            if made is not None:
                await self._undo(made)
            return {"result": {"withdrawn": True}}
        if message.get("method") != "session.create":
            return _error(jsonrpc.METHOD_NOT_FOUND, f"method not found: {message.get('method')!r}")
        if not isinstance(params, dict) or not isinstance(principal, str):
            return _error(jsonrpc.INVALID_REQUEST, "a forwarded call needs params and a principal")
        placement = message.get("placement")
        if not isinstance(placement, str):
            placement = None  # a gateway that never withdraws
        if placement is not None and not self._placements.begin(placement):
            return unreachable(
                "the gateway that placed the session here gave up waiting and created it "
                "itself; nothing was made here",
                NOT_DONE,
            )
        within_s = self._bound_s
        asked = message.get("within_s")
        if isinstance(asked, int | float) and not isinstance(asked, bool) and asked > 0:
            within_s = min(within_s, float(asked))
        deadline = trio.current_time() + within_s
        await trio.lowlevel.checkpoint_if_cancelled()
        answering.in_doubt = True
        # The session's directory entry names its placement from the first: a host that
        # takes it up after this one dies learns whether its gateway withdrew it.
        with placing(placement) if placement is not None else contextlib.nullcontext():
            reply = await _reply(self._methods["session.create"](_as_caller(principal), params))
        result = reply.get("result")
        if not isinstance(result, dict) or not isinstance(result.get("session_id"), str):
            return reply  # refused: nothing made
        session_id = result["session_id"]
        # Answered once the new session's calls reach this host: the creator's next call
        # is not refused for want of an owner.
        if placement is None or self._placements.made(placement, session_id):
            with trio.move_on_at(deadline) as waiting:
                await self._until_serving(session_id)
            if not waiting.cancelled_caught:
                return reply
            # Too late: undone here, unless a withdrawal meanwhile took it to undo.
            if placement is None or self._placements.withdraw(placement) is not None:
                await self._undo(session_id)
        else:
            await self._undo(session_id)  # withdrawn while it was being made
        return unreachable(
            f"the host the session was placed on could not create it within {within_s:g} s; "
            "nothing was kept there",
            NOT_DONE,
        )

    async def _undo(self, session_id: str) -> None:
        """Delete a session this host created for a placed create it gave up on. After its
        adoption (bounded): a deletion while its claim and directory entry are being
        written would leave an entry that an orphan scan takes over."""
        with trio.move_on_after(self._bound_s):
            await self._until_serving(session_id)
        try:
            await self._gateway.host.delete_session(session_id)
        except Exception as exc:
            log(f"cannot undo session {session_id}, created too late for its placement: {exc!r}")


class _Placements:
    """The placed creates a host made or is making, by the id each carried, and the ones
    their gateways withdrew: whichever of a create and its withdrawal comes first, exactly
    one of them undoes the session (the most recent :data:`_PLACEMENTS_KEPT`)."""

    _WITHDRAWN = ""

    def __init__(self) -> None:
        self._states: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        """Placement → the session made for it, None while it is being made, or
        ``_WITHDRAWN``."""

    def begin(self, placement: str) -> bool:
        """Whether a create may make a session for ``placement`` (not withdrawn yet)."""
        if self._states.get(placement, None) == self._WITHDRAWN:
            return False
        self._set(placement, None)
        return True

    def made(self, placement: str, session_id: str) -> bool:
        """Record ``session_id`` as made for ``placement``; False when it was withdrawn
        meanwhile (the caller undoes the session)."""
        if self._states.get(placement) == self._WITHDRAWN:
            return False
        self._set(placement, session_id)
        return True

    def withdraw(self, placement: str) -> str | None:
        """Withdraw ``placement``: the session made for it, which the caller undoes, or
        None (none made yet, or already withdrawn)."""
        made = self._states.get(placement)
        self._set(placement, self._WITHDRAWN)
        return made or None

    def _set(self, placement: str, state: str | None) -> None:
        self._states[placement] = state
        self._states.move_to_end(placement)
        while len(self._states) > _PLACEMENTS_KEPT:
            self._states.popitem(last=False)


class _Accepting:
    """A forwarded run's acceptance, awaited on the owner for its sender."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: dict[str, Any] = {}
        self.linger = trio.CancelScope()


async def _end_node(host: Host, session_id: str, params: dict[str, Any]) -> dict[str, Any]:
    """The owner's side of :data:`TREE_END_METHOD`."""
    reason = params.get("reason")
    if not isinstance(reason, str):
        return _error(jsonrpc.INVALID_PARAMS, f"{TREE_END_METHOD} needs a reason")
    try:
        ended = await host.child_reports.end_here(session_id, reason[:MAX_REASON_CHARS])
    except (SessionNotFound, HostClosed) as exc:
        return _error(OWNER_UNREACHABLE, f"session {session_id} is not open here: {exc}")
    return {"result": {"interrupted": ended}}


def _error(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class RemoteSubscription(Subscription):
    """A connection watching a session another host runs, through the session's trace
    subject: the replay is queued before the subscribe answer, the records that follow
    after it. Closing it (unsubscribe, the connection gone) stops its follower task."""

    def __init__(self, connection: GatewayConnection, session_id: str, after_seq: int) -> None:
        # Not a hub's subscription: only the connection's bookkeeping is shared.
        self.connection = connection
        self.session_id = session_id
        self.last_seq = after_seq
        self.closed = False
        self.scope = trio.CancelScope()
        self.live = trio.Event()
        self.watch_id = uuid.uuid4().hex

    def take_place(self) -> None:
        """Become the connection's subscription to the session, ending the one before (if
        any). Not done when made: a subscribe refused after reading the trace leaves the
        connection's subscription as it was."""
        old = self.connection.subscriptions.get(self.session_id)
        if old is not self:
            if old is not None:
                old.close()
            self.connection.subscriptions[self.session_id] = self

    def deliver(self, frames: list[tuple[int | None, str]]) -> None:
        """Unused: the follower task queues the frames itself."""

    def go_live(self, last_replayed: int) -> None:
        """The subscribe answer is queued: the follower may queue what follows."""
        self.live.set()

    def drop(self, reason: str) -> None:
        """End the subscription and tell the client why and where to resume."""
        if self.closed:
            return
        self.close()
        notice = {"session_id": self.session_id, "reason": reason, "last_seq": self.last_seq}
        self.connection.outbox.put_nowait(
            jsonrpc.encode(jsonrpc.notification_frame("subscription_dropped", notice))
        )

    def close(self) -> None:
        """End the subscription quietly."""
        self.closed = True
        self.scope.cancel()
        if self.connection.subscriptions.get(self.session_id) is self:
            del self.connection.subscriptions[self.session_id]


class ClusterRouter:
    """The gateway's :class:`~greenroom.actors.gateway.methods.Router` on one host of a
    cluster. ``serves`` says which sessions this host runs; ``nursery`` holds the followers
    of remote subscriptions; ``timeout_s`` bounds a forwarded call; a watch is renewed
    every third of ``watch_ttl_s`` (the owner's expiry of one); ``reopen(session_id,
    entry)`` opens a closed session here (True once it runs here)."""

    def __init__(
        self,
        *,
        host_id: str,
        gateway: Gateway,
        requests: SessionRequests,
        directory: SessionDirectory,
        registry: HostRegistry,
        traces: TraceStream,
        serves: Callable[[str], bool],
        own_load: Callable[[], int],
        nursery: trio.Nursery,
        timeout_s: float,
        watch_ttl_s: float,
        reopen: Callable[[str, dict[str, Any]], Awaitable[bool]] | None = None,
        placements: PlacementRecords | None = None,
    ) -> None:
        self._host_id = host_id
        self._placements = placements
        self._withdrawn: collections.OrderedDict[str, None] = collections.OrderedDict()
        """The placements this gateway withdrew lately (listed by no ``session.list``)."""
        self._reopen = reopen
        self._gateway = gateway
        self._requests = requests
        self._directory = directory
        self._passes = DirectoryPasses(directory)
        self._registry = registry
        self._traces = traces
        self._serves = serves
        self._own_load = own_load
        self._placed: dict[str, tuple[float, int]] = {}
        self._nursery = nursery
        self._timeout_s = timeout_s
        self._watch_ttl_s = watch_ttl_s

    def serves(self, session_id: str) -> bool:
        """Whether this host runs ``session_id``."""
        return self._serves(session_id)

    def largest_input(self) -> int:
        """The most bytes of input the cluster's trace carries in one record."""
        return self._traces.largest_input()

    async def handle(
        self,
        connection: GatewayConnection,
        method: str,
        params: dict[str, Any],
        local: Handler,
    ) -> Any:
        """Serve ``method`` on a session another host runs (a session the cluster does not
        know is answered by ``local``: 404, as on one host)."""
        if _is_forwarded(connection):
            # Its owner's desk took it: this host runs the session, or releases it and opens
            # it here again (:mod:`.in_flight`). Routed, it came back here (the entry still
            # named this host) or waited for the release to end, and the release's stop then
            # cut it short, in doubt.
            return await local(connection, params)
        session_id = str(params["session_id"])
        principal = connection.identity
        assert principal is not None  # authenticated before any session method
        entry = await self._entry(session_id)
        granted_here = session_id in self._gateway.owned(principal)
        if entry is None and not granted_here:
            return await local(connection, params)
        if not granted_here and not await self._may_use(principal, session_id, entry or {}):
            raise NotYours(session_id)  # as for a session nobody has (R-SEC-4)
        if (
            method in FORWARDED
            and (entry or {}).get("closed")
            and self._reopen is not None
            and await self._reopen(session_id, entry or {})
        ):
            return await local(connection, params)
        if method == "session.subscribe":
            jsonrpc.check_params(params, "session.subscribe")
            after_seq = jsonrpc.optional_int(params, "after_seq", minimum=0) or 0
            return await self._subscribe(connection, principal, session_id, after_seq)
        if method == "session.unsubscribe":
            jsonrpc.check_params(params, "session.unsubscribe")
            subscription = connection.subscriptions.get(session_id)
            if subscription is not None:
                subscription.close()
            return {"unsubscribed": subscription is not None}
        if method == "run":
            return await self._forward_run(session_id, params, principal)
        timeout = max(self._timeout_s, COMPACT_TIMEOUT_S) if method == "compact" else None
        try:
            result = _raise_reply(
                await self._forward(session_id, method, params, principal, timeout)
            )
        except RpcError as exc:
            if not await self._reopened_since(exc, method, session_id):
                raise
            return await local(connection, params)
        if method == "session.fork" and isinstance(result, dict):
            fork_id = result.get("session_id")
            if isinstance(fork_id, str):
                # The fork lives on its source's host (R-FORK-1), the caller's: known here
                # before that host's directory entry is, like a placed session.
                self._gateway.grant(principal, fork_id)
        return result

    async def _reopened_since(self, exc: RpcError, method: str, session_id: str) -> bool:
        """Whether a call no host carried out (``not_done``) finds its session closed since
        its entry was read, and opened here: its owner closed it and released it as the
        call went there (a subagent that just finished), and stopped answering for it."""
        data = exc.data if isinstance(exc.data, dict) else {}
        if exc.code != OWNER_UNREACHABLE or data.get("outcome") != NOT_DONE:
            return False
        entry = await self._entry(session_id)
        return (
            method in FORWARDED
            and bool((entry or {}).get("closed"))
            and self._reopen is not None
            and await self._reopen(session_id, entry or {})
        )

    async def holds(self, principal: str, session_id: str) -> bool:
        """Whether ``principal`` was granted ``session_id``: by this gateway, or by the
        gateway of a host that ran it (the principals of its directory entry). The root of
        a tree authorizes its nodes (R-TREE-1) on whichever hosts they run."""
        if session_id in self._gateway.owned(principal):
            return True
        return principal in ((await self._entry(session_id) or {}).get("principals") or ())

    async def sessions_elsewhere(
        self, principal: str, listed: frozenset[str]
    ) -> tuple[list[dict[str, Any]], frozenset[str], str | None]:
        """The sessions of the cluster ``principal`` may see that ``listed`` (this host's
        listing) does not answer for, with their ``host``; those of ``listed`` to leave
        out (another host's now, or deleted in the cluster); and a note when the directory
        could not be read whole (:mod:`.listing`)."""
        return await sessions_elsewhere(
            self._passes,
            principal,
            self._gateway.owned(principal),
            listed,
            bound_s=self._timeout_s,
            host_id=self._host_id,
            serves=self._serves,
            withdrawn=self._withdrawn,
            placements=self._placements,
        )

    async def _may_use(self, principal: str, session_id: str, entry: dict[str, Any]) -> bool:
        """Whether ``principal`` may use ``session_id`` (not granted here), from its
        directory ``entry``: among its principals, or those of its tree's root."""
        if principal in (entry.get("principals") or ()):
            return True
        meta = entry.get("meta")
        root_id = stored_root(meta if isinstance(meta, dict) else {}, session_id)
        return root_id != session_id and await self.holds(principal, root_id)

    async def _entry(self, session_id: str) -> dict[str, Any] | None:
        try:
            return await self._directory.get(session_id)
        except ValueError:
            return None  # not an id the cluster can hold
        except ClusterUnavailable as exc:
            # Read before anything is sent: the call was not carried out.
            raise RpcError(
                OWNER_UNREACHABLE, f"the cluster cannot be reached: {exc}", {"outcome": NOT_DONE}
            ) from exc

    async def _forward_run(self, session_id: str, params: dict[str, Any], principal: str) -> Any:
        """``run`` on another host's session: answered as soon as the owner has started
        the task, then (:class:`AnswerLater`) once the owner says the prompt is durable.

        A run the owner did not start (it gave the session up first, or no host served
        it) is a 503 whose ``data.outcome`` is ``not_done``: the client may run it again.
        One that may have started is never reported so (R-CLUSTER-2: running it again
        could run the task twice): a 503 with ``data.outcome`` ``unknown`` (and the
        ``run_id`` when the task is known to have begun) whose message says to look at
        the session's trace, where a run taken up by the next owner goes on."""
        try:
            reply = await self._forward(session_id, "run", params, principal, answer="begun")
            token = reply.get("accepted")
            result = _raise_reply(reply)
        except RpcError as exc:
            if _outcome(exc) != IN_DOUBT:
                raise
            raise RpcError(
                OWNER_UNREACHABLE,
                f"the run may have started on session {session_id}: its host stopped "
                f"answering first ({exc.message}). The session's trace (session.subscribe) "
                "shows whether it did; running it again may run it twice",
                {"outcome": IN_DOUBT},
            ) from exc
        if not isinstance(token, str):
            return result  # an owner that answers once the prompt is durable
        run_id = result.get("run_id") if isinstance(result, dict) else None

        async def accepted() -> Any:
            asked = {"token": token}
            bound = ACCEPT_WAIT_S + self._timeout_s
            try:
                return _raise_reply(
                    await self._forward(session_id, ACCEPTED_METHOD, asked, principal, bound)
                )
            except RpcError as exc:
                if exc.code != OWNER_UNREACHABLE:
                    raise
                # The task began: whether its prompt was durable before its host gave the
                # session up (and the next owner took the run up) only the trace says.
                raise RpcError(
                    OWNER_UNREACHABLE,
                    f"run {run_id} began on session {session_id}, whose host gave the session "
                    f"up before its prompt was known to be durable ({exc.message}). The "
                    "session's trace (session.subscribe) shows whether the run was taken up; "
                    "running it again may run it twice",
                    {"outcome": IN_DOUBT, "run_id": run_id},
                ) from exc

        return AnswerLater(accepted, begun=result)

    async def _forward(
        self,
        session_id: str,
        method: str,
        params: dict[str, Any],
        principal: str,
        timeout_s: float | None = None,
        *,
        answer: str | None = None,
    ) -> dict[str, Any]:
        message = {"method": method, "params": params, "principal": principal}
        if answer is not None:
            message["answer"] = answer
        try:
            return await self._requests.request(
                session_id, message, timeout_s=timeout_s or self._timeout_s
            )
        except OwnerUnreachable as exc:
            outcome = IN_DOUBT if exc.in_doubt else NOT_DONE
            raise RpcError(OWNER_UNREACHABLE, str(exc), {"outcome": outcome}) from exc
        except CallTooLarge as exc:
            raise RpcError(
                jsonrpc.INVALID_REQUEST,
                f"session {session_id} runs on another host: {exc}; send less, or send it "
                "through that host's gateway",
                {"outcome": NOT_DONE},
            ) from exc
        except ClusterUnavailable as exc:
            raise RpcError(
                OWNER_UNREACHABLE,
                f"the cluster cannot be reached: {exc}; the call may have been carried out",
                {"outcome": IN_DOUBT},
            ) from exc

    async def place(self, connection: GatewayConnection, params: dict[str, Any]) -> Any | None:
        """Create the session on the least loaded host: None when that is this host (or
        this call was itself placed here); else the answer of the host that created it.
        A host that does not answer in time, or says it kept nothing, leaves the session
        to this host (the placement withdrawn there: a late answer's session is deleted);
        one that stopped while it created it is a 503 in doubt (the session may exist
        there: creating it here too would make two)."""
        if _is_forwarded(connection):
            return None
        principal = connection.identity
        assert principal is not None
        try:
            target = self._least_loaded(await self._registry.hosts())
        except ClusterUnavailable:
            return None
        if target is None:
            return None
        placement = uuid.uuid4().hex
        message = {
            "method": "session.create",
            "params": params,
            "principal": principal,
            "within_s": self._timeout_s,
            "placement": placement,
        }
        try:
            # Longer than the placed host may take: its answer is heard, and one that
            # never comes means the host kept nothing (or is gone with what it made).
            reply = await self._requests.request_host(
                target.host_id, message, timeout_s=self._timeout_s + PLACE_MARGIN_S
            )
        except ClusterError as exc:
            kept = await self._withdraw(target.host_id, placement, principal)
            if kept is None:
                log(f"cannot place a session on host {target.host_id} ({exc}); creating it here")
                return None
            # Made there, then that host died or stalled: another took the session up first.
            log(f"host {target.host_id} made session {kept} and was lost; it is the client's")
            self._gateway.grant(principal, kept)
            return {"session_id": kept}
        outcome = outcome_of(reply)
        if outcome == NOT_DONE:
            log(f"host {target.host_id} did not create a session placed on it; creating it here")
            return None
        if outcome == IN_DOUBT:
            raise RpcError(
                OWNER_UNREACHABLE,
                f"host {target.host_id} stopped while it created the session: it may have "
                "been created there, its id unknown; create another if you need one",
                {"outcome": IN_DOUBT},
            )
        result = _raise_reply(reply)
        self._count_placed(target)
        if isinstance(result, dict) and isinstance(result.get("session_id"), str):
            # Known here before the owner's directory entry is: the next call finds it.
            self._gateway.grant(principal, result["session_id"])
        return result

    async def _withdraw(self, host_id: str, placement: str, principal: str) -> str | None:
        """Withdraw the create ``placement`` given up on at host ``host_id``: recorded in
        the cluster, then told to that host. The session made for it when another host
        took it up first (its host died): then nothing is withdrawn, it is the client's."""
        self._withdrawn[placement] = None
        while len(self._withdrawn) > _PLACEMENTS_KEPT:
            self._withdrawn.popitem(last=False)
        if self._placements is not None:
            try:
                kept = await self._placements.withdraw(placement)
            except ClusterUnavailable as exc:
                log(f"cannot record the withdrawal of a placement on host {host_id}: {exc}")
                kept = None
            if kept is not None:
                self._withdrawn.pop(placement, None)
                return kept
        # Its answer may only be late (the host stalled after it made the session):
        # NATS delivers the withdrawal when it wakes, and the session made there goes.
        self._nursery.start_soon(self._tell_withdrawn, host_id, placement, principal)
        return None

    async def _tell_withdrawn(self, host_id: str, placement: str, principal: str) -> None:
        """Tell host ``host_id`` that the create ``placement`` was given up on: what it
        made for it is deleted. Sent once; a host that does not answer is not waited for
        past a forwarded call's bound (the request reaches it all the same)."""
        message = {
            "method": WITHDRAWN_METHOD,
            "params": {"placement": placement},
            "principal": principal,
        }
        with contextlib.suppress(ClusterError):
            await self._requests.request_host(host_id, message, timeout_s=self._timeout_s)

    def _least_loaded(self, hosts: list[HostRecord]) -> HostRecord | None:
        """The host to place a new session on, None for this one."""
        others = {
            record.host_id: record
            for record in hosts
            if record.host_id != self._host_id and record.placeable
        }
        best = place_elsewhere(
            self._own_load(),
            (
                attrs.evolve(record, load=record.load + self._placed_since(record))
                for record in others.values()
            ),
        )
        return None if best is None else others[best.host_id]

    def _placed_since(self, record: HostRecord) -> int:
        """How many sessions this gateway placed on ``record``'s host since it announced."""
        at, count = self._placed.get(record.host_id, (record.at, 0))
        return count if at == record.at else 0

    def _count_placed(self, record: HostRecord) -> None:
        self._placed[record.host_id] = (record.at, self._placed_since(record) + 1)

    async def _subscribe(
        self, connection: GatewayConnection, principal: str, session_id: str, after_seq: int
    ) -> dict[str, Any]:
        subscription = RemoteSubscription(connection, session_id, after_seq)
        try:
            room = max(1, connection.limits.max_pending_frames // 2)
            replayed = 0
            # A page at a time: a long trace read whole cost each subscriber its size.
            async with self._traces.pages(session_id, after_seq=after_seq) as pages:
                async for page in pages:
                    # A record after ``after_seq``: the resume point is the session's.
                    subscription.take_place()
                    for record in page:
                        await connection.outbox.wait_below(room)
                        connection.outbox.put_nowait(output_frame(record))
                        subscription.last_seq = record.seq or subscription.last_seq
                        replayed += 1
                jsonrpc.check_after_seq(after_seq, pages.last_seq)
            subscription.take_place()
            # Before the answer: a ``run`` the client sends next finds the owner knowing
            # that someone can answer its approvals.
            await self._watch(subscription, principal, watching=True)
        except BaseException:
            subscription.close()
            raise
        last_seq = subscription.last_seq
        self._nursery.start_soon(self._follow, subscription, principal)
        connection.after_answer.append(lambda: subscription.go_live(last_seq))
        return {"session_id": session_id, "replayed": replayed, "last_seq": last_seq}

    async def _watch(
        self, subscription: RemoteSubscription, principal: str, *, watching: bool
    ) -> None:
        """Tell the owner a client watches (or stopped); an owner that does not hear it
        hears the next renewal."""
        session_id = subscription.session_id
        params = {"session_id": session_id, "watching": watching, "watch_id": subscription.watch_id}
        with contextlib.suppress(RpcError):
            await self._forward(session_id, "watch", params, principal)

    async def _renew_watch(self, subscription: RemoteSubscription, principal: str) -> None:
        while True:
            await trio.sleep(self._watch_ttl_s / 3)
            await self._watch(subscription, principal, watching=True)

    async def _follow(self, subscription: RemoteSubscription, principal: str) -> None:
        connection = subscription.connection
        room = max(1, connection.limits.max_pending_frames // 2)
        try:
            with subscription.scope:
                await subscription.live.wait()
                async with (
                    trio.open_nursery() as renewing,
                    self._traces.follow(
                        subscription.session_id, after_seq=subscription.last_seq
                    ) as records,
                ):
                    renewing.start_soon(self._renew_watch, subscription, principal)
                    async for record in records:
                        await connection.outbox.wait_below(room)
                        connection.outbox.put_nowait(output_frame(record))
                        subscription.last_seq = record.seq or subscription.last_seq
                    renewing.cancel_scope.cancel()
                subscription.drop("the cluster connection closed")
        except ClusterUnavailable as exc:
            subscription.drop(f"the cluster cannot be reached: {exc}")
        except Exception as exc:
            # Its task is the host's: a failure here ends this subscription, nothing else.
            log(f"following session {subscription.session_id} failed: {exc!r}")
            subscription.drop("internal error while following the session")
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_UNWATCH_S):
                with contextlib.suppress(Exception):
                    await self._watch(subscription, principal, watching=False)
