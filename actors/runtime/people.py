"""The host's side of people in the loop (R-HITL): the timeout clock, what is pending, and
an answer delivered to the task that waits for it.

:class:`People` belongs to a host. It runs the desk
(:class:`~greenroom.actors.runtime.people_desk.PeopleDesk`) and, when a request's wait
runs out, resolves it by the session's
``approval_timeout_action`` — ``deny`` answers it with a deny by ``default``, ``abort``
interrupts the task (scope ``node``: its background subagents run on) — if it is still
pending. :func:`pending_of` lists a session's waiting
requests and :attr:`People.stored` those of stored sessions, read from their traces
without loading them (each trace again only once it changed); :func:`answer` hands a
person's answer to the session's work (waking a parked task: R-HITL-3) and returns once it
is taken, or raises :class:`NotPending` (a question whose call no longer waits for it too)
— or :class:`InputTooLarge` for answer text larger
than one record of the session's trace carries (a cluster's NATS server): the text is the
call's result, recorded whole, and such a record stopped the session on its host
(R-SEC-9, R-CLUSTER-1).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable

import attrs
import trio

from greenroom.actors.runtime.accounting import stored_origin
from greenroom.actors.runtime.errors import InputTooLarge, NotPending
from greenroom.actors.runtime.people_desk import PeopleDesk, WatchRequest
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.tool_pool import question_waits
from greenroom.actors.runtime.trace_store import (
    FileTraceLog,
    StoredSessionMissing,
    StoredSessionUnreadable,
    TraceLog,
    TraceStore,
)
from greenroom.protocols.content import TextBlock
from greenroom.protocols.messages import InterruptTask, PersonAnswered
from greenroom.protocols.outputs import PeopleKind
from greenroom.protocols.people import PendingApproval, arguments_digest, waiting_requests
from greenroom.protocols.task import fold
from greenroom.protocols.trace import input_size

__all__ = ["People", "StoredPending", "answer", "pending_of"]


class People:
    """A host's clock for waiting requests; ``port_of`` finds an open session's port
    (None when the session is not open: its requests wait in its trace until it is
    loaded again, which watches them anew)."""

    __slots__ = ("_desk", "_port_of", "stored")

    def __init__(self, port_of: Callable[[str], SessionPort | None]) -> None:
        self._port_of = port_of
        self._desk: trio.MemorySendChannel[WatchRequest] | None = None
        self.stored = StoredPending()
        """The requests waiting in the host's stored sessions (``pending_approvals``)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the desk until :meth:`close` (or cancellation)."""
        # Unbounded: sessions register their waits with send_nowait from their own tasks
        # and must never block; the desk takes each at once into its heap.
        self._desk, inbox = trio.open_memory_channel[WatchRequest](math.inf)
        async with trio.open_nursery() as nursery:
            await nursery.start(PeopleDesk(self._expire).run, inbox)
            task_status.started()

    def close(self) -> None:
        """Stop the desk: nothing expires any more (the host is closing)."""
        if self._desk is not None:
            self._desk.close()

    def watch(self, port: SessionPort, call_id: str, asked_at: float | None) -> None:
        """Hold ``call_id``'s wait to ``port``'s timeout policy, counted from
        ``asked_at`` (now when None)."""
        timeout = port.settings.approval_timeout_s
        if timeout is None or self._desk is None:
            return
        since = time.time() - (asked_at if asked_at is not None else time.time())
        deadline = trio.current_time() + max(0.0, timeout - max(0.0, since))
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            self._desk.send_nowait(
                WatchRequest(
                    session_id=port.id, call_id=call_id, deadline=deadline, asked_at=asked_at
                )
            )

    def watch_pending(self, port: SessionPort) -> None:
        """Hold each request ``port``'s record leaves pending (a session loaded) to its
        timeout policy, counted from when it was asked: one whose time ran out while the
        session was closed is decided now."""
        for request in port.machine.record.pending_people:
            self.watch(port, request.call_id, request.asked_at)

    def _expire(self, watched: WatchRequest) -> None:
        port = self._port_of(watched.session_id)
        if port is None:
            return
        call_id = watched.call_id
        request = port.machine.record.pending(call_id)
        if request is None:
            return
        if watched.asked_at is not None and request.asked_at != watched.asked_at:
            return  # answered, and the call asked again since: that wait has its own
        settings = port.settings
        if settings.approval_timeout_action == "abort":
            # The limit is that task's: it ends with its foreground children, as an
            # interrupt of scope node ends it; its background subagents, with requests and
            # limits of their own, run on and answer it as follow-ups (R-HITL-1, R-TREE-2).
            port.deliver(
                InterruptTask(
                    reason=f"nobody answered the request about {request.tool} "
                    f"(call {call_id}) within {settings.approval_timeout_s:g} s",
                    scope="node",
                )
            )
        else:
            port.deliver(PersonAnswered(call_id=call_id, by="default"))


def pending_of(port: SessionPort) -> list[PendingApproval]:
    """The requests of ``port``'s open task that wait for a person
    (:func:`~greenroom.protocols.people.waiting_requests`), less a question whose call no
    longer waits for its answer here (R-HITL-5: whoever asked, once its host stopped)."""
    record = port.machine.record
    waiting = waiting_requests(
        record.pending_people,
        record.allowed,
        session_id=port.id,
        origin=port.origin_path,
        running=port.inbox is not None,
    )
    return [p for p in waiting if not _asker_gone(port, p.call_id, p.kind)]


def _asker_gone(port: SessionPort, call_id: str, kind: PeopleKind) -> bool:
    """Whether the request of ``call_id`` is a question its running call asked (``ctx.ask``:
    an MCP server's elicitation, a Python tool's, whichever session's servers) and that call
    no longer waits for the answer here: a supervisor that took the task up after a restart
    runs no call yet, and the call that asked went with the host that stopped (R-HITL-5).
    Nobody can answer it; the task's resumption settles the call as in doubt."""
    return (
        kind == "question"
        and call_id in port.machine.record.allowed
        and not question_waits(port.inbox, call_id)
    )


@attrs.frozen
class _Read:
    """What one stored session's trace file said when it was last read."""

    identity: tuple[str, int, int, int]
    """The file's path, inode, size and modification time (ns), taken before the read."""
    pending: tuple[PendingApproval, ...]


class StoredPending:
    """The requests that wait for a person in stored sessions, as :meth:`read` finds them.

    The gateway lists them on each request (approvals.list, an answer's look-up, AG-UI's
    interrupts), so each session's list is remembered with the identity of the trace file
    it came from (path, inode, size, modification time, taken before the read) and its
    trace is read again only when that changed: a record appended, a compaction's new
    file, a session stored anew. A store whose traces are not the files its log's
    ``location`` names is read every time, never remembered. Only the sessions of the last
    :meth:`read` are remembered (a session deleted, loaded or no longer waiting leaves)."""

    __slots__ = ("_read",)

    def __init__(self) -> None:
        self._read: dict[str, _Read] = {}

    def __len__(self) -> int:
        """How many sessions' lists are remembered."""
        return len(self._read)

    async def read(self, store: TraceStore, session_ids: Iterable[str]) -> list[PendingApproval]:
        """The requests that wait for a person in the stored sessions ``session_ids``, read
        from each one's latest trace as :func:`pending_of` would list them once loaded (with
        no supervisor running their calls). Reads only: nothing is loaded, taken up or
        written. A session gone or unreadable meanwhile lists nothing."""
        wanted = list(dict.fromkeys(session_ids))
        for gone in self._read.keys() - set(wanted):
            del self._read[gone]
        identities = await trio.to_thread.run_sync(_identities, store.log, wanted)
        found: list[PendingApproval] = []
        for session_id in wanted:
            identity = identities.get(session_id)
            known = self._read.get(session_id)
            if identity is not None and known is not None and known.identity == identity:
                found.extend(known.pending)
                continue
            self._read.pop(session_id, None)
            pending = await _stored_pending_of(store, session_id)
            if pending is None:
                continue  # deleted or broken since the index saw it: nothing of it waits
            if identity is not None:
                self._read[session_id] = _Read(identity=identity, pending=pending)
            found.extend(pending)
        return found


def _identities(log: TraceLog, session_ids: list[str]) -> dict[str, tuple[str, int, int, int]]:
    """The identity of each session's latest trace file (see :class:`StoredPending`); none
    for a session without one, and none at all for a log that does not read its traces
    from the files ``location`` names."""
    # The file log reads the file ``location`` names; a cluster host's log replicates
    # appends elsewhere but reads its file log's files, which it keeps as ``files``.
    if not isinstance(log, FileTraceLog) and not isinstance(
        getattr(log, "files", None), FileTraceLog
    ):
        return {}
    found: dict[str, tuple[str, int, int, int]] = {}
    for session_id in session_ids:
        try:
            path = log.location(session_id)
            stat = path.stat()
        except (OSError, KeyError):
            continue  # no trace file (yet): read, and not remembered
        found[session_id] = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return found


async def _stored_pending_of(
    store: TraceStore, session_id: str
) -> tuple[PendingApproval, ...] | None:
    """The requests waiting for a person in ``session_id``'s latest stored trace; None when
    it is gone or cannot be read."""
    try:
        meta = await store.catalog.read_meta(session_id)
        trace = await store.log.read_latest(session_id)
    except (StoredSessionMissing, StoredSessionUnreadable, OSError):
        return None
    record = fold(list(trace.records)).recorded()
    if record.run_id is None:
        return ()
    return tuple(
        waiting_requests(
            record.pending_people,
            record.allowed,
            session_id=session_id,
            origin=stored_origin(meta, session_id) or (session_id,),
            running=False,
        )
    )


async def answer(port: SessionPort, message: PersonAnswered) -> None:
    """Hand ``message`` to the work of ``port`` and wait until it is taken. Raises
    :class:`NotPending` when the call waits for no answer (or no longer), when the answer
    names other arguments than the call's, or when it is not of the request's kind;
    :class:`InputTooLarge` when its text is larger than one record of the trace carries
    (a person's input is refused, never cut: nothing is taken, the question waits)."""
    if message.verdict not in (None, "allow", "deny", "allow_session"):
        raise ValueError(f"decision must be allow, deny or allow_session, not {message.verdict!r}")
    request = port.machine.record.pending(message.call_id)
    if request is None:
        raise NotPending(
            f"call {message.call_id!r} of session {port.id} waits for no answer: it was "
            "answered, it timed out, or its task ended"
        )
    if _asker_gone(port, message.call_id, request.kind):
        raise NotPending(
            f"the question of call {message.call_id!r} of session {port.id} was asked by the "
            "running call, which no longer waits for its answer: the host that ran it "
            "stopped (the call is in doubt once its task resumes) or the call ended"
        )
    if message.digest is not None and message.digest != arguments_digest(request.arguments):
        raise NotPending(
            f"call {message.call_id!r} has other arguments than the ones that were shown"
        )
    most = port.host.trace_log.largest_input()
    if message.text is not None and most is not None:
        size = input_size((TextBlock(text=message.text),))
        if size > most:
            raise InputTooLarge(size, most)
    # One slot: the supervisor's one reply never waits for this reader.
    reply_send, reply = trio.open_memory_channel[str | None](1)
    if not port.deliver(attrs.evolve(message, reply=reply_send)):
        raise NotPending(f"session {port.id} has no task waiting for an answer")
    with reply:
        try:
            refused = await reply.receive()
        except trio.EndOfChannel:
            refused = f"session {port.id} ended before the answer was taken"
    if refused is not None:
        raise NotPending(refused)
