"""Where a host keeps its sessions: the data-dir layout, in one place.

``<data_dir>/sessions/<session_id>/`` holds ``session.json`` (settings, workspace, tools,
``parent_id`` for a subagent), the trace files ``trace_001.jsonl``, ``trace_002.jsonl``, …
(one model context each, R-COMPACT-8), the scratchpad ``scratch/`` and ``attachments/``,
the private copies of the session's images named by their SHA-256 (R-SEC-8). Every module
that needs one of these paths asks :class:`SessionStore` or takes the names here; nothing
else spells the layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import attrs

from greenroom.actors.runtime.disk import DISK, PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, Disk
from greenroom.actors.runtime.trace_sink import read_trace
from greenroom.protocols.outputs import Output
from greenroom.protocols.trace import trace_file_name, trace_file_number

__all__ = [
    "PRIVATE_DIR_MODE",
    "PRIVATE_FILE_MODE",
    "SESSIONS_DIR",
    "SESSION_FILE",
    "SessionStore",
    "read_session_records",
    "tighten",
]

SESSION_FILE = "session.json"
"""A session's metadata file, in its directory."""

ATTACHMENTS_DIR = "attachments"
"""The folder of a session's directory that holds its private copies of images."""

SESSIONS_DIR = "sessions"
"""The folder of the data dir that holds one directory per session."""



def tighten(path: Path, mode: int) -> None:
    """Take away every permission beyond ``mode`` (never adds one)."""
    current = path.stat().st_mode & 0o777
    if current & ~mode:
        os.chmod(path, current & mode)


@attrs.frozen
class SessionStore:
    """The session paths of the data dir ``data_dir`` (no I/O: paths only)."""

    data_dir: Path

    @property
    def sessions_dir(self) -> Path:
        """``<data_dir>/sessions``."""
        return self.data_dir / SESSIONS_DIR

    def session_dir(self, session_id: str) -> Path:
        """The directory of session ``session_id``."""
        return self.data_dir / SESSIONS_DIR / session_id

    def meta_path(self, session_id: str) -> Path:
        """The ``session.json`` of session ``session_id``."""
        return self.session_dir(session_id) / SESSION_FILE

    def trace_path(self, session_id: str, number: int) -> Path:
        """The ``number``-th trace file (1-based) of session ``session_id``."""
        return self.session_dir(session_id) / trace_file_name(number)


def read_session_records(
    session_dir: Path,
    *,
    after_seq: int = 0,
    on_unreadable: Callable[[Path, OSError], None] | None = None,
    disk: Disk = DISK,
) -> list[Output]:
    """The traced outputs with ``seq > after_seq`` from every trace file of a session,
    oldest file first (the conversation across compactions). A missing directory gives
    none; a file that cannot be read is skipped (and reported to ``on_unreadable``).
    Blocking: call it in a thread."""
    try:
        entries = list(session_dir.iterdir())
    except OSError:
        return []
    numbered = sorted(
        (number, entry)
        for entry in entries
        if (number := trace_file_number(entry.name)) is not None
    )
    records: list[Output] = []
    for _, path in numbered:
        try:
            result = read_trace(path, disk=disk)
        except OSError as exc:
            if on_unreadable is not None:
                on_unreadable(path, exc)
            continue
        records.extend(r for r in result.records if r.seq is not None and r.seq > after_seq)
    return records
