"""``greenroom run --output-schema FILE`` (R-OUT-1) and ``--hooks FILE`` (R-HOOK-2) end to
end in subprocesses, on the built-in scripted model: what reaches stdout and stderr, the
exit codes, and a bad file reported by name and place, never a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.apps.demo import write_demo_workspace  # noqa: E402
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT  # noqa: E402
from tests.test_cli import greenroom  # noqa: E402

CITY = {
    "type": "object",
    "title": "City",
    "properties": {"name": {"type": "string", "minLength": 3}, "people": {"type": "integer"}},
    "required": ["name", "people"],
    "additionalProperties": False,
}


def test_output_schema_prints_the_answer_alone_on_stdout(tmp_path: Path) -> None:
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    result = greenroom(tmp_path, "run", "--provider", "scripted", "--output-schema",
                       str(schema), "a", "city")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ['{"name": "example", "people": 0}']
    # The conversation (the model's JSON text too) and the summary are stderr's.
    assert "✓ completed · 1 turn" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_output_schema_file_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    missing = greenroom(tmp_path, "run", "--output-schema", "nope.json", "hi")
    assert missing.returncode == 2
    assert "--output-schema: nope.json: cannot read it: No such file or directory" in (
        missing.stderr
    )
    listed = tmp_path / "list.json"
    listed.write_text('{"type": "array"}')
    wrong = greenroom(tmp_path, "run", "--output-schema", str(listed), "hi")
    assert wrong.returncode == 2 and f"--output-schema: {listed}: output_schema must" in (
        wrong.stderr
    )
    both = greenroom(tmp_path, "run", "--json", "--output-schema", str(listed), "hi")
    assert both.returncode == 2 and "give one of them" in both.stderr
    for result in (missing, wrong, both):
        assert "Traceback" not in result.stderr and result.stdout == ""


def test_run_with_hooks_shows_what_the_hook_did(tmp_path: Path) -> None:
    """The scripted model lists the workspace, then reads each CSV file: the hook denies
    the reads, and the screen says so in the vocabulary of people."""
    write_demo_workspace(tmp_path / "ws")
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps({"before_tool": [
        {"match": "read_file", "command": "echo 'no reading today' >&2; exit 2"}
    ]}))
    result = greenroom(tmp_path, "run", "--provider", "scripted", "--approve", "all",
                       "--workspace", str(tmp_path / "ws"), "--hooks", str(hooks), DEMO_PROMPT)
    assert result.returncode == 0, result.stderr
    assert "read_file before_tool hook denied it: no reading today" in result.stdout
    assert "read_file denied by a hook" in result.stdout
    assert "list_dir ok" in result.stdout.replace("◂ ", "")


@pytest.mark.parametrize("command", ["run", "chat", "serve", "approve"])
def test_a_bad_hooks_file_is_a_usage_error_naming_the_file_and_place(
    tmp_path: Path, command: str
) -> None:
    hooks = tmp_path / "hooks.json"
    hooks.write_text('{"before_tool": [{"match": "run_shell"}]}')
    args = {"run": ["run", "hi"], "chat": ["chat"], "serve": ["serve", "--port", "0"],
            "approve": ["approve", "s1", "c1", "allow"]}[command]
    result = greenroom(tmp_path, *args, "--hooks", str(hooks))
    assert result.returncode == 2, result.stderr
    assert f"--hooks: {hooks}: $.before_tool[0].command: required" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_output_schema_too_costly_to_check_is_a_usage_error(tmp_path: Path) -> None:
    """R-SEC-1: a pattern that needs backtracking and a chain of ``anyOf`` of ``$ref``
    that doubles with each link are refused before anything runs, naming why."""
    from tests.test_schema_cost import anyof_chain

    backreference = {"type": "object", "properties": {"a": {"pattern": "^(a+)\\1$"}}}
    for name, schema, reason in (
        ("chain.json", anyof_chain(18), "more than 50000 sub-schemas"),
        ("backreference.json", backreference, "uses a backreference"),
    ):
        path = tmp_path / name
        path.write_text(json.dumps(schema))
        result = greenroom(tmp_path, "run", "--provider", "scripted", "--output-schema",
                           str(path), "hi")
        assert result.returncode == 2, result.stderr
        assert f"--output-schema: {path}: output_schema" in result.stderr
        assert reason in result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
