"""The turn state machine: one turn's blocks, tool calls, attempts and settlement, pure.

The supervisor feeds it what happened (stream events, approval decisions, tool results, an
interrupt) and carries out what it returns: outputs to emit and commands for the other
actors. It does no I/O and keeps no clock, so every path can be tested with plain calls.

Rules, each upheld on every path:

1. A turn has attempts 1, 2, …; only the current attempt's events count. Blocks complete in
   stream order, each as one ``model_msg`` (R-RUN-2); deltas give live ``partial_*`` outputs.
2. Every complete tool call gets exactly one ``approval_decision`` and exactly one
   ``tool_call_output`` (R-APPROVE-1, R-TOOL-7) — allowed and run, denied
   (``Tool call denied by user.``), truncated by the token limit (never run, no decision:
   R-TOOL-5), or settled by an interrupt (``[interrupted: tool aborted by user]``, with a
   ``deny`` by ``default`` for a call still waiting for its decision: R-APPROVE-5).
3. Calls are sent for approval one at a time, in call order (R-TOOL-1): the next
   :class:`ApproveCall` is returned with the decision on the previous one.
   A call runs only after an ``allow``: the machine returns :class:`RunToolCall` exactly
   once per allowed call, and never after the interrupt was requested.
4. :meth:`TurnMachine.results` lists the results in the original call order, whatever order
   the calls finished in (R-RUN-4).
5. A failed attempt's output becomes the retry note's blocks (R-RETRY-4); the calls that ran
   in it are not run again, and events about them that arrive late are ignored.
6. :meth:`TurnMachine.abort` settles every call in any state (R-ABORT-1..2): nothing is left
   unpaired.
7. An event a call's state does not allow raises :class:`IllegalTransition` — the one
   exception is the late report named in rule 5 and a tool result that arrives after its
   call was settled by an interrupt (a tool may finish while it is being abandoned), which
   are stale and dropped, as the transition table says.

Call states and their transitions are the table :data:`CALL_TRANSITIONS`.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from greenroom.protocols import markers
from greenroom.protocols.content import (
    ModelBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    ToolContent,
)
from greenroom.protocols.context import ToolResult
from greenroom.protocols.messages import ApproveCall, RunToolCall, SkipToolCall
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    DecidedBy,
    ModelMsg,
    Output,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    RequestStatus,
    TokenUsageOutput,
    ToolCallOutput,
    ToolProgress,
    ToolStatus,
    partial_text,
)
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    MessageCompleted,
    ModelError,
    StreamEvent,
    StreamFailed,
    TextDelta,
    ThinkingDelta,
    TokenUsage,
    ToolArgumentsDelta,
    ToolCallTruncated,
    UsageReported,
)
from greenroom.protocols.trace import fit_model_block, fit_partial, record_size

__all__ = [
    "CALL_TRANSITIONS",
    "TRUNCATED_TEXT",
    "CallEvent",
    "CallState",
    "Effect",
    "IllegalTransition",
    "RecordUsage",
    "SkipToolCall",
    "TurnMachine",
    "resume_turn",
]

TRUNCATED_TEXT = (
    "Tool call was truncated by the output token limit and was not executed. "
    "Send it again with shorter arguments, or split the work."
)
"""The result of a tool call cut off by the output-token limit (R-TOOL-5)."""


class CallState(enum.Enum):
    """Where one complete tool call stands."""

    APPROVING = "approving"
    """Sent to the approval broker; no decision yet."""
    RUNNING = "running"
    """Allowed; its result has not come back."""
    DONE = "done"
    """Its one result has been emitted."""


class CallEvent(enum.Enum):
    """What can happen to a call."""

    ALLOWED = "allowed"
    DENIED = "denied"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


_STALE = None

CALL_TRANSITIONS: dict[tuple[CallState, CallEvent], CallState | None] = {
    (CallState.APPROVING, CallEvent.ALLOWED): CallState.RUNNING,
    (CallState.APPROVING, CallEvent.DENIED): CallState.DONE,
    (CallState.APPROVING, CallEvent.INTERRUPTED): CallState.DONE,
    (CallState.RUNNING, CallEvent.FINISHED): CallState.DONE,
    (CallState.RUNNING, CallEvent.INTERRUPTED): CallState.DONE,
    # A tool that ends after the interrupt settled it (it was being abandoned): stale.
    (CallState.DONE, CallEvent.FINISHED): _STALE,
}
"""``(state, event) → next state``; ``None`` marks a stale event that is dropped. Every
pair not in the table is illegal."""


class IllegalTransition(Exception):
    """An event that the call's state does not allow (a bug in the caller, never input)."""


@attrs.frozen(kw_only=True, slots=True)
class RecordUsage:
    """Command: add this request's usage to the task's total and the usage ledger.
    ``started``: the stream's first report of it (what the request is billed from its
    start, its input): for the ledger only, so that a host that dies mid-stream still
    counts the request (R-SHARE-3); its last report follows as the request's usage."""

    usage: TokenUsage
    started: bool = False


Command = ApproveCall | RunToolCall | SkipToolCall | RecordUsage
Effect = Output | Command
"""What the machine returns: outputs to emit (traced ones have ``TRACED`` true) and
commands, in the order they must be carried out."""


@attrs.define(slots=True)
class _Call:
    block: ToolCallBlock
    position: int
    state: CallState


class TurnMachine:
    """The state of one turn. Create one per turn; see the module docstring for the rules.

    Every method returns the effects of the event it was given, in order. ``feed`` is the
    per-network-read hot path: it appends to one list and creates one output per delta.
    """

    __slots__ = (
        "_asking",
        "_attempt",
        "_calls",
        "_discarded",
        "_done_blocks",
        "_largest_record",
        "_last_usage",
        "_open",
        "_order",
        "_results",
        "_retried_blocks",
        "_stream_result",
        "_to_ask",
        "_unfit",
        "run_id",
        "session_id",
        "turn",
    )

    def __init__(self, *, session_id: str, run_id: str, turn: int, attempt: int = 0,
                 largest_record: int | None = None) -> None:
        """``largest_record``: the most bytes a trace record holds (None: any, a file)."""
        self.session_id = session_id
        self._largest_record = largest_record
        self.run_id = run_id
        self.turn = turn
        self._attempt = attempt  # the last one: begin_attempt(attempt + 1) starts next
        self._open: dict[int, tuple[BlockStarted, list[str]]] = {}
        self._done_blocks: list[ModelBlock] = []
        self._retried_blocks: list[ModelBlock] = []
        self._stream_result: MessageCompleted | StreamFailed | None = None
        self._unfit: StreamFailed | None = None  # a block no record holds ended the attempt
        self._last_usage: TokenUsage | None = None
        self._calls: dict[str, _Call] = {}
        self._order: list[str] = []
        self._results: dict[str, ToolResult] = {}
        self._discarded: set[str] = set()
        self._asking: str | None = None
        self._to_ask: list[ToolCallBlock] = []

    # -- what the supervisor reads ------------------------------------------------------

    @property
    def attempt(self) -> int:
        """The current attempt (1-based; 0 before the first)."""
        return self._attempt

    @property
    def stream_result(self) -> MessageCompleted | StreamFailed | None:
        """The current attempt's terminal stream event, once it came."""
        return self._stream_result

    @property
    def asking(self) -> str | None:
        """The call being asked about (approvals go one at a time), if any."""
        return self._asking

    @property
    def has_calls(self) -> bool:
        """Whether the turn (its current attempt) produced tool calls."""
        return bool(self._order)

    @property
    def all_calls_terminal(self) -> bool:
        """Whether every call of the current attempt has its result."""
        return all(call.state is CallState.DONE for call in self._calls.values())

    @property
    def done_blocks(self) -> tuple[ModelBlock, ...]:
        """The current attempt's completed blocks, in stream order."""
        return tuple(self._done_blocks)

    def call_state(self, call_id: str) -> CallState | None:
        """The state of a call of the current attempt (None for an unknown id)."""
        call = self._calls.get(call_id)
        return call.state if call is not None else None

    def calls(self) -> tuple[ToolCallBlock, ...]:
        """The current attempt's tool calls in call order."""
        return tuple(self._calls[call_id].block for call_id in self._order)

    def results(self) -> tuple[ToolResult, ...]:
        """The results in the original call order (R-RUN-4); all once every call has one."""
        return tuple(self._results[c] for c in self._order if c in self._results)

    def partial_blocks(self) -> list[ModelBlock]:
        """The attempt's output so far: completed blocks, open text, open calls (never run)."""
        return [*self._done_blocks, *(() if self._unfit else _open_blocks(self._open))]

    # -- events ---------------------------------------------------------------------------

    def begin_attempt(self, attempt: int) -> list[Effect]:
        """A new attempt starts: ``request_begin``. Attempts count up by one; attempt 1 may
        start again only after :meth:`restart` (a rerun after an overflow compaction)."""
        if attempt != self._attempt + 1:
            raise IllegalTransition(f"attempt {attempt} after attempt {self._attempt}")
        if self._stream_result is None and self._attempt:
            raise IllegalTransition("a new attempt while the current one is streaming")
        if not self.all_calls_terminal:
            raise IllegalTransition("a new attempt while tool calls are unsettled")
        self._attempt = attempt
        self._open = {}
        self._done_blocks = []
        self._stream_result = self._unfit = None
        self._last_usage = None
        self._asking = None
        self._to_ask = []
        return [
            RequestBegin(
                session_id=self.session_id, run_id=self.run_id, turn=self.turn, attempt=attempt
            )
        ]

    def feed(self, events: Sequence[StreamEvent]) -> list[Effect]:
        """Stream events of the current attempt (one network read's worth)."""
        out: list[Effect] = []
        if self._stream_result is not None:
            return out  # nothing after the terminal event counts
        if unfit := self._unfit:
            return _drain(self, unfit, events)
        sid = self.session_id
        rid = self.run_id
        open_blocks = self._open
        for event in events:
            kind = type(event)
            if kind is TextDelta:
                assert isinstance(event, TextDelta)
                open_blocks[event.index][1].append(event.text)
                out.append(partial_text(sid, rid, event.index, event.text))
            elif kind is ToolArgumentsDelta:
                assert isinstance(event, ToolArgumentsDelta)
                open_blocks[event.index][1].append(event.delta)
                out.append(
                    PartialToolCall(
                        session_id=sid,
                        run_id=rid,
                        index=event.index,
                        call_id=event.call_id,
                        name=event.name,
                        arguments_delta=event.delta,
                    )
                )
            elif kind is ThinkingDelta:
                assert isinstance(event, ThinkingDelta)
                open_blocks[event.index][1].append(event.text)
                out.append(PartialThinking(session_id=sid, run_id=rid, index=event.index,
                                           text=event.text))
            elif kind is BlockStarted:
                assert isinstance(event, BlockStarted)
                open_blocks[event.index] = (event, [])
            elif kind is BlockCompleted:
                assert isinstance(event, BlockCompleted)
                self._complete_block(event.index, event.block, out)
            elif kind is ToolCallTruncated:
                assert isinstance(event, ToolCallTruncated)
                _truncated_call(self, event, out)
            elif kind is UsageReported:
                assert isinstance(event, UsageReported)
                if self._last_usage is None:
                    out.append(RecordUsage(usage=event.usage, started=True))
                self._last_usage = event.usage
            elif kind is MessageCompleted:
                assert isinstance(event, MessageCompleted)
                self._last_usage = event.usage
                self._close_open_blocks(out)  # e.g. text cut by max_tokens
                self._usage(out)
                if (unfit := self._unfit) is not None:
                    self._stream_result = unfit  # a block could not be recorded
                    return out
                self._stream_result = event
                out.append(_request_end(self, "ok", stop_reason=event.stop_reason,  # R-RUN-3
                                        response_id=event.response_id,
                                        response_model=event.response_model))
                return out
            elif kind is StreamFailed:
                assert isinstance(event, StreamFailed)
                # What the model wrote before the failure is a fact of the attempt: it is
                # traced, and becomes the retry note's blocks (R-RETRY-4). An open block no
                # record holds is left out, and the stream's own failure stands (retried).
                failed = self._unfit
                self._close_open_blocks(out)
                self._usage(out)
                self._stream_result = failed or event
                return out
        return out

    def fail_attempt(self, error: ModelError, *, retry_in_ms: int | None) -> list[Effect]:
        """The attempt's stream failed with ``error``: its ``request_end`` (with the planned
        wait when it will be retried, R-RETRY-3)."""
        if not isinstance(self._stream_result, StreamFailed):
            raise IllegalTransition("fail_attempt without a failed stream")
        return [
            _request_end(
                self,
                _request_status(error),
                error_message=error.message,
                retry_in_ms=retry_in_ms,
                http_status=error.status_code,
            )
        ]

    def discard_attempt(self) -> None:
        """After a failed attempt whose calls are all terminal: its output becomes the retry
        note's blocks (an attempt that produced nothing keeps the previous ones) and its
        calls become history — late reports about them are dropped (rule 5)."""
        if not self.all_calls_terminal:
            raise IllegalTransition("discard_attempt with unsettled calls")
        blocks = self.partial_blocks()
        if blocks:
            self._retried_blocks = blocks
        self._discarded.update(self._calls)
        self._calls = {}
        self._order = []
        self._asking = None
        self._to_ask = []

    def restart(self) -> None:
        """The turn runs again from attempt 1 (after an overflow compaction): the retry note
        is dropped with the old context."""
        self.discard_attempt()
        self._retried_blocks = []
        self._attempt = 0
        self._stream_result = None

    def decide(
        self,
        call_id: str,
        *,
        allowed: bool,
        by: DecidedBy,
        interrupted: bool = False,
        remember: bool = False,
        principal: str | None = None,
        answer: str | None = None,
        denied_text: str = markers.DENIED_TEXT,
    ) -> list[Effect]:
        """The decision on the call being asked about. ``interrupted`` says the interrupt
        was already requested: an allowed call then never starts, and :meth:`abort`
        reports it interrupted; a deny then sends the pool nothing (it may be gone already).
        ``remember``: it was ``allow_session`` (R-APPROVE-4). ``answer``: a person answered
        the call's question (R-HITL-5): that text is its result and no tool runs. A deny's
        result is ``denied_text`` (a hook's says why). The next call waiting is asked at
        once (rule 3)."""
        call = self._known(call_id)
        if call is None:
            return []
        out: list[Effect] = []
        self._move(call, CallEvent.ALLOWED if allowed else CallEvent.DENIED)
        out.append(
            ApprovalDecision(
                session_id=self.session_id,
                run_id=self.run_id,
                call_id=call.block.id,
                tool=call.block.name,
                decision="allow" if allowed else "deny",
                by=by,
                remember=remember and allowed,
                principal=principal,
            )
        )
        if not allowed:
            if not interrupted:
                out.append(SkipToolCall(position=call.position))
            out.append(self._result(call, "denied", denied_text))  # R-APPROVE-3
        elif answer is not None:
            self._move(call, CallEvent.FINISHED)
            out.append(SkipToolCall(position=call.position))
            out.append(self._result(call, "ok", answer))
        elif not interrupted:
            out.append(RunToolCall(call=call.block, position=call.position))
        if self._asking == call_id:
            self._asking = None
            self._ask_next(out)
        return out

    def _ask_next(self, out: list[Effect]) -> None:
        while self._asking is None and self._to_ask:
            block = self._to_ask.pop(0)
            if self._calls[block.id].state is CallState.APPROVING:
                self._asking = block.id
                out.append(ApproveCall(call=block))

    def finish(
        self, call_id: str, *, status: ToolStatus, content: tuple[ToolContent, ...]
    ) -> list[Effect]:
        """A tool call's result came back from the pool."""
        call = self._known(call_id)
        if call is None:
            return []
        if self._move(call, CallEvent.FINISHED) is None:
            return []
        return [self._result(call, status, content)]

    def progress(self, call_id: str, message: str) -> list[Effect]:
        """A running tool's progress note: live only, dropped unless the call is running
        (R-TOOL-6)."""
        call = self._calls.get(call_id)
        if call is None or call.state is not CallState.RUNNING:
            return []
        return [
            ToolProgress(
                session_id=self.session_id,
                run_id=self.run_id,
                call_id=call.block.id,
                tool=call.block.name,
                message=message,
            )
        ]

    def settle(self) -> list[Effect]:
        """Give every unsettled call its decision and result (R-TOOL-7, R-APPROVE-5): a call
        waiting for approval is denied by default, every unfinished call is interrupted."""
        out: list[Effect] = []
        self._asking = None
        self._to_ask = []
        for call_id in self._order:
            call = self._calls[call_id]
            if call.state is CallState.APPROVING:
                out.append(
                    ApprovalDecision(
                        session_id=self.session_id,
                        run_id=self.run_id,
                        call_id=call_id,
                        tool=call.block.name,
                        decision="deny",
                        by="default",
                    )
                )
            if call.state is not CallState.DONE:
                self._move(call, CallEvent.INTERRUPTED)
                out.append(self._result(call, "interrupted", markers.INTERRUPTED_TEXT))
        return out

    def abort(self, reason: str, *, message_complete: bool) -> list[Effect]:
        """The task was interrupted: settle every call, end the attempt ``aborted`` when its
        stream was cut (``message_complete`` False: no ``request_end`` yet), and record the
        ``abort`` with the partial output (R-ABORT-2). A failed stream cut the message too:
        its output — or, during a backoff, the failed attempt's — is the turn's partial."""
        out = self.settle()
        self._usage(out)  # a cut stream's usage so far is billed: counted (R-SHARE-3, -4)
        if not message_complete:
            out.append(_request_end(self, "aborted", error_message=reason))
        # A failed attempt's message is never committed: case A would carry none of its calls.
        cut = not message_complete or isinstance(self._stream_result, StreamFailed)
        partial = tuple(self.partial_blocks() or self._retried_blocks) if cut else ()
        abort = Abort(session_id=self.session_id, run_id=self.run_id, reason=reason,
                      partial=(), message_complete=not cut)
        if partial and (most := self._largest_record) is not None:
            # Each block was made to fit a record alone; all of them in one may not.
            partial = fit_partial(partial, most, record_size(abort))
        out.append(attrs.evolve(abort, partial=partial))
        return out

    def fail(self, message: str, *, message_complete: bool) -> list[Effect]:
        """The task ends on an internal failure: settle every call and, when the model
        message was cut, end the attempt ``failed``."""
        out = self.settle()
        self._usage(out)  # as for an abort
        if not message_complete:
            out.append(_request_end(self, "failed", error_message=message))
        return out

    # -- internals ------------------------------------------------------------------------

    def _known(self, call_id: str) -> _Call | None:
        call = self._calls.get(call_id)
        if call is None:
            if call_id in self._discarded:
                return None  # rule 5: a report about a discarded attempt's call
            raise IllegalTransition(f"no tool call {call_id!r} in this turn")
        return call

    def _move(self, call: _Call, event: CallEvent) -> CallState | None:
        key = (call.state, event)
        if key not in CALL_TRANSITIONS:
            raise IllegalTransition(
                f"tool call {call.block.id!r}: {event.value} while {call.state.value}"
            )
        target = CALL_TRANSITIONS[key]
        if target is not None:
            call.state = target
        return target

    def _add_call(self, block: ToolCallBlock, state: CallState) -> _Call:
        if block.id in self._calls:
            raise IllegalTransition(f"tool call id {block.id!r} repeated in one message")
        call = _Call(block=block, position=len(self._order), state=state)
        self._calls[block.id] = call
        self._order.append(block.id)
        return call

    def _complete_block(self, index: int, block: ModelBlock, out: list[Effect]) -> None:
        self._open.pop(index, None)
        if self._recorded(block, out) and isinstance(block, ToolCallBlock):
            self._add_call(block, CallState.APPROVING)
            self._to_ask.append(block)
            self._ask_next(out)  # R-TOOL-1: at once, unless an earlier call is being asked

    def _recorded(self, block: ModelBlock, out: list[Effect]) -> bool:
        """Record the model's ``block`` (:func:`_fit`); False when no record holds it."""
        most = self._largest_record
        blocks = (block,) if most is None else _fit(block, most, self._unfit)
        if isinstance(blocks, StreamFailed):
            self._unfit = blocks  # the attempt ends with its stream; the session goes on
            return False
        self._done_blocks += blocks
        out += [ModelMsg(session_id=self.session_id, run_id=self.run_id, turn=self.turn,
                         block=piece) for piece in blocks]
        return True

    def _close_open_blocks(self, out: list[Effect]) -> None:
        """Complete the text and thinking blocks the stream left open; an unfinished tool
        call is dropped (it never completed, so it never runs: R-TOOL-5)."""
        for index in sorted(self._open):
            started, pieces = self._open[index]
            if started.kind == "text" and pieces:
                self._complete_block(index, TextBlock(text="".join(pieces)), out)
            elif started.kind == "thinking" and pieces:
                self._complete_block(index, ThinkingBlock(text="".join(pieces)), out)
        self._open = {}

    def _usage(self, out: list[Effect]) -> None:
        usage = self._last_usage
        if usage is None:
            return
        out.append(TokenUsageOutput(session_id=self.session_id, run_id=self.run_id,
                                    turn=self.turn, request=usage))
        out.append(RecordUsage(usage=usage))
        self._last_usage = None  # recorded once, at the stream's end or at its cut

    def _result(self, call: _Call, status: ToolStatus, content: Any) -> ToolCallOutput:
        output = _tool_output(self.session_id, self.run_id, call.block, status, content)
        self._results[call.block.id] = _as_result(output)
        return output


def _request_end(
    machine: TurnMachine,
    status: RequestStatus,
    *,
    stop_reason: str | None = None,
    response_id: str | None = None,
    response_model: str | None = None,
    error_message: str | None = None,
    retry_in_ms: int | None = None,
    http_status: int | None = None,
) -> RequestEnd:
    """The ``request_end`` of ``machine``'s current attempt."""
    return RequestEnd(session_id=machine.session_id, run_id=machine.run_id, turn=machine.turn,
                      status=status, attempt=machine.attempt, retry_in_ms=retry_in_ms,
                      error_message=error_message, stop_reason=stop_reason,
                      response_id=response_id, response_model=response_model,
                      http_status=http_status)


def _truncated_call(machine: TurnMachine, event: ToolCallTruncated, out: list[Effect]) -> None:
    """A tool call cut off by the output-token limit: never executed, but paired — it
    enters the context with an error result (R-TOOL-5)."""
    block = ToolCallBlock(id=event.call_id, name=event.name, arguments={},
                          invalid_arguments=event.partial_arguments)
    machine._open.pop(event.index, None)
    if not machine._recorded(block, out):
        return
    call = machine._add_call(block, CallState.DONE)
    out.append(SkipToolCall(position=call.position))
    out.append(machine._result(call, "truncated", TRUNCATED_TEXT))


def _drain(
    machine: TurnMachine, unfit: StreamFailed, events: Sequence[StreamEvent]
) -> list[Effect]:
    """Events of an attempt that a block no record holds ended (``unfit``, R-SEC-9, the
    attempt's result once its stream ends): nothing of the stream is recorded any more,
    but it is read to its end, for the usage the provider reports there is what the
    request is billed, its output in full (R-TRACE-5, R-SHARE-3). The stream is bounded
    as any is, by its output-token limit and no-progress deadline (R-SEC-10); an
    interrupt ends it at once, with the usage reported so far."""
    out: list[Effect] = []
    for event in events:
        if isinstance(event, UsageReported | MessageCompleted):
            machine._last_usage = event.usage
        if isinstance(event, MessageCompleted | StreamFailed):
            machine._usage(out)
            machine._stream_result = unfit
            break
    return out


def _fit(
    block: ModelBlock, most: int, failed: StreamFailed | None
) -> tuple[ModelBlock, ...] | StreamFailed:
    """The blocks that record ``block`` in a trace whose records hold at most ``most``
    bytes (a cluster's NATS server: text split at line breaks,
    :func:`~greenroom.protocols.trace.fit_model_block`), or the attempt's end when it
    cannot be recorded: a failure that is not retried, for the model would answer the
    same; written, the record would stop the session on its host and its next host would
    meet it again (R-SEC-9, R-CLUSTER-1). A tool call never runs unrecorded. ``failed``:
    the attempt ended so already, and the blocks still open are dropped."""
    if isinstance(failed, StreamFailed):
        return failed
    fitted = fit_model_block(block, most)
    if isinstance(fitted, str):
        return StreamFailed(error=ModelError(kind="failed", message=fitted, permanent=True))
    return fitted


def _as_result(output: ToolCallOutput) -> ToolResult:
    return ToolResult(
        call_id=output.call_id,
        tool=output.tool,
        status=output.status,
        is_error=output.is_error,
        content=output.content,
    )


def _tool_output(
    session_id: str, run_id: str, call: ToolCallBlock, status: ToolStatus, content: Any
) -> ToolCallOutput:
    blocks = (TextBlock(text=content),) if isinstance(content, str) else tuple(content)
    return ToolCallOutput(
        session_id=session_id,
        run_id=run_id,
        call_id=call.id,
        tool=call.name,
        status=status,
        is_error=status != "ok",
        content=blocks,
    )


def _open_blocks(open_blocks: dict[int, tuple[BlockStarted, list[str]]]) -> list[ModelBlock]:
    """The blocks still open, in index order: text so far, and tool calls with their
    argument text (never run)."""
    blocks: list[ModelBlock] = []
    for index in sorted(open_blocks):
        started, pieces = open_blocks[index]
        if started.kind == "text":
            blocks.append(TextBlock(text="".join(pieces)))
        elif started.kind == "tool_call":
            blocks.append(
                ToolCallBlock(
                    id=started.call_id or "",
                    name=started.name or "",
                    arguments={},
                    invalid_arguments="".join(pieces),
                )
            )
    return blocks


def _request_status(error: ModelError) -> RequestStatus:
    kind = error.kind
    if kind in ("auth", "timeout", "malformed", "failed", "context_overflow"):
        return kind
    return "failed"


def resume_turn(
    *,
    session_id: str,
    run_id: str,
    turn: int,
    attempt: int,
    calls: Sequence[ToolCallBlock],
    results: Mapping[str, ToolResult],
    allowed: Collection[str],
    stream_ended: bool,
    largest_record: int | None = None,
) -> TurnMachine:
    """A turn machine in the state a trace leaves attempt ``attempt`` of turn ``turn`` in:
    its tool calls (call order) with their recorded ``results``, the calls ``allowed``
    and still without a result (running when the trace stopped), and whether its stream
    ended (``request_end`` ok) or was cut (it then ends failed, to be retried). The state
    is reached through the machine's own events, replayed, so it is one the machine can
    be in; what the replay returned is dropped (it is in the trace already).
    ``largest_record`` is the machine's for the attempts after (the calls replayed are
    recorded already, and are not measured again)."""
    # Replayed without the limit: the calls are recorded already, whatever a record holds
    # now (a NATS server of a smaller max_payload would refuse them again).
    machine = TurnMachine(session_id=session_id, run_id=run_id, turn=turn, attempt=attempt - 1)
    if attempt > 1:
        # The attempts before it failed and were retried: over, as the trace says.
        machine.feed([StreamFailed(error=ModelError(kind="timeout", message="retried"))])
    machine.begin_attempt(attempt)
    events: list[StreamEvent] = []
    for index, call in enumerate(calls):
        result = results.get(call.id)
        if result is not None and result.status == "truncated":
            events.append(
                ToolCallTruncated(
                    index=index,
                    call_id=call.id,
                    name=call.name,
                    partial_arguments=call.invalid_arguments or "",
                )
            )
        else:
            events.append(BlockCompleted(index=index, block=call))
    if stream_ended:
        events.append(MessageCompleted(stop_reason="tool_use", usage=TokenUsage()))
    else:
        failure = ModelError(kind="timeout", message="the stream was cut")
        events.append(StreamFailed(error=failure))
    machine.feed(events)
    for call in calls:
        result = results.get(call.id)
        if result is None:
            if call.id in allowed:
                machine.decide(call.id, allowed=True, by="host", interrupted=True)
        elif result.status == "denied":
            machine.decide(call.id, allowed=False, by="default")
        elif result.status != "truncated":
            machine.decide(call.id, allowed=True, by="host", interrupted=True)
            machine.finish(call.id, status=result.status, content=result.content)
    machine._largest_record = largest_record  # for the attempts to come
    return machine
