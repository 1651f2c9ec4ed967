#!/usr/bin/env python3
"""Set up and run greenroom from a fresh clone with nothing but Python >= 3.11 and pip.

    python3 tasks.py demo     # create .venv, install, run `greenroom demo`
    python3 tasks.py test     # create .venv, install with dev extras, run ruff, mypy, pytest
    python3 tasks.py check    # ruff + mypy only

Extra arguments after the command go to `greenroom demo` or to pytest.

pytest runs in three worker processes (pytest-xdist): most tests wait on subprocesses,
sockets and files rather than on the CPU, so even on two cores a third worker uses time the
other two leave idle (two workers kept the CPU 147% busy, three 171%).
`GREENROOM_TEST_WORKERS=N` sets another count (0: one process); so does `-n N` given to
pytest here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
TYPECHECK_TREE = ROOT / "build" / "typecheck"


def sh(*cmd: str | Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    result = subprocess.run([str(c) for c in cmd], cwd=ROOT)
    if result.returncode != 0:
        sys.exit(result.returncode)


def ensure_venv(extras: str) -> None:
    if sys.version_info < (3, 11):
        sys.exit("greenroom needs Python >= 3.11")
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / f".installed-{extras or 'base'}"
    pyproject = ROOT / "pyproject.toml"
    if not stamp.exists() or stamp.stat().st_mtime < pyproject.stat().st_mtime:
        sh(PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e",
           f".[{extras}]" if extras else ".")
        stamp.touch()


def typecheck_tree() -> Path:
    """mypy cannot follow the editable install's import hook, so it reads the packages
    through directory links that give them their installed names."""
    package = TYPECHECK_TREE / "greenroom"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("actors", "protocols"):
        link = package / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    for name in ("__init__.py", "py.typed"):
        link = package / name
        if not link.is_symlink():
            link.symlink_to(ROOT / "actors" / "_root" / name)
    return TYPECHECK_TREE


def check() -> None:
    sh(BIN / "ruff", "check", "actors", "protocols", "tests", "examples", "tasks.py")
    tree = typecheck_tree()
    env_path = str(tree)
    print("+ mypy --strict -p greenroom", flush=True)
    result = subprocess.run(
        [str(BIN / "mypy"), "-p", "greenroom"],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": env_path},
    )
    if result.returncode != 0:
        sys.exit(result.returncode)


def worker_options(pytest_args: list[str]) -> list[str]:
    """``-n N`` for pytest-xdist, unless the arguments choose already."""
    if any(a in ("-n", "--numprocesses", "no:xdist") or a.startswith(("-n", "--numprocesses="))
           for a in pytest_args):
        return []
    workers = os.environ.get("GREENROOM_TEST_WORKERS", "3").strip()
    if not workers.isdigit():
        sys.exit(f"GREENROOM_TEST_WORKERS must be a number of processes, not {workers!r}")
    return ["-n", workers]


def main() -> None:
    command, *rest = sys.argv[1:] or ["help"]
    if command == "demo":
        ensure_venv("")
        sh(BIN / "greenroom", "demo", *rest)
    elif command == "test":
        ensure_venv("dev")
        check()
        sh(PY, "-m", "pytest", *worker_options(rest), *rest)
    elif command == "check":
        ensure_venv("dev")
        check()
    else:
        print(__doc__)
        sys.exit(0 if command == "help" else 2)


if __name__ == "__main__":
    main()
