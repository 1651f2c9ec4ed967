"""The ``greenroom`` command line.

::

    greenroom demo                      the sales-CSV task on a fresh workspace, no key needed
    greenroom run [PROMPT] [options]    one task; PROMPT or stdin
    greenroom chat [options]            an interactive terminal on one session (actors/apps/chat.py)
    greenroom acp [options]             an Agent Client Protocol agent on stdio, for editors
                                        (actors/apps/acp.py)
    greenroom serve [--host H] [--port P] the websocket JSON-RPC gateway at ws://H:P/v1 and
                                        the web console at http://H:P+1/
    greenroom sessions                  the sessions stored in the data dir
    greenroom trace SESSION_ID          a session's latest trace file, one line per record
    greenroom usage [--since WHEN] [--until WHEN] [--by session|principal|model]
                                        what the sessions cost, from the usage ledger
                                        (actors/apps/usage_command.py)
    greenroom approvals                 what waits for a person: tool calls, the model's
                                        questions (actors/apps/approvals.py)
    greenroom approve SESSION_ID CALL_ID allow|deny|allow_session
    greenroom answer SESSION_ID CALL_ID TEXT
                                        answer one, then run its task on to its end
    greenroom fork SESSION_ID [--at SEQ] a new session with the history up to a record
    greenroom rewind SESSION_ID --to SEQ continue a session from its history at a record
    greenroom replay SESSION_ID --provider P [--model M] [--json] [--run-tools]
                                        run its prompts again on another model, compare
                                        (actors/apps/time_travel_command.py)
    greenroom mcp login NAME --mcp-config FILE
                                        authorize greenroom for an HTTP MCP server that
                                        asks for OAuth (actors/apps/mcp_command.py)

Exit codes (CONTRACT.md): 0 completed, 1 failed / max_turns / loop_detected / budget_exceeded
(a limit stopped the task, as max_turns does), 2 usage error
(bad flag, unknown session, missing credentials, a data dir or token file that cannot be
used, an address that cannot be listened on), 3 auth, 130 aborted (Ctrl-C interrupts the
task, which ends with ``task_end(aborted)``; a second Ctrl-C leaves at once), 141 the reader
of stdout went away (``| head``: the task is interrupted and the command ends quietly).

Streams: with ``--json`` stdout carries exactly one JSON object per output and nothing else.
Without it, stdout carries the conversation (streamed text, tool calls, their approval and
results) and stderr the bookkeeping (session id, retries, the closing summary), so piping
stdout keeps only what the agent said and did. What tools print goes to stderr: while a
task runs, fd 1 is stderr and the renderer writes to a private duplicate of stdout.

Failures are turned into exit codes in one place (``main``): exceptions come out of trio's
nurseries wrapped in exception groups, and the boundary looks at their leaves.

This module is only the entry point: the arguments are in ``parser``, each command in
its own module (``run``, ``chat``, ``demo``, ``approvals``, ``serve_command``,
``trace_command``), what they show in ``render``, what they ask in ``asking``, the exit
codes in ``exits``. ``chat``, ``demo`` and ``approvals`` are imported only when their
command runs (``chat`` loads prompt_toolkit, which no other command needs).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import trio

from greenroom.actors.apps.exits import (
    EXIT_ABORTED,
    EXIT_BROKEN_PIPE,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    print_error,
)
from greenroom.actors.apps.parser import build_parser
from greenroom.actors.apps.run import (
    data_dir_from,
    exception_leaves,
    refuse_unsafe_flag_file,
    run_command,
)
from greenroom.actors.apps.serve_command import acp_command, cluster_demo_command, serve_command
from greenroom.actors.apps.trace_command import sessions_command, trace_command
from greenroom.actors.providers import (
    LEAN_HTTP_VARIABLE,
    lean_http_enabled,
)
from greenroom.actors.runtime import (
    ConfigurationError,
    HooksFileError,
    SessionObserver,
    install_tool_hooks,
    load_hooks_file,
)

# -- entry point ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, restore_sigint: bool = False) -> int:
    """Run the command line and return the exit code (the console script exits with it).

    ``restore_sigint``: first put Python's default SIGINT handler back, in place of the
    one ``python -m greenroom`` installs while the command line loads; from then on a
    Ctrl-C at any moment ends the command with exit code 130, never a traceback."""
    args: argparse.Namespace | None = None
    try:
        if restore_sigint:
            # Inside the try: a KeyboardInterrupt from here on is handled below.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        closed = _open_standard_streams()
        for stream in (sys.stdout, sys.stderr):
            # A terminal or pipe that cannot encode a character must not crash the run.
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(errors="backslashreplace")
        try:
            args = build_parser().parse_args(argv)
            # What the command line said, for a command that starts more of itself
            # (serve --workers hands its flags to each worker).
            args.argv = list(sys.argv[1:] if argv is None else argv)
        except SystemExit as exc:  # argparse: usage errors exit 2, --help exits 0
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        except BrokenPipeError:  # greenroom --help | head -1
            _discard_output()
            return EXIT_BROKEN_PIPE
        if STDOUT_FD in closed and args.command not in ("serve", "cluster-demo"):
            raise UsageError(
                "stdout is closed, so what the command shows would be lost "
                "(to discard it, send it to /dev/null)"
            )
        return _dispatch(args)
    except BaseException as exc:
        code = _failure_exit_code(exc, args)
        if code is None:
            raise
        return code


STDOUT_FD = 1

_STANDARD_STREAMS = (("stdin", os.O_RDONLY), ("stdout", os.O_WRONLY), ("stderr", os.O_WRONLY))
"""File descriptors 0, 1 and 2: the ``sys`` attribute of each and how it is opened."""


def _open_standard_streams() -> frozenset[int]:
    """Put /dev/null on each of file descriptors 0, 1 and 2 that the process was started
    without (``greenroom run <&-``), with a ``sys`` stream on it where Python left None;
    the descriptors that were closed. Left closed, the first file the command opens (a
    trace, the usage ledger) would take the number and receive what is printed, and a
    ``sys.stdin`` of None would end in a traceback."""
    closed: set[int] = set()
    for fd, (name, flags) in enumerate(_STANDARD_STREAMS):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
            devnull = os.open(os.devnull, flags)  # the lowest free number: fd itself
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
        if getattr(sys, name) is None:
            mode = "r" if flags == os.O_RDONLY else "w"
            stream = open(  # noqa: SIM115 -- the process's stream, for its whole life
                fd, mode, buffering=1 if name == "stderr" else -1, encoding="utf-8",
                errors="backslashreplace", closefd=False,
            )  # fmt: skip
            setattr(sys, name, stream)
    return frozenset(closed)


def _dispatch(args: argparse.Namespace) -> int:
    with _telemetry(args) as observers:
        args.observers = (*observers, *_tool_hooks(args))
        return _dispatch_command(args)


def _tool_hooks(args: argparse.Namespace) -> tuple[SessionObserver, ...]:
    """``--hooks FILE`` (R-HOOK-2) as a host observer that gives every session the command
    opens the file's tool hooks; a file that cannot be read or used is a usage error
    naming it and the place."""
    path = getattr(args, "hooks", None)
    if path is None:
        return ()
    refuse_unsafe_flag_file("--hooks", path)  # never a FIFO, a device or an endless file
    try:
        return (install_tool_hooks(load_hooks_file(path)),)
    except HooksFileError as exc:
        raise UsageError(f"--hooks: {exc}") from None


OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@contextlib.contextmanager
def _telemetry(args: argparse.Namespace) -> Iterator[tuple[SessionObserver, ...]]:
    """The host observers of ``--otel`` / ``--no-otel`` and the ``OTEL_*`` variables
    (R-OBS-1); spans are flushed when the command ends. OpenTelemetry is imported only
    when export is on."""
    wanted = getattr(args, "otel", False)
    if wanted is None:
        wanted = any(os.environ.get(name) for name in OTLP_ENDPOINT_VARIABLES)
    if not wanted:
        yield ()
        return
    try:
        from greenroom.actors.observers.otel import exporting
    except ImportError:
        if args.otel:
            raise UsageError(
                "--otel needs the OpenTelemetry extra: pip install 'greenroom[otel]'"
            ) from None
        yield ()  # the variables alone: without the extra, nothing changes
        return
    with exporting() as observer:
        yield (observer.observe,)


def _dispatch_command(args: argparse.Namespace) -> int:
    _check_data_dir_of(args)
    _choose_lean_http(args)
    if args.command == "run":
        return run_command(args)
    if args.command == "acp":
        return acp_command(args)
    if args.command == "chat":
        from greenroom.actors.apps.chat import chat_command

        return chat_command(args)
    if args.command == "demo":
        from greenroom.actors.apps.demo import run_demo

        return run_demo(args)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "cluster-demo":
        return cluster_demo_command(args)
    if args.command == "sessions":
        return trio.run(sessions_command, args)
    if args.command == "trace":
        return trio.run(trace_command, args)
    if args.command == "usage":
        from greenroom.actors.apps.usage_command import usage_command

        return usage_command(args)
    if args.command in ("fork", "rewind", "replay"):
        from greenroom.actors.apps import time_travel_command

        command = {
            "fork": time_travel_command.fork_command,
            "rewind": time_travel_command.rewind_command,
            "replay": time_travel_command.replay_command,
        }[args.command]
        return command(args)
    if args.command == "mcp":
        from greenroom.actors.apps.mcp_command import mcp_command

        return mcp_command(args)
    if args.command in ("approvals", "approve", "answer"):
        from greenroom.actors.apps import approvals

        command = {
            "approvals": approvals.approvals_command,
            "approve": approvals.approve_command,
            "answer": approvals.answer_command,
        }[args.command]
        return command(args)
    raise UsageError(f"unknown command {args.command!r}")


def _failure_exit_code(exc: BaseException, args: argparse.Namespace | None) -> int | None:
    """The one place where what escaped a command becomes an exit code and at most one
    line on stderr; None for a failure that is a bug (it is re-raised, traceback and all).
    ``args`` is None when the command line was not parsed yet.

    Exceptions leave trio's nurseries wrapped in exception groups, so the leaves are looked
    at: an interrupt wins (exit 130), then a reader that went away (exit 141, quietly),
    then the first problem of the user's command line or environment (exit 2)."""
    leaves = list(exception_leaves(exc))
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
        if args is not None and args.command == "serve":
            # Ctrl-C before the gateway listens for it: stopping is what it asks, either way.
            return EXIT_OK
        _say_last("interrupted")
        return EXIT_ABORTED
    if any(isinstance(leaf, BrokenPipeError) for leaf in leaves):
        _discard_output()
        return EXIT_BROKEN_PIPE
    if args is None:
        return None
    for leaf in leaves:
        message = _problem_message(leaf, args)
        if message is not None:
            _say_last(f"greenroom {args.command}: {message}")
            return EXIT_USAGE
    return None


def _problem_message(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The message for a failure the user can fix (their command line, their files, their
    network setup); None for anything else."""
    if isinstance(exc, UsageError | ConfigurationError):
        return str(exc)
    if not isinstance(exc, OSError):
        return None
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        if isinstance(exc, FileExistsError):  # a directory was to be made where it is
            reason = _in_the_way(Path(os.fsdecode(exc.filename))) or reason
        return f"{exc.filename}: {reason}"
    if args.command == "serve":
        # No file named: the listening socket (files always come with their name).
        if isinstance(exc, socket.gaierror):
            return f"--host: cannot listen on {args.host!r}: {reason}"
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"--host: cannot listen on {args.host}: this machine has no such address"
        if exc.errno == errno.EADDRINUSE:
            return f"cannot listen on {args.host}:{args.port}: the port is in use"
        return f"cannot listen on {args.host}:{args.port}: {reason}"
    return reason


def _in_the_way(path: Path) -> str | None:
    """Why a directory cannot be made at ``path`` when the error said only that it exists:
    it is a file, or a symbolic link to nothing (None when neither)."""
    try:
        if path.is_symlink() and not path.exists():
            return f"it is {_broken_link(path)}, not a directory"
        if path.exists() and not path.is_dir():
            return "it is not a directory"
    except OSError:
        return None
    return None


def _say_last(message: str) -> None:
    """A last line on stderr, when stderr may itself be a closed pipe."""
    try:
        print_error(message)
    except OSError:
        _discard_output()


def _discard_output() -> None:
    """Point stdout and stderr at /dev/null, so that the interpreter's last flush of
    what a closed pipe refused does not end in an error report."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _choose_lean_http(args: argparse.Namespace) -> None:
    """``--lean-http`` / ``--no-lean-http`` decide for the providers this process makes
    (through the variable the provider registry reads); without either, a malformed
    variable is refused here in one line, before anything starts."""
    chosen = getattr(args, "lean_http", None)
    if chosen is not None:
        os.environ[LEAN_HTTP_VARIABLE] = "1" if chosen else "0"
        return
    try:
        lean_http_enabled()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_data_dir_of(args: argparse.Namespace) -> None:
    """Refuse, before anything starts, a data dir the command cannot use: one line naming
    it and what is wrong, not a traceback from deep inside the host."""
    if args.command not in (
        "run", "chat", "acp", "serve", "sessions", "trace", "demo", "approvals", "approve",
        "answer", "usage", "fork", "rewind", "replay", "mcp",
    ):  # fmt: skip
        return
    if args.command == "demo" and args.data_dir is None:
        return  # a fresh temp dir
    path = data_dir_from(args.data_dir)
    problem = data_dir_problem(path, write=args.command not in ("trace", "approvals", "usage"))
    if problem is None:
        return
    if args.data_dir is None:
        problem += " (the default data dir: choose another with --data-dir or $GREENROOM_HOME)"
    else:
        problem = f"--data-dir: {problem}"
    raise UsageError(problem)


def _broken_link(path: Path) -> str:
    """What is wrong with the symbolic link ``path``, whose target cannot be reached."""
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link in a loop"
        with contextlib.suppress(OSError):
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        return f"a symbolic link that cannot be followed ({exc.strerror})"
    return "a symbolic link"  # reachable again already: a race, said plainly


def data_dir_problem(path: Path, *, write: bool) -> str | None:
    """Why ``path`` cannot serve as a data dir (it is a file, it cannot be created, it is
    not writable when ``write``), or None when it can (it may not exist yet)."""
    try:
        existing = path
        while not existing.exists() and existing != existing.parent:
            if existing.is_symlink():  # exists() is False for a link to nothing, or a loop
                where = "" if existing == path else f"cannot use {path}: "
                return f"{where}{existing} is {_broken_link(existing)}"
            existing = existing.parent
        if existing == path:
            if not path.is_dir():
                return f"{path} is not a directory"
            if write and not os.access(path, os.W_OK | os.X_OK):
                return f"{path} is not writable"
            if not os.access(path, os.R_OK | os.X_OK):
                return f"{path} is not readable"
            return None
        verb = "create" if write else "read"
        if not existing.is_dir():
            return f"cannot {verb} {path}: {existing} is not a directory"
        if write and not os.access(existing, os.W_OK | os.X_OK):
            return f"cannot create {path}: {existing} is not writable"
        return None
    except OSError as exc:  # an ancestor that cannot be searched, a symlink loop, …
        return f"cannot use {path}: {exc.strerror or exc}"


if __name__ == "__main__":
    sys.exit(main())
