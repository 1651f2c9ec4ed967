"""Hooks: host code called at fixed checkpoints of the turn loop (R-HOOK-1).

* ``before_request(info)`` — before each model request (every attempt);
* ``after_tool_results(info)`` — when every tool call of a turn is terminal;
* ``on_stop(info)`` — when the task would end because the model answered without tool calls.
  Returning a non-empty text asks for one more turn: the text is delivered as steering
  input (traced as ``user_msg`` of kind ``steering``). At most ``max_stop_continuations``
  times per task.

Hooks see frozen values only: they can observe and ask to continue, never widen the tools,
the approval rules or the settings. A hook may be sync or async; a hook that raises is
ignored — a hook never ends a task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from greenroom.protocols.content import ModelBlock
from greenroom.protocols.context import ModelRequest, ToolResult


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


@attrs.frozen(kw_only=True)
class Hooks:
    """The hooks of a session; every field is optional."""

    before_request: Callable[[RequestInfo], HookResult] | None = None
    after_tool_results: Callable[[ToolResultsInfo], HookResult] | None = None
    on_stop: Callable[[StopInfo], HookResult] | None = None
    max_stop_continuations: int = 1
