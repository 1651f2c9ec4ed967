"""The editor's files and terminal, modes, the session list, close and usage through ACP
(R-ACP-2, R-SEC-7): the agent in a subprocess (``tests/support/acp_editor_agent.py``:
``greenroom acp``'s set-up with the built-in tools and a scripted model that does what the
prompt says), the official ACP Python SDK's client side as the editor. The editor here
implements ``fs/*`` over real files and a buffer of unsaved text of its own, and
``terminal/*`` over real subprocesses; every frame greenroom writes is checked strictly
against the SDK's schema (``tests/test_acp.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from acp import RequestError
from acp.schema import (
    ClientCapabilities,
    ContentToolCallContent,
    CreateTerminalResponse,
    FileEditToolCallContent,
    FileSystemCapabilities,
    KillTerminalResponse,
    ReadTextFileResponse,
    ReleaseTerminalResponse,
    TerminalExitStatus,
    TerminalOutputResponse,
    TerminalToolCallContent,
    WaitForTerminalExitResponse,
    WriteTextFileResponse,
)

from tests.test_acp import (
    PROMPT_CANCEL_S,
    ROOT,
    Agent,
    Editor,
    run,
    spawned_agent,
    text,
)

AGENT = ROOT / "tests" / "support" / "acp_editor_agent.py"

FILES = ClientCapabilities(fs=FileSystemCapabilities(read_text_file=True, write_text_file=True))
TERMINAL = ClientCapabilities(terminal=True)
EVERYTHING = ClientCapabilities(
    fs=FileSystemCapabilities(read_text_file=True, write_text_file=True), terminal=True
)


class _Terminal:
    """A command the editor runs for the agent: a real subprocess and its output."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.output = bytearray()
        self.released = False
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while chunk := await self.process.stdout.read(1 << 16):
            self.output += chunk

    def status(self) -> tuple[int | None, str | None]:
        code = self.process.returncode
        if code is not None and code < 0:
            return None, signal.Signals(-code).name
        return code, None


class FilesEditor(Editor):
    """An editor that reads and writes files for the agent — its own unsaved buffers first
    — and runs its commands in terminals of its own; it records every such request. With
    ``hold`` set, a read waits for it (``reading`` says one waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[str, str] = {}
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.terminals: dict[str, _Terminal] = {}
        self.hold: asyncio.Event | None = None
        self.reading = asyncio.Event()
        self.released = asyncio.Event()

    async def read_text_file(
        self, session_id: str, path: str, line: int | None = None, limit: int | None = None,
        **kwargs: Any,
    ) -> ReadTextFileResponse:  # fmt: skip
        self.requests.append(("fs/read_text_file", {"path": path, "line": line, "limit": limit}))
        if self.hold is not None:
            self.reading.set()
            await self.hold.wait()
        if path in self.buffers:
            whole = self.buffers[path]
        else:
            try:
                whole = await asyncio.to_thread(Path(path).read_text, encoding="utf-8")
            except FileNotFoundError:
                raise RequestError.resource_not_found(path) from None
        lines = whole.splitlines(keepends=True)
        start = (line or 1) - 1
        chosen = lines[start : start + limit] if limit is not None else lines[start:]
        return ReadTextFileResponse(content="".join(chosen))

    async def write_text_file(
        self, session_id: str, path: str, content: str, **kwargs: Any
    ) -> WriteTextFileResponse:
        self.requests.append(("fs/write_text_file", {"path": path, "content": content}))
        await asyncio.to_thread(Path(path).write_text, content, encoding="utf-8")
        self.buffers[path] = content
        return WriteTextFileResponse()

    async def create_terminal(
        self, session_id: str, command: str, args: list[str] | None = None,
        env: Any = None, cwd: str | None = None, output_byte_limit: int | None = None,
        **kwargs: Any,
    ) -> CreateTerminalResponse:  # fmt: skip
        self.requests.append(
            ("terminal/create", {"command": command, "args": args, "cwd": cwd,
                                 "outputByteLimit": output_byte_limit})
        )  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            command, *(args or []), cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        terminal_id = f"term-{len(self.terminals) + 1}"
        self.terminals[terminal_id] = _Terminal(process)
        return CreateTerminalResponse(terminal_id=terminal_id)

    async def terminal_output(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> TerminalOutputResponse:
        self.requests.append(("terminal/output", {"terminalId": terminal_id}))
        terminal = self.terminals[terminal_id]
        code, name = terminal.status()
        exited = terminal.process.returncode is not None
        if exited:
            await terminal.reader
        return TerminalOutputResponse(
            output=terminal.output.decode(),
            truncated=False,
            exit_status=TerminalExitStatus(exit_code=code, signal=name) if exited else None,
        )

    async def wait_for_terminal_exit(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> WaitForTerminalExitResponse:
        self.requests.append(("terminal/wait_for_exit", {"terminalId": terminal_id}))
        terminal = self.terminals[terminal_id]
        await terminal.process.wait()
        await terminal.reader
        code, name = terminal.status()
        return WaitForTerminalExitResponse(exit_code=code, signal=name)

    async def kill_terminal(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> KillTerminalResponse:
        self.requests.append(("terminal/kill", {"terminalId": terminal_id}))
        with contextlib.suppress(ProcessLookupError):
            self.terminals[terminal_id].process.kill()
        return KillTerminalResponse()

    async def release_terminal(
        self, session_id: str, terminal_id: str, **kwargs: Any
    ) -> ReleaseTerminalResponse:
        self.requests.append(("terminal/release", {"terminalId": terminal_id}))
        terminal = self.terminals[terminal_id]
        terminal.released = True
        with contextlib.suppress(ProcessLookupError):
            terminal.process.kill()
        await terminal.process.wait()
        self.released.set()
        return ReleaseTerminalResponse()

    def methods(self) -> list[str]:
        return [method for method, _ in self.requests]

    def ends(self) -> list[Any]:
        """The final update of each tool call, in order."""
        return [
            u for _, u in self.updates
            if u.session_update == "tool_call_update" and u.status in ("completed", "failed")
        ]  # fmt: skip

    def said(self, update: Any) -> str:
        return "".join(
            c.content.text for c in update.content or () if isinstance(c, ContentToolCallContent)
        )


@contextlib.asynccontextmanager
async def editor_agent(
    tmp_path: Path, sandbox: str = "auto", approve: str = "all", editor: Editor | None = None
) -> AsyncIterator[Agent]:
    """The agent of :data:`AGENT` with ``editor`` (a new :class:`FilesEditor` if none)."""
    async with spawned_agent(
        tmp_path, editor or FilesEditor(), sys.executable, str(AGENT), str(tmp_path / "data"),
        sandbox, approve,
    ) as agent:  # fmt: skip
        yield agent


def files_of(agent: Agent) -> FilesEditor:
    assert isinstance(agent.editor, FilesEditor)
    return agent.editor


async def open_session(agent: Agent, workspace: Path, capabilities: ClientCapabilities) -> str:
    await agent.conn.initialize(protocol_version=1, client_capabilities=capabilities)
    created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])
    return created.session_id


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    directory.mkdir()
    (directory / "notes.txt").write_text("saved on disk\n", encoding="utf-8")
    (tmp_path / "outside.txt").write_text("not yours\n", encoding="utf-8")
    (directory / "link.txt").symlink_to(tmp_path / "outside.txt")
    return directory.resolve()


def test_files_are_read_and_written_through_the_editor_and_edits_are_diffs(
    tmp_path: Path, workspace: Path
) -> None:
    """R-ACP-2: with ``fs.readTextFile`` and ``writeTextFile``, read_file reads the editor's
    unsaved buffer (not the disk) by absolute path with 1-based ``line``; write_file has
    the editor write (its buffer and the file, parents created first) and the call shows
    the edit as a ``diff`` from the buffer's text (null for a new file). R-SEC-7: a path
    outside the workspace — by ``..``, by a symlink, for a write — is refused before the
    editor is asked anything."""
    notes = str(workspace / "notes.txt")

    async def scenario() -> None:
        async with editor_agent(tmp_path) as agent:
            editor = files_of(agent)
            editor.buffers[notes] = "unsaved one\nunsaved two\n"
            sid = await open_session(agent, workspace, FILES)

            answer = await agent.conn.prompt(session_id=sid, prompt=text("read notes.txt"))
            assert answer.stop_reason == "end_turn"
            assert editor.requests == [
                ("fs/read_text_file", {"path": notes, "line": 1, "limit": 2001})
            ]
            read = editor.ends()[-1]
            assert read.status == "completed"
            assert editor.said(read) == "     1\tunsaved one\n     2\tunsaved two"
            assert "saved on disk" not in editor.text()

            answer = await agent.conn.prompt(
                session_id=sid, prompt=text("write notes.txt fresh\\n")
            )
            assert answer.stop_reason == "end_turn"
            assert editor.requests[-2:] == [
                ("fs/read_text_file", {"path": notes, "line": None, "limit": None}),
                ("fs/write_text_file", {"path": notes, "content": "fresh\n"}),
            ]
            assert (workspace / "notes.txt").read_text() == "fresh\n"
            wrote = editor.ends()[-1]
            assert wrote.status == "completed"
            diff = wrote.content[0]
            assert isinstance(diff, FileEditToolCallContent) and diff.type == "diff"
            assert (diff.path, diff.old_text, diff.new_text) == (
                notes, "unsaved one\nunsaved two\n", "fresh\n"
            )
            assert editor.said(wrote) == "wrote 6 bytes to notes.txt"

            await agent.conn.prompt(session_id=sid, prompt=text("write sub/new.txt hi"))
            new = str(workspace / "sub" / "new.txt")
            assert editor.requests[-1] == ("fs/write_text_file", {"path": new, "content": "hi"})
            diff = editor.ends()[-1].content[0]
            assert isinstance(diff, FileEditToolCallContent)
            assert (diff.path, diff.old_text, diff.new_text) == (new, None, "hi")

            asked = len(editor.requests)
            for prompt in ("read ../outside.txt", "read link.txt", "write ../outside.txt x"):
                answer = await agent.conn.prompt(session_id=sid, prompt=text(prompt))
                assert answer.stop_reason == "end_turn"
                refused = editor.ends()[-1]
                assert refused.status == "failed", prompt
                assert "outside the workspace" in editor.said(refused), prompt
            assert len(editor.requests) == asked, "the editor was asked about a path outside"
            assert (tmp_path / "outside.txt").read_text() == "not yours\n"
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_run_shell_uses_the_editors_terminal_only_with_sandbox_off(
    tmp_path: Path, workspace: Path
) -> None:
    """R-ACP-2, R-SEC-3: an editor that offers ``terminal`` runs run_shell's commands only
    in a session whose sandbox is ``off``: there the command runs in a terminal of the
    editor (``bash -c`` in the workspace), embedded in the call as ``terminal`` content
    before it ends, waited for, read and released; under ``auto`` it runs in greenroom's
    own sandbox and the editor is asked nothing. Without ``fs`` the files are read from
    the disk."""

    async def local() -> None:
        async with editor_agent(tmp_path, sandbox="auto") as agent:
            editor = files_of(agent)
            editor.buffers[str(workspace / "notes.txt")] = "unsaved\n"
            sid = await open_session(agent, workspace, TERMINAL)
            await agent.conn.prompt(session_id=sid, prompt=text("run echo local"))
            assert editor.said(editor.ends()[-1]) == "exit code: 0\nlocal\n"
            await agent.conn.prompt(session_id=sid, prompt=text("read notes.txt"))
            assert editor.said(editor.ends()[-1]) == "     1\tsaved on disk"
            assert editor.requests == []
            assert await agent.close_stdin() == 0
            agent.check_frames()

    async def through_the_editor() -> None:
        async with editor_agent(tmp_path, sandbox="off") as agent:
            editor = files_of(agent)
            sid = await open_session(agent, workspace, TERMINAL)
            answer = await agent.conn.prompt(
                session_id=sid, prompt=text("run echo from the editor; pwd; exit 3")
            )
            assert answer.stop_reason == "end_turn"
            assert editor.methods() == [
                "terminal/create", "terminal/wait_for_exit", "terminal/output",
                "terminal/release",
            ]  # fmt: skip
            assert editor.requests[0][1] == {
                "command": "bash",
                "args": ["-c", "echo from the editor; pwd; exit 3"],
                "cwd": str(workspace),
                "outputByteLimit": 256 * 1024,
            }
            calls = [u for _, u in editor.updates if getattr(u, "tool_call_id", None) == "c1"]
            shown = [
                u for u in calls
                if u.session_update == "tool_call_update" and u.status == "in_progress"
                and u.content and isinstance(u.content[0], TerminalToolCallContent)
            ]  # fmt: skip
            assert shown and shown[0].content[0].terminal_id == "term-1"
            end = editor.ends()[-1]
            assert end.status == "completed" and calls.index(shown[0]) < calls.index(end)
            assert isinstance(end.content[0], TerminalToolCallContent)
            assert editor.said(end) == f"exit code: 3\nfrom the editor\n{workspace}\n"
            assert editor.terminals["term-1"].released
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(local())
    run(through_the_editor())


def test_a_cancelled_command_is_killed_in_the_editors_terminal(
    tmp_path: Path, workspace: Path
) -> None:
    """R-ACP-2, R-ABORT-1: session/cancel while the editor's terminal runs the command
    answers the prompt cancelled promptly and releases the terminal (which kills the
    command); the call ends failed, its terminal still shown."""

    async def scenario() -> None:
        async with editor_agent(tmp_path, sandbox="off") as agent:
            editor = files_of(agent)
            sid = await open_session(agent, workspace, TERMINAL)
            prompt = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text("run sleep 600"))
            )
            await editor.wait_for(
                lambda u: u.session_update == "tool_call_update" and bool(u.content)
                and isinstance(u.content[0], TerminalToolCallContent)
            )  # fmt: skip
            await agent.conn.cancel(session_id=sid)
            answer = await asyncio.wait_for(prompt, PROMPT_CANCEL_S)
            assert answer.stop_reason == "cancelled"
            await asyncio.wait_for(editor.released.wait(), PROMPT_CANCEL_S)
            assert editor.methods() == [
                "terminal/create", "terminal/wait_for_exit", "terminal/release"
            ]
            terminal = editor.terminals["term-1"]
            assert terminal.released and terminal.process.returncode is not None
            end = editor.ends()[-1]
            assert end.status == "failed" and isinstance(end.content[0], TerminalToolCallContent)
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_modes_are_the_approval_policy_and_apply_to_the_next_calls(
    tmp_path: Path, workspace: Path
) -> None:
    """R-ACP-2, R-HITL: session/new answers the modes ``ask`` (current: ``--approve ask``),
    ``all`` and ``none``; session/set_mode changes the policy for the calls decided after
    it — in later prompts, and in the running task: a task started under ``all`` asks the
    editor about its next call once the mode is ``ask``, one started under ``ask`` has its
    next call denied unasked once the mode is ``none``. An unknown mode is -32602."""

    async def scenario() -> None:
        async with editor_agent(tmp_path, approve="ask") as agent:
            editor = files_of(agent)
            await agent.conn.initialize(protocol_version=1, client_capabilities=FILES)
            created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])
            sid = created.session_id
            assert created.modes is not None and created.modes.current_mode_id == "ask"
            assert [m.id for m in created.modes.available_modes] == ["ask", "all", "none"]

            await agent.conn.prompt(session_id=sid, prompt=text("read notes.txt"))
            assert len(editor.permissions) == 1 and editor.ends()[-1].status == "completed"
            await agent.conn.set_session_mode(session_id=sid, mode_id="all")
            await agent.conn.prompt(session_id=sid, prompt=text("read notes.txt"))
            assert len(editor.permissions) == 1 and editor.ends()[-1].status == "completed"
            await agent.conn.set_session_mode(session_id=sid, mode_id="none")
            await agent.conn.prompt(session_id=sid, prompt=text("read notes.txt"))
            assert len(editor.permissions) == 1
            denied = editor.ends()[-1]
            assert denied.status == "failed" and editor.said(denied) == "Tool call denied by user."

            async def twice(mode_then: str) -> None:
                editor.hold = asyncio.Event()
                editor.reading.clear()
                prompt = asyncio.create_task(
                    agent.conn.prompt(session_id=sid, prompt=text("twice notes.txt"))
                )
                await editor.reading.wait()  # the first call runs: the mode changes now
                await agent.conn.set_session_mode(session_id=sid, mode_id=mode_then)
                editor.hold.set()
                assert (await prompt).stop_reason == "end_turn"
                editor.hold = None

            await agent.conn.set_session_mode(session_id=sid, mode_id="all")
            await twice("ask")
            assert len(editor.permissions) == 2, "the second call was not asked about"
            assert [e.status for e in editor.ends()[-2:]] == ["completed", "completed"]

            await twice("none")  # the task starts under ask: its first call is asked
            assert len(editor.permissions) == 3, "the second call was asked about"
            assert [e.status for e in editor.ends()[-2:]] == ["completed", "failed"]

            with pytest.raises(RequestError) as unknown:
                await agent.conn.set_session_mode(session_id=sid, mode_id="yolo")
            assert unknown.value.code == -32602
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_sessions_are_listed_closed_and_prompts_report_their_usage(
    tmp_path: Path, workspace: Path
) -> None:
    """R-ACP-2: a prompt's answer carries the task's token usage and each model request a
    ``usage_update`` (context used of ``max_context_length``); session/list lists the
    data dir's sessions newest first with their cwd, last activity and title (the stored
    title, else the first prompt), filtered by ``cwd``; session/close ends a running task
    (its prompt answered cancelled), forgets the session (-32002 after) and keeps its
    trace: it is listed, loads and works again; session/fork still works and answers its
    modes."""
    other = tmp_path / "other"
    other.mkdir()

    async def scenario() -> None:
        async with editor_agent(tmp_path) as agent:
            editor = files_of(agent)
            first = await open_session(agent, workspace, FILES)
            answer = await agent.conn.prompt(session_id=first, prompt=text("hello  there\nfriend"))
            usage = answer.usage
            assert usage is not None and usage.total_tokens > 0 and usage.output_tokens > 0
            assert usage.total_tokens == (
                usage.input_tokens + usage.output_tokens + (usage.cached_read_tokens or 0)
                + (usage.cached_write_tokens or 0)
            )  # fmt: skip
            context = [u for _, u in editor.updates if u.session_update == "usage_update"]
            assert [(u.used, u.size) for u in context] == [(usage.total_tokens, 128_000)]

            second = (await agent.conn.new_session(cwd=str(other), mcp_servers=[])).session_id
            (tmp_path / "data" / "sessions" / second / "title.txt").write_text("Quarterly\n")
            listed = await agent.conn.list_sessions()
            assert [(s.session_id, s.cwd, s.title) for s in listed.sessions] == [
                (second, str(other.resolve()), "Quarterly"),
                (first, str(workspace), "hello there friend"),
            ]
            assert listed.next_cursor is None and all(s.updated_at for s in listed.sessions)
            only = await agent.conn.list_sessions(cwd=str(workspace))
            assert [s.session_id for s in only.sessions] == [first]
            with pytest.raises(RequestError) as bad:
                await agent.conn.list_sessions(cursor="not a cursor")
            assert bad.value.code == -32602

            forked = await agent.conn.fork_session(cwd=str(workspace), session_id=first)
            assert forked.modes is not None and forked.modes.current_mode_id == "all"
            again = await agent.conn.prompt(session_id=forked.session_id, prompt=text("hi"))
            assert again.stop_reason == "end_turn"

            editor.hold = asyncio.Event()
            running = asyncio.create_task(
                agent.conn.prompt(session_id=first, prompt=text("read notes.txt"))
            )
            await editor.reading.wait()
            await agent.conn.close_session(session_id=first)
            assert (await running).stop_reason == "cancelled"
            editor.hold.set()
            with pytest.raises(RequestError) as gone:
                await agent.conn.prompt(session_id=first, prompt=text("hi"))
            assert gone.value.code == -32002
            trace = next((tmp_path / "data" / "sessions" / first).glob("trace_*.jsonl"))
            records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
            assert records[-1]["type"] == "task_end" and records[-1]["status"] == "aborted"
            assert first in [s.session_id for s in (await agent.conn.list_sessions()).sessions]

            editor.hold = None
            loaded = await agent.conn.load_session(
                cwd=str(workspace), session_id=first, mcp_servers=[]
            )
            assert loaded.modes is not None and loaded.modes.current_mode_id == "all"
            back = await agent.conn.prompt(session_id=first, prompt=text("read notes.txt"))
            assert back.stop_reason == "end_turn"
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())
