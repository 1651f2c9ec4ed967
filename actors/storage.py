"""Where a host keeps its sessions: the data-dir layout, in one place.

``<data_dir>/sessions/<session_id>/`` holds ``session.json`` (settings, workspace, tools,
``parent_id`` for a subagent), the trace files ``trace_001.jsonl``, ``trace_002.jsonl``, …
(one model context each, R-COMPACT-8) and the scratchpad ``scratch/``. Every module that
needs one of these paths asks :class:`SessionStore`; nothing else spells the layout.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from greenroom.protocols.trace import trace_file_name

SESSION_FILE = "session.json"
"""A session's metadata file, in its directory."""

SESSIONS_DIR = "sessions"
"""The folder of the data dir that holds one directory per session."""


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
