"""The trace as a checked promise (R-SEC-1, R-TRACE-1..3, R-RUN-8).

* Text that UTF-8 cannot encode (a lone UTF-16 surrogate) is repaired where it enters the
  supervisor — user input, tool output — and a record that still cannot be encoded, or a
  file that cannot be written, ends only its own session's task (``failed``, with the
  reason); the sink, the host and the other sessions go on.
* ``sync`` never pretends: after a failed write or with the sink closed it raises, and a
  tool with side effects then does not start (R-TRACE-2).
* Nothing reaches a client before the trace holds it: a published traced output is in its
  file already, and a ``task_start`` is published only once its input is fsynced.

Real host, real files, real worker threads: every wait is bounded by ``fail_after``. The
host's file store writes through a :class:`FaultyDisk` (the real disk unless a test arms a
fault on it), which also records every fsync.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import (
    RUN_TIMEOUT_S,
    Gates,
    Recorder,
    allow_all,
    collect,
    of_type,
    open_host,
    port_of,
    trace_lines,
)

import greenroom.actors.runtime.supervisor as supervisor_module
from greenroom.actors.gateway.methods import once_recorded
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.emitter import DURABLE_WAIT_S
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.receipts import ACCEPT_WAIT_S, InputReceipt, once_durable
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.trace_sink import (
    TraceSink,
    TraceSinkClosed,
    TraceWriteError,
    read_trace,
)
from greenroom.actors.runtime.trace_store import FileTraceStore
from greenroom.protocols import jsonrpc
from greenroom.protocols.content import TextBlock
from greenroom.protocols.jsonrpc import RpcError
from greenroom.protocols.outputs import (
    ModelMsg,
    Output,
    TaskEnd,
    TaskStart,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.stream import ModelError
from greenroom.protocols.text import REPLACEMENT
from greenroom.protocols.tools import make_tool
from greenroom.protocols.trace import encode_record, trace_file_name
from tests.support.disks import FaultyDisk

SURROGATE = "\ud800"


@pytest.fixture
def disk() -> FaultyDisk:
    return FaultyDisk()


@pytest.fixture
async def host(data_dir: Path, disk: FaultyDisk) -> AsyncIterator[Host]:
    """A host whose file store writes through the test's ``disk``."""
    async with Host.open(data_dir, trace_store=lambda d: FileTraceStore(d, disk=disk)) as opened:
        yield opened


def sink_of(host: Host) -> TraceSink:
    """The trace sink of a host on the default file store."""
    store = host.trace_store
    assert isinstance(store, FileTraceStore)
    return store.sink


def task_end(outputs: list[Output]) -> TaskEnd:
    ends = of_type(outputs, TaskEnd)
    assert len(ends) == 1, outputs
    return ends[0]


def echo_provider(*replies: str) -> ScriptedProvider:
    return ScriptedProvider([Reply(blocks=(text(r),)) for r in replies])


class Marks:
    """A side-effecting tool (not parallel-safe) that records every call it ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

        async def mark(key: str) -> str:
            """Record a mark (a side effect)."""
            self.ran.append(key)
            return f"marked {key}"

        self.tool = make_tool(mark, parallel=False)


async def run_all(session: Session, prompt: str, **kwargs: Any) -> list[Output]:
    return await collect(session.run(prompt, approve=allow_all, **kwargs))


# -- 1. lone surrogates ------------------------------------------------------------------------


async def test_surrogates_in_user_input_and_tool_output_are_repaired(
    host: Host, workspace: Path
) -> None:
    """R-SEC-1: a prompt, a steering message, a follow-up and a tool's output with a lone
    surrogate are stored and shown with U+FFFD; the host and the trace stay whole."""
    gates = Gates()

    async def bad_output(key: str) -> str:
        """Return text with a lone surrogate."""
        return f"bytes {SURROGATE} of {key}"

    provider = ScriptedProvider(
        [
            Reply(blocks=(tool_call("c1", "wait", key="k"),)),
            Reply(blocks=(tool_call("c2", "bad_output", key="x"),)),
            Reply(blocks=(text("done"),)),
            Reply(blocks=(text("follow-up done"),)),
            Reply(blocks=(text("again"),)),
        ]
    )
    session = await host.create_session(
        provider=provider,
        workspace_dir=workspace,
        tools=[gates.tool(), make_tool(bad_output, parallel=True)],
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = session.run(f"prompt {SURROGATE}", approve=allow_all)
        await gates.started("k")
        assert session.steer(f"steer {SURROGATE}")
        assert session.follow_up(f"follow {SURROGATE}", approve=allow_all)
        gates.release("k")
        outputs = await collect(stream)
    ends = of_type(outputs, TaskEnd)
    assert [e.status for e in ends] == ["completed", "completed"], ends
    user_texts = [b.text for m in of_type(outputs, UserMsg) for b in m.content]
    assert user_texts == [
        f"prompt {REPLACEMENT}",
        f"steer {REPLACEMENT}",
        f"follow {REPLACEMENT}",
    ]
    bad = next(o for o in of_type(outputs, ToolCallOutput) if o.call_id == "c2")
    assert bad.content == (TextBlock(text=f"bytes {REPLACEMENT} of x"),)
    await port_of(session).sync_trace()
    lines = trace_lines(session)
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert any(
        line.get("content") == [{"type": "text", "text": f"bytes {REPLACEMENT} of x"}]
        for line in lines
    )
    # The host still serves: another task runs on.
    assert task_end(await run_all(session, "again")).status == "completed"


def test_sink_refuses_an_unencodable_line_and_goes_on(tmp_path: Path) -> None:
    """A line UTF-8 cannot encode is refused by write() itself (ValueError, nothing
    buffered): the writer never meets it, the other lines of the file are written."""

    async def main() -> None:
        sink = TraceSink(tmp_path)
        path = tmp_path / "sessions" / "s1" / trace_file_name(1)
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            sink.write(path, line(1))
            with pytest.raises(ValueError, match="UTF-8"):
                sink.write(path, line(2, f"bad {SURROGATE}"))
            sink.write(path, line(2))
            await sink.sync(path)
            await sink.aclose()
        assert [r.seq for r in read_trace(path).records] == [1, 2]

    trio.run(main)


def line(seq: int, value: str = "x") -> str:
    return encode_record(
        ModelMsg(session_id="s1", run_id="r1", seq=seq, turn=1, block=TextBlock(text=value))
    )


async def test_an_unencodable_record_past_the_repairs_fails_only_its_task(
    host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-1: with the supervisor's input repair out of the way, a steering message with
    a surrogate reaches the trace writer (its ``steering_queued``, recorded as it is
    queued). The task ends failed naming the record; the trace holds it repaired (no seq
    gap), and nothing delivers it; a second session runs on meanwhile and after."""
    monkeypatch.setattr(supervisor_module, "repaired_blocks", lambda blocks: blocks)
    gates = Gates()
    bad = await host.create_session(
        provider=ScriptedProvider(
            [Reply(blocks=(tool_call("c1", "wait", key="v"),)), Reply(blocks=(text("no"),))]
        ),
        workspace_dir=workspace,
        tools=[gates.tool()],
    )
    other = await host.create_session(
        provider=ScriptedProvider(
            [
                Reply(blocks=(tool_call("o1", "wait", key="o"),)),
                Reply(blocks=(text("ok"),)),
                Reply(blocks=(text("more"),)),
            ]
        ),
        workspace_dir=workspace,
        tools=[gates.tool()],
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        other_stream = other.run("keep going", approve=allow_all)
        bad_stream = bad.run("go", approve=allow_all)
        await gates.started("v")
        await gates.started("o")
        assert bad.steer(f"steer {SURROGATE}")
        gates.release("v")
        outputs = await collect(bad_stream)
        gates.release("o")
        other_outputs = await collect(other_stream)
    end = task_end(outputs)
    assert end.status == "failed"
    assert end.message is not None
    assert "steering_queued record" in end.message and "could not be encoded" in end.message
    assert task_end(other_outputs).status == "completed"
    await port_of(bad).sync_trace()
    lines = trace_lines(bad)
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    steering = [line for line in lines if line["type"] == "steering_queued"]
    assert [s["content"][0]["text"] for s in steering] == [f"steer {REPLACEMENT}"]
    assert not [line for line in lines if line.get("kind") == "steering"]
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "failed"
    assert not sink_of(host).closed
    assert task_end(await run_all(other, "more")).status == "completed"


async def test_a_failing_trace_file_ends_only_its_task(
    host: Host, workspace: Path, disk: FaultyDisk
) -> None:
    """R-SEC-1: the disk refuses one session's file mid-task. That task ends failed with
    the OS's reason (its task_end lands once the disk takes writes again); a session
    running at the same time completes with a whole trace; the failed session runs again."""
    gates = Gates()
    victim = await host.create_session(
        provider=ScriptedProvider(
            [
                Reply(blocks=(tool_call("c1", "wait", key="v"),)),
                Reply(blocks=(text("never"),)),
                Reply(blocks=(text("ok"),)),
            ]
        ),
        workspace_dir=workspace,
        tools=[gates.tool()],
    )
    bystander = await host.create_session(
        provider=ScriptedProvider(
            [Reply(blocks=(tool_call("b1", "wait", key="b"),)), Reply(blocks=(text("ok"),))]
        ),
        workspace_dir=workspace,
        tools=[gates.tool()],
    )
    recorder = Recorder(victim)
    with trio.fail_after(RUN_TIMEOUT_S):
        victim_stream = victim.run("work", approve=allow_all)
        bystander_stream = bystander.run("work too", approve=allow_all)
        await gates.started("v")
        await gates.started("b")
        disk.refuse(victim.trace_path)
        gates.release("v")
        await recorder.wait_for("tool_call_output", call_id="c1")
        disk.mend()
        outputs = await collect(victim_stream)
        gates.release("b")
        bystander_outputs = await collect(bystander_stream)
    assert disk.hits >= 1
    end = task_end(outputs)
    assert end.status == "failed"
    assert end.message is not None and "No space left on device" in end.message, end.message
    assert task_end(bystander_outputs).status == "completed"
    bystander_lines = trace_lines(bystander)
    assert [line["seq"] for line in bystander_lines] == list(range(1, len(bystander_lines) + 1))
    victim_lines = trace_lines(victim)
    assert victim_lines[-1]["type"] == "task_end"
    assert victim_lines[-1]["status"] == "failed"
    assert "No space left on device" in victim_lines[-1]["message"]
    assert not sink_of(host).closed
    # The failure was reported; the next task may use the file again.
    assert task_end(await run_all(victim, "again")).status == "completed"


# -- 2. durable before a side effect ---------------------------------------------------------


async def test_a_side_effect_does_not_start_when_its_call_cannot_be_made_durable(
    host: Host, workspace: Path, disk: FaultyDisk
) -> None:
    """R-TRACE-2: the fsync before a side-effecting tool fails. The tool never runs, its
    call gets an error output naming the trace failure, and the task ends failed."""
    marks = Marks()
    session = await host.create_session(
        provider=ScriptedProvider(
            [Reply(blocks=(tool_call("c1", "mark", key="m1"),)), Reply(blocks=(text("x"),))]
        ),
        workspace_dir=workspace,
        tools=[marks.tool],
    )
    recorder = Recorder(session)
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = session.run("mark it", approve=allow_all)
        await recorder.wait_for("task_start")  # its input's fsync got through
        disk.refuse(session.trace_path, appends=False)
        outputs = await collect(stream)
    assert marks.ran == []
    result = next(o for o in of_type(outputs, ToolCallOutput) if o.call_id == "c1")
    assert result.is_error and result.status == "error"
    assert "No space left on device" in result.content[0].text  # type: ignore[union-attr]
    end = task_end(outputs)
    assert end.status == "failed"
    assert end.message is not None and "cannot write the trace" in end.message


async def test_sync_raises_once_the_writer_has_stopped(tmp_path: Path, disk: FaultyDisk) -> None:
    """R-TRACE-2: a bug that stops the writer loop (here: an fsync that raises something
    the disk would never refuse with, not an OSError) closes the sink instead of ending its
    nursery (the host), and from then on no sync returns as if lines were durable."""
    path = tmp_path / "sessions" / "s1" / trace_file_name(1)
    disk.break_writer(path)
    sink = TraceSink(tmp_path, disk=disk)
    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            sink.write(path, line(1))
            with pytest.raises((TraceWriteError, TraceSinkClosed)):
                await sink.sync(path)
            with pytest.raises(TraceSinkClosed):
                await sink.sync(path)
            with pytest.raises(TraceSinkClosed):
                sink.write(path, line(2))
            assert sink.error(path) is not None
    assert disk.bug_hits >= 1


async def test_a_stopped_writer_fails_the_task_and_starts_no_side_effect(
    host: Host, workspace: Path, disk: FaultyDisk
) -> None:
    """R-SEC-1, R-TRACE-2: the writer stops while a side-effecting call waits for its
    approval. The call never runs, the task ends failed naming the trace, and the host is
    still up for the next session's call (which is refused the same way, not hanging)."""
    marks = Marks()
    decide = trio.Event()
    asked = trio.Event()

    async def approve(call: Any) -> str:
        asked.set()
        await decide.wait()
        return "allow"

    session = await host.create_session(
        provider=ScriptedProvider([Reply(blocks=(tool_call("c1", "mark", key="m1"),))]),
        workspace_dir=workspace,
        tools=[marks.tool],
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = session.run("mark it", approve=approve)
        await asked.wait()
        disk.break_writer(session.trace_path)
        port = port_of(session)
        port.append(  # any record to sync wakes the writer, which then stops
            attrs_evolve_seq(
                ModelMsg(session_id=session.id, run_id="x", turn=1, block=TextBlock(text="w")),
                port.next_seq(),
            )
        )
        port.commit()
        with pytest.raises((TraceWriteError, TraceSinkClosed)):
            await sink_of(host).sync(session.trace_path)
        decide.set()
        outputs = await collect(stream)
    assert marks.ran == []
    end = task_end(outputs)
    assert end.status == "failed"
    assert end.message is not None and "trace" in end.message
    assert [o.status for o in of_type(outputs, ToolCallOutput)] in (
        ["interrupted"],
        ["error"],
    )


def attrs_evolve_seq(output: ModelMsg, seq: int) -> ModelMsg:
    import attrs

    return attrs.evolve(output, seq=seq)


# -- 3. the live stream never runs ahead of the trace ----------------------------------------


class TraceWatch:
    """A subscriber that checks, as each batch is published, that every traced output in
    it is in the trace file already, and that a ``task_start`` comes after an fsync of
    the file that covered its input (``fsyncs``: the disk's record, file and size)."""

    def __init__(self, session: Session, fsyncs: list[tuple[Path, int]]) -> None:
        self.session = session
        self.fsyncs = fsyncs
        self.problems: list[str] = []
        self.checked = 0
        session.subscribe(self.on_batch)

    def on_batch(self, batch: list[Output]) -> None:
        path = self.session.trace_path
        traced = [o for o in batch if type(o).TRACED]
        if not traced:
            return
        data = path.read_bytes() if path.exists() else b""
        in_file = {r.seq for r in read_trace(path).records} if data else set()
        for output in traced:
            self.checked += 1
            if output.seq not in in_file:
                self.problems.append(f"{output.TYPE} seq {output.seq} published before written")
            if isinstance(output, TaskStart):
                prompt_end = _end_of_record(data, output.input_seq)
                if not any(p == path and size >= prompt_end for p, size in self.fsyncs):
                    self.problems.append(f"task_start seq {output.seq} before its input's fsync")


def _end_of_record(data: bytes, seq: int | None) -> int:
    """The file offset just past the record with this seq (huge when it is missing)."""
    offset = 0
    for raw in data.split(b"\n"):
        offset += len(raw) + 1
        if raw and json.loads(raw).get("seq") == seq:
            return offset
    return 1 << 62


async def test_published_outputs_are_already_in_the_trace(
    host: Host, workspace: Path, disk: FaultyDisk
) -> None:
    """R-RUN-8, R-TRACE-3: at the moment any traced output reaches a subscriber (and so
    the run iterator and the gateway, fed by the same batches) its record is in the file;
    ``task_start`` only after an fsync covering its input. Across a follow-up too."""
    marks = Marks()
    session = await host.create_session(
        provider=ScriptedProvider(
            [
                Reply(
                    blocks=(
                        text("let me"),
                        tool_call("c1", "mark", key="a"),
                        tool_call("c2", "mark", key="b"),
                    )
                ),
                Reply(blocks=(text("done"),)),
                Reply(blocks=(text("and the follow-up"),)),
            ]
        ),
        workspace_dir=workspace,
        tools=[marks.tool],
    )
    watch = TraceWatch(session, disk.fsyncs)
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = session.run("two marks", approve=allow_all)
        assert session.follow_up("and then", approve=allow_all)
        outputs = await collect(stream)
    assert [e.status for e in of_type(outputs, TaskEnd)] == ["completed", "completed"]
    assert marks.ran == ["a", "b"]
    assert watch.problems == []
    assert watch.checked == len([o for o in outputs if type(o).TRACED])


async def test_task_start_waits_for_the_fsync_of_its_input(
    host: Host, workspace: Path, disk: FaultyDisk
) -> None:
    """R-TRACE-3: while the fsync of the prompt hangs, the prompt is published (it is
    written) but the task has not started: no task_start, no model request. Released,
    everything follows in order."""
    provider = ScriptedProvider([Reply(blocks=(text("hello there"),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    disk.stall(session.trace_path)
    recorder = Recorder(session)
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = session.run("hi")
        await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
        await trio.testing.wait_all_tasks_blocked()
        assert [o.TYPE for o in recorder.outputs] == ["user_msg"]
        assert [r["type"] for r in trace_lines(session)] == ["user_msg"]
        assert provider.requests == []
        disk.release()
        outputs = await collect(stream)
    assert [o.TYPE for o in outputs][:3] == ["user_msg", "task_start", "request_begin"]
    assert recorder.outputs == outputs
    assert task_end(outputs).status == "completed"


def fsynced_sizes(disk: FaultyDisk, path: Path) -> list[int]:
    return [size for synced, size in disk.fsyncs if synced == path]


async def test_a_completed_task_end_is_written_and_its_fsync_is_the_next_one(
    data_dir: Path, workspace: Path, disk: FaultyDisk
) -> None:
    """R-TRACE-2: a completed task's last turn boundary is made durable, and its
    ``task_end`` then only written (it is in the file when the run yields it, R-RUN-8):
    its fsync is the session's next one — the next prompt's — or the host's close. One
    fsync less for each task; the end is not held for the disk."""
    provider = echo_provider("first answer", "second answer")
    async with Host.open(data_dir, trace_store=lambda d: FileTraceStore(d, disk=disk)) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        path = session.trace_path
        with trio.fail_after(RUN_TIMEOUT_S):
            first = await run_all(session, "one")
        assert task_end(first).status == "completed"
        end_line = path.read_bytes().splitlines(keepends=True)[-1]
        assert json.loads(end_line)["type"] == "task_end"
        after_first = path.stat().st_size
        assert max(fsynced_sizes(disk, path)) == after_first - len(end_line)
        with trio.fail_after(RUN_TIMEOUT_S):
            second = await run_all(session, "two")
        assert task_end(second).status == "completed"
        # The second prompt's fsync came before its task_start: the first task_end with it.
        prompt_syncs = [s for s in fsynced_sizes(disk, path) if s > after_first - len(end_line)]
        assert prompt_syncs and prompt_syncs[0] > after_first
        final = path.stat().st_size
        assert max(fsynced_sizes(disk, path)) < final
    assert max(fsynced_sizes(disk, path)) == final  # the host's close


async def test_closing_a_session_fsyncs_its_last_task_end(
    host: Host, workspace: Path, disk: FaultyDisk
) -> None:
    """R-TRACE-2: a closed session has no next prompt to fsync its completed task's
    ``task_end`` with: closing it does, not the host's close."""
    session = await host.create_session(provider=echo_provider("bye"), workspace_dir=workspace)
    path = session.trace_path
    with trio.fail_after(RUN_TIMEOUT_S):
        outputs = await run_all(session, "one")
        assert task_end(outputs).status == "completed"
        assert max(fsynced_sizes(disk, path)) < path.stat().st_size
        await host.close_session(session.id)
    assert max(fsynced_sizes(disk, path)) == path.stat().st_size


async def test_a_task_end_that_follows_what_was_not_synced_is_fsynced(
    host: Host, workspace: Path, disk: FaultyDisk
) -> None:
    """A task that does not complete (here: the model's request fails) has no synced
    last boundary to follow: its ``task_end`` is fsynced before the run ends."""
    refused = ModelError(kind="failed", message="no such model", permanent=True)
    provider = ScriptedProvider([Reply(fail=refused)])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    with trio.fail_after(RUN_TIMEOUT_S):
        outputs = await run_all(session, "one")
    assert task_end(outputs).status == "failed"
    path = session.trace_path
    assert max(fsynced_sizes(disk, path)) == path.stat().st_size


async def completed_then_cut(data_dir: Path, workspace: Path, disk: FaultyDisk) -> TaskEnd:
    """Complete a task answering "the answer", then cut its trace back to what was
    fsynced when it ended (a power cut before its ``task_end`` reached the disk)."""
    async with Host.open(data_dir, trace_store=lambda d: FileTraceStore(d, disk=disk)) as host:
        session = await host.create_session(
            provider=echo_provider("the answer"), workspace_dir=workspace
        )
        path = session.trace_path
        with trio.fail_after(RUN_TIMEOUT_S):
            outputs = await run_all(session, "one")
        durable = max(fsynced_sizes(disk, path))
    with path.open("r+b") as f:
        f.truncate(durable)
    assert json.loads(path.read_bytes().splitlines()[-1])["type"] == "request_end"
    return task_end(outputs)


async def test_a_power_cut_before_the_task_end_is_fsynced_loses_no_answer(
    data_dir: Path, workspace: Path, disk: FaultyDisk
) -> None:
    """R-TRACE-2, R-TRACE-4: the file cut back to what was fsynced when a completed task
    ended still holds the whole answer; the next host's ``resume`` ends the task
    completed without a model request."""
    end = await completed_then_cut(data_dir, workspace, disk)
    again = ScriptedProvider([])
    async with Host.open(data_dir) as host:
        resumed = await host.resume(end.session_id, provider=again)
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        lines = trace_lines(resumed)
    assert again.requests == []
    assert [line["block"]["text"] for line in lines if line["type"] == "model_msg"] == [
        "the answer"
    ]
    assert lines[-1]["type"] == "task_end"
    assert (lines[-1]["run_id"], lines[-1]["status"]) == (end.run_id, "completed")


async def test_a_new_task_after_such_a_power_cut_has_the_answer_in_its_context(
    data_dir: Path, workspace: Path, disk: FaultyDisk
) -> None:
    """R-TRACE-4: without ``resume``, a new task recovers the open one as interrupted:
    nothing is aborted (its turn had ended), and the model is sent the whole exchange."""
    end = await completed_then_cut(data_dir, workspace, disk)
    again = echo_provider("the second answer")
    async with Host.open(data_dir) as host:
        session = await host.load_session(end.session_id, provider=again)
        with trio.fail_after(RUN_TIMEOUT_S):
            outputs = await run_all(session, "two")
        lines = trace_lines(session)
    assert task_end(outputs).status == "completed"
    (request,) = again.requests
    sent = [
        (type(m).__name__, [b.text for b in m.content if isinstance(b, TextBlock)])
        for m in request.messages
    ]
    assert sent == [
        ("UserMessage", ["one"]),
        ("AssistantMessage", ["the answer"]),
        ("UserMessage", ["two"]),
    ]
    assert "abort" not in [line["type"] for line in lines]


@pytest.mark.parametrize("kind", ["steer", "follow_up"])
async def test_queued_input_is_settled_only_once_an_fsync_covers_its_record(
    host: Host, workspace: Path, disk: FaultyDisk, kind: str
) -> None:
    """R-STEER-1, R-STEER-6, R-TRACE-2: the receipt of steering or a follow-up (the
    gateway answers ``queued: true`` on it) settles only once an fsync covers its record,
    so a power cut after the answer cannot take the input: while that fsync hangs the
    record is written, and the receipt still waits. Before, it settled as the record was
    written, before any fsync."""
    gates = Gates()
    provider = ScriptedProvider(
        [
            Reply(blocks=(tool_call("c1", "wait", key="k"),)),
            Reply(blocks=(text("done"),)),
            Reply(blocks=(text("the follow-up is done"),)),
        ]
    )
    session = await host.create_session(
        provider=provider, workspace_dir=workspace, tools=[gates.tool()]
    )
    path = session.trace_path
    recorded = InputReceipt()
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = session.run("go", approve=allow_all)
        await gates.started("k")  # no sync is due until the tool's result
        disk.stall(path)
        if kind == "steer":
            assert session.steer("mind the gap", recorded=recorded)
        else:
            assert session.follow_up("and then", approve=allow_all, recorded=recorded)
        await trio.testing.wait_all_tasks_blocked()
        assert trace_lines(session)[-1]["type"] == (
            "steering_queued" if kind == "steer" else "task_queued"
        )
        record_end = path.stat().st_size
        assert not recorded.settled.is_set()
        await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
        assert not recorded.settled.is_set()
        assert max(fsynced_sizes(disk, path), default=0) < record_end
        disk.release()
        await recorded.settled.wait()
        assert max(fsynced_sizes(disk, path)) >= record_end
        assert recorded.dropped is None
        gates.release("k")
        outputs = await collect(stream)
    assert [e.status for e in of_type(outputs, TaskEnd)] == ["completed"] * (
        1 if kind == "steer" else 2
    )


async def stalled_during_a_call(
    host: Host, workspace: Path, disk: FaultyDisk, gates: Gates
) -> Session:
    """A session of ``host`` whose task runs its call ``k`` (held by ``gates``; no sync is
    due until its result), every fsync of its trace stalled from now on."""
    provider = ScriptedProvider([Reply(blocks=(tool_call("c1", "wait", key="k"),))])
    session = await host.create_session(
        provider=provider, workspace_dir=workspace, tools=[gates.tool()]
    )
    session.run("go", approve=allow_all)
    await gates.started("k")
    disk.stall(session.trace_path)
    return session


async def test_queued_input_whose_fsync_is_under_way_as_the_host_is_cancelled_settles(
    data_dir: Path, workspace: Path, disk: FaultyDisk
) -> None:
    """R-STEER-1, R-STEER-6, R-HOST-3: steering whose fsync is under way (or waits behind
    one) as the host is cancelled settles by the time the host is gone, with the truth the
    store's last fsyncs give: the first steer, covered by the fsync in flight, is durable
    (``queued: true``); the second, whose fsync the disk then refuses, is answered 410.
    Before, the tasks waiting for those fsyncs were cancelled with the host and neither
    receipt ever settled: the gateway answered each only after its whole 10 s, and
    ``queued: true`` for the second."""
    gates = Gates()
    first, second = InputReceipt(), InputReceipt()
    hosting = trio.CancelScope()

    async def host_until_cancelled(*, task_status: trio.TaskStatus[Host]) -> None:
        with hosting:
            store = functools.partial(FileTraceStore, disk=disk)
            async with Host.open(data_dir, trace_store=store) as opened:
                task_status.started(opened)
                await trio.sleep_forever()

    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            host: Host = await nursery.start(host_until_cancelled)
            session = await stalled_during_a_call(host, workspace, disk, gates)
            path = session.trace_path
            assert session.steer("first", recorded=first)
            await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
            assert session.steer("second", recorded=second)  # its fsync waits behind
            await trio.testing.wait_all_tasks_blocked()
            hosting.cancel()
            await trio.testing.wait_all_tasks_blocked()  # the host's close waits for the disk
            disk.refuse(path, appends=False)  # the fsync under way passed this check
            disk.release()
    # The host is gone: nothing is left that could settle them later.
    assert first.settled.is_set() and second.settled.is_set()
    assert await once_recorded(first) == {"queued": True}
    with pytest.raises(RpcError) as refused:
        await once_recorded(second)
    assert refused.value.code == jsonrpc.GONE
    assert refused.value.message.startswith(
        f"the input was dropped, not queued: session {session.id} closed before its record"
        " was durable ("
    )


# -- 4. private files ------------------------------------------------------------------------


async def test_queued_input_whose_fsync_never_completes_is_in_doubt_after_durable_wait_s(
    data_dir: Path, workspace: Path, disk: FaultyDisk, mock_clock: trio.testing.MockClock
) -> None:
    """R-STEER-6, R-SEC-9: a receipt waits at most DURABLE_WAIT_S for the fsync that
    covers its record; the disk never finishing it, the input is in doubt, with the reason
    (the gateway's 503, outcome unknown): written and held by the running session, it runs
    unless the host dies first, so it is neither answered ``queued: true``, nor 410 (a
    client would send it again and have it run twice), nor left waiting for ever. The
    clock stands still until the steer, then jumps whenever the run loop is idle: the
    stalled fsync leaves it so, and the clock goes straight to the receipt's bound (the
    test's own, twice as far, fails a receipt left waiting); then it stands again, so
    that the host's close, waiting for its threads, meets none of its bounds."""
    gates = Gates()
    recorded = InputReceipt()
    store = functools.partial(FileTraceStore, disk=disk)
    async with Host.open(data_dir, trace_store=store) as host:
        session = await stalled_during_a_call(host, workspace, disk, gates)
        path = session.trace_path
        assert session.steer("mind the gap", recorded=recorded)
        asked = trio.current_time()
        mock_clock.autojump_threshold = 0
        with trio.fail_after(2 * DURABLE_WAIT_S):
            await recorded.settled.wait()
        mock_clock.autojump_threshold = math.inf
        waited = trio.current_time() - asked
        assert trace_lines(session)[-1]["type"] == "steering_queued"  # written, not fsynced
        assert max(fsynced_sizes(disk, path), default=0) < path.stat().st_size
        disk.release()  # the host's close fsyncs what is left
        gates.release("k")
    assert recorded.dropped is None
    assert recorded.in_doubt == f"its record was not known durable within {DURABLE_WAIT_S:g} s"
    assert waited >= DURABLE_WAIT_S  # virtual time: the receipt waited its whole bound
    with pytest.raises(RpcError) as refused:
        await once_recorded(recorded)
    assert refused.value.code == jsonrpc.UNAVAILABLE
    assert refused.value.data == {"outcome": "unknown"}
    assert refused.value.message.startswith(
        "the input may have been queued: its record was not known durable within "
        f"{DURABLE_WAIT_S:g} s"
    )



async def test_input_not_known_durable_within_the_accept_wait_is_answered_so(
    mock_clock: trio.testing.MockClock,
) -> None:
    """R-STEER-6, R-TRACE-3: ``steer``, ``follow_up`` and ``run`` answer once their input
    is durable; a store that has not said so within ACCEPT_WAIT_S holds the answer no
    longer, and the answer says ``durable: false`` rather than promise what it does not
    know. Durable in time, the answer is the plain one."""
    mock_clock.autojump_threshold = 0
    waiting = InputReceipt()
    asked = trio.current_time()
    assert await once_recorded(waiting) == {"queued": True, "durable": False}
    assert trio.current_time() - asked == ACCEPT_WAIT_S
    never = trio.Event()
    assert await once_durable(never.wait, {"run_id": "r"}) == {"run_id": "r", "durable": False}
    settled = InputReceipt()
    settled.durable()
    assert await once_recorded(settled) == {"queued": True}
    done = trio.Event()
    done.set()
    assert await once_durable(done.wait, {"run_id": "r"}) == {"run_id": "r"}


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.fixture
def umask_022() -> Any:
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.usefixtures("umask_022")
async def test_data_dir_sessions_and_traces_are_private(tmp_path: Path, workspace: Path) -> None:
    """Traces hold tool output (file contents): data dir, sessions/ and session dirs
    0700; trace files, session.json and the usage ledger 0600."""
    data = tmp_path / "fresh" / "data"
    async with open_host(data) as host:
        session = await host.create_session(provider=echo_provider("hi"), workspace_dir=workspace)
        await run_all(session, "hello")
        await port_of(session).sync_trace()
        assert mode(data) == 0o700
        assert mode(data / "sessions") == 0o700
        assert mode(session.directory) == 0o700
        assert mode(session.scratchpad_dir) == 0o700
        assert mode(session.trace_path) == 0o600
        assert mode(session.directory / "session.json") == 0o600
    for name in ("usage.sqlite", "usage.sqlite-wal", "usage.sqlite-shm"):
        if (data / name).exists():
            assert mode(data / name) == 0o600, name


def test_the_directories_a_host_makes_are_durable_before_its_sessions(tmp_path: Path) -> None:
    """R-TRACE-3: a new data dir (and the missing directories above it) and its sessions/
    have their entries fsynced before any session is created in them, so that a power cut
    after a creation cannot take the session with the directory; a data dir that exists
    is not fsynced again, its sessions/ only when it is new."""
    from greenroom.actors.runtime.host import _prepare_data_dir

    disk = FaultyDisk()
    data = tmp_path / "new" / "data"
    assert _prepare_data_dir(data, disk) == data
    assert sorted(disk.fsynced) == sorted([tmp_path, tmp_path / "new", data])
    disk.fsynced.clear()
    _prepare_data_dir(data, disk)
    assert disk.fsynced == []
    (data / "sessions").rmdir()
    _prepare_data_dir(data, disk)
    assert disk.fsynced == [data]


@pytest.mark.usefixtures("umask_022")
async def test_an_existing_data_dir_with_wide_modes_is_tightened(
    tmp_path: Path, workspace: Path
) -> None:
    """A data dir left with wider modes (an older version, a copy) is tightened when the
    host opens it, and a stored session when it is loaded."""
    data = tmp_path / "data"
    async with open_host(data) as host:
        session = await host.create_session(provider=echo_provider("hi"), workspace_dir=workspace)
        await run_all(session, "hello")
        sid = session.id
    directory = data / "sessions" / sid
    for path in (data, data / "sessions", directory, directory / "scratch"):
        os.chmod(path, 0o755)
    for path in (directory / trace_file_name(1), directory / "session.json", data / "usage.sqlite"):
        os.chmod(path, 0o644)
    async with open_host(data) as host:
        assert mode(data) == 0o700
        assert mode(data / "sessions") == 0o700
        assert mode(data / "usage.sqlite") == 0o600
        loaded = await host.load_session(sid, provider=echo_provider("again"))
        assert mode(directory) == 0o700
        assert mode(directory / "scratch") == 0o700
        assert mode(loaded.trace_path) == 0o600
        assert mode(directory / "session.json") == 0o600
        assert task_end(await run_all(loaded, "more")).status == "completed"


@pytest.mark.usefixtures("umask_022")
async def test_a_foreign_directory_as_data_dir_keeps_its_mode(tmp_path: Path) -> None:
    """Pointed at a directory that is neither empty nor a greenroom data dir, the host
    leaves its mode alone and makes private only what it creates."""
    data = tmp_path / "project"
    data.mkdir()
    (data / "notes.txt").write_text("mine")
    os.chmod(data, 0o755)
    async with open_host(data):
        pass
    assert mode(data) == 0o755
    assert mode(data / "sessions") == 0o700
    assert mode(data / "usage.sqlite") == 0o600
