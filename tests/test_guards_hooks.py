"""Guards and hooks: max_turns across a tool loop (R-RUN-6), repeated identical calls and
no-progress turns (R-GUARD-1), and the hooks before_request / after_tool_results /
on_stop (R-HOOK-1)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import trio
from conftest import (
    Lookup,
    Recorder,
    allow_all,
    collect,
    last_user,
    model_error,
    of_type,
    result_text,
    results_of,
    texts_of,
)

from greenroom.actors.providers.scripted import Reply, ScriptedStream, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolSchema
from greenroom.protocols.hooks import Hooks, RequestInfo, StopInfo, ToolResultsInfo
from greenroom.protocols.outputs import RequestEnd, TaskEnd, ToolCallOutput, UserMsg
from greenroom.protocols.tools import make_tool


def calls_forever(key_of_turn) -> object:
    """A script function: every request answers with one lookup call whose key depends on
    how many requests came before (turn n: ``key_of_turn(n)``)."""
    count = [0]

    def step(request: ModelRequest) -> Reply:
        count[0] += 1
        n = count[0]
        return Reply(blocks=(tool_call(f"c{n}", "lookup", key=key_of_turn(n)),))

    return step


# -- R-RUN-6 max_turns ------------------------------------------------------------------------


async def test_max_turns_stops_a_tool_loop_and_the_last_turns_calls_stay_paired(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-RUN-6: max_turns=3 and a model that always calls a tool: exactly 3 requests, the
    task ends `max_turns` (not completed) with a message naming the limit, turns=3; the
    third turn's call ran and its result reaches the next task's first request."""
    provider = providers(calls_forever(lambda n: f"k{n}"))
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace, max_turns=3
    )
    outputs = await collect(session.run("loop", approve=allow_all))

    assert len(provider.requests) == 3
    assert lookup.calls == ["k1", "k2", "k3"]
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("max_turns", 3)
    assert end.message is not None and "max_turns=3" in end.message
    assert outputs[-1] is end

    await collect(session.run("next", approve=allow_all))
    carried = last_user(provider.requests[3])
    assert [(r.call_id, result_text(r)) for r in results_of(carried)] == [("c3", "value-k3")]
    assert texts_of(carried) == ["next"]


async def test_a_task_that_finishes_within_max_turns_is_completed(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-RUN-6: reaching the final answer on the last allowed turn is `completed`."""
    provider = providers(
        [Reply(blocks=(tool_call("c1", "lookup", key="a"),)), Reply(blocks=(text("done"),))]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace, max_turns=2
    )
    outputs = await collect(session.run("go", approve=allow_all))
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("completed", 2)


# -- R-GUARD-1 loop guards -------------------------------------------------------------------


async def test_the_same_call_in_three_turns_in_a_row_is_a_loop(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-GUARD-1: the same tool with the same arguments in loop_repeat_threshold (default 3)
    consecutive turns ends the task `loop_detected` with a message naming the call; the
    calls did run (the guard judges finished turns)."""
    provider = providers(calls_forever(lambda n: "same"))
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    assert session.settings.loop_repeat_threshold == 3
    outputs = await collect(session.run("loop", approve=allow_all))

    assert len(provider.requests) == 3
    assert lookup.calls == ["same"] * 3
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("loop_detected", 3)
    assert end.message is not None
    assert 'lookup {"key": "same"}' in end.message
    assert "3 turns in a row" in end.message


async def test_a_different_argument_resets_the_repeat_streak(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-GUARD-1: a a b a a — never three identical calls in consecutive turns — is not a
    loop; the model then answers and the task completes."""
    keys = ["a", "a", "b", "a", "a"]
    script = [Reply(blocks=(tool_call(f"c{i}", "lookup", key=k),)) for i, k in enumerate(keys)]
    provider = providers([*script, Reply(blocks=(text("done"),))])
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=allow_all))
    assert lookup.calls == keys
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("completed", 6)


async def test_turns_where_every_call_fails_or_is_denied_are_no_progress(
    host: Host, workspace: Path, providers
) -> None:
    """R-GUARD-1: with loop_no_progress_threshold=2, two turns in a row in which every call
    ended in an error (one failing tool, then one denied call; different arguments, so it
    is not the repeat guard) end the task `loop_detected` naming the lack of progress."""
    runs: list[str] = []

    async def broken(key: str) -> str:
        """Always fails."""
        runs.append(key)
        raise RuntimeError("nope")

    def approve(call) -> str:
        return "deny" if call.arguments.get("key") == "denied" else "allow"

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "broken", key="x"),)),
            Reply(blocks=(tool_call("c2", "broken", key="denied"),)),
            Reply(blocks=(text("never"),)),
        ]
    )
    session = await host.create_session(
        tools=[make_tool(broken, parallel=True)],
        provider=provider,
        workspace_dir=workspace,
        loop_no_progress_threshold=2,
    )
    outputs = await collect(session.run("go", approve=approve))

    assert runs == ["x"]
    assert [o.status for o in of_type(outputs, ToolCallOutput)] == ["error", "denied"]
    assert len(provider.requests) == 2
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("loop_detected", 2)
    assert end.message is not None and "no progress" in end.message


async def test_a_successful_call_resets_the_no_progress_count(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-GUARD-1: denied, success, denied, then an answer: never two unproductive turns in a
    row (threshold 2), so the task completes."""

    def approve(call) -> str:
        return "allow" if call.arguments.get("key") == "ok" else "deny"

    keys = ["d1", "ok", "d2"]
    script = [Reply(blocks=(tool_call(f"c{i}", "lookup", key=k),)) for i, k in enumerate(keys)]
    provider = providers([*script, Reply(blocks=(text("done"),))])
    session = await host.create_session(
        tools=[lookup.tool],
        provider=provider,
        workspace_dir=workspace,
        loop_no_progress_threshold=2,
    )
    outputs = await collect(session.run("go", approve=approve))
    assert lookup.calls == ["ok"]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_thresholds_of_zero_or_less_disable_the_guards(
    host: Host, workspace: Path, providers
) -> None:
    """R-GUARD-1: loop_repeat_threshold=0 and loop_no_progress_threshold=-1: six identical,
    denied calls in a row do not stop the task; the model's answer completes it."""
    script = [Reply(blocks=(tool_call(f"c{i}", "lookup", key="same"),)) for i in range(6)]
    provider = providers([*script, Reply(blocks=(text("giving up"),))])
    lookup = Lookup()
    session = await host.create_session(
        tools=[lookup.tool],
        provider=provider,
        workspace_dir=workspace,
        loop_repeat_threshold=0,
        loop_no_progress_threshold=-1,
    )
    outputs = await collect(session.run("go"))  # no approve: every call denied
    assert [o.status for o in of_type(outputs, ToolCallOutput)] == ["denied"] * 6
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("completed", 7)


# -- R-HOOK-1 hooks --------------------------------------------------------------------------


async def test_before_request_is_called_once_per_attempt_with_the_request(
    host: Host, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-HOOK-1: before_request sees every attempt (turn 1 attempt 1 fails, attempt 2
    succeeds with a call, turn 2 answers): (1,1), (1,2), (2,1), each with exactly the
    request the provider then received. An async hook works."""
    seen: list[RequestInfo] = []

    async def before(info: RequestInfo) -> None:
        await trio.lowlevel.checkpoint()
        seen.append(info)

    provider = providers(
        [
            Reply(fail=model_error("timeout")),
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(text("done"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool],
        provider=provider,
        workspace_dir=workspace,
        hooks=Hooks(before_request=before),
    )
    outputs = await collect(session.run("go", approve=allow_all), bound_s=None)

    assert [(i.turn, i.attempt) for i in seen] == [(1, 1), (1, 2), (2, 1)]
    assert [i.request for i in seen] == provider.requests
    run_id = of_type(outputs, TaskEnd)[0].run_id
    assert all(i.run_id == run_id and i.session_id == session.id for i in seen)
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_after_tool_results_gets_the_results_in_call_order_once_per_tool_turn(
    host: Host, workspace: Path, providers
) -> None:
    """R-HOOK-1: after_tool_results is called once per turn that had tool calls (not for
    the final answer), when every call is terminal, with the results in CALL order even
    though c2 finished first."""
    release_slow = trio.Event()
    infos: list[ToolResultsInfo] = []

    async def work(key: str) -> str:
        """Slow for 'slow'."""
        if key == "slow":
            await release_slow.wait()
        return f"did {key}"

    def after(info: ToolResultsInfo) -> None:
        infos.append(info)

    async def turn_1(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.tool_call(tool_call("c1", "work", key="slow"))
        await stream.tool_call(tool_call("c2", "work", key="fast"))
        await stream.end("tool_use")

    provider = providers([turn_1, Reply(blocks=(text("done"),))])
    session = await host.create_session(
        tools=[make_tool(work, parallel=True)],
        provider=provider,
        workspace_dir=workspace,
        hooks=Hooks(after_tool_results=after),
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await recorder.wait_for("tool_call_output", call_id="c2")
    assert infos == []  # not before every call is terminal
    release_slow.set()
    outputs = await collect(stream)

    assert [o.call_id for o in of_type(outputs, ToolCallOutput)] == ["c2", "c1"]
    assert len(infos) == 1
    assert infos[0].turn == 1
    assert [(r.call_id, result_text(r)) for r in infos[0].results] == [
        ("c1", "did slow"),
        ("c2", "did fast"),
    ]


async def test_on_stop_text_continues_the_task_once_as_steering(
    host: Host, workspace: Path, providers
) -> None:
    """R-HOOK-1, R-STEER-4: on_stop returning a text makes the task go on: the text is
    emitted and traced as user_msg(kind=steering) and the next request ends with it as
    `[user_steering]…[/user_steering]`. With the default max_stop_continuations=1 the hook
    is not asked again and the second answer completes the task."""
    stops: list[StopInfo] = []

    def on_stop(info: StopInfo) -> str:
        stops.append(info)
        return "Also check the tests."

    provider = providers([Reply(blocks=(text("First answer."),)), Reply(blocks=(text("Ok."),))])
    session = await host.create_session(
        provider=provider, workspace_dir=workspace, hooks=Hooks(on_stop=on_stop)
    )
    outputs = await collect(session.run("go"))

    assert len(stops) == 1
    assert stops[0].final_message == (TextBlock(text="First answer."),)
    assert stops[0].continuations == 0
    steering = [o for o in of_type(outputs, UserMsg) if o.kind == "steering"]
    assert len(steering) == 1
    assert steering[0].content == (TextBlock(text="Also check the tests."),)
    assert steering[0].seq is not None  # traced
    assert texts_of(last_user(provider.requests[1])) == [
        "[user_steering]Also check the tests.[/user_steering]"
    ]
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("completed", 2)


async def test_on_stop_continues_at_most_max_stop_continuations_times(
    host: Host, workspace: Path, providers
) -> None:
    """R-HOOK-1: an (async) on_stop that always asks for more gets at most
    max_stop_continuations=2 extra turns; then the task completes."""
    stops: list[int] = []

    async def on_stop(info: StopInfo) -> str:
        stops.append(info.continuations)
        return "more"

    provider = providers(lambda request: Reply(blocks=(text("answer"),)))
    session = await host.create_session(
        provider=provider,
        workspace_dir=workspace,
        hooks=Hooks(on_stop=on_stop, max_stop_continuations=2),
    )
    outputs = await collect(session.run("go"))
    assert stops == [0, 1]
    assert len(provider.requests) == 3
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("completed", 3)


async def test_on_stop_returning_nothing_or_blank_ends_the_task(
    host: Host, workspace: Path, providers
) -> None:
    """R-HOOK-1, R-RUN-5: None or a blank text is not a request to continue."""
    for answer in (None, "   "):
        provider = providers([Reply(blocks=(text("done"),))])
        session = await host.create_session(
            provider=provider, workspace_dir=workspace, hooks=Hooks(on_stop=lambda i, a=answer: a)
        )
        outputs = await collect(session.run("go"))
        assert len(provider.requests) == 1
        assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_raising_hooks_never_end_the_task(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-HOOK-1: every hook raises (sync and async); the task runs its tool turn and
    completes as if there were no hooks."""
    called: list[str] = []

    def before(info: RequestInfo) -> None:
        called.append("before")
        raise RuntimeError("before broke")

    async def after(info: ToolResultsInfo) -> None:
        called.append("after")
        raise ValueError("after broke")

    def on_stop(info: StopInfo) -> str:
        called.append("stop")
        raise KeyError("stop broke")

    provider = providers(
        [Reply(blocks=(tool_call("c1", "lookup", key="a"),)), Reply(blocks=(text("done"),))]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    session.hooks = Hooks(before_request=before, after_tool_results=after, on_stop=on_stop)
    outputs = await collect(session.run("go", approve=allow_all))

    assert called == ["before", "after", "before", "stop"]
    assert lookup.calls == ["a"]
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["ok", "ok"]
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns, end.message) == ("completed", 2, None)


async def test_hooks_cannot_widen_tools(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-HOOK-1: a hook gets frozen values: trying to add a tool to the request it sees
    fails (FrozenInstanceError, swallowed like any hook error), and every request carries
    exactly the session's tools."""
    attempts: list[str] = []
    extra = ToolSchema(name="rm_rf", description="delete everything", input_schema={})

    def widen(info: RequestInfo) -> None:
        try:
            info.request.tools = (*info.request.tools, extra)  # type: ignore[misc]
        except attrs.exceptions.FrozenInstanceError:
            attempts.append("request frozen")
        try:
            info.turn = 99  # type: ignore[misc]
        except attrs.exceptions.FrozenInstanceError:
            attempts.append("info frozen")
        raise PermissionError("tried to widen")

    provider = providers(
        [Reply(blocks=(tool_call("c1", "lookup", key="a"),)), Reply(blocks=(text("done"),))]
    )
    session = await host.create_session(
        tools=[lookup.tool],
        provider=provider,
        workspace_dir=workspace,
        hooks=Hooks(before_request=widen),
    )
    outputs = await collect(session.run("go", approve=allow_all))

    assert attempts == ["request frozen", "info frozen"] * 2
    assert all(r.tools == (lookup.tool.schema,) for r in provider.requests)
    assert [t.name for t in session.tools] == ["lookup"]
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        session.hooks.max_stop_continuations = 5  # type: ignore[misc]
