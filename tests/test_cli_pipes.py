"""``greenroom`` and the pipe on its stdout: a reader that goes away early (``| head``) and
tools that print while ``--json`` owns stdout.

The reader is a real pipe whose read end the test closes. To make the next write certain
to come after the close (never by timing luck), the commands run with ``--approve ask``
and the answer is typed only after the close: the decision line is then written into a
pipe nobody reads. ``trace`` writes more than a pipe holds, so it blocks on a full pipe
until the close.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.providers.scripted_brain import DEMO_PROMPT  # noqa: E402
from tests.test_cli import CLI, TIMEOUT_S, cli_env, greenroom, json_lines  # noqa: E402

EXIT_BROKEN_PIPE = 141
NOISE = ("Traceback", "BrokenPipe", "Exception", "Error")


def start(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*CLI, *args], cwd=tmp_path, env=cli_env(tmp_path),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def close_reader_then_answer(process: subprocess.Popen[bytes], lines: int) -> tuple[str, bytes]:
    """Read ``lines`` lines of stdout, close the read end (the reader goes away), then answer
    the approval question so that the command writes again; returns stderr and what was read."""
    assert process.stdout is not None and process.stdin is not None
    read = b"".join(process.stdout.readline() for _ in range(lines))
    process.stdout.close()
    try:
        _, err = process.communicate(input=b"y\n", timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return err.decode("utf-8", errors="replace"), read


def assert_quiet(stderr: str) -> None:
    for word in NOISE:
        assert word not in stderr, stderr


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    from greenroom.actors.apps.demo import write_demo_workspace

    directory = tmp_path / "ws"
    write_demo_workspace(directory)
    return directory


def trace_records(tmp_path: Path, session_id: str) -> list[dict[str, object]]:
    trace = tmp_path / "data" / "sessions" / session_id / "trace_001.jsonl"
    text = trace.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_run_piped_to_head_exits_quietly_and_ends_the_task(
    tmp_path: Path, workspace: Path, as_json: bool
) -> None:
    process = start(
        tmp_path, "run", *(["--json"] if as_json else []), "--approve", "ask",
        "--workspace", str(workspace), "--data-dir", str(tmp_path / "data"), DEMO_PROMPT,
    )  # fmt: skip
    stderr, first = close_reader_then_answer(process, 1)
    assert first.strip(), "nothing was read before the close"
    assert process.returncode == EXIT_BROKEN_PIPE, stderr
    assert_quiet(stderr)
    # the task was interrupted and its record closed properly
    session_id = stderr.split("session: ", 1)[1].split()[0]
    records = trace_records(tmp_path, session_id)
    assert [r["type"] for r in records][-2:] == ["abort", "task_end"]
    assert records[-2]["reason"] == "the reader of the output went away"
    assert records[-1]["status"] == "aborted"


def test_demo_piped_to_head_exits_quietly(tmp_path: Path) -> None:
    process = start(tmp_path, "demo", "--approve", "ask")
    stderr, first = close_reader_then_answer(process, 1)
    assert first == b"greenroom demo\n"
    assert process.returncode == EXIT_BROKEN_PIPE, stderr
    assert_quiet(stderr)


def test_trace_piped_to_head_exits_quietly(tmp_path: Path, workspace: Path) -> None:
    result = greenroom(
        tmp_path, "run", "--json", "--approve", "all", "--workspace", str(workspace),
        "--data-dir", str(tmp_path / "data"), DEMO_PROMPT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    session_id = json_lines(result.stdout)[0]["session_id"]
    # Many copies of the run's records: far more output than a pipe buffers.
    trace = tmp_path / "data" / "sessions" / session_id / "trace_001.jsonl"
    records = [json.loads(line) for line in trace.read_text(encoding="utf-8").splitlines()]
    lines = []
    for _ in range(200):
        for record in records:
            lines.append(json.dumps({**record, "seq": len(lines) + 1}) + "\n")
    trace.write_text("".join(lines), encoding="utf-8")

    for extra in ([], ["--json"]):
        process = start(tmp_path, "trace", session_id, "--data-dir", str(tmp_path / "data"),
                        *extra)  # fmt: skip
        stderr, first = close_reader_then_answer(process, 1)
        assert first.strip()
        assert process.returncode == EXIT_BROKEN_PIPE, stderr
        assert_quiet(stderr)


PRINTING_TOOLS = '''
import os
import subprocess
import sys

from greenroom.protocols.tools import tool


@tool(parallel=True)
async def list_dir(path: str) -> str:
    """List a directory (this one talks a lot on stdout first)."""
    for n in range(300):
        print(f"print line {n} from the tool")
    sys.stdout.flush()
    os.write(1, b"raw write to fd 1 from the tool\\n" * 50)
    subprocess.run([sys.executable, "-c", "print('a child process of the tool')"], check=True)
    return "notes.txt  (5 bytes)"
'''


def test_a_tool_printing_to_stdout_never_corrupts_run_json(tmp_path: Path) -> None:
    tools = tmp_path / "printing_tools.py"
    tools.write_text(PRINTING_TOOLS, encoding="utf-8")
    result = greenroom(
        tmp_path, "run", "--json", "--approve", "all", "--tools", str(tools),
        "--data-dir", str(tmp_path / "data"), DEMO_PROMPT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for line in lines:
        json.loads(line)  # nothing but JSON lines on stdout
    assert json.loads(lines[-1])["type"] == "task_end"
    outputs = [json.loads(line) for line in lines if '"tool_call_output"' in line]
    assert outputs[0]["status"] == "ok"
    # what the tool printed went to stderr instead, all of it
    assert result.stderr.count("from the tool") == 350
    assert "a child process of the tool" in result.stderr
