"""MCP beyond tools (R-MCP-5): how greenroom introduces itself in ``initialize``, the
roots it gives, resources and prompts, against the SDK-built test server
(``tests/support/mcp_server.py``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect

import greenroom
from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools import (
    AttachmentError,
    PromptCommandError,
    attach_resources,
    attach_to_input,
    expand_prompt_command,
    mcp_stdio,
    parse_prompt_command,
    prompt_usage,
)
from greenroom.actors.tools import mcp as mcp_module
from greenroom.actors.tools.mcp import McpConnection, McpServerError
from greenroom.actors.tools.mcp_commands import MAX_ATTACHMENTS
from greenroom.protocols.content import TextBlock
from greenroom.protocols.tools import Tool
from tests.test_mcp import connection, content_text, odd, outputs_by_call, stdio


@pytest.fixture
async def mcp_host(data_dir: Path) -> AsyncIterator[Host]:
    async with Host.open(data_dir) as host:
        yield host


async def test_initialize_names_greenroom_and_gives_the_workspace_as_root(
    mcp_host: Host, workspace: Path, providers: Any, tmp_path: Path
) -> None:
    """R-MCP-5: ``clientInfo`` is greenroom and its version; the capabilities declare
    ``roots`` and ``elicitation``; ``roots/list`` answers the sessions' workspaces, and
    another session sharing the server adds its own."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__t__client"), tool_call("c2", "mcp__t__roots"))),
        Reply(blocks=(text("done"),)),
        Reply(blocks=(tool_call("c3", "mcp__t__roots"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    by_call = outputs_by_call(await collect(session.run("who", approve=allow_all)))
    client = json.loads(content_text(by_call["c1"]))
    assert (client["name"], client["version"]) == ("greenroom", greenroom.__version__)
    assert client["capabilities"]["roots"] == {"listChanged": True}
    assert "elicitation" in client["capabilities"]
    assert json.loads(content_text(by_call["c2"])) == [
        {"uri": workspace.as_uri(), "name": workspace.name}
    ]
    other_workspace = tmp_path / "other"
    other_workspace.mkdir()
    other = await mcp_host.create_session(
        provider=provider, workspace_dir=other_workspace, mcp_servers={"t": stdio()}
    )
    by_call = outputs_by_call(await collect(other.run("roots", approve=allow_all)))
    assert [r["uri"] for r in json.loads(content_text(by_call["c3"]))] == [
        workspace.as_uri(), other_workspace.as_uri()
    ]


async def test_resources_are_read_by_the_model_and_attached_to_prompts(
    mcp_host: Host, workspace: Path, providers: Any
) -> None:
    """R-MCP-5: a server with resources gets a ``read_resource`` tool naming them; the
    model reads one by URI; ``@server:uri`` in a prompt inlines its text, delimited; an
    unreadable one is an error naming it."""
    provider = providers([
        Reply(blocks=(tool_call("r1", "mcp__t__read_resource", uri="greenroom://notes"),
                      tool_call("r2", "mcp__t__read_resource", uri="greenroom://nope"))),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    reader = {t.name: t for t in session.tools}["mcp__t__read_resource"]
    assert "greenroom://notes (notes): The team's notes" in reader.description
    by_call = outputs_by_call(await collect(session.run("read", approve=allow_all)))
    assert "the notes say: ship on Friday" in content_text(by_call["r1"])
    assert by_call["r2"].is_error and "greenroom://nope" in content_text(by_call["r2"])

    blocks = await attach_resources("see @t:greenroom://notes and mail a@t:x", session.tools)
    assert [b.text for b in blocks] == [
        "see @t:greenroom://notes and mail a@t:x",
        '<attachment source="@t:greenroom://notes">\n[resource greenroom://notes of MCP '
        "server 't']\nthe notes say: ship on Friday\n</attachment>",
    ]
    with pytest.raises(AttachmentError, match=r"^@t:greenroom://nope: MCP server 't'"):
        await attach_resources("@t:greenroom://nope", session.tools)
    assert await attach_resources("@other:x", session.tools) == [TextBlock(text="@other:x")]


async def test_prompts_are_listed_and_expanded(mcp_host: Host, workspace: Path) -> None:
    """R-MCP-5: a server's prompts are listed with their arguments; ``/server:prompt
    arg=value`` parses, and the prompt expands into its messages' text."""
    await mcp_host.create_session(
        provider="scripted", workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    server = connection(mcp_host, "t")
    (review,) = [p for p in server.prompts if p.name == "review"]
    assert review.arguments == (("path", True), ("tone", False))
    command = parse_prompt_command('/t:review path=a.py tone="very dry"')
    assert command == ("t", "review", {"path": "a.py", "tone": "very dry"})
    assert await server.get_prompt("review", command[2]) == "Review a.py in a very dry tone."
    assert parse_prompt_command("/t:review a.py") == "/t:review: 'a.py' is not arg=value"
    assert parse_prompt_command("/help") is None
    with pytest.raises(McpServerError, match=r"refused prompt nope"):
        await server.get_prompt("nope", {})


async def test_a_prompt_command_is_checked_against_the_listing_then_expanded(
    mcp_host: Host, workspace: Path
) -> None:
    """R-MCP-5: ``session.mcp`` lists each server's prompts and resources; a command
    naming an unknown server or prompt, missing a required argument or giving an unknown
    one is a one-line error naming it (nothing asked of the server); a good one expands.
    ``only_known`` leaves a line naming no server of the session to be ordinary text."""
    session = await mcp_host.create_session(
        provider="scripted", workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    mcp = session.mcp
    assert mcp is not None
    (review,) = mcp.prompts()["t"]
    assert prompt_usage("t", review) == "/t:review path=… [tone=…]"
    assert {r.uri for r in mcp.resources()["t"]} == {
        "greenroom://notes", "greenroom://counter", "greenroom://slow"
    }
    assert await expand_prompt_command("/t:review path=a.py", mcp) == "Review a.py in a kind tone."
    for line, message in [
        ("/t:review", "/t:review: path=… is required (usage: /t:review path=… [tone=…])"),
        ("/t:review path=a mood=x", "/t:review: no argument 'mood' (usage: /t:review path=… "
                                    "[tone=…])"),
        ("/t:nope", "/t:nope: MCP server 't' has no prompt 'nope' (its prompts: review)"),
        ("/x:y", "/x:y: no MCP server 'x' in this session (its servers: t)"),
        ("/t:review a.py", "/t:review: 'a.py' is not arg=value"),
    ]:  # fmt: skip
        with pytest.raises(PromptCommandError) as info:
            await expand_prompt_command(line, mcp)
        assert str(info.value) == message
    assert await expand_prompt_command("/x:y", mcp, only_known=True) is None
    assert await expand_prompt_command("/c:/Users/me", mcp, only_known=True) is None
    assert await expand_prompt_command("hello /t:review", mcp) is None
    plain = await mcp_host.create_session(provider="scripted", workspace_dir=workspace)
    assert plain.mcp is None
    with pytest.raises(PromptCommandError, match=r"^/t:review: no MCP server 't' in this"):
        await expand_prompt_command("/t:review path=a", plain.mcp)


async def test_one_input_attaches_at_most_max_attachments() -> None:
    """R-MCP-5: every text block of an input is looked at, each attachment following its
    block; one input reads at most ``MAX_ATTACHMENTS`` resources, and the next is an
    error naming it and its block (nothing past the cap is read)."""
    read: list[str] = []

    async def read_resource(uri: str) -> tuple[TextBlock, ...]:
        read.append(uri)
        return (TextBlock(text=f"body of {uri}"),)

    reader = Tool(name="mcp__f__read_resource", description="", input_schema={},
                  parallel=True, side_effects=False, function=read_resource)  # fmt: skip
    words = " ".join(f"@f:u{n}" for n in range(MAX_ATTACHMENTS - 1))
    content = [TextBlock(text="@f:first"), TextBlock(text=words)]
    blocks = await attach_to_input(content, [reader])
    assert [b.text for b in blocks if isinstance(b, TextBlock)][:3] == [
        "@f:first", '<attachment source="@f:first">\nbody of first\n</attachment>', words
    ]
    assert len(blocks) == 2 + MAX_ATTACHMENTS
    read.clear()
    with pytest.raises(AttachmentError) as info:
        await attach_to_input([*content, TextBlock(text="@f:one-more")], [reader])
    assert info.value.index == 2
    assert str(info.value) == f"@f:one-more: one input attaches at most {MAX_ATTACHMENTS} resources"
    assert "one-more" not in read and len(read) == MAX_ATTACHMENTS


async def test_a_session_whose_creation_was_cancelled_is_no_root_of_a_shared_server(
    mcp_host: Host, workspace: Path, providers: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R-MCP-5, R-SEC-4: a creation cancelled while its servers' tools were listed (a
    client that went away) left its workspace among the roots a shared server is told,
    for the other sessions' (and principals') servers to see."""
    provider = providers([
        Reply(blocks=(tool_call("c1", "mcp__t__roots"),)),
        Reply(blocks=(text("done"),)),
    ])  # fmt: skip
    session = await mcp_host.create_session(
        provider=provider, workspace_dir=workspace, mcp_servers={"t": stdio()}
    )
    listing = trio.Event()

    async def list_for_ever(self: Any) -> Any:
        listing.set()
        await trio.sleep_forever()

    monkeypatch.setattr(McpConnection, "list_tools", list_for_ever)
    other_workspace = tmp_path / "other"
    other_workspace.mkdir()
    positions: Any = mcp_host.trace_log
    traced = set(positions._positions)
    async with trio.open_nursery() as nursery:

        async def create() -> None:
            await mcp_host.create_session(
                provider=provider, workspace_dir=other_workspace, mcp_servers={"t": stdio()}
            )

        nursery.start_soon(create)
        await listing.wait()
        nursery.cancel_scope.cancel()
    monkeypatch.undo()
    assert set(positions._positions) == traced  # nor does the trace log keep it
    by_call = outputs_by_call(await collect(session.run("roots", approve=allow_all)))
    assert [r["uri"] for r in json.loads(content_text(by_call["c1"]))] == [workspace.as_uri()]


async def test_a_server_that_exits_while_a_resource_is_read_stopped_and_starts_again(
    mcp_host: Host, workspace: Path
) -> None:
    """R-MCP-4, R-MCP-5: a server that exits during ``resources/read`` was said to have
    refused the read (``refused reading odd://crash: Connection closed``). It stopped, as a
    call's server does, in those words, and the next read starts it again."""
    await mcp_host.create_session(workspace_dir=workspace, mcp_servers={"c": odd()})
    server = connection(mcp_host, "c")
    with trio.fail_after(RUN_TIMEOUT_S):
        first = await server.read_resource("odd://hello")
        with pytest.raises(McpServerError) as caught:
            await server.read_resource("odd://crash")
        again = await server.read_resource("odd://hello")
    assert str(caught.value).startswith("MCP server 'c' stopped during reading odd://crash: ")
    assert str(caught.value).endswith("; it is started again on its next use")
    assert "hello from" in again and again != first  # another process answered


async def test_a_server_that_stops_answering_a_resource_read_is_pinged_then_restarted(
    mcp_host: Host, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-MCP-4, R-MCP-5: a read past ``timeout_s`` left the server trusted, so every later
    request waited out its own timeout on a server that answers nothing. Like a call's, it
    marks the server to be pinged before its next use, and restarted when it does not
    answer."""
    # Short bounds: the frozen server answers no ping, and only its kill ends it.
    monkeypatch.setattr(mcp_module, "PING_TIMEOUT_S", 0.2)
    monkeypatch.setattr(mcp_stdio, "PROCESS_TERMINATION_TIMEOUT", 0.1)
    monkeypatch.setattr(mcp_stdio, "FORCE_KILL_TIMEOUT", 0.1)
    await mcp_host.create_session(
        workspace_dir=workspace, mcp_servers={"z": odd(timeout_s=0.5)}
    )
    server = connection(mcp_host, "z")
    with trio.fail_after(RUN_TIMEOUT_S):
        first = await server.read_resource("odd://hello")
        with pytest.raises(McpServerError) as caught:
            await server.read_resource("odd://freeze")
        again = await server.read_resource("odd://hello")
    assert str(caught.value) == "MCP server 'z' did not answer reading odd://freeze within 0.5 s"
    assert "hello from" in again and again != first  # another process answered
