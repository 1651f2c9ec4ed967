"""One suite of contracts every trace store keeps, run against each backend (R-TRACE,
R-COMPACT-8, R-CLUSTER-1, R-HOST-3, R-SEC-1).

The backends (``tests/support/store_backends.py``): ``files`` — the default
:class:`~greenroom.actors.runtime.trace_store.FileTraceStore`, writing through a test disk
that records its fsyncs and refuses writes on demand; ``memory`` — the tests' in-memory
store, acknowledging records from its own task (later than the append, as a networked store
would); ``jetstream`` — the cluster's ``ReplicatingTraceStore`` against a real nats-server,
its sessions adopted as a cluster node adopts them. The JetStream backend is skipped, with
the reason, only where nats-server or the cluster extra is missing.

Each contract talks to the store through its three parts (``store.catalog``, ``store.log``,
``store.ledger``) and looks past them only through the backend's views of where records
really are: ``written`` (what survives the death of the process) and ``durable`` (what
survives a power cut). A contract runs on a fresh store, bounded by a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from greenroom.actors.runtime.errors import SeqRefused
from greenroom.actors.runtime.trace_sink import TraceSinkClosed, TraceWriteError
from greenroom.actors.runtime.trace_store import (
    StaleTraceWriter,
    StoredSessionMissing,
    StoredSessionUnreadable,
)
from greenroom.protocols.content import TextBlock
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import UserMsg
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import STARTED, UsageLine, UsageQuery, UsageRow, encode_record
from tests.support.store_backends import KINDS, Backend, Runner


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A nats-server with JetStream for the module (each contract uses names of its own)."""
    try:
        from greenroom.actors.cluster.server import NatsServerMissing, nats_server_binary
        from tests.support.nats import running_nats
    except ImportError as exc:
        pytest.skip(f"the JetStream backend needs the cluster extra: {exc}")
    try:
        nats_server_binary()
    except NatsServerMissing as exc:
        pytest.skip(f"the JetStream backend needs nats-server: {exc}")
    with running_nats(tmp_path_factory.mktemp("nats")) as server:
        yield server.url


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Runner:
    kind: str = request.param
    url = request.getfixturevalue("nats_url") if kind == "jetstream" else None
    return Runner(kind, tmp_path, url)


# -- helpers -----------------------------------------------------------------------------


def meta_of(session_id: str, **more: Any) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "created_at": 1_700_000_000.0,
        "workspace_dir": "/work",
        "settings": {"model": "m"},
        "tools": [],
        **more,
    }


async def new_session(b: Backend, session_id: str) -> None:
    """As a host creates one: its metadata, its empty trace, then its observers."""
    await b.store.catalog.create(session_id, meta_of(session_id))
    b.store.log.start(session_id)
    await b.adopt(session_id)


async def load(b: Backend, session_id: str) -> Any:
    """As a host loads one: the latest trace, then its observers."""
    loaded = await b.store.log.load(session_id)
    await b.adopt(session_id)
    return loaded


def record(session_id: str, seq: int) -> str:
    return encode_record(
        UserMsg(
            session_id=session_id,
            run_id="r1",
            seq=seq,
            kind="prompt",
            content=(TextBlock(text=f"record {seq}"),),
        )
    )


async def written(b: Backend, session_id: str, ticket: int) -> None:
    """Commit the session's records and wait until ``ticket`` is done (R-TRACE-3)."""
    log = b.store.log
    if log.commit(session_id):
        assert log.batch_done(ticket)
        return
    # Room for the one answer: when_batch_done never waits.
    send, receive = trio.open_memory_channel[TraceWritten](1)
    log.when_batch_done(ticket, send)
    assert await receive.receive() == TraceWritten(ticket=ticket)
    assert log.batch_done(ticket)


async def append_all(b: Backend, session_id: str, seqs: range | list[int]) -> None:
    """Append each record, commit, wait until written."""
    ticket = 0
    for seq in seqs:
        ticket = b.store.log.append(session_id, seq, record(session_id, seq))
    await written(b, session_id, ticket)


def seqs_of(records: Any) -> list[int | None]:
    return [r.seq for r in records]


# -- the trace log -------------------------------------------------------------------------


def test_records_read_back_in_order_after_a_reload(backend: Runner) -> None:
    """R-TRACE-1, R-TRACE-4: appended records come back in seq order from a reload (and
    from a reader that takes no position); a session with no records loads empty."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        await new_session(b, "s2")
        await append_all(b, "s1", range(1, 4))
        await append_all(b, "s1", range(4, 6))
        await log.sync("s1")
        log.release("s1")
        log.release("s2")
        latest = await log.read_latest("s1")
        loaded = await load(b, "s1")
        assert seqs_of(loaded.records) == seqs_of(latest.records) == [1, 2, 3, 4, 5]
        assert (loaded.number, loaded.last_seq, loaded.errors) == (1, 5, ())
        assert loaded.records[0] == UserMsg(
            session_id="s1", run_id="r1", seq=1, kind="prompt",
            content=(TextBlock(text="record 1"),),
        )
        empty = await load(b, "s2")
        assert (empty.records, empty.number, empty.last_seq) == ((), 1, 0)

    backend.run(contract)


def test_appends_are_fenced_by_seq(backend: Runner) -> None:
    """R-CLUSTER-1, R-TRACE-1: an append whose seq the trace holds already is refused with
    StaleTraceWriter and stores nothing; later seqs go on (a seq left unused is no error),
    and after a reload the fence starts from the stored records."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        await append_all(b, "s1", [1, 2])
        for stale in (2, 1):
            with pytest.raises(StaleTraceWriter):
                log.append("s1", stale, record("s1", stale))
        await append_all(b, "s1", [3, 5])
        await log.sync("s1")
        assert seqs_of(await log.read_after("s1")) == [1, 2, 3, 5]
        assert await b.written("s1") == [1, 2, 3, 5]
        log.release("s1")
        with pytest.raises(KeyError):  # released: appending needs a load
            log.append("s1", 6, record("s1", 6))
        assert (await load(b, "s1")).last_seq == 5
        with pytest.raises(StaleTraceWriter):
            log.append("s1", 5, record("s1", 5))
        await append_all(b, "s1", [6])
        await log.sync("s1")
        assert await b.written("s1") == [1, 2, 3, 5, 6]

    backend.run(contract)


def test_a_line_that_cannot_be_stored_is_refused_and_costs_nothing(backend: Runner) -> None:
    """R-SEC-1: a line without its newline, or with text UTF-8 cannot encode, is refused
    (ValueError) before anything is kept; the same seq then takes a good record."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        with pytest.raises(ValueError):
            log.append("s1", 1, record("s1", 1).rstrip("\n"))
        with pytest.raises(ValueError):
            log.append("s1", 1, record("s1", 1).replace("record 1", "record \ud800"))
        await append_all(b, "s1", [1])
        await log.sync("s1")
        assert seqs_of(await log.read_after("s1")) == [1]

    backend.run(contract)


def test_read_after_replays_from_a_seq(backend: Runner) -> None:
    """R-TRACE-1 (replay for a client that reconnects): every record after a seq, in
    order; nothing for a seq past the end or a session without records."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        await append_all(b, "s1", range(1, 7))
        assert seqs_of(await log.read_after("s1")) == [1, 2, 3, 4, 5, 6]
        assert seqs_of(await log.read_after("s1", 3)) == [4, 5, 6]
        assert await log.read_after("s1", 6) == []
        assert await log.read_after("nobody", 0) == []

    backend.run(contract)


def test_rotation_starts_a_new_numbered_trace(backend: Runner) -> None:
    """R-COMPACT-8: a rotation starts the session's next numbered trace in a new place;
    load returns the latest trace's records (seq goes on across traces), replay reads
    across all of them."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        await append_all(b, "s1", [1, 2, 3])
        first = log.location("s1")
        assert log.trace_number("s1") == 1
        name = log.rotate("s1")
        assert name and log.trace_number("s1") == 2
        assert log.location("s1") != first
        await append_all(b, "s1", [4, 5])
        await log.sync("s1")
        latest = await log.read_latest("s1")
        assert (seqs_of(latest.records), latest.number, latest.last_seq) == ([4, 5], 2, 5)
        assert seqs_of(await log.read_after("s1", 2)) == [3, 4, 5]
        log.release("s1")
        loaded = await load(b, "s1")
        assert (seqs_of(loaded.records), loaded.number, loaded.last_seq) == ([4, 5], 2, 5)
        assert log.trace_number("s1") == 2
        with pytest.raises(StaleTraceWriter):
            log.append("s1", 5, record("s1", 5))
        log.rotate("s1")
        await append_all(b, "s1", [6])
        await log.sync("s1")
        assert await b.written("s1") == [1, 2, 3, 4, 5, 6]
        listed = {s.session_id: s for s in await b.store.catalog.list_sessions()}
        assert listed["s1"].traces == 3

    backend.run(contract)


def test_a_fork_copies_the_prefix_and_shares_nothing(backend: Runner) -> None:
    """R-FORK-1: a fork holds the source's records up to its seq, in the same numbered
    traces, moved to its own id, durable; it loads like any session and appends after the
    fork point; the source reads back as before; a seq past the source's last, or an
    unknown source, is refused and stores nothing."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "src")
        await append_all(b, "src", [1, 2, 3])
        log.rotate("src")
        await append_all(b, "src", [4, 5, 6])
        await log.sync("src")
        before = (await b.written("src"), await log.read_after("src"))
        assert await log.fork("src", "fork", 5) == 5
        await b.store.catalog.create("fork", meta_of("fork"))
        loaded = await load(b, "fork")
        assert (seqs_of(loaded.records), loaded.number, loaded.last_seq) == ([4, 5], 2, 5)
        assert {r.session_id for r in loaded.records} == {"fork"}
        with pytest.raises(StaleTraceWriter):
            log.append("fork", 5, record("fork", 5))
        await append_all(b, "fork", [6, 7])
        await log.sync("fork")
        assert await b.written("fork") == [1, 2, 3, 4, 5, 6, 7]
        assert await b.durable("fork") == [1, 2, 3, 4, 5, 6, 7]
        copied = await log.read_after("fork")
        assert [r.session_id for r in copied] == ["fork"] * 7
        assert copied[:5] == [attrs.evolve(r, session_id="fork") for r in before[1][:5]]
        assert (await b.written("src"), await log.read_after("src")) == before
        assert await log.fork("src", "empty", 0) == 0
        await b.store.catalog.create("empty", meta_of("empty"))
        assert (await load(b, "empty")).last_seq == 0
        assert await log.fork("src", "whole", None) == 6
        await b.store.catalog.create("whole", meta_of("whole"))
        assert seqs_of(await log.read_after("whole")) == [1, 2, 3, 4, 5, 6]
        for bad in (7, -1):
            with pytest.raises(SeqRefused):
                await log.fork("src", "bad", bad)
        with pytest.raises(StoredSessionMissing):
            await log.fork("nobody", "bad", 0)
        assert await log.read_after("bad") == []

    backend.run(contract)


def test_publication_waits_for_the_write(backend: Runner) -> None:
    """R-TRACE-3, R-RUN-8: once commit says the records are handed on, or once the ticket
    is done (TraceWritten on the reply channel), they survive the death of this process;
    a done ticket is answered at once."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        ticket = log.append("s1", 1, record("s1", 1))
        log.append("s1", 2, record("s1", 2))
        last = log.append("s1", 3, record("s1", 3))
        assert last >= ticket
        if log.commit("s1"):
            assert log.batch_done(last)
        else:
            # Room for the one answer: when_batch_done never waits.
            send, receive = trio.open_memory_channel[TraceWritten](1)
            log.when_batch_done(last, send)
            assert await receive.receive() == TraceWritten(ticket=last)
        assert log.batch_done(ticket) and log.batch_done(last)
        assert await b.written("s1") == [1, 2, 3]
        send, receive = trio.open_memory_channel[TraceWritten](1)
        log.when_batch_done(last, send)
        assert receive.receive_nowait() == TraceWritten(ticket=last)

    backend.run(contract)


def test_sync_makes_the_appended_records_durable(backend: Runner) -> None:
    """R-TRACE-2: when sync returns, every record appended before it is durable — for one
    session, and for every session with no session named."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        await new_session(b, "s2")
        for seq in (1, 2, 3):
            log.append("s1", seq, record("s1", seq))
        await log.sync("s1")
        assert await b.durable("s1") == [1, 2, 3]
        log.append("s1", 4, record("s1", 4))
        log.append("s2", 1, record("s2", 1))
        await log.sync()
        assert await b.durable("s1") == [1, 2, 3, 4]
        assert await b.durable("s2") == [1]

    backend.run(contract)


def test_a_write_failure_is_the_sessions_own_and_sticky(backend: Runner) -> None:
    """R-SEC-1: records of one session cannot be written: that session's sync raises and
    its error stays — after the disk recovers too — until cleared; the other session
    writes and syncs as before, and nothing ends the store."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        await new_session(b, "s2")
        await append_all(b, "s1", [1])
        await log.sync("s1")
        b.refuse_writes("s1")
        await append_all(b, "s1", [2])
        await append_all(b, "s2", [1])
        with pytest.raises(TraceWriteError):
            await log.sync("s1")
        assert isinstance(log.error("s1"), TraceWriteError)
        assert log.error("s2") is None
        await log.sync("s2")
        assert await b.durable("s2") == [1]
        b.mend()
        await append_all(b, "s1", [3])
        assert log.error("s1") is not None  # sticky: a record was lost
        with pytest.raises(TraceWriteError):
            await log.sync("s1")
        log.clear_error("s1")
        assert log.error("s1") is None
        await append_all(b, "s1", [4])
        await log.sync("s1")
        assert {1, 3, 4} <= set(await b.durable("s1"))

    backend.run(contract)


def test_a_closed_store_refuses_appends_syncs_and_rows(backend: Runner) -> None:
    """R-TRACE-2: after the store is closed nothing is accepted that could not be made
    durable: append, sync and a ledger row raise TraceSinkClosed."""

    async def contract(b: Backend) -> None:
        log = b.store.log
        await new_session(b, "s1")
        await append_all(b, "s1", [1])
        await b.store.aclose()
        with pytest.raises(TraceSinkClosed):
            log.append("s1", 2, record("s1", 2))
        with pytest.raises(TraceSinkClosed):
            await log.sync("s1")
        with pytest.raises(TraceSinkClosed):
            b.store.ledger.record_usage(usage_row("s1", "title"))

    backend.run(contract)


# -- the session catalog -------------------------------------------------------------------


def test_metadata_is_created_read_and_listed(backend: Runner) -> None:
    """R-HOST-1: a created session exists, reads back its metadata and is listed with it;
    a session never created is missing (StoredSessionMissing), not unreadable."""

    async def contract(b: Backend) -> None:
        catalog = b.store.catalog
        assert await catalog.list_sessions() == []
        await new_session(b, "s1")
        await new_session(b, "s2")
        await append_all(b, "s2", [1])
        assert await catalog.exists("s1") and await catalog.exists("s2")
        assert await catalog.read_meta("s1") == meta_of("s1")
        assert not await catalog.exists("nobody")
        with pytest.raises(StoredSessionMissing):
            await catalog.read_meta("nobody")
        listed = {s.session_id: s for s in await catalog.list_sessions()}
        assert set(listed) == {"s1", "s2"}
        for sid, entry in listed.items():
            assert (entry.meta, entry.problem) == (meta_of(sid), None)
            assert entry.updated_at > 0 and entry.where
        assert (listed["s1"].traces, listed["s2"].traces) == (0, 1)

    backend.run(contract)


def test_unreadable_metadata_is_reported_never_hidden(backend: Runner) -> None:
    """R-SEC-1: metadata that cannot be used — not JSON, or a known field of the wrong
    type — raises StoredSessionUnreadable naming where it is; the list shows the session
    with the reason and every other session as before."""

    async def contract(b: Backend) -> None:
        catalog = b.store.catalog
        await new_session(b, "bad")
        await new_session(b, "good")
        await catalog.create("wrong", meta_of("wrong", settings="not an object"))
        b.corrupt_meta("bad")
        for sid, why in (("bad", "not JSON"), ("wrong", "settings")):
            with pytest.raises(StoredSessionUnreadable, match=why):
                await catalog.read_meta(sid)
            assert await catalog.exists(sid)
        listed = {s.session_id: s for s in await catalog.list_sessions()}
        assert set(listed) == {"bad", "good", "wrong"}
        assert listed["bad"].meta is None and "not JSON" in (listed["bad"].problem or "")
        assert listed["bad"].where in (listed["bad"].problem or "")
        assert listed["good"].meta == meta_of("good") and listed["good"].problem is None

    backend.run(contract)


def test_delete_removes_everything(backend: Runner) -> None:
    """R-HOST-3: deleting a session (open or not) removes its metadata and every trace —
    nothing of it is left in the store, and its records are not replayed; another session
    is untouched; deleting a session never stored is no error."""

    async def contract(b: Backend) -> None:
        catalog, log = b.store.catalog, b.store.log
        await new_session(b, "s1")
        await new_session(b, "s2")
        await append_all(b, "s1", [1, 2])
        log.rotate("s1")
        await append_all(b, "s1", [3])
        await append_all(b, "s2", [1])
        await log.sync()
        await catalog.delete("s1")
        assert not await catalog.exists("s1")
        with pytest.raises(StoredSessionMissing):
            await catalog.read_meta("s1")
        assert await log.read_after("s1") == []
        assert [s.session_id for s in await catalog.list_sessions()] == ["s2"]
        assert await b.leftovers("s1") == []
        with pytest.raises(KeyError):  # the log forgot it
            log.append("s1", 4, record("s1", 4))
        assert seqs_of(await log.read_after("s2")) == [1]
        await catalog.delete("never-stored")

    backend.run(contract)


# -- the usage ledger ----------------------------------------------------------------------


def usage_row(
    session_id: str,
    kind: Any,
    *,
    at: float = 1_700_000_000.0,
    model: str = "m",
    cost_usd: float | None = None,
    principal: str | None = None,
    root_id: str | None = None,
    **tokens: int,
) -> UsageRow:
    return UsageRow(
        at=at,
        session_id=session_id,
        run_id="r1",
        turn=1,
        kind=kind,
        provider="scripted",
        model=model,
        usage=TokenUsage(**tokens, cost_usd=cost_usd),
        principal=principal,
        root_id=root_id,
    )


def test_the_ledger_records_rows(backend: Runner) -> None:
    """R-TRACE-5: every row recorded is counted in the totals, per session and kind."""

    async def contract(b: Backend) -> None:
        ledger = b.store.ledger
        assert await ledger.totals() == {}
        ledger.record_usage(usage_row("a", "request", input=100, output=10, cache_read=5))
        ledger.record_usage(usage_row("a", "request", input=50, output=5))
        ledger.record_usage(usage_row("a", "compaction_failed"))
        ledger.record_usage(usage_row("b", "title", input=7, output=3))
        totals = await ledger.totals()
        assert totals == {
            "a": {"input": 150, "output": 15, "cache_read": 5, "cache_write": 0,
                  "total": 170, "requests": 2, "compaction_failures": 1, "titles": 0},
            "b": {"input": 7, "output": 3, "cache_read": 0, "cache_write": 0,
                  "total": 10, "requests": 0, "compaction_failures": 0, "titles": 1},
        }  # fmt: skip
        assert await ledger.totals("b") == {"b": totals["b"]}
        assert await ledger.totals("nobody") == {}

    backend.run(contract)


def test_a_keyed_row_replaces_the_row_of_its_key(backend: Runner) -> None:
    """R-SHARE-3, R-TRACE-5: a request's ``started`` row is replaced by its last row (the
    same ``request_key``): one row a request in the totals and reports, never two; rows
    without a key are each counted."""

    async def contract(b: Backend) -> None:
        ledger = b.store.ledger
        started = attrs.evolve(
            usage_row("a", "request", input=1_000, cost_usd=0.003),
            status=STARTED, request_key="k1",
        )  # fmt: skip
        ledger.record_usage(started)
        ledger.record_usage(usage_row("a", "request", input=5, output=1))
        assert (await ledger.totals("a"))["a"]["requests"] == 2
        ledger.record_usage(
            attrs.evolve(
                usage_row("a", "request", input=1_000, output=40, cost_usd=0.0036),
                request_key="k1",
            )
        )
        totals = (await ledger.totals("a"))["a"]
        assert (totals["requests"], totals["input"], totals["output"]) == (2, 1_005, 41)
        (line,) = await ledger.report(UsageQuery())
        assert line.requests == 2 and line.cost_usd == pytest.approx(0.0036)

    backend.run(contract)


def test_the_ledger_reports_cost_by_session_principal_model_and_time(backend: Runner) -> None:
    """R-SHARE-3: a report adds up the rows a query covers — a time range (since
    inclusive, until exclusive), a principal, a tree — per session, principal or model,
    with their cost; requests of unknown price are counted apart, never priced."""
    day = 86_400.0
    t0 = 1_700_000_000.0

    async def contract(b: Backend) -> None:
        ledger = b.store.ledger
        assert await ledger.report(UsageQuery()) == []
        assert await ledger.report(UsageQuery(by=None)) == [UsageLine(key=None)]
        rows = [
            usage_row("a", "request", at=t0, model="m1", cost_usd=0.5, principal="alice",
                      root_id="a", input=100, output=10),
            usage_row("a", "request", at=t0 + day, model="m2", principal="alice",
                      root_id="a", input=7, output=1),
            usage_row("a.child", "request", at=t0 + day, model="m1", cost_usd=0.25,
                      principal="alice", root_id="a", input=40, output=4),
            usage_row("b", "title", at=t0 + 2 * day, model="m1", cost_usd=0.125,
                      principal="bob", root_id="b", input=20, output=2),
            usage_row("b", "compaction_failed", at=t0 + 2 * day, principal="bob",
                      root_id="b"),
            usage_row("old", "request", at=t0 - day, model="m1", input=5, output=5),
        ]  # fmt: skip
        for row in rows:
            ledger.record_usage(row)
        by_session = await ledger.report(UsageQuery())
        assert [(line.key, line.requests, line.cost_usd, line.unpriced) for line in by_session] == [
            ("a", 2, 0.5, 1),
            ("a.child", 1, 0.25, 0),
            ("b", 1, 0.125, 0),
            ("old", 1, 0.0, 1),
        ]
        assert by_session[0] == UsageLine(
            key="a", requests=2, input=107, output=11, total=118, cost_usd=0.5, unpriced=1
        )
        by_principal = await ledger.report(UsageQuery(by="principal"))
        assert [(line.key, line.cost_usd) for line in by_principal] == [
            (None, 0.0), ("alice", 0.75), ("bob", 0.125)
        ]
        by_model = await ledger.report(UsageQuery(by="model", since=t0, until=t0 + 2 * day))
        assert [(line.key, line.requests, line.cost_usd) for line in by_model] == [
            ("m1", 2, 0.75), ("m2", 1, 0.0)
        ]
        alice_today = await ledger.report(UsageQuery(by=None, principal="alice", since=t0 + day))
        assert alice_today == [
            UsageLine(key=None, requests=2, input=47, output=5, total=52, cost_usd=0.25,
                      unpriced=1)
        ]  # fmt: skip
        tree = await ledger.report(UsageQuery(by=None, tree="a"))
        assert (tree[0].requests, tree[0].cost_usd) == (3, 0.75)
        child = await ledger.report(UsageQuery(by=None, tree="a.child"))
        assert (child[0].requests, child[0].cost_usd) == (1, 0.25)

    backend.run(contract)
