"""greenroom's own stdio transport for MCP servers: one message is read up to a bound
(R-SEC-1, R-SEC-9, R-MCP-4).

The SDK's ``stdio_client`` joins what a server writes until a newline, however much that is,
and offers no place to bound it. :func:`bounded_stdio_client` runs the server the same way
(the SDK's :class:`~mcp.StdioServerParameters`, its ``get_default_environment()`` under the
server's ``env``, its ``cwd``, stderr to ``errlog``, a process group of its own) and yields
the same pair of streams for :class:`~mcp.ClientSession`, but reads raw bytes and splits the
lines itself (:class:`MessageLines`, which does no I/O): at most
:data:`~greenroom.actors.tools.mcp_bounds.MAX_MESSAGE_BYTES` of a line are kept, the bound
greenroom gives a message over streamable HTTP. The rest of a longer line is discarded as it
arrives, never held, but for its first and last few KiB. When those show it is the response
to one of greenroom's requests (its id named before its ``result``, as the Python SDK writes
it, or as its last member, as the TypeScript SDK's ``JSON.stringify`` writes it), that request
is answered with a JSON-RPC error naming the bound, so the
waiting call ends at once with an error output; otherwise the session gets an exception item
(as the SDK gives it for a line that is not JSON-RPC, or not text) and ignores it. Either way
the connection goes on.

The server runs under ``shell_launcher.py`` in its lifeline mode, the parent of every
``run_shell`` command too: the launcher passes the server its stdin, stdout and stderr,
and watches a socket whose other end only the transport holds. When the server exits, or
that end is closed — by the transport, or by the kernel when the host dies, even by SIGKILL
(R-SEC-11) — the launcher kills the server's process group and every process it left
behind (a subreaper on Linux), then exits.

Shutdown, every step bounded and shielded from the caller's cancellation so that no server
process outlives the transport: what the session already sent is flushed (at most
``FLUSH_S``), stdin is closed, the server has the SDK's ``PROCESS_TERMINATION_TIMEOUT`` to
exit, then its process group gets SIGTERM (through the launcher) and ``FORCE_KILL_TIMEOUT``
to end, then the lifeline is closed and the launcher kills it all. Meanwhile its
stdout is drained, so a server blocked writing can still read its stdin closing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TextIO

import anyio
import attrs
import mcp_types
import trio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import StdioServerParameters
from mcp.client.stdio import (
    FORCE_KILL_TIMEOUT,
    PROCESS_TERMINATION_TIMEOUT,
    get_default_environment,
)
from mcp.shared.message import SessionMessage

from greenroom.actors.tools.mcp_bounds import MAX_MESSAGE_BYTES, too_large

log = logging.getLogger("greenroom.mcp")

HEAD_BYTES = 4096
"""How much of a discarded line's start is kept to find the id of the response it was."""

TAIL_BYTES = 4096
"""How much of a discarded line's end is kept, for an id written after the ``result``."""

FLUSH_S = 0.5
"""How long the writer may take to pass on what the session sent before stdin is closed."""

REAP_S = 2.0
"""How long a killed server may take to be seen dead; only an unkillable one runs it out."""

START_S = 10.0
"""How long the launcher may take to report that the server runs (or why it does not)."""

_LAUNCHER = Path(__file__).with_name("shell_launcher.py")

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NO_ID = object()
"""No ``id`` key seen (its value may be ``null``)."""
_LITERAL_CHARS = frozenset("-+.0123456789eEtruefalsn")
"""The characters of a JSON number, true, false or null."""

Received = SessionMessage | Exception
"""What the session reads: a message, or an exception for a line that is none."""

Streams = tuple[MemoryObjectReceiveStream[Received], MemoryObjectSendStream[SessionMessage]]
"""The pair :class:`~mcp.ClientSession` takes: what it reads and what it sends."""


class WorkingDirectoryNotFound(OSError):
    """A server's ``cwd`` does not exist; its message says so (not a missing command)."""


@attrs.frozen(kw_only=True)
class OversizedLine:
    """A line longer than the bound, discarded: its first :data:`HEAD_BYTES`, its last
    :data:`TAIL_BYTES` and its size."""

    head: bytes
    tail: bytes
    size: int


class MessageLines:
    """Splits what a server writes into lines, holding at most ``limit`` bytes of one line.

    :meth:`feed` takes bytes as they arrive and gives the lines they complete: ``bytes``
    without the newline, or an :class:`OversizedLine` for a line longer than ``limit``, of
    which only the head was kept. A line the stream ends in the middle of is never given.
    """

    def __init__(self, limit: int = MAX_MESSAGE_BYTES) -> None:
        self.limit = limit
        self.most_kept = 0
        """The most bytes of one line held at once: never more than ``limit``."""
        self._line = bytearray()
        self._discarded: int | None = None
        self._head = b""
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes | OversizedLine]:
        """The lines ``data`` completes, in order."""
        lines: list[bytes | OversizedLine] = []
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._take(memoryview(data)[start:end])
            lines.append(self._finish())
            start = end + 1
        self._take(memoryview(data)[start:])
        return lines

    def _take(self, piece: memoryview) -> None:
        if self._discarded is not None:
            self._discarded += len(piece)
            self._keep_tail(piece)
        elif len(self._line) + len(piece) > self.limit:
            wanted = max(0, HEAD_BYTES - len(self._line))
            self._head = bytes(self._line[:HEAD_BYTES]) + bytes(piece[:wanted])
            self._tail = bytes(self._line[-TAIL_BYTES:])
            self._keep_tail(piece)
            self._discarded = len(self._line) + len(piece)
            self._line = bytearray()  # not clear(): give the memory back now
        else:
            self._line += piece
            self.most_kept = max(self.most_kept, len(self._line))

    def _keep_tail(self, piece: memoryview) -> None:
        # Only the piece's own end is copied: a read may bring far more than the tail.
        self._tail = (self._tail + bytes(piece[-TAIL_BYTES:]))[-TAIL_BYTES:]

    def _finish(self) -> bytes | OversizedLine:
        if self._discarded is not None:
            oversized = OversizedLine(head=self._head, tail=self._tail, size=self._discarded)
            self._discarded, self._head, self._tail = None, b"", b""
            return oversized
        line, self._line = bytes(self._line), bytearray()
        return line


def response_id(head: str, tail: str = "") -> int | str | None:
    """The id of the response to one of greenroom's requests that a discarded message was,
    from the JSON text of its start ``head`` and of its end ``tail``: named among its
    top-level keys before its ``result`` or ``error`` (the Python SDK's order), or else
    among the plain members that end it (the TypeScript SDK's order: ``result``, then
    ``jsonrpc`` and ``id``). None when neither shows it, also for a request or notification
    of the server's (an id of the server's own numbering)."""
    decoder = json.JSONDecoder()
    at = _skip_space(head, 0)
    if not head.startswith("{", at):
        return None
    found: Any = _NO_ID
    at += 1
    while True:
        try:
            key, at = decoder.raw_decode(head, _skip_space(head, at))
            at = _skip_space(head, at)
            if not isinstance(key, str) or not head.startswith(":", at):
                return None
            if key in ("result", "error"):
                # Only a response has these, so the id, if not named yet, comes after.
                return _last_id(tail) if found is _NO_ID else _usable_id(found)
            if key == "method":
                return None
            value, at = decoder.raw_decode(head, _skip_space(head, at + 1))
        except ValueError:  # the head ends inside the value (or is not JSON)
            return None
        if key == "id":
            found = value
        at = _skip_space(head, at)
        if not head.startswith(",", at):
            return None
        at += 1


def _usable_id(value: Any) -> int | str | None:
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


def _last_id(tail: str) -> int | str | None:
    """The ``id`` among the members without nested values that end the JSON object whose
    end is ``tail``, read backwards: the line's last ``}`` closes the message itself, so
    these members are top-level ones. None when a nested value or the tail's start comes
    first, or the message is a request of the server's (a ``method``)."""
    at = _space_before(tail, len(tail))
    if not tail.endswith("}", 0, at):
        return None
    at -= 1
    try:
        while True:
            value, at = _plain_value_before(tail, _space_before(tail, at))
            at = _space_before(tail, at)
            if not tail.endswith(":", 0, at):
                return None
            key, at = _plain_value_before(tail, _space_before(tail, at - 1))
            at = _space_before(tail, at)
            # A member that the tail's start may have cut counts for nothing.
            if not isinstance(key, str) or not tail.endswith((",", "{"), 0, at):
                return None
            if key == "id":
                return _usable_id(value)
            if key == "method" or tail.endswith("{", 0, at):
                return None
            at -= 1
    except ValueError:  # a nested value, the tail's start inside a value, or not JSON
        return None


def _plain_value_before(text: str, end: int) -> tuple[Any, int]:
    """The JSON string, number, true, false or null that ends at ``end`` in ``text``, and
    where it starts; ValueError when there is none (a nested value ends there)."""
    start = end
    if text.endswith('"', 0, end):
        start = end - 1
        while True:
            start = text.rfind('"', 0, start)
            if start < 0:
                raise ValueError("the string starts before the text")
            escapes = 0
            while start - escapes > 0 and text[start - escapes - 1] == "\\":
                escapes += 1
            if escapes % 2 == 0:  # an escaped quote is part of the string
                break
    else:
        while start > 0 and text[start - 1] in _LITERAL_CHARS:
            start -= 1
    return json.loads(text[start:end]), start


def _space_before(text: str, at: int) -> int:
    while at > 0 and text[at - 1] in " \t\n\r":
        at -= 1
    return at


def _skip_space(text: str, at: int) -> int:
    match = _WHITESPACE.match(text, at)
    return at if match is None else match.end()


def _message(line: bytes | OversizedLine, params: StdioServerParameters) -> Received:
    """What the session gets for one line: the message, a JSON-RPC error answering the
    request an oversized response was for, or an exception (which the session ignores)."""
    if isinstance(line, OversizedLine):
        reason = f"{too_large(MAX_MESSAGE_BYTES)}: a line of {line.size} bytes"
        head, tail = (part.decode(params.encoding, "ignore") for part in (line.head, line.tail))
        request = response_id(head, tail)
        log.warning("an MCP server's message was discarded: %s", reason)
        if request is None:
            return ValueError(reason)
        error = mcp_types.ErrorData(
            code=mcp_types.PARSE_ERROR, message=too_large(MAX_MESSAGE_BYTES)
        )
        return SessionMessage(mcp_types.JSONRPCError(jsonrpc="2.0", id=request, error=error))
    try:
        text = line.decode(params.encoding, params.encoding_error_handler)
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(text, by_name=False))
    except ValueError as exc:  # both UnicodeDecodeError and pydantic's ValidationError
        log.warning("an MCP server wrote a line that is not a JSON-RPC message: %.200s", exc)
        return exc


@contextlib.asynccontextmanager
async def bounded_stdio_client(
    params: StdioServerParameters, *, errlog: TextIO, lines: MessageLines | None = None
) -> AsyncIterator[Streams]:
    """Run the server ``params`` describes and yield ``(read_stream, write_stream)`` for a
    :class:`~mcp.ClientSession`: anyio memory object streams of ``SessionMessage |
    Exception`` and of ``SessionMessage``. ``lines`` splits the server's stdout (a fresh
    :class:`MessageLines` unless given; a test reads its ``most_kept``). The read stream ends
    when the server closes its stdout. Leaving stops the server (see the module docstring)
    even when the caller is cancelled. Raises OSError when the server cannot be started
    (:class:`WorkingDirectoryNotFound` for a ``cwd`` that does not exist)."""
    process, lifeline = await _start(params, errlog)
    stdin, stdout = process.stdin, process.stdout
    assert stdin is not None and stdout is not None
    # Buffer 0 on both: no line is read from the server before the session takes the last
    # one, and the session's send waits for the pipe as it would for the SDK's transport.
    to_session, read_stream = anyio.create_memory_object_stream[Received](0)
    write_stream, from_session = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = trio.Event()
    # Shielded: the pipes keep draining and flushing while a cancelled caller's shutdown
    # runs; the shutdown itself cancels them last.
    pipes = trio.CancelScope(shield=True)

    async def run_pipes() -> None:
        with pipes:
            async with trio.open_nursery() as nursery:
                splitter = MessageLines() if lines is None else lines
                nursery.start_soon(_read_lines, stdout, splitter, to_session, params)
                nursery.start_soon(
                    _write_messages, stdin, from_session, to_session, params, writer_done
                )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_pipes)
        try:
            yield read_stream, write_stream
        finally:
            with trio.CancelScope(shield=True):
                # A reader whose delivery waits now drains instead, so that a server blocked
                # writing its stdout can read its stdin: the flush, then its closing.
                read_stream.close()
                write_stream.close()
                with trio.move_on_after(FLUSH_S):
                    await writer_done.wait()
                await _stop(process, lifeline)
                pipes.cancel()


def _launched(params: StdioServerParameters, lifeline: int, env: dict[str, str]) -> list[str]:
    """The server's command run by ``shell_launcher.py`` in its lifeline mode, with the
    environment ``env`` (the launcher's own; see its docstring)."""
    ctype = env.get("LC_CTYPE")
    return [
        sys.executable, "-I", "-S", str(_LAUNCHER), "--lifeline", str(lifeline), "-", "-", "-",
        "-" if ctype is None else f"={ctype}", params.command, *params.args,
    ]


async def _start(
    params: StdioServerParameters, errlog: TextIO
) -> tuple[Process, trio.socket.SocketType]:
    """The launcher running the server, once it reports that the server runs, and the
    host's end of its lifeline. Raises OSError as starting the server itself would."""
    ours, theirs = socket.socketpair()
    env = get_default_environment() | (params.env or {})
    try:
        process = await anyio.open_process(
            _launched(params, theirs.fileno(), env),
            env=env,
            stderr=errlog,
            cwd=params.cwd,
            start_new_session=True,
            pass_fds=(theirs.fileno(),),
        )
    except FileNotFoundError as exc:
        ours.close()
        # The child's chdir failing is reported with the cwd as the missing file: say so.
        if params.cwd is not None and exc.filename == os.fspath(params.cwd):
            raise WorkingDirectoryNotFound(f"working directory not found: {params.cwd}") from exc
        raise
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()  # only the host holds the lifeline's other end
    lifeline = trio.socket.from_stdlib_socket(ours)
    report = b""
    try:
        with trio.fail_after(START_S):
            while not report.endswith(b"\n"):
                received = await lifeline.recv(64)
                if not received:
                    break
                report += received
        code = int(report) if report.endswith(b"\n") else None
    except BaseException:
        with trio.CancelScope(shield=True):
            await _stop(process, lifeline)
        raise
    if code != 0:
        with trio.CancelScope(shield=True):
            await _stop(process, lifeline)
        if code is None:
            raise OSError(f"{params.command}: the launcher ended before starting it")
        raise OSError(code, os.strerror(code), params.command)
    return process, lifeline


async def _read_lines(
    stdout: ByteReceiveStream,
    lines: MessageLines,
    to_session: MemoryObjectSendStream[Received],
    params: StdioServerParameters,
) -> None:
    """Deliver the server's messages until its stdout ends, then drain it."""
    with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        async with to_session:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                async for data in stdout:
                    for line in lines.feed(data):
                        await to_session.send(_message(line, params))
        # The session has gone (or stdout ended): what the server still writes is read and
        # dropped, so that it is never blocked on a full pipe while it is being stopped.
        async for _ in stdout:
            pass


async def _write_messages(
    stdin: ByteSendStream,
    from_session: MemoryObjectReceiveStream[SessionMessage],
    to_session: MemoryObjectSendStream[Received],
    params: StdioServerParameters,
    done: trio.Event,
) -> None:
    """Write what the session sends, one line each, until it stops sending."""
    try:
        async with from_session:
            async for session_message in from_session:
                message = session_message.message
                text = message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await stdin.send(text.encode(params.encoding, params.encoding_error_handler))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        # The server stopped reading: end the session's read stream so that its waiting
        # requests fail now instead of at their timeouts.
        to_session.close()
    finally:
        done.set()


async def _stop(process: Process, lifeline: trio.socket.SocketType) -> None:
    """Close stdin, give the server its grace period, then SIGTERM, then close the lifeline:
    the launcher kills the server's process group and all it left behind, and exits (it
    does that too when the server exits)."""
    assert process.stdin is not None and process.stdout is not None
    with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        await process.stdin.aclose()
    if not await _exited(process, PROCESS_TERMINATION_TIMEOUT):
        # The launcher leads a group of its own and passes the signal to the server's.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        if not await _exited(process, FORCE_KILL_TIMEOUT):
            lifeline.close()
            if not await _exited(process, REAP_S):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                if not await _exited(process, REAP_S):
                    log.warning(
                        "MCP server process %d outlived its kill; abandoning it", process.pid
                    )
    lifeline.close()
    with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        await process.stdout.aclose()


async def _exited(process: Process, within_s: float) -> bool:
    # trio's wait is for the process alone, not for its pipes (which a child may hold open).
    with trio.move_on_after(within_s):
        await process.wait()
        return True
    return False


__all__ = [
    "HEAD_BYTES",
    "TAIL_BYTES",
    "MessageLines",
    "OversizedLine",
    "Received",
    "Streams",
    "WorkingDirectoryNotFound",
    "bounded_stdio_client",
    "response_id",
]
