"""A session's writer lock file (``writer.lock``) that is not a regular file — a directory,
a FIFO, a symbolic link (to a FIFO, to a directory, to nothing, to itself) — as opening the
session for writing meets it: an OSError naming the file and what it is (one line, exit 2,
on the command line), nothing created or opened through a link; never a session opened
without its lock, nor a file made elsewhere.

Before the fix: the lock was opened following links, and a failure to open it was taken for
"no directory yet": a directory, a link to one or a link loop opened the session unlocked
(two hosts could both append to it, one seq twice), a link to nothing created a file where
it pointed, outside the session, and a FIFO (or a link to one) was locked as if a file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import open_host

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.runtime.trace_store import WRITER_LOCK_FILE  # noqa: E402
from tests.test_c14_cli_files import forked  # noqa: E402
from tests.test_clifix_bad_input import make_session, one_line  # noqa: E402

SAID = {
    "dir": "Is a directory",
    "fifo": "it is a FIFO (a named pipe), not a regular file",
    "link_to_fifo": "it is a symbolic link, not a regular file",
    "link_to_dir": "it is a symbolic link, not a regular file",
    "link_to_nothing": "it is a symbolic link, not a regular file",
    "link_loop": "it is a symbolic link, not a regular file",
}


def _put(lock: Path, by: str, aside: Path) -> None:
    """Put ``by`` where the lock file ``lock`` is; a link points into ``aside``."""
    lock.unlink(missing_ok=True)
    if by == "dir":
        lock.mkdir()
    elif by == "fifo":
        os.mkfifo(lock)
    elif by == "link_to_fifo":
        os.mkfifo(aside / "fifo")
        lock.symlink_to(aside / "fifo")
    elif by == "link_to_dir":
        lock.symlink_to(aside)
    elif by == "link_to_nothing":
        lock.symlink_to(aside / "made_through_the_link")
    else:
        lock.symlink_to(lock)


@pytest.mark.parametrize("by", sorted(SAID))
async def test_loading_a_session_whose_writer_lock_is_no_file_names_it(
    tmp_path: Path, data_dir: Path, workspace: Path, providers: Any, by: str
) -> None:
    aside = tmp_path / "aside"
    aside.mkdir()
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=providers([]), workspace_dir=workspace)
        session_id = session.id
    lock = data_dir / "sessions" / session_id / WRITER_LOCK_FILE
    _put(lock, by, aside)
    async with open_host(data_dir) as host:
        with pytest.raises(OSError) as info:
            await host.load_session(session_id, provider=providers([]))
        assert (info.value.filename, info.value.strerror) == (str(lock), SAID[by])
        assert sorted(p.name for p in aside.iterdir()) == (["fifo"] if by == "link_to_fifo" else [])
        # Nothing of the refused load holds the session: without the odd file, it loads
        # and takes its lock (a second host is refused it).
        lock.rmdir() if by == "dir" else lock.unlink()
        loaded = await host.load_session(session_id, provider=providers([]))
        assert lock.is_file() and not lock.is_symlink()
        fd = os.open(lock, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError) as held:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert held.value.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
        finally:
            os.close(fd)
        await host.close_session(loaded.id)


@pytest.mark.parametrize("by", ["dir", "link_to_nothing"])
def test_run_session_whose_writer_lock_is_no_file_is_one_line(tmp_path: Path, by: str) -> None:
    aside = tmp_path / "aside"
    aside.mkdir()
    data, session_id = make_session(tmp_path)
    lock = data / "sessions" / session_id / WRITER_LOCK_FILE
    _put(lock, by, aside)
    run = ["run", "--session", session_id, "--no-builtin-tools", "--data-dir", str(data)]
    result = forked(tmp_path, *run, "again")
    one_line(result, 2, str(lock), SAID[by])
    assert result.stdout == ""
    assert list(aside.iterdir()) == []
