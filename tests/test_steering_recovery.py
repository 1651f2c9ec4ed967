"""Queued steering survives its host (R-STEER-1..5, R-TRACE-2, R-HITL-4).

``Session.steer`` queues input for the running task's next input assembly; the supervisor
records it (``steering_queued``) as it queues it. A host that stops before that assembly
leaves it in the trace: the host that takes the task up queues it again, and the task's
next request carries it in one ``[user_steering]`` text, once (the ``user_msg`` that
delivers it names it in ``steering_ids``). The task's end drops what it did not take
(R-STEER-5): nothing is delivered after a restart.

The stop is simulated as in ``tests/test_follow_up_recovery.py``: the session's files are
copied while the task runs, and the copy is taken up by a second host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from conftest import RUN_TIMEOUT_S, Gates, Recorder, allow_all, open_host, port_of, trace_lines
from test_compaction import BIG, new_session, summary_step
from test_follow_up_recovery import parked_on_pay, paying_tool, records_of, streaming_forever
from test_recovery import copy_session, records

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.converter import output_from_dict
from greenroom.protocols.outputs import SteeringQueuedOutput, TaskEnd, TaskStart, UserMsg
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.task import fold
from greenroom.protocols.time_travel import settlement

STEER = "also check the logs"
OPENING = f"[{markers.USER_STEERING}]"


def request_text(request: ModelRequest) -> str:
    """Every text the user side of ``request`` sends, joined."""
    return "\n".join(
        b.text
        for m in request.messages
        if isinstance(m, UserMessage)
        for b in m.content
        if isinstance(b, TextBlock)
    )


async def steer_during_a_long_tool_call(
    host: Host, workspace: Path, gates: Gates, crash_dir: Path
) -> tuple[Any, list[dict[str, Any]]]:
    """A session whose task waits on the tool call ``k`` (held) with ``STEER`` queued and
    recorded; returns it and its trace as copied to ``crash_dir`` then."""
    checking = Reply(blocks=(text("Checking."), tool_call("c1", "wait", key="k")))
    provider = ScriptedProvider([checking])
    session = await host.create_session(
        provider=provider, tools=[gates.tool()], workspace_dir=workspace
    )
    recorder = Recorder(session)
    session.run("work", approve=allow_all).detach()
    await gates.started("k")
    assert session.steer(STEER)
    await recorder.wait_for("steering_queued")
    await port_of(session).sync_trace()
    return session, records(copy_session(session, crash_dir))


async def test_steering_queued_when_the_host_stopped_reaches_the_next_request_once(
    data_dir: Path, workspace: Path, gates: Gates, tmp_path: Path
) -> None:
    """R-STEER-1, R-STEER-2, R-TRACE-2: steering given during a long tool call is in the
    trace before its input assembly; the host that takes the task up (``Host.resume``)
    sends it in the next request, in one ``[user_steering]`` text, once, and the
    ``user_msg`` that delivers it names it."""
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session, lines = await steer_during_a_long_tool_call(host, workspace, gates, crash_dir)
    types = [line["type"] for line in lines]
    assert "task_end" not in types and "steering_queued" in types
    (queued,) = [line for line in lines if line["type"] == "steering_queued"]
    assert queued["content"] == [{"type": "text", "text": STEER}]
    assert not [line for line in lines if line.get("kind") == "steering"]

    after = ScriptedProvider([Reply(blocks=(text("Logs checked."),))])
    async with Host.open(crash_dir) as second:
        # What resume_tasks does for each open task, with this test's model.
        resumed = await second.resume(session.id, provider=after, tools=[gates.tool()])
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        taken = trace_lines(resumed)

    assert len(after.requests) == 1
    sent = request_text(after.requests[0])
    assert sent.count(OPENING) == 1 and sent.count(STEER) == 1
    (delivered,) = [line for line in taken if line.get("kind") == "steering"]
    assert delivered["steering_ids"] == [queued["steering_id"]]
    assert [line["status"] for line in taken if line["type"] == "task_end"] == ["completed"]
    assert fold(records_of(resumed)).record.steering == ()


async def test_steering_queued_across_a_compaction_survives_in_the_next_trace_file(
    data_dir: Path, workspace: Path, gates: Gates, tmp_path: Path
) -> None:
    """R-STEER-1, R-COMPACT-8: a compaction before the turn that takes the steering starts
    the next trace file, which a load reads on its own; the steering still queued is
    recorded again in it, so a host that stops right after the compaction loses none."""
    turn_2, streaming = streaming_forever()
    provider = ScriptedProvider([
        Reply(blocks=(tool_call("c1", "wait", key="k"),), usage=BIG),
        summary_step("User wants work done."),
        turn_2,
    ])  # fmt: skip
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session = await new_session(host, workspace, provider, [gates.tool()])
        recorder = Recorder(session)
        session.run("work", approve=allow_all).detach()
        await gates.started("k")
        assert session.steer(STEER)
        await recorder.wait_for("steering_queued")
        gates.release("k")
        with trio.fail_after(RUN_TIMEOUT_S):
            await streaming.wait()
        await port_of(session).sync_trace()
        assert session.trace_path.name == "trace_002.jsonl"
        trace = copy_session(session, crash_dir)  # the current file only
    lines = records(trace)
    assert [line["type"] for line in lines][:3] == ["compaction_end", "steering_queued", "user_msg"]
    # The host stopped once the compaction was durable, before the turn took the steering.
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines[:2]), encoding="utf-8")

    after = ScriptedProvider([Reply(blocks=(text("Done."),))])
    async with open_host(crash_dir) as second:
        resumed = await second.resume(session.id, provider=after, tools=[gates.tool()])
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
    sent = request_text(after.requests[-1])
    assert sent.count(OPENING) == 1 and sent.count(STEER) == 1


async def test_steering_an_interrupt_ended_is_not_delivered_after_a_restart(
    data_dir: Path, workspace: Path, gates: Gates, tmp_path: Path
) -> None:
    """R-STEER-5, R-ABORT-1: the task's end drops the steering it had not taken; the next
    host finds no work, and the session's next task is not sent it."""
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session, _ = await steer_during_a_long_tool_call(host, workspace, gates, crash_dir)
        assert session.interrupt("stop")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        await port_of(session).sync_trace()
        lines = records(copy_session(session, crash_dir / "after"))
    types = [line["type"] for line in lines]
    assert "steering_queued" in types and types[-1] == "task_end"
    assert not [line for line in lines if line.get("kind") == "steering"]

    after = ScriptedProvider([Reply(blocks=(text("Fresh."),))])
    async with Host.open(crash_dir / "after", resume_tasks=True, tools=[gates.tool()]) as second:
        assert await second.resume_tasks() == []
        loaded = await second.load_session(session.id, provider=after)
        assert fold(records_of(loaded)).record.steering == ()
        with trio.fail_after(RUN_TIMEOUT_S):
            await loaded.run("something else").collect()
    assert STEER not in request_text(after.requests[0])


async def test_steering_given_to_a_parked_task_is_delivered_once_its_answer_wakes_it(
    data_dir: Path, workspace: Path
) -> None:
    """R-STEER-1, R-HITL-4: steering given while the task waits for a person is recorded;
    a host that closes then leaves it with the parked task, and the answer that wakes the
    task on the next host (nothing taken up) sends it with the call's result, once."""
    paid: list[int] = []
    tools = [paying_tool(paid)]
    sid = await parked_on_pay(data_dir, workspace, tools, lambda s: s.steer(STEER))

    after = ScriptedProvider([Reply(blocks=(text("Paid, logs checked."),))])
    async with open_host(data_dir) as host:
        session = await host.load_session(sid, provider=after, tools=tools)
        (pending,) = await host.pending_approvals()
        await host.answer_approval(sid, "p1", "allow", digest=pending.digest)
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
    assert paid == [7]
    sent = request_text(after.requests[0])
    assert sent.count(OPENING) == 1 and sent.count(STEER) == 1


# -- the fold -----------------------------------------------------------------------------------


def steered(seq: int, steering_id: str, run_id: str = "run_a") -> SteeringQueuedOutput:
    return SteeringQueuedOutput(
        session_id="s",
        run_id=run_id,
        seq=seq,
        steering_id=steering_id,
        content=(TextBlock(text=steering_id),),
    )


def started(seq: int, run_id: str = "run_a") -> TaskStart:
    return TaskStart(session_id="s", run_id=run_id, seq=seq, input_seq=seq - 1)


def test_the_fold_holds_steering_until_a_user_msg_delivers_it_or_the_task_ends() -> None:
    machine = fold([started(2), steered(3, "s1"), steered(4, "s2"), steered(5, "s3")])
    assert machine.recorded().steering == ("s1", "s2", "s3")
    machine.observe(
        UserMsg(
            session_id="s",
            run_id="run_a",
            seq=6,
            kind="steering",
            content=(TextBlock(text="s1 s2"),),
            steering_ids=("s1", "s2"),
        )
    )
    assert machine.recorded().steering == ("s3",)
    machine.observe(steered(7, "s3"))  # recorded again after a compaction: still one
    assert machine.recorded().steering == ("s3",)
    machine.observe(
        TaskEnd(
            session_id="s",
            run_id="run_a",
            seq=8,
            status="aborted",
            turns=1,
            usage=TokenUsage(),
            wall_ms=1,
        )
    )
    assert machine.recorded().steering == ()


def test_steering_for_a_task_that_never_started_is_not_the_next_ones() -> None:
    """Steering recorded for a task whose host stopped before its ``task_start`` went with
    that task: the next task to start does not take it."""
    machine = fold([steered(1, "s1", run_id="run_a"), started(3, run_id="run_b")])
    assert machine.recorded().steering == ()


def test_a_cut_carries_no_steering() -> None:
    """R-FORK-1, R-FORK-2: a fork or rewind ends the task its history leaves open, and the
    steering it had not taken with it."""
    machine = fold(
        [
            UserMsg(
                session_id="s",
                run_id="run_a",
                seq=1,
                kind="prompt",
                content=(TextBlock(text="go"),),
            ),
            started(2),
            steered(3, "s1"),
        ]
    )
    for output in settlement(machine.record, (), session_id="s", reason="forked"):
        machine.observe(output)
    assert machine.record.steering == () and machine.run_id is None


def test_a_trace_written_before_steering_was_recorded_loads() -> None:
    """An old ``user_msg`` of kind ``steering`` has no ``steering_ids``: it loads, and
    delivers nothing recorded."""
    old = output_from_dict(
        {
            "type": "user_msg",
            "session_id": "s",
            "run_id": "run_a",
            "seq": 3,
            "kind": "steering",
            "content": [{"type": "text", "text": "hi"}],
        }
    )
    assert isinstance(old, UserMsg) and old.steering_ids == ()
    machine = fold([started(2), steered(3, "s1"), old])
    assert machine.recorded().steering == ("s1",)
