"""A user's mistakes and a broken environment, as ``greenroom`` meets them (R-SEC-1: no
traceback ever reaches a user for their mistake or their environment): each is one clear
line on stderr and an exit code the contract names, never a traceback, a hang, a read
without end, or output lost with exit code 0.

Files named by flags that are FIFOs or devices, a prompt or chat input that never ends or
is not UTF-8, a ``~user`` that names nobody, standard streams the process was started
without, data dirs behind broken symbolic links, an unreadable session given to
``replay``, numbers past a flag's range, a tool module that exits as it loads, a demo
workspace that is a file, and a session id as long as a file.

Command lines that end by themselves are forked from a process that has loaded the command
line (``support/forked_cli.py``); those that need a limit on memory, closed descriptors or
an environment of their own start ``python -m greenroom``. A read without end is caught
by an address-space limit on the child (it fails with MemoryError, not after minutes).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.forked_cli import shared_forked_cli  # noqa: E402
from tests.test_cli import CLI, cli_env  # noqa: E402

TIMEOUT_S = 60
"""A bound on one command, never waited for: each ends by itself (before the fixes, a
FIFO or an endless stdin held some of them until this killed them)."""

MEMORY_LIMIT = 2 * 1024**3
"""The address space of a child that is given an endless input: reading it without a
bound runs into this within seconds (MemoryError), a bounded read never comes near."""

FILE_FLAGS = ["--hooks", "--prices", "--output-schema", "--mcp-config"]


def forked(
    tmp_path: Path, *args: str, stdin: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return shared_forked_cli().run(
        list(args), cwd=tmp_path, env=env or cli_env(tmp_path), timeout=TIMEOUT_S, stdin=stdin
    )


def started(
    tmp_path: Path,
    *args: str,
    stdin: int | bytes = b"",
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m greenroom ARGS`` afresh; ``stdin`` bytes to send, or a descriptor."""
    data = stdin if isinstance(stdin, bytes) else None
    result = subprocess.run(
        [*CLI, *args], cwd=tmp_path, env=env or cli_env(tmp_path), input=data,
        stdin=None if data is not None else stdin, capture_output=True,
        timeout=TIMEOUT_S, preexec_fn=preexec_fn,
    )  # fmt: skip
    return subprocess.CompletedProcess(
        result.args,
        result.returncode,
        result.stdout.decode(errors="replace"),
        result.stderr.decode(errors="replace"),
    )


def limited_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def one_line(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The one line on stderr of a command that ended with ``code``, holding ``needles``."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == code, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def make_session(tmp_path: Path) -> tuple[Path, str]:
    """A data dir holding one finished session of the scripted model, and its id."""
    data = tmp_path / "data"
    made = forked(tmp_path, "run", "--no-builtin-tools", "--data-dir", str(data), "hi")
    assert made.returncode == 0, made.stderr
    (session_id,) = [p.name for p in (data / "sessions").iterdir()]
    return data, session_id


# -- files named by flags ----------------------------------------------------------------


@pytest.mark.parametrize("flag", FILE_FLAGS)
def test_a_flag_s_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path, flag: str) -> None:
    fifo = tmp_path / "settings.json"
    os.mkfifo(fifo)  # nobody ever writes it: opening it to read would wait for ever
    result = forked(tmp_path, "run", "--no-builtin-tools", flag, str(fifo), "hi")
    one_line(result, 2, flag, str(fifo), "FIFO")


@pytest.mark.parametrize("flag", FILE_FLAGS)
def test_a_flag_s_file_that_is_an_endless_device_is_refused_unread(
    tmp_path: Path, flag: str
) -> None:
    result = started(
        tmp_path, "run", "--no-builtin-tools", flag, "/dev/zero", "hi", preexec_fn=limited_memory
    )
    one_line(result, 2, flag, "/dev/zero", "device")


@pytest.mark.parametrize("flag", FILE_FLAGS)
def test_a_flag_s_file_past_the_bound_is_refused_by_its_size(tmp_path: Path, flag: str) -> None:
    large = tmp_path / "large.json"
    with large.open("wb") as file:
        file.truncate(17 * 1024 * 1024)  # sparse: no disk, no memory
    result = forked(tmp_path, "run", "--no-builtin-tools", flag, str(large), "hi")
    one_line(result, 2, flag, "larger than 16 MiB")


@pytest.mark.parametrize("flag", ["--prices", "--output-schema"])
def test_a_flag_s_file_that_is_not_utf8_says_where(tmp_path: Path, flag: str) -> None:
    (tmp_path / "latin1.json").write_bytes(b'{"caf\xe9": 1}')
    result = forked(tmp_path, "run", "--no-builtin-tools", flag, "latin1.json", "hi")
    one_line(result, 2, flag, "not UTF-8 text (byte 0xe9 at offset 5)")


# -- stdin ----------------------------------------------------------------------------------


def test_an_endless_prompt_on_stdin_is_refused_past_the_bound(tmp_path: Path) -> None:
    with open("/dev/zero", "rb") as zero:
        result = started(
            tmp_path, "run", "--no-builtin-tools", stdin=zero.fileno(), preexec_fn=limited_memory
        )
    one_line(result, 2, "the prompt on stdin is larger than 16 MiB")


def test_a_prompt_on_stdin_that_is_not_utf8_is_refused_not_mangled(tmp_path: Path) -> None:
    data = tmp_path / "data"
    result = started(
        tmp_path, "run", "--no-builtin-tools", "--data-dir", str(data), stdin=b"caf\xe9 au lait\n"
    )
    one_line(result, 2, "not UTF-8 text (byte 0xe9 at offset 3)")
    assert not (data / "sessions").exists() or not list((data / "sessions").iterdir())


def test_a_prompt_on_stdin_undecodable_in_a_strict_encoding_is_no_traceback(
    tmp_path: Path,
) -> None:
    env = {**cli_env(tmp_path), "PYTHONIOENCODING": "ascii"}
    result = started(tmp_path, "run", "--no-builtin-tools", stdin=b"caf\xc3\xa9\n", env=env)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert "café" in result.stdout  # decoded as UTF-8 whatever sys.stdin's encoding is


def test_chat_on_an_endless_line_ends_its_input_and_leaves(tmp_path: Path) -> None:
    with open("/dev/zero", "rb") as zero:
        result = started(
            tmp_path, "chat", "--no-builtin-tools", stdin=zero.fileno(), preexec_fn=limited_memory
        )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[input] a line longer than 16 MiB" in result.stderr
    assert "to resume: greenroom chat --session" in result.stderr


# -- paths and homes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["sessions", "--data-dir", "~nosuchuser-gr/data"],
        ["run", "--no-builtin-tools", "--prices", "~nosuchuser-gr/prices.json", "hi"],
        ["run", "--no-builtin-tools", "--workspace", "~nosuchuser-gr", "hi"],
        ["run", "--no-builtin-tools", "--tools", "~nosuchuser-gr/tools.py", "hi"],
        ["run", "--no-builtin-tools", "--mcp-config", "~nosuchuser-gr/mcp.json", "hi"],
    ],
    ids=["data-dir", "prices", "workspace", "tools", "mcp-config"],
)
def test_a_path_under_an_unknown_user_s_home_is_a_usage_error(
    tmp_path: Path, args: list[str]
) -> None:
    result = forked(tmp_path, *args)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    assert "cannot expand ~nosuchuser-gr" in result.stderr


def test_a_greenroom_home_under_an_unknown_user_is_one_line(tmp_path: Path) -> None:
    env = {**cli_env(tmp_path), "GREENROOM_HOME": "~nosuchuser-gr/greenroom"}
    one_line(forked(tmp_path, "sessions", env=env), 2, "GREENROOM_HOME", "cannot expand")


def test_chat_with_a_data_dir_and_no_default_one_says_how_to_resume(tmp_path: Path) -> None:
    # The default data dir cannot be named (its ~ names nobody): the resume hint has the
    # data dir given, and comparing the two is no traceback.
    env = {**cli_env(tmp_path), "GREENROOM_HOME": "~nosuchuser-gr/greenroom"}
    data = tmp_path / "data"
    result = forked(
        tmp_path, "chat", "--no-builtin-tools", "--data-dir", str(data), stdin="/quit\n", env=env
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert f"--data-dir {data}" in result.stderr


# -- standard streams the process was started without ------------------------------------


def test_run_started_without_stdin_runs_the_prompt_of_its_words(tmp_path: Path) -> None:
    result = started(
        tmp_path, "run", "--no-builtin-tools", "hi", stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert 'You asked: "hi"' in result.stdout


def test_fork_started_without_stdout_refuses_rather_than_lose_the_new_id(tmp_path: Path) -> None:
    data, session_id = make_session(tmp_path)
    result = started(
        tmp_path, "fork", session_id, "--data-dir", str(data), preexec_fn=lambda: os.close(1)
    )
    one_line(result, 2, "stdout is closed")
    assert [p.name for p in (data / "sessions").iterdir()] == [session_id]  # no fork made


# -- data dirs behind symbolic links --------------------------------------------------------


@pytest.mark.parametrize("command", [["sessions"], ["run", "--no-builtin-tools", "hi"]])
def test_a_data_dir_that_is_a_symlink_loop_says_so(tmp_path: Path, command: list[str]) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    result = forked(tmp_path, *command, "--data-dir", str(loop))
    line = one_line(result, 2, "--data-dir", str(loop), "symbolic link in a loop")
    assert "File exists" not in line


def test_a_data_dir_that_is_a_dangling_symlink_says_so(tmp_path: Path) -> None:
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "gone" / "data")
    result = forked(tmp_path, "run", "--no-builtin-tools", "--data-dir", str(link), "hi")
    line = one_line(result, 2, "--data-dir", "symbolic link to", "which does not exist")
    assert "File exists" not in line


def test_a_data_dir_whose_sessions_is_a_file_says_it_is_not_a_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "sessions").write_text("not a directory\n")
    result = forked(tmp_path, "run", "--no-builtin-tools", "--data-dir", str(data), "hi")
    line = one_line(result, 2, str(data / "sessions"), "not a directory")
    assert "File exists" not in line


# -- sessions and their ids -----------------------------------------------------------------


def test_replay_of_a_session_whose_metadata_is_unreadable_is_one_line(tmp_path: Path) -> None:
    data, session_id = make_session(tmp_path)
    (data / "sessions" / session_id / "session.json").write_text("not json{")
    result = forked(
        tmp_path, "replay", session_id, "--provider", "scripted", "--data-dir", str(data)
    )
    one_line(result, 2, f"session {session_id!r} is unreadable", "not JSON")


def test_a_session_id_as_long_as_a_file_is_not_a_session_id(tmp_path: Path) -> None:
    long_id = "x" * 10_000
    for args in (["trace", long_id], ["fork", long_id], ["run", "--session", long_id, "hi"]):
        line = one_line(forked(tmp_path, *args), 2, "is not a session id", "10000 characters")
        assert len(line) < 200, line


# -- numbers past a flag's range ----------------------------------------------------------


def test_max_turns_past_the_bound_is_refused_as_the_flag_is_read(tmp_path: Path) -> None:
    result = forked(tmp_path, "run", "--no-builtin-tools", "--max-turns", "9" * 20, "hi")
    assert result.returncode == 2, result.stderr
    assert "argument --max-turns: must be at most" in result.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["fork", "20990101-000000-abcdef", "--at"], "argument --at: a seq is 0 or more"),
        (["serve", "--port"], "argument --port: must be between 0 and 65535"),
        (["run", "--max-concurrent-requests"], "must be at least 1"),
    ],
)
def test_a_hugely_negative_number_is_told_its_own_bound(
    tmp_path: Path, args: list[str], words: str
) -> None:
    result = forked(tmp_path, *args, "-" + "9" * 20)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr, result.stderr


# -- tool modules and the demo ---------------------------------------------------------------


def test_a_tool_module_that_exits_as_it_loads_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    result = forked(tmp_path, "run", "--no-builtin-tools", "--tools", "exits.py", "hi")
    one_line(result, 2, "--tools", "exits.py", "sys.exit(0)")


def test_demo_with_a_workspace_that_is_a_file_says_it_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    result = forked(tmp_path, "demo", "--workspace", "notes.txt")
    line = one_line(result, 2, "--workspace", "notes.txt is not a directory")
    assert "Errno" not in line
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
