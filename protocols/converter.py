"""The one JSON converter: trace lines, ``--json`` output and websocket frames.

Every tagged class (a class with a ``TYPE`` class variable) becomes a JSON object whose
first key is ``type``; unions of tagged classes are structured by that tag. ``seq`` and
``origin`` are left out when None (live-only outputs, outputs not from a subagent).
``TokenUsage`` also writes its derived ``total``, and always its ``cost_usd`` (null when
unknown; a record written before costs were computed reads back with None). Invalid input raises a
``cattrs`` error; :func:`describe_error` renders it as ``$.path`` messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, get_args

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from greenroom.protocols import content, context, outputs
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.text import compact_json

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=False)

_TAGGED_BLOCKS: tuple[type[Any], ...] = (
    content.TextBlock,
    content.ImageBlock,
    content.ThinkingBlock,
    content.RedactedThinkingBlock,
    content.ToolCallBlock,
)
_BLOCK_BY_TAG: dict[str, type[Any]] = {cls.TYPE: cls for cls in _TAGGED_BLOCKS}
OUTPUT_BY_TAG: dict[str, type[outputs.Output]] = {cls.TYPE: cls for cls in outputs.OUTPUT_CLASSES}


def _is_tagged(cls: Any) -> bool:
    return isinstance(cls, type) and attrs.has(cls) and isinstance(getattr(cls, "TYPE", None), str)


def _make_tagged_unstructure(cls: type[Any]) -> Callable[[Any], dict[str, Any]]:
    overrides: dict[str, Any] = {}
    field_names = {f.name for f in attrs.fields(cls)}
    for name in (
        "seq",
        "origin",
        "media_type",
        "sha256",
        "signature",
        "item_id",
        "invalid_arguments",
        "remember",
        "error_kind",
        "principal",
        "asked_at",
        "check_error",
        "output_schema",
        "output",
        "response_id",
        "response_model",
        "http_status",
        "queued_id",
        "steering_ids",
        "late_steering",
        "session_rules",
        # compaction_end's only: the other outputs' turn and usage have no default, so
        # they are always written.
        "turn",
        "usage",
        "answer_failures",
    ):
        if name in field_names:
            overrides[name] = override(omit_if_default=True)
    if cls is outputs.ApprovalRequest:
        overrides["kind"] = override(omit_if_default=True)
    if cls is outputs.ToolHook:
        overrides["arguments"] = override(omit_if_default=True)
        overrides["reason"] = override(omit_if_default=True)
    inner = make_dict_unstructure_fn(cls, converter, **overrides)
    tag = cls.TYPE

    def unstructure(obj: Any) -> dict[str, Any]:
        return {"type": tag, **inner(obj)}

    return unstructure


def _strict_bool(value: Any, _: Any) -> bool:
    # cattrs would take bool(value): a hand-edited "false" or "no" read back as true.
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _make_tagged_structure(cls: type[Any]) -> Callable[[Any, Any], Any]:
    overrides: dict[str, Any] = {}
    if "late_steering" in {f.name for f in attrs.fields(cls)}:
        overrides["late_steering"] = override(struct_hook=_strict_bool)
    inner = make_dict_structure_fn(cls, converter, **overrides)

    def structure(data: Any, _: Any) -> Any:
        return inner(data, cls)

    return structure


converter.register_unstructure_hook_factory(_is_tagged, _make_tagged_unstructure)
converter.register_structure_hook_factory(_is_tagged, _make_tagged_structure)


def _union_structure(by_tag: dict[str, type[Any]]) -> Callable[[Any, Any], Any]:
    def structure(data: Any, _: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"expected an object with a 'type', got {type(data).__name__}")
        tag = data.get("type")
        cls = by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise ValueError(f"unknown type {tag!r}; expected one of {sorted(by_tag)}")
        return converter.structure(data, cls)

    return structure


def _register_union(union: Any, by_tag: dict[str, type[Any]]) -> None:
    converter.register_structure_hook(union, _union_structure(by_tag))
    converter.register_unstructure_hook(union, converter.unstructure)


for _union in (content.ModelBlock, content.UserContent, content.ToolContent):
    _register_union(_union, {cls.TYPE: cls for cls in get_args(_union)})
_register_union(outputs.Output, OUTPUT_BY_TAG)

_user_parts: dict[str, type[Any]] = {
    content.TextBlock.TYPE: content.TextBlock,
    content.ImageBlock.TYPE: content.ImageBlock,
    "tool_result": context.ToolResult,
}
_tool_result_unstructure = make_dict_unstructure_fn(context.ToolResult, converter)
converter.register_unstructure_hook(
    context.ToolResult,
    lambda r: {"type": "tool_result", **_tool_result_unstructure(r)},
)
_register_union(content.UserContent | context.ToolResult, _user_parts)


def _usage_unstructure(usage: TokenUsage) -> dict[str, int | float | None]:
    return {
        "input": usage.input,
        "output": usage.output,
        "cache_read": usage.cache_read,
        "cache_write": usage.cache_write,
        "total": usage.total,
        "cost_usd": usage.cost_usd,
    }


def _usage_structure(data: Any, _: Any) -> TokenUsage:
    cost = data.get("cost_usd")
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, int | float)):
        raise ValueError(f"cost_usd: expected a number or null, got {cost!r}")
    return TokenUsage(
        input=int(data.get("input", 0)),
        output=int(data.get("output", 0)),
        cache_read=int(data.get("cache_read", 0)),
        cache_write=int(data.get("cache_write", 0)),
        cost_usd=None if cost is None else float(cost),
    )


converter.register_unstructure_hook(TokenUsage, _usage_unstructure)
converter.register_structure_hook(TokenUsage, _usage_structure)


def to_dict(obj: Any) -> Any:
    """The JSON-ready form of any protocol value."""
    return converter.unstructure(obj)


def to_json(obj: Any) -> str:
    """One compact JSON line (no newline) for any protocol value."""
    return compact_json(converter.unstructure(obj))


def output_from_dict(data: Any) -> outputs.Output:
    """Read one output (a trace record or a ``--json`` line) back; raises on bad input."""
    result: outputs.Output = converter.structure(data, outputs.Output)  # type: ignore[arg-type]
    return result


def structure(data: Any, cls: type[T]) -> T:
    """Structure ``data`` as ``cls`` with the shared converter."""
    return converter.structure(data, cls)


def describe_error(exc: BaseException, path: str = "$") -> str:
    """A cattrs/validation error on one line: each problem as ``message @ $.path``
    (``path`` the place of the structured value), joined by ``; ``."""
    if isinstance(exc, cattrs.BaseValidationError):
        text = "; ".join(cattrs.transform_error(exc, path=path))
    else:
        text = str(exc)
    return " ".join(text.split()) or type(exc).__name__
