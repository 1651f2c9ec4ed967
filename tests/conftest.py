"""Shared fixtures for the turn-loop behaviour tests (scripted model, real host).

Every test here runs a real :class:`Host` in ``tmp_path`` (real trace files, real SQLite
ledger) against a :class:`ScriptedProvider`. Synchronisation is by events only:

* :class:`Recorder` subscribes to a session and lets a test ``await`` a given output;
* :class:`Gates` builds tools that block until the test releases them, and records when
  each call started, finished and how many ran at once.

Providers made with the ``providers`` fixture are checked at teardown: every request they
got satisfied the transcript invariants (each tool call answered exactly once, in call
order: R-TOOL-7), so every test guards pairing whatever else it checks.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from greenroom.actors.providers.scripted import ScriptedProvider, ScriptStep
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.port import SessionPort
from greenroom.actors.runtime.session import RunStream, Session
from greenroom.actors.runtime.trace_sink import LEDGER_FILE_NAME
from greenroom.protocols.content import TextBlock, ToolCallBlock
from greenroom.protocols.context import (
    Message,
    ModelRequest,
    ToolResult,
    UserMessage,
)
from greenroom.protocols.outputs import Output
from greenroom.protocols.tools import Tool, ToolContext, make_tool

RUN_TIMEOUT_S = 10.0
"""Bound on every wait of these tests: a hang fails the test instead of the suite."""

OutT = TypeVar("OutT")

LIVE_ONLY = {"partial_text", "partial_thinking", "partial_tool_call", "tool_progress"}


# -- host ------------------------------------------------------------------------------------


@asynccontextmanager
async def open_host(data_dir: Path) -> AsyncIterator[Host]:
    """A host on ``data_dir``; closing it flushes every trace file and the ledger."""
    async with Host.open(data_dir) as host:
        yield host


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
async def host(data_dir: Path) -> AsyncIterator[Host]:
    async with open_host(data_dir) as opened:
        yield opened


@pytest.fixture
def providers() -> Iterator[Callable[[Sequence[ScriptStep] | ScriptStep], ScriptedProvider]]:
    """A factory of scripted providers; at teardown none of them saw a request that broke
    the transcript invariants (R-TOOL-7 on every path the test took)."""
    made: list[ScriptedProvider] = []

    def make(script: Sequence[ScriptStep] | ScriptStep) -> ScriptedProvider:
        provider = ScriptedProvider(script)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        assert_no_violations(provider)


def assert_no_violations(provider: ScriptedProvider) -> None:
    assert provider.violations == [], provider.violations


# -- outputs ---------------------------------------------------------------------------------


async def collect(stream: RunStream, bound_s: float | None = RUN_TIMEOUT_S) -> list[Output]:
    """Every output of a run, once it has ended (bounded).

    Tests on an autojump ``MockClock`` pass ``bound_s=None``: the trace sink's worker
    threads leave the run loop idle, so the clock would jump straight to any deadline."""
    if bound_s is None:
        return await stream.collect()
    with trio.fail_after(bound_s):
        return await stream.collect()


def of_type(outputs: Sequence[Output], cls: type[OutT]) -> list[OutT]:
    return [o for o in outputs if isinstance(o, cls)]


def types(outputs: Sequence[Output], *, traced_only: bool = True) -> list[str]:
    return [o.TYPE for o in outputs if not (traced_only and o.TYPE in LIVE_ONLY)]


def traced(outputs: Sequence[Output]) -> list[Output]:
    return [o for o in outputs if type(o).TRACED]


def index_of(outputs: Sequence[Output], predicate: Callable[[Output], bool]) -> int:
    for i, output in enumerate(outputs):
        if predicate(output):
            return i
    raise AssertionError("no output matches")


def is_output(type_name: str, **fields: Any) -> Callable[[Output], bool]:
    def check(output: Output) -> bool:
        return type_name == output.TYPE and all(
            getattr(output, k, None) == v for k, v in fields.items()
        )

    return check


class Recorder:
    """Subscribes to a session and records every output; tests ``await wait_for(...)``.

    The listener runs synchronously inside the supervisor's flush, so an awaited output
    has been emitted (and traced) by the time ``wait_for`` returns.
    """

    def __init__(self, session: Session) -> None:
        self.outputs: list[Output] = []
        self._waiters: list[tuple[Callable[[Output], bool], trio.Event, list[Output]]] = []
        self.unsubscribe = session.subscribe(self._on_batch)

    def _on_batch(self, batch: list[Output]) -> None:
        for output in batch:
            self.outputs.append(output)
            for predicate, event, found in self._waiters:
                if not event.is_set() and predicate(output):
                    found.append(output)
                    event.set()

    async def wait_for(
        self, type_name: str, *, bound_s: float | None = RUN_TIMEOUT_S, **fields: Any
    ) -> Output:
        """The first output of this type with these field values, once emitted. Pass
        ``bound_s=None`` on an autojump clock (see :func:`collect`)."""
        predicate = is_output(type_name, **fields)
        for output in self.outputs:
            if predicate(output):
                return output
        event = trio.Event()
        found: list[Output] = []
        self._waiters.append((predicate, event, found))
        with trio.fail_after(bound_s) if bound_s is not None else contextlib.nullcontext():
            await event.wait()
        return found[0]

    def seen(self, type_name: str, **fields: Any) -> bool:
        predicate = is_output(type_name, **fields)
        return any(predicate(o) for o in self.outputs)


# -- requests --------------------------------------------------------------------------------


def last_user(request: ModelRequest) -> UserMessage:
    message = request.messages[-1]
    assert isinstance(message, UserMessage), message
    return message


def results_of(message: Message) -> list[ToolResult]:
    return [p for p in message.content if isinstance(p, ToolResult)]


def texts_of(message: Message) -> list[str]:
    return [p.text for p in message.content if isinstance(p, TextBlock)]


def result_text(result: ToolResult) -> str:
    return "".join(b.text for b in result.content if isinstance(b, TextBlock))


# -- trace and ledger ------------------------------------------------------------------------


def trace_lines(session: Session) -> list[dict[str, Any]]:
    """The session's current trace file, one dict per line (every line must be JSON)."""
    text = session.trace_path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def cut_after(trace: Path, last: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Keep ``trace`` up to its first record for which ``last`` holds: the file a host that
    stopped right after that record leaves (the file store writes every record in order,
    at once)."""
    records = [json.loads(line) for line in trace.read_text("utf-8").splitlines()]
    end = next(i for i, r in enumerate(records) if last(r))
    kept = records[: end + 1]
    trace.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    return kept


def ledger_rows(data_dir: Path, session_id: str | None = None) -> list[dict[str, Any]]:
    """Rows of the usage ledger (table ``usage`` in ``<data_dir>/usage.sqlite``), in order."""
    conn = sqlite3.connect(data_dir / LEDGER_FILE_NAME)
    conn.row_factory = sqlite3.Row
    try:
        query = "SELECT * FROM usage"
        params: tuple[str, ...] = ()
        if session_id is not None:
            query += " WHERE session_id = ?"
            params = (session_id,)
        return [dict(row) for row in conn.execute(query + " ORDER BY id", params)]
    finally:
        conn.close()


def hold_after_first(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str
) -> tuple[trio.Event, trio.Event]:
    """The next call of ``owner``'s coroutine function ``name`` waits, once it has
    returned, until the test lets it go on; later calls run as they are. Returns (done,
    let_go)."""
    done, let_go = trio.Event(), trio.Event()
    original: Callable[..., Awaitable[Any]] = getattr(owner, name)

    async def done_then_wait(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        if not done.is_set():
            done.set()
            await let_go.wait()
        return result

    monkeypatch.setattr(owner, name, done_then_wait)
    return done, let_go


async def answer_meeting_a_close(
    monkeypatch: pytest.MonkeyPatch,
    host: Host,
    session_id: str,
    answer: Callable[[], Awaitable[None]],
    found: trio.Event,
    let_answer: trio.Event,
    *,
    stage: str,
) -> None:
    """Run ``answer``, held once it found its request pending (``found``; ``let_answer``
    lets it go on), into the host's close of ``session_id``: the close begun and held
    (``stage`` ``"closing"``) or done (``"closed"``) before the answer goes on, then
    let end. Returns once both have."""
    closing, let_close = hold_after_first(monkeypatch, Session, "aclose")
    closed = trio.Event()

    async def close() -> None:
        await host.close_session(session_id)
        closed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        await found.wait()
        nursery.start_soon(close)
        await closing.wait()  # the host lists the session no more
        if stage == "closed":
            let_close.set()
            await closed.wait()
        let_answer.set()
        await trio.testing.wait_all_tasks_blocked()  # when closing: the answer waits
        let_close.set()


# -- tools -----------------------------------------------------------------------------------


def allow_all(call: ToolCallBlock) -> str:
    return "allow"


class Gates:
    """Tools whose calls block until the test releases them, by the call's ``key``.

    Records the start order, the finish order, how many calls run at this moment and the
    most that ever ran at once. ``report`` keeps each call's progress callback so a test
    can send a note after the call has finished (R-TOOL-6).
    """

    def __init__(self) -> None:
        self._release: dict[str, trio.Event] = {}
        self._started: dict[str, trio.Event] = {}
        self.start_order: list[str] = []
        self.finish_order: list[str] = []
        self.running = 0
        self.peak = 0
        self.report: dict[str, Callable[[str], None]] = {}
        self.cancelled: list[str] = []
        self._counts: dict[int, trio.Event] = {}

    def _event(self, table: dict[str, trio.Event], key: str) -> trio.Event:
        if key not in table:
            table[key] = trio.Event()
        return table[key]

    def release(self, key: str) -> None:
        self._event(self._release, key).set()

    async def started(self, key: str) -> None:
        with trio.fail_after(RUN_TIMEOUT_S):
            await self._event(self._started, key).wait()

    async def started_count(self, n: int) -> None:
        """Wait until ``n`` calls have started."""
        if len(self.start_order) >= n:
            return
        with trio.fail_after(RUN_TIMEOUT_S):
            await self._event_n(n).wait()

    def _event_n(self, n: int) -> trio.Event:
        if n not in self._counts:
            self._counts[n] = trio.Event()
        return self._counts[n]

    def is_started(self, key: str) -> bool:
        return key in self.start_order

    def tool(self, name: str = "wait", *, parallel: bool = True, progress: bool = False) -> Tool:
        gates = self

        async def wait(key: str, ctx: ToolContext) -> str:
            gates.start_order.append(key)
            gates.report[key] = ctx.report_progress
            gates.running += 1
            gates.peak = max(gates.peak, gates.running)
            gates._event(gates._started, key).set()
            gates._event_n(len(gates.start_order)).set()
            try:
                if progress:
                    ctx.report_progress(f"{key} halfway")
                await gates._event(gates._release, key).wait()
            except trio.Cancelled:
                gates.cancelled.append(key)
                raise
            finally:
                gates.running -= 1
            gates.finish_order.append(key)
            return f"done {key}"

        wait.__doc__ = "Wait until the test releases this key."
        return make_tool(wait, parallel=parallel, name=name)


@pytest.fixture
def gates() -> Gates:
    return Gates()


class Lookup:
    """A parallel-safe ``lookup(key)`` tool that counts its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

        async def lookup(key: str) -> str:
            """Look up a key."""
            self.calls.append(key)
            return f"value-{key}"

        self.tool = make_tool(lookup, parallel=True)


@pytest.fixture
def lookup() -> Lookup:
    return Lookup()


# -- timing and trace helpers (retry, interrupt phases, recovery) ----------------------------


class Timeline:
    """Subscribes to a session and records ``(trio.current_time(), output)`` for every
    output as it is emitted. Under a ``MockClock`` the times are exact virtual times."""

    def __init__(self, session: Session) -> None:
        self.entries: list[tuple[float, Output]] = []
        self.unsubscribe = session.subscribe(self._on_batch)

    def _on_batch(self, batch: list[Output]) -> None:
        now = trio.current_time()
        self.entries.extend((now, output) for output in batch)

    def times_of(self, type_name: str) -> list[float]:
        return [t for t, o in self.entries if type_name == o.TYPE]


def port_of(session: Session) -> SessionPort:
    """The session's runtime seam (:class:`SessionPort`), for tests that stand in for part
    of the runtime: its trace, its publication."""
    return session.host.port(session.id)


async def assert_trace_seq_without_gaps(session: Session) -> list[dict[str, Any]]:
    """R-TRACE-1: the current trace file's ``seq`` runs 1, 2, 3… with no gap.

    Syncs the trace first: on an autojump ``MockClock`` a task's final (bounded) sync can
    be cut short by the clock jumping to its deadline while the writer thread works."""
    await port_of(session).sync_trace()
    lines = trace_lines(session)
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    return lines


def model_error(kind: str, message: str | None = None, **fields: Any) -> Any:
    """A classified model failure for a scripted ``Reply(fail=…)``."""
    from greenroom.protocols.stream import ModelError

    return ModelError(kind=kind, message=message or f"{kind} failure", **fields)  # type: ignore[arg-type]
