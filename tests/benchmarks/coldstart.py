"""Cold start: ``greenroom run`` from process start to its first output, ``greenroom serve``
to listening, and what they import.

    .venv/bin/python -m tests.benchmarks.coldstart [--quick] [--reps 7] [--no-lean-http]

Each repetition starts a fresh ``greenroom run --provider anthropic --base-url <mock>
--approve all --json PROMPT`` (the mock model server unpaced, the reference workload) and
measures, from just before the process is started: the first byte on its stdout (the first
output), its exit, and its CPU (user + system of the child); then a fresh ``greenroom serve
--port 0`` and the time to its ``listening on`` line (it is then stopped with SIGTERM).
Then ``python -X importtime`` of the CLI module (what ``greenroom`` imports before it parses
its arguments) and of the whole run, listing the largest cumulative imports. Figures are
medians. ``--no-lean-http`` runs the provider's SDK path instead (``GREENROOM_LEAN_HTTP=0``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.common import (
    ROOT,
    MockServer,
    arg_parser,
    median,
    print_machine,
    print_table,
    write_json,
)

GREENROOM = Path(sys.executable).with_name("greenroom")
TARGET_FIRST_OUTPUT_S = 0.8
"""R-PERF-1: ``greenroom run`` to its first output, the median of the cold runs."""


def _one_run(base_url: str, data_dir: str, workspace: str) -> dict[str, float]:
    env = dict(os.environ, ANTHROPIC_API_KEY="bench", GREENROOM_HOME=data_dir)
    cmd = [
        str(GREENROOM),
        "run",
        "--provider",
        "anthropic",
        "--base-url",
        base_url,
        "--model",
        "mock-model",
        "--approve",
        "all",
        "--workspace",
        workspace,
        "--data-dir",
        data_dir,
        "--json",
        "Look up keys 1 and 2 and summarise.",
    ]
    before = os.times()
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=workspace, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - started
    proc.stdout.read()
    proc.wait()
    total = time.perf_counter() - started
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    if proc.returncode != 0:
        raise RuntimeError(f"greenroom run exited {proc.returncode}")
    return {"first_output_s": first, "exit_s": total, "cpu_s": cpu}


def _one_serve(data_dir: str, workspace: str) -> float:
    """Seconds from the start of ``greenroom serve --port 0`` to its ``listening on`` line."""
    env = dict(os.environ, ANTHROPIC_API_KEY="bench", GREENROOM_HOME=data_dir)
    cmd = [
        str(GREENROOM), "serve", "--host", "127.0.0.1", "--port", "0", "--no-console",
        "--data-dir", data_dir, "--workspace", workspace,
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=workspace, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    listening = 0.0
    for line in proc.stderr:
        if line.startswith(b"listening on"):
            listening = time.perf_counter() - started
            break
    proc.send_signal(signal.SIGTERM)
    proc.stderr.read()
    proc.wait()
    if not listening:
        raise RuntimeError(f"greenroom serve exited {proc.returncode} without listening")
    return listening


def _importtime(code: str) -> tuple[float, list[tuple[str, float]]]:
    """Total import time of ``code`` and the largest top-level imports (cumulative)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, ANTHROPIC_API_KEY="bench"),
        check=True,
    ).stderr
    tops: list[tuple[str, float]] = []
    total = 0.0
    for line in out.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if not match:
            continue
        cumulative = int(match.group(2)) / 1e6
        depth = len(match.group(3))
        if depth <= 1:
            tops.append((match.group(4), cumulative))
            total += cumulative
    tops.sort(key=lambda t: -t[1])
    return total, tops[:12]


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (default 7; quick 3)")
    parser.add_argument(
        "--no-lean-http",
        action="store_true",
        help="the provider's SDK path (GREENROOM_LEAN_HTTP=0)",
    )
    args = parser.parse_args()
    if args.no_lean_http:
        os.environ["GREENROOM_LEAN_HTTP"] = "0"
    reps = args.reps or (3 if args.quick else 7)
    print_machine()
    samples: list[dict[str, float]] = []
    with MockServer("--workload", "reference") as server, tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        for rep in range(reps):
            s = _one_run(server.base_url, str(Path(tmp) / "data"), str(workspace))
            s["serve_listening_s"] = _one_serve(str(Path(tmp) / "serve-data"), str(workspace))
            samples.append(s)
            print(
                f"  rep {rep + 1}/{reps}: first output {s['first_output_s'] * 1000:.0f} ms, "
                f"exit {s['exit_s'] * 1000:.0f} ms, cpu {s['cpu_s'] * 1000:.0f} ms; serve "
                f"listening {s['serve_listening_s'] * 1000:.0f} ms",
                flush=True,
            )
    row = {key: median(s[key] for s in samples) for key in samples[0]}
    cli_total, cli_tops = _importtime("import greenroom.actors.apps.cli")
    run_total, run_tops = _importtime(
        "import greenroom.actors.apps.cli, greenroom.actors.runtime.host, "
        "greenroom.actors.providers.anthropic"
    )
    print_table(f"greenroom run and serve, cold (medians of {reps})", [row])
    met = row["first_output_s"] <= TARGET_FIRST_OUTPUT_S
    print(
        f"  greenroom run to its first output: target <= {TARGET_FIRST_OUTPUT_S:g} s "
        f"{'met' if met else 'not met'}"
    )
    print_table(
        f"imports of the CLI module ({cli_total * 1000:.0f} ms in all)",
        [{"module": m, "cumulative_ms": 1000 * t} for m, t in cli_tops],
    )
    print_table(
        f"imports of a run with the anthropic provider ({run_total * 1000:.0f} ms in all)",
        [{"module": m, "cumulative_ms": 1000 * t} for m, t in run_tops],
    )
    result: dict[str, Any] = {
        "lean_http": not args.no_lean_http,
        "reps": reps,
        "run": row,
        "target_met": met,
        "samples": samples,
        "cli_import_s": cli_total,
        "cli_imports": cli_tops,
        "run_import_s": run_total,
        "run_imports": run_tops,
    }
    write_json("coldstart", result)


if __name__ == "__main__":
    main()
