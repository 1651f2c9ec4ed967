"""R-HOST-5: generate_title is a separate one-shot call, outside history and trace."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import collect

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, ScriptedStream, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.protocols.context import ModelRequest, UserMessage
from greenroom.protocols.tools import tool

release = trio.Event()


@tool(parallel=True)
async def wait_for_release() -> str:
    """Blocks until the test releases it."""
    await release.wait()
    return "released"


async def test_title_is_one_shot_and_never_traced(tmp_path: Path) -> None:
    seen: list[ModelRequest] = []

    async def title_step(request: ModelRequest, stream: ScriptedStream) -> None:
        seen.append(request)
        await stream.text('"Quarterly sales by region"')
        await stream.end()

    provider = ScriptedProvider([Reply(blocks=(text("Sure."),)), title_step])
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=provider, workspace_dir=tmp_path)
        assert await session.generate_title() == ""  # nothing to title yet
        await collect(session.run("Summarize the sales per region"))
        trace_before = session.trace_path.read_text()
        context_before = list(session.transcript.messages)
        with trio.fail_after(10):
            title = await session.generate_title()
        assert title == "Quarterly sales by region"
        (request,) = seen
        assert request.system is None and request.tools == ()
        assert isinstance(request.messages[0], UserMessage)
        assert "Summarize the sales per region" in request.messages[0].content[0].text  # type: ignore[union-attr]
        assert session.transcript.messages == context_before
    assert session.trace_path.read_text() == trace_before
    with sqlite3.connect(tmp_path / "data" / "usage.sqlite") as db:
        kinds = [row[0] for row in db.execute("SELECT kind FROM usage ORDER BY id")]
    assert kinds == ["request", "title"]


async def test_title_does_not_wait_for_a_running_task(tmp_path: Path) -> None:
    from greenroom.actors.providers.scripted import tool_call

    provider = ScriptedProvider(
        [
            Reply(blocks=(text("Working."), tool_call("c1", "wait_for_release"))),
            Reply(blocks=(text("A title"),)),
            Reply(blocks=(text("Done."),)),
        ]
    )
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=provider, tools=[wait_for_release], workspace_dir=tmp_path
        )
        run = session.run("first prompt", approve=lambda call: "allow")
        async for output in run:
            if output.TYPE == "approval_decision":
                break
        with trio.fail_after(10):
            assert await session.generate_title() == "A title"
        assert session.busy
        release.set()
        outputs = await collect(run)
    assert outputs[-1].TYPE == "task_end" and outputs[-1].status == "completed"  # type: ignore[union-attr]


async def test_the_demo_model_answers_a_title_request_with_a_title(tmp_path: Path) -> None:
    """The built-in model (greenroom demo, serve's default) answers R-HOST-5's request
    with a title, not as if it were a prompt."""
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider="scripted", workspace_dir=tmp_path)
        await collect(session.run("Summarize the sales CSV files, please!"))
        assert await session.generate_title() == "Summarize the sales CSV files please"


async def test_a_title_too_long_is_cut_at_a_word_and_says_so(tmp_path: Path) -> None:
    """R-HOST-5: a title longer than ``max_chars`` ends with "…" where it was cut, at a
    word boundary (a single word too long is cut inside it)."""
    long = "Revenue, costs and margins per region: an overview of the whole year"
    provider = ScriptedProvider(
        [
            Reply(blocks=(text("Sure."),)),
            Reply(blocks=(text(long),)),
            Reply(blocks=(text("Supercalifragilisticexpialidocious"),)),
        ]
    )
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=provider, workspace_dir=tmp_path)
        await collect(session.run("Tell me about the year"))
        with trio.fail_after(10):
            title = await session.generate_title()
            word = await session.generate_title(max_chars=12)
    assert title == "Revenue, costs and margins per region: an overview of the…"
    assert len(title) <= 60
    assert word == "Supercalifr…"


async def test_a_title_whose_streamer_stops_as_it_starts_is_no_title_and_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-HOST-5, R-HOST-3: a title asked for as the host shuts down can find its streamer
    stopped as soon as it started (cancelled before it took the request; trio may run it
    before the caller resumes). That is no title, not a BrokenResourceError raised into
    the gateway's title task, which ended `greenroom serve` on its SIGINT with a
    traceback."""
    provider = ScriptedProvider([Reply(blocks=(text("Sure."),)), Reply(blocks=(text("T"),))])
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(provider=provider, workspace_dir=tmp_path)
        await collect(session.run("Summarize the sales per region"))

        async def stops_at_once(
            self: LLMStreamer,
            commands: trio.MemoryReceiveChannel[Any],
            *,
            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            task_status.started()
            commands.close()  # as its cancelled loop leaves it

        monkeypatch.setattr(LLMStreamer, "run", stops_at_once)
        with trio.fail_after(10):
            assert await session.generate_title() == ""
