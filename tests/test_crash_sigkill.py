"""SIGKILL in the middle of work, then restart (R-TRACE-1..4, R-RUN-8, R-SEC-1).

``greenroom serve`` (driven over the websocket) and ``greenroom run --json`` are killed with
SIGKILL at moments a seeded generator picks — counted in outputs the client has read, so a
kill lands while text streams, between a tool call and its result, during a fsync or
between tasks. The model is a scripted one that, three times per task, writes a sentence
and calls ``append_mark``, a side-effecting tool that appends its call id to a file. After
every kill the data dir must show:

* every trace line parses, and ``seq`` runs 1, 2, 3… with no gap (R-TRACE-1);
* every output the client saw is in the trace, as it saw it (R-RUN-8);
* no ``task_start`` without its ``user_msg`` stored before it (R-TRACE-3);
* the marks file holds each call id at most once, and only ids of calls the trace holds:
  no side effect ran twice or before its call was durable (R-TRACE-2);
* loading the session pairs every tool call: the next request of a new task on it passes
  the scripted model's transcript checks (R-TRACE-4).

The next round continues from there: a ``run`` round continues the session the previous
``serve`` round created (a serve round starts a session of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import open_websocket_url

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.trace_sink import read_trace
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.converter import to_dict
from greenroom.protocols.outputs import ModelMsg, Output, TaskStart, UserMsg
from greenroom.protocols.trace import trace_file_number

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL (POSIX)")

SEED = 20261201
KILLS = 10
ROUND_TIMEOUT_S = 30.0
WHOLE_TIMEOUT_S = 150.0
LIVE_ONLY = {"partial_text", "partial_thinking", "partial_tool_call", "tool_progress"}

APP = '''\
"""greenroom with a scripted model that calls a side-effecting tool (the crash test)."""

import sys
import uuid

from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import AssistantMessage
from greenroom.protocols.tools import ToolContext, tool

STEPS = 3


@tool
async def append_mark(key: str, ctx: ToolContext) -> str:
    """Append this call's id to marks.txt in the workspace (a side effect)."""
    with open(ctx.workspace_dir / "marks.txt", "a", encoding="utf-8") as f:
        f.write(ctx.call_id + "\\n")
    return f"marked {key}"


async def brain(request, stream):
    steps = 0
    for message in reversed(request.messages):
        if isinstance(message, AssistantMessage):
            steps += 1
        elif any(isinstance(part, TextBlock) for part in message.content):
            break
    if steps < STEPS:
        await stream.text(
            f"Step {steps + 1}: I will put one more mark into the file now.",
            chunk_delay_s=0.002,
        )
        call = ToolCallBlock(
            id="m" + uuid.uuid4().hex[:12], name="append_mark", arguments={"key": str(steps)}
        )
        await stream.tool_call(call)
        await stream.end("tool_use")
        return
    await stream.text("Every mark is in the file, so the task is done.", chunk_delay_s=0.002)
    await stream.end()


if __name__ == "__main__":
    import greenroom.actors.runtime.provider_clients as host
    from greenroom.actors.apps.cli import main
    from greenroom.actors.providers.scripted import ScriptedProvider

    host.make_provider = lambda settings: ScriptedProvider(brain)
    sys.exit(main(sys.argv[1:]))
'''


class Crashes:
    """The data dir, the workspace and what clients saw, across every round."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.workspace = root / "workspace"
        self.workspace.mkdir()
        self.app = root / "crash_app.py"
        self.app.write_text(APP, encoding="utf-8")
        self.seen: dict[str, dict[int, dict[str, Any]]] = {}
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY")
        }
        self.env["GREENROOM_HOME"] = str(root / "home")
        self.env["NO_COLOR"] = "1"

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable,
            str(self.app),
            *args,
            "--data-dir",
            str(self.data),
            "--workspace",
            str(self.workspace),
            "--approve",
            "all",
            "--no-builtin-tools",
            "--tools",
            str(self.app),
        ]

    def saw(self, params: dict[str, Any]) -> None:
        if params.get("type") not in LIVE_ONLY:
            self.seen.setdefault(params["session_id"], {})[params["seq"]] = params

    # -- one round ----------------------------------------------------------------------------

    async def serve_round(self, budget: int) -> str:
        """Serve, create a session, run tasks over the websocket until ``budget`` output
        frames were read, SIGKILL. Returns the session id."""
        process = await trio.lowlevel.open_process(
            self.command("serve", "--port", "0", "--no-console"),
            env=self.env,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        try:
            assert process.stderr is not None
            seen = b""
            while b"/v1" not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            match = re.search(rb"ws://[\w.:\[\]]+/v1", seen)
            assert match is not None
            token = (self.data / "serve.token").read_text().strip()
            headers = [("Authorization", f"Bearer {token}")]
            session_id = ""
            with contextlib.suppress(Exception):  # the kill tears the connection down
                async with open_websocket_url(match.group().decode(), extra_headers=headers) as ws:
                    ids = iter(range(1, 1_000_000))

                    async def send(method: str, params: dict[str, Any]) -> int:
                        ident = next(ids)
                        frame = {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
                        await ws.send_message(json.dumps(frame))
                        return ident

                    async def answer(ident: int) -> dict[str, Any]:
                        while True:
                            frame = json.loads(await ws.get_message())
                            if frame.get("id") == ident:
                                assert "result" in frame, frame
                                return frame["result"]  # type: ignore[no-any-return]
                            if frame.get("method") == "output":
                                self.saw(frame["params"])

                    created = await answer(await send("session.create", {}))
                    session_id = created["session_id"]
                    await answer(await send("session.subscribe", {"session_id": session_id}))
                    task = 0
                    await send("run", {"session_id": session_id, "input": f"task {task}"})
                    outputs = 0
                    while outputs < budget:
                        frame = json.loads(await ws.get_message())
                        if frame.get("method") != "output":
                            continue
                        outputs += 1
                        self.saw(frame["params"])
                        if frame["params"]["type"] == "task_end":
                            task += 1  # keep it busy: the next task (a 409 is answered, ignored)
                            await send("run", {"session_id": session_id, "input": f"task {task}"})
                    process.kill()
                    await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()
        assert session_id
        return session_id

    async def run_round(self, session_id: str, budget: int, round_no: int) -> None:
        """``greenroom run --json --session ID`` until ``budget`` JSON lines were read (a
        finished run is followed by the next), SIGKILL."""
        outputs = 0
        task = 0
        while True:
            process = await trio.lowlevel.open_process(
                [*self.command("run", "--json", "--session", session_id), f"run {round_no}.{task}"],
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
            )
            assert process.stdout is not None
            pending = b""
            try:
                while outputs < budget:
                    chunk = await process.stdout.receive_some()
                    if not chunk:
                        break  # the task ended: start the next one
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.strip():
                            self.saw(json.loads(line))
                            outputs += 1
                if outputs >= budget:
                    process.kill()
                    await process.wait()
                    return
            finally:
                if process.returncode is None:
                    process.kill()
                await process.wait()
            task += 1

    # -- the checks after a kill --------------------------------------------------------------

    async def check(self) -> None:
        sessions = sorted(p.name for p in (self.data / "sessions").iterdir() if p.is_dir())
        trace_call_ids: set[str] = set()
        for session_id in sessions:
            trace_call_ids |= self.check_trace(session_id)
        marks = (
            (self.workspace / "marks.txt").read_text().split()
            if (self.workspace / "marks.txt").exists()
            else []
        )
        repeated = {m for m in marks if marks.count(m) > 1}
        assert not repeated, f"side effects repeated: {sorted(repeated)}"
        assert set(marks) <= trace_call_ids, "a mark for a call the trace does not hold"
        await self.check_reload(sessions)

    def check_trace(self, session_id: str) -> set[str]:
        directory = self.data / "sessions" / session_id
        files = sorted(
            (number, p) for p in directory.iterdir() if (number := trace_file_number(p.name))
        )
        records: list[Output] = []
        for _, path in files:
            result = read_trace(path)
            assert result.errors == [], [str(e) for e in result.errors]
            records.extend(result.records)
        seqs = [r.seq for r in records]
        assert seqs == list(range(1, len(seqs) + 1)), f"{session_id}: seq {seqs}"
        stored = {r.seq: json.loads(json.dumps(to_dict(r))) for r in records}
        for seq, params in sorted(self.seen.get(session_id, {}).items()):
            assert stored.get(seq) == params, f"{session_id}: seen but not stored: {params}"
        by_seq = {r.seq: r for r in records}
        for record in records:
            if isinstance(record, TaskStart):
                prompt = by_seq.get(record.input_seq)
                assert isinstance(prompt, UserMsg), f"task_start {record.seq} without input"
                assert prompt.kind == "prompt" and prompt.seq is not None
                assert record.seq is not None and prompt.seq < record.seq
        return {
            r.block.id
            for r in records
            if isinstance(r, ModelMsg) and isinstance(r.block, ToolCallBlock)
        }

    async def check_reload(self, sessions: list[str]) -> None:
        """R-TRACE-4: each session loads with every call paired; the scripted model checks
        the transcript invariants on the request of a short task on it."""
        async with Host.open(self.data) as host:
            for session_id in sessions:
                provider = ScriptedProvider([Reply(blocks=(text("checked"),))])
                session = await host.load_session(session_id, provider=provider)
                assert session.load_errors == []
                outputs = [o async for o in session.run("check the context")]
                assert provider.violations == [], provider.violations
                assert outputs[-1].TYPE == "task_end"
                for output in outputs:
                    if output.TYPE not in LIVE_ONLY:
                        self.saw(json.loads(json.dumps(to_dict(output))))


async def test_sigkill_mid_run_loses_no_seen_output_and_repeats_no_side_effect(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    crashes = Crashes(tmp_path)
    started = time.monotonic()
    session_id = ""
    rounds: list[str] = []
    with trio.fail_after(WHOLE_TIMEOUT_S):
        for round_no in range(KILLS):
            budget = rng.randint(5, 120)
            with trio.fail_after(ROUND_TIMEOUT_S):
                if round_no % 3 == 2 and session_id:
                    await crashes.run_round(session_id, budget, round_no)
                    rounds.append(f"run@{budget}")
                else:
                    session_id = await crashes.serve_round(budget)
                    rounds.append(f"serve@{budget}")
                await crashes.check()
    seen = sum(len(v) for v in crashes.seen.values())
    marks = (crashes.workspace / "marks.txt").read_text().split()
    # The rounds did real work: outputs were seen and side effects ran.
    assert seen > KILLS * 5, (rounds, seen)
    assert len(marks) >= 3, (rounds, marks)
    assert time.monotonic() - started < WHOLE_TIMEOUT_S
