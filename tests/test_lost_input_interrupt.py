"""Interrupting a session whose stopped host left input it had not started a task for
(R-ABORT-1, R-STEER-6, R-TRACE-3).

A host that stops right after it records a prompt (its ``user_msg``, no ``task_start``)
or a follow-up (``task_queued``, its task not begun) leaves that input for whoever takes
the session up: the run was accepted. Interrupting the loaded session ends it instead, as
an interrupt of queued input ends it in a live session: the prompt's task starts and ends
``aborted`` at once, a follow-up is recorded dropped (``task_queue_dropped``). Nothing is
asked of the model, and a host opened later has nothing of it to take up.

The stop is simulated by cutting the trace after a record (``conftest.cut_after``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, allow_all, cut_after, open_host, trace_lines
from test_tree_takeup import TaskEnds

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.outputs import Output, TaskEnd, UserMsg


def _is_prompt(text_: str) -> Any:
    def check(record: dict[str, Any]) -> bool:
        content = record.get("content") or [{}]
        return record["type"] == "user_msg" and content[0].get("text") == text_

    return check


async def _stopped_after(data_dir: Path, workspace: Path, last: Any) -> str:
    """A session that ran ``first`` with ``second`` queued behind it as a follow-up, its
    trace cut after the record ``last`` picks: its host stopped there. Its id."""
    provider = ScriptedProvider([Reply(blocks=(text("one"),)), Reply(blocks=(text("two"),))])
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            session = await host.create_session(provider=provider, workspace_dir=workspace)
            stream = session.run("first")
            assert session.follow_up("second")
            await stream.collect()
    cut_after(session.trace_path, last)
    return session.id


async def _interrupt_loaded(data_dir: Path, session_id: str) -> list[dict[str, Any]]:
    """Load the session on a new host, interrupt it, and wait until its work has ended;
    then open another host and check it takes nothing up. The session's trace lines."""
    never = ScriptedProvider([Reply(blocks=(text("never asked"),))])
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            session = await host.load_session(session_id, provider=never)
            assert session.interrupt("enough")
            await session.wait_idle()
            await trio.testing.wait_all_tasks_blocked()
            assert not session.busy
            assert not session.interrupt("again")  # nothing is left to end
        assert never.requests == []
        async with open_host(data_dir) as host:
            assert await host.resume_tasks(approve=allow_all) == []
            lines = trace_lines(await host.load_session(session_id, provider=never))
        assert never.requests == []
    return lines


async def test_interrupting_a_prompt_whose_task_never_started_ends_it(
    data_dir: Path, workspace: Path
) -> None:
    """R-ABORT-1, R-TRACE-3: the trace ends in the prompt of ``second``. Interrupted, its
    task starts and ends aborted with the reason, nothing asked of the model; a host opened
    after does not start it. Before, the interrupt returned False and the next
    ``resume_tasks`` ran the task."""
    sid = await _stopped_after(data_dir, workspace, _is_prompt("second"))
    lines = await _interrupt_loaded(data_dir, sid)
    prompt_seq = next(line["seq"] for line in lines if _is_prompt("second")(line))
    after = [line for line in lines if line["seq"] > prompt_seq]
    assert [line["type"] for line in after] == ["task_start", "abort", "task_end"]
    start, _, end = after
    assert start["input_seq"] == prompt_seq and start["run_id"] == end["run_id"]
    assert (end["status"], end["message"], end["turns"]) == ("aborted", "enough", 0)


async def test_interrupting_a_follow_up_whose_task_never_started_drops_it(
    data_dir: Path, workspace: Path
) -> None:
    """R-ABORT-1, R-STEER-6: the trace holds ``second`` as queued (``task_queued``) and
    ends with the first task's ``task_end``. Interrupted, the follow-up is recorded dropped
    with the reason, as an interrupt drops a live queue; no task starts, and a host opened
    after does not run it. Before, the interrupt returned False and the next
    ``resume_tasks`` ran the follow-up."""
    sid = await _stopped_after(data_dir, workspace, lambda r: r["type"] == "task_end")
    lines = await _interrupt_loaded(data_dir, sid)
    (queued,) = [line for line in lines if line["type"] == "task_queued"]
    end_seq = next(line["seq"] for line in lines if line["type"] == "task_end")
    (dropped,) = [line for line in lines if line["seq"] > end_seq]
    assert dropped["type"] == "task_queue_dropped"
    assert dropped["queue_ids"] == [queued["queue_id"]]
    assert "enough" in dropped["reason"]
    assert [line["type"] for line in lines].count("task_start") == 1


def _scouting(request: ModelRequest) -> Reply:
    """The root spawns a background scout, then answers; the scout answers at once."""
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=(text("found it"),))
    last = request.messages[-1]
    if (
        isinstance(last, UserMessage)
        and not any(isinstance(b, ToolResult) for b in last.content)
        and "[subagent" not in str(last.content)
    ):
        spawn = {"task": "find it", "background": True, "name": "scout"}
        return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent", arguments=spawn),))
    return Reply(blocks=(text("noted"),))


async def _until_the_scout_is_merged(inbox: trio.MemoryReceiveChannel[list[Output]]) -> None:
    """Until the root's task that takes the scout's answer ends: the answer reaches the
    root as steering or as a follow-up, a ``user_msg`` either way."""
    reported = False
    async for batch in inbox:
        for output in batch:
            if output.origin is not None:
                continue
            if isinstance(output, UserMsg) and "[subagent scout" in str(output.content):
                reported = True
            elif reported and isinstance(output, TaskEnd):
                return


async def _scout_left_at_its_prompt(data_dir: Path, workspace: Path) -> tuple[str, Session]:
    """A root whose background scout was spawned, its trace then cut after its prompt (its
    host stopped before the scout's task started): the root's id and the scout."""
    async with open_host(data_dir) as host:
        root = await host.create_session(
            provider=ScriptedProvider(_scouting), tools=[spawn_subagent], workspace_dir=workspace
        )
        # Unbounded: the root's outputs are read only up to the scout's merge.
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        root.watch(send)
        root.run("scout", approve=allow_all).detach()
        await _until_the_scout_is_merged(inbox)
        (child,) = await root.children()
    cut_after(child.trace_path, lambda r: r["type"] == "user_msg")
    return root.id, child


async def test_interrupting_a_background_subagents_unstarted_prompt_ends_it(
    data_dir: Path, workspace: Path
) -> None:
    """R-ABORT-1, R-TREE-2: a background subagent's trace ends in its prompt (its host
    stopped before its task started). Loaded and interrupted, its task ends aborted with
    no model request, and a host opened after does not take it up. Before, the interrupt
    returned False and the next ``resume_tasks`` ran the subagent."""
    with trio.fail_after(RUN_TIMEOUT_S):
        _root_id, child = await _scout_left_at_its_prompt(data_dir, workspace)
    lines = await _interrupt_loaded(data_dir, child.id)
    assert [line["type"] for line in lines] == ["user_msg", "task_start", "abort", "task_end"]
    assert (lines[-1]["status"], lines[-1]["message"]) == ("aborted", "enough")


async def test_a_tree_interrupt_ends_a_stored_subagents_unstarted_prompt(
    data_dir: Path, workspace: Path
) -> None:
    """R-ABORT-1, R-TREE-2: as above, but the root is interrupted with scope tree and the
    scout is left in its trace: read from the store, it is loaded and its task ends
    aborted, no model request sent, no answer for the root; a host opened after takes
    nothing up. Before, the scout was left as it was and the next ``resume_tasks`` ran it."""
    with trio.fail_after(RUN_TIMEOUT_S):
        root_id, child = await _scout_left_at_its_prompt(data_dir, workspace)
        never = ScriptedProvider([Reply(blocks=(text("never asked"),))])
        ends = TaskEnds()
        async with Host.open(data_dir, observers=[ends]) as host:
            root = await host.load_session(root_id, provider=never)
            root.interrupt("enough")
            await ends.of(child.id).wait()
            await trio.testing.wait_all_tasks_blocked()
            assert not ends.of(root_id).is_set()  # the scout's end is for nobody
        async with open_host(data_dir) as host:
            assert await host.resume_tasks(approve=allow_all) == []
            lines = trace_lines(await host.load_session(child.id, provider=never))
    assert never.requests == []
    assert [line["type"] for line in lines] == ["user_msg", "task_start", "abort", "task_end"]
    assert lines[-1]["status"] == "aborted"
