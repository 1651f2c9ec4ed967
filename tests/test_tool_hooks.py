"""Tool hooks that decide (R-HOOK-2), on the scripted model: ``before_tool`` denies or
rewrites a call — and the rewritten call is the one approved and run, by a callback, a
person or a session rule —, ``after_tool`` replaces a result; every action is a
``tool_hook`` record; a hook that raises, answers nonsense or times out denies the call
(``before_tool``) or keeps the result (``after_tool``); subagents meet their parent's
hooks; a structured task's answer is no tool and meets none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
import trio.testing
from conftest import (
    RUN_TIMEOUT_S,
    allow_all,
    collect,
    last_user,
    of_type,
    result_text,
    results_of,
)

from greenroom import Host, tool
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.scripted import Reply, text, tool_call
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult
from greenroom.protocols.hooks import Deny, Hooks, Replace, Rewrite
from greenroom.protocols.outputs import (
    ApprovalDecision,
    ApprovalRequest,
    ModelMsg,
    TaskEnd,
    ToolCallOutput,
    ToolHook,
)

ran: list[str] = []


@tool(parallel=False)
async def run_shell(command: str) -> str:
    """Run a shell command (a stand-in: it records what it was asked)."""
    ran.append(command)
    return f"ran {command}: secret=hunter2"


def script(*calls: ToolCallBlock) -> Any:
    """The model makes ``calls``, then answers with the results it was given."""

    def step(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        results = results_of(last) if hasattr(last, "content") else []
        if results:
            return Reply(blocks=(text(" | ".join(result_text(r) for r in results)),))
        return Reply(blocks=calls)

    return step


async def run_with(
    host: Host, workspace: Path, providers: Any, hooks: Hooks, *calls: ToolCallBlock,
    approve: Any = allow_all, bound_s: float | None = RUN_TIMEOUT_S,
) -> tuple[list[Any], Any]:
    ran.clear()
    session = await host.create_session(
        provider=providers(script(*calls)), tools=[run_shell], workspace_dir=workspace,
        hooks=hooks,
    )
    outputs = await collect(session.run("go", approve=approve), bound_s)
    return outputs, session


def sh(call_id: str, command: str) -> ToolCallBlock:
    return tool_call(call_id, "run_shell", command=command)


async def test_before_tool_denies_with_its_reason(
    host: Host, workspace: Path, providers: Any
) -> None:
    def no_rm(call: ToolCallBlock) -> Deny | None:
        return Deny("rm is not allowed here") if "rm" in call.arguments["command"] else None

    outputs, _ = await run_with(
        host, workspace, providers, Hooks(before_tool=no_rm), sh("c1", "rm -rf /"), sh("c2", "ls")
    )
    assert ran == ["ls"]
    (hooked,) = of_type(outputs, ToolHook)
    assert (hooked.call_id, hooked.hook, hooked.action, hooked.reason) == (
        "c1", "before_tool", "deny", "rm is not allowed here"
    )
    decisions = {d.call_id: (d.decision, d.by) for d in of_type(outputs, ApprovalDecision)}
    assert decisions == {"c1": ("deny", "hook"), "c2": ("allow", "host")}
    denied = next(o for o in of_type(outputs, ToolCallOutput) if o.call_id == "c1")
    assert denied.status == "denied"
    assert denied.content == (TextBlock(text="Tool call denied by a hook: rm is not allowed here"),)
    # The record comes before the decision it explains.
    assert outputs.index(hooked) < outputs.index(next(
        d for d in of_type(outputs, ApprovalDecision) if d.call_id == "c1"))
    assert outputs[-1].status == "completed"


async def test_a_rewritten_call_is_approved_and_run_as_rewritten(
    host: Host, workspace: Path, providers: Any
) -> None:
    """The approve callback sees the rewritten arguments (a hook never widens what is
    approved) and the tool runs with them; the model's own message keeps its words."""
    seen: list[dict[str, Any]] = []

    async def sandboxed(call: ToolCallBlock) -> Rewrite:
        return Rewrite({"command": f"timeout 10 {call.arguments['command']}"})

    def approve(call: ToolCallBlock) -> str:
        seen.append(call.arguments)
        return "allow"

    outputs, session = await run_with(
        host, workspace, providers, Hooks(before_tool=sandboxed), sh("c1", "make"),
        approve=approve,
    )
    assert seen == [{"command": "timeout 10 make"}] and ran == ["timeout 10 make"]
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.action == "rewrite" and hooked.arguments == {"command": "timeout 10 make"}
    call = next(o.block for o in of_type(outputs, ModelMsg) if isinstance(o.block, ToolCallBlock))
    assert call.arguments == {"command": "make"}
    records = [json.loads(line) for line in session.trace_path.read_text().splitlines()]
    assert {"type": "tool_hook", "action": "rewrite"}.items() <= next(
        r for r in records if r["type"] == "tool_hook").items()


async def test_a_person_approves_the_rewritten_call_and_it_runs_so_after_parking(
    host: Host, workspace: Path, providers: Any
) -> None:
    """With people answering, the request shows the rewritten arguments; the task parks
    while it waits (no runner keeps the rewrite in memory), and the call that runs when
    the answer comes is the one the person saw."""
    def rewrite(call: ToolCallBlock) -> Rewrite:
        return Rewrite({"command": "ls -l"})

    ran.clear()
    session = await host.create_session(
        provider=providers(script(sh("c1", "ls"))), tools=[run_shell], workspace_dir=workspace,
        hooks=Hooks(before_tool=rewrite),
    )
    stream = session.run("go", approve="people")
    with trio.fail_after(RUN_TIMEOUT_S):
        async for output in stream:
            if isinstance(output, ApprovalRequest):
                assert output.arguments == {"command": "ls -l"}
                break
        await trio.testing.wait_all_tasks_blocked()
        assert session.busy and ran == []
        await host.answer_approval(session.id, "c1", "allow")
        rest = [o async for o in stream]
    assert ran == ["ls -l"] and rest[-1].status == "completed"


async def test_an_allow_session_rule_does_not_skip_the_hook(
    host: Host, workspace: Path, providers: Any
) -> None:
    """The second call of a tool allowed for the session is not asked about, but the hook
    still sees it, and denies it."""
    count = 0

    def second_denied(call: ToolCallBlock) -> Deny | None:
        nonlocal count
        count += 1
        return Deny("once is enough") if count > 1 else None

    outputs, _ = await run_with(
        host, workspace, providers, Hooks(before_tool=second_denied),
        sh("c1", "ls"), sh("c2", "ls"), approve=lambda call: "allow_session",
    )
    decisions = [(d.call_id, d.decision, d.by) for d in of_type(outputs, ApprovalDecision)]
    assert decisions == [("c1", "allow", "host"), ("c2", "deny", "hook")]
    assert ran == ["ls"]


async def test_a_before_tool_hook_that_fails_denies_the_call(
    host: Host, workspace: Path, providers: Any
) -> None:
    def broken(call: ToolCallBlock) -> None:
        raise ValueError("policy store unreachable")

    def nonsense(call: ToolCallBlock) -> str:
        return "yes"

    for hook, reason in (
        (broken, "the hook raised ValueError: policy store unreachable"),
        (nonsense, "answered 'yes'; expected None, Deny(reason) or Rewrite(arguments)"),
    ):
        outputs, _ = await run_with(host, workspace, providers, Hooks(before_tool=hook),
                                    sh("c1", "ls"))
        assert ran == []
        (hooked,) = of_type(outputs, ToolHook)
        assert hooked.action == "error" and hooked.reason == reason
        (result,) = of_type(outputs, ToolCallOutput)
        assert result.status == "denied" and result.content == (
            TextBlock(text=f"Tool call denied: the before_tool hook failed ({reason})."),
        )


async def test_a_before_tool_hook_that_times_out_denies_the_call(
    workspace: Path, providers: Any, data_dir: Path, mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0

    async def slow(call: ToolCallBlock) -> None:
        await trio.sleep(60)

    async with Host.open(data_dir) as host:
        outputs, _ = await run_with(
            host, workspace, providers, Hooks(before_tool=slow, tool_hook_timeout_s=2),
            sh("c1", "ls"), bound_s=None,
        )
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.reason == "no answer within 2 s" and ran == []
    assert of_type(outputs, ApprovalDecision)[0].by == "hook"


async def test_after_tool_replaces_the_result_and_the_trace_keeps_no_original(
    host: Host, workspace: Path, providers: Any
) -> None:
    got: list[ToolResult] = []
    asked: list[ModelRequest] = []

    def redact(call: ToolCallBlock, result: ToolResult) -> Replace:
        got.append(result)
        return Replace(result_text(result).replace("hunter2", "[redacted]"))

    def step(request: ModelRequest) -> Reply:
        asked.append(request)
        return script(sh("c1", "env"))(request)

    ran.clear()
    session = await host.create_session(
        provider=providers(step), tools=[run_shell], workspace_dir=workspace,
        hooks=Hooks(after_tool=redact),
    )
    outputs = await collect(session.run("go", approve=allow_all))
    assert got[0].status == "ok" and got[0].call_id == "c1"
    (hooked,) = of_type(outputs, ToolHook)
    assert (hooked.hook, hooked.action) == ("after_tool", "replace")
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.content == (TextBlock(text="ran env: secret=[redacted]"),)
    assert result_text(results_of(last_user(asked[-1]))[0]) == "ran env: secret=[redacted]"
    assert "hunter2" not in session.trace_path.read_text()


async def test_an_after_tool_hook_that_fails_keeps_the_result(
    host: Host, workspace: Path, providers: Any
) -> None:
    def broken(call: ToolCallBlock, result: ToolResult) -> None:
        raise RuntimeError("disk full")

    outputs, _ = await run_with(host, workspace, providers, Hooks(after_tool=broken),
                                sh("c1", "ls"))
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.action == "error" and hooked.reason == "the hook raised RuntimeError: disk full"
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.status == "ok" and result_text(result) == "ran ls: secret=hunter2"  # type: ignore[arg-type]


async def test_a_subagent_meets_its_parents_tool_hooks(
    host: Host, workspace: Path, providers: Any
) -> None:
    def no_shell(call: ToolCallBlock) -> Deny | None:
        return Deny("no shell in subagents either") if call.name == "run_shell" else None

    def step(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            if results_of(last) if hasattr(last, "content") else []:
                return Reply(blocks=(text("child done"),))
            return Reply(blocks=(sh("k1", "ls"),))
        if results_of(last) if hasattr(last, "content") else []:
            return Reply(blocks=(text("parent done"),))
        return Reply(blocks=(tool_call("p1", SPAWN_SUBAGENT, task="list files"),))

    ran.clear()
    session = await host.create_session(
        provider=providers(step), tools=[run_shell, spawn_subagent], workspace_dir=workspace,
        hooks=Hooks(before_tool=no_shell),
    )
    outputs = await collect(session.run("go", approve=allow_all))
    assert ran == []
    (hooked,) = [o for o in of_type(outputs, ToolHook) if o.origin is not None]
    assert hooked.call_id == "k1" and hooked.action == "deny"
    assert isinstance(outputs[-1], TaskEnd) and outputs[-1].status == "completed"


async def test_the_final_answer_of_a_structured_task_meets_no_hook(
    host: Host, workspace: Path, providers: Any
) -> None:
    seen: list[str] = []

    def deny_all(call: ToolCallBlock) -> Deny:
        seen.append(call.name)
        return Deny("nothing runs")

    session = await host.create_session(
        provider=providers([Reply(blocks=(tool_call("a1", "final_answer", n=1),))]),
        workspace_dir=workspace, hooks=Hooks(before_tool=deny_all),
    )
    result = await session.run(
        "n?", output_schema={"type": "object", "properties": {"n": {"type": "integer"}}}
    ).result()
    assert seen == [] and result.output == {"n": 1}


async def test_a_hooks_long_reason_is_cut_where_it_is_recorded(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-HOOK-2, R-SEC-9: a Python hook's reason (a ``Deny``'s, or the message of what it
    raised) is recorded in the ``tool_hook`` record and the denied result; one of 400 KB
    is cut to the first 2,000 characters and a note of how many were left out, as a
    command hook's stderr is (before: whole, in both, past what one record of a cluster's
    trace carries)."""
    long = "why " * 100_000

    def deny(call: ToolCallBlock) -> Deny:
        return Deny(long)

    def broken(call: ToolCallBlock, result: ToolResult) -> None:
        raise RuntimeError(long)

    cut = f"{long[:2000]}… [cut: {len(long) - 2000} of {len(long)} characters left out]"
    outputs, _ = await run_with(host, workspace, providers, Hooks(before_tool=deny),
                                sh("c1", "ls"))
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.reason == cut
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.content == (TextBlock(text=f"Tool call denied by a hook: {cut}"),)
    outputs, _ = await run_with(host, workspace, providers, Hooks(after_tool=broken),
                                sh("c1", "ls"))
    (hooked,) = of_type(outputs, ToolHook)
    raised = f"the hook raised RuntimeError: {long}"
    assert hooked.reason == (
        f"{raised[:2000]}… [cut: {len(raised) - 2000} of {len(raised)} characters left out]"
    )


async def test_a_hooks_lone_surrogate_is_repaired_and_the_task_goes_on(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-SEC-1, R-HOOK-2: a hook's text is outside text, repaired where it enters — a
    rewrite's arguments (keys too), a ``Deny``'s reason, the message of what a hook raised
    — so its lone surrogate becomes U+FFFD and the task completes; a hook never ends a task
    (before: the ``tool_hook`` record could not be written and the task ended ``failed``)."""

    def rewrite(call: ToolCallBlock) -> Rewrite:
        return Rewrite({"command": "ls \ud800", "why\udfff": 1})

    def deny(call: ToolCallBlock) -> Deny:
        return Deny("no \ud800 here")

    def broken(call: ToolCallBlock, result: ToolResult) -> None:
        raise RuntimeError("bad \udc80 byte")

    outputs, _ = await run_with(host, workspace, providers, Hooks(before_tool=rewrite),
                                sh("c1", "ls"))
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.arguments == {"command": "ls \ufffd", "why\ufffd": 1}
    outputs, _ = await run_with(host, workspace, providers, Hooks(before_tool=deny),
                                sh("c1", "ls"))
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.reason == "no \ufffd here"
    (result,) = of_type(outputs, ToolCallOutput)
    assert result_text(result) == "Tool call denied by a hook: no \ufffd here"  # type: ignore[arg-type]
    outputs, _ = await run_with(host, workspace, providers, Hooks(after_tool=broken),
                                sh("c1", "ls"))
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.reason == "the hook raised RuntimeError: bad \ufffd byte"
