"""R-COMPACT-9 against a real context window: a loopback model that refuses every request
whose body is larger than its window, with Anthropic's own overflow error.

The compaction that answers a turn's overflow must not send the context that overflowed
again: its summary request sends the old context cut to fit (the largest tool result first),
and a summary request that overflows is retried on a smaller base, a bounded number of
times, before the compaction fails with a message that says why. The pure parts
are checked on their own in ``test_compact9_fit_base.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from test_compaction import records, trace_files
from test_compaction_wire import is_summary, of_type, run, texts

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import TextBlock
from greenroom.protocols.outputs import (
    CompactionBegin,
    CompactionEnd,
    RequestEnd,
    ToolCallOutput,
)
from greenroom.protocols.retry import MAX_RETRIES
from greenroom.protocols.tools import tool
from tests.support.mock_model_server import (
    ErrorReply,
    MockModelServer,
    RecordedRequest,
    Reply,
    Response,
    Text,
    ToolUse,
    open_mock_server,
)

LOG_LINES = [
    f"{n:05d} worker-{n % 7} handled job {n * 37 % 1000:03d} in {n % 90} ms" for n in range(600)
]
LOG = "\n".join(LOG_LINES)
"""A tool result far larger than the window below (about 27,000 characters)."""


@tool(parallel=True)
async def read_log() -> str:
    """Read the service log."""
    return LOG


class Window:
    """A model with a context window of ``most`` request bytes: a larger request is
    refused as Anthropic refuses one (HTTP 400 ``prompt is too long: N tokens > M
    maximum``, 4 bytes a token; ``numbers=False``: the words alone) — except the first
    ``roomy`` requests, answered whatever their size. A request that fits gets a summary
    when it asks for one, else the next of ``replies``."""

    def __init__(
        self, most: int, replies: list[Reply], *, numbers: bool = True, roomy: int = 0
    ) -> None:
        self.most = most
        self.replies = replies
        self.numbers = numbers
        self.roomy = roomy
        self.refused: list[RecordedRequest] = []
        self.accepted: list[RecordedRequest] = []

    def __call__(self, request: RecordedRequest) -> Response:
        size = len(request.raw_body)
        if size > self.most and len(self.accepted) >= self.roomy:
            self.refused.append(request)
            words = "prompt is too long"
            if self.numbers:
                words += f": {size // 4} tokens > {self.most // 4} maximum"
            return ErrorReply.anthropic(400, "invalid_request_error", words)
        self.accepted.append(request)
        if is_summary(request):
            return Reply([Text("[summary]The user asked for the log; it was read.[/summary]")])
        return self.replies.pop(0)


@asynccontextmanager
async def windowed_session(
    tmp_path: Path, window: Window
) -> AsyncIterator[tuple[MockModelServer, Session]]:
    async with open_mock_server(fallback=window) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key="k")
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                tools=[read_log],
                provider=provider,
                workspace_dir=tmp_path,
                system="Be brief.",
                model="claude-sonnet-5-5",
            )
            yield server, session


def summaries(requests: list[RecordedRequest]) -> list[RecordedRequest]:
    return [r for r in requests if is_summary(r)]


async def test_an_overflow_compaction_sends_a_summary_request_that_fits_the_window(
    tmp_path: Path,
) -> None:
    """R-COMPACT-9: the tool result makes the turn's request overflow the window. The
    summary request does not send that context again: it sends it with the large result
    cut (its start and end kept, a marker between), fits the window, and the turn runs again
    from the summary: the task completes. The trace keeps the whole result."""
    window = Window(
        16_000,
        [
            Reply([ToolUse("c1", "read_log", {})], stop_reason="tool_use"),
            Reply([Text("The log is fine.")]),
        ],
    )
    async with windowed_session(tmp_path, window) as (server, session):
        outputs = await run(session, "Read the log and tell me if it is fine.")
        server.assert_clean()
        files = trace_files(session)

    assert outputs[-1].status == "completed", outputs[-1]
    assert [b.reason for b in of_type(outputs, CompactionBegin)] == ["overflow"]
    (end,) = of_type(outputs, CompactionEnd)
    assert (end.status, end.attempt) == ("ok", 1)
    # Only the turn that overflowed was refused: the provider's numbers were enough to aim
    # the first summary request inside the window.
    (overflowed,) = window.refused
    assert not is_summary(overflowed)
    (summary,) = summaries(server.requests)
    assert len(summary.raw_body) <= window.most < len(overflowed.raw_body)
    first = summary.body["messages"][0]["content"]
    assert [b["text"] for b in first] == ["Read the log and tell me if it is fine."]  # whole
    (result,) = [
        block["content"]
        for message in summary.body["messages"]
        for block in (message["content"] if isinstance(message["content"], list) else [])
        if block.get("type") == "tool_result"
    ]
    body = result if isinstance(result, str) else "".join(b["text"] for b in result)
    assert body.startswith(LOG_LINES[0]) and body.endswith(LOG_LINES[-1])
    assert "characters left out here so that the summary request fits" in body
    assert len(body) < len(LOG)
    rerun = server.requests[-1].body
    assert texts(rerun) == [
        "[context_summary]The user asked for the log; it was read.[/context_summary]"
    ]
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["ok", "context_overflow", "ok"]
    # The history is not cut: the first file still holds the whole result.
    (call,) = [r for r in records(files[0]) if isinstance(r, ToolCallOutput)]
    assert "".join(b.text for b in call.content if isinstance(b, TextBlock)) == LOG


async def test_a_summary_request_that_never_fits_fails_the_compaction_after_bounded_tries(
    tmp_path: Path,
) -> None:
    """R-COMPACT-9 with R-COMPACT-7: a window too small for any summary request (its
    prompt alone nearly fills it), and an error without numbers: every summary request
    overflows. Each retry sends a smaller base, at once; after a bounded number of tries the
    compaction ends failed with a message that says the summary request overflows the
    context window, the task ends failed, and the old context and its trace file stay."""
    # The first turn is let through, to bring the large result into the context.
    window = Window(
        700,
        [Reply([ToolUse("c1", "read_log", {})], stop_reason="tool_use")],
        numbers=False,
        roomy=1,
    )
    async with windowed_session(tmp_path, window) as (server, session):
        with trio.fail_after(20):
            outputs = await run(session, "Read the log.")
        server.assert_clean()
        files = trace_files(session)

    (end,) = of_type(outputs, CompactionEnd)
    assert end.status == "failed"
    assert 1 < end.attempt <= MAX_RETRIES + 1
    message = end.error_message or ""
    assert message.startswith("the summary request "), message
    assert "overflow" in message and "context window" in message
    assert message.endswith("prompt is too long"), message  # the provider's own words
    tries = summaries(server.requests)
    assert len(tries) == end.attempt
    sizes = [len(r.raw_body) for r in tries]
    assert sizes == sorted(set(sizes), reverse=True), sizes  # each try smaller
    assert outputs[-1].status == "failed"
    # The task's end says the compaction failed, not only that the turn overflowed.
    task_message = outputs[-1].message or ""
    assert "compacting the context failed: the summary request " in task_message, task_message
    assert [f.name for f in files] == ["trace_001.jsonl"]
