"""One task as its supervisor carries it out, from its first step to its one teardown.

A :class:`RunningTask` is a prompt and its turns, or a manual compaction (the two kinds of
task of the task machine): its actors (:class:`TaskWork`: the approval broker, the tool
pool, the LLM streamer and the hook calls, in one cancel scope), its turns
(:class:`~greenroom.actors.runtime.turn_runner.TurnRunner`), its compaction
(:class:`~greenroom.actors.runtime.compactor.CompactionRun`) and the numbers of its model
requests. The supervisor creates one per task, hands it the steps the task machine issues
and the inbox messages that concern it, and ends it — whatever ended it — through the one
teardown: :meth:`stop_work`, then :meth:`settle` and the ``task_end`` (R-RUN-7), or
:meth:`park` when the task waits only for people (R-HITL-3).

Before each model request it sends — a turn's attempt (with the steering it delivers), an
automatic compaction's summary and its retries — it asks the session's account whether the
request could pass a cost budget (R-SHARE-4, :mod:`~greenroom.protocols.budgets`); if so the
request is not sent and the task machine is told, which ends the task ``budget_exceeded``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import attrs
import trio

from greenroom.actors.providers.base import sole_exception
from greenroom.actors.runtime.accounting import RequestBilling
from greenroom.actors.runtime.approval_broker import ApprovalBroker
from greenroom.actors.runtime.compactor import CompactionRun
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.actors.runtime.port import Parked, SessionPort, TaskInput
from greenroom.actors.runtime.resumption import take_up
from greenroom.actors.runtime.subagents import RunChild, Subagents
from greenroom.actors.runtime.tool_hooks import tool_hook_calls
from greenroom.actors.runtime.tool_pool import ToolPool
from greenroom.actors.runtime.turn_runner import TurnRunner
from greenroom.actors.runtime.user_code import call_user_code
from greenroom.protocols.content import UserContent
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.hooks import RequestInfo, StopInfo, ToolResultsInfo
from greenroom.protocols.messages import (
    ActorFailed,
    ApprovalAsked,
    ApprovalDecided,
    ApproveCall,
    HookAnswered,
    PersonAnswered,
    PlanBackoff,
    PoolCommand,
    QuestionAsked,
    SkipBackoff,
    StartAttempt,
    StreamBatch,
    StreamerCommand,
    SupervisorMessage,
    ToolCallChecked,
    ToolCallFinished,
    ToolProgressed,
)
from greenroom.protocols.outputs import CompactionReason, Output, TaskEnd, TaskStatus, UserMsg
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.stream import StreamFailed
from greenroom.protocols.task import CallHook

__all__ = ["FINISHED_GRACE_S", "RunningTask", "TaskWork", "build_request"]

logger = logging.getLogger(__name__)

FINISHED_GRACE_S = 2.0
"""How long a finished task's actors may take to end once their inboxes are closed
before they are cancelled (they have nothing left to do: this only bounds a bug)."""


class TaskWork:
    """The actors of one task: the approval broker, the tool pool and the LLM streamer,
    with the hook calls, in one nursery whose cancel scope ends them together (interrupt
    = cancellation). Start it with ``nursery.start(work.run)``; it serves until
    :meth:`stop`. Each reports to the supervisor's inbox only. An actor that fails
    (a bug, here or in code it calls) ends the task ``failed``, never the session's
    supervisor or the host (R-SEC-1)."""

    __slots__ = (
        "_approvals",
        "_done",
        "_inbox",
        "_pool",
        "_port",
        "_run_child",
        "_stopping",
        "_streamer",
        "_task",
        "approvals",
        "nursery",
        "pool",
        "scope",
        "streamer",
        "tool_hooks",
    )

    def __init__(
        self,
        port: SessionPort,
        task: TaskInput | None,
        inbox: trio.MemorySendChannel[SupervisorMessage],
        run_child: RunChild,
    ) -> None:
        self._port = port
        self._task = task
        self._inbox = inbox
        self._run_child = run_child
        self._done = trio.Event()
        self._stopping = False
        self.scope = trio.CancelScope()
        # Unbounded, all three: the supervisor commands with send_nowait and never waits
        # for its actors; at most a turn's calls (or a handful of stream commands) queue.
        self.approvals, self._approvals = trio.open_memory_channel[ApproveCall](math.inf)
        self.pool, self._pool = trio.open_memory_channel[PoolCommand](math.inf)
        self.streamer, self._streamer = trio.open_memory_channel[StreamerCommand](math.inf)
        self.nursery: trio.Nursery | None = None
        self.tool_hooks = tool_hook_calls(
            port.hooks, port.id, port.workspace_dir, port.host.trace_log.largest_input()
        )
        """The session's tool hooks as the task starts (R-HOOK-2), for the broker and the
        pool; None without any."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the actors; ready once they serve. Returns after :meth:`stop`, or once
        an actor has failed (the task is then told to end ``failed``)."""
        serving = False
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    # Hook calls run here, the actors in a nursery of their own that ends
                    # when they have: their inboxes closed (a finished task's stop), or
                    # the scope cancelled (any other).
                    self.nursery = nursery
                    async with trio.open_nursery() as actors:
                        await self._start_actors(actors)
                        task_status.started()
                        serving = True
                    nursery.cancel_scope.cancel()  # a hook call still out ends with them
        # except*: a failure can come grouped with a cancellation (an actor's clean-up
        # failing as an interrupt ends it); the failure stays here, a cancellation of the
        # host goes on. Before the actors serve, the supervisor's start sees it.
        except* Exception as failed:
            if not serving:
                raise
            self._actor_failed(failed)
        finally:
            self._done.set()

    def _actor_failed(self, failed: BaseExceptionGroup[Exception]) -> None:
        """An actor (or a hook call of the task) raised: logged, and the task told to end
        ``failed`` unless it is ending already."""
        logger.error("an actor of session %s failed", self._port.id, exc_info=failed)
        if self._stopping:
            return  # the task ends anyway: its end says why
        message = f"internal error: {sole_exception(failed)!r}"
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._inbox.send_nowait(ActorFailed(message=message))

    async def _start_actors(self, nursery: trio.Nursery) -> None:
        """Start the broker, the pool and the streamer in ``nursery``, each ready to serve
        (R-ACTOR-2)."""
        port = self._port
        settings = port.settings
        approve = self._task.approve if self._task is not None else None
        hooks = self.tool_hooks
        broker = ApprovalBroker(
            approve=approve,
            timeout_s=settings.approval_timeout_s,
            inbox=self._inbox,
            origin=port.origin_path,
            hooks=hooks,
            tools=port.tool_by_name,
            largest_answer=port.host.trace_log.largest_input(),
        )
        await nursery.start(broker.run, self._approvals)
        subagents = Subagents(port, approve=approve, run_child=self._run_child)
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
            workspace_identity=port.workspace_identity,
            attachments=port.attachments,
            people=approve == PEOPLE,
            hooks=hooks,
            editor=port.editor,
            largest_record=port.host.trace_log.largest_input(),
        )
        await nursery.start(pool.run, self._pool)
        streamer = LLMStreamer(
            port.provider.open_task(), self._inbox, port.requester(), RequestBilling(port)
        )
        await nursery.start(streamer.run, self._streamer)

    async def stop(self, *, finished: bool = False) -> None:
        """End the actors and wait until they have: a tool that ignores cancellation is
        abandoned after the pool's grace (R-SEC-2), so this stays bounded.

        ``finished``: the task is done and nothing of it is in flight, so closing the
        actors' inboxes ends them (R-ACTOR-2) without a cancellation unwinding through
        each, about four times cheaper; an actor still busy past
        :data:`FINISHED_GRACE_S` is cancelled after all."""
        self._stopping = True
        if finished:
            for channel in (self.approvals, self.pool, self.streamer):
                channel.close()
            with trio.move_on_after(FINISHED_GRACE_S):
                await self._done.wait()
                return
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
            await call_hook(hook, info)
            streamer.send_nowait(command)

        assert self.nursery is not None
        self.nursery.start_soon(after_hook)

    def call_hook(self, name: Any, hook: Callable[[Any], Any] | None, info: Any) -> None:
        """Call a host hook in a task of the work; its answer reaches the supervisor's
        inbox as ``HookAnswered``."""
        inbox = self._inbox

        async def call() -> None:
            answer = await call_hook(hook, info)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                inbox.send_nowait(HookAnswered(hook=name, answer=answer))

        assert self.nursery is not None
        self.nursery.start_soon(call)


class RunningTask:
    """One task of ``port``, run ``run_id`` (see the module docstring). ``task`` is
    None for a manual compaction."""

    __slots__ = (
        "_compaction",
        "_out",
        "_port",
        "_requests",
        "_turn_request",
        "run_id",
        "started_at",
        "task",
        "turns",
        "work",
    )

    def __init__(
        self,
        port: SessionPort,
        out: OutputEmitter,
        task: TaskInput | None,
        *,
        run_id: str,
        started_at: float,
    ) -> None:
        self._port = port
        self._out = out
        self.task = task
        self.run_id = run_id
        self.started_at = started_at
        self.work: TaskWork | None = None
        self.turns: TurnRunner | None = None
        self._compaction: CompactionRun | None = None
        self._requests = 0
        self._turn_request = 0

    async def open(
        self,
        nursery: trio.Nursery,
        inbox: trio.MemorySendChannel[SupervisorMessage],
        run_child: RunChild,
    ) -> None:
        """Start the task's actors in ``nursery`` (the supervisor's)."""
        work = TaskWork(self._port, self.task, inbox, run_child)
        await nursery.start(work.run)
        self.work = work
        self.turns = TurnRunner(
            port=self._port,
            emitter=self._out,
            run_id=self.run_id,
            approvals=work.approvals,
            pool=work.pool,
            people=self.task is not None and self.task.approve == PEOPLE,
            before_tool=work.tool_hooks is not None and work.tool_hooks.has_before,
        )

    def _actors(self) -> tuple[TurnRunner, TaskWork]:
        assert self.turns is not None and self.work is not None
        return self.turns, self.work

    # -- steps --------------------------------------------------------------------------------

    def begin_turn(
        self, turn: int, steering: tuple[UserContent, ...], steering_ids: tuple[str, ...] = ()
    ) -> None:
        """Begin turn ``turn``: the steering (its images attached already) recorded as one
        input (R-STEER-2) that names the recorded ``steering_queued`` it delivers
        (``steering_ids``), then attempt 1 — unless its request could pass a budget."""
        turns, _ = self._actors()
        if self._over_budget(steering):
            return
        turns.begin_turn(turn)
        if steering:
            self._out.emit(
                UserMsg(session_id=self._port.id, run_id=self.run_id, kind="steering",
                        content=steering, steering_ids=steering_ids)
            )
        self._send_attempt(1, 0)

    def begin_attempt(self, attempt: int, delay_ms: int) -> None:
        """Send attempt ``attempt`` of the turn's request after ``delay_ms`` — unless it
        could pass a budget."""
        if not self._over_budget():
            self._send_attempt(attempt, delay_ms)

    def _over_budget(self, steering: tuple[UserContent, ...] = ()) -> bool:
        """Whether the session's next request — the transcript's, and the ``steering``
        a turn delivers with it — could pass one of its cost budgets (see
        :meth:`_refused`)."""
        port = self._port
        if not port.account.limits:
            return False  # the usual case: no budget, nothing to estimate
        request = build_request(port, self.task)
        if steering:
            # Recorded only once the turn is sure to be sent, the steering is not in the
            # transcript yet; the request carries it all the same.
            messages = (*request.messages, UserMessage(content=steering))
            request = attrs.evolve(request, messages=messages)
        return self._refused(request)

    def _refused(self, request: ModelRequest) -> bool:
        """Whether ``request`` could pass one of the session's cost budgets; if so the task
        machine has been told (it ends the task ``budget_exceeded``), else the request's
        bound is held until its cost is spent (R-SHARE-4)."""
        port = self._port
        account = port.account
        if not account.limits:
            return False
        machine = port.machine
        refusal = account.refusal(request, machine.record.last_request_total)
        if refusal is not None:
            machine.exceed_budget(refusal)
        return refusal is not None

    def _send_attempt(self, attempt: int, delay_ms: int) -> None:
        turns, work = self._actors()
        port = self._port
        turns.begin_attempt(attempt)
        self._out.flush()
        request = build_request(port, self.task)
        self._turn_request = self._next_request()
        command = StartAttempt(
            request=request, attempt=attempt, delay_ms=delay_ms, number=self._turn_request
        )
        info = RequestInfo(
            session_id=port.id, run_id=self.run_id, turn=turns.turn, attempt=attempt,
            request=request,
        )
        work.request(command, port.hooks.before_request, info)

    def _next_request(self) -> int:
        self._requests += 1
        return self._requests

    def start_compaction(self, reason: CompactionReason) -> None:
        """Compact now (R-COMPACT); after an overflow the failed attempt is history. An
        automatic compaction's requests, its summary's retries too, are checked against
        the budgets as a turn's are (a manual one's are the user's own requests)."""
        turns, work = self._actors()
        if reason != "manual" and self._over_budget():
            return
        if reason == "overflow":
            turns.discard_attempt()
        # The task's own request settings, thinking included, so that the summary
        # request's prefix is the one the provider has cached (R-COMPACT-5).
        self._compaction = CompactionRun(
            port=self._port,
            emitter=self._out,
            streamer=work.streamer,
            run_id=self.run_id,
            turn=turns.turn,
            reason=reason,
            template=build_request(self._port, self.task),
            number=self._next_request,
            refused=None if reason == "manual" else self._refused,
        )
        self._compaction.start()

    @property
    def compaction(self) -> CompactionRun | None:
        """The compaction in progress, if any."""
        compaction = self._compaction
        if compaction is not None and not compaction.running and not compaction.ready:
            self._compaction = compaction = None
        return compaction

    def call_hook(self, step: CallHook) -> None:
        """Call the host's ``after_tool_results`` or ``on_stop`` hook (R-HOOK-1)."""
        turns, work = self._actors()
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

    def take_up(self, *, lost_host: bool) -> None:
        """Take up the open task the trace left (R-HITL-4): see
        :mod:`greenroom.actors.runtime.resumption`."""
        turns, work = self._actors()
        take_up(self._port, self._out, turns, work.streamer, run_id=self.run_id,
                lost_host=lost_host)

    # -- what the actors report -----------------------------------------------------------

    def on_batch(self, batch: StreamBatch) -> None:
        """A stream batch: the turn's attempt's, the compaction's, or a stale one."""
        number = batch.request
        if number and number == self._turn_request:
            self._turn_batch(batch)
        elif self._compaction is not None and number == self._compaction.request:
            self._compaction.feed(batch.events)

    def _turn_batch(self, batch: StreamBatch) -> None:
        turns, work = self._actors()
        turns.feed(batch.events)
        result = turns.machine.stream_result
        if result is None:
            return
        self._turn_request = 0
        if isinstance(result, StreamFailed):
            error = result.error
            retry_in_ms = self._port.machine.plan_failure(error)
            if retry_in_ms is not None:
                # Skippable from the moment it is announced (R-RETRY-5).
                work.streamer.send_nowait(PlanBackoff())
            turns.fail_attempt(error, retry_in_ms)

    def on_turn_message(
        self,
        message: ToolCallFinished | ToolProgressed | ApprovalDecided | ApprovalAsked
        | QuestionAsked | ToolCallChecked,
    ) -> None:
        """What the pool or the broker reported."""
        if self.turns is not None:
            self.turns.handle(message)

    def answer(self, answer: PersonAnswered) -> str | None:
        """A person's answer; why it was refused, or None. A task told to stop (an
        interrupt, a failure, a budget) waits for no answer: taken, it would be recorded
        as a person's decision for a call that is settled as interrupted instead."""
        if self.turns is None:
            return f"session {self._port.id} has no request waiting for an answer"
        stop = self._port.machine.stop_reason
        if stop is not None:
            return (
                f"call {answer.call_id!r} of session {self._port.id} waits for no answer: "
                f"its task is ending ({stop})"
            )
        return self.turns.answer(answer)

    def skip_backoff(self) -> None:
        """End the reconnect wait, a turn's or a compaction's (R-RETRY-5)."""
        if self.work is not None:
            self.work.streamer.send_nowait(SkipBackoff())

    # -- the one teardown -------------------------------------------------------------------

    async def stop_work(self, *, finished: bool = False) -> None:
        """Stop the task's actors (and drop its model requests: their late batches are
        stale). The supervisor then drains what they reported before and settles.
        ``finished``: the task completed, nothing of it is in flight (see
        :meth:`TaskWork.stop`)."""
        self._turn_request = 0
        if self._compaction is not None:
            self._compaction.request = 0
        work, self.work = self.work, None
        if work is not None:
            with trio.CancelScope(shield=True):
                await work.stop(finished=finished)
            if self.turns is not None:
                self.turns.actors_stopped()
        # No request of the task is under way any more: its bound holds no budget (what a
        # cut stream reported is spent as the task settles).
        self._port.account.release()

    def settle(self, status: TaskStatus, message: str | None, *, best_effort: bool) -> None:
        """Settle what is in flight for ``status``: a compaction ends failed, an aborted
        task's calls are settled with its ``abort`` (R-ABORT-1..3, R-APPROVE-5), a failed
        one's with its request ended failed."""
        compaction, self._compaction = self._compaction, None
        reason = message or status
        with _best_effort(best_effort):
            if compaction is not None:
                compaction.end_interrupted(reason)
            if self.task is None or self.turns is None:
                return  # a manual compaction has no task records
            if status == "aborted":
                if not self._port.machine.record.aborting:  # a taken-up task's is recorded
                    self.turns.abort(reason)
            elif status == "failed":
                self.turns.fail(reason)

    def task_end(self, status: TaskStatus, message: str | None) -> TaskEnd:
        """The task's one ``task_end``."""
        machine = self._port.machine
        answers = machine.record.answers
        return TaskEnd(
            session_id=self._port.id,
            run_id=self.run_id,
            status=status,
            turns=machine.turn,
            usage=machine.usage,
            wall_ms=round((trio.current_time() - self.started_at) * 1000),
            message=message,
            output=answers.answer if answers is not None and status == "completed" else None,
        )

    async def park(
        self, output: trio.MemorySendChannel[list[Output]], cancel: trio.Event | None
    ) -> Parked:
        """The task waits only for people: its actors stop and it keeps only its run
        options, its reader's channel and its run's cancel event (R-HITL-3)."""
        await self.stop_work()
        assert self.task is not None
        # A run nobody reads any more (the gateway's, after a restart) keeps no channel.
        reader = output.statistics().open_receive_channels > 0
        return Parked(task=self.task, output=output if reader else None,
                      started_at=self.started_at, cancel=cancel)


def build_request(port: SessionPort, task: TaskInput | None) -> ModelRequest:
    """The next request of the session: the transcript's context (with the
    ``[turn_retried]`` note on a retry: R-RETRY-4), the system prompt and tools, the
    task's thinking level, and the answer it requires (R-OUT-1: as its trace records it,
    so a task taken up elsewhere asks for the same)."""
    settings = port.settings
    answers = port.machine.record.answers
    return ModelRequest(
        model=settings.model,
        system=settings.system,
        tools=port.tool_schemas,
        messages=port.transcript.request_messages(),
        max_tokens=settings.max_tokens,
        thinking_level=task.thinking_level if task is not None else None,
        supports_vision=settings.supports_vision,
        images=port.attachments.source,
        output=answers.format if answers is not None else None,
    )


def _best_effort(ignore_errors: bool) -> contextlib.AbstractContextManager[object]:
    """Where a failure may be what ended the task: errors there are dropped."""
    if ignore_errors:
        return contextlib.suppress(Exception)
    return contextlib.nullcontext()


async def call_hook(hook: Callable[[Any], Any] | None, info: Any) -> Any:
    """Call a host hook; a hook that raises is ignored (hooks never end a task), its
    failure logged."""
    if hook is None:
        return None
    result, failure = await call_user_code(hook, info)
    if failure is not None:
        logger.warning("a host hook raised (ignored)", exc_info=failure)
    return result
