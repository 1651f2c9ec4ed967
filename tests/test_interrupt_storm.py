"""A seeded storm on one host (R-SEC-1, R-SEC-2, R-ABORT-1, R-STEER-1, R-TRACE-1, R-TOOL-7).

Several sessions run task after task at once, each task against a model that answers at
random: text at any pace, tool calls (quick, slow, failing, hanging until cancelled, or
whose clean-up fails as it is cancelled), a transient failure that is retried, a stream
that stalls until it is interrupted and then fails its own clean-up, a provider bug. The
approval callback allows, denies, raises, takes its time, or waits past its bound and
fails its clean-up. Steering and interrupts come at random points of each run (after a
drawn number of its outputs); a run stuck on something that only an interrupt ends (a
hanging call, a stalled stream) is interrupted then.

Whatever happens, every run ends with exactly one ``task_end`` and nothing after it, no
task ends on an internal error, each session's next task completes, every request the
model sees pairs each tool call with its result, each trace's ``seq`` has no gap, and the
host closes without an error. Bounded: a few sessions and tasks per seed, on an autojump
clock.
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import (
    allow_all,
    assert_trace_seq_without_gaps,
    collect,
    of_type,
    port_of,
    trace_lines,
)

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.errors import HostClosed, NotPending, SeqRefused, SessionClosed
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SPAWN_SUBAGENT, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.outputs import Abort, Output, TaskEnd, TaskStart
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.stream import ModelError
from greenroom.protocols.tools import make_tool
from greenroom.protocols.trace import trace_file_number

SESSIONS = 6
TASKS = 8
TOOL_KEYS = ("quick", "quick", "slow", "fail", "hang", "clean-up")
ENDINGS = {"completed", "aborted", "failed", "loop_detected", "max_turns"}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
}


async def _wait_then_fail_clean_up() -> None:
    """Wait until cancelled; the clean-up then fails, grouped with the cancellation."""

    async def clean_up_fails() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise RuntimeError("the clean-up failed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(clean_up_fails)
        await trio.sleep_forever()


def storm_tool(stuck: list[trio.Event]) -> Any:
    """The ``work`` tool of one session; a call that waits until it is cancelled sets the
    session's current ``stuck[0]`` first."""

    async def work(key: str) -> str:
        """Do the work named by ``key``."""
        kind, _, arg = key.partition(":")
        if kind == "slow":
            await trio.sleep(float(arg))
        elif kind == "fail":
            raise ValueError("the work failed")
        elif kind == "hang":
            stuck[0].set()
            await trio.sleep_forever()
        elif kind == "clean-up":
            stuck[0].set()
            await _wait_then_fail_clean_up()
        return f"done {key}"

    return make_tool(work, parallel=True)


class StormModel:
    """The model's answers, drawn from one seeded generator; ``calm`` answers text only."""

    def __init__(self, seed: int, *, asks: bool = False, spawns: bool = False) -> None:
        self.rng = random.Random(seed)
        self.asks = asks
        """Whether it asks people questions (``ask_user``) among its calls."""
        self.spawns = spawns
        """Whether it hands tasks to subagents, in the foreground or the background."""
        self.calm = False
        self.requests = 0
        self.stuck = [trio.Event()]
        """Set when the run waits on something only an interrupt ends."""

    async def __call__(self, request: ModelRequest, stream: ScriptedStream) -> None:
        self.requests += 1
        number = self.requests
        rng = self.rng
        if self.calm:
            await stream.text("All calm now.")
            return
        draw = rng.random()
        if draw < 0.35:
            await stream.text(
                "Here is " + "some text " * rng.randint(1, 6),
                chunk_delay_s=rng.choice((0.0, 0.05, 0.3)),
            )
        elif draw < 0.7:
            if rng.random() < 0.5:
                await stream.text("Working on it.")
            for i in range(rng.randint(1, 3)):
                if self.asks and rng.random() < 0.2:
                    question = tool_call(f"r{number}c{i}", "ask_user", question="Which one?")
                    await stream.tool_call(question)
                    continue
                if self.spawns and rng.random() < 0.3:
                    arguments = {
                        "task": f"look into part {i}",
                        "background": rng.random() < 0.4,
                        "name": f"helper {number}.{i}",
                    }
                    spawn = ToolCallBlock(
                        id=f"r{number}c{i}", name=SPAWN_SUBAGENT, arguments=arguments
                    )
                    await stream.tool_call(spawn)
                    continue
                key = rng.choice(TOOL_KEYS)
                if key == "slow":
                    key = f"slow:{rng.uniform(0.1, 3):.2f}"
                await stream.tool_call(tool_call(f"r{number}c{i}", "work", key=key))
            await stream.end("tool_use")
        elif draw < 0.77:
            await stream.text_delta("Par")
            await stream.fail(ModelError(kind="timeout", message="overloaded (HTTP 529)"))
        elif draw < 0.8:
            # The context is too long: compacted (by this same model), then the turn again.
            await stream.fail(ModelError(kind="context_overflow", message="prompt is too long"))
        elif draw < 0.9:
            await stream.text_delta("Thinking aloud")
            self.stuck[0].set()
            await _wait_then_fail_clean_up()
        elif draw < 0.95:
            raise RuntimeError("a provider bug")
        else:
            await trio.sleep(rng.uniform(0, 2))
            await stream.text("Late but here.")


class StormApprovals:
    """The approval callback: its answer for each call drawn from ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def __call__(self, call: Any) -> str:
        draw = self.rng.random()
        if draw < 0.6:
            return "allow"
        if draw < 0.7:
            return "deny"
        if draw < 0.8:
            raise RuntimeError("the approval callback failed")
        if draw < 0.9:
            await trio.sleep(self.rng.uniform(0.1, 2))
            return "allow"
        await _wait_then_fail_clean_up()
        return "allow"  # pragma: no cover - never reached


async def _storm_sessions(
    host: Host,
    workspace: Path,
    seed: int,
    *,
    model: dict[str, bool] | None = None,
    tools: tuple[Any, ...] = (),
    **options: Any,
) -> tuple[list[Session], list[StormModel], list[ScriptedProvider]]:
    """:data:`SESSIONS` sessions on ``host``, each with its own seeded model (``model``:
    what it may do besides text and tool calls) and its ``work`` tool; ``options`` for
    every session (a callable value is called with the session's index)."""
    models = [StormModel(seed * 100 + i, **(model or {})) for i in range(SESSIONS)]
    providers = [ScriptedProvider(storm, keep_requests=True) for storm in models]
    sessions = []
    for i, (storm, provider) in enumerate(zip(models, providers, strict=True)):
        given = {k: v(i) if callable(v) else v for k, v in options.items()}
        sessions.append(
            await host.create_session(
                provider=provider,
                workspace_dir=workspace,
                tools=[storm_tool(storm.stuck), *tools],
                **given,
            )
        )
    return sessions, models, providers


async def _one_task(
    session: Session,
    model: StormModel,
    prompt: str,
    approve: Any,
    rng: random.Random,
    *,
    follow_ups: bool = False,
) -> list[Output]:
    """Run one task, steered and interrupted at random points; its outputs. The points
    are counted in outputs, not in time: an autojump clock jumps to the next deadline
    whenever every task waits on a thread (the trace's fsyncs)."""
    outputs: list[Output] = []
    ended = trio.Event()
    wake = trio.Event()
    # Not replaced: a task that a background child's answer started may have got stuck
    # before this run began (it then waits behind that task), and that must be answered.
    stuck = model.stuck[0]
    steer_after = rng.randint(1, 30) if rng.random() < 0.3 else None
    follow_after = rng.randint(1, 30) if follow_ups and rng.random() < 0.3 else None
    interrupt_after = rng.randint(1, 60) if rng.random() < 0.5 else None
    seen = 0

    def listen(batch: list[Output]) -> None:
        nonlocal seen
        seen += len(batch)
        if (
            (interrupt_after is not None and seen >= interrupt_after)
            or (steer_after is not None and seen >= steer_after)
            or (follow_after is not None and seen >= follow_after)
        ):
            wake.set()

    unsubscribe = session.subscribe(listen)
    # Now and then the answer must match a schema (R-OUT-1): a text answer is sent back
    # once with the errors, then the task fails with them.
    schema = ANSWER_SCHEMA if rng.random() < 0.15 else None
    stream = session.run(prompt, approve=approve, output_schema=schema)

    async def read() -> None:
        outputs.extend(await collect(stream, bound_s=None))
        ended.set()
        wake.set()

    async def stuck_wakes() -> None:
        await stuck.wait()
        wake.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(stuck_wakes)
            while not ended.is_set():
                await wake.wait()
                wake = trio.Event()
                if steer_after is not None and seen >= steer_after:
                    steer_after = None
                    with contextlib.suppress(SessionClosed):  # the host closed the session
                        session.steer("and keep it short")
                if follow_after is not None and seen >= follow_after:
                    follow_after = None
                    # Refused while the host drains or once it has closed the session.
                    with contextlib.suppress(HostClosed, SessionClosed):
                        session.follow_up("then one more thing", approve=approve)
                if stuck.is_set() or (interrupt_after is not None and seen >= interrupt_after):
                    interrupt_after = None
                    if stuck.is_set():
                        model.stuck[0] = trio.Event()  # answered
                    session.interrupt("interrupted by the storm")
                    await ended.wait()
            nursery.cancel_scope.cancel()
    finally:
        unsubscribe()
    return outputs


def _check_run(outputs: list[Output], *, follow_ups: bool = False) -> str:
    """R-ABORT-1, R-RUN-7: one ``task_end`` per ``task_start`` (one task, or with
    ``follow_ups`` the run's task and those queued after it), the last output ends the
    last task; each aborted one follows its ``abort``. The last task's status. Outputs
    of subagents, forwarded with their ``origin``, are their own trees' to check."""
    outputs = [output for output in outputs if output.origin is None]
    ends = of_type(outputs, TaskEnd)
    starts = of_type(outputs, TaskStart)
    assert ends and len(ends) == max(1, len(starts)), [o.TYPE for o in outputs]
    assert follow_ups or len(ends) == 1, [o.TYPE for o in outputs]
    assert outputs[-1] is ends[-1]
    for end in ends:
        assert end.status in ENDINGS, end
        assert not (end.message or "").startswith("internal error"), end.message
    aborted = [end for end in ends if end.status == "aborted"]
    assert len(of_type(outputs, Abort)) == len(aborted)
    return ends[-1].status


async def _travel(host: Host, session: Session, rng: random.Random) -> None:
    """Now and then between tasks, time travel (R-FORK-1, R-FORK-2): rewind the session
    to a record of its trace, or fork it there and run a task on the fork, which must
    complete. A point an earlier rewind cut is refused (``SeqRefused``), as it says."""
    draw = rng.random()
    if draw > 0.25:
        return
    await port_of(session).sync_trace()
    seq = rng.choice([line["seq"] for line in trace_lines(session)])
    with contextlib.suppress(SeqRefused):
        if draw < 0.15:
            await session.rewind(seq, reason="the storm rewinds")
            return
        calm = StormModel(0)
        calm.calm = True
        fork = await host.fork_session(
            session.id, seq, provider=ScriptedProvider(calm), tools=[storm_tool(calm.stuck)]
        )
        outputs = await collect(fork.run("go on from here", approve=allow_all), bound_s=None)
        assert _check_run(outputs) == "completed"
        # A fork past a compaction starts from the file the compaction began.
        await _assert_seq_contiguous(fork, from_one=False)


@pytest.mark.parametrize("seed", range(1, 17))
async def test_a_storm_of_interrupts_and_failures_leaves_every_session_sound(
    data_dir: Path, workspace: Path, seed: int, mock_clock: trio.testing.MockClock
) -> None:
    mock_clock.autojump_threshold = 0
    rng = random.Random(seed)
    statuses: list[str] = []
    async with Host.open(data_dir) as host:
        sessions, models, providers = await _storm_sessions(
            host,
            workspace,
            seed,
            approval_timeout_s=5,
            max_turns=lambda i: -1 if i % 2 else 3,
        )

        async def storm(session: Session, model: StormModel, session_rng: random.Random) -> None:
            approve = StormApprovals(session_rng)
            for k in range(TASKS):
                outputs = await _one_task(session, model, f"task {k}", approve, session_rng)
                statuses.append(_check_run(outputs))
                await _travel(host, session, session_rng)

        async with trio.open_nursery() as nursery:
            for session, model in zip(sessions, models, strict=True):
                nursery.start_soon(storm, session, model, random.Random(rng.random()))

        for model in models:
            model.calm = True
        for session in sessions:
            final = await collect(
                session.run("are we fine?", approve=StormApprovals(rng)), bound_s=None
            )
            assert _check_run(final) == "completed"
            await _assert_seq_contiguous(session)
    for provider in providers:
        assert provider.violations == []  # R-TOOL-7: every call paired, every request
    # The storm did what it is for: tasks that ended, and tasks that were interrupted.
    assert "aborted" in statuses and ("completed" in statuses or "failed" in statuses)


async def test_a_decision_drained_as_an_interrupt_ends_the_task_asks_nobody(
    data_dir: Path, workspace: Path
) -> None:
    """Found by the storm: the approval of a turn's first call is sent after an interrupt
    has stopped the task's actors (the callback interrupts, then, shielded, lets the
    supervisor begin the task's end before it answers). The task's end drains the
    decision, and the turn moves on to ask about the second call: that ask went to the
    stopped broker's closed inbox and ended the task ``failed`` with ``internal error:
    BrokenResourceError()``. It ends ``aborted``, both calls settled."""
    stuck: list[trio.Event] = [trio.Event()]
    calls = (tool_call("c1", "work", key="quick"), tool_call("c2", "work", key="quick"))
    provider = ScriptedProvider([Reply(blocks=calls), Reply(blocks=(text("Fine."),))])
    async with Host.open(data_dir) as host:
        session = await host.create_session(
            provider=provider, workspace_dir=workspace, tools=[storm_tool(stuck)]
        )

        async def interrupt_then_allow(call: ToolCallBlock) -> str:
            session.interrupt("interrupted while approving")
            # Shielded: the supervisor takes the interrupt and stops the actors meanwhile;
            # the answer below is then sent by a broker already told to stop.
            with trio.CancelScope(shield=True):
                for _ in range(50):
                    await trio.lowlevel.checkpoint()
            return "allow"

        outputs = await collect(session.run("go", approve=interrupt_then_allow))
        assert _check_run(outputs) == "aborted"
        again = await collect(session.run("again", approve=lambda call: "allow"))
        assert _check_run(again) == "completed"
        await assert_trace_seq_without_gaps(session)
    assert provider.violations == []


def _whole_trace(session: Session) -> list[dict[str, Any]]:
    """Every record of the session's trace files, oldest file first (a compaction starts
    a new file; its ``seq`` goes on from the last)."""
    files = [p for p in session.directory.iterdir() if trace_file_number(p.name)]
    files.sort(key=lambda p: trace_file_number(p.name) or 0)
    return [json.loads(line) for path in files for line in path.read_text().splitlines()]


async def _assert_seq_contiguous(session: Session, *, from_one: bool = True) -> None:
    """R-TRACE-1 across compactions: the trace's ``seq`` runs 1, 2, 3… over its files
    (unless not ``from_one``: on from its first record)."""
    await port_of(session).sync_trace()
    seqs = [line["seq"] for line in _whole_trace(session)]
    first = 1 if from_one else seqs[0]
    assert seqs == list(range(first, first + len(seqs)))


async def _person(host: Host, rng: random.Random, answered: list[str]) -> None:
    """A person who answers when they can: every pending request, now and then, with a
    drawn answer (some left for a later round; a call in doubt: done, or not done). An
    answer the task no longer waits for (interrupted meanwhile) is refused with
    ``NotPending``, which is theirs to see; a host that is closing refuses them all
    (``HostClosed``), and they go."""
    with contextlib.suppress(HostClosed):
        await _answer_when_they_can(host, rng, answered)


async def _answer_when_they_can(host: Host, rng: random.Random, answered: list[str]) -> None:
    while True:
        await trio.sleep(rng.uniform(0.1, 3))
        for pending in await host.pending_approvals():
            if rng.random() < 0.3:
                continue
            with contextlib.suppress(NotPending):
                if pending.kind == "question":
                    await host.answer_question(pending.session_id, pending.call_id, "blue")
                elif pending.kind == "in_doubt":  # its host stopped while it ran: R-EFFECT-2
                    said = rng.choice(("done", "not done"))
                    await host.answer_question(pending.session_id, pending.call_id, said)
                else:
                    verdict = rng.choice(("allow", "allow", "deny", "allow_session"))
                    await host.answer_approval(pending.session_id, pending.call_id, verdict)
                answered.append(pending.call_id)


@pytest.mark.parametrize("seed", range(1, 9))
async def test_a_storm_with_people_follow_ups_and_compactions(
    data_dir: Path, workspace: Path, seed: int, mock_clock: trio.testing.MockClock
) -> None:
    """The storm with people deciding the calls and answering the model's questions when
    they can (R-HITL-1..5), follow-ups queued during runs (R-STEER-6), and a manual
    compaction now and then between tasks (R-COMPACT-2)."""
    mock_clock.autojump_threshold = 0
    rng = random.Random(seed)
    statuses: list[str] = []
    answered: list[str] = []
    async with Host.open(data_dir) as host:
        sessions, models, providers = await _storm_sessions(
            host, workspace, seed, model={"asks": True}
        )

        async def storm(session: Session, model: StormModel, session_rng: random.Random) -> None:
            for k in range(TASKS):
                outputs = await _one_task(
                    session, model, f"task {k}", PEOPLE, session_rng, follow_ups=True
                )
                statuses.append(_check_run(outputs, follow_ups=True))
                if session_rng.random() < 0.2 and session.compactability() == "ok":
                    model.calm = True
                    ended = await session.compact()
                    model.calm = False
                    assert ended is not None and ended.status in ("ok", "failed"), ended

        async with trio.open_nursery() as people:
            people.start_soon(_person, host, random.Random(rng.random()), answered)
            async with trio.open_nursery() as nursery:
                for session, model in zip(sessions, models, strict=True):
                    nursery.start_soon(storm, session, model, random.Random(rng.random()))
            people.cancel_scope.cancel()

        for model in models:
            model.calm = True
        for session in sessions:
            final = await collect(session.run("are we fine?", approve=PEOPLE), bound_s=None)
            assert _check_run(final) == "completed"
            await _assert_seq_contiguous(session)
            assert not session.busy
    for provider in providers:
        assert provider.violations == []
    assert "aborted" in statuses and "completed" in statuses and answered


def _traced_tasks(session: Session) -> list[dict[str, Any]]:
    """The session's ``task_end`` records, once each ``task_start`` of its trace has one
    (R-RUN-7) and its ``seq`` runs without a gap (R-TRACE-1)."""
    lines = _whole_trace(session)
    seqs = [line["seq"] for line in lines]
    assert seqs == list(range(1, len(seqs) + 1))
    starts = [line for line in lines if line["type"] == "task_start"]
    ends = [line for line in lines if line["type"] == "task_end"]
    assert len(starts) == len(ends), (len(starts), len(ends))
    return ends


@pytest.mark.parametrize("seed", range(1, 7))
async def test_a_storm_across_a_host_stop_and_its_successor(
    data_dir: Path, workspace: Path, seed: int, mock_clock: trio.testing.MockClock
) -> None:
    """The storm with people, stopped part-way: the host drains (running tasks stop at
    their turn boundary, R-DRAIN-1) or simply closes (running tasks are interrupted,
    parked ones stay pending, R-HITL-1). A second host on the same data dir takes up every
    open task (R-HITL-4) with people answering, calls in doubt included; a task stuck on a
    call is interrupted. Then every session answers a last task, every traced task has
    its end, none an internal error, and nothing waits for anyone."""
    mock_clock.autojump_threshold = 0
    rng = random.Random(seed)
    models = [StormModel(seed * 100 + i, asks=True) for i in range(SESSIONS)]
    answered: list[str] = []
    stop_after = rng.randint(50, 400)
    seen = 0
    stopping = trio.Event()

    def count(batch: list[Output]) -> None:
        nonlocal seen
        seen += len(batch)
        if seen >= stop_after:
            stopping.set()

    async with Host.open(data_dir) as host:
        sessions = [
            await host.create_session(
                provider=ScriptedProvider(model, keep_requests=False),
                workspace_dir=workspace,
                tools=[storm_tool(model.stuck)],
            )
            for model in models
        ]
        ids = [session.id for session in sessions]
        for session in sessions:
            session.subscribe(count)

        async def storm(session: Session, model: StormModel, session_rng: random.Random) -> None:
            for k in range(TASKS):
                if stopping.is_set():
                    return
                outputs = await _one_task(
                    session, model, f"task {k}", PEOPLE, session_rng, follow_ups=True
                )
                if not stopping.is_set():
                    _check_run(outputs, follow_ups=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_person, host, random.Random(rng.random()), answered)
            for session, model in zip(sessions, models, strict=True):
                nursery.start_soon(storm, session, model, random.Random(rng.random()))
            await stopping.wait()
            if rng.random() < 0.5:
                await host.drain(rng.uniform(0.5, 5))
            await host.aclose()
            nursery.cancel_scope.cancel()

    async with Host.open(data_dir) as host:
        resumed = [
            await host.resume(
                sid,
                approve=PEOPLE,
                provider=ScriptedProvider(model, keep_requests=True),
                tools=[storm_tool(model.stuck)],
            )
            for sid, model in zip(ids, models, strict=True)
        ]

        async def interrupt_when_stuck(session: Session, model: StormModel) -> None:
            while True:
                await _interrupt_when_stuck(session, model, "stuck after the restart")

        async def settle(session: Session, model: StormModel) -> None:
            """Until the session's task has ended: a parked one waits for the person,
            whose answer wakes it (its outputs wake this wait)."""
            wake = [trio.Event()]
            unsubscribe = session.subscribe(lambda batch: wake[0].set())
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(interrupt_when_stuck, session, model)
                    while True:
                        await session.wait_idle()
                        if not session.busy:
                            break
                        await wake[0].wait()
                        wake[0] = trio.Event()
                    nursery.cancel_scope.cancel()
            finally:
                unsubscribe()

        async with trio.open_nursery() as people:
            people.start_soon(_person, host, random.Random(rng.random()), answered)
            async with trio.open_nursery() as nursery:
                for session, model in zip(resumed, models, strict=True):
                    nursery.start_soon(settle, session, model)
            people.cancel_scope.cancel()

        assert await host.pending_approvals() == []
        for session, model in zip(resumed, models, strict=True):
            model.calm = True
            final = await collect(session.run("are we fine?", approve=PEOPLE), bound_s=None)
            assert _check_run(final) == "completed"
            await port_of(session).sync_trace()
            for end in _traced_tasks(session):
                assert end["status"] in ENDINGS, end
                assert not (end.get("message") or "").startswith("internal error"), end
            assert port_of(session).provider.violations == []  # type: ignore[attr-defined]


async def _tree_ends(session: Session) -> list[dict[str, Any]]:
    """The ``task_end`` records of ``session`` and of every subagent below it, each
    trace checked as :func:`_traced_tasks` does once the node is idle: an interrupt of
    the tree ends a background node's task as its own supervisor gets to it, which may
    be after its parent is idle."""
    await session.wait_idle()
    await port_of(session).sync_trace()
    ends = _traced_tasks(session)
    for child in await session.children():
        ends += await _tree_ends(child)
    return ends


async def _settle(session: Session, model: StormModel) -> None:
    """Wait until ``session`` is idle between the storm's tasks. A background child's answer
    may have started a task of its own, and that task may wait on what only an interrupt
    ends: it is interrupted when it gets stuck, and so is one that starts as the session
    goes idle."""
    while True:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_idle_then_cancel, session, nursery.cancel_scope)
            nursery.start_soon(_interrupt_when_stuck, session, model, "the storm goes on")
        if not session.busy:
            return
        session.interrupt("the storm goes on")


async def _idle_then_cancel(session: Session, scope: trio.CancelScope) -> None:
    await session.wait_idle()
    scope.cancel()


async def _interrupt_when_stuck(session: Session, model: StormModel, reason: str) -> None:
    """Once the model's current stuck request is reported: answered with an interrupt."""
    await model.stuck[0].wait()
    model.stuck[0] = trio.Event()  # answered
    session.interrupt(reason)


@pytest.mark.parametrize("seed", range(1, 9))
async def test_a_storm_of_agent_trees(
    data_dir: Path, workspace: Path, seed: int, mock_clock: trio.testing.MockClock
) -> None:
    """The storm where the model also hands tasks to subagents, in the foreground and in
    the background, which may do the same (R-TREE-1..3): interrupts end a whole tree
    (R-TREE-2), a background child's answer reaches its parent as steering or as a task
    after the run (the next run then waits for it), and at the end every node of every
    tree has ended each task it traced, none on an internal error."""
    mock_clock.autojump_threshold = 0
    rng = random.Random(seed)
    statuses: list[str] = []
    async with Host.open(data_dir) as host:
        roots, models, providers = await _storm_sessions(
            host,
            workspace,
            seed,
            model={"spawns": True},
            tools=(spawn_subagent,),
            approval_timeout_s=5,
        )

        async def storm(session: Session, model: StormModel, session_rng: random.Random) -> None:
            approve = StormApprovals(session_rng)
            for k in range(TASKS):
                await _settle(session, model)
                outputs = await _one_task(
                    session, model, f"task {k}", approve, session_rng, follow_ups=True
                )
                statuses.append(_check_run(outputs, follow_ups=True))

        async with trio.open_nursery() as nursery:
            for session, model in zip(roots, models, strict=True):
                nursery.start_soon(storm, session, model, random.Random(rng.random()))

        for model in models:
            model.calm = True
        for session in roots:
            session.interrupt("the storm is over")  # background children included
            await session.wait_idle()
            final = await collect(
                session.run("are we fine?", approve=StormApprovals(rng)), bound_s=None
            )
            assert _check_run(final) == "completed"
            for end in await _tree_ends(session):
                assert end["status"] in ENDINGS | {"budget_exceeded", "max_turns"}, end
                assert not (end.get("message") or "").startswith("internal error"), end
    for provider in providers:
        assert provider.violations == []
    assert "aborted" in statuses and "completed" in statuses
