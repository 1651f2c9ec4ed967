"""An orchestrator: three researchers in the background, their answers merged.

The orchestrator's model calls ``spawn_subagent`` three times with ``background=true``:
each call returns ``{"session_id": …}`` at once, and the orchestrator's task ends while the
researchers — subagents, each a session with its own trace — look things up. Each
researcher's answer comes back to the orchestrator as input, ``[subagent NAME finished]
…``: steering if its task is still running, else a follow-up task of its own. Once all
three have answered, the orchestrator merges them.

The whole tree is watched through the orchestrator's session: its own outputs, and every
researcher's, tagged with ``origin`` (the session ids from the root). It runs offline on
the scripted model, whose replies are written out below:

    .venv/bin/python examples/orchestrator.py
"""

from __future__ import annotations

import math
import re
import sys
import tempfile

import trio

from greenroom import Host, tool, user_text
from greenroom.actors.runtime import spawn_subagent
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM
from greenroom.actors.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.protocols import ModelMsg, Output, TaskEnd, TextBlock, ToolCallBlock, UserMsg
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage

TOPICS = {"researcher-1": "tides", "researcher-2": "glaciers", "researcher-3": "monsoons"}

NOTES = {
    "tides": "two highs a day, pulled by the moon",
    "glaciers": "they flow, a few metres a day",
    "monsoons": "seasonal winds that bring the rain",
}

FINISHED = re.compile(r"\[subagent (\S+) finished\] (.*?)(?:\[/user_steering\])?$")
"""An answer as the orchestrator reads it: a finished-message that arrives while its task
still runs is steering, and the steering's closing tag may end the answer's line."""


@tool(parallel=True)
async def read_notes(topic: str) -> str:
    """Read the library's notes on a topic.

    Args:
        topic: one word, e.g. "tides".
    """
    # Stands in for a search that takes a while: the researchers finish one by one.
    await trio.sleep(0.02 * (1 + sorted(NOTES).index(topic)) if topic in NOTES else 0)
    return NOTES.get(topic, "nothing on that")


def approve(call: ToolCallBlock) -> str:
    """The host allows every call: spawning researchers and reading notes."""
    return "allow"


def texts(message: UserMessage) -> list[str]:
    return [part.text for part in message.content if isinstance(part, TextBlock)]


def researcher(request: ModelRequest) -> Reply:
    """A researcher reads its topic's notes, then answers with them."""
    first = request.messages[0]
    assert isinstance(first, UserMessage)
    topic = texts(first)[0].split()[-1]
    results = [p for p in request.messages[-1].content if isinstance(p, ToolResult)]
    if not results:
        return Reply(blocks=(tool_call("notes", "read_notes", topic=topic),))
    found = "".join(b.text for b in results[0].content if isinstance(b, TextBlock))
    return Reply(blocks=(text(f"{topic}: {found}"),))


def orchestrator(request: ModelRequest) -> Reply:
    """The orchestrator fans out, then merges once every researcher has answered."""
    answers: dict[str, str] = {}
    for message in request.messages:
        if isinstance(message, UserMessage):
            for line in "\n".join(texts(message)).splitlines():
                if match := FINISHED.search(line):
                    answers[match.group(1)] = match.group(2)
    if len(answers) == len(TOPICS):
        merged = "\n".join(f"- {answers[name]}" for name in sorted(answers))
        return Reply(blocks=(text(f"Merged report:\n{merged}"),))
    if len(request.messages) == 1:
        return Reply(
            blocks=(
                text("Three questions, three researchers."),
                *(
                    ToolCallBlock(
                        id=f"spawn_{n}",
                        name="spawn_subagent",
                        arguments={
                            "task": f"Find what the notes say about {topic}",
                            "background": True,
                            "name": name,
                        },
                    )
                    for n, (name, topic) in enumerate(TOPICS.items(), start=1)
                ),
            )
        )
    waiting = sorted(set(TOPICS) - set(answers))
    return Reply(blocks=(text(f"Waiting for {', '.join(waiting)}."),))


def brain(request: ModelRequest) -> Reply:
    """One scripted model for the whole tree: a subagent's system prompt says it is one."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return researcher(request)
    return orchestrator(request)


def show(output: Output) -> None:
    """One line for each output that matters, a researcher's indented under the root."""
    depth = len(output.origin or ()) - 1 if output.origin else 0
    pad = "    " * depth
    who = "orchestrator" if depth == 0 else f"researcher {output.session_id[-6:]}"
    if isinstance(output, UserMsg) and depth == 0:
        # Each block is one input: answers that arrive together, as one steering, each
        # keep a line of their own.
        said = "\n".join(b.text for b in output.content if isinstance(b, TextBlock))
        for line in said.splitlines():
            print(f"{pad}{who} <- {line}")
    elif isinstance(output, ModelMsg) and isinstance(output.block, TextBlock):
        for line in output.block.text.splitlines():
            print(f"{pad}{who}: {line}")
    elif isinstance(output, ModelMsg) and isinstance(output.block, ToolCallBlock):
        print(f"{pad}{who} calls {output.block.name} {output.block.arguments}")
    elif isinstance(output, TaskEnd):
        print(f"{pad}{who} task_end: {output.status}")


async def main() -> int:
    with tempfile.TemporaryDirectory() as data_dir, trio.move_on_after(30):
        async with Host.open(data_dir=data_dir) as host:
            session = await host.create_session(
                provider=ScriptedProvider(brain),
                tools=[read_notes, spawn_subagent],
                workspace_dir=".",
            )
            # The whole tree, across the orchestrator's follow-up tasks: unbounded, as
            # the session never waits for its watchers.
            send, receive = trio.open_memory_channel[list[Output]](math.inf)
            session.watch(send)
            question = "What do the notes say about tides, glaciers and monsoons?"
            # Read through the watch alone: the run's own stream ends with its first task.
            session.run([user_text(question)], approve=approve).detach()
            merged = False
            async for batch in receive:
                for output in batch:
                    show(output)
                    if output.origin is not None:
                        continue  # a researcher's: shown, indented
                    if isinstance(output, ModelMsg) and isinstance(output.block, TextBlock):
                        merged = output.block.text.startswith("Merged report")
                    if isinstance(output, TaskEnd) and (merged or output.status != "completed"):
                        return 0 if merged else 1
    print("no merged report within 30 s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(trio.run(main))
