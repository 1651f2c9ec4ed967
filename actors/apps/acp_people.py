"""``greenroom acp``: people answer when they can, through the editor (R-HITL).

With ``--approve ask`` the agent's tasks run with ``approve="people"``: every request a
task records (``approval_request``) waits in its trace, not in the agent, and
:class:`EditorPeople` asks the editor about it and hands the answer to the host:

- an approval: ``session/request_permission`` (allow once, always, deny), the answer to
  ``host.answer_approval`` with the digest of the arguments the editor was shown;
- a question of the model (``ask_user``): with choices, ``session/request_permission``
  whose options are the choices; without, the extension request ``_greenroom/ask`` when
  the client says it answers it (``clientCapabilities._meta.greenroom.ask``), else
  ``session/request_permission`` with the option "Answer in my next message" (the editor's
  next ``session/prompt`` is the answer); the answer to ``host.answer_question``. "Not
  now", a cancelled request or no answer leaves the question pending.

A session whose mode (R-ACP-2) was set to ``all`` or ``none`` after its task started under
``ask`` has the calls that task records answered by the mode, not asked: allowed or denied,
recorded as the client's answer, since its person chose the mode.

Answers are recorded ``by: client`` with the client's ``clientInfo.name`` (else
``editor``) as ``principal``. An answer to a request settled meanwhile (an interrupt, the
timeout policy, another surface) is refused by the host and only logged.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from greenroom.actors.runtime import Host, NotPending, Session, SessionClosed, SessionNotFound
from greenroom.protocols import acp
from greenroom.protocols.content import TextBlock, ToolCallBlock, UserContent
from greenroom.protocols.outputs import (
    ApprovalDecision,
    ApprovalRequest,
    CallResolved,
    Output,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.people import Verdict, arguments_digest
from greenroom.protocols.task import fold

__all__ = ["Asked", "EditorPeople", "OnAnswer"]

OnAnswer = Callable[[acp.Response], None]
"""Called with the client's answer to a request as it is read, before the next frame."""

Request = Callable[[str, dict[str, Any], OnAnswer | None], Awaitable[acp.Response]]
"""The agent's way to send a request to the client and wait for its answer."""

Notify = Callable[[str, dict[str, Any]], Awaitable[None]]
"""The agent's way to send a ``session/update`` of a session."""


class Asked:
    """What the editor is asked about one session: the calls being asked (each with
    whether it is the root task's own, not a subagent's), the question the next prompt
    answers, and the session's ``mode``: whether its calls are asked about at all."""

    def __init__(self, session: Session, mapper: acp.UpdateMapper, mode: str) -> None:
        self.session = session
        self.mapper = mapper
        self.mode = mode
        """The session's approval policy, its ACP mode (R-ACP-2): ``ask`` (the editor is
        asked), ``all`` (every call allowed) or ``none`` (every call denied)."""
        self.asking: dict[str, bool] = {}
        self.closed = False
        """The editor closed the session (``session/close``): answers it gives to what
        was asked before are not taken; the requests stay pending in the trace."""
        self.answer_next: tuple[str, str] | None = None
        """The question (session id, call id) the next ``session/prompt`` answers."""

    def settled(self, output: Output) -> None:
        """Forget what the editor is asked about a call that ``output`` of the session
        settles (its decision, its result, or the end of the root's task): answered
        elsewhere, timed out or interrupted (``session/cancel``), it waits for no one, even
        while the editor leaves that request unanswered. Else the session would look as if
        it waited for people — and a task running later would not be interrupted when
        the editor goes away (R-HITL-1) — and a later call of the same id never asked."""
        match output:
            case ApprovalDecision() | CallResolved() | ToolCallOutput():
                self.asking.pop(output.call_id, None)
                if self.answer_next is not None and self.answer_next[1] == output.call_id:
                    self.answer_next = None
            case TaskEnd() if output.origin is None:
                self.asking = {call: root for call, root in self.asking.items() if not root}
                if self.answer_next is not None and self.answer_next[0] == self.session.id:
                    self.answer_next = None
            case _:
                pass

    async def waits_for_people(self) -> bool:
        """Whether the session's task waits only for people: the editor is being asked,
        or its trace says so (a question left for later)."""
        if any(self.asking.values()) or self.answer_next is not None:
            return True
        session = self.session
        if not session.busy:
            return False
        records = await session.host.trace_store.log.read_after(session.id)
        return fold(records).waiting_for == "people"


class EditorPeople:
    """Asks the editor of one ACP connection about what waits for people (see the module
    docstring). ``request`` and ``notify`` are the agent's ways out; each request is
    asked from a task of ``nursery`` (the pumps never wait on the client)."""

    def __init__(self, host: Host, request: Request, notify: Notify) -> None:
        self._host = host
        self._request = request
        self._notify = notify
        self._person = "editor"
        self._client_asks = False

    def configure(self, initialize: Mapping[str, Any]) -> None:
        """Learn from the client's ``initialize`` who answers (``clientInfo.name``) and
        whether it answers ``_greenroom/ask``."""
        self._person = acp.client_name(initialize) or "editor"
        self._client_asks = acp.client_asks(initialize)

    def ask_soon(self, nursery: trio.Nursery, asked: Asked, request: ApprovalRequest) -> None:
        """Ask the editor about ``request`` from a task of ``nursery``, unless it is
        being asked already."""
        if request.call_id in asked.asking:
            return
        asked.asking[request.call_id] = request.origin is None or len(request.origin) < 2
        nursery.start_soon(self._ask, asked, request)

    async def _ask(self, asked: Asked, request: ApprovalRequest) -> None:
        # A subagent's request is its own session's (the last of its origin).
        session_id = request.origin[-1] if request.origin else asked.session.id
        call = ToolCallBlock(id=request.call_id, name=request.tool, arguments=request.arguments)
        try:
            if request.kind in ("question", "in_doubt"):
                # A call in doubt is asked as a question: done, not done or run again.
                await self._ask_question(asked, session_id, call)
            else:
                # Set to allow or deny all since the task started: the mode answers.
                verdict: Verdict = (
                    await self.ask_now(asked, call)
                    if asked.mode == "ask"
                    else "allow" if asked.mode == "all" else "deny"
                )
                if asked.closed:
                    return
                await self._host.answer_approval(
                    session_id,
                    call.id,
                    verdict,
                    by=self._person,
                    # The decision is about the arguments the editor showed (R-HITL-2).
                    digest=arguments_digest(request.arguments),
                )
        except (NotPending, SessionNotFound) as exc:
            # Answered elsewhere, timed out, or its task ended meanwhile.
            _log(f"the answer about call {call.id} was not taken: {exc}")
        finally:
            asked.asking.pop(call.id, None)

    async def _ask_question(self, asked: Asked, session_id: str, call: ToolCallBlock) -> None:
        question, choices = acp.question_of(call.arguments)
        root_id = asked.session.id
        if not choices and self._client_asks:
            params = acp.ask_params(root_id, call.id, question)
            text = acp.asked_answer(await self._request(acp.ASK_METHOD, params, None))
        else:

            def answer_next(response: acp.Response) -> None:
                # Set as the answer is read: the prompt the client sends next answers.
                if not choices and acp.selected_option(response) == acp.ANSWER_NEXT:
                    asked.answer_next = (session_id, call.id)

            params = asked.mapper.question_params(root_id, call)
            response = await self._request("session/request_permission", params, answer_next)
            await self._restore(asked, call)
            if asked.answer_next == (session_id, call.id):
                return
            text = acp.choice_of(acp.selected_option(response), choices)
        if text is None or asked.closed:
            _log(f"question {call.id} of session {session_id} stays unanswered for now")
            return
        await self._host.answer_question(session_id, call.id, text, by=self._person)

    async def ask_now(self, asked: Asked, call: ToolCallBlock) -> Verdict:
        """Ask the editor about ``call`` of ``asked``'s session with
        ``session/request_permission``, and its verdict (a cancelled request denies)."""
        params = asked.mapper.permission_params(asked.session.id, call)
        response = await self._request("session/request_permission", params, None)
        await self._restore(asked, call)
        return acp.verdict_of(response)

    async def _restore(self, asked: Asked, call: ToolCallBlock) -> None:
        for update in asked.mapper.restore_after_permission(call):
            await self._notify(asked.session.id, update)

    async def answer_with(self, asked: Asked, content: tuple[UserContent, ...]) -> bool:
        """A prompt that answers the question the person chose to answer in their next
        message: True once the question took it, False when there is none or it waits no
        more (the prompt is then an ordinary one). Raises :class:`SessionClosed` when the
        editor closed the session since the prompt found it: the answer is not taken, and
        the question stays pending in the trace (asked again on load)."""
        if asked.answer_next is None:
            return False
        session_id, call_id = asked.answer_next
        if asked.closed:
            # No checkpoint between this and the host's lookup: an answer handed on once
            # the close began would have the host load the session again with its own
            # tools and model, off the connection (R-HITL-1, R-HOST-3).
            raise SessionClosed(f"session {asked.session.id} is closed")
        asked.answer_next = None
        text = "\n".join(b.text for b in content if isinstance(b, TextBlock))
        try:
            await self._host.answer_question(session_id, call_id, text, by=self._person)
        except (NotPending, SessionNotFound) as exc:
            _log(f"the prompt does not answer question {call_id}: {exc}")
            return False
        return True


def _log(message: str) -> None:
    print(f"greenroom acp: {message}", file=sys.stderr, flush=True)
