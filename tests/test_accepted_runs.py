"""A run, once accepted, happens even if its host stops before starting it (R-TRACE-3,
R-CLUSTER-2, R-HITL-4).

The prompt is durable before ``task_start`` is written. A host that stops between the two
leaves a trace that ends in the prompt: whoever takes the session up starts that task (its
``task_start`` names the prompt's ``seq`` and carries its ``output_schema``), and a fork
or rewind that cuts the history there settles it as an interrupt would. The gateway's
``run`` answers only once the prompt is durable, so a client told ``{run_id}`` is never
left waiting for a run no host will start.

The stop is simulated as in ``tests/test_recovery.py``: the session's files are copied
while the prompt's fsync is held, and the copy is taken up by a second host.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, cut_after, open_host, port_of, trace_lines
from support.disks import FaultyDisk
from test_gateway import connect, serving
from test_recovery import copy_session

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.trace_store import FileTraceStore
from greenroom.protocols.content import TextBlock
from greenroom.protocols.outputs import TaskEnd, TaskStart, UserMsg
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.task import fold
from greenroom.protocols.time_travel import settlement

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def prompt(seq: int, run_id: str = "run_a", schema: Any = None) -> UserMsg:
    return UserMsg(session_id="s", run_id=run_id, seq=seq, kind="prompt",
                   content=(TextBlock(text="hi"),), output_schema=schema)


def ended(seq: int, run_id: str) -> Iterator[Any]:
    yield TaskStart(session_id="s", run_id=run_id, seq=seq, input_seq=seq - 1)
    yield TaskEnd(session_id="s", run_id=run_id, seq=seq + 1, status="completed", turns=0,
                  usage=TokenUsage(), wall_ms=0)


# -- the fold -----------------------------------------------------------------------------------


def test_a_trace_that_ends_in_a_prompt_holds_a_run_to_start() -> None:
    machine = fold([*ended(2, "run_0"), prompt(4, schema=SCHEMA)])
    assert machine.run_id is None  # the fold is the trace: no task started
    assert machine.record.unstarted is not None and machine.record.unstarted.seq == 4
    assert machine.adopt_unstarted()
    assert (machine.run_id, machine.record.answers is not None) == ("run_a", True)
    assert not machine.adopt_unstarted()  # a task is open now


@pytest.mark.parametrize(
    "records",
    [
        [prompt(1), *ended(2, "run_a")],  # its task started (and ended)
        [],
        [*ended(2, "run_0")],
    ],
)
def test_no_run_to_start_when_the_prompt_has_its_task(records: list[Any]) -> None:
    machine = fold(records)
    assert machine.record.unstarted is None
    assert not machine.adopt_unstarted()


def test_a_cut_that_leaves_a_prompt_settles_it_as_an_interrupt_would() -> None:
    """A fork or rewind to a prompt's seq: task_start, abort, task_end(aborted) — nothing
    left for a host to start later, and no usage or turns of the task before it."""
    machine = fold([*ended(2, "run_0"), prompt(4, schema=SCHEMA)])
    settled = settlement(machine.record, (), session_id="s", reason="forked")
    assert [o.TYPE for o in settled] == ["task_start", "abort", "task_end"]
    start, _, end = settled
    assert isinstance(start, TaskStart) and isinstance(end, TaskEnd)
    assert (start.run_id, start.input_seq, start.output_schema) == ("run_a", 4, SCHEMA)
    assert (end.run_id, end.status, end.turns, end.message) == ("run_a", "aborted", 0, "forked")
    for output in settled:
        machine.observe(output)
    assert machine.record.unstarted is None and machine.run_id is None


# -- a host that stops between the prompt and its task --------------------------------------------


@pytest.fixture
def disk() -> FaultyDisk:
    return FaultyDisk()


async def stop_after_the_prompt(
    data_dir: Path, workspace: Path, copy_to: Path, disk: FaultyDisk, **run: Any
) -> str:
    """Run a prompt in a host whose disk holds the prompt's fsync; copy the session's
    files then (its trace ends in the prompt) into ``copy_to``. Returns the session id."""
    async with Host.open(data_dir, trace_store=lambda d: FileTraceStore(d, disk=disk)) as host:
        provider = ScriptedProvider([Reply(blocks=(text("never asked"),))])
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        disk.stall(session.trace_path)
        session.run("weather in Lyon?", **run).detach()
        with trio.fail_after(RUN_TIMEOUT_S):
            await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
        assert [r["type"] for r in trace_lines(session)] == ["user_msg"]
        copy_session(session, copy_to)
        assert provider.requests == []
        disk.release()
        await session.wait_idle()
    return session.id


async def test_a_run_whose_host_stopped_before_its_task_started_is_started(
    data_dir: Path, workspace: Path, tmp_path: Path, disk: FaultyDisk
) -> None:
    """R-CLUSTER-2, R-HITL-4: the next host lists the session as open work, starts the
    prompt's task with its schema, and the model gets the prompt once; the answer is held
    to the schema."""
    copy = tmp_path / "copy"
    sid = await stop_after_the_prompt(data_dir, workspace, copy, disk, output_schema=SCHEMA)
    provider = ScriptedProvider([Reply(blocks=(text(json.dumps({"city": "Lyon"})),))])
    async with open_host(copy) as host:
        with trio.fail_after(RUN_TIMEOUT_S):
            assert await host.resume_tasks() == [sid]
            session = await host.load_session(sid)
            port_of(session).provider = provider
            await session.wait_idle()
        lines = trace_lines(session)
    assert [line["type"] for line in lines][:3] == ["user_msg", "task_start", "request_begin"]
    prompt_line, start = lines[0], lines[1]
    assert start["run_id"] == prompt_line["run_id"]
    assert (start["input_seq"], start["output_schema"]) == (prompt_line["seq"], SCHEMA)
    end = lines[-1]
    assert (end["type"], end["status"], end["output"]) == ("task_end", "completed",
                                                          {"city": "Lyon"})
    assert [line["type"] for line in lines].count("user_msg") == 1
    (request,) = provider.requests
    (message,) = request.messages  # the prompt, once
    assert [b.text for b in message.content if isinstance(b, TextBlock)] == ["weather in Lyon?"]


async def test_a_stopped_run_is_started_by_resume_with_the_hosts_approval(
    data_dir: Path, workspace: Path, tmp_path: Path, disk: FaultyDisk
) -> None:
    """``Host.resume`` starts the task too (as a cluster takeover does), and a session
    whose trace ends in a task that started is not started again."""
    copy = tmp_path / "copy"
    sid = await stop_after_the_prompt(data_dir, workspace, copy, disk)
    provider = ScriptedProvider([Reply(blocks=(text("sunny"),))])
    async with open_host(copy) as host:
        with trio.fail_after(RUN_TIMEOUT_S):
            session: Session = await host.resume(sid, provider=provider)
            await session.wait_idle()
            again = await host.resume(sid, provider=provider)
            await again.wait_idle()
        types = [line["type"] for line in trace_lines(session)]
    assert types.count("task_start") == types.count("task_end") == 1
    assert len(provider.requests) == 1


async def test_a_fork_at_a_prompt_whose_task_never_started_settles_it(
    data_dir: Path, workspace: Path, tmp_path: Path, disk: FaultyDisk
) -> None:
    """R-FORK-1: forking the stopped session at its prompt gives a branch whose task is
    settled (aborted, the prompt carried over) — the branch is not open work for a host
    to start."""
    copy = tmp_path / "copy"
    sid = await stop_after_the_prompt(data_dir, workspace, copy, disk)
    async with open_host(copy) as host:
        with trio.fail_after(RUN_TIMEOUT_S):
            branch = await host.fork_session(sid, at_seq=1)
            lines = trace_lines(branch)
            assert [line["type"] for line in lines] == [
                "user_msg", "task_start", "abort", "task_end"
            ]
            assert lines[-1]["status"] == "aborted"
            assert await host.resume_tasks() == [sid]  # the source, not the branch


# -- the gateway's answer -------------------------------------------------------------------------


async def test_run_answers_once_its_prompt_is_durable(tmp_path: Path) -> None:
    """R-TRACE-3, R-CLUSTER-2: while the prompt's fsync is held, ``run`` has not answered
    (a client told ``{run_id}`` can count on the run); released, it answers and the task
    runs."""
    disk = FaultyDisk()
    options = {"trace_store": lambda d: FileTraceStore(d, disk=disk)}
    answers: list[dict[str, Any]] = []
    answered = trio.Event()
    async with serving(tmp_path, host_options=options) as server, connect(server) as client:
        sid = (await client.result("session.create"))["session_id"]
        session = await server.host.load_session(sid)
        disk.stall(session.trace_path)

        async def run() -> None:
            answers.append(await client.call("run", {"session_id": sid, "input": "hi"}))
            answered.set()

        with trio.fail_after(RUN_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
                await trio.testing.wait_all_tasks_blocked()
                assert answers == []
                disk.release()
                await answered.wait()
            await session.wait_idle()
    (answer,) = answers
    run_id = answer["result"]["run_id"]
    lines = trace_lines(session)
    assert [line["run_id"] for line in lines if line["type"] == "task_start"] == [run_id]
    assert lines[-1]["status"] == "completed"


async def test_a_run_waiting_for_its_prompt_holds_up_no_later_call(tmp_path: Path) -> None:
    """While the prompt's fsync is held, the connection answers the calls sent after
    ``run``: one that needs no fsync is answered first; a ``steer`` finds the task begun
    (the run's work was done in order) and is answered ``queued: true`` once its record is
    fsynced too (R-STEER-1), and ``run`` once the prompt is durable."""
    disk = FaultyDisk()
    options = {"trace_store": lambda d: FileTraceStore(d, disk=disk)}
    async with serving(tmp_path, host_options=options) as server, connect(server) as client:
        sid = (await client.result("session.create"))["session_id"]
        session = await server.host.load_session(sid)
        disk.stall(session.trace_path)
        with trio.fail_after(RUN_TIMEOUT_S):
            await client.send({"jsonrpc": "2.0", "id": "run", "method": "run",
                               "params": {"session_id": sid, "input": "hi"}})
            await client.send({"jsonrpc": "2.0", "id": "steer", "method": "steer",
                               "params": {"session_id": sid, "input": "and more"}})
            await client.send({"jsonrpc": "2.0", "id": "list", "method": "approvals.list",
                               "params": {"session_id": sid}})
            first = await client.receive()
            assert first["id"] == "list" and "result" in first
            await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
            disk.release()
            answers = {a["id"]: a for a in [await client.receive(), await client.receive()]}
            assert answers["steer"] == {"jsonrpc": "2.0", "id": "steer", "result": {"queued": True}}
            assert isinstance(answers["run"]["result"]["run_id"], str)
            await session.wait_idle()
    assert trace_lines(session)[-1]["status"] == "completed"


async def test_a_run_whose_client_left_before_its_answer_keeps_no_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that sends ``run`` and goes away before the prompt is durable: the run
    goes on (its outputs in the trace and to subscribers) and its stream is let go. It was
    kept open, unread, and held every output of the run and its follow-ups."""
    disk = FaultyDisk()
    options = {"trace_store": lambda d: FileTraceStore(d, disk=disk)}
    streams: list[Any] = []
    run = Session.run

    def run_and_keep(self: Session, *args: Any, **kwargs: Any) -> Any:
        streams.append(run(self, *args, **kwargs))
        return streams[-1]

    monkeypatch.setattr(Session, "run", run_and_keep)
    async with serving(tmp_path, host_options=options) as server:
        async with connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            session = await server.host.load_session(sid)
            disk.stall(session.trace_path)
            with trio.fail_after(RUN_TIMEOUT_S):
                await client.send({"jsonrpc": "2.0", "id": "run", "method": "run",
                                   "params": {"session_id": sid, "input": "hi"}})
                await trio.to_thread.run_sync(disk.stalled.wait, RUN_TIMEOUT_S)
        with trio.fail_after(RUN_TIMEOUT_S):
            await trio.testing.wait_all_tasks_blocked()
            (stream,) = streams
            assert stream._receive.statistics().open_receive_channels == 0
            disk.release()
            await session.wait_idle()
    assert trace_lines(session)[-1]["status"] == "completed"


async def test_a_stopped_run_loaded_and_closed_is_still_taken_up_by_its_host(
    data_dir: Path, workspace: Path
) -> None:
    """R-CLUSTER-2, R-HITL-4: the trace ends in an accepted prompt (cut after it). The
    next host lists its requests (which loads the session), closes the session, then takes
    up its open work: the run starts and completes. Before, the close forgot that the
    session held work (only an open task counted), and ``resume_tasks`` found nothing
    until another host scanned the store."""
    provider = ScriptedProvider([Reply(blocks=(text("one"),))])
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await session.run("first").collect()
    cut_after(session.trace_path, lambda record: record["type"] == "user_msg")
    async with open_host(data_dir) as host:
        with trio.fail_after(RUN_TIMEOUT_S):
            await host.pending_approvals()  # reads the store: the session is loaded
            await host.close_session(session.id)
            assert await host.resume_tasks() == [session.id]
            resumed = await host.load_session(session.id)
            port_of(resumed).provider = ScriptedProvider([Reply(blocks=(text("two"),))])
            await resumed.wait_idle()
        lines = trace_lines(resumed)
    assert [line["type"] for line in lines][:2] == ["user_msg", "task_start"]
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"
