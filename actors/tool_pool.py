"""The tool pool: executes approved calls with at most five at the same moment.

Parallel-safe calls share the five slots. A call to a tool that is not parallel-safe waits
until every earlier call of the turn is terminal, and every later call waits for it
(R-TOOL-2, R-TOOL-3). Failures never escape: an unknown tool, bad arguments, an exception or
a timeout becomes an error result (R-TOOL-4, R-TOOL-5). Results larger than the budget are
cut to head and tail with a marker naming the scratchpad file holding all of it (R-TOOL-8).
Progress notes go to the supervisor, which drops those of finished calls (R-TOOL-6).
A tool that takes ``ctx`` gets the supervisor's ``spawn`` callback there (subagents,
R-HOST-4); the subagent then runs in the call's task, under this pool's cancellation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import trio

from greenroom.protocols.content import TextBlock, ToolCallBlock, ToolContent
from greenroom.protocols.messages import (
    RunToolCall,
    SupervisorMessage,
    ToolCallFinished,
    ToolProgressed,
)
from greenroom.protocols.outputs import ToolStatus
from greenroom.protocols.text import repair_text
from greenroom.protocols.tools import Tool, ToolContext, normalize_result

SLOTS = 5


class ToolPool:
    """Runs one task's tool calls. ``begin_turn`` resets the per-turn ordering."""

    __slots__ = (
        "_exclusive",
        "_inbox",
        "_limiter",
        "_result_budget",
        "_scratchpad_dir",
        "_spawn",
        "_sync_trace",
        "_terminal",
        "_tools",
        "_workspace_dir",
    )

    def __init__(
        self,
        *,
        tools: Mapping[str, Tool],
        inbox: trio.MemorySendChannel[SupervisorMessage],
        workspace_dir: Path,
        scratchpad_dir: Path,
        sync_trace: Callable[[], Awaitable[None]],
        result_budget: int,
        slots: int = SLOTS,
        spawn: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self._tools = tools
        self._inbox = inbox
        self._workspace_dir = workspace_dir
        self._scratchpad_dir = scratchpad_dir
        self._sync_trace = sync_trace
        self._result_budget = result_budget
        self._spawn = spawn
        self._limiter = trio.CapacityLimiter(slots)
        self._terminal: list[trio.Event] = []
        self._exclusive: list[bool] = []

    def begin_turn(self) -> None:
        self._terminal = []
        self._exclusive = []

    def _slot(self, position: int) -> trio.Event:
        while len(self._terminal) <= position:
            self._terminal.append(trio.Event())
            self._exclusive.append(False)
        return self._terminal[position]

    def mark_terminal(self, position: int) -> None:
        """A call that will never run here (denied, truncated) is terminal at once."""
        self._slot(position).set()

    def admit(self, command: RunToolCall) -> None:
        """Register an approved call's place before it starts, so that later calls know
        whether they must wait for it. Call synchronously, in call order."""
        tool = self._tools.get(command.call.name)
        self._slot(command.position)
        self._exclusive[command.position] = tool is not None and not tool.parallel

    async def execute(self, command: RunToolCall) -> None:
        """Run one call admitted with :meth:`admit` and report it to the supervisor.
        Cancel-safe: on cancellation nothing is reported (the supervisor settles
        unfinished calls)."""
        call, position = command.call, command.position
        done = self._slot(position)
        exclusive = self._exclusive[position]
        try:
            for earlier in range(position):
                if exclusive or self._exclusive[earlier]:
                    await self._terminal[earlier].wait()
            async with self._limiter:
                try:
                    status, content = await self._run(call)
                except Exception as exc:
                    # Whatever fails around the tool itself (the trace sync before a side
                    # effect, the scratchpad write of a long result) is still an error
                    # result the model sees, never a failed task (R-TOOL-4, R-TOOL-7).
                    status, content = "error", _text(f"{call.name} failed: {exc!r}")
        finally:
            done.set()
        self._inbox.send_nowait(
            ToolCallFinished(
                call_id=call.id, status=status, is_error=status != "ok", content=content
            )
        )

    async def _run(self, call: ToolCallBlock) -> tuple[ToolStatus, tuple[ToolContent, ...]]:
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            return "error", _text(f"Unknown tool {call.name!r}. Available tools: {known}.")
        if call.invalid_arguments is not None:
            return "error", _text(
                f"Invalid arguments for {call.name}: not a JSON object: "
                f"{call.invalid_arguments[:500]}"
            )
        problems = tool.validate(call.arguments)
        if problems:
            return "error", _text(f"Invalid arguments for {call.name}: " + "; ".join(problems))
        if tool.side_effects:
            await self._sync_trace()
        inbox = self._inbox

        def report(message: str) -> None:
            inbox.send_nowait(ToolProgressed(call_id=call.id, message=message))

        kwargs = dict(call.arguments)
        if tool.takes_ctx:
            kwargs["ctx"] = ToolContext(
                call_id=call.id,
                workspace_dir=self._workspace_dir,
                scratchpad_dir=self._scratchpad_dir,
                report_progress=report,
                spawn=self._spawn,
            )
        try:
            if tool.timeout_s is not None:
                with trio.fail_after(tool.timeout_s):
                    value = await tool.function(**kwargs)
            else:
                value = await tool.function(**kwargs)
        except trio.TooSlowError:
            return "error", _text(f"{call.name} timed out after {tool.timeout_s} s")
        except trio.Cancelled:
            raise
        except Exception as exc:
            return "error", _text(f"{type(exc).__name__}: {exc}")
        # Outside text (R-SEC-1): repaired before it is measured, stored or traced.
        content = tuple(
            TextBlock(text=repair_text(b.text)) if isinstance(b, TextBlock) else b
            for b in normalize_result(value)
        )
        return "ok", await self._fit_budget(call, content)

    async def _fit_budget(
        self, call: ToolCallBlock, content: tuple[ToolContent, ...]
    ) -> tuple[ToolContent, ...]:
        text = "".join(b.text for b in content if isinstance(b, TextBlock))
        size = len(text.encode())
        if size <= self._result_budget:
            return content
        path = self._scratchpad_dir / f"tool-output-{_safe(call.id)}.txt"
        await trio.to_thread.run_sync(_write_text, path, text)
        half = self._result_budget // 2
        head = text.encode()[:half].decode(errors="ignore")
        tail = text.encode()[-half:].decode(errors="ignore")
        marker = (
            f"\n[... output cut: {size} bytes in all, over the {self._result_budget}-byte "
            f"budget; the whole output is in {path} ...]\n"
        )
        images = tuple(b for b in content if not isinstance(b, TextBlock))
        return (TextBlock(text=head + marker + tail), *images)


def _text(message: str) -> tuple[ToolContent, ...]:
    return (TextBlock(text=message),)


def _safe(call_id: str) -> str:
    """A file-name-safe form of a call id, bounded in length (ids come from the model)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in call_id) or "call"
    if len(safe) > 80:
        safe = safe[:60] + "-" + hashlib.sha256(call_id.encode()).hexdigest()[:16]
    return safe


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")

