"""The built-in tools: read, list, search and write files in the workspace, run shell commands.

Workspace confinement (R-SEC-7, :mod:`greenroom.actors.tools.workspace`): each call first
opens the session's workspace and checks that it is still the directory the session was
created with (else :class:`WorkspaceError`); every path argument is then walked from that
open directory one component at a time, symlinks read and followed only while they stay
inside, ``..`` never above the root (else :class:`OutsideWorkspaceError`), before anything
is read, listed or written. A raised exception becomes an error output to the model
(R-TOOL-4), so every message here is written for the model to read.

Exceptions::

    BuiltinToolError              a built-in tool refused or failed
    ├── OutsideWorkspaceError     a path argument leads outside the workspace
    ├── WorkspaceError            the session's workspace was replaced, is gone, or private
    └── ShellTimeoutError         run_shell hit its timeout; every process it started was killed

Other ``OSError`` s of file access are translated to :class:`BuiltinToolError` with a
workspace-relative path. Blocking file I/O runs in one worker thread per call that an
interrupt abandons (``abandon_on_cancel=True``, R-SEC-2); the read-only tools are
parallel-safe, ``write_file`` and ``run_shell`` are not (R-TOOL-3).

The file tools use regular files only: special files (FIFOs, sockets, devices) are refused
by ``lstat`` before opening and again by ``fstat`` on the descriptor, which is opened
``O_NONBLOCK | O_NOFOLLOW`` so that nothing waits on a peer. A file with more hard links
than names inside the workspace is refused too (:class:`_LinkCensus`). ``search_files``
matches in a worker process (``search_worker.py``) killed on cancellation, because
Python's ``re`` cannot be interrupted in-process; it opens the files it is given from the
verified workspace descriptor, never through a symlink. ``run_shell`` is confined as
:mod:`greenroom.actors.tools.sandbox` describes (R-SEC-3) and runs under
``shell_launcher.py``, which ends every process the command started with the call
(R-SEC-11).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Generator, Iterator
from functools import partial
from pathlib import Path

import trio

from greenroom.actors.tools.sandbox import (
    bwrap_command,
    sandbox_status,
    shell_environment,
    workspace_guard,
)
from greenroom.actors.tools.workspace import (
    BuiltinToolError,
    OpenWorkspace,
    OutsideWorkspaceError,
    Target,
    WorkspaceError,
    display,
    file_error,
    moved_private,
    open_workspace,
)
from greenroom.protocols.tools import Editor, EditorError, Tool, ToolContext, tool

__all__ = [
    "BUILTIN_TOOLS",
    "BuiltinToolError",
    "OutsideWorkspaceError",
    "ShellTimeoutError",
    "WorkspaceError",
    "builtin_tools",
    "list_dir",
    "read_file",
    "resolve_in_workspace",
    "run_shell",
    "search_files",
    "write_file",
]


class ShellTimeoutError(BuiltinToolError):
    """``run_shell`` ran past its ``timeout_s``; every process the command started was
    killed.

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
# The regular expression runs in this script, in its own process (see _run_search_worker).
_SEARCH_WORKER = Path(__file__).with_name("search_worker.py")
_SEARCH_TIME_BUDGET_S = 30.0
_SEARCH_FIRST_BATCH = 16
_SEARCH_BATCH = 256
_READ_CHUNK = 64 * 1024
# Enough bytes for _MAX_LINE_CHARS characters of any UTF-8 text.
_KEEP_LINE_BYTES = _MAX_LINE_CHARS * 4
# The most one read_file keeps, whatever its limit (R-SEC-9): each line counts its bytes
# and its number's; more than the session result budget, so the scratchpad keeps more.
_READ_KEEP_BYTES = 256 * 1024
_READ_LINE_OVERHEAD = 16
# The walk that finds the other names of a hard-linked file stops here (and refuses it).
_LINK_SCAN_ENTRIES = 100_000
# Larger than the session result budget (R-TOOL-8, 32 KiB by default) so the scratchpad
# copy keeps more than the model sees; the cap only bounds memory.
_SHELL_OUTPUT_CAP = 256 * 1024
# The launcher normally ends the command's last process before it exits, and with it the
# output pipe; where it cannot (no subreaper), a process left behind holding the pipe is
# read for this long after the command exits, then the call returns without it.
_SHELL_DRAIN_GRACE_S = 1.0
# The parent of every run_shell command (R-SEC-11); see its docstring.
_SHELL_LAUNCHER = Path(__file__).with_name("shell_launcher.py")
# How long a launcher told to stop (SIGTERM) may take to kill what the command started
# and exit, before it is killed itself.
_LAUNCHER_STOP_GRACE_S = 5.0
# The descriptor of the verified workspace inside a sandboxed command (shell_launcher.py).
_SANDBOX_WORKSPACE_FD = 3


def resolve_in_workspace(workspace_dir: Path, path: str) -> Path:
    """``path`` (relative to the workspace, or absolute) resolved through symlinks and ``..``.

    Raises :class:`OutsideWorkspaceError` unless the result is the resolved workspace root
    or below it. The path need not exist. Does blocking filesystem I/O (readlink). A
    check of names only: the built-in tools themselves walk paths from the verified
    workspace descriptor (:meth:`OpenWorkspace.locate`).
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


def _workspace(ctx: ToolContext) -> OpenWorkspace:
    """The call's workspace, opened and verified (R-SEC-7). Blocking."""
    return open_workspace(ctx.workspace_identity, ctx.workspace_dir, ctx.private_dirs)


def _clip(line: str, limit: int) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [line cut: {len(line) - limit} more characters]"


# --- opening files safely ----------------------------------------------------------------

# O_NONBLOCK: opening a FIFO or a device never waits for a peer; O_NOFOLLOW: the last
# component cannot be swapped for a symlink between the walk and the open.
_OPEN_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_SPECIAL_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _special_file(shown: str, mode: int) -> BuiltinToolError:
    kind = next((name for test, name in _SPECIAL_KINDS if test(mode)), "not a regular file")
    return BuiltinToolError(f"{shown} is {kind}; the file tools read and write regular files only")


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


class _LinkCensus:
    """How many names each hard-linked file has inside the workspace, counted by one
    bounded walk of it from its descriptor (symlinks are not followed). A file whose link
    count is higher than its names inside has a name elsewhere, and is refused."""

    __slots__ = ("_complete", "_names", "_workspace", "refused")

    def __init__(self, workspace: OpenWorkspace) -> None:
        self._workspace = workspace
        self._names: dict[tuple[int, int], int] | None = None
        self._complete = False
        self.refused = 0
        """Files a caller skipped because :meth:`all_inside` said no."""

    def all_inside(self, info: os.stat_result) -> bool:
        if info.st_nlink <= 1:
            return True
        if self._names is None:
            self._count()
        assert self._names is not None
        return self._complete and self._names.get((info.st_dev, info.st_ino), 0) >= info.st_nlink

    def _count(self) -> None:
        names: dict[tuple[int, int], int] = {}
        self._names = names
        root = self._workspace.fd
        # Depth first, one open descriptor per level: (directory, its subdirectories left).
        frames: list[tuple[int, list[str]]] = []
        fd = root
        visited = 0
        try:
            while True:
                _check_cancelled()
                subdirs: list[str] = []
                try:
                    with os.scandir(fd) as scan:
                        for entry in scan:
                            visited += 1
                            if visited > _LINK_SCAN_ENTRIES:
                                return  # incomplete: every hard-linked file is refused
                            if _is_dir(entry):
                                if not self._workspace.is_hidden(entry):
                                    subdirs.append(entry.name)
                            elif entry.is_file(follow_symlinks=False):
                                info = entry.stat(follow_symlinks=False)
                                if info.st_nlink > 1:
                                    key = (info.st_dev, info.st_ino)
                                    names[key] = names.get(key, 0) + 1
                except OSError:
                    pass  # an unreadable directory: its names stay uncounted
                frames.append((fd, subdirs))
                fd = -1
                while frames and fd < 0:
                    top, left = frames[-1]
                    if not left:
                        frames.pop()
                        if top != root:
                            os.close(top)
                        continue
                    name = left.pop()
                    with contextlib.suppress(OSError):
                        fd = self._workspace.enter(name, top, shown=name)
                if fd < 0:
                    break
        finally:
            for top, _ in frames:
                if top != root:
                    os.close(top)
            if fd not in (-1, root):
                os.close(fd)
        self._complete = True


def _hard_link_refusal(shown: str, info: os.stat_result) -> BuiltinToolError:
    return BuiltinToolError(
        f"{shown} has {info.st_nlink} hard links and not all of them are inside the "
        "workspace; the file tools do not use files that may also live outside it"
    )


def _open_regular(
    workspace: OpenWorkspace, target: Target, shown: str, *, write: bool = False
) -> int:
    """A blocking descriptor of the regular file ``target`` (created empty when ``write``
    and missing). Refuses directories, special files and files hard-linked from outside
    the workspace, checked on the opened descriptor. The caller closes it."""
    name = target.name
    if name is None:
        raise BuiltinToolError(f"{shown}: is a directory")
    try:
        before = os.stat(name, dir_fd=target.dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        if not write:
            raise
    else:
        # Refuse before opening, so no device is ever opened; the fstat below decides.
        if stat.S_ISDIR(before.st_mode):
            raise BuiltinToolError(f"{shown}: is a directory")
        if not stat.S_ISREG(before.st_mode) and not stat.S_ISLNK(before.st_mode):
            raise _special_file(shown, before.st_mode)
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    try:
        fd = os.open(name, flags | _OPEN_FLAGS, 0o666, dir_fd=target.dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BuiltinToolError(f"{shown} was replaced by a symlink; try again") from exc
        if exc.errno == errno.ENXIO:
            raise BuiltinToolError(f"{shown} is a FIFO or a device; refused") from exc
        raise
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise BuiltinToolError(f"{shown}: is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise _special_file(shown, info.st_mode)
        if not _LinkCensus(workspace).all_inside(info):
            raise _hard_link_refusal(shown, info)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_cancelled() -> None:
    """Stop a worker thread whose call was cancelled (and abandoned) at the next step."""
    with contextlib.suppress(RuntimeError):  # not in a trio worker thread
        trio.from_thread.check_cancelled()


# --- read_file ---------------------------------------------------------------------------


def _read_window(fd: int, offset: int, limit: int) -> tuple[list[tuple[bytes, int]], int, bool]:
    """Lines ``offset`` to ``offset + limit`` of the file as ``(first bytes, length)``,
    how many lines were passed, and whether more follow. Reads in chunks and stops once the
    lines kept hold :data:`_READ_KEEP_BYTES`: memory stays within a chunk and that budget
    whatever the file holds and the limit asks."""
    lines: list[tuple[bytes, int]] = []
    kept = 0  # bytes of the lines kept, with their numbers'
    seen = 0  # complete lines passed so far
    head = bytearray()
    length = 0
    pending = False  # the current line has bytes and no newline yet
    more = False
    with open(fd, "rb", buffering=0, closefd=False) as raw:
        while not more and (chunk := raw.read(_READ_CHUNK)):
            _check_cancelled()
            pos, size = 0, len(chunk)
            while pos < size:
                if seen < offset:
                    need = offset - seen
                    count = chunk.count(b"\n", pos)
                    if count < need:
                        seen += count
                        pending = not chunk.endswith(b"\n")
                        break
                    for _ in range(need):
                        pos = chunk.index(b"\n", pos) + 1
                    seen, pending = offset, False
                elif len(lines) >= limit or kept >= _READ_KEEP_BYTES:
                    more = True
                    break
                else:
                    newline = chunk.find(b"\n", pos)
                    end = size if newline < 0 else newline
                    room = _KEEP_LINE_BYTES - len(head)
                    if room > 0:
                        head += chunk[pos : min(end, pos + room)]
                    length += end - pos
                    pending = True
                    if newline < 0:
                        break
                    lines.append((bytes(head), length))
                    kept += len(head) + _READ_LINE_OVERHEAD
                    head, length, pending = bytearray(), 0, False
                    seen += 1
                    pos = newline + 1
    if pending:  # a last line without a newline
        if seen < offset:
            seen += 1
        elif len(lines) < limit and kept < _READ_KEEP_BYTES:
            lines.append((bytes(head), length))
            seen += 1
        else:
            more = True
    return lines, seen, more


def _line_text(head: bytes, length: int) -> str:
    if length <= len(head):
        return _clip(head.decode("utf-8", errors="replace").rstrip("\r"), _MAX_LINE_CHARS)
    shown = head.decode("utf-8", errors="replace")[:_MAX_LINE_CHARS]
    rest = length - len(shown.encode("utf-8", errors="replace"))
    return f"{shown}… [line cut: about {rest} more bytes]"



def _read_file_sync(ctx: ToolContext, path: str, offset: int, limit: int) -> str:
    with _workspace(ctx) as workspace:
        target = workspace.locate(path)
        shown = display(target.relative)
        try:
            fd = _open_regular(workspace, target, shown)
            try:
                if b"\0" in os.pread(fd, _SNIFF_BYTES, 0):
                    size = os.fstat(fd).st_size
                    raise BuiltinToolError(
                        f"{shown} is a binary file ({size} bytes); read_file reads text files"
                        " only"
                    )
                lines, seen, more = _read_window(fd, offset, limit)
            finally:
                os.close(fd)
        except OSError as exc:
            raise file_error(exc, shown) from exc
    if not lines:
        if seen == 0:
            return f"[{shown} is empty]"
        return f"[{shown} has {seen} lines; offset {offset} is past the end]"
    return _numbered([_line_text(head, length) for head, length in lines], offset, more)


def _numbered(lines: list[str], offset: int, more: bool) -> str:
    """``read_file``'s answer: the lines numbered from ``offset + 1``, and a note when
    ``more`` lines remain."""
    numbered = [f"{number:>6}\t{line}" for number, line in enumerate(lines, start=offset + 1)]
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
    if ctx.editor is not None and ctx.editor.reads:
        return await _read_in_editor(ctx, ctx.editor, path, offset, limit)
    return await trio.to_thread.run_sync(
        _read_file_sync, ctx, path, offset, limit, abandon_on_cancel=True
    )


# --- list_dir ----------------------------------------------------------------------------


def _list_dir_sync(ctx: ToolContext, path: str) -> str:
    with _workspace(ctx) as workspace:
        target = workspace.locate(path)
        shown = display(target.relative)
        try:
            if target.name is None:
                fd = target.dir_fd
            else:
                fd = workspace.open_dir(target.name, target.dir_fd, shown=shown)
            with os.scandir(fd) as scan:
                entries = sorted(
                    (entry for entry in scan if not workspace.is_hidden(entry)),
                    key=lambda entry: entry.name,
                )
        except OSError as exc:
            raise file_error(exc, shown) from exc
        if not entries:
            return f"[{shown} is empty]"
        lines = [
            _listed(workspace, entry, target.parts) for entry in entries[:_MAX_LIST_ENTRIES]
        ]
    if len(entries) > _MAX_LIST_ENTRIES:
        lines.append(f"[{len(entries) - _MAX_LIST_ENTRIES} more entries not shown]")
    return "\n".join(lines)


def _listed(workspace: OpenWorkspace, entry: os.DirEntry[str], parts: tuple[str, ...]) -> str:
    """``list_dir``'s line for ``entry`` of the directory at ``parts``: a symlink is shown
    as what it points at only when that lies inside the workspace (walked from the root
    like a path argument), never by asking the kernel to follow it: the size or kind of a
    file outside, or in the data dir, is not shown (R-SEC-7)."""
    name = display(entry.name)
    try:
        if not entry.is_symlink():
            info = entry.stat(follow_symlinks=False)
        else:
            try:
                target = workspace.locate("/".join((*parts, entry.name)))
            except OutsideWorkspaceError:
                return f"{name}  (a symlink that leads outside the workspace)"
            except BuiltinToolError:
                return name  # a loop, a component that is not a directory
            try:
                if target.name is None:
                    return f"{name}/"
                info = os.stat(target.name, dir_fd=target.dir_fd, follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode) and (info.st_dev, info.st_ino) in workspace.hidden:
                    return f"{name}  (a symlink that leads outside the workspace)"
            finally:
                workspace.release(target)
    except OSError:
        return name
    if stat.S_ISDIR(info.st_mode):
        return f"{name}/"
    if stat.S_ISREG(info.st_mode):
        return f"{name}  ({info.st_size} bytes)"
    return name


@tool(parallel=True)
async def list_dir(path: str = ".", *, ctx: ToolContext) -> str:
    """List a directory in the workspace, sorted by name: directories end with `/`, files
    show their size in bytes. Bytes of a name that are not UTF-8 are shown as `\\xNN`.

    Args:
        path: directory path, relative to the workspace root.
    """
    return await trio.to_thread.run_sync(_list_dir_sync, ctx, path, abandon_on_cancel=True)


# --- search_files ------------------------------------------------------------------------


def _search_tree(
    workspace: OpenWorkspace, start_fd: int, start: tuple[str, ...]
) -> Iterator[tuple[int, tuple[str, ...], list[os.DirEntry[str]]]]:
    """Each directory below ``start`` (open as ``start_fd``), top down in sorted order,
    as its descriptor, its names from the root and its sorted entries; VCS directories
    and directory symlinks are not entered. One descriptor is open per level, closed as
    the walk leaves it (or when the generator is closed)."""
    frames: list[tuple[int, tuple[str, ...], list[str]]] = []
    fd, here = start_fd, start
    try:
        while True:
            try:
                with os.scandir(fd) as scan:
                    entries = sorted(scan, key=lambda entry: entry.name)
            except OSError:
                entries = []
            entries = [e for e in entries if not workspace.is_hidden(e)]
            subdirs = [e.name for e in entries if e.name not in _SEARCH_SKIP_DIRS and _is_dir(e)]
            frames.append((fd, here, subdirs[::-1]))
            yield fd, here, entries
            fd = -1
            while frames and fd < 0:
                top, top_parts, left = frames[-1]
                if not left:
                    frames.pop()
                    if top != start_fd:
                        os.close(top)
                    continue
                name = left.pop()
                with contextlib.suppress(OSError):
                    fd = workspace.enter(name, top, shown=name)
                    here = (*top_parts, name)
            if fd < 0:
                return
    finally:
        for top, _, _ in frames:
            if top != start_fd:
                os.close(top)


def _search_files_of(
    workspace: OpenWorkspace, start: Target, census: _LinkCensus
) -> Generator[tuple[str, str]]:
    """The files to search as ``(path from the root, shown name)``: regular files only,
    a symlinked file only when it leads to one inside the workspace. Files hard-linked
    from outside are counted in ``census.refused``."""

    def regular(target: Target) -> str | None:
        if target.name is None:
            return None
        try:
            info = os.stat(target.name, dir_fd=target.dir_fd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(info.st_mode):
            return None  # FIFOs, sockets, devices: never opened
        if not census.all_inside(info):
            census.refused += 1
            return None
        return target.relative

    if start.name is not None:
        found = regular(start)
        if found is not None:
            yield found, display(found)
        return
    for fd, parts, entries in _search_tree(workspace, start.dir_fd, start.parts):
        for entry in entries:
            if _is_dir(entry):
                continue
            walked = "/".join((*parts, entry.name))
            if entry.is_symlink():
                try:
                    # A symlinked file may point anywhere; only files inside are read.
                    target = workspace.locate(walked)
                except BuiltinToolError:
                    continue
                resolved = regular(target)
                workspace.release(target)
            else:
                resolved = regular(Target(fd, entry.name, (*parts, entry.name)))
            if resolved is not None:
                yield resolved, display(walked)


class _SearchPlan:
    """The files ``search_files`` may read, found by walking lazily from the start path
    in the verified workspace: regular files inside the workspace (symlinks resolved
    from the root), never a special file, never a file hard-linked from outside.

    Advanced from worker threads, one at a time; :meth:`close` may come from any thread
    at any moment and never blocks: a walk under way closes the workspace when it stops,
    so no descriptor is closed while a thread still uses it."""

    __slots__ = (
        "_busy",
        "_census",
        "_closing",
        "_files",
        "_lock",
        "root_fd",
        "shown_start",
        "workspace",
    )

    def __init__(self, ctx: ToolContext, path: str) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._closing = False
        self.workspace = workspace = _workspace(ctx)
        self.root_fd = workspace.fd
        try:
            start = workspace.locate(path)
            self.shown_start = display(start.relative)
            if start.name is not None:
                try:
                    info = os.stat(start.name, dir_fd=start.dir_fd, follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode):
                        fd = workspace.open_dir(start.name, start.dir_fd, shown=self.shown_start)
                        start = Target(fd, None, start.parts)
                except OSError as exc:
                    raise file_error(exc, self.shown_start) from exc
            self._census = _LinkCensus(workspace)
            self._files = _search_files_of(workspace, start, self._census)
        except BaseException:
            workspace.close()
            raise

    @property
    def linked(self) -> int:
        """How many files were skipped for hard links outside the workspace."""
        return self._census.refused

    def next_batch(self, size: int) -> list[tuple[str, str]]:
        """Up to ``size`` more files; empty when the walk is over (or closed)."""
        with self._lock:
            if self._closing:
                return []
            self._busy = True
        # Released here when close() came while this batch was being walked.
        release = self._release_if_closing
        try:
            _check_cancelled()  # an abandoned walk stops here instead of finishing the tree
            batch: list[tuple[str, str]] = []
            for found in self._files:
                batch.append(found)
                if len(batch) == size:
                    break
            return batch
        finally:
            release()

    def close(self) -> None:
        """Close the walk and the workspace, now or as soon as the walk under way stops."""
        with self._lock:
            self._closing = True
            if not self._busy:
                self._release()

    def _release_if_closing(self) -> None:
        with self._lock:
            self._busy = False
            if self._closing:
                self._release()

    def _release(self) -> None:
        self._files.close()
        self.workspace.close()


class _SearchResults:
    """What the worker reported, parsed line by line as it arrives."""

    __slots__ = ("_partial", "capped", "large", "matches")

    def __init__(self) -> None:
        self._partial = b""
        self.matches: list[str] = []
        self.capped = False
        self.large = 0

    def feed(self, chunk: bytes | bytearray) -> None:
        # A killed worker's cut last line stays partial and is never parsed.
        *lines, self._partial = (self._partial + bytes(chunk)).split(b"\n")
        for line in lines:
            record = json.loads(line)
            if record[0] == "match":
                self.matches.append(record[1])
            elif record[0] == "capped":
                self.capped = True
            elif record[0] == "large":
                self.large += 1




async def _run_search_worker(
    pattern: str, plan: _SearchPlan, report_progress: Callable[[str], None]
) -> tuple[_SearchResults, bool]:
    """Run the regular expression over the plan's files in a worker process; the results,
    and whether the time ran out. Files are fed to it while the walk goes on, and the walk
    stops when it has enough matches. The worker is killed at once when the call is
    cancelled (Python's ``re`` holds the interpreter lock while it matches, so it cannot
    be stopped in-process); what it reported until then is kept."""
    header = {
        "root_fd": plan.root_fd,
        "pattern": pattern,
        "max_matches": _MAX_SEARCH_MATCHES,
        "max_match_chars": _MAX_MATCH_CHARS,
        "max_file_bytes": _MAX_SEARCH_FILE_BYTES,
        "sniff_bytes": _SNIFF_BYTES,
    }
    results = _SearchResults()

    async def kill(process: trio.Process) -> None:
        process.kill()

    async def collect(stream: trio.abc.ReceiveStream) -> None:
        async with stream:
            while chunk := await stream.receive_some():
                found = len(results.matches)
                results.feed(chunk)
                if len(results.matches) > found:
                    count = len(results.matches)
                    report_progress(f"{count} match{'es' if count > 1 else ''} so far")

    async def feed(stream: trio.abc.SendStream) -> None:
        # A worker that stopped early (enough matches) closes its end: the walk stops too.
        with contextlib.suppress(trio.BrokenResourceError):
            async with stream:
                await stream.send_all(_json_line(header))
                size = _SEARCH_FIRST_BATCH  # small, so the worker starts on it at once
                while batch := await trio.to_thread.run_sync(
                    plan.next_batch, size, abandon_on_cancel=True
                ):
                    await stream.send_all(b"".join(_json_line(item) for item in batch))
                    size = _SEARCH_BATCH

    with trio.move_on_after(_SEARCH_TIME_BUDGET_S) as budget:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(
                partial(
                    trio.run_process,
                    [sys.executable, "-I", "-S", str(_SEARCH_WORKER)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    # The worker opens each file from the verified workspace descriptor.
                    pass_fds=(plan.root_fd,),
                    check=False,
                    deliver_cancel=kill,
                )
            )
            assert process.stdin is not None and process.stdout is not None
            nursery.start_soon(feed, process.stdin)
            nursery.start_soon(collect, process.stdout)
    return results, budget.cancelled_caught


def _json_line(value: object) -> bytes:
    # ASCII JSON: names that are not UTF-8 travel as escaped surrogates and come back whole.
    return json.dumps(value).encode("ascii") + b"\n"


@tool(parallel=True)
async def search_files(pattern: str, path: str = ".", *, ctx: ToolContext) -> str:
    """Search text files for a regular expression (Python syntax), line by line. Results
    are `file:line: text`, at most 200 of them. Binary files and `.git` are skipped.

    Args:
        pattern: the regular expression to look for in each line.
        path: a directory to search below, or one file; relative to the workspace root.
    """
    try:
        re.compile(pattern)
    except re.error as exc:
        raise BuiltinToolError(f"invalid regular expression {pattern!r}: {exc}") from exc
    # An abandoned plan is collected when its thread ends, and its descriptors with it.
    plan = await trio.to_thread.run_sync(_SearchPlan, ctx, path, abandon_on_cancel=True)
    try:
        ctx.report_progress(f"searching below {plan.shown_start}")
        results, out_of_time = await _run_search_worker(pattern, plan, ctx.report_progress)
    finally:
        plan.close()
    matches, large = results.matches, results.large
    notes: list[str] = []
    if results.capped:
        notes.append(
            f"[stopped after {_MAX_SEARCH_MATCHES} matches; narrow the pattern or the path]"
        )
    if out_of_time:
        notes.append(
            f"[search stopped after {_SEARCH_TIME_BUDGET_S:g} s, not every file was searched;"
            " a pattern with nested repetition such as (a+)+ can take exponential time]"
        )
    if large:
        notes.append(f"[skipped {large} files larger than {_MAX_SEARCH_FILE_BYTES} bytes]")
    if plan.linked:
        notes.append(f"[skipped {plan.linked} files with hard links outside the workspace]")
    if not matches:
        return "\n".join([f"no matches for {pattern!r} in {plan.shown_start}", *notes])
    return "\n".join(matches + notes)


# --- write_file --------------------------------------------------------------------------


def _write_file_sync(ctx: ToolContext, path: str, content: str) -> str:
    data = content.encode("utf-8")
    with _workspace(ctx) as workspace:
        target = workspace.locate(path, make_parents=True)
        shown = display(target.relative)
        if target.name is None:
            raise BuiltinToolError(f"{path!r} is the workspace directory, not a file")
        try:
            # Opened without truncation: a refused file (special, hard-linked) is left as it
            # was.
            fd = _open_regular(workspace, target, shown, write=True)
            try:
                os.ftruncate(fd, 0)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError as exc:
            raise file_error(exc, shown) from exc
    return f"wrote {len(data)} bytes to {shown}"


@tool(parallel=False)
async def write_file(path: str, content: str, *, ctx: ToolContext) -> str:
    """Write a text file in the workspace (UTF-8), replacing it if it exists and creating
    missing parent directories.

    Args:
        path: file path, relative to the workspace root.
        content: the complete new content of the file.
    """
    if ctx.editor is not None and ctx.editor.writes:
        return await _write_in_editor(ctx, ctx.editor, path, content)
    # Abandoned on cancel like every file tool: an interrupt never waits for a stuck file
    # system. A write already under way may still finish after the call is reported
    # interrupted (R-ABORT-4: interrupting is not rollback).
    return await trio.to_thread.run_sync(
        _write_file_sync, ctx, path, content, abandon_on_cancel=True
    )


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


async def _stop_launcher(process: trio.Process) -> None:
    """``deliver_cancel`` for ``trio.run_process``: SIGTERM tells the launcher to kill
    every process of the command and exit (trio waits for that exit). A launcher that has
    not exited after :data:`_LAUNCHER_STOP_GRACE_S` is killed itself; trio cancels this
    function as soon as the launcher exits."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    await trio.sleep(_LAUNCHER_STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


async def _drain(stream: trio.abc.ReceiveStream, output: _CappedOutput,
                 scope: trio.CancelScope) -> None:
    """Read ``stream`` to EOF into ``output``; closes ``stream``."""
    with scope:
        async with stream:
            while chunk := await stream.receive_some():
                output.add(chunk)


async def _shell_command(
    command: str, ctx: ToolContext, workspace: OpenWorkspace
) -> list[str]:
    """The launcher's command line that runs ``command`` as the session's settings say
    (R-SEC-3): under bubblewrap when it works here (``sandbox=auto``) or always
    (``required``: refused otherwise), unconfined with ``off``; allow-listed environment
    in every case. Unconfined, the command starts in the verified ``workspace`` itself
    (its descriptor); sandboxed, bubblewrap binds the directory that descriptor holds."""
    scratchpad = await trio.to_thread.run_sync(_prepare_scratchpad, ctx.scratchpad_dir)
    home = scratchpad / "home"
    status = None
    if ctx.sandbox != "off":
        status = await trio.to_thread.run_sync(sandbox_status, abandon_on_cancel=True)
        if not status.available:
            if ctx.sandbox == "required":
                raise BuiltinToolError(
                    f"the command was not run: sandbox=required, and {status.reason}"
                )
            status = None
    if status is None or status.bwrap is None:
        env = shell_environment(home=home, tmpdir=scratchpad / "tmp")
        return _launcher_command(["bash", "-c", command], env, cwd_fd=workspace.fd)
    bwrap = status.bwrap

    def sandboxed() -> list[str]:
        hidden = tuple(private.resolve() for private in ctx.private_dirs)
        moved = moved_private(workspace.path, hidden)
        if moved is not None:
            # The sandbox hides it by its path: with something else there, it would not.
            raise BuiltinToolError(
                f"the command was not run: the host's data dir {moved} is no longer the "
                "directory the host opened (it was moved, or replaced), so the sandbox "
                "cannot hide it; the host's owner must put it back"
            )
        return bwrap_command(
            bwrap,
            workspace_guard(_SANDBOX_WORKSPACE_FD, command),
            workspace=workspace.path,
            workspace_fd=_SANDBOX_WORKSPACE_FD,
            scratchpad=scratchpad,
            network=ctx.shell_network,
            hidden=hidden,
        )

    argv = await trio.to_thread.run_sync(sandboxed)
    env = shell_environment(home=home, tmpdir=Path("/tmp"))
    return _launcher_command(argv, env, keep_fd=workspace.fd)


def _launcher_command(
    argv: list[str], env: dict[str, str], *, cwd_fd: int | None = None,
    keep_fd: int | None = None,
) -> list[str]:
    """``argv`` run by ``shell_launcher.py`` with the environment ``env`` (see its
    docstring for the arguments)."""
    return [
        sys.executable,
        "-I",
        "-S",
        str(_SHELL_LAUNCHER),
        "-" if cwd_fd is None else str(cwd_fd),
        "-" if keep_fd is None else str(keep_fd),
        str(len(env)),
        *(f"{name}={value}" for name, value in env.items()),
        *argv,
    ]


def _prepare_scratchpad(scratchpad_dir: Path) -> Path:
    """The resolved scratchpad, with the shell's ``home`` and ``tmp`` in it."""
    for name in ("home", "tmp"):
        (scratchpad_dir / name).mkdir(parents=True, exist_ok=True)
    return scratchpad_dir.resolve()


@tool(parallel=False)
async def run_shell(command: str, timeout_s: float = 60, *, ctx: ToolContext) -> str:
    """Run a command with `bash -c` in the workspace directory. Returns the exit code
    and the combined stdout and stderr (long output keeps its start and end). stdin is
    empty. Every process the command starts ends with the call: when bash exits, on
    timeout and on interrupt, background jobs (`cmd &`, `nohup`, `setsid`) are killed
    too, so nothing keeps running between calls. The environment holds no credentials;
    where the host supports it the command runs in a sandbox that sees only the
    workspace, the scratchpad and the system's programs, without network unless the
    session allows it.

    Args:
        command: the bash command line to run.
        timeout_s: seconds before the command is killed.
    """
    # Cancellation contract: when the call is cancelled (interrupt, timeout) while the
    # command runs, run_process sends SIGTERM to the launcher, which kills every process
    # the command started and exits, and waits for that exit before the Cancelled
    # propagates. Under bubblewrap the launcher's child is bwrap: killing it ends the
    # sandbox's PID namespace, and every process in it (--die-with-parent ties the
    # sandbox to bwrap, and bwrap to the launcher, a process that outlives no call).
    if not timeout_s > 0:
        raise BuiltinToolError("timeout_s must be more than 0")
    if ctx.editor is not None and ctx.editor.runs and ctx.sandbox == "off":
        # Only when the session runs commands unconfined anyway: the editor's terminal is
        # the editor's process, which no sandbox of greenroom's reaches (R-ACP-2).
        return await _run_in_editor(ctx, ctx.editor, command, timeout_s)
    # Not abandoned on cancel: the descriptor must be closed here, and opening a
    # directory does not hang on a working file system.
    workspace = await trio.to_thread.run_sync(_workspace, ctx)
    try:
        return await _run_launched(await _shell_command(command, ctx, workspace), workspace,
                                   timeout_s)
    finally:
        workspace.close()


async def _run_launched(argv: list[str], workspace: OpenWorkspace, timeout_s: float) -> str:
    output = _CappedOutput(_SHELL_OUTPUT_CAP)
    process: trio.Process | None = None
    exited = False
    try:
        with trio.move_on_after(timeout_s) as deadline:
            async with trio.open_nursery() as nursery:
                process = await nursery.start(
                    partial(
                        trio.run_process,
                        argv,
                        # A pipe the host never writes to: its end of file tells the
                        # launcher that the host is gone (R-SEC-11).
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        pass_fds=(workspace.fd,),
                        check=False,
                        start_new_session=True,
                        deliver_cancel=_stop_launcher,
                    )
                )
                assert process.stdout is not None
                drain_scope = trio.CancelScope()
                nursery.start_soon(_drain, process.stdout, output, drain_scope)
                await process.wait()
                exited = True
                drain_scope.deadline = trio.current_time() + _SHELL_DRAIN_GRACE_S
    finally:
        if process is not None and process.stdin is not None:
            with trio.CancelScope(shield=True):
                await process.stdin.aclose()
    if deadline.cancelled_caught and not exited:
        # The launcher was told to stop and has exited: nothing of the command still runs.
        raise ShellTimeoutError(
            f"command timed out after {timeout_s:g} s and was killed; output so far:\n"
            f"{output.text()}"
        )
    assert process is not None and process.returncode is not None
    return f"exit code: {process.returncode}\n{output.text()}"


# --- through the editor (ACP: R-ACP-2) ---------------------------------------------------

# The longest old text an edit is shown as a diff with (a longer file's edit is shown as
# its result alone): a diff travels whole in one frame to the editor.
_DIFF_MAX_CHARS = 1 << 20


class _EditorTarget:
    """A file the editor is asked about: its absolute ``path`` in the workspace, the name
    ``shown`` to the model, whether it ``exists`` on disk, and for a write its text there
    (``disk_text``; None when it cannot be shown in a diff: binary or too long)."""

    __slots__ = ("disk_text", "exists", "path", "shown")

    def __init__(self, path: str, shown: str, exists: bool, disk_text: str | None) -> None:
        self.path = path
        self.shown = shown
        self.exists = exists
        self.disk_text = disk_text


def _editor_target(ctx: ToolContext, path: str, write: bool) -> _EditorTarget:
    """Check ``path`` as the file tools do before the editor is asked anything (R-SEC-7):
    walked from the verified workspace, never outside it nor into the data dir; an
    existing file must be a regular file with no hard link outside. A write creates the
    missing parent directories, as ``write_file`` does, and reads the file's text for its
    diff. Blocking."""
    with _workspace(ctx) as workspace:
        target = workspace.locate(path, make_parents=write)
        shown = display(target.relative)
        if target.name is None:
            raise BuiltinToolError(f"{path!r} is the workspace directory, not a file")
        absolute = str(workspace.path.joinpath(*target.parts))
        try:
            absolute.encode("utf-8")
        except UnicodeEncodeError:
            raise BuiltinToolError(
                f"{shown}: a name that is not UTF-8 cannot be given to the editor"
            ) from None
        try:
            fd = _open_regular(workspace, target, shown)
        except FileNotFoundError:
            return _EditorTarget(absolute, shown, False, None)
        except OSError as exc:
            raise file_error(exc, shown) from exc
        try:
            data = os.read(fd, _DIFF_MAX_CHARS * 4 + 1) if write else b""
        except OSError as exc:
            raise file_error(exc, shown) from exc
        finally:
            os.close(fd)
    text = data.decode("utf-8", errors="replace")
    shown_whole = write and len(data) <= _DIFF_MAX_CHARS * 4 and "\0" not in text
    return _EditorTarget(absolute, shown, True, text if shown_whole else None)


async def _read_in_editor(
    ctx: ToolContext, editor: Editor, path: str, offset: int, limit: int
) -> str:
    """``read_file`` through the editor: its buffer, saved or not, in the same shape as a
    read of the disk. A file missing on disk is asked for too (a buffer not saved yet)."""
    target = await trio.to_thread.run_sync(
        _editor_target, ctx, path, False, abandon_on_cancel=True
    )
    try:
        # One line more than asked: whether more remain.
        text = await editor.read_text(target.path, line=offset + 1, limit=limit + 1)
    except EditorError as exc:
        raise BuiltinToolError(f"{target.shown}: the editor could not read it: {exc}") from exc
    if "\0" in text:
        raise BuiltinToolError(
            f"{target.shown} is a binary file; read_file reads text files only"
        )
    lines = text.split("\n") if text else []
    if text.endswith("\n"):
        lines.pop()
    more = len(lines) > limit
    lines = [_clip(line.rstrip("\r"), _MAX_LINE_CHARS) for line in lines[:limit]]
    if not lines:
        if offset == 0:
            return f"[{target.shown} is empty]"
        return f"[{target.shown} has no more than {offset} lines; offset {offset} is past the end]"
    return _numbered(lines, offset, more)


async def _write_in_editor(ctx: ToolContext, editor: Editor, path: str, content: str) -> str:
    """``write_file`` through the editor: it writes the file (its buffer too) and the
    call shows the edit as a diff of the text it replaced — the editor's buffer when the
    editor reads files, else the disk's."""
    target = await trio.to_thread.run_sync(_editor_target, ctx, path, True, abandon_on_cancel=True)
    old = target.disk_text
    if target.exists and editor.reads:
        # What the edit replaces is what the person sees: the buffer, saved or not.
        with contextlib.suppress(EditorError):
            buffer = await editor.read_text(target.path)
            old = buffer if len(buffer) <= _DIFF_MAX_CHARS and "\0" not in buffer else None
    try:
        await editor.write_text(target.path, content)
    except EditorError as exc:
        raise BuiltinToolError(f"{target.shown}: the editor could not write it: {exc}") from exc
    if not target.exists:
        editor.show_diff(ctx.call_id, target.path, None, content)
    elif old is not None:
        editor.show_diff(ctx.call_id, target.path, old, content)
    return f"wrote {len(content.encode('utf-8'))} bytes to {target.shown}"


async def _run_in_editor(
    ctx: ToolContext, editor: Editor, command: str, timeout_s: float
) -> str:
    """``run_shell`` in the editor's terminal, shown on the call: in the verified
    workspace (R-SEC-7), killed after ``timeout_s`` or when the call is cancelled."""
    workspace = await trio.to_thread.run_sync(_workspace, ctx)
    cwd = str(workspace.path)
    workspace.close()
    try:
        ran = await editor.run(
            command,
            cwd=cwd,
            timeout_s=timeout_s,
            output_limit=_SHELL_OUTPUT_CAP,
            call_id=ctx.call_id,
            report_progress=ctx.report_progress,
        )
    except EditorError as exc:
        raise BuiltinToolError(f"the editor could not run the command: {exc}") from exc
    output = ran.output
    if ran.truncated:
        output = f"[… the start of the output was dropped by the editor …]\n{output}"
    if ran.timed_out:
        raise ShellTimeoutError(
            f"command timed out after {timeout_s:g} s and was killed; output so far:\n{output}"
        )
    if ran.exit_code is not None:
        return f"exit code: {ran.exit_code}\n{output}"
    if ran.signal is not None:
        return f"killed by signal {ran.signal}\n{output}"
    return f"exit code: unknown (the editor did not say)\n{output}"


BUILTIN_TOOLS: tuple[Tool, ...] = (read_file, list_dir, search_files, write_file, run_shell)
"""The built-in tools, in the order they are offered to the model."""


def builtin_tools() -> list[Tool]:
    """A new list of :data:`BUILTIN_TOOLS`, for callers that add their own tools to it."""
    return list(BUILTIN_TOOLS)
