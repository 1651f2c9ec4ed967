"""How a host makes the runtime seam of a session it creates or loads
(:class:`~greenroom.actors.runtime.port.SessionPort`): its provider client, its fixed
workspace (R-SEC-7), its shared tool table, its ``session.json`` (new) or rebuilt
transcript and task state (stored), its MCP servers, its account (the price of its
model, its principal and its cost budgets: :mod:`~greenroom.actors.runtime.accounting`)
and its place at its provider endpoint's admission (R-SHARE-1). It owns what sessions
share for this: the provider clients and their admission points, the shared tables, the
MCP connections and the accounting."""

from __future__ import annotations

import contextlib
import enum
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from greenroom.actors.runtime.accounting import Accounting, stored_origin
from greenroom.actors.runtime.admission import ProviderAdmissions
from greenroom.actors.runtime.client_tools_file import give_kept_client_tools
from greenroom.actors.runtime.errors import ConfigurationError, SessionNotFound
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.mcp_servers import McpServers
from greenroom.actors.runtime.port import Approval, SessionPort
from greenroom.actors.runtime.provider_clients import ProviderClients
from greenroom.actors.runtime.shared_tables import SharedTables, fixed_workspace
from greenroom.actors.runtime.storage import SESSION_FILE, SessionStore
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT
from greenroom.actors.runtime.trace_store import (
    StoredSessionMissing,
    StoredSessionUnreadable,
    TraceStore,
)
from greenroom.actors.runtime.tree import forward_up_while_open
from greenroom.actors.tools.mcp_config import McpConfigError, as_configs
from greenroom.actors.tools.workspace import WorkspaceError, current_boot, open_unlinked
from greenroom.protocols.converter import converter, describe_error
from greenroom.protocols.history import context_at
from greenroom.protocols.hooks import Hooks
from greenroom.protocols.jsonrpc import settings_problem
from greenroom.protocols.outputs import Rewind
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.task import fold
from greenroom.protocols.tools import Tool, WorkspaceIdentity
from greenroom.protocols.transcript import Transcript, rebuild

if TYPE_CHECKING:
    from greenroom.actors.runtime.host import Host

__all__ = [
    "HOST_APPROVE",
    "HostApproval",
    "LoadApproval",
    "LoadDefaults",
    "PortBuilder",
    "load_defaults",
]


class HostApproval(enum.Enum):
    """A load's ``approve`` left to its host (``Host.load_session``, ``Host.resume``)."""

    DEFAULT = "the host's approve"
    """The ``approve`` the host was opened with (``Host.open(approve=…)``)."""


HOST_APPROVE: Final = HostApproval.DEFAULT
"""A load's ``approve`` when it names none: the host's."""

LoadApproval = Approval | HostApproval
"""A load's ``approve``: its own, or :data:`HOST_APPROVE`."""


@attrs.frozen
class LoadDefaults:
    """What a session a host loads gets when its load names none (``Host.open(tools=…,
    mcp_servers=…, approve=…)``): the sessions the host loads on its own (resumed tasks, a
    closed parent taking its subagent's answer, a cluster's takeover) get them (R-MCP-4,
    R-HITL-4); a load that names its own keeps its own."""

    tools: tuple[Tool, ...] = ()
    mcp_servers: Mapping[str, Any] = attrs.field(factory=dict)
    """Checked already (:func:`load_defaults`)."""
    approve: Approval = PEOPLE
    """How the task a loaded session leaves open, once taken up, decides its calls (and
    the follow-ups its trace queued under a callback, and those its background children's
    answers start): ``serve --approve`` says it for the host's own loads (R-HITL-4)."""


def load_defaults(
    tools: Iterable[Tool], mcp_servers: Mapping[str, Any] | None, approve: Approval = PEOPLE
) -> LoadDefaults:
    """``Host.open``'s defaults for the sessions it loads; a bad MCP server entry raises
    :class:`ConfigurationError` before the host opens."""
    _mcp_configs(mcp_servers)
    return LoadDefaults(tuple(tools), dict(mcp_servers or {}), approve)


class PortBuilder:
    """Makes the ports of one host's sessions; see the module docstring."""

    __slots__ = (
        "_data_dir",
        "_host",
        "_shared",
        "_store",
        "accounting",
        "admissions",
        "clients",
        "defaults",
        "mcp",
    )

    def __init__(
        self,
        host: Host,
        data_dir: Path,
        store: TraceStore,
        start_soon: Callable[..., Any],
        accounting: Accounting | None = None,
        admissions: ProviderAdmissions | None = None,
        defaults: LoadDefaults | None = None,
    ) -> None:
        self._host = host
        self.defaults = defaults or LoadDefaults()
        """The tools, MCP servers and approve of a loaded session whose load names none."""
        self._data_dir = data_dir
        self._store = store
        self.clients = ProviderClients()
        """The host's provider clients, one per provider and endpoint."""
        self.admissions = admissions or ProviderAdmissions()
        """The admission point of each provider client, under the host's limits (and
        shared with other hosts when the host's are, R-SHARE-1)."""
        self._shared = SharedTables()
        self.mcp = McpServers(data_dir / "mcp", start_soon)
        """The MCP server connections of the host's sessions."""
        self.accounting = accounting or Accounting(store.ledger, catalog=store.catalog)
        """The host's prices and the principals' budgets (R-SHARE-3, R-SHARE-4)."""

    def approval(self, approve: LoadApproval) -> Approval:
        """``approve``, or the host's (:attr:`defaults`) when it is left to the host."""
        return self.defaults.approve if isinstance(approve, HostApproval) else approve

    @property
    def data_dir(self) -> Path:
        """The host's data dir (where the sessions' directories are)."""
        return self._data_dir

    async def new(
        self,
        session_id: str,
        *,
        parent: SessionPort | None,
        parent_id: str | None,
        settings: SessionSettings,
        provider: ModelProvider | None,
        tools: list[Tool],
        workspace_dir: str | Path | WorkspaceIdentity,
        name: str | None,
        hooks: Hooks | None,
        mcp_servers: Mapping[str, Any] | None,
        background: bool = False,
        principal: str | None = None,
    ) -> SessionPort:
        """A new session's port, its ``session.json`` written and its trace started (see
        :meth:`Host.create_session <greenroom.actors.runtime.host.Host.create_session>`
        for what each argument means and what raises). A subagent is charged to its
        parent's principal, and its requests are admitted for it."""
        mcp_configs = _mcp_configs(mcp_servers)
        model_provider = provider or await self.clients.get(settings)
        account = await self.accounting.account(
            session_id,
            settings,
            principal=principal,
            parent=None if parent is None else (parent.settings, parent.account),
        )
        identity = self._shared.identity(
            await trio.to_thread.run_sync(fixed_workspace, workspace_dir, self._data_dir)
        )
        origin = None if parent_id is None else _child_origin(parent, parent_id, session_id)
        meta = _new_meta(session_id, identity, settings, tools, origin, name)
        if background:
            meta["background"] = True
        if account.principal is not None:
            meta["principal"] = account.principal
        await self._store.catalog.create(session_id, meta)
        self._store.log.start(session_id)
        port = SessionPort(
            host=self._host,
            session_id=session_id,
            directory=SessionStore(self._data_dir).session_dir(session_id),
            settings=settings,
            workspace_dir=identity.path,
            tools=self._shared.tool_table(tools),
            provider=model_provider,
            transcript=Transcript(supports_vision=settings.supports_vision),
            parent_id=parent_id,
            workspace_identity=identity,
            origin=origin,
            account=account,
            admission=self.admissions.of(model_provider),
            principal=account.principal or "",
        )
        if background:
            port.report_as = name or session_id
        if hooks is not None:
            port.hooks = hooks
        if mcp_configs:
            with self._forgotten_unless_opened(session_id):
                await self.mcp.attach(port, mcp_configs)
        return port

    async def child(
        self,
        session_id: str,
        parent: SessionPort,
        settings: SessionSettings,
        tools: list[Tool],
        name: str | None,
        background: bool,
    ) -> SessionPort:
        """A subagent's new port under ``parent`` (R-HOST-4, R-TREE-1): the parent's
        provider, workspace, editor and tool hooks (a subagent's calls meet the same policy as
        its parent's: R-HOOK-2); ``background`` is recorded in its ``session.json``."""
        tool_hooks = parent.hooks.tool_hooks
        has_any = tool_hooks.before_tool is not None or tool_hooks.after_tool is not None
        inherited = tool_hooks if has_any else None
        port = await self.new(
            session_id,
            parent=parent,
            parent_id=parent.id,
            settings=settings,
            provider=parent.provider,
            tools=tools,
            # The parent's workspace as fixed (R-SEC-7), never what its path names now.
            workspace_dir=parent.workspace_identity or parent.workspace_dir,
            name=name,
            hooks=inherited,
            mcp_servers=None,
            background=background,
        )
        # The same files as its parent: the editor's buffers when an editor drives it.
        port.editor = parent.editor
        return port

    async def stored(
        self,
        session_id: str,
        *,
        tools: Iterable[Tool] | None,
        provider: str | ModelProvider | None,
        mcp_servers: Mapping[str, Any] | None,
        overrides: dict[str, Any],
        principal: str | None = None,
        approve: LoadApproval = HOST_APPROVE,
    ) -> SessionPort:
        """A stored session's port: settings from its ``session.json`` (``overrides``
        applied), transcript and task state folded from its latest trace file, ``approve``
        for the calls of the task it leaves open unless a host takes that up otherwise
        (see :meth:`Host.load_session <greenroom.actors.runtime.host.Host.load_session>`).
        ``tools`` and ``mcp_servers`` None, ``approve`` left to the host: the host's
        :attr:`defaults`."""
        approve = self.approval(approve)
        if tools is None:
            tools = self.defaults.tools
        servers = self.defaults.mcp_servers if mcp_servers is None else mcp_servers
        mcp_configs = _mcp_configs(servers)
        directory = SessionStore(self._data_dir).session_dir(session_id)
        meta, settings = await _stored_settings(self._store, session_id, directory)
        if isinstance(provider, str):
            overrides["provider"] = provider
        if overrides:
            settings = checked_settings(settings, overrides)
        model_provider = provider if not isinstance(provider, str | None) else None
        if model_provider is None:
            model_provider = await self.clients.get(settings)
        origin = stored_origin(meta, session_id)
        if origin is not None and len(origin) - 1 >= settings.max_subagent_depth:
            # Whoever loads it gives it their tools: the last level is offered no spawn,
            # loaded again as when it was spawned (R-TREE-1).
            tools = [t for t in tools if t.name != SPAWN_SUBAGENT]
        stored_principal = meta.get("principal")
        account = await self.accounting.account(
            session_id,
            settings,
            principal=stored_principal if isinstance(stored_principal, str) else principal,
            stored=True,
            origin=origin,
        )
        loaded = await self._store.log.load(session_id)
        with self._forgotten_unless_opened(session_id):
            records = list(loaded.records)
            if records and isinstance(records[0], Rewind):
                # A rewind into an earlier context started this trace: its context begins
                # there (R-FORK-2).
                records = context_at(await self._store.log.read_after(session_id))
            stored_at = await trio.to_thread.run_sync(_stored_workspace, meta)
            identity = self._shared.identity(stored_at)
            port = SessionPort(
                host=self._host,
                session_id=session_id,
                directory=directory,
                settings=settings,
                workspace_dir=identity.path,
                tools=self._shared.tool_table(list(tools)),
                provider=model_provider,
                transcript=rebuild(
                    records, supports_vision=settings.supports_vision, recover=False
                ),
                machine=fold(records),
                last_seq=loaded.last_seq,
                parent_id=meta.get("parent_id"),
                workspace_identity=identity,
                origin=origin,
                account=account,
                admission=self.admissions.of(model_provider),
                principal=account.principal or "",
            )
            port.load_errors = list(loaded.errors)
            # Its callback, if it ran under one, went with the host or the close (R-HITL-4).
            port.lost_approve = approve
            port.forked_from = _forked_from(meta)
            if meta.get("background") is True and port.parent_id is not None:
                name = meta.get("name")
                port.report_as = name if isinstance(name, str) and name else session_id
            if port.parent_id is not None:
                # Its outputs reach its parent as they did before the restart: the root's
                # watchers, and each ancestor's token budget (R-TREE-1, R-TREE-3).
                port.subscribe(forward_up_while_open(port, self._open_port))
            if mcp_configs:
                await self.mcp.attach(port, mcp_configs)
            # Whatever loads it, it offers its kept client tools again (R-PROTO-2).
            await give_kept_client_tools(port)
            return port

    def _open_port(self, session_id: str) -> SessionPort | None:
        try:
            return self._host.port(session_id)
        except SessionNotFound:
            return None

    @contextlib.contextmanager
    def _forgotten_unless_opened(self, session_id: str) -> Iterator[None]:
        """Past the trace's start or load: when the port is not made (its creation was
        cancelled, a client that went away), the trace log forgets the session."""
        try:
            yield
        except BaseException:
            self._store.log.release(session_id)
            raise

    async def release(self, session_id: str) -> None:
        """``session_id`` closed: the trace log forgets it and its private MCP connections
        close."""
        self._store.log.release(session_id)
        await self.mcp.release(session_id)

    async def aclose(self) -> None:
        """Close the provider clients and the MCP connections (the host is closing)."""
        await self.clients.aclose()
        await self.mcp.aclose()


def _mcp_configs(mcp_servers: Mapping[str, Any] | None) -> dict[str, Any]:
    try:
        return as_configs(mcp_servers) if mcp_servers else {}
    except McpConfigError as exc:
        raise ConfigurationError(str(exc)) from None


_UNKNOWN_DIRECTORY = 0
"""The device and inode numbers of a workspace that could not be identified when its
session was loaded: no directory has inode 0, so every use of it is refused."""


def _stored_workspace(meta: Mapping[str, Any]) -> WorkspaceIdentity:
    """A loaded session's workspace identity: the stored one when it was taken in this
    boot, else the directory at the stored path now (an old ``session.json``, or device
    numbers that a reboot may have changed). A path that is now a symlink or no
    directory gives an identity no directory has. Blocking."""
    path = Path(meta.get("workspace_dir", "."))
    stored = meta.get("workspace_identity")
    boot = current_boot()
    if isinstance(stored, dict):
        device, inode = stored.get("device"), stored.get("inode")
        if isinstance(device, int) and isinstance(inode, int) and stored.get("boot") == boot:
            return WorkspaceIdentity(path=path, device=device, inode=inode, boot=boot)
    try:
        # The stored path was resolved when the session was created: a symlink on it now
        # (the last component or any other) stands in the workspace's place.
        fd = open_unlinked(Path(os.path.abspath(path)))
        try:
            info: os.stat_result | None = os.fstat(fd)
        finally:
            os.close(fd)
    except (OSError, ValueError, WorkspaceError):
        info = None
    if info is None or not stat.S_ISDIR(info.st_mode):
        return WorkspaceIdentity(
            path=path, device=_UNKNOWN_DIRECTORY, inode=_UNKNOWN_DIRECTORY, boot=boot
        )
    return WorkspaceIdentity(path=path, device=info.st_dev, inode=info.st_ino, boot=boot)


def _new_meta(
    session_id: str,
    identity: WorkspaceIdentity,
    settings: SessionSettings,
    tools: list[Tool],
    origin: tuple[str, ...] | None,
    name: str | None,
) -> dict[str, Any]:
    """A new session's ``session.json``."""
    meta: dict[str, Any] = {
        "session_id": session_id,
        "created_at": time.time(),
        "workspace_dir": str(identity.path),
        "workspace_identity": {
            "device": identity.device,
            "inode": identity.inode,
            "boot": identity.boot,
        },
        "settings": converter.unstructure(settings),
        "tools": [t.name for t in tools],
    }
    if origin is not None:
        meta["parent_id"] = origin[-2]
        meta["root_id"] = origin[0]
        meta["origin"] = list(origin)
    if name is not None:
        meta["name"] = name
    return meta


def _child_origin(parent: SessionPort | None, parent_id: str, session_id: str) -> tuple[str, ...]:
    """A new subagent's path from its root: its parent's (just the parent's id when the
    parent is not open here), then its own id."""
    return (*(parent.origin_path if parent is not None else (parent_id,)), session_id)


async def _stored_settings(
    store: TraceStore, session_id: str, directory: Path
) -> tuple[dict[str, Any], SessionSettings]:
    """A stored session's metadata and settings, each setting held to the bounds a
    client's meets (``settings_problem``: a hand edit may have passed them);
    :class:`SessionNotFound` says why not, naming the file and the setting."""
    try:
        meta = await store.catalog.read_meta(session_id)
        raw = meta.get("settings", {})
        settings = converter.structure(raw, SessionSettings)
        problem = settings_problem(raw)
        if problem is None:
            return meta, settings
    except StoredSessionMissing as exc:
        raise SessionNotFound(str(exc)) from None
    except StoredSessionUnreadable as exc:
        raise SessionNotFound(f"session {session_id!r} is unreadable: {exc}") from None
    except Exception as exc:  # cattrs: a field of the wrong type or value
        problem = describe_error(exc, path="$.settings")
    raise SessionNotFound(
        f"session {session_id!r} is unreadable: {directory / SESSION_FILE}: bad "
        f"settings: {problem}"
    )


def checked_settings(base: SessionSettings, changes: Mapping[str, Any]) -> SessionSettings:
    """``base`` with ``changes``, held to the bounds a client's settings meet
    (``settings_problem``), so that a session is never given settings it could not be
    loaded with. :class:`ConfigurationError` names an unknown setting or one out of them."""
    try:
        settings = attrs.evolve(base, **changes)
    except TypeError as exc:
        raise ConfigurationError(f"bad session settings: {exc}") from None
    problem = settings_problem(converter.unstructure(settings))
    if problem is not None:
        raise ConfigurationError(f"bad session settings: {problem}")
    return settings


def _forked_from(meta: Mapping[str, Any]) -> tuple[str, int] | None:
    """``forked_from`` of a ``session.json`` (R-FORK-1), when it is one."""
    forked = meta.get("forked_from")
    if not isinstance(forked, dict):
        return None
    source, seq = forked.get("session_id"), forked.get("seq")
    if isinstance(source, str) and isinstance(seq, int) and not isinstance(seq, bool):
        return source, seq
    return None
