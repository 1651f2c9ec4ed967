"""``greenroom.actors.scripted``: the public way to script the built-in model, and the
one-call answer of a run (``RunStream.result``, ``final_text``, ``task_end``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type

from greenroom import Host, RunResult, tool, user_text
from greenroom.actors import scripted
from greenroom.actors.scripted import (
    Reply,
    ScriptedProvider,
    invalid_tool_call,
    model_error,
    text,
    thinking,
    tool_call,
)
from greenroom.protocols import (
    ModelMsg,
    RequestEnd,
    TaskEnd,
    TextBlock,
    ThinkingBlock,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.context import ModelRequest


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def test_module_documents_every_helper() -> None:
    doc = scripted.__doc__ or ""
    for name in scripted.__all__:
        assert name in doc, name
        if name != "ScriptStep":  # a type alias: documented in the module docstring
            assert getattr(scripted, name).__doc__, name


async def test_result_is_the_last_message_and_the_task_end(
    host: Host, workspace: Path, providers
) -> None:
    """The answer is the last model message's text, not every text of the task."""
    provider = providers(
        [
            Reply(
                blocks=(
                    thinking("which key?"),
                    text("Let me look."),
                    tool_call("c1", "lookup", key="a"),
                    invalid_tool_call("c2", "lookup", '{"key": '),
                )
            ),
            Reply(fail=model_error("timeout", "slow")),
            Reply(blocks=(text("It is"), text("value of a."))),
        ]
    )
    session = await host.create_session(provider=provider, tools=[lookup], workspace_dir=workspace)
    stream = session.run([user_text("what is a?")], approve=allow_all)
    assert stream.final_text == "" and stream.task_end is None
    with trio.fail_after(RUN_TIMEOUT_S):
        result = await stream.result()
    assert isinstance(result, RunResult)
    assert result.text == "It is\nvalue of a."
    assert result.status == "completed" and isinstance(result.task_end, TaskEnd)
    assert result.task_end.turns == 2
    assert stream.final_text == result.text and stream.task_end is result.task_end


async def test_request_end_names_the_model_that_answered(
    host: Host, workspace: Path, providers
) -> None:
    """R-OBS-2: a scripted response names the model that answered as a provider does
    (``request_end.response_model``): the one asked for, or the one its ``Reply`` gives."""
    provider = providers(
        [Reply(blocks=(text("one"),)), Reply(blocks=(text("two"),), model="scripted-2026-01")]
    )
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    named = []
    for prompt in ("first", "second"):
        (end,) = of_type(await collect(session.run(prompt)), RequestEnd)
        named.append(end.response_model)
    assert named == [session.settings.model, "scripted-2026-01"]


async def test_final_text_follows_the_stream_and_ignores_subagents(
    host: Host, workspace: Path, providers
) -> None:
    """While iterating, ``final_text`` is the last complete message so far; a message
    with no text (tool calls only) leaves it empty, so a stale text is never reported."""
    provider = providers(
        [
            Reply(blocks=(text("Checking."), tool_call("c1", "lookup", key="a"))),
            Reply(blocks=(tool_call("c2", "lookup", key="b"),)),
        ]
    )
    session = await host.create_session(
        provider=provider, tools=[lookup], workspace_dir=workspace, max_turns=2
    )
    seen: list[str] = []
    with trio.fail_after(RUN_TIMEOUT_S):
        stream = session.run("go", approve=allow_all)
        async for output in stream:
            if isinstance(output, ToolCallOutput):
                seen.append(stream.final_text)
    assert seen == ["Checking.", ""]
    assert stream.task_end is not None and stream.task_end.status == "max_turns"
    assert (await stream.result()).text == ""


async def test_a_follow_up_gives_the_last_task_answer(
    host: Host, workspace: Path, providers
) -> None:
    provider = providers([Reply(blocks=(text("first"),)), Reply(blocks=(text("second"),))])
    session = await host.create_session(provider=provider, workspace_dir=workspace)
    stream = session.run("one")
    assert session.follow_up("two")
    with trio.fail_after(RUN_TIMEOUT_S):
        result = await stream.result()
    assert result.text == "second" and result.task_end.run_id == stream.run_id


async def test_a_request_function_answers_from_what_the_model_was_sent(
    host: Host, workspace: Path
) -> None:
    def echo(request: ModelRequest) -> Reply:
        return Reply(blocks=(thinking("easy", signature="sig"), text(str(len(request.messages)))))

    session = await host.create_session(provider=ScriptedProvider(echo), workspace_dir=workspace)
    outputs = await session.run("hi").collect()
    blocks = [o.block for o in outputs if isinstance(o, ModelMsg)]
    assert blocks[0] == ThinkingBlock(text="easy", signature="sig")


def test_the_example_in_examples_runs() -> None:
    """examples/embed_minimal.py works as shipped (the README points newcomers to it)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "embed_minimal.py"
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "task_end: completed" in result.stdout
    assert "send_email [denied]" in result.stdout


def test_the_orchestrator_example_merges_three_background_researchers() -> None:
    """examples/orchestrator.py (the README's agent-tree example, R-TREE-2) works as
    shipped: three background researchers, each answer back as input, one merged report."""
    example = Path(__file__).resolve().parents[1] / "examples" / "orchestrator.py"
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("calls spawn_subagent") == 3
    for name in ("researcher-1", "researcher-2", "researcher-3"):
        assert f"orchestrator <- [subagent {name} finished] " in out
    report = out[out.index("orchestrator: Merged report:"):]
    assert report.splitlines()[1:4] == [
        "orchestrator: - tides: two highs a day, pulled by the moon",
        "orchestrator: - glaciers: they flow, a few metres a day",
        "orchestrator: - monsoons: seasonal winds that bring the rain",
    ]


def test_the_orchestrator_example_shows_answers_delivered_together_one_a_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two researchers that finish during the same turn reach the orchestrator as one
    steering input of two blocks (R-STEER-2): the example shows each on a line of its own,
    as the test above reads them, whatever order a busy machine gives."""
    path = Path(__file__).resolve().parents[1] / "examples" / "orchestrator.py"
    spec = importlib.util.spec_from_file_location("orchestrator_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.show(
        UserMsg(
            session_id="s",
            run_id="r",
            kind="steering",
            content=(
                TextBlock(text="[subagent researcher-2 finished] glaciers: they flow"),
                TextBlock(text="[subagent researcher-3 finished] monsoons: winds"),
            ),
        )
    )
    assert capsys.readouterr().out.splitlines() == [
        "orchestrator <- [subagent researcher-2 finished] glaciers: they flow",
        "orchestrator <- [subagent researcher-3 finished] monsoons: winds",
    ]


def test_the_structured_output_example_corrects_its_answer_once() -> None:
    """examples/structured_output.py (the README's structured output example, R-OUT-1)
    works as shipped: a tool first, an answer sent back with its problem, the corrected
    one built into the attrs class."""
    example = Path(__file__).resolve().parents[1] / "examples" / "structured_output.py"
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "tool call   read_document {'document': 'invoice-17.txt'}"
    assert lines[2] == "sent back   - $.lines[0].quantity: expected integer, got string"
    assert lines[4:6] == ["task_end: completed after 3 turns", "ACME Tools invoice 17: 159.98 EUR"]
    assert json.loads(lines[6])["lines"][0]["quantity"] == 2
