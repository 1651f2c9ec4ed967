"""Over ``serve --ag-ui`` (R-PROTO-2, R-HITL-5): a ``cancelled`` resume of the model's own
question (``ask_user``) is recorded as a decline — the caller's ``deny`` — and an answer a
front end sends is the person's text whatever it says, also the words the model reads for a
decline: held to the question's choices like any other."""

from __future__ import annotations

from pathlib import Path

import trio
from test_gateway import serving
from test_gateway_ag_ui import BOUND_S, posted, run_input
from test_p14_ag_ui import question_script, the_interrupt

from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.markers import DECLINED_ANSWER
from greenroom.protocols.outputs import ApprovalDecision, ToolCallOutput


async def test_a_cancelled_resume_is_recorded_as_the_callers_deny(tmp_path: Path) -> None:
    """R-HITL-5: the front end cancels the interrupt of the model's question (S or M).
    It was recorded as an ``allow`` whose result was the words ``(the person declined to
    answer)``, as if the person had typed them. Now the trace says declined: the caller's
    ``deny``; the model reads those words as the call's (denied) result."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, question_script, tools=[ask_user], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            interrupt = the_interrupt(await posted(url, run_input("t-q", "r1", "order a shirt")))
            cancel = [{"interruptId": interrupt.id, "status": "cancelled"}]
            done = await posted(url, run_input("t-q", "r2", resume=cancel))
            records = await replay_records(server.host.get_session("t-q"), 0)
    assert done.status == 200, done.body
    assert done.of("TOOL_CALL_RESULT")[0]["content"] == DECLINED_ANSWER
    decided = [(r.decision, r.by) for r in records if isinstance(r, ApprovalDecision)]
    assert decided == [("deny", "client")]
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.status == "denied"


async def test_an_answer_that_reads_as_the_decline_is_held_to_the_choices(
    tmp_path: Path,
) -> None:
    """R-HITL-5, R-PROTO-2: the front end answers the question (S or M) with ``{"answer":
    "(the person declined to answer)"}``. Those words were taken as a decline: the
    choices went unchecked and the run went on. Now they are an answer like any other:
    409, none of the choices, and the question waits for its real answer."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, question_script, tools=[ask_user], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            interrupt = the_interrupt(await posted(url, run_input("t-q", "r1", "order a shirt")))
            typed = [{"interruptId": interrupt.id, "status": "resolved",
                      "payload": {"answer": DECLINED_ANSWER}}]  # fmt: skip
            refused = await posted(url, run_input("t-q", "r2", resume=typed))
            chosen = [{"interruptId": interrupt.id, "status": "resolved",
                       "payload": {"answer": "M"}}]  # fmt: skip
            done = await posted(url, run_input("t-q", "r3", resume=chosen))
    assert refused.status == 409 and "choose one of" in str(refused.body), refused.body
    assert done.status == 200, done.body
    assert done.of("TOOL_CALL_RESULT")[0]["content"] == "M"
