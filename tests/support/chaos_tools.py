"""The chaos benchmark's tools (``tests/benchmarks/chaos.py``), loaded by ``serve --tools``.

Both make one effect: a line ``KEY TOOL CALL_ID`` appended to the ledger file named by
``GREENROOM_CHAOS_LEDGER`` (the key is the call's idempotency key, R-EFFECT-1). Each call
lasts 50-200 ms with the effect at a random point inside, so that when a host goes its
calls are in flight, some with their effect made and some without.

* ``ledger_write`` has side effects and neither a check nor ``idempotent=True``: the
  at-most-once case of R-EFFECT-3. It appends on every start, so a second start of one
  call would show in the ledger as its key written twice.
* ``checked_write`` appends the same way and declares a check (R-EFFECT-2) that looks the
  key up in the ledger: a call found there is done, one not found runs again with its key.

Several host processes append to one file: each line is one ``write`` with ``O_APPEND``,
far below a page, so lines never interleave. No fsync: the benchmark kills processes, not
the machine, and the page cache survives a process.
"""

from __future__ import annotations

import os
import random

import trio

from greenroom.protocols.tools import ToolContext, tool

LEDGER_ENV = "GREENROOM_CHAOS_LEDGER"
CALL_S = (0.050, 0.200)
"""The shortest and longest call."""


def _append(key: str, tool_name: str, call_id: str) -> None:
    fd = os.open(os.environ[LEDGER_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{key} {tool_name} {call_id}\n".encode())
    finally:
        os.close(fd)


async def _write(tool_name: str, ctx: ToolContext) -> str:
    duration = random.uniform(*CALL_S)
    before = random.uniform(0.0, duration)
    await trio.sleep(before)
    _append(ctx.idempotency_key, tool_name, ctx.call_id)
    await trio.sleep(duration - before)
    return f"written under {ctx.idempotency_key}"


@tool(side_effects=True)
async def ledger_write(entry: str, ctx: ToolContext) -> str:
    """Write an entry to the ledger.

    Args:
        entry: what to write.
    """
    return await _write("ledger_write", ctx)


async def find_in_ledger(key: str) -> str | None:
    """The ledger line of ``key``, None when the ledger has none (R-EFFECT-2)."""
    try:
        text = await trio.Path(os.environ[LEDGER_ENV]).read_text()
    except FileNotFoundError:
        return None
    lines = (line for line in text.splitlines() if line.split(" ", 1)[0] == key)
    return next((f"found: {line}" for line in lines), None)


@tool(side_effects=True, check=find_in_ledger)
async def checked_write(entry: str, ctx: ToolContext) -> str:
    """Write an entry to the ledger; a lost call is looked up by its key.

    Args:
        entry: what to write.
    """
    return await _write("checked_write", ctx)
