"""Showing a task's outputs: one JSON object a line (``--json``) or the conversation on
stdout and the bookkeeping on stderr, and one trace record as one readable line."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO, assert_never

import trio

from greenroom.protocols.budgets import usd
from greenroom.protocols.content import (
    ImageBlock,
    ModelBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from greenroom.protocols.converter import to_json
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
from greenroom.protocols.people import ASK_USER
from greenroom.protocols.tables import TableLayout
from greenroom.protocols.tools import Tool
from greenroom.protocols.wording import (
    INTERRUPTED_APPROVAL,
    allowed_without_asking,
    decision_words,
    in_doubt_words,
    resolved_words,
    tool_hook_words,
)

# -- rendering --------------------------------------------------------------------------


class Renderer:
    """Shows outputs as they arrive. Subclasses override :meth:`show`."""

    def __init__(self) -> None:
        self._shown_calls: dict[str, trio.Event] = {}
        self._interrupted_approvals: set[str] = set()
        self.allowed_without_asking: str | None = None
        """What allows every call without asking (``"--approve all"``), if anything: the
        host's allows are then shown as its doing, not a person's."""

    def show(self, output: Output) -> None:
        """Show one output; called for every output of the run, in order, and must not block.
        A subclass marks what it has shown so that :meth:`wait_shown` returns."""
        raise NotImplementedError

    def mark_interrupted(self, call_id: str) -> None:
        """The approval question of ``call_id`` was answered by Ctrl-C: its deny is shown
        as :data:`~greenroom.protocols.wording.INTERRUPTED_APPROVAL`."""
        self._interrupted_approvals.add(call_id)

    def decision_text(self, output: ApprovalDecision) -> str:
        """The decision in the words every screen uses (``--json`` keeps the values)."""
        if output.decision == "deny" and output.call_id in self._interrupted_approvals:
            return INTERRUPTED_APPROVAL
        if (output.decision, output.by) == ("allow", "host") and self.allowed_without_asking:
            return allowed_without_asking(self.allowed_without_asking)
        return decision_words(output.decision, output.by)

    def break_line(self) -> None:
        """End a partly written line before something else is written (a question)."""

    async def wait_shown(self, key: str) -> None:
        """Return once ``call:<id>`` (a tool call) or ``decision:<id>`` (its approval
        decision) has been shown."""
        await self._shown_event(key).wait()

    def _mark_shown(self, output: Output) -> None:
        match output:
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                pass  # live only; first, as most outputs are these
            case ModelMsg(block=ToolCallBlock() as call):
                self._shown_event(f"call:{call.id}").set()
            case ApprovalDecision():
                self._shown_event(f"decision:{output.call_id}").set()
            case (
                ModelMsg()
                | UserMsg()
                | TaskStart()
                | RequestBegin()
                | TokenUsageOutput()
                | RequestEnd()
                | ApprovalRequest()
                | ToolHook()
                | ToolCallOutput()
                | Abort()
                | CompactionBegin()
                | CompactionEnd()
                | CallInDoubt()
                | CallResolved()
                | Rewind()
                | TaskQueuedOutput()
                | TaskQueueDropped()
                | SteeringQueuedOutput()
                | TaskEnd()
            ):
                pass  # only tool calls and their decisions are waited for
            case _:
                assert_never(output)

    def _shown_event(self, key: str) -> trio.Event:
        event = self._shown_calls.get(key)
        if event is None:
            event = self._shown_calls[key] = trio.Event()
        return event


class JsonRenderer(Renderer):
    """``--json``: each output as one JSON line (the trace's JSON form) and nothing else."""

    def __init__(self, out: TextIO) -> None:
        super().__init__()
        self._out = out

    def show(self, output: Output) -> None:
        """Write ``output`` as one JSON line and flush."""
        self._out.write(to_json(output) + "\n")
        self._out.flush()
        self._mark_shown(output)


class _Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled and text else text

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)

    def yellow(self, text: str) -> str:
        return self._wrap("33", text)

    def cyan(self, text: str) -> str:
        return self._wrap("36", text)


def color_enabled(stream: TextIO) -> bool:
    """Whether to colour what goes to ``stream``: a terminal, without NO_COLOR or TERM=dumb."""
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


# What a terminal would act on rather than show: C0 and C1 controls but the line end and
# tab, and every escape sequence but the colours (SGR) this renderer itself adds.
_TERMINAL_CONTROLS = re.compile(r"\x1b\[[0-9;]*m|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _shown_control(match: re.Match[str]) -> str:
    found = match.group()
    return found if len(found) > 1 else f"\\x{ord(found):02x}"


def terminal_text(text: str) -> str:
    """``text`` as a terminal shows it without acting on it: a control character (an
    escape sequence's start, a bell, a carriage return) becomes its ``\\xNN`` escape, so
    model, tool and server text cannot write the clipboard, retitle or clear the screen
    (colours pass). Line ends and tabs are kept."""
    if "\r\n" in text:
        text = text.replace("\r\n", "\n")
    return _TERMINAL_CONTROLS.sub(_shown_control, text)


class HumanRenderer(Renderer):
    """Terminal output: text streams as it arrives, thinking is dimmed (or prefixed with
    ``thinking:`` without colour), each tool call is shown with its arguments, then its
    approval decision, then its result. Failed requests and other events go to stderr."""

    OUTPUT_LINES = 3
    PREVIEW_LINES = {"list_dir": 12, "search_files": 8}
    """Tools whose output is read at a glance show more of it: a short listing whole."""
    LINE_CHARS = 100

    def __init__(self, out: TextIO, err: TextIO, *, tools: Sequence[Tool] = ()) -> None:
        super().__init__()
        self._out = out
        self._err = err
        self._style = _Style(color_enabled(out))
        self._err_style = _Style(color_enabled(err))
        self._parallel = {t.name: t.parallel for t in tools}
        self._line_open = False
        self._streamed_text = False
        self._streamed_thinking = False
        self._running: set[str] = set()
        self._after_tool = False
        self._hinted_default_deny = False
        # Streamed text passes through it; Markdown tables come out aligned once whole.
        self._tables = TableLayout()

    # writing helpers

    def _write(self, text: str) -> None:
        if not text:
            return
        self._out.write(terminal_text(text))
        self._out.flush()
        self._line_open = not text.endswith("\n")

    def _line(self, text: str) -> None:
        self.break_line()
        self._write(text + "\n")

    def _note(self, text: str) -> None:
        """A line on stderr, after ending any open stdout line."""
        self.break_line()
        self._err.write(terminal_text(text) + "\n")
        self._err.flush()

    def break_line(self) -> None:
        """End the open stdout line, if any."""
        if self._line_open:
            self._write("\n")

    # outputs

    def show(self, output: Output) -> None:
        """Show one output as the class docstring says; a subagent's (``origin`` set) are shown
        as dimmed one-line notes tagged with its path."""
        if output.origin:
            self._show_subagent(output)
            return
        if not isinstance(output, PartialText):
            self.release_held_text()  # the text was cut off (an abort, a failed attempt)
        match output:
            case PartialText():
                if self._streamed_thinking:
                    self.break_line()
                    self._streamed_thinking = False
                self._start_prose()
                self._streamed_text = True
                self._write(self._tables.feed(output.text))
            case PartialThinking():
                if not self._streamed_thinking:
                    self._start_prose()
                    self.break_line()
                    self._write(self._thinking_prefix())
                    self._streamed_thinking = True
                self._write(self._style.dim(output.text))
            case ModelMsg():
                self._show_block(output.block)
                self._mark_shown(output)
            case ApprovalDecision():
                self._show_decision(output)
                self._mark_shown(output)
            case ToolCallOutput():
                self._show_tool_output(output)
            case ToolProgress():
                self._line(self._style.dim(f"  … {output.tool}: {output.message}"))
            case ToolHook():
                self._line(f"  {self._style.yellow('⚑')} {output.tool} "
                           + self._style.yellow(tool_hook_words(output)))
            case RequestBegin():
                if output.attempt > 1:
                    self._note(
                        self._err_style.yellow(
                            f"retrying turn {output.turn}: attempt {output.attempt}"
                        )
                    )
            case RequestEnd():
                self._show_request_end(output)
            case UserMsg():
                if output.kind == "steering":
                    self._line(self._style.cyan(f"[steering] {_content_text(output.content)}"))
            case Abort():
                self._note(self._err_style.yellow(f"aborted: {output.reason}"))
            case CompactionBegin():
                self._note(self._err_style.dim(f"compacting the context ({output.reason})…"))
            case Rewind():
                self._note(self._err_style.yellow(f"rewound to seq {output.to_seq}"))
            case CompactionEnd():
                detail = (
                    f"now in {output.trace_file}" if output.status == "ok" else output.error_message
                )
                self._note(self._err_style.dim(f"compaction {output.status}: {detail or ''}"))
            case CallInDoubt():
                self._line(f"  {self._style.yellow('?')} {in_doubt_words(output)}")
            case CallResolved():
                self._line(f"  {self._style.yellow('?')} {resolved_words(output)}")
            case TaskEnd():
                self.break_line()
                if output.message and output.status not in ("completed", "aborted"):
                    self._note(self._err_style.yellow(output.message))
            case (
                TaskStart() | TokenUsageOutput() | PartialToolCall() | ApprovalRequest()
                | TaskQueuedOutput() | TaskQueueDropped() | SteeringQueuedOutput()
            ):
                # A streaming call shows once complete, an approval request by its
                # decision, a follow-up by its prompt once it starts, steering once
                # delivered; the start of a task and its token counts add nothing a reader
                # needs.
                pass
            case _:
                assert_never(output)

    def _start_prose(self) -> None:
        # A blank line between tool results and the model's next words.
        if self._after_tool:
            self.break_line()
            self._write("\n")
            self._after_tool = False

    def _thinking_prefix(self) -> str:
        return self._style.dim("thinking: ")

    def release_held_text(self) -> None:
        """Write the text held back as a possible Markdown table, if any, laid out if it is
        one: the text it belongs to has ended or was cut off."""
        if self._tables.holding:
            self._write(self._tables.finish())

    def _show_block(self, block: ModelBlock) -> None:
        if isinstance(block, TextBlock):
            if not self._streamed_text:
                self._start_prose()
                self._write(self._tables.feed(block.text))
            self._write(self._tables.finish())  # also: the next text starts a new line
            self._streamed_text = False
            self.break_line()
        elif isinstance(block, ThinkingBlock):
            if not self._streamed_thinking:
                self.break_line()
                self._write(self._thinking_prefix() + self._style.dim(block.text))
            self._streamed_thinking = False
            self.break_line()
        elif isinstance(block, RedactedThinkingBlock):
            self._line(self._style.dim("thinking: (redacted)"))
        else:
            args = arguments_text(block, 160)
            self._line(
                f"{self._style.cyan('▸')} {self._style.bold(block.name)} {args}  "
                + self._style.dim(f"[{block.id}]")
            )

    def _show_decision(self, output: ApprovalDecision) -> None:
        if self.show_question_decision(output):
            return
        words = self.decision_text(output)
        if output.decision == "deny":
            self._line(f"  {self._style.red('✗')} {output.tool} {self._style.red(words)}")
            if words == decision_words("deny", "default") and not self._hinted_default_deny:
                self._hinted_default_deny = True
                self._note(
                    self._err_style.dim(
                        "(no one can answer approval questions here: use --approve ask "
                        "on a terminal, or --approve all)"
                    )
                )
            return
        self._running.add(output.call_id)
        if self._parallel.get(output.tool, True):
            slots = f"running: {min(len(self._running), 5)} of 5 slots busy"
        else:
            slots = "exclusive: runs alone, in call order"
        self._line(
            f"  {self._style.green('✓')} {output.tool} {self._style.green(words)} "
            + self._style.dim(f"· {slots}")
        )

    def show_question_decision(self, output: ApprovalDecision, words: str | None = None) -> bool:
        """Show the decision of a question (``ask_user``) — answered, or not — and return
        True; False for any other call. A question runs nothing: its answer is the
        result shown next, so no slot is named. ``words`` replace the usual ones."""
        if output.tool != ASK_USER or output.decision != "allow":
            return False
        if words is None:
            words = "answered" if output.by == "client" else "not answered"
        self._line(f"  {self._style.green('?')} {output.tool} {self._style.green(words)}")
        return True

    def _show_tool_output(self, output: ToolCallOutput) -> None:
        self._running.discard(output.call_id)
        color = self._style.green if output.status == "ok" else self._style.red
        text = _content_text(output.content)
        lines = text.splitlines() or [""]
        shown = self.PREVIEW_LINES.get(output.tool, self.OUTPUT_LINES)
        if len(lines) <= shown + 1:
            shown = len(lines)  # "… 1 more line" would hide nothing worth hiding
        head = [clip(line, self.LINE_CHARS) for line in lines[:shown]]
        more = len(lines) - len(head)
        self._line(
            f"  {color('◂')} {output.tool} {color(output.status)}  "
            + self._style.dim(f"[{output.call_id}]")
        )
        for line in head:
            self._line(self._style.dim(f"      {line}"))
        if more > 0:
            self._line(self._style.dim(f"      … {_plural(more, 'more line')}"))
        self._after_tool = True

    def _show_request_end(self, output: RequestEnd) -> None:
        if output.status == "ok":
            if output.stop_reason == "max_tokens":
                self._note(self._err_style.yellow("the reply was cut by the output token limit"))
            return
        if output.status == "aborted":
            return
        retry = (
            f"retrying in {output.retry_in_ms} ms"
            if output.retry_in_ms is not None
            else "no more retries"
        )
        # The message says what happened; the status is only its retry class (a refused
        # connection and a 429 are both `timeout`), so it is not shown as the headline.
        self._note(
            self._err_style.red(
                f"model request failed (turn {output.turn}, attempt {output.attempt}): "
                f"{output.error_message or output.status}; {retry}"
            )
        )

    def _show_subagent(self, output: Output) -> None:
        who = "/".join(output.origin or ())
        match output:
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                pass  # the most frequent outputs, tested first: a subagent's stay quiet
            case ModelMsg(block=TextBlock() as block):
                self._line(self._style.dim(f"  [{who}] {clip(block.text, 200)}"))
            case ModelMsg(block=ToolCallBlock() as block):
                self._line(self._style.dim(f"  [{who}] ▸ {block.name} {arguments_text(block)}"))
            case ToolCallOutput():
                self._line(self._style.dim(f"  [{who}] ◂ {output.tool} {output.status}"))
            case TaskEnd():
                self._line(self._style.dim(f"  [{who}] subagent {output.status}"))
            case CallInDoubt():
                self._line(self._style.dim(f"  [{who}] {in_doubt_words(output)}"))
            case CallResolved():
                self._line(self._style.dim(f"  [{who}] {resolved_words(output)}"))
            case (
                ModelMsg()
                | UserMsg()
                | TaskStart()
                | RequestBegin()
                | TokenUsageOutput()
                | RequestEnd()
                | ApprovalRequest()
                | ApprovalDecision()
                | ToolHook()
                | Abort()
                | CompactionBegin()
                | CompactionEnd()
                | Rewind()
                | TaskQueuedOutput()
                | TaskQueueDropped()
                | SteeringQueuedOutput()
            ):
                pass  # a subagent shows its words, its tool calls and its end, nothing more
            case _:
                assert_never(output)


def summary_line(end: TaskEnd | None, trace_path: Path | None, *, color: bool = False) -> str:
    """The closing one-liner: status, turns, tokens in/out, cost (R-SHARE-3), time, trace
    file."""
    style = _Style(color)
    if end is None:
        return style.red("✗ the task ended without a task_end (see the trace)")
    mark = style.green("✓") if end.status == "completed" else style.red("✗")
    usage = end.usage
    parts = [
        f"{mark} {end.status}",
        _plural(end.turns, "turn"),
        f"tokens {usage.input:,} in / {usage.output:,} out",
        "cost unknown" if usage.cost_usd is None else usd(usage.cost_usd),
        f"{end.wall_ms / 1000:.1f} s",
    ]
    if trace_path is not None:
        parts.append(f"trace {trace_path}")
    return " · ".join(parts)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the last one an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def arguments_text(call: ToolCallBlock, limit: int = 120) -> str:
    """A tool call's arguments as clipped JSON, or its raw text when it is not valid JSON."""
    if call.invalid_arguments is not None:
        return clip(call.invalid_arguments, limit) + " (not valid JSON)"
    return clip(json.dumps(call.arguments, ensure_ascii=False), limit)


def _content_text(content: Sequence[TextBlock | ImageBlock]) -> str:
    return "\n".join(
        part.text if isinstance(part, TextBlock) else f"[image {part.path}]" for part in content
    )


def format_record(record: Output) -> str:
    """One trace record as one readable line: seq, type, the key fields."""
    seq = "-" if record.seq is None else str(record.seq)
    detail = _record_detail(record)
    origin = f"  (from {'/'.join(record.origin)})" if record.origin else ""
    return f"{seq:>5}  {record.TYPE:<17} {detail}{origin}"


def _record_detail(record: Output) -> str:
    match record:
        case UserMsg():
            return f"{record.kind}: {clip(_one_line(_content_text(record.content)), 120)}"
        case TaskStart():
            return f"{record.run_id} input_seq={record.input_seq}"
        case RequestBegin():
            return f"turn {record.turn} attempt {record.attempt}"
        case ModelMsg():
            return f"turn {record.turn} {_block_detail(record.block)}"
        case TokenUsageOutput():
            usage = record.request
            return (
                f"turn {record.turn} in={usage.input} out={usage.output} "
                f"cache_read={usage.cache_read} cache_write={usage.cache_write}"
            )
        case RequestEnd():
            parts = [f"turn {record.turn} {record.status} attempt {record.attempt}"]
            if record.stop_reason:
                parts.append(f"stop={record.stop_reason}")
            if record.retry_in_ms is not None:
                parts.append(f"retry_in={record.retry_in_ms}ms")
            if record.error_message:
                parts.append(clip(_one_line(record.error_message), 120))
            return " ".join(parts)
        case ApprovalRequest():
            return f"{record.call_id} {record.tool} {clip(json.dumps(record.arguments), 120)}"
        case ApprovalDecision():
            return f"{record.call_id} {record.tool} {decision_words(record.decision, record.by)}"
        case ToolHook():
            return f"{record.call_id} {record.tool} {clip(tool_hook_words(record), 160)}"
        case ToolCallOutput():
            text = clip(_one_line(_content_text(record.content)), 100)
            return f"{record.call_id} {record.tool} {record.status}: {text}"
        case Abort():
            state = "message complete" if record.message_complete else "message incomplete"
            return f"{record.reason} ({state}, {_plural(len(record.partial), 'partial block')})"
        case CompactionBegin():
            return f"reason={record.reason}"
        case CallInDoubt():
            return f"{record.call_id} {record.tool} key={record.idempotency_key}"
        case CallResolved():
            who = f" ({record.principal})" if record.principal else ""
            text = f"{record.call_id} {record.tool} by {record.by}{who}: {record.outcome}"
            if record.check_error:
                text += f"; check: {clip(_one_line(record.check_error), 100)}"
            return text
        case Rewind():
            cut = f"to seq {record.to_seq}: later records are cut from the history"
            return f"{cut} ({record.reason})" if record.reason else cut
        case CompactionEnd():
            parts = [f"{record.status} attempt {record.attempt}"]
            if record.trace_file:
                parts.append(f"-> {record.trace_file}")
            if record.error_message:
                parts.append(clip(_one_line(record.error_message), 120))
            return " ".join(parts)
        case TaskEnd():
            usage = record.usage
            text = (
                f"{record.status} turns={record.turns} in={usage.input} out={usage.output} "
                f"wall={record.wall_ms}ms"
            )
            return f"{text} {record.message}" if record.message else text
        case TaskQueuedOutput():
            return f"{record.queue_id}: {clip(_one_line(_content_text(record.content)), 120)}"
        case TaskQueueDropped():
            dropped = " ".join(record.queue_ids)
            return f"{dropped} {clip(_one_line(record.reason), 120)}" if record.reason else dropped
        case SteeringQueuedOutput():
            return f"{record.steering_id}: {clip(_one_line(_content_text(record.content)), 120)}"
        case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
            return ""  # live only: never in a trace
        case _:
            assert_never(record)


def _block_detail(block: ModelBlock) -> str:
    if isinstance(block, TextBlock):
        return f"text: {clip(_one_line(block.text), 120)}"
    if isinstance(block, ThinkingBlock):
        return f"thinking: {clip(_one_line(block.text), 120)}"
    if isinstance(block, RedactedThinkingBlock):
        return "redacted_thinking"
    return f"tool_call {block.id} {block.name} {arguments_text(block)}"


def _one_line(text: str) -> str:
    return " ".join(text.split())

