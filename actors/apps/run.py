"""One task from the terminal: ``greenroom run`` and what ``demo`` and ``chat`` share with
it — the options, the tools, the session opened or continued, Ctrl-C and a reader that
went away."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shlex
import shutil
import signal
import stat
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

import attrs
import trio

from greenroom.actors.apps.asking import TerminalApprover, approver_for
from greenroom.actors.apps.exits import (
    EXIT_ABORTED,
    EXIT_AUTH,
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_USAGE,
    MAX_INPUT_BYTES,
    UsageError,
    mib,
    print_error,
)
from greenroom.actors.apps.parser import ALLOW_ALL_SOURCE, check_session_id
from greenroom.actors.apps.render import (
    HumanRenderer,
    JsonRenderer,
    Renderer,
    color_enabled,
    summary_line,
)
from greenroom.actors.providers import (
    PROVIDERS,
    default_provider_name,
)
from greenroom.actors.runtime import (
    AuthLocked,
    Busy,
    ConfigurationError,
    Disk,
    GreenroomError,
    Host,
    ProviderLimits,
    Session,
    SessionNotFound,
    SessionObserver,
    SessionOpenElsewhere,
    SessionStore,
    default_data_dir,
    spawn_subagent,
)
from greenroom.actors.tools import (
    AttachmentError,
    McpConfigError,
    ToolLoadError,
    ask_user,
    builtin_tools,
    load_config_files,
    load_tools,
)
from greenroom.actors.tools import (
    attach_resources as attach_mcp_resources,
)
from greenroom.protocols.errors import OutputSchemaError
from greenroom.protocols.outputs import (
    TaskEnd,
)
from greenroom.protocols.prices import Price, PriceError, parse_prices
from greenroom.protocols.structured import OutputSpec, output_spec
from greenroom.protocols.tools import Tool, json_error_reason
from greenroom.protocols.wording import special_file_words


def data_dir_from(value: str | None) -> Path:
    """The absolute data dir ``--data-dir`` names, or the default one when it names none.
    Raises :class:`UsageError` when the default is wanted and there is no home directory to
    hold it (no ``$HOME`` and no account entry, as for a container's numeric user)."""
    if value:
        return Path(value).expanduser().absolute()
    try:
        return default_data_dir().absolute()
    except RuntimeError:  # pathlib: "Could not determine home directory."
        named = os.environ.get("GREENROOM_HOME")
        if named:
            raise UsageError(
                f"GREENROOM_HOME={named!r}: cannot expand its ~: no such user, or no home "
                "directory"
            ) from None
        raise UsageError(
            "there is no home directory for the default data dir (~/.greenroom): "
            "choose one with --data-dir or $GREENROOM_HOME"
        ) from None


def is_default_data_dir(data_dir: Path) -> bool:
    """Whether ``data_dir`` is the one a command uses without ``--data-dir`` (commands it
    prints for pasting then leave the flag out); never, when there is no default."""
    try:
        return data_dir.absolute() == default_data_dir().absolute()
    except RuntimeError:  # no home directory: no default data dir
        return False


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
    prices: Mapping[str, Price] | None = None
    max_cost_usd: float | None = None
    provider_limits: ProviderLimits | None = None
    output_schema: OutputSpec | None = None
    """``--output-schema``: the answer must match it (R-OUT-1); stdout then carries only
    the answer's JSON, and the conversation goes to stderr."""


@attrs.frozen(kw_only=True)
class RunResult:
    """How a run went: the exit code, and where to find its record."""

    exit_code: int
    session_id: str | None = None
    trace_path: Path | None = None
    task_end: TaskEnd | None = None


def run_command(args: argparse.Namespace) -> int:
    """``greenroom run``: one task on the prompt of the arguments or stdin; its exit code."""
    words: list[str] = args.prompt
    if not words or words == ["-"]:
        if not words and sys.stdin.isatty():
            raise UsageError("no prompt: give PROMPT or pipe it on stdin")
        prompt = prompt_from_stdin()
    else:
        prompt = " ".join(words)
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return run_task(run_options(args, prompt)).exit_code


def run_options(args: argparse.Namespace, prompt: str) -> RunOptions:
    """The options of ``run`` (and ``chat``) from the parsed command line."""
    if args.session is not None:
        check_session_id(args.session)
    approve = args.approve or ("ask" if sys.stdin.isatty() else "none")
    schema_file = getattr(args, "output_schema", None)
    if schema_file is not None and getattr(args, "json", False):
        raise UsageError(
            "--output-schema prints the answer's JSON alone on stdout and --json every "
            "output: give one of them (with --json, task_end.output holds the answer)"
        )
    return RunOptions(
        prompt=prompt,
        data_dir=data_dir_from(args.data_dir),
        session_id=args.session,
        provider=args.provider,
        model=args.model,
        base_url=args.base_url,
        workspace=args.workspace,
        system=args.system,
        tools=tuple(
            collect_tools(
                args.tools, builtin=not args.no_builtin_tools, questions=approve == "ask",
                a2a_agents=args.a2a_agent,
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
        prices=prices_file(args.prices),
        max_cost_usd=args.max_cost_usd,
        provider_limits=provider_limits(args),
        output_schema=None if schema_file is None else output_schema_file(schema_file),
    )


def prompt_from_stdin() -> str:
    """``run``'s prompt from stdin: at most :data:`MAX_INPUT_BYTES` of UTF-8 text, or a
    :class:`UsageError` that says which of these it is not (whatever encoding the locale or
    ``PYTHONIOENCODING`` gives ``sys.stdin``: the bytes are read and decoded here)."""
    too_large = f"the prompt on stdin is larger than {mib(MAX_INPUT_BYTES)}"
    source = getattr(sys.stdin, "buffer", None)
    if source is None:  # a text stream put in its place (in-process callers)
        text: str = sys.stdin.read(MAX_INPUT_BYTES + 1)
        if len(text) > MAX_INPUT_BYTES:
            raise UsageError(too_large)
        return text
    data: bytes = source.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise UsageError(too_large)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"the prompt on stdin is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}): convert it first, for example with iconv"
        ) from None


def flag_file_problem(status: os.stat_result, max_bytes: int = MAX_INPUT_BYTES) -> str | None:
    """Why a file with ``status`` cannot be a flag's file, in the words of ``strerror``:
    a FIFO or a device would be waited on or read for ever, so only regular files (and,
    for the callers' own message, directories) pass; a regular one must fit in
    ``max_bytes``."""
    mode = status.st_mode
    if stat.S_ISDIR(mode):
        return os.strerror(errno.EISDIR)
    if not stat.S_ISREG(mode):
        return special_file_words(mode)
    if status.st_size > max_bytes:
        return f"it is larger than {mib(max_bytes)}"
    return None


def read_regular_file(path: str | Path, *, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the file at ``path`` (``~`` expanded), read once from the file opened:
    raises :class:`OSError` (``strerror`` says why, ``filename`` is ``path``) when it cannot
    be opened, is not a regular file (refused before any read: opening does not wait for a
    FIFO's writer) or holds more than ``max_bytes``. (A file the host wrote, of any size,
    is read by :meth:`Disk.read`.)"""
    where = str(path)
    target = Path(path).expanduser()
    problem = flag_file_problem(os.stat(target), max_bytes)
    if problem is not None:  # refused unopened: opening a device may act on it
        raise OSError(errno.EINVAL, problem, where)
    fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        problem = flag_file_problem(os.fstat(fd), max_bytes)  # what was opened, if changed
        if problem is not None:
            raise OSError(errno.EINVAL, problem, where)
        chunks: list[bytes] = []
        size = 0
        # Up to one byte past the bound: a file in /proc says its size is 0.
        while size <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"it is larger than {mib(max_bytes)}", where)
    return data


def read_flag_file(path: str | Path) -> str:
    """The UTF-8 text of the file at ``path`` (``~`` expanded): :func:`read_regular_file`
    within :data:`MAX_INPUT_BYTES`, then :class:`UnicodeDecodeError` when it is not
    UTF-8."""
    return read_regular_file(path).decode("utf-8")


def flag_file_text(flag: str, path: str) -> str:
    """:func:`read_flag_file` for ``flag``: a file it cannot read is a :class:`UsageError`
    naming the flag, the file and why."""
    try:
        return read_flag_file(path)
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        raise UsageError(
            f"{flag}: {path}: not UTF-8 text (byte 0x{bad:02x} at offset {exc.start})"
        ) from None
    except OSError as exc:
        raise UsageError(f"{flag}: {path}: cannot read it: {exc.strerror or exc}") from None


def output_schema_file(path: str) -> OutputSpec:
    """The answer a ``--output-schema`` file requires (R-OUT-1); a file that cannot be
    read or used is a :class:`UsageError` naming it and the problem."""
    raw = flag_file_text("--output-schema", path)
    try:
        schema = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"--output-schema: {path}: not JSON: {json_error_reason(exc)}") from None
    try:
        return output_spec(schema)
    except OutputSchemaError as exc:
        raise UsageError(f"--output-schema: {path}: {exc}") from None


def prices_file(path: str | None) -> dict[str, Price] | None:
    """The prices of a ``--prices`` file (R-SHARE-3), None without one; a file that cannot
    be read or used is a :class:`UsageError` naming it and the problem."""
    if path is None:
        return None
    raw = flag_file_text("--prices", path)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"--prices: {path}: not JSON: {json_error_reason(exc)}") from None
    try:
        return parse_prices(data)
    except PriceError as exc:
        raise UsageError(f"--prices: {path}: {exc}") from None




def provider_limits(args: argparse.Namespace) -> ProviderLimits | None:
    """The limits of ``--max-concurrent-requests`` and ``--requests-per-minute`` (``run``,
    ``serve``); None when neither is given (or the command has neither)."""
    concurrent = getattr(args, "max_concurrent_requests", None)
    per_minute = getattr(args, "requests_per_minute", None)
    if concurrent is None and per_minute is None:
        return None
    return ProviderLimits(max_concurrent_requests=concurrent, requests_per_minute=per_minute)


def mcp_servers(paths: Sequence[str]) -> Mapping[str, Any]:
    """The servers of the ``--mcp-config`` files. A bad entry is a warning on stderr naming
    the file, the JSON path and why, and is skipped (R-MCP-6); a file that cannot be read or
    is not JSON is a :class:`UsageError` naming it."""

    def warn(message: str) -> None:
        print_error(f"warning: --mcp-config: {message}")

    for path in paths:
        refuse_unsafe_flag_file("--mcp-config", path)
    try:
        return load_config_files(paths, warn)
    except McpConfigError as exc:
        raise UsageError(f"--mcp-config: {exc}") from None


def refuse_unsafe_flag_file(flag: str, path: str) -> None:
    """Refuse, before its loader reads it, a file ``flag`` names that is a FIFO, a device or
    too large (:func:`flag_file_problem`), as a :class:`UsageError`; the loader reports
    everything else in its own words (a file that is missing, a directory, not UTF-8, not
    JSON)."""
    try:
        status = os.stat(Path(path).expanduser())  # not opened: a device's open may act
    except OSError:
        return
    problem = None if stat.S_ISDIR(status.st_mode) else flag_file_problem(status)
    if problem is not None:
        raise UsageError(f"{flag}: {path}: {problem}")


def collect_tools(
    specs: Sequence[str],
    *,
    builtin: bool = True,
    questions: bool = False,
    a2a_agents: Sequence[str] = (),
) -> list[Tool]:
    """The built-in tools and ``spawn_subagent`` (unless ``builtin`` is False) — with
    ``ask_user`` too when ``questions`` (a person can answer the model's questions) — the
    tools of each ``--tools`` spec, and one per ``--a2a-agent`` URL whose card can be read
    (R-PROTO-1; one that cannot is reported on stderr and left out); a later tool replaces
    an earlier one of the same name. Raises :class:`UsageError` naming the spec when one
    cannot be loaded."""
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
        except SystemExit as exc:  # the module's own code called sys.exit() as it loaded
            raise UsageError(
                f"--tools: importing {spec} called sys.exit({exc.code!r}): a tool module "
                "must not exit when it is imported"
            ) from None
        for loaded_tool in loaded:
            tools[loaded_tool.name] = loaded_tool
    if a2a_agents:
        from greenroom.actors.tools import a2a_tools  # loaded only when asked for

        for remote in a2a_tools(a2a_agents):
            tools[remote.name] = remote
    return list(tools.values())


def run_task(options: RunOptions) -> RunResult:
    """Open a host, create or load the session, run one task to its end and render it
    (``greenroom run`` and ``greenroom demo``).

    Raises :class:`UsageError` for a command line that cannot run (missing credentials, a
    workspace that is not a directory); an unknown session is reported and gives exit
    code 2 in the result. What the tools print goes to stderr while the task runs: stdout
    carries only what the renderer writes (with ``--json``, JSON lines and nothing else)."""
    options = prepare_options(options)
    with stdout_for_renderer() as out:
        return trio.run(_run_task, options, out)


@contextlib.contextmanager
def stdout_for_renderer() -> Iterator[TextIO]:
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
    raises :class:`UsageError` when either is missing. A command that goes on to work says
    what :func:`report_shell_confinement` says once its setup is complete, so that a
    mistake in the setup stays one line."""
    if options.workspace is not None:
        workspace = Path(options.workspace).expanduser()
        if not workspace.is_dir():
            raise UsageError(f"--workspace: {options.workspace} is not a directory")
        options = attrs.evolve(options, workspace=str(workspace.resolve()))
    check_credentials(options)
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


def report_shell_confinement(options: RunOptions) -> None:
    """One line on stderr as a command starts its work when ``run_shell`` is offered and
    bubblewrap is missing: with ``auto`` its commands run unconfined, with ``required``
    they are refused."""
    if not any(t.name == "run_shell" for t in options.tools) or bubblewrap_available():
        return
    sandbox = options.sandbox
    if sandbox is None and options.session_id is not None:
        sandbox = _stored_settings(options.data_dir, options.session_id).get("sandbox")
    sandbox = sandbox or "auto"
    if sandbox == "auto":
        print_error(
            "warning: run_shell is not confined: bubblewrap (bwrap) is not installed, so "
            "its commands run with your permissions (--sandbox required refuses them instead)"
        )
    elif sandbox == "required":
        print_error(
            "warning: run_shell will refuse every command: --sandbox required and "
            "bubblewrap (bwrap) is not installed"
        )


def _stored_settings(data_dir: Path, session_id: str) -> dict[str, Any]:
    """The stored settings of a session, or {} when it cannot be read (the host then
    reports the missing session properly, and one that is not a regular file as such)."""
    try:
        path = SessionStore(data_dir).meta_path(session_id)
        meta = json.loads(Disk().read(path).decode("utf-8"))
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
            ("max_cost_usd", options.max_cost_usd),
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
        print_error(
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
    except (SessionNotFound, SessionOpenElsewhere) as exc:
        print_error(f"greenroom: --session: {exc}")
        return None
    except (ConfigurationError, ImportError) as exc:
        print_error(f"greenroom: cannot set up the session: {exc}")
        return None
    print_error(f"session: {session.id}")
    for problem in session.load_errors:
        print_error(f"warning: corrupt trace line skipped: {problem}")
    return session


async def _run_task(options: RunOptions, out: TextIO) -> RunResult:
    return await leaving_in_bounded_time(
        _run_in_host(options, out), lambda result: result.exit_code, out
    )


async def _run_in_host(options: RunOptions, out: TextIO) -> RunResult:
    async with Host.open(
        data_dir=options.data_dir,
        observers=options.observers,
        prices=options.prices,
        limits=options.provider_limits,
    ) as host:
        session = await open_reported_session(host, options)
        if session is None:
            return RunResult(exit_code=EXIT_USAGE, session_id=options.session_id)
        report_shell_confinement(options)
        structured = options.output_schema
        # With --output-schema stdout is the answer's alone: the conversation is stderr's.
        shown = sys.stderr if structured is not None else out
        renderer: Renderer = (
            JsonRenderer(out)
            if options.json
            else HumanRenderer(shown, sys.stderr, tools=session.tools)
        )
        approve = approver_for(
            options.approve, renderer, allow_all_source=options.allow_all_source
        )
        try:
            # ``@server:uri`` words attach MCP resources (R-MCP-5), read before the task.
            prompt = await attach_mcp_resources(options.prompt, session.tools)
        except AttachmentError as exc:
            print_error(f"error: {exc}")
            return RunResult(exit_code=EXIT_USAGE, session_id=session.id)
        try:
            stream = session.run(prompt, approve=approve, output_schema=structured)
        except AuthLocked as exc:
            print_error(str(exc))
            return RunResult(exit_code=EXIT_AUTH, session_id=session.id)
        except OutputSchemaError as exc:
            print_error(f"greenroom: --output-schema: {exc}")
            return RunResult(exit_code=EXIT_USAGE, session_id=session.id)
        except GreenroomError as exc:
            print_error(refusal_words(exc, session.id, options.data_dir))
            return RunResult(exit_code=EXIT_FAILED, session_id=session.id)
        end: TaskEnd | None = None
        asking = approve if isinstance(approve, TerminalApprover) else None
        reader_gone: BrokenPipeError | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(interrupt_on_sigint, host, session, asking)
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
        if structured is not None and end is not None and end.output is not None:
            out.write(json.dumps(end.output, ensure_ascii=False) + "\n")
        trace_path = session.trace_path
        print_error(summary_line(end, trace_path, color=color_enabled(sys.stderr)))
        code = EXIT_CODES.get(end.status, EXIT_FAILED) if end is not None else EXIT_FAILED
        return RunResult(exit_code=code, session_id=session.id, trace_path=trace_path, task_end=end)


def refusal_words(exc: GreenroomError, session_id: str, data_dir: Path) -> str:
    """Why a session refuses a new task, in the command line's words. A session that is
    busy when a command starts one has a task waiting for a person (parked, R-HITL-3):
    the words name the commands that list and answer what waits."""
    if not isinstance(exc, Busy):
        return str(exc)
    where = ""
    if not is_default_data_dir(data_dir):
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


async def interrupt_on_sigint(
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
            print_error(
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
    print_error("interrupted again: leaving now")
    try:
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + LEAVE_GRACE_S
            # The host owns its trace store; closing it is the one point where no write is in
            # flight, and nothing after it waits for the tools.
            await host.trace_store.aclose()
    finally:
        _exit_now(EXIT_ABORTED)


def _exit_now(code: int, streams: Sequence[TextIO] = ()) -> NoReturn:
    """End the process with ``code`` without unwinding anything (trio would wait for the
    tasks left behind): the directories of :func:`remove_when_leaving` are removed and the
    output streams flushed first."""
    for path in _REMOVED_WHEN_LEAVING:
        shutil.rmtree(path, ignore_errors=True)
    for stream in (*streams, sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


LEAVE_POLL_S = 0.01
"""How often a leave that waits for the tasks left behind looks whether they have ended."""

_T = TypeVar("_T")


async def leaving_in_bounded_time(
    work: Awaitable[_T], exit_code: Callable[[_T], int], *streams: TextIO
) -> _T:
    """What ``work`` returns (or raises) — the whole of a command's trio run but its end,
    its host opened and closed (every record written) — unless the run's end would wait
    for ever for tasks left behind: tools a task abandoned because they ignore the
    interrupt (R-SEC-2), still running in trio's system tasks, which trio waits for once the
    main task has returned and which no Ctrl-C reaches then. They get :data:`LEAVE_GRACE_S`
    to end; then the process exits with the code the command documents — ``exit_code`` of
    the result, 130 for an interrupt (at once: a Ctrl-C asks not to wait), 141 for a reader
    that went away, 1 with the traceback for any other error — with ``streams`` flushed. A
    Ctrl-C while it waits leaves at once (exit 130). Must be awaited by the main task."""
    try:
        result = await work
    except BaseException as exc:
        leaves = list(exception_leaves(exc))
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
            if not await _ended_within(0.0, streams):
                print_error("interrupted")
                _exit_now(EXIT_ABORTED, streams)
        elif not await _ended_within(LEAVE_GRACE_S, streams):
            if any(isinstance(leaf, BrokenPipeError) for leaf in leaves):
                _exit_now(EXIT_BROKEN_PIPE, streams)  # quietly, as main() ends then
            traceback.print_exception(exc)
            _exit_now(EXIT_FAILED, streams)
        raise
    if not await _ended_within(LEAVE_GRACE_S, streams):
        _exit_now(exit_code(result), streams)
    return result


async def _ended_within(grace_s: float, streams: Sequence[TextIO]) -> bool:
    """Whether no task is left behind, or none is any more within ``grace_s``; a Ctrl-C
    meanwhile leaves at once (exit 130)."""
    try:
        own = await _trio_own_task()
        with trio.move_on_after(grace_s):
            # Looked at, not awaited: trio offers no wait for the end of a system task.
            while _left_behind(own):  # noqa: ASYNC110
                await trio.sleep(LEAVE_POLL_S)
            return True
        return not _left_behind(own)
    except KeyboardInterrupt:
        print_error("interrupted: leaving now")
        _exit_now(EXIT_ABORTED, streams)


def _left_behind(own: trio.lowlevel.Task) -> list[trio.lowlevel.Task]:
    """The tasks trio's run would wait for after the calling (main) task has returned: the
    system tasks, but ``own`` (trio's own, which ends with the run)."""
    main = trio.lowlevel.current_task()
    root = trio.lowlevel.current_root_task()
    return [
        task
        for nursery in (root.child_nurseries if root is not None else ())
        for task in nursery.child_tasks
        if task is not main and task is not own
    ]


async def _trio_own_task() -> trio.lowlevel.Task:
    """The system task in which trio runs the ``run_sync_soon`` callbacks (found as the
    task one of them runs in: trio gives it no public name)."""
    found: list[trio.lowlevel.Task] = []
    ran = trio.Event()

    def note() -> None:
        found.append(trio.lowlevel.current_task())
        ran.set()

    trio.lowlevel.current_trio_token().run_sync_soon(note)
    await ran.wait()
    return found[0]


def exception_leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions ``exc`` holds, groups opened to their leaves (or ``exc`` itself)."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from exception_leaves(inner)
    else:
        yield exc
