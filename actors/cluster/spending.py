"""What each principal spends in its budget's period, counted over every host of a cluster
(R-SHARE-4 across hosts).

One counter per principal and period in the KV bucket ``<prefix>_spending``: the key is
a hash of the principal (a gateway client's id may hold any character), the period
(``day`` or ``month``) and its start in unix seconds; the value ``{"usd": total}``. A host
adds what its requests cost with compare-and-set on the counter's revision (read, add,
write if nobody wrote since; else again), from one sender task, so recording a request
never waits for NATS. Every host watches the bucket (a KV watch: JetStream pushes each
new total to every watcher), so the check before a request reads memory, as on a single
host, and sees what the other hosts spent as soon as they add it.

A principal's limit on a host (:class:`SharedSpendLimit`) counts the counter's total as
last heard plus what the host spent since and has not yet added: spending never goes
unseen on the host that made it. Starting, it reads the counter (a host's first session of
the principal in the period); a counter that does not exist yet is created with what this
host's ledger holds for the period.

When NATS is out of reach the host says so once in its log and goes on: its limits count
the cluster's total as last heard plus its own spending since, and what it spent is added
to the counter when NATS answers again. Meanwhile the other hosts' spending is not seen.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time

import nats.errors
import nats.js.errors
import nats.js.kv
import trio

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.leases import open_bucket
from greenroom.protocols.budgets import SpendLimit, period_start

__all__ = ["ClusterSpending", "SharedSpendLimit", "spending_key"]

KEEP_S = 40 * 86_400.0
"""How long a counter outlives its last update (the bucket's TTL): longer than a month,
the longest period, so a counter lasts its period; then it is dropped."""

RETRY_S = 1.0
"""How long the sender waits before trying NATS again."""

_MAX_TRIES = 50
_PRINCIPAL_DIGITS = 24


def log(message: str) -> None:
    """One line on stderr (the serve process's log)."""
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)


def spending_key(principal: str, period: str, since: float) -> str:
    """The counter of ``principal`` for the ``period`` that starts at ``since``."""
    digest = hashlib.sha256(principal.encode()).hexdigest()[:_PRINCIPAL_DIGITS]
    return f"{digest}.{period}.{int(since)}"


class SharedSpendLimit(SpendLimit):
    """A principal's budget as the cluster spends it: the counter's total as last heard
    (:attr:`cluster_usd`) plus what this host spent since and has not yet added to it
    (:attr:`unsent_usd`); ``spent_usd`` is their sum. In a new period it counts that
    period's counter, from what was heard of it."""

    __slots__ = ("_book", "_changed", "cluster_usd", "principal", "unsent_usd")

    def __init__(
        self, local: SpendLimit, principal: str, book: ClusterSpending, cluster_usd: float
    ) -> None:
        super().__init__(
            local.name,
            local.limit_usd,
            spent_usd=cluster_usd,
            period=local.period,
            since=local.since,
        )
        self.principal = principal
        self.cluster_usd = cluster_usd
        """What the cluster's counter held when this host last heard of it."""
        self.unsent_usd = 0.0
        """What this host spent and has not yet added to the counter."""
        self._book = book
        self._changed = trio.Event()

    @property
    def key(self) -> str:
        """The counter of the current period."""
        return spending_key(self.principal, self.period or "", self.since or 0.0)

    def spend(self, cost_usd: float, now: float) -> None:
        """A priced request of this host cost ``cost_usd``: counted at once here, and
        added to the cluster's counter by the sender."""
        self._follow_period(now)
        self.unsent_usd += cost_usd
        self.spent_usd = self.cluster_usd + self.unsent_usd
        self._book.add(self, cost_usd)
        self._wake()

    def refusal(self, bound_usd: float, now: float) -> str | None:
        """As :meth:`SpendLimit.refusal`, over what the whole cluster spent."""
        self._follow_period(now)
        return super().refusal(bound_usd, now)

    def _follow_period(self, now: float) -> None:
        """In a new period, count its counter as last heard (another host may have spent
        in it already) and nothing of this host's yet."""
        if self.period is None:
            return
        start = period_start(self.period, now)
        if self.since is None or start > self.since:
            # Set here, so SpendLimit finds its period current and counts nothing again.
            self.since = start
            self.cluster_usd = self._book.total(self.key)
            self.unsent_usd = 0.0
            self.spent_usd = self.cluster_usd

    def heard(self, key: str, total_usd: float) -> None:
        """The counter ``key`` holds ``total_usd`` (the bucket's watch). Counted when it
        is the current period's and more than last heard. Until this host's own addition
        is confirmed (:meth:`sent`) a total that holds it counts it twice: a request may be
        refused a moment early, never let through."""
        if key == self.key and total_usd > self.cluster_usd:
            self.cluster_usd = total_usd
            self.spent_usd = total_usd + self.unsent_usd
            self._wake()

    def sent(self, key: str, amount_usd: float, total_usd: float) -> None:
        """This host added ``amount_usd`` to counter ``key``, which then held
        ``total_usd``."""
        if key != self.key:
            return
        self.unsent_usd = max(0.0, self.unsent_usd - amount_usd)
        self.cluster_usd = max(self.cluster_usd, total_usd)
        self.spent_usd = self.cluster_usd + self.unsent_usd
        self._wake()

    async def wait_spent(self, usd: float) -> None:
        """Return once the principal's spending as this host counts it reaches ``usd``
        (what other hosts spent included, as it is heard of)."""
        while self.spent_usd < usd:
            await self._changed.wait()

    def _wake(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()


class ClusterSpending:
    """The principals' spending counters of one cluster, as one host uses them (see the
    module docstring). Use :meth:`open`, then run :meth:`run` in a nursery."""

    def __init__(self, conn: Connection, kv: nats.js.kv.KeyValue, host_id: str) -> None:
        self._conn = conn
        self._kv = kv
        self.host_id = host_id
        self._limits: dict[str, SharedSpendLimit] = {}
        self._by_digest: dict[str, SharedSpendLimit] = {}
        self._totals: dict[str, float] = {}
        self._pending: dict[str, tuple[SharedSpendLimit, float]] = {}
        self._due = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._unreachable = False

    @classmethod
    async def open(cls, conn: Connection, host_id: str) -> ClusterSpending:
        """Bind the spending bucket, creating it when it is missing."""
        return cls(conn, await open_bucket(conn, conn.names.spending, ttl_s=KEEP_S), host_id)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Add this host's spending to the counters and hear every other host's, until
        cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send)
            nursery.start_soon(self._watch)
            task_status.started()

    async def share(self, principal: str, local: SpendLimit) -> SharedSpendLimit:
        """The limit of ``principal`` on this host, counted with the cluster's counter;
        ``local`` holds its budget, its period and what this host's ledger holds for it.
        Reads the counter (creating it with the ledger's amount when missing); with NATS
        out of reach it starts from the ledger's amount and says so."""
        existing = self._limits.get(principal)
        if existing is not None:
            return existing
        key = spending_key(principal, local.period or "", local.since or 0.0)
        try:
            total = await self._seed(key, local.spent_usd)
        except ClusterUnavailable as exc:
            self._out_of_reach(exc)
            total = local.spent_usd
        limit = SharedSpendLimit(local, principal, self, total)
        self._limits[principal] = limit
        self._by_digest[key.split(".", 1)[0]] = limit
        return limit

    def total(self, key: str) -> float:
        """The last total heard of counter ``key`` (of a principal with a limit on this
        host); 0 when none was."""
        return self._totals.get(key, 0.0)

    def add(self, limit: SharedSpendLimit, cost_usd: float) -> None:
        """Queue ``cost_usd`` for ``limit``'s current counter. Never blocks."""
        key = limit.key
        _, queued = self._pending.get(key, (limit, 0.0))
        self._pending[key] = (limit, queued + cost_usd)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._due.set()

    async def flushed(self) -> None:
        """Return once every cost queued so far is in the counters (a host that closes
        waits for it, within a bound)."""
        await self._idle.wait()

    async def _send(self) -> None:
        while True:
            await self._due.wait()
            self._due = trio.Event()
            pending, self._pending = self._pending, {}
            failed = False
            for key, (limit, amount) in pending.items():
                try:
                    total = await self._add(key, amount)
                except ClusterUnavailable as exc:
                    self._out_of_reach(exc)
                    failed = True
                    _, queued = self._pending.get(key, (limit, 0.0))
                    self._pending[key] = (limit, queued + amount)
                    continue
                limit.sent(key, amount, total)
                if self._unreachable:
                    self._unreachable = False
                    log(f"host {self.host_id} counts principals' spending with the cluster again")
            if failed:
                await trio.sleep(RETRY_S)
                self._due.set()
            elif not self._pending:
                self._idle.set()

    async def _seed(self, key: str, ledger_usd: float) -> float:
        """The counter's total; a missing counter is created with ``ledger_usd``."""
        for _ in range(_MAX_TRIES):
            found = await self._read(key)
            if found is not None:
                return found[0]
            if ledger_usd <= 0:
                return 0.0
            if await self._create(key, ledger_usd):
                return ledger_usd
        raise ClusterUnavailable(f"cannot start the spending counter {key}")

    async def _add(self, key: str, amount: float) -> float:
        """Add ``amount`` to counter ``key`` (compare-and-set); the new total."""
        for _ in range(_MAX_TRIES):
            found = await self._read(key)
            if found is None:
                if await self._create(key, amount):
                    return amount
                continue
            total = found[0] + amount
            try:
                await self._conn.call(self._kv.update(key, _encode(total), last=found[1]))
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another host added meanwhile: read again
            except nats.js.errors.APIError as exc:
                raise ClusterUnavailable(f"cannot add to {key}: {exc}") from exc
            return total
        raise ClusterUnavailable(f"too many hosts added to {key} at once")

    async def _read(self, key: str) -> tuple[float, int] | None:
        try:
            entry = await self._conn.call(self._kv.get(key))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot read {key}: {exc}") from exc
        return _decode(entry.value), entry.revision or 0

    async def _create(self, key: str, total: float) -> bool:
        """Whether counter ``key`` was created holding ``total`` (False: another host
        created it first)."""
        try:
            await self._conn.call(self._kv.create(key, _encode(total)))
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            return False
        except nats.js.errors.APIError as exc:
            raise ClusterUnavailable(f"cannot create {key}: {exc}") from exc
        return True

    async def _watch(self) -> None:
        """Hear every counter's new totals; watch again after a failure."""
        while True:
            try:
                watcher = await self._conn.call(self._kv.watch(">"))
            except (ClusterUnavailable, nats.errors.Error) as exc:
                self._out_of_reach(exc)
                await trio.sleep(RETRY_S)
                continue
            try:
                # None marks the end of the totals the watch starts with.
                async for entry in self._conn.bridge.messages(watcher.__anext__):
                    if entry is not None and entry.value:
                        self._hear(entry.key, _decode(entry.value))
            except (ClusterUnavailable, nats.errors.Error) as exc:
                self._out_of_reach(exc)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(RETRY_S):
                    with contextlib.suppress(ClusterUnavailable, nats.errors.Error):
                        await self._conn.call(watcher.stop())  # type: ignore[no-untyped-call]
            await trio.sleep(RETRY_S)

    def _hear(self, key: str, total: float) -> None:
        limit = self._by_digest.get(key.split(".", 1)[0])
        if limit is not None:
            # Kept for a limit that enters this period later (its host was idle at midnight).
            self._totals[key] = max(total, self._totals.get(key, 0.0))
            limit.heard(key, total)

    def _out_of_reach(self, exc: Exception) -> None:
        if not self._unreachable:
            self._unreachable = True
            log(
                f"host {self.host_id} cannot reach the cluster's spending counters ({exc}); "
                "principals' budgets count the cluster's spending as last heard plus this "
                "host's own until NATS answers"
            )


def _encode(total: float) -> bytes:
    return json.dumps({"usd": total, "at": time.time()}).encode()


def _decode(value: bytes | None) -> float:
    try:
        usd = json.loads(value or b"").get("usd")
    except (ValueError, AttributeError):
        return 0.0
    return float(usd) if isinstance(usd, int | float) and math.isfinite(usd) else 0.0
