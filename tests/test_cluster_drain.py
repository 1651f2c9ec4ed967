"""A cluster host drains on SIGTERM and hands its sessions over (R-DRAIN-1, R-DRAIN-2):
``greenroom serve --nats`` hosts as subprocesses on a real nats-server. The host running a
task whose side-effecting call is in flight gets SIGTERM; the call finishes, the task stops
at its turn boundary, and the host hands the session to the other host at once (not after
its lease expires) and exits. The other host finishes the task: the call is not run again,
no host-lost note, one ``task_start`` and one ``task_end`` in the cluster's trace."""

from __future__ import annotations

import signal
from pathlib import Path

import trio
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.traces import TraceStream
from greenroom.protocols.outputs import Output, TaskEnd, ToolCallOutput, UserMsg
from tests.support.cluster_hosts import HostProcess, start_host
from tests.support.mock_model_server import open_mock_server
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    fresh_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_cluster_takeover import _stop
from tests.test_gateway import Client
from tests.test_serve_drain import Gate, _model

LEASE_TTL_S = 30.0
"""Longer than the test: the session moves only because it is handed over."""
BOUND_S = 90.0


def test_a_draining_cluster_host_hands_its_held_session_over(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(conn: Connection) -> tuple[list[Output], list[str], HostProcess]:
        gate = Gate(tmp_path / "gate.sock")
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(gate.serve)
            hosts: list[HostProcess] = []
            try:
                for host_id in ("a", "b"):
                    hosts.append(
                        await start_host(
                            nursery,
                            tmp_path,
                            host_id,
                            nats_url=nats_server.url,
                            model_url=model.base_url,
                            effects=gate.path,
                            lease_ttl_s=LEASE_TTL_S,
                        )
                    )
                headers = [(b"Authorization", f"Bearer {hosts[0].token}".encode())]
                async with open_websocket_url(hosts[0].url, extra_headers=headers) as ws:
                    client = Client(ws)
                    sid = (await client.result("session.create"))["session_id"]
                    await client.result("run", {"session_id": sid, "input": "pay"})
                await gate.started.wait()
                leases = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
                owner = await leases.holder(sid)
                draining = next(h for h in hosts if h.host_id == owner)
                other = next(h for h in hosts if h is not draining)
                draining.process.send_signal(signal.SIGTERM)
                await draining.wait_logged("draining")
                gate.opened.set()
                records: list[Output] = []
                stream = await TraceStream.open(conn)
                async with stream.follow(sid) as following:
                    async for record in following:
                        records.append(record)
                        if isinstance(record, TaskEnd):
                            break
                assert await draining.process.wait() == 0
                assert draining.logged(f"handed session {sid} to host {other.host_id}")
                assert other.logged(f"host {other.host_id} takes session {sid} over")
                model.assert_clean()
                return records, list(gate.notes), draining
            finally:
                for host in hosts:  # shown by pytest when the test fails
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    await _stop(hosts)
                nursery.cancel_scope.cancel()

    records, notes, _draining = run_connected(
        nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S
    )
    assert notes == ["pay"]  # ran once, finished on the draining host, never again
    ends = [r for r in records if isinstance(r, TaskEnd)]
    assert [e.status for e in ends] == ["completed"]
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.status == "ok"
    steering = [r for r in records if isinstance(r, UserMsg) and r.kind == "steering"]
    assert steering == []  # no host-lost note: the task was held, not lost
