"""Output schemas (R-OUT-1), pure: what attrs classes and TypedDicts become, what the
validator finds, and the wire forms the providers that restrict JSON Schema get."""

from __future__ import annotations

import enum
from typing import Literal, NotRequired, TypedDict

import attrs
import pytest

from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.structured import (
    AnswerCheck,
    OutputSchemaError,
    anthropic_native_model,
    anthropic_schema,
    example_value,
    openai_strict,
    output_spec,
    parse_text_answer,
    validate,
)


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@attrs.frozen
class Line:
    """One line of an invoice."""

    item: str
    quantity: int
    price: float


@attrs.frozen
class Invoice:
    """An invoice as the model read it."""

    customer: str
    lines: list[Line]
    currency: Literal["EUR", "USD"]
    colour: Colour
    note: str | None = None
    tags: tuple[str, ...] = ()


class Person(TypedDict):
    name: str
    age: NotRequired[int]


def test_an_attrs_class_becomes_a_closed_object_schema_with_its_required_fields() -> None:
    spec = output_spec(Invoice)
    schema = spec.schema
    assert spec.name == "Invoice" and spec.python_type is Invoice
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert schema["description"] == "An invoice as the model read it."
    assert schema["required"] == ["customer", "lines", "currency", "colour"]
    props = schema["properties"]
    assert props["lines"]["items"]["required"] == ["item", "quantity", "price"]
    assert props["currency"] == {"enum": ["EUR", "USD"]}
    assert props["colour"] == {"enum": ["red", "blue"]}
    assert props["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}


def test_the_answer_is_built_into_the_class() -> None:
    spec = output_spec(Invoice)
    value = {
        "customer": "ACME",
        "lines": [{"item": "widget", "quantity": 2, "price": 9.5}],
        "currency": "EUR",
        "colour": "red",
    }
    assert validate(value, spec.schema) == []
    built = spec.build(value)
    assert built == Invoice(
        customer="ACME", lines=[Line("widget", 2, 9.5)], currency="EUR", colour=Colour.RED
    )


def test_a_typeddict_keeps_its_optional_keys_optional_and_builds_a_dict() -> None:
    spec = output_spec(Person)
    assert spec.schema["required"] == ["name"]
    assert set(spec.schema["properties"]) == {"name", "age"}
    assert spec.python_type is None and spec.build({"name": "Ada"}) == {"name": "Ada"}


def test_a_dict_schema_must_describe_an_object() -> None:
    assert output_spec({"properties": {"a": {"type": "string"}}}).schema["type"] == "object"
    assert output_spec({"type": "object", "title": "Weather report!"}).name == "Weather_report"
    with pytest.raises(OutputSchemaError, match="must describe an object"):
        output_spec({"type": "array"})
    with pytest.raises(OutputSchemaError, match="not JSON"):
        output_spec({"type": "object", "default": object()})
    with pytest.raises(OutputSchemaError, match="attrs class or a TypedDict"):
        output_spec(int)


@attrs.frozen
class Node:
    children: list[Node]


def test_a_recursive_class_is_refused() -> None:
    with pytest.raises(OutputSchemaError, match="refers to itself"):
        output_spec(Node)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "pattern": "^[A-Z]"},
        "age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2,
                 "uniqueItems": True},
        "kind": {"const": "person"},
        "score": {"type": "number", "multipleOf": 0.5},
        "id": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        "ref": {"$ref": "#/$defs/Point"},
        "any": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
    "$defs": {
        "Point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    },
}


def test_a_matching_value_has_no_problems() -> None:
    value = {"name": "Ada", "age": 36, "kind": "person", "tags": ["a"], "score": 1.5,
             "id": 3, "ref": {"x": 1}, "any": None}
    assert validate(value, SCHEMA) == []


def test_problems_name_the_path_and_what_is_wrong() -> None:
    value = {"name": "a", "age": 150, "tags": ["a", "c", "a"], "score": 0.3, "id": True,
             "ref": {}, "any": 3, "extra": 1, "kind": "robot"}
    problems = validate(value, SCHEMA)
    assert "$.name: at least 2 characters expected, got 1" in problems
    assert "$.name: does not match the pattern '^[A-Z]'" in problems
    assert "$.age: expected less than 150, got 150" in problems
    assert '$.tags[1]: expected one of "a", "b", got "c"' in problems
    assert "$.tags: at most 2 items expected, got 3" in problems
    assert "$.tags[2]: repeats an earlier item" in problems
    assert '$.kind: expected "person", got "robot"' in problems
    assert "$.score: expected a multiple of 0.5, got 0.3" in problems
    assert "$.id: must match exactly one of the allowed forms (oneOf), matches 0" in problems
    assert "$.ref.x: required property missing" in problems
    assert any(p.startswith("$.any: matches none of the allowed forms (anyOf)") for p in problems)
    assert "$.extra: unexpected property" in problems


def test_types_follow_json_not_python() -> None:
    assert validate({"n": True}, {"properties": {"n": {"type": "integer"}}}) == [
        "$.n: expected integer, got boolean"
    ]
    assert validate({"n": 2.0}, {"properties": {"n": {"type": "integer"}}}) == []
    assert validate(1, {"enum": [True]}) == ["$: expected one of true, got 1"]
    assert validate({"a": None}, {"required": ["a", "b c"]}) == [
        '$["b c"]: required property missing'
    ]


def test_a_ref_cycle_does_not_hang() -> None:
    schema = {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}
    assert validate({}, schema) == ["$: nested too deeply"]


def test_text_answers_are_json_with_or_without_a_fence() -> None:
    assert parse_text_answer('```json\n{"a": 1}\n```') == ({"a": 1}, [])
    assert parse_text_answer(' {"a": 1} ') == ({"a": 1}, [])
    value, problems = parse_text_answer("Sure! Here it is.")
    assert value is None and problems[0].startswith("$: the answer is not JSON (")
    assert parse_text_answer("")[1] == [
        "$: the answer is empty: it must be JSON matching the output schema"
    ]


def test_the_answer_check_counts_invalid_answers_across_attempts() -> None:
    check = AnswerCheck(output_spec(Person).schema)
    check.begin_attempt()
    check.text(TextBlock(text='{"age": 3}'))
    check.message_ended(with_calls=False)
    assert check.failures == 1 and not check.answered
    assert check.problems == ("$.name: required property missing",)
    check.begin_attempt()
    call = ToolCallBlock(id="c1", name="final_answer", arguments={"name": "Ada"})
    check.call_result(call, ok=True)
    assert check.answered and check.answer == {"name": "Ada"} and not check.exhausted
    check.begin_attempt()
    bad = ToolCallBlock(id="c2", name="final_answer", arguments={}, invalid_arguments="[1")
    check.call_result(bad, ok=False)
    assert check.exhausted and check.answer is None
    assert check.failure_message() == (
        "the answer does not match the output schema after 1 repair round: "
        "$: the arguments are malformed JSON: expecting ',' delimiter at character 2"
    )


def test_anthropic_gets_closed_objects_and_its_refused_keywords_in_words() -> None:
    wire = anthropic_schema(SCHEMA)
    assert wire is not None
    assert wire["$defs"]["Point"]["additionalProperties"] is False
    age = wire["properties"]["age"]
    assert "minimum" not in age and age["description"] == (
        "(minimum: 0, exclusiveMaximum: 150)"
    )
    assert SCHEMA["properties"]["age"]["minimum"] == 0  # type: ignore[index]
    assert anthropic_schema({"type": "object", "additionalProperties": {"type": "string"}}) is None


def test_anthropic_native_structured_output_is_for_claude_4_5_and_later() -> None:
    for model in ("claude-sonnet-4-5", "claude-opus-4-6", "claude-haiku-4-5-20251001",
                  "claude-sonnet-5-5", "claude-opus-5"):
        assert anthropic_native_model(model), model
    for model in ("claude-sonnet-4-20250514", "claude-opus-4-1", "claude-3-5-sonnet-latest",
                  "gpt-4o", "my-proxy-alias"):
        assert not anthropic_native_model(model), model


def test_openai_strict_only_for_closed_objects_with_every_property_required() -> None:
    assert openai_strict(output_spec(Line).schema)
    assert not openai_strict(output_spec(Invoice).schema)  # note and tags have defaults
    assert not openai_strict({"type": "object", "properties": {}})


def test_the_example_value_of_a_schema_matches_it() -> None:
    """What the scripted model answers a structured task with."""
    for schema in (output_spec(Invoice).schema, output_spec(Person).schema,
                   {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3},
                                                     "s": {"type": "string", "minLength": 9},
                                                     "a": {"type": "array", "minItems": 2,
                                                           "items": {"$ref": "#/$defs/P"}}},
                    "required": ["n", "s", "a"],
                    "$defs": {"P": {"type": "object", "properties": {"x": {"const": 1}},
                                    "required": ["x"]}}}):
        value = example_value(schema)
        assert validate(value, schema) == [], (schema, value)


@pytest.mark.parametrize("number", [float("inf"), float("-inf"), float("nan")])
def test_a_schema_holding_a_non_finite_number_is_refused(number: float) -> None:
    """A bound that is not finite would be recorded as ``Infinity``/``NaN``, which no JSON
    reader of the trace or of a replay takes: the schema is refused, not copied."""
    schema = {"type": "object", "properties": {"a": {"type": "number", "maximum": number}}}
    with pytest.raises(OutputSchemaError, match="not JSON"):
        output_spec(schema)
