"""Session ownership: which host runs each session, valid while that host's own lease lives
(R-CLUSTER-1..2).

Two JetStream KV buckets:

* ``host_leases`` (with the lease TTL): host id → the host's *incarnation*, a random token
  it chose when it took its lease. The host renews this one key every third of the TTL with
  a compare-and-set on the revision it last wrote; the bucket's TTL removes it when nobody
  renews it.
* ``owners`` (no TTL): session id → the host id and incarnation that own the session.

A session's ownership is live while its owner's host lease holds the incarnation it names.
So a host renews one key whatever its number of sessions: thousands of sessions on a busy
host cannot make its renewals fall behind, which per-session leases did (a saturated host
lost them all at once, and another host fenced sessions whose owner had not yet noticed).
A host that dies or stalls past the TTL loses every session at once; another host claims
each (compare-and-set on the owner entry, so one claim wins) and fences its trace.

:class:`SessionOwners` is the table (claim, release, who holds a session, which sessions
nobody holds); :class:`OwnershipKeeper` is the actor that holds this host's lease and the
sessions it owns, and reports every one of them lost (callback) when the lease is: a
renewal refused (the key expired or was replaced: after a stall, or a renewal that took
longer than the TTL), or NATS unreachable for a TTL since the last renewal that succeeded
was sent. It then takes a lease under a new incarnation, so the sessions it gave up can be
claimed again, by any host.

A renewal that takes long is waited for, not cut off: its compare-and-set succeeds only
if the key never expired, which proves that no other host could claim a session meanwhile;
and while the answer is on its way the sessions' appends are fenced anyway (a host that
claims a session fences its trace first), so nothing the host writes can count twice. The
host's lease goes over a connection of its own (``lease_conn``), so its renewals do not
queue behind the sessions' trace appends and claims.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Iterable

import attrs
import nats.js.errors
import nats.js.kv
import trio

from greenroom.actors.cluster.connection import Connection, check_session_id
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.leases import bucket_entries, open_bucket, wrong_last_sequence

__all__ = ["Ownership", "OwnershipKeeper", "SessionOwners"]


@attrs.frozen(kw_only=True)
class Ownership:
    """``host_id`` (in incarnation ``token``) owns ``session_id`` as of KV revision
    ``revision`` of its owner entry."""

    session_id: str
    host_id: str
    token: str
    revision: int


@attrs.frozen
class _Owner:
    host_id: str
    token: str

    def to_json(self) -> bytes:
        return json.dumps({"host": self.host_id, "token": self.token}).encode()

    @classmethod
    def from_json(cls, value: bytes | None) -> _Owner | None:
        try:
            decoded = json.loads(value or b"")
        except ValueError:
            return None
        if not isinstance(decoded, dict):
            return None
        host, token = decoded.get("host"), decoded.get("token")
        return cls(host, token) if isinstance(host, str) and isinstance(token, str) else None


class SessionOwners:
    """The owner entries and the host leases they depend on. Use :meth:`open`."""

    def __init__(
        self,
        conn: Connection,
        owners: nats.js.kv.KeyValue,
        host_leases: nats.js.kv.KeyValue,
        ttl_s: float,
        *,
        lease_conn: tuple[Connection, nats.js.kv.KeyValue] | None = None,
    ) -> None:
        self._conn = conn
        self._owners = owners
        self._host_leases = host_leases
        self.ttl_s = ttl_s
        self._lease_conn, self._lease_kv = lease_conn or (conn, host_leases)

    @classmethod
    async def open(
        cls, conn: Connection, *, ttl_s: float, lease_conn: Connection | None = None
    ) -> SessionOwners:
        """Bind the cluster's two buckets, creating them when missing (the host leases with
        TTL ``ttl_s``); the host's own lease is taken and renewed over ``lease_conn``
        (default: ``conn``). Every host of a cluster must use the same TTL; a bucket that
        exists with another TTL keeps its own (it is the bucket's TTL that expires
        leases)."""
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"the lease TTL must be a positive number of seconds, not {ttl_s}")
        host_leases = await open_bucket(conn, conn.names.host_leases, ttl_s=ttl_s)
        owners = await open_bucket(conn, conn.names.owners, ttl_s=None)
        status = await conn.call(host_leases.status())
        bucket_ttl = status.stream_info.config.max_age
        own = None
        if lease_conn is not None:
            own = (lease_conn, await open_bucket(lease_conn, conn.names.host_leases, ttl_s=ttl_s))
        ttl = float(bucket_ttl) if bucket_ttl else ttl_s
        return cls(conn, owners, host_leases, ttl, lease_conn=own)

    # -- host leases ----------------------------------------------------------------------

    async def take_host_lease(self, host_id: str, token: str) -> int:
        """Make ``token`` ``host_id``'s incarnation (whatever was there: a host id is one
        process, and an earlier incarnation's sessions become claimable at once); the
        revision written."""
        return int(
            await self._lease_conn.call_api(
                self._lease_kv.put(check_session_id(host_id), token.encode()),
                f"take the lease of host {host_id}",
            )
        )

    async def renew_host_lease(self, host_id: str, token: str, revision: int) -> int | None:
        """Extend ``host_id``'s lease written at ``revision``; the new revision, or None
        when it expired or was replaced since."""
        try:
            return int(
                await self._lease_conn.call(
                    self._lease_kv.update(host_id, token.encode(), last=revision)
                )
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot renew the lease of host {host_id}: {exc}") from exc

    async def drop_host_lease(self, host_id: str) -> None:
        """Delete ``host_id``'s lease: every session it owns is claimable at once."""
        await self._lease_conn.call_api(
            self._lease_kv.delete(host_id), f"drop the lease of host {host_id}"
        )

    async def _incarnation(self, host_id: str) -> str | None:
        entry = await _get(self._conn, self._host_leases, host_id)
        return None if entry is None or entry.value is None else entry.value.decode()

    async def live_hosts(self) -> dict[str, str]:
        """Every host whose lease lives, with its incarnation."""
        found = await bucket_entries(self._conn, self._conn.names.host_leases)
        return {host_id: token.decode() for host_id, token in found.items() if token}

    # -- sessions -------------------------------------------------------------------------

    async def claim(
        self, session_id: str, host_id: str, token: str, *, left: Ownership | None = None
    ) -> Ownership | None:
        """Take ``session_id`` for ``host_id`` in incarnation ``token`` if no live host owns
        it; None when one does (this one included) — unless the entry is still ``left``,
        this host's own ownership that it gave up but could not release: taken back."""
        check_session_id(session_id)
        mine = _Owner(host_id, token).to_json()
        for _ in range(3):
            # A new session has no entry: one request claims it.
            revision = await self._write(session_id, mine, None)
            if revision is None:
                entry = await _get(self._conn, self._owners, session_id)
                if entry is None:
                    continue  # deleted since: create it
                owner = _Owner.from_json(entry.value)
                ours = left is not None and entry.revision == left.revision
                if (
                    not ours
                    and owner is not None
                    and await self._incarnation(owner.host_id) == owner.token
                ):
                    return None
                revision = await self._write(session_id, mine, entry.revision)
            if revision is not None:
                return Ownership(
                    session_id=session_id, host_id=host_id, token=token, revision=revision
                )
            # Another claim (or a delete) landed between the read and the write.
        return None

    async def _write(self, session_id: str, value: bytes, last: int | None) -> int | None:
        """Create the owner entry (``last`` None) or replace the one at revision ``last``;
        None when the entry is not as expected."""
        try:
            if last is None:
                return int(await self._conn.call(self._owners.create(session_id, value)))
            return int(await self._conn.call(self._owners.update(session_id, value, last=last)))
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            return None
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot claim session {session_id}: {exc}") from exc

    async def release(self, ownership: Ownership) -> None:
        """Give ``ownership`` up now. Does nothing when another host owns the session."""
        try:
            await self._conn.call(
                self._owners.delete(ownership.session_id, last=ownership.revision)
            )
        except nats.js.errors.APIError as exc:
            # A delete at a stale revision is refused as a bad request: someone else
            # claimed the session since, and it is theirs.
            if not wrong_last_sequence(exc):
                raise ClusterUnavailable(
                    f"cannot release session {ownership.session_id}: {exc}"
                ) from exc

    async def holder(self, session_id: str) -> str | None:
        """The host that owns ``session_id`` now, or None when no live host does."""
        entry = await _get(self._conn, self._owners, check_session_id(session_id))
        owner = None if entry is None else _Owner.from_json(entry.value)
        if owner is None or await self._incarnation(owner.host_id) != owner.token:
            return None
        return owner.host_id

    async def unowned(
        self, session_ids: Iterable[str], *, live: dict[str, str] | None = None
    ) -> list[str]:
        """Those of ``session_ids`` that no live host owns, given the ``live`` hosts
        (:meth:`live_hosts`, read here when None)."""
        session_ids = list(session_ids)
        owned = await self.live_owners(session_ids, live=live)
        return [session_id for session_id in session_ids if session_id not in owned]

    async def live_owners(
        self, session_ids: Iterable[str], *, live: dict[str, str] | None = None
    ) -> dict[str, str]:
        """The host that owns each of ``session_ids`` that a live host owns, given the
        ``live`` hosts (:meth:`live_hosts`, read here when None)."""
        live = await self.live_hosts() if live is None else live
        found = {}
        for session_id in session_ids:
            entry = await _get(self._conn, self._owners, check_session_id(session_id))
            owner = None if entry is None else _Owner.from_json(entry.value)
            if owner is not None and live.get(owner.host_id) == owner.token:
                found[session_id] = owner.host_id
        return found


async def _get(
    conn: Connection, kv: nats.js.kv.KeyValue, key: str
) -> nats.js.kv.KeyValue.Entry | None:
    try:
        return await conn.call(kv.get(key))
    except nats.js.errors.KeyNotFoundError:  # absent, deleted or expired
        return None
    except nats.js.errors.APIError as exc:
        raise ClusterUnavailable(f"cannot read {key}: {exc}") from exc


class OwnershipKeeper:
    """Holds this host's lease and the sessions it owns; reports them lost with it.

    ``on_lost(session_id, reason)`` is called from the keeper's task, at most once per
    ownership, for every owned session when the host's lease is lost (see the module
    docstring). Sessions are taken with :meth:`claim` and given up with :meth:`release`.
    """

    def __init__(
        self,
        owners: SessionOwners,
        host_id: str,
        on_lost: Callable[[str, str], None],
        *,
        renew_every_s: float | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._owners = owners
        self.host_id = host_id
        self._on_lost = on_lost
        self._warn = warn
        self._every = renew_every_s if renew_every_s is not None else owners.ttl_s / 3
        self._held: dict[str, Ownership] = {}
        self._unreleased: dict[str, Ownership] = {}
        """Sessions given up whose release NATS did not take: their entries still name this
        incarnation (nobody else may claim them), so they are released again at each
        renewal, and taken back by a claim here."""
        self._token: str | None = None
        self._leased = trio.Event()
        self._revision = 0
        self._renewed_sent = -math.inf

    @property
    def incarnation(self) -> str | None:
        """The token of this host's current lease (None while it has none)."""
        return self._token

    async def take_lease(self) -> None:
        """Take this host's lease under a new incarnation."""
        token = secrets.token_hex(8)
        sent = trio.current_time()
        self._revision = await self._owners.take_host_lease(self.host_id, token)
        self._token, self._renewed_sent = token, sent
        self._leased.set()

    async def claim(self, session_id: str) -> Ownership | None:
        """Own ``session_id`` if no live host does; None when one does (this one too).
        Waits (up to a TTL) while this host has no lease: it is being taken, at start or
        after a loss; raises :class:`ClusterUnavailable` when none is taken by then."""
        with trio.move_on_after(self._owners.ttl_s):
            await self._leased.wait()
        token = self._token
        if token is None:
            raise ClusterUnavailable(f"host {self.host_id} holds no lease now")
        left = self._unreleased.pop(session_id, None)
        ownership = await self._owners.claim(session_id, self.host_id, token, left=left)
        if ownership is None:
            return None
        if token != self._token:
            # The lease was lost while the claim was on its way: the entry names a dead
            # incarnation, and the session is nobody's.
            raise ClusterUnavailable(f"host {self.host_id} lost its lease during the claim")
        self._held[session_id] = ownership
        return ownership

    def holds(self, ownership: Ownership) -> bool:
        """Whether ``ownership`` (what :meth:`claim` returned) is still this host's: not
        released, nor lost with the host's lease since."""
        return self._held.get(ownership.session_id) is ownership

    def held(self) -> tuple[str, ...]:
        """The sessions this host owns."""
        return tuple(self._held)

    async def release(self, session_id: str) -> None:
        """Give ``session_id`` up; when NATS cannot be reached, again at each renewal."""
        ownership = self._held.pop(session_id, None)
        if ownership is None:
            return
        try:
            await self._owners.release(ownership)
        except ClusterUnavailable:
            self._unreleased[session_id] = ownership

    async def _release_again(self) -> None:
        for session_id, ownership in list(self._unreleased.items()):
            try:
                await self._owners.release(ownership)
            except ClusterUnavailable:
                return  # at the next renewal
            if self._unreleased.get(session_id) is ownership:
                del self._unreleased[session_id]

    async def release_all(self) -> None:
        """Give every session up at once by dropping the host's lease (a clean shutdown)."""
        self._held.clear()
        self._unreleased.clear()
        self._token, self._leased = None, trio.Event()
        await self._owners.drop_host_lease(self.host_id)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take the lease, then renew it every ``renew_every_s`` until cancelled (taking a
        new one after a loss)."""
        await self.take_lease()
        task_status.started()
        while True:
            await trio.sleep(self._every)
            await self.renew()

    async def renew(self) -> None:
        """One renewal: extend the lease, or report every session lost when it cannot be
        (and try to take a new lease)."""
        token = self._token
        if token is None:
            await self._retake()
            return
        sent = trio.current_time()
        try:
            revision = await self._owners.renew_host_lease(self.host_id, token, self._revision)
        except ClusterUnavailable as exc:
            silent = trio.current_time() - self._renewed_sent
            if silent >= self._owners.ttl_s:
                # Others may have found the lease expired and claimed the sessions.
                self._lose_all(f"no renewal for {silent:.1f} s: {exc}")
                await self._retake()
            return  # again at the next tick
        if token != self._token:
            return  # given up meanwhile (release_all)
        since = trio.current_time() - self._renewed_sent
        if revision is None:
            self._lose_all(f"the renewal was refused, {since:.1f} s after the last one was sent")
            await self._retake()
            return
        if since > self._owners.ttl_s * 2 / 3 and self._warn is not None:
            # Renewed, but with little to spare: an operator should know before it is lost.
            self._warn(
                f"host {self.host_id} renewed its lease {since:.1f} s after the last renewal "
                f"was sent (TTL {self._owners.ttl_s:g} s): the host is too busy to renew in time"
            )
        self._revision, self._renewed_sent = revision, sent
        if self._unreleased:
            await self._release_again()

    def _lose_all(self, reason: str) -> None:
        # Entries that name a lost incarnation are nobody's: nothing is left to release.
        self._token, self._leased, self._unreleased = None, trio.Event(), {}
        lost, self._held = self._held, {}
        for session_id in lost:
            self._on_lost(session_id, reason)

    async def _retake(self) -> None:
        try:
            await self.take_lease()
        except ClusterUnavailable:
            return  # again at the next tick
