"""Fork, rewind and branches through the Python API, against the scripted model
(R-FORK-1, R-FORK-2, issue 26's branches): what the new session's history is, what the
trace keeps, what the source keeps (its bytes), and how a task the cut leaves open ends."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
from conftest import (
    Gates,
    Recorder,
    allow_all,
    collect,
    cut_after,
    last_user,
    open_host,
    result_text,
    results_of,
    texts_of,
    trace_lines,
)

from greenroom.actors.providers.scripted import Reply, ScriptedStream, text, tool_call
from greenroom.actors.runtime.errors import Busy, SeqRefused, SessionNotFound
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.time_travel import record
from greenroom.actors.runtime.trace_store import FileTraceLog, FileTraceStore
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import AssistantMessage, ModelRequest, UserMessage
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Rewind

INTERRUPTED = "[interrupted: tool aborted by user]"


def trace_bytes(session: Session) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(session.directory.glob("trace_*.jsonl"))}


def prompts_of(request: ModelRequest) -> list[str]:
    """The user texts a request carries, in order."""
    return [t for m in request.messages if isinstance(m, UserMessage) for t in texts_of(m)]


async def two_tasks(host: Host, workspace: Path, providers: Any, lookup: Any) -> Session:
    """A session with two finished tasks: the first calls ``lookup`` once."""
    provider = providers(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="a"),)),
            Reply(blocks=(text("a is value-a"),)),
            Reply(blocks=(text("second answer"),)),
        ]
    )
    session = await host.create_session(
        provider=provider, tools=[lookup.tool], workspace_dir=workspace
    )
    await collect(session.run("first question", approve=allow_all))
    await collect(session.run("second question"))
    return session


async def test_a_fork_has_the_history_and_the_source_stays_byte_identical(
    host: Host, workspace: Path, providers: Any, lookup: Any
) -> None:
    """R-FORK-1: the fork's context is the source's, its session.json names where it
    came from, its trace holds the prefix under its own id, and running it changes
    nothing of the source's trace files."""
    source = await two_tasks(host, workspace, providers, lookup)
    before = trace_bytes(source)
    last = source.transcript  # the source's context, to compare with the fork's
    fork_provider = providers([Reply(blocks=(text("from the fork"),))])
    fork = await host.fork_session(source.id, provider=fork_provider)
    assert fork.id != source.id
    assert fork.transcript.messages == last.messages
    meta = json.loads((fork.directory / "session.json").read_text())
    source_lines = trace_lines(source)
    assert meta["forked_from"] == {"session_id": source.id, "seq": source_lines[-1]["seq"]}
    fork_lines = trace_lines(fork)
    assert [{**line, "session_id": source.id} for line in fork_lines] == source_lines
    assert {line["session_id"] for line in fork_lines} == {fork.id}
    result = await collect(fork.run("third question"))
    assert result[-1].TYPE == "task_end"
    (request,) = fork_provider.requests
    assert prompts_of(request) == ["first question", "second question", "third question"]
    assert trace_bytes(source) == before
    assert lookup.calls == ["a"]  # the fork's history ran no tool again


async def test_a_fork_point_inside_a_task_is_settled_as_an_interrupt(
    host: Host, workspace: Path, providers: Any, lookup: Any
) -> None:
    """R-FORK-1, R-ABORT-2: forking between a tool call and its result leaves the call
    unpaired; the fork settles it in its own trace (interrupted result, abort,
    task_end(aborted)) and its next request carries the interrupted result, paired."""
    source = await two_tasks(host, workspace, providers, lookup)
    lines = trace_lines(source)
    call_seq = next(
        line["seq"] for line in lines
        if line["type"] == "request_end" and line["turn"] == 1
    )
    fork_provider = providers([Reply(blocks=(text("going on"),))])
    fork = await host.fork_session(source.id, at_seq=call_seq, provider=fork_provider)
    tail = [line["type"] for line in trace_lines(fork)[-3:]]
    assert tail == ["tool_call_output", "abort", "task_end"]
    settled = trace_lines(fork)[-3]
    assert (settled["call_id"], settled["status"]) == ("c1", "interrupted")
    assert trace_lines(fork)[-1]["status"] == "aborted"
    assert not fork.busy
    await collect(fork.run("go on"))
    (request,) = fork_provider.requests
    carried = results_of(last_user(request))
    assert [(r.call_id, result_text(r)) for r in carried] == [("c1", INTERRUPTED)]
    assert "second question" not in prompts_of(request)


@pytest.mark.parametrize("how", ["fork", "rewind"])
async def test_a_cut_between_an_abort_and_its_task_end_keeps_the_carried_results(
    host: Host, workspace: Path, providers: Any, lookup: Any, how: str
) -> None:
    """R-FORK-1, R-FORK-2, R-ABORT-2 case A: a task interrupted after its model message,
    one call done and one denied, records both results and its ``abort``; they go to
    the next request as carry-over. A fork or a rewind at that ``abort`` gets only the
    missing ``task_end``: a second ``abort`` (as a cut inside a running task gets) used
    to replace the carry-over with nothing, and the next request left both calls
    unpaired. Found by the storm (tests/test_interrupt_storm.py)."""
    calls = (tool_call("c1", "lookup", key="a"), tool_call("c2", "lookup", key="b"))
    source_provider = providers([Reply(blocks=calls), Reply(blocks=(text("next"),))])
    source = await host.create_session(
        provider=source_provider, tools=[lookup.tool], workspace_dir=workspace
    )

    def allow_then_interrupt(call: Any) -> str:
        if call.id == "c2":
            source.interrupt("enough")
            return "deny"
        return "allow"

    first = await collect(source.run("look both up", approve=allow_then_interrupt))
    assert first[-1].TYPE == "task_end" and first[-1].status == "aborted"  # type: ignore[attr-defined]
    abort_seq = next(line["seq"] for line in trace_lines(source) if line["type"] == "abort")
    after = providers([Reply(blocks=(text("going on"),))])
    if how == "fork":
        session = await host.fork_session(source.id, at_seq=abort_seq, provider=after)
    else:
        await source.rewind(abort_seq)
        session = source
        session.host.port(session.id).provider = after
    tail = [line["type"] for line in trace_lines(session)[-3:]]
    assert tail[-2:] == (["abort", "task_end"] if how == "fork" else ["rewind", "task_end"])
    assert [line["type"] for line in trace_lines(session)].count("abort") == 1
    ended = await collect(session.run("go on"))
    assert ended[-1].status == "completed"  # type: ignore[attr-defined]
    (request,) = after.requests
    carried = results_of(last_user(request))
    assert [r.call_id for r in carried] == ["c1", "c2"]
    assert [r.status for r in carried][1] == "denied"


async def interrupted_mid_stream(host: Host, workspace: Path, providers: Any) -> Session:
    """A session whose one task was interrupted while the model streamed: its trace ends
    ``model_msg`` ("the first half"), ``request_end(aborted)``, ``abort`` (with that
    partial), ``task_end(aborted)``."""

    async def half_then_hold(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.block(text("the first half"))
        await trio.Event().wait()  # until the interrupt cancels the stream

    source = await host.create_session(
        provider=providers([half_then_hold]), workspace_dir=workspace
    )
    recorder = Recorder(source)
    stream = source.run("tell me")
    await recorder.wait_for("model_msg")
    source.interrupt("stop")
    await collect(stream)
    tail = [(line["type"], line.get("status")) for line in trace_lines(source)[-4:]]
    assert tail == [
        ("model_msg", None), ("request_end", "aborted"), ("abort", None), ("task_end", "aborted")
    ]
    return source


CARRIED_PARTIAL = "[turn_aborted]the first half[/turn_aborted]"
"""The carry-over of :func:`interrupted_mid_stream`'s task, as its next request reads it."""


@pytest.mark.parametrize("how", ["fork", "rewind"])
async def test_a_cut_between_a_cut_streams_request_end_and_its_abort_keeps_the_partial(
    host: Host, workspace: Path, providers: Any, how: str
) -> None:
    """R-FORK-1, R-FORK-2, R-ABORT-2 case B: an interrupt mid-stream records
    ``request_end(aborted)``, then the ``abort`` with what the model had streamed. A fork
    or a rewind at that ``request_end`` wrote a second ``request_end(aborted)`` and an
    ``abort`` with nothing in it, so the next request read ``[turn_aborted][/turn_aborted]``
    instead of the text. Now only the ``abort`` (partial and all) and the ``task_end``
    follow, and the next request reads what a cut one record later gives."""
    source = await interrupted_mid_stream(host, workspace, providers)
    request_end = trace_lines(source)[-3]["seq"]
    after = providers([Reply(blocks=(text("going on"),))])
    if how == "fork":
        session = await host.fork_session(source.id, at_seq=request_end, provider=after)
    else:
        await source.rewind(request_end)
        session = source
        session.host.port(session.id).provider = after
    settled = trace_lines(session)
    first = "request_end" if how == "fork" else "rewind"
    assert [line["type"] for line in settled[-3:]] == [first, "abort", "task_end"]
    assert [line["type"] for line in settled].count("request_end") == 1
    assert settled[-2]["partial"] == [{"type": "text", "text": "the first half"}]
    await collect(session.run("go on"))
    (request,) = after.requests
    assert texts_of(last_user(request)) == [CARRIED_PARTIAL, "go on"]


async def test_a_trace_a_host_left_at_a_cut_streams_request_end_loads_with_the_partial(
    data_dir: Path, workspace: Path, providers: Any
) -> None:
    """R-TRACE-4, R-ABORT-2 case B, and the cut of R-FORK-1 left by a host that stopped
    between a cut stream's ``request_end(aborted)`` and its ``abort``: loaded, the task is
    over as the interrupt would have left it. It used to lose what the model had streamed
    and send the next prompt in one message with the interrupted task's."""
    async with open_host(data_dir) as host:
        source = await interrupted_mid_stream(host, workspace, providers)
        session_id, trace = source.id, source.trace_path
    cut_after(trace, lambda line: line["type"] == "request_end")
    after = providers([Reply(blocks=(text("going on"),))])
    async with open_host(data_dir) as host:
        loaded = await host.load_session(session_id, provider=after)
        await collect(loaded.run("go on"))
    (request,) = after.requests
    assert [texts_of(m) for m in request.messages] == [["tell me"], [CARRIED_PARTIAL, "go on"]]


async def test_a_fork_of_a_fork_point_that_is_missing_is_refused(
    host: Host, workspace: Path, providers: Any, lookup: Any, data_dir: Path
) -> None:
    """Bad input gets a clear error and leaves nothing behind: an unknown session, a seq
    past the last record or below 0."""
    source = await two_tasks(host, workspace, providers, lookup)
    sessions_before = sorted(p.name for p in (data_dir / "sessions").iterdir())
    with pytest.raises(SessionNotFound, match="no session 'nope'"):
        await host.fork_session("nope")
    last = trace_lines(source)[-1]["seq"]
    for bad in (last + 1, -1):
        with pytest.raises(SeqRefused, match=f"seq {bad} is out of range"):
            await host.fork_session(source.id, at_seq=bad)
    assert sorted(p.name for p in (data_dir / "sessions").iterdir()) == sessions_before
    empty = await host.fork_session(source.id, at_seq=0)
    assert empty.transcript.messages == []


async def test_a_fork_of_a_session_with_a_bad_setting_names_the_setting(
    host: Host, workspace: Path, providers: Any, lookup: Any
) -> None:
    source = await two_tasks(host, workspace, providers, lookup)
    await host.close_session(source.id)
    meta_path = source.directory / "session.json"
    meta = json.loads(meta_path.read_text())
    meta["settings"]["max_turns"] = "many"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(SessionNotFound) as refused:
        await host.fork_session(source.id)
    assert str(refused.value) == (
        f"session {source.id!r} has bad settings: "
        "invalid value for type, expected int @ $.settings.max_turns"
    )


async def test_branches_run_concurrently_and_share_only_the_prefix(
    host: Host, workspace: Path, providers: Any, lookup: Any, gates: Gates
) -> None:
    """Issue 26 "Branches": two forks of one point run at the same time (both tools are
    running at once), and their traces are equal up to the fork point (ids aside) and
    differ after it."""
    source = await two_tasks(host, workspace, providers, lookup)
    point = trace_lines(source)[-1]["seq"]
    branches = []
    for key in ("left", "right"):
        provider = providers(
            [Reply(blocks=(tool_call(f"w-{key}", "wait", key=key),)), Reply(blocks=(text(key),))]
        )
        branch = await host.fork_session(
            source.id, at_seq=point, provider=provider, tools=[gates.tool()]
        )
        branches.append(branch)
    streams = [b.run(f"go {b.id}", approve=allow_all) for b in branches]
    await gates.started("left")
    await gates.started("right")
    assert gates.peak == 2  # both branches' tools run at once
    gates.release("left")
    gates.release("right")
    for stream in streams:
        assert (await stream.result()).status == "completed"
    left, right = (trace_lines(b) for b in branches)
    prefix = trace_lines(source)
    for lines in (left, right):
        assert [{**line, "session_id": source.id} for line in lines[:point]] == prefix
        assert all(line["seq"] > point for line in lines[point:])
    assert [line["type"] for line in left[point:]] == [line["type"] for line in right[point:]]
    assert left[point:] != right[point:]  # their own prompts, calls and answers
    assert {line["session_id"] for line in left} == {branches[0].id}


async def test_a_rewind_cuts_the_history_and_the_trace_keeps_it(
    data_dir: Path, workspace: Path, providers: Any, lookup: Any
) -> None:
    """R-FORK-2: after a rewind to the end of the first task the session continues from
    there: its context, the next request and a reload after a restart say so; the trace
    keeps the second task behind the rewind record; a subscriber sees the rewind."""
    async with open_host(data_dir) as host:
        session = await two_tasks(host, workspace, providers, lookup)
        lines = trace_lines(session)
        first_end = next(line["seq"] for line in lines if line["type"] == "task_end")
        recorder = Recorder(session)
        record = await session.rewind(first_end, reason="try again")
        assert isinstance(record, Rewind) and record.to_seq == first_end
        assert record.seq == lines[-1]["seq"] + 1
        assert recorder.seen("rewind", to_seq=first_end)
        after = trace_lines(session)
        assert after[: len(lines)] == lines  # nothing recorded is erased
        assert after[-1]["type"] == "rewind" and after[-1]["reason"] == "try again"
        texts = [
            b.text
            for m in session.transcript.messages
            if isinstance(m, AssistantMessage)
            for b in m.content
            if isinstance(b, TextBlock)
        ]
        assert texts == ["a is value-a"]
        session_id = session.id
    replay = providers([Reply(blocks=(text("again"),))])
    async with open_host(data_dir) as host:
        loaded = await host.load_session(session_id, provider=replay, tools=[lookup.tool])
        await collect(loaded.run("another second question"))
        (request,) = replay.requests
        assert prompts_of(request) == ["first question", "another second question"]


async def test_a_rewind_into_a_task_settles_it_and_a_rewind_point_is_checked(
    host: Host, workspace: Path, providers: Any, lookup: Any
) -> None:
    """R-FORK-2, R-ABORT-2: a rewind to a point inside a task ends that task as an
    interrupt would (the call gets its interrupted result after the rewind record); a
    point out of range, or one an earlier rewind cut, is refused with why and what to do."""
    session = await two_tasks(host, workspace, providers, lookup)
    lines = trace_lines(session)
    last = lines[-1]["seq"]
    call_seq = next(
        line["seq"] for line in lines if line["type"] == "request_end" and line["turn"] == 1
    )
    await session.rewind(call_seq)
    tail = [line["type"] for line in trace_lines(session)[-4:]]
    assert tail == ["rewind", "tool_call_output", "abort", "task_end"]
    with pytest.raises(SeqRefused, match="out of range"):
        await session.rewind(10_000)
    with pytest.raises(SeqRefused, match=f"cut from the history by the rewind at seq {last + 1}"):
        await session.rewind(last)
    await session.rewind(0)
    assert session.transcript.messages == []


async def test_a_rewind_while_a_task_runs_is_refused(
    host: Host, workspace: Path, providers: Any, gates: Gates
) -> None:
    """R-FORK-2, R-HOST-2: a running task is never rewound under itself (Busy, 409 on the
    wire); once it has ended the rewind goes ahead."""
    provider = providers(
        [Reply(blocks=(tool_call("w1", "wait", key="k"),)), Reply(blocks=(text("done"),))]
    )
    session = await host.create_session(
        provider=provider, tools=[gates.tool()], workspace_dir=workspace
    )
    stream = session.run("wait for it", approve=allow_all)
    await gates.started("k")
    with pytest.raises(Busy):
        await session.rewind(1)
    gates.release("k")
    await stream.result()
    await session.rewind(0)
    assert not session.busy and session.transcript.messages == []


class _HeldReads(FileTraceLog):
    """A file log whose ``read_latest`` waits until the test lets it return."""

    def __init__(self, store: FileTraceStore) -> None:
        super().__init__(store.paths, store.sink)
        self.reading = trio.Event()
        self.go_on = trio.Event()

    async def read_latest(self, session_id: str) -> Any:
        self.reading.set()
        await self.go_on.wait()
        return await super().read_latest(session_id)


async def test_a_task_started_while_a_rewind_reads_the_trace_is_not_rewound(
    tmp_path: Path, workspace: Path, providers: Any, lookup: Any
) -> None:
    """R-FORK-2, R-HOST-2: a rewind reads the trace before it cuts; a task that starts
    meanwhile owns the session, and the rewind is refused rather than done under it."""
    logs: list[_HeldReads] = []

    def store(data_dir: Path) -> FileTraceStore:
        files = FileTraceStore(data_dir)
        files.log = _HeldReads(files)
        logs.append(files.log)
        return files

    async with Host.open(tmp_path / "data", trace_store=store) as host:
        session = await two_tasks(host, workspace, providers, lookup)
        (log,) = logs
        refused: list[BaseException] = []

        async def rewind() -> None:
            try:
                await session.rewind(0)
            except Busy as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rewind)
            await log.reading.wait()
            stream = session.run("third question", approve=allow_all)
            log.go_on.set()
        assert [type(e) for e in refused] == [Busy]
        await stream.result()
        assert [line["type"] for line in trace_lines(session)].count("rewind") == 0


async def rewind_past_a_compaction(session: Session) -> None:
    """Ask, compact, ask again, then rewind to the end of the first answer: the session's
    latest trace (``trace_003.jsonl``) starts with a rewind into its first context. The
    session's provider gives the first answer, the summary and the second answer."""
    await collect(session.run("first question"))
    first_end = trace_lines(session)[-1]["seq"]
    assert (await session.compact()) is not None
    await collect(session.run("second question"))
    assert session.trace_path.name == "trace_002.jsonl"
    await session.rewind(first_end)
    assert session.trace_path.name == "trace_003.jsonl"
    assert trace_lines(session)[0]["type"] == "rewind"


async def test_a_rewind_past_a_compaction_goes_back_to_the_earlier_context(
    data_dir: Path, workspace: Path, providers: Any
) -> None:
    """R-FORK-2, R-COMPACT-8: a rewind to a record before a compaction starts the next
    trace file (one file, one context) with the rewind; the session, live and reloaded,
    continues from the full context it had there, not from the summary."""
    provider = providers(
        [
            Reply(blocks=(text("first answer"),)),
            Reply(blocks=(text("[summary]they asked once[/summary]"),)),
            Reply(blocks=(text("second answer"),)),
            Reply(blocks=(text("after the rewind"),)),
        ]
    )
    async with open_host(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        await rewind_past_a_compaction(session)
        live = list(session.transcript.messages)
        session_id = session.id
    again = providers([Reply(blocks=(text("again"),))])
    async with open_host(data_dir) as host:
        loaded = await host.load_session(session_id, provider=again)
        assert loaded.transcript.messages == live
        await collect(loaded.run("another question"))
        (request,) = again.requests
        assert prompts_of(request) == ["first question", "another question"]
        answer = request.messages[1]
        assert isinstance(answer, AssistantMessage)
        assert answer.content == (TextBlock(text="first answer"),)


class _LateAckPort:
    """What ``record`` uses of a port whose store acknowledges late (the cluster's)."""

    def __init__(self) -> None:
        self.seq = 0
        self.acks: list[trio.MemorySendChannel[Any]] = []
        self.asked = trio.Event()
        self.published: list[list[Any]] = []
        self.transcript = SimpleNamespace(apply=lambda output: None)
        self.machine = SimpleNamespace(observe=lambda output: None)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def append(self, output: Any) -> int:
        return output.seq

    def commit(self) -> bool:
        return False

    def when_batch_done(self, ticket: int, inbox: trio.MemorySendChannel[Any]) -> None:
        self.acks.append(inbox)
        self.asked.set()

    def publish(self, batch: list[Any]) -> None:
        self.published.append(batch)

    async def sync_trace(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_rewind_whose_caller_left_while_the_cluster_acked_it_is_published() -> None:
    # R-FORK-2: the rewind's records are applied before the cluster's store acknowledges
    # them; a caller that went away meanwhile (its request cancelled) left them
    # unpublished: live subscribers never saw the rewind and saw the seqs jump.
    port = _LateAckPort()
    note = Rewind(session_id="s1", run_id="", to_seq=3, seq=0)

    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def rewind() -> None:
            with scope:
                await record(port, [note])  # type: ignore[arg-type]

        nursery.start_soon(rewind)
        await port.asked.wait()
        scope.cancel()  # the caller goes away
        await trio.testing.wait_all_tasks_blocked()
        port.acks[0].send_nowait(TraceWritten(ticket=1))
    assert [[output.seq for output in batch] for batch in port.published] == [[1]]
