"""A tool's ``check`` that answers a ``bool``, or an awaitable (a forgotten ``await``),
gives no answer about a call in doubt (R-EFFECT-2): the resolution falls through — to a
person where there is one, else the note — with the reason recorded, and the call does
not run again. Before, such an answer was taken as the effect found: the model was told
the payment had been made, with ``False`` (the check's *not found*) as what it reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, open_host, trace_lines
from test_effects import Payments, crash_mid_call, of, take_up

from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.host import Host
from greenroom.protocols import markers
from greenroom.protocols.people import PEOPLE


async def _lookup(key: str) -> str | None:
    return None


@pytest.mark.parametrize("answer", [False, True, "awaitable"])
async def test_a_check_answering_a_bool_or_an_awaitable_leaves_the_note(
    host: Host, workspace: Path, tmp_path: Path, providers: Any, answer: Any
) -> None:
    """R-EFFECT-2, R-EFFECT-3: nobody to ask: the model gets the host-lost note (not run
    again), and ``call_resolved`` says why the check did not decide."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)
    asked: list[str] = []

    async def check(asked_key: str) -> Any:
        asked.append(asked_key)
        return _lookup(asked_key) if answer == "awaitable" else answer  # no await

    payments = Payments(check=check)
    after = providers([Reply(blocks=(text("It may not have gone through."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, allow_all)
        lines = trace_lines(session)
    assert asked == [key] and payments.runs == []
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("note", "unknown")
    expected = "an awaitable (coroutine)" if answer == "awaitable" else str(answer)
    assert resolved["check_error"].startswith(f"the check answered {expected}")
    (result,) = of(lines, "tool_call_output")
    assert result["status"] == "interrupted"
    assert result["content"][0]["text"] == markers.HOST_LOST_TEXT
    assert lines[-1]["status"] == "completed"


async def test_a_check_answering_false_passes_the_call_to_a_person(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-EFFECT-2, R-HITL-1: where people answer, the person is asked, the question saying
    what the check answered; their "not done" leaves the payment not run."""
    sid, crashed, _key = await crash_mid_call(host, workspace, tmp_path, providers)

    async def found(asked_key: str) -> bool:
        return asked_key in payments.made

    payments = Payments(check=found)
    after = providers([Reply(blocks=(text("Not paid, then."),))])
    async with open_host(crashed) as second:
        session = await take_up(second, sid, after, payments.tool, PEOPLE)
        (pending,) = await second.pending_approvals()
        assert pending.kind == "in_doubt"
        assert pending.arguments["check_error"].startswith("the check answered False")
        await second.answer_question(sid, "p1", "not done", "ana")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert payments.runs == []
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("person", "not_done")


def test_what_a_check_may_answer() -> None:
    """R-EFFECT-2: a result (text, blocks, a ToolResult, anything a tool may return) or
    None is an answer; a bool or an awaitable is not."""
    from greenroom.protocols.effects import check_answer_problem  # new here

    assert [check_answer_problem(v) for v in (None, "", "paid 7", {"id": 1}, 0)] == [None] * 5
    assert all(check_answer_problem(v) for v in (False, True))
