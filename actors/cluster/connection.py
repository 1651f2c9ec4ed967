"""One host's connection to NATS and the names of the cluster's JetStream resources.

A :class:`Connection` is the nats-py client and its JetStream context, reached from trio
through the :class:`~greenroom.actors.cluster.bridge.Bridge`. :class:`ClusterNames` spells
every bucket, stream and subject, so that several clusters (or tests) can share one server
under different prefixes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import attrs
import nats
import nats.errors
import nats.js.api
import nats.js.errors
import trio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from greenroom.actors.cluster.bridge import Behind, Bridge, Inbox, within_else_behind
from greenroom.actors.cluster.errors import ClusterUnavailable

__all__ = [
    "NATS_URL_ENV",
    "ClusterNames",
    "Connection",
    "check_session_id",
    "connect",
    "credentialed_url",
    "shown_url",
]

T = TypeVar("T")

_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_CLOSE_S = 2.0
_DRAIN_S = 1.0
"""How long a subscription's block waits for its drain. Within _CLOSE_S: a drain cut short
leaves time for the unsubscription after it."""
_BEHIND_S = 8.0
"""How long a drain cut short goes on in the background, from its start. Below nats-py's
flush timeout (10 s), past which nats-py marks the subscription closed and refuses its
unsubscription but keeps it, to subscribe it again when it reconnects."""


NATS_URL_ENV = "GREENROOM_NATS_URL"
"""The environment variable that may give ``--nats``'s URL with its credentials, so that
they are on no command line (``serve --workers`` passes its own server's to its workers
so): used when it names the same servers as ``--nats`` (:func:`credentialed_url`)."""


def credentialed_url(given: str, from_env: str | None) -> str:
    """``from_env`` when it names the servers ``given`` names (their credentials aside),
    else ``given``."""
    if from_env and shown_url(from_env) == shown_url(given):
        return from_env
    return given


def shown_url(url: str) -> str:
    """``url`` (NATS servers, comma-separated) without the credentials any of them carries,
    for a log or an error message."""
    return ",".join(_CREDENTIALS.sub(r"\1", part) for part in url.split(","))


_CREDENTIALS = re.compile(r"^(\s*(?:[A-Za-z][A-Za-z0-9+.-]*://)?)[^/@]*@")


def check_session_id(session_id: str) -> str:
    """``session_id`` if it can be one token of a NATS subject and a KV key; else ValueError
    (greenroom's ids, ``20260101-120000-abcdef``, always can)."""
    if not _TOKEN.fullmatch(session_id):
        raise ValueError(f"session id {session_id!r} cannot be used in the cluster")
    return session_id


@attrs.frozen(kw_only=True)
class ClusterNames:
    """The JetStream buckets, stream and subjects of one cluster (``prefix`` sets them apart
    when several share a server)."""

    prefix: str = "greenroom"

    def __attrs_post_init__(self) -> None:
        if not _TOKEN.fullmatch(self.prefix):
            raise ValueError(f"cluster prefix {self.prefix!r} must be letters, digits, - or _")

    @property
    def host_leases(self) -> str:
        """The KV bucket host id → its incarnation (with the lease TTL)."""
        return f"{self.prefix}_host_leases"

    @property
    def owners(self) -> str:
        """The KV bucket session id → the host (and incarnation) that owns it."""
        return f"{self.prefix}_owners"

    @property
    def hosts(self) -> str:
        """The KV bucket host id → host record (load, gateway URL), with a TTL."""
        return f"{self.prefix}_hosts"

    @property
    def sessions(self) -> str:
        """The KV bucket session id → session metadata."""
        return f"{self.prefix}_sessions"

    @property
    def placements(self) -> str:
        """The KV bucket placement id → whether the gateway that placed that
        ``session.create`` withdrew it or a host kept its session (with a TTL)."""
        return f"{self.prefix}_placements"

    @property
    def trace_stream(self) -> str:
        """The JetStream stream holding every session's trace."""
        return f"{self.prefix.upper()}_TRACES"

    def trace_subject(self, session_id: str) -> str:
        """The one subject of ``session_id``'s trace records."""
        return f"{self.prefix}.trace.{check_session_id(session_id)}"

    @property
    def trace_subjects(self) -> str:
        """The wildcard of all trace subjects (the stream's subjects)."""
        return f"{self.prefix}.trace.>"

    def request_subject(self, session_id: str) -> str:
        """The subject on which only ``session_id``'s owner answers requests."""
        return f"{self.prefix}.session.{check_session_id(session_id)}"

    def host_subject(self, host_id: str) -> str:
        """The subject on which host ``host_id`` answers requests not about one session
        (a ``session.create`` placed on it)."""
        return f"{self.prefix}.host.{check_session_id(host_id)}"

    def live_subject(self, session_id: str) -> str:
        """The subject of ``session_id``'s live-only outputs (not stored)."""
        return f"{self.prefix}.live.{check_session_id(session_id)}"

    @property
    def admission_leases(self) -> str:
        """The KV bucket provider endpoint → the host that admits its requests for the
        whole cluster (with the lease TTL)."""
        return f"{self.prefix}_admission"

    def admission_subject(self, endpoint_key: str) -> str:
        """The subject on which the host that admits for an endpoint answers the others."""
        return f"{self.prefix}.admission.{check_session_id(endpoint_key)}"

    def pause_subject(self, endpoint_key: str) -> str:
        """The subject on which an endpoint's pauses (a 429's ``retry-after``) reach every
        host that sends to it."""
        return f"{self.prefix}.admission.{check_session_id(endpoint_key)}.pause"

    @property
    def spending(self) -> str:
        """The KV bucket principal and period → what the principal spent in it, over
        every host."""
        return f"{self.prefix}_spending"


@attrs.define
class Connection:
    """A connected NATS client. ``call`` awaits one of its coroutines from trio, translating
    a lost connection into :class:`ClusterUnavailable`."""

    bridge: Bridge
    client: Client
    js: JetStreamContext
    names: ClusterNames
    inboxes: set[Inbox[Any]] = attrs.field(factory=set)
    """The inboxes of the subscriptions open now: ended when the client closes."""
    lingering: _LingeringDrains = attrs.field(factory=lambda: _LingeringDrains())
    """The drains cut short that go on in the background: stopped when the client loses
    its connection (:func:`connect` hands it the client's ``disconnected_cb``)."""
    reconnects: _Reconnects = attrs.field(
        default=attrs.Factory(lambda self: _Reconnects(self.bridge), takes_self=True)
    )
    """How many times the client connected again after a loss (:func:`connect` hands it
    the client's ``reconnected_cb``)."""

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (built from :attr:`client` or :attr:`js`) on the asyncio side.
        Connection-level failures become :class:`ClusterUnavailable`; JetStream API errors
        cross unchanged for the caller to translate."""

        async def wrapped() -> T:
            return await coro

        try:
            return await self.bridge.call(wrapped)
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.NoServersError,
            nats.js.errors.ServiceUnavailableError,
            nats.js.errors.NoStreamResponseError,
            OSError,
        ) as exc:
            raise ClusterUnavailable(f"NATS is unavailable: {_describe(exc)}") from exc

    async def call_api(self, coro: Coroutine[Any, Any, T], doing: str) -> T:
        """:meth:`call`, with a JetStream API error turned into :class:`ClusterUnavailable`
        saying what could not be done: ``cannot {doing}: {error}``."""
        try:
            return await self.call(coro)
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot {doing}: {exc}") from exc

    async def close_consumer(
        self,
        sub: JetStreamContext.PushSubscription,
        info: nats.js.api.ConsumerInfo | None = None,
    ) -> None:
        """Unsubscribe ``sub`` and delete its ephemeral consumer now (``info``: its
        consumer's, when the caller holds it; else asked for); a coroutine for
        :meth:`call`. A stream holds at most 1,000 consumers by default, and the server
        keeps an unsubscribed one for seconds: a burst of reads (a takeover's, a thousand
        placements) would otherwise find the stream full."""
        await sub.unsubscribe()
        with contextlib.suppress(nats.js.errors.NotFoundError):
            if info is None:
                info = await sub.consumer_info()
            await self.js.delete_consumer(info.stream_name, info.name)

    @property
    def connected(self) -> bool:
        """Whether the client is connected now (not reconnecting, not closed)."""
        return bool(self.client.is_connected)

    @property
    def reconnections(self) -> int:
        """How many times the client has connected again since :func:`connect`."""
        return self.reconnects.count

    async def reconnected(self, after: int) -> None:
        """Return once the client has connected again more than ``after`` times
        (:attr:`reconnections`). By then its subscriptions are made again and confirmed by
        the server: a message published from then on reaches them."""
        while self.reconnects.count <= after:
            await self.reconnects.next().wait()

    async def settled(self) -> None:
        """Return once no drain cut short goes on in the background (each has ended: done,
        or cut short by its bound or a lost connection)."""
        await self.call(self.lingering.settled())

    @contextlib.asynccontextmanager
    async def subscription(
        self, subject: str, *, late_reply: bytes | None = None
    ) -> AsyncIterator[Inbox[Msg]]:
        """Subscribe to ``subject`` for the block; yields its messages as a trio async
        iterator (an :class:`~greenroom.actors.cluster.bridge.Inbox`), which ends when
        the connection closes. Messages published from the moment the block starts reach
        it (the subscription is confirmed by the server first). Drained on exit, within a
        bound: the messages the server sent before it stopped are in the inbox when the
        block ends, for the caller to take after it. A drain the server does not answer
        within the bound goes on in the background for a while (:data:`_BEHIND_S`): each
        request it still brings is answered ``late_reply`` (None: not answered), since
        nobody takes it from the inbox any more. Raises :class:`ClusterUnavailable` when
        the subscription cannot be made."""
        inbox: Inbox[Msg] = self.bridge.inbox()
        recipient = _Recipient(inbox, late_reply)
        self.inboxes.add(inbox)
        sub: Subscription | None = None
        confirmed = False
        try:
            try:
                sub = await self.call(self.client.subscribe(subject, cb=recipient.put))
                await self.call(self.client.flush())
            except nats.errors.Error as exc:
                raise ClusterUnavailable(f"cannot subscribe to {subject}: {exc}") from exc
            confirmed = True
            yield inbox
        finally:
            # Also when the confirming flush failed or was cancelled: a subscriber left
            # behind would take the subject's requests and answer none.
            if sub is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_S):
                    await self._end_subscription(sub, recipient, drain=confirmed)
            self.inboxes.discard(inbox)
            inbox.end()

    async def _end_subscription(
        self, sub: Subscription, recipient: _Recipient, *, drain: bool
    ) -> None:
        # Drained, not merely unsubscribed: nats-py forgets an unsubscribed subscription
        # at once and drops what the server sent it before reading the UNSUB, so a
        # request forwarded to a host as it stops serving a session would wait out its
        # whole timeout. A drain sends the UNSUB, waits for the server's PONG (all it
        # sent before has arrived) and for every message to be in the inbox; trio takes
        # none until the block has ended, so the inbox must hold them all.
        recipient.inbox.hold_all()
        # Not drained while the connection is down (the drain's round trip would wait for
        # the server) nor when the subscription was never confirmed (nobody was told it
        # serves). A drain cut short (its bound; the server slow, gone, or reconnecting,
        # which drops the round trip's PONG; a host's shutdown) goes on in the background
        # while the connection holds, its late messages given the late reply: unsubscribed
        # instead, nats-py would drop a request the server sent before it read the UNSUB,
        # and its sender wait out its timeout. It is unsubscribed while it is still under
        # way (its bound, a lost connection): nats-py marks a drained subscription closed,
        # refusing any unsubscription, but forgets it only when the drain ends, so a drain
        # cancelled half way would leave it to the client, which subscribes it again when
        # it reconnects (where it would take the subject's next server's requests).
        cut_short = False
        if drain and self.connected:
            disconnects = self.lingering.disconnects

            async def unsubscribe() -> None:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

            def keep_behind(behind: Behind) -> bool:
                nonlocal cut_short
                cut_short = True
                recipient.late = True
                # Lost since the drain began, even if back already: that connection's
                # round trip will never be answered, and the client may have subscribed
                # it again on the next.
                if not self.connected or self.lingering.disconnects != disconnects:
                    return False
                self.lingering.keep(sub, behind)
                return True

            drained = within_else_behind(
                sub.drain(),  # type: ignore[no-untyped-call]
                _DRAIN_S,
                _BEHIND_S,
                unsubscribe,
                keep_behind,
            )
            try:
                await self.call(drained)
                return
            except (ClusterUnavailable, nats.errors.Error, TimeoutError):
                if cut_short:
                    return
        with contextlib.suppress(ClusterUnavailable, nats.errors.Error):
            await self.call(sub.unsubscribe())

    async def aclose(self) -> None:
        """Close the client (idempotent; errors while closing are ignored). Bounded: with
        the server gone, the client's last flush would wait for it forever."""
        if self.client.is_closed:
            return
        with trio.move_on_after(_CLOSE_S), contextlib.suppress(Exception):
            await self.bridge.call(self.client.close)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def connect(
    bridge: Bridge,
    url: str,
    *,
    name: str,
    names: ClusterNames | None = None,
    connect_timeout_s: float = 5.0,
) -> Connection:
    """Connect to the NATS server(s) at ``url`` (comma-separated for a cluster). Raises
    :class:`ClusterUnavailable` when none can be reached within ``connect_timeout_s``."""
    servers = [part.strip() for part in url.split(",") if part.strip()]

    inboxes: set[Inbox[Any]] = set()
    lingering = _LingeringDrains()
    reconnects = _Reconnects(bridge)

    async def closed() -> None:
        for inbox in list(inboxes):
            inbox.end()

    async def attempt() -> Client:
        client = _Client()
        await client.connect(
            servers=servers,
            name=name,
            connect_timeout=max(1, round(connect_timeout_s)),
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            # Without this the client retries the first connection forever.
            error_cb=_ignore_error,
            closed_cb=closed,
            disconnected_cb=lingering.disconnected,
            reconnected_cb=reconnects.reconnected,
        )
        return client

    # Bounded here: once connected the client reconnects forever, and so it would
    # retry a first connection forever too.
    client: Client | None = None
    with trio.move_on_after(connect_timeout_s):
        try:
            client = await bridge.call(attempt)
        except Exception as exc:
            raise ClusterUnavailable(
                f"cannot reach NATS at {shown_url(url)}: {_describe(exc)}"
            ) from exc
    if client is None:
        raise ClusterUnavailable(
            f"cannot reach NATS at {shown_url(url)} within {connect_timeout_s:g} s"
        )
    return Connection(
        bridge=bridge,
        client=client,
        js=client.jetstream(),
        names=names or ClusterNames(),
        inboxes=inboxes,
        lingering=lingering,
        reconnects=reconnects,
    )


class _Client(Client):
    """nats-py's client, for a PONG that comes after its flush gave up.

    A flush queues a future for its PING's PONG; a flush that times out (or is cancelled)
    cancels that future but leaves it queued, and nats-py sets the result of the first
    queued future when a PONG comes, so the late PONG raised InvalidStateError in the
    read loop, which died: the client, still "connected", received nothing until a
    reconnect. Each PONG still answers the oldest PING, in order; one whose flush has
    given up is taken and dropped."""

    async def _process_pong(self) -> None:
        if self._pongs:
            waiting = self._pongs.pop(0)
            if not waiting.done():
                waiting.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


class _Recipient:
    """Where a subscription's messages go: its inbox until its drain is cut short, then
    (the drain going on in the background, nobody taking from the inbox) the late reply
    to each request, nothing to the others."""

    def __init__(self, inbox: Inbox[Msg], late_reply: bytes | None) -> None:
        self.inbox = inbox
        self.late_reply = late_reply
        self.late = False

    async def put(self, msg: Msg) -> None:
        """Take ``msg`` (the subscription's callback, on the asyncio side)."""
        if not self.late:
            await self.inbox.put(msg)
        elif self.late_reply is not None and msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(self.late_reply)


class _LingeringDrains:
    """The drains cut short that go on in the background, by subscription, and how many
    times the client has lost its connection. For the asyncio side."""

    def __init__(self) -> None:
        self.drains: dict[Subscription, Behind] = {}
        self.disconnects = 0

    def keep(self, sub: Subscription, behind: Behind) -> None:
        """Hold ``sub``'s drain, ``behind``, until it ends."""
        self.drains[sub] = behind
        behind.on_end(lambda: self.drains.pop(sub, None))

    async def disconnected(self) -> None:
        """The client lost its connection (its ``disconnected_cb``, called before it
        reconnects): each drain is cut short, its subscription unsubscribed now. The
        lost connection's round trip will not be answered, and the client would
        subscribe it again on the server it reconnects to, where it would take the
        subject's next server's requests."""
        self.disconnects += 1
        for behind in list(self.drains.values()):
            await behind.stop()

    async def settled(self) -> None:
        """Return once every drain held now has ended."""
        for behind in list(self.drains.values()):
            await behind.wait()


class _Reconnects:
    """How many times the client has connected again after losing its connection, and
    the event the trio side waits on for the next time."""

    def __init__(self, bridge: Bridge) -> None:
        self.count = 0
        self._bridge = bridge
        self._next: trio.Event | None = None

    async def reconnected(self) -> None:
        """The client is connected again (its ``reconnected_cb``, on the asyncio side, once
        its subscriptions are made again and the server has answered a round trip)."""
        self.count += 1
        waiting, self._next = self._next, None
        if waiting is not None:
            self._bridge.wake(waiting)

    def next(self) -> trio.Event:
        """The event set at the next reconnection (trio side)."""
        if self._next is None:
            self._next = trio.Event()
        return self._next


async def _ignore_error(exc: Exception) -> None:
    """nats-py reports every transient error here; the calls that fail report them to us."""
