"""A history cut after a failed attempt's ``request_end``, before its retry begins
(R-FORK-1, R-FORK-2, R-ABORT-2 case B, R-RETRY-4): a fork or a rewind there settles the
task as a live interrupt at that point does — the failed attempt's output is the partial."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import allow_all, collect, last_user, model_error, texts_of, trace_lines

from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols import time_travel
from greenroom.protocols.content import TextBlock
from greenroom.protocols.outputs import (
    Abort,
    ModelMsg,
    Output,
    RequestBegin,
    RequestEnd,
    TaskStart,
    UserMsg,
)
from greenroom.protocols.task import fold
from greenroom.protocols.transcript import rebuild

INTERRUPTED = "[interrupted: tool aborted by user]"


async def failed_then_retried(host: Host, workspace: Path, providers: Any, lookup: Any) -> Session:
    """A session whose one task's attempt 1 writes a text and a ``lookup`` call, then
    fails (``request_end(timeout)``); the call runs, and attempt 2 answers."""
    provider = providers(
        [
            Reply(
                blocks=(text("Half."), tool_call("c1", "lookup", key="a"), text("never")),
                fail=model_error("timeout", "overloaded"),
                fail_after_blocks=2,
            ),
            Reply(blocks=(text("Done."),)),
        ]
    )
    source = await host.create_session(
        tools=[lookup.tool], provider=provider, workspace_dir=workspace
    )
    await collect(source.run("try", approve=allow_all), bound_s=None)
    assert lookup.calls == ["a"]
    return source


@pytest.mark.parametrize("how", ["fork", "rewind"])
@pytest.mark.parametrize(
    ("after", "result"),
    [("request_end", INTERRUPTED), ("tool_call_output", "value-a")],
    ids=["at_request_end", "in_backoff"],
)
async def test_a_cut_after_a_failed_attempts_request_end_carries_its_output(
    host: Host,
    workspace: Path,
    providers: Any,
    lookup: Any,
    autojump_clock: Any,
    how: str,
    after: str,
    result: str,
) -> None:
    """The cut falls right after attempt 1's ``request_end(timeout)`` (its call not run
    yet), or after its call's result (the retry's backoff). An interrupt there records the
    failed attempt's output as the abort's partial, incomplete, and no second
    ``request_end`` (6606892). The settlement wrote ``abort(message_complete=True)`` with
    nothing: the forked or rewound session's next request was never told that the model
    had written a text and made the call."""
    source = await failed_then_retried(host, workspace, providers, lookup)
    at = next(line["seq"] for line in trace_lines(source) if line["type"] == after)
    following = providers([Reply(blocks=(text("going on"),))])
    if how == "fork":
        session = await host.fork_session(source.id, at_seq=at, provider=following)
    else:
        await source.rewind(at)
        session = source
        session.host.port(session.id).provider = following
    lines = trace_lines(session)
    if how == "rewind":
        settled = lines[[line["type"] for line in lines].index("rewind") + 1 :]
    else:
        settled = [line for line in lines if line["seq"] > at]
    abort = next(line for line in settled if line["type"] == "abort")
    assert abort["message_complete"] is False
    assert [b["type"] for b in abort["partial"]] == ["text", "tool_call"]
    assert "request_end" not in [line["type"] for line in settled]
    await collect(session.run("go on"), bound_s=None)
    (request,) = following.requests
    assert texts_of(last_user(request)) == [
        '[turn_aborted]Half.\n[tool call lookup {"key": "a"}]\n'
        f"[tool result lookup: {result}][/turn_aborted]",
        "go on",
    ]
    assert lookup.calls == ["a"]


def test_a_cut_after_a_retry_that_wrote_nothing_carries_the_earlier_attempts_output() -> None:
    """R-ABORT-2 case B, R-RETRY-4: attempt 1 wrote a text and failed, the retry failed
    before writing anything. An interrupt there records attempt 1's output (the retry
    note's) as the partial; a cut there gave an abort with nothing, so the next request
    read an empty ``[turn_aborted]``. Now the settlement's carry-over is the interrupt's."""
    half = TextBlock(text="half")

    def end(seq: int, attempt: int) -> RequestEnd:
        return RequestEnd(session_id="s1", run_id="r1", seq=seq, turn=1, attempt=attempt,
                          status="timeout", retry_in_ms=250)  # fmt: skip

    records: list[Output] = [
        UserMsg(
            session_id="s1", run_id="r1", seq=1, kind="prompt", content=(TextBlock(text="try"),)
        ),
        TaskStart(session_id="s1", run_id="r1", seq=2, input_seq=1),
        RequestBegin(session_id="s1", run_id="r1", seq=3, turn=1, attempt=1),
        ModelMsg(session_id="s1", run_id="r1", seq=4, turn=1, block=half),
        end(5, 1),
        RequestBegin(session_id="s1", run_id="r1", seq=6, turn=1, attempt=2),
        end(7, 2),
    ]
    assert time_travel.failed_output(records) == (half,)
    # While the retry streams, its own partial output counts (the transcript's).
    assert time_travel.failed_output(records[:-1]) is None
    transcript = rebuild(records, recover=False)
    failed = time_travel.failed_output(records)
    record = fold(records).record
    out = time_travel.settlement(
        record, transcript.attempt_blocks, session_id="s1", reason="x", failed=failed
    )
    assert [o.TYPE for o in out] == ["abort", "task_end"]
    interrupted = Abort(session_id="s1", run_id="r1", seq=8, reason="x", partial=(half,),
                        message_complete=False)  # fmt: skip
    settled = [attrs.evolve(o, seq=8 + i) for i, o in enumerate(out)]
    assert rebuild([*records, *settled]).carry_over == rebuild([*records, interrupted]).carry_over
    assert rebuild([*records, *settled]).carry_over == [
        TextBlock(text="[turn_aborted]half[/turn_aborted]")
    ]
