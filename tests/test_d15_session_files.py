"""A stored session's ``session.json`` or trace file that is not a regular file (a FIFO, a
link to /dev/zero, a directory), as loading it meets it (R-SEC-1): ``run --session``,
``fork`` and ``rewind`` say so in one line (exit 2), a program that loads it through
:class:`Host` gets a clear exception; never a hang or a read without end.

Before the fix: ``Disk.read`` (every read of ``session.json`` and of trace files when a
session is loaded or forked) opened a FIFO and waited for a writer for ever, and read a
link to /dev/zero until memory ran out (a MemoryError traceback); ``run --session`` read
``session.json`` itself first, and hung there too. ``replay`` checked the trace files of
a file store only: on a cluster's store a trace that is a directory was "no recorded
prompt".

The commands run in a child (``forked``, with a timeout; ``started`` with an address-space
limit where a read would have no end). In this process, a read still waiting on a FIFO
after :data:`BOUND_S` is ended by opening the FIFO's other end (its reader sees an end),
so that a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.apps.exits import UsageError  # noqa: E402
from greenroom.actors.apps.replay import replay_session  # noqa: E402
from greenroom.actors.cluster.store import ReplicatingTraceStore  # noqa: E402
from greenroom.actors.runtime import Host, Session, SessionNotFound  # noqa: E402
from greenroom.actors.runtime.trace_store import TraceStore  # noqa: E402
from greenroom.actors.scripted import ScriptedProvider  # noqa: E402
from tests.test_c14_cli_files import _replace, forked  # noqa: E402
from tests.test_clifix_bad_input import limited_memory, make_session, one_line, started  # noqa: E402

BOUND_S = 20
"""A bound on a load in this process, never waited for: the load ends by itself."""

SESSION_FILES = ["session.json", "trace_001.jsonl"]


def _said(by: str) -> str:
    """What the line says of a file replaced ``by`` a FIFO, a device or a directory."""
    return {
        "fifo": "it is a FIFO (a named pipe), not a regular file",
        "zero": "it is a device, not a regular file",
        "dir": "Is a directory",
    }[by]


def _run(data: Path, session_id: str, command: str) -> list[str]:
    tail = {
        "run": ["run", "--session", session_id, "--no-builtin-tools", "again"],
        "fork": ["fork", session_id],
        "rewind": ["rewind", session_id, "--to", "1"],
    }[command]
    return [*tail, "--data-dir", str(data)]


def _made_into(tmp_path: Path, name: str, kind: str) -> tuple[Path, str, Path]:
    """A closed session whose file ``name`` is made into ``kind`` (see ``_replace``): its
    data folder, its id and the path of that file."""
    data, session_id = make_session(tmp_path)
    path = data / "sessions" / session_id / name
    _replace(path, kind)
    return data, session_id, path


# -- the command line ------------------------------------------------------------------------


@pytest.mark.parametrize("name", SESSION_FILES)
@pytest.mark.parametrize("command", ["run", "fork", "rewind"])
def test_a_session_file_that_is_a_fifo_is_one_line_not_a_hang(
    tmp_path: Path, command: str, name: str
) -> None:
    data, session_id, path = _made_into(tmp_path, name, "fifo")
    result = forked(tmp_path, *_run(data, session_id, command))
    line = one_line(result, 2, str(path), _said("fifo"))
    if name == "session.json":
        assert f"session {session_id!r} is unreadable" in line
    assert result.stdout == ""


@pytest.mark.parametrize("name", SESSION_FILES)
@pytest.mark.parametrize("command", ["run", "fork", "rewind"])
def test_a_session_file_that_is_a_link_to_dev_zero_is_one_line_not_read_for_ever(
    tmp_path: Path, command: str, name: str
) -> None:
    data, session_id, path = _made_into(tmp_path, name, "zero")
    result = started(
        tmp_path, *_run(data, session_id, command), preexec_fn=limited_memory
    )
    one_line(result, 2, str(path), _said("zero"))
    assert result.stdout == ""


# -- a program that loads it through Host --------------------------------------------------


async def _raised_within_bound(fifo: Path, call: Callable[[], Awaitable[object]]) -> Exception:
    """What ``call`` raises; a read still waiting on ``fifo`` after :data:`BOUND_S` is let
    go (its writer's end opened and closed: it reads an end), so that it fails the test
    rather than hang it."""
    raised: Exception | None = None

    async def let_go_after_bound() -> None:
        await trio.sleep(BOUND_S)
        while True:  # until nobody is left reading it
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                assert exc.errno == errno.ENXIO, exc
                return
            await trio.sleep(0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(let_go_after_bound)
        try:
            await call()
        except Exception as exc:
            raised = exc
        nursery.cancel_scope.cancel()
    assert raised is not None, "no error for a FIFO"
    return raised


async def _stored_session(host: Host, workspace: Path) -> Session:
    """A new session of ``host``, closed again: stored, its files on disk."""
    session = await host.create_session(provider=ScriptedProvider(()), workspace_dir=workspace)
    await host.close_session(session.id)
    return session


async def test_loading_a_session_whose_session_json_is_a_fifo_raises_session_not_found(
    data_dir: Path, workspace: Path
) -> None:
    async with Host.open(data_dir) as host:
        session = await _stored_session(host, workspace)
        meta = data_dir / "sessions" / session.id / "session.json"
        _replace(meta, "fifo")
        raised = await _raised_within_bound(
            meta, lambda: host.load_session(session.id, provider=ScriptedProvider(()))
        )
    assert isinstance(raised, SessionNotFound), repr(raised)
    assert str(raised) == (
        f"session {session.id!r} is unreadable: {meta}: {_said('fifo')}"
    )


async def test_loading_a_session_whose_trace_is_a_fifo_raises_an_os_error_naming_it(
    data_dir: Path, workspace: Path
) -> None:
    async with Host.open(data_dir) as host:
        session = await _stored_session(host, workspace)
        trace = data_dir / "sessions" / session.id / "trace_001.jsonl"
        trace.write_bytes(b"")
        _replace(trace, "fifo")
        raised = await _raised_within_bound(
            trace, lambda: host.load_session(session.id, provider=ScriptedProvider(()))
        )
        assert isinstance(raised, OSError), repr(raised)
        assert (raised.filename, raised.strerror) == (str(trace), _said("fifo"))
        # Nothing of the refused load holds the session: once the trace is a file, it loads.
        trace.unlink()
        loaded = await host.load_session(session.id, provider=ScriptedProvider(()))
        await host.close_session(loaded.id)


# -- replay on a cluster's store -------------------------------------------------------------


def _cluster_store(data_dir: Path) -> TraceStore:
    return ReplicatingTraceStore(data_dir, on_fenced=lambda _session_id: None)


async def test_replay_on_a_cluster_store_names_a_trace_that_is_a_directory(
    data_dir: Path, workspace: Path
) -> None:
    async with Host.open(data_dir, trace_store=_cluster_store) as host:
        session = await _stored_session(host, workspace)
        trace = data_dir / "sessions" / session.id / "trace_001.jsonl"
        trace.write_bytes(b"")
        _replace(trace, "dir")
        with trio.fail_after(BOUND_S), pytest.raises(UsageError) as info:
            await replay_session(host, session.id, tools=[], provider=ScriptedProvider(()))
    assert str(info.value) == (
        f"session {session.id} cannot be replayed: its trace {trace} is a directory, not a file"
    )
