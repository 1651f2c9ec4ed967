"""A person's "run again" for a call in doubt is refused where the session cannot run it
(R-EFFECT-2, R-HITL-2): opened without the call's tool (``greenroom answer`` without the
``--tools`` that gives it, an MCP server that did not start), the answer is refused and
the question waits on. Before, it was taken: ``call_resolved`` said the call ran again
(``rerun``, by the person) while nothing ran, and the model got ``Unknown tool`` — the
first run's effect, still unknown, hidden behind an error that says nothing of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, open_host, trace_lines
from test_effects import Payments, crash_mid_call, of, take_up

from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.errors import NotPending
from greenroom.actors.runtime.host import Host
from greenroom.protocols.people import PEOPLE


async def test_run_again_is_refused_where_the_session_has_no_such_tool(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """The question is asked where the tool is; the session is then opened without it:
    "run again" is refused, naming the tool, and nothing is recorded; the question still
    waits, and "not done" resolves the call. Opened with the tool, "run again" runs it
    once, with its key."""
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)
    async with open_host(crashed) as second:
        await take_up(second, sid, providers([]), Payments(check=None).tool, PEOPLE)
        assert [p.kind for p in await second.pending_approvals()] == ["in_doubt"]
    async with open_host(crashed) as third:
        session = await third.load_session(sid, provider=providers([]), tools=[])
        with pytest.raises(NotPending, match=r"cannot run again here: .* no tool 'pay'"):
            await third.answer_question(sid, "p1", "run again", "ana")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        assert third.port(sid).parked
        (pending,) = await third.pending_approvals()
        assert (pending.kind, pending.call_id) == ("in_doubt", "p1")
        assert not of(trace_lines(session), "call_resolved")

    payments = Payments(check=None)
    after = providers([Reply(blocks=(text("Paid."),))])
    async with open_host(crashed) as fourth:
        session = await fourth.load_session(sid, provider=after, tools=[payments.tool])
        await fourth.answer_question(sid, "p1", "run again", "ana")
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)
    assert payments.runs == [key]
    (resolved,) = of(lines, "call_resolved")
    assert [resolved[k] for k in ("by", "outcome", "principal")] == ["person", "rerun", "ana"]
    (result,) = of(lines, "tool_call_output")
    assert (result["status"], result["content"][0]["text"]) == ("ok", "paid 7")
