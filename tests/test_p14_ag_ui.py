"""The AG-UI endpoint of ``serve --ag-ui`` (R-PROTO-2) against a real gateway, every event
validated with the ``ag-ui-protocol`` package's types: a question's choices are where an
AG-UI front end reads them (the interrupt's ``responseSchema``), and an image the session's
``max_image_bytes`` admits is not refused by the HTTP front's frame cap first (R-SEC-1)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from ag_ui.core import Interrupt, RunFinishedEvent
from test_gateway import TOKEN, serving
from test_gateway_ag_ui import BOUND_S, posted, run_input
from test_protofix_a2a import order
from test_protofix_ag_ui import PNG, image, with_parts

from greenroom.actors.gateway import Gateway, SessionDefaults
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptStep,
    text,
    tool_call,
)
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.questions import ask_user


def question_script() -> list[ScriptStep]:
    return [
        Reply(blocks=(tool_call("q1", "ask_user", question="Which size?", choices=["S", "M"]),)),
        Reply(blocks=(text("Noted."),)),
    ]


def the_interrupt(stream: Any) -> Interrupt:
    (finished,) = stream.of("RUN_FINISHED")
    (interrupt,) = RunFinishedEvent.model_validate(finished).outcome.interrupts
    return interrupt


async def test_a_questions_choices_are_in_its_interrupts_response_schema(
    tmp_path: Path,
) -> None:
    """R-PROTO-2, R-HITL-5: the model asks which size, S or M. The interrupt said only
    ``Which size?`` with a response schema of any text: the choices were in
    ``metadata.arguments``, which no AG-UI front end reads. Now the ``answer`` of its
    ``responseSchema`` is an ``enum`` of the choices (what a front end builds its form
    from), the message names them, and ``metadata`` keeps the arguments (and the choices);
    the answer chosen reaches the model."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, question_script, tools=[ask_user], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("t-q", "r1", "order me a shirt"))
            interrupt = the_interrupt(first)
            resume = [{"interruptId": interrupt.id, "status": "resolved",
                       "payload": {"answer": "M"}}]  # fmt: skip
            done = await posted(url, run_input("t-q", "r2", resume=resume))
    assert interrupt.reason == "question"
    schema = interrupt.response_schema
    assert schema is not None
    assert schema["properties"]["answer"] == {"type": "string", "enum": ["S", "M"]}
    assert schema["required"] == ["answer"]
    assert interrupt.message == "Which size?\nChoose one of: S, M"
    assert interrupt.metadata is not None
    assert interrupt.metadata["arguments"] == {"question": "Which size?", "choices": ["S", "M"]}
    assert interrupt.metadata["choices"] == ["S", "M"]
    assert done.of("TOOL_CALL_RESULT")[0]["content"] == "M"
    assert done.types[-1] == "RUN_FINISHED"


def order_script() -> list[ScriptStep]:
    return [Reply(blocks=(tool_call("c1", "order"),)), Reply(blocks=(text("Ordered."),))]


async def test_a_running_calls_question_shows_its_choices_too(tmp_path: Path) -> None:
    """R-PROTO-2, R-HITL-5: a question a call asks while it runs (an MCP elicitation)
    offers its choices the same way; an approval's schema is as it was."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, order_script, tools=[order], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("t-o", "r1", "buy a shirt"))
            approval = the_interrupt(first)
            allow = [{"interruptId": "c1", "status": "resolved",
                      "payload": {"decision": "allow"}}]  # fmt: skip
            second = await posted(url, run_input("t-o", "r2", resume=allow))
            question = the_interrupt(second)
            answer = [{"interruptId": "c1", "status": "resolved", "payload": {"answer": "S"}}]
            done = await posted(url, run_input("t-o", "r3", resume=answer))
    assert approval.response_schema is not None
    assert approval.response_schema["properties"]["decision"]["enum"] == [
        "allow", "deny", "allow_session"
    ]  # fmt: skip
    assert question.response_schema is not None
    assert question.response_schema["properties"]["answer"]["enum"] == ["S", "M"]
    assert question.message == "Which size?\nChoose one of: S, M"
    assert done.of("TOOL_CALL_RESULT")[0]["content"] == "ordered S (accept)"


async def test_a_cancelled_resume_declines_a_running_calls_question(tmp_path: Path) -> None:
    """R-PROTO-2, R-HITL: a ``cancelled`` resume entry for a question a call asks while it
    runs (an MCP elicitation) was sent to the call as the answer text ``(the person
    declined to answer)`` — refused as none of its choices (the run 400, the question
    waiting on), or taken as a free answer. It now declines the question: the call gets
    ``decline`` and the run streams the rest of the task. The model's own question keeps
    its answer in words (it has no decline)."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, order_script, tools=[order], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            await posted(url, run_input("t-d", "r1", "buy a shirt"))
            allow = [{"interruptId": "c1", "status": "resolved",
                      "payload": {"decision": "allow"}}]  # fmt: skip
            asked = await posted(url, run_input("t-d", "r2", resume=allow))
            assert the_interrupt(asked).reason == "question"
            cancel = [{"interruptId": "c1", "status": "cancelled"}]
            done = await posted(url, run_input("t-d", "r3", resume=cancel))
    assert done.status == 200, done.body
    assert done.of("TOOL_CALL_RESULT")[0]["content"] == "ordered None (decline)"
    assert done.types[-1] == "RUN_FINISHED"
    assert done.of("RUN_FINISHED")[0]["outcome"]["type"] == "success"


# -- an image the session admits, through the HTTP front ----------------------------------------


def png_of(size: int) -> str:
    """Base64 of ``size`` bytes that start as a PNG."""
    return base64.b64encode(PNG + b"\0" * (size - len(PNG))).decode()


@asynccontextmanager
async def serving_images(tmp_path: Path, max_image_bytes: int) -> AsyncIterator[Any]:
    """A gateway serving AG-UI whose sessions take images of at most ``max_image_bytes``
    (``serve --max-image-bytes``); the frame cap is the default 1 MiB. Yields the gateway
    and the scripted providers of the sessions made."""
    made: list[ScriptedProvider] = []

    def factory() -> ScriptedProvider:
        made.append(ScriptedProvider([Reply(blocks=(text("A picture."),))]))
        return made[-1]

    (tmp_path / "ws").mkdir()
    defaults = SessionDefaults(
        provider_factory=factory,
        workspace_dir=tmp_path / "ws",
        settings={"max_image_bytes": max_image_bytes},
    )
    async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
        gateway = Gateway(host, token=TOKEN, port=0, defaults=defaults, ag_ui=True)
        await nursery.start(gateway.run)
        yield gateway, made
        nursery.cancel_scope.cancel()


async def test_an_image_max_image_bytes_admits_is_not_refused_by_the_frame_cap(
    tmp_path: Path,
) -> None:
    """R-PROTO-2, R-SEC-1: the HTTP front refused every body over the gateway's 1 MiB
    frame cap before the image rule applied: an image of 900 KB, under ``max_image_bytes``,
    was a 413 ``request body larger than 1048576 bytes``. A run's body may now be the frame
    cap plus the base64 of an image at ``max_image_bytes``: the 900 KB image, and one of
    exactly ``max_image_bytes``, reach the model; one byte more is the image rule's 400
    naming the part and ``max_image_bytes``; a body past the larger cap is 413 naming the
    image limit."""
    limit = 2 << 20
    text_part = {"type": "text", "text": "what is this?"}

    def run_with(thread: str, size: int) -> dict[str, Any]:
        source = {"type": "data", "value": png_of(size), "mimeType": "image/png"}
        return with_parts(thread, "r", text_part, image(source))

    with trio.fail_after(BOUND_S * 2):
        async with serving_images(tmp_path, limit) as (gateway, made):
            url = f"http://127.0.0.1:{gateway.port}/ag-ui"
            admitted = [await posted(url, run_with(f"t-{size}", size)) for size in (900_000, limit)]
            refused = await posted(url, run_with("t-over", limit + 1))
            too_large = await posted(url, run_with("t-huge", limit + (1 << 20)))
    for done in admitted:
        assert done.status == 200, done.body
        assert done.types[-1] == "RUN_FINISHED"
    ran = [p.requests for p in made if p.requests]  # a refused run's session never asks
    assert [type(b).__name__ for r in ran for b in r[0].messages[-1].content] == [
        "TextBlock", "ImageBlock"
    ] * 2  # fmt: skip
    assert refused.status == 400, refused.body
    message = refused.body["error"]["message"]
    assert message.startswith("$.messages[0].content[1]") and "max_image_bytes" in message
    assert too_large.status == 413, too_large.body
    assert f"max_image_bytes ({limit} bytes)" in too_large.body["error"]["message"]
