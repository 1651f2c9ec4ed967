"""Subagents (R-HOST-4, R-TREE): the ``spawn_subagent`` tool and the runtime behind it.

A subagent is an independent session — its own id, directory, ``session.json`` (with
``parent_id``, ``root_id`` and ``origin``), trace file and turn loop — created through the
host with the parent's provider, model, workspace and tools, and a system prompt that tells
it it is a subagent doing one task. It is open in the host while it runs: anyone holding
its handle (``host.get_session``, ``session.children()``) steers, interrupts or answers it
like any session (R-TREE-1).

A **foreground** child (the default) runs its supervisor in the task of the
``spawn_subagent`` call, so it is a child of the parent task's nursery: interrupting the
parent interrupts it, and it records its own ``abort`` and ``task_end(aborted)`` before
the parent settles. The call's result is its final answer (the text of its last model
message), or an error naming the child when it failed, was interrupted or hit a limit.

A **background** child (``background=true``, R-TREE-2) runs its supervisor in the host's
nursery: the call returns ``{"session_id": …}`` at once and the parent goes on. When the
child ends, a task of the host's nursery hands its answer (or why it failed) to the parent
as input ``[subagent NAME finished] …`` (:func:`~greenroom.actors.runtime.tree.tell`):
steering of the parent's open task, else a follow-up task, run with the approvals of the
task that spawned it. That input is one record of the parent's trace: where a record has
a limit (a cluster's NATS server) a longer answer is cut, marked, to fit
(:func:`finished_text`); the whole answer stays in the child's trace. A parent whose
host closes before the answer it took has run records it as a queued follow-up
(``task_queued``) that the next host runs (R-STEER-6); once the host is closed no parent
takes one (one line logged: the answer stays in the child's trace). A subagent's own
task does not end while its background children run (it waits for their answers); a
root's does.

A child whose spawning task is told to stop (or whose call is cancelled) while the child is
being created — its files are written in threads no cancellation reaches — is not started:
its session is forgotten and the call is an error, so that no interrupt misses it.

Every output of a subagent reaches its parent as a live output, with ``origin`` = the path
of session ids from the root (:func:`~greenroom.actors.runtime.tree.forward_up`, a
subscriber of the child's port): through the parent's supervisor while it has work, else
to the parent's subscribers directly. It is traced only in the child's trace.

Approvals inside a subagent go to the approve callback of the task that spawned it (the
root run's, passed down the tree), else to the parent's client approvers (the root's
clients, shared down the tree: the ``approval_request`` the child records reaches them
with its ``origin``), else they are denied; the parent's "allow for this session" rules do
not apply to the child. With ``approve="people"`` a child's request waits in the host's
pending approvals with its ``origin`` until a person answers it.

Limits (:class:`~greenroom.protocols.settings.SessionSettings`): ``max_subagents_concurrent``
children of one session run at once, foreground and background (more wait for a slot);
``max_subagents_per_task`` spawns per task, beyond that the call is an error;
``subagent_token_budget`` tokens for each child's whole subtree (its descendants' count
too, R-TREE-3), past it the child is interrupted with its subtree and its call (or its
finished message) is an error naming the budget; ``tree_cost_budget_usd`` USD for each
child's subtree, checked before each of its requests rather than counted here (the child's
account holds the limit, shared with its descendants:
:mod:`~greenroom.actors.runtime.accounting`), so the node whose next request could pass
it ends ``budget_exceeded`` and its call is an error naming the budget (R-SHARE-4);
``max_subagent_depth`` levels below the root: ``spawn_subagent`` is not offered to a child
that may not spawn.

Exceptions::

    SubagentError     the subagent failed, was interrupted or hit a limit (an error output)
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, assert_never, cast

import attrs
import trio

from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.port import Approval, SessionPort, TaskInput
from greenroom.actors.runtime.tree import (
    Children,
    children_of,
    forget_finished,
    forward_up,
    tell,
)
from greenroom.protocols.content import TextBlock
from greenroom.protocols.messages import InterruptTask, SubagentFinished
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    Rewind,
    SteeringQueuedOutput,
    TaskEnd,
    TaskQueuedOutput,
    TaskQueueDropped,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    ToolHook,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.tools import ToolContext, tool
from greenroom.protocols.trace import cut_to_fit

if TYPE_CHECKING:
    from greenroom.actors.runtime.host import Host

__all__ = [
    "SPAWN_SUBAGENT",
    "SUBAGENT_SYSTEM",
    "ChildWatch",
    "SubagentError",
    "Subagents",
    "answer_fitted",
    "finished_text",
    "spawn_subagent",
    "subagent_system",
]

logger = logging.getLogger(__name__)

SPAWN_SUBAGENT = "spawn_subagent"
"""The name of the tool (tools of this name are withheld from a child that may not spawn)."""

SUBAGENT_SYSTEM = (
    "You are a subagent: another agent handed you one task. Do that task, and only that "
    "task, with the tools you have, then answer with the result in your final message: "
    "it is all the other agent will see of your work. Nobody can answer questions while "
    "you work; if something blocks you, say so in your answer."
)
"""The start of a subagent's system prompt; the parent's own system prompt follows it."""

MAX_NAME_CHARS = 80
"""The longest subagent name kept (a model writes it; it lands in markers and files)."""


class SubagentError(Exception):
    """A subagent failed, was interrupted or hit a limit; the message is for the model."""


def subagent_system(parent_system: str | None) -> str:
    """A subagent's system prompt: :data:`SUBAGENT_SYSTEM`, then the parent's."""
    if parent_system:
        return f"{SUBAGENT_SYSTEM}\n\n{parent_system}"
    return SUBAGENT_SYSTEM


def finished_text(label: str, answer: str, *, child_id: str, most: int | None) -> str:
    """The input a background subagent's end gives its parent (R-TREE-2):
    ``[subagent <label> finished] <answer or why it failed>``, cut to ``most`` bytes of
    input (the parent's :meth:`~.trace_store.TraceLog.largest_input`) with a marker naming
    the child's trace, where the whole answer is (:func:`~.trace.cut_to_fit`)."""
    return answer_fitted(f"[subagent {label} finished] {answer}", child_id=child_id, most=most)


def answer_fitted(text: str, *, child_id: str, most: int | None) -> str:
    """A background child's report ``text``, cut to fit one record of a trace that holds
    ``most`` bytes of input: as the parent's steering or follow-up it is recorded whole
    in one record, and in a cluster a record NATS cannot carry stopped the parent on its
    host (R-SEC-9, R-CLUSTER-1, R-TREE-2)."""
    return cut_to_fit(text, most, f"the trace of subagent session {child_id}")


@tool(parallel=True, side_effects=True)
async def spawn_subagent(
    task: str, background: bool = False, name: str | None = None, *, ctx: ToolContext
) -> str:
    """Hand one self-contained task to a subagent: a separate agent with its own context
    and the same workspace and tools. It works on the task alone; give it everything it
    needs to know, since it does not see this conversation. Several subagents may run side
    by side.

    By default the call waits and returns the subagent's final answer. With background
    set, it returns {"session_id": ...} at once and you go on working; the subagent's
    answer reaches you later as a message "[subagent NAME finished] ...".

    Args:
        task: the complete task, with the context and the answer you expect.
        background: run it in the background instead of waiting for its answer.
        name: a short name for the subagent, used when its answer arrives.
    """
    if ctx.spawn is None:
        raise SubagentError("subagents are not available here")
    return await ctx.spawn(task, background=background, name=name)


RunChild = Callable[[SessionPort, TaskInput, trio.MemorySendChannel[list[Output]]], Awaitable[None]]
"""Runs one task of a child session in the calling task (the supervisor's ``run_child``)."""


class Subagents:
    """The subagents of one parent task: its limits, and ``spawn`` (the callback the tool
    pool puts in every :class:`ToolContext`). ``run_child`` runs a foreground child's task
    in the calling task; background children start in the host's nursery."""

    __slots__ = ("_approve", "_parent", "_run_child", "_started")

    def __init__(self, parent: SessionPort, *, approve: Approval, run_child: RunChild) -> None:
        self._parent = parent
        self._approve = approve
        self._run_child = run_child
        self._started = 0

    async def spawn(self, task: str, *, background: bool = False, name: str | None = None) -> str:
        """Run a subagent on ``task`` and return its final answer — or, in the
        ``background``, start it and return ``{"session_id": …}`` as JSON. Raises
        :class:`SubagentError` when it cannot run, fails or hits a limit."""
        parent = self._parent
        settings = parent.settings
        depth = len(parent.origin_path) - 1
        if depth >= settings.max_subagent_depth:
            raise SubagentError(
                f"session {parent.id} may not spawn subagents "
                f"(max_subagent_depth={settings.max_subagent_depth}); do the task yourself"
            )
        if not task.strip():
            raise SubagentError("the task is empty; describe what the subagent should do")
        limit = settings.max_subagents_per_task
        if 0 <= limit <= self._started:
            raise SubagentError(
                f"this task has already spawned {self._started} subagents, the most allowed "
                f"(max_subagents_per_task={limit}); do the rest yourself"
            )
        self._started += 1
        name = " ".join((name or "").split())[:MAX_NAME_CHARS] or None
        children = children_of(parent)
        # A slot is held from before the child exists until it has ended: a background
        # child's by the task that follows it.
        await children.slots.acquire()
        try:
            child = await self._create(depth + 1, name, background=background)
        except BaseException:
            children.slots.release()
            raise
        cut = self._cut()
        if cut is not None:
            # Creating the child waits on disk work that no cancellation reaches: an
            # interrupt that came meanwhile found it among no live children (R-TREE-2), so
            # it must not start behind that interrupt.
            children.slots.release()
            parent.host.forget_child(child)
            raise SubagentError(f"subagent {child.id} was not started: {cut} while it was created")
        if background:
            self._start_background(children, child, task, name)
            return json.dumps({"session_id": child.id})
        try:
            return await self._run_foreground(children, child, task)
        finally:
            children.slots.release()

    def _cut(self) -> str | None:
        """Why a child just created may not start, None when it may: the parent's task was
        told to stop, or this call was cancelled (interrupted, timed out: its result is
        settled without the child's id)."""
        machine = self._parent.machine
        if machine.stopping:
            return f"the task was told to stop ({machine.stop_reason or 'no reason given'})"
        if trio.current_effective_deadline() == -math.inf:
            return "the call was cancelled"
        return None

    async def _create(self, depth: int, name: str | None, *, background: bool) -> SessionPort:
        parent = self._parent
        settings = parent.settings
        may_spawn = depth < settings.max_subagent_depth
        tools = [t for t in parent.tool_by_name.values() if may_spawn or t.name != SPAWN_SUBAGENT]
        child = await parent.host.create_child(
            parent,
            settings=attrs.evolve(settings, system=subagent_system(settings.system)),
            tools=tools,
            name=name,
            background=background,
        )
        # The parent may be closed and loaded again while the child runs (a parked or held
        # parent): its outputs then go to the port open now (R-TREE-1).
        child.subscribe(forward_up(child, parent, _open_in(cast("Host", parent.host))))
        return child

    def _task(self, task: str) -> TaskInput:
        return TaskInput(
            content=(TextBlock(text=task),), approve=self._approve, thinking_level=None
        )

    async def _run_foreground(self, children: Children, child: SessionPort, task: str) -> str:
        watch = ChildWatch(child, self._parent.settings.subagent_token_budget)
        children.add(child, background=False)
        # Unbounded: the child's supervisor publishes with send_nowait and must never wait
        # for this task, which drains the channel continuously.
        outputs_send, outputs = trio.open_memory_channel[list[Output]](math.inf)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch.follow, outputs)
                try:
                    await self._run_child(child, self._task(task), outputs_send)
                finally:
                    # The child has ended (or never started): the watch reads what is left.
                    outputs_send.close()
        finally:
            children.remove(child.id)
            forget_finished(child)
        return watch.result()

    def _start_background(
        self, children: Children, child: SessionPort, task: str, name: str | None
    ) -> None:
        parent = self._parent
        host = parent.host
        watch = ChildWatch(child, parent.settings.subagent_token_budget)
        children.add(child, background=True)
        # Unbounded: the child's supervisor publishes with send_nowait; the follower task
        # below drains it until the child's work ends.
        outputs_send, outputs = trio.open_memory_channel[list[Output]](math.inf)
        host.start_work(child, self._task(task), outputs_send)
        label = name or child.id
        approve = self._approve

        async def follow() -> None:
            try:
                await watch.follow(outputs, shield=False)
            finally:
                entry = children.remove(child.id)
                children.slots.release()
                forget_finished(child)
                # No end: the host closed while the child's task waited for people; the
                # task is open in its trace, and whoever takes it up reports its answer.
                # A closed host starts no follow-up in the parent (its close may have
                # listed the sessions to close already): the answer stays in the child's
                # trace, said once unless the close itself ended the child.
                end = watch.end
                answered = entry is not None and not entry.cut and end is not None
                if answered and not host.is_open():
                    _kept_in_trace(child.id, parent.id, end)
                elif answered:
                    try:
                        answer = watch.result()
                    except SubagentError as exc:
                        answer = str(exc)
                    most = host.trace_log.largest_input()
                    text = finished_text(label, answer, child_id=child.id, most=most)
                    content = (TextBlock(text=text),)
                    # The follow-up it starts when the parent is idle runs with the
                    # approvals of the task that spawned it.
                    follow_up = TaskInput(
                        content=content, approve=approve, thinking_level=None, report=True
                    )
                    told = tell(
                        parent,
                        SubagentFinished(session_id=child.id, content=content, follow_up=follow_up),
                    )
                    if not told and parent.closed:
                        await _to_closed_parent(parent, child.id, text, approve)

        host.start_task(follow)


def _kept_in_trace(child_id: str, parent_id: str, end: TaskEnd | None) -> None:
    """A background child's answer that its parent does not take: the host is closed (its
    close may have listed the sessions to close already, so nothing would write the
    follow-up). Said in one line, unless the close itself ended the child."""
    if end is not None and end.status != "aborted":
        logger.warning(
            "subagent %s finished as its host closed; its answer for %s stays in its trace "
            "(session.children() finds it)",
            child_id,
            parent_id,
        )


def _open_in(host: Host) -> Callable[[str], SessionPort | None]:
    """The open session of an id in ``host``, None when it has none."""

    def open_port(session_id: str) -> SessionPort | None:
        try:
            return host.port(session_id)
        except SessionNotFound:
            return None

    return open_port


async def _to_closed_parent(
    parent: SessionPort, child_id: str, text: str, approve: Approval
) -> None:
    """A background child's answer for ``parent`` whose close began while the child ran (a
    parked or held parent closes with its background children running, a subagent
    interrupted alone leaves its host with them): the parent as it opens next takes it,
    as a taken-up child's answer reaches a closed parent (loaded once its close is done;
    in a cluster, opened where its owner is, or here)."""
    # The host's own reports (HostServices, the port's view of the host, leaves them out).
    host = cast("Host", parent.host)
    try:
        await host.child_reports.deliver(parent.id, child_id, text, approve)
    except Exception:  # a task of the host's: it must not end the host
        logger.exception("the answer of subagent %s could not reach %s", child_id, parent.id)


class ChildWatch:
    """Reads one child's run: adds up the token usage of its subtree (its own requests
    and its descendants', forwarded through it) against the budget, and keeps its final
    answer and ``task_end``."""

    __slots__ = ("_child", "_texts", "budget", "end", "exceeded", "used")

    def __init__(self, child: SessionPort, budget: int, *, used: int = 0) -> None:
        self._child = child
        self.budget = budget
        """The tokens the child's subtree may use (-1: no limit)."""
        self._texts: list[str] = []
        self.used = used
        """The tokens the child's subtree used, from ``used`` (what it used before this
        watch began: a child taken up after a restart)."""
        self.exceeded = False
        self.end: TaskEnd | None = None

    async def follow(
        self, outputs: trio.MemoryReceiveChannel[list[Output]], *, shield: bool = True
    ) -> None:
        """Handle every batch the child publishes until its channel closes. Shielded for a
        foreground child: an interrupted parent still gets the child's own ``abort`` and
        ``task_end`` (the child settles within its supervisor's teardown bound, then the
        channel closes)."""
        with trio.CancelScope(shield=shield):
            async for batch in outputs:
                self.on_batch(batch)

    def recall(self, records: Iterable[Output]) -> None:
        """Take the answer the child's open task had given before this watch began (a
        child taken up after its host stopped, R-TREE-4): ``records`` are its trace's, in
        ``seq`` order, up to the watch's start. The answer is then what :meth:`on_batch`
        would have kept, live, from its task's start: the text of its last model message,
        until a new request of the task replaces it. Their token usage is not counted: it
        is the ``used`` the watch began with."""
        for record in records:
            match record:
                case _ if record.origin is not None:
                    pass
                case TaskStart() | RequestBegin():
                    self._texts = []  # an earlier task's answer, or an earlier request's
                case ModelMsg(block=TextBlock() as block):
                    self._texts.append(block.text)
                case _:
                    pass  # neither the answer nor its start

    def on_batch(self, batch: list[Output]) -> None:
        """Take one batch of the child's outputs (its own and its descendants')."""
        for output in batch:
            match output:
                case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                    pass  # the most frequent outputs, tested first: live only
                case TokenUsageOutput():
                    if self.exceeded:
                        continue  # counted up to the request that passed the budget
                    # R-TREE-3: a descendant's requests count against this child's budget.
                    self.used += output.request.total
                    if 0 <= self.budget < self.used:
                        self.exceeded = True
                        # Delivered, not sent: a child parked on a person's answer has no
                        # supervisor to read it; it wakes for it (R-HITL-3).
                        self._child.deliver(
                            InterruptTask(
                                reason=f"subagent token budget exceeded: {self.used} tokens "
                                f"used, the budget is {self.budget}",
                                scope="tree",
                            )
                        )
                case _ if output.origin is not None:
                    pass  # a descendant's: neither the answer nor the end of this child
                case RequestBegin():
                    self._texts = []  # the answer is the last model message's text
                case ModelMsg(block=TextBlock() as block):
                    self._texts.append(block.text)
                case TaskEnd():
                    self.end = output
                case (
                    ModelMsg()
                    | UserMsg()
                    | TaskStart()
                    | RequestEnd()
                    | ApprovalRequest()
                    | ApprovalDecision()
                    | ToolHook()
                    | ToolCallOutput()
                    | Abort()
                    | CompactionBegin()
                    | CompactionEnd()
                    | CallInDoubt()
                    | CallResolved()
                    | Rewind()
                    | TaskQueuedOutput()
                    | TaskQueueDropped()
                    | SteeringQueuedOutput()
                ):
                    pass  # neither the answer nor the budget needs them
                case _:
                    assert_never(output)

    def result(self) -> str:
        """The child's answer; raises :class:`SubagentError` naming the child and why it
        has none (its budget, its status)."""
        child_id = self._child.id
        if self.exceeded:
            raise SubagentError(
                f"subagent {child_id} was interrupted: it and its subagents used {self.used} "
                f"tokens, over its budget of {self.budget} (subagent_token_budget)"
            )
        end = self.end
        if end is None:
            raise SubagentError(f"subagent {child_id} ended without a result")
        if end.status != "completed":
            raise SubagentError(
                f"subagent {child_id} ended with status {end.status}: {end.message or 'no details'}"
            )
        answer = "\n".join(t for t in self._texts if t.strip()).strip()
        return answer or f"(subagent {child_id} finished without a text answer)"
