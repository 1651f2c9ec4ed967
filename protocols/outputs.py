"""Outputs: everything the runtime emits to a host, a trace file or a websocket client.

One frozen class per ``type`` of CONTRACT.md. Every output carries ``session_id`` and
``run_id``; traced outputs carry the session's ``seq`` (strictly increasing, no gaps within
a session: R-TRACE-1); outputs forwarded from a subagent carry ``origin``, the path of
session ids from the root (R-HOST-4). Live-only outputs (``partial_*``, ``tool_progress``)
have ``seq`` None and never reach a trace.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import attrs

from greenroom.protocols.content import ModelBlock, ToolContent, UserContent
from greenroom.protocols.stream import TokenUsage

RequestStatus = Literal[
    "ok", "failed", "timeout", "malformed", "auth", "context_overflow", "aborted"
]
TaskStatus = Literal["completed", "aborted", "failed", "auth", "max_turns", "loop_detected"]
ToolStatus = Literal["ok", "error", "denied", "interrupted", "truncated"]
Decision = Literal["allow", "deny"]
DecidedBy = Literal["host", "session_rule", "default"]
CompactionReason = Literal["context", "turns", "manual", "overflow"]


@attrs.frozen(kw_only=True, slots=True)
class UserMsg:
    TYPE: ClassVar[str] = "user_msg"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    kind: Literal["prompt", "steering"]
    content: tuple[UserContent, ...]


@attrs.frozen(kw_only=True, slots=True)
class TaskStart:
    TYPE: ClassVar[str] = "task_start"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    input_seq: int | None


@attrs.frozen(kw_only=True, slots=True)
class RequestBegin:
    TYPE: ClassVar[str] = "request_begin"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    turn: int
    attempt: int


@attrs.frozen(kw_only=True, slots=True)
class PartialText:
    TYPE: ClassVar[str] = "partial_text"
    TRACED: ClassVar[bool] = False
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    index: int
    text: str


@attrs.frozen(kw_only=True, slots=True)
class PartialThinking:
    TYPE: ClassVar[str] = "partial_thinking"
    TRACED: ClassVar[bool] = False
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    index: int
    text: str


@attrs.frozen(kw_only=True, slots=True)
class PartialToolCall:
    TYPE: ClassVar[str] = "partial_tool_call"
    TRACED: ClassVar[bool] = False
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    index: int
    call_id: str
    name: str
    arguments_delta: str


@attrs.frozen(kw_only=True, slots=True)
class ModelMsg:
    TYPE: ClassVar[str] = "model_msg"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    turn: int
    block: ModelBlock


@attrs.frozen(kw_only=True, slots=True)
class TokenUsageOutput:
    TYPE: ClassVar[str] = "token_usage"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    turn: int
    request: TokenUsage


@attrs.frozen(kw_only=True, slots=True)
class RequestEnd:
    TYPE: ClassVar[str] = "request_end"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    turn: int
    status: RequestStatus
    attempt: int
    retry_in_ms: int | None = None
    error_message: str | None = None
    stop_reason: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class ApprovalRequest:
    TYPE: ClassVar[str] = "approval_request"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    call_id: str
    tool: str
    arguments: dict[str, Any]


@attrs.frozen(kw_only=True, slots=True)
class ApprovalDecision:
    TYPE: ClassVar[str] = "approval_decision"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    call_id: str
    tool: str
    decision: Decision
    by: DecidedBy


@attrs.frozen(kw_only=True, slots=True)
class ToolProgress:
    """A tool's progress note (live only; dropped once the call is terminal: R-TOOL-6)."""

    TYPE: ClassVar[str] = "tool_progress"
    TRACED: ClassVar[bool] = False
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    call_id: str
    tool: str
    message: str


@attrs.frozen(kw_only=True, slots=True)
class ToolCallOutput:
    TYPE: ClassVar[str] = "tool_call_output"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    call_id: str
    tool: str
    status: ToolStatus
    is_error: bool
    content: tuple[ToolContent, ...]


@attrs.frozen(kw_only=True, slots=True)
class Abort:
    """The task was interrupted. ``partial`` is what the model had produced in the turn in
    flight; ``message_complete`` tells which carry-over case applies (R-ABORT-2), so
    carry-over can be rebuilt from the trace after a restart (R-ABORT-3)."""

    TYPE: ClassVar[str] = "abort"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    reason: str
    partial: tuple[ModelBlock, ...] = ()
    message_complete: bool = False


@attrs.frozen(kw_only=True, slots=True)
class CompactionBegin:
    TYPE: ClassVar[str] = "compaction_begin"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    reason: CompactionReason


@attrs.frozen(kw_only=True, slots=True)
class CompactionEnd:
    TYPE: ClassVar[str] = "compaction_end"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    status: Literal["ok", "failed"]
    attempt: int
    error_message: str | None = None
    trace_file: str | None = None
    summary: str | None = None
    """The summary that starts the new context (``summarize`` mode, status ``ok``). A
    successful ``compaction_end`` is the first record of the new trace file, so the file
    alone rebuilds its context (R-COMPACT-8)."""
    kept_input: tuple[UserContent, ...] = ()
    """A new prompt that was pending when the compaction ran: not summarized, it is the
    first input of the new context."""


@attrs.frozen(kw_only=True, slots=True)
class TaskEnd:
    TYPE: ClassVar[str] = "task_end"
    TRACED: ClassVar[bool] = True
    session_id: str
    run_id: str
    seq: int | None = None
    origin: tuple[str, ...] | None = None
    status: TaskStatus
    turns: int
    usage: TokenUsage
    wall_ms: int
    message: str | None = None


Output = (
    UserMsg
    | TaskStart
    | RequestBegin
    | PartialText
    | PartialThinking
    | PartialToolCall
    | ModelMsg
    | TokenUsageOutput
    | RequestEnd
    | ApprovalRequest
    | ApprovalDecision
    | ToolProgress
    | ToolCallOutput
    | Abort
    | CompactionBegin
    | CompactionEnd
    | TaskEnd
)

OUTPUT_CLASSES: tuple[type[Output], ...] = (
    UserMsg,
    TaskStart,
    RequestBegin,
    PartialText,
    PartialThinking,
    PartialToolCall,
    ModelMsg,
    TokenUsageOutput,
    RequestEnd,
    ApprovalRequest,
    ApprovalDecision,
    ToolProgress,
    ToolCallOutput,
    Abort,
    CompactionBegin,
    CompactionEnd,
    TaskEnd,
)
