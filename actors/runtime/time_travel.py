"""Fork and rewind a session (R-FORK-1, R-FORK-2): the runtime's part.

**Fork** (:func:`fork`, ``Host.fork_session``): the store copies the source's trace up to
the fork point into the new session (:meth:`~greenroom.actors.runtime.trace_store.TraceLog.
fork`: the file store copies bytes, no record decoded), then its ``session.json`` is written
— last, so a fork whose copy failed is no session — with ``forked_from: {session_id, seq}``;
its images are shared (hard links: an attachment is named by its hash and never changes).
The new session is then loaded like any stored one; a task the fork point leaves open is
settled as an interrupt settles it (:func:`~greenroom.protocols.time_travel.settlement`),
in the fork's own trace. The source is only read. The fork keeps the source's workspace
(or takes one of its own): workspace files are never copied.

**Rewind** (:func:`rewind_to`, ``Session.rewind``): an idle session's current trace is read
back (all of its trace when the point lies in an earlier context), the point is checked
(:func:`~greenroom.protocols.time_travel.rewind_problem`), the model context and task state
are folded again from what the rewind keeps
(:func:`~greenroom.protocols.history.context_at`), and the ``rewind`` record (with the
settlement of a task the point leaves open) is written and published like any output:
subscribers see it. A rewind into an earlier context (before a compaction) starts the next
trace file, as a compaction does, so that a trace file stays one context. Workspace files
are not rewound.

Records written here are written as a task's are (R-TRACE-3): numbered, appended, fed to
the transcript and the task machine, published once written, then made durable.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from greenroom.actors.runtime.errors import (
    Busy,
    SeqRefused,
    SessionExists,
    SessionNotFound,
)
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.port_builder import checked_settings
from greenroom.actors.runtime.shared_tables import fixed_workspace
from greenroom.actors.runtime.storage import ATTACHMENTS_DIR, PRIVATE_DIR_MODE, SessionStore
from greenroom.actors.runtime.trace_store import (
    StoredSessionMissing,
    StoredSessionUnreadable,
    TraceLog,
    TraceStore,
)
from greenroom.protocols.converter import converter, describe_error
from greenroom.protocols.history import context_at
from greenroom.protocols.jsonrpc import settings_problem
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Output, Rewind
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.task import Phase, fold
from greenroom.protocols.time_travel import failed_output, rewind_problem, settlement
from greenroom.protocols.tools import Tool
from greenroom.protocols.transcript import rebuild

if TYPE_CHECKING:
    from greenroom.actors.runtime.port_builder import PortBuilder
    from greenroom.actors.tools.mcp import LiveToolTable
    from greenroom.actors.tools.mcp_commands import McpView

__all__ = ["fork", "record", "rewind_to", "settle_fork"]

ACK_WAIT_S = 30.0
"""How long a rewind waits for a store that acknowledges late (the cluster's) to have its
records, past a cancellation, before it publishes them."""

_AFTER_AN_ATTEMPT = (Phase.TOOLS, Phase.RETRY, Phase.FAILED)
"""Where a task stands after an attempt's ``request_end``, before the next one begins."""

_NOT_INHERITED = ("parent_id", "root_id", "origin", "name", "background", "forked_from")
"""What a fork does not take from its source's ``session.json``: a fork is a root session
of its own, whatever its source was."""


async def fork(
    builder: PortBuilder,
    store: TraceStore,
    source_id: str,
    at_seq: int | None,
    session_id: str,
    default_tools: Iterable[Tool],
    *,
    tools: Iterable[Tool] | None = None,
    provider: str | ModelProvider | None = None,
    mcp_servers: Mapping[str, Any] | None = None,
    principal: str | None = None,
    workspace_dir: str | Path | None = None,
    wrap_tools: Callable[[Tool], Tool] | None = None,
    **overrides: Any,
) -> SessionPort:
    """Fork ``source_id`` at ``at_seq`` (None: its last record) into the new session
    ``session_id`` and return its port, loaded; :func:`settle_fork` then closes a task
    the fork point leaves open, once the host shows the session to its observers (see the
    module docstring).

    ``tools`` (default: ``default_tools``), ``provider`` and ``mcp_servers`` are the new
    session's, as for ``Host.load_session``; ``overrides`` change its settings (any
    :class:`SessionSettings` field, ``model`` say) and are stored with it; a provider name
    is stored too. ``principal`` is whom it belongs to (default: the source's);
    ``workspace_dir`` fixes a workspace of its own (default: the source's).
    ``wrap_tools`` gives each of its tools — its own, its MCP servers', and those a server
    lists later (R-MCP-4) — as the new session runs it: a replay decides every call so
    (R-FORK-3). It holds while this port is open; the session loaded again runs its tools
    as they are.

    Raises :class:`SessionNotFound` (no such source, or one that cannot be read),
    :class:`SeqRefused` (``at_seq`` out of range) and :class:`ConfigurationError` (bad
    overrides, a workspace that cannot be one); nothing is left of the fork then."""
    meta = await _source_meta(store, source_id)
    settings = _forked_settings(meta, provider, overrides)
    data_dir = builder.data_dir
    identity = None
    if workspace_dir is not None:
        identity = await trio.to_thread.run_sync(fixed_workspace, workspace_dir, data_dir)
    if await store.catalog.exists(session_id):
        # Before anything is copied: the failure path below removes the new session.
        raise SessionExists(f"a session {session_id!r} is stored already")
    try:
        seq = await store.log.fork(source_id, session_id, at_seq)
    except StoredSessionMissing as exc:
        raise SessionNotFound(str(exc)) from None
    try:
        new_meta = {k: v for k, v in meta.items() if k not in _NOT_INHERITED}
        new_meta.update(
            session_id=session_id,
            created_at=time.time(),
            settings=converter.unstructure(settings),
            forked_from={"session_id": source_id, "seq": seq},
        )
        if principal is not None:
            new_meta["principal"] = principal
        if identity is not None:
            new_meta["workspace_dir"] = str(identity.path)
            new_meta["workspace_identity"] = {
                "device": identity.device,
                "inode": identity.inode,
                "boot": identity.boot,
            }
        paths = SessionStore(data_dir)
        await trio.to_thread.run_sync(
            _share_attachments, paths.session_dir(source_id), paths.session_dir(session_id)
        )
        await store.catalog.create(session_id, new_meta)
        port = await builder.stored(
            session_id,
            tools=default_tools if tools is None else tools,
            provider=provider if not isinstance(provider, str) else None,
            mcp_servers=mcp_servers,
            overrides={},
            principal=principal,
        )
        if wrap_tools is not None:
            _run_tools_through(port, wrap_tools)
        return port
    except BaseException:
        with trio.CancelScope(shield=True), contextlib.suppress(Exception):
            store.log.release(session_id)
            await store.catalog.delete(session_id)
        raise


async def settle_fork(port: SessionPort) -> None:
    """Close the task the fork point of ``port``'s new session leaves open, if any, as an
    interrupt closes it (R-ABORT), then make its trace durable — the copy too, where the
    store is durable (a cluster: once the host's observers have it replicated)."""
    source, seq = port.forked_from or ("?", 0)
    why = f"forked from session {source} at seq {seq}"
    blocks = port.transcript.attempt_blocks
    log = port.host.trace_log
    task = port.machine.record
    failed = None
    if task.run_id is not None and not task.request_ok and task.phase in _AFTER_AN_ATTEMPT:
        # The attempt may have failed: what it wrote is in the trace, not in the context.
        failed = failed_output(await _context_records(log, port.id))
    settled = settlement(task, blocks, session_id=port.id, reason=why,
                         most=log.largest_input(), failed=failed)  # fmt: skip
    await record(port, settled)
    await port.sync_trace()


async def rewind_to(port: SessionPort, to_seq: int, reason: str | None = None) -> Rewind:
    """Rewind the idle session of ``port`` to ``to_seq`` (see the module docstring) and
    return the ``rewind`` record. The caller has checked that no task runs. Raises
    :class:`SeqRefused` when the history cannot be cut there (the message says why and
    what to do instead)."""
    log = port.host.trace_log
    loaded = await log.read_latest(port.id)
    records = list(loaded.records)
    start = (records[0].seq or 0) if loaded.number > 1 and records else 0
    crossing = to_seq < start  # into an earlier context: the rewind starts the next file
    if crossing or (records and isinstance(records[0], Rewind)):
        records = await log.read_after(port.id)  # the context begins in an earlier file
    if port.busy:
        # A task started while the trace was read: its supervisor owns the session's
        # state now, and it is not rewound under it. From here to the append nothing
        # waits, so no task starts before the rewound state is in place.
        raise Busy(f"session {port.id} started a task; rewind it once the task has ended")
    problem = rewind_problem(records, to_seq, last_seq=port.last_seq)
    if problem is not None:
        raise SeqRefused(f"cannot rewind session {port.id}: {problem}")
    kept = context_at(records, to_seq)
    transcript = rebuild(kept, supports_vision=port.settings.supports_vision, recover=False)
    machine = fold(kept)
    note = Rewind(session_id=port.id, run_id=port.new_run_id(), to_seq=to_seq, reason=reason)
    settled = settlement(
        machine.record,
        transcript.attempt_blocks,
        session_id=port.id,
        reason=f"rewound to seq {to_seq}",
        most=log.largest_input(),
        failed=failed_output(kept),
    )
    port.transcript = transcript
    port.machine = machine
    if crossing:
        port.rotate_trace()
    traced = await record(port, [note, *settled])
    first = traced[0]
    assert isinstance(first, Rewind)
    return first


async def record(port: SessionPort, outputs: list[Output]) -> list[Output]:
    """Write ``outputs`` for ``port``'s idle session as its task would (R-TRACE-3): each
    numbered, appended and fed to its transcript and task machine; then the batch is
    published once written, and made durable. Returns them as traced."""
    if not outputs:
        return []
    traced: list[Output] = []
    ticket = 0
    for output in outputs:
        output = attrs.evolve(output, seq=port.next_seq())
        ticket = port.append(output)
        port.transcript.apply(output)
        port.machine.observe(output)
        traced.append(output)
    if not port.commit():
        # A store that acknowledges late (the cluster's): publish once it has them.
        # Room for the one answer: when_batch_done never waits.
        send, written = trio.open_memory_channel[TraceWritten](1)
        port.when_batch_done(ticket, send)
        # Shielded: the records are applied already, so a caller that went away must not
        # leave them unpublished (subscribers would miss them and see seqs jump); bounded,
        # as the store may never answer.
        with trio.CancelScope(shield=True), trio.move_on_after(ACK_WAIT_S):
            await written.receive()
    port.publish(traced)
    await port.sync_trace()
    return traced


def _run_tools_through(port: SessionPort, wrap: Callable[[Tool], Tool]) -> None:
    """Give ``port``'s session its own tools as ``wrap`` gives them (a client's are run by
    the client, never here). With MCP servers its table is their binding's, which puts a
    changed list in it at a turn boundary (R-MCP-4): a table that wraps what it is given
    keeps later tools wrapped too."""
    own = port.own_tool_names()
    tools = {name: tool for name, tool in port.tool_by_name.items() if name in own}
    schemas = tuple(schema for schema in port.tool_schemas if schema.name in own)
    if port.mcp is None:
        port.set_tool_table({name: wrap(tool) for name, tool in tools.items()}, schemas)
        return
    table = _wrapping_table(port.mcp, wrap)
    table.replace(tools)
    port.set_tool_table(table, schemas)


def _wrapping_table(view: McpView, wrap: Callable[[Tool], Tool]) -> LiveToolTable:
    """A new table for the MCP binding ``view`` that holds each tool as ``wrap`` gives it;
    the binding keeps it from now on."""
    # Imported here: only a session that has MCP servers loads the MCP SDK.
    from greenroom.actors.tools.mcp import LiveToolTable, McpBinding

    class WrappingTable(LiveToolTable):
        """A tool table whose tools are wrapped as they are put in it."""

        def replace(self, tools: Mapping[str, Tool]) -> None:
            """Make the table hold ``tools``, each as ``wrap`` gives it."""
            super().replace({name: wrap(tool) for name, tool in tools.items()})

    assert isinstance(view, McpBinding)  # what attaching MCP servers gives a session
    table = view.table = WrappingTable()
    return table


async def _context_records(log: TraceLog, session_id: str) -> list[Output]:
    """The records of the session's model context, as loading it reads them."""
    records = list((await log.read_latest(session_id)).records)
    if records and isinstance(records[0], Rewind):
        # A rewind into an earlier context started this trace: its context begins there.
        records = context_at(await log.read_after(session_id))
    return records


async def _source_meta(store: TraceStore, source_id: str) -> dict[str, Any]:
    try:
        return await store.catalog.read_meta(source_id)
    except StoredSessionMissing as exc:
        raise SessionNotFound(str(exc)) from None
    except StoredSessionUnreadable as exc:
        raise SessionNotFound(f"session {source_id!r} is unreadable: {exc}") from None


def _forked_settings(
    meta: Mapping[str, Any], provider: str | ModelProvider | None, overrides: Mapping[str, Any]
) -> SessionSettings:
    """The fork's settings: the source's with ``overrides`` (and a provider name)."""
    raw = meta.get("settings", {})
    try:
        settings = converter.structure(raw, SessionSettings)
        problem = settings_problem(raw)  # the bounds a client's settings meet
    except Exception as exc:  # cattrs: a field of the wrong type or value
        problem = describe_error(exc, path="$.settings")
    if problem is not None:
        name = meta.get("session_id")
        raise SessionNotFound(f"session {name!r} has bad settings: {problem}")
    changes = dict(overrides)
    if isinstance(provider, str):
        changes["provider"] = provider
    return checked_settings(settings, changes)


def _share_attachments(source: Path, target: Path) -> None:
    """Give ``target`` the images ``source`` holds (R-SEC-8): hard links where the file
    system allows, copies elsewhere. Blocking."""
    try:
        entries = [e for e in (source / ATTACHMENTS_DIR).iterdir() if e.is_file()]
    except OSError:
        return  # no images
    directory = target / ATTACHMENTS_DIR
    directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    for entry in entries:
        if entry.is_symlink():
            continue
        destination = directory / entry.name
        try:
            os.link(entry, destination)
        except FileExistsError:
            continue
        except OSError:
            shutil.copyfile(entry, destination)
            os.chmod(destination, 0o600)

