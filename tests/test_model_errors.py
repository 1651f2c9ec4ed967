"""What a failed model request is reported as: what happened, never its retry class alone
nor Python's internals (R-RETRY-1, R-RETRY-3, R-TOOL-5).

A refused connection and a 429 are both ``timeout`` attempts (retried), but their
``request_end.error_message`` — traced, and shown by the CLI — says ``connection refused by
HOST:PORT`` and ``rate limited (HTTP 429)``; a dropped or garbled connection names what
happened, and a provider's own bug gives its message, not a repr. Model output that does not
parse (a number past Python's digit limit, ``NaN``, a missing field) gives a clear message:
an invalid-arguments error output for a tool call, a ``malformed`` attempt for a stream
event. Requests go to the loopback mock model server through each provider's lean path
(greenroom's own HTTP client) and its library path (the real ``anthropic`` SDK, httpx),
which must say the same.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.base import Deliver, connect_failure, transport_failure
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols import anthropic_codec, openai_codec
from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import Output, RequestEnd, TaskEnd, ToolCallOutput
from greenroom.protocols.sse import MAX_EVENT_BYTES
from greenroom.protocols.stream import MAX_TOOL_CALLS, StreamFailed
from greenroom.protocols.tools import tool
from tests.support.mock_model_server import (
    MOCK_MODEL,
    MockModelServer,
    Reply,
    SSEEvent,
    Streamed,
    Text,
    ToolUse,
    WireError,
    open_mock_server,
)
from tests.test_cli import greenroom_async

WIRES = ["anthropic", "anthropic-sdk", "openai", "openai-httpx"]
"""Each provider on its lean path and on its library path (the anthropic SDK, httpx)."""
HUGE = "9" * 5000  # past Python's 4300-digit limit for reading an integer
INTERNALS = ("Exceeds the limit", "set_int_max_str_digits", "Error(", "Error:", "Traceback")
ran: list[str] = []


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    ran.append(key)
    return f"value of {key}"


@asynccontextmanager
async def wire_session(
    wire: str, server: MockModelServer, tmp_path: Path, prices: dict[str, Any] | None = None
) -> AsyncIterator[Session]:
    lean = wire in ("anthropic", "openai")  # "-sdk", "-httpx": the library paths
    provider: Any = (
        AnthropicProvider(base_url=server.base_url, api_key="k", lean_http=lean)
        if wire.startswith("anthropic")
        else OpenAIProvider(base_url=server.base_url + "/v1", api_key="k", lean_http=lean)
    )
    async with Host.open(tmp_path / "data", prices=prices) as host:
        yield await host.create_session(
            tools=[lookup], provider=provider, workspace_dir=tmp_path, model=MOCK_MODEL
        )


async def run(session: Session, prompt: str = "go") -> list[Output]:
    with trio.fail_after(20):
        return [o async for o in session.run(prompt, approve=lambda _: "allow")]


def request_ends(outputs: list[Output]) -> list[RequestEnd]:
    return [o for o in outputs if isinstance(o, RequestEnd)]


def without_internals(text: str) -> bool:
    return not any(marker in text for marker in INTERNALS)


# -- connections and provider bugs ----------------------------------------------------------


def test_transport_failures_are_put_in_words() -> None:
    """A dropped or garbled connection names what happened, then the library's detail;
    never a bare class name."""
    assert transport_failure(httpx.ReadError("")) == "connection dropped while reading the response"
    assert transport_failure(httpx.RemoteProtocolError("illegal status line: b'x'")) == (
        "bad HTTP from the server (illegal status line: b'x')"
    )
    cut = httpx.RemoteProtocolError("peer closed connection without sending complete message")
    assert transport_failure(cut) == (
        "connection dropped by the server (peer closed connection without sending complete "
        "message)"
    )
    assert transport_failure(httpx.WriteError("[Errno 32] Broken pipe")) == (
        "connection dropped while sending the request (Broken pipe)"
    )
    assert transport_failure(OSError()) == "connection failed"


def test_connect_failures_name_the_host_and_port() -> None:
    url = "https://api.example.com/v1/messages"
    refused = httpx.ConnectError("All connection attempts failed")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert connect_failure(url, refused) == (
        f"connection refused by api.example.com:443 (cannot connect to {url})"
    )
    assert connect_failure("http://[::1]:8080/v1", ConnectionResetError()).startswith(
        "connection reset by [::1]:8080 ("
    )
    assert connect_failure(url, httpx.ConnectError("boom")) == f"cannot connect to {url} (boom)"


class Exploding:
    """A provider whose stream has a bug."""

    name = "exploding"

    def open_task(self) -> Exploding:
        return self

    async def stream(self, request: ModelRequest, deliver: Deliver) -> None:
        raise RuntimeError("the encoder tripped")

    async def aclose(self) -> None:
        pass


async def test_a_provider_bug_is_reported_without_a_repr(tmp_path: Path) -> None:
    """A provider that raises: the attempt fails ``failed`` with words and the exception's
    message, not its repr (the traceback goes to the log)."""
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=Exploding(), workspace_dir=tmp_path)
        outputs = await run(session)
    message = request_ends(outputs)[0].error_message or ""
    assert message.startswith("the provider failed unexpectedly: the encoder tripped")
    assert "RuntimeError" not in message


# -- transient statuses -------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [anthropic_codec, openai_codec], ids=["anthropic", "openai"])
@pytest.mark.parametrize(
    ("status", "words"),
    [
        (429, "rate limited (HTTP 429)"),
        (529, "overloaded (HTTP 529)"),
        (503, "service unavailable (HTTP 503)"),
        (500, "server error (HTTP 500)"),
        (599, "server error (HTTP 599)"),
        (408, "request timeout (HTTP 408)"),
    ],
)
def test_a_transient_status_says_what_happened(codec: Any, status: int, words: str) -> None:
    """R-RETRY-1: still a ``timeout``, but named: the words first, then the provider's own
    message when it sent one."""
    bare = codec.classify_error(status, b"", {})
    assert (bare.kind, bare.message) == ("timeout", words)
    body = json.dumps({"error": {"type": "some_error", "message": "Slow down"}}).encode()
    told = codec.classify_error(status, body, {})
    assert told.kind == "timeout"
    assert told.message.startswith(words + ": ") and "Slow down" in told.message


@pytest.mark.parametrize("wire", WIRES)
async def test_a_429_is_traced_as_rate_limited(tmp_path: Path, wire: str) -> None:
    """A 429 whose body names nothing: the attempt's ``request_end`` (what the trace and
    every client get) says ``rate limited (HTTP 429)``, the status stays ``timeout``, and
    the retry answers."""
    async with open_mock_server(
        WireError(429, "rate_limit_error", ""), Reply([Text("Fine now.")])
    ) as server:
        async with wire_session(wire, server, tmp_path) as session:
            outputs = await run(session)
            trace = session.trace_path.read_text()
    first, second = request_ends(outputs)
    assert (first.status, second.status) == ("timeout", "ok")
    assert (first.error_message or "").startswith("rate limited (HTTP 429)")
    traced = [json.loads(line) for line in trace.splitlines()]
    [failed] = [r for r in traced if r.get("type") == "request_end" and r["status"] != "ok"]
    assert failed["error_message"] == first.error_message


async def test_the_cli_shows_what_happened_not_the_retry_class(
    tmp_path: Path, workspace: Path
) -> None:
    """``greenroom run``: a 429 then an answer. The failed attempt's line says the request
    was rate limited, not that it timed out."""
    async with open_mock_server(WireError(429, "rate_limit_error", ""), Reply([Text("Ok.")])) as s:
        result = await greenroom_async(
            tmp_path, "run", "--provider", "openai", "--model", "m", "--base-url",
            s.base_url + "/v1", "--workspace", str(workspace), "hi",
            env={"OPENAI_API_KEY": "k"},
        )  # fmt: skip
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "model request failed (turn 1, attempt 1): rate limited (HTTP 429)" in stderr
    assert "timeout" not in stderr


# -- model output that does not parse ---------------------------------------------------------


def anthropic_stream(*events: dict[str, Any] | bytes) -> Streamed:
    return Streamed(
        events=[
            SSEEvent(data=e if isinstance(e, bytes) else
                     f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode())
            for e in events
        ]
    )  # fmt: skip


def openai_stream(*chunks: dict[str, Any] | bytes) -> Streamed:
    events = [
        SSEEvent(data=c if isinstance(c, bytes) else f"data: {json.dumps(c)}\n\n".encode())
        for c in chunks
    ]
    return Streamed(events=[*events, SSEEvent(data=b"data: [DONE]\n\n")])


A_START = {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
    "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 1}}}  # fmt: skip
A_END = [
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
    {"type": "message_stop"},
]


def a_tool(index: int, call_id: str, arguments: str) -> list[dict[str, Any]]:
    return [
        {"type": "content_block_start", "index": index,
         "content_block": {"type": "tool_use", "id": call_id, "name": "lookup", "input": {}}},
        {"type": "content_block_delta", "index": index,
         "delta": {"type": "input_json_delta", "partial_json": arguments}},
        {"type": "content_block_stop", "index": index},
    ]  # fmt: skip


def oa_chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip


def oa_tool(index: int, call_id: str, arguments: str) -> dict[str, Any]:
    fragment = {"index": index, "id": call_id, "type": "function",
                "function": {"name": "lookup", "arguments": arguments}}  # fmt: skip
    return oa_chunk({"tool_calls": [fragment]}, None)


def two_calls(wire: str, bad_arguments: str) -> Streamed:
    """A reply with two tool calls: ``call_bad`` with ``bad_arguments``, ``call_ok`` fine."""
    good = '{"key": "fine"}'
    if wire.startswith("anthropic"):
        return anthropic_stream(
            A_START, *a_tool(0, "call_bad", bad_arguments), *a_tool(1, "call_ok", good), *A_END
        )
    return openai_stream(
        oa_tool(0, "call_bad", bad_arguments), oa_tool(1, "call_ok", good),
        oa_chunk({}, "tool_calls"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ('{"key": ' + HUGE + "}", "malformed JSON: number too long"),
        ('{"key": NaN}', "malformed JSON: NaN is not a JSON number"),
        ('{"key": -Infinity}', "malformed JSON: -Infinity is not a JSON number"),
        # Valid JSON that Python reads as inf: as unsendable later as Infinity itself.
        ('{"key": [1e999]}', "malformed JSON: number too large (not finite once read)"),
        ('{"key": "x",}', "malformed JSON: expecting property name enclosed in double quotes"),
        ('["x"]', "not a JSON object (got array)"),
    ],
    ids=["huge-integer", "nan", "infinity", "overflowing-float", "trailing-comma", "array"],
)
@pytest.mark.parametrize("wire", WIRES)
async def test_unreadable_arguments_are_that_calls_error(
    tmp_path: Path, wire: str, arguments: str, reason: str
) -> None:
    """R-TOOL-5: arguments that do not parse as a usable JSON object give that call an
    invalid-arguments error output saying why in words; the other call runs, the attempt
    is ``ok``, and the next request (which carries the call back, paired) succeeds. A
    ``NaN`` kept as an argument would make every later request of the session unsendable."""
    ran.clear()
    async with open_mock_server(two_calls(wire, arguments), Reply([Text("Done.")])) as server:
        async with wire_session(wire, server, tmp_path) as session:
            outputs = await run(session)
        server.assert_clean()
    assert [e.status for e in request_ends(outputs)] == ["ok", "ok"]
    results = {o.call_id: o for o in outputs if isinstance(o, ToolCallOutput)}
    bad = results["call_bad"]
    assert bad.is_error and bad.status == "error"
    text = bad.content[0].text  # type: ignore[union-attr]
    assert text.startswith(f"Invalid arguments for lookup: {reason}")
    assert without_internals(text), text
    assert ran == ["fine"]
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed"


@pytest.mark.parametrize("wire", WIRES)
async def test_a_huge_integer_in_a_stream_event_is_a_malformed_attempt(
    tmp_path: Path, wire: str
) -> None:
    """A stream event whose JSON holds an integer Python will not read: a ``malformed``
    attempt whose message says the number is too long, without Python's advice on its
    digit limit; the retry answers."""
    if wire.startswith("anthropic"):
        usage = b'{"type":"message_delta","delta":{"stop_reason":null},"usage":{"output_tokens":'
        broken = anthropic_stream(
            A_START, b"event: message_delta\ndata: " + usage + HUGE.encode() + b"}}\n\n"
        )
    else:
        broken = openai_stream(
            oa_chunk({"content": "Hel"}, None),
            b'data: {"choices":[],"usage":{"completion_tokens":' + HUGE.encode() + b"}}\n\n",
        )
    async with open_mock_server(broken, Reply([Text("Hello.")])) as server:
        async with wire_session(wire, server, tmp_path) as session:
            outputs = await run(session)
        server.assert_clean()
    first, second = request_ends(outputs)
    assert (first.status, second.status) == ("malformed", "ok")
    message = first.error_message or ""
    assert message.startswith("malformed JSON in the model stream: number too long")
    assert without_internals(message), message


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("reported", [-(10**9), 10**400], ids=["negative", "past-a-float"])
async def test_a_token_count_no_request_can_use_costs_nothing_odd(
    tmp_path: Path, wire: str, reported: int
) -> None:
    """R-SHARE-3: a usage report is priced only as a count a request can have. A negative
    output count priced the request below zero (minus $10,000 here), which every budget
    it was spent against took back; one past a float's range failed the task with
    Python's ``OverflowError``. The negative one is ignored, the huge one counts as the
    largest count taken (a cost that stops any budget), and the task completes."""
    prices = {MOCK_MODEL: {"input": 10.0, "output": 10.0}}
    async with open_mock_server(Reply([Text("Hello.")], usage=(5, reported))) as server:
        async with wire_session(wire, server, tmp_path, prices) as session:
            outputs = await run(session)
    end = outputs[-1]
    assert isinstance(end, TaskEnd) and end.status == "completed", end
    assert [e.status for e in request_ends(outputs)] == ["ok"]
    cost = end.usage.cost_usd
    assert cost is not None
    assert 0 < cost < 1 if reported < 0 else cost >= 1e9


@pytest.mark.parametrize("wire", WIRES)
async def test_an_event_without_end_is_given_up_at_its_size_cap(
    tmp_path: Path, wire: str
) -> None:
    """R-SEC-9: an SSE line that never ends was held whole for as long as the server sent
    it (the read timeout allows minutes of it): the stream's memory had no bound. The
    decoder gives the event up past ``MAX_EVENT_BYTES`` — a ``malformed`` attempt saying
    so — and the retry answers."""
    endless = b"data: " + b"x" * (MAX_EVENT_BYTES + (1 << 20))
    if wire.startswith("anthropic"):
        broken = anthropic_stream(A_START, b"event: content_block_start\n" + endless)
    else:
        broken = openai_stream(oa_chunk({"content": "Hel"}, None), endless)
    async with open_mock_server(broken, Reply([Text("Hello.")])) as server:
        async with wire_session(wire, server, tmp_path) as session:
            outputs = await run(session)
    first, second = request_ends(outputs)
    assert (first.status, second.status) == ("malformed", "ok")
    assert first.error_message == "an event of the stream grew past 16 MiB without ending"


@pytest.mark.parametrize("wire", WIRES)
async def test_a_message_with_too_many_tool_calls_is_a_malformed_attempt(
    tmp_path: Path, wire: str
) -> None:
    """R-SEC-1, R-SEC-6: every call of a message costs the runtime work in proportion to
    the calls before it (2,000 calls took 2 s, 8,000 took 20 s), so a stream of tiny
    tool_use blocks held the session, and its core, for hours. A message with more than
    ``MAX_TOOL_CALLS`` is a ``malformed`` attempt saying so; no call past the cap runs
    (those before it may have run while the message streamed, R-TOOL-1)."""
    ran.clear()
    calls = [ToolUse(f"toolu_{i}", "lookup", {"key": str(i)}) for i in range(MAX_TOOL_CALLS + 1)]
    script = (Reply(calls, stop_reason="tool_use"), Reply([Text("Hello.")]))
    async with open_mock_server(*script) as server:
        async with wire_session(wire, server, tmp_path) as session:
            outputs = await run(session)
    first, second = request_ends(outputs)
    assert (first.status, second.status) == ("malformed", "ok")
    assert f"more than {MAX_TOOL_CALLS} tool calls in one message" in (first.error_message or "")
    assert len(ran) <= MAX_TOOL_CALLS


@pytest.mark.parametrize(
    ("event", "problem"),
    [
        ({"type": "content_block_start", "index": 0}, "missing field 'content_block'"),
        ({"type": "content_block_start", "index": 0, "content_block": "text"},
         "a field has the wrong type"),
        ({"type": "content_block_delta", "index": 7,
          "delta": {"type": "text_delta", "text": "x"}}, "delta for unknown block index 7"),
    ],
    ids=["missing-field", "wrong-type", "broken-rule"],
)  # fmt: skip
def test_an_event_of_the_wrong_shape_says_what_is_wrong(
    event: dict[str, Any], problem: str
) -> None:
    """An Anthropic event that parses but has the wrong shape: a ``malformed`` failure that
    names the problem in words, not a Python exception class."""
    decoder = AnthropicStreamDecoder()
    body = b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in (A_START, event)
    )
    failure = decoder.feed(body)[-1]
    assert isinstance(failure, StreamFailed) and failure.error.kind == "malformed"
    assert failure.error.message == f"unexpected {event['type']} shape: {problem}"
