"""The built-in ``ask_user`` tool: the model asks the person a question (R-HITL-5).

Where people answer (``approve="people"``: ``serve``, chat, the console, editors, hosts
that answer through ``host.answer_question``), a call of this tool is never run: it is a
durable question in the trace (``approval_request`` of ``kind: "question"``), answered
whenever the person can, and the answer is the call's result. Where nobody can answer, the
tool's own body runs and tells the model so.
"""

from __future__ import annotations

from greenroom.protocols.people import ASK_USER
from greenroom.protocols.tools import tool

__all__ = ["NOBODY_TO_ASK", "ask_user"]

NOBODY_TO_ASK = (
    "No one can answer questions in this session. Decide yourself, and say in your answer "
    "what you assumed."
)
"""The result of ``ask_user`` where no person answers questions."""


@tool(parallel=True, name=ASK_USER)
async def ask_user(question: str, choices: list[str] | None = None) -> str:
    """Ask the person you work for a question, and wait for their answer (they may answer
    much later). Use it when you cannot go on well without a decision or a fact only they
    have; give ``choices`` when the answer is one of a few options.

    Args:
        question: the question, complete enough to answer without the conversation.
        choices: the possible answers, when there are a few.
    """
    return NOBODY_TO_ASK
