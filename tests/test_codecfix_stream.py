"""What a model stream cannot do to a session (R-SEC-1, R-RETRY-1): the codecs and the lean
HTTP client against hostile or broken servers.

- A lone UTF-16 surrogate in any field a codec passes on (the model's name, the response
  id, a stop reason, an error's words in the stream or in an HTTP error body, a call id, a
  signature, argument text) is repaired where it enters: the task goes on (or retries)
  instead of failing on its own trace.
- A signature or encrypted reasoning that is not text is a malformed attempt, not a block
  of the transcript.
- A response that never ends is cut at ``MAX_RESPONSE_BYTES``: a malformed attempt, not a
  host that grows until it dies.
- A redirect to a Location that is no URL, and a response head the libraries' parser (h11)
  refuses, fail the lean path as they fail the library path: bad HTTP, ``timeout``.
- A response head or an error body trickled a byte at a time ends the lean attempt at the
  read timeout (R-SEC-10), as silence would.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.lean_http import DEADLINE_SLACK, Timeouts
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.actors.runtime.host import Host
from greenroom.protocols.anthropic_codec import AnthropicStreamDecoder
from greenroom.protocols.anthropic_codec import classify_error as anthropic_classify
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.openai_codec import OpenAIStreamDecoder
from greenroom.protocols.openai_codec import classify_error as openai_classify
from greenroom.protocols.openai_responses_codec import ResponsesStreamDecoder
from greenroom.protocols.outputs import Output, RequestEnd, TaskEnd
from greenroom.protocols.stream import (
    BlockCompleted,
    MessageCompleted,
    StreamEvent,
    StreamFailed,
)
from greenroom.protocols.text import has_surrogates
from tests.support.mock_model_server import (
    ErrorReply,
    Reply,
    SSEEvent,
    Streamed,
    Text,
    open_mock_server,
)
from tests.support.raw_http import serve_answer

BOUND_S = 20.0
"""Bound on every wait: a hang fails the test instead of the suite."""

Decoder = Callable[[], Any]


def strings(value: Any) -> list[str]:
    """Every string an event holds, however deep."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings(k) + strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for item in value for s in strings(item)]
    if attrs.has(type(value)):
        return [s for f in attrs.fields(type(value)) for s in strings(getattr(value, f.name))]
    return []


def decode(decoder: Decoder, body: bytes) -> list[StreamEvent]:
    codec = decoder()
    return [*codec.feed(body), *codec.end_of_stream()]


# -- bodies ------------------------------------------------------------------------------------

BAD = "\ud800"  # a lone surrogate: JSON spells it, UTF-8 cannot encode it


def anthropic_body(*events: Any) -> bytes:
    return b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events
    )


def message_start(model: str = "m", message_id: str = "msg_1") -> dict[str, Any]:
    return {"type": "message_start",
            "message": {"id": message_id, "model": model, "usage": {"input_tokens": 5}}}


def block(index: int, content: dict[str, Any], *deltas: dict[str, Any]) -> list[Any]:
    return [
        {"type": "content_block_start", "index": index, "content_block": content},
        *({"type": "content_block_delta", "index": index, "delta": d} for d in deltas),
        {"type": "content_block_stop", "index": index},
    ]


def text(index: int, words: str) -> list[Any]:
    return block(index, {"type": "text", "text": ""}, {"type": "text_delta", "text": words})


def message_end(stop: str = "end_turn") -> list[Any]:
    return [{"type": "message_delta", "delta": {"stop_reason": stop},
             "usage": {"output_tokens": 3}}, {"type": "message_stop"}]


def openai_body(*chunks: Any) -> bytes:
    return b"".join(
        f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks
    )


def chunk(delta: dict[str, Any], finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "model": "m", **fields,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def responses_body(*events: Any) -> bytes:
    return b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events
    )


def item(index: int, raw: dict[str, Any], event: str = "added") -> dict[str, Any]:
    return {"type": f"response.output_item.{event}", "output_index": index, "item": raw}


def completed(**response: Any) -> dict[str, Any]:
    return {"type": "response.completed", "response": {"id": "resp_1", **response}}


CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup"}

SURROGATE_CASES: dict[str, tuple[Decoder, bytes]] = {
    "anthropic model name": (AnthropicStreamDecoder, anthropic_body(
        message_start(model="claude" + BAD), *text(0, "hi"), *message_end())),
    "anthropic message id": (AnthropicStreamDecoder, anthropic_body(
        message_start(message_id="msg" + BAD), *text(0, "hi"), *message_end())),
    "anthropic stop reason": (AnthropicStreamDecoder, anthropic_body(
        message_start(), *text(0, "hi"), *message_end("odd" + BAD))),
    "anthropic error event": (AnthropicStreamDecoder, anthropic_body(
        message_start(), *text(0, "hi"),
        {"type": "error", "error": {"type": "new_error", "message": "bad " + BAD}})),
    "anthropic bad block index": (AnthropicStreamDecoder, anthropic_body(
        message_start(), {"type": "content_block_stop", "index": BAD})),
    "anthropic thinking signature": (AnthropicStreamDecoder, anthropic_body(
        message_start(), *block(0, {"type": "thinking", "thinking": "hm", "signature": BAD}),
        *message_end())),
    "anthropic redacted thinking": (AnthropicStreamDecoder, anthropic_body(
        message_start(), *block(0, {"type": "redacted_thinking", "data": "x" + BAD}),
        *message_end())),
    "anthropic input not arguments": (AnthropicStreamDecoder, anthropic_body(
        message_start(),
        *block(0, {"type": "tool_use", "id": "toolu_1", "name": "lookup",
                   "input": {"key": BAD, "n": float("nan")}}),
        *message_end("tool_use"))),
    "openai response id and model": (OpenAIStreamDecoder, openai_body(
        chunk({"content": "hi"}, id="chatcmpl" + BAD, model="gpt" + BAD),
        chunk({}, "stop"), "[DONE]")),
    "openai finish reason": (OpenAIStreamDecoder, openai_body(
        chunk({"content": "hi"}), chunk({}, "odd" + BAD), "[DONE]")),
    "openai error chunk": (OpenAIStreamDecoder, openai_body(
        chunk({"content": "hi"}), {"error": {"message": "bad " + BAD, "type": "x" + BAD}})),
    "responses model and id": (ResponsesStreamDecoder, responses_body(
        {"type": "response.created", "response": {"id": "resp" + BAD, "model": "gpt" + BAD}},
        completed(model="gpt" + BAD))),
    "responses call id and arguments": (ResponsesStreamDecoder, responses_body(
        item(0, {**CALL, "call_id": "call" + BAD}),
        {"type": "response.function_call_arguments.delta", "output_index": 0,
         "delta": '["' + BAD + '"]'},
        item(0, {**CALL, "call_id": "call" + BAD}, "done"),
        completed())),
    "responses final arguments": (ResponsesStreamDecoder, responses_body(
        item(0, CALL), item(0, {**CALL, "arguments": '["' + BAD + '"]'}, "done"),
        completed())),
    "responses truncated call": (ResponsesStreamDecoder, responses_body(
        item(0, {**CALL, "arguments": '{"key": "' + BAD}),
        {"type": "response.incomplete",
         "response": {"incomplete_details": {"reason": "odd" + BAD}}})),
    "responses reasoning item": (ResponsesStreamDecoder, responses_body(
        item(0, {"type": "reasoning", "id": "rs" + BAD}),
        item(0, {"type": "reasoning", "id": "rs" + BAD, "encrypted_content": "E" + BAD},
             "done"),
        completed())),
    "responses error event": (ResponsesStreamDecoder, responses_body(
        {"type": "error", "error": {"code": "c" + BAD, "message": ""}})),
}


@pytest.mark.parametrize("case", sorted(SURROGATE_CASES))
def test_a_lone_surrogate_never_leaves_a_codec(case: str) -> None:
    """R-SEC-1: whatever field of the stream holds a lone surrogate, every string of every
    event the codec passes on can be encoded (each is traced or shown), and the stream
    still ends with its one terminal event."""
    decoder, body = SURROGATE_CASES[case]
    events = decode(decoder, body)
    assert isinstance(events[-1], (MessageCompleted, StreamFailed))
    assert [s for e in events for s in strings(e) if has_surrogates(s)] == []


ERROR_BODY = json.dumps(
    {"type": "error", "error": {"type": "api_error" + BAD, "message": "went wrong " + BAD}}
).encode()


@pytest.mark.parametrize("status", [400, 401, 413, 429, 500])
@pytest.mark.parametrize("classify", [anthropic_classify, openai_classify])
def test_an_error_body_spelling_a_lone_surrogate_is_classified_in_clean_words(
    classify: Callable[..., Any], status: int
) -> None:
    """The provider's words in an HTTP error body are traced with the failed attempt:
    repaired where they enter, whatever the status and its class."""
    error = classify(status, ERROR_BODY, {})
    assert "went wrong \ufffd" in error.message and not has_surrogates(error.message)


@pytest.mark.parametrize(
    ("content", "what"),
    [
        ({"type": "redacted_thinking", "data": {"a": 1}}, "redacted_thinking data"),
        ({"type": "redacted_thinking", "data": 12}, "redacted_thinking data"),
        ({"type": "thinking", "thinking": "hm", "signature": ["s"]}, "signature"),
    ],
)
def test_a_signature_that_is_not_text_is_a_malformed_attempt(
    content: dict[str, Any], what: str
) -> None:
    """The provider wants its signatures and encrypted thinking back as it sent them, and
    they are traced: one that is not a string is a malformed attempt (retried), never a
    block of the transcript holding some other type."""
    events = decode(AnthropicStreamDecoder, anthropic_body(
        message_start(), *block(0, content), *text(1, "hi"), *message_end()))
    assert not [e for e in events if isinstance(e, BlockCompleted)]
    failure = events[-1]
    assert isinstance(failure, StreamFailed) and failure.error.kind == "malformed"
    assert f"{what} is not a string" in failure.error.message


@pytest.mark.parametrize(
    "decoder", [AnthropicStreamDecoder, OpenAIStreamDecoder, ResponsesStreamDecoder]
)
def test_a_response_that_never_ends_is_cut_at_the_bound(decoder: Decoder) -> None:
    """A server that never ends its answer cannot grow the host's memory until the process
    dies (R-SEC-1): past ``MAX_RESPONSE_BYTES`` of one body (128 MiB, far beyond the
    longest answer a model streams) the attempt is malformed, and retried; the decoder
    takes nothing more."""
    line = b": " + b"k" * ((1 << 20) - 3) + b"\n"  # 1 MiB a read, nothing an event
    codec = decoder()
    events: list[StreamEvent] = []
    reads = 0
    while not events and reads < 256:
        events = codec.feed(line)
        reads += 1
    assert events, "256 MiB taken and no end in sight"
    assert reads == 129
    [failure] = events
    assert isinstance(failure, StreamFailed) and failure.error.kind == "malformed"
    assert "grew past 128 MiB" in failure.error.message
    assert codec.finished and codec.feed(line) == [] and codec.end_of_stream() == []


# -- whole sessions ------------------------------------------------------------------------------


def sse(events: bytes) -> Streamed:
    """A 200 SSE body of pre-rendered events (split at their blank lines)."""
    parts = [p + b"\n\n" for p in events.split(b"\n\n") if p]
    return Streamed([SSEEvent(data=p) for p in parts])


async def run_session(wire: str, lean: bool, *responses: Any, tmp_path: Path) -> list[Output]:
    async with open_mock_server(*responses) as server:
        if wire == "anthropic":
            provider: Any = AnthropicProvider(base_url=server.base_url, api_key="k",
                                              lean_http=lean)
        else:
            provider = OpenAIProvider(base_url=server.base_url + "/v1", api_key="k",
                                      lean_http=lean)
        async with Host.open(tmp_path / f"data-{wire}-{lean}") as host:
            session = await host.create_session(provider=provider, workspace_dir=tmp_path)
            with trio.fail_after(BOUND_S):
                outputs = [o async for o in session.run("go")]
        server.assert_clean()
    return outputs


@pytest.mark.parametrize("lean", [True, False])
async def test_a_model_name_with_a_lone_surrogate_does_not_fail_the_task(
    lean: bool, tmp_path: Path
) -> None:
    """The model's name in ``message_start`` is traced with the request's end: a lone
    surrogate in it is repaired where it enters, and the task completes (before, the
    task failed, unable to write its trace)."""
    body = anthropic_body(message_start(model="claude" + BAD), *text(0, "hi"), *message_end())
    outputs = await run_session("anthropic", lean, sse(body), tmp_path=tmp_path)
    end = outputs[-1]
    assert isinstance(end, TaskEnd)
    assert end.status == "completed", end.message
    [request] = [o for o in outputs if isinstance(o, RequestEnd)]
    assert request.response_model == "claude\ufffd"


@pytest.mark.parametrize("lean", [True, False])
async def test_an_error_quoting_a_lone_surrogate_is_retried(lean: bool, tmp_path: Path) -> None:
    """An error inside a 200 stream whose words hold a lone surrogate is a failed attempt
    like any other: traced, retried, and the retry answers (before, the task failed on
    its own trace and was never retried)."""
    body = openai_body(chunk({"content": "partial"}),
                       {"error": {"message": "went wrong " + BAD, "type": "server_error"}})
    outputs = await run_session("openai", lean, sse(body), Reply([Text("Recovered.")]),
                                tmp_path=tmp_path)
    ends = [(o.status, o.attempt) for o in outputs if isinstance(o, RequestEnd)]
    assert ends == [("timeout", 1), ("ok", 2)]
    failed = next(o for o in outputs if isinstance(o, RequestEnd))
    assert failed.error_message is not None and "went wrong \ufffd" in failed.error_message
    end = outputs[-1]
    assert isinstance(end, TaskEnd)
    assert end.status == "completed", end.message


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
@pytest.mark.parametrize("lean", [True, False])
async def test_an_error_status_quoting_a_lone_surrogate_is_retried(
    wire: str, lean: bool, tmp_path: Path
) -> None:
    """A 500 whose body spells a lone surrogate is a transient failure like any other:
    traced, retried, answered (before, the task failed on its own trace)."""
    outputs = await run_session(wire, lean, ErrorReply(500, ERROR_BODY),
                                Reply([Text("Recovered.")]), tmp_path=tmp_path)
    ends = [(o.status, o.attempt) for o in outputs if isinstance(o, RequestEnd)]
    assert ends == [("timeout", 1), ("ok", 2)]
    end = outputs[-1]
    assert isinstance(end, TaskEnd)
    assert end.status == "completed", end.message


# -- the lean HTTP client against the library path ---------------------------------------------


def request() -> ModelRequest:
    hello = UserMessage(content=(TextBlock(text="hi"),))
    return ModelRequest(model="m", system=None, tools=(), messages=(hello,), max_tokens=64)


def provider_for(wire: str, base_url: str, lean: bool) -> Any:
    if wire == "anthropic":
        return AnthropicProvider(base_url=base_url, api_key="k", lean_http=lean)
    if wire == "openai-responses":
        return OpenAIResponsesProvider(base_url=base_url + "/v1", api_key="k", lean_http=lean)
    return OpenAIProvider(base_url=base_url + "/v1", api_key="k", lean_http=lean)


async def one_stream(provider: Any) -> list[StreamEvent]:
    """One attempt's events; an exception out of ``stream`` fails the test as such."""
    events: list[StreamEvent] = []

    async def deliver(batch: list[StreamEvent]) -> None:
        events.extend(batch)

    try:
        with trio.fail_after(BOUND_S):
            await provider.open_task().stream(request(), deliver)
    finally:
        await provider.aclose()
    return events


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
async def test_a_redirect_to_no_url_is_bad_http_on_both_paths(wire: str) -> None:
    """A 307 whose Location is not a URL: the library paths report bad HTTP from the
    server (``timeout``, retried); the lean path reports it alike instead of raising out
    of the provider (a traceback in the log, a ``failed`` attempt)."""
    failures = {}
    for lean in (True, False):
        reply = ErrorReply(307, b"", {"location": "http://[::1"})
        async with open_mock_server(reply) as server:
            events = await one_stream(provider_for(wire, server.base_url, lean))
        failure = events[-1]
        assert isinstance(failure, StreamFailed), (lean, events)
        failures[lean] = failure.error
    assert failures[True].kind == failures[False].kind == "timeout"
    assert failures[True].message.startswith(
        "bad HTTP from the server (Invalid URL in location header"
    ), failures[True].message


SSE_BODY = anthropic_body(message_start(), *text(0, "hi"), *message_end())
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE_BODY), SSE_BODY)
SSE_HEAD = b"content-type: text/event-stream\r\n"

REFUSED_HEADS: dict[str, bytes] = {
    "status of one digit": b"HTTP/1.1 0 OK\r\n" + SSE_HEAD + b"transfer-encoding: chunked\r\n",
    "status of four digits": b"HTTP/1.1 2000 OK\r\n" + SSE_HEAD
    + b"transfer-encoding: chunked\r\n",
    "status below 100": b"HTTP/1.1 099 OK\r\n" + SSE_HEAD + b"transfer-encoding: chunked\r\n",
    "switching protocols unasked": b"HTTP/1.1 101 Switching Protocols\r\n" + SSE_HEAD
    + b"transfer-encoding: chunked\r\n",
    "two content lengths": b"HTTP/1.1 200 OK\r\n" + SSE_HEAD
    + b"content-length: %d\r\ncontent-length: 3\r\n" % len(CHUNKED),
    "a transfer coding besides chunked": b"HTTP/1.1 200 OK\r\n" + SSE_HEAD
    + b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
}


@pytest.mark.parametrize("case", sorted(REFUSED_HEADS))
async def test_a_head_the_libraries_refuse_fails_the_lean_path_alike(case: str) -> None:
    """A response head h11 (the library paths' parser) refuses: both paths fail the
    attempt as bad HTTP from the server, ``timeout``, whatever body follows (before, the
    lean path streamed it, or classified it as an error status, or cut it short)."""
    answer = REFUSED_HEADS[case] + b"\r\n" + CHUNKED
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    kinds = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_answer, listener, answer)
        for lean in (True, False):
            events = await one_stream(provider_for("anthropic", f"http://127.0.0.1:{port}", lean))
            failure = events[-1]
            assert isinstance(failure, StreamFailed), (lean, events)
            assert failure.error.message.startswith("bad HTTP from the server"), (
                lean, failure.error.message
            )
            kinds[lean] = failure.error.kind
        nursery.cancel_scope.cancel()
    await listener.aclose()
    assert kinds == {True: "timeout", False: "timeout"}


async def _trickle(
    listener: trio.SocketListener, prefix: bytes, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer a request with ``prefix``, then one byte every 2 s for ever: never silent for
    a read timeout, never done."""
    task_status.started()
    stream = await listener.accept()
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.receive_some(65536)
        await stream.send_all(prefix)
        while True:
            await trio.sleep(2.0)
            await stream.send_all(b"x")


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
@pytest.mark.parametrize(
    ("prefix", "words"),
    [
        (b"HTTP/1.1 200 OK\r\n", "no response from the server within 10 s"),
        (b"HTTP/1.1 500 Oops\r\ncontent-length: 100000\r\n\r\n", "(HTTP 500): xxxx"),
    ],
    ids=["head", "error body"],
)
async def test_a_head_or_error_body_trickled_byte_by_byte_ends_at_the_read_timeout(
    autojump_clock: trio.testing.MockClock, wire: str, prefix: bytes, words: str
) -> None:
    """R-SEC-10 on the lean path: a response head, or an error's body, that comes a byte
    every 2 s with a 10 s read timeout is no progress. The attempt fails as ``timeout``
    once the read timeout (and its slack) has passed since the head was awaited or the
    body begun, naming the status when it came (before, each byte renewed the timeout
    and the request was held for days)."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    timeouts = Timeouts(connect=5.0, read=10.0, write=5.0, pool=5.0)
    if wire == "anthropic":
        provider: Any = AnthropicProvider(base_url=f"http://127.0.0.1:{port}", api_key="k",
                                          timeout=timeouts, lean_http=True)
    else:
        provider = OpenAIProvider(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                                  timeout=timeouts, lean_http=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(_trickle, listener, prefix)
        start = trio.current_time()
        with trio.fail_after(1000):
            events = await one_stream(provider)
        took = trio.current_time() - start
        nursery.cancel_scope.cancel()
    await listener.aclose()
    [failure] = events
    assert isinstance(failure, StreamFailed) and failure.error.kind == "timeout"
    assert words in failure.error.message, failure.error.message
    assert took <= 10.0 * (1 + DEADLINE_SLACK) + 0.1

