"""Chaos, bounded: three ``serve --nats`` hosts with a session each, mid-tool; SIGKILL one
host, then SIGSTOP another past its lease and SIGCONT it. Each lost session reaches exactly
one ``task_end`` on another host, its trace reads seq 1..n without gap or duplicate, no tool
call starts twice, and the woken host gives its sessions up without writing (R-CLUSTER-1..2).
Repeated ``ROUNDS`` times with random victims and kill moments."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import trio

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.traces import TraceStream
from greenroom.protocols.outputs import Output, TaskEnd
from tests.support.cluster_hosts import HostProcess, start_host
from tests.support.mock_model_server import open_mock_server
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    fresh_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_cluster_takeover import (
    LEASE_TTL_S,
    Effects,
    _check_trace,
    _model,
    _records_until_task_end,
    _start_task,
    _stop,
)

ROUNDS = 2
BOUND_S = 150.0



@pytest.mark.parametrize("round_number", range(ROUNDS))
def test_kill_one_host_then_stall_another(
    tmp_path: Path, nats_server: NatsProcess, round_number: int
) -> None:
    chance = random.Random(round_number)

    async def body(conn: Connection) -> None:
        effects = Effects(tmp_path / "effects.sock")
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(effects.serve)
            hosts: list[HostProcess] = []
            try:
                for host_id in ("a", "b", "c"):
                    hosts.append(
                        await start_host(
                            nursery, tmp_path, host_id, nats_url=nats_server.url,
                            model_url=model.base_url, effects=effects.path,
                            lease_ttl_s=LEASE_TTL_S,
                        )
                    )
                sessions = {host.host_id: await _start_task(host) for host in hosts}
                while len(effects.notes) < len(hosts):
                    effects.started = trio.Event()
                    await effects.started.wait()
                leases = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
                for host_id, sid in sessions.items():
                    assert await leases.holder(sid) == host_id
                killed, stalled = chance.sample(hosts, 2)
                await trio.sleep(chance.uniform(0.0, LEASE_TTL_S / 2))
                killed.process.send_signal(signal.SIGKILL)
                first = await _records_until_task_end(conn, sessions[killed.host_id])
                stalled.process.send_signal(signal.SIGSTOP)
                second = await _records_until_task_end(conn, sessions[stalled.host_id])
                stalled.process.send_signal(signal.SIGCONT)
                await stalled.wait_logged("lost the lease", "was fenced")
                # The lost sessions' traces, read again after the woken host gave up.
                stream = await TraceStream.open(conn)
                for sid, seen in (
                    (sessions[killed.host_id], first),
                    (sessions[stalled.host_id], second),
                ):
                    again: list[Output] = list((await stream.read(sid)).records)
                    assert again == seen
                    _check_trace(again)
                    assert sum(isinstance(r, TaskEnd) for r in again) == 1
                    owner = await leases.holder(sid)
                    assert owner not in (killed.host_id, stalled.host_id), owner
                # One start per session: nothing ran again after a takeover.
                assert effects.notes == ["pay"] * len(hosts)
                model.assert_clean()
            finally:
                for host in hosts:  # shown by pytest when the test fails
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    for host in hosts:
                        if host.process.returncode is None:
                            host.process.send_signal(signal.SIGCONT)
                    await _stop(hosts)
                nursery.cancel_scope.cancel()

    run_connected(nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S)
