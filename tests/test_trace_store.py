"""The trace-store seam (R-TRACE, R-CLUSTER-1): a host runs, reloads and replays sessions on
any :class:`TraceStore`, and appends are fenced by ``seq``.

``MemoryTraceStore`` (``tests/support/memory_store.py``) is a second backend written
against the interfaces alone: it keeps records in memory and acknowledges appends only when
the test says so (as a networked store would, later than the append), so these tests show
that the actors need nothing of the file backend and publish nothing before its record is
stored (R-TRACE-3). The contracts each backend keeps are ``tests/test_store_conformance.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import Gates, allow_all, collect, types

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.runtime.trace_store import (
    FileTraceStore,
    StaleTraceWriter,
    StoredSessionMissing,
    TraceStore,
)
from greenroom.protocols.converter import output_from_dict
from greenroom.protocols.outputs import Output, TaskEnd, UserMsg
from greenroom.protocols.tools import tool
from tests.support.memory_store import MemoryTraceStore


def _is_store(store: TraceStore) -> TraceStore:
    return store


@tool
async def lookup(key: str) -> str:
    """Look up a key."""
    return f"value of {key}"


def _script() -> ScriptedProvider:
    return ScriptedProvider(
        [
            Reply(blocks=(tool_call("c1", "lookup", key="k"),), stop_reason="tool_use"),
            Reply(blocks=(text("done"),)),
        ]
    )


async def test_a_host_runs_reloads_and_replays_on_another_backend(tmp_path: Path) -> None:
    stores: list[MemoryTraceStore] = []

    def factory(data_dir: Path) -> TraceStore:
        stores.append(MemoryTraceStore(data_dir))
        return _is_store(stores[-1])

    data_dir = tmp_path / "data"
    async with Host.open(data_dir, trace_store=factory) as host:
        session = await host.create_session(
            provider=_script(), tools=[lookup], workspace_dir=tmp_path
        )
        outputs = await collect(session.run("look it up", approve=allow_all))
        assert types(outputs)[-1] == "task_end"
        store = stores[0]
        stored = [output_from_dict(_json(line)) for line in store.log.traces[session.id][0]]
        traced = [o for o in outputs if o.seq is not None]
        assert [o.seq for o in stored] == [o.seq for o in traced] == list(
            range(1, len(traced) + 1)
        )
        rows = store.ledger.rows
        assert rows and {row.session_id for row in rows} == {session.id}
        assert store.log.syncs > 0  # R-TRACE-2 reached the backend
        replay = await store.log.read_after(session.id, after_seq=3)
        assert [o.seq for o in replay] == [o.seq for o in traced if o.seq > 3]
        assert [s.session_id for s in await host.list_sessions()] == [session.id]
        await host.close_session(session.id)
        assert store.log.released == [session.id]  # the host forgets what it closed

        again = await host.load_session(session.id, provider=ScriptedProvider([Reply(
            blocks=(text("still here"),))]))
        more = await collect(again.run("again", approve=allow_all))
        assert more[0].seq == len(traced) + 1  # seq goes on after the stored records
        assert isinstance(more[-1], TaskEnd) and more[-1].status == "completed"
    # No trace file was written: the data dir holds only what the store chose to keep.
    assert not list(data_dir.glob("sessions/*/trace_*.jsonl"))


async def test_outputs_wait_for_the_backend_to_store_them(tmp_path: Path) -> None:
    """R-TRACE-3 through the seam: a store that acknowledges late holds publication."""
    store = MemoryTraceStore(tmp_path, auto_ack=False)
    async with Host.open(tmp_path / "data", trace_store=lambda _: store) as host:
        session = await host.create_session(
            provider=ScriptedProvider([Reply(blocks=(text("hi"),))]), workspace_dir=tmp_path
        )
        seen: list[Output] = []
        session.subscribe(seen.extend)
        stream = session.run("hello", approve=allow_all)
        await trio.testing.wait_all_tasks_blocked()
        assert store.log.pending  # the records are appended …
        assert not [o for o in seen if o.seq is not None]  # … and nothing traced is out yet
        store.log.auto_ack = True
        store.log.acknowledge()
        outputs = await collect(stream)
        assert [o.seq for o in seen if o.seq is not None] == [
            o.seq for o in outputs if o.seq is not None
        ]
        assert isinstance(outputs[-1], TaskEnd)
        assert isinstance(outputs[0], UserMsg)


async def test_queued_input_a_late_store_has_not_stored_as_its_host_is_cancelled_settles(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """R-STEER-1, R-HOST-3 through the seam: steering whose record a store that
    acknowledges late has not stored when its host is cancelled settles once the store
    is done with it (here as the host closes the store, which stores it), by the time the
    host is gone. Before, its supervisor's teardown, done waiting for the store, forgot
    the receipt with the batches it published unwritten: it never settled, and the
    gateway answered only after its whole 10 s."""
    gates = Gates()
    store = MemoryTraceStore(tmp_path)
    recorded = InputReceipt()
    provider = ScriptedProvider([Reply(blocks=(tool_call("c1", "wait", key="k"),))])
    hosting = trio.CancelScope()

    async def host_until_cancelled(*, task_status: trio.TaskStatus[Host]) -> None:
        with hosting:
            async with Host.open(tmp_path / "data", trace_store=lambda _: store) as opened:
                task_status.started(opened)
                await trio.sleep_forever()

    # No fail_after on the autojump clock: the host's worker threads leave the run loop
    # idle, and the clock would jump to it (see conftest.collect). The host's own bounds
    # end it: its supervisor's wait for the store (ABORT_GRACE_S), then the session's
    # close (SHUTDOWN_GRACE_S), after which the host closes the store, which stores all.
    async with trio.open_nursery() as nursery:
        host: Host = await nursery.start(host_until_cancelled)
        session = await host.create_session(
            provider=provider, workspace_dir=tmp_path, tools=[gates.tool()]
        )
        session.run("go", approve=allow_all)
        await gates.started("k")
        store.log.auto_ack = False
        assert session.steer("mind the gap", recorded=recorded)
        await trio.testing.wait_all_tasks_blocked()
        assert store.log.pending and not recorded.settled.is_set()  # written, not stored
        hosting.cancel()
    assert recorded.settled.is_set()
    assert recorded.dropped is None
    assert "mind the gap" in "".join(store.log.traces[session.id][-1])


async def test_the_file_store_refuses_a_record_it_already_holds(tmp_path: Path) -> None:
    """The fence (R-CLUSTER-1) in the default backend: a stale ``seq`` is refused, the
    record is not written, later records go on."""
    async with trio.open_nursery() as nursery:
        store = FileTraceStore(tmp_path)
        log = store.log
        await nursery.start(store.run)
        await store.catalog.create("s1", {"session_id": "s1"})
        log.start("s1")
        first = UserMsg(session_id="s1", run_id="r", seq=1, kind="prompt", content=())
        log.append("s1", 1, _line(first))
        with pytest.raises(StaleTraceWriter, match="seq 1"):
            log.append("s1", 1, _line(first))
        log.append("s1", 2, _line(UserMsg(session_id="s1", run_id="r", seq=2,
                                         kind="prompt", content=())))
        await log.sync("s1")
        loaded = await log.load("s1")
        assert [r.seq for r in loaded.records] == [1, 2] and loaded.last_seq == 2
        with pytest.raises(StaleTraceWriter):
            log.append("s1", 2, _line(first))
        assert log.location("s1") == tmp_path / "sessions" / "s1" / "trace_001.jsonl"
        assert log.rotate("s1") == "trace_002.jsonl"
        log.append("s1", 3, _line(UserMsg(session_id="s1", run_id="r", seq=3,
                                         kind="prompt", content=())))
        await log.sync("s1")
        assert [r.seq for r in await log.read_after("s1", 1)] == [2, 3]
        with pytest.raises(StoredSessionMissing):
            await store.catalog.read_meta("nobody")
        await log.sync("s1")
        log.release("s1")  # closed: only the files remain, and where they are
        assert log.location("s1") == tmp_path / "sessions" / "s1" / "trace_002.jsonl"
        with pytest.raises(KeyError):
            log.append("s1", 4, _line(first))
        assert (await log.load("s1")).last_seq == 3
        await store.aclose()


def _line(output: Output) -> str:
    from greenroom.protocols.trace import encode_record

    return encode_record(output)


def _json(line: str) -> dict[str, Any]:
    import json

    value: dict[str, Any] = json.loads(line)
    return value


async def test_a_sync_asked_after_its_session_was_released_makes_its_file_durable(
    tmp_path: Path,
) -> None:
    """A receipt's sync may start once its session was closed (released): it makes the
    session's last file durable, as it was asked to, rather than fail for a session the
    store no longer holds (R-STEER-6, R-TRACE-2)."""
    from tests.support.disks import FaultyDisk

    disk = FaultyDisk()
    async with trio.open_nursery() as nursery:
        store = FileTraceStore(tmp_path, disk=disk)
        log = store.log
        await nursery.start(store.run)
        await store.catalog.create("s1", {"session_id": "s1"})
        log.start("s1")
        log.append("s1", 1, _line(UserMsg(session_id="s1", run_id="r", seq=1,
                                         kind="steering", content=())))
        log.release("s1")  # closed with its record written, not yet fsynced
        disk.fsynced.clear()
        await log.sync("s1")
        assert log.location("s1") in disk.fsynced
        assert log.lost("s1", 1) is None
        await store.aclose()


async def test_a_delete_cancelled_in_its_sync_leaves_no_descriptor_to_the_next_session(
    tmp_path: Path,
) -> None:
    """A delete of an open session waits for its file's fsync; cancelled there, it must
    still forget the file in the sink. Else the sink kept its descriptor, a retried
    delete removed the directory, and a new session of the same id wrote its records
    through that descriptor, to the removed file (R-TRACE-2)."""
    from tests.support.disks import FaultyDisk

    disk = FaultyDisk()
    meta = {"session_id": "s1"}
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            store = FileTraceStore(tmp_path, disk=disk)
            log = store.log
            path = store.paths.trace_path("s1", 1)
            await nursery.start(store.run)
            await store.catalog.create("s1", meta)
            log.start("s1")
            for seq in (1, 2):
                log.append("s1", seq, _line(UserMsg(session_id="s1", run_id="r", seq=seq,
                                                   kind="steering", content=())))
                log.commit("s1")
            assert list(disk.appending.values()) == [path]
            disk.stall(path)
            with trio.CancelScope() as deleting:

                async def cancel_once_stalled() -> None:
                    await trio.to_thread.run_sync(disk.stalled.wait)
                    deleting.cancel()

                nursery.start_soon(cancel_once_stalled)
                await store.catalog.delete("s1")
            assert deleting.cancelled_caught
            disk.release()
            assert disk.appending == {}
            await store.catalog.delete("s1")
            assert not path.parent.exists()
            await store.catalog.create("s1", meta)
            log.start("s1")
            log.append("s1", 1, _line(UserMsg(session_id="s1", run_id="r2", seq=1,
                                             kind="steering", content=())))
            log.commit("s1")
            await log.sync("s1")
            assert [r["run_id"] for r in map(json.loads, path.read_text().splitlines())] == [
                "r2"
            ]
            await store.aclose()


async def test_a_created_session_is_durable_before_its_creation_returns(tmp_path: Path) -> None:
    """``session.json`` is fsynced before it takes its name, then the session directory
    and the directories above that are new: a power cut after the creation returned
    leaves the session, whole, whether or not it ever ran."""
    from tests.support.disks import FaultyDisk

    data_dir = tmp_path / "data"
    sessions = data_dir / "sessions"
    disk = FaultyDisk()
    async with trio.open_nursery() as nursery:
        store = FileTraceStore(data_dir, disk=disk)
        await nursery.start(store.run)
        disk.fsyncs.clear()
        await store.catalog.create("s1", {"session_id": "s1"})
        meta = (sessions / "s1" / "session.json").read_bytes()
        written, *entries = disk.fsyncs
        assert written[0].parent == sessions / "s1"
        assert written[0].name.startswith("session.json.") and written[0].suffix == ".tmp"
        assert written[1] == len(meta)  # its content, whole, before its name
        assert [path for path, _ in entries] == [sessions / "s1", sessions, data_dir]
        disk.fsyncs.clear()
        await store.catalog.create("s2", {"session_id": "s2"})
        assert [path for path, _ in disk.fsyncs[1:]] == [sessions / "s2", sessions]
        await store.aclose()


async def test_a_creation_whose_directory_cannot_be_made_durable_leaves_no_session(
    tmp_path: Path,
) -> None:
    from tests.support.disks import FaultyDisk

    disk = FaultyDisk()
    async with trio.open_nursery() as nursery:
        store = FileTraceStore(tmp_path, disk=disk)
        await nursery.start(store.run)
        disk.refuse(tmp_path / "sessions" / "s1", appends=False)
        with pytest.raises(OSError, match="No space left"):
            await store.catalog.create("s1", {"session_id": "s1"})
        assert not await store.catalog.exists("s1")
        disk.mend()
        await store.catalog.create("s1", {"session_id": "s1"})  # the id is free
        assert await store.catalog.exists("s1")
        await store.aclose()
