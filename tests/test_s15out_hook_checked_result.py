"""The result a call in doubt gets from its tool's check is the call's result, and the
session's ``after_tool`` hook sees it before the model does, as it sees every result the
pool reports (R-HOOK-2, R-EFFECT-2): a redacting hook redacts it, and what the hook did is
a ``tool_hook`` record before the result.

Before, a check's result went to the model and the trace as the check gave it: the hook
never ran, and what it keeps out of both (a card number) reached both after a restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import allow_all, trace_lines
from test_effects import Payments, crash_mid_call, of, take_up

from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.command_hooks import install_tool_hooks
from greenroom.actors.runtime.host import Host
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ToolResult
from greenroom.protocols.hooks import Hooks, Replace

CARD = "4111 1111 1111 1111"


def redact(call: ToolCallBlock, result: ToolResult) -> Replace | None:
    text_ = "".join(b.text for b in result.content if isinstance(b, TextBlock))
    return Replace(text_.replace(CARD, "[card]")) if CARD in text_ else None


async def test_a_checks_found_result_meets_the_after_tool_hook(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    sid, crashed, key = await crash_mid_call(host, workspace, tmp_path, providers)

    async def find(asked: str) -> str:
        payments.asked.append(asked)
        return f"paid 7 with the card {CARD}"

    payments = Payments(check=find)
    after = providers([Reply(blocks=(text("Noted."),))])
    # The hooks reach a loaded session as `--hooks` gives them: a host observer.
    observers = [install_tool_hooks(Hooks(after_tool=redact))]
    async with Host.open(crashed, observers=observers) as second:
        session = await take_up(second, sid, after, payments.tool, allow_all)
        lines = trace_lines(session)
    assert payments.asked == [key] and payments.runs == []
    assert CARD not in "".join(str(line) for line in lines)
    (hooked,) = of(lines, "tool_hook")
    assert (hooked["call_id"], hooked["hook"], hooked["action"]) == ("p1", "after_tool",
                                                                      "replace")
    (resolved,) = of(lines, "call_resolved")
    assert (resolved["by"], resolved["outcome"]) == ("check", "done")
    (result,) = of(lines, "tool_call_output")
    assert [b["text"] for b in result["content"]] == [markers.IN_DOUBT_FOUND_TEXT,
                                                      "paid 7 with the card [card]"]
    types = [line["type"] for line in lines]
    assert types.index("tool_hook") < types.index("call_resolved")
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"
