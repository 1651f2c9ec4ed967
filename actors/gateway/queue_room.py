"""The cap on what clients queue in a session (R-SEC-9): a session's open task takes
steering at its next model request and follow-ups when it ends, and one that waits for a
person does neither, so a client that queued faster would grow the server's memory without
bound. Each session holds at most ``GatewayLimits.max_queued_inputs`` steering inputs and
as many follow-ups; ``steer``, ``follow_up`` and an A2A message that steers answer 429
beyond.

The count is exact: what the session's task machine holds, and the input accepted and not
held by it yet — its call still reading the input's attachments, or the input in the
session's inbox. Counting only the machine's let calls from several connections (or
pipelined on one) all pass the check before any of their input reached the machine. Each
accepted call holds a place until the machine takes its input or it is dropped
(:attr:`InputReceipt.on_taken`), or its call gives the place back, never having handed
its input over (an error, a cancelled call, a session that had no task).

A session whose close has begun takes no input: every call that comes to it from then on
— even one that found it open a moment before — is answered 410, in the words its
supervisor drops late input with (:func:`closed_answer`)."""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Literal

from greenroom.actors.runtime.errors import SessionNotFound
from greenroom.actors.runtime.port import TaskInput
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.runtime.session import Session
from greenroom.protocols import jsonrpc
from greenroom.protocols.jsonrpc import RpcError

QueuedKind = Literal["steering", "follow-ups"]
"""What clients queue in a session."""

NOT_HANDED_OVER = "the input was not handed to the session"
"""Why a receipt whose input its call never handed over is dropped (nobody reads it)."""


class QueueRoom:
    """The places left in each session's queues of client input (see the module)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        """At most this many of each kind per session."""
        self._pending: Counter[tuple[str, QueuedKind]] = Counter()

    def reserve(self, session: Session, kind: QueuedKind) -> InputReceipt:
        """A place for one more ``kind`` in ``session``, or 429 when it holds :attr:`cap`
        already, counting input accepted and not yet taken by its task machine. The place
        is the receipt to give ``Session.steer`` or ``follow_up``: it is freed once the
        machine takes the input or drops it. A call that does not hand its input over
        (``steer`` answered False, or it failed or was cancelled first) drops the receipt
        (:meth:`InputReceipt.drop`) to free it. 410 once the session's close has begun
        (:func:`check_open`)."""
        check_open(session, kind)
        key = (session.id, kind)
        if held(session, kind) + self._pending[key] >= self.cap:
            raise RpcError(
                jsonrpc.TOO_MANY_REQUESTS,
                f"too many {kind} queued in session {session.id!r} (at most {self.cap}): "
                "wait until its task takes them, or interrupt it",
            )
        self._pending[key] += 1
        return InputReceipt(on_taken=partial(self._free, key))

    def pending(self, session_id: str, kind: QueuedKind) -> int:
        """How many ``kind`` of ``session_id`` were accepted and not yet taken by its task
        machine (nor dropped)."""
        return self._pending[(session_id, kind)]

    def _free(self, key: tuple[str, QueuedKind]) -> None:
        self._pending[key] -= 1
        if self._pending[key] <= 0:
            del self._pending[key]  # a session's places leave nothing behind


def held(session: Session, kind: QueuedKind) -> int:
    """How many ``kind`` the task machine of ``session`` holds: steering its open task has
    not taken, or tasks queued behind it. Steering that came too late for its task waits
    as a task of its own, and counts as the steering its client sent all the same: each
    input counts against one cap for its whole life, whatever the machine makes of it.
    A session loaded again holds what its trace queued in its record alone until its task
    wakes and queues it again (a parked one, until a person answers): that counts too."""
    machine = session.host.port(session.id).machine
    tasks = machine.queued_tasks
    late = sum(1 for task in tasks if isinstance(task, TaskInput) and task.late_steering)
    recorded = machine.record.queued
    late_recorded = sum(1 for task in recorded if task.late_steering)
    if kind == "steering":
        return len(machine.record.steering) + max(late, late_recorded)
    return max(len(tasks) - late, len(recorded) - late_recorded)


def dropped_answer(reason: str) -> RpcError:
    """Error 410 for input that will never run, ``reason`` saying why after
    :data:`~greenroom.protocols.jsonrpc.DROPPED`: what ``steer``, ``follow_up`` and an A2A
    message that steers answer for it, whatever dropped it (R-STEER-1, R-STEER-6). Every
    such answer begins with those words, so a client recognises it by its start."""
    return RpcError(jsonrpc.GONE, f"{jsonrpc.DROPPED}: {reason}")


def in_doubt_answer(reason: str) -> RpcError:
    """Error 503, ``data.outcome`` ``unknown``, for input whose record may or may not have
    survived the host (R-STEER-6, R-CLUSTER-2): what ``steer``, ``follow_up`` and an A2A
    message that steers answer when a cluster host gave the session up while the record
    was on its way to the cluster's trace, and NATS did not say whether it stored it, or
    the disk did not confirm it durable in time. Not a 410: the host that takes the
    session up may run it, and a client that sent it again could have it run twice."""
    return RpcError(
        jsonrpc.UNAVAILABLE,
        f"{jsonrpc.IN_DOUBT}: {reason}. The session's trace (session.subscribe) shows "
        "whether it was (its steering_queued or task_queued); sending it again may queue it "
        "twice",
        {"outcome": "unknown"},
    )


def closed_answer(session_id: str, kind: QueuedKind) -> RpcError:
    """:func:`dropped_answer` for ``kind`` sent to ``session_id`` once its close has
    begun, in the words its supervisor drops such input with when it reaches its inbox."""
    what = "steering" if kind == "steering" else "follow-up"
    return dropped_answer(f"session {session_id} closed before the {what} ran")


def check_open(session: Session, kind: QueuedKind) -> None:
    """:func:`closed_answer` once the host has begun to close ``session``: it lists it no
    more (or lists another, loaded since under its id). A call that found the session open
    just before gets the answer its input would get a moment later (R-HOST-3), not the
    host's "not open in this host"."""
    try:
        open_here = session.host.get_session(session.id) is session
    except SessionNotFound:
        open_here = False
    if not open_here:
        raise closed_answer(session.id, kind)
