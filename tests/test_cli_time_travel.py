"""``greenroom fork``, ``rewind`` and ``replay`` (R-FORK-1..3) as a person runs them: real
processes, the data dir of the test, and for replay the real anthropic client against the
loopback wire mock. A replay that repeats a recorded side-effecting call runs it zero
times; bad input is one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import trio
from test_cli import greenroom, greenroom_async, json_lines

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from tests.support import mock_model_server as wire

PAY_TOOL = '''
from pathlib import Path

from greenroom import tool
from greenroom.protocols import ToolContext


@tool
async def pay(invoice: str, ctx: ToolContext) -> str:
    """Pay an invoice: a side effect, written to payments.log in the workspace."""
    with open(Path(ctx.workspace_dir) / "payments.log", "a", encoding="utf-8") as log:
        log.write(invoice + "\\n")
    return f"paid {invoice}"
'''


async def two_task_session(data_dir: Path, workspace: Path) -> str:
    async with Host.open(data_dir) as host:
        provider = ScriptedProvider([Reply(blocks=(text("one"),)), Reply(blocks=(text("two"),))])
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await session.run("first").result()
        await session.run("second").result()
        return session.id


def test_fork_and_rewind_from_the_command_line(tmp_path: Path, workspace: Path) -> None:
    data_dir = tmp_path / "home"
    source = trio.run(two_task_session, data_dir, workspace)
    trace = data_dir / "sessions" / source / "trace_001.jsonl"
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    first_end = next(r["seq"] for r in records if r["type"] == "task_end")
    before = trace.read_bytes()

    forked = greenroom(tmp_path, "fork", source, "--at", str(first_end))
    assert forked.returncode == 0, forked.stderr
    fork_id = forked.stdout.strip()
    assert f"forked {source} at seq {first_end}" in forked.stderr
    fork_meta = json.loads((data_dir / "sessions" / fork_id / "session.json").read_text())
    assert fork_meta["forked_from"] == {"session_id": source, "seq": first_end}
    as_json = greenroom(tmp_path, "fork", source, "--json")
    assert json.loads(as_json.stdout)["forked_from"] == {
        "session_id": source,
        "seq": records[-1]["seq"],
    }
    assert trace.read_bytes() == before

    rewound = greenroom(tmp_path, "rewind", source, "--to", str(first_end), "--json")
    assert rewound.returncode == 0, rewound.stderr
    assert json.loads(rewound.stdout) == {
        "session_id": source,
        "to_seq": first_end,
        "seq": records[-1]["seq"] + 1,
    }
    shown = greenroom(tmp_path, "trace", source)
    assert f"rewind            to seq {first_end}" in shown.stdout

    for args, message in [
        (("fork", "nope"), "greenroom fork: no session 'nope'"),
        (("fork", source, "--at", "999"), "greenroom fork: seq 999 is out of range"),
        (("fork", source, "--at", "x"), "argument --at: expected a whole number"),
        (("rewind", source, "--to", "999"), "greenroom rewind: cannot rewind session"),
        (("rewind", source, "--to", str(records[-1]["seq"])), "was cut from the history"),
        (("rewind", "nope", "--to", "0"), "greenroom rewind: no session 'nope'"),
        (("rewind", source), "the following arguments are required: --to"),
        (("replay", source), "the following arguments are required: --provider"),
        (("replay", "nope", "--provider", "scripted"), "greenroom replay: no session 'nope'"),
    ]:
        result = greenroom(tmp_path, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


async def test_a_replay_on_the_wire_runs_a_recorded_payment_zero_times(
    tmp_path: Path, workspace: Path
) -> None:
    """R-FORK-3 through the real anthropic client: a session pays invoice A; its replay's
    model pays A again (answered from the record: not run) and B (denied: not run), and
    the report says so; payments.log holds A once."""
    (tmp_path / "pay.py").write_text(PAY_TOOL, encoding="utf-8")
    env = {"ANTHROPIC_API_KEY": "test-key"}
    recorded = (
        wire.Reply(
            [wire.Text("Paying."), wire.ToolUse("toolu_1", "pay", {"invoice": "A"})],
            stop_reason="tool_use",
        ),
        wire.Reply([wire.Text("Invoice A is paid.")]),
    )
    common = ("--provider", "anthropic", "--model", "mock-model", "--tools", "pay.py")
    async with wire.open_mock_server(*recorded) as server:
        run = await greenroom_async(
            tmp_path, "run", "--json", *common, "--base-url", server.base_url,
            "--approve", "all", "--workspace", str(workspace), "--no-builtin-tools",
            "pay invoice A", env=env,
        )  # fmt: skip
        server.assert_clean()
    assert run.returncode == 0, run.stderr.decode()
    source = json_lines(run.stdout.decode())[0]["session_id"]
    assert (workspace / "payments.log").read_text() == "A\n"

    replayed = (
        wire.Reply(
            [
                wire.ToolUse("toolu_9", "pay", {"invoice": "A"}),
                wire.ToolUse("toolu_10", "pay", {"invoice": "B"}),
            ],
            stop_reason="tool_use",
        ),
        wire.Reply([wire.Text("A was paid; B was not.")]),
    )
    async with wire.open_mock_server(*replayed) as server:
        replay = await greenroom_async(
            tmp_path, "replay", source, *common, "--base-url", server.base_url, "--json",
            "--no-builtin-tools", env=env,
        )  # fmt: skip
        server.assert_clean()
        results = server.requests[1].messages[-1]["content"]
    assert replay.returncode == 0, replay.stderr.decode()
    assert (workspace / "payments.log").read_text() == "A\n"  # zero runs in the replay
    report = json.loads(replay.stdout.decode())
    assert report["tool_calls"] == {"same": 1, "different": 0, "denied": 1}
    (task,) = report["tasks"]
    assert task["original"]["answer"] == "Invoice A is paid."
    assert task["replay"]["answer"] == "A was paid; B was not."
    assert [c["outcome"] for c in task["replay"]["calls"]] == ["same", "denied"]
    assert task["original"]["tokens"] > 0 and task["replay"]["tokens"] > 0
    by_id = {r["tool_use_id"]: json.dumps(r["content"]) for r in results}
    assert "paid A" in by_id["toolu_9"]
    assert "was not run" in by_id["toolu_10"]
    assert report["source_id"] == source and report["replay_id"] != source


def test_a_trace_line_with_a_seq_too_long_to_read_is_a_damaged_line(
    tmp_path: Path, workspace: Path
) -> None:
    """A line whose ``seq`` has 5,000 digits (past Python's 4,300 for an integer) made
    ``fork`` print a traceback. It is a damaged line, as one of 25 digits is: ``fork``
    leaves both out, ``trace`` names both in words, without Python's advice."""
    data_dir = tmp_path / "home"
    source = trio.run(two_task_session, data_dir, workspace)
    trace = data_dir / "sessions" / source / "trace_001.jsonl"
    last = json.loads(trace.read_text().splitlines()[-1])
    with trace.open("a", encoding="utf-8") as file:  # as encode_record ends a line
        for digits in (5000, 25):
            line = json.dumps({**last, "seq": 0}, separators=(",", ":"))
            file.write(line.replace('"seq":0}', '"seq":%s}' % ("9" * digits)) + "\n")

    for args in (("--at", "3"), ("--json",)):
        forked = greenroom(tmp_path, "fork", source, *args)
        assert forked.returncode == 0, forked.stderr
        assert "Traceback" not in forked.stderr
    fork_id = json.loads(forked.stdout)["session_id"]
    assert json.loads(forked.stdout)["forked_from"] == {"session_id": source, "seq": last["seq"]}
    copied = (data_dir / "sessions" / fork_id / "trace_001.jsonl").read_text().splitlines()
    assert json.loads(copied[-1])["seq"] == last["seq"]

    shown = greenroom(tmp_path, "trace", source)
    assert "invalid JSON: an integer of more than 4300 digits" in shown.stderr, shown.stderr
    assert "seq of more than 19 digits" in shown.stderr, shown.stderr
    assert "set_int_max_str_digits" not in shown.stderr
