"""OpenTelemetry export (R-OBS-1): GenAI spans and metrics from a host's outputs.

Spans are collected with the SDK's in-memory exporter: names, attributes and parentage
(task → chat / execute_tool; a subagent's task under its spawn_subagent call), denied and
interrupted calls, content only when opted in. ``test_otel_export.py`` runs ``greenroom
run`` against an OTLP/HTTP receiver.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, Gates, allow_all, collect, model_error
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from greenroom.actors.observers.otel import COST_ATTRIBUTE, GenAIObserver
from greenroom.actors.providers.scripted import Reply, tool_call
from greenroom.actors.providers.scripted import text as text_block
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.tools import make_tool

CONTENT_KEYS = (
    "gen_ai.system_instructions",
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
)


class Telemetry:
    """A host whose sessions are observed, and the spans they produced."""

    def __init__(self, host: Host, exporter: InMemorySpanExporter, metrics: InMemoryMetricReader):
        self.host = host
        self._exporter = exporter
        self._metrics = metrics

    def spans(self) -> list[ReadableSpan]:
        return list(self._exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name.startswith(prefix)]

    def metric_points(self, name: str) -> list[Any]:
        data = self._metrics.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@asynccontextmanager
async def observed(
    data_dir: Path, *, capture_content: bool = False, prices: dict[str, Any] | None = None
) -> AsyncIterator[Telemetry]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    observer = GenAIObserver(
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
        capture_content=capture_content,
    )
    async with Host.open(data_dir, observers=[observer.observe], prices=prices) as host:
        yield Telemetry(host, exporter, reader)


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def attrs_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def has_results(request: ModelRequest) -> bool:
    last = request.messages[-1]
    return isinstance(last, UserMessage) and any(not isinstance(p, TextBlock) for p in last.content)


def tool_then_answer(
    *calls: ToolCallBlock, answer: str = "done"
) -> Callable[[ModelRequest], Reply]:
    def step(request: ModelRequest) -> Reply:
        if has_results(request):
            return Reply(blocks=(text_block(answer),), usage=TokenUsage(input=30, output=4))
        return Reply(blocks=calls, usage=TokenUsage(input=20, output=6, cache_read=5))

    return step


def echo_tool() -> Any:
    async def echo(word: str) -> str:
        return f"echo {word}"

    echo.__doc__ = "Echo a word."
    return make_tool(echo, parallel=True)


async def test_task_chat_and_tool_spans_with_genai_attributes(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-OBS-1: one invoke_agent span per task, the root; a chat span per model request
    attempt and an execute_tool span per call, both its children, with the GenAI
    attributes; no message content without the opt-in."""
    provider = providers(tool_then_answer(tool_call("c1", "echo", word="hi")))
    async with observed(data_dir) as seen:
        session = await seen.host.create_session(
            tools=[echo_tool()], provider=provider, workspace_dir=workspace
        )
        await collect(session.run("say hi", approve=allow_all))
        model = session.settings.model
    (task,) = seen.named("invoke_agent")
    chats = seen.named("chat ")
    (tool,) = seen.named("execute_tool")
    assert task.parent is None
    assert attrs_of(task)["gen_ai.operation.name"] == "invoke_agent"
    assert attrs_of(task)["gen_ai.conversation.id"] == session.id
    assert attrs_of(task)["gen_ai.provider.name"] == "scripted"
    assert attrs_of(task)["gen_ai.usage.input_tokens"] == 50
    assert task.status.status_code is StatusCode.UNSET

    assert [c.name for c in chats] == [f"chat {model}"] * 2
    assert all(parent_of(c) == span_id(task) for c in chats)
    first = attrs_of(chats[0])
    assert first["gen_ai.operation.name"] == "chat"
    assert first["gen_ai.request.model"] == model
    assert first["gen_ai.response.model"] == model
    assert (first["gen_ai.usage.input_tokens"], first["gen_ai.usage.output_tokens"]) == (20, 6)
    assert first["gen_ai.usage.cache_read.input_tokens"] == 5
    assert first["gen_ai.response.finish_reasons"] == ("tool_use",)
    assert attrs_of(chats[1])["gen_ai.response.finish_reasons"] == ("end_turn",)

    assert tool.name == "execute_tool echo"
    assert parent_of(tool) == span_id(task)
    tool_attrs = attrs_of(tool)
    assert tool_attrs["gen_ai.tool.name"] == "echo"
    assert tool_attrs["gen_ai.tool.call.id"] == "c1"
    assert tool_attrs["gen_ai.tool.type"] == "function"
    assert tool_attrs["greenroom.tool.status"] == "ok"
    assert "error.type" not in tool_attrs
    # The call ran between the two requests.
    assert chats[0].end_time <= tool.start_time <= tool.end_time <= chats[1].start_time
    assert task.start_time <= chats[0].start_time and chats[1].end_time <= task.end_time

    for span in seen.spans():
        assert not set(CONTENT_KEYS) & set(attrs_of(span)), span.name


async def test_spans_carry_the_cost_when_the_price_is_known(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-SHARE-3: each chat span carries its request's cost and the invoke_agent span the
    task's, as greenroom.usage.cost_usd; with no price, no such attribute."""
    prices = {"scripted": {"input": 2.0, "output": 10.0, "cache_read": 0.5}}
    provider = providers(tool_then_answer(tool_call("c1", "echo", word="hi")))
    async with observed(data_dir, prices=prices) as seen:
        session = await seen.host.create_session(
            tools=[echo_tool()], provider=provider, workspace_dir=workspace
        )
        await collect(session.run("say hi", approve=allow_all))
    (task,) = seen.named("invoke_agent")
    chats = seen.named("chat ")
    first = (20 * 2.0 + 6 * 10.0 + 5 * 0.5) / 1e6
    second = (30 * 2.0 + 4 * 10.0) / 1e6
    assert [attrs_of(c)[COST_ATTRIBUTE] for c in chats] == [
        pytest.approx(first), pytest.approx(second)
    ]
    assert attrs_of(task)[COST_ATTRIBUTE] == pytest.approx(first + second)
    async with observed(data_dir / "unpriced") as seen:
        session = await seen.host.create_session(
            tools=[echo_tool()],
            provider=providers(tool_then_answer(tool_call("c1", "echo", word="hi"))),
            workspace_dir=workspace,
        )
        await collect(session.run("say hi", approve=allow_all))
    assert all(COST_ATTRIBUTE not in attrs_of(span) for span in seen.spans())


async def test_message_content_only_when_opted_in(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-OBS-1: with the opt-in, the prompt, the model's output, the tool's arguments and
    result are exported."""
    provider = providers(tool_then_answer(tool_call("c1", "echo", word="hi"), answer="bye"))
    async with observed(data_dir, capture_content=True) as seen:
        session = await seen.host.create_session(
            tools=[echo_tool()], provider=provider, workspace_dir=workspace
        )
        await collect(session.run("say hi", approve=allow_all))
    (task,) = seen.named("invoke_agent")
    (tool,) = seen.named("execute_tool")
    chats = seen.named("chat ")
    prompt = json.loads(attrs_of(task)["gen_ai.input.messages"])
    assert prompt == [{"role": "user", "parts": [{"type": "text", "content": "say hi"}]}]
    assert "bye" in attrs_of(task)["gen_ai.output.messages"]
    first_output = json.loads(attrs_of(chats[0])["gen_ai.output.messages"])
    assert first_output[0]["parts"] == [
        {"type": "tool_call", "id": "c1", "name": "echo", "arguments": {"word": "hi"}}
    ]
    assert json.loads(attrs_of(tool)["gen_ai.tool.call.arguments"]) == {"word": "hi"}
    assert attrs_of(tool)["gen_ai.tool.call.result"] == "echo hi"
    # R-OBS-2: a session without a system prompt has no system instructions to show.
    for span in seen.spans():
        assert "gen_ai.system_instructions" not in attrs_of(span), span.name


async def test_denied_call_is_marked(data_dir: Path, workspace: Path, providers) -> None:
    """R-OBS-1: a denied call has its execute_tool span, marked denied, as an error."""
    provider = providers(tool_then_answer(tool_call("c1", "echo", word="hi")))
    async with observed(data_dir) as seen:
        session = await seen.host.create_session(
            tools=[echo_tool()], provider=provider, workspace_dir=workspace
        )
        await collect(session.run("say hi", approve=lambda call: "deny"))
    (tool,) = seen.named("execute_tool")
    tool_attrs = attrs_of(tool)
    assert tool_attrs["greenroom.tool.status"] == "denied"
    assert tool_attrs["greenroom.approval.decision"] == "deny"
    assert tool_attrs["error.type"] == "denied"
    assert tool.status.status_code is StatusCode.ERROR


async def test_interrupted_call_and_task_are_marked(
    data_dir: Path, workspace: Path, providers, gates: Gates
) -> None:
    """R-OBS-1: interrupting a task while its tool runs ends the tool span interrupted
    and the task span aborted, with the abort's reason as an event."""
    provider = providers(tool_then_answer(tool_call("c1", "wait", key="a")))
    async with observed(data_dir) as seen:
        session = await seen.host.create_session(
            tools=[gates.tool()], provider=provider, workspace_dir=workspace
        )
        stream = session.run("wait", approve=allow_all)
        await gates.started("a")
        session.interrupt("stop now")
        await collect(stream)
    (tool,) = seen.named("execute_tool")
    (task,) = seen.named("invoke_agent")
    assert attrs_of(tool)["greenroom.tool.status"] == "interrupted"
    assert attrs_of(tool)["error.type"] == "interrupted"
    assert attrs_of(task)["error.type"] == "aborted"
    assert task.status.status_code is StatusCode.ERROR
    assert [e.name for e in task.events] == ["abort"]
    assert (task.events[0].attributes or {})["greenroom.abort.reason"] == "stop now"


async def test_failed_attempt_has_error_type(data_dir: Path, workspace: Path, providers) -> None:
    """R-OBS-1: a failed model request attempt is a chat span with ``error.type``."""
    provider = providers([Reply(fail=model_error("auth", "bad key"))])
    async with observed(data_dir) as seen:
        session = await seen.host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("hi"))
    (chat,) = seen.named("chat ")
    assert attrs_of(chat)["error.type"] == "auth"
    assert chat.status.status_code is StatusCode.ERROR
    assert chat.status.description == "bad key"
    (task,) = seen.named("invoke_agent")
    assert attrs_of(task)["error.type"] == "auth"


def is_child(request: ModelRequest) -> bool:
    return (request.system or "").startswith(SUBAGENT_SYSTEM)


def task_of(request: ModelRequest) -> str:
    first = request.messages[0]
    assert isinstance(first, UserMessage)
    return "".join(p.text for p in first.content if isinstance(p, TextBlock))


async def test_subagent_task_is_under_its_spawn_call(
    data_dir: Path, workspace: Path, providers
) -> None:
    """R-OBS-1, R-HOST-4: each subagent's invoke_agent span is a child of the
    spawn_subagent execute_tool span that started it (two side by side, told apart by
    their tasks); the subagent's own requests are under its task span. R-OBS-2: with
    capture on, every task and chat span carries as gen_ai.system_instructions the system
    prompt its session's requests were sent: the root's own, a subagent's its own."""
    parent_step = tool_then_answer(
        tool_call("s1", SPAWN_SUBAGENT, task="first job"),
        tool_call("s2", SPAWN_SUBAGENT, task="second job"),
    )

    def brain(request: ModelRequest) -> Reply:
        if is_child(request):
            return Reply(blocks=(text_block(f"did {task_of(request)}"),))
        return parent_step(request)

    provider = providers(brain)
    async with observed(data_dir, capture_content=True) as seen:
        session = await seen.host.create_session(
            tools=[spawn_subagent],
            provider=provider,
            workspace_dir=workspace,
            max_subagents_concurrent=2,
            system="Delegate what you can.",
        )
        await collect(session.run("delegate", approve=allow_all))
    (child_system,) = {r.system for r in provider.requests if is_child(r)}
    for span in seen.spans():
        if span.name.startswith(("invoke_agent", "chat ")):
            is_root = attrs_of(span)["gen_ai.conversation.id"] == session.id
            system = "Delegate what you can." if is_root else child_system
            instructions = json.loads(attrs_of(span)["gen_ai.system_instructions"])
            assert instructions == [{"type": "text", "content": system}], span.name
    tasks = seen.named("invoke_agent")
    (root,) = [t for t in tasks if t.parent is None]
    spawns = {attrs_of(s)["gen_ai.tool.call.id"]: s for s in seen.named("execute_tool")}
    assert set(spawns) == {"s1", "s2"}
    assert all(parent_of(s) == span_id(root) for s in spawns.values())
    children = [t for t in tasks if t.parent is not None]
    assert len(children) == 2
    by_parent = {parent_of(t): t for t in children}
    assert set(by_parent) == {span_id(spawns["s1"]), span_id(spawns["s2"])}
    for call_id, job in (("s1", "first job"), ("s2", "second job")):
        child = by_parent[span_id(spawns[call_id])]
        assert job in attrs_of(child)["gen_ai.input.messages"]
        child_id = attrs_of(child)["gen_ai.conversation.id"]
        assert child_id != session.id
        assert tuple(attrs_of(child)["greenroom.origin"]) == (session.id, child_id)
        (child_chat,) = [c for c in seen.named("chat ") if parent_of(c) == span_id(child)]
        assert attrs_of(child_chat)["gen_ai.conversation.id"] == child_id
        spawn = spawns[call_id]
        assert spawn.start_time <= child.start_time <= child.end_time <= spawn.end_time


async def test_compaction_is_its_own_span(data_dir: Path, workspace: Path, providers) -> None:
    """R-OBS-1: a manual compaction is a ``compaction`` span (no task around it)."""
    provider = providers(
        [
            Reply(blocks=(text_block("Hello."),)),
            Reply(blocks=(text_block("[summary]greeted[/summary]"),)),
        ]
    )
    async with observed(data_dir) as seen:
        session = await seen.host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("hi"))
        with trio.fail_after(RUN_TIMEOUT_S):
            end = await session.compact()
        assert end is not None and end.status == "ok"
    (compaction,) = seen.named("compaction")
    assert compaction.parent is None
    assert attrs_of(compaction)["greenroom.compaction.reason"] == "manual"
    assert attrs_of(compaction)["greenroom.compaction.status"] == "ok"
    assert attrs_of(compaction)["gen_ai.conversation.id"] == session.id


async def test_token_and_duration_metrics(data_dir: Path, workspace: Path, providers) -> None:
    """R-OBS-1: gen_ai.client.token.usage (input and output) and
    gen_ai.client.operation.duration are recorded when a meter provider is configured.
    R-OBS-2: their gen_ai.response.model is the model the provider named."""
    reply = Reply(
        blocks=(text_block("Hello."),), usage=TokenUsage(input=7, output=3), model="snapshot-1"
    )
    provider = providers([reply])
    async with observed(data_dir) as seen:
        session = await seen.host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("hi"))
    tokens = seen.metric_points("gen_ai.client.token.usage")
    by_type = {dict(p.attributes)["gen_ai.token.type"]: p.sum for p in tokens}
    assert by_type == {"input": 7, "output": 3}
    durations = seen.metric_points("gen_ai.client.operation.duration")
    operations = {dict(p.attributes)["gen_ai.operation.name"] for p in durations}
    assert operations == {"chat", "invoke_agent"}
    for point in [*tokens, *durations]:
        assert dict(point.attributes)["gen_ai.response.model"] == "snapshot-1"
        assert dict(point.attributes)["gen_ai.request.model"] == session.settings.model


async def test_a_loaded_session_is_observed(data_dir: Path, workspace: Path, providers) -> None:
    """R-OBS-1: sessions loaded from the data dir are observed like new ones."""
    provider = providers([Reply(blocks=(text_block("one"),)), Reply(blocks=(text_block("two"),))])
    async with Host.open(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await collect(session.run("first"))
    async with observed(data_dir) as seen:
        loaded = await seen.host.load_session(session.id, provider=provider)
        await collect(loaded.run("second"))
    (task,) = seen.named("invoke_agent")
    assert attrs_of(task)["gen_ai.conversation.id"] == session.id


class _Settings:
    provider = "scripted"
    model = "m"
    base_url = None
    max_tokens = 100


class _Root:
    """What the observer reads of a session: its id and settings."""

    id = "root"
    settings = _Settings()


def test_subagents_started_out_of_order_find_their_own_spawn_call() -> None:
    """R-OBS-1: children whose tasks start in another order than their spawn calls (their
    sessions are created concurrently) are matched to the call by their task."""
    from greenroom.protocols.outputs import ApprovalDecision, ModelMsg, TaskStart, UserMsg

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = GenAIObserver(tracer_provider=provider, capture_content=False)
    root: Any = _Root()
    batch: list[Any] = [
        UserMsg(session_id="root", run_id="r", kind="prompt", content=(TextBlock(text="go"),)),
        TaskStart(session_id="root", run_id="r", input_seq=1),
    ]
    for call_id, job in (("s1", "first job"), ("s2", "second job")):
        call = tool_call(call_id, SPAWN_SUBAGENT, task=job)
        batch.append(ModelMsg(session_id="root", run_id="r", turn=1, block=call))
    for call_id in ("s1", "s2"):
        batch.append(
            ApprovalDecision(
                session_id="root",
                run_id="r",
                call_id=call_id,
                tool=SPAWN_SUBAGENT,
                decision="allow",
                by="host",
            )
        )
    for child, job in (("kid2", "second job"), ("kid1", "first job")):
        origin = ("root", child)
        batch.append(
            UserMsg(
                session_id=child,
                run_id="c",
                origin=origin,
                kind="prompt",
                content=(TextBlock(text=job),),
            )
        )
        batch.append(TaskStart(session_id=child, run_id="c", origin=origin, input_seq=1))
    observer.on_batch(root, batch)
    observer.close()
    spans = list(exporter.get_finished_spans())
    calls = {attrs_of(s)["gen_ai.tool.call.id"]: s for s in spans if s.name.startswith("execute")}
    kids = {
        attrs_of(s)["gen_ai.conversation.id"]: s
        for s in spans
        if s.parent is not None and s.name == "invoke_agent"
    }
    assert parent_of(kids["kid1"]) == span_id(calls["s1"])
    assert parent_of(kids["kid2"]) == span_id(calls["s2"])
