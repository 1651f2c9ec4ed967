"""Replay a recorded session on another model (R-FORK-3): the pure parts.

A replay reads what the user gave a session — each task's prompt and the output schema it
held the answer to, the steering it got and the turn that took it, its follow-ups (each a
task of its own) — from the session's trace (:func:`recorded_tasks`), and runs it again in
a fork on another model. The model's tool calls are answered by the record where it can:
a call equal to a recorded one (same tool name, same arguments as canonical JSON:
:func:`call_key`) gets that call's recorded result and does not run
(:class:`RecordedResults`, first recorded first). What each side did is put side by side
in a :class:`ReplayReport` — answers, tool calls (``same``: answered from the record;
``different``: no recorded call matched, it ran or failed; ``denied``: no recorded call
matched and the tool may have side effects, so it was not run), tokens, cost and wall
time — rendered for people by :func:`render_report` and for machines by
:meth:`ReplayReport.to_dict`.
"""

from __future__ import annotations

import json
import textwrap
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import zip_longest
from typing import Any, Literal

import attrs

from greenroom.protocols.content import TextBlock, ToolCallBlock, ToolContent, UserContent
from greenroom.protocols.history import live_records
from greenroom.protocols.outputs import (
    ModelMsg,
    Output,
    RequestBegin,
    TaskEnd,
    TaskStart,
    ToolCallOutput,
    ToolStatus,
    UserMsg,
)
from greenroom.protocols.stream import TokenUsage

__all__ = [
    "CallLine",
    "Outcome",
    "Outcomes",
    "RecordedCall",
    "RecordedResults",
    "RecordedTask",
    "ReplayReport",
    "ReplayedTask",
    "Side",
    "call_key",
    "recorded_tasks",
    "render_report",
]

Outcome = Literal["same", "different", "denied"]
"""What became of a replay's tool call: answered from the record, not matched (it ran, or
failed), not matched and not run (the tool may have side effects)."""


def call_key(name: str, arguments: Mapping[str, Any]) -> str:
    """What makes two tool calls equal for a replay: the tool's name and its arguments as
    canonical JSON (keys sorted, no spaces, text as it is)."""
    canonical = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{name}\n{canonical}"


@attrs.frozen(kw_only=True)
class RecordedCall:
    """A tool call of the recorded session, with its result (``status`` None: it has none,
    the trace ends first)."""

    name: str
    arguments: Mapping[str, Any]
    status: ToolStatus | None = None
    is_error: bool = False
    content: tuple[ToolContent, ...] = ()


class RecordedResults:
    """The recorded results by :func:`call_key`: the n-th equal call of a replay takes the
    n-th recorded result of that call; once they are used up, the call is a new one."""

    __slots__ = ("_results",)

    def __init__(self, calls: Iterable[RecordedCall]) -> None:
        self._results: dict[str, deque[RecordedCall]] = {}
        for call in calls:
            if call.status is not None:
                self._results.setdefault(call_key(call.name, call.arguments), deque()).append(call)

    def take(self, name: str, arguments: Mapping[str, Any]) -> RecordedCall | None:
        """The next recorded result of a call equal to this one, or None."""
        queue = self._results.get(call_key(name, arguments))
        return queue.popleft() if queue else None


class Outcomes:
    """What a replay made of each of its calls (:data:`Outcome`), noted as each is decided:
    by call id — or, for a call of a tool that has an argument named ``ctx`` (the name a
    tool's context would take, so the call runs without one that names it), by
    :func:`call_key`, the n-th equal call taking the n-th outcome noted for such calls."""

    __slots__ = ("_by_call", "_by_id")

    def __init__(self) -> None:
        self._by_id: dict[str, Outcome] = {}
        self._by_call: dict[str, deque[Outcome]] = {}

    def note(
        self, outcome: Outcome, *, call_id: str | None, name: str, arguments: Mapping[str, Any]
    ) -> None:
        """Note the ``outcome`` of the call ``call_id`` (None: not known) of tool ``name``
        with ``arguments``."""
        if call_id is not None:
            self._by_id[call_id] = outcome
        else:
            self._by_call.setdefault(call_key(name, arguments), deque()).append(outcome)

    def take(self, call: ToolCallBlock) -> Outcome:
        """The outcome of ``call`` (asked once per call, in call order); ``different``
        when none was noted (its tool never ran it: its arguments were invalid, say)."""
        outcome = self._by_id.get(call.id)
        if outcome is not None:
            return outcome
        queue = self._by_call.get(call_key(call.name, call.arguments))
        return queue.popleft() if queue else "different"


@attrs.frozen(kw_only=True)
class RecordedTask:
    """One task of the recorded session: what the user gave it and what it did."""

    prompt: tuple[UserContent, ...]
    prompt_seq: int
    """The ``seq`` of its prompt (a replay forks just before the first task's)."""
    output_schema: dict[str, Any] | None = None
    """The schema its answer was held to (its ``task_start``'s, R-OUT-1), as recorded."""
    steering: tuple[tuple[int, tuple[UserContent, ...]], ...] = ()
    """Each steering input with the turn whose request took it."""
    answer: str = ""
    calls: tuple[RecordedCall, ...] = ()
    status: str | None = None
    """Its ``task_end`` status; None when the trace ends inside it."""
    usage: TokenUsage = attrs.field(factory=TokenUsage)
    wall_ms: int = 0


def recorded_tasks(records: Sequence[Output]) -> list[RecordedTask]:
    """The tasks of a session's trace (every file, in order), rewinds applied: the user's
    inputs and what each task did. Outputs forwarded from subagents are left out (a
    subagent's work is its parent's tool call)."""
    tasks: list[RecordedTask] = []
    current: dict[str, Any] | None = None
    prompt: UserMsg | None = None
    waiting_steering: list[tuple[UserContent, ...]] = []
    for record in live_records(records):
        if record.origin is not None:
            continue
        match record:
            case UserMsg(kind="prompt"):
                prompt = record
            case TaskStart() if prompt is not None:
                current = {
                    "prompt": prompt,
                    "output_schema": record.output_schema,
                    "steering": [],
                    "texts": [],
                    "calls": {},
                }
                prompt = None
            case UserMsg() if current is not None:
                waiting_steering.append(record.content)
            case RequestBegin() if current is not None:
                current["texts"] = []
                current["steering"] += [(record.turn, c) for c in waiting_steering]
                waiting_steering = []
            case ModelMsg() if current is not None:
                block = record.block
                if isinstance(block, TextBlock):
                    current["texts"].append(block.text)
                elif isinstance(block, ToolCallBlock):
                    current["calls"][block.id] = RecordedCall(
                        name=block.name, arguments=block.arguments
                    )
            case ToolCallOutput() if current is not None and record.call_id in current["calls"]:
                current["calls"][record.call_id] = attrs.evolve(
                    current["calls"][record.call_id],
                    status=record.status,
                    is_error=record.is_error,
                    content=record.content,
                )
            case TaskEnd() if current is not None:
                tasks.append(_task(current, record))
                current = None
            case _:
                pass  # approvals, usage, compactions: the task's end says what they came to
    if current is not None:
        tasks.append(_task(current, None))
    return tasks


def _task(current: Mapping[str, Any], end: TaskEnd | None) -> RecordedTask:
    prompt: UserMsg = current["prompt"]
    return RecordedTask(
        prompt=prompt.content,
        prompt_seq=prompt.seq or 0,
        output_schema=current["output_schema"],
        steering=tuple(current["steering"]),
        answer="\n".join(t for t in current["texts"] if t),
        calls=tuple(current["calls"].values()),
        status=None if end is None else end.status,
        usage=TokenUsage() if end is None else end.usage,
        wall_ms=0 if end is None else end.wall_ms,
    )


# -- the report --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CallLine:
    """One tool call as the report shows it; ``outcome`` for a replay's call only."""

    name: str
    arguments: Mapping[str, Any]
    outcome: Outcome | None = None

    def text(self) -> str:
        """``name {"arg":…}`` and the outcome, if any."""
        canonical = call_key(self.name, self.arguments).split("\n", 1)[1]
        shown = f"{self.name} {canonical}"
        return shown if self.outcome is None else f"{shown} [{self.outcome}]"


@attrs.frozen(kw_only=True)
class Side:
    """What one side (the recorded session, or the replay) did for one task."""

    answer: str
    calls: tuple[CallLine, ...]
    tokens: int
    cost_usd: float | None
    wall_ms: int
    status: str | None


@attrs.frozen(kw_only=True)
class ReplayedTask:
    """One task, both sides; ``undelivered`` counts steering inputs the replay's task
    ended before reaching the turn of."""

    prompt: str
    original: Side
    replay: Side
    undelivered: int = 0


@attrs.frozen(kw_only=True)
class ReplayReport:
    """A replay, side by side with its recorded session."""

    source_id: str
    replay_id: str
    original_model: str
    replay_model: str
    tasks: tuple[ReplayedTask, ...]

    def outcomes(self) -> dict[str, int]:
        """How many of the replay's calls were ``same``, ``different`` and ``denied``."""
        counts = {"same": 0, "different": 0, "denied": 0}
        for task in self.tasks:
            for call in task.replay.calls:
                if call.outcome is not None:
                    counts[call.outcome] += 1
        return counts

    def totals(self) -> dict[str, dict[str, Any]]:
        """Tokens, cost (None when a price was unknown) and wall time of each side."""
        return {
            name: {
                "tokens": sum(s.tokens for s in sides),
                "cost_usd": None
                if any(s.cost_usd is None for s in sides)
                else sum(s.cost_usd or 0.0 for s in sides),
                "wall_ms": sum(s.wall_ms for s in sides),
            }
            for name, sides in (
                ("original", [t.original for t in self.tasks]),
                ("replay", [t.replay for t in self.tasks]),
            )
        }

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able data (``greenroom replay --json``)."""
        data: dict[str, Any] = attrs.asdict(self)
        data["tool_calls"] = self.outcomes()
        data["totals"] = self.totals()
        return data


_COLUMN = 44


def render_report(report: ReplayReport) -> str:
    """The report for people: per task, the two sides in columns, then the totals."""
    lines = [
        f"replay of {report.source_id} as {report.replay_id}",
        "",
    ]
    head = ("", f"original ({report.original_model})", f"replay ({report.replay_model})")
    for number, task in enumerate(report.tasks, start=1):
        lines.append(f"task {number}: {_one_line(task.prompt)}")
        lines.extend(_rows([head], indent=2))
        rows: list[tuple[str, str, str]] = [
            ("answer", task.original.answer or "(none)", task.replay.answer or "(none)"),
            (
                "tool calls",
                "\n".join(c.text() for c in task.original.calls) or "(none)",
                "\n".join(c.text() for c in task.replay.calls) or "(none)",
            ),
            ("tokens", str(task.original.tokens), str(task.replay.tokens)),
            ("cost", _cost(task.original.cost_usd), _cost(task.replay.cost_usd)),
            ("time", _seconds(task.original.wall_ms), _seconds(task.replay.wall_ms)),
            ("status", task.original.status or "(open)", task.replay.status or "(open)"),
        ]
        lines.extend(_rows(rows, indent=2))
        if task.undelivered:
            lines.append(
                f"  note: the replay's task ended before {task.undelivered} steering "
                "input(s) of the recorded one were due"
            )
        lines.append("")
    totals = report.totals()
    original, replay = totals["original"], totals["replay"]
    lines.append("totals")
    lines.extend(
        _rows(
            [
                ("tokens", str(original["tokens"]), str(replay["tokens"])),
                ("cost", _cost(original["cost_usd"]), _cost(replay["cost_usd"])),
                ("time", _seconds(original["wall_ms"]), _seconds(replay["wall_ms"])),
            ],
            indent=2,
        )
    )
    counts = report.outcomes()
    lines.append(
        f"tool calls of the replay: {counts['same']} same (answered from the record, not "
        f"run), {counts['different']} different, {counts['denied']} denied (side effects, "
        "not run)"
    )
    return "\n".join(lines) + "\n"


def _rows(rows: Sequence[tuple[str, str, str]], *, indent: int) -> list[str]:
    out: list[str] = []
    for label, left, right in rows:
        left_lines = _wrap(left)
        right_lines = _wrap(right)
        for i, (a, b) in enumerate(zip_longest(left_lines, right_lines, fillvalue="")):
            name = label if i == 0 else ""
            out.append(f"{' ' * indent}{name:<11}{a:<{_COLUMN}}  {b}".rstrip())
    return out


def _wrap(text: str) -> list[str]:
    wrapped: list[str] = []
    for paragraph in text.splitlines() or [""]:
        wrapped.extend(textwrap.wrap(paragraph, _COLUMN) or [""])
    return wrapped


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:79] + "…"


def _cost(cost: float | None) -> str:
    return "unknown" if cost is None else f"${cost:.4f}"


def _seconds(ms: int) -> str:
    return f"{ms / 1000:.1f} s"
