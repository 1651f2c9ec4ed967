"""Interrupt at every phase of a turn, with the carry-over checked in the next task's first
request (R-ABORT-1..4, R-APPROVE-5, R-RETRY-5, R-TOOL-7, R-TRACE-1).

Phases: before the first chunk, mid-text, mid-tool-input, after the message with tools
running (case A), during approval (message complete, and while the model still streams),
during a reconnect backoff. Every test checks: exactly one ``abort`` and one
``task_end(aborted)``, nothing after ``task_end`` (run stream and subscribers), the trace's
seq without gaps, carry-over never traced, every tool call paired in the next request.

Time: a ``MockClock`` (autojump) — no latency is measured here (that is a benchmark), but
when tools honour cancellation the run's iterator must end without the virtual clock
advancing beyond the abort grace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import (
    Lookup,
    Recorder,
    allow_all,
    assert_trace_seq_without_gaps,
    collect,
    last_user,
    model_error,
    of_type,
    open_host,
    result_text,
    results_of,
    texts_of,
    types,
)

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    check_invariants,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import RunStream, Session
from greenroom.actors.runtime.supervisor import ABORT_GRACE_S
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, ModelRequest, UserMessage
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    RequestEnd,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.stream import BlockStarted, ToolArgumentsDelta
from greenroom.protocols.tools import Tool, make_tool

INTERRUPTED = "[interrupted: tool aborted by user]"


class Blocking:
    """A parallel-safe ``hold(key)`` tool: ``quick`` keys return at once, the others block
    until cancelled. No deadlines anywhere (an autojump clock would jump to them)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.blocked = trio.Event()
        blocking = self

        async def hold(key: str) -> str:
            """Hold until cancelled, unless the key starts with 'quick'."""
            blocking.started.append(key)
            if key.startswith("quick"):
                blocking.finished.append(key)
                return f"done {key}"
            blocking.blocked.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                blocking.cancelled.append(key)
                raise
            return "unreachable"  # pragma: no cover

        self.tool: Tool = make_tool(hold, parallel=True)


async def interrupt_and_check(session: Session, stream: RunStream, recorder: Recorder) -> list:
    """Interrupt now; check R-ABORT-1 / R-RUN-7 on the run's outputs and return them."""
    interrupted_at = trio.current_time()
    assert session.interrupt() is True
    outputs = await collect(stream, bound_s=None)
    # The iterator ended within the abort grace of virtual time (no tool held it up).
    assert trio.current_time() - interrupted_at <= ABORT_GRACE_S
    assert len(of_type(outputs, Abort)) == 1
    ends = of_type(outputs, TaskEnd)
    assert len(ends) == 1 and ends[0].status == "aborted"
    assert types(outputs, traced_only=False)[-2:] == ["abort", "task_end"]
    assert outputs[-1] is ends[0]
    await trio.testing.wait_all_tasks_blocked()
    assert recorder.outputs[-1] is ends[0]  # subscribers: nothing after task_end either
    assert not session.busy
    return outputs


async def next_task_request(
    session: Session, provider: ScriptedProvider, recorder: Recorder
) -> ModelRequest:
    """Run the next task ("go on") to completion; its first provider request."""
    before = len(provider.requests)
    outputs = await collect(session.run("go on", approve=allow_all), bound_s=None)
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    request = provider.requests[before]
    assert check_invariants(request) == []  # R-TOOL-7: every call paired, in call order
    lines = await assert_trace_seq_without_gaps(session)
    assert_carry_over_not_traced(lines)
    return request


async def next_task_request_reloaded(
    data_dir: Path, session_id: str, tool: Tool, providers: Any
) -> ModelRequest:
    """Load the session in a new host on ``data_dir`` (its trace read back without a
    corrupt line) and run its next task: that task's first request (:func:`next_task_request`)."""
    provider = providers([Reply(blocks=(text("Resumed."),))])
    async with open_host(data_dir) as host:
        session = await host.load_session(session_id, tools=[tool], provider=provider)
        assert session.load_errors == []
        return await next_task_request(session, provider, Recorder(session))


def assert_carry_over_not_traced(lines: list[dict[str, Any]]) -> None:
    """R-ABORT-3: carry-over reaches the model context only, never the trace; the abort
    record is there once."""
    assert [line["type"] for line in lines].count("abort") == 1
    for line in lines:
        if line["type"] == "user_msg":
            for block in line["content"]:
                body = block.get("text", "")
                assert "[turn_aborted]" not in body and INTERRUPTED not in body
    # nothing of the aborted run after its task_end
    aborted_run = next(line["run_id"] for line in lines if line["type"] == "abort")
    mine = [line["type"] for line in lines if line.get("run_id") == aborted_run]
    assert mine[-2:] == ["abort", "task_end"]


def assert_no_assistant_for(request: ModelRequest, prompt: str) -> None:
    """Case B: the cut turn left no assistant message; the first prompt is its own user
    message before the carry-over."""
    assert request.messages[0] == UserMessage(content=(TextBlock(text=prompt),))
    assert not any(isinstance(m, AssistantMessage) for m in request.messages)


async def test_interrupt_before_the_first_chunk(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-ABORT-1, R-ABORT-2 case B: the provider got the request but sent nothing. The
    attempt ends `aborted`, the abort has no partial output and message_complete False;
    the next request carries an empty `[turn_aborted][/turn_aborted]` before the input."""
    arrived = trio.Event()

    async def silent(request: ModelRequest, stream: ScriptedStream) -> None:
        arrived.set()
        await trio.sleep_forever()

    provider = providers([silent, Reply(blocks=(text("Resumed."),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    recorder = Recorder(session)
    stream = session.run("start")
    await arrived.wait()
    outputs = await interrupt_and_check(session, stream, recorder)

    abort = of_type(outputs, Abort)[0]
    assert (abort.message_complete, abort.partial) == (False, ())
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["aborted"]
    assert "model_msg" not in types(outputs)

    request = await next_task_request(session, provider, recorder)
    assert_no_assistant_for(request, "start")
    assert texts_of(last_user(request)) == ["[turn_aborted][/turn_aborted]", "go on"]


async def test_interrupt_mid_text(host: Host, workspace: Path, providers, autojump_clock) -> None:
    """R-ABORT-2 case B: a complete text block and a text cut mid-word are both carried in
    one `[turn_aborted]` text, in order, before the new input."""
    cut = trio.Event()

    async def talk(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("One.")
        await stream.text_delta("Tw")
        cut.set()
        await trio.sleep_forever()

    provider = providers([talk, Reply(blocks=(text("Resumed."),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    recorder = Recorder(session)
    stream = session.run("count")
    await cut.wait()
    outputs = await interrupt_and_check(session, stream, recorder)

    abort = of_type(outputs, Abort)[0]
    assert abort.message_complete is False
    assert abort.partial == (TextBlock(text="One."), TextBlock(text="Tw"))

    request = await next_task_request(session, provider, recorder)
    assert_no_assistant_for(request, "count")
    assert texts_of(last_user(request)) == ["[turn_aborted]One.\nTw[/turn_aborted]", "go on"]


async def test_interrupt_mid_tool_input(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-ABORT-2 case B, R-TOOL-5: a tool call whose arguments were still streaming (a
    ToolArgumentsDelta sent, the block never completed) is never approved or run and gets
    no tool output; the carry-over shows it with its partial arguments."""
    cut = trio.Event()
    blocking = Blocking()

    async def calling(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("Calling.")
        await stream._deliver(
            [
                BlockStarted(index=1, kind="tool_call", call_id="c1", name="hold"),
                ToolArgumentsDelta(index=1, call_id="c1", name="hold", delta='{"key": "qu'),
            ]
        )
        cut.set()
        await trio.sleep_forever()

    provider = providers([calling, Reply(blocks=(text("Resumed."),))])
    session = await host.create_session(
        tools=[blocking.tool], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("call it", approve=allow_all)
    await cut.wait()
    outputs = await interrupt_and_check(session, stream, recorder)

    assert blocking.started == []
    assert of_type(outputs, ToolCallOutput) == []
    assert of_type(outputs, ApprovalDecision) == []
    abort = of_type(outputs, Abort)[0]
    assert abort.message_complete is False
    assert abort.partial == (
        TextBlock(text="Calling."),
        ToolCallBlock(id="c1", name="hold", arguments={}, invalid_arguments='{"key": "qu'),
    )

    request = await next_task_request(session, provider, recorder)
    assert_no_assistant_for(request, "call it")
    assert texts_of(last_user(request)) == [
        '[turn_aborted]Calling.\n[tool call hold {"key": "qu][/turn_aborted]',
        "go on",
    ]
    assert results_of(last_user(request)) == []


async def test_interrupt_after_the_message_with_tools_running(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-ABORT-2 case A, R-ABORT-4: the message was complete; c1 finished, c2 was running
    and is cancelled through trio. The next request has the assistant message, then c1's
    real result and c2's `[interrupted: tool aborted by user]`, in call order, then the
    new input."""
    blocking = Blocking()
    provider = providers(
        [
            Reply(
                blocks=(
                    text("Two calls."),
                    tool_call("c1", "hold", key="quick-a"),
                    tool_call("c2", "hold", key="b"),
                )
            ),
            Reply(blocks=(text("Resumed."),)),
        ]
    )
    session = await host.create_session(
        tools=[blocking.tool], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("two", approve=allow_all)
    await recorder.wait_for("tool_call_output", call_id="c1", bound_s=None)
    await blocking.blocked.wait()
    outputs = await interrupt_and_check(session, stream, recorder)

    assert blocking.cancelled == ["b"]
    assert blocking.finished == ["quick-a"]  # R-ABORT-4: what finished stays done
    abort = of_type(outputs, Abort)[0]
    assert (abort.message_complete, abort.partial) == (True, ())
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["ok"]
    statuses = {o.call_id: o.status for o in of_type(outputs, ToolCallOutput)}
    assert statuses == {"c1": "ok", "c2": "interrupted"}

    request = await next_task_request(session, provider, recorder)
    assistant = request.messages[-2]
    assert isinstance(assistant, AssistantMessage)
    assert [b.id for b in assistant.content if isinstance(b, ToolCallBlock)] == ["c1", "c2"]
    carried = last_user(request)
    assert [(r.call_id, r.status, result_text(r)) for r in results_of(carried)] == [
        ("c1", "ok", "done quick-a"),
        ("c2", "interrupted", INTERRUPTED),
    ]
    assert texts_of(carried) == ["go on"]
    assert sorted(blocking.started) == ["b", "quick-a"]  # nothing re-ran in the next task


async def test_interrupt_during_approval_after_the_message(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-APPROVE-5, R-ABORT-2 case A: the message is complete and the approve callback is
    still deciding c1. The interrupt resolves it as deny (by default), never runs it, and
    pairs it with the interrupted result in the next request."""
    asked = trio.Event()
    blocking = Blocking()

    async def undecided(call: ToolCallBlock) -> str:
        asked.set()
        await trio.sleep_forever()
        return "allow"  # pragma: no cover

    provider = providers(
        [Reply(blocks=(tool_call("c1", "hold", key="quick"),)), Reply(blocks=(text("Ok."),))]
    )
    session = await host.create_session(
        tools=[blocking.tool], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("ask", approve=undecided)
    await asked.wait()
    await recorder.wait_for("request_end", bound_s=None)
    outputs = await interrupt_and_check(session, stream, recorder)

    assert [(d.call_id, d.decision, d.by) for d in of_type(outputs, ApprovalDecision)] == [
        ("c1", "deny", "default")
    ]
    (output,) = of_type(outputs, ToolCallOutput)
    assert (output.call_id, output.is_error) == ("c1", True)
    assert of_type(outputs, Abort)[0].message_complete is True
    assert blocking.started == []

    request = await next_task_request(session, provider, recorder)
    carried = last_user(request)
    assert [(r.call_id, r.is_error) for r in results_of(carried)] == [("c1", True)]
    assert texts_of(carried) == ["go on"]
    assert blocking.started == []


async def test_interrupt_during_approval_while_the_model_still_streams(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-APPROVE-5, R-ABORT-2 case B: c1's block is complete and awaiting approval while
    the model still streams text. The interrupt denies c1 and the turn is flattened: the
    `[turn_aborted]` text shows the call and its interrupted result, so no structured
    call is left unpaired."""
    asked = trio.Event()
    blocking = Blocking()

    async def undecided(call: ToolCallBlock) -> str:
        asked.set()
        await trio.sleep_forever()
        return "allow"  # pragma: no cover

    async def streaming(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.tool_call(tool_call("c1", "hold", key="quick"))
        await asked.wait()
        await stream.text_delta("And also")
        await trio.sleep_forever()

    provider = providers([streaming, Reply(blocks=(text("Ok."),))])
    session = await host.create_session(
        tools=[blocking.tool], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("ask", approve=undecided)
    await recorder.wait_for("partial_text", bound_s=None)
    outputs = await interrupt_and_check(session, stream, recorder)

    assert [(d.call_id, d.decision) for d in of_type(outputs, ApprovalDecision)] == [("c1", "deny")]
    assert of_type(outputs, Abort)[0].message_complete is False
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["aborted"]
    assert blocking.started == []

    request = await next_task_request(session, provider, recorder)
    assert_no_assistant_for(request, "ask")
    (carried_text, new_input) = texts_of(last_user(request))
    assert carried_text == (
        '[turn_aborted][tool call hold {"key": "quick"}]\n'
        f"[tool result hold: {INTERRUPTED}]\nAnd also[/turn_aborted]"
    )
    assert new_input == "go on"
    assert results_of(last_user(request)) == []


@pytest.mark.parametrize("reload", [False, True], ids=["live", "reloaded"])
async def test_interrupt_during_backoff(
    data_dir: Path, workspace: Path, providers, lookup: Lookup, autojump_clock, reload: bool
) -> None:
    """R-RETRY-5, R-ABORT-1, R-ABORT-2 case B, R-RETRY-4, R-TRACE-4: attempt 1 streams a
    text and a tool call that is approved and RUNS, then fails; the streamer sleeps a 30 s
    backoff and the task is interrupted. No further request is sent; the pending attempt
    ends `aborted`. The next task's first request (live, and after a reload from the
    trace) carries the failed attempt's output — the text, the call and its result — in
    `[turn_aborted]`, so the model knows the tool already ran; nothing is unpaired and
    the tool is not run again."""
    provider = providers(
        [
            Reply(
                blocks=(text("Half."), tool_call("c1", "lookup", key="a"), text("never")),
                fail=model_error("timeout", "overloaded", retry_after_s=30.0),
                fail_after_blocks=2,
            ),
            *([] if reload else [Reply(blocks=(text("Resumed."),))]),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[lookup.tool], provider=provider, workspace_dir=workspace
        )
        recorder = Recorder(session)
        stream = session.run("try", approve=allow_all)
        await recorder.wait_for("request_end", attempt=1, bound_s=None)
        await trio.testing.wait_all_tasks_blocked()  # asleep in the backoff
        outputs = await interrupt_and_check(session, stream, recorder)

        assert len(provider.requests) == 1
        assert lookup.calls == ["a"]
        assert [(e.status, e.attempt) for e in of_type(outputs, RequestEnd)] == [
            ("timeout", 1),
            ("aborted", 2),
        ]
        abort = of_type(outputs, Abort)[0]
        assert abort.message_complete is False
        assert abort.partial == (
            TextBlock(text="Half."),
            ToolCallBlock(id="c1", name="lookup", arguments={"key": "a"}),
        )
        if not reload:
            request = await next_task_request(session, provider, recorder)
        session_id = session.id

    if reload:
        request = await next_task_request_reloaded(data_dir, session_id, lookup.tool, providers)

    assert lookup.calls == ["a"]
    assert_no_assistant_for(request, "try")
    assert texts_of(last_user(request)) == [
        '[turn_aborted]Half.\n[tool call lookup {"key": "a"}]\n'
        "[tool result lookup: value-a][/turn_aborted]",
        "go on",
    ]


@pytest.mark.parametrize("reload", [False, True], ids=["live", "reloaded"])
async def test_interrupt_after_a_failed_attempt_while_its_call_runs(
    data_dir: Path, workspace: Path, providers, autojump_clock, reload: bool
) -> None:
    """R-ABORT-2 case B, R-ABORT-3, R-RETRY-4: attempt 1 streams a text and a call that
    starts running, then fails; its `request_end` is written and the retry waits for the
    call (R-RUN-4) when the interrupt lands. The failed stream cut the message: the abort
    records it incomplete, with the attempt's output, and writes no second `request_end`.
    The next task's first request (live, and rebuilt from the trace) tells the model that
    the call was made and was interrupted; nothing runs again."""
    blocking = Blocking()
    provider = providers(
        [
            Reply(
                blocks=(text("Half."), tool_call("c1", "hold", key="b"), text("never")),
                fail=model_error("timeout", "overloaded"),
                fail_after_blocks=2,
            ),
            *([] if reload else [Reply(blocks=(text("Resumed."),))]),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[blocking.tool], provider=provider, workspace_dir=workspace
        )
        recorder = Recorder(session)
        stream = session.run("try", approve=allow_all)
        await recorder.wait_for("request_end", attempt=1, bound_s=None)
        await blocking.blocked.wait()
        await trio.testing.wait_all_tasks_blocked()  # the retry waits for c1
        outputs = await interrupt_and_check(session, stream, recorder)

        assert len(provider.requests) == 1
        assert blocking.cancelled == ["b"]
        assert [(e.status, e.attempt) for e in of_type(outputs, RequestEnd)] == [("timeout", 1)]
        assert [(o.call_id, o.status) for o in of_type(outputs, ToolCallOutput)] == [
            ("c1", "interrupted")
        ]
        abort = of_type(outputs, Abort)[0]
        assert abort.message_complete is False
        assert abort.partial == (
            TextBlock(text="Half."),
            ToolCallBlock(id="c1", name="hold", arguments={"key": "b"}),
        )
        if not reload:
            request = await next_task_request(session, provider, recorder)
        session_id = session.id

    if reload:
        request = await next_task_request_reloaded(data_dir, session_id, blocking.tool, providers)

    assert blocking.started == ["b"]
    assert_no_assistant_for(request, "try")
    assert texts_of(last_user(request)) == [
        '[turn_aborted]Half.\n[tool call hold {"key": "b"}]\n'
        f"[tool result hold: {INTERRUPTED}][/turn_aborted]",
        "go on",
    ]


@pytest.mark.parametrize("reload", [False, True], ids=["live", "reloaded"])
async def test_interrupt_while_the_retry_streams(
    data_dir: Path, workspace: Path, providers, lookup: Lookup, autojump_clock, reload: bool
) -> None:
    """R-ABORT-2 case B, R-ABORT-3, R-RETRY-4: attempt 1 runs lookup(a) and fails; the
    retry is sent with the `[turn_retried]` note (the call and its result) and is cut
    mid-text. The next task's first request (live, and rebuilt from the trace) keeps the
    note with the input it was sent with, then the retry's own partial output in
    `[turn_aborted]`: the model still knows the call ran and what it returned, and it is
    not run again."""
    cut = trio.Event()

    async def retry(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text_delta("Other")
        cut.set()
        await trio.sleep_forever()

    provider = providers(
        [
            Reply(
                blocks=(text("Half."), tool_call("c1", "lookup", key="a"), text("never")),
                fail=model_error("timeout", "overloaded"),
                fail_after_blocks=2,
            ),
            retry,
            *([] if reload else [Reply(blocks=(text("Resumed."),))]),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            tools=[lookup.tool], provider=provider, workspace_dir=workspace
        )
        recorder = Recorder(session)
        stream = session.run("try", approve=allow_all)
        await cut.wait()
        outputs = await interrupt_and_check(session, stream, recorder)

        sent_with_retry = provider.requests[1].messages[-1]
        assert [(e.status, e.attempt) for e in of_type(outputs, RequestEnd)] == [
            ("timeout", 1),
            ("aborted", 2),
        ]
        abort = of_type(outputs, Abort)[0]
        assert (abort.message_complete, abort.partial) == (False, (TextBlock(text="Other"),))
        if not reload:
            request = await next_task_request(session, provider, recorder)
        session_id = session.id

    if reload:
        request = await next_task_request_reloaded(data_dir, session_id, lookup.tool, providers)

    assert lookup.calls == ["a"]
    note = (
        '[turn_retried]Half.\n[tool call lookup {"key": "a"}]\n'
        "[tool result lookup: value-a][/turn_retried]"
    )
    assert texts_of(sent_with_retry) == ["try", note]
    assert request.messages[0] == sent_with_retry  # as the retry was sent
    assert not any(isinstance(m, AssistantMessage) for m in request.messages)
    assert texts_of(last_user(request)) == ["[turn_aborted]Other[/turn_aborted]", "go on"]
