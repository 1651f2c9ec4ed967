"""Confinement of ``run_shell`` (R-SEC-3): an allow-listed environment, and on Linux a
bubblewrap sandbox.

The environment of a shell command is built from nothing: ``PATH``, ``LANG``, ``LC_*``,
``TERM`` and ``TZ`` are copied from the host when set; ``HOME`` is a directory in the
session's scratchpad and ``TMPDIR`` a fresh temporary directory. Nothing else of the host's
environment — API keys, tokens, credentials, agent sockets — reaches the command, in any
sandbox mode.

The sandbox (``bwrap``) gives the command a file system of its own: the workspace and the
session's scratchpad read-write at their real paths; ``/usr``, ``/bin``, ``/sbin``,
``/lib*`` and a short list of ``/etc`` files read-only; a fresh ``/tmp``, ``/proc`` and
``/dev``; nothing else (no data dir, no home directory, no other workspace). All namespaces
are unshared (network too, unless the session allows it), every capability is dropped, the
command runs in a new session (no terminal injection) and dies with the tool call.

The workspace is bound from a descriptor of the directory the tool call verified
(R-SEC-7), not from its path, and :func:`workspace_guard` checks inside the sandbox,
before the command runs, that the directory bound there is that one, then closes the
descriptor.

:func:`sandbox_status` probes once whether bubblewrap is present and works here, and caches
the answer; the probe blocks (a few milliseconds, at most :data:`PROBE_TIMEOUT_S`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

__all__ = [
    "PROBE_TIMEOUT_S",
    "SandboxStatus",
    "bwrap_command",
    "sandbox_available",
    "sandbox_status",
    "shell_environment",
    "workspace_guard",
]

PROBE_TIMEOUT_S = 10.0
"""Bound on the one-time check that bubblewrap can start a sandbox here."""

_COPIED_VARIABLES = ("PATH", "LANG", "TERM", "TZ")
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

# Read-only top-level system directories; a symlink (a merged /usr) is recreated as one.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What programs need from /etc to run, resolve names and verify TLS; no shadow, no ssh keys,
# no host configuration beyond that.
_ETC_ENTRIES = (
    "/etc/alternatives",
    "/etc/ca-certificates",
    "/etc/ca-certificates.conf",
    "/etc/group",
    "/etc/host.conf",
    "/etc/hosts",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/mime.types",
    "/etc/nsswitch.conf",
    "/etc/os-release",
    "/etc/passwd",
    "/etc/pki",
    "/etc/protocols",
    "/etc/resolv.conf",
    "/etc/services",
    "/etc/ssl",
    "/etc/timezone",
)


@attrs.frozen(kw_only=True, slots=True)
class SandboxStatus:
    """Whether ``run_shell`` can be sandboxed here; ``reason`` says why not, or what runs it."""

    available: bool
    reason: str
    bwrap: str | None = None


_lock = threading.Lock()
_status: SandboxStatus | None = None


def sandbox_status() -> SandboxStatus:
    """Probe bubblewrap once (cached for the process) and say whether it can sandbox
    ``run_shell``. Blocks during the first call; never raises."""
    global _status
    with _lock:
        if _status is None:
            _status = _probe()
        return _status


def sandbox_available() -> bool:
    """True when ``run_shell`` commands can run under bubblewrap here (see
    :func:`sandbox_status` for the reason when not)."""
    return sandbox_status().available


def _probe() -> SandboxStatus:
    if not sys.platform.startswith("linux"):
        return SandboxStatus(available=False, reason="sandboxing uses bubblewrap, Linux only")
    bwrap = shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )
    if bwrap is None:
        return SandboxStatus(available=False, reason="bubblewrap (bwrap) is not installed")
    try:
        with tempfile.TemporaryDirectory(prefix="greenroom-probe-") as place:
            root = Path(place).resolve()
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                argv = bwrap_command(
                    bwrap,
                    workspace_guard(fd, "true"),
                    workspace=root,
                    workspace_fd=fd,
                    scratchpad=root,
                    network=False,
                    hidden=(),
                )
                done = subprocess.run(
                    argv,
                    env=shell_environment(home=root, tmpdir=Path("/tmp")),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=(fd,),
                    timeout=PROBE_TIMEOUT_S,
                    check=False,
                )
            finally:
                os.close(fd)
    except (OSError, subprocess.SubprocessError) as exc:
        return SandboxStatus(available=False, reason=f"bubblewrap cannot run: {exc}")
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip().splitlines()
        why = detail[-1] if detail else f"exit code {done.returncode}"
        return SandboxStatus(available=False, reason=f"bubblewrap cannot run here: {why}")
    return SandboxStatus(available=True, reason=f"sandboxed with {bwrap}", bwrap=bwrap)


def shell_environment(
    *, home: Path, tmpdir: Path, host_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of a shell command: the allow-listed host variables, ``HOME``
    and ``TMPDIR``. ``host_env`` defaults to ``os.environ``."""
    source = os.environ if host_env is None else host_env
    env = {name: source[name] for name in _COPIED_VARIABLES if name in source}
    env.update({name: value for name, value in source.items() if name.startswith("LC_")})
    env.setdefault("PATH", _DEFAULT_PATH)
    env["HOME"] = str(home)
    env["TMPDIR"] = str(tmpdir)
    return env


def workspace_guard(fd: int, command: str) -> list[str]:
    """``bash -c command``, run only when the directory it starts in (the workspace the
    sandbox bound) is the directory open as ``fd`` (the one the tool call verified), and
    with ``fd`` closed first: an open directory of the host must never reach the command,
    since ``..`` from it leads out of the sandbox. Exit code 125 when the check fails."""
    script = (
        f"[ /proc/self/fd/{fd} -ef . ] || {{ echo 'the sandbox did not bind the verified"
        " workspace; the command was not run' >&2; exit 125; }\n"
        f"exec {fd}<&-\n"
        'exec bash -c "$1"'
    )
    return ["bash", "-c", script, "bash", command]


def bwrap_command(
    bwrap: str,
    command: Sequence[str],
    *,
    workspace: Path,
    scratchpad: Path,
    network: bool,
    hidden: Sequence[Path],
    workspace_fd: int | None = None,
) -> list[str]:
    """The ``bwrap`` command line that runs ``command`` confined (see the module docstring).

    ``workspace`` and ``scratchpad`` must be resolved paths; they are mounted read-write at
    the same paths, and the command starts in ``workspace``. With ``workspace_fd`` (a
    descriptor bwrap inherits) the directory mounted at ``workspace`` is the one that
    descriptor holds, whatever stands at that path by then; the command should then be a
    :func:`workspace_guard`. Each directory of ``hidden``
    that lies inside the workspace (the data dir, say) is covered by an empty tmpfs; the
    scratchpad is mounted after, so it stays visible even inside a hidden directory.
    Looks at the file system (which system directories are symlinks).
    """
    argv = [bwrap, "--unshare-all", "--unshare-user"]
    if network:
        argv.append("--share-net")
    argv += ["--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    for directory in _SYSTEM_DIRS:
        if os.path.islink(directory):
            argv += ["--symlink", os.readlink(directory), directory]
        elif os.path.isdir(directory):
            argv += ["--ro-bind", directory, directory]
    for entry in _ETC_ENTRIES:
        argv += ["--ro-bind-try", entry, entry]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    source = str(workspace) if workspace_fd is None else f"/proc/self/fd/{workspace_fd}"
    argv += ["--bind", source, str(workspace)]
    for private in hidden:
        # Only an existing directory: a mount point would be created in the workspace.
        if private.is_relative_to(workspace) and private != workspace and private.is_dir():
            argv += ["--tmpfs", str(private)]
    if scratchpad != workspace:
        argv += ["--bind", str(scratchpad), str(scratchpad)]
    argv += ["--chdir", str(workspace), "--", *command]
    return argv
