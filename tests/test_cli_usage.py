"""Costs on the command line (R-SHARE-3): ``--prices FILE``, the cost in the closing line,
and ``greenroom usage`` over the ledger — per session, principal or model, for a time
range, as a table or JSON lines. Subprocesses, as a user runs them, each with a timeout."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import trio
from test_cli import greenroom, json_lines

from greenroom.actors.runtime.trace_sink import TraceSink
from greenroom.protocols.budgets import usd
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import UsageRow

JAN_1 = 1_767_225_600.0
"""2026-01-01 00:00 UTC."""
DAY = 86_400.0


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_run_prices_its_requests_from_the_file_and_usage_reports_them(tmp_path: Path) -> None:
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"scripted": {"input": 3, "output": 15}}))
    data = str(tmp_path / "data")
    ran = greenroom(tmp_path, "run", "--data-dir", data, "--prices", str(prices), "--json", "hi")
    assert ran.returncode == 0, ran.stderr
    outputs = json_lines(ran.stdout)
    end = outputs[-1]
    assert end["type"] == "task_end"
    usage = end["usage"]
    by_hand = (usage["input"] * 3 + usage["output"] * 15) / 1e6
    assert usage["cost_usd"] == pytest.approx(by_hand) and by_hand > 0
    (request,) = [o["request"] for o in outputs if o["type"] == "token_usage"]
    assert request["cost_usd"] == pytest.approx(by_hand)

    human = greenroom(tmp_path, "run", "--data-dir", data, "--prices", str(prices), "hello")
    assert human.returncode == 0, human.stderr
    summary = human.stderr.splitlines()[-1]
    assert " tokens " in summary and "$0.0" in summary

    report = greenroom(tmp_path, "usage", "--data-dir", data, "--json")
    assert report.returncode == 0, report.stderr
    lines = json_lines(report.stdout)
    assert len(lines) == 2
    assert lines[[line["session"] for line in lines].index(end["session_id"])]["cost_usd"] == (
        pytest.approx(by_hand)
    )
    table = greenroom(tmp_path, "usage", "--data-dir", data)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == [
        "SESSION", "REQUESTS", "INPUT", "OUTPUT", "CACHE", "READ", "CACHE", "WRITE", "COST"
    ]  # fmt: skip
    total = table.stdout.splitlines()[-1].split()
    assert total[0] == "total" and total[1] == "2"
    assert total[-1] == usd(sum(line["cost_usd"] for line in lines))


def test_unpriced_runs_say_their_cost_is_unknown(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    ran = greenroom(tmp_path, "run", "--data-dir", data, "hi")
    assert ran.returncode == 0, ran.stderr
    assert "cost unknown" in ran.stderr.splitlines()[-1]
    report = greenroom(tmp_path, "usage", "--data-dir", data)
    assert report.stdout.splitlines()[-1].split()[-1] == "unknown"
    assert "1 request of unknown price not counted" in report.stderr


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not JSON"),
        ('{"m": {"input": 1}}', "$.m.output: required"),
        ('{"m": {"input": -2, "output": 1}}', "$.m.input: expected a number >= 0, got -2"),
        ("[1]", "$: expected an object of models"),
    ],
)
def test_a_bad_prices_file_is_one_line_naming_it(
    tmp_path: Path, content: str, problem: str
) -> None:
    bad = tmp_path / "prices.json"
    bad.write_text(content)
    for command in (["run", "hi"], ["serve", "--port", "0"]):
        result = greenroom(tmp_path, *command, "--prices", str(bad))
        one_line_error(result, f"--prices: {bad}:", problem)
    missing = greenroom(tmp_path, "run", "--prices", str(tmp_path / "nope.json"), "hi")
    one_line_error(missing, "nope.json: cannot read it: No such file or directory")


async def write_ledger(data_dir: Path, rows: list[UsageRow]) -> None:
    sink = TraceSink(data_dir)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for row in rows:
            sink.record_usage(row)
        await sink.aclose()


def row(session: str, at: float, model: str, cost: float | None, principal: str | None) -> UsageRow:
    return UsageRow(
        at=at, session_id=session, run_id="r", turn=1, kind="request", provider="p", model=model,
        usage=TokenUsage(input=1000, output=100, cost_usd=cost), principal=principal,
        root_id=session,
    )  # fmt: skip


def test_usage_adds_up_a_time_range_by_principal_and_model(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rows = [
        row("s1", JAN_1 + 10, "claude-sonnet-4-5", 0.5, "alice"),
        row("s1", JAN_1 + DAY + 10, "claude-sonnet-4-5", 0.25, "alice"),
        row("s2", JAN_1 + DAY + 20, "gpt-4o", 1.0, "bob"),
        row("s3", JAN_1 + 2 * DAY, "local-llama", None, None),
    ]
    trio.run(write_ledger, data, rows)

    def report(*flags: str) -> list[dict[str, object]]:
        result = greenroom(tmp_path, "usage", "--data-dir", str(data), "--json", *flags)
        assert result.returncode == 0, result.stderr
        return json_lines(result.stdout)

    by_principal = report("--by", "principal")
    summary = [(r["principal"], r["requests"], r["cost_usd"], r["unpriced"]) for r in by_principal]
    assert summary == [
        (None, 1, 0.0, 1), ("alice", 2, 0.75, 0), ("bob", 1, 1.0, 0)
    ]  # fmt: skip
    jan_2 = report("--by", "model", "--since", "2026-01-02", "--until", "2026-01-03T00:00Z")
    assert [(r["model"], r["cost_usd"]) for r in jan_2] == [
        ("claude-sonnet-4-5", 0.25), ("gpt-4o", 1.0)
    ]
    alice = report("--principal", "alice", "--until", "2026-01-02")
    assert [(r["session"], r["cost_usd"]) for r in alice] == [("s1", 0.5)]
    assert report("--since", "1d") == []  # nothing in the last day: the rows are of January

    table = greenroom(tmp_path, "usage", "--data-dir", str(data), "--by", "principal")
    assert table.returncode == 0, table.stderr
    first, *body = table.stdout.splitlines()
    assert first.split()[0] == "PRINCIPAL"
    assert [line.split()[0] for line in body] == ["(none)", "alice", "bob", "total"]
    assert body[-1].split()[-3:] == ["$1.75", "(+1", "unpriced)"]
    assert "from the first request to now, by principal" in table.stderr


def test_usage_refuses_a_time_it_cannot_read(tmp_path: Path) -> None:
    one_line_error(
        greenroom(tmp_path, "usage", "--since", "last week"),
        "--since: 'last week' is not a time",
    )
    one_line_error(
        greenroom(tmp_path, "usage", "--since", "2026-02-01", "--until", "2026-01-01"),
        "--until: must come after --since",
    )
    empty = greenroom(tmp_path, "usage")
    assert empty.returncode == 0 and "no requests in that range" in empty.stderr


def test_usage_names_a_damaged_ledger_and_what_to_do(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    trio.run(write_ledger, data, [row(f"s{i}", JAN_1 + i, "m", 0.1, "a") for i in range(300)])
    ledger = data / "usage.sqlite"
    whole = ledger.read_bytes()
    for damaged, reason in (
        (whole[: len(whole) // 2], "database disk image is malformed"),
        (b"not a database" * 100, "file is not a database"),
    ):
        ledger.write_bytes(damaged)
        for flags in ((), ("--json",), ("--by", "model")):
            one_line_error(
                greenroom(tmp_path, "usage", "--data-dir", str(data), *flags),
                f"the usage ledger {ledger} cannot be used ({reason}): move it aside",
            )


def test_serve_refuses_a_negative_budget(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "serve", "--principal-budget-usd", "-1")
    assert result.returncode == 2
    assert "--principal-budget-usd: must be 0 or more" in result.stderr
