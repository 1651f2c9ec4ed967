"""The JSON-RPC methods of the gateway, one handler each.

The dispatch table is driven by :data:`greenroom.protocols.jsonrpc.METHODS`, the one table of
the methods, their parameters and results: each method ``name`` is handled by
``Methods.rpc_<name>`` (dots as underscores), and a method of the table without a handler
fails when the gateway is built. Handlers check their params against the table
(``check_params``) and answer errors by raising :class:`RpcError` or a
:class:`GreenroomError` (the connection turns them into error responses).

Ownership (R-SEC-4): a principal sees only the sessions it created or was granted; another
principal's session answers 403, an unknown one 404. The creator is stored with the session
(:func:`~greenroom.actors.gateway.access.store_owner`), so ownership outlives the gateway.

People (R-HITL): under ``approve="ask"`` tasks run with ``approve="people"``: each request
waits in the session's trace, ``approvals.list`` lists those of the caller's sessions
(whether or not their task is in memory), and ``approve`` / ``answer`` go to the host
(``answer_approval`` / ``answer_question``) as the caller's principal — to be loaded, when
the host began to close the session once the call found the request, with the server's
tools and model, not the host's own; an answer for a call that waits for none is 409.
Workspaces (R-SEC-5): a client's ``session.create {workspace}`` must resolve under the
workspace root. Caps (R-SEC-9): a principal's open sessions (``session.create`` answers
429 beyond them) and, for a connection that authenticates with ``initialize``, its
connections; a remote address
that sent too many wrong tokens is refused (429) before its token is looked at.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol, cast

import attrs
import trio

from greenroom.actors.gateway.access import (
    Admission,
    Grants,
    NotYours,
    Principals,
    no_such_session,
)
from greenroom.actors.gateway.config import (
    CLIENT_ID,
    CLIENT_SETTABLE_FORBIDDEN,
    PATH,
    GatewayLimits,
    SessionDefaults,
)
from greenroom.actors.gateway.connection import AnswerLater, Connection, Handler
from greenroom.actors.gateway.creation import SessionCreation
from greenroom.actors.gateway.hubs import Hubs, session_state
from greenroom.actors.gateway.nodes import Nodes
from greenroom.actors.gateway.queue_room import (
    NOT_HANDED_OVER,
    QueuedKind,
    QueueRoom,
    closed_answer,
    dropped_answer,
    in_doubt_answer,
)
from greenroom.actors.gateway.time_travel import TimeTravelMethods
from greenroom.actors.gateway.titles import Titles
from greenroom.actors.runtime.errors import ImageRefused, SessionClosed, SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import Approval
from greenroom.actors.runtime.receipts import InputReceipt, once_durable, queued_once_recorded
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.storage import SessionStore
from greenroom.actors.tools.mcp_commands import AttachmentError, attach_to_input
from greenroom.protocols import jsonrpc
from greenroom.protocols.content import UserContent
from greenroom.protocols.converter import to_dict
from greenroom.protocols.jsonrpc import RpcError, invalid
from greenroom.protocols.messages import InterruptScope
from greenroom.protocols.people import PendingApproval, Verdict
from greenroom.protocols.trace import UsageLine, UsageQuery, input_size

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 100_000
"""The longest text ``answer`` takes (it becomes a tool result, R-HITL-5)."""

ROUTED = frozenset(
    {
        "session.subscribe",
        "session.unsubscribe",
        "session.fork",
        "session.rewind",
        "run",
        "steer",
        "follow_up",
        "approvals.list",
        "approve",
        "answer",
        "interrupt",
        "compact",
        "skip_reconnect_wait",
        "retry_auth",
    }
)
"""The methods on one session that a :class:`Router` may serve for a session another host
runs."""


class Router(Protocol):
    """Where the gateway's calls go for sessions this host does not run (cluster mode; None
    in single-host mode, where every session is this host's)."""

    def serves(self, session_id: str) -> bool:
        """Whether this host runs ``session_id`` (its calls are handled here as usual)."""
        ...

    def largest_input(self) -> int:
        """The most bytes a call's input (its blocks and output schema, as its trace
        record holds them) may take: the cluster's trace carries no larger record."""
        ...

    async def handle(
        self, connection: Connection, method: str, params: dict[str, Any], local: Handler
    ) -> Any:
        """Answer ``method`` on a session this host does not run (``local``: the gateway's
        own handler, for a session the router does not know either)."""
        ...

    async def place(self, connection: Connection, params: dict[str, Any]) -> Any | None:
        """The answer of a ``session.create`` placed on another host, or None to create the
        session here."""
        ...

    async def holds(self, principal: str, session_id: str) -> bool:
        """Whether ``principal`` was granted ``session_id`` here or on another host (the
        root of a tree whose node runs here may run on another host)."""
        ...

    async def sessions_elsewhere(
        self, principal: str, listed: frozenset[str]
    ) -> tuple[list[dict[str, Any]], frozenset[str], str | None]:
        """``session.list``'s entries of the sessions ``principal`` may see on other hosts,
        each with its ``host``; the sessions of ``listed`` (this host's listing) whose copy
        here is stale, to leave out of it (listed among the others when another host has
        them, not at all when deleted in the cluster); and a note for the answer's
        ``cluster`` when they could not all be read (else None)."""
        ...


DETACHED = frozenset({"compact"})
"""Methods a connection runs in their own task when called alone: ``compact`` waits for a
model request, and the connection keeps reading meanwhile."""


async def once_recorded(recorded: InputReceipt) -> dict[str, Any]:
    """The answer of ``steer``, ``follow_up`` and an A2A message that steers
    (:func:`~greenroom.actors.runtime.receipts.queued_once_recorded`): ``{queued: true}``
    once the input's record survives this host; error 410 when it was dropped unrun (its
    session closed first); error 503 (``data.outcome`` ``unknown``) when nobody knows
    whether the record survived (:func:`in_doubt_answer`)."""
    return await queued_once_recorded(recorded, dropped=dropped_answer, in_doubt=in_doubt_answer)


class Methods:
    """The handlers of the gateway's methods, over the host's sessions.

    Holds no channel and starts no task: each handler runs in the task of the connection
    that called it (a detached one in the connection's nursery). ``creation.workspace_root``
    is set by the gateway when it starts, before any call.
    """

    def __init__(
        self,
        host: Host,
        *,
        defaults: SessionDefaults,
        approval_timeout_s: float | None,
        principals: Principals,
        grants: Grants,
        hubs: Hubs,
        titles: Titles,
        limits: GatewayLimits | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.host = host
        self.defaults = defaults
        self.approval_timeout_s = approval_timeout_s
        self._principals = principals
        self._grants = grants
        self._nodes = Nodes(host, grants)
        self._hubs = hubs
        self._titles = titles
        self._limits = limits or GatewayLimits()
        self._admission = admission or Admission(self._limits)
        self.queue_room = QueueRoom(self._limits.max_queued_inputs)
        """The places left for the steering and follow-ups clients queue (R-SEC-9)."""
        self.creation = SessionCreation(
            host,
            defaults=defaults,
            approval_timeout_s=approval_timeout_s,
            grants=grants,
            hubs=hubs,
            limits=self._limits,
        )
        """Creates the sessions clients ask for (``session.create``, the HTTP endpoints)."""
        self.router: Router | None = None
        """Serves the sessions of other hosts (cluster mode)."""
        self._time_travel = TimeTravelMethods(
            host, defaults, self._owned_session, self.creation.reserve, self.creation.take_new
        )

    def table(self) -> dict[str, Handler]:
        """The dispatch table, in the order of ``jsonrpc.METHODS``."""
        owners = (self, self._time_travel)
        table = {name: _handler(owners, name) for name in jsonrpc.METHODS}
        for name in ROUTED & table.keys():
            table[name] = self._routed(name, table[name])
        return table

    def _routed(self, method: str, local: Handler) -> Handler:
        async def handler(connection: Connection, params: dict[str, Any]) -> Any:
            router = self.router
            session_id = params.get("session_id") if isinstance(params, dict) else None
            if router is None or not isinstance(session_id, str) or router.serves(session_id):
                return await local(connection, params)
            return await router.handle(connection, method, params, local)

        return handler

    # -- sessions and ownership ------------------------------------------------------------------

    async def _owned_session(
        self, connection: Connection, params: Mapping[str, Any], *, node: bool = True
    ) -> Session:
        session_id = jsonrpc.require_str(params, "session_id", max_len=200)
        return await self.owned_session(_identity(connection), session_id, node=node)

    async def owned_session(self, principal: str, session_id: str, *, node: bool = True) -> Session:
        """The session ``session_id``, when ``principal`` may use it: one it created or was
        granted, or (``node``) a subagent at any depth of such a tree (R-TREE-1: the root
        authorizes its nodes). A session that is not open (a finished subagent, a root the
        host closed) is loaded. 403 for another principal's (:class:`NotYours`), 404 for an
        unknown one; -32602 for a subagent where ``node``
        is false (the call starts work: it goes to the root). Its hub is running when it
        returns."""
        if not self._grants.holds(principal, session_id):
            root_id = await self._nodes.root_of(session_id)
            if (
                root_id is None
                or root_id == session_id
                or not await self._holds(principal, root_id)
            ):
                if root_id is not None or await self._nodes.exists(session_id):
                    raise NotYours(session_id)
                raise no_such_session(session_id)
            if not node:
                raise invalid(
                    "$.session_id",
                    f"{session_id!r} is a subagent of the tree of {root_id!r}: call this "
                    "method on the root (a node takes session.subscribe, steer, interrupt, "
                    "approve, answer)",
                )
        try:
            session = self.host.get_session(session_id)
        except SessionNotFound:
            # Closed by the host since (or granted from the data dir), or a finished
            # subagent: load it again.
            session = await self.host.load_session(session_id, **self.defaults.loading(principal))
        await self._hubs.adopt(session)
        return session

    async def _holds(self, principal: str, session_id: str) -> bool:
        """Whether ``principal`` created or was granted ``session_id``: at this gateway or,
        in a cluster, at the gateway of a host that ran it (``Router.holds``)."""
        if self._grants.holds(principal, session_id):
            return True
        return self.router is not None and await self.router.holds(principal, session_id)

    def approver(self) -> Approval:
        """How the tasks clients start decide their calls (the server's ``--approve``)."""
        return self.defaults.task_approval()

    async def _input(self, session: Session, params: Mapping[str, Any]) -> tuple[UserContent, ...]:
        """The call's ``input`` with its attachments: its images (R-SEC-8), read once, now,
        off the event loop, from inside the workspace or scratchpad only; then each
        ``@server:uri`` of a text, a resource of one of this session's own MCP servers
        (R-MCP-5), read through that server. One that cannot be read is -32602 naming the
        block and why, and nothing of the call is done."""
        if "input" not in params:
            raise invalid("$.input", "required")
        blocks = jsonrpc.parse_input(params["input"])
        try:
            attached = await session.attach(blocks, confine=True)
        except ImageRefused as exc:
            raise invalid(f"$.input[{exc.index}].path", f"{exc.path!r}: {exc.reason}") from None
        try:
            content = tuple(await attach_to_input(attached, session.tools))
        except AttachmentError as exc:
            where = "$.input" if isinstance(params["input"], str) else f"$.input[{exc.index}].text"
            raise invalid(where, str(exc)) from None
        if self.router is not None:
            _check_recordable(content, params.get("output_schema"), self.router.largest_input())
        return content

    # -- methods ----------------------------------------------------------------------------------

    async def rpc_initialize(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Authenticate the connection (R-SEC-4): its first call, exactly once. The principal is
        the token's (which must agree with the handshake's, if any); a ``client_id`` must name
        that principal. Answers 401 for a bad or missing token, 403 for another client id."""
        jsonrpc.check_params(params, "initialize")
        if connection.initialized or connection.calls:
            raise RpcError(jsonrpc.INVALID_REQUEST, "initialize must be the first call, once")
        token = jsonrpc.optional_str(params, "token", max_len=1000)
        client_id = jsonrpc.optional_str(params, "client_id", max_len=64)
        if client_id is not None and not CLIENT_ID.fullmatch(client_id):
            raise invalid("$.client_id", "letters, digits and ._:@- only, at most 64")
        address = connection.address
        now = trio.current_time()
        principal = connection.identity
        if token is not None:
            wait = None if address is None else self._admission.throttled(address, now)
            if wait is not None:
                # Refused before the token is looked at, as at the handshake.
                reason = "too many failed authentication attempts from this address"
                connection.close_with = (1008, reason)
                raise RpcError(jsonrpc.TOO_MANY_REQUESTS, f"{reason}; retry in {math.ceil(wait)} s")
            principal = self._principals.of(token.encode("utf-8"))
            if principal is None and address is not None:
                self._admission.failed(address, now)
            if connection.identity is not None and principal != connection.identity:
                principal = None  # the handshake's token said otherwise
        if principal is None:
            connection.failed_auth()
            raise RpcError(jsonrpc.UNAUTHORIZED, "unauthorized: bad or missing token")
        claimed = client_id or connection.claimed
        if claimed is not None and claimed != principal:
            connection.failed_auth()
            raise RpcError(
                jsonrpc.FORBIDDEN,
                f"forbidden: client_id {claimed!r} is not this token's principal",
            )
        if connection.counted is None:
            if not self._admission.admit(principal):
                cap = self._limits.max_connections_per_principal
                reason = f"too many connections for client {principal!r} (at most {cap})"
                connection.close_with = (1008, reason)
                raise RpcError(jsonrpc.TOO_MANY_REQUESTS, reason)
            connection.counted = principal
        connection.initialized = True
        connection.identity = principal
        connection.authenticated.set()
        return {"client_id": principal, "server": "greenroom", "path": PATH}

    async def rpc_session_create(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Create a session for the caller, who owns it: the server's defaults, then the client's
        settings (none of ``CLIENT_SETTABLE_FORBIDDEN``); a ``workspace`` must resolve under
        the workspace root (R-SEC-5). Returns ``{session_id}``."""
        jsonrpc.check_params(params, "session.create")
        if self.router is not None:
            placed = await self.router.place(connection, params)
            if placed is not None:
                return placed
        workspace_param = jsonrpc.optional_str(params, "workspace", max_len=4096)
        model = jsonrpc.optional_str(params, "model", max_len=200)
        raw_settings = jsonrpc.optional_object(params, "settings")
        client_settings = (
            jsonrpc.parse_settings(raw_settings, forbidden=CLIENT_SETTABLE_FORBIDDEN)
            if raw_settings is not None
            else {}
        )
        session = await self.create_session_for(
            _identity(connection), workspace=workspace_param, model=model, settings=client_settings
        )
        return {"session_id": session.id}

    async def create_session_for(
        self,
        principal: str,
        *,
        workspace: str | None = None,
        model: str | None = None,
        settings: Mapping[str, Any] | None = None,
        session_id: str | None = None,
    ) -> Session:
        """Create a session owned by ``principal`` (:meth:`SessionCreation.create_for`)."""
        return await self.creation.create_for(
            principal, workspace=workspace, model=model, settings=settings, session_id=session_id
        )

    async def settled(self, session: Session) -> Session:
        """``session``, once a task that has emitted its ``task_end`` has finished syncing
        its trace (:meth:`Hubs.settled`)."""
        return await self._hubs.settled(session)

    async def rpc_session_list(self, connection: Connection, params: dict[str, Any]) -> Any:
        """The caller's stored sessions with their live state (open, busy, auth lock, title, last
        activity) and ``usage`` (``tokens`` and ``cost_usd`` of its requests), and the subagents of
        their trees (``parent_id``, ``root_id``: R-TREE-1); those that cannot be read are
        listed apart, by id with the reason. In a cluster, those of other hosts too, and the
        cluster's view of copies here it supersedes (``Router.sessions_elsewhere``)."""
        jsonrpc.check_params(params, "session.list")
        principal = _identity(connection)
        owned = self._grants.owned(principal)
        listing: dict[str, Any] = {"sessions": []}
        if owned:
            listing = await _stored_listing(self.host, self._hubs, self._titles, owned)
        if self.router is None:
            return listing
        listed = frozenset(
            s["session_id"] for s in [*listing["sessions"], *listing.get("unreadable", ())]
        )
        return _with_cluster(listing, *await self.router.sessions_elsewhere(principal, listed))

    async def rpc_session_subscribe(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Subscribe the connection to a session it owns: the traced outputs after ``after_seq``
        (at most the session's last seq) are replayed, then live ones follow. Returns
        ``{session_id, replayed, last_seq}``."""
        jsonrpc.check_params(params, "session.subscribe")
        session = await self._owned_session(connection, params)
        after_seq = jsonrpc.optional_int(params, "after_seq", minimum=0) or 0
        jsonrpc.check_after_seq(after_seq, session.host.port(session.id).last_seq)
        replayed, last_seq = await self._hubs.subscribe(connection, session, after_seq)
        return {"session_id": session.id, "replayed": replayed, "last_seq": last_seq}

    async def rpc_session_unsubscribe(self, connection: Connection, params: dict[str, Any]) -> Any:
        """End the connection's subscription to a session; ``unsubscribed`` is False when there
        was none."""
        jsonrpc.check_params(params, "session.unsubscribe")
        session = await self._owned_session(connection, params)
        subscription = connection.subscriptions.get(session.id)
        if subscription is not None:
            subscription.close()
        return {"unsubscribed": subscription is not None}

    async def rpc_run(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Start a task on the session; its outputs reach the client through its subscription.
        Answers ``{run_id}`` once the task's prompt is durable (the run then happens even
        if this host dies: another takes it up), without holding up the connection's
        later calls meanwhile; a busy (409) or auth-locked (423) session refuses."""
        jsonrpc.check_params(params, "run")
        output = jsonrpc.optional_output_schema(params)
        session = await self._hubs.settled(
            await self._owned_session(connection, params, node=False)
        )
        content = await self._input(session, params)
        stream = session.run(content, approve=self.approver(), output_schema=output)

        async def once_accepted() -> dict[str, Any]:
            # Answered once the prompt is durable: from then on the run is not lost with
            # this host (R-CLUSTER-2); a disk that hangs holds the answer only so long.
            try:
                return await once_durable(stream.accepted, {"run_id": stream.run_id})
            finally:
                # Clients read the outputs through their subscriptions; and one that went
                # away meanwhile leaves none piling up here for the run's whole life.
                stream.detach()

        # The task has started: the connection's next call (a steer, say) finds it so,
        # and waits for no disk. No checkpoint between ``session.run`` and here: a call
        # cancelled before it returns has not started its task (a forwarded run cut short
        # is answered so, and may be sent again: cluster ``OwnerDesk``).
        return AnswerLater(once_accepted, begun={"run_id": stream.run_id})

    async def rpc_steer(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Steer the running task with ``input`` (R-STEER-1); ``queued`` is False when idle.
        ``queued: true`` is answered once the steering's record survives this host (see
        :func:`once_recorded`), without holding up the connection's later calls."""
        jsonrpc.check_params(params, "steer")
        session = await self._hubs.settled(await self._owned_session(connection, params))

        def steer(content: tuple[UserContent, ...], recorded: InputReceipt) -> bool:
            return session.steer(content, recorded=recorded)

        return await self._queue(session, params, "steering", steer)

    async def rpc_follow_up(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Queue ``input`` as a task to run after the current one (R-STEER-6); ``queued`` is
        False when idle (then call ``run``). Answered as ``steer`` is."""
        jsonrpc.check_params(params, "follow_up")
        output = jsonrpc.optional_output_schema(params)
        session = await self._hubs.settled(
            await self._owned_session(connection, params, node=False)
        )
        approve = self.approver()

        def follow_up(content: tuple[UserContent, ...], recorded: InputReceipt) -> bool:
            return session.follow_up(
                content, approve=approve, output_schema=output, recorded=recorded
            )

        return await self._queue(session, params, "follow-ups", follow_up)

    async def _queue(
        self,
        session: Session,
        params: Mapping[str, Any],
        kind: QueuedKind,
        hand: Callable[[tuple[UserContent, ...], InputReceipt], bool],
    ) -> Any:
        """``steer`` and ``follow_up`` after their checks: a place in ``session``'s queue of
        ``kind`` (429 when full), then the call's input read and ``hand``-ed to the session
        with its receipt; ``queued: false`` when the session takes none (idle), else
        answered once the input's record survives this host."""
        # Before the input is read: a full queue costs no attachment read.
        recorded = self.queue_room.reserve(session, kind)
        queued = False
        try:
            queued = hand(await self._input(session, params), recorded)
        except SessionClosed:  # its close began while its input was read
            raise closed_answer(session.id, kind) from None
        finally:
            if not queued:
                recorded.drop(NOT_HANDED_OVER)  # its place is free again
        if not queued:
            return {"queued": False}
        return AnswerLater(partial(once_recorded, recorded))

    async def rpc_approvals_list(self, connection: Connection, params: dict[str, Any]) -> Any:
        """The requests waiting for a person (approvals and questions) in the caller's
        sessions — or in ``session_id`` and its subagents — open or stored (R-HITL-2)."""
        jsonrpc.check_params(params, "approvals.list")
        # Read from the traces, nothing loaded: a listing is cheap, and loads no session
        # (another principal's among them) with the host's tools and model (R-HITL-2).
        if params.get("session_id") is not None:
            session = await self._owned_session(connection, params)
            pending = await self.host.pending_approvals(read_only=True)
            listed = [p for p in pending if session.id in p.origin or p.session_id == session.id]
        else:
            owned = self._grants.owned(_identity(connection))
            pending = await self.host.pending_approvals(read_only=True) if owned else []
            listed = [p for p in pending if _root(p) in owned]
        return {"approvals": [_listed(p) for p in listed]}

    async def rpc_approve(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Answer the pending approval request ``call_id`` with ``decision``, as the caller's
        principal, whether or not its task is in memory (R-HITL-2); a request of a
        subagent is answered through its root's id too. 409 when the call waits for no
        decision or its arguments are not those of ``digest``."""
        jsonrpc.check_params(params, "approve")
        session = await self._owned_session(connection, params)
        call_id = jsonrpc.require_str(params, "call_id", max_len=500)
        decision = cast(
            Verdict, jsonrpc.require_choice(params, "decision", ("allow", "deny", "allow_session"))
        )
        digest = jsonrpc.optional_str(params, "digest", max_len=200)
        principal = _identity(connection)
        asked_in = await self._nodes.asked_in(session, call_id)
        await self.host.answer_approval(
            asked_in,
            call_id,
            decision,
            by=principal,
            digest=digest,
            **loading_unless_open(self.host, self.defaults, asked_in, principal),
        )
        return {}

    async def rpc_answer(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Answer the model's question ``call_id`` (``ask_user``, R-HITL-5) with ``text``, as
        the caller's principal; 409 when the call waits for no answer."""
        jsonrpc.check_params(params, "answer")
        session = await self._owned_session(connection, params)
        call_id = jsonrpc.require_str(params, "call_id", max_len=500)
        text = jsonrpc.require_str(params, "text", max_len=MAX_ANSWER_CHARS)
        principal = _identity(connection)
        asked_in = await self._nodes.asked_in(session, call_id)
        await self.host.answer_question(
            asked_in,
            call_id,
            text,
            by=principal,
            **loading_unless_open(self.host, self.defaults, asked_in, principal),
        )
        return {}

    async def rpc_interrupt(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Interrupt the session's running task; ``interrupted`` is False when it was idle.
        ``scope`` (R-TREE-2): ``tree`` (the default) ends the whole subtree (answered once
        ends out of this host are written); ``node``, the task and foreground children."""
        jsonrpc.check_params(params, "interrupt")
        scope: InterruptScope = "tree"
        if params.get("scope") is not None:
            scope = cast(InterruptScope, jsonrpc.require_choice(params, "scope", ("tree", "node")))
        session = await self._owned_session(connection, params)
        interrupted = session.interrupt("interrupted by client", scope=scope)
        reached = scope == "tree" and await self.host.child_reports.reached(session.id)
        return {"interrupted": interrupted or reached}

    async def rpc_compact(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Compact the session's context now (R-COMPACT-10) and wait for it: the
        ``compaction_end`` output as a dict, None when there is nothing to compact; 409
        while busy."""
        jsonrpc.check_params(params, "compact")
        session = await self._hubs.settled(
            await self._owned_session(connection, params, node=False)
        )
        end = await session.compact()
        return None if end is None else to_dict(end)

    async def rpc_skip_reconnect_wait(self, connection: Connection, params: dict[str, Any]) -> Any:
        """End the session's current reconnect wait (R-RETRY-5); ``skipped`` is False when idle."""
        jsonrpc.check_params(params, "skip_reconnect_wait")
        session = await self._owned_session(connection, params)
        return {"skipped": session.skip_reconnect_wait()}

    async def rpc_retry_auth(self, connection: Connection, params: dict[str, Any]) -> Any:
        """Unlock a session locked by an auth failure (R-RETRY-6)."""
        jsonrpc.check_params(params, "retry_auth")
        session = await self._owned_session(connection, params)
        session.retry_auth()
        return {}


def _check_recordable(content: tuple[UserContent, ...], output_schema: object, most: int) -> None:
    """Refuse input whose trace record the cluster cannot carry (``most`` bytes of input
    and output schema, as the record holds them): recorded, it stopped its session on its
    host after the call was answered as accepted (R-SEC-9, R-CLUSTER-2); refused here,
    nothing of the call is done."""
    size = input_size(content, output_schema)
    if size > most:
        raise invalid(
            "$.input",
            f"too large: its trace record would hold {size} bytes of input, more than the "
            f"cluster's NATS server carries in one message ({most} bytes with its "
            "max_payload); nothing was done, send less",
        )


def loading_unless_open(
    host: Host, defaults: SessionDefaults, session_id: str, principal: str
) -> dict[str, Any]:
    """How the host is to load ``session_id`` for an answer: as any call on a closed
    session loads it (the server's tools and model) when the host lists it no more — its
    close began since the request was found, or is done — and the host alone would load it
    with its own (R-HITL-1); nothing while it is open (it keeps its own, and no provider
    is made for nothing). The caller hands them to the host with no checkpoint between."""
    try:
        host.get_session(session_id)
    except SessionNotFound:
        return defaults.loading(principal)
    return {}


def _identity(connection: Connection) -> str:
    assert connection.identity is not None  # checked before any method but initialize
    return connection.identity


def _handler(owners: tuple[object, ...], method: str) -> Handler:
    """The handler of ``method``: ``rpc_<name>`` (dots as underscores) of the first of
    ``owners`` that has one (a method without one fails when the gateway is built)."""
    name = "rpc_" + method.replace(".", "_")
    owner = next((o for o in owners if hasattr(o, name)), owners[0])
    return cast(Handler, getattr(owner, name))


def _root(request: PendingApproval) -> str:
    """The session a request's tree hangs from: the one clients own."""
    return request.origin[0] if request.origin else request.session_id


def _listed(request: PendingApproval) -> dict[str, Any]:
    """One entry of ``approvals.list``."""
    return {
        "session_id": request.session_id,
        "call_id": request.call_id,
        "tool": request.tool,
        "arguments": request.arguments,
        "asked_at": request.asked_at,
        "origin": list(request.origin),
        "kind": request.kind,
        "digest": request.digest,
    }


async def _stored_listing(
    host: Host, hubs: Hubs, titles: Titles, owned: frozenset[str]
) -> dict[str, Any]:
    """``session.list``'s answer from this host's data dir: the sessions of ``owned``
    and of their trees, and those of them that cannot be read."""
    open_sessions = {s.id: s for s in host.sessions}
    scan = await host.scan_sessions()
    named = await titles.of(
        (i.session_id for i in scan.sessions if i.session_id in owned),
        SessionStore(host.data_dir).sessions_dir,
    )
    usage = {line.key: line for line in await host.usage_ledger.report(UsageQuery(by="session"))}
    sessions: list[dict[str, Any]] = []
    for info in scan.sessions:
        # A subagent is listed with its tree (R-TREE-1): the caller owns its root.
        if info.session_id not in owned and info.root_id not in owned:
            continue
        session = open_sessions.get(info.session_id)
        hub = hubs.get(info.session_id)
        sessions.append(
            {
                **attrs.asdict(info),
                "open": session is not None,
                "busy": session is not None and session.busy,
                "auth_locked": session is not None and session.auth_locked is not None,
                "title": named.get(info.session_id, ""),
                "last_activity_at": max(
                    info.updated_at, hub.last_output_at if hub is not None else 0.0
                ),
                "state": session_state(session, hub),
                "usage": _usage_entry(usage.get(info.session_id)),
            }
        )
    # The reason names a path of the server's data dir: the session id is enough.
    unreadable = [
        {"session_id": bad.session_id, "reason": bad.reason.removeprefix(f"{bad.path}: ")}
        for bad in scan.unreadable
        if bad.session_id in owned
    ]
    if unreadable:
        return {"sessions": sessions, "unreadable": unreadable}
    return {"sessions": sessions}


def _with_cluster(
    listing: dict[str, Any],
    elsewhere: list[dict[str, Any]],
    stale: frozenset[str],
    note: str | None,
) -> dict[str, Any]:
    """``session.list``'s answer from this host's ``listing``: without the copies the
    cluster's view supersedes (``stale``), with the sessions listed from the directory
    (``elsewhere``) after it, and ``cluster`` saying why some may be missing (``note``)."""
    answer = {"sessions": [s for s in listing["sessions"] if s["session_id"] not in stale]}
    unreadable = [s for s in listing.get("unreadable", ()) if s["session_id"] not in stale]
    if unreadable:
        answer["unreadable"] = unreadable
    answer["sessions"] += elsewhere
    return answer if note is None else {**answer, "cluster": note}


def _usage_entry(line: UsageLine | None) -> dict[str, Any]:
    """A session's ``usage`` in ``session.list``: the tokens and cost of its own requests
    so far; ``cost_usd`` is null when a price was unknown (R-SHARE-3)."""
    if line is None:
        return {"tokens": 0, "cost_usd": 0.0}
    return {"tokens": line.total, "cost_usd": None if line.unpriced else line.cost_usd}
