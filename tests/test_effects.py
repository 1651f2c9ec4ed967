"""Exactly-once effects (R-EFFECT-1..3): every call has an idempotency key of its own that
no restart changes, and a call whose host was lost is resolved — by the tool's check, by a
person, or by the note — with one record saying how.

A crash is a SIGKILL of a host process where the key's stability across processes is the
point; elsewhere it is the copy of a session's files taken while its call runs, loaded in
a second host (as ``tests/test_recovery.py`` does). The tool is a payment service that
pays at most once per key and finds a payment by its key.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, open_host, port_of, trace_lines
from test_people import last_result
from test_recovery import copy_session

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import NotPending
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ToolResult
from greenroom.protocols.effects import (
    IN_DOUBT_CHOICES,
    first_resolver,
    idempotency_key,
    outcome_of_answer,
)
from greenroom.protocols.hooks import Hooks, Rewrite
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool, ToolContext, ToolDefinitionError, make_tool

PAY = [Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7)))]
"""The first host's model: one payment."""


class Payments:
    """A payment service: ``pay`` pays at most once per idempotency key (the call's), and
    ``find`` looks a payment up by its key. ``runs`` are the keys ``pay`` ran with,
    ``asked`` those ``find`` was asked about. ``check`` replaces ``find`` as the tool's
    check (None: the tool has none)."""

    def __init__(self, check: Any = "find", *, timeout_s: float | None = None) -> None:
        self.made: dict[str, int] = {}
        self.runs: list[str] = []
        self.asked: list[str] = []

        async def pay(amount: int, ctx: ToolContext) -> str:
            """Pay an amount."""
            self.runs.append(ctx.idempotency_key)
            self.made.setdefault(ctx.idempotency_key, amount)
            return f"paid {amount}"

        async def find(key: str) -> str | None:
            self.asked.append(key)
            return f"paid {self.made[key]}" if key in self.made else None

        self.tool = make_tool(
            pay,
            parallel=False,
            timeout_s=timeout_s,
            check=find if check == "find" else check,
        )


def of(lines: list[dict[str, Any]], type_name: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["type"] == type_name]


def call_key(session_id: str, lines: list[dict[str, Any]], call_id: str) -> str:
    """The key the trace gives call ``call_id`` (the last model_msg that holds it)."""
    (seq,) = [
        line["seq"]
        for line in lines
        if line["type"] == "model_msg" and line["block"].get("id") == call_id
    ][-1:]
    return idempotency_key(session_id, seq, call_id)


async def crash_mid_call(
    host: Host, workspace: Path, tmp_path: Path, providers: Any, hooks: Hooks | None = None
) -> tuple[str, Path, str]:
    """Run a payment in ``host`` (with the session's ``hooks``) whose call never ends, and
    take a copy of the session's files once the call runs — the host as a crash leaves it.
    Returns the session id, the data dir of the copy and the key the call ran with."""
    started = trio.Event()
    keys: list[str] = []

    async def pay(amount: int, ctx: ToolContext) -> str:
        """Pay an amount."""
        keys.append(ctx.idempotency_key)
        started.set()
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    session = await host.create_session(
        provider=providers(PAY), tools=[make_tool(pay, parallel=False)], workspace_dir=workspace,
        hooks=hooks,
    )
    session.run("pay 7", approve=allow_all)
    with trio.fail_after(RUN_TIMEOUT_S):
        await started.wait()
    await port_of(session).sync_trace()
    copy_session(session, tmp_path / "crashed")
    return session.id, tmp_path / "crashed", keys[0]


async def take_up(
    host: Host, sid: str, provider: ScriptedProvider, tool: Tool, approve: Any
) -> Session:
    """Resume the crashed task in ``host`` and wait until it ends or waits for people."""
    session = await host.resume(sid, provider=provider, tools=[tool], approve=approve)
    with trio.fail_after(RUN_TIMEOUT_S):
        await session.wait_idle()
    return session


def resolved_by_the_note(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The one ``call_resolved`` record of ``lines``, which says the note resolved it."""
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("note", "unknown")
    return resolved


def assert_noted_and_aborted(lines: list[dict[str, Any]]) -> None:
    """The one call's result is the note of a lost host, and the task ended aborted."""
    (result,) = of(lines, "tool_call_output")
    assert result["content"][0]["text"] == markers.HOST_LOST_TEXT
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "aborted"


async def take_up_interrupted_in_check(
    crashed: Path, sid: str, providers: Any, then: Callable[[], None]
) -> tuple[Payments, list[dict[str, Any]]]:
    """Take session ``sid``'s crashed task up in a host on ``crashed``; the check of its
    call in doubt interrupts the task, as the user would meanwhile, then does ``then()``
    (returns: no payment found; raises: the check fails). The payments and the trace."""
    opened: dict[str, Host] = {}

    async def find(asked: str) -> None:
        payments.asked.append(asked)
        opened["host"].get_session(sid).interrupt()  # the user interrupts meanwhile
        then()

    payments = Payments(check=find)
    async with open_host(crashed) as second:
        opened["host"] = second
        session = await take_up(second, sid, providers([]), payments.tool, allow_all)
        lines = trace_lines(session)
    return payments, lines


# -- the key (R-EFFECT-1) -------------------------------------------------------------------


def test_a_key_is_derived_from_trace_facts_alone() -> None:
    """R-EFFECT-1: the same facts give the same key; another session, seq or call id gives
    another; keys are short and plain whatever the call id holds."""
    key = idempotency_key("s1", 4, "toolu_1")
    assert key == idempotency_key("s1", 4, "toolu_1")
    others = {idempotency_key("s2", 4, "toolu_1"), idempotency_key("s1", 9, "toolu_1"),
              idempotency_key("s1", 4, "toolu_2")}  # fmt: skip
    assert key not in others and len(others) == 3
    odd = idempotency_key("s1", 4, "id with spaces/ü" * 40)
    for value in (key, odd):
        assert value.startswith("gr-") and len(value) == 35
        assert all(c in "0123456789abcdef" for c in value[3:])


async def test_every_call_has_a_key_of_its_own(
    host: Host, workspace: Path, providers: Any
) -> None:
    """R-EFFECT-1: two calls of one turn, a call of a later turn that repeats an id (as
    some models do) and the same calls in another session all get different keys; each is
    the one the trace gives the call, and the header helper carries it."""
    seen: list[tuple[str, str]] = []

    async def note(ctx: ToolContext) -> str:
        """Note the call's key."""
        assert ctx.idempotency_headers() == {"Idempotency-Key": ctx.idempotency_key}
        seen.append((ctx.call_id, ctx.idempotency_key))
        return "noted"

    script = [
        Reply(blocks=(tool_call("c1", "note"), tool_call("c2", "note"))),
        Reply(blocks=(tool_call("c1", "note"),)),
        Reply(blocks=(text("Done."),)),
    ]
    keys: list[str] = []
    for _ in range(2):
        session = await host.create_session(
            provider=providers(script), tools=[make_tool(note, parallel=True)],
            workspace_dir=workspace,
        )  # fmt: skip
        seen.clear()
        await collect(session.run("note", approve=allow_all))
        lines = trace_lines(session)
        calls = [line for line in of(lines, "model_msg") if line["block"]["type"] == "tool_call"]
        expected = [idempotency_key(session.id, c["seq"], c["block"]["id"]) for c in calls]
        assert sorted(k for _, k in seen) == sorted(expected)
        assert [c for c, _ in seen].count("c1") == 2
        keys += expected
    assert len(set(keys)) == 6


CRASHING_HOST = textwrap.dedent(
    """
    import sys, trio
    from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
    from greenroom.actors.runtime.host import Host
    from greenroom.protocols.tools import make_tool

    data_dir, workspace, marks = sys.argv[1:4]

    async def pay(amount: int, ctx) -> str:
        \"\"\"Pay an amount.\"\"\"
        with open(marks, "a") as handle:
            handle.write(ctx.idempotency_key + "\\n")
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


async def test_a_killed_hosts_call_keeps_its_key_and_runs_once_more_when_not_done(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-EFFECT-1, R-EFFECT-2: a host SIGKILLed in the middle of a payment; the next host
    finds the call in doubt, asks the tool's check by the call's key — the key the killed
    host ran it with — and the check finds no payment: the call runs once more, with that
    same key, and the task ends. The records say so, in order."""
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
            while b"paying" not in lines:
                lines += await process.stdout.receive_some()
        sid = lines.split()[0].decode()
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    (first_key,) = marks.read_text().split()

    payments = Payments()
    again = ScriptedProvider([Reply(blocks=(text("Paid."),))])
    async with open_host(data_dir) as host:
        session = await take_up(host, sid, again, payments.tool, allow_all)
        lines = trace_lines(session)
    assert payments.asked == payments.runs == [first_key]
    assert first_key == call_key(sid, lines, "p1")
    (doubt,) = of(lines, "call_in_doubt")
    assert doubt["idempotency_key"] == first_key
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("check", "rerun")
    (result,) = of(lines, "tool_call_output")
    assert (result["status"], result["content"][0]["text"]) == ("ok", "paid 7")
    order = [line["type"] for line in lines]
    assert order.index("call_in_doubt") < order.index("call_resolved") < order.index(
        "tool_call_output"
    )
    assert order.count("task_start") == order.count("task_end") == 1
    assert lines[-1]["status"] == "completed"
    assert last_result(again.requests[0]).content[0].text == "paid 7"  # type: ignore[union-attr]


# -- the check (R-EFFECT-2) -------------------------------------------------------------------


@pytest.mark.parametrize("found", ["text", "error result"])
async def test_a_check_that_finds_the_effect_is_the_calls_result(
    host: Host, workspace: Path, tmp_path: Path, providers: Any, found: str
) -> None:
    """R-EFFECT-2: the check finds the payment by the call's key: what it reports is the
    call's result (an error result stays an error), marked as found by the check; the
    tool does not run again."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)
    payments = Payments()
    if found == "text":
        payments.made[key] = 7
    else:

        async def failed(asked: str) -> ToolResult:
            payments.asked.append(asked)
            return ToolResult(call_id="", tool="pay", status="error", is_error=True,
                              content=(TextBlock(text="card declined"),))  # fmt: skip

        payments = Payments(check=failed)
    after = providers([Reply(blocks=(text("Noted."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, allow_all)
        lines = trace_lines(session)
    assert payments.asked == [key] and payments.runs == []
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("check", "done")
    (result,) = of(lines, "tool_call_output")
    texts = [block["text"] for block in result["content"]]
    assert texts[0] == markers.IN_DOUBT_FOUND_TEXT
    if found == "text":
        assert (result["status"], texts[1]) == ("ok", "paid 7")
    else:
        assert (result["status"], texts[1]) == ("error", "card declined")
    seen = last_result(after.requests[0])
    assert markers.IN_DOUBT_FOUND_TEXT in seen.content[0].text  # type: ignore[union-attr]
    assert lines[-1]["status"] == "completed"


async def test_a_check_that_raises_leaves_the_note_where_nobody_is_asked(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2: a check that raises answers nothing: with nobody to ask (the host
    decides by callback) the model gets the host-lost note, the call does not run again,
    and the record says why the check did not decide."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)

    asked: list[str] = []

    async def broken(key: str) -> str:
        asked.append(key)
        raise ConnectionError("the payment service is down")

    payments = Payments(check=broken)
    after = providers([Reply(blocks=(text("It may not have gone through."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, allow_all)
        lines = trace_lines(session)
    assert asked == [key] and payments.runs == []
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("note", "unknown")
    assert "ConnectionError: the payment service is down" in resolved["check_error"]
    (result,) = of(lines, "tool_call_output")
    assert result["status"] == "interrupted"
    assert result["content"][0]["text"] == markers.HOST_LOST_TEXT
    assert lines[-1]["status"] == "completed"


async def test_a_checks_long_failure_is_cut_where_it_is_recorded(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-SEC-9: what a failed check raised is recorded (``call_resolved``'s
    ``check_error``, a person's question): a message of 500 KB is cut to its first 2,000
    characters and a note of how many were left out (before: whole, past what one record
    of a cluster's trace carries)."""
    sid, crashed, _ = await crash_mid_call(host, workspace, tmp_path, providers)
    long = "down " * 100_000

    async def broken(key: str) -> str:
        raise ConnectionError(long)

    payments = Payments(check=broken)
    after = providers([Reply(blocks=(text("It may not have gone through."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, allow_all)
        lines = trace_lines(session)
    (resolved,) = of(lines, "call_resolved")
    error = f"the check raised ConnectionError: {long}"
    assert resolved["check_error"] == (
        f"{error[:2000]}… [cut: {len(error) - 2000} of {len(error)} characters left out]"
    )
    assert lines[-1]["status"] == "completed"


async def test_a_check_that_hangs_passes_the_call_to_a_person(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-HITL-1: a check that does not answer within its bound (the tool's
    0.2 s timeout here: real time, the product's own wait) falls through to a person, whose
    question says why; "not done" leaves the call not run."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)

    asked: list[str] = []

    async def hangs(key: str) -> str:
        asked.append(key)
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    payments = Payments(check=hangs, timeout_s=0.2)
    after = providers([Reply(blocks=(text("Not paid, then."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, PEOPLE)
        assert asked == [key]
        (pending,) = await second.pending_approvals()
        assert (pending.kind, pending.call_id) == ("in_doubt", "p1")
        assert pending.arguments["check_error"] == "the check gave no answer within 0.2 s"
        await second.answer_question(sid, "p1", "not done", "ana")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert payments.runs == []
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"], resolved["principal"]) == (
        "person", "not_done", "ana"
    )
    assert resolved["check_error"] == "the check gave no answer within 0.2 s"
    (result,) = of(lines, "tool_call_output")
    assert (result["status"], result["content"][0]["text"]) == (
        "interrupted", markers.IN_DOUBT_NOT_DONE_TEXT
    )


# -- a person (R-EFFECT-2, R-HITL) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "outcome", "status", "runs"),
    [
        ("done", "done", "ok", 0),
        ("not done", "not_done", "interrupted", 0),
        ("Run again", "rerun", "ok", 1),
    ],
)
async def test_a_person_says_what_became_of_a_call_in_doubt(
    host: Host, workspace: Path, tmp_path: Path, providers: Any,
    answer: str, outcome: str, status: str, runs: int,
) -> None:  # fmt: skip
    """R-EFFECT-2, R-HITL-1..3: without a check, where people answer the task's requests,
    the call in doubt is a durable question (kind in_doubt, the choices, the call's
    arguments and key); the task waits parked. An answer outside the choices, or a
    decision, is refused; each choice resolves the call as it says, recorded with who
    answered; "run again" runs it once, with its key."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)
    payments = Payments(check=None)
    after = providers([Reply(blocks=(text("Noted."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, PEOPLE)
        assert second.port(sid).parked and after.requests == []
        (pending,) = await second.pending_approvals()
        assert pending.kind == "in_doubt"
        assert pending.arguments["choices"] == list(IN_DOUBT_CHOICES)
        assert pending.arguments["arguments"] == {"amount": 7}
        assert pending.arguments["idempotency_key"] == key
        assert "pay" in pending.arguments["question"]
        with pytest.raises(NotPending, match="done, not done, run again"):
            await second.answer_question(sid, "p1", "maybe")
        with pytest.raises(NotPending, match="done, not done, run again"):
            await second.answer_approval(sid, "p1", "allow")
        await second.answer_question(sid, "p1", answer, "ana")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
        assert await second.pending_approvals() == []
    assert payments.runs == [key] * runs
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"], resolved["principal"]) == (
        "person", outcome, "ana"
    )
    (result,) = of(lines, "tool_call_output")
    assert result["status"] == status
    if outcome == "done":
        assert result["content"][0]["text"] == markers.IN_DOUBT_DONE_TEXT
    elif outcome == "rerun":
        assert result["content"][0]["text"] == "paid 7"
    assert len(of(lines, "approval_request")) == 1 and len(of(lines, "call_in_doubt")) == 1
    assert lines[-1]["status"] == "completed"


async def test_a_question_about_a_call_in_doubt_survives_a_restart(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-HITL-1: the host that asked stops; the next one lists the question
    (it is not asked again, nor the call checked or run), and its answer runs the call
    once, with its key."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)
    async with open_host(crashed) as second:
        await take_up(second, sid, providers([]), Payments(check=None).tool, PEOPLE)
        assert [p.kind for p in await second.pending_approvals()] == ["in_doubt"]
    payments = Payments(check=None)
    after = providers([Reply(blocks=(text("Paid."),))])
    async with open_host(crashed) as third:
        session = await third.load_session(sid, provider=after, tools=[payments.tool])
        assert third.port(sid).parked
        (pending,) = await third.pending_approvals()
        assert (pending.call_id, pending.kind) == ("p1", "in_doubt")
        assert payments.runs == []
        await third.answer_question(sid, "p1", "run again")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert payments.runs == [key]
    assert [len(of(lines, t)) for t in ("call_in_doubt", "approval_request", "call_resolved")] == [
        1, 1, 1
    ]
    assert lines[-1]["status"] == "completed"


async def test_interrupting_a_task_whose_call_is_in_doubt_resolves_it_by_the_note(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-ABORT-1: a task interrupted while its call in doubt waits for a
    person ends with the call resolved (the note) and paired, never left open."""
    sid, crashed, _key = await crash_mid_call(host, workspace, tmp_path, providers)
    payments = Payments(check=None)
    async with open_host(crashed) as second:
        session = await take_up(second, sid, providers([]), payments.tool, PEOPLE)
        assert session.interrupt()  # wakes the parked task, which ends at once
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        assert not session.busy
        lines = trace_lines(session)
    assert payments.runs == []
    resolved_by_the_note(lines)
    assert_noted_and_aborted(lines)


async def test_a_check_that_answers_after_an_interrupt_reruns_nothing(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-ABORT-1: the task is interrupted while its call in doubt is being
    checked, and the check then finds no effect. The answer was taken as a rerun (recorded
    ``check``/``rerun``, the run cancelled by the stop, the model told the user aborted the
    tool); no call starts after the interrupt, so the call gets the note."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)
    # The check then finds no payment.
    payments, lines = await take_up_interrupted_in_check(crashed, sid, providers, lambda: None)
    assert payments.asked == [key] and payments.runs == []
    assert [(r["by"], r["outcome"]) for r in of(lines, "call_resolved")] == [("note", "unknown")]
    assert_noted_and_aborted(lines)


# -- who resolves (pure) ----------------------------------------------------------------------


def _tool(**options: Any) -> Tool:
    async def act() -> str:
        """Act."""
        return "acted"

    return make_tool(act, **{"parallel": False, **options})


async def _find(key: str) -> None:
    return None


@pytest.mark.parametrize(
    ("tool", "people", "check_failed", "expected"),
    [
        (lambda: _tool(check=_find), True, False, "check"),
        (lambda: _tool(check=_find), True, True, "person"),
        (lambda: _tool(check=_find), False, True, "note"),
        (lambda: _tool(), True, False, "person"),
        (lambda: _tool(idempotent=True), True, False, "note"),
        (lambda: _tool(parallel=True), True, False, "note"),
        (lambda: None, True, False, "note"),
    ],
)
def test_who_resolves_a_call_in_doubt(
    tool: Callable[[], Tool | None], people: bool, check_failed: bool, expected: str
) -> None:
    """R-EFFECT-2: the check first; then a person, for a call whose effect running it
    again could repeat (side effects, not idempotent) where people answer; else the note."""
    assert first_resolver(tool(), people=people, check_failed=check_failed) == expected


def test_answers_and_checks_are_checked() -> None:
    """R-EFFECT-2: a person's answer names a choice (case and blanks aside); a check must
    be an async function."""
    assert [outcome_of_answer(a) for a in (" Done", "NOT DONE", "run again", "yes")] == [
        "done", "not_done", "rerun", None
    ]

    def sync_check(key: str) -> None:
        return None

    with pytest.raises(ToolDefinitionError, match="check must be an async function"):
        _tool(check=sync_check)


# -- a call a hook rewrote (R-EFFECT-2, R-HOOK-2) -------------------------------------------


def _cap_at_one(call: ToolCallBlock) -> Rewrite:
    """A before_tool policy: every payment is of 1, whatever the model asked."""
    return Rewrite({"amount": 1})


async def test_a_call_a_hook_rewrote_runs_once_more_as_rewritten(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-HOOK-2, R-TRACE-4: a before_tool hook rewrote pay(amount=7) to amount 1,
    which was approved and ran when the host was lost. The host that takes the task up —
    without the hook, as a restart may — checks the call and, nothing found, runs it once
    more as rewritten, from the ``tool_hook`` record: never with the 7 nobody approved
    (before: ``paid 7``)."""
    sid, crashed, key = await crash_mid_call(
        host, workspace, tmp_path, providers, Hooks(before_tool=_cap_at_one)
    )
    payments = Payments()  # its check finds nothing: the call runs once more
    after = providers([Reply(blocks=(text("Paid."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, allow_all)
        lines = trace_lines(session)
    assert payments.asked == [key] and payments.made == {key: 1}
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("check", "rerun")
    (result,) = of(lines, "tool_call_output")
    assert result["content"][0]["text"] == "paid 1"
    assert lines[-1]["status"] == "completed"


async def test_a_person_is_asked_about_a_call_in_doubt_as_a_hook_rewrote_it(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-HOOK-2, R-HITL-1: the in-doubt question about a rewritten call shows
    the arguments that were approved and ran (amount 1, not the model's 7: before, the
    model's), and "run again" runs it so."""
    sid, crashed, key = await crash_mid_call(
        host, workspace, tmp_path, providers, Hooks(before_tool=_cap_at_one)
    )
    payments = Payments(check=None)
    after = providers([Reply(blocks=(text("Paid."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, PEOPLE)
        (pending,) = await second.pending_approvals()
        assert (pending.kind, pending.arguments["arguments"]) == ("in_doubt", {"amount": 1})
        await second.answer_question(sid, "p1", "run again", "ana")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
    assert payments.made == {key: 1}
