"""The pure task machine (protocols/task.py): its decisions, and its fold of a trace.

A small world plays a supervisor against the machine: it carries out each step by emitting
the outputs a supervisor would emit, from a script of what the model, the tools, the hooks
and the people do, and feeds every traced output back to the machine. Hypothesis draws the
scripts; every run is checked against the rules, and every prefix of its trace is folded
and compared with the live machine's recorded state at that seq (invariant 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from greenroom.protocols.content import TextBlock, ToolCallBlock, UserContent
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    RequestBegin,
    RequestEnd,
    TaskEnd,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.retry import MAX_RETRIES
from greenroom.protocols.stream import ModelError, TokenUsage
from greenroom.protocols.task import (
    BeginAttempt,
    BeginTurn,
    CallHook,
    Compact,
    EndTask,
    Finish,
    Phase,
    RecordedState,
    StartTask,
    TaskLimits,
    TaskMachine,
    Wait,
    fold,
)
from greenroom.protocols.trace import input_size

SID = "s"


@attrs.frozen
class Call:
    tool: str
    error: bool = False
    early: bool = False  # its result arrives before the attempt's request_end
    ask: bool = False  # a person is asked (approval_request) before it is decided
    deny: bool = False


@attrs.frozen
class Attempt:
    """What one model request does: ``fail`` names an error kind, else it answers with
    ``calls`` (none: the final answer)."""

    calls: tuple[Call, ...] = ()
    fail: str | None = None
    tokens: int = 10


class World:
    """Carries out the machine's steps as a supervisor would, from a script."""

    def __init__(
        self,
        machine: TaskMachine,
        attempts: list[Attempt],
        *,
        compactions: list[str] | None = None,
        hook_answers: list[str | None] | None = None,
        on_record: Callable[[int, World], None] | None = None,
    ) -> None:
        self.machine = machine
        self.attempts = list(attempts)
        self.compactions = list(compactions or [])
        self.hook_answers = list(hook_answers or [])
        self.on_record = on_record
        self.records: list[Output] = []
        self.snapshots: list[RecordedState] = []
        self.steps: list[Any] = []
        self.pending: list[ToolCallOutput] = []
        self.open_calls: dict[str, ToolCallBlock] = {}
        self.streaming = False
        self.compacting = False
        self.run_id = ""
        self.runs = 0
        self.call_n = 0
        self.turn = 0

    # -- recording --------------------------------------------------------------------

    def emit(self, output: Output) -> None:
        output = attrs.evolve(output, seq=len(self.records) + 1)
        self.records.append(output)
        self.machine.observe(output)
        self.snapshots.append(self.machine.recorded())
        if isinstance(output, ToolCallOutput):
            self.open_calls.pop(output.call_id, None)
        if self.on_record is not None:
            self.on_record(len(self.records), self)

    def result(self, call: ToolCallBlock, status: str, error: bool) -> ToolCallOutput:
        return ToolCallOutput(
            session_id=SID, run_id=self.run_id, call_id=call.id, tool=call.name,
            status=status, is_error=error, content=(TextBlock(text=status),),  # type: ignore[arg-type]
        )

    # -- the loop ---------------------------------------------------------------------

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            step = self.machine.next_step()
            self.steps.append(step)
            match step:
                case Finish():
                    return
                case Wait():
                    assert self.pending, f"the machine waits for nothing: {self.machine.recorded()}"
                    self.emit(self.pending.pop(0))
                case StartTask():
                    self.start(step)
                case Compact(reason=reason):
                    self.compact(reason)
                case BeginTurn(turn=turn, steering=steering):
                    if steering:
                        self.emit(UserMsg(session_id=SID, run_id=self.run_id, kind="steering",
                                          content=steering))
                    self.turn = turn
                    self.attempt(1)
                case BeginAttempt(attempt=attempt):
                    self.attempt(attempt)
                case CallHook():
                    self.machine.hook_answered(self.hook_answers.pop(0) if self.hook_answers
                                               else None)
                case EndTask():
                    self.end(step)
        raise AssertionError("the machine never finished")

    def start(self, step: StartTask) -> None:
        self.runs += 1
        self.run_id = f"run{self.runs}"
        if step.kind == "compaction":
            self.compact("manual")
            return
        self.emit(UserMsg(session_id=SID, run_id=self.run_id, kind="prompt",
                          content=(TextBlock(text=str(step.task)),)))
        self.emit(TaskStart(session_id=SID, run_id=self.run_id, input_seq=len(self.records)))

    def compact(self, reason: Any) -> None:
        self.emit(CompactionBegin(session_id=SID, run_id=self.run_id, reason=reason))
        outcome = self.compactions.pop(0) if self.compactions else "ok"
        self.compacting = True
        if outcome == "interrupt":
            self.machine.interrupt("interrupted during compaction")
            return
        self.compacting = False
        if outcome == "ok":
            self.emit(CompactionEnd(session_id=SID, run_id=self.run_id, status="ok", attempt=1,
                                    summary="s"))
        else:
            self.emit(CompactionEnd(session_id=SID, run_id=self.run_id, status="failed",
                                    attempt=1, error_message=outcome,
                                    error_kind="auth" if outcome == "auth" else "timeout"))

    def attempt(self, number: int) -> None:
        script = self.attempts.pop(0) if self.attempts else Attempt()
        self.emit(RequestBegin(session_id=SID, run_id=self.run_id, turn=self.turn,
                               attempt=number))
        self.streaming = True
        for call in script.calls:
            self.call_n += 1
            block = ToolCallBlock(id=f"c{self.call_n}", name=call.tool, arguments={})
            self.open_calls[block.id] = block
            self.emit(ModelMsg(session_id=SID, run_id=self.run_id, turn=self.turn, block=block))
            if call.ask:
                self.emit(ApprovalRequest(session_id=SID, run_id=self.run_id, call_id=block.id,
                                          tool=block.name, arguments={}))
            decision = ApprovalDecision(session_id=SID, run_id=self.run_id, call_id=block.id,
                                        tool=block.name, decision="deny" if call.deny else "allow",
                                        by="host")
            status, error = ("denied", True) if call.deny else (
                ("error", True) if call.error else ("ok", False))
            later: list[ToolCallOutput] = []
            if call.ask:
                self.pending.append(decision)  # type: ignore[arg-type]
            else:
                self.emit(decision)
            if call.early and not call.ask:
                self.emit(self.result(block, status, error))
            else:
                later.append(self.result(block, status, error))
            self.pending.extend(later)
        self.emit(TokenUsageOutput(session_id=SID, run_id=self.run_id, turn=self.turn,
                                   request=TokenUsage(input=script.tokens, output=1)))
        self.streaming = False
        if script.fail is None:
            self.emit(RequestEnd(session_id=SID, run_id=self.run_id, turn=self.turn,
                                 status="ok", attempt=number))
            return
        error = ModelError(kind=script.fail, message=f"{script.fail} happened")  # type: ignore[arg-type]
        retry = self.machine.plan_failure(error)
        self.emit(RequestEnd(session_id=SID, run_id=self.run_id, turn=self.turn,
                             status=script.fail, attempt=number, retry_in_ms=retry,  # type: ignore[arg-type]
                             error_message=error.message))

    def end(self, step: EndTask) -> None:
        if self.compacting:
            self.compacting = False
            self.emit(CompactionEnd(session_id=SID, run_id=self.run_id, status="failed",
                                    attempt=1, error_message=step.message))
            if self.machine.kind is None:
                self.pending.clear()
                return
        if step.status in ("aborted", "failed"):
            for output in list(self.pending):
                if isinstance(output, ApprovalDecision):
                    self.emit(attrs.evolve(output, decision="deny", by="default"))
            self.pending.clear()
            for block in list(self.open_calls.values()):
                self.emit(self.result(block, "interrupted", True))
            if step.status == "aborted":
                self.emit(Abort(session_id=SID, run_id=self.run_id, reason=step.message or ""))
        self.emit(TaskEnd(session_id=SID, run_id=self.run_id, status=step.status,
                          turns=self.machine.turn, usage=self.machine.usage, wall_ms=0,
                          message=step.message))


def check_fold(world: World) -> None:
    """Invariant 1: folding every prefix gives the live recorded state at that seq."""
    limits = world.machine._limits  # the same limits: fold decides the loop guard by them
    replay = TaskMachine(limits)
    for k, record in enumerate(world.records):
        replay.observe(record)
        assert replay.recorded() == world.snapshots[k], f"diverged at seq {record.seq}: {record}"
    assert fold(world.records, limits).recorded() == world.snapshots[-1]


def check_rules(world: World) -> None:
    records = world.records
    open_run: str | None = None
    open_calls: set[str] = set()
    for record in records:
        match record:
            case TaskStart():
                assert open_run is None, "a task started inside another"
                open_run = record.run_id
            case TaskEnd():
                assert open_run == record.run_id, "a task_end without its task"
                open_run = None
                assert not open_calls, "a task ended with unpaired calls (R-TOOL-7)"
            case RequestBegin():
                assert not open_calls, "a request began before every call had its result"
            case ModelMsg(block=ToolCallBlock() as block):
                open_calls.add(block.id)
            case ToolCallOutput():
                open_calls.discard(record.call_id)
            case _:
                pass
    assert open_run is None, "a task never ended (R-RUN-7)"
    assert world.machine.phase is Phase.IDLE


def run_world(attempts: list[Attempt], *, tasks: int = 1, limits: TaskLimits | None = None,
              **kwargs: Any) -> World:
    machine = TaskMachine(limits or TaskLimits(max_context_length=0))
    for n in range(tasks):
        machine.queue_task(f"task {n}")
    world = World(machine, attempts, **kwargs)
    world.run()
    check_rules(world)
    check_fold(world)
    return world


def ends(world: World) -> list[tuple[str, str | None]]:
    return [(r.status, r.message) for r in world.records if isinstance(r, TaskEnd)]


# -- decisions ---------------------------------------------------------------------------


def test_a_task_that_answers_completes_in_one_turn() -> None:
    world = run_world([Attempt()])
    assert ends(world) == [("completed", None)]
    assert world.machine.turn == 1


def test_tool_calls_make_another_turn_after_every_result() -> None:
    world = run_world([Attempt(calls=(Call("a"), Call("b", early=True))), Attempt()])
    turns = [r.turn for r in world.records if isinstance(r, RequestBegin)]
    assert turns == [1, 2]
    assert ends(world) == [("completed", None)]


def test_a_retryable_failure_is_retried_after_the_planned_wait() -> None:
    world = run_world([Attempt(fail="timeout"), Attempt(fail="malformed"), Attempt()])
    retries = [s for s in world.steps if isinstance(s, BeginAttempt)]
    assert [(s.attempt, s.delay_ms) for s in retries] == [(2, 250), (3, 500)]
    assert ends(world) == [("completed", None)]


def test_six_failed_attempts_end_the_task_failed_with_the_last_error() -> None:
    world = run_world([Attempt(fail="timeout")] * (MAX_RETRIES + 1))
    attempts = [r.attempt for r in world.records if isinstance(r, RequestBegin)]
    assert attempts == [1, 2, 3, 4, 5, 6]
    assert ends(world) == [("failed", "timeout happened")]


def test_auth_is_never_retried_and_locks_the_session() -> None:
    world = run_world([Attempt(fail="auth")], tasks=2)
    assert ends(world)[0] == ("auth", "auth happened")
    assert world.machine.auth_locked == "auth happened"
    assert fold(world.records).auth_locked == "auth happened"
    world.machine.retry_auth()
    assert world.machine.auth_locked is None


def test_an_overflow_compacts_once_and_reruns_the_same_turn() -> None:
    world = run_world([Attempt(fail="context_overflow"), Attempt()])
    begins = [(r.turn, r.attempt) for r in world.records if isinstance(r, RequestBegin)]
    assert begins == [(1, 1), (1, 1)]
    assert [s.reason for s in world.steps if isinstance(s, Compact)] == ["overflow"]
    assert ends(world) == [("completed", None)]


def test_a_second_overflow_in_one_turn_fails_the_task() -> None:
    world = run_world([Attempt(fail="context_overflow"), Attempt(fail="context_overflow")])
    assert [s.reason for s in world.steps if isinstance(s, Compact)] == ["overflow"]
    assert ends(world) == [("failed", "context_overflow happened")]


def test_a_failed_overflow_compaction_fails_the_task_and_auth_locks_it() -> None:
    world = run_world([Attempt(fail="context_overflow")], compactions=["auth"])
    assert ends(world) == [("auth", "auth")]
    assert world.machine.auth_locked == "auth"


def test_a_context_trigger_compacts_before_the_next_turn_once() -> None:
    limits = TaskLimits(max_context_length=100)
    world = run_world([Attempt(calls=(Call("a"),), tokens=200), Attempt()], limits=limits,
                      compactions=["timeout"])
    # The failed compaction is not tried again before the same turn (R-COMPACT-7).
    assert [s.reason for s in world.steps if isinstance(s, Compact)] == ["context"]
    assert ends(world) == [("completed", None)]


def test_max_turns_ends_the_task_with_its_status() -> None:
    world = run_world([Attempt(calls=(Call("a"),)), Attempt(calls=(Call("b"),))],
                      limits=TaskLimits(max_turns=2, max_context_length=0))
    assert ends(world) == [("max_turns", "stopped after max_turns=2 turns")]


def test_the_same_call_in_three_turns_is_a_loop() -> None:
    world = run_world([Attempt(calls=(Call("same"),))] * 3,
                      limits=TaskLimits(max_context_length=0))
    status, message = ends(world)[0]
    assert status == "loop_detected" and "3 turns in a row" in (message or "")


def test_turns_whose_calls_all_fail_are_no_progress() -> None:
    attempts = [Attempt(calls=(Call(f"t{n}", error=True),)) for n in range(5)]
    world = run_world(attempts, limits=TaskLimits(max_context_length=0))
    status, message = ends(world)[0]
    assert status == "loop_detected" and "made no progress" in (message or "")


def test_steering_after_a_final_answer_continues_the_task() -> None:
    steered: list[bool] = []

    def steer(n: int, world: World) -> None:
        if isinstance(world.records[-1], ModelMsg) or (
            isinstance(world.records[-1], TokenUsageOutput) and not steered
        ):
            steered.append(True)
            world.machine.queue_steering((TextBlock(text="also this"),))

    world = run_world([Attempt(), Attempt()], on_record=steer)
    kinds = [r.kind for r in world.records if isinstance(r, UserMsg)]
    assert kinds == ["prompt", "steering"]  # R-STEER-3
    assert ends(world) == [("completed", None)]


def test_steering_a_record_cannot_carry_merged_goes_over_the_next_turns_in_order() -> None:
    """R-STEER-2, R-CLUSTER-2: with a limit on a record of steering (a cluster's NATS
    server's), the steering queued during a turn is taken in order while it fits, the rest
    by the next turns: each input once, in order, named by the ids it delivers; an input
    over the limit alone still goes, alone (before: all in one record, which stopped the
    session on its host)."""
    sizes = {"a": 1000, "b": 1000, "c": 1000, "d": 3000, "e": 10}

    def steer(n: int, world: World) -> None:
        if isinstance(world.records[-1], RequestBegin) and world.turn == 1:
            for name, size in sizes.items():
                blocks = (TextBlock(text=name * size),)
                world.machine.queue_steering(blocks, steering_id=f"steer_{name}")

    limits = TaskLimits(max_context_length=0, largest_steering=2500)
    world = run_world([Attempt()], limits=limits, on_record=steer)
    taken = [
        (step.steering_ids, "".join(b.text for b in step.steering if isinstance(b, TextBlock)))
        for step in world.steps
        if isinstance(step, BeginTurn) and step.steering
    ]
    assert [ids for ids, _ in taken] == [
        ("steer_a", "steer_b"), ("steer_c",), ("steer_d",), ("steer_e",)
    ]
    assert "".join(text for _, text in taken) == "".join(k * v for k, v in sizes.items())
    assert ends(world) == [("completed", None)]


def test_the_stop_hook_continues_at_most_its_limit() -> None:
    limits = TaskLimits(max_context_length=0, has_stop_hook=True, max_stop_continuations=1)
    world = run_world([Attempt(), Attempt()], limits=limits,
                      hook_answers=["keep going", "and again"])
    hooks = [s for s in world.steps if isinstance(s, CallHook)]
    assert [h.continuations for h in hooks] == [0]
    steering = [r for r in world.records if isinstance(r, UserMsg) and r.kind == "steering"]
    assert steering[0].content == (TextBlock(text="keep going"),)
    assert ends(world) == [("completed", None)]


def test_a_stop_hooks_answer_past_what_a_record_carries_is_cut_with_a_marker() -> None:
    """R-SEC-9, R-CLUSTER-1: an ``on_stop`` hook's answer of 5,000 characters under a
    2,500-byte record limit is delivered as its start and a marker saying how much was
    cut and that the rest is not kept, within the limit: alone it is one ``user_msg``,
    which a cluster could not carry (before: all 5,000, and the session stopped on its
    host). Without a limit (a file trace) it is delivered whole."""
    answer = "k" * 5000

    def delivered(largest: int | None) -> tuple[UserContent, ...]:
        limits = TaskLimits(
            max_context_length=0, has_stop_hook=True, largest_steering=largest
        )
        world = run_world([Attempt(), Attempt()], limits=limits, hook_answers=[answer])
        assert ends(world) == [("completed", None)]
        (steering,) = [r for r in world.records if isinstance(r, UserMsg) and r.kind == "steering"]
        return steering.content

    (cut,) = delivered(2500)
    assert isinstance(cut, TextBlock)
    kept = cut.text.index("\n[cut: ")
    assert cut.text[:kept] == "k" * kept and kept > 2000
    assert cut.text[kept:] == (
        f"\n[cut: {5000 - kept} of 5000 characters left out to fit one record of this "
        "session's trace (2500 bytes); the rest is not kept]"
    )
    assert 2400 < input_size((cut,)) <= 2500
    assert delivered(None) == (TextBlock(text=answer),)


def test_the_results_hook_runs_once_per_turn_with_calls() -> None:
    limits = TaskLimits(max_context_length=0, has_results_hook=True)
    world = run_world([Attempt(calls=(Call("a"),)), Attempt(calls=(Call("b"),)), Attempt()],
                      limits=limits)
    assert [s.hook for s in world.steps if isinstance(s, CallHook)] == [
        "after_tool_results", "after_tool_results"]


def test_follow_ups_run_in_order_after_the_task() -> None:
    world = run_world([Attempt(), Attempt(), Attempt()], tasks=3)
    prompts = [r.content[0].text for r in world.records  # type: ignore[union-attr]
               if isinstance(r, UserMsg) and r.kind == "prompt"]
    assert prompts == ["task 0", "task 1", "task 2"]


def test_an_interrupt_ends_the_task_and_drops_the_follow_ups() -> None:
    def interrupt(n: int, world: World) -> None:
        if isinstance(world.records[-1], ModelMsg):
            world.machine.interrupt("stop")

    world = run_world([Attempt(calls=(Call("a"),))], tasks=3, on_record=interrupt)
    assert ends(world) == [("aborted", "stop")]
    assert sum(isinstance(r, Abort) for r in world.records) == 1


def test_an_interrupt_before_the_task_starts_still_ends_it_aborted() -> None:
    machine = TaskMachine(TaskLimits(max_context_length=0))
    machine.queue_task("t")
    step = machine.next_step()
    assert isinstance(step, StartTask)
    machine.interrupt("too soon")
    machine.observe(TaskStart(session_id=SID, run_id="r", seq=1, input_seq=None))
    assert machine.next_step() == EndTask(status="aborted", message="too soon")


def test_an_interrupt_when_idle_starts_nothing() -> None:
    machine = TaskMachine()
    machine.interrupt("nothing runs")
    assert machine.next_step() == Finish()


def test_a_trace_failure_ends_the_task_failed_and_the_follow_ups_still_run() -> None:
    def fail(n: int, world: World) -> None:
        if isinstance(world.records[-1], TaskStart) and world.runs == 1:
            world.machine.fail("cannot write the trace")

    world = run_world([Attempt()], tasks=2, on_record=fail)
    assert ends(world) == [("failed", "cannot write the trace"), ("completed", None)]


def test_a_budget_ends_the_task_before_the_turn_it_was_issued_and_follow_ups_still_run() -> None:
    """R-SHARE-4: told, instead of carrying out its BeginTurn, that the request could pass
    a budget, the machine ends the task budget_exceeded with the budget's words; no
    request of that turn is recorded; the next task still starts (and may meet it too)."""
    machine = TaskMachine(TaskLimits(max_context_length=0))
    machine.queue_task("t")
    machine.queue_task("after")
    assert isinstance(machine.next_step(), StartTask)
    machine.observe(TaskStart(session_id=SID, run_id="r", seq=1, input_seq=None))
    assert isinstance(machine.next_step(), BeginTurn)
    machine.exceed_budget("budget exceeded: max_cost_usd=1")
    assert machine.stopping and machine.stop_reason == "budget exceeded: max_cost_usd=1"
    step = machine.next_step()
    assert step == EndTask(status="budget_exceeded", message="budget exceeded: max_cost_usd=1")
    machine.observe(TaskEnd(session_id=SID, run_id="r", seq=2, status="budget_exceeded",
                            turns=0, usage=machine.usage, wall_ms=0, message=step.message))
    assert machine.usage == TokenUsage(cost_usd=0.0)  # a task that spent nothing
    assert isinstance(machine.next_step(), StartTask)
    assert not machine.stopping


def test_a_manual_compaction_is_a_task_without_task_records() -> None:
    machine = TaskMachine()
    machine.queue_task(None, "compaction")
    machine.queue_task("after")
    world = World(machine, [Attempt()])
    world.run()
    check_fold(world)
    types = [r.type for r in world.records]
    assert types[:2] == ["compaction_begin", "compaction_end"]
    assert types[2:4] == ["user_msg", "task_start"]


def test_steps_are_issued_once_until_their_record_comes() -> None:
    machine = TaskMachine()
    machine.queue_task("t")
    assert isinstance(machine.next_step(), StartTask)
    assert machine.next_step() == Wait()
    machine.observe(TaskStart(session_id=SID, run_id="r", seq=2, input_seq=1))
    step = machine.next_step()
    assert isinstance(step, BeginTurn) and step.turn == 1
    assert machine.next_step() == Wait()


def test_a_person_asked_is_what_the_task_waits_for() -> None:
    seen: list[str | None] = []

    def look(n: int, world: World) -> None:
        if isinstance(world.records[-1], RequestEnd):
            seen.append(world.machine.waiting_for)

    run_world([Attempt(calls=(Call("a", ask=True),)), Attempt()], on_record=look)
    assert seen[0] == "people"


def test_a_subagents_answered_task_holds_while_background_children_run() -> None:
    """R-TREE-2: with ``wait_for_children`` an answered turn waits (issues nothing) while
    children run; their answer as steering continues the task; a root's task ends."""
    for holds in (True, False):
        machine = TaskMachine(TaskLimits(max_context_length=0, wait_for_children=holds))
        machine.queue_task("t")
        world = World(machine, [Attempt()])
        world.start(machine.next_step())  # type: ignore[arg-type]
        machine.children_running(1)
        world.turn = 1
        assert isinstance(machine.next_step(), BeginTurn)
        world.attempt(1)
        while world.pending:
            world.emit(world.pending.pop(0))
        step = machine.next_step()
        if not holds:
            assert isinstance(step, EndTask) and step.status == "completed"
            assert not machine.takes_steering  # ending: steering would be lost with it
            continue
        assert step == Wait() and machine.waiting_for == "children"
        assert machine.next_step() == Wait()  # nothing was issued
        assert machine.takes_steering
        machine.queue_steering((TextBlock(text="[subagent c finished] done"),))
        machine.children_running(0)
        step = machine.next_step()
        assert isinstance(step, BeginTurn) and step.turn == 2
        assert step.steering == (TextBlock(text="[subagent c finished] done"),)


def test_allow_session_is_remembered_from_the_trace() -> None:
    decision = ApprovalDecision(session_id=SID, run_id="r", seq=1, call_id="c", tool="write",
                                decision="allow", by="host", remember=True)
    assert fold([decision]).allowed_for_session("write")
    assert not fold([attrs.evolve(decision, remember=False)]).allowed_for_session("write")


# -- properties --------------------------------------------------------------------------

calls = st.builds(Call, tool=st.sampled_from(["a", "b", "c"]), error=st.booleans(),
                  early=st.booleans(), ask=st.booleans(), deny=st.booleans())
attempts = st.builds(
    Attempt,
    calls=st.lists(calls, max_size=3).map(tuple),
    fail=st.sampled_from([None, None, None, "timeout", "malformed", "failed", "auth",
                          "context_overflow"]),
    tokens=st.integers(1, 300),
)


@settings(max_examples=300, deadline=None)
@given(
    script=st.lists(attempts, max_size=14),
    tasks=st.integers(1, 3),
    compactions=st.lists(st.sampled_from(["ok", "ok", "timeout", "auth", "interrupt"]),
                         max_size=3),
    hooks=st.lists(st.one_of(st.none(), st.just("more")), max_size=3),
    limits=st.builds(
        TaskLimits,
        max_turns=st.integers(-1, 6),
        max_context_length=st.sampled_from([0, 150, 400]),
        max_session_turns=st.sampled_from([-1, 3]),
        loop_repeat_threshold=st.integers(0, 4),
        loop_no_progress_threshold=st.integers(0, 4),
        has_stop_hook=st.booleans(),
        max_stop_continuations=st.integers(0, 2),
        has_results_hook=st.booleans(),
    ),
    interrupt_at=st.one_of(st.none(), st.integers(1, 60)),
    steer_at=st.lists(st.integers(1, 60), max_size=3),
)
def test_any_run_keeps_the_rules_and_folds_to_the_live_state(
    script: list[Attempt],
    tasks: int,
    compactions: list[str],
    hooks: list[str | None],
    limits: TaskLimits,
    interrupt_at: int | None,
    steer_at: list[int],
) -> None:
    def inputs(n: int, world: World) -> None:
        if n in steer_at:
            world.machine.queue_steering((TextBlock(text=f"steer {n}"),))
        if n == interrupt_at:
            world.machine.interrupt("interrupted")

    run_world(script, tasks=tasks, limits=limits, compactions=compactions,
              hook_answers=hooks, on_record=inputs)
