"""The trace-store seam (R-TRACE, R-CLUSTER-1): a host runs, reloads and replays sessions on
any :class:`TraceStore`, and appends are fenced by ``seq``.

``MemoryTraceStore`` is a second backend written against the interface alone: it keeps
records in memory and acknowledges appends only when the test says so (as a networked
store would, later than the append), so these tests show that the actors need nothing
of the file backend and publish nothing before its record is stored (R-TRACE-3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import allow_all, collect, types

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.trace_sink import TraceSinkClosed, TraceWriteError
from greenroom.actors.runtime.trace_store import (
    FileTraceStore,
    LoadedTrace,
    StaleTraceWriter,
    StoredSessionMissing,
    TraceStore,
)
from greenroom.protocols.converter import output_from_dict
from greenroom.protocols.messages import TraceWritten
from greenroom.protocols.outputs import Output, TaskEnd, UserMsg
from greenroom.protocols.tools import tool
from greenroom.protocols.trace import UsageRow, parse_trace


class MemoryTraceStore:
    """A :class:`TraceStore` in memory whose writes complete when ``acknowledge()`` runs
    (or at once with ``auto_ack``)."""

    def __init__(self, data_dir: Path, *, auto_ack: bool = True) -> None:
        self.data_dir = data_dir
        self.auto_ack = auto_ack
        self.meta: dict[str, dict[str, Any]] = {}
        self.traces: dict[str, list[list[str]]] = {}
        self.pending: list[tuple[str, str]] = []
        self.usage: list[UsageRow] = []
        self.syncs = 0
        self.released: list[str] = []
        self._next_seq: dict[str, int] = {}
        self._tickets_taken = 0
        self._tickets_done = 0
        self._waiting: list[tuple[int, trio.MemorySendChannel[TraceWritten]]] = []
        self._closed = trio.Event()
        self._stored = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self._closed.wait()

    async def aclose(self) -> None:
        self.acknowledge()
        self._closed.set()
        await trio.lowlevel.checkpoint()

    async def create(self, session_id: str, meta: dict[str, Any]) -> None:
        self.meta[session_id] = dict(meta)
        self.traces[session_id] = [[]]
        self._next_seq[session_id] = 1
        await trio.lowlevel.checkpoint()

    async def read_meta(self, session_id: str) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        if session_id not in self.meta:
            raise StoredSessionMissing(f"no session {session_id!r} in memory")
        return dict(self.meta[session_id])

    async def exists(self, session_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return session_id in self.meta

    async def load(self, session_id: str) -> LoadedTrace:
        await trio.lowlevel.checkpoint()
        traces = self.traces[session_id]
        result = parse_trace("".join(traces[-1]), file="memory")
        every = [r for lines in traces for r in parse_trace("".join(lines), file="memory").records]
        last = max((r.seq or 0 for r in every), default=0)
        self._next_seq[session_id] = last + 1
        return LoadedTrace(
            records=tuple(result.records), errors=(), number=len(traces), last_seq=last
        )

    async def read_after(self, session_id: str, after_seq: int = 0) -> list[Output]:
        await trio.lowlevel.checkpoint()
        return [
            r
            for lines in self.traces.get(session_id, [])
            for r in parse_trace("".join(lines), file="memory").records
            if (r.seq or 0) > after_seq
        ]

    async def delete(self, session_id: str) -> None:
        self.meta.pop(session_id, None)
        self.traces.pop(session_id, None)
        await trio.lowlevel.checkpoint()

    def release(self, session_id: str) -> None:
        self.released.append(session_id)
        self._next_seq.pop(session_id, None)

    def location(self, session_id: str) -> Path:
        return Path(f"memory:{session_id}/{len(self.traces[session_id])}")

    def trace_number(self, session_id: str) -> int:
        return len(self.traces[session_id])

    def append(self, session_id: str, seq: int, line: str) -> int:
        if self._closed.is_set():
            raise TraceSinkClosed("closed")
        if seq < self._next_seq[session_id]:
            raise StaleTraceWriter(self.location(session_id), f"seq {seq} is stale")
        self._next_seq[session_id] = seq + 1
        self.pending.append((session_id, line))
        return self._tickets_taken + 1

    def commit(self, session_id: str) -> bool:
        if self.auto_ack:
            self.acknowledge()
            return True
        return not any(sid == session_id for sid, _ in self.pending)

    def acknowledge(self) -> None:
        """Store every pending record and complete its ticket."""
        if not self.pending:
            return
        for session_id, line in self.pending:
            self.traces[session_id][-1].append(line)
        self.pending.clear()
        self._tickets_taken += 1
        self._tickets_done = self._tickets_taken
        due = [(t, reply) for t, reply in self._waiting if t <= self._tickets_done]
        self._waiting = [(t, reply) for t, reply in self._waiting if t > self._tickets_done]
        for ticket, reply in due:
            reply.send_nowait(TraceWritten(ticket=ticket))
        self._stored.set()

    def batch_done(self, ticket: int) -> bool:
        return ticket <= self._tickets_done

    def when_batch_done(self, ticket: int, reply: trio.MemorySendChannel[TraceWritten]) -> None:
        if self.batch_done(ticket):
            reply.send_nowait(TraceWritten(ticket=ticket))
        else:
            self._waiting.append((ticket, reply))

    def error(self, session_id: str) -> TraceWriteError | None:
        return None

    def clear_error(self, session_id: str) -> None:
        pass

    async def sync(self, session_id: str | None = None) -> None:
        self.syncs += 1
        if self.auto_ack:
            self.acknowledge()
        while self.pending:  # durable only once stored
            self._stored = trio.Event()
            await self._stored.wait()
        await trio.lowlevel.checkpoint()

    def rotate(self, session_id: str) -> str:
        self.traces[session_id].append([])
        return f"memory trace {len(self.traces[session_id])}"

    def record_usage(self, row: UsageRow) -> None:
        self.usage.append(row)


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
        stored = [output_from_dict(_json(line)) for line in store.traces[session.id][0]]
        traced = [o for o in outputs if o.seq is not None]
        assert [o.seq for o in stored] == [o.seq for o in traced] == list(
            range(1, len(traced) + 1)
        )
        assert store.usage and {row.session_id for row in store.usage} == {session.id}
        assert store.syncs > 0  # R-TRACE-2 reached the backend
        replay = await store.read_after(session.id, after_seq=3)
        assert [o.seq for o in replay] == [o.seq for o in traced if o.seq > 3]
        await host.close_session(session.id)
        assert store.released == [session.id]  # the host forgets what it closed

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
        assert store.pending  # the records are appended …
        assert not [o for o in seen if o.seq is not None]  # … and nothing traced is out yet
        store.auto_ack = True
        store.acknowledge()
        outputs = await collect(stream)
        assert [o.seq for o in seen if o.seq is not None] == [
            o.seq for o in outputs if o.seq is not None
        ]
        assert isinstance(outputs[-1], TaskEnd)
        assert isinstance(outputs[0], UserMsg)


async def test_the_file_store_refuses_a_record_it_already_holds(tmp_path: Path) -> None:
    """The fence (R-CLUSTER-1) in the default backend: a stale ``seq`` is refused, the
    record is not written, later records go on."""
    async with trio.open_nursery() as nursery:
        store = FileTraceStore(tmp_path)
        await nursery.start(store.run)
        await store.create("s1", {"session_id": "s1"})
        first = UserMsg(session_id="s1", run_id="r", seq=1, kind="prompt", content=())
        store.append("s1", 1, _line(first))
        with pytest.raises(StaleTraceWriter, match="seq 1"):
            store.append("s1", 1, _line(first))
        store.append("s1", 2, _line(UserMsg(session_id="s1", run_id="r", seq=2,
                                           kind="prompt", content=())))
        await store.sync("s1")
        loaded = await store.load("s1")
        assert [r.seq for r in loaded.records] == [1, 2] and loaded.last_seq == 2
        with pytest.raises(StaleTraceWriter):
            store.append("s1", 2, _line(first))
        assert store.location("s1") == tmp_path / "sessions" / "s1" / "trace_001.jsonl"
        assert store.rotate("s1") == "trace_002.jsonl"
        store.append("s1", 3, _line(UserMsg(session_id="s1", run_id="r", seq=3,
                                           kind="prompt", content=())))
        await store.sync("s1")
        assert [r.seq for r in await store.read_after("s1", 1)] == [2, 3]
        with pytest.raises(StoredSessionMissing):
            await store.read_meta("nobody")
        await store.sync("s1")
        store.release("s1")  # closed: only the files remain, and where they are
        assert store.location("s1") == tmp_path / "sessions" / "s1" / "trace_002.jsonl"
        with pytest.raises(KeyError):
            store.append("s1", 4, _line(first))
        assert (await store.load("s1")).last_seq == 3
        await store.aclose()


def _line(output: Output) -> str:
    from greenroom.protocols.trace import encode_record

    return encode_record(output)


def _json(line: str) -> dict[str, Any]:
    import json

    value: dict[str, Any] = json.loads(line)
    return value
