"""What a recorded task costs on each provider's wire (R-SHARE-3): the real clients
against the loopback mock server replaying recorded streams; each request's cost in
``token_usage`` and the task's in ``task_end`` match a hand computation at the model's
list price (its dated name found through its alias)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from conftest import Gates, ledger_rows

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.protocols.outputs import Output, PartialText, TaskEnd, TokenUsageOutput, UserMsg
from tests.support.mock_model_server import (
    Fixture,
    Paused,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)

SSE = {"content-type": "text/event-stream"}


def allow(_: object) -> str:
    return "allow"


def per_million(*terms: tuple[int, float]) -> float:
    return sum(tokens * rate for tokens, rate in terms) / 1_000_000


def anthropic(url: str) -> ModelProvider:
    return AnthropicProvider(base_url=url, api_key="test-key")


def paused_reply(input_tokens: int, after_events: int) -> tuple[Paused, trio.Event]:
    """A reply ``one two three`` in two text deltas, its usage ``input_tokens`` in and 10
    out, held after its first ``after_events`` SSE events until the returned event is set."""
    resume = trio.Event()
    reply = Reply([Text("one two three", chunks=["one ", "two three"])], usage=(input_tokens, 10))
    return Paused(reply, after_events=after_events, resume=resume), resume


async def a_crashed_hosts_next_task_is_over_budget(
    crashed: Path, session_id: str, make: Callable[[str], ModelProvider]
) -> None:
    """On the data dir a host left as it died mid-stream (``crashed``), the session's next
    task ends ``budget_exceeded`` and sends nothing: the ledger counted the request that
    was under way."""
    async with open_mock_server(Reply([Text("never sent")])) as server:
        async with Host.open(crashed) as host:
            loaded = await host.load_session(session_id, provider=make(server.base_url))
            with trio.fail_after(10):
                again = [o async for o in loaded.run("again")]
        end = again[-1]
        assert isinstance(end, TaskEnd) and end.status == "budget_exceeded", end
        assert server.requests == []


CASES: list[tuple[str, str, list[Fixture], Callable[[str], ModelProvider], list[float]]] = [
    (
        "anthropic",
        "claude-sonnet-4-5-20250929",
        [Fixture("anthropic/thinking_then_tool_use.sse"), Fixture("anthropic/text_only.sse")],
        lambda url: AnthropicProvider(base_url=url, api_key="test-key"),
        # Sonnet 4.5: $3 input, $15 output, $0.30 cache read, $3.75 cache write:
        # $0.004596 + $0.002805 + $0.003072 + $0.00768 = $0.018153, then $0.0003.
        [
            per_million((1532, 3.0), (187, 15.0), (10240, 0.30), (2048, 3.75)),
            per_million((25, 3.0), (15, 15.0)),
        ],
    ),
    (
        "openai",
        "gpt-4o-2024-08-06",
        [Fixture("openai/parallel_tool_calls.sse"), Fixture("openai/text_only.sse")],
        lambda url: OpenAIProvider(base_url=url + "/v1", api_key="k"),
        # gpt-4o: $2.50 input, $10 output.
        [per_million((149, 2.5), (60, 10.0)), per_million((19, 2.5), (10, 10.0))],
    ),
    (
        "openai-responses",
        "gpt-5-mini",
        [
            Fixture("openai_responses/reasoning_tool_call.sse", status=200, headers=SSE),
            Fixture("openai_responses/text_only.sse", status=200, headers=SSE),
        ],
        lambda url: OpenAIResponsesProvider(base_url=url + "/v1", api_key="k"),
        # gpt-5-mini: $0.25 input, $2 output (reasoning included), $0.025 cached input.
        [per_million((120, 0.25), (60, 2.0)), per_million((20, 0.25), (10, 0.025), (8, 2.0))],
    ),
]


@pytest.mark.parametrize(("name", "model", "replies", "make", "expected"), CASES,
                         ids=[case[0] for case in CASES])  # fmt: skip
async def test_a_recorded_task_costs_its_tokens_at_the_list_price(
    tmp_path: Path,
    name: str,
    model: str,
    replies: list[Fixture],
    make: Callable[[str], ModelProvider],
    expected: list[float],
) -> None:
    async with open_mock_server(*replies) as server:
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                provider=make(server.base_url), model=model, workspace_dir=tmp_path
            )
            with trio.fail_after(10):
                outputs: list[Output] = [o async for o in session.run("go", approve=allow)]
        server.assert_clean()
    costs = [o.request.cost_usd for o in outputs if isinstance(o, TokenUsageOutput)]
    assert costs == [pytest.approx(cost, rel=1e-12) for cost in expected]
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.turns == 2, end
    assert end.usage.cost_usd == pytest.approx(sum(expected), rel=1e-12)



async def test_an_interrupted_request_costs_the_input_its_stream_reported(tmp_path: Path) -> None:
    """R-SHARE-3, R-SHARE-4: message_start said 100,000 input tokens ($0.30 on Sonnet 4.5)
    and the task is interrupted mid-answer. The provider bills them, so they are in
    token_usage, task_end, the ledger, and the session's budget: the next task's first
    request could pass max_cost_usd=0.5 and is not sent."""
    # message_start, content_block_start and the first delta
    held, resume = paused_reply(input_tokens=100_000, after_events=3)
    data = tmp_path / "data"
    async with open_mock_server(held) as server, Host.open(data) as host:
        session = await host.create_session(
            provider=AnthropicProvider(base_url=server.base_url, api_key="test-key"),
            model="claude-sonnet-4-5", workspace_dir=tmp_path, max_cost_usd=0.5,
            max_tokens=100,
        )
        outputs: list[Output] = []
        with trio.fail_after(10):
            async for output in session.run("go"):
                outputs.append(output)
                if isinstance(output, PartialText):
                    session.interrupt("enough")
            resume.set()
            second = [o async for o in session.run("again")]
    cost = per_million((100_000, 3.0), (1, 15.0))  # one output delta so far
    assert [o.request.cost_usd for o in outputs if isinstance(o, TokenUsageOutput)] == [
        pytest.approx(cost)
    ]
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "aborted", end
    assert end.usage.cost_usd == pytest.approx(cost)
    assert [r["cost_usd"] for r in ledger_rows(data)] == [pytest.approx(cost)]
    end = second[-1]
    assert isinstance(end, TaskEnd) and end.status == "budget_exceeded", end
    assert len(server.requests) == 1


async def test_steering_a_turn_delivers_counts_in_its_requests_bound(
    tmp_path: Path, gates: Gates
) -> None:
    """R-SHARE-4, R-STEER-2: turn 1 costs $0.12015 on Sonnet 4.5 (40,000 input tokens) and
    calls a tool; while it runs the user steers 480,000 characters (120,000 tokens), which
    turn 2's request carries. Its bound counts them: 120,000+ tokens at the cache-write rate
    ($3.75/M, $0.45) plus 100 output tokens passes max_cost_usd=0.5 on top of what was spent
    — without them, the last context's 40,010 tokens ($0.15) would fit. Turn 2 is not sent,
    and the steering it would have delivered is not recorded as delivered."""
    first = Reply(
        [Text("Waiting."), ToolUse("c1", "wait", {"key": "k"})],
        stop_reason="tool_use",
        usage=(40_000, 10),
    )
    async with open_mock_server(first, Reply([Text("Done.")])) as server:
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                provider=AnthropicProvider(base_url=server.base_url, api_key="test-key"),
                model="claude-sonnet-4-5", tools=[gates.tool()], workspace_dir=tmp_path,
                max_cost_usd=0.5, max_tokens=100,
            )  # fmt: skip
            outputs: list[Output] = []
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:

                    async def run() -> None:
                        outputs.extend([o async for o in session.run("go", approve=allow)])

                    nursery.start_soon(run)
                    await gates.started("k")
                    assert session.steer("x" * 480_000)
                    gates.release("k")
    assert len(server.requests) == 1
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "budget_exceeded", end
    bound = re.search(r"could cost up to \$([\d.]+)", end.message or "")
    assert bound is not None and float(bound.group(1)) > 0.45, end.message
    assert not [o for o in outputs if isinstance(o, UserMsg) and o.kind == "steering"]


async def test_a_streamed_requests_input_is_in_the_ledger_before_its_end(tmp_path: Path) -> None:
    """R-SHARE-3, R-TRACE-5: a streamed request's row is in the ledger as soon as its stream
    reports its input (``message_start``) — status ``started``, that usage and its cost,
    committed to the file while the stream is held — so that a host that dies there leaves
    the request counted: a host opened on the data dir as it was then (the crash's state)
    counts it against the session's ``max_cost_usd`` and sends nothing more. The request's
    end replaces the row: one row a request, its final usage."""
    # message_start, content_block_start and the first delta
    held, resume = paused_reply(input_tokens=100_000, after_events=3)
    data, crashed = tmp_path / "data", tmp_path / "crashed"
    started_cost = per_million((100_000, 3.0))
    async with open_mock_server(held) as server, Host.open(data) as host:
        session = await host.create_session(
            provider=AnthropicProvider(base_url=server.base_url, api_key="test-key"),
            model="claude-sonnet-4-5", workspace_dir=tmp_path, max_cost_usd=0.2,
            max_tokens=100,
        )  # fmt: skip
        outputs: list[Output] = []
        with trio.fail_after(10):
            async for output in session.run("go"):
                outputs.append(output)
                if isinstance(output, PartialText) and not resume.is_set():
                    # The first delta came after message_start: its row is queued; once
                    # the ledger has taken it, the data dir is what a crash would leave.
                    await host.usage_ledger.totals(session.id)
                    (row,) = ledger_rows(data)
                    assert row["status"] == "started" and row["request_key"]
                    assert (row["input"], row["output"]) == (100_000, 1)
                    assert row["cost_usd"] == pytest.approx(started_cost + per_million((1, 15.0)))
                    await trio.to_thread.run_sync(shutil.copytree, data, crashed)
                    resume.set()
    (row_after,) = ledger_rows(data)
    assert row_after["request_key"] == row["request_key"] and row_after["id"] == row["id"]
    assert (row_after["status"], row_after["input"], row_after["output"]) == ("ok", 100_000, 10)
    full = per_million((100_000, 3.0), (10, 15.0))
    assert row_after["cost_usd"] == pytest.approx(full)
    assert [o.request.cost_usd for o in outputs if isinstance(o, TokenUsageOutput)] == [
        pytest.approx(full)
    ]

    await a_crashed_hosts_next_task_is_over_budget(crashed, session.id, anthropic)
    assert [r["status"] for r in ledger_rows(crashed)] == ["started"]


def started_rows_told(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """An event set once a session has handed a ``started`` usage row to the ledger."""
    from greenroom.actors.runtime.port import SessionPort

    told = trio.Event()
    record = SessionPort.record_usage

    def recording(self: SessionPort, *args: object, **kwargs: object) -> None:
        record(self, *args, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("started"):
            told.set()

    monkeypatch.setattr(SessionPort, "record_usage", recording)
    return told


@pytest.mark.parametrize("end", ["completed", "interrupted"])
async def test_a_summary_requests_input_is_in_the_ledger_before_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """R-SHARE-3, R-TRACE-5: a compaction's summary request carries the whole context, so
    its row is in the ledger once its stream reports its input, as a turn's request's is:
    a host that dies there leaves it counted. Its end replaces the row (one row, the same
    key); an interrupt that cuts the summary bills what it reported (its input) and
    replaces the row too."""
    resume = trio.Event()
    summary = Paused(
        Reply([Text("the summary of it all", chunks=["the ", "summary of it all"])],
              usage=(50_000, 10)),
        after_events=3,  # message_start, content_block_start and the first delta
        resume=resume,
    )  # fmt: skip
    data = tmp_path / "data"
    async with open_mock_server(Reply([Text("hello")], usage=(100, 5)), summary) as server:
        async with Host.open(data) as host:
            session = await host.create_session(
                provider=AnthropicProvider(base_url=server.base_url, api_key="test-key"),
                model="claude-sonnet-4-5", workspace_dir=tmp_path,
            )  # fmt: skip
            with trio.fail_after(10):
                [o async for o in session.run("go")]
                told = started_rows_told(monkeypatch)  # the summary's, not the task's
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.compact)
                    await told.wait()
                    await host.usage_ledger.totals(session.id)  # the row taken
                    first, held = ledger_rows(data)
                    assert (first["status"], first["input"]) == ("ok", 100)
                    assert (held["kind"], held["status"], held["input"]) == (
                        "request", "started", 50_000,
                    )  # fmt: skip
                    assert held["request_key"]
                    if end == "interrupted":
                        session.interrupt("enough")
                    else:
                        resume.set()
                resume.set()
                await host.usage_ledger.totals(session.id)
    _, last = ledger_rows(data)
    assert (last["id"], last["request_key"]) == (held["id"], held["request_key"])
    assert last["status"] == "ok"
    assert last["input"] == 50_000
    assert last["output"] == (10 if end == "completed" else 1)
