"""Interrupting a session whose task its host stopped under (R-ABORT-1, R-TRACE-4, R-TREE-2).

The crashing host of :mod:`test_tree_takeup` is killed while the root's foreground payer
runs its ``pay`` call: both tasks are left open in their traces, and nobody runs them in
the next host. Interrupting such a loaded session ends its task there, ``aborted``, with
no model request; a host opened later has nothing of it to take up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, allow_all, trace_lines
from test_gateway import connect, serving
from test_tree_takeup import (
    _call_output,
    _child_of,
    _crash_mid_child_call,
    _crashed_mid_pay,
    _ended_aborted,
    _pay_tool,
    _task_of,
)

from greenroom.actors.gateway.access import store_owner
from greenroom.actors.providers.scripted import ScriptedProvider
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.subagents import spawn_subagent


@pytest.mark.parametrize("scope", ["tree", "node"])
@pytest.mark.parametrize("node", ["root", "payer"])
async def test_interrupting_a_task_its_host_stopped_under_ends_it(
    data_dir: Path,
    workspace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    node: Literal["root", "payer"],
    scope: Literal["tree", "node"],
) -> None:
    """R-ABORT-1, R-TRACE-4: the host is killed mid ``pay`` of the root's foreground payer.
    On the next host the node, loaded alone, is interrupted: the call says it interrupted
    work, and the node's task ends aborted in its trace with the reason, its open call
    settled interrupted, no model request sent, nothing paid; a host opened after takes
    none of it up. Before, the interrupt returned False and left the task open: the next
    ``resume_tasks`` took the root up and ran it on."""
    crashed = await _crashed_mid_pay(data_dir, workspace, tmp_path, monkeypatch, background=False)
    root_id, asked, model, paid, tools, ends = crashed
    async with Host.open(data_dir, tools=tools, observers=[ends]) as host:
        child_id = await _child_of(host, root_id)
        node_id = root_id if node == "root" else child_id
        session = await host.load_session(node_id, provider=ScriptedProvider(model))
        assert session.interrupt("enough", scope=scope)
        with trio.fail_after(RUN_TIMEOUT_S):
            await ends.of(node_id).wait()
            await trio.testing.wait_all_tasks_blocked()
        assert not session.busy
        assert not session.interrupt("again", scope=scope)  # nothing is left to end
    async with Host.open(data_dir, tools=tools) as host:
        taken_up = await host.resume_tasks(approve=allow_all)
        lines = trace_lines(await host.load_session(node_id))
    # The payer's root, not interrupted, is still open and taken up: never the payer.
    assert taken_up == ([] if node == "root" else [root_id])
    assert (tmp_path / "marks").read_text() == "7\n" and paid == []
    assert _task_of(lines) == ["task_start", "task_end"]
    assert _ended_aborted(lines) and "enough" in lines[-1]["message"]
    call_id = "s1" if node == "root" else "p1"
    assert _call_output(lines, call_id)["status"] == "interrupted"
    if node == "root":
        assert asked == []


async def test_the_gateway_says_a_task_its_host_stopped_under_was_interrupted(
    data_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    """R-ABORT-1: the gateway's ``interrupt`` of a root whose host was killed mid-task (its
    owner kept as a gateway keeps it) answers ``interrupted: true`` and ends the task
    aborted in its trace, with no model request; before, it answered false."""
    root_id = await _crash_mid_child_call(data_dir, workspace, tmp_path, background=False)
    await trio.to_thread.run_sync(store_owner, data_dir / "sessions" / root_id, "default")
    with trio.fail_after(RUN_TIMEOUT_S):
        async with (
            serving(tmp_path, tools=[_pay_tool([]), spawn_subagent]) as server,
            connect(server) as client,
        ):
            answer = await client.result("interrupt", {"session_id": root_id})
            assert answer == {"interrupted": True}
            await server.host.get_session(root_id).wait_idle()
            lines = trace_lines(server.host.get_session(root_id))
            assert server.providers == [] or all(p.requests == [] for p in server.providers)
    assert _task_of(lines) == ["task_start", "task_end"] and _ended_aborted(lines)
