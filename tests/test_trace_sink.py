"""The TraceSink actor against real files and a real SQLite ledger.

Worker threads run for real here, so there is no MockClock: every test is bounded by
``fail_after`` instead, and nothing waits by sleeping. Tests that look at fsyncs give the
sink a :class:`FaultyDisk`, which records them.
"""

from __future__ import annotations

import shutil
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from greenroom.actors.runtime import trace_sink
from greenroom.actors.runtime.disk import DISK, Disk
from greenroom.actors.runtime.trace_sink import (
    LEDGER_FILE_NAME,
    MOST_OPEN_TRACE_FILES,
    STARTED_ROWS_WAIT_S,
    SYNC_THREADS,
    TraceSink,
    TraceSinkClosed,
    TraceWriteError,
    latest_trace_file,
    most_open_trace_files,
    read_trace,
    usage_report,
    usage_totals,
)
from greenroom.protocols.content import TextBlock
from greenroom.protocols.outputs import ModelMsg, TokenUsageOutput
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.trace import (
    STARTED,
    UsageLine,
    UsageQuery,
    UsageRow,
    encode_record,
    trace_file_name,
)
from tests.support.disks import FaultyDisk

TIMEOUT = 10


def line(seq: int, session_id: str = "s1", text: str = "x") -> str:
    return encode_record(
        ModelMsg(session_id=session_id, run_id="r1", seq=seq, turn=1, block=TextBlock(text=text))
    )


def trace_path(root: Path, session_id: str, n: int = 1) -> Path:
    return root / "sessions" / session_id / trace_file_name(n)


def seqs(path: Path) -> list[int | None]:
    result = read_trace(path)
    assert result.errors == []
    return [r.seq for r in result.records]


@asynccontextmanager
async def running_sink(data_dir: Path, disk: Disk = DISK) -> AsyncIterator[TraceSink]:
    sink = TraceSink(data_dir, disk=disk)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        yield sink
        await sink.aclose()


@pytest.fixture
def disk() -> FaultyDisk:
    return FaultyDisk()


@pytest.fixture
def fsynced(disk: FaultyDisk) -> list[Path]:
    """The path of every file and directory the sink fsyncs through ``disk``, in order."""
    return disk.fsynced


async def test_ready_means_ledger_open(tmp_path: Path) -> None:
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path / "home") as sink:
            assert sink.ledger_path == tmp_path / "home" / "usage.sqlite"
            assert sink.ledger_path.exists()


async def test_write_then_sync_is_on_disk_and_fsynced(
    tmp_path: Path, disk: FaultyDisk, fsynced: list[Path]
) -> None:
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            for seq in range(1, 4):
                sink.write(path, line(seq))
            await sink.sync(path)
            assert seqs(path) == [1, 2, 3]
            assert path in fsynced
            # The new file's directory entry (and the new session directories) are synced too.
            assert path.parent in fsynced


async def test_nothing_pending_returns_at_once(
    tmp_path: Path, disk: FaultyDisk, fsynced: list[Path]
) -> None:
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            await sink.sync(path)
            await sink.sync()
            assert sink.batches_written == 0
            sink.write(path, line(1))
            await sink.sync(path)
            batches = sink.batches_written
            await sink.sync(path)
            await sink.sync()
            assert sink.batches_written == batches
            assert not path.with_name("other").exists()


async def test_unsynced_lines_are_written_with_the_next_batch(
    tmp_path: Path, disk: FaultyDisk, fsynced: list[Path]
) -> None:
    quiet, busy = trace_path(tmp_path, "quiet"), trace_path(tmp_path, "busy")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            sink.write(quiet, line(1))
            sink.write(busy, line(1))
            await sink.sync(busy)
            # Nobody synced `quiet`, yet its line went out with the batch: lines never wait
            # for a sync. It was not fsynced, though: that is what sync is for.
            assert seqs(quiet) == [1]
            assert quiet not in fsynced
            await sink.sync(quiet)
            assert quiet in fsynced
            # The same with files that exist already (no new directory entries involved).
            fsynced.clear()
            sink.write(quiet, line(2))
            sink.write(busy, line(2))
            await sink.sync(busy)
            assert seqs(quiet) == [1, 2]
            assert fsynced == [busy]
            await sink.sync(quiet)
            assert fsynced == [busy, quiet]


async def test_concurrent_syncs_share_batches(tmp_path: Path) -> None:
    writers, files, per_writer = 200, 20, 3
    paths = [trace_path(tmp_path, f"s{i}") for i in range(files)]
    next_seq = dict.fromkeys(paths, 0)

    async def writer(i: int, sink: TraceSink) -> None:
        path = paths[i % files]
        for _ in range(per_writer):
            next_seq[path] += 1
            sink.write(path, line(next_seq[path], text=f"writer {i}"))
        await sink.sync(path)
        # Durable means on disk now, whatever the others do afterwards.
        assert f"writer {i}" in path.read_text()

    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink, trio.open_nursery() as nursery:
            for i in range(writers):
                nursery.start_soon(writer, i, sink)
    for path in paths:
        assert seqs(path) == list(range(1, writers // files * per_writer + 1))
    # Group commit: 200 syncs rode on a handful of worker-thread batches, not 200.
    assert 1 <= sink.batches_written <= 10, sink.batches_written


async def test_syncs_arriving_during_a_batch_share_the_next_one(tmp_path: Path) -> None:
    paths = [trace_path(tmp_path, f"s{i}") for i in range(50)]
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            sink.write(paths[0], line(1))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sink.sync, paths[0])
                # Let the first batch be taken, then pile up writers behind it.
                await trio.testing.wait_all_tasks_blocked()
                for path in paths[1:]:
                    sink.write(path, line(1))
                    nursery.start_soon(sink.sync, path)
            assert sink.batches_written <= 3
            for path in paths:
                assert seqs(path) == [1]


async def test_usage_rows_land_in_sqlite(tmp_path: Path) -> None:
    def usage_output(session_id: str, turn: int, usage: TokenUsage) -> TokenUsageOutput:
        return TokenUsageOutput(session_id=session_id, run_id="r1", seq=turn, turn=turn,
                                request=usage)

    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            for turn in (1, 2):
                sink.record_usage(
                    UsageRow.for_request(
                        usage_output("a", turn, TokenUsage(input=100, output=10, cache_read=5)),
                        at=1000.0 + turn,
                        provider="scripted",
                        model="m",
                    )
                )
            sink.record_usage(
                UsageRow(at=1003.0, session_id="a", run_id="r1", turn=None,
                         kind="compaction_failed", provider="scripted", model="m",
                         status="failed", error_message="empty summary")
            )
            sink.record_usage(
                UsageRow(at=1004.0, session_id="b", run_id=None, turn=None, kind="title",
                         provider="scripted", model="m", usage=TokenUsage(input=7, output=3))
            )
            await sink.sync()
            totals = usage_totals(sink.ledger_path)
            assert totals == {
                "a": {"input": 200, "output": 20, "cache_read": 10, "cache_write": 0,
                      "total": 230, "requests": 2, "compaction_failures": 1, "titles": 0},
                "b": {"input": 7, "output": 3, "cache_read": 0, "cache_write": 0,
                      "total": 10, "requests": 0, "compaction_failures": 0, "titles": 1},
            }
            assert usage_totals(sink.ledger_path, session_id="b") == {"b": totals["b"]}
            assert usage_totals(sink.ledger_path, session_id="zzz") == {}
    with sqlite3.connect(sink.ledger_path) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(usage)")]
        failed = conn.execute(
            "SELECT kind, status, error_message, turn FROM usage WHERE kind != 'request'"
            " ORDER BY id"
        ).fetchall()
    assert columns == ["id", "at", "session_id", "run_id", "turn", "kind", "provider", "model",
                       "input", "output", "cache_read", "cache_write", "total", "status",
                       "error_message", "cost_usd", "principal", "root_id", "request_key",
                       "estimated"]
    assert failed == [("compaction_failed", "failed", "empty summary", None),
                      ("title", None, None, None)]
    assert usage_totals(tmp_path / "missing.sqlite") == {}


OLD_LEDGER_COLUMNS = """
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, session_id TEXT NOT NULL,
    run_id TEXT, turn INTEGER, kind TEXT NOT NULL, provider TEXT NOT NULL, model TEXT NOT NULL,
    input INTEGER NOT NULL DEFAULT 0, output INTEGER NOT NULL DEFAULT 0,
    cache_read INTEGER NOT NULL DEFAULT 0, cache_write INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0, status TEXT, error_message TEXT"""
"""The ledger's columns before costs were recorded."""


def write_old_ledger(ledger: Path, row: str, *later_columns: str) -> None:
    """Write a ledger as an older greenroom left it: the table ``usage`` with the columns it
    had before costs, then ``later_columns`` (those it had of the ones added since), and the
    one row the INSERT statement ``row`` adds."""
    columns = ", ".join((OLD_LEDGER_COLUMNS, *later_columns))
    with sqlite3.connect(ledger) as conn:
        conn.execute(f"CREATE TABLE usage ({columns}\n)")
        conn.execute(row)
    conn.close()


async def test_a_ledger_from_before_costs_is_read_and_migrated(tmp_path: Path) -> None:
    """R-SHARE-3: a ledger written before costs were recorded reads as rows of unknown
    cost (read-only, unchanged), and the sink that opens it adds the new columns: its old
    rows keep no cost, new rows carry theirs."""
    ledger = tmp_path / LEDGER_FILE_NAME
    write_old_ledger(
        ledger,
        "INSERT INTO usage (at, session_id, kind, provider, model, input, output, total)"
        " VALUES (10.0, 'old', 'request', 'anthropic', 'claude-sonnet-4-5', 1000, 100, 1100)",
    )
    before = usage_report(ledger, UsageQuery(by="principal"))
    assert before == [UsageLine(key=None, requests=1, input=1000, output=100, total=1100,
                                unpriced=1)]  # fmt: skip
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            new = UsageRow(at=20.0, session_id="new", run_id="r1", turn=1, kind="request",
                           provider="anthropic", model="claude-sonnet-4-5",
                           usage=TokenUsage(input=1000, output=1, cost_usd=0.003015),
                           status="started", principal="alice", root_id="new",
                           request_key="k")  # fmt: skip
            sink.record_usage(new)
            await sink.sync()
            # The request's last row replaces its first in the migrated ledger too.
            usage = TokenUsage(input=1000, output=100, cost_usd=0.0045)
            sink.record_usage(attrs.evolve(new, usage=usage, status="ok"))
            await sink.sync()
    after = usage_report(ledger, UsageQuery())
    assert [(line.key, line.cost_usd, line.unpriced) for line in after] == [
        ("new", 0.0045, 0), ("old", 0.0, 1)
    ]
    alice = usage_report(ledger, UsageQuery(by=None, principal="alice", since=15.0))
    assert (alice[0].requests, alice[0].cost_usd) == (1, 0.0045)
    assert usage_report(tmp_path / "missing.sqlite", UsageQuery()) == []


async def test_aclose_flushes_unsynced_lines_and_rows(
    tmp_path: Path, disk: FaultyDisk, fsynced: list[Path]
) -> None:
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            for seq in range(1, 6):
                sink.write(path, line(seq))
            sink.record_usage(UsageRow(at=1.0, session_id="s1", run_id="r1", turn=1,
                                       kind="request", provider="p", model="m",
                                       usage=TokenUsage(input=1)))
            await sink.aclose()
            assert sink.closed
    assert seqs(path) == [1, 2, 3, 4, 5]
    assert path in fsynced
    assert usage_totals(sink.ledger_path)["s1"]["input"] == 1


async def test_cancelling_run_flushes_unsynced_lines(
    tmp_path: Path, disk: FaultyDisk, fsynced: list[Path]
) -> None:
    path = trace_path(tmp_path, "s1")
    sink = TraceSink(tmp_path, disk=disk)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            sink.write(path, line(1))
            await sink.sync(path)
            sink.write(path, line(2))
            sink.write(path, line(3))
            nursery.cancel_scope.cancel()
    assert seqs(path) == [1, 2, 3]
    assert fsynced.count(path) >= 2
    with pytest.raises(TraceSinkClosed):
        sink.write(path, line(4))


async def test_a_sync_asked_as_the_actor_is_cancelled_is_answered(
    tmp_path: Path, disk: FaultyDisk, fsynced: list[Path]
) -> None:
    """R-TRACE-2: the actor, waiting for its inbox, is cancelled with its host, and before
    it runs again a session closing (shielded) asks for a sync. The actor's last batch
    serves it: the sync returns, its line on disk. Before, the request went with the
    inbox and the sync waited for ever (a cluster host's shutdown hung on it)."""
    path = trace_path(tmp_path, "s1")
    sink = TraceSink(tmp_path, disk=disk)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
        sink.write(path, line(1))
        with trio.CancelScope(shield=True), trio.fail_after(TIMEOUT):
            await sink.sync(path)
    assert seqs(path) == [1]
    assert path in fsynced


async def test_write_after_close_raises(tmp_path: Path) -> None:
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            sink.write(path, line(1))
        with pytest.raises(TraceSinkClosed, match="closed"):
            sink.write(path, line(2))
        with pytest.raises(TraceSinkClosed):
            sink.record_usage(UsageRow(at=1.0, session_id="s1", run_id=None, turn=None,
                                       kind="title", provider="p", model="m"))
        # R-TRACE-2 is a checked promise: after close no barrier can be kept, so none is
        # pretended (a side-effecting tool waiting on it must not start).
        with pytest.raises(TraceSinkClosed):
            await sink.sync(path)
        with pytest.raises(TraceSinkClosed):
            await sink.sync()
        await sink.aclose()
    assert seqs(path) == [1]


async def test_a_row_the_ledger_refuses_fails_the_ledger_only(tmp_path: Path) -> None:
    """R-SEC-1, R-TRACE-5: a usage row SQLite cannot store (a token count past 64 bits, as a
    model server may send) fails the ledger; the trace file synced in the same batch is
    durable, and the writer goes on."""
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            sink.write(path, line(1))
            sink.record_usage(UsageRow(at=1.0, session_id="s1", run_id="r1", turn=1,
                                       kind="request", provider="p", model="m",
                                       usage=TokenUsage(input=2**70)))
            await sink.sync(path)
            with pytest.raises(TraceWriteError) as info:
                await sink.sync()
            assert info.value.path == sink.ledger_path
            assert set(sink.errors) == {sink.ledger_path}
            sink.write(path, line(2))
            await sink.sync(path)
    assert seqs(path) == [1, 2]


async def test_a_failing_file_does_not_stop_the_others(tmp_path: Path) -> None:
    blocker = tmp_path / "sessions" / "bad"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where a session directory should be")
    bad, good = blocker / trace_file_name(1), trace_path(tmp_path, "good")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            sink.write(bad, line(1, "bad"))
            sink.write(good, line(1, "good"))
            with pytest.raises(TraceWriteError) as info:
                await sink.sync(bad)
            assert info.value.path == bad
            assert str(bad) in str(info.value)
            await sink.sync(good)
            assert seqs(good) == [1]
            # Lines were lost, so the error sticks until acknowledged, also for sync().
            with pytest.raises(TraceWriteError):
                await sink.sync(bad)
            with pytest.raises(TraceWriteError):
                await sink.sync()
            assert set(sink.errors) == {bad}
            sink.clear_error(bad)
            await sink.sync(bad)
            await sink.sync()
            sink.write(good, line(2, "good"))
            await sink.sync(good)
    assert seqs(good) == [1, 2]


async def test_torn_tail_is_terminated_before_appending(tmp_path: Path) -> None:
    path = trace_path(tmp_path, "s1")
    path.parent.mkdir(parents=True)
    torn = line(2)[:10]
    path.write_text(line(1) + torn)  # a crash cut the second record short
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            sink.write(path, line(3))
            await sink.sync(path)
    result = read_trace(path)
    assert [r.seq for r in result.records] == [1, 3]
    assert [e.line for e in result.errors] == [2]
    assert path.read_text().splitlines()[1] == torn


async def test_sync_waiters_that_are_cancelled_leave_the_sink_working(tmp_path: Path) -> None:
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            sink.write(path, line(1))
            with trio.CancelScope() as scope:
                scope.cancel()
                await sink.sync(path)
            sink.write(path, line(2))
            await sink.sync(path)
    assert seqs(path) == [1, 2]


def test_latest_trace_file(tmp_path: Path) -> None:
    assert latest_trace_file(tmp_path / "missing") is None
    assert latest_trace_file(tmp_path) is None
    for n in (1, 2, 10):
        (tmp_path / trace_file_name(n)).write_text("")
    (tmp_path / "trace_999.jsonl.tmp").write_text("")
    (tmp_path / "notes.txt").write_text("")
    assert latest_trace_file(tmp_path) == tmp_path / "trace_010.jsonl"


async def test_a_released_file_is_still_made_durable_when_it_has_unsynced_lines(
    tmp_path: Path, disk: FaultyDisk, fsynced: list[Path]
) -> None:
    """Releasing a closed session's file forgets it only once nothing of it is pending:
    committed lines that were never fsynced are still fsynced at close."""
    synced, pending = trace_path(tmp_path, "synced"), trace_path(tmp_path, "pending")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            sink.write(synced, line(1))
            await sink.sync(synced)
            sink.write(pending, line(1))
            sink.commit(pending)
            sink.release(synced)
            sink.release(pending)
            fsynced.clear()
    assert fsynced.count(pending) == 1
    assert synced not in fsynced
    assert seqs(pending) == [1]


class CountingDisk(FaultyDisk):
    """A :class:`FaultyDisk` that sets ``reached`` once ``target`` fsyncs are done."""

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target
        self.reached = threading.Event()

    def fsync(self, path: Path) -> None:
        super().fsync(path)
        if len(self.fsynced) >= self.target:
            self.reached.set()


async def test_one_batch_fsyncs_its_files_at_once(tmp_path: Path) -> None:
    """A thousand sessions at a turn boundary are one batch: its fsyncs overlap (up to
    SYNC_THREADS at once, each thread taking the batch's next file), so one slow file
    holds back one thread, not the other files."""
    paths = [trace_path(tmp_path, f"s{i}") for i in range(20)]
    assert SYNC_THREADS > 1
    disk = CountingDisk(target=len(paths) - 1)
    disk.stall(paths[0])
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            for path in paths:
                sink.write(path, line(1, path.parent.name))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sink.sync)
                # Every file outside the stalled thread's share is fsynced while it waits.
                assert await trio.to_thread.run_sync(disk.reached.wait, TIMEOUT)
                assert disk.stalled.is_set() and paths[0] not in disk.fsynced
                disk.release()
            assert sink.batches_written == 1
    assert set(paths) <= set(disk.fsynced)


async def test_a_directory_is_fsynced_once_for_all_its_new_files(tmp_path: Path) -> None:
    folder = tmp_path / "sessions" / "shared"
    paths = [folder / trace_file_name(n) for n in range(1, 21)]
    disk = FaultyDisk()
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            for path in paths:
                sink.write(path, line(1))
            await sink.sync()
    assert set(paths) <= set(disk.fsynced)
    # Each new file's entry is durable once its directory is fsynced after it was made:
    # they were all made before the batch began, so one fsync of it covers them all.
    assert disk.fsynced.count(folder) == 1


@asynccontextmanager
async def syncing_each(
    sink: TraceSink, paths: list[Path], sync: Callable[[TraceSink, Path], Awaitable[None]]
) -> AsyncIterator[None]:
    """Each of ``paths`` gets its first line, all in one batch, and ``sync`` of each runs
    in a task of its own; on leaving, every one of them has returned."""
    for path in paths:
        sink.write(path, line(1, path.parent.name))
    async with trio.open_nursery() as nursery:
        for path in paths:
            nursery.start_soon(sync, sink, path)
        yield


async def test_a_sync_is_answered_once_its_own_files_are_durable(tmp_path: Path) -> None:
    """A thousand sessions reach a turn boundary in one batch; each goes on once its own
    files are durable, not once the whole batch is: a stalled fsync holds back only the
    sync that needs it (R-TRACE-2, R-PERF-1)."""
    paths = [trace_path(tmp_path, f"s{i}") for i in range(20)]
    disk = FaultyDisk()
    disk.stall(paths[0])
    answered: list[Path] = []
    others_answered = trio.Event()

    async def sync(sink: TraceSink, path: Path) -> None:
        await sink.sync(path)
        answered.append(path)
        if len(answered) == len(paths) - 1:
            others_answered.set()

    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            async with syncing_each(sink, paths, sync):
                await others_answered.wait()
                # Its file is not durable yet: the stalled file's sync still waits.
                assert paths[0] not in answered
                disk.release()
            assert answered[-1] == paths[0]
            assert sink.batches_written == 1
    for path in paths:
        assert seqs(path) == [1]


async def test_a_writer_bug_in_a_batch_answers_only_the_syncs_not_answered_early(
    tmp_path: Path,
) -> None:
    """A bug below the writer (an fsync raising what the disk never refuses with) stops
    the actor; the syncs of its batch already answered, their files durable, keep their
    answer, and only the others are told of the failure: a second answer would not fit
    their one-slot channels and would end the host (R-TRACE-2, R-SEC-1)."""
    paths = [trace_path(tmp_path, f"s{i}") for i in range(20)]
    disk = FaultyDisk()
    disk.break_writer(paths[-1])
    durable: list[Path] = []
    failed: list[Path] = []

    async def sync(sink: TraceSink, path: Path) -> None:
        try:
            await sink.sync(path)
        except (TraceWriteError, TraceSinkClosed):
            failed.append(path)
        else:
            durable.append(path)

    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink, syncing_each(sink, paths, sync):
            pass  # every sync returns, answered or told of the failure
    assert failed == [paths[-1]]
    assert sorted(durable) == sorted(paths[:-1])


# -- files kept open between commits ---------------------------------------------------------


def commit_each(sink: TraceSink, paths: tuple[Path, ...], seqs: tuple[int, ...]) -> None:
    """Write and commit records ``seqs`` to each of ``paths``, file by file (the session
    of a file is its directory's name)."""
    for path in paths:
        for seq in seqs:
            sink.write(path, line(seq, path.parent.name))
            sink.commit(path)


async def test_a_file_stays_open_between_its_commits_until_its_session_closes(
    tmp_path: Path, disk: FaultyDisk
) -> None:
    """A commit to a file the sink wrote last goes through the descriptor the previous one
    kept; releasing the file (its session closed, or moved to its next file) closes it,
    and its lines are still made durable."""
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            sink.write(path, line(1))
            sink.commit(path)  # creates the file: opened and closed
            assert disk.appending == {}
            kept: set[int] = set()
            for seq in range(2, 6):
                sink.write(path, line(seq))
                sink.commit(path)
                assert list(disk.appending.values()) == [path]
                kept |= set(disk.appending)
            assert len(kept) == 1  # one descriptor for the four commits
            sink.write(path, line(6))
            sink.release(path)  # its last line written, unsynced: the file stays known
            assert disk.appending == {}
            assert seqs(path) == [1, 2, 3, 4, 5, 6]
            await sink.sync(path)
            assert disk.appending == {}
    assert seqs(path) == [1, 2, 3, 4, 5, 6]
    assert path in disk.fsynced


async def test_a_deleted_sessions_file_and_a_closing_sink_leave_no_descriptor(
    tmp_path: Path, disk: FaultyDisk
) -> None:
    gone, other = trace_path(tmp_path, "gone"), trace_path(tmp_path, "other")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            commit_each(sink, (gone, other), (1, 2))
            assert sorted(disk.appending.values()) == sorted([gone, other])
            await sink.sync(gone)
            sink.forget(gone)
            assert list(disk.appending.values()) == [other]
            sink.write(other, line(3, "other"))
            sink.commit(other)
        assert disk.appending == {}
    assert seqs(other) == [1, 2, 3]


async def test_the_sink_keeps_at_most_its_bound_of_files_open(
    tmp_path: Path, disk: FaultyDisk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound the least recently written file is closed; every line still lands,
    in order, its file reopened when written again."""
    monkeypatch.setattr(trace_sink, "most_open_trace_files", lambda: 2)
    paths = [trace_path(tmp_path, f"s{i}") for i in range(5)]
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            for seq in (1, 2, 3):
                for path in paths:
                    sink.write(path, line(seq, path.parent.name))
                    sink.commit(path)
                    assert len(disk.appending) <= 2
            assert sorted(disk.appending.values()) == sorted(paths[-2:])
            await sink.sync()
    for path in paths:
        assert seqs(path) == [1, 2, 3]


async def test_with_no_bound_to_read_every_append_opens_its_file(
    tmp_path: Path, disk: FaultyDisk, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_sink, "most_open_trace_files", lambda: 0)
    path = trace_path(tmp_path, "s1")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            for seq in (1, 2, 3):
                sink.write(path, line(seq))
                sink.commit(path)
                assert disk.appending == {}
            await sink.sync(path)
    assert seqs(path) == [1, 2, 3]


async def test_a_close_the_file_system_fails_is_that_files_failure(
    tmp_path: Path, disk: FaultyDisk
) -> None:
    """A network file system may report a write it could not make only when the file is
    closed: once the kept descriptor is closed, the file's syncs report it, as its
    append's failure would have been; the other files go on."""
    bad, good = trace_path(tmp_path, "bad"), trace_path(tmp_path, "good")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            commit_each(sink, (bad, good), (1, 2))
            disk.fail_close(bad)
            await sink.sync()  # nothing failed yet: the descriptor is still open
            sink.write(bad, line(3, "bad"))
            sink.release(bad)
            assert list(disk.appending.values()) == [good]
            with pytest.raises(TraceWriteError) as info:
                await sink.sync(bad)
            assert info.value.path == bad
            assert "Input/output error" in str(info.value)
            await sink.sync(good)
            assert set(sink.errors) == {bad}


async def test_a_file_removed_or_replaced_under_its_descriptor_gets_its_later_lines(
    tmp_path: Path, disk: FaultyDisk
) -> None:
    """A file whose descriptor the sink keeps may lose its name behind the sink's back: its
    directory removed (a delete that never told the sink), or the file written again by
    another hand (a takeover rebuilding a trace). The next lines go to the file the path
    names now — created again, or the new one — and its sync makes them durable; through
    the kept descriptor they went to a file nobody could read, and the sync said durable."""
    removed, replaced = trace_path(tmp_path, "removed"), trace_path(tmp_path, "replaced")
    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path, disk) as sink:
            commit_each(sink, (removed, replaced), (1, 2))
            assert sorted(disk.appending.values()) == sorted([removed, replaced])
            shutil.rmtree(removed.parent)
            replaced.unlink()
            replaced.write_bytes((line(1, "replaced") + line(2, "replaced")).encode())
            commit_each(sink, (removed, replaced), (3,))
            disk.fsynced.clear()
            await sink.sync()
            assert seqs(removed) == [3]
            assert seqs(replaced) == [1, 2, 3]
            assert {removed, replaced} <= set(disk.fsynced)
            assert sorted(disk.appending.values()) == [replaced]  # the new file's, kept
    assert disk.appending == {}


async def test_a_sink_closed_before_it_ran_leaves_no_descriptor(
    tmp_path: Path, disk: FaultyDisk
) -> None:
    """Commits need no running actor; a sink closed before it ever ran closes the
    descriptors they kept."""
    path = trace_path(tmp_path, "s1")
    sink = TraceSink(tmp_path, disk=disk)
    commit_each(sink, (path,), (1, 2))
    assert list(disk.appending.values()) == [path]
    await sink.aclose()
    assert disk.appending == {}
    assert seqs(path) == [1, 2]


def test_the_bound_is_an_eighth_of_the_open_files_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    def limit(soft: int) -> None:
        monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, resource.RLIM_INFINITY))

    limit(1024)
    assert most_open_trace_files() == 128
    limit(20_000)
    assert most_open_trace_files() == 2_500
    limit(10**6)
    assert most_open_trace_files() == MOST_OPEN_TRACE_FILES
    limit(resource.RLIM_INFINITY)
    assert most_open_trace_files() == MOST_OPEN_TRACE_FILES
    limit(7)
    assert most_open_trace_files() == 0


async def test_a_row_with_a_requests_key_replaces_the_one_written_as_it_started(
    tmp_path: Path,
) -> None:
    """R-TRACE-5, R-SHARE-3: one row a request. The row written as a stream began (its
    input so far) is replaced by the request's last one, in the same batch or a later one;
    rows without a key are rows of their own, and another request's key is another row."""

    def row(key: str | None, status: str, usage: TokenUsage) -> UsageRow:
        return UsageRow(at=1.0, session_id="s1", run_id="r1", turn=1, kind="request",
                        provider="p", model="m", usage=usage, status=status, request_key=key)

    with trio.fail_after(TIMEOUT):
        async with running_sink(tmp_path) as sink:
            sink.record_usage(row("a", "started", TokenUsage(input=100, output=1)))
            sink.record_usage(row(None, "ok", TokenUsage(input=7, output=3)))
            sink.record_usage(row("b", "started", TokenUsage(input=50, output=1)))
            await sink.sync()
            sink.record_usage(row("a", "ok", TokenUsage(input=100, output=40)))
            sink.record_usage(row("c", "started", TokenUsage(input=9)))
            sink.record_usage(row("c", "error", TokenUsage(input=9, output=2)))
            await sink.sync()
    conn = sqlite3.connect(tmp_path / LEDGER_FILE_NAME)
    try:
        rows = conn.execute(
            "SELECT request_key, status, input, output FROM usage ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    assert rows == [
        ("a", "ok", 100, 40),
        (None, "ok", 7, 3),
        ("b", "started", 50, 1),  # a request whose host died mid-stream: counted as it began
        ("c", "error", 9, 2),
    ]
    totals = usage_totals(tmp_path / LEDGER_FILE_NAME)
    assert totals["s1"]["requests"] == 4
    assert (totals["s1"]["input"], totals["s1"]["output"]) == (166, 46)


async def test_rows_of_requests_just_started_wait_a_little_to_share_a_commit(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Each batch commits the ledger (an fsync): rows written as requests' streams began
    wait up to STARTED_ROWS_WAIT_S for company, and share one batch; a sync or a row of
    any other kind ends the wait at once (on a clock that stands still here). Worker
    threads run for real; a batch is counted as it begins."""

    def row(n: int, status: str) -> UsageRow:
        return UsageRow(at=1.0, session_id="s1", run_id="r1", turn=n, kind="request",
                        provider="p", model="m", usage=TokenUsage(input=n), status=status,
                        request_key=f"k{n}")  # fmt: skip

    async with running_sink(tmp_path) as sink:
        await trio.testing.wait_all_tasks_blocked()
        before = sink.batches_written
        for n in (1, 2, 3):
            sink.record_usage(row(n, STARTED))
        await trio.testing.wait_all_tasks_blocked()
        assert sink.batches_written == before  # waiting for company
        mock_clock.jump(STARTED_ROWS_WAIT_S)
        await trio.testing.wait_all_tasks_blocked()
        assert sink.batches_written == before + 1  # the three, in one batch
        await sink.flush_usage()  # nothing left to write: no batch
        for n in (4, 5):
            sink.record_usage(row(n, STARTED))
        await trio.testing.wait_all_tasks_blocked()
        assert sink.batches_written == before + 1
        sink.record_usage(row(1, "ok"))  # a request's end: no waiting
        await trio.testing.wait_all_tasks_blocked()
        assert sink.batches_written == before + 2
        await sink.flush_usage()
        assert sink.batches_written == before + 2
    conn = sqlite3.connect(tmp_path / LEDGER_FILE_NAME)
    try:
        rows = conn.execute("SELECT turn, status FROM usage ORDER BY id").fetchall()
    finally:
        conn.close()
    assert rows == [(1, "ok"), (2, STARTED), (3, STARTED), (4, STARTED), (5, STARTED)]
