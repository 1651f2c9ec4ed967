"""A principal's budget through the gateway (R-SHARE-4): real trio-websocket clients
against the real gateway on port 0, bounded by ``trio.fail_after``, never sleeps. Each
client's sessions are charged to its principal; once a principal's spending for the UTC
day leaves no room for its next request, its task ends ``budget_exceeded`` naming the
budget — another principal's tasks run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from test_gateway import BOUND_S, Client, connect, serving

from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import UsageQuery

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"
PRICES = {"scripted": {"input": 10.0, "output": 10.0}}
"""$10 per million tokens: a reply that used 100,000 tokens cost $1."""


def a_dollar_reply() -> Reply:
    return Reply(blocks=(text("Done."),), usage=TokenUsage(input=100_000))


async def run_task(client: Client, words: str) -> dict[str, Any]:
    """Create a session, run ``words`` on it and return its task_end."""
    sid = (await client.result("session.create", {"settings": {"max_tokens": 100}}))[
        "session_id"
    ]
    await client.result("run", {"session_id": sid, "input": words})
    await client.result("session.subscribe", {"session_id": sid})
    outputs = client.take_outputs()
    if not outputs or outputs[-1]["type"] != "task_end":
        outputs += await client.outputs_until("task_end")
    end = outputs[-1]
    assert end["type"] == "task_end" and end["session_id"] == sid
    return end


async def test_a_principal_budget_ends_its_next_task_and_spares_the_others(
    tmp_path: Path,
) -> None:
    options = {"prices": PRICES, "principal_budget": PrincipalBudget(usd=1.0, period="day")}
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path,
            a_dollar_reply,
            tokens={"alice": ALICE, "bob": BOB},
            host_options=options,
        ) as server:
            async with connect(server, token=ALICE) as alice:
                first = await run_task(alice, "one")
                assert first["status"] == "completed"
                assert first["usage"]["cost_usd"] == 1.0
                # A new session of the same principal: $1 spent leaves no room.
                second = await run_task(alice, "two")
            async with connect(server, token=BOB) as bob:
                theirs = await run_task(bob, "mine")
            ledger = await server.host.usage_ledger.report(UsageQuery(by="principal"))
    assert second["status"] == "budget_exceeded"
    assert second["turns"] == 0
    assert "budget of principal 'alice' (1 USD per UTC day)" in second["message"]
    assert "$1.00 spent of $1.00" in second["message"]
    assert second["usage"]["cost_usd"] == 0.0
    assert theirs["status"] == "completed"
    assert [(line.key, line.cost_usd) for line in ledger] == [("alice", 1.0), ("bob", 1.0)]
