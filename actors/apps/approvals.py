"""``greenroom approvals``, ``approve`` and ``answer``: people answer from the command line
whenever they can (R-HITL-2).

::

    greenroom approvals [--data-dir D] [--json]
    greenroom approve SESSION_ID CALL_ID allow|deny|allow_session [--data-dir D] [--json]
    greenroom answer SESSION_ID CALL_ID TEXT… [--data-dir D] [--json]

``approvals`` lists the requests that wait for a person in the data dir's sessions — tool
calls to decide, the model's questions (``ask_user``) and calls in doubt after a crash
(R-EFFECT-2: answered ``done``, ``not done`` or ``run again``) — read from their traces: it
starts no host, needs no model credentials and changes nothing, so it works on a data dir
it cannot write.

``approve`` and ``answer`` answer one request (recorded with ``principal`` the OS user's
name) and then follow the session's task, which resumes from its trace, to its end on the
terminal: its outputs as ``greenroom run`` shows them (``--json``: as JSON lines), the
closing summary, and ``run``'s exit code for the task's end. When the task asks a person
again, a terminal asks at once (as ``run --approve ask`` does: y / n / a, or the answer to
a question); without a terminal — or at end of input — the request is left waiting in the
trace, the command says how to answer it and exits 0 once the task waits only for people.
A subagent's request cannot wait that way (its task lives in this process): without a
terminal the task is interrupted instead.

The session is opened with the tools it was created with (``session.json`` names them),
taken from the built-in ones and those of ``--tools`` / ``--mcp-config``: a session that
was given tools of its own needs them again here, and the command warns about any it
cannot give.

Exit codes: the task's as for ``run`` (0 also when it waits for a person again); 1 when the
call waits for no answer (answered already, timed out, its task ended); 2 for a usage error
(an unknown session, a decision for a question or text for an approval, an answer outside
the question's choices, missing credentials).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import math
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import attrs
import trio

from greenroom.actors.apps.asking import (
    TerminalApprover,
    answer_hint,
    asker_of,
    chosen_answer,
    question_of,
)
from greenroom.actors.apps.exits import (
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    print_error,
)
from greenroom.actors.apps.parser import check_session_id
from greenroom.actors.apps.render import (
    HumanRenderer,
    JsonRenderer,
    Renderer,
    clip,
    color_enabled,
    summary_line,
)
from greenroom.actors.apps.run import (
    READER_GONE,
    RunOptions,
    collect_tools,
    data_dir_from,
    interrupt_on_sigint,
    is_default_data_dir,
    mcp_servers,
    prepare_options,
    report_shell_confinement,
    stdout_for_renderer,
)
from greenroom.actors.runtime import (
    ConfigurationError,
    Disk,
    FileTraceStore,
    Host,
    NotPending,
    Session,
    SessionNotFound,
    SessionOpenElsewhere,
    SessionStore,
)
from greenroom.actors.tools import ask_user
from greenroom.protocols.content import ToolCallBlock
from greenroom.protocols.outputs import ApprovalDecision, ApprovalRequest, Output, TaskEnd
from greenroom.protocols.people import (
    ASK_USER,
    PendingApproval,
    answered_with_text,
    waiting_requests,
)
from greenroom.protocols.task import fold

__all__ = [
    "answer_command",
    "approvals_command",
    "approve_command",
    "how_to_answer",
    "stored_requests",
]

ARGUMENT_LINES = 12
"""How many lines of a call's pretty-printed arguments a listing shows."""

ARGUMENT_CHARS = 200
"""How much of one string argument a listing shows."""


# -- reading what waits -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StoredRequests:
    """What waits for a person in a data dir (oldest first), and the sessions that could
    not be read (one line each, naming the session and why)."""

    requests: tuple[PendingApproval, ...]
    problems: tuple[str, ...]


async def stored_requests(data_dir: Path, session_id: str | None = None) -> StoredRequests:
    """The requests that wait for a person in the sessions of ``data_dir`` (only
    ``session_id``'s when given), read from the latest trace of each, as a host that
    loaded them would list them (``host.pending_approvals``). Reads only: no host, no
    credentials, nothing written."""
    store = FileTraceStore(data_dir)
    entries = await store.catalog.list_sessions()
    parents = {e.session_id: (e.meta or {}).get("parent_id") for e in entries}
    found: list[PendingApproval] = []
    problems: list[str] = []
    for entry in sorted(entries, key=lambda e: e.session_id):
        if session_id is not None and entry.session_id != session_id:
            continue
        if entry.meta is None:
            problems.append(f"unreadable session {entry.session_id}: {entry.problem}")
            continue
        try:
            trace = await store.log.read_latest(entry.session_id)
        except OSError as exc:
            problems.append(f"unreadable trace of session {entry.session_id}: {exc}")
            continue
        recorded = fold(trace.records).recorded()
        if recorded.run_id is None:
            continue  # no task open: nothing can wait
        found.extend(
            waiting_requests(
                recorded.pending_people,
                recorded.allowed,
                session_id=entry.session_id,
                origin=_origin(entry.session_id, parents),
                running=False,  # read from the trace: no supervisor runs its calls here
            )
        )
    found.sort(key=lambda p: (p.asked_at or 0.0, p.session_id, p.call_id))
    return StoredRequests(requests=tuple(found), problems=tuple(problems))


def _origin(session_id: str, parents: Mapping[str, Any]) -> tuple[str, ...]:
    """The session ids from the root to ``session_id`` (R-HOST-4)."""
    path = [session_id]
    parent = parents.get(session_id)
    while isinstance(parent, str) and parent not in path:
        path.append(parent)
        parent = parents.get(parent)
    return tuple(reversed(path))


# -- greenroom approvals ------------------------------------------------------------------


def approvals_command(args: argparse.Namespace) -> int:
    """``greenroom approvals``: what waits for a person, one block per request (``--json``:
    one object per request, the fields of :class:`PendingApproval`); exit 0."""
    data_dir = data_dir_from(args.data_dir)
    stored = trio.run(stored_requests, data_dir)
    for problem in stored.problems:  # one bad session never hides the others
        print_error(problem)
    if args.json:
        for request in stored.requests:
            print(json.dumps(attrs.asdict(request), ensure_ascii=False))
        return EXIT_OK
    if not stored.requests:
        print_error(f"no approvals or questions wait for a person in {data_dir}")
        return EXIT_OK
    now = time.time()
    print("\n\n".join(describe(request, data_dir, now=now) for request in stored.requests))
    return EXIT_OK


def describe(request: PendingApproval, data_dir: Path, *, now: float) -> str:
    """One request as ``greenroom approvals`` shows it: who asks what since when, the
    call's arguments (or the question and its choices), and the command that answers."""
    what = {"question": "question", "in_doubt": f"{request.tool} in doubt"}.get(
        request.kind, f"{request.kind} of {request.tool}"
    )
    head = f"session {request.session_id} · call {request.call_id} · {what}"
    if request.asked_at is not None:
        head += f" · asked {_when(request.asked_at, now)}"
    lines = [head]
    if len(request.origin) > 1:
        lines.append(f"  in a subagent of session {request.origin[0]}")
    if answered_with_text(request.kind):
        question, choices = question_of(request.arguments)
        asker = asker_of(request.kind)
        lines.append(f"  {asker}: " + "\n    ".join(question.splitlines()))
        lines.extend(f"    {number}) {choice}" for number, choice in enumerate(choices, 1))
        if request.kind == "in_doubt":
            # What the call was asked to do, and the key to look its effect up by.
            call = request.arguments.get("arguments")
            shown = call if isinstance(call, Mapping) else {}
            lines.extend("  " + line for line in pretty_arguments(shown))
            lines.append(f"  idempotency key: {request.arguments.get('idempotency_key')}")
            if request.arguments.get("check_error"):
                lines.append(f"  its check gave no answer: {request.arguments['check_error']}")
    else:
        lines.extend("  " + line for line in pretty_arguments(request.arguments))
    lines.append("  answer: " + how_to_answer(request, data_dir))
    return "\n".join(lines)


def pretty_arguments(arguments: Mapping[str, Any]) -> list[str]:
    """A call's arguments as indented JSON, long strings clipped and at most
    :data:`ARGUMENT_LINES` lines (the rest counted): readable at a glance, never a page."""
    text = json.dumps(_clipped(arguments), indent=2, ensure_ascii=False)
    lines = [clip(line, ARGUMENT_CHARS + 40) for line in text.splitlines()]
    if len(lines) > ARGUMENT_LINES + 1:
        more = len(lines) - ARGUMENT_LINES
        lines = [*lines[:ARGUMENT_LINES], f"… {more} more lines"]
    return lines


def _clipped(value: Any) -> Any:
    if isinstance(value, str):
        return clip(value, ARGUMENT_CHARS)
    if isinstance(value, Mapping):
        return {key: _clipped(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_clipped(item) for item in value]
    return value


def _when(asked_at: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(asked_at))
    seconds = max(0, int(now - asked_at))
    if seconds < 60:
        ago = "just now"
    elif seconds < 3600:
        ago = f"{seconds // 60} min ago"
    elif seconds < 86400:
        ago = f"{seconds // 3600} h ago"
    else:
        ago = f"{seconds // 86400} d ago"
    return f"{stamp} ({ago})"


def how_to_answer(request: PendingApproval, data_dir: Path) -> str:
    """The command that answers ``request`` (with ``--data-dir`` when not the default),
    ready to paste: an approval's with ``allow`` and the other decisions named after it."""
    where = ""
    if not is_default_data_dir(data_dir):
        where = f"--data-dir {shlex.quote(str(data_dir))} "
    ids = f"{shlex.quote(request.session_id)} {shlex.quote(request.call_id)}"
    if request.kind == "in_doubt":
        return f"greenroom answer {where}{ids} done  (or 'not done', 'run again')"
    if request.kind == "question":
        return f"greenroom answer {where}{ids} TEXT"
    return f"greenroom approve {where}{ids} allow  (or deny, allow_session)"


# -- greenroom approve / answer -----------------------------------------------------------


def approve_command(args: argparse.Namespace) -> int:
    """``greenroom approve SESSION_ID CALL_ID DECISION``: see the module docstring."""
    return _answer_command(args, verdict=args.decision, text=None)


def answer_command(args: argparse.Namespace) -> int:
    """``greenroom answer SESSION_ID CALL_ID TEXT…``: see the module docstring."""
    return _answer_command(args, verdict=None, text=" ".join(args.text))


@attrs.frozen(kw_only=True)
class _Answer:
    """One person's answer, as the command line gave it."""

    session_id: str
    call_id: str
    verdict: str | None
    text: str | None
    by: str
    digest: str | None


def _answer_command(args: argparse.Namespace, *, verdict: str | None, text: str | None) -> int:
    session_id: str = args.session_id
    check_session_id(session_id, what="SESSION_ID")
    data_dir = data_dir_from(args.data_dir)
    request = trio.run(_waiting_request, data_dir, session_id, args.call_id)
    if isinstance(request, str):
        print_error(f"greenroom {args.command}: {request}")
        return EXIT_FAILED
    text = _checked_answer(request, verdict, text, data_dir)
    tools = _session_tools(args, data_dir, session_id)
    options = prepare_options(
        RunOptions(
            prompt="",
            data_dir=data_dir,
            session_id=session_id,
            tools=tuple(tools),
            mcp_servers=mcp_servers(args.mcp_config),
            json=args.json,
            observers=getattr(args, "observers", ()),
        )
    )
    answer = _Answer(
        session_id=session_id,
        call_id=request.call_id,
        verdict=verdict,
        text=text,
        by=_person(),
        digest=getattr(args, "digest", None),
    )
    with stdout_for_renderer() as out:
        return trio.run(_answer_and_follow, options, answer, args.command, out)


async def _waiting_request(data_dir: Path, session_id: str, call_id: str) -> PendingApproval | str:
    """The request ``call_id`` of the session, as its trace has it waiting; why not (a
    line for the user) when it waits for no answer. Raises :class:`UsageError` for a
    session the data dir does not hold."""
    if not await FileTraceStore(data_dir).catalog.exists(session_id):
        raise UsageError(f"no session {session_id!r} in {data_dir}")
    stored = await stored_requests(data_dir, session_id)
    for problem in stored.problems:
        raise UsageError(problem)
    for request in stored.requests:
        if request.call_id == call_id:
            return request
    why = (
        f"call {call_id!r} of session {session_id} waits for no answer: it was answered, "
        "it timed out, or its task ended"
    )
    others = ", ".join(f"{r.call_id} ({r.tool})" for r in stored.requests)
    return f"{why}; waiting in this session: {others}" if others else why


def _checked_answer(
    request: PendingApproval, verdict: str | None, text: str | None, data_dir: Path
) -> str | None:
    """The answer's text as it will be given (a choice named by its number becomes the
    choice); raises :class:`UsageError` for an answer of the wrong kind or outside the
    question's choices."""
    question = answered_with_text(request.kind)
    if verdict is not None and question:
        what = (
            "is in doubt: say whether it took effect"
            if request.kind == "in_doubt"
            else "is a question of the model, answered with text"
        )
        raise UsageError(f"call {request.call_id} {what}: " + how_to_answer(request, data_dir))
    if text is None:
        return None
    if not question:
        raise UsageError(
            f"call {request.call_id} asks for a decision, not text: "
            + how_to_answer(request, data_dir)
        )
    _, choices = question_of(request.arguments)
    chosen = chosen_answer(text, choices)
    if chosen is None:
        raise UsageError(f"call {request.call_id}: {answer_hint(choices)}")
    return chosen


def _session_tools(args: argparse.Namespace, data_dir: Path, session_id: str) -> list[Any]:
    """The tools the session is opened with: of the built-in tools (``ask_user``
    included) and those of ``--tools``, the ones ``session.json`` names — the session's
    own set, never a wider one; all of them when it names none. Warns about the tools
    the session had that none of these gives (MCP tools come with ``--mcp-config``)."""
    tools = collect_tools(args.tools, builtin=not args.no_builtin_tools,
                          a2a_agents=args.a2a_agent)
    if not args.no_builtin_tools and all(t.name != ASK_USER for t in tools):
        tools.append(ask_user)
    names = _stored_tool_names(data_dir, session_id)
    if not names:
        return tools
    kept = [t for t in tools if t.name in names]
    offered = {t.name for t in kept}
    missing = [
        name
        for name in names
        if name not in offered and not (name.startswith("mcp__") and args.mcp_config)
    ]
    if missing:
        print_error(
            f"warning: session {session_id} was created with tools not offered now: "
            f"{', '.join(missing)} (give them with --tools or --mcp-config)"
        )
    return kept


def _stored_tool_names(data_dir: Path, session_id: str) -> list[str]:
    """The names of the tools ``session.json`` lists; [] when it cannot be read (the host
    reports that properly when it loads the session)."""
    try:
        path = SessionStore(data_dir).meta_path(session_id)
        meta = json.loads(Disk().read(path).decode("utf-8"))
    except (OSError, ValueError):  # a FIFO too: refused, never waited on
        return []
    names = meta.get("tools") if isinstance(meta, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _person() -> str:
    """Who answers: the OS user's name, or ``cli`` when it cannot be told."""
    try:
        return getpass.getuser() or "cli"
    except Exception:  # no name for this uid (a container): still someone at the CLI
        return "cli"


async def _answer_and_follow(
    options: RunOptions, answer: _Answer, command: str, out: TextIO
) -> int:
    async with Host.open(
        data_dir=options.data_dir, observers=options.observers, tools=options.tools
    ) as host:
        try:
            session = await host.load_session(answer.session_id, mcp_servers=options.mcp_servers)
        except (SessionNotFound, SessionOpenElsewhere) as exc:
            print_error(f"greenroom {command}: {exc}")
            return EXIT_USAGE
        except (ConfigurationError, ImportError) as exc:
            print_error(f"greenroom {command}: cannot set up the session: {exc}")
            return EXIT_USAGE
        report_shell_confinement(options)
        print_error(f"session: {session.id}")
        renderer: Renderer = (
            JsonRenderer(out)
            if options.json
            else HumanRenderer(out, sys.stderr, tools=session.tools)
        )
        follower = Follower(
            host,
            session,
            renderer,
            by=answer.by,
            data_dir=options.data_dir,
            interactive=_is_terminal(sys.stdin),
        )

        async def give() -> None:
            if answer.text is not None:
                await host.answer_question(session.id, answer.call_id, answer.text, answer.by)
            else:
                assert answer.verdict is not None
                await host.answer_approval(
                    session.id,
                    answer.call_id,
                    answer.verdict,  # type: ignore[arg-type]  # the parser's choices
                    answer.by,
                    digest=answer.digest,
                )

        try:
            return await follower.run(give)
        except NotPending as exc:
            print_error(f"greenroom {command}: {exc}")
            return EXIT_FAILED


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class Follower:
    """Follows a session's resumed task on the terminal until its end — or until it waits
    only for people that nobody here answers (see the module docstring).

    The task's outputs arrive through a watch of the session (subscribed before the
    answer is given, so nothing is missed). Whether the task waits for people once more
    is told by the session going idle while still busy (parked, R-HITL-3): after each
    answer given here, a task of its own waits for the session to go idle and puts an
    empty batch among the outputs; the file store publishes a batch before the task can
    park, so every request that made it park has come through by then."""

    def __init__(
        self,
        host: Host,
        session: Session,
        renderer: Renderer,
        *,
        by: str,
        data_dir: Path,
        interactive: bool,
    ) -> None:
        self._host = host
        self._session = session
        self._renderer = renderer
        self._by = by
        self._data_dir = data_dir
        self._asker = TerminalApprover(renderer) if interactive else None
        # Unbounded: the session publishes with send_nowait and must never wait for the
        # terminal; a task's outputs are bounded by its work.
        self._send, self._receive = trio.open_memory_channel[list[Output]](math.inf)
        self._nursery: trio.Nursery | None = None
        self._waiting: dict[str, ApprovalRequest] = {}
        self._end: TaskEnd | None = None
        self._answers = 0  # answers given here; each is followed by one idle mark
        self._marks = 0
        self._asking = 0  # questions open on the terminal
        self._reader_gone: BrokenPipeError | None = None

    async def run(self, give: Callable[[], Awaitable[None]]) -> int:
        """Give the first answer (``give``; its :class:`NotPending` propagates), follow
        the task, and return the exit code."""
        session = self._session
        session.watch(self._send)
        await give()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(interrupt_on_sigint, self._host, session, self._asker)
            self._expect_idle()
            parked = await self._follow()
            nursery.cancel_scope.cancel()
        if self._reader_gone is not None:
            raise self._reader_gone  # main() ends quietly
        if parked:
            self._report_waiting()
            return EXIT_OK
        end = self._end
        print_error(summary_line(end, session.trace_path, color=color_enabled(sys.stderr)))
        return EXIT_CODES.get(end.status, EXIT_FAILED) if end is not None else EXIT_FAILED

    async def _follow(self) -> bool:
        """Show the outputs until the task's end (False) or until it is parked with
        nobody here to answer (True)."""
        async for batch in self._receive:
            if not batch:  # an idle mark
                self._marks += 1
                if self._parked():
                    return True
                continue
            for output in batch:
                self._show(output)
                self._note(output)
            if self._end is not None:
                return False
        return False

    def _show(self, output: Output) -> None:
        if self._reader_gone is not None:
            return  # the task is ending: its last records go to the trace only
        try:
            self._renderer.show(output)
        except BrokenPipeError as exc:
            self._reader_gone = exc
            self._session.interrupt(READER_GONE)

    def _note(self, output: Output) -> None:
        if isinstance(output, ApprovalRequest):
            self._waiting[output.call_id] = output
            self._asked(output)
        elif isinstance(output, ApprovalDecision):
            self._waiting.pop(output.call_id, None)
        elif isinstance(output, TaskEnd) and output.origin is None:
            self._end = output

    def _parked(self) -> bool:
        """Whether the task waits only for people, with no question open here: every
        answer given here has been followed by its idle mark, and the session is idle
        yet busy."""
        return (
            self._end is None
            and self._asking == 0
            and self._marks >= self._answers
            and self._session.busy
        )

    def _asked(self, request: ApprovalRequest) -> None:
        assert self._nursery is not None
        if self._asker is not None:
            self._asking += 1
            self._nursery.start_soon(self._ask, self._asker, request)
        elif request.origin is not None:
            # A subagent's task never parks: nobody could answer it once this command ends.
            print_error(
                f"a subagent asks about {request.tool} (call {request.call_id}) and no one "
                "can answer it here: the task is interrupted (answer on a terminal instead)"
            )
            self._session.interrupt("a subagent's request cannot wait without a terminal")

    async def _ask(self, asker: TerminalApprover, request: ApprovalRequest) -> None:
        """Ask the person at the terminal and answer with what they say; at end of input
        the request is left waiting."""
        call = ToolCallBlock(id=request.call_id, name=request.tool, arguments=request.arguments)
        host, by = self._host, self._by
        try:
            if answered_with_text(request.kind):
                text = await asker.answer_question(call, asker_of(request.kind))
                if text is not None:
                    await host.answer_question(request.session_id, call.id, text, by)
            else:
                verdict = await asker.ask(call)
                if verdict is not None:
                    await host.answer_approval(
                        request.session_id,
                        call.id,
                        verdict,  # type: ignore[arg-type]  # the approver's y / n / a
                        by,
                    )
        except NotPending as exc:  # answered meanwhile: the timeout policy, an interrupt
            print_error(f"not answered: {exc}")
        finally:
            self._asking -= 1
            self._expect_idle()

    def _expect_idle(self) -> None:
        assert self._nursery is not None
        self._answers += 1
        self._nursery.start_soon(self._mark_idle)

    async def _mark_idle(self) -> None:
        await self._session.wait_idle()
        # Closed once the session's watches end (the host closing): no mark is needed.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._send.send_nowait([])

    def _report_waiting(self) -> None:
        waiting = list(self._waiting.values())
        if not waiting:
            print_error("the task waits for a person: greenroom approvals lists what")
            return
        for request in waiting:
            pending = PendingApproval(
                session_id=request.session_id,
                call_id=request.call_id,
                tool=request.tool,
                arguments=request.arguments,
                asked_at=request.asked_at,
                origin=request.origin or (request.session_id,),
                kind=request.kind,
            )
            what = {"question": "a question", "in_doubt": f"{request.tool} in doubt"}.get(
                request.kind, request.tool
            )
            print_error(
                f"waiting for a person: {what} (call {request.call_id}); answer with: "
                + how_to_answer(pending, self._data_dir)
            )
