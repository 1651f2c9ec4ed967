"""An editor's prompt sent while its session has work steers that work (R-STEER-1, R-ACP-2),
and is answered at the end of the task that took it: the running one, a follow-up's
that was about to start, or the task of its own that steering too late for its task
becomes (R-STEER-6). The ACP agent in-process, with a scripted model; every order is
forced with events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import hold_after_first, trace_lines

from greenroom.actors.apps import acp as acp_app
from greenroom.actors.apps.acp import AcpConfig
from greenroom.actors.runtime.emitter import OutputEmitter
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.actors.scripted import Reply, ScriptedProvider, ScriptedStream, text
from greenroom.protocols import acp
from greenroom.protocols.content import TextBlock
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.converter import output_from_dict
from greenroom.protocols.outputs import Output, TaskEnd, UserMsg
from tests.test_acp_agent import TIMEOUT_S, Client, agent_on, said


def steering_accepted(monkeypatch: pytest.MonkeyPatch) -> list[trio.Event]:
    """One event per ``Session.steer`` the session accepted, set as it says True."""
    accepted: list[trio.Event] = [trio.Event() for _ in range(4)]
    steer = Session.steer
    count = 0

    def noted(self: Session, *args: Any, **kwargs: Any) -> bool:
        nonlocal count
        taken = steer(self, *args, **kwargs)
        if taken:
            accepted[count].set()
            count += 1
        return taken

    monkeypatch.setattr(Session, "steer", noted)
    return accepted


def last_said_to(request: ModelRequest) -> str:
    """The text of the last message the model was sent."""
    return "".join(p.text for p in request.messages[-1].content if isinstance(p, TextBlock))


async def new_session(client: Client, workspace: Path) -> str:
    created = await client.call("session/new", {"cwd": str(workspace), "mcpServers": []})
    sid: str = created["result"]["sessionId"]
    return sid


async def prompt(client: Client, sid: str, words: str) -> int:
    params = {"sessionId": sid, "prompt": [{"type": "text", "text": words}]}
    return await client.send("session/prompt", params)


def answered_after(client: Client, request_id: int, words: str) -> bool:
    """Whether the client read the answer to ``request_id`` after the chunk ``words``."""
    frames = client.frames
    answer = next(i for i, f in enumerate(frames) if f.get("id") == request_id)
    chunks = [
        i
        for i, f in enumerate(frames)
        if f.get("method") == "session/update"
        and f["params"]["update"].get("content", {}).get("text") == words
    ]
    return bool(chunks) and chunks[-1] < answer


@dataclass
class Steered:
    """A new session of the ACP agent in-process: its host, the editor's client, the
    session's id, and the events of the steers it accepts (``steering_accepted``)."""

    host: Host
    client: Client
    sid: str
    accepted: list[trio.Event]


@asynccontextmanager
async def steered_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provider: ScriptedProvider
) -> AsyncIterator[Steered]:
    """A new session of an ACP agent over ``provider`` (no tools) and a host of
    ``tmp_path / "data"``, for the block, which fails after TIMEOUT_S."""
    accepted = steering_accepted(monkeypatch)
    config = AcpConfig(provider=provider, tools=())
    with trio.fail_after(TIMEOUT_S):
        async with agent_on(tmp_path / "data", config) as (host, client):
            yield Steered(host, client, await new_session(client, tmp_path), accepted)


async def too_late_for_its_task(
    steered: Steered, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, int, trio.Event]:
    """Prompt "hello", then "also" while that task's end is written (the session still
    takes input), once the session accepted it as steering: the ids of the two prompts,
    and the event that lets the first task's end go on."""
    ending, let_end = hold_after_first(monkeypatch, OutputEmitter, "sync_task_end")
    first = await prompt(steered.client, steered.sid, "hello")
    await ending.wait()  # the task's end is written; the session still takes input
    late = await prompt(steered.client, steered.sid, "also")
    await steered.accepted[0].wait()
    return first, late, let_end


def late_steering_marks(session: Session) -> list[object]:
    """The ``late_steering`` of each ``task_queued`` of ``session``'s trace."""
    return [r.get("late_steering") for r in trace_lines(session) if r["type"] == "task_queued"]


async def test_steering_too_late_for_its_task_is_answered_at_the_end_of_the_task_it_became(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1, R-ACP-2: a prompt sent while the running task's end is written comes
    too late for that task and runs as a task of its own. It was answered at the end of
    the task it came for, "end_turn", before the model had seen it; now it is answered at
    the end of its own task, with that task's stop reason (a refusal), after its reply."""

    async def model(request: ModelRequest, stream: ScriptedStream) -> None:
        if last_said_to(request) == "hello":
            await stream.text("Hello.")
        else:
            await stream.text("Also.")
            await stream.end("refusal")

    provider = ScriptedProvider(model)
    async with steered_session(tmp_path, monkeypatch, provider) as steered:
        client = steered.client
        first, late, let_end = await too_late_for_its_task(steered, monkeypatch)
        let_end.set()
        assert (await client.answer_of(first))["result"]["stopReason"] == "end_turn"
        assert (await client.answer_of(late))["result"]["stopReason"] == "refusal"
        assert answered_after(client, late, "Also.")
        session = steered.host.get_session(steered.sid)
    assert late_steering_marks(session) == [True]
    assert provider.violations == []


async def test_a_prompt_during_a_late_steering_task_joins_it_and_both_are_answered_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1, R-ACP-2: a prompt too late for its task runs as a task of its own; a
    second prompt sent while that task runs steers it. The second ran as a task of its
    own after it, as nothing of the connection's was seen to run; now the two prompts are
    one task, and both are answered at its end with its stop reason (a refusal) and its
    usage, after its reply."""
    late_started, go = trio.Event(), trio.Event()

    async def model(request: ModelRequest, stream: ScriptedStream) -> None:
        words = last_said_to(request)
        if words == "hello":
            await stream.text("Hello.")
        elif words == "also":
            late_started.set()
            await go.wait()
            await stream.text("Also.")
        else:
            assert "more" in words, words  # the second prompt, as steering
            await stream.text("More.")
            await stream.end("refusal")

    provider = ScriptedProvider(model)
    async with steered_session(tmp_path, monkeypatch, provider) as steered:
        client = steered.client
        first, late, let_end = await too_late_for_its_task(steered, monkeypatch)
        let_end.set()
        assert (await client.answer_of(first))["result"]["stopReason"] == "end_turn"
        await late_started.wait()
        more = await prompt(client, steered.sid, "more")
        await trio.testing.wait_all_tasks_blocked()
        assert steered.accepted[1].is_set(), "the second prompt steers the task the first became"
        go.set()
        answers = [(await client.answer_of(request))["result"] for request in (late, more)]
        assert said(client) == "Hello.Also.More."
        assert answered_after(client, late, "More.") and answered_after(client, more, "More.")
        session = steered.host.get_session(steered.sid)
    ends = [r for r in trace_lines(session) if r["type"] == "task_end"]
    assert [end["status"] for end in ends] == ["completed", "completed"]
    end = output_from_dict(ends[1])
    assert isinstance(end, TaskEnd)
    usage = acp.prompt_usage(end.usage)
    assert answers == [{"stopReason": "refusal", "usage": usage}] * 2
    assert late_steering_marks(session) == [True]
    assert provider.violations == []


async def test_steering_too_late_for_its_task_and_dropped_by_an_interrupt_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1, R-ABORT-1, R-ACP-2: a prompt too late for its task is queued as a task of
    its own, and session/cancel drops it before it starts. It was answered with the end
    of the task it came for ("end_turn"), as if it had run; now it is answered
    "cancelled", and the model never sees it."""
    provider = ScriptedProvider(lambda request: _hello(request))
    async with steered_session(tmp_path, monkeypatch, provider) as steered:
        client, sid = steered.client, steered.sid
        first, late, let_end = await too_late_for_its_task(steered, monkeypatch)
        await client._write(
            {"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": sid}}
        )
        await trio.testing.wait_all_tasks_blocked()  # the interrupt reached the session
        let_end.set()
        assert (await client.answer_of(first))["result"]["stopReason"] == "end_turn"
        assert (await client.answer_of(late))["result"] == {"stopReason": "cancelled"}
        session = steered.host.get_session(sid)
    assert [r["type"] for r in trace_lines(session)].count("task_queue_dropped") == 1
    assert len(provider.requests) == 1 and provider.violations == []


def _hello(request: ModelRequest) -> Reply:
    assert last_said_to(request) == "hello"
    return Reply(blocks=(text("Hello."),))


async def test_a_prompt_between_a_task_and_a_queued_follow_up_steers_the_follow_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-STEER-1, R-STEER-6, R-ACP-2: a prompt sent after the editor read a task's end,
    while the follow-up it queued behind that task is starting, finds the session busy
    with that work: it steers the follow-up's task and is answered at its end. It ran as
    a task of its own after the follow-up's, where one sent a moment later joined it."""

    async def model(request: ModelRequest, stream: ScriptedStream) -> None:
        words = last_said_to(request)
        if words == "hello":
            follow_up_asked.set()
            await go.wait()
        await stream.text({"hello": "Hello.", "and then?": "Then."}.get(words, "Noted."))

    follow_up_asked, go, gap, leave_gap = trio.Event(), trio.Event(), trio.Event(), trio.Event()
    read = acp_app._OutputImages.read

    async def held_before_the_follow_up_starts(images: Any, output: Output) -> None:
        if isinstance(output, UserMsg) and output.queued_id is not None and not gap.is_set():
            gap.set()  # the pump has read the first task's end, not the follow-up's start
            await leave_gap.wait()
        await read(images, output)

    monkeypatch.setattr(acp_app._OutputImages, "read", held_before_the_follow_up_starts)
    provider = ScriptedProvider(model)
    async with steered_session(tmp_path, monkeypatch, provider) as steered:
        client, sid = steered.client, steered.sid
        first = await prompt(client, sid, "hello")
        await follow_up_asked.wait()
        then = [{"type": "text", "text": "and then?"}]
        follow_up = await client.send("_greenroom/follow_up", {"sessionId": sid, "prompt": then})
        await trio.testing.wait_all_tasks_blocked()  # the follow-up is queued
        go.set()
        await gap.wait()
        between = await prompt(client, sid, "by the way")
        await trio.testing.wait_all_tasks_blocked()
        assert steered.accepted[0].is_set(), "the prompt steers the follow-up's task"
        leave_gap.set()
        assert (await client.answer_of(first))["result"]["stopReason"] == "end_turn"
        for request in (follow_up, between):
            assert (await client.answer_of(request))["result"]["stopReason"] == "end_turn"
        assert answered_after(client, between, "Noted.")
        session = steered.host.get_session(sid)
    records = trace_lines(session)
    assert [r["status"] for r in records if r["type"] == "task_end"] == ["completed"] * 2
    assert any(r["type"] == "steering_queued" for r in records)
    assert provider.violations == []
