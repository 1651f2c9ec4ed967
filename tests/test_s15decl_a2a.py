"""Over ``serve --a2a`` (R-PROTO-1, R-HITL-5), driven by the a2a-sdk's own client: a decline
of the model's own question (``ask_user``) is recorded as a decline — the caller's ``deny`` —
and text a person sends is their answer whatever it says, also the words the model reads for
a decline. A trace written before declines were recorded so (the decline an ``allow`` whose
result is those words) has exactly the records of such a typed answer, and reads as one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from a2a.types import GetTaskRequest, Role, TaskState
from test_a15_a2a_decline import question_script
from test_gateway import serving
from test_gateway_a2a import BOUND_S, collect, state_of
from test_p14_a2a import declined
from test_protofix_a2a import said, with_the_sdk

from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.markers import DECLINED_ANSWER
from greenroom.protocols.outputs import ApprovalDecision, ToolCallOutput


async def asked_then(tmp_path: Path, answer: Any) -> tuple[list[Any], list[Any], Any]:
    """Ask the model to buy a shirt (it asks which size, freely), then send ``answer(ids)``;
    the stream of that send, the session's records and the task as ``tasks/get`` gives it."""

    async def work(client: Any) -> Any:
        first = await collect(client.send_message(said("buy me a shirt", "m-buy")))
        task = first[0].task
        ids = {"task_id": task.id, "context_id": task.context_id}
        answered = await collect(client.send_message(answer(ids)))
        return task, answered, await client.get_task(GetTaskRequest(id=task.id))

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, question_script(), tools=[ask_user], a2a=True) as server:
            task, answered, got = await with_the_sdk(server, work)
            records = await replay_records(server.host.get_session(task.context_id), 0)
    return answered, records, got


def last_user_reply(got: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The texts and data parts of the task history's last user message."""
    (*_, last) = [m for m in got.history if m.role == Role.ROLE_USER]
    texts = [p.text for p in last.parts if p.text]
    return texts, [dict(p.data.struct_value) for p in last.parts if p.HasField("data")]


async def test_a_decline_is_recorded_as_the_callers_deny(tmp_path: Path) -> None:
    """R-HITL-5: a ``{"decision": "deny"}`` data part declines the model's question. It
    was recorded as an ``allow`` whose result was the words ``(the person declined to
    answer)``, as if the person had typed them. Now the trace says declined: the caller's
    ``deny``, the words the call's (denied) result the model reads."""
    answered, records, got = await asked_then(tmp_path, lambda ids: declined("m-no", **ids))
    assert state_of(answered[-1]) == TaskState.TASK_STATE_COMPLETED
    decided = [(r.decision, r.by) for r in records if isinstance(r, ApprovalDecision)]
    assert decided == [("deny", "client")]
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.status == "denied"
    assert result.content[0].text == DECLINED_ANSWER  # type: ignore[union-attr]
    assert last_user_reply(got) == ([], [{"call_id": "q1", "question": "declined"}])


async def test_typed_words_that_read_as_the_decline_are_the_answer(tmp_path: Path) -> None:
    """R-HITL-5, R-PROTO-1: the person answers the question with the text ``(the person
    declined to answer)``. The history showed the question declined and dropped the
    person's words. Now it is their answer: an ``allow`` by them, the words the call's
    result, and the history's user turn shows them as the answer."""
    answered, records, got = await asked_then(
        tmp_path, lambda ids: said(DECLINED_ANSWER, "m-typed", **ids)
    )
    assert state_of(answered[-1]) == TaskState.TASK_STATE_COMPLETED
    decided = [(r.decision, r.by) for r in records if isinstance(r, ApprovalDecision)]
    assert decided == [("allow", "client")]
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.status == "ok"
    assert last_user_reply(got) == (
        [DECLINED_ANSWER],
        [{"call_id": "q1", "answer": DECLINED_ANSWER}],
    )
