"""Subagents (R-HOST-4): the ``spawn_subagent`` tool and the runtime behind it.

A subagent is an independent session — its own id, directory, ``session.json`` (with
``parent_id``), trace file and turn loop — created through the host with the parent's
provider, model, workspace and tools, and a system prompt that tells it it is a subagent
doing one task. Its supervisor runs in the task of the ``spawn_subagent`` call, so it is a
child of the parent task's nursery: interrupting the parent interrupts it, and it records
its own ``abort`` and ``task_end(aborted)`` before the parent settles.

Every output of the subagent is forwarded to the parent's run stream and subscribers as a
live output of the parent, with ``origin`` = the path of session ids from the root (the
parent's path plus the child's id): the ``spawn_subagent`` call's task reads the child's
run channel and sends each batch to the parent's supervisor as ``SubagentOutputs``. It is
traced only in the child's trace. The parent's trace has the ``spawn_subagent`` call and
its ``tool_call_output``: the child's final answer (the text of its last model message), or
an error naming the child when it failed, was interrupted or hit a limit.

Approvals inside the subagent go to the parent run's ``approve`` callback, else to the
parent's client approvers (websocket clients answer on the parent's session), else they are
denied; the parent's "allow for this session" rules do not apply to the child.

Limits (:class:`~greenroom.protocols.settings.SessionSettings`): ``max_subagents_concurrent``
children of one task run at once, more wait for a slot; ``max_subagents_per_task`` in all,
beyond that the call is an error; ``subagent_token_budget`` tokens per child, past it the
child is interrupted and the call is an error; ``max_subagent_depth`` levels below the
root: ``spawn_subagent`` is not offered to a child that may not spawn.

Exceptions::

    SubagentError     the subagent failed, was interrupted or hit a limit (an error output)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import assert_never

import attrs
import trio

from greenroom.actors.runtime.port import Approval, SessionPort, TaskInput
from greenroom.protocols.content import TextBlock
from greenroom.protocols.messages import InterruptTask, SubagentOutputs, SupervisorMessage
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    TaskEnd,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.tools import ToolContext, tool

__all__ = [
    "SPAWN_SUBAGENT",
    "SUBAGENT_SYSTEM",
    "SubagentError",
    "Subagents",
    "spawn_subagent",
    "subagent_system",
]

SPAWN_SUBAGENT = "spawn_subagent"
"""The name of the tool (tools of this name are withheld from a child that may not spawn)."""

SUBAGENT_SYSTEM = (
    "You are a subagent: another agent handed you one task. Do that task, and only that "
    "task, with the tools you have, then answer with the result in your final message: "
    "it is all the other agent will see of your work. Nobody can answer questions while "
    "you work; if something blocks you, say so in your answer."
)
"""The start of a subagent's system prompt; the parent's own system prompt follows it."""

class SubagentError(Exception):
    """A subagent failed, was interrupted or hit a limit; the message is for the model."""


def subagent_system(parent_system: str | None) -> str:
    """A subagent's system prompt: :data:`SUBAGENT_SYSTEM`, then the parent's."""
    if parent_system:
        return f"{SUBAGENT_SYSTEM}\n\n{parent_system}"
    return SUBAGENT_SYSTEM


@tool(parallel=True, side_effects=True)
async def spawn_subagent(task: str, *, ctx: ToolContext) -> str:
    """Hand one self-contained task to a subagent: a separate agent with its own context
    and the same workspace and tools. It works on the task alone and its final answer is
    returned here. Several subagents may run side by side; give each everything it needs
    to know, since it does not see this conversation.

    Args:
        task: the complete task, with the context and the answer you expect.
    """
    if ctx.spawn is None:
        raise SubagentError("subagents are not available here")
    return await ctx.spawn(task)


RunChild = Callable[[SessionPort, TaskInput, trio.MemorySendChannel[list[Output]]], Awaitable[None]]
"""Runs one task of a child session in the calling task (the supervisor's ``run_child``)."""


class Subagents:
    """The subagents of one parent task: its limits, and ``spawn`` (the callback the tool
    pool puts in every :class:`ToolContext`). ``report`` is the parent supervisor's inbox:
    the children's outputs go there as ``SubagentOutputs``; ``run_child`` runs a child's
    task."""

    __slots__ = ("_approve", "_parent", "_report", "_run_child", "_slots", "_started")

    def __init__(
        self,
        parent: SessionPort,
        *,
        approve: Approval,
        report: trio.MemorySendChannel[SupervisorMessage],
        run_child: RunChild,
    ) -> None:
        self._parent = parent
        self._approve = approve
        self._report = report
        self._run_child = run_child
        self._slots: trio.Semaphore | None = None
        self._started = 0

    async def spawn(self, task: str) -> str:
        """Run a subagent on ``task`` in the calling task and return its final answer;
        raises :class:`SubagentError` when it cannot run, fails or hits a limit."""
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
        if self._slots is None:
            self._slots = trio.Semaphore(max(1, settings.max_subagents_concurrent))
        async with self._slots:
            return await self._spawn(task, depth + 1)

    async def _spawn(self, task: str, depth: int) -> str:
        parent = self._parent
        settings = parent.settings
        host = parent.host
        may_spawn = depth < settings.max_subagent_depth
        tools = [t for t in parent.tool_by_name.values() if may_spawn or t.name != SPAWN_SUBAGENT]
        child = await host.create_child(
            parent,
            settings=attrs.evolve(settings, system=subagent_system(settings.system)),
            tools=tools,
        )
        child.set_origin_path((*parent.origin_path, child.id))
        watch = _ChildWatch(child, settings.subagent_token_budget, self._report)
        # Unbounded: the child's supervisor publishes with send_nowait and must never wait
        # for this task, which drains the channel continuously.
        outputs_send, outputs = trio.open_memory_channel[list[Output]](math.inf)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch.follow, outputs)
                try:
                    await self._run_child(
                        child,
                        TaskInput(
                            content=(TextBlock(text=task),),
                            approve=self._approve,
                            thinking_level=None,
                        ),
                        outputs_send,
                    )
                finally:
                    # The child has ended (or never started): the watch reads what is left.
                    outputs_send.close()
        finally:
            host.forget_child(child)
        return watch.result()


class _ChildWatch:
    """Reads one child's outputs: forwards them to the parent, adds up its token usage
    against the budget, and keeps its final answer and ``task_end``."""

    __slots__ = ("_budget", "_child", "_origin", "_report", "_texts", "end", "exceeded", "used")

    def __init__(
        self, child: SessionPort, budget: int, report: trio.MemorySendChannel[SupervisorMessage]
    ) -> None:
        self._child = child
        self._budget = budget
        self._report = report
        self._origin = child.origin_path
        self._texts: list[str] = []
        self.used = 0
        self.exceeded = False
        self.end: TaskEnd | None = None

    async def follow(self, outputs: trio.MemoryReceiveChannel[list[Output]]) -> None:
        """Handle every batch the child publishes until its channel closes. Shielded: an
        interrupted parent still gets the child's own ``abort`` and ``task_end`` (the
        child settles within its supervisor's teardown bound, then the channel closes)."""
        with trio.CancelScope(shield=True):
            async for batch in outputs:
                self._on_batch(batch)

    def _on_batch(self, batch: list[Output]) -> None:
        # A parent supervisor that has ended closed its inbox: nobody is left to tell.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._report.send_nowait(SubagentOutputs(outputs=tuple(batch), origin=self._origin))
        for output in batch:
            if output.origin is not None:
                continue  # a grandchild's: forwarded, and no business of this watch
            match output:
                case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                    pass  # the most frequent outputs, tested first: live only
                case RequestBegin():
                    self._texts = []  # the answer is the last model message's text
                case ModelMsg(block=TextBlock() as block):
                    self._texts.append(block.text)
                case TokenUsageOutput():
                    self.used += output.request.total
                    if 0 <= self._budget < self.used and not self.exceeded:
                        self.exceeded = True
                        self._child.send(
                            InterruptTask(
                                reason=f"subagent token budget exceeded: {self.used} tokens "
                                f"used, the budget is {self._budget}"
                            )
                        )
                case TaskEnd():
                    self.end = output
                case (
                    ModelMsg()
                    | UserMsg()
                    | TaskStart()
                    | RequestEnd()
                    | ApprovalRequest()
                    | ApprovalDecision()
                    | ToolCallOutput()
                    | Abort()
                    | CompactionBegin()
                    | CompactionEnd()
                ):
                    pass  # forwarded above; neither the answer nor the budget needs them
                case _:
                    assert_never(output)

    def result(self) -> str:
        child_id = self._child.id
        if self.exceeded:
            raise SubagentError(
                f"subagent {child_id} was interrupted: it used {self.used} tokens, over its "
                f"budget of {self._budget} (subagent_token_budget)"
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
