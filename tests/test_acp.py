"""``greenroom acp`` driven as an editor drives it (R-ACP-1): a subprocess, the official ACP
Python SDK's client side (``agent-client-protocol``, asyncio) on its stdin and stdout, the
scripted model and test tools from a ``--tools`` file.

Every frame greenroom writes is kept as raw text and checked at the end of each test: one
JSON-RPC object a line and nothing else on stdout, each validated against the SDK's
pydantic schema models *strictly* (the model's dump must give back the frame, so an unknown
field or a value the SDK would quietly salvage fails the test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest
from acp import RequestError
from acp.client.connection import ClientSideConnection
from acp.connection import StreamDirection, StreamEvent
from acp.schema import (
    AllowedOutcome,
    CloseSessionResponse,
    CreateTerminalRequest,
    DeniedOutcome,
    Error,
    ForkSessionResponse,
    InitializeResponse,
    KillTerminalRequest,
    ListSessionsResponse,
    LoadSessionResponse,
    NewSessionResponse,
    PromptResponse,
    ReadTextFileRequest,
    ReleaseTerminalRequest,
    RequestPermissionRequest,
    RequestPermissionResponse,
    SessionNotification,
    SetSessionModeResponse,
    TerminalOutputRequest,
    TextContentBlock,
    ToolCallUpdate,
    WaitForTerminalExitRequest,
    WriteTextFileRequest,
)
from conftest import cut_after

from greenroom.actors.apps.demo import write_demo_workspace
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "greenroom"]
TIMEOUT_S = 60.0
PROMPT_CANCEL_S = 10.0
"""How long a cancelled prompt's answer is waited for: a hang bound, not a speed test
(R-ABORT-1 aims at 100 ms; the prompts cancelled here would never end otherwise, their
tool blocked for good, and a busy machine must not fail them)."""

TOOLS = '''
"""Test doubles of the demo's tools: noisy on stdout, and able to block."""
import os

import trio

from greenroom.actors.tools.builtin import builtin_tools
from greenroom.protocols.tools import ToolContext, tool

_REAL = {t.name: t for t in builtin_tools()}


@tool(parallel=True)
async def list_dir(path: str, *, ctx: ToolContext) -> str:
    """List a directory."""
    print("a tool printing on stdout")
    os.system("echo a child process printing on stdout")
    ctx.report_progress("listing " + path)
    if (ctx.workspace_dir / "BLOCK").exists():
        await trio.sleep_forever()
    return await _REAL["list_dir"].function(path=path, ctx=ctx)
'''

RESPONSE_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "initialize": InitializeResponse,
    "session/new": NewSessionResponse,
    "session/load": LoadSessionResponse,
    "session/prompt": PromptResponse,
    "session/fork": ForkSessionResponse,
    "session/list": ListSessionsResponse,
    "session/set_mode": SetSessionModeResponse,
    "session/close": CloseSessionResponse,
    "_greenroom/follow_up": PromptResponse,
}

REQUEST_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "session/request_permission": RequestPermissionRequest,
    "fs/read_text_file": ReadTextFileRequest,
    "fs/write_text_file": WriteTextFileRequest,
    "terminal/create": CreateTerminalRequest,
    "terminal/output": TerminalOutputRequest,
    "terminal/wait_for_exit": WaitForTerminalExitRequest,
    "terminal/kill": KillTerminalRequest,
    "terminal/release": ReleaseTerminalRequest,
}
"""The requests greenroom sends the editor, each checked against its model."""


def strict(model: type[pydantic.BaseModel], data: Any) -> pydantic.BaseModel:
    """Validate ``data`` and insist that the model keeps every field as sent."""
    parsed = model.model_validate(data)
    dumped = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert dumped == data, f"{model.__name__} does not keep the frame as sent:\n{data}\n{dumped}"
    return parsed


class Editor:
    """The client side: records updates, answers permission requests with ``choose``."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, Any]] = []
        self.permissions: list[ToolCallUpdate] = []
        self.choose: Callable[[ToolCallUpdate], str | None] = lambda call: "allow"
        self.release = asyncio.Event()
        self.asked = asyncio.Event()
        self.changed = asyncio.Event()

    async def request_permission(
        self, options: Any, session_id: str, tool_call: ToolCallUpdate, **kwargs: Any
    ) -> RequestPermissionResponse:
        self.permissions.append(tool_call)
        self.asked.set()
        choice = self.choose(tool_call)
        if choice is None:  # hold the question until released, then say cancelled
            await self.release.wait()
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(
            outcome=AllowedOutcome(option_id=choice, outcome="selected")
        )

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append((session_id, update))
        self.changed.set()

    async def wait_for(self, check: Callable[[Any], bool]) -> Any:
        while True:
            for _, update in self.updates:
                if check(update):
                    return update
            self.changed.clear()
            await self.changed.wait()

    def kinds(self) -> list[str]:
        return [update.session_update for _, update in self.updates]

    def text(self, kind: str = "agent_message_chunk") -> str:
        return "".join(
            u.content.text
            for _, u in self.updates
            if u.session_update == kind and isinstance(u.content, TextContentBlock)
        )


class Agent:
    """A ``greenroom acp`` process with the SDK's client connection on its pipes, and a
    tap on both directions for the frame checks."""

    def __init__(self, process: asyncio.subprocess.Process, editor: Editor) -> None:
        self.process = process
        self.editor = editor
        self.raw: list[bytes] = []
        self.events: list[StreamEvent] = []
        self.traffic = asyncio.Event()
        """Set at each message sent or received (cleared by whoever waits on it)."""
        self.stderr = bytearray()
        self._reader = asyncio.StreamReader(limit=64 << 20)
        self._tasks = [
            asyncio.create_task(self._tee()),
            asyncio.create_task(self._drain_stderr()),
        ]
        assert process.stdin is not None
        self.conn = ClientSideConnection(
            editor, process.stdin, self._reader, observers=[self._observe]
        )

    def _observe(self, event: StreamEvent) -> None:
        self.events.append(event)
        self.traffic.set()

    async def wait_sent(self, check: Callable[[dict[str, Any]], bool]) -> None:
        """Return once a message the client has written satisfies ``check``."""
        while not any(
            e.direction == StreamDirection.OUTGOING and check(e.message) for e in self.events
        ):
            self.traffic.clear()
            await self.traffic.wait()

    async def _tee(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.raw.append(line)
            self._reader.feed_data(line)
        self._reader.feed_eof()

    async def _drain_stderr(self) -> None:
        assert self.process.stderr is not None
        while chunk := await self.process.stderr.read(1 << 16):
            self.stderr += chunk

    def write_raw(self, data: bytes) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(data)

    async def close_stdin(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        code = await asyncio.wait_for(self.process.wait(), TIMEOUT_S)
        await asyncio.gather(*self._tasks)
        return code

    def check_frames(self) -> None:
        """Every line greenroom wrote is one JSON-RPC message valid for the SDK."""
        methods: dict[Any, str] = {}
        for event in self.events:
            message = event.message
            if (
                event.direction == StreamDirection.OUTGOING
                and "method" in message
                and "id" in message
            ):
                methods[message["id"]] = message["method"]
        for line in self.raw:
            assert line.endswith(b"\n")
            frame = json.loads(line)
            assert isinstance(frame, dict) and frame.get("jsonrpc") == "2.0", line
            if frame.get("method") == "session/update":
                strict(SessionNotification, frame["params"])
            elif frame.get("method") in REQUEST_MODELS:
                assert "id" in frame, line
                strict(REQUEST_MODELS[frame["method"]], frame["params"])
            elif str(frame.get("method", "")).startswith("_greenroom/"):
                assert "id" in frame and isinstance(frame.get("params"), dict), line
            elif "error" in frame:
                assert set(frame) == {"jsonrpc", "id", "error"}, line
                strict(Error, frame["error"])
            else:
                assert "result" in frame, line
                model = RESPONSE_MODELS.get(methods.get(frame["id"], ""))
                if model is not None:
                    strict(model, frame["result"])


def env_for(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")
    }
    env["GREENROOM_HOME"] = str(tmp_path / "home")
    env["NO_COLOR"] = "1"
    return env


@contextlib.asynccontextmanager
async def spawned_agent(tmp_path: Path, editor: Any, *argv: str) -> AsyncIterator[Agent]:
    """The agent process ``argv`` (run in ``tmp_path``, its home there), driven by
    ``editor``; killed at exit if it is still running."""
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=tmp_path, env=env_for(tmp_path), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    agent = Agent(process, editor)
    try:
        yield agent
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def greenroom_acp(tmp_path: Path, *flags: str) -> AsyncIterator[Agent]:
    tools = tmp_path / "acp_test_tools.py"
    tools.write_text(TOOLS, encoding="utf-8")
    async with spawned_agent(
        tmp_path, Editor(), *CLI, "acp", "--provider", "scripted",
        "--data-dir", str(tmp_path / "data"), "--tools", str(tools), *flags,
    ) as agent:  # fmt: skip
        yield agent


async def start(agent: Agent, workspace: Path) -> str:
    init = await agent.conn.initialize(protocol_version=1)
    assert init.protocol_version == 1
    created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])
    return created.session_id


async def held_at_its_first_call(
    agent: Agent, workspace: Path
) -> tuple[str, asyncio.Task[PromptResponse]]:
    """A new session's prompt (the demo's) running and held at its first call's permission
    request until ``agent.editor.release`` is set (then each is allowed for the session);
    the session and the prompt's task."""
    sid = await start(agent, workspace)
    editor = agent.editor
    editor.choose = lambda call: None if not editor.release.is_set() else "allow_session"
    task = asyncio.create_task(agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT)))
    await editor.asked.wait()
    return sid, task


def text(value: str) -> list[TextContentBlock]:
    return [TextContentBlock(type="text", text=value)]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    write_demo_workspace(directory)
    return directory


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


# -- the tests ---------------------------------------------------------------------------------


def test_initialize_new_and_a_prompt_with_permissions_streams_updates(
    tmp_path: Path, workspace: Path
) -> None:
    """R-ACP-1: version 1 and the capabilities; a prompt streams text chunks and tool calls
    with title, kind and rawInput; each call is asked about (allow once for list_dir, allow
    always for the first read_file, so the other reads are decided by the session rule);
    the answer is end_turn; a tool printing on stdout does not reach the protocol."""

    async def scenario() -> None:
        async with greenroom_acp(tmp_path) as agent:
            init = await agent.conn.initialize(protocol_version=1)
            caps = init.agent_capabilities
            assert init.protocol_version == 1
            assert init.agent_info is not None and init.agent_info.name == "greenroom"
            assert caps is not None and caps.load_session
            assert caps.prompt_capabilities is not None and caps.prompt_capabilities.image
            assert caps.mcp_capabilities is not None and caps.mcp_capabilities.http
            created = await agent.conn.new_session(cwd=str(workspace), mcp_servers=[])
            editor = agent.editor
            editor.choose = lambda call: (
                "allow" if call.title and call.title.startswith("List") else "allow_session"
            )
            answer = await agent.conn.prompt(
                session_id=created.session_id, prompt=text(DEMO_PROMPT)
            )
            assert answer.stop_reason == "end_turn"
            assert [p.kind for p in editor.permissions] == ["read", "read"]
            assert editor.permissions[0].title == "List ."
            calls = [u for _, u in editor.updates if u.session_update == "tool_call"]
            assert [c.kind for c in calls] == ["read"] * 4
            assert calls[0].raw_input == {"path": "."}
            assert calls[1].title.startswith("Read ") and calls[1].locations
            ends = [
                u
                for _, u in editor.updates
                if u.session_update == "tool_call_update" and u.status in ("completed", "failed")
            ]
            assert [e.status for e in ends] == ["completed"] * 4
            assert "sales_north.csv" in ends[0].content[0].content.text
            assert "| north |" in editor.text().lower() or "north" in editor.text().lower()
            progress = [
                u
                for _, u in editor.updates
                if u.session_update == "tool_call_update" and u.content
                and getattr(u.content[0].content, "text", "") == "listing ."
            ]  # fmt: skip
            assert progress, "the tool's progress note is shown on its call"
            assert await agent.close_stdin() == 0
            agent.check_frames()
            assert b"printing on stdout" in agent.stderr

    run(scenario())


def test_a_rejected_call_fails_and_the_task_goes_on(tmp_path: Path, workspace: Path) -> None:
    """R-APPROVE-3 through ACP: reject_once denies; the call's update is failed with the
    denial and the model still answers (end_turn)."""

    async def scenario() -> None:
        async with greenroom_acp(tmp_path) as agent:
            sid = await start(agent, workspace)
            agent.editor.choose = lambda call: "deny"
            answer = await agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            assert answer.stop_reason == "end_turn"
            failed = await agent.editor.wait_for(
                lambda u: u.session_update == "tool_call_update" and u.status == "failed"
            )
            assert failed.content[0].content.text == "Tool call denied by user."
            assert failed.field_meta == {"greenroom": {"status": "denied"}}
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_hooks_deny_calls_before_the_editor_is_asked(tmp_path: Path, workspace: Path) -> None:
    """R-HOOK-2 through ACP: ``greenroom acp --hooks FILE`` gives every session the file's
    command hooks: a denied call fails with the hook's reason and the editor is never
    asked about it; the task goes on."""
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps({"before_tool": [
        {"match": "list_dir", "command": "echo 'no listings here' >&2; exit 2"}
    ]}), encoding="utf-8")

    async def scenario() -> None:
        async with greenroom_acp(tmp_path, "--hooks", str(hooks)) as agent:
            sid = await start(agent, workspace)
            agent.editor.choose = lambda call: "allow_session"
            answer = await agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            assert answer.stop_reason == "end_turn"
            failed = await agent.editor.wait_for(
                lambda u: u.session_update == "tool_call_update" and u.status == "failed"
            )
            assert failed.content[0].content.text == (
                "Tool call denied by a hook: no listings here"
            )
            assert all(not (p.title or "").startswith("List") for p in agent.editor.permissions)
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_cancel_mid_tool_answers_cancelled_promptly(tmp_path: Path, workspace: Path) -> None:
    """R-ABORT-1 through ACP: session/cancel while a tool blocks ends the prompt with
    cancelled at once, and the call's update says failed (interrupted)."""
    (workspace / "BLOCK").write_text("", encoding="utf-8")

    async def scenario() -> None:
        async with greenroom_acp(tmp_path, "--approve", "all") as agent:
            sid = await start(agent, workspace)
            prompt = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            )
            await agent.editor.wait_for(
                lambda u: u.session_update == "tool_call_update" and u.content
                and getattr(u.content[0].content, "text", "").startswith("listing")
            )  # fmt: skip
            await agent.conn.cancel(session_id=sid)
            answer = await asyncio.wait_for(prompt, PROMPT_CANCEL_S)
            assert answer.stop_reason == "cancelled"
            last = [u for _, u in agent.editor.updates if u.session_update == "tool_call_update"][
                -1
            ]
            assert last.status == "failed"
            assert last.field_meta == {"greenroom": {"status": "interrupted"}}
            assert await agent.close_stdin() == 0
            agent.check_frames()
        trace = next((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
        records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
        assert records[-1]["type"] == "task_end" and records[-1]["status"] == "aborted"

    run(scenario())


def test_a_pending_permission_cancelled_by_the_client_denies(
    tmp_path: Path, workspace: Path
) -> None:
    """The client answers a held permission request with outcome cancelled (as an editor
    does when its user cancels): the call is denied, the task goes on."""

    async def scenario() -> None:
        async with greenroom_acp(tmp_path) as agent:
            sid = await start(agent, workspace)
            agent.editor.choose = lambda call: None
            prompt = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            )
            await agent.editor.asked.wait()
            agent.editor.release.set()
            answer = await prompt
            assert answer.stop_reason == "end_turn"
            assert "denied" in agent.editor.text()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_load_replays_the_history_in_a_fresh_process(tmp_path: Path, workspace: Path) -> None:
    """session/load in a new process replays the stored conversation as updates before it
    answers: the user's prompt, the model's text, each tool call and its end; the session
    then takes a new prompt."""

    async def first() -> str:
        async with greenroom_acp(tmp_path, "--approve", "all") as agent:
            sid = await start(agent, workspace)
            answer = await agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            assert answer.stop_reason == "end_turn"
            assert await agent.close_stdin() == 0
            return sid

    sid = run(first())

    async def second() -> None:
        async with greenroom_acp(tmp_path, "--approve", "all") as agent:
            await agent.conn.initialize(protocol_version=1)
            await agent.conn.load_session(cwd=str(workspace), session_id=sid, mcp_servers=[])
            editor = agent.editor
            kinds = editor.kinds()
            assert kinds[0] == "user_message_chunk"
            assert editor.text("user_message_chunk") == DEMO_PROMPT
            assert kinds.count("tool_call") == 4
            assert "north" in editor.text().lower()
            replayed = len(editor.updates)
            answer = await agent.conn.prompt(session_id=sid, prompt=text("thanks"))
            assert answer.stop_reason == "end_turn"
            assert len(editor.updates) > replayed
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(second())


def test_bad_frames_get_errors_and_the_connection_stays(tmp_path: Path, workspace: Path) -> None:
    """Malformed frames are answered with JSON-RPC errors (-32700, -32600, -32601, -32602,
    and -32002 for an unknown session) and the agent keeps serving."""

    async def scenario() -> None:
        async with greenroom_acp(tmp_path) as agent:
            sid = await start(agent, workspace)
            for frame in (
                b"this is not json\n",
                b"\xff\xfe not utf-8\n",
                b"[]\n",
                b'{"jsonrpc":"2.0","id":901}\n',
                b'{"jsonrpc":"2.0","id":902,"method":"no/such/method","params":{}}\n',
                b'{"jsonrpc":"2.0","id":903,"method":"session/prompt","params":'
                b'{"sessionId":"' + sid.encode() + b'","prompt":"not a list"}}\n',
                b'{"jsonrpc":"2.0","id":904,"method":"session/new","params":{"cwd":"relative"}}\n',
            ):
                agent.write_raw(frame)
            with pytest.raises(RequestError) as unknown:
                await agent.conn.prompt(session_id="20990101-000000-abcdef", prompt=text("hi"))
            assert unknown.value.code == -32002
            with pytest.raises(RequestError) as traversal:
                await agent.conn.prompt(session_id="../../etc", prompt=text("hi"))
            assert traversal.value.code == -32002
            with pytest.raises(RequestError) as missing:
                await agent.conn.load_session(
                    cwd=str(workspace), session_id="20990101-000000-abcdef", mcp_servers=[]
                )
            assert missing.value.code == -32002
            answer = await agent.conn.prompt(session_id=sid, prompt=text("still there?"))
            assert answer.stop_reason == "end_turn"
            assert await agent.close_stdin() == 0
            agent.check_frames()
            errors = {}
            for line in agent.raw:
                frame = json.loads(line)
                if "error" in frame:
                    errors.setdefault(frame["id"], []).append(frame["error"]["code"])
            assert errors[None] == [-32700, -32700, -32600]
            assert errors[901] == [-32600]
            assert errors[902] == [-32601]
            assert errors[903] == [-32602]
            assert errors[904] == [-32602]

    run(scenario())


def test_prompt_while_running_steers_and_follow_up_queues(tmp_path: Path, workspace: Path) -> None:
    """R-STEER through ACP: a session/prompt sent while a task waits for a permission joins
    that task (the model sees it) and is answered when it ends; _greenroom/follow_up runs
    its task after, and is answered when that one ends."""

    async def scenario() -> None:
        async with greenroom_acp(tmp_path) as agent:
            sid, first = await held_at_its_first_call(agent, workspace)
            editor = agent.editor
            steer = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text("count the files too"))
            )
            follow = asyncio.create_task(
                agent.conn.ext_method(
                    "greenroom/follow_up",
                    {"sessionId": sid, "prompt": [{"type": "text", "text": "and now?"}]},
                )
            )
            # Both frames are read before the held permission is answered (frames are read
            # in order, and this one is answered after them).
            queued = await agent.conn.ext_method(
                "greenroom/steer", {"sessionId": sid, "prompt": [{"type": "text", "text": "x"}]}
            )
            assert queued == {"queued": True}
            editor.release.set()
            assert (await first).stop_reason == "end_turn"
            assert (await steer).stop_reason == "end_turn"
            followed = await follow
            assert followed["stopReason"] == "end_turn" and followed["usage"]["totalTokens"] > 0
            assert "count the files too" in editor.text()  # the steering prompt reached the model
            assert 'You asked: "and now?"' in editor.text()
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_max_turns_answers_max_turn_requests(tmp_path: Path, workspace: Path) -> None:
    async def scenario() -> None:
        async with greenroom_acp(tmp_path, "--approve", "all", "--max-turns", "1") as agent:
            sid = await start(agent, workspace)
            answer = await agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            assert answer.stop_reason == "max_turn_requests"
            assert await agent.close_stdin() == 0
            agent.check_frames()

    run(scenario())


def test_stdin_closed_mid_task_interrupts_it_and_exits_0(tmp_path: Path, workspace: Path) -> None:
    """The editor goes away while a tool blocks: the task is interrupted, its trace ends
    with task_end(aborted), the process exits 0."""
    (workspace / "BLOCK").write_text("", encoding="utf-8")

    async def scenario() -> str:
        async with greenroom_acp(tmp_path, "--approve", "all") as agent:
            sid = await start(agent, workspace)
            prompt = asyncio.create_task(
                agent.conn.prompt(session_id=sid, prompt=text(DEMO_PROMPT))
            )
            await agent.editor.wait_for(
                lambda u: u.session_update == "tool_call_update" and u.status == "in_progress"
            )
            assert await agent.close_stdin() == 0
            with contextlib.suppress(Exception):
                await prompt
            agent.check_frames()
            return sid

    sid = run(scenario())
    trace = next((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
    records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
    assert records[-1]["type"] == "task_end" and records[-1]["status"] == "aborted"


def test_a_command_line_that_cannot_run_exits_2_with_nothing_on_stdout(tmp_path: Path) -> None:
    import subprocess

    for flags in (["--provider", "anthropic"], ["--tools", "no_such_file.py"], ["--bogus"]):
        result = subprocess.run(
            [*CLI, "acp", *flags], cwd=tmp_path, env=env_for(tmp_path), input="",
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert result.stdout == ""
        assert "Traceback" not in result.stderr


async def loaded_then_thanked(
    tmp_path: Path, workspace: Path, sid: str, left: tuple[str, ...]
) -> None:
    """In a new process, load ``sid`` and at once prompt "thanks": the work its trace
    ``left`` (those prompts, in order) runs first, its updates reach the editor, and the
    prompt is answered end_turn after them; the agent exits 0 with well-formed frames."""
    async with greenroom_acp(tmp_path) as agent:
        await agent.conn.initialize(protocol_version=1)
        await agent.conn.load_session(cwd=str(workspace), session_id=sid, mcp_servers=[])
        answer = await agent.conn.prompt(session_id=sid, prompt=text("thanks"))
        assert answer.stop_reason == "end_turn"
        said = agent.editor.text()
        positions = [said.find(f'You asked: "{words}"') for words in (*left, "thanks")]
        assert -1 not in positions and positions == sorted(positions), said
        assert await agent.close_stdin() == 0
        agent.check_frames()


def test_follow_ups_a_stopped_host_left_queued_run_after_load(
    tmp_path: Path, workspace: Path
) -> None:
    """R-STEER-6, R-HITL-4, R-ACP-2: the host stopped after a task's end, before the two
    follow-ups queued behind it started (no task open, both recorded as queued). Loaded in
    a new process, both run in order and their updates reach the editor; a prompt sent
    at once runs after them, and nothing is dropped."""

    async def first() -> str:
        async with greenroom_acp(tmp_path) as agent:
            sid, task = await held_at_its_first_call(agent, workspace)
            editor = agent.editor
            follow_ups = []
            for words in ("and now?", "and then?"):
                params = {"sessionId": sid, "prompt": [{"type": "text", "text": words}]}
                follow_ups.append(
                    asyncio.create_task(agent.conn.ext_method("greenroom/follow_up", params))
                )
                await agent.wait_sent(lambda m, sent=params: m.get("params") == sent)
            # Answered after both follow-ups are read (frames are read in order).
            await agent.conn.list_sessions()
            editor.release.set()
            assert (await task).stop_reason == "end_turn"
            for follow_up in follow_ups:
                assert (await follow_up)["stopReason"] == "end_turn"
            assert await agent.close_stdin() == 0
            return sid

    sid = run(first())
    trace = next((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
    kept = cut_after(trace, lambda record: record["type"] == "task_end")
    queued = [r["queue_id"] for r in kept if r["type"] == "task_queued"]
    assert len(queued) == 2 and "task_queue_dropped" not in [r["type"] for r in kept]

    run(loaded_then_thanked(tmp_path, workspace, sid, ("and now?", "and then?")))
    records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
    assert "task_queue_dropped" not in [r["type"] for r in records]
    prompts = [r for r in records if r["type"] == "user_msg" and r["kind"] == "prompt"]
    assert [p.get("queued_id") for p in prompts[1:]] == [*queued, None]
    assert [r["status"] for r in records if r["type"] == "task_end"] == ["completed"] * 4


def test_a_prompt_accepted_and_not_started_runs_after_load(
    tmp_path: Path, workspace: Path
) -> None:
    """R-CLUSTER-2, R-HITL-4, R-ACP-2: the host stopped after it recorded a prompt's
    user_msg, before its task_start (the run was accepted, not started). Loaded in a new
    process, the accepted prompt runs and its updates reach the editor; a prompt sent at
    once runs after it, and each prompt runs once."""

    async def first() -> str:
        async with greenroom_acp(tmp_path) as agent:
            sid = await start(agent, workspace)
            for words in ("hello", "are you there?"):
                answer = await agent.conn.prompt(session_id=sid, prompt=text(words))
                assert answer.stop_reason == "end_turn"
            assert await agent.close_stdin() == 0
            return sid

    sid = run(first())
    trace = next((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
    kept = cut_after(
        trace,
        lambda record: record["type"] == "user_msg"
        and record["content"] == [{"type": "text", "text": "are you there?"}],
    )
    accepted = kept[-1]["run_id"]
    assert [r["type"] for r in kept].count("task_start") == 1

    run(loaded_then_thanked(tmp_path, workspace, sid, ("are you there?",)))
    records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
    prompts = [r for r in records if r["type"] == "user_msg" and r["kind"] == "prompt"]
    assert [p["content"][0]["text"] for p in prompts] == ["hello", "are you there?", "thanks"]
    starts = [r["run_id"] for r in records if r["type"] == "task_start"]
    assert starts[1] == accepted and len(starts) == 3
    assert [r["status"] for r in records if r["type"] == "task_end"] == ["completed"] * 3
