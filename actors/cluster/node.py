"""One host of a cluster: ownership, fenced traces and takeover around a normal Host
(R-CLUSTER-1..2).

::

    open_cluster_host            connects to NATS, then runs
    ├── trace streams            one task per owned session: its records, fenced, to JetStream
    │                    and one request server per owned session (its calls from other
    │                    gateways, :mod:`.router`)
    ├── ClusterLimits            the provider limits and principals' budgets every host
    │                            holds together (:mod:`.limits`): the host's SharedLimits
    └── Host (ReplicatingTraceStore)
        └── ClusterNode.run
            ├── OwnershipKeeper  renews this host's lease; its sessions are owned through
            │                    it, and stop here when it is lost
            ├── announcer        this host's load in the host registry, when it changes and
            │                    every TTL / 3; placeable once it answers placed sessions
            ├── directory        session metadata (running or idle) to the session bucket
            ├── host requests    sessions placed on this host by other gateways
            ├── subagent relays  the records of subagents that run on other hosts, from their
            │                    traces, to their ancestors open here (:mod:`.remote_children`)
            └── orphan scan      every TTL / 2: sessions no live host owns (read in full
                                 only when a host's lease went, :mod:`.orphans`), spread
                                 over the live hosts by tree; this host takes over its share

A session the host creates or loads is *adopted*: it is claimed (its owner entry names
this host's lease, :mod:`.ownership`), its trace fenced, its lines replicated. When the
host's lease is lost (a renewal refused, say after a stall; NATS out of reach for a TTL)
every session it owns, and a session whose append is refused (fenced), stops replicating
at once — nothing it writes after that reaches the cluster's trace — and is closed on this
host.

Takeover of an orphan (a session whose owner's lease is gone): claim it, fence the trace,
read it, write it into this host's data dir as the session's trace files (with its
``session.json`` from the directory), then take it up as a restarted host takes up its own
sessions (R-HITL-4; the orphans of one scan are all loaded before their tasks are taken
up together, as ``Host.resume_tasks`` does: a subagent knows its running children from
its first step, R-TREE-2): a task that was in flight goes on — every tool call
whose result is missing is in doubt and is resolved by its tool's check, a person or the
host-lost note; it runs again only when the check found it not done or a person says so,
with its idempotency key (R-EFFECT-2); the model is told, the task ends with one
``task_end`` (R-CLUSTER-2) — and a task that waited for a person keeps waiting, asked again
of whoever can answer, never denied because its host was lost (R-HITL-1). An idle session
is taken over too (loaded, nothing run), so no session is left without a host. One made
for a ``session.create`` a gateway placed on its host and then withdrew (that host died or
stalled before its answer arrived) is deleted instead, by the one host that takes it up
(:mod:`.placements`).
A session the host closes leaving no work (a subagent whose task ended, which its host
forgets; a session its user closed: ``Host.on_closed``) leaves the host: out of its load at
once; then, in its lane after its adoption (:mod:`.lanes`) and once JetStream holds its
last record, its directory entry is written closed (:mod:`.directory_entries`: no orphan),
its stream and request server stop (once the calls forwarded to it are done:
:mod:`.in_flight`) and its claim is released. Opened again here it is adopted again; a
call through any gateway opens it on that gateway's host (:mod:`.router`).
A session closed while it leaves work for a take-up stays this host's, an orphan for
the scan to take up once this host is lost: its task waits for
people (R-HITL-1), or a run accepted and not started, or follow-ups queued, are in its
trace (``open_tasks.leaves_work``: R-CLUSTER-2, R-STEER-6).
A session deleted through any host leaves the cluster (metadata, trace and owner); a host
that held a copy of it deletes that once it hears of it, or when it starts again if it was
away (:mod:`.deleted_copies`). Usage rows are not written again: each host's ledger holds
the requests it made; what a principal spends is also added to the cluster's counter of its
period (:mod:`.spending`), which its budget counts on every host.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from greenroom.actors.cluster.bridge import Bridge
from greenroom.actors.cluster.connection import ClusterNames, Connection, connect, shown_url
from greenroom.actors.cluster.deleted_copies import delete_copy, watch_deleted_copies
from greenroom.actors.cluster.directory_entries import DirectoryEntries, Grantor
from greenroom.actors.cluster.errors import ClusterError, ClusterUnavailable
from greenroom.actors.cluster.handover import HandedSince, gather_tree, hand_over, take_handed
from greenroom.actors.cluster.in_flight import CallsInFlight
from greenroom.actors.cluster.lanes import SessionLanes
from greenroom.actors.cluster.limits import ClusterLimits
from greenroom.actors.cluster.listing import DirectoryPasses, stale_copies
from greenroom.actors.cluster.orphans import OrphanFinder
from greenroom.actors.cluster.ownership import OwnershipKeeper, SessionOwners
from greenroom.actors.cluster.placements import PlacementRecords, withdrawn
from greenroom.actors.cluster.registry import HostRecord, HostRegistry, SessionDirectory
from greenroom.actors.cluster.remote_children import RemoteChildren
from greenroom.actors.cluster.router import ClusterRouter, OwnerDesk
from greenroom.actors.cluster.routing import SessionRequests
from greenroom.actors.cluster.store import (
    ReplicatingTraceLog,
    ReplicatingTraceStore,
    UnreplicableRecord,
)
from greenroom.actors.cluster.traces import TraceRead, TraceStream, TraceWriter, largest_input
from greenroom.actors.cluster.tree_link import ParentLink, reopen_if_closed
from greenroom.actors.cluster.tree_reach import ReachParts, TreeReach
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.actors.runtime.admission import ProviderLimits
from greenroom.actors.runtime.child_reports import ChildReports
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.host import Host, SessionObserver, take_up_loaded
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.port import Approval
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.storage import SessionStore
from greenroom.protocols.outputs import Output, TaskEnd, TaskStart
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool
from greenroom.protocols.trace import encode_record, trace_file_name

if TYPE_CHECKING:
    from greenroom.actors.gateway.server import Gateway

__all__ = ["ClusterConfig", "ClusterNode", "open_cluster_host"]


@attrs.frozen(kw_only=True)
class ClusterConfig:
    """How a host joins a cluster: the NATS ``url`` (comma-separated servers), its
    ``host_id`` (unique in the cluster), the lease TTL and the resource prefix."""

    url: str
    host_id: str
    lease_ttl_s: float = 5.0
    prefix: str = "greenroom"
    gateway: str | None = None
    request_timeout_s: float | None = None
    """How long a gateway waits for a session's owner to answer a call it forwards
    (None: the lease TTL, after which a stalled owner has lost the session)."""


def log(message: str) -> None:
    """One line on stderr (the serve process's log)."""
    print(f"greenroom cluster: {message}", file=sys.stderr, flush=True)


class ClusterNode:
    """The cluster side of one host. Made by :func:`open_cluster_host`."""

    def __init__(
        self,
        conn: Connection,
        config: ClusterConfig,
        *,
        tools: Iterable[Tool] = (),
        approve: Approval = PEOPLE,
        provider: Callable[[], ModelProvider] | None = None,
        lease_conn: Connection | None = None,
    ) -> None:
        self.conn = conn
        self._lease_conn = lease_conn
        self.config = config
        self.host_id = config.host_id
        self._tools = tuple(tools)
        self._approve = approve
        self._provider = provider
        self.store: ReplicatingTraceStore | None = None
        self._host: Host | None = None
        self._streams: trio.Nursery | None = None
        self._work: trio.Nursery | None = None
        self._owners: SessionOwners | None = None
        self._keeper: OwnershipKeeper | None = None
        self._finder: OrphanFinder | None = None
        self._traces: TraceStream | None = None
        self._registry: HostRegistry | None = None
        self._directory: SessionDirectory | None = None
        self._stream_scopes: dict[str, trio.CancelScope] = {}
        self._taking_over: set[str] = set()
        self._adopted: set[str] = set()
        self._lanes = SessionLanes()
        self._entries = DirectoryEntries(self.host_id, self._adopted.__contains__, log)
        self._gateway: Gateway | None = None
        self._desk: OwnerDesk | None = None
        self._desk_ready = trio.Event()
        self._requests = SessionRequests(conn)
        self._remote = RemoteChildren(self._requests, self.serves, log)
        self._placements = PlacementRecords(conn)
        self._placeable = False
        self._handed = HandedSince()
        self._gathering: set[str] = set()
        self._serving: dict[str, trio.Event] = {}
        self._calls = CallsInFlight(config.lease_ttl_s)

    # -- wiring ---------------------------------------------------------------------------

    def make_store(self, data_dir: Path) -> ReplicatingTraceStore:
        """The host's trace store (``Host.open(trace_store=…)``)."""
        largest = functools.partial(largest_input, self.conn)
        self.store = ReplicatingTraceStore(
            data_dir, on_fenced=self._on_fenced, on_deleted=self._on_deleted, largest_input=largest
        )
        return self.store

    def bind_grants(self, grants: Grantor) -> None:
        """Share the gateway's grants through the session directory: the principals that
        may see a session here may see it on whichever host takes it over."""
        self._entries.grants = grants

    def bind_gateway(self, gateway: Gateway) -> None:
        """Serve every session through ``gateway`` (R-CLUSTER-1): its calls on sessions
        other hosts run are forwarded to them, and the calls other gateways forward here
        run through its methods. Before the gateway serves."""
        self._gateway = gateway
        self.bind_grants(gateway)
        self._desk = OwnerDesk(
            gateway,
            functools.partial(_answers, self.serves, self._lanes),
            functools.partial(_until_serving, self._serving),
            bound_s=self.config.lease_ttl_s,
            reports=self._take_report,
            takes=self._take_handed,
            running=self._remote.take,
        )
        self._desk_ready.set()
        if self._work is not None:
            self._route(gateway, self._work)

    async def _take_report(self, session_id: str, params: dict[str, Any]) -> dict[str, Any]:
        """A background subagent's answer for ``session_id``, sent by another host."""
        assert self._host is not None
        return await ParentLink(self._requests, self._host, self._approve).take(session_id, params)

    def serves(self, session_id: str) -> bool:
        """Whether this host runs ``session_id`` (owns it, or is taking it over)."""
        return session_id in self._adopted or session_id in self._taking_over

    @property
    def load(self) -> int:
        """How many sessions this host owns."""
        return len(self._adopted)

    def observe(self, session: Session) -> None:
        """The host's :data:`SessionObserver`: adopt every session it creates or loads."""
        assert self.store is not None and self._work is not None
        sid = session.id
        self.store.log.replicate(sid)
        self._adopted.add(sid)
        self._entries.note_placement(sid)
        self._load_changed()
        # Unbounded: the publisher never waits on the node, and the node's watcher waits
        # on nothing but this inbox (an announcement is queued without blocking), so the
        # inbox holds only what was published since the watcher's last turn.
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        session.watch(send, kinds=(TaskStart, TaskEnd))
        session.host.start_task(functools.partial(self._entries.follow, sid, inbox))
        self._remote.opened(session)
        if sid not in self._taking_over:
            with contextlib.suppress(RuntimeError):  # shutting down
                self._lanes.start_soon(self._work, sid, functools.partial(self._adopt, sid))

    async def run(
        self, host: Host, streams: trio.Nursery, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Open the cluster's buckets and stream, then keep leases, the registry and the
        directory up to date and take over orphans, until cancelled."""
        self._host = host
        self._streams = streams
        ttl = self.config.lease_ttl_s
        self._owners = await SessionOwners.open(self.conn, ttl_s=ttl, lease_conn=self._lease_conn)
        self._keeper = OwnershipKeeper(self._owners, self.host_id, self._on_lost, warn=log)
        self._traces = traces = await TraceStream.open(self.conn)
        self._registry = await HostRegistry.open(self.conn, ttl_s=self._owners.ttl_s)
        self._directory = directory = await SessionDirectory.open(self.conn)
        self._entries.bind(host, self._directory)
        reopen = functools.partial(reopen_if_closed, self._directory, self._take_entry)
        link = ParentLink(self._requests, host, self._approve, timeout_s=ttl, reopen=reopen)
        reach = (directory, self._owners, self.serves, self._load_over, self._requests)
        _link_tree(host.child_reports, link, self.config, reach)
        host.hand_over = self.hand_over
        host.on_closed = self._on_closed
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_deleted_copies, self.conn, traces, host, self.serves)
            self._work = nursery
            self._remote.bind(host, traces, nursery)
            if self._gateway is not None:
                self._route(self._gateway, nursery)
            await nursery.start(self._keeper.run)
            await nursery.start(self._registry.announce_every, self._record)
            nursery.start_soon(self._entries.send_updates)
            self._finder = OrphanFinder(self._directory, self._owners, self.serves)
            take = self._take_entries
            scan = (self._registry, self.host_id, ttl / 2, take, lambda: host.draining)
            nursery.start_soon(self._finder.scan, *scan)
            log(f"host {self.host_id} joined the cluster at {shown_url(self.config.url)}")
            task_status.started()

    def _route(self, gateway: Gateway, nursery: trio.Nursery) -> None:
        assert self._directory is not None and self._registry is not None
        assert self._traces is not None and self._desk is not None
        ttl = self.config.lease_ttl_s
        router = ClusterRouter(
            host_id=self.host_id,
            gateway=gateway,
            requests=self._requests,
            directory=self._directory,
            registry=self._registry,
            traces=self._traces,
            serves=self.serves,
            own_load=lambda: self.load,
            nursery=nursery,
            timeout_s=self.config.request_timeout_s or ttl,
            watch_ttl_s=ttl,
            reopen=self._take_entry,
            placements=self._placements,
        )
        gateway.route_through(router)
        nursery.start_soon(self._serve_host, gateway, self._desk)

    async def _serve_host(self, gateway: Gateway, desk: OwnerDesk) -> None:
        """Take the sessions other gateways place here, and tell them so only once a placed
        ``session.create`` is answered at once: this host's subject is served (confirmed by
        the server) and its provider's library loaded. Until then placement passes this
        host by, instead of waiting for it and giving up."""
        assert self._registry is not None
        try:
            await gateway.load_provider()
        except ConfigurationError as exc:
            log(f"host {self.host_id} takes no sessions placed by other hosts: {exc}")
            return
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    functools.partial(self._requests.serve_host, self.host_id, desk.for_host)
                )
                self._placeable = True
                with contextlib.suppress(ClusterUnavailable):  # announced again at the tick
                    await self._registry.announce(self._record())
                log(f"host {self.host_id} takes sessions placed by other hosts")
        except ClusterError as exc:
            log(f"cannot take sessions placed on host {self.host_id}: {exc}")
        finally:
            self._placeable = False

    def _load_changed(self) -> None:
        if self._registry is not None:
            self._registry.changed()

    def _record(self) -> HostRecord:
        # A draining host's load falls as it hands its sessions over: announced as it is,
        # it would be the least loaded, given new sessions it refuses and orphans it
        # never takes (its scan has stopped).
        draining = self._host is not None and self._host.draining
        return HostRecord(
            host_id=self.host_id,
            load=self.load,
            gateway=self.config.gateway,
            placeable=self._placeable and not draining,
            draining=draining,
        )

    # -- adoption and loss ----------------------------------------------------------------

    async def _adopt(self, session_id: str) -> None:
        assert self._keeper is not None and self._traces is not None and self.store is not None
        if session_id in self._stream_scopes:
            # Opened again while its close was released: still owned and replicated here.
            self._entries.announce(session_id)
            return
        try:
            ownership = await self._keeper.claim(session_id)
            if ownership is None:
                log(f"session {session_id} is owned by another host; closing it here")
                self._give_up(session_id)
                return
            writer = await self._traces.fence(session_id, self.host_id)
            # In the directory before any of its records is in the cluster: the orphan
            # scan finds sessions there, so a host lost after its first record (a task's
            # prompt, its task_start) never leaves a trace that no host takes over.
            await self._entries.publish(session_id)
        except ClusterError as exc:
            log(f"cannot adopt session {session_id}: {exc}")
            await self._abandon(session_id)
            return
        if not (self._keeper.holds(ownership) and self.store.log.replicated(session_id)):
            # Lost (and given up) or deleted meanwhile: streaming it now would replicate a
            # session this host no longer owns, or has no more (its lane forgets it next).
            log(f"session {session_id} was lost or deleted while this host adopted it")
            return
        self._start_stream(session_id, writer)
        # Again from the update queue: the principals the gateway grants it after this.
        self._entries.announce(session_id)

    def _start_stream(self, session_id: str, writer: TraceWriter) -> None:
        assert self._streams is not None and self.store is not None
        scope = self._stream_scopes[session_id] = trio.CancelScope()
        serve = functools.partial(self._serve_requests, session_id)
        self._streams.start_soon(_stream, scope, self.store.log, session_id, writer, serve)

    async def _serve_requests(self, session_id: str) -> None:
        """Answer the calls other gateways forward for ``session_id`` while this host owns
        it (once a gateway is bound: a host without one answers none)."""
        await self._desk_ready.wait()
        assert self._desk is not None
        handler = self._calls.counted(session_id, self._desk.for_session(session_id))
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(self._requests.serve, session_id, handler))
                self._serving.setdefault(session_id, trio.Event()).set()
        except ClusterError as exc:
            log(f"cannot answer other gateways for session {session_id}: {exc}")

    async def _abandon(self, session_id: str) -> None:
        # NATS failed it half-way: its claim goes too, so that the next scan finds it
        # (here or on another host) instead of this host owning a session it closed.
        self._give_up(session_id)
        if self._keeper is not None and self._finder is not None:
            await self._keeper.release(session_id)
            self._finder.suspect()

    def _on_lost(self, session_id: str, reason: str) -> None:
        log(
            f"host {self.host_id} lost the lease of session {session_id} ({reason}); "
            "stopping it here"
        )
        self._give_up(session_id)

    def _on_closed(self, session_id: str) -> None:
        """The host closed ``session_id`` leaving no work: it leaves this host's load at
        once, and the cluster's hands once its trace is in JetStream (the module
        docstring; :func:`_release_closed`, in its lane: after its adoption)."""
        if session_id not in self._adopted or self._work is None or self.store is None:
            return  # given up already
        assert self._keeper is not None
        parts = (self.store.log, self._stop_closed, self._entries, self._keeper, self._adopted)
        release = functools.partial(_release_closed, session_id, *parts, self._calls)
        try:
            self._lanes.start_soon(self._work, session_id, release)
        except RuntimeError:  # shutting down: released with the host's lease
            return
        self._adopted.discard(session_id)
        self._load_changed()

    def _stop_closed(self, session_id: str) -> bool:
        """Stop streaming and serving ``session_id``, closed here; False when it was opened
        again (it stays this host's) or given up meanwhile."""
        scope = None if session_id in self._adopted else self._stream_scopes.pop(session_id, None)
        if scope is not None:
            scope.cancel()
            self._serving.pop(session_id, None)
        return scope is not None

    def _on_deleted(self, session_id: str) -> None:
        released = session_id not in self._adopted  # claimed first: see _forget
        self._adopted.discard(session_id)
        self._load_changed()
        self._serving.pop(session_id, None)
        _stop_stream(self._stream_scopes, session_id)
        if self._work is not None and self._directory is not None:
            assert self._traces is not None and self._keeper is not None
            parts = (self._entries, self._traces, self._keeper)
            forget = functools.partial(_forget, *parts, session_id, claim=released)
            with contextlib.suppress(RuntimeError):  # shutting down
                self._lanes.start_soon(self._work, session_id, forget)

    def _on_fenced(self, session_id: str) -> None:
        log(_stopping(session_id, self.store.log.error(session_id) if self.store else None))
        if self._work is None:
            self._give_up(session_id)
            return
        # Its claim goes too (a no-op when another host holds it): a fence written while
        # the claim is still this host's (by a host that lost its own claim before taking
        # the session up) would otherwise leave the session owned here and served
        # nowhere, and no scan would ever take it over.
        try:
            self._work.start_soon(self._abandon, session_id)
        except RuntimeError:  # shutting down
            self._give_up(session_id)

    def _give_up(self, session_id: str) -> None:
        """Stop replicating (nothing more reaches the cluster's trace), then close it here."""
        if self.store is not None:
            self.store.log.forget(session_id)
        _stop_stream(self._stream_scopes, session_id)
        self._adopted.discard(session_id)
        self._load_changed()
        self._serving.pop(session_id, None)
        if self._work is not None and self._host is not None:
            # During shutdown the work nursery is closed: the host closes the session.
            with contextlib.suppress(RuntimeError):
                self._work.start_soon(_close_quietly, self._host, session_id)

    # -- takeover -------------------------------------------------------------------------

    async def _take_entry(self, session_id: str, entry: dict[str, Any]) -> bool:
        """Take ``session_id`` over from ``entry`` (:meth:`_take_entries`)."""
        return session_id in await self._take_entries({session_id: entry})

    async def _take_entries(self, entries: dict[str, dict[str, Any]]) -> list[str]:
        """Take ``entries`` (id → directory entry) over, their tasks up together: served ids.
        One made for a placement its gateway withdrew is deleted instead (:mod:`.placements`)."""
        assert self._host is not None and self._traces is not None and self._keeper is not None
        served, loaded = [], []
        for session_id, entry in entries.items():
            if await _lane_done(self._lanes, self._work, session_id, self.serves):
                served.append(session_id)
            elif await withdrawn(self._placements, session_id, entry):
                await _delete_withdrawn(
                    self._host, self._entries, self._traces, self._keeper, session_id
                )
            elif await self._load_over(session_id, entry.get("meta") or {}):
                loaded.append(session_id)
        served += _take_up(self._host, self._entries, loaded, self._approve)
        _grant(self._entries, entries, served, self.host_id)
        return served

    async def _take_handed(self, session_id: str, with_ids: list[str]) -> bool:
        """A draining host handed ``session_id`` over (R-DRAIN-2): :func:`take_handed`."""
        assert self._directory is not None and self._host is not None
        handed = [session_id, *with_ids]
        return await take_handed(self._directory, self._host, self._take_entries, handed)

    async def hand_over(self, session_id: str) -> None:
        """Hand a held (or parked) session and its tree to another host (R-DRAIN-2)."""
        assert self._registry is not None and self._keeper is not None and self._host is not None
        self._load_changed()  # announced as draining now, not at the next tick
        tree = await gather_tree(self._host, session_id, self._adopted, self._gathering)
        if tree:  # else not this host's, or handed with the tree another call gathers
            parts = (self._registry, self._keeper, self._requests, self._give_up)
            ttl = self.config.lease_ttl_s
            await hand_over(tree[0], self.host_id, *parts, ttl, self._handed, with_ids=tree[1:])

    async def take_over(self, session_id: str, meta: dict[str, Any]) -> bool:
        """Claim ``session_id``, rebuild it from its trace and take up its open task (see
        the module docstring). False when another host claimed it first, this host drains
        or it could not be rebuilt."""
        loaded = await self._load_over(session_id, meta)
        assert self._host is not None
        return loaded and _take_up(self._host, self._entries, [session_id], self._approve) != []

    async def _load_over(self, session_id: str, meta: dict[str, Any]) -> bool:
        """:meth:`take_over` up to the load of the session, its task not taken up yet."""
        assert self._keeper is not None
        assert self._traces is not None and self._host is not None
        try:
            ownership = await self._keeper.claim(session_id)
            if ownership is None:
                return False
            if self._host.draining:
                # A draining host takes nothing over (R-DRAIN-2). An orphan scan that
                # began before the drain would take the very sessions the drain hands over
                # (given up and released here, so orphans for a moment): the hand-over's
                # target then found them claimed, and they waited for this host to stop.
                await self._keeper.release(session_id)
                return False
            writer = await self._traces.fence(session_id, self.host_id)
            read = await self._traces.read(session_id)
        except ClusterError as exc:
            log(f"cannot take session {session_id} over: {exc}")
            await self._abandon(session_id)
            return False
        log(f"host {self.host_id} takes session {session_id} over")
        directory = SessionStore(self._host.data_dir).session_dir(session_id)
        # From here on a gateway that loads the session (a client asking for it) gets the
        # one this takeover rebuilds: no second adoption.
        self._taking_over.add(session_id)
        try:
            await trio.to_thread.run_sync(_materialize, directory, meta, read)
            if not self._keeper.holds(ownership):
                # Lost meanwhile (the host's lease): taken up now, it would run unowned.
                log(f"session {session_id} was lost while this host took it over")
                return False
            assert self.store is not None
            # Replicated before it is taken up: the host-lost results and everything the
            # task writes from here on reach the cluster's trace, fenced by this host.
            self.store.log.replicate(session_id)
            self._start_stream(session_id, writer)
            provider = self._provider() if self._provider is not None else None
            await self._host.load_session(session_id, tools=self._tools, provider=provider)
        except Exception as exc:
            log(f"cannot load session {session_id}: {exc}")
            self._give_up(session_id)
            return False
        finally:
            self._taking_over.discard(session_id)
        return True

    async def release_all(self) -> None:
        """Give every session up (a clean shutdown: others need not wait for the TTL)."""
        if self._keeper is None:
            return
        if self._registry is not None:
            # Gone from the registry at once: no host hands it a session meanwhile.
            with contextlib.suppress(ClusterUnavailable):
                await self._registry.withdraw(self.host_id)
        with contextlib.suppress(ClusterUnavailable):  # then they go with the TTL
            await self._keeper.release_all()


def _link_tree(
    reports: ChildReports, link: ParentLink, config: ClusterConfig, reach: ReachParts
) -> None:
    """Link the host's trees to the cluster's (R-TREE-4): a taken-up child's answer goes
    through ``link`` to a parent another host owns (offered again within half a TTL), and
    a tree interrupt reaches the nodes of the tree that this host does not run (through
    ``reach``, waiting for other hosts as long as for a forwarded call)."""
    ttl_s = config.lease_ttl_s
    reports.link = link.send
    reports.retry_s = ttl_s / 2
    timeout_s = config.request_timeout_s or ttl_s
    reports.stored_below = TreeReach(reach, host_id=config.host_id, timeout_s=timeout_s).below


def _take_up(
    host: Host, entries: DirectoryEntries, session_ids: list[str], approve: Approval
) -> list[str]:
    """Take up the open tasks of ``session_ids``, taken over and loaded in ``host``,
    together; the ids of those still open there. All loaded before any is taken up, as a
    restarted host takes its own up: a subagent's task takes its first step knowing its
    background children that run again here (R-TREE-2, R-TREE-4)."""
    # The path a restarted host takes (R-HITL-4): one way to take a task up, so a
    # takeover neither re-runs a call nor denies a pending approval.
    taken = take_up_loaded(host, session_ids, approve).open
    for session_id in taken:
        # The task goes on without a task_start of its own: the directory learns here
        # that it runs.
        entries.running[session_id] = host.get_session(session_id).busy
        entries.announce(session_id)
    return taken


def _grant(
    entries: DirectoryEntries, taken: dict[str, dict[str, Any]], served: list[str], host_id: str
) -> None:
    """Grant each session of ``served`` to the principals its directory entry in ``taken``
    names, once rebuilt here (a request loads none here meanwhile)."""
    for session_id in served:
        for principal in taken[session_id].get("principals") or ():
            if entries.grants is not None and isinstance(principal, str):
                entries.grants.grant(principal, session_id)
        log(f"host {host_id} serves session {session_id} now")


async def _until_serving(serving: dict[str, trio.Event], session_id: str) -> None:
    """Return once this host answers ``session_id``'s requests (``serving`` sets its
    event then)."""
    await serving.setdefault(session_id, trio.Event()).wait()


def _stopping(session_id: str, error: Exception | None) -> str:
    """The log line of a session whose trace cannot go on from this host (``error``: the
    store's reason)."""
    if isinstance(error, UnreplicableRecord):
        return f"session {session_id} stops here: {error.message}"
    return f"the trace of session {session_id} was fenced by another host; stopping it here"


async def _stream(
    scope: trio.CancelScope,
    log: ReplicatingTraceLog,
    session_id: str,
    writer: TraceWriter,
    serve: Callable[[], Awaitable[None]],
) -> None:
    """Append ``session_id``'s records to the cluster's trace and answer its forwarded
    calls (``serve``) until ``scope`` is cancelled. Nothing when the session stopped being
    replicated between the stream's start and this task's first step (deleted or given up
    meanwhile): ``stream_to`` would replicate it again, and it stayed replicated here."""
    with scope:
        if not log.replicated(session_id):
            return
        async with trio.open_nursery() as both:
            both.start_soon(serve)
            await log.stream_to(session_id, writer)
            both.cancel_scope.cancel()


def _stop_stream(scopes: dict[str, trio.CancelScope], session_id: str) -> None:
    """Stop ``session_id``'s trace stream and request server, when it has them here."""
    scope = scopes.pop(session_id, None)
    if scope is not None:
        scope.cancel()


async def _lane_done(
    lanes: SessionLanes,
    nursery: trio.Nursery | None,
    session_id: str,
    serves: Callable[[str], bool],
) -> bool:
    """Wait until the work queued in ``session_id``'s lane before this call is done; then
    whether this host runs the session (``serves``: opened here again meanwhile, nothing
    to take over). A session this host closed is released in its lane, its entry closed
    first: a call that reads that entry reopens it (:meth:`ClusterNode._take_entry`) —
    on this host too — and a takeover beside the release would fence the release's own
    stream, and have its claim released under it."""
    if nursery is not None and lanes.has(session_id):
        done = trio.Event()

        async def mark() -> None:
            done.set()

        with contextlib.suppress(RuntimeError):  # shutting down: nothing waits
            lanes.start_soon(nursery, session_id, mark)
            await done.wait()
    return serves(session_id)


def _answers(serves: Callable[[str], bool], lanes: SessionLanes, session_id: str) -> bool:
    """Whether this host answers the calls forwarded for ``session_id``: it runs it, or it
    closed it and its release is under way. Such a call opens it here again (adopted after
    the release, in its lane, or kept if the release has not stopped it yet), as a call
    on a closed session opens it where it arrives; before, it was told to try again while
    no host ran the session."""
    return serves(session_id) or lanes.has(session_id)


async def _release_closed(
    session_id: str,
    log: ReplicatingTraceLog,
    stop: Callable[[str], bool],
    entries: DirectoryEntries,
    keeper: OwnershipKeeper,
    adopted: set[str],
    calls: CallsInFlight,
) -> None:
    """A session closed here leaves the cluster's hands once JetStream holds its every
    record: its directory entry closed, then no longer replicated (``stop``: nor streamed
    or served), then its claim released — never an orphan for the scan to take over.

    The entry is closed while this host still answers the session's calls: a gateway that
    reads it opens the session where its call arrives, one that read it before reaches
    this host, which opens it here again (:func:`_answers`). Stopped first, the session
    was served by no host and named by an entry that was not closed yet, and a call then
    was told to try again. ``stop`` waits for the calls forwarded here that are under way
    (``calls``: bounded), and those that come meanwhile wait for the release's end
    (:mod:`.in_flight`): stopped under it, a call opening the session here again was cut
    short, in doubt. Opened here again before ``stop``, it stays this host's: its
    adoption, next in its lane, announces its entry open again."""
    # Not replicated any more (fenced, given up), or opened again: nothing to release.
    if not await log.settled(session_id) or session_id in adopted:
        return
    await entries.close(session_id)
    async with calls.releasing(session_id) as release:
        release.left = stop(session_id)
        if release.left:
            log.stop(session_id)
            await keeper.release(session_id)


async def _forget(
    entries: DirectoryEntries,
    traces: TraceStream,
    keeper: OwnershipKeeper,
    session_id: str,
    *,
    claim: bool = False,
) -> None:
    """A deleted session leaves the cluster: metadata, trace and owner entry. ``claim`` (a
    session released when it was closed here): unless another host opened it since."""
    try:
        if claim and await keeper.claim(session_id) is None:
            log(f"session {session_id} is open on another host: deleted on this host only")
            return
        await entries.remove(session_id)  # after an update in flight, never under it
        await traces.purge(session_id)
    except ClusterUnavailable as exc:
        log(f"cannot remove session {session_id} from the cluster: {exc}")
    await keeper.release(session_id)


async def _delete_withdrawn(
    host: Host,
    entries: DirectoryEntries,
    traces: TraceStream,
    keeper: OwnershipKeeper,
    session_id: str,
) -> None:
    """Delete ``session_id``, made for a placement its gateway withdrew, from the cluster
    and from this host's data dir when it holds a copy (the host it was placed on,
    started again on its data dir, takes it up)."""
    await _forget(entries, traces, keeper, session_id, claim=True)
    await delete_copy(host, session_id, "its placement was withdrawn")


async def _close_quietly(host: Host, session_id: str) -> None:
    try:
        await host.close_session(session_id)
    except Exception as exc:
        log(f"closing session {session_id} failed: {exc}")


def _materialize(directory: Path, meta: dict[str, Any], read: TraceRead) -> None:
    """Write the session's ``session.json`` and trace files as the trace stream has them
    (replacing what this host may have kept from an earlier ownership)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for old in [*directory.glob("trace_*.jsonl"), directory / "session.json"]:
        old.unlink(missing_ok=True)
    for number, records in read.files:
        _write_private(
            directory / trace_file_name(number), "".join(encode_record(r) for r in records)
        )
    # Last: a session without session.json does not exist for a loader, so nobody loads
    # it half written.
    if meta:
        _write_private(directory / "session.json", json.dumps(meta, indent=2) + "\n")


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.asynccontextmanager
async def open_cluster_host(
    bridge: Bridge,
    config: ClusterConfig,
    data_dir: Path,
    *,
    observers: Iterable[SessionObserver] = (),
    tools: Iterable[Tool] = (),
    mcp_servers: Mapping[str, Any] | None = None,
    approve: Approval = PEOPLE,
    provider: Callable[[], ModelProvider] | None = None,
    on_node: Callable[[ClusterNode], None] | None = None,
    prices: Mapping[str, Any] | None = None,
    principal_budget: PrincipalBudget | None = None,
    limits: ProviderLimits | None = None,
    on_limits: Callable[[ClusterLimits], None] | None = None,
) -> AsyncIterator[Host]:
    """A :class:`Host` on ``data_dir`` that is one host of the cluster at ``config.url``;
    ``tools`` and ``mcp_servers`` are those of the sessions it loads on its own (takeovers,
    a parent loaded for its subagent's answer: ``Host.open``), ``approve`` decides the calls
    of the tasks it takes over and of the sessions it loads on its own. Raises
    :class:`ClusterUnavailable` when NATS cannot be
    reached. On exit the host closes as in single-host mode (its last records reach the
    cluster's trace) and its sessions are released (its lease dropped). ``limits`` (the
    host's ``Host.open(limits=…)``) and the limits learned from 429s hold for every host of
    the cluster together, per endpoint and credential, and ``principal_budget`` over every
    host's spending (:mod:`.limits`; give every host the same). ``on_limits`` is called
    with them before the host opens. Its ``list_sessions`` lists its own sessions, not a
    copy of one another host runs now or the cluster deleted (:func:`.listing.stale_copies`)."""
    names = ClusterNames(prefix=config.prefix)
    conn = await connect(bridge, config.url, name=f"greenroom-{config.host_id}", names=names)
    try:
        # The host's lease alone: its renewals never queue behind the sessions' traffic.
        lease_conn = await connect(
            bridge, config.url, name=f"greenroom-{config.host_id}-lease", names=names
        )
    except ClusterUnavailable:
        with trio.CancelScope(shield=True):
            await conn.aclose()
        raise
    tool_list = tuple(tools)
    node = ClusterNode(
        conn, config, tools=tool_list, approve=approve, provider=provider, lease_conn=lease_conn
    )
    if on_node is not None:
        on_node(node)
    shared = ClusterLimits(conn, config.host_id, lease_ttl_s=config.lease_ttl_s)
    if on_limits is not None:
        on_limits(shared)
    try:
        async with trio.open_nursery() as streams:
            await streams.start(shared.run)
            async with (
                Host.open(
                    data_dir,
                    observers=(*observers, node.observe),
                    trace_store=node.make_store,
                    tools=tool_list,
                    mcp_servers=mcp_servers,
                    approve=approve,
                    prices=prices,
                    principal_budget=principal_budget,
                    limits=limits,
                    shared=shared,
                ) as host,
                trio.open_nursery() as nursery,
            ):
                await nursery.start(node.run, host, streams)
                passes = DirectoryPasses(await SessionDirectory.open(conn))
                host.stale_copies = functools.partial(
                    stale_copies,
                    passes,
                    bound_s=config.lease_ttl_s,
                    host_id=config.host_id,
                    serves=node.serves,
                )
                try:
                    yield host
                finally:
                    nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True), trio.move_on_after(config.lease_ttl_s):
                await node.release_all()
                await shared.aclose()
            streams.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await lease_conn.aclose()
            await conn.aclose()
