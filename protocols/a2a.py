"""A2A (the Agent2Agent protocol, version 0.3, JSON-RPC binding) over greenroom's
sessions, for ``serve --a2a`` (R-PROTO-1). No I/O.

The mapping, in one place:

* An A2A **context** is a greenroom session (``contextId`` = session id); an A2A **task**
  is one greenroom task (:func:`task_id` joins the two ids: ``SESSION:RUN``, so a task is
  found from its id alone, after a restart too).
* :class:`TaskFold` folds the outputs of one task into the A2A ``Task`` (state, history,
  artifacts) and gives the stream events each output causes (``status-update``,
  ``artifact-update``), the same way live and from a stored trace.
* States: ``submitted`` before the task starts, ``working`` while it runs,
  ``input-required`` while a call waits for a person (R-HITL), then ``completed``,
  ``canceled`` (interrupted) or ``failed``. A stream ends (``final: true``) at
  ``input-required`` and at the end states.
* A pending approval is answered by the next message: :func:`parse_decision` reads
  ``allow``/``deny``/``always`` from its text or a ``{"decision": …}`` data part; a
  question (``ask_user``, or one a running call asks: an MCP elicitation) is shown as its
  text and choices (:func:`approval_prompt`) and answered by the message's text, which
  the history shows as the user's turn once the call has it as its result (a running
  call's answer is not traced: the history says only that it was answered or declined).
  A question is declined by a ``{"decision": "deny"}`` data part (:func:`declines`),
  never by its text: ``deny`` may be the answer itself, and so may any words. Either kind
  is denied (the model's own, ``ask_user``, then reads
  :data:`~greenroom.protocols.markers.DECLINED_ANSWER` as its result), and its ``deny``
  shows in the history as ``{"call_id": …, "question": "declined"}``. Only the decision
  says declined: a result's text never does (in a trace written before a decline of
  ``ask_user`` was a ``deny``, it is an answer of those words, and shows as one).
  Each request and each answer is a message of its own id, also when one call is asked
  twice (its approval, then its question).
* The runtime's own input to a task (the "host lost" note a task resumed after its host
  stopped gets, :data:`~greenroom.protocols.markers.HOST_LOST_CONTINUATION`) is an agent
  message of the history, never the user's words.
* A message is delivered once: :class:`MessageIds` remembers, per context, the task each
  ``messageId`` went to, so a client's retry is answered with that task, not run again.
* Artifacts are the files tool calls return (image blocks), as file parts whose bytes the
  caller reads (``file_data``).

Invariants: every object built here validates against the a2a-sdk's v0.3 models (the
tests check each one); ids and texts the client sent are never echoed unbounded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, assert_never

from greenroom.protocols.content import ImageBlock, TextBlock, ToolCallBlock
from greenroom.protocols.markers import HOST_LOST_CONTINUATION
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
from greenroom.protocols.people import Verdict

PROTOCOL_VERSION = "0.3.0"
"""The A2A protocol version served (the a2a-sdk's clients speak it as its v0.3 binding)."""

METHODS = ("message/send", "message/stream", "tasks/get", "tasks/cancel", "tasks/resubscribe")
"""The JSON-RPC methods served at ``/a2a``."""

TaskState = Literal["submitted", "working", "input-required", "completed", "canceled", "failed"]

END_STATES: frozenset[str] = frozenset({"completed", "canceled", "failed"})
"""States a task never leaves."""

# A2A's error codes (JSON-RPC server errors), https://a2a-protocol.org, section 8.
TASK_NOT_FOUND = -32001
TASK_NOT_CANCELABLE = -32002
UNSUPPORTED_OPERATION = -32004
CONTENT_TYPE_NOT_SUPPORTED = -32005

ALLOW_WORDS = frozenset({"allow", "yes", "y", "approve", "approved", "ok", "go"})
DENY_WORDS = frozenset({"deny", "no", "n", "reject", "denied", "stop"})
SESSION_WORDS = frozenset({"always", "allow_session", "allow for session"})

FileData = Callable[[ImageBlock], tuple[str, str] | None]
"""``(media type, base64 data)`` of an image a tool returned, or None when it cannot be
read."""


MAX_REMEMBERED_IDS = 256
"""The most message ids remembered per context, the oldest forgotten first."""

MAX_KEPT_ID_CHARS = 128
"""The longest ``messageId`` remembered as it is; a longer one by its SHA-256."""


def message_key(message_id: str) -> str:
    """The key a ``messageId`` is remembered under: itself, or a long one's SHA-256 (what
    a client sent is never kept unbounded)."""
    if len(message_id) <= MAX_KEPT_ID_CHARS:
        return message_id
    return "sha256:" + hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()


class MessageIds:
    """The run each recent ``messageId`` of one context went to (keys of
    :func:`message_key`), at most ``limit``, the oldest forgotten first. Its JSON form
    (:meth:`dumps`, :meth:`loads`) is what a context keeps of them."""

    def __init__(self, limit: int = MAX_REMEMBERED_IDS) -> None:
        self.limit = limit
        self._runs: dict[str, str] = {}

    def run_of(self, key: str) -> str | None:
        """The run the message of ``key`` went to, or None when it is not remembered."""
        return self._runs.get(key)

    def add(self, key: str, run_id: str) -> None:
        """Remember that the message of ``key`` went to ``run_id`` (as the newest)."""
        self._runs.pop(key, None)
        self._runs[key] = run_id
        while len(self._runs) > self.limit:
            del self._runs[next(iter(self._runs))]

    def dumps(self) -> str:
        """The JSON form: ``{"ids": [[key, run id], …]}``, oldest first."""
        return json.dumps({"ids": [[k, r] for k, r in self._runs.items()]}, ensure_ascii=False)

    @classmethod
    def loads(cls, text: str, limit: int = MAX_REMEMBERED_IDS) -> MessageIds:
        """The ids of a JSON form :meth:`dumps` wrote; entries that are not pairs of
        strings are left out. Raises ValueError when ``text`` is not such an object."""
        value = json.loads(text)
        pairs = value.get("ids") if isinstance(value, dict) else None
        if not isinstance(pairs, list):
            raise ValueError("not an object with a list of ids")
        ids = cls(limit)
        for pair in pairs:
            if (
                isinstance(pair, list)
                and len(pair) == 2
                and all(isinstance(item, str) for item in pair)
                and len(pair[0]) <= MAX_KEPT_ID_CHARS + 7
            ):
                ids.add(pair[0], pair[1])
        return ids


def task_id(session_id: str, run_id: str) -> str:
    """The A2A task id of a greenroom task."""
    return f"{session_id}:{run_id}"


def split_task_id(value: str) -> tuple[str, str] | None:
    """``(session id, run id)`` of an A2A task id, or None when it is not one of ours."""
    session_id, colon, run_id = value.partition(":")
    if not colon or not session_id or not run_id.startswith("run_") or len(value) > 300:
        return None
    return session_id, run_id


def agent_card(
    *, url: str, description: str, skills: Iterable[Mapping[str, Any]], version: str
) -> dict[str, Any]:
    """The agent card served at ``/.well-known/agent-card.json``: JSON-RPC at ``url``,
    streaming, bearer tokens (the gateway's), the given skills."""
    return {
        "name": "greenroom",
        "description": description,
        "url": url,
        "version": version,
        "protocolVersion": PROTOCOL_VERSION,
        "preferredTransport": "JSONRPC",
        "capabilities": {"streaming": True, "pushNotifications": False},
        "defaultInputModes": ["text/plain", "application/json"],
        "defaultOutputModes": ["text/plain", "application/json", "image/*"],
        "skills": [dict(s) for s in skills],
        "securitySchemes": {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "a token of the greenroom gateway (its token files)",
            }
        },
        "security": [{"bearer": []}],
    }


def skills_of(
    tools: Iterable[tuple[str, str]], system: str | None, max_chars: int = 500
) -> list[dict[str, Any]]:
    """The card's skills: one for the agent's conversation (described by its system
    prompt), one per tool (name, description)."""
    about = " ".join((system or "").split())[:max_chars]
    skills = [
        {
            "id": "conversation",
            "name": "conversation",
            "description": about or "An agent that answers and works with its tools.",
            "tags": ["chat"],
        }
    ]
    for name, description in tools:
        skills.append(
            {
                "id": name,
                "name": name,
                "description": " ".join(description.split())[:max_chars] or name,
                "tags": ["tool"],
            }
        )
    return skills


def message(
    role: Literal["user", "agent"],
    parts: list[dict[str, Any]],
    *,
    message_id: str,
    context_id: str,
    task: str,
) -> dict[str, Any]:
    """An A2A ``Message``."""
    return {
        "kind": "message",
        "messageId": message_id,
        "role": role,
        "parts": parts,
        "contextId": context_id,
        "taskId": task,
    }


def text_part(text: str) -> dict[str, Any]:
    """A text part."""
    return {"kind": "text", "text": text}


def data_part(data: Mapping[str, Any]) -> dict[str, Any]:
    """A data part (a JSON object)."""
    return {"kind": "data", "data": dict(data)}


def parse_decision(text: str, data: Iterable[Mapping[str, Any]]) -> Verdict | None:
    """The verdict a message answering an approval gives: a data part's ``decision``
    (``allow``, ``deny``, ``allow_session``), else its text (``allow``/``yes``…,
    ``deny``/``no``…, ``always``); None when it gives none."""
    for item in data:
        decision = item.get("decision")
        if decision in ("allow", "deny", "allow_session"):
            return decision  # type: ignore[no-any-return]
    words = " ".join(text.lower().split()).strip(" .!")
    if words in ALLOW_WORDS:
        return "allow"
    if words in DENY_WORDS:
        return "deny"
    if words in SESSION_WORDS:
        return "allow_session"
    return None


def declines(data: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a message answering a question declines it: a data part's ``decision`` is
    ``deny``. Its text is the answer whatever it says (``deny`` may be one)."""
    return any(item.get("decision") == "deny" for item in data)


HOST_LOST_NOTE = (
    "The host running this task stopped; the task goes on from where it was. Tool calls "
    "that had not finished say in their results what became of them."
)
"""What the history shows of the note a task resumed after its host stopped gets."""


def question_choices(arguments: Mapping[str, Any]) -> list[str]:
    """The answers a question offers: ``ask_user``'s ``choices``, or the options of the one
    field an elicitation's ``requested_schema`` asks for; none when it offers none."""
    choices = arguments.get("choices")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return list(choices)
    schema = arguments.get("requested_schema")
    fields = schema.get("properties") if isinstance(schema, Mapping) else None
    if isinstance(fields, Mapping) and len(fields) == 1:
        (field,) = fields.values()
        options = field.get("enum") if isinstance(field, Mapping) else None
        if isinstance(options, list) and options:
            return [str(option) for option in options]
    return []


def _form_hint(arguments: Mapping[str, Any]) -> str | None:
    """How to answer an elicitation that asks for a form of several fields."""
    schema = arguments.get("requested_schema")
    fields = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(fields, Mapping) or len(fields) < 2:
        return None
    return "Reply with a JSON object of the fields " + ", ".join(str(f) for f in fields) + "."


def approval_prompt(request: ApprovalRequest) -> str:
    """What a person is asked, in words: a question as its text and its choices, a call
    to decide with the words that decide it."""
    arguments = json.dumps(request.arguments, ensure_ascii=False)[:2000]
    match request.kind:
        case "question":
            question = request.arguments.get("question")
            words = (
                question
                if isinstance(question, str) and question.strip()
                else f"{request.tool}: {arguments}"
            )
            choices = question_choices(request.arguments)
            if choices:
                return words + "\nChoose one of: " + ", ".join(choices)
            hint = _form_hint(request.arguments)
            return words if hint is None else f"{words}\n{hint}"
        case "in_doubt":
            return (
                f"The call {request.tool}({arguments}) was running when its host stopped: "
                "did it take effect? Reply allow (run it again) or deny."
            )
        case "approval":
            return (
                f"Approve the call {request.tool}({arguments})? Reply allow, deny, or always "
                "(allow this tool for the rest of the context)."
            )
        case _:
            assert_never(request.kind)


class TaskFold:
    """One greenroom task as an A2A ``Task``: feed its outputs to :meth:`apply` in order
    (those of other tasks are ignored), read :meth:`task` whenever.

    ``file_data`` reads the images tool calls return (artifacts). ``submitted`` holds the
    message that starts a task the caller is about to run (its prompt is then known
    before the trace has it).
    """

    def __init__(
        self,
        *,
        context_id: str,
        run_id: str,
        file_data: FileData | None = None,
        submitted: dict[str, Any] | None = None,
    ) -> None:
        self.context_id = context_id
        self.run_id = run_id
        self.id = task_id(context_id, run_id)
        self.state: TaskState = "submitted"
        self.history: list[dict[str, Any]] = [submitted] if submitted is not None else []
        self.artifacts: list[dict[str, Any]] = []
        self.pending: dict[str, ApprovalRequest] = {}
        """The requests waiting for a person, by call id."""
        self.decided: set[str] = set()
        """The calls whose request was decided."""
        self._answered: set[str] = set()
        """Questions (``ask_user``) a person answered whose call has no result yet: the
        result is the answer, the user's turn in the history."""
        self._asks: dict[str, int] = {}
        """How many requests (and answers) each call had so far: a call asked twice (its
        approval, then its question while it runs) gets a message id for each."""
        self.status_message: dict[str, Any] | None = None
        self.seen = submitted is not None
        """Whether any output (or the submitted message) of the task was seen."""
        self._file_data = file_data or (lambda block: None)
        self._prompt_seen = False
        self._texts: list[str] = []
        """The text blocks of the model's last message (the answer, once the task ends)."""

    @property
    def final(self) -> bool:
        """Whether a stream of the task ends here: an end state or ``input-required``."""
        return self.state in END_STATES or self.state == "input-required"

    def task(self, history_length: int | None = None) -> dict[str, Any]:
        """The A2A ``Task`` now; ``history_length`` keeps that many last messages."""
        history = self.history
        if history_length is not None:
            history = history[-history_length:] if history_length > 0 else []
        return {
            "kind": "task",
            "id": self.id,
            "contextId": self.context_id,
            "status": self._status(),
            "history": list(history),
            "artifacts": list(self.artifacts),
        }

    def status_event(self) -> dict[str, Any]:
        """A ``status-update`` event of the state now."""
        return {
            "kind": "status-update",
            "taskId": self.id,
            "contextId": self.context_id,
            "status": self._status(),
            "final": self.final,
        }

    def _status(self) -> dict[str, Any]:
        status: dict[str, Any] = {"state": self.state}
        if self.status_message is not None:
            status["message"] = self.status_message
        return status

    def _agent(self, message_id: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        said = message(
            "agent", parts, message_id=message_id, context_id=self.context_id, task=self.id
        )
        self.history.append(said)
        return said

    def _moved(self, state: TaskState, said: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.state = state
        self.status_message = said
        return [self.status_event()]

    def apply(self, output: Output) -> list[dict[str, Any]]:
        """Fold one output in; the stream events it causes (none for most)."""
        if output.run_id != self.run_id or output.origin is not None:
            return []
        self.seen = True
        match output:
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                return []  # live pieces: the complete blocks follow
            case UserMsg():
                return self._user(output)
            case TaskStart():
                return self._moved("working")
            case ModelMsg():
                return self._model(output)
            case ToolCallOutput():
                return self._tool_result(output)
            case ApprovalRequest():
                return self._asked(output)
            case ApprovalDecision():
                request = self.pending.pop(output.call_id, None)
                question = request is not None and request.kind == "question"
                # A question asked before its call was decided is the model's (ask_user):
                # its ``allow`` only records that it was answered; the answer's text is
                # the call's result, written as the user's turn when it comes.
                asked = question and output.call_id not in self.decided
                self.decided.add(output.call_id)
                if output.by == "client" and asked and output.decision == "allow":
                    self._answered.add(output.call_id)
                elif output.by == "client" and question:
                    # A running call's question (an MCP elicitation), or any declined: its
                    # ``allow`` and ``deny`` say answered or declined; a running call's
                    # answer went to the call alone.
                    answer = "answered" if output.decision == "allow" else "declined"
                    replied = {"call_id": output.call_id, "question": answer}
                    self._user_answer(output.call_id, [data_part(replied)])
                elif output.by == "client":  # a person's answer: the user's turn
                    word = "always" if output.remember else output.decision
                    decided = {"call_id": output.call_id, "decision": word}
                    self._user_answer(output.call_id, [text_part(word), data_part(decided)])
                if self.pending or self.state in END_STATES:
                    return []
                return self._moved("working")
            case TaskEnd():
                return self._ended(output)
            case RequestBegin():
                self._texts = []
                return []
            case RequestEnd() | TokenUsageOutput() | Abort() | CompactionBegin() | CompactionEnd():
                return []
            case CallResolved():
                # A question about a call in doubt is answered (R-EFFECT-2): no longer input.
                self.pending.pop(output.call_id, None)
                if self.pending or self.state in END_STATES:
                    return []
                return self._moved("working")
            case (
                CallInDoubt() | ToolHook() | Rewind() | TaskQueuedOutput() | TaskQueueDropped()
                | SteeringQueuedOutput()
            ):
                return []  # what they change shows in the records that follow
            case _:
                assert_never(output)

    def _numbered(self, kind: str, call_id: str) -> str:
        """The id of a request (``ask``) or answer (``answer``) message of ``call_id``:
        the first of each has the call's id alone, later ones a number after it."""
        key = f"{kind}-{call_id}"
        count = self._asks[key] = self._asks.get(key, 0) + 1
        return f"{self.run_id}-{key}" if count == 1 else f"{self.run_id}-{key}-{count}"

    def _asked(self, output: ApprovalRequest) -> list[dict[str, Any]]:
        self.pending[output.call_id] = output
        request: dict[str, Any] = {
            "call_id": output.call_id,
            "tool": output.tool,
            "arguments": output.arguments,
            "kind": output.kind,
        }
        if output.kind == "question":
            request["choices"] = question_choices(output.arguments)
        said = self._agent(
            self._numbered("ask", output.call_id),
            [text_part(approval_prompt(output)), data_part({"approval_request": request})],
        )
        return self._moved("input-required", said)

    def _user(self, output: UserMsg) -> list[dict[str, Any]]:
        if output.kind == "prompt" and self.history and not self._prompt_seen:
            self._prompt_seen = True  # the submitted message: known already
            return []
        self._prompt_seen = True
        # The runtime's note to a task its host lost rides as steering: it is the
        # agent's side speaking, never the user's words.
        lost = any(_host_lost(b) for b in output.content)
        texts = [b.text for b in output.content if isinstance(b, TextBlock) and not _host_lost(b)]
        if texts or not lost:
            self.history.append(
                message(
                    "user",
                    [text_part("\n".join(texts))],
                    message_id=f"{self.run_id}-in-{output.seq}",
                    context_id=self.context_id,
                    task=self.id,
                )
            )
        if not lost:
            return []
        said = self._agent(f"{self.run_id}-note-{output.seq}", [text_part(HOST_LOST_NOTE)])
        return [] if self.state in END_STATES else self._moved("working", said)

    def _user_answer(self, call_id: str, parts: list[dict[str, Any]]) -> None:
        """A person's answer to the request of ``call_id``: the user's turn in the
        history."""
        self.history.append(
            message(
                "user",
                parts,
                message_id=self._numbered("answer", call_id),
                context_id=self.context_id,
                task=self.id,
            )
        )

    def _model(self, output: ModelMsg) -> list[dict[str, Any]]:
        block = output.block
        if isinstance(block, TextBlock) and block.text:
            self._texts.append(block.text)
            said = self._agent(f"{self.run_id}-m{output.seq}", [text_part(block.text)])
            return self._moved("working", said)
        if isinstance(block, ToolCallBlock):
            call = {"id": block.id, "name": block.name, "arguments": block.arguments}
            said = self._agent(f"{self.run_id}-m{output.seq}", [data_part({"tool_call": call})])
            return self._moved("working", said)
        return []  # thinking is the model's own

    def _tool_result(self, output: ToolCallOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        text = "\n".join(b.text for b in output.content if isinstance(b, TextBlock))
        if output.call_id in self._answered:
            self._answered.discard(output.call_id)
            answer = {"call_id": output.call_id, "answer": text}
            self._user_answer(output.call_id, [text_part(text), data_part(answer)])
        result = {
            "call_id": output.call_id,
            "tool": output.tool,
            "status": output.status,
            "is_error": output.is_error,
            "text": text,
        }
        said = self._agent(f"{self.run_id}-m{output.seq}", [data_part({"tool_result": result})])
        images = [b for b in output.content if isinstance(b, ImageBlock)]
        for number, image in enumerate(images):
            loaded = self._file_data(image)
            if loaded is None:
                continue
            media_type, data = loaded
            artifact = {
                "artifactId": f"{output.call_id}-{number}",
                "name": image.path,
                "description": f"returned by {output.tool} ({output.call_id})",
                "parts": [
                    {
                        "kind": "file",
                        "file": {"name": image.path, "mimeType": media_type, "bytes": data},
                    }
                ],
            }
            self.artifacts.append(artifact)
            events.append(
                {
                    "kind": "artifact-update",
                    "taskId": self.id,
                    "contextId": self.context_id,
                    "artifact": artifact,
                    "lastChunk": True,
                }
            )
        return [*events, *self._moved("working", said)]

    def _ended(self, output: TaskEnd) -> list[dict[str, Any]]:
        self.pending.clear()
        match output.status:
            case "completed":
                answer = "\n".join(self._texts)
                said = (
                    None
                    if not answer
                    else message(
                        "agent",
                        [text_part(answer)],
                        message_id=f"{self.run_id}-answer",
                        context_id=self.context_id,
                        task=self.id,
                    )
                )
                return self._moved("completed", said)
            case "aborted":
                return self._moved("canceled", self._note("canceled", output))
            case "failed" | "auth" | "max_turns" | "loop_detected" | "budget_exceeded":
                return self._moved("failed", self._note("failed", output))
            case _:
                assert_never(output.status)

    def _note(self, state: str, output: TaskEnd) -> dict[str, Any]:
        words = output.message or f"the task ended: {output.status}"
        return message(
            "agent",
            [text_part(words)],
            message_id=f"{self.run_id}-{state}",
            context_id=self.context_id,
            task=self.id,
        )


def _host_lost(block: object) -> bool:
    return isinstance(block, TextBlock) and block.text == HOST_LOST_CONTINUATION


def open_run(outputs: Iterable[Output]) -> str | None:
    """The run id of the session's task that has started and not ended (the one a
    pending approval belongs to), from its outputs in order; None when every task ended."""
    running: str | None = None
    for output in outputs:
        if output.origin is not None:
            continue
        if isinstance(output, TaskStart):
            running = output.run_id
        elif isinstance(output, TaskEnd) and output.run_id == running:
            running = None
    return running
