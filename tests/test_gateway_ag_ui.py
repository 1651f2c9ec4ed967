"""The AG-UI endpoint of ``serve --ag-ui`` (R-PROTO-2): a front end's ``POST /ag-ui``
against a real gateway on port 0 with scripted models, every event validated with the
``ag-ui-protocol`` package's types: a run with a tool call that waits for an approval
(an interrupt), the run that resumes it, a reconnect from a last event id (the trace's
seq replay), the gateway's tokens and principals (R-SEC-4), bad input. The client is
httpx in a worker thread."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import pydantic
import pytest
import trio
import trio.testing
from ag_ui.core import Event, RunAgentInput
from conftest import Lookup, answer_meeting_a_close, hold_after_first
from test_gateway import TOKEN, connect, lookup_brain, lookup_script, serving
from test_mcp import stdio

from greenroom.actors.gateway import ag_ui as ag_ui_front
from greenroom.actors.gateway import feeds
from greenroom.actors.gateway.ag_ui import FRONT_END_TOOLS_FILE
from greenroom.actors.providers.scripted import ScriptedStream, ScriptStep
from greenroom.actors.runtime import client_tools_file
from greenroom.actors.tools.builtin import read_file
from greenroom.protocols import ag_ui, jsonrpc
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.outputs import (
    ApprovalRequest,
    ModelMsg,
    PartialText,
    RequestBegin,
    TaskEnd,
    ToolCallOutput,
)
from greenroom.protocols.stream import (
    BlockCompleted,
    BlockStarted,
    TextDelta,
    TokenUsage,
    ToolArgumentsDelta,
)

BOUND_S = 20.0
MCP_BOUND_S = 60.0  # a session with an MCP server starts its process: slow on a busy machine
EVENTS = pydantic.TypeAdapter(Event)


def run_input(thread: str, run: str, text: str | None = None, **extra: Any) -> dict[str, Any]:
    messages = [] if text is None else [{"id": f"u-{run}", "role": "user", "content": text}]
    body = {
        "threadId": thread,
        "runId": run,
        "messages": messages,
        "tools": [],
        "context": [],
        "state": {},
        "forwardedProps": {},
        **extra,
    }
    RunAgentInput.model_validate(body)  # what a front end sends
    return body


class Stream:
    """One answer of the endpoint: its status and, for an event stream, its events
    (``(id, event)``), each validated as an AG-UI event."""

    def __init__(self, status: int, events: list[tuple[str | None, dict[str, Any]]], body: Any):
        self.status = status
        self.events = events
        self.body = body

    @property
    def types(self) -> list[str]:
        return [event["type"] for _, event in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for _, event in self.events if event["type"] == kind]


def post(
    url: str,
    body: Any,
    *,
    token: str | None = TOKEN,
    headers: dict[str, str] | None = None,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> Stream:
    """POST ``body`` and read the whole answer (blocking: run in a worker thread); with
    ``until``, only up to the first event it holds true of, then close the connection (a
    front end that loses the stream there)."""
    sent = {"Accept": "text/event-stream", **(headers or {})}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with (
        httpx.Client(timeout=BOUND_S) as client,
        client.stream("POST", url, content=content, headers=sent) as response,
    ):
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.read()
            return Stream(response.status_code, [], response.json())
        events: list[tuple[str | None, dict[str, Any]]] = []
        event_id: str | None = None
        for line in response.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                EVENTS.validate_python(event)  # every event is an AG-UI event
                events.append((event_id, event))
                if until is not None and until(event):
                    break
        return Stream(response.status_code, events, None)


async def posted(url: str, body: Any, **options: Any) -> Stream:
    return await trio.to_thread.run_sync(lambda: post(url, body, **options))


async def waiting_on_pick_color(server: Any) -> tuple[str, Stream]:
    """Run thread-f on ``server``'s AG-UI endpoint with the front-end tool ``pick_color``,
    which the model calls (f1): the run ends with that call waiting for its result. The
    endpoint's URL, and the run's stream."""
    url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
    first = await posted(url, run_input("thread-f", "run-1", "pick one", tools=[COLOR_TOOL]))
    assert first.of("STATE_SNAPSHOT")[-1]["snapshot"]["pendingToolCalls"] == ["f1"]
    return url, first


async def test_ag_ui_client_drives_a_run_with_a_tool_call_an_interrupt_and_a_resume(
    tmp_path: Path, lookup: Lookup
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_script, tools=[lookup.tool], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("thread-1", "run-1", "go"))
            assert first.status == 200
            assert first.types[:2] == ["RUN_STARTED", "STATE_SNAPSHOT"]
            assert first.of("RUN_STARTED")[0]["threadId"] == "thread-1"
            texts = [e["delta"] for e in first.of("TEXT_MESSAGE_CONTENT")]
            assert "".join(texts) == "Checking."
            (start,) = first.of("TOOL_CALL_START")
            assert (start["toolCallId"], start["toolCallName"]) == ("c1", "lookup")
            # Under the words that led to it.
            assert start["parentMessageId"] == first.of("TEXT_MESSAGE_START")[0]["messageId"]
            args = "".join(e["delta"] for e in first.of("TOOL_CALL_ARGS"))
            assert json.loads(args) == {"key": "a"}
            assert first.of("TOOL_CALL_END")
            finished = first.events[-1][1]
            assert finished["type"] == "RUN_FINISHED"
            (interrupt,) = finished["outcome"]["interrupts"]
            assert (interrupt["id"], interrupt["toolCallId"]) == ("c1", "c1")
            assert interrupt["reason"] == "tool_approval"
            assert lookup.calls == []
            # Answering nothing is refused while the thread waits.
            busy = await posted(url, run_input("thread-1", "run-x", "hello?"))
            assert busy.status == 409

            resume = [{"interruptId": "c1", "status": "resolved", "payload": {"decision": "allow"}}]
            second = await posted(url, run_input("thread-1", "run-2", resume=resume))
            assert second.types[0] == "RUN_STARTED"
            (result,) = second.of("TOOL_CALL_RESULT")
            assert (result["toolCallId"], result["content"]) == ("c1", "value-a")
            assert "".join(e["delta"] for e in second.of("TEXT_MESSAGE_CONTENT")) == "Done."
            done = second.events[-1][1]
            assert done["type"] == "RUN_FINISHED" and done["outcome"] == {"type": "success"}
            assert done["usage"][0]["outputTokens"] >= 0
            assert lookup.calls == ["a"]

            # A front end that lost the first stream after the tool call reconnects from
            # that event's id: the rest comes from the trace, up to the task's end.
            end_id = next(i for i, e in first.events if e["type"] == "TOOL_CALL_END")
            assert end_id is not None
            again = await posted(
                url, run_input("thread-1", "run-1"), headers={"Last-Event-ID": end_id}
            )
            assert again.types[0] == "RUN_STARTED"
            assert not again.of("TOOL_CALL_START")  # seen before the id: not again
            assert [e["toolCallId"] for e in again.of("TOOL_CALL_RESULT")] == ["c1"]
            assert again.events[-1][1]["type"] == "RUN_FINISHED"
            # From the last id there is nothing more: the thread is idle.
            last_id = second.events[-1][0]
            idle = await posted(
                url, run_input("thread-1", "run-2"), headers={"Last-Event-ID": str(last_id)}
            )
            assert idle.types == ["RUN_STARTED", "STATE_SNAPSHOT", "STATE_SNAPSHOT", "RUN_FINISHED"]
            # The thread is the session: the websocket gateway shows the same task.
            async with connect(server) as client:
                listed = (await client.result("session.list"))["sessions"]
                assert [s["session_id"] for s in listed] == ["thread-1"]


async def test_a_resume_answering_one_interrupt_twice_is_refused_and_decides_nothing(
    tmp_path: Path, lookup: Lookup
) -> None:
    """A deny then an allow for the same interrupt: refused whole, before either is given,
    so the front end's 400 is true (the call still waits) rather than a 409 after a deny
    it was never told of."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_script, tools=[lookup.tool], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("thread-1", "run-1", "go"))
            (interrupt,) = first.events[-1][1]["outcome"]["interrupts"]
            assert interrupt["id"] == "c1"
            twice = [
                {"interruptId": "c1", "status": "resolved", "payload": {"decision": decision}}
                for decision in ("deny", "allow")
            ]
            refused = await posted(url, run_input("thread-1", "run-2", resume=twice))
            assert refused.status == 400
            assert refused.body["error"]["message"] == "$.resume: interrupt 'c1' answered twice"
            async with connect(server) as client:
                waiting = (await client.result("approvals.list"))["approvals"]
                assert [a["call_id"] for a in waiting] == ["c1"]
            allowed = await posted(url, run_input("thread-1", "run-3", resume=twice[1:]))
            assert [e["content"] for e in allowed.of("TOOL_CALL_RESULT")] == ["value-a"]
            assert lookup.calls == ["a"]


@pytest.mark.parametrize("stage", ["closing", "closed"])
async def test_a_resume_whose_thread_began_to_close_once_it_was_found_is_taken_there_again(
    tmp_path: Path, lookup: Lookup, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """R-HITL-1, R-HITL-2, R-HOST-3: a resume that found its interrupt pending, and came to
    the host once the host had begun to close the thread's session (or had closed it), had
    the host load the session with the host's own tools and model: the approved call
    failed as an unknown tool. The session is loaded as any call on a closed session loads
    it (the server's tools and model), and the run streams from it: the tool runs once and
    the run finishes."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_brain, tools=[lookup.tool], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("thread-1", "run-1", "go"))
            assert first.events[-1][1]["outcome"]["interrupts"][0]["id"] == "c1"
            # The last look before the answers: the interrupt was found pending.
            found, let_answer = hold_after_first(monkeypatch, ag_ui_front, "replay_records")
            resumed: list[Stream] = []

            async def resume() -> None:
                allow = {"decision": "allow"}
                entry = {"interruptId": "c1", "status": "resolved", "payload": allow}
                resumed.append(await posted(url, run_input("thread-1", "run-2", resume=[entry])))

            await answer_meeting_a_close(
                monkeypatch, server.host, "thread-1", resume, found, let_answer, stage=stage
            )
            (second,) = resumed
            (result,) = second.of("TOOL_CALL_RESULT")
            assert (result["toolCallId"], result["content"]) == ("c1", "value-a")
            done = second.events[-1][1]
            assert done["type"] == "RUN_FINISHED" and done["outcome"] == {"type": "success"}, done
            assert lookup.calls == ["a"]


async def test_tokens_and_principals_are_the_gateway_s(tmp_path: Path, lookup: Lookup) -> None:
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path, lookup_script, tools=[lookup.tool], ag_ui=True, tokens=tokens
        ) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            body = run_input("alices", "r1", "go")
            assert (await posted(url, body, token=None)).status == 401
            assert (await posted(url, body, token="wrong-token-0123456789")).status == 401
            mine = await posted(url, body, token=tokens["alice"])
            assert mine.events[-1][1]["outcome"]["type"] == "interrupt"
            other = await posted(url, run_input("alices", "r2", "hi"), token=tokens["bob"])
            assert other.status == 403
            peek = await posted(
                url, run_input("alices", "r3"), token=tokens["bob"], headers={"Last-Event-ID": "0"}
            )
            assert peek.status == 403
            resume = [{"interruptId": "c1", "status": "resolved", "payload": {"decision": "allow"}}]
            steal = await posted(url, run_input("alices", "r4", resume=resume), token=tokens["bob"])
            assert steal.status == 403
            assert lookup.calls == []


async def test_bad_input_is_refused_with_a_reason(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            for body, words in (
                (b"{nope", "not JSON"),
                (b"[" * 5000 + b"]" * 5000, "not JSON"),
                (b"[" * 100 + b"]" * 100, "nested deeper than 64"),
                ({"threadId": "t"}, "$.runId"),
                (run_input("bad/thread", "r", "hi"), "$.threadId"),
                (run_input("t", "r"), "no user message"),
            ):
                refused = await posted(url, body)
                assert refused.status == 400, body
                assert words in refused.body["error"]["message"]
            for last_event in (b"\xb2", b"-1", b"1" * 19):  # "²" (latin-1): its isdigit() is true
                refused = await posted(
                    url, run_input("t", "r", "hi"), headers={"Last-Event-ID": last_event}
                )
                assert refused.status == 400, last_event
                assert "Last-Event-ID" in refused.body["error"]["message"]
            answer = await trio.to_thread.run_sync(
                lambda: httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
            )
            assert answer.status_code == 405
            ok = await posted(url, run_input("t", "r", "hello"))
            assert ok.events[-1][1]["type"] == "RUN_FINISHED"


async def test_a_refused_run_on_an_unknown_thread_makes_no_session(tmp_path: Path) -> None:
    """R-SEC-9: a run refused for its input made its unknown thread's session first — one
    more of the principal's sessions, on disk and against its cap, for each thread id sent
    with a bad body, behind a 400. Refused, it now makes none."""
    resume = [{"interruptId": "c1", "status": "resolved", "payload": {"decision": "allow"}}]
    bad_tool = {"name": "bad tool", "description": "", "parameters": {"type": "object"}}
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            for thread, body, headers, status in (
                ("t-empty", run_input("t-empty", "r"), {}, 400),
                ("t-last", run_input("t-last", "r"), {"Last-Event-ID": "5"}, 404),
                ("t-resume", run_input("t-resume", "r", resume=resume), {}, 409),
                ("t-tools", run_input("t-tools", "r", "hi", tools=[bad_tool]), {}, 400),
                ("t-long", run_input("t-long", "r", "x" * 100_001), {}, 400),
            ):
                refused = await posted(url, body, headers=headers)
                assert not (server.host.data_dir / "sessions" / thread).exists(), thread
                assert refused.status == status, (thread, refused.body)
            async with connect(server) as client:
                assert (await client.result("session.list"))["sessions"] == []
            ok = await posted(url, run_input("t-empty", "r", "hello"))
            assert ok.events[-1][1]["type"] == "RUN_FINISHED"


async def _no_session_until_a_good_run(server: Any, url: str, thread: str) -> None:
    """After a refused run on ``thread``: no session of it on disk, open or listed; the
    thread's next good run makes it and finishes."""
    assert not (server.host.data_dir / "sessions" / thread).exists()
    assert [s.id for s in server.host.sessions] == []
    async with connect(server) as client:
        assert await client.result("session.list") == {"sessions": []}
    ok = await posted(url, run_input(thread, "r2", "hello"))
    assert ok.status == 200, ok.body
    assert ok.events[-1][1]["type"] == "RUN_FINISHED"


async def _a_taken_name_leaves_no_session(
    server: Any, thread: str, taken: dict[str, Any]
) -> None:
    """A new thread's run whose front-end tool ``taken`` has a name the session's tools
    have is refused (400, naming it), and the thread has no session until a good run."""
    url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
    refused = await posted(url, run_input(thread, "r1", "hi", tools=[taken]))
    assert refused.status == 400
    assert refused.body["error"]["message"] == (
        f"$.tools: a client tool may not be named '{taken['name']}': the session has one"
    )
    await _no_session_until_a_good_run(server, url, thread)


async def test_a_front_end_tool_named_like_a_server_tool_makes_no_session(
    tmp_path: Path,
) -> None:
    """R-SEC-9, R-PROTO-2: a run on an unknown thread whose front-end tool took the name of
    one of the server's tools made the thread's session, then was refused — a session on
    disk and against the caller's cap behind the 400. It is refused before any is made;
    the thread's first good run makes it."""
    taken = {"name": "read_file", "description": "", "parameters": {"type": "object"}}
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, tools=[read_file], ag_ui=True) as server:
            await _a_taken_name_leaves_no_session(server, "tX", taken)


async def test_a_front_end_tool_named_like_an_mcp_tool_leaves_no_session(
    tmp_path: Path,
) -> None:
    """R-SEC-9, R-PROTO-2: the tools of the server's MCP servers are known once a session
    is made; a new thread's front-end tool named like one of them left that session — on
    disk, listed, held by the caller — behind the 400. The session is deleted again with
    the caller's hold of it; the thread's next good run makes it anew."""
    taken = {"name": "mcp__t__echo", "description": "", "parameters": {"type": "object"}}
    with trio.fail_after(MCP_BOUND_S):
        async with serving(tmp_path, ag_ui=True, mcp_servers={"t": stdio()}) as server:
            await _a_taken_name_leaves_no_session(server, "tM", taken)


async def test_a_last_event_id_past_the_threads_last_event_is_refused(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("t", "r1", "hello"))
            assert first.events[-1][1]["type"] == "RUN_FINISHED"
            last_id = int(first.events[-1][0])
            refused = await posted(
                url, run_input("t", "r2"), headers={"Last-Event-ID": str(last_id + 1)}
            )
            assert refused.status == 400
            assert refused.body["error"]["message"] == (
                f"Last-Event-ID: {last_id + 1} is past the thread's last event id ({last_id})"
            )
            idle = await posted(
                url, run_input("t", "r2"), headers={"Last-Event-ID": str(last_id)}
            )
            assert idle.types[-1] == "RUN_FINISHED"


async def test_a_refusal_quotes_a_bounded_part_of_the_input(tmp_path: Path) -> None:
    """R-SEC-9: echoed values are truncated. A message role of 0.5 MB is named by the
    input model's error (its union's tag): the 400 answer is cut to ``MAX_ERROR_CHARS``."""
    role = "x" * 500_000
    body = {**run_input("t", "r"), "messages": [{"id": "m1", "role": role, "content": "hi"}]}
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            refused = await posted(url, body)
            assert refused.status == 400
            message = refused.body["error"]["message"]
            assert message.startswith("not a RunAgentInput: $.messages.0")
            assert len(message) < jsonrpc.MAX_ERROR_CHARS + 40, len(message)


# -- protocols/ag_ui.py (pure) ------------------------------------------------------------------


def test_partial_and_complete_blocks_give_one_message_each() -> None:
    common = {"session_id": "s1", "run_id": "run_1"}
    mapper = ag_ui.RunMapper(thread_id="s1", run_id="front")
    events = mapper.started()
    for output in (
        RequestBegin(seq=1, turn=1, attempt=1, **common),
        PartialText(index=0, text="Hel", **common),
        PartialText(index=0, text="lo", **common),
        ModelMsg(seq=2, turn=1, block=TextBlock(text="Hello"), **common),
        ModelMsg(seq=3, turn=1, block=ToolCallBlock(id="c9", name="t", arguments={}), **common),
        ApprovalRequest(seq=4, call_id="c9", tool="t", arguments={}, **common),
    ):
        events += mapper.map(output)
    assert mapper.interrupts
    events += mapper.interrupted()
    for event in events:
        EVENTS.validate_python(event)
    starts = [e for e in events if e["type"] == "TEXT_MESSAGE_START"]
    assert len(starts) == 1 and starts[0]["messageId"] == "run_1-1-0"
    assert events[-1]["outcome"]["interrupts"][0]["id"] == "c9"


def test_a_failed_task_is_run_error_and_an_aborted_one_cancelled() -> None:
    common = {"session_id": "s1", "run_id": "run_1"}
    for status, kind in (("failed", "RUN_ERROR"), ("aborted", "RUN_FINISHED")):
        mapper = ag_ui.RunMapper(thread_id="s1", run_id="front")
        events = mapper.map(
            TaskEnd(seq=1, status=status, turns=1, usage=TokenUsage(), wall_ms=1, **common)  # type: ignore[arg-type]
        )
        for event in events:
            EVENTS.validate_python(event)
        assert events[-1]["type"] == kind
    assert events[-1]["outcome"] == {"type": "cancelled"}
    result = ag_ui.RunMapper(thread_id="s1", run_id="f").map(
        ToolCallOutput(call_id="c", tool="t", status="denied", is_error=True, content=(), **common)
    )
    assert result[0]["content"] == "[denied]"


def test_resume_entries_and_new_input() -> None:
    resolved = {"status": "resolved"}
    deny = ag_ui.parse_resume({**resolved, "payload": {"decision": "deny"}}, "approval")
    assert deny == ("deny", None)
    assert ag_ui.parse_resume({**resolved, "payload": True}, "approval") == ("allow", None)
    assert ag_ui.parse_resume({"status": "cancelled"}, "approval") == ("deny", None)
    assert ag_ui.parse_resume({**resolved, "payload": "blue"}, "question") == (None, "blue")
    try:
        ag_ui.parse_resume({"status": "resolved", "payload": 3}, "approval")
    except ag_ui.ResumeError as exc:
        assert "decision" in str(exc)
    else:
        raise AssertionError("a payload that decides nothing is refused")
    said = [
        {"role": "user", "content": "old"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "new"}]},
        {"role": "user", "content": "more"},
    ]
    assert ag_ui.new_input(said) == "new\n\nmore"


# -- front-end tools, context and state ---------------------------------------------------------

COLOR_TOOL = {
    "name": "pick_color",
    "description": "Ask the user to pick a color in the page.",
    "parameters": {"type": "object", "properties": {"hint": {"type": "string"}},
                   "required": ["hint"]},
}


def front_end_script() -> list[Any]:
    from greenroom.actors.providers.scripted import Reply, text, tool_call

    return [
        Reply(blocks=(text("Let me ask."), tool_call("f1", "pick_color", hint="warm"))),
        Reply(blocks=(text("You picked it."),)),
    ]


async def test_a_front_end_tool_waits_for_its_result_from_the_next_run(tmp_path: Path) -> None:
    """R-PROTO-2: the run's tools are offered to the model; a call of one is shown as a
    call and the run ends (success) with the thread waiting for its result — under
    --approve all too, since the front end runs it; the next run's tool message is its
    result (the history's earlier tool messages are not), and the task goes on."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, front_end_script, approve="all", ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("thread-f", "run-1", "pick one",
                                                tools=[COLOR_TOOL]))
            assert first.status == 200
            (start,) = first.of("TOOL_CALL_START")
            assert (start["toolCallId"], start["toolCallName"]) == ("f1", "pick_color")
            finished = first.events[-1][1]
            assert finished["type"] == "RUN_FINISHED" and finished["outcome"] == {"type": "success"}
            assert first.of("STATE_SNAPSHOT")[-1]["snapshot"]["pendingToolCalls"] == ["f1"]
            (request,) = server.providers[0].requests
            assert [t.name for t in request.tools][-1] == "pick_color"

            history = [
                {"id": "u-run-1", "role": "user", "content": "pick one"},
                {"id": "old", "role": "tool", "toolCallId": "zz", "content": "stale"},
                {"id": "a1", "role": "assistant", "toolCalls": [{"id": "f1", "type": "function",
                 "function": {"name": "pick_color", "arguments": '{"hint": "warm"}'}}]},
                {"id": "t1", "role": "tool", "toolCallId": "f1", "content": "orange"},
            ]
            second = await posted(url, run_input("thread-f", "run-2", messages=history,
                                                 tools=[COLOR_TOOL]))
            assert second.status == 200, second.body
            (result,) = second.of("TOOL_CALL_RESULT")
            assert (result["toolCallId"], result["content"]) == ("f1", "orange")
            assert "".join(e["delta"] for e in second.of("TEXT_MESSAGE_CONTENT")) == (
                "You picked it."
            )
            assert second.events[-1][1]["outcome"] == {"type": "success"}
    follow = server.providers[0].requests[-1]
    assert "orange" in repr(follow.messages[-1])


def color_brain() -> Any:
    """``front_end_script`` as a model that reads the conversation, so a session loaded
    again (given a new one) goes on where it was; a new input ``again`` is answered
    ``Again.``."""
    from greenroom.actors.providers.scripted import Reply, text, tool_call
    from greenroom.protocols.context import ModelRequest, ToolResult

    def brain(request: ModelRequest) -> Reply:
        last = request.messages[-1].content
        if any(isinstance(p, ToolResult) for p in last):
            return Reply(blocks=(text("You picked it."),))
        if any(isinstance(p, TextBlock) and p.text == "again" for p in last):
            return Reply(blocks=(text("Again."),))
        return Reply(blocks=(text("Let me ask."), tool_call("f1", "pick_color", hint="warm")))

    return brain


COLOR_RESULT = [
    {"id": "u-run-1", "role": "user", "content": "pick one"},
    {"id": "a1", "role": "assistant", "toolCalls": [{"id": "f1", "type": "function",
     "function": {"name": "pick_color", "arguments": '{"hint": "warm"}'}}]},
    {"id": "t1", "role": "tool", "toolCallId": "f1", "content": "orange"},
]
"""A front end's history once it ran ``pick_color`` (call ``f1``): its result last."""


def offered(server: Any) -> list[str]:
    """The tools the model was offered in its last request (of the newest provider)."""
    return [t.name for t in server.providers[-1].requests[-1].tools]


@pytest.mark.parametrize("approve", ["ask", "all"])
@pytest.mark.parametrize("again", ["closed", "restarted"])
async def test_a_threads_front_end_tools_reach_its_session_loaded_again(
    tmp_path: Path, again: str, approve: str
) -> None:
    """R-PROTO-2, R-HITL-1, R-HITL-3, R-HOST-3: a thread's session loaded again (after its
    close, or a restart) had none of the front-end tools its last run gave: the next run's
    result of the waiting front-end call (a run that gives no ``tools`` keeps the last
    run's) was refused as no new input (400), and a new input was not offered them. The
    session loaded again has them: the result answers the call, and the next run offers
    them. The wait is durable whatever ``--approve`` says: under ``--approve all`` closing
    the thread's session (or the host) aborted its task and denied the call (``by:
    default``), and the front end's result found nothing pending."""
    with trio.fail_after(BOUND_S * 2):
        async with serving(tmp_path, color_brain, approve=approve, ag_ui=True) as server:
            url, first = await waiting_on_pick_color(server)
            assert first.events[-1][1]["outcome"] == {"type": "success"}
            # Kept private, as the session's other files are (R-SEC-8).
            session_dir = server.host.get_session("thread-f").trace_path.parent
            assert (session_dir / FRONT_END_TOOLS_FILE).stat().st_mode & 0o777 == 0o600
            if again == "closed":
                await server.host.close_session("thread-f")
                await resume_and_run_again(server, url)
        if again == "restarted":
            async with serving(tmp_path, color_brain, approve=approve, ag_ui=True) as server:
                url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
                await resume_and_run_again(server, url)


async def test_a_kept_tools_file_that_names_a_tool_twice_offers_it_once(
    tmp_path: Path,
) -> None:
    """R-PROTO-2, R-SEC-9: the thread's kept front-end tools, edited by hand to name a tool
    twice, were given to its session loaded again as they were: every request offered the
    model two tools of one name, which a provider refuses. The first of each name is
    kept, with a warning."""
    with trio.fail_after(BOUND_S * 2):
        async with serving(tmp_path, color_brain, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("thread-f", "run-1", "pick one",
                                                tools=[COLOR_TOOL]))  # fmt: skip
            assert first.events[-1][1]["outcome"] == {"type": "success"}
            session_dir = server.host.get_session("thread-f").trace_path.parent
            await server.host.close_session("thread-f")
            (session_dir / FRONT_END_TOOLS_FILE).write_text(json.dumps([COLOR_TOOL] * 2))
            await resume_and_run_again(server, url)
            assert offered(server).count("pick_color") == 1


@pytest.mark.parametrize("later_cancelled", [False, True])
async def test_two_runs_giving_a_thread_tools_at_once_keep_the_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, later_cancelled: bool
) -> None:
    """R-PROTO-2, R-HOST-3: two runs of a thread that give it tools at once wrote the kept
    file each in its own thread: the earlier one's write, finishing last, left the tools
    the session no longer had, and a session loaded again got those. One write at a
    time now, and only while its tools are the session's; the later run's write is
    made even when its run is cancelled (its client left) while it waits its turn."""
    entered, let_go = threading.Event(), threading.Event()
    replace_file = client_tools_file.replace_private_file

    def held_once(path: Path, text: str) -> None:
        if not entered.is_set():
            entered.set()
            let_go.wait(BOUND_S)
        replace_file(path, text)

    with trio.fail_after(BOUND_S * 2):
        async with serving(tmp_path, color_brain, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            await posted(url, run_input("thread-f", "run-1", "pick one"))
            session = server.host.get_session("thread-f")
            monkeypatch.setattr(client_tools_file, "replace_private_file", held_once)
            endpoint = ag_ui_front.AgUiEndpoint(cast(Any, None))
            later = {**COLOR_TOOL, "name": "pick_shade"}
            async with trio.open_nursery() as nursery:
                for tool in (COLOR_TOOL, later):
                    run = RunAgentInput.model_validate(run_input("thread-f", "r", tools=[tool]))
                    nursery.start_soon(endpoint._client_tools, session, run)
                    await trio.to_thread.run_sync(entered.wait, BOUND_S)
                    await trio.testing.wait_all_tasks_blocked()
                if later_cancelled:
                    nursery.cancel_scope.cancel()
                let_go.set()
            kept = json.loads((session.trace_path.parent / FRONT_END_TOOLS_FILE).read_text())
    assert [tool["name"] for tool in kept] == ["pick_shade"]


def test_a_kept_tools_file_that_cannot_be_written_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-9, R-TRACE-2: a write of the kept tools that failed (a full disk) left its
    temporary file in the session's directory, one more each run; the file is fsynced
    before it replaces the last, so a power cut leaves the one or the other whole."""
    kept = tmp_path / FRONT_END_TOOLS_FILE
    client_tools_file.replace_private_file(kept, "[1]")
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    client_tools_file.replace_private_file(kept, "[2]")
    assert len(synced) == 1 and kept.read_text() == "[2]"

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        client_tools_file.replace_private_file(kept, "[3]")
    assert [p.name for p in tmp_path.iterdir()] == [FRONT_END_TOOLS_FILE]
    assert kept.read_text() == "[2]"


async def resume_and_run_again(server: Any, url: str) -> None:
    """The front end's result of ``f1`` and then a new input, both runs without
    ``tools``: each offers the model ``pick_color``."""
    second = await posted(url, run_input("thread-f", "run-2", messages=COLOR_RESULT))
    assert second.status == 200, second.body
    (result,) = second.of("TOOL_CALL_RESULT")
    assert (result["toolCallId"], result["content"]) == ("f1", "orange")
    assert "".join(e["delta"] for e in second.of("TEXT_MESSAGE_CONTENT")) == "You picked it."
    assert second.events[-1][1]["outcome"] == {"type": "success"}
    assert "pick_color" in offered(server)
    third = await posted(url, run_input("thread-f", "run-3", "again"))
    assert "".join(e["delta"] for e in third.of("TEXT_MESSAGE_CONTENT")) == "Again."
    assert "pick_color" in offered(server)


def color_then_lookup_brain() -> Any:
    """A model that asks the front end for a color (``f1``), looks the color up (``l1``,
    an ordinary tool of the server's) once it has it, and ends with ``Orange it is.``."""
    from greenroom.actors.providers.scripted import Reply, text, tool_call
    from greenroom.protocols.context import ModelRequest, ToolResult

    def brain(request: ModelRequest) -> Reply:
        results = {p.call_id for p in request.messages[-1].content if isinstance(p, ToolResult)}
        if "f1" in results:
            return Reply(blocks=(tool_call("l1", "lookup", key="orange"),))
        if "l1" in results:
            return Reply(blocks=(text("Orange it is."),))
        return Reply(blocks=(text("Let me ask."), tool_call("f1", "pick_color", hint="warm")))

    return brain


@pytest.mark.parametrize("again", ["closed", "restarted"])
async def test_a_thread_loaded_again_for_a_front_end_result_runs_its_next_calls_as_approve_says(
    tmp_path: Path, lookup: Lookup, again: str
) -> None:
    """R-HITL-1, R-HITL-4, R-PROTO-2, R-HOST-3: the session the endpoint loads again for a
    front-end call's result (after its close, or a restart) takes its task up under the
    server's ``--approve``, not ``"people"``: under ``--approve all`` the model's next
    ordinary call (``lookup``) runs at once and the run ends in success (before: it waited
    for a person, the run ending with a ``tool_approval`` interrupt nobody was asked)."""
    with trio.fail_after(BOUND_S * 2):
        async with serving(tmp_path, color_then_lookup_brain, tools=[lookup.tool],
                           approve="all", ag_ui=True) as server:
            url, _ = await waiting_on_pick_color(server)
            if again == "closed":
                await server.host.close_session("thread-f")
                await result_then_lookup(url, lookup)
        if again == "restarted":
            async with serving(tmp_path, color_then_lookup_brain, tools=[lookup.tool],
                               approve="all", ag_ui=True) as server:
                url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
                await result_then_lookup(url, lookup)


async def result_then_lookup(url: str, lookup: Lookup) -> None:
    """The front end's result of ``f1``: the run streams ``lookup``'s call, run at once,
    and the task's end."""
    second = await posted(url, run_input("thread-f", "run-2", messages=COLOR_RESULT))
    assert second.status == 200, second.body
    assert second.events[-1][1]["outcome"] == {"type": "success"}, second.events[-1]
    results = {e["toolCallId"]: e["content"] for e in second.of("TOOL_CALL_RESULT")}
    assert results == {"f1": "orange", "l1": "value-orange"}
    assert lookup.calls == ["orange"]
    assert "".join(e["delta"] for e in second.of("TEXT_MESSAGE_CONTENT")) == "Orange it is."


@pytest.mark.parametrize("stage", ["closing", "closed"])
async def test_a_front_end_result_whose_thread_began_to_close_is_taken_there_with_the_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """R-PROTO-2, R-HITL-1, R-HOST-3: a front-end call's result that found the call
    pending, and came to the host once the host had begun to close the thread's session
    (or had closed it), had the host load the session without the thread's front-end
    tools: the task went on without them. The session loaded for the answer is given them
    before its task goes on: the model's next request offers them."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, color_brain, ag_ui=True) as server:
            url, _ = await waiting_on_pick_color(server)
            # The last look before the answers: the call was found pending.
            found, let_answer = hold_after_first(monkeypatch, ag_ui_front, "replay_records")
            resumed: list[Stream] = []

            async def resume() -> None:
                body = run_input("thread-f", "run-2", messages=COLOR_RESULT)
                resumed.append(await posted(url, body))

            await answer_meeting_a_close(
                monkeypatch, server.host, "thread-f", resume, found, let_answer, stage=stage
            )
            (second,) = resumed
            (result,) = second.of("TOOL_CALL_RESULT")
            assert (result["toolCallId"], result["content"]) == ("f1", "orange")
            assert second.events[-1][1]["outcome"] == {"type": "success"}, second.events[-1]
            assert len(server.providers) == 2 and "pick_color" in offered(server)


async def test_front_end_tools_reach_a_session_loaded_again_by_a_websocket_answer(
    tmp_path: Path,
) -> None:
    """R-PROTO-2, R-HITL-1: a thread's kept front-end tools reached its session loaded
    again only when the AG-UI endpoint loaded it: the websocket ``answer`` of the waiting
    front-end call, on the closed session, loaded it without them, and the task went on
    without them. Every load gives the session its kept client tools: the model's next
    request offers ``pick_color``."""
    with trio.fail_after(BOUND_S * 2):
        async with serving(tmp_path, color_brain, ag_ui=True) as server:
            await waiting_on_pick_color(server)
            await server.host.close_session("thread-f")
            async with connect(server) as client:
                answer = {"session_id": "thread-f", "call_id": "f1", "text": "orange"}
                assert await client.result("answer", answer) == {}
                await client.result("session.subscribe", {"session_id": "thread-f",
                                                          "after_seq": 0})  # fmt: skip
                after = await client.outputs_until("task_end")
            assert after[-1]["status"] == "completed", after[-1]
            assert len(server.providers) == 2 and "pick_color" in offered(server)


async def test_front_end_tools_reach_a_task_cut_mid_turn_taken_up_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-PROTO-2, R-HITL-4: the host died (its session's files copied as they were)
    while the model's request after a front-end call's result streamed; the host started
    on them takes the task up (``resume_tasks``) in a session it loads itself, which had
    none of the thread's front-end tools: the request made again did not offer them. It
    offers them now."""
    from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
    from greenroom.actors.runtime import provider_clients
    from greenroom.protocols.context import ModelRequest, ToolResult

    asked_again = trio.Event()

    def cut_after_the_result() -> Any:
        def brain(request: ModelRequest, stream: Any) -> Any:
            if any(isinstance(p, ToolResult) for p in request.messages[-1].content):
                return held()
            return Reply(blocks=(text("Let me ask."), tool_call("f1", "pick_color",
                                                                hint="warm")))  # fmt: skip

        async def held() -> None:
            asked_again.set()
            await trio.sleep_forever()  # the host stops mid-request

        return brain

    with trio.fail_after(BOUND_S * 2):
        async with serving(tmp_path, cut_after_the_result, ag_ui=True) as server:
            await waiting_on_pick_color(server)
            async with connect(server) as client:
                answer = {"session_id": "thread-f", "call_id": "f1", "text": "orange"}
                assert await client.result("answer", answer) == {}
            await asked_again.wait()
            assert "pick_color" in offered(server)
            # The process dies here: what its session's directory holds is what is left.
            session = server.host.get_session("thread-f")
            crashed = tmp_path / "crashed"
            shutil.copytree(session.directory, crashed / "data" / "sessions" / "thread-f")
        # The host taking the task up loads the session with its settings' provider.
        taken_up: list[ScriptedProvider] = []
        asked_after_the_restart = trio.Event()

        def answering(request: ModelRequest) -> Reply:
            asked_after_the_restart.set()
            return Reply(blocks=(text("You picked it."),))

        def provider(*_: Any) -> ScriptedProvider:
            taken_up.append(ScriptedProvider(answering))
            return taken_up[-1]

        monkeypatch.setattr(provider_clients, "make_provider", provider)
        async with serving(crashed, color_brain, ag_ui=True,
                           host_options={"resume_tasks": True}):  # fmt: skip
            await asked_after_the_restart.wait()
    # The request cut by the host's death, made again.
    assert "pick_color" in [t.name for t in taken_up[0].requests[0].tools]


async def test_front_end_tools_that_cannot_be_offered_are_refused(
    tmp_path: Path, lookup: Lookup
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, tools=[lookup.tool], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            bad_name = {**COLOR_TOOL, "name": "pick color"}
            refused = await posted(url, run_input("t-bad", "r1", "hi", tools=[bad_name]))
            assert refused.status == 400 and "$.tools[0].name" in json.dumps(refused.body)
            bad_schema = {**COLOR_TOOL, "parameters": {"type": "string"}}
            refused = await posted(url, run_input("t-bad", "r2", "hi", tools=[bad_schema]))
            assert refused.status == 400 and "$.tools[0].parameters" in json.dumps(refused.body)
            taken = {**COLOR_TOOL, "name": "lookup"}
            refused = await posted(url, run_input("t-bad", "r3", "hi", tools=[taken]))
            assert refused.status == 400 and "lookup" in json.dumps(refused.body)


async def test_context_and_a_changed_state_reach_the_model_with_the_input(
    tmp_path: Path,
) -> None:
    """The run's context entries come with every new input; the state only when it
    changed since the thread's last run."""
    from greenroom.actors.providers.scripted import Reply, text

    script = lambda: [Reply(blocks=(text("ok"),)), Reply(blocks=(text("ok"),)),  # noqa: E731
                      Reply(blocks=(text("ok"),))]
    context = [{"description": "page", "value": "checkout"}]
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            for run, state in (("r1", {"cart": 2}), ("r2", {"cart": 2}), ("r3", {"cart": 3})):
                done = await posted(url, run_input("t-ctx", run, f"go {run}", context=context,
                                                   state=state))
                assert done.events[-1][1]["type"] == "RUN_FINISHED"
    prompts = [
        "\n".join(b.text for b in request.messages[-1].content if isinstance(b, TextBlock))
        for request in server.providers[0].requests
    ]
    assert all("[front-end context]\n- page: checkout" in p for p in prompts)
    assert ['[front-end state]\n{"cart": 2}' in p for p in prompts] == [True, False, False]
    assert '[front-end state]\n{"cart": 3}' in prompts[2]
    assert prompts[2].endswith("go r3")


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e999"])
async def test_a_body_holding_a_number_that_is_not_finite_is_refused(
    tmp_path: Path, number: str
) -> None:
    """A front-end tool whose schema holds ``NaN``, ``Infinity`` or ``1e999`` (which reads
    as infinity) was kept with its thread, and no request to a provider can carry it: the
    body is refused (400) before any session or tools file is made."""
    tool = {**COLOR_TOOL, "parameters": {"type": "object", "properties": {
        "shade": {"type": "number", "maximum": "__N__"}}}}  # fmt: skip
    body = json.dumps(run_input("t-num", "r1", "hi", tools=[tool]))
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            refused = await posted(url, body.replace('"__N__"', number).encode())
            assert refused.status == 400, refused.body
            assert "the body is not JSON" in refused.body["error"]["message"]
            assert not list((tmp_path / "data").rglob(FRONT_END_TOOLS_FILE))
            await _no_session_until_a_good_run(server, url, "t-num")


# -- reconnecting and resuming in the middle of a turn ---------------------------------------


def held_block_script(
    gate: trio.Event, *, text_first: bool = False, call: ToolCallBlock | None = None
) -> Callable[[], list[ScriptStep]]:
    """One model step that streams a block's first piece, waits for ``gate``, then the
    rest of it: the text ``Hello`` (``Hel`` … ``lo``), or ``call`` (its arguments cut in
    two); ``text_first`` puts a whole text block ``Checking.`` before it."""
    from greenroom.protocols.context import ModelRequest

    async def step(request: ModelRequest, stream: ScriptedStream) -> None:
        # ScriptedStream has no call that goes on with a block it left open: the events
        # go to its deliver, as a provider's do.
        deliver = stream._deliver
        index = 0
        if text_first:
            await stream.text("Checking.")
            index = 1
        if call is None:
            opened = [BlockStarted(index=index, kind="text"), TextDelta(index=index, text="Hel")]
            await deliver(opened)
            await gate.wait()
            await deliver([TextDelta(index=index, text="lo"),
                           BlockCompleted(index=index, block=TextBlock(text="Hello"))])  # fmt: skip
            await stream.end()
            return
        raw = json.dumps(call.arguments)
        cut = len(raw) // 2
        pieces = [
            ToolArgumentsDelta(index=index, call_id=call.id, name=call.name, delta=part)
            for part in (raw[:cut], raw[cut:])
        ]
        opened = BlockStarted(index=index, kind="tool_call", call_id=call.id, name=call.name)
        await deliver([opened, pieces[0]])
        await gate.wait()
        await deliver([pieces[1], BlockCompleted(index=index, block=call)])
        await stream.end("tool_use")

    return lambda: [step]


def message_ids(stream: Stream) -> list[str]:
    return [e["messageId"] for e in stream.of("TEXT_MESSAGE_START")]


def said(stream: Stream) -> str:
    return "".join(e["delta"] for e in stream.of("TEXT_MESSAGE_CONTENT"))


async def test_a_reconnect_gives_a_message_cut_off_mid_block_whole_under_its_id(
    tmp_path: Path,
) -> None:
    """R-PROTO-2: a front end that lost the stream after ``Hel`` of ``Hello`` reconnects
    from its last event id once the block is complete. The replay starts after the turn's
    ``request_begin``, and the reconnect's mapper counted turns from 0: the message came
    again under ``RUN-0-0``, not the ``RUN-1-0`` the front end was shown."""
    gate = trio.Event()
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, held_block_script(gate), ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(
                url, run_input("t1", "r1", "hi"),
                until=lambda e: e["type"] == "TEXT_MESSAGE_CONTENT",
            )  # fmt: skip
            assert said(first) == "Hel"
            gate.set()
            await server.host.get_session("t1").wait_idle()
            again = await posted(
                url, run_input("t1", "r1"), headers={"Last-Event-ID": str(first.events[-1][0])}
            )
    assert said(again) == "Hello"
    assert message_ids(again) == message_ids(first)
    assert again.events[-1][1]["outcome"] == {"type": "success"}


async def reconnect_then_go_on(
    monkeypatch: pytest.MonkeyPatch, url: str, first: Stream, gate: trio.Event
) -> Stream:
    """Reconnect to thread ``t1``'s run ``r1`` from the last event ``first`` read; the model
    goes on (``gate``) only once the reconnect's replay has read the trace, so its next
    piece is a live one, never one the replay makes stale. The reconnect's stream."""
    replayed, let_go = hold_after_first(monkeypatch, feeds, "replay_records")
    streams: list[Stream] = []

    async def reconnect() -> None:
        last = str(first.events[-1][0])
        streams.append(await posted(url, run_input("t1", "r1"), headers={"Last-Event-ID": last}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reconnect)
        await replayed.wait()
        gate.set()
        let_go.set()
    (again,) = streams
    return again


async def test_a_reconnect_while_the_model_still_writes_a_message_gives_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-PROTO-2: the front end reconnects after ``Hel`` while the model still writes the
    block. ``Hel`` is not in the trace (live pieces never are) and was published before
    the reconnect watched, so the reconnect began a message of its own with the pieces
    that followed (``lo``). The block comes whole once complete, under its id."""
    gate = trio.Event()
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, held_block_script(gate), ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(
                url, run_input("t1", "r1", "hi"),
                until=lambda e: e["type"] == "TEXT_MESSAGE_CONTENT",
            )  # fmt: skip
            again = await reconnect_then_go_on(monkeypatch, url, first, gate)
    assert said(again) == "Hello"
    assert message_ids(again) == message_ids(first)
    assert again.events[-1][1]["outcome"] == {"type": "success"}


async def test_a_reconnect_while_the_model_still_writes_a_tool_call_gives_it_whole(
    tmp_path: Path, lookup: Lookup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-PROTO-2: the front end reconnects, from the end of ``Checking.``, while the model
    still writes the call's arguments. The reconnect showed the call with the rest of its
    JSON only (not JSON), and without the ``parentMessageId`` the front end was shown (its
    mapper knew no text message of the turn). The call comes whole, under its message."""
    gate = trio.Event()
    call = ToolCallBlock(id="c1", name="lookup", arguments={"key": "a"})
    script = held_block_script(gate, text_first=True, call=call)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script, tools=[lookup.tool], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(
                url, run_input("t1", "r1", "hi"), until=lambda e: e["type"] == "TOOL_CALL_ARGS"
            )
            (live,) = first.of("TOOL_CALL_START")
            assert live["parentMessageId"] == message_ids(first)[0]
            again = await reconnect_then_go_on(monkeypatch, url, first, gate)
    assert not again.of("TEXT_MESSAGE_START")  # seen before the id: not again
    (start,) = again.of("TOOL_CALL_START")
    assert start == live
    assert json.loads("".join(e["delta"] for e in again.of("TOOL_CALL_ARGS"))) == {"key": "a"}
    assert again.events[-1][1]["outcome"]["interrupts"][0]["id"] == "c1"


async def test_a_resume_gives_the_rest_of_a_turn_asked_about_mid_stream_under_its_ids(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-PROTO-2: a call is asked about as soon as its block is complete, while the model
    may still write the turn. The run ends on that interrupt; the resume streams from the
    request, after the turn's ``request_begin``, and its mapper counted from turn 0: the
    turn's next call came without the ``parentMessageId`` of the words before it."""
    from greenroom.protocols.context import ModelRequest

    gate = trio.Event()

    async def step(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text("Checking.")
        await stream.tool_call(ToolCallBlock(id="c1", name="lookup", arguments={"key": "a"}))
        await gate.wait()  # c1 is asked about meanwhile
        await stream.tool_call(ToolCallBlock(id="c2", name="lookup", arguments={"key": "b"}))
        await stream.end("tool_use")

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lambda: [step], tools=[lookup.tool], ag_ui=True) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            first = await posted(url, run_input("t1", "r1", "go"))
            assert first.events[-1][1]["outcome"]["interrupts"][0]["id"] == "c1"
            assert [e["toolCallId"] for e in first.of("TOOL_CALL_START")] == ["c1"]
            gate.set()
            allow = {"interruptId": "c1", "status": "resolved", "payload": {"decision": "allow"}}
            second = await posted(url, run_input("t1", "r2", resume=[allow]))
    (start,) = second.of("TOOL_CALL_START")
    assert start["toolCallId"] == "c2"
    assert start["parentMessageId"] == message_ids(first)[0]
    assert json.loads("".join(e["delta"] for e in second.of("TOOL_CALL_ARGS"))) == {"key": "b"}
    assert second.events[-1][1]["outcome"]["interrupts"][0]["id"] == "c2"
    assert lookup.calls == ["a"]
