"""The parent of every ``run_shell`` command: it ends every process the command started
when the command ends, when it is told to stop, or when the host dies (R-SEC-11).

Run as ``python -I -S shell_launcher.py CWD_FD KEEP_FD N NAME=VALUE… COMMAND…``, with
stdin a pipe whose other end only the host holds:

* ``CWD_FD`` (or ``-``): an inherited descriptor of the workspace directory the host
  verified (R-SEC-7); the command starts there, and the descriptor is closed first.
* ``KEEP_FD`` (or ``-``): an inherited descriptor the command gets as descriptor 3 (the
  sandbox binds the verified workspace through it); closed in the launcher itself.
* ``N`` and the ``N`` ``NAME=VALUE`` arguments: the command's whole environment. It is
  passed here, not as the launcher's own environment, because Python adds ``LC_CTYPE``
  to that one at start-up.

On Linux the launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process the
command leaves behind — ``cmd &``, ``nohup``, ``setsid``, a double fork — is reparented
to it, not to init, when its own parent ends. The command runs in a process group of its
own. When the command ends, when the launcher gets SIGTERM, SIGINT or SIGHUP, or when its
stdin reaches end of file (the host closed it, or died: the kernel closes a dead
process's descriptors), the launcher kills the command's process group, then each of its
own children, again and again as orphans are reparented to it, until it has none left;
then it exits with the command's status (a command killed by a signal makes the launcher
end by the same signal). Elsewhere (no subreaper) a process that leaves the command's
process group and outlives its parent escapes.

With ``--lifeline FD`` before ``CWD_FD`` (an MCP server over stdio, whose stdin and
stdout are its channel), the launcher watches ``FD`` — its end of a socket pair whose other
end only the host holds — for end of file instead of its stdin, and passes its stdin,
stdout and stderr to the command untouched. ``N`` may then be ``-``: the command gets the
launcher's own environment, with ``LC_CTYPE`` as the next argument says (``-``: none;
``=VALUE``: that value), since Python may have set it (the environment of an MCP server can
hold credentials, which are never put in the arguments every process can read). The
launcher writes ``0`` and a newline to ``FD`` once the command runs, or the ``errno`` of
its failure and exits with 127. SIGTERM, SIGINT and SIGHUP are passed to the command's
process group, not acted on: the command has its grace period, and the host ends it all by
closing its end of ``FD``.

Standard library C modules only (no ``signal``, ``ctypes``, ``subprocess`` or even
``contextlib``, each one to several milliseconds to import): the launcher starts once per
call.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stubs; see below
import os
import select
import sys

_PR_SET_CHILD_SUBREAPER = 36
_STOP_SIGNALS = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP)
# Reset in the command to what a program expects: Python ignores SIGPIPE and SIGXFSZ.
_RESET_SIGNALS = (_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGCHLD, *_STOP_SIGNALS)
_COMMAND_FD = 3


def _become_subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import _ctypes

        prctl = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")  # type: ignore[arg-type]
        _ctypes.call_function(prctl, (_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0))
    except (ImportError, AttributeError, OSError):
        # Without it, processes that leave the command's group can escape: the process
        # tests catch that.
        pass


def process_stats() -> list[tuple[int, list[bytes]]]:
    """Every process's id and the fields of its ``/proc/PID/stat`` after the command name
    (state, parent, process group, session, …); empty where there is no ``/proc``."""
    found: list[tuple[int, list[bytes]]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                data = stat.read()
        except OSError:
            continue  # gone since the listing
        # The command name (field 2) may hold spaces and parentheses: parse after its end.
        found.append((int(name), data[data.rfind(b")") + 2 :].split()))
    return found


def _children(me: int) -> list[int]:
    """The launcher's children, from ``/proc`` (empty where there is none)."""
    return [pid for pid, fields in process_stats() if len(fields) > 1 and int(fields[1]) == me]


def end_all(group: int) -> None:
    """Kill the command's process group, then every child of the launcher, until it has
    no child left (each killed child's own children are reparented to it first)."""
    try:  # noqa: SIM105 (no contextlib here: see the module docstring)
        os.killpg(group, _signal.SIGKILL)
    except OSError:
        pass  # the group is empty already
    me = os.getpid()
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        for child in _children(me):
            try:  # noqa: SIM105
                os.kill(child, _signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _ignore(signum: int, frame: object) -> None:
    """A handler, so that the signal reaches the wakeup descriptor."""


def _exit_like(status: int | None) -> None:
    if status is not None and os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    signum = os.WTERMSIG(status) if status is not None else _signal.SIGKILL
    if signum != _signal.SIGKILL:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        except (ImportError, OSError, ValueError):
            pass
        _signal.signal(signum, _signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _parse(
    argv: list[str],
) -> tuple[int | None, int | None, int | None, dict[str, str], list[str]]:
    lifeline = None
    if argv[0] == "--lifeline":
        lifeline, argv = int(argv[1]), argv[2:]
    cwd_fd = None if argv[0] == "-" else int(argv[0])
    keep_fd = None if argv[1] == "-" else int(argv[1])
    env: dict[str, str] = {}
    if argv[2] == "-":
        env.update(os.environ)
        env.pop("LC_CTYPE", None)
        if argv[3] != "-":
            env["LC_CTYPE"] = argv[3][1:]
        return lifeline, cwd_fd, keep_fd, env, argv[4:]
    count = int(argv[2])
    for item in argv[3 : 3 + count]:
        name, _, value = item.partition("=")
        env[name] = value
    return lifeline, cwd_fd, keep_fd, env, argv[3 + count :]


def main(argv: list[str]) -> None:
    """Run the command ``argv`` describes (see the module docstring) and exit like it."""
    lifeline, cwd_fd, keep_fd, env, command = _parse(argv)
    _become_subreaper()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    _signal.set_wakeup_fd(wake_write)
    for signum in (_signal.SIGCHLD, *_STOP_SIGNALS):
        _signal.signal(signum, _ignore)
    if cwd_fd is not None:
        os.fchdir(cwd_fd)
        os.close(cwd_fd)
    actions: list[tuple[int, ...] | tuple[int, int, str, int, int]] = []
    if lifeline is None:
        actions.append((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0))
        watched = 0
    else:
        os.set_inheritable(lifeline, False)
        watched = lifeline
    if keep_fd is not None and keep_fd != _COMMAND_FD:
        os.set_inheritable(keep_fd, False)
        actions.append((os.POSIX_SPAWN_DUP2, keep_fd, _COMMAND_FD))
    try:
        shell = os.posix_spawnp(
            command[0],
            command,
            env,
            file_actions=actions,
            setpgroup=0,
            setsigdef=_RESET_SIGNALS,
        )
    except OSError as exc:
        if lifeline is None:
            os.write(2, f"{command[0]}: cannot run: {exc.strerror or exc}\n".encode())
        else:
            os.write(lifeline, f"{exc.errno or 0}\n".encode())
        os._exit(127)
    if lifeline is not None:
        os.write(lifeline, b"0\n")
    if keep_fd is not None:
        os.close(keep_fd)  # the command has its copy
    poller = select.poll()
    poller.register(watched, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    status: int | None = None
    stop = False
    while status is None and not stop:
        for fd, events in poller.poll():
            if fd == wake_read:
                woken = os.read(wake_read, 256)
                signals = [signum for signum in _STOP_SIGNALS if signum in woken]
                if lifeline is None:
                    stop = stop or bool(signals)
                    continue
                for signum in signals:
                    try:  # noqa: SIM105
                        os.killpg(shell, signum)  # the command's grace period
                    except OSError:
                        pass
            elif events & select.POLLIN:
                stop = stop or not os.read(watched, 4096)  # end of file: the host is gone
            else:
                stop = True  # POLLHUP, POLLERR: the host's end is closed
        pid, waited = os.waitpid(shell, os.WNOHANG)
        if pid:
            status = waited
    end_all(shell)
    _exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
