"""The host: the root of the actor tree.

A :class:`Host` owns the root nursery, the trace store (its session catalog, trace log and
usage ledger: :mod:`~greenroom.actors.runtime.trace_store`) and the provider clients, and
creates, loads, lists and closes sessions (R-HOST-1). With the default file store, sessions
live in ``<data_dir>/sessions/<session_id>/``: ``session.json`` (settings, workspace and its
identity, and ``parent_id`` for a subagent), ``trace_001.jsonl``… and ``scratch/``. A
session's workspace is fixed when it is created (R-SEC-7): ``workspace_identity`` in
``session.json`` names the directory (device and inode numbers, and the boot they were
taken in), and a loaded session keeps it; one stored without it, or in another boot, takes
the directory found at its path when it is loaded.

Traces hold tool output such as file contents, so only the owner may read them: the data
dir, ``sessions/`` and every session directory are 0700, trace files, ``session.json`` and
the usage ledger 0600 — tightened when they exist with wider modes. A subagent (R-HOST-4)
is such a session too, created by its parent's ``spawn_subagent`` call, open in the host
while it runs (``get_session`` finds it: it is steered, interrupted and answered like any,
R-TREE-1) and forgotten when it ends (its files stay). Its ``session.json`` names its
``parent_id``, its ``root_id`` and its ``origin`` (the ids from the root), and the host
keeps each open session's children's ids, so ``children_of`` reads the store only for a
session loaded from it. ``fork_session`` makes a new session of a stored one's history up to
a record (R-FORK-1: :mod:`~greenroom.actors.runtime.time_travel`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from greenroom.actors.providers.base import sole_exception
from greenroom.actors.providers.registry import default_model, provider_for, require_credentials
from greenroom.actors.runtime.accounting import Accounting, PrincipalBudget, price_overrides
from greenroom.actors.runtime.admission import ProviderAdmissions, ProviderLimits
from greenroom.actors.runtime.child_index import ChildIndex
from greenroom.actors.runtime.child_reports import ChildReports
from greenroom.actors.runtime.disk import DISK, Disk
from greenroom.actors.runtime.drain import HandOver, drain_sessions
from greenroom.actors.runtime.errors import HostClosed, SessionNotFound
from greenroom.actors.runtime.gc_tuning import tuned_gc
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.open_tasks import OpenTaskIndex, leaves_work
from greenroom.actors.runtime.people import People, answer, pending_of
from greenroom.actors.runtime.port import Approval, SessionPort, TaskInput
from greenroom.actors.runtime.port_builder import (
    HOST_APPROVE,
    LoadApproval,
    LoadDefaults,
    PortBuilder,
    checked_settings,
    load_defaults,
)
from greenroom.actors.runtime.session import Session, require_trio, settled
from greenroom.actors.runtime.session_ids import OpeningSessions
from greenroom.actors.runtime.shared_limits import SharedLimits
from greenroom.actors.runtime.storage import (
    PRIVATE_DIR_MODE,
    SESSIONS_DIR,
    tighten,
)
from greenroom.actors.runtime.supervisor import start, take_up_stored
from greenroom.actors.runtime.time_travel import fork, settle_fork
from greenroom.actors.runtime.trace_sink import LedgerUnusable
from greenroom.actors.runtime.trace_store import (
    FileTraceStore,
    StoredSession,
    TraceLog,
    TraceStore,
    TraceStoreFactory,
    UsageLedger,
)
from greenroom.actors.tools.workspace import keep_private_identity
from greenroom.protocols.hooks import Hooks
from greenroom.protocols.messages import PersonAnswered, SupervisorMessage
from greenroom.protocols.outputs import Output
from greenroom.protocols.people import PEOPLE, PendingApproval, Verdict
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.tools import Tool, WorkspaceIdentity

SHUTDOWN_GRACE_S = 30.0
"""Bound on closing a host: interrupting every running task and flushing the traces."""
CLOSE_CLIENTS_S = 10.0
"""Bound on closing the provider clients and the MCP servers, past the one above."""

if TYPE_CHECKING:
    pass


def default_data_dir() -> Path:
    """``$GREENROOM_HOME`` or ``~/.greenroom``."""
    return Path(os.environ.get("GREENROOM_HOME") or Path.home() / ".greenroom").expanduser()


@attrs.frozen(kw_only=True)
class SessionInfo:
    """What ``Host.list_sessions`` reports about one stored session. ``parent_id`` names
    the session that spawned it (None for a root), ``root_id`` the root of its tree (its
    own id for a root: R-TREE-1)."""

    session_id: str
    created_at: float
    updated_at: float
    workspace_dir: str
    provider: str
    model: str
    trace_files: int
    parent_id: str | None = None
    root_id: str = ""


@attrs.frozen(kw_only=True)
class UnreadableSession:
    """A stored session whose ``session.json`` cannot be used: where it is and why."""

    session_id: str
    path: str
    reason: str


@attrs.frozen(kw_only=True)
class SessionScan:
    """``Host.scan_sessions``: the readable sessions (newest first) and the others."""

    sessions: tuple[SessionInfo, ...]
    unreadable: tuple[UnreadableSession, ...]


ProviderFactory = Callable[[SessionSettings], ModelProvider]

SessionObserver = Callable[[Session], None]
"""Called with each session a host creates or loads, before it runs (it may subscribe):
every node of a tree (a subagent's outputs also reach its parent's subscribers with
``origin``). Must not block or raise."""

SessionCloser = Callable[[str], None]
"""Told the id of a session that leaves a host's open sessions, not deleted: closed
(``close_session``) leaving no work for a take-up (``open_tasks.leaves_work``: no task
open, no run accepted and not started, no follow-up queued), or a finished subagent
forgotten with no task open. Must not block or raise."""

StaleCopies = Callable[[frozenset[str]], Awaitable[frozenset[str]]]
"""Given the ids of the sessions a host's data dir holds, those whose copy there is not the
host's own session: another host of its cluster runs it now, or the cluster deleted it.
Must not raise (a cluster it cannot ask: none)."""


class Host:
    """The root actor. Open it with ``async with Host.open(data_dir=…) as host``."""

    def __init__(
        self,
        data_dir: Path,
        nursery: trio.Nursery,
        store: TraceStore,
        observers: Iterable[SessionObserver] = (),
        defaults: LoadDefaults | None = None,
        accounting: Accounting | None = None,
        admissions: ProviderAdmissions | None = None,
    ) -> None:
        self.data_dir = data_dir
        self._observers = tuple(observers)
        self._nursery = nursery
        self._store = store
        self.trace_log: TraceLog = store.log
        """The store's trace log: the route of every record (R-TRACE), through the ports."""
        self.usage_ledger: UsageLedger = store.ledger
        """The store's usage ledger (R-TRACE-5)."""
        self._sessions: dict[str, Session] = {}
        self._ports: dict[str, SessionPort] = {}
        self._opening = OpeningSessions(self._sessions)
        self._children = ChildIndex(store.catalog, self.load_session, self._sessions.__contains__)
        self._builder = PortBuilder(self, data_dir, store, nursery.start_soon, accounting,
                                    admissions, defaults)
        self._open_tasks = OpenTaskIndex(store)
        self.child_reports = ChildReports(self, self._open_tasks)
        """Reports of background subagents taken up by this host (R-TREE-2, R-TREE-4)."""
        self._closed = False
        self.draining = False
        """Whether the host drains (:meth:`drain`, R-DRAIN-1)."""
        self.hand_over: HandOver | None = None
        """Where :meth:`drain` hands held sessions (a cluster host's: R-DRAIN-2)."""
        self.on_closed: SessionCloser | None = None
        """Told of each session closed here with no work left (a cluster's node)."""
        self.stale_copies: StaleCopies | None = None
        """What :meth:`list_sessions` leaves out (a cluster host's: :data:`StaleCopies`)."""
        self._people = People(self._ports.get)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        data_dir: str | Path | None = None,
        *,
        observers: Iterable[SessionObserver] = (),
        trace_store: TraceStoreFactory | None = None,
        gc_tuning: bool | None = None,
        resume_tasks: bool = False,
        tools: Iterable[Tool] = (),
        mcp_servers: Mapping[str, Any] | None = None,
        approve: Approval = PEOPLE,
        prices: Mapping[str, Any] | None = None,
        principal_budget: PrincipalBudget | None = None,
        limits: ProviderLimits | None = None,
        shared: SharedLimits | None = None,
    ) -> AsyncIterator[Host]:
        """Start the host's actor tree; on exit close every session (interrupting running tasks
        — one a subagent's answer started stops open at its next turn boundary — and waiting
        for their last records; one waiting only for people stays pending), flush and stop.

        ``resume_tasks=True`` takes up, once the host is open, every stored task that was open when
        its host stopped (a crash, a SIGKILL): a parked task waits on for its answer, a running one
        goes on — calls that were running get host-lost results and are not run again, a request in
        flight is sent again (R-HITL-4). ``tools``, ``mcp_servers`` (as for :meth:`create_session`;
        a bad one: ConfigurationError) and ``approve`` (as for :meth:`resume`) are those of the
        sessions the host loads on its own (resumed tasks, answers to sessions not open, cluster
        takeovers) and of every load naming none (R-MCP-4, R-HITL-4).

        ``observers`` see every session the host creates or loads (:data:`SessionObserver`:
        the OpenTelemetry export subscribes through it). ``trace_store`` builds where the
        sessions are stored from the data dir (default: :class:`FileTraceStore`, files in
        the data dir; any :class:`~greenroom.actors.runtime.trace_store.TraceStore`: a
        session catalog, a trace log and a usage ledger).

        Python's cyclic garbage collector runs less often while the host is open (less
        CPU per streamed event, cyclic garbage kept a little longer: process-wide
        thresholds, restored on exit; :mod:`~greenroom.actors.runtime.gc_tuning` says why
        that is safe): by default (``gc_tuning=None``) only in a process that runs with
        CPython's own thresholds; ``True`` always, ``False`` never.

        Costs and limits (R-SHARE): ``prices`` over the built-in table (``{model: {input,
        output, cache_read, cache_write}}`` in USD per million tokens, or ``Price`` values;
        a bad one raises :class:`ConfigurationError`); ``principal_budget``, what each
        principal may spend per UTC day or month; ``limits`` (:class:`ProviderLimits`), for
        each provider endpoint across the host's sessions, with those the provider makes
        known (429 / 529 with ``retry-after``); ``shared`` (a cluster's ``SharedLimits``)
        makes limits and budgets hold for all the hosts that share it.

        Raises ``RuntimeError`` when entered outside trio (under ``asyncio.run``, say)."""
        require_trio()
        costs = _Costs(price_overrides(prices), principal_budget, limits, shared)
        defaults = load_defaults(tools, mcp_servers, approve)
        path = await trio.to_thread.run_sync(_prepare_data_dir, data_dir)
        with tuned_gc(gc_tuning):
            async with _host_tree(cls, path, observers, trace_store, defaults, costs) as host:
                if resume_tasks:
                    await host.resume_tasks()
                yield host

    # -- sessions -----------------------------------------------------------------------

    async def create_session(
        self,
        *,
        model: str | None = None,
        tools: Iterable[Tool] = (),
        workspace_dir: str | Path | WorkspaceIdentity = ".",
        provider: str | ModelProvider | None = None,
        system: str | None = None,
        settings: SessionSettings | None = None,
        session_id: str | None = None,
        hooks: Hooks | None = None,
        parent_id: str | None = None,
        mcp_servers: Mapping[str, Any] | None = None,
        name: str | None = None,
        principal: str | None = None,
        **overrides: Any,
    ) -> Session:
        """Create a session. ``provider`` is ``anthropic``, ``openai``, ``scripted`` or a
        provider object; ``settings`` and keyword overrides (any
        :class:`SessionSettings` field) fill the rest; ``hooks`` are its R-HOOK-1/2 hooks.
        ``parent_id`` names the session that spawned this one as a subagent (R-HOST-4);
        it is stored in ``session.json`` with ``root_id``, ``origin`` (the ids from the
        root, R-TREE-1) and ``name`` (a subagent's). ``mcp_servers`` adds the tools of MCP servers
        (``{"NAME": {"command": …} | {"type": "http", "url": …}}``, as in an
        ``mcpServers`` file: R-MCP-1); a bad entry raises :class:`ConfigurationError`.
        ``principal`` (a gateway client) is who the session's costs are charged to
        (R-SHARE-4) and its requests admitted for, in turn with other principals
        (R-SHARE-2); kept in ``session.json``; a subagent takes its parent's.

        The workspace is fixed now (R-SEC-7): ``workspace_dir`` must name a directory (``~``
        expanded, symlinks followed) that neither is nor lies inside the host's data dir (one that
        holds it is fine: the data dir is hidden from the session's tools); a
        :class:`~greenroom.protocols.tools.WorkspaceIdentity` (a subagent's, its parent's) must
        still name the directory at its path. Else :class:`ConfigurationError`.

        Without ``provider`` (or ``settings``), a ``claude-*`` model means ``anthropic``;
        otherwise the provider is ``anthropic`` when ``ANTHROPIC_API_KEY`` is set, else
        the scripted model. The ``anthropic`` provider without ``ANTHROPIC_API_KEY`` or
        ``ANTHROPIC_AUTH_TOKEN`` raises :class:`ConfigurationError`: asking for Claude
        never runs another model silently. A ``session_id`` in use (open, being created or
        stored) raises :class:`SessionExists`; without it, an unused id is drawn."""
        self.check_open()
        port = await self._opening.create(
            session_id,
            self._builder.new,
            parent=None if parent_id is None else self._ports.get(parent_id),
            parent_id=parent_id,
            settings=_new_settings(settings, provider, model, system, overrides),
            provider=provider if not isinstance(provider, str | None) else None,
            tools=list(tools),
            workspace_dir=workspace_dir,
            name=name,
            hooks=hooks,
            mcp_servers=mcp_servers,
            principal=principal,
        )
        return self._add(port, created=True)

    def _add(self, port: SessionPort, *, created: bool = False) -> Session:
        """Open ``port``'s session here and show it to the observers (every node of a
        tree: in a cluster a child is a session like any other, R-TREE-4)."""
        session = Session(port, self.is_open)
        self._sessions[port.id] = session
        self._ports[port.id] = port
        if created:
            self._children.created(port.id, port.parent_id)
        for observe in self._observers:
            observe(session)
        return session

    async def load_session(
        self,
        session_id: str,
        *,
        tools: Iterable[Tool] | None = None,
        provider: str | ModelProvider | None = None,
        mcp_servers: Mapping[str, Any] | None = None,
        principal: str | None = None,
        approve: LoadApproval = HOST_APPROVE,
        **overrides: Any,
    ) -> Session:
        """Load a stored session: its model context is rebuilt from the latest trace file
        (unresolved calls interrupted, carry-over from the last abort: R-TRACE-4). Corrupt
        trace lines are skipped and listed in ``session.load_errors``. ``mcp_servers`` and
        ``principal`` as for :meth:`create_session` (an open session keeps its own, and its
        ``approve``); ``tools``, ``mcp_servers`` and ``approve`` default to the host's.

        A task the trace leaves open (its host stopped mid-task) stays open: a task that
        waits only for people is parked and answered like any (R-HITL-1), its other calls
        and the follow-ups queued under a callback decided by ``approve`` (as for
        :meth:`resume`); another is taken up by :meth:`resume` (R-HITL-4), or recovered as
        interrupted when a new task starts (R-TRACE-4)."""
        self.check_open()
        if (open_now := await self._opening.settled(session_id, self.check_open)) is not None:
            return open_now  # open, or opened by a load under way: one port a session
        with self._opening.opening(session_id):
            port = await self._builder.stored(
                session_id, tools=tools, provider=provider, mcp_servers=mcp_servers,
                overrides=overrides, principal=principal, approve=approve,
            )
            self.child_reports.loaded(port)  # R-TREE-2, R-TREE-4
            self._people.watch_pending(port)  # R-HITL-1: a wait keeps its time limit
            return self._add(port)

    async def fork_session(
        self, session_id: str, at_seq: int | None = None, **options: Any
    ) -> Session:
        """A new session, open here, with ``session_id``'s history up to ``at_seq`` (default:
        its last record: R-FORK-1); ``options`` and what raises: :func:`~greenroom.actors.
        runtime.time_travel.fork` (``tools`` and ``mcp_servers`` default to the host's)."""
        self.check_open()
        port = await self._opening.create(None, fork, self._builder, self._store, session_id,
                                          at_seq, default_tools=self._builder.defaults.tools,
                                          **options)
        session = self._add(port, created=True)
        await settle_fork(port)  # after the observers: a cluster replicates the copy first
        return session

    def get_session(self, session_id: str) -> Session:
        """An open session of this host; raises :class:`SessionNotFound`."""
        if (session := self._sessions.get(session_id)) is None:
            raise SessionNotFound(f"session {session_id!r} is not open in this host")
        return session

    @property
    def sessions(self) -> tuple[Session, ...]:
        """The sessions open in this host (running subagents included)."""
        return tuple(self._sessions.values())

    async def children_of(self, session_id: str) -> list[Session]:
        """The subagents of ``session_id``, running and finished (loaded), oldest first:
        ``Session.children`` (R-TREE-1)."""
        return await self._children.sessions(session_id)

    async def list_sessions(self) -> list[SessionInfo]:
        """Every readable session stored in the data dir, newest first; on a cluster host, but
        for the copies of sessions another host runs now or the cluster deleted."""
        return await _own_sessions((await self.scan_sessions()).sessions, self.stale_copies)

    async def scan_sessions(self) -> SessionScan:
        """Every session of the store's catalog: the readable ones newest first, and each
        one whose metadata cannot be used with where it is and the reason. One bad file
        never hides the others (R-SEC-1)."""
        return _session_scan(await self._store.catalog.list_sessions())

    async def close_session(self, session_id: str) -> None:
        """Interrupt the session's task, wait for its last record, forget it (R-HOST-3)."""
        await self._close(session_id, delete=False)

    async def delete_session(self, session_id: str) -> None:
        """Close the session — interrupting its task and waiting until its last record is
        written (R-HOST-3) — then remove its directory: trace files, scratchpad and all.
        Raises :class:`SessionNotFound` when it is neither open nor stored."""
        if session_id not in self._sessions and not await self._store.catalog.exists(session_id):
            raise SessionNotFound(f"no session {session_id!r} in {self.data_dir}")
        await self._close(session_id, delete=True)

    async def _close(self, session_id: str, *, delete: bool) -> None:
        # After a creation or load under way; a load meanwhile waits for the close (and
        # finds a deleted session gone, not half deleted), cut short or not (_SessionClose).
        await self._opening.settled(session_id)
        with contextlib.ExitStack() as held:
            held.enter_context(self._opening.opening(session_id))
            session, port = self._sessions.pop(session_id, None), self._ports.pop(session_id, None)
            self._children.closed(session_id)
            if session is not None and port is not None:
                closing = _SessionClose(port, delete, self._open_tasks, lambda: self.on_closed)
                await closing.run(session, self._builder, held, self.start_task)
            if delete:
                self._open_tasks.deleted(session_id)
                await self._store.catalog.delete(session_id)

    async def drain(self, grace_s: float) -> list[str]:
        """Drain before a stop (R-DRAIN-1, :mod:`~greenroom.actors.runtime.drain`): users
        get no new task (``run``, ``follow_up``, ``compact`` raise :class:`HostClosed`);
        running tasks stop at their next turn boundary, open in their traces, handed over
        by ``hand_over`` (a cluster host's) or taken up by the next host: nothing re-run,
        no request wasted. Returns within ``grace_s`` the ids of the sessions held so."""
        self.draining = True
        return await drain_sessions(self._ports.values(), grace_s, self.hand_over)

    async def aclose(self) -> None:
        """Close every session (concurrently) and the provider clients."""
        self._closed = True
        try:
            async with trio.open_nursery() as nursery:
                for sid in self._opening.every_id():  # a load under way: once it ends
                    nursery.start_soon(self.close_session, sid)
        finally:
            # Even past the shutdown bound: the desk, the provider clients and the MCP
            # servers' manager must end for the host's nursery to.
            self._people.close()
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_CLIENTS_S):
                await self._builder.aclose()

    # -- internals ---------------------------------------------------------------------

    @property
    def trace_store(self) -> TraceStore:
        """Where the host's sessions are stored: ``.catalog`` (the sessions and their
        metadata), ``.log`` (every record goes through it: R-TRACE), ``.ledger``."""
        return self._store

    def check_open(self) -> None:
        """Raise :class:`HostClosed` once the host has shut down."""
        if self._closed:
            raise HostClosed("the host is closed")

    def is_open(self) -> bool:
        """Whether the host still takes work."""
        return not self._closed

    def port(self, session_id: str) -> SessionPort:
        """The runtime seam of an open session (:class:`SessionPort`): what its running
        work uses. For integrations and tests that stand in for part of the runtime; its
        methods are not the user API. Raises :class:`SessionNotFound`."""
        if (port := self._ports.get(session_id)) is None:
            raise SessionNotFound(f"session {session_id!r} is not open in this host")
        return port

    async def create_child(self, parent: SessionPort, *, settings: SessionSettings,
                           tools: Iterable[Tool], name: str | None = None,
                           background: bool = False) -> SessionPort:
        """Create a subagent's session ``name`` under ``parent`` (R-HOST-4, R-TREE-1): the
        parent's provider and workspace, ``settings`` and ``tools``; ``background`` is
        recorded in its ``session.json`` (R-TREE-2)."""
        self.check_open()
        port = await self._opening.create(None, self._builder.child, parent=parent,
                                          settings=settings, tools=list(tools), name=name,
                                          background=background)
        self._add(port, created=True)
        return port

    def forget_child(self, child: SessionPort) -> None:
        """Drop a finished subagent session from the open sessions and its trace position
        (it has no MCP connections); ``load_session`` opens it again. Told to ``on_closed``
        as a closed session is, unless its task stays open (the host closes as it waits)."""
        if self._ports.get(child.id) is child:
            del self._ports[child.id]
            self._sessions.pop(child.id, None)
            self._children.closed(child.id)
            self._store.log.release(child.id)
            if self.on_closed is not None and child.machine.run_id is None:
                self.on_closed(child.id)
        child.closed = True
        child.end_watches()

    def start_work(self, port: SessionPort, task: TaskInput | None,
                   output: trio.MemorySendChannel[list[Output]]) -> None:
        """Start ``port``'s work in the host's nursery (R-TREE-2; see HostServices)."""
        start(port, task, output)

    # -- people (R-HITL) -----------------------------------------------------------------

    async def serve_people(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the host's clock for requests that wait for people (until it closes)."""
        await self._people.run(task_status=task_status)

    async def pending_approvals(
        self, *, read_only: bool = False, **load: Any
    ) -> list[PendingApproval]:
        """Every request waiting for a person (approvals and questions) in this host's
        sessions — the open ones and the stored ones whose trace leaves a task waiting
        (R-HITL-2). Those are loaded for it (``load`` as for :meth:`load_session`: the host's
        tools by default) or, ``read_only``, read from their traces: none is loaded."""
        stored = await self._open_tasks.ids(self._ports)
        for session_id in () if read_only else stored:
            with contextlib.suppress(SessionNotFound):
                await self.load_session(session_id, **load)
        listed = [p for port in list(self._ports.values()) for p in pending_of(port)]
        return listed + (await self._people.stored.read(self._store, stored) if read_only else [])

    async def answer_approval(
        self, session_id: str, call_id: str, decision: Verdict, by: str | None = None, *,
        digest: str | None = None, **load: Any,
    ) -> None:
        """Answer the pending approval of ``call_id``: ``allow``, ``deny`` or
        ``allow_session``, recorded with ``by: client`` and ``principal=by`` (R-HITL-2).
        Works whether or not the session is open or its task in memory: the task resumes
        (a parked one wakes, a stored one is loaded, with ``load`` as for :meth:`load_session`:
        a front's own tools and model, also when its close begins meanwhile). ``digest``,
        when given, must be the arguments digest the person saw. Raises :class:`NotPending`
        when the call waits for no decision, :class:`SessionNotFound` when there is none."""
        port = self._ports[(await self.load_session(session_id, **load)).id]
        await answer(
            port,
            PersonAnswered(call_id=call_id, verdict=decision, principal=by, digest=digest),
        )

    async def answer_question(
        self, session_id: str, call_id: str, text: str, by: str | None = None, **load: Any
    ) -> None:
        """Answer the model's question of ``call_id`` (the ``ask_user`` tool, R-HITL-5): ``text`` is
        the call's result; or say what became of a call in doubt (R-EFFECT-2): ``done``, ``not
        done`` or ``run again``. ``load`` and what raises as for :meth:`answer_approval`."""
        port = self._ports[(await self.load_session(session_id, **load)).id]
        await answer(port, PersonAnswered(call_id=call_id, text=text, principal=by))

    async def resume(
        self, session_id: str, *, approve: LoadApproval = HOST_APPROVE, **load: Any
    ) -> Session:
        """Take up the session's open task, if its trace leaves one: loaded (``load`` as for
        :meth:`load_session`) and resumed (R-HITL-4). A prompt recorded without its ``task_start``
        is a run its host accepted and had not started: its task starts (R-CLUSTER-2). ``approve``
        (by default the host's: ``Host.open``) decides the calls of a task whose host stopped under
        it, as ``session.run(approve=…)`` does: the callback it ran with went with that host. A call
        waiting for a person keeps waiting for one, whatever ``approve`` is (R-HITL-1); a parked
        task keeps its own. A background subagent's task goes on, its answer reaching its parent
        (``child_reports``); a foreground one's is left to its trace. Returns the session."""
        session = await self.load_session(session_id, approve=approve, **load)
        take_up_stored(self._ports[session_id], self._builder.approval(approve))
        return session

    async def resume_tasks(self, approve: LoadApproval = HOST_APPROVE) -> list[str]:
        """Take up every stored task stopped hosts left open (``Host.open(resume_tasks=True)``,
        ``approve`` as for :meth:`resume`); the ids taken up: a foreground child's, not."""
        ids = await self._open_tasks.ids(self._ports)
        return await _take_up_together(self, ids, self._builder.approval(approve))

    def wake(self, port: SessionPort, message: SupervisorMessage | None) -> None:
        """Start a supervisor for ``port``'s open task (see :data:`HostServices`)."""
        self.child_reports.wake(port, message)

    def watch_approval(self, port: SessionPort, call_id: str, asked_at: float | None) -> None:
        """Hold the wait of ``call_id`` to ``port``'s timeout policy."""
        self._people.watch(port, call_id, asked_at)

    def start_task(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` in the host's nursery, past its caller; it must not raise (ends host)."""
        self._nursery.start_soon(fn)

    async def load_provider(
        self, provider: str | None = None, *, model: str | None = None, base_url: str | None = None
    ) -> None:
        """Make the provider client that sessions created with ``provider``, ``model`` and
        ``base_url`` will share (as :meth:`create_session` names it), unless it is made already: a
        host that must answer its first session within a bound loads the provider's library
        beforehand. Off the event loop. Raises :class:`ConfigurationError` as :meth:`create_session`
        would (an unknown provider, or anthropic without credentials)."""
        await self._builder.clients.load(provider, model=model, base_url=base_url)


class _SessionClose:
    """The end of a host's close of one session (R-HOST-3), once its work has ended: the
    open-task index learns what it leaves, its private MCP connections close, and
    ``on_closed`` is told. A close cut short (its caller was cancelled while the work
    ended) leaves that to a task of the host's, which holds the session's id meanwhile, as
    the close did — a load of it waits — until the work has ended and its trace is synced,
    or let go (:func:`~greenroom.actors.runtime.session.settled`): bounded, and never past
    the close of the host's store. Before: its MCP connections stayed open until the
    host closed, and ``on_closed`` never heard of it."""

    def __init__(self, port: SessionPort, delete: bool, open_tasks: OpenTaskIndex,
                 on_closed: Callable[[], SessionCloser | None]) -> None:
        self._port = port
        self._delete = delete
        self._open_tasks = open_tasks
        self._on_closed = on_closed

    async def run(self, session: Session, builder: PortBuilder, held: contextlib.ExitStack,
                  start_task: Callable[[Callable[[], Awaitable[None]]], None]) -> None:
        """Close ``session`` and end its close; ``held`` holds its id against loads."""
        try:
            # A task that waits only for people is not interrupted: its request stays
            # pending in the trace, and loading the session asks it again (R-HITL-1).
            await session.aclose()
        except BaseException:
            log = self._port.host.trace_log
            cut_short: Callable[[str], trio.Event | None] | None = getattr(log, "cut_short", None)
            let_go = cut_short(self._port.id) if cut_short is not None else None
            kept = held.pop_all()
            try:
                start_task(functools.partial(self._later, kept, builder, let_go))
            except RuntimeError:  # the host's nursery has ended: so has all of it
                kept.close()
            raise
        await self._end(builder.release)

    async def _later(self, held: contextlib.ExitStack, builder: PortBuilder,
                     let_go: trio.Event | None) -> None:
        with held:
            await settled(self._port, let_go)
            # The trace is the session's own task's to let go (its release, in
            # Session.aclose): a load here then waits for it.
            with trio.move_on_after(CLOSE_CLIENTS_S):
                await self._end(builder.mcp.release)

    async def _end(self, release: Callable[[str], Awaitable[None]]) -> None:
        port = self._port
        holds_work = leaves_work(port.machine)
        self._open_tasks.closed(port.id, port.machine)
        await release(port.id)
        on_closed = self._on_closed()
        if not (self._delete or holds_work) and on_closed is not None:
            on_closed(port.id)


async def _take_up_together(host: Host, session_ids: list[str], approve: Approval) -> list[str]:
    """Load each of ``session_ids``, then take up their open tasks (``Host.resume``); the
    ids of those whose work was taken up (a foreground subagent's is not: it stays
    loaded, its task its parent's call's)."""
    loaded = []
    for session_id in session_ids:
        with contextlib.suppress(SessionNotFound):  # unreadable, or deleted meanwhile
            await host.load_session(session_id, approve=approve)
            loaded.append(session_id)
    return take_up_loaded(host, loaded, approve).resumed


@attrs.frozen
class TakenUp:
    """What :func:`take_up_loaded` made of the sessions it was given."""

    open: list[str]
    """The ids of those still open here, work taken up or not: a cluster host announces
    each as served here."""
    resumed: list[str]
    """The ids of those whose work was taken up (a supervisor runs it now)."""


def take_up_loaded(host: Host, session_ids: Iterable[str], approve: Approval) -> TakenUp:
    """Take up the open tasks of ``session_ids``, every one loaded in ``host`` already
    (``approve`` as for :meth:`Host.resume`). Loading several sessions that a stopped host
    left (``Host.resume_tasks``, a cluster host's takeover of another's), take them all
    first, then their tasks up with this."""
    taken = TakenUp([], [])
    # All are open before any supervisor starts, and all start with no pause between
    # them: a subagent's task takes its first step knowing which of its background
    # children run again here, and waits for them as before its host stopped (R-TREE-2).
    for session_id in session_ids:
        with contextlib.suppress(SessionNotFound):  # closed while the others loaded
            if take_up_stored(host.port(session_id), approve):
                taken.resumed.append(session_id)
            taken.open.append(session_id)
    return taken


@attrs.frozen
class _Costs:
    """What ``Host.open`` was given of prices, budgets and limits (R-SHARE)."""

    prices: Mapping[str, Any]
    principal_budget: PrincipalBudget | None
    limits: ProviderLimits | None
    shared: SharedLimits | None


@asynccontextmanager
async def _host_tree(
    cls: type[Host],
    path: Path,
    observers: Iterable[SessionObserver],
    trace_store: TraceStoreFactory | None,
    defaults: LoadDefaults,
    costs: _Costs,
) -> AsyncIterator[Host]:
    """The host's actor tree while it is open: its nursery, its store and its people's
    clock; on exit every session is closed and the store flushed (``Host.open``).
    ``costs`` are the host's prices, budgets and limits, checked already."""
    try:
        async with trio.open_nursery() as nursery:
            store = (trace_store or FileTraceStore)(path)
            accounting = Accounting(
                store.ledger,
                catalog=store.catalog,
                prices=costs.prices,
                principal_budget=costs.principal_budget,
                shared=costs.shared,
            )
            await nursery.start(store.run)
            admissions = ProviderAdmissions(costs.limits, costs.shared)
            host = cls(path, nursery, store, observers, defaults, accounting, admissions)
            await nursery.start(host.serve_people)
            try:
                yield host
            finally:
                # Shielded so that the last records land even when the host is being
                # cancelled; bounded so that a tool stuck in a thread cannot hang it.
                with trio.CancelScope(shield=True) as teardown:
                    teardown.deadline = trio.current_time() + SHUTDOWN_GRACE_S
                    try:
                        await host.aclose()
                    finally:
                        await store.aclose()
    # The store fails to start inside the host's nursery; its reason is the caller's to
    # read as any error of opening, not inside an exception group.
    except* LedgerUnusable as group:
        raise sole_exception(group) from None


def _prepare_data_dir(data_dir: str | Path | None, disk: Disk = DISK) -> Path:
    """Create the data dir and ``sessions/`` (0700), or tighten them to 0700. An existing
    data dir is tightened only when it is a greenroom data dir or empty: pointed at some
    other directory, the host changes nothing there but what it creates (``sessions/``
    and the ledger are private all the same). The entries of the directories it creates
    are made durable (their parents fsynced) before any session is created in them."""
    path = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    made: list[Path] = []
    if path.is_dir():
        if (path / SESSIONS_DIR).is_dir() or not any(path.iterdir()):
            tighten(path, PRIVATE_DIR_MODE)
    else:
        missing = path
        while not missing.exists() and missing != missing.parent:
            made.append(missing)
            missing = missing.parent
        path.mkdir(parents=True, mode=PRIVATE_DIR_MODE)
    sessions = path / SESSIONS_DIR
    if not sessions.is_dir():
        made.append(sessions)
    sessions.mkdir(exist_ok=True, mode=PRIVATE_DIR_MODE)
    tighten(sessions, PRIVATE_DIR_MODE)
    for parent in sorted({directory.parent for directory in made}, reverse=True):
        disk.fsync(parent)
    # Hidden from every session by what it is, not by its path: a sandboxed command that
    # renames a directory above it does not carry it out of sight (R-SEC-7).
    keep_private_identity(path)
    return path


def _new_settings(
    settings: SessionSettings | None,
    provider: str | ModelProvider | None,
    model: str | None,
    system: str | None,
    overrides: dict[str, Any],
) -> SessionSettings:
    """A new session's settings, as :meth:`Host.create_session` composes them."""
    base = settings or SessionSettings()
    provider_name = (
        getattr(provider, "name", None)
        if provider is not None and not isinstance(provider, str)
        else base.provider
        if provider is None and settings is not None
        else provider_for(provider, model)
    )
    if isinstance(provider, str | None):
        require_credentials(str(provider_name), model, overrides.get("base_url"))
    changes: dict[str, Any] = dict(overrides)
    changes["provider"] = provider_name
    if model is not None:
        changes["model"] = model
    elif settings is None:
        changes["model"] = default_model(str(provider_name))
    if system is not None:
        changes["system"] = system
    return checked_settings(base, changes)


def stored_root(meta: Mapping[str, Any], session_id: str) -> str:
    """The root of a stored session's tree (R-TREE-1), from its ``session.json``: its
    ``root_id``; for a subagent stored before trees had depth, its parent (then always
    the root); a root's own id."""
    root_id = meta.get("root_id")
    if isinstance(root_id, str):
        return root_id
    parent_id = meta.get("parent_id")
    return parent_id if isinstance(parent_id, str) else session_id


async def _own_sessions(
    listed: Iterable[SessionInfo], stale_copies: StaleCopies | None
) -> list[SessionInfo]:
    """The sessions of ``listed`` that are the host's own (see :data:`StaleCopies`)."""
    infos = list(listed)
    if stale_copies is None:
        return infos
    stale = await stale_copies(frozenset(info.session_id for info in infos))
    return [info for info in infos if info.session_id not in stale]


def _session_scan(stored: list[StoredSession]) -> SessionScan:
    infos: list[SessionInfo] = []
    unreadable: list[UnreadableSession] = []
    for entry in stored:
        meta = entry.meta
        if meta is None:
            unreadable.append(
                UnreadableSession(
                    session_id=entry.session_id, path=entry.where, reason=entry.problem or ""
                )
            )
            continue
        settings = meta.get("settings", {})
        created = meta.get("created_at", 0.0)
        session_id = meta.get("session_id", entry.session_id)
        parent_id = meta.get("parent_id")
        root_id = stored_root(meta, session_id)
        infos.append(
            SessionInfo(
                session_id=session_id,
                created_at=float(created) if abs(created) < 1e300 else 0.0,
                updated_at=entry.updated_at,
                workspace_dir=meta.get("workspace_dir", ""),
                provider=str(settings.get("provider", "")),
                model=str(settings.get("model", "")),
                trace_files=entry.traces,
                parent_id=parent_id,
                root_id=root_id,
            )
        )
    infos.sort(key=lambda i: i.updated_at, reverse=True)
    unreadable.sort(key=lambda u: u.session_id)
    return SessionScan(sessions=tuple(infos), unreadable=tuple(unreadable))
