"""Replay a recorded session on another model (R-FORK-3): the runtime's part of
``greenroom replay``.

:func:`replay_session` forks the session just before its first prompt (so the replay has
its own trace and the recorded one is only read), has the fork run every tool it has — its
own and its MCP servers', those a server lists later too — wrapped by :func:`replaying`,
and runs the recorded tasks in order: each prompt as a task of its own (follow-ups were),
held to the output schema it was recorded with (R-OUT-1), each steering input queued while
the turn before the one that took it runs (so the same turn takes it, R-STEER-2). Every
call is approved: the wrapper decides what runs —

* a call equal to a recorded one (:func:`~greenroom.protocols.replay.call_key`) gets the
  recorded result and does not run (``same``);
* another call of a tool without side effects (``side_effects=False``) runs
  (``different``);
* another call of a tool that may have side effects (``side_effects=True``, whether or not
  it is parallel-safe) is refused with a note the model reads (``denied``) — unless
  ``run_tools``: then it runs (``different``).

Every argument reaches the record and the tool as the model gave it, whatever its name
(an MCP tool's argument named ``ctx`` too). It returns the
:class:`~greenroom.protocols.replay.ReplayReport`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import attrs

from greenroom.actors.apps.exits import UsageError
from greenroom.actors.runtime import (
    Host,
    ModelProvider,
    Session,
    SessionNotFound,
    current_tool_context,
)
from greenroom.protocols.content import TextBlock, ToolCallBlock, UserContent
from greenroom.protocols.outputs import ModelMsg, RequestBegin, TaskStart
from greenroom.protocols.replay import (
    CallLine,
    Outcome,
    Outcomes,
    RecordedResults,
    RecordedTask,
    ReplayedTask,
    ReplayReport,
    Side,
    recorded_tasks,
)
from greenroom.protocols.structured import recorded_spec
from greenroom.protocols.tools import Tool, ToolContext, ToolFailure

__all__ = ["replay_session", "replaying"]


def denied_note(name: str) -> str:
    """What the model reads for a call a replay did not run."""
    return (
        f"[replay: {name} was not run: the tool may have side effects and the recorded "
        "session made no call of it with these arguments; `greenroom replay --run-tools` "
        "runs such calls]"
    )


def replaying(
    tool: Tool, recorded: RecordedResults, outcomes: Outcomes, *, run_tools: bool
) -> Tool:
    """``tool`` as a replay offers it (see the module docstring); the outcome of each call
    is noted in ``outcomes``. Every argument reaches the record and the tool as the model
    gave it: only a tool that takes the pool's context (``takes_ctx``) is given it as
    ``ctx``; any other's ``ctx`` (an MCP server's may have one) is the model's."""
    original = tool.function
    name = tool.name

    async def decide(ctx: ToolContext | None, arguments: dict[str, Any]) -> Any:
        call_id = None if ctx is None else ctx.call_id
        result = recorded.take(name, arguments)
        outcome: Outcome = (
            "same"
            if result is not None
            else ("denied" if tool.side_effects and not run_tools else "different")
        )
        outcomes.note(outcome, call_id=call_id, name=name, arguments=arguments)
        if result is not None:
            if result.is_error:
                texts = (b.text for b in result.content if isinstance(b, TextBlock))
                raise ToolFailure(" ".join(texts) or f"{name} failed")
            return result.content
        if outcome == "denied":
            raise ToolFailure(denied_note(name))
        if tool.takes_ctx:
            return await original(ctx=ctx, **arguments)
        return await original(**arguments)

    if tool.takes_ctx:

        async def replay_call(ctx: ToolContext, **arguments: Any) -> Any:
            return await decide(ctx, arguments)

        return attrs.evolve(tool, function=replay_call)

    async def replay_arguments(**arguments: Any) -> Any:
        # Every argument is the model's (an MCP tool's ``ctx`` too, declared by its schema
        # or not): the call's context comes apart, never in an argument's place.
        return await decide(current_tool_context(), arguments)

    return attrs.evolve(tool, function=replay_arguments)


async def replay_session(
    host: Host,
    source_id: str,
    *,
    tools: Iterable[Tool],
    provider: str | ModelProvider | None,
    run_tools: bool = False,
    **overrides: Any,
) -> ReplayReport:
    """Replay the recorded tasks of ``source_id`` in a fork of it on ``provider`` (a
    name, or a provider object) with ``tools``; ``overrides`` are the fork's other options
    (``mcp_servers``, whose tools the replay decides as it decides ``tools``) and settings
    (``model``, ``base_url``…). Raises :class:`SessionNotFound` for an unknown session and
    :class:`UsageError` for one that has no recorded prompt."""
    if not await host.trace_store.catalog.exists(source_id):
        raise SessionNotFound(f"no session {source_id!r} in {host.data_dir}")
    source_meta = await host.trace_store.catalog.read_meta(source_id)
    try:
        tasks = recorded_tasks(await host.trace_store.log.read_after(source_id))
    except OSError as exc:  # a trace file that cannot be read (R-SEC-1): never a part
        raise UsageError(f"session {source_id} cannot be replayed: its trace {_why(exc)}") from None
    if not tasks:
        raise UsageError(f"session {source_id} has no recorded prompt to replay")
    recorded = RecordedResults(call for task in tasks for call in task.calls)
    outcomes = Outcomes()
    fork = await host.fork_session(
        source_id,
        tasks[0].prompt_seq - 1,
        tools=list(tools),
        wrap_tools=functools.partial(
            replaying, recorded=recorded, outcomes=outcomes, run_tools=run_tools
        ),
        provider=provider,
        **overrides,
    )
    replayed = [await _replay_task(fork, task, outcomes) for task in tasks]
    settings = source_meta.get("settings", {})
    return ReplayReport(
        source_id=source_id,
        replay_id=fork.id,
        original_model=f"{settings.get('provider', '?')}/{settings.get('model', '?')}",
        replay_model=f"{fork.settings.provider}/{fork.settings.model}",
        tasks=tuple(replayed),
    )


def _why(exc: OSError) -> str:
    """A trace file's OSError as the replay says it: ``PATH is a directory, not a file``,
    ``PATH is a FIFO (a named pipe), not a regular file``, ``PATH: Permission denied``."""
    if isinstance(exc, IsADirectoryError):
        return f"{exc.filename} is a directory, not a file"
    why = exc.strerror or str(exc)
    if why.startswith("it "):  # Disk.read's words for what is no regular file
        return f"{exc.filename} {why.removeprefix('it ')}"
    return f"{exc.filename}: {why}"


async def _replay_task(session: Session, task: RecordedTask, outcomes: Outcomes) -> ReplayedTask:
    steering = list(task.steering)
    calls: list[ToolCallBlock] = []
    schema = None if task.output_schema is None else recorded_spec(task.output_schema)
    stream = session.run(task.prompt, approve=_allow, output_schema=schema)
    async with stream:
        async for output in stream:
            if output.origin is not None:
                continue
            # The recorded steering for turn t is queued while turn t - 1 runs: the
            # request that begins now has taken its input already (R-STEER-2).
            if isinstance(output, TaskStart | RequestBegin):
                running = output.turn if isinstance(output, RequestBegin) else 0
                due = [content for turn, content in steering if turn <= running + 1]
                steering = [(turn, c) for turn, c in steering if turn > running + 1]
                for content in due:
                    session.steer(content)
            elif isinstance(output, ModelMsg) and isinstance(output.block, ToolCallBlock):
                calls.append(output.block)
    end = stream.task_end
    original = Side(
        answer=task.answer,
        calls=tuple(CallLine(name=c.name, arguments=c.arguments) for c in task.calls),
        tokens=task.usage.total,
        cost_usd=task.usage.cost_usd,
        wall_ms=task.wall_ms,
        status=task.status,
    )
    replay = Side(
        answer=stream.final_text,
        calls=tuple(
            CallLine(name=c.name, arguments=c.arguments, outcome=outcomes.take(c)) for c in calls
        ),
        tokens=0 if end is None else end.usage.total,
        cost_usd=None if end is None else end.usage.cost_usd,
        wall_ms=0 if end is None else end.wall_ms,
        status=None if end is None else end.status,
    )
    return ReplayedTask(
        prompt=_text_of(task.prompt), original=original, replay=replay, undelivered=len(steering)
    )


def _allow(call: ToolCallBlock) -> str:
    # Every call is allowed here: the replay's tool wrappers decide what runs.
    return "allow"


def _text_of(content: tuple[UserContent, ...]) -> str:
    return " ".join(b.text for b in content if isinstance(b, TextBlock))
