"""What the providers refuse in a structured-output request (R-OUT-1), checked by the mock
model server on every request as the real APIs would (their documentation, 2025-11 and
after), so that an encoder that drifts from what they take fails every test that reaches
it, not only the ones that look:

* **Anthropic** ``output_config.format``: ``{type: json_schema, schema}``; every object of
  the schema closed (``additionalProperties: false``); no numeric, length or count
  constraints (``minimum``, ``maxLength``, ``maxItems``…). ``tool_choice`` ``tool`` names
  a tool of the request; ``any`` or ``tool`` with extended thinking on is refused ("Thinking
  may not be enabled when tool_choice forces tool use.").
* **OpenAI chat** ``response_format`` / **Responses** ``text.format``:
  ``type: json_schema``, a ``name`` of ``[A-Za-z0-9_-]{1,64}``, an object ``schema``;
  ``strict: true`` only for a schema whose every object is closed and requires every
  property.
"""

from __future__ import annotations

import re
from typing import Any, Literal

__all__ = ["check_structured_request"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANTHROPIC_REFUSED = (
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "maxItems", "minProperties", "maxProperties",
)
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "description", "title")


def check_structured_request(
    wire: Literal["anthropic", "openai", "responses"], body: Any
) -> list[str]:
    """What the provider of ``wire`` would refuse in ``body``'s structured-output fields
    (empty when it has none, or they are fine)."""
    if not isinstance(body, dict):
        return []
    if wire == "anthropic":
        return _anthropic(body)
    if wire == "openai":
        fmt = body.get("response_format")
        if fmt is None:
            return []
        if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object",
                                                                 "text"):
            return [f"response_format: unknown type in {fmt!r}"]
        if fmt["type"] != "json_schema":
            return []
        return _openai_format(fmt.get("json_schema"), "response_format.json_schema")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is None:
        return []
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return [f"text.format: expected type json_schema, got {fmt!r}"]
    return _openai_format(fmt, "text.format")


def _anthropic(body: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    config = body.get("output_config")
    if config is not None:
        fmt = config.get("format") if isinstance(config, dict) else None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            problems.append("output_config.format: expected {type: json_schema, schema}")
        elif not isinstance(fmt.get("schema"), dict):
            problems.append("output_config.format.schema: expected an object")
        else:
            _walk_anthropic(fmt["schema"], "output_config.format.schema", problems)
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        names = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
        if kind not in ("auto", "any", "tool", "none"):
            problems.append(f"tool_choice: unknown type {kind!r}")
        if kind == "tool" and choice.get("name") not in names:
            problems.append(f"tool_choice: no tool named {choice.get('name')!r} in tools")
        if kind in ("any", "tool") and isinstance(body.get("thinking"), dict):
            problems.append("Thinking may not be enabled when tool_choice forces tool use.")
    for i, declared in enumerate(body.get("tools") or []):
        schema = declared.get("input_schema") if isinstance(declared, dict) else None
        if not isinstance(schema, dict) or schema.get("type") != "object":
            problems.append(f"tools[{i}].input_schema: the root must be type object")
    return problems


def _walk_anthropic(node: Any, path: str, problems: list[str]) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk_anthropic(item, f"{path}[{i}]", problems)
        return
    if not isinstance(node, dict):
        return
    for keyword in _ANTHROPIC_REFUSED:
        if keyword in node:
            problems.append(f"{path}: '{keyword}' is not supported in structured outputs")
    if (node.get("type") == "object" or "properties" in node) and (
        node.get("additionalProperties") is not False
    ):
        problems.append(f"{path}: objects must set additionalProperties to false")
    for key, value in node.items():
        if key not in _NOT_SCHEMAS:
            _walk_anthropic(value, f"{path}.{key}", problems)


def _openai_format(fmt: Any, path: str) -> list[str]:
    if not isinstance(fmt, dict):
        return [f"{path}: expected an object"]
    problems: list[str] = []
    name = fmt.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        problems.append(f"{path}.name: must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        problems.append(f"{path}.schema: the root must be type object")
    elif fmt.get("strict") is True:
        _walk_strict(schema, f"{path}.schema", problems)
    return problems


def _walk_strict(node: Any, path: str, problems: list[str]) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk_strict(item, f"{path}[{i}]", problems)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "object" or "properties" in node:
        if node.get("additionalProperties") is not False:
            problems.append(f"{path}: strict mode: additionalProperties must be false")
        missing = set(node.get("properties") or {}) - set(node.get("required") or ())
        if missing:
            problems.append(f"{path}: strict mode: every property must be required, "
                            f"missing {sorted(missing)}")
    for key, value in node.items():
        if key not in _NOT_SCHEMAS:
            _walk_strict(value, f"{path}.{key}", problems)
