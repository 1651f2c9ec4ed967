"""What a person writes that reaches MCP servers (R-MCP-5): ``@server:uri`` attachments in a
prompt and ``/server:prompt arg=value`` commands (chat, ACP).

Loads no MCP SDK: a prompt is looked at on every run, and a host with no MCP server must not
pay for it. Resources are read through the session's ``mcp__<server>__read_resource`` tools
(which exist only for servers that list resources), and prompts through the session's
:class:`McpView` (``Session.mcp``), so nothing here holds a connection.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import attrs

from greenroom.protocols.content import TextBlock, UserContent
from greenroom.protocols.tools import Tool, ToolFailure

__all__ = [
    "MAX_ATTACHMENTS",
    "AttachmentError",
    "McpPromptInfo",
    "McpResourceInfo",
    "McpView",
    "PromptCommandError",
    "attach_resources",
    "attach_to_input",
    "attachment_refs",
    "expand_prompt_command",
    "has_attachments",
    "parse_prompt_command",
    "prompt_usage",
    "read_linked_resource",
]

READ_RESOURCE = "read_resource"
"""The name, after ``mcp__<server>__``, of the tool that reads a server's resources."""

MAX_ATTACHMENTS = 20
"""How many ``@server:uri`` resources one input may attach: each is a request to a server,
made while the input waits."""

_ATTACHMENT = re.compile(r"(?<!\S)@([A-Za-z0-9_-]+):(\S+)")
_COMMAND = re.compile(r"/([A-Za-z0-9_-]+):(\S+)(?:\s+(.*))?", re.DOTALL)


@attrs.frozen(kw_only=True, slots=True)
class McpResourceInfo:
    """One resource as the server lists it."""

    uri: str
    name: str
    description: str | None = None
    mime_type: str | None = None


@attrs.frozen(kw_only=True, slots=True)
class McpPromptInfo:
    """One prompt as the server lists it: its name, description and arguments (name,
    whether required)."""

    name: str
    description: str | None = None
    arguments: tuple[tuple[str, bool], ...] = ()


class McpView(Protocol):
    """What a session's MCP servers offer a person besides tools (R-MCP-5), as they last
    listed it: ``Session.mcp``."""

    def prompts(self) -> dict[str, tuple[McpPromptInfo, ...]]:
        """Every server of the session by name, in configuration order, with its prompts
        (none for a server that lists none or has not started)."""
        ...

    def resources(self) -> dict[str, tuple[McpResourceInfo, ...]]:
        """Every server of the session by name, in configuration order, with its resources."""
        ...

    async def get_prompt(self, server: str, prompt: str, arguments: Mapping[str, str]) -> str:
        """Prompt ``prompt`` of ``server`` expanded with ``arguments`` into its messages'
        text (``prompts/get``). Raises :class:`~greenroom.protocols.tools.ToolFailure`
        saying why not, in words."""
        ...


class AttachmentError(ValueError):
    """An ``@server:uri`` attachment that could not be read; the message names it and why.
    ``index`` is the input block that names it."""

    def __init__(self, message: str, index: int = 0) -> None:
        super().__init__(message)
        self.index = index


class PromptCommandError(ValueError):
    """A ``/server:prompt`` command that cannot be run; the message (one line) names it
    and why: nothing was sent."""


# -- attachments -------------------------------------------------------------------------------


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


def _readers(tools: Iterable[Tool]) -> dict[str, Tool]:
    """The resource-reading tools of the session, by server."""
    found: dict[str, Tool] = {}
    for item in tools:
        parts = item.name.split("__")
        if len(parts) == 3 and parts[0] == "mcp" and parts[2] == READ_RESOURCE:
            found[parts[1]] = item
    return found


def has_attachments(text: str, tools: Iterable[Tool]) -> bool:
    """Whether ``text`` attaches a resource of one of the session's servers."""
    return bool(attachment_refs(text, _readers(tools)))


async def _read(server: str, uri: str, reader: Tool, index: int) -> TextBlock:
    try:
        content = await reader.function(uri=uri)
    except ToolFailure as exc:
        raise AttachmentError(f"@{server}:{uri}: {exc}", index) from None
    body = "\n".join(b.text for b in content if isinstance(b, TextBlock))
    return TextBlock(text=f'<attachment source="@{server}:{uri}">\n{body}\n</attachment>')


async def attach_to_input(
    content: Sequence[UserContent], tools: Iterable[Tool]
) -> list[UserContent]:
    """``content`` with each text block followed by the resources it attaches as
    ``@server:uri`` (a server whose resources the session can read), one text block each,
    delimited so that a resource cannot pass for the person's own words. The person
    attached it, so it is read without asking for approval. Raises
    :class:`AttachmentError` (its ``index`` the block) when one cannot be read, or past
    :data:`MAX_ATTACHMENTS`."""
    readers = _readers(tools)
    blocks: list[UserContent] = []
    count = 0
    for index, block in enumerate(content):
        blocks.append(block)
        if not isinstance(block, TextBlock) or not readers:
            continue
        for server, uri in attachment_refs(block.text, readers):
            count += 1
            if count > MAX_ATTACHMENTS:
                raise AttachmentError(
                    f"@{server}:{uri}: one input attaches at most {MAX_ATTACHMENTS} resources",
                    index,
                )
            blocks.append(await _read(server, uri, readers[server], index))
    return blocks


async def attach_resources(text: str, tools: Iterable[Tool]) -> list[TextBlock]:
    """The prompt ``text`` followed by each resource it attaches (see
    :func:`attach_to_input`). Raises :class:`AttachmentError` when one cannot be read."""
    blocks = await attach_to_input([TextBlock(text=text)], tools)
    return [b for b in blocks if isinstance(b, TextBlock)]


async def read_linked_resource(
    uri: str, mcp: McpView | None, tools: Iterable[Tool], index: int = 0
) -> TextBlock | None:
    """A resource a client links to (ACP's ``resource_link``) as an attachment, read
    through the first of the session's servers that lists ``uri`` among its resources;
    None when none does (the link is then only named). Raises :class:`AttachmentError`
    when that server cannot read it."""
    if mcp is None:
        return None
    readers = _readers(tools)
    for server, resources in mcp.resources().items():
        if server in readers and any(r.uri == uri for r in resources):
            return await _read(server, uri, readers[server], index)
    return None


# -- prompt commands ---------------------------------------------------------------------------


def parse_prompt_command(line: str) -> tuple[str, str, dict[str, str]] | str | None:
    """``/server:prompt arg=value …`` as (server, prompt, arguments); None for a line that
    is not such a command; a message for one that is malformed (a word without ``=``). A
    value runs to the next space; quote it (``arg="two words"``) to hold spaces."""
    match = _COMMAND.fullmatch(line.strip())
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


def prompt_usage(server: str, prompt: McpPromptInfo) -> str:
    """How the command of a prompt is written: ``/server:prompt path=… [tone=…]``
    (required arguments bare, optional ones in brackets)."""
    words = [f"/{server}:{prompt.name}"]
    words += [f"{name}=…" if required else f"[{name}=…]" for name, required in prompt.arguments]
    return " ".join(words)


def _prompt_of(
    prompts: Mapping[str, tuple[McpPromptInfo, ...]],
    server: str,
    name: str,
    arguments: Mapping[str, str],
) -> McpPromptInfo:
    """The listed prompt a command names, its arguments checked against the listing."""
    head = f"/{server}:{name}"
    if server not in prompts:
        known = f" (its servers: {', '.join(prompts)})" if prompts else ""
        raise PromptCommandError(f"{head}: no MCP server {server!r} in this session{known}")
    found = next((p for p in prompts[server] if p.name == name), None)
    if found is None:
        names = ", ".join(p.name for p in prompts[server])
        known = f" (its prompts: {names})" if names else " (it lists no prompts)"
        raise PromptCommandError(f"{head}: MCP server {server!r} has no prompt {name!r}{known}")
    usage = prompt_usage(server, found)
    listed = {argument for argument, _ in found.arguments}
    for argument in arguments:
        if argument not in listed:
            raise PromptCommandError(f"{head}: no argument {argument!r} (usage: {usage})")
    for argument, required in found.arguments:
        if required and argument not in arguments:
            raise PromptCommandError(f"{head}: {argument}=… is required (usage: {usage})")
    return found


async def expand_prompt_command(
    line: str, mcp: McpView | None, *, only_known: bool = False
) -> str | None:
    """The text of the MCP prompt that ``line`` (``/server:prompt arg=value …``) runs,
    expanded by its server with those arguments; None when ``line`` is no such command
    (with ``only_known``, nor one that names a server of the session: such a line is
    ordinary text). Raises :class:`PromptCommandError` for a malformed command, an
    unknown server or prompt, a missing or unknown argument, and when the server fails
    to expand it (or expands it to no text)."""
    match = _COMMAND.fullmatch(line.strip())
    if match is None:
        return None
    prompts = mcp.prompts() if mcp is not None else {}
    if only_known and match.group(1) not in prompts:
        return None
    parsed = parse_prompt_command(line)
    if isinstance(parsed, str):
        raise PromptCommandError(parsed)
    assert parsed is not None  # the same pattern matched
    server, name, arguments = parsed
    _prompt_of(prompts, server, name, arguments)
    assert mcp is not None  # a known server has a view
    try:
        text = await mcp.get_prompt(server, name, arguments)
    except ToolFailure as exc:
        raise PromptCommandError(f"/{server}:{name}: {' '.join(str(exc).split())}") from None
    if not text.strip():
        raise PromptCommandError(f"/{server}:{name}: the server's prompt holds no text")
    return text
