"""The file system as the file backend uses it: one small seam for its traces and metadata.

:class:`Disk` holds the blocking calls through which the trace sink and the file store
write, make durable and read what they keep: appending records to a trace file, fsyncing a
file or a directory, writing a file whole and putting it in place (``session.json``: a new
session's only where none is), reading one back. (The usage ledger is SQLite's own I/O;
modes and directory listings are plain calls: they hold no record.) The default is the
operating system itself (:data:`DISK`). A test passes a disk of its own — one that refuses
or stalls on a given path, or records what was fsynced — to ``FileTraceStore(data_dir,
disk=…)`` or ``TraceSink(data_dir, disk=…)``, instead of patching the backend's functions.

The contract of every method: it blocks (the trace sink appends from the session's own
task — one small append to the page cache — and does everything else from a worker
thread), and what the disk refuses is an ``OSError``. Anything else a method raises is a bug
below the writer: the trace sink's actor stops on it rather than go on promising durability
(see :mod:`~greenroom.actors.runtime.trace_sink`).

Files the backend creates are private to the user that runs the host: 0600, directories
0700 (they hold tool output such as file contents: R-SEC-5).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from greenroom.protocols.wording import special_file_words

__all__ = ["DISK", "PRIVATE_DIR_MODE", "PRIVATE_FILE_MODE", "Disk"]

PRIVATE_DIR_MODE = 0o700
"""Directories the host creates: only its user may enter them (traces hold tool output)."""

PRIVATE_FILE_MODE = 0o600
"""Files the host creates (metadata, traces, the ledger)."""


# What link(2) answers on a file system without hard links (FAT, some network and FUSE
# mounts), where placing a new file falls back to a check and rename(2).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK})


class Disk:
    """The operating system's files, as the file backend writes and reads them. Subclass
    it to make a test's disk (override a method, call the real one through ``super()``)."""

    def append(self, path: Path, data: bytes, *, create: bool = False) -> None:
        """Write all of ``data`` at the end of the file ``path`` (``O_APPEND``). A missing
        file raises FileNotFoundError, unless ``create``: then it is created (0600)."""
        fd = self.open_appending(path, create=create)
        try:
            self.append_to(fd, path, data)
        finally:
            self.close(fd)

    def open_appending(self, path: Path, *, create: bool = False) -> int:
        """A descriptor that writes at the end of the file ``path`` (``O_APPEND``), for
        :meth:`append_to`; the caller closes it with :meth:`close`. A missing file raises
        FileNotFoundError, unless ``create``: then it is created (0600)."""
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
        return os.open(path, flags, PRIVATE_FILE_MODE)

    def append_to(self, fd: int, path: Path, data: bytes) -> None:
        """Write all of ``data`` through ``fd``, a descriptor :meth:`open_appending`
        opened for ``path``."""
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def close(self, fd: int) -> None:
        """Close a descriptor :meth:`open_appending` opened."""
        os.close(fd)

    def still_named(self, fd: int) -> bool:
        """Whether the file of ``fd`` still has a name: False once it was removed, or
        replaced by another file under its path."""
        return os.fstat(fd).st_nlink > 0

    def last_byte(self, path: Path) -> bytes:
        """The last byte of the file ``path`` (``b""`` when it is empty). A missing file
        raises FileNotFoundError."""
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if not size:
                return b""
            f.seek(size - 1)
            return f.read(1)

    def make_dir(self, path: Path) -> None:
        """Create the directory ``path`` (0700) in its existing parent; one that exists
        already is left as it is."""
        path.mkdir(exist_ok=True, mode=PRIVATE_DIR_MODE)

    def fsync(self, path: Path) -> None:
        """Make the content of the file ``path`` — or the entries of the directory
        ``path`` — durable. A missing one raises FileNotFoundError."""
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, path: Path, data: bytes) -> None:
        """Create the file ``path`` (0600), or empty the one there, and write ``data``."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def place_new(self, source: Path, target: Path) -> bool:
        """Put the file ``source`` at ``target`` in one step unless ``target`` exists:
        False, changing nothing, when it does. ``link(2)`` refuses an existing name even
        when another process made it a moment ago (a check, then ``rename(2)``, would
        overwrite it); ``source`` stays, for the caller to remove. On a file system
        without hard links: the check and ``rename(2)``."""
        try:
            os.link(source, target)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            if os.path.lexists(target):
                return False
            os.replace(source, target)
        return True

    def read(self, path: Path) -> bytes:
        """The content of the regular file ``path``, of any size (the backend wrote it). One
        that is not a regular file is an OSError naming it and what it is, refused before a
        byte is read (R-SEC-1): a FIFO would be waited on for ever, a link to /dev/zero read
        for ever; a directory is an IsADirectoryError, as reading it always was."""
        where = str(path)
        problem = _not_regular(os.stat(path).st_mode, where)
        if problem is not None:  # refused unopened: opening a device may act on it
            raise problem
        # O_NONBLOCK: a FIFO put in its place since the stat is not waited on when opened.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            problem = _not_regular(os.fstat(fd).st_mode, where)  # what was opened
            if problem is not None:
                raise problem
            return file.read()

    def check_readable(self, path: Path) -> os.stat_result:
        """The status of ``path`` when it is a regular file its user may read, else the
        OSError :meth:`read` would raise for it (a permission refused is a
        PermissionError naming it), checked without opening it: what lists many files
        (a scan of sessions, a session's older traces) asks it instead of reading each."""
        status = os.stat(path)
        problem = _not_regular(status.st_mode, str(path))
        if problem is not None:
            raise problem
        if not os.access(path, os.R_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return status


def _not_regular(mode: int, where: str) -> OSError | None:
    """The error for reading a file of ``mode`` at ``where`` when it is not a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), where)
    return OSError(errno.EINVAL, special_file_words(mode), where)


DISK = Disk()
"""The real disk: what the file backend uses unless it is given another."""
