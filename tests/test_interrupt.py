"""Interrupt and carry-over: the outputs of an interrupted task, the carry-over of case A
(complete message, tools running) and case B (message cut mid-text), live and rebuilt
from the trace after a restart (R-ABORT-1..4, R-TRACE-4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import (
    RUN_TIMEOUT_S,
    Gates,
    Recorder,
    allow_all,
    collect,
    last_user,
    of_type,
    open_host,
    result_text,
    results_of,
    texts_of,
    trace_lines,
    types,
)

from greenroom.actors.providers.scripted import Reply, ScriptedStream, text, tool_call
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import AssistantMessage, ModelRequest, UserMessage
from greenroom.protocols.outputs import Abort, RequestBegin, RequestEnd, TaskEnd, ToolCallOutput

INTERRUPTED = "[interrupted: tool aborted by user]"


def assert_one_abort_then_task_end(outputs: list) -> TaskEnd:
    """R-ABORT-1, R-RUN-7: one abort, then one task_end(aborted), and nothing after."""
    assert len(of_type(outputs, Abort)) == 1
    ends = of_type(outputs, TaskEnd)
    assert len(ends) == 1
    assert ends[0].status == "aborted"
    assert types(outputs, traced_only=False)[-2:] == ["abort", "task_end"]
    return ends[0]


def assert_carry_over_not_traced(lines: list[dict]) -> None:
    """R-ABORT-3: carry-over is never written to the trace as a message. R-TRACE-1: the
    trace's seq has no gap, across the interrupt and a reload."""
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert [line["type"] for line in lines].count("abort") == 1
    for line in lines:
        if line["type"] == "user_msg":
            for block in line["content"]:
                assert "[turn_aborted]" not in block.get("text", "")
                assert INTERRUPTED not in block.get("text", "")


@pytest.mark.parametrize("reload", [False, True], ids=["live", "reloaded"])
async def test_interrupt_mid_text_carries_the_partial_turn_as_turn_aborted(
    data_dir: Path, workspace: Path, providers, reload: bool
) -> None:
    """R-ABORT-2 case B, R-ABORT-3, R-TRACE-4: the model is cut mid-text; the next task's
    first request carries `[turn_aborted]…[/turn_aborted]` with the partial text, before
    the new input, whether the session continued live or was reloaded from its trace."""
    cut = trio.Event()

    async def turn_1(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("First sentence.")
        await stream.text_delta("Second senten")
        cut.set()
        await trio.sleep_forever()

    after = Reply(blocks=(text("Picking up."),))
    first_provider = providers([turn_1] if reload else [turn_1, after])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=first_provider, workspace_dir=workspace)
        stream = session.run("write two sentences")
        with trio.fail_after(10):
            await cut.wait()
        assert session.interrupt() is True
        outputs = await collect(stream)
        end = assert_one_abort_then_task_end(outputs)
        abort = of_type(outputs, Abort)[0]
        assert abort.message_complete is False
        assert abort.partial == (
            TextBlock(text="First sentence."),
            TextBlock(text="Second senten"),
        )
        assert end.turns == 1
        aborted = [r for r in of_type(outputs, RequestEnd) if r.status == "aborted"]
        assert len(aborted) == 1
        if reload:
            session_id = session.id
        else:
            await collect(session.run("go on"))
            request = first_provider.requests[1]
            lines = trace_lines(session)

    if reload:
        second_provider = providers([after])
        async with open_host(data_dir) as host:
            session = await host.load_session(session_id, provider=second_provider)
            assert session.load_errors == []
            outputs = await collect(session.run("go on"))
            assert of_type(outputs, TaskEnd)[0].status == "completed"
            request = second_provider.requests[0]
            lines = trace_lines(session)

    assert request.messages[0] == UserMessage(content=(TextBlock(text="write two sentences"),))
    assert last_user(request).content == (
        TextBlock(text="[turn_aborted]First sentence.\nSecond senten[/turn_aborted]"),
        TextBlock(text="go on"),
    )
    assert not any(isinstance(m, AssistantMessage) for m in request.messages)
    assert_carry_over_not_traced(lines)


@pytest.mark.parametrize("reload", [False, True], ids=["live", "reloaded"])
async def test_interrupt_while_tools_run_carries_results_and_interrupted_markers(
    data_dir: Path, workspace: Path, providers, gates: Gates, reload: bool
) -> None:
    """R-ABORT-2 case A, R-ABORT-4, R-TOOL-7, R-TRACE-4: the message was complete; call c1
    finished, c2 and c3 were still running when the task was interrupted. The running
    tools are cancelled; c1's result is carried as it is, c2 and c3 get exactly
    `[interrupted: tool aborted by user]`, in call order, before the new input — live and
    after a reload from the trace."""
    reply = Reply(
        blocks=(
            text("Three lookups."),
            tool_call("c1", "wait", key="a"),
            tool_call("c2", "wait", key="b"),
            tool_call("c3", "wait", key="c"),
        )
    )
    after = Reply(blocks=(text("Continuing."),))
    first_provider = providers([reply] if reload else [reply, after])
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[gates.tool()], provider=first_provider, workspace_dir=workspace
        )
        recorder = Recorder(session)
        stream = session.run("look up three", approve=allow_all)
        for key in "abc":
            await gates.started(key)
        gates.release("a")
        await recorder.wait_for("tool_call_output", call_id="c1")
        assert session.interrupt() is True
        outputs = await collect(stream)

        assert_one_abort_then_task_end(outputs)
        assert sorted(gates.cancelled) == ["b", "c"]  # cancelled through trio
        assert gates.finish_order == ["a"]  # R-ABORT-4: what finished stays done
        found = {o.call_id: o for o in of_type(outputs, ToolCallOutput)}
        assert len(of_type(outputs, ToolCallOutput)) == 3
        assert found["c1"].status == "ok"
        for call_id in ("c2", "c3"):
            assert found[call_id].status == "interrupted"
            assert found[call_id].is_error
            assert found[call_id].content == (TextBlock(text=INTERRUPTED),)
        abort = of_type(outputs, Abort)[0]
        assert abort.message_complete is True
        # the request itself had ended normally: no aborted request_end
        assert [r.status for r in of_type(outputs, RequestEnd)] == ["ok"]
        if reload:
            session_id = session.id
        else:
            await collect(session.run("go on", approve=allow_all))
            request = first_provider.requests[1]
            lines = trace_lines(session)

    if reload:
        second_provider = providers([after])
        async with open_host(data_dir) as host:
            session = await host.load_session(
                session_id, tools=[gates.tool()], provider=second_provider
            )
            outputs = await collect(session.run("go on", approve=allow_all))
            assert of_type(outputs, TaskEnd)[0].status == "completed"
            request = second_provider.requests[0]
            lines = trace_lines(session)

    assistant = request.messages[-2]
    assert isinstance(assistant, AssistantMessage)
    carried = last_user(request)
    results = results_of(carried)
    assert [(r.call_id, r.status) for r in results] == [
        ("c1", "ok"),
        ("c2", "interrupted"),
        ("c3", "interrupted"),
    ]
    assert [result_text(r) for r in results] == ["done a", INTERRUPTED, INTERRUPTED]
    assert texts_of(carried) == ["go on"]
    assert isinstance(carried.content[-1], TextBlock)  # the new input follows the results
    assert_carry_over_not_traced(lines)


async def test_cancel_event_interrupts_like_interrupt(
    data_dir: Path, workspace: Path, providers, gates: Gates
) -> None:
    """R-ABORT-1: run(cancel=event) — setting the event interrupts the task: the running
    tool is cancelled, one abort, one task_end(aborted) with the host's reason."""
    provider = providers([Reply(blocks=(tool_call("c1", "wait", key="a"),))])
    cancel = trio.Event()
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[gates.tool()], provider=provider, workspace_dir=workspace
        )
        stream = session.run("go", approve=allow_all, cancel=cancel)
        await gates.started("a")
        cancel.set()
        outputs = await collect(stream)
        assert not session.busy

    assert_one_abort_then_task_end(outputs)
    assert gates.cancelled == ["a"]
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.status == "interrupted"
    assert of_type(outputs, Abort)[0].reason == "cancelled by host"


async def test_interrupt_drops_queued_follow_ups_and_steering(
    data_dir: Path, workspace: Path, providers, gates: Gates
) -> None:
    """R-ABORT-1, R-STEER-5, R-STEER-6: an interrupted run ends there: queued follow-ups
    do not start and queued steering is discarded (never sent, never traced)."""
    provider = providers(
        [Reply(blocks=(tool_call("c1", "wait", key="a"),)), Reply(blocks=(text("later"),))]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[gates.tool()], provider=provider, workspace_dir=workspace
        )
        stream = session.run("go", approve=allow_all)
        await gates.started("a")
        assert session.follow_up("next task")
        assert session.steer("steer me")
        session.interrupt()
        outputs = await collect(stream)
        assert len(provider.requests) == 1
        assert_one_abort_then_task_end(outputs)
        assert [o.TYPE for o in outputs].count("user_msg") == 1

        await collect(session.run("fresh", approve=allow_all))
        carried = last_user(provider.requests[1])
        assert texts_of(carried) == ["fresh"]
        assert [r.status for r in results_of(carried)] == ["interrupted"]


async def test_interrupt_when_idle_returns_false(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-ABORT-1: nothing to interrupt when no task is running."""
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=providers([Reply(blocks=(text("ok"),))]), workspace_dir=workspace
        )
        assert session.interrupt() is False
        outputs = await collect(session.run("hi"))
        assert of_type(outputs, TaskEnd)[0].status == "completed"
        assert session.interrupt() is False


async def test_interrupt_while_an_allow_decision_waits_in_the_inbox(
    host, workspace: Path, providers
) -> None:
    """An approval that arrives after the interrupt (still in the supervisor's inbox when
    the task settles) never starts its call: the decision is recorded and the call is
    interrupted, paired (R-APPROVE-1, R-ABORT-2)."""
    ran: list[str] = []

    async def work() -> str:
        """Do work."""
        ran.append("work")
        return "done"

    from greenroom.protocols.tools import make_tool

    provider = providers([Reply(blocks=(tool_call("c1", "work"),)), Reply(blocks=(text("after"),))])
    session = await host.create_session(
        tools=[make_tool(work, parallel=True)], provider=provider, workspace_dir=workspace
    )

    def interrupt_then_allow(call: object) -> str:
        session.interrupt("interrupted while deciding")
        return "allow"

    outputs = await collect(session.run("go", approve=interrupt_then_allow))

    assert ran == []
    assert_one_abort_then_task_end(outputs)
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.status == "interrupted"
    again = await collect(session.run("next", approve=allow_all))
    assert of_type(again, TaskEnd)[-1].status == "completed"


async def test_an_interrupt_that_comes_as_a_turns_steering_is_read_sends_no_request(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, gates: Gates
) -> None:
    # R-ABORT-1: the steering of the next turn is read (its images attached) off the
    # supervisor's task; an interrupt handled together with that work's end was ignored
    # by the turn, which began all the same and sent its request before ending aborted.
    from greenroom.actors.providers.scripted import ScriptedProvider
    from greenroom.actors.runtime import supervisor

    attach = supervisor.attach

    async def attach_as_interrupted(*args: Any, **kwargs: Any) -> Any:
        assert session.interrupt("stop")  # delivered before the work's end
        return await attach(*args, **kwargs)

    provider = ScriptedProvider([
        Reply(blocks=(text("Working."), tool_call("c1", "wait", key="a"))),
        Reply(blocks=(text("Never sent."),)),
    ])  # fmt: skip
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=provider, tools=[gates.tool()], workspace_dir=workspace
        )
        stream = session.run("work", approve=allow_all)
        with trio.fail_after(RUN_TIMEOUT_S):
            await gates.started("a")
            assert session.steer("and mind the edges")
            monkeypatch.setattr(supervisor, "attach", attach_as_interrupted)
            gates.release("a")
            outputs = await collect(stream)
    assert [o.status for o in outputs if isinstance(o, TaskEnd)] == ["aborted"]
    assert len(provider.requests) == 1
    assert sum(isinstance(o, RequestBegin) for o in outputs) == 1
