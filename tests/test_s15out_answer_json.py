"""A structured answer given as text is JSON as every reader takes it (R-OUT-1), or it is
an invalid answer sent back once like any other.

Before, the text was read by Python's ``json.loads`` alone: ``NaN``, ``Infinity`` and
``1e999`` (read as infinity) passed a ``number`` schema and the task completed with them,
so ``task_end.output`` held ``NaN`` — the trace, ``--json``, the gateway's frames and
``greenroom run --output-schema``'s stdout carried text no JSON reader (a browser's
``JSON.parse``) takes. And an answer nested some hundreds of levels deep ended the task
``failed`` with ``internal error: RecursionError`` instead of being sent back: a call's
arguments may nest 64 levels (R-SEC-6), a text answer had no bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import collect, last_user, of_type, texts_of, trace_lines

from greenroom import Host
from greenroom.actors.scripted import Reply, text
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import TaskEnd, UserMsg
from greenroom.protocols.structured import parse_text_answer

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "rows": {"type": "array", "uniqueItems": True}},
    "required": ["a"],
}


def _strict(text: str) -> Any:
    """``text`` read as JSON by a reader that takes no ``NaN`` or ``Infinity``."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is no JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_number_that_is_not_finite_is_no_json_answer(number: str) -> None:
    value, problems = parse_text_answer('{"a": ' + number + "}")
    assert value is None
    (problem,) = problems
    assert problem.startswith("$: the answer is not JSON (")


def test_an_answer_nested_past_the_arguments_bound_is_refused_and_64_levels_are_taken() -> None:
    deep = '{"rows": ' + "[" * 600 + "]" * 600 + ', "a": 1}'
    value, problems = parse_text_answer(deep)
    assert value is None and problems == ["$: the answer nests deeper than 64 levels"]
    fits = '{"a": 1, "rows": ' + "[" * 63 + "]" * 63 + "}"
    value, problems = parse_text_answer(fits)
    assert problems == [] and value is not None and value["a"] == 1


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ('{"a": NaN}', "$: the answer is not JSON ("),
        ('{"a": 1, "rows": [' + "[" * 600 + "]" * 600 + "]}",
         "$: the answer nests deeper than 64 levels"),
    ],
    ids=["nan", "deep"],
)
async def test_such_an_answer_is_sent_back_and_every_record_is_json(
    host: Host, workspace: Path, providers: Any, bad: str, problem: str
) -> None:
    asked: list[ModelRequest] = []

    def second(request: ModelRequest) -> Reply:
        asked.append(request)
        return Reply(blocks=(text('{"a": 2.5}'),))

    provider = providers([Reply(blocks=(text(bad),)), second])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    outputs = await collect(session.run("a number?", output_schema=SCHEMA))
    end = outputs[-1]
    assert isinstance(end, TaskEnd)
    assert (end.status, end.message, end.output) == ("completed", None, {"a": 2.5})
    (steering,) = [u for u in of_type(outputs, UserMsg) if u.kind == "steering"]
    (note,) = texts_of(last_user(asked[0]))
    assert f"- {problem}" in note
    assert steering.content[0].text in note  # type: ignore[union-attr]
    for line in session.trace_path.read_text(encoding="utf-8").splitlines():
        _strict(line)
    assert trace_lines(session)[-1]["output"] == {"a": 2.5}
