"""A tree across hosts (R-TREE-1, R-TREE-4): the outputs of a subagent that runs on
another host than its parent reach the parent's watchers all the same.

On one host a subagent's outputs go up to its parent as they are published
(:func:`~greenroom.actors.runtime.tree.forward_up`). A subagent that runs elsewhere — taken
over after a host loss by another host than its parent's, or spawned there by a subagent
that runs there — has no parent on its host. So:

* **Its host tells.** A host that opens a subagent (creates it, loads it, takes it over)
  sends :data:`~.router.RUNNING_METHOD` to the owner of each of its ancestors that this
  host does not run, with its ``origin`` and the ``seq`` of its last record when it was
  opened here (:meth:`RemoteChildren.opened`). Sent once and not offered again: what it
  leads to is live outputs, not input. So an ancestor with no owner then, or opened on
  another host later while the subagent runs on, relays nothing of it.
* **An ancestor's host relays** to that ancestor when the next node below it on the
  subagent's path is not open there (else that node's outputs go up there already, the
  subagent's among them or relayed to it). It follows the subagent's trace in JetStream
  from that record on (:meth:`~.traces.TraceStream.follow`: in order, no gap, no
  duplicate, whichever host writes it) and hands each record to the ancestor as a local
  child's outputs, with the subagent's ``origin``
  (:func:`~greenroom.actors.runtime.tree.hand_up`): into its run while it has a task,
  else to its watchers. One relay a subagent and ancestor, whatever hosts the subagent
  moves between.
* **It stops** after the subagent's own ``task_end``, when the ancestor closes, or when
  the subagent comes to the ancestor's host: then its own forwarder takes its outputs up
  from its load on, and the relay hands up only the records before it, so no record
  reaches the ancestor twice. It never blocks the ancestor: handing up never waits.

Only traced records cross: a remote subagent's partial outputs (its streaming text and
tool calls) stay on its host. A relay's failure (NATS out of reach) is logged; the
ancestor's work goes on without the subagent's live outputs, and its answer still comes
(:mod:`.tree_link`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import nats.errors
import trio

from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.router import RUNNING_METHOD
from greenroom.actors.cluster.routing import SessionRequests
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.tree import hand_up
from greenroom.protocols.outputs import Output, TaskEnd

__all__ = ["RemoteChildren"]

_INVALID_PARAMS = -32602


class RemoteChildren:
    """One host's side of both ends (see the module docstring). ``serves`` says whether
    this host runs a session; ``warn`` hears of a relay that failed. :meth:`bind` once
    the host runs, before :meth:`opened` and :meth:`take`."""

    __slots__ = (
        "_came_here",
        "_host",
        "_nursery",
        "_relayed",
        "_requests",
        "_serves",
        "_traces",
        "_warn",
    )

    def __init__(
        self,
        requests: SessionRequests,
        serves: Callable[[str], bool],
        warn: Callable[[str], None],
    ) -> None:
        self._requests = requests
        self._serves = serves
        self._warn = warn
        self._host: Host | None = None
        self._traces: TraceStream | None = None
        self._nursery: trio.Nursery | None = None
        self._relayed: dict[str, set[str]] = {}
        """Subagent id → the ancestors this host relays its records to."""
        self._came_here: dict[str, int] = {}
        """Relayed subagent id → the ``seq`` of its last record when it was opened on this
        host: its own forwarder takes the later ones up."""

    def bind(self, host: Host, traces: TraceStream, nursery: trio.Nursery) -> None:
        """Relay into ``host``'s sessions, from ``traces``, in tasks of ``nursery``."""
        self._host, self._traces, self._nursery = host, traces, nursery

    def opened(self, session: Session) -> None:
        """``session`` opened on this host: tell the owner of each of its ancestors that
        runs elsewhere; a relay of it here stops after its last record now."""
        if self._host is None or self._nursery is None:
            return
        try:
            last_seq = self._host.port(session.id).last_seq
        except SessionNotFound:
            return
        if session.id in self._relayed:
            self._came_here[session.id] = last_seq
        origin = session.origin
        params = {"child_id": session.id, "origin": list(origin), "after_seq": last_seq}
        message = {"method": RUNNING_METHOD, "params": params, "principal": ""}
        for ancestor in origin[:-1]:
            if not self._serves(ancestor):
                with contextlib.suppress(RuntimeError):  # shutting down
                    self._nursery.start_soon(self._tell, ancestor, message)

    async def _tell(self, ancestor: str, message: dict[str, Any]) -> None:
        # No owner (closed, or lost and not taken over yet): no watchers to relay to.
        with contextlib.suppress(ClusterError):
            await self._requests.request(ancestor, message)

    def take(self, session_id: str, params: dict[str, Any]) -> dict[str, Any]:
        """The ancestor's side of :meth:`opened`: relay the subagent ``params`` names to
        ``session_id``, open here, when the next node below ``session_id`` on the
        subagent's path runs elsewhere (else that node's own outputs go up here: the
        subagent's reach ``session_id`` through it, or through its own relay), unless it
        is relayed to ``session_id`` already."""
        child_id, origin, after = (params.get(k) for k in ("child_id", "origin", "after_seq"))
        if (
            not isinstance(child_id, str)
            or not isinstance(origin, list)
            or not all(isinstance(i, str) for i in origin)
            or origin[-1:] != [child_id]
            or session_id not in origin[:-1]
            or not isinstance(after, int)
            or isinstance(after, bool)
        ):
            message = "a running subagent needs child_id, its origin and after_seq"
            return {"error": {"code": _INVALID_PARAMS, "message": message}}
        if self._nursery is None:
            return {"result": {}}  # not running yet: nothing is open here
        below = origin[origin.index(session_id) + 1]
        ancestors = self._relayed.setdefault(child_id, set())
        if session_id not in ancestors and not self._open(below):
            ancestors.add(session_id)
            relay = functools.partial(self._relay, session_id, child_id, tuple(origin), after)
            self._nursery.start_soon(relay)
        elif not ancestors:
            del self._relayed[child_id]
        return {"result": {}}

    async def _relay(
        self, ancestor_id: str, child_id: str, origin: tuple[str, ...], after_seq: int
    ) -> None:
        assert self._traces is not None and self._host is not None
        try:
            ancestor = self._host.port(ancestor_id)
            # Nothing is ever sent on it (no output is of no kind): it ends when the
            # ancestor closes, and the relay with it.
            send, closing = trio.open_memory_channel[list[Output]](1)
            end_watch = ancestor.watch(send, kinds=())
            # Not a nursery of its own: a NATS failure reaches the handler below as it
            # is, not in an exception group.
            relaying = trio.CancelScope()
            assert self._nursery is not None
            self._nursery.start_soon(_cancel_at_end, closing, relaying)
            try:
                with relaying:
                    async with self._traces.follow(child_id, after_seq=after_seq) as records:
                        async for record in records:
                            if not self._hand_up(ancestor, child_id, origin, record):
                                break
            finally:
                end_watch()  # which ends _cancel_at_end too
        except SessionNotFound:
            return  # closed before its relay began
        except (ClusterError, nats.errors.Error) as exc:
            self._warn(f"cannot relay the outputs of subagent {child_id}: {exc}")
        finally:
            ancestors = self._relayed.get(child_id, set())
            ancestors.discard(ancestor_id)
            if not ancestors:
                self._relayed.pop(child_id, None)
                self._came_here.pop(child_id, None)

    def _hand_up(
        self, ancestor: SessionPort, child_id: str, origin: tuple[str, ...], record: Output
    ) -> bool:
        """Hand ``record`` up; whether the relay goes on."""
        came_here = self._came_here.get(child_id)
        if came_here is not None and (record.seq or 0) > came_here:
            return False
        if came_here is None and self._open(child_id):
            return False  # opened here unseen: its own forwarder has its records
        if ancestor.closed:
            return False
        hand_up(ancestor, origin, [record])
        return not (isinstance(record, TaskEnd) and record.origin is None)

    def _open(self, session_id: str) -> bool:
        assert self._host is not None
        try:
            self._host.port(session_id)
        except SessionNotFound:
            return False
        return True


async def _cancel_at_end(
    channel: trio.MemoryReceiveChannel[list[Output]], scope: trio.CancelScope
) -> None:
    async for _ in channel:
        pass
    scope.cancel()
