"""Tools: the built-in file, search and shell tools, the sandbox for ``run_shell``, loading
``--tools`` modules, MCP servers' tools, and remote A2A agents as tools."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from greenroom.actors.tools.a2a_agent import A2aAgentError, a2a_tools, load_a2a_agent
    from greenroom.actors.tools.builtin import builtin_tools
    from greenroom.actors.tools.loader import (
        ToolLoadError,
        load_tools,
    )
    from greenroom.actors.tools.mcp_commands import (
        AttachmentError,
        McpView,
        PromptCommandError,
        attach_resources,
        attach_to_input,
        expand_prompt_command,
        has_attachments,
        parse_prompt_command,
        prompt_usage,
        read_linked_resource,
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
    from greenroom.actors.tools.questions import ask_user

# Loaded on first use: the modules import each other, and importing the package must
# not import them all (nor pay for the ones a program never uses).
_MODULE_OF = {
    "A2aAgentError": "greenroom.actors.tools.a2a_agent",
    "a2a_tools": "greenroom.actors.tools.a2a_agent",
    "load_a2a_agent": "greenroom.actors.tools.a2a_agent",
    "ask_user": "greenroom.actors.tools.questions",
    "builtin_tools": "greenroom.actors.tools.builtin",
    "ToolLoadError": "greenroom.actors.tools.loader",
    "load_tools": "greenroom.actors.tools.loader",
    "AttachmentError": "greenroom.actors.tools.mcp_commands",
    "McpView": "greenroom.actors.tools.mcp_commands",
    "PromptCommandError": "greenroom.actors.tools.mcp_commands",
    "attach_resources": "greenroom.actors.tools.mcp_commands",
    "attach_to_input": "greenroom.actors.tools.mcp_commands",
    "expand_prompt_command": "greenroom.actors.tools.mcp_commands",
    "has_attachments": "greenroom.actors.tools.mcp_commands",
    "parse_prompt_command": "greenroom.actors.tools.mcp_commands",
    "prompt_usage": "greenroom.actors.tools.mcp_commands",
    "read_linked_resource": "greenroom.actors.tools.mcp_commands",
    "McpConfigError": "greenroom.actors.tools.mcp_config",
    "load_config_files": "greenroom.actors.tools.mcp_config",
    "McpLoginError": "greenroom.actors.tools.mcp_login",
    "login_to_mcp_server": "greenroom.actors.tools.mcp_login",
    "mcp_login_problem": "greenroom.actors.tools.mcp_login",
}

__all__ = [
    "A2aAgentError",
    "AttachmentError",
    "McpConfigError",
    "McpLoginError",
    "McpView",
    "PromptCommandError",
    "ToolLoadError",
    "a2a_tools",
    "ask_user",
    "attach_resources",
    "attach_to_input",
    "builtin_tools",
    "expand_prompt_command",
    "has_attachments",
    "load_a2a_agent",
    "load_config_files",
    "load_tools",
    "login_to_mcp_server",
    "mcp_login_problem",
    "parse_prompt_command",
    "prompt_usage",
    "read_linked_resource",
]


if not TYPE_CHECKING:  # type checkers see the imports above, and no catch-all

    def __getattr__(name: str) -> Any:
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = globals()[name] = getattr(import_module(module), name)
        return value
