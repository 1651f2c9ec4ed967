"""The session supervisor: the only owner of a task's turn state.

One supervisor runs per ``Session.run`` (and the follow-ups queued behind it), as a trio
task in the host's nursery, and ends with the work: an idle session has no task running.
Its children — one :class:`LLMStreamer` attempt at a time, the :class:`ApprovalBroker`,
and the :class:`ToolPool`'s call tasks — live in the task's nursery and talk to it only
through its inbox. The supervisor decides everything that happens next, emits every
output (to the run's channel, to subscribers and, for traced outputs, to the trace), and
feeds traced outputs to the session's :class:`Transcript`, which owns the model context.

The trace comes first (R-RUN-8, R-TRACE-3): a batch of outputs is published — to the run's
channel and to subscribers — only once its records are written to the trace file (handed
to the OS: a crash of the host cannot take them out of the trace; see
:meth:`TraceSink.commit`), batches in order; a task's input is fsynced before its
``task_start`` is emitted. Text entering from the user (prompts, steering, follow-ups) and
from tools is repaired here (R-SEC-1). A record that cannot be written — or encoded,
despite the repairs — ends the task ``failed`` with the reason; the host and the other
sessions go on.

Interrupt is cancellation: the task runs inside a cancel scope; ``interrupt()`` cancels it,
and the supervisor settles the turn (R-ABORT-1..3) under a shielded, bounded scope before
it emits exactly one ``task_end``.

A subagent (R-HOST-4, :mod:`greenroom.actors.runtime.subagents`) runs its own supervisor inside
a ``spawn_subagent`` call's task, i.e. in this task's nursery; its outputs come back
through this supervisor's inbox (``SubagentOutputs``) as live outputs of this run, tagged
with their ``origin`` and never traced here.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, assert_never

import attrs
import trio

from greenroom.actors.runtime.approval_broker import ApprovalBroker, ApproveFn
from greenroom.actors.runtime.compactor import Compaction, compaction_due
from greenroom.actors.runtime.emitter import OutputEmitter, repaired_blocks
from greenroom.actors.runtime.llm_streamer import LLMStreamer, ProviderTask
from greenroom.actors.runtime.subagents import Subagents
from greenroom.actors.runtime.tool_pool import ToolPool
from greenroom.actors.runtime.turn_dispatch import TurnDispatch
from greenroom.protocols.content import (
    TextBlock,
    UserContent,
)
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.guards import LoopGuard
from greenroom.protocols.hooks import RequestInfo, StopInfo, ToolResultsInfo
from greenroom.protocols.messages import (
    ApproveCall,
    BackoffSkipped,
    BeginTurn,
    InterruptTask,
    PlanBackoff,
    PoolCommand,
    SessionControl,
    SkipBackoff,
    StartAttempt,
    SteeringQueued,
    StreamerCommand,
    SupervisorMessage,
)
from greenroom.protocols.outputs import (
    CompactionReason,
    Output,
    RequestStatus,
    TaskEnd,
    TaskStart,
    TaskStatus,
    UserMsg,
)
from greenroom.protocols.retry import MAX_RETRIES, decide_retry
from greenroom.protocols.stream import (
    MessageCompleted,
    ModelError,
    StreamFailed,
    TokenUsage,
)
from greenroom.protocols.turn import TurnMachine

if TYPE_CHECKING:
    from greenroom.actors.runtime.session import Session

ABORT_GRACE_S = 2.0
"""Bound on the shielded teardown after an interrupt: writing ``abort`` and ``task_end``
and syncing the trace. Well above the usual few milliseconds, far below a hang."""

@attrs.frozen(kw_only=True, slots=True)
class TaskInput:
    """One task to run: the prompt and the run options that apply to it."""

    content: tuple[UserContent, ...]
    approve: ApproveFn | None
    thinking_level: str | None


class SessionSupervisor:
    """Runs the tasks of one ``Session.run`` call; see the module docstring."""

    def __init__(
        self,
        session: Session,
        first: TaskInput | None,
        output: trio.MemorySendChannel[list[Output]],
        cancel: trio.Event | None,
    ) -> None:
        self._session = session
        self._first = first
        self._output = output
        self._cancel_event = cancel
        self._scope = trio.CancelScope()
        self._abort_reason = "interrupted"
        self._stopping = False
        # Unbounded on purpose: tools, approvals and the streamer report with send_nowait
        # and must never block on the supervisor; the supervisor drains it continuously.
        inbox_send, inbox_receive = trio.open_memory_channel[SupervisorMessage](math.inf)
        self._inbox = inbox_send
        self._inbox_receive = inbox_receive
        # Unbounded: the session handle sends with send_nowait from any task and must
        # never block; a person or a client sends a handful per task.
        self.control, self._control = trio.open_memory_channel[SessionControl](math.inf)
        """The send side of the control inbox (interrupt, steer, skip the wait)."""
        # One queue for the whole call: the dispatch extends it, delivery drains it.
        self._steering: list[UserContent] = []
        # A trace the emitter cannot write ends the task failed (R-SEC-1).
        self._out = OutputEmitter(session, output, lambda: self._scope.cancel())
        self._dispatch = TurnDispatch(
            session=session,
            emitter=self._out,
            inbox=inbox_receive,
            interrupted=lambda: self._scope.cancel_called,
            on_steering=self._steering.extend,
            on_skip=self._skip_wait,
            on_usage=self._add_usage,
        )
        self._streamer: trio.MemorySendChannel[StreamerCommand] | None = None
        self._provider_task: ProviderTask | None = None
        self._compactor: Compaction | None = None
        self._task: TaskInput | None = None
        self.run_id = ""
        # per-task state
        self._turn = 0
        self._usage = TokenUsage()
        # The turn's state — blocks, calls, attempts, settlement — is the pure machine's
        # (R-ACTOR-3); one per turn.
        self._machine = TurnMachine(session_id=session.id, run_id="", turn=0)
        self._approvals: trio.MemorySendChannel[ApproveCall] | None = None
        self._pool: trio.MemorySendChannel[PoolCommand] | None = None

    # -- control from the session handle (its one inbox) ------------------------------

    async def _serve_control(self) -> None:
        async for message in self._control:
            match message:
                case InterruptTask(reason=reason):
                    # _stopping: an interrupt between two tasks must not start the next.
                    self._abort_reason, self._stopping = reason, True
                    self._scope.cancel()
                case SteeringQueued():
                    self._inbox.send_nowait(message)
                case BackoffSkipped():
                    self._skip_reconnect_wait()
                case _:
                    assert_never(message)

    def _skip_reconnect_wait(self) -> None:
        if self._compactor is not None and self._streamer is not None:
            # A compaction does not pump the inbox: its wait is the streamer's, told so.
            self._streamer.send_nowait(SkipBackoff())
            return
        self._inbox.send_nowait(BackoffSkipped())

    # -- the outer loop: this task, then queued follow-ups (R-STEER-6) ---------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the first task and every follow-up queued behind it, then close the
        output channel. Ready at once: its inboxes exist from construction, so control
        sent before the first turn is kept. Never raises except on host shutdown."""
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve_control)
                self._out.serve_in(nursery)
                try:
                    await self._run_tasks()
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._control.close()  # later control finds no one: the handle ignores it

    async def _run_tasks(self) -> None:
        session = self._session
        try:
            task: TaskInput | None = self._first
            if task is None:
                await self._run_manual_compaction()
            while task is not None:
                await self._run_task(task)
                interrupted = self._scope.cancelled_caught and self._out.trace_error is None
                if interrupted or self._stopping or session.auth_locked:
                    break
                task = session.take_follow_up()
                if task is not None:
                    self._out.flush()
                self._scope = trio.CancelScope()
        finally:
            # The session is idle before the host sees the last task_end, so a host that
            # reacts to it by starting the next task never meets Busy.
            session.task_finished(self.control)
            with trio.CancelScope(shield=True):
                self._out.flush()
                with trio.move_on_after(ABORT_GRACE_S):
                    await self._out.wait_published()
                # Past the bound the disk hangs: what is left still reaches its readers,
                # the last task_end above all.
                self._out.publish_unwritten()
                await self._output.aclose()

    async def _run_task(self, task: TaskInput) -> None:
        session = self._session
        self._task = task
        self.run_id = self._dispatch.run_id = session.new_run_id()
        started = trio.current_time()
        self._turn = 0
        self._usage = TokenUsage()
        self._steering.clear()
        self._out.begin_task()
        status: TaskStatus = "failed"
        message: str | None = None
        # R-TRACE-3: the input is a fact of the session before the task starts: fsynced
        # before task_start exists (a failure ends the task at once, in the scope below).
        prompt = self._out.emit(
            UserMsg(
                session_id=self._session.id,
                run_id=self.run_id,
                kind="prompt",
                content=repaired_blocks(task.content),
            )
        )
        self._out.flush()
        await self._out.sync()
        self._out.emit(
            TaskStart(session_id=self._session.id, run_id=self.run_id, input_seq=prompt.seq)
        )
        self._out.flush()
        try:
            with self._scope:
                status, message = await self._run_turns(task)
        except Exception as exc:  # a bug must end the task visibly, not hang the host
            status, message = "failed", f"internal error: {exc!r}"
            self._settle_failure(message)
        trace_error = self._out.trace_error
        if trace_error is not None:
            status, message = "failed", trace_error
            self._settle_failure(trace_error)
        elif self._scope.cancelled_caught:
            status, message = "aborted", self._abort_reason
            self._settle_abort()
        with trio.CancelScope(shield=True) as teardown:
            teardown.deadline = trio.current_time() + ABORT_GRACE_S
            self._out.emit(
                TaskEnd(
                    session_id=self._session.id,
                    run_id=self.run_id,
                    status=status,
                    turns=self._turn,
                    usage=self._usage,
                    wall_ms=round((trio.current_time() - started) * 1000),
                    message=message,
                )
            )
            # Written now, published by run() once the session is idle; the sync below
            # only has to fsync it. A trace that cannot be written must not cost the host:
            # task_end still reaches its readers, and the next task may try the file again.
            self._out.commit()
            await self._out.sync_quietly()

    def _settle_failure(self, message: str) -> None:
        """Settle the turn of a task that failed on its own (a bug, the trace): every call
        paired, the request ended. Best effort: the trace may be what failed."""
        with contextlib.suppress(Exception):
            # Results that arrived before the failure still count.
            self._dispatch.drain(self._machine)
            self._end_interrupted_compaction(message)
            complete = self._session.transcript.message_complete
            self._dispatch.apply(self._machine.fail(message, message_complete=complete))

    async def _run_turns(self, task: TaskInput) -> tuple[TaskStatus, str | None]:
        session = self._session
        settings = session.settings
        async with trio.open_nursery() as nursery:
            # Unbounded: asked with send_nowait; at most a turn's calls are ever queued.
            approvals_send, approvals_receive = trio.open_memory_channel[ApproveCall](math.inf)
            self._approvals = self._dispatch.approvals = approvals_send
            broker = ApprovalBroker(
                approve=task.approve,
                clients=session.client_approvals,
                session_rules=session.approval_rules(),
                timeout_s=settings.approval_timeout_s,
                inbox=self._inbox,
            )
            await nursery.start(broker.run, approvals_receive)
            subagents = Subagents(session, approve=task.approve, report=self._inbox)
            pool = ToolPool(
                tools=session.tool_by_name,
                inbox=self._inbox,
                workspace_dir=session.workspace_dir,
                scratchpad_dir=session.scratchpad_dir,
                sync_trace=session.sync_trace,
                result_budget=settings.tool_result_budget,
                spawn=subagents.spawn,
                sandbox=settings.sandbox,
                shell_network=settings.shell_network,
                private_dirs=(session.host.data_dir,),
                workspace_identity=session.workspace_identity,
            )
            # Unbounded: commands are sent with send_nowait as decisions arrive and the
            # pool only admits them; at most a turn's calls are ever queued.
            self._pool, pool_commands = trio.open_memory_channel[PoolCommand](math.inf)
            self._dispatch.pool = self._pool
            await nursery.start(pool.run, pool_commands)
            self._provider_task = session.provider.open_task()
            self._streamer = await start_streamer(nursery, self._provider_task, self._inbox)
            if self._cancel_event is not None:
                nursery.start_soon(forward_cancel, self._cancel_event, self.control)
            try:
                return await self._turn_loop(task)
            finally:
                nursery.cancel_scope.cancel()

    async def _turn_loop(self, task: TaskInput) -> tuple[TaskStatus, str | None]:
        settings = self._session.settings
        hooks = self._session.hooks
        guard = LoopGuard(
            repeat_threshold=settings.loop_repeat_threshold,
            no_progress_threshold=settings.loop_no_progress_threshold,
        )
        continuations = 0
        while True:
            if settings.max_turns >= 0 and self._turn >= settings.max_turns:
                return "max_turns", f"stopped after max_turns={settings.max_turns} turns"
            self._turn += 1
            self._dispatch.turn = self._turn
            self._machine = TurnMachine(
                session_id=self._session.id, run_id=self.run_id, turn=self._turn
            )
            reason = compaction_due(self._session)
            if reason is not None:
                compacted = await self._compact(reason)
                if not compacted and self._session.auth_locked is not None:
                    # R-COMPACT-7: auth stops at once; no request with a rejected key.
                    return "auth", self._session.auth_locked
            # R-STEER-5: drained at every input assembly, after a compaction too.
            self._dispatch.drain(self._machine)
            self._deliver_steering()
            failure = await self._run_turn(task)
            if failure is not None:
                if failure.kind == "auth":
                    self._session.lock_auth(failure.message)
                    return "auth", failure.message
                return "failed", failure.message
            await self._out.sync()  # R-TRACE-2: durable at every turn boundary
            self._dispatch.drain(self._machine)
            machine = self._machine
            if machine.has_calls:
                results = machine.results()
                await _call_hook(
                    hooks.after_tool_results,
                    ToolResultsInfo(
                        session_id=self._session.id,
                        run_id=self.run_id,
                        turn=self._turn,
                        results=results,
                    ),
                )
                loop = guard.observe_turn(list(machine.calls()), (r.is_error for r in results))
                if loop is not None:
                    return "loop_detected", loop
                continue
            if self._steering:
                continue
            if hooks.on_stop is not None and continuations < hooks.max_stop_continuations:
                more = await _call_hook(
                    hooks.on_stop,
                    StopInfo(
                        session_id=self._session.id,
                        run_id=self.run_id,
                        turn=self._turn,
                        final_message=machine.done_blocks,
                        continuations=continuations,
                    ),
                )
                if isinstance(more, str) and more.strip():
                    continuations += 1
                    self._steering.append(TextBlock(text=more))
                    continue
            return "completed", None

    # -- one turn ---------------------------------------------------------------

    async def _run_turn(self, task: TaskInput) -> ModelError | None:
        """Stream the turn (retrying per R-RETRY) and wait until every tool call of it is
        terminal. Returns the final error when the turn failed."""
        assert self._streamer is not None and self._pool is not None
        machine = self._machine
        self._pool.send_nowait(BeginTurn())
        delay_ms = 0
        attempt = 0
        overflow_compacted = False
        while True:
            attempt += 1
            self._dispatch.apply(machine.begin_attempt(attempt))
            self._out.flush()
            request = build_request(self._session, task)
            await _call_hook(
                self._session.hooks.before_request,
                RequestInfo(
                    session_id=self._session.id,
                    run_id=self.run_id,
                    turn=self._turn,
                    attempt=attempt,
                    request=request,
                ),
            )
            self._streamer.send_nowait(
                StartAttempt(request=request, attempt=attempt, delay_ms=delay_ms)
            )
            dispatch = self._dispatch
            result = await dispatch.pump(machine, lambda: machine.stream_result is not None)
            if isinstance(result, MessageCompleted):
                break
            assert isinstance(result, StreamFailed)
            error = result.error
            decision = decide_retry(error, attempt)
            delay_ms = decision.delay_ms or 0
            if decision.retry:
                # Skippable from the moment it is announced (R-RETRY-5).
                self._streamer.send_nowait(PlanBackoff())
            self._dispatch.apply(machine.fail_attempt(error, retry_in_ms=decision.delay_ms))
            # R-RETRY-4: calls that already ran are reported, never run again.
            await self._dispatch.pump(machine, lambda: machine.all_calls_terminal)
            if error.kind == "context_overflow" and not overflow_compacted:
                # R-COMPACT-9: compact once and rerun the same turn, once per turn.
                overflow_compacted = True
                machine.discard_attempt()
                self._pool.send_nowait(BeginTurn())
                if await self._compact("overflow"):
                    attempt, delay_ms = 0, 0
                    machine.restart()
                    # R-STEER-5: the rerun is the input assembly after the compaction.
                    self._dispatch.drain(self._machine)
                    self._deliver_steering()
                    continue
                if self._session.auth_locked is not None:
                    return ModelError(kind="auth", message=self._session.auth_locked)
                return error
            if not decision.retry:
                return error
            # The transcript turns the failed attempt into the [turn_retried] note; the
            # machine keeps its blocks for an abort during the backoff.
            machine.discard_attempt()
            self._pool.send_nowait(BeginTurn())
        await self._dispatch.pump(machine, lambda: machine.all_calls_terminal)
        return None

    # -- compaction (R-COMPACT) -----------------------------------------------------

    def _compaction(self) -> Compaction:
        assert self._streamer is not None
        return Compaction(
            session=self._session,
            emitter=self._out,
            streamer=self._streamer,
            run_id=self.run_id,
            turn=self._turn,
            add_usage=self._add_usage,
        )

    async def _compact(self, reason: CompactionReason) -> bool:
        """Run one compaction (R-COMPACT); returns whether it succeeded."""
        compaction = self._compactor = self._compaction()
        # The task's own request settings, thinking included, so that the summary
        # request's prefix is the one the provider has cached (R-COMPACT-5).
        template = build_request(self._session, self._task)
        # Kept while it runs: an interrupt or failure in it ends it failed (_settle_abort).
        succeeded = await compaction.run(reason, template)
        self._compactor = None
        return succeeded

    def _add_usage(self, usage: TokenUsage) -> None:
        self._usage = self._usage + usage

    def _skip_wait(self) -> None:
        # Every reconnect wait, a compaction's too, is the streamer's (R-RETRY-5).
        if self._streamer is not None:
            self._streamer.send_nowait(SkipBackoff())

    async def _run_manual_compaction(self) -> None:
        """``session.compact()``: a compaction on its own, as the session's one activity
        (R-COMPACT-11). Interrupting it ends it ``failed``."""
        session = self._session
        self.run_id = self._dispatch.run_id = session.new_run_id()
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    # The summary requests take the one path to the model (R-ACTOR-4).
                    provider_task = session.provider.open_task()
                    self._streamer = await start_streamer(nursery, provider_task, self._inbox)
                    await self._compact("manual")
                    nursery.cancel_scope.cancel()
        except Exception as exc:  # a bug must end the compaction visibly
            self._end_interrupted_compaction(f"internal error: {exc!r}")
        if self._out.trace_error is not None or self._scope.cancelled_caught:
            self._end_interrupted_compaction(self._out.trace_error or self._abort_reason)
        with trio.CancelScope(shield=True) as teardown:
            teardown.deadline = trio.current_time() + ABORT_GRACE_S
            self._out.flush()
            await session.sync_trace_quietly()

    def _end_interrupted_compaction(self, reason: str) -> None:
        if self._compactor is not None:
            self._compactor.end_interrupted(reason)
            self._compactor = None

    # -- steering -------------------------------------------------------------------

    def _deliver_steering(self) -> None:
        """R-STEER-2: drain the queue into one steering input at input assembly."""
        if not self._steering:
            return
        content = tuple(self._steering)
        self._steering.clear()
        self._out.emit(
            UserMsg(
                session_id=self._session.id, run_id=self.run_id, kind="steering", content=content
            )
        )

    # -- abort ------------------------------------------------------------------------

    def _settle_abort(self) -> None:
        """R-ABORT-1..3 and R-APPROVE-5: settle every call, record the abort."""
        self._dispatch.drain(self._machine)  # results that arrived before the cancel still count
        self._end_interrupted_compaction(self._abort_reason)
        complete = self._session.transcript.message_complete
        self._dispatch.apply(self._machine.abort(self._abort_reason, message_complete=complete))

def build_request(session: Session, task: TaskInput | None) -> ModelRequest:
    """The next request of ``session``: the transcript's context (with the
    ``[turn_retried]`` note on a retry: R-RETRY-4), the system prompt and tools, and the
    task's thinking level."""
    settings = session.settings
    return ModelRequest(
        model=settings.model,
        system=settings.system,
        tools=session.tool_schemas,
        messages=session.transcript.request_messages(),
        max_tokens=settings.max_tokens,
        thinking_level=task.thinking_level if task is not None else None,
        supports_vision=settings.supports_vision,
    )


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


def _request_status(error: ModelError) -> RequestStatus:
    kind = error.kind
    if kind in ("auth", "timeout", "malformed", "failed", "context_overflow"):
        return kind
    return "failed"


__all__ = ["MAX_RETRIES", "SessionSupervisor", "TaskInput"]


async def start_streamer(
    nursery: trio.Nursery,
    provider_task: ProviderTask,
    inbox: trio.MemorySendChannel[SupervisorMessage],
) -> trio.MemorySendChannel[StreamerCommand]:
    """Start an LLM streamer for ``provider_task`` that reports to ``inbox``; returns the
    send side of its command inbox."""
    streamer = LLMStreamer(provider_task, inbox)
    # Unbounded: the supervisor commands with send_nowait and never waits for the
    # streamer; a turn sends a handful of commands at most.
    send, commands = trio.open_memory_channel[StreamerCommand](math.inf)
    await nursery.start(streamer.run, commands)
    return send


async def forward_cancel(
    event: trio.Event, control: trio.MemorySendChannel[SessionControl]
) -> None:
    """``session.run(cancel=event)``: setting the event interrupts the task."""
    await event.wait()
    control.send_nowait(InterruptTask(reason="cancelled by host"))
