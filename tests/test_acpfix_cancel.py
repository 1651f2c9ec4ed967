"""``session/cancel`` as an editor sends it (R-ACP-1, R-ABORT-1, R-HITL-1): the ACP agent in
a subprocess, the official ACP SDK's client side as the editor, every frame checked against
the SDK's schema.

A cancel interrupts the session's work — also the prompts the editor sent before it that
had not reached a task yet. A permission request the cancel settled, which the editor
leaves unanswered, is no longer taken for one that waits for a person: the next call of
the same id is asked, and a task running when the editor goes away is interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

from greenroom.actors.apps.demo import write_demo_workspace
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT
from tests.test_acp import greenroom_acp, held_at_its_first_call, run, spawned_agent, text
from tests.test_acp_people import (
    EDITOR,
    PeopleEditor,
    editor_of,
    held_at_its_permission,
    open_session,
    people_agent,
    trace_of,
    workspace_of,
)


def test_a_prompt_sent_before_a_cancel_does_not_run_after_it(tmp_path: Path) -> None:
    """ACP: session/cancel cancels the session's prompt turn. A prompt sent before it
    that waits for the session (here behind the task a load took up, held at its
    permission) ran once the cancel had ended that task, answered ``end_turn``: the
    person stopped the session and their message ran anyway. It is answered
    ``cancelled`` and never reaches the session."""

    async def first() -> str:
        async with people_agent(tmp_path, "pay") as agent:
            sid, editor, prompt = await held_at_its_permission(agent, tmp_path)
            assert await agent.close_stdin() == 0
            editor.release.set()
            with contextlib.suppress(Exception):
                await prompt
            return sid

    sid = run(first())

    async def second() -> None:
        async with people_agent(tmp_path, "pay") as agent:
            editor = editor_of(agent)
            editor.choose = lambda call: None  # asked again on load, and held
            await agent.conn.initialize(protocol_version=1, client_info=EDITOR)
            await agent.conn.load_session(
                cwd=str(workspace_of(tmp_path)), session_id=sid, mcp_servers=[]
            )
            await editor.asked.wait()
            late = asyncio.create_task(agent.conn.prompt(session_id=sid, prompt=text("thanks")))
            await agent.wait_sent(
                lambda m: m.get("method") == "session/prompt" and "thanks" in str(m["params"])
            )
            await agent.conn.cancel(session_id=sid)
            assert (await late).stop_reason == "cancelled"
            assert "You are welcome." not in editor.text()
            editor.release.set()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(second())
    records = trace_of(tmp_path, sid)
    said = [r["content"] for r in records if r["type"] == "user_msg"]
    assert said == [[{"type": "text", "text": "pay"}]]
    assert [r["status"] for r in records if r["type"] == "task_end"] == ["aborted"]
    assert not (tmp_path / "marks").exists()


REPEATING_AGENT = """
import os, sys
from pathlib import Path

from greenroom.actors.apps.acp import AcpConfig, serve_stdio
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ToolResult, UserMessage
from greenroom.protocols.tools import make_tool

data_dir, marks = sys.argv[1:3]


async def pay(amount: int) -> str:
    \"\"\"Pay an amount.\"\"\"
    with open(marks, "a", encoding="utf-8") as handle:
        handle.write(f"{amount}\\n")
    return f"paid {amount}"


def model(request):
    # Each prompt "pay" calls pay with the id p1, as models that number their calls
    # per reply do; its result is answered "Done: ...".
    last = request.messages[-1]
    said = [p.text for p in last.content if isinstance(p, TextBlock)]
    if said and said[-1] == "pay":
        return Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7)))
    results = [p for p in last.content if isinstance(p, ToolResult)]
    done = "".join(b.text for b in results[-1].content if isinstance(b, TextBlock))
    return Reply(blocks=(text(f"Done: {done}"),))


config = AcpConfig(provider=ScriptedProvider(model), tools=(make_tool(pay, parallel=False),))
frames = os.dup(1)
os.dup2(2, 1)
serve_stdio(config, Path(data_dir), frames)
"""
"""An ACP agent (``--approve ask``) whose model calls ``pay`` with the same id ``p1`` at
each prompt ``pay``; each payment made is a line of the file ``marks``."""


def test_a_call_asked_about_again_after_a_cancel_is_asked(tmp_path: Path) -> None:
    """The editor leaves the permission of call ``p1`` unanswered and cancels: the prompt
    is answered ``cancelled``. The next prompt's call has the same id (as models that
    number their calls per reply give): it was never asked — the agent still took the
    request the cancel settled for the one being asked — and the task waited for good.
    It is asked, allowed, and runs once."""
    script = tmp_path / "repeating_agent.py"
    script.write_text(REPEATING_AGENT, encoding="utf-8")

    async def scenario() -> str:
        async with spawned_agent(
            tmp_path, PeopleEditor(), sys.executable, str(script), str(tmp_path / "data"),
            str(tmp_path / "marks"),
        ) as agent:  # fmt: skip
            sid = await open_session(agent, tmp_path)
            editor = editor_of(agent)
            editor.choose = lambda call: None  # never answered
            first = asyncio.create_task(agent.conn.prompt(session_id=sid, prompt=text("pay")))
            await editor.asked.wait()
            await agent.conn.cancel(session_id=sid)
            assert (await first).stop_reason == "cancelled"
            editor.choose = lambda call: "allow"
            again = await agent.conn.prompt(session_id=sid, prompt=text("pay"))
            assert again.stop_reason == "end_turn"
            assert [p.tool_call_id for p in editor.permissions] == ["p1", "p1"]
            assert "Done: paid 7" in editor.text()
            assert await agent.close_stdin() == 0
            editor.release.set()
            agent.check_frames()
            return sid

    sid = run(scenario())
    assert (tmp_path / "marks").read_text() == "7\n"
    records = trace_of(tmp_path, sid)
    assert [r["status"] for r in records if r["type"] == "task_end"] == ["aborted", "completed"]


def test_the_editor_leaving_interrupts_a_task_after_a_cancelled_permission(
    tmp_path: Path,
) -> None:
    """R-ACP-1, R-HITL-1: after a cancel whose permission request the editor left
    unanswered, the next prompt's task runs a tool when the editor goes away (stdin
    closed). The agent took the session for one waiting for a person: it did not
    interrupt the task, never answered the prompt, and left after its grace with the
    trace cut short. The task is interrupted, the prompt answered ``cancelled``, the
    trace ends with the task's end, and the process exits 0."""
    workspace = tmp_path / "ws"
    write_demo_workspace(workspace)

    async def scenario() -> str:
        async with greenroom_acp(tmp_path) as agent:
            sid, first = await held_at_its_first_call(agent, workspace)  # never released
            await agent.conn.cancel(session_id=sid)
            assert (await first).stop_reason == "cancelled"
            (workspace / "BLOCK").write_text("", encoding="utf-8")
            agent.editor.choose = lambda call: "allow"
            second = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            )
            await agent.editor.wait_for(
                lambda u: u.session_update == "tool_call_update" and u.content
                and getattr(u.content[0].content, "text", "").startswith("listing")
            )  # fmt: skip
            assert await agent.close_stdin() == 0
            assert (await second).stop_reason == "cancelled"
            agent.editor.release.set()
            agent.check_frames()
            return sid

    sid = run(scenario())
    trace = next((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
    records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
    ends = [r["status"] for r in records if r["type"] == "task_end"]
    assert ends == ["aborted", "aborted"] and records[-1]["type"] == "task_end"
