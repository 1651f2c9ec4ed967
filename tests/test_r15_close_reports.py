"""A host that closes while a taken-up background child's answer is on its way to a root
that is not loaded (R-TREE-2, R-TREE-4, R-TREE-1): a host closing is normal, so no
traceback reaches the log (before: an ERROR with a ``HostClosed`` traceback), one line
says where the answer is, and the next host on the same data dir finds it where it is
recorded, in the child's trace (``session.children()``). The crash is a real SIGKILLed
host process (tests/test_tree_takeup.py), the model the scripted one."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import trio
from conftest import RUN_TIMEOUT_S, open_host, trace_lines
from test_tree_takeup import _after_takeup, _child_of, _crash_mid_child_call, _pay_tool

from greenroom.actors.providers.scripted import ScriptedProvider
from greenroom.actors.runtime.subagents import spawn_subagent
from greenroom.protocols.outputs import Output, TaskEnd
from greenroom.protocols.people import PEOPLE


async def test_r15_a_host_closing_as_a_taken_up_childs_answer_leaves_logs_no_traceback(
    data_dir: Path, workspace: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The child taken up ends its task and the host closes at once, its report to the
    root on its way: no ERROR, no traceback (before: when the close came before the root's
    load, ``HostClosed`` logged with its traceback). Then the report offered on the closed
    host, as it is when the close comes first: one WARNING line, nothing raised (before:
    ``HostClosed``). The next host finds the answer in the child's trace."""
    root_id = await _crash_mid_child_call(data_dir, workspace, tmp_path, background=True)
    model = ScriptedProvider(_after_takeup)
    tools = [_pay_tool([]), spawn_subagent]
    caplog.set_level(logging.INFO)
    async with open_host(data_dir) as host:
        child_id = await _child_of(host, root_id)
        child = await host.load_session(child_id, provider=model, tools=tools)
        send, inbox = trio.open_memory_channel[list[Output]](math.inf)
        child.watch(send)
        await host.resume(child_id, provider=model, tools=tools, approve=lambda call: "allow")
        with trio.fail_after(RUN_TIMEOUT_S):
            async for batch in inbox:
                if any(isinstance(o, TaskEnd) and o.origin is None for o in batch):
                    break
        # The host closes now, the report to the root (not loaded) on its way.
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
    caplog.clear()
    text = "[subagent payer finished] paid, as far as I know"
    await host.child_reports.deliver(root_id, child_id, text, PEOPLE)
    (said,) = [r for r in caplog.records if r.name.endswith("child_reports")]
    assert said.levelno == logging.WARNING and said.exc_info is None
    assert child_id in said.getMessage() and "stays in its trace" in said.getMessage()

    async with open_host(data_dir) as host:
        root = await host.load_session(root_id, provider=model, tools=tools)
        (found,) = await root.children()
        lines = trace_lines(found)
    assert found.id == child_id
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"
    answers = [line for line in lines if line["type"] == "model_msg"]
    assert answers[-1]["block"] == {"type": "text", "text": "paid, as far as I know"}
