"""A recursive output schema (local ``$ref`` to itself: a list, a tree) holds answers as
deep as any answer may be — 64 levels, as a call's arguments (R-OUT-1, R-SEC-6).

Before, the validator's bound of 64 counted every sub-schema it stepped through, not the
levels of the answer: a ``$ref``, an ``anyOf`` branch and a property are three steps for
one level of a linked list, so a valid chain of 22 nodes (or a tree 22 levels deep)
failed with ``nested too deeply``, a problem the model cannot repair: the task failed.
A ``$ref`` cycle that never reaches a value is still stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import collect

from greenroom import Host
from greenroom.actors.scripted import Reply, text
from greenroom.protocols.outputs import TaskEnd
from greenroom.protocols.structured import output_spec, validate

CHAIN = output_spec(
    {
        "type": "object",
        "properties": {"head": {"$ref": "#/$defs/Node"}},
        "required": ["head"],
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "step": {"type": "string"},
                    "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                },
                "required": ["step", "next"],
                "additionalProperties": False,
            }
        },
    }
).schema

TREE = output_spec(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"type": "array",
                                                                "items": {"$ref": "#"}}},
        "required": ["name"],
    }
).schema


def chain(nodes: int) -> dict[str, Any]:
    node: Any = None
    for i in reversed(range(nodes)):
        node = {"step": f"s{i}", "next": node}
    return {"head": node}


def tree(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"name": "leaf"}
    for _ in range(levels - 1):
        node = {"name": "n", "children": [node]}
    return node


def test_answers_as_deep_as_an_answer_may_be_are_checked_to_their_end() -> None:
    assert validate(chain(40), CHAIN) == []
    assert validate(chain(63), CHAIN) == []
    assert validate(tree(32), TREE) == []  # an object and its array: 63 levels
    wrong = chain(40)
    node = wrong["head"]
    for _ in range(39):
        node = node["next"]
    node["step"] = 7  # the last node's step is no string
    (problem,) = validate(wrong, CHAIN)
    assert "expected string, got integer" in problem and "nested too deeply" not in problem


def test_past_64_levels_and_a_cycle_that_reaches_no_value_are_nested_too_deeply() -> None:
    problems = validate(chain(70), CHAIN)
    assert len(problems) == 1 and "nested too deeply" in problems[0]
    cycle = {"$ref": "#/$defs/A", "$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}}}
    assert validate({}, cycle) == ["$: nested too deeply"]


async def test_a_task_with_a_recursive_schema_completes_with_a_long_chain(
    host: Host, workspace: Path, providers: Any
) -> None:
    import json

    answer = chain(63)
    provider = providers([Reply(blocks=(text(json.dumps(answer)),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("the steps?", output_schema=CHAIN))
    end = outputs[-1]
    assert isinstance(end, TaskEnd)
    assert (end.status, end.message, end.output) == ("completed", None, answer)
