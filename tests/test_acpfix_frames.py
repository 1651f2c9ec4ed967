"""Frames over the longest greenroom reads (64 MiB, R-ACP-1): the ACP agent in a subprocess
(``tests/support/acp_editor_agent.py``), the official ACP SDK's client side as the editor,
every frame checked against the SDK's schema.

An over-long line is dropped unread, but its start says what it was: a request is answered
with its id, so the editor's call ends; the editor's answer to one of greenroom's requests
(a file's text) fails that request at once, with no reply to the answer itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from acp import RequestError
from acp.schema import ReadTextFileResponse

from greenroom.protocols import acp
from greenroom.protocols.acp import MAX_FRAME_BYTES
from greenroom.protocols.jsonrpc import FrameError
from tests.test_acp import run, text
from tests.test_acp_editor import FILES, FilesEditor, editor_agent, open_session


class HugeFileEditor(FilesEditor):
    """An editor whose buffer of every file is one line longer than a frame may be."""

    async def read_text_file(self, *args: Any, **kwargs: Any) -> ReadTextFileResponse:
        self.requests.append(("fs/read_text_file", kwargs))
        return ReadTextFileResponse(content="x" * MAX_FRAME_BYTES)


def null_id_errors(raw: list[bytes]) -> list[dict[str, Any]]:
    frames = [json.loads(line) for line in raw]
    return [f for f in frames if "error" in f and f.get("id") is None]


def test_an_over_long_answer_of_the_editor_fails_its_read_at_once(tmp_path: Path) -> None:
    """fs/read_text_file answered with a text over the frame limit: the answer was dropped
    and greenroom replied to it as to a bad request of the editor's (an error with a null
    id), while the read waited for an answer that would never come, then failed after a
    minute as unanswered. The read fails at once, saying the answer was too large, and
    the task goes on; nothing is replied to the answer."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("short on disk\n", encoding="utf-8")

    async def scenario() -> None:
        editor = HugeFileEditor()
        async with editor_agent(tmp_path, editor=editor) as agent:
            sid = await open_session(agent, workspace, FILES)
            answer = await agent.conn.prompt(session_id=sid, prompt=text("read notes.txt"))
            assert answer.stop_reason == "end_turn"
            (end,) = editor.ends()
            assert end.status == "failed"
            said = editor.said(end)
            assert "notes.txt: the editor could not read it: the answer was a" in said
            assert f"larger than {MAX_FRAME_BYTES}" in said
            assert await agent.close_stdin() == 0
            assert null_id_errors(agent.raw) == []
            agent.check_frames()

    run(scenario())


def test_an_over_long_prompt_is_answered_with_its_id(tmp_path: Path) -> None:
    """A session/prompt over the frame limit (a large pasted text or image) was answered
    -32600 with a null id: the editor could not tell which request failed, and its prompt
    waited for good. It is answered -32600 with its own id, and the session goes on."""
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def scenario() -> None:
        async with editor_agent(tmp_path) as agent:
            sid = await open_session(agent, workspace, FILES)
            with pytest.raises(RequestError) as refused:
                await agent.conn.prompt(session_id=sid, prompt=text("y" * MAX_FRAME_BYTES))
            assert refused.value.code == -32600
            assert f"larger than {MAX_FRAME_BYTES}" in str(refused.value)
            answer = await agent.conn.prompt(session_id=sid, prompt=text("hello"))
            assert answer.stop_reason == "end_turn"
            assert await agent.close_stdin() == 0
            assert null_id_errors(agent.raw) == []
            agent.check_frames()

    run(scenario())


def test_the_splitter_keeps_the_start_of_a_dropped_line_to_answer_it_by() -> None:
    """The start of an over-long line, however it arrives, names what it was: a request
    by its id (answered with it), an answer to one of greenroom's requests (that request
    fails), or nothing known (a null id)."""
    splitter = acp.LineSplitter(max_bytes=64)
    request = b'{"jsonrpc":"2.0","id":7,"method":"session/prompt","params":{"t":"'
    out = splitter.feed(request[:20])
    out += splitter.feed(request[20:] + b"x" * 100)
    out += splitter.feed(b'"}}\n{"jsonrpc":"2.0","id":3,"result":{"content":"' + b"y" * 100)
    # Its id comes after the first 4 KiB kept, and the one in its params is not it.
    out += splitter.feed(b'"}}\n{"params":{"id":4,"t":"' + b"z" * 5000 + b'"},"id":5}\n')
    out += splitter.feed(b'{"jsonrpc":"2.0","method":"session/cancel","params":{"a":"')
    out += splitter.feed(b"w" * 100)
    out += splitter.close()
    dropped = [acp.too_long_error(piece) for piece in out if isinstance(piece, acp.TooLong)]
    assert len(dropped) == len(out) == 4
    asked, answered, unknown, notified = dropped
    assert isinstance(asked, FrameError) and asked.id == 7
    assert asked.error.code == -32600
    assert isinstance(answered, acp.Response) and answered.id == 3
    assert answered.error is not None and answered.error["code"] == -32600
    assert isinstance(unknown, FrameError) and unknown.id is None
    assert isinstance(notified, FrameError) and notified.id is None
