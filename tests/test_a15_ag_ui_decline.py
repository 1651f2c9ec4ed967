"""Declining the model's own question (``ask_user``) with choices over ``serve --ag-ui``
(R-PROTO-2, R-HITL-5): a ``cancelled`` resume entry tells the model the person declined,
also when the question offers choices the decline's words are none of."""

from __future__ import annotations

from pathlib import Path

import trio
from test_gateway import serving
from test_gateway_ag_ui import BOUND_S, posted, run_input
from test_p14_ag_ui import question_script, the_interrupt

from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.markers import DECLINED_ANSWER


async def test_a_cancelled_resume_declines_the_models_question_with_choices(
    tmp_path: Path,
) -> None:
    """R-PROTO-2, R-HITL-5: the model asks which size, S or M; the front end cancels the
    interrupt. The decline's words went to the question as its answer and were refused as
    none of its choices: the run was 400 ``asks to choose one of ['S', 'M']`` and the
    question waited on, with no way to decline it. Now the decline is taken: the call's
    result tells the model the person declined and the run streams the task to its end."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, question_script, tools=[ask_user], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("t-q", "r1", "order me a shirt"))
            interrupt = the_interrupt(first)
            cancel = [{"interruptId": interrupt.id, "status": "cancelled"}]
            done = await posted(url, run_input("t-q", "r2", resume=cancel))
    assert interrupt.reason == "question"
    assert done.status == 200, done.body
    assert done.of("TOOL_CALL_RESULT")[0]["content"] == DECLINED_ANSWER
    assert done.types[-1] == "RUN_FINISHED"
    assert done.of("RUN_FINISHED")[0]["outcome"]["type"] == "success"
