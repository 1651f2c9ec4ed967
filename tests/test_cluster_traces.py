"""The fenced trace stream in JetStream, against a real nats-server (R-CLUSTER-1: an
append from a host that lost its lease is refused; R-TRACE-1: the same JSONL records, seq
without gap or duplicate on replay)."""

from __future__ import annotations

import trio

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import Fenced
from greenroom.actors.cluster.traces import TraceStream, TraceWriter
from greenroom.protocols.outputs import Output, TaskStart
from greenroom.protocols.trace import encode_record
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
)

SID = "20260101-120000-abcdef"


def _line(seq: int) -> str:
    return encode_record(TaskStart(session_id=SID, run_id="r1", seq=seq, input_seq=None))


def _seqs(records: tuple[Output, ...] | list[Output]) -> list[int | None]:
    return [r.seq for r in records]


def test_appends_read_back_as_the_same_records(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[list[int | None], list[str]]:
        stream = await TraceStream.open(conn)
        writer = await stream.fence(SID, "host-a")
        await writer.append([_line(1), _line(2)])
        await writer.append([_line(3)])
        read = await stream.read(SID)
        return _seqs(read.records), [encode_record(r) for r in read.records]

    seqs, lines = run_connected(nats_server.url, body)
    assert seqs == [1, 2, 3]
    assert lines == [_line(1), _line(2), _line(3)]


def test_a_stale_writer_is_fenced_by_the_new_owner(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[list[int | None], bool, bool]:
        stream = await TraceStream.open(conn)
        old = await stream.fence(SID, "host-a")
        await old.append([_line(1)])
        # host-a stalls; host-b claims the session and fences the trace.
        new = await stream.fence(SID, "host-b")
        try:
            await old.append([_line(2)])
            refused = False
        except Fenced:
            refused = True
        await new.append([_line(2)])
        try:
            await old.append([_line(3)])  # still refused, without asking again
            again = False
        except Fenced:
            again = True
        return _seqs((await stream.read(SID)).records), refused, again

    assert run_connected(nats_server.url, body) == ([1, 2], True, True)


def test_a_retry_of_a_message_stored_unacknowledged_is_no_fence(
    nats_server: NatsProcess,
) -> None:
    # The server stored an append but its acknowledgement was lost: the writer's retry
    # (the same message after the same sequence) was refused as "wrong last sequence"
    # and taken for a fence, though nobody else wrote. A message the server has as the
    # subject's first after the writer's last is now recognised as the retried one, even
    # when a new owner's fence follows it (it was stored: R-CLUSTER-2, no record given up
    # that the cluster holds); anything else there still fences.
    async def body(conn: Connection) -> dict[str, object]:
        stream = await TraceStream.open(conn)
        writer = await stream.fence(SID, "host-a")
        await writer.append([_line(1)])
        found: dict[str, object] = {}
        # What the server stored of the attempt whose acknowledgement was lost: the same
        # writer's message, published by a copy of it the writer never hears from.
        stored = await TraceWriter(conn, SID, expected=writer.expected).append([_line(2)])
        found["retry"] = await writer.append([_line(2)]) == stored
        await writer.append([_line(3)])
        found["records"] = _seqs((await stream.read(SID)).records)
        # A different message after the same sequence is someone else's write.
        await TraceWriter(conn, SID, expected=writer.expected).append([_line(4)])
        try:
            await writer.append([_line(5)])
            found["other message"] = "accepted"
        except Fenced:
            found["other message"] = "fenced"
        # The retried message stored, then a new owner's fence: the retry finds it
        # stored, and the writer's next append is fenced.
        writer = await stream.fence(SID, "host-b")
        stored = await TraceWriter(conn, SID, expected=writer.expected).append([_line(5)])
        await stream.fence(SID, "host-c")
        found["retry before a fence"] = await writer.append([_line(5)]) == stored
        try:
            await writer.append([_line(6)])
            found["fenced after"] = "accepted"
        except Fenced:
            found["fenced after"] = "fenced"
        return found

    assert run_connected(nats_server.url, body) == {
        "retry": True,
        "records": [1, 2, 3],
        "other message": "fenced",
        "retry before a fence": True,
        "fenced after": "fenced",
    }


def test_replay_after_seq_across_a_rotation(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[list[int | None], list[int | None], int]:
        stream = await TraceStream.open(conn)
        writer = await stream.fence(SID, "host-a")
        await writer.append([_line(1), _line(2), _line(3)])
        await writer.rotate(2)
        await writer.append([_line(4), _line(5)])
        read = await stream.read(SID, after_seq=2)
        return _seqs(read.records), _seqs(read.current), read.file

    assert run_connected(nats_server.url, body) == ([3, 4, 5], [4, 5], 2)


def test_pages_give_what_read_gives_a_message_at_a_time(nats_server: NatsProcess) -> None:
    """A replay's pages: the records read gives, each message's new ones as one page (a
    fence, a rotation, records at or before ``after_seq`` make none), up to the last
    message there was when asked; an empty trace has none (R-SEC-9)."""

    async def body(conn: Connection) -> dict[str, object]:
        stream = await TraceStream.open(conn)
        async with stream.pages("20260101-120000-nopage") as pages:
            empty = [page async for page in pages]
        writer = await stream.fence(SID, "host-a")
        await writer.append([_line(1), _line(2), _line(3)])
        await writer.rotate(2)
        await writer.append([_line(4)])
        await writer.append([_line(5), _line(6)])
        async with stream.pages(SID, after_seq=2) as pages:
            await writer.append([_line(7)])  # after it was asked: not in it
            paged = [_seqs(page) async for page in pages]
        read = await stream.read(SID, after_seq=2)
        return {"empty": empty, "pages": paged, "read": _seqs(read.records)}

    assert run_connected(nats_server.url, body) == {
        "empty": [],
        "pages": [[3], [4], [5, 6]],
        "read": [3, 4, 5, 6, 7],
    }


def test_an_empty_trace_reads_as_nothing(nats_server: NatsProcess) -> None:
    async def body(conn: Connection) -> tuple[int, int]:
        stream = await TraceStream.open(conn)
        read = await stream.read(SID)
        return len(read.records), read.last_sequence

    assert run_connected(nats_server.url, body) == (0, 0)


def test_follow_replays_then_goes_live_without_gap_or_duplicate(
    nats_server: NatsProcess,
) -> None:
    async def body(conn: Connection) -> list[int | None]:
        stream = await TraceStream.open(conn)
        writer = await stream.fence(SID, "host-a")
        await writer.append([_line(1), _line(2)])
        await writer.append([_line(3)])
        seen: list[int | None] = []
        caught_up = trio.Event()
        async with stream.follow(SID, after_seq=1) as records:
            async with trio.open_nursery() as nursery:

                async def write_later() -> None:
                    await caught_up.wait()
                    await writer.append([_line(4), _line(5)])

                nursery.start_soon(write_later)
                async for record in records:
                    seen.append(record.seq)
                    if record.seq == 3:
                        caught_up.set()
                    if record.seq == 5:
                        break
        return seen

    assert run_connected(nats_server.url, body) == [2, 3, 4, 5]
