"""People answer when they can, through an editor (R-HITL-1, R-HITL-2, R-HITL-5, R-ACP-1):
the ACP agent in a subprocess (``tests/support/acp_people_agent.py``: ``greenroom acp``'s
set-up with a scripted model and a ``pay`` tool that records its payments), the official
ACP SDK's client side as the editor, every frame checked against the SDK's schema.

A permission the editor leaves unanswered survives the agent process: it waits in the trace,
and ``session/load`` in a new process asks it again; the answer runs the tool exactly once
and the resumed task's updates reach the editor. Questions (``ask_user``) are asked with
their choices as options, with ``_greenroom/ask`` when the editor says it answers it, or
answered by the editor's next prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from acp import RequestError
from acp.schema import (
    ClientCapabilities,
    Implementation,
    PermissionOption,
    PromptResponse,
    ToolCallUpdate,
)

from tests.test_acp import ROOT, Agent, Editor, run, spawned_agent, text

AGENT = ROOT / "tests" / "support" / "acp_people_agent.py"
EDITOR = Implementation(name="test-editor", version="1.0")


class PeopleEditor(Editor):
    """An editor that also keeps the options it was offered and answers ``_greenroom/ask``
    with ``answer``."""

    def __init__(self) -> None:
        super().__init__()
        self.options: list[list[PermissionOption]] = []
        self.asked_questions: list[tuple[str, dict[str, Any]]] = []
        self.answer = ""

    async def request_permission(
        self, options: Any, session_id: str, tool_call: ToolCallUpdate, **kwargs: Any
    ) -> Any:
        self.options.append(list(options))
        return await super().request_permission(options, session_id, tool_call, **kwargs)

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.asked_questions.append((method, params))
        return {"answer": self.answer}

    async def until_text(self, wanted: str) -> None:
        """Return once the agent's messages so far contain ``wanted``."""
        while wanted not in self.text():
            self.changed.clear()
            await self.changed.wait()


@contextlib.asynccontextmanager
async def people_agent(tmp_path: Path, scenario: str) -> AsyncIterator[Agent]:
    async with spawned_agent(
        tmp_path, PeopleEditor(), sys.executable, str(AGENT), scenario,
        str(tmp_path / "data"), str(tmp_path / "marks"),
    ) as agent:  # fmt: skip
        yield agent


def editor_of(agent: Agent) -> PeopleEditor:
    assert isinstance(agent.editor, PeopleEditor)
    return agent.editor


def trace_of(tmp_path: Path, sid: str) -> list[dict[str, Any]]:
    trace = next((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
    return [json.loads(line) for line in trace.read_text("utf-8").splitlines()]


def workspace_of(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    directory.mkdir(exist_ok=True)
    return directory


async def open_session(agent: Agent, tmp_path: Path, *, asks: bool = False) -> str:
    capabilities = ClientCapabilities(field_meta={"greenroom": {"ask": True}}) if asks else None
    await agent.conn.initialize(
        protocol_version=1, client_capabilities=capabilities, client_info=EDITOR
    )
    created = await agent.conn.new_session(cwd=str(workspace_of(tmp_path)), mcp_servers=[])
    return created.session_id


async def held_at_its_permission(
    agent: Agent, tmp_path: Path
) -> tuple[str, PeopleEditor, asyncio.Task[PromptResponse]]:
    """Open a session and prompt ``pay`` until its call's permission is asked, the editor
    holding it: the session's id, the editor and the prompt's task."""
    sid = await open_session(agent, tmp_path)
    editor = editor_of(agent)
    editor.choose = lambda call: None  # held: the person is away
    prompt = asyncio.create_task(agent.conn.prompt(session_id=sid, prompt=text("pay")))
    await editor.asked.wait()
    return sid, editor, prompt


def test_a_pending_permission_survives_the_agent_and_is_asked_again_on_load(
    tmp_path: Path,
) -> None:
    """R-HITL-1: the editor goes away (stdin closed) while its permission is asked; the
    call is not denied, the process exits 0 and the trace ends with the request. A new
    process loads the session, replays it, asks again; allowed, the tool runs once, the
    resumed task's updates stream to the editor and it ends once, completed; the next
    prompt runs after it."""

    async def first() -> str:
        async with people_agent(tmp_path, "pay") as agent:
            sid, editor, prompt = await held_at_its_permission(agent, tmp_path)
            assert editor.permissions[0].tool_call_id == "p1"
            assert await agent.close_stdin() == 0
            editor.release.set()
            with contextlib.suppress(Exception):
                await prompt  # the agent is gone: however the SDK ends it
            agent.check_frames()
            return sid

    sid = run(first())
    records = trace_of(tmp_path, sid)
    assert records[-1]["type"] == "approval_request" and records[-1]["call_id"] == "p1"
    assert not any(r["type"] in ("approval_decision", "task_end") for r in records)
    assert not (tmp_path / "marks").exists()

    async def second() -> None:
        async with people_agent(tmp_path, "pay") as agent:
            editor = editor_of(agent)
            await agent.conn.initialize(protocol_version=1, client_info=EDITOR)
            await agent.conn.load_session(
                cwd=str(workspace_of(tmp_path)), session_id=sid, mcp_servers=[]
            )
            assert "Paying." in editor.text()  # the history came first
            await editor.until_text("Done: paid 7")
            (asked,) = editor.permissions
            assert asked.tool_call_id == "p1"
            kinds = [o.kind for o in editor.options[0]]
            assert kinds == ["allow_once", "allow_always", "reject_once"]
            ends = [
                u
                for _, u in editor.updates
                if u.session_update == "tool_call_update" and u.status == "completed"
            ]
            assert [e.tool_call_id for e in ends] == ["p1"]
            # A prompt now runs once the resumed task has ended.
            answer = await agent.conn.prompt(session_id=sid, prompt=text("thanks"))
            assert answer.stop_reason == "end_turn"
            assert "You are welcome." in editor.text()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(second())
    assert (tmp_path / "marks").read_text() == "7\n"  # once, after the answer
    records = trace_of(tmp_path, sid)
    types = [r["type"] for r in records]
    assert types.count("task_start") == 2 and types.count("approval_request") == 1
    (decision,) = [r for r in records if r["type"] == "approval_decision"]
    assert (decision["decision"], decision["by"]) == ("allow", "client")
    assert decision["principal"] == "test-editor"
    # The task that waited ended once, completed, before the next one started.
    assert [r["status"] for r in records if r["type"] == "task_end"] == ["completed"] * 2
    assert types.index("task_end") < types.index("task_start", types.index("task_start") + 1)


def test_a_prompt_that_meets_its_session_closing_is_told_it_was_not_sent(
    tmp_path: Path,
) -> None:
    """R-ACP-1, R-HOST-3: a prompt that found its session on the connection, and reached it
    once ``session/close`` had begun, was answered -32603 "session X is closed", an internal
    error. It is answered -32002, as a prompt after the close is, saying the prompt was not
    sent; the trace holds nothing of it. The prompt is held by the task a load took up (a
    permission the editor leaves unanswered): a prompt waits for that task to end."""

    async def scenario() -> str:
        async with people_agent(tmp_path, "pay") as agent:
            sid, editor, first = await held_at_its_permission(agent, tmp_path)
            await agent.conn.close_session(session_id=sid)  # the task waits in the trace
            assert (await first).stop_reason == "cancelled"
            await agent.conn.load_session(
                cwd=str(workspace_of(tmp_path)), session_id=sid, mcp_servers=[]
            )
            late = asyncio.create_task(agent.conn.prompt(session_id=sid, prompt=text("thanks")))
            await agent.wait_sent(
                lambda m: m.get("method") == "session/prompt" and "thanks" in str(m["params"])
            )
            # Answered after the prompt's request, read first, has taken its session.
            await agent.conn.list_sessions()
            await agent.conn.close_session(session_id=sid)
            with pytest.raises(RequestError) as refused:
                await late
            assert refused.value.code == -32002
            assert str(refused.value) == (
                f"session {sid} is closed: its close began before the prompt reached it, so "
                "nothing was sent; session/load opens it again"
            )
            editor.release.set()
            assert await agent.close_stdin() == 0
            agent.check_frames()
            return sid

    sid = run(scenario())
    said = [r["content"] for r in trace_of(tmp_path, sid) if r["type"] == "user_msg"]
    assert said == [[{"type": "text", "text": "pay"}]]


def test_a_question_with_choices_is_asked_with_them_as_options(tmp_path: Path) -> None:
    """R-HITL-5: the choices are the options (plus "Not now"); the chosen one is the
    call's result."""

    async def scenario() -> str:
        async with people_agent(tmp_path, "choices") as agent:
            sid = await open_session(agent, tmp_path)
            editor = editor_of(agent)
            editor.choose = lambda call: "choice:1"
            answer = await agent.conn.prompt(session_id=sid, prompt=text("paint it"))
            assert answer.stop_reason == "end_turn"
            (asked,) = editor.permissions
            assert (asked.tool_call_id, asked.title) == ("q1", "Which color?")
            assert [(o.option_id, o.name, o.kind) for o in editor.options[0]] == [
                ("choice:0", "red", "allow_once"),
                ("choice:1", "blue", "allow_once"),
                ("not_now", "Not now", "reject_once"),
            ]
            assert "Done: blue" in editor.text()
            assert await agent.close_stdin() == 0
            agent.check_frames()
            return sid

    sid = run(scenario())
    (result,) = [r for r in trace_of(tmp_path, sid) if r["type"] == "tool_call_output"]
    assert result["content"] == [{"type": "text", "text": "blue"}]


def test_a_free_question_goes_to_an_editor_that_answers_greenroom_ask(tmp_path: Path) -> None:
    """R-HITL-5: an editor that says it answers ``_greenroom/ask`` gets the question
    without choices there, and its answer is the call's result; no permission is asked."""

    async def scenario() -> None:
        async with people_agent(tmp_path, "free") as agent:
            sid = await open_session(agent, tmp_path, asks=True)
            editor = editor_of(agent)
            editor.answer = "Friday at noon"
            answer = await agent.conn.prompt(session_id=sid, prompt=text("plan a meeting"))
            assert answer.stop_reason == "end_turn"
            assert editor.asked_questions == [
                (
                    "greenroom/ask",
                    {"sessionId": sid, "toolCallId": "q1", "question": "When shall we meet?"},
                )
            ]
            assert editor.permissions == []
            assert "Done: Friday at noon" in editor.text()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_a_free_question_is_answered_by_the_editors_next_prompt(tmp_path: Path) -> None:
    """R-HITL-5 for an editor without ``_greenroom/ask``: the question is a permission
    request whose option "Answer in my next message" makes the next session/prompt the
    answer; both prompts are answered when the task ends."""

    async def scenario() -> None:
        async with people_agent(tmp_path, "free") as agent:
            sid = await open_session(agent, tmp_path)
            editor = editor_of(agent)
            editor.choose = lambda call: "answer_next"
            first = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text("plan a meeting"))
            )
            await editor.asked.wait()
            (asked,) = editor.permissions
            assert asked.title == "When shall we meet?"
            assert [o.option_id for o in editor.options[0]] == ["answer_next", "not_now"]
            # The answer to the permission request is on its way before the prompt.
            await agent.wait_sent(lambda m: "result" in m and "optionId" in str(m["result"]))
            second = await agent.conn.prompt(session_id=sid, prompt=text("Friday"))
            assert second.stop_reason == "end_turn"
            assert (await first).stop_reason == "end_turn"
            assert "Done: Friday" in editor.text()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_a_question_left_for_later_waits_in_the_trace_and_is_asked_again(
    tmp_path: Path,
) -> None:
    """R-HITL-5, R-HITL-1: "Not now" leaves the question pending; the editor going away
    does not end it; loaded in a new process, it is asked again and answered."""

    async def first() -> str:
        async with people_agent(tmp_path, "choices") as agent:
            sid = await open_session(agent, tmp_path)
            editor = editor_of(agent)
            editor.choose = lambda call: "not_now"
            prompt = asyncio.create_task(agent.conn.prompt(session_id=sid, prompt=text("paint")))
            await editor.asked.wait()
            await agent.wait_sent(lambda m: "result" in m and "not_now" in str(m["result"]))
            assert await agent.close_stdin() == 0
            with contextlib.suppress(Exception):
                await prompt
            agent.check_frames()
            return sid

    sid = run(first())
    records = trace_of(tmp_path, sid)
    assert records[-1]["type"] == "approval_request" and records[-1]["kind"] == "question"

    async def second() -> None:
        async with people_agent(tmp_path, "choices") as agent:
            editor = editor_of(agent)
            editor.choose = lambda call: "choice:0"
            await agent.conn.initialize(protocol_version=1, client_info=EDITOR)
            await agent.conn.load_session(
                cwd=str(workspace_of(tmp_path)), session_id=sid, mcp_servers=[]
            )
            await editor.until_text("Done: red")
            answer = await agent.conn.prompt(session_id=sid, prompt=text("thanks"))
            assert answer.stop_reason == "end_turn"
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(second())
    records = trace_of(tmp_path, sid)
    (result,) = [r for r in records if r["type"] == "tool_call_output"]
    assert result["content"] == [{"type": "text", "text": "red"}]
    assert [r["status"] for r in records if r["type"] == "task_end"] == ["completed"] * 2
