"""The session supervisor: one loop over one inbox, where a session's work moves on.

One supervisor runs while a session has work — a ``Session.run`` and the tasks queued
behind it, or a manual compaction — as a trio task in the host's nursery, and ends with
the work: an idle session has no task running (R-HOST-1). A task that waits only for
people is parked: its supervisor ends and a new one takes it up when an answer (or an
interrupt) comes (R-HITL-3).

The loop asks the session's task machine (:mod:`greenroom.protocols.task`, pure) for the
next step and carries it out; when the step is to wait, it takes the next message from its
one inbox. Everything reaches it there: the session handle's commands (tasks, steering,
interrupt, skip, the auth unlock, people's answers), the LLM streamer's batches (a turn's
and a compaction's), the approval broker's decisions, the tool pool's results and its
calls' questions to people, subagents' outputs, hook answers, and the end of its own
waits. The open task's parts — its actors, turns, compaction — are a
:class:`~greenroom.actors.runtime.running_task.RunningTask`.
Every traced output goes through the :class:`~greenroom.actors.runtime.emitter.OutputEmitter`,
which feeds it to the transcript and the task machine: the machine learns what happened
exactly as a fold of the trace would (invariant 1 of the task machine).

The trace comes first (R-RUN-8, R-TRACE-3): a batch is published only once its records are
written; a task's input is durable before its ``task_start``, and the trace at every turn
boundary (R-TRACE-2). While the supervisor waits for a sync (or for a prompt's images to be
read) it keeps serving its inbox, so neither an interrupt nor a steer waits for the disk. A
record that cannot be written ends the task ``failed`` with the reason (R-SEC-1).

Interrupt is cancellation: a task's actors live in one cancel scope, which ending the task
cancels; the supervisor then settles the turn (R-ABORT-1..3) and emits exactly one
``task_end`` under a shielded, bounded scope.

A subagent (R-HOST-4, :mod:`greenroom.actors.runtime.subagents`) runs its own supervisor
inside a ``spawn_subagent`` call's task (:func:`run_child`), or, in the background, in the
host's nursery like any session's (:func:`start`); its outputs come back through this
supervisor's inbox (``SubagentOutputs``) as live outputs of this run, tagged with their
``origin`` and never traced here, and a background child's end as ``SubagentFinished``:
steering of the open task, or a follow-up (R-TREE-2), which the session's close holds at its
next turn boundary rather than ending it (:func:`_close_holds`). An interrupt of scope
``tree`` ends the session's running children too
(:func:`~greenroom.actors.runtime.tree.end_subtree`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar, assert_never

import attrs
import trio

from greenroom.actors.runtime.attachments import attach, has_images
from greenroom.actors.runtime.drain import holds_for_drain, rests_with_children
from greenroom.actors.runtime.emitter import OutputEmitter, repaired_blocks
from greenroom.actors.runtime.errors import ImageRefused
from greenroom.actors.runtime.port import (
    Approval,
    SessionPort,
    TaskInput,
    left_open,
    left_unstarted,
)
from greenroom.actors.runtime.receipts import InputReceipt, drop_unrun, taken
from greenroom.actors.runtime.resumption import parked_or_lost, queued_record, requeue_recorded
from greenroom.actors.runtime.running_task import RunningTask, build_request
from greenroom.actors.runtime.tree import background_count, end_subtree, tell
from greenroom.actors.runtime.turn_runner import TurnRunner
from greenroom.protocols.content import UserContent
from greenroom.protocols.messages import (
    ActorFailed,
    ApprovalAsked,
    ApprovalDecided,
    AuthRetried,
    BackoffSkipped,
    HookAnswered,
    InterruptTask,
    PersonAnswered,
    QuestionAnswered,
    QuestionAsked,
    SteeringQueued,
    StreamBatch,
    SubagentFinished,
    SubagentOutputs,
    SupervisorMessage,
    TaskQueued,
    ToolCallChecked,
    ToolCallFinished,
    ToolProgressed,
    TraceFailed,
    WorkDone,
)
from greenroom.protocols.outputs import (
    Output,
    SteeringQueuedOutput,
    TaskQueueDropped,
    TaskStart,
    TaskStatus,
    UserMsg,
)
from greenroom.protocols.people import ASK_USER, PEOPLE
from greenroom.protocols.task import (
    BeginAttempt,
    BeginTurn,
    CallHook,
    Compact,
    EndTask,
    Finish,
    Phase,
    StartTask,
    TaskKind,
    Wait,
)
from greenroom.protocols.turn import CallState

__all__ = [
    "ABORT_GRACE_S",
    "SessionSupervisor",
    "build_request",
    "end_left_work",
    "run_child",
    "start",
    "take_up_stored",
    "wake",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

CANCELLED_BY_HOST = "cancelled by host"
"""The interrupt reason of a run whose ``cancel`` event was set."""

STALE_QUEUE = "not taken up after the session's host stopped; new work started"
"""Why follow-ups a stopped host left recorded as queued are dropped when the session's
next work starts without them (nobody took them up: ``Host.resume`` would have queued
them), as its open task is then recovered as interrupted (R-TRACE-4)."""

CLOSE_HOLD_S = 10.0
"""Bound on how long a session's close lets a task that a background child's answer
started go on to its next turn boundary (:func:`_close_holds`) before interrupting it:
well within the host's shutdown bound (``host.SHUTDOWN_GRACE_S``)."""

ABORT_GRACE_S = 2.0
"""Bound on the shielded teardown after a task: writing its last records (``abort``,
``task_end``) and syncing the trace. Well above the usual few milliseconds, far below a
hang."""


class SessionSupervisor:
    """Runs the work of one session while it has some; see the module docstring."""

    def __init__(
        self,
        port: SessionPort,
        output: trio.MemorySendChannel[list[Output]],
        cancel: trio.Event | None,
        ended_first: InterruptTask | None = None,
    ) -> None:
        self._port = port
        self._machine = port.machine
        self._output = output
        self._cancel_event = cancel
        self._ended_first = ended_first
        # Unbounded on purpose: the session handle, the streamer, the broker, the pool,
        # subagents and hook calls all send with send_nowait and must never block on the
        # supervisor, which drains the inbox whenever it is not carrying out a step.
        self.inbox, self._inbox = trio.open_memory_channel[SupervisorMessage](math.inf)
        """The send side of the one inbox: the session handle's way in."""
        # A function of the inbox alone, not a method of the supervisor: the emitter
        # holding the supervisor would make a cycle that only the cyclic collector frees,
        # and with it the channels and machines of every finished run (R-PERF-1).
        trace_failed = functools.partial(_report_trace_failure, self.inbox)
        self._out = OutputEmitter(port, output, trace_failed)
        self._nursery: trio.Nursery | None = None
        self._task: RunningTask | None = None
        # What steering that comes once its task has ended runs with (R-STEER-1).
        self._ended: TaskInput | None = None
        self._asked_token = 0
        self._done_token = 0
        self._boundary_synced: tuple[str | None, int] = (None, 0)
        self._parked = False
        self._closing = False  # the close holds its task at its next boundary

    # -- the loop -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the queued work, then close the output channel. Ready at once: the inbox
        exists from construction, so nothing sent before the first step is lost. Never
        raises except on host shutdown."""
        task_status.started()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._out.serve_in(nursery)
            if self._cancel_event is not None:
                nursery.start_soon(forward_cancel, self._cancel_event, self.inbox)
            try:
                await self._loop()
            finally:
                _make_idle(self._port, self.inbox)
                _pass_on_leftovers(self._port, self._inbox, self._out)
                with trio.CancelScope(shield=True):
                    if self._task is not None:
                        await self._task.stop_work()
                    self._out.flush()
                    with trio.move_on_after(ABORT_GRACE_S):
                        await self._out.wait_published()
                    # Past the bound the disk hangs: what is left still reaches its
                    # readers, the last task_end above all.
                    self._out.publish_unwritten()
                    if not self._parked:
                        # A parked task's run goes on when it wakes: its reader waits.
                        await self._output.aclose()
                nursery.cancel_scope.cancel()

    async def _loop(self) -> None:
        step = self._first_step
        while True:
            try:
                if await step():
                    return
            except Exception as exc:  # a bug ends the task visibly, never the host (R-SEC-1)
                if self._machine.run_id is None or self._task is None:
                    return _abandon(self._port)
                logger.error("session %s: its task failed", self._port.id, exc_info=True)
                await self._end_task("failed", f"internal error: {exc!r}", crashed=True)
            step = self._step

    async def _first_step(self) -> bool:
        if self._machine.run_id is not None:
            await self._resume()  # a woken or reloaded task: taken up before its inbox is read
        else:
            # The run's own task (its handle sent it first) starts before later messages
            # are read: an interrupt that follows at once ends it aborted, not dropped.
            if not self._machine.has_queued_tasks:  # else taken up: Host.resume queued them
                _drop_recorded(self._out, self._port, STALE_QUEUE)
            with contextlib.suppress(trio.WouldBlock):
                self._handle(self._inbox.receive_nowait())
        return False

    async def _step(self) -> bool:
        """Carry out one step; True once the session has no work (or it is parked)."""
        machine = self._machine
        task = self._task
        if machine.run_id is None and task is not None:
            # A manual compaction ended on its own record: its actors end with it.
            self._task = None
            await task.stop_work()
        compaction = task.compaction if task is not None else None
        if compaction is not None and compaction.ready:
            await compaction.finish(self._sync)
            return False
        if machine.phase is Phase.TURN_DONE and not machine.stopping:
            boundary = (machine.run_id, machine.turn)
            if self._boundary_synced != boundary:
                self._boundary_synced = boundary
                await self._sync()  # R-TRACE-2: durable at every turn boundary
                return False
        machine.children_running(background_count(self._port))
        step = machine.next_step()
        match step:
            case Wait():
                if self._drain():
                    return False  # what was waiting may have changed the next step
                self._out.flush()
                if self._may_park():
                    await self._park()
                    return True
                if rests_with_children(self._port):  # R-DRAIN-1: no answer would come
                    return await self._hold((), ())
                self._handle(await self._inbox.receive())
                self._drain()
                self._out.flush()
            case StartTask(task=input_, kind=kind):
                await self._start_task(input_, kind)
            case Compact(reason=reason):
                self._running().start_compaction(reason)
            case BeginTurn(turn=turn, steering=steering, steering_ids=ids):
                if _holds(self._port, self._closing):
                    return await self._hold(steering, ids)
                await self._begin_turn(turn, steering, ids)
            case BeginAttempt(attempt=attempt, delay_ms=delay_ms):
                # A retry takes no steering: with some queued, a later boundary records it.
                if _holds(self._port, self._closing) and not machine.steering_queued:
                    return await self._hold((), ())
                self._running().begin_attempt(attempt, delay_ms)
            case CallHook():
                self._running().call_hook(step)
            case EndTask(status=status, message=message):
                await self._end_task(status, message)
            case Finish():
                return self._finish()
            case _:
                assert_never(step)
        return False

    def _running(self) -> RunningTask:
        assert self._task is not None
        return self._task

    def _drain(self) -> bool:
        """Handle every message already waiting, without blocking; whether there was any."""
        receive = self._inbox
        handled = False
        while True:
            try:
                message = receive.receive_nowait()
            except trio.WouldBlock:
                return handled
            self._handle(message)
            handled = True

    def _handle(self, message: SupervisorMessage) -> None:
        """One inbox message."""
        task = self._task
        machine = self._machine
        match message:
            case StreamBatch():
                # The hot path: one batch per network read.
                if task is not None:
                    task.on_batch(message)
            case (
                ToolCallFinished()
                | ToolProgressed()
                | ApprovalDecided()
                | ApprovalAsked()
                | ToolCallChecked()
            ):
                if task is not None:
                    task.on_turn_message(message)
            case QuestionAsked():
                if task is not None:
                    task.on_turn_message(message)
                else:  # the call's task has ended: nobody is asked
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        message.reply.send_nowait(QuestionAnswered(action="cancel"))
            case SubagentOutputs():
                # Live outputs of this run, already in the subagent's trace (R-HOST-4).
                self._out.forward(message.outputs, message.origin)
            case SteeringQueued() if machine.takes_steering:
                _queue_steering(self._out, self._port, message, task)
            case SteeringQueued():  # late: its task was ending or interrupted
                came_for = task.task if task is not None else self._ended
                _run_late_steering(self._out, self._port, message, came_for)
            case SubagentFinished():
                _take_answer(self._out, self._port, message)
            case TaskQueued():
                _queue_task(self._out, self._port, message)
            case InterruptTask():
                held = _close_holds(self._port, message, task, self._nursery, self.inbox)
                self._closing = self._closing or held
                if not held:
                    _interrupt(self._out, self._port, message)
            case BackoffSkipped():
                if task is not None:
                    task.skip_backoff()
            case AuthRetried():
                machine.retry_auth()
            case HookAnswered():
                answer = message.answer
                machine.hook_answered(answer if isinstance(answer, str) else None)
            case WorkDone():
                self._done_token = max(self._done_token, message.token)
            case TraceFailed() | ActorFailed():
                machine.fail(message.message)
            case PersonAnswered():
                refused = (
                    task.answer(message)
                    if task is not None
                    else f"session {self._port.id} has no request waiting for an answer"
                )
                if message.reply is not None:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        message.reply.send_nowait(refused)
            case _:
                assert_never(message)

    # -- steps ----------------------------------------------------------------------------

    async def _start_task(self, input_: TaskInput | None, kind: TaskKind) -> None:
        port = self._port
        task = self._task = RunningTask(
            port, self._out, input_, run_id=port.new_run_id(), started_at=trio.current_time()
        )
        self._out.begin_task()
        self._machine.configure(port.task_limits())
        if kind == "compaction" or input_ is None:
            await self._open(task)
            task.start_compaction("manual")
            return
        # R-SEC-8: the prompt's images are read now, once, before anything is recorded;
        # one that is refused (or an interrupt meanwhile) ends the task with nothing else.
        content: tuple[UserContent, ...] | str | None = tuple(input_.content)
        if has_images(input_.content):
            read = await self._serving(lambda: _attach_prompt(port, input_.content))
            content = read[0] if read is not None else None
        if not isinstance(content, tuple):
            _refused(self._out, port, task, input_, content)
            return
        # R-TRACE-3: the input is a fact of the session before the task starts: durable
        # before task_start exists.
        schema = input_.output.schema if input_.output is not None else None
        prompt = self._out.emit(
            UserMsg(
                session_id=port.id, run_id=task.run_id, kind="prompt",
                content=repaired_blocks(content), output_schema=schema,
                queued_id=input_.queued_id,
            )
        )
        await self._sync()
        self._out.emit(TaskStart(session_id=port.id, run_id=task.run_id, input_seq=prompt.seq,
                                 output_schema=schema))
        self._out.flush()
        await self._open(task)

    async def _open(self, task: RunningTask) -> None:
        assert self._nursery is not None
        await task.open(self._nursery, self.inbox, run_child)

    async def _begin_turn(
        self, turn: int, steering: tuple[UserContent, ...], ids: tuple[str, ...]
    ) -> None:
        attached = await self._attached(steering)
        if attached is not None:
            self._running().begin_turn(turn, attached, ids)

    async def _attached(self, steering: tuple[UserContent, ...]) -> tuple[UserContent, ...] | None:
        """``steering`` with its images attached; None when interrupted meanwhile (the
        task ends at the next step)."""
        if not steering:
            return steering
        # R-SEC-8: images not attached yet are read now; a refused one becomes a line
        # saying so, and the steering's words still count.
        read = await self._serving(lambda: attach(steering, self._port.attachments, fold=True))
        return None if read is None else read[0]

    async def _hold(self, steering: tuple[UserContent, ...], ids: tuple[str, ...]) -> bool:
        """The host drains (R-DRAIN-1): the task stops at this boundary instead of sending
        its next request, open in its trace with the steering the turn took recorded, and
        holds nothing — like a parked task, a message wakes it. The next host (or this
        one, woken) takes it up with nothing lost and nothing re-run. False if not held."""
        attached = await self._attached(steering)
        machine, port = self._machine, self._port
        if attached is None:
            return False
        machine.hold()
        if attached:
            self._out.emit(UserMsg(session_id=port.id, run_id=machine.run_id or "",
                                   kind="steering", content=attached, steering_ids=ids))
        if not await self._sync() or machine.steering_queued:
            # An interrupt came during the sync (the task ends at its next step), or
            # steering (a later boundary holds, with it recorded).
            return False
        task, self._task = self._running(), None
        port.parked_task = await task.park(self._output, self._cancel_event)
        port.held = True
        self._parked = _keeps_reader(port, self._closing)
        return True

    async def _end_task(
        self, status: TaskStatus, message: str | None, *, crashed: bool = False
    ) -> None:
        """End the open task with ``status``: its actors stop, what is in flight is
        settled, and its one ``task_end`` is written (R-RUN-7)."""
        machine = self._machine
        task = self._running()
        await task.stop_work(finished=status == "completed")
        # Results that arrived before the actors stopped still count.
        with contextlib.suppress(*((Exception,) if crashed else ())):
            self._drain()
        # The trace may be what failed: settling is then best effort.
        task.settle(status, message, best_effort=crashed or status == "failed")
        self._task, self._ended = None, task.task
        if task.task is None:
            return  # a manual compaction has no task records
        with trio.CancelScope(shield=True) as teardown:
            teardown.deadline = trio.current_time() + ABORT_GRACE_S
            end = task.task_end(status, message)
            self._out.emit(end)
            if machine.run_id is not None:
                # The record could not be encoded or written: the machine still ends the
                # task, as the trace would have told it.
                machine.observe(end)
            # Written now, published once the session is idle or the next task runs;
            # the sync below only fsyncs it (if anything). A trace that cannot be written
            # must not cost the host: task_end still reaches its readers.
            self._out.commit()
            await self._out.sync_task_end(completed=status == "completed")
        _leave_answers(self._out, self._port)
        if machine.has_queued_tasks:
            self._out.flush()

    def _finish(self) -> bool:
        """No work is left: the session becomes idle — unless a task was queued since the
        last look at the inbox. Synchronous, so nothing can arrive in between."""
        self._drain()
        if self._machine.busy:
            return False
        _make_idle(self._port, self.inbox)
        return True

    # -- people: parking and resuming (R-HITL) ----------------------------------------------

    def _may_park(self) -> bool:
        """A task that waits only for people (and has nothing else in flight or in its
        inbox) holds nothing while it waits (R-HITL-3): a root's, or a background
        subagent's (its spawning call has returned; a foreground one's runs in that call)."""
        machine, port = self._machine, self._port
        if machine.waiting_for != "people" or (
            port.parent_id is not None and port.report_as is None
        ):
            return False
        task = self._task
        return (
            not machine.stopping
            and task is not None
            and task.task is not None
            and task.compaction is None
            and _answered_elsewhere(port, task.task.approve, task.turns)
        )

    async def _park(self) -> None:
        task, self._task = self._running(), None
        self._port.parked_task = await task.park(self._output, self._cancel_event)
        self._parked = _keeps_reader(self._port, self._closing)

    async def _resume(self) -> None:
        """Take up the session's open task: woken from parking, or loaded after its host
        stopped (R-HITL-4; :mod:`greenroom.actors.runtime.resumption`)."""
        port, machine = self._port, self._machine
        port.held = False
        input_, parked = parked_or_lost(port)
        started = parked.started_at if parked is not None else trio.current_time()
        task = self._task = RunningTask(
            port, self._out, input_, run_id=machine.run_id or "", started_at=started
        )
        self._out.begin_task()
        machine.configure(port.task_limits())
        await self._open(task)
        ended, self._ended_first = self._ended_first, None
        if ended is not None:
            # Before the take-up, which would resolve or ask again what its host left
            # open: a task that ends at once runs nothing and asks nobody (R-ABORT-1).
            self._handle(ended)
        task.take_up(lost_host=parked is None)
        cancel = self._cancel_event
        if cancel is not None and cancel.is_set():
            # Set while the task was parked (nothing watched it then): the task ends
            # before anything in the inbox — an answer above all — can start a call.
            machine.interrupt(CANCELLED_BY_HOST)

    # -- waits that keep the inbox served ---------------------------------------------------

    async def _sync(self) -> bool:
        """Make the trace durable (R-TRACE-2), serving the inbox meanwhile. Returns False
        when the task was told to stop before the sync came back (it goes on unobserved);
        a failed sync ends the task ``failed`` through ``TraceFailed``."""
        self._out.flush()
        done = await self._serving(self._out.sync)
        return done is not None and not self._machine.stopping

    async def _serving(self, work: Callable[[], Awaitable[T]]) -> tuple[T] | None:
        """Run ``work`` in a task of its own while the supervisor keeps serving its inbox,
        so that neither an interrupt nor a steer waits for it. Returns its result, or
        None when the task was told to stop first, or as it ended (the work is cancelled,
        a thread it waits on abandoned): nothing more is done for a stopped task."""
        assert self._nursery is not None
        self._asked_token += 1
        token = self._asked_token
        scope = trio.CancelScope()
        result: list[T] = []
        failure: list[Exception] = []
        inbox = self.inbox

        async def run() -> None:
            try:
                with scope:
                    result.append(await work())
            except Exception as exc:  # raised again in the supervisor's own task
                failure.append(exc)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                inbox.send_nowait(WorkDone(token=token))

        self._nursery.start_soon(run)
        while self._done_token < token:
            if self._machine.stopping:
                scope.cancel()
                return None
            self._handle(await self._inbox.receive())
            self._drain()
            self._out.flush()
        if failure:
            raise failure[0]
        return (result[0],) if result and not self._machine.stopping else None


def _take_answer(out: OutputEmitter, port: SessionPort, message: SubagentFinished) -> None:
    """A background child's end (R-TREE-2): steering of a task that goes on, else a task
    of its own after the one that ends (never dropped with it). A closing session runs no
    more tasks: its answer is recorded as a queued follow-up (``task_queued``) before the
    close ends, for the next host that takes the session up (R-STEER-6, R-DRAIN-1)."""
    machine = port.machine
    if machine.takes_steering:
        machine.queue_steering(repaired_blocks(message.content), message.follow_up)
    elif port.closed:
        out.emit(queued_record(port, message.follow_up)[1])
        out.flush()
    else:
        machine.queue_task(message.follow_up)


def _leave_answers(out: OutputEmitter, port: SessionPort) -> None:
    """A task of a closing session has ended. What is queued behind it now is children's
    answers (a user's follow-ups went with the close's interrupt, and a closing session
    takes no new ones): no task runs them here; each is recorded as a queued follow-up
    (``task_queued``, written now, made durable by the close's sync) that the next host
    takes up (R-TREE-2, R-STEER-6). An answer once accepted is in its parent's trace,
    whenever the host closes."""
    machine = port.machine
    if not (port.closed and machine.has_queued_tasks):
        return
    _record_answers(out, port)
    machine.interrupt(f"session {port.id} closed")  # no task is open: only the queue goes


def _record_answers(out: OutputEmitter, port: SessionPort) -> None:
    """Record each child's answer queued in ``port``'s machine (in memory alone: no
    ``queued_id``) as a queued follow-up (``task_queued``), for the next host."""
    for answer in port.machine.queued_tasks:
        if isinstance(answer, TaskInput) and answer.queued_id is None:
            out.emit(queued_record(port, answer)[1])


def _queue_task(out: OutputEmitter, port: SessionPort, message: TaskQueued) -> None:
    """Queue the task ``message`` brings. A user's follow-up is recorded first
    (``task_queued``, written at once, its ``recorded`` settled once the record is
    durable: fsynced, or in a cluster acknowledged by JetStream), so that a host that takes
    the session up runs it (R-STEER-6); a closing session takes none (it accepts no more
    work: R-HOST-3), and ``recorded`` says it was dropped. A background child's report is
    not recorded: its parent gets it from the child's own trace when the child is taken up
    (``child_reports``), and recording it here too would deliver it twice — unless the
    session closes before it runs (:func:`_leave_answers`)."""
    task = message.task
    with _handed_to_machine(message.recorded):
        if message.follow_up and isinstance(task, TaskInput):
            if port.closed:
                closed = f"session {port.id} closed before the follow-up ran"
                drop_unrun(message.recorded, closed)
                return
            task = _record_follow_up(out, port, task, message.recorded)
        port.machine.queue_task(task, message.kind)


@contextlib.contextmanager
def _handed_to_machine(recorded: InputReceipt | None) -> Iterator[None]:
    """Queued input, once the block has put it in the task machine or dropped it (or
    failed on a bug, which fails the task): whoever counted it apart until the machine
    took it (``InputReceipt.on_taken``, the gateway's cap: R-SEC-9) stops now."""
    try:
        yield
    finally:
        taken(recorded)


def _record_follow_up(
    out: OutputEmitter, port: SessionPort, task: TaskInput, recorded: InputReceipt | None
) -> TaskInput:
    """``task`` recorded as queued (``task_queued``, written at once), under the id its
    prompt will name; ``recorded`` settles once the record is durable (set_when_durable)."""
    task, record = queued_record(port, task)
    out.emit(record)
    out.flush()
    if recorded is not None:
        out.set_when_durable(recorded)
    return task


def _queue_steering(
    out: OutputEmitter, port: SessionPort, message: SteeringQueued, task: RunningTask | None
) -> None:
    """Queue a user's steering for the open (or starting) task, recorded first
    (``steering_queued``, written at once, its ``recorded`` set once the record is durable:
    fsynced, or in a cluster acknowledged by JetStream) so that a host that takes the task
    up delivers it (R-STEER-1, R-STEER-2)."""
    with _handed_to_machine(message.recorded):
        content = repaired_blocks(message.content)  # a lone surrogate must not fail the task
        steering_id = "steer_" + uuid.uuid4().hex[:12]
        # A task that is starting has no run id in the record yet: its own is the one to name.
        run_id = task.run_id if task is not None else port.machine.run_id or ""
        out.emit(SteeringQueuedOutput(session_id=port.id, run_id=run_id,
                                      steering_id=steering_id, content=content))
        out.flush()
        if message.recorded is not None:
            out.set_when_durable(message.recorded)
        port.machine.queue_steering(content, steering_id=steering_id)


def _drop_recorded(
    out: OutputEmitter, port: SessionPort, reason: str, only: str | None = None
) -> None:
    """Record that the follow-ups recorded as queued (or just ``only``) will not run."""
    machine = port.machine
    ids = tuple(q.queue_id for q in machine.record.queued if only in (None, q.queue_id))
    if ids:
        out.emit(TaskQueueDropped(session_id=port.id, run_id=machine.run_id or "",
                                  queue_ids=ids, reason=reason))


def _interrupt(out: OutputEmitter, port: SessionPort, message: InterruptTask) -> None:
    """Interrupt the open task and drop the queue (R-ABORT-1), the recorded follow-ups with
    it: a host that takes the session up later does not run them. Scope ``tree`` ends the
    live subtree too. A node's own interrupt leaves its background children running: their
    answers still reach it, as follow-ups (a closing host's: recorded queued). A close
    (R-HOST-3) drops no child's answer it has taken (R-TREE-2): each queued behind the task
    is recorded queued now, each in its steering once the task has ended
    (:func:`_leave_answers`), for the next host."""
    _drop_recorded(out, port, f"interrupted: {message.reason}")
    closing = message.closing or port.closed
    if closing:
        _record_answers(out, port)
    port.machine.interrupt(message.reason, keep_answers=closing or message.scope == "node")
    if message.scope == "tree":
        end_subtree(port, "parent task interrupted")


def _close_holds(
    port: SessionPort,
    message: InterruptTask,
    task: RunningTask | None,
    nursery: trio.Nursery | None,
    inbox: trio.MemorySendChannel[SupervisorMessage],
) -> bool:
    """Whether ``message``, the session's close, holds ``task`` at its next turn boundary
    (:func:`_holds`) instead of ending it: the task's prompt is a background child's
    answer (R-TREE-2), in the trace already — ended, nobody would answer it, as no host
    takes an ended task up. Held, it stays open in its trace, as a drain leaves a task
    (R-DRAIN-1): the next host's ``resume_tasks`` goes on with it, nothing re-run, and an
    answer that ends it first (no more turns) ends it here. A task not held within
    :data:`CLOSE_HOLD_S` is interrupted then; the close's scope ``tree`` ends the live
    subtree at once, as it would have."""
    input_ = task.task if task is not None else None
    if not (message.closing and input_ is not None and input_.report and nursery is not None):
        return False
    if message.scope == "tree":
        end_subtree(port, "parent task interrupted")
    interrupt = InterruptTask(reason=message.reason, scope="node")
    nursery.start_soon(_send_after, inbox, interrupt, CLOSE_HOLD_S)
    return True


def _holds(port: SessionPort, closing: bool) -> bool:
    """Whether ``port``'s task stops at this turn boundary, open in its trace: its host
    drains (R-DRAIN-1), or its close holds it (``closing``: :func:`_close_holds`) and
    every task queued behind it is in its trace. One in this host's memory alone (another
    child's answer, queued as a task) would be lost with the held task: the task runs on,
    and its end records that answer queued (:func:`_leave_answers`)."""
    if holds_for_drain(port):
        return True
    queued = port.machine.queued_tasks
    return closing and all(isinstance(t, TaskInput) and t.queued_id for t in queued)


def _keeps_reader(port: SessionPort, closing: bool) -> bool:
    """Whether the reader of ``port``'s run, its task now parked or held, waits on for the
    task to wake: not once its close held it (``closing``), which a reader would wait
    for in vain — the task goes on only where the session is loaded again."""
    if closing and port.parked_task is not None:
        port.parked_task = attrs.evolve(port.parked_task, output=None)
    return not closing


async def _send_after(
    inbox: trio.MemorySendChannel[SupervisorMessage], message: SupervisorMessage, delay_s: float
) -> None:
    await trio.sleep(delay_s)
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        inbox.send_nowait(message)


def _refused(
    out: OutputEmitter, port: SessionPort, task: RunningTask, input_: TaskInput,
    refused: str | None,
) -> None:
    """A task whose input was refused (an image: ``refused`` says why) or interrupted
    (``refused`` None) before its prompt was recorded ends at once (R-SEC-8); a
    follow-up's recorded queue entry goes with it, so that nobody runs it later (an
    interrupt has dropped it already)."""
    if refused is not None and input_.queued_id is not None:
        _drop_recorded(out, port, refused, only=input_.queued_id)
    status: TaskStatus = "aborted" if refused is None else "failed"
    out.emit(task.task_end(status, refused or port.machine.stop_reason))
    out.commit()
    _leave_answers(out, port)


def _report_trace_failure(inbox: trio.MemorySendChannel[SupervisorMessage], message: str) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        inbox.send_nowait(TraceFailed(message=message))


async def _attach_prompt(
    port: SessionPort, content: tuple[UserContent, ...]
) -> tuple[UserContent, ...] | str:
    """The prompt with its images attached off the event loop, or why an image was
    refused (R-SEC-8)."""
    try:
        return await attach(content, port.attachments)
    except ImageRefused as exc:
        return str(exc)


def _answered_elsewhere(port: SessionPort, approve: Approval, turns: TurnRunner | None) -> bool:
    """Whether everything ``port``'s task waits for is answered from outside the task, so
    that it may park (R-HITL-3): always under ``approve="people"``; under a callback (or
    nobody), only when its broker asks nobody — each unfinished call waits for a client
    tool's result (R-PROTO-2), for a person who held its request when the task was taken
    up (``turns.left_for_people``: R-HITL-1, not asked again), or behind such a call, to be
    asked once it is decided. The broker may otherwise be asking the callback about a
    call, or the callback's person an ``ask_user`` question (``ANSWER_QUESTION``), which
    parking would drop; and closing a task that is not parked aborts it, denying what a
    person still had to answer. The callback stays the parked task's, for its next calls."""
    if approve == PEOPLE:
        return True
    if turns is None:
        return False
    record = port.machine.record
    held = turns.left_for_people
    # A client call is known by its request, not by the session's tools: a session loaded
    # again (a restart's take-up) has no client tools until its client gives them again. A
    # running call's question (an MCP elicitation) is an allowed call's: it holds a slot.
    outside = {
        request.call_id
        for request in record.pending_people
        if request in held
        or (
            request.kind == "question"
            and request.tool != ASK_USER
            and request.call_id not in record.allowed
        )
    }
    machine = turns.machine
    # Approvals go one at a time: only the call being asked about is the broker's.
    return bool(outside) and all(
        call_id in outside
        or (call_id != machine.asking and machine.call_state(call_id) is CallState.APPROVING)
        for call_id in record.unfinished_calls()
    )


def _abandon(port: SessionPort) -> None:
    """Work that failed outside any task's records (a manual compaction, say) ends: the
    session is idle again, and the host goes on (R-SEC-1)."""
    logger.error("session %s: its work failed", port.id, exc_info=True)
    port.machine.abandon()


def start(
    port: SessionPort,
    task: TaskInput | None,
    output: trio.MemorySendChannel[list[Output]],
    cancel: trio.Event | None = None,
) -> trio.MemorySendChannel[SupervisorMessage]:
    """Start a supervisor for idle ``port`` in the host's nursery, on ``task`` (None: a
    manual compaction), publishing every batch on ``output`` (which it closes when the
    work ends); setting ``cancel`` interrupts the work. Returns the supervisor's inbox,
    which is the port's from now on. What ``Session.run`` and ``compact`` do, and how a
    background subagent and a parent's follow-up start (R-TREE-2)."""
    supervisor = SessionSupervisor(port, output, cancel)
    supervisor.inbox.send_nowait(
        TaskQueued(task=task, kind="task" if task is not None else "compaction")
    )
    port.inbox = supervisor.inbox
    port.idle = trio.Event()
    port.host.start_task(supervisor.run)
    return supervisor.inbox


def _make_idle(port: SessionPort, inbox: trio.MemorySendChannel[SupervisorMessage]) -> None:
    """The session of ``port`` has no work: ``inbox`` takes no more."""
    if port.inbox is inbox:
        # The session is idle before its readers see the last task_end, so a host that
        # reacts to it by starting the next task never meets Busy.
        port.inbox = None
        idle, port.idle = port.idle, None
        if idle is not None:
            idle.set()
    inbox.close()  # later commands find no one: the handle ignores them


def _run_late_steering(
    out: OutputEmitter, port: SessionPort, message: SteeringQueued, came_for: TaskInput | None
) -> None:
    """Steering its task no longer takes, after steer() said yes (the task was ending, or
    interrupted): the words run as a task of their own, with the options of the task they
    came for (``came_for``, also once it has ended), as the host would have run them had
    steer() found no task (R-STEER-1). The
    task's own queue went with it (R-STEER-5). That task is recorded as a follow-up's is
    (``task_queued``), so that ``recorded`` settles only once the words survive the host
    (R-STEER-6): a host that takes the session up runs them. Once the session closes
    nothing runs, and ``recorded`` says they were dropped."""
    if port.closed:
        drop_unrun(message.recorded, f"session {port.id} closed before the steering ran")
        return
    with _handed_to_machine(message.recorded):
        late = TaskInput(
            content=repaired_blocks(message.content),
            approve=came_for.approve if came_for is not None else None,
            thinking_level=came_for.thinking_level if came_for is not None else None,
            late_steering=True,
        )
        port.machine.queue_task(_record_follow_up(out, port, late, message.recorded))


def _pass_on_leftovers(
    port: SessionPort, inbox: trio.MemoryReceiveChannel[SupervisorMessage], out: OutputEmitter
) -> None:
    """Messages that came after the last look at the inbox (while a task parked, say)
    reach the session's next supervisor; an answer nobody can take any more is
    refused, so that no one waits for it. A child's answer to a closing session is
    recorded queued, as :func:`_take_answer` records it, for the next host."""
    while True:
        try:
            message = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return
        if port.deliver(message):
            continue
        if isinstance(message, SubagentFinished):
            # The session is idle now: a follow-up of its own.
            if not tell(port, message) and port.closed:
                out.emit(queued_record(port, message.follow_up)[1])
            continue
        if isinstance(message, SteeringQueued | TaskQueued):
            # Never recorded, and nothing runs it: whoever waits for it is told so.
            drop_unrun(message.recorded, f"session {port.id} stopped before its input was recorded")
        if isinstance(message, PersonAnswered) and message.reply is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                message.reply.send_nowait(f"session {port.id} has no task waiting for an answer")


def wake(port: SessionPort, message: SupervisorMessage | None) -> None:
    """Start a supervisor for ``port``'s open task — parked on people, or loaded after
    its host stopped — with ``message`` first in its inbox (R-HITL-2..4); an interrupt
    ends the task before it is taken up (nothing it left in flight runs again, nobody is
    asked). The run's reader, when a parked task has one, reads on; otherwise the outputs
    reach the trace and the session's watchers only."""
    parked = port.parked_task
    if parked is None:
        # Loaded, not parked here (an answer or Host.resume wakes it): the queue it had is
        # the one its trace records (R-STEER-6).
        requeue_recorded(port)
    output = parked.output if parked is not None else None
    if output is None:
        # Unbounded and unread: nothing waits on it; the trace and watchers get all.
        output, unread = trio.open_memory_channel[list[Output]](math.inf)
        unread.close()
    # With no task open, an interrupt is read first from the inbox: it drops the queue.
    open_task = port.machine.run_id is not None
    ended = message if isinstance(message, InterruptTask) and open_task else None
    cancel = parked.cancel if parked is not None else None
    supervisor = SessionSupervisor(port, output, cancel, ended)
    port.inbox = supervisor.inbox
    port.idle = trio.Event()
    if message is not None and ended is None:
        supervisor.inbox.send_nowait(message)
    port.host.start_task(supervisor.run)


def take_up_stored(port: SessionPort, approve: Approval) -> bool:
    """Take up the work a stopped host left in ``port``'s trace (``Host.resume``): its open
    task, or the task of a prompt it recorded and had not started (the run was accepted:
    :meth:`~greenroom.protocols.task.TaskMachine.adopt_unstarted`), with ``approve`` for
    its calls, then the follow-ups it recorded as queued (R-STEER-6). Nothing when a
    supervisor runs it already, or for a foreground subagent (its parent's call ended
    with that host). Whether it took work up."""
    if port.inbox is not None or (port.parent_id is not None and port.report_as is None):
        return False
    machine = port.machine
    if machine.run_id is not None or machine.adopt_unstarted() or machine.record.queued:
        port.lost_approve = approve
        port.host.wake(port, None)  # the host knows the taken-up subagents (R-TREE-2)
        return True
    return False


def end_left_work(port: SessionPort, interrupt: InterruptTask) -> bool:
    """End at once the work a stopped host left in ``port``'s trace with nobody to run it
    (R-ABORT-1): its open task; the task of a prompt it recorded and had not started,
    which starts only to end ``aborted``; the follow-ups it recorded as queued, recorded
    dropped. A supervisor takes the work up with ``interrupt`` first, so nothing of it
    runs and nobody is asked; else the next take-up would run what the user interrupted.
    Whether there was any."""
    if not (left_open(port) or left_unstarted(port)):
        return False
    port.machine.adopt_unstarted()
    port.host.wake(port, interrupt)
    return True


async def forward_cancel(
    event: trio.Event, inbox: trio.MemorySendChannel[SupervisorMessage]
) -> None:
    """``session.run(cancel=event)``: setting the event interrupts the task."""
    await event.wait()
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        inbox.send_nowait(InterruptTask(reason=CANCELLED_BY_HOST))


async def run_child(
    port: SessionPort,
    task: TaskInput,
    outputs: trio.MemorySendChannel[list[Output]],
    *,
    reason: str = "parent task interrupted",
) -> None:
    """Run one task of ``port`` as a subagent in the calling task — a tool call of the
    parent's task — instead of the host's nursery, and return when it has ended.

    Every batch of its outputs is sent on ``outputs`` (closed when the task has ended);
    the caller drains it concurrently. Cancelling the caller interrupts the subagent with
    ``reason`` and scope ``node`` (its background children run on, unless the parent's
    interrupt was of scope ``tree``, which has reached them already): the subagent runs
    shielded, so it settles and records its own ``abort`` and ``task_end(aborted)``
    (bounded by its teardown grace) before the cancellation goes on to the caller."""
    supervisor = SessionSupervisor(port, outputs, None)
    port.inbox = supervisor.inbox
    port.idle = trio.Event()
    supervisor.inbox.send_nowait(TaskQueued(task=task))
    finished = trio.Event()

    async def run_shielded() -> None:
        try:
            with trio.CancelScope(shield=True):
                await supervisor.run()
        finally:
            finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_shielded)
        try:
            await finished.wait()
        except trio.Cancelled:
            port.send(InterruptTask(reason=reason, scope="node"))
            raise
