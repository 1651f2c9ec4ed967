"""``Host.resume`` of a trace a host left between an interrupt's records (R-TRACE-4,
R-ABORT-1, R-ABORT-2 case B): the task the user interrupted stays interrupted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import (
    RUN_TIMEOUT_S,
    Recorder,
    collect,
    cut_after,
    last_user,
    open_host,
    texts_of,
    trace_lines,
)

from greenroom.actors.providers.scripted import Reply, ScriptedStream, text
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import TaskQueuedOutput
from greenroom.protocols.trace import encode_record

CARRIED = "[turn_aborted]the first half[/turn_aborted]"


async def interrupted_mid_stream(data_dir: Path, workspace: Path, providers: Any) -> Path:
    """A session whose one task was interrupted while the model streamed: its trace ends
    ``model_msg``, ``request_end(aborted)``, ``abort``, ``task_end(aborted)``. Returns its
    trace file."""

    async def half_then_hold(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.block(text("the first half"))
        await trio.Event().wait()  # until the interrupt cancels the stream

    async with open_host(data_dir) as host:
        source = await host.create_session(
            provider=providers([half_then_hold]), workspace_dir=workspace
        )
        recorder = Recorder(source)
        stream = source.run("tell me")
        await recorder.wait_for("model_msg")
        source.interrupt("stop")
        await collect(stream)
        return source.trace_path


@pytest.mark.parametrize("last", ["request_end", "abort"])
async def test_resume_of_a_trace_left_inside_an_interrupt_runs_nothing_again(
    data_dir: Path, workspace: Path, providers: Any, last: str
) -> None:
    """The host stopped right after the cut stream's ``request_end(aborted)`` (before the
    ``abort``), or after the ``abort`` (before the ``task_end``). ``Host.resume`` took
    the first for a stream its host lost: it failed the attempt and retried it, and the
    task the user had interrupted ran on. Now the take-up finishes the interrupt: the
    ``abort`` with what the model had streamed (when it is missing) and the
    ``task_end(aborted)``, no model request; the next task reads the carry-over once."""
    trace = await interrupted_mid_stream(data_dir, workspace, providers)
    kept = cut_after(trace, lambda line: line["type"] == last)
    session_id = kept[0]["session_id"]
    again = providers([Reply(blocks=(text("resumed"),))])
    async with open_host(data_dir) as host:
        resumed = await host.resume(session_id, provider=again)
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        assert again.requests == []
        lines = trace_lines(resumed)
        tail = [(line["type"], line.get("status")) for line in lines[len(kept) - 1 :]]
        assert [kind for kind, _ in tail].count("request_end") == (
            1 if last == "request_end" else 0
        )
        assert tail[-1] == ("task_end", "aborted")
        assert [line["type"] for line in lines].count("abort") == 1
        abort = next(line for line in lines if line["type"] == "abort")
        assert abort["partial"] == [{"type": "text", "text": "the first half"}]
        assert abort["message_complete"] is False
        following = providers([Reply(blocks=(text("going on"),))])
        host.port(session_id).provider = following
        await collect(resumed.run("go on"))
    (request,) = following.requests
    assert [texts_of(m) for m in request.messages] == [["tell me"], [CARRIED, "go on"]]
    assert texts_of(last_user(request)) == [CARRIED, "go on"]


async def test_a_follow_up_queued_during_the_interrupt_runs_once_the_task_has_ended(
    data_dir: Path, workspace: Path, providers: Any
) -> None:
    """R-ABORT-1, R-STEER-6: the interrupt dropped the queue it found; a follow-up queued
    after it (``task_queued`` behind the cut stream's ``request_end(aborted)``) is not
    dropped by it. Taken up, the interrupted task ends without a request of its own and
    the follow-up runs next, with the interrupted task's carry-over."""
    trace = await interrupted_mid_stream(data_dir, workspace, providers)
    kept = cut_after(trace, lambda line: line["type"] == "request_end")
    last = kept[-1]
    queued = TaskQueuedOutput(session_id=last["session_id"], run_id=last["run_id"],
                              seq=last["seq"] + 1, queue_id="queued_next",
                              content=(TextBlock(text="next"),))  # fmt: skip
    with trace.open("a", encoding="utf-8") as f:
        f.write(encode_record(queued))
    following = providers([Reply(blocks=(text("the next answer"),))])
    async with open_host(data_dir) as host:
        resumed = await host.resume(last["session_id"], provider=following)
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        ends = [(line["run_id"], line["status"]) for line in trace_lines(resumed)
                if line["type"] == "task_end"]  # fmt: skip
    (request,) = following.requests
    assert texts_of(last_user(request)) == [CARRIED, "next"]
    assert ends[0] == (last["run_id"], "aborted")
    assert [status for _, status in ends[1:]] == ["completed"]
