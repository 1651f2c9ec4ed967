"""Loop guards (R-GUARD-1) as a pure state machine fed once per finished turn.

Two patterns end a task with ``loop_detected``:

* the same tool call — same tool, same arguments — in ``repeat_threshold`` turns in a row;
* ``no_progress_threshold`` turns in a row that made no progress: every tool call of the
  turn ended in an error (failed, denied, truncated), so nothing the model did worked.

A threshold ≤ 0 turns that guard off.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from greenroom.protocols.content import ToolCallBlock


def call_signature(call: ToolCallBlock) -> str:
    """Tool name and canonical arguments: equal for calls that do the same thing."""
    args = call.invalid_arguments
    if args is None:
        args = json.dumps(call.arguments, sort_keys=True, ensure_ascii=False)
    return f"{call.name} {args}"


class LoopGuard:
    """Counts repeated calls and unproductive turns across the turns of one task."""

    __slots__ = ("_no_progress", "_no_progress_threshold", "_repeat_threshold", "_streaks")

    def __init__(self, *, repeat_threshold: int, no_progress_threshold: int) -> None:
        self._repeat_threshold = repeat_threshold
        self._no_progress_threshold = no_progress_threshold
        self._streaks: dict[str, int] = {}
        self._no_progress = 0

    @property
    def streaks(self) -> tuple[tuple[str, int], ...]:
        """How many turns in a row each call signature of the last turn was made."""
        return tuple(sorted(self._streaks.items()))

    @property
    def no_progress(self) -> int:
        """How many turns in a row ended with every call failed."""
        return self._no_progress

    def observe_turn(self, calls: Iterable[ToolCallBlock], errors: Iterable[bool]) -> str | None:
        """Record one finished turn; returns the reason when a loop is detected."""
        signatures = {call_signature(c) for c in calls}
        self._streaks = {s: self._streaks.get(s, 0) + 1 for s in signatures}
        if self._repeat_threshold > 0:
            for signature, count in self._streaks.items():
                if count >= self._repeat_threshold:
                    return (
                        f"loop detected: the same tool call ({signature[:200]}) was made "
                        f"in {count} turns in a row"
                    )
        outcomes = list(errors)
        if outcomes and all(outcomes):
            self._no_progress += 1
        else:
            self._no_progress = 0
        if 0 < self._no_progress_threshold <= self._no_progress:
            return (
                f"loop detected: {self._no_progress} turns in a row made no progress "
                "(every tool call failed or was denied)"
            )
        return None
