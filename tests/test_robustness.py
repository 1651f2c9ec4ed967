"""Failures around the loop never take a session or the host down: a trace file that
cannot be written, a scratchpad that cannot be written, a subscriber that raises."""

from __future__ import annotations

import shutil
from pathlib import Path

import trio
from conftest import collect, of_type

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.protocols.outputs import TaskEnd, ToolCallOutput
from greenroom.protocols.tools import tool


@tool(parallel=True)
async def big() -> str:
    """Returns more than the result budget."""
    return "x" * 40_000


def allow(_: object) -> str:
    return "allow"


async def test_unwritable_trace_fails_the_task_not_the_host(tmp_path: Path) -> None:
    async with Host.open(tmp_path / "data") as host:
        broken = await host.create_session(
            provider=ScriptedProvider([Reply(blocks=(text("hi"),))]), workspace_dir=tmp_path
        )
        broken.trace_path.mkdir(parents=True)  # a directory where the file should be
        healthy = await host.create_session(
            provider=ScriptedProvider([Reply(blocks=(text("fine"),))]), workspace_dir=tmp_path
        )
        with trio.fail_after(10):
            failed = await collect(broken.run("hello"))
            ok = await collect(healthy.run("hello"))
    (end,) = of_type(failed, TaskEnd)
    assert end.status == "failed" and "trace" in (end.message or "").lower()
    assert of_type(ok, TaskEnd)[0].status == "completed"
    assert healthy.trace_path.read_text().count("\n") == len([o for o in ok if o.seq])


async def test_unwritable_scratchpad_gives_an_error_result(tmp_path: Path) -> None:
    provider = ScriptedProvider(
        [Reply(blocks=(tool_call("c1", "big"),)), Reply(blocks=(text("done"),))]
    )
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=provider, tools=[big], workspace_dir=tmp_path)
        shutil.rmtree(session.scratchpad_dir)
        session.scratchpad_dir.write_text("not a directory")
        with trio.fail_after(10):
            outputs = await collect(session.run("go", approve=allow))
    (result,) = of_type(outputs, ToolCallOutput)
    assert result.status == "error" and result.is_error
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert provider.violations == []


async def test_a_raising_subscriber_does_not_stop_the_run(tmp_path: Path) -> None:
    seen: list[int] = []

    def broken_listener(batch: list[object]) -> None:
        raise RuntimeError("listener bug")

    def counting_listener(batch: list[object]) -> None:
        seen.append(len(batch))

    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=ScriptedProvider([Reply(blocks=(text("hi"),))]), workspace_dir=tmp_path
        )
        session.subscribe(broken_listener)
        session.subscribe(counting_listener)
        with trio.fail_after(10):
            outputs = await collect(session.run("hello"))
    assert of_type(outputs, TaskEnd)[0].status == "completed"
    assert sum(seen) == len(outputs)
