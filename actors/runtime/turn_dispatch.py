"""The supervisor's dispatch: inbox messages to the turn machine, its effects to the actors.

:class:`TurnDispatch` owns the receive side of a running session's inbox. Each message is
fed to the turn's :class:`~greenroom.protocols.turn.TurnMachine` (one exhaustive ``match``);
the effects the machine returns are carried out in order — outputs emitted through the
:class:`~greenroom.actors.runtime.emitter.OutputEmitter`, ``ApproveCall`` to the approval broker,
``RunToolCall`` / ``SkipToolCall`` to the tool pool, usage to the task's total and the
ledger. Steering and backoff skips are handed to the supervisor's callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

import trio

from greenroom.actors.runtime.emitter import OutputEmitter, repaired_blocks
from greenroom.protocols.content import UserContent
from greenroom.protocols.messages import (
    ApprovalAsked,
    ApprovalDecided,
    ApproveCall,
    BackoffSkipped,
    PoolCommand,
    RunToolCall,
    SkipToolCall,
    SteeringQueued,
    StreamBatch,
    SubagentOutputs,
    SupervisorMessage,
    ToolCallFinished,
    ToolProgressed,
)
from greenroom.protocols.outputs import (
    ApprovalRequest,
    PartialText,
    PartialThinking,
    PartialToolCall,
)
from greenroom.protocols.stream import MessageCompleted, StreamFailed, TokenUsage
from greenroom.protocols.text import repair_text
from greenroom.protocols.turn import Effect, RecordUsage, TurnMachine

if TYPE_CHECKING:
    from greenroom.actors.runtime.session import Session


_PARTIALS = frozenset({PartialText, PartialThinking, PartialToolCall})


class TurnDispatch:
    """Feeds one running session's inbox to its turn machine and carries out the effects.

    ``interrupted`` says whether the task's interrupt was requested (an allow decided
    after it never starts the call); ``on_steering`` receives steering input; ``on_skip``
    ends the current reconnect wait; ``on_usage`` adds a request's usage to the task's
    total. ``approvals`` and ``pool`` are set when the task's actors have started."""

    __slots__ = (
        "_emitter",
        "_inbox",
        "_interrupted",
        "_on_skip",
        "_on_steering",
        "_on_usage",
        "_session",
        "approvals",
        "pool",
        "run_id",
        "turn",
    )

    def __init__(
        self,
        *,
        session: Session,
        emitter: OutputEmitter,
        inbox: trio.MemoryReceiveChannel[SupervisorMessage],
        interrupted: Callable[[], bool],
        on_steering: Callable[[tuple[UserContent, ...]], None],
        on_skip: Callable[[], None],
        on_usage: Callable[[TokenUsage], None],
    ) -> None:
        self._session = session
        self._emitter = emitter
        self._inbox = inbox
        self._interrupted = interrupted
        self._on_steering = on_steering
        self._on_skip = on_skip
        self._on_usage = on_usage
        self.approvals: trio.MemorySendChannel[ApproveCall] | None = None
        self.pool: trio.MemorySendChannel[PoolCommand] | None = None
        self.run_id = ""
        self.turn = 0

    async def pump(
        self, machine: TurnMachine, done: Callable[[], bool]
    ) -> MessageCompleted | StreamFailed | None:
        """Handle inbox messages until ``done()``; returns the attempt's terminal event."""
        receive = self._inbox
        emitter = self._emitter
        while not done():
            # What the caller emitted is written and published before we wait.
            emitter.flush()
            message = await receive.receive()
            self.handle(machine, message)
            self.drain(machine)
            emitter.flush()
        return machine.stream_result

    def drain(self, machine: TurnMachine) -> None:
        """Handle every message already waiting, without blocking."""
        receive = self._inbox
        while True:
            try:
                message = receive.receive_nowait()
            except trio.WouldBlock:
                return
            self.handle(machine, message)

    def handle(self, machine: TurnMachine, message: SupervisorMessage) -> None:
        """One inbox message."""
        match message:
            case StreamBatch():
                if message.attempt == machine.attempt:
                    # The hot path: one batch per network read.
                    self.apply(machine.feed(message.events))
            case ToolCallFinished():
                # Tool output is outside text (R-SEC-1): repaired before anyone encodes it.
                self.apply(
                    machine.finish(
                        message.call_id,
                        status=message.status,
                        content=repaired_blocks(message.content),
                    )
                )
            case ApprovalDecided():
                if message.verdict == "allow_session":
                    self._session.allow_for_session(message.call.name)
                self.apply(
                    machine.decide(
                        message.call.id,
                        allowed=message.verdict != "deny",
                        by=message.by,
                        # The interrupt came first (the decision was still in the inbox):
                        # the call never starts, and the abort reports it interrupted.
                        interrupted=self._interrupted(),
                    )
                )
            case ApprovalAsked():
                asked = message.call
                self._emitter.emit(
                    ApprovalRequest(
                        session_id=self._session.id,
                        run_id=self.run_id,
                        call_id=asked.id,
                        tool=asked.name,
                        arguments=asked.arguments,
                    )
                )
            case ToolProgressed():
                # Live only: progress notes never reach the trace (R-TRACE-1, R-TOOL-6).
                self.apply(machine.progress(message.call_id, repair_text(message.message)))
            case SteeringQueued():
                self._on_steering(repaired_blocks(message.content))
            case BackoffSkipped():
                self._on_skip()
            case SubagentOutputs():
                # Live outputs of this run, already in the subagent's trace (R-HOST-4).
                self._emitter.forward(message.outputs, message.origin)
            case _:
                assert_never(message)

    def apply(self, effects: list[Effect]) -> None:
        """Carry out what the turn machine returned, in order: outputs are emitted (traced
        ones traced), commands go to the broker, the pool and the ledger."""
        emitter = self._emitter
        emit_live = emitter.emit_live
        for effect in effects:
            # The hot path: most effects are live partial outputs, one per token.
            if effect.__class__ in _PARTIALS:
                emit_live(effect)  # type: ignore[arg-type]
                continue
            match effect:
                case ApproveCall():
                    assert self.approvals is not None
                    self.approvals.send_nowait(effect)  # R-TOOL-1: at once
                case RunToolCall() | SkipToolCall():
                    assert self.pool is not None
                    self.pool.send_nowait(effect)
                case RecordUsage():
                    self._on_usage(effect.usage)
                    self._session.record_usage(self.run_id, self.turn, effect.usage)
                case _ if effect.TRACED:
                    emitter.emit(effect)
                case _:
                    emitter.emit_live(effect)


__all__ = ["TurnDispatch"]
