"""The A2A server of ``serve --a2a`` (R-PROTO-1) driven by the a2a-sdk's own client (its
v0.3 JSON-RPC transport, asyncio in a worker thread) against a real gateway on port 0
with scripted models: the agent card, a streamed task with a tool call that waits for an
approval (``input-required``) answered by the next message, ``tasks/get``,
``tasks/cancel``, ``tasks/resubscribe``; the gateway's tokens and principals (R-SEC-4).
The pure mapping (``protocols/a2a.py``) is checked against the SDK's v0.3 models."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import trio
import trio.testing
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.errors import A2AClientError
from a2a.compat.v0_3 import types as v03
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskState,
)
from a2a.utils.errors import A2AError
from conftest import Gates, Lookup, answer_meeting_a_close, hold_after_first, port_of
from test_gateway import TOKEN, connect, lookup_brain, lookup_script, serving
from test_gateway_queued import closed_before_it_ran, hold_task_end, steered_event
from trio_websocket import open_websocket_url

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.gateway import a2a as a2a_endpoint
from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.providers import read_image
from greenroom.actors.providers.scripted import Reply, ScriptStep, text, tool_call
from greenroom.protocols import a2a, jsonrpc
from greenroom.protocols.content import ImageBlock, TextBlock, ToolCallBlock
from greenroom.protocols.outputs import (
    ApprovalDecision,
    ApprovalRequest,
    ModelMsg,
    TaskEnd,
    TaskStart,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.tools import ToolContext, tool

BOUND_S = 20.0
T = TypeVar("T")
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


def in_asyncio(work: Callable[[], Awaitable[T]]) -> Callable[[], T]:
    """``work`` run by asyncio in a worker thread (the a2a-sdk client is asyncio's)."""
    return lambda: asyncio.run(work())  # type: ignore[arg-type]


def base_url(server: Any) -> str:
    return f"http://127.0.0.1:{server.gateway.port}"


def http_client(token: str | None = TOKEN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(headers=headers, timeout=BOUND_S)


async def collect(events: Any) -> list[StreamResponse]:
    return [event async for event in events]


def state_of(event: StreamResponse) -> int:
    if event.HasField("task"):
        return int(event.task.status.state)
    if event.HasField("status_update"):
        return int(event.status_update.status.state)
    return -1


def user_message(words: str, **ids: str) -> SendMessageRequest:
    return SendMessageRequest(
        message=Message(
            role=Role.ROLE_USER, message_id=f"m-{words}", parts=[Part(text=words)], **ids
        )
    )


async def test_a2a_client_drives_a_task_with_a_tool_call_and_an_approval(
    tmp_path: Path, lookup: Lookup
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_script, tools=[lookup.tool], a2a=True) as server:
            url = base_url(server)

            async def drive() -> dict[str, Any]:
                async with http_client() as http:
                    card = await A2ACardResolver(http, url).get_agent_card()
                    client = ClientFactory(ClientConfig(httpx_client=http)).create(card)
                    first = await collect(client.send_message(user_message("go")))
                    task = first[0].task
                    second = await collect(
                        client.send_message(
                            user_message("allow", task_id=task.id, context_id=task.context_id)
                        )
                    )
                    got = await client.get_task(GetTaskRequest(id=task.id))
                    return {"card": card, "first": first, "second": second, "got": got}

            result = await trio.to_thread.run_sync(in_asyncio(drive))
    card = result["card"]
    assert {skill.id for skill in card.skills} == {"conversation", "lookup"}
    first, second, got = result["first"], result["second"], result["got"]
    assert first[0].HasField("task")
    assert state_of(first[0]) == TaskState.TASK_STATE_SUBMITTED
    assert state_of(first[-1]) == TaskState.TASK_STATE_INPUT_REQUIRED
    asked = first[-1].status_update.status.message
    assert "lookup" in asked.parts[0].text
    assert state_of(second[-1]) == TaskState.TASK_STATE_COMPLETED
    assert second[-1].status_update.status.message.parts[0].text == "Done."
    assert lookup.calls == ["a"]
    assert got.status.state == TaskState.TASK_STATE_COMPLETED
    said = [part for message in got.history for part in message.parts]
    texts = [p.text for p in said if p.text]
    assert texts[:2] == ["go", "Checking."] and "allow" in texts and texts[-1] == "Done."
    results = [p.data for p in said if p.HasField("data") and "tool_result" in p.data.struct_value]
    assert results, "the tool's result is in the task's history"
    assert got.id.startswith(got.context_id + ":run_")  # the context is the session


async def test_message_send_blocks_until_input_required_and_tasks_get_cancel(
    tmp_path: Path, lookup: Lookup
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_script, tools=[lookup.tool], a2a=True) as server:
            url = base_url(server)

            async def drive() -> dict[str, Any]:
                async with http_client() as http:
                    card = await A2ACardResolver(http, url).get_agent_card()
                    config = ClientConfig(httpx_client=http, streaming=False)
                    client = ClientFactory(config).create(card)
                    (sent,) = await collect(client.send_message(user_message("go")))
                    task = sent.task
                    streaming = ClientFactory(ClientConfig(httpx_client=http)).create(card)
                    resubscribed = await collect(
                        streaming.subscribe(SubscribeToTaskRequest(id=task.id))
                    )
                    canceled = await client.cancel_task(CancelTaskRequest(id=task.id))
                    try:
                        await client.cancel_task(CancelTaskRequest(id=task.id))
                    except (A2AClientError, A2AError) as exc:
                        again = str(exc)
                    return {
                        "sent": sent,
                        "resubscribed": resubscribed,
                        "canceled": canceled,
                        "again": again,
                    }

            result = await trio.to_thread.run_sync(in_asyncio(drive))
    assert result["sent"].task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    (snapshot,) = result["resubscribed"]
    assert snapshot.task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    assert result["canceled"].status.state == TaskState.TASK_STATE_CANCELED
    assert "canceled" in result["again"]
    assert lookup.calls == []


async def test_tokens_and_principals_are_the_gateway_s(tmp_path: Path, lookup: Lookup) -> None:
    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path, lookup_script, tools=[lookup.tool], a2a=True, tokens=tokens
        ) as server:
            url = base_url(server)
            body = message_send("go")

            async def drive() -> dict[str, Any]:
                statuses = {}
                async with http_client(None) as anonymous:
                    statuses["card"] = (
                        await anonymous.get(url + "/.well-known/agent-card.json")
                    ).status_code
                    statuses["none"] = (await anonymous.post(url + "/a2a", json=body)).status_code
                async with http_client("wrong-token-0123456789") as wrong:
                    refused = await wrong.post(url + "/a2a", json=body)
                    statuses["wrong"] = refused.status_code
                    statuses["www"] = refused.headers.get("www-authenticate")
                async with http_client(tokens["alice"]) as alice:
                    created = (await alice.post(url + "/a2a", json=body)).json()["result"]
                async with http_client(tokens["bob"]) as bob:
                    card = await A2ACardResolver(bob, url).get_agent_card()
                    client = ClientFactory(ClientConfig(httpx_client=bob)).create(card)
                    errors = []
                    for attempt in (
                        lambda: client.get_task(GetTaskRequest(id=created["id"])),
                        lambda: client.cancel_task(CancelTaskRequest(id=created["id"])),
                        lambda: collect(
                            client.send_message(user_message("allow", task_id=created["id"]))
                        ),
                        lambda: collect(
                            client.send_message(
                                user_message("hi", context_id=created["contextId"])
                            )
                        ),
                    ):
                        try:
                            await attempt()
                        except (A2AClientError, A2AError) as exc:
                            errors.append(str(exc))
                return {"statuses": statuses, "created": created, "errors": errors}

            result = await trio.to_thread.run_sync(in_asyncio(drive))
    statuses = result["statuses"]
    assert (statuses["card"], statuses["none"], statuses["wrong"]) == (401, 401, 401)
    assert statuses["www"] == 'Bearer realm="greenroom"'
    assert result["created"]["status"]["state"] == "input-required"
    assert len(result["errors"]) == 4
    assert all("no task" in e or "no context" in e for e in result["errors"]), result["errors"]
    assert lookup.calls == []


async def test_bad_requests_get_json_rpc_errors_and_the_gateway_keeps_serving(
    tmp_path: Path,
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, a2a=True) as server:
            url = base_url(server)

            async def drive() -> list[Any]:
                answers: list[Any] = []
                async with http_client() as http:
                    for raw in (
                        b"{not json",
                        b"[]",
                        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "nope"}).encode(),
                        json.dumps(
                            {"jsonrpc": "2.0", "id": 2, "method": "message/send", "params": {}}
                        ).encode(),
                        json.dumps(
                            {
                                "jsonrpc": "2.0",
                                "id": 3,
                                "method": "tasks/get",
                                "params": {"id": "no-such-task"},
                            }
                        ).encode(),
                    ):
                        answer = await http.post(url + "/a2a", content=raw)
                        answers.append((answer.status_code, answer.json()))
                    answers.append((await http.get(url + "/a2a")).status_code)
                    answers.append((await http.get(url + "/elsewhere")).status_code)
                return answers

            answers = await trio.to_thread.run_sync(in_asyncio(drive))
            codes = [a[1]["error"]["code"] for a in answers[:5]]
            assert codes == [-32700, -32600, -32601, -32602, a2a.TASK_NOT_FOUND]
            assert all(a[0] == 200 for a in answers[:5])
            assert "$.params.message" in answers[3][1]["error"]["message"]
            assert answers[5:] == [405, 404]
            # The websocket gateway on the same port is untouched.
            async with connect(server) as client:
                assert (await client.result("session.create"))["session_id"]


def post_message(server: Any, message: dict[str, Any]) -> dict[str, Any]:
    """POST ``message`` as an A2A ``message/send`` with the token (blocking: from a thread);
    the JSON-RPC answer."""
    params = {"message": message}
    frame = {"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": params}
    answer = httpx.post(
        base_url(server) + "/a2a",
        json=frame,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=BOUND_S,
    )
    body: dict[str, Any] = answer.json()
    return body


async def test_a_decision_is_taken_from_the_data_part_that_names_its_call(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-PROTO-1, R-HITL-2: a message whose data parts decide two calls, one of them no
    longer waiting (a stale answer first), decided the waiting call with the first part's
    decision: ``c1`` was denied though its own part said allow."""

    def send(message: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = post_message(server, message)["result"]
        return result

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_script, tools=[lookup.tool], a2a=True) as server:
            go = {"kind": "message", "messageId": "m1", "role": "user"}
            task = await trio.to_thread.run_sync(
                lambda: send({**go, "parts": [{"kind": "text", "text": "go"}]})
            )
            assert task["status"]["state"] == "input-required"
            decisions = [
                {"kind": "data", "data": {"call_id": "c0", "decision": "deny"}},
                {"kind": "data", "data": {"call_id": "c1", "decision": "allow"}},
            ]
            answer = {
                **go,
                "messageId": "m2",
                "taskId": task["id"],
                "contextId": task["contextId"],
                "parts": decisions,
            }
            done = await trio.to_thread.run_sync(lambda: send(answer))
            assert done["status"]["state"] == "completed", done
            assert lookup.calls == ["a"]
            records = await replay_records(server.host.get_session(task["contextId"]), 0)
            decided = [(r.call_id, r.decision) for r in records if isinstance(r, ApprovalDecision)]
            assert decided == [("c1", "allow")]


async def test_a_message_refused_for_want_of_text_makes_no_context(tmp_path: Path) -> None:
    """R-SEC-9: a message without ``contextId`` and without text (a data part alone, blank
    text) was refused -32602 after its new context had been made: one more session of the
    principal on disk and against its cap for each. Refused, it now makes none."""

    def send(parts: list[dict[str, Any]]) -> dict[str, Any]:
        message = {"kind": "message", "messageId": "m1", "role": "user", "parts": parts}
        error: dict[str, Any] = post_message(server, message)["error"]
        return error

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, a2a=True) as server:
            for parts in (
                [{"kind": "data", "data": {"decision": "allow"}}],
                [{"kind": "text", "text": "  \n "}],
            ):
                error = await trio.to_thread.run_sync(send, parts)
                assert error["code"] == jsonrpc.INVALID_PARAMS
                assert "no text to start a task" in error["message"]
            sessions = server.host.data_dir / "sessions"
            assert not sessions.exists() or list(sessions.iterdir()) == []
            async with connect(server) as client:
                assert (await client.result("session.list"))["sessions"] == []


async def test_the_websocket_gateway_shares_the_port(tmp_path: Path) -> None:
    """A websocket handshake through the HTTP front reaches the gateway whole: the
    handshake's bytes are given back, the bad path still gets the gateway's 404."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, a2a=True, ag_ui=True) as server:
            async with connect(server) as client:
                sid = (await client.result("session.create"))["session_id"]
                await client.result("session.subscribe", {"session_id": sid})
                await client.result("run", {"session_id": sid, "input": "hello"})
                outputs = await client.outputs_until("task_end")
                assert outputs[-1]["status"] == "completed"
            with pytest.raises(Exception, match="404"):
                async with open_websocket_url(
                    f"ws://127.0.0.1:{server.gateway.port}/elsewhere",
                    extra_headers=[(b"Authorization", f"Bearer {TOKEN}".encode())],
                ):
                    pass


def gated_script() -> list[ScriptStep]:
    return [
        Reply(blocks=(text("Waiting."), tool_call("c1", "wait", key="a"))),
        Reply(blocks=(text("Done."),)),
    ]


def message_send(text: str, **ids: str) -> dict[str, Any]:
    """A raw JSON-RPC ``message/send`` of a user's ``text`` (``ids``: ``contextId``…)."""
    message = {"kind": "message", "messageId": "m1", "role": "user", **ids}
    message["parts"] = [{"kind": "text", "text": text}]
    return {"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {"message": message}}


def raw_post(port: int, body: dict[str, Any], token: str = TOKEN) -> bytes:
    """``body`` as a whole HTTP request to ``/a2a``."""
    content = json.dumps(body).encode()
    return (
        f"POST /a2a HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(content)}\r\n\r\n"
    ).encode() + content


async def test_a_blocking_send_whose_client_goes_away_stops_waiting_and_the_task_goes_on(
    tmp_path: Path, gates: Gates
) -> None:
    """A blocking ``message/send`` waits for its task to end; when its HTTP client closes
    the connection meanwhile, the server stops waiting at once (the request's place among
    its principal's connections is given back), as a ``message/stream`` whose client goes
    away does. The task goes on, and ``tasks/get`` finds it completed."""
    limits = GatewayLimits(max_connections_per_principal=1)
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path, gated_script, tools=[gates.tool()], approve="all", a2a=True, limits=limits
        ) as server:
            port = server.gateway.port
            admission = server.gateway._admission
            async with connect(server) as client:
                sid = (await client.result("session.create"))["session_id"]
            send = message_send("go", contextId=sid)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(raw_post(port, send))
            await gates.started("a")
            assert admission.connections_of("default") == 1  # the send waits for its task
            await stream.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert admission.connections_of("default") == 0
            session = server.host.get_session(sid)
            assert session.busy and not gates.cancelled  # the task was not touched
            gates.release("a")
            await session.wait_idle()
            [run_id] = {o.run_id for o in await replay_records(session, 0)}

            async def get() -> Any:
                async with http_client() as http:
                    card = await A2ACardResolver(http, base_url(server)).get_agent_card()
                    client = ClientFactory(ClientConfig(httpx_client=http)).create(card)
                    return await client.get_task(GetTaskRequest(id=f"{sid}:{run_id}"))

            got = await trio.to_thread.run_sync(in_asyncio(get))
    assert got.status.state == TaskState.TASK_STATE_COMPLETED
    assert got.status.message.parts[0].text == "Done."


def hold_after_catching_up(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """The next message waits, once it has read its session's records up to now (and so
    found whether its task runs), until the test lets it go on. Returns (found, let_go)."""
    return hold_after_first(monkeypatch, a2a_endpoint, "_caught_up")


async def send_with_the_sdk(server: Any, message: SendMessageRequest) -> tuple[str, list[Any]]:
    """``message`` sent with the a2a-sdk client (message/send, no stream), from a thread
    of its own: the error the client raised ("answered without an error" when none), and
    the JSON-RPC frames the server answered with."""
    answered: list[Any] = []

    async def keep(response: httpx.Response) -> None:
        if response.request.method == "POST":
            answered.append(json.loads(await response.aread()))

    async def drive() -> str:
        async with http_client() as http:
            http.event_hooks["response"] = [keep]
            card = await A2ACardResolver(http, base_url(server)).get_agent_card()
            config = ClientConfig(httpx_client=http, streaming=False)
            sdk = ClientFactory(config).create(card)
            try:
                await collect(sdk.send_message(message))
            except (A2AClientError, A2AError) as exc:
                return str(exc)
        return "answered without an error"

    return await trio.to_thread.run_sync(in_asyncio(drive)), answered


@contextlib.asynccontextmanager
async def steering_a_running_task(
    tmp_path: Path, gates: Gates
) -> AsyncIterator[tuple[Any, str, Any]]:
    """An A2A server whose session's task waits in its gated call ``a``: the server, the
    session's id and a message that steers that task."""
    async with serving(
        tmp_path, gated_script, tools=[gates.tool()], approve="all", a2a=True
    ) as server:
        async with connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            started = await client.result("run", {"session_id": sid, "input": "go"})
        await gates.started("a")
        task_id = a2a.task_id(sid, started["run_id"])
        yield server, sid, user_message("STEER LATE", task_id=task_id, context_id=sid)


async def test_steering_that_a_closing_session_drops_is_answered_410(
    tmp_path: Path, gates: Gates, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1, R-HOST-3: a message for a running task steers it. One that reaches the
    session as its task ends runs as a task of its own; but when the host closes the
    session before the supervisor takes it up, it never runs: the a2a-sdk client gets
    error 410 saying the input was dropped, and the model is not asked again."""
    ending, let_end = hold_task_end(monkeypatch)
    steered = steered_event(monkeypatch)
    with trio.fail_after(BOUND_S):
        async with steering_a_running_task(tmp_path, gates) as (server, sid, steer):
            found, let_steer = hold_after_catching_up(monkeypatch)
            sent: list[tuple[str, list[Any]]] = []

            async def send() -> None:
                sent.append(await send_with_the_sdk(server, steer))

            port = port_of(server.host.get_session(sid))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                await found.wait()  # the task was found running: the message steers it
                gates.release("a")
                await ending.wait()  # its task_end is written; its supervisor waits
                let_steer.set()
                await steered.wait()  # in the inbox of the supervisor whose task ends
                nursery.start_soon(server.host.close_session, sid)
                await trio.testing.wait_all_tasks_blocked()
                assert port.closed
                let_end.set()
            [(refusal, [frame])] = sent
            assert refusal == closed_before_it_ran(sid, "steer")
            assert frame["error"]["code"] == jsonrpc.GONE == 410, frame
            assert len(server.providers[0].requests) == 2  # the words reached no model


@pytest.mark.parametrize("stage", ["closing", "closed"])
async def test_steering_a_session_whose_close_began_once_it_was_found_is_answered_410(
    tmp_path: Path, gates: Gates, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """R-STEER-1, R-HOST-3: a message that found its task running, and came to steer it
    once the host had begun to close the session, was answered 404 "not open in this
    host" while the task still ended (the host lists a closing session no more), and 409
    "the task waits; send its answer" once it had ended. The a2a-sdk client gets the 410
    of steering the close drops now, in the same words, and no place stays taken."""
    ending, let_end = hold_task_end(monkeypatch)
    with trio.fail_after(BOUND_S):
        async with steering_a_running_task(tmp_path, gates) as (server, sid, steer):
            found, let_steer = hold_after_catching_up(monkeypatch)
            sent: list[tuple[str, list[Any]]] = []
            answered, closed = trio.Event(), trio.Event()

            async def send() -> None:
                sent.append(await send_with_the_sdk(server, steer))
                answered.set()

            async def close() -> None:
                await server.host.close_session(sid)
                closed.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                await found.wait()  # the task was found running: the message steers it
                nursery.start_soon(close)
                await ending.wait()  # the close interrupted the task, whose end waits
                if stage == "closed":
                    let_end.set()
                    await closed.wait()
                let_steer.set()
                await answered.wait()  # when closing: answered while the task still ends
                let_end.set()
            [(refusal, [frame])] = sent
            assert refusal == closed_before_it_ran(sid, "steer")
            assert frame["error"]["code"] == jsonrpc.GONE == 410, frame
            assert server.gateway._calls.queue_room.pending(sid, "steering") == 0  # R-SEC-9
            assert len(server.providers[0].requests) == 1  # the words reached no model


@pytest.mark.parametrize("stage", ["closing", "closed"])
async def test_an_answer_to_a_session_whose_close_began_once_it_was_found_is_taken_there_again(
    tmp_path: Path, lookup: Lookup, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """R-HITL-1, R-HOST-3: a message that found its task waiting for an approval, and came
    to answer it once the host had begun to close the session (or had closed it), had the
    host load the session with the host's own tools and model: the approval was recorded
    there, the call failed as an unknown tool, and the a2a-sdk client was told the task
    still waited for that approval. The answer goes to the session loaded as any call on
    a closed session loads it: the tool runs once and the client gets the task completed."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_brain, tools=[lookup.tool], a2a=True) as server:
            _, [asked] = await send_with_the_sdk(server, user_message("go"))
            task = asked["result"]
            assert task["status"]["state"] == "input-required", task
            sid = task["contextId"]
            allow = user_message("allow", task_id=task["id"], context_id=sid)
            # Found once the approval was found pending: the message answers it.
            found, let_answer = hold_after_catching_up(monkeypatch)
            sent: list[tuple[str, list[Any]]] = []

            async def send() -> None:
                sent.append(await send_with_the_sdk(server, allow))

            await answer_meeting_a_close(
                monkeypatch, server.host, sid, send, found, let_answer, stage=stage
            )
            [(outcome, [frame])] = sent
            assert outcome == "answered without an error"
            status = frame["result"]["status"]
            assert status["state"] == "completed", frame
            assert status["message"]["parts"][0]["text"] == "Done."
            assert lookup.calls == ["a"]
            records = await replay_records(server.host.get_session(sid), 0)
            decisions = [r for r in records if isinstance(r, ApprovalDecision)]
            assert [(d.call_id, d.decision, d.principal) for d in decisions] == [
                ("c1", "allow", "default")
            ]
            [result] = [r for r in records if isinstance(r, ToolCallOutput)]
            assert not result.is_error, result


async def test_tool_images_are_read_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The images a task's tools returned become artifacts of ``tasks/get`` (and of the
    send that waited for the task), read from the session's private copies in a worker
    thread, never in the event loop's (R-SEC-8)."""
    loop_thread = threading.get_ident()
    readers: list[int] = []

    def reading(block: ImageBlock, source: Any) -> Any:
        readers.append(threading.get_ident())
        return read_image(block, source)

    monkeypatch.setattr(a2a_endpoint, "read_image", reading)

    @tool
    async def shot(ctx: ToolContext) -> list[TextBlock | ImageBlock]:
        """Take a screenshot."""
        (ctx.workspace_dir / "shot.png").write_bytes(PNG)
        return [TextBlock(text="saved"), ImageBlock(path="shot.png", media_type="image/png")]

    def script() -> list[ScriptStep]:
        return [Reply(blocks=(tool_call("c1", "shot"),)), Reply(blocks=(text("Done."),))]

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script, tools=[shot], approve="all", a2a=True) as server:
            url = base_url(server)

            async def drive() -> tuple[Any, Any]:
                async with http_client() as http:
                    card = await A2ACardResolver(http, url).get_agent_card()
                    config = ClientConfig(httpx_client=http, streaming=False)
                    client = ClientFactory(config).create(card)
                    (sent,) = await collect(client.send_message(user_message("shoot")))
                    got = await client.get_task(GetTaskRequest(id=sent.task.id))
                    return sent.task, got

            sent, got = await trio.to_thread.run_sync(in_asyncio(drive))
    for task in (sent, got):
        assert task.status.state == TaskState.TASK_STATE_COMPLETED
        (artifact,) = task.artifacts
        assert artifact.name == "shot.png"
        assert artifact.parts[0].raw == PNG
    assert len(readers) >= 2 and loop_thread not in readers


# -- protocols/a2a.py (pure), against the SDK's v0.3 models ------------------------------------


def _outputs() -> list[Any]:
    common = {"session_id": "s1", "run_id": "run_1"}
    return [
        UserMsg(seq=1, kind="prompt", content=(TextBlock(text="go"),), **common),
        TaskStart(seq=2, input_seq=1, **common),
        ModelMsg(seq=3, turn=1, block=TextBlock(text="Checking."), **common),
        ModelMsg(seq=4, turn=1, block=ToolCallBlock(id="c1", name="shot", arguments={}), **common),
        ApprovalRequest(seq=5, call_id="c1", tool="shot", arguments={}, **common),
        ApprovalDecision(seq=6, call_id="c1", tool="shot", decision="allow", by="client", **common),
        ToolCallOutput(
            seq=7,
            call_id="c1",
            tool="shot",
            status="ok",
            is_error=False,
            content=(TextBlock(text="saved"), ImageBlock(path="shot.png", media_type="image/png")),
            **common,
        ),
        ModelMsg(seq=8, turn=2, block=TextBlock(text="Done."), **common),
        TaskEnd(seq=9, status="completed", turns=2, usage=TokenUsage(), wall_ms=5, **common),
    ]


def test_every_event_and_the_task_validate_against_the_sdk_models() -> None:
    fold = a2a.TaskFold(
        context_id="s1", run_id="run_1", file_data=lambda block: ("image/png", "aGk=")
    )
    states = []
    for output in _outputs():
        for event in fold.apply(output):
            if event["kind"] == "status-update":
                v03.TaskStatusUpdateEvent.model_validate(event)
                states.append(event["status"]["state"])
            else:
                v03.TaskArtifactUpdateEvent.model_validate(event)
    task = v03.Task.model_validate(fold.task())
    assert task.status.state == v03.TaskState.completed
    assert states[0] == "working" and "input-required" in states and states[-1] == "completed"
    (artifact,) = task.artifacts or []
    assert artifact.name == "shot.png"
    assert fold.task(history_length=1)["history"][-1]["parts"][0]["text"] == "Done."
    card = a2a.agent_card(
        url="http://h/a2a",
        description="d",
        skills=a2a.skills_of([("lookup", "Look up a key.")], "You help."),
        version="1",
    )
    v03.AgentCard.model_validate(card)


@pytest.mark.parametrize(
    ("words", "data", "verdict"),
    [
        ("allow", [], "allow"),
        ("Yes.", [], "allow"),
        ("no", [], "deny"),
        ("always", [], "allow_session"),
        ("perhaps", [], None),
        ("", [{"decision": "deny"}], "deny"),
    ],
)
def test_parse_decision(words: str, data: list[dict[str, Any]], verdict: str | None) -> None:
    assert a2a.parse_decision(words, data) == verdict


def test_task_ids_join_the_session_and_the_run() -> None:
    assert a2a.split_task_id(a2a.task_id("s1", "run_abc")) == ("s1", "run_abc")
    assert a2a.split_task_id("nonsense") is None
    assert a2a.split_task_id("s1:notarun") is None
    assert a2a.open_run(_outputs()[:5]) == "run_1"
    assert a2a.open_run(_outputs()) is None


def test_a_failed_or_interrupted_task_ends_failed_or_canceled() -> None:
    common = {"session_id": "s1", "run_id": "run_1"}
    for status, state in (("aborted", "canceled"), ("max_turns", "failed")):
        fold = a2a.TaskFold(context_id="s1", run_id="run_1")
        fold.apply(TaskStart(seq=1, input_seq=None, **common))
        (event,) = fold.apply(
            TaskEnd(seq=2, status=status, turns=1, usage=TokenUsage(), wall_ms=1, **common)  # type: ignore[arg-type]
        )
        v03.TaskStatusUpdateEvent.model_validate(event)
        assert (event["status"]["state"], event["final"]) == (state, True)


async def test_message_send_and_stream_keep_the_history_length_the_configuration_asks(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-PROTO-1: ``configuration.historyLength`` (A2A 0.3: the number of most recent
    history messages the response carries) was honoured by ``tasks/get`` only:
    ``message/send`` answered the whole history, and so did the Task a
    ``message/stream`` answering a waiting task begins with."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_script, tools=[lookup.tool], a2a=True) as server:
            url = base_url(server)

            async def drive() -> tuple[Any, list[StreamResponse], Any]:
                async with http_client() as http:
                    card = await A2ACardResolver(http, url).get_agent_card()
                    config = ClientConfig(httpx_client=http, streaming=False)
                    sending = ClientFactory(config).create(card)
                    streaming = ClientFactory(ClientConfig(httpx_client=http)).create(card)
                    one = SendMessageConfiguration(history_length=1)
                    go = SendMessageRequest(message=user_message("go").message, configuration=one)
                    (sent,) = await collect(sending.send_message(go))
                    task = sent.task
                    said = user_message("allow", task_id=task.id, context_id=task.context_id)
                    allow = SendMessageRequest(message=said.message, configuration=one)
                    streamed = await collect(streaming.send_message(allow))
                    return sent, streamed, await sending.get_task(GetTaskRequest(id=task.id))

            sent, streamed, got = await trio.to_thread.run_sync(in_asyncio(drive))
    assert sent.task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    # Of go, Checking., the call and the question about it: the question alone.
    (asked,) = sent.task.history
    assert asked.parts[0].text == sent.task.status.message.parts[0].text
    assert streamed[0].HasField("task") and len(streamed[0].task.history) == 1
    assert state_of(streamed[-1]) == TaskState.TASK_STATE_COMPLETED
    assert len(got.history) > 2  # the task keeps its whole history


async def test_a_question_answered_with_text_is_that_text_in_the_task_history(
    tmp_path: Path,
) -> None:
    """R-PROTO-1: the model asks (``ask_user``) and the next message's text, ``blue``,
    answers it. The task's history showed the user saying ``allow`` (the answer's
    decision); it shows the answer, as the user's turn, before the call's result."""
    from greenroom.actors.tools import ask_user

    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(tool_call("q1", "ask_user", question="Which color?"),)),
            Reply(blocks=(text("Blue it is."),)),
        ]

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script, tools=[ask_user], a2a=True) as server:
            url = base_url(server)

            async def drive() -> tuple[list[StreamResponse], list[StreamResponse], Any]:
                async with http_client() as http:
                    card = await A2ACardResolver(http, url).get_agent_card()
                    client = ClientFactory(ClientConfig(httpx_client=http)).create(card)
                    first = await collect(client.send_message(user_message("pick")))
                    task = first[0].task
                    answer = user_message("blue", task_id=task.id, context_id=task.context_id)
                    second = await collect(client.send_message(answer))
                    return first, second, await client.get_task(GetTaskRequest(id=task.id))

            first, second, got = await trio.to_thread.run_sync(in_asyncio(drive))
    assert state_of(first[-1]) == TaskState.TASK_STATE_INPUT_REQUIRED
    assert state_of(second[-1]) == TaskState.TASK_STATE_COMPLETED
    users = [m for m in got.history if m.role == Role.ROLE_USER]
    assert [[p.text for p in m.parts if p.text] for m in users] == [["pick"], ["blue"]]
    answer = users[-1]
    assert any(
        p.HasField("data") and p.data.struct_value["call_id"] == "q1" for p in answer.parts
    )
    after = list(got.history)[list(got.history).index(answer) + 1 :]
    assert any(
        p.HasField("data") and "tool_result" in p.data.struct_value
        for m in after
        for p in m.parts
    ), "the call's result follows the answer"
