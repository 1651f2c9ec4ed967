"""``greenroom fork``, ``greenroom rewind`` and ``greenroom replay`` (R-FORK-1..3).

``fork`` and ``rewind`` never ask a model: the session is opened with a provider that is
never called (:data:`NO_MODEL`), so they need no credentials and work on any session of the
data dir. ``replay`` runs the session's prompts again on the model its flags name
(:mod:`~greenroom.actors.apps.replay`) and prints the report: side by side for people, one
JSON object with ``--json``. Bad input (an unknown session, a seq the history does not
have, a busy session) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

import trio

from greenroom.actors.apps.exits import EXIT_CODES, EXIT_FAILED, EXIT_OK, UsageError, print_error
from greenroom.actors.apps.parser import check_session_id
from greenroom.actors.apps.replay import replay_session
from greenroom.actors.apps.run import collect_tools, data_dir_from, mcp_servers
from greenroom.actors.providers import PROVIDERS, default_model
from greenroom.actors.runtime import Busy, GreenroomError, Host, SeqRefused, SessionNotFound
from greenroom.actors.scripted import ScriptedProvider
from greenroom.protocols.replay import render_report
from greenroom.protocols.tools import Tool

__all__ = ["NO_MODEL", "fork_command", "replay_command", "rewind_command"]

NO_MODEL = ScriptedProvider(())
"""The provider of the sessions ``fork`` and ``rewind`` open: never asked anything."""


def fork_command(args: argparse.Namespace) -> int:
    """``greenroom fork SESSION_ID [--at SEQ]``: the new session's id on stdout."""
    check_session_id(args.session_id, what="SESSION_ID")
    return trio.run(_fork, args)


async def _fork(args: argparse.Namespace) -> int:
    async with Host.open(data_dir_from(args.data_dir), observers=args.observers) as host:
        try:
            fork = await host.fork_session(args.session_id, args.at, provider=NO_MODEL)
        except (SessionNotFound, SeqRefused) as exc:
            raise UsageError(str(exc)) from None
    assert fork.forked_from is not None
    source, seq = fork.forked_from
    if args.json:
        forked_from = {"session_id": source, "seq": seq}
        print(json.dumps({"session_id": fork.id, "forked_from": forked_from}))
    else:
        print(fork.id)
        print_error(
            f"forked {source} at seq {seq}; continue it with: "
            f"greenroom run --session {fork.id} PROMPT"
        )
    return EXIT_OK


def rewind_command(args: argparse.Namespace) -> int:
    """``greenroom rewind SESSION_ID --to SEQ``: the session continues from its history
    at SEQ; later records stay in its trace behind the rewind record."""
    check_session_id(args.session_id, what="SESSION_ID")
    return trio.run(_rewind, args)


async def _rewind(args: argparse.Namespace) -> int:
    async with Host.open(data_dir_from(args.data_dir), observers=args.observers) as host:
        try:
            session = await host.load_session(args.session_id, provider=NO_MODEL)
            record = await session.rewind(args.to, reason="rewound from the command line")
        except (SessionNotFound, SeqRefused, Busy) as exc:
            raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"session_id": session.id, "to_seq": record.to_seq, "seq": record.seq}))
    else:
        print_error(
            f"rewound {session.id} to seq {record.to_seq} (the rewind record is seq "
            f"{record.seq}; workspace files are as they are now)"
        )
    return EXIT_OK


async def _check_readable(host: Host, session_id: str) -> None:
    """A stored session whose metadata cannot be read is a :class:`UsageError` saying where
    and why, as ``fork`` and ``rewind`` say it (a missing one is the replay's to say)."""
    catalog = host.trace_store.catalog
    if not await catalog.exists(session_id):
        return
    try:
        await catalog.read_meta(session_id)
    except GreenroomError as exc:  # what the store raises for metadata it cannot use
        raise UsageError(f"session {session_id!r} is unreadable: {exc}") from None


def replay_command(args: argparse.Namespace) -> int:
    """``greenroom replay SESSION_ID --provider P [--model M]``: the report; exit 0 when
    every replayed task completed, else the first other status's code."""
    check_session_id(args.session_id, what="SESSION_ID")
    missing = PROVIDERS[args.provider].missing_credentials(args.base_url)
    if missing is not None:
        raise UsageError(missing)
    tools = collect_tools(args.tools, builtin=not args.no_builtin_tools)
    servers = mcp_servers(args.mcp_config)
    return trio.run(_replay, args, tools, servers)


async def _replay(
    args: argparse.Namespace, tools: list[Tool], servers: Mapping[str, Any]
) -> int:
    overrides: dict[str, Any] = {"model": args.model or default_model(args.provider)}
    if args.base_url is not None:
        overrides["base_url"] = args.base_url
    async with Host.open(data_dir_from(args.data_dir), observers=args.observers) as host:
        await _check_readable(host, args.session_id)
        try:
            report = await replay_session(
                host,
                args.session_id,
                tools=tools,
                provider=args.provider,
                run_tools=args.run_tools,
                mcp_servers=servers,
                **overrides,
            )
        except SessionNotFound as exc:
            raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(report.to_dict(), ensure_ascii=False))
    else:
        print(render_report(report), end="")
    statuses = [task.replay.status for task in report.tasks]
    bad = next((s for s in statuses if s != "completed"), None)
    return EXIT_OK if bad is None else EXIT_CODES.get(bad, EXIT_FAILED)
