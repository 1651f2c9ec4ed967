"""The model context as a pure function of the traced outputs.

:class:`Transcript` consumes traced outputs one by one and maintains the model context
they imply. The supervisor feeds it every traced output as it emits it, and loading a
session feeds it the trace file: both paths build the context with the same code, so a
reloaded session continues exactly where the live one stood (R-TRACE-4).

Invariants:

* ``messages`` is only appended to (until a compaction starts a new context).
* Every tool call of a committed assistant message gets exactly one result, in the
  original call order, before the next request or as carry-over (R-TOOL-7, R-RUN-4).
* Carry-over (R-ABORT-2) is derived from the ``abort`` record and the state before it;
  it is never a traced message itself (R-ABORT-3).
"""

from __future__ import annotations

from typing import assert_never

from greenroom.protocols import markers
from greenroom.protocols.compaction import summary_message
from greenroom.protocols.content import (
    ImageBlock,
    ModelBlock,
    TextBlock,
    ToolCallBlock,
    UserContent,
)
from greenroom.protocols.context import AssistantMessage, Message, ToolResult, UserMessage
from greenroom.protocols.history import live_records
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    Rewind,
    SteeringQueuedOutput,
    TaskEnd,
    TaskQueuedOutput,
    TaskQueueDropped,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    ToolHook,
    ToolProgress,
    UserMsg,
)

InputPart = UserContent | ToolResult

DISCARDED_TEXT = "The earlier conversation was discarded to free the context."
"""First message of a context started by a ``discard`` compaction."""


def interrupted_result(call: ToolCallBlock) -> ToolResult:
    """The placeholder result of a call that never finished (R-ABORT-2 case A)."""
    return ToolResult(
        call_id=call.id,
        tool=call.name,
        status="interrupted",
        is_error=True,
        content=(TextBlock(text=markers.INTERRUPTED_TEXT),),
    )


class Transcript:
    """Model context rebuilt from traced outputs. Not thread-safe; one owner."""

    __slots__ = (
        "_attempt_aborted",
        "_attempt_active",
        "_attempt_blocks",
        "_earlier_results",
        "_failed_blocks",
        "_fresh_context",
        "_open_calls",
        "_pending",
        "_prompt_parts",
        "_results",
        "_retry_note",
        "carry_over",
        "last_request_total",
        "messages",
        "session_turns",
        "supports_vision",
    )

    def __init__(self, *, supports_vision: bool = True) -> None:
        self.messages: list[Message] = []
        self.carry_over: list[InputPart] = []
        self.session_turns = 0
        self.last_request_total: int | None = None
        self.supports_vision = supports_vision
        self._pending: list[InputPart] = []
        self._open_calls: list[ToolCallBlock] = []
        self._results: dict[str, ToolResult] = {}
        self._earlier_results: dict[str, ToolResult] = {}
        """The results of the calls of the task's failed attempts: what an abort renders
        them with, apart from the current attempt's, whose call ids may repeat them."""
        self._attempt_blocks: list[ModelBlock] = []
        self._attempt_active = False
        self._attempt_aborted = False
        self._fresh_context = False
        self._failed_blocks: list[ModelBlock] = []
        self._retry_note: TextBlock | None = None
        self._prompt_parts = 0

    # -- reading -------------------------------------------------------------------

    @property
    def message_complete(self) -> bool:
        """False while a model response is being streamed (R-ABORT-2 case B)."""
        return not self._attempt_active

    @property
    def attempt_blocks(self) -> tuple[ModelBlock, ...]:
        """What the model request in flight has produced so far (empty when none is):
        the partial output an interrupt records (R-ABORT-2 case B). A request the interrupt
        ended ``aborted`` keeps it until the task's ``abort`` records it, for a fork or a
        rewind cut in between to record (R-FORK-1, R-FORK-2)."""
        if self._attempt_active or self._attempt_aborted:
            return tuple(self._attempt_blocks)
        return ()

    @property
    def open_calls(self) -> tuple[ToolCallBlock, ...]:
        """Tool calls of the last committed model message still owed a result."""
        return tuple(self._open_calls)

    def result_of(self, call_id: str) -> ToolResult | None:
        """The result recorded for tool call ``call_id``, or None while it has none."""
        return self._results.get(call_id)

    def request_messages(self) -> tuple[Message, ...]:
        """The context of the next request: committed messages plus pending input (and,
        on a retry, the ``[turn_retried]`` note)."""
        pending = self._input()
        if not pending:
            return tuple(self.messages)
        return (*self.messages, UserMessage(content=pending))

    def _input(self) -> tuple[InputPart, ...]:
        if self._retry_note is None:
            return tuple(self._pending)
        return (*self._pending, self._retry_note)

    def has_pending_input(self) -> bool:
        """Whether the next request has something new to carry: pending user input or open calls."""
        return bool(self._pending) or bool(self._open_calls)

    # -- feeding -------------------------------------------------------------------

    def apply(self, output: Output) -> None:
        """Take one traced output into account. Live-only outputs are ignored."""
        match output:
            case ModelMsg():
                self._attempt_blocks.append(output.block)
            case ToolCallOutput():
                self._results[output.call_id] = ToolResult(
                    call_id=output.call_id,
                    tool=output.tool,
                    status=output.status,
                    is_error=output.is_error,
                    content=output.content,
                )
            case RequestBegin():
                self._flush_results()
                self._note_failed_attempt()
                # A failed attempt's results are in its note now: a call of the new attempt
                # that repeats one of their ids must not be taken for done (R-RETRY-4); an
                # abort still renders the failed attempt with them.
                self._earlier_results.update(self._results)
                self._results.clear()
                self._attempt_blocks = []
                self._attempt_active = True
                self._attempt_aborted = False
            case RequestEnd():
                self._end_attempt(output)
            case TokenUsageOutput():
                self.last_request_total = output.request.total
            case UserMsg():
                self._add_user(output)
            case Abort():
                self._abort(output)
            case CompactionEnd(status="ok"):
                self._start_new_context(output.summary, output.kept_input)
            case TaskEnd():
                # A retry note belongs to its turn; a failed task's next task starts afresh.
                self._failed_blocks = []
                self._retry_note = None
            case CompactionEnd() | CompactionBegin():
                pass  # the context changes only when a compaction succeeds
            case (
                TaskStart() | ApprovalRequest() | ApprovalDecision() | CallInDoubt()
                | CallResolved() | ToolHook()
            ):
                pass  # the model sees the prompt and the calls' results, not these
            case Rewind():
                # The records a rewind cut are left out before they get here (rebuild, and
                # a rewinding session rebuilds its transcript): nothing to undo.
                pass
            case TaskQueuedOutput() | TaskQueueDropped() | SteeringQueuedOutput():
                # A queued follow-up reaches the context as its own prompt, once started;
                # queued steering as the user_msg that delivers it.
                pass
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                pass  # live only: the complete block or result follows
            case _:
                assert_never(output)

    def compaction_base(
        self, *, keep_prompt: bool = True
    ) -> tuple[tuple[Message, ...], tuple[UserContent, ...]]:
        """What a compaction summarizes, and what it keeps for after.

        It absorbs the context and the input not yet sent — pending tool results and
        carry-over (a manual compaction folds it in) — (R-COMPACT-3). With
        ``keep_prompt``, a new prompt still pending (the first turn of a task) is kept out
        of the summary and becomes the input after it, so the model reads the user's
        words, not a paraphrase. (After a provider overflow the prompt may be what was too
        long, so there it is absorbed too.)"""
        self._flush_results()
        kept: tuple[UserContent, ...] = ()
        pending: list[InputPart] = list(self._pending)
        if keep_prompt and self._prompt_parts:
            tail = pending[-self._prompt_parts :]
            if all(isinstance(p, TextBlock | ImageBlock) for p in tail):
                kept = tuple(p for p in tail if isinstance(p, TextBlock | ImageBlock))
                pending = pending[: -self._prompt_parts]
        absorbed = [*self.carry_over, *pending]
        if self._retry_note is not None:
            absorbed.append(self._retry_note)
        if not absorbed:
            return tuple(self.messages), kept
        return (*self.messages, UserMessage(content=tuple(absorbed))), kept

    @property
    def just_compacted(self) -> bool:
        """True while the context is exactly a fresh compaction's first message."""
        return (
            self._fresh_context
            and len(self.messages) <= 1
            and not self._pending
            and not self.carry_over
        )

    def _start_new_context(self, summary: str | None, kept: tuple[UserContent, ...]) -> None:
        self.messages = [summary_message(summary if summary is not None else DISCARDED_TEXT)]
        self._pending = list(kept)
        self._prompt_parts = len(kept)
        self._failed_blocks = []
        self._retry_note = None
        self._open_calls = []
        self._results.clear()
        self._earlier_results.clear()
        self.carry_over = []
        self._attempt_blocks = []
        self._attempt_active = False
        self._attempt_aborted = False
        self.session_turns = 0
        self.last_request_total = None
        self._fresh_context = True

    def _add_user(self, output: UserMsg) -> None:
        if output.kind == "prompt":
            self._flush_results()
            if self.carry_over:
                self._pending[:0] = self.carry_over
                self.carry_over = []
            self._pending.extend(output.content)
            self._prompt_parts = len(output.content)
            return
        self._flush_results()
        self._prompt_parts = 0
        text, images = markers.steering_text(output.content, supports_vision=self.supports_vision)
        self._pending.append(text)
        self._pending.extend(images)

    def _end_attempt(self, output: RequestEnd) -> None:
        self._attempt_active = False
        # An interrupted attempt's output stays until the abort that follows records it:
        # a history cut in between settles the task with it (R-FORK-1).
        self._attempt_aborted = output.status == "aborted"
        if self._attempt_aborted:
            return
        if output.status != "ok":
            if self._attempt_blocks:
                self._failed_blocks = self._attempt_blocks
            self._attempt_blocks = []
            return
        pending = self._input()
        if pending:
            self.messages.append(UserMessage(content=pending))
            self._pending = []
        self._retry_note = None
        self._prompt_parts = 0
        blocks = tuple(self._attempt_blocks)
        self._attempt_blocks = []
        self.messages.append(AssistantMessage(content=blocks))
        self._fresh_context = False
        self._open_calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
        self.session_turns += 1

    def _note_failed_attempt(self) -> None:
        """Before a retry: the failed attempt's output, and the results of the calls that
        already ran, become the ``[turn_retried]`` note that travels with the turn's input
        — and stays in the history once the retry succeeds, so no result is lost
        (R-RETRY-4)."""
        if not self._failed_blocks:
            return
        call_ids = {b.id for b in self._failed_blocks if isinstance(b, ToolCallBlock)}
        known = {
            call_id: " ".join(b.text for b in result.content if isinstance(b, TextBlock))
            for call_id, result in self._results.items()
            if call_id in call_ids
        }
        body = markers.render_partial(self._failed_blocks, known)
        self._failed_blocks = []
        if body:
            self._retry_note = TextBlock(text=markers.wrap(markers.TURN_RETRIED, body))

    def _flush_results(self) -> None:
        """Move the results of the open calls, in call order, into the pending input.

        A call without a result (only possible in a trace cut short by a crash) gets the
        interrupted placeholder, so pairing holds on every path (R-TOOL-7)."""
        if not self._open_calls:
            return
        for call in self._open_calls:
            result = self._results.pop(call.id, None)
            self._pending.append(result if result is not None else interrupted_result(call))
        self._open_calls = []
        self._results.clear()
        self._earlier_results.clear()

    def _abort(self, output: Abort) -> None:
        # The record says which case applies: the supervisor ends the cut attempt with
        # request_end(aborted) before it writes the abort, so the attempt is no longer
        # active here even in case B.
        self._attempt_aborted = False
        if self._attempt_active or not output.message_complete:
            # Case B: the model message was incomplete; the turn becomes one marked text.
            known = {
                call_id: " ".join(b.text for b in result.content if isinstance(b, TextBlock))
                for call_id, result in (*self._earlier_results.items(), *self._results.items())
            }
            body = markers.render_partial(output.partial, known)
            note = self._retry_note
            if note is not None and note.text == markers.wrap(markers.TURN_RETRIED, body):
                # Cut before the retry wrote anything (in its backoff, say): the partial
                # output is the failed attempt's, which the note holds — said once.
                self._retry_note = None
            # A retry's note stays in the history with the input it was sent with, as once a
            # retry succeeds: the calls that ran and their results are not lost (R-RETRY-4).
            pending = self._input()
            if pending:
                self.messages.append(UserMessage(content=pending))
                self._pending = []
            self.carry_over = [TextBlock(text=markers.wrap(markers.TURN_ABORTED, body))]
            self._attempt_blocks = []
            self._attempt_active = False
            self._results.clear()
            self._earlier_results.clear()
            self._failed_blocks = []
            self._retry_note = None
            self._prompt_parts = 0
            return
        # Case A: the message was complete; finished results are carried as they are,
        # unfinished calls get the interrupted placeholder so every call stays paired.
        self._flush_results()
        self.carry_over = list(self._input())
        self._pending = []
        self._failed_blocks = []
        self._retry_note = None
        self._prompt_parts = 0

    def recover(self, *, session_id: str, run_id: str) -> None:
        """Close a trace that ended without ``task_end`` (the process died mid-task):
        the turn in flight is treated as interrupted, exactly as if an ``abort`` had been
        recorded with what the trace holds (R-TRACE-4) — also when the attempt had ended
        ``aborted`` and the process died before the ``abort``."""
        cut = self._attempt_active or self._attempt_aborted
        if cut or self._open_calls:
            self._abort(
                Abort(
                    session_id=session_id,
                    run_id=run_id,
                    reason="recovered after an unclean stop",
                    partial=tuple(self._attempt_blocks),
                    message_complete=not cut,
                )
            )


def rebuild(
    records: list[Output], *, supports_vision: bool = True, recover: bool = True
) -> Transcript:
    """A transcript from the records of one trace file (one model context). A trace whose
    last task has no ``task_end`` (its ``task_start`` may be in the previous file, before
    the compaction that started this one) is recovered as interrupted — unless
    ``recover`` is False: the task is then left open, for the runtime to take up
    (R-HITL-4) or to recover when a new task starts (:meth:`Transcript.recover`).

    What a ``rewind`` cut is left out (:func:`~greenroom.protocols.history.live_records`):
    the context is the one the session continued from (R-FORK-2)."""
    transcript = Transcript(supports_vision=supports_vision)
    open_run: str | None = None
    session_id = ""
    for record in live_records(records):
        transcript.apply(record)
        session_id = record.session_id
        match record:
            case TaskStart():
                open_run = record.run_id
            case TaskEnd():
                open_run = None
            case CompactionEnd(status="ok") if open_run is None:
                # A file started by a compaction: the task that compacted (if any) has its
                # task_start in the previous file and goes on here (R-COMPACT-8).
                open_run = record.run_id
            case (
                CompactionEnd()
                | UserMsg()
                | RequestBegin()
                | ModelMsg()
                | TokenUsageOutput()
                | RequestEnd()
                | ApprovalRequest()
                | ApprovalDecision()
                | ToolHook()
                | ToolCallOutput()
                | Abort()
                | CompactionBegin()
                | CallInDoubt()
                | CallResolved()
                | Rewind()
                | TaskQueuedOutput()
                | TaskQueueDropped()
                | SteeringQueuedOutput()
                | PartialText()
                | PartialThinking()
                | PartialToolCall()
                | ToolProgress()
            ):
                pass  # inside a task, or never traced: the open task is unchanged
            case _:
                assert_never(record)
    if open_run is not None and recover:
        transcript.recover(session_id=session_id, run_id=open_run)
    return transcript
