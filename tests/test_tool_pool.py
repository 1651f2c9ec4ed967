"""The tool pool through the turn loop: slots, exclusive tools, failures, bad arguments,
truncated calls, progress and the result budget (R-TOOL-1..8)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
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
    result_text,
    results_of,
)

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedStream,
    check_invariants,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.tool_pool import CANCEL_GRACE_S
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, ModelRequest, UserMessage
from greenroom.protocols.markers import INTERRUPTED_TEXT
from greenroom.protocols.outputs import (
    ApprovalDecision,
    RequestEnd,
    TaskEnd,
    ToolCallOutput,
    ToolProgress,
)
from greenroom.protocols.tools import ToolFailure, make_tool, tool


def outputs_by_call(outputs: list) -> dict[str, ToolCallOutput]:
    found: dict[str, ToolCallOutput] = {}
    for output in of_type(outputs, ToolCallOutput):
        assert output.call_id not in found, f"two outputs for {output.call_id}"
        found[output.call_id] = output
    return found


async def test_approval_of_call_1_happens_while_the_model_streams_call_2(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-TOOL-1: a complete call is sent for approval at once: the approve callback sees
    call 1 before the model has produced call 2."""
    asked: list[str] = []
    first_asked = trio.Event()

    def approve(call: ToolCallBlock) -> str:
        asked.append(call.id)
        first_asked.set()
        return "allow"

    async def turn_1(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.tool_call(tool_call("c1", "lookup", key="a"))
        await first_asked.wait()  # the model goes on only once call 1 was asked about
        assert asked == ["c1"]
        await stream.text("And another one.")
        await stream.tool_call(tool_call("c2", "lookup", key="b"))
        await stream.end("tool_use")

    provider = providers([turn_1, Reply(blocks=(text("Done."),))])
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=approve))

    assert asked == ["c1", "c2"]  # sequential, in call order
    decision_1 = index_of(outputs, is_output("approval_decision", call_id="c1"))
    model_2 = index_of(
        outputs, lambda o: o.TYPE == "model_msg" and o.block == tool_call("c2", "lookup", key="b")
    )
    assert decision_1 < model_2
    assert decision_1 < index_of(outputs, is_output("request_end", turn=1))
    assert [d.call_id for d in of_type(outputs, ApprovalDecision)] == ["c1", "c2"]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_at_most_five_calls_run_at_once(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-TOOL-2: 8 parallel-safe calls: exactly 5 run at the same moment; the others
    start one by one as slots free. All 8 results reach the next request in call order."""
    keys = [f"k{i}" for i in range(8)]
    provider = providers(
        [
            Reply(blocks=tuple(tool_call(f"c{i}", "wait", key=k) for i, k in enumerate(keys))),
            Reply(blocks=(text("All eight."),)),
        ]
    )
    session = await host.create_session(
        tools=[gates.tool()], provider=provider, workspace_dir=workspace
    )
    stream = session.run("go", approve=allow_all)

    await gates.started_count(5)
    await trio.testing.wait_all_tasks_blocked()
    assert len(gates.start_order) == 5
    assert gates.running == 5
    released: list[str] = []
    for n in range(6, 9):
        key = gates.start_order[len(released)]
        released.append(key)
        gates.release(key)
        await gates.started_count(n)
        await trio.testing.wait_all_tasks_blocked()
        assert len(gates.start_order) == n  # exactly one freed slot, one new call
        assert gates.running == 5
    assert sorted(gates.start_order) == keys
    for key in keys:
        gates.release(key)
    outputs = await collect(stream)

    assert gates.peak == 5
    assert len(of_type(outputs, ToolCallOutput)) == 8
    results = results_of(last_user(provider.requests[1]))
    assert [r.call_id for r in results] == [f"c{i}" for i in range(8)]
    assert [result_text(r) for r in results] == [f"done {k}" for k in keys]


async def test_exclusive_tool_waits_for_earlier_calls_and_later_calls_wait_for_it(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-TOOL-3: calls p1, p2 (parallel-safe), X (not parallel-safe), p3: X starts only
    when p1 and p2 are terminal, and p3 only when X is."""
    provider = providers(
        [
            Reply(
                blocks=(
                    tool_call("p1", "wait", key="a"),
                    tool_call("p2", "wait", key="b"),
                    tool_call("x", "solo", key="x"),
                    tool_call("p3", "wait", key="c"),
                )
            ),
            Reply(blocks=(text("Done."),)),
        ]
    )
    session = await host.create_session(
        tools=[gates.tool("wait"), gates.tool("solo", parallel=False)],
        provider=provider,
        workspace_dir=workspace,
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)

    await gates.started("a")
    await gates.started("b")
    await trio.testing.wait_all_tasks_blocked()
    assert not gates.is_started("x")
    assert not gates.is_started("c")  # later parallel-safe call waits for X too

    gates.release("b")
    await recorder.wait_for("tool_call_output", call_id="p2")
    await trio.testing.wait_all_tasks_blocked()
    assert not gates.is_started("x")  # p1 still running

    gates.release("a")
    await gates.started("x")
    await trio.testing.wait_all_tasks_blocked()
    assert not gates.is_started("c")
    assert gates.running == 1

    gates.release("x")
    await gates.started("c")
    gates.release("c")
    outputs = await collect(stream)

    assert gates.start_order[2:] == ["x", "c"]
    assert gates.peak == 2
    assert [o.call_id for o in of_type(outputs, ToolCallOutput)] == ["p2", "p1", "x", "p3"]
    results = results_of(last_user(provider.requests[1]))
    assert [r.call_id for r in results] == ["p1", "p2", "x", "p3"]


async def test_tool_exception_becomes_an_error_output_and_the_task_goes_on(
    host: Host, workspace: Path, providers
) -> None:
    """R-TOOL-4: a raising tool gives tool_call_output is_error with the error text; it is
    not retried; the model sees it and the task completes."""
    attempts: list[str] = []

    @tool(parallel=True)
    async def boom(key: str) -> str:
        """Fail."""
        attempts.append(key)
        raise ValueError(f"kaput {key}")

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "boom", key="a"),)),
            Reply(blocks=(text("It failed; giving up."),)),
        ]
    )
    session = await host.create_session(tools=[boom], provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("go", approve=allow_all))

    (output,) = of_type(outputs, ToolCallOutput)
    assert output.status == "error"
    assert output.is_error is True
    assert output.content == (TextBlock(text="ValueError: kaput a"),)
    assert attempts == ["a"]
    (result,) = results_of(last_user(provider.requests[1]))
    assert result.is_error and result.status == "error"
    assert result_text(result) == "ValueError: kaput a"
    end = of_type(outputs, TaskEnd)[0]
    assert end.status == "completed"
    assert end.turns == 2


async def test_tool_timeout_becomes_an_error_output(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-TOOL-4: a call that runs longer than the tool's timeout_s is cancelled and answered
    with an error output (MockClock: 30 virtual seconds, no real wait)."""

    @tool(parallel=True, timeout_s=30)
    async def slow(key: str) -> str:
        """Never finishes."""
        await trio.sleep_forever()
        return key  # pragma: no cover

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "slow", key="a"),)),
            Reply(blocks=(text("Too slow."),)),
        ]
    )
    session = await host.create_session(tools=[slow], provider=provider, workspace_dir=workspace)
    started = trio.current_time()
    outputs = await collect(session.run("go", approve=allow_all), bound_s=None)

    (output,) = of_type(outputs, ToolCallOutput)
    assert output.status == "error" and output.is_error
    assert output.content == (TextBlock(text="slow timed out after 30 s"),)
    assert trio.current_time() - started >= 30
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_bad_arguments_and_unknown_tools_give_errors_without_running(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-TOOL-5: arguments that are not JSON, arguments that fail the schema, and a tool
    that does not exist each get an error output; nothing runs; the valid call beside
    them runs; the task completes."""
    provider = providers(
        [
            Reply(
                blocks=(
                    ToolCallBlock(
                        id="c1", name="lookup", arguments={}, invalid_arguments='{"key": "a'
                    ),
                    tool_call("c2", "lookup", key=5),
                    tool_call("c3", "lookup", key="b", extra=True),
                    tool_call("c4", "no_such_tool", key="c"),
                    tool_call("c5", "lookup", key="ok"),
                )
            ),
            Reply(blocks=(text("Fixed."),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=allow_all))

    assert lookup.calls == ["ok"]
    found = outputs_by_call(outputs)
    assert set(found) == {"c1", "c2", "c3", "c4", "c5"}
    for call_id in ("c1", "c2", "c3", "c4"):
        assert found[call_id].status == "error"
        assert found[call_id].is_error
    assert "Invalid arguments for lookup" in result_text(found["c1"])
    assert '{"key": "a' in result_text(found["c1"])
    assert "$.key: expected string, got integer" in result_text(found["c2"])
    assert "$.extra: unexpected property" in result_text(found["c3"])
    assert "Unknown tool 'no_such_tool'" in result_text(found["c4"])
    assert "lookup" in result_text(found["c4"])  # names the tools that exist
    assert found["c5"].status == "ok"
    results = results_of(last_user(provider.requests[1]))
    assert [r.call_id for r in results] == ["c1", "c2", "c3", "c4", "c5"]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_truncated_call_is_not_executed_but_stays_paired(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-TOOL-5, R-TOOL-7: a call cut by max_tokens never runs; it gets a tool_call_output
    with status truncated, and the next request pairs it with that error result."""
    provider = providers(
        [
            Reply(
                blocks=(
                    text("Writing a big call."),
                    tool_call("c1", "lookup", key="a"),
                    tool_call("c2", "lookup", key="x" * 200),
                ),
                truncate_last_tool_call=True,
            ),
            Reply(blocks=(text("I will split it."),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=allow_all))

    assert lookup.calls == ["a"]
    found = outputs_by_call(outputs)
    assert found["c2"].status == "truncated"
    assert found["c2"].is_error
    assert "truncated" in result_text(found["c2"])
    assert found["c1"].status == "ok"
    # a truncated call is never sent for approval
    assert [d.call_id for d in of_type(outputs, ApprovalDecision)] == ["c1"]
    assert of_type(outputs, RequestEnd)[0].stop_reason == "max_tokens"
    assistant = provider.requests[1].messages[-2]
    assert isinstance(assistant, AssistantMessage)
    assert [b.id for b in assistant.content if isinstance(b, ToolCallBlock)] == ["c1", "c2"]
    results = results_of(last_user(provider.requests[1]))
    assert [(r.call_id, r.status) for r in results] == [("c1", "ok"), ("c2", "truncated")]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


def result_text_of(output: ToolCallOutput) -> str:
    return "".join(b.text for b in output.content if isinstance(b, TextBlock))


async def test_progress_is_shown_while_running_and_dropped_after_the_call_ended(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-TOOL-6: ctx.report_progress gives tool_progress outputs while the call runs; a
    note sent by a call that has already finished is dropped."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "wait", key="a"), tool_call("c2", "wait", key="b"))),
            Reply(blocks=(text("Done."),)),
        ]
    )
    session = await host.create_session(
        tools=[gates.tool(progress=True)], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)

    await recorder.wait_for("tool_progress", call_id="c1")
    await recorder.wait_for("tool_progress", call_id="c2")
    gates.release("a")
    await recorder.wait_for("tool_call_output", call_id="c1")
    gates.report["a"]("a is late")  # c1 is terminal: dropped
    gates.report["b"]("b still going")  # c2 is running: shown, and proves a is handled
    await recorder.wait_for("tool_progress", message="b still going")
    gates.release("b")
    outputs = await collect(stream)

    notes = [(o.call_id, o.message) for o in of_type(outputs, ToolProgress)]
    # the two calls start in either order; the late note of c1 is nowhere
    assert sorted(notes[:2]) == [("c1", "a halfway"), ("c2", "b halfway")]
    assert notes[2:] == [("c2", "b still going")]
    first = index_of(outputs, is_output("tool_progress", call_id="c1"))
    assert first < index_of(outputs, is_output("tool_call_output", call_id="c1"))
    assert all(o.seq is None for o in of_type(outputs, ToolProgress))  # live only
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_large_output_is_cut_to_head_and_tail_with_a_scratchpad_file(
    host: Host, workspace: Path, providers
) -> None:
    """R-TOOL-8: a 100 KB result is cut in the model context to head + tail around a
    marker naming a scratchpad file; the file holds the whole output."""
    big = "HEAD-" + "".join(f"line {i:06d}\n" for i in range(9000)) + "-TAIL"
    assert len(big) > 100_000

    async def dump() -> str:
        """Print a lot."""
        return big

    provider = providers([Reply(blocks=(tool_call("c1", "dump"),)), Reply(blocks=(text("Long."),))])
    session = await host.create_session(
        tools=[make_tool(dump, parallel=True)], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=allow_all))

    (output,) = of_type(outputs, ToolCallOutput)
    assert output.status == "ok"
    shown = result_text_of(output)
    budget = session.settings.tool_result_budget
    assert budget == 32 * 1024
    assert len(shown.encode()) < budget + 1024
    assert shown.startswith("HEAD-line 000000")
    assert shown.endswith("line 008999\n-TAIL")
    files = list(session.scratchpad_dir.iterdir())
    assert len(files) == 1
    assert str(files[0]) in shown
    assert files[0].read_text(encoding="utf-8") == big
    (result,) = results_of(last_user(provider.requests[1]))
    assert result_text(result) == shown


async def test_a_large_error_is_cut_to_the_budget_like_a_result(
    host: Host, workspace: Path, providers
) -> None:
    """R-TOOL-8, R-SEC-9: a failure's message is a result the model gets too (an MCP
    server's ``isError`` text, a tool's exception): 100 KB of it is cut to head and tail
    around the marker naming the scratchpad file, which holds all of it (before: whole,
    past the budget and, in a cluster, past what one record of the trace carries)."""
    big = "HEAD-" + "".join(f"error {i:06d}\n" for i in range(9000)) + "-TAIL"

    async def fail() -> str:
        """Fail at length."""
        raise ToolFailure(big)

    provider = providers([Reply(blocks=(tool_call("c1", "fail"),)), Reply(blocks=(text("No."),))])
    session = await host.create_session(
        tools=[make_tool(fail, parallel=True)], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=allow_all))

    (output,) = of_type(outputs, ToolCallOutput)
    assert (output.status, output.is_error) == ("error", True)
    shown = result_text_of(output)
    assert len(shown.encode()) < session.settings.tool_result_budget + 1024
    assert shown.startswith("HEAD-error 000000") and shown.endswith("error 008999\n-TAIL")
    (file,) = session.scratchpad_dir.iterdir()
    assert str(file) in shown
    assert file.read_text(encoding="utf-8") == big
    assert of_type(outputs, TaskEnd)[-1].status == "completed"


async def test_every_call_is_paired_on_every_path(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-TOOL-7: one message whose calls take the ok, deny, error, bad-argument and
    truncation paths: every request the model gets pairs each call with exactly one
    result, in call order (the scripted provider checks; here explicitly as well)."""

    @tool(parallel=True)
    async def boom() -> str:
        """Fail."""
        raise OSError("disk on fire")

    def approve(call: ToolCallBlock) -> str:
        return "deny" if call.id == "c2" else "allow"

    provider = providers(
        [
            Reply(
                blocks=(
                    tool_call("c1", "lookup", key="a"),
                    tool_call("c2", "lookup", key="b"),
                    tool_call("c3", "boom"),
                    tool_call("c4", "lookup"),
                    tool_call("c5", "lookup", key="e" * 100),
                ),
                truncate_last_tool_call=True,
            ),
            Reply(blocks=(text("Mixed results."),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool, boom], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=approve))

    statuses = {o.call_id: o.status for o in of_type(outputs, ToolCallOutput)}
    assert statuses == {
        "c1": "ok",
        "c2": "denied",
        "c3": "error",
        "c4": "error",
        "c5": "truncated",
    }
    assert len(of_type(outputs, ToolCallOutput)) == 5
    assert provider.violations == []
    assert check_invariants(provider.requests[1]) == []
    results = results_of(last_user(provider.requests[1]))
    assert [r.call_id for r in results] == ["c1", "c2", "c3", "c4", "c5"]
    # The guard has teeth: the same request with one result missing is a violation.
    request = provider.requests[1]
    broken = UserMessage(content=tuple(results[1:]))
    assert check_invariants(attrs.evolve(request, messages=(*request.messages[:-1], broken)))
    assert of_type(outputs, TaskEnd)[0].status == "completed"


@contextlib.contextmanager
def hang_guard(*releases: Callable[[], None]) -> Iterator[None]:
    """Run ``releases`` in the run loop after RUN_TIMEOUT_S of real time, so a regression
    fails the test instead of hanging the suite (a deadline would not do on an autojump
    clock: it fires as soon as the loop idles)."""
    token = trio.lowlevel.current_trio_token()

    def release_all() -> None:
        for release in releases:
            release()

    guard = threading.Timer(RUN_TIMEOUT_S, token.run_sync_soon, (release_all,))
    guard.start()
    try:
        yield
    finally:
        guard.cancel()


async def test_interrupt_abandons_tools_that_ignore_cancellation(
    host: Host, workspace: Path, providers, autojump_clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-2, R-ABORT-1: a shielded tool and a tool blocked in a thread that cannot be
    abandoned do not hold the interrupt. The pool waits CANCEL_GRACE_S, then abandons
    them: the abort is recorded at once, task_end(aborted) arrives, both calls are
    interrupted and paired, and their late endings report nothing."""
    traced_at: dict[str, float] = {}
    trace = SessionPort.append

    def timed_trace(self: SessionPort, output: Any) -> int:
        traced_at.setdefault(output.TYPE, trio.current_time())
        return trace(self, output)

    monkeypatch.setattr(SessionPort, "append", timed_trace)
    release_thread = threading.Event()
    release_shield = trio.Event()
    running: dict[str, trio.Event] = {"thread": trio.Event(), "shield": trio.Event()}
    ended: dict[str, trio.Event] = {"thread": trio.Event(), "shield": trio.Event()}

    @tool(parallel=True)
    async def in_thread() -> str:
        """Blocks in a worker thread that ignores cancellation."""
        running["thread"].set()
        try:
            await trio.to_thread.run_sync(release_thread.wait, abandon_on_cancel=False)
            return "thread done"
        finally:
            ended["thread"].set()

    @tool(parallel=True)
    async def shielded() -> str:
        """Waits under a shield."""
        try:
            with trio.CancelScope(shield=True):
                running["shield"].set()
                await release_shield.wait()
            return "shield done"
        finally:
            ended["shield"].set()

    provider = providers(
        [
            Reply(blocks=(tool_call("t1", "in_thread"), tool_call("s1", "shielded"))),
            Reply(blocks=(text("Carried on."),)),
        ]
    )
    session = await host.create_session(
        tools=[in_thread, shielded], provider=provider, workspace_dir=workspace
    )
    recorder = Recorder(session)
    try:
        stream = session.run("go", approve=allow_all)
        await running["thread"].wait()
        await running["shield"].wait()
        interrupted_at = trio.current_time()
        assert session.interrupt("stop")
        # Virtual time: only the grace passes between the interrupt and the abort record
        # (the clock then jumps through the trace sink's waits, which is no real time).
        with hang_guard(release_thread.set, release_shield.set):
            outputs = await collect(stream, bound_s=None)
        (end,) = of_type(outputs, TaskEnd)
        assert end.status == "aborted"
        assert traced_at["abort"] - interrupted_at == pytest.approx(CANCEL_GRACE_S)
        assert CANCEL_GRACE_S < 0.1
        by_call = outputs_by_call(outputs)
        assert set(by_call) == {"t1", "s1"}
        for output in by_call.values():
            assert output.status == "interrupted"
            assert output.content == (TextBlock(text=INTERRUPTED_TEXT),)
        assert not ended["thread"].is_set() and not ended["shield"].is_set()
    finally:
        release_thread.set()
        release_shield.set()
    await ended["thread"].wait()
    await ended["shield"].wait()
    # The abandoned calls ended later: nothing more was emitted for them.
    assert len(of_type(recorder.outputs, ToolCallOutput)) == 2

    again = await collect(session.run("carry on", approve=allow_all), bound_s=None)
    assert of_type(again, TaskEnd)[0].status == "completed"


async def test_timeout_abandons_a_tool_that_ignores_cancellation(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-TOOL-4: a tool past its timeout that ignores the cancellation is abandoned after
    the grace and answered as timed out; the task goes on."""
    release = trio.Event()

    @tool(parallel=True, timeout_s=5)
    async def stubborn() -> str:
        """Ignores cancellation."""
        with trio.CancelScope(shield=True):
            await release.wait()
        return "late"

    provider = providers(
        [Reply(blocks=(tool_call("c1", "stubborn"),)), Reply(blocks=(text("Moving on."),))]
    )
    session = await host.create_session(
        tools=[stubborn], provider=provider, workspace_dir=workspace
    )
    started = trio.current_time()
    try:
        with hang_guard(release.set):
            outputs = await collect(session.run("go", approve=allow_all), bound_s=None)
    finally:
        release.set()
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.content == (TextBlock(text="stubborn timed out after 5 s"),)
    assert trio.current_time() - started >= 5
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_a_tool_that_exits_the_interpreter_is_an_error_output(
    host: Host, workspace: Path, providers
) -> None:
    """R-SEC-1: SystemExit raised by a tool is the call's error, not the host's end."""

    @tool(parallel=True)
    async def quitter() -> str:
        """Calls sys.exit."""
        raise SystemExit(3)

    provider = providers(
        [Reply(blocks=(tool_call("c1", "quitter"),)), Reply(blocks=(text("Still here."),))]
    )
    session = await host.create_session(
        tools=[quitter], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=allow_all))
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.is_error and output.content == (TextBlock(text="SystemExit: 3"),)
    assert of_type(outputs, TaskEnd)[0].status == "completed"
