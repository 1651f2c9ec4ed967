"""The streamer's door into its supervisor: the hot path of a running session.

Every network read of a model stream becomes one :class:`StreamBatch`. Sent through the
supervisor's inbox, each batch costs a task switch (the streamer's task wakes the
supervisor's, which wakes the reader's) on top of the work itself. When the supervisor is
parked on its inbox with nothing in it, which is nearly always while a model streams, the
door hands the batch to the supervisor's own handler at once, in the streamer's task:
handling is synchronous (no checkpoint), so it cannot interleave with the supervisor, and
the order of what reaches the supervisor is kept — a batch goes through the inbox whenever
anything was sent before it and not yet taken.

What a batch handled this way changes is the supervisor's to act on: unless the batch held
only deltas and traced nothing (the task machine saw nothing new, so its next step is
still to wait), the door sends :class:`Replan` so that the supervisor looks at its next
step again. A handler that raises does so in the supervisor's task, through ``Replan``,
where the failure ends the task as any other internal error does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import trio

from greenroom.actors.runtime.port import SessionPort
from greenroom.protocols.messages import Replan, StreamBatch, SupervisorMessage
from greenroom.protocols.stream import TextDelta, ThinkingDelta, ToolArgumentsDelta

__all__ = ["StreamDoor"]

_DELTAS = frozenset({TextDelta, ThinkingDelta, ToolArgumentsDelta})


class StreamDoor:
    """Where a task's streamer sends its batches (``send_nowait``, like the inbox it
    stands for). The supervisor sets :attr:`waiting` while it is parked on its inbox."""

    __slots__ = ("_flush", "_handle", "_inbox", "_port", "_receive", "waiting")

    def __init__(
        self,
        inbox: trio.MemorySendChannel[SupervisorMessage],
        receive: trio.MemoryReceiveChannel[SupervisorMessage],
        handle: Callable[[SupervisorMessage], None],
        flush: Callable[[], None],
        port: SessionPort,
    ) -> None:
        self._inbox = inbox
        self._receive = receive
        self._handle = handle
        self._flush = flush
        self._port = port
        self.waiting = False
        """True while the supervisor waits for its inbox (set and cleared by it)."""

    def send_nowait(self, batch: StreamBatch) -> None:
        """Hand ``batch`` to the supervisor: at once when it waits on an empty inbox,
        else through the inbox. Never raises (a closed inbox drops the batch, as a
        stale one would be)."""
        # A message sent to the waiting supervisor is handed to it directly and takes it
        # off the channel's waiters: then this batch must queue behind that message.
        if not (self.waiting and self._receive.statistics().tasks_waiting_receive):
            self._send(batch)
            return
        seq = self._port.last_seq
        try:
            self._handle(batch)
            self._flush()
        except Exception as exc:  # raised again in the supervisor's task, which ends the task
            self._send(Replan(error=exc))
            return
        if self._port.last_seq != seq or any(e.__class__ not in _DELTAS for e in batch.events):
            self._send(Replan())

    def _send(self, message: SupervisorMessage) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._inbox.send_nowait(message)
