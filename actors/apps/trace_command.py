"""``greenroom sessions`` and ``greenroom trace``: what the data dir holds, read without
running anything."""

from __future__ import annotations

import argparse
import json
import sys
import time

import attrs

from greenroom.actors.apps.exits import EXIT_OK, UsageError, print_error
from greenroom.actors.apps.parser import is_session_id, not_a_session_id
from greenroom.actors.apps.render import format_record
from greenroom.actors.apps.run import data_dir_from
from greenroom.actors.runtime import FileTraceStore, Host
from greenroom.protocols.converter import to_json

# -- sessions and trace ---------------------------------------------------------------------


async def sessions_command(args: argparse.Namespace) -> int:
    """``greenroom sessions``: the data dir's sessions, as a table or one JSON object each."""
    async with Host.open(data_dir=data_dir_from(args.data_dir)) as host:
        scan = await host.scan_sessions()
        data_dir = host.data_dir
    infos = scan.sessions
    for bad in scan.unreadable:  # one bad file never hides the others
        print_error(f"unreadable session {bad.session_id}: {bad.reason}")
    if args.json:
        for info in infos:
            print(json.dumps(attrs.asdict(info), ensure_ascii=False))
        return EXIT_OK
    if not infos:
        if not scan.unreadable:  # else "no sessions" would deny the one just named
            print_error(f"no sessions in {data_dir}")
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


async def trace_command(args: argparse.Namespace) -> int:
    """``greenroom trace``: a session's latest trace, one line (or JSON object) a record."""
    session_id: str = args.session_id
    if not is_session_id(session_id):
        raise UsageError(not_a_session_id(session_id))
    data_dir = data_dir_from(args.data_dir)
    # The file store itself, not a host: reading starts no writer, creates nothing and
    # needs no write permission on the data dir. (Disk.read refuses what is not a
    # regular file: a FIFO or /dev/zero is one line, not a hang.)
    store = FileTraceStore(data_dir)
    if not await store.catalog.exists(session_id):
        raise UsageError(f"no session {session_id!r} in {data_dir}")
    path = store.log.location(session_id)
    try:
        trace = await store.log.read_latest(session_id)
    except OSError as exc:
        raise UsageError(
            f"{exc.filename or path}: cannot read it: {exc.strerror or exc}"
        ) from None
    if not trace.records and not trace.errors:
        print_error(f"session {session_id} has no trace yet")
        return EXIT_OK
    print_error(f"trace: {path}")
    for record in trace.records:
        print(to_json(record) if args.json else format_record(record))
    sys.stdout.flush()
    for problem in trace.errors:
        print_error(problem)
    return EXIT_OK
