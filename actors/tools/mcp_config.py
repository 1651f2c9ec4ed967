"""MCP server configuration as the host and the command line take it: ``--mcp-config``
files and ``mcp_servers=`` arguments, checked into :class:`McpServerConfig` values.

Kept apart from :mod:`greenroom.actors.tools.mcp` so that checking a configuration never
imports the MCP SDK: a host with no MCP server loads none of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from greenroom.protocols.mcp_config import (
    McpConfigError,
    McpServerConfig,
    Report,
    merge_configs,
    parse_config_text,
    parse_servers,
)

__all__ = ["McpConfigError", "as_configs", "load_config_files"]


def load_config_files(
    paths: Iterable[str | Path], report: Report | None = None
) -> dict[str, McpServerConfig]:
    """The servers of ``--mcp-config`` files, in order (blocking file reads: call it before
    the event loop starts, or in a thread). Raises :class:`McpConfigError` naming the file
    and, for bad content, the JSON path. With ``report``, a bad or repeated server entry is
    reported through it and skipped instead (R-MCP-6), as are ignored settings; a file that
    cannot be read or is not JSON still raises."""
    parts: list[tuple[str, dict[str, McpServerConfig]]] = []
    for item in paths:
        path = Path(item).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise McpConfigError(f"{item}: no such file") from None
        except IsADirectoryError:
            raise McpConfigError(f"{item}: is a directory, not a file") from None
        except UnicodeDecodeError:
            raise McpConfigError(f"{item}: not UTF-8 text") from None
        except OSError as exc:
            raise McpConfigError(f"{item}: cannot be read: {exc.strerror or exc}") from None
        parts.append((str(item), parse_config_text(text, str(item), report)))
    return merge_configs(parts, report)


def as_configs(mcp_servers: Mapping[str, Any]) -> dict[str, McpServerConfig]:
    """``host.create_session(mcp_servers=…)``: server entries as in a config file's
    ``mcpServers`` (dicts) or already parsed. Raises :class:`McpConfigError`."""
    return parse_servers(mcp_servers, source="mcp_servers", path="$")
