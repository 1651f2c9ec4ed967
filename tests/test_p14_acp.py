"""``greenroom acp`` (R-ACP-1, R-ACP-2) in-process on memory streams, every frame raw as an
editor writes it: a notification that fails validation is never answered (JSON-RPC 2.0),
and a write the editor was asked for is not given up on while its call runs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from test_acp_agent import TIMEOUT_S, Client, agent_on

from greenroom.actors.apps.acp import AcpConfig
from greenroom.actors.apps.acp_editor import EDITOR_TIMEOUT_S
from greenroom.actors.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.tools.builtin import builtin_tools
from greenroom.protocols import acp
from greenroom.protocols.context import ToolResult

BAD_NOTIFICATIONS = [
    {"jsonrpc": "2.0", "method": "session/cancel", "params": [1]},
    {"jsonrpc": "2.0", "method": "session/cancel", "params": {}, "extra": 1},
    {"jsonrpc": "1.0", "method": "session/cancel", "params": {}},
    {"method": "_zed/whatever", "params": "text"},
]


async def test_a_notification_that_fails_validation_is_not_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """R-ACP-1: a message with a method and no id is a notification, and JSON-RPC 2.0 says
    a server never answers one, not even on error. greenroom answered those that failed
    validation (params that are not an object, an unknown member, another ``jsonrpc``)
    with an error of a null id, which answers none of the editor's requests (the ACP SDK
    drops such notifications unanswered). They are now only logged; a message that is no
    call at all (no method, no id) is still answered -32600 with a null id."""
    config = AcpConfig(provider=ScriptedProvider([]))
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(tmp_path / "data", config) as (_, client):
            for frame in BAD_NOTIFICATIONS:
                await client._write(frame)
            await client._write({"jsonrpc": "2.0", "params": {}})
            listed = await client.call("session/list", {})
    assert "sessions" in listed["result"]
    answered_null = [f for f in client.frames if "error" in f and f.get("id") is None]
    assert [f["error"]["code"] for f in answered_null] == [-32600]
    assert "$.method" in answered_null[0]["error"]["message"]
    logged = capsys.readouterr().err
    assert logged.count("dropped a notification 'session/cancel'") == 3, logged
    assert "dropped a notification '_zed/whatever'" in logged


def test_a_bad_notification_is_read_as_one() -> None:
    """The frame reader tells a malformed notification from a frame to answer."""
    for frame in BAD_NOTIFICATIONS:
        read = acp.parse_message(json.dumps(frame).encode())
        assert isinstance(read, acp.BadNotification), frame
    read = acp.parse_message(b'{"jsonrpc": "2.0", "id": 3, "method": "x", "params": [1]}')
    assert not isinstance(read, acp.BadNotification)  # a request: answered with its id
    read = acp.parse_message(b'{"jsonrpc": "2.0", "method": 5}')
    assert not isinstance(read, acp.BadNotification)  # no method name: no call at all


# -- a write the editor was asked for ---------------------------------------------------------

WRITES = {"protocolVersion": 1, "clientCapabilities": {"fs": {"writeTextFile": True}}}


def write_script() -> ScriptedProvider:
    return ScriptedProvider(
        [
            Reply(blocks=(tool_call("w1", "write_file", path="notes.txt", content="two\n"),)),
            Reply(blocks=(text("Written."),)),
        ]
    )


@asynccontextmanager
async def writing_agent(tmp_path: Path) -> AsyncIterator[tuple[ScriptedProvider, Path, Client]]:
    """The agent on :func:`write_script` with the built-in tools: its model, the
    workspace (``tmp_path / "ws"``, made) and the editor's client."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    provider = write_script()
    config = AcpConfig(provider=provider, tools=builtin_tools())
    async with agent_on(tmp_path / "data", config) as (_, client):
        yield provider, workspace, client


async def asked_to_write(client: Client) -> dict[str, Any]:
    """Read up to the agent's ``fs/write_text_file`` request (allowing the call first)."""
    while True:
        frame = await client._read()
        if frame.get("method") == "session/request_permission":
            await client._permit(frame)
        elif frame.get("method") == "fs/write_text_file":
            return frame


async def write_kept_waiting(
    client: Client, workspace: Path, mock_clock: trio.testing.MockClock
) -> tuple[str, int, dict[str, Any]]:
    """Initialize with writes, open a session in ``workspace``, prompt it to write notes
    and read up to the agent's write request, which the editor then leaves unanswered for
    twice the editor's timeout: the session's id, the prompt's request id (not yet
    answered) and the write request."""
    await client.call("initialize", WRITES)
    created = await client.call("session/new", {"cwd": str(workspace), "mcpServers": []})
    sid = created["result"]["sessionId"]
    prompt = [{"type": "text", "text": "write notes"}]
    prompted = await client.send("session/prompt", {"sessionId": sid, "prompt": prompt})
    asked = await asked_to_write(client)
    await trio.testing.wait_all_tasks_blocked()
    mock_clock.jump(EDITOR_TIMEOUT_S * 2)  # the editor takes its time
    await trio.testing.wait_all_tasks_blocked()
    return sid, prompted, asked


async def test_a_write_the_editor_answers_late_is_the_write_it_did(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """R-ACP-2: an editor answered ``fs/write_text_file`` after 60 s (a slow disk, a dialog
    of its own): the write took effect in the editor, but greenroom had given up on it at
    60 s and told the model ``the editor could not write it``, so the model wrote again,
    or told the person it had failed. A write that was sent now waits for the editor's
    answer as long as its call runs: the model reads what the editor did."""
    async with writing_agent(tmp_path) as (provider, workspace, client):
        _, prompted, asked = await write_kept_waiting(client, workspace, mock_clock)
        (workspace / "notes.txt").write_text(asked["params"]["content"], encoding="utf-8")
        await client._write({"jsonrpc": "2.0", "id": asked["id"], "result": {}})
        answer = await client.answer_of(prompted)
    assert answer["result"]["stopReason"] == "end_turn", answer
    (result,) = [
        block
        for message in provider.requests[1].messages
        for block in getattr(message, "content", ())
        if isinstance(block, ToolResult)
    ]
    said = " ".join(getattr(b, "text", "") for b in result.content)
    assert said == "wrote 4 bytes to notes.txt", said
    assert not result.is_error


async def test_a_write_the_editor_never_answers_ends_with_the_interrupt(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """R-ACP-1, R-ACP-2: the wait for a write that was sent ends when the person cancels
    the prompt (``session/cancel``): the prompt is answered ``cancelled`` and the call is
    interrupted, not failed. Before, the write failed at 60 s and the task went on, the
    model told the write had failed."""
    async with writing_agent(tmp_path) as (provider, workspace, client):
        sid, prompted, _ = await write_kept_waiting(client, workspace, mock_clock)
        await client._write(
            {"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": sid}}
        )
        answer = await client.answer_of(prompted)
    assert answer["result"]["stopReason"] == "cancelled", answer
    assert len(provider.requests) == 1  # the model was not told the write failed
    ends = [
        u for u in client.updates()
        if u.get("toolCallId") == "w1" and u.get("status") in ("completed", "failed")
    ]  # fmt: skip
    assert [u["status"] for u in ends] == ["failed"]
    assert ends[0].get("_meta", {}).get("greenroom", {}).get("status") == "interrupted"
