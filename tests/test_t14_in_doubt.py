"""An interrupt after a call's check failed keeps the check's error (R-EFFECT-2, R-HITL):
the ``call_resolved`` the interrupt's note records says why the check gave no answer, as
every other resolution that follows a failed check does. Before, it had no
``check_error``: the reason was lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from conftest import RUN_TIMEOUT_S, open_host, trace_lines
from test_effects import (
    Payments,
    assert_noted_and_aborted,
    crash_mid_call,
    resolved_by_the_note,
    take_up,
    take_up_interrupted_in_check,
)

from greenroom.actors.runtime.host import Host
from greenroom.protocols.people import PEOPLE


async def test_an_interrupt_while_the_check_fails_records_its_error(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """The user interrupts while the check runs, and the check then fails: the call gets
    the note, recorded with the check's error."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)

    def unreachable() -> None:
        raise ConnectionError("the payment ledger is unreachable")

    payments, lines = await take_up_interrupted_in_check(crashed, sid, providers, unreachable)
    assert payments.asked == [key] and payments.runs == []
    resolved = resolved_by_the_note(lines)
    assert "the payment ledger is unreachable" in (resolved.get("check_error") or "")
    assert_noted_and_aborted(lines)


async def test_an_interrupt_while_a_person_is_asked_after_a_failed_check_keeps_its_error(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """The check fails, so a person is asked (the question carries the check's error);
    the task is interrupted before anyone answers: the note's record keeps that error."""
    sid, crashed, _key = await crash_mid_call(host, workspace, tmp_path, providers)

    async def find(asked: str) -> None:
        raise ConnectionError("the payment ledger is unreachable")

    payments = Payments(check=find)
    async with open_host(crashed) as second:
        session = await take_up(second, sid, providers([]), payments.tool, PEOPLE)
        (pending,) = await second.pending_approvals()
        assert "unreachable" in pending.arguments["check_error"]
        assert session.interrupt()  # wakes the parked task, which ends at once
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert payments.runs == []
    resolved = resolved_by_the_note(lines)
    assert "the payment ledger is unreachable" in (resolved.get("check_error") or "")
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "aborted"
