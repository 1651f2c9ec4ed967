"""The words people read for runtime facts, one vocabulary for the CLI, chat and console.

The JSON keeps its values (``by: host | session_rule | default``); screens show these.
The web console carries the same table in its script (``DECISION_WORDS``), checked
against this one by a test.
"""

from __future__ import annotations

from greenroom.protocols.outputs import DecidedBy, Decision

DECISION_WORDS: dict[tuple[Decision, DecidedBy], str] = {
    ("allow", "host"): "allowed by you",
    ("allow", "session_rule"): "allowed for this session",
    ("allow", "default"): "allowed by default",
    ("deny", "host"): "denied by you",
    ("deny", "session_rule"): "denied by a session rule",
    ("deny", "default"): "denied: no one to ask",
}
"""An ``approval_decision``'s ``(decision, by)`` in plain words."""

INTERRUPTED_APPROVAL = "denied: interrupted"
"""What a terminal shows when Ctrl-C answers an approval prompt (recorded as a deny)."""


def decision_words(decision: Decision, by: DecidedBy) -> str:
    """The plain words for an approval decision, e.g. ``"allowed for this session"``."""
    return DECISION_WORDS[(decision, by)]


def allowed_without_asking(source: str) -> str:
    """The words for a call the host allowed without asking anyone, because ``source``
    allows every call: ``"allowed by --approve all"``. ``allowed by you`` would claim a
    person was asked."""
    return f"allowed by {source}"
