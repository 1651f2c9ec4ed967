"""The file tools against hostile workspaces: special files, catastrophic patterns, huge
lines, names that are not UTF-8, hard links to files outside (R-SEC-1, R-SEC-2)."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, Recorder, allow_all, collect, of_type

import greenroom.actors.tools.builtin as builtin
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import ImageRefused
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.builtin import (
    BuiltinToolError,
    list_dir,
    read_file,
    search_files,
    write_file,
)
from greenroom.protocols.content import user_image
from greenroom.protocols.outputs import TaskEnd, ToolCallOutput
from greenroom.protocols.tools import Tool, ToolContext


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


async def call(some_tool: Tool, workspace: Path, **arguments: Any) -> Any:
    assert some_tool.validate(arguments) == []
    ctx = ToolContext(
        call_id="c1",
        workspace_dir=workspace,
        scratchpad_dir=workspace / ".scratch",
        report_progress=lambda message: None,
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        return await some_tool.function(**arguments, ctx=ctx)


@pytest.fixture
def fifo(ws: Path) -> Iterator[Path]:
    """A FIFO in the workspace. Should a tool regress and block opening it, a timer opens
    the other end so the thread returns and the test fails instead of hanging."""
    path = ws / "pipe"
    os.mkfifo(path)

    def unblock() -> None:
        for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
            with contextlib.suppress(OSError):  # no peer waiting on that side
                os.close(os.open(path, flags))

    guard = threading.Timer(RUN_TIMEOUT_S / 2, unblock)
    guard.start()
    yield path
    guard.cancel()


# --- special files (R-SEC-2) ---------------------------------------------------------


async def test_read_and_write_refuse_a_fifo_without_blocking(ws: Path, fifo: Path) -> None:
    with trio.fail_after(2):
        with pytest.raises(BuiltinToolError, match="pipe is a FIFO"):
            await call(read_file, ws, path="pipe")
        with pytest.raises(BuiltinToolError, match="pipe is a FIFO"):
            await call(write_file, ws, path="pipe", content="x")
        (ws / "note.txt").write_text("hello\n")
        assert await call(search_files, ws, pattern="hello") == "note.txt:1: hello"
        assert "pipe" in await call(list_dir, ws)


async def test_file_tools_refuse_sockets(ws: Path) -> None:
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(ws / "sock"))
        with pytest.raises(BuiltinToolError, match="sock is a socket"):
            await call(read_file, ws, path="sock")
        with pytest.raises(BuiltinToolError, match="sock is a socket"):
            await call(write_file, ws, path="sock", content="x")


async def test_a_fifo_read_in_a_session_neither_wedges_it_nor_the_host(
    host: Host, ws: Path, fifo: Path, providers
) -> None:
    """The model asks to read the FIFO: an error output, and the task completes."""
    provider = providers(
        [Reply(blocks=(tool_call("c1", "read_file", path="pipe"),)), Reply(blocks=(text("ok"),))]
    )
    session = await host.create_session(tools=[read_file], provider=provider, workspace_dir=ws)
    outputs = await collect(session.run("go", approve=allow_all), bound_s=3)
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.is_error and "FIFO" in output.content[0].text  # type: ignore[union-attr]
    assert of_type(outputs, TaskEnd)[0].status == "completed"


# --- catastrophic patterns (R-SEC-2) ---------------------------------------------------

# Exponential backtracking: about 2**28 steps for this line, over 10 s in Python's re,
# during which re holds the interpreter lock.
_CATASTROPHIC = r"(a+)+$"
_LINE_OF_AS = "a" * 28 + "!"


async def test_a_backtracking_search_is_interrupted_at_once(
    host: Host, ws: Path, providers
) -> None:
    """The first file matches at once; the interrupt comes when that match is reported,
    while the worker backtracks through the second."""
    (ws / "a-first.txt").write_text("aaaa\n")
    (ws / "b-long.txt").write_text(_LINE_OF_AS + "\n")
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "search_files", pattern=_CATASTROPHIC),)),
            Reply(blocks=(text("ok"),)),
        ]
    )
    session = await host.create_session(tools=[search_files], provider=provider, workspace_dir=ws)
    recorder = Recorder(session)
    stream = session.run("go", approve=allow_all)
    await recorder.wait_for("tool_progress", call_id="c1", message="1 match so far")
    interrupted_at = trio.current_time()
    assert session.interrupt("stop")
    outputs = await collect(stream, bound_s=3)
    assert trio.current_time() - interrupted_at < 1
    assert of_type(outputs, TaskEnd)[0].status == "aborted"
    (output,) = of_type(outputs, ToolCallOutput)
    assert output.status == "interrupted"


async def test_a_backtracking_search_stops_at_its_time_budget(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long enough for the worker to start and report the first file on a busy machine;
    # the backtracking line alone takes far longer.
    monkeypatch.setattr(builtin, "_SEARCH_TIME_BUDGET_S", 2.0)
    (ws / "a-first.txt").write_text("aaa found\n")
    (ws / "b-long.txt").write_text(_LINE_OF_AS + "\n")
    with trio.fail_after(20):
        result = await call(search_files, ws, pattern=r"(a+)+$|found")
    lines = result.splitlines()
    assert lines[0] == "a-first.txt:1: aaa found"
    assert "search stopped after 2 s" in lines[-1]
    # A normal search is unaffected.
    assert await call(search_files, ws, pattern="found") == "a-first.txt:1: aaa found"


# --- huge lines (bounded memory) ------------------------------------------------------


async def test_read_file_of_one_huge_line_stays_in_bounded_memory(ws: Path) -> None:
    path = ws / "one-line.txt"
    block = b"x" * (1024 * 1024)
    with path.open("wb") as out:
        for _ in range(50):
            out.write(block)
    tracemalloc.start()
    try:
        result = await call(read_file, ws, path="one-line.txt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024, f"peak {peak} bytes"
    assert result.startswith("     1\t" + "x" * builtin._MAX_LINE_CHARS + "…")
    assert "[line cut: about 52426800 more bytes]" in result


def _reference_window(data: bytes, offset: int, limit: int) -> tuple[list[str], bool]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    window = [line.decode("utf-8", errors="replace").rstrip("\r") for line in lines]
    return window[offset : offset + limit], len(lines) > offset + limit


async def test_read_file_windows_agree_with_splitting_the_whole_file(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offsets and limits by lines, read in tiny chunks so that lines, newlines and
    multi-byte characters straddle chunk boundaries."""
    monkeypatch.setattr(builtin, "_READ_CHUNK", 7)
    rng = random.Random(5)
    for trial in range(40):
        pieces = [rng.choice(["", "a", "é", "line", "\r", "€uro", "x" * 20]) for _ in range(60)]
        data = "\n".join(
            "".join(pieces[i : i + rng.randint(0, 4)]) for i in range(0, 60, 3)
        ).encode()
        if trial % 2:
            data += b"\n"
        (ws / "f.txt").write_bytes(data)
        offset, limit = rng.randint(0, 25), rng.randint(1, 8)
        expected, more = _reference_window(data, offset, limit)
        result = await call(read_file, ws, path="f.txt", offset=offset, limit=limit)
        if not expected:
            assert "is empty" in result or "past the end" in result
            continue
        lines = result.split("\n")
        if more:
            assert f"offset={offset + len(expected)}" in lines.pop()
        assert [line.split("\t", 1)[1] for line in lines] == expected, (data, offset, limit)


# --- names that are not UTF-8 ---------------------------------------------------------


async def test_list_dir_shows_names_that_are_not_utf8_escaped(ws: Path) -> None:
    os.close(os.open(os.fsencode(ws) + b"/bad-\xff\xfe.txt", os.O_CREAT | os.O_WRONLY))
    (ws / "good.txt").write_text("fine")
    listing = await call(list_dir, ws)
    listing.encode("utf-8")  # nothing unencodable reaches the model or the trace
    assert listing.splitlines() == ["bad-\\xff\\xfe.txt  (0 bytes)", "good.txt  (4 bytes)"]


async def test_a_path_with_a_lone_surrogate_is_refused_in_words(ws: Path) -> None:
    """R-SEC-1: a path no file system can hold (a lone surrogate, as JSON can spell one)
    is a clear refusal from every file tool, wherever it stands in the path, and never a
    raw UnicodeEncodeError."""
    (ws / "dir").mkdir()
    for path in ("\ud800", "dir/\ud800.txt", f"{ws}/\udfff", "/elsewhere/\ud800"):
        shown = repr(path)
        for some_tool, extra in (
            (read_file, {}),
            (write_file, {"content": "x"}),
            (list_dir, {}),
            (search_files, {"pattern": "x"}),
        ):
            with pytest.raises(BuiltinToolError) as refused:
                await call(some_tool, ws, path=path, **extra)
            assert str(refused.value) == (
                f"path {shown} is not valid text (it holds a lone surrogate)"
            ), some_tool.name
    assert sorted(os.listdir(ws)) == ["dir"]


async def test_an_image_path_with_a_lone_surrogate_is_refused_in_the_same_words(
    tmp_path: Path, ws: Path
) -> None:
    """R-SEC-1, R-SEC-8: the image reader judges a path as the file tools do."""
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=ScriptedProvider([]), workspace_dir=ws)
        with pytest.raises(ImageRefused) as refused:
            await session.attach([user_image("shot-\ud800.png")])
    assert refused.value.reason == "the path is not valid text (it holds a lone surrogate)"


# --- hard links (R-SEC-1) -------------------------------------------------------------


async def test_hard_links_to_files_outside_are_refused(ws: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    os.link(secret, ws / "linked.txt")
    with pytest.raises(BuiltinToolError, match="hard links"):
        await call(read_file, ws, path="linked.txt")
    with pytest.raises(BuiltinToolError, match="hard links"):
        await call(write_file, ws, path="linked.txt", content="pwned")
    assert secret.read_text() == "top secret\n"
    searched = await call(search_files, ws, pattern="secret")
    assert searched.splitlines() == [
        "no matches for 'secret' in .",
        "[skipped 1 files with hard links outside the workspace]",
    ]


async def test_hard_links_inside_the_workspace_are_allowed(ws: Path) -> None:
    (ws / "sub").mkdir()
    (ws / "a.txt").write_text("shared\n")
    os.link(ws / "a.txt", ws / "sub" / "b.txt")
    assert await call(read_file, ws, path="sub/b.txt") == "     1\tshared"
    await call(write_file, ws, path="sub/b.txt", content="changed\n")
    assert (ws / "a.txt").read_text() == "changed\n"
