"""``greenroom serve`` drains on SIGTERM (R-DRAIN-1): a real serve process with a task
whose side-effecting call is in flight gets SIGTERM; the call finishes, the task stops at
its turn boundary without sending its next request, and the process exits. The next
``serve`` on the same data dir takes the task up: the call is not run again, no host-lost
note, one ``task_start`` and one ``task_end``."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import trio
from trio_websocket import open_websocket_url

from tests.support.cluster_hosts import HostProcess, start_host
from tests.support.mock_model_server import RecordedRequest, Reply, Text, ToolUse, open_mock_server
from tests.test_cluster_takeover import _unix_listener
from tests.test_gateway import Client

BOUND_S = 60.0


def _model(request: RecordedRequest) -> Reply:
    body = request.body if isinstance(request.body, dict) else {}
    if not body.get("tools"):
        return Reply([Text("A title")])
    if "tool_result" in str(request.messages):
        return Reply([Text("done")])
    return Reply([ToolUse(id="call-1", name="gated", input={"note": "pay"})], "tool_use")


class Gate:
    """The ``gated`` tool's other end: counts its starts, lets them finish on ``open``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.notes: list[str] = []
        self.started = trio.Event()
        self.opened = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        listener = trio.SocketListener(await _unix_listener(self.path))
        task_status.started()
        async with listener, trio.open_nursery() as nursery:
            while True:
                nursery.start_soon(self._call, await listener.accept())

    async def _call(self, stream: trio.abc.Stream) -> None:
        self.notes.append((await stream.receive_some()).decode().strip())
        self.started.set()
        await self.opened.wait()
        await stream.send_all(b"go\n")


def _headers(host: HostProcess) -> list[tuple[bytes, bytes]]:
    return [(b"Authorization", f"Bearer {host.token}".encode())]


def test_sigterm_drains_to_the_turn_boundary_and_the_next_serve_finishes(
    tmp_path: Path,
) -> None:
    async def body() -> tuple[list[str], list[dict[str, object]], int, list[str]]:
        gate = Gate(tmp_path / "gate.sock")
        async with open_mock_server(fallback=_model) as model, trio.open_nursery() as nursery:
            await nursery.start(gate.serve)
            first = await start_host(
                nursery,
                tmp_path,
                "a",
                nats_url=None,
                model_url=model.base_url,
                effects=gate.path,
                lease_ttl_s=5.0,
            )
            async with open_websocket_url(first.url, extra_headers=_headers(first)) as ws:
                client = Client(ws)
                sid = (await client.result("session.create"))["session_id"]
                await client.result("run", {"session_id": sid, "input": "pay"})
                await gate.started.wait()
                first.process.send_signal(signal.SIGTERM)
                await first.wait_logged("draining")
                # Draining: no new task for users, the running one goes on.
                other = (await client.result("session.create"))["session_id"]
                refused = await client.error("run", {"session_id": other, "input": "x"})
                assert "draining" in str(refused), refused
                gate.opened.set()
                assert await first.process.wait() == 0
            assert first.logged("drained: 1 task held at a turn boundary")
            task_requests = [r for r in model.requests if (r.body or {}).get("tools")]
            sent_before = len(task_requests)

            second = await start_host(
                nursery,
                tmp_path,
                "a",
                nats_url=None,
                model_url=model.base_url,
                effects=gate.path,
                lease_ttl_s=5.0,
            )
            try:
                async with open_websocket_url(second.url, extra_headers=_headers(second)) as ws:
                    client = Client(ws)
                    await client.result("session.subscribe", {"session_id": sid})
                    outputs = client.take_outputs()
                    if not any(o["type"] == "task_end" for o in outputs):
                        outputs += await client.outputs_until("task_end")
            finally:
                second.process.send_signal(signal.SIGINT)
                await second.process.wait()
            nursery.cancel_scope.cancel()
        trace = tmp_path / "a" / "sessions" / sid / "trace_001.jsonl"
        lines = [json.loads(line) for line in trace.read_text().splitlines()]
        return gate.notes, lines, sent_before, first.log

    async def bounded() -> tuple[list[str], list[dict[str, object]], int, list[str]]:
        with trio.fail_after(BOUND_S):
            return await body()

    notes, lines, sent_before, _log = trio.run(bounded)
    assert notes == ["pay"]  # the call ran once and was not run again
    assert sent_before == 1  # the boundary sent no request before the process stopped
    types = [line["type"] for line in lines]
    assert types.count("task_start") == 1 and types.count("task_end") == 1, types
    assert lines[-1]["status"] == "completed"
    (result,) = [line for line in lines if line["type"] == "tool_call_output"]
    assert result["status"] == "ok" and "done: pay" in str(result["content"])
    assert not any("[host lost]" in str(line) for line in lines)
