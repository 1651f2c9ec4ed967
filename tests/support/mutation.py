"""Seeded mutations of well-formed JSON values, for the fuzz trials of the fronts: a field
dropped, given an odd value, or changed deeper down; an item of a list changed."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

ODD_VALUES: tuple[Any, ...] = (
    None, True, 0, -1, 2**70, 1.5, float("1e308"), "", "x" * 20_000, "a\ud800b", "\udfff",
    [], {}, [[[[["deep"]]]]], "../../etc/passwd", "\x00", "20990101-000000-abcdef",
)  # fmt: skip
"""Values no field expects: wrong types, lone surrogates, huge or deep, paths, ids."""


class JsonMutator:
    """Mutates JSON values in place with ``rng``: ``odd`` values are drawn from
    :data:`ODD_VALUES` and ``more_odd``; now and then a key of ``extra_keys`` is added."""

    def __init__(
        self,
        rng: random.Random,
        *,
        more_odd: Sequence[Any] = (),
        extra_keys: Sequence[str] = (),
        max_depth: int = 4,
    ) -> None:
        self.rng = rng
        self.odd_values = (*ODD_VALUES, *more_odd)
        self.extra_keys = tuple(extra_keys)
        self.max_depth = max_depth

    def odd(self) -> Any:
        return self.rng.choice(self.odd_values)

    def mutate(self, value: Any, depth: int = 0) -> Any:
        """``value`` changed in one drawn place (or an odd value instead of it)."""
        rng = self.rng
        if isinstance(value, dict) and value and rng.random() < 0.8:
            key = rng.choice(sorted(value))
            draw = rng.random()
            if draw < 0.3:
                del value[key]
            elif draw < 0.6 or depth >= self.max_depth:
                value[key] = self.odd()
            else:
                value[key] = self.mutate(value[key], depth + 1)
            if self.extra_keys and rng.random() < 0.1:
                value[rng.choice(self.extra_keys)] = self.odd()
            return value
        if isinstance(value, list) and value and rng.random() < 0.8:
            i = rng.randrange(len(value))
            value[i] = self.mutate(value[i], depth + 1) if rng.random() < 0.6 else self.odd()
            return value
        return self.odd()
