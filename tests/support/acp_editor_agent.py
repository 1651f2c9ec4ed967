"""An ACP agent process for the tests of the editor's files, terminal, modes, session list
and usage (``tests/test_acp_editor.py``, ``tests/test_acp_editor_ts.py``): ``greenroom
acp``'s set-up with the built-in tools and a scripted model that does what the prompt
says.

Usage: ``python acp_editor_agent.py DATA_DIR SANDBOX APPROVE``: the sessions' ``sandbox``
setting (``auto``, ``off``, ``required``) and ``--approve`` (``ask``, ``all``, ``none``).
The model, on the prompt:

* ``read PATH``: ``read_file(path=PATH)``; ``twice PATH``: that call, and once its result is
  in, the same call again;
* ``write PATH TEXT``: ``write_file(path=PATH, content=TEXT)`` (``\\n`` in TEXT is a newline);
* ``run COMMAND``: ``run_shell(command=COMMAND)``;
* once the last call's result is in: ``Done: <that result>``;
* anything else: ``Hello.``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from greenroom.actors.apps.acp import AcpConfig, serve_stdio
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.tools.builtin import builtin_tools
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage


def model(request: ModelRequest) -> Reply:
    messages = request.messages
    prompt = next(
        (
            "".join(p.text for p in m.content if isinstance(p, TextBlock))
            for m in reversed(messages)
            if isinstance(m, UserMessage) and any(isinstance(p, TextBlock) for p in m.content)
        ),
        "",
    )
    last = messages[-1] if messages else None
    results = (
        [p for p in last.content if isinstance(p, ToolResult)]
        if isinstance(last, UserMessage)
        else []
    )
    verb, _, rest = prompt.partition(" ")
    call_id = f"c{len(messages)}"
    if results:
        if verb == "twice" and len(results) == 1 and _calls_since_prompt(messages) == 1:
            return Reply(blocks=(tool_call(call_id, "read_file", path=rest),))
        said = "".join(b.text for b in results[-1].content if isinstance(b, TextBlock))
        return Reply(blocks=(text(f"Done: {said}"),))
    if verb in ("read", "twice"):
        return Reply(blocks=(tool_call(call_id, "read_file", path=rest),))
    if verb == "write":
        path, _, content = rest.partition(" ")
        content = content.replace("\\n", "\n")
        return Reply(blocks=(tool_call(call_id, "write_file", path=path, content=content),))
    if verb == "run":
        return Reply(blocks=(tool_call(call_id, "run_shell", command=rest),))
    return Reply(blocks=(text("Hello."),))


def _calls_since_prompt(messages: tuple[object, ...]) -> int:
    count = 0
    for message in reversed(messages):
        if isinstance(message, UserMessage) and any(
            isinstance(p, TextBlock) for p in message.content
        ):
            return count
        if isinstance(message, UserMessage):
            count += sum(isinstance(p, ToolResult) for p in message.content)
    return count


def main() -> None:
    data_dir, sandbox, approve = sys.argv[1:4]
    config = AcpConfig(
        provider=ScriptedProvider(model),
        tools=tuple(builtin_tools()),
        settings={"sandbox": sandbox},
        approve=approve,
    )
    # As `greenroom acp` does: frames go to a private duplicate of stdout, fd 1 to stderr.
    frames = os.dup(1)
    os.dup2(2, 1)
    serve_stdio(config, Path(data_dir), frames)


if __name__ == "__main__":
    main()
