"""The lean wire's own requests (R-PERF-1): what greenroom sends when it builds a model
request itself instead of an SDK, what it does not import, and where it gives way to the
library path (a proxy from the environment).

- The anthropic request: ``POST /v1/messages`` with the JSON body the SDK path sends for
  the same task (tools, ``output_config``, thinking and all), ``x-api-key`` (or a bearer
  ``ANTHROPIC_AUTH_TOKEN``), ``anthropic-version``, the JSON content type, a user agent
  naming greenroom, and ``ANTHROPIC_CUSTOM_HEADERS``; the OpenAI providers' bodies equal
  httpx's.
- ``greenroom run`` on the lean path imports neither the anthropic SDK nor any HTTP
  library; ``--no-lean-http`` does.
- ``HTTPS_PROXY`` and its kin send a lean provider to its library path, which goes through
  the proxy; ``NO_PROXY`` naming the host keeps it lean.
- A key, token or header a request cannot carry, a malformed ``GREENROOM_LEAN_HTTP`` and a
  base URL that is not http(s) are configuration errors naming what is wrong.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from greenroom.actors.providers.anthropic import ANTHROPIC_VERSION, AnthropicProvider
from greenroom.actors.providers.lean_http import environment_proxy, parse_url
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.providers.openai_responses import OpenAIResponsesProvider
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.errors import ConfigurationError
from greenroom.protocols.stream import StreamEvent, StreamFailed
from greenroom.protocols.tools import tool
from tests.support.mock_model_server import (
    MockModelServer,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)

BOUND_S = 20.0
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROXY_VARIABLES = (
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
    "http_proxy", "https_proxy", "all_proxy", "no_proxy", "REQUEST_METHOD",
)  # fmt: skip


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    monkeypatch.delenv("GREENROOM_LEAN_HTTP", raising=False)


@attrs.frozen
class Forecast:
    """Tomorrow's forecast for one city."""

    city: str
    high: float
    rain: bool


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    return f"value of {key}"


def request() -> ModelRequest:
    hello = UserMessage(content=(TextBlock(text="hi"),))
    return ModelRequest(model="m", system=None, tools=(), messages=(hello,), max_tokens=64)


async def one_stream(provider: Any) -> list[StreamEvent]:
    events: list[StreamEvent] = []

    async def deliver(batch: list[StreamEvent]) -> None:
        events.extend(batch)

    try:
        with trio.fail_after(BOUND_S):
            await provider.open_task().stream(request(), deliver)
    finally:
        await provider.aclose()
    return events


MAKERS: dict[str, Callable[[MockModelServer, bool], Any]] = {
    "anthropic": lambda s, lean: AnthropicProvider(
        base_url=s.base_url, api_key="k", lean_http=lean
    ),
    "openai": lambda s, lean: OpenAIProvider(
        base_url=s.base_url + "/v1", api_key="k", lean_http=lean
    ),
    "openai-responses": lambda s, lean: OpenAIResponsesProvider(
        base_url=s.base_url + "/v1", api_key="k", lean_http=lean
    ),
}


async def structured_task(wire: str, lean: bool, tmp_path: Path) -> list[Any]:
    """The request bodies of a structured task with a tool and thinking, on one path."""
    async with open_mock_server(
        Reply([ToolUse("toolu_1", "lookup", {"key": "lyon"})], stop_reason="tool_use"),
        Reply([Text('{"city": "Lyon", "high": 24.0, "rain": false}')]),
    ) as server:
        provider = MAKERS[wire](server, lean)
        assert provider.lean_http is lean
        model = "claude-sonnet-4-5" if wire == "anthropic" else "gpt-4o"
        async with Host.open(tmp_path / f"data-{lean}") as host:
            session = await host.create_session(
                tools=[lookup], provider=provider, workspace_dir=tmp_path, model=model
            )
            with trio.fail_after(BOUND_S):
                result = await session.run(
                    "forecast for Lyon?", approve=lambda _: "allow", output_schema=Forecast
                ).result()
        server.assert_clean()
    assert result.output == Forecast("Lyon", 24.0, False)
    return [(r.method, r.path, r.body) for r in server.requests]


@pytest.mark.parametrize("wire", sorted(MAKERS))
async def test_the_lean_path_sends_the_library_paths_body(wire: str, tmp_path: Path) -> None:
    """Method, path and JSON body of every request of a structured task with a tool call
    (the anthropic one with ``output_config`` in the body, which the SDK path sends as an
    extra body field) are the same on both paths."""
    library = await structured_task(wire, False, tmp_path)
    lean = await structured_task(wire, True, tmp_path)
    assert lean == library
    if wire == "anthropic":
        assert lean[0][2]["output_config"]["format"]["type"] == "json_schema"
        assert lean[0][2]["stream"] is True


async def test_the_anthropic_request_headers() -> None:
    async with open_mock_server(Reply([Text("hi")])) as server:
        events = await one_stream(MAKERS["anthropic"](server, True))
        [sent] = server.requests
    assert type(events[-1]).__name__ == "MessageCompleted"
    assert (sent.method, sent.path) == ("POST", "/v1/messages")
    headers = sent.headers
    assert headers["x-api-key"] == "k" and "authorization" not in headers
    assert headers["anthropic-version"] == ANTHROPIC_VERSION == "2023-06-01"
    assert headers["content-type"] == "application/json"
    assert headers["accept"] == "application/json"
    assert headers["user-agent"].startswith("greenroom")
    assert headers["content-length"] == str(len(sent.raw_body))
    assert headers["host"] == server.base_url.removeprefix("http://")


async def test_an_auth_token_is_sent_as_a_bearer_token_and_custom_headers_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ANTHROPIC_AUTH_TOKEN`` (no key) is ``Authorization: Bearer``; the lines of
    ``ANTHROPIC_CUSTOM_HEADERS`` are added, replacing a default of the same name."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "tok")
    monkeypatch.setenv(
        "ANTHROPIC_CUSTOM_HEADERS", "anthropic-beta: one,two\nno colon here\nUser-Agent: mine"
    )
    async with open_mock_server(Reply([Text("hi")])) as server:
        await one_stream(AnthropicProvider(base_url=server.base_url, lean_http=True))
        [sent] = server.requests
    assert sent.headers["authorization"] == "Bearer tok" and "x-api-key" not in sent.headers
    assert sent.headers["anthropic-beta"] == "one,two"
    assert sent.headers["user-agent"] == "mine"


@pytest.mark.parametrize("wire", ["openai", "openai-responses"])
async def test_the_openai_request_headers(wire: str) -> None:
    async with open_mock_server(Reply([Text("hi")])) as server:
        events = await one_stream(MAKERS[wire](server, True))
        [sent] = server.requests
    assert not isinstance(events[-1], StreamFailed)
    assert sent.path == ("/v1/chat/completions" if wire == "openai" else "/v1/responses")
    assert sent.headers["authorization"] == "Bearer k"
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["user-agent"].startswith("greenroom")


# -- what the run path imports ----------------------------------------------------------------

REPORT = """
import json, sys
from greenroom.actors.apps.cli import main
code = main(sys.argv[2:])
libraries = ("anthropic", "httpx", "httpx2", "httpcore", "httpcore2", "h11", "pydantic",
             "importlib.metadata", "email.utils")
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "loaded": [m for m in libraries if m in sys.modules]}, out)
"""


@pytest.mark.parametrize(
    ("provider", "flag", "loaded"),
    [
        ("anthropic", "--lean-http", []),
        ("anthropic", "--no-lean-http", ["anthropic", "httpx2"]),
        ("openai", "--lean-http", []),
        ("openai", "--no-lean-http", ["httpx"]),
    ],
)
async def test_a_lean_run_imports_no_sdk_and_no_http_library(
    tmp_path: Path, provider: str, flag: str, loaded: list[str]
) -> None:
    """``greenroom run`` answered by the mock server: on the lean path neither the
    anthropic SDK nor httpx, httpx2, httpcore, h11 or pydantic is imported (about a second
    of a cold start), nor the package metadata (``--version`` alone reads it) or the mail
    modules (an HTTP-date ``retry-after`` alone needs them); ``--no-lean-http`` loads the
    library path's."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    report = tmp_path / "report.json"
    async with open_mock_server(Reply([Text("Hello.")])) as server:
        base_url = server.base_url + ("/v1" if provider == "openai" else "")
        with trio.fail_after(60):
            result = await trio.run_process(
                [sys.executable, "-c", REPORT, str(report), "run", "--json", flag,
                 "--provider", provider, "--model", "mock-model", "--base-url", base_url,
                 "--workspace", str(workspace), "--data-dir", str(tmp_path / "data"), "hi"],
                env={"ANTHROPIC_API_KEY": "k", "OPENAI_API_KEY": "k", "PATH": "/usr/bin:/bin",
                     "HOME": str(tmp_path)},
                capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    outcome = json.loads(report.read_text())
    assert outcome["code"] == 0
    for name in loaded:
        assert name in outcome["loaded"]
    if not loaded:
        assert outcome["loaded"] == []
    assert b"Hello." in result.stdout


def test_the_version_is_looked_up_only_when_asked_for(tmp_path: Path) -> None:
    """``greenroom --version`` still prints the installed version on stdout, though the
    parser no longer reads it to build itself."""
    import subprocess
    from importlib.metadata import version

    result = subprocess.run(
        [sys.executable, "-m", "greenroom", "--version"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"greenroom {version('greenroom')}\n"


# -- proxies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "url", "proxy"),
    [
        ({}, "https://api.example.com/v1", None),
        ({"HTTPS_PROXY": "http://p:3128"}, "https://api.example.com/v1", "http://p:3128"),
        ({"HTTPS_PROXY": "http://p:3128"}, "http://api.example.com/v1", None),
        ({"http_proxy": "http://p:3128"}, "http://api.example.com/v1", "http://p:3128"),
        ({"ALL_PROXY": "socks5://p:1080"}, "http://127.0.0.1:8080", "socks5://p:1080"),
        ({"HTTPS_PROXY": "http://p:1", "https_proxy": ""}, "https://a.example/", None),
        ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "*"}, "https://a.example/", None),
        ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "x.org, example.com"},
         "https://api.example.com/", None),
        ({"HTTPS_PROXY": "http://p:1", "no_proxy": ".example.com"}, "https://example.com/",
         "http://p:1"),
        ({"HTTPS_PROXY": "http://p:1", "NO_PROXY": "a.example:443"}, "https://a.example/",
         "http://p:1"),
        ({"HTTP_PROXY": "http://p:1", "NO_PROXY": "localhost,127.0.0.1"},
         "http://127.0.0.1:9", None),
        ({"HTTP_PROXY": "http://p:1", "REQUEST_METHOD": "GET"}, "http://a.example/", None),
    ],
)  # fmt: skip
def test_the_environment_proxy_for_a_url(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], url: str, proxy: str | None
) -> None:
    """Read as httpx reads it; a ``NO_PROXY`` entry the lean client cannot match exactly
    (here one with a port) counts as not excluding, so the library path decides."""
    if sys.platform in ("darwin", "win32"):
        pytest.skip("the system's proxy settings count there too")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert environment_proxy(parse_url(url)) == proxy


SSE_BODY = (FIXTURES / "anthropic" / "text_only.sse").read_bytes()


async def serve_as_proxy(
    listener: trio.SocketListener, seen: list[bytes], *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """A forward proxy that answers every request itself with the text fixture, recording
    each request line."""

    async def one(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            more = await stream.receive_some(65536)
            if not more:
                return
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        seen.append(head.split(b"\r\n", 1)[0])
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += await stream.receive_some(65536)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
            b"content-length: " + str(len(SSE_BODY)).encode() + b"\r\n\r\n" + SSE_BODY
        )
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        task_status.started()
        while True:
            nursery.start_soon(one, await listener.accept())


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
async def test_a_proxied_base_url_goes_through_the_library_and_its_proxy(
    monkeypatch: pytest.MonkeyPatch, wire: str
) -> None:
    """``HTTP_PROXY`` set: the provider asked for the lean path uses its library path
    (which honours the proxy) and says why; the request reaches the proxy in absolute
    form. ``NO_PROXY`` naming the host keeps the lean path."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    upstream = "http://model.invalid:8080"
    seen: list[bytes] = []
    if wire == "anthropic":
        provider: Any = AnthropicProvider(base_url=upstream, api_key="k", lean_http=True)
    else:
        provider = OpenAIProvider(base_url=upstream + "/v1", api_key="k", lean_http=True)
    assert provider.lean_http is False
    assert provider.proxy == f"http://127.0.0.1:{port}"
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_as_proxy, listener, seen)
        events = await one_stream(provider)
        nursery.cancel_scope.cancel()
    await listener.aclose()
    path = "/v1/messages" if wire == "anthropic" else "/v1/chat/completions"
    assert seen == [f"POST {upstream}{path} HTTP/1.1".encode()]
    if wire == "anthropic":
        assert type(events[-1]).__name__ == "MessageCompleted"
    monkeypatch.setenv("NO_PROXY", "model.invalid")
    kept = AnthropicProvider(base_url=upstream, api_key="k", lean_http=True)
    assert kept.lean_http is True and kept.proxy is None
    await kept.aclose()


@pytest.mark.parametrize(
    ("url", "target", "authority"),
    [
        ("http://127.0.0.1:8080/v1/messages", b"/v1/messages", b"127.0.0.1:8080"),
        ("https://api.anthropic.com/v1/messages", b"/v1/messages", b"api.anthropic.com"),
        ("https://h:443", b"/", b"h"),
        ("http://[::1]:9/v1?a=1", b"/v1?a=1", b"[::1]:9"),
        ("https://b\u00fccher.example/x", b"/x", b"xn--bcher-kva.example"),
        ("http://h/a b/\u00e9?q=\u00e9", b"/a%20b/%C3%A9?q=%C3%A9", b"h"),
        ("http://h/x\r\nEvil: 1", b"/xEvil:%201", b"h"),
    ],
)
def test_a_url_becomes_a_request_target_that_cannot_break_the_request_line(
    url: str, target: bytes, authority: bytes
) -> None:
    """The request line and ``Host`` header are built from the parsed URL: spaces,
    non-ASCII and line breaks are percent-encoded or dropped (a redirect's ``location``
    goes through here too), names in IDNA, IPv6 hosts in brackets, default ports left
    out."""
    parsed = parse_url(url)
    assert (parsed.target, parsed.authority) == (target, authority)
    assert all(33 <= byte < 127 for byte in parsed.target)


# -- configuration errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: AnthropicProvider(api_key="sk-ant\nX-Evil: 1", base_url="http://h"),
         "the API key holds a character an HTTP header cannot carry"),
        (lambda: OpenAIProvider(api_key="sk\r\n", base_url="http://h/v1"),
         "the OpenAI API key holds a character an HTTP header cannot carry"),
        (lambda: AnthropicProvider(api_key="k", base_url="ftp://h"),
         "base URL 'ftp://h' is not an http or https URL"),
        (lambda: OpenAIProvider(api_key="k", base_url="localhost:8000/v1"),
         "is not an http or https URL"),
    ],
)  # fmt: skip
def test_what_a_request_cannot_carry_is_a_configuration_error(
    make: Callable[[], Any], words: str
) -> None:
    """Refused when the provider is made, in words that do not repeat the secret: never a
    request with an injected header line, nor a retried failure for a URL that cannot
    work."""
    with pytest.raises(ConfigurationError, match=words) as caught:
        make()
    assert "Evil" not in str(caught.value) and "sk-ant" not in str(caught.value)


def test_a_bad_custom_header_or_lean_setting_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ANTHROPIC_CUSTOM_HEADERS", "bad name: x")
    with pytest.raises(ConfigurationError, match="ANTHROPIC_CUSTOM_HEADERS"):
        AnthropicProvider(api_key="k", base_url="http://h", lean_http=True)
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS")
    monkeypatch.setenv("GREENROOM_LEAN_HTTP", "maybe")
    with pytest.raises(ConfigurationError, match="GREENROOM_LEAN_HTTP"):
        AnthropicProvider(api_key="k", base_url="http://h")
    with pytest.raises(ConfigurationError, match="GREENROOM_LEAN_HTTP"):
        OpenAIProvider(api_key="k", base_url="http://h/v1")


@pytest.mark.parametrize(("value", "lean"), [(None, True), ("1", True), ("0", False)])
def test_a_provider_given_no_choice_follows_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str | None, lean: bool
) -> None:
    """R-PERF-1: a provider made in code without ``lean_http`` is lean unless
    ``GREENROOM_LEAN_HTTP`` turns it off."""
    if value is not None:
        monkeypatch.setenv("GREENROOM_LEAN_HTTP", value)
    for provider in (
        AnthropicProvider(api_key="k", base_url="http://h"),
        OpenAIProvider(api_key="k", base_url="http://h/v1"),
        OpenAIResponsesProvider(api_key="k", base_url="http://h/v1"),
    ):
        assert provider.lean_http is lean
