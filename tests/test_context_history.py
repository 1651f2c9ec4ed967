"""What the model context keeps, live and after a reload (R-TRACE-4):

* a retried turn keeps its ``[turn_retried]`` note in the history once the retry
  succeeds, so the result of a tool that ran in the failed attempt is never lost
  (R-RETRY-4);
* a compaction triggered on the first turn of a task summarizes the old context but keeps
  the new prompt out of the summary: the model reads the user's own words after the
  ``[context_summary]`` (R-COMPACT-3).
"""

from __future__ import annotations

from pathlib import Path

from conftest import collect, model_error, of_type, texts_of

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.compaction import summary_message
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import UserMessage
from greenroom.protocols.outputs import CompactionEnd, TaskEnd
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.tools import tool
from greenroom.protocols.trace import parse_trace
from greenroom.protocols.transcript import rebuild

runs: list[str] = []


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    runs.append(key)
    return f"value-{key}"


def allow(_: object) -> str:
    return "allow"


async def test_turn_retried_note_stays_in_history(tmp_path: Path) -> None:
    runs.clear()
    provider = ScriptedProvider(
        [
            Reply(
                blocks=(text("Let me look."), tool_call("c1", "lookup", key="a")),
                fail=model_error("timeout", "overloaded"),
                fail_after_blocks=2,
            ),
            Reply(blocks=(text("a is value-a."),)),
            Reply(blocks=(text("Yes."),)),
        ]
    )
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=provider, tools=[lookup], workspace_dir=tmp_path
        )
        first = await collect(session.run("what is a?", approve=allow))
        assert of_type(first, TaskEnd)[0].status == "completed"
        second = await collect(session.run("sure?", approve=allow))
        assert of_type(second, TaskEnd)[0].status == "completed"
        trace = session.trace_path
    assert runs == ["a"]  # ran once, in the failed attempt; never again
    retry, later = provider.requests[1], provider.requests[2]
    note = texts_of(retry.messages[-1])[-1]
    assert note.startswith("[turn_retried]") and "[tool result lookup: value-a]" in note
    # The note is part of the committed history: the next task still sees it.
    assert texts_of(later.messages[0]) == ["what is a?", note]
    assert provider.violations == []
    # A reload rebuilds the same history from the trace alone.
    records = parse_trace(trace.read_text(), file=str(trace)).records
    assert rebuild(records).messages[:2] == list(later.messages[:2])


async def test_compaction_on_a_new_task_keeps_the_prompt_verbatim(tmp_path: Path) -> None:
    provider = ScriptedProvider(
        [
            Reply(blocks=(text("Hello."),), usage=TokenUsage(input=900, output=200)),
            Reply(blocks=(text("[summary]The user greeted us.[/summary]"),)),
            Reply(blocks=(text("Paris."),)),
        ]
    )
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=provider, workspace_dir=tmp_path, max_context_length=1000
        )
        await collect(session.run("hello"))
        outputs = await collect(session.run("What is the capital of France?"))
        trace = session.trace_path
    (end,) = of_type(outputs, CompactionEnd)
    assert end.status == "ok" and end.kept_input == (
        TextBlock(text="What is the capital of France?"),
    )
    summary_request, answer_request = provider.requests[1], provider.requests[2]
    assert "capital" not in repr(summary_request.messages)
    expected = (
        summary_message("The user greeted us."),
        UserMessage(content=(TextBlock(text="What is the capital of France?"),)),
    )
    assert answer_request.messages == expected
    # The new trace file alone rebuilds that context (it starts with compaction_end).
    assert trace.name == "trace_002.jsonl"
    records = parse_trace(trace.read_text(), file=str(trace)).records
    assert isinstance(records[0], CompactionEnd)
    assert tuple(rebuild(records).messages) == (*expected, *rebuild(records).messages[2:])
    assert rebuild(records).messages[:2] == list(expected)
