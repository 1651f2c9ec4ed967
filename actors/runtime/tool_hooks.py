"""Calling a session's tool hooks (R-HOOK-2) for one task's broker and pool.

:class:`ToolHookCalls` turns what a ``before_tool`` or ``after_tool`` hook did into the
call to decide, the result to give and the :class:`~greenroom.protocols.hooks.ToolHookAction`
to record. It never raises into its caller: a hook that raises, answers anything but what
it may answer, or runs past ``Hooks.tool_hook_timeout_s`` is a hook error, and the error's
words say which (:class:`ToolHookError` carries a hook's own words — a command hook's exit
status and stderr). On such an error ``before_tool`` denies the call: a policy hook that
cannot answer must not let calls through. ``after_tool`` keeps the result: the tool has
run, and its result is the truth of what happened.

The approval broker calls :meth:`ToolHookCalls.before` for each call before anyone decides
it, and the tool pool :meth:`ToolHookCalls.after` for each result before it is reported;
both run in the task's cancel scope, so an interrupt ends a hook with the task.

A reason (a ``Deny``'s, or what went wrong) is recorded in the ``tool_hook`` record, and a
denial's in the call's result too: one longer than :data:`MAX_REASON_CHARS` is cut, with a
note of how much was left out, so that neither record can grow past what one record of a
cluster's trace carries (R-SEC-9).
A rewrite's arguments are recorded too (the ``tool_hook`` record, a person's
``approval_request``): arguments larger than one record of the session's trace carries
(``largest_record``: a cluster's NATS server) cannot be cut without changing the call, so
such a rewrite is a hook error, as one that is no JSON object is, or nests deeper than
any call's arguments may (R-SEC-6: its record could not be encoded): the call is denied,
its result saying why, and the session goes on (a record too large would stop it on its
host).

:func:`tool_hook_record` gives the ``tool_hook`` record of what a hook did. A call asked
anew after its host stopped (a take-up) is decided afresh, and the latest decision is the
one that runs — then and at any later take-up, which reads it from the trace: when the
``before_tool`` hook lets such a call be while the trace holds an earlier rewrite of it, a
rewrite to the arguments it goes on with (the model's) is recorded.

While a hook runs, :func:`hook_site` says whose call it decides — the session and its
workspace — without widening the hooks' signatures: command hooks run in that workspace
and give both to their command.
"""

from __future__ import annotations

import contextvars
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from greenroom.actors.runtime.user_code import call_user_code
from greenroom.protocols.content import ImageBlock, TextBlock, ToolCallBlock, ToolContent
from greenroom.protocols.context import ToolResult
from greenroom.protocols.hooks import (
    Deny,
    Hooks,
    Replace,
    Rewrite,
    ToolHookAction,
)
from greenroom.protocols.outputs import ToolHook, ToolHookName, ToolStatus
from greenroom.protocols.text import repair_json, repair_text
from greenroom.protocols.tools import MAX_ARGUMENT_DEPTH, value_too_deep
from greenroom.protocols.trace import record_size

__all__ = [
    "MAX_REASON_CHARS",
    "HookSite",
    "ToolHookCalls",
    "ToolHookError",
    "cut_reason",
    "hook_site",
    "tool_hook_calls",
    "tool_hook_record",
]

MAX_REASON_CHARS = 2000
"""The longest reason of a hook's action kept whole (:func:`cut_reason` cuts a longer one)."""


@attrs.frozen
class HookSite:
    """Whose call a tool hook decides: the session's id and its workspace (R-SEC-7)."""

    session_id: str
    workspace: Path


_SITE: contextvars.ContextVar[HookSite | None] = contextvars.ContextVar(
    "greenroom_hook_site", default=None
)


def hook_site() -> HookSite | None:
    """The session whose call the running tool hook decides; None outside a hook."""
    return _SITE.get()


class ToolHookError(Exception):
    """A tool hook could not answer; its message says why, in words a person reads in the
    trace (``exited 1: <stderr>``). Raised by a hook (a command hook does); any other
    exception of a hook is reported with its type and message."""


class ToolHookCalls:
    """The ``before_tool`` and ``after_tool`` hooks of one task (see the module docstring)."""

    __slots__ = ("_after", "_before", "_largest_record", "_site", "_timeout_s")

    def __init__(
        self, hooks: Hooks, site: HookSite | None = None, largest_record: int | None = None
    ) -> None:
        self._site = site
        self._largest_record = largest_record
        self._before = hooks.before_tool
        self._after = hooks.after_tool
        self._timeout_s = math.inf if hooks.tool_hook_timeout_s is None else (
            hooks.tool_hook_timeout_s
        )

    @property
    def has_before(self) -> bool:
        """Whether a ``before_tool`` hook sees each call before it is decided."""
        return self._before is not None

    async def before(
        self, call: ToolCallBlock
    ) -> tuple[ToolCallBlock | None, ToolHookAction | None]:
        """The call to decide — ``call`` itself, or rewritten — or None when it is denied;
        and what the hook did (None: nothing). Never raises but Cancelled."""
        if self._before is None:
            return call, None
        answer, error = await self._call("before_tool", self._before, call)
        if error is None:
            if answer is None:
                return call, None
            if isinstance(answer, Deny) and isinstance(answer.reason, str):
                return None, _action("before_tool", "deny", reason=answer.reason)
            if isinstance(answer, Rewrite):
                arguments = _json_object(answer.arguments)
                error = arguments if isinstance(arguments, str) else self._refused(arguments)
                if error is None and isinstance(arguments, dict):
                    return attrs.evolve(call, arguments=arguments, invalid_arguments=None), (
                        _action("before_tool", "rewrite", arguments=arguments)
                    )
            else:
                error = (
                    f"answered {_what(answer)}; expected None, Deny(reason) or "
                    "Rewrite(arguments)"
                )
        return None, _action("before_tool", "error", reason=error)

    def _refused(self, arguments: dict[str, Any]) -> str | None:
        """Why a rewrite to ``arguments`` is refused; None when it is not."""
        most = self._largest_record
        if most is None:
            return None
        size = record_size(arguments)
        if size <= most:
            return None
        return (
            f"the rewritten arguments take {size} bytes as JSON, more than the {most} bytes "
            "one record of this session's trace carries"
        )

    async def after(
        self, call: ToolCallBlock, status: ToolStatus, content: tuple[ToolContent, ...]
    ) -> tuple[tuple[ToolContent, ...], ToolHookAction | None]:
        """The content the model gets for ``call``'s result — the tool's, or the hook's
        replacement — and what the hook did. Never raises but Cancelled."""
        if self._after is None:
            return content, None
        result = ToolResult(
            call_id=call.id, tool=call.name, status=status, is_error=status != "ok",
            content=content,
        )
        answer, error = await self._call("after_tool", self._after, call, result)
        if error is None:
            if answer is None:
                return content, None
            if isinstance(answer, Replace) and _is_content(answer.content):
                return answer.blocks(), _action("after_tool", "replace")
            error = f"answered {_what(answer)}; expected None or Replace(content)"
        return content, _action("after_tool", "error", reason=error)

    async def _call(self, name: ToolHookName, hook: Any, *args: Any) -> tuple[Any, str | None]:
        """The hook's answer, or None and why it has none."""
        site = _SITE.set(self._site)
        try:
            with trio.move_on_after(self._timeout_s):
                answer, failure = await call_user_code(hook, *args)
                if failure is not None:
                    return None, _hook_error(name, failure)
                return answer, None
            return None, f"no answer within {self._timeout_s:g} s"
        finally:
            _SITE.reset(site)


def _hook_error(name: ToolHookName, exc: BaseException) -> str:
    """What a hook's failure is recorded as: a ``ToolHookError``'s own words, else the
    exception's class and message."""
    if isinstance(exc, ToolHookError):
        return str(exc) or f"the {name} hook failed"
    return f"the hook raised {type(exc).__name__}: {exc}"


def tool_hook_calls(
    hooks: Hooks, session_id: str, workspace: Path, largest_record: int | None = None
) -> ToolHookCalls | None:
    """The tool hook calls of a task of session ``session_id`` (working in ``workspace``)
    with ``hooks``, whose trace takes records of at most ``largest_record`` bytes of input
    (None: no limit); None without any hooks."""
    if hooks.before_tool is None and hooks.after_tool is None:
        return None
    return ToolHookCalls(hooks, HookSite(session_id, workspace), largest_record)


def tool_hook_record(
    action: ToolHookAction | None,
    call: ToolCallBlock | None,
    *,
    session_id: str,
    run_id: str,
    call_id: str,
    calls: Iterable[ToolCallBlock],
    rewrites: Mapping[str, dict[str, Any]] | None,
) -> ToolHook | None:
    """The ``tool_hook`` record of what a tool hook did to ``call_id`` (``action``; None:
    it let the call or its result be), or None when there is nothing to record. ``call``
    is the call as a ``before_tool`` decision leaves it, ``calls`` the attempt's (they
    name its tool), ``rewrites`` the arguments the task's record holds rewrites to
    (:attr:`~greenroom.protocols.task.TaskRecord.rewrites`). A call decided afresh that
    the hook lets be, after an earlier rewrite the record holds, is recorded rewritten to
    its own arguments: the latest decision is the one a later take-up runs (R-HOOK-2)."""
    earlier = (rewrites or {}).get(call.id) if call is not None else None
    if action is None and call is not None and earlier not in (None, call.arguments):
        action = _action("before_tool", "rewrite", arguments=call.arguments)
    if action is None:
        return None
    return ToolHook(
        session_id=session_id,
        run_id=run_id,
        call_id=call_id,
        tool=next((c.name for c in calls if c.id == call_id), ""),
        hook=action.hook,
        action=action.action,
        arguments=action.arguments,
        reason=action.reason,
    )


def _action(
    hook: ToolHookName,
    action: Any,
    *,
    arguments: dict[str, Any] | None = None,
    reason: str | None = None,
) -> ToolHookAction:
    if reason is not None:
        # Outside text (R-SEC-1): a lone surrogate would make the record unwritable and end
        # the task, and a hook never does that.
        reason = cut_reason(repair_text(reason))
    return ToolHookAction(hook=hook, action=action, arguments=arguments, reason=reason)


def cut_reason(reason: str) -> str:
    """``reason`` — words that say why (a hook's, a failed check's) and are recorded —
    whole up to :data:`MAX_REASON_CHARS`, else its start and a note of how much was left
    out, so that its records stay within what one record of a cluster's trace carries."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    left_out = len(reason) - MAX_REASON_CHARS
    return f"{reason[:MAX_REASON_CHARS]}… [cut: {left_out} of {len(reason)} characters left out]"


def _json_object(value: Any) -> dict[str, Any] | str:
    """``value`` as a JSON object (a copy that holds JSON values only, its text repaired:
    R-SEC-1), or why it is none."""
    not_json = "Rewrite(arguments) must hold a JSON object"
    if not isinstance(value, dict):
        return not_json
    if value_too_deep(value):
        # Measured before any recursive walk: deeper, the copy below or the tool_hook
        # record's encoding would fail, and end the task (R-SEC-6).
        return f"Rewrite(arguments) nests deeper than {MAX_ARGUMENT_DEPTH} levels"
    try:
        copied = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return not_json
    # A lone surrogate (a command hook printing "\ud800") would make the tool_hook record
    # unwritable and end the task: repaired here, where the hook's text enters.
    return repair_json(copied) if isinstance(copied, dict) else not_json


def _is_content(value: Any) -> bool:
    if isinstance(value, str):
        return True
    return isinstance(value, tuple) and all(isinstance(b, TextBlock | ImageBlock) for b in value)


def _what(answer: Any) -> str:
    text = repr(answer)
    return text if len(text) <= 80 else text[:77] + "..."
