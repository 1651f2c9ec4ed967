"""Command hooks' settings file (R-HOOK-2), read and checked without running anything.

``--hooks FILE`` names a JSON file of programs to run before and after tool calls::

    {
      "before_tool": [{"match": "run_shell", "command": "./policy.sh", "timeout": 10}],
      "after_tool": [{"match": "mcp__github__*|read_file", "command": "./redact.py"}]
    }

Each entry: ``command`` (required, run by ``/bin/sh -c``), ``match`` (tool names, ``*``
and ``?`` wildcards, alternatives separated by ``|``; default ``*``: every tool),
``timeout`` (seconds, default :data:`DEFAULT_TIMEOUT_S`). Nothing else is accepted, so a
typo is an error and not a hook that silently never runs: :func:`parse_hooks_settings`
raises :class:`~greenroom.protocols.errors.HooksFileError` naming the place
(``$.before_tool[0].timeout: expected a number of seconds, got string``).

What the commands are given and what their answers mean is the runner's
(:mod:`greenroom.actors.runtime.command_hooks`).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from typing import Any

import attrs

from greenroom.protocols.errors import HooksFileError

__all__ = ["DEFAULT_TIMEOUT_S", "CommandHook", "HookSettings", "parse_hooks_settings"]

DEFAULT_TIMEOUT_S = 30.0
"""How long a command hook may run when its entry names no ``timeout``."""

_ENTRY_KEYS = ("match", "command", "timeout")


@attrs.frozen(kw_only=True, slots=True)
class CommandHook:
    """One entry of the file: run ``command`` for the tools ``match`` names, for at most
    ``timeout_s`` seconds."""

    command: str
    match: str = "*"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def matches(self, tool: str) -> bool:
        """Whether ``tool`` is one of the tools this hook is for."""
        return any(fnmatch.fnmatchcase(tool, part.strip()) for part in self.match.split("|"))


@attrs.frozen(kw_only=True, slots=True)
class HookSettings:
    """The command hooks of a settings file, in file order (they run in that order)."""

    before_tool: tuple[CommandHook, ...] = ()
    after_tool: tuple[CommandHook, ...] = ()


def parse_hooks_settings(text: str, source: str) -> HookSettings:
    """The settings in ``text`` (the content of the file ``source`` names). Raises
    :class:`HooksFileError` naming ``source`` and the place of the first problem."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        where = (
            f"line {exc.lineno} column {exc.colno}: {exc.msg}"
            if isinstance(exc, json.JSONDecodeError)
            else "nested too deeply"
            if isinstance(exc, RecursionError)
            else str(exc)
        )
        raise HooksFileError(f"{source}: not JSON: {where}") from None
    if not isinstance(data, dict):
        raise HooksFileError(f"{source}: $: expected an object with before_tool and after_tool")
    unknown = sorted(set(data) - {"before_tool", "after_tool"})
    if unknown:
        raise HooksFileError(
            f"{source}: $.{unknown[0]}: unknown key (the keys are before_tool and after_tool)"
        )
    return HookSettings(
        before_tool=_entries(data, "before_tool", source),
        after_tool=_entries(data, "after_tool", source),
    )


def _entries(data: Mapping[str, Any], key: str, source: str) -> tuple[CommandHook, ...]:
    entries = data.get(key, [])
    if not isinstance(entries, list):
        raise HooksFileError(f"{source}: $.{key}: expected a list of hooks")
    return tuple(_entry(entry, f"$.{key}[{i}]", source) for i, entry in enumerate(entries))


def _entry(entry: Any, path: str, source: str) -> CommandHook:
    if not isinstance(entry, dict):
        raise HooksFileError(f"{source}: {path}: expected an object {{match?, command, timeout?}}")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise HooksFileError(
            f"{source}: {path}.{unknown[0]}: unknown key (a hook has match, command and "
            "timeout)"
        )
    command = entry.get("command")
    if not isinstance(command, str) or not command.strip():
        raise HooksFileError(f"{source}: {path}.command: required: the program to run")
    match = entry.get("match", "*")
    if not isinstance(match, str) or not match.strip():
        raise HooksFileError(f"{source}: {path}.match: expected tool names such as run_shell")
    timeout = entry.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise HooksFileError(
            f"{source}: {path}.timeout: expected a number of seconds above 0, got "
            f"{json.dumps(timeout)}"
        )
    try:
        timeout_s = float(timeout)
    except OverflowError:  # an integer past a float's range: 400 digits read as JSON
        raise HooksFileError(
            f"{source}: {path}.timeout: expected a number of seconds above 0, got one too "
            "large"
        ) from None
    return CommandHook(command=command, match=match, timeout_s=timeout_s)
