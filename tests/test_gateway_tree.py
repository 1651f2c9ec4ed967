"""Every node of an agent tree is addressable through the gateway (R-TREE-1, R-TREE-2):
over a real websocket client, a root that spawns a child that spawns a grandchild; the
client lists the tree (``parent_id``, ``root_id``), steers the grandchild by its own id
and the grandchild's next model request carries the steering; subscribes to the
grandchild alone; interrupts the child with ``scope: "node"`` and the root goes on to
complete its task; another principal is refused every node of the tree.

One scripted brain serves every node (a subagent's system prompt starts with
``SUBAGENT_SYSTEM``; its task is its first user message). Nodes that must stay running wait
on ``trio.Event``s inside their model stream; the test waits on those events and on
outputs, never for a length of time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from conftest import Lookup, result_text, results_of, texts_of
from test_gateway import ALICE, BOB, BOUND_S, Client, connect, serving
from test_subagents import has_results, is_child, spawn, task_of

from greenroom.actors.providers.scripted import ScriptedStream, tool_call
from greenroom.actors.runtime.subagents import spawn_subagent
from greenroom.protocols.context import ModelRequest, UserMessage

TWO = {"alice": ALICE, "bob": BOB}
STEERING = "look under the floorboards instead"


class Tree:
    """The scripted tree: root → "child job" → "grandchild job". The grandchild waits in
    its first model request until released, then looks a key up; the child waits in its
    second request (after the grandchild answered) until it is interrupted."""

    def __init__(self) -> None:
        self.grandchild_asking = trio.Event()
        self.grandchild_go = trio.Event()
        self.child_waiting = trio.Event()
        self.grandchild_saw: list[str] = []
        self.root_saw: list[str] = []

    async def brain(self, request: ModelRequest, stream: ScriptedStream) -> None:
        if not is_child(request):
            if has_results(request):
                self.root_saw.extend(results_text(request))
                await stream.text("the root carried on")
            else:
                await stream.block(spawn("s1", "child job"))
        elif task_of(request) == "child job":
            if has_results(request):
                self.child_waiting.set()
                await trio.sleep_forever()  # until the client interrupts this node
            await stream.block(spawn("s2", "grandchild job"))
        elif has_results(request):
            self.grandchild_saw.append(_last_texts(request))
            await stream.text("the grandchild is done")
        else:
            self.grandchild_asking.set()
            await self.grandchild_go.wait()
            await stream.block(tool_call("c1", "lookup", key="a"))


def results_text(request: ModelRequest) -> list[str]:
    """The text of each tool result in the request's last message."""
    last = request.messages[-1]
    return [result_text(r) for r in results_of(last)] if isinstance(last, UserMessage) else []


def _last_texts(request: ModelRequest) -> str:
    last = request.messages[-1]
    return "\n".join(texts_of(last)) if isinstance(last, UserMessage) else ""


async def wait(event: trio.Event) -> None:
    with trio.fail_after(BOUND_S):
        await event.wait()


async def listed_tree(client: Client, root: str) -> dict[str, dict[str, Any]]:
    """The entries of ``session.list`` in ``root``'s tree, by session id."""
    listed = (await client.result("session.list"))["sessions"]
    return {s["session_id"]: s for s in listed if s["root_id"] == root}


async def test_a_client_steers_a_grandchild_interrupts_a_child_and_bob_is_refused(
    tmp_path: Path, lookup: Lookup
) -> None:
    tree = Tree()
    with trio.fail_after(BOUND_S * 2):
        async with (
            serving(
                tmp_path,
                lambda: tree.brain,
                tools=[lookup.tool, spawn_subagent],
                approve="all",
                tokens=TWO,
            ) as server,
            connect(server, token=ALICE) as alice,
            connect(server, token=ALICE) as watcher,
            connect(server, token=BOB) as bob,
        ):
            root = (await alice.result("session.create"))["session_id"]
            await alice.result("session.subscribe", {"session_id": root})
            await alice.result("run", {"session_id": root, "input": "go"})
            await wait(tree.grandchild_asking)

            # R-TREE-1: session.list shows the tree, each node with its parent and root.
            nodes = await listed_tree(alice, root)
            assert len(nodes) == 3, nodes
            assert nodes[root]["parent_id"] is None
            (child,) = [sid for sid, s in nodes.items() if s["parent_id"] == root]
            (grandchild,) = [sid for sid, s in nodes.items() if s["parent_id"] == child]
            assert nodes[grandchild]["state"] == "running" and nodes[grandchild]["open"]
            assert await listed_tree(bob, root) == {}

            # Another principal is refused every node, whatever the method.
            for method, params in [
                ("steer", {"input": "mine now"}),
                ("session.subscribe", {}),
                ("interrupt", {"scope": "node"}),
                ("approve", {"call_id": "c1", "decision": "allow"}),
                ("answer", {"call_id": "c1", "text": "no"}),
                ("approvals.list", {}),
            ]:
                for node in (grandchild, child):
                    refused = await bob.error(method, {"session_id": node, **params})
                    assert refused["code"] == 403, (method, node, refused)

            # Work is started on the root only: a node takes control calls.
            for method in ("run", "follow_up"):
                wrong = await alice.error(method, {"session_id": grandchild, "input": "x"})
                assert wrong["code"] == -32602 and "subagent" in wrong["message"], wrong
            # approve reaches the grandchild: nothing of its waits for a decision (409).
            stale = await alice.error(
                "approve", {"session_id": grandchild, "call_id": "zz", "decision": "allow"}
            )
            assert stale["code"] == 409, stale

            # A second connection watches the grandchild alone: its own outputs, no origin.
            subscribed = await watcher.result("session.subscribe", {"session_id": grandchild})
            assert subscribed["session_id"] == grandchild

            steered = await alice.result("steer", {"session_id": grandchild, "input": STEERING})
            assert steered == {"queued": True}
            tree.grandchild_go.set()

            ended = await watcher.outputs_until("task_end")
            assert all(o.get("origin") is None for o in ended)
            assert ended[-1]["session_id"] == grandchild
            assert ended[-1]["status"] == "completed"
            assert len(tree.grandchild_saw) == 1 and STEERING in tree.grandchild_saw[0]
            assert lookup.calls == ["a"]

            # R-TREE-2: a node-scoped interrupt ends the child; the root runs on.
            await wait(tree.child_waiting)
            bad = await alice.error("interrupt", {"session_id": child, "scope": "all"})
            assert bad["code"] == -32602 and "$.scope" in bad["message"]
            interrupted = await alice.result("interrupt", {"session_id": child, "scope": "node"})
            assert interrupted == {"interrupted": True}
            outputs = await alice.outputs_until("task_end", session_id=root)
            ends = {o["session_id"]: o["status"] for o in outputs if o["type"] == "task_end"}
            assert ends[child] == "aborted", ends
            assert ends[root] == "completed", ends
            # The root's spawning call failed with the child's end, and the root went on.
            assert tree.root_saw == [
                f"SubagentError: subagent {child} ended with status aborted: interrupted by client"
            ]

            # A finished node is still addressable: loaded, idle, nothing to steer.
            nodes = await listed_tree(alice, root)
            assert {s["state"] for s in nodes.values()} == {"idle"}
            assert await alice.result("steer", {"session_id": grandchild, "input": "too late"}) == {
                "queued": False
            }
