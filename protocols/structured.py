"""Structured output (R-OUT-1): the schema a task's answer must match, and the checks, pure.

``Session.run(…, output_schema=SCHEMA)`` takes a JSON Schema dict, an attrs class or a
``TypedDict``; :func:`output_spec` turns it into an :class:`OutputSpec`: the JSON Schema
(its root is always an object: every provider's structured output and tool input needs
one), the name the providers are given, and how the validated JSON becomes the value the
host gets (a dict, or an instance of the class).

A model gives its answer in one of two ways, and the runtime takes either, whatever the
provider was asked for:

* **natively** — the provider constrains the model's last message to the schema (OpenAI
  ``response_format``, Responses ``text.format``, Anthropic ``output_config.format``): the
  answer is the text of a message with no tool calls, as JSON;
* **through the final tool** — the request offers a synthetic tool :data:`FINAL_ANSWER`
  whose input schema is the schema, and names it in ``tool_choice`` (or asks for any tool
  while the session has others, so the model may call them first): the answer is that
  call's arguments. The runtime decides the call itself (no approval, no hook: it runs
  nothing) and its result tells the model whether the answer was taken.

Either way the answer is validated (:func:`validate`: the subset of JSON Schema that attrs
classes and TypedDicts produce, plus the common keywords — ``type``, ``properties``,
``required``, ``additionalProperties``, ``items``, ``prefixItems``, ``enum``, ``const``,
``anyOf``, ``oneOf``, ``allOf``, ``not``, ``minimum``/``maximum`` and their exclusive forms,
``multipleOf``, ``minLength``/``maxLength``, ``pattern``, ``minItems``/``maxItems``,
``uniqueItems``, ``minProperties``/``maxProperties``, local ``$ref``; others, ``format``
among them, are not checked). The check is bounded work whatever the schema and the
answer (R-SEC-1): patterns run in :mod:`greenroom.protocols.pattern`, never in ``re``,
the whole check stops at its :func:`check_budget` (linear in the answer's length), and
:func:`output_spec` refuses a schema it could not check in time. An invalid answer is sent
back once with its problems (:data:`ANSWER_ATTEMPTS`); a second invalid one fails the task
naming them.
:class:`AnswerCheck` keeps that account for the task record: a fold of the trace, so a task
taken up elsewhere knows how many answers it has had (a trace file a compaction started
counts those before it in its first record: :meth:`AnswerCheck.carry`).

The wire forms of a schema for the providers that restrict JSON Schema —
:func:`anthropic_schema`, :func:`openai_strict` — are here too, next to the validator that
enforces what they leave out.
"""

from __future__ import annotations

import copy
import enum
import json
import math
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import (
    Any,
    Literal,
    NotRequired,
    Required,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

import attrs
import cattrs

from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import OutputFormat, ToolSchema
from greenroom.protocols.errors import OutputSchemaError
from greenroom.protocols.pattern import MAX_PROGRAM, Pattern, PatternError, compile_pattern
from greenroom.protocols.text import json_type_name
from greenroom.protocols.tools import (
    MAX_ARGUMENT_DEPTH,
    NotAJsonNumber,
    decode_strict_json,
    invalid_arguments_reason,
    json_text_too_deep,
)

__all__ = [
    "ANSWER_ACCEPTED_TEXT",
    "ANSWER_ATTEMPTS",
    "FINAL_ANSWER",
    "AnswerCheck",
    "OutputSchemaError",
    "OutputSpec",
    "answer_rejected_text",
    "anthropic_native_model",
    "anthropic_schema",
    "check_budget",
    "check_call",
    "example_value",
    "final_answer_tool",
    "openai_strict",
    "output_spec",
    "parse_text_answer",
    "recorded_spec",
    "repair_note",
    "schema_name",
    "validate",
]

FINAL_ANSWER = "final_answer"
"""The synthetic tool a model answers through when its provider has no native structured
output for it (R-OUT-1). A session may not have a tool of this name while a task of it
asks for an ``output_schema``."""

ANSWER_ATTEMPTS = 2
"""How many answers a task gets: the first, and one repair round with its problems."""

ANSWER_ACCEPTED_TEXT = "Answer recorded."
"""The result of a ``final_answer`` call whose arguments match the schema."""

MAX_PROBLEMS = 20
"""At most this many problems are reported for one answer (the model and the person
reading the failure need the first few, not thousands)."""

MAX_CHECK_WORK = 100_000
"""The work any answer's check may take (R-SEC-1): a sub-schema checked against a value
counts 4, a character a ``pattern`` reads counts the states it moves, an ``enum`` value or
an item of a ``uniqueItems`` array counts 1. A long answer may take
:data:`CHECK_WORK_PER_CHAR` more for each character of its JSON (:func:`check_budget`).
The check runs on the event loop that serves every session, so past its budget it stops,
and the answer fails with :data:`TOO_COSTLY`."""

CHECK_WORK_PER_CHAR = 2
"""The work each character of an answer's JSON adds to its check's budget: a check grows
with the answer (a value is a few characters and costs about 4 a schema it meets) and
stays linear in what the model wrote whatever the schema — at most about a microsecond of
the event loop a character (an ordinary schema takes a fifth of that)."""

TOO_COSTLY = (
    "$: the output schema is too costly to check against this answer (more than "
    f"{MAX_CHECK_WORK} steps and {CHECK_WORK_PER_CHAR} a character of the answer): "
    "simplify the schema (fewer nested anyOf/oneOf and $ref) or ask for a smaller answer"
)
"""The problem of an answer whose check ran out of its :func:`check_budget`."""

MAX_PATTERN_WORK = 50_000
"""The ``pattern`` keywords of one ``output_schema`` may hold at most this many characters
and automaton states in all (each distinct pattern counted once): reading them is work
too, done when the schema is given."""

MAX_SCHEMA_NODES = 50_000
"""An ``output_schema`` may hold at most this many sub-schemas, counting each ``$ref`` as
the schema it names (R-SEC-1): chained ``anyOf`` of ``$ref`` can otherwise ask for a number
of checks that doubles with every link."""


# -- the spec ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True, slots=True)
class OutputSpec:
    """A task's required answer: ``schema`` (JSON Schema, object root), ``name`` (what the
    providers call it) and ``python_type`` (the attrs class the answer is built into;
    None: the answer is the validated dict)."""

    name: str
    schema: dict[str, Any] = attrs.field(eq=False)
    python_type: type | None = attrs.field(default=None, eq=False)

    def build(self, value: dict[str, Any]) -> Any:
        """The host's value of a validated answer: the dict itself, or an instance of the
        attrs class (raises :class:`OutputSchemaError` when the class refuses it — its own
        validators can be stricter than its schema)."""
        if self.python_type is None:
            return value
        try:
            return cattrs.Converter().structure(value, self.python_type)
        except Exception as exc:
            raise OutputSchemaError(
                f"the answer matches the schema but {self.python_type.__name__} refused it: "
                f"{exc}"
            ) from exc


def output_spec(schema: Any) -> OutputSpec:
    """The :class:`OutputSpec` of ``schema``: a JSON Schema dict (its root an object), an
    attrs class, a ``TypedDict``, or an :class:`OutputSpec` already. Raises
    :class:`OutputSchemaError` saying why one cannot be used."""
    if isinstance(schema, OutputSpec):
        return schema
    if isinstance(schema, Mapping):
        checked = _checked_dict(schema)
        return OutputSpec(name=schema_name(checked), schema=checked)
    if isinstance(schema, type) and (attrs.has(schema) or is_typeddict(schema)):
        generated = _class_schema(schema, ())
        return OutputSpec(
            name=schema_name(generated),
            schema=generated,
            python_type=schema if attrs.has(schema) else None,
        )
    raise OutputSchemaError(
        f"output_schema must be a JSON Schema dict, an attrs class or a TypedDict, "
        f"not {type(schema).__name__}"
    )


def recorded_spec(schema: Mapping[str, Any]) -> OutputSpec:
    """The :class:`OutputSpec` of a schema read from a trace: taken as it was recorded, not
    refused again (a host of an earlier version may have accepted a pattern this one
    refuses, and the task must not be lost). Its answers are still checked within
    their :func:`check_budget`, and a pattern that cannot run is a problem of the answer."""
    return OutputSpec(name=schema_name(schema), schema=dict(schema))


def _checked_dict(schema: Mapping[str, Any]) -> dict[str, Any]:
    try:
        # allow_nan=False: an infinite bound would be recorded as ``Infinity``, which no
        # reader of the trace or of a replayed frame (a browser's JSON.parse) takes.
        copied = json.loads(json.dumps(schema, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise OutputSchemaError(f"output_schema is not JSON: {exc}") from None
    except RecursionError:
        raise OutputSchemaError("output_schema is nested too deeply") from None
    root = copied.get("type")
    if root != "object" and not (root is None and "properties" in copied):
        raise OutputSchemaError(
            'output_schema must describe an object ({"type": "object", …}): providers '
            "take structured answers and tool inputs as objects only"
        )
    copied.setdefault("type", "object")
    _check_cost(copied)
    return dict(copied)


_VALUES = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are data, not schemas: a ``pattern`` key inside is no pattern."""


def _check_cost(schema: dict[str, Any]) -> None:
    """Refuse, before any answer is asked for, a schema whose checks could hold the event
    loop (R-SEC-1): a ``pattern`` that cannot be matched in linear time, or more than
    :data:`MAX_SCHEMA_NODES` sub-schemas once each ``$ref`` is counted as its target."""
    sizes: dict[str, int] = {}
    resolver = _Validator(schema, [])
    patterns: set[str] = set()
    pattern_work = 0

    def check_pattern(source: str) -> None:
        nonlocal pattern_work
        if source in patterns:
            return
        patterns.add(source)
        pattern_work += len(source)
        if pattern_work <= MAX_PATTERN_WORK:
            try:
                pattern_work += len(compile_pattern(source))
            except PatternError as exc:
                raise OutputSchemaError(f"output_schema's pattern {source!r} {exc}") from None
        if pattern_work > MAX_PATTERN_WORK:
            raise OutputSchemaError(
                f"output_schema's patterns are too large to check answers against: more "
                f"than {MAX_PATTERN_WORK} characters and states in all"
            )

    def size(node: Any, refs: tuple[str, ...]) -> int:
        # Iterative over the tree itself; recursive only through $ref, each named once per
        # chain (a cycle counts once: the answer's own size bounds a recursive schema).
        total = 0
        stack = [node]
        while stack:
            item = stack.pop()
            total += 1
            if total > MAX_SCHEMA_NODES:
                return total
            if isinstance(item, list):
                stack.extend(item)
                continue
            if not isinstance(item, dict):
                continue
            pattern = item.get("pattern")
            if isinstance(pattern, str):
                check_pattern(pattern)
            ref = item.get("$ref")
            if isinstance(ref, str) and ref not in refs:
                if ref not in sizes:
                    sizes[ref] = size(resolver.resolve(ref), (*refs, ref))
                total += sizes[ref]
            stack.extend(v for k, v in item.items() if k not in _VALUES)
        return total

    try:
        total = size(schema, ())
    except RecursionError:
        total = MAX_SCHEMA_NODES + 1  # a chain of $ref longer than any schema needs
    if total > MAX_SCHEMA_NODES:
        raise OutputSchemaError(
            f"output_schema is too large to check answers against: more than "
            f"{MAX_SCHEMA_NODES} sub-schemas once each $ref is counted as the schema it names"
        )


_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")


def schema_name(schema: Mapping[str, Any]) -> str:
    """The name the providers are given for ``schema``: its ``title`` made of the
    characters they accept (at most 64), else ``answer``."""
    title = schema.get("title")
    name = _NAME_CHARS.sub("_", title).strip("_")[:64] if isinstance(title, str) else ""
    return name or "answer"


_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _class_schema(cls: type, seen: tuple[type, ...]) -> dict[str, Any]:
    """An attrs class or TypedDict as an object schema: every field a property, those
    without a default (the TypedDict's required keys) required, nothing else allowed."""
    if cls in seen:
        raise OutputSchemaError(f"{cls.__name__} refers to itself: recursive types have no "
                                "schema every provider takes")
    try:
        hints = get_type_hints(cls)
    except Exception as exc:
        raise OutputSchemaError(f"cannot read the annotations of {cls.__name__}: {exc}") from None
    inner = (*seen, cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    if attrs.has(cls):
        for field in attrs.fields(cls):
            name = field.name  # the key cattrs builds the instance from
            properties[name] = _annotation_schema(hints.get(field.name, Any), inner, name)
            if field.default is attrs.NOTHING:
                required.append(name)
    else:
        # Read from the annotations themselves: with postponed annotations (PEP 563) the
        # class's __required_keys__ cannot see a NotRequired[…] written as a string.
        total = getattr(cls, "__total__", True)
        for name, annotation in get_type_hints(cls, include_extras=True).items():
            wrapper = get_origin(annotation)
            if wrapper is NotRequired or wrapper is Required:
                (annotation,) = get_args(annotation)
            properties[name] = _annotation_schema(annotation, inner, name)
            if wrapper is Required or (total and wrapper is not NotRequired):
                required.append(name)
    schema: dict[str, Any] = {"type": "object", "title": cls.__name__}
    doc = (cls.__doc__ or "").strip()
    if doc:  # the class's first paragraph tells the model what the answer is
        schema["description"] = doc.split("\n\n", 1)[0]
    schema.update(properties=properties, required=required, additionalProperties=False)
    return schema


def _annotation_schema(annotation: Any, seen: tuple[type, ...], where: str) -> dict[str, Any]:
    if annotation is Any:
        return {}
    if annotation is None or annotation is type(None):
        return {"type": "null"}
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if isinstance(annotation, type):
        if attrs.has(annotation) or is_typeddict(annotation):
            return _class_schema(annotation, seen)
        if issubclass(annotation, enum.Enum):
            return {"enum": [member.value for member in annotation]}
        if annotation in (list, tuple, set, frozenset):
            return {"type": "array"}
        if annotation is dict:
            return {"type": "object"}
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (list, set, frozenset, Sequence) or (
        origin is tuple and len(args) == 2 and args[1] is Ellipsis
    ):
        items = _annotation_schema(args[0], seen, where) if args else {}
        unique = {"uniqueItems": True} if origin in (set, frozenset) else {}
        return {"type": "array", "items": items, **unique}
    if origin is tuple:
        return {
            "type": "array",
            "prefixItems": [_annotation_schema(a, seen, where) for a in args],
            "minItems": len(args),
            "maxItems": len(args),
        }
    if origin in (dict, Mapping):
        if args and args[0] is not str:
            raise OutputSchemaError(f"{where}: JSON object keys are strings, not {args[0]!r}")
        values = _annotation_schema(args[1], seen, where) if args else {}
        return {"type": "object", "additionalProperties": values}
    if origin in (Union, types.UnionType):
        return {"anyOf": [_annotation_schema(a, seen, where) for a in args]}
    raise OutputSchemaError(f"{where}: no JSON schema for the annotation {annotation!r}")


# -- validation -------------------------------------------------------------------------


def check_budget(answer_chars: int) -> int:
    """The work the check of an answer of ``answer_chars`` characters of JSON may take:
    :data:`MAX_CHECK_WORK` and :data:`CHECK_WORK_PER_CHAR` for each character."""
    return MAX_CHECK_WORK + CHECK_WORK_PER_CHAR * max(answer_chars, 0)


def validate(
    value: Any, schema: Mapping[str, Any], *, answer_chars: int | None = None
) -> list[str]:
    """The problems of ``value`` (decoded JSON) against ``schema`` as ``$.path: what is
    wrong`` lines, at most :data:`MAX_PROBLEMS`; empty when it matches. Never raises:
    a keyword it does not know is not checked. ``answer_chars`` is the length of the JSON
    ``value`` was decoded from (measured again when not given): it sets the work the check
    may take (:func:`check_budget`)."""
    problems: list[str] = []
    if answer_chars is None:
        answer_chars = _json_chars(value)
    try:
        _Validator(schema, problems, work=_Work(check_budget(answer_chars))).check(
            value, schema, "$"
        )
    except _TooCostly:
        return [*problems[: MAX_PROBLEMS - 1], TOO_COSTLY]
    except RecursionError:
        # Within both bounds a schema can still nest past Python's stack: a problem of
        # the answer, never a failed task.
        return [*problems[: MAX_PROBLEMS - 1], "$: nested too deeply to check"]
    return problems[:MAX_PROBLEMS]


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` is ``1.0``, objects ignore key order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _show(value: Any) -> str:
    if isinstance(value, str) and len(value) > 60:
        value = value[:60]  # not the whole of a long text, to show its start
    elif isinstance(value, list | dict) and len(value) > 20:
        members = "items" if isinstance(value, list) else "properties"
        return f"an {json_type_name(value)} of {len(value)} {members}"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "…"


def _json_key(value: Any) -> str:
    """A text equal for two values exactly when :func:`_same` holds: uniqueness in linear
    time, not by comparing every pair."""
    return json.dumps(_canonical(value), sort_keys=True, ensure_ascii=False)


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    if isinstance(value, dict):
        return {key: _canonical(item) for key, item in value.items()}
    return value


def _json_chars(value: Any) -> int:
    """The length of ``value`` as compact JSON; 0 when it is not JSON (the check then has
    the least budget, and says what is wrong)."""
    try:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except (TypeError, ValueError, RecursionError):
        return 0


def _key_path(path: str, key: str) -> str:
    # An ASCII identifier is exactly [A-Za-z_][A-Za-z0-9_]*, without a regex per key.
    if key.isascii() and key.isidentifier():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


class _TooCostly(Exception):
    """The check ran out of its :func:`check_budget`."""


class _Work:
    """The work left to one answer's check, shared by every probe of its combinators, and
    the patterns it compiled."""

    __slots__ = ("left", "patterns")

    def __init__(self, budget: int = MAX_CHECK_WORK) -> None:
        self.left = budget
        self.patterns: dict[str, Pattern | str] = {}

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < 0:
            raise _TooCostly

    def pattern(self, source: str) -> Pattern | str:
        """The compiled pattern, or why it cannot be checked."""
        if source not in self.patterns:
            self.spend(len(source))  # reading it is work too, before any state is built
            try:
                self.patterns[source] = compiled = compile_pattern(source)
                self.spend(len(compiled))
            except PatternError as exc:
                self.patterns[source] = str(exc)
                self.spend(MAX_PROGRAM)
        return self.patterns[source]


MAX_SCHEMA_STEPS = 64
"""How many sub-schemas (``$ref``, ``allOf``/``anyOf``/``oneOf``/``not``) one part of an
answer is checked through, one inside the other: more is a ``$ref`` cycle that never
reaches a part of the value (``nested too deeply``)."""


class _Validator:
    """One validation: the root (for ``$ref``), the problems found so far and the work
    left (:func:`check_budget`). ``depth`` is how deep the part checked lies in the answer
    (at most :data:`~greenroom.protocols.tools.MAX_ARGUMENT_DEPTH`, as any answer's),
    ``steps`` the sub-schemas it is being checked through (:data:`MAX_SCHEMA_STEPS`)."""

    __slots__ = ("_depth", "_steps", "_work", "problems", "root")

    def __init__(
        self,
        root: Mapping[str, Any],
        problems: list[str],
        depth: int = 0,
        work: _Work | None = None,
        steps: int = 0,
    ) -> None:
        self.root = root
        self.problems = problems
        self._depth = depth
        self._steps = steps
        self._work = work if work is not None else _Work()

    def check(self, value: Any, schema: Any, path: str) -> None:
        self._work.spend(4)
        if schema is True or schema == {}:
            return
        if schema is False:
            self.problems.append(f"{path}: no value is allowed here")
            return
        if not isinstance(schema, Mapping) or len(self.problems) >= MAX_PROBLEMS:
            return
        # Counted apart: a recursive schema takes several steps for each level of its
        # answer, and an answer as deep as any may be must be checked to its end.
        too_deep = self._depth >= MAX_ARGUMENT_DEPTH and isinstance(value, dict | list)
        if too_deep or self._steps > MAX_SCHEMA_STEPS:
            self.problems.append(f"{path}: nested too deeply")
            return
        self._steps += 1
        try:
            self._check(value, schema, path)
        finally:
            self._steps -= 1

    def _member(self, value: Any, schema: Any, path: str) -> None:
        """Check ``value``, a member of the value at hand, against ``schema``: a level
        deeper in the answer, its steps through sub-schemas counted anew."""
        steps, self._steps = self._steps, 0
        self._depth += 1
        try:
            self.check(value, schema, path)
        finally:
            self._depth -= 1
            self._steps = steps

    def _check(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self.resolve(ref)
            if target is None:
                self.problems.append(f"{path}: the schema's $ref {ref!r} names nothing")
                return
            self.check(value, target, path)
        if not self._type_ok(value, schema, path):
            return  # the other keywords would only restate it
        if "const" in schema and not _same(value, schema["const"]):
            self.problems.append(f"{path}: expected {_show(schema['const'])}, got {_show(value)}")
        enum_values = schema.get("enum")
        if isinstance(enum_values, list):
            self._work.spend(len(enum_values))
        if isinstance(enum_values, list) and not any(_same(value, e) for e in enum_values):
            allowed = ", ".join(_show(e) for e in enum_values)
            self.problems.append(f"{path}: expected one of {allowed}, got {_show(value)}")
        self._combinators(value, schema, path)
        if isinstance(value, dict):
            self._object(value, schema, path)
        elif isinstance(value, list):
            self._array(value, schema, path)
        elif isinstance(value, str):
            self._string(value, schema, path)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            self._number(value, schema, path)

    def resolve(self, ref: str) -> Any:
        """The sub-schema a local ``$ref`` names (``#/$defs/Point``), or None."""
        if not ref.startswith("#"):
            return None
        node: Any = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def _type_ok(self, value: Any, schema: Mapping[str, Any], path: str) -> bool:
        expected = schema.get("type")
        if expected is None:
            return True
        kinds = [expected] if isinstance(expected, str) else list(expected)
        if any(_TYPE_CHECKS.get(k, lambda _: True)(value) for k in kinds):
            return True
        wanted = " or ".join(kinds)
        self.problems.append(f"{path}: expected {wanted}, got {json_type_name(value)}")
        return False

    def _fails(self, value: Any, schema: Any, path: str) -> list[str]:
        """The problems of ``value`` against a sub-schema, kept apart."""
        probe = _Validator(self.root, [], self._depth, self._work, self._steps)
        probe.check(value, schema, path)
        return probe.problems

    def _combinators(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        for sub in schema.get("allOf") or ():
            self.check(value, sub, path)
        any_of = schema.get("anyOf")
        if isinstance(any_of, list) and any_of:
            failures: list[list[str]] = []
            for sub in any_of:
                failures.append(self._fails(value, sub, path))
                if not failures[-1]:
                    break  # one form matches: the others need no check
            if all(failures):
                closest = "; ".join(min(failures, key=len)[:3])
                # Nested anyOf nest their messages: the text is work too.
                self._work.spend(len(closest) // 32)
                self.problems.append(
                    f"{path}: matches none of the allowed forms (anyOf); the closest: {closest}"
                )
        one_of = schema.get("oneOf")
        if isinstance(one_of, list) and one_of:
            matching = 0
            for sub in one_of:
                matching += not self._fails(value, sub, path)
                if matching > 1:
                    break  # already more than one: the rest cannot change that
            if matching != 1:
                self.problems.append(
                    f"{path}: must match exactly one of the allowed forms (oneOf), "
                    f"matches {'more than one' if matching else 0}"
                )
        if "not" in schema and not self._fails(value, schema["not"], path):
            self.problems.append(f"{path}: matches a form that is not allowed (not)")

    def _object(self, value: dict[str, Any], schema: Mapping[str, Any], path: str) -> None:
        properties: Mapping[str, Any] = schema.get("properties") or {}
        for key in schema.get("required") or ():
            if key not in value:
                self.problems.append(f"{_key_path(path, key)}: required property missing")
        additional = schema.get("additionalProperties", True)
        for key, item in value.items():
            where = _key_path(path, key)
            if key in properties:
                self._member(item, properties[key], where)
            elif additional is False:
                self.problems.append(f"{where}: unexpected property")
            elif isinstance(additional, Mapping):
                self._member(item, additional, where)
        low, high = schema.get("minProperties"), schema.get("maxProperties")
        if isinstance(low, int) and len(value) < low:
            self.problems.append(f"{path}: at least {low} properties expected, got {len(value)}")
        if isinstance(high, int) and len(value) > high:
            self.problems.append(f"{path}: at most {high} properties expected, got {len(value)}")

    def _array(self, value: list[Any], schema: Mapping[str, Any], path: str) -> None:
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # the older tuple form of items
            prefix, items = items, schema.get("additionalItems", True)
        done = 0
        if isinstance(prefix, list):
            for i, (item, sub) in enumerate(zip(value, prefix, strict=False)):
                self._member(item, sub, f"{path}[{i}]")
            done = min(len(prefix), len(value))
        if items is not None and items is not True:
            for i in range(done, len(value)):
                self._member(value[i], items, f"{path}[{i}]")
        low, high = schema.get("minItems"), schema.get("maxItems")
        if isinstance(low, int) and len(value) < low:
            self.problems.append(f"{path}: at least {low} items expected, got {len(value)}")
        if isinstance(high, int) and len(value) > high:
            self.problems.append(f"{path}: at most {high} items expected, got {len(value)}")
        if schema.get("uniqueItems") is True:
            self._work.spend(len(value))
            seen: set[str] = set()
            for i, item in enumerate(value):
                key = _json_key(item)
                if key in seen:
                    self.problems.append(f"{path}[{i}]: repeats an earlier item")
                    break
                seen.add(key)

    def _string(self, value: str, schema: Mapping[str, Any], path: str) -> None:
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) and len(value) < low:
            self.problems.append(f"{path}: at least {low} characters expected, got {len(value)}")
        if isinstance(high, int) and len(value) > high:
            self.problems.append(f"{path}: at most {high} characters expected, got {len(value)}")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            compiled = self._work.pattern(pattern)
            if isinstance(compiled, str):
                self.problems.append(
                    f"{path}: the schema's pattern {pattern!r} cannot be checked: {compiled}"
                )
            elif not compiled.search(value, self._work.spend):
                self.problems.append(f"{path}: does not match the pattern {pattern!r}")

    def _number(self, value: float, schema: Mapping[str, Any], path: str) -> None:
        bounds: tuple[tuple[str, Callable[[float, float], bool], str], ...] = (
            ("minimum", lambda v, b: v >= b, "at least"),
            ("maximum", lambda v, b: v <= b, "at most"),
            ("exclusiveMinimum", lambda v, b: v > b, "more than"),
            ("exclusiveMaximum", lambda v, b: v < b, "less than"),
        )
        for keyword, holds, words in bounds:
            bound = schema.get(keyword)
            if not isinstance(bound, int | float) or isinstance(bound, bool):
                continue
            if not holds(value, bound):
                self.problems.append(f"{path}: expected {words} {bound}, got {_show(value)}")
        step = schema.get("multipleOf")
        if not isinstance(step, int | float) or isinstance(step, bool) or step <= 0:
            return
        if not _multiple(value, step):
            self.problems.append(f"{path}: expected a multiple of {step}, got {_show(value)}")


def _multiple(value: float, step: float) -> bool:
    if isinstance(value, int) and isinstance(step, int):
        return value % step == 0
    try:
        quotient = value / step
    except OverflowError:  # an integer too large for a float
        return True
    # Past 2**53 every float is whole: an infinite or huge quotient cannot be told apart.
    return not math.isfinite(quotient) or math.isclose(quotient, round(quotient), abs_tol=1e-9)


# -- answers ----------------------------------------------------------------------------

_FENCE = re.compile(r"^```(?:json)?\s*\n(.*)\n```\s*$", re.DOTALL)


def parse_text_answer(text: str) -> tuple[Any, list[str]]:
    """The JSON value of a message given as the answer (``(value, [])``), or why it is
    not one (``(None, [problem])``): no ``NaN`` or ``Infinity``, and nested no deeper
    than a call's arguments may be (:data:`~greenroom.protocols.tools.MAX_ARGUMENT_DEPTH`
    levels: every reader of the answer walks it recursively). A whole-message Markdown code
    fence is taken off: models without native structured output often add one."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced is not None:
        stripped = fenced.group(1).strip()
    if not stripped:
        return None, ["$: the answer is empty: it must be JSON matching the output schema"]
    if json_text_too_deep(stripped):
        return None, [f"$: the answer nests deeper than {MAX_ARGUMENT_DEPTH} levels"]
    try:
        return decode_strict_json(stripped), []
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, json.JSONDecodeError):
            reason = f"{exc.msg} at character {exc.pos}"
        else:
            reason = str(exc) if isinstance(exc, NotAJsonNumber) else "not valid JSON"
        return None, [f"$: the answer is not JSON ({reason})"]


EXAMPLE_LIMITS = (10_000, 100_000)
"""At most this many values and characters in one :func:`example_value`: a schema's
``minItems``/``minLength`` (or an object of objects through ``$ref``) may ask for more than
memory holds; past them arrays get fewer items and texts fewer characters (R-SEC-9)."""


def example_value(schema: Any, root: Mapping[str, Any] | None = None, depth: int = 0) -> Any:
    """A value of ``schema``'s simplest form: its ``const`` or first ``enum`` value,
    ``""``/``0``/``false`` (raised to a ``minimum`` or ``minLength``), the fewest items an
    array may have, every required property of an object, within :data:`EXAMPLE_LIMITS`.
    The scripted model answers with it; ``pattern`` and ``format`` are not honoured."""
    root = root if root is not None else (schema if isinstance(schema, Mapping) else {})
    return _Example(root).value(schema, depth)


class _Example:
    __slots__ = ("chars", "resolver", "values")

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.resolver = _Validator(root, [])
        self.values, self.chars = EXAMPLE_LIMITS

    def value(self, schema: Any, depth: int) -> Any:
        if not isinstance(schema, Mapping) or depth > 32 or self.values <= 0:
            return None
        self.values -= 1
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.value(self.resolver.resolve(ref), depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][0]
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.value(schema[key][0], depth + 1)
        kind = schema.get("type")
        kind = kind[0] if isinstance(kind, list) and kind else kind
        if kind == "object" or "properties" in schema:
            properties = schema.get("properties") or {}
            return {
                name: self.value(properties.get(name, {}), depth + 1)
                for name in schema.get("required") or ()
                if isinstance(name, str)
            }
        if kind == "array":
            count = schema.get("minItems", 0)
            count = min(count, self.values) if isinstance(count, int) else 0
            return [self.value(schema.get("items", {}), depth + 1) for _ in range(count)]
        if kind == "string":
            low = schema.get("minLength", 0)
            low = min(low, self.chars) if isinstance(low, int) else 0
            self.chars -= low
            return "example" + "x" * max(0, low - 7)
        if kind in ("integer", "number"):
            low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
            value = low if isinstance(low, int | float) else 0
            value = value + 1 if "exclusiveMinimum" in schema else value
            return math.ceil(value) if kind == "integer" else value
        if kind == "boolean":
            return False
        return None


def final_answer_tool(spec_schema: Mapping[str, Any]) -> ToolSchema:
    """The synthetic :data:`FINAL_ANSWER` tool of a request whose provider answers through
    a tool: its input schema is the output schema."""
    return ToolSchema(
        name=FINAL_ANSWER,
        description=(
            "Give your final answer: call this once, when you are done (after any other "
            "tool calls you need); its arguments are the answer, and they must match this "
            "schema."
        ),
        input_schema=dict(spec_schema),
    )


def answer_rejected_text(problems: Sequence[str]) -> str:
    """The result of a ``final_answer`` call whose arguments do not match the schema."""
    listed = "\n".join(f"- {p}" for p in problems)
    return (
        f"The answer does not match the output schema:\n{listed}\n"
        f"Call {FINAL_ANSWER} again with a corrected answer."
    )


def repair_note(problems: Sequence[str]) -> str:
    """The steering that asks again for an answer given as text that did not match."""
    listed = "\n".join(f"- {p}" for p in problems)
    return (
        f"Your answer does not match the required output schema:\n{listed}\n"
        "Answer again with only the corrected JSON "
        f"(through the {FINAL_ANSWER} tool when you have it)."
    )


class AnswerCheck:
    """The answers of one task that requires ``schema``, as its trace records them: the
    task record feeds it the outputs of the task (a fold, like the rest of the record).

    An answer is the arguments of a :data:`FINAL_ANSWER` call with an ``ok`` result (the
    runtime validated them), or the text of a message that ended without tool calls. Each
    new attempt forgets the answer before it (a later answer supersedes); ``failures``
    counts the invalid answers of the whole task, ``problems`` are the last one's.

    The checks run when the verdict is first read, not as the answers are folded in: a
    trace read back (a session loaded, a task taken up) does not check again the answers
    of the tasks that ended, which nobody asks about (R-SEC-1: each check may take up to
    its :func:`check_budget`)."""

    __slots__ = (
        "_answer",
        "_answered",
        "_failures",
        "_problems",
        "_texts",
        "_unsettled",
        "format",
        "schema",
    )

    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self.format = OutputFormat(name=schema_name(schema), schema=schema)
        """What the task's requests ask for."""
        self._answer: dict[str, Any] | None = None
        self._answered = False
        self._failures = 0
        self._problems: tuple[str, ...] = ()
        self._texts: list[str] = []
        self._unsettled: list[Callable[[], None]] = []

    @property
    def answer(self) -> dict[str, Any] | None:
        """The valid answer of the current attempt, if it gave one."""
        self._settle_all()
        return self._answer

    @property
    def answered(self) -> bool:
        """Whether the current attempt gave a valid answer."""
        self._settle_all()
        return self._answered

    @property
    def failures(self) -> int:
        """How many invalid answers the whole task has had."""
        self._settle_all()
        return self._failures

    @property
    def problems(self) -> tuple[str, ...]:
        """The problems of the last invalid answer."""
        self._settle_all()
        return self._problems

    @property
    def exhausted(self) -> bool:
        """Whether the task has had its :data:`ANSWER_ATTEMPTS` invalid answers."""
        return self.failures >= ANSWER_ATTEMPTS

    def carry(self, failures: int) -> None:
        """The task's invalid answers before the trace file this check is read from (a
        compaction's ``compaction_end`` counts them): they count toward
        :data:`ANSWER_ATTEMPTS` as the file's own do."""
        self._failures += failures

    def begin_attempt(self) -> None:
        """A new attempt: what it says supersedes any earlier answer."""
        self._texts = []
        if self._unsettled:
            self._later(self._forget)  # after the checks that wait, in order
        else:
            self._forget()

    def text(self, block: TextBlock) -> None:
        """A complete text block of the attempt's message."""
        self._texts.append(block.text)

    def message_ended(self, *, with_calls: bool) -> None:
        """The attempt's message ended (``request_end`` ok): without tool calls, its text
        is the answer."""
        if with_calls:
            return
        text = "\n".join(self._texts)
        self._later(lambda: self._check_text(text))

    def call_result(self, call: ToolCallBlock, ok: bool) -> None:
        """The result of a :data:`FINAL_ANSWER` call: ``ok`` when its arguments were taken."""
        if ok:
            self._later(lambda: self._settle(call.arguments, []))
        else:
            self._later(
                lambda: self._settle(
                    None, check_call(call, self.schema) or ["$: the answer was refused"]
                )
            )

    def _later(self, step: Callable[[], None]) -> None:
        self._unsettled.append(step)

    def _settle_all(self) -> None:
        steps, self._unsettled = self._unsettled, []
        for step in steps:
            step()

    def _forget(self) -> None:
        self._answer = None
        self._answered = False

    def _check_text(self, text: str) -> None:
        value, problems = parse_text_answer(text)
        self._settle(value, problems or validate(value, self.schema, answer_chars=len(text)))

    def _settle(self, value: Any, problems: Sequence[str]) -> None:
        if problems:
            self._failures += 1
            self._problems = tuple(problems)
            return
        self._answer = value
        self._answered = True

    def failure_message(self) -> str:
        """Why the task failed: its last answer's problems, after the repair round."""
        return (
            f"the answer does not match the output schema after {ANSWER_ATTEMPTS - 1} "
            "repair round: " + "; ".join(self.problems)
        )


def check_call(call: ToolCallBlock, schema: Mapping[str, Any]) -> list[str]:
    """The problems of a :data:`FINAL_ANSWER` call's arguments (its text may not even be
    a JSON object: then why, as a tool call's error says it, R-TOOL-5)."""
    if call.invalid_arguments is not None:
        return [f"$: the arguments are {invalid_arguments_reason(call.invalid_arguments)}"]
    return validate(call.arguments, schema)


# -- the wire forms ---------------------------------------------------------------------

_ANTHROPIC_NATIVE = re.compile(r"^claude-(?:opus|sonnet|haiku)-(\d+)(?:-(\d{1,2}))?(?:-|$)")

_ANTHROPIC_UNSUPPORTED = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "maxItems",
    "minProperties",
    "maxProperties",
    "uniqueItems",
)
"""Keywords Anthropic's structured outputs refuse (its documentation, 2025-11 and after);
the wire schema says them in the description instead, and :func:`validate` enforces them."""


def anthropic_native_model(model: str) -> bool:
    """Whether ``model`` has Anthropic's native structured output (``output_config.format``):
    generally available for Claude Haiku, Sonnet and Opus 4.5 and later. Earlier models
    and names that are not Claude's (a proxy's alias) answer through the final tool."""
    match = _ANTHROPIC_NATIVE.match(model)
    if match is None:
        return False
    major, minor = int(match.group(1)), int(match.group(2) or 0)
    return (major, minor) >= (4, 5)


def anthropic_schema(schema: Mapping[str, Any]) -> dict[str, Any] | None:
    """``schema`` in the form Anthropic's structured outputs take: every object closed
    (``additionalProperties: false``), the keywords it refuses moved into the description.
    None when the schema cannot be said so (an object that allows other properties: a
    map), and the final tool must carry it."""
    wire = copy.deepcopy(dict(schema))
    return wire if _anthropic_node(wire) else None


def _anthropic_node(node: Any) -> bool:
    if isinstance(node, list):
        return all(_anthropic_node(item) for item in node)
    if not isinstance(node, dict):
        return True
    notes = [f"{k}: {json.dumps(node.pop(k))}" for k in _ANTHROPIC_UNSUPPORTED if k in node]
    if "minItems" in node and node["minItems"] not in (0, 1):
        notes.append(f"minItems: {json.dumps(node.pop('minItems'))}")
    if notes:
        described = node.get("description")
        node["description"] = (f"{described} " if isinstance(described, str) else "") + (
            "(" + ", ".join(notes) + ")"
        )
    is_object = node.get("type") == "object" or "properties" in node
    if is_object:
        additional = node.get("additionalProperties", False)
        if additional is not False:
            return False
        node["additionalProperties"] = False
    return all(
        _anthropic_node(value)
        for key, value in node.items()
        if key not in ("enum", "const", "default", "examples", "description", "title")
    )


def openai_strict(schema: Mapping[str, Any]) -> bool:
    """Whether ``schema`` may be sent with ``strict: true`` to OpenAI: every object closed
    and every property required (optional fields take a null instead). Else it is sent
    non-strict, and :func:`validate` holds the model to it."""
    return _strict_node(schema)


def _strict_node(node: Any) -> bool:
    if isinstance(node, list):
        return all(_strict_node(item) for item in node)
    if not isinstance(node, Mapping):
        return True
    if node.get("type") == "object" or "properties" in node:
        properties = node.get("properties") or {}
        if node.get("additionalProperties") is not False:
            return False
        if set(node.get("required") or ()) != set(properties):
            return False
    return all(
        _strict_node(value)
        for key, value in node.items()
        if key not in ("enum", "const", "default", "examples", "description", "title")
    )
