"""``_greenroom/steer`` keeps the promise of the gateway's ``steer`` (R-STEER-1, R-STEER-6,
R-ACP-1): ``{queued: true}`` only once the steering's record survives the host, for the
session and for a running node of its tree; ``durable: false`` when the disk has not
confirmed it in time; an error when it was dropped unrun, or nobody knows whether its
record survived. The ACP agent in-process, with a scripted model and a client whose
frames are checked against the ACP SDK's schema; every order is forced with events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from greenroom.actors.apps.acp import AcpConfig
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.receipts import ACCEPT_WAIT_S, InputReceipt
from greenroom.actors.runtime.session import Session
from greenroom.actors.runtime.subagents import SUBAGENT_SYSTEM, spawn_subagent
from greenroom.actors.scripted import ScriptedProvider, ScriptedStream
from greenroom.protocols import jsonrpc
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from tests.support.disks import FaultyDisk
from tests.test_acp_agent import TIMEOUT_S, Client, agent_on

REASON = "the test's outage"


@dataclass
class Steerable:
    """A session of the ACP agent whose steered node holds in its model request until
    ``release``: the session itself (``node`` None) or a background subagent of it."""

    host: Host
    client: Client
    sid: str
    node: Session
    release: trio.Event

    def params(self, words: str) -> dict[str, Any]:
        """The params of ``_greenroom/steer`` for the node."""
        params = {"sessionId": self.sid, "text": words}
        if self.node.id != self.sid:
            params["nodeId"] = self.node.id
        return params


@asynccontextmanager
async def steerable(
    tmp_path: Path, target: str, disk: FaultyDisk | None = None
) -> AsyncIterator[Steerable]:
    """A session of an agent on a host of ``tmp_path / "data"`` (its traces written
    through ``disk``) whose ``target`` — ``root``, or a background ``node`` it spawned —
    holds in its model request: the session answers its prompt by spawning the child,
    which is then held. Released on leaving, when the test has not released it."""
    holding, release = trio.Event(), trio.Event()

    async def model(request: ModelRequest, stream: ScriptedStream) -> None:
        users = [m for m in request.messages if isinstance(m, UserMessage)]
        child = (request.system or "").startswith(SUBAGENT_SYSTEM)
        if child or target == "root":
            if not release.is_set():
                holding.set()
                await release.wait()
            await stream.text("Done.")
        elif any(isinstance(p, ToolResult) for p in users[-1].content):
            await stream.text("Started the scout.")
        elif any(isinstance(p, TextBlock) and "finished]" in p.text for p in users[-1].content):
            await stream.text("Merged.")
        else:
            arguments = {"task": "scout the notes", "background": True, "name": "scout"}
            block = ToolCallBlock(id="p1", name="spawn_subagent", arguments=arguments)
            await stream.tool_call(block)

    config = AcpConfig(provider=ScriptedProvider(model), tools=(spawn_subagent,), approve="all")
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(tmp_path / "data", config, disk) as (host, client):
            created = await client.call("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            sid = created["result"]["sessionId"]
            prompt = [{"type": "text", "text": "research"}]
            prompted = await client.send("session/prompt", {"sessionId": sid, "prompt": prompt})
            if target == "node":
                answer = await client.answer_of(prompted)
                assert answer["result"]["stopReason"] == "end_turn", answer
            await holding.wait()
            tree = [s for s in host.sessions if s.root_id == sid]
            node = next(s for s in tree if (s.id == sid) == (target == "root"))
            yield Steerable(host, client, sid, node, release)
            release.set()
            if target == "root":
                await client.answer_of(prompted)


@pytest.mark.parametrize("target", ["root", "node"])
async def test_steering_not_known_durable_in_time_is_answered_so(
    tmp_path: Path, mock_clock: trio.testing.MockClock, target: str
) -> None:
    """R-STEER-6, R-ACP-1: the fsync that covers the steering's record is held; the answer
    waits ACCEPT_WAIT_S for it, as the gateway's ``steer``, and then says
    ``durable: false``. Before, ``_greenroom/steer`` answered ``{queued: true}`` at once,
    while the record could still be lost with the host. The clock stands still until
    the fsync is held, then jumps whenever the run loop is idle; then it stands again.
    Once fsyncs go through, steering is answered the plain ``{queued: true}``."""
    disk = FaultyDisk()
    async with steerable(tmp_path, target, disk) as steered:
        disk.stall(steered.node.trace_path)
        sent = await steered.client.send("_greenroom/steer", steered.params("mind the gap"))
        await trio.to_thread.run_sync(disk.stalled.wait, TIMEOUT_S)
        await trio.testing.wait_all_tasks_blocked()
        asked = trio.current_time()
        mock_clock.autojump_threshold = 0
        held = await steered.client.answer_of(sent)
        mock_clock.autojump_threshold = float("inf")
        waited = trio.current_time() - asked
        disk.release()
        durable = await steered.client.call("_greenroom/steer", steered.params("and this"))
    assert held.get("result") == {"queued": True, "durable": False}, held
    assert waited == ACCEPT_WAIT_S
    assert durable.get("result") == {"queued": True}, durable


@pytest.mark.parametrize("target", ["root", "node"])
@pytest.mark.parametrize("outcome", ["dropped", "in_doubt"])
async def test_steering_dropped_or_in_doubt_is_answered_with_an_error_not_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, outcome: str
) -> None:
    """R-STEER-6, R-STEER-1, R-ACP-1, R-CLUSTER-2: the steering's receipt settles as
    dropped (its record never reached the trace a host taking the session up reads) or in
    doubt (nobody knows whether it did). Before, ``_greenroom/steer`` had answered
    ``{queued: true}`` already; now it answers as the gateway's ``steer`` does: 410, the
    input dropped, which the editor may send again; or 503 with ``data.outcome``
    ``unknown``, saying it may have been queued and sending it again may run it twice."""
    settled = trio.Event()

    def settle(self: OutputEmitter, receipt: InputReceipt) -> None:
        if outcome == "dropped":
            receipt.drop(REASON)
        else:
            receipt.doubt(REASON)
        settled.set()

    async with steerable(tmp_path, target) as steered:
        monkeypatch.setattr(OutputEmitter, "set_when_durable", settle)
        answer = await steered.client.call("_greenroom/steer", steered.params("mind the gap"))
    assert "error" in answer, answer
    assert settled.is_set()
    error = answer["error"]
    if outcome == "dropped":
        assert (error["code"], error.get("data")) == (jsonrpc.GONE, None)
        assert error["message"] == f"the input was dropped, not queued: {REASON}"
    else:
        assert (error["code"], error.get("data")) == (jsonrpc.UNAVAILABLE, {"outcome": "unknown"})
        assert error["message"].startswith(f"the input may have been queued: {REASON}")
        assert "sending it again may run it twice" in error["message"]


@pytest.mark.parametrize("target", ["root", "node"])
async def test_steering_sent_while_an_earlier_one_waits_for_its_record_is_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """R-STEER-1, R-ACP-1: steering waits for its record's fsync before it is answered,
    but not in its session's line: steering the editor sends meanwhile reaches the task
    at once, not only once the earlier steering is answered. Both are answered
    ``{queued: true}`` once the fsync goes through."""
    handed: list[str] = []
    steer = Session.steer

    def noted(self: Session, content: Any, *args: Any, **kwargs: Any) -> bool:
        handed.append("".join(getattr(part, "text", "") for part in content))
        return steer(self, content, *args, **kwargs)

    disk = FaultyDisk()
    async with steerable(tmp_path, target, disk) as steered:
        monkeypatch.setattr(Session, "steer", noted)
        disk.stall(steered.node.trace_path)
        first = await steered.client.send("_greenroom/steer", steered.params("first"))
        await trio.to_thread.run_sync(disk.stalled.wait, TIMEOUT_S)
        second = await steered.client.send("_greenroom/steer", steered.params("second"))
        await trio.testing.wait_all_tasks_blocked()
        assert handed == ["first", "second"]
        disk.release()
        answers = [await steered.client.answer_of(sent) for sent in (first, second)]
    assert [answer.get("result") for answer in answers] == [{"queued": True}] * 2, answers
