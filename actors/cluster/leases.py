"""Leases with a TTL in a JetStream KV bucket: one host at a time holds a key (a provider
endpoint's admission, :mod:`.admission`). Sessions are owned through the host's own lease
instead (:mod:`.ownership`), so that a host renews one key whatever its number of sessions.

The bucket maps a key → the holding host. A host *claims* a key with ``create``
(which succeeds only when no live lease exists), *renews* it with a compare-and-set
``update`` on the revision it last wrote, and *releases* it with a compare-and-set delete.
The bucket's TTL (JetStream ``max_age``) removes a lease nobody renewed: a dead or stalled
host's keys become claimable after at most the TTL. A renewal after that point fails
(the revision it names is gone), so a host that wakes up from a stall learns it lost the
lease instead of believing it still holds it.

:func:`open_bucket` binds (or creates) any of the cluster's KV buckets.
"""

from __future__ import annotations

import json
import math

import attrs
import nats.errors
import nats.js.api
import nats.js.errors
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from greenroom.actors.cluster.connection import Connection, check_session_id
from greenroom.actors.cluster.errors import ClusterUnavailable, LeaseLost

__all__ = [
    "BucketPass",
    "Lease",
    "LeaseTable",
    "bucket_entries",
    "bucket_keys",
    "bucket_prefix",
    "open_bucket",
    "removed_entry",
    "wrong_last_sequence",
]


@attrs.frozen(kw_only=True)
class Lease:
    """``host_id``'s hold of key ``session_id`` as of KV revision ``revision``."""

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
    async def open(cls, conn: Connection, *, ttl_s: float, bucket: str) -> LeaseTable:
        """Bind the lease bucket ``bucket``, creating it with TTL ``ttl_s`` if it does not
        exist. Every host of a cluster must use the same TTL; a bucket that
        exists with another TTL keeps its own (it is the bucket's TTL that expires
        leases)."""
        if not ttl_s > 0 or not math.isfinite(ttl_s):
            raise ValueError(f"the lease TTL must be a positive number of seconds, not {ttl_s}")
        kv = await open_bucket(conn, bucket, ttl_s=ttl_s)
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
                if not wrong_last_sequence(exc):
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


def wrong_last_sequence(exc: nats.js.errors.APIError) -> bool:
    """Whether ``exc`` refused a write for naming a revision that is not the last."""
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


_MARKER_REASON = "Nats-Marker-Reason"
"""The header of the marker nats-server (2.11 and later) leaves where a key expired or was
removed; named here because older nats-py releases do not."""

LIST_WAIT_S = 5.0
"""How long a bucket listing waits for the server's next entry before giving up."""


async def bucket_keys(conn: Connection, bucket: str) -> list[str]:
    """Every live key of KV bucket ``bucket``."""
    return list((await _last_per_key(conn, bucket, values=False)).live)


async def bucket_entries(conn: Connection, bucket: str) -> dict[str, bytes]:
    """Every live key of KV bucket ``bucket`` with its value, as of one pass over it."""
    return (await _last_per_key(conn, bucket, values=True)).live


@attrs.frozen(kw_only=True)
class BucketPass:
    """What one pass over a KV bucket read: ``live``, each live key with its value;
    ``removed``, each key whose last entry is a delete marker (the key was written, then
    deleted or purged); ``whole``, whether the pass read the whole bucket."""

    live: dict[str, bytes]
    removed: frozenset[str]
    whole: bool


async def bucket_prefix(conn: Connection, bucket: str, limit: int) -> BucketPass:
    """One pass over the first ``limit`` entries of ``bucket`` (oldest writes first): a
    listing a caller asks for on demand holds no more than it can send."""
    return await _last_per_key(conn, bucket, values=True, limit=limit)


async def _last_per_key(
    conn: Connection, bucket: str, *, values: bool, limit: int | None = None
) -> BucketPass:
    """The last entry of each key of ``bucket``, in one consumer pass (stopped after
    ``limit`` entries, if given): the live keys, the removed ones, and whether the pass
    read them all.

    nats-py's ``KeyValue.keys()`` decides that a listing is empty when the consumer reports
    nothing pending before the client has parsed a message; the server can send that answer
    ahead of the messages it already delivered, and the listing then comes back empty with
    keys in the bucket. Here the end is the server's own count: the entry delivered with
    nothing pending after it, or a consumer that has delivered nothing and has nothing to.
    Its consumer is deleted at the end; should that fail, the server drops it once idle
    for :data:`LIST_WAIT_S`.
    """
    prefix = f"$KV.{bucket}."

    async def listing() -> BucketPass:
        sub = await conn.js.subscribe(
            f"{prefix}>",
            stream=f"KV_{bucket}",
            ordered_consumer=True,
            deliver_policy=nats.js.api.DeliverPolicy.LAST_PER_SUBJECT,
            headers_only=not values,
            inactive_threshold=LIST_WAIT_S,
        )
        info = await sub.consumer_info()
        try:
            found: dict[str, bytes] = {}
            removed: set[str] = set()
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return BucketPass(live=found, removed=frozenset(), whole=True)
            read = 0
            while True:
                msg = await sub.next_msg(timeout=LIST_WAIT_S)
                key = msg.subject[len(prefix) :]
                if removed_entry(msg.headers):
                    found.pop(key, None)
                    removed.add(key)
                else:
                    found[key] = msg.data or b""
                    removed.discard(key)
                if msg.metadata.num_pending == 0:
                    return BucketPass(live=found, removed=frozenset(removed), whole=True)
                read += 1
                if limit is not None and read >= limit:
                    return BucketPass(live=found, removed=frozenset(removed), whole=False)
        finally:
            await conn.close_consumer(sub, info)

    try:
        return await conn.call(listing())
    except nats.errors.TimeoutError as exc:
        raise ClusterUnavailable(
            f"cannot list bucket {bucket}: no entry from the server in {LIST_WAIT_S:g} s"
        ) from exc
    except nats.js.errors.APIError as exc:
        raise ClusterUnavailable(f"cannot list bucket {bucket}: {exc}") from exc


def removed_entry(headers: dict[str, str] | None) -> bool:
    """Whether a KV message (by its ``headers``) marks its key deleted, purged or
    expired."""
    if not headers:
        return False
    return headers.get(KV_OP) in (KV_DEL, KV_PURGE) or _MARKER_REASON in headers
