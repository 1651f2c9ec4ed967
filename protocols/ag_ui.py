"""AG-UI (the Agent-User Interaction protocol, 1.0) over greenroom's sessions, for
``serve --ag-ui`` (R-PROTO-2). No I/O.

An AG-UI run is what a front end sees of a greenroom task between its ``POST /ag-ui`` and
the end of that response: ``threadId`` is the session id, ``runId`` the front end's own.
:class:`RunMapper` turns the task's outputs into AG-UI events (JSON objects with the
wire's camelCase keys):

* ``RUN_STARTED`` and a ``STATE_SNAPSHOT`` open the run (:meth:`RunMapper.started`).
* Text: ``TEXT_MESSAGE_START``, ``TEXT_MESSAGE_CONTENT`` per streamed piece,
  ``TEXT_MESSAGE_END`` once the block is complete. Tool calls likewise
  (``TOOL_CALL_START/ARGS/END``), then ``TOOL_CALL_RESULT`` when the call has run.
* A call that waits for a person (R-HITL) is an interrupt: once the outputs at hand are
  mapped, :meth:`RunMapper.interrupted` ends the run with ``RUN_FINISHED`` whose outcome
  lists the interrupts (``id`` = the call id). The task waits on; the front end answers
  with a new run whose ``resume`` entries carry the answers (:func:`parse_resume`). A
  question's choices are its ``responseSchema``'s ``answer`` enum
  (:func:`question_schema`), its ``metadata.choices`` and a line of its ``message``.
* ``task_end``: ``completed`` gives ``RUN_FINISHED`` (with the run's token usage),
  ``aborted`` ``RUN_FINISHED`` with the ``cancelled`` outcome, any other ``RUN_ERROR``.
* Front-end tools (the run's ``tools``, :func:`client_tools`) are the session's client
  tools: a call of one is shown as any call (``TOOL_CALL_START/ARGS/END``) and then waits
  for the front end, which runs it and sends its result as a ``tool`` message of the next
  run (:func:`tool_results`). A run that waits only for such results ends with
  ``RUN_FINISHED`` and the ``success`` outcome, as AG-UI front ends expect; one that also
  waits for a person ends on the interrupts.
* The run's ``context`` and a ``state`` the front end changed are given to the model with
  the new input (:func:`front_end_notes`).
* The image parts of the new user messages (their bytes inline: a ``data`` source or a
  ``data:`` URL) are images the model sees (:func:`new_images`); the legacy ``binary``
  part is read as the media part it became in AG-UI 1.0 (:func:`upgrade_binary_parts`).
  An image by URL or provider file handle, or audio, video and documents, are refused.

Ids are derived from the trace (``RUNID-TURN-BLOCK`` for messages, the call id for tool
calls), so the events of a block replayed after a disconnect carry the ids the front end
saw live. Each event is given with the ``seq`` of the last traced output it reflects:
the SSE ``id`` a front end resumes from (``Last-Event-ID``) — a message or tool call cut
off in the middle comes again whole, under its id. The mapper of a run that takes a
thread up midway (a reconnect, a resume) takes its turn and block count from the records
the front end was shown (:meth:`RunMapper.join`: the replay starts after them), and
ignores the streamed pieces of the block still open once the replay is mapped
(:meth:`RunMapper.caught_up`): its first pieces were never given to it, so that block
comes whole with its ``model_msg``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, assert_never

from greenroom.protocols.a2a import question_choices
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.mcp_config import schema_problem
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
from greenroom.protocols.people import PendingApproval, Verdict

PROTOCOL_VERSION = "1.0"
"""The AG-UI protocol version spoken."""

INTERRUPT_REASONS = {"approval": "tool_approval", "question": "question", "in_doubt": "in_doubt"}
"""An interrupt's ``reason`` for each kind of request a person answers."""

APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"decision": {"enum": ["allow", "deny", "allow_session"]}},
    "required": ["decision"],
}
"""What the answer to an approval interrupt looks like (its ``responseSchema``)."""

QUESTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
}
"""What the answer to a question interrupt looks like."""

Event = dict[str, Any]
"""One AG-UI event, as its JSON object."""


def question_schema(choices: list[str]) -> dict[str, Any]:
    """The ``responseSchema`` of a question interrupt: :data:`QUESTION_SCHEMA`, its
    ``answer`` one of ``choices`` (a JSON Schema ``enum``, which a front end builds its
    form from) when the question offers some."""
    if not choices:
        return QUESTION_SCHEMA
    answer = {"type": "string", "enum": list(choices)}
    return {**QUESTION_SCHEMA, "properties": {"answer": answer}}


class ResumeError(ValueError):
    """A ``resume`` entry that answers nothing greenroom can take (its message says why)."""


def parse_resume(entry: Mapping[str, Any], kind: str) -> tuple[Verdict, None] | tuple[None, str]:
    """The answer a ``resume`` entry gives an interrupt of ``kind``: a verdict for an
    approval (``payload.decision``, or ``payload`` ``true``/``false``/a decision word; a
    ``cancelled`` entry denies), the text for a question (``payload.answer`` or a string),
    whatever it says. A ``cancelled`` entry declines a question: ``deny`` (the model's own,
    ``ask_user``, then reads :data:`~greenroom.protocols.markers.DECLINED_ANSWER` as its
    result). Raises :class:`ResumeError` for a payload that gives neither."""
    status = entry.get("status")
    payload = entry.get("payload")
    if kind == "question":
        if status == "cancelled":
            return "deny", None
        answer = payload.get("answer") if isinstance(payload, Mapping) else payload
        if isinstance(answer, str):
            return None, answer
        raise ResumeError("the answer to a question is payload {answer: text} or a string")
    if status == "cancelled":
        return "deny", None
    decision = payload.get("decision") if isinstance(payload, Mapping) else payload
    if decision is True:
        return "allow", None
    if decision is False:
        return "deny", None
    if decision in ("allow", "deny", "allow_session"):
        return decision, None
    raise ResumeError(
        "the answer to an approval is payload {decision: allow | deny | allow_session}"
    )


def new_input(messages: Iterable[Mapping[str, Any]]) -> str:
    """The text of the user messages at the end of a run's ``messages`` (what the front
    end added since the agent last spoke); empty when the last message is not a user's."""
    texts: list[str] = []
    for said in reversed(list(messages)):
        if said.get("role") != "user":
            break
        texts.append(_text_of(said.get("content")))
    return "\n\n".join(t for t in reversed(texts) if t)


class ImageInputError(ValueError):
    """A part of a run's new user messages greenroom cannot give the model (the message
    names it, and says why)."""


_DATA_URL = re.compile(r"data:([^;,]+)((?:;[^;,]*)*),(.*)", re.DOTALL)


def _new_messages(messages: list[Mapping[str, Any]]) -> list[int]:
    """The indexes of the user messages at the end of ``messages`` (the new input)."""
    found: list[int] = []
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") != "user":
            break
        found.append(index)
    return found[::-1]


def new_images(messages: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """``(where, media type, base64 data)`` of each image part of the user messages at the
    end of a run's ``messages`` (those :func:`new_input` takes the text of), in order;
    ``where`` is the part's ``$.messages[i].content[j]``. Raises :class:`ImageInputError`
    for an image given by a URL (other than a ``data:`` URL of base64 bytes) or by a
    provider's file handle, one whose type is not ``image/…``, and for an audio, video or
    document part. The bytes are checked (base64, size) when they are attached."""
    listed = list(messages)
    images: list[tuple[str, str, str]] = []
    for index in _new_messages(listed):
        content = listed[index].get("content")
        for number, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, Mapping) else None
            where = f"$.messages[{index}].content[{number}]"
            if kind == "text":
                continue
            if kind != "image":
                raise ImageInputError(f"{where}: a {kind} part; this agent takes text and images")
            media_type, data = _image_source(part.get("source"), where)
            if not media_type.startswith("image/"):
                raise ImageInputError(f"{where}: {media_type[:100]!r} is not an image type")
            images.append((where, media_type, data))
    return images


def _image_source(source: Any, where: str) -> tuple[str, str]:
    """``(media type, base64 data)`` of an image part's ``source``."""
    kind = source.get("type") if isinstance(source, Mapping) else None
    value = source.get("value") if isinstance(source, Mapping) else None
    if not isinstance(value, str):
        raise ImageInputError(f"{where}.source: no value")
    media_type = source.get("mimeType") if isinstance(source, Mapping) else None
    if kind == "url":
        found = _DATA_URL.fullmatch(value)
        if found is None:
            raise ImageInputError(
                f"{where}.source: an image by URL is not fetched; send its bytes (a data "
                "source, or a data: URL)"
            )
        if "base64" not in found.group(2).split(";"):
            raise ImageInputError(f"{where}.source: a data: URL of base64 bytes only")
        return found.group(1).strip().lower(), found.group(3)
    if kind != "data":
        raise ImageInputError(
            f"{where}.source: a provider's file handle names no bytes this agent has; send "
            "the image's bytes (a data source)"
        )
    if not isinstance(media_type, str):
        raise ImageInputError(f"{where}.source.mimeType: required")
    return media_type.strip().lower(), value


_MEDIA_KINDS = {"image/": "image", "audio/": "audio", "video/": "video"}


def upgrade_binary_parts(body: Any) -> Any:
    """A ``RunAgentInput`` (JSON) whose user messages' legacy ``binary`` parts (AG-UI
    0.x: ``mimeType`` and ``data``, ``url`` or ``id``) are the media parts AG-UI 1.0
    replaced them with, as the protocol's own compatibility boundary upgrades them: by
    their type an ``image``, ``audio``, ``video`` or ``document`` part whose source is the
    data, the URL or the file id. Anything else is left as it is (the validation that
    follows judges it)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for said in messages if isinstance(messages, list) else ():
        content = said.get("content") if isinstance(said, dict) else None
        if not isinstance(content, list):
            continue
        for number, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "binary":
                content[number] = _upgraded(part)
    return body


def _upgraded(part: dict[str, Any]) -> dict[str, Any]:
    media_type = part.get("mimeType")
    if not isinstance(media_type, str):
        return part
    kind = next(
        (k for prefix, k in _MEDIA_KINDS.items() if media_type.startswith(prefix)), "document"
    )
    for field, source in (("data", "data"), ("url", "url"), ("id", "file")):
        value = part.get(field)
        if isinstance(value, str) and value:
            given = {"type": source, "value": value, "mimeType": media_type}
            return {"type": kind, "source": given}
    return part


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


MAX_CLIENT_TOOLS = 64
"""The most front-end tools a run may give."""

MAX_NOTES_CHARS = 20_000
"""The longest the front end's context and state may be, as text for the model."""

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ClientToolError(ValueError):
    """A front-end tool greenroom cannot offer the model (the message says which, and why)."""


def client_tools(tools: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(name, description, parameters)`` of a run's front-end tools. Raises
    :class:`ClientToolError` for one whose name a provider refuses or whose parameters are
    not an object schema, or for more than :data:`MAX_CLIENT_TOOLS`."""
    given = list(tools)
    if len(given) > MAX_CLIENT_TOOLS:
        raise ClientToolError(f"$.tools: at most {MAX_CLIENT_TOOLS} tools")
    found: list[tuple[str, str, dict[str, Any]]] = []
    for index, tool in enumerate(given):
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ClientToolError(
                f"$.tools[{index}].name: letters, digits, '_' and '-' only, at most 64"
            )
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        problem = schema_problem(parameters)
        if problem is not None:
            raise ClientToolError(f"$.tools[{index}].parameters: {problem}")
        description = tool.get("description")
        found.append((name, description if isinstance(description, str) else "", parameters))
    return found


def tool_results(messages: Iterable[Mapping[str, Any]], waiting: Iterable[str]) -> dict[str, str]:
    """The results a run's ``tool`` messages give the front-end calls in ``waiting`` (call
    ids), by call id. Tool messages of other calls — the history a front end sends again
    with every run — are not answers."""
    open_calls = set(waiting)
    results: dict[str, str] = {}
    for said in messages:
        call_id = said.get("toolCallId")
        if said.get("role") == "tool" and call_id in open_calls:
            content = said.get("content")
            results[call_id] = content if isinstance(content, str) else _text_of(content)
    return results


def front_end_notes(
    context: Iterable[Mapping[str, Any]], state: Any, *, state_changed: bool
) -> str:
    """What the model is told of the front end with a new input: the run's ``context``
    entries, and its ``state`` when it changed since the thread's last run (empty when
    there is neither)."""
    lines = [
        f"- {entry.get('description')}: {entry.get('value')}"
        for entry in context
        if isinstance(entry.get("description"), str)
    ]
    parts = []
    if lines:
        parts.append("[front-end context]\n" + "\n".join(lines) + "\n[/front-end context]")
    if state_changed and state not in (None, {}, []):
        shown = json.dumps(state, ensure_ascii=False, sort_keys=True)
        parts.append(f"[front-end state]\n{shown}\n[/front-end state]")
    return "\n".join(parts)


class RunMapper:
    """The events of one AG-UI run over a session's outputs. Feed outputs to :meth:`map`
    in order; after the outputs at hand, :attr:`interrupts` says whether the run must end
    on them (:meth:`interrupted`); :attr:`ended` once a terminal event was given. Outputs
    of subagents (``origin`` set) are not shown."""

    def __init__(
        self, *, thread_id: str, run_id: str, client_tools: frozenset[str] = frozenset()
    ) -> None:
        self.thread_id = thread_id
        self.run_id = run_id
        self.client_tools = client_tools
        self.interrupts: dict[str, Event] = {}
        """The open requests as interrupts, by call id."""
        self.client_calls: set[str] = set()
        """The front-end calls waiting for their results, by call id."""
        self.ended = False
        self._turn = 0
        self._block = 0
        self._open_texts: dict[int, str] = {}
        self._open_calls: set[str] = set()
        self._said: str | None = None
        """The id of the turn's last text message: its calls' ``parentMessageId``."""
        self._joining = False
        """Joined midway (:meth:`join`), and the replay is not mapped yet."""
        self._unseen: int | None = None
        """The index of the attempt's block whose first pieces this mapper never got: its
        pieces are ignored, and it comes whole with its ``model_msg``."""
        self._usage = {"input": 0, "output": 0, "cached": 0}
        self._status = "running"

    def _event(self, kind: str, **fields: Any) -> Event:
        return {"type": kind, **fields}

    def state(self) -> dict[str, Any]:
        """The run's state as the front end is shown it (``STATE_SNAPSHOT``)."""
        return {
            "sessionId": self.thread_id,
            "status": self._status,
            "pendingApprovals": sorted(self.interrupts),
            "pendingToolCalls": sorted(self.client_calls),
            "usage": {
                "inputTokens": self._usage["input"],
                "outputTokens": self._usage["output"],
            },
        }

    def started(self, pending: Iterable[PendingApproval] = ()) -> list[Event]:
        """``RUN_STARTED`` and the first state snapshot; ``pending``: requests already
        waiting (the run ends on them unless they are answered)."""
        for request in pending:
            self._ask(request)
        return [
            self._event(
                "RUN_STARTED",
                threadId=self.thread_id,
                runId=self.run_id,
                protocolVersion=PROTOCOL_VERSION,
            ),
            self._event("STATE_SNAPSHOT", snapshot=self.state()),
        ]

    def join(self, shown: Iterable[Output]) -> None:
        """Take the thread up midway, where the front end left it: ``shown`` are the
        traced outputs it was given (up to its ``Last-Event-ID``, or to the request a
        resume answers), in order.
        Sends nothing: the turn, the attempt's block count and its last text message are
        set from them, so the blocks that follow carry the ids and ``parentMessageId`` the
        front end saw live. Call :meth:`caught_up` once the replay is mapped."""
        for output in shown:
            if output.origin is not None:
                continue
            if isinstance(output, RequestBegin):
                self._turn, self._block, self._said = output.turn, 0, None
            elif isinstance(output, ModelMsg):
                index, self._block = self._block, self._block + 1
                if isinstance(output.block, TextBlock) and output.block.text:
                    self._said = self._message_id(output.run_id, index)
        self._joining = True

    def caught_up(self) -> None:
        """The outputs mapped so far were the trace's replay; those that follow are
        published live. After :meth:`join`, the attempt's block that is open now may
        have streamed pieces published before the live ones began, never given here: its
        pieces are ignored until it completes, and it comes whole (``START``, all its text
        or arguments, ``END``). Does nothing for a mapper not joined, or a second time."""
        if self._joining:
            self._joining = False
            self._unseen = self._block

    def map(self, output: Output) -> list[Event]:
        """The events of one output (none for most)."""
        if output.origin is not None or self.ended:
            return []
        match output:
            case PartialText():
                return self._text_piece(output)
            case PartialToolCall():
                return self._call_piece(output)
            case PartialThinking() | ToolProgress() | UserMsg() | TaskStart() | Abort():
                return []
            case RequestBegin():
                events = self._close_open()
                self._turn, self._block = output.turn, 0
                self._said = self._unseen = None
                return events
            case RequestEnd():
                return [] if output.status == "ok" else self._close_open()
            case ModelMsg():
                block_index, self._block = self._block, self._block + 1
                return self._block_done(output, block_index)
            case ToolCallOutput():
                text = "\n".join(b.text for b in output.content if isinstance(b, TextBlock))
                return [
                    self._event(
                        "TOOL_CALL_RESULT",
                        messageId=f"{output.call_id}-result",
                        toolCallId=output.call_id,
                        content=text or f"[{output.status}]",
                        role="tool",
                    )
                ]
            case ApprovalRequest():
                self._ask(output)
                return []
            case ApprovalDecision():
                self.interrupts.pop(output.call_id, None)
                self.client_calls.discard(output.call_id)
                return []
            case TokenUsageOutput():
                self._usage["input"] += output.request.input
                self._usage["output"] += output.request.output
                self._usage["cached"] += output.request.cache_read
                return []
            case CompactionBegin() | CompactionEnd():
                return []
            case TaskEnd():
                return self._ended(output)
            case CallResolved():
                # A question about a call in doubt is answered (R-EFFECT-2).
                self.interrupts.pop(output.call_id, None)
                return []
            case (
                CallInDoubt() | ToolHook() | Rewind() | TaskQueuedOutput() | TaskQueueDropped()
                | SteeringQueuedOutput()
            ):
                return []  # what they change shows in the records that follow
            case _:
                assert_never(output)

    @property
    def waiting(self) -> bool:
        """Whether the task waits for the front end: interrupts, or front-end calls."""
        return bool(self.interrupts or self.client_calls)

    def _ask(self, request: ApprovalRequest | PendingApproval) -> None:
        if request.kind == "question" and request.tool in self.client_tools:
            self.client_calls.add(request.call_id)
            return
        choices = question_choices(request.arguments) if request.kind == "question" else []
        metadata: dict[str, Any] = {"tool": request.tool, "arguments": request.arguments}
        if choices:
            metadata["choices"] = choices
        interrupt: Event = {
            "id": request.call_id,
            "reason": INTERRUPT_REASONS[request.kind],
            "toolCallId": request.call_id,
            "message": _prompt(request, choices),
            "responseSchema": (
                question_schema(choices) if request.kind == "question" else APPROVAL_SCHEMA
            ),
            "metadata": metadata,
        }
        self.interrupts[request.call_id] = interrupt

    def interrupted(self) -> list[Event]:
        """End the run on what it waits for: its open interrupts (the ``interrupt``
        outcome), or only front-end calls (``success``: the front end runs them and sends
        their results)."""
        self.ended = True
        if self.interrupts:
            self._status = "waiting_for_approval"
            outcome = {"type": "interrupt", "interrupts": list(self.interrupts.values())}
        else:
            self._status = "waiting_for_tool_results"
            outcome = {"type": "success"}
        return [
            *self._close_open(),
            self._event("STATE_SNAPSHOT", snapshot=self.state()),
            self._event(
                "RUN_FINISHED", threadId=self.thread_id, runId=self.run_id, outcome=outcome
            ),
        ]

    def idle(self) -> list[Event]:
        """End a run that found nothing to show: the thread is idle."""
        self.ended = True
        self._status = "idle"
        return [
            *self._close_open(),
            self._event("STATE_SNAPSHOT", snapshot=self.state()),
            self._event(
                "RUN_FINISHED",
                threadId=self.thread_id,
                runId=self.run_id,
                outcome={"type": "success"},
            ),
        ]

    def _message_id(self, run_id: str, index: int) -> str:
        return f"{run_id}-{self._turn}-{index}"

    def _text_piece(self, output: PartialText) -> list[Event]:
        if output.index == self._unseen:
            return []  # its start was never given here: it comes whole (caught_up)
        events: list[Event] = []
        message_id = self._open_texts.get(output.index)
        if message_id is None:
            message_id = self._open_texts[output.index] = self._message_id(
                output.run_id, output.index
            )
            events.append(self._event("TEXT_MESSAGE_START", messageId=message_id, role="assistant"))
            self._said = message_id
        if output.text:
            events.append(
                self._event("TEXT_MESSAGE_CONTENT", messageId=message_id, delta=output.text)
            )
        return events

    def _call_piece(self, output: PartialToolCall) -> list[Event]:
        if output.index == self._unseen:
            return []  # its first fragments were never given here: it comes whole
        events: list[Event] = []
        if output.call_id not in self._open_calls:
            self._open_calls.add(output.call_id)
            events.append(self._call_start(output.call_id, output.name))
        if output.arguments_delta:
            events.append(
                self._event(
                    "TOOL_CALL_ARGS", toolCallId=output.call_id, delta=output.arguments_delta
                )
            )
        return events

    def _block_done(self, output: ModelMsg, index: int) -> list[Event]:
        if index == self._unseen:
            self._unseen = None
        block = output.block
        if isinstance(block, TextBlock):
            message_id = self._open_texts.pop(index, None)
            if message_id is not None:
                return [self._event("TEXT_MESSAGE_END", messageId=message_id)]
            if not block.text:
                return []
            message_id = self._said = self._message_id(output.run_id, index)
            return [
                self._event("TEXT_MESSAGE_START", messageId=message_id, role="assistant"),
                self._event("TEXT_MESSAGE_CONTENT", messageId=message_id, delta=block.text),
                self._event("TEXT_MESSAGE_END", messageId=message_id),
            ]
        if isinstance(block, ToolCallBlock):
            if block.id in self._open_calls:
                self._open_calls.discard(block.id)
                return [self._event("TOOL_CALL_END", toolCallId=block.id)]
            arguments = block.invalid_arguments or json.dumps(block.arguments, ensure_ascii=False)
            return [
                self._call_start(block.id, block.name),
                self._event("TOOL_CALL_ARGS", toolCallId=block.id, delta=arguments),
                self._event("TOOL_CALL_END", toolCallId=block.id),
            ]
        return []  # thinking stays the model's own

    def _call_start(self, call_id: str, name: str) -> Event:
        """``TOOL_CALL_START``, under the turn's text message when it has one (a front end
        shows the call with the words that led to it)."""
        if self._said is None:
            return self._event("TOOL_CALL_START", toolCallId=call_id, toolCallName=name)
        return self._event(
            "TOOL_CALL_START", toolCallId=call_id, toolCallName=name, parentMessageId=self._said
        )

    def _close_open(self) -> list[Event]:
        """End what a failed attempt (or the end of the run) left open."""
        events = [self._event("TEXT_MESSAGE_END", messageId=m) for m in self._open_texts.values()]
        events += [self._event("TOOL_CALL_END", toolCallId=c) for c in sorted(self._open_calls)]
        self._open_texts.clear()
        self._open_calls.clear()
        return events

    def _usage_entries(self) -> list[dict[str, Any]]:
        usage = self._usage
        return [
            {
                "inputTokens": usage["input"],
                "outputTokens": usage["output"],
                "totalTokens": usage["input"] + usage["output"],
                "cachedInputTokens": min(usage["cached"], usage["input"]),
            }
        ]

    def _ended(self, output: TaskEnd) -> list[Event]:
        self.ended = True
        self.interrupts.clear()
        self.client_calls.clear()
        self._status = "idle"
        events = [*self._close_open(), self._event("STATE_SNAPSHOT", snapshot=self.state())]
        match output.status:
            case "completed":
                outcome: dict[str, Any] = {"type": "success"}
            case "aborted":
                outcome = {"type": "cancelled"}
            case "failed" | "auth" | "max_turns" | "loop_detected" | "budget_exceeded":
                message = output.message or f"the task ended: {output.status}"
                events.append(
                    self._event(
                        "RUN_ERROR",
                        message=message,
                        code=output.status,
                        usage=self._usage_entries(),
                    )
                )
                return events
            case _:
                assert_never(output.status)
        events.append(
            self._event(
                "RUN_FINISHED",
                threadId=self.thread_id,
                runId=self.run_id,
                outcome=outcome,
                usage=self._usage_entries(),
            )
        )
        return events


def _prompt(request: ApprovalRequest | PendingApproval, choices: list[str]) -> str:
    arguments = json.dumps(request.arguments, ensure_ascii=False)[:2000]
    if request.kind == "question":
        question = request.arguments.get("question")
        if isinstance(question, str):
            # Said in the words too: a front end that shows only the message still
            # shows what may be answered.
            return question + ("\nChoose one of: " + ", ".join(choices) if choices else "")
    if request.kind == "in_doubt":
        return f"Did the call {request.tool}({arguments}) take effect before its host stopped?"
    return f"Allow the call {request.tool}({arguments})?"
