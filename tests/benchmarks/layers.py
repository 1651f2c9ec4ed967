"""Layers: client CPU per wire event of the paced run, split by layer, from py-spy samples.

    .venv/bin/python -m tests.benchmarks.layers [--n 1000] [--gc-tuning] [--lean-http]

Runs ``scale``'s greenroom variant once (one N, one repetition) under ``py-spy record
--format raw --gil`` (``pip install py-spy``; sampling does not slow the hot path the way
cProfile does). Only the thread holding the GIL is sampled: threads parked on a lock do
not count, and neither do system calls, which release it (``scale`` reports the kernel's
share, ``sys_s``). Every sample is charged to the layer of its innermost frame (self
time); frames of generic helpers (``contextlib``, ``abc``, ``typing``, ``functools``) are
charged to their caller's layer. The layers: trio's scheduler and I/O readiness, the
socket layer, h11, httpcore2, httpx2, the SDK's response wrappers, greenroom's SSE decoder
and codec, and so on (``ours`` marks greenroom's own). A layer's share of the samples
times the run's CPU per wire event gives its µs per event. Time in the cyclic garbage
collector is measured apart (``gc.callbacks``, in ``scale``'s output): py-spy charges it to
the frame that allocated. The raw profile is kept in ``bench-results/layers-<variant>-<N>.txt``
(collapsed stacks, for a flame graph).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from tests.benchmarks.common import RESULTS_DIR, ROOT, arg_parser, print_table, write_json

STARTUP = "start-up (imports)"

# (layer, ours, path fragments of the innermost frame's file), first match wins.
LAYERS: list[tuple[str, bool, tuple[str, ...]]] = [
    ("trio channels", False, ("trio/_channel.py",)),
    ("trio sockets", False, ("trio/_socket.py", "trio/_highlevel_socket.py", "/socket.py")),
    (
        "trio scheduler, timeouts and I/O readiness",
        False,
        (
            "trio/_core/",
            "trio._core",
            "trio/_timeouts.py",
            "trio/_util.py",
            "outcome/",
            "sortedcontainers/",
        ),
    ),
    ("trio other", False, ("trio/",)),
    ("h11 (HTTP/1.1, chunked framing)", False, ("h11/",)),
    ("httpcore2 (connection, pool, exception mapping)", False, ("httpcore2/",)),
    ("httpx2 (response, byte streams)", False, ("httpx2/",)),
    (
        "anthropic SDK (requests, response wrappers, pydantic)",
        False,
        ("anthropic/", "pydantic", "typing_extensions.py", "dataclasses.py", "copy.py"),
    ),
    ("SSE decoder and Anthropic codec", True, ("protocols/sse.py", "protocols/anthropic_codec.py")),
    ("json", False, ("json/",)),
    ("turn machine and dispatch", True, ("protocols/turn.py", "turn_dispatch.py")),
    (
        "output objects (attrs)",
        True,
        ("protocols/outputs.py", "protocols/stream.py", "attrs generated", "attr/", "attrs/"),
    ),
    ("text repair", True, ("protocols/text.py",)),
    (
        "emitter, transcript and trace",
        True,
        (
            "runtime/emitter.py",
            "actors/emitter.py",
            "protocols/transcript.py",
            "trace_sink.py",
            "trace_store.py",
            "runtime/disk.py",
            "protocols/trace.py",
            "protocols/converter.py",
            "cattrs/",
        ),
    ),
    ("lean HTTP client", True, ("lean_http.py",)),
    (
        "streamer and provider adapter",
        True,
        (
            "llm_streamer.py",
            "actors/provider_",
            "providers/anthropic.py",
            "providers/anthropic_sdk.py",
            "providers/lean_wire.py",
        ),
    ),
    ("supervisor, session, tools", True, ("actors/", "protocols/")),
    ("consumer (benchmark loop)", False, ("tests/benchmarks/", "(workloads.py:", "(common.py:")),
    (STARTUP, False, ("<frozen importlib", "importlib/")),
]

GENERIC = ("contextlib.py", "/abc.py", "typing.py", "functools.py", "<frozen abc>")
"""Helpers whose samples belong to the layer that called them."""


def layer_of(frame: str) -> tuple[str, bool]:
    if not frame.strip():
        return "unnamed frames (py-spy)", False
    for name, ours, fragments in LAYERS:
        if any(f in frame for f in fragments):
            return name, ours
    return "other", False


def charged_frame(stack: str) -> str:
    """The innermost frame of a collapsed stack that is not a generic helper."""
    frames = stack.split(";")
    for frame in reversed(frames):
        if not any(g in frame for g in GENERIC):
            return frame
    return frames[-1]


def attribute(raw: str) -> Counter[tuple[str, bool]]:
    """Samples per layer from py-spy's raw (collapsed) output: ``frame;frame;... count``,
    the innermost frame last."""
    counts: Counter[tuple[str, bool]] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        counts[layer_of(charged_frame(stack))] += int(n)
    return counts


def main() -> None:
    parser = arg_parser(__doc__ or "")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--gc-tuning", action="store_true", help="the greenroom-gc variant")
    parser.add_argument("--lean-http", action="store_true", help="with the lean transport")
    parser.add_argument("--top", type=int, default=30, help="innermost frames to list")
    parser.add_argument(
        "--reuse", action="store_true", help="analyse the profile of the last run again"
    )
    args = parser.parse_args()
    variant = "greenroom" + ("-gc" if args.gc_tuning else "") + ("-lean" if args.lean_http else "")
    name = f"layers-{variant}-{args.n}"
    if args.reuse:
        raw = (RESULTS_DIR / f"{name}.txt").read_text()
        run = json.loads((RESULTS_DIR / f"{name}.json").read_text())["scale_row"]
    else:
        raw, run = profile(variant, args.n, args.rate)
    report(name, variant, args.n, raw, run, args.top)


def profile(variant: str, n: int, rate: int) -> tuple[str, dict[str, Any]]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "profile.txt"
        cmd = [
            py_spy,
            "record",
            "--format",
            "raw",
            "--gil",
            "--rate",
            str(rate),
            "--output",
            str(raw_path),
            "--",
            sys.executable,
            "-m",
            "tests.benchmarks.scale",
            "--n",
            str(n),
            "--reps",
            "1",
            "--variants",
            variant,
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        raw = raw_path.read_text()
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"layers-{variant}-{n}.txt").write_text(raw)
    scale = json.loads((RESULTS_DIR / "scale.json").read_text())
    row: dict[str, Any] = scale["rows"][0]
    return raw, row


def report(name: str, variant: str, n: int, raw: str, run: dict[str, Any], top_n: int) -> None:
    us_per_event = float(run["us_per_event"])
    counts = attribute(raw)
    # The measured run's samples only, as far as they can be told apart: imports are left
    # out; creating the sessions (outside the measured run) stays in, a small share.
    for key in [k for k in counts if k[0] == STARTUP]:
        del counts[key]
    total = sum(counts.values()) or 1
    rows: list[dict[str, Any]] = []
    for (layer, ours), count in counts.most_common():
        rows.append(
            {
                "layer": layer,
                "ours": "yes" if ours else "",
                "share": count / total,
                "us_per_event": us_per_event * count / total,
            }
        )
    print_table(
        f"{variant} N={n}: {us_per_event:.1f} us of client CPU per wire event "
        f"(gc {run['gc_s']:.1f}s of {run['cpu_s']:.1f}s), "
        f"{run['events_per_read']:.1f} events per read; {total} samples",
        rows,
    )
    frames: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            frames[stack.rsplit(";", 1)[-1]] += int(count_text)
    top = [
        {
            "frame": frame[-90:],
            "share": count / total,
            "us_per_event": us_per_event * count / total,
        }
        for frame, count in frames.most_common(top_n)
    ]
    print_table("innermost frames", top)
    write_json(name, {"scale_row": run, "rows": rows, "top_frames": top})


if __name__ == "__main__":
    main()
