"""Watching a session from a task of one's own (R-ACTOR-1): ``Session.watch`` sends every
published batch to the watcher's inbox, in order, without the publisher ever waiting; a
watch whose receive side is closed, whose inbox is full or whose session closes ends and
is forgotten."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import trio
import trio.lowlevel
import trio.testing
from conftest import collect

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.outputs import Output, TaskEnd, TaskStart

BOUND_S = 10


def two_tasks() -> ScriptedProvider:
    return ScriptedProvider([Reply(blocks=(text("One."),)), Reply(blocks=(text("Two."),))])


async def watched_two_tasks(
    tmp_path: Path, kinds: tuple[type[Output], ...] | None = None
) -> tuple[list[list[Output]], list[list[Output]]]:
    """Two tasks run with a subscriber and a watch (``kinds``): what each got."""
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(provider=two_tasks(), workspace_dir=tmp_path)
            heard: list[list[Output]] = []
            session.subscribe(heard.append)
            # Unbounded: the test reads only after the tasks, and must lose nothing.
            send, receive = trio.open_memory_channel[list[Output]](math.inf)
            session.watch(send, kinds=kinds)
            await collect(session.run("first"))
            await collect(session.run("second"))
            seen: list[list[Output]] = []
            with contextlib.suppress(trio.WouldBlock):
                while True:
                    seen.append(receive.receive_nowait())
    return heard, seen


async def test_a_watch_gets_every_batch_in_publication_order(tmp_path: Path) -> None:
    """Across batches and across tasks the watch sees exactly what a subscriber sees, in
    the same order, as the batches the publisher handed out."""
    heard, seen = await watched_two_tasks(tmp_path)
    assert len(heard) > 2, "the tasks published several batches"
    assert seen == heard
    assert [b is h for b, h in zip(seen, heard, strict=True)] == [True] * len(heard)
    ends = [o for batch in seen for o in batch if isinstance(o, TaskEnd)]
    assert len(ends) == 2
    seqs = [o.seq for batch in seen for o in batch if o.seq is not None]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


async def test_a_watch_for_some_kinds_gets_only_those_outputs_and_no_empty_batch(
    tmp_path: Path,
) -> None:
    """``kinds``: each batch cut down to the outputs asked for, in order; a batch with
    none of them is not sent (the watcher is not woken for partial outputs)."""
    heard, seen = await watched_two_tasks(tmp_path, kinds=(TaskStart, TaskEnd))
    wanted = [o for batch in heard for o in batch if isinstance(o, TaskStart | TaskEnd)]
    assert [type(o) for o in wanted] == [TaskStart, TaskEnd, TaskStart, TaskEnd]
    assert [o for batch in seen for o in batch] == wanted
    assert all(batch for batch in seen)
    assert len(seen) < len(heard), "batches without a start or an end were not sent"


async def test_a_watcher_that_stops_reading_blocks_neither_the_session_nor_others(
    tmp_path: Path,
) -> None:
    """A full inbox cuts its watcher off: the publisher never waits, the other watchers
    get everything, and the stalled one reads what it holds, then the end."""
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(provider=two_tasks(), workspace_dir=tmp_path)
            # One slot, never read while the tasks run: the watcher that fell behind.
            stalled_send, stalled = trio.open_memory_channel[list[Output]](1)
            session.watch(stalled_send)
            # Unbounded: this watcher keeps up, and must lose nothing.
            steady_send, steady = trio.open_memory_channel[list[Output]](math.inf)
            session.watch(steady_send)
            first = await collect(session.run("first"))
            second = await collect(session.run("second"))
            got: list[Output] = []
            while True:
                try:
                    got.extend(steady.receive_nowait())
                except trio.WouldBlock:
                    break
            held = await stalled.receive()
            try:
                await stalled.receive()
            except trio.EndOfChannel:
                ended = True
            else:
                ended = False
    assert got == first + second
    assert held == got[: len(held)], "the cut-off watcher kept the first batch"
    assert ended, "the cut-off watch ended instead of skipping batches"
    assert stalled.statistics().open_send_channels == 0


async def test_a_closed_watch_is_forgotten(tmp_path: Path) -> None:
    """Closing the receive side ends the watch: at the next batch the session closes the
    send side and forgets it, without a word to the publishing task."""
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(provider=two_tasks(), workspace_dir=tmp_path)
            # Unbounded: nothing is ever sent that waits; the channel is closed at once.
            send, receive = trio.open_memory_channel[list[Output]](math.inf)
            session.watch(send)
            receive.close()
            assert receive.statistics().open_send_channels == 1
            outputs = await collect(session.run("first"))
            assert receive.statistics().open_send_channels == 0
            again = await collect(session.run("second"))
    assert isinstance(outputs[-1], TaskEnd) and outputs[-1].status == "completed"
    assert isinstance(again[-1], TaskEnd) and again[-1].status == "completed"


async def test_closing_the_session_ends_its_watches(tmp_path: Path) -> None:
    """The session's inbox ends when it closes: a watcher's loop returns after the last
    batch, so a watcher task of the host's nursery never keeps the host open."""
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            session = await host.create_session(provider=two_tasks(), workspace_dir=tmp_path)
            # Unbounded: the watcher drains it after the task.
            send, receive = trio.open_memory_channel[list[Output]](math.inf)
            session.watch(send)
            outputs = await collect(session.run("first"))
            await host.close_session(session.id)
            seen = [output async for batch in receive for output in batch]
    assert seen == outputs


async def test_the_otel_observer_maps_outputs_in_its_own_task(tmp_path: Path) -> None:
    """R-ACTOR-1: the OpenTelemetry observer's work runs in its task, not in the task that
    publishes, and it sees every batch, in order, before the host has closed."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider

    from greenroom.actors.observers.otel import GenAIObserver

    publishers: list[trio.lowlevel.Task] = []
    mappers: list[trio.lowlevel.Task] = []
    mapped: list[list[Output]] = []
    heard: list[list[Output]] = []

    class Recording(GenAIObserver):
        def on_batch(self, session: Session, batch: list[Output]) -> None:
            mappers.append(trio.lowlevel.current_task())
            mapped.append(batch)
            super().on_batch(session, batch)

    def listen(batch: list[Output]) -> None:
        publishers.append(trio.lowlevel.current_task())
        heard.append(batch)

    observer = Recording(tracer_provider=TracerProvider(), capture_content=False)
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data", observers=[observer.observe]) as host:
            session = await host.create_session(provider=two_tasks(), workspace_dir=tmp_path)
            session.subscribe(listen)
            await collect(session.run("first"))
    assert mapped == heard and len(heard) > 2
    assert not set(mappers) & set(publishers)


async def test_a_watch_of_a_closed_session_ends_at_once(tmp_path: Path) -> None:
    # Nothing is published after the session closed: a watch begun then (a hub or feed
    # that adopted the session just as it closed) waited for ever.
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider="scripted", workspace_dir=tmp_path)
        await host.close_session(session.id)
        # Unbounded: the test only looks at whether the channel ended.
        send, receive = trio.open_memory_channel[list[Output]](math.inf)
        session.watch(send)
        with pytest.raises(trio.EndOfChannel):
            receive.receive_nowait()


async def test_a_closed_feed_leaves_no_watch_on_an_idle_session(tmp_path: Path) -> None:
    # An A2A or AG-UI reader that comes and goes (a front end reconnecting) on an idle
    # session: each feed's watch stayed on the session until it next published, and the
    # next publish removed them one by one (quadratic in their number).
    from greenroom.actors.gateway.feeds import SessionFeed

    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider="scripted", workspace_dir=tmp_path)
        watching = session._port._listeners
        before = len(watching or ())
        for _ in range(50):
            with SessionFeed(session) as feed:
                assert await feed.next_batch() == []  # the replay: nothing yet
        assert len(session._port._listeners or ()) == before
        result = await session.run("hi").result()  # and the session publishes as before
        assert result.task_end.status == "completed"


async def test_a_close_the_shutdown_bound_cuts_short_still_ends_the_watches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    # A session whose last sync hangs past the host's shutdown bound: its close was cut
    # short before the watches ended, and the provider clients and MCP servers were never
    # closed; a watcher, or the MCP servers' manager, then held the host open for ever.
    from greenroom.actors.runtime.port import SessionPort
    from greenroom.actors.runtime.port_builder import PortBuilder

    async def hangs(self: SessionPort) -> None:
        await trio.sleep_forever()

    closed: list[str] = []
    builder_aclose = PortBuilder.aclose

    async def aclose_and_tell(self: PortBuilder) -> None:
        closed.append("clients")
        await builder_aclose(self)

    monkeypatch.setattr(PortBuilder, "aclose", aclose_and_tell)
    # Unbounded: the test only looks at whether the watch ended.
    send, receive = trio.open_memory_channel[list[Output]](math.inf)
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider="scripted", workspace_dir=tmp_path)
        session.watch(send)
        monkeypatch.setattr(SessionPort, "sync_trace_quietly", hangs)
    assert closed == ["clients"]
    while True:
        try:
            receive.receive_nowait()
        except trio.WouldBlock:
            pytest.fail("the watch did not end")
        except trio.EndOfChannel:
            break
