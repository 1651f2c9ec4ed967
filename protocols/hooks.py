"""Hooks: host code called at fixed checkpoints of the turn loop (R-HOOK-1, R-HOOK-2).

The loop's checkpoints (R-HOOK-1):

* ``before_request(info)`` — before each model request (every attempt);
* ``after_tool_results(info)`` — when every tool call of a turn is terminal;
* ``on_stop(info)`` — when the task would end because the model answered without tool calls.
  Returning a non-empty text asks for one more turn: the text is delivered as steering
  input (traced as ``user_msg`` of kind ``steering``; where a record of the trace has a
  limit, a cluster's, cut to fit it with a marker saying so). At most
  ``max_stop_continuations`` times per task.

These see frozen values only: they can observe and ask to continue, never widen the tools,
the approval rules or the settings. A hook may be sync or async; one of these that raises
is ignored — a hook never ends a task.

The tool hooks, which decide (R-HOOK-2):

* ``before_tool(call)`` — each complete tool call, before it is decided: ``None`` lets it go
  on as it is, :class:`Deny` ends it (``approval_decision`` ``deny`` by ``hook``, a
  ``denied`` result carrying the reason), :class:`Rewrite` replaces its arguments — and the
  rewritten call is the one approved (a person, the ``approve`` callback and a session rule
  see it) and run: a hook never widens permissions.
* ``after_tool(call, result)`` — each call the pool ran (``call`` as it ran), before the
  model sees the result: ``None`` keeps it, :class:`Replace` gives the model other content
  (its status stays).

What a tool hook did is a ``tool_hook`` record of the trace. A tool hook that raises, answers
something else or takes longer than ``tool_hook_timeout_s`` is a hook error, recorded with
what went wrong: ``before_tool`` then denies the call (the safe side: a policy that cannot
answer does not let calls through), ``after_tool`` keeps the result. A sync hook runs on the
event loop: keep it quick, or make it async. Subagents take their parent's tool hooks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from greenroom.protocols.content import ModelBlock, TextBlock, ToolCallBlock, ToolContent
from greenroom.protocols.context import ModelRequest, ToolResult
from greenroom.protocols.outputs import ToolHookActionKind, ToolHookName


@attrs.frozen(kw_only=True, slots=True)
class RequestInfo:
    """What ``before_request`` is given: the request of attempt ``attempt`` of turn ``turn``,
    before it is sent."""

    session_id: str
    run_id: str
    turn: int
    attempt: int
    request: ModelRequest


@attrs.frozen(kw_only=True, slots=True)
class ToolResultsInfo:
    """What ``after_tool_results`` is given: the results of every tool call of turn ``turn``,
    before the next request carries them to the model."""

    session_id: str
    run_id: str
    turn: int
    results: tuple[ToolResult, ...]


@attrs.frozen(kw_only=True, slots=True)
class StopInfo:
    """What ``on_stop`` is given when a turn ends without tool calls: ``final_message`` is the
    model's last message, ``continuations`` how many times ``on_stop`` already continued this
    task (a non-empty string returned continues it, up to ``max_stop_continuations``)."""

    session_id: str
    run_id: str
    turn: int
    final_message: tuple[ModelBlock, ...]
    continuations: int


HookResult = Any | Awaitable[Any]


@attrs.frozen
class Deny:
    """``before_tool``'s answer: the call does not run; the model is told it was denied,
    and why (``reason``)."""

    reason: str


@attrs.frozen
class Rewrite:
    """``before_tool``'s answer: the call goes on with these ``arguments`` instead (a JSON
    object), approved and run as rewritten. The model's own message keeps what it wrote."""

    arguments: dict[str, Any]


@attrs.frozen
class Replace:
    """``after_tool``'s answer: the model gets ``content`` (a text, or text and image
    blocks) instead of the tool's result. The trace records that it was replaced, not
    what was replaced (a hook that redacts keeps the redacted part out of the trace)."""

    content: str | tuple[ToolContent, ...]

    def blocks(self) -> tuple[ToolContent, ...]:
        """The content as blocks."""
        return (TextBlock(text=self.content),) if isinstance(self.content, str) else self.content


BeforeTool = Callable[[ToolCallBlock], HookResult]
"""``before_tool(call)`` → None, :class:`Deny` or :class:`Rewrite` (sync or async)."""

AfterTool = Callable[[ToolCallBlock, ToolResult], HookResult]
"""``after_tool(call, result)`` → None or :class:`Replace` (sync or async)."""



@attrs.frozen(kw_only=True, slots=True)
class ToolHookAction:
    """What a tool hook did to one call (the ``tool_hook`` record, without its envelope):
    ``deny`` (``reason`` the hook's), ``rewrite`` (``arguments`` the call goes on with),
    ``replace`` (the result the model gets is the hook's), or ``error`` (the hook raised,
    answered nonsense or timed out: ``reason`` says so; ``before_tool`` then denied)."""

    hook: ToolHookName
    action: ToolHookActionKind
    arguments: dict[str, Any] | None = None
    reason: str | None = None


def hook_denied_text(action: ToolHookAction) -> str:
    """The result the model gets for a call a ``before_tool`` hook denied (or failed on)."""
    if action.action == "error":
        return f"Tool call denied: the before_tool hook failed ({action.reason})."
    return f"Tool call denied by a hook: {action.reason}"


@attrs.frozen(kw_only=True)
class Hooks:
    """The hooks of a session; every field is optional. ``tool_hook_timeout_s`` bounds each
    ``before_tool`` and ``after_tool`` call (None: no bound — command hooks bound each
    command themselves)."""

    before_request: Callable[[RequestInfo], HookResult] | None = None
    after_tool_results: Callable[[ToolResultsInfo], HookResult] | None = None
    on_stop: Callable[[StopInfo], HookResult] | None = None
    max_stop_continuations: int = 1
    before_tool: BeforeTool | None = None
    after_tool: AfterTool | None = None
    tool_hook_timeout_s: float | None = 30.0

    @property
    def tool_hooks(self) -> Hooks:
        """Only the tool hooks of these: what a subagent takes from its parent."""
        return Hooks(
            before_tool=self.before_tool,
            after_tool=self.after_tool,
            tool_hook_timeout_s=self.tool_hook_timeout_s,
        )
