"""Session ownership: one lease per session in a JetStream KV bucket with a TTL (R-CLUSTER-1).

The bucket maps session id → the owning host. A host *claims* a session with ``create``
(which succeeds only when no live lease exists), *renews* it with a compare-and-set
``update`` on the revision it last wrote, and *releases* it with a compare-and-set delete.
The bucket's TTL (JetStream ``max_age``) removes a lease nobody renewed: a dead or stalled
host's sessions become claimable after at most the TTL. A renewal after that point fails
(the revision it names is gone), so a host that wakes up from a stall learns it lost the
lease instead of believing it still owns the session.

:class:`LeaseTable` is the bucket; :class:`LeaseKeeper` is the actor that renews a host's
leases every third of the TTL and reports each one it loses (callback), so the host can stop
that session's tasks. A lease whose renewals keep failing for a whole TTL (NATS unreachable)
is given up too: by then the server may have expired it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import attrs
import nats.js.errors
import trio

from greenroom.actors.cluster.connection import Connection, check_session_id
from greenroom.actors.cluster.errors import ClusterUnavailable, LeaseLost

__all__ = ["Lease", "LeaseKeeper", "LeaseTable"]


@attrs.frozen(kw_only=True)
class Lease:
    """``host_id``'s ownership of ``session_id`` as of KV revision ``revision``."""

    session_id: str
    host_id: str
    revision: int


class LeaseTable:
    """The lease bucket. Use :meth:`open`."""

    def __init__(self, conn: Connection, kv: nats.js.kv.KeyValue, ttl_s: float) -> None:
        self._conn = conn
        self._kv = kv
        self.ttl_s = ttl_s

    @classmethod
    async def open(cls, conn: Connection, *, ttl_s: float, bucket: str | None = None) -> LeaseTable:
        """Bind the cluster's lease bucket (or ``bucket``: leases on something else than
        sessions, such as a provider endpoint's admission), creating it with TTL ``ttl_s``
        if it does not exist. Every host of a cluster must use the same TTL; a bucket that
        exists with another TTL keeps its own (it is the bucket's TTL that expires
        leases)."""
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"the lease TTL must be a positive number of seconds, not {ttl_s}")
        kv = await open_bucket(conn, bucket or conn.names.leases, ttl_s=ttl_s)
        status = await conn.call(kv.status())
        bucket_ttl = status.stream_info.config.max_age
        return cls(conn, kv, float(bucket_ttl) if bucket_ttl else ttl_s)

    async def claim(self, session_id: str, host_id: str) -> Lease | None:
        """Take ``session_id`` for ``host_id`` if no live lease exists; None when another
        host (or this one, under an older lease) holds it."""
        check_session_id(session_id)
        for _ in range(2):
            try:
                revision = await self._conn.call(self._kv.create(session_id, _value(host_id)))
            except nats.js.errors.KeyWrongLastSequenceError:
                return None
            except nats.js.errors.KeyNotFoundError:
                # ``create`` found a lease, then looked it up to see whether it was deleted,
                # and it had expired in between: nobody holds it now, so claim again. (The
                # gap between the two requests widens on a busy machine.)
                continue
            except nats.js.errors.APIError as exc:
                raise ClusterUnavailable(f"cannot claim session {session_id}: {exc}") from exc
            return Lease(session_id=session_id, host_id=host_id, revision=revision)
        return None

    async def renew(self, lease: Lease) -> Lease:
        """Extend ``lease`` by a TTL. Raises :class:`LeaseLost` when it expired or another
        host holds the session now."""
        try:
            revision = await self._conn.call(
                self._kv.update(lease.session_id, _value(lease.host_id), last=lease.revision)
            )
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise LeaseLost(lease.session_id) from exc
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot renew session {lease.session_id}: {exc}") from exc
        return attrs.evolve(lease, revision=revision)

    async def release(self, lease: Lease) -> None:
        """Give ``lease`` up now (so another host need not wait for the TTL). Does nothing
        when the lease is already gone or another host holds the session."""
        revision = lease.revision
        for _ in range(2):
            try:
                await self._conn.call(self._kv.delete(lease.session_id, last=revision))
                return
            except nats.js.errors.APIError as exc:
                # A delete at a stale revision is refused as a bad request (the client
                # does not map it to KeyWrongLastSequenceError as it does for update).
                if not _wrong_last_sequence(exc):
                    raise ClusterUnavailable(
                        f"cannot release session {lease.session_id}: {exc}"
                    ) from exc
            # A renewal of this host's that was on its way landed first and moved the
            # revision on: the lease is still ours, then, and stayed until its TTL (a
            # drain's hand-over found it held and had to wait for the orphan scan).
            found = await self._entry(lease.session_id)
            if found is None or found.revision is None:
                return
            if _host_of(found.value) != lease.host_id:
                return
            revision = found.revision

    async def _entry(self, session_id: str) -> nats.js.kv.KeyValue.Entry | None:
        try:
            return await self._conn.call(self._kv.get(check_session_id(session_id)))
        except nats.js.errors.KeyNotFoundError:
            return None
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot read the lease of {session_id}: {exc}") from exc

    async def holder(self, session_id: str) -> str | None:
        """The host that holds ``session_id`` now, or None when nobody does."""
        entry = await self._entry(session_id)
        return None if entry is None else _host_of(entry.value)


_WRONG_LAST_SEQUENCE = (10071, 10164)
"""JetStream's error codes for a write that names a revision that is not the last."""


def _wrong_last_sequence(exc: nats.js.errors.APIError) -> bool:
    return (
        isinstance(exc, nats.js.errors.KeyWrongLastSequenceError)
        or exc.err_code in _WRONG_LAST_SEQUENCE
    )


def _value(host_id: str) -> bytes:
    return json.dumps({"host": host_id}).encode()


def _host_of(value: bytes | None) -> str | None:
    try:
        decoded = json.loads(value or b"")
    except ValueError:
        return None
    host = decoded.get("host") if isinstance(decoded, dict) else None
    return host if isinstance(host, str) else None


async def open_bucket(conn: Connection, bucket: str, *, ttl_s: float | None) -> nats.js.kv.KeyValue:
    """Bind KV ``bucket``, creating it (with ``ttl_s``, None for none) if it is missing."""
    try:
        return await conn.call(conn.js.key_value(bucket))
    except nats.js.errors.BucketNotFoundError:
        pass
    except nats.js.errors.APIError as exc:
        raise ClusterUnavailable(f"cannot open bucket {bucket}: {exc}") from exc
    try:
        return await conn.call(conn.js.create_key_value(bucket=bucket, ttl=ttl_s, history=1))
    except nats.js.errors.APIError as exc:
        # Another host created it between our two calls: bind that one.
        try:
            return await conn.call(conn.js.key_value(bucket))
        except nats.js.errors.APIError:
            raise ClusterUnavailable(f"cannot create bucket {bucket}: {exc}") from exc


@attrs.define
class _Held:
    lease: Lease
    renewed_at: float


class LeaseKeeper:
    """Renews a host's leases and reports the ones it loses.

    ``on_lost(session_id, reason)`` is called (from the keeper's task, at most once per
    lease) when a renewal is refused, or when no renewal succeeded for a whole TTL. Leases
    are added with :meth:`hold` after a successful claim and dropped with :meth:`release`.
    """

    def __init__(
        self,
        table: LeaseTable,
        on_lost: Callable[[str, str], None],
        *,
        renew_every_s: float | None = None,
    ) -> None:
        self._table = table
        self._on_lost = on_lost
        self._every = renew_every_s if renew_every_s is not None else table.ttl_s / 3
        self._held: dict[str, _Held] = {}

    def hold(self, lease: Lease) -> None:
        """Keep ``lease`` renewed from now on."""
        self._held[lease.session_id] = _Held(lease, trio.current_time())

    def lease(self, session_id: str) -> Lease | None:
        """The current lease on ``session_id``, if this keeper holds it."""
        held = self._held.get(session_id)
        return held.lease if held else None

    def held(self) -> tuple[str, ...]:
        """The sessions whose leases this keeper holds."""
        return tuple(self._held)

    async def release(self, session_id: str) -> None:
        """Stop renewing ``session_id`` and release its lease (best effort)."""
        held = self._held.pop(session_id, None)
        if held is None:
            return
        try:
            await self._table.release(held.lease)
        except ClusterUnavailable:
            return

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew every held lease each ``renew_every_s`` until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self._every)
            await self.renew_all()

    async def renew_all(self) -> None:
        """One round of renewals, concurrently; losses are reported before it returns."""
        async with trio.open_nursery() as nursery:
            for session_id in list(self._held):
                nursery.start_soon(self._renew_one, session_id)

    async def _renew_one(self, session_id: str) -> None:
        held = self._held.get(session_id)
        if held is None:
            return
        now = trio.current_time()
        if now - held.renewed_at >= self._table.ttl_s:
            # A stall (SIGSTOP, a blocked loop) outlived the lease: it may be someone
            # else's by now, whatever a renewal would say.
            self._lose(session_id, held, f"no renewal for {now - held.renewed_at:.1f} s")
            return
        try:
            lease = await self._table.renew(held.lease)
        except LeaseLost:
            self._lose(session_id, held, "the renewal was refused")
            return
        except ClusterUnavailable:
            return
        if self._held.get(session_id) is held:
            self._held[session_id] = _Held(lease, now)

    def _lose(self, session_id: str, held: _Held, reason: str) -> None:
        if self._held.get(session_id) is held:
            del self._held[session_id]
            self._on_lost(session_id, reason)
