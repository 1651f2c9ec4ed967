"""A minimal embedding of greenroom: a custom tool, an approve callback, printed outputs.

Runs offline against the scripted model, whose replies are written out below, so the run
is the same every time:

    .venv/bin/python examples/embed_minimal.py

To run it on Claude instead, set ANTHROPIC_API_KEY and replace ``provider=…`` in
``create_session`` with ``model="claude-sonnet-4-5"``.
"""

from __future__ import annotations

import sys
import tempfile

import trio

from greenroom import Host, tool, user_text
from greenroom.actors.scripted import Reply, ScriptedProvider, ScriptedStream, text, tool_call
from greenroom.protocols import (
    ApprovalDecision,
    ModelMsg,
    Output,
    PartialText,
    TaskEnd,
    TextBlock,
    ToolCallBlock,
    ToolCallOutput,
)
from greenroom.protocols.context import ModelRequest, ToolResult

PRICES = {"widget": "19.99", "gadget": "49.50", "gizmo": "120.00"}


@tool(parallel=True)
async def lookup_price(product: str) -> str:
    """Look up the unit price of a product, in EUR.

    Args:
        product: the product name, e.g. "widget".
    """
    await trio.sleep(0.01)  # stands in for a database or HTTP call
    try:
        return PRICES[product.lower()]
    except KeyError:
        # Raising gives the model an error output; the task goes on (R-TOOL-4).
        raise ValueError(f"no product named {product!r}") from None


@tool(parallel=False)
async def send_email(to: str, body: str) -> str:
    """Send an email (a side effect: the approve callback below refuses it).

    Args:
        to: the recipient's address.
        body: the message.
    """
    return f"sent to {to}"


def approve(call: ToolCallBlock) -> str:
    """The host decides each tool call: read-only lookups yes, anything else no."""
    return "allow" if call.name == "lookup_price" else "deny"


async def answer(request: ModelRequest, stream: ScriptedStream) -> None:
    """The scripted model's second turn: it reads the tool results it was given and
    streams its answer word by word."""
    results = [
        part
        for message in request.messages
        for part in message.content
        if isinstance(part, ToolResult)
    ]
    lines = [
        f"- {r.tool} [{r.status}]: "
        + " ".join(b.text for b in r.content if isinstance(b, TextBlock))
        for r in results
    ]
    await stream.text("Here is what I found:\n" + "\n".join(lines), chunk_delay_s=0.01)
    await stream.end()


SCRIPT = [
    Reply(
        blocks=(
            text("Let me look up both prices at once, and tell the team."),
            tool_call("call_1", "lookup_price", product="widget"),
            tool_call("call_2", "lookup_price", product="gizmo"),
            tool_call("call_3", "send_email", to="team@example.com", body="Prices checked."),
        )
    ),
    answer,
]


def show(output: Output) -> None:
    """Print one output: streamed text inline, a line for each event that matters."""
    if isinstance(output, PartialText):
        print(output.text, end="", flush=True)
    elif isinstance(output, ModelMsg) and isinstance(output.block, TextBlock):
        print()
    elif isinstance(output, ModelMsg) and isinstance(output.block, ToolCallBlock):
        print(f"  tool call  {output.block.name} {output.block.arguments}")
    elif isinstance(output, ApprovalDecision):
        print(f"  decision   {output.tool}: {output.decision} (by {output.by})")
    elif isinstance(output, ToolCallOutput):
        content = " ".join(b.text for b in output.content if isinstance(b, TextBlock))
        print(f"  result     {output.tool} [{output.status}]: {content}")
    elif isinstance(output, TaskEnd):
        print(f"task_end: {output.status} after {output.turns} turns")


async def main() -> int:
    with tempfile.TemporaryDirectory() as data_dir:
        async with Host.open(data_dir=data_dir) as host:
            session = await host.create_session(
                provider=ScriptedProvider(SCRIPT),
                tools=[lookup_price, send_email],
                workspace_dir=".",
            )
            stream = session.run(
                [user_text("What do a widget and a gizmo cost?")], approve=approve
            )
            async for output in stream:
                show(output)
            # The stream kept the answer (result.text) and the task_end: a host that does
            # not watch the outputs calls result() alone.
            result = await stream.result()
    return 0 if result.status == "completed" else 1


if __name__ == "__main__":
    sys.exit(trio.run(main))
