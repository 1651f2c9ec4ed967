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
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import sys
from collections.abc import Iterable, Iterator
from typing import Any

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


if __name__ == "__main__":
    stdin = sys.stdin.buffer
    search(json.loads(stdin.readline()), _files(stdin))
