"""``@server:uri`` in the gateway's input (R-MCP-5): the resource is read through the
session's own MCP server (a real one, ``tests/support/mcp_server.py``, built with the
official SDK) where ``run``, ``steer`` and ``follow_up`` take their input, so every
websocket client — the console too — gets it. Real server on 127.0.0.1 port 0, real
websocket clients, scripted models; every wait bounded."""

from __future__ import annotations

from typing import Any

import trio
from conftest import last_user, texts_of

from greenroom.actors.providers.scripted import Reply, text
from tests.test_gateway import ALICE, BOB, connect, serving
from tests.test_mcp import stdio

BOUND_S = 60.0  # each session starts an MCP server process: slow on a busy machine

NOTES = (
    '<attachment source="@t:greenroom://notes">\n'
    "[resource greenroom://notes of MCP server 't']\n"
    "the notes say: ship on Friday\n</attachment>"
)


def replies() -> list[Reply]:
    return [Reply(blocks=(text(f"answer {n}"),)) for n in range(1, 5)]


def user_texts(outputs: list[dict[str, Any]]) -> list[list[str]]:
    return [[b["text"] for b in o["content"]] for o in outputs if o["type"] == "user_msg"]


async def test_run_attaches_resources_of_the_sessions_server(tmp_path: Any) -> None:
    """R-MCP-5: ``@t:greenroom://notes`` in ``run``'s input, a string or a text block, is
    followed by the resource's text, delimited; the ``user_msg`` outputs show it and the
    model gets it. A mention of no server of the session, or an e-mail address, is left
    alone."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, replies, approve="all", mcp_servers={"t": stdio()}) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            await client.result("session.subscribe", {"session_id": sid})
            await client.result("run", {"session_id": sid, "input": "read @t:greenroom://notes"})
            first = await client.outputs_until("task_end")
            assert user_texts(first) == [["read @t:greenroom://notes", NOTES]]
            request = server.providers[0].requests[0]
            assert texts_of(last_user(request))[-1] == NOTES

            blocks = [{"type": "text", "text": "mail a@t:x about @other:y"},
                      {"type": "text", "text": "@t:greenroom://notes"}]  # fmt: skip
            await client.result("run", {"session_id": sid, "input": blocks})
            second = await client.outputs_until("task_end")
            assert user_texts(second) == [
                ["mail a@t:x about @other:y", "@t:greenroom://notes", NOTES]
            ]


async def test_an_unreadable_mention_is_invalid_params_naming_it_and_nothing_runs(
    tmp_path: Any,
) -> None:
    """R-MCP-5: a resource the server cannot read is -32602 naming the block and the
    mention, for ``run``, ``steer`` and ``follow_up``; no task starts, nothing is
    recorded, and the session takes the corrected input."""
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, replies, approve="all", mcp_servers={"t": stdio()}) as server,
            connect(server) as client,
        ):
            sid = (await client.result("session.create"))["session_id"]
            error = await client.error("run", {"session_id": sid, "input": "@t:greenroom://nope"})
            assert error["code"] == -32602
            assert error["message"].startswith(
                "$.input: @t:greenroom://nope: MCP server 't' refused reading greenroom://nope"
            ), error
            bad = [{"type": "text", "text": "fine"}, {"type": "text", "text": "@t:greenroom://nope"}]
            for method in ("run", "steer", "follow_up"):
                error = await client.error(method, {"session_id": sid, "input": bad})
                assert error["code"] == -32602, (method, error)
                assert error["message"].startswith("$.input[1].text: @t:greenroom://nope: "), error
            assert server.providers[0].requests == []
            subscribed = await client.result("session.subscribe", {"session_id": sid})
            assert subscribed["replayed"] == 0  # nothing was recorded
            await client.result("run", {"session_id": sid, "input": "@t:greenroom://notes"})
            outputs = await client.outputs_until("task_end")
            assert user_texts(outputs) == [["@t:greenroom://notes", NOTES]]


async def test_a_principal_reads_through_its_own_sessions_servers_only(tmp_path: Any) -> None:
    """R-MCP-5, R-SEC-4: with ``"scope": "session"`` each session has its own server
    process; bob's mention in alice's session is refused (403) before anything is read,
    and bob's own mention reaches his session's server, not alice's (its read counter
    and process id are its own)."""
    servers = {"t": stdio(scope="session")}
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, replies, approve="all", mcp_servers=servers,
                    tokens={"alice": ALICE, "bob": BOB}) as server,
            connect(server, token=ALICE) as alice,
            connect(server, token=BOB) as bob,
        ):  # fmt: skip
            alice_sid = (await alice.result("session.create"))["session_id"]
            await alice.result("session.subscribe", {"session_id": alice_sid})
            refused = await bob.error(
                "run", {"session_id": alice_sid, "input": "@t:greenroom://counter"}
            )
            assert refused["code"] == 403
            await alice.result("run", {"session_id": alice_sid, "input": "@t:greenroom://counter"})
            alice_read = user_texts(await alice.outputs_until("task_end"))[0][1]
            assert "\nread 1 of process " in alice_read  # bob's refused call read nothing

            bob_sid = (await bob.result("session.create"))["session_id"]
            await bob.result("session.subscribe", {"session_id": bob_sid})
            await bob.result("run", {"session_id": bob_sid, "input": "@t:greenroom://counter"})
            bob_read = user_texts(await bob.outputs_until("task_end"))[0][1]
            assert "\nread 1 of process " in bob_read
            alice_pid = alice_read.split("of process ")[1].split()[0]
            assert bob_read.split("of process ")[1].split()[0] != alice_pid
