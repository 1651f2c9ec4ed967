"""A raw HTTP/1.1 server side for tests that answer a client with bytes of their own
choosing (heads no HTTP library would write), over a real trio socket listener."""

from __future__ import annotations

import contextlib
from typing import Any

import trio

__all__ = ["read_request", "serve_answer"]


async def read_request(stream: trio.abc.Stream) -> bytes:
    """Read one request from ``stream``, its head and the body its ``content-length``
    says: its head."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += await stream.receive_some(65536)
    return head


async def serve_answer(
    listener: trio.SocketListener, answer: bytes, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer each request on ``listener`` with ``answer``, then close the connection."""
    task_status.started()
    while True:
        stream = await listener.accept()
        with contextlib.suppress(trio.BrokenResourceError):
            await read_request(stream)
            await stream.send_all(answer)
        await stream.aclose()
