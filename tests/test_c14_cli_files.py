"""Files of the data dir, of ``--tools`` and of an MCP configuration that are not regular
files, as the command line meets them (R-SEC-1): each is one clear line and the exit code
the CLI documents, never a hang, a read without end, a traceback or a wrong reason.

Before the fixes: a session's trace file or ``session.json`` that was a FIFO hung
``greenroom trace`` and ``greenroom sessions`` (a link to /dev/zero was read for ever);
``replay`` of a session whose trace file was a FIFO hung, and one whose trace file was a
directory said the session had no recorded prompt; ``--tools`` naming a FIFO said the file
was not found; an MCP server's ``envFile`` that was a FIFO hung ``run``.

Every command runs in a child with a timeout (``forked``), or an address-space limit where
it would read without end (``started``), as in ``test_clifix_bad_input``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.forked_cli import shared_forked_cli  # noqa: E402
from tests.test_cli import cli_env  # noqa: E402
from tests.test_clifix_bad_input import (  # noqa: E402
    TIMEOUT_S,
    limited_memory,
    make_session,
    one_line,
    started,
)

ODD_SERVER = ROOT / "tests" / "support" / "mcp_odd_server.py"


def forked(
    tmp_path: Path, *args: str, timeout: int = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``greenroom ARGS`` in a child forked from a loaded command line, ended (SIGALRM)
    past ``timeout``: a bound never waited for, the command ends by itself."""
    return shared_forked_cli().run(
        list(args), cwd=tmp_path, env=cli_env(tmp_path), timeout=timeout, stdin=""
    )


def _replace(path: Path, by: str) -> None:
    """Put a FIFO, a directory or a link to /dev/zero where the file ``path`` is."""
    path.unlink()
    if by == "fifo":
        os.mkfifo(path)  # nobody ever writes it: reading it would wait for ever
    elif by == "dir":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")


# -- trace and sessions --------------------------------------------------------------------


def test_trace_of_a_session_whose_trace_file_is_a_fifo(tmp_path: Path) -> None:
    data, session_id = make_session(tmp_path)
    trace = data / "sessions" / session_id / "trace_001.jsonl"
    _replace(trace, "fifo")
    result = forked(tmp_path, "trace", session_id, "--data-dir", str(data))
    one_line(result, 2, "greenroom trace:", str(trace), "FIFO", "not a regular file")
    assert result.stdout == ""


def test_trace_of_a_session_whose_trace_file_is_a_link_to_dev_zero(tmp_path: Path) -> None:
    data, session_id = make_session(tmp_path)
    trace = data / "sessions" / session_id / "trace_001.jsonl"
    _replace(trace, "zero")
    result = started(
        tmp_path, "trace", session_id, "--data-dir", str(data), preexec_fn=limited_memory
    )
    one_line(result, 2, str(trace), "a device, not a regular file")


@pytest.mark.parametrize("by", ["fifo", "zero"])
def test_sessions_names_a_session_json_that_is_no_regular_file_and_lists_the_others(
    tmp_path: Path, by: str
) -> None:
    data, bad = make_session(tmp_path)
    made = forked(tmp_path, "run", "--no-builtin-tools", "--data-dir", str(data), "again")
    assert made.returncode == 0, made.stderr
    (good,) = [p.name for p in (data / "sessions").iterdir() if p.name != bad]
    meta = data / "sessions" / bad / "session.json"
    _replace(meta, by)
    result = started(tmp_path, "sessions", "--data-dir", str(data), preexec_fn=limited_memory)
    what = "a FIFO (a named pipe)" if by == "fifo" else "a device"
    # One line for the bad one (the exit code of a listing that shows the others: 0).
    one_line(result, 0, f"unreadable session {bad}: {meta}: it is {what}, not a regular file")
    assert good in result.stdout and bad not in result.stdout


def test_sessions_with_only_an_unreadable_session_does_not_also_say_there_are_none(
    tmp_path: Path,
) -> None:
    data, session_id = make_session(tmp_path)
    _replace(data / "sessions" / session_id / "session.json", "fifo")
    result = forked(tmp_path, "sessions", "--data-dir", str(data))
    one_line(result, 0, f"unreadable session {session_id}", "FIFO")


# -- replay --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("by", "said"),
    [("dir", "is a directory, not a file"), ("fifo", "is a FIFO (a named pipe), not a regular")],
)
def test_replay_of_a_session_whose_trace_file_is_not_a_file(
    tmp_path: Path, by: str, said: str
) -> None:
    data, session_id = make_session(tmp_path)
    trace = data / "sessions" / session_id / "trace_001.jsonl"
    _replace(trace, by)
    result = forked(
        tmp_path, "replay", session_id, "--provider", "scripted", "--data-dir", str(data)
    )
    line = one_line(result, 2, "greenroom replay:", f"its trace {trace} {said}")
    assert "no recorded prompt" not in line


# -- --tools and envFile -------------------------------------------------------------------


def test_tools_naming_a_fifo_says_it_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "tools.py"
    os.mkfifo(fifo)
    result = forked(tmp_path, "run", "--no-builtin-tools", "--tools", str(fifo), "hi")
    line = one_line(result, 2, "--tools", str(fifo), "FIFO (a named pipe), not a regular file")
    assert "not found" not in line


def test_tools_naming_a_directory_says_so(tmp_path: Path) -> None:
    folder = tmp_path / "tools.py"
    folder.mkdir()
    result = forked(tmp_path, "run", "--no-builtin-tools", "--tools", str(folder), "hi")
    one_line(result, 2, "--tools", str(folder), "a directory, not a file")


def test_an_mcp_servers_env_file_that_is_a_fifo_is_a_warning_not_a_hang(tmp_path: Path) -> None:
    env_file = tmp_path / "server.env"
    os.mkfifo(env_file)
    config = tmp_path / "servers.json"
    server = {"command": sys.executable, "args": [str(ODD_SERVER)], "envFile": str(env_file)}
    config.write_text(json.dumps({"mcpServers": {"e": server}}))
    result = forked(
        tmp_path, "run", "--no-builtin-tools", "--mcp-config", str(config), "hi", timeout=20
    )
    # The documented code for an envFile that cannot be loaded: a warning, and the server
    # starts without it.
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (warning,) = [line for line in result.stderr.splitlines() if "its envFile" in line]
    assert warning.startswith(f"warning: --mcp-config: {config}: server 'e': its envFile"), warning
    assert "not a regular file" in warning and "it starts without it" in warning
