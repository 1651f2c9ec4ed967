"""Declining the model's own question (``ask_user``) over ``serve --a2a`` (R-PROTO-1,
R-HITL-5), driven by the a2a-sdk's own client: a ``{"decision": "deny"}`` data part
declines it as AG-UI's ``cancelled`` resume does — the model is told, in the same words,
that the person declined, and the task's history shows the question declined."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from a2a.types import GetTaskRequest, Role, TaskState
from test_gateway import serving
from test_gateway_a2a import BOUND_S, collect, state_of
from test_p14_a2a import declined
from test_protofix_a2a import said, with_the_sdk

from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.providers.scripted import Reply, ScriptStep, text, tool_call
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.markers import DECLINED_ANSWER
from greenroom.protocols.outputs import ApprovalDecision, ToolCallOutput


def question_script(**choices: list[str]) -> Any:
    def script() -> list[ScriptStep]:
        ask = tool_call("q1", "ask_user", question="Which size?", **choices)
        return [Reply(blocks=(ask,)), Reply(blocks=(text("I will pick one myself."),))]

    return script


@pytest.mark.parametrize("choices", [{}, {"choices": ["S", "M"]}], ids=["free", "choices"])
async def test_the_models_own_question_is_declined_by_a_decision_data_part(
    tmp_path: Path, choices: dict[str, list[str]]
) -> None:
    """R-PROTO-1, R-HITL-5: the model asks (``ask_user``) which size; the answer is a
    message whose data part is ``{"decision": "deny"}``. It was refused with the JSON-RPC
    error ``answer it with text`` (only a running call's question could be declined), the
    question waiting on. Now it is declined: the call's result tells the model the person
    declined, in AG-UI's words (one constant), the task completes, and the history shows
    the question declined — not the decline's words as the user's answer. A question with
    choices is declined too (the decline is none of them, and need not be)."""

    async def work(client: Any) -> Any:
        first = await collect(client.send_message(said("buy me a shirt", "m-buy")))
        task = first[0].task
        ids = {"task_id": task.id, "context_id": task.context_id}
        answered = await collect(client.send_message(declined("m-no", **ids)))
        return task, first, answered, await client.get_task(GetTaskRequest(id=task.id))

    script = question_script(**choices)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script, tools=[ask_user], a2a=True) as server:
            task, first, answered, got = await with_the_sdk(server, work)
            records = await replay_records(server.host.get_session(task.context_id), 0)
    assert state_of(first[-1]) == TaskState.TASK_STATE_INPUT_REQUIRED
    assert state_of(answered[-1]) == TaskState.TASK_STATE_COMPLETED
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.content[0].text == DECLINED_ANSWER  # type: ignore[union-attr]
    assert [r.by for r in records if isinstance(r, ApprovalDecision)] == ["client"]
    users = [m for m in got.history if m.role == Role.ROLE_USER]
    assert [p.text for p in users[0].parts] == ["buy me a shirt"]
    (reply,) = [dict(p.data.struct_value) for p in users[-1].parts if p.HasField("data")]
    assert reply == {"call_id": "q1", "question": "declined"}
    assert not [p.text for p in users[-1].parts if p.text]


async def test_the_models_own_question_answered_with_text_is_still_that_answer(
    tmp_path: Path,
) -> None:
    """R-HITL-5 (a guard): a plain ``deny`` text answers the model's question with the
    word ``deny`` — the decline is a data part's alone."""

    async def work(client: Any) -> Any:
        first = await collect(client.send_message(said("buy me a shirt", "m-buy")))
        task = first[0].task
        ids = {"task_id": task.id, "context_id": task.context_id}
        await collect(client.send_message(said("deny", "m-deny", **ids)))
        return task, await client.get_task(GetTaskRequest(id=task.id))

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, question_script(), tools=[ask_user], a2a=True) as server:
            task, got = await with_the_sdk(server, work)
            records = await replay_records(server.host.get_session(task.context_id), 0)
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.content[0].text == "deny"  # type: ignore[union-attr]
    users = [m for m in got.history if m.role == Role.ROLE_USER]
    (reply,) = [dict(p.data.struct_value) for p in users[-1].parts if p.HasField("data")]
    assert reply == {"call_id": "q1", "answer": "deny"}
