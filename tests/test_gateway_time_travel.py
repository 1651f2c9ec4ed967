"""``session.fork`` and ``session.rewind`` over the websocket gateway (R-FORK-1, R-FORK-2):
a real server, real clients, scripted models; every wait bounded, no sleeps."""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import Gates
from test_gateway import ALICE, BOB, BOUND_S, connect, serving, traced_seqs

from greenroom.actors.providers.scripted import Reply, ScriptStep, text, tool_call
from greenroom.protocols import jsonrpc


def answers() -> list[ScriptStep]:
    return [Reply(blocks=(text(f"{n} answer"),)) for n in ("first", "second", "third")]


async def test_fork_belongs_to_the_caller_and_rewind_reaches_subscribers(tmp_path: Path) -> None:
    """A fork of a session the caller owns is the caller's (listed, usable); another
    client may not fork it (403); a rewind is seen by subscribers as a ``rewind`` output
    and the next task continues from the rewound history; bad points are -32602."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, answers, tokens={"alice": ALICE, "bob": BOB}) as server,
            connect(server, token=ALICE, client_id="alice") as alice,
            connect(server, token=BOB, client_id="bob") as bob,
        ):
            sid = (await alice.result("session.create"))["session_id"]
            await alice.result("session.subscribe", {"session_id": sid})
            await alice.result("run", {"session_id": sid, "input": "one"})
            first = await alice.outputs_until("task_end")
            first_end = first[-1]["seq"]
            await server.host.get_session(sid).wait_idle()
            await alice.result("run", {"session_id": sid, "input": "two"})
            second = await alice.outputs_until("task_end")
            await server.host.get_session(sid).wait_idle()

            forked = await alice.result("session.fork", {"session_id": sid, "at_seq": first_end})
            assert forked["seq"] == first_end and forked["session_id"] != sid
            listed = await alice.result("session.list")
            assert forked["session_id"] in {s["session_id"] for s in listed["sessions"]}
            assert (await bob.error("session.fork", {"session_id": sid}))["code"] == 403
            missing = await alice.error("session.fork", {"session_id": "20990101-000000-abcdef"})
            assert missing["code"] == 404
            past = await alice.error("session.fork", {"session_id": sid, "at_seq": 10_000})
            assert past["code"] == jsonrpc.INVALID_PARAMS
            assert past["message"].startswith("$.at_seq: seq 10000 is out of range")
            async with connect(server, token=ALICE, client_id="alice") as watcher:
                await watcher.result("session.subscribe", {"session_id": forked["session_id"]})
                replayed = watcher.take_outputs()
                assert traced_seqs(replayed) == traced_seqs(first)
                assert {o["session_id"] for o in replayed} == {forked["session_id"]}

            rewound = await alice.result("session.rewind", {"session_id": sid, "to_seq": first_end})
            (note,) = await alice.outputs_until("rewind")
            assert note["to_seq"] == first_end and note["seq"] == rewound["seq"]
            assert rewound["seq"] == second[-1]["seq"] + 1
            assert note["reason"] == "rewound by alice"
            await alice.result("run", {"session_id": sid, "input": "two again"})
            assert (await alice.outputs_until("task_end"))[-1]["status"] == "completed"
            (provider,) = [p for p in server.providers if p.requests and p.requests[-1].messages]
            texts = [
                block.text
                for message in provider.requests[-1].messages
                for block in message.content
                if hasattr(block, "text")
            ]
            assert "two" not in texts and "second answer" not in texts
            assert texts[-1] == "two again"

            for params, path in [
                ({"session_id": sid}, "$.to_seq: required"),
                ({"session_id": sid, "to_seq": -1}, "$.to_seq: must be at least 0"),
                ({"session_id": sid, "to_seq": 10_000}, "$.to_seq: cannot rewind"),
            ]:
                error = await alice.error("session.rewind", params)
                assert error["code"] == jsonrpc.INVALID_PARAMS, error
                assert error["message"].startswith(path), error
            assert (await bob.error("session.rewind", {"session_id": sid, "to_seq": 0}))[
                "code"
            ] == 403


async def test_a_rewind_while_a_task_runs_is_409(tmp_path: Path, gates: Gates) -> None:
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
            busy = await client.error("session.rewind", {"session_id": sid, "to_seq": 0})
            assert busy["code"] == jsonrpc.BUSY
            gates.release("a")
            await client.outputs_until("task_end")
            await server.host.get_session(sid).wait_idle()
            assert (await client.result("session.rewind", {"session_id": sid, "to_seq": 0}))[
                "seq"
            ] > 0
