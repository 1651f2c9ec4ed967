"""The tool pool: executes approved calls with at most five at the same moment.

Parallel-safe calls share the five slots. A call to a tool that is not parallel-safe waits
until every earlier call of the turn is terminal, and every later call waits for it
(R-TOOL-2, R-TOOL-3). Failures never escape: an unknown tool, bad arguments, an exception or
a timeout becomes an error result (R-TOOL-4, R-TOOL-5). Every result the pool reports, an
error's text as much as a tool's output, passes through :meth:`ToolPool._fit`: text larger
than the budget is cut to head and tail with a marker naming the scratchpad file holding all
of it (R-TOOL-8), and a result whose record is still larger than one record of the session's
trace carries (``largest_record``: a cluster's NATS server, R-CLUSTER-1) is made to fit it:
its images past what fits beside its text are left out, the last first, with a line saying
how many (:func:`~greenroom.protocols.trace.fit_images`), and its text is cut
(:func:`~greenroom.protocols.trace.cut_to_fit`), the marker naming that file too: such a
record stopped the session on its host (R-SEC-9).
Progress notes go to the supervisor, which drops those of finished calls (R-TOOL-6).
A tool that takes ``ctx`` gets the supervisor's ``spawn`` callback there (subagents,
R-HOST-4); the subagent then runs in the call's task, under this pool's cancellation.
Every call's context is also :func:`current_tool_context` while its tool runs: a tool whose
arguments are all the model's (an MCP server's, where ``ctx`` may be one of them: R-MCP-3)
reaches it there, and its arguments reach it as the model gave them.
Where people answer the task's requests, ``ctx.ask`` puts a question to them through the
supervisor (``QuestionAsked``: an MCP server's elicitation, R-HITL-5); the call keeps its
slot while it waits, and :func:`question_waits` says so meanwhile. Every call's context
carries its idempotency key (R-EFFECT-1), the one its ``RunToolCall`` names.

In doubt (R-EFFECT-2): ``CheckToolCall`` asks a tool's ``check`` whether a call its host
lost took effect, in a task of its own and outside the slots (a check only looks), bounded
by :data:`~greenroom.protocols.effects.CHECK_TIMEOUT_S` and abandoned like a tool; its
answer — or its failure, whose words are recorded and so cut as a hook's reason is
(:func:`~.tool_hooks.cut_reason`) — goes to the supervisor as ``ToolCallChecked``.
A session's ``after_tool`` hook (R-HOOK-2) sees each result before it is reported, while
the call still holds its slot; a replaced result is cut to the budget like a tool's.

Abandoning (R-SEC-2, R-ABORT-1): each tool function runs in a task of its own outside the
session's task tree (a trio system task), and the call's task waits for it. When the call
is cancelled (interrupt) or times out, the pool cancels the tool, waits at most
:data:`CANCEL_GRACE_S` for it to end (:data:`SUBAGENT_CANCEL_GRACE_S` while it runs a
subagent, whose own teardown is bounded), and then stops waiting: a tool that ignores
cancellation — shielded, or blocked in a thread that cannot be abandoned — keeps running
on its own, unobserved, and its call is settled as interrupted (or timed out), so an
interrupt never waits for it. What such a tool does later is not reported anywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Literal, assert_never

import attrs
import trio

from greenroom.actors.runtime.attachments import Attachments, attach
from greenroom.actors.runtime.tool_hooks import ToolHookCalls, cut_reason
from greenroom.protocols.content import TextBlock, ToolCallBlock, ToolContent
from greenroom.protocols.context import ToolResult
from greenroom.protocols.effects import CHECK_TIMEOUT_S, check_answer_problem
from greenroom.protocols.hooks import ToolHookAction
from greenroom.protocols.messages import (
    BeginTurn,
    CheckToolCall,
    PoolCommand,
    QuestionAnswered,
    QuestionAsked,
    RunToolCall,
    SkipToolCall,
    SupervisorMessage,
    ToolCallChecked,
    ToolCallFinished,
    ToolProgressed,
)
from greenroom.protocols.outputs import ToolStatus
from greenroom.protocols.text import repair_text
from greenroom.protocols.tools import (
    Editor,
    InDoubtCheck,
    Spawn,
    Tool,
    ToolContext,
    ToolFailure,
    WorkspaceIdentity,
    invalid_arguments_reason,
    normalize_result,
)
from greenroom.protocols.trace import cut_to_fit, fit_images, input_size

SLOTS = 5

CANCEL_GRACE_S = 0.05
"""How long a cancelled (or timed-out) tool may take to end before the pool abandons it.
Tools that honour cancellation end in well under a millisecond; this keeps an interrupt
under the 100 ms of R-ABORT-1 whatever a tool does."""

SUBAGENT_CANCEL_GRACE_S = 3.0
"""The same bound for a call that is running a subagent: the child records its own
``abort`` and ``task_end`` before the parent settles (R-HOST-4), and its teardown is itself
bounded (its tools are abandoned after :data:`CANCEL_GRACE_S`, its trace writes by the
supervisor's own grace)."""


_CONTEXT: contextvars.ContextVar[ToolContext | None] = contextvars.ContextVar(
    "greenroom_tool_context", default=None
)


def current_tool_context() -> ToolContext | None:
    """The context of the tool call whose tool runs here (in the tool function's task and
    the tasks it starts), whether or not the tool takes ``ctx``; None outside a call a pool
    runs (a tool function called by hand, a check of a call in doubt)."""
    return _CONTEXT.get()


# A question is answerable only while the call that asked waits for its answer (R-HITL-5):
# the asks waiting now, by call id, of the task whose supervisor's inbox is the key. Weak:
# an inbox goes with its supervisor, and nothing here keeps it.
_WAITING: weakref.WeakKeyDictionary[trio.MemorySendChannel[SupervisorMessage], Counter[str]] = (
    weakref.WeakKeyDictionary()
)


def question_waits(inbox: trio.MemorySendChannel[SupervisorMessage] | None, call_id: str) -> bool:
    """Whether call ``call_id`` of the task whose supervisor's inbox is ``inbox`` (a port's
    ``inbox``) waits now, in this process, for the answer to a question it asked
    (``ctx.ask``: a Python tool's, an MCP server's elicitation, R-HITL-5). False once the
    call stopped waiting, and for a question the trace holds from a host that stopped: the
    call that asked went with it, and nobody can answer it."""
    waiting = None if inbox is None else _WAITING.get(inbox)
    return waiting is not None and waiting[call_id] > 0


class ToolPool:
    """Runs one task's tool calls. ``begin_turn`` resets the per-turn ordering."""

    __slots__ = (
        "_attachments",
        "_editor",
        "_exclusive",
        "_hooks",
        "_inbox",
        "_largest_record",
        "_limiter",
        "_people",
        "_private_dirs",
        "_result_budget",
        "_sandbox",
        "_scratchpad_dir",
        "_shell_network",
        "_spawn",
        "_sync_trace",
        "_terminal",
        "_tools",
        "_workspace_dir",
        "_workspace_identity",
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
        spawn: Spawn | None = None,
        sandbox: Literal["auto", "required", "off"] = "auto",
        shell_network: bool = False,
        private_dirs: tuple[Path, ...] = (),
        attachments: Attachments | None = None,
        workspace_identity: WorkspaceIdentity | None = None,
        people: bool = False,
        hooks: ToolHookCalls | None = None,
        editor: Editor | None = None,
        largest_record: int | None = None,
    ) -> None:
        self._tools = tools
        self._largest_record = largest_record
        self._editor = editor
        self._hooks = hooks
        self._people = people
        self._attachments = attachments
        self._inbox = inbox
        self._workspace_dir = workspace_dir
        self._scratchpad_dir = scratchpad_dir
        self._sync_trace = sync_trace
        self._result_budget = result_budget
        self._spawn = spawn
        self._sandbox: Literal["auto", "required", "off"] = sandbox
        self._shell_network = shell_network
        self._private_dirs = private_dirs
        self._workspace_identity = workspace_identity
        self._limiter = trio.CapacityLimiter(slots)
        self._terminal: list[trio.Event] = []
        self._exclusive: list[bool] = []

    async def run(
        self,
        commands: trio.MemoryReceiveChannel[PoolCommand],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the task's pool commands until the channel closes or the task is
        cancelled: each admitted call runs in a task of its own, under the 5 slots
        (R-TOOL-2) and the exclusive ordering (R-TOOL-3). Cancel-safe: on cancellation
        nothing more is reported (the supervisor settles unfinished calls)."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            with commands:
                async for command in commands:
                    match command:
                        case BeginTurn():
                            self._terminal = []
                            self._exclusive = []
                        case SkipToolCall():
                            self._slot(command.position).set()
                        case RunToolCall():
                            self._admit(command)
                            nursery.start_soon(self._execute, command)
                        case CheckToolCall():
                            nursery.start_soon(self._check, command)
                        case _:
                            assert_never(command)
            nursery.cancel_scope.cancel()  # closed: a call still running ends

    def _slot(self, position: int) -> trio.Event:
        while len(self._terminal) <= position:
            self._terminal.append(trio.Event())
            self._exclusive.append(False)
        return self._terminal[position]

    def _admit(self, command: RunToolCall) -> None:
        # The call's place is known before it starts, so that later calls know whether
        # they must wait for it; commands arrive in call order.
        tool = self._tools.get(command.call.name)
        self._slot(command.position)
        self._exclusive[command.position] = tool is not None and not tool.parallel

    async def _execute(self, command: RunToolCall) -> None:
        """Run one admitted call and report it to the supervisor's inbox."""
        call, position = command.call, command.position
        done = self._slot(position)
        exclusive = self._exclusive[position]
        try:
            for earlier in range(position):
                if exclusive or self._exclusive[earlier]:
                    await self._terminal[earlier].wait()
            async with self._limiter:
                hooked: ToolHookAction | None = None
                try:
                    status, content = await self._run(call, command.idempotency_key)
                    content = await self._fit(call, content)
                    if self._hooks is not None:
                        content, hooked = await self._hooks.after(call, status, content)
                        if hooked is not None and hooked.action == "replace":
                            content = await self._fit(call, content)
                except Exception as exc:
                    # Whatever fails around the tool itself (the trace sync before a side
                    # effect, the scratchpad write of a long result) is still an error
                    # result the model sees, never a failed task (R-TOOL-4, R-TOOL-7).
                    status, content = "error", _text(f"{call.name} failed: {exc!r}")
        finally:
            done.set()
        self._inbox.send_nowait(
            ToolCallFinished(
                call_id=call.id,
                status=status,
                is_error=status != "ok",
                content=content,
                hook=hooked,
            )
        )

    async def _run(
        self, call: ToolCallBlock, idempotency_key: str
    ) -> tuple[ToolStatus, tuple[ToolContent, ...]]:
        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            return "error", _text(f"Unknown tool {call.name!r}. Available tools: {known}.")
        if call.invalid_arguments is not None:
            raw = call.invalid_arguments
            return "error", _text(
                f"Invalid arguments for {call.name}: {invalid_arguments_reason(raw)}: {raw[:500]}"
            )
        problems = tool.validate(call.arguments)
        if problems:
            return "error", _text(f"Invalid arguments for {call.name}: " + "; ".join(problems))
        if tool.side_effects:
            await self._sync_trace()
        inbox = self._inbox
        running = _Detached()

        def report(message: str) -> None:
            # An abandoned tool may report after the task ended and the inbox closed.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                inbox.send_nowait(ToolProgressed(call_id=call.id, message=message))

        spawn = self._spawn
        ctx = ToolContext(
            call_id=call.id,
            workspace_dir=self._workspace_dir,
            scratchpad_dir=self._scratchpad_dir,
            report_progress=report,
            spawn=None if spawn is None else running.track_spawn(spawn),
            sandbox=self._sandbox,
            shell_network=self._shell_network,
            private_dirs=self._private_dirs,
            workspace_identity=self._workspace_identity,
            ask=_asker(inbox, call.id) if self._people else None,
            editor=self._editor,
            idempotency_key=idempotency_key or call.id,
        )
        kwargs = dict(call.arguments)
        if tool.takes_ctx:
            kwargs["ctx"] = ctx
        running.start(tool.function, kwargs, name=f"tool {call.name} ({call.id})", ctx=ctx)
        finished = await running.wait(tool.timeout_s)
        if not finished:
            return "error", _text(f"{call.name} timed out after {tool.timeout_s} s")
        if running.error is not None:
            exc = running.error
            if isinstance(exc, ToolFailure):
                return "error", _text(str(exc) or f"{call.name} failed")
            return "error", _text(f"{type(exc).__name__}: {exc}")
        return "ok", await self._content(call, running.value)

    async def _content(self, call: ToolCallBlock, value: Any) -> tuple[ToolContent, ...]:
        """What a tool (or its check) returned, as the content the model sees."""
        # Outside text (R-SEC-1): repaired before it is measured, stored or traced.
        content = tuple(
            TextBlock(text=repair_text(b.text)) if isinstance(b, TextBlock) else b
            for b in normalize_result(value)
        )
        if self._attachments is not None:
            # R-SEC-8: a returned image is read now, once; one that cannot be is a line
            # saying why, which the model sees with the rest of the result.
            content = await attach(content, self._attachments, fold=True)
        return content

    async def _check(self, command: CheckToolCall) -> None:
        """Ask the tool's check about in-doubt ``command.call`` and report the answer."""
        call = command.call
        tool = self._tools.get(call.name)
        if tool is None or tool.check is None:
            answer = ToolCallChecked(
                call_id=call.id, outcome="failed", error=f"{call.name} has no check"
            )
        else:
            try:
                answer = await self._ask_check(call, tool, tool.check, command.idempotency_key)
            except Exception as exc:  # around the check (its result's scratchpad file)
                answer = ToolCallChecked(call_id=call.id, outcome="failed", error=repr(exc))
        if answer.error is not None:
            # Recorded (call_resolved, a person's question): bounded as a hook's reason is.
            answer = attrs.evolve(answer, error=cut_reason(answer.error))
        self._inbox.send_nowait(answer)

    async def _ask_check(
        self, call: ToolCallBlock, tool: Tool, check: InDoubtCheck, key: str
    ) -> ToolCallChecked:
        timeout_s = min(CHECK_TIMEOUT_S, tool.timeout_s or math.inf)
        running = _Detached()

        async def ask() -> Any:
            return await check(key)

        running.start(ask, {}, name=f"check of {call.name} ({call.id})")
        if not await running.wait(timeout_s):
            error = f"the check gave no answer within {timeout_s:g} s"
            return ToolCallChecked(call_id=call.id, outcome="failed", error=error)
        if running.error is not None:
            exc = running.error
            error = f"the check raised {type(exc).__name__}: {exc}"
            return ToolCallChecked(call_id=call.id, outcome="failed", error=error)
        value = running.value
        if (problem := check_answer_problem(value)) is not None:
            return ToolCallChecked(call_id=call.id, outcome="failed", error=problem)
        if value is None:
            return ToolCallChecked(call_id=call.id, outcome="not_done")
        if isinstance(value, ToolResult):
            status: ToolStatus = "error" if value.is_error else "ok"
            value = value.content
        else:
            status = "ok"
        content = await self._fit(call, await self._content(call, value))
        hooked: ToolHookAction | None = None
        if self._hooks is not None:
            # What the check found is the call's result: the model gets it as the hook
            # leaves it, as any result (R-HOOK-2).
            content, hooked = await self._hooks.after(call, status, content)
            if hooked is not None and hooked.action == "replace":
                content = await self._fit(call, content)
        return ToolCallChecked(
            call_id=call.id, outcome="done", status=status, content=content, hook=hooked
        )

    async def _fit(
        self, call: ToolCallBlock, content: tuple[ToolContent, ...]
    ) -> tuple[ToolContent, ...]:
        """``content``, a result of ``call``, as the model gets it and its record holds it:
        its text over the budget cut to head and tail (R-TOOL-8), and, when its record is
        larger than one record of the trace carries, its images past what fits left out
        with a line saying so (:func:`~greenroom.protocols.trace.fit_images`) and its text
        cut further; a cut text's whole then in a scratchpad file the marker names."""
        text = "".join(b.text for b in content if isinstance(b, TextBlock))
        size = len(text.encode())
        most = self._largest_record
        if size <= self._result_budget and (most is None or input_size(content) <= most):
            return content
        path = self._scratchpad_dir / f"tool-output-{_safe(call.id)}.txt"
        whole = text
        if size > self._result_budget:
            await trio.to_thread.run_sync(_write_text, path, whole)
            half = self._result_budget // 2
            head = text.encode()[:half].decode(errors="ignore")
            tail = text.encode()[-half:].decode(errors="ignore")
            marker = (
                f"\n[... output cut: {size} bytes in all, over the {self._result_budget}-byte "
                f"budget; the whole output is in {path} ...]\n"
            )
            text = head + marker + tail
            content = (TextBlock(text=text), *_images(content))
        if most is None:
            return content
        # Escapes can make the record of a text within the budget several times its bytes,
        # a budget may be set past what the trace carries, and images take room too.
        fit = fit_images(content, most)
        left_out = () if fit.left_out is None else (fit.left_out,)
        if fit.text_room is None:
            return (*fit.content, *left_out)
        if size <= self._result_budget:
            await trio.to_thread.run_sync(_write_text, path, whole)
        # The marker names the record's bytes, as every cut's does, not what images left.
        text = cut_to_fit(text, fit.text_room, str(path), record=most)
        return (TextBlock(text=text), *_images(fit.content), *left_out)


def _text(message: str) -> tuple[ToolContent, ...]:
    return (TextBlock(text=message),)


def _images(content: tuple[ToolContent, ...]) -> tuple[ToolContent, ...]:
    return tuple(b for b in content if not isinstance(b, TextBlock))


def _safe(call_id: str) -> str:
    """A file-name-safe form of a call id, bounded in length (ids come from the model)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in call_id) or "call"
    if len(safe) > 80:
        safe = safe[:60] + "-" + hashlib.sha256(call_id.encode()).hexdigest()[:16]
    return safe


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


class _Detached:
    """One tool function running in a system task, so that its call can stop waiting for
    it (see the module docstring). Never raises into the system nursery: every outcome of
    the function, exceptions included, is kept here for the waiting call."""

    __slots__ = ("_done", "_scope", "_spawning", "error", "value")

    def __init__(self) -> None:
        self._done = trio.Event()
        self._scope = trio.CancelScope()
        self._spawning = 0
        self.value: Any = None
        self.error: BaseException | None = None

    def track_spawn(self, spawn: Spawn) -> Spawn:
        """``spawn`` that marks this call as running a subagent while it runs."""

        async def tracked(task: str, *, background: bool = False, name: str | None = None) -> str:
            self._spawning += 1
            try:
                return await spawn(task, background=background, name=name)
            finally:
                self._spawning -= 1

        return tracked

    def start(
        self,
        function: Callable[..., Awaitable[Any]],
        kwargs: dict[str, Any],
        *,
        name: str,
        ctx: ToolContext | None = None,
    ) -> None:
        """Start ``function(**kwargs)``; ``ctx`` is :func:`current_tool_context` in it."""
        # A copy of the caller's context: system tasks would otherwise start without it.
        # The call's own, set always: a tool run inside another's call (a subagent's) never
        # sees the outer call's.
        context = contextvars.copy_context()
        context.run(_CONTEXT.set, ctx)
        trio.lowlevel.spawn_system_task(self._body, function, kwargs, name=name, context=context)

    async def _body(self, function: Callable[..., Awaitable[Any]], kwargs: dict[str, Any]) -> None:
        try:
            with self._scope:
                self.value = await function(**kwargs)
        except trio.Cancelled:
            raise  # not ours: the run is shutting down
        except BaseException as exc:  # SystemExit too: a tool must never end the host
            self.error = exc
        finally:
            self._done.set()

    async def wait(self, timeout_s: float | None) -> bool:
        """Wait for the function to end; False when it ran past ``timeout_s`` (it is then
        cancelled and abandoned after the grace). When the wait itself is cancelled the
        function is cancelled too, waited for at most the grace (shielded), and Cancelled
        propagates: the call is interrupted whether or not the function ended in time."""
        try:
            with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
                await self._done.wait()
                return True
        except trio.Cancelled:
            self._scope.cancel()
            with trio.CancelScope(shield=True) as grace:
                grace.deadline = trio.current_time() + self._grace()
                await self._done.wait()
            raise
        self._scope.cancel()
        with trio.move_on_after(self._grace()):
            await self._done.wait()
        return False

    def _grace(self) -> float:
        return SUBAGENT_CANCEL_GRACE_S if self._spawning else CANCEL_GRACE_S


_UNANSWERED = QuestionAnswered(action="cancel")


def _asker(
    inbox: trio.MemorySendChannel[SupervisorMessage], call_id: str
) -> Callable[[dict[str, Any]], Awaitable[QuestionAnswered]]:
    """``ctx.ask`` of call ``call_id``: the question goes to the supervisor, which records
    it and replies once (see ``QuestionAsked``). A task that has ended (its inbox closed)
    or a supervisor that drops the reply answers ``cancel``."""

    async def ask(arguments: dict[str, Any]) -> QuestionAnswered:
        # One slot: the supervisor's one reply never waits for this reader.
        reply_send, reply = trio.open_memory_channel[QuestionAnswered](1)
        try:
            inbox.send_nowait(QuestionAsked(call_id=call_id, arguments=arguments, reply=reply_send))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return _UNANSWERED
        waiting = _WAITING.setdefault(inbox, Counter())
        waiting[call_id] += 1  # before the supervisor records the question: no checkpoint
        try:
            return await reply.receive()
        except trio.EndOfChannel:
            return _UNANSWERED
        finally:
            reply.close()
            waiting[call_id] -= 1
            if not waiting[call_id]:
                del waiting[call_id]

    return ask
