"""One JSON frame per line over a pair of trio byte streams: the editor's side of the
ACP tests' stdio."""

from __future__ import annotations

import json
from typing import Any

import trio


class NdjsonPeer:
    """Writes and reads newline-delimited JSON frames."""

    def __init__(self, send: trio.abc.SendStream, receive: trio.abc.ReceiveStream) -> None:
        self._send = send
        self._receive = receive
        self._buffer = b""

    async def write(self, frame: dict[str, Any]) -> None:
        """Send one frame as one line."""
        await self._send.send_all((json.dumps(frame) + "\n").encode())

    async def read(self) -> dict[str, Any]:
        """The next frame; fails the test when the agent has closed its output."""
        while b"\n" not in self._buffer:
            data = await self._receive.receive_some()
            assert data, "the agent closed its output"
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        frame: dict[str, Any] = json.loads(line)
        return frame
