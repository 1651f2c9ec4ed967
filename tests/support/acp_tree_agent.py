"""An ACP agent process for the agent-tree tests (``tests/test_acp_tree.py``):
``greenroom acp``'s set-up (``--approve all``) with a scripted model that fans out one
background subagent, and a ``hold`` tool that blocks until the test writes a line to a
FIFO (a child that is busy for as long as the test wants, without a clock).

Usage: ``python acp_tree_agent.py DATA_DIR FIFO``. The model:

* the root, on any prompt: ``spawn_subagent(task="scout the notes", background=true,
  name="scout")``, then, once the call's result is in, ``Started the scout.``;
* the child (its system prompt is a subagent's): ``Looking.`` and ``hold()``, then, once
  the hold is released, ``Scout report: <every later user text of its context>`` — the
  steering it received;
* the root, on ``[subagent scout finished] …``: ``Merged: <that text>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import trio

from greenroom.actors.apps.acp import AcpConfig, serve_stdio
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.tools import make_tool


def main() -> None:
    data_dir, fifo = sys.argv[1:3]

    async def hold() -> str:
        """Wait until released."""
        said = await trio.to_thread.run_sync(Path(fifo).read_text, abandon_on_cancel=True)
        return f"released: {said.strip()}"

    def model(request: ModelRequest) -> Reply:
        users = [m for m in request.messages if isinstance(m, UserMessage)]
        last = users[-1]
        said = "".join(p.text for p in last.content if isinstance(p, TextBlock))
        results = [p for p in last.content if isinstance(p, ToolResult)]
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            if len(users) == 1:
                return Reply(blocks=(text("Looking."), tool_call("h1", "hold")))
            later = [p.text for m in users[1:] for p in m.content if isinstance(p, TextBlock)]
            return Reply(blocks=(text("Scout report: " + " ".join(later)),))
        if said.startswith("[subagent scout finished]"):
            return Reply(blocks=(text(f"Merged: {said}"),))
        if results:
            return Reply(blocks=(text("Started the scout."),))
        arguments = {"task": "scout the notes", "background": True, "name": "scout"}
        call = ToolCallBlock(id="p1", name="spawn_subagent", arguments=arguments)
        return Reply(blocks=(call,))

    config = AcpConfig(
        provider=ScriptedProvider(model),
        tools=(make_tool(hold, parallel=False), spawn_subagent),
        approve="all",
    )
    # As `greenroom acp` does: frames go to a private duplicate of stdout, fd 1 to stderr.
    frames = os.dup(1)
    os.dup2(2, 1)
    serve_stdio(config, Path(data_dir), frames)


if __name__ == "__main__":
    main()
