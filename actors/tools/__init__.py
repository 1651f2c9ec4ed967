"""Tools: the built-in file, search and shell tools, the sandbox for ``run_shell``, loading
``--tools`` modules, and MCP servers' tools."""
