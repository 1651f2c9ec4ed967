"""Session titles: each session the gateway serves is named once, after its first task.

The title comes from :meth:`Session.generate_title` (R-HOST-5) and is kept in ``title.txt``
next to the session's ``session.json``, never in its trace: a restarted gateway reads it and
asks the model nothing more. A session the model has never answered (its tasks failed: a
bad key, an unreachable provider) cannot be titled by the model either; it is named after
its first prompt instead, so a failed session is still recognisable in a list.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import trio

from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import AssistantMessage, UserMessage
from greenroom.protocols.text import repair_text
from greenroom.protocols.wording import clip_words

logger = logging.getLogger(__name__)

TITLE_FILE = "title.txt"
"""A session's generated title, next to its ``session.json`` (never in its trace)."""

TITLE_CHARS = 60
"""The longest title, its ``…`` included (a longer one is cut at a word)."""

STORED_TITLE_CHARS = 200
"""The longest title read from a ``title.txt`` (one edited by hand, say)."""


class Titles:
    """The gateway's titler: names each session once, in the background.

    Start it with ``await nursery.start(titles.run)``; it holds the nursery its title
    tasks run in until it is cancelled (then a title being made is abandoned and tried
    again after the session's next task). :meth:`title_once` is called from a session's
    output listener, inside the supervisor's flush: it never blocks and never raises. It
    starts one task per untitled session (at most one per session at a time: the
    ``titling`` set) and needs no channel. With ``enabled`` false it does nothing.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.titling: set[str] = set()
        """Sessions titled, or being titled, by this gateway."""
        self._title_of: dict[str, str] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run title tasks until cancelled; reports ready once :meth:`title_once` works."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def title_once(self, session: Session) -> None:
        """After a task of ``session`` ended: give it a title unless it has one."""
        if not self.enabled or session.id in self.titling or self._nursery is None:
            return
        self.titling.add(session.id)
        self._nursery.start_soon(self._make_title, session)

    async def of(self, session_ids: Iterable[str], sessions_dir: Path) -> dict[str, str]:
        """The titles of ``session_ids`` (``""``: none yet): the ones this gateway made,
        the others read from their sessions' ``title.txt`` under ``sessions_dir``."""
        untitled = [sid for sid in session_ids if sid not in self._title_of]
        read = await trio.to_thread.run_sync(
            read_titles, [sessions_dir / sid / TITLE_FILE for sid in untitled]
        )
        return {**dict(zip(untitled, read, strict=True)), **self._title_of}

    async def _make_title(self, session: Session) -> None:
        path = session.directory / TITLE_FILE
        title = ""
        try:
            title = (await trio.to_thread.run_sync(read_titles, [path]))[0]
            if not title:
                try:
                    made = repair_text(await session.generate_title(max_chars=TITLE_CHARS))
                except Exception:
                    logger.exception("gateway: cannot title session %s", session.id)
                    made = ""
                if not made:
                    made = prompt_title(session)
                if made:
                    await trio.to_thread.run_sync(_write_title, path, made)
                title = made
        finally:
            if title:
                self._title_of[session.id] = title
            else:  # failed, empty or cancelled: try again after the next task
                self.titling.discard(session.id)


def prompt_title(session: Session) -> str:
    """The title of a session the model has never answered: its first prompt, on one line
    and cut at a word with ``…`` (``""`` when the model did answer, or nothing was asked)."""
    messages = session.transcript.request_messages()
    if any(isinstance(message, AssistantMessage) for message in messages):
        return ""
    for message in messages:
        if isinstance(message, UserMessage):
            words = " ".join(
                " ".join(
                    block.text for block in message.content if isinstance(block, TextBlock)
                ).split()
            )
            if words:
                return clip_words(repair_text(words), TITLE_CHARS)
    return ""


def read_titles(paths: list[Path]) -> list[str]:
    """The title in each file (``""`` for a missing or unreadable one). Blocking."""
    titles: list[str] = []
    for path in paths:
        try:
            text = " ".join(path.read_text(encoding="utf-8").split())
        except (OSError, UnicodeDecodeError):
            text = ""
        titles.append(clip_words(text, STORED_TITLE_CHARS))
    return titles


def _write_title(path: Path, title: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(title + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # the session may have been deleted meanwhile
        logger.warning("gateway: cannot store the title of %s: %s", path.parent.name, exc)
