"""The console shows an agent tree and steers one node of it (R-TREE-1): the session list
nests each subagent under its parent (from ``session.list``'s ``parent_id``), folds and
unfolds a node's children, shows each node's state and tokens; selecting the grandchild watches it
alone and the prompt box steers it — its next model request carries the text.

Driven in headless Chromium like ``tests/test_console.py``; the tree is started by a
second client over a real websocket, with the scripted tree of ``test_gateway_tree``.
"""

from __future__ import annotations

from pathlib import Path

import trio
from conftest import Lookup
from test_console import (
    BROWSER_BOUND_S,
    SUBSCRIBED,
    TOKEN,
    chromium,
    needs_chromium,
    open_console,
    stack,
)
from test_gateway import Client
from test_gateway_tree import STEERING, Tree, wait
from trio_websocket import open_websocket_url

from greenroom.actors.runtime.subagents import spawn_subagent


def node(session_id: str) -> str:
    return f"li.tree-node[data-session-id='{session_id}']"


@needs_chromium
async def test_browser_nests_the_tree_folds_it_and_steers_the_grandchild(
    tmp_path: Path, lookup: Lookup
) -> None:
    tree = Tree()
    with trio.fail_after(BROWSER_BOUND_S):
        async with (
            stack(
                tmp_path, lambda: tree.brain, tools=[lookup.tool, spawn_subagent], approve="all"
            ) as server,
            open_websocket_url(
                server.gateway.url, extra_headers=[(b"Authorization", f"Bearer {TOKEN}".encode())]
            ) as ws,
            chromium(tmp_path) as page,
        ):
            other = Client(ws)
            root = (await other.result("session.create"))["session_id"]
            await other.result("run", {"session_id": root, "input": "go"})
            await wait(tree.grandchild_asking)
            listed = (await other.result("session.list"))["sessions"]
            child = next(s["session_id"] for s in listed if s["parent_id"] == root)
            grandchild = next(s["session_id"] for s in listed if s["parent_id"] == child)

            await open_console(page, server)
            # Nested: root > child > grandchild, the grandchild running.
            grand = " > ul.children > ".join(
                ["#sessions > " + node(root), node(child), node(grandchild)]
            )
            await page.wait_for(f"!!document.querySelector(`{grand}`)")
            assert await page.count("#sessions > li.tree-node") == 1
            assert await page.texts(f"{grand} button.node .state") == ["running"]

            # Fold the root: its subtree is hidden; unfold: shown again.
            toggle = f"{node(root)} > .node-row > button.toggle"
            assert await page.js(f"document.querySelector(`{toggle}`).ariaExpanded") == "true"
            await page.click(toggle)
            await page.wait_for(f"document.querySelector(`{node(root)} > ul.children`).hidden")
            assert await page.js(f"document.querySelector(`{toggle}`).ariaExpanded") == "false"
            await page.click(toggle)
            await page.wait_for(f"!document.querySelector(`{node(root)} > ul.children`).hidden")

            # Select the grandchild: the page watches it; the prompt box steers it.
            await page.click(f"{grand} button.node")
            await page.wait_for(f"{SUBSCRIBED} === '{grandchild}'")
            assert await page.js("document.querySelector('#send').textContent") == "Steer"
            await page.type_and_send(STEERING)
            await page.wait_for(
                "!!document.querySelector('[data-type=user_msg][data-state=queued]')"
            )
            tree.grandchild_go.set()
            await page.wait_for("!!document.querySelector('[data-type=task_end]')")
            assert len(tree.grandchild_saw) == 1 and STEERING in tree.grandchild_saw[0]
            await other.result("interrupt", {"session_id": root})

            # Each node shows the tokens of its own requests, as session.list has them.
            listed = (await other.result("session.list"))["sessions"]
            tokens = {s["session_id"]: s["usage"]["tokens"] for s in listed}
            assert all(tokens[n] > 0 for n in (root, child, grandchild))
            # The scripted model has no price: its cost is unknown, never a guess.
            assert {s["usage"]["cost_usd"] for s in listed} == {None}
            await page.js("document.querySelector('#refresh').click()")
            for session_id in (root, child, grandchild):
                shown = f"{node(session_id)} > .node-row button.node .tokens"
                await page.wait_for(
                    f"document.querySelector(`{shown}`)?.dataset.tokens === '{tokens[session_id]}'"
                )
                cost = f"{node(session_id)} > .node-row button.node .cost"
                assert await page.texts(cost) == ["cost unknown"]
