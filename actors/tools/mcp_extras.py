"""MCP beyond tools (R-MCP-5): the roots a server is given, its resources and its prompts.

Kept apart from :mod:`greenroom.actors.tools.mcp` (which owns the connections) so that each
part stays one job: this module lists what a server offers besides tools, reads a resource
or a prompt through a client session it is handed, and turns the answers into content
blocks. Nothing here holds a connection open.

* Roots: the workspaces of the sessions using a connection (:class:`WorkspaceRoots`).
* Resources: listed when the server declares the capability; the model reads one with a
  ``mcp__<server>__read_resource`` tool (:func:`read_resource_tool`, offered only by a
  server that has resources), through which a prompt's ``@server:uri`` attachments are read
  (:mod:`greenroom.actors.tools.mcp_commands`).
* Prompts: listed likewise; :func:`prompt_messages` expands one into the text of its
  messages (chat's ``/server:prompt arg=value``, parsed in :mod:`…mcp_commands`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import mcp_types
import trio
from mcp import ClientSession
from mcp.client import ClientRequestContext

from greenroom.actors.tools.mcp_commands import READ_RESOURCE, McpPromptInfo, McpResourceInfo
from greenroom.protocols.content import TextBlock, ToolContent
from greenroom.protocols.mcp_config import tool_name
from greenroom.protocols.tools import Tool

__all__ = [
    "McpPromptInfo",
    "McpResourceInfo",
    "WorkspaceRoots",
    "fetch_prompts",
    "fetch_resources",
    "prompt_messages",
    "read_resource_tool",
    "resource_text",
]


MAX_LISTED = 50
"""How many resources the read tool's description names (a long list would fill every
request's prefix); the others are still readable by URI."""

MAX_PAGES = 1000
"""A server that pages forever is not followed forever."""


# -- roots -----------------------------------------------------------------------------------


class WorkspaceRoots:
    """The roots of one connection: the workspace of each session using it, by session id.
    ``changed`` is called (synchronously) whenever the list of roots changes."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self._workspaces: dict[str, Path] = {}
        self._changed = changed

    def add(self, session_id: str, workspace: Path) -> None:
        """A session using the connection works in ``workspace``."""
        self._update(lambda: self._workspaces.__setitem__(session_id, workspace))

    def drop(self, session_id: str) -> None:
        """The session no longer uses the connection: its workspace stops being a root
        (unless another session works there too)."""
        self._update(lambda: self._workspaces.pop(session_id, None))

    def roots(self) -> list[mcp_types.Root]:
        """Each workspace once, as a ``file://`` root named after its directory."""
        seen: dict[str, mcp_types.Root] = {}
        for workspace in self._workspaces.values():
            path = workspace.absolute()
            root = {"uri": path.as_uri(), "name": path.name}  # validated into the SDK's FileUrl
            seen.setdefault(path.as_uri(), mcp_types.Root.model_validate(root))
        return list(seen.values())

    async def answer(self, context: ClientRequestContext) -> mcp_types.ListRootsResult:
        """``roots/list`` from the server (the SDK's ``list_roots_callback``)."""
        await trio.lowlevel.checkpoint()
        return mcp_types.ListRootsResult(roots=self.roots())

    def _update(self, change: Callable[[], object]) -> None:
        before = self.roots()
        change()
        if self.roots() != before:
            self._changed()


# -- resources -------------------------------------------------------------------------------


async def fetch_resources(session: ClientSession) -> tuple[McpResourceInfo, ...]:
    """Every resource the server lists (``resources/list``, all pages)."""
    found: list[McpResourceInfo] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        params = None if cursor is None else mcp_types.PaginatedRequestParams(cursor=cursor)
        result = await session.list_resources(params=params)
        found.extend(
            McpResourceInfo(uri=str(item.uri), name=item.name,
                            description=item.description, mime_type=item.mime_type)
            for item in result.resources
        )  # fmt: skip
        cursor = result.next_cursor
        if not cursor:
            break
    return tuple(found)


def resource_text(server: str, result: mcp_types.ReadResourceResult) -> str:
    """A ``resources/read`` answer as text: each part's text under a line naming its URI;
    a binary part is named with its type and size, not inlined."""
    parts: list[str] = []
    for item in result.contents:
        if isinstance(item, mcp_types.TextResourceContents):
            parts.append(f"[resource {item.uri} of MCP server {server!r}]\n{item.text}")
        else:
            mime = item.mime_type or "application/octet-stream"
            parts.append(f"[resource {item.uri} of MCP server {server!r}: binary {mime}, "
                         f"{len(item.blob) * 3 // 4} bytes, not shown as text]")
    return "\n\n".join(parts) or f"[resource of MCP server {server!r}: empty]"


def read_resource_tool(
    server: str,
    resources: tuple[McpResourceInfo, ...],
    read: Callable[[str], Awaitable[str]],
) -> Tool:
    """The tool the model reads ``server``'s resources with, by URI; its description
    names the resources (up to :data:`MAX_LISTED`). Reading changes nothing, so it may
    run beside other calls."""
    lines = [f"- {r.uri}" + (f" ({r.name})" if r.name and r.name != r.uri else "")
             + (f": {r.description}" if r.description else "")
             for r in resources[:MAX_LISTED]]  # fmt: skip
    if len(resources) > MAX_LISTED:
        lines.append(f"- … and {len(resources) - MAX_LISTED} more")
    description = (f"Read a resource of the MCP server {server!r} by its URI. "
                   "Its resources:\n" + "\n".join(lines))

    async def read_resource(uri: str) -> tuple[ToolContent, ...]:
        return (TextBlock(text=await read(uri)),)

    return Tool(
        name=tool_name(server, READ_RESOURCE),
        description=description,
        input_schema={
            "type": "object",
            "properties": {"uri": {"type": "string", "description": "The resource's URI"}},
            "required": ["uri"],
        },
        parallel=True,
        side_effects=False,
        function=read_resource,
        takes_ctx=False,
    )


# -- prompts ---------------------------------------------------------------------------------


async def fetch_prompts(session: ClientSession) -> tuple[McpPromptInfo, ...]:
    """Every prompt the server lists (``prompts/list``, all pages)."""
    found: list[McpPromptInfo] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        params = None if cursor is None else mcp_types.PaginatedRequestParams(cursor=cursor)
        result = await session.list_prompts(params=params)
        found.extend(
            McpPromptInfo(name=item.name, description=item.description,
                          arguments=tuple((a.name, bool(a.required))
                                          for a in item.arguments or ()))
            for item in result.prompts
        )  # fmt: skip
        cursor = result.next_cursor
        if not cursor:
            break
    return tuple(found)


def prompt_messages(result: mcp_types.GetPromptResult) -> str:
    """A ``prompts/get`` answer as the text the person sends: each message's text (a
    resource's text inlined; other content named), an assistant message marked as such."""
    parts: list[str] = []
    for message in result.messages:
        content = message.content
        if isinstance(content, mcp_types.TextContent):
            body = content.text
        elif isinstance(content, mcp_types.EmbeddedResource) and isinstance(
            content.resource, mcp_types.TextResourceContents
        ):
            body = f"[resource {content.resource.uri}]\n{content.resource.text}"
        else:
            body = f"[{content.type} content, not shown as text]"
        parts.append(body if message.role == "user" else f"[{message.role}]\n{body}")
    return "\n\n".join(parts)
