"""greenroom's HTTP client reads TLS from the socket itself (R-PERF-1): one read hands on
the plaintext of every record that has arrived, where a TLS stream hands on one record —
one streamed event — a read. The server here is an ``ssl`` object in memory, so what has
"arrived" is exactly what the test hands over."""

from __future__ import annotations

import contextlib
import ssl
from pathlib import Path

import pytest

from greenroom.actors.providers import lean_http
from tests.support.tls import self_signed


class _MemoryServer:
    """The server's end of one TLS connection, in memory; to the client it is the
    transport its handshake runs over."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.sent: list[bytes] = []

    async def send_all(self, data: bytes) -> None:  # what the client sends
        self.incoming.write(data)
        with contextlib.suppress(ssl.SSLWantReadError):
            self.tls.do_handshake()

    async def receive_some(self, max_bytes: int) -> bytes:
        return self.outgoing.read()

    def records(self, *texts: bytes) -> bytes:
        """What the server sends for ``texts``, one record each, as bytes on the wire."""
        for text in texts:
            self.tls.write(text)
        return self.outgoing.read()

    def received(self, wire: bytes) -> bytes:
        self.incoming.write(wire)
        return self.tls.read(65536)


async def _connected(tmp_path: Path) -> tuple[lean_http._Tls, _MemoryServer]:
    cert, key = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    server = _MemoryServer(server_context)
    client = lean_http._Tls(ssl.create_default_context(cafile=str(cert)), "localhost")
    await client.handshake(server)  # type: ignore[arg-type]
    return client, server


async def test_one_read_hands_on_every_record_that_arrived(tmp_path: Path) -> None:
    client, server = await _connected(tmp_path)
    wire = server.records(b"one", b"two", b"three")
    assert client.decrypt(wire) == b"onetwothree"
    assert not client.closed


async def test_a_record_cut_between_reads_is_handed_on_once_whole(tmp_path: Path) -> None:
    client, server = await _connected(tmp_path)
    wire = server.records(b"first", b"second")
    cut = len(wire) - 5
    assert client.decrypt(wire[:cut]) == b"first"
    assert client.decrypt(wire[cut:]) == b"second"


async def test_what_the_client_sends_is_encrypted(tmp_path: Path) -> None:
    client, server = await _connected(tmp_path)
    wire = client.encrypt(b"POST / HTTP/1.1\r\n\r\n")
    assert b"POST" not in wire
    assert server.received(wire) == b"POST / HTTP/1.1\r\n\r\n"


async def test_close_notify_and_a_bare_end_both_end_the_connection(tmp_path: Path) -> None:
    client, server = await _connected(tmp_path)
    wire = server.records(b"last")
    with contextlib.suppress(ssl.SSLWantReadError):
        server.tls.unwrap()  # close_notify, then it waits for the client's
    assert client.decrypt(wire + server.outgoing.read()) == b"last"
    assert client.closed
    client, server = await _connected(tmp_path)
    assert client.decrypt(server.records(b"cut")) == b"cut"
    assert client.decrypt(b"") == b""  # no close_notify: an HTTPS end all the same
    assert client.closed


async def test_a_damaged_record_is_an_ssl_error(tmp_path: Path) -> None:
    client, server = await _connected(tmp_path)
    wire = bytearray(server.records(b"x" * 100))
    wire[-10] ^= 0xFF
    with pytest.raises(ssl.SSLError):
        client.decrypt(bytes(wire))


async def test_a_server_that_hangs_up_in_the_handshake_is_a_connect_error(
    tmp_path: Path,
) -> None:
    cert, _ = self_signed(tmp_path)
    client = lean_http._Tls(ssl.create_default_context(cafile=str(cert)), "localhost")

    class HangsUp:
        async def send_all(self, data: bytes) -> None:
            pass

        async def receive_some(self, max_bytes: int) -> bytes:
            return b""

    with pytest.raises(lean_http.ConnectError, match="closed the connection during the TLS"):
        await client.handshake(HangsUp())  # type: ignore[arg-type]
