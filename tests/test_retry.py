"""Automatic reconnect with the scripted model under a MockClock: the exact backoff
schedule (announced and really slept), the classified statuses, retry-after, auth,
skip_reconnect_wait, interrupt during backoff, the `[turn_retried]` resend and the
overflow boundary (R-RETRY-1..7, R-COMPACT-9)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import (
    RUN_TIMEOUT_S,
    Lookup,
    Recorder,
    Timeline,
    allow_all,
    assert_trace_seq_without_gaps,
    collect,
    last_user,
    model_error,
    of_type,
    open_host,
    port_of,
    texts_of,
    trace_lines,
    types,
)

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.errors import AuthLocked
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.supervisor import ABORT_GRACE_S
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.effects import idempotency_key
from greenroom.protocols.outputs import (
    Abort,
    RequestBegin,
    RequestEnd,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.retry import MAX_RETRIES, should_retry
from greenroom.protocols.tools import ToolContext, make_tool

SCHEDULE_MS = [250, 500, 1000, 2000, 4000]


def timed(replies: list[Reply], arrivals: list[float]) -> list[Callable[[ModelRequest], Reply]]:
    """Script steps that note the (virtual) time each request reaches the provider."""

    def step(reply: Reply) -> Callable[[ModelRequest], Reply]:
        def answer(request: ModelRequest) -> Reply:
            arrivals.append(trio.current_time())
            return reply

        return answer

    return [step(r) for r in replies]


def diffs_ms(times: list[float]) -> list[int]:
    return [round((b - a) * 1000) for a, b in itertools.pairwise(times)]


async def test_backoff_schedule_announced_and_slept_then_failed_with_classified_statuses(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-1, R-RETRY-2, R-RETRY-3: six attempts that all fail (timeout, malformed,
    failed, …). Each request_end carries its own classified status (never relabelled), the
    1-based attempt and retry_in_ms 250/500/1000/2000/4000 (none after the last); the
    attempts really reach the provider that far apart (7.75 s of patience in total), each
    request_begin precedes its attempt by exactly the announced wait, and the task ends
    `failed` after the sixth attempt."""
    kinds = ["timeout", "malformed", "failed", "timeout", "malformed", "failed"]
    arrivals: list[float] = []
    replies = [Reply(fail=model_error(k, f"boom {i + 1}")) for i, k in enumerate(kinds)]
    provider = providers(timed(replies, arrivals))
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    timeline = Timeline(session)
    outputs = await collect(session.run("hello"), bound_s=None)

    ends = of_type(outputs, RequestEnd)
    assert [e.status for e in ends] == kinds
    assert [e.attempt for e in ends] == [1, 2, 3, 4, 5, 6]
    assert [e.retry_in_ms for e in ends] == [*SCHEDULE_MS, None]
    assert [e.error_message for e in ends] == [f"boom {i}" for i in range(1, 7)]
    assert all(e.turn == 1 for e in ends)
    assert [b.attempt for b in of_type(outputs, RequestBegin)] == [1, 2, 3, 4, 5, 6]

    assert len(provider.requests) == 6
    assert diffs_ms(arrivals) == SCHEDULE_MS
    assert arrivals[-1] - arrivals[0] == pytest.approx(7.75)
    # request_begin of attempt n+1 is emitted when attempt n fails; the streamer then
    # sleeps exactly the announced wait before the request goes out.
    begins = timeline.times_of("request_begin")
    fails = timeline.times_of("request_end")
    for n, wait_ms in enumerate(SCHEDULE_MS):
        assert begins[n + 1] == pytest.approx(fails[n])
        assert round((arrivals[n + 1] - begins[n + 1]) * 1000) == wait_ms
        assert round((arrivals[n + 1] - fails[n]) * 1000) == ends[n].retry_in_ms

    (end,) = of_type(outputs, TaskEnd)
    assert end.status == "failed"
    assert end.message == "boom 6"
    assert end.turns == 1
    assert types(outputs)[-1] == "task_end"
    await assert_trace_seq_without_gaps(session)


async def test_a_success_within_the_budget_completes_the_turn(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-2: failures followed by a success stay inside the same turn: one turn, the
    task completes, the successful request_end is `ok` with its attempt number."""
    arrivals: list[float] = []
    replies = [
        Reply(fail=model_error("timeout")),
        Reply(fail=model_error("malformed")),
        Reply(blocks=(text("finally"),)),
    ]
    provider = providers(timed(replies, arrivals))
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("hi"), bound_s=None)

    assert [(e.status, e.attempt, e.retry_in_ms) for e in of_type(outputs, RequestEnd)] == [
        ("timeout", 1, 250),
        ("malformed", 2, 500),
        ("ok", 3, None),
    ]
    assert diffs_ms(arrivals) == [250, 500]
    (end,) = of_type(outputs, TaskEnd)
    assert (end.status, end.turns) == ("completed", 1)
    # Each attempt resends the same original input (nothing partial to report here).
    assert provider.requests[0].messages == provider.requests[2].messages


async def test_retry_after_raises_the_wait_but_never_lowers_it(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-2, R-RETRY-3: a retry-after of 3 s is longer than the planned 250 ms and
    raises the wait to 3000 ms; a retry-after of 0.1 s is shorter than the planned 500 ms
    and leaves it at 500 ms. Announced and slept waits agree."""
    arrivals: list[float] = []
    replies = [
        Reply(fail=model_error("timeout", "429 slow down", status_code=429, retry_after_s=3.0)),
        Reply(fail=model_error("timeout", "429 again", status_code=429, retry_after_s=0.1)),
        Reply(blocks=(text("ok"),)),
    ]
    provider = providers(timed(replies, arrivals))
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("hi"), bound_s=None)

    assert [e.retry_in_ms for e in of_type(outputs, RequestEnd)] == [3000, 500, None]
    assert diffs_ms(arrivals) == [3000, 500]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_auth_is_not_retried_and_locks_the_session_until_retry_auth(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-6: an auth failure is never retried (one request, no retry_in_ms), the task
    ends with status `auth`, queued follow-ups do not run, and the session refuses new
    tasks with AuthLocked until retry_auth() is called."""
    provider = providers(
        [
            Reply(fail=model_error("auth", "401 invalid x-api-key", status_code=401)),
            Reply(blocks=(text("back in business"),)),
        ]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    stream = session.run("hi")
    assert session.follow_up("then this")
    outputs = await collect(stream, bound_s=None)

    assert len(provider.requests) == 1
    (request_end,) = of_type(outputs, RequestEnd)
    assert (request_end.status, request_end.attempt, request_end.retry_in_ms) == ("auth", 1, None)
    assert request_end.error_message == "401 invalid x-api-key"
    ends = of_type(outputs, TaskEnd)
    assert len(ends) == 1  # the follow-up never started
    assert ends[0].status == "auth"
    assert "401" in (ends[0].message or "")
    assert session.auth_locked is not None

    with pytest.raises(AuthLocked, match="retry_auth"):
        session.run("again")
    assert len(provider.requests) == 1

    session.retry_auth()
    outputs = await collect(session.run("again"), bound_s=None)
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert len(provider.requests) == 2


async def test_skip_reconnect_wait_ends_the_backoff_without_changing_the_attempt(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-5: during a 30 s backoff (retry-after), skip_reconnect_wait() makes the next
    attempt start at once: the clock does not advance by the planned wait. The attempt
    number is unchanged: the next attempt is attempt 2 and, failing, announces the second
    step of the schedule (500 ms)."""
    arrivals: list[float] = []
    replies = [
        Reply(fail=model_error("timeout", "overloaded", retry_after_s=30.0)),
        Reply(fail=model_error("timeout", "overloaded again")),
        Reply(blocks=(text("ok"),)),
    ]
    provider = providers(timed(replies, arrivals))
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    assert session.skip_reconnect_wait() is False  # idle: nothing to skip
    recorder = Recorder(session)
    stream = session.run("hi")
    await recorder.wait_for("request_end", attempt=1, bound_s=None)
    await trio.testing.wait_all_tasks_blocked()  # the streamer is asleep in its backoff
    assert len(provider.requests) == 1
    skipped_at = trio.current_time()
    assert session.skip_reconnect_wait() is True
    outputs = await collect(stream, bound_s=None)

    assert arrivals[1] == pytest.approx(skipped_at)
    assert arrivals[1] - arrivals[0] < 30.0
    assert diffs_ms(arrivals)[1] == 500
    ends = of_type(outputs, RequestEnd)
    assert [(e.attempt, e.retry_in_ms) for e in ends] == [(1, 30000), (2, 500), (3, None)]
    assert [b.attempt for b in of_type(outputs, RequestBegin)] == [1, 2, 3]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_skip_reconnect_wait_right_when_the_backoff_is_announced(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-5: a host that asks to skip the wait the moment it sees the request_end that
    announces it (a subscriber calling skip_reconnect_wait(), before the streamer has even
    started sleeping) is not ignored: the next attempt starts at once."""
    arrivals: list[float] = []
    replies = [
        Reply(fail=model_error("timeout", "overloaded", retry_after_s=30.0)),
        Reply(blocks=(text("ok"),)),
    ]
    provider = providers(timed(replies, arrivals))
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    skipped: list[bool] = []

    def on_batch(batch: list) -> None:
        for output in batch:
            if isinstance(output, RequestEnd) and output.retry_in_ms:
                skipped.append(session.skip_reconnect_wait())

    session.subscribe(on_batch)
    outputs = await collect(session.run("hi"), bound_s=None)

    assert skipped == [True]
    assert arrivals[1] == pytest.approx(arrivals[0])
    assert [(e.attempt, e.retry_in_ms) for e in of_type(outputs, RequestEnd)] == [
        (1, 30000),
        (2, None),
    ]


async def test_interrupt_during_backoff_aborts_without_another_request(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-5, R-ABORT-1: an interrupt during the backoff sleep ends the task `aborted`
    (one abort, one task_end, nothing after) and no further request is sent; the run ends
    well before the planned 30 s wait."""
    provider = providers(
        [
            Reply(fail=model_error("timeout", "overloaded", retry_after_s=30.0)),
            Reply(blocks=(text("never sent"),)),
        ]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    recorder = Recorder(session)
    stream = session.run("hi")
    await recorder.wait_for("request_end", attempt=1, bound_s=None)
    await trio.testing.wait_all_tasks_blocked()
    interrupted_at = trio.current_time()
    assert session.interrupt() is True
    outputs = await collect(stream, bound_s=None)

    assert trio.current_time() - interrupted_at <= ABORT_GRACE_S
    assert len(provider.requests) == 1
    assert len(of_type(outputs, Abort)) == 1
    (end,) = of_type(outputs, TaskEnd)
    assert end.status == "aborted"
    assert types(outputs)[-2:] == ["abort", "task_end"]
    assert outputs[-1] is end
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["timeout", "aborted"]
    await trio.testing.wait_all_tasks_blocked()
    assert len(provider.requests) == 1  # the cancelled backoff never resumed
    assert not session.busy


async def test_retry_after_partial_output_resends_turn_retried_and_never_reruns_a_tool(
    host: Host, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-RETRY-4, R-RETRY-7: attempt 1 streams a text and a complete tool call (which is
    approved and RUNS), then fails. The retry resends the turn's original input plus one
    `[turn_retried]…[/turn_retried]` block with the partial text, the call and its result;
    the tool is not run again, and the retried attempt's own call runs once."""
    provider = providers(
        [
            Reply(
                blocks=(
                    text("Let me look."),
                    tool_call("c1", "lookup", key="a"),
                    text("never streamed"),
                ),
                fail=model_error("malformed", "stream cut short"),
                fail_after_blocks=2,
            ),
            Reply(blocks=(text("Now b."), tool_call("c2", "lookup", key="b"))),
            Reply(blocks=(text("Both known."),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("find a", approve=allow_all), bound_s=None)

    assert lookup.calls == ["a", "b"]  # a ran once, in the failed attempt, never again
    assert [(e.status, e.turn, e.attempt) for e in of_type(outputs, RequestEnd)] == [
        ("malformed", 1, 1),
        ("ok", 1, 2),
        ("ok", 2, 1),
    ]
    c1 = [o for o in of_type(outputs, ToolCallOutput) if o.call_id == "c1"]
    assert len(c1) == 1 and c1[0].status == "ok"

    first, retry = provider.requests[0], provider.requests[1]
    assert first.messages == (UserMessage(content=(TextBlock(text="find a"),)),)
    assert retry.messages[:-1] == first.messages[:-1]
    assert last_user(retry).content == (
        TextBlock(text="find a"),
        TextBlock(
            text='[turn_retried]Let me look.\n[tool call lookup {"key": "a"}]\n'
            "[tool result lookup: value-a][/turn_retried]"
        ),
    )
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    await assert_trace_seq_without_gaps(session)


async def test_tool_errors_are_never_retried_by_the_runtime(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-7, R-TOOL-4: a tool that raises runs once; its error becomes an error output
    for the model, the request is not retried (every request_end is `ok`, attempt 1) and
    the task goes on to complete."""
    runs: list[str] = []

    async def flaky(key: str) -> str:
        """Always fails."""
        runs.append(key)
        raise RuntimeError("disk on fire")

    from greenroom.protocols.tools import make_tool

    provider = providers(
        [Reply(blocks=(tool_call("c1", "flaky", key="a"),)), Reply(blocks=(text("I see."),))]
    )
    session = await host.create_session(
        tools=[make_tool(flaky, parallel=True)], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=allow_all), bound_s=None)

    assert runs == ["a"]
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.is_error and "disk on fire" in "".join(
        b.text for b in output.content if isinstance(b, TextBlock)
    )
    assert [(e.status, e.attempt) for e in of_type(outputs, RequestEnd)] == [("ok", 1), ("ok", 1)]
    assert len(provider.requests) == 2
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_empty_failed_attempt_keeps_the_previous_turn_retried_note(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-4: attempt 1 produces a partial text and fails; attempt 2 fails before any
    output; attempt 3 still carries attempt 1's partial output."""
    provider = providers(
        [
            Reply(
                blocks=(text("Half an answer"), text("rest")),
                fail=model_error("timeout"),
                fail_after_blocks=1,
            ),
            Reply(fail=model_error("timeout")),
            Reply(blocks=(text("Whole answer."),)),
        ]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("answer"), bound_s=None)
    note = "[turn_retried]Half an answer[/turn_retried]"
    assert texts_of(last_user(provider.requests[1])) == ["answer", note]
    assert texts_of(last_user(provider.requests[2])) == ["answer", note]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_context_overflow_is_not_retried_but_compacted_once_and_the_turn_rerun(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-1, R-RETRY-2, R-COMPACT-9: `context_overflow` is its own class, not a
    transient failure: its request_end says `context_overflow` with no retry_in_ms (no
    backoff). It triggers one compaction, then the same turn is rerun (attempt 1 again)
    and the task completes in one turn."""
    arrivals: list[float] = []
    replies = [
        Reply(fail=model_error("context_overflow", "prompt is too long")),
        Reply(blocks=(text("[summary]the user sent a huge input[/summary]"),)),
        Reply(blocks=(text("answered after compaction"),)),
    ]
    provider = providers(timed(replies, arrivals))
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("a huge input"), bound_s=None)

    assert len(provider.requests) == 3
    assert diffs_ms(arrivals) == [0, 0]  # no backoff anywhere
    ends = of_type(outputs, RequestEnd)
    assert [(e.status, e.turn, e.attempt, e.retry_in_ms) for e in ends] == [
        ("context_overflow", 1, 1, None),
        ("ok", 1, 1, None),
    ]
    assert [o.reason for o in outputs if o.TYPE == "compaction_begin"] == ["overflow"]
    assert [o.status for o in outputs if o.TYPE == "compaction_end"] == ["ok"]
    task_end = of_type(outputs, TaskEnd)[0]
    assert (task_end.status, task_end.turns) == ("completed", 1)
    rerun = provider.requests[2]
    assert texts_of(rerun.messages[0]) == [
        "[context_summary]the user sent a huge input[/context_summary]"
    ]


async def test_context_overflow_twice_in_a_turn_ends_the_task_failed(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-2, R-COMPACT-9: the overflow compaction happens once per turn; a second
    overflow in the rerun is not retried and ends the task `failed`, its request_end
    still classified `context_overflow` (never relabelled)."""
    provider = providers(
        [
            Reply(fail=model_error("context_overflow", "prompt is too long")),
            Reply(blocks=(text("[summary]short[/summary]"),)),
            Reply(fail=model_error("context_overflow", "still too long")),
            Reply(blocks=(text("not used"),)),
        ]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("a huge input"), bound_s=None)

    assert len(provider.requests) == 3
    assert [(e.status, e.retry_in_ms) for e in of_type(outputs, RequestEnd)] == [
        ("context_overflow", None),
        ("context_overflow", None),
    ]
    assert [o.TYPE for o in outputs].count("compaction_begin") == 1
    task_end = of_type(outputs, TaskEnd)[0]
    assert task_end.status == "failed"
    assert task_end.message == "still too long"
    assert session.auth_locked is None


async def test_a_skip_before_any_wait_is_planned_is_ignored(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-5 ends the *current* backoff: a skip pressed while an attempt is still
    streaming (no wait planned yet) does not shorten the wait announced afterwards."""
    from greenroom.actors.providers.scripted import ScriptedStream

    arrivals: list[float] = []
    streaming = trio.Event()
    may_fail = trio.Event()

    async def first(request: ModelRequest, stream: ScriptedStream) -> None:
        arrivals.append(trio.current_time())
        streaming.set()
        await may_fail.wait()
        await stream.fail(model_error("timeout", "overloaded", retry_after_s=30.0))

    async def second(request: ModelRequest, stream: ScriptedStream) -> None:
        arrivals.append(trio.current_time())
        await stream.text("ok")
        await stream.end()

    provider = providers([first, second])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    run = session.run("hi")
    await streaming.wait()
    assert session.skip_reconnect_wait() is True  # busy: the request is taken...
    await trio.testing.wait_all_tasks_blocked()
    may_fail.set()
    outputs = await collect(run, bound_s=None)
    assert arrivals[1] - arrivals[0] == pytest.approx(30.0)  # ...but had nothing to end
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_a_permanent_failure_ends_the_turn_without_retries(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-2: a `failed` error the provider marks permanent (unknown model, invalid
    request) would fail the same way again: one attempt, no planned wait, the task ends
    `failed` with the provider's message; the next task starts normally."""
    rejected = model_error("failed", "not_found_error: model: nope", permanent=True)
    provider = providers([Reply(fail=rejected), Reply(blocks=(text("fine"),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("hi"), bound_s=None)
    assert [(e.status, e.attempt, e.retry_in_ms) for e in of_type(outputs, RequestEnd)] == [
        ("failed", 1, None)
    ]
    (end,) = of_type(outputs, TaskEnd)
    assert end.status == "failed" and "model: nope" in (end.message or "")
    again = await collect(session.run("again"), bound_s=None)
    assert of_type(again, TaskEnd)[0].status == "completed"
    assert len(provider.requests) == 2


def test_should_retry_never_retries_a_permanent_failure() -> None:
    for kind in ("timeout", "malformed", "failed"):
        assert should_retry(kind, 1) and not should_retry(kind, 1, permanent=True)
    assert not should_retry("failed", MAX_RETRIES + 1)


@pytest.mark.parametrize("retry_id", ["p1", "p2"])
async def test_a_retry_that_repeats_a_call_id_is_a_new_call_after_a_crash(
    host: Host, workspace: Path, tmp_path: Path, providers: Any, retry_id: str
) -> None:
    """R-RETRY-4, R-EFFECT-2: attempt 1's call ``p1`` ran, then its stream failed; the
    retry's model repeats the id (models do) and the host is lost while that new call runs.
    The transcript kept attempt 1's result under ``p1``, so the take-up took the new call
    for done: nothing was put in doubt and the task waited for ever. The retry's call is in
    doubt under its own key and resolved by the check (``p2``, a fresh id, the same)."""
    from test_effects import Payments, of, take_up
    from test_recovery import copy_session

    keys: list[str] = []
    second_started = trio.Event()

    async def pay(amount: int, ctx: ToolContext) -> str:
        """Pay an amount."""
        keys.append(ctx.idempotency_key)
        if len(keys) == 1:
            return f"paid {amount} (first)"
        second_started.set()
        await trio.sleep_forever()  # the host is lost while the retry's call runs
        return "never"

    script = [
        Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7)),
              fail=model_error("timeout", "cut"), fail_after_blocks=2),
        Reply(blocks=(text("Paying."), tool_call(retry_id, "pay", amount=7))),
    ]  # fmt: skip
    session = await host.create_session(
        provider=providers(script), tools=[make_tool(pay, parallel=False)],
        workspace_dir=workspace,
    )  # fmt: skip
    session.run("pay 7", approve=allow_all)
    with trio.fail_after(RUN_TIMEOUT_S):
        await second_started.wait()
    await port_of(session).sync_trace()
    lines = trace_lines(session)
    calls = [line for line in of(lines, "model_msg") if line["block"]["type"] == "tool_call"]
    assert keys[1] == idempotency_key(session.id, calls[1]["seq"], retry_id) != keys[0]
    copy_session(session, tmp_path / "crashed")

    payments = Payments()  # its check finds no payment under the retry's key
    async with open_host(tmp_path / "crashed") as second:
        after = providers([Reply(blocks=(text("Done."),))])
        resumed = await take_up(second, session.id, after, payments.tool, allow_all)
        lines = trace_lines(resumed)
    assert [d["idempotency_key"] for d in of(lines, "call_in_doubt")] == [keys[1]]
    assert payments.asked == [keys[1]] and payments.runs == [keys[1]]
    assert [line["status"] for line in of(lines, "task_end")] == ["completed"]
