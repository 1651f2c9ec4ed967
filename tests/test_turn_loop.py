"""The turn loop with the scripted model: output order, tool-result order, task end,
max_turns, thinking, Busy, steering and follow-ups (R-RUN, R-STEER)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import (
    RUN_TIMEOUT_S,
    Gates,
    Lookup,
    Recorder,
    allow_all,
    collect,
    index_of,
    is_output,
    last_user,
    of_type,
    open_host,
    result_text,
    results_of,
    texts_of,
    types,
)

from greenroom.actors.providers.scripted import Reply, ScriptedStream, text, tool_call
from greenroom.actors.runtime.errors import Busy, SessionClosed
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import ImageBlock, TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, ModelRequest
from greenroom.protocols.outputs import (
    Abort,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    TaskEnd,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.stream import TokenUsage


async def test_turn_outputs_in_stream_order_and_request_end_before_running_tool_finishes(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-RUN-2, R-RUN-3: request_begin, partials and one model_msg per block in stream
    order; token_usage then request_end as soon as the stream ends, while the tool that
    the model called is still running; its tool_call_output comes after request_end."""

    async def turn_1(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.thinking("Plan the lookup.", signature="sig-1")
        await stream.text("Looking it up.")
        await stream.tool_call(tool_call("c1", "wait", key="a"))
        await gates.started("a")  # the tool runs while the model still streams
        await stream.text("Still streaming.")
        await stream.end("tool_use", TokenUsage(input=20, output=7))

    provider = providers([turn_1, Reply(blocks=(text("All done."),))])
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)

    await recorder.wait_for("request_end", turn=1)
    assert gates.is_started("a")
    assert gates.finish_order == []
    assert not recorder.seen("tool_call_output")
    await trio.testing.wait_all_tasks_blocked()
    assert not recorder.seen("tool_call_output")  # request_end did not wait for the tool
    assert len(provider.requests) == 1
    gates.release("a")
    outputs = await collect(stream)

    assert types(outputs) == [
        "user_msg",
        "task_start",
        "request_begin",
        "model_msg",  # thinking
        "model_msg",  # text
        "model_msg",  # tool_call
        "approval_decision",
        "model_msg",  # text
        "token_usage",
        "request_end",
        "tool_call_output",
        "request_begin",
        "model_msg",
        "token_usage",
        "request_end",
        "task_end",
    ]
    turn_1_blocks = [m.block for m in of_type(outputs, ModelMsg) if m.turn == 1]
    assert turn_1_blocks == [
        ThinkingBlock(text="Plan the lookup.", signature="sig-1"),
        TextBlock(text="Looking it up."),
        ToolCallBlock(id="c1", name="wait", arguments={"key": "a"}),
        TextBlock(text="Still streaming."),
    ]
    # Each block's partials come after the previous block's model_msg and before its own.
    turn_1 = outputs[: index_of(outputs, is_output("request_end", turn=1))]
    models = [i for i, o in enumerate(turn_1) if isinstance(o, ModelMsg)]
    partial_kinds = (PartialText, PartialThinking, PartialToolCall)
    for k, position in enumerate(models):
        previous = models[k - 1] if k else 0
        partials = [
            i for i, o in enumerate(turn_1) if isinstance(o, partial_kinds) and o.index == k
        ]
        assert partials, f"no partial output for block {k}"
        assert all(previous < i < position for i in partials)
    text_partials = "".join(
        o.text for o in outputs[: models[1]] if isinstance(o, PartialText) and o.index == 1
    )
    assert text_partials == "Looking it up."
    usage = of_type(outputs, TokenUsageOutput)[0]
    assert usage.request == TokenUsage(input=20, output=7)
    end = index_of(outputs, is_output("request_end", turn=1))
    assert index_of(outputs, is_output("token_usage", turn=1)) == end - 1
    assert outputs[end].stop_reason == "tool_use"
    assert index_of(outputs, is_output("tool_call_output", call_id="c1")) > end


async def test_results_in_call_order_outputs_in_completion_order(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-RUN-4: call 2 finishes before call 1: the outputs come c2, c1; the next request
    carries the results c1, c2 and starts only once both calls are terminal."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "wait", key="a"), tool_call("c2", "wait", key="b"))),
            Reply(blocks=(text("Both done."),)),
        ]
    )
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)

    await gates.started("a")
    await gates.started("b")
    gates.release("b")
    await recorder.wait_for("tool_call_output", call_id="c2")
    await trio.testing.wait_all_tasks_blocked()
    assert len(provider.requests) == 1  # c1 is still running: no next request yet
    assert not recorder.seen("request_begin", turn=2)
    gates.release("a")
    outputs = await collect(stream)

    assert [o.call_id for o in of_type(outputs, ToolCallOutput)] == ["c2", "c1"]
    results = results_of(last_user(provider.requests[1]))
    assert [r.call_id for r in results] == ["c1", "c2"]
    assert [result_text(r) for r in results] == ["done a", "done b"]
    begin_2 = index_of(outputs, is_output("request_begin", turn=2))
    assert all(outputs.index(o) < begin_2 for o in of_type(outputs, ToolCallOutput))


async def test_answer_without_tool_call_ends_the_task_with_one_task_end(
    host: Host, workspace: Path, providers
) -> None:
    """R-RUN-5, R-RUN-7: a message without tool calls ends the task; exactly one task_end
    (completed, turns, usage, wall_ms) and it is the last output."""
    provider = providers([Reply(blocks=(text("Hello."),), usage=TokenUsage(input=9, output=2))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("hi"))

    ends = of_type(outputs, TaskEnd)
    assert len(ends) == 1
    assert outputs[-1] is ends[0]
    end = ends[0]
    assert end.status == "completed"
    assert end.turns == 1
    assert end.usage == TokenUsage(input=9, output=2)
    assert isinstance(end.wall_ms, int) and end.wall_ms >= 0
    assert end.run_id == of_type(outputs, TaskStart)[0].run_id
    assert len(provider.requests) == 1
    assert not session.busy


async def test_task_usage_is_the_sum_of_its_token_usage_outputs(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-RUN-7: task_end.usage sums every token_usage of the task (two turns here)."""
    provider = providers(
        [
            Reply(
                blocks=(tool_call("c1", "lookup", key="k"),),
                usage=TokenUsage(input=100, output=10, cache_read=50),
            ),
            Reply(blocks=(text("k is value-k."),), usage=TokenUsage(input=130, output=6)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("what is k?", approve=allow_all))

    usages = [o.request for o in of_type(outputs, TokenUsageOutput)]
    assert len(usages) == 2
    end = of_type(outputs, TaskEnd)[0]
    assert end.status == "completed"
    assert end.turns == 2
    assert end.usage == TokenUsage(input=230, output=16, cache_read=50)
    assert lookup.calls == ["k"]


async def test_max_turns_ends_the_task_with_status_max_turns(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-RUN-6: create_session(max_turns=2) overrides the default (-1); a model that keeps
    calling tools is stopped after 2 turns with status max_turns and a message, never
    "completed". The next task still pairs the last turn's results (R-TOOL-7)."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(tool_call("c2", "lookup", key="b"),)),
            Reply(blocks=(text("Stopping."),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace, max_turns=2
    )
    assert session.settings.max_turns == 2
    outputs = await collect(session.run("loop", approve=allow_all))

    end = of_type(outputs, TaskEnd)[0]
    assert outputs[-1] is end
    assert end.status == "max_turns"
    assert end.turns == 2
    assert end.message is not None and "max_turns" in end.message
    assert len(provider.requests) == 2
    assert lookup.calls == ["a", "b"]

    outputs = await collect(session.run("go on"))
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    carried = last_user(provider.requests[2])
    assert [r.call_id for r in results_of(carried)] == ["c2"]
    assert texts_of(carried) == ["go on"]


async def test_default_max_turns_is_unlimited(host: Host, workspace: Path, providers) -> None:
    """R-RUN-6: the default is -1, no limit."""
    session = await host.create_session(
        provider=providers([Reply(blocks=(text("ok"),))]), workspace_dir=workspace
    )
    assert session.settings.max_turns == -1
    outputs = await collect(session.run("hi"))
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_thinking_is_shown_and_kept_in_the_assistant_message(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-RUN-9: thinking is emitted (partial_thinking, model_msg); the supervisor keeps the
    ThinkingBlock, signature included, in the AssistantMessage of the next request (the
    codec decides what to resend)."""
    thinking = ThinkingBlock(text="I should look k up.", signature="opaque-sig")
    provider = providers(
        [
            Reply(blocks=(thinking, tool_call("c1", "lookup", key="k"))),
            Reply(blocks=(text("value-k"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("k?", approve=allow_all))

    assert [o.text for o in of_type(outputs, PartialThinking)] == ["I should look k up."]
    assert of_type(outputs, ModelMsg)[0].block == thinking
    assistant = provider.requests[1].messages[1]
    assert isinstance(assistant, AssistantMessage)
    assert assistant.content[0] == thinking
    assert isinstance(assistant.content[1], ToolCallBlock)


async def test_second_run_while_running_raises_busy(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-HOST-2: one task at a time; run() while running raises Busy, and works again
    once the task has ended."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "wait", key="a"),)),
            Reply(blocks=(text("done"),)),
            Reply(blocks=(text("again"),)),
        ]
    )
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace
    )
    stream = session.run("first", approve=allow_all)
    await gates.started("a")
    assert session.busy
    with pytest.raises(Busy):
        session.run("second")
    gates.release("a")
    assert of_type(await collect(stream), TaskEnd)[0].status == "completed"
    outputs = await collect(session.run("third"))
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert [texts_of(last_user(r))[-1] for r in provider.requests[2:]] == ["third"]


# -- steering and follow-ups (R-STEER) --------------------------------------------------------


async def test_steer_and_follow_up_return_false_when_idle(
    host: Host, workspace: Path, providers
) -> None:
    """R-STEER-1, R-STEER-6: with no task running there is nothing to steer or follow."""
    session = await host.create_session(
        provider=providers([Reply(blocks=(text("ok"),))]), workspace_dir=workspace
    )
    assert session.steer("hello") is False
    assert session.follow_up("hello") is False
    await collect(session.run("hi"))
    assert session.steer("after") is False


async def test_steer_and_follow_up_raise_session_closed_once_its_close_has_begun(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-STEER-1, R-STEER-6, R-HOST-3: a closed session takes no more work, and steer and
    follow_up say so as run does, with SessionClosed: while the task the close interrupted
    still ends, and once the session is closed. They answered False, which tells a caller
    to start a task instead (or True, for input that reached the closing supervisor's
    inbox, only to be dropped there)."""
    provider = providers([Reply(blocks=(tool_call("c1", "wait", key="a"),))])
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace
    )
    stream = session.run("start", approve=allow_all)
    await gates.started("a")
    while_closing: list[str] = []

    def queue_as_the_task_aborts(batch: list[Output]) -> None:
        # Published by the supervisor of the task the close interrupted: it still runs.
        if not any(isinstance(output, Abort) for output in batch):
            return
        for queue in (session.steer, session.follow_up):
            try:
                while_closing.append(f"answered {queue('too late')}")
            except SessionClosed as exc:
                while_closing.append(str(exc))

    session.subscribe(queue_as_the_task_aborts)
    await host.close_session(session.id)
    assert while_closing == [f"session {session.id} is closed"] * 2
    assert of_type(await collect(stream), TaskEnd)[0].status == "aborted"
    for queue in (session.steer, session.follow_up):
        with pytest.raises(SessionClosed, match=f"^session {session.id} is closed$"):
            queue("later")
    assert len(provider.requests) == 1  # nothing ran the words


async def test_steering_during_a_tool_run_joins_that_turns_results(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-STEER-1, R-STEER-2, R-STEER-4: two steer() calls while a tool runs reach the next
    request as ONE [user_steering] text after the turn's tool results; a user_msg of kind
    steering is emitted and traced; the tool output is untouched."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "wait", key="a"),)),
            Reply(blocks=(text("Adjusted."),)),
        ]
    )
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("start", approve=allow_all)
    await gates.started("a")
    assert session.steer("use metric units") is True
    assert session.steer([TextBlock(text="and be brief")]) is True
    await trio.testing.wait_all_tasks_blocked()
    assert not recorder.seen("user_msg", kind="steering")  # queued, not yet delivered
    gates.release("a")
    outputs = await collect(stream)

    message = last_user(provider.requests[1])
    assert [r.call_id for r in results_of(message)] == ["c1"]
    assert result_text(results_of(message)[0]) == "done a"
    assert texts_of(message) == ["[user_steering]use metric units\nand be brief[/user_steering]"]
    assert isinstance(message.content[-1], TextBlock)  # after the results
    steering = [o for o in of_type(outputs, UserMsg) if o.kind == "steering"]
    assert len(steering) == 1
    assert steering[0].content == (
        TextBlock(text="use metric units"),
        TextBlock(text="and be brief"),
    )
    assert steering[0].seq is not None
    at = outputs.index(steering[0])
    assert index_of(outputs, is_output("tool_call_output", call_id="c1")) < at
    assert at < index_of(outputs, is_output("request_begin", turn=2))
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_steering_in_a_turn_without_tool_calls_continues_the_task(
    host: Host, workspace: Path, providers
) -> None:
    """R-STEER-3: the model answers without tool calls, but steering was queued during the
    turn: the task does not end; the steering alone is the next request's input."""
    streaming = trio.Event()
    steered = trio.Event()

    async def turn_1(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("Here is a long answer.")
        streaming.set()
        await steered.wait()
        await stream.end()

    provider = providers([turn_1, Reply(blocks=(text("Shorter then."),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    stream = session.run("explain")
    with trio.fail_after(10):
        await streaming.wait()
    assert session.steer("shorter please")
    steered.set()
    outputs = await collect(stream)

    assert len(provider.requests) == 2
    assert last_user(provider.requests[1]).content == (
        TextBlock(text="[user_steering]shorter please[/user_steering]"),
    )
    assert isinstance(provider.requests[1].messages[-2], AssistantMessage)
    end = of_type(outputs, TaskEnd)
    assert len(end) == 1
    assert end[0].status == "completed"
    assert end[0].turns == 2
    assert [o.kind for o in of_type(outputs, UserMsg)] == ["prompt", "steering"]


async def test_follow_ups_run_after_the_task_in_the_same_stream_fifo(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-STEER-6: follow-ups queued during a task run as new tasks after it, in order, in
    the same RunStream; they never change the running task."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "wait", key="a"),)),
            Reply(blocks=(text("one"),)),
            Reply(blocks=(text("two"),)),
            Reply(blocks=(text("three"),)),
        ]
    )
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace
    )
    stream = session.run("first", approve=allow_all)
    await gates.started("a")
    assert session.follow_up("second") is True
    assert session.follow_up("third") is True
    gates.release("a")
    outputs = await collect(stream)

    prompts = [o for o in of_type(outputs, UserMsg) if o.kind == "prompt"]
    assert [p.content for p in prompts] == [
        (TextBlock(text="first"),),
        (TextBlock(text="second"),),
        (TextBlock(text="third"),),
    ]
    ends = of_type(outputs, TaskEnd)
    assert [e.status for e in ends] == ["completed"] * 3
    assert outputs[-1] is ends[-1]
    run_ids = [p.run_id for p in prompts]
    assert len(set(run_ids)) == 3
    assert [e.run_id for e in ends] == run_ids
    starts = of_type(outputs, TaskStart)
    assert [s.input_seq for s in starts] == [p.seq for p in prompts]
    # Each task ends before the next one's input is taken.
    for end, prompt in zip(ends, prompts[1:], strict=False):
        assert outputs.index(end) < outputs.index(prompt)
    # The running task never saw the follow-ups.
    assert not any("second" in t for t in texts_of(last_user(provider.requests[1])))
    assert texts_of(last_user(provider.requests[2])) == ["second"]
    assert texts_of(last_user(provider.requests[3])) == ["third"]
    assert of_type(outputs, RequestBegin)[-1].run_id == run_ids[2]


@pytest.mark.parametrize("vision", [True, False], ids=["vision", "no-vision"])
async def test_steering_images_follow_the_block_or_fold_into_it(
    host: Host, workspace: Path, providers, gates: Gates, vision: bool
) -> None:
    """R-STEER-2: images in steering input follow the [user_steering] text as image
    content (attached when the steering is taken: R-SEC-8); for a model without vision
    they fold into `[attached image: <path>]` lines inside the one marked block."""
    (workspace / "shot.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    provider = providers(
        [Reply(blocks=(tool_call("c1", "wait", key="a"),)), Reply(blocks=(text("ok"),))]
    )
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace, supports_vision=vision
    )
    stream = session.run("start", approve=allow_all)
    await gates.started("a")
    assert session.steer([TextBlock(text="look at this"), ImageBlock(path="shot.png")])
    gates.release("a")
    await collect(stream)

    content = last_user(provider.requests[1]).content
    assert [type(p).__name__ for p in content[:1]] == ["ToolResult"]
    if vision:
        assert content[1:] == (
            TextBlock(text="[user_steering]look at this[/user_steering]"),
            ImageBlock(
                path="shot.png",
                media_type="image/png",
                sha256=hashlib.sha256(b"\x89PNG\r\n\x1a\n").hexdigest(),
            ),
        )
    else:
        assert content[1:] == (
            TextBlock(
                text="[user_steering]look at this\n[attached image: shot.png][/user_steering]"
            ),
        )


async def test_steering_that_comes_as_a_task_ends_runs_as_a_task_of_its_own(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R-STEER-1, R-STEER-5: steering that came while the task's end was made durable was
    # accepted (steer() answered True) and then discarded: the person's words were lost.
    # Given to the next task as [user_steering] (hours later perhaps) it would be wrong
    # too. It runs as a task of its own right after, as if steer() had found no task.
    from greenroom.actors.providers.scripted import ScriptedProvider
    from greenroom.actors.runtime.emitter import OutputEmitter

    provider = ScriptedProvider(
        [Reply(blocks=(text("One."),)), Reply(blocks=(text("Late."),)),
         Reply(blocks=(text("Two."),))]
    )
    sync_task_end = OutputEmitter.sync_task_end
    steered: list[bool] = []

    async def steered_while_ending(self: OutputEmitter, *, completed: bool) -> None:
        if not steered:
            steered.append(session.steer("LATE STEER"))
        await sync_task_end(self, completed=completed)

    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        monkeypatch.setattr(OutputEmitter, "sync_task_end", steered_while_ending)
        first = await collect(session.run("one", approve=allow_all))
        monkeypatch.undo()
        await collect(session.run("two", approve=allow_all))
    assert steered == [True]  # delivered: the task's supervisor still ran
    assert [e.status for e in of_type(first, TaskEnd)] == ["completed", "completed"]
    assert last_user(provider.requests[1]).content == (TextBlock(text="LATE STEER"),)
    assert "user_steering" not in str(provider.requests[2].messages)
    assert last_user(provider.requests[2]).content == (TextBlock(text="two"),)


async def test_steering_right_after_an_interrupt_runs_after_the_aborted_task(
    data_dir: Path, workspace: Path, gates: Gates
) -> None:
    # R-STEER-1, R-ABORT-1: Ctrl-C, then words typed at once: the interrupt is handled
    # first, so the words come to a stopping task. They were discarded although steer()
    # had answered True; they run as the next task.
    from greenroom.actors.providers.scripted import ScriptedProvider

    provider = ScriptedProvider(
        [Reply(blocks=(tool_call("c1", "wait", key="a"),)),
         Reply(blocks=(text("Heard you."),))]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=provider, workspace_dir=workspace, tools=[gates.tool()]
        )
        stream = session.run("work", approve=allow_all)
        await gates.started("a")
        assert session.interrupt() is True
        assert session.steer("AFTER CTRL-C") is True
        outputs = await collect(stream)
    assert [e.status for e in of_type(outputs, TaskEnd)] == ["aborted", "completed"]
    # The aborted call's result is carried over before the new task's input (R-ABORT-3).
    assert last_user(provider.requests[1]).content[-1] == TextBlock(text="AFTER CTRL-C")


async def test_steering_given_while_a_task_starts_reaches_its_first_request(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R-STEER-1: a task starting (its prompt being made durable, before its task_start)
    # takes steering: its first input assembly has it. Read then, it was taken for
    # steering of no task and dropped.
    from greenroom.actors.providers.scripted import ScriptedProvider
    from greenroom.actors.runtime.emitter import OutputEmitter

    syncing, may_go_on = trio.Event(), trio.Event()
    sync = OutputEmitter.sync

    async def prompt_sync_waits(self: OutputEmitter) -> None:
        if not syncing.is_set():  # the first: the prompt's
            syncing.set()
            await may_go_on.wait()
        await sync(self)

    monkeypatch.setattr(OutputEmitter, "sync", prompt_sync_waits)
    provider = ScriptedProvider([Reply(blocks=(text("Noted."),))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        with trio.fail_after(RUN_TIMEOUT_S):
            stream = session.run("one", approve=allow_all)
            await syncing.wait()
            assert session.steer("North only")
            await trio.testing.wait_all_tasks_blocked()
            may_go_on.set()
            await collect(stream)
    assert "North only" in str(provider.requests[0].messages)
