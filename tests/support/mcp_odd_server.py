"""An MCP server that misbehaves in the ways real ones do, written with the SDK's own server
API (``MCPServer``), for the failures ``tests/support/mcp_server.py`` does not show.

    python tests/support/mcp_odd_server.py                   # stdio
    python tests/support/mcp_odd_server.py --hang-init       # stdio, never answers initialize
    python tests/support/mcp_odd_server.py --sse-no-endpoint # legacy HTTP+SSE on 127.0.0.1,
        # port 0 (prints "PORT <n>" first): its event stream never names the endpoint to
        # post to, and sends keep-alives instead

Tools: ``total`` (its listed output schema asks for a key its structured content never
gives), ``span`` (listed with draft-07's tuple form of ``items``, as zod-to-json-schema
writes ``z.tuple``), ``env`` (the value of an environment variable, "" when unset).
Resources: ``odd://hello`` (``hello from PID``), ``odd://crash`` (the process exits while
it is read) and ``odd://freeze`` (the process stops itself, SIGSTOP, while it is read: it
answers nothing more, pings included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer


@contextlib.asynccontextmanager
async def _hang_forever(_: Any) -> AsyncIterator[dict[str, Any]]:
    # The lifespan runs before the server answers initialize: it never will.
    await anyio.sleep_forever()
    yield {}


server = MCPServer("odd", lifespan=_hang_forever if "--hang-init" in sys.argv else None)


@server.tool()
def total(a: int, b: int) -> dict[str, int]:
    """Add; the output schema it is listed with asks for ``total``, it gives ``sum``."""
    return {"sum": a + b}


@server.tool()
def span(p: list[float]) -> str:
    """The distance between the two ends of a span ``[start, end]``."""
    return f"{p[1] - p[0]:g}"


@server.tool()
def env(name: str) -> str:
    """The value of environment variable ``name`` ("" when it is not set)."""
    return os.environ.get(name, "")


def _list_with(tool: str, key: str, schema: dict[str, Any]) -> None:
    # The SDK derives schemas from the annotations; these tools are listed as other
    # servers' SDKs write them.
    registered: Any = server._tool_manager.get_tool(tool)
    if key == "output":
        registered.fn_metadata.output_schema = schema
    else:
        registered.parameters = schema


_list_with("total", "output", {
    "type": "object",
    "properties": {"total": {"type": "integer"}},
    "required": ["total"],
})
_list_with("span", "input", {
    "type": "object",
    "properties": {"p": {"type": "array", "minItems": 2, "maxItems": 2,
                         "items": [{"type": "number"}, {"type": "number"}],
                         "additionalItems": False}},
    "required": ["p"],
})


@server.resource("odd://hello", name="hello", mime_type="text/plain")
def hello() -> str:
    """Which process answered."""
    return f"hello from {os.getpid()}"


@server.resource("odd://crash", name="crash", mime_type="text/plain")
def crash() -> str:
    """The process exits while this is read."""
    os._exit(3)


@server.resource("odd://freeze", name="freeze", mime_type="text/plain")
def freeze() -> str:
    """The process stops itself while this is read (only SIGKILL or SIGCONT ends that)."""
    os.kill(os.getpid(), signal.SIGSTOP)
    return "thawed"


def _without_endpoint(app: Any) -> Any:
    """The SDK's SSE app, but its ``endpoint`` event goes out as a keep-alive comment: a
    server (or a proxy before it) that holds the stream open and never says where to post."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        async def send_filtered(message: Any) -> None:
            body = message.get("body", b"")
            if message.get("type") == "http.response.body" and b"event: endpoint" in body:
                message = {**message, "body": b": keep-alive\r\n\r\n"}
            await send(message)

        await app(scope, receive, send_filtered)

    return wrapped


def _serve_sse_without_endpoint() -> None:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    app = _without_endpoint(server.sse_app())
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    if "--sse-no-endpoint" in sys.argv:
        _serve_sse_without_endpoint()
    else:
        server.run()
