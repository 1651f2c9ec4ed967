"""Checking an answer against a schema is bounded work (R-SEC-1, R-OUT-1): patterns run
without backtracking, the whole check has a budget, and schemas whose checks could hold
the event loop are refused before any answer is asked for."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, Recorder, collect, of_type, open_host, port_of, trace_lines

from greenroom import Host
from greenroom.actors.runtime.host import Host as OpenedHost
from greenroom.actors.scripted import Reply, ScriptedProvider, ScriptedStream, text
from greenroom.protocols import jsonrpc, structured
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.errors import OutputSchemaError
from greenroom.protocols.outputs import TaskEnd
from greenroom.protocols.pattern import (
    MAX_COMPILE_STEPS,
    MAX_PROGRAM,
    PatternError,
    compile_pattern,
)
from greenroom.protocols.structured import (
    CHECK_WORK_PER_CHAR,
    EXAMPLE_LIMITS,
    MAX_CHECK_WORK,
    MAX_PATTERN_WORK,
    MAX_SCHEMA_NODES,
    TOO_COSTLY,
    check_budget,
    example_value,
    output_spec,
    validate,
)


def anyof_chain(links: int) -> dict[str, Any]:
    """Each link offers the next one twice: 2**links checks for a value none matches."""
    defs: dict[str, Any] = {
        f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]}
        for i in range(links)
    }
    defs[f"a{links}"] = {"type": "integer"}
    return {
        "type": "object",
        "$defs": defs,
        "properties": {"v": {"$ref": "#/$defs/a0"}},
        "required": ["v"],
    }


BACKTRACKING = {
    "type": "object",
    "properties": {"a": {"type": "string", "minLength": 34, "pattern": "(x+)+y"}},
    "required": ["a"],
}


def test_a_pattern_reads_each_character_once_however_it_nests() -> None:
    """``(x+)+y`` against ``x``s: ``re`` tries 2**n splits; here every character moves at
    most twice the automaton's states, counted."""
    pattern = compile_pattern("(x+)+y")
    moves: list[int] = []
    assert not pattern.search("x" * 5000, moves.append)
    assert len(moves) == 5001
    assert max(moves) <= 2 * len(pattern)
    assert validate({"a": "x" * 40}, BACKTRACKING) == ["$.a: does not match the pattern '(x+)+y'"]
    assert validate({"a": "x" * 40 + "y"}, BACKTRACKING) == []


@pytest.mark.parametrize(
    "source",
    [
        r"^[a-z]+@[a-z]+\.[a-z]{2,}$",
        r"\d{3}-\d{4}",
        r"^$",
        r"a|b|c",
        r"(?i)ab[^c]",
        r"(?i)[^a]",
        r"\bfoo\b",
        r"\Bo",
        r"a$",
        r"(?m)^b$",
        r"(?s)a.b",
        r"(ab)*c",
        r"^a{2,3}$",
        r"(a|ab)(c|bcd)(d*)",
        r"^\S+$",
        r"\A\d+\Z",
        r"(a*)*b",
        r"(?a)^\w+$",
        r"^-?\d+(\.\d+)?$",
        r"colou?r",
        r"a+?b",
    ],
)
def test_a_pattern_matches_where_re_matches(source: str) -> None:
    texts = ["", "ab", "abd", "ABD", "A", "a", "foo bar", "afoo", "a\n", "a\nb\n", "a\nb",
             "abababc", "aaa", "abcd", "abbcd", "me@x.org", "123-4567", "é", "\uff13", "-1.5",
             "1.", "colour", "aab", "x y", "b"]  # fmt: skip
    pattern = compile_pattern(source)
    for sample in texts:
        assert pattern.search(sample, lambda _: None) == (re.search(source, sample) is not None), (
            sample
        )


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (r"^(a+)\1$", "uses a backreference, which cannot be checked without backtracking"),
        (r"^(?=.*\d).+$", "uses lookahead or lookbehind, which is not supported"),
        (r"(?>a+)b", "uses an atomic group, which is not supported"),
        (r"a++b", "uses possessive repetition, which is not supported"),
        (r"^[a-z]{1,5000}$", f"too large to check (more than {MAX_PROGRAM} states"),
        # Groups that make no state are read all the same, each repetition: bounded too.
        (r"(?:){100000}", f"too large to check (more than {MAX_COMPILE_STEPS} parts"),
        (r"(?:(?:){300}){300}", f"too large to check (more than {MAX_COMPILE_STEPS} parts"),
        (r"((", "not a regular expression Python can read: missing )"),
    ],
)
def test_a_pattern_that_cannot_run_without_backtracking_is_refused_up_front(
    source: str, reason: str
) -> None:
    with pytest.raises(PatternError, match=re.escape(reason)):
        compile_pattern(source)
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": source}}}
    with pytest.raises(OutputSchemaError, match=re.escape(reason)):
        output_spec(schema)
    # A schema recorded before the refusal (a trace) still cannot pass an answer unchecked.
    (problem,) = validate({"a": "aa"}, schema)
    assert problem.startswith(f"$.a: the schema's pattern {source!r} cannot be checked: ")


@pytest.mark.parametrize("sample", ["ß", "\ufb00", "k", "K", "é"])
def test_a_case_insensitive_class_takes_a_character_as_re_does(sample: str) -> None:
    """Under (?i) a character matches a class by its own case forms of one character:
    "ß".upper() is "SS", no letter between A and Z (R-OUT-1)."""
    source = "(?i)^[A-Z]+$"
    expected = re.search(source, sample) is not None
    assert compile_pattern(source).search(sample, lambda _: None) == expected
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": source}}}
    assert (validate({"a": sample}, schema) == []) == expected


# Every character with another case form (and its neighbours in the tables of re's
# exceptions: dotted and dotless i, long s, the Kelvin and Angstrom signs, Greek forms).
_CASED = [chr(c) for c in range(0x20000) if chr(c).lower() != chr(c) or chr(c).upper() != chr(c)]


@pytest.mark.parametrize(
    "source",
    [
        r"(?i)[a-z]",
        r"(?i)[^a-z]",
        r"(?i)k",
        r"(?i)s",
        r"(?i)i",
        r"(?i)\u00e5",
        r"(?i)[\u00e0-\u00ff]",
        r"(?i)[\u0370-\u03ff]",
        r"(?i)\u03c9",
        r"(?ia)[a-z]",
        r"(?i:[\u0400-\u04ff])",
    ],
)
def test_case_insensitive_matching_is_res_own_for_every_cased_character(source: str) -> None:
    """re's case folding has exceptions no rule of lower and upper forms reproduces: "İ"
    and the Kelvin sign match (?i)[a-z], "ß" does not. Each character is taken as re
    takes it (R-OUT-1)."""
    pattern = compile_pattern(source)
    differing = [
        c for c in _CASED if pattern.search(c, lambda _: None) != (re.search(source, c) is not None)
    ]
    assert differing == []


def test_a_pattern_in_data_is_no_pattern() -> None:
    schema = {"type": "object", "properties": {"a": {"const": {"pattern": "(a)\\1"}}}}
    assert output_spec(schema).schema["properties"]["a"]["const"] == {"pattern": "(a)\\1"}


def test_a_chain_of_anyof_refs_is_refused_up_front_by_its_size() -> None:
    """Each link doubles the checks; the depth limit never sees it (the chain is short)."""
    output_spec(anyof_chain(10))
    with pytest.raises(OutputSchemaError, match=f"more than {MAX_SCHEMA_NODES} sub-schemas"):
        output_spec(anyof_chain(18))


def test_a_recursive_schema_is_not_refused_for_its_cycle() -> None:
    tree = {
        "type": "object",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "properties": {"root": {"$ref": "#/$defs/node"}},
    }
    assert output_spec(tree).schema == tree
    assert validate({"root": {"kids": [{"kids": []}]}}, tree) == []


def test_the_check_stops_at_its_work_budget_with_a_clear_problem() -> None:
    """A schema that was never refused (one read from a trace) meets the budget: 2**16
    checks of the chain are more than it allows."""
    assert MAX_CHECK_WORK < 4 * 2**16
    problems = validate({"v": "not a number"}, anyof_chain(16))
    assert problems[-1] == TOO_COSTLY
    assert "too costly to check" in TOO_COSTLY
    assert validate({"v": 3}, anyof_chain(16)) == []  # the first branch matches at once


ROWS = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 100},
                    "n": {"type": "integer", "minimum": 0},
                    "tag": {"enum": ["a", "b", "c"]},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "n"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["rows"],
}


def rows(count: int) -> dict[str, Any]:
    return {"rows": [{"name": f"row {i}", "n": i, "tag": "a", "ok": True} for i in range(count)]}


def test_a_long_answer_is_checked_to_its_end() -> None:
    """The budget was one size for every answer: 6,000 rows of four values (120,000
    values, about 330 KB) failed as too costly against an ordinary schema. A long answer
    earns the work it needs: the last row's problem is found."""
    answer = rows(6_000)
    assert validate(answer, ROWS) == []
    answer["rows"][-1]["n"] = -1
    assert validate(answer, ROWS) == ["$.rows[5999].n: expected at least 0, got -1"]
    chars = len(json.dumps(answer, separators=(",", ":")))
    assert validate(answer, ROWS, answer_chars=chars)[0].startswith("$.rows[5999].n:")
    assert validate(answer, ROWS, answer_chars=0) == [TOO_COSTLY]


def test_the_budget_grows_with_the_answer_and_bounds_its_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chain of 14 links (about 300,000 steps for a value it refuses) is too costly for
    a short answer and fits the budget of one padded by 150,000 characters; an answer of
    many values that each meet a longer chain stops within its budget, linear in its
    length."""
    assert validate({"v": "not a number"}, anyof_chain(14)) == [TOO_COSTLY]
    padded = {"v": "not a number", "pad": "x" * 150_000}
    problems = validate(padded, anyof_chain(14))
    assert problems and problems[-1] != TOO_COSTLY
    assert "matches none of the allowed forms" in problems[-1]

    chain = anyof_chain(16)
    chain["properties"] = {"v": {"type": "array", "items": {"$ref": "#/$defs/a0"}}}
    checks = 0
    real_check = structured._Validator.check

    def counted(self: Any, value: Any, schema: Any, path: str) -> None:
        nonlocal checks
        checks += 1
        real_check(self, value, schema, path)

    monkeypatch.setattr(structured._Validator, "check", counted)
    answer = {"v": ["x"] * 50_000}
    chars = len(json.dumps(answer, separators=(",", ":")))
    assert validate(answer, chain)[-1] == TOO_COSTLY
    assert MAX_CHECK_WORK // 4 < checks <= check_budget(chars) // 4 + 1
    assert CHECK_WORK_PER_CHAR * chars > MAX_CHECK_WORK  # the answer, not the base, bound it


def test_unique_items_compare_as_json_values() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    assert validate({"a": [1, 1.0]}, schema) == ["$.a[1]: repeats an earlier item"]
    assert validate({"a": [1, True, "1", [1], {"1": 1}]}, schema) == []
    assert validate({"a": [{"x": 1, "y": [2.0]}, {"y": [2], "x": 1}]}, schema) == [
        "$.a[1]: repeats an earlier item"
    ]
    assert validate({"a": list(range(20_000))}, schema) == []


def test_a_long_value_is_shown_by_its_start() -> None:
    schema = {"type": "object", "properties": {"a": {"const": "short"}}}
    (problem,) = validate({"a": "x" * 100_000}, schema)
    assert len(problem) < 120 and problem.endswith("…")
    (problem,) = validate({"a": list(range(100_000))}, schema)
    assert problem == '$.a: expected "short", got an array of 100000 items'


async def test_a_backtracking_pattern_fails_the_answer_and_other_sessions_are_served(
    host: Host, workspace: Path, providers: Any
) -> None:
    """The reproduction: ``(x+)+y`` against forty ``x`` (2**40 tries for ``re``). The
    answer is checked, sent back once, and the task fails naming the pattern; between
    the two answers (forced: the second waits for it) another session runs to its end,
    so the first check let go of the event loop."""
    other_done = trio.Event()
    answer = json.dumps({"a": "x" * 40})

    async def first(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text(answer)
        await stream.end()

    async def second(request: ModelRequest, stream: ScriptedStream) -> None:
        await other_done.wait()
        await stream.text(answer)
        await stream.end()

    slow = await host.create_session(provider=providers([first, second]), workspace_dir=workspace)
    other = await host.create_session(
        provider=providers([Reply(blocks=(text("served"),))]), workspace_dir=workspace
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = slow.run("answer", output_schema=BACKTRACKING)
        async with trio.open_nursery() as nursery:

            async def serve_other() -> None:
                outputs = await collect(other.run("hi"))
                assert [e.status for e in of_type(outputs, TaskEnd)] == ["completed"]
                other_done.set()

            nursery.start_soon(serve_other)
            result = await stream.result()
    assert other_done.is_set()
    assert result.status == "failed"
    assert "$.a: does not match the pattern '(x+)+y'" in result.task_end.message


async def test_the_gateway_refuses_a_costly_schema_and_the_session_stays_usable(
    tmp_path: Path,
) -> None:
    """``run`` with the doubling ``$ref`` chain or a backreference is -32602 naming why,
    nothing starts, and the next run of the same session completes."""
    from test_gateway import BOUND_S, connect, serving

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    backreference = {"type": "object", "properties": {"a": {"pattern": "^(a+)\\1$"}}}
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lambda: [Reply(blocks=(text('{"city": "Lyon"}'),))]) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            for costly, reason in (
                (anyof_chain(18), f"more than {MAX_SCHEMA_NODES} sub-schemas"),
                (backreference, "uses a backreference"),
            ):
                refused = await client.error(
                    "run", {"session_id": sid, "input": "x", "output_schema": costly}
                )
                assert refused["code"] == jsonrpc.INVALID_PARAMS
                assert refused["message"].startswith("$.output_schema: output_schema")
                assert reason in refused["message"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result(
                "run", {"session_id": sid, "input": "city?", "output_schema": schema}
            )
            outputs = client.take_outputs() + await client.outputs_until("task_end")
    assert [o["type"] for o in outputs].count("task_start") == 1
    assert outputs[-1]["status"] == "completed" and outputs[-1]["output"] == {"city": "Lyon"}


def test_multiple_of_past_float_range_is_a_verdict_not_an_exception() -> None:
    """``1e308 / 1e-308`` is infinite and a 4000-digit integer has no float: the check
    once raised ``OverflowError`` out of the task's fold."""
    tiny = {"type": "object", "properties": {"n": {"multipleOf": 1e-308}}}
    assert validate({"n": 1e308}, tiny) == []
    assert validate({"n": 10**4000}, tiny) == []
    three = {"type": "object", "properties": {"n": {"multipleOf": 3}}}
    assert validate({"n": 3 * 10**400}, three) == []
    (problem,) = validate({"n": 10**4000}, three)
    assert problem.startswith("$.n: expected a multiple of 3, got 1000") and len(problem) < 120
    assert validate({"n": 7.5}, three) == ["$.n: expected a multiple of 3, got 7.5"]


async def test_a_recorded_schema_now_refused_is_still_checked_after_a_restart(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """A follow-up queued with a schema whose pattern is now refused (a trace of an
    earlier host) is taken up, not lost, and not a failed load: its answer cannot pass
    the pattern unchecked, so the task fails naming it."""
    from test_follow_up_recovery import streaming_forever
    from test_recovery import copy_session

    turn, streaming = streaming_forever()
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a)b$"}}}
    crash_dir = tmp_path / "crashed"
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=ScriptedProvider([turn]), workspace_dir=workspace
        )
        session.run("work").detach()
        with trio.fail_after(RUN_TIMEOUT_S):
            await streaming.wait()
        assert session.follow_up("answer", output_schema=schema)
        with trio.fail_after(RUN_TIMEOUT_S):
            await Recorder(session).wait_for("task_queued")
        await port_of(session).sync_trace()
        trace = copy_session(session, crash_dir)
    text_of_trace = trace.read_text(encoding="utf-8")
    assert text_of_trace.count('"^(a)b$"') == 1
    trace.write_text(text_of_trace.replace('"^(a)b$"', '"^(a)\\\\1$"'), encoding="utf-8")

    answers = [Reply(blocks=(text("Done."),))] * 2 + [Reply(blocks=(text('{"a": "aa"}'),))] * 2
    async with OpenedHost.open(crash_dir) as second:
        resumed = await second.resume(session.id, provider=ScriptedProvider(answers))
        with trio.fail_after(RUN_TIMEOUT_S):
            await resumed.wait_idle()
        ends = [line for line in trace_lines(resumed) if line["type"] == "task_end"]
    assert [e["status"] for e in ends] == ["completed", "failed"]
    assert (
        "$.a: the schema's pattern '^(a)\\\\1$' cannot be checked: uses a backreference"
        in (ends[-1]["message"])
    )


def test_the_scripted_example_of_a_huge_schema_stays_small() -> None:
    """``minLength`` and ``minItems`` past any memory (the scripted model answers with the
    example): once a MemoryError, or a list of a billion lists."""
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "minLength": 10**12},
            "a": {"type": "array", "minItems": 10**9, "items": {"type": "array",
                  "minItems": 10**9, "items": {"type": "integer"}}},
        },
        "required": ["s", "a"],
    }  # fmt: skip
    value = example_value(schema)
    values, chars = EXAMPLE_LIMITS
    assert len(value["s"]) == chars
    inner = [len(items) for items in value["a"] if items is not None]
    assert inner and len(value["a"]) + sum(inner) <= 2 * values


def test_many_large_patterns_are_refused_by_their_total() -> None:
    """Each pattern is within its own limit; reading all of them is not (distinct, so no
    pattern is read twice)."""
    properties = {
        f"p{n}": {"type": "string", "pattern": f"^[a-z]{{1,{900 + n}}}$"} for n in range(60)
    }
    with pytest.raises(OutputSchemaError, match=f"more than {MAX_PATTERN_WORK} characters"):
        output_spec({"type": "object", "properties": properties})
    same = {f"p{n}": {"type": "string", "pattern": "^[a-z]{1,900}$"} for n in range(60)}
    output_spec({"type": "object", "properties": same})


async def test_reading_a_trace_back_does_not_check_the_answers_of_ended_tasks(
    host: Host, workspace: Path, providers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each check may take up to the work budget; a session loaded with many ended tasks
    would pay it once per answer. The fold checks an answer only when the verdict is
    read: for the open task, never for one that ended."""
    from test_follow_up_recovery import records_of

    from greenroom.protocols.task import fold

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    session = await host.create_session(
        provider=providers([Reply(blocks=(text(answer),)) for answer in ('{"n": 1}', "{}", "{}")]),
        workspace_dir=workspace,
    )
    for _ in range(2):
        await collect(session.run("count", output_schema=schema))
    records = records_of(session)
    assert [r.status for r in records if isinstance(r, TaskEnd)] == ["completed", "failed"]

    checks: list[Any] = []
    real_validate = structured.validate

    def counting(value: Any, schema: Any, *, answer_chars: int | None = None) -> list[str]:
        checks.append(value)
        return real_validate(value, schema, answer_chars=answer_chars)

    monkeypatch.setattr(structured, "validate", counting)
    record = fold(records).record
    assert checks == []
    last_open = [r for r in records if not isinstance(r, TaskEnd)]  # the last task not ended
    answers = fold(last_open).record.answers
    assert answers is not None and checks == []
    assert answers.failures == 2 and checks == [{}, {}]
    assert record.answers is None
