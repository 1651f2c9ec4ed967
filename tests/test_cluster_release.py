"""A session closed on a cluster host leaves the cluster's hands in its lane (R-CLUSTER-1,
R-TREE-4): its directory entry is closed while the host still answers calls on it, then its
replication and serving stop, then its claim goes; a call forwarded meanwhile is answered
here, where the session is opened again, rather than told to try again. The serving stops
once the calls under way are done; those that come later wait for the release's end."""

from __future__ import annotations

from typing import Any, cast

import trio
import trio.testing

from greenroom.actors.cluster.directory_entries import DirectoryEntries
from greenroom.actors.cluster.in_flight import CallsInFlight
from greenroom.actors.cluster.lanes import SessionLanes
from greenroom.actors.cluster.node import _answers, _release_closed
from greenroom.actors.cluster.ownership import OwnershipKeeper
from greenroom.actors.cluster.routing import NOT_DONE, Answering, Handler, outcome_of
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
        CallsInFlight(5.0),
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


# -- the calls forwarded while a release is under way (R-CLUSTER-1) ---------------------------


STEER = {"method": "steer"}


def _steer(asked: list[str], until: trio.Event | None = None) -> Handler:
    async def handle(message: dict[str, Any], answering: Answering) -> dict[str, Any]:
        asked.append(message["method"])
        if until is not None:
            await until.wait()
        return {"result": {"queued": False}}

    return handle


def test_a_release_begins_once_the_calls_under_way_are_done() -> None:
    async def main() -> list[str]:
        calls = CallsInFlight(5.0)
        seen: list[str] = []
        done = trio.Event()
        handle = calls.counted("s1", _steer(seen, done))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle, STEER, Answering())
            await trio.testing.wait_all_tasks_blocked()

            async def release() -> None:
                async with calls.releasing("s1") as began:
                    seen.append("stop")
                    began.left = True

            nursery.start_soon(release)
            await trio.testing.wait_all_tasks_blocked()
            seen.append("call done")
            done.set()
        return seen

    assert trio.run(main) == ["steer", "call done", "stop"]


def test_a_call_under_way_is_cut_short_after_the_bound_as_before() -> None:
    async def main() -> float:
        calls = CallsInFlight(5.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(calls.counted("s1", _steer([], trio.Event())), STEER, Answering())
            await trio.testing.wait_all_tasks_blocked()
            began = trio.current_time()
            async with calls.releasing("s1"):
                waited = trio.current_time() - began
            nursery.cancel_scope.cancel()
        return waited

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == 5.0


def test_a_call_that_comes_during_a_release_waits_for_its_end() -> None:
    """Answered ``not_done`` once the session has left (its claim released, even when the
    stream's stop cancels the call meanwhile): its gateway opens it where the call arrived.
    Carried out when the session stayed (a call under way opened it again)."""

    async def main(leaves: bool) -> tuple[list[str], dict[str, Any], bool]:
        calls = CallsInFlight(5.0)
        seen: list[str] = []
        answering = Answering()
        replies: list[dict[str, Any]] = []
        stream = trio.CancelScope()

        async def call() -> None:
            with stream:
                replies.append(await calls.counted("s1", _steer(seen))(STEER, answering))

        async with trio.open_nursery() as nursery:
            async with calls.releasing("s1") as release:
                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()
                release.left = leaves
                if leaves:
                    stream.cancel()  # the stop ends the stream; then the claim goes
                    await trio.testing.wait_all_tasks_blocked()
                    seen.append("claim released")
                seen.append("release ending")
        return seen, replies[0], answering.in_doubt

    seen, reply, in_doubt = trio.run(main, True)
    assert seen == ["claim released", "release ending"]
    assert outcome_of(reply) == NOT_DONE and not in_doubt
    seen, reply, _ = trio.run(main, False)
    assert seen == ["release ending", "steer"] and reply == {"result": {"queued": False}}
