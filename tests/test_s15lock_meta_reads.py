"""``greenroom run --session`` (the stored sandbox setting) and ``greenroom approve`` (the
stored tool names) look at a session's ``session.json`` before their host loads it. They
read it through the one reader of the files the host wrote, :meth:`Disk.read`, which
refuses a file that is not a regular one unopened (a FIFO is never waited on), instead of
a second reader of their own; what they make of it is unchanged: the setting or the names
when the file holds them, nothing otherwise (the load then reports the file properly).

Before the change both read it with ``read_regular_file(path, max_bytes=None)``, a second
implementation next to ``Disk.read``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from greenroom.actors.apps.approvals import _stored_tool_names
from greenroom.actors.apps.run import _stored_settings
from greenroom.actors.runtime import Disk, SessionStore

SESSION = "s1"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path read through :meth:`Disk.read`."""
    seen: list[Path] = []
    original = Disk.read

    def read(self: Disk, path: Path) -> bytes:
        seen.append(path)
        return original(self, path)

    monkeypatch.setattr(Disk, "read", read)
    return seen


def _meta(data_dir: Path) -> Path:
    path = SessionStore(data_dir).meta_path(SESSION)
    path.parent.mkdir(parents=True)
    return path


def test_the_stored_settings_and_tools_are_read_through_the_disk(
    tmp_path: Path, reads: list[Path]
) -> None:
    meta = _meta(tmp_path)
    meta.write_text(json.dumps({"settings": {"sandbox": "required"}, "tools": ["a", 3, "b"]}))
    assert _stored_settings(tmp_path, SESSION) == {"sandbox": "required"}
    assert _stored_tool_names(tmp_path, SESSION) == ["a", "b"]
    assert reads == [meta, meta]


def _put(meta: Path, by: str) -> None:
    if by == "fifo":
        os.mkfifo(meta)  # nobody ever writes it: opening it to read would wait for ever
    elif by == "dir":
        meta.mkdir()
    elif by == "endless":
        meta.symlink_to("/dev/zero")
    elif by == "not_utf8":
        meta.write_bytes(b'{"tools": ["\xff"]}')
    elif by == "not_json":
        meta.write_text("{")
    elif by == "not_an_object":
        meta.write_text(json.dumps(["tools"]))
    elif by == "wrong_shapes":
        meta.write_text(json.dumps({"settings": ["sandbox"], "tools": "a"}))


@pytest.mark.parametrize(
    "by",
    ["missing", "fifo", "dir", "endless", "not_utf8", "not_json", "not_an_object",
     "wrong_shapes"],
)
def test_a_session_json_that_cannot_be_used_gives_nothing(
    tmp_path: Path, reads: list[Path], by: str
) -> None:
    meta = _meta(tmp_path)
    _put(meta, by)
    got: list[Any] = [_stored_settings(tmp_path, SESSION), _stored_tool_names(tmp_path, SESSION)]
    assert got == [{}, []]
    assert reads == [meta, meta]
