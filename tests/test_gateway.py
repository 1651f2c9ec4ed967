"""The websocket gateway (CONTRACT.md "WebSocket: JSON-RPC 2.0"): a real server on
127.0.0.1 port 0, real clients (``trio_websocket.open_websocket_url``), scripted models.
Every test is bounded by ``trio.fail_after``; synchronisation is by messages and events,
never sleeps. The pure frame code (``protocols/jsonrpc.py``) is tested at the end."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import stat
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from conftest import Gates, Lookup, last_user, port_of, results_of, texts_of
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
)

from greenroom.actors.gateway import (
    Gateway,
    GatewayLimits,
    SessionDefaults,
    load_or_create_token,
    run_serve,
)
from greenroom.actors.gateway.connection import OpenConnections
from greenroom.actors.gateway.http_front import HttpFront
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, ScriptStep, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols import jsonrpc
from greenroom.protocols.content import ImageBlock, TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.tools import Tool

TOKEN = "test-token-0123456789"
BOUND_S = 10.0

# -- harness ------------------------------------------------------------------------------------


@attrs.define
class Server:
    host: Host
    gateway: Gateway
    providers: list[ScriptedProvider]

    @property
    def url(self) -> str:
        return self.gateway.url


@asynccontextmanager
async def serving(
    tmp_path: Path,
    script: Callable[[], Sequence[ScriptStep] | ScriptStep] = lambda: [Reply(blocks=(text("hi"),))],
    *,
    tools: Sequence[Tool] = (),
    approve: str = "ask",
    limits: GatewayLimits | None = None,
    workspace_root: Path | None = None,
    host_options: Mapping[str, Any] | None = None,
    mcp_servers: Mapping[str, Any] | None = None,
    **gateway_options: Any,
) -> AsyncIterator[Server]:
    """A host and its gateway on a free port; each created session gets a new scripted
    provider playing ``script()``. At exit none of them saw a broken transcript.
    ``host_options`` go to :meth:`Host.open`, ``gateway_options`` to the :class:`Gateway`
    (the token is ``TOKEN`` unless they give ``tokens``); ``mcp_servers`` are every
    session's."""
    made: list[ScriptedProvider] = []

    def factory() -> ScriptedProvider:
        made.append(ScriptedProvider(script()))
        return made[-1]

    workspace = tmp_path / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    async with (
        Host.open(tmp_path / "data", **(host_options or {})) as host,
        trio.open_nursery() as nursery,
    ):
        gateway = Gateway(
            host,
            token=None if "tokens" in gateway_options else TOKEN,
            listen_host="127.0.0.1",
            port=0,
            defaults=SessionDefaults(
                provider_factory=factory,
                tools=tools,
                workspace_dir=workspace,
                approve=approve,  # type: ignore[arg-type]
                workspace_root=workspace_root,
                mcp_servers=mcp_servers or {},
            ),
            limits=limits,
            **gateway_options,
        )
        port = await nursery.start(gateway.run)
        assert port == gateway.port and port > 0
        yield Server(host=host, gateway=gateway, providers=made)
        nursery.cancel_scope.cancel()
    for provider in made:
        assert provider.violations == []


class Client:
    """A JSON-RPC client over one websocket: ``call`` sends a request and reads until its
    response; notifications read meanwhile are kept, in order, for ``notification``."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._ids = 0
        self._notes: deque[dict[str, Any]] = deque()

    async def send(self, frame: Any) -> None:
        await self.ws.send_message(frame if isinstance(frame, str | bytes) else json.dumps(frame))

    async def receive(self) -> Any:
        return json.loads(await self.ws.get_message())

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._ids += 1
        request: dict[str, Any] = {"jsonrpc": "2.0", "id": self._ids, "method": method}
        if params is not None:
            request["params"] = params
        await self.send(request)
        return await self.response(self._ids)

    async def response(self, request_id: Any) -> dict[str, Any]:
        while True:
            message = await self.receive()
            if isinstance(message, dict) and "method" in message:
                self._notes.append(message)
                continue
            assert isinstance(message, dict) and message["id"] == request_id, message
            return message

    async def result(self, method: str, params: dict[str, Any] | None = None) -> Any:
        response = await self.call(method, params)
        assert "result" in response, response
        return response["result"]

    async def error(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self.call(method, params)
        assert "error" in response, response
        error: dict[str, Any] = response["error"]
        return error

    async def notification(self) -> dict[str, Any]:
        if self._notes:
            return self._notes.popleft()
        message = await self.receive()
        assert isinstance(message, dict) and "method" in message, message
        return message

    def take_outputs(self) -> list[dict[str, Any]]:
        """The outputs already received (e.g. replayed before a subscribe answer)."""
        notes, self._notes = list(self._notes), deque()
        assert all(n["method"] == "output" for n in notes), notes
        return [n["params"] for n in notes]

    async def output(self) -> dict[str, Any]:
        note = await self.notification()
        assert note["method"] == "output", note
        params: dict[str, Any] = note["params"]
        return params

    async def outputs_until(self, type_name: str, **fields: Any) -> list[dict[str, Any]]:
        """Every output up to and including the first of this type with these fields."""
        outputs: list[dict[str, Any]] = []
        while True:
            output = await self.output()
            outputs.append(output)
            if output["type"] == type_name and all(output.get(k) == v for k, v in fields.items()):
                return outputs


@asynccontextmanager
async def connect(
    server: Server, *, token: str | None = TOKEN, client_id: str | None = None
) -> AsyncIterator[Client]:
    headers: list[tuple[bytes, bytes]] = []
    if token is not None:
        headers.append((b"Authorization", b"Bearer " + token.encode()))
    if client_id is not None:
        headers.append((b"X-Greenroom-Client", client_id.encode()))
    async with open_websocket_url(
        server.url, extra_headers=headers, connect_timeout=BOUND_S, disconnect_timeout=BOUND_S
    ) as ws:
        yield Client(ws)


def traced_seqs(outputs: Sequence[dict[str, Any]]) -> list[int]:
    return [o["seq"] for o in outputs if "seq" in o]


def types_of(outputs: Sequence[dict[str, Any]]) -> list[str]:
    return [o["type"] for o in outputs if not o["type"].startswith("partial_")]


def lookup_script() -> list[ScriptStep]:
    return [
        Reply(blocks=(text("Checking."), tool_call("c1", "lookup", key="a"))),
        Reply(blocks=(text("Done."),)),
    ]


def lookup_brain() -> ScriptStep:
    """``lookup_script`` as a model that reads the conversation, so a session loaded again
    (given a new one) goes on where it was: a call to look ``a`` up, then ``Done.``."""

    def brain(request: ModelRequest) -> Reply:
        if results_of(last_user(request)):
            return Reply(blocks=(text("Done."),))
        return Reply(blocks=(text("Checking."), tool_call("c1", "lookup", key="a")))

    return brain


# -- handshake and authentication -----------------------------------------------------------------


async def test_bearer_handshake_create_run_subscribe(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            created = await client.result("session.create")
            sid = created["session_id"]
            started = await client.result("run", {"session_id": sid, "input": "hello"})
            assert started["run_id"].startswith("run_")
            subscribed = await client.result("session.subscribe", {"session_id": sid})
            assert subscribed["session_id"] == sid
            # Replayed before the answer, live after it: together the whole task, once.
            outputs = client.take_outputs()
            if not outputs or outputs[-1]["type"] != "task_end":
                outputs += await client.outputs_until("task_end")
            seqs = traced_seqs(outputs)
            assert seqs == list(range(1, len(seqs) + 1))
            assert outputs[0]["type"] == "user_msg" and outputs[0]["content"] == [
                {"type": "text", "text": "hello"}
            ]
            assert outputs[-1]["type"] == "task_end" and outputs[-1]["status"] == "completed"
            assert {o["run_id"] for o in outputs} == {started["run_id"]}
            assert all(o["session_id"] == sid for o in outputs)
            await server.host.get_session(sid).wait_idle()
            listed = await client.result("session.list")
            assert [s["session_id"] for s in listed["sessions"]] == [sid]
            assert listed["sessions"][0]["busy"] is False


async def test_bad_bearer_token_is_refused_at_the_handshake(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server:
            with pytest.raises(ConnectionRejected) as rejected:
                async with connect(server, token="wrong"):
                    pass
            assert rejected.value.status_code == 401


async def test_other_paths_are_404(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server:
            url = server.url.replace("/v1", "/v2")
            with pytest.raises(ConnectionRejected) as rejected:
                async with open_websocket_url(url, connect_timeout=BOUND_S):
                    pass
            assert rejected.value.status_code == 404


async def test_initialize_authenticates_a_connection_without_a_header(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server, token=None) as client:
            assert (await client.error("session.list"))["code"] == 401
            assert (await client.error("session.create"))["code"] == 401
            assert (await client.error("initialize", {"token": "nope"}))["code"] == 401
            # The connection survived the failures. One token is the principal `default`:
            # a client id naming another is refused (R-SEC-4).
            other = await client.error("initialize", {"token": TOKEN, "client_id": "ann"})
            assert other["code"] == jsonrpc.FORBIDDEN
            result = await client.result("initialize", {"token": TOKEN, "client_id": "default"})
            assert result["client_id"] == "default"
            assert (await client.result("session.list")) == {"sessions": []}
            again = await client.error("initialize", {"token": TOKEN})
            assert again["code"] == jsonrpc.INVALID_REQUEST


async def test_repeated_bad_tokens_close_the_connection(tmp_path: Path) -> None:
    limits = GatewayLimits(max_auth_failures=2)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits) as server, connect(server, token=None) as c:
            assert (await c.error("initialize", {"token": "a"}))["code"] == 401
            assert (await c.error("initialize", {"token": "b"}))["code"] == 401
            with pytest.raises(ConnectionClosed) as closed:
                await c.ws.get_message()
            assert closed.value.reason is not None and closed.value.reason.code == 1008


# -- ownership ------------------------------------------------------------------------------------


ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


async def test_sessions_belong_to_the_client_that_created_them(tmp_path: Path) -> None:
    """R-SEC-4: each token is a principal; it sees and steers only its own sessions."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, tokens={"alice": ALICE, "bob": BOB}) as server,
            connect(server, token=None) as alice,
            connect(server, token=BOB, client_id="bob") as bob,
        ):
            await alice.result("initialize", {"token": ALICE, "client_id": "alice"})
            sid = (await alice.result("session.create"))["session_id"]
            for method, params in [
                ("session.subscribe", {}),
                ("run", {"input": "x"}),
                ("interrupt", {}),
                ("approve", {"call_id": "c1", "decision": "allow"}),
            ]:
                error = await bob.error(method, {"session_id": sid, **params})
                assert error["code"] == 403, (method, error)
            assert (await bob.result("session.list")) == {"sessions": []}
            missing = await bob.error("session.subscribe", {"session_id": "20990101-000000-abcdef"})
            assert missing["code"] == 404
            # Another connection of the same identity sees the session; a grant shares it.
            async with connect(server, token=None) as alice2:
                await alice2.result("initialize", {"token": ALICE})
                listed = await alice2.result("session.list")
                assert [s["session_id"] for s in listed["sessions"]] == [sid]
            server.gateway.grant("bob", sid)
            assert (await bob.result("session.subscribe", {"session_id": sid}))["replayed"] == 0


# -- subscriptions --------------------------------------------------------------------------------


async def test_subscribe_after_seq_replays_then_continues_live(tmp_path: Path) -> None:
    def script() -> list[ScriptStep]:
        return [Reply(blocks=(text("first"),)), Reply(blocks=(text("second"),))]

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script) as server:
            async with connect(server) as client:
                sid = (await client.result("session.create"))["session_id"]
                await client.result("session.subscribe", {"session_id": sid})
                await client.result("run", {"session_id": sid, "input": "one"})
                first = await client.outputs_until("task_end")
            first_seqs = traced_seqs(first)
            assert first_seqs == list(range(1, len(first_seqs) + 1))
            cut = 3
            async with connect(server) as client:
                answer = await client.result(
                    "session.subscribe", {"session_id": sid, "after_seq": cut}
                )
                replay = client.take_outputs()
                assert traced_seqs(replay) == first_seqs[cut:]
                assert answer == {
                    "session_id": sid,
                    "replayed": len(replay),
                    "last_seq": first_seqs[-1],
                }
                second_run = await client.result("run", {"session_id": sid, "input": "two"})
                second = await client.outputs_until("task_end")
            seqs = traced_seqs(replay + second)
            assert seqs == list(range(cut + 1, cut + 1 + len(seqs)))
            assert second[0]["type"] == "user_msg" and second[0]["run_id"] == second_run["run_id"]
            assert second[-1]["status"] == "completed"


async def test_subscribe_after_seq_past_the_last_seq_is_refused(tmp_path: Path) -> None:
    def script() -> list[ScriptStep]:
        return [Reply(blocks=(text("first"),)), Reply(blocks=(text("second"),))]

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "one"})
            last = traced_seqs(await client.outputs_until("task_end"))[-1]
            for past in (last + 1, 10**30):
                error = await client.error(
                    "session.subscribe", {"session_id": sid, "after_seq": past}
                )
                assert error["code"] == jsonrpc.INVALID_PARAMS
                assert error["message"].startswith(f"$.after_seq: {past} is past")
                assert f"last seq ({last})" in error["message"]
            # The refused subscribe left the first one alone, and a resume point at the
            # last seq is a subscription that misses nothing live.
            unsubscribed = await client.result("session.unsubscribe", {"session_id": sid})
            assert unsubscribed == {"unsubscribed": True}
            answer = await client.result(
                "session.subscribe", {"session_id": sid, "after_seq": last}
            )
            assert answer == {"session_id": sid, "replayed": 0, "last_seq": last}
            await client.result("run", {"session_id": sid, "input": "two"})
            second = await client.outputs_until("task_end")
            seqs = traced_seqs(second)
            assert seqs == list(range(last + 1, last + 1 + len(seqs)))
            assert second[0]["type"] == "user_msg"


async def test_subscribe_during_a_run_has_no_gap_and_no_duplicate(
    tmp_path: Path, gates: Gates
) -> None:
    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(tool_call("c1", "wait", key="a"),)),
            Reply(blocks=(text("finished"),)),
        ]

    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, script, tools=[gates.tool()], approve="all") as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("run", {"session_id": sid, "input": "go"})
            await gates.started("a")
            await client.result("session.subscribe", {"session_id": sid, "after_seq": 0})
            gates.release("a")
            outputs = client.take_outputs()
            outputs += await client.outputs_until("task_end")
            seqs = traced_seqs(outputs)
            assert seqs == list(range(1, len(seqs) + 1))
            assert types_of(outputs).count("tool_call_output") == 1


# -- steering, approvals, interrupt, busy -----------------------------------------------------


async def test_steer_during_a_run_reaches_the_next_request(tmp_path: Path, gates: Gates) -> None:
    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(tool_call("c1", "wait", key="a"),)),
            Reply(blocks=(text("ok"),)),
        ]

    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, script, tools=[gates.tool()], approve="all") as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "start"})
            await gates.started("a")
            steered = await client.result(
                "steer", {"session_id": sid, "input": [{"type": "text", "text": "also this"}]}
            )
            assert steered == {"queued": True}
            gates.release("a")
            outputs = await client.outputs_until("task_end")
            steering = [o for o in outputs if o["type"] == "user_msg"]
            assert steering and steering[-1]["kind"] == "steering"
            request: ModelRequest = server.providers[0].requests[1]
            assert any("[user_steering]" in t for t in texts_of(last_user(request)))
            await server.host.get_session(sid).wait_idle()
            idle = await client.result("steer", {"session_id": sid, "input": "late"})
            assert idle == {"queued": False}


async def test_client_approves_a_tool_call(tmp_path: Path, lookup: Lookup) -> None:
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool]) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "go"})
            before = await client.outputs_until("approval_request")
            request = before[-1]
            assert (request["call_id"], request["tool"], request["arguments"]) == (
                "c1",
                "lookup",
                {"key": "a"},
            )
            assert "seq" in request
            unknown = await client.error(
                "approve", {"session_id": sid, "call_id": "nope", "decision": "allow"}
            )
            assert unknown["code"] == 409 and "'nope'" in unknown["message"]
            bad = await client.error(
                "approve", {"session_id": sid, "call_id": "c1", "decision": "maybe"}
            )
            assert bad["code"] == jsonrpc.INVALID_PARAMS and "$.decision" in bad["message"]
            answered = await client.result(
                "approve", {"session_id": sid, "call_id": "c1", "decision": "allow"}
            )
            assert answered == {}
            after = await client.outputs_until("task_end")
            (decision,) = [o for o in after if o["type"] == "approval_decision"]
            assert (decision["decision"], decision["by"]) == ("allow", "client")
            assert decision["principal"] == "default"
            (result,) = [o for o in after if o["type"] == "tool_call_output"]
            assert result["status"] == "ok"
            assert lookup.calls == ["a"]


async def test_a_request_nobody_watches_waits_for_a_person(tmp_path: Path, lookup: Lookup) -> None:
    """R-HITL-1: with no client subscribed the request is still asked and waits in the
    trace (it used to be denied at once); a client that subscribes later finds it and
    answers it."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool]) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("run", {"session_id": sid, "input": "go"})
            await client.result("session.subscribe", {"session_id": sid})
            # The task may have asked before the subscription: the replay then holds it.
            before = client.take_outputs()
            if "approval_request" not in types_of(before):
                before += await client.outputs_until("approval_request")
            assert "approval_decision" not in types_of(before)
            await server.host.get_session(sid).wait_idle()  # parked: the task holds nothing
            assert server.host.get_session(sid).busy
            listed = await client.result("approvals.list")
            assert [a["call_id"] for a in listed["approvals"]] == ["c1"]
            assert lookup.calls == []
            allow = {"session_id": sid, "call_id": "c1", "decision": "allow"}
            await client.result("approve", allow)
            after = await client.outputs_until("task_end")
            (result,) = [o for o in after if o["type"] == "tool_call_output"]
            assert result["status"] == "ok" and lookup.calls == ["a"]


async def test_unanswered_approval_times_out(tmp_path: Path, lookup: Lookup) -> None:
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, lookup_script, tools=[lookup.tool]) as server,
            connect(server) as client,
        ):
            created = await client.result(
                "session.create", {"settings": {"approval_timeout_s": 0.05}}
            )
            sid = created["session_id"]
            assert server.host.get_session(sid).settings.approval_timeout_s == 0.05
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "go"})
            outputs = await client.outputs_until("task_end")
            (decision,) = [o for o in outputs if o["type"] == "approval_decision"]
            assert (decision["decision"], decision["by"]) == ("deny", "default")
            assert lookup.calls == []


async def test_a_pending_request_outlives_the_gateway(tmp_path: Path, lookup: Lookup) -> None:
    """R-HITL-1, R-HITL-2: stopping the gateway leaves the request pending (it used to be
    denied); a gateway started again on the host knows the session's owner from the data
    dir, and the owner answers there."""
    with trio.fail_after(BOUND_S):
        (tmp_path / "workspace").mkdir()
        async with Host.open(tmp_path / "data") as host:
            defaults = SessionDefaults(
                provider_factory=lambda: ScriptedProvider(lookup_script()),
                tools=[lookup.tool],
                workspace_dir=tmp_path / "workspace",
            )
            async with trio.open_nursery() as nursery:
                gateway = Gateway(host, token=TOKEN, port=0, defaults=defaults)
                await nursery.start(gateway.run)
                async with connect(Server(host=host, gateway=gateway, providers=[])) as client:
                    sid = (await client.result("session.create"))["session_id"]
                    await client.result("session.subscribe", {"session_id": sid})
                    await client.result("run", {"session_id": sid, "input": "go"})
                    await client.outputs_until("approval_request")
                    nursery.cancel_scope.cancel()
            session = host.get_session(sid)
            await session.wait_idle()
            await port_of(session).sync_trace()
            records = [json.loads(line) for line in session.trace_path.read_text().splitlines()]
            assert "approval_decision" not in [r["type"] for r in records]
            assert session.busy and lookup.calls == []
            async with trio.open_nursery() as nursery:
                again = Gateway(host, token=TOKEN, port=0, defaults=defaults)
                await nursery.start(again.run)
                assert again.owned("default") == {sid}
                async with connect(Server(host=host, gateway=again, providers=[])) as client:
                    await client.result("session.subscribe", {"session_id": sid})
                    await client.result(
                        "approve", {"session_id": sid, "call_id": "c1", "decision": "allow"}
                    )
                    after = await client.outputs_until("task_end")
                    assert after[-1]["status"] == "completed"
                nursery.cancel_scope.cancel()
            assert lookup.calls == ["a"]


async def test_image_input_is_confined_to_the_workspace(tmp_path: Path) -> None:
    """A relative image path is taken from the workspace and attached there (R-SEC-8): the
    block keeps the client's name and carries the hash of the bytes read."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8
            (server.host.get_session(sid).workspace_dir / "pic.png").write_bytes(png)
            blocks = [{"type": "text", "text": "see"}, {"type": "image", "path": "pic.png"}]
            await client.result("run", {"session_id": sid, "input": blocks})
            outputs = await client.outputs_until("task_end")
            image = outputs[0]["content"][1]
            assert image == {
                "type": "image",
                "path": "pic.png",
                "media_type": "image/png",
                "sha256": hashlib.sha256(png).hexdigest(),
            }


async def test_approve_none_denies_and_all_allows(tmp_path: Path, lookup: Lookup) -> None:
    for mode, verdict in (("none", "deny"), ("all", "allow")):
        with trio.fail_after(BOUND_S):
            async with (
                serving(tmp_path / mode, lookup_script, tools=[lookup.tool], approve=mode) as s,
                connect(s) as client,
            ):
                sid = (await client.result("session.create"))["session_id"]
                await client.result("session.subscribe", {"session_id": sid})
                await client.result("run", {"session_id": sid, "input": "go"})
                outputs = await client.outputs_until("task_end")
                assert "approval_request" not in types_of(outputs)
                (decision,) = [o for o in outputs if o["type"] == "approval_decision"]
                assert decision["decision"] == verdict


async def test_interrupt_and_busy(tmp_path: Path, gates: Gates) -> None:
    def script() -> list[ScriptStep]:
        return [Reply(blocks=(tool_call("c1", "wait", key="a"),)), Reply(blocks=(text("x"),))]

    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, script, tools=[gates.tool()], approve="all") as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "go"})
            await gates.started("a")
            busy = await client.error("run", {"session_id": sid, "input": "again"})
            assert busy["code"] == 409
            assert (await client.error("compact", {"session_id": sid}))["code"] == 409
            assert await client.result("follow_up", {"session_id": sid, "input": "later"}) == {
                "queued": True
            }
            assert await client.result("interrupt", {"session_id": sid}) == {"interrupted": True}
            outputs = await client.outputs_until("task_end")
            assert outputs[-1]["status"] == "aborted"
            assert "abort" in types_of(outputs)
            await server.host.get_session(sid).wait_idle()
            assert await client.result("interrupt", {"session_id": sid}) == {"interrupted": False}
            assert await client.result("skip_reconnect_wait", {"session_id": sid}) == {
                "skipped": False
            }
            assert await client.result("retry_auth", {"session_id": sid}) == {}


async def test_compact_answers_with_compaction_end(tmp_path: Path) -> None:
    def script() -> list[ScriptStep]:
        return [
            Reply(blocks=(text("hello"),)),
            Reply(blocks=(text("[summary]we said hello[/summary]"),)),
        ]

    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, script) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            assert await client.result("compact", {"session_id": sid}) is None  # empty
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "hi"})
            await client.outputs_until("task_end")
            end = await client.result("compact", {"session_id": sid})
            assert end["type"] == "compaction_end" and end["status"] == "ok"


# -- bad frames, limits, batches ------------------------------------------------------------------


async def test_bad_frames_get_errors_and_the_connection_survives(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            await client.send("{not json")
            parsed = await client.receive()
            assert parsed["id"] is None and parsed["error"]["code"] == jsonrpc.PARSE_ERROR
            await client.send(b"\x00\x01binary")
            binary = await client.receive()
            assert binary["error"]["code"] == jsonrpc.INVALID_REQUEST
            await client.send({"jsonrpc": "2.0", "id": 7})
            shape = await client.receive()
            assert shape["id"] == 7 and shape["error"]["code"] == jsonrpc.INVALID_REQUEST
            await client.send([1, 2])
            entries = await client.receive()
            assert [e["error"]["code"] for e in entries] == [jsonrpc.INVALID_REQUEST] * 2
            assert (await client.error("no.such.method"))["code"] == jsonrpc.METHOD_NOT_FOUND
            missing = await client.error("run", {})
            assert missing["code"] == jsonrpc.INVALID_PARAMS
            assert "$.session_id" in missing["message"]
            sid = (await client.result("session.create"))["session_id"]
            no_input = await client.error("run", {"session_id": sid})
            assert "$.input" in no_input["message"]
            bad_block = await client.error(
                "run", {"session_id": sid, "input": [{"type": "text", "text": 3}]}
            )
            assert "$.input[0].text" in bad_block["message"]
            outside = await client.error(
                "run", {"session_id": sid, "input": [{"type": "image", "path": "../../etc/x"}]}
            )
            assert "$.input[0].path" in outside["message"]
            unknown = await client.error("session.create", {"settings": {"bogus": 1}})
            assert unknown["code"] == jsonrpc.INVALID_PARAMS
            assert "$.settings.bogus" in unknown["message"]
            wrong = await client.error("session.create", {"settings": {"max_turns": "many"}})
            assert "$.settings.max_turns" in wrong["message"]
            key = await client.error("session.create", {"settings": {"base_url": "http://x"}})
            assert "$.settings.base_url" in key["message"]
            extra = await client.error("session.list", {"surprise": True})
            assert "$.surprise" in extra["message"]
            # Still connected and working.
            listed = await client.result("session.list")
            assert [s["session_id"] for s in listed["sessions"]] == [sid]


async def test_a_model_given_twice_takes_the_parameter(tmp_path: Path) -> None:
    """``session.create`` with ``model`` and ``settings.model``: the parameter wins and the
    session is created (the settings' model used to reach create_session a second time)."""
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            both = await client.result(
                "session.create", {"model": "model-param", "settings": {"model": "model-set"}}
            )
            only_settings = await client.result(
                "session.create", {"settings": {"model": "model-set"}}
            )
            listed = {
                s["session_id"]: s["model"]
                for s in (await client.result("session.list"))["sessions"]
            }
            assert listed == {
                both["session_id"]: "model-param",
                only_settings["session_id"]: "model-set",
            }


async def test_too_large_frame_is_an_error(tmp_path: Path) -> None:
    limits = GatewayLimits(max_frame_bytes=1000)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits) as server, connect(server) as client:
            await client.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "x" * 2000}))
            answer = await client.receive()
            assert answer["error"]["code"] == jsonrpc.INVALID_REQUEST
            assert (await client.result("session.list")) == {"sessions": []}


async def test_batches(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path) as server, connect(server) as client:
            await client.send(
                [
                    {"jsonrpc": "2.0", "id": "a", "method": "session.list"},
                    {"jsonrpc": "2.0", "method": "session.list"},  # a notification
                    {"jsonrpc": "2.0", "id": "b", "method": "nope"},
                ]
            )
            answers = await client.receive()
            assert [a["id"] for a in answers] == ["a", "b"]
            assert answers[0]["result"] == {"sessions": []}
            assert answers[1]["error"]["code"] == jsonrpc.METHOD_NOT_FOUND
            await client.send([])
            empty = await client.receive()
            assert empty["error"]["code"] == jsonrpc.INVALID_REQUEST


async def test_rate_limit_answers_429(tmp_path: Path) -> None:
    limits = GatewayLimits(rate_per_s=0.001, burst=3)
    with trio.fail_after(BOUND_S):
        async with serving(tmp_path, limits=limits) as server, connect(server) as client:
            for _ in range(3):
                await client.result("session.list")
            assert (await client.error("session.list"))["code"] == jsonrpc.TOO_MANY_REQUESTS
            async with connect(server) as other:  # the limit is per connection
                await other.result("session.list")


async def test_gateway_stop_closes_connections_with_a_reason(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            async with trio.open_nursery() as nursery:
                gateway = Gateway(host, token=TOKEN, port=0)
                await nursery.start(gateway.run)
                server = Server(host=host, gateway=gateway, providers=[])
                async with connect(server) as client:
                    await client.result("session.list")
                    nursery.cancel_scope.cancel()
                    with pytest.raises(ConnectionClosed) as closed:
                        await client.ws.get_message()
                    reason = closed.value.reason
                    assert reason is not None and reason.code == 1001
                    assert reason.reason == "server shutting down"


async def test_a_gateway_stop_waits_for_the_close_handshakes_not_the_close_timeout(
    tmp_path: Path,
) -> None:
    """R-DRAIN-1 (a deploy's SIGTERM ends serve once drained): a stop closes each
    connection with its client's close handshake and is done once the clients have
    answered. The websocket readers used to be cancelled with the gateway, so no answer
    could be read and every stop with a client connected waited the whole close timeout
    (5 s by default; here far beyond the test's bound), and a client whose reader went
    first was told 1000 "bye"."""
    limits = GatewayLimits(close_timeout_s=BOUND_S * 10)
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            gateway = Gateway(host, token=TOKEN, port=0, limits=limits)
            server = Server(host=host, gateway=gateway, providers=[])
            stop = trio.Event()
            stopped = trio.Event()

            async def run_gateway(*, task_status: trio.TaskStatus[None]) -> None:
                async with trio.open_nursery() as nursery:
                    await nursery.start(gateway.run)
                    task_status.started()
                    await stop.wait()
                    nursery.cancel_scope.cancel()
                stopped.set()

            async with trio.open_nursery() as outer:
                await outer.start(run_gateway)
                async with connect(server) as first, connect(server) as second:
                    await first.result("session.list")
                    await second.result("session.list")
                    stop.set()
                    for client in (first, second):
                        with pytest.raises(ConnectionClosed) as closed:
                            await client.ws.get_message()
                        reason = closed.value.reason
                        assert reason is not None
                        assert (reason.code, reason.reason) == (1001, "server shutting down")
                    await stopped.wait()


async def silent_websocket_client(port: int) -> trio.SocketStream:
    """A client that completes the websocket handshake and then reads nothing: it never
    answers a close frame, so the gateway's stop waits the close timeout for it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    await stream.send_all(
        (
            f"GET /v1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
        ).encode()
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = await stream.receive_some(4096)
        assert chunk, f"the gateway closed during the handshake: {answer!r}"
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return stream


async def test_a_gateway_started_again_while_its_last_run_closes_serves_its_sessions(
    tmp_path: Path,
) -> None:
    """R-DRAIN-1, R-HITL-2: a gateway stopped and started again (the console's reconnect,
    a host that restarts its gateway) serves subscriptions even while its last run still
    waits for a client's close handshake. The two runs shared the gateway's hubs and
    titles, and the ending run cleared them under the new one: every subscribe then failed
    with "the gateway has stopped"."""
    limits = GatewayLimits(close_timeout_s=1.0)  # how long the silent client holds the stop
    (tmp_path / "workspace").mkdir()
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
            defaults = SessionDefaults(
                provider_factory=lambda: ScriptedProvider([Reply(blocks=(text("hi"),))]),
                workspace_dir=tmp_path / "workspace",
            )
            gateway = Gateway(host, token=TOKEN, port=0, defaults=defaults, limits=limits)
            server = Server(host=host, gateway=gateway, providers=[])
            old_run_ended = trio.Event()

            async def run_gateway(
                scope: trio.CancelScope, ended: trio.Event, *, task_status: trio.TaskStatus[int]
            ) -> None:
                with scope:
                    await gateway.run(task_status=task_status)
                ended.set()

            first = trio.CancelScope()
            await nursery.start(run_gateway, first, old_run_ended)
            async with connect(server) as client:
                sid = (await client.result("session.create"))["session_id"]
            silent = await silent_websocket_client(gateway.port)
            first.cancel()
            await nursery.start(run_gateway, trio.CancelScope(), trio.Event())
            await silent.aclose()
            await old_run_ended.wait()
            async with connect(server) as client:
                await client.result("session.subscribe", {"session_id": sid})
                await client.result("run", {"session_id": sid, "input": "go"})
                outputs = await client.outputs_until("task_end")
                assert outputs[-1]["status"] == "completed"
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("listener", ["websocket", "http"])
async def test_a_connection_failing_while_the_gateway_stops_does_not_end_it(
    listener: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """R-SEC-4: a connection whose clean-up fails while the gateway is being cancelled
    raises the failure and the cancellation together (an exception group with both); the
    failure is logged and only the cancellation goes on, so the stopping listener, and
    ``serve``, end quietly instead of with a traceback. For the websocket listener's
    connections and for the HTTP front's."""

    async def fails_while_cancelled(*args: object) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            try:
                await trio.sleep_forever()
            finally:
                raise RuntimeError("clean-up failed")

    handle: Callable[[Any], Awaitable[None]]
    if listener == "websocket":
        gateway = Gateway(host=None, token=TOKEN)  # type: ignore[arg-type]
        monkeypatch.setattr(gateway, "_handshake_and_serve", fails_while_cancelled)
        handle = functools.partial(gateway._handle, OpenConnections())
    else:
        front = HttpFront(
            {},
            principals=None,  # type: ignore[arg-type]
            admission=None,  # type: ignore[arg-type]
            seats=None,  # type: ignore[arg-type]
            origin_allowed=lambda origin: True,
            limits=GatewayLimits(),
        )
        monkeypatch.setattr(front, "_route_connection", fails_while_cancelled)
        handle = front._route
    with trio.CancelScope() as stopping:
        stopping.cancel()
        await handle(None)
    assert stopping.cancelled_caught
    assert "clean-up failed" in caplog.text


# -- token file and run_serve ---------------------------------------------------------------------


def test_token_file_is_created_with_mode_0600_and_reused(tmp_path: Path) -> None:
    token = load_or_create_token(tmp_path)
    path = tmp_path / "serve.token"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text().strip() == token and len(token) >= 32
    assert load_or_create_token(tmp_path) == token
    given = tmp_path / "mine"
    given.write_text("  secret-value-0123\n")
    assert load_or_create_token(tmp_path, given) == "secret-value-0123"


async def test_run_serve_prints_and_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ports: list[int] = []
    ready = trio.Event()
    (tmp_path / "workspace").mkdir()

    def on_ready(port: int) -> None:
        ports.append(port)
        ready.set()

    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: run_serve(
                    host="127.0.0.1",
                    port=0,
                    data_dir=tmp_path / "data",
                    defaults=SessionDefaults(
                        provider="scripted", workspace_dir=tmp_path / "workspace"
                    ),
                    ready=on_ready,
                )
            )
            await ready.wait()
            token = (tmp_path / "data" / "serve.token").read_text().strip()
            url = f"ws://127.0.0.1:{ports[0]}/v1"
            async with open_websocket_url(
                url, extra_headers=[(b"Authorization", f"Bearer {token}".encode())]
            ) as ws:
                client = Client(ws)
                sid = (await client.result("session.create"))["session_id"]
                await client.result("session.subscribe", {"session_id": sid})
                await client.result("run", {"session_id": sid, "input": "hi"})
                outputs = await client.outputs_until("task_end")
                assert outputs[-1]["status"] == "completed"
            nursery.cancel_scope.cancel()
    err = capsys.readouterr().err
    assert f"listening on {url}" in err
    assert str(tmp_path / "data" / "serve.token") in err


# -- protocols/jsonrpc.py (pure) ---------------------------------------------------------------


def test_parse_frame_requests_notifications_batches() -> None:
    request = jsonrpc.parse_frame('{"jsonrpc":"2.0","id":1,"method":"run","params":{"a":1}}')
    assert request == jsonrpc.Request(id=1, method="run", params={"a": 1})
    note = jsonrpc.parse_frame('{"jsonrpc":"2.0","method":"x"}')
    assert note == jsonrpc.Notification(method="x", params={})
    batch = jsonrpc.parse_frame('[{"jsonrpc":"2.0","id":"a","method":"m"}, 5]')
    assert isinstance(batch, jsonrpc.Batch) and len(batch.items) == 2
    assert isinstance(batch.items[1], jsonrpc.FrameError)


@pytest.mark.parametrize(
    ("frame", "code", "request_id"),
    [
        ("{", jsonrpc.PARSE_ERROR, None),
        ("NaN", jsonrpc.PARSE_ERROR, None),
        (b"{}", jsonrpc.INVALID_REQUEST, None),
        ("[]", jsonrpc.INVALID_REQUEST, None),
        ("3", jsonrpc.INVALID_REQUEST, None),
        ('{"id":1,"method":"m"}', jsonrpc.INVALID_REQUEST, 1),
        ('{"jsonrpc":"2.0","id":true,"method":"m"}', jsonrpc.INVALID_REQUEST, None),
        ('{"jsonrpc":"2.0","id":2,"method":""}', jsonrpc.INVALID_REQUEST, 2),
        ('{"jsonrpc":"2.0","id":3,"method":"m","extra":1}', jsonrpc.INVALID_REQUEST, 3),
        ('{"jsonrpc":"2.0","id":4,"method":"m","params":[1]}', jsonrpc.INVALID_PARAMS, 4),
        ("x" * 2000, jsonrpc.INVALID_REQUEST, None),
    ],
)
def test_parse_frame_errors(frame: str | bytes, code: int, request_id: Any) -> None:
    parsed = jsonrpc.parse_frame(frame, max_bytes=1000)
    assert isinstance(parsed, jsonrpc.FrameError)
    response = parsed.response()
    assert response["id"] == request_id and response["error"]["code"] == code


def test_an_integer_too_long_to_read_is_named_without_pythons_advice() -> None:
    """Python refuses to read an integer of more than 4300 digits and names
    sys.set_int_max_str_digits(), of no use to a client: the frame's error says what is
    wrong in its own terms (R-PROTO-1); one of 4300 digits is read."""
    too_long = '{"jsonrpc":"2.0","id":1,"method":"run","params":{"n":-%s}}' % ("9" * 4301)
    parsed = jsonrpc.parse_frame(too_long)
    assert isinstance(parsed, jsonrpc.FrameError)
    assert parsed.error.message == "parse error: an integer of more than 4300 digits"
    longest = jsonrpc.parse_frame(
        '{"jsonrpc":"2.0","id":1,"method":"run","params":{"n":%s}}' % ("9" * 4300)
    )
    assert isinstance(longest, jsonrpc.Request) and longest.params["n"] == int("9" * 4300)


def test_batch_size_is_bounded() -> None:
    frame = json.dumps([{"jsonrpc": "2.0", "method": "m"}] * 3)
    parsed = jsonrpc.parse_frame(frame, max_batch=2)
    assert isinstance(parsed, jsonrpc.FrameError)


def test_frames_are_built_and_encoded() -> None:
    assert jsonrpc.result_frame(1, {"a": 1}) == {"jsonrpc": "2.0", "id": 1, "result": {"a": 1}}
    error = jsonrpc.RpcError(404, "no such session", data={"session_id": "s"})
    assert jsonrpc.error_frame("x", error) == {
        "jsonrpc": "2.0",
        "id": "x",
        "error": {"code": 404, "message": "no such session", "data": {"session_id": "s"}},
    }
    note = jsonrpc.notification_frame("output", {"type": "task_end", "text": "é"})
    assert jsonrpc.encode(note) == (
        '{"jsonrpc":"2.0","method":"output","params":{"type":"task_end","text":"é"}}'
    )


def test_parse_input() -> None:
    assert jsonrpc.parse_input("hi") == (TextBlock(text="hi"),)
    blocks = jsonrpc.parse_input(
        [{"type": "text", "text": "look"}, {"type": "image", "path": "a.png"}]
    )
    assert blocks == (TextBlock(text="look"), ImageBlock(path="a.png"))
    for value, path in [
        ("", "$.input"),
        ([], "$.input"),
        (5, "$.input"),
        ([{"type": "video"}], "$.input[0].type"),
        ([{"type": "text"}], "$.input[0].text"),
        ([{"type": "image", "path": ""}], "$.input[0].path"),
        ([{"type": "text", "text": "a", "x": 1}], "$.input[0].x"),
        (["text"], "$.input[0]"),
    ]:
        with pytest.raises(jsonrpc.RpcError) as caught:
            jsonrpc.parse_input(value)
        assert caught.value.code == jsonrpc.INVALID_PARAMS
        assert caught.value.message.startswith(path + ":"), (value, caught.value.message)


def test_parse_settings() -> None:
    good = {
        "max_turns": 3,
        "compact_mode": "discard",
        "approval_timeout_s": 2,
        "system": None,
        "supports_vision": False,
    }
    assert jsonrpc.parse_settings(good) == good
    for value, path in [
        ({"nope": 1}, "$.settings.nope"),
        ({"max_turns": "3"}, "$.settings.max_turns"),
        ({"max_turns": True}, "$.settings.max_turns"),
        ({"max_turns": 1.5}, "$.settings.max_turns"),
        ({"max_turns": -2}, "$.settings.max_turns"),
        ({"compact_mode": "zip"}, "$.settings.compact_mode"),
        ({"approval_timeout_s": 0}, "$.settings.approval_timeout_s"),
        ({"supports_vision": 1}, "$.settings.supports_vision"),
        ({"model": 5}, "$.settings.model"),
        ({"base_url": "http://x"}, "$.settings.base_url"),
    ]:
        with pytest.raises(jsonrpc.RpcError) as caught:
            jsonrpc.parse_settings(value, forbidden=("base_url",))
        assert caught.value.message.startswith(path + ":"), (value, caught.value.message)
    with pytest.raises(jsonrpc.RpcError):
        jsonrpc.parse_settings([1])


def test_param_helpers() -> None:
    params = {"session_id": "s", "after_seq": 2, "n": "x"}
    assert jsonrpc.require_str(params, "session_id") == "s"
    assert jsonrpc.optional_int(params, "after_seq", minimum=0) == 2
    assert jsonrpc.optional_int({}, "after_seq") is None
    for call, path in [
        (lambda: jsonrpc.require_str({}, "session_id"), "$.session_id"),
        (lambda: jsonrpc.require_str({"session_id": 1}, "session_id"), "$.session_id"),
        (lambda: jsonrpc.optional_int({"after_seq": -1}, "after_seq", minimum=0), "$.after_seq"),
        (lambda: jsonrpc.optional_int({"after_seq": "1"}, "after_seq"), "$.after_seq"),
        (lambda: jsonrpc.check_params(params, "session.subscribe"), "$.n"),
        (lambda: jsonrpc.require_choice({"d": "x"}, "d", ("allow", "deny")), "$.d"),
    ]:
        with pytest.raises(jsonrpc.RpcError) as caught:
            call()
        assert caught.value.code == jsonrpc.INVALID_PARAMS
        assert caught.value.message.startswith(path + ":"), caught.value.message
