"""Compaction through the real SDKs against the loopback mock server.

The Anthropic provider goes through the official ``anthropic`` SDK (the OpenAI-compatible
one through httpx) to :mod:`tests.support.mock_model_server`, which records every request
body and checks the tool_use/tool_result pairing of each (R-TOOL-7). Assertions are on
the recorded JSON bodies: the compaction request's byte-identical prefix (R-COMPACT-5),
the repair of an invalid summary (R-COMPACT-6), overflow with the providers' exact
wordings (R-COMPACT-9), thinking not resent (R-RUN-9), the tool result budget (R-TOOL-8),
and a long session compacted many times (the issue's "Done when").
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import port_of
from test_compaction import (
    assert_one_context_per_file,
    prompt_msg,
    records,
    trace_files,
)

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.anthropic_codec import build_request
from greenroom.protocols.compaction import CORRECTION_NOTE, STRAY_CALL_TEXT
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import (
    CompactionBegin,
    CompactionEnd,
    Output,
    RequestEnd,
    ToolCallOutput,
)
from greenroom.protocols.settings import DEFAULT_COMPACT_PROMPT
from greenroom.protocols.tools import tool
from greenroom.protocols.transcript import rebuild
from tests.support.mock_model_server import (
    Fixture,
    MockModelServer,
    RecordedRequest,
    Reply,
    Response,
    Text,
    Thinking,
    ToolUse,
    error_fixture,
    open_mock_server,
)

LIMIT = 1000
ran: list[str] = []


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    ran.append(key)
    return f"value of {key}"


@asynccontextmanager
async def anthropic_session(
    server: MockModelServer, tmp_path: Path, **settings: Any
) -> AsyncIterator[tuple[Host, Session]]:
    provider = AnthropicProvider(base_url=server.base_url, api_key="test-key")
    settings.setdefault("max_context_length", LIMIT)
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            tools=[lookup],
            provider=provider,
            workspace_dir=tmp_path,
            system="Be brief.",
            model="claude-sonnet-5-5",
            **settings,
        )
        yield host, session


def allow(_: object) -> str:
    return "allow"


def of_type(outputs: list[Output], cls: type[Any]) -> list[Any]:
    return [o for o in outputs if isinstance(o, cls)]


async def run(session: Session, prompt: str, **options: Any) -> list[Output]:
    with trio.fail_after(10):
        outputs: list[Output] = []
        async for output in session.run(prompt, approve=allow, **options):
            outputs.append(output)
            if isinstance(output, RequestEnd) and output.retry_in_ms:
                session.skip_reconnect_wait()  # keep real-time backoffs short
        return outputs


def strip(value: Any) -> Any:
    """``value`` without ``cache_control`` keys (breakpoints move to the last block)."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def texts(body: dict[str, Any]) -> list[str]:
    """Every text of the last message of an Anthropic or OpenAI body."""
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return [content]
    return [b["text"] for b in content if b.get("type") == "text"]


def is_summary(rec: RecordedRequest) -> bool:
    return any(t.endswith(DEFAULT_COMPACT_PROMPT) for t in texts(rec.body))


def assert_prefix(earlier: dict[str, Any], later: dict[str, Any]) -> None:
    """R-COMPACT-5: same system and tools (byte for byte); ``earlier``'s messages are a
    prefix of ``later``'s — byte for byte except the breakpoint on earlier's last block."""
    for key in ("model", "system", "tools"):
        assert dumps(later.get(key)) == dumps(earlier.get(key)), key
    before, after = earlier["messages"], later["messages"]
    assert len(after) >= len(before)
    assert dumps(after[: len(before) - 1]) == dumps(before[:-1])
    last = strip(before[-1])
    shared = strip(after[len(before) - 1])
    # The last earlier message may have been merged with what follows (same role).
    assert shared["role"] == last["role"]
    assert shared["content"][: len(last["content"])] == last["content"]


# -- R-COMPACT-5: the byte-identical prefix ----------------------------------------------------


async def test_compaction_request_keeps_system_tools_and_a_byte_identical_prefix(
    tmp_path: Path,
) -> None:
    """R-COMPACT-5, R-COMPACT-3: the summary request repeats the previous normal request
    (system, tools, messages) byte for byte and only appends (tool results + prompt);
    the next request is exactly one user text [context_summary]…[/context_summary]."""
    ran.clear()
    async with open_mock_server(
        Reply(
            [Text("One."), ToolUse("toolu_1", "lookup", {"key": "a"})],
            stop_reason="tool_use",
            usage=(100, 10),
        ),
        Reply(
            [Text("Two."), ToolUse("toolu_2", "lookup", {"key": "b"})],
            stop_reason="tool_use",
            usage=(900, 200),
        ),
        Reply([Text("[summary]a and b are known[/summary]")]),
        Reply([Text("Done.")]),
        rechunk="random",
    ) as server:
        async with anthropic_session(server, tmp_path) as (host, session):
            outputs = await run(session, "find a and b")
            await assert_one_context_per_file(host, session, [])
        server.assert_clean()
    assert outputs[-1].status == "completed"
    assert [b.reason for b in of_type(outputs, CompactionBegin)] == ["context"]
    first, second, summary, after = (r.body for r in server.requests)
    assert is_summary(server.requests[2])
    assert_prefix(first, second)
    assert_prefix(second, summary)
    assert summary["tools"] and summary["system"][0]["text"] == "Be brief."
    assert "thinking" not in summary
    # Appended: the turn's tool result and the prompt, in one user message.
    tail = summary["messages"][-1]
    assert [b["type"] for b in tail["content"]] == ["tool_result", "text"]
    assert tail["content"][0]["tool_use_id"] == "toolu_2"
    assert tail["content"][1]["text"] == DEFAULT_COMPACT_PROMPT
    assert strip(after["messages"]) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "[context_summary]a and b are known[/context_summary]"}
            ],
        }
    ]
    assert dumps(after["tools"]) == dumps(second["tools"])
    assert sorted(ran) == ["a", "b"]


# -- R-COMPACT-6: a stray tool call in the summary response ------------------------------------


async def test_stray_tool_call_in_the_summary_is_answered_on_the_wire(tmp_path: Path) -> None:
    """R-COMPACT-6: the summary response calls a tool: it is never run; the retry request
    pairs it with a synthetic error tool_result (the server checks pairing), adds the
    correction note before the prompt, and the failed request is its unchanged prefix."""
    ran.clear()
    async with open_mock_server(
        Reply(
            [ToolUse("toolu_1", "lookup", {"key": "a"})], stop_reason="tool_use", usage=(900, 200)
        ),
        Reply(
            [Text("Checking first."), ToolUse("toolu_s", "lookup", {"key": "stray"})],
            stop_reason="tool_use",
        ),
        Reply([Text("[summary]a is known[/summary]")]),
        Reply([Text("Done.")]),
    ) as server:
        async with anthropic_session(server, tmp_path) as (host, session):
            outputs = await run(session, "find a")
            await assert_one_context_per_file(host, session, [])
        server.assert_clean()
    assert ran == ["a"]
    assert [o.call_id for o in of_type(outputs, ToolCallOutput)] == ["toolu_1"]
    (end,) = of_type(outputs, CompactionEnd)
    assert (end.status, end.attempt, end.summary) == ("ok", 2, "a is known")
    bad, retry = server.requests[1].body, server.requests[2].body
    assert_prefix(bad, retry)
    stray, answer = retry["messages"][-2:]
    assert stray["role"] == "assistant"
    assert [b["type"] for b in stray["content"]] == ["text", "tool_use"]
    result, note = strip(answer["content"])
    assert result == {
        "type": "tool_result",
        "tool_use_id": "toolu_s",
        "content": [{"type": "text", "text": STRAY_CALL_TEXT}],
        "is_error": True,
    }
    assert note["text"] == f"{CORRECTION_NOTE}\n\n{DEFAULT_COMPACT_PROMPT}"
    assert outputs[-1].status == "completed"


# -- R-COMPACT-9: overflow with the providers' exact wordings ----------------------------------


OVERFLOWS_ANTHROPIC = [
    error_fixture("anthropic/errors/400_prompt_too_long.json"),
    error_fixture("anthropic/errors/400_input_plus_max_tokens_exceeds_context.json"),
    Fixture("anthropic/model_context_window_exceeded.sse"),
]
OVERFLOWS_OPENAI = [
    error_fixture("openai/errors/400_context_length_exceeded.json"),
    error_fixture("openai/errors/400_context_length_exceeded_with_completion.json"),
    error_fixture("openai/local/vllm_error_context_length.json"),
    error_fixture("openai/local/llamacpp_error_exceed_context.json"),
]


@pytest.mark.parametrize(
    ("wire", "overflow"),
    [("anthropic", o) for o in OVERFLOWS_ANTHROPIC] + [("openai", o) for o in OVERFLOWS_OPENAI],
    ids=[
        "anthropic-prompt-too-long",
        "anthropic-input-plus-max-tokens",
        "anthropic-context-window-exceeded-stop",
        "openai-context-length-exceeded",
        "openai-context-length-exceeded-with-completion",
        "vllm-maximum-context-length",
        "llamacpp-exceed-context-size",
    ],
)
async def test_provider_overflow_compacts_once_and_reruns_the_turn(
    tmp_path: Path, wire: str, overflow: Response
) -> None:
    """R-COMPACT-9, R-RETRY-1: each provider's own "input too long" answer is
    `context_overflow`: one compaction (reason `overflow`), then the same turn again from
    the summary, and the task completes."""
    async with open_mock_server(
        overflow,
        Reply([Text("[summary]The user said hi.[/summary]")]),
        Reply([Text("Hello!")]),
    ) as server:
        provider: Any = (
            AnthropicProvider(base_url=server.base_url, api_key="k")
            if wire == "anthropic"
            else OpenAIProvider(base_url=server.base_url + "/v1", api_key="k")
        )
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                tools=[lookup], provider=provider, workspace_dir=tmp_path, system="Be brief."
            )
            outputs = await run(session, "hi")
        server.assert_clean()
    ends = of_type(outputs, RequestEnd)
    assert [(e.turn, e.attempt, e.status) for e in ends] == [
        (1, 1, "context_overflow"),
        (1, 1, "ok"),
    ]
    assert ends[0].retry_in_ms is None
    assert [b.reason for b in of_type(outputs, CompactionBegin)] == ["overflow"]
    assert of_type(outputs, CompactionEnd)[0].status == "ok"
    assert outputs[-1].status == "completed" and outputs[-1].turns == 1
    assert len(server.requests) == 3
    assert is_summary(server.requests[1])
    rerun = server.requests[2].body
    assert texts(rerun) == ["[context_summary]The user said hi.[/context_summary]"]
    assert len([m for m in rerun["messages"] if m["role"] != "system"]) == 1


@pytest.mark.parametrize(
    ("wire", "response"),
    [
        ("anthropic", error_fixture("anthropic/errors/429_rate_limit_error.json")),
        ("openai", error_fixture("openai/errors/429_rate_limit_exceeded.json")),
        ("anthropic", Fixture("anthropic/max_tokens_truncated_tool_use.sse")),
        ("anthropic", Reply([Text("cut at the li")], stop_reason="max_tokens")),
        ("openai", Fixture("openai/length_truncated_tool_call.sse")),
    ],
    ids=[
        "anthropic-429",
        "openai-429",
        "anthropic-max-tokens-tool",
        "anthropic-max-tokens-text",
        "openai-length",
    ],
)
async def test_rate_limits_and_output_limits_are_not_overflow(
    tmp_path: Path, wire: str, response: Response
) -> None:
    """R-COMPACT-9: a rate limit (retried as `timeout`) or an output-token limit is never
    mistaken for context overflow: no compaction."""
    async with open_mock_server(response, Reply([Text("Fine.")])) as server:
        provider: Any = (
            AnthropicProvider(base_url=server.base_url, api_key="k")
            if wire == "anthropic"
            else OpenAIProvider(base_url=server.base_url + "/v1", api_key="k")
        )
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                tools=[lookup], provider=provider, workspace_dir=tmp_path
            )
            outputs = await run(session, "go")
        server.assert_clean()
    assert of_type(outputs, CompactionBegin) == []
    assert "context_overflow" not in [e.status for e in of_type(outputs, RequestEnd)]
    assert outputs[-1].status == "completed"


# -- R-RUN-9: thinking is not resent -----------------------------------------------------------


async def test_thinking_is_sent_back_only_on_the_current_tool_chain(tmp_path: Path) -> None:
    """R-RUN-9: with thinking on, the signed thinking of the assistant message whose tool
    calls are answered goes back; after a new prompt no earlier thinking is resent; a
    compaction request keeps the task's thinking setting (its prefix is the cached one,
    R-COMPACT-5) and resends no earlier thinking either."""
    async with open_mock_server(
        Reply(
            [
                Thinking("plan the lookup", signature="sig-1"),
                ToolUse("toolu_1", "lookup", {"key": "a"}),
            ],
            stop_reason="tool_use",
            usage=(10, 10),
        ),
        Reply([Thinking("wrap up", signature="sig-2"), Text("a is known.")], usage=(10, 10)),
        Reply([Thinking("again", signature="sig-3"), Text("Still known.")], usage=(900, 200)),
        Reply([Text("[summary]a is known[/summary]")]),
        Reply([Text("Fresh.")]),
    ) as server:
        async with anthropic_session(server, tmp_path) as (_, session):
            await run(session, "find a", thinking_level="low")
            await run(session, "and now?", thinking_level="low")
            await run(session, "once more", thinking_level="low")
        server.assert_clean()
    bodies = [r.body for r in server.requests]
    chain = bodies[1]["messages"][1]["content"]
    assert chain[0] == {"type": "thinking", "thinking": "plan the lookup", "signature": "sig-1"}
    later = bodies[2]
    assert later["thinking"]["type"] == "enabled"
    assert "thinking" not in dumps(later["messages"]).replace('"thinking_level"', "")
    assert not any(
        b["type"] in ("thinking", "redacted_thinking")
        for m in later["messages"]
        for b in m["content"]
    )
    summary = bodies[3]
    assert is_summary(server.requests[3])
    assert summary["thinking"] == later["thinking"]
    assert not any(b["type"] == "thinking" for m in summary["messages"] for b in m["content"])


# -- R-TOOL-8: the tool result budget in the model context -------------------------------------


async def test_large_tool_output_is_cut_on_the_wire_and_in_the_summary_request(
    tmp_path: Path,
) -> None:
    """R-TOOL-8: an output over the session's budget reaches the model (and the
    compaction request) as head + tail around a marker naming the scratchpad file."""
    big = "HEAD-" + "x" * 20_000 + "-TAIL"

    @tool(parallel=True)
    async def dump() -> str:
        """Print a lot."""
        return big

    async with open_mock_server(
        Reply([ToolUse("toolu_1", "dump", {})], stop_reason="tool_use", usage=(900, 200)),
        Reply([Text("[summary]dumped[/summary]")]),
        Reply([Text("Done.")]),
    ) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key="k")
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                tools=[dump],
                provider=provider,
                workspace_dir=tmp_path,
                tool_result_budget=4096,
                max_context_length=LIMIT,
            )
            outputs = await run(session, "dump it")
            (scratch,) = list(session.scratchpad_dir.iterdir())
        server.assert_clean()
    assert outputs[-1].status == "completed"
    result = server.requests[1].body["messages"][-1]["content"][0]
    assert result["type"] == "tool_result"
    shown = result["content"][0]["text"]
    assert shown.startswith("HEAD-") and shown.endswith("-TAIL")
    assert len(shown.encode()) < 4096 + 1024
    assert str(scratch) in shown
    assert scratch.read_text(encoding="utf-8") == big


# -- Done when: a long session compacted many times --------------------------------------------


async def test_fifty_turns_past_a_small_threshold_keep_going(tmp_path: Path) -> None:
    """The issue's "Done when": 50 turns over ten tasks against the loopback mock with the
    anthropic provider and a small threshold: compaction happens many times, every
    request is paired (server.assert_clean), every summary request repeats the previous
    request's system, tools and messages, and every trace file is one consistent context
    (it alone rebuilds exactly what was summarized, or the live context)."""
    ran.clear()
    turns = [0]

    def model(rec: RecordedRequest) -> Response:
        if is_summary(rec):
            return Reply([Text(f"Noted.\n[summary]state after {turns[0]} turns[/summary]")])
        turns[0] += 1
        n = turns[0]
        if n % 5 == 0:
            return Reply([Text(f"Task part {n} finished.")])
        return Reply(
            [Text(f"Step {n}."), ToolUse(f"toolu_{n:03d}", "lookup", {"key": f"k{n}"})],
            stop_reason="tool_use",
        )

    async with open_mock_server(fallback=model, rechunk=64) as server:
        async with anthropic_session(server, tmp_path, max_context_length=300) as (
            host,
            session,
        ):
            for task in range(10):
                outputs = await run(session, f"task {task}")
                assert outputs[-1].status == "completed", outputs[-1]
            await host.trace_store.log.sync()
            files = trace_files(session)
            per_file = await assert_one_context_per_file(host, session, [])
            schemas = port_of(session).tool_schemas
        server.assert_clean()
    assert turns[0] == 50
    assert sorted(ran) == sorted(f"k{n}" for n in range(1, 51) if n % 5)
    summaries = [i for i, r in enumerate(server.requests) if is_summary(r)]
    assert len(summaries) >= 10
    assert len(files) == len(summaries) + 1
    ends = [r for recs in per_file for r in recs if isinstance(r, CompactionEnd)]
    assert [e.status for e in ends] == ["ok"] * len(summaries)
    for i, recs in zip(summaries, per_file, strict=False):
        summary = server.requests[i].body
        assert_prefix(server.requests[i - 1].body, summary)
        # The file alone rebuilds exactly the context that was summarized.
        rebuilt = build_request(
            ModelRequest(
                model="claude-sonnet-5-5",
                system="Be brief.",
                tools=schemas,
                messages=(*rebuild(recs).compaction_base()[0], prompt_msg()),
                max_tokens=8192,
            )
        )
        assert strip(rebuilt["messages"]) == strip(summary["messages"])
    assert all(records(f) for f in files)


# -- R-COMPACT-5 for a structured task answering through the final tool ------------------------

OPEN_SCHEMA = {
    "type": "object",
    "properties": {"key": {"type": "string"}},
    "required": ["key"],
    "additionalProperties": True,  # a map: no native form, the final tool carries it
}


async def test_summary_request_of_a_structured_task_keeps_the_final_answer_tool(
    tmp_path: Path,
) -> None:
    """R-COMPACT-5, R-OUT-1: a structured task whose answer goes through the final_answer
    tool compacts: the summary request repeats the turn's tools byte for byte, final_answer
    included (the prompt cache still hits), and forces no answer (no tool_choice); the
    turn after the compaction forces it again."""
    async with open_mock_server(
        Reply(
            [ToolUse("toolu_1", "lookup", {"key": "a"})], stop_reason="tool_use",
            usage=(900, 200),
        ),
        Reply([Text("[summary]a is known[/summary]")]),
        Reply([ToolUse("toolu_2", "final_answer", {"key": "a"})], stop_reason="tool_use"),
    ) as server:
        async with anthropic_session(server, tmp_path) as (_, session):
            outputs = await run(session, "find a", output_schema=OPEN_SCHEMA)
        server.assert_clean()
    assert (outputs[-1].status, outputs[-1].output) == ("completed", {"key": "a"})
    turn, summary, after = (r.body for r in server.requests)
    assert is_summary(server.requests[1])
    assert [t["name"] for t in turn["tools"]] == ["lookup", "final_answer"]
    assert_prefix(turn, summary)
    assert turn["tool_choice"] == {"type": "any"}
    assert "tool_choice" not in summary and "output_config" not in summary
    assert dumps(after["tools"]) == dumps(turn["tools"])
    assert after["tool_choice"] == {"type": "any"}


async def test_summary_request_defines_the_final_answer_tool_its_history_calls(
    tmp_path: Path,
) -> None:
    """R-COMPACT-5, R-OUT-1: a session without tools whose structured task had its first
    final_answer refused compacts: the summary request's history holds that tool_use, so
    it defines the tool (the turn's tools, byte for byte), without naming it in
    tool_choice."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": True,
    }
    async with open_mock_server(
        Reply(
            [ToolUse("toolu_1", "final_answer", {"n": "x"})], stop_reason="tool_use",
            usage=(900, 200),
        ),
        Reply([Text("[summary]n was asked for; x is no integer[/summary]")]),
        Reply([ToolUse("toolu_2", "final_answer", {"n": 1})], stop_reason="tool_use"),
    ) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key="test-key")
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(
                tools=[], provider=provider, workspace_dir=tmp_path,
                model="claude-sonnet-5-5", max_context_length=LIMIT,
            )
            outputs = await run(session, "give n", output_schema=schema)
        server.assert_clean()
    assert (outputs[-1].status, outputs[-1].output) == ("completed", {"n": 1})
    turn, summary, _after = (r.body for r in server.requests)
    assert is_summary(server.requests[1])
    calls = [
        b["name"] for m in summary["messages"] for b in m["content"] if b["type"] == "tool_use"
    ]
    assert calls == ["final_answer"]
    assert [t["name"] for t in summary["tools"]] == ["final_answer"]
    assert dumps(summary["tools"]) == dumps(turn["tools"])
    assert turn["tool_choice"] == {"type": "tool", "name": "final_answer"}
    assert "tool_choice" not in summary and "output_config" not in summary
