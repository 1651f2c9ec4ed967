"""MCP server configuration as the host and the command line take it: ``--mcp-config``
files and ``mcp_servers=`` arguments, checked into :class:`McpServerConfig` values.

Kept apart from :mod:`greenroom.actors.tools.mcp` so that checking a configuration never
imports the MCP SDK: a host with no MCP server loads none of it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from greenroom.protocols.mcp_config import (
    McpConfigError,
    McpServerConfig,
    Report,
    env_file_values,
    merge_configs,
    parse_config_text,
    parse_servers,
)
from greenroom.protocols.wording import special_file_words

__all__ = ["EnvFileProblem", "McpConfigError", "as_configs", "load_config_files", "read_env_file"]


class EnvFileProblem(ValueError):
    """A stdio server's ``envFile`` that is not loaded: ``path`` (as read) and ``why``."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"its envFile {path} is not loaded ({why})")
        self.path = path
        self.why = why


def read_env_file(name: str) -> dict[str, str]:
    """The variables of the ``envFile`` ``name`` (R-MCP-6; blocking: call it in a thread
    from the event loop). Raises :class:`EnvFileProblem` when the file cannot be read or is
    not simple ``KEY=VALUE`` lines (:func:`~greenroom.protocols.mcp_config.env_file_values`)."""
    path = Path(name)
    try:
        if "${" in name:
            raise ValueError("its ${…} variables other than ${workspaceFolder} are not expanded")
        path = path.expanduser()
        return env_file_values(_regular_file_text(path))
    except UnicodeDecodeError:
        raise EnvFileProblem(str(path), "it is not UTF-8 text") from None
    except OSError as exc:
        raise EnvFileProblem(str(path), exc.strerror or str(exc)) from None
    except (ValueError, RuntimeError) as exc:  # RuntimeError: a ~user with no home
        raise EnvFileProblem(str(path), str(exc)) from None


MAX_ENV_FILE_BYTES = 1024 * 1024
"""The most an ``envFile`` may hold: a path to a log or a device by mistake is refused."""


def _regular_file_text(path: Path) -> str:
    """The UTF-8 text of the regular file ``path``: a FIFO (whose open would wait for a
    writer for ever) or a device (read without end) is an OSError before any read, as is
    a file past :data:`MAX_ENV_FILE_BYTES` (R-SEC-1)."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
    if not stat.S_ISREG(mode):  # not opened: opening a device may act on it
        raise OSError(0, special_file_words(mode))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        opened = os.fstat(fd).st_mode
        if not stat.S_ISREG(opened):  # replaced since
            raise OSError(0, special_file_words(opened))
        data = file.read(MAX_ENV_FILE_BYTES + 1)
    if len(data) > MAX_ENV_FILE_BYTES:
        raise OSError(0, "it is larger than 1 MiB")
    return data.decode("utf-8")


def load_config_files(
    paths: Iterable[str | Path], report: Report | None = None
) -> dict[str, McpServerConfig]:
    """The servers of ``--mcp-config`` files, in order (blocking file reads: call it before
    the event loop starts, or in a thread). Raises :class:`McpConfigError` naming the file
    and, for bad content, the JSON path. With ``report``, a bad or repeated server entry is
    reported through it and skipped instead (R-MCP-6), as are ignored settings; a file that
    cannot be read or is not JSON still raises. With ``report``, a stdio server's
    ``envFile`` that cannot be loaded now is reported too, naming the server and the file
    (the server still loads, and starts without it while the file stays so)."""
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
        servers = parse_config_text(text, str(item), report)
        if report is not None:
            servers = {name: _check_env_file(config, str(item), report)
                       for name, config in servers.items()}
        parts.append((str(item), servers))
    return merge_configs(parts, report)


def _check_env_file(config: McpServerConfig, source: str, report: Report) -> McpServerConfig:
    """``config``, its ``envFile`` read once now so that a problem with it is reported with
    the configuration's others rather than only logged when the server starts; the
    problem is kept on the config so that the start does not report it again."""
    if config.env_file is None:
        return config
    try:
        read_env_file(config.env_file)
    except EnvFileProblem as problem:
        report(f"{source}: server {config.name!r}: {problem}; it starts without it")
        return attrs.evolve(config, env_file_noted=problem.why)
    return config


def as_configs(mcp_servers: Mapping[str, Any]) -> dict[str, McpServerConfig]:
    """``host.create_session(mcp_servers=…)``: server entries as in a config file's
    ``mcpServers`` (dicts) or already parsed. Raises :class:`McpConfigError`."""
    return parse_servers(mcp_servers, source="mcp_servers", path="$")
