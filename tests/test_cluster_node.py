"""What a host does with a session it takes over (R-CLUSTER-2, R-HITL-4), without NATS: the
trace as JetStream holds it is written into the new owner's data dir and the open task is
taken up by the runtime's resume, the path a restarted host takes. Each call that was
running is in doubt (R-EFFECT-2); with no check and nobody to ask (the host decides by
callback) it gets its host-lost result and is not run again (an idempotent tool's result
says a new call is safe), seq goes on without a gap and the task ends once; a finished
task gets nothing."""

from __future__ import annotations

import json
from pathlib import Path

import trio
from conftest import RUN_TIMEOUT_S, allow_all, open_host, trace_lines

from greenroom.actors.cluster.node import _materialize
from greenroom.actors.cluster.traces import TraceRead
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.protocols import markers
from greenroom.protocols.outputs import Output
from greenroom.protocols.tools import Tool, make_tool
from greenroom.protocols.trace import parse_trace


class Calls:
    """``pay`` and the idempotent ``fetch``: each records its start and blocks until the
    test ends, as a call does whose host is lost under it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.both = trio.Event()

        async def pay(note: str) -> str:
            """Pay."""
            return await self._block(note)

        async def fetch(note: str) -> str:
            """Fetch."""
            return await self._block(note)

        # side_effects: each call is durable in the trace before it starts (R-TRACE-2).
        self.tools: list[Tool] = [
            make_tool(pay, parallel=True, side_effects=True),
            make_tool(fetch, parallel=True, side_effects=True, idempotent=True),
        ]

    async def _block(self, note: str) -> str:
        self.started.append(note)
        if len(self.started) == 2:
            self.both.set()
        await trio.sleep_forever()
        return "never"


def _two_calls() -> list[Reply]:
    return [
        Reply(
            blocks=(
                text("Paying and fetching."),
                tool_call("c1", "pay", note="pay"),
                tool_call("c2", "fetch", note="fetch"),
            )
        )
    ]


async def _stored_on_a_lost_host(
    data_dir: Path, workspace: Path, replies: list[Reply], *, wait_for_calls: bool
) -> tuple[str, dict[str, object], list[Output], Calls]:
    """Run a task on a host and take its session's records as the cluster's trace holds
    them: while both calls run (the host is then lost), or once the task has ended."""
    calls = Calls()
    async with open_host(data_dir) as host:
        session = await host.create_session(
            provider=ScriptedProvider(replies), tools=calls.tools, workspace_dir=workspace
        )
        stream = session.run("pay and fetch", approve=allow_all)
        stream.detach()
        with trio.fail_after(RUN_TIMEOUT_S):
            if wait_for_calls:
                await calls.both.wait()
            else:
                await session.wait_idle()
        records = parse_trace(session.trace_path.read_text(), file="trace").records
        meta = json.loads((session.trace_path.parent / "session.json").read_text())
        session.interrupt("the test is over")
    return session.id, meta, records, calls


def _read(records: list[Output]) -> TraceRead:
    return TraceRead(
        records=tuple(records),
        current=tuple(records),
        file=1,
        last_sequence=len(records),
        files=((1, tuple(records)),),
    )


async def test_running_calls_get_host_lost_results_and_the_task_goes_on_once(
    tmp_path: Path, workspace: Path
) -> None:
    sid, meta, records, first = await _stored_on_a_lost_host(
        tmp_path / "a", workspace, _two_calls(), wait_for_calls=True
    )
    assert sorted(first.started) == ["fetch", "pay"]

    owner = tmp_path / "b"
    again = Calls()
    model = ScriptedProvider([Reply(blocks=(text("The payment may not have gone through."),))])
    async with open_host(owner) as host:
        await trio.to_thread.run_sync(
            _materialize, owner / "sessions" / sid, meta, _read(records)
        )
        session = await host.resume(sid, tools=again.tools, provider=model, approve=allow_all)
        with trio.fail_after(RUN_TIMEOUT_S):
            await session.wait_idle()
        lines = trace_lines(session)

    assert again.started == []  # neither call ran again
    resolved = [line for line in lines if line["type"] == "call_resolved"]
    assert [(r["call_id"], r["by"]) for r in resolved] == [("c1", "note"), ("c2", "note")]
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    types = [line["type"] for line in lines]
    assert types.count("task_start") == 1 and types.count("task_end") == 1
    assert lines[-1]["type"] == "task_end" and lines[-1]["status"] == "completed"
    results = {
        line["call_id"]: (line["status"], line["content"][0]["text"])
        for line in lines
        if line["type"] == "tool_call_output"
    }
    assert results == {
        "c1": ("interrupted", markers.HOST_LOST_TEXT),
        "c2": ("interrupted", markers.HOST_LOST_IDEMPOTENT_TEXT),
    }
    (request,) = model.requests
    assert markers.HOST_LOST_TEXT in str(request.messages)


async def test_a_finished_task_gets_nothing(tmp_path: Path, workspace: Path) -> None:
    replies = [
        Reply(blocks=(tool_call("c1", "missing_tool", note="x"),)),
        Reply(blocks=(text("Done."),)),
    ]
    sid, meta, records, _ = await _stored_on_a_lost_host(
        tmp_path / "a", workspace, replies, wait_for_calls=False
    )
    owner = tmp_path / "b"
    model = ScriptedProvider([])
    async with open_host(owner) as host:
        await trio.to_thread.run_sync(
            _materialize, owner / "sessions" / sid, meta, _read(records)
        )
        session = await host.resume(sid, tools=Calls().tools, provider=model)
        assert not session.busy
        lines = trace_lines(session)
    assert len(lines) == len(records) and lines[-1]["type"] == "task_end"
    assert model.requests == []
