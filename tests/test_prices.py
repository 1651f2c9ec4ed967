"""The price table (R-SHARE-3): what a request costs, how a model name finds its price,
and how overrides are checked."""

from __future__ import annotations

from typing import Any

import pytest

from greenroom.protocols.prices import (
    BUILT_IN_PRICES,
    Price,
    PriceError,
    PriceTable,
    parse_prices,
)
from greenroom.protocols.stream import TokenUsage

USAGE = TokenUsage(input=1_000, output=500, cache_read=20_000, cache_write=4_000)


def test_a_cost_is_each_count_at_its_rate() -> None:
    sonnet = BUILT_IN_PRICES["claude-sonnet-4-5"]
    # $3 in, $15 out, $0.30 cache read, $3.75 cache write, per million tokens.
    expected = (1_000 * 3 + 500 * 15 + 20_000 * 0.30 + 4_000 * 3.75) / 1_000_000
    assert sonnet.cost(USAGE) == pytest.approx(expected)
    assert expected == pytest.approx(0.0315)


@pytest.mark.parametrize(
    ("model", "key"),
    [
        ("claude-sonnet-4-5", "claude-sonnet-4-5"),
        ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5"),
        ("claude-opus-4-20250514", "claude-opus-4"),
        ("claude-3-5-haiku-latest", "claude-3-5-haiku"),
        ("claude-3-7-sonnet-20250219", "claude-3-7-sonnet"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("o3-2025-04-16", "o3"),
        ("gpt-5-chat-latest", "gpt-5-chat"),
    ],
)
def test_dated_names_find_their_model(model: str, key: str) -> None:
    assert PriceTable().price_of(model) == BUILT_IN_PRICES[key]


def test_an_exact_name_wins_over_its_undated_alias() -> None:
    table = PriceTable()
    assert table.price_of("gpt-4o-2024-05-13") == Price(
        input=5.0, output=15.0, cache_read=5.0, cache_write=5.0
    )
    assert table.price_of("gpt-4o-2024-05-13") != table.price_of("gpt-4o")


@pytest.mark.parametrize(
    "model",
    ["scripted", "claude-sonnet", "claude-sonnet-4-5x", "gpt-4o-turbo", "my-local-llama", ""],
)
def test_an_unknown_model_has_no_price_and_no_cost(model: str) -> None:
    """Never a guess from a similar name."""
    table = PriceTable()
    assert table.price_of(model) is None
    assert table.cost(model, USAGE) is None


def test_the_built_in_table_covers_the_current_families() -> None:
    for model in (
        "claude-opus-4-1", "claude-opus-4-5", "claude-sonnet-4", "claude-haiku-4-5",
        "claude-3-7-sonnet", "claude-3-5-sonnet", "claude-3-5-haiku",
        "gpt-4o", "gpt-4o-mini", "gpt-4.1", "gpt-4.1-mini", "gpt-4.1-nano", "o3", "o4-mini",
        "gpt-5", "gpt-5-mini", "gpt-5-nano",
    ):  # fmt: skip
        price = BUILT_IN_PRICES[model]
        assert 0 < price.cache_read <= price.input < price.output, model


def test_overrides_replace_or_add_a_model_and_answers_are_cached() -> None:
    custom = Price(input=1.0, output=2.0, cache_read=0.5, cache_write=1.5)
    table = PriceTable({"claude-sonnet-4-5": custom, "my-model": custom})
    assert table.price_of("claude-sonnet-4-5-20250929") is custom
    assert table.cost("my-model", TokenUsage(input=1_000_000, output=1_000_000)) == 3.0
    assert table.price_of("gpt-4o") == BUILT_IN_PRICES["gpt-4o"]
    first = table.price_of("my-model")
    assert table.price_of("my-model") is first


def test_parse_prices_reads_the_json_shape() -> None:
    prices = parse_prices(
        {
            "my-model": {"input": 1, "output": 2, "cache_read": 0.1, "cache_write": 1.25},
            "local": {"input": 0, "output": 0},
        }
    )
    assert prices["my-model"] == Price(input=1.0, output=2.0, cache_read=0.1, cache_write=1.25)
    # Cache rates left out are the input rate.
    assert prices["local"] == Price(input=0.0, output=0.0, cache_read=0.0, cache_write=0.0)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ([], "$: expected an object of models, got an array"),
        ({"m": 3}, "$.m: expected an object of rates, got a number"),
        ({"m": {"output": 1}}, "$.m.input: required"),
        ({"m": {"input": 1}}, "$.m.output: required"),
        ({"m": {"input": "1", "output": 1}}, "$.m.input: expected a number, got a string"),
        ({"m": {"input": True, "output": 1}}, "$.m.input: expected a number, got a boolean"),
        ({"m": {"input": -1, "output": 1}}, "$.m.input: expected a number >= 0, got -1"),
        ({"m": {"input": 1, "output": float("nan")}}, "$.m.output: expected a number >= 0"),
        ({"m": {"input": 1, "output": 1, "cached": 1}}, "$.m.cached: unknown rate"),
        ({"": {"input": 1, "output": 1}}, "$.: a model name must be a non-empty string"),
    ],
)
def test_parse_prices_names_the_problem(data: Any, problem: str) -> None:
    with pytest.raises(PriceError) as caught:
        parse_prices(data)
    assert str(caught.value).startswith(problem)
