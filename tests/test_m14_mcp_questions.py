"""A question asked by a running call is answerable only while that call waits for it here
(R-HITL-5, R-HITL-4), whoever asked — a session's own MCP server, its parent's server in a
subagent, a Python tool's ``ctx.ask`` — and whatever the next host was opened with; and an
MCP tool's arguments reach its server as the model gave them, ``ctx`` too (R-MCP-3).
Real servers written with the SDK's server API (``tests/support/mcp_server.py``, and the
low-level server below)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import NotPending
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.people import answer, pending_of
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.messages import PersonAnswered
from greenroom.protocols.outputs import ApprovalRequest, TaskEnd, ToolCallOutput
from greenroom.protocols.people import PEOPLE

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests" / "support" / "mcp_server.py"


def stdio(script: Path) -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(script)]}


# -- a question whose asker went with its host -------------------------------------------------

ASKING_HOST = textwrap.dedent(
    """
    import sys, trio
    from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
    from greenroom.actors.runtime.host import Host
    from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
    from greenroom.protocols.content import ToolCallBlock
    from greenroom.protocols.context import ToolResult, UserMessage
    from greenroom.protocols.people import PEOPLE
    from greenroom.protocols.tools import ToolContext, tool

    data_dir, workspace, server, asker = sys.argv[1:5]

    @tool(parallel=False)
    async def confirm(ctx: ToolContext) -> str:
        \"\"\"Ask the person whether to go on.\"\"\"
        answer = await ctx.ask({"question": "go on?"})
        return answer.text or answer.action

    ORDER = ToolCallBlock(id="o1", name="mcp__t__order", arguments={"item": "shirt"})
    CONFIRM = ToolCallBlock(id="o1", name="confirm", arguments={})

    def model(request):
        results = [b for m in request.messages if isinstance(m, UserMessage)
                   for b in m.content if isinstance(b, ToolResult)]
        if results:
            return Reply(blocks=(text("done"),))
        if asker == "subagent" and not (request.system or "").startswith(SUBAGENT_SYSTEM):
            spawn = {"task": "order a shirt", "background": True, "name": "buyer"}
            return Reply(blocks=(ToolCallBlock(id="s1", name="spawn_subagent",
                                               arguments=spawn),))
        return Reply(blocks=(CONFIRM if asker == "python" else ORDER,))

    async def main():
        # Unbounded: the subscriber's callback must never block; two calls at most.
        send, asked = trio.open_memory_channel(float("inf"))

        def on_batch(batch):
            for out in batch:  # published once written: the request is in the trace
                if out.TYPE != "approval_request":
                    continue
                if out.kind == "question":
                    print(out.session_id, out.call_id, flush=True)
                else:
                    send.send_nowait((out.session_id, out.call_id))

        async with Host.open(data_dir) as host:
            session = await host.create_session(
                provider=ScriptedProvider(model), workspace_dir=workspace,
                tools=[confirm, spawn_subagent],
                mcp_servers={"t": {"command": sys.executable, "args": [server]}},
            )
            session.subscribe(on_batch)
            session.run("order a shirt", approve=PEOPLE).detach()
            async for session_id, call_id in asked:  # the spawn, the call that asks
                await host.answer_approval(session_id, call_id, "allow")
            # killed while the question waits

    trio.run(main)
    """
)
"""A host whose call ``o1`` asks a question — the session's own MCP server (``mcp``), its
parent's server in a background subagent (``subagent``), a Python tool's ``ctx.ask``
(``python``) — printing the asking session's id and the call's once the question is in the
trace; then it waits to be killed."""


async def left_asking(data_dir: Path, workspace: Path, tmp_path: Path, asker: str) -> str:
    """Run :data:`ASKING_HOST` until its question is asked, kill it (SIGKILL: nothing of
    its own shutdown runs), and return the id of the session whose call asked."""
    script = tmp_path / "ask.py"
    script.write_text(ASKING_HOST)
    process = await trio.lowlevel.open_process(
        [sys.executable, str(script), str(data_dir), str(workspace), str(SERVER), asker],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        lines = b""
        with trio.fail_after(RUN_TIMEOUT_S):
            while b"\n" not in lines:
                data = await process.stdout.receive_some()
                assert data, "the asking host ended before its question"
                lines += data
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    session_id, call_id = lines.split(b"\n")[0].decode().split()
    assert call_id == "o1"
    return session_id


@pytest.mark.parametrize(
    ("asker", "servers"),
    [
        ("python", True),  # a Python tool's ctx.ask
        ("mcp", False),  # the session's own server, the next host opened without it
        ("subagent", True),  # a subagent's call of its parent's server
        ("subagent", False),  # the same, the next host opened without the server
    ],
)
async def test_a_question_whose_asker_went_with_its_host_is_never_listed_nor_answered(
    data_dir: Path, workspace: Path, tmp_path: Path, asker: str, servers: bool
) -> None:
    """R-HITL-5, R-HITL-4: a running call asks a question and its host is killed. The next
    host, taking the task up (``Host.resume``, as ``resume_tasks`` does), listed that
    question as answerable from the moment it took the task up until the call was settled,
    unless the session had MCP servers of its own there and one of them asked: a Python
    tool's ``ctx.ask``, a subagent's call of its parent's server, a session loaded on a host
    without its servers. The call that asked is gone with its host, and nobody can answer.
    It is never listed, and an answer to it is refused saying why; the call is then settled
    as lost, or the question about it in doubt follows, and is listed."""
    sid = await left_asking(data_dir, workspace, tmp_path, asker)
    extra: dict[str, Any] = {"mcp_servers": {"t": stdio(SERVER)}} if servers else {}
    async with Host.open(data_dir, **extra) as host:
        await host.load_session(sid)
        port = host.port(sid)
        root_done = trio.Event()
        if port.parent_id is not None:  # a background subagent: its answer reaches its root
            root = await host.load_session(port.parent_id)
            root.subscribe(lambda batch: any(
                isinstance(o, TaskEnd) and o.origin is None for o in batch
            ) and root_done.set())  # fmt: skip
        await host.resume(sid)  # as resume_tasks takes it up
        assert port.inbox is not None  # a supervisor runs the task
        request = port.machine.record.pending("o1")
        assert request is not None and request.kind == "question"  # not settled yet
        assert pending_of(port) == []
        # Answered before anything settles it (the host's answer_question may let the
        # resumption record the doubt first).
        with pytest.raises(NotPending, match="no longer waits for its answer"):
            await answer(port, PersonAnswered(call_id="o1", text="yes"))
        with trio.fail_after(RUN_TIMEOUT_S):
            await port.wait_idle()  # the call settled as lost, or parked on its doubt
        settled = port.machine.record.pending("o1")
        assert settled is None or settled.kind == "in_doubt"
        listed = await host.pending_approvals()
        assert [p.kind for p in listed] == ([] if settled is None else ["in_doubt"])
        if settled is None and port.parent_id is not None:
            with trio.fail_after(RUN_TIMEOUT_S):
                await root_done.wait()  # the subagent's answer taken before the host closes


def _model(request: ModelRequest) -> Reply:
    """A root that spawns a foreground subagent, which orders a shirt from the root's
    server; each answers once its call's result is in."""
    if any(isinstance(b, ToolResult) for m in request.messages if isinstance(m, UserMessage)
           for b in m.content):  # fmt: skip
        return Reply(blocks=(text("done"),))
    if (request.system or "").startswith(SUBAGENT_SYSTEM):
        return Reply(blocks=(tool_call("o1", "mcp__t__order", item="shirt"),))
    return Reply(blocks=(tool_call("s1", "spawn_subagent", task="order a shirt"),))


async def test_a_subagents_question_is_listed_and_answered_while_its_call_waits(
    host: Host, workspace: Path
) -> None:
    """R-HITL-5, R-TREE-1: a subagent's call of its parent's MCP server asks a question;
    while the call waits for it the question is listed under the subagent's id and its
    answer reaches the server (the call's wait is known in the subagent's own task)."""
    session = await host.create_session(
        provider=ScriptedProvider(_model), workspace_dir=workspace,
        tools=[spawn_subagent], mcp_servers={"t": stdio(SERVER)},
    )  # fmt: skip
    # Unbounded: the subscriber's callback never blocks; a handful of requests in all.
    send, requests = trio.open_memory_channel[ApprovalRequest](math.inf)
    session.subscribe(
        lambda batch: [send.send_nowait(o) for o in batch if isinstance(o, ApprovalRequest)]
    )
    stream = session.run("order a shirt through a helper", approve=PEOPLE)
    with trio.fail_after(RUN_TIMEOUT_S):
        async for request in requests:
            if request.kind == "question":
                break
            await host.answer_approval(request.session_id, request.call_id, "allow")
    child = request.session_id
    assert child != session.id and request.call_id == "o1"
    listed = await host.pending_approvals()
    assert [(p.session_id, p.call_id, p.kind) for p in listed] == [(child, "o1", "question")]
    await host.answer_question(child, "o1", '{"size": "L", "quantity": 1}')
    outputs = await collect(stream)  # the subagent's reach the root's stream too
    (result,) = [o for o in of_type(outputs, ToolCallOutput) if o.call_id == "o1"]
    assert result.content == (TextBlock(text="ordered 1 L shirt"),)


# -- an MCP tool's arguments -------------------------------------------------------------------

ARGUMENTS_SERVER = textwrap.dedent(
    """
    import json
    import anyio
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.server.stdio import stdio_server

    TEXT = {"type": "object", "properties": {"text": {"type": "string"}}}
    OWN = {"type": "object", "properties": {"ctx": {"type": "string"}, "text": {"type": "string"}}}

    async def list_tools(ctx, params):
        return types.ListToolsResult(tools=[
            types.Tool(name="undeclared", description="What arrived.", input_schema=TEXT),
            types.Tool(name="declared", description="What arrived.", input_schema=OWN),
        ])

    async def call_tool(ctx, params):
        # Exactly what the request carried: the arguments and the call's _meta key.
        meta = dict(params.meta or {})
        got = {"arguments": params.arguments, "key": meta.get("greenroom/idempotency_key")}
        return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(got))])

    server = Server("arguments", on_list_tools=list_tools, on_call_tool=call_tool)

    async def main():
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)
    """
)
"""A server whose tools answer with the arguments and idempotency key their request
carried: ``undeclared`` (its schema names ``text`` only, and takes other properties) and
``declared`` (its schema names ``ctx`` too)."""


async def test_an_mcp_tools_ctx_argument_reaches_its_server_as_the_model_gave_it(
    host: Host, workspace: Path, tmp_path: Path, providers: Any
) -> None:
    """R-MCP-3, R-EFFECT-1: the pool passes a tool's context as the argument ``ctx``. For an
    MCP tool whose schema does not declare ``ctx`` it put its context in place of the
    model's ``ctx``, which never reached the server; one whose schema declares it got no
    context at all, so its request carried no idempotency key. Every argument now reaches
    the server as the model gave it, and every call carries its key."""
    script = tmp_path / "arguments_server.py"
    script.write_text(ARGUMENTS_SERVER, encoding="utf-8")
    calls = (
        tool_call("u1", "mcp__t__undeclared", text="a", ctx="home"),
        tool_call("u2", "mcp__t__undeclared", text="b"),
        tool_call("d1", "mcp__t__declared", text="c", ctx="work"),
    )
    session = await host.create_session(
        provider=providers([Reply(blocks=calls), Reply(blocks=(text("done"),))]),
        workspace_dir=workspace,
        mcp_servers={"t": stdio(script)},
    )
    outputs = await collect(session.run("say what arrives", approve=allow_all))
    got: dict[str, Any] = {}
    for output in of_type(outputs, ToolCallOutput):
        assert not output.is_error, output
        (block,) = output.content
        assert isinstance(block, TextBlock)
        got[output.call_id] = json.loads(block.text)
    assert {call: seen["arguments"] for call, seen in got.items()} == {
        "u1": {"text": "a", "ctx": "home"},
        "u2": {"text": "b"},
        "d1": {"text": "c", "ctx": "work"},
    }
    keys = [seen["key"] for seen in got.values()]
    assert all(isinstance(key, str) and key.startswith("gr-") for key in keys), keys
    assert len(set(keys)) == 3
