"""The A2A server of ``serve --a2a`` (R-PROTO-1) driven by the a2a-sdk's own client: a
question a running call asks (an MCP elicitation) shows as the question it is; a message
sent again with the same ``messageId`` (a client's retry after a lost answer) is answered
with what its first delivery started, after a restart too; the runtime's "host lost" note
is never the user's words in a task's history."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types import GetTaskRequest, Message, Part, Role, SendMessageRequest, TaskState
from conftest import Lookup, allow_all, cut_after
from test_gateway import serving
from test_gateway_a2a import BOUND_S, base_url, collect, http_client, in_asyncio, state_of

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptStep,
    text,
    tool_call,
)
from greenroom.protocols import a2a
from greenroom.protocols.markers import HOST_LOST_CONTINUATION
from greenroom.protocols.tools import ToolContext, tool


def said(words: str, message_id: str, **ids: str) -> SendMessageRequest:
    """The user's ``words`` as the message ``message_id`` (``ids``: task_id, context_id)."""
    return SendMessageRequest(
        message=Message(role=Role.ROLE_USER, message_id=message_id, parts=[Part(text=words)], **ids)
    )


async def with_the_sdk(server: Any, work: Any, *, streaming: bool = True) -> Any:
    """``work(client)`` with an a2a-sdk client of ``server``, in a worker thread."""

    async def drive() -> Any:
        async with http_client() as http:
            card = await A2ACardResolver(http, base_url(server)).get_agent_card()
            config = ClientConfig(httpx_client=http, streaming=streaming)
            return await work(ClientFactory(config).create(card))

    return await trio.to_thread.run_sync(in_asyncio(drive))


def model_requests(server: Any) -> int:
    return sum(len(provider.requests) for provider in server.providers)


# -- a running call's question ----------------------------------------------------------------


@tool(parallel=False, name="order")
async def order(ctx: ToolContext) -> str:
    """Order a shirt, asking its size while the call runs."""
    assert ctx.ask is not None
    answer = await ctx.ask({"question": "Which size?", "choices": ["S", "M"]})
    return f"ordered {answer.text} ({answer.action})"


def order_script() -> list[ScriptStep]:
    return [Reply(blocks=(tool_call("c1", "order"),)), Reply(blocks=(text("Ordered."),))]


async def order_allowed(client: Any) -> tuple[Any, dict[str, str], list[Any]]:
    """Through the SDK's ``client``: ask to buy a shirt, then allow the order's call. The
    task, the ids the task's next messages carry, and what the allowing send returned."""
    first = await collect(client.send_message(said("buy a shirt", "m-buy")))
    task = first[0].task
    ids = {"task_id": task.id, "context_id": task.context_id}
    approved = await collect(client.send_message(said("allow", "m-allow", **ids)))
    return task, ids, approved


def user_data_parts(task: Any) -> list[dict[str, Any]]:
    """The data parts of the user's messages in ``task``'s history, in order."""
    return [
        dict(p.data.struct_value)
        for m in task.history
        if m.role == Role.ROLE_USER
        for p in m.parts
        if p.HasField("data")
    ]


async def test_a_question_a_running_call_asks_shows_as_that_question(tmp_path: Path) -> None:
    """R-PROTO-1, R-HITL-5: a call is approved, then asks while it runs which size (an
    MCP elicitation). Its question had the message id of the approval before it (a
    client that keeps messages by id showed the approval's "allow, deny, or always" in
    its place), its choices were not said, the answer ``M`` went in the history as the
    user saying ``allow``, and the send that answered came back at once with the task
    still asking. Now the question is a message of its own with its text and choices,
    the history shows the question answered (no decision), and the send that answers it
    follows the task to its end."""

    async def work(client: Any) -> Any:
        task, ids, approved = await order_allowed(client)
        answered = await collect(client.send_message(said("M", "m-size", **ids)))
        return approved, answered, await client.get_task(GetTaskRequest(id=task.id))

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, order_script, tools=[order], a2a=True) as server:
            approved, answered, got = await with_the_sdk(server, work)
    assert state_of(approved[-1]) == TaskState.TASK_STATE_INPUT_REQUIRED
    question = approved[-1].status_update.status.message
    assert question.parts[0].text == "Which size?\nChoose one of: S, M"
    asked = question.parts[1].data.struct_value["approval_request"]
    assert (asked["kind"], list(asked["choices"])) == ("question", ["S", "M"])
    assert state_of(answered[-1]) == TaskState.TASK_STATE_COMPLETED
    assert answered[-1].status_update.status.message.parts[0].text == "Ordered."
    ids = [m.message_id for m in got.history]
    assert len(ids) == len(set(ids)), ids
    asks = [m for m in got.history if m.role == Role.ROLE_AGENT and "approval_request" in str(m)]
    assert [m.parts[0].text.split("?")[0] for m in asks] == [
        "Approve the call order({})",
        "Which size",
    ]
    replies = user_data_parts(got)
    assert replies == [
        {"call_id": "c1", "decision": "allow"},
        {"call_id": "c1", "question": "answered"},
    ]
    results = [p for m in got.history for p in m.parts if "tool_result" in str(p)]
    assert "ordered M (accept)" in str(results[-1])


# -- a message sent again ---------------------------------------------------------------------


def retried_script() -> list[ScriptStep]:
    return [
        Reply(blocks=(text("Checking."), tool_call("c1", "lookup", key="a"))),
        Reply(blocks=(text("Done."),)),
        Reply(blocks=(text("More."),)),
        Reply(blocks=(text("Once more?"),)),
        Reply(blocks=(text("And again?"),)),
    ]


async def test_a_message_sent_again_is_answered_with_what_its_first_delivery_started(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-PROTO-1 (A2A: the ``messageId`` names the message): a client that lost the
    answer sends the same message again. A first message (no ``contextId``) sent again
    made a second context and asked the model again; an answer to an approval sent again
    was refused (its task had ended); a new task's message sent again ran another task.
    Each is now answered with the task its first delivery went to, in the state it is
    in, and nothing runs again — after a restart too (the ids are kept with the
    context)."""

    async def first_part(client: Any) -> dict[str, Any]:
        go = said("go", "m-go")
        first = (await collect(client.send_message(go)))[-1].task
        again = (await collect(client.send_message(go)))[-1].task
        ids = {"task_id": first.id, "context_id": first.context_id}
        allow = said("allow", "m-allow", **ids)
        allowed = (await collect(client.send_message(allow)))[-1].task
        allowed_again = (await collect(client.send_message(allow)))[-1].task
        more = said("more", "m-more", context_id=first.context_id)
        other = (await collect(client.send_message(more)))[-1].task
        other_again = (await collect(client.send_message(more)))[-1].task
        return {
            "first": first, "again": again, "allowed": allowed,
            "allowed_again": allowed_again, "other": other, "other_again": other_again,
        }  # fmt: skip

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, retried_script, tools=[lookup.tool], a2a=True) as server:
            sent = await with_the_sdk(server, first_part, streaming=False)
            assert len(server.providers) == 1
            assert model_requests(server) == 3
    first, other = sent["first"], sent["other"]
    assert first.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    assert (sent["again"].id, sent["again"].status.state) == (first.id, first.status.state)
    assert sent["allowed"].status.state == TaskState.TASK_STATE_COMPLETED
    assert sent["allowed_again"].id == first.id
    assert sent["allowed_again"].status.state == TaskState.TASK_STATE_COMPLETED
    assert other.id != first.id and other.status.state == TaskState.TASK_STATE_COMPLETED
    assert (sent["other_again"].id, sent["other_again"].status.message.parts[0].text) == (
        other.id,
        "More.",
    )
    assert lookup.calls == ["a"]
    kept = tmp_path / "data" / "sessions" / first.context_id / "a2a_messages.json"
    assert kept.exists()  # the context's ids outlive its host

    async def after_the_restart(client: Any) -> Any:
        more = said("more", "m-more", context_id=first.context_id)
        return [event async for event in client.send_message(more)]

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, retried_script, tools=[lookup.tool], a2a=True) as server:
            streamed = await with_the_sdk(server, after_the_restart)
            assert model_requests(server) == 0
    assert streamed[0].task.id == other.id
    assert state_of(streamed[-1]) == TaskState.TASK_STATE_COMPLETED


def test_message_ids_are_bounded_and_kept_as_json() -> None:
    """The ids of a context are the newest ones, a long id by its hash; a file that is not
    theirs is refused."""
    ids = a2a.MessageIds(limit=2)
    for number in range(3):
        ids.add(f"m{number}", f"run_{number}")
    ids.add("m1", "run_1")  # seen again: the newest
    again = a2a.MessageIds.loads(ids.dumps(), limit=2)
    assert [again.run_of(f"m{n}") for n in range(3)] == [None, "run_1", "run_2"]
    long = a2a.message_key("x" * 1000)
    assert long.startswith("sha256:") and len(long) < 100
    assert a2a.message_key("m1") == "m1"
    for bad in ("[]", '{"ids": 3}'):
        try:
            a2a.MessageIds.loads(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


# -- the host lost ----------------------------------------------------------------------------


@tool(name="slow")
async def slow(key: str) -> str:
    """Look ``key`` up, slowly."""
    return f"value of {key}"


def lost_script() -> list[ScriptStep]:
    return [Reply(blocks=(tool_call("c1", "slow", key="a"),)), Reply(blocks=(text("Done."),))]


async def test_the_host_lost_note_is_not_the_users_words_in_the_history(
    tmp_path: Path,
) -> None:
    """R-PROTO-1, R-CLUSTER-2: a task whose host stopped while its call ran is taken up
    with the runtime's note that the host was lost. ``tasks/get`` showed that note as a
    message of the user; it is the agent's side (a status note) now, and the user's
    messages are the user's words alone."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lost_script, tools=[slow], approve="all", a2a=True) as server:
            go = await with_the_sdk(
                server, lambda client: collect(client.send_message(said("go", "m-go")))
            )
            task = go[-1].task if go[-1].HasField("task") else go[0].task
            session = server.host.get_session(task.context_id)
            await session.wait_idle()
            trace = session.trace_path
    # The host stopped right after the call was allowed: it was running.
    cut_after(trace, lambda record: record["type"] == "approval_decision")

    steps: Sequence[ScriptStep] = [Reply(blocks=(text("Carried on."),))]
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lost_script, tools=[slow], approve="all", a2a=True) as server:
            resumed = await server.host.resume(
                task.context_id, provider=ScriptedProvider(steps), tools=[slow], approve=allow_all
            )
            await resumed.wait_idle()
            lines = [line for line in resumed.trace_path.read_text().splitlines() if line]
            assert any("[host lost]" in line for line in lines)  # the note was given
            got = await with_the_sdk(
                server, lambda client: client.get_task(GetTaskRequest(id=task.id))
            )
    assert got.status.state == TaskState.TASK_STATE_COMPLETED
    users = [[p.text for p in m.parts if p.text] for m in got.history if m.role == Role.ROLE_USER]
    assert users == [["go"]], users
    notes = [
        p.text
        for m in got.history
        if m.role == Role.ROLE_AGENT
        for p in m.parts
        if p.text and "host" in p.text
    ]
    assert notes == [a2a.HOST_LOST_NOTE]
    assert HOST_LOST_CONTINUATION not in str(got.history)
