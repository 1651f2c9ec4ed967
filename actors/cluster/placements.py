"""What the cluster remembers of a ``session.create`` one gateway placed on another host,
so that a placement its gateway withdrew leaves no session even when the host it was
placed on dies or stalls (R-CLUSTER-1, R-SEC-9).

A placed create carries a placement id (:mod:`.router`). The session made for it carries
that id in its directory entry (:data:`PLACEMENT_FIELD`, from its first entry on: the
host learns it while the session is created, :func:`placing`), until its first task
starts: by then its client knows it, so it was not withdrawn. A gateway that gives up on
the host it placed a create on records the withdrawal in the KV bucket
``greenroom_placements`` (:class:`PlacementRecords`) before it withdraws the placement
there. A host that takes such a session up — an orphan after its host's lease went, a
closed session a call opens again, a hand-over — records that it keeps it instead; one
compare-and-set decides between the two, so exactly one happens:

* withdrawn first: the session is deleted from the cluster instead of being taken up;
* kept first: the gateway's client is answered with that session (its host died after
  making it; another took it over) and no second one is made.

The host it was placed on, which stopped or died before it took the withdrawal up,
deletes the copy its data dir holds of a session deleted so when it starts again, as of
any session deleted while it was away (:mod:`.deleted_copies`); a host that takes up such
a session of its own data dir deletes that copy with it.

A session whose entry carries no placement (made here, or placed and then run) is taken
up as before, with no request more. The records expire after
:data:`PLACEMENT_RECORD_TTL_S`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import nats.js.errors
import nats.js.kv

from greenroom.actors.cluster.connection import Connection, check_session_id
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.leases import open_bucket

__all__ = [
    "PLACEMENT_FIELD",
    "PLACEMENT_RECORD_TTL_S",
    "PlacementRecords",
    "placement_of",
    "placing",
    "withdrawn",
]

PLACEMENT_FIELD = "placement"
"""The directory entry's field naming the placement its session was made for."""

PLACEMENT_RECORD_TTL_S = 24 * 3600.0
"""How long a withdrawal (or a kept placement) is remembered: far longer than a session
waits to be taken over once its host is gone, while some host of the cluster lives."""


@attrs.define
class _Placing:
    placement: str
    session_id: str | None = None


_PLACING: contextvars.ContextVar[_Placing | None] = contextvars.ContextVar(
    "greenroom_placing", default=None
)


@contextlib.contextmanager
def placing(placement: str) -> Iterator[None]:
    """Within this block (this task), the session created is made for ``placement``."""
    token = _PLACING.set(_Placing(placement))
    try:
        yield
    finally:
        _PLACING.reset(token)


def placement_of(session_id: str) -> str | None:
    """The placement ``session_id`` is made for, when it is created within
    :func:`placing`: the first session seen there (a task started meanwhile inherits the
    block, and the sessions it makes later are not the placed one)."""
    current = _PLACING.get()
    if current is None or current.session_id not in (None, session_id):
        return None
    current.session_id = session_id
    return current.placement


class PlacementRecords:
    """Placement id → ``{"withdrawn": true}`` or ``{"kept": session_id}``, whichever was
    written first (the bucket is opened on first use)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._kv: nats.js.kv.KeyValue | None = None

    async def withdraw(self, placement: str) -> str | None:
        """Record ``placement`` withdrawn; the session made for it when a host kept it
        first (the client's session then), else None. Raises :class:`ClusterUnavailable`."""
        decided = await self._decide(placement, {"withdrawn": True})
        kept = decided.get("kept")
        return kept if isinstance(kept, str) else None

    async def keep(self, placement: str, session_id: str) -> bool:
        """Record ``session_id``, made for ``placement``, kept; False when the placement
        was withdrawn first (the session is to be deleted). Raises
        :class:`ClusterUnavailable`."""
        return (await self._decide(placement, {"kept": session_id})).get("withdrawn") is not True

    async def withdrawn_among(self, placements: Iterable[str]) -> frozenset[str]:
        """Those of ``placements`` recorded withdrawn, read without recording anything.
        Raises :class:`ClusterUnavailable`."""
        found = set()
        for placement in placements:
            try:
                key = check_session_id(placement)
            except ValueError:
                continue  # not an id a gateway makes: never recorded
            try:
                record = await self._conn.call((await self._bucket()).get(key))
            except nats.js.errors.KeyNotFoundError:
                continue
            except nats.js.errors.APIError as exc:
                raise ClusterUnavailable(f"cannot read placement {placement}: {exc}") from exc
            if _record(record.value).get("withdrawn") is True:
                found.add(placement)
        return frozenset(found)

    async def _bucket(self) -> nats.js.kv.KeyValue:
        if self._kv is None:
            self._kv = await open_bucket(
                self._conn, self._conn.names.placements, ttl_s=PLACEMENT_RECORD_TTL_S
            )
        return self._kv

    async def _decide(self, placement: str, record: dict[str, Any]) -> dict[str, Any]:
        """Write ``record`` unless ``placement`` has one already: the one that holds."""
        key = check_session_id(placement)
        kv = await self._bucket()
        try:
            await self._conn.call(kv.create(key, json.dumps(record).encode()))
            return record
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot record placement {placement}: {exc}") from exc
        try:
            found = await self._conn.call(kv.get(key))
        except nats.js.errors.KeyNotFoundError:
            return record  # expired in between: long past any withdrawal
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot read placement {placement}: {exc}") from exc
        return _record(found.value)


def _record(data: bytes | None) -> dict[str, Any]:
    try:
        decoded = json.loads(data or b"")
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


async def withdrawn(records: PlacementRecords, session_id: str, entry: Mapping[str, Any]) -> bool:
    """Whether ``session_id`` (directory ``entry``), about to be taken up here, was made for
    a placement its gateway withdrew: then it is to be deleted instead. Taken up, it is
    recorded kept. A record that cannot be reached leaves it taken up, as a session made
    for no placement is (the takeover needs NATS too: it is rarely that far)."""
    placement = entry.get(PLACEMENT_FIELD)
    if not isinstance(placement, str):
        return False
    try:
        if await records.keep(placement, session_id):
            return False
    except (ClusterUnavailable, ValueError) as exc:
        _log(
            f"cannot tell whether session {session_id}'s placement was withdrawn ({exc}); "
            "taking it up"
        )
        return False
    return True


def _log(message: str) -> None:
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)
