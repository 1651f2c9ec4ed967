"""A bounded fuzz trial of the gateway's HTTP front (R-SEC-1, R-PROTO-2: no request can
end the host or another session). A seeded generator posts 240 mutated A2A JSON-RPC
requests and AG-UI run inputs — fields dropped, given odd types, lone surrogates, huge or
deep values, other methods, broken JSON — with a valid token. Every request is answered:
A2A with a JSON-RPC result or error (never an internal error), AG-UI with an event stream
or a 4xx naming the problem; never a 5xx. Then a well-formed run of each protocol still
completes, and so does a websocket client's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import trio
from test_gateway import BOUND_S, TOKEN, connect, serving
from test_gateway_ag_ui import run_input

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.providers.scripted import Reply, ScriptStep, text
from tests.support.mutation import JsonMutator

REQUESTS = 240
SEED = 20261205
A2A_METHODS = ["message/send", "message/stream", "tasks/get", "tasks/cancel", "tasks/resubscribe"]
INTERNAL_ERROR = -32603


def user_message_body(words: str, message_id: str) -> dict[str, Any]:
    """An A2A v0.3 user message, as its JSON-RPC params carry it."""
    return {
        "kind": "message",
        "messageId": message_id,
        "role": "user",
        "parts": [{"kind": "text", "text": words}],
    }


def plenty() -> list[ScriptStep]:
    """Enough replies for every task the fuzzer can start."""
    return [Reply(blocks=(text("ok"),))] * (REQUESTS + 10)


def a2a_body(rng: random.Random, number: int, task_ids: list[str]) -> dict[str, Any]:
    method = rng.choice([*A2A_METHODS, "nope", "message/send"])
    params: dict[str, Any]
    if method.startswith("message/"):
        params = {"message": user_message_body(f"fuzz {number}", f"m{number}")}
        if task_ids and rng.random() < 0.3:
            params["message"]["taskId"] = rng.choice(task_ids)
    else:
        params = {"id": rng.choice([*task_ids, "no-such-task"]) if task_ids else "none"}
    return {"jsonrpc": "2.0", "id": number, "method": method, "params": params}


def encode(body: Any, rng: random.Random) -> bytes:
    """The body as bytes, now and then broken or not JSON at all."""
    data = json.dumps(body).encode("utf-8", "surrogatepass")
    draw = rng.random()
    if draw < 0.05:
        return data[: rng.randrange(len(data) + 1)]
    if draw < 0.08:
        return b"\xff\xfe\x00 not json"
    return data


def check_a2a(status: int, content: bytes) -> None:
    assert status == 200 or 400 <= status < 500, (status, content[:300])
    if status != 200:
        return
    if content.startswith(b"data:") or b"\ndata:" in content[:200]:
        frames = [
            json.loads(line[5:]) for line in content.splitlines() if line.startswith(b"data:")
        ]
    else:
        frames = [json.loads(content)]
    for frame in frames:
        assert frame.get("jsonrpc") == "2.0", frame
        if "error" in frame:
            assert frame["error"]["code"] != INTERNAL_ERROR, frame
            assert isinstance(frame["error"]["message"], str) and frame["error"]["message"]


def check_ag_ui(status: int, content: bytes, content_type: str) -> None:
    assert status == 200 or 400 <= status < 500, (status, content[:300])
    if status != 200:
        error = json.loads(content)["error"]
        assert isinstance(error["message"], str) and error["message"], error
        return
    assert content_type.startswith("text/event-stream"), content_type
    events = [json.loads(line[6:]) for line in content.splitlines() if line.startswith(b"data: ")]
    assert events and events[-1]["type"] in ("RUN_FINISHED", "RUN_ERROR"), events[-3:]


async def test_fuzzed_http_requests_are_all_answered_and_nothing_breaks(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    mutator = JsonMutator(
        rng, more_odd=({"kind": "nope"},), extra_keys=("kind", "role", "id", "extra", "\ud800")
    )
    limits = GatewayLimits(rate_per_s=1e9, burst=10**9, max_message_bytes=1 << 20)
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream"}
    with trio.fail_after(BOUND_S * 12):
        async with serving(tmp_path, plenty, a2a=True, ag_ui=True, limits=limits) as server:
            base = f"http://127.0.0.1:{server.gateway.port}"

            def send(path: str, content: bytes) -> tuple[int, bytes, str]:
                with httpx.Client(timeout=BOUND_S) as client:
                    answer = client.post(base + path, content=content, headers=headers)
                    return (
                        answer.status_code,
                        answer.content,
                        answer.headers.get("content-type", ""),
                    )

            task_ids: list[str] = []
            for number in range(REQUESTS):
                if rng.random() < 0.5:
                    body: Any = a2a_body(rng, number, task_ids)
                    draw = rng.random()
                    if draw < 0.7:  # the method's params: reach past the envelope
                        body["params"] = mutator.mutate(body["params"])
                    elif draw < 0.85:
                        body = mutator.mutate(body)
                    status, content, _ = await trio.to_thread.run_sync(
                        send, "/a2a", encode(body, rng)
                    )
                    try:
                        check_a2a(status, content)
                    except AssertionError as exc:
                        raise AssertionError(f"request {number}: {body!r:.300}: {exc}") from exc
                    if status == 200 and content.startswith(b"{"):
                        result = json.loads(content).get("result")
                        if isinstance(result, dict) and isinstance(result.get("id"), str):
                            task_ids.append(result["id"])
                else:
                    body = run_input(f"thread-{rng.randrange(4)}", f"run-{number}", "go")
                    if rng.random() < 0.85:
                        body = mutator.mutate(body)
                    status, content, kind = await trio.to_thread.run_sync(
                        send, "/ag-ui", encode(body, rng)
                    )
                    try:
                        check_ag_ui(status, content, kind)
                    except AssertionError as exc:
                        raise AssertionError(f"request {number}: {body!r:.300}: {exc}") from exc

            # Still serving, every side of the port.
            well_formed = {
                "jsonrpc": "2.0",
                "id": "last",
                "method": "message/send",
                "params": {"message": user_message_body("still there?", "m-last")},
            }
            status, content, _ = await trio.to_thread.run_sync(
                send, "/a2a", json.dumps(well_formed).encode()
            )
            assert status == 200 and json.loads(content)["result"]["status"]["state"] in (
                "completed",
                "input-required",
            ), content[:300]
            status, content, kind = await trio.to_thread.run_sync(
                send, "/ag-ui", json.dumps(run_input("thread-last", "run-last", "hi")).encode()
            )
            check_ag_ui(status, content, kind)
            assert status == 200 and b'"RUN_FINISHED"' in content
            async with connect(server) as client:
                sid = (await client.result("session.create"))["session_id"]
                await client.result("session.subscribe", {"session_id": sid})
                await client.result("run", {"session_id": sid, "input": "hello"})
                assert (await client.outputs_until("task_end"))[-1]["status"] == "completed"
