"""The gateway's session hubs are actors (R-ACTOR-1, R-ACTOR-2): each watches its session
from a task of its own through ``Session.watch``. A subscription starts at a marker in the
hub's FIFO inbox, so the hop between the session and the hub neither loses nor repeats an
output: one published before the subscription and not yet drained by the hub reaches the
client once (by the replay); a traced one the hub drains after the subscription went live
and the replay sent is skipped by seq. The interleavings are forced: each step below runs
without a checkpoint, so the hub cannot drain in between."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import trio
import trio.testing
from conftest import port_of

from greenroom.actors.gateway import GatewayLimits
from greenroom.actors.gateway.connection import Connection
from greenroom.actors.gateway.hubs import Hubs
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.session import Session
from greenroom.protocols.outputs import ModelMsg, Output, PartialText

BOUND_S = 10


def live(session: Session, words: str) -> Output:
    return PartialText(session_id=session.id, run_id="run_x", index=0, text=words)


async def traced(session: Session, words: str) -> Output:
    """A traced output, written and synced as the emitter does before it publishes."""
    port = port_of(session)
    output = ModelMsg(
        session_id=session.id, run_id="run_x", turn=1, block=text(words), seq=port.next_seq()
    )
    port.append(output)
    port.commit()
    await port.sync_trace()
    return output


def connection() -> Connection:
    # The hubs only use the connection's outbox and subscriptions: no socket is needed.
    return Connection(cast(Any, None), "me", GatewayLimits(), methods={}, auth_timeout_s=BOUND_S)


async def sent(client: Connection) -> list[tuple[str, str]]:
    frames = await client.outbox.take_all()
    notes = [json.loads(frame) for frame in frames]
    return [(n["params"]["type"], n["params"].get("block", n["params"]).get("text")) for n in notes]


async def test_the_hop_to_the_hub_neither_loses_nor_repeats_an_output(tmp_path: Path) -> None:
    hubs = Hubs(on_task_end=None, limits=GatewayLimits())
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
            provider = ScriptedProvider([Reply(blocks=(text("Hi."),))])
            session = await host.create_session(provider=provider, workspace_dir=tmp_path)
            await nursery.start(hubs.run)
            await hubs.adopt(session)
            client = connection()

            before = await traced(session, "before")
            in_replay = await traced(session, "in the replay")
            # Published just before the subscription, still in the hub's inbox when the
            # subscription is made: its marker goes behind them.
            port_of(session).publish([live(session, "ghost"), before])
            replayed, last_seq = await hubs.subscribe(client, session, 0)
            assert (replayed, last_seq) == (2, in_replay.seq)
            # Published after the subscription, drained by the hub only after it went live
            # (the connection queued its answer): the traced one was in the replay.
            port_of(session).publish([live(session, "after"), in_replay])
            for go_live in client.after_answer:
                go_live()
            later = await traced(session, "later")
            port_of(session).publish([later])
            await trio.testing.wait_all_tasks_blocked()
            frames = await sent(client)
            nursery.cancel_scope.cancel()
    assert frames == [
        ("model_msg", "before"),
        ("model_msg", "in the replay"),
        ("partial_text", "after"),
        ("model_msg", "later"),
    ]


async def test_a_hub_ends_with_its_session_and_tells_its_clients(tmp_path: Path) -> None:
    """Closing the session ends its watch: the hub's loop drops the subscriptions with a
    notice (where to resume) and ends, instead of watching a session that is gone."""
    hubs = Hubs(on_task_end=None, limits=GatewayLimits())
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
            provider = ScriptedProvider([Reply(blocks=(text("Hi."),))])
            session = await host.create_session(provider=provider, workspace_dir=tmp_path)
            await nursery.start(hubs.run)
            hub = await hubs.adopt(session)
            client = connection()
            await hubs.subscribe(client, session, 0)
            for go_live in client.after_answer:
                go_live()
            await host.close_session(session.id)
            await trio.testing.wait_all_tasks_blocked()
            notes = [json.loads(f) for f in await client.outbox.take_all()]
            assert not hub.subscriptions and not client.subscriptions
            nursery.cancel_scope.cancel()
    assert [n["method"] for n in notes] == ["subscription_dropped"]
    assert notes[0]["params"] == {
        "session_id": session.id,
        "reason": "session closed",
        "last_seq": 0,
    }


async def test_a_failing_hub_step_costs_one_batch_and_the_hub_goes_on(tmp_path: Path) -> None:
    """R-SEC-1: a bug met while the hub handles one batch (here its task-end callback
    raises) is logged; the hub keeps following the session and the next task's outputs
    reach its client."""
    ended: list[str] = []

    def broken(session: Session) -> None:
        ended.append(session.id)
        if len(ended) == 1:
            raise RuntimeError("titler bug")

    hubs = Hubs(on_task_end=broken, limits=GatewayLimits())
    with trio.fail_after(BOUND_S):
        async with Host.open(tmp_path / "data") as host, trio.open_nursery() as nursery:
            provider = ScriptedProvider(
                [Reply(blocks=(text("One."),)), Reply(blocks=(text("Two."),))]
            )
            session = await host.create_session(provider=provider, workspace_dir=tmp_path)
            await nursery.start(hubs.run)
            await hubs.adopt(session)
            await session.run("first").collect()
            await trio.testing.wait_all_tasks_blocked()
            client = connection()
            _, last_seq = await hubs.subscribe(client, session, 0)
            await client.outbox.take_all()  # the replay
            for go_live in client.after_answer:
                go_live()
            await session.run("second").collect()
            await trio.testing.wait_all_tasks_blocked()
            notes = [json.loads(frame) for frame in await client.outbox.take_all()]
            nursery.cancel_scope.cancel()
    assert ended == [session.id, session.id]
    traced_notes = [n["params"] for n in notes if "seq" in n["params"]]
    assert traced_notes[-1]["type"] == "task_end"
    assert all(o["seq"] > last_seq for o in traced_notes)
