"""People in the loop (R-HITL): what a pending request of a person looks like, and the
checks an answer must pass.

A request waits in the trace as an ``approval_request`` record until its
``approval_decision``; :class:`PendingApproval` is that request as the API, the gateway,
the CLI and the console list it. An answer names the call and may name the digest of the
arguments it was given (:func:`arguments_digest`): a call no longer pending, or whose
arguments are not those the person saw, is refused (R-HITL-2).

A question's answer is text. It must be one of the question's ``choices`` when it has
some (``ask_user``), and fit its ``requested_schema`` when it has one (an MCP server's
elicitation, R-HITL-5): :func:`answer_problem` says why an answer does not,
:func:`form_content` turns one that does into the object the schema describes — a JSON
object, or, for a schema of one field, that field's value written plainly (``M``, ``3``,
``yes``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any, Literal

import attrs

from greenroom.protocols.outputs import ApprovalRequest, PeopleKind

__all__ = [
    "ASK_USER",
    "PEOPLE",
    "PendingApproval",
    "Verdict",
    "answer_problem",
    "answered_with_text",
    "arguments_digest",
    "form_content",
    "waiting_requests",
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
        kind: ``approval``, ``question`` (``ask_user``: answer with text) or ``in_doubt``
            (a call its host lost: answer ``done``, ``not done`` or ``run again``).
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


def answered_with_text(kind: PeopleKind) -> bool:
    """Whether a request of ``kind`` is answered with text (``host.answer_question``, the
    gateway's ``answer``): a question (``ask_user``, an elicitation) or a call in doubt
    (``done``, ``not done``, ``run again``: R-EFFECT-2); an approval is decided."""
    return kind != "approval"


def answer_problem(arguments: dict[str, Any], text: str) -> str | None:
    """Why ``text`` cannot answer the question asked with ``arguments`` (None when it
    can): not one of its ``choices``, or not fitting its ``requested_schema``."""
    choices = arguments.get("choices")
    if isinstance(choices, list) and choices and text not in choices:
        return f"asks to choose one of {choices}"
    schema = arguments.get("requested_schema")
    if isinstance(schema, dict):
        content = form_content(schema, text)
        if isinstance(content, str):
            return content
    return None


_TRUE = frozenset({"true", "yes", "y", "1", "on"})
_FALSE = frozenset({"false", "no", "n", "0", "off"})


def form_content(schema: dict[str, Any], text: str) -> dict[str, Any] | str:
    """The object that ``text`` gives for an elicitation's ``requested_schema`` (a flat
    object of strings, numbers, booleans and enums), or why it gives none. ``text`` is a
    JSON object; or, when the schema has exactly one field, that field's value written
    plainly."""
    properties = schema.get("properties")
    fields: dict[str, Any] = properties if isinstance(properties, dict) else {}
    stripped = text.strip()
    value: Any = None
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except ValueError as exc:
            return f"the answer is not a JSON object: {exc}"
    if isinstance(value, dict):
        content = value
    elif len(fields) == 1:
        ((name, field),) = fields.items()
        plain = _plain_value(field if isinstance(field, dict) else {}, stripped)
        if isinstance(plain, _Refused):
            return f"{name}: {plain.why}"
        content = {name: plain}
    elif not fields:
        content = {}
    else:
        return f"answer with a JSON object of the fields {sorted(fields)}"
    required = schema.get("required")
    for name in required if isinstance(required, list) else ():
        if name not in content:
            return f"{name} is required"
    for name, item in content.items():
        field = fields.get(name)
        if not isinstance(field, dict):
            return f"{name} is not a field of the form (its fields: {sorted(fields)})"
        why = _value_problem(field, item)
        if why is not None:
            return f"{name}: {why}"
    return content


@attrs.frozen
class _Refused:
    why: str


def _options(field: dict[str, Any]) -> list[Any] | None:
    """The values an enum field allows (``enum``, or ``oneOf``/``anyOf`` of ``const``)."""
    if isinstance(field.get("enum"), list):
        return list(field["enum"])
    for key in ("oneOf", "anyOf"):
        items = field.get(key)
        if isinstance(items, list):
            return [i.get("const") for i in items if isinstance(i, dict) and "const" in i]
    return None


def _plain_value(field: dict[str, Any], text: str) -> Any:
    """A field's value written plainly, converted to the field's type."""
    kind = field.get("type")
    if kind == "boolean":
        lowered = text.lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
        return _Refused("answer yes or no")
    if kind in ("integer", "number"):
        try:
            number = float(text)
        except ValueError:
            return _Refused(f"answer with a number, not {text!r}")
        if kind == "integer" or number.is_integer():
            if not number.is_integer():
                return _Refused(f"answer with a whole number, not {text!r}")
            return int(number)
        return number
    if kind == "array":
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def _value_problem(field: dict[str, Any], value: Any) -> str | None:
    kind = field.get("type")
    options = _options(field)
    if kind == "array":
        items = field.get("items")
        allowed = _options(items) if isinstance(items, dict) else None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return "expected a list of strings"
        if allowed is not None and any(v not in allowed for v in value):
            return f"choose among {allowed}"
        return None
    if options is not None:
        return None if value in options else f"choose one of {options}"
    if kind == "string":
        if not isinstance(value, str):
            return "expected a string"
        low, high = field.get("minLength"), field.get("maxLength")
        if isinstance(low, int) and len(value) < low:
            return f"at least {low} characters"
        if isinstance(high, int) and len(value) > high:
            return f"at most {high} characters"
        return None
    if kind == "boolean":
        return None if isinstance(value, bool) else "expected true or false"
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "expected a number"
        if kind == "integer" and not float(value).is_integer():
            return "expected a whole number"
        low, high = field.get("minimum"), field.get("maximum")
        if isinstance(low, int | float) and value < low:
            return f"at least {low:g}"
        if isinstance(high, int | float) and value > high:
            return f"at most {high:g}"
    return None


def waiting_requests(
    pending: Iterable[ApprovalRequest],
    allowed: AbstractSet[str],
    *,
    session_id: str,
    origin: tuple[str, ...],
    running: bool,
) -> list[PendingApproval]:
    """The requests of a session's open task that wait for a person, as every reader lists
    them (the host's ``pending_approvals``, ``greenroom approvals``): its ``pending``
    ``approval_request`` records, less the questions of calls that were ``allowed`` and
    running (an MCP elicitation) unless a supervisor still runs them (``running``): one
    that a stopped host left in the trace is settled when the task resumes (the call is
    in doubt), and nobody can answer it. The question about a call in doubt counts always
    (R-EFFECT-2)."""
    return [
        PendingApproval(
            session_id=session_id,
            call_id=request.call_id,
            tool=request.tool,
            arguments=request.arguments,
            asked_at=request.asked_at,
            origin=origin,
            kind=request.kind,
            digest=arguments_digest(request.arguments),
        )
        for request in pending
        if running or request.call_id not in allowed or request.kind == "in_doubt"
    ]
