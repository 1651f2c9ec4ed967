"""A drain's hand-overs are spread over the other hosts (R-DRAIN-2): every held task of a
drain reaches its boundary within a turn, so the hand-overs come in a burst, faster than
the other hosts announce their new loads. Counted with what was handed to them since
their last announcement, the hosts share the burst as placement shares new sessions;
before, every session went to the host that had announced the least load (the chaos
benchmark: 17 of 17 to one host, which then took a second to take each up)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import trio

from greenroom.actors.cluster.handover import HandedSince, hand_over
from greenroom.actors.cluster.registry import HostRecord

ANNOUNCED = 1000.0


class Registry:
    """The hosts as they last announced themselves: the drainer and two others."""

    def __init__(self, loads: dict[str, int]) -> None:
        self.records = [
            HostRecord(host_id=h, load=n, at=ANNOUNCED, placeable=True) for h, n in loads.items()
        ]

    async def hosts(self) -> list[HostRecord]:
        return list(self.records)


class Keeper:
    async def release(self, session_id: str) -> None:
        pass


class Requests:
    """Takes every session once all of the burst have asked (their choices are made)."""

    def __init__(self, burst: int, refused_by: str | None = None) -> None:
        self.burst = burst
        self.refused_by = refused_by
        self.asked: list[str] = []
        self.params: list[dict[str, Any]] = []
        self.taken: Counter[str] = Counter()
        self.all_asked = trio.Event()

    async def request_host(
        self, host_id: str, message: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        self.asked.append(host_id)
        self.params.append(message["params"])
        if len(self.asked) >= self.burst:
            self.all_asked.set()
        await self.all_asked.wait()
        if host_id == self.refused_by:
            return {"result": {"taken": False}}
        self.taken[host_id] += 1
        return {"result": {"taken": True}}


async def _burst(registry: Registry, requests: Requests, sessions: int) -> None:
    handed = HandedSince()
    async with trio.open_nursery() as nursery:
        for n in range(sessions):
            nursery.start_soon(
                hand_over, f"s{n}", "a", registry, Keeper(), requests, lambda _: None, 5.0,
                handed,
            )


async def test_a_burst_of_hand_overs_is_spread_by_load() -> None:
    requests = Requests(burst=8)
    await _burst(Registry({"a": 20, "b": 3, "c": 1}), requests, 8)
    # c announced 1 and b 3: c takes two first, then they alternate.
    assert requests.taken == {"b": 3, "c": 5}


async def test_a_host_that_refuses_is_not_counted() -> None:
    requests = Requests(burst=4, refused_by="b")
    await _burst(Registry({"a": 20, "b": 0, "c": 0}), requests, 4)
    assert requests.taken == {"c": 4}


async def test_a_tree_goes_to_one_host_in_one_request() -> None:
    """R-DRAIN-2, R-TREE-2: a session handed with the rest of its tree: every one is given
    up here, one request names them all, and the host that takes them counts them all."""
    registry = Registry({"a": 20, "b": 0, "c": 2})
    requests = Requests(burst=1)
    given_up: list[str] = []
    handed = HandedSince()
    tree = ("payer", "collector")
    await hand_over(
        "root", "a", registry, Keeper(), requests, given_up.append, 5.0, handed, with_ids=tree
    )
    assert given_up == ["root", "payer", "collector"]
    assert requests.params == [{"session_id": "root", "with": ["payer", "collector"]}]
    assert requests.taken == {"b": 1}
    assert handed.load(registry.records[1]) == 3
