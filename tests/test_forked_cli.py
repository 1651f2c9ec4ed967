"""The driver that runs the CLI tests' command lines as forked processes
(``support/forked_cli.py``): each process gets its own argv, working directory,
environment, input and exit code, and what would reach a user's terminal — a traceback
above all, which the CLI fuzz looks for — reaches its stderr as the interpreter prints it.
Each case runs a small module of its own in place of ``greenroom``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.forked_cli import SETUP_FAILED, ForkedCli, forked_cli

PROBE = """
import os, sys, time
what = sys.argv[1]
if what == "raise":
    raise RuntimeError("a bug")
if what == "words":
    sys.exit("greenroom: a clear message")
if what == "code":
    sys.exit(3)
if what == "hang":
    time.sleep(600)
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE_VALUE"))
print("stdin", sys.stdin.read())
"""


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[ForkedCli]:
    (tmp_path / "forked_probe.py").write_text(PROBE)
    with forked_cli() as driver:
        yield driver


def _run(
    cli: ForkedCli, tmp_path: Path, *argv: str, stdin: str = "", timeout: int = 60
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROBE_VALUE": str(tmp_path.name)}
    return cli.run(
        list(argv), cwd=tmp_path, env=env, timeout=timeout, stdin=stdin, module="forked_probe"
    )


def test_a_bug_escaping_the_command_is_a_traceback_on_stderr_with_exit_1(
    cli: ForkedCli, tmp_path: Path
) -> None:
    result = _run(cli, tmp_path, "raise")
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.rstrip().endswith("RuntimeError: a bug")


def test_exits_are_the_interpreters(cli: ForkedCli, tmp_path: Path) -> None:
    words = _run(cli, tmp_path, "words")
    assert (words.returncode, words.stderr) == (1, "greenroom: a clear message\n")
    code = _run(cli, tmp_path, "code")
    assert (code.returncode, code.stderr) == (3, "")


def test_each_process_has_its_own_argv_directory_environment_and_input(
    cli: ForkedCli, tmp_path: Path
) -> None:
    first = _run(cli, tmp_path, "show", "é", stdin="piped text")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [
        f"argv ['show', 'é'] cwd {tmp_path} env {tmp_path.name}",
        "stdin piped text",
    ]
    second = _run(cli, tmp_path, "show")
    assert second.stdout.splitlines()[1] == "stdin "


def test_a_process_past_its_timeout_is_killed_and_the_driver_goes_on(
    cli: ForkedCli, tmp_path: Path
) -> None:
    assert _run(cli, tmp_path, "hang", timeout=1).returncode == -14
    assert _run(cli, tmp_path, "code").returncode == 3


def test_a_process_that_cannot_become_the_command_is_told_apart(
    cli: ForkedCli, tmp_path: Path
) -> None:
    result = cli.run(["code"], cwd=tmp_path / "missing", env={}, timeout=60)
    assert result.returncode == SETUP_FAILED
    assert "FileNotFoundError" in result.stderr
