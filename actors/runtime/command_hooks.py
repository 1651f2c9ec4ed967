"""Command hooks (R-HOOK-2): tool hooks that are programs, from a settings file.

:func:`load_hooks_file` reads ``--hooks FILE`` (:mod:`greenroom.protocols.hooks_file`) and
:func:`command_hooks` makes its entries the ``before_tool`` and ``after_tool`` of a
:class:`~greenroom.protocols.hooks.Hooks`, so they are decided, recorded and bounded as any
tool hook is. Each matching command runs in file order, through ``/bin/sh -c``, off the
event loop (``trio.run_process``), in the workspace of the session whose call it decides
(:func:`~greenroom.actors.runtime.tool_hooks.hook_site`; the process's working directory
for a hook called outside a session), and is killed when it outlives its ``timeout``. It
runs in a process group of its own, killed whole when the hook ends — it exits, outlives
its timeout or is interrupted — so that no process it started outlives it (R-SEC-11). It
is given the call as JSON on stdin, with the session and its workspace::

    {"hook": "before_tool", "tool": "run_shell", "call_id": "c1",
     "arguments": {"command": "ls"}, "session_id": "…", "cwd": "/path/to/workspace"}

(``after_tool`` adds ``"result": {"status", "is_error", "text"}``), and answers by its
exit status and output:

* exit 0 with nothing on stdout: the call (or result) goes on as it is;
* exit 0 with a JSON object on stdout: ``before_tool`` — the object is the call's new
  arguments (the next hooks and the approval see them; larger than one record of a
  cluster's trace carries, they are a hook error as a Python hook's are); ``after_tool`` —
  ``{"content": "…"}`` is the result the model gets instead (fit to the result budget and
  the record as a tool's result is);
* exit 2: ``before_tool`` denies the call, its stderr the reason (cut as any reason is:
  :func:`~greenroom.actors.runtime.tool_hooks.cut_reason`); ``after_tool`` gives the
  model its stderr instead of the result (fit to the result budget as a tool's result is);
* anything else — another exit status, other output, no answer in time, more than
  :data:`OUTPUT_CAP` bytes on stdout or stderr, a command that cannot start — is a hook
  error naming the command and what it did (its stderr): the
  call is denied (``before_tool``), the result kept (``after_tool``).

:func:`install_tool_hooks` gives the hooks to every session a host creates or loads (a
host observer): ``run``, ``chat`` and ``serve`` take ``--hooks`` so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from greenroom.actors.runtime.tool_hooks import ToolHookError, hook_site
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ToolResult
from greenroom.protocols.errors import HooksFileError
from greenroom.protocols.hooks import Deny, Hooks, Replace, Rewrite
from greenroom.protocols.hooks_file import CommandHook, HookSettings, parse_hooks_settings

__all__ = ["command_hooks", "install_tool_hooks", "load_hooks_file"]

DENY_EXIT = 2
"""The exit status by which a command hook denies a call (``before_tool``) or replaces a
result with its stderr (``after_tool``)."""

OUTPUT_CAP = 4 * 1024 * 1024
"""The most bytes of a command hook's stdout, and of its stderr, that are read: a hook that
prints more is a hook error (killed then), so a hook never holds more memory than this."""


def load_hooks_file(path: str | Path) -> Hooks:
    """The command hooks of the settings file at ``path``. Raises
    :class:`~greenroom.protocols.errors.HooksFileError` naming the file and the place of
    the problem when it cannot be read or used."""
    source = str(path)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise HooksFileError(f"{source}: cannot read it: {reason}") from None
    return command_hooks(parse_hooks_settings(text, source))


def command_hooks(settings: HookSettings) -> Hooks:
    """Tool hooks that run the commands of ``settings`` (see the module docstring). Each
    command is bounded by its own timeout, so the hooks as a whole are not."""
    before = settings.before_tool
    after = settings.after_tool

    async def before_tool(call: ToolCallBlock) -> Deny | Rewrite | None:
        arguments = call.arguments
        rewritten = False
        for hook in before:
            if not hook.matches(call.name):
                continue
            payload = {"hook": "before_tool", "tool": call.name, "call_id": call.id,
                       "arguments": arguments}
            code, stdout, stderr = await _run(hook, payload)
            if code == DENY_EXIT:
                return Deny(stderr or f"denied by the hook `{hook.command}`")
            answer = _answer(hook, code, stdout, stderr)
            if answer is not None:
                arguments, rewritten = answer, True
        return Rewrite(arguments) if rewritten else None

    async def after_tool(call: ToolCallBlock, result: ToolResult) -> Replace | None:
        text = "".join(b.text for b in result.content if isinstance(b, TextBlock))
        replaced: str | None = None
        for hook in after:
            if not hook.matches(call.name):
                continue
            payload = {"hook": "after_tool", "tool": call.name, "call_id": call.id,
                       "arguments": call.arguments,
                       "result": {"status": result.status, "is_error": result.is_error,
                                  "text": text if replaced is None else replaced}}
            code, stdout, stderr = await _run(hook, payload)
            if code == DENY_EXIT:
                replaced = stderr
                continue
            answer = _answer(hook, code, stdout, stderr)
            if answer is None:
                continue
            content = answer.get("content")
            if not isinstance(content, str) or set(answer) != {"content"}:
                raise ToolHookError(
                    f"hook `{hook.command}` printed {_clip(stdout)}: an after_tool hook "
                    'replaces a result with {"content": "…"}'
                )
            replaced = content
        return None if replaced is None else Replace(replaced)

    return Hooks(
        before_tool=before_tool if before else None,
        after_tool=after_tool if after else None,
        tool_hook_timeout_s=None,
    )


def install_tool_hooks(hooks: Hooks) -> Callable[[Any], None]:
    """A host observer (``Host.open(observers=…)``) that gives every session the host
    creates or loads the tool hooks of ``hooks`` (its other hooks stay; subagents take
    their parent's)."""

    def install(session: Any) -> None:
        session.hooks = attrs.evolve(
            session.hooks,
            before_tool=hooks.before_tool,
            after_tool=hooks.after_tool,
            tool_hook_timeout_s=hooks.tool_hook_timeout_s,
        )

    return install


async def _run(hook: CommandHook, payload: dict[str, Any]) -> tuple[int, str, str]:
    """Run ``hook``'s command with ``payload`` (and the session's id and workspace) on
    stdin, in that workspace: its exit status, stdout and stderr (stripped, whole). Raises
    :class:`ToolHookError` when it cannot start, prints more than :data:`OUTPUT_CAP` bytes
    on either, or outlives its timeout. However it ends (an interrupt too) its process
    group is killed: nothing it started outlives it (R-SEC-11)."""
    site = hook_site()
    cwd = None
    if site is not None:
        cwd = str(site.workspace)
        payload = {**payload, "session_id": site.session_id, "cwd": cwd}
    data = json.dumps(payload, ensure_ascii=False).encode()
    stdout, stderr = _Output(), _Output()
    process: trio.Process | None = None
    failure: OSError | None = None
    try:
        with trio.move_on_after(hook.timeout_s) as deadline:
            async with trio.open_nursery() as nursery:
                try:
                    process = await nursery.start(
                        partial(
                            trio.run_process,
                            ["/bin/sh", "-c", hook.command],
                            cwd=cwd,
                            stdin=data,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            check=False,
                            # Its own group, so that its children can be killed with it.
                            start_new_session=True,
                            deliver_cancel=_kill,
                        )
                    )
                except OSError as exc:
                    failure = exc
                else:
                    assert process.stdout is not None and process.stderr is not None
                    too_much = nursery.cancel_scope
                    nursery.start_soon(stdout.read, process.stdout, too_much)
                    nursery.start_soon(stderr.read, process.stderr, too_much)
                    nursery.start_soon(_end_with, process)
    finally:
        if process is not None:
            # Cancelled after the shell exited, _end_with may not have run.
            _kill_group(process)
    if failure is not None:
        raise ToolHookError(f"hook `{hook.command}` cannot start: {failure}")
    if deadline.cancelled_caught:
        raise ToolHookError(
            f"hook `{hook.command}` did not finish within {hook.timeout_s:g} s (killed)"
        )
    for name, output in (("stdout", stdout), ("stderr", stderr)):
        if output.over:
            raise ToolHookError(
                f"hook `{hook.command}` printed more than {OUTPUT_CAP} bytes on {name} (killed)"
            )
    assert process is not None and process.returncode is not None
    return process.returncode, stdout.text(), stderr.text()


class _Output:
    """What a hook printed on one stream, up to :data:`OUTPUT_CAP` bytes."""

    __slots__ = ("_data", "over")

    def __init__(self) -> None:
        self._data = bytearray()
        self.over = False
        """The hook printed more than :data:`OUTPUT_CAP` bytes here."""

    async def read(self, stream: trio.abc.ReceiveStream, too_much: trio.CancelScope) -> None:
        """Read ``stream`` to its end (and close it); past the cap, cancel ``too_much``:
        the hook is killed, its answer refused."""
        async with stream:
            while chunk := await stream.receive_some():
                if len(self._data) + len(chunk) > OUTPUT_CAP:
                    self.over = True
                    too_much.cancel()
                    return
                self._data += chunk

    def text(self) -> str:
        """What was read, decoded (a byte that is no UTF-8 replaced) and stripped."""
        return self._data.decode(errors="replace").strip()


async def _end_with(process: trio.Process) -> None:
    """Once the hook's shell exits, kill what it left running: a child that keeps its
    stdout open would otherwise hold the hook until its timeout."""
    await process.wait()
    _kill_group(process)


async def _kill(process: trio.Process) -> None:
    """A hook past its time (or interrupted) is killed at once, with every process of its
    group (not asked to stop: its answer is moot)."""
    _kill_group(process)


def _kill_group(process: trio.Process) -> None:
    """Kill the hook's process group. Its id stays taken while any of its processes lives,
    so it names none but theirs; gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _answer(hook: CommandHook, code: int, stdout: str, stderr: str) -> dict[str, Any] | None:
    """A finished command's answer: None (nothing printed) or the JSON object it printed;
    :class:`ToolHookError` for any other exit status or output."""
    if code != 0:
        why = f": {stderr}" if stderr else " (nothing on stderr)"
        raise ToolHookError(f"hook `{hook.command}` exited {code}{why}")
    if not stdout:
        return None
    try:
        value = json.loads(stdout)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ToolHookError(
            f"hook `{hook.command}` printed {_clip(stdout)}: expected nothing, or a JSON object"
        )
    return value


def _clip(text: str, limit: int = 120) -> str:
    return json.dumps(text if len(text) <= limit else text[: limit - 1] + "…")
