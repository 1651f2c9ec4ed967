"""What became of the input a caller queued in a running session: the receipt that
``Session.steer`` and ``Session.follow_up`` fill in (their ``recorded=``), so that whoever
answers a client for that input — the gateway's ``steer`` and ``follow_up``, an A2A message
that steers, the ACP agent's ``_greenroom/steer`` — tells the truth: ``queued`` only for
input that survives the host (R-STEER-1, R-STEER-6, R-CLUSTER-2), an error for input that
was dropped unrun, and that it is not known for input whose record may or may not have
survived. :func:`queued_once_recorded` is that answer, for every front."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio


@attrs.define(eq=False, slots=True)
class InputReceipt:
    """Filled in once what became of queued input is known; ``settled`` is set then.

    Either its record (``steering_queued``, ``task_queued``) survives the host — fsynced,
    or in a cluster acknowledged by JetStream — so that a host that takes the session up
    after this one stopped still delivers it, and ``dropped`` stays None; or it never
    runs (its session closed, or its work stopped, before it was recorded) and
    ``dropped`` says why; or nobody knows which (a cluster host gave the session up while
    the record was on its way to JetStream, and NATS did not say whether it stored it)
    and ``in_doubt`` says why. Steering that comes too late for its task is recorded as
    the task of its own it becomes (``task_queued``)."""

    settled: trio.Event = attrs.field(factory=trio.Event)
    """Set once the input's record survives the host, or it was dropped."""

    dropped: str | None = None
    """Why the input will not run, when it was dropped; None otherwise."""

    in_doubt: str | None = None
    """Why it is not known whether the input runs, when it is not; None otherwise."""

    on_taken: Callable[[], object] | None = None
    """Called once, when the session's task machine has taken the input (into the steering
    of its open task, or its queue of tasks) or the input was dropped: whoever counts the
    input queued in a session (the gateway's cap, R-SEC-9) counts it from the machine from
    then on, and until then must count it itself. Never called for input that was not
    handed to a session (``steer`` answered False): its caller drops the receipt then."""

    def taken(self) -> None:
        """The session's task machine holds the input now: :attr:`on_taken`, once."""
        on_taken, self.on_taken = self.on_taken, None
        if on_taken is not None:
            on_taken()

    def durable(self) -> None:
        """The input's record survives the host: settle, unless settled already."""
        self.settled.set()

    def drop(self, reason: str) -> None:
        """The input will not run: settle with ``reason``, unless settled already."""
        if not self.settled.is_set():
            self.dropped = reason
            self.settled.set()
        self.taken()  # nothing will hold it: it counts nowhere

    def doubt(self, reason: str) -> None:
        """Whether the input's record survives the host is not known: settle with
        ``reason``, unless settled already."""
        if not self.settled.is_set():
            self.in_doubt = reason
            self.settled.set()
        self.taken()  # nothing here holds it: the session was given up


def drop_unrun(receipt: InputReceipt | None, reason: str) -> None:
    """:meth:`InputReceipt.drop` when there is a receipt (callers may give none)."""
    if receipt is not None:
        receipt.drop(reason)


def taken(receipt: InputReceipt | None) -> None:
    """:meth:`InputReceipt.taken` when there is a receipt (callers may give none)."""
    if receipt is not None:
        receipt.taken()


ACCEPT_WAIT_S = 10.0
"""How long an answer for input waits for its record to be durable (the gateway's ``run``
for its prompt, ``steer`` and ``follow_up``, the ACP agent's ``_greenroom/steer``) before
it is given anyway, saying ``durable: false``."""


async def once_durable(
    durable: Callable[[], Awaitable[object]], answer: dict[str, Any]
) -> dict[str, Any]:
    """``answer`` once ``durable`` has returned; a store that hangs holds it only
    :data:`ACCEPT_WAIT_S`, and ``answer`` then says ``durable: false``: this host took the
    input and goes on with it, but it is not known to survive the host, so a client that
    must not lose it follows the session (its trace says whether it ran) rather than
    count on it (R-TRACE-3, R-STEER-6, R-CLUSTER-2)."""
    with trio.move_on_after(ACCEPT_WAIT_S) as waiting:
        await durable()
    return {**answer, "durable": False} if waiting.cancelled_caught else answer


async def queued_once_recorded(
    recorded: InputReceipt,
    *,
    dropped: Callable[[str], Exception],
    in_doubt: Callable[[str], Exception],
) -> dict[str, Any]:
    """``{queued: true}`` once ``recorded`` (of ``Session.steer`` or ``follow_up``) says
    the input's record survives this host — fsynced, or in a cluster acknowledged by
    JetStream — so a host that takes the session up delivers it (R-STEER-1, R-STEER-6,
    R-CLUSTER-2). Raises ``dropped(reason)`` when it says the input was dropped unrun,
    ``in_doubt(reason)`` when it says nobody knows whether the record survived: each
    front builds those errors in its own words. A store that hangs holds the answer
    only :data:`ACCEPT_WAIT_S` (:func:`once_durable`)."""
    answer = await once_durable(recorded.settled.wait, {"queued": True})
    if recorded.dropped is not None:
        raise dropped(recorded.dropped)
    if recorded.in_doubt is not None:
        raise in_doubt(recorded.in_doubt)
    return answer
