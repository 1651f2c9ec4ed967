"""People in the loop (R-HITL): what a pending request of a person looks like, and the
checks an answer must pass.

A request waits in the trace as an ``approval_request`` record until its
``approval_decision``; :class:`PendingApproval` is that request as the API, the gateway,
the CLI and the console list it. An answer names the call and may name the digest of the
arguments it was given (:func:`arguments_digest`): a call no longer pending, or whose
arguments are not those the person saw, is refused (R-HITL-2).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import attrs

from greenroom.protocols.outputs import PeopleKind

__all__ = [
    "ASK_USER",
    "PEOPLE",
    "PendingApproval",
    "Verdict",
    "arguments_digest",
]

ASK_USER = "ask_user"
"""The built-in tool by which the model asks the person a question (R-HITL-5): a call to a
tool of this name is answered by a person, and the answer is its result."""

PEOPLE: Literal["people"] = "people"
"""``session.run(…, approve=PEOPLE)``: tool calls wait for a person's decision, asked
through the trace (``approval_request``) and answered from any surface — the API
(``host.answer_approval``), the gateway, the CLI, the console, an editor (R-HITL)."""

Verdict = Literal["allow", "deny", "allow_session"]


def arguments_digest(arguments: Any) -> str:
    """A short digest of a call's arguments (canonical JSON): what an answer names to be
    sure it decides the call the person saw."""
    text = json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@attrs.frozen(kw_only=True)
class PendingApproval:
    """A request waiting for a person (R-HITL-1).

    Fields:
        session_id: the session (a subagent's own id for a call inside a subagent).
        call_id: the tool call; answers name it.
        tool: the tool's name.
        arguments: the call's arguments.
        asked_at: when it was asked (seconds since the epoch), or None.
        origin: the session ids from the root to ``session_id`` (R-HOST-4).
        kind: ``approval``, ``question`` (``ask_user``: answer with text) or ``in_doubt``.
        digest: :func:`arguments_digest` of ``arguments``; an answer may name it.
    """

    session_id: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    asked_at: float | None
    origin: tuple[str, ...]
    kind: PeopleKind = "approval"
    digest: str = ""
