"""What a failed model request is reported as: what happened, never its retry class alone
nor Python's internals (R-RETRY-1, R-RETRY-3).

A refused connection and a 429 are both ``timeout`` attempts (retried), but their
``request_end.error_message`` — traced, and shown by the CLI — says ``connection refused by
HOST:PORT`` and ``rate limited (HTTP 429)``; a dropped or garbled connection names what
happened, and a provider's own bug gives its message, not a repr. Requests go through the
real ``anthropic`` SDK and httpx to the loopback mock model server.
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
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import Deliver, connect_failure, transport_failure
from greenroom.actors.runtime.session import Session
from greenroom.protocols import anthropic_codec, openai_codec
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import Output, RequestEnd
from greenroom.protocols.tools import tool
from tests.support.mock_model_server import (
    MockModelServer,
    Reply,
    Text,
    WireError,
    open_mock_server,
)
from tests.test_cli import greenroom_async

ran: list[str] = []


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    ran.append(key)
    return f"value of {key}"


@asynccontextmanager
async def wire_session(
    wire: str, server: MockModelServer, tmp_path: Path
) -> AsyncIterator[Session]:
    provider: Any = (
        AnthropicProvider(base_url=server.base_url, api_key="k")
        if wire == "anthropic"
        else OpenAIProvider(base_url=server.base_url + "/v1", api_key="k")
    )
    async with Host.open(tmp_path / "data") as host:
        yield await host.create_session(tools=[lookup], provider=provider, workspace_dir=tmp_path)


async def run(session: Session, prompt: str = "go") -> list[Output]:
    with trio.fail_after(20):
        return [o async for o in session.run(prompt, approve=lambda _: "allow")]


def request_ends(outputs: list[Output]) -> list[RequestEnd]:
    return [o for o in outputs if isinstance(o, RequestEnd)]


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


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
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
