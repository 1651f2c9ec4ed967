"""The session supervisor: one loop over one inbox, where a session's work moves on.

One supervisor runs while a session has work — a ``Session.run`` and the tasks queued
behind it, or a manual compaction — as a trio task in the host's nursery, and ends with
the work: an idle session has no task running (R-HOST-1).

The loop asks the session's task machine (:mod:`greenroom.protocols.task`, pure) for the
next step and carries it out; when the step is to wait, it takes the next message from its
one inbox. Everything reaches it there: the session handle's commands (tasks, steering,
interrupt, skip, the auth unlock), the LLM streamer's batches (a turn's and a
compaction's), the approval broker's decisions, the tool pool's results, subagents'
outputs, hook answers, and trace syncs. A turn's mechanics are the pure turn machine's,
carried out by :class:`~greenroom.actors.runtime.turn_runner.TurnRunner`; a compaction's by
:class:`~greenroom.actors.runtime.compactor.CompactionRun`. Every traced output goes through
the :class:`~greenroom.actors.runtime.emitter.OutputEmitter`, which feeds it to the
transcript and the task machine: the machine learns what happened exactly as a fold of the
trace would (invariant 1 of the task machine).

The trace comes first (R-RUN-8, R-TRACE-3): a batch is published only once its records are
written; a task's input is durable before its ``task_start``, and the trace at every turn
boundary (R-TRACE-2). While the supervisor waits for a sync it keeps serving its inbox, so
neither an interrupt nor a steer waits for the disk. A record that cannot be written ends
the task ``failed`` with the reason (R-SEC-1).

Interrupt is cancellation: a task's actors — broker, pool, streamer, hook calls — live in
:class:`TaskWork`, whose cancel scope ends them together; the supervisor then settles the
turn (R-ABORT-1..3) and emits exactly one ``task_end`` under a shielded, bounded scope.

A subagent (R-HOST-4, :mod:`greenroom.actors.runtime.subagents`) runs its own supervisor
inside a ``spawn_subagent`` call's task (:func:`run_child`); its outputs come back through
this supervisor's inbox (``SubagentOutputs``) as live outputs of this run, tagged with their
``origin`` and never traced here.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, assert_never

import trio

from greenroom.actors.runtime.approval_broker import ApprovalBroker
from greenroom.actors.runtime.attachments import attach
from greenroom.actors.runtime.compactor import CompactionRun
from greenroom.actors.runtime.emitter import OutputEmitter, repaired_blocks
from greenroom.actors.runtime.errors import ImageRefused
from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.actors.runtime.port import SessionPort, TaskInput
from greenroom.actors.runtime.subagents import Subagents
from greenroom.actors.runtime.tool_pool import ToolPool
from greenroom.actors.runtime.turn_runner import TurnRunner
from greenroom.protocols.content import UserContent
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.hooks import RequestInfo, StopInfo, ToolResultsInfo
from greenroom.protocols.messages import (
    ApprovalAsked,
    ApprovalDecided,
    ApproveCall,
    AuthRetried,
    BackoffSkipped,
    HookAnswered,
    InterruptTask,
    PlanBackoff,
    PoolCommand,
    SkipBackoff,
    StartAttempt,
    SteeringQueued,
    StreamBatch,
    StreamerCommand,
    SubagentOutputs,
    SupervisorMessage,
    TaskQueued,
    ToolCallFinished,
    ToolProgressed,
    TraceFailed,
    WorkDone,
)
from greenroom.protocols.outputs import (
    CompactionReason,
    Output,
    TaskEnd,
    TaskStart,
    TaskStatus,
    UserMsg,
)
from greenroom.protocols.stream import StreamEvent, StreamFailed
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

__all__ = ["ABORT_GRACE_S", "SessionSupervisor", "TaskWork", "build_request", "run_child"]

T = TypeVar("T")

ABORT_GRACE_S = 2.0
"""Bound on the shielded teardown after a task: writing its last records (``abort``,
``task_end``) and syncing the trace. Well above the usual few milliseconds, far below a
hang."""


class TaskWork:
    """The actors of one task: the approval broker, the tool pool and the LLM streamer,
    with the hook calls the supervisor starts, in one nursery whose cancel scope ends them
    together (interrupt = cancellation). Start it with ``nursery.start(work.run)``; it
    serves until :meth:`stop`. Each reports to the supervisor's inbox only."""

    __slots__ = (
        "_approvals",
        "_done",
        "_inbox",
        "_pool",
        "_port",
        "_streamer",
        "_task",
        "approvals",
        "nursery",
        "pool",
        "scope",
        "streamer",
    )

    def __init__(
        self,
        port: SessionPort,
        task: TaskInput | None,
        inbox: trio.MemorySendChannel[SupervisorMessage],
    ) -> None:
        self._port = port
        self._task = task
        self._inbox = inbox
        self._done = trio.Event()
        self.scope = trio.CancelScope()
        # Unbounded, all three: the supervisor commands with send_nowait and never waits
        # for its actors; at most a turn's calls (or a handful of stream commands) queue.
        self.approvals, self._approvals = trio.open_memory_channel[ApproveCall](math.inf)
        self.pool, self._pool = trio.open_memory_channel[PoolCommand](math.inf)
        self.streamer, self._streamer = trio.open_memory_channel[StreamerCommand](math.inf)
        self.nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the actors; ready once they serve. Returns after :meth:`stop`."""
        port = self._port
        settings = port.settings
        task = self._task
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    approve = task.approve if task is not None else None
                    broker = ApprovalBroker(
                        approve=approve,
                        clients=port.client_approvals,
                        timeout_s=settings.approval_timeout_s,
                        inbox=self._inbox,
                    )
                    await nursery.start(broker.run, self._approvals)
                    subagents = Subagents(
                        port, approve=approve, report=self._inbox, run_child=run_child
                    )
                    pool = ToolPool(
                        tools=port.tool_by_name,
                        inbox=self._inbox,
                        workspace_dir=port.workspace_dir,
                        scratchpad_dir=port.scratchpad_dir,
                        sync_trace=port.sync_trace,
                        result_budget=settings.tool_result_budget,
                        spawn=subagents.spawn,
                        sandbox=settings.sandbox,
                        shell_network=settings.shell_network,
                        private_dirs=(port.host.data_dir,),
                        attachments=port.attachments,
                    )
                    await nursery.start(pool.run, self._pool)
                    streamer = LLMStreamer(port.provider.open_task(), self._inbox)
                    await nursery.start(streamer.run, self._streamer)
                    self.nursery = nursery
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            self._done.set()

    async def stop(self) -> None:
        """End the actors and wait until they have: a tool that ignores cancellation is
        abandoned after the pool's grace (R-SEC-2), so this stays bounded."""
        self.scope.cancel()
        await self._done.wait()

    def request(
        self, command: StartAttempt, hook: Callable[[Any], Any] | None, info: Any
    ) -> None:
        """Send ``command`` to the streamer — after the host's ``before_request`` hook has
        seen it, when there is one, in a task of the work: the supervisor never waits for
        a hook, and an interrupt drops the held request with the work."""
        if hook is None:
            self.streamer.send_nowait(command)
            return
        streamer = self.streamer

        async def after_hook() -> None:
            await _call_hook(hook, info)
            streamer.send_nowait(command)

        assert self.nursery is not None
        self.nursery.start_soon(after_hook)

    def call_hook(self, name: Any, hook: Callable[[Any], Any] | None, info: Any) -> None:
        """Call a host hook in a task of the work; its answer reaches the supervisor's
        inbox as ``HookAnswered``."""
        inbox = self._inbox

        async def call() -> None:
            answer = await _call_hook(hook, info)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                inbox.send_nowait(HookAnswered(hook=name, answer=answer))

        assert self.nursery is not None
        self.nursery.start_soon(call)


class SessionSupervisor:
    """Runs the work of one session while it has some; see the module docstring."""

    def __init__(
        self,
        port: SessionPort,
        output: trio.MemorySendChannel[list[Output]],
        cancel: trio.Event | None,
    ) -> None:
        self._port = port
        self._machine = port.machine
        self._output = output
        self._cancel_event = cancel
        # Unbounded on purpose: the session handle, the streamer, the broker, the pool,
        # subagents and hook calls all send with send_nowait and must never block on the
        # supervisor, which drains the inbox whenever it is not carrying out a step.
        self.inbox, self._inbox = trio.open_memory_channel[SupervisorMessage](math.inf)
        """The send side of the one inbox: the session handle's way in."""
        self._out = OutputEmitter(port, output, self._trace_failed)
        self._nursery: trio.Nursery | None = None
        self._work: TaskWork | None = None
        self._turns: TurnRunner | None = None
        self._compaction: CompactionRun | None = None
        self._task: TaskInput | None = None
        self._requests = 0
        self._turn_request = 0
        self._asked_token = 0
        self._done_token = 0
        self._boundary_synced: tuple[str | None, int] = (None, 0)
        self._started_at = 0.0
        self.run_id = ""

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
                self._make_idle()
                with trio.CancelScope(shield=True):
                    if self._work is not None:
                        await self._work.stop()
                    self._out.flush()
                    with trio.move_on_after(ABORT_GRACE_S):
                        await self._out.wait_published()
                    # Past the bound the disk hangs: what is left still reaches its
                    # readers, the last task_end above all.
                    self._out.publish_unwritten()
                    await self._output.aclose()
                nursery.cancel_scope.cancel()

    async def _loop(self) -> None:
        # The run's own task comes first (its handle sent it before anything else could
        # be sent): it is started before later messages are read, so an interrupt that
        # follows at once ends it aborted rather than dropping it unseen.
        with contextlib.suppress(trio.WouldBlock):
            self._handle(self._inbox.receive_nowait())
        while True:
            try:
                if await self._step():
                    return
            except Exception as exc:  # a bug must end the task visibly, not hang the host
                if self._machine.run_id is None:
                    raise
                await self._end_task("failed", f"internal error: {exc!r}", crashed=True)

    async def _step(self) -> bool:
        """Carry out one step; True once the session is idle."""
        machine = self._machine
        if machine.run_id is None and self._work is not None:
            # A manual compaction ended on its own record: its actors end with it.
            work, self._work = self._work, None
            await work.stop()
        compaction = self._compaction
        if compaction is not None:
            if compaction.ready:
                await compaction.finish(self._sync)
            if not compaction.running:
                self._compaction = None
        if machine.phase is Phase.TURN_DONE and not machine.stopping:
            boundary = (machine.run_id, machine.turn)
            if self._boundary_synced != boundary:
                self._boundary_synced = boundary
                await self._sync()  # R-TRACE-2: durable at every turn boundary
                return False
        step = machine.next_step()
        match step:
            case Wait():
                self._out.flush()
                self._handle(await self._inbox.receive())
                self._drain()
                self._out.flush()
            case StartTask(task=task, kind=kind):
                await self._start_task(task, kind)
            case Compact(reason=reason):
                self._start_compaction(reason)
            case BeginTurn(turn=turn, steering=steering):
                await self._begin_turn(turn, steering)
            case BeginAttempt(attempt=attempt, delay_ms=delay_ms):
                self._begin_attempt(attempt, delay_ms)
            case CallHook():
                self._call_hook(step)
            case EndTask(status=status, message=message):
                await self._end_task(status, message)
            case Finish():
                return self._finish()
            case _:
                assert_never(step)
        return False

    def _drain(self) -> None:
        """Handle every message already waiting, without blocking."""
        receive = self._inbox
        while True:
            try:
                message = receive.receive_nowait()
            except trio.WouldBlock:
                return
            self._handle(message)

    def _handle(self, message: SupervisorMessage) -> None:
        """One inbox message."""
        match message:
            case StreamBatch():
                # The hot path: one batch per network read.
                number = message.request
                if number == self._turn_request and number:
                    self._turn_batch(message.events)
                elif self._compaction is not None and number == self._compaction.request:
                    self._compaction.feed(message.events)
            case ToolCallFinished() | ToolProgressed() | ApprovalDecided() | ApprovalAsked():
                if self._turns is not None:
                    self._turns.handle(message)
            case SubagentOutputs():
                # Live outputs of this run, already in the subagent's trace (R-HOST-4).
                self._out.forward(message.outputs, message.origin)
            case SteeringQueued():
                self._machine.queue_steering(repaired_blocks(message.content))
            case TaskQueued():
                self._machine.queue_task(message.task, message.kind)
            case InterruptTask():
                self._machine.interrupt(message.reason)
            case BackoffSkipped():
                # Every reconnect wait, a compaction's too, is the streamer's (R-RETRY-5).
                if self._work is not None:
                    self._work.streamer.send_nowait(SkipBackoff())
            case AuthRetried():
                self._machine.retry_auth()
            case HookAnswered():
                answer = message.answer
                self._machine.hook_answered(answer if isinstance(answer, str) else None)
            case WorkDone():
                self._done_token = max(self._done_token, message.token)
            case TraceFailed():
                self._machine.fail(message.message)
            case _:
                assert_never(message)

    # -- steps ----------------------------------------------------------------------------

    async def _start_task(self, task: TaskInput | None, kind: TaskKind) -> None:
        port = self._port
        self._task = task
        self.run_id = port.new_run_id()
        self._started_at = trio.current_time()
        self._out.begin_task()
        self._machine.configure(port.task_limits())
        if kind == "compaction" or task is None:
            await self._open_work(None)
            self._start_compaction("manual")
            return
        # R-SEC-8: the prompt's images are read now, once, before anything is recorded;
        # one that is refused (or an interrupt meanwhile) ends the task with nothing else.
        content = await self._serving(lambda: attach_prompt(port, task.content))
        if content is None or isinstance(content[0], str):
            refused = content[0] if content is not None and isinstance(content[0], str) else None
            self._out.emit(
                TaskEnd(session_id=port.id, run_id=self.run_id,
                        status="aborted" if refused is None else "failed", turns=0,
                        usage=self._machine.usage, wall_ms=0,
                        message=refused or self._machine.stop_reason)
            )
            self._out.commit()
            return
        # R-TRACE-3: the input is a fact of the session before the task starts: durable
        # before task_start exists.
        prompt = self._out.emit(
            UserMsg(
                session_id=port.id,
                run_id=self.run_id,
                kind="prompt",
                content=repaired_blocks(content[0]),
            )
        )
        await self._sync()
        self._out.emit(TaskStart(session_id=port.id, run_id=self.run_id, input_seq=prompt.seq))
        self._out.flush()
        await self._open_work(task)

    async def _open_work(self, task: TaskInput | None) -> None:
        assert self._nursery is not None
        work = TaskWork(self._port, task, self.inbox)
        await self._nursery.start(work.run)
        self._work = work
        self._turns = TurnRunner(
            port=self._port,
            emitter=self._out,
            run_id=self.run_id,
            approvals=work.approvals,
            pool=work.pool,
        )

    async def _begin_turn(self, turn: int, steering: tuple[UserContent, ...]) -> None:
        assert self._turns is not None
        self._turns.begin_turn(turn)
        if steering:
            # R-SEC-8: images not attached yet are read now; a refused one becomes a line
            # saying so, and the steering's words still count.
            read = await self._serving(
                lambda: attach(steering, self._port.attachments, fold=True)
            )
            if read is None:
                return  # interrupted meanwhile: the task ends at the next step
            # R-STEER-2: the queue drained into one steering input at input assembly.
            self._out.emit(
                UserMsg(session_id=self._port.id, run_id=self.run_id, kind="steering",
                        content=read[0])
            )
        self._begin_attempt(1, 0)

    def _begin_attempt(self, attempt: int, delay_ms: int) -> None:
        turns, work = self._turns, self._work
        assert turns is not None and work is not None
        port = self._port
        turns.begin_attempt(attempt)
        self._out.flush()
        request = build_request(port, self._task)
        self._requests += 1
        self._turn_request = self._requests
        command = StartAttempt(
            request=request, attempt=attempt, delay_ms=delay_ms, number=self._requests
        )
        work.request(
            command,
            port.hooks.before_request,
            RequestInfo(
                session_id=port.id,
                run_id=self.run_id,
                turn=turns.turn,
                attempt=attempt,
                request=request,
            ),
        )

    def _turn_batch(self, events: list[StreamEvent]) -> None:
        turns, work = self._turns, self._work
        assert turns is not None and work is not None
        turns.feed(events)
        result = turns.machine.stream_result
        if result is None:
            return
        self._turn_request = 0
        if isinstance(result, StreamFailed):
            error = result.error
            retry_in_ms = self._machine.plan_failure(error)
            if retry_in_ms is not None:
                # Skippable from the moment it is announced (R-RETRY-5).
                work.streamer.send_nowait(PlanBackoff())
            turns.fail_attempt(error, retry_in_ms)

    def _start_compaction(self, reason: CompactionReason) -> None:
        turns, work = self._turns, self._work
        assert turns is not None and work is not None
        if reason == "overflow":
            turns.discard_attempt()
        # The task's own request settings, thinking included, so that the summary
        # request's prefix is the one the provider has cached (R-COMPACT-5).
        template = build_request(self._port, self._task)
        self._compaction = CompactionRun(
            port=self._port,
            emitter=self._out,
            streamer=work.streamer,
            run_id=self.run_id,
            turn=turns.turn,
            reason=reason,
            template=template,
            number=self._next_request,
        )
        self._compaction.start()

    def _next_request(self) -> int:
        self._requests += 1
        return self._requests

    def _call_hook(self, step: CallHook) -> None:
        turns, work = self._turns, self._work
        assert turns is not None and work is not None
        port = self._port
        machine = turns.machine
        sid, rid, turn = port.id, self.run_id, turns.turn
        if step.hook == "after_tool_results":
            results = ToolResultsInfo(session_id=sid, run_id=rid, turn=turn,
                                      results=machine.results())
            work.call_hook(step.hook, port.hooks.after_tool_results, results)
        else:
            stop = StopInfo(session_id=sid, run_id=rid, turn=turn,
                            final_message=machine.done_blocks,
                            continuations=step.continuations)
            work.call_hook(step.hook, port.hooks.on_stop, stop)

    async def _end_task(self, status: TaskStatus, message: str | None, *,
                        crashed: bool = False) -> None:
        """End the open task with ``status``: its actors stop, what is in flight is
        settled, and its one ``task_end`` is written (R-RUN-7)."""
        machine = self._machine
        # The model requests in flight are over: their late batches are dropped.
        self._turn_request = 0
        compaction, self._compaction = self._compaction, None
        if compaction is not None:
            compaction.request = 0
        work, self._work = self._work, None
        if work is not None:
            with trio.CancelScope(shield=True):
                await work.stop()
        # Results that arrived before the actors stopped still count.
        with _best_effort(crashed):
            self._drain()
        reason = message or status
        if machine.kind == "compaction":
            if compaction is not None:
                compaction.end_interrupted(reason)
            return  # a manual compaction has no task records
        turns = self._turns
        best_effort = crashed or status == "failed"  # the trace may be what failed
        with _best_effort(best_effort):
            if compaction is not None:
                compaction.end_interrupted(reason)
            if turns is not None and status == "aborted":
                turns.abort(reason)  # R-ABORT-1..3, R-APPROVE-5
            elif turns is not None and status == "failed":
                turns.fail(reason)
        with trio.CancelScope(shield=True) as teardown:
            teardown.deadline = trio.current_time() + ABORT_GRACE_S
            self._out.emit(
                TaskEnd(
                    session_id=self._port.id,
                    run_id=self.run_id,
                    status=status,
                    turns=machine.turn,
                    usage=machine.usage,
                    wall_ms=round((trio.current_time() - self._started_at) * 1000),
                    message=message,
                )
            )
            if machine.run_id is not None:
                # The record could not be encoded or written: the machine still ends the
                # task, as the trace would have told it.
                machine.observe(
                    TaskEnd(session_id=self._port.id, run_id=self.run_id, status=status,
                            turns=machine.turn, usage=machine.usage, wall_ms=0,
                            message=message)
                )
            # Written now, published once the session is idle or the next task runs;
            # the sync below only fsyncs it. A trace that cannot be written must not cost
            # the host: task_end still reaches its readers.
            self._out.commit()
            await self._out.sync_quietly()
        self._turns = None
        if machine.has_queued_tasks:
            self._out.flush()

    def _finish(self) -> bool:
        """No work is left: the session becomes idle — unless a task was queued since the
        last look at the inbox. Synchronous, so nothing can arrive in between."""
        self._drain()
        if self._machine.busy:
            return False
        self._make_idle()
        return True

    def _make_idle(self) -> None:
        port = self._port
        if port.inbox is self.inbox:
            # The session is idle before its readers see the last task_end, so a host that
            # reacts to it by starting the next task never meets Busy.
            port.inbox = None
            idle, port.idle = port.idle, None
            if idle is not None:
                idle.set()
        self.inbox.close()  # later commands find no one: the handle ignores them

    # -- the trace ------------------------------------------------------------------------

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
        None when the task was told to stop first (the work is then cancelled, and a
        thread it waits on abandoned)."""
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
        return (result[0],) if result else None

    def _trace_failed(self, message: str) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self.inbox.send_nowait(TraceFailed(message=message))


def build_request(port: SessionPort, task: TaskInput | None) -> ModelRequest:
    """The next request of the session: the transcript's context (with the
    ``[turn_retried]`` note on a retry: R-RETRY-4), the system prompt and tools, and the
    task's thinking level."""
    settings = port.settings
    return ModelRequest(
        model=settings.model,
        system=settings.system,
        tools=port.tool_schemas,
        messages=port.transcript.request_messages(),
        max_tokens=settings.max_tokens,
        thinking_level=task.thinking_level if task is not None else None,
        supports_vision=settings.supports_vision,
        images=port.attachments.source,
    )


def _best_effort(ignore_errors: bool) -> contextlib.AbstractContextManager[object]:
    """Where a failure may be what ended the task: errors there are dropped."""
    if ignore_errors:
        return contextlib.suppress(Exception)
    return contextlib.nullcontext()


async def attach_prompt(
    port: SessionPort, content: tuple[UserContent, ...]
) -> tuple[UserContent, ...] | str:
    """The prompt with its images attached off the event loop, or why an image was
    refused (R-SEC-8)."""
    try:
        return await attach(content, port.attachments)
    except ImageRefused as exc:
        return str(exc)


async def _call_hook(hook: Callable[[Any], Any] | None, info: Any) -> Any:
    """Call a host hook; a hook that raises is ignored (hooks never end a task)."""
    if hook is None:
        return None
    try:
        result = hook(info)
        if inspect.isawaitable(result):
            result = await result
    except Exception:
        return None
    return result


async def forward_cancel(
    event: trio.Event, inbox: trio.MemorySendChannel[SupervisorMessage]
) -> None:
    """``session.run(cancel=event)``: setting the event interrupts the task."""
    await event.wait()
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        inbox.send_nowait(InterruptTask(reason="cancelled by host"))


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
    ``reason``: the subagent runs shielded, so it settles and records its own ``abort``
    and ``task_end(aborted)`` (bounded by its teardown grace) before the cancellation goes
    on to the caller."""
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
            port.send(InterruptTask(reason=reason))
            raise
