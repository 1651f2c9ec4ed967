"""The full runtime against a real HTTP server speaking each provider's wire protocol.

Requests go through the real ``anthropic`` SDK (and httpx for the OpenAI-compatible
provider) to the loopback mock server, which checks the tool_use/tool_result pairing of
EVERY request it receives (R-TOOL-7). Backoff waits here are the runtime's real schedule
(250 ms, 500 ms…); the exact schedule is tested under MockClock with the scripted model.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.runtime.errors import AuthLocked
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import TextBlock
from greenroom.protocols.outputs import (
    ModelMsg,
    Output,
    RequestEnd,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.tools import tool
from tests.support.mock_model_server import (
    DropAfter,
    ErrorReply,
    Fixture,
    MalformedJSON,
    MidStreamError,
    MockModelServer,
    Reply,
    SSEEvent,
    Streamed,
    Text,
    Thinking,
    ToolUse,
    WireError,
    error_fixture,
    open_mock_server,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ran: list[str] = []


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    ran.append(key)
    return f"value of {key}"


@asynccontextmanager
async def anthropic_session(
    server: MockModelServer, tmp_path: Path, *, lean: bool = True, **settings: Any
) -> AsyncIterator[Session]:
    provider = AnthropicProvider(base_url=server.base_url, api_key="test-key", lean_http=lean)
    async with Host.open(tmp_path / "data") as host:
        yield await host.create_session(
            tools=[lookup],
            provider=provider,
            workspace_dir=tmp_path,
            system="Be brief.",
            model="claude-sonnet-5-5",
            **settings,
        )


def of_type(outputs: list[Output], cls: type[Any]) -> list[Any]:
    return [o for o in outputs if isinstance(o, cls)]


def allow(_: object) -> str:
    return "allow"


async def test_anthropic_tool_turns_through_the_sdk(tmp_path: Path) -> None:
    """R-RUN-2..4 over the wire: streamed text and tool calls, results in call order,
    system prompt and tools marked for prompt caching, byte-identical request prefix."""
    ran.clear()
    async with open_mock_server(
        Reply(
            [
                Thinking("I should look both up.", signature="sig-1"),
                Text("Looking them up."),
                ToolUse("toolu_a", "lookup", {"key": 'Sáo "1"'}),
                ToolUse("toolu_b", "lookup", {"key": "two"}),
            ],
            stop_reason="tool_use",
        ),
        Reply([Text("Both found.")]),
        rechunk="random",
    ) as server:
        async with anthropic_session(server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [
                    o async for o in session.run("find them", approve=allow, thinking_level="low")
                ]
        server.assert_clean()
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed" and end.turns == 2
    assert sorted(ran) == ['Sáo "1"', "two"]
    first, second = (r.body for r in server.requests)
    assert first["system"][0]["cache_control"] == {"type": "ephemeral"}
    assert first["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert first["stream"] is True
    results = [b for b in second["messages"][-1]["content"] if b["type"] == "tool_result"]
    assert [b["tool_use_id"] for b in results] == ["toolu_a", "toolu_b"]
    # R-RUN-9: with thinking on, the thinking of the message whose calls are answered goes
    # back, signed.
    assert second["messages"][1]["content"][0] == {
        "type": "thinking",
        "thinking": "I should look both up.",
        "signature": "sig-1",
    }
    # The prefix (system, tools, first user message) is byte-identical between turns.
    for key in ("system", "tools"):
        assert json.dumps(first[key]) == json.dumps(second[key])
    def strip(message: dict[str, Any]) -> str:
        content = message["content"]
        if isinstance(content, list):
            content = [{k: v for k, v in b.items() if k != "cache_control"} for b in content]
        return json.dumps(content)

    assert strip(first["messages"][0]) == strip(second["messages"][0])


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "sdk"])
async def test_overloaded_then_success_is_retried_with_turn_retried(
    tmp_path: Path, lean: bool
) -> None:
    """R-RETRY-1..4: a 529 and a mid-stream overloaded error are retried in the same turn;
    the retry carries the partial output in a [turn_retried] block (both HTTP paths)."""
    async with open_mock_server(
        error_fixture("anthropic/errors/529_overloaded_error.json"),
        MidStreamError(Reply([Text("Partial answer that was cut")]), after_events=4),
        Reply([Text("Complete answer.")]),
    ) as server:
        async with anthropic_session(server, tmp_path, lean=lean) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("question", approve=allow)]
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert [(e.status, e.attempt, e.retry_in_ms) for e in ends] == [
        ("timeout", 1, 250),
        ("timeout", 2, 500),
        ("ok", 3, None),
    ]
    assert "overloaded" in (ends[0].error_message or "").lower()
    assert outputs[-1].status == "completed"
    retry_body = json.dumps(server.requests[2].body["messages"][-1])
    assert "[turn_retried]" in retry_body and "Partial" in retry_body
    assert "[turn_retried]" not in json.dumps(server.requests[1].body)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "sdk"])
async def test_auth_failure_is_not_retried_and_locks_the_session(
    tmp_path: Path, lean: bool
) -> None:
    """R-RETRY-6: 401 ends the turn with auth, no retry; the session refuses new tasks until
    retry_auth() (both HTTP paths)."""
    async with open_mock_server(
        error_fixture("anthropic/errors/401_authentication_error.json"),
        Reply([Text("Hello again.")]),
    ) as server:
        async with anthropic_session(server, tmp_path, lean=lean) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("hi", approve=allow)]
                assert [(e.status, e.attempt) for e in of_type(outputs, RequestEnd)] == [
                    ("auth", 1)
                ]
                assert outputs[-1].status == "auth"
                assert len(server.requests) == 1
                with pytest.raises(AuthLocked):
                    session.run("again")
                session.retry_auth()
                again = [o async for o in session.run("again", approve=allow)]
        assert again[-1].status == "completed"


@pytest.mark.parametrize(
    "fault",
    [
        DropAfter(Reply([Text("one two three four")]), after_events=3),
        MalformedJSON(after_events=2),
        Fixture("anthropic/truncated_no_message_stop.sse"),
    ],
    ids=["dropped-connection", "malformed-json", "no-message-stop"],
)
async def test_broken_streams_are_retried_and_never_run_partial_tools(
    tmp_path: Path, fault: Any
) -> None:
    """R-RETRY-1: a connection dropped mid-body, bad JSON and a stream without message_stop
    are `malformed` streams; the half-streamed tool call of the fixture never runs."""
    ran.clear()
    async with open_mock_server(fault, Reply([Text("Recovered.")])) as server:
        async with anthropic_session(server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("go", approve=allow)]
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert ends[0].status == "malformed" and ends[0].attempt == 1
    assert ends[-1].status == "ok" and ends[-1].attempt == 2
    assert ran == []
    assert outputs[-1].status == "completed"


async def test_max_tokens_truncated_tool_call_is_not_executed(tmp_path: Path) -> None:
    """R-TOOL-5: the fixture's tool_use cut by max_tokens gets a `truncated` error output,
    is never run, and stays paired in the next request."""
    async with open_mock_server(
        Fixture("anthropic/max_tokens_truncated_tool_use.sse"),
        Reply([Text("I will write a shorter report.")]),
    ) as server:
        async with anthropic_session(server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("write it", approve=allow)]
        server.assert_clean()
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.status == "truncated" and result.is_error
    assert not (tmp_path / "report.md").exists()
    answer = server.requests[1].body["messages"][-1]["content"][0]
    assert answer["type"] == "tool_result" and answer["is_error"] is True
    assert answer["tool_use_id"] == result.call_id


async def test_failed_is_retried_until_the_budget_is_spent(tmp_path: Path) -> None:
    """R-RETRY-2: `failed` is retried too and, with the budget spent, the task fails with
    the status kept as `failed` (never relabelled)."""
    bad = ErrorReply.anthropic(409, "conflict_error", "try again")
    async with open_mock_server(*([bad] * 6)) as server:
        async with anthropic_session(server, tmp_path) as session:
            with trio.fail_after(20):
                run = session.run("hi", approve=allow)
                outputs: list[Output] = []
                async for output in run:
                    outputs.append(output)
                    if isinstance(output, RequestEnd) and output.retry_in_ms:
                        session.skip_reconnect_wait()  # R-RETRY-5: same attempt count
    ends = of_type(outputs, RequestEnd)
    assert [e.attempt for e in ends] == [1, 2, 3, 4, 5, 6]
    assert {e.status for e in ends} == {"failed"}
    assert [e.retry_in_ms for e in ends] == [250, 500, 1000, 2000, 4000, None]
    assert outputs[-1].status == "failed" and len(server.requests) == 6


async def test_openai_compatible_provider_runs_tool_turns(tmp_path: Path) -> None:
    """The openai provider over httpx: tool calls, results in order, and a 429
    `insufficient_quota` classified `failed`, not a transient timeout: the turn ends at
    once, since waiting will not refill a quota."""
    ran.clear()
    async with open_mock_server(
        ErrorReply.openai(
            429, "insufficient_quota", "You exceeded your quota.", code="insufficient_quota"
        ),
        Reply(
            [
                Text("Checking."),
                ToolUse("call_1", "lookup", {"key": "x"}),
                ToolUse("call_2", "lookup", {"key": "y"}),
            ],
            stop_reason="tool_use",
        ),
        Reply([Text("Done.")]),
    ) as server:
        provider = OpenAIProvider(base_url=server.base_url + "/v1", api_key="k")
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                tools=[lookup], provider=provider, workspace_dir=tmp_path
            )
            with trio.fail_after(10):
                refused = [o async for o in session.run("go", approve=allow)]
                outputs = [o async for o in session.run("go", approve=allow)]
        server.assert_clean()
    (end,) = of_type(refused, RequestEnd)
    assert end.status == "failed" and "quota" in (end.error_message or "")
    assert end.retry_in_ms is None and refused[-1].status == "failed"
    assert outputs[-1].status == "completed" and sorted(ran) == ["x", "y"]
    tool_messages = [m for m in server.requests[2].body["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["call_1", "call_2"]


async def test_wire_error_rendered_per_endpoint_is_classified(tmp_path: Path) -> None:
    """A 500 on either wire is a transient `timeout` (R-RETRY-1)."""
    async with (
        open_mock_server(
            WireError(500, "api_error", "Internal server error"), Reply([Text("ok")])
        ) as server,
        anthropic_session(server, tmp_path) as session,
    ):
        with trio.fail_after(10):
            outputs = [o async for o in session.run("hi", approve=allow)]
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["timeout", "ok"]


@asynccontextmanager
async def openai_session(server: MockModelServer, tmp_path: Path) -> AsyncIterator[Session]:
    provider = OpenAIProvider(base_url=server.base_url + "/v1", api_key="k")
    async with Host.open(tmp_path / "data") as host:
        yield await host.create_session(tools=[lookup], provider=provider, workspace_dir=tmp_path)


def openai_stream(*chunks: dict[str, Any]) -> Streamed:
    events = [SSEEvent(data=f"data: {json.dumps(c)}\n\n".encode()) for c in chunks]
    return Streamed(events=[*events, SSEEvent(data=b"data: [DONE]\n\n")])


def anthropic_stream(*events: dict[str, Any]) -> Streamed:
    return Streamed(
        events=[
            SSEEvent(data=f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode())
            for e in events
        ]
    )


def oa_chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


async def test_empty_finish_reason_streams_to_the_end(tmp_path: Path) -> None:
    """A server sending `"finish_reason": ""` on every chunk: the message ends at the real
    finish reason, and a connection dropped after the first chunk is a retried `malformed`
    attempt, never a one-chunk answer (R-RETRY-1)."""
    body = openai_stream(
        oa_chunk({"role": "assistant", "content": "Hel"}, ""),
        oa_chunk({"content": "lo"}, ""),
        oa_chunk({}, "stop"),
    )
    async with open_mock_server(DropAfter(body, after_events=1), body) as server:
        async with openai_session(server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("hi", approve=allow)]
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert [(e.status, e.attempt) for e in ends] == [("malformed", 1), ("ok", 2)]
    assert outputs[-1].status == "completed"
    assert of_type(outputs, ModelMsg)[-1].block == TextBlock(text="Hello")


A_START = {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
    "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 1}}}


def a_tool(index: int, call_id: str, arguments: str) -> list[dict[str, Any]]:
    return [
        {"type": "content_block_start", "index": index,
         "content_block": {"type": "tool_use", "id": call_id, "name": "lookup", "input": {}}},
        {"type": "content_block_delta", "index": index,
         "delta": {"type": "input_json_delta", "partial_json": arguments}},
        {"type": "content_block_stop", "index": index},
    ]


A_END = [
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
     "usage": {"output_tokens": 9}},
    {"type": "message_stop"},
]


def wire_session(
    wire: str, server: MockModelServer, tmp_path: Path
) -> AbstractAsyncContextManager[Session]:
    if wire == "anthropic":
        return anthropic_session(server, tmp_path)
    return openai_session(server, tmp_path)


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
async def test_repeated_tool_call_id_is_a_malformed_attempt(tmp_path: Path, wire: str) -> None:
    """R-SEC-6: two calls with one id in a model message make the attempt `malformed`; it
    is retried and every request stays paired (the mock server checks each one)."""
    ran.clear()
    spliced = Reply(
        [ToolUse("toolu_same", "lookup", {"key": "one"}),
         ToolUse("toolu_same", "lookup", {"key": "two"})],
        stop_reason="tool_use",
    )
    async with open_mock_server(
        spliced,
        Reply([ToolUse("toolu_b", "lookup", {"key": "three"})], stop_reason="tool_use"),
        Reply([Text("Done.")]),
    ) as server:
        async with wire_session(wire, server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("go", approve=allow)]
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert ends[0].status == "malformed" and "toolu_same" in (ends[0].error_message or "")
    assert [e.status for e in ends[1:]] == ["ok", "ok"]
    assert outputs[-1].status == "completed"
    assert "two" not in ran and "three" in ran


def oa_tool(index: int, call_id: str, arguments: str) -> dict[str, Any]:
    fragment = {"index": index, "id": call_id, "type": "function",
                "function": {"name": "lookup", "arguments": arguments}}
    return oa_chunk({"tool_calls": [fragment]}, None)


@pytest.mark.parametrize("depth", [100_000, 500])
@pytest.mark.parametrize("wire", ["anthropic", "openai"])
async def test_deeply_nested_arguments_are_that_calls_error(
    tmp_path: Path, wire: str, depth: int
) -> None:
    """R-SEC-6/R-TOOL-5: arguments nested 100,000 deep (beyond what the JSON parser takes)
    or 500 deep (which it takes) give that call an invalid-arguments error output; the
    attempt succeeds, the other call runs, the task completes."""
    ran.clear()
    deep = '{"key": ' + "[" * depth + "]" * depth + "}"
    if wire == "anthropic":
        stream = anthropic_stream(
            A_START, *a_tool(0, "toolu_deep", deep), *a_tool(1, "toolu_ok", '{"key": "fine"}'),
            *A_END,
        )
    else:
        stream = openai_stream(
            oa_tool(0, "toolu_deep", deep), oa_tool(1, "toolu_ok", '{"key": "fine"}'),
            oa_chunk({}, "tool_calls"),
        )
    async with open_mock_server(stream, Reply([Text("Done.")])) as server:
        async with wire_session(wire, server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("go", approve=allow)]
        server.assert_clean()
    assert [e.status for e in of_type(outputs, RequestEnd)] == ["ok", "ok"]
    results = {o.call_id: o for o in of_type(outputs, ToolCallOutput)}
    assert results["toolu_deep"].is_error and results["toolu_deep"].status == "error"
    assert not results["toolu_ok"].is_error and ran == ["fine"]
    assert outputs[-1].status == "completed"


@pytest.mark.parametrize(
    "fixture",
    [
        "anthropic/errors/404_not_found_error.json",
        "anthropic/errors/400_invalid_request_generic.json",
        "anthropic/errors/413_request_too_large.json",
    ],
)
async def test_request_rejections_end_the_turn_at_once(tmp_path: Path, fixture: str) -> None:
    """R-RETRY-2: a wrong model, an invalid request or one too large fails the same way
    every time: the turn ends `failed` after one attempt, with the provider's message."""
    async with open_mock_server(error_fixture(fixture), Reply([Text("unused")])) as server:
        async with anthropic_session(server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("hi", approve=allow)]
    (end,) = of_type(outputs, RequestEnd)
    provider_message = json.loads((FIXTURES / fixture).read_text())["error"]["message"]
    assert (end.status, end.attempt, end.retry_in_ms) == ("failed", 1, None)
    assert provider_message in (end.error_message or "")
    assert outputs[-1].status == "failed" and len(server.requests) == 1


async def test_openai_unknown_model_ends_the_turn_at_once(tmp_path: Path) -> None:
    async with open_mock_server(
        ErrorReply.openai(404, "invalid_request_error", "The model `nope` does not exist",
                          code="model_not_found"),
        Reply([Text("unused")]),
    ) as server:
        async with openai_session(server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("hi", approve=allow)]
    (end,) = of_type(outputs, RequestEnd)
    assert (end.status, end.retry_in_ms) == ("failed", None)
    assert "does not exist" in (end.error_message or "") and len(server.requests) == 1


@pytest.mark.parametrize("wire", ["anthropic", "anthropic-sdk", "openai", "openai-httpx"])
async def test_unreachable_server_is_named_and_retried(tmp_path: Path, wire: str) -> None:
    """A base URL nothing listens on: `connection refused by HOST:PORT (cannot connect to
    URL)`, a `timeout` that is retried on the usual schedule (R-RETRY-1), on the lean and
    the library paths."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now: connections are refused
    base = f"http://127.0.0.1:{port}"
    lean = wire in ("anthropic", "openai")
    provider: Any = (
        AnthropicProvider(base_url=base, api_key="k", lean_http=lean)
        if wire.startswith("anthropic")
        else OpenAIProvider(base_url=base + "/v1", api_key="k", lean_http=lean)
    )
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=provider, workspace_dir=tmp_path)
        with trio.fail_after(20):
            outputs: list[Output] = []
            async for output in session.run("hi", approve=allow):
                outputs.append(output)
                if isinstance(output, RequestEnd) and output.retry_in_ms:
                    session.skip_reconnect_wait()
    ends = of_type(outputs, RequestEnd)
    assert [e.status for e in ends] == ["timeout"] * 6
    assert ends[0].retry_in_ms == 250
    message = ends[0].error_message or ""
    assert message.startswith(f"connection refused by 127.0.0.1:{port} (cannot connect to {base}/")
