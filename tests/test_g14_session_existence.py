"""Another principal's session answers 403 on every call, an unknown one 404 (R-SEC-4,
CONTRACT's codes), and an AG-UI thread of another principal is never taken over or created
anew. Real gateway on port 0, real websocket and HTTP clients, scripted models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from conftest import Lookup
from test_gateway import BOUND_S, Client, connect, lookup_script, serving
from test_gateway_ag_ui import posted, run_input

from greenroom.protocols import jsonrpc

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"
TOKENS = {"alice": ALICE, "bob": BOB}
UNKNOWN = "20990101-000000-abcdef"

CALLS: list[tuple[str, dict[str, Any]]] = [
    ("session.subscribe", {}),
    ("session.fork", {}),
    ("session.rewind", {"to_seq": 1}),
    ("run", {"input": "x"}),
    ("steer", {"input": "x"}),
    ("follow_up", {"input": "x"}),
    ("approvals.list", {}),
    ("approve", {"call_id": "c1", "decision": "allow"}),
    ("answer", {"call_id": "c1", "text": "x"}),
    ("interrupt", {}),
    ("compact", {}),
    ("skip_reconnect_wait", {}),
    ("retry_auth", {}),
]


async def refusal(client: Client, method: str, session_id: str, params: dict[str, Any]) -> Any:
    """The error ``method`` answers for ``session_id``, with the id written as ``ID``."""
    error = await client.error(method, {"session_id": session_id, **params})
    return {**error, "message": error["message"].replace(session_id, "ID")}


async def test_another_principals_session_answers_403_on_every_call(tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, tokens=TOKENS) as server,
            connect(server, token=ALICE) as alice,
            connect(server, token=BOB) as bob,
        ):
            sid = (await alice.result("session.create"))["session_id"]
            assert len(sid) == len(UNKNOWN)  # the messages quote ids of one length
            for method, params in CALLS:
                theirs = await refusal(bob, method, sid, params)
                unknown = await refusal(bob, method, UNKNOWN, params)
                assert theirs["code"] == jsonrpc.FORBIDDEN, (method, theirs)
                assert theirs["message"] == "session 'ID' belongs to another client", method
                assert unknown["code"] == jsonrpc.NOT_FOUND, (method, unknown)
                assert unknown["message"] == "no session 'ID'", (method, unknown)
            # Alice's own session is untouched and still hers.
            listed = await alice.result("session.list")
            assert [s["session_id"] for s in listed["sessions"]] == [sid]
            assert await bob.result("session.list") == {"sessions": []}


async def test_an_ag_ui_thread_of_another_principal_answers_403_and_is_not_taken(
    tmp_path: Path, lookup: Lookup
) -> None:
    with trio.fail_after(BOUND_S):
        async with serving(
            tmp_path, lookup_script, tools=[lookup.tool], ag_ui=True, tokens=TOKENS
        ) as server:
            url = f"http://127.0.0.1:{server.gateway.port}/ag-ui"
            mine = await posted(url, run_input("alices", "r1", "go"), token=ALICE)
            assert mine.events[-1][1]["outcome"]["type"] == "interrupt"
            resume = [{"interruptId": "c1", "status": "resolved", "payload": {"decision": "allow"}}]
            for body, headers in (
                (run_input("alices", "r2", "hi"), {}),
                (run_input("alices", "r3"), {"Last-Event-ID": "0"}),
                (run_input("alices", "r4", resume=resume), {}),
            ):
                other = await posted(url, body, token=BOB, headers=headers)
                assert other.status == 403, other
                assert "belongs to another client" in other.body["error"]["message"], other
            assert lookup.calls == []
            async with connect(server, token=BOB) as bob:
                assert await bob.result("session.list") == {"sessions": []}
