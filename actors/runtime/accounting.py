"""What a host's sessions spend (R-SHARE-3) and the budgets it counts against (R-SHARE-4,
R-TREE-3).

:class:`Accounting` is the host's: its :class:`~greenroom.protocols.prices.PriceTable` (the
built-in prices with ``Host.open(prices=…)`` over them) and the budget of each principal
(``Host.open(principal_budget=…)``). It gives every session it makes a port for an
:class:`Account`: the price of the session's model, looked up once, the principal the
session is charged to, and the :class:`~greenroom.protocols.budgets.SpendLimit` objects its
requests count against, shared with the sessions they cover:

* the session's own ``max_cost_usd``, for a root (its subagents inherit the object, so it
  covers the whole tree);
* for a subagent, every limit of its parent, and ``tree_cost_budget_usd`` of the parent's
  settings as a new limit of the subagent's subtree;
* the principal's budget over its current UTC day or month, one object per principal
  for every session of the host.

A tree's limits are one object each in the host, found by the session whose subtree they
cover: a stored session takes the one open already, so a subagent loaded after a restart
(a background child taken up, or answered once its host came back) counts against its
root's ``max_cost_usd`` and the ``tree_cost_budget_usd`` of each subagent on its path, as
it did before the restart, with the sessions of its tree open here.

Spending already recorded comes from the usage ledger, once: a stored root's limit starts
at what its tree spent, a stored subagent's subtree limit at what the subagent and its
descendants spent (:func:`tree_usage`: the ledger keeps the root of each row, and each
session's ``session.json`` its path from the root), a principal's at what it spent since its
period began. From then on every priced request adds its cost to its account's limits as it
is recorded, so a check before a request (:meth:`Account.refusal`) reads memory only.

A principal's budget holds for the hosts that share its spending (a cluster's,
:class:`SharedSpending`): its limit, seeded from this host's ledger, is handed to the
shared spending, which returns the limit to count against instead — one that adds what the
principal spends on the other hosts as they record it. Sessions' and trees' budgets are
one host's: a tree runs on the host of its root.
"""

from __future__ import annotations

import contextlib
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.trace_sink import TraceSinkClosed
from greenroom.actors.runtime.trace_store import StoredSessionMissing, StoredSessionUnreadable
from greenroom.protocols.budgets import (
    BudgetPeriod,
    SpendLimit,
    estimate_input_tokens,
    period_start,
    request_bound,
)
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.prices import Price, PriceError, PriceTable, parse_prices
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import UsageLine, UsageQuery

if TYPE_CHECKING:
    from greenroom.actors.runtime.port import SessionPort
    from greenroom.actors.runtime.trace_store import SessionCatalog, UsageLedger

__all__ = [
    "NO_ACCOUNT",
    "Account",
    "Accounting",
    "PrincipalBudget",
    "RequestBilling",
    "SharedSpending",
    "price_overrides",
    "stored_origin",
    "tree_usage",
]


@attrs.frozen(kw_only=True)
class PrincipalBudget:
    """What each principal (a gateway client) may spend in USD per UTC ``period``
    (``day`` or ``month``), over every session of the host (``serve
    --principal-budget-usd``)."""

    usd: float
    period: BudgetPeriod = "day"

    def __attrs_post_init__(self) -> None:
        if not self.usd >= 0:
            raise ConfigurationError(f"principal budget: expected USD >= 0, got {self.usd!r}")
        if self.period not in ("day", "month"):
            raise ConfigurationError(
                f"principal budget: period must be day or month, got {self.period!r}"
            )


class SharedSpending(Protocol):
    """Principals' spending that several hosts count together (a cluster's, R-SHARE-4)."""

    async def share_principal(self, principal: str, local: SpendLimit) -> SpendLimit:
        """The limit this host's sessions of ``principal`` count against, given ``local``:
        the principal's budget for its current period with what this host's ledger holds
        for it. Never raises for the other hosts being out of reach: it then returns a
        limit that counts what it can (at worst this host's own spending)."""
        ...


def price_overrides(prices: Mapping[str, Any] | None) -> dict[str, Price]:
    """``Host.open(prices=…)``: a mapping of :class:`Price` values, or the JSON shape
    ``{model: {input, output, cache_read, cache_write}}``; raises
    :class:`ConfigurationError` naming the place of a problem."""
    if not prices:
        return {}
    if all(isinstance(v, Price) for v in prices.values()):
        return {str(k): v for k, v in prices.items()}
    try:
        return parse_prices(prices)
    except PriceError as exc:
        raise ConfigurationError(f"prices: {exc}") from None


def stored_origin(meta: Mapping[str, Any], session_id: str) -> tuple[str, ...] | None:
    """A stored subagent's path from its root (``origin`` in its ``session.json``), when
    it is one that ends with the session; else ``(parent_id, session_id)`` for a subagent
    stored without it, None for a root."""
    origin = meta.get("origin")
    if (
        isinstance(origin, list)
        and len(origin) >= 2
        and all(isinstance(i, str) for i in origin)
        and origin[-1] == session_id
    ):
        return tuple(origin)
    parent_id = meta.get("parent_id")
    return (parent_id, session_id) if isinstance(parent_id, str) else None


async def tree_usage(
    ledger: UsageLedger, catalog: SessionCatalog, root: str, *, until: float | None = None
) -> list[tuple[tuple[str, ...], UsageLine]]:
    """What each session of ``root``'s tree used (before ``until``, when given), as the
    ledger holds it, with the session's path from the root (its ``session.json``'s,
    :func:`stored_origin`): what a stored subagent's subtree used before it was loaded is
    the lines whose path holds it (R-TREE-3). A session whose metadata is gone or
    unreadable is left out, as its place in the tree is unknown."""
    found: list[tuple[tuple[str, ...], UsageLine]] = []
    for line in await ledger.report(UsageQuery(tree=root, until=until, by="session")):
        session_id = line.key
        if session_id is None:
            continue
        if session_id == root:
            found.append(((root,), line))
            continue
        try:
            meta = await catalog.read_meta(session_id)
        except (StoredSessionMissing, StoredSessionUnreadable):
            continue
        path = stored_origin(meta, session_id)
        if path is not None:
            found.append((path, line))
    return found


def _spent_under(top: str, usage: Sequence[tuple[tuple[str, ...], UsageLine]]) -> float:
    """What the subtree under ``top`` spent in ``usage`` (:func:`tree_usage`)."""
    return sum(line.cost_usd for path, line in usage if top in path)


class Account:
    """One session's price, principal and budgets (see the module docstring)."""

    __slots__ = (
        "_begun", "_estimates", "_held_usd", "_started_keys", "limits", "price", "principal"
    )

    def __init__(
        self,
        price: Price | None = None,
        principal: str | None = None,
        limits: tuple[SpendLimit, ...] = (),
    ) -> None:
        self.price = price
        """The price of the session's model; None when it is unknown."""
        self.principal = principal
        """The gateway client the session's requests are charged to, if any."""
        self.limits = limits
        """The budgets the session's requests count against, broadest last."""
        self._held_usd = 0.0
        self._started_keys: dict[str, str] = {}
        """The key of the request of each kind under way (a title runs beside a task)."""
        self._begun: set[str] = set()
        """The kinds whose request under way has its first row written by its streamer
        (:class:`RequestBilling`) already."""
        self._estimates: dict[str, TokenUsage] = {}
        """The usage estimated for the request of each kind under way, if any."""

    def request_key(self, kind: str = "request", *, started: bool) -> str | None:
        """The usage ledger's key of the session's request of ``kind`` under way (its
        requests of one kind run one at a time): a new one when its stream begins to
        report usage (``started``), then the same one, once, for the request's last row,
        which replaces the first (None when it had no first row). None for ``started``
        when its streamer wrote that row already (:meth:`begun`): there is none to write."""
        if started:
            if kind in self._begun:
                self._begun.discard(kind)
                return None
            key = self._started_keys[kind] = uuid.uuid4().hex
            return key
        self._begun.discard(kind)
        return self._started_keys.pop(kind, None)

    def next_request(self, kind: str = "request") -> None:
        """A new request of ``kind`` is on its way: what an earlier one left (an attempt
        dropped before its end was recorded) is forgotten, so its row is not replaced."""
        self._started_keys.pop(kind, None)
        self._begun.discard(kind)
        self._estimates.pop(kind, None)

    def begun(self, kind: str = "request") -> None:
        """The first row of the request of ``kind`` under way is written (by its streamer,
        before the stream's first events were handed on)."""
        self._begun.add(kind)

    def estimated_as(self, usage: TokenUsage, kind: str = "request") -> None:
        """``usage`` is the estimate of the request of ``kind`` under way: recorded as its
        usage (its stream cut before the provider reported any), it is flagged so."""
        self._estimates[kind] = usage

    def is_estimate(self, usage: TokenUsage, kind: str = "request") -> bool:
        """Whether ``usage`` is the estimate of the request of ``kind`` under way (the
        object itself: a report of the same numbers is not)."""
        return usage is self._estimates.get(kind)

    def priced(self, usage: TokenUsage) -> TokenUsage:
        """``usage`` with its cost at the session's price (unchanged when it has one, or
        when the price is unknown)."""
        price = self.price
        if price is None or usage.cost_usd is not None:
            return usage
        return attrs.evolve(usage, cost_usd=price.cost(usage))

    def spend(self, cost_usd: float | None, *, settles: bool = True) -> None:
        """A request of the session cost ``cost_usd`` (None: unknown, not counted);
        ``settles``: it is the request under way, whose bound is held no longer."""
        if settles:
            self.release()
        if cost_usd is None or not self.limits:
            return
        now = time.time()
        for limit in self.limits:
            limit.spend(cost_usd, now)

    def release(self) -> None:
        """The session's request under way, if any, is over: its bound is held no longer
        (its cost, if it had one, is spent)."""
        held, self._held_usd = self._held_usd, 0.0
        if held:
            for limit in self.limits:
                limit.release(held)

    def refusal(self, request: ModelRequest, last_context: int | None) -> str | None:
        """Why ``request`` may not be sent — it could pass one of the budgets, named in
        the words — or None; then it is the session's request under way, and its bound
        is held against the budgets until its cost is spent or :meth:`release` (R-SHARE-4:
        requests running at once cannot together pass a budget). Never refuses a request
        of unknown price. A session sends one request at a time: the previous one's hold
        ends here."""
        self.release()
        price = self.price
        if not self.limits or price is None:
            return None
        bound = request_bound(price, request, last_context)
        now = time.time()
        for limit in self.limits:
            refusal = limit.refusal(bound, now)
            if refusal is not None:
                return refusal
        for limit in self.limits:
            limit.hold(bound)
        self._held_usd = bound
        return None


NO_ACCOUNT = Account()
"""The account of a session built without a host's accounting: no price, no budget. A
port given none makes its own (an account keeps its session's request under way)."""


class RequestBilling:
    """The usage-ledger rows a task's streamer writes for the session of ``port`` as a
    request's stream begins (R-SHARE-3, R-TRACE-5).

    A request the provider has begun to answer is billed, at least for its input. Its
    ``started`` row — the usage the stream reported first, or for a provider that reports
    usage only at a stream's end the request's estimated input — is written and committed
    (the ledger's ``commit``, when it has one) before the stream's first events are handed
    on: a host that dies once anything of the stream was seen leaves the request counted,
    and a host opened on its data dir counts it against the budgets it seeds from the
    ledger. A batch of many streams that begin together shares one commit; the rest of a
    stream costs nothing here. The request's last row (the turn's or the compaction's)
    replaces this one, as before."""

    __slots__ = ("_commit", "_port")

    def __init__(self, port: SessionPort) -> None:
        self._port = port
        self._commit = getattr(port.host.usage_ledger, "commit", None)

    def next_request(self) -> None:
        """An attempt begins (see :meth:`Account.next_request`)."""
        self._port.account.next_request()

    def estimate(self, request: ModelRequest) -> TokenUsage:
        """The usage ``request`` is billed at least before its provider reports any: its
        input, estimated as the budgets do (:func:`estimate_input_tokens`), flagged as an
        estimate wherever it is recorded as the request's usage."""
        usage = TokenUsage(input=estimate_input_tokens(request))
        self._port.account.estimated_as(usage)
        return usage

    async def began(self, usage: TokenUsage) -> None:
        """The request's stream began with ``usage`` and goes on: its ``started`` row is
        written, and committed when this returns. Cancel-safe: see :meth:`cut`."""
        port = self._port
        machine = port.machine
        try:
            port.record_usage(machine.run_id or "", machine.turn, usage, started=True)
        except TraceSinkClosed:
            return  # the host is closing: its store takes nothing more
        port.account.begun()
        if self._commit is not None:
            await self._commit()

    def cut(self, usage: TokenUsage) -> None:
        """The attempt was cancelled before the batch that began its stream was handed on
        (while :meth:`began` waited): nobody else will record the request, so its last
        row is ``usage`` (what its ``started`` row holds), and its cost is spent."""
        port = self._port
        machine = port.machine
        with contextlib.suppress(TraceSinkClosed):
            port.record_usage(machine.run_id or "", machine.turn, usage)


class Accounting:
    """A host's prices and principals' budgets; makes each session's :class:`Account`
    (see the module docstring)."""

    __slots__ = (
        "_catalog", "_ledger", "_principals", "_trees", "prices", "principal_budget", "shared"
    )

    def __init__(
        self,
        ledger: UsageLedger,
        *,
        catalog: SessionCatalog | None = None,
        prices: Mapping[str, Any] | None = None,
        principal_budget: PrincipalBudget | None = None,
        shared: SharedSpending | None = None,
    ) -> None:
        self._ledger = ledger
        # Where a stored subagent's descendants are found (None: a stored subtree's limit
        # starts at what its top session spent itself).
        self._catalog = catalog
        self.prices = PriceTable(price_overrides(prices))
        """The built-in prices with the host's overrides."""
        self.principal_budget = principal_budget
        self.shared = shared
        """Where the principals' spending is counted with other hosts' (None: this host's
        alone)."""
        self._principals: dict[str, tuple[SpendLimit, trio.Event]] = {}
        # The limit of each subtree that has one, by the session at its top, while a
        # session of the subtree holds it (R-TREE-3).
        self._trees: weakref.WeakValueDictionary[str, SpendLimit] = (
            weakref.WeakValueDictionary()
        )

    async def account(
        self,
        session_id: str,
        settings: SessionSettings,
        *,
        principal: str | None,
        parent: tuple[SessionSettings, Account] | None = None,
        stored: bool = False,
        origin: tuple[str, ...] | None = None,
    ) -> Account:
        """The account of session ``session_id``: new, or ``stored`` (its tree's spending
        is read from the ledger); ``parent`` gives a new subagent's parent's settings and
        account (the subagent inherits its limits and its principal); ``origin``, a stored
        subagent's path from its root (its settings, its parent's copy, give the budgets
        of the tree)."""
        price = self.prices.price_of(settings.model)
        if parent is not None:
            parent_settings, parent_account = parent
            limits = parent_account.limits
            tree_budget = parent_settings.tree_cost_budget_usd
            if tree_budget is not None:
                limits = (self._tree_limit(session_id, tree_budget, 0.0), *limits)
            return Account(price, parent_account.principal, limits)
        path = origin or (session_id,)
        limits = ()
        if (tree_budget := settings.tree_cost_budget_usd) is not None:
            subtrees = path[:0:-1]
            usage: Sequence[tuple[tuple[str, ...], UsageLine]] = ()
            if stored and any(node not in self._trees for node in subtrees):
                usage = await self._tree_usage(path[0], subtrees)
            for node in subtrees:
                limits = (*limits, self._tree_limit(node, tree_budget, _spent_under(node, usage)))
        if settings.max_cost_usd is not None:
            root, usd = path[0], settings.max_cost_usd
            spent = 0.0
            if stored and root not in self._trees:
                spent = await self._spent(UsageQuery(by=None, tree=root))
            limits = (*limits, self._tree_limit(root, usd, spent, root=True))
        if principal is not None and self.principal_budget is not None:
            limits = (*limits, await self._principal_limit(principal, self.principal_budget))
        return Account(price, principal, limits)

    def _tree_limit(self, top: str, usd: float, spent: float, *, root: bool = False) -> SpendLimit:
        """The limit of the subtree under ``top`` (a root's ``max_cost_usd``, else a
        subagent's ``tree_cost_budget_usd``): the one open here, else a new one, which
        starts at ``spent`` (what the ledger holds for the subtree, for a stored one)."""
        if (known := self._trees.get(top)) is not None:
            # Another session of the tree may have made it while the ledger was read: it
            # counts that spending already, and what was spent since.
            return known
        if root:
            name = f"max_cost_usd={usd:g} of session {top} and its subagents"
        else:
            name = f"tree_cost_budget_usd={usd:g} of subagent {top} and its subagents"
        limit = SpendLimit(name, usd, spent_usd=spent)
        self._trees[top] = limit
        return limit

    async def _tree_usage(
        self, root: str, subtrees: Sequence[str]
    ) -> Sequence[tuple[tuple[str, ...], UsageLine]]:
        """:func:`tree_usage` of ``root``'s tree; without a catalog, what each top of
        ``subtrees`` spent itself."""
        if self._catalog is not None:
            return await tree_usage(self._ledger, self._catalog, root)
        return [
            ((top,), (await self._ledger.report(UsageQuery(by=None, tree=top)))[0])
            for top in subtrees
        ]

    async def _principal_limit(self, principal: str, budget: PrincipalBudget) -> SpendLimit:
        while (known := self._principals.get(principal)) is not None:
            if known[1].is_set():
                # The limit shared with other hosts, once it is (the same one when not).
                return known[0]
            # Another session seeds it. When that fails (its entry goes), seed it here:
            # a limit of one's own would count from nothing and for nobody else.
            await known[1].wait()
        now = time.time()
        since = period_start(budget.period, now)
        name = f"budget of principal {principal!r} ({budget.usd:g} USD per UTC {budget.period})"
        limit = SpendLimit(name, budget.usd, period=budget.period, since=since)
        seeded = trio.Event()
        self._principals[principal] = (limit, seeded)
        try:
            # Rows from before ``now`` are the ledger's to count; later ones are spent live.
            limit.spend(await self._spent(UsageQuery(by=None, principal=principal,
                                                     since=since, until=now)), now)
            if self.shared is not None:
                limit = await self.shared.share_principal(principal, limit)
                self._principals[principal] = (limit, seeded)
        except BaseException:
            del self._principals[principal]
            raise
        finally:
            seeded.set()
        return limit

    async def _spent(self, query: UsageQuery) -> float:
        (line,) = await self._ledger.report(query)
        return line.cost_usd
