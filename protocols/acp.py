"""The Agent Client Protocol (ACP, protocol version 1) for ``greenroom acp``. No I/O.

Editors (Zed and other ACP clients) start ``greenroom acp`` and speak newline-delimited
JSON-RPC 2.0 on its stdin and stdout. This module holds what does not wait for anything:

* :class:`LineSplitter` cuts the byte stream into frames (one JSON value per line), and
  :func:`parse_message` reads one frame as a call, a response to one of our own requests,
  or a :class:`~greenroom.protocols.jsonrpc.FrameError` that already holds its answer.
  Neither ever raises: every malformed frame gets an error answer and the connection stays
  — but a malformed notification (:class:`BadNotification`), which JSON-RPC answers never.
* The ``params`` readers (:func:`parse_new_session`, :func:`parse_prompt`, …) raise
  :class:`~greenroom.protocols.jsonrpc.RpcError` (``-32602``) naming the bad value as a
  ``$.path``.
* :class:`UpdateMapper` turns greenroom outputs into ``session/update`` payloads, the same
  way for a live task and for the replay of a stored trace (``session/load``). Outputs of a
  subagent become updates of the parent's ``spawn_subagent`` tool call, never a stream of
  their own. A background subagent (R-TREE-2), whose spawning call returns at once, gets a
  tool call of its own instead (:meth:`UpdateMapper.note`, :data:`BACKGROUND_PREFIX`).
* :func:`stop_reason` maps a ``task_end`` to the ``{stopReason}`` answer of
  ``session/prompt``, or to the JSON-RPC error of a failed task.
* :func:`commands_update` advertises slash commands (the session's MCP prompts, R-MCP-5)
  as an ``available_commands_update``.
* The editor's files and terminal, modes, the session list and usage (R-ACP-2):
  :func:`editor_capabilities` reads what ``initialize`` offers, :func:`client_result` and
  its readers check the editor's answers, :func:`diff_content` and
  :func:`terminal_content` are what a call shows (:meth:`UpdateMapper.attach`);
  :func:`modes_state`, :func:`parse_set_mode`; :func:`parse_list_sessions`,
  :func:`sessions_page`, :func:`session_info`; :func:`prompt_usage`, :func:`usage_update`.

Invariants: every tool call the client is told about (``tool_call``) ends with one
``tool_call_update`` whose status is ``completed`` or ``failed`` — denied, interrupted and
truncated calls too; a session id in a frame is checked before it names a directory.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, assert_never

import attrs

from greenroom.protocols.content import ImageBlock, TextBlock, ThinkingBlock, ToolCallBlock
from greenroom.protocols.jsonrpc import (
    DROPPED,
    GONE,
    IN_DOUBT,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    PARSE_ERROR,
    UNAVAILABLE,
    Call,
    FrameError,
    RequestId,
    RpcError,
    decode_json,
    json_type,
    parse_call,
)
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    Rewind,
    SteeringQueuedOutput,
    TaskEnd,
    TaskQueuedOutput,
    TaskQueueDropped,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    ToolHook,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.people import Verdict
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.text import repair_json
from greenroom.protocols.tools import value_too_deep

PROTOCOL_VERSION = 1
"""The ACP version greenroom speaks; every ``initialize`` is answered with it."""

AUTH_REQUIRED = -32000
"""ACP's code for a failure of authentication (here: the model provider's credentials)."""
RESOURCE_NOT_FOUND = -32002
"""ACP's code for an unknown resource: a session id this connection does not know."""

MAX_FRAME_BYTES = 64 << 20
"""Longest frame read (images travel inline as base64); a longer line is answered -32600."""
MAX_DEPTH = 64
"""How deeply a frame may nest arrays and objects."""

META_KEY = "greenroom"
"""The key of greenroom's own fields inside an ACP ``_meta`` object."""

BACKGROUND_PREFIX = "subagent:"
"""The ``toolCallId`` of a background subagent's own tool call is this prefix and the
subagent's session id (its node id, for ``_greenroom/steer``)."""

StopReason = Literal["end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled"]
ToolKind = Literal["read", "edit", "delete", "move", "search", "execute", "think", "fetch", "other"]

TOOL_KINDS: dict[str, ToolKind] = {
    "read_file": "read",
    "list_dir": "read",
    "search_files": "search",
    "write_file": "edit",
    "run_shell": "execute",
}
"""The ACP kind of each built-in tool (icons in the editor); other tools are ``other``."""

PERMISSION_OPTIONS: tuple[dict[str, str], ...] = (
    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
    {"optionId": "allow_session", "name": "Always allow in this session", "kind": "allow_always"},
    {"optionId": "deny", "name": "Deny", "kind": "reject_once"},
)
"""The options of every ``session/request_permission``; the option id is the verdict."""

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


# -- frames ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True, slots=True)
class Response:
    """The client's answer to a request greenroom sent (``session/request_permission``):
    ``result`` or ``error`` (the error object as sent)."""

    id: RequestId
    result: Any = None
    error: dict[str, Any] | None = None


@attrs.frozen(kw_only=True, slots=True)
class BadNotification:
    """A notification (a ``method`` name and no ``id``) that is not a valid call: never
    answered — JSON-RPC 2.0 answers no notification, not even on error, and an error with
    a null id would answer none of the client's requests — only logged. ``method`` is cut
    to be echoed."""

    method: str
    error: RpcError


Message = Call | Response | FrameError | BadNotification


TOO_LONG_HEAD_BYTES = 4096
"""How much of the start of a dropped over-long line is kept: enough for the ``id`` and
the keys before the long value, which :func:`too_long_error` answers by."""


@attrs.frozen(kw_only=True, slots=True)
class TooLong:
    """A line longer than the splitter's limit; its bytes were dropped but for its first
    :data:`TOO_LONG_HEAD_BYTES` (``head``)."""

    size: int
    head: bytes = b""


class LineSplitter:
    """Cuts a byte stream into lines (without their ``\\n``), in order. A line longer than
    ``max_bytes`` is dropped and reported once as :class:`TooLong`; the next line is read
    normally. ``close()`` returns what followed the last newline, if anything."""

    __slots__ = ("_buffer", "_dropping", "_head", "_max", "_skipped")

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_bytes
        self._dropping = False
        self._skipped = 0
        self._head = b""

    def feed(self, data: bytes) -> list[bytes | TooLong]:
        """The lines and :class:`TooLong` reports completed by ``data``, in order; an unfinished
        line is kept for the next call."""
        out: list[bytes | TooLong] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            piece = data[start:end]
            if self._dropping:
                out.append(TooLong(size=self._skipped + len(piece), head=self._head))
                self._dropping = False
                self._skipped = 0
            elif len(self._buffer) + len(piece) > self._max:
                size = len(self._buffer) + len(piece)
                out.append(TooLong(size=size, head=self._head_of(piece)))
                self._buffer.clear()
            else:
                self._buffer += piece
                out.append(bytes(self._buffer))
                self._buffer.clear()
            start = end + 1
        rest = data[start:]
        if self._dropping:
            self._skipped += len(rest)
        elif len(self._buffer) + len(rest) > self._max:
            self._dropping = True
            self._skipped = len(self._buffer) + len(rest)
            self._head = self._head_of(rest)
            self._buffer.clear()
        else:
            self._buffer += rest
        return out

    def _head_of(self, rest: bytes) -> bytes:
        """The first :data:`TOO_LONG_HEAD_BYTES` of the line buffered so far and ``rest``."""
        head = bytes(self._buffer[:TOO_LONG_HEAD_BYTES])
        return head + rest[: TOO_LONG_HEAD_BYTES - len(head)]

    def close(self) -> list[bytes | TooLong]:
        """What is left at end of stream: the unterminated last line unless it is only whitespace,
        or a :class:`TooLong` when that line was over the limit."""
        if self._dropping:
            return [TooLong(size=self._skipped, head=self._head)]
        rest = bytes(self._buffer)
        self._buffer.clear()
        return [rest] if rest.strip() else []


def too_long_error(frame: TooLong) -> FrameError | Response:
    """What a dropped over-long line is, read from its start (``frame.head``): a request
    is answered -32600 with its ``id`` (its sender waits for that answer: a prompt with
    too large an image, say), a line whose id cannot be read with a null id; the client's
    answer to one of our requests (a text read for a tool, too large) is that answer,
    an error saying so, so the request fails at once rather than wait for an answer that
    was dropped."""
    message = f"frame of {frame.size} bytes, larger than {MAX_FRAME_BYTES}"
    keys = _leading_keys(frame.head)
    frame_id = keys.get("id")
    known_id = isinstance(frame_id, str | int) and not isinstance(frame_id, bool)
    if known_id and "method" not in keys and ("result" in keys or "error" in keys):
        said = f"the answer was a {message}, and was not read"
        return Response(id=frame_id, error={"code": INVALID_REQUEST, "message": said})
    # A head with a method and no id is not known to be a notification: the head is cut
    # within a value, and an id may follow it (object keys have no order). JSON-RPC answers
    # a message whose id cannot be read with a null id, as a parse error may have been a
    # notification too; silence would hide from a request's sender that it was dropped.
    return FrameError(id=frame_id if known_id else None, error=RpcError(INVALID_REQUEST, message))


def _leading_keys(head: bytes) -> dict[str, Any]:
    """The top-level keys of a JSON object whose text starts with ``head`` (the rest
    unknown), up to the first value that does not end within it: each with its value,
    or ``...`` for that last one."""
    text = head.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    keys: dict[str, Any] = {}
    at = _skip_space(text, 0)
    if not text.startswith("{", at):
        return keys
    at += 1
    try:
        while True:
            at = _skip_space(text, at)
            key, at = decoder.raw_decode(text, at)
            at = _skip_space(text, at)
            if not isinstance(key, str) or not text.startswith(":", at):
                return keys
            keys[key] = ...
            value, at = decoder.raw_decode(text, _skip_space(text, at + 1))
            at = _skip_space(text, at)
            if not text.startswith((",", "}"), at):
                return keys  # maybe cut short (a number): its value is not known
            keys[key] = value
            if text.startswith("}", at):
                return keys
            at += 1
    except ValueError:  # cut within a key or a value: what was read is all there is
        return keys


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def parse_message(line: bytes) -> Message:
    """One frame: a request or notification from the client, a response to one of our
    requests, a :class:`BadNotification` (answered by nothing), or a :class:`FrameError`
    holding the answer (-32700 for text that is not UTF-8 JSON, -32600 for JSON that is
    not a message; batches are not part of ACP)."""
    try:
        text = line.decode("utf-8")
        # NaN, 1e999 (read as infinity) and 5,000-digit integers could not be written
        # back as JSON, to the editor or to a provider: refused as a gateway frame is.
        value = decode_json(text)
    except (ValueError, RecursionError) as exc:
        return FrameError(id=None, error=RpcError(PARSE_ERROR, f"parse error: {exc}"))
    if value_too_deep(value, MAX_DEPTH):
        return FrameError(
            id=None, error=RpcError(INVALID_REQUEST, f"nested deeper than {MAX_DEPTH} levels")
        )
    value = repair_json(value)
    if isinstance(value, list):
        return FrameError(
            id=None,
            error=RpcError(INVALID_REQUEST, "batches are not part of ACP: one message a line"),
        )
    if (
        isinstance(value, dict)
        and "method" not in value
        and ("result" in value or "error" in value)
    ):
        return _response(value)
    call = parse_call(value)
    if (
        isinstance(call, FrameError)
        and isinstance(value, dict)
        and "id" not in value
        and isinstance(value.get("method"), str)
    ):
        return BadNotification(method=_clip(value["method"], 80), error=call.error)
    return call


def _response(value: dict[str, Any]) -> Message:
    raw_id = value.get("id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int):
        return FrameError(
            id=None, error=RpcError(INVALID_REQUEST, "$.id: a response needs the id it answers")
        )
    error = value.get("error")
    if error is not None and not isinstance(error, dict):
        return FrameError(
            id=None,
            error=RpcError(INVALID_REQUEST, f"$.error: expected an object, got {json_type(error)}"),
        )
    return Response(id=raw_id, result=value.get("result"), error=error)


def request_frame(request_id: int, method: str, params: Any) -> dict[str, Any]:
    """A request from the agent to the client (``session/request_permission``, …)."""
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


# -- params ----------------------------------------------------------------------------------


def invalid(path: str, message: str) -> RpcError:
    """An invalid-params error (-32602) whose message starts with the ``$.path`` at fault."""
    return RpcError(INVALID_PARAMS, f"{path}: {message}")



def dropped(reason: str) -> RpcError:
    """The error for ``_greenroom/steer`` whose steering will never run, ``reason`` saying
    why (R-STEER-1, R-STEER-6): its session closed, or its work stopped, before recording
    it. Code and words as the gateway's answer for such input: nothing of it runs, so the
    editor may send it again."""
    return RpcError(GONE, f"{DROPPED}: {reason}")


def in_doubt(reason: str) -> RpcError:
    """The error for a prompt, steering or follow-up whose record may or may not have
    survived the host, ``reason`` saying why (R-STEER-6, R-CLUSTER-2): a cluster host gave
    the session up while the record was on its way to the cluster's trace, and NATS did
    not say whether it stored it, or the disk did not confirm it durable in time. Not a
    turn's ``cancelled``: the host that takes the session up may run it, and an editor that
    sent it again could have it run twice. Code and ``data.outcome`` as the gateway's
    answer for such input."""
    return RpcError(
        UNAVAILABLE,
        f"{IN_DOUBT}: {reason}. The session's history (session/load) shows whether it was "
        "(a turn that runs it); sending it again may run it twice",
        {"outcome": "unknown"},
    )


def negotiate_version(params: Mapping[str, Any]) -> int:
    """The version to answer ``initialize`` with: ours, whatever the client asked for
    (ACP: the agent answers the client's version when it supports it, else its latest).
    Raises -32602 when ``protocolVersion`` is missing."""
    if "protocolVersion" not in params:
        raise invalid("$.protocolVersion", "required")
    return PROTOCOL_VERSION


def initialize_result(version: str) -> dict[str, Any]:
    """greenroom's answer to ``initialize``: sessions can be loaded, listed, forked and
    closed, prompts may carry images and embedded context, MCP servers may be given over
    stdio and HTTP."""
    return {
        "protocolVersion": PROTOCOL_VERSION,
        "agentCapabilities": {
            "loadSession": True,
            "sessionCapabilities": {"fork": {}, "list": {}, "close": {}},
            "promptCapabilities": {"image": True, "audio": False, "embeddedContext": True},
            "mcpCapabilities": {"http": True, "sse": False},
        },
        "agentInfo": {"name": "greenroom", "title": "greenroom", "version": version},
        "authMethods": [],
    }


def require_str(params: Mapping[str, Any], name: str) -> str:
    """``params[name]``: a non-empty string. Raises an :class:`RpcError` (-32602) otherwise."""
    value = params.get(name)
    if value is None:
        raise invalid(f"$.{name}", "required")
    if not isinstance(value, str) or not value:
        raise invalid(f"$.{name}", f"expected a non-empty string, got {json_type(value)}")
    return value


def session_id_of(params: Mapping[str, Any]) -> str:
    """``$.sessionId``, checked to be a greenroom session id (it names a directory)."""
    value = require_str(params, "sessionId")
    if len(value) > 200 or not _SESSION_ID.fullmatch(value):
        raise RpcError(RESOURCE_NOT_FOUND, f"no session {value!r}")
    return value


@attrs.frozen(kw_only=True, slots=True)
class NewSession:
    """``session/new`` (and the shared part of ``session/load``)."""

    cwd: str
    mcp_servers: tuple[dict[str, Any], ...]


def parse_new_session(params: Mapping[str, Any]) -> NewSession:
    """The checked parameters of ``session/new``: an absolute ``cwd``, ``mcpServers`` an array of
    objects with a ``name``. Raises an :class:`RpcError` (-32602) naming the first bad field."""
    cwd = require_str(params, "cwd")
    if not posixpath.isabs(cwd):
        raise invalid("$.cwd", f"must be an absolute path, got {cwd!r}")
    return NewSession(cwd=cwd, mcp_servers=_mcp_servers(params.get("mcpServers", [])))


@attrs.frozen(kw_only=True, slots=True)
class ForkSession:
    """``session/fork``: the session to fork, where (``_meta.greenroom.atSeq``, greenroom's
    extension: the last record the fork keeps; None: the last), and the new session's
    ``cwd`` and ``mcpServers`` as for ``session/new``."""

    session_id: str
    at_seq: int | None
    new: NewSession


def parse_fork_session(params: Mapping[str, Any]) -> ForkSession:
    """The checked parameters of ``session/fork`` (R-FORK-1). Raises an :class:`RpcError`
    naming the first bad field."""
    session_id = session_id_of(params)
    meta = params.get("_meta")
    ours = meta.get(META_KEY) if isinstance(meta, Mapping) else None
    at_seq = ours.get("atSeq") if isinstance(ours, Mapping) else None
    if at_seq is not None and (
        not isinstance(at_seq, int) or isinstance(at_seq, bool) or at_seq < 0
    ):
        raise invalid(f"$._meta.{META_KEY}.atSeq", "expected an integer of at least 0")
    return ForkSession(session_id=session_id, at_seq=at_seq, new=parse_new_session(params))


def _mcp_servers(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list):
        raise invalid("$.mcpServers", f"expected an array, got {json_type(value)}")
    servers: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid(f"$.mcpServers[{i}]", f"expected an object, got {json_type(item)}")
        if not isinstance(item.get("name"), str) or not item["name"]:
            raise invalid(f"$.mcpServers[{i}].name", "required")
        servers.append(item)
    return tuple(servers)


def mcp_servers_config(servers: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The client's ``mcpServers`` in greenroom's ``{"NAME": {...}}`` shape (the shape of
    an ``--mcp-config`` file): stdio servers as ``{command, args, env}``, HTTP ones as
    ``{type: http, url, headers}``."""
    config: dict[str, dict[str, Any]] = {}
    for server in servers:
        name = str(server["name"])
        if server.get("type") in ("http", "sse"):
            config[name] = {
                "type": server["type"],
                "url": server.get("url", ""),
                "headers": {
                    str(h.get("name")): str(h.get("value"))
                    for h in server.get("headers", [])
                    if isinstance(h, dict)
                },
            }
        else:
            config[name] = {
                "command": server.get("command", ""),
                "args": [str(a) for a in server.get("args", [])],
                "env": {
                    str(e.get("name")): str(e.get("value"))
                    for e in server.get("env", [])
                    if isinstance(e, dict)
                },
            }
    return config


@attrs.frozen(kw_only=True, slots=True)
class InlineImage:
    """An image of a prompt, as the client sent it (base64); the agent stores it as a file
    and gives the model an :class:`~greenroom.protocols.content.ImageBlock`."""

    data: str
    mime_type: str


@attrs.frozen(kw_only=True, slots=True)
class LinkedResource:
    """A ``resource_link`` of a prompt: the agent reads it when one of the session's MCP
    servers lists ``uri`` (R-MCP-5), else gives the model ``text``, a line naming it."""

    uri: str
    text: str


PromptPart = TextBlock | InlineImage | LinkedResource


def parse_prompt(params: Mapping[str, Any], name: str = "prompt") -> tuple[PromptPart, ...]:
    """The content blocks of a prompt: text, images, resource links (:class:`LinkedResource`)
    and embedded resources (their text; an embedded image becomes an image). Audio is
    refused: ``promptCapabilities.audio`` is false."""
    value = params.get(name)
    path = f"$.{name}"
    if not isinstance(value, list):
        raise invalid(path, f"expected an array of content blocks, got {json_type(value)}")
    if not value:
        raise invalid(path, "must not be empty")
    parts: list[PromptPart] = []
    for i, block in enumerate(value):
        item = f"{path}[{i}]"
        if not isinstance(block, dict):
            raise invalid(item, f"expected an object, got {json_type(block)}")
        kind = block.get("type")
        if kind == "text":
            parts.append(TextBlock(text=_field(block, "text", item)))
        elif kind == "image":
            parts.append(
                InlineImage(
                    data=_field(block, "data", item), mime_type=_field(block, "mimeType", item)
                )
            )
        elif kind == "resource_link":
            uri = _field(block, "uri", item)
            label = block.get("name") if isinstance(block.get("name"), str) else uri
            parts.append(LinkedResource(uri=uri, text=f"[resource: {label}] {uri}"))
        elif kind == "resource":
            parts.append(_embedded(block.get("resource"), f"{item}.resource"))
        elif kind == "audio":
            raise invalid(f"{item}.type", "audio prompts are not supported")
        else:
            raise invalid(f"{item}.type", f"unknown content block type {kind!r}")
    return tuple(parts)


def _field(block: Mapping[str, Any], name: str, path: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise invalid(f"{path}.{name}", f"expected a string, got {json_type(value)}")
    return value


def _embedded(resource: Any, path: str) -> PromptPart:
    if not isinstance(resource, dict):
        raise invalid(path, f"expected an object, got {json_type(resource)}")
    uri = _field(resource, "uri", path)
    if isinstance(resource.get("text"), str):
        return TextBlock(text=f"[resource: {uri}]\n{resource['text']}\n[/resource]")
    blob = _field(resource, "blob", path)
    mime = resource.get("mimeType")
    if isinstance(mime, str) and mime.startswith("image/"):
        return InlineImage(data=blob, mime_type=mime)
    return TextBlock(text=f"[resource: {uri} ({mime or 'binary'}), not shown]")


@attrs.frozen(kw_only=True, slots=True)
class SlashCommand:
    """A command the editor offers as ``/name``: ``hint`` says what to type after it
    (None: it takes no input)."""

    name: str
    description: str
    hint: str | None = None


def commands_update(commands: Iterable[SlashCommand]) -> dict[str, Any]:
    """The ``available_commands_update`` of ``session/update`` that offers ``commands``."""
    listed: list[dict[str, Any]] = []
    for command in commands:
        item: dict[str, Any] = {"name": command.name, "description": command.description}
        if command.hint is not None:
            item["input"] = {"hint": command.hint}
        listed.append(item)
    return {"sessionUpdate": "available_commands_update", "availableCommands": listed}


# -- outputs → session/update ----------------------------------------------------------------


ImageLoader = Callable[[ImageBlock], tuple[str, str] | None]
"""``(media_type, base64 data)`` of an image block, or None when it cannot be read."""


def tool_kind(name: str) -> ToolKind:
    """The ACP kind of tool ``name`` (see :data:`TOOL_KINDS`); ``other`` for any other tool."""
    return TOOL_KINDS.get(name, "other")


def tool_title(call: ToolCallBlock) -> str:
    """What the editor shows for a call: ``Read notes.txt``, ``Run `make test```, …"""
    args = call.arguments

    def arg(key: str, default: str = "") -> str:
        value = args.get(key, default)
        return _clip(value if isinstance(value, str) else json.dumps(value), 80)

    if call.name == "read_file":
        return f"Read {arg('path')}"
    if call.name == "list_dir":
        return f"List {arg('path', '.')}"
    if call.name == "search_files":
        return f"Search {arg('pattern')} in {arg('path', '.')}"
    if call.name == "write_file":
        return f"Write {arg('path')}"
    if call.name == "run_shell":
        return f"Run `{arg('command')}`"
    if call.name == "spawn_subagent":
        return f"Subagent: {arg('task')}"
    shown = call.invalid_arguments or json.dumps(args, ensure_ascii=False)
    return f"{call.name} {_clip(shown, 80)}"


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@attrs.define
class _Call:
    name: str
    origin: tuple[str, ...] | None
    anchor: str
    """The id the client knows the call by: its own, or the ``spawn_subagent`` call that
    runs the subagent it belongs to."""
    closed: bool = False


@attrs.define
class _Child:
    anchor: str
    lines: list[str] = attrs.Factory(list)


@attrs.define
class _Background:
    """A background subagent of the session, shown on its own call until it ends."""

    anchor: str
    name: str
    lines: list[str] = attrs.Factory(list)


class UpdateMapper:
    """Turns the outputs of one session into ``session/update`` payloads (the ``update``
    object of each notification), in order.

    ``live`` is False for the replay of a stored trace: then the user's messages are sent
    as ``user_message_chunk`` and complete blocks as chunks (a live task's user input is the
    client's own, and its text arrives as ``partial_*`` first). ``workspace`` makes the
    ``locations`` of file tools absolute; ``load_image`` reads images of user messages and
    tool results (none given: images are named in text).
    """

    CHILD_LINES = 40
    """How many lines of a subagent's activity its ``spawn_subagent`` call shows."""

    def __init__(
        self,
        *,
        live: bool,
        workspace: str | None = None,
        load_image: ImageLoader | None = None,
    ) -> None:
        self.live = live
        self._workspace = workspace
        self._load_image = load_image
        self._calls: dict[tuple[tuple[str, ...] | None, str], _Call] = {}
        self._by_id: dict[str, _Call] = {}
        self._children: dict[str, _Child] = {}
        self._open_spawns: list[tuple[str, str]] = []  # (call id, task) not yet bound
        # call id → (name, task) of a background spawn whose result is not yet seen
        self._background_spawns: dict[str, tuple[str, str]] = {}
        self._background: dict[str, _Background] = {}  # child id → its own call
        self._titles: dict[str, str] = {}
        self._shown: dict[str, list[dict[str, Any]]] = {}  # call id → content of its own
        self._streamed_text = False
        self._streamed_thinking = False
        self.last_stop_reason: str | None = None
        """The provider's stop reason of the last completed model request (not a subagent's)."""

    def attach(self, call_id: str, content: dict[str, Any]) -> None:
        """Show ``content`` (a ``diff`` or ``terminal``: :func:`diff_content`,
        :func:`terminal_content`) first in every later update of the call ``call_id``
        until the call ends (R-ACP-2: an edit or a command made through the editor)."""
        self._shown.setdefault(call_id, []).append(content)

    # -- lookups for approvals

    def anchor_of(self, call: ToolCallBlock) -> tuple[str, tuple[str, ...] | None] | None:
        """The id the client knows ``call`` by and the call's origin, once its ``model_msg``
        has been mapped; None before."""
        known = self._by_id.get(call.id)
        if known is None:
            return None
        return known.anchor, known.origin

    def permission_params(self, session_id: str, call: ToolCallBlock) -> dict[str, Any]:
        """The params of ``session/request_permission`` for ``call``. A subagent's call is
        asked about on its ``spawn_subagent`` call, with the call itself in ``_meta``."""
        known = self._by_id.get(call.id)
        tool_call: dict[str, Any] = {
            "toolCallId": call.id,
            "title": tool_title(call),
            "kind": tool_kind(call.name),
            "status": "pending",
            "rawInput": _raw_input(call),
        }
        if known is not None and known.origin is not None:
            tool_call["toolCallId"] = known.anchor
            tool_call["title"] = f"Subagent {known.origin[-1]}: {tool_title(call)}"
            tool_call["_meta"] = {
                META_KEY: {"origin": list(known.origin), "callId": call.id, "tool": call.name}
            }
        return {
            "sessionId": session_id,
            "toolCall": tool_call,
            "options": [dict(option) for option in PERMISSION_OPTIONS],
        }

    def question_params(self, session_id: str, call: ToolCallBlock) -> dict[str, Any]:
        """The params of ``session/request_permission`` that ask the model's question
        (``ask_user``, R-HITL-5) of the editor: the question as the title and content;
        one option per choice (``choice:<i>``, kind ``allow_once``) or, without choices,
        :data:`ANSWER_NEXT`; always :data:`NOT_NOW` (kind ``reject_once``). Anchored as
        :meth:`permission_params` anchors a call."""
        question, choices = question_of(call.arguments)
        params = self.permission_params(session_id, call)
        tool_call = params["toolCall"]
        title = _clip(question, 200) or "A question"
        known = self._by_id.get(call.id)
        if known is not None and known.origin is not None:
            title = f"Subagent {known.origin[-1]} asks: {title}"
        tool_call["title"] = title
        tool_call["kind"] = "other"
        content = [_text_content(question)]
        if choices:
            options = [
                {"optionId": f"{CHOICE_PREFIX}{i}", "name": _clip(c, 200), "kind": "allow_once"}
                for i, c in enumerate(choices)
            ]
        else:
            content.append(_text_content(ANSWER_NEXT_NOTE))
            options = [
                {"optionId": ANSWER_NEXT, "name": "Answer in my next message", "kind": "allow_once"}
            ]
        options.append({"optionId": NOT_NOW, "name": "Not now", "kind": "reject_once"})
        tool_call["content"] = content
        params["options"] = options
        return params

    def restore_after_permission(self, call: ToolCallBlock) -> list[dict[str, Any]]:
        """Updates that give a ``spawn_subagent`` call back its own title and kind after a
        permission request about one of its subagent's calls changed them."""
        known = self._by_id.get(call.id)
        if known is None or known.origin is None:
            return []
        title = self._titles.get(known.anchor, "Subagent")
        return [
            {
                "sessionUpdate": "tool_call_update",
                "toolCallId": known.anchor,
                "title": title,
                "kind": "other",
                "status": "in_progress",
            }
        ]

    # -- mapping

    def map(self, output: Output) -> list[dict[str, Any]]:
        """The updates for one output (often none). The outputs of a background subagent
        known to :meth:`note` give none here: :meth:`note` shows them."""
        if output.origin is not None and len(output.origin) > 1:
            if self._is_bg(output.origin):
                return []
            return self._child(output, output.origin)
        match output:
            case UserMsg():
                if self.live:
                    return []
                return [self._user_chunk(block) for block in output.content]
            case PartialText():
                self._streamed_text = True
                return [_chunk("agent_message_chunk", output.text)]
            case PartialThinking():
                self._streamed_thinking = True
                return [_chunk("agent_thought_chunk", output.text)]
            case ModelMsg():
                return self._model_block(output)
            case ApprovalDecision():
                call = self._calls.get((None, output.call_id))
                if output.decision == "allow" and call is not None and not call.closed:
                    return [_status(output.call_id, "in_progress")]
                return []
            case ToolProgress():
                call = self._calls.get((None, output.call_id))
                if call is None or call.closed:
                    return []
                update = _status(output.call_id, "in_progress")
                update["content"] = [*self._shown.get(output.call_id, ()),
                                     _text_content(output.message)]
                return [update]
            case ToolCallOutput():
                return self._tool_output(output)
            case RequestEnd():
                if output.status == "ok":
                    self.last_stop_reason = output.stop_reason
                return []
            case Abort():
                return self._close_open_calls()
            case TaskEnd():
                updates = self._close_open_calls()
                # The task's calls are all settled: a long session keeps no state per call.
                # Background children outlive the task: their calls stay known (approvals).
                self._calls = {k: c for k, c in self._calls.items() if self._is_bg(c.origin)}
                self._by_id = {k: c for k, c in self._by_id.items() if self._is_bg(c.origin)}
                self._children.clear()
                self._titles.clear()
                self._shown.clear()
                return updates
            case (
                TaskStart()
                | RequestBegin()
                | PartialToolCall()
                | TokenUsageOutput()
                | ApprovalRequest()
                | CompactionBegin()
                | CompactionEnd()
                | CallInDoubt()
                | CallResolved()
                | ToolHook()
                | Rewind()
                | TaskQueuedOutput()
                | TaskQueueDropped()
                | SteeringQueuedOutput()
            ):
                # The editor learns of a call from its block, is asked to approve by the
                # agent's own request, and sees no request, usage, compaction or rewind
                # events (an editor cannot take back what it shows; session/load replays
                # the rewound history); a call in doubt ends with its result as any call
                # does, and what a tool hook did shows in the call's decision and result.
                return []
            case _:
                assert_never(output)

    def is_background(self, output: Output) -> bool:
        """Whether ``output`` comes from a background subagent :meth:`note` shows (or
        from one of its descendants)."""
        return self._is_bg(output.origin)

    def _is_bg(self, origin: tuple[str, ...] | None) -> bool:
        return origin is not None and len(origin) > 1 and origin[1] in self._background

    def note(self, output: Output) -> list[dict[str, Any]]:
        """The updates that show the session's background subagents (R-TREE-2), for every
        output the session publishes, as it is published — whether or not a prompt of the
        client runs, since a background child outlives the call and the task that spawned
        it. :meth:`map` shows everything else.

        A ``spawn_subagent`` call with ``background: true`` returns the child's session id;
        from that result on the child has a ``tool_call`` of its own: ``toolCallId``
        :data:`BACKGROUND_PREFIX` + its id, kind ``think``, ``rawInput`` its task and
        ``sessionId``, ``_meta.greenroom`` ``{nodeId, origin, background: true}``. Its
        activity (and its descendants') is that call's ``in_progress`` updates — its last
        :data:`CHILD_LINES` lines, ``_meta.greenroom`` ``{nodeId, origin, subagent,
        type}`` — and its own ``task_end`` closes it ``completed`` or ``failed``."""
        origin = output.origin
        if origin is None:
            if isinstance(output, ModelMsg) and isinstance(output.block, ToolCallBlock):
                block = output.block
                if block.name == "spawn_subagent" and block.arguments.get("background") is True:
                    name, task = block.arguments.get("name"), block.arguments.get("task")
                    self._background_spawns[block.id] = (
                        name if isinstance(name, str) else "",
                        task if isinstance(task, str) else "",
                    )
            elif isinstance(output, ToolCallOutput) and output.call_id in self._background_spawns:
                return self._background_started(output)
            return []
        if len(origin) < 2:
            return []
        child = self._background.get(origin[1])
        if child is None:
            return []
        line = self._child_line(output, origin, child.anchor)
        if line is not None:
            child.lines.append(line)
            del child.lines[: -self.CHILD_LINES]
        node = origin[-1]
        meta: dict[str, Any] = {"nodeId": node, "origin": list(origin), "subagent": node}
        if isinstance(output, TaskEnd) and len(origin) == 2:
            # Its own end: the call closes, as every call the client was told about does.
            del self._background[origin[1]]
            ok = output.status == "completed"
            update = _status(child.anchor, "completed" if ok else "failed")
            meta["status"] = output.status
        elif line is None:
            return []
        else:
            update = _status(child.anchor, "in_progress")
        update["content"] = [_text_content("\n".join(child.lines))]
        update["_meta"] = {META_KEY: {**meta, "type": output.type}}
        return [update]

    def _background_started(self, output: ToolCallOutput) -> list[dict[str, Any]]:
        name, task = self._background_spawns.pop(output.call_id)
        said = "".join(b.text for b in output.content if isinstance(b, TextBlock))
        try:
            child_id = json.loads(said)["session_id"] if output.status == "ok" else None
        except (ValueError, TypeError, KeyError):
            child_id = None
        if not isinstance(child_id, str):
            return []  # it did not start: the spawning call says why
        anchor = f"{BACKGROUND_PREFIX}{child_id}"
        label = name or child_id
        self._background[child_id] = _Background(anchor=anchor, name=label)
        return [
            {
                "sessionUpdate": "tool_call",
                "toolCallId": anchor,
                "title": f"Subagent {label} (background)",
                "kind": "think",
                "status": "in_progress",
                "rawInput": {"task": task, "sessionId": child_id},
                "_meta": {
                    META_KEY: {
                        "nodeId": child_id,
                        "background": True,
                        "spawnCallId": output.call_id,
                    }
                },
            }
        ]

    def map_all(self, outputs: Iterable[Output]) -> list[dict[str, Any]]:
        """The updates for ``outputs``, in order (:meth:`map` of each)."""
        updates: list[dict[str, Any]] = []
        for output in outputs:
            updates.extend(self.map(output))
        return updates

    def _model_block(self, output: ModelMsg) -> list[dict[str, Any]]:
        block = output.block
        if isinstance(block, TextBlock):
            streamed, self._streamed_text = self._streamed_text, False
            return [] if streamed or not block.text else [_chunk("agent_message_chunk", block.text)]
        if isinstance(block, ToolCallBlock):
            call = _Call(name=block.name, origin=None, anchor=block.id)
            self._calls[(None, block.id)] = call
            self._by_id[block.id] = call
            title = self._titles[block.id] = tool_title(block)
            if block.name == "spawn_subagent":
                task = block.arguments.get("task")
                self._open_spawns.append((block.id, task if isinstance(task, str) else ""))
            update: dict[str, Any] = {
                "sessionUpdate": "tool_call",
                "toolCallId": block.id,
                "title": title,
                "kind": tool_kind(block.name),
                "status": "pending",
                "rawInput": _raw_input(block),
            }
            locations = self._locations(block)
            if locations:
                update["locations"] = locations
            return [update]
        if isinstance(block, ThinkingBlock):
            streamed, self._streamed_thinking = self._streamed_thinking, False
            return [] if streamed or not block.text else [_chunk("agent_thought_chunk", block.text)]
        return []  # redacted thinking: nothing to show

    def _locations(self, call: ToolCallBlock) -> list[dict[str, Any]]:
        path = call.arguments.get("path")
        if call.name not in ("read_file", "write_file", "list_dir") or not isinstance(path, str):
            return []
        if self._workspace is None and not posixpath.isabs(path):
            return []
        full = posixpath.normpath(posixpath.join(self._workspace or "/", path))
        return [{"path": full}]

    def _tool_output(self, output: ToolCallOutput) -> list[dict[str, Any]]:
        call = self._calls.get((None, output.call_id))
        if call is None:
            # A result without its call (a trace cut at the start): still say how it went.
            call = _Call(name=output.tool, origin=None, anchor=output.call_id)
            self._calls[(None, output.call_id)] = call
        if call.closed:
            return []
        call.closed = True
        self._open_spawns = [s for s in self._open_spawns if s[0] != output.call_id]
        update = _status(output.call_id, "completed" if output.status == "ok" else "failed")
        shown = self._shown.pop(output.call_id, [])
        update["content"] = [*shown, *(self._content(block) for block in output.content)]
        update["_meta"] = {META_KEY: {"status": output.status}}
        return [update]

    def _close_open_calls(self) -> list[dict[str, Any]]:
        updates: list[dict[str, Any]] = []
        for (origin, call_id), call in self._calls.items():
            if origin is None and not call.closed:
                call.closed = True
                update = _status(call_id, "failed")
                update["content"] = [
                    *self._shown.pop(call_id, []),
                    _text_content("[interrupted: tool aborted by user]"),
                ]
                update["_meta"] = {META_KEY: {"status": "interrupted"}}
                updates.append(update)
        self._open_spawns = []
        return updates

    def _child(self, output: Output, origin: tuple[str, ...]) -> list[dict[str, Any]]:
        child_id = origin[1]
        child = self._children.get(child_id)
        if child is None:
            anchor = self._bind_child(output)
            if anchor is None:
                return []  # no spawn_subagent call to show it on
            child = self._children[child_id] = _Child(anchor=anchor)
        parent = self._calls.get((None, child.anchor))
        if parent is None or parent.closed:
            return []
        line = self._child_line(output, origin, child.anchor)
        if line is None:
            return []
        child.lines.append(line)
        del child.lines[: -self.CHILD_LINES]
        update = _status(child.anchor, "in_progress")
        update["content"] = [_text_content("\n".join(child.lines))]
        update["_meta"] = {
            META_KEY: {"origin": list(origin), "subagent": origin[-1], "type": output.type}
        }
        return [update]

    def _bind_child(self, output: Output) -> str | None:
        """The ``spawn_subagent`` call a new subagent belongs to: the open call whose task
        is the subagent's prompt, else the oldest open one."""
        if not self._open_spawns:
            return None
        chosen = self._open_spawns[0]
        if isinstance(output, UserMsg):
            text = "".join(b.text for b in output.content if isinstance(b, TextBlock))
            for spawn in self._open_spawns:
                if spawn[1] == text:
                    chosen = spawn
                    break
        self._open_spawns.remove(chosen)
        return chosen[0]

    def _child_line(self, output: Output, origin: tuple[str, ...], anchor: str) -> str | None:
        who = "/".join(origin[1:])
        if isinstance(output, ModelMsg):
            block = output.block
            if isinstance(block, TextBlock) and block.text.strip():
                return f"[{who}] {_clip(block.text, 300)}"
            if isinstance(block, ToolCallBlock):
                call = _Call(name=block.name, origin=origin, anchor=anchor)
                self._calls[(origin, block.id)] = call
                self._by_id[block.id] = call
                return f"[{who}] ▸ {tool_title(block)}"
            return None
        if isinstance(output, ToolCallOutput):
            return f"[{who}] ◂ {output.tool} {output.status}"
        if isinstance(output, TaskEnd):
            return f"[{who}] subagent {output.status}"
        return None

    def _user_chunk(self, block: TextBlock | ImageBlock) -> dict[str, Any]:
        return {"sessionUpdate": "user_message_chunk", "content": self._block(block)}

    def _content(self, block: TextBlock | ImageBlock) -> dict[str, Any]:
        return {"type": "content", "content": self._block(block)}

    def _block(self, block: TextBlock | ImageBlock) -> dict[str, Any]:
        if isinstance(block, TextBlock):
            return {"type": "text", "text": block.text}
        loaded = self._load_image(block) if self._load_image is not None else None
        if loaded is None:
            return {"type": "text", "text": f"[image {block.path}]"}
        media_type, data = loaded
        return {"type": "image", "data": data, "mimeType": media_type}


def _chunk(kind: str, text: str) -> dict[str, Any]:
    return {"sessionUpdate": kind, "content": {"type": "text", "text": text}}


def _status(call_id: str, status: str) -> dict[str, Any]:
    return {"sessionUpdate": "tool_call_update", "toolCallId": call_id, "status": status}


def _text_content(text: str) -> dict[str, Any]:
    return {"type": "content", "content": {"type": "text", "text": text}}


def _raw_input(call: ToolCallBlock) -> Any:
    if call.invalid_arguments is not None:
        return call.invalid_arguments
    return call.arguments


# -- the end of a task -----------------------------------------------------------------------


def stop_reason(end: TaskEnd, last_stop_reason: str | None) -> StopReason:
    """The ``stopReason`` of a task that ended: ``end_turn`` (completed; ``refusal`` or
    ``max_tokens`` when the model's last message ended so), ``max_turn_requests``
    (``max_turns``), ``cancelled`` (interrupted). Raises the :class:`RpcError` to answer
    with for a task that failed (``auth``: -32000; ``failed``, ``loop_detected``,
    ``budget_exceeded``: -32603, its message naming the budget)."""
    if end.status == "completed":
        if last_stop_reason == "refusal":
            return "refusal"
        if last_stop_reason == "max_tokens":
            return "max_tokens"
        return "end_turn"
    if end.status == "max_turns":
        return "max_turn_requests"
    if end.status == "aborted":
        return "cancelled"
    code = AUTH_REQUIRED if end.status == "auth" else INTERNAL_ERROR
    message = end.message or f"the task ended with status {end.status}"
    raise RpcError(code, message, {"status": end.status})


def verdict_of(response: Response | None) -> Verdict:
    """The approval verdict of a ``session/request_permission`` answer: the selected
    option's id (``allow``, ``allow_session``, ``deny``); a cancelled request, an error or
    anything else denies (R-APPROVE-2)."""
    if response is None or response.error is not None or not isinstance(response.result, dict):
        return "deny"
    outcome = response.result.get("outcome")
    if not isinstance(outcome, dict) or outcome.get("outcome") != "selected":
        return "deny"
    option = outcome.get("optionId")
    if option == "allow":
        return "allow"
    if option == "allow_session":
        return "allow_session"
    return "deny"


# -- people: approvals and questions (R-HITL) ------------------------------------------------

ASK_METHOD = "_greenroom/ask"
"""The extension request by which greenroom asks a free-text question (``ask_user``
without ``choices``) of a client that says it answers it:
``initialize {clientCapabilities: {_meta: {greenroom: {ask: true}}}}``. Params
``{sessionId, toolCallId, question}``; answered ``{answer: "…"}``, or anything else (an
error, ``{}``) to leave the question unanswered for now."""

ANSWER_NEXT = "answer_next"
"""The option of a free-text question asked with ``session/request_permission`` (a client
without ``_greenroom/ask``): the editor's next ``session/prompt`` on the session is the
answer."""

ANSWER_NEXT_NOTE = "Choose “Answer in my next message”, then send your answer as a prompt."
"""What a free-text question asked with ``session/request_permission`` tells the person."""

NOT_NOW = "not_now"
"""The option that leaves a question unanswered: it stays pending (R-HITL-1) and is asked
again when the session is loaded; another surface may answer it meanwhile."""

CHOICE_PREFIX = "choice:"
"""The option ids of a question's choices: ``choice:0``, ``choice:1``, …"""


def client_name(params: Mapping[str, Any]) -> str | None:
    """The ``clientInfo.name`` of ``initialize`` (who answers approvals: the decisions'
    ``principal``), when the client gives one."""
    info = params.get("clientInfo")
    name = info.get("name") if isinstance(info, Mapping) else None
    return _clip(name, 100) if isinstance(name, str) and name.strip() else None


def client_asks(params: Mapping[str, Any]) -> bool:
    """Whether the client answers :data:`ASK_METHOD` (its ``initialize`` says so in
    ``clientCapabilities._meta.greenroom.ask``)."""
    capabilities = params.get("clientCapabilities")
    meta = capabilities.get("_meta") if isinstance(capabilities, Mapping) else None
    ours = meta.get(META_KEY) if isinstance(meta, Mapping) else None
    return isinstance(ours, Mapping) and ours.get("ask") is True


def question_of(arguments: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The question and its choices (none when the model gave none, or gave no list of
    strings) of an ``ask_user`` call's arguments."""
    question = arguments.get("question")
    choices = arguments.get("choices")
    listed = (
        tuple(choices)
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
        else ()
    )
    return (question if isinstance(question, str) else ""), listed


def selected_option(response: Response | None) -> str | None:
    """The option id a ``session/request_permission`` answer selected; None for a
    cancelled request, an error or anything else."""
    if response is None or response.error is not None or not isinstance(response.result, dict):
        return None
    outcome = response.result.get("outcome")
    if not isinstance(outcome, dict) or outcome.get("outcome") != "selected":
        return None
    option = outcome.get("optionId")
    return option if isinstance(option, str) else None


def choice_of(option: str | None, choices: tuple[str, ...]) -> str | None:
    """The choice a question's selected option names (``choice:<i>``), else None."""
    if option is None or not option.startswith(CHOICE_PREFIX):
        return None
    index = option[len(CHOICE_PREFIX) :]
    if not index.isdigit() or int(index) >= len(choices):
        return None
    return choices[int(index)]


def ask_params(session_id: str, call_id: str, question: str) -> dict[str, Any]:
    """The params of :data:`ASK_METHOD`."""
    return {"sessionId": session_id, "toolCallId": call_id, "question": question}


def asked_answer(response: Response | None) -> str | None:
    """The text of an :data:`ASK_METHOD` answer, None when it gives none."""
    if response is None or response.error is not None or not isinstance(response.result, dict):
        return None
    answer = response.result.get("answer")
    return answer if isinstance(answer, str) else None


# -- the editor's files and terminal (R-ACP-2) ------------------------------------------------


@attrs.frozen(kw_only=True, slots=True)
class EditorCapabilities:
    """What the client's ``initialize`` offers of its own: ``fs/read_text_file``
    (``reads``), ``fs/write_text_file`` (``writes``) and the ``terminal/*`` methods
    (``terminal``)."""

    reads: bool = False
    writes: bool = False
    terminal: bool = False

    @property
    def any(self) -> bool:
        """Whether the client offers any of them."""
        return self.reads or self.writes or self.terminal


def editor_capabilities(params: Mapping[str, Any]) -> EditorCapabilities:
    """The ``clientCapabilities.fs`` and ``terminal`` of ``initialize`` (each only when
    it is exactly ``true``)."""
    capabilities = params.get("clientCapabilities")
    if not isinstance(capabilities, Mapping):
        return EditorCapabilities()
    fs = capabilities.get("fs")
    fs = fs if isinstance(fs, Mapping) else {}
    return EditorCapabilities(
        reads=fs.get("readTextFile") is True,
        writes=fs.get("writeTextFile") is True,
        terminal=capabilities.get("terminal") is True,
    )


def diff_content(path: str, old_text: str | None, new_text: str) -> dict[str, Any]:
    """The ``diff`` tool call content of an edit of ``path`` (``old_text`` None: a new
    file)."""
    return {"type": "diff", "path": path, "oldText": old_text, "newText": new_text}


def terminal_content(terminal_id: str) -> dict[str, Any]:
    """The ``terminal`` tool call content that embeds the client's terminal
    ``terminal_id`` (its live output, shown by the client)."""
    return {"type": "terminal", "terminalId": terminal_id}


def client_result(response: Response, method: str) -> dict[str, Any]:
    """The result object of the client's answer to our request ``method``. Raises
    ``ValueError`` with the client's own message when it answered an error, or saying
    what is wrong with its answer."""
    if response.error is not None:
        message = response.error.get("message")
        said = _clip(message, 500) if isinstance(message, str) and message.strip() else "error"
        return _refuse(f"{said} (code {response.error.get('code')})")
    if response.result is None and method in _EMPTY_ANSWERS:
        return {}
    if not isinstance(response.result, dict):
        return _refuse(f"{method} answered {json_type(response.result)}, not an object")
    return response.result


# Methods whose answer may be null: the schema's empty responses.
_EMPTY_ANSWERS = frozenset({"fs/write_text_file", "terminal/kill", "terminal/release"})


def _refuse(message: str) -> dict[str, Any]:
    raise ValueError(message)


def text_of(result: Mapping[str, Any]) -> str:
    """The ``content`` of an ``fs/read_text_file`` answer; ``ValueError`` without it."""
    content = result.get("content")
    if not isinstance(content, str):
        raise ValueError(f"fs/read_text_file answered no text ({json_type(content)})")
    return content


def terminal_id_of(result: Mapping[str, Any]) -> str:
    """The ``terminalId`` of a ``terminal/create`` answer; ``ValueError`` without it."""
    terminal_id = result.get("terminalId")
    if not isinstance(terminal_id, str) or not terminal_id:
        raise ValueError("terminal/create answered no terminalId")
    return terminal_id


@attrs.frozen(kw_only=True, slots=True)
class TerminalOutput:
    """A ``terminal/output`` answer: the ``output`` kept, whether the client dropped its
    start (``truncated``) and how the command ended, when it has (``exit_code`` or
    ``signal``; ``exited`` False while it runs)."""

    output: str
    truncated: bool
    exited: bool
    exit_code: int | None
    signal: str | None


def terminal_output(result: Mapping[str, Any]) -> TerminalOutput:
    """The checked fields of a ``terminal/output`` answer (``ValueError`` without its
    ``output``)."""
    output = result.get("output")
    if not isinstance(output, str):
        raise ValueError("terminal/output answered no output")
    status = result.get("exitStatus")
    code, signal = exit_status(status) if isinstance(status, Mapping) else (None, None)
    return TerminalOutput(
        output=output,
        truncated=result.get("truncated") is True,
        exited=isinstance(status, Mapping),
        exit_code=code,
        signal=signal,
    )


def exit_status(result: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """The ``exitCode`` and ``signal`` of a ``terminal/wait_for_exit`` answer or of an
    ``exitStatus`` (None for what it does not say)."""
    code = result.get("exitCode")
    signal = result.get("signal")
    return (
        code if isinstance(code, int) and not isinstance(code, bool) else None,
        _clip(signal, 40) if isinstance(signal, str) and signal else None,
    )


# -- modes: the approval policy (R-ACP-2) -----------------------------------------------------

APPROVAL_MODES: tuple[tuple[str, str, str], ...] = (
    ("ask", "Ask", "Ask before each tool call runs"),
    ("all", "Allow all", "Run every tool call without asking"),
    ("none", "Deny all", "Deny every tool call; the model is told it was denied"),
)
"""The session modes greenroom offers: its approval policies (``--approve`` values), as
``(id, name, description)``."""


def modes_state(current: str) -> dict[str, Any]:
    """The ``modes`` of a ``session/new``, ``load`` or ``fork`` answer: the approval
    policies, ``current`` the session's."""
    return {
        "currentModeId": current,
        "availableModes": [
            {"id": mode, "name": name, "description": description}
            for mode, name, description in APPROVAL_MODES
        ],
    }


def parse_set_mode(params: Mapping[str, Any]) -> str:
    """The ``modeId`` of ``session/set_mode``: one of :data:`APPROVAL_MODES`, else -32602
    naming them."""
    mode = require_str(params, "modeId")
    known = [m for m, _, _ in APPROVAL_MODES]
    if mode not in known:
        raise invalid("$.modeId", f"unknown mode {_clip(mode, 40)!r}; the modes are {known}")
    return mode


# -- session/list (R-ACP-2) -------------------------------------------------------------------

SESSION_PAGE = 50
"""How many sessions one ``session/list`` answer holds (then ``nextCursor``)."""


@attrs.frozen(kw_only=True, slots=True)
class ListSessions:
    """``session/list``: only the sessions working in ``cwd`` (None: all), after
    ``cursor`` (when the last session of the page before was created, and its id; None:
    from the newest)."""

    cwd: str | None
    cursor: tuple[float, str] | None


_CURSOR = re.compile(r"([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)~([A-Za-z0-9][A-Za-z0-9._-]*)")


def parse_list_sessions(params: Mapping[str, Any]) -> ListSessions:
    """The checked parameters of ``session/list``: an absolute ``cwd`` and a ``cursor``
    this agent gave, both optional. Raises -32602 naming the bad one."""
    cwd = params.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not posixpath.isabs(cwd)):
        raise invalid("$.cwd", f"must be an absolute path, got {_clip(str(cwd), 80)!r}")
    cursor = params.get("cursor")
    if cursor is None:
        return ListSessions(cwd=cwd, cursor=None)
    found = _CURSOR.fullmatch(cursor) if isinstance(cursor, str) and len(cursor) < 300 else None
    if found is None:
        raise invalid("$.cursor", "not a cursor of this agent: pass nextCursor as it came")
    return ListSessions(cwd=cwd, cursor=(float(found[1]), found[2]))


def sessions_page(
    sessions: Iterable[tuple[float, str]],
    cursor: tuple[float, str] | None,
    size: int = SESSION_PAGE,
) -> tuple[list[str], str | None]:
    """One page of ``sessions`` (``(created_at, session_id)``), newest first: those
    after ``cursor``, at most ``size`` ids, and the ``nextCursor`` of the page after
    (None on the last). A cursor stays valid while sessions come and go: a page never
    repeats a session nor skips one that was there before."""
    ordered = sorted(sessions, reverse=True)
    if cursor is not None:
        ordered = [entry for entry in ordered if entry < cursor]
    page = ordered[:size]
    if len(ordered) <= size:
        return [sid for _, sid in page], None
    created, last = page[-1]
    return [sid for _, sid in page], f"{created!r}~{last}"


def session_info(
    session_id: str, cwd: str, title: str | None, updated_at: str | None
) -> dict[str, Any]:
    """One ``SessionInfo`` of a ``session/list`` answer."""
    info: dict[str, Any] = {"sessionId": session_id, "cwd": cwd}
    if title:
        info["title"] = title
    if updated_at is not None:
        info["updatedAt"] = updated_at
    return info


# -- usage (R-ACP-2) --------------------------------------------------------------------------


def prompt_usage(usage: TokenUsage) -> dict[str, Any]:
    """The ``usage`` of a ``session/prompt`` answer: the tokens of the task that answers
    it (``inputTokens`` the fresh input; cache reads and writes apart; ``totalTokens``
    all of them), its cost in ``_meta.greenroom.costUsd`` when the price is known."""
    answer: dict[str, Any] = {
        "totalTokens": usage.total,
        "inputTokens": usage.input,
        "outputTokens": usage.output,
        "cachedReadTokens": usage.cache_read,
        "cachedWriteTokens": usage.cache_write,
    }
    if usage.cost_usd is not None:
        answer["_meta"] = {META_KEY: {"costUsd": usage.cost_usd}}
    return answer


def usage_update(output: Output, context_size: int) -> list[dict[str, Any]]:
    """The ``usage_update`` a root ``token_usage`` output gives: the tokens its request
    occupied (``used``) of the context window (``size``: ``max_context_length``); none
    for any other output."""
    if not isinstance(output, TokenUsageOutput) or output.origin is not None:
        return []
    return [{"sessionUpdate": "usage_update", "used": output.request.total, "size": context_size}]
