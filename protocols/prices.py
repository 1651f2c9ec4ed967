"""Model prices, and what one request cost in USD (R-SHARE-3). Pure: no I/O.

A :class:`Price` is four rates in USD per million tokens — fresh ``input``, ``output``
(reasoning included: providers bill it as output), ``cache_read`` and ``cache_write`` —
matching the four counts of a :class:`~greenroom.protocols.stream.TokenUsage`, so a cost is
one weighted sum. A :class:`PriceTable` finds a model's price: its exact name first, then
the name without a dated suffix (``claude-sonnet-4-5-20250929`` → ``claude-sonnet-4-5``,
``gpt-4o-2024-08-06`` → ``gpt-4o``) or without ``-latest``. A model it does not know has no
price and its cost is None — never a guess from a similar name. Lookups are cached per
model name, so pricing a request costs four multiplications.

:data:`BUILT_IN_PRICES` are the list prices Anthropic and OpenAI publish for their
standard (not batch, not priority) API tiers, checked on 2026-12-04 against the providers'
pricing pages. What the table does not model: Anthropic's 1-hour cache writes (priced as
the 5-minute ones, the only kind greenroom requests), long-context surcharges (a Sonnet 4 or
4.5 request over 200K input tokens costs more), batch and regional discounts. OpenAI bills
no cache writes, so its ``cache_write`` is the input rate (it never reports any).

Overrides (``Host.open(prices=…)``, ``--prices FILE``) have the JSON shape
``{model: {input, output, cache_read, cache_write}}``; :func:`parse_prices` checks it and
names the place of a problem as ``$.model.field``. ``cache_read`` and ``cache_write`` may be
left out: they are then the input rate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

from greenroom.protocols.stream import TokenUsage

__all__ = [
    "BUILT_IN_PRICES",
    "Price",
    "PriceError",
    "PriceTable",
    "parse_prices",
]

PER_TOKENS = 1_000_000
"""Prices are per this many tokens."""


class PriceError(ValueError):
    """A price override that cannot be used; the message names where (``$.model.field``)."""


@attrs.frozen(kw_only=True, slots=True)
class Price:
    """A model's rates in USD per million tokens."""

    input: float
    output: float
    cache_read: float
    cache_write: float

    def cost(self, usage: TokenUsage) -> float:
        """What ``usage`` costs at these rates, in USD."""
        return (
            usage.input * self.input
            + usage.output * self.output
            + usage.cache_read * self.cache_read
            + usage.cache_write * self.cache_write
        ) / PER_TOKENS


def _anthropic(input: float, output: float, cache_write: float, cache_read: float) -> Price:
    return Price(input=input, output=output, cache_read=cache_read, cache_write=cache_write)


def _openai(input: float, output: float, cached: float | None = None) -> Price:
    # OpenAI bills no cache writes; a model without prompt caching reads at the input rate.
    return Price(
        input=input,
        output=output,
        cache_read=input if cached is None else cached,
        cache_write=input,
    )


_OPUS_4 = _anthropic(15.0, 75.0, 18.75, 1.50)
_OPUS_4_5 = _anthropic(5.0, 25.0, 6.25, 0.50)
_SONNET = _anthropic(3.0, 15.0, 3.75, 0.30)

BUILT_IN_PRICES: Mapping[str, Price] = {
    # Anthropic: base input, output, 5-minute cache write, cache hit.
    "claude-opus-4": _OPUS_4,
    "claude-opus-4-0": _OPUS_4,
    "claude-opus-4-1": _OPUS_4,
    "claude-opus-4-5": _OPUS_4_5,
    "claude-opus-4-6": _OPUS_4_5,
    "claude-opus-4-7": _OPUS_4_5,
    "claude-opus-4-8": _OPUS_4_5,
    "claude-sonnet-4": _SONNET,
    "claude-sonnet-4-0": _SONNET,
    "claude-sonnet-4-5": _SONNET,
    "claude-sonnet-4-6": _SONNET,
    "claude-3-7-sonnet": _SONNET,
    "claude-3-5-sonnet": _SONNET,
    "claude-haiku-4-5": _anthropic(1.0, 5.0, 1.25, 0.10),
    "claude-3-5-haiku": _anthropic(0.80, 4.0, 1.0, 0.08),
    "claude-3-haiku": _anthropic(0.25, 1.25, 0.30, 0.03),
    # OpenAI: input, output, cached input.
    "gpt-4o": _openai(2.50, 10.0, 1.25),
    "gpt-4o-2024-05-13": _openai(5.0, 15.0),
    "gpt-4o-mini": _openai(0.15, 0.60, 0.075),
    "gpt-4.1": _openai(2.0, 8.0, 0.50),
    "gpt-4.1-mini": _openai(0.40, 1.60, 0.10),
    "gpt-4.1-nano": _openai(0.10, 0.40, 0.025),
    "o1": _openai(15.0, 60.0, 7.50),
    "o3": _openai(2.0, 8.0, 0.50),
    "o3-mini": _openai(1.10, 4.40, 0.55),
    "o4-mini": _openai(1.10, 4.40, 0.275),
    "gpt-5": _openai(1.25, 10.0, 0.125),
    "gpt-5-chat": _openai(1.25, 10.0, 0.125),
    "gpt-5-mini": _openai(0.25, 2.0, 0.025),
    "gpt-5-nano": _openai(0.05, 0.40, 0.005),
    "gpt-5-pro": _openai(15.0, 120.0),
    "gpt-5.1": _openai(1.25, 10.0, 0.125),
    "gpt-5.2": _openai(1.75, 14.0, 0.175),
    "gpt-5.4": _openai(2.50, 15.0, 0.25),
    "gpt-5.4-mini": _openai(0.75, 4.50, 0.075),
    "gpt-5.4-nano": _openai(0.20, 1.25, 0.02),
}
"""List prices (USD per million tokens) of the models greenroom's providers serve; see the
module docstring for their date and what they leave out."""

_DATED = re.compile(r"-(?:\d{8}|\d{4}-\d{2}-\d{2}|latest)$")
"""A dated snapshot's suffix (Anthropic ``-20250929``, OpenAI ``-2024-08-06``) or ``-latest``."""


class PriceTable:
    """The prices a host charges by: the built-in table with ``overrides`` over it (an
    override replaces a model's whole price). :meth:`price_of` caches its answer per model
    name, None included."""

    __slots__ = ("_cache", "_prices")

    def __init__(
        self,
        overrides: Mapping[str, Price] | None = None,
        *,
        built_in: Mapping[str, Price] = BUILT_IN_PRICES,
    ) -> None:
        self._prices: dict[str, Price] = {**built_in, **(overrides or {})}
        self._cache: dict[str, Price | None] = {}

    def price_of(self, model: str) -> Price | None:
        """``model``'s price: by its exact name, else by its name without a dated suffix or
        ``-latest``; None when the table has neither (an unknown model is never priced)."""
        try:
            return self._cache[model]
        except KeyError:
            pass
        price = self._prices.get(model)
        if price is None:
            undated = _DATED.sub("", model)
            price = self._prices.get(undated) if undated != model else None
        self._cache[model] = price
        return price

    def cost(self, model: str, usage: TokenUsage) -> float | None:
        """What ``usage`` of ``model`` costs in USD; None when the model's price is unknown."""
        price = self.price_of(model)
        return None if price is None else price.cost(usage)


_RATES = ("input", "output", "cache_read", "cache_write")


def parse_prices(data: Any, path: str = "$") -> dict[str, Price]:
    """Price overrides in their JSON shape, ``{model: {input, output, cache_read?,
    cache_write?}}`` (USD per million tokens; ``cache_read`` and ``cache_write`` default to
    ``input``). Raises :class:`PriceError` naming the place of the first problem."""
    if not isinstance(data, Mapping):
        raise PriceError(f"{path}: expected an object of models, got {_kind(data)}")
    prices: dict[str, Price] = {}
    for model, rates in data.items():
        where = f"{path}.{model}"
        if not isinstance(model, str) or not model.strip():
            raise PriceError(f"{where}: a model name must be a non-empty string")
        if not isinstance(rates, Mapping):
            raise PriceError(f"{where}: expected an object of rates, got {_kind(rates)}")
        unknown = sorted(str(k) for k in rates if k not in _RATES)
        if unknown:
            raise PriceError(
                f"{where}.{unknown[0]}: unknown rate (expected {', '.join(_RATES)})"
            )
        values: dict[str, float] = {}
        for rate in _RATES:
            value = rates.get(rate)
            if value is None and rate in ("cache_read", "cache_write") and "input" in values:
                value = values["input"]
            if value is None:
                raise PriceError(f"{where}.{rate}: required (USD per million tokens)")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise PriceError(f"{where}.{rate}: expected a number, got {_kind(value)}")
            try:
                number = float(value)
            except OverflowError:  # an integer past a float's range: 400 digits read as JSON
                raise PriceError(
                    f"{where}.{rate}: expected a number >= 0, got one too large"
                ) from None
            if not math.isfinite(number) or number < 0:
                raise PriceError(f"{where}.{rate}: expected a number >= 0, got {value!r}")
            values[rate] = number
        prices[model] = Price(**values)
    return prices


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__
