"""A disk for tests: the real one, with faults a test turns on and a record of its fsyncs.

The file backend writes every byte through a :class:`~greenroom.actors.runtime.disk.Disk`
(``FileTraceStore(data_dir, disk=…)``, ``TraceSink(data_dir, disk=…)``); a test gives it a
:class:`FaultyDisk` instead of patching the backend's functions. The faults are per file
and thread-safe enough for the worker threads that call them (each is one attribute read).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

from greenroom.actors.runtime.disk import Disk

__all__ = ["FaultyDisk"]

STALL_LIMIT_S = 30.0
"""The longest a stalled fsync waits for :meth:`FaultyDisk.release` (a test that forgets
to release it fails instead of hanging)."""


class FaultyDisk(Disk):
    """The real disk, and:

    * :meth:`refuse` — the disk refuses (``ENOSPC``) the appends to one file and its fsyncs
      (or only its fsyncs); ``hits`` counts the refusals; :meth:`mend` ends it;
    * :meth:`break_writer` — an fsync of one file raises an error that is not an OSError
      (a bug below the trace writer); ``bug_hits`` counts them;
    * :meth:`stall` — an fsync of one file waits (``stalled`` is set) until
      :meth:`release`;
    * :meth:`fail_close` — closing a descriptor of one file closes it and then raises
      ``EIO`` (as a network file system reports a write it could not make);
    * every descriptor opened for appending and not closed yet, in ``appending`` (descriptor
      -> path);
    * every fsync, as ``(path, size of the file then)`` in ``fsyncs`` and its path in
      ``fsynced`` (the test may clear either).
    """

    def __init__(self) -> None:
        self.fsyncs: list[tuple[Path, int]] = []
        self.fsynced: list[Path] = []
        self.hits = 0
        self.bug_hits = 0
        self.stalled = threading.Event()
        self._released = threading.Event()
        self._refused: Path | None = None
        self._refuse_appends = False
        self._broken: Path | None = None
        self._stalling: Path | None = None
        self._failing_close: Path | None = None
        self.appending: dict[int, Path] = {}
        self._lock = threading.Lock()

    # -- faults -----------------------------------------------------------------------------

    def refuse(self, path: Path, *, appends: bool = True) -> None:
        """From now on refuse the fsyncs of ``path`` and, with ``appends``, its appends."""
        self._refuse_appends = appends
        self._refused = path

    def mend(self) -> None:
        """Stop refusing."""
        self._refused = None

    def break_writer(self, path: Path) -> None:
        """From now on an fsync of ``path`` raises RuntimeError (not a refusal of the disk)."""
        self._broken = path

    def stall(self, path: Path) -> None:
        """From now on an fsync of ``path`` waits until :meth:`release`."""
        self._stalling = path

    def release(self) -> None:
        """Let stalled fsyncs (and later ones) through."""
        self._released.set()

    def fail_close(self, path: Path) -> None:
        """From now on closing a descriptor of ``path`` raises ``EIO`` once it is closed."""
        self._failing_close = path

    # -- the disk ---------------------------------------------------------------------------

    def append(self, path: Path, data: bytes, *, create: bool = False) -> None:
        """The real append, unless appends to ``path`` are refused."""
        if self._refuse_appends:
            self._hit(path)
        super().append(path, data, create=create)

    def open_appending(self, path: Path, *, create: bool = False) -> int:
        """The real descriptor, remembered in ``appending`` until closed."""
        fd = super().open_appending(path, create=create)
        with self._lock:
            self.appending[fd] = path
        return fd

    def append_to(self, fd: int, path: Path, data: bytes) -> None:
        """The real append through ``fd``, unless appends to ``path`` are refused."""
        if self._refuse_appends:
            self._hit(path)
        super().append_to(fd, path, data)

    def close(self, fd: int) -> None:
        """The real close; then ``EIO`` when closes of its file are to fail."""
        with self._lock:
            path = self.appending.pop(fd, None)
        super().close(fd)
        if path is not None and path == self._failing_close:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def fsync(self, path: Path) -> None:
        """The real fsync, after the faults armed for ``path``; recorded once done."""
        self._hit(path)
        if path == self._broken:
            with self._lock:
                self.bug_hits += 1
            raise RuntimeError("writer bug")
        if path == self._stalling and not self._released.is_set():
            self.stalled.set()
            self._released.wait(STALL_LIMIT_S)
        super().fsync(path)
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # removed meanwhile (its session was deleted)
            size = -1
        with self._lock:
            self.fsyncs.append((path, size))
            self.fsynced.append(path)

    def _hit(self, path: Path) -> None:
        if path == self._refused:
            with self._lock:
                self.hits += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
