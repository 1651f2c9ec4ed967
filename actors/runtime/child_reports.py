"""A background subagent's answer when the run that spawned it is gone (R-TREE-2, R-TREE-4).

While the host run that spawned a background child runs it, the spawning side follows the
child and hands its answer to the parent (:mod:`~greenroom.actors.runtime.subagents`). A
child whose task is taken up by another run — a restarted host (R-HITL-4) or, in a cluster,
the host that took it over when its own was lost (R-TREE-4) — has no such follower:
:meth:`ChildReports.follow` gives it one. When the child's task ends, its answer (or why it
failed) goes to its parent as ``[subagent NAME finished] …``: to the parent open in this
host; else, in a cluster, to the parent's owner through :attr:`ChildReports.link` (tried
again while the parent has no owner yet, as during its own takeover, or its owner refuses
it for now: its host closes, the parent's work is ending); else to the parent loaded here.
Each wait before it is tried again doubles, from a share of :attr:`ChildReports.retry_s`
up to it, :data:`LINK_ATTEMPTS` times at most. The parent takes it as it takes a live
child's: steering of its open task, else a follow-up task. The answer is the task's last
text, as a live child's: what the task said before its host stopped (read from its trace:
it had answered and waited for its own children, or its end was not written yet) holds
until a new request replaces it.

A foreground child is not taken up: the call that ran it got its host-lost result with the
rest of its parent's task (R-CLUSTER-2), so its answer would reach nobody. Its task stays
open in its trace, recovered as interrupted when the session is next used (R-TRACE-4).

A report queued in its parent as a follow-up task is not recorded there while the parent
runs on (``task_queued``, R-STEER-6, is for a user's follow-ups): the child's trace is what
makes it durable, and a child whose task its host had not ended is taken up and reports
again; recorded in the parent too, it would be delivered twice. A parent whose host closes
before it ran a report it took records it then, queued (the child's task has ended: it
reports no more), so that the close does not lose it (the supervisor's ``_leave_answers``);
one whose task it has started (its prompt recorded) the close holds at the task's next turn
boundary, open in its trace for the next host (``TaskInput.report``, the supervisor's
``_close_holds``), instead of ending it.

While a taken-up child runs here — a supervisor runs it, or its task waits here for
people (parked) — its parent open here counts it among its running children
(:meth:`ChildReports.wake`, :meth:`ChildReports.loaded`), as before its host stopped: a
subagent's task holds for its answer (R-TREE-2), and the parent's tree interrupts reach
it (cut, it reports to nobody). A parked child of a subagent is waited for as a parked
child spawned in this process is: until a person answers it here, or its approval
timeout decides; a root's task does not wait for its background children, and its
parked one is not counted (closing the root leaves it pending for its answer).
A child whose session closes with its task open, or that is held for a drain's hand-over,
runs here no more: the parent's task stops waiting for it; its answer comes later all the
same (steering, or a follow-up task). One that nobody loads here is never waited for.

A report is sent once, when the child's taken-up task ends; the child then leaves the
host's open sessions as a live child does (in a cluster its host releases it, as it
releases any session it closes). A child whose task ended on the
lost host a moment before that host could send the report sends none: the answer is in
the child's trace (``session.children()`` finds it), not in the parent's input. So too
when the host closes before the report is taken (one line logged, no traceback): a
closing host starts no follow-up in a parent, as for a live child's answer — nor in one
whose load for it ends once the close has begun (the close no longer looks at it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from greenroom.actors.runtime.accounting import stored_origin, tree_usage
from greenroom.actors.runtime.errors import HostClosed, SessionClosed, SessionNotFound
from greenroom.actors.runtime.open_tasks import OpenTaskIndex
from greenroom.actors.runtime.port import Approval, SessionPort, TaskInput, left_unstarted
from greenroom.actors.runtime.subagents import (
    ChildWatch,
    SubagentError,
    answer_fitted,
    finished_text,
)
from greenroom.actors.runtime.supervisor import end_left_work, wake
from greenroom.actors.runtime.tree import (
    LiveChild,
    TakenUpWork,
    children_of,
    end_subtree,
    forget_finished,
    stopped_running,
    tell,
)
from greenroom.protocols.content import TextBlock
from greenroom.protocols.history import live_records
from greenroom.protocols.messages import InterruptTask, SubagentFinished, SupervisorMessage
from greenroom.protocols.outputs import Output

if TYPE_CHECKING:
    from greenroom.actors.runtime.host import Host

__all__ = ["ChildReports", "NodeElsewhere", "NodesBelow", "ParentLink", "StoredBelow", "StoredNode"]

logger = logging.getLogger(__name__)

ParentLink = Callable[[str, str, str], Awaitable[bool]]
"""Hands a report to the host that owns its parent, in a cluster: ``(parent_id, child_id,
text)`` → True once that host has taken it, False when no host owns the parent now or
its owner refuses it for now (the report is offered again later)."""

StoredNode = tuple[str, Callable[[], Awaitable[bool]]]
"""A stored node a tree interrupt ends (:meth:`ChildReports.end_unreached`): its id, and
what opens it in this host to be ended (False when it is not to be ended here: another
host took it meanwhile)."""

NodeElsewhere = tuple[str, Callable[[str], Awaitable[bool]]]
"""A node a tree interrupt ends that another host runs (in a cluster): its id, and what
asks that host to end it, given the reason (:meth:`ChildReports.end_here` there). That
returns once the node's end is written there: True when it had work to end; False when
it had none, or its host did not answer in time or refused (logged). Never raises."""


@attrs.frozen(kw_only=True)
class NodesBelow:
    """The nodes below a node that a tree interrupt of it ends, besides those open here
    (:data:`StoredBelow`), each list shallow first."""

    stored: list[StoredNode]
    """Those that no host runs, opened here to be ended."""
    elsewhere: list[NodeElsewhere] = attrs.field(factory=list)
    """Those that other hosts run, ended there."""


StoredBelow = Callable[[str], Awaitable[NodesBelow]]
"""Finds the nodes below a node (its id) that a tree interrupt of it ends besides those
open here: its background descendants that no host runs and whose task may be open, and
in a cluster those other hosts run. Raises
:class:`~greenroom.actors.runtime.errors.HostClosed` once the host is closed."""

LINK_ATTEMPTS = 20
"""How often a report is offered to a parent that has no owner (or whose owner refuses it
for now), before it is given up (logged): a parent whose host was lost with its child's,
or stopped, gets a new owner within a few lease periods."""

FIRST_RETRY_SHARE = 1 / 16
"""The first wait before a report is offered again, as a share of ``retry_s``: a parent
being handed over has its new owner within a round trip or two; the wait doubles from
there up to ``retry_s`` (a parent whose host stopped waits for the orphan scan)."""


def _parent_waits(child: SessionPort) -> bool:
    """Whether ``child``'s parent is a subagent, whose task waits for its background
    children (R-TREE-2); a root's does not. A parked child taken up here counts among
    the parent's running children only then: a root's close, which ends the subtree it
    counts, leaves it pending, as it did before the child counted parked."""
    return child.parent_id is not None and child.parent_id != child.root_id


class ChildReports:
    """A host's reports of taken-up background children; see the module docstring."""

    __slots__ = (
        "_cut",
        "_followed",
        "_here",
        "_host",
        "_places",
        "_reaching",
        "link",
        "retry_s",
        "stored_below",
    )

    def __init__(self, host: Host, open_tasks: OpenTaskIndex) -> None:
        self._host = host
        self.stored_below: StoredBelow = functools.partial(_stored_here, host, open_tasks)
        """Where a tree interrupt finds the stored nodes it ends (:meth:`end_unreached`):
        on one host, its stored sessions left with a task open; a cluster host sets the
        cluster's (those no host runs)."""
        self._reaching: dict[str, list[_StoredEnd]] = {}
        """The stored ends under way of each node's tree interrupts (:meth:`reached`)."""
        self._cut: set[str] = set()
        """The background children that :meth:`end_unreached` ended: their answers are
        for nobody."""
        self._followed: set[str] = set()
        """The taken-up children whose reports are still to come."""
        self._here: dict[str, SessionPort] = {}
        """Those of them that run here now: a supervisor runs them, or they are parked
        here (their task waits for people)."""
        self._places: dict[str, LiveChild] = {}
        """The entry of each of those among its parent's running children, kept past the
        parent's closing: its ``cut`` says that the parent's tree interrupt ended it."""
        self.link: ParentLink | None = None
        """The cluster's way to a parent owned by another host (set by a cluster host)."""
        self.retry_s = 1.0
        """The longest wait before a report is offered again to a parent without owner
        (the waits double up to it from :data:`FIRST_RETRY_SHARE` of it)."""

    def loaded(self, port: SessionPort) -> None:
        """``port`` was loaded here. A background child's open task: its answer reaches
        its parent when it ends, whoever takes it up (R-TREE-4). A parent: it counts its
        taken-up children that run here now, as it would have, open before them."""
        if port.report_as is not None and port.machine.run_id is not None:
            self.follow(port)
            if port.parked and _parent_waits(port):
                self._count(port)  # it waits here for a person: its parent waits for it
        for child in self._here.values():
            place = self._places.get(child.id)
            if child.parent_id == port.id and not (place is not None and place.cut):
                self._places[child.id] = children_of(port).take_up(child)

    def wake(self, port: SessionPort, message: SupervisorMessage | None) -> None:
        """Start a supervisor for ``port``'s open task, with ``message`` first in its inbox
        (:func:`~greenroom.actors.runtime.supervisor.wake`). A taken-up child then runs
        here: its parent, open here, counts it among its running children while it runs
        or waits here for people (see the module docstring)."""
        # A task that waits only for people, taken up, parks again at once: counted
        # parked only where its parent waits for it (see :func:`_parent_waits`).
        parks_again = message is None and port.parked
        wake(port, message)
        idle = port.idle
        if port.id not in self._followed or idle is None:
            return
        if parks_again and not _parent_waits(port):
            return
        self._count(port)
        self._host.start_task(functools.partial(self._until_idle, port, idle))

    def _count(self, port: SessionPort) -> None:
        """The followed child ``port`` runs here: its parent open here counts it."""
        self._here[port.id] = port
        parent = self._open_port(port.parent_id)
        place = self._places.get(port.id)
        if parent is not None and not (place is not None and place.cut):
            self._places[port.id] = children_of(parent).take_up(port)

    async def _until_idle(self, port: SessionPort, idle: trio.Event) -> None:
        await idle.wait()
        if port.inbox is not None:
            return  # woken again meanwhile: the new supervisor is watched in its turn
        if port.machine.run_id is None:
            self._here.pop(port.id, None)
            return  # its task has ended: its report, on its way, lets its parent go on
        if port.parked and not (port.held or port.closed) and _parent_waits(port):
            # It waits here for a person, as a parked child spawned here does: its parent
            # waits on (R-TREE-2); a close ends its follower, which lets the parent go.
            return
        self._here.pop(port.id, None)
        self._places.pop(port.id, None)
        parent = self._open_port(port.parent_id)
        if parent is not None:
            stopped_running(parent, port)

    def _open_port(self, session_id: str | None) -> SessionPort | None:
        if session_id is None:
            return None
        try:
            return self._host.port(session_id)
        except SessionNotFound:
            return None

    def follow(self, port: SessionPort) -> None:
        """Follow the background child ``port`` from now on and report its answer when
        its task ends; the follow-up task the report may start in its parent is decided
        as ``port.lost_approve`` says (``Host.resume(approve=…)``, else the host's:
        ``Host.open(approve=…)``)."""
        parent_id, label = port.parent_id, port.report_as
        if parent_id is None or label is None:
            return
        # Unbounded: the publisher never waits on this follower, which drains it until
        # the child's task ends.
        send, outputs = trio.open_memory_channel[list[Output]](math.inf)
        port.watch(send)
        work = TakenUpWork(port)  # right after the watch: its last task's end, not a new run's
        # Its subtree's token budget holds as it did before (R-TREE-3), counted from what
        # its task used then and what its descendants had used: its parent's setting,
        # which it inherited.
        watch = ChildWatch(
            port, budget=port.settings.subagent_token_budget, used=port.machine.usage.total
        )
        followed_at = time.time()
        # What its task had said before is in its trace up to here; what it says from now
        # on reaches the watch.
        said_through = port.last_seq
        self._followed.add(port.id)

        async def report() -> None:
            try:
                await report_once()
            finally:
                self._followed.discard(port.id)
                self._cut.discard(port.id)
                self._here.pop(port.id, None)
                self._places.pop(port.id, None)
                # Its parent's task must not wait for a report that did not reach it.
                parent = self._open_port(parent_id)
                if parent is not None:
                    stopped_running(parent, port)

        async def report_once() -> None:
            if watch.budget >= 0:
                watch.used += await self._descendants_used(port, followed_at)
            # Its answer may be given already: its task answered, then waited for its own
            # background children, or its host stopped before the task's end was recorded.
            watch.recall(await self._said_before(port, said_through))
            with outputs:
                await work.read(outputs, watch.on_batch)
            if watch.end is None:
                return  # the session closed with its task open: taken up again later
            try:
                answer = watch.result()
            except SubagentError as exc:
                answer = str(exc)
            # Its work done, it leaves the host's open sessions before its parent hears of
            # it, as a live child does (``load_session`` opens it again). In a cluster too:
            # its host releases it, and answers the calls on their way to it meanwhile.
            forget_finished(port)
            place = self._places.pop(port.id, None)
            if place is not None and place.cut:
                return  # its parent's tree interrupt ended it: its answer is for nobody
            most = self._host.trace_log.largest_input()  # the link's message fits too
            text = finished_text(label, answer, child_id=port.id, most=most)
            try:
                await self.deliver(parent_id, port.id, text, port.lost_approve)
            except Exception:  # a task of the host's: it must not end the host
                logger.exception("the answer of subagent %s could not reach %s", port.id, parent_id)

        self._host.start_task(report)

    async def _descendants_used(self, port: SessionPort, until: float) -> int:
        """The tokens ``port``'s descendants used before ``until``, as the ledger holds them
        (their requests are in their own traces): those of the subagents it spawns from
        then on reach its watch (0, logged, when the ledger cannot be read)."""
        store = self._host.trace_store
        try:
            usage = await tree_usage(store.ledger, store.catalog, port.root_id, until=until)
        except Exception:  # a task of the host's: it must not end the host
            logger.exception("what the subagents of %s used could not be read", port.id)
            return 0
        return sum(line.total for path, line in usage if port.id in path[:-1])

    async def _said_before(self, port: SessionPort, through_seq: int) -> list[Output]:
        """``port``'s traced records up to ``through_seq``, across its traces (its task
        may have started before a compaction), without what a rewind cut; none, logged,
        when its trace cannot be read."""
        try:
            records = await self._host.trace_store.log.read_after(port.id)
        except Exception:  # a task of the host's: it must not end the host
            logger.exception("the trace of %s could not be read for its answer", port.id)
            return []
        return live_records([r for r in records if r.seq is not None and r.seq <= through_seq])

    async def deliver(self, parent_id: str, child_id: str, text: str, approve: Approval) -> None:
        """Hand child ``child_id``'s report ``text`` to ``parent_id`` (see the module
        docstring); none when a tree interrupt ended the child (:meth:`end_unreached`), nor
        once the host is closed (one line logged: the answer stays in the child's trace,
        as when a host is lost). Never raises :class:`HostClosed`."""
        if child_id in self._cut:
            self._cut.discard(child_id)
            return
        wait_s = self.retry_s * FIRST_RETRY_SHARE
        for _ in range(LINK_ATTEMPTS):
            try:
                if await self._offer(parent_id, child_id, text, approve):
                    return
            except HostClosed:
                # A host closing is no failure: a closing host starts no follow-up in a
                # parent, as for a live child's answer (subagents.py).
                logger.warning(
                    "subagent %s finished as its host closed; its answer for %s stays in "
                    "its trace (session.children() finds it)",
                    child_id,
                    parent_id,
                )
                return
            await trio.sleep(wait_s)
            wait_s = min(wait_s * 2, self.retry_s)
        logger.warning(
            "subagent %s finished, but no host took its answer for %s", child_id, parent_id
        )

    async def _offer(self, parent_id: str, child_id: str, text: str, approve: Approval) -> bool:
        """One offer of the report (:meth:`deliver`): False when it is to be offered again;
        True once taken, or refused for good (no such parent: logged, one line)."""
        if self.link is not None and not self._is_open(parent_id):
            return await self.link(parent_id, child_id, text)
        try:
            await self.take(parent_id, child_id, text, approve)
        except SessionClosed:
            return False  # it runs again: loaded again here, or taken over
        except SessionNotFound as exc:  # deleted meanwhile, or locked: refused for good
            logger.warning(
                "session %s refused the answer of its subagent %s: %s", parent_id, child_id, exc
            )
        return True

    def _is_open(self, session_id: str) -> bool:
        try:
            self._host.get_session(session_id)
        except SessionNotFound:
            return False
        return True

    async def take(self, parent_id: str, child_id: str, text: str, approve: Approval) -> None:
        """The parent's side: ``parent_id`` (open here, or loaded: its open task, taken up,
        decides as the host says, ``Host.open(approve=…)``) takes the report as
        steering of its open task, else as a follow-up task run with ``approve``, cut to
        fit one record of this host's trace (:func:`~.subagents.answer_fitted`). Raises
        :class:`SessionNotFound` when there is no such session, or it is locked by an auth
        failure; :class:`SessionClosed` when it takes nothing now, as its close or its work
        ends (it runs again: loaded here, or taken over in a cluster);
        :class:`~greenroom.actors.runtime.errors.HostClosed` when the host is closed."""
        await self._host.load_session(parent_id)
        # A load that began before the host's close and ends after it leaves the parent
        # open where the close no longer looks: nothing would make what it takes durable.
        self._host.check_open()
        parent = self._host.port(parent_id)
        if parent.children is not None:
            parent.children.let_go(child_id)  # it runs no more: its answer comes now
        most = self._host.trace_log.largest_input()
        content = (TextBlock(text=answer_fitted(text, child_id=child_id, most=most)),)
        follow_up = TaskInput(
            content=content, approve=approve, thinking_level=None, report=True
        )
        if tell(
            parent, SubagentFinished(session_id=child_id, content=content, follow_up=follow_up)
        ):
            return
        if parent.machine.auth_locked is not None and not parent.closed:
            raise SessionNotFound(f"session {parent_id} takes no more work")
        raise SessionClosed(f"session {parent_id} takes no work while its close or work ends")

    # -- tree interrupts ---------------------------------------------------------------

    def end_unreached(self, node: SessionPort, reason: str) -> bool:
        """A tree interrupt of ``node`` (R-TREE-2): besides the trees of its live children,
        which its own interrupt ends, every descendant they leave out ends too. Those open
        here: taken up after a restart and not counted (a root's parked child), or whose
        parent was loaded again since it spawned them. Then the stored ones no host runs
        (:attr:`stored_below`), whose trace leaves them running or waiting for people,
        background children of the tree (a foreground child's task went with its parent's
        call): each is loaded for it and ends a moment later. In a cluster, those other
        hosts run are ended there (:meth:`end_here`). :meth:`reached` waits for those
        ends to be durable. Each ends as a live child ends, ``cut``: its pending requests
        are answered interrupted, nothing runs after, and its answer is for nobody. True
        when one open here had work to interrupt."""
        reason = f"parent interrupted: {reason}"
        below = [p for p in self._open_ports() if node.id in p.origin_path[:-1]]
        hit = False
        # Shallow first: a node ended here ends the live children it counts itself.
        for port in sorted(below, key=lambda p: len(p.origin_path)):
            if self._place_of(port) is None:
                hit = self._end(port, reason) or hit
        stored_end = _StoredEnd()
        here = frozenset(port.id for port in below)
        self._host.start_task(
            functools.partial(self._end_stored, node.id, reason, stored_end, here)
        )
        self._reaching.setdefault(node.id, []).append(stored_end)
        return hit

    async def reached(self, node_id: str) -> bool:
        """Return once the stored nodes that the tree interrupts of ``node_id`` made so far
        end (:meth:`end_unreached`) have ended, their ends durable in their traces (in a
        cluster: in JetStream, and those other hosts run once their hosts say so, or
        did not answer in time), or could not be reached (logged). True when one of them
        had work to end. Never raises."""
        ends = list(self._reaching.get(node_id, ()))
        for stored_end in ends:
            await stored_end.done.wait()
        return any(stored_end.ended for stored_end in ends)

    async def end_here(self, session_id: str, reason: str) -> bool:
        """End ``session_id``, open here, as :meth:`end_unreached` ends a node open here
        for a tree interrupt of one of its ancestors that runs on another host (in a
        cluster), ``reason`` already saying so: ``cut``, its answer for nobody. Return once
        it has stopped and its trace is durable; True when it had work to end. Raises
        :class:`SessionNotFound` when it is not open here."""
        port = self._host.port(session_id)
        place = self._place_of(port)
        # Cut already: its parent here, ended for the same interrupt, ended it.
        ended = (place is None or not place.cut) and self._end(port, reason)
        await _until_written(port)
        return ended

    def _open_ports(self) -> list[SessionPort]:
        ports = (self._open_port(session.id) for session in self._host.sessions)
        return [port for port in ports if port is not None]

    def _place_of(self, port: SessionPort) -> LiveChild | None:
        """``port``'s entry among its parent's live children, when its parent is open here
        and counts it: the parent's tree interrupt reaches it."""
        parent = self._open_port(port.parent_id)
        children = None if parent is None else parent.children
        return None if children is None else children.live.get(port.id)

    def _end(self, port: SessionPort, reason: str) -> bool:
        unstarted = left_unstarted(port)
        if port.report_as is not None and (port.machine.run_id is not None or unstarted):
            self._cut.add(port.id)
        place = self._place_of(port)
        if place is not None:
            place.cut = True  # its parent's own tree interrupt leaves it to this one
        interrupt = InterruptTask(reason=reason, scope="tree")
        if port.deliver(interrupt):
            return True
        if port.report_as is not None and end_left_work(port, interrupt):
            # Its trace leaves it running, or its input not started, as its host stopped:
            # taken up to end at once, so that its end is in its trace; else the next
            # host to take up the open tasks would run it, and its answer would reach
            # its parent.
            return True
        return end_subtree(port, reason)

    async def _end_stored(
        self, node_id: str, reason: str, stored_end: _StoredEnd, here: frozenset[str]
    ) -> None:
        """The stored part of :meth:`end_unreached`: ``stored_end`` is done once the nodes
        it ended have their ends written. ``here`` are the nodes open here that it ended
        already: one of them, its work ended, may close and leave this host while the
        stored nodes are looked for, found then as run by no host; opened again, it would
        stay open here for nothing."""
        ended: list[SessionPort] = []
        try:
            below = await self.stored_below(node_id)
            for session_id, open_here in below.stored:
                with contextlib.suppress(SessionNotFound):  # deleted, or closed meanwhile
                    if session_id in here or not await open_here():
                        continue
                    port = self._host.port(session_id)
                    place = self._place_of(port)
                    if (place is None or not place.cut) and self._end(port, reason):
                        ended.append(port)
            elsewhere = [node for node in below.elsewhere if node[0] not in here]
            ended_elsewhere = await _ended_elsewhere(elsewhere, reason)
            stored_end.ended = bool(ended) or ended_elsewhere
            # Ended in memory is not ended: a host lost now would leave it open in its
            # trace, and the next to take it up would run it on.
            for port in ended:
                await _until_written(port)
        except HostClosed:
            return
        except Exception:  # a task of the host's: it must not end the host
            logger.exception("the tree interrupt of %s could not reach its stored nodes", node_id)
        finally:
            stored_end.done.set()
            reaching = self._reaching.get(node_id, [])
            if stored_end in reaching:
                reaching.remove(stored_end)
            if not reaching:
                self._reaching.pop(node_id, None)


class _StoredEnd:
    """One tree interrupt's end of stored nodes (:meth:`ChildReports.end_unreached`)."""

    __slots__ = ("done", "ended")

    def __init__(self) -> None:
        self.done = trio.Event()
        """Set once the nodes it ended have their ends written, or it gave up."""
        self.ended = False
        """Whether it ended a node's work."""


async def _ended_elsewhere(nodes: list[NodeElsewhere], reason: str) -> bool:
    """Ask the hosts that run ``nodes`` to end them, all at once; whether one had work.
    Never raises (a :data:`NodeElsewhere`'s end does not)."""
    ended: list[bool] = []

    async def end_there(end: Callable[[str], Awaitable[bool]]) -> None:
        ended.append(await end(reason))

    async with trio.open_nursery() as nursery:
        for _, end in nodes:
            nursery.start_soon(end_there, end)
    return any(ended)


async def _stored_here(host: Host, open_tasks: OpenTaskIndex, node_id: str) -> NodesBelow:
    """The stored nodes below ``node_id`` on one host (:data:`StoredBelow`): of the
    sessions the host left with a task open, not open here, the background children of
    the tree, read from their ``session.json``."""
    stored = await open_tasks.ids({session.id for session in host.sessions})
    below: list[tuple[int, str]] = []
    for session_id in stored:
        try:
            meta = await host.trace_store.catalog.read_meta(session_id)
        except Exception:  # unreadable or gone: nothing of it runs
            continue
        origin = stored_origin(meta, session_id) or ()
        if meta.get("background") is True and node_id in origin[:-1]:
            below.append((len(origin), session_id))
    return NodesBelow(
        stored=[(sid, functools.partial(_load, host, sid)) for _, sid in sorted(below)]
    )


async def _load(host: Host, session_id: str) -> bool:
    await host.load_session(session_id)
    return True


async def _until_written(port: SessionPort) -> None:
    """Return once ``port``'s task, interrupted, has stopped and its trace is durable (a
    failure to write it is the store's to report: logged there, not raised here)."""
    await port.wait_idle()
    await port.sync_trace_quietly()
