"""The approval broker through the turn loop: one decision per call, who decided,
session rules, the conservative default, failures, timeouts and cancellation
(R-APPROVE-1..5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from conftest import (
    Lookup,
    Recorder,
    allow_all,
    collect,
    index_of,
    is_output,
    last_user,
    of_type,
    port_of,
    result_text,
    results_of,
    texts_of,
    trace_lines,
    types,
)

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.converter import converter
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    CompactionEnd,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.tools import tool

DENIED = "Tool call denied by user."


def decisions(outputs: list) -> list[tuple[str, str, str]]:
    return [(d.call_id, d.decision, d.by) for d in of_type(outputs, ApprovalDecision)]


async def test_host_callback_decides_each_call_exactly_once(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-1: every complete call gets exactly one approval_decision with tool,
    decision and by=host; the callback is asked once per call, in call order."""
    asked: list[str] = []

    def approve(call: ToolCallBlock) -> str:
        asked.append(call.id)
        return "allow" if call.id != "c2" else "deny"

    provider = providers(
        [
            Reply(
                blocks=(
                    tool_call("c1", "lookup", key="a"),
                    tool_call("c2", "lookup", key="b"),
                    tool_call("c3", "lookup", key="c"),
                )
            ),
            Reply(blocks=(text("ok"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=approve))

    assert asked == ["c1", "c2", "c3"]
    assert decisions(outputs) == [
        ("c1", "allow", "host"),
        ("c2", "deny", "host"),
        ("c3", "allow", "host"),
    ]
    assert all(d.tool == "lookup" for d in of_type(outputs, ApprovalDecision))
    assert sorted(lookup.calls) == ["a", "c"]
    for call_id in ("c1", "c2", "c3"):  # the decision precedes the call's output
        assert index_of(outputs, is_output("approval_decision", call_id=call_id)) < index_of(
            outputs, is_output("tool_call_output", call_id=call_id)
        )


async def test_async_callback_and_bool_answers(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-1, R-APPROVE-4: the callback may be async and may answer with a bool."""

    async def approve(call: ToolCallBlock) -> bool:
        await trio.lowlevel.checkpoint()
        return call.id == "c1"

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"), tool_call("c2", "lookup", key="b"))),
            Reply(blocks=(text("ok"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=approve))
    assert decisions(outputs) == [("c1", "allow", "host"), ("c2", "deny", "host")]
    assert lookup.calls == ["a"]


async def test_allow_session_is_remembered_as_a_session_rule(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-4, R-APPROVE-1: after allow_session, later calls of the same tool are
    decided by=session_rule without asking the callback again, in later turns and in later
    tasks of the session; other tools are still asked."""
    asked: list[str] = []

    def approve(call: ToolCallBlock) -> str:
        asked.append(call.id)
        return "allow_session" if call.name == "lookup" else "deny"

    @tool(parallel=True)
    async def other(key: str) -> str:
        """Another tool."""
        return key

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(tool_call("c2", "lookup", key="b"), tool_call("c3", "other", key="x"))),
            Reply(blocks=(text("ok"),)),
            Reply(blocks=(tool_call("c4", "lookup", key="c"),)),
            Reply(blocks=(text("ok again"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool, other], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=approve))
    assert decisions(outputs) == [
        ("c1", "allow", "host"),
        ("c2", "allow", "session_rule"),
        ("c3", "deny", "host"),
    ]
    assert asked == ["c1", "c3"]

    outputs = await collect(session.run("more", approve=approve))
    assert decisions(outputs) == [("c4", "allow", "session_rule")]
    assert asked == ["c1", "c3"]
    assert lookup.calls == ["a", "b", "c"]


async def test_allow_session_applies_to_a_later_call_of_the_same_turn(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-4: two calls of one tool in the same message: allow_session on the first
    decides the second by session_rule (the callback is asked once)."""
    asked: list[str] = []

    def approve(call: ToolCallBlock) -> str:
        asked.append(call.id)
        return "allow_session"

    provider = providers(
        [
            Reply(
                blocks=(
                    tool_call("c1", "lookup", key="a"),
                    tool_call("c2", "lookup", key="b"),
                    tool_call("c3", "lookup", key="c"),
                )
            ),
            Reply(blocks=(text("ok"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=approve))
    assert asked == ["c1"]
    assert decisions(outputs) == [
        ("c1", "allow", "host"),
        ("c2", "allow", "session_rule"),
        ("c3", "allow", "session_rule"),
    ]


async def test_allow_session_outlives_a_compaction_and_a_reload(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-4, R-HITL-1, R-COMPACT-8: the rule is a fact of the trace, and a loaded
    session reads only the file its last compaction started, so that file's first record,
    ``compaction_end``, carries it. Allowed for the session, compacted, closed and loaded,
    a call of the tool is allowed by session_rule without asking a callback that would
    deny; a rewind to the compaction's record keeps the rule (decided before it). A
    ``compaction_end`` written before it carried rules reads as carrying none."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(text("ok"),)),
            Reply(blocks=(text("[summary]looked up a[/summary]"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=lambda call: "allow_session"))
    assert decisions(outputs) == [("c1", "allow", "host")]
    end = await session.compact()
    assert end is not None and end.status == "ok"
    await host.close_session(session.id)

    asked: list[str] = []

    def deny(call: ToolCallBlock) -> str:
        asked.append(call.id)
        return "deny"

    again = providers(
        [Reply(blocks=(tool_call("c2", "lookup", key="b"),)), Reply(blocks=(text("ok again"),))]
    )
    loaded = await host.load_session(session.id, tools=[lookup.tool], provider=again)
    assert loaded.trace_path.name == "trace_002.jsonl"
    outputs = await collect(loaded.run("more", approve=deny))
    assert decisions(outputs) == [("c2", "allow", "session_rule")]
    assert asked == []
    assert lookup.calls == ["a", "b"]

    first = trace_lines(loaded)[0]
    assert (first["type"], first["session_rules"]) == ("compaction_end", ["lookup"])
    await loaded.rewind(first["seq"])
    assert port_of(loaded).machine.allowed_for_session("lookup")
    del first["session_rules"]
    assert converter.structure(first, CompactionEnd).session_rules == ()


async def test_no_callback_denies_by_default_and_the_task_goes_on(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-2, R-APPROVE-3: without a callback or client the call is denied
    (by=default); its output is exactly "Tool call denied by user." (status denied,
    is_error); the tool does not run; the model sees the denial and the task completes."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(text("You denied it; here is what I know anyway."),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go"))

    assert decisions(outputs) == [("c1", "deny", "default")]
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.status == "denied"
    assert output.is_error is True
    assert output.content == (TextBlock(text=DENIED),)
    assert lookup.calls == []
    (result,) = results_of(last_user(provider.requests[1]))
    assert (result.call_id, result.status, result.is_error) == ("c1", "denied", True)
    assert result_text(result) == DENIED
    end = of_type(outputs, TaskEnd)[0]
    assert end.status == "completed"
    assert end.turns == 2


@pytest.mark.parametrize("answer", ["deny", "maybe", None, 1])
async def test_callback_deny_or_nonsense_denies(
    host: Host, workspace: Path, providers, lookup: Lookup, answer: object
) -> None:
    """R-APPROVE-1, R-APPROVE-3: "deny" and any answer that is not a decision deny
    (by=host)."""
    provider = providers(
        [Reply(blocks=(tool_call("c1", "lookup", key="a"),)), Reply(blocks=(text("ok"),))]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=lambda call: answer))
    assert decisions(outputs) == [("c1", "deny", "host")]
    assert of_type(outputs, ToolCallOutput)[0].status == "denied"
    assert lookup.calls == []
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_callback_that_raises_denies(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-1: a callback that raises gives deny; the task is not harmed."""

    def approve(call: ToolCallBlock) -> str:
        raise RuntimeError("approval UI crashed")

    provider = providers(
        [Reply(blocks=(tool_call("c1", "lookup", key="a"),)), Reply(blocks=(text("ok"),))]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    outputs = await collect(session.run("go", approve=approve))
    assert decisions(outputs) == [("c1", "deny", "default")]
    assert of_type(outputs, ToolCallOutput)[0].content == (TextBlock(text=DENIED),)
    assert lookup.calls == []
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_callback_that_never_answers_is_denied_after_the_timeout(
    host: Host, workspace: Path, providers, lookup: Lookup, autojump_clock
) -> None:
    """R-APPROVE-4: create_session(approval_timeout_s=5): a callback that never answers is
    denied after 5 (virtual) seconds, and the task goes on to completion."""
    asked_at: list[float] = []

    async def approve(call: ToolCallBlock) -> str:
        asked_at.append(trio.current_time())
        await trio.sleep_forever()
        return "allow"  # pragma: no cover

    provider = providers(
        [Reply(blocks=(tool_call("c1", "lookup", key="a"),)), Reply(blocks=(text("ok"),))]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace, approval_timeout_s=5
    )
    assert session.settings.approval_timeout_s == 5
    recorder = Recorder(session)
    stream = session.run("go", approve=approve)
    decided = await recorder.wait_for("approval_decision", call_id="c1", bound_s=None)
    decided_at = trio.current_time()
    outputs = await collect(stream, bound_s=None)

    assert len(asked_at) == 1
    assert decided_at - asked_at[0] == pytest.approx(5)
    assert isinstance(decided, ApprovalDecision)
    assert decided.decision == "deny"
    assert decisions(outputs) == [("c1", "deny", decided.by)]
    assert of_type(outputs, ToolCallOutput)[0].status == "denied"
    assert lookup.calls == []
    assert of_type(outputs, TaskEnd)[0].status == "completed"


async def test_interrupt_while_an_approval_is_pending_denies_it_and_frees_the_broker(
    host: Host, workspace: Path, providers, lookup: Lookup
) -> None:
    """R-APPROVE-5: cancelling the task while the callback is still deciding resolves the
    call as deny (one approval_decision), pairs it, ends the run (one abort, one
    task_end aborted, nothing after); a second run on the session works."""
    asked = trio.Event()

    async def hang(call: ToolCallBlock) -> str:
        asked.set()
        await trio.sleep_forever()
        return "allow"  # pragma: no cover

    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(tool_call("c2", "lookup", key="b"),)),
            Reply(blocks=(text("ok"),)),
        ]
    )
    session = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    stream = session.run("go", approve=hang)
    with trio.fail_after(10):
        await asked.wait()
    assert session.interrupt() is True
    outputs = await collect(stream)

    assert decisions(outputs) == [("c1", "deny", "default")]
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.call_id == "c1" and output.is_error
    assert len(of_type(outputs, Abort)) == 1
    ends = of_type(outputs, TaskEnd)
    assert len(ends) == 1 and ends[0].status == "aborted"
    assert outputs[-1] is ends[0]
    assert types(outputs)[-2:] == ["abort", "task_end"]
    assert lookup.calls == []
    assert not session.busy

    outputs = await collect(session.run("again", approve=allow_all))
    assert decisions(outputs) == [("c2", "allow", "host")]
    assert lookup.calls == ["b"]
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    carried = last_user(provider.requests[1])
    assert [r.call_id for r in results_of(carried)] == ["c1"]
    assert texts_of(carried) == ["again"]
