"""The console's list of requests waiting for the person (R-HITL-2, R-HITL-5): every
pending approval and question of the principal's sessions, from ``approvals.list``, with
the call's arguments readable and Allow / Deny / Always; a question shows its text, its
choices and a text form that calls ``answer``, in the list and in the conversation.

Driven in headless Chromium like ``tests/test_console.py`` (whose helpers this reuses);
the sessions are started by a second client over a real websocket, so the requests are
there before the page asks for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from conftest import Lookup
from test_console import (
    BROWSER_BOUND_S,
    SUBSCRIBED,
    TOKEN,
    chromium,
    needs_chromium,
    open_console,
    stack,
)
from test_gateway import Client
from trio_websocket import open_websocket_url

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage

PENDING = "#pending li"
QUESTION = f"{PENDING}[data-kind=question]"
APPROVAL = f"{PENDING}[data-kind=approval]"


def brain(request: ModelRequest) -> Reply:
    """Asks to look a key up for a prompt that says "look", a question otherwise; after
    the call's result, says what it got."""
    last = request.messages[-1]
    results = [p for p in last.content if isinstance(p, ToolResult)]
    if results:
        got = "".join(b.text for b in results[-1].content if isinstance(b, TextBlock))
        return Reply(blocks=(text(f"Got {got}."),))
    first = request.messages[0]
    assert isinstance(first, UserMessage)
    prompt = "".join(b.text for b in first.content if isinstance(b, TextBlock))
    if "look" in prompt:
        return Reply(blocks=(tool_call("c1", "lookup", key="a"),))
    return Reply(
        blocks=(tool_call("q1", "ask_user", question="Which color?", choices=["red", "blue"]),)
    )


async def js_str(page: Any, expression: str) -> str:
    return str(await page.js(expression))


@needs_chromium
async def test_browser_lists_pending_requests_and_answers_a_question(
    tmp_path: Path, lookup: Lookup
) -> None:
    with trio.fail_after(BROWSER_BOUND_S):
        async with (
            stack(tmp_path, lambda: brain, tools=[lookup.tool, ask_user]) as server,
            open_websocket_url(
                server.gateway.url, extra_headers=[(b"Authorization", f"Bearer {TOKEN}".encode())]
            ) as ws,
            chromium(tmp_path) as page,
        ):
            other = Client(ws)  # the same principal, from another client
            looking = (await other.result("session.create"))["session_id"]
            asking = (await other.result("session.create"))["session_id"]
            await other.result("run", {"session_id": looking, "input": "look up a"})
            await other.result("run", {"session_id": asking, "input": "paint the fence"})
            for sid in (looking, asking):
                await server.host.get_session(sid).wait_idle()  # parked on its request
            await other.result("session.subscribe", {"session_id": asking})

            await open_console(page, server)
            await page.wait_for(f"document.querySelectorAll('{PENDING}').length === 2")
            assert await page.js("document.querySelector('#pending-empty').hidden") is True

            # The approval: the tool, its arguments as readable JSON, three answers.
            approval = f"{APPROVAL}[data-session-id='{looking}']"
            assert await page.texts(f"{approval} .what") == ["Approve lookup?"]
            args = await js_str(page, f"document.querySelector(`{approval} pre`).textContent")
            assert json.loads(args) == {"key": "a"} and "\n" in args
            assert await page.texts(f"{approval} button[data-testid^=pending-]") == [
                "Allow",
                "Deny",
                "Always",
            ]

            # The question: its text, its choices and a text form.
            question = f"{QUESTION}[data-session-id='{asking}']"
            assert await page.texts(f"{question} .question-text") == ["Which color?"]
            assert await page.texts(f"{question} [data-testid=pending-choice]") == [
                "red",
                "blue",
            ]
            answer_text = f"{question} [data-testid=pending-answer-text]"
            await page.js(
                f"(i => {{ i.value = 'green'; i.form.requestSubmit(); }})"
                f"(document.querySelector(`{answer_text}`))"
            )
            # Outside the choices: refused with the reason; the form stays usable.
            await page.wait_for("document.querySelector('#error').textContent.includes('choose')")
            await page.wait_for(f"!document.querySelector(`{answer_text}`).disabled")
            assert await page.count(question) == 1

            # The conversation shows the same question with its own form; answer there.
            await page.js(f"document.querySelector(`{question} .open-session`).click()")
            await page.wait_for(f"{SUBSCRIBED} === '{asking}'")
            in_log = "[data-type=approval_request][data-kind=question]"
            await page.wait_for(f"!!document.querySelector('{in_log} .answer-form')")
            assert await page.texts(f"{in_log} .question-text") == ["Which color?"]
            await page.js(
                f"(i => {{ i.value = 'blue'; i.form.requestSubmit(); }})"
                f"(document.querySelector('{in_log} [data-testid=log-answer-text]'))"
            )
            outputs = await other.outputs_until("task_end")
            (result,) = [o for o in outputs if o["type"] == "tool_call_output"]
            assert result["content"] == [{"type": "text", "text": "blue"}]
            assert outputs[-1]["status"] == "completed"
            await page.wait_for(f"document.querySelectorAll('{PENDING}').length === 1")
            await page.wait_for(f"!!document.querySelector('{in_log} .approval-answer')")
            assert await page.texts(f"{in_log} .approval-answer") == ["— answered by you"]

            # The approval of the other session, from the list: it runs, the list empties.
            await page.click(f"{approval} [data-testid=pending-allow]")
            await page.wait_for(f"document.querySelectorAll('{PENDING}').length === 0")
            assert await page.js("document.querySelector('#pending-empty').hidden") is False
            await server.host.get_session(looking).wait_idle()
            assert lookup.calls == ["a"]
            assert await other.result("approvals.list") == {"approvals": []}
