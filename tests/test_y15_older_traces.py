"""A session's older trace file (not its latest) that cannot be read — a FIFO, a link to
/dev/zero, a directory — as loading, listing and showing the session meet it (R-TRACE,
R-SEC-1): loading fails with an OSError naming the file and why (the path a latest trace
that cannot be read takes), ``sessions`` lists the session as unreadable, ``trace`` says so
in one line; never a session rebuilt without the history that file holds.

Before the fix: every trace file but the latest was read through a reader that skipped the
one it could not read, silently. A session whose latest trace starts with a rewind into an
earlier context loaded without the records before the rewind point (its model saw none of
them), and ``sessions`` and ``trace`` showed it as any other.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import collect, open_host

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.providers.scripted import Reply, text  # noqa: E402
from greenroom.actors.runtime.host import Host  # noqa: E402
from tests.test_c14_cli_files import _replace, forked  # noqa: E402
from tests.test_clifix_bad_input import make_session, one_line  # noqa: E402
from tests.test_d15_session_files import _said  # noqa: E402
from tests.test_time_travel import rewind_past_a_compaction  # noqa: E402

KINDS = ["fifo", "zero", "dir"]


async def _rewound_past_a_compaction(data_dir: Path, workspace: Path, providers: Any) -> str:
    """A closed session whose latest trace (``trace_003.jsonl``) starts with a rewind into
    its first context (``trace_001.jsonl``): loading it needs that older file."""
    provider = providers(
        [
            Reply(blocks=(text("first answer"),)),
            Reply(blocks=(text("[summary]they asked once[/summary]"),)),
            Reply(blocks=(text("second answer"),)),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await rewind_past_a_compaction(session)
        return session.id


async def _older_trace_made_into(
    data_dir: Path, workspace: Path, providers: Any, by: str
) -> tuple[str, Path]:
    """A session of :func:`_rewound_past_a_compaction` whose older trace file is made into
    ``by`` (see ``_replace``): its id and that file's path."""
    session_id = await _rewound_past_a_compaction(data_dir, workspace, providers)
    older = data_dir / "sessions" / session_id / "trace_001.jsonl"
    _replace(older, by)
    return session_id, older


async def _load_error(data_dir: Path, session_id: str, providers: Any) -> OSError:
    async with open_host(data_dir) as host:
        with pytest.raises(OSError) as info:
            loaded = await host.load_session(session_id, provider=providers([]))
            # What it would have been: a context without the first question.
            pytest.fail(f"loaded without its older trace: {loaded.transcript.messages!r}")
    return info.value


@pytest.mark.parametrize("by", KINDS)
async def test_loading_a_rewound_session_whose_older_trace_is_no_file_names_it(
    data_dir: Path, workspace: Path, providers: Any, by: str
) -> None:
    session_id, older = await _older_trace_made_into(data_dir, workspace, providers, by)
    raised = await _load_error(data_dir, session_id, providers)
    assert (raised.filename, raised.strerror) == (str(older), _said(by))
    # Nothing of the refused load holds the session: once the file is back, it loads.
    older.rmdir() if by == "dir" else older.unlink()
    older.write_bytes(b"")
    async with open_host(data_dir) as host:
        await host.close_session((await host.load_session(session_id, provider=providers([]))).id)


async def test_loading_a_session_whose_older_trace_is_a_fifo_names_it_even_unneeded(
    data_dir: Path, workspace: Path, providers: Any
) -> None:
    """Its latest trace is its whole context, but what reads its history later (a gateway's
    replay, a child's answer, a rewind) would not have it: the session is unreadable."""
    provider = providers(
        [
            Reply(blocks=(text("first answer"),)),
            Reply(blocks=(text("[summary]they asked once[/summary]"),)),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("first question"))
        assert (await session.compact()) is not None
        assert session.trace_path.name == "trace_002.jsonl"
        session_id = session.id
    older = data_dir / "sessions" / session_id / "trace_001.jsonl"
    _replace(older, "fifo")
    raised = await _load_error(data_dir, session_id, providers)
    assert (raised.filename, raised.strerror) == (str(older), _said("fifo"))


@pytest.mark.parametrize("by", ["fifo", "dir"])
async def test_reading_the_history_of_a_session_whose_older_trace_is_no_file_fails(
    data_dir: Path, workspace: Path, providers: Any, by: str
) -> None:
    session_id, older = await _older_trace_made_into(data_dir, workspace, providers, by)
    async with Host.open(data_dir) as host:
        with pytest.raises(OSError) as info:
            await host.trace_store.log.read_after(session_id)
    assert (info.value.filename, info.value.strerror) == (str(older), _said(by))


@pytest.mark.parametrize("by", ["fifo", "zero"])
async def test_scanning_lists_a_session_whose_older_trace_is_no_file_as_unreadable(
    data_dir: Path, workspace: Path, providers: Any, by: str
) -> None:
    session_id, older = await _older_trace_made_into(data_dir, workspace, providers, by)
    async with Host.open(data_dir) as host:
        scan = await host.scan_sessions()
    assert scan.sessions == ()
    (bad,) = scan.unreadable
    assert (bad.session_id, bad.reason) == (session_id, f"{older}: {_said(by)}")


# -- the command line ------------------------------------------------------------------------


def _with_an_older_fifo(tmp_path: Path) -> tuple[Path, str, Path]:
    """A session of the CLI with a second trace file, its first one replaced by a FIFO."""
    data, session_id = make_session(tmp_path)
    directory = data / "sessions" / session_id
    first = directory / "trace_001.jsonl"
    (directory / "trace_002.jsonl").write_bytes(first.read_bytes())
    _replace(first, "fifo")
    return data, session_id, first


def test_trace_of_a_session_whose_older_trace_is_a_fifo_is_one_line(tmp_path: Path) -> None:
    data, session_id, first = _with_an_older_fifo(tmp_path)
    result = forked(tmp_path, "trace", session_id, "--data-dir", str(data))
    one_line(result, 2, str(first), _said("fifo"))
    assert result.stdout == ""


def test_sessions_names_a_session_whose_older_trace_is_a_fifo(tmp_path: Path) -> None:
    data, session_id, first = _with_an_older_fifo(tmp_path)
    result = forked(tmp_path, "sessions", "--data-dir", str(data))
    one_line(result, 0, f"unreadable session {session_id}: {first}: {_said('fifo')}")
