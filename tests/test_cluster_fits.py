"""A model's message larger than one record of a cluster's trace, end to end (R-SEC-9,
R-CLUSTER-1): an in-process cluster host on a real nats-server that carries 128 KiB, its
sessions sending to the loopback model server through the anthropic provider.

* A fork or rewind (R-FORK-1, R-FORK-2) inside or right after a model message recorded in
  pieces settles it within one record: right after, the next request carries the text
  whole with its line breaks; inside, the carry-over (R-ABORT-2) holds its fitted start.
  The new history's records reach JetStream and its next task completes on the host.
* A tool call no record holds ends its task ``failed``; the usage the provider reported
  for that request at its stream's end is counted (R-TRACE-5, R-SHARE-3, R-SHARE-4): in
  the ledger, and in the principal's spending, so the principal's budget stops the next
  task.
* An interrupt in the middle of a long text: the abort's partial fits one record, and the
  next task's carry-over shows it (R-ABORT-2), its two markers naming the record's size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import allow_all

from greenroom.actors.cluster.bridge import Bridge
from greenroom.actors.cluster.connection import Connection
from greenroom.actors.cluster.spending import SharedSpendLimit
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.providers.anthropic import AnthropicProvider
from greenroom.actors.runtime.accounting import PrincipalBudget
from greenroom.actors.runtime.session import Session
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.outputs import (
    Abort,
    ModelMsg,
    Output,
    PartialText,
    RequestEnd,
    TaskEnd,
)
from greenroom.protocols.trace import UsageQuery, record_size
from tests.support.mock_model_server import (
    MockModelServer,
    Paused,
    Reply,
    Text,
    ToolUse,
    open_mock_server,
)
from tests.support.nats import run_connected, running_nats
from tests.test_cluster_admission import in_cluster, session_on, two_hosts
from tests.test_cluster_forwarding import BOUND_S, SMALL_PAYLOAD, _member, _write_file_tool

MODEL = "mock-model"
LINES = "\n".join(f"line {i}: " + "y" * 90 for i in range(3000))
"""The model's answer: 300 KB in lines, recorded in three pieces at 128 KiB a record."""


def _long_text() -> Text:
    """:data:`LINES` as a stream sends it, in deltas of 10,000 characters."""
    return Text(LINES, chunks=[LINES[i : i + 10_000] for i in range(0, len(LINES), 10_000)])


def _provider(model: MockModelServer) -> AnthropicProvider:
    return AnthropicProvider(base_url=model.base_url, api_key="test-key")


async def _records(conn: Connection, session_id: str) -> list[Output]:
    """What JetStream holds of ``session_id``'s trace."""
    return list((await (await TraceStream.open(conn)).read(session_id)).records)


async def _kept(conn: Connection, owner: Any, session_id: str, model: Any) -> dict[str, Any]:
    """What became of ``session_id`` on its host ``owner`` once its task ended: JetStream
    acknowledged all its records (settled), the host still serves it, the records JetStream
    holds, the host's record limit, and the last request ``model`` was sent."""
    return {
        "settled": await owner.node.store.log.settled(session_id),
        "serves": owner.node.serves(session_id),
        "records": await _records(conn, session_id),
        "most": owner.host.trace_log.largest_input(),
        "request": model.requests[-1],
    }


def _wire_texts(message: dict[str, Any]) -> list[str]:
    """The texts of one message of a request as the provider received it."""
    content = message["content"]
    if isinstance(content, str):
        return [content]
    return [block["text"] for block in content if block.get("type") == "text"]


@pytest.mark.parametrize("how", ["fork", "rewind"])
@pytest.mark.parametrize("where", ["inside", "after"])
def test_a_fork_or_rewind_at_a_message_in_pieces_fits_its_records_and_goes_on(
    tmp_path: Path, how: str, where: str
) -> None:
    """R-FORK-1, R-FORK-2, R-ABORT-2, R-SEC-9, R-CLUSTER-1: the model answered 300 KB of
    text in lines, recorded in pieces within a record each. A fork (or a rewind) at the
    second piece settles the open task with an abort within one record, its carry-over in
    the next request the text's start with a marker; one at the request's end keeps the
    whole answer, which the next request carries as one text, its line breaks kept. The
    new history's records reach JetStream and its next task completes on the host."""

    async def body(conn: Connection, url: str) -> dict[str, Any]:
        replies = [Reply([_long_text()]), Reply([Text("Forked.")])]
        async with (
            open_mock_server(*replies) as model,
            _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as owner,
        ):
            source = await owner.host.create_session(
                provider=_provider(model), model=MODEL, workspace_dir=tmp_path / "ws"
            )
            first = (await source.run("go").result()).task_end
            records = await _records(conn, source.id)
            pieces = [r for r in records if isinstance(r, ModelMsg)]
            (end,) = [r for r in records if isinstance(r, RequestEnd)]
            at = pieces[1].seq if where == "inside" else end.seq
            assert at is not None
            target: Session = source
            if how == "fork":
                target = await owner.host.fork_session(source.id, at, provider=_provider(model))
            else:
                await source.rewind(at)
            then = (await target.run("go on").result()).task_end
            return {
                "first": first,
                "pieces": pieces,
                "then": then,
                **await _kept(conn, owner, target.id, model),
            }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: body(conn, server.url), timeout_s=BOUND_S)
    assert found["first"].status == "completed"
    pieces = [r.block.text for r in found["pieces"]]
    assert len(pieces) == 3 and "\n".join(pieces) == LINES
    assert found["settled"] and found["serves"], "the session stopped on its host"
    assert found["then"].status == "completed", found["then"]
    assert all(record_size(r) <= SMALL_PAYLOAD for r in found["records"])
    (abort,) = [r for r in found["records"] if isinstance(r, Abort)]
    user, *_ = messages = found["request"].messages
    answer = [m for m in messages if m["role"] == "assistant"]
    carried = [t for t in _wire_texts(user) if t.startswith("[turn_aborted]")]
    if where == "after":  # the message was complete: the history keeps it whole
        assert abort.message_complete and carried == []
        assert [_wire_texts(m) for m in answer] == [[LINES]]
        return
    assert answer == []  # an interrupted message is carried over, not answered
    assert record_size(abort.partial) <= found["most"]
    marker = _blocks_cut(2, found["most"])
    assert abort.partial[-1] == TextBlock(text=marker)
    (over,) = carried
    kept = over.removeprefix("[turn_aborted]").split("\n[cut: ")[0]
    assert LINES.startswith(kept) and len(kept) > 100_000
    assert over.endswith(f"{marker}[/turn_aborted]")


def _blocks_cut(count: int, most: int) -> str:
    """The marker ending an abort's partial when the last of its ``count`` blocks was cut
    to fit a record of ``most`` bytes."""
    return (
        f"[cut: {count} of {count} blocks of the interrupted message left out or cut to fit "
        f"one record of this session's trace ({most} bytes)]"
    )


PRICES = {MODEL: {"input": 1.0, "output": 1.0}}
"""$1 a million tokens: a request of 10,000 input tokens and 160,000 output costs $0.17."""
COST = (10_000 + 160_000) / 1_000_000


def test_a_call_no_record_holds_ends_its_task_failed_and_its_usage_is_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-TRACE-5, R-SHARE-3, R-SHARE-4, R-SEC-9, R-CLUSTER-1: Alice may spend $0.005 a
    day. On host a, the model answers her with two calls of write_file whose 300 KB of
    arguments no record holds, reporting 10,000 input tokens as its stream starts and
    160,000 output tokens at its end, 300 KB after the first call ($0.17): the task ends
    ``failed`` naming the first call's size and the record's, no call run; the request's
    whole usage is in the task's end and the ledger (the read that held the first call
    knew its input alone: 1 output token was counted), and reaches her spending across
    the cluster: her next task, on host b, ends ``budget_exceeded`` before any request."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "cluster-test-key")  # one credential for a and b
    ran: list[str] = []
    call = ToolUse("c1", "write_file", {"path": "big.txt", "content": "x" * 300_000})
    second = ToolUse("c2", "write_file", {"path": "more.txt", "content": "y" * 300_000})
    budget = PrincipalBudget(usd=0.005, period="day")

    async def body(bridge: Bridge, url: str) -> dict[str, Any]:
        async with (
            open_mock_server(
                Reply(
                    [Text("Here it is."), call, second],
                    stop_reason="tool_use",
                    usage=(10_000, 160_000),
                )
            ) as model,
            two_hosts(bridge, url, tmp_path, principal_budget=budget, prices=PRICES) as (a, b),
        ):
            tools = [_write_file_tool(ran)]
            on_a, _ = await session_on(*a, model.base_url, tmp_path, principal="alice", tools=tools)
            on_b, _ = await session_on(*b, model.base_url, tmp_path, principal="alice")
            limit = b[0].port(on_b.id).account.limits[-1]
            assert isinstance(limit, SharedSpendLimit)
            failed = (await on_a.run("write it", approve=allow_all).result()).task_end
            ledger = await a[0].usage_ledger.report(UsageQuery(by="principal"))
            await limit.wait_spent(0.01)  # what a spent, as b hears it: one request's cost
            then = (await on_b.run("again").result()).task_end
            return {
                "failed": failed,
                "ledger": ledger,
                "heard": limit.spent_usd,
                "then": then,
                "requests": model.request_count,
                "most": a[0].trace_log.largest_input(),
            }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = in_cluster(lambda bridge: body(bridge, server.url))
    failed = found["failed"]
    size = record_size(ToolCallBlock(id="c1", name="write_file", arguments=call.input))
    assert (failed.status, failed.message) == (
        "failed",
        f"the model's call of write_file takes {size} bytes in the trace, more than the "
        f"{found['most']} bytes one record of this session's trace carries",
    )
    assert ran == []
    usage = (failed.usage.input, failed.usage.output, failed.usage.cost_usd)
    assert usage == (10_000, 160_000, pytest.approx(COST))
    (line,) = found["ledger"]
    assert (line.key, line.requests, line.input, line.output) == ("alice", 1, 10_000, 160_000)
    assert line.cost_usd == pytest.approx(COST)
    assert found["heard"] == pytest.approx(COST)
    then = found["then"]
    assert then.status == "budget_exceeded" and then.turns == 0, then
    assert "budget of principal 'alice'" in (then.message or "")
    assert found["requests"] == 1


def test_an_interrupt_in_a_long_text_fits_its_partial_and_carries_it_over(
    tmp_path: Path,
) -> None:
    """R-ABORT-2, R-SEC-9, R-CLUSTER-1: the model has streamed 200 KB of a text in lines
    when the task is interrupted: the abort's partial, its carry-over, fits one record (the
    text's start and a marker saying it was cut), every record reaches JetStream, and the
    next task's request shows the carry-over and completes on the same host. The cut
    text's marker and the partial's both name the record's bytes (the text's named the
    room its block had, the partial's the room the abort left)."""
    resume = trio.Event()
    held = Paused(
        Reply([Text(LINES, chunks=[LINES[:200_000], LINES[200_000:]])]),
        after_events=3,  # message_start, content_block_start and the 200 KB delta
        resume=resume,
    )

    async def body(conn: Connection, url: str) -> dict[str, Any]:
        async with (
            open_mock_server(held, Reply([Text("Next.")])) as model,
            _member(conn, url, tmp_path, "a", request_timeout_s=30.0) as owner,
        ):
            session = await owner.host.create_session(
                provider=_provider(model), model=MODEL, workspace_dir=tmp_path / "ws"
            )
            interrupted: list[Output] = []
            async for output in session.run("go"):
                interrupted.append(output)
                if isinstance(output, PartialText):
                    session.interrupt("enough")
            resume.set()
            then = (await session.run("go on").result()).task_end
            return {
                "interrupted": interrupted,
                "then": then,
                **await _kept(conn, owner, session.id, model),
            }

    with running_nats(tmp_path / "nats", max_payload=SMALL_PAYLOAD) as server:
        found = run_connected(server.url, lambda conn: body(conn, server.url), timeout_s=BOUND_S)
    end = found["interrupted"][-1]
    assert isinstance(end, TaskEnd) and end.status == "aborted", end
    assert found["settled"] and found["serves"], "the session stopped on its host"
    assert found["then"].status == "completed", found["then"]
    (abort,) = [r for r in found["records"] if isinstance(r, Abort)]
    assert record_size(abort.partial) <= found["most"]
    cut, marker = abort.partial
    assert marker == TextBlock(text=_blocks_cut(1, found["most"]))
    assert isinstance(cut, TextBlock)  # its marker names the same record's bytes
    kept, _, left_out = cut.text.partition("\n[cut: ")
    assert left_out.endswith(f"trace ({found['most']} bytes); the rest is not kept]")
    assert LINES[:200_000].startswith(kept) and len(kept) > 100_000
    (user,) = found["request"].messages
    carried = [t for t in _wire_texts(user) if t.startswith("[turn_aborted]")]
    assert carried == [f"[turn_aborted]{cut.text}\n{marker.text}[/turn_aborted]"]
