"""Takeover end to end: ``greenroom serve --nats`` hosts as subprocesses on a real
nats-server; a host is lost while its session's tool call is in flight, another host
finishes the session (R-CLUSTER-1..2) — and resolves the call in doubt by the tool's check
(R-EFFECT-2)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import trio
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.traces import TraceStream
from greenroom.protocols.markers import HOST_LOST_TEXT as HOST_LOST
from greenroom.protocols.markers import IN_DOUBT_FOUND_TEXT
from greenroom.protocols.outputs import (
    CallInDoubt,
    CallResolved,
    Output,
    TaskEnd,
    ToolCallOutput,
)
from tests.support.cluster_hosts import HostProcess, start_host
from tests.support.mock_model_server import RecordedRequest, Reply, Text, ToolUse, open_mock_server
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    fresh_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_gateway import Client

LEASE_TTL_S = 3.0
BOUND_S = 60.0



def _model(request: RecordedRequest) -> Reply:
    """Calls the side-effect tool once per task; answers once a tool result is in."""
    body = request.body if isinstance(request.body, dict) else {}
    if not body.get("tools"):
        return Reply([Text("A title")])
    text = str(request.messages)
    if "tool_result" in text:
        return Reply([Text("done")])
    return Reply([ToolUse(id="call-1", name="side_effect", input={"note": "pay"})], "tool_use")


class Effects:
    """Counts the starts of the side-effect tool (one unix-socket connection each)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.notes: list[str] = []
        self.started = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        listener = trio.SocketListener(await _unix_listener(self.path))
        task_status.started()
        async with listener:
            while True:
                stream = await listener.accept()
                data = await stream.receive_some()
                self.notes.append(data.decode().strip())
                self.started.set()


async def _unix_listener(path: Path) -> trio.socket.SocketType:
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    sock.listen()
    return sock


async def _start_task(host: HostProcess) -> str:
    headers = [(b"Authorization", f"Bearer {host.token}".encode())]
    async with open_websocket_url(host.url, extra_headers=headers) as ws:
        client = Client(ws)
        sid: str = (await client.result("session.create"))["session_id"]
        await client.result("run", {"session_id": sid, "input": "pay the invoice"})
    return sid


def _is_side_effect_call(output: dict[str, Any]) -> bool:
    block = output.get("block") or {}
    return output["type"] == "model_msg" and block.get("name") == "side_effect"


async def _records_until_task_end(conn: Connection, sid: str) -> list[Output]:
    stream = await TraceStream.open(conn)
    records: list[Output] = []
    async with stream.follow(sid) as following:
        async for record in following:
            records.append(record)
            if isinstance(record, TaskEnd):
                break
    return records


def _check_trace(records: list[Output]) -> None:
    seqs = [r.seq for r in records]
    assert seqs == list(range(1, len(records) + 1)), seqs
    ends = [r for r in records if isinstance(r, TaskEnd)]
    assert len(ends) == 1 and ends[0].status == "completed", ends
    results = [r for r in records if isinstance(r, ToolCallOutput)]
    assert (results[0].call_id, results[0].status) == ("call-1", "interrupted")
    assert any(HOST_LOST in getattr(b, "text", "") for b in results[0].content)


async def _stop(hosts: list[HostProcess]) -> None:
    for host in hosts:
        if host.process.returncode is None:
            host.process.kill()
        await host.process.wait()


def _run_scenario(
    tmp_path: Path, nats_server: NatsProcess, lose: str
) -> tuple[list[Output], list[str], HostProcess, HostProcess]:
    async def body(conn: Connection) -> tuple[list[Output], list[str], HostProcess, HostProcess]:
        effects = Effects(tmp_path / "effects.sock")
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(effects.serve)
            hosts: list[HostProcess] = []
            try:
                for host_id in ("a", "b"):
                    hosts.append(
                        await start_host(
                            nursery, tmp_path, host_id, nats_url=nats_server.url,
                            model_url=model.base_url, effects=effects.path,
                            lease_ttl_s=LEASE_TTL_S,
                        )
                    )
                sid = await _start_task(hosts[0])
                await effects.started.wait()
                leases = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
                owner = await leases.holder(sid)
                lost = next(h for h in hosts if h.host_id == owner)
                other = next(h for h in hosts if h is not lost)
                if lose == "kill":
                    lost.process.send_signal(signal.SIGKILL)
                    records = await _records_until_task_end(conn, sid)
                else:
                    lost.process.send_signal(signal.SIGSTOP)
                    records = await _records_until_task_end(conn, sid)
                    lost.process.send_signal(signal.SIGCONT)
                    # The woken host finds its lease gone (or its append refused) and gives
                    # the session up.
                    await lost.wait_logged("lost the lease", "was fenced")
                    after = await (await TraceStream.open(conn)).read(sid)
                    assert len(after.records) == len(records), "the woken host wrote"
                model.assert_clean()
                return records, list(effects.notes), lost, other
            finally:
                for host in hosts:  # shown by pytest when the test fails
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    await _stop(hosts)
                nursery.cancel_scope.cancel()

    return run_connected(nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S)


def test_a_killed_hosts_session_finishes_on_another_host(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    records, notes, _lost, other = _run_scenario(tmp_path, nats_server, "kill")
    _check_trace(records)
    assert notes == ["pay"]  # the side effect was not repeated
    assert other.logged(f"host {other.host_id} takes session")


def test_a_stopped_host_is_fenced_when_it_wakes(tmp_path: Path, nats_server: NatsProcess) -> None:
    records, notes, _lost, other = _run_scenario(tmp_path, nats_server, "stop")
    _check_trace(records)
    assert notes == ["pay"]
    assert other.logged(f"host {other.host_id} takes session")




def _keyed_model(request: RecordedRequest) -> Reply:
    """Calls the keyed effect once per task; answers once a tool result is in."""
    body = request.body if isinstance(request.body, dict) else {}
    if not body.get("tools"):
        return Reply([Text("A title")])
    if "tool_result" in str(request.messages):
        return Reply([Text("done")])
    return Reply([ToolUse(id="call-1", name="keyed_effect", input={"note": "pay"})], "tool_use")


class KeyedEffects:
    """The effects of ``keyed_effect`` by their key, and the keys its check asked about
    (``? KEY`` on the same socket, answered with the effect's note or ``none``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.made: dict[str, str] = {}
        self.asked: list[str] = []
        self.started = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        listener = trio.SocketListener(await _unix_listener(self.path))
        task_status.started()
        async with listener, trio.open_nursery() as nursery:
            while True:
                nursery.start_soon(self._one, await listener.accept())

    async def _one(self, stream: trio.SocketStream) -> None:
        line = (await stream.receive_some()).decode().strip()
        if line.startswith("? "):
            key = line[2:]
            self.asked.append(key)
            await stream.send_all(f"{self.made.get(key, 'none')}\n".encode())
            await stream.aclose()
            return
        note, key = line.split()
        self.made[key] = note
        self.started.set()


def test_a_killed_hosts_call_is_found_done_by_its_check_on_another_host(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """R-EFFECT-1, R-EFFECT-2, R-CLUSTER-2: the host running a keyed effect is SIGKILLed;
    the host that takes the session over finds the call in doubt and asks the tool's check
    by the key the lost host ran it with: the effect is found, recorded as the call's
    result, and made only once; the task ends on the new host."""

    async def body(conn: Connection) -> tuple[list[Output], dict[str, str], list[str]]:
        effects = KeyedEffects(tmp_path / "effects.sock")
        async with open_mock_server(fallback=_keyed_model) as model, trio.open_nursery() as nursery:
            await nursery.start(effects.serve)
            hosts: list[HostProcess] = []
            try:
                for host_id in ("a", "b"):
                    hosts.append(
                        await start_host(
                            nursery, tmp_path, host_id, nats_url=nats_server.url,
                            model_url=model.base_url, effects=effects.path,
                            lease_ttl_s=LEASE_TTL_S,
                        )
                    )
                sid = await _start_task(hosts[0])
                await effects.started.wait()
                owner = await (await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)).holder(sid)
                next(h for h in hosts if h.host_id == owner).process.send_signal(signal.SIGKILL)
                records = await _records_until_task_end(conn, sid)
                model.assert_clean()
                return records, dict(effects.made), list(effects.asked)
            finally:
                for host in hosts:  # shown by pytest when the test fails
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    await _stop(hosts)
                nursery.cancel_scope.cancel()

    records, made, asked = run_connected(
        nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S
    )
    ((key, note),) = made.items()  # made once
    assert note == "pay" and asked == [key]
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    (doubt,) = [r for r in records if isinstance(r, CallInDoubt)]
    assert (doubt.call_id, doubt.idempotency_key) == ("call-1", key)
    (resolved,) = [r for r in records if isinstance(r, CallResolved)]
    assert (resolved.by, resolved.outcome) == ("check", "done")
    (result,) = [r for r in records if isinstance(r, ToolCallOutput)]
    assert result.status == "ok"
    assert [getattr(b, "text", "") for b in result.content] == [IN_DOUBT_FOUND_TEXT, "found: pay"]
    (end,) = [r for r in records if isinstance(r, TaskEnd)]
    assert end.status == "completed"


def test_a_client_whose_host_died_resubscribes_on_another_without_gap(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """The client follows the session on host a, a dies, the client subscribes on host b
    with the last seq it saw: every traced seq once, none missing."""

    async def body(conn: Connection) -> tuple[list[int], list[str], int]:
        effects = Effects(tmp_path / "effects.sock")
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(effects.serve)
            hosts: list[HostProcess] = []
            try:
                for host_id in ("a", "b"):
                    hosts.append(
                        await start_host(
                            nursery, tmp_path, host_id, nats_url=nats_server.url,
                            model_url=model.base_url, effects=effects.path,
                            lease_ttl_s=LEASE_TTL_S,
                        )
                    )
                first, second = hosts
                seen: list[int] = []
                async with open_websocket_url(
                    first.url, extra_headers=[(b"Authorization", f"Bearer {first.token}".encode())]
                ) as ws:
                    client = Client(ws)
                    sid = (await client.result("session.create"))["session_id"]
                    await client.result("session.subscribe", {"session_id": sid})
                    await client.result("run", {"session_id": sid, "input": "pay the invoice"})
                    outputs = client.take_outputs()
                    # The tool starts once its call is traced, which does not wait for this
                    # client to receive it: the kill comes once both have happened.
                    while not any(_is_side_effect_call(o) for o in outputs):
                        outputs.append(await client.output())
                    seen += [o["seq"] for o in outputs if o.get("seq")]
                    await effects.started.wait()
                    first.process.send_signal(signal.SIGKILL)
                    await first.process.wait()
                before = len(seen)
                async with open_websocket_url(
                    second.url,
                    extra_headers=[(b"Authorization", f"Bearer {second.token}".encode())],
                ) as ws:
                    client = Client(ws)
                    params = {"session_id": sid, "after_seq": seen[-1]}
                    # Until host b has taken the session over, it does not know it.
                    for _ in range(int(BOUND_S / 0.2)):
                        response = await client.call("session.subscribe", params)
                        if "result" in response:
                            break
                        await trio.sleep(0.2)
                    outputs = client.take_outputs()
                    while not any(o["type"] == "task_end" for o in outputs):
                        outputs.append(await client.output())
                    seen += [o["seq"] for o in outputs if o.get("seq")]
                model.assert_clean()
                return seen, list(effects.notes), before
            finally:
                for host in hosts:
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    await _stop(hosts)
                nursery.cancel_scope.cancel()

    seen, notes, before = run_connected(
        nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S
    )
    assert before > 0
    assert seen == list(range(1, len(seen) + 1)), seen
    assert notes == ["pay"]
