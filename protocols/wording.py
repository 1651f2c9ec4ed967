"""The words people read for runtime facts, one vocabulary for the CLI, chat and console.

The JSON keeps its values (``by: host | client | session_rule | default | hook``); screens
show these.
The web console carries the same table in its script (``DECISION_WORDS``), checked
against this one by a test.
"""

from __future__ import annotations

import json
import stat

from greenroom.protocols.outputs import CallInDoubt, CallResolved, DecidedBy, Decision, ToolHook

DECISION_WORDS: dict[tuple[Decision, DecidedBy], str] = {
    ("allow", "host"): "allowed by you",
    ("allow", "client"): "allowed by a person",
    ("allow", "session_rule"): "allowed for this session",
    ("allow", "default"): "allowed by default",
    ("deny", "host"): "denied by you",
    ("deny", "client"): "denied by a person",
    ("deny", "session_rule"): "denied by a session rule",
    ("deny", "default"): "denied: no one to ask",
    ("allow", "hook"): "allowed by a hook",
    ("deny", "hook"): "denied by a hook",
}
"""An ``approval_decision``'s ``(decision, by)`` in plain words."""


def tool_hook_words(record: ToolHook) -> str:
    """What a tool hook did, in words (R-HOOK-2): ``before_tool hook denied it: <reason>``,
    ``before_tool hook rewrote its arguments: {…}``, ``after_tool hook replaced its result``,
    ``after_tool hook failed (<reason>): result kept``."""
    hook = f"{record.hook} hook"
    if record.action == "deny":
        return f"{hook} denied it: {record.reason}"
    if record.action == "rewrite":
        return f"{hook} rewrote its arguments: {json.dumps(record.arguments, ensure_ascii=False)}"
    if record.action == "replace":
        return f"{hook} replaced its result"
    kept = "call denied" if record.hook == "before_tool" else "result kept"
    return f"{hook} failed ({record.reason}): {kept}"


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


def in_doubt_words(output: CallInDoubt) -> str:
    """A call in doubt in plain words (R-EFFECT-2)."""
    return (
        f"{output.tool} (call {output.call_id}) is in doubt: its host was lost before its "
        "result was recorded"
    )


_RESOLVED_WORDS = {
    ("check", "done"): "its check found it done",
    ("check", "rerun"): "its check found it not done: it runs again",
    ("person", "done"): "{who} says it took effect",
    ("person", "not_done"): "{who} says it did not take effect: not run again",
    ("person", "rerun"): "{who} has it run again",
}


def resolved_words(output: CallResolved) -> str:
    """How a call in doubt was resolved, in plain words (R-EFFECT-2)."""
    who = output.principal or "a person"
    words = _RESOLVED_WORDS.get(
        (output.by, output.outcome), "nothing could tell whether it took effect: not run again"
    ).format(who=who)
    line = f"{output.tool} (call {output.call_id}): {words}"
    if output.check_error:
        line += f" (its check gave no answer: {output.check_error})"
    return line


ELLIPSIS = "…"


def clip_words(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters: whole when it fits, else cut at the last
    word boundary that leaves room for an ellipsis (mid-word only when the first word alone
    is too long) and ended with ``…``, so a reader sees that something was left out."""
    if len(text) <= limit:
        return text
    if limit <= 1:
        return ELLIPSIS[:limit]
    room = text[: limit - 1]
    cut = room.rstrip()
    if not room[-1].isspace() and not text[limit - 1].isspace():  # a word is cut
        space = cut.rfind(" ")
        if space >= limit // 2:
            cut = cut[:space].rstrip()
    return cut.rstrip(" ,;:.-\u2013\u2014") + ELLIPSIS


def special_file_words(mode: int) -> str:
    """What a file of ``mode`` is when it is neither a regular file nor a directory, said
    to a person refusing it (R-SEC-1: a FIFO would be waited on for ever, a device read for
    ever): ``it is a FIFO (a named pipe), not a regular file`` and the like."""
    if stat.S_ISFIFO(mode):
        return "it is a FIFO (a named pipe), not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "it is a device, not a regular file"
    return "it is not a regular file"
