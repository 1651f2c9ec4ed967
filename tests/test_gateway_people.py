"""People answer through the gateway (R-HITL-1, R-HITL-2, R-HITL-5): ``approvals.list``,
``approve`` and ``answer`` over a real websocket client against a gateway in this process,
scripted models. A request waits in the trace; the caller sees and answers only its own
sessions' requests; an answer for a call that is no longer pending, or for other arguments
than the person saw, is refused with 409 and changes nothing; a session whose host was
closed and opened again is answered like one in memory.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import Lookup, answer_meeting_a_close, hold_after_first
from test_client_tools import PICK
from test_gateway import (
    ALICE,
    BOB,
    BOUND_S,
    TOKEN,
    Client,
    Server,
    connect,
    lookup_brain,
    lookup_script,
    serving,
)
from test_people import until_parked

import greenroom.actors.runtime.provider_clients as provider_clients
from greenroom.actors.gateway import Gateway, SessionDefaults
from greenroom.actors.gateway.hubs import replay_records
from greenroom.actors.gateway.nodes import Nodes
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, ScriptStep, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.runtime.supervisor import SessionSupervisor
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolResult
from greenroom.protocols.messages import PersonAnswered, SupervisorMessage
from greenroom.protocols.outputs import ApprovalDecision, TaskEnd
from greenroom.protocols.people import arguments_digest

TWO = {"alice": ALICE, "bob": BOB}


async def until_asked(client: Client, session_id: str, prompt: str = "go") -> dict[str, Any]:
    """Subscribe, run ``prompt`` and return the ``approval_request`` it leads to."""
    await client.result("session.subscribe", {"session_id": session_id})
    await client.result("run", {"session_id": session_id, "input": prompt})
    return (await client.outputs_until("approval_request"))[-1]


async def test_approvals_list_approve_and_stale_answers(tmp_path: Path, lookup: Lookup) -> None:
    """The caller's pending request is listed with what a person needs to decide it; a
    digest of other arguments is refused and leaves it pending; the right one answers it
    as the caller's principal; a second answer finds nothing pending (409)."""
    asked_after = time.time()
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool], tokens=TWO) as server,
            connect(server, token=ALICE) as alice,
        ):
            sid = (await alice.result("session.create"))["session_id"]
            request = await until_asked(alice, sid)
            digest = arguments_digest({"key": "a"})
            listed = (await alice.result("approvals.list"))["approvals"]
            assert listed == [
                {
                    "session_id": sid,
                    "call_id": "c1",
                    "tool": "lookup",
                    "arguments": {"key": "a"},
                    "asked_at": request["asked_at"],
                    "origin": [sid],
                    "kind": "approval",
                    "digest": digest,
                }
            ]
            assert asked_after <= listed[0]["asked_at"] <= time.time()
            only = await alice.result("approvals.list", {"session_id": sid})
            assert only["approvals"] == listed

            allow = {"session_id": sid, "call_id": "c1", "decision": "allow"}
            stale = await alice.error(
                "approve", {**allow, "digest": arguments_digest({"key": "b"})}
            )
            assert stale["code"] == 409 and "other arguments" in stale["message"]
            assert (await alice.result("approvals.list"))["approvals"] == listed
            assert lookup.calls == []

            allow["digest"] = digest
            assert await alice.result("approve", allow) == {}
            after = await alice.outputs_until("task_end")
            (decision,) = [o for o in after if o["type"] == "approval_decision"]
            assert (decision["decision"], decision["by"], decision["principal"]) == (
                "allow",
                "client",
                "alice",
            )
            assert after[-1]["status"] == "completed" and lookup.calls == ["a"]
            assert (await alice.result("approvals.list"))["approvals"] == []
            again = await alice.error("approve", allow)
            assert again["code"] == 409 and "waits for no answer" in again["message"]
            assert lookup.calls == ["a"]


async def test_an_answer_after_an_interrupt_is_refused_and_records_nothing(
    tmp_path: Path, lookup: Lookup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HITL-2, R-ABORT-1: an approve sent right behind an interrupt (one batch, done in
    order) was answered ``{}`` and recorded as alice's allow, though the interrupt had been
    answered and the call was then settled as interrupted, never run. It waits for no
    answer once its task is told to stop: 409, and no decision of hers in the trace. The
    woken task's supervisor is held until the answer reaches it, so that it finds the
    interrupt and the answer both in its inbox, as a busy host can."""
    answer_sent = trio.Event()
    deliver = SessionPort.deliver
    run = SessionSupervisor.run

    def delivering(port: SessionPort, message: SupervisorMessage) -> bool:
        taken = deliver(port, message)
        if isinstance(message, PersonAnswered):
            answer_sent.set()
        return taken

    async def held(supervisor: SessionSupervisor, **kwargs: Any) -> None:
        await answer_sent.wait()
        await run(supervisor, **kwargs)

    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool], tokens=TWO) as server,
            connect(server, token=ALICE) as alice,
        ):
            sid = (await alice.result("session.create"))["session_id"]
            await until_asked(alice, sid)
            await until_parked(server.host, sid)
            monkeypatch.setattr(SessionPort, "deliver", delivering)
            monkeypatch.setattr(SessionSupervisor, "run", held)
            allow = {"session_id": sid, "call_id": "c1", "decision": "allow"}
            await alice.send(
                [
                    {"jsonrpc": "2.0", "id": 10, "method": "interrupt",
                     "params": {"session_id": sid}},
                    {"jsonrpc": "2.0", "id": 11, "method": "approve", "params": allow},
                ]
            )  # fmt: skip
            answers = await alice.receive()
            while isinstance(answers, dict):  # outputs before the batch's answers
                answers = await alice.receive()
            interrupted, approved = answers
            assert interrupted["result"] == {"interrupted": True}
            assert approved["error"]["code"] == 409, approved
            assert "its task is ending (interrupted by client)" in approved["error"]["message"]
            records = await replay_records(server.host.get_session(sid), 0)
            decided = [r for r in records if isinstance(r, ApprovalDecision)]
            assert [d for d in decided if d.by == "client"] == []
            assert [r.status for r in records if isinstance(r, TaskEnd)] == ["aborted"]
            assert lookup.calls == []


async def test_another_principal_neither_sees_nor_answers(tmp_path: Path, lookup: Lookup) -> None:
    """R-SEC-4: bob's list leaves alice's request out; naming her session in
    approvals.list, approve or answer is 403, an unknown session 404; her request is still
    pending afterwards."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool], tokens=TWO) as server,
            connect(server, token=ALICE) as alice,
            connect(server, token=BOB) as bob,
        ):
            sid = (await alice.result("session.create"))["session_id"]
            await until_asked(alice, sid)
            assert await bob.result("approvals.list") == {"approvals": []}
            for method, params in [
                ("approvals.list", {}),
                ("approve", {"call_id": "c1", "decision": "allow"}),
                ("answer", {"call_id": "c1", "text": "yes"}),
            ]:
                error = await bob.error(method, {"session_id": sid, **params})
                assert error["code"] == 403, (method, error)
            missing = await bob.error("approvals.list", {"session_id": "20990101-000000-abcdef"})
            assert missing["code"] == 404
            (still,) = (await alice.result("approvals.list"))["approvals"]
            assert still["call_id"] == "c1" and lookup.calls == []


def question_script() -> list[ScriptStep]:
    return [
        Reply(
            blocks=(
                tool_call("q1", "ask_user", question="Which color?", choices=["red", "blue"]),
            )
        ),
        Reply(blocks=(text("Blue it is."),)),
    ]


async def test_a_question_is_listed_and_answered_with_text(tmp_path: Path) -> None:
    """R-HITL-5: an ask_user call is a request of kind question, answered with ``answer``:
    a decision or a text outside the choices is refused (409); the text is the call's
    result; a second answer is refused."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, question_script, tools=[ask_user]) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            request = await until_asked(client, sid, "paint it")
            assert request["kind"] == "question"
            (listed,) = (await client.result("approvals.list"))["approvals"]
            assert (listed["kind"], listed["tool"]) == ("question", "ask_user")
            assert listed["arguments"] == {"question": "Which color?", "choices": ["red", "blue"]}

            decided = await client.error(
                "approve", {"session_id": sid, "call_id": "q1", "decision": "allow"}
            )
            assert decided["code"] == 409 and "answer it with text" in decided["message"]
            outside = await client.error(
                "answer", {"session_id": sid, "call_id": "q1", "text": "green"}
            )
            assert outside["code"] == 409 and "choose one of" in outside["message"]
            empty = await client.error("answer", {"session_id": sid, "call_id": "q1", "text": ""})
            assert empty["code"] == -32602 and "$.text" in empty["message"]

            answer = {"session_id": sid, "call_id": "q1", "text": "blue"}
            assert await client.result("answer", answer) == {}
            after = await client.outputs_until("task_end")
            (result,) = [o for o in after if o["type"] == "tool_call_output"]
            assert (result["status"], result["content"]) == (
                "ok",
                [{"type": "text", "text": "blue"}],
            )
            assert after[-1]["status"] == "completed"
            assert (await client.error("answer", answer))["code"] == 409
            (provider,) = server.providers
            assert "blue" in repr(provider.requests[-1].messages[-1])


async def test_approve_after_the_host_was_closed_and_opened_again(
    tmp_path: Path, lookup: Lookup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HITL-1, R-HITL-2: the host (and its gateway) stop while a request waits; a new
    host on the data dir takes the task up and a new gateway grants the session to its
    creator again: the client lists the request and approves it, the tool runs once."""
    made: list[ScriptedProvider] = []

    def provider(*_: Any) -> ScriptedProvider:
        # One per host: the first host's asks for the call, the second one's answers.
        script = lookup_script()
        made.append(ScriptedProvider(script if not made else script[1:]))
        return made[-1]

    # Sessions the host loads on its own get their provider from their settings' name.
    monkeypatch.setattr(provider_clients, "make_provider", provider)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    defaults = SessionDefaults(provider="scripted", tools=[lookup.tool], workspace_dir=workspace)

    async def serve(host: Host, nursery: trio.Nursery) -> Server:
        gateway = Gateway(host, token=TOKEN, port=0, defaults=defaults)
        await nursery.start(gateway.run)
        return Server(host=host, gateway=gateway, providers=made)

    with trio.fail_after(BOUND_S):
        async with (
            Host.open(tmp_path / "data", tools=[lookup.tool]) as host,
            trio.open_nursery() as nursery,
        ):
            async with connect(await serve(host, nursery)) as client:
                sid = (await client.result("session.create"))["session_id"]
                await until_asked(client, sid)
            nursery.cancel_scope.cancel()
        assert lookup.calls == []
        async with (
            Host.open(tmp_path / "data", tools=[lookup.tool], resume_tasks=True) as host,
            trio.open_nursery() as nursery,
        ):
            async with connect(await serve(host, nursery)) as client:
                (listed,) = (await client.result("approvals.list"))["approvals"]
                assert (listed["session_id"], listed["call_id"]) == (sid, "c1")
                (entry,) = (await client.result("session.list"))["sessions"]
                assert entry["state"] == "waiting_for_approval"
                await client.result("session.subscribe", {"session_id": sid})
                await client.result(
                    "approve", {"session_id": sid, "call_id": "c1", "decision": "allow"}
                )
                after = await client.outputs_until("task_end")
                assert after[-1]["status"] == "completed"
            nursery.cancel_scope.cancel()
    assert lookup.calls == ["a"]
    assert all(p.violations == [] for p in made)


def question_brain() -> ScriptStep:
    """A model that asks which color (``q1``) and, once answered, says ``Blue it is.``."""

    def brain(request: ModelRequest) -> Reply:
        if any(isinstance(p, ToolResult) for p in request.messages[-1].content):
            return Reply(blocks=(text("Blue it is."),))
        return Reply(blocks=(tool_call("q1", "ask_user", question="Which color?"),))

    return brain


@pytest.mark.parametrize("stage", ["closing", "closed"])
@pytest.mark.parametrize("method", ["approve", "answer"])
async def test_an_answer_whose_session_began_to_close_once_it_was_found_is_taken_there_again(
    tmp_path: Path, lookup: Lookup, monkeypatch: pytest.MonkeyPatch, method: str, stage: str
) -> None:
    """R-HITL-1, R-HOST-3: an ``approve`` (or ``answer``) that found its request pending,
    and came to the host once the host had begun to close the session (or had closed it),
    had the host load the session with the host's own tools and model: the approved call
    failed as an unknown tool (the answered question went to the host's default model).
    The session is loaded as any call on a closed session loads it (the server's tools and
    model): the tool runs once, the server's model answers, the task completes."""
    approving = method == "approve"
    brain, tool = (lookup_brain, lookup.tool) if approving else (question_brain, ask_user)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, brain, tools=[tool]) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            request = await until_asked(client, sid)
            # Found once the request was found pending: the call answers it.
            found, let_answer = hold_after_first(monkeypatch, Nodes, "asked_in")

            async def send_the_answer() -> None:
                params = {"session_id": sid, "call_id": request["call_id"]}
                params |= {"decision": "allow"} if approving else {"text": "blue"}
                assert await client.result(method, params) == {}

            await answer_meeting_a_close(
                monkeypatch, server.host, sid, send_the_answer, found, let_answer, stage=stage
            )
            dropped = await client.notification()  # the closed session's subscription
            assert dropped["params"]["reason"] == "session closed", dropped
            after_seq = {"session_id": sid, "after_seq": request["seq"]}
            await client.result("session.subscribe", after_seq)
            after = await client.outputs_until("task_end")
            (decision,) = [o for o in after if o["type"] == "approval_decision"]
            assert (decision["call_id"], decision["principal"]) == (request["call_id"], "default")
            (result,) = [o for o in after if o["type"] == "tool_call_output"]
            assert not result["is_error"], result
            said = [b["text"] for o in after if o["type"] == "model_msg" for b in [o["block"]]]
            assert said == ["Done." if approving else "Blue it is."], said
            assert after[-1]["status"] == "completed"
            assert lookup.calls == (["a"] if approving else [])


async def test_listing_loads_no_session_and_answers_run_with_the_servers_tools(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-HITL-1, R-HITL-2: ``approvals.list`` loaded every stored session whose task waits
    with the host's own tools and model (and ``approve`` looked up where its request waits
    the same way, loading the others): an approval answered afterwards ran in that session
    and the call failed as an unknown tool. The listing reads the traces and loads nothing;
    each answer loads its session with the server's tools: the tool runs, no error."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, lookup_brain, tools=[lookup.tool]) as server:
            async with connect(server) as first:
                sids = [(await first.result("session.create"))["session_id"] for _ in "ab"]
                asked = {sid: await until_asked(first, sid) for sid in sids}
            for sid in sids:  # each task waits in its trace only
                await server.host.close_session(sid)
            async with connect(server) as client:
                listed = (await client.result("approvals.list"))["approvals"]
                assert sorted((p["session_id"], p["call_id"]) for p in listed) == sorted(
                    (sid, "c1") for sid in sids
                )
                assert [s.id for s in server.host.sessions] == []  # nothing loaded to list
                for sid in sids:
                    allow = {"session_id": sid, "call_id": "c1", "decision": "allow"}
                    assert await client.result("approve", allow) == {}
                    after_seq = {"session_id": sid, "after_seq": asked[sid]["seq"]}
                    await client.result("session.subscribe", after_seq)
                    after = await client.outputs_until("task_end")
                    (result,) = [o for o in after if o["type"] == "tool_call_output"]
                    assert not result["is_error"], result
                    assert after[-1]["status"] == "completed"
    assert lookup.calls == ["a", "a"]


def pick_then_look_brain(*, look_up_the_pick: bool) -> ScriptStep:
    """A model that asks its client for a color (``f1``, a client tool's call) and, once it
    has it, looks the color up (``l1``) or ends; a later input ``blue`` looks blue up
    (``l2``)."""

    def brain(request: ModelRequest) -> Reply:
        last = request.messages[-1].content
        results = {p.call_id for p in last if isinstance(p, ToolResult)}
        if "f1" in results and look_up_the_pick:
            return Reply(blocks=(tool_call("l1", "lookup", key="orange"),))
        if results:
            return Reply(blocks=(text("Found."),))
        if any(isinstance(p, TextBlock) and p.text == "blue" for p in last):
            return Reply(blocks=(tool_call("l2", "lookup", key="blue"),))
        return Reply(blocks=(tool_call("f1", "pick_color", hint="warm"),))

    return brain


async def until_two_ends_or_a_wait(client: Client) -> list[dict[str, Any]]:
    """The outputs up to the second ``task_end``, or to a request for a call other than
    the client tool's (a call that waits for a person nobody asks)."""
    outputs: list[dict[str, Any]] = []
    while sum(o["type"] == "task_end" for o in outputs) < 2:
        outputs.append(await client.output())
        if outputs[-1]["type"] == "approval_request" and outputs[-1]["call_id"] != "f1":
            break
    return outputs


@pytest.mark.parametrize("look_up_the_pick", [True, False])
async def test_a_session_an_answer_loads_again_decides_its_calls_as_approve_says(
    tmp_path: Path, lookup: Lookup, look_up_the_pick: bool
) -> None:
    """R-HITL-1, R-HITL-4, R-HOST-3: under ``--approve all``, a task parked on a client
    tool's call with a follow-up queued behind it (recorded ``approve: host``), its session
    closed: the ``answer`` that loads the session again took the task up under
    ``"people"``, its next ordinary call (or, when it has none, the follow-up's) waiting
    for a person nobody asked. Loaded as the server's tasks decide their calls, each is
    allowed by the server (``by: host``) and both tasks complete."""
    brain = partial(pick_then_look_brain, look_up_the_pick=look_up_the_pick)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, brain, tools=[lookup.tool], approve="all") as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            server.host.get_session(sid).set_client_tools([PICK])
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "pick one"})
            asked = (await client.outputs_until("approval_request"))[-1]
            assert asked["call_id"] == "f1"
            await until_parked(server.host, sid)
            # The refusal points a client at what it can call, not at Python's API.
            busy = await client.error("run", {"session_id": sid, "input": "again"})
            assert busy["code"] == 409 and "pending approvals" in busy["message"], busy
            assert "host." not in busy["message"], busy
            queued = await client.result("follow_up", {"session_id": sid, "input": "blue"})
            assert queued == {"queued": True}
            await server.host.close_session(sid)
            while (note := await client.notification())["method"] == "output":
                pass  # what the session did before its close
            assert note["params"]["reason"] == "session closed", note

            answer = {"session_id": sid, "call_id": "f1", "text": "orange"}
            assert await client.result("answer", answer) == {}
            await client.result("session.subscribe", {"session_id": sid, "after_seq": asked["seq"]})
            after = await until_two_ends_or_a_wait(client)
    waited = [o["call_id"] for o in after if o["type"] == "approval_request"]
    assert waited == [], f"waited for a person: {waited}"
    decided = [(o["call_id"], o["by"]) for o in after if o["type"] == "approval_decision"]
    looked_up = [("l1", "host")] if look_up_the_pick else []
    assert decided == [("f1", "client"), *looked_up, ("l2", "host")]
    assert [o["status"] for o in after if o["type"] == "task_end"] == ["completed"] * 2
    assert lookup.calls == (["orange"] if look_up_the_pick else []) + ["blue"]


def spawn_then_look() -> ScriptStep:
    """A parent that spawns a child, and a child that looks a key up."""

    def brain(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        answered = any(isinstance(p, ToolResult) for p in last.content)
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            if answered:
                return Reply(blocks=(text("child found it"),))
            return Reply(blocks=(tool_call("c1", "lookup", key="a"),))
        if answered:
            return Reply(blocks=(text("parent done"),))
        return Reply(blocks=(tool_call("s1", SPAWN_SUBAGENT, task="look a up"),))

    return brain


async def test_a_subagents_request_is_listed_and_answered_through_its_root(
    tmp_path: Path, lookup: Lookup
) -> None:
    """R-HOST-4, R-HITL-2: a request of a subagent is listed among its root's, with the
    child's id and the origin from the root; the client, who owns the root, answers it
    naming the root session."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, spawn_then_look, tools=[lookup.tool, spawn_subagent]) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            spawning = await until_asked(client, sid)
            assert spawning["call_id"] == "s1"
            spawn = {"session_id": sid, "call_id": "s1", "decision": "allow"}
            await client.result("approve", spawn)
            looking = await client.outputs_until("approval_request", call_id="c1")
            child = looking[-1]["session_id"]
            assert child != sid and looking[-1]["origin"] == [sid, child]
            (listed,) = (await client.result("approvals.list", {"session_id": sid}))["approvals"]
            assert (listed["session_id"], listed["origin"]) == (child, [sid, child])
            assert (await client.result("approvals.list"))["approvals"] == [listed]
            await client.result("approve", {**spawn, "call_id": "c1"})
            after = await client.outputs_until("task_end", session_id=sid)
            assert after[-1]["status"] == "completed"
    assert lookup.calls == ["a"]
