"""The parts of the cluster's shared limits that need no NATS (R-SHARE-1, R-SHARE-4 across
hosts): the owner's desk that admits other hosts' requests, a principal's limit counted
over the cluster, and the endpoint identity that tells hosts they share an endpoint
without naming its key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from greenroom import ProviderLimits
from greenroom.actors.cluster.admission import (
    KEEP_FOR_S,
    KEEP_IDLE_S,
    AdmissionDesk,
    KeptPlaces,
    endpoint_key,
)
from greenroom.actors.cluster.spending import SharedSpendLimit, spending_key
from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.providers.base import IdentifiedEndpoint
from greenroom.actors.providers.openai import OpenAIProvider
from greenroom.actors.runtime.admission import EndpointAdmission
from greenroom.protocols.budgets import SpendLimit, period_start


def admit(host: str, number: int, run: str = "r1") -> dict[str, Any]:
    return {"op": "admit", "host": host, "run": run, "id": number, "principal": host,
            "session": f"{host}-{number}"}


def report(op: str, host: str, number: int, run: str = "r1") -> dict[str, Any]:
    return {"op": op, "host": host, "run": run, "id": number}


def answers(log: list[str], name: str) -> Callable[[dict[str, Any]], None]:
    def reply(answer: dict[str, Any]) -> None:
        log.append(name)

    return reply


async def test_the_owners_desk_admits_other_hosts_in_turn_and_gives_their_places_back() -> None:
    """One place. b's first request is granted; its second waits, and an admit of it
    sent again waits for the same place (both answered when it is granted, one place
    taken). c's request withdrawn while it waits leaves the queue. A new run of host b
    gives back the places of its earlier run; a host missing twice from the live hosts
    loses its places; closing the desk gives back the rest."""
    admission = EndpointAdmission(ProviderLimits(max_concurrent_requests=1))
    replies: list[str] = []
    async with trio.open_nursery() as nursery:
        desk = AdmissionDesk(admission, nursery)
        desk.take(admit("b", 1), answers(replies, "b1"))
        await trio.testing.wait_all_tasks_blocked()
        assert (replies, admission.in_flight) == (["b1"], 1)

        desk.take(admit("b", 2), answers(replies, "b2"))
        desk.take(admit("b", 2), answers(replies, "b2 again"))
        desk.take(admit("c", 1), answers(replies, "c1"))
        await trio.testing.wait_all_tasks_blocked()
        assert (replies, admission.waiting) == (["b1"], 2)
        desk.take(report("release", "c", 1), None)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting == 1

        desk.take(report("accepted", "b", 1), None)
        desk.take(report("release", "b", 1), None)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(replies) == ["b1", "b2", "b2 again"]
        assert (admission.in_flight, admission.waiting, desk.holds) == (1, 0, 1)

        # b restarted under the same id: its earlier run's place is free for the new one.
        desk.take(admit("b", 1, run="r2"), answers(replies, "b1 of r2"))
        await trio.testing.wait_all_tasks_blocked()
        assert replies[-1] == "b1 of r2" and admission.in_flight == 1

        desk.drop_lost_hosts({"a"})  # missing once: maybe a late announcement
        assert admission.in_flight == 1
        desk.drop_lost_hosts({"a"})
        assert (admission.in_flight, desk.holds) == (0, 0)

        desk.take(admit("d", 1), answers(replies, "d1"))
        await trio.testing.wait_all_tasks_blocked()
        desk.close()
        assert admission.in_flight == 0
        assert "c1" not in replies


async def test_the_owners_answer_says_whether_a_place_may_be_kept_and_who_waits() -> None:
    """R-SHARE-1, R-SHARE-2: a grant's answer lets the asking host keep the place unless a
    per-minute limit is configured, and says how many wait at the owner (the asking host
    keeps nothing while some do). The common grant needs no task of the desk's own."""
    answered: list[dict[str, Any]] = []

    def record(answer: dict[str, Any]) -> None:
        answered.append(answer)

    admission = EndpointAdmission(ProviderLimits(max_concurrent_requests=1))
    async with trio.open_nursery() as nursery:
        desk = AdmissionDesk(admission, nursery)
        desk.take(admit("b", 1), record)
        assert answered == [{"keep": True, "waiting": 0}]  # at once, no task
        desk.take(admit("b", 2), record)
        desk.take(admit("c", 1), record)
        await trio.testing.wait_all_tasks_blocked()
        desk.take(report("release", "b", 1), None)
        await trio.testing.wait_all_tasks_blocked()
        assert answered[1:] == [{"keep": True, "waiting": 1}]  # c still waits
        desk.close()

    answered.clear()
    by_minute = EndpointAdmission(ProviderLimits(requests_per_minute=10))
    async with trio.open_nursery() as nursery:
        desk = AdmissionDesk(by_minute, nursery)
        desk.take(admit("b", 1), record)
        await trio.testing.wait_all_tasks_blocked()
        assert answered == [{"keep": False, "waiting": 0}]
        desk.close()


async def test_kept_places_go_back_idle_when_the_owner_is_busy_or_another_owner_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R-SHARE-1, R-SHARE-2: the asking host's kept places (no NATS here: ``give_back``
    records what would be reported). The most recently used is taken first; an answer
    saying requests wait at the owner, or an answer of another owner, gives every kept
    place back; one idle for ``KEEP_IDLE_S`` goes back by itself, and one whose time is
    up goes back when it is next looked at."""
    back: list[int] = []
    kept = KeptPlaces(back.append)
    kept.heard("a", 0)
    now = trio.current_time()
    kept.keep(1, now + KEEP_FOR_S)
    kept.keep(2, now + KEEP_FOR_S)
    taken = kept.take()
    assert taken is not None and taken.number == 2 and kept.taken == 1
    kept.keep(2, now + KEEP_FOR_S)

    kept.heard("a", 0)  # nobody waits: kept
    assert (len(kept), back) == (2, [])
    kept.heard("a", 3)  # three wait at the owner: they are owed these places
    assert (len(kept), back, kept.owner_busy) == (0, [1, 2], True)

    kept.heard("a", 0)
    kept.keep(3, trio.current_time() + KEEP_FOR_S)
    kept.heard("b", 0)  # a new owner does not count a's places
    assert (len(kept), back, kept.owner) == (0, [1, 2, 3], "b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(kept.give_back_idle)
        kept.keep(4, trio.current_time() + KEEP_FOR_S)
        # 5's time is up first, but 4 is looked at first (oldest): both go when 4 has
        # been idle for KEEP_IDLE_S.
        kept.keep(5, trio.current_time() + KEEP_IDLE_S / 2)
        await trio.sleep(KEEP_IDLE_S * 0.9)
        assert back[3:] == [] and len(kept) == 2
        await trio.sleep(KEEP_IDLE_S * 0.1 + 0.01)
        assert sorted(back[3:]) == [4, 5] and len(kept) == 0
        kept.keep(6, trio.current_time() + 0.1)
        assert kept.take() is not None  # within its time
        kept.keep(6, trio.current_time())
        assert kept.take() is None and back[-1] == 6  # its time is up: given back
        nursery.cancel_scope.cancel()


async def test_a_report_of_another_host_teaches_the_owners_admission() -> None:
    """A 429 with ``retry-after`` reported by the host that got it pauses the owner's
    admission (every host's requests pass it); a request's usage settles its estimate."""
    admission = EndpointAdmission(ProviderLimits(input_tokens_per_minute=1000))
    async with trio.open_nursery() as nursery:
        desk = AdmissionDesk(admission, nursery)
        message = {**admit("b", 1), "input": 900, "output": 0}
        desk.take(message, answers([], "b1"))
        await trio.testing.wait_all_tasks_blocked()
        desk.take({**report("settle", "b", 1), "input": 100, "output": 5}, None)
        desk.take({**report("limited", "b", 1), "retry_after": 30}, None)
        assert admission.rate_limit_answers == 1
        assert 29 < admission.pause_remaining() <= 30
        permit = admission.admit_now()
        assert permit is None  # paused (and tokens are counted: no fast path)
        desk.close()


class Book:
    """Stands in for the spending counters: what the limit queues for them."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, float]] = []
        self.heard: dict[str, float] = {}

    def add(self, limit: SharedSpendLimit, cost_usd: float) -> None:
        self.queued.append((limit.key, cost_usd))

    def total(self, key: str) -> float:
        return self.heard.get(key, 0.0)


def test_a_principals_limit_counts_the_cluster_total_and_its_own_unsent_spending() -> None:
    now = 1_800_000_000.0  # 2027-01-15 08:00 UTC
    since = period_start("day", now)
    local = SpendLimit("budget of principal 'alice'", 1.0, spent_usd=0.25, period="day",
                       since=since)
    book = Book()
    limit = SharedSpendLimit(local, "alice", book, 0.4)  # type: ignore[arg-type]
    key = spending_key("alice", "day", since)
    assert limit.key == key and "alice" not in key
    assert limit.spent_usd == 0.4

    limit.spend(0.1, now)  # counted here at once, queued for the counter
    assert book.queued == [(key, 0.1)]
    assert limit.spent_usd == pytest.approx(0.5)
    limit.heard(key, 0.6)  # another host spent 0.2
    assert limit.spent_usd == pytest.approx(0.7)  # 0.6 + this host's unsent 0.1
    limit.sent(key, 0.1, 0.7)  # this host's 0.1 reached the counter
    assert (limit.unsent_usd, limit.spent_usd) == (0.0, pytest.approx(0.7))
    limit.heard(key, 0.65)  # an older total changes nothing
    limit.heard(spending_key("alice", "day", since - 86_400), 5.0)  # nor another period's
    assert limit.spent_usd == pytest.approx(0.7)
    assert limit.refusal(0.2, now) is None
    assert limit.refusal(0.31, now) is not None

    # A new day: the count starts again from what was heard of it (another host spent
    # 0.05 after midnight, while this one was idle).
    tomorrow = now + 86_400
    next_key = spending_key("alice", "day", since + 86_400)
    limit.heard(next_key, 0.05)  # not the current period's yet here: kept by the book
    book.heard[next_key] = 0.05
    assert limit.spent_usd == pytest.approx(0.7)
    assert limit.refusal(0.95, tomorrow) is None
    assert limit.refusal(0.96, tomorrow) is not None
    limit.spend(0.3, tomorrow)
    assert book.queued[-1] == (next_key, 0.3)
    assert (limit.cluster_usd, limit.spent_usd) == (0.05, pytest.approx(0.35))


async def test_wait_spent_returns_once_the_spending_is_heard() -> None:
    since = period_start("day", 1_800_000_000.0)
    limit = SharedSpendLimit(SpendLimit("b", 1.0, period="day", since=since), "bob",
                             Book(), 0.0)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def wait() -> None:
            await limit.wait_spent(0.5)
            done.set()

        nursery.start_soon(wait)
        limit.heard(limit.key, 0.3)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        limit.heard(limit.key, 0.5)
    assert done.is_set()


def test_an_endpoint_is_known_by_provider_url_and_key_without_the_key() -> None:
    key = "sk-ant-secret-0123456789"
    one = AnthropicProvider(api_key=key, base_url="http://127.0.0.1:9/")
    same = AnthropicProvider(api_key=key, base_url="http://127.0.0.1:9")
    other_key = AnthropicProvider(api_key="sk-ant-other", base_url="http://127.0.0.1:9")
    openai = OpenAIProvider(api_key=key, base_url="http://127.0.0.1:9")
    assert isinstance(one, IdentifiedEndpoint)
    identity = one.endpoint_identity
    assert identity.startswith("anthropic http://127.0.0.1:9 ")
    assert key not in identity and "secret" not in identity
    assert same.endpoint_identity == identity
    assert other_key.endpoint_identity != identity
    assert openai.endpoint_identity.startswith("openai http://127.0.0.1:9 ")
    digest = endpoint_key(identity)
    assert len(digest) == 24 and all(c in "0123456789abcdef" for c in digest)
