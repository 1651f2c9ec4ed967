"""The command line's exit codes (CONTRACT.md), its usage error and its one way of
saying a problem on stderr: what every command shares, so it imports nothing of them."""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_ABORTED = 130
EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (``greenroom … | head``): 128 + SIGPIPE, as a shell
reports for a program the closed pipe stopped."""

EXIT_CODES: dict[str, int] = {
    "completed": EXIT_OK,
    "failed": EXIT_FAILED,
    "max_turns": EXIT_FAILED,
    "loop_detected": EXIT_FAILED,
    "budget_exceeded": EXIT_FAILED,
    "auth": EXIT_AUTH,
    "aborted": EXIT_ABORTED,
}
"""Process exit code for each ``task_end`` status."""


MAX_INPUT_BYTES = 16 * 1024 * 1024
"""The most a prompt on stdin, a line of input, or a file a flag names (``--prices``,
``--hooks``, ``--output-schema``, ``--mcp-config``) may hold: a path or a pipe that brings a
device, a log or an endless stream by mistake is refused once past it, never read for ever."""


class UsageError(Exception):
    """A command line that cannot run: the message is shown and the exit code is 2."""


def mib(size: int) -> str:
    """``size`` bytes in whole MiB, as limits are said."""
    return f"{size // (1024 * 1024)} MiB"


def print_error(message: str) -> None:
    """Say ``message`` on stderr at once: problems and bookkeeping never go to stdout."""
    print(message, file=sys.stderr, flush=True)
