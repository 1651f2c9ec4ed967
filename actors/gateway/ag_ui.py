"""The AG-UI endpoint of ``serve --ag-ui`` (R-PROTO-2): ``POST /ag-ui`` with a
``RunAgentInput`` answers a ``text/event-stream`` of AG-UI events, on the gateway's port
and tokens (:mod:`greenroom.actors.gateway.http_front`).

The mapping is :mod:`greenroom.protocols.ag_ui`; this module does the I/O. The input is
validated with the ``ag-ui-protocol`` package's models; a bad one is 400 naming the
field. ``threadId`` is the session id: a thread of the caller's goes on, an unknown one is
created (with that id, the server's defaults, counted against the caller's sessions), one
of another principal is 403 (R-SEC-4).

One request does one of three things:

* **run**: the user messages at the end of ``messages`` start a task (409 while the
  thread runs or waits for an answer), with the run's ``context`` and changed ``state``
  as notes for the model; their image parts are attached as any inline image is
  (``Session.attach_image_data``: the session's ``max_image_bytes``, an ``image/`` type,
  R-SEC-8), and one that cannot be is 400 naming the part (a new thread's session is
  then deleted again) — the HTTP front reads a run's body up to the frame cap beside an
  image of the server's ``max_image_bytes`` (:meth:`AgUiEndpoint.body_limit`), so such an
  image meets that rule, not the frame cap;
* **resume** (``resume`` entries, or ``tool`` messages with the results of front-end
  calls): answer what the last run ended on, as the caller's principal (R-HITL-2), and
  stream the task from where it waited — in the session loaded again, with the server's
  tools and model, when the host began to close it once its interrupts were found;
* **reconnect** (a ``Last-Event-ID`` header, the ``id`` of the last event received):
  stream the thread again from there — the trace's seq replay — without starting
  anything.

The run's ``tools`` become the session's client tools (``Session.set_client_tools``) for
its tasks; one named like a tool of the session's own is 400 (on an unknown thread, checked
against the server's tools before its session is made, and that session deleted again when
one of its MCP servers' tools takes the name). The runtime keeps them next
to the session's ``session.json`` (:data:`FRONT_END_TOOLS_FILE`,
:mod:`~greenroom.actors.runtime.client_tools_file`), and every load of the session gives
them back: the thread's session loaded again — after its close or a restart, by this
endpoint, a websocket ``answer``, ``serve``'s resumed tasks — has them for the task it
takes up and the next runs.

Every run's events come from the session (:class:`SessionFeed`), never from the task's
own channel: a front end that disconnects loses nothing, the task goes on, and it
reconnects from its last event id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pydantic
from ag_ui.core import RunAgentInput

from greenroom.actors.gateway.access import NotYours
from greenroom.actors.gateway.config import SESSION_ID
from greenroom.actors.gateway.feeds import SessionFeed
from greenroom.actors.gateway.http_front import BodyLimit, EventSink, HttpRequest, Reply
from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.gateway.methods import Methods, loading_unless_open
from greenroom.actors.runtime.client_tools_file import (
    CLIENT_TOOLS_FILE,
    give_client_tools,
    keep_client_tools,
)
from greenroom.actors.runtime.errors import (
    ConfigurationError,
    GreenroomError,
    ImageRefused,
    SessionNotFound,
)
from greenroom.actors.runtime.session import Session, client_tools_problem
from greenroom.protocols import ag_ui, jsonrpc
from greenroom.protocols.content import TextBlock, UserContent
from greenroom.protocols.jsonrpc import RpcError
from greenroom.protocols.outputs import ApprovalRequest, Output
from greenroom.protocols.people import PendingApproval, Verdict
from greenroom.protocols.settings import DEFAULT_MAX_IMAGE_BYTES
from greenroom.protocols.tools import Tool, client_tool, value_too_deep

__all__ = ["AG_UI_PATH", "FRONT_END_TOOLS_FILE", "AgUiEndpoint"]

AG_UI_PATH = "/ag-ui"

LAST_EVENT_ID = re.compile(r"[0-9]{1,18}")
"""An event id this endpoint gives: ASCII digits (``str.isdigit`` takes ``²`` too)."""
BAD_LAST_EVENT_ID = "Last-Event-ID: the id of an event of this endpoint (a number)"
"""Why a ``Last-Event-ID`` that is not :data:`LAST_EVENT_ID` is refused."""
MAX_TEXT_CHARS = 100_000
"""The longest text a run's new user messages may carry."""
FRONT_END_TOOLS_FILE = CLIENT_TOOLS_FILE
"""A thread's front-end tools as its last run gave them (AG-UI's ``name``,
``description``, ``parameters``), next to the session's ``session.json``: the runtime's
kept client tools."""


class _Refused(Exception):
    """An input answered with an HTTP error before any event."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AgUiEndpoint:
    """Answers ``POST /ag-ui``. Holds no channel and starts no task: each run streams in
    its connection's task."""

    def __init__(self, methods: Methods) -> None:
        self._methods = methods
        self._states: dict[str, str] = {}
        """The state each thread's front end sent last (JSON), to tell the model of a
        change only; forgotten with the process (the state is told again once)."""

    def body_limit(self, frame_bytes: int) -> BodyLimit:
        """The largest run body the HTTP front reads (R-SEC-1, R-SEC-9): ``frame_bytes``
        (the gateway's frame cap) beside one image of the server's ``max_image_bytes`` as
        base64, so an image the image rule admits meets that rule, and its clear answer,
        rather than the frame cap."""
        image = self._methods.defaults.settings.get("max_image_bytes", DEFAULT_MAX_IMAGE_BYTES)
        if not isinstance(image, int) or isinstance(image, bool) or image < 0:
            image = DEFAULT_MAX_IMAGE_BYTES  # refused where sessions are made, not here
        room = f"an image of at most max_image_bytes ({image} bytes) as base64, and {frame_bytes}"
        return BodyLimit(
            max_bytes=frame_bytes + 4 * ((image + 2) // 3), room_for=room + " bytes of the rest"
        )

    async def respond(self, request: HttpRequest, reply: Reply) -> None:
        """One run: its events, or an HTTP error when the input is refused."""
        try:
            run = self._input(request.body)
            last_event = request.headers.get("last-event-id")
            session, created = await self._thread(request.principal, run, last_event)
            shown: list[Output] | None = None
            try:
                tools = await self._client_tools(session, run)
                if last_event is not None:
                    feed, pending, shown = await self._reconnect(session, last_event)
                elif run.resume or await self._tool_results(session, run):
                    feed, pending, shown = await self._resume(
                        session, run, request.principal, tools
                    )
                else:
                    feed, pending = await self._start(session, run), []
            except _Refused:
                if created:
                    # A tool of its MCP servers, known once it was made, has the name of
                    # a front-end tool, or an image cannot be attached: the refused run
                    # leaves no session (R-SEC-9).
                    await self._methods.creation.undo(request.principal, session)
                raise
        except _Refused as exc:
            await reply.error(exc.status, str(exc))
            return
        except RpcError as exc:
            status = exc.code if 400 <= exc.code < 600 else 400
            await reply.error(status, exc.message)
            return
        except GreenroomError as exc:  # Busy (409), AuthLocked (423), NotPending (409)…
            code = getattr(exc, "code", 400)
            status = code if isinstance(code, int) and 400 <= code < 600 else 400
            await reply.error(status, str(exc))
            return
        names = frozenset(t.name for t in tools)
        mapper = ag_ui.RunMapper(thread_id=session.id, run_id=run.run_id, client_tools=names)
        if shown is not None:
            # The replay starts after the records the front end was shown (for a resume,
            # those up to its request, which may have been asked while the model still
            # wrote its turn): the mapper takes its turn and block count from them, or
            # the turn's later blocks would get other ids than a reconnect gives them.
            mapper.join(shown)
        with feed:

            async def produce(sink: EventSink) -> None:
                await _stream(feed, mapper, pending, sink)

            await reply.events(produce)

    def _input(self, body: bytes) -> RunAgentInput:
        try:
            # Not json.loads: a NaN or 1e999 in a front-end tool's schema would be kept
            # with the thread, and no request to a provider could carry it.
            value = jsonrpc.decode_json(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise _Refused(400, f"the body is not JSON: {exc}") from None
        if value_too_deep(value, jsonrpc.MAX_DEPTH):
            raise _Refused(400, f"the body is nested deeper than {jsonrpc.MAX_DEPTH} levels")
        try:
            run = RunAgentInput.model_validate(ag_ui.upgrade_binary_parts(value))
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"$.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
            )
            raise _Refused(400, f"not a RunAgentInput: {problems}") from None
        if not SESSION_ID.fullmatch(run.thread_id):
            raise _Refused(400, "$.threadId: letters, digits and ._- only, at most 128")
        if len(run.run_id) > 200:
            raise _Refused(400, "$.runId: at most 200 characters")
        return run

    async def _thread(
        self, principal: str, run: RunAgentInput, last_event: str | None
    ) -> tuple[Session, bool]:
        """The thread's session: the caller's, or a new one for an unknown thread once the
        run is found to be one that can start it (a refused run makes no session); and
        whether it was made now."""
        try:
            return await self._methods.owned_session(principal, run.thread_id, node=False), False
        except RpcError as exc:
            if exc.code != jsonrpc.NOT_FOUND or isinstance(exc, NotYours):
                raise  # another principal's thread is never made anew
        if last_event is not None:
            if not LAST_EVENT_ID.fullmatch(last_event):
                raise _Refused(400, BAD_LAST_EVENT_ID)
            raise _Refused(
                404, f"no thread {jsonrpc.echo(run.thread_id)} to pick up from Last-Event-ID"
            )
        if run.resume:
            interrupt = jsonrpc.echo(run.resume[0].interrupt_id)
            raise _Refused(409, f"no pending interrupt {interrupt} in this thread")
        _new_input(run)
        if run.tools:
            try:
                given = ag_ui.client_tools(t.model_dump() for t in run.tools)
            except ag_ui.ClientToolError as exc:
                raise _Refused(400, str(exc)) from None
            # The server's tools a new session gets; its MCP servers' are known only once
            # it is made (``respond`` deletes it again when one of theirs is taken).
            own = frozenset(t.name for t in self._methods.defaults.tools)
            problem = client_tools_problem(own, [client_tool(*tool) for tool in given])
            if problem is not None:
                raise _Refused(400, f"$.tools: {problem}")
        _checked_notes(run, state_changed=True)
        return await self._methods.create_session_for(principal, session_id=run.thread_id), True

    async def _client_tools(self, session: Session, run: RunAgentInput) -> tuple[Tool, ...]:
        """Make the run's front-end tools the session's client tools, and keep them for
        the thread (when it gives any: a run without ``tools`` keeps those of the thread's
        last run, which every load of its session gives back); the tools."""
        port = session.host.port(session.id)
        if run.tools:
            try:
                given = ag_ui.client_tools(t.model_dump() for t in run.tools)
            except ag_ui.ClientToolError as exc:
                raise _Refused(400, str(exc)) from None
            before = [t.schema for t in port.client_tools]
            try:
                session.set_client_tools([client_tool(*tool) for tool in given])
            except ConfigurationError as exc:
                raise _Refused(400, f"$.tools: {exc}") from None
            if [t.schema for t in port.client_tools] != before:
                # Kept once per change: a front end sends its tools with every run.
                await keep_client_tools(port)
        return port.client_tools

    async def _tool_results(self, session: Session, run: RunAgentInput) -> dict[str, str]:
        """The results the run's ``tool`` messages give the front-end calls that wait."""
        client = {t.name for t in session.host.port(session.id).client_tools}
        waiting = [
            p.call_id for p in await self._pending(session)
            if p.kind == "question" and p.tool in client
        ]
        if not waiting:
            return {}
        return ag_ui.tool_results((m.model_dump(by_alias=True) for m in run.messages), waiting)

    async def _pending(self, session: Session) -> list[PendingApproval]:
        return [
            p
            for p in await self._methods.host.pending_approvals(read_only=True)
            if p.session_id == session.id
        ]

    async def _start(self, session: Session, run: RunAgentInput) -> SessionFeed:
        text, images = _new_input(run)
        notes = self._notes(session, run)
        if await self._pending(session):
            raise _Refused(409, "the thread waits for answers: send them as resume entries")
        content: list[UserContent] = [TextBlock(text=t) for t in (notes, text) if t]
        for where, media_type, data in images:
            try:
                content.append(await session.attach_image_data(data, media_type))
            except ImageRefused as exc:
                raise _Refused(400, f"{where}: {exc.reason}") from None
        session = await self._methods.settled(session)
        # Live only: the session is idle, so every output of the new task follows.
        feed = SessionFeed(session, session.host.port(session.id).last_seq, replay=False)
        try:
            stream = session.run(content, approve=self._methods.approver())
        except BaseException:
            feed.close()
            raise
        stream.detach()  # read through the feed, which a disconnect cannot lose
        return feed

    def _notes(self, session: Session, run: RunAgentInput) -> str:
        """The front end's context and changed state, as text for the model."""
        state = json.dumps(run.state, sort_keys=True, default=str)
        notes = _checked_notes(run, state_changed=self._states.get(session.id) != state)
        self._states[session.id] = state
        return notes

    async def _resume(
        self, session: Session, run: RunAgentInput, principal: str, tools: Sequence[Tool]
    ) -> tuple[SessionFeed, list[PendingApproval], list[Output]]:
        """Answer what the run's ``resume`` entries and tool messages answer; the feed
        from the latest request answered, the requests still open that were asked before
        it, and the records up to it (what the front end was shown)."""
        pending = {p.call_id: p for p in await self._pending(session)}
        entries = run.resume or []
        unknown = [e.interrupt_id for e in entries if e.interrupt_id not in pending]
        if unknown:
            raise _Refused(409, f"no pending interrupt {jsonrpc.echo(unknown[0])} in this thread")
        answers: list[tuple[PendingApproval, tuple[Verdict | None, str | None]]] = [
            (pending[call_id], (None, result))
            for call_id, result in (await self._tool_results(session, run)).items()
        ]
        records = await replay_records(session, 0)
        for entry in entries:
            request = pending[entry.interrupt_id]
            try:
                answer = ag_ui.parse_resume(entry.model_dump(), request.kind)
            except ag_ui.ResumeError as exc:
                raise _Refused(400, f"$.resume[{entry.interrupt_id}]: {exc}") from None
            answers.append((request, answer))
        # Checked before any answer is given: the second answer to one call would be
        # refused only once the first had been recorded, the run answered 409 yet decided.
        seen: set[str] = set()
        for request, _ in answers:
            if request.call_id in seen:
                raise _Refused(
                    400, f"$.resume: interrupt {jsonrpc.echo(request.call_id)} answered twice"
                )
            seen.add(request.call_id)
        # Where the task waited: the latest request answered.
        answered = {request.call_id for request, _ in answers}
        asked = [
            r.seq or 0
            for r in records
            if isinstance(r, ApprovalRequest) and r.call_id in answered and r.origin is None
        ]
        after = max(asked) if asked else session.host.port(session.id).last_seq
        feed = SessionFeed(session, after)
        host = self._methods.host
        try:
            for request, (verdict, text) in answers:
                load = loading_unless_open(host, self._methods.defaults, session.id, principal)
                if load:
                    # Closed since its interrupts were found: loaded here, to be given the
                    # run's front-end tools before its task goes on with the answer.
                    _with_tools(await host.load_session(session.id, **load), tools)
                # No checkpoint from the look at the host's sessions to its lookup: a
                # session whose close began since its interrupts were found is loaded with
                # the server's tools and model, not the host's own (R-HITL-1).
                load = loading_unless_open(host, self._methods.defaults, session.id, principal)
                if text is not None:
                    await host.answer_question(
                        session.id, request.call_id, text, by=principal, **load
                    )
                elif verdict is not None:
                    await host.answer_approval(
                        session.id, request.call_id, verdict, by=principal, **load
                    )
            loaded = _loaded_again(session)
            if loaded is not None:
                # The task goes on in the session loaded again: stream that one.
                _with_tools(loaded, tools)
                feed.close()
                feed = SessionFeed(loaded, after)
        except BaseException:
            feed.close()
            raise
        still = [p for p in pending.values() if p.call_id not in answered]
        shown = [r for r in records if (r.seq or 0) <= after]
        return feed, [p for p in still if _asked_before(records, p, after)], shown

    async def _reconnect(
        self, session: Session, last_event: str
    ) -> tuple[SessionFeed, list[PendingApproval], list[Output]]:
        """The feed from ``last_event``, the requests asked before it (the replay will
        not show them), and the records up to it (what the front end was shown)."""
        if not LAST_EVENT_ID.fullmatch(last_event):
            raise _Refused(400, BAD_LAST_EVENT_ID)
        after = int(last_event)
        last = session.host.port(session.id).last_seq
        if after > last:
            # No event carried it: streaming from there would end the run at once, as if
            # it had finished, whatever the thread does.
            raise _Refused(
                400, f"Last-Event-ID: {after} is past the thread's last event id ({last})"
            )
        records = await replay_records(session, 0)
        pending = [p for p in await self._pending(session) if _asked_before(records, p, after)]
        shown = [r for r in records if (r.seq or 0) <= after]
        return SessionFeed(session, after), pending, shown


def _new_input(run: RunAgentInput) -> tuple[str, list[tuple[str, str, str]]]:
    """The user's new input of ``run`` (its last user messages): their text, and their
    images (``(where, media type, base64 data)``, not attached yet); or 400."""
    messages = [m.model_dump(by_alias=True) for m in run.messages]
    text = ag_ui.new_input(messages)
    try:
        images = ag_ui.new_images(messages)
    except ag_ui.ImageInputError as exc:
        raise _Refused(400, str(exc)) from None
    if not text.strip() and not images:
        raise _Refused(400, "$.messages: no user message after the agent's last one")
    if len(text) > MAX_TEXT_CHARS:
        raise _Refused(400, f"$.messages: more than {MAX_TEXT_CHARS} characters of text")
    return text, images


def _checked_notes(run: RunAgentInput, *, state_changed: bool) -> str:
    """The front end's context (and its state when ``state_changed``) as text for the
    model, or 400 when it is longer than the model is given."""
    notes = ag_ui.front_end_notes(
        (c.model_dump() for c in run.context or ()), run.state, state_changed=state_changed
    )
    if len(notes) > ag_ui.MAX_NOTES_CHARS:
        raise _Refused(
            400, f"$.context and $.state: more than {ag_ui.MAX_NOTES_CHARS} characters as text"
        )
    return notes


def _with_tools(session: Session, tools: Sequence[Tool]) -> tuple[Tool, ...]:
    """Give the thread's open session — loaded again — the run's front-end ``tools`` when
    it has no client tools (its kept ones could not be read, or were not kept: a failed
    write); the client tools it has."""
    try:
        port = session.host.port(session.id)
    except SessionNotFound:
        return tuple(tools)  # closed meanwhile: the load that answers it gives the kept
    return give_client_tools(port, tools)


def _loaded_again(session: Session) -> Session | None:
    """The session the host lists under ``session``'s id when that is another (``session``
    was closed and loaded again), else None."""
    try:
        listed = session.host.get_session(session.id)
    except SessionNotFound:
        return None
    return None if listed is session else listed


def _asked_before(records: list[Any], request: PendingApproval, after: int) -> bool:
    """Whether ``request`` was asked at or before seq ``after`` (a replay from ``after``
    will not show it)."""
    for record in records:
        if isinstance(record, ApprovalRequest) and record.call_id == request.call_id:
            return (record.seq or 0) <= after
    return True


async def _stream(
    feed: SessionFeed,
    mapper: ag_ui.RunMapper,
    pending: list[PendingApproval],
    sink: EventSink,
) -> None:
    """The run's events until it ends: its task's end, an interrupt, or the session's
    close. Each event's id is the seq of the last output it reflects whole."""
    cursor = feed.last_seq
    for event in mapper.started(pending):
        await sink.send(jsonrpc.encode(event), event_id=str(cursor))
    while not mapper.ended:
        if mapper.waiting:
            for event in mapper.interrupted():
                await sink.send(jsonrpc.encode(event), event_id=str(cursor))
            return
        if not feed.session.busy and feed.caught_up:
            # Nothing runs and nothing is left to replay: the thread is idle.
            for event in mapper.idle():
                await sink.send(jsonrpc.encode(event), event_id=str(cursor))
            return
        batch = await feed.next_batch()
        if batch is None:
            message = {"type": "RUN_ERROR", "message": "the session closed", "code": "closed"}
            await sink.send(jsonrpc.encode(message), event_id=str(cursor))
            return
        for output in batch:
            events = mapper.map(output)
            for number, event in enumerate(events, start=1):
                last = number == len(events) and output.seq is not None
                await sink.send(
                    jsonrpc.encode(event), event_id=str(output.seq if last else cursor)
                )
            cursor = output.seq or cursor
        # A reconnect's first batch is the trace's replay: the outputs that follow are
        # live, and the block open now may have lost its first pieces (RunMapper.join).
        mapper.caught_up()
