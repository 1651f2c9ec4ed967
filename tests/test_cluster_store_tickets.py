"""A replicated session's records count as written once JetStream acknowledged *them*,
whatever the other sessions' appends are doing, against a real nats-server (R-TRACE-3,
R-RUN-8: a client sees a record once it survives this host; R-CLUSTER-1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.store import ReplicatingTraceStore
from greenroom.actors.cluster.traces import TraceStream, TraceWriter
from greenroom.protocols.messages import TraceWritten
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_store_conformance import record


class HeldWriter(TraceWriter):
    """The real writer, whose appends wait until ``release`` is set."""

    def __init__(self, writer: TraceWriter, release: trio.Event) -> None:
        super().__init__(writer._conn, writer.session_id, expected=writer.expected)
        self.release = release
        self.waiting = trio.Event()

    async def append(self, lines: Sequence[str]) -> int:
        self.waiting.set()
        await self.release.wait()
        return await super().append(lines)


def test_a_session_is_not_held_back_by_another_sessions_append(
    nats_server: NatsProcess, tmp_path: Path
) -> None:
    async def body(conn: Connection) -> list[str]:
        traces = await TraceStream.open(conn)
        store = ReplicatingTraceStore(tmp_path, on_fenced=lambda _sid: None)
        log = store.log
        seen: list[str] = []
        release = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            for sid in ("slow", "fast"):
                await store.catalog.create(sid, {"session_id": sid})
                log.start(sid)
                log.replicate(sid)
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
            nursery.cancel_scope.cancel()
        await store.aclose()
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
        traces = await TraceStream.open(conn)
        store = ReplicatingTraceStore(tmp_path, on_fenced=lambda _sid: None)
        log = store.log
        found: dict[str, object] = {}
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            for sid in ("fenced", "lost"):
                await store.catalog.create(sid, {"session_id": sid})
                log.start(sid)
                log.replicate(sid)
                await nursery.start(log.stream_to, sid, await traces.fence(sid, "host-a"))
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
            error = log.error("lost")
            found["lost"] = "nothing" if error is None else type(error).__name__
            nursery.cancel_scope.cancel()
        await store.aclose()
        found["in_cluster"] = [r.seq for r in (await traces.read("fenced")).records]
        return found

    assert run_connected(nats_server.url, body, timeout_s=20.0) == {
        "sync": "StaleTraceWriter",
        "append": "StaleTraceWriter",
        "lost": "TraceWriteError",
        "in_cluster": [],
    }
