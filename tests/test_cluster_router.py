"""The owner's side of forwarded calls (R-CLUSTER-1): answers as a gateway connection would,
refuses what is not forwarded, and forgets a watch that is not renewed; and placement, which
passes by a host that does not take placed sessions yet."""

from __future__ import annotations

from typing import Any, cast

import trio
import trio.testing

from greenroom.actors.cluster.errors import OwnerUnreachable
from greenroom.actors.cluster.registry import HostRecord, HostRegistry, SessionDirectory
from greenroom.actors.cluster.router import (
    ACCEPTED_METHOD,
    HAND_OVER_METHOD,
    OWNER_UNREACHABLE,
    WITHDRAWN_METHOD,
    ClusterRouter,
    OwnerDesk,
)
from greenroom.actors.cluster.routing import IN_DOUBT, NOT_DONE, Answering, SessionRequests
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.gateway.connection import AnswerLater
from greenroom.actors.gateway.connection import Connection as GatewayConnection
from greenroom.actors.gateway.server import Gateway
from greenroom.actors.runtime.errors import Busy
from greenroom.protocols import jsonrpc

BOUND_S = 3.0


class _Gateway:
    def __init__(self) -> None:
        self.callers: list[str | None] = []

        async def run(connection: Any, params: dict[str, Any]) -> Any:
            self.callers.append(connection.identity)
            if params.get("input") == "busy":
                raise Busy("the session is running a task")
            return {"run_id": "r1", "session_id": params["session_id"]}

        self.methods = {"run": run}


def _desk(serving: set[str]) -> tuple[OwnerDesk, _Gateway]:
    gateway = _Gateway()

    async def until_serving(_session_id: str) -> None:
        return None

    desk = OwnerDesk(cast(Gateway, gateway), serving.__contains__, until_serving, bound_s=BOUND_S)
    return desk, gateway


def test_forwarded_calls_answer_like_a_gateway_connection() -> None:
    async def main() -> list[dict[str, Any]]:
        desk, gateway = _desk({"s1"})
        handle = desk.for_session("s1")
        replies = [
            # The session id is the subject's, whatever the params say.
            await handle({"method": "run", "params": {"session_id": "x"}, "principal": "alice"}),
            await handle({"method": "run", "params": {"input": "busy"}, "principal": "alice"}),
            await handle({"method": "initialize", "params": {}, "principal": "alice"}),
            await handle({"method": "run", "params": {}}),
            await desk.for_session("s2")({"method": "run", "params": {}, "principal": "alice"}),
        ]
        assert gateway.callers == ["alice", "alice"]
        return replies

    ok, busy, not_forwarded, anonymous, elsewhere = trio.run(main)
    assert ok == {"result": {"run_id": "r1", "session_id": "s1"}}
    assert busy["error"]["code"] == jsonrpc.BUSY
    assert not_forwarded["error"]["code"] == jsonrpc.METHOD_NOT_FOUND
    assert anonymous["error"]["code"] == jsonrpc.INVALID_REQUEST
    assert elsewhere["error"]["code"] == OWNER_UNREACHABLE


class _Host:
    def __init__(self, nursery: trio.Nursery) -> None:
        self.start_task = nursery.start_soon


def test_a_forwarded_run_is_answered_once_begun_then_once_accepted() -> None:
    """The sender's first request is answered as soon as the task has begun (with the
    token of the second); the second once the prompt is durable; an unknown token is the
    503 of a session that changed hosts; a sender that asks nothing gets one answer."""

    async def main() -> dict[str, Any]:
        desk, gateway = _desk({"s1"})
        durable = trio.Event()

        async def run(connection: Any, params: dict[str, Any]) -> Any:
            async def accepted() -> Any:
                await durable.wait()
                return {"run_id": "r1", "durable": True}

            return AnswerLater(accepted, begun={"run_id": "r1"})

        gateway.methods["run"] = run
        found: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            cast(Any, gateway).host = _Host(nursery)
            handle = desk.for_session("s1")
            call = {"method": "run", "params": {}, "principal": "alice"}
            found["begun"] = await handle({**call, "answer": "begun"})
            token = found["begun"]["accepted"]
            asked = {"method": ACCEPTED_METHOD, "params": {"token": token}, "principal": "a"}

            async def ask() -> None:
                found["accepted"] = await handle(asked)

            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            found["before_durable"] = "accepted" in found
            durable.set()
            await trio.testing.wait_all_tasks_blocked()
            found["again"] = await handle(asked)  # asked once only
            found["whole"] = await handle(call)  # an older sender: one answer, once durable
        return found

    found = trio.run(main)
    assert found["begun"]["result"] == {"run_id": "r1"}
    assert found["before_durable"] is False
    assert found["accepted"] == {"result": {"run_id": "r1", "durable": True}}
    assert found["again"]["error"]["code"] == OWNER_UNREACHABLE
    assert found["whole"] == {"result": {"run_id": "r1", "durable": True}}


def test_a_watch_lasts_until_withdrawn_or_not_renewed() -> None:
    async def main() -> list[bool]:
        desk, _ = _desk({"s1"})
        handle = desk.for_session("s1")

        async def watch(watch_id: str, watching: bool) -> None:
            params = {"watching": watching, "watch_id": watch_id}
            assert await handle({"method": "watch", "params": params, "principal": "p"}) == {
                "result": {}
            }

        seen = [desk.watched("s1")]
        await watch("w1", True)
        await watch("w2", True)
        seen.append(desk.watched("s1"))
        await watch("w1", False)
        seen.append(desk.watched("s1"))
        await trio.sleep(BOUND_S / 2)
        seen.append(desk.watched("s1"))
        await trio.sleep(BOUND_S)  # w2 was not renewed: its gateway is gone
        seen.append(desk.watched("s1"))
        return seen

    clock = trio.testing.MockClock(autojump_threshold=0)
    assert trio.run(main, clock=clock) == [False, True, True, True, False]


class _Registry:
    def __init__(self, records: list[HostRecord]) -> None:
        self.records = records

    async def hosts(self) -> list[HostRecord]:
        return self.records


class _Requests:
    def __init__(self) -> None:
        self.asked: list[str] = []

    async def request_host(
        self, host_id: str, message: dict[str, Any], *, timeout_s: float
    ) -> dict[str, Any]:
        self.asked.append(host_id)
        return {"result": {"session_id": f"made-on-{host_id}"}}


class _Grants:
    def grant(self, client_id: str, session_id: str) -> None:
        pass


class _Caller:
    identity = "alice"


def _placing_router(
    nursery: trio.Nursery,
    requests: Any,
    registry: Any,
    *,
    gateway: Any = None,
    directory: Any = None,
    reopen: Any = None,
) -> ClusterRouter:
    """Host a's router, placing sessions through ``requests`` among ``registry``'s hosts
    (and forwarding calls through them, routed by ``directory``)."""
    return ClusterRouter(
        host_id="a",
        gateway=cast(Gateway, gateway or _Grants()),
        requests=cast(SessionRequests, requests),
        directory=cast(SessionDirectory, directory),
        registry=cast(HostRegistry, registry),
        traces=cast(TraceStream, None),
        serves=lambda _sid: False,
        own_load=lambda: 1,
        nursery=nursery,
        timeout_s=BOUND_S,
        watch_ttl_s=BOUND_S,
        reopen=reopen,
    )


def test_placement_passes_by_a_host_that_does_not_take_placed_sessions_yet() -> None:
    """A host that has just joined is in the registry before it answers on its subject
    and has loaded its provider; asked then, it would not answer in time and the session
    would stay here after a wait. Placement passes it by until it announces itself
    placeable, then places there (R-CLUSTER-1)."""

    async def place(placeable: bool) -> tuple[Any, list[str]]:
        requests = _Requests()
        registry = _Registry(
            [HostRecord(host_id="a", load=1), HostRecord(host_id="b", load=0, placeable=placeable)]
        )
        async with trio.open_nursery() as nursery:
            router = _placing_router(nursery, requests, registry)
            placed = await router.place(cast(GatewayConnection, _Caller()), {})
        return placed, requests.asked

    assert trio.run(place, False) == (None, [])
    assert trio.run(place, True) == ({"session_id": "made-on-b"}, ["b"])


def test_a_call_cut_short_says_whether_it_may_have_been_done() -> None:
    """What the owner reports for a forwarded call cut short by its giving the session up
    (the sender is told so, :mod:`.routing`): a ``run`` whose method has not returned has
    not started its task (nothing done: it may be sent again), another call whose method
    was called may have been carried out (in doubt); a session no longer served here is
    answered as moving, nothing done."""

    async def main() -> dict[str, bool | dict[str, Any]]:
        desk, gateway = _desk({"s1"})
        called = trio.Event()

        async def held(connection: Any, params: dict[str, Any]) -> Any:
            called.set()
            await trio.sleep_forever()

        gateway.methods["run"] = gateway.methods["steer"] = held
        handle = desk.for_session("s1")
        found: dict[str, bool | dict[str, Any]] = {}
        for method, answer in (("run", "begun"), ("steer", None)):
            answering = Answering()
            message: dict[str, Any] = {"method": method, "params": {}, "principal": "alice"}
            if answer is not None:
                message["answer"] = answer
            called = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(handle, message, answering)
                await called.wait()
                nursery.cancel_scope.cancel()
            found[method] = answering.in_doubt
        found["moving"] = await desk.for_session("s2")(
            {"method": "steer", "params": {}, "principal": "alice"}, Answering()
        )
        return found

    found = trio.run(main)
    assert found["run"] is False
    assert found["steer"] is True
    moving = found["moving"]
    assert isinstance(moving, dict)
    assert moving["error"]["code"] == OWNER_UNREACHABLE
    assert moving["error"]["data"] == {"outcome": NOT_DONE}


class _PlacedHost:
    """The host of a desk that takes placed creates: its sessions, as deletes leave them."""

    def __init__(self) -> None:
        self.sessions = {"new-1"}
        self.deleted: list[str] = []

    async def delete_session(self, session_id: str) -> None:
        self.deleted.append(session_id)
        self.sessions.discard(session_id)


def test_a_placed_create_is_answered_within_its_bound_or_undone() -> None:
    """The placed host answers a placed ``session.create`` only within the ``within_s``
    the placing gateway gave it (at most its own bound), once the session is served
    here; a session made or served later is deleted and the answer says nothing was
    kept — the gateway, which waits a margin longer, creates the session itself."""

    async def place(create_s: float, serve_s: float, within_s: float) -> tuple[Any, set[str]]:
        gateway = _Gateway()
        host = _PlacedHost()
        cast(Any, gateway).host = host

        async def create(connection: Any, params: dict[str, Any]) -> Any:
            await trio.sleep(create_s)
            return {"session_id": "new-1"}

        async def until_serving(_session_id: str) -> None:
            await trio.sleep(serve_s)

        gateway.methods["session.create"] = create
        desk = OwnerDesk(
            cast(Gateway, gateway), {"s1"}.__contains__, until_serving, bound_s=BOUND_S
        )
        message = {"method": "session.create", "params": {}, "principal": "alice"}
        reply = await desk.for_host({**message, "within_s": within_s}, Answering())
        return reply, host.sessions

    def run(create_s: float, serve_s: float, within_s: float = BOUND_S) -> tuple[Any, set[str]]:
        return trio.run(
            place, create_s, serve_s, within_s, clock=trio.testing.MockClock(autojump_threshold=0)
        )

    made = ({"result": {"session_id": "new-1"}}, {"new-1"})
    assert run(create_s=0.5, serve_s=0.5) == made
    assert run(create_s=0.5, serve_s=0.4, within_s=1.0) == made
    for late in (
        run(create_s=BOUND_S + 1, serve_s=0.0),  # made too late
        run(create_s=1.0, serve_s=BOUND_S),  # not served in time
        run(create_s=1.5, serve_s=0.0, within_s=1.0),  # the gateway's bound, below the TTL
    ):
        reply, kept = late
        assert reply["error"]["code"] == OWNER_UNREACHABLE, reply
        assert reply["error"]["data"] == {"outcome": NOT_DONE}, reply
        assert kept == set()


def test_a_withdrawn_placement_leaves_no_session_whichever_comes_first() -> None:
    """The gateway withdraws a placed create it gave up on (``session.create.withdrawn``
    with the create's ``placement``), and the two may be taken up here in either order:
    withdrawn first, nothing is made; withdrawn while the session is being made, or after
    it was answered (the answer late: this host stalled), the session is deleted, once.
    Before, a session answered in time stayed however late its answer arrived."""

    async def place(withdrawn: str) -> tuple[Any, list[str], bool, bool]:
        gateway = _Gateway()
        host = _PlacedHost()
        cast(Any, gateway).host = host
        creating, release = trio.Event(), trio.Event()

        async def create(connection: Any, params: dict[str, Any]) -> Any:
            creating.set()
            await release.wait()
            return {"session_id": "new-1"}

        gateway.methods["session.create"] = create
        desk = OwnerDesk(
            cast(Gateway, gateway), {"s1"}.__contains__, _served_at_once, bound_s=BOUND_S
        )
        placed = {
            "method": "session.create",
            "params": {},
            "principal": "alice",
            "within_s": 1.0,
            "placement": "p1",
        }
        withdrawal = {"method": WITHDRAWN_METHOD, "params": {"placement": "p1"}, "principal": "a"}
        found: dict[str, Any] = {}

        async def create_it() -> None:
            found["reply"] = await desk.for_host(placed, Answering())

        async def withdraw() -> None:
            found["withdrawn"] = await desk.for_host(withdrawal, Answering())

        async with trio.open_nursery() as nursery:
            if withdrawn == "first":
                await withdraw()
            nursery.start_soon(create_it)
            if withdrawn == "while made":
                await creating.wait()
                await withdraw()
            release.set()
        if withdrawn == "after":
            await withdraw()
            await withdraw()  # again: nothing more to undo
        return found["reply"], host.deleted, creating.is_set(), found["withdrawn"]

    def run(withdrawn: str) -> tuple[Any, list[str], bool, bool]:
        return trio.run(place, withdrawn, clock=trio.testing.MockClock(autojump_threshold=0))

    reply, deleted, created, withdrawn = run("first")
    assert reply["error"]["data"] == {"outcome": NOT_DONE}, reply
    assert (deleted, created) == ([], False)
    reply, deleted, created, withdrawn = run("while made")
    assert reply["error"]["data"] == {"outcome": NOT_DONE}, reply
    assert deleted == ["new-1"]
    reply, deleted, created, withdrawn = run("after")
    assert reply == {"result": {"session_id": "new-1"}}  # answered in time, arrived late
    assert deleted == ["new-1"]
    assert withdrawn == {"result": {"withdrawn": True}}


async def _served_at_once(_session_id: str) -> None:
    await trio.lowlevel.checkpoint()


class _PlacingRequests:
    """A placed host's answer, and the bound the gateway waited for it with."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.asked: list[tuple[float, float]] = []

    async def request_host(
        self, host_id: str, message: dict[str, Any], *, timeout_s: float
    ) -> dict[str, Any]:
        self.asked.append((message["within_s"], timeout_s))
        return self.reply


def test_a_gateway_waits_longer_than_the_placed_host_may_take_and_heeds_its_outcome() -> None:
    """The gateway gives the placed host ``within_s`` (its own bound on a forwarded call)
    and waits a margin longer, so the placed host's answer is heard. Nothing kept
    there: the session is created here (None). In doubt (the placed host stopped while
    it created it): a 503 in doubt, not a second session here."""

    async def place(reply: dict[str, Any]) -> tuple[Any, list[tuple[float, float]]]:
        requests = _PlacingRequests(reply)
        registry = _Registry(
            [HostRecord(host_id="a", load=1), HostRecord(host_id="b", load=0, placeable=True)]
        )
        async with trio.open_nursery() as nursery:
            router = _placing_router(nursery, requests, registry)
            try:
                placed = await router.place(cast(GatewayConnection, _Caller()), {})
            except jsonrpc.RpcError as exc:
                placed = {"code": exc.code, "data": exc.data}
        return placed, requests.asked

    def cut(outcome: str) -> dict[str, Any]:
        return {"error": {"code": OWNER_UNREACHABLE, "message": "m", "data": {"outcome": outcome}}}

    placed, asked = trio.run(place, {"result": {"session_id": "made-on-b"}})
    assert placed == {"session_id": "made-on-b"}
    ((within_s, waited_s),) = asked
    assert within_s == BOUND_S and waited_s > within_s
    assert trio.run(place, cut(NOT_DONE))[0] is None
    assert trio.run(place, cut(IN_DOUBT))[0] == {
        "code": OWNER_UNREACHABLE,
        "data": {"outcome": IN_DOUBT},
    }


class _ClosingDirectory:
    """A session's directory entry, read once as its owner's and then as closed (its owner
    closed and released it between the reads)."""

    def __init__(self, *, closes: bool) -> None:
        self.reads = 0
        self.closes = closes

    async def get(self, session_id: str) -> dict[str, Any]:
        self.reads += 1
        entry: dict[str, Any] = {"host": "c", "principals": ["alice"]}
        if self.closes and self.reads > 1:
            entry["closed"] = True
        return entry


class _NoResponders:
    async def request(
        self, session_id: str, message: dict[str, Any], *, timeout_s: float
    ) -> dict[str, Any]:
        raise OwnerUnreachable(session_id, timeout_s, in_doubt=False)


class _Owned:
    def owned(self, client_id: str) -> frozenset[str]:
        return frozenset()


def test_a_call_whose_owner_released_the_session_meanwhile_opens_it_here() -> None:
    """R-CLUSTER-1, R-TREE-4: a call routed by an entry that named its owner reaches no
    host, the owner having closed the session (a subagent that just finished) and
    released it meanwhile: read again, the entry says closed, and the session is opened
    here and answered as a closed session is (before: a 503 ``try again shortly``). When
    the entry is still not closed, the 503 stands, nothing done."""

    async def call(closes: bool) -> tuple[Any, list[str], int]:
        directory = _ClosingDirectory(closes=closes)
        reopened: list[str] = []

        async def reopen(session_id: str, entry: dict[str, Any]) -> bool:
            reopened.append(session_id)
            return True

        async def local(connection: Any, params: dict[str, Any]) -> Any:
            return {"queued": False, "here": True}

        async with trio.open_nursery() as nursery:
            router = _placing_router(
                nursery,
                _NoResponders(),
                None,
                gateway=_Owned(),
                directory=directory,
                reopen=reopen,
            )
            params = {"session_id": "s1", "input": "anything else?"}
            try:
                answer = await router.handle(
                    cast(GatewayConnection, _Caller()), "steer", params, local
                )
            except jsonrpc.RpcError as exc:
                answer = {"code": exc.code, "data": exc.data}
        return answer, reopened, directory.reads

    assert trio.run(call, True) == ({"queued": False, "here": True}, ["s1"], 2)
    assert trio.run(call, False) == (
        {"code": OWNER_UNREACHABLE, "data": {"outcome": NOT_DONE}},
        [],
        2,
    )


def test_a_handed_session_is_taken_with_the_rest_of_its_tree() -> None:
    """R-DRAIN-2, R-TREE-2: ``session.take`` hands the taking host the session and the
    rest of its tree (``with``, none when absent); a ``with`` that is not a list of ids is
    refused, nothing taken."""
    taken: list[tuple[str, list[str]]] = []

    async def takes(session_id: str, with_ids: list[str]) -> bool:
        taken.append((session_id, with_ids))
        return True

    async def main() -> list[dict[str, Any]]:
        async def until_serving(_session_id: str) -> None:
            pass

        gateway = cast(Gateway, _Gateway())
        desk = OwnerDesk(gateway, set().__contains__, until_serving, bound_s=BOUND_S, takes=takes)
        replies = []
        for params in (
            {"session_id": "s1"},
            {"session_id": "root", "with": ["payer", "collector"]},
            {"session_id": "root", "with": "payer"},
        ):
            message = {"method": HAND_OVER_METHOD, "params": params, "principal": ""}
            replies.append(await desk.for_host(message, Answering()))
        return replies

    alone, tree, bad = trio.run(main)
    assert alone == tree == {"result": {"taken": True}}
    assert taken == [("s1", []), ("root", ["payer", "collector"])]
    assert bad["error"]["code"] == jsonrpc.INVALID_REQUEST
    assert "with is a list of ids" in bad["error"]["message"]
