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
from greenroom.protocols.settings import SessionSettings

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
"""The session already runs a task or a compaction (R-HOST-2)."""
AUTH_LOCKED = 423
"""The session is locked by a model auth failure until ``retry_auth`` (R-RETRY-6)."""
TOO_MANY_REQUESTS = 429
"""The connection's request rate limit was exceeded."""

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
    AUTH_LOCKED: "locked by auth failure",
    TOO_MANY_REQUESTS: "too many requests",
}

RequestId = str | int | None
"""A request id: a string or an integer (JSON-RPC also allows null; we echo it)."""


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
    UTF-8 bytes) and JSON that is not a request give a :class:`FrameError`."""
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
        value = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        return FrameError(id=None, error=RpcError(PARSE_ERROR, f"parse error: {exc}"))
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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


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
            id=request_id, error=RpcError(INVALID_REQUEST, f"$.{extra[0]}: unknown member")
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
    return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "result": result}


def error_frame(request_id: RequestId, error: RpcError) -> dict[str, Any]:
    body: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.data is not None:
        body["data"] = error.data
    return {"jsonrpc": JSONRPC_VERSION, "id": request_id, "error": body}


def notification_frame(method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC_VERSION, "method": method, "params": params}


def encode(frame: Mapping[str, Any] | list[Any]) -> str:
    """One compact JSON text frame."""
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":"))


# -- parameter validation --------------------------------------------------------------------


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def invalid(path: str, message: str) -> RpcError:
    return RpcError(INVALID_PARAMS, f"{path}: {message}")


def check_params(params: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Reject parameters a method does not take (a typo should not pass silently)."""
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise invalid(f"$.{unknown[0]}", "unknown parameter")


def require_str(params: Mapping[str, Any], name: str, *, max_len: int = 10_000) -> str:
    if name not in params:
        raise invalid(f"$.{name}", "required")
    return _string(params[name], f"$.{name}", max_len=max_len)


def optional_str(params: Mapping[str, Any], name: str, *, max_len: int = 10_000) -> str | None:
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
    if params.get(name) is None:
        return None
    value = params[name]
    if not _is_int(value):
        raise invalid(f"$.{name}", f"expected an integer, got {json_type(value)}")
    if minimum is not None and value < minimum:
        raise invalid(f"$.{name}", f"must be at least {minimum}")
    return int(value)


def optional_object(params: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    if params.get(name) is None:
        return None
    value = params[name]
    if not isinstance(value, dict):
        raise invalid(f"$.{name}", f"expected an object, got {json_type(value)}")
    return value


def require_choice(params: Mapping[str, Any], name: str, choices: Iterable[str]) -> str:
    options = tuple(choices)
    value = require_str(params, name, max_len=100)
    if value not in options:
        raise invalid(f"$.{name}", f"expected one of {', '.join(options)}, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_input(
    value: Any, path: str = "$.input", *, max_blocks: int = 100
) -> tuple[UserContent, ...]:
    """User input: a non-empty string, or a non-empty list of ``{type: text, text}`` and
    ``{type: image, path, media_type?}`` blocks. Image paths are returned as given; where
    they may point is the caller's business (the gateway confines them to the workspace)."""
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
            media_type = item.get("media_type")
            if media_type is not None and not isinstance(media_type, str):
                raise invalid(
                    f"{item_path}.media_type", f"expected a string, got {json_type(media_type)}"
                )
            blocks.append(ImageBlock(path=image_path, media_type=media_type))
        else:
            raise invalid(f"{item_path}.type", f"expected 'text' or 'image', got {kind!r}")
    return tuple(blocks)


def check_block(item: Mapping[str, Any], path: str, allowed: Iterable[str]) -> None:
    unknown = sorted(set(item) - set(allowed))
    if unknown:
        raise invalid(f"{path}.{unknown[0]}", "unknown field")


_SETTINGS_MINIMUMS: dict[str, float] = {
    "max_tokens": 1,
    "max_turns": -1,
    "max_session_turns": -1,
    "tool_result_budget": 1,
    "approval_timeout_s": 0,
    "loop_repeat_threshold": 1,
    "loop_no_progress_threshold": 1,
}
_SETTINGS_STRICTLY_POSITIVE = frozenset({"approval_timeout_s"})


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
        field_path = f"{path}.{name}"
        if name not in hints:
            raise invalid(field_path, "unknown setting")
        if name in blocked:
            raise invalid(field_path, "cannot be set by a client")
        problem = _type_problem(field_value, hints[name])
        if problem is not None:
            raise invalid(field_path, problem)
        minimum = _SETTINGS_MINIMUMS.get(name)
        if minimum is not None and isinstance(field_value, int | float):
            if name in _SETTINGS_STRICTLY_POSITIVE and field_value <= minimum:
                raise invalid(field_path, f"must be greater than {minimum:g}")
            if field_value < minimum:
                raise invalid(field_path, f"must be at least {minimum:g}")
        checked[name] = field_value
    return checked


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
        return f"expected one of {', '.join(map(str, options))}, got {value!r}"
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
        if (_is_int(value) or isinstance(value, float)) and math.isfinite(value):
            return None
        return f"expected a number, got {json_type(value)}"
    if annotation is str:
        return None if isinstance(value, str) else f"expected a string, got {json_type(value)}"
    return f"cannot be set over the wire ({annotation})"
