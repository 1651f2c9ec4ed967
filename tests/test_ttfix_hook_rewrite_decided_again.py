"""A call a ``before_tool`` hook rewrote, decided again after its host stopped
(R-HOOK-2, R-EFFECT-2, R-TRACE-4): the latest decision is the one a later take-up runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from conftest import RUN_TIMEOUT_S, allow_all, cut_after, open_host, port_of, trace_lines
from test_effects import Payments, crash_mid_call, take_up
from test_recovery import copy_session

from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.hooks import Hooks, Rewrite
from greenroom.protocols.tools import ToolContext, make_tool


def _cap_at_one(call: ToolCallBlock) -> Rewrite:
    """A before_tool policy: every payment is of 1, whatever the model asked."""
    return Rewrite({"amount": 1})


async def test_a_call_the_hook_lets_be_when_asked_again_reruns_with_the_models_arguments(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """The hook rewrote pay(amount=7) to amount 1 and its host stopped before the call was
    decided. The host that took the task up asked the call anew: its hook (changed since)
    let it be, and pay(7) was approved and ran when that host stopped too. The third host
    checks the call (nothing found) and runs it once more — with 7, what was decided
    last. Before, the record still held the first rewrite and the rerun paid 1: arguments
    the last decision had not approved."""
    sid, first, _ = await crash_mid_call(
        host, workspace, tmp_path, providers, Hooks(before_tool=_cap_at_one)
    )
    (trace,) = (first / "sessions" / sid).glob("trace_*.jsonl")
    cut_after(trace, lambda line: line["type"] == "tool_hook")

    asked: list[dict[str, Any]] = []
    started = trio.Event()

    def let_be(call: ToolCallBlock) -> None:
        asked.append(call.arguments)

    async def pay(amount: int, ctx: ToolContext) -> str:
        """Pay an amount."""
        started.set()
        await trio.sleep_forever()
        return "never"  # pragma: no cover

    blocking = make_tool(pay, parallel=False)
    async with open_host(first) as second:
        loaded = await second.load_session(sid, provider=providers([]), tools=[blocking])
        loaded.hooks = Hooks(before_tool=let_be)
        session = await second.resume(sid, provider=providers([]), tools=[blocking],
                                      approve=allow_all)  # fmt: skip
        with trio.fail_after(RUN_TIMEOUT_S):
            await started.wait()
        await port_of(session).sync_trace()
        copy_session(session, tmp_path / "again")
        decided = [line for line in trace_lines(session) if line["type"] == "approval_decision"]
    assert asked == [{"amount": 7}]
    assert [d["decision"] for d in decided] == ["allow"]

    payments = Payments()  # its check finds nothing: the call runs once more
    after = providers([Reply(blocks=(text("Paid."),))])
    async with open_host(tmp_path / "again") as third:
        session = await take_up(third, sid, after, payments.tool, allow_all)
        lines = trace_lines(session)
    assert list(payments.made.values()) == [7]
    results = [line for line in lines if line["type"] == "tool_call_output"]
    assert [r["content"][0]["text"] for r in results] == ["paid 7"]
    assert lines[-1]["status"] == "completed"
    hooked = [line for line in lines if line["type"] == "tool_hook"]
    assert [(h["action"], h["arguments"]) for h in hooked] == [
        ("rewrite", {"amount": 1}),  # the first host's hook
        ("rewrite", {"amount": 7}),  # the second's let the call be: it goes on as the model made it
    ]
