"""Costs and budgets in the runtime (R-SHARE-3, R-SHARE-4, R-TREE-3), with the scripted
model and a real host: every request's cost in ``token_usage``, ``task_end`` and the
ledger; a task that ends ``budget_exceeded`` before a request that could pass a session
budget, a subtree's budget or a principal's; and spending that outlives the host."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from conftest import allow_all, collect, ledger_rows, of_type

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.accounting import Accounting, PrincipalBudget
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import (
    Output,
    RequestBegin,
    TaskEnd,
    TokenUsageOutput,
    ToolCallOutput,
)
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.tools import tool

# $10 per million tokens every way: 100,000 tokens cost $1.
PRICES = {"scripted": {"input": 10.0, "output": 10.0, "cache_read": 1.0, "cache_write": 12.5}}
A_DOLLAR = TokenUsage(input=100_000)
"""One request's usage that costs exactly $1 at ``PRICES``."""
SMALL = {"max_tokens": 100}
"""Keeps a request's output bound small: 100 tokens at $10/M is $0.001."""


@tool(parallel=True)
async def note(text: str) -> str:
    """Take a note."""
    return f"noted: {text}"


def noting(call_id: str, usage: TokenUsage = A_DOLLAR) -> Reply:
    return Reply(blocks=(text("Noting."), tool_call(call_id, "note", text=call_id)), usage=usage)


def answer(words: str = "Done.", usage: TokenUsage = A_DOLLAR) -> Reply:
    return Reply(blocks=(text(words),), usage=usage)


def the_end(outputs: list[Any]) -> TaskEnd:
    ends = [o for o in of_type(outputs, TaskEnd) if o.origin is None]
    assert len(ends) == 1
    return ends[0]


async def test_each_request_costs_what_its_tokens_cost_at_the_model_price(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SHARE-3: token_usage carries the request's cost, task_end the sum, and each
    ledger row its cost, principal and root."""
    usage_1 = TokenUsage(input=1_000, output=200, cache_read=5_000, cache_write=2_000)
    usage_2 = TokenUsage(input=300, output=50)
    provider = ScriptedProvider([noting("c1", usage_1), answer(usage=usage_2)])
    async with Host.open(tmp_path / "data", prices=PRICES) as host:
        session = await host.create_session(
            provider=provider, tools=[note], workspace_dir=workspace, principal="alice"
        )
        outputs = await collect(session.run("go", approve=allow_all))
    # By hand: $10/M input and output, $1/M cache reads, $12.50/M cache writes.
    cost_1 = (1_000 * 10 + 200 * 10 + 5_000 * 1 + 2_000 * 12.5) / 1e6
    cost_2 = (300 * 10 + 50 * 10) / 1e6
    assert (cost_1, cost_2) == (pytest.approx(0.042), pytest.approx(0.0035))
    costs = [o.request.cost_usd for o in of_type(outputs, TokenUsageOutput)]
    assert costs == [pytest.approx(cost_1), pytest.approx(cost_2)]
    end = the_end(outputs)
    assert end.status == "completed"
    assert end.usage.cost_usd == pytest.approx(cost_1 + cost_2)
    rows = ledger_rows(tmp_path / "data", session.id)
    assert [(r["cost_usd"], r["principal"], r["root_id"]) for r in rows] == [
        (pytest.approx(cost_1), "alice", session.id),
        (pytest.approx(cost_2), "alice", session.id),
    ]


async def test_an_unknown_model_costs_null_everywhere(tmp_path: Path, workspace: Path) -> None:
    """R-SHARE-3: no price, no cost — null in token_usage, task_end and the ledger."""
    provider = ScriptedProvider([answer()])
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        outputs = await collect(session.run("go"))
    assert [o.request.cost_usd for o in of_type(outputs, TokenUsageOutput)] == [None]
    assert the_end(outputs).usage.cost_usd is None
    assert [r["cost_usd"] for r in ledger_rows(tmp_path / "data")] == [None]


async def test_bad_prices_are_refused_naming_the_place(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"prices: \$\.m\.output: required"):
        async with Host.open(tmp_path / "data", prices={"m": {"input": 1}}):
            pass


async def test_a_session_budget_ends_the_task_before_a_request_that_could_pass_it(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SHARE-4: $1 spent of max_cost_usd=1.5, and the next request's bound could pass
    it — its context of 100,000 tokens at the dearer input rate (cache writes, $12.50/M)
    plus 100 output tokens: $1.251 — so the task ends budget_exceeded, naming the budget,
    and that request is never sent."""
    provider = ScriptedProvider([noting("c1"), answer()])
    async with Host.open(tmp_path / "data", prices=PRICES) as host:
        session = await host.create_session(
            provider=provider, tools=[note], workspace_dir=workspace, max_cost_usd=1.5, **SMALL
        )
        outputs = await collect(session.run("go", approve=allow_all))
    end = the_end(outputs)
    assert (end.status, end.turns) == ("budget_exceeded", 1)
    assert end.message is not None
    assert f"max_cost_usd=1.5 of session {session.id}" in end.message
    assert "$1.00 spent of $1.50" in end.message
    assert "could cost up to $1.25" in end.message
    assert end.usage.cost_usd == pytest.approx(1.0)
    assert len(provider.requests) == 1
    assert len(of_type(outputs, RequestBegin)) == 1
    # The turn before it was whole: its call has its result.
    assert [o.status for o in of_type(outputs, ToolCallOutput)] == ["ok"]


async def test_a_session_budget_counts_what_the_session_spent_before_the_host_started(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SHARE-4: a loaded session's budget starts at what its tree spent, read from the
    ledger: $1 spent + a bound of $1.251 passes 1.9 (it would not from nothing)."""
    data = tmp_path / "data"
    async with Host.open(data, prices=PRICES) as host:
        session = await host.create_session(
            provider=ScriptedProvider([answer()]), workspace_dir=workspace, **SMALL
        )
        assert the_end(await collect(session.run("first"))).status == "completed"
        session_id = session.id
    provider = ScriptedProvider([answer()])
    async with Host.open(data, prices=PRICES) as host:
        loaded = await host.load_session(session_id, provider=provider, max_cost_usd=1.9)
        end = the_end(await collect(loaded.run("second")))
    assert end.status == "budget_exceeded" and end.turns == 0
    assert "$1.00 spent of $1.90" in (end.message or "")
    assert provider.requests == []


async def test_a_tree_budget_stops_a_subagent_and_its_spawning_call_fails_naming_it(
    tmp_path: Path, workspace: Path
) -> None:
    """R-TREE-3, R-SHARE-4: the child's subtree may spend tree_cost_budget_usd=1.5; after
    its first $1 request the next could pass it, so the child ends budget_exceeded and the
    parent's spawn_subagent call is an error naming the budget; the parent goes on."""
    provider = ScriptedProvider(
        [
            Reply(blocks=(tool_call("s1", "spawn_subagent", task="take notes"),),
                  usage=TokenUsage(input=10)),
            noting("n1"),  # the child's first turn: $1
            answer("The subagent ran out of budget.", usage=TokenUsage(input=10)),
        ]
    )  # fmt: skip
    async with Host.open(tmp_path / "data", prices=PRICES) as host:
        session = await host.create_session(
            provider=provider,
            tools=[note, spawn_subagent],
            workspace_dir=workspace,
            tree_cost_budget_usd=1.5,
            **SMALL,
        )
        with trio.fail_after(10):
            outputs = await session.run("delegate", approve=allow_all).collect()
    child_end = next(o for o in of_type(outputs, TaskEnd) if o.origin is not None)
    assert child_end.status == "budget_exceeded"
    assert "tree_cost_budget_usd=1.5 of subagent" in (child_end.message or "")
    spawned = next(o for o in of_type(outputs, ToolCallOutput) if o.call_id == "s1")
    assert spawned.status == "error"
    result = "".join(getattr(b, "text", "") for b in spawned.content)
    assert "budget_exceeded" in result and "tree_cost_budget_usd=1.5" in result
    end = the_end(outputs)
    assert end.status == "completed"
    assert len(provider.requests) == 3  # the child's second request was never sent


async def test_background_children_under_way_together_cannot_pass_their_trees_budget(
    tmp_path: Path, workspace: Path
) -> None:
    """R-TREE-3, R-SHARE-4: three background children start at once under the root's
    max_cost_usd=2.5, each request bound to $1.00 (up to 100,000 output tokens) and
    costing $0.90. A request under way holds its bound, so at most two requests of the
    tree — the children's, or the root's own next one — are under way at once: a child
    whose request would pass the budget with them ends budget_exceeded, saying what is
    held, and the tree spends at most the budget (all three were sent, $2.70, when each
    child was checked against $0 spent). Which requests go first is the scheduler's
    choice; the bound holds whatever it is."""
    go = trio.Event()
    sent_by_children: list[ModelRequest] = []
    child_ends: list[TaskEnd] = []

    async def model(request: ModelRequest, stream: ScriptedStream) -> None:
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            sent_by_children.append(request)
            if len(sent_by_children) == 3:
                go.set()  # all three under way at once: nothing held them back
            await go.wait()
            await stream.text("found it")
            await stream.end(usage=TokenUsage(output=90_000))
        elif len(request.messages) == 1:
            for n in range(3):
                call = tool_call(f"s{n}", "spawn_subagent", task=f"look {n}", background=True)
                await stream.block(call)
            await stream.end("tool_use", usage=TokenUsage(input=10))
        else:
            await stream.text("noted")
            await stream.end(usage=TokenUsage(input=10))

    def on_batch(batch: list[Output]) -> None:
        for output in batch:
            if isinstance(output, TaskEnd) and output.origin is not None:
                child_ends.append(output)
                if output.status == "budget_exceeded":
                    go.set()  # the third was refused: the two under way may answer

    data = tmp_path / "data"
    async with Host.open(data, prices=PRICES) as host:
        session = await host.create_session(
            provider=ScriptedProvider(model), tools=[spawn_subagent], workspace_dir=workspace,
            max_cost_usd=2.5, max_tokens=100_000,
        )
        session.subscribe(on_batch)
        with trio.fail_after(10):
            await collect(session.run("research", approve=allow_all))
            while len(child_ends) < 3:
                await trio.testing.wait_all_tasks_blocked()
    statuses = sorted(end.status for end in child_ends)
    assert set(statuses) <= {"budget_exceeded", "completed"}, statuses
    refused = [end for end in child_ends if end.status == "budget_exceeded"]
    # The first refusal comes while requests are under way (nothing is spent before).
    assert any("held by requests under way" in (r.message or "") for r in refused)
    assert 1 <= len(sent_by_children) == statuses.count("completed") <= 2
    spent = sum(row["cost_usd"] for row in ledger_rows(data))
    assert spent <= 2.5
    assert spent == pytest.approx(0.9 * len(sent_by_children), abs=0.01)


async def test_a_principal_budget_spans_its_sessions_and_outlives_the_host(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SHARE-4: a principal's daily budget counts every session charged to it (and
    what the ledger holds from earlier today); another principal's is its own."""
    data = tmp_path / "data"
    budget = PrincipalBudget(usd=1.5)
    async with Host.open(data, prices=PRICES, principal_budget=budget) as host:
        first = await host.create_session(
            provider=ScriptedProvider([answer()]), workspace_dir=workspace, principal="alice",
            **SMALL,
        )
        assert the_end(await collect(first.run("one"))).status == "completed"
        second = await host.create_session(
            provider=ScriptedProvider([answer("x", usage=TokenUsage(input=60_000))]),
            workspace_dir=workspace, principal="alice", **SMALL,
        )
        end = the_end(await collect(second.run("two")))
        # A fresh context: the bound is ~$0.001, and $1 + $0.6 passes $1.50 only after.
        assert end.status == "completed"
        third = await host.create_session(
            provider=ScriptedProvider([answer()]), workspace_dir=workspace, principal="alice",
            **SMALL,
        )
        end = the_end(await collect(third.run("three")))
        assert end.status == "budget_exceeded"
        assert "budget of principal 'alice' (1.5 USD per UTC day)" in (end.message or "")
        bob = await host.create_session(
            provider=ScriptedProvider([answer()]), workspace_dir=workspace, principal="bob",
            **SMALL,
        )
        assert the_end(await collect(bob.run("mine"))).status == "completed"
    async with Host.open(data, prices=PRICES, principal_budget=budget) as host:
        again = await host.create_session(
            provider=ScriptedProvider([answer()]), workspace_dir=workspace, principal="alice",
        )
        end = the_end(await collect(again.run("four")))
        assert end.status == "budget_exceeded"
        assert "$1.60 spent of $1.50" in (end.message or "")


async def test_an_automatic_compaction_is_a_request_the_budget_checks_too(
    tmp_path: Path, workspace: Path
) -> None:
    """R-SHARE-4: the context of 100,000 tokens calls for a compaction before turn 2; its
    summary request could pass the budget, so it is not started: the task ends
    budget_exceeded with no compaction recorded."""
    provider = ScriptedProvider([noting("c1"), answer("summary")])
    async with Host.open(tmp_path / "data", prices=PRICES) as host:
        session = await host.create_session(
            provider=provider, tools=[note], workspace_dir=workspace, max_cost_usd=1.5,
            max_context_length=50_000, **SMALL,
        )
        outputs = await collect(session.run("go", approve=allow_all))
    end = the_end(outputs)
    assert end.status == "budget_exceeded" and "max_cost_usd=1.5" in (end.message or "")
    assert not [o for o in outputs if o.TYPE.startswith("compaction")]
    assert len(provider.requests) == 1


async def test_a_principals_budget_a_failed_session_was_reading_is_read_for_the_next() -> None:
    # Two sessions of one principal open at once, and the first one's reading of the
    # ledger fails: the second took that session's half-made limit, counting from
    # nothing and shared with nobody (R-SHARE-4).
    reading, fail = trio.Event(), trio.Event()

    class Ledger:
        calls = 0

        async def report(self, query: Any) -> list[Any]:
            self.calls += 1
            if self.calls == 1:
                reading.set()
                await fail.wait()
                raise OSError("the ledger cannot be read")
            return [SimpleNamespace(cost_usd=4.0)]

    ledger: Any = Ledger()
    accounting = Accounting(ledger, principal_budget=PrincipalBudget(usd=5.0))
    settings = SessionSettings(model="claude-sonnet-4-5")
    opened: list[Any] = []

    async def first() -> None:
        with pytest.raises(OSError, match="cannot be read"):
            await accounting.account("s1", settings, principal="ada")

    async def second() -> None:
        opened.append(await accounting.account("s2", settings, principal="ada"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await reading.wait()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        fail.set()
    (limit,) = opened[0].limits
    assert limit.spent_usd == 4.0  # what the ledger holds
    third = await accounting.account("s3", settings, principal="ada")
    assert third.limits == (limit,)  # one limit for the principal's sessions
