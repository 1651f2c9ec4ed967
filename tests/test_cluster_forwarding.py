"""Calls one gateway forwards to another host, cut short or late (R-CLUSTER-1..2): two
in-process cluster hosts, each with its gateway, on a real nats-server; the other host's
work is held with events, and the test lets it go or takes the session away.

* A call forwarded to a session's owner that gives the session up meanwhile (here: its
  lease lost) is answered at once — a 503 whose ``data.outcome`` says whether the call may
  have been carried out — not after the forwarding gateway's whole timeout. A ``run`` that
  had not started says so (the client may run it again); one whose task began is never
  reported as not started (running it again could run it twice).
* A call of non-Latin text forwarded to its session's owner travels as the UTF-8 its
  client sent, not six times that as ASCII escapes; one larger than NATS carries is
  refused with a clear error saying nothing was done. Before, both were internal errors.
* A ``run`` whose prompt's trace record would be larger than NATS carries is refused by
  the session's host, before anything is recorded, and the session goes on there.
* A client of one host subscribing to a session another host runs has its trace replayed
  a stream message at a time, never the whole trace held at once.
* A ``session.create`` placed on a host that creates the session only after the placing
  gateway gave up and created it itself leaves one session, the one the client was told
  of: the late one is undone. So does one whose host made the session and stalled past its
  lease before its answer left: the host that takes that session up deletes it when the
  gateway withdrew the placement first, and the gateway answers with it when it was taken
  up first.
* A ``steer`` or ``follow_up`` is answered ``queued: true`` only once JetStream holds its
  record (``steering_queued``, ``task_queued``), so the host that takes the session up
  after this one dies delivers it; the connection's other calls are answered meanwhile.
  An A2A message that steers is answered so too.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from conftest import Gates, allow_all, port_of
from trio_websocket import open_websocket_url

from greenroom.actors.cluster import router as router_module
from greenroom.actors.cluster import traces as traces_module
from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.node import ClusterConfig, ClusterNode, open_cluster_host
from greenroom.actors.cluster.ownership import OwnershipKeeper
from greenroom.actors.cluster.registry import HostRecord, HostRegistry, SessionDirectory
from greenroom.actors.cluster.router import OwnerDesk
from greenroom.actors.cluster.routing import (
    IN_DOUBT,
    NOT_DONE,
    OWNER_UNREACHABLE,
    SessionRequests,
    answer_payload,
    forwarded_payload,
)
from greenroom.actors.cluster.traces import TraceStream, TraceWriter
from greenroom.actors.gateway import Gateway, SessionDefaults
from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    text,
    thinking,
    tool_call,
)
from greenroom.actors.runtime.command_hooks import load_hooks_file
from greenroom.actors.runtime.errors import InputTooLarge
from greenroom.actors.runtime.host import Host
from greenroom.actors.tools.questions import ask_user
from greenroom.protocols import markers
from greenroom.protocols.content import ImageBlock, ModelBlock, TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage, UserMessage
from greenroom.protocols.hooks import Hooks, Rewrite
from greenroom.protocols.outputs import (
    ModelMsg,
    Output,
    SteeringQueuedOutput,
    TaskEnd,
    ToolCallOutput,
    ToolHook,
    UserMsg,
)
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import Tool, make_tool
from greenroom.protocols.trace import input_size, record_size
from tests.support.nats import (  # the fixture is used as nats_server
    NatsProcess,
    module_nats_server,  # noqa: F401
    run_connected,
    running_nats,
)
from tests.test_command_hooks import hooks_file, py
from tests.test_gateway import TOKEN, Client
from tests.test_gateway_a2a import message_send, raw_post
from tests.test_people import TerminalLike, until_parked

LEASE_TTL_S = 3.0
ANSWERED_S = 5.0
"""Far below the forwarding gateway's timeout: an answer within it is not a timeout."""
BOUND_S = 60.0
PRINCIPAL = "default"  # the principal of ``TOKEN``


@attrs.define
class Member:
    """One host of the test's cluster: its host, node and gateway."""

    host: Host
    node: ClusterNode
    gateway: Gateway


@asynccontextmanager
async def _member(
    conn: Connection,
    url: str,
    tmp_path: Path,
    host_id: str,
    *,
    request_timeout_s: float,
    script: Callable[[], list[Reply]] = lambda: [Reply(blocks=(text("hi"),))],
    tools: Sequence[Tool] = (),
    a2a: bool = False,
) -> AsyncIterator[Member]:
    """Host ``host_id`` of the cluster with its gateway (serving A2A too with ``a2a``);
    each session it makes plays ``script()`` and has ``tools``."""
    config = ClusterConfig(
        url=url,
        host_id=host_id,
        prefix=conn.names.prefix,
        lease_ttl_s=LEASE_TTL_S,
        request_timeout_s=request_timeout_s,
    )
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    nodes: list[ClusterNode] = []
    async with (
        open_cluster_host(
            conn.bridge, config, tmp_path / host_id, approve=allow_all, on_node=nodes.append
        ) as host,
        trio.open_nursery() as nursery,
    ):
        gateway = Gateway(
            host,
            token=TOKEN,
            listen_host="127.0.0.1",
            port=0,
            a2a=a2a,
            defaults=SessionDefaults(
                provider_factory=lambda: ScriptedProvider(script()),
                workspace_dir=workspace,
                tools=tools,
                approve="all",
            ),
        )
        nodes[0].bind_gateway(gateway)
        await nursery.start(gateway.run)
        yield Member(host=host, node=nodes[0], gateway=gateway)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _client(member: Member) -> AsyncIterator[Client]:
    headers = [(b"Authorization", f"Bearer {TOKEN}".encode())]
    async with open_websocket_url(member.gateway.url, extra_headers=headers) as ws:
        yield Client(ws)


async def _created_through(member: Member) -> str:
    """The id ``session.create`` answers a client of ``member``'s gateway."""
    async with _client(member) as client:
        told: str = (await client.result("session.create"))["session_id"]
    return told


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Return once ``check()`` holds (the cluster's buckets are written apart from the
    calls that cause it: read until they are)."""
    while not await check():  # noqa: ASYNC110 (another host writes them: no event here)
        await trio.sleep(0.05)


async def _session_on(owner: Member, conn: Connection) -> str:
    """A new session of ``owner``'s, known to the cluster as ``PRINCIPAL``'s."""
    async with _client(owner) as client:
        sid: str = (await client.result("session.create"))["session_id"]
    assert owner.node.serves(sid)
    directory = await SessionDirectory.open(conn)

    async def listed() -> bool:
        entry = await directory.get(sid)
        return entry is not None and PRINCIPAL in (entry.get("principals") or ())

    await _until(listed)
    return sid


def test_a_forwarded_run_cut_short_by_the_owner_losing_the_session_is_answered_at_once(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """Before its method starts the task, b loses the session (its lease): a's client
    is told at once that nothing was done, instead of after a's 30 s timeout."""

    async def body(conn: Connection) -> dict[str, Any]:
        never = trio.Event()
        async with (
            _member(conn, nats_server.url, tmp_path, "a", request_timeout_s=30.0) as a,
            _member(conn, nats_server.url, tmp_path, "b", request_timeout_s=30.0) as b,
        ):
            sid = await _session_on(b, conn)
            entered = trio.Event()
            run = b.gateway.methods["run"]

            async def held_run(connection: Any, params: dict[str, Any]) -> Any:
                entered.set()
                await never.wait()  # cut short here, before the task starts
                return await run(connection, params)

            b.gateway._methods["run"] = held_run
            return await _run_cut_short(a, b, sid, entered)

    answer = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert answer["code"] == OWNER_UNREACHABLE, answer
    assert answer["data"] == {"outcome": NOT_DONE}, answer
    assert "nothing was done" in answer["message"]


async def _run_cut_short(a: Any, b: Any, sid: str, held: trio.Event) -> dict[str, Any]:
    """A client of a's gateway runs ``sid``, b's session; once b is ``held`` in the run,
    b loses the session. The error the client is answered (at once)."""
    async with _client(a) as client, trio.open_nursery() as nursery:
        answer: dict[str, Any] = {}
        answered = trio.Event()

        async def ask() -> None:
            answer.update(await client.error("run", {"session_id": sid, "input": "go"}))
            answered.set()

        nursery.start_soon(ask)
        await held.wait()
        b.node._on_lost(sid, "the test took it")
        with trio.fail_after(ANSWERED_S):
            await answered.wait()
        return answer


def test_a_forwarded_run_whose_task_began_is_never_reported_as_not_started(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b starts the task and answers that it began; a asks whether its prompt is durable
    (``run.accepted``) and b loses the session while that is asked. a's client is told
    at once that the run (its id) may have started and that the trace says whether it
    was taken up — not a plain "try again" that could run the task twice."""
    asked, never = trio.Event(), trio.Event()
    accepted = OwnerDesk._accepted

    async def held_accepted(self: OwnerDesk, token: object) -> dict[str, Any]:
        asked.set()
        await never.wait()  # cut short here, the task begun
        return await accepted(self, token)

    monkeypatch.setattr(OwnerDesk, "_accepted", held_accepted)

    async def body(conn: Connection) -> dict[str, Any]:
        async with (
            _member(conn, nats_server.url, tmp_path, "a", request_timeout_s=30.0) as a,
            _member(conn, nats_server.url, tmp_path, "b", request_timeout_s=30.0) as b,
        ):
            sid = await _session_on(b, conn)
            return await _run_cut_short(a, b, sid, asked)

    answer = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert answer["code"] == OWNER_UNREACHABLE, answer
    assert answer["data"]["outcome"] == IN_DOUBT, answer
    run_id = answer["data"]["run_id"]
    assert isinstance(run_id, str) and run_id
    assert f"run {run_id} began" in answer["message"]
    assert "running it again may run it twice" in answer["message"]


PLACED_TIMEOUT_S = 1.0
"""The placing gateway's bound on a forwarded call (``request_timeout_s``)."""
IN_TIME_TIMEOUT_S = LEASE_TTL_S
"""A placing gateway's bound long enough for a placed host to make a session within it on
a loaded machine."""


def test_a_large_forwarded_call_is_carried_or_refused_clearly(
    tmp_path: Path, nats_server: NatsProcess
) -> None:
    """A steer of 400,000 non-Latin characters (an 800 KB frame) through a reaches b's
    session; one larger than the NATS server carries is a -32600 saying why, not done.
    Before, both answered ``internal error: MaxPayloadError()`` (R-CLUSTER-1, R-SEC-9)."""

    async def body(conn: Connection) -> dict[str, Any]:
        found: dict[str, Any] = {}
        async with (
            _member(conn, nats_server.url, tmp_path, "a", request_timeout_s=30.0) as a,
            _member(conn, nats_server.url, tmp_path, "b", request_timeout_s=30.0) as b,
            _client(a) as client,
        ):
            sid = await _session_on(b, conn)
            frame = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "steer",
                "params": {"session_id": sid, "input": "é" * 400_000},
            }
            await client.send(json.dumps(frame, ensure_ascii=False))
            found["non_latin"] = await client.response(1)
            # A NATS server configured to carry less than a gateway frame.
            a.node.conn.client._max_payload = 64 * 1024
            found["too_large"] = await client.error(
                "steer", {"session_id": sid, "input": "x" * 100_000}
            )
        return found

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert found["non_latin"].get("result") == {"queued": False}, found["non_latin"]
    too_large = found["too_large"]
    assert too_large["code"] == -32600, too_large
    assert "max_payload" in too_large["message"], too_large
    assert too_large["data"] == {"outcome": NOT_DONE}


def test_a_forwarded_call_keeps_its_text_and_a_lone_surrogate_as_an_escape() -> None:
    """A forwarded call is UTF-8, non-Latin text as it came (2 bytes for "é", not the 6 of
    an escape); a lone surrogate, which an internal message may carry, is sent as its JSON
    escape rather than failing the call with an encoding error (R-CLUSTER-1)."""
    message = {"params": {"input": "é" * 10, "note": "a\ud800b"}}
    payload = forwarded_payload(message)
    assert payload.count("é".encode()) == 10
    assert b"\\ud800" in payload
    assert json.loads(payload) == message


def test_an_answer_larger_than_nats_carries_is_an_error_saying_so() -> None:
    """An owner's answer NATS cannot carry (a list of approvals with large arguments, on a
    server at 1 MiB) is replaced by an error that says the call was carried out and why its
    answer did not come; it was dropped before, and the caller waited out its timeout for a
    "no host answered" (R-CLUSTER-1, R-SEC-9)."""
    small = {"result": {"queued": True}}
    assert json.loads(answer_payload(small, 1024)) == small
    large = {"result": {"approvals": [{"arguments": "x" * 4096}]}}
    payload = answer_payload(large, 1024)
    assert len(payload) <= 1024
    error = json.loads(payload)["error"]
    assert "carried out" in error["message"] and "max_payload" in error["message"]


@asynccontextmanager
async def _placing_on_b(
    conn: Connection, url: str, tmp_path: Path, *, request_timeout_s: float
) -> AsyncIterator[tuple[Member, Member, str]]:
    """Hosts a and b (each forwarding with ``request_timeout_s``), a carrying one session
    (its id) and b none, b taking placed sessions: a's gateway places the next one on b."""
    async with (
        _member(conn, url, tmp_path, "a", request_timeout_s=request_timeout_s) as a,
        _member(conn, url, tmp_path, "b", request_timeout_s=request_timeout_s) as b,
    ):
        loaded = await a.host.create_session(
            provider=ScriptedProvider([]), workspace_dir=tmp_path / "ws"
        )
        await _until_placeable(conn, "b")
        yield a, b, loaded.id


async def _until_placeable(conn: Connection, host_id: str) -> None:
    """Return once host ``host_id`` takes placed sessions."""
    registry = await HostRegistry.open(conn, ttl_s=LEASE_TTL_S)

    async def placeable() -> bool:
        return any(h.host_id == host_id and h.placeable for h in await registry.hosts())

    await _until(placeable)


async def _left_after_placing(
    conn: Connection, a: Member, b: Member, loaded: str, told: str
) -> dict[str, Any]:
    """What a placement left once the cluster settles (bounded): whether a serves ``told``
    (the session its client was told of), b's sessions in memory and stored, and the
    sessions of the cluster's directory besides a's ``loaded`` one."""
    directory = await SessionDirectory.open(conn)
    expected = {loaded, told}

    async def settled() -> bool:
        return (
            set(await directory.ids()) == expected
            and not b.host.sessions
            and not await b.host.list_sessions()
        )

    with trio.move_on_after(LEASE_TTL_S):
        await _until(settled)
    return {
        "told": told,
        "told_on_a": a.node.serves(told),
        "on_b": [s.id for s in b.host.sessions],
        "stored_on_b": [s.session_id for s in await b.host.list_sessions()],
        "in_cluster": set(await directory.ids()) - {loaded},
    }


def test_a_placed_create_finished_after_the_gateway_gave_up_leaves_one_session(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a carries one session and b none: a's gateway places a new session on b. b's
    creation is held until a's gateway has given up on b and answered its client with a
    session of its own; then b creates it. The session the client was told of is the
    only one its create made: b undoes its late one, here and in the cluster."""
    placed: list[Any] = []
    b_done = trio.Event()
    for_host = OwnerDesk.for_host

    async def watched_for_host(
        self: OwnerDesk, message: dict[str, Any], *args: Any
    ) -> dict[str, Any]:
        reply = await for_host(self, message, *args)
        if message.get("method") == "session.create":
            placed.append(reply)
            b_done.set()
        return reply

    monkeypatch.setattr(OwnerDesk, "for_host", watched_for_host)

    async def body(conn: Connection) -> dict[str, Any]:
        async with _placing_on_b(
            conn, nats_server.url, tmp_path, request_timeout_s=PLACED_TIMEOUT_S
        ) as (a, b, loaded):
            asked, release = trio.Event(), trio.Event()
            create = b.host.create_session

            async def held_create(**kwargs: Any) -> Any:
                asked.set()
                await release.wait()
                return await create(**kwargs)

            monkeypatch.setattr(b.host, "create_session", held_create)
            told = await _created_through(a)
            assert asked.is_set()  # it was placed on b first
            release.set()
            await b_done.wait()
            return await _left_after_placing(conn, a, b, loaded, told)

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert found["told_on_a"], found
    assert found["on_b"] == [] and found["stored_on_b"] == [], found
    assert found["in_cluster"] == {found["told"]}, found
    (reply,) = placed
    assert reply["error"]["code"] == OWNER_UNREACHABLE, reply
    assert reply["error"]["data"] == {"outcome": NOT_DONE}, reply


def test_a_placed_create_answered_after_the_gateway_gave_up_leaves_one_session(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b makes the placed session well within its bound and then stalls: its answer is
    held until a's gateway has given up on b (a second past that bound) and answered its
    client with a session of its own. The session the client was told of is the only one
    its create made: a withdraws the placement and b deletes the session it made, here
    and in the cluster (before: b's empty session stayed, listed and counted against the
    principal's cap)."""
    answered: list[dict[str, Any]] = []
    made, release = trio.Event(), trio.Event()
    for_host = OwnerDesk.for_host

    async def stalled_for_host(
        self: OwnerDesk, message: dict[str, Any], *args: Any
    ) -> dict[str, Any]:
        reply = await for_host(self, message, *args)
        if message.get("method") == "session.create":
            answered.append(reply)
            made.set()
            await release.wait()  # b stalls between its answer and NATS
        return reply

    monkeypatch.setattr(OwnerDesk, "for_host", stalled_for_host)

    async def body(conn: Connection) -> dict[str, Any]:
        async with _placing_on_b(
            conn, nats_server.url, tmp_path, request_timeout_s=IN_TIME_TIMEOUT_S
        ) as (a, b, loaded):
            told = await _created_through(a)
            assert made.is_set()  # it was placed on b first
            release.set()
            return await _left_after_placing(conn, a, b, loaded, told)

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    (reply,) = answered
    assert isinstance(reply.get("result", {}).get("session_id"), str), reply  # made in time
    assert reply["result"]["session_id"] != found["told"]
    assert found["told_on_a"], found
    assert found["on_b"] == [] and found["stored_on_b"] == [], found
    assert found["in_cluster"] == {found["told"]}, found


@attrs.define
class _StalledB:
    """Host b stalled (as by SIGSTOP) from the moment it has made the session placed on it,
    before its answer leaves: its answers on its host subject (the create's, and a
    withdrawal's), its lease renewals, its announcements and its orphan scans wait for
    ``resumed``; its lease and registry record lapse meanwhile."""

    made: trio.Event = attrs.Factory(trio.Event)
    resumed: trio.Event = attrs.Factory(trio.Event)
    made_id: list[str] = attrs.Factory(list)
    """The session b made."""

    async def paused(self) -> None:
        """Wait while b is stalled."""
        if self.made.is_set():
            await self.resumed.wait()


def _stall_b_once_it_made_the_placed_session(monkeypatch: pytest.MonkeyPatch) -> _StalledB:
    stalled = _StalledB()
    for_host = OwnerDesk.for_host

    async def stalling_for_host(
        self: OwnerDesk, message: dict[str, Any], *args: Any
    ) -> dict[str, Any]:
        await stalled.paused()  # a withdrawal is not taken up by a stalled host
        reply = await for_host(self, message, *args)
        if message.get("method") == "session.create":
            stalled.made_id.append(reply["result"]["session_id"])
            stalled.made.set()
            await stalled.paused()
        return reply

    renew, announce = OwnershipKeeper.renew, HostRegistry.announce
    take_entries = ClusterNode._take_entries

    async def stalling_renew(self: OwnershipKeeper) -> None:
        if self.host_id == "b":
            await stalled.paused()
        await renew(self)

    async def stalling_announce(self: HostRegistry, record: HostRecord) -> None:
        if record.host_id == "b":
            await stalled.paused()
        await announce(self, record)

    async def stalling_take_entries(self: ClusterNode, entries: dict[str, Any]) -> list[str]:
        if self.host_id == "b":
            await stalled.paused()
        return await take_entries(self, entries)

    monkeypatch.setattr(OwnerDesk, "for_host", stalling_for_host)
    monkeypatch.setattr(OwnershipKeeper, "renew", stalling_renew)
    monkeypatch.setattr(HostRegistry, "announce", stalling_announce)
    monkeypatch.setattr(ClusterNode, "_take_entries", stalling_take_entries)
    return stalled


async def _sessions_in_cluster(conn: Connection, expected: set[str]) -> set[str]:
    """The sessions of the cluster's directory once they are ``expected``, or after two
    lease TTLs (what an orphan scan and a deletion leave is written apart from the calls
    that cause it: read until it is there)."""
    directory = await SessionDirectory.open(conn)

    async def there() -> bool:
        return set(await directory.ids()) == expected

    with trio.move_on_after(2 * LEASE_TTL_S):
        await _until(there)
    return set(await directory.ids())


def test_a_withdrawn_placement_whose_host_stalled_past_its_lease_leaves_no_session(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b makes the session placed on it, then stalls past its lease before its answer
    leaves. a's gateway gives up on b, withdraws the placement and answers its client with
    a session of its own; then a's orphan scan finds b's session. a deletes it instead of
    taking it up, and no session.list lists it meanwhile: the cluster holds only the
    client's session, and b, resumed, keeps nothing either. Before, a took b's empty
    session over, listed and counted against the principal's cap (R-CLUSTER-1, R-SEC-9)."""
    stalled = _stall_b_once_it_made_the_placed_session(monkeypatch)
    answered = trio.Event()
    take_entries = ClusterNode._take_entries

    async def taken_once_answered(self: ClusterNode, entries: dict[str, Any]) -> list[str]:
        if self.host_id == "a":
            await answered.wait()
        return await take_entries(self, entries)

    monkeypatch.setattr(ClusterNode, "_take_entries", taken_once_answered)

    async def body(conn: Connection) -> dict[str, Any]:
        async with _placing_on_b(
            conn, nats_server.url, tmp_path, request_timeout_s=IN_TIME_TIMEOUT_S
        ) as (a, b, loaded):
            async with _client(a) as client:
                told = (await client.result("session.create"))["session_id"]
                assert stalled.made.is_set()  # it was placed on b first
                listed = [
                    s["session_id"] for s in (await client.result("session.list"))["sessions"]
                ]
            answered.set()
            (made,) = stalled.made_id
            # a's orphan scan finds b's session once b's lease has lapsed.
            found = {"in_cluster": await _sessions_in_cluster(conn, {loaded, told})}
            found["taken_up"] = a.node.serves(made)
            stalled.resumed.set()

            async def b_empty() -> bool:
                return not b.host.sessions and not await b.host.list_sessions()

            with trio.move_on_after(2 * LEASE_TTL_S):
                await _until(b_empty)
            found["left_on_b"] = await b.host.list_sessions()
            found["in_cluster_at_last"] = await _sessions_in_cluster(conn, {loaded, told})
            traced = (await (await TraceStream.open(conn)).read(made)).records
            return {**found, "told": told, "made": made, "listed": listed, "traced": traced}

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    told, loaded_and_told = found["told"], found["in_cluster_at_last"]
    assert found["in_cluster"] == loaded_and_told and told in loaded_and_told, found
    assert len(loaded_and_told) == 2 and found["made"] not in loaded_and_told, found
    assert not found["taken_up"], found
    assert found["listed"] == [told], found
    assert found["left_on_b"] == [], found
    assert list(found["traced"]) == [], found


def test_a_placement_taken_over_before_its_gateway_gave_up_is_the_clients_session(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b makes the session placed on it, then stalls past its lease before its answer
    leaves, and a's orphan scan takes that session over before a's gateway gives up on b.
    The gateway answers its client with that session and makes none of its own: one create,
    one session, on a. Before, a's gateway made a second session beside the one taken over
    (R-CLUSTER-1, R-SEC-9)."""
    stalled = _stall_b_once_it_made_the_placed_session(monkeypatch)
    request_host = SessionRequests.request_host
    nodes: list[ClusterNode] = []

    async def taken_over() -> bool:
        return nodes[0].serves(stalled.made_id[0])

    async def given_up_once_taken_over(
        self: SessionRequests, host_id: str, message: dict[str, Any], **kwargs: Any
    ) -> dict[str, Any]:
        try:
            return await request_host(self, host_id, message, **kwargs)
        except ClusterError:
            if message.get("method") == "session.create":
                await _until(taken_over)
            raise

    monkeypatch.setattr(SessionRequests, "request_host", given_up_once_taken_over)

    async def body(conn: Connection) -> dict[str, Any]:
        async with _placing_on_b(
            conn, nats_server.url, tmp_path, request_timeout_s=IN_TIME_TIMEOUT_S
        ) as (a, _, loaded):
            nodes.append(a.node)
            async with _client(a) as client:
                told = (await client.result("session.create"))["session_id"]
                ran = await client.result("run", {"session_id": told, "input": "hello"})
            (made,) = stalled.made_id
            stalled.resumed.set()
            in_cluster = await _sessions_in_cluster(conn, {loaded, made})
            return {
                "told": told,
                "made": made,
                "on_a": a.node.serves(made),
                "ran": ran,
                "others": in_cluster - {loaded},
            }

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert found["told"] == found["made"], found
    assert found["others"] == {found["made"]}, found
    assert found["on_a"], found
    assert isinstance(found["ran"].get("run_id"), str), found


def _hold_takeovers_until(released: trio.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host's takeovers (its orphan scan, a call reopening a session) wait for
    ``released``: what a withdrawn placement leaves is seen before any host deletes it."""
    take_entries = ClusterNode._take_entries

    async def held(self: ClusterNode, entries: dict[str, Any]) -> list[str]:
        await released.wait()
        return await take_entries(self, entries)

    monkeypatch.setattr(ClusterNode, "_take_entries", held)


def test_a_withdrawn_placement_is_listed_by_no_other_gateway(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b makes the session placed on it and stalls before its answer leaves; a's gateway
    gives up, records the withdrawal and answers its client with a session of its own. No
    host has deleted b's session yet. A third gateway, c, lists the client's session and
    not b's, whose directory entry names a placement the cluster records withdrawn.
    Before, every gateway but a's listed it until it was deleted (R-CLUSTER-1, R-SEC-9)."""
    stalled = _stall_b_once_it_made_the_placed_session(monkeypatch)
    listed = trio.Event()
    _hold_takeovers_until(listed, monkeypatch)

    async def body(conn: Connection) -> dict[str, Any]:
        async with _placing_on_b(
            conn, nats_server.url, tmp_path, request_timeout_s=IN_TIME_TIMEOUT_S
        ) as (a, _, _):
            told = await _created_through(a)
            (made,) = stalled.made_id
            directory = await SessionDirectory.open(conn)

            async def made_is_the_clients() -> bool:
                entry = await directory.get(made)
                return entry is not None and PRINCIPAL in (entry.get("principals") or ())

            await _until(made_is_the_clients)
            entry = await directory.get(made)
            async with (
                _member(conn, nats_server.url, tmp_path, "c", request_timeout_s=ANSWERED_S) as c,
                _client(c) as client,
            ):
                listing = await client.result("session.list")
            listed.set()
            stalled.resumed.set()
            ids = [s["session_id"] for s in listing["sessions"]]
            return {"told": told, "made": made, "entry": entry, "listed": ids}

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert isinstance(found["entry"].get("placement"), str), found  # b's, not deleted yet
    assert found["listed"] == [found["told"]], found



def _silence_b_once_it_made_the_placed_session(monkeypatch: pytest.MonkeyPatch) -> _StalledB:
    """b makes the session placed on it, and neither its answer nor its taking up of the
    withdrawal ever leaves: it stops (cleanly) first. ``made`` is set once the withdrawal
    has reached it."""
    silenced = _StalledB()
    for_host = OwnerDesk.for_host

    async def silent_for_host(
        self: OwnerDesk, message: dict[str, Any], *args: Any
    ) -> dict[str, Any]:
        if message.get("method") == router_module.WITHDRAWN_METHOD:
            silenced.made.set()
            await silenced.resumed.wait()  # never: b stops first
        reply = await for_host(self, message, *args)
        if message.get("method") == "session.create":
            silenced.made_id.append(reply["result"]["session_id"])
            await silenced.resumed.wait()
        return reply

    monkeypatch.setattr(OwnerDesk, "for_host", silent_for_host)
    return silenced


async def _listed_by_b_restarted(
    conn: Connection, url: str, tmp_path: Path, expected: set[str]
) -> dict[str, Any]:
    """b started again on its data dir, once the cluster's sessions are ``expected`` (its
    orphan scan took up what it found; bounded): the sessions of the cluster then, those
    b's session.list lists and those its data dir holds."""
    async with (
        _member(conn, url, tmp_path, "b", request_timeout_s=ANSWERED_S) as b,
        _client(b) as client,
    ):
        await _until_placeable(conn, "b")  # its gateway serves the cluster's sessions
        in_cluster = await _sessions_in_cluster(conn, expected)
        listing = await client.result("session.list")
        stored = await b.host.list_sessions()
    return {
        "in_cluster": in_cluster,
        "listed_by_b": [s["session_id"] for s in listing["sessions"]],
        "stored_on_b": [s.session_id for s in stored],
    }


def test_a_withdrawn_placement_deleted_while_its_host_was_away_leaves_it_nothing(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b makes the session placed on it and its answer never leaves; a's gateway gives up
    and withdraws the placement, and b stops cleanly before it takes the withdrawal up. a's
    orphan scan deletes b's session from the cluster. b, started again on its data dir,
    deletes its copy: its session.list and its data dir hold none. Before, b listed the
    deleted session as its own (R-CLUSTER-1, R-SEC-9)."""
    silenced = _silence_b_once_it_made_the_placed_session(monkeypatch)

    async def body(conn: Connection) -> dict[str, Any]:
        url = nats_server.url
        async with _member(conn, url, tmp_path, "a", request_timeout_s=IN_TIME_TIMEOUT_S) as a:
            loaded = await a.host.create_session(
                provider=ScriptedProvider([]), workspace_dir=tmp_path / "ws"
            )
            async with _member(conn, url, tmp_path, "b", request_timeout_s=IN_TIME_TIMEOUT_S):
                await _until_placeable(conn, "b")
                told = await _created_through(a)
                await silenced.made.wait()
            (made,) = silenced.made_id
            found = {"deleted": await _sessions_in_cluster(conn, {loaded.id, told})}
            found["taken_up_by_a"] = a.node.serves(made)
        restarted = await _listed_by_b_restarted(conn, url, tmp_path, {loaded.id, told})
        return {**found, **restarted, "made": made}

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert found["made"] not in found["deleted"] and not found["taken_up_by_a"], found
    assert found["made"] not in found["listed_by_b"], found
    assert found["stored_on_b"] == [], found


def test_a_withdrawn_placement_its_own_host_takes_up_again_is_deleted_there_too(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the whole cluster stops before any host takes b's session up. b,
    started again on its data dir, finds it an orphan and deletes it: from the cluster,
    and its own copy too. Before, only the cluster's part went and b listed the session
    as its own (R-CLUSTER-1, R-SEC-9)."""
    silenced = _silence_b_once_it_made_the_placed_session(monkeypatch)
    hold = trio.Event()
    _hold_takeovers_until(hold, monkeypatch)  # a deletes nothing before it stops

    async def body(conn: Connection) -> dict[str, Any]:
        async with _placing_on_b(
            conn, nats_server.url, tmp_path, request_timeout_s=IN_TIME_TIMEOUT_S
        ) as (a, _, loaded):
            told = await _created_through(a)
            await silenced.made.wait()
        (made,) = silenced.made_id
        hold.set()
        directory = await SessionDirectory.open(conn)
        found = {"entry_left": await directory.get(made) is not None}
        restarted = await _listed_by_b_restarted(conn, nats_server.url, tmp_path, {loaded, told})
        return {**found, **restarted, "made": made}

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert found["entry_left"], found  # no host had taken it up
    assert found["made"] not in found["in_cluster"], found
    assert found["made"] not in found["listed_by_b"], found
    assert found["made"] not in found["stored_on_b"], found  # it took a's sessions over


SMALL_PAYLOAD = 128 * 1024
"""The max_payload of a NATS server that carries less than a trace record a gateway frame
can make (greenroom's own servers take 8 MiB)."""


def test_a_run_whose_record_the_cluster_cannot_carry_is_refused_and_the_session_goes_on(
    tmp_path: Path,
) -> None:
    """On a NATS server that carries 128 KiB, a run whose prompt's trace record would be
    larger — through a, a call just as large as NATS carries to b (its record holds more);
    through b, its owner, 200,000 characters — is a -32602 saying the input is too large,
    and nothing of it is recorded: the session goes on on b and runs the next prompt.
    Before, both were answered as accepted and the session stopped on b (R-SEC-9,
    R-CLUSTER-2)."""

    async def body(conn: Connection, url: str) -> dict[str, Any]:
        found: dict[str, Any] = {}
        async with (
            _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as a,
            _member(conn, url, tmp_path, "b", request_timeout_s=30.0) as b,
        ):
            sid = await _session_on(b, conn)
            call = {
                "method": "run",
                "params": {"session_id": sid, "input": ""},
                "principal": PRINCIPAL,
                "answer": "begun",
            }
            fits = "x" * (SMALL_PAYLOAD - len(forwarded_payload(call)))
            async with _client(a) as via_a, _client(b) as via_b:
                found["forwarded"] = await via_a.error("run", {"session_id": sid, "input": fits})
                found["local"] = await via_b.error(
                    "run", {"session_id": sid, "input": "x" * 200_000}
                )
                found["next"] = await via_a.result("run", {"session_id": sid, "input": "go"})
            found["on_b"] = b.node.serves(sid)
            read = await (await TraceStream.open(conn)).read(sid)
            found["prompts"] = [
                [block.text for block in r.content if isinstance(block, TextBlock)]
                for r in read.records
                if isinstance(r, UserMsg)
            ]
        return found

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: body(conn, server.url), timeout_s=BOUND_S)
    for refused in (found["forwarded"], found["local"]):
        assert refused["code"] == -32602, refused
        assert "too large" in refused["message"] and "max_payload" in refused["message"]
    assert isinstance(found["next"]["run_id"], str), found
    assert found["on_b"], found
    assert found["prompts"] == [["go"]], found


LONG_TRACE = 200
"""Records of the session a remote subscription replays, each its own stream message."""


def test_a_remote_subscribe_replays_a_long_trace_a_message_at_a_time(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's session has 200 records, each acknowledged before the next (one stream
    message each); a client of a subscribes to it. a replays every record of the trace,
    in order, as its own read gives them, and holds at most one message's records at once
    between reading them from the stream and queueing their frames. Before, it read the
    whole trace first: its memory grew with the trace, per subscriber (R-SEC-9)."""
    counts = {"read": 0, "framed": 0, "held": 0}
    fold = traces_module._Fold.add

    def counting_fold(self: Any, msg: Any) -> list[Output]:
        fresh = fold(self, msg)
        counts["read"] += len(fresh)
        return fresh

    frame = router_module.output_frame

    def counting_frame(record: Output) -> str:
        counts["held"] = max(counts["held"], counts["read"] - counts["framed"])
        counts["framed"] += 1
        return frame(record)

    async def body(conn: Connection) -> dict[str, Any]:
        async with (
            _member(conn, nats_server.url, tmp_path, "a", request_timeout_s=30.0) as a,
            _member(conn, nats_server.url, tmp_path, "b", request_timeout_s=30.0) as b,
        ):
            sid = await _session_on(b, conn)
            (session,) = [s for s in b.host.sessions if s.id == sid]
            port = port_of(session)
            for n in range(LONG_TRACE):
                note = (TextBlock(text=f"note {n}"),)
                port.append(
                    UserMsg(
                        session_id=sid,
                        run_id="run_notes",
                        seq=port.next_seq(),
                        kind="steering",
                        content=note,
                    )
                )
                port.commit()
                await port.sync_trace()
            expected = (await (await TraceStream.open(conn)).read(sid)).records
            monkeypatch.setattr(traces_module._Fold, "add", counting_fold)
            monkeypatch.setattr(router_module, "output_frame", counting_frame)
            async with _client(a) as client:
                answer = await client.result("session.subscribe", {"session_id": sid})
                replayed = client.take_outputs()
            return {
                "answer": answer,
                "replayed": [(o["seq"], o["type"]) for o in replayed],
                "expected": [(r.seq, r.type) for r in expected],
                "held": counts["held"],
            }

    found = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert len(found["expected"]) == LONG_TRACE
    assert found["replayed"] == found["expected"]
    assert found["answer"]["replayed"] == len(found["expected"])
    assert found["answer"]["last_seq"] == found["expected"][-1][0]
    assert found["held"] == 1, found["held"]


def _hold_appends_of(record: str, monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """Hold every JetStream append that carries a ``record`` record until the second event
    returned is set; the first is set once one is held."""
    held, release = trio.Event(), trio.Event()
    append = TraceWriter.append

    async def held_append(self: TraceWriter, lines: Sequence[str]) -> int:
        if any(f'"{record}"' in line for line in lines):
            held.set()
            await release.wait()
        return await append(self, lines)

    monkeypatch.setattr(TraceWriter, "append", held_append)
    return held, release


def _in_a_tool_call() -> list[Reply]:
    return [Reply(blocks=(tool_call("c1", "wait", key="a"),)), Reply(blocks=(text("ok"),))]


@asynccontextmanager
async def _owner_in_a_tool_call(
    conn: Connection,
    url: str,
    tmp_path: Path,
    gates: Gates,
    *,
    a2a: bool = False,
    script: Callable[[], list[Reply]] = _in_a_tool_call,
) -> AsyncIterator[tuple[Member, Client, str]]:
    """A cluster host, a client of its gateway, and its session whose task waits in the
    tool call ``wait`` (key ``a``) of ``gates`` (then plays the rest of ``script``)."""
    async with (
        _member(
            conn,
            url,
            tmp_path,
            "a",
            request_timeout_s=30.0,
            script=script,
            tools=[gates.tool()],
            a2a=a2a,
        ) as owner,
        _client(owner) as client,
    ):
        sid = await _session_on(owner, conn)
        await client.result("run", {"session_id": sid, "input": "start"})
        await gates.started("a")
        yield owner, client, sid


@pytest.mark.parametrize(
    ("method", "record"), [("steer", "steering_queued"), ("follow_up", "task_queued")]
)
def test_queued_input_is_answered_once_jetstream_holds_its_record(
    tmp_path: Path,
    nats_server: NatsProcess,
    monkeypatch: pytest.MonkeyPatch,
    gates: Gates,
    method: str,
    record: str,
) -> None:
    """R-STEER-1, R-STEER-6, R-CLUSTER-2: the owner's task is in a long tool call; the
    JetStream append of the input's record is held. The client's next call is answered
    meanwhile, the ``queued: true`` only once the record is in the stream — where the host
    that takes the session up reads it (before: answered at once, while a host dying then
    lost the input)."""
    held, release = _hold_appends_of(record, monkeypatch)

    async def body(conn: Connection) -> tuple[list[int], dict[str, Any], list[str], list[str]]:
        async with _owner_in_a_tool_call(conn, nats_server.url, tmp_path, gates) as (
            owner,
            client,
            sid,
        ):
            await client.send(
                {
                    "jsonrpc": "2.0",
                    "id": 100,
                    "method": method,
                    "params": {"session_id": sid, "input": "also this"},
                }
            )
            await client.send(
                {
                    "jsonrpc": "2.0",
                    "id": 101,
                    "method": "session.unsubscribe",
                    "params": {"session_id": sid},
                }
            )
            try:
                await held.wait()  # the record is on its way to JetStream, and held
                first = await client.receive()
                stored = await _types_stored(conn, sid)
            finally:
                release.set()
            second = await client.receive()
            order = [first["id"], second["id"]]
            answer = first if first["id"] == 100 else second
            after = await _types_stored(conn, sid)
            gates.release("a")
            await owner.host.get_session(sid).wait_idle()
            return order, answer, stored, after

    order, answer, stored, after = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert record not in stored
    assert order == [101, 100], f"{method} answered while JetStream lacked its {record}"
    assert answer["result"] == {"queued": True}, answer
    assert record in after


STEER_CHARS = 50_000
"""One steer's text: under what a record carries at ``SMALL_PAYLOAD``; three are over."""


def _in_a_tool_call_then_two_answers() -> list[Reply]:
    return [*_in_a_tool_call(), Reply(blocks=(text("ok again"),))]


def test_steering_merged_past_what_nats_carries_goes_over_two_requests(
    tmp_path: Path, gates: Gates
) -> None:
    """R-STEER-2, R-SEC-9, R-CLUSTER-2: three steers of 50 KB, each accepted (under what
    the cluster's NATS server, at 128 KiB, carries in a record), wait for a long tool
    call; merged into one ``user_msg`` they would not fit. The first two are delivered by
    one, the third by the next request's, in order, each once and named by its id; the
    session goes on and its task completes (before: the merged record stopped the session
    on its host)."""

    async def body(conn: Connection, url: str) -> dict[str, Any]:
        async with _owner_in_a_tool_call(
            conn, url, tmp_path, gates, script=_in_a_tool_call_then_two_answers
        ) as (owner, client, sid):
            answers = [
                await client.result("steer", {"session_id": sid, "input": c * STEER_CHARS})
                for c in "abc"
            ]
            gates.release("a")
            await owner.host.get_session(sid).wait_idle()
            settled = await owner.node.store.log.settled(sid)  # type: ignore[union-attr]
            records = (await (await TraceStream.open(conn)).read(sid)).records
            return {"answers": answers, "settled": settled, "records": records}

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: body(conn, server.url), timeout_s=BOUND_S)
    assert found["answers"] == [{"queued": True}] * 3
    assert found["settled"], "the session stopped on its host"
    records = found["records"]
    queued = [r.steering_id for r in records if isinstance(r, SteeringQueuedOutput)]
    delivered = [r for r in records if isinstance(r, UserMsg) and r.kind == "steering"]
    texts = [[b.text for b in r.content if isinstance(b, TextBlock)] for r in delivered]
    assert texts == [["a" * STEER_CHARS, "b" * STEER_CHARS], ["c" * STEER_CHARS]]
    assert [r.steering_ids for r in delivered] == [tuple(queued[:2]), tuple(queued[2:])]
    assert [r.status for r in records if isinstance(r, TaskEnd)] == ["completed"]


def test_the_python_api_refuses_input_a_cluster_record_cannot_carry(
    tmp_path: Path, gates: Gates
) -> None:
    """R-SEC-9, R-CLUSTER-2: on a cluster host (NATS at 128 KiB), ``Session.steer``,
    ``follow_up`` and ``run`` of 200 KB raise :class:`InputTooLarge` naming the sizes, and
    nothing is recorded; the session goes on (before: the input was recorded, and its
    record stopped the session on its host)."""

    async def body(conn: Connection, url: str) -> dict[str, Any]:
        big = "x" * 200_000
        refused: list[InputTooLarge] = []
        async with _owner_in_a_tool_call(
            conn, url, tmp_path, gates, script=_in_a_tool_call_then_two_answers
        ) as (owner, _, sid):
            session = owner.host.get_session(sid)
            for call in (session.steer, session.follow_up):
                with pytest.raises(InputTooLarge) as steered:
                    call(big)
                refused.append(steered.value)
            gates.release("a")
            await session.wait_idle()
            with pytest.raises(InputTooLarge) as ran:
                session.run(big)
            refused.append(ran.value)
            result = await session.run("go on").result()
            settled = await owner.node.store.log.settled(sid)  # type: ignore[union-attr]
            records = (await (await TraceStream.open(conn)).read(sid)).records
            return {
                "refused": refused,
                "status": result.task_end.status,
                "settled": settled,
                "records": records,
            }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: body(conn, server.url), timeout_s=BOUND_S)
    for refused in found["refused"]:
        assert refused.size > 200_000 and refused.most < SMALL_PAYLOAD, refused
        assert "too large" in str(refused) and "max_payload" in str(refused)
    assert found["settled"] and found["status"] == "completed", found["status"]
    types = [r.TYPE for r in found["records"]]
    assert "steering_queued" not in types and "task_queued" not in types, types
    prompts = [r.content for r in found["records"] if isinstance(r, UserMsg)]
    assert prompts == [(TextBlock(text="start"),), (TextBlock(text="go on"),)]


async def _ran_once(
    conn: Connection, url: str, tmp_path: Path, provider: ScriptedProvider, **options: Any
) -> dict[str, Any]:
    """On cluster host a, a session of ``provider`` (``options`` as for ``create_session``;
    its workspace ``tmp_path / "ws"``) runs one task, every call allowed: how the task
    ended, whether JetStream acknowledged every record, the records it holds, the largest
    input a record takes, what the model was sent last, and the session's scratchpad."""
    async with _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as owner:
        session = await owner.host.create_session(
            provider=provider, workspace_dir=tmp_path / "ws", **options
        )
        result = await session.run("go", approve=allow_all).result()
        settled = await owner.node.store.log.settled(session.id)  # type: ignore[union-attr]
        return {
            "status": result.task_end.status,
            "settled": settled,
            "records": (await (await TraceStream.open(conn)).read(session.id)).records,
            "most": owner.host.trace_log.largest_input(),
            "seen": provider.requests[-1].messages[-1],
            "scratchpad": session.scratchpad_dir,
        }


def _dump_tool(result: str) -> Tool:
    """A tool ``dump`` that returns ``result``."""

    async def dump() -> str:
        """Print a lot."""
        return result

    return make_tool(dump, parallel=True)


@pytest.mark.parametrize(
    ("output", "budget"),
    [
        # Within the default budget's bytes, but each escaped as six in the record's JSON.
        ("\x01" * 32_000, 32 * 1024),
        # A budget larger than what NATS carries.
        ("HEAD-" + "x" * 300_000, 512 * 1024),
    ],
    ids=["escaped-within-the-budget", "budget-past-the-record"],
)
def test_a_tool_result_past_what_nats_carries_is_cut_to_fit_and_the_session_goes_on(
    tmp_path: Path, output: str, budget: int
) -> None:
    """R-TOOL-8, R-SEC-9, R-CLUSTER-1: on a cluster host whose NATS server takes 128 KiB, a
    tool result that the session's budget leaves larger than one record of the trace (32 KB
    of control characters, escaped to 192 KB; 300 KB under a 512 KiB budget) is cut to fit
    that record, its start kept with a marker naming the scratchpad file that holds all of
    it; the task completes and every record reaches JetStream (before: the session stopped
    on its host, its ``tool_call_output`` larger than NATS takes)."""

    provider = ScriptedProvider(
        [Reply(blocks=(tool_call("c1", "dump"),)), Reply(blocks=(text("Long."),))]
    )
    options = {"tools": [_dump_tool(output)], "tool_result_budget": budget}
    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(
            server.url,
            lambda conn: _ran_once(conn, server.url, tmp_path, provider, **options),
            timeout_s=BOUND_S,
        )
    found["files"] = {p: p.read_text() for p in found["scratchpad"].iterdir()}
    assert found["settled"], "the session stopped on its host"
    assert found["status"] == "completed"
    (result,) = [r for r in found["records"] if isinstance(r, ToolCallOutput)]
    (block,) = result.content
    assert isinstance(block, TextBlock)
    assert found["most"] - 200 < input_size(result.content) <= found["most"]
    ((path, whole),) = found["files"].items()
    assert whole == output
    assert block.text.startswith(output[:1000])
    assert block.text.endswith(f"the whole text is in {path}]"), block.text[-300:]


def _screens_tool(paths: Sequence[str]) -> Tool:
    """A tool ``screens`` that returns a line of text and an image of each of ``paths``."""

    async def screens() -> list[str | ImageBlock]:
        """Show the screens."""
        return ["Screens of the run:", *(ImageBlock(path=p) for p in paths)]

    return make_tool(screens, parallel=True)


@pytest.mark.parametrize(
    ("count", "dots"),
    [
        # Each block's record about 400 bytes: 400 of them, not one record.
        (400, 140),
        # Each about 4 KB (a path of nearly what a file name can be): 40 of them.
        (40, 1900),
    ],
    ids=["many-small-images", "a-few-large-images"],
)
def test_a_tool_result_whose_images_do_not_fit_a_record_leaves_the_last_out_and_says_so(
    tmp_path: Path, count: int, dots: int
) -> None:
    """R-TOOL-8, R-SEC-9, R-CLUSTER-1: on a cluster host whose NATS server takes 128 KiB, a
    tool result of a line of text and images whose blocks take more than one record of the
    trace (400 of about 400 bytes, 40 of about 4 KB) keeps its text and its first images,
    leaves the last ones out and ends with a line saying how many and why, within the
    record; the model gets that line, the task completes and every record reaches
    JetStream (before: the session stopped on its host, its ``tool_call_output`` larger
    than NATS takes)."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    paths = []
    for i in range(count):
        (workspace / f"screen-{i:03d}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes([i % 256]))
        paths.append("./" * dots + f"screen-{i:03d}.png")

    provider = ScriptedProvider(
        [Reply(blocks=(tool_call("c1", "screens"),)), Reply(blocks=(text("Seen."),))]
    )
    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(
            server.url,
            lambda conn: _ran_once(
                conn, server.url, tmp_path, provider, tools=[_screens_tool(paths)]
            ),
            timeout_s=BOUND_S,
        )
    assert found["settled"], "the session stopped on its host"
    assert found["status"] == "completed"
    (result,) = [r for r in found["records"] if isinstance(r, ToolCallOutput)]
    most = found["most"]
    assert most - 5000 < input_size(result.content) <= most
    first, *images, marker = result.content
    assert first == TextBlock(text="Screens of the run:")
    assert 0 < len(images) < count
    assert [b.path for b in images if isinstance(b, ImageBlock)] == paths[: len(images)]
    assert marker == TextBlock(
        text=f"[images cut: {count - len(images)} of {count} images left out, the last ones, "
        f"to fit one record of this session's trace ({most} bytes)]"
    )
    assert marker.text in repr(found["seen"])


def _big_rewrite(kind: str, tmp_path: Path) -> Hooks:
    """A ``before_tool`` hook that rewrites every call's ``words`` to 200,000 characters:
    a Python hook's ``Rewrite``, or a command hook printing the arguments."""
    if kind == "python":

        async def rewrite(call: ToolCallBlock) -> Rewrite:
            return Rewrite({"words": "x" * 200_000})

        return Hooks(before_tool=rewrite)
    command = py("import json; print(json.dumps({'words': 'x' * 200_000}))")
    return load_hooks_file(hooks_file(tmp_path, {"before_tool": [{"command": command}]}))


@pytest.mark.parametrize("kind", ["python", "command"])
def test_a_hook_rewrite_larger_than_a_record_is_refused_and_the_session_goes_on(
    tmp_path: Path, kind: str
) -> None:
    """R-HOOK-2, R-SEC-9, R-CLUSTER-1: on a cluster host whose NATS server takes 128 KiB, a
    ``before_tool`` hook (Python, or a command) that rewrites a call's arguments to 200 KB
    is refused as a rewrite that is no JSON object is: the call is denied by the hook and
    not run, its ``tool_hook`` record an error naming the arguments' size and the limit,
    which the model is told; the task completes and every record reaches JetStream
    (before: the session stopped on its host, its ``tool_hook`` record larger than NATS
    takes)."""
    ran: list[str] = []

    async def echo(words: str) -> str:
        """Say ``words``."""
        ran.append(words)
        return words

    provider = ScriptedProvider(
        [Reply(blocks=(tool_call("c1", "echo", words="hi"),)), Reply(blocks=(text("Denied."),))]
    )
    options = {"tools": [make_tool(echo, parallel=True)], "hooks": _big_rewrite(kind, tmp_path)}
    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(
            server.url,
            lambda conn: _ran_once(conn, server.url, tmp_path, provider, **options),
            timeout_s=BOUND_S,
        )
    assert found["settled"], "the session stopped on its host"
    assert found["status"] == "completed"
    assert ran == []
    (hooked,) = [r for r in found["records"] if isinstance(r, ToolHook)]
    reason = (
        f"the rewritten arguments take 200012 bytes as JSON, more than the {found['most']} "
        "bytes one record of this session's trace carries"
    )
    assert (hooked.action, hooked.arguments, hooked.reason) == ("error", None, reason)
    (result,) = [r for r in found["records"] if isinstance(r, ToolCallOutput)]
    denied = f"Tool call denied: the before_tool hook failed ({reason})."
    assert result.content == (TextBlock(text=denied),)
    assert reason in repr(found["seen"])


def _write_file_tool(ran: list[str]) -> Tool:
    """A tool ``write_file`` that notes each path it is called with."""

    async def write_file(path: str, content: str) -> str:
        """Write ``content`` to ``path``."""
        ran.append(path)
        return "written"

    return make_tool(write_file, parallel=True)


async def _two_tasks(
    conn: Connection, url: str, tmp_path: Path, first: Reply, tools: Sequence[Tool] = ()
) -> dict[str, Any]:
    """On cluster host a, a session whose model answers its first task with ``first`` and
    its second with ``Next.``: what each task ended with, and what JetStream holds."""
    async with _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as owner:
        provider = ScriptedProvider([first, Reply(blocks=(text("Next."),))])
        session = await owner.host.create_session(
            provider=provider, tools=tools, workspace_dir=tmp_path / "ws"
        )
        ends = [(await session.run("go", approve=allow_all).result()).task_end]
        settled = await owner.node.store.log.settled(session.id)  # type: ignore[union-attr]
        ends.append((await session.run("go on", approve=allow_all).result()).task_end)
        return {
            "ends": ends,
            "settled": settled,
            "serves": owner.node.serves(session.id),
            "records": (await (await TraceStream.open(conn)).read(session.id)).records,
            "most": owner.host.trace_log.largest_input(),
            "requests": provider.requests,
        }


BIG_CONTENT = "x" * 300_000
"""A model's output of 300 KB, more than one record of a NATS server at 128 KiB holds."""
BIG_CALL = tool_call("c1", "write_file", path="big.txt", content=BIG_CONTENT)


@pytest.mark.parametrize(
    ("block", "what"),
    [
        (BIG_CALL, "call of write_file"),
        (BIG_CALL, "truncated call of write_file"),
        (text(BIG_CONTENT), "text"),
        (thinking(BIG_CONTENT, signature="sig"), "thinking"),
    ],
    ids=["tool-call", "tool-call-cut-by-max-tokens", "text-of-one-line", "signed-thinking"],
)
def test_a_model_block_no_record_holds_ends_its_task_failed_and_the_session_goes_on(
    tmp_path: Path, block: ModelBlock, what: str
) -> None:
    """R-SEC-9, R-CLUSTER-1, R-RUN-7, R-TOOL-7: on a cluster host whose NATS server takes
    128 KiB, the model answers with a block of 300 KB that cannot be split over several
    records (a tool call's arguments — complete, or 150 KB of them cut by the token limit
    —, a text with no line break, signed thinking): the task ends ``failed`` with a message
    naming the block's size and the record's, a call is not run (nor recorded), the
    records before it are kept, and the session stays on its host and runs its next task
    (before: the session stopped on its host, the model's message larger than NATS
    takes)."""
    ran: list[str] = []
    truncated = what.startswith("truncated")
    reply = Reply(blocks=(text("Here it is."), block), truncate_last_tool_call=truncated)
    if truncated:  # recorded as the token limit left it: half of its arguments' text
        raw = json.dumps(BIG_CALL.arguments)
        block = attrs.evolve(BIG_CALL, arguments={}, invalid_arguments=raw[: len(raw) // 2])
        what = what.removeprefix("truncated ")

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(
            server.url,
            lambda conn: _two_tasks(conn, server.url, tmp_path, reply, [_write_file_tool(ran)]),
            timeout_s=BOUND_S,
        )
    assert found["settled"] and found["serves"], "the session stopped on its host"
    failed, completed = found["ends"]
    size = record_size(block)
    assert (failed.status, failed.message) == (
        "failed",
        f"the model's {what} takes {size} bytes in the trace, more than the {found['most']} "
        "bytes one record of this session's trace carries",
    )
    assert completed.status == "completed"
    assert ran == []
    records = found["records"]
    blocks = [r.block for r in records if isinstance(r, ModelMsg)]
    assert blocks == [TextBlock(text="Here it is."), TextBlock(text="Next.")]
    assert not [r for r in records if isinstance(r, ToolCallOutput)]
    assert [r.status for r in records if isinstance(r, TaskEnd)] == ["failed", "completed"]


@pytest.mark.parametrize("kind", ["text", "thinking"])
def test_a_model_text_no_record_holds_is_split_at_line_breaks_and_kept_whole(
    tmp_path: Path, kind: str
) -> None:
    """R-SEC-9, R-CLUSTER-1: on a cluster host whose NATS server takes 128 KiB, the model
    answers with 300 KB of text (or unsigned thinking) in lines: it is recorded as several
    blocks of its message, each split at a line break and each within a record, which
    joined by line breaks (as a message's text blocks are read and sent) are the whole
    text; the task completes, the next request holds the whole answer, and the session
    stays on its host for its next task (before: the session stopped on its host)."""
    lines = "\n".join(f"line {i}: " + "y" * 90 for i in range(3000))
    block = text(lines) if kind == "text" else thinking(lines)
    reply = Reply(blocks=(block, text("Done.")))

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(
            server.url, lambda conn: _two_tasks(conn, server.url, tmp_path, reply),
            timeout_s=BOUND_S,
        )
    assert found["settled"] and found["serves"], "the session stopped on its host"
    assert [end.status for end in found["ends"]] == ["completed", "completed"]
    records = found["records"]
    split = [r.block for r in records if isinstance(r, ModelMsg) and type(r.block) is type(block)]
    if kind == "text":
        split = split[:-2]  # "Done." and the next task's "Next."
    assert len(split) >= 3
    assert all(record_size(b) <= found["most"] for b in split)
    assert "\n".join(b.text for b in split) == lines  # type: ignore[union-attr]
    if kind == "text":  # thinking with no signature is not sent back (R-RUN-9)
        answer = found["requests"][-1].messages[-2]
        assert isinstance(answer, AssistantMessage)
        assert answer.content == (*split, TextBlock(text="Done."))


def test_a_compaction_summary_no_record_holds_is_cut_and_the_session_goes_on(
    tmp_path: Path,
) -> None:
    """R-SEC-9, R-CLUSTER-1, R-COMPACT-8: on a cluster host whose NATS server takes 128 KiB,
    the model summarizes the context in 300 KB: the compaction ends ``ok`` with the
    summary's start and a marker saying what was left out, its record within what NATS
    carries; the new context starts from that summary, and the session stays on its host
    for its next task (before: the record was larger than NATS takes and the session
    stopped on its host)."""
    summary = "\n".join(f"fact {i}: " + "z" * 90 for i in range(3000))

    async def compact(conn: Connection, url: str) -> dict[str, Any]:
        async with _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as owner:
            replies = [Reply(blocks=(text(t),)) for t in ("Done.", summary, "Next.")]
            provider = ScriptedProvider(replies)
            session = await owner.host.create_session(
                provider=provider, workspace_dir=tmp_path / "ws"
            )
            await session.run("go", approve=allow_all).result()
            end = await session.compact()
            settled = await owner.node.store.log.settled(session.id)  # type: ignore[union-attr]
            then = (await session.run("go on", approve=allow_all).result()).task_end
            return {
                "end": end,
                "then": then,
                "settled": settled,
                "serves": owner.node.serves(session.id),
                "most": owner.host.trace_log.largest_input(),
                "requests": provider.requests,
            }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: compact(conn, server.url),
                              timeout_s=BOUND_S)
    assert found["settled"] and found["serves"], "the session stopped on its host"
    end = found["end"]
    assert end is not None and end.status == "ok"
    assert record_size(end) <= SMALL_PAYLOAD
    kept, _, marker = end.summary.rpartition("\n")
    assert summary.startswith(kept) and len(kept) > 100_000
    assert marker == (
        f"[cut: {len(summary) - len(kept)} of {len(summary)} characters left out to fit one "
        f"record of this session's trace ({found['most']} bytes); the rest is not kept]"
    )
    assert found["then"].status == "completed"
    first = found["requests"][-1].messages[0]
    assert isinstance(first, UserMessage)
    assert first.content == (
        TextBlock(text=markers.wrap(markers.CONTEXT_SUMMARY, end.summary)),
    )


def test_a_persons_answer_past_what_nats_carries_is_refused_and_the_question_waits(
    tmp_path: Path,
) -> None:
    """R-SEC-9, R-HITL-5, R-CLUSTER-1: on a cluster host whose NATS server takes 128 KiB,
    an answer of 200 KB to the model's ``ask_user`` question (its text is the call's
    result, one record) raises :class:`InputTooLarge` naming the sizes; nothing is recorded,
    the question still waits, and a shorter answer completes the task (before: the answer
    was taken, and its record stopped the session on its host)."""

    async def body(conn: Connection, url: str) -> dict[str, Any]:
        async with _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as owner:
            host = owner.host
            provider = ScriptedProvider(
                [
                    Reply(blocks=(tool_call("q1", "ask_user", question="Which color?"),)),
                    Reply(blocks=(text("Blue it is."),)),
                ]
            )
            session = await host.create_session(
                provider=provider, tools=[ask_user], workspace_dir=tmp_path / "ws"
            )
            stream = session.run("paint it", approve=PEOPLE)
            await until_parked(host, session.id)
            with pytest.raises(InputTooLarge) as refused:
                await host.answer_question(session.id, "q1", "x" * 200_000)
            pending = [p.call_id for p in await host.pending_approvals()]
            await host.answer_question(session.id, "q1", "blue")
            result = await stream.result()
            settled = await owner.node.store.log.settled(session.id)  # type: ignore[union-attr]
            records = (await (await TraceStream.open(conn)).read(session.id)).records
            return {
                "refused": refused.value,
                "pending": pending,
                "settled": settled,
                "status": result.task_end.status,
                "records": records,
            }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: body(conn, server.url), timeout_s=BOUND_S)
    refused = found["refused"]
    assert refused.size > 200_000 and refused.most < SMALL_PAYLOAD, refused
    assert "too large" in str(refused) and "max_payload" in str(refused)
    assert found["pending"] == ["q1"]
    assert found["settled"] and found["status"] == "completed", found["status"]
    (result,) = [r for r in found["records"] if isinstance(r, ToolCallOutput)]
    assert result.content == (TextBlock(text="blue"),)


def test_a_callbacks_answer_past_what_nats_carries_is_no_answer_and_the_task_goes_on(
    tmp_path: Path,
) -> None:
    """R-SEC-9, R-HITL-5, R-CLUSTER-1: on a cluster host whose NATS server takes 128 KiB,
    an ``approve`` callback that answers questions (a terminal's) answers ``ask_user`` with
    200 KB: there is nobody to refuse it to, so it is taken as no answer, as one outside
    the choices is; the call gets the no-answer text and the task completes with every
    record in JetStream (before: the answer's record stopped the session on its host)."""

    async def body(conn: Connection, url: str) -> dict[str, Any]:
        async with _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as owner:
            provider = ScriptedProvider(
                [
                    Reply(blocks=(tool_call("q1", "ask_user", question="Which color?"),)),
                    Reply(blocks=(text("Noted."),)),
                ]
            )
            session = await owner.host.create_session(
                provider=provider, tools=[ask_user], workspace_dir=tmp_path / "ws"
            )
            terminal = TerminalLike("x" * 200_000)
            result = await session.run("paint it", approve=terminal).result()
            settled = await owner.node.store.log.settled(session.id)  # type: ignore[union-attr]
            records = (await (await TraceStream.open(conn)).read(session.id)).records
            return {
                "asked": terminal.asked,
                "settled": settled,
                "status": result.task_end.status,
                "records": records,
            }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: body(conn, server.url), timeout_s=BOUND_S)
    assert found["asked"] == ["Which color?"]
    assert found["settled"] and found["status"] == "completed", found["status"]
    (result,) = [r for r in found["records"] if isinstance(r, ToolCallOutput)]
    assert result.content == (TextBlock(text=markers.NO_ANSWER_TEXT),)


async def _types_stored(conn: Connection, sid: str) -> list[str]:
    """The types of the session's records in JetStream, in order."""
    return [r.TYPE for r in (await (await TraceStream.open(conn)).read(sid)).records]


def test_an_a2a_message_that_steers_is_answered_once_jetstream_holds_its_record(
    tmp_path: Path, nats_server: NatsProcess, monkeypatch: pytest.MonkeyPatch, gates: Gates
) -> None:
    """R-STEER-1, R-CLUSTER-2: an A2A ``message/send`` (not blocking) to the context whose
    task is in a long tool call steers it; with the JetStream append of its
    ``steering_queued`` held, nothing is answered until the stream holds it (before: the
    task was answered at once)."""
    held, release = _hold_appends_of("steering_queued", monkeypatch)

    async def body(conn: Connection) -> tuple[bool, list[str], bytes, list[str]]:
        async with _owner_in_a_tool_call(conn, nats_server.url, tmp_path, gates, a2a=True) as (
            owner,
            _,
            sid,
        ):
            send = message_send("also this", contextId=sid)
            send["params"]["configuration"] = {"blocking": False}
            answer = bytearray()
            answered = trio.Event()

            async def ask() -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", owner.gateway.port)
                async with stream:
                    await stream.send_all(raw_post(owner.gateway.port, send))
                    while b"\r\n\r\n" not in answer:
                        answer.extend(await stream.receive_some())
                answered.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                try:
                    await held.wait()  # the record is on its way to JetStream, and held
                    await trio.testing.wait_all_tasks_blocked()
                    early = answered.is_set()
                    stored = await _types_stored(conn, sid)
                finally:
                    release.set()
                await answered.wait()
            after = await _types_stored(conn, sid)
            gates.release("a")
            await owner.host.get_session(sid).wait_idle()
            return early, stored, bytes(answer), after

    early, stored, answer, after = run_connected(nats_server.url, body, timeout_s=BOUND_S)
    assert "steering_queued" not in stored
    assert not early, "the steering was answered while JetStream lacked its record"
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert "steering_queued" in after
