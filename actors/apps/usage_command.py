"""``greenroom usage``: what the data dir's sessions cost, read from its usage ledger.

The ledger holds one row per model request with its tokens and its cost in USD, priced
when the request was made (R-SHARE-3); this command adds them up over a time range, per
session, principal or model. It reads the ledger read-only (a serving host may be writing
it) and starts nothing. Requests whose model had no price are counted apart, never priced.

``--since`` and ``--until`` take a date or time in ISO 8601 (``2026-12-01``,
``2026-12-01T09:30``, with a ``Z`` or an offset; without one it is UTC), ``today`` (the
start of the UTC day), or an age before now (``90m``, ``24h``, ``7d``). The range includes
``--since`` and excludes ``--until``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time

from greenroom.actors.apps.exits import EXIT_OK, UsageError, print_error
from greenroom.actors.apps.run import data_dir_from
from greenroom.actors.runtime import LEDGER_FILE_NAME, usage_report
from greenroom.protocols.budgets import period_start, usd
from greenroom.protocols.trace import UsageGrouping, UsageLine, UsageQuery

__all__ = ["parse_when", "usage_command"]

_AGO = re.compile(r"(\d+)([mhd])")
_UNIT_S = {"m": 60, "h": 3600, "d": 86_400}
_HEADINGS: dict[UsageGrouping, str] = {
    "session": "SESSION",
    "principal": "PRINCIPAL",
    "model": "MODEL",
}


def parse_when(text: str, now: float, *, flag: str) -> float:
    """A point in time (unix seconds) from ``--since`` / ``--until`` (see the module
    docstring); :class:`UsageError` naming ``flag`` for anything else."""
    value = text.strip()
    if value == "today":
        return period_start("day", now)
    ago = _AGO.fullmatch(value)
    if ago is not None:
        return now - int(ago.group(1)) * _UNIT_S[ago.group(2)]
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(
            f"{flag}: {text!r} is not a time: give an ISO date or time (2026-12-01, "
            "2026-12-01T09:30Z), 'today', or an age such as 90m, 24h, 7d"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def usage_command(args: argparse.Namespace) -> int:
    """``greenroom usage``: the report as a table on stdout (the range on stderr), or
    one JSON object per line with ``--json``."""
    now = time.time()
    since = parse_when(args.since, now, flag="--since") if args.since else None
    until = parse_when(args.until, now, flag="--until") if args.until else None
    if since is not None and until is not None and until <= since:
        raise UsageError("--until: must come after --since")
    by: UsageGrouping = args.by
    query = UsageQuery(since=since, until=until, principal=args.principal, by=by)
    ledger = data_dir_from(args.data_dir) / LEDGER_FILE_NAME
    lines = usage_report(ledger, query)
    if args.json:
        for line in lines:
            print(json.dumps(_json_line(by, line), ensure_ascii=False))
        return EXIT_OK
    print_error(f"usage {_range_words(since, until)}, by {by} ({ledger})")
    if not lines:
        print_error("no requests in that range")
        return EXIT_OK
    for row in _table(by, lines):
        print(row)
    unpriced = sum(line.unpriced for line in lines)
    if unpriced:
        print_error(
            f"{unpriced} request{'s' if unpriced != 1 else ''} of unknown price "
            "not counted in COST (give their model a price with --prices when running)"
        )
    return EXIT_OK


def _json_line(by: UsageGrouping, line: UsageLine) -> dict[str, object]:
    return {
        by: line.key,
        "requests": line.requests,
        "input": line.input,
        "output": line.output,
        "cache_read": line.cache_read,
        "cache_write": line.cache_write,
        "total": line.total,
        "cost_usd": line.cost_usd,
        "unpriced": line.unpriced,
    }


def _range_words(since: float | None, until: float | None) -> str:
    def moment(value: float) -> str:
        when = datetime.datetime.fromtimestamp(value, datetime.UTC)
        return when.strftime("%Y-%m-%d %H:%M UTC")

    start = "from the first request" if since is None else f"from {moment(since)}"
    return start + (" to now" if until is None else f" to {moment(until)}")


def _cost(line: UsageLine) -> str:
    if line.unpriced and line.unpriced == line.requests:
        return "unknown"
    words = usd(line.cost_usd)
    return f"{words} (+{line.unpriced} unpriced)" if line.unpriced else words


def _table(by: UsageGrouping, lines: list[UsageLine]) -> list[str]:
    total = UsageLine(
        key="total",
        requests=sum(line.requests for line in lines),
        input=sum(line.input for line in lines),
        output=sum(line.output for line in lines),
        cache_read=sum(line.cache_read for line in lines),
        cache_write=sum(line.cache_write for line in lines),
        cost_usd=sum(line.cost_usd for line in lines),
        unpriced=sum(line.unpriced for line in lines),
    )
    rows = [(_HEADINGS[by], "REQUESTS", "INPUT", "OUTPUT", "CACHE READ", "CACHE WRITE", "COST")]
    for line in (*lines, total):
        key = line.key if line.key is not None else "(none)"
        rows.append(
            (
                key,
                f"{line.requests:,}",
                f"{line.input:,}",
                f"{line.output:,}",
                f"{line.cache_read:,}",
                f"{line.cache_write:,}",
                _cost(line),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i in (0, len(row) - 1) else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
