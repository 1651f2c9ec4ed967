"""What a failed model request is reported as: what happened, never its retry class alone
nor Python's internals (R-RETRY-1, R-RETRY-3).

A refused connection is a ``timeout`` attempt (retried), but its ``request_end.error_message``
— traced, and shown by the CLI — says ``connection refused by HOST:PORT``; a dropped or
garbled connection names what happened, and a provider's own bug gives its message, not a
repr.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import Deliver, connect_failure, transport_failure
from greenroom.actors.runtime.session import Session
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import Output, RequestEnd


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
