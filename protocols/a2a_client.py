"""Calling a remote A2A agent as a tool (R-PROTO-1, the caller's side). No I/O.

A remote agent is known by its agent card (:func:`remote_agent` checks the fields used and
says what is wrong with one that lacks them). The tool it becomes is named after the card
(:func:`tool_name`), described by its description and skills, and takes ``message`` — and
``context_id`` / ``task_id`` to go on with a conversation or answer a question the agent
asked; both come back in every result, so the model carries them, and a restart or another
host loses nothing.

:class:`RemoteCall` folds what the agent answers — the ``Task`` or ``Message`` of
``message/send``, the events of ``message/stream`` (``status-update``, ``artifact-update``)
— into its state, its ids, a progress note per event and, at the end, the text the model
gets (:meth:`RemoteCall.outcome`). The A2A binding is version 0.3's JSON-RPC, the one
``serve --a2a`` speaks.

Invariants: every text the agent sent is bounded before it is kept (a note
:data:`MAX_NOTE_CHARS`, the answer :data:`MAX_ANSWER_CHARS`); nothing the agent sends can
make the fold raise — an event of an unknown shape is skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "END_STATES",
    "MAX_ANSWER_CHARS",
    "RemoteAgent",
    "RemoteCall",
    "card_url",
    "remote_agent",
    "request",
    "rpc_error_text",
    "tool_name",
]

CARD_PATH = "/.well-known/agent-card.json"
"""Where an agent card is served under an agent's base URL (A2A 0.3)."""

END_STATES = frozenset({"completed", "canceled", "failed", "rejected"})
"""Task states after which the agent does nothing more for the task."""

WAITING_STATES = frozenset({"input-required", "auth-required"})
"""Task states in which the agent waits for the caller's next message."""

MAX_NOTE_CHARS = 300
"""A progress note is cut to this many characters."""

MAX_ANSWER_CHARS = 100_000
"""The text the model gets is cut to this many characters (the note says so)."""

_SLUG = re.compile(r"[^a-z0-9]+")


class CardError(ValueError):
    """An agent card that cannot be used; the message says where it came from and why."""


@attrs.frozen
class RemoteAgent:
    """What the caller uses of an agent card."""

    name: str
    description: str
    url: str
    """The JSON-RPC endpoint."""
    streaming: bool
    skills: tuple[tuple[str, str], ...] = ()
    """``(name, description)`` of each skill."""

    def tool_description(self) -> str:
        """What the model is told of the tool."""
        lines = [
            f"Send a message to the remote agent {self.name!r} (A2A) and get its answer. "
            f"{self.description}".strip()
        ]
        for name, description in self.skills[:20]:
            lines.append(f"- {name}: {description}"[:MAX_NOTE_CHARS])
        lines.append(
            "Pass the context_id of an earlier answer to go on with that conversation, and "
            "its task_id too to answer a question the agent asked."
        )
        return "\n".join(lines)


def card_url(url: str) -> str:
    """Where the agent card of the agent at ``url`` is: ``url`` itself when it names a
    ``.json`` file, else the well-known path under it."""
    if url.endswith(".json"):
        return url
    return url.rstrip("/") + CARD_PATH


def remote_agent(card: Any, source: str) -> RemoteAgent:
    """The agent a card describes. Raises :class:`CardError` naming ``source`` and the
    field when a field the caller needs is missing or of the wrong type."""
    if not isinstance(card, Mapping):
        raise CardError(f"{source}: the agent card is not a JSON object")
    name, url = card.get("name"), card.get("url")
    if not isinstance(name, str) or not name.strip():
        raise CardError(f"{source}: the agent card has no name")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise CardError(f"{source}: the agent card's url is not an http(s) URL")
    description = card.get("description")
    capabilities = card.get("capabilities")
    streaming = isinstance(capabilities, Mapping) and capabilities.get("streaming") is True
    skills: list[tuple[str, str]] = []
    for skill in card.get("skills") or ():
        if isinstance(skill, Mapping) and isinstance(skill.get("name"), str):
            about = skill.get("description")
            skills.append((skill["name"][:100], about[:500] if isinstance(about, str) else ""))
    return RemoteAgent(
        name=name.strip()[:100],
        description=description[:2000] if isinstance(description, str) else "",
        url=url,
        streaming=streaming,
        skills=tuple(skills),
    )


def tool_name(agent: RemoteAgent) -> str:
    """The tool's name: ``a2a_`` and the card's name in lower-case words joined by ``_``
    (a tool name the providers take: letters, digits and ``_``, at most 64)."""
    slug = _SLUG.sub("_", agent.name.lower()).strip("_") or "agent"
    return ("a2a_" + slug)[:64]


def request(
    request_id: int,
    text: str,
    *,
    message_id: str,
    context_id: str | None,
    task_id: str | None,
    stream: bool,
) -> dict[str, Any]:
    """The JSON-RPC request that sends ``text`` as the user's message (``message/stream``
    when ``stream``, else ``message/send``)."""
    message: dict[str, Any] = {
        "kind": "message",
        "role": "user",
        "messageId": message_id,
        "parts": [{"kind": "text", "text": text}],
    }
    if context_id:
        message["contextId"] = context_id
    if task_id:
        message["taskId"] = task_id
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "message/stream" if stream else "message/send",
        "params": {"message": message},
    }


def cancel_request(request_id: int, task_id: str) -> dict[str, Any]:
    """The JSON-RPC ``tasks/cancel`` of ``task_id``."""
    return {"jsonrpc": "2.0", "id": request_id, "method": "tasks/cancel",
            "params": {"id": task_id}}


def rpc_error_text(error: Any) -> str:
    """A JSON-RPC error object in words."""
    if isinstance(error, Mapping):
        message = error.get("message")
        code = error.get("code")
        words = message[:MAX_NOTE_CHARS] if isinstance(message, str) else "an error"
        return f"{words} (code {code})" if isinstance(code, int) else words
    return "an error without a message"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parts_text(parts: Any) -> str:
    """The text of a message's or an artifact's parts: text as it is, data as compact
    JSON, a file as its name and type."""
    pieces: list[str] = []
    for part in parts if isinstance(parts, list) else ():
        if not isinstance(part, Mapping):
            continue
        kind = part.get("kind")
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind == "data":
            try:
                pieces.append(json.dumps(part.get("data"), ensure_ascii=False,
                                         separators=(",", ":")))
            except (TypeError, ValueError):
                continue
        elif kind == "file" and isinstance(part.get("file"), Mapping):
            file = part["file"]
            name = file.get("name") if isinstance(file.get("name"), str) else "a file"
            kind_of = file.get("mimeType") if isinstance(file.get("mimeType"), str) else "?"
            pieces.append(f"[file {name} ({kind_of})]")
    return "\n".join(pieces)


class RemoteCall:
    """One call of the remote agent: the results of its requests, folded."""

    def __init__(self, agent: RemoteAgent, tool: str) -> None:
        self.agent = agent
        self.tool = tool
        self.state: str | None = None
        self.context_id: str | None = None
        self.task_id: str | None = None
        self.said: str = ""
        """The text of the agent's last message (a status message, or a direct reply)."""
        self.artifacts: dict[str, str] = {}
        """Each artifact's text so far, by its id, in arrival order."""

    @property
    def waiting(self) -> bool:
        """Whether the agent waits for the caller's next message."""
        return self.state in WAITING_STATES

    @property
    def over(self) -> bool:
        """Whether the task (or the direct reply) is over."""
        return self.state in END_STATES

    def apply(self, result: Any) -> str | None:
        """Fold one result (a ``Task``, ``Message`` or stream event) in; the progress note
        it gives, if any."""
        if not isinstance(result, Mapping):
            return None
        kind = result.get("kind")
        self._ids(result)
        if kind == "task":
            self._status(result.get("status"))
            for artifact in result.get("artifacts") or ():
                self._artifact(artifact, append=False)
            return None
        if kind == "message":
            self.said = _clip(parts_text(result.get("parts")), MAX_ANSWER_CHARS)
            self.state = self.state if self.task_id else "completed"  # a direct reply
            return _clip(self.said, MAX_NOTE_CHARS) or None
        if kind == "status-update":
            note = self._status(result.get("status"))
            return note or f"{self.agent.name}: {self.state}"
        if kind == "artifact-update":
            artifact = result.get("artifact")
            self._artifact(artifact, append=result.get("append") is True)
            if isinstance(artifact, Mapping):
                return _clip(parts_text(artifact.get("parts")), MAX_NOTE_CHARS) or None
        return None

    def _ids(self, result: Mapping[str, Any]) -> None:
        task = result.get("id") if result.get("kind") == "task" else result.get("taskId")
        if isinstance(task, str) and task:
            self.task_id = task[:500]
        context = result.get("contextId")
        if isinstance(context, str) and context:
            self.context_id = context[:500]

    def _status(self, status: Any) -> str | None:
        if not isinstance(status, Mapping):
            return None
        state = status.get("state")
        if isinstance(state, str):
            self.state = state
        message = status.get("message")
        if isinstance(message, Mapping):
            said = parts_text(message.get("parts"))
            if said:
                self.said = _clip(said, MAX_ANSWER_CHARS)
                return _clip(said, MAX_NOTE_CHARS)
        return None

    def _artifact(self, artifact: Any, *, append: bool) -> None:
        if not isinstance(artifact, Mapping):
            return
        key = artifact.get("artifactId")
        key = key if isinstance(key, str) else str(len(self.artifacts))
        text = parts_text(artifact.get("parts"))
        before = self.artifacts.get(key, "") if append else ""
        self.artifacts[key] = _clip(before + text, MAX_ANSWER_CHARS)

    def question(self) -> str:
        """What the agent asks, while it waits for the caller."""
        return self.said or f"{self.agent.name} needs more input ({self.state})"

    def outcome(self) -> str:
        """The text the model gets: the agent's answer (its last message and its
        artifacts), then one line with the ids to go on with and the state."""
        body = "\n\n".join(t for t in (self.said, *self.artifacts.values()) if t)
        if len(body) > MAX_ANSWER_CHARS:
            body = body[:MAX_ANSWER_CHARS] + f"\n[cut at {MAX_ANSWER_CHARS} characters]"
        ids = [f"state={self.state or 'unknown'}"]
        if self.context_id:
            ids.append(f"context_id={self.context_id}")
        if self.task_id:
            ids.append(f"task_id={self.task_id}")
        footer = f"[a2a {self.agent.name}: {', '.join(ids)}]"
        if self.waiting:
            footer += (
                f"\nThe agent waits for an answer: call {self.tool} again with this "
                "context_id and task_id and the answer as message."
            )
        return f"{body}\n\n{footer}" if body else footer
