"""A real ``nats-server`` with JetStream for the cluster tests.

:func:`start_nats` starts one on a free port (the server picks it and logs it) with its
store in a temporary directory, returns once the server says it is ready, and
:meth:`NatsProcess.stop` kills it. Bounded: a server that is not ready within
``READY_TIMEOUT_S`` fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import selectors
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import attrs
import pytest
import trio

from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import ClusterNames, Connection, connect
from greenroom.actors.cluster.server import (
    listening_port,
    nats_server_args,
    nats_server_binary,
    server_ready,
)

READY_TIMEOUT_S = 10.0

T = TypeVar("T")


@attrs.define
class NatsProcess:
    """A running server: its URL and its process."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: list[str]

    def stop(self) -> None:
        """Kill the server and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=READY_TIMEOUT_S)


def start_nats(store_dir: Path, *, max_payload: int | None = None) -> NatsProcess:
    """Start ``nats-server -js`` with its store in ``store_dir``; return once it is ready.
    ``max_payload``: the largest message it takes (bytes), else NATS's default (1 MiB)."""
    store_dir.mkdir(parents=True, exist_ok=True)
    config: list[str] = []
    if max_payload is not None:
        path = store_dir / "payload.conf"
        path.write_text(f"max_payload: {max_payload}\n")
        config = ["-c", str(path)]
    process = subprocess.Popen(
        [str(nats_server_binary()), *config, *nats_server_args(store_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    log: list[str] = []
    port: int | None = None
    deadline = time.monotonic() + READY_TIMEOUT_S
    selector = selectors.DefaultSelector()
    selector.register(process.stderr, selectors.EVENT_READ)
    buffered = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(timeout=left):
                raise RuntimeError(f"nats-server not ready in {READY_TIMEOUT_S} s: {log}")
            chunk = process.stderr.read1(65536)
            if not chunk:
                raise RuntimeError(f"nats-server exited ({process.wait()}): {log}")
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                log.append(line)
                port = listening_port(line) or port
                if server_ready(line) and port is not None:
                    # Keep draining the log so a chatty server never blocks on a full pipe.
                    threading.Thread(target=_drain, args=(process, log), daemon=True).start()
                    return NatsProcess(
                        url=f"nats://127.0.0.1:{port}", port=port, process=process, log=log
                    )
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        selector.close()


def _drain(process: subprocess.Popen[bytes], log: list[str]) -> None:
    assert process.stderr is not None
    for raw in process.stderr:
        log.append(raw.decode(errors="replace").rstrip("\n"))


@contextlib.contextmanager
def running_nats(store_dir: Path, *, max_payload: int | None = None) -> Iterator[NatsProcess]:
    """:func:`start_nats` for the length of a ``with`` block."""
    server = start_nats(store_dir, max_payload=max_payload)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="nats_server")
def fresh_nats_server(tmp_path: Path) -> Iterator[NatsProcess]:
    """A nats-server of the test's own (a test that kills or fences hosts). Import it into
    a test module to use it there as ``nats_server``."""
    with running_nats(tmp_path / "nats") as server:
        yield server


@pytest.fixture(name="nats_server", scope="module")
def module_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsProcess]:
    """One nats-server for the tests of a module (each uses names of its own). Import it
    into a test module to use it there as ``nats_server``."""
    with running_nats(tmp_path_factory.mktemp("nats")) as server:
        yield server


def run_connected(
    url: str,
    body: Callable[[Connection], Awaitable[T]],
    *,
    prefix: str | None = None,
    timeout_s: float = 30.0,
) -> T:
    """Run ``body(connection)`` under trio as the bridge's guest, connected to ``url`` with
    its own resource names (``prefix``, else a fresh one), bounded by ``timeout_s``."""
    names = ClusterNames(prefix=prefix or f"t{uuid.uuid4().hex[:10]}")

    async def main(bridge: Bridge) -> T:
        with trio.fail_after(timeout_s):
            conn = await connect(bridge, url, name="test", names=names)
            try:
                return await body(conn)
            finally:
                with trio.CancelScope(shield=True):
                    await conn.aclose()

    return run(main)
