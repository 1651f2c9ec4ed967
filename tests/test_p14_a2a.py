"""The A2A server of ``serve --a2a`` (R-PROTO-1, R-HITL-2, R-HITL-5), driven by the a2a-sdk's
own client: a question a running call asks (an MCP elicitation) can be declined, with a data
part ``{"decision": "deny"}``; its text answers it whatever it says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from a2a.types import GetTaskRequest, Message, Part, Role, SendMessageRequest, TaskState
from google.protobuf import struct_pb2
from google.protobuf.json_format import ParseDict
from test_gateway import serving
from test_gateway_a2a import BOUND_S, collect, state_of
from test_protofix_a2a import (
    order,
    order_allowed,
    order_script,
    said,
    user_data_parts,
    with_the_sdk,
)

from greenroom.actors.gateway.hubs import replay_records
from greenroom.protocols.outputs import ApprovalDecision, ToolCallOutput


def declined(message_id: str, *words: str, **ids: str) -> SendMessageRequest:
    """A message whose data part declines the question (``words``: text parts beside it)."""
    data = ParseDict({"decision": "deny"}, struct_pb2.Value())
    parts = [*(Part(text=w) for w in words), Part(data=data)]
    return SendMessageRequest(
        message=Message(role=Role.ROLE_USER, message_id=message_id, parts=parts, **ids)
    )


async def test_a_running_calls_question_is_declined_by_a_decision_data_part(
    tmp_path: Path,
) -> None:
    """R-PROTO-1, R-HITL: a call is approved, then asks while it runs which size. A2A had
    no way to decline it: every message's text was taken as the answer, a data part
    ``{"decision": "deny"}`` included (its empty text went to the call). Now that data
    part declines the question — the call gets ``decline``, the decision is recorded as
    the caller's deny, the history shows it declined — and the send follows the task to
    its end. A text ``deny`` beside it is not read as the answer."""

    async def work(client: Any) -> Any:
        task, ids, asked = await order_allowed(client)
        answered = await collect(client.send_message(declined("m-no", "deny", **ids)))
        return task, asked, answered, await client.get_task(GetTaskRequest(id=task.id))

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, order_script, tools=[order], a2a=True) as server:
            task, asked, answered, got = await with_the_sdk(server, work)
            records = await replay_records(server.host.get_session(task.context_id), 0)
    assert state_of(asked[-1]) == TaskState.TASK_STATE_INPUT_REQUIRED
    assert asked[-1].status_update.status.message.parts[0].text.startswith("Which size?")
    assert state_of(answered[-1]) == TaskState.TASK_STATE_COMPLETED
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.content[0].text == "ordered None (decline)"  # type: ignore[union-attr]
    decided = [(r.decision, r.by) for r in records if isinstance(r, ApprovalDecision)]
    assert decided[-1] == ("deny", "client")
    replies = user_data_parts(got)
    assert replies[-1] == {"call_id": "c1", "question": "declined"}


async def test_a_question_s_text_deny_is_its_answer(tmp_path: Path) -> None:
    """R-HITL-5: without the data part, the text ``deny`` is the answer to the question —
    here not one of its choices, so the send is refused and the question still waits."""

    async def work(client: Any) -> Any:
        _, ids, _ = await order_allowed(client)
        try:
            await collect(client.send_message(said("deny", "m-deny", **ids)))
        except Exception as exc:  # the SDK raises the JSON-RPC error it was answered
            refused = str(exc)
        else:
            refused = ""
        answered = await collect(client.send_message(said("S", "m-s", **ids)))
        return refused, answered

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, order_script, tools=[order], a2a=True) as server:
            refused, answered = await with_the_sdk(server, work)
    assert "does not fit" in refused, refused
    assert state_of(answered[-1]) == TaskState.TASK_STATE_COMPLETED
