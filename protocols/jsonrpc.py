"""JSON-RPC 2.0 frames of the websocket gateway: parse, build, validate. No I/O.

Invariants:

* :func:`parse_frame` never raises. A text frame becomes a :class:`Request`, a
  :class:`Notification`, a :class:`Batch` of those, or a :class:`FrameError` that already
  holds the error response to send. Every malformed frame has an answer; none is dropped.
* Every error this module produces is an :class:`RpcError` with one of the codes below:
  the JSON-RPC codes (-32700 … -32603) and the HTTP-style codes of CONTRACT.md.
* Parameters are by name only (a JSON object, or absent). Validation failures name the
  offending value as a ``$.path`` (``$.settings.max_turns: expected an integer, got
  string``), like ``cattrs.transform_error``.
* Batches are supported (JSON-RPC 2.0 §6): an empty batch is one -32600 error; a batch of
  notifications has no response; a batch larger than ``max_batch`` is one -32600 error.
* Text is always encodable (R-SEC-1): a decoded frame has its lone UTF-16 surrogates
  (``"\\ud800"`` is valid JSON) replaced by U+FFFD, and :func:`encode` repairs any that
  reach an outgoing frame, so a reply can always be sent.
* Answers stay small whatever a frame holds (R-SEC-9): an ``id`` longer than
  :data:`MAX_ID_CHARS` is not echoed (the frame is -32600 with a null id), a value an error
  repeats (a method name, an unknown key, a rejected value) is cut to
  :data:`MAX_ECHO_CHARS` (:func:`clip`), and no error message exceeds
  :data:`MAX_ERROR_CHARS`.
* :data:`METHODS` is the one table of the methods, their parameters and results: the
  gateway's dispatch, the "unknown parameter" messages and the README's method table all
  come from it.

Frames are plain dicts (``result_frame`` …) turned into text by :func:`encode`.
"""

from __future__ import annotations

import functools
import json
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args, get_origin

import attrs

from greenroom.protocols.content import ImageBlock, TextBlock, UserContent
from greenroom.protocols.errors import OutputSchemaError
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.structured import OutputSpec, output_spec
from greenroom.protocols.text import compact_json, json_type_name, repair_json, repair_text
from greenroom.protocols.tools import value_too_deep

JSONRPC_VERSION = "2.0"

PARSE_ERROR = -32700
"""The frame is not JSON (or not UTF-8 text)."""
INVALID_REQUEST = -32600
"""JSON, but not a request object: wrong shape, binary frame, too large, empty batch."""
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
UNAUTHORIZED = 401
"""No valid token yet: authenticate on the handshake or with ``initialize``."""
FORBIDDEN = 403
"""The session exists but belongs to another client."""
NOT_FOUND = 404
"""No such session."""
BUSY = 409
"""The session already runs a task or a compaction (R-HOST-2); or an answer names a call
that waits for no answer (any more), or other arguments than the call's (R-HITL-2)."""
GONE = 410
"""A ``steer`` or ``follow_up`` whose input was dropped unrun: its session closed (or its
work stopped) before the input was recorded (R-STEER-1, R-STEER-6)."""
DROPPED = "the input was dropped, not queued"
"""How every answer for input that will never run begins, the gateway's and the ACP
agent's alike."""
AUTH_LOCKED = 423
"""The session is locked by a model auth failure until ``retry_auth`` (R-RETRY-6)."""
UNAVAILABLE = 503
"""What a call asked may or may not have been done, or was not done for now: ``data.outcome``
says which, ``unknown`` or ``not_done`` (a ``steer`` or ``follow_up`` whose record a cluster
host gave up on its way to the cluster's trace, unsure whether it got there, or that the
disk did not confirm durable in time; in a cluster, a call whose host stopped answering)."""
IN_DOUBT = "the input may have been queued"
"""How every answer for input that may or may not run begins, the gateway's and the ACP
agent's alike."""
TOO_MANY_REQUESTS = 429
"""A limit was reached: the connection's request rate, the principal's open sessions
(``session.create``) or connections (``initialize``), or the wrong tokens of the client's
address (``initialize``)."""

ERROR_MESSAGES: dict[int, str] = {
    PARSE_ERROR: "parse error",
    INVALID_REQUEST: "invalid request",
    METHOD_NOT_FOUND: "method not found",
    INVALID_PARAMS: "invalid params",
    INTERNAL_ERROR: "internal error",
    UNAUTHORIZED: "unauthorized",
    FORBIDDEN: "forbidden",
    NOT_FOUND: "no such session",
    BUSY: "busy",
    GONE: "gone",
    AUTH_LOCKED: "locked by auth failure",
    TOO_MANY_REQUESTS: "too many requests",
    UNAVAILABLE: "service unavailable",
}

RequestId = str | int | None
"""A request id: a string or an integer (JSON-RPC also allows null; we echo it)."""

MAX_ID_CHARS = 128
"""The longest id answered with itself: a string of at most this many characters or an
integer of at most this many digits. A longer one is -32600 answered with a null id, so a
client cannot make the server repeat a megabyte per call."""
MAX_ECHO_CHARS = 128
"""How much of a value sent by a client an error message repeats (:func:`clip`)."""
MAX_ERROR_CHARS = 1000
"""The longest error message sent; a longer one is cut (:func:`error_frame`)."""


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with a note of how many were left out: what
    an error message repeats of a client's value stays small however large the value."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def echo(value: Any) -> str:
    """A client's value as an error message quotes it: its ``repr``, clipped (the frame
    limit bounds the ``repr`` made first)."""
    return clip(repr(value))


class RpcError(Exception):
    """An error to answer with: ``code`` (see the constants), a message, optional data."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


@attrs.frozen(kw_only=True, slots=True)
class Request:
    """A call that wants an answer (it has an ``id``)."""

    id: RequestId
    method: str
    params: dict[str, Any]


@attrs.frozen(kw_only=True, slots=True)
class Notification:
    """A call without an ``id``: it is executed and never answered, not even on error."""

    method: str
    params: dict[str, Any]


@attrs.frozen(kw_only=True, slots=True)
class FrameError:
    """A frame (or batch entry) that could not be read as a call; ``id`` is the request's
    id when it could be recovered, else None."""

    id: RequestId
    error: RpcError

    def response(self) -> dict[str, Any]:
        """The error response frame that answers this frame."""
        return error_frame(self.id, self.error)


Call = Request | Notification


@attrs.frozen(kw_only=True, slots=True)
class Batch:
    """A JSON array of calls; entries that are not calls are :class:`FrameError` s."""

    items: tuple[Call | FrameError, ...]


Frame = Call | Batch | FrameError


# -- parsing ---------------------------------------------------------------------------------


def parse_frame(data: str | bytes, *, max_bytes: int = 1 << 20, max_batch: int = 100) -> Frame:
    """Read one websocket message. Binary frames, frames over ``max_bytes`` (counted in
    UTF-8 bytes) and JSON that is not a request give a :class:`FrameError`; so does a
    number no answer could write back as JSON (``NaN``, ``Infinity``, ``1e999``, which
    reads as infinity) or an integer past :data:`MAX_INT_DIGITS` (-32700)."""
    if isinstance(data, bytes | bytearray):
        return FrameError(
            id=None,
            error=RpcError(INVALID_REQUEST, "binary frames are not accepted; send JSON text"),
        )
    if len(data) > max_bytes or len(data.encode("utf-8", "surrogatepass")) > max_bytes:
        return FrameError(
            id=None,
            error=RpcError(INVALID_REQUEST, f"frame larger than {max_bytes} bytes"),
        )
    try:
        value = decode_json(data)
    except (ValueError, RecursionError) as exc:
        return FrameError(id=None, error=RpcError(PARSE_ERROR, f"parse error: {exc}"))
    if value_too_deep(value, MAX_DEPTH):
        return FrameError(
            id=None, error=RpcError(INVALID_REQUEST, f"nested deeper than {MAX_DEPTH} levels")
        )
    value = repair_json(value)
    if isinstance(value, list):
        if not value:
            return FrameError(id=None, error=RpcError(INVALID_REQUEST, "empty batch"))
        if len(value) > max_batch:
            return FrameError(
                id=None,
                error=RpcError(
                    INVALID_REQUEST, f"batch of {len(value)} calls; at most {max_batch}"
                ),
            )
        return Batch(items=tuple(parse_call(item) for item in value))
    return parse_call(value)


MAX_DEPTH = 64
"""How deeply a frame may nest arrays and objects; no method needs more than a few."""


def _id_too_long(request_id: RequestId) -> bool:
    if isinstance(request_id, str):
        return len(request_id) > MAX_ID_CHARS
    return isinstance(request_id, int) and abs(request_id) >= 10**MAX_ID_CHARS


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _read_float(text: str) -> float:
    # 1e999 is valid JSON that Python reads as inf: kept, it would be written back as
    # Infinity, which is not JSON, to every subscriber of the session.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{clip(text, 32)} is out of range (not finite once read)")
    return value


MAX_INT_DIGITS = 4300
"""The most digits an integer in a frame may have (Python's default bound for reading one)."""


def _read_int(text: str) -> int:
    # Python's own refusal names sys.set_int_max_str_digits(), of no use to a client.
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


def decode_json(text: str | bytes) -> Any:
    """``text`` decoded as JSON that can be written back as JSON: ``NaN``, ``Infinity``, a
    number that reads as infinity (``1e999``) and an integer of more than
    :data:`MAX_INT_DIGITS` digits raise :class:`ValueError` saying so in a client's terms
    (as malformed JSON does); deep nesting may raise :class:`RecursionError`. What a client
    sends to the gateway, as frames or HTTP bodies, is read with it."""
    return json.loads(
        text, parse_constant=_reject_constant, parse_int=_read_int, parse_float=_read_float
    )


def parse_call(value: Any) -> Call | FrameError:
    """One decoded JSON value as a request or notification."""
    if not isinstance(value, dict):
        return FrameError(
            id=None,
            error=RpcError(INVALID_REQUEST, f"$: expected an object, got {json_type(value)}"),
        )
    has_id = "id" in value
    raw_id = value.get("id")
    request_id: RequestId = None
    if has_id:
        if raw_id is None or (isinstance(raw_id, str | int) and not isinstance(raw_id, bool)):
            request_id = raw_id
        else:
            return FrameError(
                id=None,
                error=RpcError(
                    INVALID_REQUEST,
                    f"$.id: expected a string, an integer or null, got {json_type(raw_id)}",
                ),
            )
        if _id_too_long(request_id):
            return FrameError(
                id=None,
                error=RpcError(
                    INVALID_REQUEST,
                    f"$.id: longer than {MAX_ID_CHARS} characters (or digits); send a "
                    "shorter id",
                ),
            )
    if value.get("jsonrpc") != JSONRPC_VERSION:
        return FrameError(
            id=request_id, error=RpcError(INVALID_REQUEST, '$.jsonrpc: must be "2.0"')
        )
    method = value.get("method")
    if not isinstance(method, str) or not method:
        return FrameError(
            id=request_id,
            error=RpcError(INVALID_REQUEST, "$.method: expected a non-empty string"),
        )
    extra = sorted(set(value) - {"jsonrpc", "id", "method", "params"})
    if extra:
        return FrameError(
            id=request_id, error=RpcError(INVALID_REQUEST, f"$.{clip(extra[0])}: unknown member")
        )
    params = value.get("params", {})
    if not isinstance(params, dict):
        return FrameError(
            id=request_id,
            error=RpcError(
                INVALID_PARAMS,
                f"$.params: expected an object (by-name parameters), got {json_type(params)}",
            ),
        )
    if has_id:
        return Request(id=request_id, method=method, params=params)
    return Notification(method=method, params=params)


# -- building --------------------------------------------------------------------------------


def result_frame(request_id: RequestId, result: Any) -> dict[str, Any]:
    """The success response to request ``request_id``."""
    return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "result": result}


def error_frame(request_id: RequestId, error: RpcError) -> dict[str, Any]:
    """The error response to request ``request_id`` (None when the id could not be read);
    a message longer than :data:`MAX_ERROR_CHARS` is cut."""
    body: dict[str, Any] = {"code": error.code, "message": clip(error.message, MAX_ERROR_CHARS)}
    if error.data is not None:
        body["data"] = error.data
    return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "error": body}


def notification_frame(method: str, params: Any) -> dict[str, Any]:
    """A server-to-client notification: no ``id``, never answered."""
    return {"jsonrpc": JSONRPC_VERSION, "method": method, "params": params}


def encode(frame: Mapping[str, Any] | list[Any]) -> str:
    """One compact JSON text frame, always encodable as UTF-8: a lone surrogate anywhere in
    it (a session file, a tool's output) becomes U+FFFD instead of failing the send."""
    return repair_text(compact_json(frame))


# -- the methods -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True, slots=True)
class Param:
    """One by-name parameter of a method: its JSON type as documented, and what it is."""

    name: str
    type: str
    required: bool
    doc: str


@attrs.frozen(kw_only=True, slots=True)
class Method:
    """A method of the gateway: its parameters, its result, and one line on what it does."""

    name: str
    params: tuple[Param, ...]
    result: str
    doc: str


def _session_id(doc: str = "the session") -> Param:
    return Param(name="session_id", type="string", required=True, doc=doc)


_NODE = "the session, or a subagent at any depth of a tree the caller owns"

_INPUT = Param(
    name="input",
    type="string \\| blocks",
    required=True,
    doc="text, or `[{type: text, text}, {type: image, path, media_type?}]`; images are read "
    "at the call, from the workspace or scratchpad, and so is each `@server:uri` of a text, "
    "a resource of the session's MCP servers",
)
_OUTPUT_SCHEMA = Param(
    name="output_schema",
    type="object",
    required=False,
    doc="a JSON Schema of an object: the answer must match it (R-OUT-1); the `task_end` "
    "carries it as `output`",
)

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            name="initialize",
            params=(
                Param(name="token", type="string", required=False,
                      doc="the bearer token, when the handshake carried none"),
                Param(name="client_id", type="string", required=False,
                      doc="the token's principal; naming another is refused (403)"),
            ),
            result="`{client_id, server, path}`",
            doc="Authenticate (first call, once).",
        ),
        Method(
            name="session.create",
            params=(
                Param(name="workspace", type="string", required=False,
                      doc="a directory under the server's workspace root (default: the "
                      "server's workspace)"),
                Param(name="model", type="string", required=False, doc="the model name"),
                Param(name="settings", type="object", required=False,
                      doc="session settings (any but `provider`, `base_url`)"),
            ),
            result="`{session_id}`",
            doc="Create a session owned by the caller's principal.",
        ),
        Method(
            name="session.list",
            params=(),
            result="`{sessions: [{session_id, created_at, updated_at, workspace_dir, "
            "provider, model, trace_files, parent_id, root_id, open, busy, auth_locked, "
            "title, last_activity_at, state, usage: {tokens, cost_usd}}], "
            "unreadable?: [{session_id, reason}], cluster?}`",
            doc="The caller's sessions and the subagents of their trees, newest first; "
            "stored ones that cannot be read are listed apart. In a cluster, then those "
            "other hosts hold, with their `host`, and a copy here of a session another host "
            "took over is listed as that host's (`cluster`: why some may be missing).",
        ),
        Method(
            name="session.subscribe",
            params=(
                _session_id(_NODE),
                Param(name="after_seq", type="integer", required=False,
                      doc="replay traced outputs after this seq (default 0: all; at most "
                          "the session's last seq)"),
            ),
            result="`{session_id, replayed, last_seq}`",
            doc="Replay, then stream live outputs as `output` notifications.",
        ),
        Method(
            name="session.unsubscribe",
            params=(_session_id(_NODE),),
            result="`{unsubscribed}`",
            doc="Stop the session's `output` notifications.",
        ),
        Method(
            name="session.fork",
            params=(
                _session_id(_NODE),
                Param(name="at_seq", type="integer", required=False,
                      doc="the last record the fork keeps (default: the session's last; "
                      "0: none)"),
            ),
            result="`{session_id, seq}`",
            doc="A new session of the caller's whose history is this one's up to `at_seq` "
            "(R-FORK-1): `seq` is the fork point; a task open there ends aborted in the fork.",
        ),
        Method(
            name="session.rewind",
            params=(
                _session_id(),
                Param(name="to_seq", type="integer", required=True,
                      doc="the last record the session keeps (0: none)"),
            ),
            result="`{seq}`",
            doc="Continue the idle session from its history at `to_seq` (R-FORK-2); later "
            "records stay in the trace behind the `rewind` output (its `seq`); 409 while a "
            "task runs. Workspace files are not rewound.",
        ),
        Method(
            name="run",
            params=(
                _session_id(),
                _INPUT,
                _OUTPUT_SCHEMA,
            ),
            result="`{run_id, durable?}`",
            doc="Start a task (409 while one runs); answered once its prompt is durable "
            "(after 10 s without, with `durable: false`).",
        ),
        Method(
            name="steer",
            params=(_session_id(_NODE), _INPUT),
            result="`{queued, durable?}`",
            doc=(
                "Steer the running task (false: no task runs); true is answered once its "
                "record survives the host (after 10 s without, with `durable: false`)."
            ),
        ),
        Method(
            name="follow_up",
            params=(_session_id(), _INPUT, _OUTPUT_SCHEMA),
            result="`{queued, durable?}`",
            doc=(
                "Queue a task to start after the current one (false: no task runs); true is "
                "answered once its record survives the host (after 10 s without, with "
                "`durable: false`)."
            ),
        ),
        Method(
            name="approvals.list",
            params=(
                Param(name="session_id", type="string", required=False,
                      doc="only this session's requests (and its subagents'); default: "
                      "every session of the caller"),
            ),
            result="`{approvals: [{session_id, call_id, tool, arguments, asked_at, origin, "
            "kind, digest}]}`",
            doc="The requests waiting for a person in the caller's sessions, whether or not "
            "their task is in memory (`kind`: `approval`, `question`).",
        ),
        Method(
            name="approve",
            params=(
                _session_id(_NODE),
                Param(name="call_id", type="string", required=True,
                      doc="the `call_id` of an `approval_request` output"),
                Param(name="decision", type="`allow` \\| `deny` \\| `allow_session`",
                      required=True, doc="`allow_session` also allows the tool for the "
                      "rest of the session"),
                Param(name="digest", type="string", required=False,
                      doc="the request's `digest` (`approvals.list`): refused (409) if the "
                      "call's arguments are not those"),
            ),
            result="`{}`",
            doc="Answer a pending approval request, also after a restart (409: not pending).",
        ),
        Method(
            name="answer",
            params=(
                _session_id(_NODE),
                Param(name="call_id", type="string", required=True,
                      doc="the `call_id` of an `approval_request` of kind `question`"),
                Param(name="text", type="string", required=True,
                      doc="the answer: the `ask_user` call's result"),
            ),
            result="`{}`",
            doc="Answer the model's question (409: not pending).",
        ),
        Method(
            name="interrupt",
            params=(
                _session_id(_NODE),
                Param(name="scope", type="string", required=False,
                      doc="`tree` (default): the node and its whole subtree, background "
                      "children included; `node`: the node and its foreground children"),
            ),
            result="`{interrupted}`",
            doc=(
                "Interrupt the running task or compaction; with `tree`, answered once the "
                "stored nodes it ends, and in a cluster those other hosts run, have their "
                "ends written."
            ),
        ),
        Method(
            name="compact",
            params=(_session_id(),),
            result="the `compaction_end` output, or null",
            doc="Compact the idle session's context (answered when done).",
        ),
        Method(
            name="skip_reconnect_wait",
            params=(_session_id(),),
            result="`{skipped}`",
            doc="Retry a failed model request now instead of after its backoff.",
        ),
        Method(
            name="retry_auth",
            params=(_session_id(),),
            result="`{}`",
            doc="Unlock a session locked by a model auth failure (423).",
        ),
    )
}
"""Every method of the gateway, in the order the README lists them."""

NOTIFICATIONS: dict[str, str] = {
    "output": "one output of a subscribed session (the same JSON as in trace files)",
    "subscription_dropped": "`{session_id, reason, last_seq}`: the client fell behind; "
    "resubscribe with `after_seq: last_seq` and nothing is missed",
}
"""What the server sends unasked."""


def methods_markdown() -> str:
    """The README's method table, generated from :data:`METHODS` and :data:`NOTIFICATIONS`
    (a test keeps the README equal to it)."""
    lines = [
        "| method | parameters | result | |",
        "|---|---|---|---|",
    ]
    for method in METHODS.values():
        params = "<br>".join(
            f"`{p.name}{'' if p.required else '?'}`: {p.type} — {p.doc}" for p in method.params
        )
        lines.append(f"| `{method.name}` | {params or '—'} | {method.result} | {method.doc} |")
    lines.append("")
    lines.append("| notification (server → client) | params |")
    lines.append("|---|---|")
    lines.extend(f"| `{name}` | {doc} |" for name, doc in NOTIFICATIONS.items())
    return "\n".join(lines) + "\n"


# -- parameter validation --------------------------------------------------------------------


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages (a whole number is a
    ``number`` here, as the protocol's documentation names it)."""
    return json_type_name(value, integers=False)


def invalid(path: str, message: str) -> RpcError:
    """An invalid-params error (-32602) whose message starts with the ``$.path`` at fault."""
    return RpcError(INVALID_PARAMS, f"{path}: {message}")


def check_params(params: Mapping[str, Any], method: str) -> None:
    """Reject parameters ``method`` (a :data:`METHODS` name) does not take, naming the ones
    it does: a typo should not pass silently, and the error says what to send instead."""
    spec = METHODS[method]
    allowed = [p.name for p in spec.params]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = f"takes {', '.join(allowed)}" if allowed else "takes no parameters"
        raise invalid(f"$.{clip(unknown[0])}", f"unknown parameter; {method} {takes}")


def require_str(params: Mapping[str, Any], name: str, *, max_len: int = 10_000) -> str:
    """Parameter ``name``: a non-empty string of at most ``max_len`` characters. Raises an
    :class:`RpcError` (-32602) when it is missing or is not one."""
    if name not in params:
        raise invalid(f"$.{name}", "required")
    return _string(params[name], f"$.{name}", max_len=max_len)


def optional_str(params: Mapping[str, Any], name: str, *, max_len: int = 10_000) -> str | None:
    """Parameter ``name`` as :func:`require_str` checks it, or None when absent or null."""
    if params.get(name) is None:
        return None
    return _string(params[name], f"$.{name}", max_len=max_len)


def _string(value: Any, path: str, *, max_len: int) -> str:
    if not isinstance(value, str):
        raise invalid(path, f"expected a string, got {json_type(value)}")
    if not value:
        raise invalid(path, "must not be empty")
    if len(value) > max_len:
        raise invalid(path, f"longer than {max_len} characters")
    return value


def optional_int(params: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    """Parameter ``name``: an integer (not a bool) of at least ``minimum``, or None when absent
    or null. Raises an :class:`RpcError` (-32602) otherwise."""
    if params.get(name) is None:
        return None
    value = params[name]
    if not _is_int(value):
        raise invalid(f"$.{name}", f"expected an integer, got {json_type(value)}")
    if minimum is not None and value < minimum:
        raise invalid(f"$.{name}", f"must be at least {minimum}")
    return int(value)


def check_after_seq(after_seq: int, last_seq: int) -> None:
    """Refuse (-32602) a ``session.subscribe`` resume point past the session's last seq:
    no output ever carried it, and a subscription from there would skip the live outputs
    up to it as already replayed."""
    if after_seq > last_seq:
        raise invalid(
            "$.after_seq",
            f"{after_seq} is past the session's last seq ({last_seq}): give the seq of "
            "the last output received, or 0 for all",
        )


def optional_object(params: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """Parameter ``name``: a JSON object, or None when absent or null. Raises an
    :class:`RpcError` (-32602) otherwise."""
    if params.get(name) is None:
        return None
    value = params[name]
    if not isinstance(value, dict):
        raise invalid(f"$.{name}", f"expected an object, got {json_type(value)}")
    return value


def optional_output_schema(params: Mapping[str, Any]) -> OutputSpec | None:
    """Parameter ``output_schema`` of ``run`` as the answer it requires (R-OUT-1), or
    None when absent or null. Raises an :class:`RpcError` (-32602) naming why a schema
    cannot be used."""
    if params.get("output_schema") is None:
        return None
    schema = params["output_schema"]
    if not isinstance(schema, dict):
        raise invalid("$.output_schema", f"expected a JSON Schema object, got {json_type(schema)}")
    try:
        return output_spec(schema)
    except OutputSchemaError as exc:
        raise invalid("$.output_schema", str(exc)) from None


def require_choice(params: Mapping[str, Any], name: str, choices: Iterable[str]) -> str:
    """Parameter ``name``: one of ``choices``. Raises an :class:`RpcError` (-32602) naming them
    when it is missing or another value."""
    options = tuple(choices)
    value = require_str(params, name, max_len=100)
    if value not in options:
        raise invalid(f"$.{name}", f"expected one of {', '.join(options)}, got {echo(value)}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_PATH_CHARS = 4096
"""Longest path a client may name (the usual ``PATH_MAX``)."""


def parse_input(
    value: Any, path: str = "$.input", *, max_blocks: int = 100
) -> tuple[UserContent, ...]:
    """User input: a non-empty string, or a non-empty list of ``{type: text, text}`` and
    ``{type: image, path, media_type?}`` blocks. Image paths are returned as given; where
    they may point and how they are read is the caller's business (the gateway attaches
    them from the workspace: R-SEC-8)."""
    if isinstance(value, str):
        if not value:
            raise invalid(path, "must not be empty")
        return (TextBlock(text=value),)
    if not isinstance(value, list):
        raise invalid(path, f"expected a string or an array of blocks, got {json_type(value)}")
    if not value:
        raise invalid(path, "must not be empty")
    if len(value) > max_blocks:
        raise invalid(path, f"more than {max_blocks} blocks")
    blocks: list[UserContent] = []
    for i, item in enumerate(value):
        item_path = f"{path}[{i}]"
        if not isinstance(item, dict):
            raise invalid(item_path, f"expected an object, got {json_type(item)}")
        kind = item.get("type")
        if kind == TextBlock.TYPE:
            check_block(item, item_path, ("type", "text"))
            text = item.get("text")
            if not isinstance(text, str):
                raise invalid(f"{item_path}.text", f"expected a string, got {json_type(text)}")
            blocks.append(TextBlock(text=text))
        elif kind == ImageBlock.TYPE:
            check_block(item, item_path, ("type", "path", "media_type"))
            image_path = item.get("path")
            if not isinstance(image_path, str) or not image_path:
                raise invalid(
                    f"{item_path}.path", f"expected a non-empty string, got {json_type(image_path)}"
                )
            if len(image_path) > MAX_PATH_CHARS:
                raise invalid(f"{item_path}.path", f"longer than {MAX_PATH_CHARS} characters")
            media_type = item.get("media_type")
            if media_type is not None and not isinstance(media_type, str):
                raise invalid(
                    f"{item_path}.media_type", f"expected a string, got {json_type(media_type)}"
                )
            blocks.append(ImageBlock(path=image_path, media_type=media_type))
        else:
            raise invalid(f"{item_path}.type", f"expected 'text' or 'image', got {echo(kind)}")
    return tuple(blocks)


def check_block(item: Mapping[str, Any], path: str, allowed: Iterable[str]) -> None:
    """Reject a field of block ``item`` (at ``path``) not in ``allowed``, as -32602 naming it."""
    unknown = sorted(set(item) - set(allowed))
    if unknown:
        raise invalid(f"{path}.{clip(unknown[0])}", "unknown field")


# The least value each setting's documentation gives a meaning to: -1 for "no limit";
# none for the loop guards and max_context_length, which any value <= 0 turns off. A
# client gains nothing by them that a huge number would not give it.
_SETTINGS_MINIMUMS: dict[str, float] = {
    "max_tokens": 1,
    "max_turns": -1,
    "max_session_turns": -1,
    "tool_result_budget": 1,
    "approval_timeout_s": 0,
    "max_subagents_concurrent": 0,
    "max_subagents_per_task": -1,
    "subagent_token_budget": -1,
    "max_subagent_depth": 0,
    "max_image_bytes": 1,
    "max_cost_usd": 0,
    "tree_cost_budget_usd": 0,
}
_SETTINGS_STRICTLY_POSITIVE = frozenset({"approval_timeout_s"})
MAX_SETTING_NUMBER = 2**53
"""No setting means anything beyond this (and every float can hold it exactly)."""
MAX_SETTING_CHARS: dict[str, int] = {"model": 200}
MAX_SETTING_TEXT = 1_000_000
"""Longest text setting (``system``, ``compact_prompt``) of a session: more than any
model's context holds, so a program's long system prompt is never refused for its length."""
MAX_CLIENT_SETTING_TEXT = 100_000
"""Longest text setting a gateway client may give (:func:`parse_settings`): a shared
server's sessions are held to less than a program's own."""


def parse_settings(
    value: Any, path: str = "$.settings", *, forbidden: Iterable[str] = ()
) -> dict[str, Any]:
    """A client's :class:`SessionSettings` overrides, checked field by field against the
    field's type (and a few lower bounds). Unknown fields, ``forbidden`` fields, and values
    of the wrong type raise -32602 naming the field."""
    if not isinstance(value, dict):
        raise invalid(path, f"expected an object, got {json_type(value)}")
    hints = _settings_types()
    blocked = set(forbidden)
    checked: dict[str, Any] = {}
    for name, field_value in value.items():
        field_path = f"{path}.{clip(name)}"
        if name not in hints:
            raise invalid(field_path, "unknown setting")
        if name in blocked:
            raise invalid(field_path, "cannot be set by a client")
        problem = setting_problem(name, field_value, longest_text=MAX_CLIENT_SETTING_TEXT)
        if problem is not None:
            raise invalid(field_path, problem)
        checked[name] = field_value
    return checked


def setting_problem(
    name: str, value: Any, *, longest_text: int = MAX_SETTING_TEXT
) -> str | None:
    """What is wrong with ``value`` (decoded JSON) for the :class:`SessionSettings` field
    ``name``, a known one: its type, a number beyond :data:`MAX_SETTING_NUMBER` or below the
    field's minimum, a text longer than the field's most (``longest_text`` but for
    ``model``); None when it fits. The one check of a setting's value, a client's
    (:func:`parse_settings`) or a session's (:func:`settings_problem`)."""
    problem = _type_problem(value, _settings_types()[name])
    if problem is not None:
        return problem
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and abs(value) > MAX_SETTING_NUMBER:
        return f"out of range (at most {MAX_SETTING_NUMBER})"
    if isinstance(value, str):
        most = MAX_SETTING_CHARS.get(name, longest_text)
        if len(value) > most:
            return f"longer than {most} characters"
    minimum = _SETTINGS_MINIMUMS.get(name)
    if minimum is not None and number:
        if name in _SETTINGS_STRICTLY_POSITIVE and value <= minimum:
            return f"must be greater than {minimum:g}"
        if value < minimum:
            return f"must be at least {minimum:g}"
    return None


def settings_problem(settings: Mapping[str, Any], path: str = "$.settings") -> str | None:
    """The first of ``settings`` (decoded JSON: a ``session.json``'s, or unstructured
    :class:`SessionSettings`) that a client could not give (:func:`setting_problem`), as
    ``<problem> @ <path>.<name>``; None when every one fits. A name this version does not
    know is left alone: another version may have written it, and it changes nothing here."""
    hints = _settings_types()
    for name, value in settings.items():
        if name in hints:
            problem = setting_problem(name, value)
            if problem is not None:
                return f"{problem} @ {path}.{clip(name)}"
    return None


@functools.cache
def _settings_types() -> dict[str, Any]:
    hints = typing.get_type_hints(SessionSettings)
    return {f.name: hints[f.name] for f in attrs.fields(SessionSettings)}


def _type_problem(value: Any, annotation: Any) -> str | None:
    """None when ``value`` (decoded JSON) fits ``annotation``, else what is wrong."""
    origin = get_origin(annotation)
    if origin is Literal:
        options = get_args(annotation)
        if value in options and not isinstance(value, bool):
            return None
        return f"expected one of {', '.join(map(str, options))}, got {echo(value)}"
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, arm) for arm in get_args(annotation)]
        if any(p is None for p in problems):
            return None
        return " or ".join(p for p in problems if p is not None)
    if annotation is type(None):
        return None if value is None else f"expected null, got {json_type(value)}"
    if annotation is bool:
        return None if isinstance(value, bool) else f"expected a boolean, got {json_type(value)}"
    if annotation is int:
        return None if _is_int(value) else f"expected an integer, got {json_type(value)}"
    if annotation is float:
        if isinstance(value, float) and not math.isfinite(value):
            return f"expected a finite number, got {value!r}"
        if _is_int(value) or isinstance(value, float):
            return None
        return f"expected a number, got {json_type(value)}"
    if annotation is str:
        return None if isinstance(value, str) else f"expected a string, got {json_type(value)}"
    return f"cannot be set over the wire ({annotation})"
