"""A failure raised while a cancellation unwinds (R-SEC-1): code of the user's or of a
provider — a model stream, an approval callback, a question's callback, a tool hook —
whose clean-up fails as an interrupt or a timeout ends it raises the failure and the
``Cancelled`` together, in one exception group. ``except Exception`` does not catch such
a group; it used to leave the task's actor and end the host with every session on it.

Each test forces the failure with a nursery whose child raises when it is cancelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import collect, of_type

from greenroom.actors.providers.scripted import (
    Reply,
    ScriptedProvider,
    ScriptedStream,
    text,
    tool_call,
)
from greenroom.actors.runtime.errors import NotPending
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.llm_streamer import LLMStreamer
from greenroom.actors.runtime.running_task import RunningTask
from greenroom.protocols.context import ModelRequest
from greenroom.protocols.hooks import Hooks
from greenroom.protocols.outputs import (
    ApprovalDecision,
    RequestEnd,
    TaskEnd,
    ToolCallOutput,
    ToolHook,
)
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import make_tool

CLEAN_UP_FAILED = "the clean-up failed"


class FailsWhenCancelled:
    """An awaitable piece of code that waits until it is cancelled, and whose clean-up
    then fails: the cancellation and the failure leave it in one exception group."""

    def __init__(self) -> None:
        self.waiting = trio.Event()
        self.calls = 0

    async def wait(self) -> None:
        self.calls += 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._clean_up_fails)
            self.waiting.set()
            await trio.sleep_forever()

    async def _clean_up_fails(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise RuntimeError(CLEAN_UP_FAILED)


async def echo(word: str) -> str:
    """Say ``word`` back."""
    return word


class _Approve:
    """An approval callback that allows every call; its person's answers to questions
    come from ``answer``."""

    def __init__(self, answer: Any) -> None:
        self.answer_question = answer

    def __call__(self, call: Any) -> str:
        return "allow"


def _setup(where: str, broken: FailsWhenCancelled) -> tuple[list[Any], dict[str, Any], Any]:
    """The first task's script, the session's options and its approval for ``where``."""

    async def stalls(request: ModelRequest, stream: ScriptedStream) -> None:
        await stream.text_delta("Half")
        await broken.wait()

    async def hook(*args: Any) -> None:
        if not broken.calls:  # the first call only: before_request sees every request
            await broken.wait()

    async def approve(call: Any) -> str:
        await broken.wait()
        return "allow"  # pragma: no cover - never reached

    async def answer(call: Any) -> str:
        await broken.wait()
        return "blue"  # pragma: no cover - never reached

    calls = Reply(blocks=(tool_call("c1", "echo", word="hi"),))
    if where == "before_request hook":
        return [calls], {"hooks": Hooks(before_request=hook)}, _Approve(answer)
    if where == "model stream":
        return [stalls], {}, _Approve(answer)
    if where == "approval callback":
        return [calls], {}, approve
    if where == "question callback":
        asks = Reply(blocks=(tool_call("c1", "ask_user", question="Which colour?"),))
        return [asks], {}, _Approve(answer)
    return [calls], {"hooks": Hooks(**{where.replace(" hook", ""): hook})}, _Approve(answer)


WHERE = [
    "model stream",
    "approval callback",
    "question callback",
    "before_request hook",
    "before_tool hook",
    "after_tool hook",
]


@pytest.mark.parametrize("where", WHERE)
async def test_an_interrupt_whose_clean_up_fails_ends_the_task_not_the_host(
    data_dir: Path, workspace: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The interrupted task ends ``aborted`` as any; the session runs its next task, a
    session beside it is untouched, and the host closes without an error. The failure is
    in the log, but a tool hook's (its error is its action's, which an aborted call does
    not record)."""
    broken = FailsWhenCancelled()
    first, options, approve = _setup(where, broken)
    provider = ScriptedProvider([*first, Reply(blocks=(text("Fine."),))])
    beside_provider = ScriptedProvider([Reply(blocks=(text("Beside."),))] * 2)
    with trio.fail_after(60):
        async with Host.open(data_dir) as host:
            session = await host.create_session(
                provider=provider,
                workspace_dir=workspace,
                tools=[make_tool(echo, parallel=True)],
                **options,
            )
            beside = await host.create_session(provider=beside_provider, workspace_dir=workspace)
            stream = session.run("go", approve=approve)
            async with trio.open_nursery() as nursery:
                outputs: list[Any] = []

                async def read() -> None:
                    outputs.extend(await collect(stream))

                nursery.start_soon(read)
                await broken.waiting.wait()
                assert session.interrupt() is True
            assert broken.calls == 1
            assert [e.status for e in of_type(outputs, TaskEnd)] == ["aborted"]

            again = await collect(session.run("again", approve=approve))
            assert [e.status for e in of_type(again, TaskEnd)] == ["completed"]
            beside_outputs = await collect(beside.run("hello"))
            assert [e.status for e in of_type(beside_outputs, TaskEnd)] == ["completed"]
    if where not in ("before_tool hook", "after_tool hook"):
        assert CLEAN_UP_FAILED in caplog.text


@pytest.mark.parametrize("where", ["approval callback", "before_tool hook"])
async def test_a_callback_whose_clean_up_fails_as_its_time_runs_out_decides_nothing(
    data_dir: Path, workspace: Path, where: str, mock_clock: trio.testing.MockClock
) -> None:
    """R-APPROVE-4, R-HOOK-2: past its bound the approval callback has decided nothing and
    the before_tool hook has not answered — the call is denied and the task goes on to
    completion — though the clean-up of either failed as its wait was cancelled."""
    mock_clock.autojump_threshold = 0
    broken = FailsWhenCancelled()

    async def waits(*args: Any) -> str:
        await broken.wait()
        return "allow"  # pragma: no cover - never reached

    calls = Reply(blocks=(tool_call("c1", "echo", word="hi"),))
    provider = ScriptedProvider([calls, Reply(blocks=(text("Denied, fine."),))])
    if where == "approval callback":
        options: dict[str, Any] = {"approval_timeout_s": 5}
        approve: Any = waits
    else:
        options = {"hooks": Hooks(before_tool=waits, tool_hook_timeout_s=5)}
        approve = _Approve(None)
    async with Host.open(data_dir) as host:
        session = await host.create_session(
            provider=provider,
            workspace_dir=workspace,
            tools=[make_tool(echo, parallel=True)],
            **options,
        )
        outputs = await collect(session.run("go", approve=approve), bound_s=None)
    (decision,) = of_type(outputs, ApprovalDecision)
    assert (decision.decision, decision.by) == (
        ("deny", "default") if where == "approval callback" else ("deny", "hook")
    )
    if where == "before_tool hook":
        (hooked,) = of_type(outputs, ToolHook)
        assert hooked.reason == "no answer within 5 s"
    assert of_type(outputs, ToolCallOutput)[0].status == "denied"
    assert [e.status for e in of_type(outputs, TaskEnd)] == ["completed"]


async def test_a_provider_failing_in_a_nursery_is_reported_in_its_own_words(
    data_dir: Path, workspace: Path
) -> None:
    """A provider whose stream fails in a task of its own raises an exception group: the
    attempt's end names the failure, not the group that wraps it."""

    async def fails(request: ModelRequest, stream: ScriptedStream) -> None:
        async def encoder() -> None:
            raise RuntimeError("the encoder tripped")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(encoder)

    provider = ScriptedProvider([fails] * 9)
    async with Host.open(data_dir) as host:
        session = await host.create_session(provider=provider, workspace_dir=workspace)
        outputs = await collect(session.run("go"))
    message = of_type(outputs, RequestEnd)[0].error_message or ""
    assert message.startswith("the provider failed unexpectedly: the encoder tripped"), message


async def test_an_actor_that_fails_ends_its_task_failed_and_nothing_else(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails in a task's actor (here the streamer itself, as a bug would) ends
    that task ``failed`` with the error; the session's next task, another session and the
    host are untouched."""
    real = LLMStreamer._stream_attempt
    broken_once: list[bool] = []

    async def bug(self: LLMStreamer, *args: Any) -> None:
        if not broken_once:
            broken_once.append(True)
            raise KeyError("a streamer bug")
        await real(self, *args)

    monkeypatch.setattr(LLMStreamer, "_stream_attempt", bug)
    provider = ScriptedProvider([Reply(blocks=(text("Fine."),))])
    beside_provider = ScriptedProvider([Reply(blocks=(text("Beside."),))])
    with trio.fail_after(60):
        async with Host.open(data_dir) as host:
            session = await host.create_session(provider=provider, workspace_dir=workspace)
            beside = await host.create_session(provider=beside_provider, workspace_dir=workspace)
            outputs = await collect(session.run("go"))
            (end,) = of_type(outputs, TaskEnd)
            assert end.status == "failed"
            assert end.message == "internal error: KeyError('a streamer bug')"
            again = await collect(session.run("again"))
            assert [e.status for e in of_type(again, TaskEnd)] == ["completed"]
            beside_outputs = await collect(beside.run("hello"))
            assert [e.status for e in of_type(beside_outputs, TaskEnd)] == ["completed"]


async def test_a_task_that_cannot_be_taken_up_ends_failed_and_nothing_else(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parked task woken by a person's answer, whose taking up fails (a bug, as the
    turn refused at a retried attempt was): the task ends ``failed`` with the error, its
    run's reader gets that end, the person is told the answer was not taken, and the
    session and the host go on."""

    def bug(self: RunningTask, *, lost_host: bool) -> None:
        raise RuntimeError("cannot take it up")

    monkeypatch.setattr(RunningTask, "take_up", bug)
    calls = Reply(blocks=(tool_call("c1", "echo", word="hi"),))
    provider = ScriptedProvider([calls, Reply(blocks=(text("Fine."),))])
    with trio.fail_after(60):
        async with Host.open(data_dir) as host:
            session = await host.create_session(
                provider=provider, workspace_dir=workspace, tools=[make_tool(echo, parallel=True)]
            )
            stream = session.run("go", approve=PEOPLE)
            await session.wait_idle()  # parked: its supervisor has ended
            with pytest.raises(NotPending, match="its task ended"):  # the answer not taken
                await host.answer_approval(session.id, "c1", "allow")
            outputs = await collect(stream)
            (end,) = of_type(outputs, TaskEnd)
            assert (end.status, end.message) == (
                "failed",
                "internal error: RuntimeError('cannot take it up')",
            )
            again = await collect(session.run("again"))
            assert [e.status for e in of_type(again, TaskEnd)] == ["completed"]


async def test_a_manual_compaction_that_fails_ends_it_and_nothing_else(
    data_dir: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manual compaction whose start fails (a bug) has no task to end failed: compact()
    returns None, the session is idle again and its next task and another session run; the
    host goes on (it used to end with every session on it)."""

    def bug(self: RunningTask, reason: str) -> None:
        raise RuntimeError("a compaction bug")

    provider = ScriptedProvider([Reply(blocks=(text("Hello."),)), Reply(blocks=(text("Fine."),))])
    beside_provider = ScriptedProvider([Reply(blocks=(text("Beside."),))])
    with trio.fail_after(60):
        async with Host.open(data_dir) as host:
            session = await host.create_session(provider=provider, workspace_dir=workspace)
            beside = await host.create_session(provider=beside_provider, workspace_dir=workspace)
            await collect(session.run("hi"))
            monkeypatch.setattr(RunningTask, "start_compaction", bug)
            assert await session.compact() is None
            assert not session.busy
            monkeypatch.undo()
            again = await collect(session.run("again"))
            assert [e.status for e in of_type(again, TaskEnd)] == ["completed"]
            beside_outputs = await collect(beside.run("hello"))
            assert [e.status for e in of_type(beside_outputs, TaskEnd)] == ["completed"]
