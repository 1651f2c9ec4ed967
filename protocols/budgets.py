"""Cost budgets (R-SHARE-4): what a budget has spent, and whether the next request could
pass it. Pure: the caller gives the time (``now``, unix seconds) and the request.

A :class:`SpendLimit` is one budget — a session's ``max_cost_usd``, a subagent tree's
``tree_cost_budget_usd``, a principal's budget per UTC day or month — and the USD spent
against it. Every priced request of the sessions it covers adds its cost
(:meth:`SpendLimit.spend`); before a request is sent, :meth:`SpendLimit.refusal` says
whether it could pass the budget.

The check is made **before** each model request (a turn's attempt, a compaction's), with
an upper bound of what the request can cost (:func:`request_bound`): its input at the
dearer of the model's input and cache-write rates, estimated as the larger of the last
request's whole context and a count of the request's characters, plus ``max_tokens`` of
output at the output rate. A request is refused when what was spent plus that bound would
pass the budget, so a budget is never passed by more than the input estimate's error —
and a task may stop while some money is left (the bound assumes the longest answer).
Requests under way count too: a request that is sent holds its bound against every budget
it counts against (:meth:`SpendLimit.hold`) until its cost is known or it ends without
one (:meth:`SpendLimit.release`), so requests that run at the same time — background
subagents, a principal's sessions — cannot together pass a budget each would not.

A request whose model has no price has no bound and no cost: it is neither refused nor
counted (its cost is unknown, never guessed). Give the model a price to have budgets count
it.
"""

from __future__ import annotations

import datetime
import json
import math
from typing import Literal

from greenroom.protocols.content import ImageBlock, TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult
from greenroom.protocols.prices import PER_TOKENS, Price

__all__ = [
    "BudgetPeriod",
    "SpendLimit",
    "estimate_input_tokens",
    "period_start",
    "request_bound",
    "usd",
]

BudgetPeriod = Literal["day", "month"]
"""The span a principal's budget is counted over: a calendar day or month, in UTC."""

CHARS_PER_TOKEN = 4
"""The usual English ratio; the last request's real count guards against text that
tokenizes denser."""

IMAGE_TOKENS = 1_600
"""What one image costs at most as input (Anthropic counts about width x height / 750
tokens and scales images down to about 1.15 megapixels)."""


def period_start(period: BudgetPeriod, now: float) -> float:
    """The start (unix seconds) of the UTC day or month that holds ``now``."""
    moment = datetime.datetime.fromtimestamp(now, datetime.UTC)
    start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        start = start.replace(day=1)
    return start.timestamp()


def estimate_input_tokens(request: ModelRequest) -> int:
    """A request's input size from its characters: the system prompt, the tools'
    descriptions and schemas, every message's text, thinking, tool calls and results,
    and :data:`IMAGE_TOKENS` for each image."""
    chars = len(request.system or "")
    images = 0
    for schema in request.tools:
        chars += len(schema.name) + len(schema.description) + len(json.dumps(schema.input_schema))
    for message in request.messages:
        for part in message.content:
            if isinstance(part, TextBlock | ThinkingBlock):
                chars += len(part.text)
            elif isinstance(part, ToolCallBlock):
                chars += len(part.name) + len(part.invalid_arguments or json.dumps(part.arguments))
            elif isinstance(part, ToolResult):
                for block in part.content:
                    if isinstance(block, TextBlock):
                        chars += len(block.text)
                    else:
                        images += 1
            elif isinstance(part, ImageBlock):
                images += 1
    return math.ceil(chars / CHARS_PER_TOKEN) + images * IMAGE_TOKENS


def request_bound(price: Price, request: ModelRequest, last_context: int | None) -> float:
    """An upper bound of what ``request`` can cost in USD (see the module docstring):
    ``last_context`` is the previous request's whole context in tokens (its ``total``;
    None when there is none in this context)."""
    tokens = max(estimate_input_tokens(request), last_context or 0)
    input_rate = max(price.input, price.cache_write)
    return (tokens * input_rate + request.max_tokens * price.output) / PER_TOKENS


def usd(amount: float) -> str:
    """An amount of USD for people: dollars and cents, more digits when it is small."""
    if amount >= 1:
        return f"${amount:,.2f}"
    return f"${amount:.6f}".rstrip("0").rstrip(".") if amount else "$0"


class SpendLimit:
    """One cost budget and what has been spent against it. ``name`` says which budget it
    is, for the message that ends a task at it. With a ``period`` the spending counts from
    the start of the current UTC day or month: a spend or a check in a later period starts
    it again from zero."""

    __slots__ = ("__weakref__", "held_usd", "limit_usd", "name", "period", "since", "spent_usd")

    def __init__(
        self,
        name: str,
        limit_usd: float,
        *,
        spent_usd: float = 0.0,
        period: BudgetPeriod | None = None,
        since: float | None = None,
    ) -> None:
        self.name = name
        self.limit_usd = limit_usd
        self.spent_usd = spent_usd
        self.period = period
        self.since = since
        """The start of the period counted (unix seconds); None without a period."""
        self.held_usd = 0.0
        """The bounds of the requests under way (sent, their cost not yet known)."""

    def _roll(self, now: float) -> None:
        period = self.period
        if period is None:
            return
        start = period_start(period, now)
        if self.since is None or start > self.since:
            self.since = start
            self.spent_usd = 0.0

    def spend(self, cost_usd: float, now: float) -> None:
        """A priced request of the budget's sessions cost ``cost_usd``."""
        self._roll(now)
        self.spent_usd += cost_usd

    def hold(self, bound_usd: float) -> None:
        """A request that can cost up to ``bound_usd`` is under way."""
        self.held_usd += bound_usd

    def release(self, bound_usd: float) -> None:
        """A request :meth:`hold` counted is no longer under way (its cost, if any, is
        spent)."""
        self.held_usd = max(0.0, self.held_usd - bound_usd)

    def refusal(self, bound_usd: float, now: float) -> str | None:
        """Why a request that can cost up to ``bound_usd`` may not be sent (it could pass
        the budget with what was spent and what the requests under way may cost), naming
        the budget; None when it may."""
        self._roll(now)
        if self.spent_usd + self.held_usd + bound_usd <= self.limit_usd:
            return None
        held = f", {usd(self.held_usd)} held by requests under way" if self.held_usd else ""
        return (
            f"budget exceeded: {self.name}: {usd(self.spent_usd)} spent of "
            f"{usd(self.limit_usd)}{held}, and the next request could cost up to "
            f"{usd(bound_usd)}"
        )
