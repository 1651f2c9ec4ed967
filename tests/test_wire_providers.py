"""The full runtime against a real HTTP server speaking each provider's wire protocol.

Requests go through the real ``anthropic`` SDK (and httpx for the OpenAI-compatible
provider) to the loopback mock server, which checks the tool_use/tool_result pairing of
EVERY request it receives (R-TOOL-7). Backoff waits here are the runtime's real schedule
(250 ms, 500 ms…); the exact schedule is tested under MockClock with the scripted model.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.errors import AuthLocked
from greenroom.actors.host import Host
from greenroom.actors.provider_anthropic import AnthropicProvider
from greenroom.actors.provider_openai import OpenAIProvider
from greenroom.actors.session import Session
from greenroom.protocols.outputs import (
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
    Text,
    Thinking,
    ToolUse,
    WireError,
    error_fixture,
    open_mock_server,
)

ran: list[str] = []


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    ran.append(key)
    return f"value of {key}"


@asynccontextmanager
async def anthropic_session(
    server: MockModelServer, tmp_path: Path, **settings: Any
) -> AsyncIterator[Session]:
    provider = AnthropicProvider(base_url=server.base_url, api_key="test-key")
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


async def test_overloaded_then_success_is_retried_with_turn_retried(tmp_path: Path) -> None:
    """R-RETRY-1..4: a 529 and a mid-stream overloaded error are retried in the same turn;
    the retry carries the partial output in a [turn_retried] block."""
    async with open_mock_server(
        error_fixture("anthropic/errors/529_overloaded_error.json"),
        MidStreamError(Reply([Text("Partial answer that was cut")]), after_events=4),
        Reply([Text("Complete answer.")]),
    ) as server:
        async with anthropic_session(server, tmp_path) as session:
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


async def test_auth_failure_is_not_retried_and_locks_the_session(tmp_path: Path) -> None:
    """R-RETRY-6: 401 ends the turn with auth, no retry; the session refuses new tasks until
    retry_auth()."""
    async with open_mock_server(
        error_fixture("anthropic/errors/401_authentication_error.json"),
        Reply([Text("Hello again.")]),
    ) as server:
        async with anthropic_session(server, tmp_path) as session:
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
    """R-RETRY-1: a dropped connection is `timeout`, bad JSON and a stream without
    message_stop are `malformed`; the half-streamed tool call of the fixture never runs."""
    ran.clear()
    async with open_mock_server(fault, Reply([Text("Recovered.")])) as server:
        async with anthropic_session(server, tmp_path) as session:
            with trio.fail_after(10):
                outputs = [o async for o in session.run("go", approve=allow)]
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert ends[0].status in ("timeout", "malformed") and ends[0].attempt == 1
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


async def test_bad_request_fails_after_the_retry_budget(tmp_path: Path) -> None:
    """R-RETRY-2: `failed` is retried too and, with the budget spent, the task fails with
    the status kept as `failed` (never relabelled)."""
    bad = error_fixture("anthropic/errors/404_not_found_error.json")
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
    `insufficient_quota` classified `failed`, not a transient timeout."""
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
                outputs = [o async for o in session.run("go", approve=allow)]
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert ends[0].status == "failed" and "quota" in (ends[0].error_message or "")
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
