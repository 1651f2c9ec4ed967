"""``run_serve`` started in a test as ``greenroom serve`` runs it, its console included.

A scripted model, the data in ``tmp_path / "data"``, the workspace ``tmp_path / "ws"``,
the gateway on a free port of 127.0.0.1; the console's URL, which ``serve`` writes to
stderr, says the two ports and the token.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.gateway import SessionDefaults, run_serve

__all__ = ["CONSOLE_URL", "serve_console", "start_serve"]

CONSOLE_URL = re.compile(
    r"console: http://127\.0\.0\.1:(\d+)/\?ws=ws://127\.0\.0\.1:(\d+)/v1#token=(\S+)"
)
"""The console's URL on stderr: the console's port, the gateway's port, the token."""


async def start_serve(
    tmp_path: Path, nursery: trio.Nursery, *, console_port: int = 0, **options: Any
) -> None:
    """Start ``run_serve`` in ``nursery`` (its console on ``console_port``, ``options``
    passed on); return once the gateway serves."""
    ready = trio.Event()
    nursery.start_soon(
        lambda: run_serve(
            host="127.0.0.1",
            port=0,
            data_dir=tmp_path / "data",
            defaults=SessionDefaults(provider="scripted", workspace_dir=tmp_path / "ws"),
            ready=lambda port: ready.set(),
            console_port=console_port,
            **options,
        )
    )
    await ready.wait()


async def serve_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], nursery: trio.Nursery, **options: Any
) -> tuple[int, int, str]:
    """``run_serve`` with its console on a free port (``options`` passed on): the
    gateway's port, the console's port and the token the console URL carries."""
    await start_serve(tmp_path, nursery, **options)
    err = capsys.readouterr().err
    found = CONSOLE_URL.search(err)
    assert found, err
    return int(found.group(2)), int(found.group(1)), found.group(3)
