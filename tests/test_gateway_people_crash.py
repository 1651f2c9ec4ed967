"""A pending approval survives ``kill -9`` of ``greenroom serve`` (R-HITL-1, R-HITL-2,
R-HITL-4).

A real ``greenroom serve`` subprocess (its scripted model asks to call ``pay``, a tool that
appends a line to a file) and a real websocket client: the task waits for a person's
approval, the server is killed with SIGKILL, and started again on the same data dir. The
client connects to the new server: ``approvals.list`` shows the request (and another
principal neither sees nor answers it), ``approve`` answers it, the task ends and the tool
has run exactly once; a second answer is refused.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from test_cli import cli_env
from test_gateway import ALICE, BOB, BOUND_S, Client
from trio_websocket import open_websocket_url

from greenroom.protocols.people import arguments_digest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")

START_TIMEOUT_S = 60.0

APP = '''\
"""greenroom serve with a scripted model that pays once (the people crash test)."""

import sys

from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.context import ToolResult
from greenroom.protocols.tools import ToolContext, tool


@tool
async def pay(amount: int, ctx: ToolContext) -> str:
    """Pay an amount: one line in payments.txt of the workspace (a side effect)."""
    with open(ctx.workspace_dir / "payments.txt", "a", encoding="utf-8") as f:
        f.write(f"{ctx.call_id} {amount}\\n")
    return f"paid {amount}"


async def brain(request, stream):
    if any(isinstance(part, ToolResult) for part in request.messages[-1].content):
        await stream.text("Paid.")
        await stream.end()
        return
    await stream.tool_call(ToolCallBlock(id="p1", name="pay", arguments={"amount": 7}))
    await stream.end("tool_use")


if __name__ == "__main__":
    import greenroom.actors.runtime.provider_clients as clients
    from greenroom.actors.apps.cli import main
    from greenroom.actors.providers.scripted import ScriptedProvider

    clients.make_provider = lambda settings: ScriptedProvider(brain)
    sys.exit(main(sys.argv[1:]))
'''


class Serving:
    """``greenroom serve`` on the test's data dir, started as often as the test asks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.app = root / "people_app.py"
        self.app.write_text(APP, encoding="utf-8")
        self.workspace = root / "workspace"
        self.workspace.mkdir()
        self.tokens = root / "tokens"
        self.tokens.write_text(f"alice {ALICE}\nbob {BOB}\n", encoding="utf-8")

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[tuple[trio.Process, str]]:
        """The server and its websocket URL, once it listens; killed at exit if alive."""
        command = [
            sys.executable, str(self.app), "serve", "--port", "0", "--no-console",
            "--tokens-file", str(self.tokens), "--data-dir", str(self.root / "data"),
            "--workspace", str(self.workspace), "--no-builtin-tools", "--tools", str(self.app),
        ]  # fmt: skip
        process = await trio.lowlevel.open_process(
            command, env=cli_env(self.root), stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        try:
            assert process.stderr is not None
            seen = b""
            with trio.fail_after(START_TIMEOUT_S):
                while b"/v1" not in seen:
                    chunk = await process.stderr.receive_some()
                    assert chunk, f"serve exited early: {seen.decode(errors='replace')}"
                    seen += chunk
            match = re.search(rb"ws://[\w.:\[\]]+/v1", seen)
            assert match is not None, seen
            yield process, match.group().decode()
        finally:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()

    def payments(self) -> list[str]:
        path = self.workspace / "payments.txt"
        return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


@asynccontextmanager
async def client(url: str, token: str) -> AsyncIterator[Client]:
    headers = [(b"Authorization", f"Bearer {token}".encode())]
    async with open_websocket_url(
        url, extra_headers=headers, connect_timeout=BOUND_S, disconnect_timeout=BOUND_S
    ) as ws:
        yield Client(ws)


async def test_a_request_survives_sigkill_and_is_approved_after_the_restart(
    tmp_path: Path,
) -> None:
    serving = Serving(tmp_path)
    with trio.fail_after(START_TIMEOUT_S * 3):
        async with serving.serve() as (process, url):
            async with client(url, ALICE) as alice:
                sid = (await alice.result("session.create"))["session_id"]
                await alice.result("session.subscribe", {"session_id": sid})
                await alice.result("run", {"session_id": sid, "input": "pay the invoice"})
                request = (await alice.outputs_until("approval_request"))[-1]
                assert (request["call_id"], request["arguments"]) == ("p1", {"amount": 7})
                # The request is in the trace (outputs are sent once traced): kill now.
                process.kill()
                assert await process.wait() == -signal.SIGKILL
            assert serving.payments() == []
        meta = json.loads((tmp_path / "data" / "sessions" / sid / "session.json").read_text())
        assert meta["settings"]["approval_timeout_s"] is None  # serve waits without limit

        async with serving.serve() as (process, url):
            async with client(url, ALICE) as alice, client(url, BOB) as bob:
                # Taken up by the server as it started (R-HITL-4), before any call loads it.
                (entry,) = (await alice.result("session.list"))["sessions"]
                assert (entry["open"], entry["state"]) == (True, "waiting_for_approval")
                (listed,) = (await alice.result("approvals.list"))["approvals"]
                digest = arguments_digest({"amount": 7})
                assert listed == {
                    "session_id": sid,
                    "call_id": "p1",
                    "tool": "pay",
                    "arguments": {"amount": 7},
                    "asked_at": request["asked_at"],
                    "origin": [sid],
                    "kind": "approval",
                    "digest": digest,
                }
                assert await bob.result("approvals.list") == {"approvals": []}
                allow = {"session_id": sid, "call_id": "p1", "decision": "allow", "digest": digest}
                assert (await bob.error("approve", allow))["code"] == 403
                assert serving.payments() == []

                await alice.result(
                    "session.subscribe", {"session_id": sid, "after_seq": request["seq"]}
                )
                assert await alice.result("approve", allow) == {}
                after = await alice.outputs_until("task_end")
                (decision,) = [o for o in after if o["type"] == "approval_decision"]
                assert (decision["by"], decision["principal"]) == ("client", "alice")
                (result,) = [o for o in after if o["type"] == "tool_call_output"]
                assert result["status"] == "ok"
                assert after[-1]["status"] == "completed"
                assert serving.payments() == ["p1 7"]
                again = await alice.error("approve", allow)
                assert again["code"] == 409
                assert (await alice.result("approvals.list"))["approvals"] == []
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    assert serving.payments() == ["p1 7"]
    # The trace holds one decision and one result for the call, in order.
    records = [
        json.loads(line)
        for trace in sorted((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
        for line in trace.read_text(encoding="utf-8").splitlines()
    ]
    kinds = [r["type"] for r in records if r.get("call_id") == "p1"]
    assert kinds == ["approval_request", "approval_decision", "tool_call_output"], kinds
