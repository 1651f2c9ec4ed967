"""``greenroom acp``: the editor's files and terminal, for the session's tools (R-ACP-2).

An editor that says in ``initialize`` that it reads and writes files for the agent
(``clientCapabilities.fs.readTextFile``, ``writeTextFile``) or runs its commands
(``terminal``) gets each of its sessions an :class:`EditorSession`, the session's
:attr:`~greenroom.protocols.tools.ToolContext.editor`: the built-in tools check every path
against the session's workspace first (R-SEC-7), then ``read_file`` asks
``fs/read_text_file`` (the editor's buffer, saved or not), ``write_file`` asks
``fs/write_text_file`` and shows the edit as a ``diff`` on its call, and ``run_shell`` —
only in a session whose sandbox is ``off`` — runs in a terminal of the editor
(``terminal/create``, ``wait_for_exit``, ``output``, ``kill``, ``release``), embedded in
its call as ``terminal`` content.

What a call shows (the diff, the terminal) is attached to the session's mapper, which
puts it first in every later update of the call; the terminal is shown from the
progress note the call reports once it exists, so it reaches the editor after the call's
own ``tool_call``, in the order the session published them.

Every request waits at most :data:`EDITOR_TIMEOUT_S` for the editor's answer (a terminal's
``wait_for_exit`` the command's own timeout): an editor that does not answer fails the
call, it never holds it — but for a write. ``fs/write_text_file`` has no way to be taken
back once sent, and an editor that answers late has written the file all the same: given
up on, the model would be told the write failed when it took effect. So a write that was
sent waits for the editor's answer as long as its call runs; an interrupt
(``session/cancel``) ends the wait, and the call is then interrupted, never failed: the
model is not told the file was not written. A terminal is always released, even when the call is
cancelled (releasing kills a command still running) — also one whose ``terminal/create``
is answered after its call stopped waiting (cancelled, or out of time): the command it
started is not left running in the editor, unseen.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from greenroom.actors.apps.acp_people import Request
from greenroom.protocols import acp
from greenroom.protocols.tools import EditorError, TerminalRun

__all__ = ["EDITOR_TIMEOUT_S", "RELEASE_GRACE_S", "EditorSession"]

EDITOR_TIMEOUT_S = 60.0
"""How long a request of a tool to the editor (a read, starting a terminal) waits for its
answer before the call fails; a write waits for its answer as long as its call runs."""

RELEASE_GRACE_S = 5.0
"""How long releasing a terminal after its call ended (or was cancelled) may take."""

Spawn = Callable[[Callable[[], Awaitable[None]]], None]
"""Run a task of the connection's (it outlives the call that starts it)."""


class EditorSession:
    """The editor of one session of the connection (a
    :class:`~greenroom.protocols.tools.Editor`): ``capabilities`` say what it offers,
    ``request`` is the agent's way to ask the client, ``session_id`` the session the
    editor knows (the root's, for a subagent's calls too), ``mapper`` the session's;
    ``spawn`` runs the tasks that wait for a terminal its call no longer waits for."""

    def __init__(
        self,
        capabilities: acp.EditorCapabilities,
        session_id: str,
        request: Request,
        mapper: acp.UpdateMapper,
        spawn: Spawn,
    ) -> None:
        self._capabilities = capabilities
        self._session_id = session_id
        self._request = request
        self._mapper = mapper
        self._spawn = spawn

    @property
    def reads(self) -> bool:
        """Whether the editor answers ``fs/read_text_file``."""
        return self._capabilities.reads

    @property
    def writes(self) -> bool:
        """Whether the editor answers ``fs/write_text_file``."""
        return self._capabilities.writes

    @property
    def runs(self) -> bool:
        """Whether the editor answers ``terminal/*``."""
        return self._capabilities.terminal

    async def read_text(
        self, path: str, *, line: int | None = None, limit: int | None = None
    ) -> str:
        """``fs/read_text_file``: the editor's text of ``path``."""
        params: dict[str, Any] = {"sessionId": self._session_id, "path": path}
        if line is not None:
            params["line"] = line
        if limit is not None:
            params["limit"] = limit
        return _checked(acp.text_of, await self._call("fs/read_text_file", params))

    async def write_text(self, path: str, content: str) -> None:
        """``fs/write_text_file``: the editor writes ``content`` to ``path``. Waits for the
        editor's answer with no time limit (see the module docstring): only its answer
        says what became of the file; cancelling the call ends the wait."""
        params = {"sessionId": self._session_id, "path": path, "content": content}
        await self._call("fs/write_text_file", params, timeout_s=None)

    def show_diff(self, call_id: str, path: str, old_text: str | None, new_text: str) -> None:
        """The call ``call_id`` shows the edit as ``diff`` content from now on."""
        self._mapper.attach(call_id, acp.diff_content(path, old_text, new_text))

    async def run(
        self,
        command: str,
        *,
        cwd: str,
        timeout_s: float,
        output_limit: int,
        call_id: str,
        report_progress: Callable[[str], None],
    ) -> TerminalRun:
        """``command`` in a new terminal of the editor (``bash -c``), embedded in the call
        ``call_id``; killed after ``timeout_s``; released in every case."""
        terminal = await self._create(
            {
                "sessionId": self._session_id,
                "command": "bash",
                "args": ["-c", command],
                "cwd": cwd,
                "outputByteLimit": output_limit,
            }
        )
        try:
            self._mapper.attach(call_id, acp.terminal_content(terminal["terminalId"]))
            report_progress("running in the editor's terminal")
            exited: dict[str, Any] = {}
            with trio.move_on_after(timeout_s) as waiting:
                exited = await self._call("terminal/wait_for_exit", terminal, timeout_s=None)
            if waiting.cancelled_caught:
                await self._call("terminal/kill", terminal)
            shown = _checked(acp.terminal_output, await self._call("terminal/output", terminal))
        finally:
            # Shielded: a cancelled call still releases its terminal, which kills the
            # command; one the editor will not release is the editor's to end.
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(RELEASE_GRACE_S),
                contextlib.suppress(EditorError),
            ):
                await self._call("terminal/release", terminal)
        # How it exited: as wait_for_exit said, else as the output's exitStatus says.
        code, signal = acp.exit_status(exited)
        if code is None and signal is None:
            code, signal = shown.exit_code, shown.signal
        return TerminalRun(
            output=shown.output,
            truncated=shown.truncated,
            exit_code=code,
            signal=signal,
            timed_out=waiting.cancelled_caught,
        )

    async def _create(self, params: dict[str, Any]) -> dict[str, str]:
        """``terminal/create``: the ``{sessionId, terminalId}`` of the new terminal. The
        request is asked from a task of the connection: when this call stops waiting for
        its answer (cancelled, or after :data:`EDITOR_TIMEOUT_S`), the terminal the editor
        creates all the same is released once its answer comes, which kills its command."""
        answered = trio.Event()
        box: list[acp.Response] = []
        abandoned = False

        def terminal_of(response: acp.Response) -> dict[str, str]:
            created = _checked(lambda r: acp.client_result(r, "terminal/create"), response)
            terminal_id = _checked(acp.terminal_id_of, created)
            return {"sessionId": self._session_id, "terminalId": terminal_id}

        async def release(response: acp.Response) -> None:
            with contextlib.suppress(EditorError):
                terminal = terminal_of(response)
                with trio.move_on_after(RELEASE_GRACE_S):
                    await self._call("terminal/release", terminal)

        async def ask() -> None:
            box.append(await self._request("terminal/create", params, None))
            answered.set()
            if abandoned:  # no call waits for it: its command runs unseen
                await release(box[0])

        self._spawn(ask)
        try:
            with trio.move_on_after(EDITOR_TIMEOUT_S):
                await answered.wait()
        finally:
            # No checkpoint between the answer and this: either it came, or the task that
            # waits for it releases what it brings.
            abandoned = not answered.is_set()
        if abandoned:
            raise EditorError(
                f"the editor did not answer terminal/create in {EDITOR_TIMEOUT_S:g} s"
            )
        return terminal_of(box[0])

    async def _call(
        self, method: str, params: dict[str, Any], *, timeout_s: float | None = EDITOR_TIMEOUT_S
    ) -> dict[str, Any]:
        """Ask the editor, and its answer's result; :class:`EditorError` for an error, an
        answer that is not one, or none in ``timeout_s`` (None: no limit)."""
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as limit:
            response = await self._request(method, params, None)
        if limit.cancelled_caught:
            raise EditorError(f"the editor did not answer {method} in {timeout_s:g} s")
        return _checked(lambda r: acp.client_result(r, method), response)


_T = TypeVar("_T")
_V = TypeVar("_V")


def _checked(read: Callable[[_V], _T], value: _V) -> _T:
    """``read(value)``, its ``ValueError`` (the editor's answer is wrong) as an
    :class:`EditorError`."""
    try:
        return read(value)
    except ValueError as exc:
        raise EditorError(str(exc)) from None
