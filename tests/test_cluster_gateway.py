"""Any host's gateway serves any session (R-CLUSTER-1): two ``greenroom serve --nats`` hosts
on a real nats-server; a client of host b works a session that runs on host a."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.router import OWNER_UNREACHABLE
from greenroom.actors.cluster.traces import TraceStream
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
BOUND_S = 90.0
TOKENS = "alice alice-token-0123456789\nmallory mallory-token-0123456789\n"



def _model(request: RecordedRequest) -> Reply:
    """Calls the side-effect tool (which runs until interrupted); titles otherwise."""
    body = request.body if isinstance(request.body, dict) else {}
    if not body.get("tools"):
        return Reply([Text("A title")])
    return Reply([ToolUse(id="call-1", name="side_effect", input={"note": "pay"})], "tool_use")


@asynccontextmanager
async def _client(host: HostProcess, token: str) -> AsyncIterator[Client]:
    headers = [(b"Authorization", f"Bearer {token}".encode())]
    async with open_websocket_url(host.url, extra_headers=headers) as ws:
        yield Client(ws)


async def _stop(hosts: list[HostProcess]) -> None:
    for host in hosts:
        if host.process.returncode is None:
            host.process.kill()
            host.process.send_signal(signal.SIGCONT)
        await host.process.wait()


def test_a_client_of_one_host_works_a_session_that_runs_on_another(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """Through host b: create (placed on a), subscribe, run, approve, interrupt; every
    traced seq arrives once, in order; another principal is refused by b; with a stopped,
    b's forwarded call fails with a clear error within the bound."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)

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
                            lease_ttl_s=LEASE_TTL_S, approve="ask", tokens_file=tokens,
                        )
                    )
                a, b = hosts
                async with _client(b, "alice-token-0123456789") as alice, _client(
                    b, "alice-token-0123456789"
                ) as late:
                    # b is as idle as a: the first session stays on b; b runs one now, a
                    # none, so the second is placed on a.
                    first = (await alice.result("session.create"))["session_id"]
                    sid = (await alice.result("session.create"))["session_id"]
                    leases = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
                    found["owners"] = [await leases.holder(first)]
                    found["subscribed"] = await alice.result(
                        "session.subscribe", {"session_id": sid}
                    )
                    await alice.result("run", {"session_id": sid, "input": "pay the invoice"})
                    outputs = await alice.outputs_until("approval_request")
                    call_id = outputs[-1]["call_id"]
                    # A second client joins mid-task: replay after seq 1, then live.
                    joined = await late.result(
                        "session.subscribe", {"session_id": sid, "after_seq": 1}
                    )
                    late_outputs = late.take_outputs()
                    found["approved"] = await alice.result(
                        "approve", {"session_id": sid, "call_id": call_id, "decision": "allow"}
                    )
                    await effects.started.wait()
                    found["interrupted"] = await alice.result("interrupt", {"session_id": sid})
                    outputs += await alice.outputs_until("task_end")
                    late_outputs += await late.outputs_until("task_end")
                    found["late"] = (joined, [o["seq"] for o in late_outputs])
                    found["outputs"] = outputs
                    found["resubscribed"] = await alice.result(
                        "session.subscribe", {"session_id": sid, "after_seq": 2}
                    )
                    found["replayed"] = [o["seq"] for o in alice.take_outputs()]
                    found["past_end"] = await alice.error(
                        "session.subscribe", {"session_id": sid, "after_seq": 10**6}
                    )
                    found["bad_approve"] = await alice.error(
                        "approve", {"session_id": sid, "call_id": "nope", "decision": "allow"}
                    )
                    found["owners"].append(await leases.holder(sid))
                    found["traced"] = [
                        r.seq for r in (await (await TraceStream.open(conn)).read(sid)).records
                    ]
                    # R-FORK-1, R-FORK-2 through b: the fork is made on a (the source's
                    # host), in the cluster's trace once answered; a rewind is seen live.
                    forked = await alice.result("session.fork", {"session_id": sid})
                    found["fork"] = forked
                    found["fork_traced"] = [
                        r.seq
                        for r in (await (await TraceStream.open(conn)).read(
                            forked["session_id"]
                        )).records
                    ]
                    found["fork_owner"] = await leases.holder(forked["session_id"])
                    found["rewound"] = await alice.result(
                        "session.rewind", {"session_id": sid, "to_seq": 1}
                    )
                    found["rewind_note"] = (await alice.outputs_until("rewind"))[-1]
                    async with _client(b, "mallory-token-0123456789") as mallory:
                        found["refused"] = [
                            await mallory.error(method, {"session_id": sid, **params})
                            for method, params in (
                                ("run", {"input": "hi"}),
                                ("session.subscribe", {}),
                                ("interrupt", {}),
                            )
                        ]
                    found["unknown"] = await alice.error(
                        "run", {"session_id": "20260101-000000-abcdef", "input": "hi"}
                    )
                    a.process.send_signal(signal.SIGSTOP)
                    began = trio.current_time()
                    found["stalled"] = await alice.error("interrupt", {"session_id": sid})
                    found["stalled_after_s"] = trio.current_time() - began
                found["notes"] = list(effects.notes)
                return found
            finally:
                for host in hosts:  # shown by pytest when the test fails
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    await _stop(hosts)
                nursery.cancel_scope.cancel()

    found = run_connected(nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S)
    assert found["owners"] == ["b", "a"]  # placed on the least loaded host
    assert found["subscribed"]["replayed"] == 0
    assert found["approved"] == {}
    assert found["interrupted"] == {"interrupted": True}
    outputs = found["outputs"]
    seqs = [o["seq"] for o in outputs]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert found["traced"][: len(seqs)] == seqs
    assert found["fork"]["seq"] == seqs[-1]
    assert found["fork_traced"] == seqs  # the copied prefix reached JetStream
    assert found["fork_owner"] == "a"
    assert found["rewind_note"]["to_seq"] == 1
    assert found["rewound"] == {"seq": found["rewind_note"]["seq"]}
    joined, late_seqs = found["late"]
    assert late_seqs == seqs[1:]  # no gap, no duplicate across replay and live
    assert joined["replayed"] == joined["last_seq"] - 1 > 0
    # A subscription after seq 2: the rest of the trace, once each, before the answer.
    assert found["replayed"] == seqs[2:]
    assert found["resubscribed"]["last_seq"] == seqs[-1]
    assert found["resubscribed"]["replayed"] == len(seqs) - 2
    # A resume point past the end is no point of the session's (R-PROTO-2).
    assert found["past_end"]["code"] == -32602
    assert found["past_end"]["message"].startswith(
        f"$.after_seq: 1000000 is past the session's last seq ({seqs[-1]})"
    )
    # The owner's error, unchanged.
    assert found["bad_approve"]["code"] == 409  # not pending (R-HITL-2)
    assert "call 'nope'" in found["bad_approve"]["message"]
    assert "waits for no answer" in found["bad_approve"]["message"]
    types = [o["type"] for o in outputs]
    assert "approval_decision" in types and "tool_call_output" in types, types
    assert outputs[-1]["status"] == "aborted", outputs[-1]
    assert found["notes"] == ["pay"]  # the approved call ran once, on a
    assert [e["code"] for e in found["refused"]] == [403, 403, 403]
    assert found["unknown"]["code"] == 404
    stalled = found["stalled"]
    assert stalled["code"] == OWNER_UNREACHABLE
    assert "no host answered for session" in stalled["message"], stalled
    assert found["stalled_after_s"] < LEASE_TTL_S + 2.0
