"""The built-in tools: read, list, search and write files in the workspace, run shell commands.

Workspace confinement: every path argument is resolved against the workspace root
(following symlinks and ``..``) and must land inside the resolved root; otherwise the tool
raises :class:`OutsideWorkspaceError` before it reads, lists or writes anything. A raised
exception becomes an error output to the model (R-TOOL-4), so every message here is
written for the model to read.

Exceptions::

    BuiltinToolError              a built-in tool refused or failed
    ├── OutsideWorkspaceError     a path argument resolves outside the workspace
    └── ShellTimeoutError         run_shell hit its timeout; its process group was killed

Other ``OSError`` s of file access are translated to :class:`BuiltinToolError` with a
workspace-relative path. Blocking file I/O runs in one worker thread per call
(``trio.to_thread.run_sync``); the read-only tools are parallel-safe, ``write_file`` and
``run_shell`` are not (R-TOOL-3).

Confinement is checked when the call starts: a symlink swapped in by another process
between the check and the access is not defended against.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import trio

from greenroom.protocols.tools import Tool, ToolContext, tool

__all__ = [
    "BUILTIN_TOOLS",
    "BuiltinToolError",
    "OutsideWorkspaceError",
    "ShellTimeoutError",
    "builtin_tools",
    "list_dir",
    "read_file",
    "resolve_in_workspace",
    "run_shell",
    "search_files",
    "write_file",
]


class BuiltinToolError(Exception):
    """A built-in tool refused or failed; the message is meant for the model."""


class OutsideWorkspaceError(BuiltinToolError):
    """A path argument resolves (after symlinks and ``..``) outside the workspace root."""


class ShellTimeoutError(BuiltinToolError):
    """``run_shell`` ran past its ``timeout_s``; the command's process group was killed.

    The message carries the output captured before the kill.
    """


# A NUL byte in the first block is the same heuristic git and grep use for "binary".
_SNIFF_BYTES = 8192
_MAX_LINE_CHARS = 2000
_MAX_LIST_ENTRIES = 1000
_MAX_SEARCH_MATCHES = 200
_MAX_MATCH_CHARS = 500
_MAX_SEARCH_FILE_BYTES = 10 * 1024 * 1024
_SEARCH_SKIP_DIRS = frozenset({".git", ".hg", ".svn"})
# Larger than the session result budget (R-TOOL-8, 32 KiB by default) so the scratchpad
# copy keeps more than the model sees; the cap only bounds memory.
_SHELL_OUTPUT_CAP = 256 * 1024
# Background jobs can hold the output pipe open after bash exits; their output is read
# for this long, then the call returns without them.
_SHELL_DRAIN_GRACE_S = 1.0


def resolve_in_workspace(workspace_dir: Path, path: str) -> Path:
    """``path`` (relative to the workspace, or absolute) resolved through symlinks and ``..``.

    Raises :class:`OutsideWorkspaceError` unless the result is the resolved workspace root
    or below it. The path need not exist. Does blocking filesystem I/O (readlink).
    """
    root = workspace_dir.resolve()
    try:
        # An absolute ``path`` replaces ``root`` here, and is then checked like any other.
        candidate = (root / path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise BuiltinToolError(f"cannot resolve path {path!r}: {exc}") from exc
    if not candidate.is_relative_to(root):
        raise OutsideWorkspaceError(
            f"path {path!r} is outside the workspace; only paths inside the workspace"
            " may be used"
        )
    return candidate


def _shown(root: Path, target: Path) -> str:
    """How a path appears to the model: relative to the workspace root, POSIX separators."""
    relative = target.relative_to(root).as_posix()
    return relative if relative != "." else "."


def _os_error(exc: OSError, shown: str) -> BuiltinToolError:
    """An ``OSError`` as a message that names the workspace-relative path only."""
    if isinstance(exc, FileNotFoundError):
        return BuiltinToolError(f"{shown}: no such file or directory")
    if isinstance(exc, IsADirectoryError):
        return BuiltinToolError(f"{shown}: is a directory")
    if isinstance(exc, NotADirectoryError):
        return BuiltinToolError(f"{shown}: not a directory")
    if isinstance(exc, PermissionError):
        return BuiltinToolError(f"{shown}: permission denied")
    return BuiltinToolError(f"{shown}: {exc.strerror or exc}")


def _clip(line: str, limit: int) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [line cut: {len(line) - limit} more characters]"


# --- read_file ---------------------------------------------------------------------------


def _read_file_sync(workspace_dir: Path, path: str, offset: int, limit: int) -> str:
    root = workspace_dir.resolve()
    target = resolve_in_workspace(root, path)
    shown = _shown(root, target)
    try:
        with target.open("rb") as raw:
            head = raw.read(_SNIFF_BYTES)
            if b"\0" in head:
                size = os.fstat(raw.fileno()).st_size
                raise BuiltinToolError(
                    f"{shown} is a binary file ({size} bytes); read_file reads text files only"
                )
            raw.seek(0)
            text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
            lines: list[str] = []
            seen = 0
            more = False
            for line in text:
                if seen >= offset + limit:
                    more = True
                    break
                if seen >= offset:
                    lines.append(line.rstrip("\r\n"))
                seen += 1
    except OSError as exc:
        raise _os_error(exc, shown) from exc
    if not lines:
        if seen == 0:
            return f"[{shown} is empty]"
        return f"[{shown} has {seen} lines; offset {offset} is past the end]"
    numbered = [
        f"{number:>6}\t{_clip(line, _MAX_LINE_CHARS)}"
        for number, line in enumerate(lines, start=offset + 1)
    ]
    first, last = offset + 1, offset + len(lines)
    if more:
        numbered.append(
            f"[lines {first}-{last} shown; more lines remain: read again with offset={last}]"
        )
    return "\n".join(numbered)


@tool(parallel=True)
async def read_file(path: str, offset: int = 0, limit: int = 2000, *, ctx: ToolContext) -> str:
    """Read a text file in the workspace. Each line is prefixed with its 1-based number;
    a note at the end says when more lines remain. Binary files are refused.

    Args:
        path: file path, relative to the workspace root.
        offset: how many lines to skip from the start of the file.
        limit: the most lines to return.
    """
    if offset < 0:
        raise BuiltinToolError("offset must be 0 or more")
    if limit < 1:
        raise BuiltinToolError("limit must be 1 or more")
    return await trio.to_thread.run_sync(_read_file_sync, ctx.workspace_dir, path, offset, limit)


# --- list_dir ----------------------------------------------------------------------------


def _list_dir_sync(workspace_dir: Path, path: str) -> str:
    root = workspace_dir.resolve()
    target = resolve_in_workspace(root, path)
    shown = _shown(root, target)
    try:
        with os.scandir(target) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
    except OSError as exc:
        raise _os_error(exc, shown) from exc
    if not entries:
        return f"[{shown} is empty]"
    lines: list[str] = []
    for entry in entries[:_MAX_LIST_ENTRIES]:
        try:
            # Follows symlinks: an entry is shown as what it points at.
            if entry.is_dir():
                lines.append(f"{entry.name}/")
            elif entry.is_file():
                lines.append(f"{entry.name}  ({entry.stat().st_size} bytes)")
            else:
                lines.append(entry.name)
        except OSError:
            lines.append(entry.name)
    if len(entries) > _MAX_LIST_ENTRIES:
        lines.append(f"[{len(entries) - _MAX_LIST_ENTRIES} more entries not shown]")
    return "\n".join(lines)


@tool(parallel=True)
async def list_dir(path: str = ".", *, ctx: ToolContext) -> str:
    """List a directory in the workspace, sorted by name: directories end with `/`, files
    show their size in bytes.

    Args:
        path: directory path, relative to the workspace root.
    """
    return await trio.to_thread.run_sync(_list_dir_sync, ctx.workspace_dir, path)


# --- search_files ------------------------------------------------------------------------


def _search_candidates(start: Path) -> Iterator[Path]:
    """Regular files below ``start`` in sorted order, without descending into VCS
    directories or following directory symlinks."""
    if not start.is_dir():
        yield start
        return
    for dirpath, dirnames, filenames in os.walk(start):
        dirnames[:] = sorted(d for d in dirnames if d not in _SEARCH_SKIP_DIRS)
        for name in sorted(filenames):
            yield Path(dirpath, name)


def _search_files_sync(workspace_dir: Path, pattern: str, path: str) -> str:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise BuiltinToolError(f"invalid regular expression {pattern!r}: {exc}") from exc
    root = workspace_dir.resolve()
    start = resolve_in_workspace(root, path)
    shown_start = _shown(root, start)
    if not start.exists():
        raise BuiltinToolError(f"{shown_start}: no such file or directory")
    results: list[str] = []
    skipped_large = 0
    capped = False
    for candidate in _search_candidates(start):
        # Lets a cancelled call stop between files instead of walking the whole tree.
        trio.from_thread.check_cancelled()
        real = candidate.resolve()
        # A symlinked file may point anywhere; only files inside the workspace are read.
        if not real.is_relative_to(root) or not real.is_file():
            continue
        try:
            if real.stat().st_size > _MAX_SEARCH_FILE_BYTES:
                skipped_large += 1
                continue
            with real.open("rb") as raw:
                if b"\0" in raw.read(_SNIFF_BYTES):
                    continue
                raw.seek(0)
                shown = _shown(root, candidate.absolute())
                text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
                for number, line in enumerate(text, start=1):
                    line = line.rstrip("\r\n")
                    if regex.search(line):
                        if len(results) == _MAX_SEARCH_MATCHES:
                            capped = True
                            break
                        results.append(f"{shown}:{number}: {_clip(line, _MAX_MATCH_CHARS)}")
        except OSError:
            continue  # unreadable files are skipped like binary ones
        if capped:
            break
    notes: list[str] = []
    if capped:
        notes.append(
            f"[stopped after {_MAX_SEARCH_MATCHES} matches; narrow the pattern or the path]"
        )
    if skipped_large:
        notes.append(
            f"[skipped {skipped_large} files larger than {_MAX_SEARCH_FILE_BYTES} bytes]"
        )
    if not results:
        return "\n".join([f"no matches for {pattern!r} in {shown_start}", *notes])
    return "\n".join(results + notes)


@tool(parallel=True)
async def search_files(pattern: str, path: str = ".", *, ctx: ToolContext) -> str:
    """Search text files for a regular expression (Python syntax), line by line. Results
    are `file:line: text`, at most 200 of them. Binary files and `.git` are skipped.

    Args:
        pattern: the regular expression to look for in each line.
        path: a directory to search below, or one file; relative to the workspace root.
    """
    return await trio.to_thread.run_sync(_search_files_sync, ctx.workspace_dir, pattern, path)


# --- write_file --------------------------------------------------------------------------


def _write_file_sync(workspace_dir: Path, path: str, content: str) -> str:
    root = workspace_dir.resolve()
    target = resolve_in_workspace(root, path)
    shown = _shown(root, target)
    if target == root:
        raise BuiltinToolError(f"{path!r} is the workspace directory, not a file")
    data = content.encode("utf-8")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as file:
            file.write(data)
    except OSError as exc:
        raise _os_error(exc, shown) from exc
    return f"wrote {len(data)} bytes to {shown}"


@tool(parallel=False)
async def write_file(path: str, content: str, *, ctx: ToolContext) -> str:
    """Write a text file in the workspace (UTF-8), replacing it if it exists and creating
    missing parent directories.

    Args:
        path: file path, relative to the workspace root.
        content: the complete new content of the file.
    """
    # Not abandoned on cancel: a cancelled call returns only once the write is over, so
    # nothing is written after the call is reported terminal.
    return await trio.to_thread.run_sync(_write_file_sync, ctx.workspace_dir, path, content)


# --- run_shell ---------------------------------------------------------------------------


class _CappedOutput:
    """Keeps the first and last ``cap / 2`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self._half = cap // 2
        self._head = bytearray()
        self._tail = bytearray()
        self._total = 0

    def add(self, chunk: bytes | bytearray) -> None:
        self._total += len(chunk)
        room = self._half - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > self._half:
                del self._tail[: len(self._tail) - self._half]

    def text(self) -> str:
        omitted = self._total - len(self._head) - len(self._tail)
        head = self._head.decode("utf-8", errors="replace")
        tail = self._tail.decode("utf-8", errors="replace")
        if omitted == 0:
            return head + tail
        return f"{head}\n[… {omitted} bytes of output omitted …]\n{tail}"


async def _kill_process_group(process: trio.Process) -> None:
    """``deliver_cancel`` for ``trio.run_process``: SIGKILL to the whole group at once, so
    a cancelled call leaves no children running (trio's default signals only the leader,
    and waits 5 s before SIGKILL)."""
    # ProcessLookupError: every process of the group has already exited.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


async def _drain(stream: trio.abc.ReceiveStream, output: _CappedOutput,
                 scope: trio.CancelScope) -> None:
    """Read ``stream`` to EOF into ``output``; closes ``stream``."""
    with scope:
        async with stream:
            while chunk := await stream.receive_some():
                output.add(chunk)


@tool(parallel=False)
async def run_shell(command: str, timeout_s: float = 60, *, ctx: ToolContext) -> str:
    """Run a command with `bash -c` in the workspace directory. Returns the exit code
    and the combined stdout and stderr (long output keeps its start and end). stdin is
    empty. On timeout the command and every process it started are killed. A background
    job (`cmd &`) may outlive the command only if it redirects its output: the output
    pipe is closed shortly after bash exits.

    Args:
        command: the bash command line to run.
        timeout_s: seconds before the command is killed.
    """
    # Cancellation contract: when the call is cancelled while bash runs, run_process
    # delivers SIGKILL to the command's process group (its own session) and waits for
    # bash to exit before the Cancelled propagates.
    if not timeout_s > 0:
        raise BuiltinToolError("timeout_s must be more than 0")
    output = _CappedOutput(_SHELL_OUTPUT_CAP)
    process: trio.Process | None = None
    exited = False
    with trio.move_on_after(timeout_s) as deadline:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(
                partial(
                    trio.run_process,
                    ["bash", "-c", command],
                    cwd=ctx.workspace_dir,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    check=False,
                    start_new_session=True,
                    deliver_cancel=_kill_process_group,
                )
            )
            assert process.stdout is not None
            drain_scope = trio.CancelScope()
            nursery.start_soon(_drain, process.stdout, output, drain_scope)
            await process.wait()
            exited = True
            drain_scope.deadline = trio.current_time() + _SHELL_DRAIN_GRACE_S
    if deadline.cancelled_caught and not exited:
        # run_process killed the group when it was cancelled; nothing of it still runs.
        raise ShellTimeoutError(
            f"command timed out after {timeout_s:g} s and was killed; output so far:\n"
            f"{output.text()}"
        )
    assert process is not None and process.returncode is not None
    return f"exit code: {process.returncode}\n{output.text()}"


BUILTIN_TOOLS: tuple[Tool, ...] = (read_file, list_dir, search_files, write_file, run_shell)
"""The built-in tools, in the order they are offered to the model."""


def builtin_tools() -> list[Tool]:
    """A new list of :data:`BUILTIN_TOOLS`, for callers that add their own tools to it."""
    return list(BUILTIN_TOOLS)
