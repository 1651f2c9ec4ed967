"""An ACP agent process for the people-in-the-loop tests (``tests/test_acp_people.py``):
``greenroom acp`` as the command line sets it up (``--approve ask``), with a scripted model
the tests choose and a side-effecting ``pay`` tool that records each payment it makes.

Usage: ``python acp_people_agent.py SCENARIO DATA_DIR MARKS``. The model, the same in every
process of a test (a loaded session goes on where the stopped process left it):

* ``pay``: calls ``pay(amount=7)``; ``choices``: asks ``ask_user`` a question with the
  choices ``red`` and ``blue``; ``free``: asks one without choices;
* once the call's result is in: answers ``Done: <the result>``;
* to the prompt ``thanks``: answers ``You are welcome.``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from greenroom.actors.apps.acp import AcpConfig, serve_stdio
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.tools import make_tool


def main() -> None:
    scenario, data_dir, marks = sys.argv[1:4]

    async def pay(amount: int) -> str:
        """Pay an amount."""
        _mark(marks, amount)
        return f"paid {amount}"

    def model(request: ModelRequest) -> Reply:
        last = request.messages[-1] if request.messages else None
        results = (
            [p for p in last.content if isinstance(p, ToolResult)]
            if isinstance(last, UserMessage)
            else []
        )
        if results:
            said = "".join(b.text for b in results[-1].content if isinstance(b, TextBlock))
            return Reply(blocks=(text(f"Done: {said}"),))
        if isinstance(last, UserMessage) and any(
            isinstance(p, TextBlock) and p.text == "thanks" for p in last.content
        ):
            return Reply(blocks=(text("You are welcome."),))
        if scenario == "pay":
            return Reply(blocks=(text("Paying."), tool_call("p1", "pay", amount=7)))
        if scenario == "choices":
            call = tool_call("q1", "ask_user", question="Which color?", choices=["red", "blue"])
        else:
            call = tool_call("q1", "ask_user", question="When shall we meet?")
        return Reply(blocks=(call,))

    config = AcpConfig(
        provider=ScriptedProvider(model),
        tools=(make_tool(pay, parallel=False), ask_user),
    )
    # As `greenroom acp` does: frames go to a private duplicate of stdout, fd 1 to stderr.
    frames = os.dup(1)
    os.dup2(2, 1)
    serve_stdio(config, Path(data_dir), frames)


def _mark(marks: str, amount: int) -> None:
    # Small and local: written before the tool returns, so a test sees every payment.
    with open(marks, "a", encoding="utf-8") as handle:
        handle.write(f"{amount}\n")


if __name__ == "__main__":
    main()
