"""OpenTelemetry export (R-OBS-1): tasks, model requests and tool calls as GenAI spans.

An observer of outputs at the rim of the runtime, never inside it: the host calls
:meth:`GenAIObserver.observe` with each session it creates or loads, and the observer
watches it from a task of its own (``Session.watch``, R-ACTOR-1), so no span is made in
the publishing task. Subagents are not watched on their own: their outputs reach the
parent's watchers with ``origin`` (root first), so one watch per root session sees the
whole tree, in order.

The spans (GenAI semantic conventions):

    invoke_agent            task_start → task_end; gen_ai.conversation.id = session id
      chat {model}          request_begin → request_end, one per attempt
      execute_tool {tool}   approval_decision (or the model's tool_call) → tool_call_output
        invoke_agent        a subagent's task, under its spawn_subagent call
      compaction            compaction_begin → compaction_end

Times are the outputs' arrival times at the observer's task: it waits on nothing but its
inbox and runs as soon as the publishing task yields, so the batch's arrival is when it
happened (to the batching's resolution).

Token counts are the conventions' ``gen_ai.usage.*`` attributes of the chat and
invoke_agent spans; their cost in USD (R-SHARE-3), which the conventions do not define, is
``greenroom.usage.cost_usd`` on the same spans, absent when the model's price is unknown.

Finish reasons are the provider's own words (R-OBS-2): the codecs report Anthropic's, which
an OpenAI span maps back to OpenAI's; output messages carry the conventions' own
``finish_reason``. ``gen_ai.response.model`` is the model the provider named in its response
(``request_end.response_model``: often a dated snapshot of the one requested), the requested
one when it named none. A failed attempt's ``error.type`` is the provider's HTTP status when it
answered one (a 429 is ``429``, not the ``timeout`` the retry policy calls it).

Message content (the system prompt, prompts, the history each request was sent, model text,
tool arguments and results) is exported only when
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` is ``true``.

This module imports OpenTelemetry; nothing else in greenroom imports it, so without the
``otel`` extra (or with export off) nothing of it is loaded.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, assert_never
from urllib.parse import urlsplit

import trio
from opentelemetry import trace
from opentelemetry.metrics import Histogram, MeterProvider, NoOpMeterProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider

from greenroom.actors.providers.registry import server_url
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, subagent_system
from greenroom.protocols.content import (
    ImageBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    Rewind,
    SteeringQueuedOutput,
    TaskEnd,
    TaskQueuedOutput,
    TaskQueueDropped,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    ToolHook,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.stream import TokenUsage

if TYPE_CHECKING:
    from greenroom.actors.runtime.session import Session

COST_ATTRIBUTE = "greenroom.usage.cost_usd"
"""The span attribute holding a request's (chat) or a task's (invoke_agent) cost in USD."""

logger = logging.getLogger(__name__)

__all__ = [
    "CAPTURE_CONTENT_ENV",
    "COST_ATTRIBUTE",
    "GenAIObserver",
    "capture_content_from_env",
    "export_configured",
    "exporting",
    "otlp_protocol",
]

CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
METRICS_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
INSTRUMENTATION = "greenroom"

# greenroom's provider names that differ from the conventions' well-known values.
_GENAI_PROVIDERS = {"openai-responses": "openai"}

# The codecs report every stop reason in one vocabulary (Anthropic's words); an OpenAI span
# reports what OpenAI says (its chat completions finish_reason), as the conventions ask
# for gen_ai.response.finish_reasons. Anthropic's words are already Anthropic's.
_OPENAI_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "refusal": "content_filter",
}
_FINISH_REASONS_OF_PROVIDER = {"openai": _OPENAI_FINISH_REASONS}

# The output messages' finish_reason is the conventions' own enumeration, whatever the
# provider: stop, length, content_filter, tool_call, error.
_MESSAGE_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_call",
    "max_tokens": "length",
    "refusal": "content_filter",
}

# Bucket boundaries the GenAI metric conventions advise.
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
_DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)


def export_configured(environ: dict[str, str] | None = None) -> bool:
    """Whether the standard variables name an OTLP endpoint for traces."""
    env = os.environ if environ is None else environ
    return any(env.get(name) for name in ENDPOINT_ENVS)


def capture_content_from_env(environ: dict[str, str] | None = None) -> bool:
    """Whether the user opted in to exporting message content."""
    env = os.environ if environ is None else environ
    return env.get(CAPTURE_CONTENT_ENV, "").strip().lower() == "true"


class _Agent:
    """What is open for one session's task: its spans and the tool calls it has seen."""

    __slots__ = (
        "chat",
        "chat_began",
        "chat_model",
        "chat_output",
        "chat_usage",
        "child_of_call",
        "compaction",
        "compaction_began",
        "finish_reason",
        "instructions",
        "prompt",
        "response_model",
        "task",
        "texts",
        "tool_calls",
        "tools",
    )

    def __init__(self) -> None:
        self.task: Span | None = None
        self.chat: Span | None = None
        self.chat_began = 0
        self.chat_model = ""
        self.chat_output: list[dict[str, Any]] = []
        # The attempt's token counts, recorded as a metric at its end, when the model that
        # answered is known.
        self.chat_usage: TokenUsage | None = None
        self.response_model: str | None = None  # the model that answered the last request
        # gen_ai.system_instructions of the session's requests, made once (with capture).
        self.instructions: str | None = None
        self.compaction: Span | None = None
        self.compaction_began = 0
        self.tools: dict[str, _ToolSpan] = {}
        self.tool_calls: dict[str, tuple[ToolCallBlock, int]] = {}
        self.prompt = ""
        self.texts: list[str] = []
        self.child_of_call: str | None = None
        self.finish_reason: str | None = None  # the stop reason of the task's last request


class _Conversation:
    """The messages a session's model has been sent, as the conventions' input messages:
    what the observer saw since it began watching (prompts, steering, the model's
    messages, tool results; a compaction leaves its summary). The system prompt goes apart,
    as ``gen_ai.system_instructions``; a loaded session's earlier history is not in the
    outputs, so not here."""

    __slots__ = ("messages",)

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    def add(self, role: str, parts: list[dict[str, Any]]) -> None:
        """Append one message of ``role`` (``user``, ``assistant``, ``tool``)."""
        if parts:
            self.messages.append({"role": role, "parts": parts})

    def compacted(self, summary: str | None) -> None:
        """A compaction replaced the context: what follows starts from its summary."""
        self.messages = []
        if summary:
            self.add("user", [_text_part(summary)])

    def as_json(self) -> str:
        """The messages as the ``gen_ai.input.messages`` JSON string."""
        return json.dumps(self.messages, ensure_ascii=False)


class _ToolSpan:
    __slots__ = ("call", "has_child", "span")

    def __init__(self, span: Span, call: ToolCallBlock | None) -> None:
        self.span = span
        self.call = call
        self.has_child = False


class GenAIObserver:
    """Turns the outputs of the sessions it observes into GenAI spans and metrics.

    ``tracer_provider`` defaults to the global one (a no-op unless the application
    configured it); without ``meter_provider`` no metrics are recorded; ``capture_content``
    defaults to the environment's opt-in. Nothing here blocks or does I/O: the SDK's span
    processor decides when and where spans go."""

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        capture_content: bool | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(INSTRUMENTATION)
        self._metrics = _Metrics(meter_provider)
        self._capture = capture_content_from_env() if capture_content is None else capture_content
        self._clock = clock
        self._agents: dict[str, _Agent] = {}
        # Only with content capture: each session's messages, for its chat spans' input.
        self._conversations: dict[str, _Conversation] = {}

    # -- wiring ------------------------------------------------------------------------

    def observe(self, session: Session) -> None:
        """Watch ``session`` (``Host.open(observers=[observer.observe])``) from a task of
        the host's: each batch published from now on is mapped to spans there. The task
        ends when the session closes, after the session's last batch. A subagent is not
        watched on its own: its outputs reach its root's spans through its parent."""
        if session.parent_id is not None:
            return
        # Unbounded: the publisher never waits on the observer, and the observer waits on
        # nothing but this inbox (making spans does not block: the SDK's processor exports
        # them), so the inbox holds only what was published since the observer's last turn.
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        session.watch(send)
        session.host.start_task(functools.partial(self._follow, session, inbox))

    async def _follow(
        self, session: Session, inbox: trio.MemoryReceiveChannel[list[Output]]
    ) -> None:
        # A task of the host's: whatever fails here must not end the host.
        with inbox:
            async for batch in inbox:
                try:
                    self.on_batch(session, batch)
                except Exception:
                    logger.exception("otel: cannot map the outputs of session %s", session.id)

    def on_batch(self, session: Session, batch: list[Output]) -> None:
        """Map one published batch of ``session`` (and of its subagents, forwarded with
        ``origin``) to spans. Live-only outputs and waits for people make no span."""
        now = self._clock()
        for output in batch:
            self._map(session, output, now)

    def _map(self, session: Session, output: Output, now: int) -> None:
        match output:
            case UserMsg():
                self._on_user_msg(session, output, now)
            case TaskStart():
                self._on_task_start(session, output, now)
            case RequestBegin():
                self._on_request_begin(session, output, now)
            case ModelMsg():
                self._on_model_msg(session, output, now)
            case TokenUsageOutput():
                self._on_token_usage(session, output, now)
            case RequestEnd():
                self._on_request_end(session, output, now)
            case ApprovalDecision():
                self._on_approval_decision(session, output, now)
            case ToolCallOutput():
                self._on_tool_output(session, output, now)
            case CompactionBegin():
                self._on_compaction_begin(session, output, now)
            case CompactionEnd():
                self._on_compaction_end(session, output, now)
            case Abort():
                self._on_abort(session, output, now)
            case TaskEnd():
                self._on_task_end(session, output, now)
            case (
                PartialText()
                | PartialThinking()
                | PartialToolCall()
                | ApprovalRequest()
                | ToolProgress()
                | CallInDoubt()
                | CallResolved()
                | ToolHook()
                | Rewind()
                | TaskQueuedOutput()
                | TaskQueueDropped()
                | SteeringQueuedOutput()
            ):
                # Live text, progress, a wait for a person, a call found in doubt after a
                # restart: no span of their own (the call's result ends its span); what a
                # tool hook did shows as the call's decision (by hook) and result; a rewind
                # comes between tasks.
                pass
            case _:
                assert_never(output)

    def close(self) -> None:
        """End every span still open (a host closing in the middle of a task)."""
        now = self._clock()
        for agent in self._agents.values():
            self._end_open(agent, now, "interrupted")
            if agent.task is not None:
                agent.task.set_status(Status(StatusCode.ERROR, "the host closed"))
                agent.task.end(end_time=now)
        self._agents.clear()

    # -- the mapping -------------------------------------------------------------------

    def _agent(self, session_id: str) -> _Agent:
        agent = self._agents.get(session_id)
        if agent is None:
            agent = self._agents[session_id] = _Agent()
        return agent

    def _conversation(self, session_id: str) -> _Conversation:
        conversation = self._conversations.get(session_id)
        if conversation is None:
            conversation = self._conversations[session_id] = _Conversation()
        return conversation

    def _on_user_msg(self, session: Session, output: UserMsg, now: int) -> None:
        text = "\n".join(b.text for b in output.content if isinstance(b, TextBlock))
        if self._capture:
            self._conversation(output.session_id).add("user", [_text_part(text)])
        if output.kind == "prompt":
            self._agent(output.session_id).prompt = text

    def _on_task_start(self, session: Session, output: TaskStart, now: int) -> None:
        agent = self._agent(output.session_id)
        attributes = _common(session, "invoke_agent")
        attributes["gen_ai.conversation.id"] = output.session_id
        attributes["greenroom.run_id"] = output.run_id
        if output.origin is not None:
            attributes["greenroom.origin"] = list(output.origin)
        if self._capture:
            if agent.prompt:
                attributes["gen_ai.input.messages"] = _messages(
                    "user", [_text_part(agent.prompt)]
                )
            self._add_instructions(attributes, session, agent, output.origin)
        agent.texts = []
        agent.task = self._tracer.start_span(
            "invoke_agent",
            context=self._parent_of_task(output, agent),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=now,
        )

    def _parent_of_task(self, output: TaskStart, agent: _Agent) -> Any:
        """A subagent's task goes under its parent's open ``spawn_subagent`` span: the one
        whose task is the subagent's prompt, else the first without a subagent yet."""
        origin = output.origin
        if origin is None or len(origin) < 2:
            return None
        parent = self._agents.get(origin[-2])
        if parent is None:
            return None
        spawns = [
            (call_id, t)
            for call_id, t in parent.tools.items()
            if not t.has_child and t.call is not None and t.call.name == SPAWN_SUBAGENT
        ]
        chosen = next(
            (
                s
                for s in spawns
                if s[1].call is not None and s[1].call.arguments.get("task") == agent.prompt
            ),
            spawns[0] if spawns else None,
        )
        if chosen is None:
            return trace.set_span_in_context(parent.task) if parent.task is not None else None
        chosen[1].has_child = True
        agent.child_of_call = chosen[0]
        return trace.set_span_in_context(chosen[1].span)

    def _task_context(self, agent: _Agent) -> Any:
        return trace.set_span_in_context(agent.task) if agent.task is not None else None

    def _on_request_begin(self, session: Session, output: RequestBegin, now: int) -> None:
        agent = self._agent(output.session_id)
        if agent.chat is not None:  # an attempt whose end never came: close it first
            agent.chat.end(end_time=now)
            self._record_chat_tokens(session, agent, agent.chat_model)
        model = session.settings.model
        attributes = _common(session, "chat")
        attributes["gen_ai.conversation.id"] = output.session_id
        attributes["greenroom.turn"] = output.turn
        attributes["greenroom.attempt"] = output.attempt
        attributes["gen_ai.request.max_tokens"] = session.settings.max_tokens
        if self._capture:
            attributes["gen_ai.input.messages"] = self._conversation(output.session_id).as_json()
            self._add_instructions(attributes, session, agent, output.origin)
        agent.chat = self._tracer.start_span(
            f"chat {model}",
            context=self._task_context(agent),
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=now,
        )
        agent.chat_began = now
        agent.chat_model = model
        agent.chat_output = []
        agent.chat_usage = None
        agent.texts = []

    @staticmethod
    def _add_instructions(
        attributes: dict[str, Any],
        session: Session,
        agent: _Agent,
        origin: tuple[str, ...] | None,
    ) -> None:
        if agent.instructions is None:  # made once per task
            agent.instructions = _system_instructions(session.settings.system, origin)
        if agent.instructions:
            attributes["gen_ai.system_instructions"] = agent.instructions

    def _on_model_msg(self, session: Session, output: ModelMsg, now: int) -> None:
        agent = self._agent(output.session_id)
        block = output.block
        if isinstance(block, ToolCallBlock):
            agent.tool_calls[block.id] = (block, now)
        if self._capture:
            if isinstance(block, TextBlock):
                agent.texts.append(block.text)
            agent.chat_output.append(_part(block))

    def _on_token_usage(self, session: Session, output: TokenUsageOutput, now: int) -> None:
        agent = self._agent(output.session_id)
        span = agent.chat or agent.compaction
        usage = output.request
        if span is not None:
            span.set_attributes(_usage_attributes(usage))
        if agent.chat is not None:
            agent.chat_usage = usage  # recorded at the attempt's end, with the model's name
        else:
            self._metrics.tokens(session, usage, session.settings.model)

    def _record_chat_tokens(self, session: Session, agent: _Agent, model: str) -> None:
        if agent.chat_usage is not None:
            self._metrics.tokens(session, agent.chat_usage, model)
            agent.chat_usage = None

    def _on_request_end(self, session: Session, output: RequestEnd, now: int) -> None:
        agent = self._agent(output.session_id)
        span = agent.chat
        if span is None:
            return
        agent.chat = None
        # The model the provider says answered (a dated snapshot of an alias, a gateway's
        # routing), else the one requested.
        model = output.response_model or agent.chat_model
        if output.response_model:
            agent.response_model = output.response_model
        span.set_attribute("gen_ai.response.model", model)
        self._record_chat_tokens(session, agent, model)
        if output.response_id:
            span.set_attribute("gen_ai.response.id", output.response_id)
        if output.stop_reason:
            agent.finish_reason = output.stop_reason
            reason = _provider_finish_reason(session.settings.provider, output.stop_reason)
            span.set_attribute("gen_ai.response.finish_reasons", [reason])
        if self._capture and agent.chat_output:
            ended = output.stop_reason if output.status == "ok" else None
            span.set_attribute("gen_ai.output.messages", _output_messages(agent.chat_output, ended))
            if output.status == "ok":
                self._conversation(output.session_id).add("assistant", agent.chat_output)
        error_type = None
        if output.status != "ok":
            # The provider's HTTP status when it answered one (a 429 is a rate limit,
            # not the timeout the retry policy files it under), else greenroom's class.
            error_type = str(output.http_status) if output.http_status else output.status
            span.set_attribute("error.type", error_type)
            if output.retry_in_ms is not None:
                span.set_attribute("greenroom.retry_in_ms", output.retry_in_ms)
            span.set_status(Status(StatusCode.ERROR, output.error_message or output.status))
        span.end(end_time=now)
        seconds = (now - agent.chat_began) / 1e9
        self._metrics.duration(session, "chat", model, seconds, error_type)

    def _on_approval_decision(self, session: Session, output: ApprovalDecision, now: int) -> None:
        agent = self._agent(output.session_id)
        tool = self._start_tool(session, agent, output.call_id, output.tool, now)
        tool.span.set_attribute("greenroom.approval.decision", output.decision)
        tool.span.set_attribute("greenroom.approval.by", output.by)

    def _start_tool(
        self, session: Session, agent: _Agent, call_id: str, name: str, now: int
    ) -> _ToolSpan:
        existing = agent.tools.get(call_id)
        if existing is not None:
            return existing
        seen = agent.tool_calls.pop(call_id, None)
        call = seen[0] if seen is not None else None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.type": "function",
            "gen_ai.conversation.id": session.id,
        }
        if self._capture and call is not None:
            attributes["gen_ai.tool.call.arguments"] = json.dumps(
                call.arguments, ensure_ascii=False
            )
        span = self._tracer.start_span(
            f"execute_tool {name}",
            context=self._task_context(agent),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=now,
        )
        tool = agent.tools[call_id] = _ToolSpan(span, call)
        return tool

    def _on_tool_output(self, session: Session, output: ToolCallOutput, now: int) -> None:
        agent = self._agent(output.session_id)
        tool = agent.tools.pop(output.call_id, None)
        if tool is None:
            # No decision: the call was cut off or interrupted before it was decided, so
            # its span starts when the model made the call.
            seen = agent.tool_calls.get(output.call_id)
            began = seen[1] if seen is not None else now
            tool = self._start_tool(session, agent, output.call_id, output.tool, began)
            agent.tools.pop(output.call_id, None)
        span = tool.span
        span.set_attribute("greenroom.tool.status", output.status)
        if output.is_error:
            span.set_attribute("error.type", output.status)
            span.set_status(Status(StatusCode.ERROR, output.status))
        if self._capture:
            result = _tool_result(output)
            span.set_attribute("gen_ai.tool.call.result", result)
            self._conversation(output.session_id).add(
                "tool", [{"type": "tool_call_response", "id": output.call_id, "result": result}]
            )
        span.end(end_time=now)

    def _on_compaction_begin(self, session: Session, output: CompactionBegin, now: int) -> None:
        agent = self._agent(output.session_id)
        if agent.compaction is not None:
            agent.compaction.end(end_time=now)
        agent.compaction = self._tracer.start_span(
            "compaction",
            context=self._task_context(agent),
            kind=SpanKind.INTERNAL,
            attributes={
                "gen_ai.conversation.id": output.session_id,
                "greenroom.run_id": output.run_id,
                "greenroom.compaction.reason": output.reason,
            },
            start_time=now,
        )
        agent.compaction_began = now

    def _on_compaction_end(self, session: Session, output: CompactionEnd, now: int) -> None:
        agent = self._agent(output.session_id)
        span = agent.compaction
        if span is None:
            return
        agent.compaction = None
        if self._capture and output.status == "ok":
            self._conversation(output.session_id).compacted(output.summary)
        span.set_attribute("greenroom.compaction.status", output.status)
        span.set_attribute("greenroom.compaction.attempt", output.attempt)
        if output.status != "ok":
            span.set_attribute("error.type", "compaction_failed")
            span.set_status(Status(StatusCode.ERROR, output.error_message or "failed"))
        span.end(end_time=now)
        if agent.task is None:
            self._agents.pop(output.session_id, None)

    def _on_abort(self, session: Session, output: Abort, now: int) -> None:
        agent = self._agent(output.session_id)
        if agent.task is not None:
            agent.task.add_event("abort", {"greenroom.abort.reason": output.reason}, now)

    def _on_task_end(self, session: Session, output: TaskEnd, now: int) -> None:
        agent = self._agents.pop(output.session_id, None)
        if agent is None or agent.task is None:
            return
        self._end_open(agent, now, "interrupted", session)
        span = agent.task
        span.set_attributes(_usage_attributes(output.usage))
        span.set_attribute("greenroom.task.status", output.status)
        span.set_attribute("greenroom.task.turns", output.turns)
        if self._capture and agent.texts:
            ended = agent.finish_reason if output.status == "completed" else None
            answer = [_text_part("\n".join(agent.texts))]
            span.set_attribute("gen_ai.output.messages", _output_messages(answer, ended))
        if output.status != "completed":
            span.set_attribute("error.type", output.status)
            span.set_status(Status(StatusCode.ERROR, output.message or output.status))
        span.end(end_time=now)
        model = agent.response_model or session.settings.model
        failed = output.status if output.status != "completed" else None
        self._metrics.duration(session, "invoke_agent", model, output.wall_ms / 1000, failed)

    def _end_open(
        self, agent: _Agent, now: int, why: str, session: Session | None = None
    ) -> None:
        """End the spans a task left open: an attempt or calls cut short by its end (the
        attempt's tokens are recorded when the ``session`` is known)."""
        if agent.chat is not None:
            agent.chat.set_attribute("error.type", why)
            agent.chat.set_status(Status(StatusCode.ERROR, why))
            agent.chat.end(end_time=now)
            agent.chat = None
            if session is not None:
                self._record_chat_tokens(session, agent, agent.chat_model)
        if agent.compaction is not None:
            agent.compaction.set_status(Status(StatusCode.ERROR, why))
            agent.compaction.end(end_time=now)
            agent.compaction = None
        for tool in agent.tools.values():
            tool.span.set_attribute("greenroom.tool.status", why)
            tool.span.set_attribute("error.type", why)
            tool.span.set_status(Status(StatusCode.ERROR, why))
            tool.span.end(end_time=now)
        agent.tools.clear()



class _Metrics:
    """The GenAI client metrics, recorded only when a meter provider is configured."""

    __slots__ = ("_duration", "_tokens", "metered")

    def __init__(self, meter_provider: MeterProvider | None) -> None:
        meters = meter_provider or NoOpMeterProvider()
        meter = meters.get_meter(INSTRUMENTATION)
        self.metered = not isinstance(meters, NoOpMeterProvider)
        self._tokens: Histogram = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used",
            explicit_bucket_boundaries_advisory=list(_TOKEN_BUCKETS),
        )
        self._duration: Histogram = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration",
            explicit_bucket_boundaries_advisory=list(_DURATION_BUCKETS),
        )

    def tokens(self, session: Session, usage: TokenUsage, response_model: str) -> None:
        """One chat request's input and output tokens."""
        if self.metered:
            base = _metric_attributes(session, "chat", response_model)
            self._tokens.record(usage.input, {**base, "gen_ai.token.type": "input"})
            self._tokens.record(usage.output, {**base, "gen_ai.token.type": "output"})

    def duration(
        self,
        session: Session,
        operation: str,
        response_model: str,
        seconds: float,
        error_type: str | None,
    ) -> None:
        """How long one ``chat`` attempt or ``invoke_agent`` task took."""
        if self.metered:
            attributes = _metric_attributes(session, operation, response_model)
            if error_type is not None:
                attributes["error.type"] = error_type
            self._duration.record(seconds, attributes)


def _common(session: Session, operation: str) -> dict[str, Any]:
    settings = session.settings
    return {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": _GENAI_PROVIDERS.get(settings.provider, settings.provider),
        "gen_ai.request.model": settings.model,
        **_server_attributes(settings.provider, settings.base_url),
    }


def _metric_attributes(session: Session, operation: str, response_model: str) -> dict[str, Any]:
    attributes = _common(session, operation)
    attributes["gen_ai.response.model"] = response_model
    return attributes


def _system_instructions(system: str | None, origin: tuple[str, ...] | None) -> str:
    """The system prompt a session's requests are sent, as the conventions'
    ``gen_ai.system_instructions`` JSON (one text part); "" without one. ``system`` is the
    root's: a subagent's (``origin`` deeper than the root) is it wrapped once per level
    below the root, as the runtime makes it."""
    for _ in range(len(origin) - 1 if origin else 0):
        system = subagent_system(system)
    return json.dumps([_text_part(system)], ensure_ascii=False) if system else ""


def _usage_attributes(usage: TokenUsage) -> dict[str, int | float]:
    attributes: dict[str, int | float] = {
        "gen_ai.usage.input_tokens": usage.input,
        "gen_ai.usage.output_tokens": usage.output,
        "gen_ai.usage.cache_read.input_tokens": usage.cache_read,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_write,
    }
    if usage.cost_usd is not None:
        # The GenAI conventions define no cost attribute: ours, in greenroom's namespace,
        # left out when the price is unknown (R-SHARE-3).
        attributes[COST_ATTRIBUTE] = usage.cost_usd
    return attributes


def _server_attributes(provider: str, base_url: str | None) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of where the provider's requests go; none
    for a model that runs in process."""
    url = server_url(provider, base_url)
    if not url:
        return {}
    try:
        parts = urlsplit(url)
        port = parts.port or {"https": 443, "http": 80}.get(parts.scheme)
    except ValueError:  # a malformed port: the request fails on its own, say nothing
        return {}
    if not parts.hostname:
        return {}
    attributes: dict[str, Any] = {"server.address": parts.hostname}
    if port is not None:
        attributes["server.port"] = port
    return attributes


def _provider_finish_reason(provider: str, stop_reason: str) -> str:
    """``stop_reason`` in the provider's own words, for gen_ai.response.finish_reasons."""
    words = _FINISH_REASONS_OF_PROVIDER.get(_GENAI_PROVIDERS.get(provider, provider), {})
    return words.get(stop_reason, stop_reason)


def _output_messages(parts: list[dict[str, Any]], stop_reason: str | None) -> str:
    """One assistant message with the conventions' ``finish_reason`` (``error`` when the
    model did not finish: a failed attempt, a task that did not complete)."""
    reason = (
        "error" if stop_reason is None else _MESSAGE_FINISH_REASONS.get(stop_reason, stop_reason)
    )
    message = {"role": "assistant", "parts": parts, "finish_reason": reason}
    return json.dumps([message], ensure_ascii=False)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "content": text}


def _part(block: Any) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return _text_part(block.text)
    if isinstance(block, ThinkingBlock):
        return {"type": "reasoning", "content": block.text}
    if isinstance(block, ToolCallBlock):
        return {
            "type": "tool_call",
            "id": block.id,
            "name": block.name,
            "arguments": block.arguments,
        }
    return {"type": getattr(block, "type", "unknown")}


def _messages(role: str, parts: list[dict[str, Any]]) -> str:
    return json.dumps([{"role": role, "parts": parts}], ensure_ascii=False)


def _tool_result(output: ToolCallOutput) -> str:
    pieces: list[str] = []
    for block in output.content:
        if isinstance(block, TextBlock):
            pieces.append(block.text)
        elif isinstance(block, ImageBlock):
            pieces.append(f"[image {block.path}]")
    return "\n".join(pieces)


PROTOCOL_ENVS = {
    "traces": ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    "metrics": ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
}


def otlp_protocol(signal: str, environ: dict[str, str] | None = None) -> str:
    """The OTLP protocol the standard variables ask for ``signal`` (``traces`` or
    ``metrics``): the signal's own variable, else the general one, else
    ``http/protobuf`` (the specification's default)."""
    env = os.environ if environ is None else environ
    for name in PROTOCOL_ENVS[signal]:
        value = env.get(name, "").strip().lower()
        if value:
            return value
    return "http/protobuf"


def _exporter_module(signal: str) -> Any:
    """The OTLP exporter module for ``signal`` in the protocol the variables ask for.
    ``ConfigurationError`` for a protocol there is no exporter for: posting protobuf over
    HTTP to a gRPC or JSON collector would fail at every export, silently."""
    import importlib

    protocol = otlp_protocol(signal)
    variable = next((n for n in PROTOCOL_ENVS[signal] if os.environ.get(n)), "")
    kind = "trace" if signal == "traces" else "metric"
    if protocol == "http/protobuf":
        return importlib.import_module(f"opentelemetry.exporter.otlp.proto.http.{kind}_exporter")
    if protocol == "grpc":
        try:
            return importlib.import_module(
                f"opentelemetry.exporter.otlp.proto.grpc.{kind}_exporter"
            )
        except ImportError:
            raise ConfigurationError(
                f"{variable}=grpc needs the gRPC exporter: pip install 'greenroom[otel-grpc]'"
            ) from None
    if protocol == "http/json":
        raise ConfigurationError(
            f"{variable}=http/json is not supported: the OpenTelemetry Python SDK has no "
            "OTLP/JSON exporter; use http/protobuf (the default) or grpc"
        )
    raise ConfigurationError(
        f"{variable}={protocol!r} is not an OTLP protocol: use http/protobuf or grpc"
    )


@contextmanager
def exporting(*, capture_content: bool | None = None) -> Iterator[GenAIObserver]:
    """An observer exporting over OTLP/HTTP as the standard ``OTEL_*`` variables say
    (endpoint, headers, timeout, compression, service name and resource attributes: the
    SDK reads them). Spans go through a batch processor; metrics are exported too when
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` is set and
    ``OTEL_METRICS_EXPORTER`` is not ``none``. On exit every open span is ended and
    everything is flushed, within the exporter's own timeout.

    ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or its per-signal variable) picks ``http/protobuf``
    (the default) or ``grpc`` (the ``otel-grpc`` extra); ``http/json``, which the SDK has
    no exporter for, and unknown values raise ``ConfigurationError`` naming the variable,
    before anything is exported."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    defaults: dict[str, Any] = {}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        defaults["service.name"] = "greenroom"
    resource = Resource.create(defaults)
    # Both exporters are chosen before anything starts: a refused protocol leaves nothing
    # running.
    traces = _exporter_module("traces")
    metered = any(os.environ.get(name) for name in METRICS_ENDPOINT_ENVS) and (
        os.environ.get("OTEL_METRICS_EXPORTER", "").strip().lower() != "none"
    )
    metrics = _exporter_module("metrics") if metered else None
    tracer_provider = SdkTracerProvider(resource=resource)
    tracer_provider.add_span_processor(BatchSpanProcessor(traces.OTLPSpanExporter()))
    meter_provider: Any = None
    if metrics is not None:
        from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        meter_provider = SdkMeterProvider(
            resource=resource,
            metric_readers=[PeriodicExportingMetricReader(metrics.OTLPMetricExporter())],
        )
    observer = GenAIObserver(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        capture_content=capture_content,
    )
    try:
        yield observer
    finally:
        observer.close()
        # Side by side: an unreachable collector delays the exit by one export timeout
        # (OTEL_EXPORTER_OTLP_TIMEOUT), not one per signal.
        closing = threading.Thread(target=meter_provider.shutdown) if meter_provider else None
        if closing is not None:
            closing.start()
        tracer_provider.shutdown()
        if closing is not None:
            closing.join()
