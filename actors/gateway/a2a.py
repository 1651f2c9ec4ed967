"""The A2A server of ``serve --a2a`` (R-PROTO-1): the agent card at
``/.well-known/agent-card.json`` and JSON-RPC at ``/a2a`` (``message/send``,
``message/stream``, ``tasks/get``, ``tasks/cancel``, ``tasks/resubscribe``), on the
gateway's port and tokens (:mod:`greenroom.actors.gateway.http_front`).

The mapping is :mod:`greenroom.protocols.a2a`; this module does the I/O. Requests are
validated with the a2a-sdk's models of the protocol (its v0.3 binding, pydantic), so a
request the SDK would not send gets ``-32602`` naming the field, never a traceback.

Sessions are reached as the websocket methods reach them (:class:`Methods`): a context
of another principal, or one that does not exist, is "not found" alike (nothing says
which); a new context is created with the server's defaults and counts against the
principal's sessions (R-SEC-9).

A message to a context whose task waits for a person (``input-required``) answers it
(R-HITL-2, as the caller's principal) — in the session loaded again, with the server's
tools and model, when the host began to close it meanwhile (R-HITL-1: the request waits
in its trace); to a running task (its ``taskId``) it steers it; otherwise it starts a
task. A task's outputs are read from the session (:class:`SessionFeed`), never from the
task's own channel: a stream that is cut off loses nothing, and ``tasks/resubscribe``
picks it up again. A client that goes away ends its wait, never the task: a stream's
producer is cancelled, and so is the wait of a blocking ``message/send``
(:meth:`Reply.unless_gone`), which then answers nothing.

The images a task's tools returned (its artifacts) are read from the session's private
copies (R-SEC-8) in a worker thread before the task's fold meets them (:class:`_TaskFold`),
never in the event loop's thread.

A message is delivered once (A2A: the ``messageId`` names the message): a message whose
id was delivered before — a client's retry after a lost answer — is answered with the task
that first delivery went to (the ``Task`` now, followed as the first answer would have
been), and nothing runs again (:class:`_Deliveries`). The ids of a context are kept in its
session's directory (:data:`MESSAGE_IDS_FILE`, the last
:data:`~greenroom.protocols.a2a.MAX_REMEMBERED_IDS`), so they outlive a restart as its
tasks do; those of a message that made its context (no ``contextId``) are kept per
principal in memory only (the retry's context is unknown to the client, and so to the
files). A retry that comes while its first delivery is still being made waits for it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import pydantic
import trio
from a2a.compat.v0_3 import types as a2a_types

from greenroom.actors.gateway.feeds import SessionFeed
from greenroom.actors.gateway.http_front import EventSink, HttpRequest, Reply
from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.gateway.methods import Methods, once_recorded
from greenroom.actors.gateway.queue_room import NOT_HANDED_OVER, check_open
from greenroom.actors.providers import read_image
from greenroom.actors.runtime.client_tools_file import replace_private_file
from greenroom.actors.runtime.errors import GreenroomError, SessionNotFound
from greenroom.actors.runtime.session import Session
from greenroom.protocols import a2a, jsonrpc
from greenroom.protocols.content import ImageBlock, TextBlock
from greenroom.protocols.context import ImageSource
from greenroom.protocols.jsonrpc import Request, RpcError
from greenroom.protocols.outputs import ApprovalRequest, Output, ToolCallOutput

__all__ = ["A2A_PATH", "CARD_PATH", "MESSAGE_IDS_FILE", "A2aEndpoint"]

logger = logging.getLogger(__name__)

CARD_PATH = "/.well-known/agent-card.json"
A2A_PATH = "/a2a"

MAX_TEXT_CHARS = 100_000
"""The longest text a message may carry."""
NO_TEXT_TO_START = "$.params.message.parts: no text to start a task"
"""Why a message that would start a task but carries no text is refused."""

MESSAGE_IDS_FILE = "a2a_messages.json"
"""The message ids a context was sent and the task each went to (JSON, the newest
:data:`~greenroom.protocols.a2a.MAX_REMEMBERED_IDS`), next to its session's
``session.json``."""

MAX_CACHED_CONTEXTS = 1024
"""The most contexts whose message ids are held in memory (others are read again)."""
MAX_MADE_IDS = 4096
"""The most ids of messages that made their context remembered (all principals)."""

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252})(:\d{1,5})?")

_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "message/send": a2a_types.SendMessageRequest,
    "message/stream": a2a_types.SendStreamingMessageRequest,
    "tasks/get": a2a_types.GetTaskRequest,
    "tasks/cancel": a2a_types.CancelTaskRequest,
    "tasks/resubscribe": a2a_types.TaskResubscriptionRequest,
}


class A2aEndpoint:
    """Answers the agent card and the JSON-RPC calls. ``listen_url`` gives the
    ``http://HOST:PORT`` of the gateway for a request without a usable ``Host`` header.
    Holds no channel and starts no task: each call runs in its connection's task."""

    def __init__(self, methods: Methods, *, listen_url: Callable[[], str], version: str) -> None:
        self._methods = methods
        self._listen_url = listen_url
        self._version = version
        self._deliveries = _Deliveries()

    async def respond(self, request: HttpRequest, reply: Reply) -> None:
        """The card (GET) or one JSON-RPC call (POST)."""
        if request.path == CARD_PATH:
            await reply.json(200, self._card(request.host))
            return
        try:
            body = request.body.decode("utf-8")
        except UnicodeDecodeError:
            error = RpcError(jsonrpc.PARSE_ERROR, "the body is not UTF-8 text")
            await reply.json(200, jsonrpc.error_frame(None, error))
            return
        frame = jsonrpc.parse_frame(body, max_bytes=len(request.body) + 1)
        if not isinstance(frame, Request):
            error = (
                frame.error
                if isinstance(frame, jsonrpc.FrameError)
                else RpcError(jsonrpc.INVALID_REQUEST, "one request with an id, not a batch")
            )
            request_id = frame.id if isinstance(frame, jsonrpc.FrameError) else None
            await reply.json(200, jsonrpc.error_frame(request_id, error))
            return
        try:
            await self._call(frame, request.principal, reply)
        except RpcError as exc:
            await reply.json(200, jsonrpc.error_frame(frame.id, exc))
        except GreenroomError as exc:
            error = RpcError(getattr(exc, "code", jsonrpc.INTERNAL_ERROR), str(exc))
            await reply.json(200, jsonrpc.error_frame(frame.id, error))

    def _card(self, host_header: str) -> dict[str, Any]:
        base = f"http://{host_header}" if _HOST.fullmatch(host_header) else self._listen_url()
        defaults = self._methods.defaults
        skills = a2a.skills_of(((t.name, t.description) for t in defaults.tools), defaults.system)
        description = " ".join((defaults.system or "").split())[:500] or (
            "A greenroom agent: it answers, and works in its workspace with its tools."
        )
        return a2a.agent_card(
            url=base + A2A_PATH, description=description, skills=skills, version=self._version
        )

    async def _call(self, frame: Request, principal: str, reply: Reply) -> None:
        model = _MODELS.get(frame.method)
        if model is None:
            raise RpcError(
                jsonrpc.METHOD_NOT_FOUND,
                f"unknown method {jsonrpc.echo(frame.method)}; this agent serves "
                + ", ".join(a2a.METHODS),
            )
        try:
            call = model.model_validate(
                {"jsonrpc": "2.0", "id": frame.id, "method": frame.method, "params": frame.params}
            )
        except pydantic.ValidationError as exc:
            problems = "; ".join(
                f"$.params.{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}"
                for e in exc.errors()[:5]
            )
            raise RpcError(jsonrpc.INVALID_PARAMS, problems) from None
        params: Any = getattr(call, "params")  # noqa: B009 - each model's own params class
        match frame.method:
            case "message/send" | "message/stream":
                await self._message(frame, params, principal, reply)
            case "tasks/get":
                fold = await self._fold(principal, params.id)
                result = fold.task(params.history_length)
                await reply.json(200, jsonrpc.result_frame(frame.id, result))
            case "tasks/cancel":
                await reply.json(
                    200, jsonrpc.result_frame(frame.id, await self._cancel(principal, params.id))
                )
            case "tasks/resubscribe":
                await self._resubscribe(frame, principal, params.id, reply)

    # -- sessions and tasks ---------------------------------------------------------------

    async def _session(self, principal: str, session_id: str, what: str) -> Session:
        try:
            return await self._methods.owned_session(principal, session_id, node=False)
        except RpcError as exc:
            if exc.code in (jsonrpc.FORBIDDEN, jsonrpc.NOT_FOUND, jsonrpc.INVALID_PARAMS):
                # Another client's and a missing one alike: nothing says which.
                code = a2a.TASK_NOT_FOUND if what == "task" else jsonrpc.INVALID_PARAMS
                raise RpcError(
                    code, f"no {what} {jsonrpc.echo(session_id)} of this client"
                ) from None
            raise

    async def _task_session(self, principal: str, task: str) -> tuple[Session, str]:
        ids = a2a.split_task_id(task)
        if ids is None:
            raise RpcError(a2a.TASK_NOT_FOUND, f"no task {jsonrpc.echo(task)}")
        session_id, run_id = ids
        return await self._session(principal, session_id, "task"), run_id

    def _new_fold(self, session: Session, run_id: str, **kwargs: Any) -> _TaskFold:
        return _TaskFold(session.attachments.source, context_id=session.id, run_id=run_id, **kwargs)

    async def _fold(self, principal: str, task: str) -> _TaskFold:
        session, run_id = await self._task_session(principal, task)
        fold = self._new_fold(session, run_id)
        await fold.take(await replay_records(session, 0))
        if not fold.seen:
            raise RpcError(a2a.TASK_NOT_FOUND, f"no task {jsonrpc.echo(task)}")
        return fold

    async def _cancel(self, principal: str, task: str) -> dict[str, Any]:
        fold = await self._fold(principal, task)
        if fold.state in a2a.END_STATES:
            raise RpcError(a2a.TASK_NOT_CANCELABLE, f"task {jsonrpc.echo(task)} is {fold.state}")
        session, run_id = await self._task_session(principal, task)
        with SessionFeed(session, 0) as feed:
            fold = self._new_fold(session, run_id)
            session.interrupt("canceled by the A2A client")
            while fold.state not in a2a.END_STATES:
                batch = await feed.next_batch()
                if batch is None:
                    break
                await fold.take(batch)
        return fold.task()

    async def _resubscribe(self, frame: Request, principal: str, task: str, reply: Reply) -> None:
        session, run_id = await self._task_session(principal, task)
        with SessionFeed(session, 0) as feed:
            fold = self._new_fold(session, run_id)
            await fold.take(await _caught_up(feed))
            if not fold.seen:
                raise RpcError(a2a.TASK_NOT_FOUND, f"no task {jsonrpc.echo(task)}")

            async def produce(sink: EventSink) -> None:
                await sink.send(jsonrpc.encode(jsonrpc.result_frame(frame.id, fold.task())))
                await self._follow(feed, fold, frame, sink, ())

            await reply.events(produce)

    async def _follow(
        self,
        feed: SessionFeed,
        fold: _TaskFold,
        frame: Request,
        sink: EventSink | None,
        answered: Collection[ApprovalRequest],
    ) -> None:
        """Fold the task's outputs (sending their events to ``sink``) until a stream of
        it ends: an end state, or ``input-required`` once none of the requests
        ``answered`` is pending (before, the one answered is still the one pending; a
        call asked again — its question once it runs — is another request)."""
        while not (
            fold.state in a2a.END_STATES
            or (
                fold.state == "input-required"
                and not any(fold.pending.get(r.call_id) is r for r in answered)
            )
        ):
            batch = await feed.next_batch()
            if batch is None:
                return
            for event in await fold.take(batch):
                if sink is not None:
                    await sink.send(jsonrpc.encode(jsonrpc.result_frame(frame.id, event)))

    # -- message/send, message/stream -------------------------------------------------------

    async def _message(self, frame: Request, params: Any, principal: str, reply: Reply) -> None:
        sent = params.message
        if sent.role != a2a_types.Role.user:
            raise RpcError(jsonrpc.INVALID_PARAMS, "$.params.message.role: must be user")
        texts: list[str] = []
        data: list[dict[str, Any]] = []
        for part in sent.parts:
            inner = part.root
            if isinstance(inner, a2a_types.TextPart):
                texts.append(inner.text)
            elif isinstance(inner, a2a_types.DataPart):
                data.append(inner.data)
            else:
                raise RpcError(
                    a2a.CONTENT_TYPE_NOT_SUPPORTED, "this agent takes text and data parts only"
                )
        text = "\n".join(texts)
        if len(text) > MAX_TEXT_CHARS:
            raise RpcError(jsonrpc.INVALID_PARAMS, f"text longer than {MAX_TEXT_CHARS} characters")
        streaming = frame.method == "message/stream"
        configuration = params.configuration
        blocking = configuration is None or configuration.blocking is not False
        # The most recent history messages the Task answered carries (A2A 0.3), as for
        # tasks/get; the events that follow carry no history.
        history_length = None if configuration is None else configuration.history_length
        key = a2a.message_key(sent.message_id)
        new = sent.context_id is None and sent.task_id is None
        async with self._deliveries.one_at_a_time(
            (principal, sent.context_id or "", sent.task_id or "", key)
        ):
            session, run_id, again = await self._route(principal, sent, key, text)
            keep: Callable[[], Awaitable[None]] = _nothing
            if again:
                feed, fold, answered = await self._delivered_before(session, run_id)
            else:
                feed, fold, answered = await self._delivered(
                    session, run_id, text, data, principal
                )
                try:
                    keep = await self._deliveries.remember(
                        feed.session, key, fold.run_id, made_by=principal if new else None
                    )
                except BaseException:
                    feed.close()
                    raise
        with feed:

            async def produce(sink: EventSink | None) -> None:
                if sink is not None:
                    task = fold.task(history_length)
                    await sink.send(jsonrpc.encode(jsonrpc.result_frame(frame.id, task)))
                # Kept where a client that goes away stops the wait (the write goes on),
                # once a stream's client has the task's id.
                await keep()
                await self._follow(feed, fold, frame, sink, answered)

            if streaming:
                await reply.events(produce)
                return
            # A client that goes away stops the wait, as a stream's does: the task goes
            # on (tasks/get and tasks/resubscribe find it), nothing is answered.
            if blocking and not await reply.unless_gone(lambda: produce(None)):
                return
            if not blocking:
                await keep()
            await reply.json(200, jsonrpc.result_frame(frame.id, fold.task(history_length)))

    async def _route(
        self, principal: str, sent: Any, key: str, text: str
    ) -> tuple[Session, str | None, bool]:
        """The session a message goes to, the run it names and whether it was delivered
        before (the run is then the task that first delivery went to)."""
        if sent.context_id is None and sent.task_id is None:
            made = self._deliveries.made(principal, key)
            if made is not None:
                with contextlib.suppress(RpcError):  # its context is gone since: a new one
                    session, run_id = await self._task_session(principal, made)
                    return session, run_id, True
        session, named_run = await self._target(principal, sent.context_id, sent.task_id, text)
        if sent.context_id is not None or sent.task_id is not None:
            went_to = (await self._deliveries.ids_of(session)).run_of(key)
            # The same id in another task is another message (a careless client's).
            if went_to is not None and named_run in (None, went_to):
                return session, went_to, True
        return session, named_run, False

    async def _delivered_before(
        self, session: Session, run_id: str | None
    ) -> tuple[SessionFeed, _TaskFold, Collection[ApprovalRequest]]:
        """The feed and fold of the task a message delivered before went to: answered as
        that delivery was, from the task's state now."""
        assert run_id is not None
        feed = SessionFeed(session, 0)
        try:
            fold = self._new_fold(session, run_id)
            await fold.take(await _caught_up(feed))
            if not fold.seen:
                raise RpcError(
                    a2a.TASK_NOT_FOUND,
                    f"the task this message went to ({session.id}:{run_id}) is gone",
                )
        except BaseException:
            feed.close()
            raise
        return feed, fold, ()

    async def _target(
        self, principal: str, context_id: str | None, task: str | None, text: str
    ) -> tuple[Session, str | None]:
        """The session a message goes to (a new one without ids, once ``text`` can start
        its task) and the run it names."""
        if task is not None:
            session, run_id = await self._task_session(principal, task)
            if context_id is not None and context_id != session.id:
                raise RpcError(jsonrpc.INVALID_PARAMS, "taskId is not a task of contextId")
            return session, run_id
        if context_id is not None:
            return await self._session(principal, context_id, "context"), None
        if not text.strip():
            # Refused before the new context is made: a refused message makes no session.
            raise RpcError(jsonrpc.INVALID_PARAMS, NO_TEXT_TO_START)
        return await self._methods.create_session_for(principal), None

    async def _delivered(
        self,
        session: Session,
        named_run: str | None,
        text: str,
        data: list[dict[str, Any]],
        principal: str,
    ) -> tuple[SessionFeed, _TaskFold, Collection[ApprovalRequest]]:
        """:meth:`_deliver`, and the feed of the session the message went to (the caller
        closes it): a session whose close began before its pending requests were answered
        is loaded again and the message delivered there."""
        while True:
            feed = SessionFeed(session, 0, replay=True)
            try:
                fold, answered = await self._deliver(
                    session, named_run, text, data, principal, feed
                )
            except _ClosedBeforeTheAnswer:
                feed.close()
                # Loaded as any call on a closed session loads it, with the server's tools
                # and model; the host alone would load it with its own (R-HITL-1).
                session = await self._session(principal, session.id, "context")
                continue
            except BaseException:
                feed.close()
                raise
            return feed, fold, answered

    async def _deliver(
        self,
        session: Session,
        named_run: str | None,
        text: str,
        data: list[dict[str, Any]],
        principal: str,
        feed: SessionFeed,
    ) -> tuple[_TaskFold, Collection[ApprovalRequest]]:
        """Answer, steer or start, as the message says; the task's fold, and the requests
        answered. ``feed`` watches already: nothing that follows is missed."""
        records = await _caught_up(feed)
        running = a2a.open_run(records)
        if running is not None:
            fold = self._new_fold(session, running)
            await fold.take(records)
            if named_run is not None and named_run != running:
                raise RpcError(
                    jsonrpc.INVALID_PARAMS, f"task {session.id}:{named_run} is not running"
                )
            if fold.pending:
                return fold, await self._answer(session, fold, text, data, principal)
            # Closed since its task was found running, the session is not busy either:
            # the answer is the 410 of input a closed session drops, not 409.
            check_open(session, "steering")
            if not session.busy:
                raise RpcError(jsonrpc.BUSY, "the task waits; send its answer")
            recorded = self._methods.queue_room.reserve(session, "steering")
            queued = False
            try:
                queued = session.steer([TextBlock(text=text)], recorded=recorded)
            finally:
                if not queued:
                    recorded.drop(NOT_HANDED_OVER)  # its place is free again
            if queued:
                # Answered once the steering survives this host, as the gateway's steer.
                await once_recorded(recorded)
            return fold, ()
        if named_run is not None:
            raise RpcError(
                a2a.UNSUPPORTED_OPERATION,
                f"task {session.id}:{named_run} has ended: send the message with its "
                "contextId alone to start another",
            )
        if not text.strip():
            raise RpcError(jsonrpc.INVALID_PARAMS, NO_TEXT_TO_START)
        session = await self._methods.settled(session)
        stream = session.run([TextBlock(text=text)], approve=self._methods.approver())
        stream.detach()  # read through the feed, which a disconnect cannot lose
        submitted = a2a.message(
            "user",
            [a2a.text_part(text)],
            message_id=f"{stream.run_id}-prompt",
            context_id=session.id,
            task=a2a.task_id(session.id, stream.run_id),
        )
        return self._new_fold(session, stream.run_id, submitted=submitted), ()

    async def _answer(
        self,
        session: Session,
        fold: a2a.TaskFold,
        text: str,
        data: list[dict[str, Any]],
        principal: str,
    ) -> list[ApprovalRequest]:
        """Answer the task's pending requests with the message (a data part's
        ``call_id`` picks one): a decision for an approval, the text for a question, or
        its decline (a ``{"decision": "deny"}`` data part); the requests answered."""
        named = {item.get("call_id") for item in data if isinstance(item.get("call_id"), str)}
        requests = [r for r in fold.pending.values() if not named or r.call_id in named]
        if not requests:
            raise RpcError(jsonrpc.INVALID_PARAMS, "no pending request has that call_id")
        host = self._methods.host
        answered: list[ApprovalRequest] = []
        for request in requests:
            # No checkpoint from here to the host's lookup: a session it lists no more
            # would be loaded by the host, not through the gateway.
            if not _open_here(session):
                raise _ClosedBeforeTheAnswer
            # A data part naming another call says nothing of this one.
            mine = [d for d in data if d.get("call_id") in (None, request.call_id)]
            if request.kind == "question" and a2a.declines(mine):
                # Declined by a data part only: a text "deny" may be the answer itself.
                await host.answer_approval(session.id, request.call_id, "deny", by=principal)
            elif request.kind == "question":
                await host.answer_question(session.id, request.call_id, text, by=principal)
            else:
                verdict = a2a.parse_decision(text, mine)
                if verdict is None:
                    raise RpcError(
                        jsonrpc.INVALID_PARAMS,
                        "the task waits for a decision: reply allow, deny or always "
                        '(or a data part {"decision": "allow" | "deny" | "allow_session"})',
                    )
                await host.answer_approval(session.id, request.call_id, verdict, by=principal)
            answered.append(request)
        return answered


class _Deliveries:
    """Which task each message went to, so a message delivered before is not delivered
    again: per context (a :class:`~greenroom.protocols.a2a.MessageIds` kept in the
    session's :data:`MESSAGE_IDS_FILE`, read once, written in a worker thread), and per
    principal for the messages that made their context (memory only). Holds no channel."""

    def __init__(self) -> None:
        self._contexts: OrderedDict[str, a2a.MessageIds] = OrderedDict()
        self._made: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._delivering: dict[tuple[str, ...], trio.Event] = {}
        self._version = 0
        """Counts the writes asked for: a later one's content is newer."""
        self._written: OrderedDict[Path, int] = OrderedDict()
        """The version last written to each file (guarded by ``_writing``)."""
        self._writing = threading.Lock()

    @contextlib.asynccontextmanager
    async def one_at_a_time(self, key: tuple[str, ...]) -> AsyncIterator[None]:
        """Deliver the message of ``key`` (principal, context, task, message key) alone:
        a retry that comes meanwhile waits, then finds it delivered."""
        while (busy := self._delivering.get(key)) is not None:
            await busy.wait()
        done = self._delivering[key] = trio.Event()
        try:
            yield
        finally:
            del self._delivering[key]
            done.set()

    def made(self, principal: str, key: str) -> str | None:
        """The task a message of ``principal`` that made its context went to."""
        return self._made.get((principal, key))

    async def ids_of(self, session: Session) -> a2a.MessageIds:
        """The message ids of ``session``'s context (read from its file the first time;
        a file that cannot be read counts as none, and says so in the log)."""
        ids = self._contexts.get(session.id)
        if ids is None:
            read = await trio.to_thread.run_sync(_read_ids, session.directory / MESSAGE_IDS_FILE)
            # Read by another call meanwhile: that one is the context's (it may hold more).
            ids = self._contexts.setdefault(session.id, read)
        self._contexts.move_to_end(session.id)
        while len(self._contexts) > MAX_CACHED_CONTEXTS:
            self._contexts.popitem(last=False)
        return ids

    async def remember(
        self, session: Session, key: str, run_id: str, *, made_by: str | None
    ) -> Callable[[], Awaitable[None]]:
        """The message of ``key`` went to ``run_id`` of ``session``: remembered now (and,
        for a message that made the context, for ``made_by``). Returns what keeps it in
        the context's file, to be awaited where a client that goes away cuts the wait
        short: the write then completes in its worker thread all the same. A failed
        write is logged; the id is remembered while this process runs."""
        if made_by is not None:
            self._made[(made_by, key)] = a2a.task_id(session.id, run_id)
            while len(self._made) > MAX_MADE_IDS:
                self._made.popitem(last=False)
        ids = await self.ids_of(session)
        ids.add(key, run_id)
        self._version += 1
        write = functools.partial(
            self._write, session.directory / MESSAGE_IDS_FILE, ids.dumps(), self._version
        )

        async def keep() -> None:
            await trio.to_thread.run_sync(write, abandon_on_cancel=True)

        return keep

    def _write(self, path: Path, text: str, version: int) -> None:
        """Replace the ids kept in ``path`` with ``text``, unless a later version was
        written there already (writes abandoned by their callers may finish in any
        order). Blocking; called in worker threads, one at a time."""
        with self._writing:
            if self._written.get(path, 0) >= version:
                return
            try:
                replace_private_file(path, text)
            except OSError as exc:
                logger.warning("A2A: cannot keep the message ids in %s: %s", path, exc)
                return
            self._written[path] = version
            self._written.move_to_end(path)
            while len(self._written) > MAX_CACHED_CONTEXTS:
                self._written.popitem(last=False)


async def _nothing() -> None:
    """Nothing to keep (a message delivered before)."""


def _read_ids(path: Path) -> a2a.MessageIds:
    """The message ids kept in ``path`` (none when it does not exist or cannot be read).
    Blocking."""
    try:
        return a2a.MessageIds.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return a2a.MessageIds()
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        logger.warning("A2A: the message ids in %s are left out: %s", path, exc)
        return a2a.MessageIds()


class _ClosedBeforeTheAnswer(Exception):
    """The host began to close the session (or closed it) after its pending requests were
    found and before they were answered: the message goes to the session loaded again."""


def _open_here(session: Session) -> bool:
    """Whether the host still lists ``session`` under its id: not once its close began."""
    try:
        return session.host.get_session(session.id) is session
    except SessionNotFound:
        return False


class _TaskFold(a2a.TaskFold):
    """A task's fold that reads the images its tools returned (its artifacts) before it
    folds them: from the session's private copies (R-SEC-8), in a worker thread, so no
    file is read in the event loop's thread. Fed with :meth:`take`, never ``apply``."""

    def __init__(self, source: ImageSource, **kwargs: Any) -> None:
        self._source = source
        self._images: dict[ImageBlock, tuple[str, str] | None] = {}
        super().__init__(file_data=self._images.get, **kwargs)

    async def take(self, outputs: Sequence[Output]) -> list[dict[str, Any]]:
        """Fold ``outputs`` in, in order; the stream events they cause. Reads the images
        not read yet first, all in one worker thread call (cancelling abandons it)."""
        missing = list(
            dict.fromkeys(
                block
                for output in outputs
                if isinstance(output, ToolCallOutput)
                and output.run_id == self.run_id
                and output.origin is None
                for block in output.content
                if isinstance(block, ImageBlock) and block not in self._images
            )
        )
        if missing:
            source = self._source
            loaded = await trio.to_thread.run_sync(
                lambda: [read_image(block, source) for block in missing], abandon_on_cancel=True
            )
            self._images.update(zip(missing, loaded, strict=True))
        events: list[dict[str, Any]] = []
        for output in outputs:
            events += self.apply(output)
        return events


async def _caught_up(feed: SessionFeed) -> list[Any]:
    """The session's own traced outputs now, read after ``feed`` began to watch; the
    feed then gives only what follows them."""
    records = [r for r in await replay_records(feed.session, feed.last_seq) if r.origin is None]
    feed.skip_replay(max((r.seq or 0 for r in records), default=feed.last_seq))
    return records
