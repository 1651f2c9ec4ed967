"""A fork cut while a call is in doubt (R-FORK-1, R-FORK-2, R-EFFECT-2): the
call's host was lost before its result was recorded, so whether its effect happened is
unknown. The cut resolves it as an interrupt does — by the note, one ``call_resolved``
record — and the model of the fork reads the host-lost text, never that the call was
aborted by the user (which says the payment was not made)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from conftest import RUN_TIMEOUT_S, open_host, trace_lines
from test_effects import Payments, crash_mid_call, of, take_up

from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.host import Host
from greenroom.protocols import markers
from greenroom.protocols.people import PEOPLE


async def test_a_fork_of_a_session_whose_call_is_in_doubt_gives_the_call_the_note(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    sid, crashed, _key = await crash_mid_call(host, workspace, tmp_path, providers)
    payments = Payments(check=None)
    async with open_host(crashed) as second:
        await take_up(second, sid, providers([]), payments.tool, PEOPLE)
        assert [p.kind for p in await second.pending_approvals()] == ["in_doubt"]
        after = providers([Reply(blocks=(text("Noted."),))])
        with trio.fail_after(RUN_TIMEOUT_S):
            fork = await second.fork_session(sid, provider=after, tools=[payments.tool])
            await fork.wait_idle()
        lines = trace_lines(fork)
        # Only the source's question waits: the fork's call is settled.
        assert [p.session_id for p in await second.pending_approvals()] == [sid]
        source_lines = trace_lines(second.get_session(sid))
    assert payments.runs == []
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("note", "unknown")
    (result,) = of(lines, "tool_call_output")
    assert result["content"][0]["text"] == markers.HOST_LOST_TEXT
    assert result["status"] == "interrupted"
    # The source is only read: its call still waits for its person.
    assert of(source_lines, "call_resolved") == []

