"""A ``before_tool`` hook that rewrites a call to arguments nested deeper than any call's
arguments may be (64 levels, R-SEC-6) is a hook error: the call is denied, the error says
why, and the task goes on (R-HOOK-2: a hook never ends a task).

Before, such a rewrite was taken: some hundreds of levels ended the task ``failed`` with
``cannot write the trace: the tool_hook record … could not be encoded`` or ``internal
error: RecursionError`` — from a Python hook's ``Rewrite`` and from a command hook that
prints such an object alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import of_type, result_text
from test_command_hooks import py, run
from test_command_hooks import ran as command_ran
from test_command_hooks import sh as command_sh
from test_tool_hooks import ran, run_with, sh

from greenroom import Host
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.hooks import Hooks, Rewrite
from greenroom.protocols.outputs import TaskEnd, ToolCallOutput, ToolHook


def nested(levels: int) -> Any:
    """A value of ``levels`` arrays, one inside the other."""
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def assert_denied_as_too_deep(outputs: list[Any]) -> None:
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.action == "error" and hooked.arguments is None
    assert hooked.reason is not None and "deeper than 64 levels" in hooked.reason
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.status == "denied"
    assert "deeper than 64 levels" in result_text(result)  # type: ignore[arg-type]


@pytest.mark.parametrize("levels", [400, 5000])
async def test_a_python_hooks_too_deep_rewrite_denies_the_call(
    host: Host, workspace: Path, providers: Any, levels: int
) -> None:
    def rewrite(call: ToolCallBlock) -> Rewrite:
        return Rewrite({"command": "ls", "deep": nested(levels)})

    outputs, _ = await run_with(host, workspace, providers, Hooks(before_tool=rewrite),
                                sh("c1", "ls"))
    assert_denied_as_too_deep(outputs)
    assert ran == []


async def test_a_rewrite_64_levels_deep_is_taken(
    host: Host, workspace: Path, providers: Any
) -> None:
    def rewrite(call: ToolCallBlock) -> Rewrite:
        return Rewrite({"command": "ls", "deep": nested(63)})

    outputs, _ = await run_with(host, workspace, providers, Hooks(before_tool=rewrite),
                                sh("c1", "ls"))
    assert of_type(outputs, TaskEnd)[-1].status == "completed"
    (hooked,) = of_type(outputs, ToolHook)
    assert hooked.action == "rewrite" and hooked.arguments == {
        "command": "ls", "deep": nested(63)
    }


async def test_a_command_hook_printing_a_too_deep_object_denies_the_call(
    host: Host, tmp_path: Path, providers: Any
) -> None:
    deep = '{"command": "ls", "deep": ' + "[" * 400 + "]" * 400 + "}"
    settings = {"before_tool": [{"command": py(f"print({deep!r})")}]}
    outputs = await run(host, tmp_path, providers, settings, command_sh("c1", "ls"))
    assert_denied_as_too_deep(outputs)
    assert command_ran == []
