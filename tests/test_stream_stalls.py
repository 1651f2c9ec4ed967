"""R-SEC-10: every model request has a no-progress deadline, on every provider path.

Each provider reads the mock model server through its real client stack — the anthropic
SDK on httpx2 (``sdk``), greenroom's own HTTP client for the Messages API (``lean``), for
Chat Completions (``openai``) and for the Responses API (``openai-responses``), and httpx
for the last two (``openai-httpx``, ``openai-responses-httpx``) — while the server
sends a few real events and then only keep-alives (SSE comments, the wire's own idle event,
empty lines) well inside the read timeout. The attempt must end as a ``timeout`` that says
it saw only keep-alives, between one read timeout and ``1 + DEADLINE_SLACK`` of them after
the last event that made progress; then the runtime retries it (R-RETRY-2).

Under ``MockClock`` the SDK's first request resolves its platform in a worker thread, which
an autojumping clock would race with any deadline: each test streams one plain reply first,
with no deadline running, so that the measured request starts with that done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
import trio
import trio.testing

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.base import ProviderTask
from greenroom.actors.providers.lean_http import DEADLINE_SLACK
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.outputs import Output, RequestEnd, TaskEnd
from greenroom.protocols.stream import StreamEvent, StreamFailed
from tests.support.mock_model_server import (
    KeepAlives,
    MockModelServer,
    Reply,
    Text,
    open_mock_server,
)

READ_TIMEOUT = 10.0
KEEPALIVE_EVERY_S = 2.0
PATHS = ["sdk", "lean", "openai", "openai-responses", "openai-httpx", "openai-responses-httpx"]
STYLES = ["comment", "ping", "blank"]


def make_provider(path: str, base_url: str, read_timeout: float) -> Any:
    if path in ("sdk", "lean"):
        timeout2 = httpx2.Timeout(connect=5.0, read=read_timeout, write=5.0, pool=5.0)
        return AnthropicProvider(
            base_url=base_url, api_key="k", timeout=timeout2, lean_http=path == "lean"
        )
    timeout = httpx.Timeout(connect=5.0, read=read_timeout, write=5.0, pool=5.0)
    responses = path.startswith("openai-responses")
    cls = OpenAIResponsesProvider if responses else OpenAIProvider
    return cls(
        base_url=base_url + "/v1", api_key="k", timeout=timeout,
        lean_http=not path.endswith("-httpx"),
    )  # fmt: skip


def request() -> ModelRequest:
    hello = UserMessage(content=(TextBlock(text="hi"),))
    return ModelRequest(model="m", system=None, tools=(), messages=(hello,), max_tokens=64)


async def stream(task: ProviderTask) -> list[tuple[float, list[StreamEvent]]]:
    """Every batch one attempt delivers, with the (mock) time it was delivered."""
    batches: list[tuple[float, list[StreamEvent]]] = []

    async def deliver(batch: list[StreamEvent]) -> None:
        batches.append((trio.current_time(), batch))

    await task.stream(request(), deliver)
    return batches


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("path", PATHS)
async def test_keepalives_alone_end_the_attempt_as_timeout(
    autojump_clock: trio.testing.MockClock, path: str, style: str
) -> None:
    """After a few events, keep-alives every 2 s with a 10 s read timeout: the attempt
    fails as ``timeout`` between 10 and 12.5 s after the last event, saying it saw only
    keep-alives. (Without the deadline the server gives up after 100 s and cuts the body:
    the attempt would end ``malformed`` instead.)"""
    async with open_mock_server(Reply([Text("warm up")])) as server:
        provider = make_provider(path, server.base_url, READ_TIMEOUT)
        try:
            await stream(provider.open_task())
            server.push(
                KeepAlives(
                    after_events=3,
                    every_s=KEEPALIVE_EVERY_S,
                    style=style,  # type: ignore[arg-type]
                    for_s=10 * READ_TIMEOUT,
                )
            )
            with trio.fail_after(20 * READ_TIMEOUT):
                batches = await stream(provider.open_task())
        finally:
            await provider.aclose()
    *progress, (failed_at, last) = batches
    assert progress, "the first events must arrive before the keep-alives"
    [failure] = last
    assert isinstance(failure, StreamFailed)
    assert failure.error.kind == "timeout"
    assert failure.error.message == "stream stalled: no progress for 10 s (only keep-alives)"
    stalled = failed_at - progress[-1][0]
    assert READ_TIMEOUT <= stalled <= READ_TIMEOUT * (1 + DEADLINE_SLACK) + 0.1


@pytest.mark.parametrize("path", PATHS)
async def test_a_stream_that_keeps_making_progress_is_never_cut(
    autojump_clock: trio.testing.MockClock, path: str
) -> None:
    """The deadline moves with progress: a reply whose events come 6 s apart, with a 10 s
    read timeout, streams for far longer than one read timeout and completes."""
    words = " ".join(f"w{i}" for i in range(12))
    async with open_mock_server(Reply([Text("warm up")]), Reply([Text(words)])) as server:
        provider = make_provider(path, server.base_url, READ_TIMEOUT)
        try:
            await stream(provider.open_task())
            server.token_delay_ms = 6000.0
            start = trio.current_time()
            with trio.fail_after(40 * READ_TIMEOUT):
                batches = await stream(provider.open_task())
        finally:
            await provider.aclose()
    events = [event for _, batch in batches for event in batch]
    assert not any(isinstance(e, StreamFailed) for e in events), events[-1]
    assert type(events[-1]).__name__ == "MessageCompleted"
    assert trio.current_time() - start > 5 * READ_TIMEOUT


@pytest.mark.parametrize("path", ["sdk", "lean", "openai", "openai-httpx"])
async def test_a_stalled_attempt_is_retried_and_the_retry_answers(
    tmp_path: Path, path: str
) -> None:
    """Through the whole runtime, on the real clock with a short read timeout: the attempt
    that got only keep-alives ends ``timeout`` with a ``stream stalled`` message in its
    ``request_end`` (R-RETRY-3), is retried after the planned wait, and the retry's answer
    completes the task."""
    read_timeout = 1.0
    keepalives = KeepAlives(after_events=3, every_s=0.05, for_s=30.0)
    async with open_mock_server(keepalives, Reply([Text("Here it is.")])) as server:
        outputs = await run_task(server, tmp_path, make_provider(path, server.base_url, 1.0))
    ends = [o for o in outputs if isinstance(o, RequestEnd)]
    assert [(e.status, e.attempt) for e in ends] == [("timeout", 1), ("ok", 2)]
    assert (ends[0].error_message or "").startswith("stream stalled: ")
    assert ends[0].retry_in_ms == 250
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed"
    first, second = server.requests
    assert second.received_at - first.received_at >= read_timeout


async def run_task(server: MockModelServer, tmp_path: Path, provider: Any) -> list[Output]:
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=provider, workspace_dir=tmp_path)
        with trio.fail_after(60):
            outputs = [o async for o in session.run("hi", approve=lambda _: "allow")]
    server.assert_clean()
    return outputs
