"""``greenroom chat``: an interactive terminal on one session.

::

    greenroom chat [--session ID] [the provider, model, workspace, data-dir, approve,
                                   tools and limit flags of ``greenroom run``]

One session (new, or continued with ``--session``, which first shows a recap of the last
exchange), many tasks. What a typed line does depends on the moment:

* at the prompt (``you>``, no task running) a line starts a task (``Session.run``); its
  outputs stream through the renderer of ``greenroom run`` (text on stdout, bookkeeping on
  stderr) and a summary line closes it;
* while a task runs (the prompt reads ``steer>``), a line is **steering**
  (``Session.steer``): it is acknowledged at once with ``[steering queued]`` and reaches the
  model at the next input assembly, where the renderer shows it as ``[steering] TEXT``; a
  line typed just as the task ended starts the next task instead;
* while a tool-call approval question is open (``--approve ask``) the question is the
  prompt and the next line answers it (y / n / a; Ctrl-C denies), whatever else is going
  on; anything else typed there is steering, queued as such with a notice, and the
  question stays open (piped input, read a line per question, only gets the hint).

Commands: ``/follow TEXT`` queues a whole task after the running one (``follow_up``; at
the prompt it just runs), ``/compact`` compacts the context now (``Session.compact``, at the
prompt only; it says so when the session cannot compact), ``/retry`` ends a reconnect
backoff early (``skip_reconnect_wait``) and says whether a wait was skipped, ``/help``
(with the MCP prompts of the session), ``/quit``.

MCP (R-MCP-5): ``/server:prompt arg=value …`` gets that prompt from the session's MCP
server and sends its text as the line would be sent (a task at the prompt, steering while
one runs); ``@server:uri`` in a line (or after ``/follow``) attaches that resource, read
through its server. Either is prepared before anything is sent: while a prompt line is
prepared the REPL waits for it (Ctrl-C stops it), and a command or attachment that cannot
be had is one line saying why, with nothing sent.

Keys: Ctrl-C while a task (or a compaction) runs interrupts it — it ends ``aborted``, its
carry-over is kept for the next task, and the prompt returns; a second Ctrl-C before it has
ended leaves at once (exit 130), without waiting for tools that ignore the interrupt.
Ctrl-C at the prompt asks for confirmation: a second one in a row leaves. Ctrl-D (end of
input) leaves at the prompt; during a task it leaves once the task has ended (Ctrl-C first
to stop it sooner). ``/quit`` during a task interrupts it, then leaves. Leaving this way
exits 0 and says how to come back (``greenroom chat --session ID``); usage errors exit 2.
A tool that ignored the interrupt holds a leave at most ``LEAVE_GRACE_S`` (2 s), then the
process exits without it (a Ctrl-C meanwhile: at once, exit 130).

A failed model request that will be retried shows one live line on stderr that counts down
in place on a terminal: ``[retry] attempt 2/6 in 0.4 s — overloaded`` (once, without the
countdown, when stderr is not a terminal). It ends when the next attempt produces output.

The terminal. When stdin, stdout and stderr are a terminal, a :class:`TerminalScreen`
owns it: prompt_toolkit keeps the input line at the bottom — with, above it, the line the
model is still writing and the live retry line — and every finished output line is
printed above that area, so keystrokes never land inside the output and an open approval
question is never written over. prompt_toolkit runs its own asyncio loop, so it lives in a
thread of its own; trio stays in charge of everything else and talks to it only through
thread-safe calls (writes are queued and printed by that thread; its keys arrive as
events). Otherwise (a pipe, a file) lines are read with ``os.read`` in a worker thread and
nothing is typed "while" a task runs: a line is read only for the prompt or an approval
question, so ``printf 'task one\\ntask two\\n' | greenroom chat`` runs the two tasks one
after the other, then leaves.

Either way input is routed in one place: a line goes to a pending approval question
first, else to the REPL, so approvals and steering never race. Signals, keys, lines and
the end of each task arrive as events on one channel and are handled one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import math
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TextIO, assert_never, cast

import attrs
import trio
from prompt_toolkit.application import Application
from prompt_toolkit.formatted_text import ANSI
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.output import create_output
from prompt_toolkit.shortcuts import PromptSession

from greenroom.actors.apps.asking import (
    ANSWER_PROMPT,
    LineReader,
    answer_hint,
    approver_for,
    chosen_answer,
    question_block,
    question_of,
)
from greenroom.actors.apps.exits import EXIT_ABORTED, EXIT_OK, EXIT_USAGE, print_error
from greenroom.actors.apps.render import HumanRenderer, arguments_text, color_enabled, summary_line
from greenroom.actors.apps.run import (
    RunOptions,
    is_default_data_dir,
    leave_at_once,
    leaving_in_bounded_time,
    open_reported_session,
    prepare_options,
    refusal_words,
    report_shell_confinement,
    run_options,
)
from greenroom.actors.runtime import (
    ApproveFn,
    GreenroomError,
    Host,
    RunStream,
    Session,
    default_data_dir,
    read_trace,
)
from greenroom.actors.tools import (
    AttachmentError,
    McpView,
    PromptCommandError,
    attach_to_input,
    expand_prompt_command,
    has_attachments,
    parse_prompt_command,
    prompt_usage,
)
from greenroom.protocols.content import TextBlock, ToolCallBlock, UserContent
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
from greenroom.protocols.retry import MAX_RETRIES
from greenroom.protocols.tools import Tool
from greenroom.protocols.trace import trace_file_number
from greenroom.protocols.wording import INTERRUPTED_APPROVAL, decision_words

__all__ = [
    "PROMPT",
    "WORKING_PROMPT",
    "Chat",
    "ChatApprover",
    "ChatRenderer",
    "LineRouter",
    "TerminalScreen",
    "chat_command",
    "last_exchange",
    "mcp_help",
]

PROMPT = "you> "
"""Shown on stderr when no task runs and a line would start one."""

WORKING_PROMPT = "steer> "
"""The prompt while a task runs: a line typed there steers it (terminal only)."""

APPROVAL_HINT = "answer y, n or a"
"""What an approval question says to an answer it does not understand, before asking again."""

NOT_ANSWERED = "not answered"
"""How the chat shows a question of the model left without an answer (Ctrl-C, end of
input): the model is told nobody answered."""

STEERED_AT_QUESTION = "[not an answer: sent to the model as steering; the question stays open]"
"""What the chat says when a line typed at an open approval question is queued as steering."""

HELP = (
    "Type a task and press Enter. While it runs, what you type steers it; "
    "Ctrl-C interrupts it.\n"
    "  /follow TEXT   run TEXT as a new task after the current one\n"
    "  /compact       compact the session's context now (between tasks)\n"
    "  /retry         skip the wait before the next reconnect attempt\n"
    "  /quit          leave (also Ctrl-D, or Ctrl-C twice at the prompt)\n"
    "  /SERVER:PROMPT arg=value …   send an MCP server's prompt as your input\n"
    "  @SERVER:URI    in a line: attach that resource of an MCP server"
)

TICK_S = 0.1
"""How often the live retry line is redrawn."""

_ATTACHED = re.compile(r'<attachment source="([^"\n]*)">')

RECAP_CHARS = 160
"""How much of the last prompt and the last reply a resumed chat shows."""

_COMPACTABILITY_TEXT = {
    "empty": "the context is empty",
    "just_compacted": "the context was just compacted",
    "unsupported": "this session cannot compact now (locked by an auth failure?)",
}


def chat_command(args: argparse.Namespace) -> int:
    """``greenroom chat``: the exit code (0 when the user leaves, 2 on usage errors,
    130 when a second Ctrl-C cut an interrupt short)."""
    options = prepare_options(run_options(args, prompt=""))
    code = EXIT_ABORTED
    try:
        code = trio.run(_chat, options)
    except* KeyboardInterrupt:
        print_error("interrupted")
    return code


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


async def _chat(options: RunOptions) -> int:
    return await leaving_in_bounded_time(_chat_in_host(options), lambda code: code)


async def _chat_in_host(options: RunOptions) -> int:
    async with Host.open(
        data_dir=options.data_dir, observers=options.observers, prices=options.prices
    ) as host:
        session = await open_reported_session(host, options)
        if session is None:
            return EXIT_USAGE
        report_shell_confinement(options)
        screen = (
            TerminalScreen(sys.stdout, sys.stderr)
            if all(_is_terminal(s) for s in (sys.stdin, sys.stdout, sys.stderr))
            and os.environ.get("TERM") != "dumb"  # no cursor movement: lines as they come
            else None
        )
        renderer = ChatRenderer(sys.stdout, sys.stderr, tools=session.tools, screen=screen)
        if options.session_id is not None:
            exchange = await trio.to_thread.run_sync(last_exchange, session.directory)
            if exchange is not None:
                renderer.recap(*exchange)
        chat = Chat(
            session,
            renderer,
            approve=options.approve,
            fd=sys.stdin.fileno(),
            screen=screen,
            resume_hint=resume_command(session.id, options.data_dir),
            data_dir=options.data_dir,
        )
        try:
            return await chat.run()
        except* KeyboardInterrupt:
            # A second Ctrl-C during a task: the chat has given the terminal back; closing
            # the host would wait for tools that ignore the interrupt, for ever (R-SEC-2).
            await leave_at_once(host)


def mcp_help(mcp: McpView | None) -> str | None:
    """The MCP part of ``/help`` (R-MCP-5): each prompt of the session's servers as the
    command that sends it, with its arguments (optional ones in brackets) and description,
    and the servers whose resources ``@server:uri`` attaches; None without MCP servers."""
    if mcp is None:
        return None
    commands = [
        (prompt_usage(server, prompt), prompt.description or "")
        for server, prompts in mcp.prompts().items()
        for prompt in prompts
    ]
    width = min(max((len(usage) for usage, _ in commands), default=0), 40)
    lines = ["MCP prompts (each sent as your input):" if commands else "MCP prompts: none"]
    lines += [f"  {usage.ljust(width)}   {' '.join(about.split())}".rstrip()
              for usage, about in commands]  # fmt: skip
    readable = [server for server, resources in mcp.resources().items() if resources]
    if readable:
        lines.append(f"@SERVER:URI attaches a resource of: {', '.join(readable)}")
    return "\n".join(lines)


def resume_command(session_id: str, data_dir: Path | None) -> str:
    """The command that continues this session (with its data dir when not the default)."""
    command = f"greenroom chat --session {session_id}"
    if data_dir is not None and not is_default_data_dir(Path(data_dir)):
        command += f" --data-dir {shlex.quote(str(data_dir))}"
    return command


# -- the recap of a resumed session ---------------------------------------------------------


def last_exchange(session_dir: Path) -> tuple[str, str] | None:
    """The last prompt of the session and the model's last words after it, read from its
    trace files (newest first, across compactions); None when it has no prompt yet or its
    traces cannot be read. Blocking: call it from a worker thread inside trio."""
    try:
        numbered = [
            (number, entry)
            for entry in Path(session_dir).iterdir()
            if (number := trace_file_number(entry.name)) is not None
        ]
    except OSError:
        return None
    reply: str | None = None
    for _, path in sorted(numbered, reverse=True):
        try:
            records = read_trace(path).records
        except OSError:
            return None
        for record in reversed(records):
            if record.origin is not None:
                continue  # a subagent's
            if isinstance(record, ModelMsg) and isinstance(record.block, TextBlock):
                if reply is None and record.block.text.strip():
                    reply = record.block.text
            elif isinstance(record, UserMsg) and record.kind == "prompt":
                prompt = " ".join(p.text for p in record.content if isinstance(p, TextBlock))
                return prompt, reply or ""
    return None


def _clip_line(text: str, limit: int = RECAP_CHARS) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# -- input routing ----------------------------------------------------------------------


class Interrupted:
    """What :meth:`LineRouter.ask` returns when Ctrl-C answered the question."""


INTERRUPTED = Interrupted()

Answer = str | Interrupted | None
"""A typed line, Ctrl-C (:data:`INTERRUPTED`), or None at end of input."""

ReadAnswer = Callable[[], Awaitable[Answer]]
"""Where an approval question's answer comes from (:meth:`LineRouter.ask`)."""


class LineRouter:
    """Hands input lines to whoever asked for the next one (an approval question), in
    the order they asked. After :meth:`close` (end of input) every question gets None."""

    def __init__(self, on_ask: Callable[[], None] | None = None) -> None:
        self._waiters: list[trio.MemorySendChannel[Answer]] = []
        self._closed = False
        self._on_ask = on_ask

    @property
    def waiting(self) -> bool:
        """Whether a question is waiting for a line."""
        return bool(self._waiters)

    async def ask(self) -> Answer:
        """The next line typed, :data:`INTERRUPTED` for Ctrl-C, or None at end of input
        (the approver then denies)."""
        if self._closed:
            return None
        # One slot: the prompt thread's one answer never waits for the trio side.
        send, receive = trio.open_memory_channel[Answer](1)
        self._waiters.append(send)
        if self._on_ask is not None:
            self._on_ask()
        try:
            return await receive.receive()
        finally:  # also when the question is cancelled (the task was interrupted)
            if send in self._waiters:
                self._waiters.remove(send)

    def answer(self, line: str | Interrupted) -> bool:
        """Give ``line`` to the oldest open question; False when none is open."""
        if not self._waiters:
            return False
        self._waiters.pop(0).send_nowait(line)
        return True

    def close(self) -> None:
        """End of input: every open question gets None now, and every later one at once."""
        self._closed = True
        while self._waiters:
            self._waiters.pop(0).send_nowait(None)


class ChatApprover:
    """``--approve ask`` in the chat: one question at a time, in call order, asked through
    the renderer (on a terminal the question is the prompt line). y(es) → allow, n(o) →
    deny, a(lways) → allow this tool for the rest of the session; anything else gets
    :data:`APPROVAL_HINT` and the question again. Ctrl-C denies (shown as
    :data:`~greenroom.protocols.wording.INTERRUPTED_APPROVAL`), so does end of input.

    ``steer``, when given (someone types at a terminal), receives a line that is not an
    answer (nor empty, nor a ``/`` command): it is steering typed while the question was
    open, and is queued as such rather than thrown away (:data:`STEERED_AT_QUESTION`)."""

    def __init__(
        self,
        renderer: ChatRenderer,
        read_answer: ReadAnswer,
        *,
        steer: Callable[[str], bool] | None = None,
    ) -> None:
        self._renderer = renderer
        self._read_answer = read_answer
        self._steer = steer
        self._previous: str | None = None
        self._lock = trio.Lock()

    async def __call__(self, call: ToolCallBlock) -> str:
        # Subagents ask through the same callback as their parent, concurrently: one
        # terminal asks one question at a time.
        async with self._lock:
            return await self._ask(call)

    async def _ask(self, call: ToolCallBlock) -> str:
        # Let the renderer print the call (and the previous decision) first, so the
        # question follows them. Bounded: a renderer that never shows them must not stall
        # approval.
        with trio.move_on_after(1.0):
            if self._previous is not None:
                await self._renderer.wait_shown(f"decision:{self._previous}")
            await self._renderer.wait_shown(f"call:{call.id}")
        self._previous = call.id
        question = (
            f"Allow {call.name} {arguments_text(call, 200)}? "
            "[y]es / [n]o / [a]lways for this session: "
        )
        try:
            while True:
                answer = await self._renderer.ask(question, self._read_answer)
                if isinstance(answer, Interrupted):
                    self._renderer.decided_here(call.id, INTERRUPTED_APPROVAL)
                    return "deny"
                if answer is None:
                    self._renderer.decided_here(call.id, decision_words("deny", "default"))
                    return "deny"
                choice = answer.strip().lower()
                if choice in ("y", "yes"):
                    return "allow"
                if choice in ("n", "no"):
                    return "deny"
                if choice in ("a", "always"):
                    return "allow_session"
                line, steer = answer.strip(), self._steer
                if steer is not None and line and not line.startswith("/") and steer(line):
                    self._renderer.notice(STEERED_AT_QUESTION)
                self._renderer.notice(APPROVAL_HINT)
        finally:
            self._renderer.question_closed()

    async def answer_question(self, call: ToolCallBlock) -> str | None:
        """``ask_user`` (R-HITL-5): the model's question and its numbered choices as
        notices, then the next line is the answer — a choice by its number or its text;
        anything else gets a hint and the question again. Ctrl-C and end of input give
        no answer (None). Asked in turn with the approval questions."""
        async with self._lock:
            with trio.move_on_after(1.0):  # bounded, as for an approval question
                await self._renderer.wait_shown(f"call:{call.id}")
            question, choices = question_of(call.arguments)
            for line in question_block(question, choices).splitlines():
                self._renderer.notice(line)
            try:
                while True:
                    answer = await self._renderer.ask(ANSWER_PROMPT, self._read_answer)
                    if not isinstance(answer, str):  # Ctrl-C or end of input
                        self._renderer.decided_here(call.id, NOT_ANSWERED)
                        return None
                    chosen = chosen_answer(answer, choices)
                    if chosen is not None:
                        return chosen
                    self._renderer.notice(answer_hint(choices))
            finally:
                self._renderer.question_closed()


# -- events ---------------------------------------------------------------------------


@attrs.frozen
class _Line:
    text: str


@attrs.frozen
class _EndOfInput:
    pass


@attrs.frozen
class _CtrlC:
    pass


class _Compaction:
    """Identifies a running ``/compact`` as the REPL's current work."""


class _Preparing:
    """Input being prepared (an MCP prompt fetched, attachments read); the REPL's current
    work when the line was typed at the prompt. Ctrl-C cancels ``scope``."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()


_Work = RunStream | _Compaction | _Preparing


@attrs.frozen
class _WorkDone:
    work: _Work


@attrs.frozen(eq=False)
class _Prepared:
    """A preparation has ended: ``content`` to send (as a line, or with ``/follow``),
    or None when nothing is to be sent."""

    token: _Preparing
    follow: bool
    content: tuple[UserContent, ...] | None


_Event = _Line | _EndOfInput | _CtrlC | _WorkDone | _Prepared


# -- the REPL -----------------------------------------------------------------------------


class Chat:
    """The REPL on one session; see the module docstring. :meth:`run` returns the exit
    code when the user leaves."""

    def __init__(
        self,
        session: Session,
        renderer: ChatRenderer,
        *,
        approve: str,
        fd: int,
        screen: TerminalScreen | None = None,
        resume_hint: str | None = None,
        data_dir: Path | None = None,
    ) -> None:
        self._session = session
        self._data_dir = data_dir or default_data_dir()
        self._renderer = renderer
        self._fd = fd
        self._screen = screen
        # A terminal in its usual (cooked) mode echoes typed lines and "^C" itself.
        self._echoes = screen is None and os.isatty(fd)
        self._interactive = screen is not None or self._echoes
        self._wanted = trio.Event()  # piped input: a prompt or a question wants a line
        self._router = LineRouter(on_ask=self._want_line)
        self._approve: ApproveFn | None = (
            # Piped lines are read one per question: none of them is typed "meanwhile".
            ChatApprover(
                renderer, self._router.ask, steer=session.steer if self._interactive else None
            )
            if approve == "ask"
            else approver_for(approve, renderer)
        )
        # Unbounded: the prompt's thread, the signal handler and finished work post with
        # send_nowait and must never block; a person types a line at a time.
        self._send, self._events = trio.open_memory_channel[_Event](math.inf)
        self._nursery: trio.Nursery | None = None
        self._work: _Work | None = None
        self._interrupting = False
        self._ctrl_c_at_prompt = False
        self._leaving = False
        self._next_prompt: list[UserContent] = []
        self._preparing: set[_Preparing] = set()
        self._resume_hint = resume_hint

    async def run(self) -> int:
        """Run the REPL until the user leaves or input ends; returns the exit code. The resume
        hint, if any, is printed last, after the screen has let go of the terminal."""
        code = EXIT_OK
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self._screen is not None:
                    await stack.enter_async_context(self._screen.open(self._send.send_nowait))
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await nursery.start(self._watch_sigint)
                    if self._screen is None:
                        nursery.start_soon(self._read_lines)
                    nursery.start_soon(self._renderer.run_ticker)
                    self._renderer.notice(
                        "greenroom chat · Enter starts a task · typing while it runs steers "
                        "it · Ctrl-C interrupts · /help"
                    )
                    self._show_prompt()
                    async for event in self._events:
                        result = self._handle(event)
                        if result is not None:
                            code = result
                            break
                    nursery.cancel_scope.cancel()
        finally:
            if self._resume_hint is not None:
                # After the screen has let go of the terminal: the last words on it.
                print_error(f"to resume: {self._resume_hint}")
        return code

    # event sources

    async def _read_lines(self) -> None:
        reader = LineReader(self._fd)
        while True:
            if not self._echoes:  # not a terminal: one line per prompt or question
                await self._wanted.wait()
                self._wanted = trio.Event()
            # Abandoned on exit: the thread stays blocked in os.read, holding no lock.
            line = await trio.to_thread.run_sync(reader.readline, abandon_on_cancel=True)
            if line is None:
                self._send.send_nowait(_EndOfInput())
                return
            self._send.send_nowait(_Line(line))

    async def _watch_sigint(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # On a TerminalScreen Ctrl-C is a key (the terminal is in raw mode); SIGINT still
        # comes from pipes, `kill -INT` and the instants between two prompts.
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                self._send.send_nowait(_CtrlC())

    async def _consume(self, stream: RunStream) -> None:
        try:
            async for output in stream:
                self._renderer.show(output)
                if isinstance(output, TaskEnd) and output.origin is None:
                    self._renderer.summary(output, self._session.trace_path)
        finally:
            self._send.send_nowait(_WorkDone(stream))

    async def _compact(self, token: _Compaction) -> None:
        compact = getattr(self._session, "compact", None)
        assert compact is not None
        # The compaction's outputs (compaction_begin/end, retries) reach subscribers.
        unsubscribe = self._session.subscribe(self._show_batch)
        try:
            end = await compact()
        except GreenroomError as exc:
            self._renderer.notice(f"[compact] {exc}")
        else:
            if end is None:
                self._renderer.notice("[compact] nothing was compacted")
        finally:
            unsubscribe()
            self._send.send_nowait(_WorkDone(token))

    async def _prepare_input(self, text: str, token: _Preparing, follow: bool) -> None:
        content: tuple[UserContent, ...] | None = None
        with token.scope:
            try:
                content = await self._expanded(text)
            except (PromptCommandError, AttachmentError) as exc:
                self._renderer.notice(f"[not sent] {exc}")
        if token.scope.cancelled_caught:
            self._renderer.notice("[stopped: nothing was sent]")
        self._send.send_nowait(_Prepared(token, follow, content))

    async def _expanded(self, text: str) -> tuple[UserContent, ...]:
        session = self._session
        prompt = await expand_prompt_command(text, session.mcp)
        if prompt is not None:
            self._renderer.notice(f"[MCP prompt] {_clip_line(prompt)}")
            return (TextBlock(text=prompt),)
        blocks = await attach_to_input([TextBlock(text=text)], session.tools)
        for block in blocks[1:]:
            source = _ATTACHED.match(block.text) if isinstance(block, TextBlock) else None
            if source is not None:
                self._renderer.notice(f"[attached {source.group(1)}]")
        return tuple(blocks)

    def _show_batch(self, batch: list[Output]) -> None:
        for output in batch:
            self._renderer.show(output)

    # event handling: returns the exit code when the REPL should end

    def _handle(self, event: _Event) -> int | None:
        if isinstance(event, _Line):
            return self._on_line(event.text)
        if isinstance(event, _CtrlC):
            return self._on_ctrl_c()
        if isinstance(event, _EndOfInput):
            return self._on_end_of_input()
        if isinstance(event, _Prepared):
            return self._on_prepared(event)
        return self._on_work_done(event.work)

    def _on_line(self, text: str) -> int | None:
        self._ctrl_c_at_prompt = False
        if self._echoes:
            self._renderer.input_echoed()
        if self._router.answer(text):
            return None
        line = text.strip()
        if self._work is None and not self._interactive and line:
            self._renderer.echo(line)  # piped input: show what "was typed"
        if line.startswith("/"):
            return self._command(line)
        if not line:
            if self._work is None:
                self._show_prompt()
        elif has_attachments(line, self._session.tools):
            self._prepare(line, follow=False)
        else:
            self._deliver(line)
        return None

    def _deliver(self, content: str | tuple[UserContent, ...]) -> None:
        """A line ready to send: a task at the prompt, else steering for the running one."""
        if self._work is None:
            self._start(content)
        elif isinstance(self._work, _Compaction):
            self._renderer.notice("[compacting: wait for it to end, or Ctrl-C to stop it]")
        elif isinstance(self._work, _Preparing):
            self._queue_next(content, "[this runs after the input being prepared]")
        elif self._session.steer(content):
            self._renderer.notice("[steering queued]")
        else:
            self._queue_next(content)

    def _on_ctrl_c(self) -> int | None:
        if self._router.answer(INTERRUPTED):
            return None  # Ctrl-C at an approval question denies that call
        if self._work is not None:
            if self._interrupting:
                raise KeyboardInterrupt  # leave now, without waiting for the task's end
            self._interrupting = True
            self._stop_preparing()
            self._session.interrupt("interrupted by user (Ctrl-C)")
            # After the terminal's "^C" echo, on a line of its own.
            self._renderer.notice(
                ("\n" if self._echoes else "") + "[interrupting… Ctrl-C again to quit at once]"
            )
            return None
        if self._ctrl_c_at_prompt:
            self._renderer.notice("")
            return EXIT_OK
        self._ctrl_c_at_prompt = True
        self._renderer.notice(
            ("\n" if self._echoes else "") + "(Ctrl-C again, Ctrl-D or /quit to leave)"
        )
        self._show_prompt()
        return None

    def _on_end_of_input(self) -> int | None:
        self._router.close()  # open and later approval questions are denied
        if self._work is None:
            self._renderer.notice("")
            return EXIT_OK
        self._leaving = True
        self._renderer.leaving()
        self._renderer.notice("[end of input: leaving when the task ends; Ctrl-C stops it]")
        return None

    def _on_work_done(self, work: _Work) -> int | None:
        if work is not self._work:
            return None
        self._work = None
        self._interrupting = False
        if self._leaving:
            return EXIT_OK
        self._idle()
        return None

    def _on_prepared(self, event: _Prepared) -> int | None:
        self._preparing.discard(event.token)
        was_work = event.token is self._work
        if was_work:
            self._work = None
            self._interrupting = False
            if self._leaving:
                return EXIT_OK
        if event.content is not None and event.follow:
            self._follow_content(event.content)
        elif event.content is not None:
            self._deliver(event.content)
        if was_work and self._work is None:
            self._idle()
        return None

    def _idle(self) -> None:
        """Nothing runs: start what was queued meanwhile, else show the prompt."""
        if self._next_prompt:
            prompt, self._next_prompt = tuple(self._next_prompt), []
            self._start(prompt)
        else:
            self._show_prompt()

    # commands

    def _command(self, line: str) -> int | None:
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        if name == "/quit":
            if self._work is None:
                return EXIT_OK
            self._leaving = True
            self._interrupting = True
            self._stop_preparing()
            self._session.interrupt("the user left the chat")
            self._renderer.leaving()
            self._renderer.notice("[leaving: interrupting the task…]")
            return None
        if name == "/follow":
            self._follow(argument)
        elif name == "/retry":
            self._retry()
        elif name == "/compact":
            self._start_compaction()
        elif name == "/help":
            self._renderer.notice(HELP)
            mcp = mcp_help(self._session.mcp)
            if mcp is not None:
                self._renderer.notice(mcp)
        elif parse_prompt_command(line) is not None:
            self._prepare(line, follow=False)
        else:
            self._renderer.notice(f"unknown command {name}; /help lists the commands")
        if self._work is None:
            self._show_prompt()
        return None

    def _follow(self, text: str) -> None:
        if not text:
            self._renderer.notice("usage: /follow TEXT")
        elif parse_prompt_command(text) is not None or has_attachments(text, self._session.tools):
            self._prepare(text, follow=True)
        else:
            self._follow_content(text)

    def _follow_content(self, content: str | tuple[UserContent, ...]) -> None:
        if self._work is None:
            self._start(content)
        elif isinstance(self._work, _Compaction):
            self._renderer.notice("[compacting: wait for it to end, or Ctrl-C to stop it]")
        elif isinstance(self._work, _Preparing):
            self._queue_next(content, "[this runs after the input being prepared]")
        elif self._session.follow_up(content, approve=self._approve):
            self._renderer.notice("[follow-up queued]")
        else:
            self._queue_next(content)

    def _prepare(self, text: str, *, follow: bool) -> None:
        """Prepare ``text`` (an MCP prompt command, attachments) in a task of its own;
        at the prompt that is the REPL's work until it is ready."""
        if isinstance(self._work, _Compaction):
            self._renderer.notice("[compacting: wait for it to end, or Ctrl-C to stop it]")
            return
        token = _Preparing()
        self._preparing.add(token)
        if self._work is None:
            self._work = token
            self._interrupting = False
            self._renderer.working()
        assert self._nursery is not None
        self._nursery.start_soon(self._prepare_input, text, token, follow)

    def _stop_preparing(self) -> None:
        for token in self._preparing:
            token.scope.cancel()

    def _retry(self) -> None:
        if self._work is None:
            self._renderer.notice("[retry] no task is running")
            return
        waiting = self._renderer.skip_retry_wait()
        self._session.skip_reconnect_wait()  # harmless when no backoff is in progress
        if waiting:
            self._renderer.notice("[retry] wait skipped: the next attempt starts now")
        else:
            self._renderer.notice("[retry] no reconnect wait in progress")

    def _start_compaction(self) -> None:
        session = self._session
        if getattr(session, "compact", None) is None:
            self._renderer.notice("[compact] compaction is not available in this version")
            return
        if self._work is not None:
            self._renderer.notice("[compact] a task is running: compact when it has ended")
            return
        state = session.compactability()
        if state != "ok":
            self._renderer.notice(f"[compact] nothing to do: {_COMPACTABILITY_TEXT[state]}")
            return
        token = _Compaction()
        self._work = token
        self._interrupting = False
        self._renderer.working()
        assert self._nursery is not None
        self._nursery.start_soon(self._compact, token)

    # helpers

    def _start(self, text: str | tuple[UserContent, ...]) -> None:
        try:
            stream = self._session.run(text, approve=self._approve)
        except GreenroomError as exc:  # Busy (a task waits for a person), AuthLocked, …
            self._renderer.notice(refusal_words(exc, self._session.id, self._data_dir))
            self._show_prompt()
            return
        self._work = stream
        self._interrupting = False
        self._renderer.working()
        assert self._nursery is not None
        self._nursery.start_soon(self._consume, stream)

    def _queue_next(
        self,
        content: str | tuple[UserContent, ...],
        notice: str = "[the task has just ended: this starts the next one]",
    ) -> None:
        """``content`` cannot go to a running task: run it as soon as the REPL is idle."""
        self._next_prompt += [TextBlock(text=content)] if isinstance(content, str) else content
        self._renderer.notice(notice)

    def _show_prompt(self) -> None:
        if not self._leaving:
            self._renderer.prompt(PROMPT)
            self._want_line()

    def _want_line(self) -> None:
        self._wanted.set()


# -- the terminal ---------------------------------------------------------------------------


class _ScreenStream(io.TextIOBase):
    """One of the chat's output streams on a :class:`TerminalScreen`."""

    def __init__(self, screen: TerminalScreen, target: TextIO) -> None:
        super().__init__()
        self._screen = screen
        self._target = target

    def write(self, text: str) -> int:
        self._screen.write(self._target, text)
        return len(text)

    def flush(self) -> None:
        """Writes are queued for the screen's thread, which flushes the real stream."""

    def isatty(self) -> bool:
        return _is_terminal(self._target)

    def writable(self) -> bool:
        return True


_Chunk = tuple[TextIO, str]


class TerminalScreen:
    """The chat's terminal, shared by output and input through prompt_toolkit.

    The bottom of the terminal is prompt_toolkit's: the line still being written (the
    model's unfinished sentence), the live status line (the retry countdown) and the input
    line, whose label is the prompt (``you>``, ``steer>``) or an open approval question.
    Finished output lines are printed above it: the bottom is erased, the lines are written,
    the bottom is drawn again below them. The terminal stays in raw mode the whole time, so
    it never echoes a key by itself and Ctrl-C is a key, not a signal.

    prompt_toolkit runs its asyncio loop in a thread of its own (:meth:`open`); everything
    else stays in trio. From trio, :meth:`write`, :meth:`set_label`, :meth:`set_question`
    and :meth:`set_status` are thread-safe and never block; keys come back as events
    through the ``deliver`` callback, called in the trio thread.
    """

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = cast(TextIO, _ScreenStream(self, out))
        self.err = cast(TextIO, _ScreenStream(self, err))
        self._err = err
        self._lock = threading.Lock()  # guards the fields below, shared by both threads
        self._ready: list[_Chunk] = []  # finished lines, to print above the bottom area
        self._open: list[_Chunk] = []  # the unfinished line, shown in the bottom area
        self._status: str | None = None
        self._label = ""
        self._question: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._redraw_whole = False
        # Set before the screen's thread starts, then read there.
        self._deliver: Callable[[_Event], None] | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        # The screen's thread's own.
        self._app: Application[None] | None = None
        self._stopping: asyncio.Event | None = None
        self._reading = True

    # -- lifetime (trio side)

    @contextlib.asynccontextmanager
    async def open(self, deliver: Callable[[_Event], None]) -> AsyncIterator[TerminalScreen]:
        """Run the screen's thread for the duration of the block; ``deliver`` gets typed
        lines, Ctrl-C and end of input. On exit the input line is erased, the terminal is
        given back in its usual mode, and output goes straight to the streams again."""
        self._deliver = deliver
        self._trio_token = trio.lowlevel.current_trio_token()
        started = threading.Event()
        thread = threading.Thread(
            target=self._thread_main, args=(started,), name="greenroom-chat-terminal", daemon=True
        )
        thread.start()
        await trio.to_thread.run_sync(started.wait)
        try:
            yield self
        finally:
            with self._lock:
                loop = self._loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # its loop has just closed by itself
                    loop.call_soon_threadsafe(self._stop)
            with trio.CancelScope(shield=True):
                # Bounded: a wedged terminal must not keep the process from ending.
                await trio.to_thread.run_sync(thread.join, 5.0)

    # -- output (any thread)

    def write(self, target: TextIO, text: str) -> None:
        """Queue ``text`` for ``target``: finished lines are printed above the bottom area,
        an unfinished one is shown in it until its end arrives."""
        if not text:
            return
        with self._lock:
            if self._loop is None:
                target.write(text)
                target.flush()
                return
            if "\n" in text:
                # This stream's unfinished line ends here; another stream's (the model's
                # sentence on stdout, while a notice goes to stderr) stays unfinished.
                head, tail = text.rsplit("\n", 1)
                self._ready.extend(chunk for chunk in self._open if chunk[0] is target)
                self._ready.append((target, head + "\n"))
                self._open = [chunk for chunk in self._open if chunk[0] is not target]
                if tail:
                    self._open.append((target, tail))
            else:
                self._open.append((target, text))
            self._schedule_locked()

    def set_label(self, label: str) -> None:
        """The input line's label: the prompt."""
        with self._lock:
            self._label = label
            self._redraw_whole = True  # a new prompt is written whole, not as a diff
            self._schedule_locked()

    def set_question(self, question: str | None) -> None:
        """An approval question shown as the input line's label (None: the prompt again)."""
        with self._lock:
            self._question = question
            self._redraw_whole = True
            self._schedule_locked()

    def set_status(self, status: str | None) -> None:
        """The live line just above the input line (None: no such line)."""
        with self._lock:
            self._status = status
            self._schedule_locked()

    def _schedule_locked(self) -> None:
        if self._loop is not None and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon_threadsafe(self._refresh)

    # -- the screen's thread

    def _thread_main(self, started: threading.Event) -> None:
        try:
            asyncio.run(self._serve(started))
        finally:
            started.set()
            with self._lock:
                self._loop = None
                chunks, self._ready, self._open = self._ready + self._open, [], []
            self._write_chunks(chunks)

    async def _serve(self, started: threading.Event) -> None:
        self._stopping = asyncio.Event()
        session: PromptSession[str] = PromptSession(
            message=self._message,
            key_bindings=self._key_bindings(),
            output=create_output(stdout=self._err),
            erase_when_done=True,
            reserve_space_for_menu=0,
        )
        self._app = cast(Application[None], session.app)
        with self._lock:
            self._loop = asyncio.get_running_loop()
        started.set()
        prompt = asyncio.ensure_future(session.prompt_async(handle_sigint=False))
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait([prompt, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if prompt.done():
            # The input line ended by itself (the terminal went away): that is the end of
            # input, or the chat would wait for keys that can no longer come.
            failure = None if prompt.cancelled() else prompt.exception()
            if failure is not None:
                print_error(f"greenroom chat: the terminal failed: {failure!r}")
            self._send(_EndOfInput())
            return
        if self._app.is_running:
            self._app.exit()
        else:
            prompt.cancel()
        await asyncio.wait([prompt])

    def _stop(self) -> None:
        assert self._stopping is not None
        self._stopping.set()

    def _refresh(self) -> None:
        with self._lock:
            self._scheduled = False
            chunks, self._ready = self._ready, []
            whole, self._redraw_whole = self._redraw_whole, False
        app = self._app
        live = app is not None and app.is_running and not app.is_done
        if (chunks or whole) and live:
            assert app is not None
            # The bottom area goes and the cursor is back where it began; the next render
            # draws all of it again, below what is printed now.
            app.renderer.erase()
        self._write_chunks(chunks)
        if live:
            assert app is not None
            app.invalidate()

    @staticmethod
    def _write_chunks(chunks: list[_Chunk]) -> None:
        for target, text in chunks:
            target.write(text)
            target.flush()

    def _message(self) -> ANSI:
        with self._lock:
            unfinished = "".join(text for _, text in self._open)
            status = self._status
            label = self._question if self._question is not None else self._label
        lines = [line for line in (unfinished, status) if line]
        return ANSI("".join(line + "\n" for line in lines) + label)

    def _send(self, event: _Event) -> None:
        assert self._trio_token is not None and self._deliver is not None
        with contextlib.suppress(trio.RunFinishedError):  # the chat has ended already
            self._trio_token.run_sync_soon(self._deliver, event)

    def _key_bindings(self) -> KeyBindings:
        bindings = KeyBindings()

        @bindings.add("enter")
        def _enter(event: KeyPressEvent) -> None:
            if not self._reading:
                return
            buffer = event.current_buffer
            text = buffer.text
            buffer.reset(append_to_history=bool(text.strip()))
            with self._lock:
                label = self._question if self._question is not None else self._label
                # What was typed stays on the screen, after the lines printed before it
                # and above the model's unfinished line, which goes on below it.
                self._ready.append((self._err, label + text + "\n"))
            self._refresh()
            self._send(_Line(text))

        @bindings.add("c-c")
        def _ctrl_c(event: KeyPressEvent) -> None:
            event.current_buffer.reset()
            self._send(_CtrlC())

        @bindings.add("c-d")
        def _ctrl_d(event: KeyPressEvent) -> None:
            buffer = event.current_buffer
            if buffer.text:
                buffer.delete()  # as in a shell: end of input only on an empty line
            elif self._reading:
                self._reading = False
                self._send(_EndOfInput())

        return bindings


# -- rendering ----------------------------------------------------------------------------


@attrs.define
class _RetryWait:
    attempt: int
    deadline: float
    reason: str


class ChatRenderer(HumanRenderer):
    """The renderer of ``greenroom run`` plus what a REPL needs: the prompt, approval
    questions, notices on stderr, the per-task summary line, the recap of a resumed
    session, approval decisions in the words of
    :mod:`greenroom.protocols.wording`, and the live ``[retry]`` countdown line (redrawn
    in place by :meth:`run_ticker` when stderr is a terminal). With a ``screen`` it writes
    through that :class:`TerminalScreen` (``out`` and ``err`` are where the screen prints).
    ``input_echoes``: whether the input shows typed answers itself (default: stdin is a
    terminal); when it does not, the renderer shows each answer after its question."""

    def __init__(
        self,
        out: TextIO,
        err: TextIO,
        *,
        tools: Sequence[Tool] = (),
        live: bool | None = None,
        screen: TerminalScreen | None = None,
        input_echoes: bool | None = None,
    ) -> None:
        if screen is not None:
            out, err = screen.out, screen.err
        super().__init__(out, err, tools=tools)
        self._screen = screen
        # Whether the terminal shows what is typed: piped answers are shown by us instead.
        self._input_echoes = _is_terminal(sys.stdin) if input_echoes is None else input_echoes
        self._live = err.isatty() if live is None else live
        self._retry: _RetryWait | None = None
        self._retry_line_open = False
        self._wake = trio.Event()
        self._decided_here: dict[str, str] = {}

    def show(self, output: Output) -> None:
        """Show one output as ``greenroom run`` does, plus the REPL's own: a failed request that
        will be retried starts the live ``[retry]`` line instead of a line of its own."""
        if output.origin is None and not isinstance(output, PartialText):
            self.release_held_text()  # before the early returns below: the attempt ended
        match output:
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                pass  # the most frequent outputs, tested first: nothing of the REPL's own
            case RequestEnd(origin=None) if (
                output.retry_in_ms is not None and output.status not in ("ok", "aborted")
            ):
                self._begin_retry(output)
                return
            case RequestBegin(origin=None) if output.attempt > 1 and self._retry:
                return  # the live line announces this attempt already
            case TaskStart(origin=None):
                self._after_tool = False  # a new task: no gap after the last one's tools
            case (
                RequestEnd()
                | RequestBegin()
                | TaskStart()
                | UserMsg()
                | ModelMsg()
                | TokenUsageOutput()
                | ApprovalRequest()
                | ApprovalDecision()
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
                pass  # nothing of the REPL's own: shown as ``greenroom run`` shows it
            case _:
                assert_never(output)
        self._end_retry()
        super().show(output)

    # REPL lines

    def prompt(self, text: str) -> None:
        """Show the prompt ``text``: the screen's label, or on stderr without a newline."""
        self._end_retry()
        self.break_line()
        if self._screen is not None:
            self._screen.set_label(text)
            return
        self._err.write(text)
        self._err.flush()

    def working(self) -> None:
        """Work has started: on a terminal the prompt becomes :data:`WORKING_PROMPT`."""
        if self._screen is not None:
            self._screen.set_label(WORKING_PROMPT)

    def leaving(self) -> None:
        """The chat ends with the current work: no prompt any more."""
        if self._screen is not None:
            self._screen.set_label("")

    async def ask(self, question: str, read_answer: ReadAnswer) -> Answer:
        """Show an approval question and wait for its answer (see :class:`ChatApprover`)."""
        self.break_line()
        if self._screen is not None:
            self._screen.set_question(question)
            answer: Answer = await read_answer()
            return answer
        self._end_retry()
        self._err.write(question)
        self._err.flush()
        answer = await read_answer()
        if isinstance(answer, str) and not self._input_echoes:
            # Piped answers are not echoed by a terminal: show them, one per question.
            self._err.write(answer + "\n")
        elif not isinstance(answer, str):
            self._err.write("\n")  # end the question's line
        self._err.flush()
        return answer

    def question_closed(self) -> None:
        """The approval question is over (answered or cancelled): the screen stops showing it."""
        if self._screen is not None:
            self._screen.set_question(None)

    def decided_here(self, call_id: str, words: str) -> None:
        """The question was not answered by a choice (Ctrl-C, end of input): show the
        call's decision in these words instead of the decision's own."""
        self._decided_here[call_id] = words

    def notice(self, text: str) -> None:
        """A line on stderr; a live retry line stays below it. On a screen the model's
        unfinished line stays unfinished below it, and goes on whole."""
        if self._retry_line_open:
            self._err.write("\r\x1b[K")
            self._retry_line_open = False
        elif self._screen is None:
            self.break_line()
        self._err.write(self._err_style.cyan(text) + "\n" if text else "\n")
        self._err.flush()
        if self._retry is not None and self._live and self._screen is None:
            self._draw_retry()

    def echo(self, line: str) -> None:
        """Show a line that came from a pipe (a terminal has echoed it already)."""
        self._err.write(line + "\n")
        self._err.flush()

    def input_echoed(self) -> None:
        """The terminal echoed a typed line and its newline: the cursor is at the start of
        a line, so nothing written before needs ending."""
        self._line_open = False
        if self._retry_line_open:
            self._retry_line_open = False

    def summary(self, end: TaskEnd, trace_path: Path | None) -> None:
        """The task's closing line on stderr (see :func:`summary_line`)."""
        self._note(summary_line(end, trace_path, color=color_enabled(self._err)))

    def recap(self, prompt: str, reply: str) -> None:
        """The last exchange of a resumed session, clipped to one line each."""
        dim = self._err_style.dim
        self._note(dim("last exchange:"))
        self._note(dim(f"  you: {_clip_line(prompt)}"))
        self._note(dim(f"  model: {_clip_line(reply) if reply else '(no reply)'}"))

    def _note(self, text: str) -> None:
        # The screen prints finished stderr lines above the model's unfinished line, which
        # stays unfinished; elsewhere the two streams share one line and it must end first.
        if self._screen is None:
            self.break_line()
        self._err.write(text + "\n")
        self._err.flush()

    def _show_decision(self, output: ApprovalDecision) -> None:
        here = self._decided_here.pop(output.call_id, None)
        if self.show_question_decision(output, here):
            return
        words = here or self.decision_text(output)
        if output.decision == "deny":
            hint = " (start the chat with --approve ask or all)" if output.by == "default" else ""
            self._line(
                f"  {self._style.red('✗')} {output.tool} {self._style.red(words)}"
                + self._style.dim(hint)
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

    # the live retry line

    @property
    def retry_waiting(self) -> bool:
        """Whether a reconnect wait is being counted down."""
        return self._retry is not None and self._retry.deadline > trio.current_time()

    def skip_retry_wait(self) -> bool:
        """End the countdown (``/retry``); False when none was running."""
        if not self.retry_waiting:
            return False
        assert self._retry is not None
        self._retry.deadline = trio.current_time()
        if self._live:
            self._draw_retry()
        return True

    async def run_ticker(self) -> None:
        """Redraw the live retry line every :data:`TICK_S` while a wait runs."""
        while True:
            if self._retry is None or not self._live:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            self._draw_retry()
            await trio.sleep(TICK_S)

    def _begin_retry(self, output: RequestEnd) -> None:
        self._end_retry()
        assert output.retry_in_ms is not None
        reason = " ".join((output.error_message or output.status).split())
        self._retry = _RetryWait(
            attempt=output.attempt + 1,
            deadline=trio.current_time() + output.retry_in_ms / 1000,
            reason=reason if len(reason) <= 80 else reason[:79] + "…",
        )
        self.break_line()
        if self._live:
            self._draw_retry()
            self._wake.set()
        else:
            self._err.write(self._retry_text() + "\n")
            self._err.flush()

    def _retry_text(self) -> str:
        assert self._retry is not None
        remaining = max(0.0, self._retry.deadline - trio.current_time())
        return self._err_style.yellow(
            f"[retry] attempt {self._retry.attempt}/{MAX_RETRIES + 1} in {remaining:.1f} s"
            f" — {self._retry.reason}"
        )

    def _draw_retry(self) -> None:
        if self._screen is not None:
            self._screen.set_status(self._retry_text())
            return
        self._err.write("\r" + self._retry_text() + "\x1b[K")
        self._err.flush()
        self._retry_line_open = True

    def _end_retry(self) -> None:
        if self._screen is not None and self._retry is not None and self._live:
            # The last state of the live line stays on the screen, as on a plain terminal.
            self._screen.set_status(None)
            self._err.write(self._retry_text() + "\n")
        if self._retry_line_open:
            self._err.write("\n")
            self._err.flush()
            self._retry_line_open = False
        self._retry = None
