"""R-PERF-1: many response bodies streaming in one process share one read tick.

Below ``PACED_FROM_STREAMS`` bodies every read is made as its data arrives. From there on a
body that emptied its socket waits for the process's next tick before it reads again, one
tick every ``streams / READS_PER_SECOND``, so that one read carries what came meanwhile.
The clock here moves only when a test jumps it: a read made before the tick would be seen
at time zero."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trio
import trio.testing

from greenroom.actors.providers import lean_http
from greenroom.actors.providers.lean_http import ConnectionPool, Timeouts, parse_url
from tests.support.tls import self_signed

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
JUMPS = 1000  # far more ticks than a three-chunk body can need


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Exchange:
    """One chunked body, sent a chunk at a time as the test says, read through the pool
    with the time of each read; over TLS when given the two sides' contexts."""

    def __init__(self, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None) -> None:
        self.tls = tls
        self.pieces: list[tuple[float, bytes]] = []
        self.first_read = trio.Event()
        self.second_read = trio.Event()
        self.sent_second = trio.Event()
        self.send_last = trio.Event()
        self.done = trio.Event()

    async def serve(self, listener: trio.SocketListener) -> None:
        stream: trio.abc.Stream = await listener.accept()
        if self.tls is not None:
            stream = trio.SSLStream(stream, self.tls[0], server_side=True)
        await stream.receive_some(65536)
        await stream.send_all(HEAD + _chunk(b"one"))
        await self.first_read.wait()
        await stream.send_all(_chunk(b"two"))
        self.sent_second.set()
        await self.send_last.wait()
        await stream.send_all(_chunk(b"three") + b"0\r\n\r\n")
        await stream.aclose()

    async def read(self, port: int) -> None:
        if self.tls is None:
            pool, url = ConnectionPool(), parse_url(f"http://127.0.0.1:{port}/")
        else:
            pool = ConnectionPool(ssl_context=self.tls[1])
            url = parse_url(f"https://localhost:{port}/")
        response = await pool.request(b"POST", url, [], b"x", Timeouts(read=60.0))
        async for piece in response.body:
            self.pieces.append((trio.current_time(), piece))
            self.first_read.set()
            if b"two" in b"".join(p for _, p in self.pieces[1:]):
                self.second_read.set()
        await response.body.aclose()
        await pool.aclose()
        self.done.set()


async def _listen() -> tuple[trio.SocketListener, int]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    assert isinstance(listener, trio.SocketListener)
    return listener, listener.socket.getsockname()[1]


async def test_with_few_bodies_every_read_is_made_as_its_data_arrives(
    mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lean_http._streams, "open", 0)
    exchange = _Exchange()
    listener, port = await _listen()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(exchange.serve, listener)
        nursery.start_soon(exchange.read, port)
        await exchange.second_read.wait()  # no time passes: read on arrival
        exchange.send_last.set()
        await exchange.done.wait()
    await listener.aclose()
    assert [t for t, _ in exchange.pieces] == [0.0] * len(exchange.pieces)
    assert b"".join(p for _, p in exchange.pieces) == b"onetwothree"
    assert lean_http._streams.open == 0


def _tls_contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    cert, key = self_signed(tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


@pytest.mark.parametrize("transport", ["tcp", "tls"])
async def test_with_many_bodies_a_drained_body_reads_again_on_the_next_tick(
    mock_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    transport: str,
) -> None:
    """Over TLS too: its records are read from the socket directly, so a TLS body waits
    for the tick like a plain one."""
    # This body makes the count PACED_FROM_STREAMS.
    others = lean_http.PACED_FROM_STREAMS - 1
    monkeypatch.setattr(lean_http._streams, "open", others)
    pause = lean_http.PACED_FROM_STREAMS / lean_http.READS_PER_SECOND
    exchange = _Exchange(_tls_contexts(tmp_path) if transport == "tls" else None)
    listener, port = await _listen()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(exchange.serve, listener)
        nursery.start_soon(exchange.read, port)
        await exchange.sent_second.wait()
        await trio.testing.wait_all_tasks_blocked()
        # "two" is sent, and the body waits for the tick instead of reading it.
        assert [p for _, p in exchange.pieces] == [b"one"]
        exchange.send_last.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [p for _, p in exchange.pieces] == [b"one"]
        for _ in range(JUMPS):
            if exchange.done.is_set():
                break
            mock_clock.jump(pause)
            await trio.testing.wait_all_tasks_blocked()
        await exchange.done.wait()
    await listener.aclose()
    assert exchange.pieces[0] == (0.0, b"one")
    assert all(t >= pause for t, _ in exchange.pieces[1:])
    assert b"".join(p for _, p in exchange.pieces) == b"onetwothree"
    assert lean_http._streams.open == others
    # With no body left waiting the tick's task ends on its next tick.
    mock_clock.jump(pause)
    await trio.testing.wait_all_tasks_blocked()
    assert not lean_http._ticks()._ticking


async def test_a_paced_body_that_falls_silent_still_times_out(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-10 holds for a body waiting on the tick: silence ends it as a read timeout."""
    monkeypatch.setattr(lean_http._streams, "open", lean_http.PACED_FROM_STREAMS)
    listener, port = await _listen()
    read_timeout = 5.0

    async def serve() -> None:
        stream = await listener.accept()
        await stream.receive_some(65536)
        await stream.send_all(HEAD + _chunk(b"one"))
        await trio.sleep_forever()

    pool = ConnectionPool()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        url = parse_url(f"http://127.0.0.1:{port}/")
        response = await pool.request(b"POST", url, [], b"x", Timeouts(read=read_timeout))
        body = response.body
        start = trio.current_time()
        with pytest.raises(lean_http.ReadTimeout):
            with body.read_deadline():
                async for _ in body:
                    pass
        silence = trio.current_time() - start
        await body.aclose()
        nursery.cancel_scope.cancel()
    await pool.aclose()
    await listener.aclose()
    assert read_timeout <= silence <= read_timeout * (1 + lean_http.DEADLINE_SLACK) + 0.1
