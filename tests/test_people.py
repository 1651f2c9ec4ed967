"""People answer when they can (R-HITL-1..5) through the Python API, with the scripted
model: a pending approval is a record that waits — parked, holding nothing — across a
close and a load, a restart of the host and a crash of it; anyone answers it from the host
whether or not the task is in memory; the tool runs exactly once; a timeout policy decides
when nobody answers; the model asks questions with ``ask_user``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import (
    RUN_TIMEOUT_S,
    collect,
    model_error,
    of_type,
    open_host,
    port_of,
    trace_lines,
)

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import Busy, NotPending
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.questions import NOBODY_TO_ASK, ask_user
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.outputs import (
    ApprovalDecision,
    ApprovalRequest,
    RequestEnd,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.people import PEOPLE, answer_problem, arguments_digest, form_content
from greenroom.protocols.tools import make_tool


class Ledger:
    """A side-effecting ``pay(amount)`` tool that records each payment it makes."""

    def __init__(self) -> None:
        self.paid: list[int] = []

        async def pay(amount: int) -> str:
            """Pay an amount."""
            self.paid.append(amount)
            return f"paid {amount}"

        self.tool = make_tool(pay, parallel=False)


def pay_then_answer() -> list[Reply]:
    return [
        Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7))),
        Reply(blocks=(text("Done."),)),
    ]


async def until_parked(host: Host, session_id: str) -> None:
    """Wait until the session's task waits for a person with no supervisor left: its
    supervisor ends when it parks (R-HITL-3), and the session's idle wait returns."""
    session = host.get_session(session_id)
    with trio.fail_after(RUN_TIMEOUT_S):
        await session.wait_idle()
    port = host.port(session_id)
    assert port.parked and port.inbox is None


async def left_parked(
    data_dir: Path,
    workspace: Path,
    ledger: Ledger,
    replies: list[Reply] | None = None,
    prompt: str = "pay",
    **settings: Any,
) -> str:
    """Run ``prompt`` with people answering in a host on ``data_dir`` until its task parks
    on a person (``replies``: the first of :func:`pay_then_answer`), then close that host,
    the request left in the trace. Returns the session id."""
    replies = pay_then_answer()[:1] if replies is None else replies
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=ScriptedProvider(replies),
                                            tools=[ledger.tool], workspace_dir=workspace,
                                            **settings)
        session.run(prompt, approve=PEOPLE).detach()
        await until_parked(host, session.id)
        return session.id


def last_result(request: ModelRequest) -> ToolResult:
    message = request.messages[-1]
    assert isinstance(message, UserMessage)
    return [part for part in message.content if isinstance(part, ToolResult)][-1]


async def test_a_call_waits_parked_for_a_person_and_runs_once_when_allowed(
    host: Host, workspace: Path
) -> None:
    """R-HITL-1..3: with approve="people" the call is recorded as a pending request and
    the task parks — no supervisor, no actors — while the run's reader keeps waiting;
    host.pending_approvals lists it with its arguments; the answer (by a named person)
    wakes the task, the tool runs once and the same stream reaches task_end."""
    ledger = Ledger()
    provider = ScriptedProvider(pay_then_answer())
    session = await host.create_session(provider=provider, tools=[ledger.tool],
                                        workspace_dir=workspace)
    stream = session.run("pay 7", approve=PEOPLE)
    await until_parked(host, session.id)

    assert session.busy and ledger.paid == []
    with pytest.raises(Busy):
        session.run("something else")
    (pending,) = await host.pending_approvals()
    assert (pending.session_id, pending.call_id, pending.tool) == (session.id, "p1", "pay")
    assert pending.arguments == {"amount": 7} and pending.kind == "approval"
    assert pending.digest == arguments_digest({"amount": 7}) and pending.asked_at
    assert pending.origin == (session.id,)

    await host.answer_approval(session.id, "p1", "allow", by="alice")
    outputs = await collect(stream)
    assert ledger.paid == [7]
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by, decision.principal) == ("allow", "client", "alice")
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    assert await host.pending_approvals() == []
    assert not session.busy


async def test_a_call_of_a_retried_attempt_wakes_its_parked_task(
    host: Host, workspace: Path
) -> None:
    """R-HITL-3, R-RETRY-4: the turn's first attempt fails and is retried; the second one
    asks for a call and the task parks. The answer wakes the task, whose turn is taken up
    at attempt 2 — it used to be refused there ("a new attempt while the current one is
    streaming"), which ended the host."""
    ledger = Ledger()
    overloaded = model_error("timeout", "overloaded (HTTP 529)")
    provider = ScriptedProvider([Reply(fail=overloaded), *pay_then_answer()])
    session = await host.create_session(provider=provider, tools=[ledger.tool],
                                        workspace_dir=workspace)
    stream = session.run("pay 7", approve=PEOPLE)
    await until_parked(host, session.id)
    (pending,) = await host.pending_approvals()
    assert pending.call_id == "p1"

    await host.answer_approval(session.id, "p1", "allow", by="alice")
    outputs = await collect(stream)
    assert ledger.paid == [7]
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["timeout", "ok", "ok"]
    assert [e.status for e in of_type(outputs, TaskEnd)] == ["completed"]
    assert provider.violations == []


async def test_a_parked_task_holds_no_task_beyond_an_idle_sessions(
    host: Host, workspace: Path
) -> None:
    """R-HITL-3: parked, a task leaves no trio task behind: the host runs as many tasks
    as it does with the session idle."""
    ledger = Ledger()
    session = await host.create_session(provider=ScriptedProvider(pay_then_answer()),
                                        tools=[ledger.tool], workspace_dir=workspace)
    await trio.testing.wait_all_tasks_blocked()
    idle = trio.lowlevel.current_statistics().tasks_living
    stream = session.run("pay", approve=PEOPLE)
    stream.detach()
    await until_parked(host, session.id)
    await trio.testing.wait_all_tasks_blocked()
    assert trio.lowlevel.current_statistics().tasks_living == idle
    await host.answer_approval(session.id, "p1", "deny")
    await session.wait_idle()


async def test_closing_a_parked_runs_stream_interrupts_it_parked_or_woken(
    host: Host, workspace: Path
) -> None:
    """RunStream.aclose interrupts its run however far it went: parked (the task wakes
    to end aborted, the call denied) and, after an answer woke it, while its tool runs
    under the supervisor that took it up — not the first supervisor's closed inbox."""
    ledger = Ledger()
    session = await host.create_session(provider=ScriptedProvider(pay_then_answer()),
                                        tools=[ledger.tool], workspace_dir=workspace)
    stream = session.run("pay", approve=PEOPLE)
    await until_parked(host, session.id)
    await stream.aclose()
    with trio.fail_after(RUN_TIMEOUT_S):
        await session.wait_idle()
    assert not session.busy and ledger.paid == []
    ends = [line for line in trace_lines(session) if line["type"] == "task_end"]
    assert [e["status"] for e in ends] == ["aborted"]

    started, release = trio.Event(), trio.Event()

    async def pay(amount: int) -> str:
        """Pay an amount."""
        started.set()
        await release.wait()
        return "paid"

    slow = await host.create_session(
        provider=ScriptedProvider(pay_then_answer()),
        tools=[make_tool(pay, parallel=False)], workspace_dir=workspace,
    )
    stream = slow.run("pay", approve=PEOPLE)
    await until_parked(host, slow.id)
    await host.answer_approval(slow.id, "p1", "allow")
    with trio.fail_after(RUN_TIMEOUT_S):
        await started.wait()
        await stream.aclose()
        await slow.wait_idle()
    assert not slow.busy
    ends = [line for line in trace_lines(slow) if line["type"] == "task_end"]
    assert [e["status"] for e in ends] == ["aborted"]


async def test_a_runs_cancel_event_set_while_it_is_parked_ends_it_when_it_wakes(
    host: Host, workspace: Path
) -> None:
    """session.run(cancel=event): no task watches the event while the run is parked
    (R-HITL-3); set by then, it ends the task as soon as an answer wakes it — aborted,
    and the allowed call never runs. The answer that woke it is refused: its task is
    ending, so nobody's allow is recorded for a call that does not run."""
    ledger = Ledger()
    session = await host.create_session(provider=ScriptedProvider(pay_then_answer()),
                                        tools=[ledger.tool], workspace_dir=workspace)
    cancel = trio.Event()
    stream = session.run("pay", approve=PEOPLE, cancel=cancel)
    await until_parked(host, session.id)
    cancel.set()
    with pytest.raises(NotPending, match="its task is ending"):
        await host.answer_approval(session.id, "p1", "allow")
    outputs = await collect(stream)
    end = of_type(outputs, TaskEnd)[-1]
    assert (end.status, end.message) == ("aborted", "cancelled by host")
    assert [d for d in of_type(outputs, ApprovalDecision) if d.by == "client"] == []
    assert ledger.paid == []


async def test_a_pending_approval_survives_close_and_load(
    host: Host, workspace: Path
) -> None:
    """R-HITL-1: closing a session whose task waits for a person does not deny the call;
    loading it asks again, and the answer runs the tool exactly once."""
    ledger = Ledger()
    session = await host.create_session(provider=ScriptedProvider(pay_then_answer()[:1]),
                                        tools=[ledger.tool], workspace_dir=workspace)
    session.run("pay", approve=PEOPLE).detach()
    await until_parked(host, session.id)
    await host.close_session(session.id)
    assert [line["type"] for line in trace_lines(session)][-1] == "approval_request"

    loaded = await host.load_session(
        session.id, tools=[ledger.tool], provider=ScriptedProvider(pay_then_answer()[1:])
    )
    assert loaded.busy
    assert [p.call_id for p in await host.pending_approvals()] == ["p1"]
    watched: list[object] = []
    loaded.subscribe(watched.extend)
    await host.answer_approval(session.id, "p1", "allow", by="bob")
    await loaded.wait_idle()
    assert ledger.paid == [7]
    lines = trace_lines(loaded)
    assert [line["type"] for line in lines].count("task_start") == 1
    assert [line["status"] for line in lines if line["type"] == "task_end"] == ["completed"]


async def test_a_pending_approval_survives_a_restart_of_the_host(
    data_dir: Path, workspace: Path
) -> None:
    """R-HITL-1, R-HITL-4: a host that closes with a task parked on a person leaves the
    request pending in the trace; the next host (resume_tasks=True) asks it again; the
    answer completes the task, the tool run once in all."""
    ledger = Ledger()
    sid = await left_parked(data_dir, workspace, ledger)

    async with Host.open(data_dir, resume_tasks=True, tools=[ledger.tool]) as host:
        (pending,) = await host.pending_approvals()
        assert pending.call_id == "p1"
        resumed = host.get_session(sid)
        assert resumed.busy
        port_of(resumed).provider = ScriptedProvider(pay_then_answer()[1:])
        await host.answer_approval(sid, "p1", "allow", digest=pending.digest)
        await resumed.wait_idle()
        assert ledger.paid == [7]
        ends = [line for line in trace_lines(resumed) if line["type"] == "task_end"]
        assert [e["status"] for e in ends] == ["completed"]


@pytest.mark.parametrize("action", ["deny", "abort"])
async def test_a_loaded_sessions_request_keeps_its_time_limit(
    data_dir: Path, workspace: Path, action: str
) -> None:
    """R-HITL-1, R-APPROVE-4: a request's ``approval_timeout_s`` counts from when it was
    asked, across a restart: the next host loads the session without taking its task up
    (no ``resume_tasks``) and the limit still decides it. The limit was applied only to a
    task taken up; a session merely loaded waited for ever. The tool never runs."""
    ledger = Ledger()
    sid = await left_parked(data_dir, workspace, ledger, approval_timeout_s=0.2,
                            approval_timeout_action=action)

    async with Host.open(data_dir, tools=[ledger.tool]) as host:
        loaded = await host.load_session(sid, provider=ScriptedProvider(pay_then_answer()[1:]))
        ended = trio.Event()
        loaded.subscribe(lambda batch: any(isinstance(o, TaskEnd) for o in batch) and ended.set())
        with trio.fail_after(RUN_TIMEOUT_S):
            await ended.wait()
            await loaded.wait_idle()
        lines = trace_lines(loaded)
    decisions = [(d["decision"], d["by"]) for d in lines if d["type"] == "approval_decision"]
    (end,) = [line for line in lines if line["type"] == "task_end"]
    if action == "deny":
        assert decisions == [("deny", "default")]
        assert end["status"] == "completed"
    else:
        assert end["status"] == "aborted" and "within 0.2 s" in end["message"]
    assert ledger.paid == []


async def test_answers_for_calls_not_pending_are_refused_clearly(
    host: Host, workspace: Path
) -> None:
    """R-HITL-2: an answer for an unknown call, with other arguments than those shown,
    or for a call already answered is refused with NotPending, and nothing changes."""
    ledger = Ledger()
    session = await host.create_session(provider=ScriptedProvider(pay_then_answer()),
                                        tools=[ledger.tool], workspace_dir=workspace)
    stream = session.run("pay", approve=PEOPLE)
    await until_parked(host, session.id)
    with pytest.raises(NotPending, match="waits for no answer"):
        await host.answer_approval(session.id, "nope", "allow")
    with pytest.raises(NotPending, match="other arguments"):
        await host.answer_approval(session.id, "p1", "allow",
                                   digest=arguments_digest({"amount": 700}))
    with pytest.raises(NotPending, match="asks for a decision"):
        await host.answer_question(session.id, "p1", "yes")
    assert ledger.paid == [] and session.busy
    await host.answer_approval(session.id, "p1", "deny")
    with pytest.raises(NotPending):
        await host.answer_approval(session.id, "p1", "allow")
    outputs = await collect(stream)
    assert [o.status for o in of_type(outputs, ToolCallOutput)] == ["denied"]
    assert ledger.paid == []


@pytest.mark.parametrize("action", ["deny", "abort"])
async def test_the_timeout_policy_decides_when_nobody_answers(
    host: Host, workspace: Path, action: str
) -> None:
    """R-HITL-1, R-APPROVE-4: with approval_timeout_s a parked request ends when its
    time runs out: ``deny`` denies it by default and the task goes on, ``abort``
    interrupts the task; the tool never runs. (Real time: the wait is the product's own,
    and a mock clock would jump it while the trace's fsync thread works.)"""
    ledger = Ledger()
    session = await host.create_session(
        provider=ScriptedProvider(pay_then_answer()), tools=[ledger.tool],
        workspace_dir=workspace, approval_timeout_s=0.2, approval_timeout_action=action,
    )
    start = trio.current_time()
    outputs = await collect(session.run("pay", approve=PEOPLE))
    assert trio.current_time() - start >= 0.2
    end = of_type(outputs, TaskEnd)[-1]
    if action == "deny":
        (decision,) = of_type(outputs, ApprovalDecision)
        assert (decision.decision, decision.by) == ("deny", "default")
        assert end.status == "completed"
    else:
        assert end.status == "aborted" and "within 0.2 s" in (end.message or "")
    assert ledger.paid == []


async def test_the_model_asks_the_person_a_question(host: Host, workspace: Path) -> None:
    """R-HITL-5: ask_user is a durable question (approval_request kind question); the
    person's text is the call's result; an answer outside the choices is refused."""
    provider = ScriptedProvider(
        [
            Reply(blocks=(tool_call("q1", "ask_user", question="Which color?",
                                    choices=["red", "blue"]),)),
            Reply(blocks=(text("Blue it is."),)),
        ]
    )
    session = await host.create_session(provider=provider, tools=[ask_user],
                                        workspace_dir=workspace)
    stream = session.run("paint it", approve=PEOPLE)
    await until_parked(host, session.id)
    (pending,) = await host.pending_approvals()
    assert pending.kind == "question" and pending.arguments["question"] == "Which color?"
    with pytest.raises(NotPending, match="choose one of"):
        await host.answer_question(session.id, "q1", "green")
    await host.answer_question(session.id, "q1", "blue", by="carol")
    outputs = await collect(stream)
    (request,) = of_type(outputs, ApprovalRequest)
    assert request.kind == "question"
    (result,) = of_type(outputs, ToolCallOutput)
    assert (result.status, result.content) == ("ok", (TextBlock(text="blue"),))
    assert last_result(provider.requests[-1]).content == (TextBlock(text="blue"),)
    assert of_type(outputs, TaskEnd)[-1].status == "completed"


async def test_without_people_ask_user_tells_the_model_nobody_answers(
    host: Host, workspace: Path
) -> None:
    provider = ScriptedProvider(
        [Reply(blocks=(tool_call("q1", "ask_user", question="?"),)), Reply(blocks=(text("k"),))]
    )
    session = await host.create_session(provider=provider, tools=[ask_user],
                                        workspace_dir=workspace)
    outputs = await collect(session.run("go", approve=lambda call: "allow"))
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.content == (TextBlock(text=NOBODY_TO_ASK),)


class TerminalLike:
    """An approve callback that can also answer the model's questions, as a terminal
    does: it allows every call and answers each question with ``answer``."""

    def __init__(self, answer: str | None) -> None:
        self.answer = answer
        self.asked: list[str] = []

    def __call__(self, call: object) -> str:
        return "allow"

    async def answer_question(self, call: ToolCallBlock) -> str | None:
        self.asked.append(call.arguments["question"])
        return self.answer


@pytest.mark.parametrize(
    ("answer", "result", "by"),
    [("blue", "blue", "client"), (None, markers.NO_ANSWER_TEXT, "default"),
     ("green", markers.NO_ANSWER_TEXT, "default")],
)
async def test_a_callback_that_answers_questions_answers_ask_user(
    host: Host, workspace: Path, answer: str | None, result: str, by: str
) -> None:
    """R-HITL-5: with a callback that has ``answer_question`` (chat, run on a terminal)
    the question is recorded as a request of kind question and the callback's answer is
    the call's result; no answer, or one outside the choices, is the default's."""
    provider = ScriptedProvider(
        [
            Reply(blocks=(tool_call("q1", "ask_user", question="Which color?",
                                    choices=["red", "blue"]),)),
            Reply(blocks=(text("Noted."),)),
        ]
    )
    session = await host.create_session(provider=provider, tools=[ask_user],
                                        workspace_dir=workspace)
    terminal = TerminalLike(answer)
    outputs = await collect(session.run("paint it", approve=terminal))
    assert terminal.asked == ["Which color?"]
    (request,) = of_type(outputs, ApprovalRequest)
    assert (request.kind, request.call_id) == ("question", "q1")
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("allow", by)
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.content == (TextBlock(text=result),)
    assert last_result(provider.requests[-1]).content == (TextBlock(text=result),)
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    assert await host.pending_approvals() == []


CRASHING_HOST = textwrap.dedent(
    """
    import sys, trio
    from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
    from greenroom.actors.runtime.host import Host
    from greenroom.protocols.tools import make_tool

    data_dir, workspace, marks = sys.argv[1:4]

    async def pay(amount: int) -> str:
        \"\"\"Pay an amount.\"\"\"
        with open(marks, "a") as handle:
            handle.write(f"{amount}\\n")
        print("paying", flush=True)
        await trio.sleep_forever()  # the host is killed while the call runs
        return "never"

    async def main():
        async with Host.open(data_dir) as host:
            session = await host.create_session(
                provider=ScriptedProvider(
                    [Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7)))]
                ),
                tools=[make_tool(pay, parallel=False)], workspace_dir=workspace,
            )
            print(session.id, flush=True)
            await session.run("pay", approve=lambda call: "allow").collect()

    trio.run(main)
    """
)


async def test_a_killed_hosts_task_resumes_without_running_its_call_again(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-HITL-4, R-CLUSTER-2, R-EFFECT-2: a host SIGKILLed while a side-effecting call
    runs leaves the task open in its trace; the next host resumes that same task. The
    call is in doubt, and with no check and nobody to ask (the host decides by callback)
    it gets its host-lost result and is not run again; the model is told ([host lost])
    and answers, and the trace holds one task_start and one task_end."""
    marks = tmp_path / "marks"
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_HOST)
    process = await trio.lowlevel.open_process(
        [sys.executable, str(script), str(data_dir), str(workspace), str(marks)],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        lines = b""
        with trio.fail_after(RUN_TIMEOUT_S):
            while b"paying" not in lines:  # the session id, then the call's start
                lines += await process.stdout.receive_some()
        sid = lines.split()[0].decode()
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()

    again = ScriptedProvider([Reply(blocks=(text("The payment may not have gone through."),))])
    async with open_host(data_dir) as host:
        session = await host.resume(
            sid, provider=again, tools=[Ledger().tool], approve=lambda call: "allow"
        )
        await session.wait_idle()
        lines = trace_lines(session)
    assert marks.read_text() == "7\n"  # run once, before the kill; never again
    types = [line["type"] for line in lines]
    assert types.count("task_start") == 1 and types.count("task_end") == 1
    (doubt,) = [line for line in lines if line["type"] == "call_in_doubt"]
    (resolved,) = [line for line in lines if line["type"] == "call_resolved"]
    assert doubt["call_id"] == resolved["call_id"] == "p1"
    assert (resolved["by"], resolved["outcome"]) == ("note", "unknown")
    (lost,) = [line for line in lines if line["type"] == "tool_call_output"]
    assert lost["status"] == "interrupted" and "was not run again" in lost["content"][0]["text"]
    steering = [line for line in lines if line["type"] == "user_msg" and line["kind"] == "steering"]
    assert "[host lost]" in steering[0]["content"][0]["text"]
    assert lines[-1]["status"] == "completed"
    (request,) = again.requests
    assert "was not run again" in last_result(request).content[0].text  # type: ignore[union-attr]


ASKING_HOST = textwrap.dedent(
    """
    import sys, trio
    from greenroom.actors.providers.scripted import Reply, ScriptedProvider, tool_call
    from greenroom.actors.runtime.host import Host
    from greenroom.protocols.people import PEOPLE
    from greenroom.protocols.tools import tool

    data_dir, workspace = sys.argv[1:3]

    @tool(parallel=False, name="confirm")
    async def confirm(ctx) -> str:
        \"\"\"Ask the person to confirm, while the call runs.\"\"\"
        answer = await ctx.ask({"question": "Really?"})
        return answer.action

    def on_batch(batch):
        for out in batch:  # published once written: the question is in the trace
            if out.TYPE == "approval_request" and out.kind == "question":
                print("asked", flush=True)

    async def main():
        async with Host.open(data_dir) as host:
            session = await host.create_session(
                provider=ScriptedProvider([Reply(blocks=(tool_call("c1", "confirm"),))]),
                tools=[confirm], workspace_dir=workspace,
            )
            print(session.id, flush=True)
            session.subscribe(on_batch)
            session.run("go", approve=PEOPLE).detach()
            await session.wait_idle()  # parked on the call's approval
            await host.answer_approval(session.id, "c1", "allow")
            await trio.sleep_forever()  # killed while the call's question waits

    trio.run(main)
    """
)


async def test_a_running_calls_question_goes_with_its_host(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-HITL-5, R-HITL-4: a question a running call asks (ctx.ask: an MCP elicitation)
    is recorded, but it lasts only as long as its call, and a call cannot outlive its
    host: after a SIGKILL the next host lists no question to answer (the session is not
    parked on it), and resuming settles the call as lost — not run again — and the
    question with it."""
    script = tmp_path / "ask.py"
    script.write_text(ASKING_HOST)
    process = await trio.lowlevel.open_process(
        [sys.executable, str(script), str(data_dir), str(workspace)], stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        lines = b""
        with trio.fail_after(RUN_TIMEOUT_S):
            while b"asked" not in lines:
                lines += await process.stdout.receive_some()
        sid = lines.split()[0].decode()
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()

    again = ScriptedProvider([Reply(blocks=(text("It may not have been confirmed."),))])
    async with open_host(data_dir) as host:
        assert await host.pending_approvals() == []
        loaded = host.get_session(sid)
        assert not host.port(sid).parked
        with pytest.raises(NotPending):
            await host.answer_question(sid, "c1", "yes")
        session = await host.resume(sid, provider=again, tools=[])
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        assert session is loaded and await host.pending_approvals() == []
        lines = trace_lines(session)
    types = [line["type"] for line in lines]
    assert types.count("approval_request") == 2 and types.count("task_end") == 1
    (lost,) = [line for line in lines if line["type"] == "tool_call_output"]
    assert lost["status"] == "interrupted" and "was not run again" in lost["content"][0]["text"]
    assert lines[-1]["status"] == "completed"


SIZE_FORM = {
    "type": "object",
    "properties": {
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "quantity": {"type": "integer", "minimum": 1},
    },
    "required": ["size"],
}


@pytest.mark.parametrize(
    ("schema", "text", "expected"),
    [
        (SIZE_FORM, '{"size": "M", "quantity": 2}', {"size": "M", "quantity": 2}),
        (SIZE_FORM, '{"size": "M"}', {"size": "M"}),
        (SIZE_FORM, "M", "answer with a JSON object of the fields ['quantity', 'size']"),
        (SIZE_FORM, '{"quantity": 2}', "size is required"),
        (SIZE_FORM, '{"size": "XL"}', "size: choose one of ['S', 'M', 'L']"),
        (SIZE_FORM, '{"size": "M", "quantity": 0}', "quantity: at least 1"),
        (SIZE_FORM, '{"size": "M", "colour": "red"}', "colour is not a field of the form"),
        ({"properties": {"n": {"type": "integer"}}}, " 3 ", {"n": 3}),
        ({"properties": {"n": {"type": "integer"}}}, "3.5", "n: answer with a whole number"),
        ({"properties": {"ok": {"type": "boolean"}}}, "Yes", {"ok": True}),
        ({"properties": {"ok": {"type": "boolean"}}}, "maybe", "ok: answer yes or no"),
        ({"properties": {"why": {"type": "string"}}}, "because", {"why": "because"}),
        ({"type": "object", "properties": {}}, "fine", {}),
    ],
)
def test_an_answer_is_checked_against_the_form_a_question_asks_for(
    schema: dict[str, object], text: str, expected: object
) -> None:
    """R-HITL-5: an elicitation's answer is a JSON object of the requested schema's fields
    (or one field's value written plainly); what does not fit says why."""
    content = form_content(schema, text)
    if isinstance(expected, str):
        assert isinstance(content, str) and content.startswith(expected)
        assert answer_problem({"requested_schema": schema}, text) == content
    else:
        assert content == expected
        assert answer_problem({"requested_schema": schema}, text) is None


def test_a_calls_earlier_request_running_out_does_not_expire_its_later_one() -> None:
    """R-HITL-1: one call can be asked about twice — its approval, then (running) a
    question. The approval's deadline, which ran on after it was answered, expired the
    question (cancelled, or the task aborted) long before the question's own time."""
    from types import SimpleNamespace

    from greenroom.actors.runtime.people import People
    from greenroom.actors.runtime.people_desk import WatchRequest

    question = SimpleNamespace(call_id="c1", tool="confirm", asked_at=1_000_010.0)
    delivered: list[object] = []
    port = SimpleNamespace(
        machine=SimpleNamespace(record=SimpleNamespace(pending=lambda call_id: question)),
        settings=SimpleNamespace(approval_timeout_action="deny", approval_timeout_s=1.0),
        deliver=delivered.append,
    )
    people = People(lambda session_id: port)  # type: ignore[arg-type, return-value]
    approval_ran_out = WatchRequest(
        session_id="s1", call_id="c1", deadline=1.0, asked_at=1_000_000.0
    )
    people._expire(approval_ran_out)
    assert delivered == []
    question_ran_out = WatchRequest(
        session_id="s1", call_id="c1", deadline=11.0, asked_at=1_000_010.0
    )
    people._expire(question_ran_out)
    assert [(m.call_id, m.by) for m in delivered] == [("c1", "default")]  # type: ignore[attr-defined]


async def test_a_request_watched_twice_expires_once_at_its_earliest_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A session loaded and then taken up watches its requests twice (the load, then the
    task's take-up): the desk expires each once, at the earliest deadline; both expiring
    together resolved the request twice. A request asked again (another ``asked_at``) has
    a wait of its own."""
    from greenroom.actors.runtime.people_desk import PeopleDesk, WatchRequest

    expired: list[tuple[str, float | None, float]] = []
    desk = PeopleDesk(lambda r: expired.append((r.call_id, r.asked_at, trio.current_time())))
    send, inbox = trio.open_memory_channel[WatchRequest](10)
    async with trio.open_nursery() as nursery:
        await nursery.start(desk.run, inbox)
        for deadline in (5.0, 5.0, 3.0, 8.0):
            send.send_nowait(WatchRequest(session_id="s", call_id="c1", deadline=deadline,
                                          asked_at=100.0))
        send.send_nowait(WatchRequest(session_id="s", call_id="c1", deadline=4.0, asked_at=200.0))
        await trio.sleep_until(10.0)
        send.close()
    assert expired == [("c1", 100.0, 3.0), ("c1", 200.0, 4.0)]


class AllowingHost:
    """A host's ``approve`` callback (``Host.open(approve=…)``, ``serve --approve all``)
    that allows every call and notes the ids of those it was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, call: ToolCallBlock) -> str:
        self.asked.append(call.id)
        return "allow"


async def test_a_request_taken_up_under_a_callback_parks_and_survives_a_close(
    data_dir: Path, workspace: Path
) -> None:
    """R-HITL-1, R-HITL-3, R-HITL-4: a request pending when a host whose ``approve`` is a
    callback takes its task up waits on for a person, so the task waits only for people
    and parks. It did not: it kept its supervisor and actors, and closing the session
    aborted it, denying the call by default. The request stays pending across the close;
    answered once the session is loaded again, the tool runs once and the task
    completes. The callback is asked about nothing."""
    import json

    ledger = Ledger()
    sid = await left_parked(data_dir, workspace, ledger)

    approve = AllowingHost()
    async with Host.open(data_dir, tools=[ledger.tool], approve=approve,
                         resume_tasks=True) as host:
        await until_parked(host, sid)
        trace = host.get_session(sid).trace_path
        await host.close_session(sid)
        # Nothing recorded by the close: no decision, no abort, no task_end.
        assert json.loads(trace.read_text().splitlines()[-1])["type"] == "approval_request"
        loaded = await host.load_session(sid, provider=ScriptedProvider(pay_then_answer()[1:]))
        (pending,) = await host.pending_approvals()
        assert pending.call_id == "p1"
        await host.answer_approval(sid, "p1", "allow", by="alice", digest=pending.digest)
        with trio.fail_after(RUN_TIMEOUT_S):
            await loaded.wait_idle()
        lines = trace_lines(loaded)
    assert ledger.paid == [7] and approve.asked == []
    decisions = [(d["call_id"], d["decision"], d["by"])
                 for d in lines if d["type"] == "approval_decision"]
    assert decisions == [("p1", "allow", "client")]
    assert [e["status"] for e in lines if e["type"] == "task_end"] == ["completed"]


async def test_a_request_taken_up_under_a_callback_parks_and_the_callback_decides_the_rest(
    data_dir: Path, workspace: Path
) -> None:
    """R-HITL-3, R-HITL-4, R-APPROVE-2: a task taken up under a callback parks on the
    request a person has (from its first host, under ``"people"``) with the turn's next
    call waiting behind it; the person's answer wakes it, and the callback decides that
    next call (``by: host``), which runs — each call once."""
    ledger = Ledger()
    two_payments = Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7),
                                 tool_call("p2", "pay", amount=8)))
    sid = await left_parked(data_dir, workspace, ledger, [two_payments], "pay twice")

    approve = AllowingHost()
    async with Host.open(data_dir, tools=[ledger.tool], approve=approve,
                         resume_tasks=True) as host:
        await until_parked(host, sid)
        assert approve.asked == [] and ledger.paid == []
        resumed = host.get_session(sid)
        port_of(resumed).provider = ScriptedProvider([Reply(blocks=(text("Done."),))])
        (pending,) = await host.pending_approvals()
        await host.answer_approval(sid, "p1", "allow", digest=pending.digest)
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        lines = trace_lines(resumed)
    assert ledger.paid == [7, 8] and approve.asked == ["p2"]
    decisions = [(d["call_id"], d["decision"], d["by"])
                 for d in lines if d["type"] == "approval_decision"]
    assert decisions == [("p1", "allow", "client"), ("p2", "allow", "host")]
    assert [e["status"] for e in lines if e["type"] == "task_end"] == ["completed"]


async def test_a_second_host_on_the_data_dir_cannot_answer_a_session_another_has_open(
    data_dir: Path, workspace: Path
) -> None:
    """R-TRACE-1, R-HITL-2: host A has the session open, parked on a payment's approval;
    host B on the same data dir (``greenroom approve`` while a server runs, say) loaded it
    too and answered: the payment ran in B, A still listed the request and took a second
    answer, the payment ran again, and the trace held each seq twice. A session's trace
    has one writer: B is refused (``SessionOpenElsewhere``, a ``Busy``) and changes
    nothing; once A closes the session, B answers it and the payment runs once."""
    from greenroom.actors.runtime.errors import SessionOpenElsewhere

    ledger = Ledger()
    async with open_host(data_dir) as a:
        session = await a.create_session(provider=ScriptedProvider(pay_then_answer()[:1]),
                                          tools=[ledger.tool], workspace_dir=workspace)
        session.run("pay", approve=PEOPLE).detach()
        await until_parked(a, session.id)
        before = session.trace_path.read_bytes()
        async with open_host(data_dir) as b:
            with pytest.raises(SessionOpenElsewhere, match="open in another host"):
                await b.answer_approval(session.id, "p1", "allow", by="bob", tools=[ledger.tool])
            with pytest.raises(SessionOpenElsewhere):
                await b.load_session(session.id, tools=[ledger.tool])
            assert session.trace_path.read_bytes() == before and ledger.paid == []
            await a.close_session(session.id)
            await b.answer_approval(session.id, "p1", "allow", by="bob", tools=[ledger.tool],
                                    provider=ScriptedProvider(pay_then_answer()[1:]))
            answered = b.get_session(session.id)
            with trio.fail_after(RUN_TIMEOUT_S):
                await answered.wait_idle()
            lines = trace_lines(answered)
    assert ledger.paid == [7]
    seqs = [line["seq"] for line in lines]
    assert seqs == list(range(1, len(seqs) + 1))
