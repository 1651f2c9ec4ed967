"""Agent trees (R-TREE): a session's live subagents, and what crosses the tree's edges.

Every node of a tree is a session (R-TREE-1). A session that spawns keeps a
:class:`Children` on its port, made at its first spawn: the concurrency slots its children
share — foreground and background, across its tasks, so that a background child holds its
slot until it ends — and the children that run now, each marked foreground or background.

What crosses an edge:

* **Outputs, up.** A child's port has :func:`forward_up` among its subscribers from its
  creation: each batch it publishes goes to its parent's supervisor as ``SubagentOutputs``
  (emitted as live outputs of the parent's run, with ``origin``) while the parent has
  work, and straight to the parent's own subscribers (and the reader of its parked run),
  tagged with ``origin``, while it has none. The parent's own forwarder takes them on
  up, so the root's watchers see every node's outputs, whatever each node is doing
  (R-TREE-1, R-HOST-4); a parent closed and loaded again while the child runs gets them
  at the port it is open at now. A subagent loaded again (taken up after a restart, at any depth)
  has :func:`forward_up_while_open` instead, from its load: the same, to its parent while
  that is open in the host — so its requests still count against every ancestor's
  ``subagent_token_budget`` (R-TREE-3).
* **Answers, up.** A background child's end reaches its parent as input (R-TREE-2):
  :func:`tell` hands ``SubagentFinished`` to the parent's work — steering of its open task —
  or, when it is idle, starts a follow-up task through the host.
* **After a restart.** A background child whose task a host takes up again (its own
  stopped) counts among its parent's running children, when the parent is open there,
  while it runs in that host — a supervisor runs it, or, for a parent that is a subagent
  (whose task waits for its background children), it is parked there for a person
  (:meth:`Children.take_up`): from its waking or its load until its answer has come
  (:meth:`Children.let_go`), or until it is held for a hand-over or its session closes
  with its task open (:func:`stopped_running`). A child that is not loaded here — left in
  its trace by a host opened without taking tasks up — is not waited for: the parent's
  task would hold for as long as nobody takes it up.
* **Interrupts, down.** :func:`end_subtree` interrupts every live child with scope
  ``tree`` (each does the same for its own): what an interrupt of scope ``tree`` does
  besides ending the node's own task. A child ended so is ``cut``: its answer is for
  nobody. An interrupt of scope ``node`` ends the node's task alone; its foreground
  children end with their calls, its background children run on. A user's tree
  interrupt also reaches the descendants no live child's tree holds — taken up after a
  restart, or left in their traces — through the host's ``child_reports``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import attrs
import trio

from greenroom.actors.runtime.port import Listener, SessionPort
from greenroom.protocols.messages import InterruptTask, SubagentFinished, SubagentOutputs
from greenroom.protocols.outputs import Output, TaskEnd, TaskStart, UserMsg

__all__ = [
    "Children",
    "LiveChild",
    "TakenUpWork",
    "children_of",
    "end_subtree",
    "forget_finished",
    "forward_up",
    "forward_up_while_open",
    "hand_up",
    "stopped_running",
    "tell",
]


class LiveChild:
    """One running subagent of a session: its port, whether it runs in the background
    (its spawning call has returned), and whether an ancestor's tree interrupt ended it
    (``cut``: its answer goes to nobody).

    A background child ``taken_up`` by this host after its own stopped (see
    :meth:`Children.take_up`) has no follower of this process's spawning call: the
    host's ``child_reports`` end its entry (:meth:`Children.let_go`)."""

    __slots__ = ("background", "cut", "holds_slot", "port", "taken_up")

    def __init__(self, port: SessionPort, *, background: bool, taken_up: bool = False) -> None:
        self.port = port
        self.background = background
        self.cut = False
        self.taken_up = taken_up
        self.holds_slot = False
        """A taken-up child's: whether it took one of the slots (only when one was free)."""


class Children:
    """The running subagents of one session and the slots they share
    (``max_subagents_concurrent``; see the module docstring)."""

    __slots__ = ("live", "slots")

    def __init__(self, concurrent: int) -> None:
        self.slots = trio.Semaphore(max(1, concurrent))
        """Held by each running child, foreground or background, from before it is
        created until it has ended."""
        self.live: dict[str, LiveChild] = {}
        """The running children by session id, in the order they started."""

    @property
    def background(self) -> int:
        """How many background children run now."""
        return sum(1 for child in self.live.values() if child.background)

    def add(self, port: SessionPort, *, background: bool) -> LiveChild:
        """``port`` runs as a child from now on."""
        child = self.live[port.id] = LiveChild(port, background=background)
        return child

    def remove(self, session_id: str) -> LiveChild | None:
        """The child has ended; returns its entry (None when it was not running)."""
        return self.live.pop(session_id, None)

    def take_up(self, port: SessionPort) -> LiveChild:
        """``port``, a background child whose task this host took up after its own host
        stopped, runs here now: the session's task waits for its answer, as it did before
        (R-TREE-2), and its tree interrupts reach it. It holds a slot when one is free
        (the limit may have been lowered since it was spawned). Returns its entry."""
        known = self.live.get(port.id)
        if known is not None:
            return known
        child = self.live[port.id] = LiveChild(port, background=True, taken_up=True)
        try:
            self.slots.acquire_nowait()
        except trio.WouldBlock:
            return child
        child.holds_slot = True
        return child

    def let_go(self, session_id: str) -> LiveChild | None:
        """A taken-up child runs here no more (its answer has come, it was held for a
        hand-over, it parked under a root, or its session closed): its entry goes and its
        slot is freed; returns the entry, None when it had none (a child spawned in this
        process ends through its own follower)."""
        child = self.live.get(session_id)
        if child is None or not child.taken_up:
            return None
        del self.live[session_id]
        if child.holds_slot:
            self.slots.release()
        return child


def children_of(port: SessionPort) -> Children:
    """``port``'s running children, made (with the session's concurrency limit) at the
    first spawn."""
    children = port.children
    if children is None:
        children = port.children = Children(port.settings.max_subagents_concurrent)
    return children


def background_count(port: SessionPort) -> int:
    """How many background children of ``port`` run now (0 for a session that never
    spawned)."""
    children = port.children
    return 0 if children is None else children.background


def forward_up(
    child: SessionPort,
    parent: SessionPort,
    parent_open: Callable[[str], SessionPort | None] | None = None,
) -> Listener:
    """The subscriber that takes ``child``'s outputs to ``parent`` (see the module
    docstring): never blocks, never raises. Once ``parent`` is closed, each batch goes to
    the port ``parent_open`` finds open under its id (the parent loaded again: that port
    runs its work and forwards further up), else to ``parent`` still — one port, so each
    batch goes up once."""
    origin = child.origin_path

    def forward(batch: list[Output]) -> None:
        target = parent
        if parent_open is not None and parent.closed:
            target = parent_open(parent.id) or parent
        hand_up(target, origin, batch)

    return forward


def forward_up_while_open(
    child: SessionPort, parent_open: Callable[[str], SessionPort | None]
) -> Listener:
    """The subscriber that takes a loaded subagent's outputs to its parent, as
    :func:`forward_up` does a new one's, whenever ``parent_open`` (the host's open session
    of that id, or None) finds the parent: the parent may be loaded after the child, or
    closed and loaded again, so it is looked up at each batch. One per loaded port, and a
    loaded port never gets :func:`forward_up`, so each batch goes up once."""
    parent_id, origin = child.parent_id, child.origin_path

    def forward(batch: list[Output]) -> None:
        parent = None if parent_id is None else parent_open(parent_id)
        if parent is not None and not parent.closed:
            hand_up(parent, origin, batch)

    return forward


def hand_up(parent: SessionPort, origin: tuple[str, ...], batch: list[Output]) -> None:
    """Take ``batch``, outputs of the subagent at ``origin``, to ``parent``: into its run
    while it has work, else to its watchers (see the module docstring). Never blocks."""
    if parent.send(SubagentOutputs(outputs=tuple(batch), origin=origin)):
        return
    # No supervisor reads the parent's inbox (it is idle, or parked): its watchers still
    # see the child, tagged as the supervisor's emitter would have tagged it.
    tagged = [o if o.origin is not None else attrs.evolve(o, origin=origin) for o in batch]
    parent.publish(tagged)
    parked = parent.parked_task
    if parked is not None and parked.output is not None:
        # And so does the reader of its parked run, as the emitter's would: the follower
        # of a parked background child counts its subtree's tokens (R-TREE-3).
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            parked.output.send_nowait(tagged)


def end_subtree(port: SessionPort, reason: str) -> bool:
    """Interrupt every running child of ``port`` with scope ``tree`` and mark it ``cut``;
    True when one of them had work to interrupt."""
    children = port.children
    if children is None:
        return False
    hit = False
    for child in list(children.live.values()):
        if child.cut:
            continue  # reached already, by an earlier tree interrupt
        child.cut = True
        hit = child.port.deliver(InterruptTask(reason=reason, scope="tree")) or hit
    return hit


def forget_finished(child: SessionPort) -> None:
    """``child``'s work as a subagent has ended, its answer handed on (or for nobody): its
    session leaves the host's open sessions (``forget_child``; ``load_session`` opens it
    again). Not when a supervisor runs it again: someone started a task on it as its last
    one ended (a host that reacts to a ``task_end`` finds the session idle by then). That
    task is theirs, run in the session open here as any session's, to its end; its parent
    has had its answer and hears nothing more of it (R-TREE-1, R-TREE-2)."""
    if child.inbox is None:
        child.host.forget_child(child)


class TakenUpWork:
    """Which outputs of a background child taken up after a restart are the work its
    parent waits for (R-TREE-2, R-TREE-4): its open task and every task its work runs
    after it (its recorded follow-ups, steering that came too late), as a live child's
    follower reads its run to the end — so that its answer is its last task's, not its
    first's. Not a run someone starts on the session once that work has ended (a host
    that reacts to its ``task_end`` finds it idle): that run is theirs, as a live
    child's would be (:func:`forget_finished`), and its answer is no report of the task
    the parent spawned.

    Its listener is subscribed right after the follower's watch of the port, nothing
    published between, so both see the same batches in the same order. It decides as
    each batch is published, before anyone can react to it: the work has ended with the
    batch that leaves none of its tasks open or starting (a follow-up's prompt is
    published before its ``task_start``) while nothing is open or queued in the session
    — a later run, which only starts then, is in its own supervisor's inbox — or, at the
    latest, with the batch before a prompt that starts no follow-up of it (one queued
    behind its tasks has a ``queued_id``): a store that acknowledges late may publish the
    last ``task_end`` after a later run has taken its task."""

    __slots__ = ("_ended_at", "_idle", "_open", "_prompted", "_published", "_unsubscribe")

    def __init__(self, port: SessionPort) -> None:
        self._open = 1  # the task taken up: its task_start came before
        self._prompted = False
        self._published = 0
        self._ended_at: int | None = None
        """How many batches, counted from the subscription, the work published."""
        self._idle: trio.Event | None = None
        """The idle event of the last supervisor seen running one of the work's tasks."""

        def on_batch(batch: list[Output]) -> None:
            if self._ended_at is not None:
                return
            self._published += 1
            for output in batch:
                if output.origin is None and not self._count(output):
                    self._end(self._published - 1)  # another run's prompt
                    return
            if self._open > 0:
                # No other run starts while a task of the work is open (Busy): a
                # supervisor publishing now is the work's.
                if port.idle is not None:
                    self._idle = port.idle
            elif not port.machine.busy:
                self._end(self._published)

        self._unsubscribe = port.subscribe(on_batch)

    def _end(self, batches: int) -> None:
        self._ended_at = batches
        self._unsubscribe()

    def _count(self, output: Output) -> bool:
        """Count the tasks of the work that ``output``, the session's own, opens or ends;
        False when it is the prompt of a run that is not the work's."""
        match output:
            case UserMsg(kind="prompt") if not self._prompted:
                if self._open == 0 and output.queued_id is None:
                    return False
                self._open += 1  # the task starts, as its task_start soon says
                self._prompted = True
            case TaskStart():
                if not self._prompted:
                    self._open += 1
                self._prompted = False
            case TaskEnd():
                self._open = max(0, self._open - 1)
                self._prompted = False
            case _:
                pass
        return True

    async def read(
        self,
        outputs: trio.MemoryReceiveChannel[list[Output]],
        take: Callable[[list[Output]], None],
    ) -> None:
        """Hand ``take`` each batch of the work that ``outputs`` (the watch subscribed just
        before this) brings, then return once the supervisor that ran its last task has
        stopped; at once when ``outputs`` closes (the session closed with a task open)."""
        read = 0
        try:
            async for batch in outputs:
                if self._ended_at is not None and read >= self._ended_at:
                    break  # a later run's: the work ended with the batch before
                read += 1
                take(batch)
                if self._ended_at is not None and read >= self._ended_at:
                    break
            else:
                return
            if self._idle is not None:
                await self._idle.wait()
        finally:
            self._unsubscribe()


def stopped_running(parent: SessionPort, child: SessionPort) -> None:
    """``child``, taken up by this host, stopped running here without an answer: it
    was held for a hand-over, its session closed with its task open, or it parked and
    its parent, a root, does not wait for it. ``parent``'s task no
    longer waits for it (R-TREE-2); once it runs and answers, its answer comes as the
    parent's input all the same (steering, or a follow-up task)."""
    children = parent.children
    if children is None or children.let_go(child.id) is None:
        return
    # A waiting task counts its running children before each step; nothing else would
    # make it take one now. An empty batch of the child's outputs emits nothing: a
    # supervisor takes a step after every message, and none runs for an idle parent.
    parent.send(SubagentOutputs(outputs=(), origin=child.origin_path))


def tell(parent: SessionPort, message: SubagentFinished) -> bool:
    """Hand a background child's end to ``parent``: to its work when it has some (a
    parked task wakes for it), else as a follow-up task the host starts. False when the
    parent takes no more work (closed, or locked by an auth failure)."""
    if parent.deliver(message):
        return True
    if parent.closed or parent.machine.auth_locked is not None or parent.busy:
        return False
    parent.recover_open_task()
    # Unbounded and unread: nobody runs this task but the tree; the trace and the
    # parent's watchers get its outputs.
    output, unread = trio.open_memory_channel[list[Output]](math.inf)
    unread.close()
    parent.host.start_work(parent, message.follow_up, output)
    return True
