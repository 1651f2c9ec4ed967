"""Exactly-once effects (R-EFFECT): a call's idempotency key, and how a call whose host was
lost is resolved. Pure: no I/O.

**The key (R-EFFECT-1).** Every tool call has one :func:`idempotency_key`, derived from
facts of the session's trace — the session id, the ``seq`` of the ``model_msg`` that holds
the call, and the call id — so every host that reads the trace, before or after any
restart or takeover, derives the same key for the same call, and a key never names two
calls: a session's ``seq`` never repeats, while a model may well repeat a call id in a
later turn. It is a hash of those facts: fixed in length and in ``[0-9a-f]`` (payment APIs
bound keys to 255 characters of a plain alphabet; call ids come from the model), and it
shows no session id to the services it is sent to.

**In doubt (R-EFFECT-2).** A call that was allowed but has no recorded result when its task
is taken up (its host was killed, crashed or lost its lease) may or may not have taken
effect: it is *in doubt*, and ``call_in_doubt`` says so in the trace. It is resolved by the
first of these that applies (:func:`first_resolver`):

1. ``check`` — the tool declares ``@tool(check=fn)``: ``fn(key)`` asks the outside world.
   A result is the call's result; None means it did not happen, and the call runs once
   more with the same key. A check that raises or runs out of time falls through, and so
   does one that answers a ``bool`` or an awaitable (:func:`check_answer_problem`).
2. ``note`` — an idempotent tool (running it again is safe: R-CLUSTER-2) or one without
   side effects, or one the session no longer has: the model is told the call was lost
   and was not run again (an idempotent tool's note says calling it again is safe).
3. ``person`` — the task's requests go to people (``approve="people"``): a person is asked
   :data:`IN_DOUBT_QUESTION` with the choices :data:`IN_DOUBT_CHOICES`, durably, like
   ``ask_user`` (R-HITL): *done*, *not done* or *run again*.
4. ``note`` — nobody can be asked.

Each resolution is one ``call_resolved`` record (``by``, ``outcome``): exactly one for each
``call_in_doubt``, before the call's result or its second run.

A task's ``final_answer`` call (R-OUT-1) is no tool and runs nothing: it is never in doubt
(:mod:`greenroom.actors.runtime.in_doubt` gives it its result from its recorded arguments).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from typing import Any, Literal

from greenroom.protocols.outputs import Resolution
from greenroom.protocols.tools import Tool

__all__ = [
    "CHECK_TIMEOUT_S",
    "IN_DOUBT_CHOICES",
    "IN_DOUBT_DONE",
    "IN_DOUBT_NOT_DONE",
    "IN_DOUBT_QUESTION",
    "IN_DOUBT_RUN_AGAIN",
    "MCP_META_KEY",
    "Resolver",
    "check_answer_problem",
    "first_resolver",
    "idempotency_key",
    "in_doubt_question",
    "outcome_of_answer",
]

MCP_META_KEY = "greenroom/idempotency_key"
"""The ``_meta`` entry of an MCP ``tools/call`` request that carries the call's key."""

CHECK_TIMEOUT_S = 30.0
"""How long a tool's ``check`` may take (or the tool's ``timeout_s``, when shorter) before
it counts as no answer and the resolution falls through."""

IN_DOUBT_DONE = "done"
IN_DOUBT_NOT_DONE = "not done"
IN_DOUBT_RUN_AGAIN = "run again"
IN_DOUBT_CHOICES = (IN_DOUBT_DONE, IN_DOUBT_NOT_DONE, IN_DOUBT_RUN_AGAIN)
"""What a person answers to an in-doubt call's question."""

IN_DOUBT_QUESTION = (
    "The host running this call of {tool} was lost before its result was recorded. "
    "Did it take effect? done: it did (the model is told so); not done: it did not, and "
    "it is not run (the model is told so); run again: it runs once more, with the same "
    "idempotency key."
)
"""The question a person is asked about an in-doubt call (``{tool}``: its tool)."""

_OUTCOMES: dict[str, Resolution] = {
    IN_DOUBT_DONE: "done",
    IN_DOUBT_NOT_DONE: "not_done",
    IN_DOUBT_RUN_AGAIN: "rerun",
}

Resolver = Literal["check", "person", "note"]
"""Who resolves an in-doubt call: the tool's check, a person, or the model's note."""


def idempotency_key(session_id: str, seq: int | None, call_id: str) -> str:
    """The key of the call ``call_id`` whose ``model_msg`` has ``seq`` in session
    ``session_id`` (see the module docstring): ``gr-`` and 32 hex digits."""
    facts = f"{session_id}\n{seq if seq is not None else ''}\n{call_id}"
    return "gr-" + hashlib.sha256(facts.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def check_answer_problem(value: Any) -> str | None:
    """Why ``value``, what a tool's check answered, is no answer; None when it is one (a
    result, or None). ``True`` and ``False`` say whether something happened, not what
    it reported: taken as a result, ``False`` (meant as *not found*) told the model the
    payment was made; taken as *not done*, a guess would run a call again — so neither.
    An awaitable is a check that forgot an ``await`` (it is closed, never run)."""
    if isinstance(value, bool):
        return (
            f"the check answered {value}: it must answer the effect it found (text, content "
            "or a ToolResult), or None when there is none"
        )
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # never awaited: no warning, nothing run
        return f"the check answered an awaitable ({type(value).__name__}): it lacks an await"
    return None


def first_resolver(tool: Tool | None, *, people: bool, check_failed: bool) -> Resolver:
    """Who resolves an in-doubt call of ``tool`` (None: the session no longer has the
    tool) now: its check, unless it was asked and gave no answer; else a person, where
    ``people`` answer the task's requests and the call could have had an effect that
    running it again might repeat; else the note."""
    if tool is None:
        return "note"  # nothing can check it or run it again
    if tool.check is not None and not check_failed:
        return "check"
    if people and tool.side_effects and not tool.idempotent:
        return "person"
    return "note"


def in_doubt_question(
    tool: str, arguments: Mapping[str, Any], key: str, check_error: str | None
) -> dict[str, Any]:
    """The arguments of an in-doubt call's ``approval_request`` (kind ``in_doubt``): shaped
    like an ``ask_user`` question — ``question`` and ``choices`` — so every surface that
    answers questions answers it, with the call's own ``arguments``, its
    ``idempotency_key`` (to look the effect up by) and why its check gave no answer."""
    question: dict[str, Any] = {
        "question": IN_DOUBT_QUESTION.format(tool=tool),
        "choices": list(IN_DOUBT_CHOICES),
        "arguments": dict(arguments),
        "idempotency_key": key,
    }
    if check_error is not None:
        question["check_error"] = check_error
    return question


def outcome_of_answer(text: str) -> Resolution | None:
    """The outcome a person's answer gives (one of :data:`IN_DOUBT_CHOICES`, case and
    surrounding blanks aside); None for any other text."""
    return _OUTCOMES.get(text.strip().casefold())
