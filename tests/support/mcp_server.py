"""A small MCP server for the tests, written with the SDK's own server API (``MCPServer``).

    python tests/support/mcp_server.py            # stdio
    python tests/support/mcp_server.py --http     # streamable HTTP on 127.0.0.1, port 0:
                                                  # prints "PORT <n>" first on stdout
    python tests/support/mcp_server.py --sse      # the legacy HTTP+SSE transport, likewise;
                                                  # a message calling tool "http_500" is
                                                  # answered HTTP 500 before the server sees it
    python tests/support/mcp_server.py --http --json  # JSON bodies instead of SSE

Tools: ``echo`` (read-only), ``structured``, ``image``, ``resource``, ``fail`` (isError),
``crash`` (the process exits mid-call), ``pid``, ``block``/``ro_block`` (block until
``release`` with the same key, reporting progress "started" first), ``hang`` (blocks
forever; records its key in ``cancelled`` when the client cancels it), ``cancelled``,
``calls`` (the names called so far), ``add_tool`` (adds a tool and sends
``notifications/tools/list_changed``), ``bad_schema`` (listed with an unusable schema) and
``flood`` (sends ``notifications/tools/list_changed`` a given number of times),
``big`` (a text of the given number of MiB), ``big_log`` (a log message of that many MiB before
its result), ``noise`` (over stdio, writes a line that is not UTF-8 and one that is
not JSON to the wire before its result), ``linger`` (starts a child process and keeps the
server from exiting when its stdin closes; the child's pid), ``leave_child`` (starts a child
process that outlives this one, which exits as usual when its stdin closes; the child's pid),
``listings`` (how many ``tools/list`` requests it has answered),
``order`` (asks the client which size and how many, by elicitation, and says what it was
told; a cancellation is recorded in ``cancelled`` as ``order:<item>``), ``sent_key``
(the idempotency key the call's ``_meta`` carried, as the server received it), ``client``
(the client's name, version and capabilities from ``initialize``) and ``roots`` (the
client's roots, asked for with ``roots/list``). Resources ``greenroom://notes`` (text) and
``greenroom://counter`` (counts its reads: ``read N of process PID``) and ``greenroom://slow``
(never answers); prompt ``review``
(arguments ``path``, required, and ``tone``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any, Literal

import anyio
from mcp.server.elicitation import AcceptedElicitation, DeclinedElicitation
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import (
    EmbeddedResource,
    ImageContent,
    TextContent,
    TextResourceContents,
    ToolAnnotations,
)
from pydantic import BaseModel, Field

READ_ONLY = ToolAnnotations(read_only_hint=True)
PNG_1PX = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)

server = MCPServer("greenroom-test")
wire: int | None = None
"""Over stdio, a descriptor of the pipe the SDK writes its messages to (it moves fd 1 away)."""
events: dict[str, anyio.Event] = {}
cancelled_keys: list[str] = []
called: list[str] = []


def _event(key: str) -> anyio.Event:
    return events.setdefault(key, anyio.Event())


@server.tool(annotations=READ_ONLY)
def echo(text: str) -> str:
    """Echo the text back."""
    called.append("echo")
    return text


@server.tool()
def big(mebibytes: int) -> str:
    """A text of ``mebibytes`` MiB: an oversized message for the client's bound."""
    called.append("big")
    return "x" * (mebibytes << 20)


@server.tool()
async def big_log(mebibytes: int, ctx: Context) -> str:
    """A log message (a notification) of ``mebibytes`` MiB, then a short result."""
    called.append("big_log")
    await ctx.info("x" * (mebibytes << 20))
    return "after the log"


@server.tool()
def linger() -> int:
    """Start a child process, and a thread that keeps this process from exiting when its
    stdin closes (it is never joined); the child's pid."""
    called.append("linger")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    threading.Thread(target=threading.Event().wait).start()
    return child.pid


@server.tool()
def leave_child() -> int:
    """Start a child process that this one never waits for; the child's pid."""
    called.append("leave_child")
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


@server.tool()
def noise() -> str:
    """Write a line that is not UTF-8 and one that is not JSON to the client, then answer."""
    called.append("noise")
    if wire is None:
        raise ToolError("noise is written over stdio only")
    os.write(wire, b"\xff\xfe not utf-8\nnot json\n")
    return "after the noise"


@server.tool()
def structured(a: int, b: int) -> dict[str, int]:
    """Add two numbers, as structured content."""
    called.append("structured")
    return {"sum": a + b}


@server.tool()
def image() -> list[Any]:
    """A one-pixel PNG and a caption."""
    called.append("image")
    return [TextContent(type="text", text="a pixel"),
            ImageContent(type="image", data=PNG_1PX, mime_type="image/png")]


@server.tool()
def resource() -> list[Any]:
    """An embedded text resource."""
    called.append("resource")
    return [EmbeddedResource(type="resource", resource=TextResourceContents(
        uri="file:///notes.txt", mime_type="text/plain", text="the notes"))]


@server.tool()
def http_500() -> str:
    """Over ``--sse`` never called: the POST calling it is answered HTTP 500."""
    called.append("http_500")
    return "not refused"


@server.tool()
def redirect_loop() -> str:
    """Over ``--sse`` never called: the POST calling it is redirected (307) to itself, for
    ever."""
    called.append("redirect_loop")
    return "not redirected"


@server.tool()
def fail(message: str) -> str:
    """Fail with the message."""
    called.append("fail")
    raise ToolError(message)


@server.tool()
def crash() -> str:
    """Exit the server process in the middle of the call."""
    sys.stdout.flush()
    os._exit(3)


@server.tool(annotations=READ_ONLY)
def pid() -> int:
    """The server's process id."""
    return os.getpid()


async def _block(key: str, ctx: Context) -> str:
    called.append(f"block:{key}")
    await ctx.report_progress(0, 1, f"started {key}")
    await _event(key).wait()
    return f"released {key}"


@server.tool()
async def block(key: str, ctx: Context) -> str:
    """Block until release(key); not read-only."""
    return await _block(key, ctx)


@server.tool(annotations=READ_ONLY)
async def ro_block(key: str, ctx: Context) -> str:
    """Block until release(key); read-only."""
    return await _block(key, ctx)


@server.tool(annotations=READ_ONLY)
def release(key: str) -> str:
    """Release the blocked calls with this key."""
    _event(key).set()
    return f"released {key}"


@server.tool()
async def hang(key: str, ctx: Context) -> str:
    """Block forever (after a progress note); a cancellation is recorded."""
    called.append(f"hang:{key}")
    await ctx.report_progress(0, None, f"hanging {key}")
    try:
        await anyio.sleep_forever()
    finally:
        cancelled_keys.append(key)
    return "never"


class Size(BaseModel):
    size: Literal["S", "M", "L"] = Field(description="The size")
    quantity: int = Field(default=1, ge=1, description="How many")


@server.tool()
async def order(item: str, ctx: Context) -> str:
    """Order an item, asking the client which size and how many (elicitation)."""
    called.append(f"order:{item}")
    try:
        answer = await ctx.elicit(f"Which size of {item}?", schema=Size)
    except anyio.get_cancelled_exc_class():
        cancelled_keys.append(f"order:{item}")
        raise
    if isinstance(answer, AcceptedElicitation):
        return f"ordered {answer.data.quantity} {answer.data.size} {item}"
    return "declined" if isinstance(answer, DeclinedElicitation) else "cancelled"


@server.tool()
def sent_key(ctx: Context) -> str:
    """The ``greenroom/idempotency_key`` that this call's ``_meta`` carried."""
    called.append("sent_key")
    meta: Any = ctx.request_context.meta or {}
    return str(meta.get("greenroom/idempotency_key"))


@server.tool(annotations=READ_ONLY)
def client(ctx: Context) -> str:
    """How the client introduced itself in ``initialize``: name, version, capabilities."""
    params: Any = ctx.session.client_params
    return json.dumps({
        "name": params.client_info.name,
        "version": params.client_info.version,
        "capabilities": params.capabilities.model_dump(by_alias=True, exclude_none=True),
    })  # fmt: skip


@server.tool(annotations=READ_ONLY)
async def roots(ctx: Context) -> str:
    """The client's roots (``roots/list``), as a JSON array of {uri, name}."""
    result = await ctx.session.list_roots()
    return json.dumps([{"uri": str(r.uri), "name": r.name} for r in result.roots])


@server.tool(annotations=READ_ONLY)
def cancelled() -> str:
    """The keys of the hang calls that were cancelled (a JSON array)."""
    return json.dumps(cancelled_keys)


@server.tool(annotations=READ_ONLY)
def calls() -> str:
    """The tools called so far (a JSON array)."""
    return json.dumps(called)


@server.tool()
async def add_tool(tool: str, ctx: Context) -> str:
    """Add a tool that answers its own name, and tell the client the list changed."""

    def added() -> str:
        return f"I am {tool}"

    server.add_tool(added, name=tool, description=f"the added tool {tool}")
    await ctx.session.send_tool_list_changed()
    return f"added {tool}"


@server.tool()
async def flood(count: int, ctx: Context) -> str:
    """Tell the client ``count`` times that the tool list changed."""
    for _ in range(count):
        await ctx.session.send_tool_list_changed()
    return f"sent {count}"


listed = [0]
_list_tools = server._tool_manager.list_tools


def _counted_list_tools() -> Any:
    listed[0] += 1
    return _list_tools()


server._tool_manager.list_tools = _counted_list_tools  # type: ignore[method-assign]


@server.tool(annotations=READ_ONLY)
def listings() -> str:
    """How many tools/list requests the server has answered."""
    return str(listed[0])


@server.tool()
def bad_schema(x: str) -> str:
    """Listed with a schema whose property type is not a JSON type."""
    return x


server._tool_manager.get_tool("bad_schema").parameters = {  # type: ignore[union-attr]
    "type": "object",
    "properties": {"x": {"type": "file"}},
}


@server.resource("greenroom://notes", name="notes", description="The team's notes",
                 mime_type="text/plain")
def notes() -> str:
    """A text resource."""
    return "the notes say: ship on Friday"


reads: list[str] = []


@server.resource("greenroom://counter", name="counter", description="How often it was read",
                 mime_type="text/plain")
def counter() -> str:
    """A text resource that counts its reads: which server process a read reached."""
    reads.append("counter")
    return f"read {len(reads)} of process {os.getpid()}"


@server.resource("greenroom://slow", name="slow", description="Never answers",
                 mime_type="text/plain")
async def slow() -> str:
    """A resource whose read waits until the client gives up on it."""
    await anyio.sleep_forever()
    return "never"


@server.prompt(description="Review a file, in the given tone")
def review(path: str, tone: str = "kind") -> str:
    """A prompt with a required and an optional argument."""
    return f"Review {path} in a {tone} tone."


def answer_500_to_http_500(app: Any) -> Any:
    """``app`` (ASGI), but a POST of a message that calls the tool ``http_500`` is answered
    HTTP 500 (as a failing server or proxy would) before the server sees it, and one that
    calls ``redirect_loop`` is redirected to its own URL (307, which keeps the message)."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        received = [await receive()]
        while received[-1].get("more_body"):
            received.append(await receive())
        message = json.loads(b"".join(part.get("body", b"") for part in received))
        if message.get("params", {}).get("name") == "http_500":
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"text/plain")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"the server failed"})
            return None
        if message.get("params", {}).get("name") == "redirect_loop":
            query = scope["query_string"].decode()
            here = scope["path"] + (f"?{query}" if query else "")
            await send({"type": "http.response.start", "status": 307,
                        "headers": [(b"location", here.encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": b""})
            return None
        replay = iter(received)

        async def receive_again() -> Any:
            return next(replay, None) or await receive()

        return await app(scope, receive_again, send)

    return wrapped


def main() -> None:
    global wire
    if "--http" not in sys.argv and "--sse" not in sys.argv:
        wire = os.dup(1)  # not inherited by children (PEP 446): they cannot hold the pipe
        server.run()
        return
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    if "--sse" in sys.argv:
        app = answer_500_to_http_500(server.sse_app())
    else:
        app = server.streamable_http_app(json_response="--json" in sys.argv)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
