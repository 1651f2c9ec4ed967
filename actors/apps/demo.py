"""``greenroom demo``: the main job on the embedded default, in a few seconds.

It writes a small workspace — three sales CSV files and a README — and asks the agent to
"summarize the sales CSV files in this workspace: total revenue per region". Without
``ANTHROPIC_API_KEY`` the built-in scripted model answers (and the demo says so plainly);
with a key the same task runs on Claude. The run goes through the same renderer as
``greenroom run``: streamed text, each tool call with its approval and its slot in the
tool pool, the results, and a closing summary with the trace location.

The workspace and the data dir go to a fresh temp directory unless ``--workspace`` and
``--data-dir`` name them. That directory is removed when the demo ends, however it ends
(completed, failed, a usage error, Ctrl-C, the reader of its output gone); ``--data-dir``
keeps the trace for ``greenroom trace``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from greenroom.actors.apps.exits import UsageError, print_error
from greenroom.actors.apps.parser import ALLOW_ALL_SOURCE
from greenroom.actors.apps.run import (
    RunOptions,
    check_credentials,
    collect_tools,
    provider_for,
    remove_when_leaving,
    run_task,
)
from greenroom.actors.providers import DEMO_PROMPT
from greenroom.protocols.wording import decision_words

DEMO_SYSTEM = (
    "You are a careful data assistant working in the user's workspace through tools. "
    "Look before you read, read independent files in parallel (several tool calls in one "
    "message), compute exactly, and answer briefly with a small table."
)

# (date, region, product, units, unit_price): one file per region, six rows each.
SALES: dict[str, list[tuple[str, str, str, int, str]]] = {
    "sales_north.csv": [
        ("2024-03-01", "North", "Widget", 12, "19.99"),
        ("2024-03-02", "North", "Gadget", 5, "49.50"),
        ("2024-03-05", "North", "Widget", 8, "19.99"),
        ("2024-03-09", "North", "Gizmo", 3, "120.00"),
        ("2024-03-14", "North", "Gadget", 7, "49.50"),
        ("2024-03-20", "North", "Widget", 15, "18.75"),
    ],
    "sales_south.csv": [
        ("2024-03-01", "South", "Gizmo", 4, "120.00"),
        ("2024-03-03", "South", "Widget", 20, "19.99"),
        ("2024-03-07", "South", "Gadget", 9, "49.50"),
        ("2024-03-11", "South", "Widget", 6, "19.99"),
        ("2024-03-16", "South", "Gizmo", 2, "125.00"),
        ("2024-03-22", "South", "Gadget", 11, "47.00"),
    ],
    "sales_west.csv": [
        ("2024-03-02", "West", "Widget", 9, "19.99"),
        ("2024-03-04", "West", "Gizmo", 6, "120.00"),
        ("2024-03-08", "West", "Gadget", 3, "49.50"),
        ("2024-03-12", "West", "Widget", 14, "18.75"),
        ("2024-03-18", "West", "Gizmo", 1, "125.00"),
        ("2024-03-25", "West", "Gadget", 10, "47.00"),
    ],
}

README = """Sales workspace (created by `greenroom demo`)

sales_north.csv, sales_south.csv, sales_west.csv: March 2024 sales, one file per region.
Columns: date, region, product, units, unit_price (in EUR). Revenue = units x unit_price.
"""


def write_demo_workspace(directory: Path) -> list[Path]:
    """Write the demo's CSV files and README into ``directory`` (created if needed,
    existing files of the same names replaced); returns the CSV paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for name, rows in SALES.items():
        lines = ["date,region,product,units,unit_price"]
        lines.extend(f"{d},{r},{p},{u},{price}" for d, r, p, u, price in rows)
        path = directory / name
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    (directory / "README.txt").write_text(README, encoding="utf-8")
    return paths


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo for ``greenroom demo``'s parsed arguments; returns the exit code."""
    check_credentials(
        RunOptions(
            prompt=DEMO_PROMPT,
            data_dir=Path(),
            provider=args.provider,
            model=args.model,
            base_url=args.base_url,
        )
    )
    base: Path | None = None
    try:
        if args.workspace is None or args.data_dir is None:
            base = Path(tempfile.mkdtemp(prefix="greenroom-demo-"))
            remove_when_leaving(base)  # a second Ctrl-C leaves without unwinding
        return _demo(args, base)
    finally:
        if base is not None:
            shutil.rmtree(base, ignore_errors=True)


def _demo(args: argparse.Namespace, base: Path | None) -> int:
    workspace = Path(args.workspace).expanduser() if args.workspace else _under(base, "workspace")
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else _under(base, "data")
    try:
        csv_files = write_demo_workspace(workspace)
    except FileExistsError:  # made as a directory where a file is
        raise UsageError(f"--workspace: {workspace} is not a directory") from None
    except OSError as exc:
        where = workspace if exc.filename is None else exc.filename
        raise UsageError(
            f"--workspace: cannot write the demo files: {where}: {exc.strerror or exc}"
        ) from None
    provider = provider_for(args.provider, args.model)
    say = print_error if args.json else _say
    say("greenroom demo")
    if provider == "scripted":
        say(
            "No ANTHROPIC_API_KEY is set, so this runs greenroom's built-in scripted model: "
            "a deterministic stand-in that runs in-process, with no network and no key. "
            "With ANTHROPIC_API_KEY set, the same task runs on Claude."
        )
    else:
        say(f"Running the task on the {provider} provider.")
    temporary = "  (temporary: removed when the demo ends)"
    say(f"  workspace  {workspace}  ({len(csv_files)} CSV files and README.txt)"
        + (temporary if not args.workspace else ""))
    say(f"  data dir   {data_dir}" + (temporary if not args.data_dir else ""))
    # Without --approve the demo itself allows every call, and its decisions say so.
    approve = args.approve or "all"
    allow_all_source = "the demo" if args.approve is None else ALLOW_ALL_SOURCE
    if approve == "all":
        approval = "all: every tool call is allowed (try --approve ask to decide each one)"
    elif approve == "ask":
        approval = "ask: you decide each tool call (y / n / a = always for this session)"
    else:
        approval = (
            f"none: nobody is asked, so every tool call is "
            f"{decision_words('deny', 'default')} (the agent has to cope without tools)"
        )
    say(f"  approval   {approval}")
    say(f"  task       {DEMO_PROMPT}")
    say("")

    options = RunOptions(
        prompt=DEMO_PROMPT,
        data_dir=data_dir,
        provider=provider,
        model=args.model,
        base_url=args.base_url,
        workspace=str(workspace),
        system=DEMO_SYSTEM,
        tools=tuple(collect_tools(())),
        approve=approve,
        allow_all_source=allow_all_source,
        json=args.json,
    )

    result = run_task(options)
    if result.session_id is None or result.trace_path is None:
        return result.exit_code
    say("")
    if not args.data_dir:
        say(
            "The demo's temporary directory is removed now; to keep the trace of a run, "
            "give it a place: greenroom demo --data-dir DIR"
        )
        return result.exit_code
    say(f"The trace of this run is in {result.trace_path}")
    say(f"  greenroom trace {result.session_id} --data-dir {data_dir}")
    if args.workspace:
        say(
            f'  greenroom run --session {result.session_id} --data-dir {data_dir} "…"   '
            "(continue the session)"
        )
    return result.exit_code


def _under(base: Path | None, name: str) -> Path:
    assert base is not None  # made whenever a directory was not given
    return base / name


def _say(text: str) -> None:
    print(text, flush=True)


__all__ = ["DEMO_PROMPT", "SALES", "run_demo", "write_demo_workspace"]
