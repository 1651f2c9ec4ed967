"""One admission point per provider endpoint and credential for every host of a cluster
(R-SHARE-1 across hosts): the host that holds the endpoint's lease admits for all of them.

An endpoint is known by its key: the first 24 hex digits of the SHA-256 of the client's
:attr:`~greenroom.actors.providers.base.IdentifiedEndpoint.endpoint_identity` (provider,
base URL, a hash of the credential), so the same endpoint and key meet on every host and
neither the key nor its hash is in a subject. Each host that sends to the endpoint has a
:class:`SharedEndpoint`, the point its sessions ask, in one of three modes:

* **owner** — this host holds the endpoint's lease (KV ``<prefix>_admission``, claimed
  with ``create``, renewed every TTL/3 with compare-and-set, as a session's lease). Its own
  :class:`~greenroom.actors.runtime.admission.EndpointAdmission` admits for the whole
  cluster: its own sessions' requests at no cost (no NATS on their path), the other
  hosts' through an :class:`AdmissionDesk` on the endpoint's subject — one queue, so the
  configured limits, the windows learned from 429s and the fair turns across principals
  and sessions are the cluster's. The owner's limits are the ones that hold: give every
  host the same.
* **remote** — another host holds the lease. A request is admitted by one NATS request to
  the owner (answered when the owner grants it); what then becomes of it — accepted, its
  usage (only when tokens are counted), a 429, its end — follows as messages, none waited
  for. A place may be **kept** (see below), and then the host's next request takes it
  without asking.
* **local** — NATS is out of reach: the host admits its own requests alone, under its own
  limits, and logs it once; when NATS answers again it claims the lease or follows the
  owner again. Admitting never stops for want of NATS.

A 429 or 529 pauses the endpoint where it is learned (the owner's admission, which every
request of the cluster passes) and the owner publishes the pause on the endpoint's pause
subject; every host that sends to the endpoint mirrors it in its own admission, so a
session's retry is announced with the endpoint's wait and a host that falls back to local
admission still honours it.

Without a per-minute limit, a place the owner grants may be kept: when its request ends
and the owner's last answer said nobody waits there, the host that asked keeps the place
for :data:`KEEP_IDLE_S`, and its next request takes it at once, with no message either
way (the owner still counts it in flight, so the limits and the learned window hold as
before; only its first request teaches the window). A kept place goes back to the owner
when it has been idle that long, :data:`KEEP_FOR_S` after it was granted, when an answer
of the owner says requests wait there, when a 429 is answered to it or a pause is
announced, when an ask of the owner is late or answered by another owner, and when the
mode changes. A per-minute limit counts every request, and a waiting request is owed the
next place in the owner's fair turn: neither is kept from.
(Within the asking host, a request may take a kept place while another of the same host
waits for the owner's answer.) Under steady load this spares most requests the round
trip to the owner, which two hosts on one machine pay in CPU and, under load, in latency.

When the owner's host is lost or stops, its lease expires (or is released) and the next
host whose request finds no owner claims it. Requests admitted before and still running
are not counted by the new owner: for as long as they last, the endpoint may get more
than its limit (and its 429s pause it as usual).

Wire messages (JSON objects) on ``<prefix>.admission.<key>``: ``admit`` (a request; the
reply ``{"owner": host, "keep": bool, "waiting": n}`` grants it: whether its place may be
kept, and how many requests wait at the owner; an owner that does not send ``keep``
grants places that are not kept) and, published, ``accepted``, ``settle``, ``limited``
and ``release`` (which also withdraws an admit still waiting), each with the asking host's
id, the run of its admission point and its number for the request. On
``<prefix>.admission.<key>.pause``: ``{"for_s", "host"}``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import itertools
import json
import math
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import trio
from nats.aio.msg import Msg

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterError, ClusterUnavailable, LeaseLost
from greenroom.actors.cluster.leases import Lease, LeaseTable
from greenroom.actors.runtime.admission import EndpointAdmission, RequestPermit

__all__ = ["AdmissionDesk", "KeptPlaces", "Mode", "SharedEndpoint", "endpoint_key"]

RETRY_S = 1.0
"""How long a host that cannot reach NATS (or find an owner) waits before trying again."""

KEEP_IDLE_S = 1.0
"""How long a host keeps a place the owner granted to be kept after its request ended,
for its next request to take without asking."""

KEEP_FOR_S = 10.0
"""How long after it was granted a kept place may be taken again: then it goes back, so
that it returns to the owner's fair turn even under steady load."""

_KEY_DIGITS = 24

LiveHosts = Callable[[], Awaitable[set[str]]]
"""The ids of the cluster's live hosts (the host registry's)."""


def endpoint_key(identity: str) -> str:
    """The key of the endpoint an adapter names (``endpoint_identity``): hex digits, a
    token of a NATS subject and a KV key."""
    return hashlib.sha256(identity.encode()).hexdigest()[:_KEY_DIGITS]


def log(message: str) -> None:
    """One line on stderr (the serve process's log)."""
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)


class Mode(enum.Enum):
    """Who admits a :class:`SharedEndpoint`'s requests now."""

    STARTING = "starting"
    """Not known yet: requests wait until it is."""
    OWNER = "owner"
    """This host, for the whole cluster."""
    REMOTE = "remote"
    """Another host, asked over NATS."""
    LOCAL = "local"
    """This host, for itself alone: NATS is out of reach."""


class _Answer(enum.Enum):
    """What became of one ask of the owner."""

    GRANTED = "granted"
    LATE = "late"
    """No answer within a lease TTL: a long queue, or an owner that stalled."""
    NOBODY = "nobody"
    """Nobody serves the endpoint's subject, or NATS is out of reach."""


class _Kept:
    """A place this host keeps between its requests (see the module docstring)."""

    __slots__ = ("idle_since", "number", "until")

    def __init__(self, number: int, until: float, idle_since: float) -> None:
        self.number = number
        self.until = until
        self.idle_since = idle_since


class KeptPlaces:
    """The places a remote host keeps between its requests (see the module docstring),
    the most recently used last; ``give_back(number)`` returns one to the owner."""

    def __init__(self, give_back: Callable[[int], None]) -> None:
        self._give_back = give_back
        self._places: collections.deque[_Kept] = collections.deque()
        self._added = trio.Event()
        self.owner = ""
        """The owner that granted the places kept now."""
        self.owner_busy = False
        """The owner's last answer said requests wait there: keep no place."""
        self.taken = 0
        """Requests admitted on a kept place."""

    def __len__(self) -> int:
        return len(self._places)

    def take(self) -> _Kept | None:
        """The most recently used place whose time is not up (giving back those whose
        time is), or None."""
        now = trio.current_time()
        while self._places:
            kept = self._places.pop()
            if now < kept.until:
                self.taken += 1
                return kept
            self._give_back(kept.number)
        return None

    def keep(self, number: int, until: float) -> None:
        """Keep place ``number`` (its request just ended) until ``until`` at the latest."""
        self._places.append(_Kept(number, until, trio.current_time()))
        self._added.set()

    def heard(self, owner: str, waiting: object) -> None:
        """An answer of ``owner`` that says ``waiting`` requests wait there: the places of
        an owner before it, which does not count them, and every place while requests
        wait there (they are owed them) go back."""
        if owner != self.owner:
            self.give_back_all()
            self.owner = owner
        self.owner_busy = not isinstance(waiting, int) or waiting > 0
        if self.owner_busy:
            self.give_back_all()

    def give_back_all(self) -> None:
        """Every kept place goes back to the owner."""
        while self._places:
            self._give_back(self._places.popleft().number)

    async def give_back_idle(self) -> None:
        """Give back each kept place once it has been idle :data:`KEEP_IDLE_S` or its
        time is up; until cancelled."""
        while True:
            if not self._places:
                self._added = trio.Event()
                await self._added.wait()
                continue
            oldest = self._places[0]
            await trio.sleep_until(min(oldest.idle_since + KEEP_IDLE_S, oldest.until))
            now = trio.current_time()
            while self._places and (
                self._places[0].idle_since + KEEP_IDLE_S <= now or self._places[0].until <= now
            ):
                self._give_back(self._places.popleft().number)


class _Waiting:
    """An admit of another host's that waits at the owner."""

    __slots__ = ("done", "scope")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.done = trio.Event()


Reply = Callable[[dict[str, Any]], None]
"""Answers one admit (queues the answer: never blocks)."""

_Key = tuple[str, str, int]
"""A request at the owner: the asking host, the run of its admission point, its number."""


class AdmissionDesk:
    """The owner's side: other hosts' requests admitted at this host's admission, in turn
    with its own sessions'. Lives while this host holds the endpoint's lease; its
    :meth:`close` gives every place of theirs back.

    A request is known by the asking host's id, the run of its admission point (a host
    that restarted under the same id numbers its requests from 1 again: the places of its
    earlier run are given back when its new run is first heard of) and its number for
    it; an admit sent again (its answer was late or lost) waits for, or gets, the same
    place."""

    def __init__(self, admission: EndpointAdmission, nursery: trio.Nursery) -> None:
        self._admission = admission
        self._nursery = nursery
        self._granted: dict[_Key, RequestPermit] = {}
        self._waiting: dict[_Key, _Waiting] = {}
        self._runs: dict[str, str] = {}
        self._missing: set[str] = set()

    @property
    def holds(self) -> int:
        """Other hosts' requests that hold a place or wait for one now."""
        return len(self._granted) + len(self._waiting)

    def take(self, message: dict[str, Any], reply: Reply | None) -> None:
        """One message from another host (``reply`` answers an admit). Synchronous, so
        that the messages of one host are taken in the order it sent them."""
        try:
            key = (str(message["host"]), str(message["run"]), int(message["id"]))
            op = message["op"]
        except (KeyError, TypeError, ValueError):
            return
        self._follow_run(key[0], key[1])
        if op == "admit" and reply is not None:
            self._admit(key, message, reply)
            return
        permit = self._granted.get(key)
        if op == "release":
            waiting = self._waiting.get(key)
            if waiting is not None:
                waiting.scope.cancel()
            if permit is not None:
                del self._granted[key]
                permit.release()
        elif permit is None:
            return  # a place granted by an earlier owner, or already given back
        elif op == "accepted":
            permit.accepted()
        elif op == "settle":
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self._admission.settle(permit, int(message["input"]), int(message["output"]))
        elif op == "limited":
            retry = message.get("retry_after")
            permit.rate_limited(float(retry) if isinstance(retry, int | float) else None)

    def _follow_run(self, host: str, run: str) -> None:
        earlier = self._runs.get(host)
        if earlier == run:
            return
        self._runs[host] = run
        if earlier is not None:
            self._give_back(lambda key: key[0] == host and key[1] != run)

    def _give_back(self, whose: Callable[[_Key], bool]) -> None:
        for key in [k for k in self._waiting if whose(k)]:
            self._waiting[key].scope.cancel()
        for key in [k for k in self._granted if whose(k)]:
            self._granted.pop(key).release()

    def _keep(self) -> dict[str, Any]:
        """The grant's answer: whether its place may be kept by the host that asked, and
        how many wait here (the asking host keeps none while some do)."""
        admission = self._admission
        return {"keep": not admission.counts_minutes, "waiting": admission.waiting}

    def _admit(self, key: _Key, message: dict[str, Any], reply: Reply) -> None:
        if key in self._granted:
            reply(self._keep())
            return
        waiting = self._waiting.get(key)
        if waiting is not None:
            self._nursery.start_soon(self._answer_when_granted, key, waiting, reply)
            return
        if not self._admission.counts_tokens:
            # The common case (nobody waits, it fits) needs no task of its own.
            permit = self._admission.admit_now()
            if permit is not None:
                self._granted[key] = permit
                reply(self._keep())
                return
        waiting = self._waiting[key] = _Waiting()
        self._nursery.start_soon(self._grant, key, waiting, message, reply)

    async def _grant(
        self, key: _Key, waiting: _Waiting, message: dict[str, Any], reply: Reply
    ) -> None:
        permit: RequestPermit | None = None
        try:
            with waiting.scope:
                permit = await self._admission.admit(
                    str(message.get("principal", "")),
                    str(message.get("session", "")),
                    input_tokens=_whole(message.get("input")),
                    output_tokens=_whole(message.get("output")),
                )
        finally:
            del self._waiting[key]
            if permit is not None:
                self._granted[key] = permit
            waiting.done.set()
        if permit is not None:
            reply(self._keep())

    async def _answer_when_granted(self, key: _Key, waiting: _Waiting, reply: Reply) -> None:
        await waiting.done.wait()
        if key in self._granted:
            reply(self._keep())

    def drop_lost_hosts(self, live: set[str]) -> None:
        """Give back the places of hosts missing from ``live`` twice in a row (a host
        that died holding them; once may be a late announcement)."""
        hosts = {key[0] for key in (*self._granted, *self._waiting)}
        missing = hosts - live
        lost = missing & self._missing
        self._missing = missing
        if lost:
            self._give_back(lambda key: key[0] in lost)

    def close(self) -> None:
        """This host no longer admits for the others: their waits end (they ask the next
        owner) and their places are given back."""
        for waiting in self._waiting.values():
            waiting.scope.cancel()
        granted, self._granted = self._granted, {}
        for permit in granted.values():
            permit.release()


def _whole(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class _RemoteGrant:
    """A place granted by the owner: what becomes of its request goes to the owner.
    ``keep_until``: when the place may be kept after its request (None: not kept);
    ``again``: the place was kept from an earlier request."""

    __slots__ = ("_endpoint", "again", "keep_until", "number", "owner")

    def __init__(
        self,
        endpoint: SharedEndpoint,
        number: int,
        *,
        owner: str = "",
        keep_until: float | None = None,
        again: bool = False,
    ) -> None:
        self._endpoint = endpoint
        self.number = number
        self.owner = owner
        self.keep_until = keep_until
        self.again = again

    def accepted(self) -> None:
        """The request was accepted: the owner's window may grow (only a place's first
        request teaches it)."""
        if not self.again:
            self._endpoint.report("accepted", self.number)

    def settle(self, permit: RequestPermit, input_tokens: int, output_tokens: int) -> None:
        """The request's real usage, for the owner's token windows."""
        if self._endpoint.counts_tokens:
            self._endpoint.report("settle", self.number, input=input_tokens, output=output_tokens)

    def rate_limited(self, permit: RequestPermit, retry_after_s: float | None) -> None:
        """A 429 or 529: the owner learns from it and pauses the cluster; this host
        pauses at once, so its session's retry is planned after the pause."""
        self.keep_until = None
        if retry_after_s is not None:
            self._endpoint.local.pause_for(retry_after_s)
        self._endpoint.report("limited", self.number, retry_after=retry_after_s)

    def release(self, permit: RequestPermit) -> None:
        """The request ended: its place is kept for the next one, or free at the owner."""
        self._endpoint.place_ended(self)

    def pause_remaining(self) -> float:
        """The endpoint's pause as this host mirrors it."""
        return self._endpoint.local.pause_remaining()

    def lift_pause(self) -> None:
        """A request sent past the pause was accepted: this host's mirror of the pause
        ends (the owner's ends with its own time, or with its own retry-now)."""
        self._endpoint.local.lift_pause()


class HeldLease:
    """This host's hold of an endpoint's lease while it admits for the cluster: renewed
    by :meth:`keep`, given up by :meth:`release` (the host's close, from another task)."""

    def __init__(self, leases: LeaseTable) -> None:
        self._leases = leases
        self.lease: Lease | None = None

    async def keep(self) -> str:
        """Renew the lease every TTL/3; return why it was lost."""
        ttl = self._leases.ttl_s
        renewed_at = trio.current_time()
        while True:
            await trio.sleep(ttl / 3)
            # Read after the sleep: the host's close may have given the lease up meanwhile.
            lease = self.lease
            if lease is None:
                return "its lease was given up"
            try:
                renewed = await self._leases.renew(lease)
            except LeaseLost:
                self.lease = None
                return "another host holds its lease"
            except ClusterUnavailable as exc:
                if trio.current_time() - renewed_at >= ttl:
                    self.lease = None
                    return f"its lease was not renewed for a TTL: {exc}"
                continue
            if self.lease is not lease:
                # Given up while the renewal was on its way: taking the renewed lease as
                # ours would keep a closed host admitting, so give that revision up too.
                with contextlib.suppress(ClusterError):
                    await self._leases.release(renewed)
                return "its lease was given up"
            self.lease = renewed
            renewed_at = trio.current_time()

    async def release(self) -> None:
        """Give the lease up, if held (best effort)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            with contextlib.suppress(ClusterError):
                await self._leases.release(lease)


class SharedEndpoint:
    """The admission point of one endpoint and credential on one host of a cluster (see
    the module docstring): an :class:`~greenroom.actors.runtime.admission.AdmissionPoint`
    for the host's sessions. Start :meth:`run` in a nursery; until it knows who admits,
    requests wait."""

    def __init__(
        self,
        conn: Connection,
        leases: LeaseTable,
        live_hosts: LiveHosts,
        *,
        host_id: str,
        key: str,
        identity: str,
        local: EndpointAdmission,
    ) -> None:
        self._conn = conn
        self._leases = leases
        self._live_hosts = live_hosts
        self.host_id = host_id
        self.key = key
        self.identity = identity
        """The adapter's ``endpoint_identity`` (provider, base URL, a hash of the key)."""
        self.local = local
        """This host's admission for the endpoint: the cluster's while this host owns it,
        its own alone while NATS is out of reach, a mirror of the pauses otherwise."""
        self._subject = conn.names.admission_subject(key)
        self._pauses = conn.names.pause_subject(key)
        self.mode = Mode.STARTING
        self._changed = trio.Event()
        self._suspect = trio.Event()
        self._asking: set[trio.CancelScope] = set()
        self._numbers = itertools.count(1)
        self._run = uuid.uuid4().hex[:12]
        self._held = HeldLease(leases)
        self._owning: trio.CancelScope | None = None
        """The scope of :meth:`_own` while this host admits for the cluster."""
        self._closing = False
        # Unbounded: reports come from permits, which cannot wait; each is a few bytes and
        # a request makes at most four, so the outbox holds what the requests in flight
        # said since the sender's last turn.
        self._outbox_send, self._outbox = trio.open_memory_channel[tuple[str, bytes]](math.inf)
        self.asked = 0
        """Requests admitted by asking another host (a NATS round trip each)."""
        self._kept = KeptPlaces(lambda number: self.report("release", number))

    async def known(self) -> Mode:
        """The mode, once it is known (not :attr:`Mode.STARTING`)."""
        while self.mode is Mode.STARTING:
            await self._changed.wait()
        return self.mode

    # -- the AdmissionPoint of the host's sessions ----------------------------------------

    @property
    def counts_tokens(self) -> bool:
        """Whether requests' tokens are counted (a token limit is configured)."""
        return self.local.counts_tokens

    def admit_now(self) -> RequestPermit | None:
        """A place at once when this host admits (it owns the endpoint, or NATS is out of
        reach) and it fits, or when it keeps one; else None."""
        mode = self.mode
        if mode is Mode.OWNER or mode is Mode.LOCAL:
            return self.local.admit_now()
        if mode is Mode.REMOTE:
            return self._take_kept()
        return None

    def admit_past_pause(self) -> RequestPermit | None:
        """A person's "retry now" (R-RETRY-5) goes past the pause when this host admits
        (it owns the endpoint, or NATS is out of reach); else None: the owner admits it
        in its turn."""
        mode = self.mode
        if mode is Mode.OWNER or mode is Mode.LOCAL:
            return self.local.admit_past_pause()
        return None

    async def admit(
        self, principal: str, session: str, *, input_tokens: int = 0, output_tokens: int = 0
    ) -> RequestPermit:
        """A place for one request (as :meth:`EndpointAdmission.admit
        <greenroom.actors.runtime.admission.EndpointAdmission.admit>`), wherever the
        endpoint is admitted now. Cancel-safe: a place granted meanwhile is given back."""
        while True:
            mode = self.mode
            if mode is Mode.STARTING:
                await self._changed.wait()
            elif mode is Mode.OWNER or mode is Mode.LOCAL:
                return await self.local.admit(
                    principal, session, input_tokens=input_tokens, output_tokens=output_tokens
                )
            else:
                permit = self._take_kept() or await self._ask_owner(
                    principal, session, input_tokens, output_tokens
                )
                if permit is not None:
                    return permit

    # -- places kept between requests -----------------------------------------------------

    def _take_kept(self) -> RequestPermit | None:
        """A kept place (the most recently used: the others age out), unless a pause is
        in force; else None."""
        if not self._kept or self.local.pause_remaining() > 0:
            return None
        kept = self._kept.take()
        if kept is None:
            return None
        owner = self._kept.owner
        return RequestPermit(
            _RemoteGrant(self, kept.number, owner=owner, keep_until=kept.until, again=True)
        )

    def place_ended(self, grant: _RemoteGrant) -> None:
        """``grant``'s request ended: keep its place for the next request when it may be
        kept, else give it back to the owner."""
        until = grant.keep_until
        if (
            until is not None
            and trio.current_time() < until
            and grant.owner == self._kept.owner
            and not self._kept.owner_busy
            and self.mode is Mode.REMOTE
            and not self._closing
            and self.local.pause_remaining() == 0
        ):
            self._kept.keep(grant.number, until)
        else:
            self.report("release", grant.number)

    @property
    def kept(self) -> int:
        """Places this host keeps now."""
        return len(self._kept)

    @property
    def kept_taken(self) -> int:
        """Requests admitted on a place kept from an earlier request (no NATS)."""
        return self._kept.taken

    async def _ask_owner(
        self, principal: str, session: str, input_tokens: int, output_tokens: int
    ) -> RequestPermit | None:
        """A place from the owner, or None when the mode changed meanwhile (ask again)."""
        number = next(self._numbers)
        message = json.dumps(
            {
                "op": "admit",
                "host": self.host_id,
                "run": self._run,
                "id": number,
                "principal": principal,
                "session": session,
                "input": input_tokens,
                "output": output_tokens,
            }
        ).encode()
        granted = False
        scope = trio.CancelScope()
        self._asking.add(scope)
        try:
            with scope:
                while self.mode is Mode.REMOTE:
                    changed = self._changed
                    answer, reply = await self._request(message)
                    if answer is _Answer.GRANTED:
                        granted = True
                        self.asked += 1
                        return RequestPermit(self._granted(number, reply))
                    # The run loop looks at the lease (is the owner gone?).
                    self._suspect.set()
                    self._kept.give_back_all()
                    if answer is _Answer.LATE:
                        # The owner may just have a long queue: asked again at once, the
                        # request keeps its place (and gets it at once if it was granted
                        # as the first ask gave up).
                        continue
                    # Nobody serves the endpoint: wait for the run loop's decision (or
                    # ask again a little later).
                    with trio.move_on_after(RETRY_S):
                        await changed.wait()
            return None
        finally:
            self._asking.discard(scope)
            if not granted:
                # The owner may have granted it as the ask ended: give it back.
                self.report("release", number)

    def _granted(self, number: int, reply: dict[str, Any]) -> _RemoteGrant:
        owner = str(reply.get("owner", ""))
        self._kept.heard(owner, reply.get("waiting"))
        keep = reply.get("keep") is True
        until = trio.current_time() + KEEP_FOR_S if keep else None
        return _RemoteGrant(self, number, owner=owner, keep_until=until)

    async def _request(self, message: bytes) -> tuple[_Answer, dict[str, Any]]:
        """Ask the owner to admit ``message``, for at most a lease TTL; what became of
        it, and the owner's answer when it was granted."""
        timeout = self._leases.ttl_s
        client = self._conn.client

        async def ask() -> tuple[_Answer, dict[str, Any]]:
            # Caught here: nats' TimeoutError is an OSError, which ``call`` would take
            # for a lost connection.
            try:
                msg = await client.request(self._subject, message, timeout=timeout)
            except nats.errors.NoRespondersError:
                return _Answer.NOBODY, {}
            except nats.errors.TimeoutError:
                return _Answer.LATE, {}
            try:
                reply = json.loads(msg.data)
            except ValueError:
                reply = None
            return _Answer.GRANTED, reply if isinstance(reply, dict) else {}

        try:
            return await self._conn.call(ask())
        except (ClusterUnavailable, nats.errors.Error):
            return _Answer.NOBODY, {}

    def report(self, op: str, number: int, **fields: Any) -> None:
        """Tell the owner what became of request ``number`` (a :class:`RequestPermit`
        granted by it, through its grant). Never blocks. Sent in any mode: while NATS is
        out of reach the client keeps what it publishes for when it is back (or drops it
        past its buffer)."""
        payload = json.dumps(
            {"op": op, "host": self.host_id, "run": self._run, "id": number, **fields}
        )
        with contextlib.suppress(trio.ClosedResourceError):
            self._outbox_send.send_nowait((self._subject, payload.encode()))

    def _publish_pause(self, seconds: float) -> None:
        with contextlib.suppress(trio.ClosedResourceError):
            self._outbox_send.send_nowait(
                (self._pauses, json.dumps({"for_s": seconds, "host": self.host_id}).encode())
            )

    # -- who admits -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Find who admits for the endpoint and keep finding out, until cancelled: claim
        its lease (owner), follow its owner (remote), or admit alone while NATS is out of
        reach (local). Sends the reports of this host's requests and mirrors the
        endpoint's pauses meanwhile."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_reports)
            nursery.start_soon(self._mirror_pauses)
            nursery.start_soon(self._kept.give_back_idle)
            task_status.started()
            while True:
                await self._find_owner()

    async def _find_owner(self) -> None:
        if self._closing:
            # The host closes: it does not take the endpoint back after giving it up.
            await trio.sleep_forever()
        if not self._conn.connected:
            self._enter(Mode.LOCAL, "NATS is out of reach")
            await trio.sleep(RETRY_S)
            return
        try:
            lease = await self._leases.claim(self.key, self.host_id)
        except ClusterUnavailable as exc:
            self._enter(Mode.LOCAL, str(exc))
            await trio.sleep(RETRY_S)
            return
        if lease is not None and self.closing:
            # Claimed while the host's close gave the endpoint up: give this lease up too,
            # or the other hosts wait a TTL for a host that no longer admits.
            with contextlib.suppress(ClusterError):
                await self._leases.release(lease)
            return
        if lease is not None:
            if not await self._own(lease):
                await trio.sleep(RETRY_S)
            return
        self._enter(Mode.REMOTE)
        await self._follow_owner()

    async def _own(self, lease: Lease) -> bool:
        """Admit for the cluster until the lease is lost (refused, or not renewed for a
        TTL) or the endpoint's subject can no longer be served; False when it could not
        be served at all."""
        self._held.lease = lease
        ended: list[str] = []
        served = False  # the host's close may cancel the start
        async with trio.open_nursery() as nursery:
            self._owning = nursery.cancel_scope
            desk = AdmissionDesk(self.local, nursery)
            if served := await nursery.start(self._serve, desk, nursery.cancel_scope, ended):
                self.local.on_pause = self._publish_pause
                self._enter(Mode.OWNER)
                nursery.start_soon(self._drop_lost_hosts, desk)
                ended.append(await self._held.keep())
            nursery.cancel_scope.cancel()
        self._owning = None
        self.local.on_pause = None
        desk.close()
        log(
            f"host {self.host_id} no longer admits for {self.identity} "
            f"({ended[0] if ended else 'the host closes'}); "
            "looking for who does"
        )
        await self.release_lease()
        return bool(served)

    @property
    def closing(self) -> bool:
        """Whether the host closes (:meth:`close` was called): it claims the lease no
        more."""
        return self._closing

    async def close(self) -> None:
        """The host closes: give the endpoint's lease up (see :meth:`release_lease`) and
        claim it no more."""
        self._closing = True
        self._kept.give_back_all()
        if self._owning is not None:
            # Stop admitting for the others now, not when the keeper next wakes.
            self._owning.cancel()
        await self.release_lease()

    async def release_lease(self) -> None:
        """Give the endpoint's lease up, if this host holds it (best effort), so that
        another host need not wait for its TTL."""
        await self._held.release()

    async def _serve(
        self,
        desk: AdmissionDesk,
        stop: trio.CancelScope,
        ended: list[str],
        *,
        task_status: trio.TaskStatus[bool] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Take the other hosts' messages to ``desk``; started with True once they reach
        it, or with False when the subject cannot be served. When serving ends, says why
        in ``ended`` and cancels ``stop``."""
        started = False
        try:
            async with self._conn.subscription(self._subject) as messages:
                task_status.started(True)
                started = True
                async for msg in messages:
                    try:
                        message = json.loads(msg.data)
                    except ValueError:
                        continue
                    if isinstance(message, dict):
                        desk.take(message, self._replier(msg) if msg.reply else None)
            ended.append("the connection to NATS closed")
        except ClusterUnavailable as exc:
            ended.append(str(exc))
        if not started:
            task_status.started(False)
        stop.cancel()

    def _replier(self, msg: Msg) -> Reply:
        subject = msg.reply

        def reply(answer: dict[str, Any]) -> None:
            # Sent with the reports, many in one crossing of the bridge.
            data = json.dumps({"owner": self.host_id, **answer}).encode()
            with contextlib.suppress(trio.ClosedResourceError):
                self._outbox_send.send_nowait((subject, data))

        return reply

    async def _drop_lost_hosts(self, desk: AdmissionDesk) -> None:
        while True:
            await trio.sleep(self._leases.ttl_s)
            if desk.holds:
                with contextlib.suppress(ClusterError):
                    desk.drop_lost_hosts(await self._live_hosts())

    async def _follow_owner(self) -> None:
        """Return when the owner seems gone: an ask found nobody and the lease is free,
        or NATS is out of reach."""
        while True:
            await self._suspect.wait()
            self._suspect = trio.Event()
            if not self._conn.connected:
                return
            try:
                holder = await self._leases.holder(self.key)
            except ClusterUnavailable:
                return
            if holder is None:
                return

    def _enter(self, mode: Mode, reason: str = "") -> None:
        if mode is self.mode:
            return
        if mode is Mode.LOCAL:
            log(
                f"host {self.host_id} admits its own requests to {self.identity} alone, under "
                f"its own limits, until NATS answers ({reason})"
            )
        elif self.mode is Mode.LOCAL:
            log(f"host {self.host_id} admits requests to {self.identity} with the cluster again")
        self.mode = mode
        self._kept.give_back_all()
        for scope in self._asking:
            scope.cancel()
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def _send_reports(self) -> None:
        """Publish the outbox, a batch per crossing of the bridge."""
        client = self._conn.client
        async with self._outbox:
            async for first in self._outbox:
                batch = [first]
                with contextlib.suppress(trio.WouldBlock):
                    while len(batch) < 256:
                        batch.append(self._outbox.receive_nowait())

                async def publish(batch: list[tuple[str, bytes]] = batch) -> None:
                    for subject, payload in batch:
                        await client.publish(subject, payload)

                with contextlib.suppress(ClusterUnavailable, nats.errors.Error):
                    await self._conn.call(publish())

    async def _mirror_pauses(self) -> None:
        """Pause this host's admission as the owner says (its own included: no harm)."""
        while True:
            try:
                async with self._conn.subscription(self._pauses) as messages:
                    async for msg in messages:
                        with contextlib.suppress(ValueError, TypeError, KeyError):
                            self.local.pause_for(float(json.loads(msg.data)["for_s"]))
                        # The owner learns a window anew: it gets its places back.
                        self._kept.give_back_all()
            except ClusterUnavailable:
                pass
            await trio.sleep(RETRY_S)
