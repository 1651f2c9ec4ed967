"""A host's MCP servers (R-MCP-1): the manager of their processes is started with the
first session that names one, in the host's nursery, so a host without MCP servers never
loads the MCP SDK."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from greenroom.actors.runtime.port import SessionPort

if TYPE_CHECKING:
    from greenroom.actors.tools.mcp import McpConnection, McpManager

__all__ = ["McpServers"]


class McpServers:
    """The MCP servers of one host; see the module docstring."""

    __slots__ = ("_directory", "_manager", "_start_soon")

    def __init__(
        self, directory: Path, start_soon: Callable[[Callable[[], Awaitable[None]]], None]
    ) -> None:
        self._directory = directory
        self._start_soon = start_soon
        self._manager: McpManager | None = None

    async def attach(self, port: SessionPort, configs: dict[str, Any]) -> None:
        """Give the session its MCP servers' tools, starting the manager if need be."""
        # Imported here: the MCP SDK is loaded only by a host that has an MCP server.
        from greenroom.actors.tools.mcp import McpManager, attach_servers

        manager = self._manager
        if manager is None:
            manager = self._manager = McpManager(self._directory)
            self._start_soon(manager.run)
        await manager.wait_started()
        await attach_servers(manager, port, configs)

    def connections(self) -> list[McpConnection]:
        """The servers' connections now (none before the first server started)."""
        return [] if self._manager is None else self._manager.connections()

    async def release(self, session_id: str) -> None:
        """The session was closed: its share of the servers is released."""
        if self._manager is not None:
            await self._manager.release(session_id)

    async def aclose(self) -> None:
        """Stop every server (the host is closing)."""
        if self._manager is not None:
            await self._manager.aclose()
