"""Runs many short ``greenroom`` command lines as processes forked from one that has loaded
the command line once (POSIX only).

Each command line is its own process, as ``python -m greenroom`` would be: its own argv,
working directory, environment, stdin (a file), stdout, stderr and exit code; what it does
not pay again is loading the command line (a few tenths of a second each, most of what a
short command costs). The tests' ``greenroom`` helper and the CLI fuzz run through it; a
test of start-up, of signals or of a terminal starts ``python -m greenroom``.

    python tests/support/forked_cli.py     # requests on stdin, answers on stdout

A request is one JSON line ``{"argv": [...], "cwd": ..., "env": {...}, "in": PATH, "out":
PATH, "err": PATH, "timeout": SECONDS, "module": NAME}`` (what ``python -m`` would run:
``greenroom``, or a test's own module in the tests of this driver); the answer is one JSON
line ``{"code": N}`` once that process has ended (-N for a signal: -14 for one its timeout
killed). The driver reads and writes its own stdin and stdout through the file descriptors
only, so a forked child inherits no buffered request or answer.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import greenroom.actors.apps.cli  # noqa: F401  (loaded once, before any fork)

HERE = Path(__file__).resolve()
SETUP_FAILED = 125
"""The exit code of a forked process that could not become the command line (its working
directory, input or output files): told apart from every exit code the command gives."""


def _child(request: dict[str, Any]) -> int:
    """The forked process: becomes the command line of the request, as the interpreter
    would run ``python -m greenroom``, and returns its exit code."""
    # Its output first (the driver's own files), so that a failure to become the command
    # line is written where the caller reads.
    stdin = os.open(request["in"], os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # chosen again from this process's TMPDIR
    random.seed()
    module = request["module"]
    sys.argv = [module, *request["argv"]]
    sys.path[0] = request["cwd"]  # as ``-m`` puts the working directory first
    signal.alarm(request["timeout"])  # a command that never ends fails its trial, SIGALRM
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()  # as the interpreter prints what escapes
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            traceback.print_exc()
            code = 120  # as the interpreter does when flushing fails at exit
    return code


def _serve() -> None:
    pending = b""
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                code = SETUP_FAILED
                try:
                    code = _child(request)
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            os.write(1, json.dumps({"code": code}).encode() + b"\n")


class ForkedCli:
    """A running driver: :meth:`run` runs one command line and returns its result. One
    command line at a time (a lock keeps threads from sharing a request)."""

    def __init__(self, driver: subprocess.Popen[bytes], files: Path) -> None:
        self._driver = driver
        self._files = files
        self._lock = threading.Lock()

    def run(
        self,
        argv: list[str],
        *,
        cwd: Path,
        env: dict[str, str],
        timeout: int,
        stdin: str = "",
        module: str = "greenroom",
    ) -> subprocess.CompletedProcess[str]:
        """Run ``greenroom ARGV`` in its own forked process with STDIN as its input and return
        its exit code and output as :func:`subprocess.run` would (text, undecodable bytes
        replaced). A process still running after TIMEOUT seconds is killed (SIGALRM, exit
        code -14). ``module``: what ``python -m`` would run."""
        assert self._driver.stdin is not None and self._driver.stdout is not None
        with self._lock:
            given, out, err = (self._files / name for name in ("in", "out", "err"))
            given.write_text(stdin)
            request = {"argv": argv, "cwd": str(cwd), "env": env, "in": str(given),
                       "out": str(out), "err": str(err), "timeout": timeout,
                       "module": module}  # fmt: skip
            self._driver.stdin.write(json.dumps(request).encode() + b"\n")
            self._driver.stdin.flush()
            answer = self._driver.stdout.readline()
            if not answer:
                raise RuntimeError(f"the forked CLI driver ended (exit {self._driver.wait()})")
            return subprocess.CompletedProcess(
                ["greenroom", *argv],
                json.loads(answer)["code"],
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )

    def close(self) -> None:
        """End the driver (it ends when its stdin closes) and remove its files."""
        assert self._driver.stdin is not None
        self._driver.stdin.close()
        try:
            self._driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._driver.kill()
            self._driver.wait()
        shutil.rmtree(self._files, ignore_errors=True)


def start_forked_cli() -> ForkedCli:
    """Start a driver; :meth:`ForkedCli.close` ends it."""
    driver = subprocess.Popen(
        [sys.executable, str(HERE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    return ForkedCli(driver, Path(tempfile.mkdtemp(prefix="forked-cli-")))


@contextmanager
def forked_cli() -> Iterator[ForkedCli]:
    """A driver for the length of the block."""
    cli = start_forked_cli()
    try:
        yield cli
    finally:
        cli.close()


_shared: ForkedCli | None = None
_shared_lock = threading.Lock()


def shared_forked_cli() -> ForkedCli:
    """This test process's one driver, started on first use and ended at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = start_forked_cli()
            atexit.register(_shared.close)
        return _shared


if __name__ == "__main__":
    _serve()
