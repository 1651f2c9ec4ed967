"""A replicated session's records count as written once JetStream acknowledged *them*,
whatever the other sessions' appends are doing, against a real nats-server (R-TRACE-3,
R-RUN-8: a client sees a record once it survives this host; R-CLUSTER-1).

An append retried after NATS failed it reaches the stream once, and is no fence when the
failed attempt was stored (R-CLUSTER-2: no record duplicated, no session lost)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import nats.js.api
import pytest
import trio

from greenroom.actors.cluster import store as store_module
from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterUnavailable
from greenroom.actors.cluster.store import ReplicatingTraceLog, ReplicatingTraceStore
from greenroom.actors.cluster.traces import FENCE_HEADER, ROTATE_HEADER, TraceStream, TraceWriter
from greenroom.actors.runtime.trace_sink import TraceWriteError
from greenroom.protocols.content import TextBlock
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import UserMsg
from greenroom.protocols.trace import encode_record, parse_trace
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
    running_nats,
)
from tests.test_store_conformance import record


class HeldWriter(TraceWriter):
    """The real writer, whose appends after the first ``free`` wait, before they are sent,
    until ``release`` is set."""

    def __init__(self, writer: TraceWriter, release: trio.Event, *, free: int = 0) -> None:
        super().__init__(writer._conn, writer.session_id, expected=writer.expected)
        self.release = release
        self.waiting = trio.Event()
        self.free = free

    async def append(self, lines: Sequence[str]) -> int:
        if self.free:
            self.free -= 1
        else:
            self.waiting.set()
            await self.release.wait()
        return await super().append(lines)


async def _replicated(store: ReplicatingTraceStore, sid: str) -> None:
    """A new session ``sid`` in ``store``, started and replicated (no writer yet)."""
    await store.catalog.create(sid, {"session_id": sid})
    store.log.start(sid)
    store.log.replicate(sid)


async def _replicated_from_host_a(
    store: ReplicatingTraceStore, traces: TraceStream, nursery: trio.Nursery, *sids: str
) -> None:
    """New sessions ``sids`` in ``store``, each streamed to the cluster by host-a."""
    for sid in sids:
        await _replicated(store, sid)
        await nursery.start(store.log.stream_to, sid, await traces.fence(sid, "host-a"))


def _named(error: TraceWriteError | None) -> str:
    """The class name of ``error``, or "nothing"."""
    return "nothing" if error is None else type(error).__name__


def _never_fenced(_sid: str) -> None:
    """An ``on_fenced`` for the tests that do not look at which sessions stopped."""


@asynccontextmanager
async def _store_running(
    conn: Connection, data_dir: Path, on_fenced: Callable[[str], None] = _never_fenced
) -> AsyncIterator[tuple[TraceStream, ReplicatingTraceStore, trio.Nursery]]:
    """The cluster's trace stream and a store over ``data_dir`` running (``on_fenced``
    told of the sessions that stop here) in a nursery, for the sessions' streams too,
    until the block ends: the nursery is cancelled then and the store closed."""
    traces = await TraceStream.open(conn)
    store = ReplicatingTraceStore(data_dir, on_fenced=on_fenced)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        yield traces, store, nursery
        nursery.cancel_scope.cancel()
    await store.aclose()


def test_a_session_is_not_held_back_by_another_sessions_append(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    async def body(conn: Connection) -> list[str]:
        seen: list[str] = []
        release = trio.Event()
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            for sid in ("slow", "fast"):
                await _replicated(store, sid)
            slow = HeldWriter(await traces.fence("slow", "host-a"), release)
            await nursery.start(log.stream_to, "slow", slow)
            await nursery.start(log.stream_to, "fast", await traces.fence("fast", "host-a"))

            slow_ticket = log.append("slow", 1, record("slow", 1))
            assert not log.commit("slow")
            await slow.waiting.wait()  # its append is on its way, and held
            fast_ticket = log.append("fast", 1, record("fast", 1))
            log.commit("fast")
            send, written = trio.open_memory_channel[TraceWritten](2)
            log.when_batch_done(slow_ticket, send)
            log.when_batch_done(fast_ticket, send)

            assert await written.receive() == TraceWritten(ticket=fast_ticket)
            seen.append("fast acknowledged")
            assert not log.batch_done(slow_ticket) and log.batch_done(fast_ticket)
            release.set()
            assert await written.receive() == TraceWritten(ticket=slow_ticket)
            seen.append("slow acknowledged")
            assert log.batch_done(slow_ticket) and log.commit("slow")
            assert [r.seq for r in (await traces.read("slow")).records] == [1]
        return seen

    seen = run_connected(nats_server.url, body, timeout_s=10.0)
    assert seen == ["fast acknowledged", "slow acknowledged"]


def test_a_session_no_longer_replicated_says_so_instead_of_passing_records_for_durable(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    # A session fenced by another host (or given up with its lease): the store forgot
    # why with the replica, so its later records went to the file alone, committed and
    # synced as if durable, and were published to this host's subscribers as the
    # session's, while the new owner went on from an earlier seq.
    def raised(call: Callable[[], object]) -> str:
        try:
            call()
        except Exception as exc:
            return type(exc).__name__
        return "nothing"

    async def body(conn: Connection) -> dict[str, object]:
        found: dict[str, object] = {}
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            await _replicated_from_host_a(store, traces, nursery, "fenced", "lost")
            await traces.fence("fenced", "host-b")  # another host takes it over
            log.append("fenced", 1, record("fenced", 1))
            found["sync"] = "nothing"
            with trio.fail_after(10):
                try:
                    await log.sync("fenced")
                except Exception as exc:
                    found["sync"] = type(exc).__name__
            found["append"] = raised(lambda: log.append("fenced", 2, record("fenced", 2)))
            log.forget("lost")  # its lease was lost
            log.append("lost", 1, record("lost", 1))
            found["lost"] = _named(log.error("lost"))
        found["in_cluster"] = [r.seq for r in (await traces.read("fenced")).records]
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "sync": "StaleTraceWriter",
        "append": "StaleTraceWriter",
        "lost": "RecordsGivenUp",
        "in_cluster": [],
    }


async def _sync_outcome(log: ReplicatingTraceLog, session_id: str) -> str:
    """What ``log.sync(session_id)`` raised (its class's name), or "nothing"."""
    with trio.fail_after(10):
        try:
            await log.sync(session_id)
        except Exception as exc:
            return type(exc).__name__
    return "nothing"


def test_records_jetstream_acknowledged_stay_acknowledged_when_their_session_is_given_up(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    # R-STEER-6, R-CLUSTER-1: giving a session up (its lease lost: forget; the store
    # closed: give_up_all) marked it lost whatever JetStream held already, so the sync of
    # a receipt whose record JetStream had acknowledged raised RecordsGivenUp, and its
    # steer was answered 410 for input the cluster's trace holds. Only records given up
    # unacknowledged, and any appended after, are lost.
    async def body(conn: Connection) -> dict[str, object]:
        found: dict[str, object] = {}
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            await _replicated_from_host_a(store, traces, nursery, "lost", "closed")
            for sid in ("lost", "closed"):
                log.append(sid, 1, record(sid, 1))
                await log.sync(sid)  # JetStream acknowledged it
            log.forget("lost")  # its lease was lost
            log.give_up_all()  # as the store's close does
            for sid in ("lost", "closed"):
                found[f"{sid} error"] = _named(log.error(sid))
                found[f"{sid} sync"] = await _sync_outcome(log, sid)
            log.append("lost", 2, record("lost", 2))  # reaches no cluster
            found["lost sync after an append"] = await _sync_outcome(log, "lost")
        found["in_cluster"] = [r.seq for r in (await traces.read("lost")).records]
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "lost error": "nothing",
        "lost sync": "nothing",
        "closed error": "nothing",
        "closed sync": "nothing",
        "lost sync after an append": "RecordsGivenUp",
        "in_cluster": [1],
    }


async def _streamed(
    log: ReplicatingTraceLog, nursery: trio.Nursery, sid: str, writer: TraceWriter
) -> trio.CancelScope:
    """``sid``'s records streamed with ``writer`` in a task of ``nursery``, until the
    returned scope is cancelled (as the node stops a session's stream)."""
    scope = trio.CancelScope()

    async def streaming(task_status: trio.TaskStatus[None]) -> None:
        with scope:
            await log.stream_to(sid, writer, task_status=task_status)

    await nursery.start(streaming)
    return scope


async def _done(log: ReplicatingTraceLog, *tickets: int) -> None:
    """Return once ``tickets`` are done."""
    send, written = trio.open_memory_channel[TraceWritten](len(tickets))
    for ticket in tickets:
        log.when_batch_done(ticket, send)
    with trio.fail_after(10):
        for _ in tickets:
            await written.receive()


W = TypeVar("W", bound=TraceWriter)


async def _record_2_on_its_way(
    store: ReplicatingTraceStore,
    traces: TraceStream,
    nursery: trio.Nursery,
    sid: str,
    wrap: Callable[[TraceWriter], W],
    reached: Callable[[W], trio.Event],
) -> tuple[W, int, int, trio.CancelScope]:
    """A new session ``sid`` streamed by host-a through ``wrap`` of its writer, its record
    1 acknowledged by JetStream, then its record 2 appended and on its way until
    ``reached(writer)`` is set (held, stored or failed, as the writer makes it): the
    writer, the tickets of records 1 and 2, and the scope of the session's stream."""
    log = store.log
    await _replicated(store, sid)
    writer = wrap(await traces.fence(sid, "host-a"))
    stream = await _streamed(log, nursery, sid, writer)
    first = log.append(sid, 1, record(sid, 1))
    with trio.fail_after(10):
        await log.sync(sid)
    second = log.append(sid, 2, record(sid, 2))
    with trio.fail_after(10):
        await reached(writer).wait()
    return writer, first, second, stream


async def _acknowledged_then_held(
    store: ReplicatingTraceStore, traces: TraceStream, nursery: trio.Nursery, sid: str
) -> tuple[int, int, trio.CancelScope]:
    """A new session ``sid`` streamed by host-a, its record 1 acknowledged by JetStream and
    its record 2's append held before it is sent: the tickets of both, and the scope of
    the session's stream."""
    _, acknowledged, in_flight, stream = await _record_2_on_its_way(
        store,
        traces,
        nursery,
        sid,
        lambda writer: HeldWriter(writer, trio.Event(), free=1),
        lambda held: held.waiting,
    )
    return acknowledged, in_flight, stream


async def _given_up(
    log: ReplicatingTraceLog, sid: str, stream: trio.CancelScope, *on_its_way: int
) -> None:
    """This host gives ``sid`` up, as when its lease was lost: forgotten, and its stream
    stopped (as the node stops it then); return once the tickets ``on_its_way`` are done."""
    log.forget(sid)
    stream.cancel()
    await _done(log, *on_its_way)


async def _taken_over(
    log: ReplicatingTraceLog, traces: TraceStream, sid: str, stream: trio.CancelScope
) -> None:
    """Host-b takes ``sid`` over (its fence), and this host gives it up, as when its lease
    was lost: forgotten, its stream stopped."""
    await traces.fence(sid, "host-b")
    await _given_up(log, sid, stream)


def test_each_ticket_answers_whether_its_own_record_reached_the_cluster(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    # R-STEER-6, R-CLUSTER-1: a receipt asked whether its session had lost any record,
    # so a steer JetStream acknowledged was answered 410 once a later record of its
    # session was given up unacknowledged. lost() answers for one ticket: JetStream
    # acknowledged it (None), or it was given up, or appended after the session was.

    async def body(conn: Connection) -> dict[str, object]:
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            acknowledged, in_flight, stream = await _acknowledged_then_held(
                store, traces, nursery, "s"
            )
            queued = log.append("s", 3, record("s", 3))
            # Records 2 (on its way, never sent) and 3 (queued) unacknowledged.
            await _taken_over(log, traces, "s", stream)
            after = log.append("s", 4, record("s", 4))
            await _done(log, in_flight)
            found = {
                "acknowledged": _named(log.lost("s", acknowledged)),
                "in flight": _named(log.lost("s", in_flight)),
                "queued": _named(log.lost("s", queued)),
                "appended after": _named(log.lost("s", after)),
                "done": [log.batch_done(t) for t in (acknowledged, in_flight, queued, after)],
            }
        found["in_cluster"] = [r.seq for r in (await traces.read("s")).records]
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "acknowledged": "nothing",
        "in flight": "RecordsGivenUp",
        "queued": "RecordsGivenUp",
        "appended after": "RecordsGivenUp",
        "done": [True, True, True, True],
        "in_cluster": [1],
    }


class AckHeldWriter(TraceWriter):
    """The real writer, whose appends after the first reach JetStream and then wait,
    their acknowledgement held, until ``release`` is set (never, here)."""

    def __init__(self, writer: TraceWriter) -> None:
        super().__init__(writer._conn, writer.session_id, expected=writer.expected)
        self.stored = trio.Event()
        self.appends = 0

    async def append(self, lines: Sequence[str]) -> int:
        sequence = await super().append(lines)
        self.appends += 1
        if self.appends > 1:
            self.stored.set()
            await trio.Event().wait()
        return sequence


def test_a_record_jetstream_stored_on_its_way_when_its_session_was_given_up_is_not_lost(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    # R-STEER-6, R-CLUSTER-1, R-CLUSTER-2: a record whose message JetStream had stored,
    # its acknowledgement not back yet, counted as lost when the session was given up
    # (its lease lost), so a steer's receipt was answered 410 for input the cluster's
    # trace holds and the host taking the session up runs. Its fate is found out first.
    sid = "s"

    async def body(conn: Connection) -> dict[str, object]:
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            _, first, stored, stream = await _record_2_on_its_way(
                store, traces, nursery, sid, AckHeldWriter, lambda writer: writer.stored
            )
            queued = log.append(sid, 3, record(sid, 3))  # never sent
            await _given_up(log, sid, stream, stored)  # record 2 stored unacknowledged
            found: dict[str, object] = {
                "first": _named(log.lost(sid, first)),
                "stored": _named(log.lost(sid, stored)),
                "queued": _named(log.lost(sid, queued)),
            }
        found["in_cluster"] = [r.seq for r in (await traces.read(sid)).records]
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "first": "nothing",
        "stored": "nothing",
        "queued": "RecordsGivenUp",
        "in_cluster": [1, 2],
    }


def test_a_record_whose_fate_nats_does_not_tell_is_in_doubt_not_lost(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    # R-STEER-6, R-CLUSTER-2: a record given up on its way, when NATS does not answer the
    # question whether it stored it, is neither acknowledged (its input said queued) nor
    # lost (a 410 for input the cluster may run): it is in doubt.
    sid = "doubt"

    async def body(conn: Connection) -> dict[str, object]:
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            _, first, on_its_way, stream = await _record_2_on_its_way(
                store, traces, nursery, sid, AckHeldWriter, lambda writer: writer.stored
            )
            reads = conn.js.get_msg

            async def unanswered(*_args: object, **_kwargs: object) -> object:
                raise nats.errors.TimeoutError

            conn.js.get_msg = unanswered  # type: ignore[method-assign]
            await _given_up(log, sid, stream, on_its_way)
            conn.js.get_msg = reads  # type: ignore[method-assign]
            found: dict[str, object] = {
                "first": _named(log.lost(sid, first)),
                "on its way": _named(log.lost(sid, on_its_way)),
                "sync": await _sync_outcome(log, sid),
            }
        found["in_cluster"] = [r.seq for r in (await traces.read(sid)).records]
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "first": "nothing",
        "on its way": "RecordInDoubt",
        "sync": "RecordInDoubt",
        "in_cluster": [1, 2],
    }


class FailingWriter(TraceWriter):
    """The real writer, which sets ``failed`` once NATS failed an append."""

    def __init__(self, writer: TraceWriter) -> None:
        super().__init__(writer._conn, writer.session_id, expected=writer.expected)
        self.failed = trio.Event()

    async def append(self, lines: Sequence[str]) -> int:
        try:
            return await super().append(lines)
        except ClusterUnavailable:
            self.failed.set()
            raise


def test_a_record_sent_but_not_stored_when_its_session_was_given_up_is_settled_by_sending_it(
    nats_server: NatsProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R-CLUSTER-2: NATS failed the record's append (unstored), and the session was given
    # up before the retry: nothing follows the writer's last message, so the attempt may
    # still arrive. Sent again with the same id, it is stored once (or refused for good,
    # had another host fenced): its ticket answers by what the stream then holds.
    monkeypatch.setattr(store_module, "_RETRY_S", 3600.0)  # no retry but the give-up's
    sid = "resent"

    async def body(conn: Connection) -> dict[str, object]:
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            faults = FaultyPublishes(conn, unsent={1})
            _, _, failed, stream = await _record_2_on_its_way(
                store, traces, nursery, sid, FailingWriter, lambda writer: writer.failed
            )
            await _given_up(log, sid, stream, failed)
            found: dict[str, object] = {
                "failed": _named(log.lost(sid, failed)),
                "attempts": faults.appends,
            }
        found["stored"] = await stored_messages(conn, sid)
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "failed": "nothing",
        "attempts": 3,
        "stored": ["1", "2"],
    }


def test_a_ticket_given_up_stays_lost_once_its_session_is_released_or_replicated_again(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    # R-STEER-6, R-CLUSTER-1: lost() knew a session only until its release (closed here)
    # or a fresh replicate(), so a receipt that asked after either was told None (durable,
    # queued: true) for a record given up unacknowledged or appended once the session was.

    async def body(conn: Connection) -> dict[str, object]:
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            tickets: dict[str, int] = {}
            for sid in ("released", "again"):
                acknowledged, in_flight, stream = await _acknowledged_then_held(
                    store, traces, nursery, sid
                )
                tickets[f"{sid}: acknowledged"] = acknowledged
                tickets[f"{sid}: in flight"] = in_flight
                await _taken_over(log, traces, sid, stream)  # record 2 unacknowledged
                tickets[f"{sid}: appended after"] = log.append(sid, 3, record(sid, 3))
                await _done(log, in_flight)
            log.release("released")  # closed here
            log.replicate("again")  # taken up here again
            found: dict[str, object] = {
                what: _named(log.lost(what.split(":")[0], ticket))
                for what, ticket in tickets.items()
            }
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "released: acknowledged": "nothing",
        "released: in flight": "RecordsGivenUp",
        "released: appended after": "RecordsGivenUp",
        "again: acknowledged": "nothing",
        "again: in flight": "RecordsGivenUp",
        "again: appended after": "RecordsGivenUp",
    }


async def _after_a_record_too_large(
    conn: Connection, data_dir: Path, huge: str, *, sync_first: bool
) -> dict[str, object]:
    """Sessions "huge" and "other" replicated; record 1 of "huge" (synced alone when
    ``sync_first``), then its record 2 ``huge``, then record 1 of "other": what the sync of
    "huge" raised, which sessions stopped here, and the seqs each has in the cluster."""
    stopped: list[str] = []
    found: dict[str, object] = {}
    async with _store_running(conn, data_dir, stopped.append) as (traces, store, nursery):
        log = store.log
        await _replicated_from_host_a(store, traces, nursery, "huge", "other")
        log.append("huge", 1, record("huge", 1))
        if sync_first:
            await log.sync("huge")
        log.append("huge", 2, huge)
        try:
            await log.sync("huge")
        except TraceWriteError as exc:
            found["sync"] = type(exc).__name__
            found["why"] = "max_payload" in str(exc)
        log.append("other", 1, record("other", 1))
        await log.sync("other")
    found["stopped"] = stopped
    found["in_cluster"] = {
        sid: [r.seq for r in (await traces.read(sid)).records] for sid in ("huge", "other")
    }
    return found


def test_a_record_larger_than_nats_takes_stops_its_session_not_the_host(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    # A client's input of a megabyte (one frame) made a trace line over NATS'
    # max_payload: the client refused it, the error escaped the session's replication
    # task and ended the host with every session on it. Now only that session stops
    # here, as a fenced one does (its trace in the cluster goes on without the record),
    # and the others replicate on (R-SEC-9, R-CLUSTER-2).
    async def body(conn: Connection) -> dict[str, object]:
        padded = record("huge", 2).rstrip("\n") + " " * conn.client.max_payload + "\n"
        return await _after_a_record_too_large(conn, tmp_path, padded, sync_first=False)

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "sync": "UnreplicableRecord",
        "why": True,
        "stopped": ["huge"],
        "in_cluster": {"huge": [1], "other": [1]},
    }


SMALL_PAYLOAD = 64 * 1024
"""The max_payload of a NATS server that takes less than a batch of trace lines."""


def record_of(session_id: str, seq: int, size: int, fill: str = "x") -> str:
    """A trace line of ``session_id`` whose UTF-8 encoding is ``size`` bytes: its text is
    ``fill`` repeated, and ``x`` for the bytes a whole ``fill`` does not take."""
    empty = record(session_id, seq).replace(f"record {seq}", "")
    count, rest = divmod(size - len(empty.encode()), len(fill.encode()))
    assert count > 0, (size, fill)
    line = encode_record(
        UserMsg(
            session_id=session_id,
            run_id="r1",
            seq=seq,
            kind="prompt",
            content=(TextBlock(text=fill * count + "x" * rest),),
        )
    )
    assert len(line.encode()) == size
    return line


def test_a_record_that_fits_nats_only_without_its_headers_stops_its_session_not_the_host(
    tmp_path: Path,
) -> None:
    # The client compares only the payload with max_payload, the server the payload and
    # the headers (the expected sequence, the message id): a record just under
    # max_payload was sent, the server closed the host's connection for it (Maximum
    # Payload Violation), and the append went again after each reconnect, for ever, every
    # session of the host losing its connection each time. Such a record is now too
    # large before it is sent: only its session stops (R-SEC-9, R-CLUSTER-2).
    async def body(conn: Connection) -> dict[str, object]:
        huge = record_of("huge", 2, conn.client.max_payload - 8)
        return await _after_a_record_too_large(conn, tmp_path / "data", huge, sync_first=True)

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        assert run_connected(server.url, body, timeout_s=20.0) == {
            "sync": "UnreplicableRecord",
            "why": True,
            "stopped": ["huge"],
            "in_cluster": {"huge": [1], "other": [1]},
        }


@pytest.mark.parametrize(
    ("max_payload", "size", "fill", "messages"),
    [
        # Under the 256 KiB a message held: three records of 30 KB, two a message.
        (SMALL_PAYLOAD, 30_000, "x", 2),
        # Over 256 KiB, but 256 Ki characters are 1 MiB in UTF-8: one record a message.
        (512 * 1024, 300_000, "\U0001f600", 3),
    ],
    ids=["small-max-payload", "non-ascii"],
)
def test_records_that_each_fit_nats_are_never_batched_past_it(
    tmp_path: Path, max_payload: int, size: int, fill: str, messages: int
) -> None:
    # The records queued together went as one message of up to 256 Ki *characters*,
    # whatever the server takes: on a server of a smaller max_payload, or in text that
    # is more bytes than characters, a batch of records that each fit was refused as too
    # large, and the session stopped here (R-SEC-9, R-CLUSTER-2).
    sid = "batched"

    async def body(conn: Connection) -> dict[str, object]:
        stopped: list[str] = []
        found: dict[str, object] = {}
        data_dir = tmp_path / "data"
        async with _store_running(conn, data_dir, stopped.append) as (traces, store, nursery):
            log = store.log
            await _replicated_from_host_a(store, traces, nursery, sid)
            fenced_at = await traces.last_sequence(sid)
            # Queued together: one batch for the writer.
            for seq in (1, 2, 3):
                log.append(sid, seq, record_of(sid, seq, size, fill))
            try:
                await log.sync(sid)
                found["sync"] = "done"
            except TraceWriteError as exc:
                found["sync"] = str(exc)
            found["messages"] = await traces.last_sequence(sid) - fenced_at
        found["stopped"] = stopped
        found["in_cluster"] = [r.seq for r in (await traces.read(sid)).records]
        return found

    with running_nats(tmp_path / "nats", max_payload=max_payload) as server:
        assert run_connected(server.url, body, timeout_s=20.0) == {
            "sync": "done",
            "messages": messages,
            "stopped": [],
            "in_cluster": [1, 2, 3],
        }


class FaultyPublishes:
    """Replaces ``conn.js.publish`` for the appends after a fence (numbered from 0):
    those in ``lost`` reach the stream but their acknowledgement is lost (the client's
    request times out), those in ``unsent`` never reach it; the others go through."""

    def __init__(
        self, conn: Connection, *, lost: Collection[int] = (), unsent: Collection[int] = ()
    ) -> None:
        self._publish = conn.js.publish
        self._lost, self._unsent = lost, unsent
        self.appends = 0
        conn.js.publish = self.publish  # type: ignore[method-assign]

    async def publish(
        self, subject: str, payload: bytes = b"", **kwargs: Any
    ) -> nats.js.api.PubAck:
        """The real publish, or a fault."""
        if FENCE_HEADER in (kwargs.get("headers") or {}):
            return await self._publish(subject, payload, **kwargs)
        attempt, self.appends = self.appends, self.appends + 1
        if attempt in self._unsent:
            raise nats.errors.TimeoutError
        ack = await self._publish(subject, payload, **kwargs)
        if attempt in self._lost:
            raise nats.errors.TimeoutError
        return ack


async def stored_messages(conn: Connection, session_id: str) -> list[str]:
    """The session's messages as the stream holds them: each record's seq, ``R<n>`` for
    a rotation to file ``n`` (fences left out)."""
    stream, subject = conn.names.trace_stream, conn.names.trace_subject(session_id)
    last = await TraceStream(conn).last_sequence(session_id)
    found: list[str] = []
    for sequence in range(1, last + 1):
        msg = await conn.call(conn.js.get_msg(stream, sequence, direct=True))
        headers = msg.headers or {}
        if msg.subject != subject or FENCE_HEADER in headers:
            continue
        if ROTATE_HEADER in headers:
            found.append(f"R{headers[ROTATE_HEADER]}")
        found.extend(str(r.seq) for r in parse_trace(msg.data or b"", file="stream").records)
    return found


def test_an_append_whose_acknowledgement_was_lost_is_no_fence(
    nats_server: NatsProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The append was stored but its acknowledgement lost (a timeout, a reconnect): the
    # retry, after the same sequence, was refused as "wrong last sequence" and taken for
    # another host's fence, so the session was stopped here and taken over, its task
    # interrupted, though nobody else wrote.
    monkeypatch.setattr(store_module, "_RETRY_S", 0.0)
    sid = "acklost"

    async def body(conn: Connection) -> dict[str, object]:
        fenced: list[str] = []
        found: dict[str, object] = {}
        async with _store_running(conn, tmp_path, fenced.append) as (traces, store, nursery):
            log = store.log
            faults = FaultyPublishes(conn, lost={0})
            await _replicated_from_host_a(store, traces, nursery, sid)
            found["synced"] = []
            for seq in (1, 2):
                try:
                    log.append(sid, seq, record(sid, seq))
                    await log.sync(sid)
                except TraceWriteError as exc:
                    found["synced"] = type(exc).__name__
                    break
                found["synced"].append(seq)
            found["attempts"] = faults.appends
            found["fenced"] = fenced
            found["error"] = log.error(sid)
        found["read"] = [r.seq for r in (await traces.read(sid)).records]
        found["stored"] = await stored_messages(conn, sid)
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "synced": [1, 2],
        "attempts": 3,
        "fenced": [],
        "error": None,
        "read": [1, 2],
        "stored": ["1", "2"],
    }


@pytest.mark.parametrize("fault", ["unsent", "lost"])
@pytest.mark.parametrize("split", ["rotation", "size"])
def test_a_retry_sends_again_only_what_was_not_acknowledged(
    nats_server: NatsProcess,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    split: str,
    fault: str,
) -> None:
    # The records queued together went as several messages (a rotation between them,
    # or more than a message holds); when a later one failed, the retry sent them all
    # again: the stream took the ones already acknowledged twice (and a rotation back to
    # the first file), or, when the failed one was stored, refused the retry as a fence.
    monkeypatch.setattr(store_module, "_RETRY_S", 0.0)
    if split == "size":
        monkeypatch.setattr(store_module, "MAX_MESSAGE_BYTES", 1)  # a line a message
    sid = f"split-{split}-{fault}"

    async def body(conn: Connection) -> tuple[list[str], list[int | None], int]:
        async with _store_running(conn, tmp_path) as (traces, store, nursery):
            log = store.log
            await _replicated_from_host_a(store, traces, nursery, sid)
            log.append(sid, 1, record(sid, 1))
            await log.sync(sid)
            # The last of the three messages below.
            FaultyPublishes(conn, **{fault: {2}})
            # Queued together: one batch for the writer.
            log.append(sid, 2, record(sid, 2))
            if split == "rotation":
                log.rotate(sid)
            else:
                log.append(sid, 3, record(sid, 3))
            log.append(sid, 4, record(sid, 4))
            await log.sync(sid)
        read = await traces.read(sid)
        return await stored_messages(conn, sid), [r.seq for r in read.current], read.file

    expected = (
        (["1", "2", "R2", "4"], [4], 2)
        if split == "rotation"
        else (["1", "2", "3", "4"], [1, 2, 3, 4], 1)
    )
    assert run_connected(nats_server.url, body, timeout_s=20.0) == expected


class RetryHeld(FailingWriter):
    """The real writer, whose appends after a failed one wait until ``retry`` is set."""

    def __init__(self, writer: TraceWriter) -> None:
        super().__init__(writer)
        self.retry = trio.Event()

    async def append(self, lines: Sequence[str]) -> int:
        if self.failed.is_set():
            await self.retry.wait()
        return await super().append(lines)


def test_an_append_stored_unacknowledged_before_another_host_fenced_is_not_lost(
    nats_server: NatsProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # R-CLUSTER-2, R-STEER-6: the append was stored but its acknowledgement lost, and
    # another host fenced the trace before the retry. The retry, refused for its expected
    # sequence, looked for its message as the subject's *last*, found the fence, and took
    # itself for fenced: the stored record counted as lost (a steer's 410 for input the
    # next host runs). Its message is the first after the writer's last: it was stored.
    monkeypatch.setattr(store_module, "_RETRY_S", 0.0)
    sid = "fenced-after"

    async def body(conn: Connection) -> dict[str, object]:
        fenced: list[str] = []
        async with _store_running(conn, tmp_path, fenced.append) as (traces, store, nursery):
            log = store.log
            FaultyPublishes(conn, lost={1})
            writer, _, stored, _ = await _record_2_on_its_way(
                store, traces, nursery, sid, RetryHeld, lambda writer: writer.failed
            )
            await traces.fence(sid, "host-b")
            writer.retry.set()
            found: dict[str, object] = {"sync": await _sync_outcome(log, sid)}
            found["stored"] = _named(log.lost(sid, stored))
            found["fenced"] = list(fenced)
            try:
                log.append(sid, 3, record(sid, 3))  # the fence refuses it
            except TraceWriteError as exc:
                found["sync after"] = f"append refused: {type(exc).__name__}"
            else:
                found["sync after"] = await _sync_outcome(log, sid)
            found["fenced after"] = list(fenced)
        found["in_cluster"] = await stored_messages(conn, sid)
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "sync": "nothing",
        "stored": "nothing",
        "fenced": [],
        "sync after": "StaleTraceWriter",
        "fenced after": ["fenced-after"],
        "in_cluster": ["1", "2"],
    }
