"""The @tool decorator: schemas from annotations and docstrings, validation, results."""

from __future__ import annotations

from typing import Any, Literal

import pytest

from greenroom.protocols.content import ImageBlock, TextBlock
from greenroom.protocols.tools import (
    Tool,
    ToolContext,
    ToolDefinitionError,
    json_schema_for,
    normalize_result,
    tool,
    validate_json,
)


@tool(parallel=True)
async def everything(
    name: str,
    count: int,
    ratio: float,
    flag: bool,
    mode: Literal["fast", "slow"],
    note: str | None,
    tags: list[str],
    weights: dict[str, int],
    limit: int = 10,
    label: str = "x",
    *,
    ctx: ToolContext,
) -> str:
    """Do everything at once.

    A second paragraph of description.

    Args:
        name: who to greet.
        count: how many times,
            continued on a second line.
        ratio: a fraction.
        limit: the most results.
    """
    return name


def test_schema_types() -> None:
    props = everything.input_schema["properties"]
    assert props["name"]["type"] == "string"
    assert props["count"]["type"] == "integer"
    assert props["ratio"]["type"] == "number"
    assert props["flag"] == {"type": "boolean"}
    assert props["mode"] == {"enum": ["fast", "slow"], "type": "string"}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["weights"] == {"type": "object", "additionalProperties": {"type": "integer"}}


def test_schema_required_defaults_and_ctx() -> None:
    schema = everything.input_schema
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert schema["required"] == [
        "name", "count", "ratio", "flag", "mode", "note", "tags", "weights"
    ]
    assert schema["properties"]["limit"]["default"] == 10
    assert schema["properties"]["label"]["default"] == "x"
    assert "ctx" not in schema["properties"]
    assert "ctx" not in schema["required"]
    assert everything.takes_ctx


def test_schema_descriptions_from_docstring() -> None:
    props = everything.input_schema["properties"]
    assert everything.description == "Do everything at once.\n\nA second paragraph of description."
    assert props["name"]["description"] == "who to greet."
    assert props["count"]["description"] == "how many times, continued on a second line."
    assert props["limit"]["description"] == "the most results."
    assert "description" not in props["flag"]


def test_tool_flags_and_names() -> None:
    assert everything.name == "everything"
    assert everything.parallel is True
    assert everything.side_effects is False

    @tool
    async def bare(x: int) -> str:
        return str(x)

    assert isinstance(bare, Tool)
    assert bare.parallel is False
    assert bare.side_effects is True
    assert bare.takes_ctx is False
    assert bare.description == "bare"

    @tool(name="renamed", description="custom", parallel=True, side_effects=True)
    async def original() -> None:
        """Ignored docstring."""

    assert original.name == "renamed"
    assert original.description == "custom"
    assert original.side_effects is True
    assert original.schema.name == "renamed"
    assert original.input_schema["properties"] == {}


def test_non_async_function_rejected() -> None:
    def plain(x: int) -> int:
        return x

    with pytest.raises(ToolDefinitionError, match="must be an async function"):
        tool(plain)  # type: ignore[arg-type]


def test_unsupported_annotations_rejected() -> None:
    async def bad_keys(mapping: dict[int, str]) -> None:
        pass

    async def varargs(*items: str) -> None:
        pass

    async def opaque(thing: object) -> None:
        pass

    with pytest.raises(ToolDefinitionError, match="dict keys must be str"):
        tool(bad_keys)
    with pytest.raises(ToolDefinitionError, match=r"\*args"):
        tool(varargs)
    with pytest.raises(ToolDefinitionError, match="no JSON schema"):
        tool(opaque)


def test_json_schema_for_tuples_and_any() -> None:
    assert json_schema_for(Any) == {}
    assert json_schema_for(tuple[int, ...]) == {"type": "array", "items": {"type": "integer"}}
    assert json_schema_for(tuple[int, str]) == {
        "type": "array",
        "prefixItems": [{"type": "integer"}, {"type": "string"}],
        "minItems": 2,
        "maxItems": 2,
    }


VALID: dict[str, Any] = {
    "name": "a",
    "count": 1,
    "ratio": 2,
    "flag": True,
    "mode": "fast",
    "note": None,
    "tags": ["x"],
    "weights": {"k": 3},
}


def test_valid_arguments_have_no_errors() -> None:
    assert everything.validate(VALID) == []
    assert everything.validate({**VALID, "note": "text", "limit": 5}) == []


def test_validation_messages_have_paths() -> None:
    bad = {
        **VALID,
        "count": "1",
        "flag": 1,
        "mode": "medium",
        "tags": ["ok", 2],
        "weights": {"k": 1.5},
        "extra": 0,
    }
    del bad["name"]
    errors = everything.validate(bad)
    assert "$.name: required property missing" in errors
    assert "$.count: expected integer, got string" in errors
    assert "$.flag: expected boolean, got integer" in errors
    assert "$.mode: expected one of ['fast', 'slow'], got 'medium'" in errors
    assert "$.tags[1]: expected string, got integer" in errors
    assert "$.weights.k: expected integer, got number" in errors
    assert "$.extra: unexpected property" in errors
    assert len(errors) == 7


def test_validation_rejects_bool_as_number_and_checks_unions() -> None:
    assert everything.validate({**VALID, "ratio": True}) == [
        "$.ratio: expected number, got boolean"
    ]
    assert everything.validate({**VALID, "note": 3}) == ["$.note: expected one of: string, null"]
    assert validate_json([1, "a"], json_schema_for(tuple[int, str])) == []
    assert validate_json([1], json_schema_for(tuple[int, str])) == ["$: expected 2 items, got 1"]
    assert validate_json("x", {"type": "object"}) == ["$: expected object, got string"]


def test_normalize_result() -> None:
    image = ImageBlock(path="a.png", media_type="image/png")
    assert normalize_result("hi") == (TextBlock(text="hi"),)
    assert normalize_result(None) == (TextBlock(text=""),)
    assert normalize_result(TextBlock(text="t")) == (TextBlock(text="t"),)
    assert normalize_result(image) == (image,)
    assert normalize_result(["a", image]) == (TextBlock(text="a"), image)
    assert normalize_result(("a", "b")) == (TextBlock(text="a"), TextBlock(text="b"))
    assert normalize_result(42) == (TextBlock(text="42"),)
    assert normalize_result({"k": 1}) == (TextBlock(text="{'k': 1}"),)
    # A list that is not all blocks or strings is one text, not a partial conversion.
    assert normalize_result(["a", 1]) == (TextBlock(text="['a', 1]"),)
