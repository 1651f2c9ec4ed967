"""A principal's budget through the gateway (R-SHARE-4): real trio-websocket clients
against the real gateway on port 0, bounded by ``trio.fail_after``, never sleeps. Each
client's sessions are charged to its principal; once a principal's spending for the UTC
day leaves no room for its next request, its task ends ``budget_exceeded`` naming the
budget — another principal's tasks run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from test_gateway import BOUND_S, Client, connect, serving

from greenroom.actors.gateway.config import check_budgets
from greenroom.actors.providers.scripted import Reply, text
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError
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
                # session.list shows each session's own tokens and cost (R-SHARE-3).
                listed = (await alice.result("session.list"))["sessions"]
                usage = {s["session_id"]: s["usage"] for s in listed}
            async with connect(server, token=BOB) as bob:
                theirs = await run_task(bob, "mine")
            ledger = await server.host.usage_ledger.report(UsageQuery(by="principal"))
    assert second["status"] == "budget_exceeded"
    assert second["turns"] == 0
    assert "budget of principal 'alice' (1 USD per UTC day)" in second["message"]
    assert "$1.00 spent of $1.00" in second["message"]
    assert second["usage"]["cost_usd"] == 0.0
    assert theirs["status"] == "completed"
    assert usage[first["session_id"]]["cost_usd"] == 1.0
    assert usage[first["session_id"]]["tokens"] >= 100_000
    assert usage[second["session_id"]] == {"tokens": 0, "cost_usd": 0.0}
    assert [(line.key, line.cost_usd) for line in ledger] == [("alice", 1.0), ("bob", 1.0)]


async def test_a_client_sets_its_session_budget_through_session_create(tmp_path: Path) -> None:
    """max_cost_usd in session.create's settings: once the session spent $1 of 0.5, its
    next task ends budget_exceeded before any request."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, a_dollar_reply, host_options={"prices": PRICES}) as server,
            connect(server) as client,
        ):
            settings = {"max_tokens": 100, "max_cost_usd": 0.5}
            sid = (await client.result("session.create", {"settings": settings}))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "one"})
            first = (await client.outputs_until("task_end"))[-1]
            await client.result("run", {"session_id": sid, "input": "two"})
            second = (await client.outputs_until("task_end"))[-1]
    assert first["status"] == "completed"
    assert second["status"] == "budget_exceeded" and second["turns"] == 0
    assert f"max_cost_usd=0.5 of session {sid}" in second["message"]


async def test_a_ledger_damaged_while_serving_is_an_error_that_hides_its_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """session.list reads the usage ledger: damaged under a running server, the client
    gets an internal error without the server's paths, and the log says where and what
    to do; the connection goes on."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            ledger = server.host.data_dir / "usage.sqlite"
            ledger.write_bytes(b"not a database" * 100)
            for companion in ("usage.sqlite-wal", "usage.sqlite-shm"):
                (ledger.parent / companion).unlink(missing_ok=True)  # pages held there
            error = await client.error("session.list")
            assert error == {
                "code": jsonrpc.INTERNAL_ERROR,
                "message": "the server's usage ledger cannot be used (see its log)",
            }
            subscribed = await client.result("session.subscribe", {"session_id": sid})
            assert subscribed == {"session_id": sid, "replayed": 0, "last_seq": 0}
    assert f"the usage ledger {ledger} cannot be used (file is not a database)" in caplog.text


def test_a_client_may_lower_the_servers_budget_but_not_lift_it() -> None:
    server = {"max_cost_usd": 2.0}
    check_budgets({"max_cost_usd": 1.0, "tree_cost_budget_usd": None}, server)
    check_budgets({"max_cost_usd": 5.0}, {})  # no server budget: the client's own
    for asked in (3.0, None):
        with pytest.raises(RpcError) as refused:
            check_budgets({"max_cost_usd": asked}, server)
        assert refused.value.code == jsonrpc.INVALID_PARAMS
        assert refused.value.message == "$.settings.max_cost_usd: at most the server's 2"
