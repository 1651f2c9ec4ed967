"""Structured output: the answer of a run as an instance of an attrs class (R-OUT-1).

The model reads a document with a tool, then answers with JSON that must match the schema
of ``Invoice``. Its first answer gets a quantity wrong; the runtime sends the problems back
once, the model corrects them, and ``result.output`` is an ``Invoice``. Runs offline on
the scripted model, whose replies are written out below:

    .venv/bin/python examples/structured_output.py

On a real model (set ANTHROPIC_API_KEY and pass ``model="claude-sonnet-4-5"`` instead of
``provider=…``) the provider's native structured output constrains the answer; models
without it answer through a ``final_answer`` tool. Either way the answer is validated.
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Literal

import attrs
import trio

from greenroom import Host, tool
from greenroom.actors.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.protocols import ModelMsg, TextBlock, ToolCallBlock, UserMsg
from greenroom.protocols.context import ModelRequest

DOCUMENTS = {
    "invoice-17.txt": "ACME Tools, invoice 17: 2 x widget at 19.99 EUR; 1 x gizmo at 120 EUR.",
}


@attrs.frozen
class Line:
    """One line of an invoice."""

    item: str
    quantity: int
    unit_price: float


@attrs.frozen
class Invoice:
    """An invoice as read from a document."""

    supplier: str
    number: int
    currency: Literal["EUR", "USD"]
    lines: list[Line]


@tool(parallel=True)
async def read_document(document: str) -> str:
    """Read a document by name.

    Args:
        document: the document's file name, e.g. "invoice-17.txt".
    """
    return DOCUMENTS[document]


def corrected(request: ModelRequest) -> Reply:
    """The model's second answer: the runtime told it what was wrong (the last message it
    was sent), so it writes the quantity as a number."""
    note = "".join(
        block.text for block in request.messages[-1].content if isinstance(block, TextBlock)
    )
    assert "$.lines[0].quantity: expected integer, got string" in note
    answer = {
        "supplier": "ACME Tools",
        "number": 17,
        "currency": "EUR",
        "lines": [
            {"item": "widget", "quantity": 2, "unit_price": 19.99},
            {"item": "gizmo", "quantity": 1, "unit_price": 120.0},
        ],
    }
    return Reply(blocks=(text(json.dumps(answer)),))


SCRIPT = [
    Reply(blocks=(tool_call("call_1", "read_document", document="invoice-17.txt"),)),
    Reply(
        blocks=(
            text(
                '{"supplier": "ACME Tools", "number": 17, "currency": "EUR", "lines": '
                '[{"item": "widget", "quantity": "two", "unit_price": 19.99}, '
                '{"item": "gizmo", "quantity": 1, "unit_price": 120}]}'
            ),
        )
    ),
    corrected,
]


async def main() -> int:
    with tempfile.TemporaryDirectory() as data_dir:
        async with Host.open(data_dir=data_dir) as host:
            session = await host.create_session(
                provider=ScriptedProvider(SCRIPT), tools=[read_document], workspace_dir="."
            )
            stream = session.run(
                "Read invoice-17.txt and give me the invoice.",
                approve=lambda call: "allow",
                output_schema=Invoice,
            )
            async for output in stream:
                if isinstance(output, ModelMsg) and isinstance(output.block, ToolCallBlock):
                    print(f"tool call   {output.block.name} {output.block.arguments}")
                elif isinstance(output, ModelMsg) and isinstance(output.block, TextBlock):
                    print(f"answer      {output.block.text}")
                elif isinstance(output, UserMsg) and output.kind == "steering":
                    note = " ".join(b.text for b in output.content if isinstance(b, TextBlock))
                    print(f"sent back   {note.splitlines()[1]}")
            result = await stream.result()
    print(f"task_end: {result.status} after {result.task_end.turns} turns")
    invoice = result.output
    assert isinstance(invoice, Invoice)
    total = sum(line.quantity * line.unit_price for line in invoice.lines)
    print(f"{invoice.supplier} invoice {invoice.number}: {total:.2f} {invoice.currency}")
    print(json.dumps(result.task_end.output))
    return 0 if result.status == "completed" else 1


if __name__ == "__main__":
    sys.exit(trio.run(main))
