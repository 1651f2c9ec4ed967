"""A person's decline of the model's own question (``ask_user``) is a fact of its own, never
a text (R-HITL-5, R-HITL-2): ``host.answer_approval(..., "deny")`` declines it, recorded as
the call's ``approval_decision`` ``deny``; text a person types is their answer whatever it
says, also the words the model reads for a decline."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import collect, of_type
from test_people import last_result, until_parked

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import NotPending
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import RunStream
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.content import TextBlock
from greenroom.protocols.markers import DECLINED_ANSWER
from greenroom.protocols.outputs import ApprovalDecision, TaskEnd, ToolCallOutput
from greenroom.protocols.people import PEOPLE


async def parked_size_question(
    host: Host, workspace: Path
) -> tuple[ScriptedProvider, str, RunStream]:
    """A task parked on the model's ``ask_user`` question "Which size?" (S or M): its
    provider, its session's id and its stream."""
    ask = tool_call("q1", "ask_user", question="Which size?", choices=["S", "M"])
    provider = ScriptedProvider([Reply(blocks=(ask,)), Reply(blocks=(text("Noted."),))])
    session = await host.create_session(
        provider=provider, tools=[ask_user], workspace_dir=workspace
    )
    stream = session.run("order me a shirt", approve=PEOPLE)
    await until_parked(host, session.id)
    return provider, session.id, stream


async def test_a_deny_declines_the_models_question_and_the_trace_says_declined(
    host: Host, workspace: Path
) -> None:
    """R-HITL-5: a person declines the model's question with ``answer_approval(deny)``.
    It was refused (``answer it with text``): the only decline was the gateways' text
    ``(the person declined to answer)`` given as the answer. Now the deny is taken: the
    decision is recorded as ``deny`` by the person, the model reads the decline's words as
    the call's (denied) result, and the task goes on."""
    provider, session_id, stream = await parked_size_question(host, workspace)
    with pytest.raises(NotPending, match="answer it with text"):
        await host.answer_approval(session_id, "q1", "allow", by="carol")
    await host.answer_approval(session_id, "q1", "deny", by="carol")
    outputs = await collect(stream)
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by, decision.principal) == ("deny", "client", "carol")
    (result,) = of_type(outputs, ToolCallOutput)
    assert (result.status, result.content) == ("denied", (TextBlock(text=DECLINED_ANSWER),))
    assert last_result(provider.requests[-1]).content == (TextBlock(text=DECLINED_ANSWER),)
    assert of_type(outputs, TaskEnd)[-1].status == "completed"


async def test_text_that_reads_as_the_decline_is_an_answer_held_to_the_choices(
    host: Host, workspace: Path
) -> None:
    """R-HITL-5, R-HITL-2: a person types ``(the person declined to answer)`` to a question
    that asks S or M. Those words were taken as a decline: the choices were not checked
    and the text became the call's result. Now typed text is an answer like any other:
    refused as none of the choices, the question still waiting; the person's real choice
    is then the result."""
    _, session_id, stream = await parked_size_question(host, workspace)
    with pytest.raises(NotPending, match="choose one of"):
        await host.answer_question(session_id, "q1", DECLINED_ANSWER, by="carol")
    await host.answer_question(session_id, "q1", "M", by="carol")
    outputs = await collect(stream)
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("allow", "client")
    (result,) = of_type(outputs, ToolCallOutput)
    assert (result.status, result.content) == ("ok", (TextBlock(text="M"),))
