"""``greenroom chat``: an interactive terminal on one session.

::

    greenroom chat [--session ID] [the provider, model, workspace, data-dir, approve,
                                   tools and limit flags of ``greenroom run``]

One session (new, or continued with ``--session``), many tasks. What a typed line does
depends on the moment:

* at the prompt (``you>``, no task running) a line starts a task (``Session.run``); its
  outputs stream through the renderer of ``greenroom run`` (text on stdout, bookkeeping on
  stderr) and a summary line closes it;
* while a task runs, a line is **steering** (``Session.steer``): it is acknowledged at once
  with ``[steering queued]`` and reaches the model at the next input assembly, where the
  renderer shows it as ``[steering] TEXT``; a line typed just as the task ended starts the
  next task instead;
* while a tool-call approval question is open (``--approve ask``) the next line answers it
  (y / n / a), whatever else is going on.

Commands: ``/follow TEXT`` queues a whole task after the running one (``follow_up``; at
the prompt it just runs), ``/compact`` compacts the context now (``Session.compact``, at the
prompt only; it says so when the session cannot compact), ``/retry`` ends a reconnect
backoff early (``skip_reconnect_wait``) and says whether a wait was skipped, ``/help``,
``/quit``.

Keys: Ctrl-C while a task (or a compaction) runs interrupts it — it ends ``aborted``, its
carry-over is kept for the next task, and the prompt returns; a second Ctrl-C before it has
ended leaves at once (exit 130). Ctrl-C at the prompt asks for confirmation: a second one in
a row leaves. Ctrl-D (end of input) leaves at the prompt; during a task it leaves once the
task has ended (Ctrl-C first to stop it sooner). ``/quit`` during a task interrupts it,
then leaves. Leaving this way exits 0; usage errors exit 2.

A failed model request that will be retried shows one live line on stderr that counts down
in place on a terminal: ``[retry] attempt 2/6 in 0.4 s — overloaded`` (once, without the
countdown, when stderr is not a terminal). It ends when the next attempt produces output.

Input is read in one place: a worker thread reads stdin lines (``os.read``, never the
``sys.stdin`` buffer) and a trio task routes them — to a pending approval question first,
else to the REPL — so approvals and steering never race for the terminal. Signals, lines
and the end of each task arrive as events on one channel and are handled one at a time.
When stdin is not a terminal (a pipe, a file) nothing is typed "while" a task runs: a
line is read only for the prompt or an approval question, so ``printf 'task one\ntask
two\n' | greenroom chat`` runs the two tasks one after the other, then leaves.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import attrs
import trio

from greenroom.actors.cli import (
    EXIT_ABORTED,
    EXIT_OK,
    EXIT_USAGE,
    HumanRenderer,
    RunOptions,
    _approver,
    _color_enabled,
    _error,
    _LineReader,
    open_reported_session,
    prepare_options,
    run_options,
    summary_line,
)
from greenroom.actors.errors import GreenroomError
from greenroom.actors.host import Host
from greenroom.actors.session import RunStream, Session
from greenroom.protocols.outputs import Output, RequestBegin, RequestEnd, TaskEnd, TaskStart
from greenroom.protocols.retry import MAX_RETRIES
from greenroom.protocols.tools import Tool

__all__ = ["PROMPT", "Chat", "ChatRenderer", "LineRouter", "chat_command"]

PROMPT = "you> "
"""Shown on stderr when no task runs and a line would start one."""

HELP = (
    "Type a task and press Enter. While it runs, what you type steers it; "
    "Ctrl-C interrupts it.\n"
    "  /follow TEXT   run TEXT as a new task after the current one\n"
    "  /compact       compact the session's context now (between tasks)\n"
    "  /retry         skip the wait before the next reconnect attempt\n"
    "  /quit          leave (also Ctrl-D, or Ctrl-C twice at the prompt)"
)

TICK_S = 0.1
"""How often the live retry line is redrawn."""

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
        _error("interrupted")
    return code


async def _chat(options: RunOptions) -> int:
    async with Host.open(data_dir=options.data_dir) as host:
        session = await open_reported_session(host, options)
        if session is None:
            return EXIT_USAGE
        renderer = ChatRenderer(sys.stdout, sys.stderr, tools=session.tools)
        chat = Chat(session, renderer, approve=options.approve, fd=sys.stdin.fileno())
        return await chat.run()


# -- input routing ----------------------------------------------------------------------


class LineRouter:
    """Hands input lines to whoever asked for the next one (an approval question), in
    the order they asked. After :meth:`close` (end of input) every question gets None."""

    def __init__(self, on_ask: Callable[[], None] | None = None) -> None:
        self._waiters: list[trio.MemorySendChannel[str | None]] = []
        self._closed = False
        self._on_ask = on_ask

    @property
    def waiting(self) -> bool:
        return bool(self._waiters)

    async def ask(self) -> str | None:
        """The next line typed, or None at end of input (the approver then denies)."""
        if self._closed:
            return None
        send, receive = trio.open_memory_channel[str | None](1)
        self._waiters.append(send)
        if self._on_ask is not None:
            self._on_ask()
        try:
            return await receive.receive()
        finally:  # also when the question is cancelled (the task was interrupted)
            if send in self._waiters:
                self._waiters.remove(send)

    def answer(self, line: str) -> bool:
        """Give ``line`` to the oldest open question; False when none is open."""
        if not self._waiters:
            return False
        self._waiters.pop(0).send_nowait(line)
        return True

    def close(self) -> None:
        self._closed = True
        while self._waiters:
            self._waiters.pop(0).send_nowait(None)


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


_Work = RunStream | _Compaction


@attrs.frozen
class _WorkDone:
    work: _Work


_Event = _Line | _EndOfInput | _CtrlC | _WorkDone


# -- the REPL -----------------------------------------------------------------------------


class Chat:
    """The REPL on one session; see the module docstring. :meth:`run` returns the exit
    code when the user leaves."""

    def __init__(self, session: Session, renderer: ChatRenderer, *, approve: str, fd: int) -> None:
        self._session = session
        self._renderer = renderer
        self._fd = fd
        self._echoes = os.isatty(fd)
        self._wanted = trio.Event()  # piped input: a prompt or a question wants a line
        self._router = LineRouter(on_ask=self._want_line)
        self._approve = _approver(approve, renderer, read_line=self._router.ask)
        self._send, self._events = trio.open_memory_channel[_Event](math.inf)
        self._nursery: trio.Nursery | None = None
        self._work: _Work | None = None
        self._interrupting = False
        self._ctrl_c_at_prompt = False
        self._leaving = False
        self._next_prompt: str | None = None

    async def run(self) -> int:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self._watch_sigint)
            nursery.start_soon(self._read_lines)
            nursery.start_soon(self._renderer.run_ticker)
            self._renderer.notice(
                "greenroom chat · Enter starts a task · typing while it runs steers it · "
                "Ctrl-C interrupts · /help"
            )
            self._show_prompt()
            code = EXIT_OK
            async for event in self._events:
                result = self._handle(event)
                if result is not None:
                    code = result
                    break
            nursery.cancel_scope.cancel()
        return code

    # event sources

    async def _read_lines(self) -> None:
        reader = _LineReader(self._fd)
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
        return self._on_work_done(event.work)

    def _on_line(self, text: str) -> int | None:
        self._ctrl_c_at_prompt = False
        if self._echoes:
            self._renderer.input_echoed()
        if self._router.answer(text):
            return None
        line = text.strip()
        if self._work is None and not self._echoes and line:
            self._renderer.echo(line)  # piped input: show what "was typed"
        if line.startswith("/"):
            return self._command(line)
        if not line:
            if self._work is None:
                self._show_prompt()
        elif self._work is None:
            self._start(line)
        elif isinstance(self._work, _Compaction):
            self._renderer.notice("[compacting: wait for it to end, or Ctrl-C to stop it]")
        elif self._session.steer(line):
            self._renderer.notice("[steering queued]")
        else:
            self._queue_next(line)
        return None

    def _on_ctrl_c(self) -> int | None:
        if self._work is not None:
            if self._interrupting:
                raise KeyboardInterrupt  # leave now, without waiting for the task's end
            self._interrupting = True
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
        self._renderer.notice("\n(Ctrl-C again, Ctrl-D or /quit to leave)")
        self._show_prompt()
        return None

    def _on_end_of_input(self) -> int | None:
        self._router.close()  # open and later approval questions are denied
        if self._work is None:
            self._renderer.notice("")
            return EXIT_OK
        self._leaving = True
        self._renderer.notice("[end of input: leaving when the task ends; Ctrl-C stops it]")
        return None

    def _on_work_done(self, work: _Work) -> int | None:
        if work is not self._work:
            return None
        self._work = None
        self._interrupting = False
        if self._leaving:
            return EXIT_OK
        if self._next_prompt is not None:
            prompt, self._next_prompt = self._next_prompt, None
            self._start(prompt)
        else:
            self._show_prompt()
        return None

    # commands

    def _command(self, line: str) -> int | None:
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        if name == "/quit":
            if self._work is None:
                return EXIT_OK
            self._leaving = True
            self._interrupting = True
            self._session.interrupt("the user left the chat")
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
        else:
            self._renderer.notice(f"unknown command {name}; /help lists the commands")
        if self._work is None:
            self._show_prompt()
        return None

    def _follow(self, text: str) -> None:
        if not text:
            self._renderer.notice("usage: /follow TEXT")
        elif self._work is None:
            self._start(text)
        elif isinstance(self._work, _Compaction):
            self._renderer.notice("[compacting: wait for it to end, or Ctrl-C to stop it]")
        elif self._session.follow_up(text, approve=self._approve):
            self._renderer.notice("[follow-up queued]")
        else:
            self._queue_next(text)

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
        assert self._nursery is not None
        self._nursery.start_soon(self._compact, token)

    # helpers

    def _start(self, text: str) -> None:
        try:
            stream = self._session.run(text, approve=self._approve)
        except GreenroomError as exc:  # Busy, AuthLocked, SessionClosed
            self._renderer.notice(str(exc))
            self._show_prompt()
            return
        self._work = stream
        self._interrupting = False
        assert self._nursery is not None
        self._nursery.start_soon(self._consume, stream)

    def _queue_next(self, text: str) -> None:
        """The task ended as ``text`` arrived: run it as soon as the REPL is idle."""
        if self._next_prompt is None:
            self._next_prompt = text
        else:
            self._next_prompt += "\n" + text
        self._renderer.notice("[the task has just ended: this starts the next one]")

    def _show_prompt(self) -> None:
        if not self._leaving:
            self._renderer.prompt(PROMPT)
            self._want_line()

    def _want_line(self) -> None:
        self._wanted.set()


# -- rendering ----------------------------------------------------------------------------


@attrs.define
class _RetryWait:
    attempt: int
    deadline: float
    reason: str


class ChatRenderer(HumanRenderer):
    """The renderer of ``greenroom run`` plus what a REPL needs: the prompt, notices on
    stderr, the per-task summary line, and the live ``[retry]`` countdown line (redrawn
    in place by :meth:`run_ticker` when stderr is a terminal)."""

    def __init__(
        self, out: TextIO, err: TextIO, *, tools: Sequence[Tool] = (), live: bool | None = None
    ) -> None:
        super().__init__(out, err, tools=tools)
        self._live = err.isatty() if live is None else live
        self._retry: _RetryWait | None = None
        self._retry_line_open = False
        self._wake = trio.Event()

    def show(self, output: Output) -> None:
        if output.origin is None:
            if (
                isinstance(output, RequestEnd)
                and output.retry_in_ms is not None
                and output.status not in ("ok", "aborted")
            ):
                self._begin_retry(output)
                return
            if isinstance(output, RequestBegin) and output.attempt > 1 and self._retry:
                return  # the live line announces this attempt already
            if isinstance(output, TaskStart):
                self._after_tool = False  # a new task: no gap after the last one's tools
        self._end_retry()
        super().show(output)

    # REPL lines

    def prompt(self, text: str) -> None:
        self._end_retry()
        self.break_line()
        self._err.write(text)
        self._err.flush()

    def notice(self, text: str) -> None:
        """A line on stderr; a live retry line stays below it."""
        if self._retry_line_open:
            self._err.write("\r\x1b[K")
            self._retry_line_open = False
        else:
            self.break_line()
        self._err.write(self._err_style.cyan(text) + "\n" if text else "\n")
        self._err.flush()
        if self._retry is not None and self._live:
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
        self._note(summary_line(end, trace_path, color=_color_enabled(self._err)))

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
        self._err.write("\r" + self._retry_text() + "\x1b[K")
        self._err.flush()
        self._retry_line_open = True

    def _end_retry(self) -> None:
        if self._retry_line_open:
            self._err.write("\n")
            self._err.flush()
            self._retry_line_open = False
        self._retry = None
