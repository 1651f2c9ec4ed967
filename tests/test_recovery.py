"""Crash recovery: a session is loaded from a trace that a dead process left behind
(R-TRACE-4, with R-TOOL-7 pairing, R-ABORT-2 carry-over and R-TRACE-1 seq).

A crash is simulated by copying the session directory (``session.json`` and
``trace_001.jsonl``, synced first) while a task is still in flight — so the copy has no
``task_end`` — and loading the copy in a new host on another data dir.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import trio
from conftest import (
    Recorder,
    allow_all,
    assert_trace_seq_without_gaps,
    collect,
    last_user,
    of_type,
    open_host,
    port_of,
    result_text,
    results_of,
    texts_of,
)

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedStream,
    check_invariants,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.storage import SESSION_FILE
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, ModelRequest, UserMessage
from greenroom.protocols.outputs import TaskEnd
from greenroom.protocols.tools import make_tool

INTERRUPTED = "[interrupted: tool aborted by user]"


def copy_session(session: Session, data_dir: Path) -> Path:
    """Copy the session's directory layout (meta and current trace file) as it is on disk
    now into ``data_dir``; returns the copied trace file."""
    target = data_dir / "sessions" / session.id
    target.mkdir(parents=True)
    shutil.copyfile(session.directory / SESSION_FILE, target / SESSION_FILE)
    shutil.copyfile(session.trace_path, target / session.trace_path.name)
    return target / session.trace_path.name


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def blocking_tool():
    started = trio.Event()

    async def hold(key: str) -> str:
        """Blocks until cancelled."""
        started.set()
        await trio.sleep_forever()
        return "unreachable"  # pragma: no cover

    return make_tool(hold, parallel=True), started


async def test_crash_while_a_tool_runs_pairs_the_call_as_interrupted(
    host: Host, tmp_path: Path, workspace: Path, providers
) -> None:
    """R-TRACE-4, R-TOOL-7: the process dies while c2 runs (c1 already finished). Loading
    the trace rebuilds the context: the next request has the assistant message with both
    calls, c1's real result and c2's `[interrupted: tool aborted by user]`, in call order,
    then the new input; seq continues after the last record of the dead process."""
    hold, hold_started = blocking_tool()
    lookup_runs: list[str] = []

    async def lookup(key: str) -> str:
        """Look up a key."""
        lookup_runs.append(key)
        return f"value-{key}"

    tools = [hold, make_tool(lookup, parallel=True)]
    provider = providers(
        [
            Reply(
                blocks=(
                    text("Two calls."),
                    tool_call("c1", "lookup", key="a"),
                    tool_call("c2", "hold", key="b"),
                )
            )
        ]
    )
    session = await host.create_session(tools=tools, provider=provider, workspace_dir=workspace)
    recorder = Recorder(session)
    session.run("work", approve=allow_all)
    await recorder.wait_for("tool_call_output", call_id="c1")
    with trio.fail_after(10):
        await hold_started.wait()
    await port_of(session).sync_trace()
    crash_dir = tmp_path / "crashed"
    trace = copy_session(session, crash_dir)
    lines = records(trace)
    assert "task_end" not in [line["type"] for line in lines]
    assert lines[-1]["type"] == "tool_call_output"  # c1's; c2 never finished
    last_seq = lines[-1]["seq"]

    after = providers([Reply(blocks=(text("Recovered."),))])
    async with open_host(crash_dir) as second:
        loaded = await second.load_session(session.id, tools=tools, provider=after)
        assert loaded.load_errors == []
        outputs = await collect(loaded.run("go on", approve=allow_all))
        assert of_type(outputs, TaskEnd)[0].status == "completed"
        assert outputs[0].seq == last_seq + 1
        await assert_trace_seq_without_gaps(loaded)

    request = after.requests[0]
    assert check_invariants(request) == []
    assert request.messages[0] == UserMessage(content=(TextBlock(text="work"),))
    assistant = request.messages[1]
    assert isinstance(assistant, AssistantMessage)
    assert [b.id for b in assistant.content if isinstance(b, ToolCallBlock)] == ["c1", "c2"]
    carried = last_user(request)
    assert [(r.call_id, r.status, result_text(r)) for r in results_of(carried)] == [
        ("c1", "ok", "value-a"),
        ("c2", "interrupted", INTERRUPTED),
    ]
    assert texts_of(carried) == ["go on"]
    assert lookup_runs == ["a"]  # nothing re-ran on recovery


async def test_crash_mid_stream_yields_turn_aborted_carry_over(
    host: Host, tmp_path: Path, workspace: Path, providers
) -> None:
    """R-TRACE-4, R-ABORT-2 case B: the trace ends mid-stream — a complete text block was
    traced (model_msg) but no request_end. The loaded session's next request carries the
    turn as `[turn_aborted]…[/turn_aborted]` with that text, before the new input, and no
    assistant message."""
    streaming = trio.Event()

    async def turn_1(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("Complete sentence.")
        await stream.text_delta("Cut off")  # live only: never traced
        streaming.set()
        await trio.sleep_forever()

    provider = providers([turn_1])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    session.run("explain")
    with trio.fail_after(10):
        await streaming.wait()
    await port_of(session).sync_trace()
    crash_dir = tmp_path / "crashed"
    trace = copy_session(session, crash_dir)
    types = [line["type"] for line in records(trace)]
    assert types[-2:] == ["request_begin", "model_msg"]
    assert "request_end" not in types and "task_end" not in types

    after = providers([Reply(blocks=(text("Recovered."),))])
    async with open_host(crash_dir) as second:
        loaded = await second.load_session(session.id, provider=after)
        assert loaded.load_errors == []
        outputs = await collect(loaded.run("go on"))
        assert of_type(outputs, TaskEnd)[0].status == "completed"
        lines = await assert_trace_seq_without_gaps(loaded)
        assert len(lines) == len(types) + len(outputs) - _live(outputs)

    request = after.requests[0]
    assert request.messages[0] == UserMessage(content=(TextBlock(text="explain"),))
    assert not any(isinstance(m, AssistantMessage) for m in request.messages)
    assert texts_of(last_user(request)) == [
        "[turn_aborted]Complete sentence.[/turn_aborted]",
        "go on",
    ]


def _live(outputs: list) -> int:
    return sum(1 for o in outputs if not type(o).TRACED)


async def test_corrupt_line_in_the_middle_is_reported_and_the_session_runs(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-TRACE-4, R-TRACE-1: a corrupt line in the middle of the trace is reported in
    session.load_errors naming the file and the line; the other records still rebuild the
    context (the first task's exchange reaches the next request) and new records continue
    after the last good seq without reusing a number."""
    provider = providers([Reply(blocks=(text("first answer"),))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("first"))
        session_id = session.id
        trace = session.trace_path

    lines = trace.read_text(encoding="utf-8").splitlines(keepends=True)
    usage_line = next(i for i, line in enumerate(lines) if '"token_usage"' in line)
    assert 0 < usage_line < len(lines) - 1  # in the middle
    lines[usage_line] = '{"type": "token_usage", "seq": \n'
    trace.write_text("".join(lines), encoding="utf-8")
    last_seq = json.loads(lines[-1])["seq"]

    after = providers([Reply(blocks=(text("second answer"),))])
    async with open_host(data_dir) as host:
        loaded = await host.load_session(session_id, provider=after)
        assert len(loaded.load_errors) == 1
        error = loaded.load_errors[0]
        assert f"{trace.name}:{usage_line + 1}:" in error
        outputs = await collect(loaded.run("second"))
        assert of_type(outputs, TaskEnd)[0].status == "completed"
        assert next(o.seq for o in outputs if type(o).TRACED) == last_seq + 1

    request = after.requests[0]
    assert [type(m).__name__ for m in request.messages] == [
        "UserMessage",
        "AssistantMessage",
        "UserMessage",
    ]
    assert request.messages[1] == AssistantMessage(content=(TextBlock(text="first answer"),))
    assert texts_of(last_user(request)) == ["second"]


async def test_torn_last_line_is_reported_and_seq_continues_after_the_last_good_record(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-TRACE-4, R-TRACE-1: the process died while writing the last line (task_end cut in
    half). The torn line is reported; the task counts as unfinished and is recovered; the
    next record takes the seq after the last good one, so the file's numbering has no gap
    among readable records and no duplicate."""
    provider = providers([Reply(blocks=(text("answer"),))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("first"))
        session_id = session.id
        trace = session.trace_path

    lines = trace.read_text(encoding="utf-8").splitlines(keepends=True)
    assert json.loads(lines[-1])["type"] == "task_end"
    torn_seq = json.loads(lines[-1])["seq"]
    lines[-1] = lines[-1][: len(lines[-1]) // 2]  # no newline: a torn write
    trace.write_text("".join(lines), encoding="utf-8")

    after = providers([Reply(blocks=(text("again"),))])
    async with open_host(data_dir) as host:
        loaded = await host.load_session(session_id, provider=after)
        assert len(loaded.load_errors) == 1
        assert f"{trace.name}:{len(lines)}:" in loaded.load_errors[0]
        outputs = await collect(loaded.run("second"))
        assert of_type(outputs, TaskEnd)[0].status == "completed"
        assert next(o.seq for o in outputs if type(o).TRACED) == torn_seq

    request = after.requests[0]
    assert check_invariants(request) == []
    assert request.messages[1] == AssistantMessage(content=(TextBlock(text="answer"),))
    assert texts_of(last_user(request)) == ["second"]

    # The records written after the torn line start on a line of their own: a later load
    # reads all of them, and only the torn line is reported.
    third = providers([Reply(blocks=(text("third"),))])
    async with open_host(data_dir) as host:
        reloaded = await host.load_session(session_id, provider=third)
        assert len(reloaded.load_errors) == 1
        await collect(reloaded.run("third"))
    assert [texts_of(m) for m in third.requests[0].messages] == [
        ["first"],
        ["answer"],
        ["second"],
        ["again"],
        ["third"],
    ]
