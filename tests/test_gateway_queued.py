"""The gateway's ``steer`` answers ``queued: true`` only for input that survives the host,
and tells a client whose input was dropped unrun so (R-STEER-1, R-STEER-6): a real server
and websocket clients (``test_gateway``'s harness), the orders forced with trio events."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import Gates, Lookup, hold_after_first, port_of, trace_lines
from test_gateway import BOUND_S, connect, lookup_script, serving
from test_gateway_people import until_asked
from test_people import until_parked

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.gateway.hubs import Hubs
from greenroom.actors.gateway.queue_room import QueueRoom
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptStep,
    text,
    tool_call,
)
from greenroom.actors.runtime import supervisor
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.runtime.running_task import RunningTask
from greenroom.actors.runtime.session import Session
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError
from greenroom.protocols.people import PEOPLE

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8


def steered_event(
    monkeypatch: pytest.MonkeyPatch,
    method: str = "steer",
    receipts: list[InputReceipt] | None = None,
) -> trio.Event:
    """Set once ``Session.steer`` (or ``follow_up``) has handed its input to the session
    (or refused it); the receipts it was given are added to ``receipts``."""
    steered = trio.Event()
    queue = getattr(Session, method)

    def handed_over(self: Session, messages: Any, **options: Any) -> bool:
        if receipts is not None:
            receipts.append(options["recorded"])
        try:
            return bool(queue(self, messages, **options))
        finally:
            steered.set()

    monkeypatch.setattr(Session, method, handed_over)
    return steered


@contextlib.asynccontextmanager
async def running_a_gated_task(
    tmp_path: Path, gates: Gates
) -> AsyncIterator[tuple[Any, Any, str]]:
    """A gateway whose session's task waits in its gated call ``a``: the server, a client
    connected to it, and the session's id."""
    async with (
        serving(tmp_path, gated_then_ok, tools=[gates.tool()], approve="all") as server,
        connect(server) as client,
    ):
        sid = (await client.result("session.create"))["session_id"]
        await client.result("run", {"session_id": sid, "input": "work"})
        await gates.started("a")
        yield server, client, sid


def hold_task_end(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """The first task's end waits, once written, until the test lets it go: while it
    waits, its supervisor reads no message. Returns (ending, let_end)."""
    ending, let_end = trio.Event(), trio.Event()
    sync_task_end = OutputEmitter.sync_task_end

    async def held(self: OutputEmitter, *, completed: bool) -> None:
        if not ending.is_set():
            ending.set()
            await let_end.wait()
        await sync_task_end(self, completed=completed)

    monkeypatch.setattr(OutputEmitter, "sync_task_end", held)
    return ending, let_end


def hold_after_read(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """The next call that reads its input's attachments (``Session.attach``) waits, once
    they are read, until the test lets it go on to hand the input over. Returns (read,
    let_go)."""
    return hold_after_first(monkeypatch, Session, "attach")


def hold_after_lookup(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """The next call that looks its session up (``Hubs.settled``, which ``steer`` and
    ``follow_up`` go through) waits, once it has the session, until the test lets it go on
    to count its place in the session's queue. Returns (found, let_go)."""
    return hold_after_first(monkeypatch, Hubs, "settled")


def gated_then_ok() -> list[ScriptStep]:
    """A task whose first turn calls the gated ``wait`` tool (key ``a``), then answers."""
    return [Reply(blocks=(tool_call("c1", "wait", key="a"),)), Reply(blocks=(text("ok"),))]


def closed_before_it_ran(session_id: str, method: str) -> str:
    """The 410 message of ``method``'s input sent to ``session_id`` as it closes."""
    what = "steering" if method == "steer" else "follow-up"
    return f"the input was dropped, not queued: session {session_id} closed before the {what} ran"


async def test_late_steering_is_answered_queued_once_recorded_not_when_its_task_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R-STEER-1, R-STEER-6: steering that reaches a task as it ends runs as a task of its
    # own. Nothing recorded it: the client was answered queued: true at once, and a host
    # that died before that task's prompt was written (its image still being read, say)
    # lost the words. It is recorded as that task (task_queued) before the answer now.
    ending, let_end = hold_task_end(monkeypatch)
    steered = steered_event(monkeypatch)
    reading, let_read = trio.Event(), trio.Event()
    attach_prompt = supervisor._attach_prompt

    async def slow_image(port: Any, content: Any) -> Any:
        reading.set()
        await let_read.wait()
        return await attach_prompt(port, content)

    monkeypatch.setattr(supervisor, "_attach_prompt", slow_image)

    def script() -> list[ScriptStep]:
        return [Reply(blocks=(text("One."),)), Reply(blocks=(text("Late."),))]

    late = [{"type": "text", "text": "LATE WORDS"}, {"type": "image", "path": "pic.png"}]
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            session = server.host.get_session(sid)
            (session.workspace_dir / "pic.png").write_bytes(PNG)
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "one"})
            await ending.wait()
            await client.send(
                {"jsonrpc": "2.0", "id": "late", "method": "steer",
                 "params": {"session_id": sid, "input": late}}
            )
            # The steering waits in the inbox of the supervisor whose task is ending.
            await steered.wait()
            let_end.set()
            answer = await client.response("late")
            assert answer["result"] == {"queued": True}
            # What a host that died now would leave: the words, recorded to run.
            queued = [r for r in trace_lines(session) if r["type"] == "task_queued"]
            assert [q["content"][0]["text"] for q in queued] == ["LATE WORDS"]
            await reading.wait()  # the late task has begun: its prompt is not written yet
            let_read.set()
            outputs = await client.outputs_until("task_end", status="completed")
            outputs += await client.outputs_until("task_end", status="completed")
            prompts = [o for o in outputs if o["type"] == "user_msg"]
            assert prompts[-1]["queued_id"] == queued[0]["queue_id"]
            assert prompts[-1]["content"][0]["text"] == "LATE WORDS"


async def test_late_steering_counts_against_the_steering_cap_while_it_waits_as_a_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gates: Gates
) -> None:
    # R-SEC-9, R-STEER-1, R-STEER-6: a steer that comes too late for its task waits as a
    # task of its own. The cap counted it as steering until the machine took it, then as
    # a follow-up: a client that had queued no follow-up got 429 "too many follow-ups",
    # and a second steer passed the steering cap. It counts as the steer it was now.
    ending, let_end = hold_task_end(monkeypatch)
    followed = steered_event(monkeypatch, "follow_up")
    steered = steered_event(monkeypatch, "steer")

    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(text("One."),)),
            Reply(blocks=(tool_call("c1", "wait", key="b"),)),
            Reply(blocks=(text("Followed."),)),
            Reply(blocks=(text("Late."),)),
        ]

    limits = GatewayLimits(max_queued_inputs=1)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, script, tools=[gates.tool()], approve="all", limits=limits)
            as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("run", {"session_id": sid, "input": "one"})
            await ending.wait()
            # Both wait in the inbox of the supervisor whose task is ending: the follow-up
            # is queued first, and the steering, too late, as a task behind it.
            for method, done in (("follow_up", followed), ("steer", steered)):
                await client.send(
                    {"jsonrpc": "2.0", "id": method, "method": method,
                     "params": {"session_id": sid, "input": method.upper()}}
                )
                await done.wait()
            let_end.set()
            answers = [await client.receive(), await client.receive()]  # in either order
            assert {a["id"]: a["result"] for a in answers} == {
                "follow_up": {"queued": True}, "steer": {"queued": True}
            }
            await gates.started("b")  # the follow-up runs; the late steering waits
            machine = server.host.port(sid).machine
            assert [t.content[0].text for t in machine.queued_tasks] == ["STEER"]
            refused = await client.error("steer", {"session_id": sid, "input": "more"})
            assert refused["code"] == jsonrpc.TOO_MANY_REQUESTS, refused
            assert f"too many steering queued in session {sid!r} (at most 1)" in (
                refused["message"]
            )
            queued = await client.result("follow_up", {"session_id": sid, "input": "next"})
            assert queued == {"queued": True}
            gates.release("b")


async def test_follow_ups_a_loaded_session_holds_in_its_trace_count_against_the_cap(
    host: Host, workspace: Path, gates: Gates
) -> None:
    # R-SEC-9, R-HOST-3: a session loaded again holds the follow-ups its trace queued in
    # its record alone until its task wakes (a parked one: until a person answers). The
    # cap counted none of them, so every load let a client queue the cap again.
    script = ScriptedProvider([Reply(blocks=(tool_call("c1", "wait", key="b"),))])
    session = await host.create_session(
        provider=script, tools=[gates.tool()], workspace_dir=workspace
    )
    session.run("one", approve=PEOPLE).detach()
    await until_parked(host, session.id)
    room = QueueRoom(cap=2)
    for words in ("F1", "F2"):
        place = room.reserve(session, "follow-ups")
        assert session.follow_up(words, approve=PEOPLE, recorded=place)
    await trio.testing.wait_all_tasks_blocked()
    await host.close_session(session.id)

    loaded = await host.load_session(session.id, tools=[gates.tool()], provider=script)
    assert host.port(loaded.id).parked
    with pytest.raises(RpcError) as refused:
        room.reserve(loaded, "follow-ups")
    assert refused.value.code == jsonrpc.TOO_MANY_REQUESTS
    room.reserve(loaded, "steering")  # steering has its own places


@pytest.mark.parametrize("method", ["steer", "follow_up"])
async def test_input_for_a_closing_session_is_told_it_was_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gates: Gates, method: str
) -> None:
    # R-STEER-1, R-STEER-6, R-HOST-3: input that reaches a session being closed never
    # runs: its task is interrupted, and a closed session starts none. The client was
    # answered queued: true all the same (a follow-up even ran, in the closed session);
    # it now gets error 410 saying the input was dropped.
    ending, let_end = hold_task_end(monkeypatch)
    steered = steered_event(monkeypatch, method)
    with trio.fail_after(BOUND_S):
        async with (
            running_a_gated_task(tmp_path, gates) as (server, client, sid),
            trio.open_nursery() as nursery,
        ):
            # The input is read before the session closes; the call goes on after.
            read, let_input_go = hold_after_read(monkeypatch)
            await client.send(
                {"jsonrpc": "2.0", "id": "dropped", "method": method,
                 "params": {"session_id": sid, "input": "TOO LATE"}}
            )
            await read.wait()
            # The host closes the session (as a cluster node that hands it over does).
            nursery.start_soon(server.host.close_session, sid)
            await ending.wait()  # interrupted by the close: its task is ending
            let_input_go.set()
            # The steering waits in the inbox of the supervisor whose task is ending.
            await steered.wait()
            let_end.set()
            answer = await client.response("dropped")
            assert answer["error"]["code"] == jsonrpc.GONE == 410, answer
            assert "dropped" in answer["error"]["message"]
            kind = "steering" if method == "steer" else "follow-ups"
            assert server.gateway._calls.queue_room.pending(sid, kind) == 0  # R-SEC-9
            await server.host.close_session(sid)  # waits for the session's work to end
            assert len(server.providers[0].requests) == 1  # the words reached no model


@pytest.mark.parametrize("method", ["steer", "follow_up"])
async def test_input_left_in_the_inbox_of_a_closing_session_is_told_it_was_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lookup: Lookup, method: str
) -> None:
    # R-STEER-1, R-STEER-6, R-HOST-3: input that reaches a supervisor after its last look
    # at its inbox (its task parking, waiting for a person) is passed on to the session's
    # next supervisor; when the session closed meanwhile there is none, the input never
    # runs, and its client is answered 410 (not queued: true) at once.
    parking, let_park = trio.Event(), trio.Event()
    park = RunningTask.park

    async def held_park(self: RunningTask, *args: Any) -> Any:
        parking.set()
        await let_park.wait()
        return await park(self, *args)

    monkeypatch.setattr(RunningTask, "park", held_park)
    receipts: list[InputReceipt] = []
    steered = steered_event(monkeypatch, method, receipts)
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool]) as server,
            connect(server) as client,
            trio.open_nursery() as nursery,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await until_asked(client, sid)
            await parking.wait()  # the supervisor has looked at its inbox for the last time
            await client.send(
                {"jsonrpc": "2.0", "id": "left", "method": method,
                 "params": {"session_id": sid, "input": "TOO LATE"}}
            )
            await steered.wait()  # in the inbox, which nobody reads any more
            closed = trio.Event()

            async def close() -> None:
                await server.host.close_session(sid)
                closed.set()

            port = port_of(server.host.get_session(sid))
            nursery.start_soon(close)
            await trio.testing.wait_all_tasks_blocked()
            assert port.closed and not closed.is_set()  # closed, not yet idle
            let_park.set()
            await closed.wait()
            [receipt] = receipts
            assert receipt.dropped == f"session {sid} stopped before its input was recorded"
            answer = await client.response("left")
            assert answer["error"]["code"] == jsonrpc.GONE == 410, answer
            assert "the input was dropped, not queued" in answer["error"]["message"]
            kind = "steering" if method == "steer" else "follow-ups"
            assert server.gateway._calls.queue_room.pending(sid, kind) == 0
            assert len(server.providers[0].requests) == 1  # the words reached no model
            assert lookup.calls == []


@pytest.mark.parametrize("stage", ["closing", "closed"])
@pytest.mark.parametrize("method", ["steer", "follow_up"])
async def test_input_for_a_session_whose_close_began_once_it_was_found_is_answered_410(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gates: Gates, method: str, stage: str
) -> None:
    # R-STEER-1, R-STEER-6, R-HOST-3: a call that found its session open, and came to
    # count its place once the host had begun to close the session (its task still
    # ending, or over), was answered 404 "not open in this host": the host lists a
    # closing session no more. The same input a moment later got 410. Now both get 410,
    # in the words the closing supervisor drops input with, and no place stays taken.
    ending, let_end = hold_task_end(monkeypatch)
    with trio.fail_after(BOUND_S):
        async with (
            running_a_gated_task(tmp_path, gates) as (server, client, sid),
            trio.open_nursery() as nursery,
        ):
            found, let_count = hold_after_lookup(monkeypatch)
            await client.send(
                {"jsonrpc": "2.0", "id": "late", "method": method,
                 "params": {"session_id": sid, "input": "TOO LATE"}}
            )
            await found.wait()
            closed = trio.Event()

            async def close() -> None:
                await server.host.close_session(sid)
                closed.set()

            nursery.start_soon(close)
            await ending.wait()  # the close interrupted the task, whose end waits
            if stage == "closed":
                let_end.set()
                await closed.wait()
            let_count.set()
            answer = await client.response("late")
            assert answer["error"]["code"] == jsonrpc.GONE == 410, answer
            assert answer["error"]["message"] == closed_before_it_ran(sid, method)
            kind = "steering" if method == "steer" else "follow-ups"
            assert server.gateway._calls.queue_room.pending(sid, kind) == 0  # R-SEC-9
            let_end.set()
            await closed.wait()
            assert len(server.providers[0].requests) == 1  # the words reached no model


@pytest.mark.parametrize("method", ["steer", "follow_up"])
async def test_input_for_a_session_closed_while_the_input_is_read_is_answered_410(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gates: Gates, method: str
) -> None:
    # R-STEER-1, R-STEER-6, R-HOST-3: the host closed the session, its task over, while
    # the call read its input: the closed session had no task, and the client was told
    # queued: false (start a task instead). It is told 410 now, as for input the
    # session's close drops, and no place stays taken.
    with trio.fail_after(BOUND_S):
        async with running_a_gated_task(tmp_path, gates) as (server, client, sid):
            read, let_go = hold_after_read(monkeypatch)
            await client.send(
                {"jsonrpc": "2.0", "id": "late", "method": method,
                 "params": {"session_id": sid, "input": "TOO LATE"}}
            )
            await read.wait()
            await server.host.close_session(sid)
            let_go.set()
            answer = await client.response("late")
            assert answer["error"]["code"] == jsonrpc.GONE == 410, answer
            assert answer["error"]["message"] == closed_before_it_ran(sid, method)
            kind = "steering" if method == "steer" else "follow-ups"
            assert server.gateway._calls.queue_room.pending(sid, kind) == 0  # R-SEC-9
            assert len(server.providers[0].requests) == 1  # the words reached no model
