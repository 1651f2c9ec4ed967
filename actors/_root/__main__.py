"""``python -m greenroom`` is the ``greenroom`` command (its console script calls :func:`main`).

Loading the command line takes a few tenths of a second (trio, the runtime, the tools). A
Ctrl-C in that time would raise ``KeyboardInterrupt`` in the middle of some import and end
in a traceback, so a handler that leaves with exit code 130 is installed
before anything is loaded; the command line puts the usual handler back once it is loaded
and handles interrupts itself from then on. This module imports nothing but ``os``,
``signal`` and ``sys`` before the handler is in place.
"""

import os
import signal
import sys

EXIT_ABORTED = 130
"""The exit code of an interrupted command (128 + SIGINT), as the command line uses it."""


def _interrupted_while_loading(signum: int, frame: object) -> None:
    # Nothing has started yet: no file, session or terminal mode to put back.
    try:
        os.write(2, b"interrupted\n")
    finally:
        os._exit(EXIT_ABORTED)


def main() -> int:
    """Run the ``greenroom`` command line and return its exit code. A Ctrl-C while it loads
    exits 130 quietly. A SIGINT that is ignored (a background job) or handled by the
    embedding program is left alone."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    from greenroom.actors.apps.cli import main as command_line

    return command_line(restore_sigint=True)


if __name__ == "__main__":
    sys.exit(main())
