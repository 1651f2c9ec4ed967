"""Tools: the built-in file, search and shell tools, the sandbox for ``run_shell``, loading
``--tools`` modules, and MCP servers' tools."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from greenroom.actors.tools.ask_user import ask_user
    from greenroom.actors.tools.builtin import builtin_tools
    from greenroom.actors.tools.loader import (
        ToolLoadError,
        load_tools,
    )
    from greenroom.actors.tools.mcp_commands import (
        AttachmentError,
        attach_resources,
        parse_prompt_command,
    )
    from greenroom.actors.tools.mcp_config import (
        McpConfigError,
        load_config_files,
    )
    from greenroom.actors.tools.mcp_login import (
        McpLoginError,
        login_to_mcp_server,
        mcp_login_problem,
    )

# Loaded on first use: the modules import each other, and importing the package must
# not import them all (nor pay for the ones a program never uses).
_MODULE_OF = {
    "ask_user": "greenroom.actors.tools.ask_user",
    "builtin_tools": "greenroom.actors.tools.builtin",
    "ToolLoadError": "greenroom.actors.tools.loader",
    "load_tools": "greenroom.actors.tools.loader",
    "AttachmentError": "greenroom.actors.tools.mcp_commands",
    "attach_resources": "greenroom.actors.tools.mcp_commands",
    "parse_prompt_command": "greenroom.actors.tools.mcp_commands",
    "McpConfigError": "greenroom.actors.tools.mcp_config",
    "load_config_files": "greenroom.actors.tools.mcp_config",
    "McpLoginError": "greenroom.actors.tools.mcp_login",
    "login_to_mcp_server": "greenroom.actors.tools.mcp_login",
    "mcp_login_problem": "greenroom.actors.tools.mcp_login",
}

__all__ = [
    "AttachmentError",
    "McpConfigError",
    "McpLoginError",
    "ToolLoadError",
    "ask_user",
    "attach_resources",
    "builtin_tools",
    "load_config_files",
    "load_tools",
    "login_to_mcp_server",
    "mcp_login_problem",
    "parse_prompt_command",
]


if not TYPE_CHECKING:  # type checkers see the imports above, and no catch-all

    def __getattr__(name: str) -> Any:
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = globals()[name] = getattr(import_module(module), name)
        return value
