"""What a person writes that reaches MCP servers (R-MCP-5): ``@server:uri`` attachments in a
prompt and ``/server:prompt arg=value`` commands in chat.

Loads no MCP SDK: a prompt is looked at on every run, and a host with no MCP server must not
pay for it. Resources are read through the session's ``mcp__<server>__read_resource`` tools
(which exist only for servers that list resources), so nothing here holds a connection.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from greenroom.protocols.content import TextBlock
from greenroom.protocols.mcp_config import tool_name
from greenroom.protocols.tools import Tool, ToolFailure

__all__ = ["AttachmentError", "attach_resources", "attachment_refs", "parse_prompt_command"]

READ_RESOURCE = "read_resource"
"""The name, after ``mcp__<server>__``, of the tool that reads a server's resources."""

_ATTACHMENT = re.compile(r"(?<!\S)@([A-Za-z0-9_-]+):(\S+)")


class AttachmentError(ValueError):
    """An ``@server:uri`` attachment that could not be read; the message names it and why."""


def attachment_refs(text: str, servers: Iterable[str]) -> list[tuple[str, str]]:
    """The ``@server:uri`` references of a prompt, as (server, uri), in order and each
    once: only words that start with ``@`` and name one of ``servers`` count (an e-mail
    address or an ``@mention`` of anything else is left alone)."""
    known = set(servers)
    refs: list[tuple[str, str]] = []
    for match in _ATTACHMENT.finditer(text):
        ref = (match.group(1), match.group(2))
        if ref[0] in known and ref not in refs:
            refs.append(ref)
    return refs


async def attach_resources(text: str, tools: Iterable[Tool]) -> list[TextBlock]:
    """The prompt ``text`` followed by each resource it attaches as ``@server:uri`` (a
    server whose resources the session can read), one text block each, delimited so that a
    resource cannot pass for the person's own words. The person attached it, so it is read
    without asking for approval. Raises :class:`AttachmentError` when one cannot be read."""
    readers = {t.name: t for t in tools}
    servers = [name.split("__")[1] for name in readers
               if name.startswith("mcp__") and name.endswith(f"__{READ_RESOURCE}")]
    blocks = [TextBlock(text=text)]
    for server, uri in attachment_refs(text, servers):
        try:
            content = await readers[tool_name(server, READ_RESOURCE)].function(uri=uri)
        except ToolFailure as exc:
            raise AttachmentError(f"@{server}:{uri}: {exc}") from None
        body = "\n".join(b.text for b in content if isinstance(b, TextBlock))
        blocks.append(TextBlock(
            text=f'<attachment source="@{server}:{uri}">\n{body}\n</attachment>'))
    return blocks


def parse_prompt_command(line: str) -> tuple[str, str, dict[str, str]] | str | None:
    """``/server:prompt arg=value …`` as (server, prompt, arguments); None for a line that
    is not such a command; a message for one that is malformed (a word without ``=``). A
    value runs to the next space; quote it (``arg="two words"``) to hold spaces."""
    match = re.fullmatch(r"/([A-Za-z0-9_-]+):(\S+)(?:\s+(.*))?", line.strip(), re.DOTALL)
    if match is None:
        return None
    server, prompt, rest = match.group(1), match.group(2), match.group(3) or ""
    arguments: dict[str, str] = {}
    for word in re.finditer(r'([^\s=]+)=("([^"]*)"|\S*)|(\S+)', rest):
        if word.group(4) is not None:
            return f"/{server}:{prompt}: {word.group(4)!r} is not arg=value"
        value = word.group(3) if word.group(3) is not None else word.group(2)
        arguments[word.group(1)] = value
    return server, prompt, arguments
