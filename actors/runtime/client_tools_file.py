"""A session's kept client tools (R-PROTO-2, R-HITL-1, R-HITL-4): the tools a client runs
itself (an AG-UI front end's, ``Session.set_client_tools``) are kept in
:data:`CLIENT_TOOLS_FILE` next to the session's ``session.json`` when the client asks
(:func:`keep_client_tools`), and every load of the session gives them back
(:func:`give_kept_client_tools`, called by the port builder): the session loaded again —
by a gateway call, an answer, ``serve``'s resumed tasks after a restart, a closed parent
taking its subagent's answer — offers them to the task it takes up.

The file is the session directory's, on this host's disk only: a cluster host that takes
the session over rebuilds it from the cluster's trace and ``session.json``, without them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import trio

from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.storage import PRIVATE_FILE_MODE
from greenroom.protocols import ag_ui
from greenroom.protocols.tools import Tool, client_tool

__all__ = [
    "CLIENT_TOOLS_FILE",
    "give_client_tools",
    "give_kept_client_tools",
    "keep_client_tools",
]

logger = logging.getLogger(__name__)

CLIENT_TOOLS_FILE = "ag_ui_tools.json"
"""A session's kept client tools as a JSON list of ``name``, ``description`` and
``parameters`` (AG-UI's form of a front-end tool), next to its ``session.json``."""

_KEEPING: trio.lowlevel.RunVar[trio.Lock] = trio.lowlevel.RunVar("client_tools_keeping")
"""Held while a session's kept client tools are written (rarely: when they change)."""


async def keep_client_tools(port: SessionPort) -> None:
    """Keep the session's client tools as they are now, for the session loaded again; a
    failed write is logged, the session goes on (it has them while it stays open).
    Shielded: a caller cancelled once the session took its tools keeps them too. One
    write at a time, and only while the tools are still the session's: of two callers
    giving a session tools at once, the file keeps the later's."""
    tools = port.client_tools
    text = json.dumps(
        [
            {"name": t.name, "description": t.description, "parameters": t.input_schema}
            for t in tools
        ]
    )
    with trio.CancelScope(shield=True):
        async with _keeping_lock():
            if port.client_tools != tools:
                return
            try:
                await trio.to_thread.run_sync(
                    replace_private_file, port.directory / CLIENT_TOOLS_FILE, text
                )
            except OSError as exc:
                logger.warning("cannot keep the client tools in %s: %s", port.directory, exc)


def _keeping_lock() -> trio.Lock:
    try:
        return _KEEPING.get()
    except LookupError:
        lock = trio.Lock()
        _KEEPING.set(lock)
        return lock


def replace_private_file(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` at once, private (0600) from its creation, fsynced
    before it replaces the last (a power cut leaves the one or the other whole); a
    failed write leaves no temporary file. Blocking."""
    # A name of its own: two writers may replace the file at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    # Private from its creation, as every file of a session is (R-SEC-8).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(tmp, flags, PRIVATE_FILE_MODE), "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


async def give_kept_client_tools(port: SessionPort) -> None:
    """Give the session being loaded the client tools kept for it (none kept: nothing).
    A file that cannot be read or is not a list of tools leaves the session without
    them — nothing else of it is lost — and ``load_errors`` says why."""
    path = port.directory / CLIENT_TOOLS_FILE
    try:
        text = await trio.to_thread.run_sync(path.read_text, "utf-8")
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        _left_out(port, f"cannot read the kept client tools in {path}: {exc}")
        return
    try:
        kept = json.loads(text)
        if not isinstance(kept, list) or not all(isinstance(t, dict) for t in kept):
            raise ValueError("not a list of tools")
        given = ag_ui.client_tools(kept)
    except (ValueError, RecursionError) as exc:  # ClientToolError is a ValueError
        _left_out(port, f"the kept client tools in {path} are left out: {exc}")
        return
    give_client_tools(port, [client_tool(*tool) for tool in given])


def _left_out(port: SessionPort, problem: str) -> None:
    logger.warning("session %s: %s", port.id, problem)
    port.load_errors = [*port.load_errors, problem]


def give_client_tools(port: SessionPort, tools: Sequence[Tool]) -> tuple[Tool, ...]:
    """Give the open session ``tools`` as its client tools when it has none yet (one
    named like a tool of its own, or like an earlier one, is left out with a warning:
    a file edited by hand may name one twice); the client tools it has."""
    if port.client_tools or not tools:
        return port.client_tools
    names = set(port.own_tool_names())
    kept: list[Tool] = []
    for tool in tools:
        if tool.name not in names:
            kept.append(tool)
            names.add(tool.name)
    if len(kept) < len(tools):
        logger.warning(
            "session %s: client tools named like its own or like another left out", port.id
        )
    port.set_client_tools(tuple(kept))
    return tuple(kept)
