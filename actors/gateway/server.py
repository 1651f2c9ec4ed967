"""The gateway's server: the listener, admission and the handshake, up to the point where
a :class:`Connection` takes over; and ``greenroom serve`` (:func:`run_serve`).

::

    Gateway.run                     until cancelled
    ├── titles                      the titler's nursery (:class:`Titles`)
    └── the listener (trio-websocket)
        └── one handler per connection: handshake, then :meth:`Connection.run`

Admission (R-SEC-4): a handshake whose ``Host`` header names neither ``localhost``, the
listen host, an IP address nor a name given with ``allowed_hosts`` is refused with HTTP 421
before anything else (a DNS rebinding page: :class:`~greenroom.actors.gateway.access.HostNames`);
a browser handshake (one with an ``Origin`` header) whose origin is
not allowed (the console's, or one given with ``allowed_origins`` /
:meth:`Gateway.allow_origin`) is refused with HTTP 403; beyond ``max_connections`` open
connections the handshake is refused with HTTP 503, and beyond its principal's
``max_connections_per_principal`` with HTTP 429 (R-SEC-9: one principal cannot take every
place); a remote address that sent ``max_auth_failures_per_address`` wrong tokens within
``auth_failure_window_s`` is refused with HTTP 429 and ``Retry-After`` before its token
is looked at (:class:`~greenroom.actors.gateway.access.Admission`); and the listener
stops accepting sockets at ``max_connections + HANDSHAKE_SLACK``, so a flood of half-open
connections waits in the kernel's backlog instead of taking the file descriptors sessions
need for their traces. ``greenroom serve`` raises the process's soft ``RLIMIT_NOFILE`` to
its hard limit and keeps ``FD_RESERVE`` descriptors out of the cap (:func:`connection_cap`).

A wrong ``Authorization: Bearer`` token is refused with HTTP 401 before the upgrade; an
``X-Greenroom-Client`` header may only repeat the token's principal (403). A connection
without a token on its handshake authenticates with ``initialize`` within
``auth_timeout_s``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, cast

import trio
from trio_websocket import (
    ConnectionClosed,
    Endpoint,
    WebSocketConnection,
    WebSocketRequest,
    WebSocketServer,
)

from greenroom.actors.gateway.access import (
    Admission,
    ClaimRefused,
    Grants,
    HostNames,
    Principals,
    Seats,
    address_key,
    check_claim,
    claimed_client,
    normal_host_name,
    stored_owners,
)
from greenroom.actors.gateway.config import (
    AUTH_TIMEOUT_S,
    CLIENT_HEADER,
    DEFAULT_MAX_CONNECTIONS,
    FD_RESERVE,
    HANDSHAKE_SLACK,
    PATH,
    GatewayLimits,
    SessionDefaults,
    approve_for,
    check_data_dir_private,
    connection_cap,
    load_or_create_token,
    load_tokens_file,
    normal_origin,
    raise_fd_limit,
    resolved,
    token_file_path,
)
from greenroom.actors.gateway.connection import (
    SHUTTING_DOWN,
    Connection,
    Handler,
    OpenConnections,
)
from greenroom.actors.gateway.console import ConsoleServer, display_host, url_host
from greenroom.actors.gateway.http_front import HttpFront, Route
from greenroom.actors.gateway.hubs import Hubs
from greenroom.actors.gateway.listeners import open_listeners
from greenroom.actors.gateway.methods import DETACHED, Methods, Router
from greenroom.actors.gateway.sockets import CappedListener, CountedStream, HandedOverListener
from greenroom.actors.gateway.titles import Titles
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.actors.runtime.admission import ProviderLimits
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.host import Host, SessionObserver, default_data_dir
from greenroom.actors.runtime.storage import SessionStore

logger = logging.getLogger(__name__)


class Gateway:
    """The websocket JSON-RPC server of one :class:`Host`.

    Start it with ``port = await nursery.start(gateway.run)``; cancel the nursery to stop.
    ``port=0`` binds a free port (reported by ``start`` and kept in :attr:`port`).
    With ``titles``, a session whose first task through the gateway has ended is named once
    by :meth:`Session.generate_title` (R-HOST-5, in the background: it never holds up a
    task); the title is kept in ``title.txt`` in the session's directory and listed by
    ``session.list``.

    Principals: ``token`` is the one token of the principal ``default``; ``tokens`` maps
    client ids to their tokens (give one or both). A session's creator is stored with it,
    and a gateway that starts grants every stored session to its creator again.
    ``allowed_origins``: browser origins (``http://host:port``) allowed besides the ones
    added with :meth:`allow_origin`. ``allowed_hosts``: host names the gateway answers to
    besides ``localhost``, the listen host and IP addresses (:class:`HostNames`; also
    :meth:`allow_host`): a request whose ``Host`` header names another is refused with
    HTTP 421 before anything else (R-SEC-4, DNS rebinding).
    ``auth_timeout_s``: how long a connection may stay unauthenticated.
    ``a2a``, ``ag_ui``: serve the A2A endpoints (``/.well-known/agent-card.json``, ``/a2a``)
    and the AG-UI endpoint (``/ag-ui``) on the same port, with the same tokens and caps
    (:mod:`~greenroom.actors.gateway.http_front`); ConfigurationError when their extra
    (``greenroom[a2a]``, ``greenroom[ag-ui]``) is not installed.
    ``approval_timeout_s``: the ``approval_timeout_s`` setting of the sessions it creates
    (None: a request waits for a person without limit, R-HITL-1; a client's settings may
    say otherwise).

    Channels: none of its own. Each connection's frames go through its outbox
    (:class:`Connection`); the sessions' outputs reach the outboxes through the hubs
    (:class:`Hubs`), which never block.
    """

    def __init__(
        self,
        host: Host,
        *,
        token: str | None = None,
        tokens: Mapping[str, str] | None = None,
        listen_host: str = "127.0.0.1",
        port: int = 8765,
        defaults: SessionDefaults | None = None,
        approval_timeout_s: float | None = None,
        limits: GatewayLimits | None = None,
        titles: bool = False,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
        auth_timeout_s: float = AUTH_TIMEOUT_S,
        reuse_port: bool = False,
        a2a: bool = False,
        ag_ui: bool = False,
    ) -> None:
        self._principals = Principals(token=token, tokens=tokens)
        self.reuse_port = reuse_port
        """Share the port with other processes (``serve --workers``: ``SO_REUSEPORT``)."""
        if max_connections < 1:
            raise ConfigurationError("max_connections must be at least 1")
        self.host = host
        self.listen_host = listen_host
        self.port = port
        self.defaults = defaults or SessionDefaults()
        self.approval_timeout_s = approval_timeout_s
        self.limits = limits or GatewayLimits()
        self.max_connections = max_connections
        self.auth_timeout_s = auth_timeout_s
        self.titles = titles
        self._origins = {normal_origin(origin) for origin in allowed_origins}
        self.host_names = HostNames(listen_host, allowed_hosts)
        """The names requests may give in their ``Host`` header (the console's too)."""
        self._console_ports: list[int] = []
        """The ports of the consoles served with the gateway (:meth:`allow_console`)."""
        self._seats = Seats(max_connections)
        self._grants = Grants()
        self._admission = Admission(self.limits)
        self._titles = Titles(enabled=titles)
        self._hubs = Hubs(on_task_end=self._titles.title_once, limits=self.limits)
        self.connections = OpenConnections()
        """The websocket connections the gateway serves (in its latest run)."""
        self._one_run = trio.Lock()
        self._calls = Methods(
            host,
            defaults=self.defaults,
            approval_timeout_s=approval_timeout_s,
            principals=self._principals,
            grants=self._grants,
            hubs=self._hubs,
            titles=self._titles,
            limits=self.limits,
            admission=self._admission,
        )
        self._methods = self._calls.table()
        self._front = self._http_front(a2a=a2a, ag_ui=ag_ui)

    def _http_front(self, *, a2a: bool, ag_ui: bool) -> HttpFront | None:
        """The HTTP side of the port, when an endpoint is served (else None: the websocket
        server listens alone, as it always did)."""
        routes: dict[str, Route] = {}
        if a2a:
            try:
                from greenroom.actors.gateway.a2a import A2A_PATH, CARD_PATH, A2aEndpoint
            except ImportError as exc:
                raise ConfigurationError(
                    f"--a2a needs the a2a extra: pip install 'greenroom[a2a]' ({exc})"
                ) from None
            agent = A2aEndpoint(self._calls, listen_url=lambda: self.http_url, version=_version())
            routes[CARD_PATH] = Route(endpoint=agent, methods=frozenset({"GET"}))
            routes[A2A_PATH] = Route(endpoint=agent, methods=frozenset({"POST"}))
        if ag_ui:
            try:
                from greenroom.actors.gateway.ag_ui import AG_UI_PATH, AgUiEndpoint
            except ImportError as exc:
                raise ConfigurationError(
                    f"--ag-ui needs the ag-ui extra: pip install 'greenroom[ag-ui]' ({exc})"
                ) from None
            page = AgUiEndpoint(self._calls)
            body = page.body_limit(self.limits.max_frame_bytes)  # room for an image
            routes[AG_UI_PATH] = Route(endpoint=page, methods=frozenset({"POST"}), body=body)
        if not routes:
            return None
        return HttpFront(
            routes,
            principals=self._principals,
            admission=self._admission,
            seats=self._seats,
            origin_allowed=self._origin_allowed,
            limits=self.limits,
            host_names=self.host_names,
        )

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT``: where the HTTP endpoints are (the websocket's port; a
        wildcard bind is reached through loopback)."""
        return f"http://{url_host(display_host(self.listen_host))}:{self.port}"

    # -- public ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; reports the bound port when it accepts
        connections. Cancelling closes every connection (1001, with a reason); sessions
        keep running in the host. The gateway may be run again once stopped; a run
        started while the last one still closes its connections waits for it to end."""
        # The runs share the hubs and titles, which an ending run clears: one started
        # beside it would lose them and answer every subscribe "the gateway has stopped".
        async with self._one_run:
            await self._serve(task_status)

    async def _serve(self, task_status: trio.TaskStatus[int]) -> None:
        defaults = self.defaults
        root = defaults.workspace_root or defaults.workspace_dir
        self._calls.creation.workspace_root = await trio.to_thread.run_sync(resolved, root)
        await trio.to_thread.run_sync(
            check_data_dir_private, self.host.data_dir, root, defaults.workspace_dir
        )
        sessions_dir = SessionStore(self.host.data_dir).sessions_dir
        for session_id, owner in (
            await trio.to_thread.run_sync(stored_owners, sessions_dir)
        ).items():
            self._grants.grant(owner, session_id)
        listeners = await open_listeners(self.port, self.listen_host, reuse_port=self.reuse_port)
        sockets = trio.CapacityLimiter(self.max_connections + HANDSHAKE_SLACK)
        capped = [CappedListener(listener, sockets) for listener in listeners]
        limits = self.limits
        front = self._front
        # With HTTP endpoints the front accepts every connection and hands the websocket
        # ones over; size 0: each waits for trio-websocket's accept loop, always there.
        handoff, handed = trio.open_memory_channel[CountedStream](0)
        websocket_listeners = capped if front is None else [HandedOverListener(handed)]
        connections = self.connections = OpenConnections()
        # What serves the connections is shielded from the gateway's cancellation: a stop
        # stops accepting, then closes each connection with its client's close handshake,
        # which needs the connection's reader (cancelled with the rest, the reader was
        # gone and every close waited its whole timeout), then ends what is left.
        serving = trio.CancelScope(shield=True)
        accepting = trio.CancelScope()

        async def serve(*, task_status: trio.TaskStatus[None]) -> None:
            with serving:
                async with trio.open_nursery() as handlers:
                    await handlers.start(self._titles.run)
                    # Before the listener: a session is adopted only by a hub that is
                    # running. When the gateway stops, its hubs end and release what
                    # they hold.
                    await handlers.start(self._hubs.run)
                    handlers.start_soon(self._cut_off_stuck_clients, connections)
                    await handlers.start(accept, handlers)
                    task_status.started()

        async def accept(handlers: trio.Nursery, *, task_status: trio.TaskStatus[None]) -> None:
            server = WebSocketServer(
                functools.partial(self._handle, connections),
                cast(list[trio.SocketListener], websocket_listeners),  # any trio Listener
                handler_nursery=handlers,
                max_message_size=limits.max_message_bytes,
                connect_timeout=limits.handshake_timeout_s,
                disconnect_timeout=limits.close_timeout_s,
            )
            with accepting:
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.run)
                    if front is not None:
                        listening = cast(list[trio.abc.Listener[CountedStream]], capped)
                        await nursery.start(front.run, listening, handoff, handlers)
                    else:
                        handoff.close()
                        handed.close()
                    task_status.started()

        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(serve)
                self.port = listeners[0].socket.getsockname()[1]
                task_status.started(self.port)
                await trio.sleep_forever()
            finally:
                accepting.cancel()
                with trio.CancelScope(shield=True):
                    await connections.close_all(limits.close_timeout_s)
                serving.cancel()

    async def _cut_off_stuck_clients(self, connections: OpenConnections) -> None:
        """Cut off each client whose writer has been stuck in one send for the limits'
        ``send_timeout_s`` (it reads nothing), within a quarter of it more: one look at
        every connection each quarter, not a timer around each frame sent."""
        timeout = self.limits.send_timeout_s
        while True:
            await trio.sleep(timeout / 4)
            now = trio.current_time()
            for connection in connections:
                connection.outbox.cut_off_if_stuck(now, timeout)

    @property
    def url(self) -> str:
        """The websocket URL clients connect to (``ws://HOST:PORT/v1``)."""
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"ws://{host}:{self.port}{PATH}"

    def allow_origin(self, origin: str) -> None:
        """Admit browser handshakes from ``origin`` (``scheme://host[:port]``)."""
        self._origins.add(normal_origin(origin))

    def allow_host(self, name: str) -> None:
        """Answer requests whose ``Host`` header names ``name`` (a host name without a
        port; raises ConfigurationError for anything else), and admit the handshakes of
        the console's page reached by that name (:meth:`allow_console`), also when the
        console serves already (R-SEC-4)."""
        self.host_names.add(name)
        for port in self._console_ports:
            self.allow_origin(f"http://{url_host(normal_host_name(name))}:{port}")

    def allow_console(self, port: int) -> None:
        """Admit browser handshakes from the web console served on ``port`` on the
        gateway's host: its origin under each name the console is reached by (loopback's
        spellings, the listen host, the names of :meth:`allow_host`, now and later)."""
        self._console_ports.append(port)
        # The page connects from the browser: a wildcard bind is reached through loopback.
        added = (name for name in self.host_names.names if name != "localhost")
        for name in _console_hosts(display_host(self.listen_host), added):
            self.allow_origin(f"http://{url_host(name)}:{port}")

    def grant(self, client_id: str, session_id: str) -> None:
        """Let ``client_id`` see and steer ``session_id`` (created elsewhere or by another
        client). Such a grant lives as long as the gateway (a session's creator is
        stored with it)."""
        self._grants.grant(client_id, session_id)

    def owned(self, client_id: str) -> frozenset[str]:
        """The sessions ``client_id`` created or was granted."""
        return self._grants.owned(client_id)

    def holders(self, session_id: str) -> frozenset[str]:
        """The principals that created or were granted ``session_id``."""
        return self._grants.holders(session_id)

    def route_through(self, router: Router) -> None:
        """Serve the sessions of other hosts through ``router`` (cluster mode). Called
        before the gateway serves."""
        self._calls.router = router

    async def load_provider(self) -> None:
        """Load the provider client of the sessions this gateway creates (nothing to load
        when the defaults give a provider factory), so that the first ``session.create``
        does not wait for the provider's library. Raises :class:`ConfigurationError` as
        that ``session.create`` would."""
        defaults = self.defaults
        if defaults.provider_factory is not None:
            return
        base_url = defaults.settings.get("base_url")
        await self.host.load_provider(
            defaults.provider,
            model=defaults.model,
            base_url=base_url if isinstance(base_url, str) else None,
        )

    @property
    def methods(self) -> Mapping[str, Handler]:
        """The dispatch table (what a request forwarded from another host runs)."""
        return self._methods

    @property
    def _titled(self) -> set[str]:
        """The sessions titled, or being titled, by this gateway."""
        return self._titles.titling

    # -- connections ---------------------------------------------------------------------------

    async def _handle(self, connections: OpenConnections, request: WebSocketRequest) -> None:
        """One connection, from handshake to close. Never raises but Cancelled: an
        exception here would end the listener and every other connection."""
        try:
            await self._handshake_and_serve(connections, request)
        # except*: a failure in a connection's clean-up while the gateway stops comes in
        # one group with the cancellation; only the cancellation may go on.
        except* ConnectionClosed:
            pass
        except* Exception:
            logger.exception("gateway: connection failed")

    async def _handshake_and_serve(
        self, connections: OpenConnections, request: WebSocketRequest
    ) -> None:
        host = _host_header(request)
        if not self.host_names.allows(host):
            # Before anything else: a rebound page gets no answer of this server, not even
            # a wrong token's, which would throttle the loopback address's own clients.
            await request.reject(421, body=f"{self.host_names.refusal(host)}\n".encode())
            return
        if request.path.split("?", 1)[0] != PATH:
            await request.reject(404, body=f"not found: the endpoint is {PATH}\n".encode())
            return
        headers = {name.lower(): value for name, value in request.headers}
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin):
            await request.reject(403, body=b"forbidden: this origin may not connect\n")
            return
        address = _address(request)
        wait = self._admission.throttled(address, trio.current_time())
        if wait is not None:
            # Refused before the token is looked at: a throttled address learns nothing.
            seconds = math.ceil(wait)
            await request.reject(
                429,
                extra_headers=[(b"Retry-After", str(seconds).encode())],
                body=f"too many failed authentication attempts from this address; retry "
                f"in {seconds} s\n".encode(),
            )
            return
        if self._seats.full:
            await request.reject(
                503, body=f"too many connections (at most {self.max_connections})\n".encode()
            )
            return
        named = headers.get(CLIENT_HEADER)
        try:
            claimed = claimed_client(None if named is None else named.decode("latin-1"))
        except ClaimRefused as refused:
            await request.reject(refused.status, body=f"{refused.reason}\n".encode())
            return
        identity: str | None = None
        authorization = headers.get(b"authorization")
        if authorization is not None:
            scheme, _, token = authorization.partition(b" ")
            identity = self._principals.of(token.strip()) if scheme.lower() == b"bearer" else None
            if identity is None:
                self._admission.failed(address, trio.current_time())
                await request.reject(
                    401,
                    extra_headers=[(b"WWW-Authenticate", b'Bearer realm="greenroom"')],
                    body=b"unauthorized: bad bearer token\n",
                )
                return
            try:
                check_claim(claimed, identity)
            except ClaimRefused as refused:
                await request.reject(refused.status, body=f"{refused.reason}\n".encode())
                return
        if identity is not None and not self._admission.admit(identity):
            cap = self.limits.max_connections_per_principal
            await request.reject(
                429,
                body=f"too many connections for client {identity!r} (at most {cap})\n".encode(),
            )
            return
        self._seats.take()
        connection: Connection | None = None
        try:
            ws = await request.accept()
            connection = Connection(
                ws,
                identity,
                self.limits,
                methods=self._methods,
                detached=DETACHED,
                auth_timeout_s=self.auth_timeout_s,
                claimed=claimed,
                address=address,
            )
            connection.counted = identity
            await self._serve_accepted(connections, ws, connection)
        finally:
            self._seats.give_back()
            counted = identity if connection is None else connection.counted
            if counted is not None:
                self._admission.release(counted)

    async def _serve_accepted(
        self, connections: OpenConnections, ws: WebSocketConnection, connection: Connection
    ) -> None:
        connections.add(connection)
        close_code, close_reason = 1000, "bye"
        try:
            await connection.run()
            if connection.close_with is not None:
                close_code, close_reason = connection.close_with
        except trio.Cancelled:
            close_code, close_reason = SHUTTING_DOWN
            raise
        except Exception:
            close_code, close_reason = 1011, "internal error"
            raise
        finally:
            connections.discard(connection)
            connection.drop_subscriptions()
            try:
                with trio.CancelScope(shield=True) as scope:
                    # Cut off by the stop, its close timeout is spent already.
                    scope.deadline = min(
                        trio.current_time() + self.limits.close_timeout_s, connections.closed_by
                    )
                    with contextlib.suppress(ConnectionClosed, trio.BrokenResourceError):
                        await ws.aclose(close_code, close_reason)
            finally:
                # A stopping gateway keeps the readers the close needs until then.
                connections.closed(connection)

    def _origin_allowed(self, origin: bytes) -> bool:
        return normal_origin(origin.decode("latin-1")) in self._origins


def _version() -> str:
    """greenroom's version, for the A2A agent card."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("greenroom")
    except PackageNotFoundError:
        return "0.0.0"


def _host_header(request: WebSocketRequest) -> str:
    """The handshake's ``Host`` header. wsproto moves it out of the headers trio-websocket
    shows (``request.headers`` never holds it) into its request event, which trio-websocket
    keeps but does not expose; wsproto refuses a handshake without one. Should a version
    keep it elsewhere, ``""`` is refused (421) rather than every name let through."""
    host = getattr(getattr(request, "_event", None), "host", None)
    return host if isinstance(host, str) else ""


def _address(request: WebSocketRequest) -> str:
    """The key of the handshake's remote address (:func:`address_key`)."""
    remote = request.remote
    # Through the capped listener the stream is a CountedStream, whose repr is the
    # peer's address; a bare socket stream gives an Endpoint.
    return address_key(str(remote.address) if isinstance(remote, Endpoint) else remote)


# -- greenroom serve ---------------------------------------------------------------------------


DRAIN_GRACE_S = 30.0
"""How long a SIGTERM drain waits for running tasks to reach a turn boundary
(``serve --drain-grace``)."""

HostOpener = Callable[[Path, Iterable[SessionObserver]], AbstractAsyncContextManager[Host]]
"""Opens the host ``run_serve`` serves, from the data dir and the session observers."""


def _local_host_opener(
    gc_tuning: bool | None,
    defaults: SessionDefaults,
    costs: Mapping[str, Any],
    provider_limits: ProviderLimits | None = None,
) -> HostOpener:
    """The host of a single ``serve``: it takes up the tasks its last run left open (a
    crash, a SIGKILL: R-HITL-4), gives the sessions it loads on its own the tools and MCP
    servers the gateway gives the sessions it creates (``defaults``: R-MCP-4), their calls
    (and those of the follow-ups its subagents' answers start) decided as ``--approve``
    says (R-HITL-4), and holds every provider endpoint to ``provider_limits`` (R-SHARE-1);
    ``costs`` are its ``prices`` and ``principal_budget`` (R-SHARE-3, R-SHARE-4)."""

    @asynccontextmanager
    async def open_local(
        data_dir: Path, observers: Iterable[SessionObserver]
    ) -> AsyncIterator[Host]:
        async with Host.open(
            data_dir,
            observers=observers,
            gc_tuning=gc_tuning,
            tools=defaults.tools,
            mcp_servers=defaults.mcp_servers,
            approve=approve_for(defaults.approve),
            limits=provider_limits,
            **costs,
        ) as host:
            await host.resume_tasks()
            yield host

    return open_local


async def run_serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    data_dir: str | Path | None = None,
    token_file: str | Path | None = None,
    defaults: SessionDefaults | None = None,
    approval_timeout_s: float | None = None,
    limits: GatewayLimits | None = None,
    drain_grace_s: float = DRAIN_GRACE_S,
    ready: Callable[[int], None] | None = None,
    console_port: int | None = None,
    tokens_file: str | Path | None = None,
    allowed_origins: Iterable[str] = (),
    allowed_hosts: Iterable[str] = (),
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    observers: Iterable[SessionObserver] = (),
    gc_tuning: bool | None = None,
    open_host: HostOpener | None = None,
    on_gateway: Callable[[Gateway], None] | None = None,
    prices: Mapping[str, Any] | None = None,
    principal_budget: PrincipalBudget | None = None,
    provider_limits: ProviderLimits | None = None,
    reuse_port: bool = False,
    a2a: bool = False,
    ag_ui: bool = False,
) -> None:
    """``greenroom serve``: open a host on ``data_dir``, serve the gateway on it, print
    ``listening on ws://HOST:PORT/v1`` and the token file on stderr, and serve until
    cancelled or until SIGINT/SIGTERM, then close connections (1001) and the host (which
    interrupts running tasks and flushes their traces). SIGTERM drains first
    (:meth:`Host.drain`, up to ``drain_grace_s``): running tasks stop at their next turn
    boundary, to be taken up by the next start. ``ready`` gets the bound port.

    The host takes up, when it opens, the tasks left open on the data dir by a serve that
    stopped without closing them (a crash, a SIGKILL: R-HITL-4), with the tools and MCP
    servers of ``defaults`` (as every session it loads on its own); requests waiting for
    a person wait on, without limit unless ``approval_timeout_s`` says otherwise
    (R-HITL-1).
    Raises :class:`ConfigurationError` for an unusable token file and OSError when the
    address cannot be bound.

    ``console_port`` (None: no console; 0: any free port) also serves the web console on
    the same host (:mod:`greenroom.actors.gateway.console`) and prints ``console:
    http://HOST:PORT/?ws=…#token=…`` on stderr. The console is an extra: when its port
    cannot be bound, a warning is printed and the gateway serves without it; when it is
    served its origin is allowed to connect.

    ``tokens_file`` (instead of ``token_file``) gives one principal per line
    (:func:`load_tokens_file`); the console URL then carries no token (the page asks for
    one). ``allowed_origins``: more browser origins allowed to connect. ``allowed_hosts``:
    host names the gateway and the console answer to besides ``localhost``, the listen
    host and IP addresses (``--allow-host``; other ``Host`` headers are refused, 421); the
    console's origin under each is allowed to connect too.
    ``max_connections`` is lowered, with a notice, to what the file descriptor limit
    allows after the soft limit is raised to the hard one (:func:`connection_cap`).
    ``observers`` watch the host's sessions
    (:data:`~greenroom.actors.runtime.host.SessionObserver`). ``gc_tuning``: the host's
    garbage collector setting (``Host.open(gc_tuning=…)``). ``open_host`` opens the host
    instead of :meth:`Host.open` (cluster mode: a host that joins a cluster); ``on_gateway``
    gets the gateway before it serves (cluster mode shares its grants).

    ``prices`` and ``principal_budget`` are the host's (``Host.open``: R-SHARE-3,
    R-SHARE-4); each session a client creates is charged to the client's principal.
    ``provider_limits`` hold for each provider endpoint across the host's sessions
    (``Host.open(limits=…)``; an ``open_host`` applies its own).

    ``a2a``, ``ag_ui``: also serve the A2A and AG-UI endpoints on the gateway's port
    (:class:`Gateway`), and print their URLs."""
    if tokens_file is not None and token_file is not None:
        raise ConfigurationError("give --token-file or --tokens-file, not both")
    fd_limit = raise_fd_limit()
    cap = connection_cap(max_connections, fd_limit)
    if cap < max_connections:
        print(
            f"greenroom serve: at most {cap} connections (the file descriptor limit is "
            f"{fd_limit}; {FD_RESERVE} are kept for sessions)",
            file=sys.stderr,
            flush=True,
        )
    # Configuration is checked before the host opens: a mistake is one clear error.
    data = await trio.to_thread.run_sync(resolved, data_dir or default_data_dir())
    session_defaults = defaults or SessionDefaults()
    await trio.to_thread.run_sync(
        check_data_dir_private,
        data,
        session_defaults.workspace_root or session_defaults.workspace_dir,
        session_defaults.workspace_dir,
    )
    token: str | None = None
    tokens: dict[str, str] | None = None
    if tokens_file is not None:
        tokens = await trio.to_thread.run_sync(load_tokens_file, tokens_file)
        token_path = await trio.to_thread.run_sync(token_file_path, data, tokens_file)
    else:
        token_path = await trio.to_thread.run_sync(token_file_path, data, token_file)
        token = await trio.to_thread.run_sync(load_or_create_token, data, token_path)
    opener = open_host or _local_host_opener(
        gc_tuning,
        session_defaults,
        {"prices": prices, "principal_budget": principal_budget},
        provider_limits,
    )
    async with opener(data, observers) as opened:
        gateway = Gateway(
            opened,
            token=token,
            tokens=tokens,
            listen_host=host,
            port=port,
            defaults=defaults,
            approval_timeout_s=approval_timeout_s,
            limits=limits,
            titles=True,
            max_connections=cap,
            allowed_origins=allowed_origins,
            allowed_hosts=allowed_hosts,
            reuse_port=reuse_port,
            a2a=a2a,
            ag_ui=ag_ui,
        )
        if on_gateway is not None:
            on_gateway(gateway)
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(gateway.run)
            print(f"listening on {gateway.url}", file=sys.stderr, flush=True)
            kind = "tokens" if tokens else "token"
            print(f"{kind} file: {token_path}", file=sys.stderr, flush=True)
            base = gateway.http_url
            if a2a:
                print(f"a2a: {base}/a2a (agent card: {base}/.well-known/agent-card.json)",
                      file=sys.stderr, flush=True)  # fmt: skip
            if ag_ui:
                print(f"ag-ui: {base}/ag-ui", file=sys.stderr, flush=True)
            if console_port is not None:
                await _start_console(nursery, gateway, host, console_port, token, reuse_port)
            if ready is not None:
                ready(bound)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    if signum == signal.SIGTERM:
                        await _drain(opened, drain_grace_s)
                    else:
                        _say("SIGINT, shutting down")
                    break
            nursery.cancel_scope.cancel()


def _say(words: str) -> None:
    print(f"greenroom serve: {words}", file=sys.stderr, flush=True)


async def _drain(host: Host, grace_s: float) -> None:
    """SIGTERM (a deploy): drain before stopping (R-DRAIN-1). A second SIGTERM or a
    SIGINT meanwhile stops at once."""
    _say(
        f"SIGTERM, draining (running tasks stop at their next turn boundary, {grace_s:g} s at most)"
    )
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as again:
        async with trio.open_nursery() as nursery:

            async def stop_early() -> None:
                async for signum in again:
                    _say(f"{signal.Signals(signum).name} while draining, shutting down now")
                    nursery.cancel_scope.cancel()

            nursery.start_soon(stop_early)
            held = await host.drain(grace_s)
            plural = "" if len(held) == 1 else "s"
            _say(
                f"drained: {len(held)} task{plural} held at a turn boundary, for another "
                "host or the next start to take up; shutting down"
            )
            nursery.cancel_scope.cancel()


def _console_hosts(host: str, allowed: Iterable[str] = ()) -> tuple[str, ...]:
    """The names a browser may use for the console's host: a loopback address is also
    reached as ``localhost`` and the other loopback spelling; and the names the owner
    allowed (``--allow-host``)."""
    loopback = ("127.0.0.1", "localhost", "::1")
    own = loopback if host in loopback else (host,)
    return tuple(dict.fromkeys((*own, *allowed)))


async def _start_console(
    nursery: trio.Nursery,
    gateway: Gateway,
    host: str,
    port: int,
    token: str | None,
    reuse_port: bool,
) -> None:
    gateway_port = gateway.port
    console = ConsoleServer(
        listen_host=host,
        port=port,
        reuse_port=reuse_port,
        ws_port=gateway_port,
        host_names=gateway.host_names,
    )
    try:
        await nursery.start(console.run)
    except OSError as exc:
        print(
            f"console: cannot listen on {host}:{port} ({exc}); serving without the console",
            file=sys.stderr,
            flush=True,
        )
        return
    # The page connects from the browser: a wildcard bind is reached through loopback.
    ws_url = f"ws://{url_host(display_host(host))}:{gateway_port}{PATH}"
    gateway.allow_console(console.port)
    print(f"console: {console.url(ws_url, token)}", file=sys.stderr, flush=True)
