"""An ACP session listing reads each stored session's first prompt from its first trace
file for a title: one that is a FIFO (or a link to a device) was opened and waited on for
ever, holding ``session/list`` (R-SEC-1). It gives no title now, at once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from greenroom.actors.apps.acp_sessions import _first_prompt

BOUND_S = 20.0
"""A bound on the read, never waited for when it returns at once."""


def _title_within_bound(path: Path) -> tuple[bool, str]:
    """Whether ``_first_prompt(path)`` returned within :data:`BOUND_S`, and what. A read
    still waiting then is let go (the FIFO's writing end opened and closed), so a
    regression fails the test rather than hang it."""
    found: list[str] = []
    worker = threading.Thread(target=lambda: found.append(_first_prompt(path)), daemon=True)
    worker.start()
    worker.join(BOUND_S)
    returned = not worker.is_alive()
    if not returned and path.is_fifo():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(BOUND_S)
    return returned, found[0] if found else ""


def test_a_first_trace_that_is_a_fifo_gives_no_title_at_once(tmp_path: Path) -> None:
    trace = tmp_path / "trace_001.jsonl"
    os.mkfifo(trace)
    assert _title_within_bound(trace) == (True, "")


def test_a_first_trace_that_is_a_device_gives_no_title(tmp_path: Path) -> None:
    trace = tmp_path / "trace_001.jsonl"
    trace.symlink_to("/dev/zero")
    assert _title_within_bound(trace) == (True, "")


def test_a_regular_first_trace_still_gives_its_first_prompt(tmp_path: Path) -> None:
    trace = tmp_path / "trace_001.jsonl"
    trace.write_text(
        '{"type": "task_start"}\n'
        '{"type": "user_msg", "content": [{"type": "text", "text": "Sum  the\\nsales"}]}\n',
        encoding="utf-8",
    )
    assert _title_within_bound(trace) == (True, "Sum the sales")
