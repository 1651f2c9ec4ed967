"""The approval broker: exactly one decision per complete tool call, one at a time.

Calls arrive in call order as their blocks complete (possibly while the model still
streams, R-TOOL-1), one at a time: the turn machine sends the next once the previous is
decided, and calls an earlier ``allow_session`` covers never reach the broker (the task
machine holds those rules). For each call the broker asks the host's ``approve`` callback;
with ``approve="people"`` it records the request for a person and is free at once
(R-HITL-1); without either it denies (R-APPROVE-2). A callback that raises or answers
nonsense denies, and so does one that takes longer than the timeout (R-APPROVE-4). The
decision goes to the supervisor's inbox; the supervisor emits it.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import trio

from greenroom.actors.runtime.port import Approval, ApproveFn
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.messages import (
    ApprovalAsked,
    ApprovalDecided,
    ApproveCall,
    SupervisorMessage,
    Verdict,
)
from greenroom.protocols.people import ASK_USER, PEOPLE

__all__ = ["ApprovalBroker", "ApproveFn"]


def _as_verdict(answer: Any) -> Verdict:
    if answer is True:
        return "allow"
    if answer in ("allow", "deny", "allow_session"):
        return answer  # type: ignore[no-any-return]
    return "deny"


class ApprovalBroker:
    """Decides on tool calls for one task."""

    __slots__ = ("_approve", "_inbox", "_timeout_s")

    def __init__(
        self,
        *,
        approve: Approval,
        timeout_s: float | None,
        inbox: trio.MemorySendChannel[SupervisorMessage],
    ) -> None:
        self._approve = approve
        self._timeout_s = math.inf if timeout_s is None else timeout_s
        self._inbox = inbox

    async def run(
        self,
        requests: trio.MemoryReceiveChannel[ApproveCall],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve approval requests until the channel closes or the task is cancelled.

        A cancellation while a decision is pending leaves that call undecided; the
        supervisor resolves it as deny when it aborts (R-APPROVE-5)."""
        task_status.started()
        async with requests:
            async for request in requests:
                self._inbox.send_nowait(await self._decide(request.call))

    async def _decide(self, call: ToolCallBlock) -> ApprovalDecided | ApprovalAsked:
        question = call.name == ASK_USER
        if self._approve == PEOPLE:
            # A person decides (or answers the question), from any surface, whenever they
            # can: the request is recorded and the broker is free (R-HITL-1).
            return ApprovalAsked(call=call, kind="question" if question else "approval")
        if question:
            # Nobody can answer here: the tool's own body tells the model so.
            return ApprovalDecided(call=call, verdict="allow", by="default")
        approve = self._approve
        if callable(approve):
            # A callback that raises or runs out of time decided nothing: the deny is
            # the default's (R-APPROVE-2, R-APPROVE-4), not the host's.
            with trio.move_on_after(self._timeout_s):
                try:
                    answer = approve(call)
                    if inspect.isawaitable(answer):
                        answer = await answer
                except Exception:
                    return ApprovalDecided(call=call, verdict="deny", by="default")
                return ApprovalDecided(call=call, verdict=_as_verdict(answer), by="host")
            return ApprovalDecided(call=call, verdict="deny", by="default")
        return ApprovalDecided(call=call, verdict="deny", by="default")
