"""Approvals answered by clients (the websocket gateway's path): with no ``approve``
callback, the broker sends ``AskClients`` to the session's client approvals (an actor's
inbox); an ``approval_request`` output is emitted once the request is pending, and the
answer is recorded ``by: host`` (R-APPROVE-1); when no client answers, or none watches,
the call is denied by default (R-APPROVE-2); a broker that stops waiting withdraws the
request (R-APPROVE-4, R-ACTOR-1)."""

from __future__ import annotations

import math
from pathlib import Path

import trio
from conftest import collect, of_type

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.messages import (
    AnswerApproval,
    AskClients,
    AskWithdrawn,
    ClientApprovalMessage,
    ClientsAsked,
    ClientVerdict,
    Verdict,
)
from greenroom.protocols.outputs import ApprovalDecision, ApprovalRequest, ToolCallOutput
from greenroom.protocols.tools import tool


@tool(parallel=True)
async def lookup(key: str) -> str:
    """Look up a key."""
    return f"value of {key}"


def script() -> ScriptedProvider:
    return ScriptedProvider(
        [
            Reply(blocks=(text("Checking."), tool_call("c1", "lookup", key="a"))),
            Reply(blocks=(text("Done."),)),
        ]
    )


class Clients:
    """A stand-in for the gateway's hub: an actor serving the session's client approvals.
    ``watching`` False answers "nobody" at once; otherwise each request is pending and
    answered ``verdict``."""

    def __init__(self, *, watching: bool, verdict: Verdict | None) -> None:
        self.watching = watching
        self.verdict = verdict
        self.asked: list[str] = []
        self.messages: list[ClientApprovalMessage] = []
        # Unbounded: the broker sends with send_nowait and must never wait for this test.
        self.inbox, self._receive = trio.open_memory_channel[ClientApprovalMessage](math.inf)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for message in self._receive:
            self.messages.append(message)
            if isinstance(message, AskClients):
                if not self.watching:
                    message.reply.send_nowait(ClientVerdict(verdict=None))
                    continue
                self.asked.append(message.call.id)
                message.reply.send_nowait(ClientsAsked())
                message.reply.send_nowait(ClientVerdict(verdict=self.verdict))


async def run_with(tmp_path: Path, clients: Clients) -> list:
    async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
        await nursery.start(clients.run)
        session = await host.create_session(
            provider=script(), tools=[lookup], workspace_dir=tmp_path
        )
        session.set_client_approvals(clients.inbox)
        outputs = await collect(session.run("go"))
        nursery.cancel_scope.cancel()
    return outputs


async def test_client_answer_is_requested_then_recorded(tmp_path: Path) -> None:
    clients = Clients(watching=True, verdict="allow")
    outputs = await run_with(tmp_path, clients)
    assert clients.asked == ["c1"]
    (request,) = of_type(outputs, ApprovalRequest)
    (decision,) = of_type(outputs, ApprovalDecision)
    assert request.call_id == "c1" and request.arguments == {"key": "a"}
    assert request.seq is not None and decision.seq is not None and request.seq < decision.seq
    assert (decision.decision, decision.by) == ("allow", "host")
    assert of_type(outputs, ToolCallOutput)[0].status == "ok"
    # Answered: nothing is withdrawn.
    assert not [m for m in clients.messages if isinstance(m, AskWithdrawn)]


async def test_no_client_answer_denies_by_default(tmp_path: Path) -> None:
    clients = Clients(watching=True, verdict=None)
    outputs = await run_with(tmp_path, clients)
    assert len(of_type(outputs, ApprovalRequest)) == 1
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("deny", "default")
    assert of_type(outputs, ToolCallOutput)[0].status == "denied"


async def test_no_client_present_means_no_request_and_default_deny(tmp_path: Path) -> None:
    """CONTRACT: `approval_request` only where a client is asked. With nobody there to
    answer, the call is denied by default and no request is shown."""
    clients = Clients(watching=False, verdict="allow")
    outputs = await run_with(tmp_path, clients)
    assert clients.asked == [] and of_type(outputs, ApprovalRequest) == []
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("deny", "default")


async def test_approvals_whose_actor_has_gone_deny_by_default(tmp_path: Path) -> None:
    clients = Clients(watching=True, verdict="allow")
    clients._receive.close()  # the watcher ended before the task asked
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=script(), tools=[lookup], workspace_dir=tmp_path
        )
        session.set_client_approvals(clients.inbox)
        outputs = await collect(session.run("go"))
    assert of_type(outputs, ApprovalRequest) == []
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == ("deny", "default")


def test_answer_approval_carries_its_reply_out_of_equality() -> None:
    one = AnswerApproval(call_id="c1", verdict="allow", reply=object())
    assert one == AnswerApproval(call_id="c1", verdict="allow", reply=object())
