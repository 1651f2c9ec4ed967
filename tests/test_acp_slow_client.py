"""An editor that reads the ACP agent's output slowly, or not at all (R-ACP-1, R-ACTOR-1):
the session's pump drains its run's channel without waiting on the client, so no task is
held up; what waits to be written is bounded, and a client that leaves more than the
bound unread is taken as gone: the agent stops as if its stdout had closed, its task is
interrupted and the trace keeps everything. The client's side is a lockstep stream: the
agent's writer is stuck in ``send_all`` for as long as the client does not read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from greenroom.actors.apps.acp import AcpAgent, AcpConfig
from greenroom.actors.runtime.host import Host
from greenroom.actors.scripted import Reply, ScriptedProvider, text
from greenroom.protocols.context import ModelRequest
from tests.support.ndjson import NdjsonPeer

TIMEOUT_S = 20
PIECES = [f"{i:05d} " + "x" * 994 for i in range(300)]  # 300 text blocks of 1000 chars


class Editor:
    """Writes requests; reads frames only when asked to."""

    def __init__(self, send: trio.abc.SendStream, receive: trio.abc.ReceiveStream) -> None:
        self._peer = NdjsonPeer(send, receive)
        self._next = 0

    async def request(self, method: str, params: dict[str, Any]) -> int:
        self._next += 1
        await self._peer.write(
            {"jsonrpc": "2.0", "id": self._next, "method": method, "params": params}
        )
        return self._next

    async def read(self) -> dict[str, Any]:
        return await self._peer.read()

    async def answer(self, request_id: int) -> dict[str, Any]:
        while True:
            frame = await self.read()
            if frame.get("id") == request_id and "method" not in frame:
                return frame


def long_reply(asked: trio.Event) -> ScriptedProvider:
    def step(request: ModelRequest) -> Reply:
        asked.set()
        return Reply(blocks=tuple(text(piece) for piece in PIECES))

    return ScriptedProvider([step])


async def open_session(editor: Editor, workspace: Path) -> str:
    await editor.answer(await editor.request("initialize", {"protocolVersion": 1}))
    created = await editor.answer(
        await editor.request("session/new", {"cwd": str(workspace), "mcpServers": []})
    )
    sid: str = created["result"]["sessionId"]
    return sid


def prompt(sid: str) -> dict[str, Any]:
    return {"sessionId": sid, "prompt": [{"type": "text", "text": "write a lot"}]}


async def test_a_client_that_reads_late_holds_up_nothing_and_loses_nothing(
    tmp_path: Path,
) -> None:
    asked = trio.Event()
    provider = long_reply(asked)
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.lockstep_stream_one_way_pair()
    editor = Editor(to_agent, from_agent)
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            agent = AcpAgent(host, AcpConfig(provider=provider), agent_out)
            nursery.start_soon(agent.serve, agent_in)
            sid = await open_session(editor, tmp_path)
            prompt_id = await editor.request("session/prompt", prompt(sid))
            await asked.wait()
            # The client reads nothing while the task runs: the task ends all the same.
            await host.get_session(sid).wait_idle()
            chunks: list[str] = []
            while True:
                frame = await editor.read()
                if frame.get("id") == prompt_id:
                    break
                update = frame["params"]["update"]
                if update["sessionUpdate"] == "agent_message_chunk":
                    chunks.append(update["content"]["text"])
            await to_agent.aclose()
    assert frame["result"]["stopReason"] == "end_turn"
    assert "".join(chunks) == "".join(PIECES)


async def test_a_client_that_stops_reading_is_cut_off_at_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asked = trio.Event()
    provider = long_reply(asked)
    to_agent, agent_in = trio.testing.memory_stream_one_way_pair()
    agent_out, from_agent = trio.testing.lockstep_stream_one_way_pair()
    editor = Editor(to_agent, from_agent)
    bound = 32 * 1024  # a tenth of what the task streams
    stopped = trio.Event()
    with trio.fail_after(TIMEOUT_S):
        async with Host.open(data_dir=tmp_path / "data") as host, trio.open_nursery() as nursery:
            agent = AcpAgent(host, AcpConfig(provider=provider), agent_out, max_pending_bytes=bound)

            async def serve() -> None:
                await agent.serve(agent_in)
                stopped.set()

            nursery.start_soon(serve)
            sid = await open_session(editor, tmp_path)
            await editor.request("session/prompt", prompt(sid))
            # The input stays open: the agent stops on its own, having held at most the
            # bound, and interrupts the task.
            await stopped.wait()
            session = host.get_session(sid)
            await session.wait_idle()
            records = await host.trace_store.log.read_after(sid, 0)
    assert (
        f"the client has left {bound} bytes of output unread; stopping" in capsys.readouterr().err
    )
    # The task ended once (interrupted, unless it was faster than the pump), and the
    # trace holds what it wrote.
    ends = [r for r in records if r.type == "task_end"]
    assert len(ends) == 1 and ends[0].status in {"aborted", "completed"}
    written = [r.block.text for r in records if r.type == "model_msg"]
    assert written == PIECES[: len(written)]
