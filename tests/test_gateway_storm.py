"""A seeded storm of websocket clients on shared sessions (R-SEC-1, R-GW, R-STEER, R-ABORT,
R-HITL-2): five clients of one principal each carry out 80 drawn actions on three
sessions — subscribe (from the start, or from the last ``seq`` they saw), run, steer,
queue a follow-up, interrupt, decide the pending approvals, compact, rewind, drop the
connection without a word and connect again, unsubscribe — while the sessions' model
answers at random, with text and tool calls that need approval.

Every request is answered, with a result or an error the protocol names (never an
internal error); what each subscription delivers has its ``seq`` without a gap or a
repeat (a subscription that falls behind says so); every ``task_end`` a subscriber sees
follows that task's ``task_start``; at the end each session answers a last run, and no
session's trace has a gap.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import Lookup
from test_gateway import BOUND_S, TOKEN, Server, serving
from trio_websocket import ConnectionClosed, open_websocket_url

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.protocols import jsonrpc
from greenroom.protocols.context import ModelRequest

CLIENTS = 5
ACTIONS = 80
SESSIONS = 3
KNOWN_CODES = {
    jsonrpc.INVALID_PARAMS,
    jsonrpc.NOT_FOUND,
    jsonrpc.BUSY,
    jsonrpc.FORBIDDEN,
    jsonrpc.AUTH_LOCKED,
}


def storm_script(seed: int) -> Any:
    """A model that answers at random: text now and then slow, or calls of ``lookup``."""
    rng = random.Random(seed)
    count = 0

    async def answer(request: ModelRequest, stream: ScriptedStream) -> None:
        nonlocal count
        count += 1
        if rng.random() < 0.5:
            await stream.text(
                "some words " * rng.randint(1, 5), chunk_delay_s=rng.choice((0, 0.01))
            )
            return
        for i in range(rng.randint(1, 2)):
            await stream.tool_call(tool_call(f"s{seed}r{count}c{i}", "lookup", key=f"k{i}"))
        await stream.end("tool_use")

    return answer


class StormClient:
    """One websocket client: its requests are answered through a reader task that also
    checks every output it is sent (seq without gaps per subscription)."""

    def __init__(self, server: Server, name: str) -> None:
        self.server = server
        self.name = name
        self.ws: Any = None
        self.next_id = 0
        self.waiting: dict[int, trio.Event] = {}
        self.answers: dict[int, dict[str, Any]] = {}
        self.last_seq: dict[str, int] = {}
        """Per subscribed session: the last traced ``seq`` this connection delivered."""
        self.subscribing: dict[str, list[dict[str, Any]]] = {}
        """Per session being subscribed: its outputs that came before the answer."""
        self.delivered = trio.Event()
        """Set at each traced output checked (replaced by whoever waits on it)."""

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        headers = [(b"Authorization", f"Bearer {TOKEN}".encode())]
        async with open_websocket_url(
            self.server.url, extra_headers=headers, connect_timeout=BOUND_S
        ) as ws:
            self.ws = ws
            self.last_seq = {}
            self.subscribing = {}
            task_status.started()
            try:
                while True:
                    self._take(json.loads(await ws.get_message()))
            except ConnectionClosed:
                pass
            finally:
                for event in self.waiting.values():
                    event.set()  # a request cut off with its connection has no answer

    @property
    def open(self) -> bool:
        return self.ws is not None and self.ws.closed is None

    def _take(self, message: dict[str, Any]) -> None:
        if "method" not in message:
            self.answers[message["id"]] = message
            self.waiting.pop(message["id"]).set()
            return
        params = message["params"]
        if message["method"] == "subscription_dropped":
            self.last_seq.pop(params["session_id"], None)
            return
        if message["method"] != "output" or params.get("origin"):
            return
        sid = params["session_id"]
        if sid in self.subscribing:
            self.subscribing[sid].append(params)
        elif sid in self.last_seq:
            self._check(sid, params)

    def _check(self, sid: str, output: dict[str, Any]) -> None:
        if output.get("seq") is None:
            return  # live only
        expected = self.last_seq[sid] + 1
        assert output["seq"] == expected, (self.name, sid, output["type"], output["seq"], expected)
        self.last_seq[sid] = output["seq"]
        self.delivered.set()

    async def until_seen(self, sid: str, seq: int) -> None:
        """Until this connection has delivered ``sid``'s outputs up to ``seq``."""
        while self.last_seq.get(sid, 0) < seq:
            self.delivered = trio.Event()
            await self.delivered.wait()

    def subscribed(self, sid: str, start: int | None) -> None:
        """The subscription of ``sid`` is answered: from ``start`` (None: refused)."""
        early = self.subscribing.pop(sid, [])
        if start is None:
            return
        self.last_seq[sid] = start
        for output in early:
            self._check(sid, output)

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """The answer, or None when the connection went before it came."""
        self.next_id += 1
        request_id = self.next_id
        done = self.waiting[request_id] = trio.Event()
        frame = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        try:
            await self.ws.send_message(json.dumps(frame))
        except ConnectionClosed:
            self.waiting.pop(request_id, None)
            return None
        await done.wait()
        answer = self.answers.pop(request_id, None)
        if answer is not None and "error" in answer:
            assert answer["error"]["code"] in KNOWN_CODES, (method, params, answer)
        return answer

    async def subscribe(self, sid: str, after_seq: int | None) -> None:
        if sid in self.last_seq:  # one subscription a session: end the one there is
            await self.call("session.unsubscribe", {"session_id": sid})
            self.last_seq.pop(sid, None)
        params: dict[str, Any] = {"session_id": sid}
        if after_seq is not None:
            params["after_seq"] = after_seq
        self.subscribing[sid] = []
        answer = await self.call("session.subscribe", params)
        if answer is None or "result" not in answer:
            self.subscribed(sid, None)
            return
        # Replayed outputs (before or after the answer) come from after_seq, 0 without
        # it, then the live ones: no gap, no repeat.
        self.subscribed(sid, after_seq or 0)


async def _act(client: StormClient, sessions: list[str], rng: random.Random) -> None:
    sid = rng.choice(sessions)
    draw = rng.random()
    if draw < 0.15:
        after = rng.choice(["start", "last", "default"])
        if after == "start":
            await client.subscribe(sid, 0)
        elif after == "last" and sid in client.last_seq:
            await client.subscribe(sid, client.last_seq[sid])
        else:
            await client.subscribe(sid, None)
    elif draw < 0.35:
        await client.call("run", {"session_id": sid, "input": f"task from {client.name}"})
    elif draw < 0.45:
        await client.call("steer", {"session_id": sid, "input": "and be brief"})
    elif draw < 0.5:
        await client.call("follow_up", {"session_id": sid, "input": "then one more"})
    elif draw < 0.6:
        await client.call("interrupt", {"session_id": sid})
    elif draw < 0.78:
        answer = await client.call("approvals.list", {})
        pending = (answer or {}).get("result", {}).get("approvals", [])
        for request in pending:
            decision = rng.choice(["allow", "allow", "deny", "allow_session"])
            await client.call(
                "approve",
                {"session_id": request["session_id"], "call_id": request["call_id"],
                 "decision": decision},
            )  # fmt: skip
    elif draw < 0.82:
        await client.call("compact", {"session_id": sid})
    elif draw < 0.86:
        await client.call("session.rewind", {"session_id": sid, "to_seq": rng.randrange(0, 30)})
    elif draw < 0.93:
        await client.call("session.unsubscribe", {"session_id": sid})
        client.last_seq.pop(sid, None)
    else:
        await client.ws.aclose()  # gone without a word; connects again


async def _storm(server: Server, name: str, sessions: list[str], rng: random.Random) -> None:
    client = StormClient(server, name)
    done = 0
    while done < ACTIONS:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.serve)
            while done < ACTIONS and client.open:
                await _act(client, sessions, rng)
                done += 1
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_storm_of_clients_on_shared_sessions(
    tmp_path: Path, lookup: Lookup, seed: int
) -> None:
    rng = random.Random(seed)
    seeds = iter(range(1000))
    with trio.fail_after(BOUND_S * 9):
        async with serving(
            tmp_path, lambda: storm_script(next(seeds)), tools=[lookup.tool], approve="ask"
        ) as server:
            setup = StormClient(server, "setup")
            async with trio.open_nursery() as nursery:
                await nursery.start(setup.serve)
                sessions = []
                for _ in range(SESSIONS):
                    answer = await setup.call("session.create", {})
                    assert answer is not None
                    sessions.append(answer["result"]["session_id"])
                nursery.cancel_scope.cancel()
            async with trio.open_nursery() as nursery:
                for i in range(CLIENTS):
                    client_rng = random.Random(rng.random())
                    nursery.start_soon(_storm, server, f"client {i}", sessions, client_rng)

            # The storm is over: every session ends its task and answers one more run, on
            # a model that needs no approval.
            final = StormClient(server, "final")
            async with trio.open_nursery() as nursery:
                await nursery.start(final.serve)
                for sid in sessions:
                    session = server.host.get_session(sid)
                    await final.call("interrupt", {"session_id": sid})
                    await session.wait_idle()
                    server.host.port(sid).provider = ScriptedProvider(Reply(blocks=(text("ok"),)))
                    await final.subscribe(sid, 0)
                    answer = await final.call("run", {"session_id": sid, "input": "last one"})
                    assert answer is not None and "result" in answer, answer
                    await session.wait_idle()
                    lines = _trace(server, sid)
                    ends = [line for line in lines if line["type"] == "task_end"]
                    assert ends[-1]["status"] == "completed", ends[-1]
                    seqs = [line["seq"] for line in lines]
                    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
                    await final.until_seen(sid, seqs[-1])  # the subscriber sees all of it
                    assert final.last_seq[sid] == seqs[-1]
                nursery.cancel_scope.cancel()


def _trace(server: Server, sid: str) -> list[dict[str, Any]]:
    session = server.host.get_session(sid)
    return [json.loads(line) for line in session.trace_path.read_text().splitlines()]
