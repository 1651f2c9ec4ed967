"""The slow-client rule (gateway invariants): only a client that is really behind loses its
subscription. Real trio-websocket clients against the real gateway on port 0.

A busy server is modelled exactly: the session publishes many batches of outputs in a row
without a checkpoint (as a supervisor flushing under load does), so no connection's writer
runs until the burst is over."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio
import trio.testing
from conftest import port_of
from test_gateway import BOUND_S, Client, connect, serving

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.runtime.session import Session
from greenroom.protocols.outputs import Output, PartialText


def burst(session: Session, count: int, size: int = 10, *, run_id: str = "run_burst") -> None:
    """``count`` live outputs of ``size`` characters, one published batch each."""
    for i in range(count):
        text = f"{i:08d}".ljust(size, "x")
        output: Output = PartialText(session_id=session.id, run_id=run_id, index=0, text=text)
        port_of(session).publish([output])


async def notes_until_run(client: Client, run_id: str) -> list[dict[str, Any]]:
    """Every output up to the first of ``run_id``; a dropped subscription fails."""
    notes: list[dict[str, Any]] = []
    while True:
        note = await client.notification()
        assert note["method"] == "output", note  # subscription_dropped: a prompt reader lost
        notes.append(note)
        if note["params"]["run_id"] == run_id:
            return notes


async def test_prompt_readers_of_a_busy_server_are_not_dropped(tmp_path: Path) -> None:
    """20 clients read promptly; the server queues 600 frames for each in one burst, far
    beyond ``max_pending_frames``. Their writers were waiting, not stuck: nobody is
    dropped, and every frame arrives, in order."""
    limits = GatewayLimits(max_pending_frames=50)
    with trio.fail_after(BOUND_S * 3):
        async with serving(tmp_path, limits=limits) as server, AsyncExitStack() as stack:
            owner = await stack.enter_async_context(connect(server))
            sid = (await owner.result("session.create"))["session_id"]
            session = server.host.get_session(sid)
            clients = [await stack.enter_async_context(connect(server)) for _ in range(20)]
            for client in clients:
                await client.result("session.subscribe", {"session_id": sid})
            burst(session, 600)
            burst(session, 1, run_id="run_end")
            for client in clients:
                notes = await notes_until_run(client, "run_end")
                assert [n["method"] for n in notes] == ["output"] * 601
                texts = [n["params"]["text"] for n in notes[:600]]
                assert texts == [f"{i:08d}".ljust(10, "x") for i in range(600)]


async def _with_a_stuck_client(server: Any, stack: AsyncExitStack) -> tuple[Any, ...]:
    """A session with two subscribed clients: a prompt ``reader``, and one that reads
    nothing, its socket full and its writer stuck in one send, ten more outputs queued for
    it. Returns the two clients, the session and the stuck client's connection."""
    big = 256 * 1024
    reader = await stack.enter_async_context(connect(server))
    sid = (await reader.result("session.create"))["session_id"]
    session = server.host.get_session(sid)
    stalled = await stack.enter_async_context(connect(server))
    await stalled.result("session.subscribe", {"session_id": sid})
    [slow] = [c for c in server.gateway.connections if sid in c.subscriptions]
    await reader.result("session.subscribe", {"session_id": sid})
    outbox = slow.outbox
    rounds = 0
    # Until the socket refuses bytes, the writer takes whatever is queued.
    while outbox.pending == 0 or outbox._send_began is None:
        burst(session, 4, big, run_id=f"run_fill_{rounds}")
        for _ in range(4):
            await reader.notification()
        await trio.testing.wait_all_tasks_blocked()
        rounds += 1
        assert rounds < 400, "the socket never filled"
    burst(session, 10, run_id="run_wait")
    await trio.testing.wait_all_tasks_blocked()  # the session's hub has fanned them out
    return reader, stalled, session, slow


async def test_a_client_that_stops_reading_is_dropped(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """One client stops reading: once its socket refuses bytes its writer is stuck, and
    when it stays stuck for ``stall_timeout_s`` with more than ``max_pending_frames``
    frames waiting, the subscription is dropped with a notice. A prompt client of the
    same session keeps its subscription. The clock is virtual: nothing waits on time (and
    the client reads again before ``send_timeout_s`` would cut it off)."""
    limits = GatewayLimits(max_pending_frames=5, stall_timeout_s=30.0, send_timeout_s=60.0)
    async with serving(tmp_path, limits=limits) as server, AsyncExitStack() as stack:
        reader, stalled, session, slow = await _with_a_stuck_client(server, stack)
        sid = session.id
        # Stuck, but not for long: frames queue up, nobody is dropped yet.
        assert sid in slow.subscriptions
        mock_clock.jump(limits.stall_timeout_s)
        burst(session, 1, run_id="run_late")
        await trio.testing.wait_all_tasks_blocked()
        assert sid not in slow.subscriptions
        # The prompt client got everything and keeps its subscription.
        notes = await notes_until_run(reader, "run_late")
        assert [n["method"] for n in notes] == ["output"] * 11
        assert any(sid in c.subscriptions for c in server.gateway.connections)
        # The stalled client, reading again, finds the notice after what was queued.
        while True:
            note = await stalled.notification()
            if note["method"] == "subscription_dropped":
                break
            assert note["params"]["run_id"] != "run_late"
        assert note["params"]["session_id"] == sid
        assert note["params"]["reason"] == "client too slow: outputs not read"
        assert note["params"]["last_seq"] == 0


async def test_a_client_that_reads_nothing_for_the_send_timeout_is_cut_off(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """A client that stops reading for good does not keep what the server queued for it
    until it leaves: once its writer has been stuck in one send for ``send_timeout_s``
    the connection is cut off (1008, naming the bound) and what waited for it is let go.
    The session and a prompt client of it go on; the client that was cut off comes back
    on a new connection and subscribes again. The clock is virtual."""
    limits = GatewayLimits(max_pending_frames=5, stall_timeout_s=30.0, send_timeout_s=60.0)
    async with serving(tmp_path, limits=limits) as server, AsyncExitStack() as stack:
        reader, _, session, slow = await _with_a_stuck_client(server, stack)
        sid, outbox = session.id, slow.outbox
        # Stuck for less than the bound: still connected, still subscribed.
        mock_clock.jump(limits.send_timeout_s / 2)
        await trio.testing.wait_all_tasks_blocked()
        assert slow in server.gateway.connections and slow.close_with is None
        mock_clock.jump(limits.send_timeout_s / 2)
        await trio.testing.wait_all_tasks_blocked()
        # The gateway looks every quarter of the bound: cut off by the next look.
        mock_clock.jump(limits.send_timeout_s / 4)
        await trio.testing.wait_all_tasks_blocked()
        assert slow.close_with == (1008, "client too slow: nothing read for 60 s")
        assert slow not in server.gateway.connections
        assert outbox.closed and outbox.pending == 0 and outbox.size == 0
        assert slow.subscriptions == {}
        # The close frame cannot reach a client that reads nothing: it waits at most
        # close_timeout_s, then the socket is closed.
        mock_clock.jump(limits.close_timeout_s)
        await trio.testing.wait_all_tasks_blocked()
        # The session and its prompt client went on.
        burst(session, 1, run_id="run_late")
        notes = await notes_until_run(reader, "run_late")
        assert [n["params"]["run_id"] for n in notes] == ["run_wait"] * 10 + ["run_late"]
        # The client cut off comes back and subscribes again.
        again = await stack.enter_async_context(connect(server))
        await again.result("session.subscribe", {"session_id": sid})
        burst(session, 1, run_id="run_back")
        assert (await again.output())["run_id"] == "run_back"
