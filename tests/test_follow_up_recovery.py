"""Queued follow-ups survive their host (R-STEER-6, R-ABORT-1, R-HOST-3).

``Session.follow_up`` queues a task behind the running one; the supervisor records it
(``task_queued``) before it queues it. A host that stops with follow-ups queued leaves them
in the trace: the host that takes the session up runs the open task, then each follow-up,
in order, once (a ``user_msg`` names the one it starts). An interrupt drops the queue and
records it (``task_queue_dropped``): nothing runs after a restart.

The stop is simulated as in ``tests/test_recovery.py``: the session's files are copied
while the task streams, and the copy is taken up by a second host.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, Gates, Recorder, allow_all, open_host, port_of, trace_lines
from test_compaction import BIG, new_session, summary_step
from test_gateway_queued import hold_task_end
from test_people import until_parked
from test_recovery import copy_session, records

from greenroom.actors.gateway.queue_room import held
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.converter import output_from_dict
from greenroom.protocols.outputs import TaskQueuedOutput, TaskQueueDropped, UserMsg
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.task import fold
from greenroom.protocols.time_travel import settlement
from greenroom.protocols.tools import Tool, make_tool


def streaming_forever() -> tuple[Any, trio.Event]:
    """A model turn that says one sentence and then streams until its host stops."""
    streaming = trio.Event()

    async def turn(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("Working on it.")
        streaming.set()
        await trio.sleep_forever()

    return turn, streaming


async def queue_two_behind_a_streaming_task(
    host: Host, workspace: Path
) -> tuple[Session, Recorder]:
    """A session whose task streams with the follow-ups ``first`` then ``second`` queued
    behind it, both recorded."""
    turn, streaming = streaming_forever()
    session = await host.create_session(provider=ScriptedProvider([turn]), workspace_dir=workspace)
    recorder = Recorder(session)
    session.run("work").detach()
    with trio.fail_after(RUN_TIMEOUT_S):
        await streaming.wait()
    assert session.follow_up("first")
    assert session.follow_up("second", thinking_level="low")
    await recorder.wait_for("task_queued", content=(TextBlock(text="second"),))
    await port_of(session).sync_trace()
    return session, recorder


def last_words(request: ModelRequest) -> list[str]:
    message = request.messages[-1]
    assert isinstance(message, UserMessage)
    return [b.text for b in message.content if isinstance(b, TextBlock)]


async def test_follow_ups_queued_when_the_host_stopped_run_after_the_task_in_order_once(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-STEER-6, R-HOST-3: the next host takes up the task that streamed, then runs
    ``first``, then ``second`` (with its thinking level), each once; each prompt names the
    follow-up it started, and nothing is left queued in the trace."""
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session, _ = await queue_two_behind_a_streaming_task(host, workspace)
        lines = records(copy_session(session, crash_dir))
        assert "task_end" not in [line["type"] for line in lines]
        queued = [line for line in lines if line["type"] == "task_queued"]
        assert [q["content"][0]["text"] for q in queued] == ["first", "second"]
        assert [q.get("thinking_level") for q in queued] == [None, "low"]

    # The task's retried request and its turn after the host-lost note, then one each.
    after = ScriptedProvider([Reply(blocks=(text(f"Done {n}."),)) for n in range(4)])
    async with Host.open(crash_dir) as second:
        resumed = await second.resume(session.id, provider=after)
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        lines = trace_lines(resumed)

    assert [last_words(r)[-1] for r in after.requests[2:]] == ["first", "second"]
    assert len(after.requests) == 4
    ends = [line for line in lines if line["type"] == "task_end"]
    assert [e["status"] for e in ends] == ["completed"] * 3
    prompts = [line for line in lines if line["type"] == "user_msg" and line["kind"] == "prompt"]
    assert [p.get("queued_id") for p in prompts] == [None, *(q["queue_id"] for q in queued)]
    assert fold(records_of(resumed)).record.queued == ()


def records_of(session: Session) -> list[Any]:
    return [output_from_dict(line) for line in trace_lines(session)]


async def test_an_interrupt_drops_the_queue_and_nothing_runs_after_a_restart(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-ABORT-1, R-STEER-6: the interrupt's ``task_queue_dropped`` names both follow-ups;
    the next host finds no work in the session, and taking it up runs nothing."""
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session, _ = await queue_two_behind_a_streaming_task(host, workspace)
        assert session.interrupt("stop")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = records(copy_session(session, crash_dir))
    queued = [line["queue_id"] for line in lines if line["type"] == "task_queued"]
    (dropped,) = [line for line in lines if line["type"] == "task_queue_dropped"]
    assert dropped["queue_ids"] == queued and len(queued) == 2
    assert [line["type"] for line in lines].count("task_end") == 1

    after = ScriptedProvider([Reply(blocks=(text("never asked"),))])
    async with Host.open(crash_dir, resume_tasks=True) as second:
        resumed = await second.resume(session.id, provider=after)
        assert not resumed.busy
        assert fold(records_of(resumed)).record.queued == ()
    assert after.requests == []


async def test_late_steering_is_still_steering_once_its_session_is_loaded_again(
    host: Host, workspace: Path, gates: Gates, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1, R-STEER-6, R-SEC-9, R-HOST-3: steering too late for its task waits as a
    task of its own behind a follow-up that parks on a person. Its record did not say it
    was steering: once the session was closed and loaded again it was a follow-up, and
    the gateway's caps counted it as one. Loaded again, it counts as steering, and runs
    as it would have: its words as a prompt naming its record, once."""
    ending, let_end = hold_task_end(monkeypatch)
    before = ScriptedProvider(
        [Reply(blocks=(text("One."),)), Reply(blocks=(tool_call("c1", "wait", key="b"),))]
    )
    session = await host.create_session(
        provider=before, tools=[gates.tool()], workspace_dir=workspace
    )
    session.run("one", approve=PEOPLE).detach()
    with trio.fail_after(RUN_TIMEOUT_S):
        await ending.wait()
    # Both wait in the inbox of the supervisor whose task is ending: the follow-up is
    # queued first, and the steering, too late, as a task behind it.
    assert session.follow_up("FOLLOW", approve=PEOPLE)
    assert session.steer("STEER")
    let_end.set()
    await until_parked(host, session.id)
    assert (held(session, "steering"), held(session, "follow_up")) == (1, 0)
    await host.close_session(session.id)

    after = ScriptedProvider([Reply(blocks=(text("Followed."),)), Reply(blocks=(text("Late."),))])
    loaded = await host.load_session(session.id, tools=[gates.tool()], provider=after)
    await host.answer_approval(session.id, "c1", "allow")
    await gates.started("b")  # the follow-up's call runs; the late steering waits
    assert (held(loaded, "steering"), held(loaded, "follow_up")) == (1, 0)
    gates.release("b")
    with trio.fail_after(RUN_TIMEOUT_S):
        await loaded.wait_idle()
    lines = trace_lines(loaded)
    (late,) = [
        line
        for line in lines
        if line["type"] == "task_queued" and line["content"][0]["text"] == "STEER"
    ]
    assert late["late_steering"] is True
    prompt = [line for line in lines if line["type"] == "user_msg"][-1]
    assert (prompt["content"][0]["text"], prompt.get("queued_id")) == ("STEER", late["queue_id"])
    assert len(after.requests) == 2 and last_words(after.requests[-1]) == ["STEER"]
    ends = [line["status"] for line in lines if line["type"] == "task_end"]
    assert ends[-2:] == ["completed", "completed"]


async def test_late_steering_runs_with_the_options_of_the_task_it_came_for(
    host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1: steering that reaches its task while the task's end is being written runs
    as a task of its own, with the options of the task it came for. The supervisor let go
    of the task before that write, so such steering ran with calls denied and no thinking
    level."""
    ending, let_end = hold_task_end(monkeypatch)
    provider = ScriptedProvider([Reply(blocks=(text("One."),)), Reply(blocks=(text("Late."),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    session.run("one", approve=PEOPLE, thinking_level="low").detach()
    with trio.fail_after(RUN_TIMEOUT_S):
        await ending.wait()
    assert session.steer("STEER")
    let_end.set()
    with trio.fail_after(RUN_TIMEOUT_S):
        await session.wait_idle()
    (late,) = [line for line in trace_lines(session) if line["type"] == "task_queued"]
    assert (late["approve"], late.get("thinking_level"), late["late_steering"]) == (
        "people",
        "low",
        True,
    )
    assert last_words(provider.requests[-1]) == ["STEER"]


# -- the fold -----------------------------------------------------------------------------------


def queued(seq: int, queue_id: str) -> TaskQueuedOutput:
    return TaskQueuedOutput(
        session_id="s",
        run_id="run_a",
        seq=seq,
        queue_id=queue_id,
        content=(TextBlock(text=queue_id),),
    )


def started(seq: int, queue_id: str) -> UserMsg:
    return UserMsg(
        session_id="s",
        run_id="run_b",
        seq=seq,
        kind="prompt",
        content=(TextBlock(text=queue_id),),
        queued_id=queue_id,
    )


def test_the_fold_holds_what_is_queued_until_its_prompt_or_a_drop() -> None:
    machine = fold([queued(1, "q1"), queued(2, "q2"), queued(3, "q3"), started(4, "q1")])
    assert machine.recorded().queued == ("q2", "q3")
    dropped = TaskQueueDropped(session_id="s", run_id="", seq=5, queue_ids=("q3",))
    machine.observe(dropped)
    assert machine.recorded().queued == ("q2",)
    machine.observe(queued(6, "q2"))  # recorded again after a compaction: still one
    assert machine.recorded().queued == ("q2",)


def test_a_cut_drops_the_follow_ups_it_leaves_queued() -> None:
    """R-FORK-1, R-FORK-2: a fork or rewind carries no queue (the settlement drops it), so
    no host that takes the fork up runs them."""
    machine = fold([queued(1, "q1"), queued(2, "q2")])
    settled = settlement(machine.record, (), session_id="s", reason="forked")
    assert [(o.TYPE, getattr(o, "queue_ids", None)) for o in settled] == [
        ("task_queue_dropped", ("q1", "q2"))
    ]
    for output in settled:
        machine.observe(output)
    assert machine.record.queued == ()


async def test_a_follow_up_queued_before_a_compaction_survives_in_the_next_trace_file(
    data_dir: Path, workspace: Path, tmp_path: Path, gates: Gates
) -> None:
    """R-STEER-6, R-COMPACT-8: a compaction starts the next trace file, which a host reads
    on its own when it loads the session; the follow-ups still queued are recorded again
    in it, so a host that stops after the compaction loses none."""
    turn_2, streaming = streaming_forever()
    provider = ScriptedProvider([
        Reply(blocks=(tool_call("c1", "wait", key="k"),), usage=BIG),
        summary_step("User wants work done."),
        turn_2,
    ])  # fmt: skip
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session = await new_session(host, workspace, provider, [gates.tool()])
        session.run("work", approve=allow_all).detach()
        await gates.started("k")
        assert session.follow_up("then this")
        gates.release("k")
        with trio.fail_after(RUN_TIMEOUT_S):
            await streaming.wait()
        await port_of(session).sync_trace()
        assert session.trace_path.name == "trace_002.jsonl"
        lines = records(copy_session(session, crash_dir))  # the current file only
        assert [line["type"] for line in lines][:2] == ["compaction_end", "task_queued"]

    after = ScriptedProvider([Reply(blocks=(text(f"Done {n}."),)) for n in range(3)])
    async with open_host(crash_dir) as second:
        resumed = await second.resume(session.id, provider=after)
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
    assert last_words(after.requests[-1]) == ["then this"]


async def test_follow_ups_nobody_took_up_are_dropped_when_a_new_task_starts(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-STEER-6, R-TRACE-4: a session loaded without taking its work up gets a new task:
    its open task is recovered as interrupted, and the follow-ups its stopped host left
    queued are dropped then (recorded), so no later host runs them behind newer work."""
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session, _ = await queue_two_behind_a_streaming_task(host, workspace)
        copy_session(session, crash_dir)

    after = ScriptedProvider([Reply(blocks=(text("Fresh."),))])
    async with open_host(crash_dir) as second:
        loaded = await second.load_session(session.id, provider=after)
        with trio.fail_after(RUN_TIMEOUT_S):
            await loaded.run("something else").collect()
        lines = trace_lines(loaded)
    (dropped,) = [line for line in lines if line["type"] == "task_queue_dropped"]
    assert len(dropped["queue_ids"]) == 2
    assert [last_words(r) for r in after.requests][-1][-1] == "something else"
    async with Host.open(crash_dir, resume_tasks=True) as third:
        assert await third.resume_tasks() == []


async def test_follow_ups_behind_a_task_parked_on_a_person_run_once_it_is_answered(
    data_dir: Path, workspace: Path
) -> None:
    """R-STEER-6, R-HITL-4: a host closes with a task parked on a person and a follow-up
    queued behind it; the next host, without taking anything up, gets the person's answer:
    the task goes on to its end, then the follow-up runs."""
    paid: list[int] = []
    tools = [paying_tool(paid)]
    sid = await parked_on_pay(data_dir, workspace, tools, lambda s: s.follow_up("then say thanks"))

    after = ScriptedProvider([Reply(blocks=(text("Paid."),)), Reply(blocks=(text("Thanks!"),))])
    async with open_host(data_dir) as host:
        session = await host.load_session(sid, provider=after, tools=tools)
        (pending,) = await host.pending_approvals()
        await host.answer_approval(sid, "p1", "allow", digest=pending.digest)
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert paid == [7]
    assert [line["status"] for line in lines if line["type"] == "task_end"] == ["completed"] * 2
    assert last_words(after.requests[-1]) == ["then say thanks"]


def paying_tool(paid: list[int]) -> Tool:
    """A tool that pays an amount, noting it in ``paid``."""

    async def pay(amount: int) -> str:
        """Pay an amount."""
        paid.append(amount)
        return f"paid {amount}"

    return make_tool(pay, parallel=False)


async def parked_on_pay(
    data_dir: Path, workspace: Path, tools: list[Tool], give: Callable[[Session], bool]
) -> str:
    """A host closes with a task parked on a person (its call pays 7) after ``give`` gave
    the parked task more input (it must be taken); the session's id."""
    ask = ScriptedProvider([Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7)))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=ask, tools=tools, workspace_dir=workspace)
        session.run("pay 7", approve=PEOPLE).detach()
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()  # parked (R-HITL-3)
            assert give(session)
            await session.wait_idle()  # woken by the input, parked again
        return session.id
