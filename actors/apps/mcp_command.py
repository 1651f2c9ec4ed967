"""``greenroom mcp login NAME --mcp-config FILE``: log in to an HTTP MCP server that asks
for OAuth (R-MCP-5), so that sessions can use it (actors/tools/mcp_login.py does the flow,
actors/tools/mcp_auth.py keeps the tokens).

The authorization URL is printed on stdout; a browser is opened on it only when a person is
at a terminal of a desktop session (and not with ``--no-browser``): a login over SSH or in
a container prints the URL and waits, and the browser that opens it may be on another
machine as long as it can reach the loopback redirect (an SSH port forward). Exit codes: 0
logged in (or nothing to do), 1 the login failed, 2 a usage error (no such server, a
stdio server, a configuration that cannot be read), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import webbrowser
from urllib.parse import urlsplit

import trio

from greenroom.actors.apps.exits import EXIT_FAILED, EXIT_OK, UsageError, print_error
from greenroom.actors.apps.run import data_dir_from, mcp_servers
from greenroom.protocols.mcp_config import McpConfigError, McpServerConfig, parse_servers

__all__ = ["mcp_command"]


def mcp_command(args: argparse.Namespace) -> int:
    """Run ``greenroom mcp ACTION``; the exit code."""
    if args.mcp_command == "login":
        return login_command(args)
    raise UsageError(f"unknown mcp action {args.mcp_command!r}")


def login_command(args: argparse.Namespace) -> int:
    """``greenroom mcp login``: see the module docstring."""
    config = _server(args.name, args.mcp_config)
    # Imported here: the MCP SDK is loaded only by a command that talks to a server.
    from greenroom.actors.tools import McpLoginError, login_to_mcp_server, mcp_login_problem

    problem = mcp_login_problem(config)
    if problem is not None:
        raise UsageError(problem)
    browser = not args.no_browser and _desktop_terminal()

    async def show(url: str, redirect_uri: str) -> None:
        print(f"Open this URL in a browser to authorize greenroom for MCP server "
              f"{args.name!r} ({config.url}):\n\n  {url}\n", flush=True)  # fmt: skip
        if browser:
            # A thread of its own: some browsers' launchers return only when they exit.
            threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
        print(f"Waiting for the browser to come back to {redirect_uri} "
              "(Ctrl-C to give up) …", flush=True)  # fmt: skip

    try:
        result = trio.run(login_to_mcp_server, config, data_dir_from(args.data_dir), show)
    except McpLoginError as exc:
        print_error(f"greenroom mcp login: {args.name}: {exc}")
        return EXIT_FAILED
    if not result.stored:
        print(f"MCP server {args.name!r} did not ask for authorization: nothing to store.")
        return EXIT_OK
    if result.problem is not None:
        print_error(f"warning: the server refused a session with the new tokens: "
                    f"{result.problem}")  # fmt: skip
    offered = "" if result.tools is None else f"; it offers {result.tools} tools"
    print(f"Logged in to MCP server {args.name!r}{offered}. The tokens are in "
          f"{result.path} (mode 0600).", flush=True)  # fmt: skip
    return EXIT_OK


def _server(name: str, config_files: list[str]) -> McpServerConfig:
    """The server ``name`` of the ``--mcp-config`` files, or, with no file, the server at
    the URL ``name``. Raises :class:`UsageError`."""
    if not config_files:
        if urlsplit(name).scheme in ("http", "https"):
            host = urlsplit(name).hostname or "server"
            safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)
            try:
                return parse_servers({safe: {"type": "http", "url": name}},
                                     source="NAME", path="$")[safe]  # fmt: skip
            except McpConfigError as exc:
                raise UsageError(str(exc)) from None
        raise UsageError(f"name the file that configures {name!r} with --mcp-config FILE "
                         "(or give the server's URL as NAME)")  # fmt: skip
    servers = mcp_servers(config_files)
    config = servers.get(name)
    if not isinstance(config, McpServerConfig):
        known = ", ".join(sorted(servers)) or "none"
        raise UsageError(f"no server {name!r} in {', '.join(config_files)} (servers: {known})")
    return config


def _desktop_terminal() -> bool:
    """Whether a browser may be opened: a person at a terminal (stdin and stdout) of a
    desktop session. Elsewhere the printed URL is enough."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
