"""Session ids are unique within a host even when many sessions are created in one second
(R-HOST-1: each session has its own files). The generated id is a timestamp and 24 random
bits: a thousand sessions created within a second collide about once in thirty runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from conftest import RUN_TIMEOUT_S

from greenroom import Host
from greenroom.actors.runtime import host as host_module


async def test_a_generated_id_already_open_in_the_host_is_drawn_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = iter(["20260101-000000-aaaaaa", "20260101-000000-aaaaaa", "20260101-000000-bbbbbb"])
    monkeypatch.setattr(host_module, "_new_session_id", lambda: next(drawn))
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(tmp_path / "data") as host:
            first = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            second = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            assert first.id == "20260101-000000-aaaaaa"
            assert second.id == "20260101-000000-bbbbbb"
            for session in (first, second):
                result = await session.run("hi").result()
                assert result.task_end.status == "completed"
