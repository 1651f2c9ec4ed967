"""The worker process of ``search_files``: runs one regular expression over a list of files.

Python's ``re`` holds the interpreter lock for as long as one match takes, and a pattern
with nested repetition can take exponential time; run in the host process it would freeze
every session. Run here, as ``python -I -S search_worker.py``, it is killed when the call is
cancelled or runs out of time. Standard library only, so it starts in about 20 ms.

Input on stdin, one JSON value per line: first ``{root_fd, pattern, max_matches,
max_match_chars, max_file_bytes, sniff_bytes}``, then ``[path, shown]`` for each file, sent
while the caller walks the workspace. ``root_fd`` is an inherited descriptor of the
verified workspace (R-SEC-7) and ``path`` a file's path from it with every symlink already
resolved by the caller: each component is opened from there without following symlinks,
so a file swapped for a symlink since the caller looked is skipped, never followed.
Output on stdout, one JSON array per line, flushed as found: ``["match", "shown:line:
text"]``, ``["large", shown]`` (skipped for size), ``["capped"]`` (stopped at
``max_matches``; the worker then exits, which tells the caller to stop walking).

The worker ends with its call (R-SEC-11), even when the host is killed: a match may run
for minutes, and a host killed with SIGKILL runs no cleanup. On Linux the worker forks
at start: the child searches, with ``PR_SET_PDEATHSIG`` so that it dies with the parent
(which the host kills when the call is cancelled); the parent only waits, for the
child's end or for the host's end of stdout to close (``POLLERR`` on a pipe whose reader
is gone: the host stopped reading, or died), and then kills the child. Elsewhere a
worker whose host died finishes the match it is in, then stops.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stubs; as in shell_launcher.py
import io
import json
import os
import re
import select
import stat
import sys
from collections.abc import Iterable, Iterator
from typing import Any

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PR_SET_PDEATHSIG = 1


def _emit(*record: Any) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _clip(line: str, limit: int) -> str:
    if len(line) <= limit:
        return line
    return f"{line[:limit]}… [line cut: {len(line) - limit} more characters]"


def _files(lines: Iterable[bytes]) -> Iterator[tuple[str, str]]:
    for line in lines:
        path, shown = json.loads(line)
        yield path, shown


def _open_beneath(root_fd: int, path: str) -> int:
    """Open ``path`` from the directory ``root_fd``, no component through a symlink."""
    *directories, name = path.split("/")
    at = root_fd
    try:
        for directory in directories:
            parent, at = at, os.open(directory, _DIR_FLAGS, dir_fd=at)
            if parent != root_fd:
                os.close(parent)
        return os.open(name, _FLAGS, dir_fd=at)
    finally:
        if at != root_fd:
            os.close(at)


def search(request: dict[str, Any], files: Iterable[tuple[str, str]]) -> None:
    """Search ``files`` as ``request`` says and write the records described above."""
    regex = re.compile(request["pattern"])
    limit = request["max_matches"]
    root_fd = request["root_fd"]
    found = 0
    for path, shown in files:
        try:
            fd = _open_beneath(root_fd, path)
        except OSError:
            continue  # vanished or unreadable: skipped like a binary file
        with open(fd, "rb") as raw:
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    continue  # swapped for a special file since the caller looked
                if info.st_size > request["max_file_bytes"]:
                    _emit("large", shown)
                    continue
                os.set_blocking(fd, True)
                if b"\0" in raw.read(request["sniff_bytes"]):
                    continue
                raw.seek(0)
                text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
                for number, line in enumerate(text, start=1):
                    line = line.rstrip("\r\n")
                    if regex.search(line):
                        if found == limit:
                            _emit("capped")
                            return
                        found += 1
                        clipped = _clip(line, request["max_match_chars"])
                        _emit("match", f"{shown}:{number}: {clipped}")
            except OSError:
                continue


def _set_parent_death_signal(signum: int) -> bool:
    try:
        import _ctypes

        prctl = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")  # type: ignore[arg-type]
        result = _ctypes.call_function(prctl, (_PR_SET_PDEATHSIG, signum, 0, 0, 0))
        return result == 0  # type: ignore[no-any-return]
    except (ImportError, AttributeError, OSError):
        return False


def _ignore(signum: int, frame: object) -> None:
    """A handler, so that SIGCHLD reaches the wakeup descriptor."""


def watched_by_host() -> None:
    """Return in a child process that ends with the call (see the module docstring);
    the process that called this waits for that child and exits like it. Returns at
    once where that cannot be done."""
    if not sys.platform.startswith("linux"):
        return
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    _signal.set_wakeup_fd(wake_write)
    # Before the fork: a child that ends at once still wakes the parent.
    _signal.signal(_signal.SIGCHLD, _ignore)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _signal.set_wakeup_fd(-1)
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        os.close(wake_read)
        os.close(wake_write)
        if not _set_parent_death_signal(_signal.SIGKILL) or os.getppid() != parent:
            os._exit(1)  # the parent is gone already, or could not be followed
        return
    os.close(0)  # the child reads the file list
    poller = select.poll()
    poller.register(1, 0)  # POLLERR and POLLHUP only: the host's end closed
    poller.register(wake_read, select.POLLIN)
    status = None
    while status is None:
        host_gone = False
        for fd, _events in poller.poll():
            if fd == wake_read:
                os.read(wake_read, 256)
            else:
                host_gone = True
        if host_gone:
            os.kill(child, _signal.SIGKILL)
            os.waitpid(child, 0)
            os._exit(1)
        pid, waited = os.waitpid(child, os.WNOHANG)
        if pid:
            status = waited
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    watched_by_host()
    stdin = sys.stdin.buffer
    search(json.loads(stdin.readline()), _files(stdin))
