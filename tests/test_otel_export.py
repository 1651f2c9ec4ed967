"""OpenTelemetry export end to end (R-OBS-1): ``greenroom run`` in a subprocess sends its
spans over OTLP/HTTP to a receiver in the test, which decodes them with
``opentelemetry-proto``; without export nothing of OpenTelemetry is even imported.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from greenroom.actors.apps.demo import write_demo_workspace

CLI = [sys.executable, "-m", "greenroom"]
TIMEOUT_S = 60
SALES_PROMPT = "summarize the sales CSV files: revenue per region"


class Receiver:
    """An OTLP/HTTP receiver on 127.0.0.1: keeps every request's path, headers and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.lock = threading.Lock()

    def traces(self) -> list[ExportTraceServiceRequest]:
        found = []
        with self.lock:
            for path, _, body in self.requests:
                if path == "/v1/traces":
                    message = ExportTraceServiceRequest()
                    message.ParseFromString(body)
                    found.append(message)
        return found

    def metric_names(self) -> set[str]:
        names = set()
        with self.lock:
            for path, _, body in self.requests:
                if path == "/v1/metrics":
                    message = ExportMetricsServiceRequest()
                    message.ParseFromString(body)
                    for resource in message.resource_metrics:
                        for scope in resource.scope_metrics:
                            names.update(metric.name for metric in scope.metrics)
        return names


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            with receiver.lock:
                receiver.requests.append((self.path, dict(self.headers.items()), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(TIMEOUT_S)


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")
        and not k.startswith("OTEL_")
    }
    env["GREENROOM_HOME"] = str(tmp_path / "home")
    env["NO_COLOR"] = "1"
    env.update(extra)
    return env


def run_sales_task(tmp_path: Path, env: dict[str, str], *flags: str) -> None:
    workspace = tmp_path / "workspace"
    if not workspace.exists():
        workspace.mkdir()
        write_demo_workspace(workspace)
    result = subprocess.run(
        [*CLI, "run", "--workspace", str(workspace), "--approve", "all", *flags, SALES_PROMPT],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


def value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


def attributes(item: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in item.attributes}


def test_run_exports_genai_spans_over_otlp_http(tmp_path: Path) -> None:
    """R-OBS-1: with OTEL_EXPORTER_OTLP_ENDPOINT set, ``greenroom run`` exports its task,
    model requests and tool calls as GenAI spans before it exits, honouring the other
    OTEL_* variables (headers, service name); no content without the opt-in. The general
    endpoint also receives the GenAI metrics."""
    with otlp_receiver() as (receiver, endpoint):
        env = cli_env(
            tmp_path,
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_EXPORTER_OTLP_HEADERS="x-team=greenroom",
            OTEL_SERVICE_NAME="sales-agent",
        )
        run_sales_task(tmp_path, env)
        exports = receiver.traces()
        headers = [h for path, h, _ in receiver.requests if path == "/v1/traces"]
        metric_names = receiver.metric_names()
    assert exports, "no spans were exported"
    assert {"gen_ai.client.token.usage", "gen_ai.client.operation.duration"} <= metric_names
    assert all(h.get("x-team") == "greenroom" for h in headers)
    spans = []
    for export in exports:
        for resource_spans in export.resource_spans:
            assert attributes(resource_spans.resource)["service.name"] == "sales-agent"
            for scope in resource_spans.scope_spans:
                assert scope.scope.name == "greenroom"
                spans.extend(scope.spans)
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (task,) = by_name["invoke_agent"]
    task_attrs = attributes(task)
    assert task_attrs["gen_ai.operation.name"] == "invoke_agent"
    assert task_attrs["gen_ai.provider.name"] == "scripted"
    assert task_attrs["greenroom.task.status"] == "completed"
    session_id = task_attrs["gen_ai.conversation.id"]
    assert (tmp_path / "home" / "sessions" / session_id).is_dir()
    assert task.parent_span_id == b""

    chats = by_name["chat scripted"]
    assert len(chats) == 3  # list the workspace, read the files, answer
    for chat in chats:
        assert chat.parent_span_id == task.span_id
        assert chat.trace_id == task.trace_id
        chat_attrs = attributes(chat)
        assert chat_attrs["gen_ai.request.model"] == "scripted"
        assert chat_attrs["gen_ai.response.model"] == "scripted"
        assert chat_attrs["gen_ai.usage.input_tokens"] > 0
        assert chat_attrs["gen_ai.usage.output_tokens"] > 0
    assert attributes(chats[-1])["gen_ai.response.finish_reasons"] == ("end_turn",)

    assert len(by_name["execute_tool list_dir"]) == 1
    reads = by_name["execute_tool read_file"]
    assert len(reads) == 3
    for tool in [*reads, *by_name["execute_tool list_dir"]]:
        tool_attrs = attributes(tool)
        assert tool.parent_span_id == task.span_id
        assert tool_attrs["gen_ai.tool.call.id"]
        assert tool_attrs["greenroom.tool.status"] == "ok"
        assert "gen_ai.tool.call.arguments" not in tool_attrs
        assert task.start_time_unix_nano <= tool.start_time_unix_nano
        assert tool.end_time_unix_nano <= task.end_time_unix_nano


def test_no_otel_overrides_the_variables(tmp_path: Path) -> None:
    """R-OBS-1: ``--no-otel`` turns export off even with an endpoint in the environment."""
    with otlp_receiver() as (receiver, endpoint):
        run_sales_task(
            tmp_path, cli_env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint), "--no-otel"
        )
        assert receiver.requests == []


NO_IMPORT_SCRIPT = """
import os, sys, tempfile
import trio
import greenroom
from greenroom.actors.apps.cli import main
from greenroom.actors.runtime.host import Host

async def task():
    async with Host.open(tempfile.mkdtemp()) as host:
        session = await host.create_session(provider="scripted")
        await session.run("hello").result()

trio.run(task)
assert main(["run", "--provider", "scripted", "hello"]) == 0
os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
assert main(["run", "--no-otel", "--provider", "scripted", "hello"]) == 0
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""


def test_without_export_nothing_of_opentelemetry_is_imported(tmp_path: Path) -> None:
    """R-OBS-1: with export off, importing greenroom, running a task through the API and
    through ``greenroom run`` never imports ``opentelemetry`` (installed or not)."""
    result = subprocess.run(
        [sys.executable, "-c", NO_IMPORT_SCRIPT],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


WITHOUT_EXTRA_SCRIPT = """
import os, sys
sys.modules["opentelemetry"] = None  # as if greenroom[otel] were not installed
from greenroom.actors.apps.cli import main
os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
print("env only:", main(["run", "--provider", "scripted", "hello"]))
print("flag:", main(["run", "--otel", "--provider", "scripted", "hello"]))
"""


def test_without_the_extra(tmp_path: Path) -> None:
    """R-OBS-1: without the extra, the variables change nothing; ``--otel`` is a usage
    error that says what to install, without a traceback."""
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA_SCRIPT],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "env only: 0" in lines
    assert "flag: 2" in lines
    assert "pip install 'greenroom[otel]'" in result.stderr
    assert "Traceback" not in result.stderr


def spans_of(receiver: Receiver) -> dict[str, list[Any]]:
    by_name: dict[str, list[Any]] = {}
    for export in receiver.traces():
        for resource_spans in export.resource_spans:
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    by_name.setdefault(span.name, []).append(span)
    return by_name


def test_chat_exports_each_task(tmp_path: Path) -> None:
    """R-OBS-1: ``greenroom chat`` exports one invoke_agent span per line it runs, and
    flushes them when it exits."""
    with otlp_receiver() as (receiver, endpoint):
        result = subprocess.run(
            [*CLI, "chat", "--provider", "scripted"],
            cwd=tmp_path,
            env=cli_env(tmp_path, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{endpoint}/v1/traces"),
            input="hello\nagain\n",
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert result.returncode == 0, result.stderr
        spans = spans_of(receiver)
    tasks = spans["invoke_agent"]
    assert len(tasks) == 2
    assert len({attributes(t)["gen_ai.conversation.id"] for t in tasks}) == 1
    assert len(spans["chat scripted"]) == 2


async def test_serve_exports_the_tasks_of_its_clients(tmp_path: Path) -> None:
    """R-OBS-1: ``greenroom serve --otel`` exports the tasks its clients run, flushed when
    it is stopped."""
    import re
    import signal

    import trio
    from test_gateway import Client
    from trio_websocket import open_websocket_url

    token = "alice-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {token}\n")
    (tmp_path / "ws").mkdir()
    with otlp_receiver() as (receiver, endpoint):
        process = await trio.lowlevel.open_process(
            [
                *CLI,
                "serve",
                "--port",
                "0",
                "--no-console",
                "--tokens-file",
                str(tokens),
                "--data-dir",
                str(tmp_path / "data"),
                "--workspace",
                str(tmp_path / "ws"),
                "--provider",
                "scripted",
                "--otel",
            ],
            env=cli_env(tmp_path, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{endpoint}/v1/traces"),
            stderr=-1,
        )
        assert process.stderr is not None
        try:
            with trio.fail_after(TIMEOUT_S):
                seen = b""
                while b"/v1" not in seen:
                    chunk = await process.stderr.receive_some()
                    assert chunk, f"serve exited early: {seen!r}"
                    seen += chunk
                match = re.search(rb"ws://[\w.:]+/v1", seen)
                assert match
                headers = [(b"Authorization", f"Bearer {token}".encode())]
                async with open_websocket_url(match.group().decode(), extra_headers=headers) as ws:
                    client = Client(ws)
                    sid = (await client.result("session.create"))["session_id"]
                    await client.result("session.subscribe", {"session_id": sid})
                    await client.result("run", {"session_id": sid, "input": "hello"})
                    await client.outputs_until("task_end")
                process.send_signal(signal.SIGINT)
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        spans = spans_of(receiver)
    (task,) = spans["invoke_agent"]
    assert attributes(task)["gen_ai.conversation.id"] == sid


SYSTEM_PROMPT = "Answer in one short sentence."
SYSTEM_INSTRUCTIONS = [{"type": "text", "content": SYSTEM_PROMPT}]
"""``SYSTEM_PROMPT`` as the conventions' gen_ai.system_instructions (R-OBS-2)."""


def spans_in(exports: list[ExportTraceServiceRequest]) -> dict[str, list[Any]]:
    by_name: dict[str, list[Any]] = {}
    for export in exports:
        for resource_spans in export.resource_spans:
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    by_name.setdefault(span.name, []).append(span)
    return by_name


async def test_an_openai_task_exports_what_the_genai_conventions_ask(tmp_path: Path) -> None:
    """R-OBS-2: ``greenroom run`` on the openai provider against a mock OpenAI server,
    decoded from what an OTLP/HTTP receiver gets: finish reasons in OpenAI's words
    (``tool_calls``, ``stop``), the response id, the model the chunks named as
    gen_ai.response.model (the requested one for the attempt that got no response),
    server.address/port of the base URL, gen_ai.request.max_tokens; with capture on, the
    system prompt as gen_ai.system_instructions on every chat and invoke_agent span, each
    chat span's input messages (the history so far, tool results included) and output
    messages with a finish_reason, the invoke_agent's answer too; a 429 is ``error.type``
    ``429``, not ``timeout``."""
    import json

    import trio

    from tests.support.mock_model_server import ErrorReply, Text, ToolUse, open_mock_server
    from tests.support.mock_model_server import Reply as WireReply

    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("hello")
    snapshot = "gpt-test-2026-01-15"  # the model that answered, not the alias requested
    replies = (
        WireReply(
            [ToolUse("call_1", "read_file", {"path": "notes.txt"})],
            stop_reason="tool_use",
            model=snapshot,
        ),
        ErrorReply.openai(429, "requests", "rate limited", headers={"retry-after": "0"}),
        WireReply([Text("It says hello.")], model=snapshot),
    )
    with otlp_receiver() as (receiver, endpoint):
        async with open_mock_server(*replies) as server:
            port = int(server.base_url.rsplit(":", 1)[1])
            env = cli_env(
                tmp_path,
                OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true",
                OPENAI_API_KEY="sk-test",
            )
            command = [
                *CLI, "run", "--provider", "openai", "--model", "gpt-test", "--base-url",
                f"{server.base_url}/v1", "--workspace", str(workspace), "--approve", "all",
                "--system", SYSTEM_PROMPT, "read notes.txt",
            ]  # fmt: skip
            with trio.fail_after(TIMEOUT_S):
                result = await trio.run_process(
                    command, env=env, cwd=tmp_path, capture_stdout=True, capture_stderr=True,
                    check=False, stdin=b"",
                )  # fmt: skip
        assert result.returncode == 0, result.stderr.decode()
        spans = spans_in(receiver.traces())
    chats = spans["chat gpt-test"]
    assert len(chats) == 3  # the call, the rate-limited attempt, the answer
    first, limited, last = (attributes(c) for c in chats)
    for chat in (first, limited, last):
        assert chat["gen_ai.provider.name"] == "openai"
        assert (chat["server.address"], chat["server.port"]) == ("127.0.0.1", port)
        assert chat["gen_ai.request.max_tokens"] > 0
    assert first["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert last["gen_ai.response.finish_reasons"] == ("stop",)
    assert first["gen_ai.response.id"].startswith("chatcmpl")
    assert limited["error.type"] == "429"
    assert "gen_ai.response.id" not in limited
    assert (first["gen_ai.response.model"], last["gen_ai.response.model"]) == (snapshot,) * 2
    assert limited["gen_ai.response.model"] == "gpt-test"  # no response named another
    for chat in (first, limited, last):
        assert chat["gen_ai.request.model"] == "gpt-test"
        assert json.loads(chat["gen_ai.system_instructions"]) == SYSTEM_INSTRUCTIONS
    output = json.loads(first["gen_ai.output.messages"])
    assert output[0]["finish_reason"] == "tool_call"
    history = json.loads(last["gen_ai.input.messages"])
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]
    assert history[0]["parts"] == [{"type": "text", "content": "read notes.txt"}]
    assert history[2]["parts"][0]["type"] == "tool_call_response"
    assert history[2]["parts"][0]["id"] == "call_1"
    assert "hello" in history[2]["parts"][0]["result"]
    assert json.loads(first["gen_ai.input.messages"]) == history[:1]
    (task,) = spans["invoke_agent"]
    answer = json.loads(attributes(task)["gen_ai.output.messages"])
    assert answer == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": "It says hello."}],
            "finish_reason": "stop",
        }
    ]
    assert attributes(task)["server.address"] == "127.0.0.1"
    assert json.loads(attributes(task)["gen_ai.system_instructions"]) == SYSTEM_INSTRUCTIONS


async def test_an_anthropic_chat_span_names_the_model_that_answered(tmp_path: Path) -> None:
    """R-OBS-2: ``greenroom run`` on the anthropic provider against a mock Messages API
    that answers as a dated snapshot of the model asked for: each chat span's
    gen_ai.response.model is the model ``message_start`` named, gen_ai.request.model the
    one requested. Without the capture opt-in the system prompt, though sent to the
    model, is on no span."""
    import trio

    from tests.support.mock_model_server import Reply as WireReply
    from tests.support.mock_model_server import Text, ToolUse, open_mock_server

    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("hello")
    snapshot = "claude-test-20260115"
    replies = (
        WireReply(
            [ToolUse("toolu_1", "read_file", {"path": "notes.txt"})],
            stop_reason="tool_use",
            model=snapshot,
        ),
        WireReply([Text("It says hello.")], model=snapshot),
    )
    with otlp_receiver() as (receiver, endpoint):
        async with open_mock_server(*replies) as server:
            env = cli_env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, ANTHROPIC_API_KEY="k")
            command = [
                *CLI, "run", "--provider", "anthropic", "--model", "claude-test", "--base-url",
                server.base_url, "--workspace", str(workspace), "--approve", "all",
                "--system", SYSTEM_PROMPT, "read notes.txt",
            ]  # fmt: skip
            with trio.fail_after(TIMEOUT_S):
                result = await trio.run_process(
                    command, env=env, cwd=tmp_path, capture_stdout=True, capture_stderr=True,
                    check=False, stdin=b"",
                )  # fmt: skip
            sent = [request.body for request in server.requests]
        assert result.returncode == 0, result.stderr.decode()
        spans = spans_in(receiver.traces())
    assert [body["model"] for body in sent] == ["claude-test"] * 2
    assert all(SYSTEM_PROMPT in str(body["system"]) for body in sent)
    chats = spans["chat claude-test"]
    assert len(chats) == 2
    for chat in map(attributes, chats):
        assert chat["gen_ai.provider.name"] == "anthropic"
        assert chat["gen_ai.request.model"] == "claude-test"
        assert chat["gen_ai.response.model"] == snapshot
        assert chat["gen_ai.response.id"].startswith("msg_")
    for span in [*chats, *spans["invoke_agent"], *spans["execute_tool read_file"]]:
        assert "gen_ai.system_instructions" not in attributes(span), span.name


def test_grpc_protocol_exports_over_grpc(tmp_path: Path) -> None:
    """R-OBS-2: OTEL_EXPORTER_OTLP_PROTOCOL=grpc sends the spans to an OTLP/gRPC
    receiver (the ``otel-grpc`` extra), not protobuf over HTTP."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceResponse,
    )

    received: list[ExportTraceServiceRequest] = []

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = cli_env(
            tmp_path,
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{port}",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        )
        run_sales_task(tmp_path, env)
    finally:
        server.stop(None)
    (task,) = spans_in(received)["invoke_agent"]
    assert attributes(task)["greenroom.task.status"] == "completed"


def test_http_json_and_unknown_protocols_are_refused_by_name(tmp_path: Path) -> None:
    """R-OBS-2: the SDK has no OTLP/JSON exporter, so ``http/json`` is refused (exit 2,
    the variable named) instead of posting protobuf; so is a protocol OTLP does not have.
    Nothing is sent."""
    with otlp_receiver() as (receiver, endpoint):
        for variable, protocol in (
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon"),
        ):
            env = cli_env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, **{variable: protocol})
            result = subprocess.run(
                [*CLI, "run", "--provider", "scripted", "hello"],
                cwd=tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
            assert result.returncode == 2, result.stderr
            assert f"{variable}={protocol}" in result.stderr.replace("'", "")
            assert "Traceback" not in result.stderr
        assert receiver.requests == []
