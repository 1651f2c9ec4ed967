"""Input the editor sent whose record may or may not have survived the host (its receipt
settled in doubt, as when a cluster host gives the session up while the record is on its
way to JetStream) is answered with an error saying so, never as a turn that was cancelled
(R-STEER-1, R-STEER-6, R-CLUSTER-2, R-ACP-2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from greenroom.actors.apps.acp import AcpConfig
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.receipts import InputReceipt
from greenroom.actors.scripted import Reply, ScriptedProvider, ScriptedStream, text
from greenroom.protocols import jsonrpc
from greenroom.protocols.context import ModelRequest
from tests.test_acp_agent import TIMEOUT_S, agent_on

DOUBT = "its record may or may not have reached the cluster's trace (the test's outage)"


def receipts_doubted(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """Every receipt the session settles is settled in doubt, as a cluster host's that
    gave the session up while the input's record was unacknowledged; set once one is."""
    settled = trio.Event()

    def doubted(self: OutputEmitter, receipt: InputReceipt) -> None:
        receipt.doubt(DOUBT)
        settled.set()

    monkeypatch.setattr(OutputEmitter, "set_when_durable", doubted)
    return settled


@pytest.mark.parametrize("method", ["_greenroom/follow_up", "session/prompt"])
async def test_input_in_doubt_is_answered_with_an_error_that_says_it_may_have_been_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """R-STEER-6, R-STEER-1, R-CLUSTER-2, R-ACP-2: a follow-up, or a prompt that steers the
    running task, is accepted while a task runs, and its receipt is settled in doubt; the
    session then stops here (closed, as a host that gave it up stops it). Before, the
    editor was answered ``stopReason: cancelled``, as for input that never ran, and would
    send it again though the host taking the session up may run it; now the answer is an
    error whose ``data.outcome`` is ``unknown``, saying it may have been queued and to
    check the session before sending it again."""
    started, release = trio.Event(), trio.Event()

    async def held(request: ModelRequest, stream: ScriptedStream) -> None:
        started.set()
        await release.wait()
        await stream.text("Hello.")

    doubted = receipts_doubted(monkeypatch)
    provider = ScriptedProvider([held, Reply(blocks=(text("Then this."),))])
    config = AcpConfig(provider=provider, tools=())
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(tmp_path / "data", config) as (host, client):
            created = await client.call("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            sid = created["result"]["sessionId"]
            hello = [{"type": "text", "text": "hello"}]
            prompted = await client.send("session/prompt", {"sessionId": sid, "prompt": hello})
            await started.wait()
            more = [{"type": "text", "text": "and then?"}]
            sent = await client.send(method, {"sessionId": sid, "prompt": more})
            await doubted.wait()
            await host.close_session(sid)
            answer: dict[str, Any] = await client.answer_of(sent)
            await client.answer_of(prompted)
    assert "error" in answer, answer
    error = answer["error"]
    assert (error["code"], error.get("data")) == (jsonrpc.UNAVAILABLE, {"outcome": "unknown"})
    assert error["message"].startswith(f"the input may have been queued: {DOUBT}")
    assert "sending it again may" in error["message"]
