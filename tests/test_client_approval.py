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

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.gateway.hubs import Hubs
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import ToolCallBlock
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


async def test_a_request_the_broker_stopped_waiting_for_is_withdrawn_from_the_hub(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """R-APPROVE-4 through the real hub: after the timeout the broker withdraws its
    request, so a client answering late is told nothing is pending."""
    hubs = Hubs(approve="ask", on_task_end=None, limits=GatewayLimits())
    hubs.remote_watchers = lambda _session_id: True  # a client watches (from another host)
    async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
        await nursery.start(hubs.run)
        session = await host.create_session(
            provider=script(), tools=[lookup], workspace_dir=tmp_path, approval_timeout_s=5
        )
        hub = await hubs.adopt(session)
        assert session.client_approvals is hub.approvals
        started = trio.current_time()
        outputs = await collect(session.run("go"), bound_s=None)
        assert trio.current_time() - started >= 5
        assert len(of_type(outputs, ApprovalRequest)) == 1
        (decision,) = of_type(outputs, ApprovalDecision)
        assert (decision.decision, decision.by) == ("deny", "default")
        assert hub.pending == {}
        assert not await hub.answer("c1", "allow")
        nursery.cancel_scope.cancel()
    assert of_type(outputs, ToolCallOutput)[0].status == "denied"


async def test_an_answer_that_meets_a_broker_gone_before_its_withdrawal_is_refused(
    tmp_path: Path,
) -> None:
    """The answer reaches the hub after the broker stopped listening but before its
    withdrawal: the hub finds the reply closed and tells the client nothing is pending."""
    hubs = Hubs(approve="ask", on_task_end=None, limits=GatewayLimits())
    hubs.remote_watchers = lambda _session_id: True
    async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
        await nursery.start(hubs.run)
        session = await host.create_session(
            provider=script(), tools=[lookup], workspace_dir=tmp_path
        )
        hub = await hubs.adopt(session)
        assert hub.approvals is not None
        reply, answers = trio.open_memory_channel[ClientsAsked | ClientVerdict](2)
        call = ToolCallBlock(id="c9", name="lookup", arguments={"key": "a"})
        hub.approvals.send_nowait(AskClients(call=call, reply=reply))
        assert isinstance(await answers.receive(), ClientsAsked)
        answers.close()
        assert not await hub.answer("c9", "allow")
        nursery.cancel_scope.cancel()


async def test_a_late_answer_after_the_hub_ended_is_refused(tmp_path: Path) -> None:
    hubs = Hubs(approve="ask", on_task_end=None, limits=GatewayLimits())
    async with Host.open(tmp_path / "data") as host:
        async with trio.open_nursery() as nursery:
            await nursery.start(hubs.run)
            session = await host.create_session(
                provider=script(), tools=[lookup], workspace_dir=tmp_path
            )
            hub = await hubs.adopt(session)
            nursery.cancel_scope.cancel()
        assert not await hub.answer("c1", "allow")
        assert session.client_approvals is None  # the stopped gateway took its own back


def test_answer_approval_carries_its_reply_out_of_equality() -> None:
    one = AnswerApproval(call_id="c1", verdict="allow", reply=object())
    assert one == AnswerApproval(call_id="c1", verdict="allow", reply=object())


async def test_a_failing_hub_step_denies_by_timeout_and_the_hub_goes_on(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """R-SEC-1: a bug met while the hub handles one message (here the cluster's watcher
    check raises) costs that request only: the broker denies it at its timeout, and the
    hub keeps following the session (it sees the task end)."""
    hubs = Hubs(approve="ask", on_task_end=None, limits=GatewayLimits())

    def broken(_session_id: str) -> bool:
        raise RuntimeError("registry bug")

    hubs.remote_watchers = broken
    async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
        await nursery.start(hubs.run)
        session = await host.create_session(
            provider=script(), tools=[lookup], workspace_dir=tmp_path, approval_timeout_s=5
        )
        hub = await hubs.adopt(session)
        outputs = await collect(session.run("go"), bound_s=None)
        (decision,) = of_type(outputs, ApprovalDecision)
        assert (decision.decision, decision.by) == ("deny", "default")
        await trio.testing.wait_all_tasks_blocked()
        assert hub.finishing  # the hub drained the task's end after the failure
        nursery.cancel_scope.cancel()
