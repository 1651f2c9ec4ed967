"""The environment's problems as ``greenroom`` reports them: one line on stderr naming what
is wrong, exit 2, never a traceback — a data dir that is a file, that cannot be created or
is not writable (also the default one under ``$HOME``), and ``serve``'s port, address and
token file. Errors raised inside trio nurseries arrive as exception groups; the command
line unwraps them in one place.

The suite runs as root, which writes through any permission bits. For "not writable" the
child runs without the two capabilities that grant that (``CAP_DAC_OVERRIDE``,
``CAP_DAC_READ_SEARCH``): root then meets permission bits like any user. A case is skipped,
with the reason, only when even that leaves the directory writable.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.forked_cli import shared_forked_cli  # noqa: E402
from tests.test_cli import CLI, TIMEOUT_S, cli_env, greenroom  # noqa: E402

UNKNOWN_SESSION = "20990101-000000-abcdef"

# Each command that uses a data dir, with the arguments it needs to start.
COMMANDS: dict[str, list[str]] = {
    "run": ["run", "--no-builtin-tools", "hi"],
    "chat": ["chat", "--no-builtin-tools"],
    "sessions": ["sessions"],
    "trace": ["trace", UNKNOWN_SESSION],
    "serve": ["serve", "--port", "0", "--no-console", "--no-builtin-tools"],
}


def run_cli(
    tmp_path: Path,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``greenroom ARGS`` to its end: forked from the loaded command line
    (``support/forked_cli.py``), or started afresh when ``preexec_fn`` must run in it."""
    if preexec_fn is None:
        return shared_forked_cli().run(
            args, cwd=tmp_path, env=env or cli_env(tmp_path), timeout=TIMEOUT_S
        )
    return subprocess.run(
        [*CLI, *args], cwd=tmp_path, env=env or cli_env(tmp_path), input="",
        capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=preexec_fn,
    )  # fmt: skip


def assert_one_line(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    return lines[0]


# -- a data dir that is a file, or below one -------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_data_dir_that_is_a_file(tmp_path: Path, command: str) -> None:
    data = tmp_path / "data"
    data.write_text("not a directory\n")
    result = greenroom(tmp_path, *COMMANDS[command], "--data-dir", str(data))
    line = assert_one_line(result, f"greenroom {command}:", str(data), "is not a directory")
    assert "listen" not in line and "port" not in line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_data_dir_below_a_regular_file(tmp_path: Path, command: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file\n")
    data = blocker / "data"
    result = greenroom(tmp_path, *COMMANDS[command], "--data-dir", str(data))
    verb = "cannot read" if command == "trace" else "cannot create"
    line = assert_one_line(result, str(data), verb, f"{blocker} is not a directory")
    assert "listen" not in line and "port" not in line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_default_data_dir_under_a_home_that_is_a_file(tmp_path: Path, command: str) -> None:
    home = tmp_path / "home-file"
    home.write_text("a file\n")
    env = {k: v for k, v in cli_env(tmp_path).items() if k != "GREENROOM_HOME"}
    env["HOME"] = str(home)
    result = run_cli(tmp_path, COMMANDS[command], env=env)
    assert_one_line(result, str(home / ".greenroom"), "--data-dir", "GREENROOM_HOME")


# -- not writable ---------------------------------------------------------------------------

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2


def _capability_dropper() -> Callable[[], None] | None:
    """A ``preexec_fn`` that takes from root the capabilities that ignore permission bits
    (from the bounding set: the exec'd interpreter then lacks them); None when not root."""
    if os.geteuid() != 0:
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after the fork

    def drop() -> None:
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop


@pytest.fixture
def unprivileged(tmp_path: Path) -> Callable[[], None] | None:
    """How to start a child for whom a chmod 0555 directory is really not writable; the
    test is skipped (with the reason) when no such child can be made here."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    probe_dir.chmod(0o555)
    try:
        drop = _capability_dropper()
        code = f"open({str(probe_dir / 'x')!r}, 'w')"
        try:
            probe = subprocess.run(
                [sys.executable, "-c", code], preexec_fn=drop, capture_output=True,
                timeout=TIMEOUT_S,
            )  # fmt: skip
        except subprocess.SubprocessError as exc:
            reason = f"cannot start a child without CAP_DAC_OVERRIDE: {exc}"
            print(reason)
            pytest.skip(reason)
        if probe.returncode == 0:
            reason = "a chmod 0555 directory stays writable for this user (root privileges)"
            print(reason)
            pytest.skip(reason)
        return drop
    finally:
        probe_dir.chmod(0o755)


@pytest.mark.parametrize("command", ["run", "chat", "sessions", "serve"])
def test_a_data_dir_that_is_not_writable(
    tmp_path: Path, command: str, unprivileged: Callable[[], None] | None
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o555)
    try:
        result = run_cli(tmp_path, [*COMMANDS[command], "--data-dir", str(data)],
                         preexec_fn=unprivileged)  # fmt: skip
    finally:
        data.chmod(0o755)
    line = assert_one_line(result, f"greenroom {command}:", str(data), "is not writable")
    assert "listen" not in line and "port" not in line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_default_data_dir_under_an_unwritable_home(
    tmp_path: Path, command: str, unprivileged: Callable[[], None] | None
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    env = {k: v for k, v in cli_env(tmp_path).items() if k != "GREENROOM_HOME"}
    env["HOME"] = str(home)
    try:
        result = run_cli(tmp_path, COMMANDS[command], env=env, preexec_fn=unprivileged)
    finally:
        home.chmod(0o755)
    if command == "trace":  # reading needs no writable home: there is just no such session
        assert_one_line(result, f"no session {UNKNOWN_SESSION!r}")
        return
    assert_one_line(
        result, f"cannot create {home / '.greenroom'}", f"{home} is not writable", "--data-dir"
    )


def test_trace_reads_a_data_dir_it_cannot_write(
    tmp_path: Path, unprivileged: Callable[[], None] | None
) -> None:
    data = tmp_path / "data"
    made = greenroom(tmp_path, "run", "--json", "--data-dir", str(data), "hello")
    assert made.returncode == 0, made.stderr
    session_id = made.stderr.split("session: ", 1)[1].split()[0]
    for path in (data, *data.rglob("*")):
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        result = run_cli(tmp_path, ["trace", session_id, "--data-dir", str(data)],
                         preexec_fn=unprivileged)  # fmt: skip
    finally:
        for path in (data, *data.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert result.returncode == 0, result.stderr
    assert "task_end" in result.stdout


# -- serve: port, address, token file -------------------------------------------------------


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The workspace must not hold the data dir, or serve refuses that first (R-SEC-5).
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    return greenroom(tmp_path, "serve", "--no-console", "--no-builtin-tools",
                     "--data-dir", str(tmp_path / "data"), "--workspace", str(workspace),
                     *args)  # fmt: skip


def test_serve_on_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(tmp_path, "--port", str(port))
    assert_one_line(result, "greenroom serve:", f"127.0.0.1:{port}", "in use")


def test_serve_on_an_address_this_machine_does_not_have(tmp_path: Path) -> None:
    result = serve(tmp_path, "--host", "192.0.2.1", "--port", "0")  # TEST-NET-1
    assert_one_line(result, "greenroom serve: --host:", "192.0.2.1")


def test_serve_with_a_token_file_that_is_a_directory(tmp_path: Path) -> None:
    directory = tmp_path / "tokens"
    directory.mkdir()
    result = serve(tmp_path, "--port", "0", "--token-file", str(directory))
    assert_one_line(result, "--token-file", str(directory), "is a directory")


def test_serve_with_an_empty_token_file(tmp_path: Path) -> None:
    # Found inside the host's nursery: it arrives wrapped in an exception group.
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    result = serve(tmp_path, "--port", "0", "--token-file", str(token_file))
    assert_one_line(result, "greenroom serve:", str(token_file), "no usable token")


def test_serve_with_a_token_file_holding_a_short_token(tmp_path: Path) -> None:
    # R-SEC-4: --tokens-file refused such a token; --token-file served with it.
    token_file = tmp_path / "token"
    token_file.write_text("secret\n")
    result = serve(tmp_path, "--port", "0", "--token-file", str(token_file))
    assert_one_line(result, "greenroom serve:", str(token_file), "shorter than 16 characters")


# -- a Claude model without a key ------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--no-builtin-tools", "hi"],
        ["chat", "--no-builtin-tools"],
        ["serve", "--port", "0", "--no-console", "--no-builtin-tools"],
        ["acp", "--no-builtin-tools"],
        ["demo"],
    ],
    ids=lambda args: args[0],
)
def test_a_claude_model_without_a_key_is_refused_not_run_on_the_scripted_model(
    tmp_path: Path, args: list[str]
) -> None:
    """Asking for Claude never runs another model silently: without ANTHROPIC_API_KEY or
    ANTHROPIC_AUTH_TOKEN, ``--model claude-…`` is refused with exit 2, as
    ``Host.create_session(model="claude-…")`` raises ConfigurationError."""
    command = [*args, "--model", "claude-sonnet-5-5", "--data-dir", str(tmp_path / "data")]
    result = run_cli(tmp_path, command)
    line = assert_one_line(result, "--model claude-sonnet-5-5", "ANTHROPIC_API_KEY",
                           "ANTHROPIC_AUTH_TOKEN", "--provider scripted")  # fmt: skip
    assert line.startswith(f"greenroom {args[0]}: "), line
    assert not (tmp_path / "data" / "sessions").exists() or not any(
        (tmp_path / "data" / "sessions").iterdir()
    )


# -- a number too large for a float in a file a flag names --------------------------------------

BIG = "1" + "0" * 400  # valid JSON, read as an int that float() cannot take


@pytest.mark.parametrize(
    ("flag", "content", "problem"),
    [
        ("--prices", '{"m": {"input": ' + BIG + ', "output": 1}}',
         "$.m.input: expected a number >= 0, got one too large"),
        ("--hooks", '{"before_tool": [{"command": "true", "timeout": ' + BIG + "}]}",
         "$.before_tool[0].timeout: expected a number of seconds above 0, got one too large"),
    ],
    ids=["prices", "hooks"],
)  # fmt: skip
def test_a_number_too_large_for_a_float_in_a_flag_s_file_is_one_line(
    tmp_path: Path, flag: str, content: str, problem: str
) -> None:
    """A 400-digit integer is valid JSON; turning it into seconds or a price raised
    OverflowError, a traceback. It is the file's own error, naming the place."""
    file = tmp_path / "file.json"
    file.write_text(content)
    result = run_cli(tmp_path, ["run", "--no-builtin-tools", flag, str(file), "hi"])
    assert_one_line(result, f"{flag}: {file}: {problem}")


@pytest.mark.parametrize("flag", ["--hooks", "--prices", "--output-schema"])
def test_a_flag_s_file_nested_too_deeply_is_one_line(tmp_path: Path, flag: str) -> None:
    """A JSON file nested 100,000 levels deep raised RecursionError, which only a
    ValueError handler stood before: a traceback. It is the file's usage error."""
    file = tmp_path / "file.json"
    file.write_text("[" * 100_000)
    result = run_cli(tmp_path, ["run", "--no-builtin-tools", flag, str(file), "hi"])
    assert_one_line(result, f"{flag}: {file}: not JSON: nested too deeply")


def test_a_number_too_large_for_a_float_in_an_mcp_config_skips_that_server(
    tmp_path: Path,
) -> None:
    """R-MCP-6: an entry that cannot be used is a warning naming it, and the run goes on
    without that server; a 400-digit ``timeout_s`` gave a traceback instead."""
    file = tmp_path / "servers.json"
    file.write_text('{"mcpServers": {"x": {"command": "true", "timeout_s": ' + BIG + "}}}")
    result = run_cli(tmp_path, ["run", "--no-builtin-tools", "--mcp-config", str(file), "hi"])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert (f"warning: --mcp-config: {file}: $.mcpServers.x.timeout_s: expected a positive "
            "number of seconds, got one too large; server 'x' skipped") in result.stderr
