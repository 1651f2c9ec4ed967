"""Chaos: a rolling restart of a three-host cluster, then a SIGKILL, under load (issue 30).

    .venv/bin/python -m tests.benchmarks.chaos [--quick] [--sessions S] [--rounds R]
        [--subscribers N] [--lease-ttl S] [--at midway|launch]

Three ``greenroom serve --nats`` hosts on a local ``nats-server``, the scripted model in
this process, approvals ``all``. Each of S sessions (default 300; quick 60) runs one task of
R rounds (default 4): in every round the model calls ``ledger_write`` and then
``checked_write`` (``tests/support/chaos_tools.py``: each appends its call's idempotency key
to one ledger file at a random point of a 50-200 ms call; ``ledger_write`` has no check
and is not idempotent, ``checked_write``'s check looks the key up in the ledger), then
answers. The sessions start in four waves, created and run through the gateways of the
live hosts in turn (each placed on the least loaded host). Once a wave is midway (its
sessions have half their calls' results recorded; ``--at launch``: as soon as every
``run`` of the wave is answered) a host goes: after each of the first three waves one host
is restarted — SIGTERM (it drains: its tasks stop at their turn boundary and
its sessions are handed over), wait for its exit, start it again on its data dir under a
new ``--host-id``, wait until it takes placed sessions — and after the fourth the host that
runs the most open tasks is SIGKILLed. Every session's trace is followed in JetStream to
its ``task_end``; a sample of sessions (default 20; quick 10) is also followed through
websocket subscribers that resubscribe with ``after_seq`` through another host's gateway
when theirs goes away.

Figures (targets from issue 30 in brackets): failed tasks [0]; repeated effects, a ledger
key written twice [0]; effects without a record, a ledger key whose call has neither an
``ok`` result nor a ``call_resolved`` by its check in its trace [0; shown per tool:
``ledger_write`` is the at-most-once case of R-EFFECT-3]; calls in doubt and how each was
resolved, unresolved ones of the checked tool [0]; seq gaps and duplicates seen by any
subscriber [0]; for sessions handed over by a draining host with their task open, the time
from the last record the draining host wrote (its turn boundary) to the first record of the
new owner, by JetStream's own timestamps [≤ 1 s]; the takeover after the SIGKILL; total
wall. Written to ``bench-results/chaos.json``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import nats.errors
import nats.js.api
import trio
from nats.aio.msg import Msg
from trio_websocket import (
    ConnectionClosed,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import Connection, connect
from greenroom.actors.cluster.leases import bucket_keys
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.traces import FENCE_HEADER, ROTATE_HEADER
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.converter import to_dict
from greenroom.protocols.effects import idempotency_key
from greenroom.protocols.outputs import (
    CallInDoubt,
    CallResolved,
    ModelMsg,
    Output,
    TaskEnd,
    TaskStart,
    ToolCallOutput,
    UserMsg,
)
from greenroom.protocols.trace import parse_trace
from tests.benchmarks.common import (
    RESULTS_DIR,
    arg_parser,
    p99,
    print_machine,
    print_table,
    write_json,
)
from tests.support.chaos_tools import LEDGER_ENV
from tests.support.cluster_hosts import REPO, HostProcess, start_host
from tests.support.mock_model_server import RecordedRequest, Reply, Text, ToolUse, open_mock_server
from tests.support.nats import start_nats

TOOLS = REPO / "tests" / "support" / "chaos_tools.py"
CHECKED_TOOL = "checked_write"
WAVES = 4
"""One wave of sessions before each of the three restarts and one before the kill."""
LAUNCHES_AT_ONCE = 10
MIDWAY_BOUND_S = 120.0
"""The longest a host waits for its wave to be midway (``--at midway``)."""
SETTLE_S = 180.0
"""How long the sessions may take to end after the SIGKILL: one that has no task_end by
then is counted unfinished (and its trace described)."""
SUBSCRIBER_GRACE_S = 60.0
"""How long subscribers may take to see their task_end once every trace has one."""
DESCRIBED = ("call_id", "status", "block", "by", "outcome", "kind", "turn", "attempt", "decision")
"""The fields of a record that the evidence of an unfinished session shows."""
CONTINUE_TARGET_S = 1.0
UNSUBSCRIBE_S = 2.0
PROMPT = "Write the round entries to both ledgers, then say done."


# -- the model ---------------------------------------------------------------------------------


class ChaosModel:
    """The scripted model: round n (n = the tool-calling assistant messages so far + 1)
    calls ``ledger_write`` then ``checked_write``; after R rounds it answers. A round's
    request sent again (its host was lost while it streamed) gets the same calls."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.task_requests = 0

    def __call__(self, request: RecordedRequest) -> Reply:
        body = request.body if isinstance(request.body, dict) else {}
        if not body.get("tools"):
            return Reply([Text("A title")])
        self.task_requests += 1
        done = sum(1 for message in request.messages if _calls_tools(message))
        if done >= self.rounds:
            return Reply([Text("done")])
        n = done + 1
        calls = [
            ToolUse(id=f"call-{n}-{tool}", name=tool, input={"entry": f"round {n}"})
            for tool in ("ledger_write", CHECKED_TOOL)
        ]
        return Reply(calls, "tool_use")


def _calls_tools(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return (
        message.get("role") == "assistant"
        and isinstance(content, list)
        and any(isinstance(b, dict) and b.get("type") == "tool_use" for b in content)
    )


# -- following the cluster's traces ------------------------------------------------------------


@attrs.define
class Progress:
    """Wakes whoever waits for any session's trace to move on."""

    changed: trio.Event = attrs.Factory(trio.Event)

    def bump(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


@attrs.define
class Entry:
    """One message of a session's trace subject: a fence (``host``) or a record, with the
    time JetStream stored it."""

    at: float
    host: str | None = None
    record: Output | None = None


@attrs.define
class SessionTrace:
    """A session's trace as JetStream holds it, fences included."""

    session_id: str
    progress: Progress
    entries: list[Entry] = attrs.Factory(list)
    ended: trio.Event = attrs.Factory(trio.Event)
    changed: trio.Event = attrs.Factory(trio.Event)
    end: TaskEnd | None = None
    last_seq: int = 0
    duplicates: int = 0
    gaps: int = 0
    results: int = 0

    def add(self, msg: Msg) -> None:
        self.changed.set()
        self.changed = trio.Event()
        self.progress.bump()
        at = msg.metadata.timestamp.timestamp()
        headers = msg.headers or {}
        if FENCE_HEADER in headers:
            self.entries.append(Entry(at, host=headers[FENCE_HEADER]))
            return
        if ROTATE_HEADER in headers or not msg.data:
            return
        for record in parse_trace(msg.data, file=self.session_id).records:
            seq = record.seq or 0
            if seq <= self.last_seq:
                self.duplicates += 1  # readers skip it; counted, since no writer should
                continue
            self.gaps += seq - self.last_seq - 1
            self.last_seq = seq
            self.entries.append(Entry(at, record=record))
            self.results += isinstance(record, ToolCallOutput)
            if isinstance(record, TaskEnd):
                self.end = record
                self.ended.set()

    def records(self) -> Iterator[Output]:
        return (e.record for e in self.entries if e.record is not None)


async def follow_trace(conn: Connection, trace: SessionTrace) -> None:
    """Follow ``trace``'s subject (an ordered consumer, from its first message) to its
    ``task_end``."""
    subscription = await conn.call(
        conn.js.subscribe(
            conn.names.trace_subject(trace.session_id),
            stream=conn.names.trace_stream,
            ordered_consumer=True,
            deliver_policy=nats.js.api.DeliverPolicy.ALL,
        )
    )

    async def next_message() -> Msg:
        return await subscription.next_msg(timeout=None)

    try:
        async for msg in conn.bridge.messages(next_message):
            trace.add(msg)
            if trace.end is not None:
                return
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(UNSUBSCRIBE_S):
            with contextlib.suppress(nats.errors.Error):
                await conn.call(subscription.unsubscribe())


# -- the hosts ---------------------------------------------------------------------------------


@attrs.define
class Cluster:
    """The three host slots, which of them may be used (not stopping), and what happened."""

    tmp: Path
    nats_url: str
    model_url: str
    ledger: Path
    lease_ttl_s: float
    nursery: trio.Nursery
    conn: Connection
    hosts: list[HostProcess] = attrs.Factory(list)
    started: list[HostProcess] = attrs.Factory(list)
    stopping: set[str] = attrs.Factory(set)
    drained: list[dict[str, Any]] = attrs.Factory(list)
    killed: dict[str, Any] = attrs.Factory(dict)
    turn: int = 0

    async def start(self, slot: str, generation: int) -> HostProcess:
        host = await start_host(
            self.nursery,
            self.tmp,
            f"{slot}{generation}",
            nats_url=self.nats_url,
            model_url=self.model_url,
            effects=self.tmp / "unused.sock",
            lease_ttl_s=self.lease_ttl_s,
            extra_tools=(str(TOOLS),),
            data_dir=self.tmp / "data" / slot,
            extra_env={LEDGER_ENV: str(self.ledger)},
        )
        self.started.append(host)
        return host

    def live(self) -> list[HostProcess]:
        return [h for h in self.hosts if h.host_id not in self.stopping]

    def next_live(self, besides: str | None = None) -> HostProcess:
        """The live hosts in turn (another than ``besides`` when there is one)."""
        live = [h for h in self.live() if h.host_id != besides] or self.live()
        self.turn += 1
        return live[self.turn % len(live)]

    async def restart(self, index: int, generation: int) -> None:
        """SIGTERM the host in slot ``index``, wait for it to exit, start it again on its
        data dir under a new id and wait until it takes placed sessions."""
        old = self.hosts[index]
        self.stopping.add(old.host_id)
        began = time.time()
        old.process.send_signal(signal.SIGTERM)
        code = await old.process.wait()
        exited = time.time()
        left = await self.leases_of(old.host_id)
        counted = time.time()
        new = await self.start(old.host_id[0], generation)
        self.hosts[index] = new
        handed = sum("handed session" in line for line in old.log)
        self.drained.append({
            "host": old.host_id, "exit_code": code, "drain_s": exited - began,
            "restart_s": time.time() - counted, "handed_over": handed,
            "leases_left": left,
            "held": next((ln for ln in old.log if "drained:" in ln), ""),
            "problems": [ln for ln in old.log if "cannot" in ln or "no host took" in ln],
        })
        print(f"  {old.host_id}: SIGTERM → exit {code} in {exited - began:.2f} s, "
              f"{handed} sessions handed over, {left} leases left; {new.host_id} takes "
              f"sessions {time.time() - counted:.2f} s later", flush=True)

    async def leases_of(self, host_id: str) -> int:
        """How many sessions ``host_id`` still owns (a host that stopped cleanly drops its
        lease and owns none; one left waits for the TTL, and its session for the scan)."""
        keys = await bucket_keys(self.conn, self.conn.names.owners)
        owners = await SessionOwners.open(self.conn, ttl_s=self.lease_ttl_s)
        return sum([await owners.holder(key) == host_id for key in keys])

    async def kill(self, index: int, open_tasks: int) -> None:
        victim = self.hosts[index]
        self.stopping.add(victim.host_id)
        self.killed = {"host": victim.host_id, "at": time.time(), "open_tasks": open_tasks}
        victim.process.kill()
        await victim.process.wait()
        print(f"  {victim.host_id}: SIGKILL with {open_tasks} open tasks", flush=True)

    async def stop_all(self) -> None:
        for host in self.hosts:
            if host.process.returncode is None:
                host.process.kill()
            await host.process.wait()


def _headers(host: HostProcess) -> list[tuple[bytes, bytes]]:
    return [(b"Authorization", f"Bearer {host.token}".encode())]


class Rpc:
    """JSON-RPC over one websocket; notifications read while waiting for an answer go to
    ``on_note``."""

    def __init__(
        self, ws: WebSocketConnection, on_note: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.ws = ws
        self.ids = 0
        self.on_note = on_note

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.ids += 1
        await self.ws.send_message(
            json.dumps({"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params})
        )
        while True:
            message = json.loads(await self.ws.get_message())
            if "method" in message:
                if self.on_note is not None:
                    self.on_note(message)
                continue
            if message.get("id") == self.ids:
                return dict(message)

    async def result(self, method: str, params: dict[str, Any]) -> Any:
        answer = await self.call(method, params)
        if "result" not in answer:
            raise RuntimeError(f"{method}: {answer.get('error')}")
        return answer["result"]


# -- websocket subscribers ---------------------------------------------------------------------


@attrs.define
class Subscriber:
    """Watches one session through the gateways: every seq it was sent, in order, and how
    often it had to subscribe again."""

    session_id: str
    trace: SessionTrace
    seqs: list[int] = attrs.Factory(list)
    resubscribed: int = 0
    subscribe_errors: list[str] = attrs.Factory(list)
    done: bool = False
    finished: trio.Event = attrs.Factory(trio.Event)

    def saw_end(self) -> bool:
        """Whether the task_end came (a method: it changes while the caller awaits)."""
        return self.done

    def _note(self, message: dict[str, Any]) -> str | None:
        """Take one notification; returns why the subscription ended, if it did."""
        params = message.get("params") or {}
        if message.get("method") == "subscription_dropped":
            return str(params.get("reason"))
        if message.get("method") == "output":
            if params.get("seq") is not None:
                self.seqs.append(int(params["seq"]))
            if params.get("type") == "task_end":
                self.done = True
                return "task_end"
        return None

    async def run(self, cluster: Cluster, first: HostProcess,
                  *, task_status: trio.TaskStatus[None]) -> None:
        """Subscribe through ``first``'s gateway (``task_status`` once subscribed, so the
        task can be started), then follow the session to its task_end across host changes:
        when its host goes, through another live host's gateway."""
        host = first
        subscribed = False

        def on_subscribed() -> None:
            nonlocal subscribed
            if not subscribed:
                subscribed = True
                task_status.started()

        refusals = 0
        while not self.done:
            errors = len(self.subscribe_errors)
            try:
                async with open_websocket_url(host.url, extra_headers=_headers(host)) as ws:
                    await self._follow(ws, host, cluster, on_subscribed)
            except (ConnectionClosed, HandshakeError, OSError):
                pass  # its host went
            if self.saw_end():
                break
            self.resubscribed += 1
            refusals = refusals + 1 if len(self.subscribe_errors) > errors else 0
            if refusals >= len(cluster.live()):
                # Every live gateway refused (the cluster does not know the session, or
                # its owner does not answer): ask again once its trace has news.
                await self.trace.changed.wait()
                refusals = 0
            host = cluster.next_live(besides=host.host_id)
        self.finished.set()

    async def _follow(
        self,
        ws: WebSocketConnection,
        host: HostProcess,
        cluster: Cluster,
        on_subscribed: Callable[[], None],
    ) -> None:
        """Subscribe after the last seq seen, until the task_end; again on this connection
        when the subscription is dropped and this host stays. Returns when it goes (or
        refuses the subscription)."""
        ended: list[str] = []

        def note(message: dict[str, Any]) -> None:
            reason = self._note(message)
            if reason is not None:
                ended.append(reason)

        rpc = Rpc(ws, note)
        while not self.done:
            if ended:
                self.resubscribed += 1
            ended.clear()
            after = self.seqs[-1] if self.seqs else 0
            answer = await rpc.call(
                "session.subscribe", {"session_id": self.session_id, "after_seq": after}
            )
            if "error" in answer:
                self.subscribe_errors.append(f"{host.host_id}: {answer['error']}")
                return
            on_subscribed()
            while not ended:
                note(json.loads(await ws.get_message()))
            if host.host_id in cluster.stopping:
                return


# -- the run -----------------------------------------------------------------------------------


@attrs.define
class Run:
    cluster: Cluster
    conn: Connection
    traces: dict[str, SessionTrace] = attrs.Factory(dict)
    subscribers: list[Subscriber] = attrs.Factory(list)
    launch_errors: list[str] = attrs.Factory(list)
    progress: Progress = attrs.Factory(Progress)

    async def launch(self, index: int, watch: bool, nursery: trio.Nursery,
                     limit: trio.Semaphore) -> None:
        async with limit:
            host = self.cluster.next_live()
            try:
                async with open_websocket_url(host.url, extra_headers=_headers(host)) as ws:
                    rpc = Rpc(ws)
                    sid = (await rpc.result("session.create", {}))["session_id"]
                    trace = self.traces[sid] = SessionTrace(sid, self.progress)
                    nursery.start_soon(follow_trace, self.conn, trace)
                    if watch:
                        subscriber = Subscriber(sid, trace)
                        self.subscribers.append(subscriber)
                        await nursery.start(subscriber.run, self.cluster, host)
                    await rpc.result("run", {"session_id": sid, "input": PROMPT})
            except (RuntimeError, ConnectionClosed, HandshakeError) as exc:
                self.launch_errors.append(f"session {index} via {host.host_id}: {exc}")

    async def wave(
        self, first: int, count: int, watch_every: int, nursery: trio.Nursery
    ) -> list[str]:
        """Create and run sessions ``first`` .. ``first + count - 1``; return their ids
        once every ``run`` is answered."""
        before = set(self.traces)
        limit = trio.Semaphore(LAUNCHES_AT_ONCE)
        async with trio.open_nursery() as launches:
            for index in range(first, first + count):
                watch = index % watch_every == 0
                launches.start_soon(self.launch, index, watch, nursery, limit)
        return [sid for sid in self.traces if sid not in before]

    async def until_midway(self, wave: list[str], rounds: int) -> None:
        """Return once the sessions of ``wave`` have, in all, half of their calls' results
        recorded (each has 2 calls a round): calls are then in flight in every round."""
        half = len(wave) * rounds
        with trio.move_on_after(MIDWAY_BOUND_S):
            while sum(self.traces[sid].results for sid in wave) < half:
                await self.progress.changed.wait()

    def open_tasks_by_owner(self) -> collections.Counter[str]:
        """Sessions with a task running, by the host that fenced their trace last."""
        owners: collections.Counter[str] = collections.Counter()
        for trace in self.traces.values():
            if trace.end is None:
                owner = next((e.host for e in reversed(trace.entries) if e.host), None)
                if owner is not None:
                    owners[owner] += 1
        return owners


async def chaos(bridge: Bridge, tmp: Path, nats_url: str, args: Any) -> dict[str, Any]:
    conn = await connect(bridge, nats_url, name="chaos-bench")
    model = ChaosModel(args.rounds)
    ledger = tmp / "ledger.txt"
    sessions = args.sessions
    watch_every = max(1, sessions // args.subscribers)
    try:
        async with (
            open_mock_server(fallback=model, record=False) as server,
            trio.open_nursery() as nursery,
        ):
            cluster = Cluster(
                tmp, nats_url, server.base_url, ledger, args.lease_ttl, nursery, conn
            )
            cluster.hosts = [await cluster.start(slot, 1) for slot in "abc"]
            bench = Run(cluster, conn)
            began = time.time()
            try:
                per_wave = [sessions // WAVES + (k < sessions % WAVES) for k in range(WAVES)]
                first = 0
                for k, count in enumerate(per_wave):
                    wave = await bench.wave(first, count, watch_every, nursery)
                    if args.at == "midway":
                        await bench.until_midway(wave, args.rounds)
                    first += count
                    print(f"wave {k + 1}: {count} sessions running, {args.at} "
                          f"({len(bench.traces)} in all)", flush=True)
                    if k < WAVES - 1:
                        await cluster.restart(k, 2)
                owners = bench.open_tasks_by_owner()
                victim = max(range(3), key=lambda i: owners[cluster.hosts[i].host_id])
                await cluster.kill(victim, owners[cluster.hosts[victim].host_id])
                with trio.move_on_after(SETTLE_S) as bound:
                    for trace in bench.traces.values():
                        await trace.ended.wait()
                all_ended = time.time()
                with trio.move_on_after(SUBSCRIBER_GRACE_S):
                    for subscriber in bench.subscribers:
                        await subscriber.finished.wait()
            finally:
                with trio.CancelScope(shield=True):
                    await cluster.stop_all()
                nursery.cancel_scope.cancel()
            timed_out = bound.cancelled_caught
            wall = all_ended - began
            return {
                "traces": bench.traces, "subscribers": bench.subscribers,
                "launch_errors": bench.launch_errors, "drained": cluster.drained,
                "killed": cluster.killed, "wall_s": wall, "timed_out": timed_out,
                "ledger": ledger.read_text().splitlines() if ledger.exists() else [],
                "task_requests": model.task_requests, "violations": server.violations,
                "errors": server.errors,
                "host_logs": {
                    h.host_id: list(zip(h.logged_at, h.log, strict=False)) for h in cluster.started
                },
            }
    finally:
        with trio.CancelScope(shield=True):
            await conn.aclose()


# -- the figures -------------------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "median": None, "p99": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "p99": p99(values),
            "max": max(values)}


def analyse(found: dict[str, Any], rounds: int) -> dict[str, Any]:
    traces: dict[str, SessionTrace] = found["traces"]
    drained_hosts = {d["host"] for d in found["drained"]}
    killed = found["killed"]
    # Every call by its key (R-EFFECT-1: the session, its model_msg's seq, the call id).
    calls: dict[str, tuple[str, str, str]] = {}
    for sid, trace in traces.items():
        for record in trace.records():
            if isinstance(record, ModelMsg) and isinstance(record.block, ToolCallBlock):
                key = idempotency_key(sid, record.seq, record.block.id)
                calls[key] = (sid, record.block.id, record.block.name)
    ends = collections.Counter(t.end.status if t.end else "unfinished" for t in traces.values())
    unfinished = collections.Counter(
        _shape(t) for t in traces.values() if t.end is None
    )
    failed = sum(n for status, n in ends.items() if status != "completed")

    ledger_keys = collections.Counter(line.split()[0] for line in found["ledger"] if line)
    repeated = sorted(k for k, n in ledger_keys.items() if n > 1)
    recorded: set[tuple[str, str]] = set()
    for sid, trace in traces.items():
        for record in trace.records():
            if isinstance(record, ToolCallOutput) and record.status == "ok":
                recorded.add((sid, record.call_id))
            if isinstance(record, CallResolved) and (record.by, record.outcome) == (
                "check", "done"
            ):
                recorded.add((sid, record.call_id))
    unrecorded: collections.Counter[str] = collections.Counter()
    unknown_keys = 0
    for key in ledger_keys:
        call = calls.get(key)
        if call is None:
            unknown_keys += 1
        elif (call[0], call[1]) not in recorded:
            unrecorded[call[2]] += 1

    in_doubt: dict[tuple[str, str], str] = {}
    resolutions: collections.Counter[str] = collections.Counter()
    resolved: set[tuple[str, str]] = set()
    key_mismatches = 0
    for sid, trace in traces.items():
        for record in trace.records():
            if isinstance(record, CallInDoubt):
                in_doubt[(sid, record.call_id)] = record.tool
                known = calls.get(record.idempotency_key)
                key_mismatches += known is None or known[:2] != (sid, record.call_id)
            elif isinstance(record, CallResolved):
                resolved.add((sid, record.call_id))
                resolutions[f"{record.tool}: {record.by} → {record.outcome}"] += 1
    unresolved = collections.Counter(
        tool for call, tool in in_doubt.items() if call not in resolved
    )

    drain_gaps: list[float] = []
    by_drained_host: dict[str, list[float]] = collections.defaultdict(list)
    to_fence: list[float] = []
    drained: list[Transition] = []
    drain_told_lost = 0
    kill_gaps: list[float] = []
    for trace in traces.values():
        for moved in _transitions(trace):
            if moved.owner in drained_hosts:
                drain_gaps.append(moved.first_at - moved.last_at)
                by_drained_host[moved.owner].append(moved.first_at - moved.last_at)
                to_fence.append(moved.fenced_at - moved.last_at)
                drained.append(moved)
                drain_told_lost += any(
                    isinstance(r, UserMsg) and r.kind == "steering" for r in moved.after
                )
            elif moved.owner == killed.get("host"):
                kill_gaps.append(moved.first_at - killed["at"])

    subscribers: list[Subscriber] = found["subscribers"]
    sub_gaps = sub_dups = 0
    for subscriber in subscribers:
        seen = subscriber.seqs
        sub_dups += len(seen) - len(set(seen))
        if seen:
            sub_gaps += len(set(range(1, max(seen) + 1)) - set(seen))
    ideal_requests = len(traces) * (rounds + 1)
    return {
        "sessions": len(traces), "rounds": rounds, "task_ends": dict(ends), "failed_tasks": failed,
        "launch_errors": found["launch_errors"], "unfinished": dict(unfinished),
        "ledger_lines": len(found["ledger"]), "repeated_effects": len(repeated),
        "repeated_keys": repeated[:20], "effects_without_record": dict(unrecorded),
        "ledger_keys_of_no_call": unknown_keys,
        "in_doubt": dict(collections.Counter(in_doubt.values())),
        "resolutions": dict(resolutions), "unresolved_in_doubt": dict(unresolved),
        "in_doubt_key_mismatches": key_mismatches,
        "stream_seq_gaps": sum(t.gaps for t in traces.values()),
        "stream_duplicate_records": sum(t.duplicates for t in traces.values()),
        "subscribers": len(subscribers),
        "subscribers_done": sum(s.done for s in subscribers),
        "subscriber_seq_gaps": sub_gaps, "subscriber_seq_duplicates": sub_dups,
        "subscriber_resubscriptions": sum(s.resubscribed for s in subscribers),
        "subscribe_errors": [e for s in subscribers for e in s.subscribe_errors][:20],
        "drained_continue_s": _spread(drain_gaps),
        "drained_over_target": sum(g > CONTINUE_TARGET_S for g in drain_gaps),
        "drained_continue_s_by_host": {h: _spread(v) for h, v in by_drained_host.items()},
        "drained_boundary_to_fence_s": _spread(to_fence),
        "drained_new_owners": dict(collections.Counter(m.new_owner for m in drained)),
        "drain_transitions": [
            {"session": m.session_id, "from": m.owner, "to": m.new_owner, "last_at": m.last_at,
             "fenced_at": m.fenced_at, "first_at": m.first_at} for m in drained
        ],
        "drained_told_host_lost": drain_told_lost,
        "kill_takeover_s": _spread(kill_gaps),
        "drains": found["drained"], "killed": found["killed"],
        "task_requests": found["task_requests"], "ideal_task_requests": ideal_requests,
        "model_violations": found["violations"][:5], "model_errors": found["errors"][:5],
        "wall_s": found["wall_s"], "timed_out": found["timed_out"],
    }


def _shape(trace: SessionTrace) -> str:
    """What the trace of a session without task_end ends in."""
    records = list(trace.records())
    if not records:
        return "no record"
    if not any(isinstance(r, TaskStart) for r in records):
        kinds = ", ".join(r.TYPE for r in records)
        return f"no task_start ({kinds})"
    return f"task open, last record {records[-1].TYPE}"


@attrs.frozen
class Transition:
    """A change of owner while the session's task was open: ``owner`` wrote the last
    record before it (at ``last_at``), ``new_owner`` fenced the trace at ``fenced_at`` and
    wrote its first record at ``first_at``; ``after`` are its records up to the next
    change."""

    session_id: str
    owner: str
    new_owner: str
    last_at: float
    fenced_at: float
    first_at: float
    after: list[Output]


def _transitions(trace: SessionTrace) -> Iterator[Transition]:
    """Each change of owner of ``trace`` while its task was open."""
    owner: str | None = None
    fence: tuple[str, float] | None = None
    last: tuple[str, float] | None = None
    open_task = False
    pending: tuple[str, float] | None = None
    for index, entry in enumerate(trace.entries):
        if entry.host is not None:
            if owner is not None and open_task and last is not None and pending is None:
                pending = last
            owner = entry.host
            fence = (entry.host, entry.at)
            continue
        record = entry.record
        if pending is not None and fence is not None:
            after = []
            for later in trace.entries[index:]:
                if later.host is not None:
                    break
                if later.record is not None:
                    after.append(later.record)
            yield Transition(
                trace.session_id, pending[0], fence[0], pending[1], fence[1], entry.at, after
            )
            pending = None
        if isinstance(record, TaskStart):
            open_task = True
        elif isinstance(record, TaskEnd):
            open_task = False
        if owner is not None:
            last = (owner, entry.at)


def report(figures: dict[str, Any]) -> None:
    def met(ok: bool) -> str:
        return "yes" if ok else "NO"

    drained = figures["drained_continue_s"]
    unresolved_checked = figures["unresolved_in_doubt"].get(CHECKED_TOOL, 0)
    unrecorded = figures["effects_without_record"]
    rows = [
        {"figure": "failed tasks (task_end not completed, or none)",
         "value": figures["failed_tasks"], "target": 0, "met": met(figures["failed_tasks"] == 0)},
        {"figure": "repeated effects (a ledger key written twice)",
         "value": figures["repeated_effects"], "target": 0,
         "met": met(figures["repeated_effects"] == 0)},
        {"figure": f"effects without a record, {CHECKED_TOOL} (has a check)",
         "value": unrecorded.get(CHECKED_TOOL, 0), "target": 0,
         "met": met(unrecorded.get(CHECKED_TOOL, 0) == 0)},
        {"figure": "effects without a record, ledger_write (no check: at most once)",
         "value": unrecorded.get("ledger_write", 0), "target": "(0)", "met": "-"},
        {"figure": f"in-doubt calls unresolved, {CHECKED_TOOL}", "value": unresolved_checked,
         "target": 0, "met": met(unresolved_checked == 0)},
        {"figure": "in-doubt calls unresolved, all tools",
         "value": sum(figures["unresolved_in_doubt"].values()), "target": "-", "met": "-"},
        {"figure": f"subscriber seq gaps / duplicates ({figures['subscribers']} subscribers)",
         "value": f"{figures['subscriber_seq_gaps']} / {figures['subscriber_seq_duplicates']}",
         "target": "0 / 0",
         "met": met(figures["subscriber_seq_gaps"] == figures["subscriber_seq_duplicates"] == 0
                    and figures["subscribers_done"] == figures["subscribers"])},
        {"figure": f"drained sessions continue (s): median / p99 / max (n={drained['n']})",
         "value": _fmt_spread(drained), "target": f"<= {CONTINUE_TARGET_S:g}",
         "met": met(drained["n"] > 0 and figures["drained_over_target"] == 0)},
    ]
    print_table("chaos: targets", rows)
    kill = figures["kill_takeover_s"]
    print(f"\nsessions {figures['sessions']} x {figures['rounds']} rounds; task ends "
          f"{figures['task_ends']}; launch errors {len(figures['launch_errors'])}")
    for shape, n in figures["unfinished"].items():
        print(f"  unfinished: {n} whose trace has {shape}")
    print(f"ledger lines {figures['ledger_lines']}; keys of no call in any trace "
          f"{figures['ledger_keys_of_no_call']}")
    print(f"calls in doubt by tool {figures['in_doubt']}; key mismatches "
          f"{figures['in_doubt_key_mismatches']}")
    for resolution, n in sorted(figures["resolutions"].items()):
        print(f"  resolved {resolution}: {n}")
    print(f"drained sessions over {CONTINUE_TARGET_S:g} s: {figures['drained_over_target']}; "
          f"told their host was lost: {figures['drained_told_host_lost']}; from the boundary "
          f"to the new owner's fence {_fmt_spread(figures['drained_boundary_to_fence_s'])} s; "
          f"new owners {figures['drained_new_owners']}")
    for drain in figures["drains"]:
        spread = figures["drained_continue_s_by_host"].get(drain["host"])
        continued = f"; continued after {_fmt_spread(spread)} s" if spread else ""
        print(f"  drain of {drain['host']}: exit {drain['exit_code']} after "
              f"{drain['drain_s']:.2f} s, {drain['handed_over']} handed over, "
              f"{drain['leases_left']} leases left; "
              f"restarted in {drain['restart_s']:.2f} s{continued}")
        for line in drain["problems"]:
            print(f"    {line}")
    print(f"SIGKILL of {figures['killed'].get('host')} with "
          f"{figures['killed'].get('open_tasks')} open tasks: first record of the new owner "
          f"after {_fmt_spread(kill)} s (median / p99 / max, n={kill['n']})")
    print(f"trace stream: seq gaps {figures['stream_seq_gaps']}, duplicate records "
          f"{figures['stream_duplicate_records']}")
    print(f"subscribers done {figures['subscribers_done']}/{figures['subscribers']}, "
          f"resubscriptions {figures['subscriber_resubscriptions']}, subscribe errors "
          f"{len(figures['subscribe_errors'])}")
    print(f"model requests of tasks {figures['task_requests']} (ideal "
          f"{figures['ideal_task_requests']}); mock violations "
          f"{len(figures['model_violations'])}, errors {len(figures['model_errors'])}")
    print(f"total wall {figures['wall_s']:.1f} s" +
          (" (bound reached: unfinished sessions)" if figures["timed_out"] else ""))


def _fmt_spread(spread: dict[str, Any]) -> str:
    if not spread["n"]:
        return "-"
    return f"{spread['median']:.3f} / {spread['p99']:.3f} / {spread['max']:.3f}"


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--sessions", type=int, default=None, help="sessions (300; quick 60)")
    parser.add_argument("--rounds", type=int, default=4, help="tool rounds per task")
    parser.add_argument("--subscribers", type=int, default=None,
                        help="sessions also followed by websocket (20; quick 10)")
    parser.add_argument("--lease-ttl", type=float, default=5.0, help="serve --lease-ttl")
    parser.add_argument(
        "--at", choices=("midway", "launch"), default="midway",
        help="when each host goes: once its wave has half its calls' results recorded "
        "(midway), or as soon as every run of the wave is answered (launch)",
    )
    args = parser.parse_args()
    args.sessions = args.sessions or (60 if args.quick else 300)
    args.subscribers = args.subscribers or (10 if args.quick else 20)
    print_machine()
    with tempfile.TemporaryDirectory(prefix="greenroom-bench-chaos-") as tmp_name:
        tmp = Path(tmp_name)
        server = start_nats(tmp / "nats")
        try:
            found = run(lambda bridge: chaos(bridge, tmp, server.url, args))
        finally:
            server.stop()
    figures = analyse(found, args.rounds)
    report(figures)
    write_json("chaos", {"lease_ttl_s": args.lease_ttl, "at": args.at, **figures})
    write_evidence(found)


def write_evidence(found: dict[str, Any]) -> None:
    """The hosts' logs and the traces of the sessions that did not end, for finding out
    why (``bench-results/chaos-hosts.log``, ``chaos-unfinished.txt``)."""
    RESULTS_DIR.mkdir(exist_ok=True)
    with (RESULTS_DIR / "chaos-hosts.log").open("w") as out:
        for host_id, lines in found["host_logs"].items():
            out.writelines(f"{_clock(at)} {host_id}: {line}\n" for at, line in lines)
    with (RESULTS_DIR / "chaos-unfinished.txt").open("w") as out:
        for sid, trace in found["traces"].items():
            if trace.end is not None:
                continue
            out.write(f"== {sid}\n")
            for entry in trace.entries:
                stamp = _clock(entry.at)
                if entry.host is not None:
                    out.write(f"  {stamp} fence {entry.host}\n")
                elif entry.record is not None:
                    out.write(f"  {stamp} {entry.record.seq} {_describe(entry.record)}\n")


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) + f"{at % 1:.3f}"[1:]


def _describe(record: Output) -> str:
    fields = {k: v for k, v in to_dict(record).items() if k in DESCRIBED}
    return f"{record.TYPE} {json.dumps(fields)}"


if __name__ == "__main__":
    main()
