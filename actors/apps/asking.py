"""Asking the person at the terminal: approvals of tool calls (``--approve ask|all|none``)
and the model's ``ask_user`` questions, read from stdin without touching stdout."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import trio

from greenroom.actors.apps.exits import MAX_INPUT_BYTES, mib, print_error
from greenroom.actors.apps.parser import ALLOW_ALL_SOURCE
from greenroom.actors.apps.render import Renderer, arguments_text
from greenroom.actors.runtime import (
    ApproveFn,
)
from greenroom.protocols.content import (
    ToolCallBlock,
)
from greenroom.protocols.wording import (
    INTERRUPTED_APPROVAL,
)

MODEL_ASKS = "The model asks"
"""What heads the model's question (``ask_user``)."""

IN_DOUBT_ASKS = "A call is in doubt"
"""What heads the question about a call in doubt (R-EFFECT-2), which the runtime asks."""


# -- approval ---------------------------------------------------------------------------


def _allow_all(call: ToolCallBlock) -> str:
    return "allow"


def approver_for(
    mode: str,
    renderer: Renderer,
    read_line: ReadLine | None = None,
    *,
    allow_all_source: str = ALLOW_ALL_SOURCE,
) -> ApproveFn | None:
    """The approval callback ``--approve MODE`` asks for: allow every call (and have
    ``renderer`` say what allowed it), ask at the terminal, or None (every call denied)."""
    if mode == "all":
        # Nobody is asked: the screen says what allowed the calls (R-APPROVE-1).
        renderer.allowed_without_asking = allow_all_source
        return _allow_all
    if mode == "ask":
        return TerminalApprover(renderer, read_line=read_line)
    return None  # R-APPROVE-2: no callback, every call is denied by default


class LineReader:
    """Lines from stdin read with ``os.read`` on the file descriptor.

    Unlike ``input()`` it never writes to stdout (``--json`` keeps stdout clean) and never
    holds the ``sys.stdin`` buffer lock: a read abandoned by an interrupt leaves a blocked
    worker thread, and one holding that lock would stall interpreter shutdown.
    """

    def __init__(self, fd: int, *, max_bytes: int = MAX_INPUT_BYTES) -> None:
        self._fd = fd
        self._buffer = bytearray()
        self._eof = False
        self._max_bytes = max_bytes

    def readline(self) -> str | None:
        """The next line without its newline, or None at end of input. Blocking. A line
        longer than ``max_bytes`` (a pipe from ``/dev/zero``, a binary file) ends the input,
        said on stderr, rather than being read for ever."""
        end = self._buffer.find(b"\n")
        while end < 0 and not self._eof:
            scanned = len(self._buffer)  # holds no line end
            if scanned > self._max_bytes:
                print_error(
                    f"[input] a line longer than {mib(self._max_bytes)}: "
                    "the rest of the input is not read"
                )
                self._buffer.clear()
                self._eof = True
                break
            chunk = os.read(self._fd, 65536)
            if not chunk:
                self._eof = True
            self._buffer += chunk
            end = self._buffer.find(b"\n", scanned)  # only the new bytes
        if end < 0:
            if not self._buffer:
                return None
            end = len(self._buffer)  # the last line, without a line end
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line.decode("utf-8", errors="replace")


ReadLine = Callable[[], Awaitable[str | None]]
"""Where an approval answer comes from: the next input line, None at end of input."""


class TerminalApprover:
    """``--approve ask``: asks on the terminal, once per call, in call order (the broker
    asks one call at a time). Answers: y(es) → allow, n(o) → deny, a(lways) → allow this
    tool for the rest of the session. End of input denies.

    Answers are read from ``fd`` (stdin) unless ``read_line`` is given: ``greenroom chat``
    reads every line itself and hands the approver the ones that answer it."""

    def __init__(
        self, renderer: Renderer, fd: int | None = None, *, read_line: ReadLine | None = None
    ) -> None:
        self._renderer = renderer
        fd = sys.stdin.fileno() if fd is None else fd
        self._reader = LineReader(fd)
        self._read_line = read_line or self._read_from_fd
        self._echoes = os.isatty(fd)
        self._previous: str | None = None
        self._lock = trio.Lock()
        self._asking: ToolCallBlock | None = None

    async def _read_from_fd(self) -> str | None:
        return await trio.to_thread.run_sync(self._reader.readline, abandon_on_cancel=True)

    async def __call__(self, call: ToolCallBlock, origin: tuple[str, ...] = ()) -> str:
        verdict = await self.ask(call, origin)
        if verdict is None:
            sys.stderr.write("(no answer: denied)\n")
            return "deny"
        return verdict

    async def ask(self, call: ToolCallBlock, origin: tuple[str, ...] = ()) -> str | None:
        """Ask about ``call`` (of the node at ``origin``, when it is a subagent's) and
        return ``allow``, ``deny`` or ``allow_session``; None at end of input (the
        callback denies then; ``greenroom approve`` leaves the call waiting)."""
        # Subagents ask through the same callback as their parent, concurrently: one
        # terminal asks one question at a time.
        async with self._lock:
            return await self._ask(call, origin)

    async def _ask(self, call: ToolCallBlock, origin: tuple[str, ...]) -> str | None:
        # Let the renderer print the call (and the previous decision) first, so the
        # question follows them instead of cutting into them. Bounded: a renderer that
        # never shows them must not stall approval.
        with trio.move_on_after(1.0):
            if self._previous is not None:
                await self._renderer.wait_shown(f"decision:{self._previous}")
            await self._renderer.wait_shown(f"call:{call.id}")
        self._previous = call.id
        self._renderer.break_line()
        who = f"subagent {origin[-1]}: " if len(origin) > 1 else ""
        question = (
            f"{who}Allow {call.name} {arguments_text(call, 200)}? "
            "[y]es / [n]o / [a]lways for this session: "
        )
        self._asking = call
        try:
            return await self._question(question)
        finally:
            # Also when the question is cancelled: Ctrl-C (see interrupt) or the task ending.
            self._asking = None

    async def answer_question(
        self, call: ToolCallBlock, asker: str = MODEL_ASKS
    ) -> str | None:
        """``ask_user`` on the terminal (R-HITL-5): the model's question and its numbered
        choices on stderr, then the next line is the answer — a choice by its number or
        its text; anything else gets a hint and the question again. End of input gives
        no answer (None). One question at a time, among the approval questions.
        ``asker`` heads the question (:data:`IN_DOUBT_ASKS` for a call in doubt)."""
        async with self._lock:
            with trio.move_on_after(1.0):  # bounded, as for an approval question
                await self._renderer.wait_shown(f"call:{call.id}")
            self._renderer.break_line()
            question, choices = question_of(call.arguments)
            sys.stderr.write(question_block(question, choices, asker))
            self._asking = call
            try:
                return await self._answer(choices)
            finally:
                self._asking = None

    async def _answer(self, choices: Sequence[str]) -> str | None:
        while True:
            sys.stderr.write(ANSWER_PROMPT)
            sys.stderr.flush()
            line = await self._read_line()
            if line is not None and not self._echoes:
                sys.stderr.write(line + "\n")
            if line is None:
                sys.stderr.write("(no answer)\n")
                return None
            answer = chosen_answer(line, choices)
            if answer is not None:
                return answer
            sys.stderr.write(answer_hint(choices) + "\n")

    def interrupt(self) -> bool:
        """Ctrl-C: deny the open question on screen (the task's interrupt then resolves
        the call as a deny, R-APPROVE-5). False when no question is open."""
        call = self._asking
        if call is None:
            return False
        self._asking = None
        self._renderer.mark_interrupted(call.id)
        sys.stderr.write(f"\n{INTERRUPTED_APPROVAL}\n")
        sys.stderr.flush()
        return True

    async def _question(self, question: str) -> str | None:
        while True:
            sys.stderr.write(question)
            sys.stderr.flush()
            answer = await self._read_line()
            if answer is not None and not self._echoes:
                # Piped answers are not echoed by a terminal: show them, one per question.
                sys.stderr.write(answer + "\n")
            if answer is None:
                return None
            choice = answer.strip().lower()
            if choice in ("y", "yes"):
                return "allow"
            if choice in ("n", "no"):
                return "deny"
            if choice in ("a", "always"):
                return "allow_session"


ANSWER_PROMPT = "answer: "
"""The prompt of the model's question (``ask_user``) on a terminal."""


def asker_of(kind: str) -> str:
    """What heads a question of ``kind`` (``question`` or ``in_doubt``)."""
    return IN_DOUBT_ASKS if kind == "in_doubt" else MODEL_ASKS


def question_of(arguments: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The question and its choices from ``ask_user``'s arguments, as the person reads
    them (arguments are the model's: anything missing or malformed is shown as such)."""
    question = str(arguments.get("question") or "").strip() or "(no question given)"
    raw = arguments.get("choices")
    choices = [str(choice) for choice in raw] if isinstance(raw, list) else []
    return question, choices


def question_block(question: str, choices: Sequence[str], asker: str = MODEL_ASKS) -> str:
    """The model's question (or ``asker``'s) as a terminal shows it — its own lines
    indented under the first — then one numbered line per choice."""
    lines = [f"{asker}: " + "\n  ".join(question.splitlines())]
    lines.extend(f"  {number}) {choice}" for number, choice in enumerate(choices, 1))
    return "\n".join(lines) + "\n"


def chosen_answer(line: str, choices: Sequence[str]) -> str | None:
    """The answer a typed line gives to a question with ``choices``: the text itself when
    there are no choices; else the choice it names (exactly, or but for case) or numbers
    (from 1). None when it is empty or names no choice."""
    text = line.strip()
    if not text:
        return None
    if not choices or text in choices:
        return text
    folded = [choice for choice in choices if choice.casefold() == text.casefold()]
    if folded:
        return folded[0]
    if text.isdigit() and 1 <= int(text) <= len(choices):
        return choices[int(text) - 1]
    return None


def answer_hint(choices: Sequence[str]) -> str:
    """What a question says to a line that does not answer it, before asking again."""
    if not choices:
        return "type an answer (end of input leaves it unanswered)"
    return f"answer with a number from 1 to {len(choices)} or one of the choices"
