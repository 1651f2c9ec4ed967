"""A session closed on a cluster host leaves the cluster's hands in its lane (R-CLUSTER-1,
R-TREE-4): its directory entry is closed while the host still answers calls on it, then its
replication and serving stop, then its claim goes; a call forwarded meanwhile is answered
here, where the session is opened again, rather than told to try again."""

from __future__ import annotations

from typing import cast

import trio
import trio.testing

from greenroom.actors.cluster.directory_entries import DirectoryEntries
from greenroom.actors.cluster.lanes import SessionLanes
from greenroom.actors.cluster.node import _answers, _release_closed
from greenroom.actors.cluster.ownership import OwnershipKeeper
from greenroom.actors.cluster.store import ReplicatingTraceLog


class _Steps:
    """The parts a release uses (the entries' and the keeper's side here), each recording
    what it was asked in one list."""

    def __init__(self, *, opened_again_before_stop: bool = False) -> None:
        self.done: list[str] = []
        self.adopted: set[str] = set()
        self._again = opened_again_before_stop

    def stop(self, session_id: str) -> bool:
        self.done.append("stop")
        return session_id not in self.adopted

    async def close(self, session_id: str) -> None:
        self.done.append("entry closed")
        if self._again:
            self.adopted.add(session_id)  # a call opened it here again meanwhile

    async def release(self, session_id: str) -> None:
        self.done.append("claim released")


class _Log:
    """The trace log's side of a release."""

    def __init__(self, steps: _Steps) -> None:
        self._steps = steps

    async def settled(self, session_id: str) -> bool:
        self._steps.done.append("settled")
        return True

    def stop(self, session_id: str) -> None:
        self._steps.done.append("replication stopped")


async def _release(steps: _Steps) -> list[str]:
    await _release_closed(
        "s1",
        cast(ReplicatingTraceLog, _Log(steps)),
        steps.stop,
        cast(DirectoryEntries, steps),
        cast(OwnershipKeeper, steps),
        steps.adopted,
    )
    return steps.done


def test_the_entry_is_closed_before_the_host_stops_answering() -> None:
    assert trio.run(_release, _Steps()) == [
        "settled",
        "entry closed",
        "stop",
        "replication stopped",
        "claim released",
    ]


def test_a_session_opened_again_during_its_release_stays_this_hosts() -> None:
    # Its adoption, next in its lane, announces its entry open again.
    assert trio.run(_release, _Steps(opened_again_before_stop=True)) == [
        "settled",
        "entry closed",
        "stop",
    ]
    opened_at_once = _Steps()
    opened_at_once.adopted.add("s1")
    assert trio.run(_release, opened_at_once) == ["settled"]


def test_a_host_answers_for_a_session_it_runs_or_still_releases() -> None:
    async def main() -> list[bool]:
        lanes = SessionLanes()
        released = trio.Event()
        seen = []
        runs = {"s2"}.__contains__
        async with trio.open_nursery() as nursery:
            lanes.start_soon(nursery, "s1", released.wait)
            await trio.testing.wait_all_tasks_blocked()
            seen += [_answers(runs, lanes, "s1"), _answers(runs, lanes, "s2")]
            released.set()
        seen += [_answers(runs, lanes, "s1"), _answers(runs, lanes, "s3")]
        return seen

    assert trio.run(main) == [True, True, False, False]
