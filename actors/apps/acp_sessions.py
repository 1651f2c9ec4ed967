"""``greenroom acp``: the data dir's sessions listed, and the approval policy as the
session's mode (R-ACP-2).

``session/list`` lists the root sessions of the data dir (subagents belong to their root's
tree), newest first, :data:`~greenroom.protocols.acp.SESSION_PAGE` a page: each with the
``cwd`` it works in, its last activity and its title — the one the gateway gave it
(``title.txt``, R-HOST-5), else its first prompt, read from the start of its first trace
file — never asking the model.

A session's mode is its approval policy (``ask``, ``all``, ``none``: ``--approve``'s
values), held by its :class:`~greenroom.actors.apps.acp_people.Asked`. A task takes
:func:`approval_of` the mode when it starts, and a change applies to the calls decided
after it, in the running task too: a task started under ``ask`` records each call for a
person, and :class:`~greenroom.actors.apps.acp_people.EditorPeople` answers it by the mode
of the moment; a task started under ``all`` or ``none`` decides through
:class:`ModeApproval`, which reads the mode at each call and, set to ``ask`` meanwhile,
asks the editor itself.

A loaded session whose trace leaves work (a task open, a prompt accepted and not started,
follow-ups queued: R-HITL-4, R-CLUSTER-2, R-STEER-6) has it taken up, and
:class:`WatchedWork` reads what that work outputs from the session's watch, task after
task, as a run's own stream would be read.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import trio

from greenroom.actors.apps.acp_people import Asked
from greenroom.actors.runtime import Approval, Host, InputReceipt, SessionStore
from greenroom.protocols import acp
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.outputs import (
    Output,
    SteeringQueuedOutput,
    TaskEnd,
    TaskQueuedOutput,
    TaskQueueDropped,
    UserMsg,
)
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.text import repair_text
from greenroom.protocols.wording import clip_words

__all__ = [
    "FIRST_PROMPT_BYTES",
    "TITLE_CHARS",
    "InputOrder",
    "InputTurn",
    "ModeApproval",
    "WatchedWork",
    "approval_of",
    "list_sessions",
]

TITLE_CHARS = 60
"""The longest title made from a first prompt (cut at a word, with ``…``)."""

FIRST_PROMPT_BYTES = 64 * 1024
"""How much of a session's first trace file is read for its first prompt."""

AskEditor = Callable[[Asked, ToolCallBlock], Awaitable[str]]
"""Ask the editor about a call of a session now (``session/request_permission``), and its
verdict."""


async def list_sessions(host: Host, params: dict[str, Any]) -> dict[str, Any]:
    """``session/list {cwd?, cursor?}`` → ``{sessions, nextCursor?}`` (see the module
    docstring). ``cwd`` keeps the sessions working there (as given, or resolved)."""
    request = acp.parse_list_sessions(params)
    roots = {info.session_id: info for info in (await host.scan_sessions()).sessions
             if info.parent_id is None}  # fmt: skip
    if request.cwd is not None:
        places = {request.cwd, await trio.to_thread.run_sync(os.path.realpath, request.cwd)}
        roots = {sid: info for sid, info in roots.items() if info.workspace_dir in places}
    page, next_cursor = acp.sessions_page(
        ((info.created_at, sid) for sid, info in roots.items()), request.cursor
    )
    titles = await trio.to_thread.run_sync(_titles, host.data_dir, page)
    answer: dict[str, Any] = {
        "sessions": [
            acp.session_info(sid, roots[sid].workspace_dir, title, _iso(roots[sid].updated_at))
            for sid, title in zip(page, titles, strict=True)
        ]
    }
    if next_cursor is not None:
        answer["nextCursor"] = next_cursor
    return answer


def _iso(timestamp: float) -> str | None:
    try:
        return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).isoformat()
    except (OverflowError, OSError, ValueError):
        return None


def _titles(data_dir: Path, session_ids: list[str]) -> list[str]:
    """The title of each session: its ``title.txt``, else its first prompt. Blocking."""
    # Here, not at the top: the gateway package is not loaded for an editor's agent.
    from greenroom.actors.gateway.titles import TITLE_FILE, read_titles

    store = SessionStore(data_dir)
    stored = read_titles([store.session_dir(sid) / TITLE_FILE for sid in session_ids])
    return [
        title or _first_prompt(store.trace_path(sid, 1))
        for sid, title in zip(session_ids, stored, strict=True)
    ]


def _first_prompt(trace: Path) -> str:
    """The text of the first prompt in the first :data:`FIRST_PROMPT_BYTES` of a trace
    file, on one line, cut to :data:`TITLE_CHARS` ("" when there is none)."""
    try:
        # Not waited on: a FIFO in the trace's place opens at once and is not read, nor is
        # a device (R-SEC-1); only a regular file gives a title.
        fd = os.open(trace, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            head = handle.read(FIRST_PROMPT_BYTES)
    except OSError:
        return ""
    for line in head.split(b"\n")[:-1]:  # the last piece may be cut
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("type") != "user_msg":
            continue
        content = record.get("content")
        texts = [
            block["text"]
            for block in (content if isinstance(content, list) else [])
            if isinstance(block, dict) and isinstance(block.get("text"), str)
        ]
        return clip_words(repair_text(" ".join(" ".join(texts).split())), TITLE_CHARS)
    return ""


def approval_of(asked: Asked, ask_editor: AskEditor) -> Approval:
    """How a task started now decides its calls: ``people`` under ``ask`` (each call
    waits in the trace for the editor's answer), a :class:`ModeApproval` otherwise."""
    if asked.mode == "ask":
        return PEOPLE
    return ModeApproval(asked, ask_editor)


class ModeApproval:
    """The approval callback of a task started under ``all`` or ``none``: allows or
    denies each call by the session's mode when it is decided; under ``ask`` (set since
    the task started) it asks the editor, as a callback does — the question lasts as
    long as this process, bounded by the session's ``approval_timeout_s``."""

    def __init__(self, asked: Asked, ask_editor: AskEditor) -> None:
        self._asked = asked
        self._ask_editor = ask_editor

    async def __call__(self, call: ToolCallBlock) -> str:
        """The verdict on ``call``."""
        mode = self._asked.mode
        if mode == "all":
            return "allow"
        if mode == "none":
            return "deny"
        return await self._ask_editor(self._asked, call)


class WatchedWork:
    """The outputs of work no run of the connection reads — what a loaded session's trace
    leaves, taken up (R-HITL-4), or the task a background child's answer started in its
    idle parent (R-TREE-2) — from a watch of the session: its open task — or the task of
    the prompt the trace holds as accepted and not started (R-CLUSTER-2), which is not
    counted as queued even when it is a follow-up's — and then each follow-up queued
    behind it (``follow_ups``, the ids of those the trace holds as queued, and those
    queued meanwhile) until the ``task_end`` after which none is left (R-STEER-6). A
    follow-up or steering the session accepted (:meth:`accepted`) counts from then on
    until its record is read: one accepted while a task's end is written has its
    ``task_queued`` (steering too late for its task is a task of its own: R-STEER-1)
    after that ``task_end``. An async iterator, like the run's own stream."""

    def __init__(
        self, receive: trio.MemoryReceiveChannel[list[Output]], follow_ups: Iterable[str] = ()
    ) -> None:
        self._receive = receive
        self._follow_ups = set(follow_ups)
        self._unrecorded: list[InputReceipt] = []
        """Input accepted whose record (``task_queued``, ``steering_queued``) was not read
        yet, oldest first."""
        self._ended = False
        """The last output read is a ``task_end`` after which nothing was counted."""
        self._batch: list[Output] = []
        self._index = 0

    def receipt(self) -> InputReceipt:
        """The receipt to give ``Session.follow_up`` or ``steer``; :meth:`accepted` once
        it says True."""
        receipt = InputReceipt()
        receipt.on_taken = lambda: self._dropped(receipt) if receipt.dropped else None
        return receipt

    def accepted(self, receipt: InputReceipt) -> None:
        """The session accepted the input of ``receipt``: read on to its record, and to
        the ``task_end`` of the task it is or joins."""
        if receipt.dropped is None:
            self._unrecorded.append(receipt)

    def __aiter__(self) -> WatchedWork:
        return self

    async def __anext__(self) -> Output:
        while self._index >= len(self._batch):
            try:
                self._batch = await self._receive.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise StopAsyncIteration from None
            self._index = 0
        output = self._batch[self._index]
        self._index += 1
        if output.origin is None:  # a subagent's queue is not this session's
            self._follow(output)
        return output

    def _follow(self, output: Output) -> None:
        """Keep count of the follow-ups still to run; stop reading after the last end."""
        queued = self._follow_ups
        self._ended = False
        match output:
            case TaskQueuedOutput():
                queued.add(output.queue_id)
                if self._unrecorded:
                    self._unrecorded.pop(0)
            case SteeringQueuedOutput():
                if self._unrecorded:
                    self._unrecorded.pop(0)
            case TaskQueueDropped():
                queued.difference_update(output.queue_ids)
            case UserMsg() if output.queued_id is not None:
                queued.discard(output.queued_id)
            case TaskEnd():
                if output.status == "auth":
                    queued.clear()  # a locked session runs none of them
                    self._unrecorded.clear()
                if not queued:
                    self._ended = True
                    self._end_if_done()
            case _:
                pass

    def _dropped(self, receipt: InputReceipt) -> None:
        """An accepted follow-up will not run (its session stopped before recording it)."""
        if receipt in self._unrecorded:
            self._unrecorded.remove(receipt)
            self._end_if_done()

    def _end_if_done(self) -> None:
        if self._ended and not self._unrecorded:
            # What follows belongs to later tasks, each read by its own run; the session
            # forgets the watch at its next batch.
            self._batch = []
            self._receive.close()

    def close(self) -> None:
        """Stop reading (the iterator ends)."""
        self._receive.close()


class InputOrder:
    """The order in which the editor sent each session its input — prompts, steering,
    follow-ups (R-STEER-1, R-STEER-6). Requests are answered concurrently, and making one's
    content (an image stored, an MCP prompt expanded) takes its own time, so a follow-up
    sent second could reach the session first and run first. Each such request takes an
    :class:`InputTurn` in its session's line of its kind (prompts and follow-ups one,
    steering another: it is for the task running now, and waits for no prompt that waits
    for that task's end) when it is read, in the order frames arrive, and hands its input
    to the session only in its turn.

    ``session/cancel`` cancels the input read before it (:meth:`cancel`): a turn whose
    request was read before a cancel of its session says so (:attr:`InputTurn.cancelled`),
    and its input is not handed over — the cancel found no task of it to interrupt."""

    def __init__(self) -> None:
        self._lines: dict[tuple[str, str], _Line] = {}
        self._cancels: dict[str, int] = {}

    def turn(self, session_id: str, kind: str) -> InputTurn:
        """The next turn in ``session_id``'s line of ``kind`` (input of one kind keeps its
        order; kinds do not wait for each other)."""
        key = (session_id, kind)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = _Line(lambda: self._lines.pop(key, None))
        line.issued += 1
        cancels = self._cancels.get(session_id, 0)
        return InputTurn(line, line.issued - 1, lambda: self._cancels.get(session_id, 0) != cancels)

    def cancel(self, session_id: str) -> None:
        """``session/cancel`` of ``session_id`` was read: the turns taken before it are
        cancelled."""
        self._cancels[session_id] = self._cancels.get(session_id, 0) + 1


class _Line:
    """One session's turns: ``served`` is the turn whose request may hand its input over."""

    def __init__(self, forget: Callable[[], object]) -> None:
        self.issued = 0
        self.served = 0
        self.finished: set[int] = set()
        self.changed = trio.Event()
        self._forget = forget

    def finish(self, number: int) -> None:
        self.finished.add(number)
        while self.served in self.finished:
            self.finished.discard(self.served)
            self.served += 1
        self.changed.set()
        self.changed = trio.Event()
        if self.served == self.issued:
            self._forget()  # no turn waits: the session's line starts again when one does


class InputTurn:
    """A request's place in its session's :class:`InputOrder`: ``async with`` waits for
    the requests read before it to hand their input over (or fail) and ends the turn on
    leaving; :meth:`end` ends it however the request ends (it may never wait)."""

    def __init__(
        self, line: _Line | None, number: int, cancelled: Callable[[], bool] | None = None
    ) -> None:
        self._line = line
        self._number = number
        self._ended = False
        self._cancelled = cancelled

    @property
    def cancelled(self) -> bool:
        """Whether a ``session/cancel`` of the session was read after this request."""
        return self._cancelled is not None and self._cancelled()

    async def __aenter__(self) -> None:
        await self.wait()

    async def wait(self) -> None:
        """Return once the requests read before this one handed their input over."""
        line = self._line
        while line is not None and line.served != self._number:
            await line.changed.wait()

    async def __aexit__(self, *exc: object) -> None:
        self.end()

    def end(self) -> None:
        """Let the requests read after this one hand their input over (once)."""
        if not self._ended and self._line is not None:
            self._ended = True
            self._line.finish(self._number)
