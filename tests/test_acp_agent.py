"""The ACP agent in-process (R-ACP-1) on memory streams, with scripted models the demo brain
cannot play: a subagent (R-HOST-4), thinking, a refusal, a failure. Every frame is
validated strictly against the official ACP SDK's schema."""

from __future__ import annotations

import base64
import functools
import hashlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pydantic
import pytest
import trio
import trio.testing
from acp.schema import (
    Error,
    ForkSessionResponse,
    InitializeResponse,
    NewSessionResponse,
    PromptResponse,
    RequestPermissionRequest,
    SessionNotification,
)
from conftest import cut_after, hold_after_first, port_of, trace_lines

from greenroom.actors.apps import acp as acp_app
from greenroom.actors.apps.acp import AcpAgent, AcpConfig
from greenroom.actors.apps.acp_people import Asked
from greenroom.actors.runtime.disk import Disk
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.runtime.trace_store import FileTraceStore
from greenroom.actors.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    model_error,
    text,
    thinking,
    tool_call,
)
from greenroom.actors.tools.builtin import builtin_tools
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols.content import ImageBlock, TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from tests.support.ndjson import NdjsonPeer

TIMEOUT_S = 20

MCP_SERVER = Path(__file__).resolve().parent / "support" / "mcp_server.py"


def strict(model: type[pydantic.BaseModel], data: Any) -> None:
    parsed = model.model_validate(data)
    assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == data


class Client:
    """A minimal ACP client over the agent's memory streams: answers every permission
    request with ``choice`` and keeps every frame it received."""

    def __init__(self, send: trio.abc.SendStream, receive: trio.abc.ReceiveStream) -> None:
        self._peer = NdjsonPeer(send, receive)
        self.frames: list[dict[str, Any]] = []
        self.choice = "allow"
        self._next = 100

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return await self.answer_of(await self.send(method, params))

    async def send(self, method: str, params: dict[str, Any]) -> int:
        """Send a request without reading its answer; its id, for :meth:`answer_of`."""
        self._next += 1
        await self._write({"jsonrpc": "2.0", "id": self._next, "method": method, "params": params})
        return self._next

    async def answer_of(self, request_id: int) -> dict[str, Any]:
        """The answer to request ``request_id`` (read already, or read now)."""
        for frame in self.frames:
            if frame.get("id") == request_id and "method" not in frame:
                return frame
        while True:
            frame = await self._read()
            if frame.get("id") == request_id and "method" not in frame:
                return frame
            if frame.get("method") == "session/request_permission":
                await self._permit(frame)

    async def permit_next(self) -> None:
        """Read up to the next permission request and answer it with ``choice``."""
        while (frame := await self._read()).get("method") != "session/request_permission":
            pass
        await self._permit(frame)

    async def _permit(self, frame: dict[str, Any]) -> None:
        strict(RequestPermissionRequest, frame["params"])
        await self._write(
            {
                "jsonrpc": "2.0",
                "id": frame["id"],
                "result": {"outcome": {"outcome": "selected", "optionId": self.choice}},
            }
        )

    async def _write(self, frame: dict[str, Any]) -> None:
        await self._peer.write(frame)

    async def _read(self) -> dict[str, Any]:
        frame = await self._peer.read()
        if frame.get("method") == "session/update":
            strict(SessionNotification, frame["params"])
        self.frames.append(frame)
        return frame

    def updates(self) -> list[dict[str, Any]]:
        return [f["params"]["update"] for f in self.frames if f.get("method") == "session/update"]


async def converse(
    tmp_path: Path, provider: ScriptedProvider, prompt: str, choice: str = "allow"
) -> tuple[Client, dict[str, Any]]:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    (workspace / "notes.txt").write_text("one\n", encoding="utf-8")
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    client = Client(to_agent, from_agent)
    client.choice = choice
    config = AcpConfig(provider=provider, tools=(*builtin_tools(), spawn_subagent))
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            agent = AcpAgent(host, config, agent_out)
            nursery.start_soon(agent.serve, agent_in)
            await client.call("initialize", {"protocolVersion": 1})
            created = await client.call("session/new", {"cwd": str(workspace), "mcpServers": []})
            sid = created["result"]["sessionId"]
            answer = await client.call(
                "session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": prompt}]}
            )
            await to_agent.aclose()
    assert provider.violations == []
    return client, answer


async def test_a_subagent_shows_on_its_spawn_call_and_asks_there(tmp_path: Path) -> None:
    """R-HOST-4: the child's work and its permission request are about the parent's
    spawn_subagent call; no tool_call of the child ever reaches the client."""
    provider = ScriptedProvider(
        [
            Reply(blocks=(tool_call("p1", "spawn_subagent", task="list the workspace"),)),
            Reply(blocks=(text("Listing."), tool_call("k1", "list_dir", path="."))),
            Reply(blocks=(text("One file: notes.txt."),)),
            Reply(blocks=(text("The subagent found notes.txt."),)),
        ]
    )
    client, answer = await converse(tmp_path, provider, "what is there?")
    strict(PromptResponse, answer["result"])
    assert answer["result"]["stopReason"] == "end_turn"
    updates = client.updates()
    assert [u["toolCallId"] for u in updates if u["sessionUpdate"] == "tool_call"] == ["p1"]
    assert {u["toolCallId"] for u in updates if "toolCallId" in u} == {"p1"}
    asked = [f["params"] for f in client.frames if f.get("method") == "session/request_permission"]
    assert [a["toolCall"]["toolCallId"] for a in asked] == ["p1", "p1"]
    assert asked[1]["toolCall"]["_meta"]["greenroom"]["callId"] == "k1"
    from_child = [u for u in updates if u.get("_meta", {}).get("greenroom", {}).get("origin")]
    assert from_child and all(u["status"] == "in_progress" for u in from_child)
    final = [u for u in updates if u.get("status") == "completed"]
    assert final[-1]["content"][0]["content"]["text"] == "One file: notes.txt."


async def test_thinking_streams_as_thought_chunks(tmp_path: Path) -> None:
    provider = ScriptedProvider([Reply(blocks=(thinking("Let me see."), text("Hello.")))])
    client, answer = await converse(tmp_path, provider, "hi")
    assert answer["result"]["stopReason"] == "end_turn"
    kinds = {u["sessionUpdate"] for u in client.updates()}
    assert kinds == {"agent_thought_chunk", "agent_message_chunk", "usage_update"}
    thought = "".join(
        u["content"]["text"]
        for u in client.updates()
        if u["sessionUpdate"] == "agent_thought_chunk"
    )
    assert thought == "Let me see."


async def test_a_refusal_is_the_stop_reason(tmp_path: Path) -> None:
    provider = ScriptedProvider([Reply(blocks=(text("I can't help."),), stop_reason="refusal")])
    _, answer = await converse(tmp_path, provider, "something bad")
    assert answer["result"]["stopReason"] == "refusal"


async def test_a_failed_task_is_a_json_rpc_error_with_its_message(tmp_path: Path) -> None:
    provider = ScriptedProvider(Reply(fail=model_error("auth", "invalid x-api-key")))
    _, answer = await converse(tmp_path, provider, "hi")
    strict(Error, answer["error"])
    assert answer["error"]["code"] == -32000
    assert "invalid x-api-key" in answer["error"]["message"]


async def test_mcp_servers_of_session_new_give_the_session_their_tools(tmp_path: Path) -> None:
    """R-MCP-1 through ACP: session/new's stdio server (a real one, built with the MCP SDK)
    gives the session its tools as mcp__<server>__<tool>; the answer names the servers."""
    server = MCP_SERVER
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    client = Client(to_agent, from_agent)
    servers = [{"name": "fs", "command": sys.executable, "args": [str(server)], "env": []}]
    with trio.fail_after(30):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            agent = AcpAgent(host, AcpConfig(provider=ScriptedProvider([])), agent_out)
            nursery.start_soon(agent.serve, agent_in)
            await client.call("initialize", {"protocolVersion": 1})
            created = await client.call(
                "session/new", {"cwd": str(tmp_path), "mcpServers": servers}
            )
            session = host.get_session(created["result"]["sessionId"])
            names = sorted(port_of(session).tool_by_name)
            await to_agent.aclose()
    strict(NewSessionResponse, created["result"])
    assert created["result"]["_meta"] == {
        "greenroom": {"mcpServers": ["fs"], "mcpConnected": True}
    }
    assert names and all(name.startswith("mcp__fs__") for name in names), names


async def test_an_image_prompt_reaches_the_model_as_a_stored_image(tmp_path: Path) -> None:
    """promptCapabilities.image: the base64 image is stored in the session's private
    attachments (R-SEC-8) and given to the model as an image block carrying its hash; the
    extensions answer on an idle session."""
    png = b"\x89PNG\r\n\x1a\nnot really"
    seen: list[ImageBlock] = []

    def look(request: ModelRequest) -> Reply:
        for part in request.messages[-1].content:
            if isinstance(part, ImageBlock):
                seen.append(part)
        return Reply(blocks=(text("A picture."),))

    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    client = Client(to_agent, from_agent)
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            agent = AcpAgent(host, AcpConfig(provider=ScriptedProvider([look])), agent_out)
            nursery.start_soon(agent.serve, agent_in)
            await client.call("initialize", {"protocolVersion": 1})
            created = await client.call("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            sid = created["result"]["sessionId"]
            image = {
                "type": "image",
                "mimeType": "image/png",
                "data": base64.b64encode(png).decode(),
            }
            prompt = [{"type": "text", "text": "what is this?"}, image]
            answer = await client.call("session/prompt", {"sessionId": sid, "prompt": prompt})
            bad = await client.call(
                "session/prompt",
                {"sessionId": sid, "prompt": [{**image, "data": "%%% not base64"}]},
            )
            skip = await client.call("_greenroom/skip_reconnect_wait", {"sessionId": sid})
            steer = await client.call(
                "_greenroom/steer", {"sessionId": sid, "prompt": [{"type": "text", "text": "x"}]}
            )
            unknown = await client.call("_greenroom/nothing", {"sessionId": sid})
            await to_agent.aclose()
    assert answer["result"]["stopReason"] == "end_turn"
    (block,) = seen
    assert block.media_type == "image/png" and block.sha256 == hashlib.sha256(png).hexdigest()
    stored = tmp_path / "data" / "sessions" / sid / "attachments" / block.sha256
    assert stored.read_bytes() == png
    assert bad["error"]["code"] == -32602
    assert skip["result"] == {"skipped": False}
    assert steer["result"] == {"queued": False}
    assert unknown["error"]["code"] == -32601


async def test_session_fork_continues_a_copy_of_the_history(tmp_path: Path) -> None:
    """R-FORK-1 over ACP: ``session/fork`` (advertised in ``sessionCapabilities``) makes a
    new session with the source's history — up to ``_meta.greenroom.atSeq`` when given —
    that the editor prompts like any; a seq out of range or an unknown session is an error
    naming it (the SDK's ForkSessionResponse shape)."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    provider = ScriptedProvider(
        [Reply(blocks=(text("first answer"),)), Reply(blocks=(text("forked answer"),))]
    )
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    client = Client(to_agent, from_agent)
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            agent = AcpAgent(host, AcpConfig(provider=provider), agent_out)
            nursery.start_soon(agent.serve, agent_in)
            init = await client.call("initialize", {"protocolVersion": 1})
            strict(InitializeResponse, init["result"])
            assert init["result"]["agentCapabilities"]["sessionCapabilities"]["fork"] == {}
            created = await client.call("session/new", {"cwd": str(workspace), "mcpServers": []})
            sid = created["result"]["sessionId"]
            prompt = {"sessionId": sid, "prompt": [{"type": "text", "text": "first"}]}
            await client.call("session/prompt", prompt)
            forked = await client.call("session/fork", {"sessionId": sid, "cwd": str(workspace)})
            strict(ForkSessionResponse, forked["result"])
            fork_id = forked["result"]["sessionId"]
            assert fork_id != sid and host.get_session(fork_id).forked_from is not None
            prompt = {"sessionId": fork_id, "prompt": [{"type": "text", "text": "second"}]}
            answer = await client.call("session/prompt", prompt)
            assert answer["result"]["stopReason"] == "end_turn"
            (_, second) = provider.requests
            assert [m.content[0].text for m in second.messages] == [
                "first", "first answer", "second"
            ]
            past = await client.call(
                "session/fork",
                {"sessionId": sid, "cwd": str(workspace), "_meta": {"greenroom": {"atSeq": 999}}},
            )
            assert past["error"]["message"].startswith("$._meta.greenroom.atSeq: seq 999 is out")
            strict(Error, past["error"])
            unknown = await client.call(
                "session/fork", {"sessionId": "20990101-000000-abcdef", "cwd": str(workspace)}
            )
            assert "no session" in unknown["error"]["message"]
            await to_agent.aclose()
    assert provider.violations == []


async def test_a_session_opened_while_the_agent_shuts_down_leaves_it_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The editor went away while its session/new was on its way: the session that opened
    # during the shutdown ended the agent with "dictionary changed size during iteration".
    workspace = tmp_path / "ws"
    workspace.mkdir()
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    client = Client(to_agent, from_agent)
    config = AcpConfig(provider=ScriptedProvider([]), tools=())
    creating, may_create = trio.Event(), trio.Event()
    asking, may_answer = trio.Event(), trio.Event()
    create, waits = Host.create_session, Asked.waits_for_people

    async def held_create(self: Host, **options: Any) -> Any:
        creating.set()
        await may_create.wait()
        return await create(self, **options)

    async def held_waits(self: Asked) -> bool:
        asking.set()
        await may_answer.wait()
        return await waits(self)

    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            agent = AcpAgent(host, config, agent_out)
            nursery.start_soon(agent.serve, agent_in)
            await client.call("initialize", {"protocolVersion": 1})
            await client.call("session/new", {"cwd": str(workspace), "mcpServers": []})
            monkeypatch.setattr(Host, "create_session", held_create)
            monkeypatch.setattr(Asked, "waits_for_people", held_waits)
            await client._write(
                {"jsonrpc": "2.0", "id": 1, "method": "session/new",
                 "params": {"cwd": str(workspace), "mcpServers": []}}
            )
            await creating.wait()
            await to_agent.aclose()  # the editor goes away
            await asking.wait()  # the shutdown looks at the first session
            may_create.set()
            await trio.testing.wait_all_tasks_blocked()  # the second one opens
            may_answer.set()
    assert len(host.sessions) == 0


@pytest.mark.parametrize("stage", ["closing", "closed"])
async def test_a_prompt_answering_a_question_of_a_session_being_closed_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """R-HITL-1, R-ACP-2, R-HOST-3: the prompt that answers a question the person chose to
    "Answer in my next message", once its content was read, reached the session after
    ``session/close`` had begun (or was done): the host loaded the session again, with
    its own tools and model and off the connection, to record the answer, and the client
    was told ``end_turn``. An answer after the close is not taken: the prompt is answered
    -32002 saying nothing was sent, the host lists the session no more, and the question
    stays pending in its trace (asked again on ``session/load``)."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    provider = ScriptedProvider(
        [Reply(blocks=(tool_call("q1", "ask_user", question="When shall we meet?"),))]
    )
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    client = Client(to_agent, from_agent)
    client.choice = "answer_next"
    config = AcpConfig(provider=provider, tools=(ask_user,))
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            nursery.start_soon(AcpAgent(host, config, agent_out).serve, agent_in)
            await client.call("initialize", {"protocolVersion": 1})
            created = await client.call("session/new", {"cwd": str(workspace), "mcpServers": []})
            sid = created["result"]["sessionId"]
            session = host.get_session(sid)
            prompt = [{"type": "text", "text": "plan a meeting"}]
            first = await client.send("session/prompt", {"sessionId": sid, "prompt": prompt})
            await client.permit_next()  # "Answer in my next message"
            read, let_go = hold_after_first(monkeypatch, acp_app, "_prompt_content")
            closing, let_close = hold_after_first(monkeypatch, Session, "aclose")
            prompt = [{"type": "text", "text": "Friday"}]
            answering = await client.send("session/prompt", {"sessionId": sid, "prompt": prompt})
            await read.wait()  # the answer's content is read: it goes to the question next
            close = await client.send("session/close", {"sessionId": sid})
            await closing.wait()  # the close began
            if stage == "closed":
                let_close.set()
                assert (await client.answer_of(close))["result"] == {}
            let_go.set()
            await trio.testing.wait_all_tasks_blocked()  # when closing: the answer goes on
            let_close.set()
            answer = await client.answer_of(answering)
            assert (await client.answer_of(close))["result"] == {}
            assert (await client.answer_of(first))["result"]["stopReason"] == "cancelled"
            assert answer.get("error", {}).get("code") == -32002, answer
            assert answer["error"]["message"] == (
                f"session {sid} is closed: its close began before the prompt reached it, so "
                "nothing was sent; session/load opens it again"
            )
            await trio.testing.wait_all_tasks_blocked()
            assert host.sessions == ()  # not loaded again to take the answer
            await to_agent.aclose()
    records = trace_lines(session)
    assert records[-1]["type"] == "approval_request" and records[-1]["kind"] == "question"
    assert len(provider.requests) == 1 and provider.violations == []


@asynccontextmanager
async def agent_on(
    data: Path, config: AcpConfig, disk: Disk | None = None
) -> AsyncIterator[tuple[Host, Client]]:
    """An ACP agent serving ``config`` on a host of ``data`` (its traces written through
    ``disk``, when given), initialized, and its client; the client's input is closed on
    leaving, so the agent ends as a client that leaves."""
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.memory_stream_one_way_pair()
    client = Client(to_agent, from_agent)
    store = None if disk is None else functools.partial(FileTraceStore, disk=disk)
    async with Host.open(data_dir=data, trace_store=store) as host, trio.open_nursery() as nursery:
        nursery.start_soon(AcpAgent(host, config, agent_out).serve, agent_in)
        await client.call("initialize", {"protocolVersion": 1})
        yield host, client
        await to_agent.aclose()


async def stopped_with_a_prompt_accepted(tmp_path: Path) -> tuple[Path, Path, Session]:
    """A session (its workspace and data dir) whose host stopped after it recorded its
    prompt's ``user_msg``, before its ``task_start``: accepted and not started."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    data = tmp_path / "data"
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=data) as host:
            stopped = await host.create_session(
                provider=ScriptedProvider([Reply(blocks=(text("Hello."),))]),
                workspace_dir=workspace,
            )
            await stopped.run("hello").result()
    cut_after(stopped.trace_path, lambda record: record["type"] == "user_msg")
    return workspace, data, stopped


def follow_up_accepted(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """Set once a session has accepted a follow-up (``Session.follow_up`` said True)."""
    accepted = trio.Event()
    follow_up = Session.follow_up

    def noted(self: Session, *args: Any, **kwargs: Any) -> bool:
        queued = follow_up(self, *args, **kwargs)
        if queued:
            accepted.set()
        return queued

    monkeypatch.setattr(Session, "follow_up", noted)
    return accepted


async def follow_up_as_its_task_ends(
    client: Client, monkeypatch: pytest.MonkeyPatch, sid: str, start: Callable[[], Awaitable[Any]]
) -> dict[str, Any]:
    """``start`` the session's work, then send ``_greenroom/follow_up`` while that work's
    last ``task_end`` is written and not yet published (the session still takes input,
    its stream has not seen the end); the follow-up's answer."""
    ending, let_end = hold_after_first(monkeypatch, OutputEmitter, "sync_task_end")
    accepted = follow_up_accepted(monkeypatch)
    await start()
    await ending.wait()
    prompt = [{"type": "text", "text": "and then?"}]
    follow_up = await client.send("_greenroom/follow_up", {"sessionId": sid, "prompt": prompt})
    await accepted.wait()
    let_end.set()
    return await client.answer_of(follow_up)


def assert_completed(session: Session, provider: ScriptedProvider, *, tasks: int) -> None:
    """``session``'s trace ends ``tasks`` tasks, each completed, and ``provider`` was sent
    a well-formed transcript every time."""
    ends = [r["status"] for r in trace_lines(session) if r["type"] == "task_end"]
    assert ends == ["completed"] * tasks
    assert provider.violations == []


def said(client: Client) -> str:
    """The text of the agent's messages the client was shown."""
    return "".join(
        u["content"]["text"]
        for u in client.updates()
        if u["sessionUpdate"] == "agent_message_chunk"
    )


async def test_a_follow_up_accepted_as_its_run_ends_streams_and_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-ACP-2: a follow-up the session accepted while the prompt's task_end
    was being written (before its stream saw it) runs after it on the prompt's stream:
    the editor sees its reply and its answer is its task's end_turn."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    provider = ScriptedProvider(
        [Reply(blocks=(text("Hello."),)), Reply(blocks=(text("Then this."),))]
    )
    config = AcpConfig(provider=provider, tools=())
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(tmp_path / "data", config) as (host, client):
            created = await client.call("session/new", {"cwd": str(workspace), "mcpServers": []})
            sid = created["result"]["sessionId"]
            session = host.get_session(sid)
            prompted: list[int] = []

            async def prompt() -> None:
                hello = [{"type": "text", "text": "hello"}]
                prompted.append(
                    await client.send("session/prompt", {"sessionId": sid, "prompt": hello})
                )

            answer = await follow_up_as_its_task_ends(client, monkeypatch, sid, prompt)
            assert answer.get("result", {}).get("stopReason") == "end_turn", answer
            assert (await client.answer_of(prompted[0]))["result"]["stopReason"] == "end_turn"
            assert said(client) == "Hello.Then this."
    assert_completed(session, provider, tasks=2)


async def test_a_follow_up_accepted_as_taken_up_work_ends_streams_and_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-HITL-4, R-ACP-2: a loaded session's prompt, accepted and not started by
    the host that stopped, is taken up; a follow-up the session accepted while that task's
    task_end was being written (its task_queued after that end) runs after it. It was
    answered "cancelled" and its reply never reached the editor, as the watch of the work
    ended at the task_end with no follow-up counted; now the editor sees its reply and
    its answer is its task's end_turn."""
    workspace, data, stopped = await stopped_with_a_prompt_accepted(tmp_path)
    provider = ScriptedProvider(
        [Reply(blocks=(text("Hello again."),)), Reply(blocks=(text("Then this."),))]
    )
    config = AcpConfig(provider=provider, tools=())
    sid = stopped.id
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(data, config) as (host, client):

            async def load() -> None:
                params = {"sessionId": sid, "cwd": str(workspace), "mcpServers": []}
                assert "result" in await client.call("session/load", params)

            answer = await follow_up_as_its_task_ends(client, monkeypatch, sid, load)
            assert answer.get("result", {}).get("stopReason") == "end_turn", answer
            assert said(client) == "Hello again.Then this."
            session = host.get_session(sid)
    assert_completed(session, provider, tasks=2)


async def test_follow_ups_hand_their_input_over_in_the_order_they_were_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-ACP-2: requests are answered concurrently, and the first follow-up's
    content takes longer to make (its image is stored off the event loop, held here until
    every other task waits). The second one sent waited for nothing and ran first; each
    now hands its input to the session in the order the editor sent it, so the first runs
    first and the second queues behind it."""
    asked: list[str] = []

    def reply(request: ModelRequest) -> Reply:
        asked.append(" ".join(p.text for p in request.messages[-1].content if hasattr(p, "text")))
        return Reply(blocks=(text("Done."),))

    stored = trio.Event()
    attach = Session.attach_image_data

    async def held_attach(self: Session, *args: Any, **kwargs: Any) -> Any:
        await stored.wait()
        return await attach(self, *args, **kwargs)

    monkeypatch.setattr(Session, "attach_image_data", held_attach)
    config = AcpConfig(provider=ScriptedProvider([reply, reply]), tools=())
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(tmp_path / "data", config) as (_, client):
            created = await client.call("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            sid = created["result"]["sessionId"]
            png = base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode()
            image = {"type": "image", "mimeType": "image/png", "data": png}
            first = [{"type": "text", "text": "first"}, image]
            second = [{"type": "text", "text": "second"}]
            sent = [
                await client.send("_greenroom/follow_up", {"sessionId": sid, "prompt": prompt})
                for prompt in (first, second)
            ]
            await trio.testing.wait_all_tasks_blocked()
            stored.set()
            for request_id in sent:
                assert (await client.answer_of(request_id))["result"]["stopReason"] == "end_turn"
    assert asked == ["first", "second"]


async def test_steering_reaches_the_running_task_while_an_earlier_prompt_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1, R-ACP-2: a loaded session's taken-up task runs (no prompt of this
    connection waits on it); a prompt sent now waits for that task to end before its own
    starts. Steering sent after that prompt is for the running task: it is handed over at
    once, not held behind the prompt's wait for the whole task."""
    workspace, data, stopped = await stopped_with_a_prompt_accepted(tmp_path)
    started, release = trio.Event(), trio.Event()

    async def held(request: ModelRequest, stream: Any) -> None:
        started.set()
        await release.wait()
        await stream.block(text("Hello again."))

    steered: list[str] = []
    steer = Session.steer

    def noted(self: Session, content: Any, *args: Any, **kwargs: Any) -> bool:
        steered.append(" ".join(getattr(part, "text", "") for part in content))
        return steer(self, content, *args, **kwargs)

    monkeypatch.setattr(Session, "steer", noted)
    provider = ScriptedProvider([held, Reply(blocks=(text("Next."),))])
    config = AcpConfig(provider=provider, tools=())
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(data, config) as (_, client):
            load = {"sessionId": stopped.id, "cwd": str(workspace), "mcpServers": []}
            await client.call("session/load", load)
            await started.wait()  # the taken-up task runs, its model request held
            prompt = [{"type": "text", "text": "next"}]
            await client.send("session/prompt", {"sessionId": stopped.id, "prompt": prompt})
            sent = await client.send("_greenroom/steer", {"sessionId": stopped.id, "text": "also"})
            await trio.testing.wait_all_tasks_blocked()
            assert steered == ["also"]  # before its task's end
            release.set()
            assert (await client.answer_of(sent))["result"] == {"queued": True}


async def test_a_follow_up_during_a_background_childs_follow_up_task_streams_and_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-TREE-2, R-ACP-2: a background child's answer starts a task in its idle
    parent, which the tree watch streams; a follow-up the editor sends during that task
    runs after it. The watch read that task alone: the follow-up was answered "cancelled"
    as the task ended; now the editor sees its reply and its answer is its end_turn."""
    release, merging, merge = trio.Event(), trio.Event(), trio.Event()

    async def model(request: ModelRequest, stream: ScriptedStream) -> None:
        users = [m for m in request.messages if isinstance(m, UserMessage)]
        said = "".join(p.text for p in users[-1].content if isinstance(p, TextBlock))
        if (request.system or "").startswith(SUBAGENT_SYSTEM):
            await release.wait()
            await stream.text("Scout report.")
        elif said.startswith("[subagent scout finished]"):
            merging.set()
            await merge.wait()
            await stream.text("Merged.")
        elif said == "and then?":
            await stream.text("Then this.")
        elif any(isinstance(p, ToolResult) for p in users[-1].content):
            await stream.text("Started the scout.")
        else:
            arguments = {"task": "scout the notes", "background": True, "name": "scout"}
            await stream.tool_call(
                ToolCallBlock(id="p1", name="spawn_subagent", arguments=arguments)
            )

    accepted = follow_up_accepted(monkeypatch)
    provider = ScriptedProvider(model)
    config = AcpConfig(provider=provider, tools=(spawn_subagent,), approve="all")
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(tmp_path / "data", config) as (host, client):
            created = await client.call("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            sid = created["result"]["sessionId"]
            research = [{"type": "text", "text": "research"}]
            answer = await client.call("session/prompt", {"sessionId": sid, "prompt": research})
            assert answer["result"]["stopReason"] == "end_turn"
            release.set()
            await merging.wait()
            await trio.testing.wait_all_tasks_blocked()  # the watch streams the task
            prompt = [{"type": "text", "text": "and then?"}]
            follow_up = await client.send(
                "_greenroom/follow_up", {"sessionId": sid, "prompt": prompt}
            )
            await accepted.wait()
            merge.set()
            answer = await client.answer_of(follow_up)
            assert answer.get("result", {}).get("stopReason") == "end_turn", answer
            assert said(client).endswith("Merged.Then this.")
            session = host.get_session(sid)
    assert_completed(session, provider, tasks=3)


async def test_a_follow_up_behind_ones_a_stopped_host_queued_is_answered_at_its_own_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-6, R-HITL-4, R-ACP-2: a loaded session runs the two follow-ups its stopped
    host left queued, and the editor sends one during the first. The editor's was answered
    at the end of the second queued one's task, with that task's stop reason (a refusal),
    before its own ran; now its answer is its own task's end_turn, after its reply."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    data = tmp_path / "data"
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=data) as host:
            stopped = await host.create_session(
                provider=ScriptedProvider(Reply(blocks=(text("Done."),))),
                workspace_dir=workspace,
            )
            stream = stopped.run("hello")
            assert stopped.follow_up("queued one") and stopped.follow_up("queued two")
            await stream.result()
    kept = cut_after(stopped.trace_path, lambda record: record["type"] == "task_end")
    assert [r["type"] for r in kept].count("task_queued") == 2
    asked, go = trio.Event(), trio.Event()

    async def model(request: ModelRequest, stream: ScriptedStream) -> None:
        last = request.messages[-1].content
        said = "".join(p.text for p in last if isinstance(p, TextBlock))
        if said == "queued one":
            asked.set()
            await go.wait()
            await stream.text("One.")
        elif said == "queued two":
            await stream.text("I can't.")
            await stream.end("refusal")
        else:
            await stream.text("Then this.")

    accepted = follow_up_accepted(monkeypatch)
    provider = ScriptedProvider(model)
    config = AcpConfig(provider=provider, tools=())
    sid = stopped.id
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(data, config) as (host, client):
            params = {"sessionId": sid, "cwd": str(workspace), "mcpServers": []}
            assert "result" in await client.call("session/load", params)
            await asked.wait()
            prompt = [{"type": "text", "text": "and then?"}]
            params = {"sessionId": sid, "prompt": prompt}
            follow_up = await client.send("_greenroom/follow_up", params)
            await accepted.wait()
            go.set()
            answer = await client.answer_of(follow_up)
            assert answer.get("result", {}).get("stopReason") == "end_turn", answer
            assert said(client).endswith("One.I can't.Then this.")
            session = host.get_session(sid)
    prompts = [r for r in trace_lines(session) if r["type"] == "user_msg"]
    asked_in_order = ["hello", "queued one", "queued two", "and then?"]
    assert [p["content"][0]["text"] for p in prompts] == asked_in_order
    assert provider.violations == []
