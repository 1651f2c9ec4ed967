"""A bounded fuzz trial of the command line (R-SEC-1: no traceback ever reaches a user for
their mistake). A seeded generator builds 32 command lines for the commands that end by
themselves — ``run``, ``demo``, ``sessions``, ``trace``, ``usage``, ``approvals``,
``approve``, ``answer``, ``fork``, ``rewind``, ``replay`` — from each command's own
options with values drawn from good and bad ones (empty, negative, huge, not a number,
paths that do not exist or are files, lone surrogates, session ids that are not there),
against a data dir that holds a real session. Each ends with an exit code the contract
names and, when it fails, words on stderr: never a traceback.

Each command line is its own process, forked from one that has loaded the command line
(``support/forked_cli.py``): the trial pays for its cases, not for loading the command line
33 times.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
from pathlib import Path

import pytest
from support.forked_cli import ForkedCli, forked_cli

from greenroom.actors.apps.cli import build_parser

CASES = 32
COMMANDS = [
    "run", "demo", "sessions", "trace", "usage", "approvals", "approve", "answer",
    "fork", "rewind", "replay",
]  # fmt: skip
EXIT_CODES = {0, 1, 2, 3, 130}
TIMEOUT_S = 120
"""A bound on one command, never waited for: each ends by itself."""


def _options(command: str) -> tuple[list[argparse.Action], list[str]]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = sub.choices[command]
    options = [a for a in commands._actions if a.option_strings and a.dest != "help"]
    positionals = [a.dest for a in commands._actions if not a.option_strings]
    return options, positionals


def _value(rng: random.Random, tmp_path: Path, session_id: str) -> str:
    return rng.choice(
        [
            "", "-1", "0", "1", "3", "99999999999999999999", "abc", "1.5", "nan",
            "all", "none", "ask", "scripted", "anthropic", "json", "allow", "deny",
            str(tmp_path / "missing" / "dir"), str(tmp_path / "a-file.txt"), str(tmp_path),
            session_id, "20990101-000000-abcdef", "../../etc", "\udcff", "x" * 5000,
        ]
    )  # fmt: skip


def _command_line(rng: random.Random, tmp_path: Path, data_dir: Path, session_id: str) -> list[str]:
    command = rng.choice(COMMANDS)
    options, positionals = _options(command)
    argv = [command]
    for _ in range(rng.randint(0, 4)):
        action = rng.choice(options)
        flag = rng.choice(action.option_strings)
        if action.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, _value(rng, tmp_path, session_id)]
    for _ in positionals:
        if rng.random() < 0.9:
            argv.append(_value(rng, tmp_path, session_id))
    if command == "run" and "--provider" not in argv:
        argv += ["--provider", "scripted"]  # never a network: no key, no model service
    if "--data-dir" not in argv and rng.random() < 0.9:
        argv += ["--data-dir", str(data_dir)]
    return argv


def _run(cli: ForkedCli, tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")
    }
    env["GREENROOM_HOME"] = str(tmp_path / "home")
    env["TMPDIR"] = str(tmp_path)
    env["NO_COLOR"] = "1"
    return cli.run(argv, cwd=tmp_path, env=env, timeout=TIMEOUT_S)


@pytest.mark.parametrize("batch", range(2))
def test_fuzzed_command_lines_end_in_words_never_a_traceback(tmp_path: Path, batch: int) -> None:
    data_dir = tmp_path / "data"
    (tmp_path / "a-file.txt").write_text("not a directory\n")
    with forked_cli() as cli:
        made = _run(
            cli, tmp_path, ["run", "--provider", "scripted", "--data-dir", str(data_dir), "hi"]
        )
        assert made.returncode == 0, made.stderr
        (session_id,) = [p.name for p in (data_dir / "sessions").iterdir()]
        rng = random.Random(batch)
        for case in range(CASES // 2):
            argv = _command_line(rng, tmp_path, data_dir, session_id)
            result = _run(cli, tmp_path, argv)
            what = f"case {case}: greenroom {' '.join(a[:40] for a in argv)!r}"
            assert "Traceback" not in result.stderr, f"{what}\n{result.stderr}"
            assert result.returncode in EXIT_CODES, (
                f"{what}: exit {result.returncode}\n{result.stderr}"
            )
            if result.returncode == 2:
                assert result.stderr.strip(), f"{what}: exit 2 without a word"
