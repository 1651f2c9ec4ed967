"""Context compaction with the scripted model (R-COMPACT-1..11, R-STEER-5, R-RETRY-5).

Every test runs a real host (real trace files, real ledger). Retry timing is checked under
an autojump ``MockClock`` (``bound_s=None`` there, see ``conftest.collect``). Each trace
file is checked to be exactly one model context: rebuilt from that file alone it gives the
context that was summarized (older files) or the live context (the current file).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from conftest import (
    Gates,
    Lookup,
    Recorder,
    allow_all,
    collect,
    index_of,
    is_output,
    ledger_rows,
    model_error,
    of_type,
    open_host,
    port_of,
    texts_of,
    types,
)
from test_recovery import blocking_tool, copy_session

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.errors import Busy
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols import compaction, markers
from greenroom.protocols.compaction import CORRECTION_NOTE, STRAY_CALL_TEXT, summary_message
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import (
    AssistantMessage,
    Message,
    ModelRequest,
    ToolResult,
    UserMessage,
)
from greenroom.protocols.outputs import (
    Abort,
    CompactionBegin,
    CompactionEnd,
    Output,
    RequestBegin,
    RequestEnd,
    TaskEnd,
    TokenUsageOutput,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.settings import DEFAULT_COMPACT_PROMPT
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import encode_record, parse_trace, trace_file_name
from greenroom.protocols.transcript import DISCARDED_TEXT, rebuild

LIMIT = 1000
BIG = TokenUsage(input=900, output=200)  # total 1100 >= LIMIT
SMALL = TokenUsage(input=10, output=5)
SCHEDULE_MS = [250, 500, 1000, 2000, 4000]


# -- helpers ---------------------------------------------------------------------------------


def prompt_msg() -> UserMessage:
    return compaction.prompt_message(DEFAULT_COMPACT_PROMPT)


def is_summary_request(request: ModelRequest) -> bool:
    """A compaction request ends with the compaction prompt (plain or with the note)."""
    last = request.messages[-1] if request.messages else None
    return isinstance(last, UserMessage) and any(
        isinstance(p, TextBlock) and p.text.endswith(DEFAULT_COMPACT_PROMPT) for p in last.content
    )


def base_of(messages: Sequence[Message]) -> tuple[Message, ...]:
    """What a compaction request summarizes: everything before the (first) plain prompt."""
    index = list(messages).index(prompt_msg())
    return tuple(messages[:index])


def summary_step(
    summary: str, seen: list[ModelRequest] | None = None
) -> Callable[[ModelRequest], Reply]:
    def answer(request: ModelRequest) -> Reply:
        assert is_summary_request(request), request.messages[-1]
        if seen is not None:
            seen.append(request)
        return Reply(blocks=(text(f"Here it is.\n[summary]{summary}[/summary]"),))

    return answer


def held_summary() -> tuple[trio.Event, trio.Event, Any]:
    """``(entered, release, step)``: a summary step that sets ``entered`` and answers once
    ``release`` is set."""
    entered, release = trio.Event(), trio.Event()

    async def step(request: ModelRequest, stream: ScriptedStream) -> None:
        entered.set()
        await release.wait()
        await stream.text("[summary]held[/summary]")

    return entered, release, step


def timed(step: Reply | Callable[[ModelRequest], Reply], arrivals: list[float]) -> Any:
    def answer(request: ModelRequest) -> Reply:
        arrivals.append(trio.current_time())
        return step(request) if callable(step) else step

    return answer


def trace_files(session: Session) -> list[Path]:
    return sorted(session.directory.glob("trace_*.jsonl"))


def records(path: Path) -> list[Output]:
    result = parse_trace(path.read_bytes(), file=str(path))
    assert result.errors == [], result.errors
    return result.records


async def assert_one_context_per_file(
    host: Host, session: Session, summarized: Sequence[ModelRequest]
) -> list[list[Output]]:
    """R-COMPACT-8 / R-TRACE-1: files trace_001… with no gap; seq runs on across files
    without a gap; every file after the first starts with compaction_end(ok) naming it;
    each file alone rebuilds the context that was summarized (``summarized``: one request
    of each successful summarize compaction, in order; empty for discard) or, for the
    current file, the live context."""
    await host.trace_store.log.sync()
    files = trace_files(session)
    assert [f.name for f in files] == [trace_file_name(n) for n in range(1, len(files) + 1)]
    assert files[-1] == session.trace_path
    per_file = [records(f) for f in files]
    seqs = [r.seq for recs in per_file for r in recs]
    assert seqs == list(range(1, len(seqs) + 1))
    for path, recs in zip(files[1:], per_file[1:], strict=True):
        first = recs[0]
        assert isinstance(first, CompactionEnd), first
        assert (first.status, first.trace_file) == ("ok", path.name)
    if summarized:
        assert len(summarized) == len(files) - 1
        for recs, request in zip(per_file, summarized, strict=False):
            assert rebuild(recs).compaction_base()[0] == base_of(request.messages)
    live = session.transcript
    current = rebuild(per_file[-1])
    assert current.messages == live.messages
    assert current.request_messages() == live.request_messages()
    assert current.carry_over == live.carry_over
    return per_file


async def new_session(
    host: Host,
    workspace: Path,
    provider: ScriptedProvider,
    tools: Sequence[Any] = (),
    **settings: Any,
) -> Session:
    settings.setdefault("max_context_length", LIMIT)
    return await host.create_session(
        tools=list(tools),
        provider=provider,
        workspace_dir=workspace,
        system="Be brief.",
        **settings,
    )


# -- the context trigger, summarize, rotation ------------------------------------------------


async def test_context_trigger_summarizes_before_the_next_request(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-COMPACT-2 `context`, R-COMPACT-3, R-COMPACT-5, R-COMPACT-8: the last request's
    total reached max_context_length, so once the turn's tool results are in — before the
    next request — the old context plus those results plus the prompt is sent with the
    same system prompt and tools; the next request's context is exactly one user text
    [context_summary]…[/context_summary]; the trace rotates to trace_002.jsonl, whose first
    record is compaction_end(ok) with the summary."""
    seen: list[ModelRequest] = []
    provider = providers(
        [
            Reply(blocks=(text("Looking."), tool_call("c1", "lookup", key="a")), usage=BIG),
            summary_step("User wants a; a=value-a.", seen),
            Reply(blocks=(text("Done."),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    assert session.trace_path.name == "trace_001.jsonl"
    outputs = await collect(session.run("find a", approve=allow_all))

    assert of_type(outputs, TaskEnd)[0].status == "completed"
    (begin,) = of_type(outputs, CompactionBegin)
    (end,) = of_type(outputs, CompactionEnd)
    assert begin.reason == "context"
    assert (end.status, end.attempt, end.trace_file) == ("ok", 1, "trace_002.jsonl")
    assert end.summary == "User wants a; a=value-a." and end.error_message is None
    # Checked after the tool results are in, before the next request.
    i_begin = outputs.index(begin)
    assert index_of(outputs, is_output("tool_call_output", call_id="c1")) < i_begin
    assert outputs.index(end) < index_of(outputs, is_output("request_begin", turn=2))
    # The compaction's own usage is reported (and counted in the task).
    assert any(isinstance(o, TokenUsageOutput) for o in outputs[i_begin : outputs.index(end)])

    first, summary_req, after = provider.requests
    assert summary_req is seen[0]
    # R-COMPACT-5: same system prompt and tool list, history only appended to.
    assert (summary_req.system, summary_req.tools) == (first.system, first.tools)
    assert summary_req.tools and summary_req.system == "Be brief."
    assert summary_req.messages[: len(first.messages)] == first.messages
    assert summary_req.messages[-1] == prompt_msg()
    (result,) = [p for p in summary_req.messages[-2].content if isinstance(p, ToolResult)]
    assert result.call_id == "c1"
    # R-COMPACT-3: the fresh context is exactly the summary.
    assert after.messages == (summary_message("User wants a; a=value-a."),)
    assert after.messages[0].content == (
        TextBlock(text="[context_summary]User wants a; a=value-a.[/context_summary]"),
    )
    assert (after.system, after.tools) == (first.system, first.tools)

    assert session.trace_path.name == "trace_002.jsonl"
    per_file = await assert_one_context_per_file(host, session, seen)
    assert per_file[1][0] == end
    assert session.compactability() == "ok"  # "Done." came after the summary


@pytest.mark.parametrize(("total", "compacts"), [(LIMIT - 1, False), (LIMIT, True)])
async def test_context_threshold_is_inclusive(
    host: Host, workspace: Path, providers, lookup: Lookup, total: int, compacts: bool
) -> None:
    """R-COMPACT-2: `context` fires when the last request's total is >= the threshold
    (input + output + cache figures)."""
    usage = TokenUsage(input=total - 300, output=100, cache_read=150, cache_write=50)
    assert usage.total == total
    script: list[Any] = [Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=usage)]
    if compacts:
        script.append(summary_step("gist"))
    script.append(Reply(blocks=(text("ok"),)))
    session = await new_session(host, workspace, providers(script), [lookup.tool])
    outputs = await collect(session.run("go", approve=allow_all))
    assert len(of_type(outputs, CompactionBegin)) == int(compacts)
    assert of_type(outputs, TaskEnd)[0].status == "completed"


@pytest.mark.parametrize("limit", [0, -1])
async def test_non_positive_max_context_length_disables_the_trigger(
    host: Host, workspace: Path, providers, lookup: Lookup, limit: int
) -> None:
    """R-COMPACT-1: max_context_length <= 0 turns the context trigger off."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=TokenUsage(input=10**7)),
            Reply(blocks=(text("ok"),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool], max_context_length=limit)
    outputs = await collect(session.run("go", approve=allow_all))
    assert of_type(outputs, CompactionBegin) == []
    assert len(provider.requests) == 2


async def test_defaults() -> None:
    """R-COMPACT-1: the defaults of SPEC.md."""
    from greenroom.protocols.settings import SessionSettings

    s = SessionSettings()
    assert (s.max_context_length, s.max_session_turns, s.compact_mode) == (128_000, -1, "summarize")
    assert "[summary]" in s.compact_prompt


async def test_turns_trigger_counts_turns_across_tasks(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-COMPACT-2 `turns`: max_session_turns counts the session's turns across tasks
    (two in the first task, one in the second), then the count starts again in the new
    context."""
    seen: list[ModelRequest] = []
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(text("first done"),)),
            Reply(blocks=(tool_call("c2", "lookup", key="b"),)),
            summary_step("a and b looked up", seen),
            Reply(blocks=(text("second done"),)),
            Reply(blocks=(text("third"),)),
        ]
    )
    session = await new_session(
        host, workspace, provider, [lookup.tool], max_context_length=0, max_session_turns=3
    )
    first = await collect(session.run("one", approve=allow_all))
    assert of_type(first, CompactionBegin) == []
    second = await collect(session.run("two", approve=allow_all))
    (begin,) = of_type(second, CompactionBegin)
    assert begin.reason == "turns"
    assert of_type(second, CompactionEnd)[0].status == "ok"
    # It came before the second turn of the second task (the third session turn was done).
    assert second.index(begin) < index_of(second, is_output("request_begin", turn=2))
    assert provider.requests[4].messages == (summary_message("a and b looked up"),)
    third = await collect(session.run("three", approve=allow_all))
    assert of_type(third, CompactionBegin) == []  # 1 turn in the new context so far
    await assert_one_context_per_file(host, session, seen)


async def test_discard_mode_drops_the_old_context_without_a_model_request(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-COMPACT-3 `discard`: no summary request; the next request's context is only the
    marker saying the earlier conversation was dropped; the trace still rotates."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="secret"),), usage=BIG),
            Reply(blocks=(text("ok"),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool], compact_mode="discard")
    outputs = await collect(session.run("go", approve=allow_all))
    (end,) = of_type(outputs, CompactionEnd)
    assert (end.status, end.summary, end.trace_file) == ("ok", None, "trace_002.jsonl")
    assert len(provider.requests) == 2
    after = provider.requests[1]
    assert after.messages == (summary_message(DISCARDED_TEXT),)
    assert "secret" not in repr(after.messages)
    await assert_one_context_per_file(host, session, [])


# -- manual ------------------------------------------------------------------------------------


async def test_manual_compaction_and_compactability(
    host: Host, workspace: Path, providers, data_dir: Path
) -> None:
    """R-COMPACT-2 `manual`, R-COMPACT-10: compactability() is `empty` for a new session,
    `ok` after a task, `just_compacted` right after compact() (which then does nothing)
    and `ok` again once the context grew; session.compact() returns its compaction_end;
    the next task starts from the summary."""
    seen: list[ModelRequest] = []
    provider = providers(
        [
            Reply(blocks=(text("Hello."),)),
            summary_step("greeted", seen),
            Reply(blocks=(text("Again."),)),
        ]
    )
    session = await new_session(host, workspace, provider)
    recorder = Recorder(session)
    assert session.compactability() == "empty"
    assert await session.compact() is None
    await collect(session.run("hi"))
    assert session.compactability() == "ok"

    end = await session.compact()
    assert isinstance(end, CompactionEnd)
    assert (end.status, end.attempt, end.summary) == ("ok", 1, "greeted")
    assert end.trace_file == "trace_002.jsonl"
    (begin,) = [o for o in recorder.outputs if isinstance(o, CompactionBegin)]
    assert begin.reason == "manual" and begin.run_id == end.run_id
    assert session.compactability() == "just_compacted"
    assert await session.compact() is None
    assert len(provider.requests) == 2
    assert provider.requests[1].messages[:-1] == (
        *provider.requests[0].messages[:1],
        AssistantMessage(content=(text("Hello."),)),
    )

    await collect(session.run("more"))
    assert provider.requests[2].messages == (
        summary_message("greeted"),
        UserMessage(content=(TextBlock(text="more"),)),
    )
    assert session.compactability() == "ok"
    await assert_one_context_per_file(host, session, seen)


async def test_compactability_unsupported_when_auth_locked(
    host: Host, workspace: Path, providers
) -> None:
    """R-COMPACT-10: a session locked by an auth failure cannot be asked for a summary."""
    provider = providers([Reply(fail=model_error("auth", "bad key"))])
    session = await new_session(host, workspace, provider)
    outputs = await collect(session.run("hi"))
    assert of_type(outputs, TaskEnd)[0].status == "auth"
    assert session.compactability() == "unsupported"
    assert await session.compact() is None
    session.retry_auth()
    assert session.compactability() == "ok"


async def test_only_one_task_or_compaction_at_a_time(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-COMPACT-11 / R-HOST-2: compact() while a task runs raises Busy; run() and a
    second compact() while a manual compaction runs raise Busy."""
    entered, release, slow_summary = held_summary()
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "wait", key="k"),)),
            Reply(blocks=(text("ok"),)),
            slow_summary,
        ]
    )
    session = await new_session(host, workspace, provider, [gates.tool()])
    run = session.run("go", approve=allow_all)
    await gates.started("k")
    with pytest.raises(Busy):
        await session.compact()
    gates.release("k")
    await collect(run)

    ends: list[CompactionEnd | None] = []

    async def compact() -> None:
        ends.append(await session.compact())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(compact)
        with trio.fail_after(5):
            await entered.wait()
        assert session.busy
        with pytest.raises(Busy):
            session.run("now")
        with pytest.raises(Busy):
            await session.compact()
        release.set()
    (end,) = ends
    assert end is not None and end.status == "ok"
    assert not session.busy


async def test_compact_returns_when_a_follow_up_queued_meanwhile_starts(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-COMPACT-10, R-STEER-6, R-HITL-3: a follow-up queued during a manual compaction runs
    after it as a task of its own; compact() returns its compaction_end when that task
    starts, not when it ends — here it parks on a person's answer, and compact() used to
    wait for that answer. The follow-up then goes on to its answer."""
    entered, release, slow_summary = held_summary()
    provider = providers(
        [
            Reply(blocks=(text("Hello."),)),
            slow_summary,
            Reply(blocks=(tool_call("c1", "lookup", key="k"),)),
            Reply(blocks=(text("looked up"),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    recorder = Recorder(session)
    await collect(session.run("hi"))
    ends: list[CompactionEnd | None] = []

    async def compact() -> None:
        ends.append(await session.compact())

    with trio.fail_after(5):  # compact() is back while the follow-up waits for a person
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compact)
            await entered.wait()
            assert session.follow_up("then look it up", approve="people")
            release.set()
    (end,) = ends
    assert end is not None and end.status == "ok"
    await recorder.wait_for("approval_request", call_id="c1")
    assert [p.call_id for p in await host.pending_approvals()] == ["c1"]
    assert session.busy
    await host.answer_approval(session.id, "c1", "allow")
    await session.wait_idle()
    task_end = of_type(recorder.outputs, TaskEnd)[-1]
    assert task_end.status == "completed" and task_end.run_id != end.run_id
    assert lookup.calls == ["k"]


async def test_manual_compaction_folds_in_carry_over(
    host: Host, workspace: Path, providers, gates: Gates
) -> None:
    """R-COMPACT-3: an interrupted task's carry-over (here the interrupted call's paired
    placeholder result) is summarized with the context, not lost or left dangling."""
    seen: list[ModelRequest] = []
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "wait", key="k"),)),
            summary_step("interrupted wait", seen),
            Reply(blocks=(text("fresh"),)),
        ]
    )
    session = await new_session(host, workspace, provider, [gates.tool()])
    run = session.run("go", approve=allow_all)
    await gates.started("k")
    session.interrupt("stop")
    await collect(run)
    assert session.transcript.carry_over
    assert session.compactability() == "ok"
    end = await session.compact()
    assert end is not None and end.status == "ok"
    (summary_req,) = seen
    (placeholder,) = [p for p in summary_req.messages[-2].content if isinstance(p, ToolResult)]
    assert placeholder.call_id == "c1" and placeholder.status == "interrupted"
    assert session.transcript.carry_over == []
    await collect(session.run("next"))
    assert provider.requests[-1].messages[0] == summary_message("interrupted wait")
    await assert_one_context_per_file(host, session, seen)


# -- overflow ----------------------------------------------------------------------------------


async def test_overflow_compacts_once_and_reruns_the_same_turn(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-COMPACT-9: the provider says the prompt is too long: one compaction (reason
    `overflow`) of the context plus the turn's pending input, then the same turn runs
    again from the summary and the task completes."""
    seen: list[ModelRequest] = []
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=SMALL),
            Reply(fail=model_error("context_overflow", "prompt is too long: 210000 tokens")),
            summary_step("a looked up", seen),
            Reply(blocks=(text("Done."),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    outputs = await collect(session.run("go", approve=allow_all))

    assert of_type(outputs, TaskEnd)[0].status == "completed"
    (begin,) = of_type(outputs, CompactionBegin)
    assert begin.reason == "overflow"
    ends = [(e.turn, e.attempt, e.status, e.retry_in_ms) for e in of_type(outputs, RequestEnd)]
    assert ends == [(1, 1, "ok", None), (2, 1, "context_overflow", None), (2, 1, "ok", None)]
    assert "prompt is too long" in (of_type(outputs, RequestEnd)[1].error_message or "")
    overflowed = provider.requests[1]
    # What overflowed is not sent again whole: the summary request sends it cut to fit.
    assert base_of(seen[0].messages) == compaction.fit_base(overflowed.messages, 0)
    assert provider.requests[3].messages == (summary_message("a looked up"),)
    assert of_type(outputs, TaskEnd)[0].turns == 2
    # The file before still holds the whole context that overflowed (R-COMPACT-8).
    whole = attrs.evolve(seen[0], messages=(*overflowed.messages, prompt_msg()))
    await assert_one_context_per_file(host, session, [whole])


async def test_second_overflow_in_the_same_turn_fails_the_turn(
    host: Host, workspace: Path, providers
) -> None:
    """R-COMPACT-9: once per turn: an overflow after the overflow compaction ends the
    turn (and the task) `failed`, with no second compaction."""
    provider = providers(
        [
            Reply(fail=model_error("context_overflow", "prompt is too long")),
            summary_step("hi"),
            Reply(fail=model_error("context_overflow", "prompt is still too long")),
        ]
    )
    session = await new_session(host, workspace, provider)
    outputs = await collect(session.run("hi"))
    assert len(of_type(outputs, CompactionBegin)) == 1
    end = of_type(outputs, TaskEnd)[0]
    assert (end.status, end.message) == ("failed", "prompt is still too long")
    assert len(provider.requests) == 3


async def test_overflow_with_a_failed_compaction_fails_the_turn(
    host: Host, workspace: Path, providers
) -> None:
    """R-COMPACT-9 with R-COMPACT-7: the summary request itself overflows (not retried):
    compaction_end(failed), the turn fails, and the old context and trace file stay."""
    overflow = model_error("context_overflow", "prompt is too long")
    provider = providers([Reply(fail=overflow), Reply(fail=overflow)])
    session = await new_session(host, workspace, provider)
    outputs = await collect(session.run("hi"))
    (cend,) = of_type(outputs, CompactionEnd)
    assert (cend.status, cend.attempt) == ("failed", 1)
    assert of_type(outputs, TaskEnd)[0].status == "failed"
    assert [f.name for f in trace_files(session)] == ["trace_001.jsonl"]


async def test_rate_limits_and_max_tokens_are_not_overflow(
    host: Host, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-COMPACT-9: a 429 rate limit is retried as `timeout` and an output-token limit
    (max_tokens, with a truncated tool call) is a normal turn: neither compacts."""
    provider = providers(
        [
            Reply(fail=model_error("timeout", "429 rate_limit_error: too many tokens")),
            Reply(
                blocks=(text("Writing"), tool_call("c1", "lookup", key="x" * 40)),
                truncate_last_tool_call=True,
            ),
            Reply(blocks=(text("cut off at the lim"),), stop_reason="max_tokens"),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    outputs = await collect(session.run("go", approve=allow_all), bound_s=None)
    assert of_type(outputs, CompactionBegin) == []
    statuses = [(e.status, e.stop_reason) for e in of_type(outputs, RequestEnd)]
    assert statuses == [("timeout", None), ("ok", "max_tokens"), ("ok", "max_tokens")]
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert lookup.calls == []


# -- invalid summaries and the shared retry budget ------------------------------------------


async def test_stray_tool_call_in_a_summary_is_answered_never_executed(
    host: Host, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-COMPACT-6: a summary response with a tool call is a failed attempt: the call is
    never approved or executed; the retry answers it with a synthetic failure output
    (pairing kept) and appends the correction note before the prompt; the request before
    it is an unchanged prefix of the retry."""
    seen: list[ModelRequest] = []
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            Reply(blocks=(text("Let me check."), tool_call("s1", "lookup", key="stray"))),
            summary_step("a=value-a", seen),
            Reply(blocks=(text("Done."),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    outputs = await collect(session.run("go", approve=allow_all), bound_s=None)

    assert lookup.calls == ["a"]
    assert [o.call_id for o in of_type(outputs, ToolCallOutput)] == ["c1"]
    assert not any(getattr(o, "call_id", None) == "s1" for o in outputs)
    (end,) = of_type(outputs, CompactionEnd)
    assert (end.status, end.attempt) == ("ok", 2)
    first_try, retry = provider.requests[1], provider.requests[2]
    n = len(first_try.messages)
    assert retry.messages[:n] == first_try.messages
    stray, answer, note = retry.messages[n:]
    assert stray == AssistantMessage(
        content=(text("Let me check."), tool_call("s1", "lookup", key="stray"))
    )
    assert answer == UserMessage(
        content=(
            ToolResult(
                call_id="s1",
                tool="lookup",
                status="error",
                is_error=True,
                content=(TextBlock(text=STRAY_CALL_TEXT),),
            ),
        )
    )
    assert texts_of(note) == [f"{CORRECTION_NOTE}\n\n{DEFAULT_COMPACT_PROMPT}"]
    assert (retry.system, retry.tools) == (first_try.system, first_try.tools)
    assert provider.requests[3].messages == (summary_message("a=value-a"),)
    await assert_one_context_per_file(host, session, seen)


@pytest.mark.parametrize(
    "empty",
    [(text("[summary]   [/summary]"),), (text(""),), ()],
    ids=["empty-pair", "blank", "no-blocks"],
)
async def test_empty_summary_is_a_failed_attempt(
    host: Host, workspace: Path, providers, autojump_clock, empty: tuple[Any, ...]
) -> None:
    """R-COMPACT-6: an empty summary is a failed attempt; the retry keeps the response in
    history (when there was one) and appends the correction note before the prompt."""
    provider = providers(
        [Reply(blocks=(text("Hi."),)), Reply(blocks=empty), summary_step("greeting")]
    )
    session = await new_session(host, workspace, provider)
    await collect(session.run("hi"), bound_s=None)
    end = await session.compact()
    assert end is not None and (end.status, end.attempt, end.summary) == ("ok", 2, "greeting")
    first_try, retry = provider.requests[1], provider.requests[2]
    n = len(first_try.messages)
    assert retry.messages[:n] == first_try.messages
    tail = retry.messages[n:]
    kept = [m for m in tail if isinstance(m, AssistantMessage)]
    assert len(kept) == (1 if empty else 0)
    assert texts_of(tail[-1]) == [f"{CORRECTION_NOTE}\n\n{DEFAULT_COMPACT_PROMPT}"]


async def test_retry_budget_exhausted_keeps_the_old_context_and_the_next_trigger_retries(
    host: Host, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-COMPACT-7: transport failures and invalid summaries share one budget: six
    attempts 250/500/1000/2000/4000 ms apart, then compaction_end(failed) with attempt 6
    and the last error, a `compaction_failed` ledger row, the old context and trace file
    kept, the task goes on, and the next trigger compacts successfully."""
    arrivals: list[float] = []
    seen: list[ModelRequest] = []
    failures = [
        Reply(fail=model_error("timeout", "overloaded")),
        Reply(blocks=(tool_call("s1", "lookup", key="stray"),)),
        Reply(blocks=(text("[summary][/summary]"),)),
        Reply(fail=model_error("malformed", "stream cut short")),
        Reply(fail=model_error("failed", "bad gateway text")),
        Reply(fail=model_error("timeout", "still overloaded")),
    ]
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            *(timed(f, arrivals) for f in failures),
            Reply(blocks=(tool_call("c2", "lookup", key="b"),), usage=BIG),
            summary_step("a and b", seen),
            Reply(blocks=(text("Done."),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    outputs = await collect(session.run("go", approve=allow_all), bound_s=None)

    assert [round((b - a) * 1000) for a, b in itertools.pairwise(arrivals)] == SCHEDULE_MS
    assert [b.reason for b in of_type(outputs, CompactionBegin)] == ["context", "context"]
    failed, ok = of_type(outputs, CompactionEnd)
    assert (failed.status, failed.attempt, failed.error_message) == (
        "failed",
        6,
        "still overloaded",
    )
    assert failed.trace_file is None and failed.summary is None
    assert (ok.status, ok.attempt, ok.trace_file) == ("ok", 1, "trace_002.jsonl")
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert lookup.calls == ["a", "b"]  # the stray call never ran

    # History only appended to across the failed attempts.
    attempts = provider.requests[1:7]
    for before, after in itertools.pairwise(attempts):
        assert after.messages[: len(before.messages)] == before.messages
    # The old context was kept: the next normal request continues it.
    turn2 = provider.requests[7]
    assert turn2.messages == base_of(attempts[0].messages)
    assert not is_summary_request(turn2)

    await host.trace_store.log.sync()
    rows = ledger_rows(host.data_dir, session.id)
    failed_rows = [r for r in rows if r["kind"] == "compaction_failed"]
    assert len(failed_rows) == 1
    assert failed_rows[0]["status"] == "failed"
    assert failed_rows[0]["error_message"] == "still overloaded"
    per_file = await assert_one_context_per_file(host, session, seen)
    # The failed compaction is recorded in the old file (one context), not rotated.
    assert failed in per_file[0]


async def test_skip_reconnect_wait_ends_a_compaction_backoff_early(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-5 inside a compaction: skip_reconnect_wait() ends the backoff sleep at
    once without changing the attempt count."""
    arrivals: list[float] = []
    arrived = [trio.Event() for _ in range(3)]

    def noted(step: Any) -> Any:
        def answer(request: ModelRequest) -> Reply:
            arrived[len(arrivals)].set()
            return timed(step, arrivals)(request)

        return answer

    provider = providers(
        [
            Reply(blocks=(text("Hi."),)),
            noted(Reply(fail=model_error("timeout", "overloaded"))),
            noted(Reply(fail=model_error("timeout", "overloaded"))),
            noted(summary_step("hi")),
        ]
    )
    session = await new_session(host, workspace, provider)
    await collect(session.run("hi"), bound_s=None)
    ends: list[CompactionEnd | None] = []

    async def compact() -> None:
        ends.append(await session.compact())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(compact)
        for n in (0, 1):
            await arrived[n].wait()
            await trio.sleep(0.1)
            assert session.skip_reconnect_wait()
    (end,) = ends
    assert end is not None and (end.status, end.attempt) == ("ok", 3)
    gaps = [round((b - a) * 1000) for a, b in itertools.pairwise(arrivals)]
    assert gaps == [100, 100]  # instead of 250, 500


async def test_auth_failure_during_compaction_stops_at_once(
    host: Host, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-COMPACT-7 / R-RETRY-6: `auth` during a compaction is not retried: one summary
    request, compaction_end(failed, attempt 1), the task ends `auth` without another
    request, and the session is locked."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            Reply(fail=model_error("auth", "invalid x-api-key")),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    outputs = await collect(session.run("go", approve=allow_all), bound_s=None)
    (end,) = of_type(outputs, CompactionEnd)
    assert (end.status, end.attempt, end.error_message) == ("failed", 1, "invalid x-api-key")
    assert len(provider.requests) == 2
    task_end = of_type(outputs, TaskEnd)[0]
    assert task_end.status == "auth"
    assert session.auth_locked is not None
    assert types(outputs)[-1] == "task_end"


async def test_a_summary_retry_that_could_pass_the_budget_is_not_sent(
    data_dir: Path, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-SHARE-4, R-COMPACT-7: an automatic compaction's summary retry is a request the
    budget checks too. At $10 per million tokens, turn 1 spends $0.60 (60,000 tokens of
    input); the first summary request's bound (60,000 tokens at the cache-write rate,
    $0.75, plus 100 output tokens) fits max_cost_usd=1.5 and it spends $0.60 on an empty
    summary. Its retry's bound on top of $1.20 would pass the budget: it is not sent, the
    compaction ends failed naming the budget, the old context and file are kept, and the
    task ends budget_exceeded."""
    sixty = TokenUsage(input=60_000)
    prices = {"scripted": {"input": 10.0, "output": 10.0, "cache_read": 1.0, "cache_write": 12.5}}
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=sixty),
            Reply(blocks=(), usage=sixty),
            summary_step("never asked for"),
            Reply(blocks=(text("Done."),)),
        ]
    )
    async with Host.open(data_dir, prices=prices) as host:
        session = await new_session(
            host, workspace, provider, [lookup.tool], max_context_length=50_000,
            max_cost_usd=1.5, max_tokens=100,
        )  # fmt: skip
        outputs = await collect(session.run("go", approve=allow_all), bound_s=None)
        await host.trace_store.log.sync()
        rows = ledger_rows(host.data_dir, session.id)

    assert len(provider.requests) == 2
    spent = [o.request.cost_usd for o in of_type(outputs, TokenUsageOutput)]
    assert spent == [pytest.approx(0.6), pytest.approx(0.6)]
    assert [r["cost_usd"] for r in rows] == [pytest.approx(0.6), pytest.approx(0.6)]
    (begin,) = of_type(outputs, CompactionBegin)
    (end,) = of_type(outputs, CompactionEnd)
    assert (begin.reason, end.status, end.attempt) == ("context", "failed", 1)
    assert f"max_cost_usd=1.5 of session {session.id}" in (end.error_message or "")
    (task_end,) = of_type(outputs, TaskEnd)
    assert task_end.status == "budget_exceeded"
    assert "$1.20 spent of $1.50" in (task_end.message or "")
    assert task_end.usage.cost_usd == pytest.approx(1.2)
    assert [f.name for f in trace_files(session)] == ["trace_001.jsonl"]
    assert lookup.calls == ["a"]


# -- rotation, reload --------------------------------------------------------------------------


async def test_reload_after_rotation_uses_the_latest_file(
    data_dir: Path, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-COMPACT-8, R-TRACE-4: after a rotation, loading the session reads only the latest
    trace file: the next request starts from the summary and seq goes on."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            summary_step("the summary"),
            Reply(blocks=(text("Done."),)),
        ]
    )
    async with open_host(data_dir) as host:
        session = await new_session(host, workspace, provider, [lookup.tool])
        await collect(session.run("go", approve=allow_all))
        sid = session.id
        live = list(session.transcript.messages)
        last_seq = port_of(session).last_seq
    assert [f.name for f in trace_files(session)] == ["trace_001.jsonl", "trace_002.jsonl"]

    again = providers([Reply(blocks=(text("Back."),))])
    async with open_host(data_dir) as host:
        loaded = await host.load_session(sid, tools=[lookup.tool], provider=again)
        assert loaded.trace_path.name == "trace_002.jsonl"
        assert loaded.transcript.messages == live
        assert loaded.compactability() == "ok"
        outputs = await collect(loaded.run("continue"))
        assert of_type(outputs, TaskEnd)[0].status == "completed"
        assert outputs[0].seq == last_seq + 1
        await assert_one_context_per_file(host, loaded, [])
    (request,) = again.requests
    assert request.messages == (
        summary_message("the summary"),
        AssistantMessage(content=(text("Done."),)),
        UserMessage(content=(TextBlock(text="continue"),)),
    )


async def test_a_structured_task_that_compacted_keeps_its_schema_when_its_host_stops(
    host: Host, workspace: Path, tmp_path: Path, providers, lookup: Lookup
) -> None:
    """R-OUT-1, R-COMPACT-8, R-HITL-4: the new trace file alone holds the task to its
    output schema (compaction_end carries it): taken up from a copy made while its next
    call runs, the task's requests still ask for the schema and its answer is checked."""
    schema = {
        "type": "object",
        "properties": {"key": {"type": "string"}},
        "required": ["key"],
        "additionalProperties": False,
    }
    hold, hold_started = blocking_tool()
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            summary_step("the summary"),
            Reply(blocks=(tool_call("c2", "hold", key="b"),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool, hold])
    session.run("go", approve=allow_all, output_schema=schema).detach()
    with trio.fail_after(10):
        await hold_started.wait()
    await port_of(session).sync_trace()
    assert session.trace_path.name == "trace_002.jsonl"
    first = records(session.trace_path)[0]
    assert isinstance(first, CompactionEnd) and first.output_schema == schema
    copy_session(session, tmp_path / "crashed")

    again = providers([Reply(blocks=(text(json.dumps({"key": "b"})),))])
    async with open_host(tmp_path / "crashed") as other:
        with trio.fail_after(10):
            taken = await other.resume(
                session.id, provider=again, tools=[lookup.tool, hold], approve=allow_all
            )
            await taken.wait_idle()
        end = records(taken.trace_path)[-1]
    assert isinstance(end, TaskEnd)
    assert (end.status, end.output) == ("completed", {"key": "b"})
    (request,) = again.requests
    assert request.output is not None and request.output.schema == schema


# -- interrupt and steering during a compaction ------------------------------------------------


async def test_interrupt_during_compaction_then_the_next_run_works(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-ABORT-1 during a compaction: compaction_end(failed), abort, task_end(aborted);
    the trace is not rotated; the next run works (its first request compacts again: the
    trigger still holds) and every call stays paired."""
    entered = trio.Event()

    async def hang(request: ModelRequest, stream: ScriptedStream) -> None:
        entered.set()
        await trio.sleep_forever()

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            hang,
            summary_step("a looked up, then interrupted"),
            Reply(blocks=(text("Back."),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    recorder = Recorder(session)
    run = session.run("go", approve=allow_all)
    await recorder.wait_for("compaction_begin")
    with trio.fail_after(5):
        await entered.wait()
    session.interrupt("stop now")
    outputs = await collect(run)

    assert types(outputs)[-3:] == ["compaction_end", "abort", "task_end"]
    (end,) = of_type(outputs, CompactionEnd)
    assert (end.status, end.error_message) == ("failed", "stop now")
    (abort,) = of_type(outputs, Abort)
    assert abort.message_complete
    assert of_type(outputs, TaskEnd)[0].status == "aborted"
    assert [f.name for f in trace_files(session)] == ["trace_001.jsonl"]
    await assert_one_context_per_file(host, session, [])

    again = await collect(session.run("again"))
    assert of_type(again, TaskEnd)[0].status == "completed"
    assert [e.status for e in of_type(again, CompactionEnd)] == ["ok"]
    summary_req = provider.requests[2]
    # The interrupted turn's results travel as carry-over, paired, into the summary; the
    # new prompt is kept out of it and follows the summary word for word.
    assert [r.call_id for r in summary_req.messages[-2].content if isinstance(r, ToolResult)] == [
        "c1"
    ]
    assert "again" not in repr(summary_req.messages)
    assert provider.requests[3].messages == (
        summary_message("a looked up, then interrupted"),
        UserMessage(content=(TextBlock(text="again"),)),
    )


async def test_interrupt_during_manual_compaction(host: Host, workspace: Path, providers) -> None:
    """R-ABORT-1 / R-COMPACT-11: interrupting a manual compaction ends it `failed`; the
    session is idle and usable again."""
    entered = trio.Event()

    async def hang(request: ModelRequest, stream: ScriptedStream) -> None:
        entered.set()
        await trio.sleep_forever()

    provider = providers([Reply(blocks=(text("Hi."),)), hang, Reply(blocks=(text("ok"),))])
    session = await new_session(host, workspace, provider)
    await collect(session.run("hi"))
    ends: list[CompactionEnd | None] = []

    async def compact() -> None:
        ends.append(await session.compact())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(compact)
        with trio.fail_after(5):
            await entered.wait()
        assert session.interrupt("never mind")
    (end,) = ends
    assert end is not None and (end.status, end.error_message) == ("failed", "never mind")
    assert not session.busy
    assert session.compactability() == "ok"
    outputs = await collect(session.run("next"))
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert [f.name for f in trace_files(session)] == ["trace_001.jsonl"]


async def test_steering_during_a_compaction_is_delivered_right_after_it(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-STEER-5: input steered while the compaction request runs is not lost: it goes
    into the first request after the compaction, as one [user_steering] text."""
    holder: list[Session] = []
    seen: list[ModelRequest] = []

    def summary_while_steering(request: ModelRequest) -> Reply:
        assert holder[0].steer("also check b")
        return summary_step("checked a", seen)(request)

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            summary_while_steering,
            Reply(blocks=(text("Will do."),)),
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    holder.append(session)
    outputs = await collect(session.run("go", approve=allow_all))

    steering = [o for o in outputs if isinstance(o, UserMsg) and o.kind == "steering"]
    assert len(steering) == 1
    i = outputs.index(steering[0])
    assert index_of(outputs, is_output("compaction_end")) < i
    assert i < index_of(outputs, is_output("request_begin", turn=2))
    assert provider.requests[2].messages == (
        summary_message("checked a"),
        UserMessage(content=(TextBlock(text="[user_steering]also check b[/user_steering]"),)),
    )
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    await assert_one_context_per_file(host, session, seen)


async def test_steering_during_an_overflow_compaction_reaches_the_rerun(
    host: Host, workspace: Path, providers
) -> None:
    """R-STEER-5 with R-COMPACT-9: input steered during the overflow compaction goes into
    the rerun of the turn (the first request after the compaction)."""
    holder: list[Session] = []

    def summary_while_steering(request: ModelRequest) -> Reply:
        assert holder[0].steer("and be quick")
        return summary_step("asked hi")(request)

    provider = providers(
        [
            Reply(fail=model_error("context_overflow", "prompt is too long")),
            summary_while_steering,
            Reply(blocks=(text("Hi!"),)),
        ]
    )
    session = await new_session(host, workspace, provider)
    holder.append(session)
    outputs = await collect(session.run("hi"))
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert provider.requests[2].messages == (
        summary_message("asked hi"),
        UserMessage(content=(TextBlock(text="[user_steering]and be quick[/user_steering]"),)),
    )
    assert len(provider.requests) == 3


# -- many compactions --------------------------------------------------------------------------


async def test_many_compactions_keep_every_trace_file_one_context(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """Done-when, scripted: 40 turns over several tasks with a small threshold compact
    many times; every request is paired (the provider checks), every file is one context
    and seq has no gap across files."""
    seen: list[ModelRequest] = []
    counter = [0]

    def model(request: ModelRequest) -> Reply:
        if is_summary_request(request):
            seen.append(request)
            return Reply(blocks=(text(f"[summary]state after {counter[0]} turns[/summary]"),))
        counter[0] += 1
        n = counter[0]
        if n % 5 == 0:
            return Reply(blocks=(text(f"finished {n}"),))
        return Reply(blocks=(text(f"step {n}"), tool_call(f"c{n}", "lookup", key=f"k{n}")))

    provider = providers(model)
    session = await new_session(host, workspace, provider, [lookup.tool], max_context_length=60)
    for task in range(8):
        outputs = await collect(session.run(f"task {task}", approve=allow_all))
        assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert counter[0] == 40
    assert len(seen) >= 5
    ends = [r for recs in [records(f) for f in trace_files(session)] for r in recs]
    assert all(e.status == "ok" for e in ends if isinstance(e, CompactionEnd))
    await assert_one_context_per_file(host, session, seen)


async def test_interrupt_during_a_compaction_backoff_reports_the_attempt(
    host: Host, workspace: Path, providers, autojump_clock
) -> None:
    """R-RETRY-5 / R-COMPACT-7: an interrupt during a compaction's backoff ends it at once
    with compaction_end(failed) naming the attempt that failed last."""
    arrived = trio.Event()

    def second_failure(request: ModelRequest) -> Reply:
        arrived.set()
        return Reply(fail=model_error("timeout", "overloaded"))

    provider = providers(
        [
            Reply(blocks=(text("Hi."),)),
            Reply(fail=model_error("timeout", "overloaded")),
            second_failure,
        ]
    )
    session = await new_session(host, workspace, provider)
    await collect(session.run("hi"), bound_s=None)
    ends: list[CompactionEnd | None] = []

    async def compact() -> None:
        ends.append(await session.compact())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(compact)
        await arrived.wait()
        await trio.sleep(0.2)  # inside the 500 ms backoff after attempt 2
        assert session.interrupt("enough")
    (end,) = ends
    assert end is not None and (end.status, end.attempt, end.error_message) == (
        "failed",
        2,
        "enough",
    )
    assert len(provider.requests) == 3


async def test_crash_after_a_rotation_recovers_from_the_latest_file_alone(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-COMPACT-8 with R-TRACE-4: the task that rotated the trace has its task_start in
    the old file; if the process dies mid-turn after the rotation, the new file alone still
    settles the cut turn as interrupted (the same carry-over a live interrupt leaves)."""
    entered = trio.Event()

    async def partial_then_hang(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("Partial thought.")
        entered.set()
        await trio.sleep_forever()

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            summary_step("looked up a"),
            partial_then_hang,
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    run = session.run("go", approve=allow_all)
    with trio.fail_after(5):
        await entered.wait()
    session.interrupt("stop")
    await collect(run)
    per_file = await assert_one_context_per_file(host, session, [])
    full = per_file[-1]
    assert not any(isinstance(r, RequestBegin) for r in per_file[0][-3:])
    # The process "died" right after the partial block was traced.
    cut = full[: index_of(full, is_output("model_msg")) + 1]
    assert not any(isinstance(r, (TaskEnd, Abort)) for r in cut)
    recovered = rebuild(cut)
    assert recovered.message_complete
    assert recovered.carry_over == rebuild(full).carry_over == session.transcript.carry_over
    assert "[turn_aborted]Partial thought.[/turn_aborted]" in texts_of(
        UserMessage(content=tuple(recovered.carry_over))
    )


# -- a crash around the rotation -------------------------------------------------------------


def copy_traces(session: Session, data_dir: Path) -> Path:
    """Copy the session's meta and every trace file as they are on disk now into
    ``data_dir`` (a crash of the host at this point); returns the copy's directory."""
    target = data_dir / "sessions" / session.id
    target.mkdir(parents=True)
    for path in session.directory.iterdir():
        if path.name == "session.json" or path.name.startswith("trace_"):
            target.joinpath(path.name).write_bytes(path.read_bytes())
    return target


async def crash_after_the_rotation(
    session: Session, run: Any, reached: trio.Event, data_dir: Path
) -> Path:
    """Wait until the request after the rotation runs (``reached``), copy the session as
    a crash now would leave it, then interrupt the live run; returns the copy."""
    with trio.fail_after(5):
        await reached.wait()
    await port_of(session).sync_trace()
    assert session.trace_path.name == "trace_002.jsonl"
    copied = copy_traces(session, data_dir)
    session.interrupt("stop")
    await collect(run)
    return copied


@pytest.mark.parametrize("written", ["nothing", "half"])
async def test_a_crash_before_the_new_files_first_record_keeps_the_old_context(
    host: Host, workspace: Path, tmp_path: Path, providers, lookup: Lookup, written: str
) -> None:
    """R-COMPACT-8, R-TRACE-1, R-TRACE-4: the host dies once the rotation created
    trace_002 but before its first record (compaction_end) is written whole: the file is
    empty, or holds half of that record. The compaction did not happen: the session is
    taken up from trace_001 — its context, seq going on after its last record, the
    compaction ended failed as one in flight — and the task's next compaction writes
    trace_002 again (after the torn line, which alone reads as corrupt)."""
    reached = trio.Event()

    async def hang(request: ModelRequest, stream: ScriptedStream) -> None:
        reached.set()
        await trio.sleep_forever()

    seen: list[ModelRequest] = []
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG),
            summary_step("looked up a", seen),
            hang,
        ]
    )
    session = await new_session(host, workspace, provider, [lookup.tool])
    run = session.run("go", approve=allow_all)
    copied = await crash_after_the_rotation(session, run, reached, tmp_path / "crashed")
    first, second = copied / "trace_001.jsonl", copied / "trace_002.jsonl"
    line = second.read_bytes().splitlines(keepends=True)[0]
    second.write_bytes(line[: len(line) // 2] if written == "half" else b"")
    old = records(first)
    assert isinstance(old[-1], TokenUsageOutput)  # the summary's: no compaction_end

    again = providers(
        [
            Reply(blocks=(tool_call("c2", "lookup", key="b"),), usage=BIG),
            summary_step("looked up a and b"),
            Reply(blocks=(text("Done."),)),
        ]
    )
    async with open_host(tmp_path / "crashed") as other:
        with trio.fail_after(10):
            taken = await other.resume(
                session.id, provider=again, tools=[lookup.tool], approve=allow_all
            )
            # Loaded from trace_001: its last seq, not 0.
            assert port_of(taken).last_seq == old[-1].seq
            await taken.wait_idle()
    # The task went on in the old context, then compacted it.
    base = base_of(seen[0].messages)
    assert again.requests[0].messages[: len(base) - 1] == base[:-1]
    assert is_summary_request(again.requests[1])
    assert again.requests[2].messages == (summary_message("looked up a and b"),)
    ended = [r for r in records(first) if isinstance(r, CompactionEnd)]
    assert [(e.status, e.error_message) for e in ended] == [
        ("failed", markers.HOST_LOST_COMPACTION)
    ]
    result = parse_trace(second.read_bytes(), file=str(second))
    assert len(result.errors) == (1 if written == "half" else 0)
    new = result.records
    assert isinstance(new[0], CompactionEnd)
    assert (new[0].status, new[0].trace_file) == ("ok", "trace_002.jsonl")
    assert isinstance(new[-1], TaskEnd) and new[-1].status == "completed"
    seqs = [r.seq for r in (*records(first), *new)]
    assert seqs == list(range(1, len(seqs) + 1))


@pytest.mark.parametrize("reason", ["context", "overflow"])
async def test_a_crash_right_after_the_rotation_keeps_the_tasks_turns_and_usage(
    host: Host, workspace: Path, tmp_path: Path, providers, lookup: Lookup, reason: str
) -> None:
    """R-RUN-6, R-RUN-7, R-COMPACT-8, R-COMPACT-9: max_turns=2; the task compacts before
    its second turn (``context``), or when that turn overflows (``overflow``, the turn runs
    again). The host dies once trace_002 holds only compaction_end: taken up from that
    file alone, the task runs its second turn — numbered 2 — and no more, and its
    task_end counts the tokens of every request it made, before the compaction too."""
    reached = trio.Event()

    async def hang(request: ModelRequest, stream: ScriptedStream) -> None:
        reached.set()
        await trio.sleep_forever()

    first = (
        Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=BIG)
        if reason == "context"
        else Reply(blocks=(tool_call("c1", "lookup", key="a"),), usage=SMALL)
    )
    overflow = [Reply(fail=model_error("context_overflow", "prompt is too long"))]
    provider = providers(
        [first, *(overflow if reason == "overflow" else []), summary_step("gist"), hang]
    )
    session = await new_session(host, workspace, provider, [lookup.tool], max_turns=2)
    run = session.run("go", approve=allow_all)
    copied = await crash_after_the_rotation(session, run, reached, tmp_path / "crashed")
    second = copied / "trace_002.jsonl"
    second.write_bytes(second.read_bytes().splitlines(keepends=True)[0])
    (begin,) = [r for r in records(copied / "trace_001.jsonl") if isinstance(r, CompactionBegin)]
    assert begin.reason == reason

    again = providers(
        [
            Reply(blocks=(tool_call("c2", "lookup", key="b"),), usage=SMALL),
            Reply(blocks=(text("never"),)),
        ]
    )
    async with open_host(tmp_path / "crashed") as other:
        with trio.fail_after(10):
            taken = await other.resume(
                session.id, provider=again, tools=[lookup.tool], approve=allow_all, max_turns=2
            )
            await taken.wait_idle()
    assert len(again.requests) == 1
    new = records(second)
    assert [r.turn for r in new if isinstance(r, RequestBegin)] == [2]
    (end,) = of_type(new, TaskEnd)
    assert (end.status, end.turns) == ("max_turns", 2)
    spent = [
        r.request
        for path in sorted(copied.glob("trace_*.jsonl"))
        for r in records(path)
        if isinstance(r, TokenUsageOutput) and r.run_id == end.run_id
    ]
    assert len(spent) == 3  # the first turn's, the summary's, the taken-up turn's
    assert end.usage == sum(spent[1:], spent[0])


def test_compaction_end_leaves_out_the_tasks_turn_and_usage_when_it_has_none() -> None:
    """R-COMPACT-8, R-TRACE-1: compaction_end's ``turn`` and ``usage`` are in its record
    only when set — a trace written before them reads as before — and read back as
    written."""
    bare = CompactionEnd(session_id="s", run_id="r", seq=4, status="failed", attempt=1)
    assert not {"turn", "usage"} & json.loads(encode_record(bare)).keys()
    full = attrs.evolve(
        bare, status="ok", turn=3, usage=TokenUsage(input=5, output=2, cost_usd=0.5)
    )
    (read,) = parse_trace(encode_record(full), file="t").records
    assert read == full
