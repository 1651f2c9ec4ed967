"""The trace-store backends the conformance suite runs, each with a view past its interface.

A contract of ``tests/test_store_conformance.py`` is an async function of a
:class:`Backend`: the running :class:`~greenroom.actors.runtime.trace_store.TraceStore`
(``backend.store``) and what a test needs that the interfaces do not give, because it is
the backend's own business:

* ``adopt(session_id)`` — what a host's observers do with a session it creates or loads
  (a cluster node replicates it to JetStream; the others nothing);
* ``written(session_id)`` — the ``seq`` of every record that survives the death of this
  process, read from where it is kept (the files; the memory store's stored lines; the
  JetStream stream);
* ``durable(session_id)`` — the ``seq`` of every record that survives a power cut too
  (the part of each file the disk has fsynced; what a sync covered; JetStream);
* ``refuse_writes(session_id)`` / ``mend()`` — make the session's writes fail, and stop;
* ``corrupt_meta(session_id)`` — make its stored metadata unreadable;
* ``leftovers(session_id)`` — what the backend still keeps of a deleted session.

:class:`Runner` runs one contract on a fresh store of one kind (``files``, ``memory``,
``jetstream``), started and closed around it, bounded by ``TIMEOUT_S``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from greenroom.actors.runtime.storage import SessionStore, read_session_records
from greenroom.actors.runtime.trace_store import FileTraceStore, TraceStore
from greenroom.protocols.trace import parse_trace, trace_file_number
from tests.support.disks import FaultyDisk
from tests.support.memory_store import MemoryTraceStore

if TYPE_CHECKING:
    from greenroom.actors.cluster.connection import Connection
    from greenroom.actors.cluster.store import ReplicatingTraceStore
    from greenroom.actors.cluster.traces import TraceStream

__all__ = ["KINDS", "TIMEOUT_S", "Backend", "Runner"]

KINDS = ("files", "memory", "jetstream")
TIMEOUT_S = 30.0
HOST_ID = "host-a"


class Backend(Protocol):
    """A running store and the views of it a contract needs (see the module docstring)."""

    @property
    def store(self) -> TraceStore:
        """The store under test (running)."""
        ...

    async def adopt(self, session_id: str) -> None:
        """What a host's observers do with a session it created or loaded."""
        ...

    async def written(self, session_id: str) -> list[int]:
        """The seq of every record that survives the death of this process, in order."""
        ...

    async def durable(self, session_id: str) -> list[int]:
        """The seq of every record that survives a power cut, in order."""
        ...

    def refuse_writes(self, session_id: str) -> None:
        """From now on the session's records cannot be written."""
        ...

    def mend(self) -> None:
        """Writes work again."""
        ...

    def corrupt_meta(self, session_id: str) -> None:
        """Make the session's stored metadata unreadable."""
        ...

    async def leftovers(self, session_id: str) -> list[str]:
        """What the backend still keeps of the session (nothing, once deleted)."""
        ...


Contract = Callable[[Backend], Awaitable[None]]


class Runner:
    """Runs contracts on fresh stores of one kind under ``root`` (a test's tmp dir);
    ``nats_url`` is the server of the ``jetstream`` kind."""

    def __init__(self, kind: str, root: Path, nats_url: str | None = None) -> None:
        self.kind = kind
        self.root = root
        self.nats_url = nats_url

    def run(self, contract: Contract) -> None:
        """Run ``contract`` on a new store, started before and closed after it."""
        data_dir = self.root / "data"
        if self.kind == "jetstream":
            from tests.support.nats import run_connected

            assert self.nats_url is not None

            async def connected(conn: Connection) -> None:
                await _with_jetstream(conn, data_dir, contract)

            run_connected(self.nats_url, connected, timeout_s=TIMEOUT_S)
            return

        async def main() -> None:
            with trio.fail_after(TIMEOUT_S):
                if self.kind == "files":
                    disk = FaultyDisk()
                    files = FileTraceStore(data_dir, disk=disk)
                    await _running(files, FileBackend(files, disk), contract)
                else:
                    memory = MemoryTraceStore(data_dir, late_acks=True)
                    await _running(memory, MemoryBackend(memory), contract)

        trio.run(main)


async def _running(store: TraceStore, backend: Backend, contract: Contract) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        try:
            await contract(backend)
        finally:
            with trio.CancelScope(shield=True):
                await store.aclose()


# -- files -------------------------------------------------------------------------------


class FileBackend:
    """The file store, writing through a :class:`FaultyDisk` that records its fsyncs."""

    def __init__(self, store: FileTraceStore, disk: FaultyDisk) -> None:
        self._store = store
        self.disk = disk
        self.paths = SessionStore(store.data_dir)

    @property
    def store(self) -> TraceStore:
        return self._store

    async def adopt(self, session_id: str) -> None:
        await trio.lowlevel.checkpoint()

    async def written(self, session_id: str) -> list[int]:
        directory = self.paths.session_dir(session_id)
        records = await trio.to_thread.run_sync(lambda: read_session_records(directory))
        return [r.seq for r in records if r.seq is not None]

    async def durable(self, session_id: str) -> list[int]:
        return await trio.to_thread.run_sync(self._fsynced, session_id)

    def _fsynced(self, session_id: str) -> list[int]:
        synced: dict[Path, int] = {}
        for path, size in list(self.disk.fsyncs):
            synced[path] = max(size, synced.get(path, 0))
        directory = self.paths.session_dir(session_id)
        traces = sorted(
            (number, path)
            for path in synced
            if path.parent == directory and (number := trace_file_number(path.name))
        )
        seqs: list[int] = []
        for _, path in traces:
            data = path.read_bytes()[: synced[path]]
            records = parse_trace(data, file=str(path)).records
            seqs.extend(r.seq for r in records if r.seq is not None)
        return seqs

    def refuse_writes(self, session_id: str) -> None:
        self.disk.refuse(self._store.log.location(session_id))

    def mend(self) -> None:
        self.disk.mend()

    def corrupt_meta(self, session_id: str) -> None:
        self.paths.meta_path(session_id).write_text("{not json", encoding="utf-8")

    async def leftovers(self, session_id: str) -> list[str]:
        directory = trio.Path(self.paths.session_dir(session_id))
        if not await directory.exists():
            return []
        return sorted(str(p) for p in await directory.iterdir())


# -- memory ------------------------------------------------------------------------------


class MemoryBackend:
    """The memory store, acknowledging appends from its own task (a checkpoint later)."""

    def __init__(self, store: MemoryTraceStore) -> None:
        self._store = store

    @property
    def store(self) -> TraceStore:
        return self._store

    async def adopt(self, session_id: str) -> None:
        await trio.lowlevel.checkpoint()

    async def written(self, session_id: str) -> list[int]:
        await trio.lowlevel.checkpoint()
        lines = [line for trace in self._store.log.traces.get(session_id, []) for line in trace]
        return _seqs("".join(lines))

    async def durable(self, session_id: str) -> list[int]:
        await trio.lowlevel.checkpoint()
        return _seqs("".join(self._store.log.durable_lines(session_id)))

    def refuse_writes(self, session_id: str) -> None:
        self._store.log.refused.add(session_id)

    def mend(self) -> None:
        self._store.log.refused.clear()

    def corrupt_meta(self, session_id: str) -> None:
        self._store.catalog.corrupt(session_id)

    async def leftovers(self, session_id: str) -> list[str]:
        await trio.lowlevel.checkpoint()
        places: dict[str, Collection[str]] = {
            "meta": self._store.catalog.meta,
            "traces": self._store.log.traces,
            "durable": self._store.log.durable,
        }
        return sorted(name for name, table in places.items() if session_id in table)


def _seqs(text: str) -> list[int]:
    return [r.seq for r in parse_trace(text, file="memory").records if r.seq is not None]


# -- JetStream ---------------------------------------------------------------------------


async def _with_jetstream(conn: Connection, data_dir: Path, contract: Contract) -> None:
    from greenroom.actors.cluster.store import ReplicatingTraceStore
    from greenroom.actors.cluster.traces import TraceStream

    traces = await TraceStream.open(conn)
    disk = FaultyDisk()
    deleted: list[str] = []
    fenced: list[str] = []
    store = ReplicatingTraceStore(
        data_dir, on_fenced=fenced.append, on_deleted=deleted.append, disk=disk
    )
    async with trio.open_nursery() as streams:
        backend = JetStreamBackend(store, disk, traces, streams, deleted)
        await _running(store, backend, contract)
        assert fenced == [], fenced  # one host: nobody fences it
        streams.cancel_scope.cancel()


class JetStreamBackend:
    """The cluster's store: the files, and every record of an adopted session appended,
    fenced, to its JetStream subject (as a cluster node adopts the sessions of its host)."""

    def __init__(
        self,
        store: ReplicatingTraceStore,
        disk: FaultyDisk,
        traces: TraceStream,
        streams: trio.Nursery,
        deleted: list[str],
    ) -> None:
        self._store = store
        self._files = FileBackend(store.files, disk)
        self._traces = traces
        self._streams = streams
        self._deleted = deleted

    @property
    def store(self) -> TraceStore:
        return self._store

    async def adopt(self, session_id: str) -> None:
        log = self._store.log
        if log.replicated(session_id):
            await trio.lowlevel.checkpoint()
            return
        log.replicate(session_id)
        writer = await self._traces.fence(session_id, HOST_ID)
        await self._streams.start(log.stream_to, session_id, writer)

    async def written(self, session_id: str) -> list[int]:
        read = await self._traces.read(session_id)
        return [r.seq for r in read.records if r.seq is not None]

    async def durable(self, session_id: str) -> list[int]:
        # JetStream acknowledges a record once its server has stored it (file storage).
        return await self.written(session_id)

    def refuse_writes(self, session_id: str) -> None:
        self._files.refuse_writes(session_id)

    def mend(self) -> None:
        self._files.mend()

    def corrupt_meta(self, session_id: str) -> None:
        self._files.corrupt_meta(session_id)

    async def leftovers(self, session_id: str) -> list[str]:
        left = await self._files.leftovers(session_id)
        if self._store.log.replicated(session_id):
            left.append("still replicated")
        if session_id not in self._deleted:
            left.append("the cluster was not told")
        return left

