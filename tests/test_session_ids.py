"""Session ids are unique within a host even when many sessions are created in one second
(R-HOST-1: each session has its own files). The generated id is a timestamp and 24 random
bits: a thousand sessions created within a second collide about once in thirty runs. A new
session is never written over a stored one, and a stored one is opened once however many
ask for it at once."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import RUN_TIMEOUT_S, trace_lines

from greenroom import Host, Session, SessionExists
from greenroom.actors.runtime import session_ids
from greenroom.actors.runtime.disk import Disk
from greenroom.actors.runtime.trace_store import FileTraceStore


async def test_a_generated_id_already_open_in_the_host_is_drawn_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = iter(["20260101-000000-aaaaaa", "20260101-000000-aaaaaa", "20260101-000000-bbbbbb"])
    monkeypatch.setattr(session_ids, "new_session_id", lambda: next(drawn))
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(tmp_path / "data") as host:
            first = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            second = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            assert first.id == "20260101-000000-aaaaaa"
            assert second.id == "20260101-000000-bbbbbb"
            for session in (first, second):
                result = await session.run("hi").result()
                assert result.task_end.status == "completed"


async def _finished(host: Host, workspace: Path, prompt: str) -> Session:
    """A new session of the scripted model that has answered ``prompt``."""
    session = await host.create_session(provider="scripted", workspace_dir=workspace)
    assert (await session.run(prompt).result()).task_end.status == "completed"
    return session


async def _stored(host: Host, workspace: Path) -> Session:
    """A session that answered once and was closed: stored, not open."""
    session = await _finished(host, workspace, "hi")
    await host.close_session(session.id)
    return session


def _trace_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


async def test_two_creations_at_once_drawing_the_same_id_get_two_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The id was checked against the open sessions only, and a creation awaits (the
    # workspace, session.json) before it is open: both took the first id and shared its
    # files (R-HOST-1).
    drawn = iter(["20260101-000000-aaaaaa", "20260101-000000-aaaaaa", "20260101-000000-bbbbbb"])
    monkeypatch.setattr(session_ids, "new_session_id", lambda: next(drawn))
    created: list[Session] = []
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(tmp_path / "data") as host:

            async def create() -> None:
                created.append(
                    await host.create_session(provider="scripted", workspace_dir=tmp_path)
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(create)
                nursery.start_soon(create)
            assert sorted(s.id for s in created) == [
                "20260101-000000-aaaaaa",
                "20260101-000000-bbbbbb",
            ]
            for session in created:
                result = await session.run(f"hi from {session.id}").result()
                assert result.task_end.status == "completed"
            for session in created:
                prompts = [
                    line["content"][0]["text"]
                    for line in trace_lines(session)
                    if line["type"] == "user_msg"
                ]
                assert prompts == [f"hi from {session.id}"]


async def test_a_new_session_is_never_written_over_a_stored_one(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(data_dir) as host:
            first = await _finished(host, tmp_path, "remember this")
            kept = _trace_bytes(first.directory)
            with pytest.raises(SessionExists, match="is open in this host"):
                await host.create_session(
                    provider="scripted", workspace_dir=tmp_path, session_id=first.id
                )
            await host.close_session(first.id)
            with pytest.raises(SessionExists, match="is stored in"):
                await host.create_session(
                    provider="scripted", workspace_dir=tmp_path, session_id=first.id
                )
            assert _trace_bytes(first.directory) == kept
            again = await host.load_session(first.id)
            assert again.transcript.messages[0].content[0].text == "remember this"  # type: ignore[union-attr]


class SecondCreatorDisk(Disk):
    """A disk on which another process creates a session of the same id, its
    ``session.json`` in place, just after this host found none there and before it puts
    its own in place."""

    THEIRS = b'{"id": "theirs"}\n'

    def __init__(self) -> None:
        self.raced = False

    def write(self, path: Path, data: bytes) -> None:
        if not self.raced and path.name.startswith("session.json.") and path.suffix == ".tmp":
            self.raced = True
            super().write(path.with_name("session.json"), self.THEIRS)
        super().write(path, data)


async def test_a_session_another_process_creates_at_the_same_moment_is_not_written_over(
    tmp_path: Path,
) -> None:
    # Before, the check and the rename were two steps: the second creator's rename replaced
    # the first one's session.json, and both believed they had created the session.
    disk = SecondCreatorDisk()
    session_id = "20260101-000000-eeeeee"
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(
            tmp_path / "data", trace_store=lambda d: FileTraceStore(d, disk=disk)
        ) as host:
            with pytest.raises(SessionExists, match="is stored in"):
                await host.create_session(
                    provider="scripted", workspace_dir=tmp_path, session_id=session_id
                )
    assert disk.raced
    directory = tmp_path / "data" / "sessions" / session_id
    assert (directory / "session.json").read_bytes() == SecondCreatorDisk.THEIRS
    assert not [entry.name for entry in directory.iterdir() if entry.name.endswith(".tmp")]


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_new_file_is_placed_only_where_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    if not hard_links:

        def no_link(source: object, target: object) -> None:
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    disk = Disk()
    source, target = tmp_path / "new.tmp", tmp_path / "session.json"
    source.write_bytes(b"ours")
    assert disk.place_new(source, target)
    assert target.read_bytes() == b"ours"
    another = tmp_path / "another.tmp"
    another.write_bytes(b"another")
    assert not disk.place_new(another, target)
    assert target.read_bytes() == b"ours"


async def test_a_drawn_id_a_stored_session_has_is_drawn_again_for_a_new_session_and_a_fork(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "data"
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(data_dir) as host:
            stored = await _finished(host, tmp_path, "the stored one")
            other = await _finished(host, tmp_path, "the source of the fork")
        kept = _trace_bytes(stored.directory)
        drawn = iter([stored.id, "20260101-000000-cccccc", stored.id, "20260101-000000-dddddd"])
        monkeypatch.setattr(session_ids, "new_session_id", lambda: next(drawn))
        async with Host.open(data_dir) as host:
            new = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            fork = await host.fork_session(other.id)
            assert (new.id, fork.id) == ("20260101-000000-cccccc", "20260101-000000-dddddd")
            assert fork.transcript.messages[0].content[0].text == "the source of the fork"  # type: ignore[union-attr]
            assert _trace_bytes(stored.directory) == kept
            loaded = await host.load_session(stored.id)
            assert loaded.transcript.messages[0].content[0].text == "the stored one"  # type: ignore[union-attr]


async def test_two_loads_of_one_stored_session_at_once_open_it_once(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(data_dir) as host:
            session = await _stored(host, tmp_path)
            loaded: list[Session] = []

            async def load() -> None:
                loaded.append(await host.load_session(session.id))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(load)
                nursery.start_soon(load)
            assert loaded[0] is loaded[1]
            assert host.get_session(session.id) is loaded[0]
            result = await loaded[0].run("again").result()
            assert result.task_end.status == "completed"


async def test_a_session_deleted_while_it_loads_is_deleted_after_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The delete found the session not open and removed its files under the load, which
    # then opened a session without them (or failed).
    data_dir = tmp_path / "data"
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(data_dir) as host:
            session = await _stored(host, tmp_path)
            catalog = host.trace_store.catalog
            read_meta = catalog.read_meta
            reading, go_on, deleted = trio.Event(), trio.Event(), trio.Event()

            async def held_read_meta(session_id: str) -> dict[str, object]:
                reading.set()
                await go_on.wait()
                return await read_meta(session_id)

            monkeypatch.setattr(catalog, "read_meta", held_read_meta)

            async def delete() -> None:
                await host.delete_session(session.id)
                deleted.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(host.load_session, session.id)
                await reading.wait()
                nursery.start_soon(delete)
                await trio.testing.wait_all_tasks_blocked()
                assert not deleted.is_set()  # it waits for the load
                go_on.set()
            assert session.id not in {s.id for s in host.sessions}
            assert not session.directory.exists()


def _held_close(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """Make closing a session wait: the first event is set once a close waits, the
    second lets it go on."""
    aclose = Session.aclose
    closing, go_on = trio.Event(), trio.Event()

    async def held_aclose(self: Session) -> None:
        closing.set()
        await go_on.wait()
        await aclose(self)

    monkeypatch.setattr(Session, "aclose", held_aclose)
    return closing, go_on


async def test_a_session_loaded_while_it_closes_is_loaded_after_the_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The load found the session no longer open and opened it beside the closing one;
    # the close then forgot the new one's trace position, and its next record failed
    # (a lease lost and won back in a cluster closes and takes a session over so).
    data_dir = tmp_path / "data"
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(data_dir) as host:
            session = await _finished(host, tmp_path, "hi")
            closing, go_on = _held_close(monkeypatch)
            loaded = trio.Event()
            again: list[Session] = []

            async def load() -> None:
                again.append(await host.load_session(session.id))
                loaded.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(host.close_session, session.id)
                await closing.wait()
                nursery.start_soon(load)
                await trio.testing.wait_all_tasks_blocked()
                assert not loaded.is_set()  # it waits for the close
                go_on.set()
            (reloaded,) = again
            assert reloaded is not session
            assert host.get_session(session.id) is reloaded
            result = await reloaded.run("again").result()
            assert result.task_end.status == "completed"


async def test_a_session_loaded_while_it_is_deleted_is_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A load that came while the delete closed the session opened it again just before
    # its directory was removed under it.
    data_dir = tmp_path / "data"
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(data_dir) as host:
            session = await _finished(host, tmp_path, "hi")
            closing, go_on = _held_close(monkeypatch)
            found: list[BaseException] = []

            async def load() -> None:
                try:
                    await host.load_session(session.id)
                except Exception as exc:
                    found.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(host.delete_session, session.id)
                await closing.wait()
                nursery.start_soon(load)
                await trio.testing.wait_all_tasks_blocked()
                go_on.set()
            assert [type(exc).__name__ for exc in found] == ["SessionNotFound"]
            assert session.id not in {s.id for s in host.sessions}
            assert not session.directory.exists()
