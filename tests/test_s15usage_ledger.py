"""The usage ledger's durability (R-SHARE-3, R-SHARE-4, R-TRACE-5): a request the provider
bills has its ledger row before anything of its stream is handed on, and a request whose
provider reports usage only at its end (OpenAI's chat completions and Responses) is counted
at its estimated input when its stream is cut, the row flagged ``estimated``.

A copy of the data dir taken the moment a stream's first event reaches the client, with no
flush asked, is what a host killed (SIGKILL) there leaves: the ledger in the copy must hold
the request. The clock stands still in those tests (``mock_clock``), so that nothing that
waits on time can write the row in between: what is on disk then was committed before the
event was handed on. The real clients run against the loopback mock server."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import attrs
import pytest
import trio
import trio.testing
from conftest import ledger_rows
from test_cost_wire import (
    a_crashed_hosts_next_task_is_over_budget,
    anthropic,
    paused_reply,
    per_million,
)
from test_trace_sink import running_sink, write_old_ledger

from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import ModelProvider
from greenroom.actors.runtime.session import RunStream, Session
from greenroom.actors.runtime.trace_sink import LEDGER_FILE_NAME, usage_report
from greenroom.protocols.budgets import estimate_input_tokens
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.hooks import Hooks, RequestInfo
from greenroom.protocols.outputs import Output, PartialText, TaskEnd, TokenUsageOutput
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import UsageQuery, UsageRow
from tests.support.mock_model_server import (
    DropAfter,
    ErrorReply,
    Reply,
    Text,
    open_mock_server,
)

PROMPT = "word " * 80_000
"""400,000 characters: about 100,000 input tokens, which the budgets below notice."""


def _openai(url: str) -> ModelProvider:
    return OpenAIProvider(base_url=url + "/v1", api_key="k")


def _responses(url: str) -> ModelProvider:
    return OpenAIResponsesProvider(base_url=url + "/v1", api_key="k")


class OpenAICase(NamedTuple):
    """A provider whose stream reports its usage only at its end: (provider, model, its
    input and output rates, the SSE events before the first text delta and that delta)."""

    name: str
    make: Callable[[str], ModelProvider]
    model: str
    rate: float
    before_delta: int


OPENAI_CASES = [
    OpenAICase("openai", _openai, "gpt-4o", 2.5, 2),  # the role chunk, then the first delta
    # response.created, output_item.added, then the first delta
    OpenAICase("openai-responses", _responses, "gpt-4.1", 2.0, 3),
]


@pytest.fixture(params=OPENAI_CASES, ids=[case.name for case in OPENAI_CASES])
def openai_case(request: pytest.FixtureRequest) -> OpenAICase:
    case: OpenAICase = request.param
    return case


async def _openai_session(
    host: Host,
    case: OpenAICase,
    url: str,
    workspace: Path,
    max_cost_usd: float,
    requests: _Requests,
) -> Session:
    """A session on the case's provider (served at ``url``) that keeps its requests in
    ``requests``, its answers at most 100 tokens."""
    return await host.create_session(
        provider=case.make(url), model=case.model, workspace_dir=workspace,
        max_cost_usd=max_cost_usd, max_tokens=100, hooks=Hooks(before_request=requests),
    )  # fmt: skip


async def _copied_at_first_delta(
    stream: RunStream, resume: trio.Event, data: Path, crashed: Path
) -> list[dict[str, object]]:
    """Read the task's stream to its end. At its first text delta, copy the data dir to
    ``crashed`` (what a SIGKILL then would leave: nobody asked for a flush), then let the
    held reply go on (``resume``). The ledger's rows at that moment."""
    seen: list[dict[str, object]] = []
    async for output in stream:
        if isinstance(output, PartialText) and not resume.is_set():
            seen = ledger_rows(data)
            await trio.to_thread.run_sync(shutil.copytree, data, crashed)
            resume.set()
    return seen


class _Requests:
    """A ``before_request`` hook that keeps every request the session sends."""

    def __init__(self) -> None:
        self.sent: list[ModelRequest] = []

    def __call__(self, info: RequestInfo) -> None:
        self.sent.append(info.request)


async def test_a_started_row_is_on_disk_before_the_streams_first_event_is_handed_on(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """R-SHARE-3: message_start reports 100,000 input tokens; when the first text delta
    reaches the client, the ledger file already holds the request's ``started`` row with
    that input and its cost (nobody flushed it: the streamer waited for its commit before
    handing the batch on). A host opened on the data dir as it was then counts it against
    ``max_cost_usd`` and sends nothing more. Before, the row waited up to a quarter of a
    second for company: a host killed meanwhile left a billed request with no row."""
    # message_start, content_block_start and the first delta
    held, resume = paused_reply(input_tokens=100_000, after_events=3)
    data, crashed = tmp_path / "data", tmp_path / "crashed"
    async with open_mock_server(held) as server, Host.open(data) as host:
        session = await host.create_session(
            provider=anthropic(server.base_url),
            model="claude-sonnet-4-5", workspace_dir=tmp_path, max_cost_usd=0.2,
            max_tokens=100,
        )  # fmt: skip
        seen = await _copied_at_first_delta(session.run("go"), resume, data, crashed)
    assert [(r["status"], r["input"], r.get("estimated")) for r in seen] == [
        ("started", 100_000, 0)
    ]
    assert seen[0]["cost_usd"] == pytest.approx(per_million((100_000, 3.0), (1, 15.0)))
    (row,) = ledger_rows(data)
    assert (row["request_key"], row["status"], row["output"]) == (seen[0]["request_key"], "ok", 10)
    assert seen[0]["run_id"] == row["run_id"] and row["run_id"]
    assert seen[0]["turn"] == row["turn"] == 1
    await a_crashed_hosts_next_task_is_over_budget(crashed, session.id, anthropic)


async def test_an_openai_stream_has_an_estimated_row_before_its_first_event_is_handed_on(
    tmp_path: Path,
    mock_clock: trio.testing.MockClock,
    openai_case: OpenAICase,
) -> None:
    """R-SHARE-3, R-SHARE-4: an OpenAI stream reports its usage only at its end. When its
    first text delta reaches the client, the ledger file holds the request's ``started``
    row at its estimated input (the budgets' estimate of the request sent), flagged
    ``estimated``: a host opened on the data dir as it was then counts it against
    ``max_cost_usd`` and sends nothing. The end replaces the row with the usage the
    provider reported, no longer an estimate. Before, nothing was written until the end:
    a host that died mid-stream left the request uncounted."""
    rate, before_delta = openai_case.rate, openai_case.before_delta
    held, resume = paused_reply(input_tokens=90_000, after_events=before_delta + 1)
    data, crashed = tmp_path / "data", tmp_path / "crashed"
    requests = _Requests()
    async with open_mock_server(held) as server, Host.open(data) as host:
        session = await _openai_session(host, openai_case, server.base_url, tmp_path, 0.3, requests)
        seen = await _copied_at_first_delta(session.run(PROMPT), resume, data, crashed)
        server.assert_clean()
    (sent,) = requests.sent
    estimate = estimate_input_tokens(sent)
    assert estimate >= 100_000
    assert [(r["status"], r["input"], r["output"], r.get("estimated")) for r in seen] == [
        ("started", estimate, 0, 1)
    ]
    assert seen[0]["cost_usd"] == pytest.approx(per_million((estimate, rate)))
    (row,) = ledger_rows(data)
    assert (row["request_key"], row["status"]) == (seen[0]["request_key"], "ok")
    assert (row["input"], row["output"], row["estimated"]) == (90_000, 10, 0)
    await a_crashed_hosts_next_task_is_over_budget(crashed, session.id, openai_case.make)


async def test_an_interrupted_openai_request_costs_its_estimated_input(
    tmp_path: Path,
    openai_case: OpenAICase,
) -> None:
    """R-SHARE-3, R-SHARE-4: an OpenAI request interrupted mid-answer never gets its usage
    (it comes at the stream's end), but the provider bills its input. It is counted at its
    estimated input: in ``token_usage``, ``task_end``, the ledger (the row flagged
    ``estimated``) and the session's budget, so the next task's first request, which
    could pass ``max_cost_usd``, is not sent. Before, the cut request cost nothing."""
    rate, before_delta = openai_case.rate, openai_case.before_delta
    held, resume = paused_reply(input_tokens=90_000, after_events=before_delta + 1)
    data = tmp_path / "data"
    requests = _Requests()
    async with open_mock_server(held) as server, Host.open(data) as host:
        session = await _openai_session(host, openai_case, server.base_url, tmp_path, 0.4, requests)
        outputs: list[Output] = []
        with trio.fail_after(20):
            async for output in session.run(PROMPT):
                outputs.append(output)
                if isinstance(output, PartialText):
                    session.interrupt("enough")
            resume.set()
            second = [o async for o in session.run("again")]
        assert len(server.requests) == 1
    (sent,) = requests.sent
    estimate = estimate_input_tokens(sent)
    cost = per_million((estimate, rate))
    usage = [o.request for o in outputs if isinstance(o, TokenUsageOutput)]
    assert [(u.input, u.output) for u in usage] == [(estimate, 0)]
    assert usage[0].cost_usd == pytest.approx(cost)
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "aborted", end
    assert end.usage.cost_usd == pytest.approx(cost)
    rows = ledger_rows(data)
    assert [(r["status"], r["input"], r["output"], r["estimated"]) for r in rows] == [
        ("ok", estimate, 0, 1)
    ]
    assert rows[0]["cost_usd"] == pytest.approx(cost)
    end = second[-1]
    assert isinstance(end, TaskEnd) and end.status == "budget_exceeded", end


async def test_an_openai_stream_cut_by_the_network_is_billed_at_its_estimate(
    tmp_path: Path,
) -> None:
    """R-SHARE-3, R-RETRY-2: the connection drops after the first delta of a chat
    completion; the attempt is retried and the retry completes. The cut attempt was
    billed for its input: it has its own ``token_usage`` and ledger row at its estimate
    (flagged), the retry its reported usage, and the task's usage is their sum."""
    reply = Reply([Text("one two three", chunks=["one ", "two three"])], usage=(90_000, 10))
    data = tmp_path / "data"
    requests = _Requests()
    cut = DropAfter(reply, after_events=2)  # the role chunk and the first delta
    async with open_mock_server(cut, reply) as server, Host.open(data) as host:
        session = await host.create_session(
            provider=_openai(server.base_url), model="gpt-4o", workspace_dir=tmp_path,
            max_tokens=100, hooks=Hooks(before_request=requests),
        )  # fmt: skip
        with trio.fail_after(20):
            outputs = [o async for o in session.run(PROMPT)]
    first, _ = requests.sent
    estimate = estimate_input_tokens(first)
    usage = [o.request for o in outputs if isinstance(o, TokenUsageOutput)]
    assert [(u.input, u.output) for u in usage] == [(estimate, 0), (90_000, 10)]
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed", end
    assert end.usage.cost_usd == pytest.approx(
        per_million((estimate, 2.5)) + per_million((90_000, 2.5), (10, 10.0))
    )
    rows = ledger_rows(data)
    assert [(r["status"], r["input"], r["output"], r["estimated"]) for r in rows] == [
        ("ok", estimate, 0, 1),
        ("ok", 90_000, 10, 0),
    ]


async def test_an_openai_request_refused_before_its_stream_began_costs_nothing(
    tmp_path: Path,
    openai_case: OpenAICase,
) -> None:
    """A request the provider refuses (an HTTP error, no stream) is not billed: no
    estimate is written for it, and nothing is spent."""
    make, model = openai_case.make, openai_case.model
    refused = ErrorReply.openai(400, "invalid_request_error", "no such thing")
    data = tmp_path / "data"
    async with open_mock_server(refused) as server, Host.open(data) as host:
        session = await host.create_session(
            provider=make(server.base_url), model=model, workspace_dir=tmp_path,
        )  # fmt: skip
        with trio.fail_after(20):
            outputs = [o async for o in session.run(PROMPT)]
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "failed", end
    assert not any(isinstance(o, TokenUsageOutput) for o in outputs)
    assert ledger_rows(data) == []


async def test_a_ledger_from_before_estimates_gains_the_column(tmp_path: Path) -> None:
    """R-TRACE-5: a ledger written before estimates were flagged is read as before, and
    the sink that opens it adds the ``estimated`` column: its old rows keep NULL there, an
    estimated row that replaces its started one has 1, and the reports count both."""
    ledger = tmp_path / LEDGER_FILE_NAME
    write_old_ledger(
        ledger,
        "INSERT INTO usage (at, session_id, kind, provider, model, input, total, status,"
        " cost_usd) VALUES (10.0, 'old', 'request', 'openai', 'gpt-4o', 1000, 1000, 'ok',"
        " 0.0025)",
        "cost_usd REAL",
        "principal TEXT",
        "root_id TEXT",
        "request_key TEXT",
    )
    started = UsageRow(at=20.0, session_id="new", run_id="r1", turn=1, kind="request",
                       provider="openai", model="gpt-4o",
                       usage=TokenUsage(input=400, cost_usd=0.001), status="started",
                       request_key="k", estimated=True)  # fmt: skip
    with trio.fail_after(20):
        async with running_sink(tmp_path) as sink:
            sink.record_usage(started)
            await sink.flush_usage()
            sink.record_usage(attrs.evolve(started, status="ok"))
    rows = ledger_rows(tmp_path)
    assert [(r["session_id"], r["status"], r["input"], r["estimated"]) for r in rows] == [
        ("old", "ok", 1000, None),
        ("new", "ok", 400, 1),
    ]
    (line,) = usage_report(ledger, UsageQuery(by=None))
    assert (line.requests, line.input) == (2, 1400)
    assert line.cost_usd == pytest.approx(0.0035)
