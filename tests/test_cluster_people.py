"""A pending approval survives a cluster takeover (R-HITL-1, R-CLUSTER-2): ``greenroom serve
--nats --approve ask`` hosts as subprocesses on a real nats-server; the owner of a session
is SIGKILLed while a client is asked about a side-effecting call; the other host takes the
session over and the request stays pending (never denied for the loss); the client's
``approve`` through the new owner's gateway reaches it and the tool runs exactly once."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import trio
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.traces import TraceStream
from greenroom.protocols.outputs import ApprovalDecision, ApprovalRequest, TaskEnd, ToolCallOutput
from tests.support.cluster_hosts import HostProcess, start_host
from tests.support.mock_model_server import RecordedRequest, Reply, Text, ToolUse, open_mock_server
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    fresh_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_cluster_takeover import Effects
from tests.test_gateway import Client

LEASE_TTL_S = 3.0
BOUND_S = 60.0


def _model(request: RecordedRequest) -> Reply:
    """Asks for the side-effecting call once; answers once its result is in."""
    body = request.body if isinstance(request.body, dict) else {}
    if not body.get("tools"):
        return Reply([Text("A title")])
    if "tool_result" in str(request.messages):
        return Reply([Text("paid")])
    return Reply(
        [ToolUse(id="call-1", name="side_effect_once", input={"note": "pay"})], "tool_use"
    )


def _headers(host: HostProcess) -> list[tuple[bytes, bytes]]:
    return [(b"Authorization", f"Bearer {host.token}".encode())]


async def _until(client: Client, outputs: list[dict[str, Any]], type_: str) -> dict[str, Any]:
    """The first output of ``type_`` among ``outputs`` and those that follow (kept)."""
    while True:
        for output in outputs:
            if output["type"] == type_:
                return output
        outputs.append(await client.output())


def test_a_pending_approval_is_answered_on_the_host_that_took_the_session_over(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(conn: Connection) -> dict[str, Any]:
        effects = Effects(tmp_path / "effects.sock")
        found: dict[str, Any] = {}
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(effects.serve)
            hosts: list[HostProcess] = []
            try:
                for host_id in ("a", "b"):
                    hosts.append(
                        await start_host(
                            nursery, tmp_path, host_id, nats_url=nats_server.url,
                            model_url=model.base_url, effects=effects.path,
                            lease_ttl_s=LEASE_TTL_S, approve="ask",
                        )
                    )
                async with open_websocket_url(hosts[0].url, extra_headers=_headers(hosts[0])) as ws:
                    client = Client(ws)
                    sid = (await client.result("session.create"))["session_id"]
                    await client.result("session.subscribe", {"session_id": sid})
                    await client.result("run", {"session_id": sid, "input": "pay the invoice"})
                    # The owner asks this client (it watches) and waits for its answer.
                    asked = await _until(client, client.take_outputs(), "approval_request")
                    assert asked["call_id"] == "call-1"
                    leases = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
                    owner = await leases.holder(sid)
                    lost = next(h for h in hosts if h.host_id == owner)
                    other = next(h for h in hosts if h is not lost)
                    lost.process.send_signal(signal.SIGKILL)
                    await lost.process.wait()
                found["notes_at_kill"] = list(effects.notes)

                async with open_websocket_url(other.url, extra_headers=_headers(other)) as ws:
                    client = Client(ws)
                    # Logged once the session is rebuilt and its principals may see it.
                    await other.wait_logged(f"host {other.host_id} serves session {sid} now")
                    await client.result("session.subscribe", {"session_id": sid})
                    outputs = client.take_outputs()
                    # Asked again: the request is still pending in the trace it replays,
                    # and nothing decided it meanwhile.
                    again = await _until(client, outputs, "approval_request")
                    assert again["call_id"] == "call-1"
                    assert not any(o["type"] == "approval_decision" for o in outputs)
                    found["approved"] = await client.result(
                        "approve", {"session_id": sid, "call_id": "call-1", "decision": "allow"}
                    )
                    found["end"] = await _until(client, outputs, "task_end")
                    found["stale"] = await client.error(
                        "approve", {"session_id": sid, "call_id": "call-1", "decision": "allow"}
                    )
                found["trace"] = (await (await TraceStream.open(conn)).read(sid)).records
                found["taker"] = other
                model.assert_clean()
                found["notes"] = list(effects.notes)
                return found
            finally:
                for host in hosts:  # shown by pytest when the test fails
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    for host in hosts:
                        if host.process.returncode is None:
                            host.process.kill()
                        await host.process.wait()
                nursery.cancel_scope.cancel()

    found = run_connected(nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S)
    taker: HostProcess = found["taker"]
    assert taker.logged(f"host {taker.host_id} takes session")
    assert found["notes_at_kill"] == []  # asked, not run, when its host died
    assert found["approved"] == {}
    assert found["end"]["status"] == "completed"
    assert found["stale"]["code"] == 409  # answered once: a second answer is refused
    assert found["notes"] == ["pay"]  # run exactly once, on the new owner

    records = found["trace"]
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    (request,) = [r for r in records if isinstance(r, ApprovalRequest)]
    (decision,) = [r for r in records if isinstance(r, ApprovalDecision)]
    assert (request.call_id, decision.call_id, decision.decision) == ("call-1", "call-1", "allow")
    assert (decision.by, decision.principal) == ("client", "default")
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert (result.call_id, result.status) == ("call-1", "ok")
    ends = [r for r in records if isinstance(r, TaskEnd)]
    assert [e.status for e in ends] == ["completed"]
