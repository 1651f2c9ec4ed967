"""Structured output (R-OUT-1) over the wire: each provider's encoding through its real
client (the ``anthropic`` SDK, httpx for the OpenAI APIs) to the loopback mock server,
which refuses what the real API would refuse in a structured request
(``tests/support/mock_structured.py``) and checks the call pairing of every request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import RunResult, Session
from greenroom.protocols.tools import tool
from tests.support.mock_model_server import (
    MockModelServer,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)


@attrs.frozen
class Forecast:
    """Tomorrow's forecast for one city."""

    city: str
    high: float
    rain: bool
    note: str | None = None


GOOD = {"city": "Lyon", "high": 24.0, "rain": False}


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    return f"value of {key}"


def allow(_: object) -> str:
    return "allow"


@asynccontextmanager
async def session_on(
    server: MockModelServer, tmp_path: Path, kind: str, model: str
) -> AsyncIterator[Session]:
    provider: Any
    if kind == "anthropic":
        provider = AnthropicProvider(base_url=server.base_url, api_key="test-key")
    elif kind == "openai":
        provider = OpenAIProvider(base_url=server.base_url + "/v1", api_key="k")
    else:
        provider = OpenAIResponsesProvider(base_url=server.base_url + "/v1", api_key="k")
    async with Host.open(tmp_path / "data") as host:
        yield await host.create_session(
            tools=[lookup], provider=provider, workspace_dir=tmp_path, model=model
        )


async def run(session: Session, **options: Any) -> RunResult:
    with trio.fail_after(10):
        return await session.run(
            "forecast for Lyon?", approve=allow, output_schema=Forecast, **options
        ).result()


async def test_anthropic_native_structured_output_for_a_model_that_has_it(
    tmp_path: Path,
) -> None:
    """A Claude 4.5+ model gets ``output_config.format`` (every object closed, the
    keywords it refuses left out); tools are still offered and called first."""
    async with open_mock_server(
        Reply([ToolUse("toolu_1", "lookup", {"key": "lyon"})], stop_reason="tool_use"),
        Reply([Text(json.dumps(GOOD))]),
    ) as server:
        async with session_on(server, tmp_path, "anthropic", "claude-sonnet-4-5") as session:
            result = await run(session)
        server.assert_clean()
    assert result.status == "completed"
    assert result.output == Forecast(city="Lyon", high=24.0, rain=False)
    first, second = (r.body for r in server.requests)
    schema = first["output_config"]["format"]["schema"]
    assert first["output_config"]["format"]["type"] == "json_schema"
    assert schema["additionalProperties"] is False and schema["required"] == [
        "city", "high", "rain"
    ]
    assert [t["name"] for t in first["tools"]] == ["lookup"] and "tool_choice" not in first
    assert second["output_config"] == first["output_config"]


async def test_anthropic_older_models_answer_through_the_forced_final_tool(
    tmp_path: Path,
) -> None:
    """A model without native structured output gets the ``final_answer`` tool, and must
    call a tool every turn (``tool_choice: any``, as the session has another tool): it
    looks up, then answers; the answer's call is paired like any call."""
    async with open_mock_server(
        Reply([ToolUse("toolu_1", "lookup", {"key": "lyon"})], stop_reason="tool_use"),
        Reply([ToolUse("toolu_2", "final_answer", GOOD)], stop_reason="tool_use"),
    ) as server:
        async with session_on(server, tmp_path, "anthropic", "claude-sonnet-4-20250514") as s:
            result = await run(s)
        server.assert_clean()
    assert result.status == "completed" and result.output == Forecast("Lyon", 24.0, False)
    first, second = (r.body for r in server.requests)
    assert "output_config" not in first
    assert [t["name"] for t in first["tools"]] == ["lookup", "final_answer"]
    assert first["tools"][-1]["input_schema"]["properties"]["rain"] == {"type": "boolean"}
    assert first["tool_choice"] == {"type": "any"}
    assert second["tool_choice"] == {"type": "any"}
    assert result.task_end.turns == 2  # the accepted answer ends the task: no third request


async def test_anthropic_final_tool_is_named_when_it_is_the_only_tool_and_free_with_thinking(
    tmp_path: Path,
) -> None:
    """Alone, the final tool is named in ``tool_choice``; with extended thinking a forced
    choice is refused by the API, so none is sent and a JSON text answer is taken."""
    async with open_mock_server(
        Reply([ToolUse("toolu_1", "final_answer", GOOD)], stop_reason="tool_use"),
        Reply([Text("```json\n" + json.dumps(GOOD) + "\n```")]),
    ) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key="test-key")
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                provider=provider, workspace_dir=tmp_path, model="claude-3-7-sonnet-latest"
            )
            named = await run(session)
            thinking = await run(session, thinking_level="low")
        server.assert_clean()
    assert named.output == thinking.output == Forecast("Lyon", 24.0, False)
    first, second = (r.body for r in server.requests)
    assert first["tool_choice"] == {"type": "tool", "name": "final_answer"}
    assert "thinking" in second and "tool_choice" not in second


async def test_openai_chat_response_format_with_tools_and_one_repair(tmp_path: Path) -> None:
    """Chat completions get ``response_format: json_schema`` (non-strict: ``note`` has a
    default, so strict mode could not hold it); an answer that misses a field is sent back
    once with its problems, and the second is taken."""
    async with open_mock_server(
        Reply([ToolUse("call_1", "lookup", {"key": "lyon"})], stop_reason="tool_use"),
        Reply([Text('{"city": "Lyon", "high": 24}')]),
        Reply([Text(json.dumps({**GOOD, "note": "windy"}))]),
    ) as server:
        async with session_on(server, tmp_path, "openai", "gpt-4o-mini") as session:
            result = await run(session)
        server.assert_clean()
    assert result.output == Forecast("Lyon", 24.0, False, "windy")
    bodies = [r.body for r in server.requests]
    fmt = bodies[0]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Forecast"
    assert fmt["json_schema"]["strict"] is False
    repair = bodies[2]["messages"][-1]
    assert repair["role"] == "user" and "$.rain: required property missing" in json.dumps(repair)


async def test_openai_responses_text_format_strict_when_the_schema_allows(
    tmp_path: Path,
) -> None:
    """The Responses API gets ``text.format``; a schema whose objects are closed and
    require every property goes strict."""
    schema = {
        "type": "object",
        "title": "City",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    async with open_mock_server(Reply([Text('{"name": "Lyon"}')])) as server:
        async with session_on(server, tmp_path, "responses", "gpt-5-mini") as session:
            with trio.fail_after(10):
                result = await session.run("city?", output_schema=schema).result()
        server.assert_clean()
    assert result.output == {"name": "Lyon"} and result.task_end.output == {"name": "Lyon"}
    (body,) = (r.body for r in server.requests)
    assert body["text"]["format"] == {
        "type": "json_schema", "name": "City", "schema": schema, "strict": True
    }
