"""A loopback mock model server: real HTTP/1.1 (trio + h11) speaking Anthropic and OpenAI SSE.

Endpoints
---------
* ``POST /v1/messages``: Anthropic Messages. ``"stream": true`` gets SSE (``event:`` + ``data:``
  lines, one blank line after each event, compact JSON, like ``tests/fixtures/anthropic``);
  otherwise one JSON message.
* ``POST /v1/chat/completions``: OpenAI chat completions. Streams are ``data: {chunk}`` lines,
  a finish chunk (``delta: {}`` + ``finish_reason``), a usage chunk with ``choices: []`` (always
  sent) and ``data: [DONE]``; otherwise one ``chat.completion`` JSON object.
* ``POST /v1/responses``: the OpenAI Responses API, streamed only (see
  :mod:`tests.support.mock_responses`); tool pairing is checked by ``call_id``.
* ``GET /health``: ``200 ok`` (not recorded as a model request).

Streamed bodies use chunked transfer encoding; connections are kept alive between requests.

Scripting
---------
The server holds a FIFO of responses; every model request pops the next one. An entry is one
of :data:`Response`: :class:`Reply` (rendered in the wire format of the endpoint hit),
:class:`Fixture` (a fixture file replayed byte for byte), :class:`ErrorReply` /
:class:`WireError` (an HTTP error), a fault (:class:`DropAfter`, :class:`MidStreamError`,
:class:`MalformedJSON`, :class:`SlowFirstByte`, :class:`Hang`, :class:`KeepAlives`), a stream
held mid-way until the test lets it go on (:class:`Paused`), a pre-rendered
:class:`Streamed` body, or a callable ``(RecordedRequest) -> Response`` (dynamic scripts).
When the FIFO is empty the ``fallback`` handler answers (for example :class:`Workload`, the
benchmark's endless reference workload); without one the server answers 500 naming the
request number, so a test fails loudly instead of hanging.

Checking
--------
Every model request is recorded in ``server.requests`` (:class:`RecordedRequest`, arrival
order) and checked for the tool-pairing invariant (:func:`check_anthropic_messages`,
:func:`check_openai_messages`) and for what the provider refuses in a structured-output
request (:func:`~tests.support.mock_structured.check_structured_request`). A violation is
appended to ``server.violations`` and the request is answered 400 naming it (the FIFO is
not popped); tests call ``server.assert_clean()``.

In-process use (a trio test)::

    async with open_mock_server(Reply([Text("hi there")])) as server:
        client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="k", max_retries=0)
        ...
        server.assert_clean()

or ``port = await nursery.start(server.serve)``.

Subprocess use (benchmarks)::

    python -m tests.support.mock_model_server --port 0 --workload reference \\
        --token-delay-ms 20 --first-token-ms 500

prints ``PORT <n>`` as its first stdout line (flushed), serves until SIGTERM/SIGINT, then
prints ``STATS requests=.. violations=.. errors=.. connections=.. rate_limited=..
peak_streams=..`` on stderr. ``--max-streams K --limit-retry-after S`` make it a provider
that takes K requests at once and answers 429 beyond; ``--tool-rounds N`` gives the
reference workload N rounds of tool calls before its final answer; ``--title-tokens K``
answers a request that offers no tools (a session title) with K text deltas; ``--tls CERT
KEY`` serves HTTPS. Violations are logged to stderr as they happen (nothing is recorded
in this mode).
"""

from __future__ import annotations

import argparse
import heapq
import http
import itertools
import json
import math
import os
import random
import re
import signal
import ssl
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeAlias

import h11
import trio

from tests.support.mock_responses import (
    RESPONSES_PATH,
    check_responses_input,
    render_responses,
    responses_error_event,
)
from tests.support.mock_structured import check_structured_request

__all__ = [
    "ANTHROPIC_PATH",
    "FIXTURES_DIR",
    "OPENAI_PATH",
    "DropAfter",
    "ErrorReply",
    "Fixture",
    "Handler",
    "Hang",
    "KeepAlives",
    "MalformedJSON",
    "MidStreamError",
    "MockModelServer",
    "Paused",
    "RecordedRequest",
    "Reply",
    "Response",
    "SSEEvent",
    "SlowFirstByte",
    "Streamed",
    "Text",
    "Thinking",
    "ToolUse",
    "WireError",
    "Workload",
    "check_anthropic_messages",
    "check_openai_messages",
    "error_fixture",
    "fixture_manifest",
    "main",
    "open_mock_server",
]

Wire = Literal["anthropic", "openai", "responses"]
Rechunk: TypeAlias = Literal["random"] | int | None

ANTHROPIC_PATH = "/v1/messages"
OPENAI_PATH = "/v1/chat/completions"

FIXTURES_DIR = Path(
    os.environ.get("GREENROOM_FIXTURES_DIR", Path(__file__).resolve().parents[1] / "fixtures")
)
"""Where :class:`Fixture` paths are resolved (``tests/fixtures`` in the repository, or
``$GREENROOM_FIXTURES_DIR``)."""

_SSE_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-type", "text/event-stream; charset=utf-8"),
    ("cache-control", "no-cache"),
)
_JSON = "application/json"
_RANDOM_PIECE_MAX = 16


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# Response kinds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Text:
    """A text block. Streamed one delta per token: ``text`` split after each run of spaces
    (``"a b c"`` → ``"a "``, ``"b "``, ``"c"``), or the explicit ``chunks`` (which must join to
    ``text``)."""

    text: str
    chunks: Sequence[str] | None = None

    def deltas(self) -> list[str]:
        if self.chunks is not None:
            if "".join(self.chunks) != self.text:
                raise ValueError("Text.chunks must join to Text.text")
            return list(self.chunks)
        return _split_tokens(self.text)


@dataclass(frozen=True, slots=True)
class Thinking:
    """A thinking block (Anthropic: ``thinking_delta`` per token then one ``signature_delta``;
    OpenAI: ``delta.reasoning_content`` per token, no signature)."""

    text: str
    signature: str = "mock-signature"

    def deltas(self) -> list[str]:
        return _split_tokens(self.text)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A client tool call. ``input`` is serialised (``json.dumps``, non-ASCII kept) and sent in
    ``fragments`` pieces cut in awkward places (right after a backslash or a quote when one is
    near the even cut point), never parseable on their own."""

    id: str
    name: str
    input: Mapping[str, Any]
    fragments: int = 3

    def argument_fragments(self) -> list[str]:
        return _split_json(json.dumps(self.input, ensure_ascii=False), self.fragments)


Block: TypeAlias = Text | Thinking | ToolUse | str
"""A content block of a :class:`Reply`; a bare ``str`` means ``Text(str)``."""

MOCK_MODEL = "mock-model"
"""The model a :class:`Reply` names when the request named none."""


@dataclass(frozen=True, slots=True)
class Reply:
    """One model response, rendered in the wire format of the endpoint that was hit.

    ``stop_reason`` is Anthropic's (``end_turn``, ``tool_use``, ``max_tokens``,
    ``stop_sequence``, ``refusal``, ...); on the OpenAI endpoint it is mapped to a
    ``finish_reason`` (``tool_use`` → ``tool_calls``, ``max_tokens`` → ``length``,
    ``refusal`` → ``content_filter``, else ``stop``; OpenAI values pass through).
    ``usage`` is ``(input_tokens, output_tokens)``; by default input is ``len(body) // 4`` and
    output the number of deltas sent. Anthropic's ``message_delta`` carries cumulative usage.
    ``model`` is the model the response names (``message_start``'s message, each chunk, the
    Responses ``response``): by default the one the request asked for, as a provider does;
    give another (a dated snapshot, say) to tell the two apart.
    """

    blocks: Sequence[Block] = ()
    stop_reason: str = "end_turn"
    usage: tuple[int, int] | None = None
    model: str | None = None
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Fixture:
    """Replay a fixture file verbatim (path relative to :data:`FIXTURES_DIR`, or absolute).

    Status, headers and ``close_after_body`` come from ``manifest.json`` unless given. A
    ``.sse`` body is sent with chunked encoding (or, with ``close_after_body``, with no framing
    and the connection closed right after it); other bodies with ``content-length``."""

    path: str | Path
    status: int | None = None
    headers: Mapping[str, str] | None = None
    close_after_body: bool | None = None


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An HTTP error response sent verbatim: ``body`` is bytes, str or a JSON-able mapping."""

    status: int
    body: bytes | str | Mapping[str, Any] = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def anthropic(
        cls, status: int, error_type: str, message: str, headers: Mapping[str, str] | None = None
    ) -> ErrorReply:
        """``{"type":"error","error":{"type":..,"message":..},"request_id":..}``."""
        return cls(status, _anthropic_error_body(error_type, message), dict(headers or {}))

    @classmethod
    def openai(
        cls,
        status: int,
        error_type: str,
        message: str,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> ErrorReply:
        """``{"error":{"message":..,"type":..,"param":null,"code":..}}``."""
        return cls(status, _openai_error_body(error_type, message, code), dict(headers or {}))


@dataclass(frozen=True, slots=True)
class WireError:
    """An HTTP error whose body is rendered in the wire format of the endpoint hit (Anthropic
    or OpenAI error shape), for scripts shared by both providers."""

    status: int
    error_type: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One pre-rendered SSE event (its bytes include the trailing blank line).

    ``content``: the first content event is delayed by ``first_token_ms``; ``delta``: every
    delta after the first is delayed by ``token_delay_ms``."""

    data: bytes
    delta: bool = False
    content: bool = False


@dataclass(frozen=True, slots=True)
class Streamed:
    """A pre-rendered 200 SSE body (what :class:`Workload` produces; also usable directly)."""

    events: Sequence[SSEEvent]
    status: int = 200
    headers: Sequence[tuple[str, str]] = _SSE_HEADERS
    close_after_body: bool = False
    paced: bool = True


StreamSource: TypeAlias = Reply | Fixture | Streamed


@dataclass(frozen=True, slots=True)
class DropAfter:
    """Send the first ``after_events`` SSE events of ``reply``, then close the connection
    without the chunked terminator (the client sees an incomplete body)."""

    reply: StreamSource
    after_events: int


@dataclass(frozen=True, slots=True)
class MidStreamError:
    """Send ``after_events`` events of ``reply``, then an error event and end the body.

    Anthropic: ``event: error`` / ``{"type":"error","error":{"details":null,"type":..,
    "message":..}}``; OpenAI: ``data: {"error":{"message":..,"type":..,...}}`` (no
    ``[DONE]``). ``message`` defaults to ``Overloaded`` / ``Internal server error`` / the
    type."""

    reply: StreamSource
    after_events: int
    error_type: str = "overloaded_error"
    message: str | None = None


@dataclass(frozen=True, slots=True)
class MalformedJSON:
    """Send ``after_events`` events of ``reply`` (default: a short text reply), then an event
    whose ``data:`` is not valid JSON, then end the body properly."""

    after_events: int = 0
    reply: StreamSource | None = None


@dataclass(frozen=True, slots=True)
class SlowFirstByte:
    """Wait ``delay_s`` before sending anything (status line included), then send ``reply``."""

    reply: Response
    delay_s: float


@dataclass(frozen=True, slots=True)
class Hang:
    """Send 200 SSE headers, then nothing until the client closes the connection."""


KeepAliveStyle = Literal["comment", "ping", "blank"]


@dataclass(frozen=True, slots=True)
class KeepAlives:
    """Send ``after_events`` events of ``reply`` (default: a short text reply, whose first
    event is Anthropic's ``message_start``, OpenAI chat's role chunk, or the Responses API's
    ``response.created``), then nothing but keep-alives, one every ``every_s`` seconds, until
    the client closes the connection. ``style``: ``comment`` (an SSE comment line,
    ``: keep-alive``), ``ping`` (the wire's own idle event: Anthropic's ``ping``, a Chat
    Completions chunk whose delta is empty, a Responses ``response.in_progress``), or
    ``blank`` (an empty line). With ``for_s`` the keep-alives stop after that long and the
    connection is closed mid-body: a client without a no-progress deadline then sees a stream
    cut short instead of waiting for ever."""

    after_events: int = 1
    reply: StreamSource | None = None
    every_s: float = 5.0
    style: KeepAliveStyle = "comment"
    for_s: float = math.inf


@dataclass(frozen=True, slots=True)
class Paused:
    """Send the first ``after_events`` SSE events of ``reply``, wait until ``resume`` is set,
    then send the rest: a stream held at a known point (say, in the middle of a line of
    text) for as long as a test needs. Set ``resume`` from a thread with
    ``trio.from_thread.run_sync(resume.set)``."""

    reply: StreamSource
    after_events: int
    resume: trio.Event


Handler: TypeAlias = Callable[["RecordedRequest"], "Response"]
"""A dynamic script entry: called with the request, returns what to answer."""

Response: TypeAlias = (
    Reply
    | Fixture
    | ErrorReply
    | WireError
    | Streamed
    | DropAfter
    | MidStreamError
    | MalformedJSON
    | SlowFirstByte
    | Hang
    | KeepAlives
    | Paused
    | Handler
)


# ---------------------------------------------------------------------------------------------
# Recorded requests and invariants
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RecordedRequest:
    """One request as received. ``index`` is the 1-based arrival number over all model
    requests; ``headers`` are lower-cased (repeated headers joined with ``", "``); ``body`` is
    the parsed JSON (``None`` if the body was empty)."""

    index: int
    method: str
    path: str
    headers: dict[str, str]
    raw_body: bytes
    body: Any
    wire: Wire | None
    received_at: float

    @property
    def messages(self) -> list[Any]:
        """The conversation: ``messages``, or the Responses API's ``input`` items."""
        key = "input" if self.wire == "responses" else "messages"
        msgs = self.body.get(key) if isinstance(self.body, dict) else None
        return msgs if isinstance(msgs, list) else []

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True

    @property
    def api_key(self) -> str | None:
        """``x-api-key``, else the token of ``authorization: Bearer ...``."""
        key = self.headers.get("x-api-key")
        if key is not None:
            return key
        auth = self.headers.get("authorization", "")
        return auth[7:] if auth.lower().startswith("bearer ") else None

    def last_message_has_tool_results(self) -> bool:
        """True when the last message carries tool results (Anthropic: a ``tool_result``
        block in a user message; OpenAI: a ``role: tool`` message)."""
        msgs = self.messages
        if not msgs or not isinstance(msgs[-1], dict):
            return False
        last = msgs[-1]
        if self.wire == "openai":
            return last.get("role") == "tool"
        if self.wire == "responses":
            return last.get("type") == "function_call_output"
        return last.get("role") == "user" and any(
            b.get("type") == "tool_result" for b in _blocks(last)
        )


    def tool_rounds(self) -> int:
        """How many rounds of tool calls the conversation has had: Anthropic user messages
        with ``tool_result`` blocks, OpenAI assistant messages with ``tool_calls``."""
        if self.wire == "openai":
            return sum(1 for m in self.messages
                       if isinstance(m, dict) and m.get("role") == "assistant"
                       and m.get("tool_calls"))
        return sum(1 for m in self.messages
                   if isinstance(m, dict) and m.get("role") == "user"
                   and any(b.get("type") == "tool_result" for b in _blocks(m)))


def _blocks(message: Any) -> list[dict[str, Any]]:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return []


def check_anthropic_messages(body: Any) -> list[str]:
    """Violations of the Anthropic conversation invariants in a request body (empty if fine).

    Roles are ``user``/``assistant``, alternate, and start with ``user``; every ``tool_use`` id
    is a non-empty string, unique in the conversation, and has exactly one ``tool_result`` in
    the immediately following user message; every ``tool_result`` refers to a ``tool_use`` of
    the immediately preceding assistant message."""
    msgs = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(msgs, list) or not msgs:
        return ["'messages' must be a non-empty list"]
    problems: list[str] = []
    seen_ids: dict[str, int] = {}
    prev_role: Any = None
    prev_ids: list[Any] = []
    for i, msg in enumerate(msgs):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant"):
            problems.append(f"messages[{i}]: role must be 'user' or 'assistant', got {role!r}")
        elif i == 0 and role != "user":
            problems.append(f"messages[0]: the first message must have role 'user', got {role!r}")
        elif role == prev_role:
            problems.append(f"messages[{i}]: role {role!r} follows {prev_role!r} (must alternate)")
        blocks = _blocks(msg)
        if role == "user":
            for b in blocks:
                if b.get("type") != "tool_result":
                    continue
                tid = b.get("tool_use_id")
                if not isinstance(tid, str) or not tid:
                    problems.append(f"messages[{i}]: tool_result with empty tool_use_id")
                elif prev_role != "assistant" or tid not in prev_ids:
                    problems.append(
                        f"messages[{i}]: tool_result refers to unknown tool_use id {tid!r} "
                        "(not in the immediately preceding assistant message)"
                    )
        ids: list[Any] = []
        if role == "assistant":
            ids = [b.get("id") for b in blocks if b.get("type") == "tool_use"]
            nxt = msgs[i + 1] if i + 1 < len(msgs) else None
            results: list[Any] = []
            if isinstance(nxt, dict) and nxt.get("role") == "user":
                results = [
                    b.get("tool_use_id") for b in _blocks(nxt) if b.get("type") == "tool_result"
                ]
            for tid in ids:
                if not isinstance(tid, str) or not tid:
                    problems.append(f"messages[{i}]: tool_use with empty id")
                    continue
                if tid in seen_ids:
                    problems.append(
                        f"messages[{i}]: tool_use id {tid!r} already used in "
                        f"messages[{seen_ids[tid]}]"
                    )
                    continue
                seen_ids[tid] = i
                count = results.count(tid)
                if count == 0:
                    problems.append(
                        f"messages[{i}]: tool_use id {tid!r} has no tool_result in the "
                        f"immediately following user message (messages[{i + 1}])"
                    )
                elif count > 1:
                    problems.append(
                        f"messages[{i}]: tool_use id {tid!r} has {count} tool_results in "
                        f"messages[{i + 1}] (exactly one required)"
                    )
        prev_role, prev_ids = role, ids
    return problems


def check_openai_messages(body: Any) -> list[str]:
    """Violations of the OpenAI chat invariants in a request body (empty if fine).

    Every ``tool_calls[].id`` of an assistant message is a non-empty string, unique in the
    conversation, and answered by exactly one ``role: tool`` message (``tool_call_id``) in the
    run of tool messages right after it; every tool message answers a call of the assistant
    message that run follows."""
    msgs = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(msgs, list) or not msgs:
        return ["'messages' must be a non-empty list"]
    problems: list[str] = []
    seen_ids: dict[str, int] = {}
    open_ids: list[Any] = []  # ids of the assistant message the current tool run follows
    answered: list[Any] = []
    open_at = -1

    def close_run() -> None:
        for tid in open_ids:
            if not isinstance(tid, str) or not tid:
                continue
            count = answered.count(tid)
            if count == 0:
                problems.append(
                    f"messages[{open_at}]: tool_call id {tid!r} has no following "
                    "role 'tool' message with that tool_call_id"
                )
            elif count > 1:
                problems.append(
                    f"messages[{open_at}]: tool_call id {tid!r} has {count} tool messages "
                    "(exactly one required)"
                )

    for i, msg in enumerate(msgs):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "tool":
            tid = msg.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                problems.append(f"messages[{i}]: tool message with empty tool_call_id")
            elif tid not in open_ids:
                problems.append(
                    f"messages[{i}]: tool message refers to unknown tool_call id {tid!r}"
                )
            else:
                answered.append(tid)
            continue
        close_run()
        open_ids, answered, open_at = [], [], i
        if role == "assistant" and isinstance(msg, dict):
            calls = msg.get("tool_calls") or []
            for call in calls if isinstance(calls, list) else []:
                tid = call.get("id") if isinstance(call, dict) else None
                if not isinstance(tid, str) or not tid:
                    problems.append(f"messages[{i}]: tool_call with empty id")
                elif tid in seen_ids:
                    problems.append(
                        f"messages[{i}]: tool_call id {tid!r} already used in "
                        f"messages[{seen_ids[tid]}]"
                    )
                else:
                    seen_ids[tid] = i
                    open_ids.append(tid)
    close_run()
    return problems


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"\S+\s*|\s+")


def _split_tokens(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def _split_json(s: str, n: int) -> list[str]:
    """Cut ``s`` into ``n`` non-empty pieces near even offsets, preferring awkward places:
    between a backslash and the escaped character, or right after a quote."""
    n = max(1, min(n, len(s)))
    cuts: list[int] = []
    for k in range(1, n):
        ideal = len(s) * k // n
        best = ideal
        for d in (0, 1, -1, 2, -2, 3, -3):
            p = ideal + d
            if 0 < p < len(s) and s[p - 1] == "\\":
                best = p
                break
        else:
            for d in (0, 1, -1, 2, -2):
                p = ideal + d
                if 0 < p < len(s) and s[p - 1] == '"':
                    best = p
                    break
        lo = cuts[-1] + 1 if cuts else 1
        best = max(lo, min(best, len(s) - (n - k)))
        cuts.append(best)
    bounds = [0, *cuts, len(s)]
    return [s[a:b] for a, b in itertools.pairwise(bounds)]


def _anthropic_event(name: str, obj: Any) -> bytes:
    return f"event: {name}\ndata: {_dumps(obj)}\n\n".encode()


def _openai_event(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


_OPENAI_DONE = b"data: [DONE]\n\n"

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "pause_turn": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "content_filter": "content_filter",
    "function_call": "function_call",
}


def _requested_model(rec: RecordedRequest) -> str:
    """The model ``rec`` asked for, else :data:`MOCK_MODEL`."""
    model = rec.body.get("model") if isinstance(rec.body, dict) else None
    return model if isinstance(model, str) and model else MOCK_MODEL


def _finish_reason(stop_reason: str) -> str:
    return _FINISH_REASONS.get(stop_reason, "stop")


def _as_block(b: Block) -> Text | Thinking | ToolUse:
    return Text(b) if isinstance(b, str) else b


def _anthropic_usage_start(input_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 1,
        "service_tier": "standard",
    }


def _anthropic_message_start(message_id: str, model: str, input_tokens: int) -> bytes:
    return _anthropic_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _anthropic_usage_start(input_tokens),
            },
        },
    )


def _anthropic_message_end(
    stop_reason: str, stop_sequence: str | None, input_tokens: int, output_tokens: int
) -> list[SSEEvent]:
    delta = _anthropic_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {
                "input_tokens": input_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": output_tokens,
            },
        },
    )
    return [SSEEvent(delta), SSEEvent(_anthropic_event("message_stop", {"type": "message_stop"}))]


def _anthropic_block_events(index: int, block: Text | Thinking | ToolUse) -> list[SSEEvent]:
    """content_block_start, deltas, content_block_stop for one block."""
    start: dict[str, Any]
    deltas: list[dict[str, Any]]
    if isinstance(block, Text):
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": t} for t in block.deltas()]
    elif isinstance(block, Thinking):
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": t} for t in block.deltas()]
        deltas.append({"type": "signature_delta", "signature": block.signature})
    else:
        start = {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}
        deltas = [
            {"type": "input_json_delta", "partial_json": f} for f in block.argument_fragments()
        ]
    events = [
        SSEEvent(
            _anthropic_event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": start},
            ),
            content=True,
        )
    ]
    events.extend(
        SSEEvent(
            _anthropic_event(
                "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}
            ),
            delta=True,
            content=True,
        )
        for d in deltas
    )
    events.append(
        SSEEvent(
            _anthropic_event("content_block_stop", {"type": "content_block_stop", "index": index})
        )
    )
    return events


def _count_output(blocks: Sequence[Text | Thinking | ToolUse]) -> int:
    n = 0
    for b in blocks:
        n += len(b.argument_fragments()) if isinstance(b, ToolUse) else len(b.deltas())
    return max(n, 1)


def render_anthropic(reply: Reply, *, message_id: str, default_input_tokens: int) -> list[SSEEvent]:
    """The Anthropic Messages SSE events of ``reply``."""
    blocks = [_as_block(b) for b in reply.blocks]
    inp, out = reply.usage or (default_input_tokens, _count_output(blocks))
    events = [SSEEvent(_anthropic_message_start(message_id, reply.model or MOCK_MODEL, inp))]
    for i, b in enumerate(blocks):
        events.extend(_anthropic_block_events(i, b))
    events.extend(_anthropic_message_end(reply.stop_reason, reply.stop_sequence, inp, out))
    return events


class _OpenAIChunks:
    """Renders chat.completion.chunk objects with a fixed id/created/model."""

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self.head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "service_tier": "default",
            "system_fingerprint": "fp_mock",
        }

    def delta(self, delta: Mapping[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return _openai_event({**self.head, "choices": [choice], "usage": None})

    def usage(self, prompt: int, completion: int) -> bytes:
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        return _openai_event({**self.head, "choices": [], "usage": usage})


def _openai_block_events(
    chunks: _OpenAIChunks, block: Text | Thinking | ToolUse, tool_index: int
) -> list[SSEEvent]:
    if isinstance(block, Text):
        return [SSEEvent(chunks.delta({"content": t}), True, True) for t in block.deltas()]
    if isinstance(block, Thinking):
        return [
            SSEEvent(chunks.delta({"reasoning_content": t}), True, True) for t in block.deltas()
        ]
    start = {
        "index": tool_index,
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": ""},
    }
    events = [SSEEvent(chunks.delta({"tool_calls": [start]}), False, True)]
    events.extend(
        SSEEvent(
            chunks.delta({"tool_calls": [{"index": tool_index, "function": {"arguments": f}}]}),
            True,
            True,
        )
        for f in block.argument_fragments()
    )
    return events


def render_openai(reply: Reply, *, completion_id: str, default_input_tokens: int) -> list[SSEEvent]:
    """The OpenAI chat-completions SSE events of ``reply`` (ending with ``[DONE]``)."""
    blocks = [_as_block(b) for b in reply.blocks]
    inp, out = reply.usage or (default_input_tokens, _count_output(blocks))
    chunks = _OpenAIChunks(completion_id, reply.model or MOCK_MODEL, int(time.time()))
    has_text = any(isinstance(b, Text) for b in blocks)
    first = {"role": "assistant", "content": "" if has_text else None, "refusal": None}
    events = [SSEEvent(chunks.delta(first))]
    tool_index = 0
    for b in blocks:
        events.extend(_openai_block_events(chunks, b, tool_index))
        if isinstance(b, ToolUse):
            tool_index += 1
    events.append(SSEEvent(chunks.delta({}, _finish_reason(reply.stop_reason))))
    events.append(SSEEvent(chunks.usage(inp, out)))
    events.append(SSEEvent(_OPENAI_DONE))
    return events


def render_responses_reply(reply: Reply, index: int, default_input_tokens: int) -> list[SSEEvent]:
    """The Responses API SSE events of ``reply`` (``max_tokens`` ends it incomplete, with
    its last tool call cut)."""
    blocks = [_as_block(b) for b in reply.blocks]
    usage = reply.usage or (default_input_tokens, _count_output(blocks))
    rendered = render_responses(blocks, response_id=f"resp_mock{index:08d}",
                                model=reply.model or MOCK_MODEL, stop_reason=reply.stop_reason,
                                usage=usage)
    return [SSEEvent(data, delta=delta, content=delta) for data, delta in rendered]


def _non_stream_body(reply: Reply, wire: Wire, ident: str, default_input_tokens: int) -> bytes:
    blocks = [_as_block(b) for b in reply.blocks]
    inp, out = reply.usage or (default_input_tokens, _count_output(blocks))
    if wire == "anthropic":
        content: list[dict[str, Any]] = []
        for b in blocks:
            if isinstance(b, Text):
                content.append({"type": "text", "text": b.text})
            elif isinstance(b, Thinking):
                content.append({"type": "thinking", "thinking": b.text, "signature": b.signature})
            else:
                content.append({"type": "tool_use", "id": b.id, "name": b.name,
                                "input": dict(b.input)})
        return _dumps({
            "id": ident, "type": "message", "role": "assistant", "model": reply.model or MOCK_MODEL,
            "content": content, "stop_reason": reply.stop_reason,
            "stop_sequence": reply.stop_sequence,
            "usage": {"input_tokens": inp, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": out},
        }).encode()
    text = "".join(b.text for b in blocks if isinstance(b, Text))
    message: dict[str, Any] = {
        "role": "assistant", "content": text if text else None, "refusal": None,
    }
    calls = [
        {"id": b.id, "type": "function",
         "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
        for b in blocks if isinstance(b, ToolUse)
    ]
    if calls:
        message["tool_calls"] = calls
    return _dumps({
        "id": ident, "object": "chat.completion", "created": int(time.time()),
        "model": reply.model or MOCK_MODEL,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": _finish_reason(reply.stop_reason)}],
        "usage": {"prompt_tokens": inp, "completion_tokens": out, "total_tokens": inp + out},
    }).encode()


def _anthropic_error_body(error_type: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": "req_mock",
    }


def _openai_error_body(error_type: str, message: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def _wire_error_body(wire: Wire | None, error_type: str, message: str) -> bytes:
    if wire in ("openai", "responses"):
        return _dumps(_openai_error_body(error_type, message)).encode()
    return _dumps(_anthropic_error_body(error_type, message)).encode()


_MIDSTREAM_MESSAGES = {"overloaded_error": "Overloaded", "api_error": "Internal server error"}


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

_fixture_cache: dict[Path, bytes] = {}
_manifest_cache: dict[Path, dict[str, Any]] = {}


def fixture_manifest(fixtures_dir: Path | None = None) -> dict[str, Any]:
    """The parsed ``manifest.json`` (cached)."""
    root = fixtures_dir or FIXTURES_DIR
    if root not in _manifest_cache:
        _manifest_cache[root] = json.loads((root / "manifest.json").read_text("utf-8"))
    return _manifest_cache[root]


def _fixture_bytes(path: Path) -> bytes:
    if path not in _fixture_cache:
        _fixture_cache[path] = path.read_bytes()
    return _fixture_cache[path]


def _fixture_entry(path: str | Path, fixtures_dir: Path) -> tuple[Path, dict[str, Any]]:
    full = Path(path) if Path(path).is_absolute() else fixtures_dir / path
    try:
        key = full.resolve().relative_to(fixtures_dir.resolve()).as_posix()
    except ValueError:
        key = str(path)
    manifest = fixture_manifest(fixtures_dir) if (fixtures_dir / "manifest.json").exists() else {}
    return full, manifest.get(key, {})


def error_fixture(path: str | Path, fixtures_dir: Path | None = None) -> ErrorReply:
    """An :class:`ErrorReply` from an error fixture file (status and headers from the
    manifest), e.g. ``error_fixture("anthropic/errors/529_overloaded_error.json")``."""
    full, entry = _fixture_entry(path, fixtures_dir or FIXTURES_DIR)
    return ErrorReply(int(entry.get("status", 500)), _fixture_bytes(full),
                      dict(entry.get("headers", {})))


def _split_events(data: bytes) -> list[SSEEvent]:
    """Split an SSE body after each blank line; a trailing partial event is kept as is."""
    events: list[SSEEvent] = []
    start = 0
    while True:
        end = data.find(b"\n\n", start)
        if end < 0:
            break
        events.append(SSEEvent(data[start : end + 2]))
        start = end + 2
    if start < len(data):
        events.append(SSEEvent(data[start:]))
    return events


# ---------------------------------------------------------------------------------------------
# The reference workload
# ---------------------------------------------------------------------------------------------


class Workload:
    """The benchmark's reference workload, an endless handler (use as ``fallback``).

    A request whose last message carries no tool results gets ``text_tokens`` text deltas then
    ``tool_calls`` calls of ``tool_name`` with input ``{"key": "<n>"}`` (n = 1, 2, ...), their
    arguments in ``fragments`` pieces, ``stop_reason`` ``tool_use``; a request whose last
    message carries tool results gets ``text_tokens`` deltas and ``end_turn`` — once its
    conversation has had ``rounds`` rounds of tool calls (Anthropic and OpenAI wires;
    default one), else more tool calls (on the Anthropic wire with the next keys: 3, 4…).
    Both wire
    formats. Event bytes are rendered once; per request only the message/tool ids (and, on
    OpenAI, the completion id prefix of each chunk) are filled in. Tool ids are unique per
    request. Non-streaming requests get the equivalent JSON body.

    ``title_tokens`` (default None: off): a streamed Anthropic request that offers no tools
    (a session title, which ``greenroom serve`` asks for after a session's first task) gets
    that many text deltas and ``end_turn`` instead, as a model names a conversation in a
    few words."""

    def __init__(
        self,
        text_tokens: int = 200,
        tool_calls: int = 2,
        fragments: int = 3,
        tool_name: str = "lookup",
        model: str = "mock-model",
        rounds: int = 1,
        title_tokens: int | None = None,
    ) -> None:
        self.rounds = rounds
        self.title_tokens = title_tokens
        self.text_tokens = text_tokens
        self.tool_calls = tool_calls
        self.fragments = fragments
        self.tool_name = tool_name
        self.model = model
        self._counter = itertools.count(1)
        self._tokens = [f"tok{i} " for i in range(text_tokens)]
        self._inputs = [{"key": str(n)} for n in range(1, tool_calls + 1)]
        text_block = Text("".join(self._tokens), chunks=self._tokens)
        # Anthropic: everything except message_start and the tool_use starts is static.
        self._a_text = _anthropic_block_events(0, text_block) if text_tokens else []
        # One set of calls per round, their keys numbered on (1, 2 in the first round, 3, 4
        # in the next…): a model that repeated the very same call would look stuck.
        self._a_rounds: list[list[tuple[bytes, bytes, list[SSEEvent]]]] = []
        base = 1 if text_tokens else 0
        for done in range(max(1, rounds)):
            calls: list[tuple[bytes, bytes, list[SSEEvent]]] = []
            for n in range(tool_calls):
                inp = {"key": str(done * tool_calls + n + 1)}
                evs = _anthropic_block_events(base + n,
                                              ToolUse("@ID@", tool_name, inp, fragments))
                before, after = evs[0].data.split(b"@ID@")
                calls.append((before, after, evs[1:]))
            self._a_rounds.append(calls)
        out_tool = max(1, text_tokens + tool_calls * fragments)
        out_final = max(1, text_tokens)
        self._a_end_tool = _anthropic_message_end("tool_use", None, 0, out_tool)
        self._a_end_final = _anthropic_message_end("end_turn", None, 0, out_final)
        # OpenAI: chunks are rendered with a placeholder id; the id prefix is per request.
        ch = _OpenAIChunks("@ID@", model, 0)
        self._o_first = ch.delta({"role": "assistant", "content": "", "refusal": None})
        self._o_text = [ch.delta({"content": t}) for t in self._tokens]
        self._o_tools: list[tuple[bytes, bytes, list[bytes]]] = []
        for n, inp in enumerate(self._inputs):
            start = {"index": n, "id": "@CALL@", "type": "function",
                     "function": {"name": tool_name, "arguments": ""}}
            before, after = ch.delta({"tool_calls": [start]}).split(b"@CALL@")
            frags = [
                ch.delta({"tool_calls": [{"index": n, "function": {"arguments": f}}]})
                for f in _split_json(json.dumps(inp), fragments)
            ]
            self._o_tools.append((before, after, frags))
        self._o_finish_tool = ch.delta({}, "tool_calls")
        self._o_finish_final = ch.delta({}, "stop")
        self._o_usage_tool = ch.usage(0, out_tool)
        self._o_usage_final = ch.usage(0, out_final)

    def __call__(self, request: RecordedRequest) -> Response:
        n = next(self._counter)
        final = self.tool_calls == 0 or (
            request.last_message_has_tool_results()
            and (self.rounds <= 1 or request.tool_rounds() >= self.rounds)
        )
        if not request.stream:
            return self._reply(n, final)
        if request.wire == "openai":
            return Streamed(self._openai(n, final))
        if self.title_tokens is not None and not (
            isinstance(request.body, dict) and request.body.get("tools")
        ):
            return Streamed(self._title(n, max(1, len(request.raw_body) // 4)))
        done = min(request.tool_rounds(), len(self._a_rounds) - 1) if self.rounds > 1 else 0
        return Streamed(self._anthropic(n, final, max(1, len(request.raw_body) // 4), done))

    def _reply(self, n: int, final: bool) -> Reply:
        blocks: list[Block] = [Text("".join(self._tokens), chunks=self._tokens)]
        if not final:
            blocks += [
                ToolUse(f"toolu_mock{n:08d}_{k}", self.tool_name, inp, self.fragments)
                for k, inp in enumerate(self._inputs, 1)
            ]
        return Reply(blocks, "end_turn" if final else "tool_use", model=self.model)

    def _anthropic(
        self, n: int, final: bool, input_tokens: int, done: int = 0
    ) -> list[SSEEvent]:
        events = [SSEEvent(_anthropic_message_start(f"msg_mock{n:08d}", self.model,
                                                    input_tokens))]
        events += self._a_text
        if final:
            events += self._a_end_final
            return events
        for k, (before, after, rest) in enumerate(self._a_rounds[done], 1):
            tid = f"toolu_mock{n:08d}_{k}".encode()
            events.append(SSEEvent(before + tid + after, content=True))
            events += rest
        events += self._a_end_tool
        return events

    def _title(self, n: int, input_tokens: int) -> list[SSEEvent]:
        tokens = [f"Title{i} " for i in range(self.title_tokens or 1)]
        reply = Reply([Text("".join(tokens), chunks=tokens)], model=self.model)
        return render_anthropic(reply, message_id=f"msg_mock{n:08d}",
                                default_input_tokens=input_tokens)

    def _openai(self, n: int, final: bool) -> list[SSEEvent]:
        cid = f"chatcmpl-mock{n:08d}".encode()

        def fill(chunk: bytes) -> bytes:
            return chunk.replace(b"@ID@", cid, 1)

        events = [SSEEvent(fill(self._o_first))]
        events += [SSEEvent(fill(c), True, True) for c in self._o_text]
        if not final:
            for k, (before, after, frags) in enumerate(self._o_tools, 1):
                call = f"call_mock{n:08d}_{k}".encode()
                events.append(SSEEvent(fill(before) + call + after, False, True))
                events += [SSEEvent(fill(f), True, True) for f in frags]
        events.append(SSEEvent(fill(self._o_finish_final if final else self._o_finish_tool)))
        events.append(SSEEvent(fill(self._o_usage_final if final else self._o_usage_tool)))
        events.append(SSEEvent(_OPENAI_DONE))
        return events


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------

Ending = Literal["end", "drop", "close", "hang", "keepalive"]


@dataclass(slots=True)
class _Plan:
    """What to send for one request. ``events is None``: a fixed body with content-length."""

    status: int
    headers: list[tuple[str, str]]
    events: Sequence[SSEEvent] | None = None
    body: bytes = b""
    ending: Ending = "end"
    paced: bool = False
    first_byte_delay: float = 0.0
    keepalive: bytes = b""
    keepalive_every_s: float = 0.0
    keepalive_for_s: float = math.inf
    pause: tuple[int, trio.Event] | None = None


@dataclass(slots=True, eq=False)
class _PacedBody:
    """The rest of a paced body that the pacer writes: ``events[next:]``, each due at its
    ``deadlines`` entry; ``tail`` goes with the last write. ``pending``: bytes the socket
    did not take (the stream's task sends them); ``error``: the socket failed."""

    raw: Any
    events: Sequence[SSEEvent]
    deadlines: list[float]
    next: int
    frame: Callable[[bytes], list[bytes]]
    tail: bytes
    task: trio.lowlevel.Task | None = None
    pending: bytes = b""
    done: bool = False
    error: trio.BrokenResourceError | None = None
    cancelled: bool = False


class _Pacer:
    """Wakes paced streams on a shared tick grid with one timer, and writes them.

    A trio sleep costs a cancel scope and a Cancelled exception per call; with 1000 paced
    streams that is tens of thousands per second, and a task switch per stream per token
    more. Here a paced body waits in the bucket of its next deadline (rounded up to the
    tick) and one pacer task writes every body that is due at each tick, with one
    non-blocking send each, its stream's task asleep until the body is written (or the
    socket is full: then that task sends the rest and the body waits again).
    :meth:`sleep_until` parks a task in a bucket instead (the old way, for sockets the pacer
    cannot write)."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self._buckets: dict[int, list[trio.lowlevel.Task | _PacedBody]] = {}
        self._keys: list[int] = []
        self._scope: trio.CancelScope | None = None

    async def run(self) -> None:
        while True:
            deadline = self._keys[0] * self.tick if self._keys else math.inf
            with trio.CancelScope(deadline=deadline) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None
            due = math.floor(trio.current_time() / self.tick + 1e-6)
            while self._keys and self._keys[0] <= due:
                for item in self._buckets.pop(heapq.heappop(self._keys), ()):
                    if isinstance(item, _PacedBody):
                        self._write_due(item)
                    else:
                        trio.lowlevel.reschedule(item)

    def _write_due(self, body: _PacedBody) -> None:
        """Write what of ``body`` is due now, as the stream's own loop would have at this
        wake: the event it waited for and every later one already due, in one write."""
        if body.cancelled:
            return
        now = trio.current_time()
        events, deadlines = body.events, body.deadlines
        first = body.next
        end = first + 1
        while end < len(events) and deadlines[end] <= now:
            end += 1
        body.next = end
        body.done = end == len(events)
        data = b"".join([*body.frame(b"".join(e.data for e in events[first:end])),
                         body.tail if body.done else b""])
        try:
            sent = _try_send(body.raw, data)
        except trio.BrokenResourceError as exc:
            body.error = exc
            sent = len(data)
        if sent < len(data):
            body.pending = data[sent:]
        if body.done or body.pending or body.error is not None:
            assert body.task is not None
            task, body.task = body.task, None
            trio.lowlevel.reschedule(task)
        else:
            self._add(deadlines[end], body)

    def _add(self, deadline: float, item: trio.lowlevel.Task | _PacedBody) -> None:
        key = math.ceil(deadline / self.tick)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = []
            heapq.heappush(self._keys, key)
            if self._scope is not None and key * self.tick < self._scope.deadline:
                self._scope.deadline = key * self.tick
        bucket.append(item)

    async def write(self, body: _PacedBody, stream: trio.abc.Stream) -> None:
        """Have ``body`` written at its deadlines; returns once it is all sent."""
        while True:
            body.task = trio.lowlevel.current_task()
            self._add(body.deadlines[body.next], body)

            def abort(_: Any) -> trio.lowlevel.Abort:
                body.cancelled = True
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
            if body.error is not None:
                raise body.error
            if body.pending:
                data, body.pending = body.pending, b""
                await stream.send_all(data)
            if body.done:
                return

    async def sleep_until(self, deadline: float) -> None:
        task = trio.lowlevel.current_task()
        self._add(deadline, task)
        key = math.ceil(deadline / self.tick)
        bucket = self._buckets[key]

        def abort(_: Any) -> trio.lowlevel.Abort:
            bucket.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class _Exhausted(Exception):
    pass


def _reason(status: int) -> bytes:
    if status == 529:
        return b"Overloaded"
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class MockModelServer:
    """A loopback model server; see the module docstring for the protocol.

    Parameters: ``responses`` seed the FIFO (``push`` adds more); ``fallback`` answers when
    the FIFO is empty (e.g. ``Workload()``); ``require_api_key`` makes requests whose
    ``x-api-key`` / bearer token differ get 401 with the provider's auth error body;
    ``rechunk`` (``"random"`` or a piece size in bytes) writes every streamed body as many
    small HTTP chunks (seeded by ``seed`` and the request number) so client SSE parsers meet
    arbitrary read boundaries; ``first_token_ms`` / ``token_delay_ms`` pace generated streams
    (:class:`Reply`, :class:`Workload`; not fixtures), with catch-up batching when the server
    falls behind (streams wake on a shared ``pacing_tick_ms`` grid, one timer for all; 0
    means one trio sleep per wait); ``check_invariants`` enables the tool-pairing check;
    ``record=False`` keeps no :class:`RecordedRequest` (long benchmark runs);
    ``max_streams`` answers a model request that comes while that many responses are being
    written with 429 ``rate_limit_error`` and ``retry-after: limit_retry_after`` (a provider
    that takes K requests at once: the FIFO is not popped), counted in ``rate_limited``.

    Public state: ``requests``, ``violations`` (strings naming the request number),
    ``errors`` (empty FIFO, handler exceptions, bad JSON), ``request_count``,
    ``rate_limited``, ``active_streams``, ``peak_streams``,
    ``connections_total``, ``connections_open``, ``port``, ``base_url``, ``pending``.
    """

    def __init__(
        self,
        responses: Iterable[Response] = (),
        *,
        fallback: Handler | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        require_api_key: str | None = None,
        rechunk: Rechunk = None,
        seed: int = 0,
        first_token_ms: float = 0.0,
        token_delay_ms: float = 0.0,
        check_invariants: bool = True,
        record: bool = True,
        fixtures_dir: Path | None = None,
        log_problems: bool = False,
        pacing_tick_ms: float = 1.0,
        max_streams: int | None = None,
        limit_retry_after: float = 1.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.tls = tls
        self.max_streams = max_streams
        self.limit_retry_after = limit_retry_after
        self.rate_limited = 0
        self.active_streams = 0
        self.peak_streams = 0
        self.queue: deque[Response] = deque(responses)
        self.fallback = fallback
        self.host = host
        self.port = port
        self.require_api_key = require_api_key
        self.rechunk: Rechunk = rechunk
        self.seed = seed
        self.first_token_ms = first_token_ms
        self.token_delay_ms = token_delay_ms
        self.check_invariants = check_invariants
        self.record = record
        self.fixtures_dir = fixtures_dir or FIXTURES_DIR
        self.log_problems = log_problems
        self.pacing_tick_ms = pacing_tick_ms
        self._pacer: _Pacer | None = None
        self.requests: list[RecordedRequest] = []
        self.violations: list[str] = []
        self.errors: list[str] = []
        self.request_count = 0
        self.connections_total = 0
        self.connections_open = 0
        self._ids = itertools.count(1)

    # -- scripting ---------------------------------------------------------------------------

    def push(self, *responses: Response) -> None:
        """Append responses to the FIFO."""
        self.queue.extend(responses)

    @property
    def pending(self) -> int:
        """Scripted responses not yet consumed."""
        return len(self.queue)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (valid once serving)."""
        return f"http://{self.host}:{self.port}"

    def assert_clean(self) -> None:
        """Raise AssertionError if any request violated an invariant or found no response."""
        problems = self.violations + self.errors
        if problems:
            raise AssertionError("mock model server saw problems:\n  " + "\n  ".join(problems))

    # -- serving -----------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (port 0 picks one, stored in ``self.port``), report the port
        through ``task_status.started`` and serve until cancelled."""
        tcp = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = tcp[0].socket.getsockname()[1]
        listeners: list[trio.abc.Listener[Any]] = list(tcp)
        if self.tls is not None:
            listeners = [trio.SSLListener(t, self.tls, https_compatible=True) for t in tcp]
        async with trio.open_nursery() as nursery:
            if self.pacing_tick_ms > 0:
                self._pacer = _Pacer(self.pacing_tick_ms / 1000)
                nursery.start_soon(self._pacer.run)
            task_status.started(self.port)
            await trio.serve_listeners(self._handle_connection, listeners,
                                       handler_nursery=nursery)

    async def _handle_connection(self, stream: trio.abc.Stream) -> None:
        self.connections_total += 1
        self.connections_open += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
        try:
            while True:
                got = await self._receive_request(conn, stream)
                if got is None:
                    return
                keep_alive = await self._respond(conn, stream, *got)
                if not (keep_alive and conn.our_state is h11.DONE
                        and conn.their_state is h11.DONE):
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            self.connections_open -= 1
            await trio.aclose_forcefully(stream)

    async def _receive_request(
        self, conn: h11.Connection, stream: trio.abc.Stream
    ) -> tuple[h11.Request, bytes] | None:
        request: h11.Request | None = None
        body: list[bytes] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, b"".join(body)
            else:  # ConnectionClosed, PAUSED
                return None

    def _problem(self, kind: list[str], text: str) -> None:
        kind.append(text)
        if self.log_problems:
            print(f"mock model server: {text}", file=sys.stderr, flush=True)

    async def _respond(
        self, conn: h11.Connection, stream: trio.abc.Stream, req: h11.Request, raw: bytes
    ) -> bool:
        method = req.method.decode()
        path = req.target.decode("latin-1").split("?", 1)[0]
        wire: Wire | None = {
            ANTHROPIC_PATH: "anthropic", OPENAI_PATH: "openai", RESPONSES_PATH: "responses"
        }.get(path)
        if wire is None:
            if path == "/health":
                return await self._send(conn, stream, _Plan(200, [("content-type", "text/plain")],
                                                            body=b"ok"), None)
            body = _wire_error_body(None, "not_found_error", f"no route {method} {path}")
            return await self._send(conn, stream, _Plan(404, [("content-type", _JSON)],
                                                        body=body), None)
        self.request_count += 1
        index = self.request_count
        headers: dict[str, str] = {}
        for name, value in req.headers:
            key = name.decode("latin-1").lower()
            val = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError as exc:
            parsed = None
            bad_json: str | None = f"request #{index} ({path}): body is not JSON: {exc}"
        else:
            bad_json = None
        rec = RecordedRequest(index, method, path, headers, raw, parsed, wire,
                              trio.current_time())
        if self.record:
            self.requests.append(rec)

        def error(status: int, error_type: str, message: str, **extra: str) -> _Plan:
            return _Plan(status, [("content-type", _JSON), *extra.items()],
                         body=_wire_error_body(wire, error_type, message))

        if self.max_streams is not None and self.active_streams >= self.max_streams:
            self.rate_limited += 1
            retry_after = f"{self.limit_retry_after:g}"
            plan = error(429, "rate_limit_error",
                         f"mock model server: {self.max_streams} requests at once at most",
                         **{"retry-after": retry_after})
            return await self._send(conn, stream, plan, rec)
        if method != "POST":
            plan = error(405, "invalid_request_error", f"{method} not allowed on {path}")
        elif bad_json is not None:
            self._problem(self.errors, bad_json)
            plan = error(400, "invalid_request_error", bad_json)
        elif self.require_api_key is not None and rec.api_key != self.require_api_key:
            plan = self._auth_error(wire)
        else:
            problems: list[str] = []
            if self.check_invariants:
                check = {"anthropic": check_anthropic_messages, "openai": check_openai_messages,
                         "responses": check_responses_input}[wire]
                problems = check(parsed) + check_structured_request(wire, parsed)
            if problems:
                text = f"request #{index} ({path}) violates invariants: " + "; ".join(problems)
                self._problem(self.violations, text)
                plan = error(400, "invalid_request_error", "mock model server: " + text)
            else:
                try:
                    plan = self._plan(self._next_response(rec), rec)
                except _Exhausted:
                    text = (f"request #{index} ({method} {path}): no scripted response left "
                            "(the FIFO is empty and there is no fallback)")
                    self._problem(self.errors, text)
                    plan = error(500, "api_error", "mock model server: " + text,
                                 **{"x-should-retry": "false"})
                except Exception as exc:
                    text = f"request #{index} ({path}): script raised {exc!r}"
                    self._problem(self.errors, text)
                    plan = error(500, "api_error", "mock model server: " + text,
                                 **{"x-should-retry": "false"})
        self.active_streams += 1
        self.peak_streams = max(self.peak_streams, self.active_streams)
        try:
            return await self._send(conn, stream, plan, rec)
        finally:
            self.active_streams -= 1

    def _auth_error(self, wire: Wire) -> _Plan:
        if wire in ("openai", "responses"):
            body = _openai_error_body(
                "invalid_request_error",
                "Incorrect API key provided. You can find your API key at "
                "https://platform.openai.com/account/api-keys.",
                "invalid_api_key",
            )
        else:
            body = _anthropic_error_body("authentication_error", "invalid x-api-key")
        return _Plan(401, [("content-type", _JSON)], body=_dumps(body).encode())

    def _next_response(self, rec: RecordedRequest) -> Response:
        if self.queue:
            return self.queue.popleft()
        if self.fallback is not None:
            return self.fallback
        raise _Exhausted

    def _request_headers(self, rec: RecordedRequest) -> list[tuple[str, str]]:
        if rec.wire in ("openai", "responses"):
            return [("x-request-id", f"req_mock{rec.index:08d}")]
        return [("request-id", f"req_mock{rec.index:08d}")]

    def _plan(self, response: Response, rec: RecordedRequest) -> _Plan:
        for _ in range(16):
            if isinstance(response, (Reply, Fixture, ErrorReply, WireError, Streamed, DropAfter,
                                     MidStreamError, MalformedJSON, SlowFirstByte, Hang,
                                     KeepAlives, Paused)):
                break
            response = response(rec)
        else:
            raise TypeError("handler chain too deep")
        wire: Wire = rec.wire or "anthropic"
        if isinstance(response, Reply):
            if response.model is None:
                response = replace(response, model=_requested_model(rec))
            ident = (f"msg_mock{rec.index:08d}" if wire == "anthropic"
                     else f"chatcmpl-mock{rec.index:08d}")
            default_in = max(1, len(rec.raw_body) // 4)
            if not rec.stream:
                return _Plan(200, [("content-type", _JSON), *self._request_headers(rec)],
                             body=_non_stream_body(response, wire, ident, default_in))
            if wire == "responses":
                events = render_responses_reply(response, rec.index, default_in)
            elif wire == "anthropic":
                events = render_anthropic(response, message_id=ident,
                                          default_input_tokens=default_in)
            else:
                events = render_openai(response, completion_id=ident,
                                       default_input_tokens=default_in)
            return _Plan(200, [*_SSE_HEADERS, *self._request_headers(rec)], events, paced=True)
        if isinstance(response, Streamed):
            return _Plan(response.status, [*response.headers, *self._request_headers(rec)],
                         response.events, ending="close" if response.close_after_body else "end",
                         paced=response.paced)
        if isinstance(response, Fixture):
            full, entry = _fixture_entry(response.path, self.fixtures_dir)
            data = _fixture_bytes(full)
            status = response.status if response.status is not None else int(
                entry.get("status", 200))
            headers = dict(response.headers if response.headers is not None
                           else entry.get("headers", {}))
            close = (response.close_after_body if response.close_after_body is not None
                     else bool(entry.get("close_after_body", False)))
            if full.suffix == ".sse":
                return _Plan(status, list(headers.items()), _split_events(data),
                             ending="close" if close else "end")
            return _Plan(status, list(headers.items()), body=data)
        if isinstance(response, ErrorReply):
            body = response.body
            if isinstance(body, Mapping):
                body = _dumps(body)
            if isinstance(body, str):
                body = body.encode()
            headers = {"content-type": _JSON, **response.headers}
            return _Plan(response.status, list(headers.items()), body=body)
        if isinstance(response, WireError):
            headers = {"content-type": _JSON, **response.headers}
            return _Plan(response.status, list(headers.items()),
                         body=_wire_error_body(wire, response.error_type, response.message))
        if isinstance(response, Hang):
            return _Plan(200, list(_SSE_HEADERS), ending="hang")
        if isinstance(response, SlowFirstByte):
            plan = self._plan(response.reply, rec)
            plan.first_byte_delay += response.delay_s
            return plan
        if isinstance(response, Paused):
            plan = self._streamed_plan(response.reply, rec)
            plan.pause = (response.after_events, response.resume)
            return plan
        if isinstance(response, DropAfter):
            plan = self._streamed_plan(response.reply, rec)
            plan.events = list(plan.events or ())[: response.after_events]
            plan.ending = "close" if plan.ending == "close" else "drop"
            return plan
        if isinstance(response, KeepAlives):
            plan = self._streamed_plan(
                response.reply or Reply([Text("This reply never comes")]), rec)
            plan.events = list(plan.events or ())[: response.after_events]
            plan.ending = "keepalive"
            plan.keepalive = _keepalive_bytes(wire, response.style)
            plan.keepalive_every_s = response.every_s
            plan.keepalive_for_s = response.for_s
            return plan
        if isinstance(response, MidStreamError):
            plan = self._streamed_plan(response.reply, rec)
            message = response.message or _MIDSTREAM_MESSAGES.get(
                response.error_type, response.error_type)
            if wire == "anthropic":
                err = _anthropic_event("error", {"type": "error", "error": {
                    "details": None, "type": response.error_type, "message": message}})
            elif wire == "responses":
                code = "server_error" if response.error_type in _MIDSTREAM_MESSAGES else (
                    response.error_type)
                err = responses_error_event(code, message)
            else:
                err = _openai_event(_openai_error_body(response.error_type, message))
            plan.events = [*list(plan.events or ())[: response.after_events], SSEEvent(err)]
            return plan
        # MalformedJSON
        source = response.reply or Reply([Text("This reply is cut by malformed JSON")])
        plan = self._streamed_plan(source, rec)
        if wire == "anthropic":
            bad = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                   b'"delta":{"type":"text_delta","text":"broken}\n\n')
        elif wire == "responses":
            bad = (b'event: response.output_text.delta\ndata: {"type":"response.output_text'
                   b'.delta","output_index":0,"delta":"broken}\n\n')
        else:
            bad = b'data: {"id":"chatcmpl-mock","choices":[{"index":0,"delta":{"content":\n\n'
        plan.events = [*list(plan.events or ())[: response.after_events], SSEEvent(bad)]
        return plan

    def _streamed_plan(self, source: StreamSource, rec: RecordedRequest) -> _Plan:
        if isinstance(source, Reply) and not rec.stream:
            rec = RecordedRequest(rec.index, rec.method, rec.path, rec.headers, rec.raw_body,
                                  {**(rec.body if isinstance(rec.body, dict) else {}),
                                   "stream": True}, rec.wire, rec.received_at)
        plan = self._plan(source, rec)
        if plan.events is None:
            raise TypeError(f"{type(source).__name__} does not produce an SSE stream here")
        return plan

    # -- writing -----------------------------------------------------------------------------

    def _framer(self, chunked: bool, index: int) -> Callable[[bytes], list[bytes]]:
        """Turn body bytes into wire pieces: HTTP chunks (split per ``rechunk``) or, without
        chunked framing, the raw pieces."""
        rechunk = self.rechunk
        rng = random.Random(f"{self.seed}:{index}") if rechunk == "random" else None

        def pieces(data: bytes) -> list[bytes]:
            if not data:
                return []
            if rechunk is None:
                return [data]
            out = []
            i = 0
            while i < len(data):
                step = rng.randint(1, _RANDOM_PIECE_MAX) if rng is not None else int(rechunk)
                out.append(data[i : i + max(1, step)])
                i += max(1, step)
            return out

        if not chunked:
            return pieces

        def frame(data: bytes) -> list[bytes]:
            return [b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces(data))] if data else []

        return frame

    async def _send(
        self, conn: h11.Connection, stream: trio.abc.Stream, plan: _Plan,
        rec: RecordedRequest | None,
    ) -> bool:
        """Write one response; True if the connection may be reused."""
        if plan.first_byte_delay > 0:
            await trio.sleep(plan.first_byte_delay)
        index = rec.index if rec is not None else 0
        if plan.ending == "close":
            lines = [b"HTTP/1.1 %d %b\r\n" % (plan.status, _reason(plan.status))]
            lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in plan.headers
                      if k.lower() not in ("content-length", "transfer-encoding", "connection")]
            lines.append(b"connection: close\r\n\r\n")
            await stream.send_all(b"".join(lines))
            body = b"".join(e.data for e in plan.events or ()) if plan.events else plan.body
            for piece in self._framer(False, index)(body):
                await stream.send_all(piece)
            return False
        headers = [(k, v) for k, v in plan.headers if k.lower() != "content-length"]
        if plan.events is None and plan.ending != "hang":
            headers.append(("content-length", str(len(plan.body))))
            out = conn.send(h11.Response(status_code=plan.status, headers=headers,
                                         reason=_reason(plan.status)))
            out += conn.send(h11.Data(data=plan.body)) + conn.send(h11.EndOfMessage())
            await stream.send_all(out)
            return True
        head = conn.send(h11.Response(status_code=plan.status, headers=headers,
                                      reason=_reason(plan.status)))
        if plan.ending == "hang":
            await stream.send_all(head)
            while await stream.receive_some(65536):
                pass
            return False
        chunked = conn.their_http_version != b"1.0"
        frame = self._framer(chunked, index)
        tail = b""
        if plan.ending == "end":
            tail = conn.send(h11.EndOfMessage())  # b"0\r\n\r\n" when chunked
        events = plan.events or ()
        if plan.pause is not None:
            after, resume = plan.pause
            await self._write_events(stream, head, events[:after], frame, b"", plan.paced)
            await resume.wait()
            head, events = b"", events[after:]
        await self._write_events(stream, head, events, frame, tail, plan.paced)
        if plan.ending == "keepalive":
            # Until the client gives up (a send to a closed connection ends the handler) or
            # the time is up: then the body is cut, the connection closed.
            until = trio.current_time() + plan.keepalive_for_s
            while trio.current_time() + plan.keepalive_every_s <= until:
                await trio.sleep(plan.keepalive_every_s)
                await stream.send_all(b"".join(frame(plan.keepalive)))
            return False
        return plan.ending == "end"

    async def _write_events(
        self,
        stream: trio.abc.Stream,
        head: bytes,
        events: Sequence[SSEEvent],
        frame: Callable[[bytes], list[bytes]],
        tail: bytes,
        paced: bool,
    ) -> None:
        first_s = self.first_token_ms / 1000 if paced else 0.0
        delay_s = self.token_delay_ms / 1000 if paced else 0.0
        if first_s <= 0 and delay_s <= 0:
            await stream.send_all(b"".join([head, *frame(b"".join(e.data for e in events)),
                                            tail]))
            return
        # Absolute deadlines; events already due when we wake are batched into one write.
        clock = trio.current_time
        pacer = self._pacer
        # trio's stdlib socket, for the fast path (none under TLS: writes go through it)
        raw = getattr(getattr(stream, "socket", None), "_sock", None)
        if pacer is not None and raw is not None:
            await self._write_through_pacer(pacer, stream, raw, head, events, frame, tail,
                                            first_s, delay_s)
            return
        start = now = clock()
        prefix = head
        buf: list[bytes] = []
        for ev, deadline in zip(events, _deadlines(events, start, first_s, delay_s), strict=True):
            if deadline > now:
                if buf or prefix:
                    data = b"".join([prefix, *frame(b"".join(buf))])
                    prefix, buf = b"", []
                    sent = _try_send(raw, data)
                    if sent < len(data):
                        await stream.send_all(data[sent:])
                if pacer is not None:
                    await pacer.sleep_until(deadline)
                else:
                    await trio.sleep_until(deadline)
                now = clock()
            buf.append(ev.data)
        await stream.send_all(b"".join([prefix, *frame(b"".join(buf)), tail]))


    async def _write_through_pacer(
        self,
        pacer: _Pacer,
        stream: trio.abc.Stream,
        raw: Any,
        head: bytes,
        events: Sequence[SSEEvent],
        frame: Callable[[bytes], list[bytes]],
        tail: bytes,
        first_s: float,
        delay_s: float,
    ) -> None:
        """What the loop of :meth:`_write_events` sends, with the same deadlines and the
        same batching of the events due at each wake, written by the pacer's own task: the
        stream's task sleeps until its body is written (or the socket is full)."""
        start = trio.current_time()
        deadlines = _deadlines(events, start, first_s, delay_s)
        first = 0
        while first < len(events) and deadlines[first] <= start:
            first += 1
        due = b"".join(e.data for e in events[:first])
        if first == len(events):
            await stream.send_all(b"".join([head, *frame(due), tail]))
            return
        data = b"".join([head, *frame(due)])
        if data:
            sent = _try_send(raw, data)
            if sent < len(data):
                await stream.send_all(data[sent:])
        await pacer.write(_PacedBody(raw, events, deadlines, first, frame, tail), stream)


def _deadlines(
    events: Sequence[SSEEvent], start: float, first_s: float, delay_s: float
) -> list[float]:
    """When each event of a paced body is due: the first content event ``first_s`` after
    ``start``, each delta after the first ``delay_s`` after the one before, every other
    event with the event before it."""
    deadlines: list[float] = []
    deadline = start
    seen_content = seen_delta = False
    for ev in events:
        if ev.content and not seen_content:
            seen_content = True
            deadline = max(deadline, start + first_s)
        if ev.delta:
            if seen_delta:
                deadline += delay_s
            seen_delta = True
        deadlines.append(deadline)
    return deadlines


def _keepalive_bytes(wire: Wire, style: KeepAliveStyle) -> bytes:
    if style == "comment":
        return b": keep-alive\n\n"
    if style == "blank":
        return b"\n"
    if wire == "anthropic":
        return _anthropic_event("ping", {"type": "ping"})
    if wire == "responses":
        return (b'event: response.in_progress\ndata: {"type":"response.in_progress",'
                b'"response":{"id":"resp_mock","object":"response","status":"in_progress"}}\n\n')
    return _openai_event({"id": "chatcmpl-mock", "object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": {}, "finish_reason": None}]})


def _try_send(sock: Any, data: bytes) -> int:
    """Paced writes are small and the socket buffer nearly always has room: one non-blocking
    ``send`` on the stdlib socket costs a fraction of ``SocketStream.send_all`` (which
    schedules twice). Returns how many bytes went out; the caller sends the rest normally.
    The task still yields at every pacing wait."""
    if sock is None:
        return 0
    try:
        return int(sock.send(data))
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError as exc:
        raise trio.BrokenResourceError(str(exc)) from exc


@asynccontextmanager
async def open_mock_server(*responses: Response, **options: Any) -> AsyncIterator[MockModelServer]:
    """Run a :class:`MockModelServer` (``options`` are its keyword parameters) in a nursery
    for the duration of the block; it is listening when the block starts."""
    server = MockModelServer(responses, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# Subprocess entry point
# ---------------------------------------------------------------------------------------------


def _parse_rechunk(value: str) -> Rechunk:
    if value == "random":
        return "random"
    return int(value)


async def _run_cli(server: MockModelServer) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        print(f"PORT {port}", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.support.mock_model_server``: see the module docstring."""
    parser = argparse.ArgumentParser(description="greenroom loopback mock model server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workload", choices=["reference", "none"], default="reference")
    parser.add_argument("--text-tokens", type=int, default=200)
    parser.add_argument("--tool-calls", type=int, default=2)
    parser.add_argument("--fragments", type=int, default=3)
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--first-token-ms", type=float, default=0.0)
    parser.add_argument("--rechunk", type=_parse_rechunk, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--require-api-key", default=None)
    parser.add_argument("--no-invariants", action="store_true")
    parser.add_argument("--tool-rounds", type=int, default=1)
    parser.add_argument("--title-tokens", type=int, default=None)
    parser.add_argument("--max-streams", type=int, default=None)
    parser.add_argument("--limit-retry-after", type=float, default=1.0)
    parser.add_argument(
        "--tls", nargs=2, metavar=("CERT", "KEY"), default=None, help="serve HTTPS"
    )
    args = parser.parse_args(argv)
    tls: ssl.SSLContext | None = None
    if args.tls:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(*args.tls)
    fallback: Handler | None = None
    if args.workload == "reference":
        fallback = Workload(args.text_tokens, args.tool_calls, args.fragments,
                            rounds=args.tool_rounds, title_tokens=args.title_tokens)
    server = MockModelServer(
        fallback=fallback,
        host=args.host,
        port=args.port,
        require_api_key=args.require_api_key,
        rechunk=args.rechunk,
        seed=args.seed,
        first_token_ms=args.first_token_ms,
        token_delay_ms=args.token_delay_ms,
        check_invariants=not args.no_invariants,
        record=False,
        log_problems=True,
        max_streams=args.max_streams,
        limit_retry_after=args.limit_retry_after,
        tls=tls,
    )
    trio.run(_run_cli, server)
    print(
        f"STATS requests={server.request_count} violations={len(server.violations)} "
        f"errors={len(server.errors)} connections={server.connections_total} "
        f"rate_limited={server.rate_limited} peak_streams={server.peak_streams}",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
