"""A tree across a cluster (R-TREE-4): ``greenroom serve --nats`` hosts as subprocesses on a
real nats-server. A root spawns a background subagent; the host running both is killed
while the subagent's side-effecting call is in flight. Another host takes both over: the
subagent's trace and the root's are in JetStream, the call is not run again, the subagent
answers, and its answer reaches the root as input, which the root answers."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import trio
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.traces import TraceStream
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.markers import HOST_LOST_TEXT as HOST_LOST
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd, ToolCallOutput, UserMsg
from tests.support.cluster_hosts import HostProcess, start_host
from tests.support.mock_model_server import RecordedRequest, Reply, Text, ToolUse, open_mock_server
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    fresh_nats_server,  # noqa: F401
    run_connected,
)
from tests.test_cluster_takeover import Effects, _stop
from tests.test_gateway import Client

LEASE_TTL_S = 3.0
BOUND_S = 90.0
FINISHED = "[subagent payer finished]"


def _model(request: RecordedRequest) -> Reply:
    """The root spawns the payer in the background; the payer calls the side-effect tool
    and answers once its result is in; the root merges the payer's answer."""
    body = request.body if isinstance(request.body, dict) else {}
    if not body.get("tools"):
        return Reply([Text("A title")])
    text = str(request.messages)
    if "You are a subagent" in str(body.get("system")):
        if "tool_result" in text:
            return Reply([Text("paid, as far as I know")])
        return Reply([ToolUse(id="pay-1", name="side_effect", input={"note": "pay"})], "tool_use")
    if FINISHED in str(request.messages[-1]):
        return Reply([Text("merged: the payer is done")])
    if "tool_result" in text:
        return Reply([Text("the payer works on it")])
    spawn = {"task": "pay the invoice", "background": True, "name": "payer"}
    return Reply([ToolUse(id="spawn-1", name="spawn_subagent", input=spawn)], "tool_use")


async def _start_root(host: HostProcess) -> str:
    headers = [(b"Authorization", f"Bearer {host.token}".encode())]
    async with open_websocket_url(host.url, extra_headers=headers) as ws:
        client = Client(ws)
        sid: str = (await client.result("session.create"))["session_id"]
        await client.result("run", {"session_id": sid, "input": "pay through a subagent"})
    return sid


async def _records_until(
    stream: TraceStream, sid: str, done: type[Output] | None, seen: list[Output], test: object
) -> None:
    """Follow ``sid``'s trace in JetStream into ``seen`` until ``test(record)`` holds."""
    async with stream.follow(sid) as following:
        async for record in following:
            seen.append(record)
            if callable(test) and test(record):
                return


def _child_of(records: list[Output]) -> str:
    (spawned,) = [r for r in records if isinstance(r, ToolCallOutput)]
    child_id: str = json.loads(spawned.content[0].text)["session_id"]  # type: ignore[union-attr]
    return child_id


def test_a_background_child_survives_the_loss_of_its_host(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    async def body(conn: Connection) -> tuple[list[Output], list[Output], list[str]]:
        effects = Effects(tmp_path / "effects.sock")
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(effects.serve)
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
                            effects=effects.path,
                            lease_ttl_s=LEASE_TTL_S,
                            extra_tools=("greenroom.actors.runtime.subagents",),
                        )
                    )
                sid = await _start_root(hosts[0])
                stream = await TraceStream.open(conn)
                first: list[Output] = []
                await _records_until(
                    stream, sid, None, first, lambda r: isinstance(r, ToolCallOutput)
                )
                child_id = _child_of(first)
                await effects.started.wait()
                # The child's call is in JetStream before its host is lost.
                await _records_until(
                    stream,
                    child_id,
                    None,
                    [],
                    lambda r: isinstance(r, ModelMsg) and isinstance(r.block, ToolCallBlock),
                )
                leases = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
                owner = await leases.holder(child_id)
                assert owner == await leases.holder(sid)  # a child runs where it was spawned
                lost = next(h for h in hosts if h.host_id == owner)
                lost.process.send_signal(signal.SIGKILL)
                root: list[Output] = []
                await _records_until(
                    stream,
                    sid,
                    None,
                    root,
                    lambda r: isinstance(r, TaskEnd) and _ends_report(root),
                )
                child: list[Output] = []
                await _records_until(
                    stream, child_id, None, child, lambda r: isinstance(r, TaskEnd)
                )
                model.assert_clean()
                return root, child, list(effects.notes)
            finally:
                for host in hosts:  # shown by pytest when the test fails
                    print(f"--- host {host.host_id}", *host.log, sep="\n")
                with trio.CancelScope(shield=True):
                    await _stop(hosts)
                nursery.cancel_scope.cancel()

    root, child, notes = run_connected(nats_server.url, body, prefix="greenroom", timeout_s=BOUND_S)
    assert notes == ["pay"]  # the side effect was not repeated
    (lost,) = [r for r in child if isinstance(r, ToolCallOutput)]
    assert lost.status == "interrupted"
    assert any(HOST_LOST in getattr(b, "text", "") for b in lost.content)
    assert [r.status for r in child if isinstance(r, TaskEnd)] == ["completed"]
    prompts = [r for r in root if isinstance(r, UserMsg) and r.kind == "prompt"]
    assert [p.content[0].text for p in prompts] == [  # type: ignore[union-attr]
        "pay through a subagent",
        f"{FINISHED} paid, as far as I know",
    ]
    assert [r.status for r in root if isinstance(r, TaskEnd)] == ["completed", "completed"]


def _ends_report(records: list[Output]) -> bool:
    """Whether the last task of ``records`` was started by the payer's report."""
    prompts = [r for r in records if isinstance(r, UserMsg) and r.kind == "prompt"]
    return bool(prompts) and FINISHED in str(prompts[-1].content)
