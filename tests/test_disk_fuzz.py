"""Seeded damage to a stored session's files (R-SEC-1, R-TRACE-4): a host must load what
it can of a trace or a ``session.json`` that was cut, garbled, reordered or edited by hand,
report what it cannot in words (a :class:`GreenroomError`, or the session's
``load_errors``), and never end — nor let the damage reach another session.

One source data dir holds three sessions: one with finished tasks (tool calls, a denied
call, an interrupted task), one whose task waits for a person (parked), and one left
alone. Each case copies it, damages one file of the first two sessions in one drawn way,
and opens a host on the copy: it lists the sessions, asks for the pending requests, loads
the damaged session and runs a task on it (which must end, in any status), then runs a
task on the untouched session, which must complete. Bounded: a fixed number of cases.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import allow_all, collect, of_type

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text, tool_call
from greenroom.actors.runtime.errors import GreenroomError
from greenroom.actors.runtime.host import Host
from greenroom.actors.runtime.trace_sink import LedgerUnusable
from greenroom.protocols.outputs import TaskEnd
from greenroom.protocols.people import PEOPLE
from greenroom.protocols.tools import make_tool
from greenroom.protocols.trace import trace_file_number

CASES = 60
BOUND_S = 60


async def lookup(key: str) -> str:
    """Look ``key`` up."""
    return f"value-{key}"


LOOKUP = make_tool(lookup, parallel=True)


def _calm() -> ScriptedProvider:
    return ScriptedProvider(lambda request: Reply(blocks=(text("Fine."),)))


async def _build(data_dir: Path, workspace: Path) -> tuple[str, str, str]:
    """The source data dir; the ids of the finished, the parked and the untouched session."""
    script = [
        Reply(blocks=(text("Looking."), tool_call("c1", "lookup", key="a"))),
        Reply(blocks=(tool_call("c2", "lookup", key="b"), tool_call("c3", "lookup", key="c"))),
        Reply(blocks=(text("Done with a, b and c."),)),
        Reply(blocks=(tool_call("c4", "lookup", key="d"),)),
    ]
    async with Host.open(data_dir) as host:
        finished = await host.create_session(
            provider=ScriptedProvider(script), tools=[LOOKUP], workspace_dir=workspace
        )

        def deny_c3(call: Any) -> str:
            return "deny" if call.id == "c3" else "allow"

        await collect(finished.run("look a, b and c up", approve=deny_c3))

        def interrupt(call: Any) -> str:
            finished.interrupt("enough")
            return "allow"

        await collect(finished.run("and d", approve=interrupt))
        parked = await host.create_session(
            provider=ScriptedProvider([Reply(blocks=(tool_call("p1", "lookup", key="e"),))]),
            tools=[LOOKUP],
            workspace_dir=workspace,
        )
        parked.run("look e up", approve=PEOPLE).detach()
        while not (await host.pending_approvals()):
            await parked.wait_idle()
        untouched = await host.create_session(provider=_calm(), workspace_dir=workspace)
        await collect(untouched.run("hello"))
        return finished.id, parked.id, untouched.id


Damage = Callable[[bytes, random.Random], bytes]


def _cut(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def _drop_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    del lines[rng.randrange(len(lines))]
    return b"".join(lines)


def _repeat_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i = rng.randrange(len(lines))
    lines.insert(rng.randrange(len(lines) + 1), lines[i])
    return b"".join(lines)


def _swap_lines(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"".join(lines)


_ODD_VALUES: list[Any] = [None, -1, 0, 2**70, "", "x" * 300, [], {}, True, 1.5, "\ud800"]


def _one_record(
    data: bytes, rng: random.Random, change: Callable[[dict[str, Any]], dict[str, Any]]
) -> bytes:
    """One drawn line of a trace, changed as a JSON object by ``change`` (bytes flipped
    instead when that line is not one)."""
    lines = _lines(data)
    i = rng.randrange(len(lines))
    try:
        record = json.loads(lines[i])
    except ValueError:
        return _flip(data, rng)
    if not isinstance(record, dict) or not record:
        return _flip(data, rng)
    line = json.dumps(change(record)).encode("utf-8", "surrogatepass")
    lines[i] = line + (b"\n" if lines[i].endswith(b"\n") else b"")
    return b"".join(lines)


def _edit_field(data: bytes, rng: random.Random) -> bytes:
    """A field of one JSON object (session.json, or a trace line) set to an odd value,
    removed, or one added: what a hand edit or another program's bug leaves."""
    try:
        whole = json.loads(data)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and whole:  # session.json
        return json.dumps(_edited(whole, rng), indent=2).encode("utf-8", "surrogatepass")
    return _one_record(data, rng, lambda record: _edited(record, rng))


def _edited(record: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    key = rng.choice(sorted(record))
    draw = rng.random()
    if draw < 0.6:
        record[key] = rng.choice(_ODD_VALUES)
    elif draw < 0.8:
        del record[key]
    else:
        record["unexpected_field"] = rng.choice(_ODD_VALUES)
    return record


def _change_type(data: bytes, rng: random.Random) -> bytes:
    """One trace record turned into another kind of record (its fields as they were)."""
    kinds = ["no_such_record"]
    for line in _lines(data):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("type"), str):
            kinds.append(record["type"])
    return _one_record(data, rng, lambda record: {**record, "type": rng.choice(kinds)})


DAMAGES: list[Damage] = [
    _cut,
    _flip,
    _drop_line,
    _repeat_line,
    _swap_lines,
    _edit_field,
    _edit_field,
    _change_type,
]


def _files(session_dir: Path) -> list[Path]:
    return [
        path
        for path in session_dir.iterdir()
        if path.name == "session.json" or trace_file_number(path.name) is not None
    ]


async def _visit(data_dir: Path, damaged: str, untouched: str, *, ledger: bool) -> None:
    """Open a host on ``data_dir`` and use it as a person would after the damage. On a
    damaged ledger the host may refuse to open, naming the file (one error, not a group),
    and nothing else."""
    try:
        async with Host.open(data_dir) as host:
            await _use(host, damaged, untouched)
    except LedgerUnusable as exc:
        assert ledger and "usage.sqlite" in str(exc), exc


async def _use(host: Host, damaged: str, untouched: str) -> None:
    await host.list_sessions()
    with contextlib.suppress(GreenroomError):
        await host.pending_approvals()
    try:
        session = await host.load_session(damaged, provider=_calm(), tools=[LOOKUP])
    except GreenroomError:
        session = None
    if session is not None:
        try:
            stream = session.run("go on", approve=allow_all)
        except GreenroomError:  # Busy: its task waits for a person
            stream = None
        if stream is not None:
            outputs = await collect(stream)
            assert of_type(outputs, TaskEnd), [o.TYPE for o in outputs]
    other = await host.load_session(untouched, provider=_calm())
    ended = await collect(other.run("still fine?"))
    assert [e.status for e in of_type(ended, TaskEnd)] == ["completed"]


@pytest.mark.parametrize("batch", range(3))
async def test_damaged_session_files_never_end_the_host(
    tmp_path: Path, workspace: Path, batch: int
) -> None:
    """R-SEC-1: a damaged trace, session.json or ledger is an error in words or a load
    error, never the end of the host or of another session."""
    source = tmp_path / "source"
    finished, parked, untouched = await _build(source, workspace)
    rng = random.Random(batch)
    for case in range(CASES // 3):
        victim = rng.choice([finished, parked])
        copy = tmp_path / f"case-{case}"
        shutil.copytree(source, copy)
        ledger = rng.random() < 0.1
        if ledger:
            target = copy / "usage.sqlite"
            damage = rng.choice((_cut, _flip))
        else:
            target = rng.choice(sorted(_files(copy / "sessions" / victim)))
            damage = rng.choice(DAMAGES)
        original = target.read_bytes()
        target.write_bytes(damage(original, rng) if original else original)
        what = f"case {case}: {damage.__name__} on {target.name} of {victim}"
        try:
            with trio.fail_after(BOUND_S):
                await _visit(copy, victim, untouched, ledger=ledger)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from exc
        except BaseException as exc:
            raise AssertionError(f"{what}: {type(exc).__name__}: {exc}") from exc
        shutil.rmtree(copy)
