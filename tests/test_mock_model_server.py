"""The loopback mock model server, exercised through the real anthropic SDK and httpx."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio
import trio.testing

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from tests.support.mock_model_server import (  # noqa: E402
    FIXTURES_DIR,
    DropAfter,
    ErrorReply,
    Fixture,
    Hang,
    KeepAlives,
    MalformedJSON,
    MidStreamError,
    Paused,
    RecordedRequest,
    Reply,
    Response,
    SlowFirstByte,
    Text,
    Thinking,
    ToolUse,
    WireError,
    Workload,
    check_anthropic_messages,
    check_openai_messages,
    error_fixture,
    fixture_manifest,
    open_mock_server,
)

USER = [{"role": "user", "content": "hi"}]


def sdk(server: Any, api_key: str = "k") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base_url, api_key=api_key, max_retries=0)


def parse_anthropic_sse(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for raw in body.decode().split("\n\n"):
        if not raw.strip():
            continue
        lines = dict(line.split(": ", 1) for line in raw.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def openai_payloads(body: bytes) -> list[str]:
    out = []
    for raw in body.decode().split("\n\n"):
        if raw.strip():
            assert raw.startswith("data: "), raw
            out.append(raw[len("data: ") :])
    return out


# -- through the anthropic SDK -------------------------------------------------------------------


async def test_sdk_parses_text_thinking_and_tool_use() -> None:
    reply = Reply(
        [
            Thinking("Let me think about it.", signature="sig-1"),
            Text("Hello there, friend — é 👋"),
            ToolUse("toolu_1", "lookup", {"key": 'a "quoted" \\ value\nnext', "n": [1, 2]}),
        ],
        stop_reason="tool_use",
        usage=(12, 34),
    )
    with trio.fail_after(10):
        async with (
            open_mock_server(reply) as server,
            sdk(server) as client,
            client.messages.stream(model="m", max_tokens=100, messages=USER) as stream,
        ):
            text_deltas = [e.delta.text async for e in stream
                           if e.type == "content_block_delta" and e.delta.type == "text_delta"]
            message = await stream.get_final_message()
    assert text_deltas == ["Hello ", "there, ", "friend ", "— ", "é ", "👋"]
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think about it."
    assert thinking.signature == "sig-1"
    assert text.type == "text" and text.text == "Hello there, friend — é 👋"
    assert tool.type == "tool_use" and tool.id == "toolu_1" and tool.name == "lookup"
    assert tool.input == {"key": 'a "quoted" \\ value\nnext', "n": [1, 2]}
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 34)
    assert message.model == "m"  # message_start names the model asked for, as a provider does
    (req,) = server.requests
    assert req.index == 1 and req.path == "/v1/messages" and req.wire == "anthropic"
    assert req.api_key == "k"  # SDK 2.14 sends `authorization: Bearer k`
    assert req.body["messages"] == USER and req.stream
    server.assert_clean()


async def test_sdk_raw_event_stream_matches_fixture_shapes() -> None:
    with trio.fail_after(10):
        async with open_mock_server(Reply(["a b"])) as server, sdk(server) as client:
            stream = await client.messages.create(
                model="m", max_tokens=10, messages=USER, stream=True
            )
            types = [event.type async for event in stream]
    assert types == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]


async def test_sdk_error_reply_529() -> None:
    with trio.fail_after(10):
        async with open_mock_server(
            ErrorReply.anthropic(529, "overloaded_error", "Overloaded", {"x-should-retry": "true"})
        ) as server, sdk(server) as client:
            with pytest.raises(anthropic.APIStatusError) as info:
                await client.messages.create(model="m", max_tokens=10, messages=USER,
                                             stream=True)
    assert info.value.status_code == 529
    assert isinstance(info.value, anthropic.OverloadedError)
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    server.assert_clean()


async def test_sdk_error_fixture_429_headers() -> None:
    with trio.fail_after(10):
        async with open_mock_server(
            error_fixture("anthropic/errors/429_rate_limit_error.json")
        ) as server, sdk(server) as client:
            with pytest.raises(anthropic.RateLimitError) as info:
                await client.messages.create(model="m", max_tokens=10, messages=USER)
    assert info.value.response.headers["retry-after"]
    assert info.value.response.headers["anthropic-ratelimit-requests-limit"]


async def test_sdk_401_when_api_key_does_not_match() -> None:
    with trio.fail_after(10):
        async with open_mock_server(Reply(["ok"]), require_api_key="right") as server:
            async with sdk(server, api_key="wrong") as client:
                with pytest.raises(anthropic.AuthenticationError) as info:
                    await client.messages.create(model="m", max_tokens=10, messages=USER)
            assert info.value.status_code == 401
            assert server.pending == 1  # a refused request does not consume the script
            async with sdk(server, api_key="right") as client:
                message = await client.messages.create(model="m", max_tokens=10, messages=USER)
    assert message.content[0].type == "text" and message.content[0].text == "ok"
    assert [r.api_key for r in server.requests] == ["wrong", "right"]


async def test_sdk_midstream_error_raises() -> None:
    with trio.fail_after(10):
        async with open_mock_server(
            MidStreamError(Reply(["one two three four"]), after_events=4)
        ) as server, sdk(server) as client:
            stream = await client.messages.create(model="m", max_tokens=10, messages=USER,
                                                  stream=True)
            seen = []
            with pytest.raises(anthropic.APIStatusError) as info:
                async for event in stream:
                    seen.append(event.type)
    assert seen == ["message_start", "content_block_start", "content_block_delta",
                    "content_block_delta"]
    assert "overloaded_error" in str(info.value)


async def test_sdk_parses_byte_rechunked_fixture() -> None:
    """Every byte in its own HTTP chunk: the SDK's SSE decoder meets every boundary."""
    expect = fixture_manifest()["anthropic/thinking_then_tool_use.sse"]["expect"]
    with trio.fail_after(20):
        async with (
            open_mock_server(Fixture("anthropic/thinking_then_tool_use.sse"), rechunk=1) as server,
            sdk(server) as client,
            client.messages.stream(model="m", max_tokens=10, messages=USER) as s,
        ):
            message = await s.get_final_message()
    tools = [{"id": b.id, "name": b.name, "input": b.input}
             for b in message.content if b.type == "tool_use"]
    assert tools == expect["tool_calls"]
    assert message.stop_reason == "tool_use"


# -- OpenAI wire format and faults over raw httpx ------------------------------------------------


async def test_openai_reply_with_tool_calls() -> None:
    reply = Reply(
        [Text("Let me check."), ToolUse("call_1", "lookup", {"key": "1"}),
         ToolUse("call_2", "lookup", {"key": "é\"2"})],
        stop_reason="tool_use",
        usage=(7, 9),
    )
    with trio.fail_after(10):
        async with open_mock_server(reply) as server, httpx.AsyncClient() as client:
            response = await client.post(
                f"{server.base_url}/v1/chat/completions",
                json={"model": "gpt", "stream": True, "messages": USER},
                headers={"authorization": "Bearer sk-test"},
            )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["transfer-encoding"] == "chunked"
    payloads = openai_payloads(response.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = ""
    calls: dict[int, dict[str, str]] = {}
    fragments: dict[int, int] = {}
    for chunk in chunks[:-2]:
        delta = chunk["choices"][0]["delta"]
        text += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in tc:
                entry["id"], entry["name"] = tc["id"], tc["function"]["name"]
            elif tc["function"]["arguments"]:
                fragments[tc["index"]] = fragments.get(tc["index"], 0) + 1
            entry["arguments"] += tc["function"]["arguments"]
    assert text == "Let me check."
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("call_1", "lookup", {"key": "1"}), ("call_2", "lookup", {"key": 'é"2'})]
    assert fragments == {0: 3, 1: 3}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert {chunk["model"] for chunk in chunks} == {"gpt"}  # the model asked for
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
    assert server.requests[0].api_key == "sk-test" and server.requests[0].wire == "openai"


async def test_drop_after_ends_the_stream_early() -> None:
    with trio.fail_after(10):
        async with open_mock_server(
            DropAfter(Reply(["one two three four five"]), after_events=3)
        ) as server, httpx.AsyncClient() as client:
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream(
                    "POST", f"{server.base_url}/v1/messages",
                    json={"model": "m", "stream": True, "messages": USER},
                ) as response:
                    async for piece in response.aiter_bytes():
                        received += piece
    assert [name for name, _ in parse_anthropic_sse(received)] == [
        "message_start", "content_block_start", "content_block_delta"]


async def test_malformed_json_event() -> None:
    with trio.fail_after(10):
        async with open_mock_server(
            MalformedJSON(after_events=2), MalformedJSON(after_events=1)
        ) as server, httpx.AsyncClient() as client:
            first = await client.post(f"{server.base_url}/v1/messages",
                                      json={"stream": True, "messages": USER})
            second = await client.post(f"{server.base_url}/v1/chat/completions",
                                       json={"stream": True, "messages": USER})
    events = [e for e in first.content.decode().split("\n\n") if e]
    assert len(events) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(events[2].split("data: ", 1)[1])
    payloads = openai_payloads(second.content)
    assert len(payloads) == 2 and "[DONE]" not in payloads
    with pytest.raises(json.JSONDecodeError):
        json.loads(payloads[1])


async def test_hang_until_the_client_gives_up_and_slow_first_byte() -> None:
    with trio.fail_after(10):
        async with open_mock_server(
            Hang(), SlowFirstByte(Reply(["late"]), 0.2)
        ) as server, httpx.AsyncClient() as client:
            with pytest.raises(httpx.ReadTimeout):
                async with client.stream(
                    "POST", f"{server.base_url}/v1/messages",
                    json={"stream": True, "messages": USER}, timeout=httpx.Timeout(5, read=0.2),
                ) as response:
                    assert response.status_code == 200  # headers arrived
                    await response.aread()
            start = trio.current_time()
            late = await client.post(f"{server.base_url}/v1/messages",
                                     json={"stream": False, "messages": USER})
            assert trio.current_time() - start >= 0.2
    assert late.json()["content"] == [{"type": "text", "text": "late"}]


@pytest.mark.parametrize(
    ("path", "style", "keepalive"),
    [
        ("/v1/messages", "ping", b'event: ping\ndata: {"type":"ping"}\n\n'),
        ("/v1/chat/completions", "comment", b": keep-alive\n\n"),
        ("/v1/responses", "blank", b"\n"),
    ],
)
async def test_keepalives_follow_the_first_events_until_the_time_is_up(
    autojump_clock: trio.testing.MockClock, path: str, style: str, keepalive: bytes
) -> None:
    """:class:`KeepAlives`: the reply's first event, then a keep-alive every ``every_s``
    seconds, and after ``for_s`` a body cut short (no chunked terminator)."""
    async with open_mock_server(
        KeepAlives(after_events=1, every_s=2.0, style=style, for_s=9.0)  # type: ignore[arg-type]
    ) as server, httpx.AsyncClient(timeout=httpx.Timeout(5, read=None)) as client:
        pieces: list[tuple[float, bytes]] = []
        with pytest.raises(httpx.RemoteProtocolError):
            body = {"stream": True, "messages": USER, "input": USER}
            async with client.stream("POST", server.base_url + path, json=body) as response:
                async for piece in response.aiter_bytes():
                    pieces.append((trio.current_time(), piece))
    (start, first), *rest = pieces
    assert first.startswith((b"event: message_start", b"data: {", b"event: response.created"))
    assert [piece for _, piece in rest] == [keepalive] * 4
    assert [round(at - start, 3) for at, _ in rest] == [2.0, 4.0, 6.0, 8.0]


async def test_empty_fifo_answers_500_naming_the_request() -> None:
    with trio.fail_after(10):
        async with open_mock_server(Reply(["only one"])) as server, sdk(server) as client:
            await client.messages.create(model="m", max_tokens=10, messages=USER)
            with pytest.raises(anthropic.InternalServerError) as info:
                await client.messages.create(model="m", max_tokens=10, messages=USER)
    assert "request #2" in str(info.value)
    with pytest.raises(AssertionError, match="request #2"):
        server.assert_clean()


async def test_callable_handler_and_wire_error_and_keep_alive() -> None:
    def echo(request: RecordedRequest) -> Response:
        return Reply([Text(f"you said {request.messages[-1]['content']}")])

    with trio.fail_after(10):
        async with open_mock_server(
            echo, WireError(503, "overloaded_error", "busy"), fallback=echo
        ) as server, httpx.AsyncClient() as client:
            url = f"{server.base_url}/v1/chat/completions"
            bodies = [{"stream": False, "messages": [{"role": "user", "content": str(i)}]}
                      for i in range(4)]
            first = await client.post(url, json=bodies[0])
            busy = await client.post(url, json=bodies[1])
            rest = [await client.post(url, json=b) for b in bodies[2:]]
    assert first.json()["choices"][0]["message"]["content"] == "you said 0"
    assert busy.status_code == 503 and busy.json()["error"]["message"] == "busy"
    assert [r.json()["choices"][0]["message"]["content"] for r in rest] == [
        "you said 2", "you said 3"]
    assert server.connections_total == 1  # keep-alive: one connection for all four
    server.assert_clean()


# -- invariants ----------------------------------------------------------------------------------

TOOL_TURN = {"role": "assistant", "content": [
    {"type": "text", "text": "checking"},
    {"type": "tool_use", "id": "toolu_a", "name": "lookup", "input": {}},
    {"type": "tool_use", "id": "toolu_b", "name": "lookup", "input": {}}]}


def results(*ids: str) -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": i, "content": "ok"} for i in ids]}


def test_anthropic_invariants() -> None:
    ok = {"messages": [*USER, TOOL_TURN, results("toolu_a", "toolu_b")]}
    assert check_anthropic_messages(ok) == []
    unpaired = check_anthropic_messages({"messages": [*USER, TOOL_TURN, results("toolu_a")]})
    assert len(unpaired) == 1 and "'toolu_b' has no tool_result" in unpaired[0]
    unknown = check_anthropic_messages(
        {"messages": [*USER, TOOL_TURN, results("toolu_a", "toolu_b", "toolu_x")]})
    assert len(unknown) == 1 and "unknown tool_use id 'toolu_x'" in unknown[0]
    doubled = check_anthropic_messages(
        {"messages": [*USER, TOOL_TURN, results("toolu_a", "toolu_b", "toolu_b")]})
    assert len(doubled) == 1 and "2 tool_results" in doubled[0]
    roles = check_anthropic_messages({"messages": [TOOL_TURN, *USER, *USER]})
    assert any("first message" in p for p in roles) and any("alternate" in p for p in roles)
    empty = check_anthropic_messages({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "", "name": "x", "input": {}}]}, results("")]})
    assert "tool_use with empty id" in empty[0] and "empty tool_use_id" in empty[1]


def test_openai_invariants() -> None:
    call_turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}

    def tool(i: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": i, "content": "ok"}

    system = {"role": "system", "content": "s"}
    assert check_openai_messages(
        {"messages": [system, *USER, call_turn, tool("call_b"), tool("call_a")]}) == []
    missing = check_openai_messages({"messages": [*USER, call_turn, tool("call_a"), *USER]})
    assert len(missing) == 1 and "'call_b'" in missing[0]
    stray = check_openai_messages({"messages": [*USER, tool("call_z")]})
    assert len(stray) == 1 and "unknown tool_call id 'call_z'" in stray[0]


async def test_server_rejects_an_unpaired_tool_use() -> None:
    bad = {"model": "m", "max_tokens": 10,
           "messages": [*USER, TOOL_TURN, results("toolu_a")]}
    with trio.fail_after(10):
        async with open_mock_server(Reply(["fine"])) as server, sdk(server) as client:
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(**bad)
            assert server.pending == 1
            good = await client.messages.create(
                model="m", max_tokens=10,
                messages=[*USER, TOOL_TURN, results("toolu_a", "toolu_b")])
    assert "toolu_b" in str(info.value) and "request #1" in str(info.value)
    assert good.content[0].type == "text"
    assert len(server.violations) == 1 and "request #1" in server.violations[0]
    with pytest.raises(AssertionError, match="toolu_b"):
        server.assert_clean()


# -- fixtures replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("rechunk", ["random", 7])
async def test_rechunked_fixture_replay_is_byte_identical(rechunk: str | int) -> None:
    manifest = fixture_manifest()
    paths = sorted(p for p in manifest if p.endswith(".sse"))
    with trio.fail_after(20):
        async with (
            open_mock_server(*map(Fixture, paths), rechunk=rechunk) as server,
            httpx.AsyncClient() as client,
        ):
            for path in paths:
                async with client.stream(
                    "POST", f"{server.base_url}/v1/messages",
                    json={"stream": True, "messages": USER},
                ) as response:
                    pieces = [p async for p in response.aiter_raw()]
                assert b"".join(pieces) == (FIXTURES_DIR / path).read_bytes(), path
                assert response.status_code == manifest[path]["status"]
                assert response.headers["content-type"] == (
                    manifest[path]["headers"]["content-type"])
                if manifest[path].get("close_after_body"):
                    assert "transfer-encoding" not in response.headers
                else:
                    assert response.headers["transfer-encoding"] == "chunked"
                    assert len(pieces) > 3, path
    server.assert_clean()


# -- the reference workload ----------------------------------------------------------------------


def tool_results_for(message: anthropic.types.Message) -> list[dict[str, Any]]:
    return [{"type": "tool_result", "tool_use_id": b.id, "content": "v"}
            for b in message.content if b.type == "tool_use"]


async def run_reference_task(client: anthropic.AsyncAnthropic) -> tuple[Any, Any]:
    messages: list[Any] = [{"role": "user", "content": "go"}]
    async with client.messages.stream(model="m", max_tokens=10, messages=messages) as s:
        first = await s.get_final_message()
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": tool_results_for(first)}]
    async with client.messages.stream(model="m", max_tokens=10, messages=messages) as s:
        second = await s.get_final_message()
    return first, second


async def test_workload_in_process_concurrent_and_paced() -> None:
    with trio.fail_after(30):
        async with open_mock_server(fallback=Workload()) as server, sdk(server) as client:
            done: list[tuple[Any, Any]] = []

            async def task() -> None:
                done.append(await run_reference_task(client))

            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(task)
            server.first_token_ms, server.token_delay_ms = 100, 1
            start = trio.current_time()
            await run_reference_task(client)
            elapsed = trio.current_time() - start
    assert len(done) == 20
    first, second = done[0]
    assert first.stop_reason == "tool_use" and second.stop_reason == "end_turn"
    assert first.content[0].text == "".join(f"tok{i} " for i in range(200))
    assert [(b.name, b.input) for b in first.content[1:]] == [
        ("lookup", {"key": "1"}), ("lookup", {"key": "2"})]
    assert len({b.id for f, _ in done for b in f.content[1:]}) == 40  # ids unique
    assert [b.type for b in second.content] == ["text"]
    # two paced requests: each >= first token + 199 text deltas (+ 6 fragments) of 1 ms
    assert elapsed >= 2 * 0.1 + 0.199 + 0.205
    server.assert_clean()


async def test_workload_openai_wire() -> None:
    with trio.fail_after(10):
        async with (
            open_mock_server(fallback=Workload(text_tokens=5)) as server,
            httpx.AsyncClient() as client,
        ):
            url = f"{server.base_url}/v1/chat/completions"
            first = await client.post(url, json={"stream": True, "messages": USER})
            chunks = [json.loads(p) for p in openai_payloads(first.content)[:-1]]
            ids = [tc["id"] for c in chunks if c["choices"]
                   for tc in c["choices"][0]["delta"].get("tool_calls", []) if "id" in tc]
            calls = [{"id": i, "type": "function",
                      "function": {"name": "lookup", "arguments": "{}"}} for i in ids]
            history = [*USER, {"role": "assistant", "content": "x", "tool_calls": calls},
                       *({"role": "tool", "tool_call_id": i, "content": "v"} for i in ids)]
            second = await client.post(url, json={"stream": True, "messages": history})
    assert len(ids) == 2 and len(set(ids)) == 2
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert len({c["id"] for c in chunks}) == 1
    final = [json.loads(p) for p in openai_payloads(second.content)[:-1]]
    assert final[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in final if c["choices"]) == "tok0 tok1 tok2 tok3 tok4 "
    server.assert_clean()


async def test_subprocess_prints_port_and_serves_the_reference_workload() -> None:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.support.mock_model_server", "--port", "0",
         "--workload", "reference", "--token-delay-ms", "0", "--first-token-ms", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        with trio.fail_after(20):
            line = b""
            while not line.endswith(b"\n"):
                piece = await proc.stdout.receive_some(1)
                assert piece, "server exited before printing PORT"
                line += piece
            word, port = line.decode().split()
            assert word == "PORT" and int(port) > 0

            class Addr:
                base_url = f"http://127.0.0.1:{port}"

            async with sdk(Addr) as client:
                first, second = await run_reference_task(client)
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            await proc.wait()
    stderr = b""
    while chunk := await proc.stderr.receive_some(65536):
        stderr += chunk
    assert first.stop_reason == "tool_use" and len(first.content) == 3
    assert second.stop_reason == "end_turn"
    assert "STATS requests=2 violations=0 errors=0" in stderr.decode(), stderr


async def test_max_streams_answers_429_with_retry_after_beyond_k_at_once() -> None:
    """``max_streams=1``: while one response is being written, another request gets 429
    ``rate_limit_error`` with the configured ``retry-after`` (the FIFO is not popped);
    once it ends, the next request is answered."""
    resume = trio.Event()
    with trio.fail_after(10):
        async with (
            open_mock_server(Paused(Reply([Text("one two")]), 2, resume), Reply([Text("ok")]),
                             max_streams=1, limit_retry_after=2.5) as server,
            httpx.AsyncClient(base_url=server.base_url) as client,
        ):
            body = {"model": "m", "max_tokens": 10, "stream": True, "messages": USER}
            async with client.stream("POST", "/v1/messages", json=body) as held:
                chunks = held.aiter_bytes()
                await chunks.__anext__()  # the first events arrived: it is being written
                refused = await client.post("/v1/messages", json=body)
                resume.set()
                rest = b"".join([chunk async for chunk in chunks])
            assert b"message_stop" in rest
            answered = await client.post("/v1/messages", json=body)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "2.5"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert answered.status_code == 200 and b"ok" in answered.content
    assert (server.rate_limited, server.request_count, server.peak_streams) == (1, 3, 1)


async def test_the_workload_takes_as_many_tool_rounds_as_asked() -> None:
    with trio.fail_after(10):
        async with (
            open_mock_server(fallback=Workload(text_tokens=2, rounds=3)) as server,
            sdk(server) as client,
        ):
            messages: list[Any] = [{"role": "user", "content": "go"}]
            stops, keys = [], []
            for _ in range(5):
                async with client.messages.stream(model="m", max_tokens=10,
                                                  messages=messages) as s:
                    message = await s.get_final_message()
                stops.append(message.stop_reason)
                keys += [b.input["key"] for b in message.content if b.type == "tool_use"]
                if message.stop_reason == "end_turn":
                    break
                messages += [
                    {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                    {"role": "user", "content": tool_results_for(message)},
                ]
    assert stops == ["tool_use", "tool_use", "tool_use", "end_turn"]
    assert keys == ["1", "2", "3", "4", "5", "6"]  # each round calls with new arguments
    server.assert_clean()
