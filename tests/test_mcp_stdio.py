"""greenroom's stdio transport for MCP servers (R-SEC-1, R-SEC-9, R-MCP-4): the line splitter
and the response-id scan on their own, then the transport under the SDK's ``ClientSession``
against the SDK-built test server (``tests/support/mcp_server.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import mcp_types
import pytest
import trio
from conftest import RUN_TIMEOUT_S
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import FORCE_KILL_TIMEOUT, PROCESS_TERMINATION_TIMEOUT
from mcp.shared.exceptions import MCPError

from greenroom.actors.tools.mcp_bounds import MAX_MESSAGE_BYTES
from greenroom.actors.tools.mcp_stdio import (
    HEAD_BYTES,
    TAIL_BYTES,
    MessageLines,
    OversizedLine,
    bounded_stdio_client,
    response_id,
)
from tests.test_mcp import SERVER, alive

PARAMS = StdioServerParameters(command=sys.executable, args=[str(SERVER)])

TS_ORDER_SERVER = """
import json, sys
# Answers as the TypeScript SDK writes (JSON.stringify of {result, jsonrpc, id}): the id
# last. Tool "big" answers 3 MiB of text; any other tool echoes its "text".
for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue
    method, params = message["method"], message.get("params", {})
    if method == "initialize":
        result = {"protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "ts-order", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [{"name": name, "inputSchema": {"type": "object"}}
                            for name in ("big", "echo")]}
    elif params.get("name") == "big":
        result = {"content": [{"type": "text", "text": "x" * (3 << 20)}]}
    else:
        result = {"content": [{"type": "text", "text": params["arguments"]["text"]}]}
    answer = {"result": result, "jsonrpc": "2.0", "id": message["id"]}
    sys.stdout.write(json.dumps(answer) + "\\n")
    sys.stdout.flush()
"""
"""A hand-written stdio MCP server whose answers name their id after their result."""


@contextlib.asynccontextmanager
async def server_session(
    tmp_path: Path, lines: MessageLines | None = None, params: StdioServerParameters = PARAMS
) -> AsyncIterator[ClientSession]:
    """The test server (or the one ``params`` names) over :func:`bounded_stdio_client`,
    initialized; its stderr in ``tmp_path``."""
    with (tmp_path / "server.stderr.log").open("a", encoding="utf-8") as errlog:
        async with bounded_stdio_client(params, errlog=errlog, lines=lines) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                yield session


def text_of(result: mcp_types.CallToolResult) -> str:
    (block,) = result.content
    assert isinstance(block, mcp_types.TextContent)
    return block.text


def gone(pid: int) -> bool:
    """The process has exited: reaped, or a zombie whose reaping is its new parent's (an
    orphan's is PID 1's, which may never do it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# -- lines (no I/O) ------------------------------------------------------------------------


def test_lines_are_split_across_reads_and_a_long_one_is_discarded_as_it_arrives() -> None:
    lines = MessageLines(limit=8)
    assert lines.feed(b'{"a"') == []
    assert lines.feed(b":1}\nab") == [b'{"a":1}']
    assert lines.feed(b"cdefghijkl") == []  # 12 bytes: past the limit, so no longer kept
    assert lines.feed(b"mn\n12345678\n\n") == [
        OversizedLine(head=b"abcdefghijkl", tail=b"abcdefghijklmn", size=14),
        b"12345678",  # exactly the limit is kept
        b"",
    ]
    assert lines.most_kept == 8
    assert lines.feed(b"tail without a newline") == []


def test_the_head_and_tail_of_a_discarded_line_are_bounded() -> None:
    lines = MessageLines(limit=HEAD_BYTES * 2)
    assert lines.feed(b"a" * HEAD_BYTES * 3) == []
    assert lines.feed(b"b" * (TAIL_BYTES - 2) + b"\n") == [
        OversizedLine(
            head=b"a" * HEAD_BYTES,
            tail=b"aa" + b"b" * (TAIL_BYTES - 2),
            size=HEAD_BYTES * 3 + TAIL_BYTES - 2,
        )
    ]
    assert lines.most_kept == 0


def test_the_tail_of_a_discarded_line_is_its_end_across_small_reads() -> None:
    """The tail is kept across reads of any size, from the line kept before the bound
    was passed too; a later line starts afresh."""
    lines = MessageLines(limit=8)
    assert lines.feed(b"0123456") == []
    for digit in b"789":
        assert lines.feed(bytes([digit])) == []
    assert lines.feed(b"\nshort\n") == [
        OversizedLine(head=b"012345678", tail=b"0123456789", size=10),
        b"short",
    ]


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        ('{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"xx', 7),
        (' { "id" : "call-1" , "jsonrpc" : "2.0", "error" : {"message": "xx', "call-1"),
        # The server's own request or notification: its id is not one of greenroom's.
        ('{"jsonrpc":"2.0","id":3,"method":"sampling/createMessage","params":{"x', None),
        ('{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"xx', None),
        ('{"result":{"content":[{"type":"text","text":"xx', None),  # the id comes after
        ('{"jsonrpc":"2.0","id":7', None),  # cut before the result begins
        ('{"jsonrpc":"2.0","id":true,"result":{', None),
        ('{"jsonrpc":"2.0","id":1.5,"result":{', None),
        ('{"jsonrpc":"2.0","id":{"a":1},"result":{', None),
        ("xxxxxxxx", None),
        ("[1, 2", None),
    ],
)
def test_the_id_of_a_discarded_response_is_read_from_its_head(
    head: str, expected: int | str | None
) -> None:
    assert response_id(head) == expected


@pytest.mark.parametrize(
    ("head", "tail", "expected"),
    [
        # The TypeScript SDK's order: JSON.stringify of {result, jsonrpc, id}.
        ('{"result":{"content":[{"type":"text","text":"xx', 'xx"}]},"jsonrpc":"2.0","id":7}', 7),
        ('{"error":{"code":1,"message":"xx', 'xx"}, "id" : "call-\\"1\\\\" } \r', 'call-"1\\'),
        ('{"jsonrpc":"2.0","result":{"x":"xx', 'xx"},"id":7,"jsonrpc":"2.0"}', 7),
        # An id named first wins; one named null there is none.
        ('{"id":3,"result":{"x":"xx', 'xx"},"id":7}', 3),
        ('{"id":null,"result":{"x":"xx', 'xx"},"id":7}', None),
        # The server's own request: its id is not one of greenroom's.
        ('{"method":"elicitation/create","params":{"x', 'x"},"jsonrpc":"2.0","id":3}', None),
        # No id among the plain members that end it: one in the result is not the message's.
        ('{"result":{"x":"xx', 'xx","id":7}}', None),
        ('{"result":{"x":"xx', 'xx"}}', None),
        ('{"result":{"x":"xx', 'xx"},"id":true}', None),
        ('{"result":{"x":"xx', 'xx"},"id":1.5}', None),
        ('{"result":{"x":"xx', 'x,"id":7', None),  # cut: not the end of an object
        ('{"result":{"x":"xx', '"id":7}', None),  # the tail starts inside the member
        ('{"result":{"x":"xx', 'xx"id":7}', None),
        ('{"result":{"x":"xx', "", None),
    ],
)
def test_the_id_of_a_discarded_response_is_read_from_its_tail_when_it_comes_last(
    head: str, tail: str, expected: int | str | None
) -> None:
    assert response_id(head, tail) == expected


# -- the transport against a real server ---------------------------------------------------


async def test_a_line_past_the_bound_fails_its_call_and_the_next_call_works(
    tmp_path: Path,
) -> None:
    """A 3 MiB result (6 MiB on the wire: its text and its structured copy) is never held
    whole: at most MAX_MESSAGE_BYTES of it is kept; that call fails naming the bound, at
    once; the next call on the same process succeeds."""
    lines = MessageLines()
    with trio.fail_after(RUN_TIMEOUT_S * 2):
        async with server_session(tmp_path, lines) as session:
            before = text_of(await session.call_tool("pid", {}))
            with pytest.raises(MCPError, match="larger than 1 MiB") as raised:
                await session.call_tool("big", {"mebibytes": 3})
            assert raised.value.code == mcp_types.PARSE_ERROR
            assert text_of(await session.call_tool("echo", {"text": "after"})) == "after"
            assert text_of(await session.call_tool("pid", {})) == before
    assert 0 < lines.most_kept <= MAX_MESSAGE_BYTES


async def test_a_line_past_the_bound_with_its_id_last_fails_its_call_at_once(
    tmp_path: Path,
) -> None:
    """A server that names the id after the result (the TypeScript SDK's order): the
    call of a 3 MiB result fails naming the bound at once, not at its timeout, from the
    line's kept tail; the next call works."""
    script = tmp_path / "ts_order_server.py"
    script.write_text(TS_ORDER_SERVER, encoding="utf-8")
    params = StdioServerParameters(command=sys.executable, args=[str(script)])
    lines = MessageLines()
    with trio.fail_after(RUN_TIMEOUT_S):
        async with server_session(tmp_path, lines, params) as session:
            with pytest.raises(MCPError, match="larger than 1 MiB") as raised:
                await session.call_tool("big", {})
            assert raised.value.code == mcp_types.PARSE_ERROR
            assert text_of(await session.call_tool("echo", {"text": "after"})) == "after"
    assert 0 < lines.most_kept <= MAX_MESSAGE_BYTES


async def test_an_oversized_notification_is_dropped_and_the_call_goes_on(
    tmp_path: Path,
) -> None:
    """A message whose head names no id of greenroom's (here a log notification) is an
    exception for the session, which ignores it: the call it came during still gets its
    result."""
    lines = MessageLines()
    with trio.fail_after(RUN_TIMEOUT_S * 2):
        async with server_session(tmp_path, lines) as session:
            result = await session.call_tool("big_log", {"mebibytes": 2})
            assert text_of(result) == "after the log"
    assert lines.most_kept <= MAX_MESSAGE_BYTES


async def test_lines_that_are_not_utf8_or_not_json_leave_the_session_going(
    tmp_path: Path,
) -> None:
    """As the SDK does for a line it cannot parse, each is an exception item the session
    ignores (the SDK's own transport gave up on a line that was not UTF-8)."""
    with trio.fail_after(RUN_TIMEOUT_S):
        async with server_session(tmp_path) as session:
            assert text_of(await session.call_tool("noise", {})) == "after the noise"
            assert text_of(await session.call_tool("echo", {"text": "after"})) == "after"


async def test_a_cancelled_caller_still_stops_the_server(tmp_path: Path) -> None:
    """Leaving under cancellation, with a call in flight, still ends the process."""
    with trio.fail_after(RUN_TIMEOUT_S):
        with trio.CancelScope() as scope:
            async with server_session(tmp_path) as session:
                pid = int(text_of(await session.call_tool("pid", {})))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.call_tool, "hang", {"key": "k"})
                    await trio.testing.wait_all_tasks_blocked()
                    scope.cancel()
    assert scope.cancelled_caught
    assert not alive(pid)


async def test_a_server_that_outlives_its_stdin_is_killed_with_its_children(
    tmp_path: Path,
) -> None:
    """Past its grace period after stdin closes, the server's process group is terminated:
    the server and the child it started both end."""
    bound = PROCESS_TERMINATION_TIMEOUT + FORCE_KILL_TIMEOUT + RUN_TIMEOUT_S
    with trio.fail_after(bound):
        async with server_session(tmp_path) as session:
            pid = int(text_of(await session.call_tool("pid", {})))
            child = int(text_of(await session.call_tool("linger", {})))
            assert alive(child)
    assert not alive(pid)
    assert gone(child)


async def test_a_server_that_exits_in_its_grace_period_leaves_no_child_behind(
    tmp_path: Path,
) -> None:
    """A server that exits at once when its stdin closes, leaving a child it started: the
    rest of its process group is killed all the same, so no process outlives the
    transport (R-MCP-4: closing stops every server)."""
    with trio.fail_after(PROCESS_TERMINATION_TIMEOUT + RUN_TIMEOUT_S):
        async with server_session(tmp_path) as session:
            pid = int(text_of(await session.call_tool("pid", {})))
            child = int(text_of(await session.call_tool("leave_child", {})))
            ending = os.pidfd_open(child)
        try:
            assert not alive(pid)
            # The kill is sent as the transport ends; the child's end is awaited, not assumed.
            await trio.lowlevel.wait_readable(ending)
        finally:
            os.close(ending)
    assert gone(child)


KILLED_HOST = """
import importlib.util
import sys
import trio
from mcp import ClientSession, StdioServerParameters

# The transport the test imported, from its file (the checkout under test).
spec = importlib.util.spec_from_file_location("greenroom.actors.tools.mcp_stdio", sys.argv[4])
transport = importlib.util.module_from_spec(spec)
spec.loader.exec_module(transport)
bounded_stdio_client = transport.bounded_stdio_client

async def main(server, log, tool, _):
    params = StdioServerParameters(command=sys.executable, args=[server])
    with open(log, "a", encoding="utf-8") as errlog:
        async with bounded_stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                pids = [(await session.call_tool(name, {})).content[0].text
                        for name in ("pid", tool)]
                print(*pids, flush=True)
                await trio.sleep_forever()

trio.run(main, *sys.argv[1:])
"""
"""A host holding one connection to the test server: prints the server's pid and that of
the child ``argv[3]`` started, then waits to be killed. ``argv[4]`` is the transport's
file."""


@pytest.mark.parametrize("tool", ["linger", "leave_child"])
async def test_a_server_and_its_children_end_when_the_host_is_killed(
    tmp_path: Path, tool: str
) -> None:
    """R-SEC-11: the host process killed with SIGKILL (no shutdown of its own runs), the
    server and the child it started end all the same (the launcher sees its lifeline close)."""
    host = await trio.lowlevel.open_process(
        [sys.executable, "-c", KILLED_HOST, str(SERVER), str(tmp_path / "err.log"), tool,
         sys.modules[bounded_stdio_client.__module__].__file__ or ""],
        stdout=-1,
        cwd=Path(__file__).parent.parent,
    )
    left: list[int] = []
    try:
        assert host.stdout is not None
        printed = b""
        with trio.fail_after(RUN_TIMEOUT_S):
            while not printed.endswith(b"\n"):
                data = await host.stdout.receive_some()
                assert data, "the host ended before it printed the pids"
                printed += data
        left = [int(pid) for pid in printed.split()]
        endings = [os.pidfd_open(pid) for pid in left]
        host.kill()
        await host.wait()
        try:
            for ending in endings:
                with trio.move_on_after(RUN_TIMEOUT_S):  # readable once the process ends
                    await trio.lowlevel.wait_readable(ending)
        finally:
            for ending in endings:
                os.close(ending)
        assert [pid for pid in left if not gone(pid)] == []
    finally:
        host.kill()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await host.wait()
