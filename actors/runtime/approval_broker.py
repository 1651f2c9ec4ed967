"""The approval broker: exactly one decision per complete tool call, one at a time.

Calls arrive in call order as their blocks complete (possibly while the model still
streams, R-TOOL-1), one at a time: the turn machine sends the next once the previous is
decided, and calls an earlier ``allow_session`` covers never reach the broker (the task
machine holds those rules). For each call the broker asks the host's ``approve`` callback;
with ``approve="people"`` it records the request for a person and is free at once
(R-HITL-1); without either it denies (R-APPROVE-2). A callback that raises or answers
nonsense denies, and so does one that takes longer than the timeout (R-APPROVE-4). The
decision goes to the supervisor's inbox; the supervisor emits it.

The model's questions (``ask_user``, R-HITL-5) go to people: under ``approve="people"``
they wait in the trace like any request; with a callback that has an
:data:`ANSWER_QUESTION` method (a terminal that can ask the person in front of it), the
question is recorded as an ``approval_request`` of kind ``question`` and the callback's
text is the person's answer; otherwise nobody can answer and the tool's own body says so.
That answer becomes the call's result, one record: text larger than one record of the
session's trace carries (``largest_answer``: a cluster's NATS server, R-SEC-9) is taken as
no answer, as one outside the question's choices is, and logged; a callback has no way to
be told it was refused, and such a record stopped the session on its host.

A session's ``before_tool`` hook (R-HOOK-2) sees each call first
(:mod:`~greenroom.actors.runtime.tool_hooks`): its deny settles the call (``by: hook``), and
a rewritten call is the one asked about and decided — by a person, the callback or a
session rule, which the turn runner then sends here too, so the hook is never skipped.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from greenroom.actors.runtime.port import Approval, ApproveFn
from greenroom.actors.runtime.tool_hooks import ToolHookCalls
from greenroom.actors.runtime.user_code import call_user_code
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.hooks import ToolHookAction
from greenroom.protocols.messages import (
    ApprovalAsked,
    ApprovalDecided,
    ApproveCall,
    PersonAnswered,
    SupervisorMessage,
    Verdict,
)
from greenroom.protocols.people import ASK_USER, PEOPLE
from greenroom.protocols.tools import Tool
from greenroom.protocols.trace import input_size

__all__ = ["ANSWER_QUESTION", "ApprovalBroker", "ApproveFn"]

logger = logging.getLogger(__name__)

ANSWER_QUESTION = "answer_question"
"""The method by which an ``approve`` callback answers the model's questions: called with
the ``ask_user`` call's :class:`~greenroom.protocols.content.ToolCallBlock` (sync or
async), it returns the person's answer, or None when they gave none (the call then gets
the no-answer text, as when the wait runs out)."""


def _takes_origin(approve: ApproveFn) -> bool:
    """Whether an ``approve`` callback takes the ``origin`` keyword: the path of session
    ids from the root to the node whose call it decides (R-TREE-1)."""
    try:
        parameters = inspect.signature(approve).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: called with the call alone
        return False
    return any(
        p.name == "origin" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    )


def _as_verdict(answer: Any) -> Verdict:
    if answer is True:
        return "allow"
    if answer in ("allow", "deny", "allow_session"):
        return answer  # type: ignore[no-any-return]
    return "deny"


class ApprovalBroker:
    """Decides on tool calls for one task."""

    __slots__ = (
        "_approve",
        "_hooks",
        "_inbox",
        "_largest_answer",
        "_origin",
        "_takes_origin",
        "_timeout_s",
        "_tools",
    )

    def __init__(
        self,
        *,
        approve: Approval,
        timeout_s: float | None,
        inbox: trio.MemorySendChannel[SupervisorMessage],
        origin: tuple[str, ...] = (),
        hooks: ToolHookCalls | None = None,
        tools: Mapping[str, Tool] | None = None,
        largest_answer: int | None = None,
    ) -> None:
        self._approve = approve
        self._largest_answer = largest_answer
        self._hooks = hooks
        self._tools: Mapping[str, Tool] = tools or {}
        self._origin = origin
        self._timeout_s = math.inf if timeout_s is None else timeout_s
        self._inbox = inbox
        self._takes_origin: bool | None = None  # the callback's signature, read once

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
        with requests:
            async for request in requests:
                decided = await self._decide(request)
                if decided is not None:
                    self._inbox.send_nowait(decided)

    async def _decide(self, request: ApproveCall) -> ApprovalDecided | ApprovalAsked | None:
        """The message that settles the call for now; None when the broker sent what
        settles it itself (a question the callback answered). The ``before_tool`` hook
        sees the call first: its deny settles it, its rewrite is what is decided."""
        call, action = request.call, None
        if self._hooks is not None:
            hooked, action = await self._hooks.before(call)
            if hooked is None:
                return ApprovalDecided(call=call, verdict="deny", by="hook", hook=action)
            call = hooked
        if request.session_rule:
            return ApprovalDecided(call=call, verdict="allow", by="session_rule", hook=action)
        decided = await self._verdict(call, action)
        return decided if decided is None or action is None else attrs.evolve(decided, hook=action)

    async def _verdict(
        self, call: ToolCallBlock, action: ToolHookAction | None
    ) -> ApprovalDecided | ApprovalAsked | None:
        tool = self._tools.get(call.name)
        if tool is not None and tool.client_side:
            # Its client gives the result, as a person answers a question, whatever
            # decides the session's other calls (never run here).
            return ApprovalAsked(call=call, kind="question")
        question = call.name == ASK_USER
        if self._approve == PEOPLE:
            # A person decides (or answers the question), from any surface, whenever they
            # can: the request is recorded and the broker is free (R-HITL-1).
            return ApprovalAsked(call=call, kind="question" if question else "approval")
        if question:
            ask = getattr(self._approve, ANSWER_QUESTION, None)
            if callable(self._approve) and callable(ask):
                await self._ask_person(call, ask, action)
                return None
            # Nobody can answer here: the tool's own body tells the model so.
            return ApprovalDecided(call=call, verdict="allow", by="default")
        approve = self._approve
        if callable(approve):
            # A callback that raises or runs out of time decided nothing: the deny is
            # the default's (R-APPROVE-2, R-APPROVE-4), not the host's.
            with trio.move_on_after(self._timeout_s):
                answer, failure = await call_user_code(self._call_approve, approve, call)
                if failure is None:
                    return ApprovalDecided(call=call, verdict=_as_verdict(answer), by="host")
                logger.warning(
                    "the approval callback raised: call %s is denied", call.id, exc_info=failure
                )
            return ApprovalDecided(call=call, verdict="deny", by="default")
        return ApprovalDecided(call=call, verdict="deny", by="default")

    def _call_approve(self, approve: Any, call: ToolCallBlock) -> Any:
        """The approve callback's answer for ``call`` (an awaitable for an async one),
        given the host's ``origin`` when it takes one."""
        if self._takes_origin is None:
            self._takes_origin = _takes_origin(approve)
        if self._takes_origin:
            return approve(call, origin=self._origin)
        return approve(call)

    async def _ask_person(
        self, call: ToolCallBlock, ask: Any, action: ToolHookAction | None
    ) -> None:
        """Ask the callback's person ``call``'s question. The question is recorded first,
        so that it waits in the trace like any (R-HITL-5: a process that dies meanwhile
        leaves it pending); the answer then reaches the task as any person's does. No
        answer (end of input, a callback that raised, the wait ran out) is the default's:
        the call gets the no-answer text; so is an answer outside the question's choices
        (a callback offers them to its person and takes only those), and one larger than
        a record of the trace carries."""
        self._inbox.send_nowait(ApprovalAsked(call=call, kind="question", hook=action))
        choices = call.arguments.get("choices")
        text: str | None = None
        with trio.move_on_after(self._timeout_s):
            answer, failure = await call_user_code(ask, call)
            if failure is not None:
                logger.warning(
                    "the question callback raised: call %s has no answer", call.id, exc_info=failure
                )
            if isinstance(answer, str) and (
                not isinstance(choices, list) or not choices or answer in choices
            ):
                text = answer
        most = self._largest_answer
        if text is not None and most is not None and input_size((TextBlock(text=text),)) > most:
            logger.warning(
                "the question callback's answer to call %s is larger than one record of the "
                "session's trace carries (%d bytes): taken as no answer",
                call.id,
                most,
            )
            text = None
        # Refused when the timeout policy answered first: nothing more to do then.
        self._inbox.send_nowait(
            PersonAnswered(call_id=call.id, text=text)
            if text is not None
            else PersonAnswered(call_id=call.id, by="default")
        )
