"""What the console's session list reads from ``session.list``: each session's ``title``
(named once by the gateway after its first task, R-HOST-5), ``last_activity_at`` and
``state``. Over a real websocket, against a gateway in this process."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from conftest import Gates
from trio_websocket import WebSocketConnection, open_websocket_url

from greenroom.actors.gateway import TITLE_FILE, Gateway, SessionDefaults
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.stream import ModelError

BOUND_S = 20.0
TOKEN = "sessions-test-token"


def is_title_request(request: ModelRequest) -> bool:
    first = request.messages[0].content[0] if request.messages else None
    return (
        not request.tools
        and isinstance(first, TextBlock)
        and first.text.startswith("Give a short title")
    )


@attrs.define
class Model:
    """One scripted model for every session: task replies in order, title replies in
    order, each request recorded."""

    replies: list[Reply]
    titles: list[Reply] = attrs.field(factory=list)
    requests: list[ModelRequest] = attrs.field(factory=list)

    def __call__(self, request: ModelRequest) -> Reply:
        self.requests.append(request)
        queue = self.titles if is_title_request(request) else self.replies
        if not queue:
            return Reply(fail=ModelError(kind="failed", message="nothing scripted"))
        return queue.pop(0)

    @property
    def title_requests(self) -> int:
        return sum(1 for r in self.requests if is_title_request(r))


class Client:
    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self._ids = 0
        self.outputs: list[dict[str, Any]] = []

    async def result(self, method: str, params: dict[str, Any] | None = None) -> Any:
        self._ids += 1
        await self.ws.send_message(
            json.dumps(
                {"jsonrpc": "2.0", "id": self._ids, "method": method, "params": params or {}}
            )
        )
        while True:
            message = json.loads(await self.ws.get_message())
            if message.get("method") == "output":
                self.outputs.append(message["params"])
            elif message.get("id") == self._ids:
                assert "result" in message, message
                return message["result"]

    async def until_output(self, kind: str, count: int = 1) -> None:
        while sum(1 for o in self.outputs if o["type"] == kind) < count:
            message = json.loads(await self.ws.get_message())
            if message.get("method") == "output":
                self.outputs.append(message["params"])

    async def listed(self, session_id: str) -> dict[str, Any]:
        sessions = (await self.result("session.list"))["sessions"]
        (entry,) = [s for s in sessions if s["session_id"] == session_id]
        assert isinstance(entry, dict)
        return entry

    async def listed_until(self, session_id: str, check: Callable[[dict[str, Any]], bool]) -> Any:
        """Poll ``session.list`` until ``check`` holds for the session's entry (the title
        is made in the background)."""
        while True:
            entry = await self.listed(session_id)
            if check(entry):
                return entry
            await trio.sleep(0.02)


@asynccontextmanager
async def gateway_client(
    host: Host, model: Model, *, titles: bool, gates: Gates | None = None
) -> AsyncIterator[tuple[Gateway, Client]]:
    workspace = host.data_dir.parent / "workspace"  # never holding the data dir (R-SEC-5)
    workspace.mkdir(exist_ok=True)
    gateway = Gateway(
        host,
        token=TOKEN,
        port=0,
        defaults=SessionDefaults(
            provider_factory=lambda: ScriptedProvider(model),
            tools=[gates.tool()] if gates else [],
            workspace_dir=workspace,
        ),
        titles=titles,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.run)
        async with open_websocket_url(
            gateway.url, extra_headers=[(b"Authorization", f"Bearer {TOKEN}".encode())]
        ) as ws:
            yield gateway, Client(ws)
        nursery.cancel_scope.cancel()


async def run_task(client: Client, session_id: str, prompt: str, number: int) -> None:
    await client.result("run", {"session_id": session_id, "input": prompt})
    await client.until_output("task_end", number)


def steps(*replies: str) -> list[Reply]:
    return [Reply(blocks=(text(r),)) for r in replies]


async def test_a_session_is_titled_once_after_its_first_task(tmp_path: Path) -> None:
    model = Model(steps("Up 4%.", "Down 1%."), titles=steps('"Quarterly sales by region"'))
    started = time.time()
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host:
            async with gateway_client(host, model, titles=True) as (gateway, client):
                sid = (await client.result("session.create"))["session_id"]
                await client.result("session.subscribe", {"session_id": sid})
                fresh = await client.listed(sid)
                assert fresh["title"] == "" and fresh["state"] == "idle"
                assert fresh["last_activity_at"] >= fresh["updated_at"]
                for field in ("created_at", "updated_at", "model", "open", "busy"):
                    assert field in fresh  # the fields it had stay
                await run_task(client, sid, "How did sales go?", 1)
                entry = await client.listed_until(sid, lambda e: e["title"] != "")
                assert entry["title"] == "Quarterly sales by region"
                assert entry["state"] == "idle"
                assert started <= entry["last_activity_at"] <= time.time()
                path = host.data_dir / "sessions" / sid / TITLE_FILE
                assert path.read_text(encoding="utf-8") == "Quarterly sales by region\n"
                await run_task(client, sid, "And next quarter?", 2)
                assert (await client.listed(sid))["title"] == "Quarterly sales by region"
            # A new gateway on the same data dir (a restart) reads the stored title and
            # asks for none: the title is the session's, made once.
            async with gateway_client(host, model, titles=True) as (gateway, client):
                gateway.grant("default", sid)
                assert (await client.listed(sid))["title"] == "Quarterly sales by region"
                await client.result("session.subscribe", {"session_id": sid})
                await client.result("run", {"session_id": sid, "input": "Thanks"})
                await client.until_output("task_end")
                assert (await client.listed(sid))["title"] == "Quarterly sales by region"
    assert model.title_requests == 1
    # The title is never part of the conversation (R-HOST-5).
    task_requests = [r for r in model.requests if not is_title_request(r)]
    assert all("short title" not in repr(r.messages) for r in task_requests)


async def test_a_failed_title_is_tried_again_after_the_next_task(tmp_path: Path) -> None:
    failing = Reply(fail=ModelError(kind="failed", message="overloaded"))
    model = Model(steps("One.", "Two."), titles=[failing, *steps("Counting tasks")])
    with trio.fail_after(BOUND_S):
        async with (
            Host.open(tmp_path / "data") as host,
            gateway_client(host, model, titles=True) as (gateway, client),
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await run_task(client, sid, "Count", 1)
            # Once the failed call is over the gateway may try again after the next task.
            await client.listed_until(
                sid, lambda e: model.title_requests == 1 and sid not in gateway._titled
            )
            await run_task(client, sid, "Again", 2)
            entry = await client.listed_until(sid, lambda e: e["title"] != "")
            assert entry["title"] == "Counting tasks"
    assert model.title_requests == 2


async def test_a_long_title_is_cut_at_a_word_with_an_ellipsis(tmp_path: Path) -> None:
    """R-HOST-5: a title longer than the list shows ends with "…" where it was cut, at a
    word, never mid-word and silently."""
    long = "Quarterly sales by region for the northern and southern districts, compared"
    model = Model(steps("Up 4%."), titles=steps(long))
    with trio.fail_after(BOUND_S):
        async with (
            Host.open(tmp_path / "data") as host,
            gateway_client(host, model, titles=True) as (_, client),
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await run_task(client, sid, "How did sales go?", 1)
            entry = await client.listed_until(sid, lambda e: e["title"] != "")
    title = entry["title"]
    assert title == "Quarterly sales by region for the northern and southern…"
    assert len(title) <= 60


async def test_a_session_the_model_never_answered_is_named_after_its_first_prompt(
    tmp_path: Path,
) -> None:
    """A session whose task failed before the model said anything (a bad key, a provider
    that is down) cannot be titled by the model either: it is listed under its first
    prompt, cut at a word, instead of "Untitled"."""
    down = Reply(fail=ModelError(kind="failed", message="no such model", permanent=True))
    model = Model([down], titles=[down])
    prompt = "Summarize   the quarterly sales\nfiles per region and explain the outliers in detail"
    with trio.fail_after(BOUND_S):
        async with (
            Host.open(tmp_path / "data") as host,
            gateway_client(host, model, titles=True) as (_, client),
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await run_task(client, sid, prompt, 1)
            assert [o["status"] for o in client.outputs if o["type"] == "task_end"] == ["failed"]
            entry = await client.listed_until(sid, lambda e: e["title"] != "")
    assert entry["title"] == "Summarize the quarterly sales files per region and explain…"
    assert model.title_requests == 1


async def test_without_titles_the_gateway_asks_the_model_nothing_more(tmp_path: Path) -> None:
    model = Model(steps("One.", "Two."), titles=steps("A title"))
    with trio.fail_after(BOUND_S):
        async with (
            Host.open(tmp_path / "data") as host,
            gateway_client(host, model, titles=False) as (_, client),
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await run_task(client, sid, "Count", 1)
            await run_task(client, sid, "Again", 2)
            assert (await client.listed(sid))["title"] == ""
    assert model.title_requests == 0 and len(model.requests) == 2


async def test_state_says_running_or_waiting_for_approval(tmp_path: Path, gates: Gates) -> None:
    model = Model([Reply(blocks=(tool_call("c1", "wait", key="a"),)), *steps("Waited.")])
    with trio.fail_after(BOUND_S):
        async with (
            Host.open(tmp_path / "data") as host,
            gateway_client(host, model, titles=False, gates=gates) as (_, client),
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "Wait"})
            await client.until_output("approval_request")
            # Once a client has seen the request, the list says so.
            assert (await client.listed(sid))["state"] == "waiting_for_approval"
            await client.result(
                "approve", {"session_id": sid, "call_id": "c1", "decision": "allow"}
            )
            await gates.started("a")
            assert (await client.listed(sid))["state"] == "running"
            gates.release("a")
            await client.until_output("task_end")
            assert (await client.listed(sid))["state"] == "idle"
