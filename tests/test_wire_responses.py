"""The OpenAI Responses provider end to end: httpx against the loopback server's
``/v1/responses``, which checks the ``call_id`` pairing of every request (R-TOOL-7)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.actors.runtime.errors import AuthLocked
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import ThinkingBlock
from greenroom.protocols.outputs import ModelMsg, Output, RequestEnd, TaskEnd, ToolCallOutput
from greenroom.protocols.tools import tool
from tests.support.mock_model_server import (
    DropAfter,
    MidStreamError,
    MockModelServer,
    Reply,
    Text,
    Thinking,
    ToolUse,
    WireError,
    open_mock_server,
)

ran: list[str] = []


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    ran.append(key)
    return f"value of {key}"


def allow(_: object) -> str:
    return "allow"


def of_type(outputs: list[Output], cls: type[Any]) -> list[Any]:
    return [o for o in outputs if isinstance(o, cls)]


@asynccontextmanager
async def responses_session(server: MockModelServer, tmp_path: Path) -> AsyncIterator[Session]:
    provider = OpenAIResponsesProvider(base_url=server.base_url + "/v1", api_key="k")
    async with Host.open(tmp_path / "data") as host:
        yield await host.create_session(
            tools=[lookup], provider=provider, workspace_dir=tmp_path, system="Be brief.",
            model="gpt-5-mini",
        )


async def run(session: Session, prompt: str, **options: Any) -> list[Output]:
    with trio.fail_after(10):
        return [o async for o in session.run(prompt, approve=allow, **options)]


async def test_tool_turns_carry_the_encrypted_reasoning_across_the_call(tmp_path: Path) -> None:
    """R-RUN-9's provider exception: the reasoning item of the message whose calls are
    answered goes back with its encrypted content; results pair by call_id in call order."""
    ran.clear()
    async with open_mock_server(
        Reply(
            [
                Thinking("Both keys are needed.", signature="ENCRYPTED-1"),
                Text("Looking them up."),
                ToolUse("call_a", "lookup", {"key": 'Sáo "1"'}),
                ToolUse("call_b", "lookup", {"key": "two"}),
            ],
            stop_reason="tool_use",
        ),
        Reply([Text("Both found.")]),
        rechunk="random",
    ) as server:
        async with responses_session(server, tmp_path) as session:
            outputs = await run(session, "find them", thinking_level="low")
        server.assert_clean()
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed" and end.turns == 2
    assert sorted(ran) == ['Sáo "1"', "two"]
    thinking = [o.block for o in of_type(outputs, ModelMsg) if isinstance(o.block, ThinkingBlock)]
    assert thinking and thinking[0].signature == "ENCRYPTED-1" and thinking[0].item_id
    first, second = (r.body for r in server.requests)
    assert first["store"] is False and first["include"] == ["reasoning.encrypted_content"]
    assert first["instructions"] == "Be brief." and first["reasoning"]["effort"] == "low"
    kinds = [item["type"] for item in second["input"]]
    assert kinds == ["message", "reasoning", "message", "function_call", "function_call",
                     "function_call_output", "function_call_output"]
    reasoning = second["input"][1]
    assert reasoning["encrypted_content"] == "ENCRYPTED-1"
    assert reasoning["id"] == thinking[0].item_id
    answered = [i["call_id"] for i in second["input"] if i["type"] == "function_call_output"]
    assert answered == ["call_a", "call_b"]
    # The prefix of turn 2 is turn 1's input, byte for byte, under the same cache key.
    assert json.dumps(second["input"][:1]) == json.dumps(first["input"])
    assert first["prompt_cache_key"] == second["prompt_cache_key"]


async def test_a_failure_mid_stream_is_retried_with_the_partial_output(tmp_path: Path) -> None:
    """R-RETRY-1..4: a response.failed after some text is a retried `timeout`; the retry
    carries the partial output in [turn_retried]; tools that ran are not run again."""
    ran.clear()
    async with open_mock_server(
        MidStreamError(
            Reply([Text("Partial answer"), ToolUse("call_1", "lookup", {"key": "k"}),
                   Text("cut here")], stop_reason="tool_use"),
            after_events=11,
            error_type="server_error",
            message="The server had an error.",
        ),
        Reply([Text("Complete answer.")]),
    ) as server:
        async with responses_session(server, tmp_path) as session:
            outputs = await run(session, "question")
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert [(e.status, e.attempt, e.retry_in_ms) for e in ends] == [
        ("timeout", 1, 250), ("ok", 2, None)
    ]
    assert ran == ["k"]
    retry = json.dumps(server.requests[1].body["input"])
    assert "[turn_retried]" in retry and "Partial answer" in retry
    assert outputs[-1].status == "completed"


async def test_a_dropped_connection_is_malformed_and_retried(tmp_path: Path) -> None:
    async with open_mock_server(
        DropAfter(Reply([Text("one two three four")]), after_events=3),
        Reply([Text("Recovered.")]),
    ) as server:
        async with responses_session(server, tmp_path) as session:
            outputs = await run(session, "go")
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert [e.status for e in ends] == ["malformed", "ok"]


async def test_a_call_cut_by_max_output_tokens_never_runs(tmp_path: Path) -> None:
    """R-TOOL-5: response.incomplete leaves the open call truncated; it stays paired."""
    ran.clear()
    async with open_mock_server(
        Reply([Text("Writing."), ToolUse("call_cut", "lookup", {"key": "long " * 20})],
              stop_reason="max_tokens"),
        Reply([Text("Shorter next time.")]),
    ) as server:
        async with responses_session(server, tmp_path) as session:
            outputs = await run(session, "write it")
        server.assert_clean()
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.status == "truncated" and result.call_id == "call_cut"
    assert ran == []
    answer = [i for i in server.requests[1].body["input"] if i["type"] == "function_call_output"]
    assert [i["call_id"] for i in answer] == ["call_cut"]


async def test_auth_failure_locks_the_session(tmp_path: Path) -> None:
    async with open_mock_server(
        WireError(401, "invalid_request_error", "Incorrect API key provided."),
        Reply([Text("Hello again.")]),
    ) as server:
        async with responses_session(server, tmp_path) as session:
            outputs = await run(session, "hi")
            assert [(e.status, e.attempt) for e in of_type(outputs, RequestEnd)] == [("auth", 1)]
            with pytest.raises(AuthLocked):
                session.run("again")
            session.retry_auth()
            again = await run(session, "again")
    assert again[-1].status == "completed"


async def test_an_unknown_model_ends_the_turn_at_once(tmp_path: Path) -> None:
    async with open_mock_server(
        WireError(404, "invalid_request_error", "The model `gpt-x` does not exist."),
    ) as server:
        async with responses_session(server, tmp_path) as session:
            outputs = await run(session, "hi")
    (end,) = of_type(outputs, RequestEnd)
    assert end.status == "failed" and end.retry_in_ms is None
    assert "does not exist" in (end.error_message or "")
    assert len(server.requests) == 1


async def test_the_cli_runs_the_responses_provider(tmp_path: Path) -> None:
    """`--provider openai-responses --base-url` reaches the server through the registry."""
    import sys

    async with open_mock_server(Reply([Text("Hello from responses.")])) as server:
        process = await trio.run_process(
            [sys.executable, "-m", "greenroom", "run", "--json", "--provider",
             "openai-responses", "--base-url", server.base_url + "/v1", "--model", "gpt-5-mini",
             "--data-dir", str(tmp_path / "data"), "--workspace", str(tmp_path), "hi"],
            capture_stdout=True, capture_stderr=True, check=False,
            env={"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "k", "HOME": str(tmp_path)},
        )
        server.assert_clean()
    assert process.returncode == 0, process.stderr.decode()
    lines = [json.loads(line) for line in process.stdout.decode().splitlines()]
    texts = [o["block"]["text"] for o in lines if o["type"] == "model_msg"]
    assert texts == ["Hello from responses."]
    assert server.requests[0].path == "/v1/responses"
