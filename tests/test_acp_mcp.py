"""``greenroom acp`` with the editor's MCP server (R-MCP-5, R-ACP-1): its prompts offered
as slash commands (``available_commands_update``) after ``session/new`` and
``session/load``, a ``/server:prompt …`` prompt run as that MCP prompt, ``@server:uri`` and
``resource_link`` blocks of the server's resources attached. The editor is the official
ACP SDK's client on the agent's pipes (``tests/test_acp.py``), the server a real one built
with the official MCP SDK (``tests/support/mcp_server.py``); every frame is checked
strictly against the ACP schema."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from acp import RequestError
from acp.schema import EnvVariable, McpServerStdio, ResourceContentBlock

from tests.test_acp import Agent, greenroom_acp, run, text
from tests.test_mcp import SERVER


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    directory.mkdir()
    return directory

NOTES = (
    '<attachment source="@t:greenroom://notes">\n'
    "[resource greenroom://notes of MCP server 't']\n"
    "the notes say: ship on Friday\n</attachment>"
)


def servers() -> list[Any]:
    return [McpServerStdio(name="t", command=sys.executable, args=[str(SERVER)],
                           env=[EnvVariable(name="GREENROOM_TEST", value="1")])]  # fmt: skip


def user_messages(tmp_path: Path, session_id: str) -> list[tuple[str, list[str]]]:
    records = [
        json.loads(line)
        for trace in sorted((tmp_path / "data" / "sessions" / session_id).glob("trace_*.jsonl"))
        for line in trace.read_text("utf-8").splitlines()
    ]
    return [(r["kind"], [b["text"] for b in r["content"]]) for r in records
            if r["type"] == "user_msg"]  # fmt: skip


def commands_after_answer(agent: Agent, method: str) -> list[dict[str, Any]]:
    """The ``available_commands_update`` updates the agent wrote, each checked to come
    after its answer to the last ``method`` request (the editor knows the session by then)."""
    sent = [e.message for e in agent.events if e.message.get("method") == method]
    request_id = sent[-1]["id"]
    frames = [json.loads(line) for line in agent.raw]
    answered = next(
        i for i, f in enumerate(frames) if f.get("id") == request_id and "method" not in f
    )
    found = []
    for index, frame in enumerate(frames):
        update = frame.get("params", {}).get("update", {}) if frame.get("method") else {}
        if update.get("sessionUpdate") == "available_commands_update":
            found.append((index, update))
    return [update for index, update in found if index > answered]


REVIEW = {
    "name": "t:review",
    "description": "Review a file, in the given tone",
    "input": {"hint": "path=… [tone=…]"},
}


def test_prompts_are_slash_commands_and_run_as_the_input(
    tmp_path: Path, workspace: Path
) -> None:
    """R-MCP-5: after ``session/new`` (and not before its answer) the server's prompt is
    offered as ``/t:review`` with its arguments as the hint; a prompt ``/t:review
    path=a.py tone=dry`` is sent as the prompt's text; a missing argument or an unknown
    prompt of the server is -32602 naming it and nothing is sent; a ``/x:y`` naming no
    server of the session is ordinary text."""

    async def scenario() -> None:
        async with greenroom_acp(tmp_path, "--approve", "all") as agent:
            await agent.conn.initialize(protocol_version=1)
            created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=servers())
            sid = created.session_id
            update = await agent.editor.wait_for(
                lambda u: u.session_update == "available_commands_update"
            )
            assert [c.name for c in update.available_commands] == ["t:review"]
            assert commands_after_answer(agent, "session/new") == [
                {"sessionUpdate": "available_commands_update", "availableCommands": [REVIEW]}
            ]
            answer = await agent.conn.prompt(
                session_id=sid, prompt=text("/t:review path=a.py tone=dry")
            )
            assert answer.stop_reason == "end_turn"
            assert 'You asked: "Review a.py in a dry tone."' in agent.editor.text()
            for bad, message in [
                ("/t:review", "/t:review: path=… is required (usage: /t:review path=… [tone=…])"),
                ("/t:nope", "/t:nope: MCP server 't' has no prompt 'nope' (its prompts: review)"),
            ]:
                with pytest.raises(RequestError) as refused:
                    await agent.conn.prompt(session_id=sid, prompt=text(bad))
                assert refused.value.code == -32602
                assert str(refused.value) == f"$.prompt[0]: {message}"
            answer = await agent.conn.prompt(session_id=sid, prompt=text("/x:y"))
            assert answer.stop_reason == "end_turn"
            assert await agent.close_stdin() == 0
            agent.check_frames()
        assert user_messages(tmp_path, sid) == [
            ("prompt", ["Review a.py in a dry tone."]),
            ("prompt", ["/x:y"]),
        ]

    run(scenario())


def test_mentions_and_resource_links_are_read_through_the_server(
    tmp_path: Path, workspace: Path
) -> None:
    """R-MCP-5: ``@t:greenroom://notes`` in a text block and a ``resource_link`` to a
    resource the server lists are attached, read through the server; a link to anything
    else is named as before; an unreadable mention is -32602 naming the block and
    nothing is sent. ``session/load`` offers the commands again after its answer; a
    session without MCP servers is offered none."""

    async def scenario() -> None:
        async with greenroom_acp(tmp_path, "--approve", "all") as agent:
            await agent.conn.initialize(protocol_version=1)
            created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=servers())
            sid = created.session_id
            with pytest.raises(RequestError) as refused:
                await agent.conn.prompt(
                    session_id=sid,
                    prompt=[*text("first"), *text("see @t:greenroom://nope")],
                )
            assert refused.value.code == -32602
            assert str(refused.value).startswith(
                "$.prompt[1]: @t:greenroom://nope: MCP server 't' refused reading"
            ), str(refused.value)
            links = [
                ResourceContentBlock(type="resource_link", uri="greenroom://notes", name="notes"),
                ResourceContentBlock(type="resource_link", uri="file:///w/a.py", name="a.py"),
            ]
            answer = await agent.conn.prompt(
                session_id=sid, prompt=[*text("see @t:greenroom://notes"), *links]
            )
            assert answer.stop_reason == "end_turn"
            plain = (await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])).session_id
            await agent.conn.prompt(session_id=plain, prompt=text("hi"))
            assert await agent.close_stdin() == 0
            agent.check_frames()
            offered = [session for session, u in agent.editor.updates
                       if u.session_update == "available_commands_update"]  # fmt: skip
            assert offered == [sid]
        linked = "[resource: a.py] file:///w/a.py"
        assert user_messages(tmp_path, sid) == [
            ("prompt", ["see @t:greenroom://notes", NOTES, NOTES, linked])
        ]

        async with greenroom_acp(tmp_path, "--approve", "all") as agent:
            await agent.conn.initialize(protocol_version=1)
            await agent.conn.load_session(
                cwd=str(workspace), session_id=sid, mcp_servers=servers()
            )
            await agent.editor.wait_for(lambda u: u.session_update == "available_commands_update")
            assert commands_after_answer(agent, "session/load") == [
                {"sessionUpdate": "available_commands_update", "availableCommands": [REVIEW]}
            ]
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())
