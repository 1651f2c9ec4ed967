"""Taking up a task the trace leaves open (R-HITL-3, R-HITL-4, R-CLUSTER-2).

A task is open when its ``task_start`` has no ``task_end``: it was parked while it waited
only for people (no supervisor, no actors: R-HITL-3), or its host stopped under it (a
crash, a SIGKILL, a takeover by another host). A supervisor that starts for such a session
takes the task up where the trace left it, through :func:`take_up`:

- a prompt recorded without its ``task_start`` (the run was accepted, its host stopped
  before starting it: ``TaskMachine.adopt_unstarted``) gets it now, and its task runs;
- a compaction in flight is over: ``compaction_end(failed)``;
- a task its host stopped under while an interrupt ended it (after the cut stream's
  ``request_end(aborted)``, or after the ``abort``) stays interrupted: the ``abort`` is
  recorded if it is missing, with what the model had streamed, and the task ends
  ``aborted`` — nothing of it runs again, nobody is asked (R-ABORT-1, R-TRACE-4);
- the attempt in flight is rebuilt (:meth:`TurnRunner.resume`): a call that was running
  is in doubt and is resolved — by its tool's check, a person or the host-lost note; it
  runs again only when the check found it not done or a person says so (R-EFFECT-2:
  :mod:`~greenroom.actors.runtime.in_doubt`); a stream that was cut ends its attempt
  failed, to be tried again (R-RETRY-4); a call being decided is asked again unless a
  person has it;
- every request waiting for a person keeps waiting, held to the session's timeout policy
  from the moment it was first asked (R-HITL-1);
- the follow-ups the trace holds as queued (``task_queued``, neither started nor dropped)
  are queued again, in order, behind the task (:func:`requeue_recorded`, R-STEER-6); with
  no task open the first of them starts;
- the user's steering the trace holds as queued for the open task (``steering_queued``,
  not yet delivered by a ``user_msg``) is queued again as its steering, in order: its next
  input assembly delivers it, once (R-STEER-1, R-STEER-2).

Nothing is ever lost for a parked task (nothing was in flight); for the others the task
goes on with the host-lost note as steering, so the model knows what happened.
"""

from __future__ import annotations

import uuid

import attrs
import trio

from greenroom.actors.runtime.emitter import OutputEmitter, repaired_blocks
from greenroom.actors.runtime.port import Parked, SessionPort, TaskInput
from greenroom.actors.runtime.turn_runner import TurnRunner
from greenroom.protocols import markers
from greenroom.protocols.content import TextBlock
from greenroom.protocols.messages import PlanBackoff, StreamerCommand
from greenroom.protocols.outputs import CompactionEnd, TaskQueuedOutput, TaskStart
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.stream import ModelError
from greenroom.protocols.structured import recorded_spec
from greenroom.protocols.task import Phase
from greenroom.protocols.time_travel import interrupt_rest

__all__ = ["parked_or_lost", "queued_record", "requeue_recorded", "take_up"]

LEFT_INTERRUPTED = "interrupted; its host stopped before the task had ended"
"""The reason a task taken up inside its interrupt ends with (the interrupt's own is in
the trace)."""

_OPEN_ATTEMPT = frozenset({Phase.MODEL, Phase.TOOLS, Phase.RETRY, Phase.FAILED})
"""Phases in which the trace leaves an attempt whose calls the task must know again."""


def parked_or_lost(port: SessionPort) -> tuple[TaskInput, Parked | None]:
    """The run options of the open task: the parked task's own, or — for a task whose
    host stopped — the port's ``lost_approve``: ``"people"`` unless the host that takes
    it up says otherwise (its callback, if it had one, is gone with the process; a person
    answers instead)."""
    parked, port.parked_task = port.parked_task, None
    if parked is not None:
        return parked.task, parked
    return TaskInput(content=(), approve=port.lost_approve, thinking_level=None), None


def queued_record(port: SessionPort, task: TaskInput) -> tuple[TaskInput, TaskQueuedOutput]:
    """A user's follow-up ``task`` with the id it is queued under, and its ``task_queued``
    record (R-STEER-6): what a host that takes the session up needs to run it."""
    queue_id = "queued_" + uuid.uuid4().hex[:12]
    approve = task.approve
    record = TaskQueuedOutput(
        session_id=port.id,
        run_id=port.machine.run_id or "",
        queue_id=queue_id,
        content=repaired_blocks(task.content),  # a lone surrogate must not fail the task
        approve="deny" if approve is None else "people" if approve == PEOPLE else "host",
        thinking_level=task.thinking_level,
        output_schema=task.output.schema if task.output is not None else None,
        late_steering=task.late_steering,
    )
    return attrs.evolve(task, queued_id=queue_id), record


def requeue_recorded(port: SessionPort) -> None:
    """Queue again the steering and the follow-ups ``port``'s trace holds as queued (a
    fresh load's machine has none in memory): the steering as the open task's (none is
    open: it was for a task whose host stopped before starting it, which went with it),
    each follow-up with its recorded options, a host's callback replaced by the port's
    ``lost_approve`` as for the task its host stopped under."""
    machine = port.machine
    if machine.run_id is not None:
        for steering in machine.record.steering:
            machine.queue_steering(steering.content, steering_id=steering.steering_id)
    for record in machine.record.queued:
        approve = record.approve
        machine.queue_task(
            TaskInput(
                content=record.content,
                approve=PEOPLE if approve == "people" else None if approve == "deny"
                else port.lost_approve,
                thinking_level=record.thinking_level,
                output=recorded_spec(record.output_schema) if record.output_schema else None,
                queued_id=record.queue_id,
                late_steering=record.late_steering,
            )
        )


def take_up(
    port: SessionPort,
    out: OutputEmitter,
    turns: TurnRunner,
    streamer: trio.MemorySendChannel[StreamerCommand],
    *,
    run_id: str,
    lost_host: bool,
) -> None:
    """Take up the open task of ``port`` with the task's fresh actors (see the module
    docstring). ``lost_host``: the task's host stopped under it (not a parked task)."""
    machine = port.machine
    record = machine.record
    lost = False
    prompt = record.unstarted
    if prompt is not None and prompt.run_id == run_id:
        out.emit(
            TaskStart(session_id=port.id, run_id=run_id, input_seq=prompt.seq,
                      output_schema=prompt.output_schema)
        )
    elif record.aborting or record.attempt_aborted:
        _end_interrupted(port, out)
    elif record.phase is Phase.COMPACTING:
        lost = True
        out.emit(
            CompactionEnd(
                session_id=port.id,
                run_id=run_id,
                status="failed",
                attempt=1,
                error_message=markers.HOST_LOST_COMPACTION,
            )
        )
    elif record.turn and record.phase in _OPEN_ATTEMPT:
        cut, lost = turns.resume(record)
        if cut:
            lost = True
            error = ModelError(kind="timeout", message=markers.HOST_LOST_STREAM)
            retry_in_ms = machine.plan_failure(error)
            if retry_in_ms is not None:
                # Skippable from the moment it is announced (R-RETRY-5).
                streamer.send_nowait(PlanBackoff())
            turns.fail_attempt(error, retry_in_ms)
    for request in record.pending_people:
        port.host.watch_approval(port, request.call_id, request.asked_at)
    if lost and lost_host:
        machine.queue_steering((TextBlock(text=markers.HOST_LOST_CONTINUATION),))
    out.flush()


def _end_interrupted(port: SessionPort, out: OutputEmitter) -> None:
    """The host of ``port``'s open task stopped while an interrupt ended it: record what
    the interrupt had still to record, and end the task ``aborted`` as the interrupt
    would have (its ``task_end`` is the task's end's). Taking it up as a stream cut by the
    lost host would run the interrupted task again."""
    machine = port.machine
    reason = machine.stop_reason or LEFT_INTERRUPTED
    rest = interrupt_rest(
        machine.record,
        port.transcript.attempt_blocks,
        session_id=port.id,
        reason=reason,
        most=port.host.trace_log.largest_input(),
    )
    for output in rest:
        out.emit(output)
    # The interrupt dropped the queue (and recorded it): the follow-ups queued since, as
    # the trace holds them, still run once the task has ended.
    queued = machine.queued_tasks
    machine.interrupt(reason)
    for task in queued:
        machine.queue_task(task)
