"""A data dir on a file system without ``flock`` (some network file systems: ENOLCK,
EOPNOTSUPP) is written as before, unlocked — and the host's log says so, once per host, in
one warning naming the data dir: nothing else tells its user that another host on the data
dir is not kept from writing a session this one has open (R-TRACE: one writer a trace).

Before the fix the sessions were written unlocked silently."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

import pytest
from conftest import collect, open_host, trace_lines

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.protocols.context import ModelRequest

LOGGER = "greenroom.actors.runtime.trace_store"


def _hello(request: ModelRequest) -> Reply:
    return Reply(blocks=(text("hello"),))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP], ids=["ENOLCK", "EOPNOTSUPP"])
async def test_a_data_dir_without_file_locks_is_written_with_one_warning_per_host(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, code: int,
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with open_host(data_dir) as host:
        first = await host.create_session(provider=ScriptedProvider(_hello),
                                          workspace_dir=workspace)
        second = await host.create_session(provider=ScriptedProvider(_hello),
                                           workspace_dir=workspace)
        await collect(first.run("hello"))
        await host.close_session(first.id)
        again = await host.load_session(first.id, provider=ScriptedProvider(_hello))
        await collect(again.run("again"))
        assert second.id != first.id
    (warning,) = _warnings(caplog)
    assert str(data_dir) in warning and os.strerror(code) in warning
    assert "\n" not in warning
    # Written as before: both tasks, in order.
    assert [line["status"] for line in trace_lines(again) if line["type"] == "task_end"] == [
        "completed", "completed"
    ]
    async with open_host(data_dir) as host:  # another host says it again, once
        await host.load_session(first.id, provider=ScriptedProvider(_hello))
    assert len(_warnings(caplog)) == 2


async def test_a_data_dir_with_file_locks_gives_no_warning(
    data_dir: Path, workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=ScriptedProvider(_hello),
                                            workspace_dir=workspace)
        await collect(session.run("hello"))
    assert _warnings(caplog) == []
