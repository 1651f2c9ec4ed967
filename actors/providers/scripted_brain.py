"""The default script of the ``scripted`` provider: a small, honest, context-aware agent.

Without an API key, ``greenroom demo`` and ``greenroom run`` talk to this function. It is
called for every request and decides the next step from the request alone — the last user
prompt and the tool calls and results after it — like a real model would, so it works on
any workspace and in any session (continued, interrupted, denied):

* the sales task ("summarize the sales CSV files… revenue per region"):

  1. no tool used yet → "I'll look at the workspace first." + ``list_dir(".")``;
  2. the listing is in → one ``read_file`` per ``.csv`` file, all in ONE message, so they
     run in parallel slots of the tool pool (no CSV → it says so and stops);
  3. the contents are in → it parses the CSV text, sums ``units * unit_price`` (or a
     revenue column) per region and answers with a table.

  A denied or failed tool call is reported as such, never papered over.
* anything else: a reply that echoes the prompt and explains that this is the scripted
  model (no API key), without tools.
* a task that requires an output schema (R-OUT-1) gets, where it would answer, the JSON of
  the schema's simplest value instead (:func:`~greenroom.protocols.structured.example_value`).

Deterministic: the same request gives the same reply. Text streams word by word with a
small delay so a terminal shows it arriving; the whole demo takes well under three seconds.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation

import attrs

from greenroom.actors.providers.scripted import ScriptedStream
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, Message, ModelRequest, ToolResult
from greenroom.protocols.structured import example_value

DEMO_PROMPT = "Summarize the sales CSV files in this workspace: total revenue per region."
"""The task ``greenroom demo`` runs (on this script, or on a real model with a key)."""

CHUNK_DELAY_S = 0.012
"""Pause between streamed words: visible streaming, yet the demo ends in about two seconds."""

Brain = Callable[[ModelRequest, ScriptedStream], Awaitable[None]]

_TASK_WORDS = re.compile(r"\b(csv|sales|revenue)\b", re.IGNORECASE)
_MARKER_PREFIXES = tuple(
    f"[{tag}]"
    for tag in (
        markers.USER_STEERING,
        markers.TURN_ABORTED,
        markers.TURN_RETRIED,
        markers.CONTEXT_SUMMARY,
    )
)
# read_file numbers every line as "<spaces><n>\t<text>"; notes it appends start with "[".
_NUMBERED_LINE = re.compile(r"^\s*\d+\t(.*)$")
_REVENUE_COLUMNS = ("revenue", "amount", "total", "sales")


@attrs.frozen(kw_only=True, slots=True)
class _Situation:
    """What the request says about the task in progress."""

    prompt: str
    earlier_prompts: int
    turn: int
    calls: tuple[ToolCallBlock, ...]
    results: dict[str, ToolResult]


def make_demo_brain(chunk_delay_s: float = CHUNK_DELAY_S) -> Brain:
    """The demo script with another streaming pace (tests use 0 for speed)."""

    async def brain(request: ModelRequest, stream: ScriptedStream) -> None:
        await _respond(request, stream, chunk_delay_s)

    return brain


async def demo_brain(request: ModelRequest, stream: ScriptedStream) -> None:
    """Answer one request of the scripted provider; see the module docstring."""
    await _respond(request, stream, CHUNK_DELAY_S)


async def _respond(request: ModelRequest, stream: ScriptedStream, delay: float) -> None:
    title_of = _title_request(request)
    if title_of is not None:
        await stream.text(_title(title_of))
        await stream.end()
        return
    situation = _read_situation(request.messages)
    if request.output is not None and not _TASK_WORDS.search(situation.prompt):
        await stream.text(json.dumps(example_value(request.output.schema)), chunk_delay_s=delay)
        await stream.end()
        return
    steering = _steering(request.messages)
    if steering:
        # A real model would take steering into account; this one at least shows it read it.
        await stream.text(f'Noted: "{_one_line(steering, 160)}".', chunk_delay_s=delay)
    if not _TASK_WORDS.search(situation.prompt):
        await stream.text(_generic_reply(situation), chunk_delay_s=delay)
        await stream.end()
        return
    listings = [c for c in situation.calls if c.name == "list_dir"]
    reads = [c for c in situation.calls if c.name == "read_file"]
    tool_names = {tool.name for tool in request.tools}
    if not listings and not reads:
        if "list_dir" not in tool_names:
            await stream.text(
                "I can't look at the workspace: the list_dir tool isn't available in this "
                "session (were the built-in tools turned off?). Enable it and ask again.",
                chunk_delay_s=delay,
            )
            await stream.end()
            return
        await stream.text("I'll look at the workspace first.", chunk_delay_s=delay)
        await stream.tool_call(
            ToolCallBlock(id=_call_id(situation.turn, 1), name="list_dir", arguments={"path": "."})
        )
        await stream.end("tool_use")
        return
    if not reads:
        await _after_listing(situation, listings[-1], tool_names, stream, delay)
        return
    answer = _final_answer(situation, reads)
    if request.output is not None:
        answer = json.dumps(example_value(request.output.schema))
    await stream.text(answer, chunk_delay_s=delay)
    await stream.end()


async def _after_listing(
    situation: _Situation,
    listing: ToolCallBlock,
    tool_names: set[str],
    stream: ScriptedStream,
    delay: float,
) -> None:
    result = situation.results.get(listing.id)
    if result is None or result.is_error:
        await stream.text(
            f"I couldn't list the workspace: {_failure(result)}. So I can't find the sales "
            "files or compute revenue per region. Allow the list_dir call (or tell me the "
            "file names) and I'll continue.",
            chunk_delay_s=delay,
        )
        await stream.end()
        return
    csv_files = _csv_files(_result_text(result))
    if not csv_files:
        await stream.text(
            "The workspace has no CSV files at its top level, so there is no sales data "
            "to summarize. Add the CSV files (or tell me where they are) and ask again.",
            chunk_delay_s=delay,
        )
        await stream.end()
        return
    if "read_file" not in tool_names:
        await stream.text(
            f"I found {_count(len(csv_files), 'CSV file')} ({', '.join(csv_files)}), but the "
            "read_file tool isn't available in this session, so I can't read them.",
            chunk_delay_s=delay,
        )
        await stream.end()
        return
    await stream.text(
        f"I found {_count(len(csv_files), 'CSV file')}: {', '.join(csv_files)}. "
        "I'll read them all at once.",
        chunk_delay_s=delay,
    )
    for n, name in enumerate(csv_files, start=1):
        await stream.tool_call(
            ToolCallBlock(
                id=_call_id(situation.turn, n), name="read_file", arguments={"path": name}
            )
        )
    await stream.end("tool_use")


# -- reading the request ---------------------------------------------------------------


def _title_request(request: ModelRequest) -> str | None:
    """The conversation's opening when ``request`` asks for a title (R-HOST-5), else None."""
    if request.tools or request.system is not None or len(request.messages) != 1:
        return None
    (message,) = request.messages
    texts = [p.text for p in message.content if isinstance(p, TextBlock)]
    if len(texts) != 1 or not texts[0].startswith(markers.TITLE_PROMPT):
        return None
    return texts[0][len(markers.TITLE_PROMPT) :].strip()


def _title(opening: str) -> str:
    """A title from the first words of the opening, as a model might write it."""
    words = re.sub(r"[^\w\s'-]", " ", opening.split("\n", 1)[0]).split()[:6]
    title = " ".join(words)
    return title[:1].upper() + title[1:] if title else "A conversation"


def _read_situation(messages: tuple[Message, ...]) -> _Situation:
    """Find the last real user prompt and collect the tool calls and results after it."""
    prompt_index = -1
    prompt = ""
    earlier = 0
    for index, message in enumerate(messages):
        if isinstance(message, AssistantMessage):
            continue
        texts = [
            part.text
            for part in message.content
            if isinstance(part, TextBlock) and not part.text.startswith(_MARKER_PREFIXES)
        ]
        if texts:
            if prompt_index >= 0:
                earlier += 1
            prompt_index = index
            prompt = "\n".join(texts).strip()
    calls: list[ToolCallBlock] = []
    results: dict[str, ToolResult] = {}
    for message in messages[prompt_index + 1 :]:
        for part in message.content:
            if isinstance(part, ToolCallBlock):
                calls.append(part)
            elif isinstance(part, ToolResult):
                results[part.call_id] = part
    # Counting every assistant message of the context keeps call ids unique across the
    # whole session, also when a continued session runs the same task again.
    turn = 1 + sum(isinstance(m, AssistantMessage) for m in messages)
    return _Situation(
        prompt=prompt, earlier_prompts=earlier, turn=turn, calls=tuple(calls), results=results
    )


def _steering(messages: tuple[Message, ...]) -> str:
    """The steering text sent with the newest user message, if any (R-STEER-2)."""
    if not messages or isinstance(messages[-1], AssistantMessage):
        return ""
    opening, closing = f"[{markers.USER_STEERING}]", f"[/{markers.USER_STEERING}]"
    notes = [
        part.text.removeprefix(opening).removesuffix(closing).strip()
        for part in messages[-1].content
        if isinstance(part, TextBlock) and part.text.startswith(opening)
    ]
    return " ".join(n for n in notes if n)


def _result_text(result: ToolResult) -> str:
    return "\n".join(b.text for b in result.content if isinstance(b, TextBlock))


def _csv_files(listing: str) -> list[str]:
    """``.csv`` file names of a ``list_dir`` result ("name  (N bytes)" lines)."""
    names: list[str] = []
    for line in listing.splitlines():
        name = re.sub(r"\s+\(\d+ bytes\)$", "", line.strip())
        if name.lower().endswith(".csv") and not name.startswith("["):
            names.append(name)
    return names


# -- the answers -----------------------------------------------------------------------


@attrs.define
class _Region:
    rows: int = 0
    units: Decimal = Decimal(0)
    revenue: Decimal = Decimal(0)


def _final_answer(situation: _Situation, reads: list[ToolCallBlock]) -> str:
    regions: dict[str, _Region] = {}
    used: list[str] = []
    problems: list[str] = []
    for call in reads:
        path = str(call.arguments.get("path", "?"))
        result = situation.results.get(call.id)
        if result is None or result.is_error:
            problems.append(f"{path}: {_failure(result)}")
            continue
        added, problem = _add_csv(_strip_line_numbers(_result_text(result)), regions)
        if problem is not None:
            problems.append(f"{path}: {problem}")
        if added:
            used.append(path)
    lines: list[str] = []
    if regions:
        lines.append(f"Total revenue per region, from {', '.join(used)}:")
        lines.append("")
        lines.extend(_table(regions))
    else:
        lines.append("I couldn't compute revenue per region: none of the files gave me data.")
    if problems:
        lines.append("")
        lines.append("Not included:" if regions else "What went wrong:")
        lines.extend(f"- {p}" for p in problems)
        if regions:
            lines.append("")
            lines.append("The totals above leave these out.")
    elif regions:
        best = max(regions.items(), key=lambda item: (item[1].revenue, item[0]))
        lines.append("")
        lines.append(f"{best[0]} leads with {_money(best[1].revenue)} in revenue.")
    return "\n".join(lines)


def _failure(result: ToolResult | None) -> str:
    """An honest account of a tool call that gave no data."""
    if result is None:
        return "no result came back"
    if result.status == "denied":
        # The result says who denied it, and why (a hook gives its reason: R-HOOK-2).
        return f'the call was denied ("{_one_line(_result_text(result))}")'
    if result.status == "interrupted":
        return "the call was interrupted before it finished"
    return f"the tool failed ({result.status}: {_one_line(_result_text(result))})"


def _strip_line_numbers(text: str) -> str:
    rows: list[str] = []
    for line in text.splitlines():
        match = _NUMBERED_LINE.match(line)
        if match is not None:
            rows.append(match.group(1))
        elif not line.startswith("["):
            rows.append(line)
    return "\n".join(rows)


def _add_csv(text: str, regions: dict[str, _Region]) -> tuple[int, str | None]:
    """Add one file's rows to ``regions``: how many rows were added, and what was wrong
    with the file (None when nothing was)."""
    reader = csv.DictReader(text.splitlines())
    fields = {(name or "").strip().lower(): name for name in reader.fieldnames or []}
    region_key = fields.get("region")
    if region_key is None:
        return 0, "no 'region' column"
    revenue_key = next((fields[c] for c in _REVENUE_COLUMNS if c in fields), None)
    units_key, price_key = fields.get("units"), fields.get("unit_price")
    if revenue_key is None and (units_key is None or price_key is None):
        return 0, "no revenue column (nor units and unit_price)"
    added = bad = 0
    for row in reader:
        try:
            units = Decimal((row.get(units_key) or "0").strip()) if units_key else Decimal(0)
            if revenue_key is not None:
                revenue = Decimal((row.get(revenue_key) or "").strip())
            else:
                assert price_key is not None
                revenue = units * Decimal((row.get(price_key) or "").strip())
        except (InvalidOperation, AttributeError):
            bad += 1
            continue
        region = (row.get(region_key) or "").strip() or "(no region)"
        entry = regions.setdefault(region, _Region())
        entry.rows += 1
        entry.units += units
        entry.revenue += revenue
        added += 1
    if bad:
        return added, f"{_count(bad, 'row')} with unreadable numbers left out"
    return added, None if added else "no data rows"


def _table(regions: dict[str, _Region]) -> list[str]:
    ordered = sorted(regions.items(), key=lambda item: (-item[1].revenue, item[0]))
    total = _Region()
    for _, entry in ordered:
        total.rows += entry.rows
        total.units += entry.units
        total.revenue += entry.revenue
    lines = ["| Region | Rows | Units | Revenue |", "|---|---:|---:|---:|"]
    for name, entry in [*ordered, ("Total", total)]:
        lines.append(f"| {name} | {entry.rows} | {entry.units:,} | {_money(entry.revenue)} |")
    return lines


def _money(value: Decimal) -> str:
    return f"{value.quantize(Decimal('0.01')):,}"


def _generic_reply(situation: _Situation) -> str:
    asked = _one_line(situation.prompt, 160) or "(an empty prompt)"
    history = (
        f" This session already holds {_count(situation.earlier_prompts, 'earlier prompt')}."
        if situation.earlier_prompts
        else ""
    )
    return (
        f'You asked: "{asked}".{history}\n\n'
        "I'm greenroom's built-in scripted model: no ANTHROPIC_API_KEY is set, so no real "
        'model is answering. I only know one task — try: "' + DEMO_PROMPT + '" '
        "(or run `greenroom demo`). Set ANTHROPIC_API_KEY, or use `--provider openai "
        "--base-url URL`, to work with a real model."
    )


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _call_id(turn: int, n: int) -> str:
    return f"call_{turn}_{n}"
