"""The scripted provider: a deterministic in-process model.

It serves tests, examples and ``greenroom demo``. A script is a sequence of steps, one per
request: a :class:`Reply` (complete blocks streamed word by word), a plain function of the
request returning a ``Reply``, or an async function driving a :class:`ScriptedStream` for
full control (tests use it to stop mid-stream on a ``trio.Event``).

Like the loopback wire server, it checks transcript invariants on every request it gets
(each tool call answered exactly once by the next user message, no orphan results, ids
non-empty). A violation is recorded in ``violations`` and fails that request, so every test
that uses the scripted model guards R-TOOL-7.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from greenroom.actors.providers.base import Deliver
from greenroom.protocols.content import (
    ModelBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from greenroom.protocols.context import AssistantMessage, ModelRequest, ToolResult, UserMessage
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    ErrorKind,
    MessageCompleted,
    ModelError,
    StreamEvent,
    StreamFailed,
    TextDelta,
    ThinkingDelta,
    TokenUsage,
    ToolArgumentsDelta,
    ToolCallTruncated,
    UsageReported,
)


@attrs.frozen(kw_only=True)
class Reply:
    """One scripted response.

    ``fail`` makes the attempt fail with that error after ``fail_after_blocks`` complete
    blocks. ``truncate_last_tool_call`` cuts the last tool call as the output-token limit
    would (stop reason ``max_tokens``). ``chunk_delay_s`` paces the stream (for the demo).
    ``model`` is the model the response says answered (a real provider's dated snapshot,
    say); by default the one requested.
    """

    blocks: tuple[ModelBlock, ...] = ()
    stop_reason: str | None = None
    usage: TokenUsage | None = None
    fail: ModelError | None = None
    fail_after_blocks: int = 0
    truncate_last_tool_call: bool = False
    chunk_delay_s: float = 0.0
    model: str | None = None


def text(value: str) -> TextBlock:
    """A text block for a :class:`Reply`: ``text("Hello")``."""
    return TextBlock(text=value)


def thinking(value: str, signature: str | None = None) -> ThinkingBlock:
    """A thinking (reasoning) block for a :class:`Reply`."""
    return ThinkingBlock(text=value, signature=signature)


def tool_call(call_id: str, name: str, **arguments: Any) -> ToolCallBlock:
    """A tool call block for a :class:`Reply`: ``tool_call("call_1", "read_file",
    path="a.txt")``; the keyword arguments are the call's arguments."""
    return ToolCallBlock(id=call_id, name=name, arguments=arguments)


def invalid_tool_call(call_id: str, name: str, raw_arguments: str) -> ToolCallBlock:
    """A tool call whose argument text is not a JSON object (``raw_arguments`` as the
    model sent it): the runtime answers it with an error output (R-TOOL-5)."""
    return ToolCallBlock(id=call_id, name=name, arguments={}, invalid_arguments=raw_arguments)


def model_error(
    kind: ErrorKind,
    message: str,
    *,
    status_code: int | None = None,
    retry_after_s: float | None = None,
) -> ModelError:
    """A model failure for ``Reply(fail=…)`` or ``ScriptedStream.fail``: ``kind`` is
    ``failed``, ``timeout``, ``malformed``, ``auth`` or ``context_overflow`` (all but
    ``auth`` are retried: R-RETRY)."""
    return ModelError(
        kind=kind, message=message, status_code=status_code, retry_after_s=retry_after_s
    )


def estimate_tokens(request: ModelRequest) -> int:
    """A rough input size (4 characters a token), enough for usage figures and triggers."""
    size = len(request.system or "")
    for message in request.messages:
        for part in message.content:
            if isinstance(part, TextBlock | ThinkingBlock):
                size += len(part.text)
            elif isinstance(part, ToolCallBlock):
                size += len(part.name) + len(json.dumps(part.arguments))
            elif isinstance(part, ToolResult):
                size += sum(len(b.text) for b in part.content if isinstance(b, TextBlock))
    return max(1, size // 4)


def check_invariants(request: ModelRequest) -> list[str]:
    """Transcript invariants every request must satisfy (R-TOOL-7)."""
    problems: list[str] = []
    messages = request.messages
    answered: set[str] = set()
    for i, message in enumerate(messages):
        if isinstance(message, AssistantMessage):
            calls = [b for b in message.content if isinstance(b, ToolCallBlock)]
            ids = [c.id for c in calls]
            if any(not c for c in ids):
                problems.append(f"message {i}: tool call with an empty id")
            if len(set(ids)) != len(ids):
                problems.append(f"message {i}: duplicate tool call ids {ids}")
            if not calls:
                continue
            following = messages[i + 1] if i + 1 < len(messages) else None
            if following is None:
                problems.append(f"message {i}: tool calls {ids} are the last message")
                continue
            if not isinstance(following, UserMessage):
                problems.append(f"message {i}: tool calls not followed by a user message")
                continue
            results = [p.call_id for p in following.content if isinstance(p, ToolResult)]
            if sorted(results) != sorted(ids):
                problems.append(f"message {i}: calls {ids} answered by {results}")
            if results != ids:
                problems.append(f"message {i}: results {results} not in call order {ids}")
            answered.update(results)
        else:
            for part in message.content:
                if isinstance(part, ToolResult) and part.call_id not in answered:
                    prev = messages[i - 1] if i > 0 else None
                    prev_ids = (
                        {b.id for b in prev.content if isinstance(b, ToolCallBlock)}
                        if isinstance(prev, AssistantMessage)
                        else set()
                    )
                    if part.call_id not in prev_ids:
                        problems.append(f"message {i}: orphan result for {part.call_id}")
    return problems


_WORD = re.compile(r"\S+\s*|\s+")


class ScriptedStream:
    """Low-level control of one scripted response (for async script steps)."""

    def __init__(self, deliver: Deliver, request: ModelRequest) -> None:
        self._deliver = deliver
        self._index = 0
        self._output_chars = 0
        self.request = request
        self.finished = False

    async def text(self, value: str, *, chunk_delay_s: float = 0.0) -> None:
        """Stream a complete text block word by word, ``chunk_delay_s`` between words."""
        index = self._next_index()
        await self._deliver([BlockStarted(index=index, kind="text")])
        for piece in _WORD.findall(value):
            if chunk_delay_s:
                await trio.sleep(chunk_delay_s)
            await self._deliver([TextDelta(index=index, text=piece)])
        self._output_chars += len(value)
        await self._deliver([BlockCompleted(index=index, block=TextBlock(text=value))])

    async def text_delta(self, value: str) -> int:
        """Open a text block and send one delta, leaving the block incomplete."""
        index = self._next_index()
        await self._deliver(
            [BlockStarted(index=index, kind="text"), TextDelta(index=index, text=value)]
        )
        return index

    async def thinking(self, value: str, signature: str | None = None) -> None:
        """Stream a complete thinking block."""
        index = self._next_index()
        await self._deliver(
            [
                BlockStarted(index=index, kind="thinking"),
                ThinkingDelta(index=index, text=value),
                BlockCompleted(index=index, block=ThinkingBlock(text=value, signature=signature)),
            ]
        )

    async def tool_call(self, block: ToolCallBlock, *, fragments: int = 2) -> None:
        """Stream a complete tool call, its JSON arguments cut into ``fragments``."""
        index = self._next_index()
        raw = block.invalid_arguments or json.dumps(block.arguments)
        step = max(1, -(-len(raw) // max(1, fragments)))
        events: list[StreamEvent] = [
            BlockStarted(index=index, kind="tool_call", call_id=block.id, name=block.name)
        ]
        events.extend(
            ToolArgumentsDelta(
                index=index, call_id=block.id, name=block.name, delta=raw[i : i + step]
            )
            for i in range(0, len(raw), step)
        )
        events.append(BlockCompleted(index=index, block=block))
        self._output_chars += len(raw)
        await self._deliver(events)

    async def truncated_tool_call(self, block: ToolCallBlock) -> None:
        """Stream half of a tool call's arguments, cut off as by the output-token limit
        (follow with ``end("max_tokens")``)."""
        index = self._next_index()
        raw = json.dumps(block.arguments)
        cut = raw[: max(1, len(raw) // 2)]
        await self._deliver(
            [
                BlockStarted(index=index, kind="tool_call", call_id=block.id, name=block.name),
                ToolArgumentsDelta(index=index, call_id=block.id, name=block.name, delta=cut),
                ToolCallTruncated(
                    index=index, call_id=block.id, name=block.name, partial_arguments=cut
                ),
            ]
        )

    async def block(self, block: ModelBlock, *, chunk_delay_s: float = 0.0) -> None:
        """Stream any complete block, as a :class:`Reply` would."""
        if isinstance(block, TextBlock):
            await self.text(block.text, chunk_delay_s=chunk_delay_s)
        elif isinstance(block, ThinkingBlock):
            await self.thinking(block.text, block.signature)
        elif isinstance(block, ToolCallBlock):
            await self.tool_call(block)
        elif isinstance(block, RedactedThinkingBlock):
            index = self._next_index()
            await self._deliver([BlockCompleted(index=index, block=block)])

    async def end(
        self,
        stop_reason: str = "end_turn",
        usage: TokenUsage | None = None,
        *,
        model: str | None = None,
    ) -> None:
        """Finish the response (usage estimated from the text when not given), naming
        ``model`` as the one that answered, by default the one requested (as a provider
        does). A step that returns without calling ``end`` or ``fail`` is ended with
        ``end_turn``."""
        usage = usage or TokenUsage(
            input=estimate_tokens(self.request), output=max(1, self._output_chars // 4)
        )
        self.finished = True
        named = model or self.request.model or None
        completed = MessageCompleted(stop_reason=stop_reason, usage=usage, response_model=named)
        await self._deliver([UsageReported(usage=usage), completed])

    async def fail(self, error: ModelError) -> None:
        """End the attempt with ``error`` (see :func:`model_error`)."""
        self.finished = True
        await self._deliver([StreamFailed(error=error)])

    def _next_index(self) -> int:
        index = self._index
        self._index += 1
        return index


ScriptStep = (
    Reply
    | Callable[[ModelRequest], Reply]
    | Callable[[ModelRequest, ScriptedStream], Awaitable[None]]
)


class ScriptedProvider:
    """A model that answers each request with the next step of its script.

    ``script`` is a sequence of steps, or one function called for every request. Every
    request is kept in ``requests`` unless ``keep_requests`` is false (a long-lived host,
    or a benchmark of what sessions hold, has no use for them). When the script runs out
    the request fails with a clear message (a test then fails instead of hanging).
    """

    name = "scripted"

    def __init__(
        self, script: Sequence[ScriptStep] | ScriptStep, *, keep_requests: bool = True
    ) -> None:
        if isinstance(script, Reply) or callable(script):
            self._steps: list[ScriptStep] | None = None
            self._function: ScriptStep | None = script
        else:
            self._steps = list(script)
            self._function = None
        self.requests: list[ModelRequest] = []
        self.violations: list[str] = []
        self._keep_requests = keep_requests
        self._requests_seen = 0

    def open_task(self) -> ScriptedProvider:
        """The provider itself: the script is shared by every task."""
        return self

    async def aclose(self) -> None:
        """Nothing to close."""
        return None

    def _next_step(self) -> ScriptStep | None:
        if self._function is not None:
            return self._function
        if self._steps:
            return self._steps.pop(0)
        return None

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        """Record ``request``, check the transcript invariants and play the next step. A request
        that breaks an invariant (kept in ``violations``) or finds the script exhausted fails
        with a ``failed`` error instead."""
        self._requests_seen += 1
        number = self._requests_seen
        if self._keep_requests:
            self.requests.append(request)
        problems = check_invariants(request)
        stream = ScriptedStream(deliver, request)
        if problems:
            self.violations.extend(f"request {number}: {p}" for p in problems)
            await stream.fail(ModelError(kind="failed", message="; ".join(problems)))
            return
        step = self._next_step()
        if step is None:
            await stream.fail(
                ModelError(kind="failed", message=f"script exhausted at request {number}")
            )
            return
        if isinstance(step, Reply):
            await self._play(step, stream)
            return
        if len(inspect.signature(step).parameters) == 1:
            result = step(request)  # type: ignore[call-arg]
        else:
            result = step(request, stream)  # type: ignore[call-arg]
        if isinstance(result, Reply):
            await self._play(result, stream)
            return
        await result
        if not stream.finished:
            await stream.end()

    async def _play(self, reply: Reply, stream: ScriptedStream) -> None:
        blocks = list(reply.blocks)
        truncated = blocks.pop() if reply.truncate_last_tool_call and blocks else None
        for done, block in enumerate(blocks):
            if reply.fail is not None and done >= reply.fail_after_blocks:
                await stream.fail(reply.fail)
                return
            await stream.block(block, chunk_delay_s=reply.chunk_delay_s)
        if reply.fail is not None:
            await stream.fail(reply.fail)
            return
        if isinstance(truncated, ToolCallBlock):
            await stream.truncated_tool_call(truncated)
            await stream.end("max_tokens", reply.usage, model=reply.model)
            return
        stop = reply.stop_reason or (
            "tool_use" if any(isinstance(b, ToolCallBlock) for b in blocks) else "end_turn"
        )
        await stream.end(stop, reply.usage, model=reply.model)
