"""A taken-up background child reports the answer of the task its parent spawned
(R-TREE-2, R-TREE-4), never that of a run someone starts on its session as that task
ends: the host takes the scout up after a drain held it (``resume_tasks``), and an
observer of the host starts a new run on the scout as it sees the taken-up task's
``task_end``. That run is the observer's, run to its end in the scout's open session, as
a live child's would be; the parent hears the taken-up task's answer once."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect
from test_drain import SlowTool
from test_t14_tree_reports import drained_scout, scout_model, taken_up
from test_tree_takeup import _reports, _until_task_end

from greenroom.actors.runtime.session import RunStream, Session
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd

_model = scout_model("the task's answer", "and again", "a later run's answer")
"""The scout answers ``the task's answer``; a run ``and again`` on it answers ``a later
run's answer``."""


async def test_a_taken_up_child_run_again_as_its_task_ends_reports_that_tasks_answer(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TREE-2, R-TREE-4: before, the follower of the taken-up scout read on into the
    observer's run, started as the task's ``task_end`` was published, and the root was
    told ``a later run's answer``; now it is told the task's own answer, once, and the
    observer's run still ends with its answer."""
    slow = SlowTool()
    root_id, scout_id = await drained_scout(data_dir, workspace, _model, slow)
    runs: list[RunStream] = []

    def run_again(session: Session) -> None:
        def listen(batch: list[Output]) -> None:
            ends = any(isinstance(o, TaskEnd) and o.origin is None for o in batch)
            if ends and session.id == scout_id and not runs:
                runs.append(session.run("and again", approve=allow_all))

        session.subscribe(listen)

    ids = (root_id, scout_id)
    async with taken_up(data_dir, _model, slow, ids, monkeypatch, [run_again]) as (root, inbox):
        with trio.fail_after(RUN_TIMEOUT_S):
            seen = await _until_task_end(inbox)
            again = await collect(runs[0])
            await root.wait_idle()
    assert _reports(seen) == ["[subagent scout finished] the task's answer"]
    answers = [o.block for o in again if isinstance(o, ModelMsg) and o.origin is None]
    assert [getattr(block, "text", None) for block in answers] == ["a later run's answer"]
    assert [o.status for o in again if isinstance(o, TaskEnd)] == ["completed"]
