"""Built-in tools against real files in a temporary workspace, and the --tools loader."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.tools.builtin import (
    BUILTIN_TOOLS,
    BuiltinToolError,
    OutsideWorkspaceError,
    ShellTimeoutError,
    builtin_tools,
    list_dir,
    read_file,
    run_shell,
    search_files,
    write_file,
)
from greenroom.actors.tools.loader import ToolLoadError, load_tools
from greenroom.protocols.tools import Tool, ToolContext


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the workspace with one secret file."""
    place = tmp_path / "outside"
    place.mkdir()
    (place / "secret.txt").write_text("top secret\n")
    return place


async def call(
    some_tool: Tool, workspace: Path, *, sandbox: Any = "auto", **arguments: Any
) -> Any:
    assert some_tool.validate(arguments) == []
    ctx = ToolContext(
        call_id="c1",
        workspace_dir=workspace,
        scratchpad_dir=workspace / ".scratch",
        report_progress=lambda message: None,
        sandbox=sandbox,
    )
    with trio.fail_after(10):
        return await some_tool.function(**arguments, ctx=ctx)


def test_builtin_tool_set() -> None:
    assert [t.name for t in BUILTIN_TOOLS] == [
        "read_file", "list_dir", "search_files", "write_file", "run_shell"
    ]
    assert {t.name: t.parallel for t in BUILTIN_TOOLS} == {
        "read_file": True,
        "list_dir": True,
        "search_files": True,
        "write_file": False,
        "run_shell": False,
    }
    assert all(t.takes_ctx for t in BUILTIN_TOOLS)
    fresh = builtin_tools()
    fresh.append(read_file)
    assert len(BUILTIN_TOOLS) == 5 and len(builtin_tools()) == 5


# --- read_file -----------------------------------------------------------------------


async def test_read_file_numbers_lines(workspace: Path) -> None:
    (workspace / "a.txt").write_text("one\ntwo\r\nthree")
    text = await call(read_file, workspace, path="a.txt")
    assert text == "     1\tone\n     2\ttwo\n     3\tthree"


async def test_read_file_window_says_more_remain(workspace: Path) -> None:
    (workspace / "long.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    text = await call(read_file, workspace, path="long.txt", offset=2, limit=3)
    lines = text.splitlines()
    assert lines[:3] == ["     3\tline 3", "     4\tline 4", "     5\tline 5"]
    assert "more lines remain" in lines[3] and "offset=5" in lines[3]
    tail = await call(read_file, workspace, path="long.txt", offset=8, limit=5)
    assert tail == "     9\tline 9\n    10\tline 10"
    past = await call(read_file, workspace, path="long.txt", offset=20)
    assert "has 10 lines" in past and "past the end" in past


async def test_read_file_refuses_binary_and_bad_arguments(workspace: Path) -> None:
    (workspace / "blob.bin").write_bytes(b"PK\x03\x04\x00\x00binary")
    with pytest.raises(BuiltinToolError, match="binary file"):
        await call(read_file, workspace, path="blob.bin")
    with pytest.raises(BuiltinToolError, match="no such file"):
        await call(read_file, workspace, path="missing.txt")
    (workspace / "d").mkdir()
    with pytest.raises(BuiltinToolError, match="is a directory"):
        await call(read_file, workspace, path="d")
    (workspace / "a.txt").write_text("x\n")
    with pytest.raises(BuiltinToolError, match="offset"):
        await call(read_file, workspace, path="a.txt", offset=-1)
    with pytest.raises(BuiltinToolError, match="limit"):
        await call(read_file, workspace, path="a.txt", limit=0)


async def test_read_file_keeps_a_bounded_window_whatever_its_limit(workspace: Path) -> None:
    """R-SEC-9: the model chooses ``limit``; a 2 MB file of short lines read with a limit of
    a billion held every line at once (173 MiB at its peak). One call keeps at most 256 KiB
    of lines, says where to read on, and the next call goes on from there."""
    import tracemalloc

    (workspace / "log.txt").write_bytes(b"x\n" * 1_000_000)
    tracemalloc.start()
    try:
        text = await call(read_file, workspace, path="log.txt", limit=10**9)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MiB for a 2 MB file"
    *lines, note = text.splitlines()
    assert 10_000 < len(lines) < 20_000 and lines[-1] == f"{len(lines):>6}\tx"
    assert f"more lines remain: read again with offset={len(lines)}" in note
    after = await call(read_file, workspace, path="log.txt", offset=len(lines), limit=2)
    assert after.splitlines()[0] == f"{len(lines) + 1:>6}\tx"


async def test_a_path_that_goes_down_and_up_again_holds_no_descriptor_per_step(
    workspace: Path,
) -> None:
    """``a/../`` repeated kept one open directory a step until the walk ended: one call
    ran the host process out of descriptors (every session's trace writes and accepts
    failed meanwhile). The directories left are closed as the walk goes; past
    MAX_PATH_STEPS components a path is refused with a clear error."""
    import resource

    from greenroom.actors.tools.workspace import MAX_PATH_STEPS

    (workspace / "a").mkdir()
    (workspace / "x.txt").write_text("hello\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    try:
        text = await call(read_file, workspace, path="a/../" * 2000 + "x.txt")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert text == "     1\thello"
    with pytest.raises(BuiltinToolError, match=f"more than {MAX_PATH_STEPS} components"):
        await call(read_file, workspace, path="a/../" * MAX_PATH_STEPS + "x.txt")


async def test_read_file_empty(workspace: Path) -> None:
    (workspace / "empty.txt").write_text("")
    assert "empty" in await call(read_file, workspace, path="empty.txt")


# --- list_dir ------------------------------------------------------------------------


async def test_list_dir_sorted_with_markers_and_sizes(workspace: Path) -> None:
    (workspace / "zeta.txt").write_text("12345")
    (workspace / "alpha").mkdir()
    (workspace / "alpha" / "inner.txt").write_text("")
    (workspace / "beta.py").write_text("")
    assert await call(list_dir, workspace) == (
        "alpha/\nbeta.py  (0 bytes)\nzeta.txt  (5 bytes)"
    )
    assert await call(list_dir, workspace, path="alpha") == "inner.txt  (0 bytes)"
    with pytest.raises(BuiltinToolError, match="not a directory"):
        await call(list_dir, workspace, path="zeta.txt")


async def test_list_dir_does_not_stat_through_symlinks_outside(
    workspace: Path, outside: Path
) -> None:
    """R-SEC-7: a symlink in the workspace is shown as what it points at only inside it;
    one to a file or a directory outside was followed by the host, telling the model
    that the file exists, its kind and its size."""
    (workspace / "real").mkdir()
    (workspace / "real" / "f.txt").write_text("inside")
    (workspace / "alias").symlink_to("real/f.txt")
    (workspace / "here").symlink_to("real")
    (workspace / "leak").symlink_to(outside / "secret.txt")
    (workspace / "there").symlink_to(outside)
    outside_line = "  (a symlink that leads outside the workspace)"
    assert await call(list_dir, workspace) == "\n".join(
        [
            "alias  (6 bytes)",
            "here/",
            f"leak{outside_line}",
            "real/",
            f"there{outside_line}",
        ]
    )


# --- search_files --------------------------------------------------------------------


async def test_search_files_finds_matches_and_skips_git_and_binary(workspace: Path) -> None:
    (workspace / "src").mkdir()
    (workspace / "src" / "a.py").write_text("import os\ndef needle():\n    pass\n")
    (workspace / "b.txt").write_text("no match\nanother needle here\n")
    (workspace / ".git").mkdir()
    (workspace / ".git" / "config").write_text("needle in git\n")
    (workspace / "img.bin").write_bytes(b"\x00needle\x00")
    text = await call(search_files, workspace, pattern=r"need+le")
    assert text.splitlines() == ["b.txt:2: another needle here", "src/a.py:2: def needle():"]
    only_src = await call(search_files, workspace, pattern="needle", path="src")
    assert only_src == "src/a.py:2: def needle():"
    one_file = await call(search_files, workspace, pattern="^import", path="src/a.py")
    assert one_file == "src/a.py:1: import os"
    assert "no matches" in await call(search_files, workspace, pattern="absent")


async def test_search_files_caps_results(workspace: Path) -> None:
    (workspace / "many.txt").write_text("hit\n" * 500)
    lines = (await call(search_files, workspace, pattern="hit")).splitlines()
    assert len(lines) == 201
    assert lines[199] == "many.txt:200: hit"
    assert "stopped after 200 matches" in lines[200]


async def test_search_files_bad_regex(workspace: Path) -> None:
    with pytest.raises(BuiltinToolError, match="invalid regular expression"):
        await call(search_files, workspace, pattern="(unclosed")


async def test_search_files_skips_symlinked_file_outside(workspace: Path, outside: Path) -> None:
    (workspace / "link.txt").symlink_to(outside / "secret.txt")
    (workspace / "linkdir").symlink_to(outside, target_is_directory=True)
    assert "no matches" in await call(search_files, workspace, pattern="secret")


# --- write_file ----------------------------------------------------------------------


async def test_write_file_creates_parents_and_replaces(workspace: Path) -> None:
    result = await call(write_file, workspace, path="deep/er/new.txt", content="héllo\n")
    assert result == "wrote 7 bytes to deep/er/new.txt"
    assert (workspace / "deep" / "er" / "new.txt").read_text(encoding="utf-8") == "héllo\n"
    await call(write_file, workspace, path="deep/er/new.txt", content="short")
    assert (workspace / "deep" / "er" / "new.txt").read_text() == "short"
    with pytest.raises(BuiltinToolError, match="is a directory"):
        await call(write_file, workspace, path="deep", content="x")


# --- confinement ---------------------------------------------------------------------


def _escapes(workspace: Path, outside: Path) -> list[str]:
    (workspace / "out").symlink_to(outside, target_is_directory=True)
    (workspace / "secret-link.txt").symlink_to(outside / "secret.txt")
    return [
        "../outside/secret.txt",
        "sub/../../outside/secret.txt",
        str(outside / "secret.txt"),
        "out/secret.txt",
        "secret-link.txt",
    ]


async def test_read_file_refuses_paths_outside(workspace: Path, outside: Path) -> None:
    for path in _escapes(workspace, outside):
        with pytest.raises(OutsideWorkspaceError, match="outside the workspace"):
            await call(read_file, workspace, path=path)


async def test_list_dir_refuses_paths_outside(workspace: Path, outside: Path) -> None:
    _escapes(workspace, outside)
    for path in ["..", "../outside", str(outside), "/", "out", "out/."]:
        with pytest.raises(OutsideWorkspaceError, match="outside the workspace"):
            await call(list_dir, workspace, path=path)


async def test_search_files_refuses_paths_outside(workspace: Path, outside: Path) -> None:
    _escapes(workspace, outside)
    for path in ["..", str(outside), "out", "secret-link.txt"]:
        with pytest.raises(OutsideWorkspaceError, match="outside the workspace"):
            await call(search_files, workspace, pattern="secret", path=path)


def _files_outside(tmp_path: Path, workspace: Path) -> list[Path]:
    return sorted(p for p in tmp_path.rglob("*") if not p.is_relative_to(workspace))


async def test_write_file_refuses_paths_outside(
    workspace: Path, outside: Path, tmp_path: Path
) -> None:
    escapes = [*_escapes(workspace, outside), "../new.txt", "out/newdir/new.txt"]
    before = _files_outside(tmp_path, workspace)
    for path in escapes:
        with pytest.raises(OutsideWorkspaceError, match="outside the workspace"):
            await call(write_file, workspace, path=path, content="pwned")
    assert _files_outside(tmp_path, workspace) == before
    assert (outside / "secret.txt").read_text() == "top secret\n"


async def test_inside_symlink_and_dotdot_are_allowed(workspace: Path) -> None:
    (workspace / "real").mkdir()
    (workspace / "real" / "f.txt").write_text("inside\n")
    (workspace / "alias").symlink_to(workspace / "real", target_is_directory=True)
    assert await call(read_file, workspace, path="alias/f.txt") == "     1\tinside"
    assert await call(read_file, workspace, path="real/../real/f.txt") == "     1\tinside"
    assert await call(read_file, workspace, path=str(workspace / "real" / "f.txt"))


# --- run_shell -----------------------------------------------------------------------


async def test_run_shell_output_and_exit_code(workspace: Path) -> None:
    (workspace / "marker.txt").write_text("")
    result = await call(run_shell, workspace, command="ls; echo to-err >&2; exit 3")
    assert result.splitlines() == ["exit code: 3", "marker.txt", "to-err"]
    assert await call(run_shell, workspace, command="true") == "exit code: 0\n"


async def test_run_shell_caps_output_keeping_head_and_tail(workspace: Path) -> None:
    command = "echo FIRST; head -c 1000000 /dev/zero | tr '\\0' x; echo; echo LAST"
    result = await call(run_shell, workspace, command=command)
    assert result.startswith("exit code: 0\nFIRST\n")
    assert result.endswith("LAST\n")
    assert "bytes of output omitted" in result
    assert len(result) < 300_000


async def _read_until_every_writer_is_gone(fifo: Path, first: trio.Event) -> None:
    """Read the FIFO until EOF, which comes only when every process holding its write end
    has exited; ``first`` is set once the command has written to it."""

    def read() -> None:
        with fifo.open("rb") as reader:
            if reader.readline():
                trio.from_thread.run_sync(first.set)
            reader.read()

    await trio.to_thread.run_sync(read, abandon_on_cancel=True)


# A background job holds the FIFO open (fd 3) until it is killed: EOF proves the whole
# process group, sandbox or not, is gone.
_HOLD_FIFO = "exec 3>{fifo}; echo started; echo running >&3; sleep 30 & wait"


@pytest.mark.parametrize("sandbox", ["off", "auto"])
async def test_run_shell_timeout_kills_process_group(workspace: Path, sandbox: str) -> None:
    fifo = workspace / "held.fifo"
    os.mkfifo(fifo)
    failure: list[ShellTimeoutError] = []
    first = trio.Event()

    async def runner() -> None:
        with pytest.raises(ShellTimeoutError) as info:
            await call(
                run_shell, workspace, command=_HOLD_FIFO.format(fifo=fifo), timeout_s=1.0,
                sandbox=sandbox,
            )
        failure.append(info.value)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner)
            await _read_until_every_writer_is_gone(fifo, first)
    assert first.is_set()
    assert "timed out after 1 s" in str(failure[0])
    assert "started" in str(failure[0])


@pytest.mark.parametrize("sandbox", ["off", "auto"])
async def test_run_shell_cancellation_kills_process_group(workspace: Path, sandbox: str) -> None:
    fifo = workspace / "held.fifo"
    os.mkfifo(fifo)
    finished = False
    first = trio.Event()

    async def runner() -> None:
        nonlocal finished
        await call(run_shell, workspace, command=_HOLD_FIFO.format(fifo=fifo), sandbox=sandbox)
        finished = True

    with trio.fail_after(10):
        async with trio.open_nursery() as reading:
            # The reader outlives the cancelled call: it ends at EOF, when all are dead.
            reading.start_soon(_read_until_every_writer_is_gone, fifo, first)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runner)
                await first.wait()
                nursery.cancel_scope.cancel()
    assert not finished


async def test_run_shell_runs_in_workspace(workspace: Path) -> None:
    (workspace / "here.txt").write_text("")
    result = await call(run_shell, workspace, command="ls; pwd -P")
    real = await trio.to_thread.run_sync(os.path.realpath, workspace)
    assert result == f"exit code: 0\nhere.txt\n{real}\n"


async def test_run_shell_rejects_nonpositive_timeout(workspace: Path) -> None:
    with pytest.raises(BuiltinToolError, match="timeout_s"):
        await call(run_shell, workspace, command="true", timeout_s=0)


# --- tool_loader ---------------------------------------------------------------------

TOOL_FILE = '''
from greenroom.protocols.tools import tool

@tool(parallel=True)
async def second_defined_first() -> str:
    """Alpha."""
    return "a"

@tool
async def then_this(x: int) -> str:
    """Beta."""
    return str(x)

alias = then_this

async def not_a_tool() -> None:
    pass
'''


async def test_load_tools_from_file(tmp_path: Path) -> None:
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    tools = load_tools(str(path))
    assert [t.name for t in tools] == ["second_defined_first", "then_this"]
    assert tools[0].parallel and not tools[1].parallel
    assert await tools[1].function(x=4) == "4"
    # A second file of the same name is a separate module, not a cached one.
    other = tmp_path / "other" / "my_tools.py"
    other.parent.mkdir()
    other.write_text("from greenroom.protocols.tools import tool\n"
                     "@tool\nasync def different() -> None: ...\n")
    assert [t.name for t in load_tools(str(other))] == ["different"]


def test_load_tools_errors(tmp_path: Path) -> None:
    with pytest.raises(ToolLoadError, match=r"tool file not found: .*missing\.py"):
        load_tools(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ToolLoadError, match="RuntimeError: boom at import"):
        load_tools(str(broken))
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    with pytest.raises(ToolLoadError, match="defines no tools"):
        load_tools(str(empty))
    with pytest.raises(ToolLoadError, match="ModuleNotFoundError"):
        load_tools("greenroom_no_such_module_xyz")


def test_load_tools_from_module_name() -> None:
    tools = load_tools("greenroom.actors.tools.builtin")
    assert [t.name for t in tools] == [t.name for t in BUILTIN_TOOLS]


def test_load_tools_rejects_two_tools_with_one_name(tmp_path: Path) -> None:
    path = tmp_path / "clash.py"
    path.write_text(
        "from greenroom.protocols.tools import tool\n"
        "@tool(name='same')\nasync def a() -> None: ...\n"
        "@tool(name='same')\nasync def b() -> None: ...\n"
    )
    with pytest.raises(ToolLoadError, match="two different tools named 'same'"):
        load_tools(str(path))
