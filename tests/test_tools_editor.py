"""The built-in tools through an editor (R-ACP-2, R-SEC-7): with ``ToolContext.editor``
set, ``read_file`` and ``write_file`` ask the editor and ``run_shell`` runs in its
terminal when the session's sandbox is ``off`` — each only after the same workspace checks
as on the disk, so nothing outside the workspace, in the data dir, special or hard-linked
from outside is ever asked of the editor. A session's tasks take its ``editor``, and its
subagents work through it too."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.tools.builtin import (
    BuiltinToolError,
    ShellTimeoutError,
    read_file,
    run_shell,
    write_file,
)
from greenroom.actors.tools.workspace import identify_workspace
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.outputs import ToolCallOutput
from greenroom.protocols.tools import (
    EditorError,
    TerminalRun,
    Tool,
    ToolContext,
    WorkspaceIdentity,
)


@attrs.define
class FakeEditor:
    """An editor with buffers of its own; it records what it is asked."""

    reads: bool = True
    writes: bool = True
    runs: bool = True
    buffers: dict[str, str] = attrs.Factory(dict)
    asked: list[tuple[str, Any]] = attrs.Factory(list)
    diffs: list[tuple[str, str, str | None, str]] = attrs.Factory(list)
    ran: TerminalRun = attrs.Factory(lambda: TerminalRun(output="ok\n", exit_code=0))
    fail: str | None = None

    async def read_text(
        self, path: str, *, line: int | None = None, limit: int | None = None
    ) -> str:
        await trio.lowlevel.checkpoint()
        self.asked.append(("read", (path, line, limit)))
        if self.fail is not None:
            raise EditorError(self.fail)
        lines = self.buffers[path].splitlines(keepends=True)
        start = (line or 1) - 1
        return "".join(lines[start : start + limit] if limit is not None else lines[start:])

    async def write_text(self, path: str, content: str) -> None:
        await trio.lowlevel.checkpoint()
        self.asked.append(("write", (path, content)))
        self.buffers[path] = content

    def show_diff(self, call_id: str, path: str, old_text: str | None, new_text: str) -> None:
        self.diffs.append((call_id, path, old_text, new_text))

    async def run(
        self, command: str, *, cwd: str, timeout_s: float, output_limit: int, call_id: str,
        report_progress: Callable[[str], None],
    ) -> TerminalRun:  # fmt: skip
        await trio.lowlevel.checkpoint()
        self.asked.append(("run", (command, cwd, timeout_s, output_limit, call_id)))
        report_progress("running in the editor's terminal")
        return self.ran


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "notes.txt").write_text("on disk\n", encoding="utf-8")
    (tmp_path / "secret.txt").write_text("secret\n", encoding="utf-8")
    return root.resolve()


async def call(
    some_tool: Tool, workspace: Path, editor: FakeEditor, sandbox: str = "auto",
    private: tuple[Path, ...] = (), identity: WorkspaceIdentity | None = None,
    **arguments: Any,
) -> Any:  # fmt: skip
    ctx = ToolContext(
        call_id="c1",
        workspace_dir=workspace,
        scratchpad_dir=workspace.parent / "scratch",
        report_progress=lambda message: None,
        sandbox=sandbox,  # type: ignore[arg-type]
        private_dirs=private,
        workspace_identity=identity,
        editor=editor,
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        return await some_tool.function(**arguments, ctx=ctx)


async def test_read_file_reads_the_editors_buffer_in_the_usual_shape(ws: Path) -> None:
    """R-ACP-2: the buffer, not the disk; 1-based line and one line more than the limit;
    numbered lines, the more-lines note, long lines cut, binary text refused."""
    notes = str(ws / "notes.txt")
    editor = FakeEditor(buffers={notes: "one\ntwo\nthree\n" + "x" * 3000 + "\n"})
    assert await call(read_file, ws, editor, path="notes.txt", limit=2) == (
        "     1\tone\n     2\ttwo\n[lines 1-2 shown; more lines remain: read again with offset=2]"
    )
    assert editor.asked == [("read", (notes, 1, 3))]
    shown = await call(read_file, ws, editor, path=notes, offset=3)
    assert shown.startswith("     4\txxx") and "[line cut: 1000 more characters]" in shown
    assert await call(read_file, ws, editor, path="notes.txt", offset=9) == (
        "[notes.txt has no more than 9 lines; offset 9 is past the end]"
    )
    editor.buffers[notes] = ""
    assert await call(read_file, ws, editor, path="notes.txt") == "[notes.txt is empty]"
    editor.buffers[notes] = "a\0b"
    with pytest.raises(BuiltinToolError, match="binary"):
        await call(read_file, ws, editor, path="notes.txt")
    editor.fail = "no such buffer"
    with pytest.raises(BuiltinToolError, match="the editor could not read it: no such buffer"):
        await call(read_file, ws, editor, path="notes.txt")


async def test_nothing_outside_the_workspace_is_asked_of_the_editor(
    ws: Path, tmp_path: Path
) -> None:
    """R-SEC-7: ``..``, an absolute path outside, a symlink out, the data dir inside the
    workspace, a FIFO, a file hard-linked from outside and a replaced workspace are refused
    by the checks the disk tools make, before the editor is asked anything; the file
    inside is read through it."""
    data = ws / "data"
    data.mkdir()
    (data / "serve.token").write_text("t\n", encoding="utf-8")
    (ws / "out").symlink_to(tmp_path / "secret.txt")
    os.mkfifo(ws / "pipe")
    os.link(tmp_path / "secret.txt", ws / "hard.txt")
    notes = str(ws / "notes.txt")
    editor = FakeEditor(buffers={notes: "buffer\n"})
    for path in ("../secret.txt", str(tmp_path / "secret.txt"), "out", "data/serve.token",
                 "pipe", "hard.txt"):  # fmt: skip
        with pytest.raises(BuiltinToolError):
            await call(read_file, ws, editor, private=(data,), path=path)
        with pytest.raises(BuiltinToolError):
            await call(write_file, ws, editor, private=(data,), path=path, content="x")
    assert editor.asked == []
    identity = identify_workspace(ws)
    assert await call(read_file, ws, editor, identity=identity, path="notes.txt") == (
        "     1\tbuffer"
    )
    os.rename(ws, tmp_path / "moved")
    os.symlink(tmp_path, ws)  # the workspace replaced by a way out
    with pytest.raises(BuiltinToolError, match="was replaced"):
        await call(read_file, ws, editor, identity=identity, path="secret.txt")
    with pytest.raises(BuiltinToolError, match="was replaced"):
        await call(write_file, ws, editor, identity=identity, path="secret.txt", content="x")
    assert editor.asked == [("read", (notes, 1, 2001))] and editor.diffs == []
    assert (tmp_path / "secret.txt").read_text() == "secret\n"


async def test_write_file_writes_through_the_editor_and_shows_a_diff(ws: Path) -> None:
    """R-ACP-2: the editor writes; the diff's old text is the editor's buffer when it
    reads files, the disk's when it only writes, null for a new file (its parents made
    first); a binary file's edit has no diff."""
    notes = str(ws / "notes.txt")
    editor = FakeEditor(buffers={notes: "in the buffer\n"})
    assert await call(write_file, ws, editor, path="notes.txt", content="new\n") == (
        "wrote 4 bytes to notes.txt"
    )
    assert editor.asked == [("read", (notes, None, None)), ("write", (notes, "new\n"))]
    assert editor.diffs == [("c1", notes, "in the buffer\n", "new\n")]
    assert (ws / "notes.txt").read_text() == "on disk\n"  # the editor's to write

    writer = FakeEditor(reads=False)
    await call(write_file, ws, writer, path="notes.txt", content="new\n")
    await call(write_file, ws, writer, path="deep/er/new.txt", content="hi")
    assert (ws / "deep" / "er").is_dir()
    (ws / "blob.bin").write_bytes(b"\0\1")
    await call(write_file, ws, writer, path="blob.bin", content="text")
    assert writer.diffs == [
        ("c1", notes, "on disk\n", "new\n"),
        ("c1", str(ws / "deep" / "er" / "new.txt"), None, "hi"),
    ]
    assert [kind for kind, _ in writer.asked] == ["write", "write", "write"]


async def test_run_shell_runs_in_the_editors_terminal_only_with_sandbox_off(ws: Path) -> None:
    """R-ACP-2, R-SEC-3: under ``auto`` and ``required`` the editor's terminal is never
    used (greenroom's sandbox applies); under ``off`` the command runs there, in the
    workspace, with the shell's output cap; its exit, signal and timeout are told as a
    local run's."""
    editor = FakeEditor()
    for sandbox in ("auto", "required"):
        try:
            said = await call(run_shell, ws, editor, sandbox=sandbox, command="echo here")
        except BuiltinToolError as exc:  # required, where bubblewrap cannot run
            assert "sandbox=required" in str(exc)
        else:
            assert said == "exit code: 0\nhere\n"
    assert editor.asked == []
    assert await call(run_shell, ws, editor, sandbox="off", command="make") == (
        "exit code: 0\nok\n"
    )
    assert editor.asked == [("run", ("make", str(ws), 60, 256 * 1024, "c1"))]
    editor.ran = TerminalRun(output="tail\n", truncated=True, signal="SIGTERM")
    assert await call(run_shell, ws, editor, sandbox="off", command="x") == (
        "killed by signal SIGTERM\n[… the start of the output was dropped by the editor …]\n"
        "tail\n"
    )
    editor.ran = TerminalRun(output="so far\n", timed_out=True)
    with pytest.raises(ShellTimeoutError, match=r"timed out after 2 s(.|\n)*so far"):
        await call(run_shell, ws, editor, sandbox="off", command="sleep 9", timeout_s=2)


async def test_a_sessions_tasks_and_subagents_work_through_its_editor(
    host: Host, workspace: Path, providers: Any
) -> None:
    """A session's ``editor`` is its tasks' (the tool pool gives it to each call) and its
    subagents' (a child gets its parent's): both read the editor's buffer."""
    (Path(workspace) / "notes.txt").write_text("on disk\n", encoding="utf-8")

    def brain(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        done = isinstance(last, UserMessage) and any(
            isinstance(p, ToolResult) for p in last.content
        )
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            if done:
                return Reply(blocks=(text("child read it"),))
            return Reply(blocks=(tool_call("k1", "read_file", path="notes.txt"),))
        if done:
            return Reply(blocks=(text("done"),))
        return Reply(blocks=(
            tool_call("r1", "read_file", path="notes.txt"),
            tool_call("s1", "spawn_subagent", task="read the notes"),
        ))  # fmt: skip

    session = await host.create_session(
        tools=[read_file, spawn_subagent], provider=providers(brain), workspace_dir=workspace
    )
    notes = str(session.workspace_dir / "notes.txt")
    editor = FakeEditor(buffers={notes: "in the buffer\n"})
    session.editor = editor
    assert session.editor is editor
    outputs = await collect(session.run("go", approve=allow_all))
    reads = {
        o.call_id: "".join(b.text for b in o.content if isinstance(b, TextBlock))
        for o in of_type(outputs, ToolCallOutput)
        if o.tool == "read_file"
    }
    assert reads == {"r1": "     1\tin the buffer", "k1": "     1\tin the buffer"}
    assert editor.asked == [("read", (notes, 1, 2001))] * 2
