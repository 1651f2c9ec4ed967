"""Shared helpers of the benchmark scripts (not collected by pytest).

* :class:`MockServer`: the loopback mock model server (``tests.support.mock_model_server``)
  in a subprocess, pinned to its own core when ``taskset`` works; the client process pins
  itself to the other core (:func:`pin_client`).
* :class:`Meter`: CPU seconds (``time.process_time``: every thread of this process), wall
  seconds and peak RSS of one measured phase (the kernel's high-water mark ``VmHWM``, reset
  at the start of the phase through ``/proc/self/clear_refs``).
* :func:`median`, :func:`p99`, :func:`print_table`, :func:`write_json`
  (``bench-results/<name>.json`` under the repository root).
* :func:`machine_info`: cores, CPU model, Python and library versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench-results"
CLIENT_CPU = 0
SERVER_CPU = 1

# -- machine ---------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def machine_info() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "trio": _version("trio"),
        "anthropic": _version("anthropic"),
        "httpx": _version("httpx"),
        "httpcore": _version("httpcore"),
        "httpx2": _version("httpx2"),
        "httpcore2": _version("httpcore2"),
        "attrs": _version("attrs"),
        "cattrs": _version("cattrs"),
        "pinned": PINNED,
    }


PINNED: dict[str, Any] = {"client": None, "server": None}


def pin_client() -> None:
    """Pin this process (and the worker threads it starts later) to one core."""
    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        return
    try:
        os.sched_setaffinity(0, {CLIENT_CPU})
        PINNED["client"] = CLIENT_CPU
    except OSError:
        pass


# -- the mock server -------------------------------------------------------------------------


class MockServer:
    """``python -m tests.support.mock_model_server`` in a subprocess; use as a context
    manager. ``args`` are its command-line options (``--token-delay-ms`` ...); ``pin=False``
    leaves it unpinned (the kernel places it); with ``--tls CERT KEY`` among them it serves
    HTTPS and ``base_url`` is ``https://localhost:PORT``."""

    def __init__(self, *args: str, pin: bool = True) -> None:
        self.args = [str(a) for a in args]
        self.pin = pin
        self.tls = "--tls" in self.args
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.stats = ""

    @property
    def base_url(self) -> str:
        if self.tls:
            return f"https://localhost:{self.port}"
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> MockServer:
        cmd = [
            sys.executable,
            "-m",
            "tests.support.mock_model_server",
            "--port",
            "0",
            "--no-invariants",
            *self.args,
        ]
        if self.pin and shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
            probe = subprocess.run(["taskset", "-c", str(SERVER_CPU), "true"], capture_output=True)
            if probe.returncode == 0:
                cmd = ["taskset", "-c", str(SERVER_CPU), *cmd]
                PINNED["server"] = SERVER_CPU
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.match(r"PORT (\d+)", line)
        if not match:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self.proc.kill()
            raise RuntimeError(f"mock server did not start: {line!r} {err}")
        self.port = int(match.group(1))
        where = f"pinned to cpu {PINNED['server']}" if self.pin else "not pinned"
        print(f"mock server {' '.join(self.args)} on port {self.port}, {where}", flush=True)
        return self

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (Linux; 0.0 elsewhere)."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
            self.stats = (err or "").strip().splitlines()[-1] if err and err.strip() else ""
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


# -- measuring -------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux); False when not possible (then the peak is
    the process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Meter:
    """``with Meter() as m: ...`` then ``m.cpu_s`` (``m.sys_s`` of it in the kernel),
    ``m.wall_s``, ``m.peak_rss``."""

    def __enter__(self) -> Meter:
        reset_peak_rss()
        self.rss_start = rss_bytes()
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self._times = os.times()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = time.process_time() - self._cpu
        times = os.times()
        self.sys_s = times.system - self._times.system
        """Of ``cpu_s``, the kernel's share (system calls, waits, wake-ups)."""
        self.wall_s = time.perf_counter() - self._wall
        self.peak_rss = peak_rss_bytes()
        self.rss_end = rss_bytes()


class ReadCounter:
    """Counts the socket reads that returned data in this process: every trio
    ``SocketStream.receive_some`` (the SDK's stack and TLS connections read through it)
    and every ``os.read`` of the lean transport's plain TCP connections.
    ``install()`` wraps both once; a wrapper adds one call per read."""

    def __init__(self) -> None:
        self.reads = 0
        self._original: Any = None
        self._original_read: Any = None

    @classmethod
    def install(cls) -> ReadCounter:
        import trio

        from greenroom.actors.providers import lean_http

        counter = cls()
        original = trio.SocketStream.receive_some
        original_read = lean_http._read

        async def receive_some(stream: Any, max_bytes: int | None = None) -> Any:
            data = await original(stream, max_bytes)
            if data:
                counter.reads += 1
            return data

        def read(fd: int, size: int) -> bytes:
            data = original_read(fd, size)
            if data:
                counter.reads += 1
            return data

        counter._original = original
        counter._original_read = original_read
        trio.SocketStream.receive_some = receive_some  # type: ignore[method-assign]
        lean_http._read = read
        return counter

    def reset(self) -> None:
        self.reads = 0

    def uninstall(self) -> None:
        import trio

        from greenroom.actors.providers import lean_http

        if self._original is not None:
            trio.SocketStream.receive_some = self._original  # type: ignore[method-assign]
            lean_http._read = self._original_read
            self._original = None


class GcMeter:
    """Time spent in the cyclic garbage collector and collections per generation, through
    ``gc.callbacks`` (called once per collection, so it costs nothing per event)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self.seconds_by_generation = [0.0, 0.0, 0.0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            spent = time.perf_counter() - self._started
            self.seconds += spent
            self.collections[info["generation"]] += 1
            self.seconds_by_generation[info["generation"]] += spent

    def __enter__(self) -> GcMeter:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)


def wire_events_per_task() -> int:
    """SSE events the mock sends for one reference task (both requests)."""
    from tests.support.mock_model_server import Workload

    workload = Workload()
    return len(workload._anthropic(1, False, 1)) + len(workload._anthropic(2, True, 1))


# -- statistics and reporting ----------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    vals = list(values)
    return statistics.median(vals) if vals else float("nan")


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    vals = sorted(values)
    if not vals:
        return float("nan")
    rank = max(1, -(-len(vals) * q // 100))
    return vals[int(min(rank, len(vals))) - 1]


def p99(values: Iterable[float]) -> float:
    return percentile(values, 99)


PHASES = ("start", "request 1", "boundary", "request 2", "end")


def phase_medians(
    tasks: Iterable[dict[str, float]], paced: tuple[float, float]
) -> dict[str, float]:
    """Where a reference task's time goes, medians over ``tasks``, in seconds. Each task
    gives times on one clock: ``sent`` (its run asked for), ``begin1``, ``end1``,
    ``begin2``, ``end2`` (its two requests) and ``ended``; a task missing one is left
    out. ``start`` is sent to begin1; ``request 1`` and ``request 2`` are what each
    request took beyond its ``paced`` time; ``boundary`` is end1 to begin2 (the tools,
    their approval, the turn made durable); ``end`` is end2 to ended."""
    keys = {"sent", "begin1", "end1", "begin2", "end2", "ended"}
    spans: dict[str, list[float]] = {name: [] for name in PHASES}
    for t in tasks:
        if not keys <= t.keys():
            continue
        spans["start"].append(t["begin1"] - t["sent"])
        spans["request 1"].append(t["end1"] - t["begin1"] - paced[0])
        spans["boundary"].append(t["begin2"] - t["end1"])
        spans["request 2"].append(t["end2"] - t["begin2"] - paced[1])
        spans["end"].append(t["ended"] - t["end2"])
    return {name: median(v) if v else float("nan") for name, v in spans.items()}


def phases_text(spans: dict[str, float]) -> str:
    """``phase_medians`` on one line."""
    return ", ".join(
        f"{name} {'+' if name.startswith('request') else ''}{value:.2f}"
        for name, value in spans.items()
    )


def mib(n: float) -> float:
    return n / (1024 * 1024)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    if value is None:
        return "-"
    return str(value)


def print_table(
    title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None
) -> None:
    if not rows:
        print(f"\n{title}: no rows")
        return
    cols = list(columns or rows[0].keys())
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    data = {
        "benchmark": name,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_info(),
        **payload,
    }
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nwrote {path.relative_to(ROOT)}")
    return path


def print_machine() -> None:
    info = machine_info()
    print(
        f"machine: {info['nproc']} cores ({info['cpu']}), python {info['python']}, "
        f"trio {info['trio']}, anthropic {info['anthropic']}, httpx {info['httpx']}, "
        f"httpx2 {info['httpx2']}; client pinned to {info['pinned']['client']}, "
        f"server to {info['pinned']['server']}"
    )


def arg_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a reduced run (under a minute)")
    return parser


# -- the reference workload's tool -----------------------------------------------------------

TOOL_SLEEP_S = 0.010
MODEL = "mock-model"
MAX_TOKENS = 1024
PROMPT = "Look up keys 1 and 2 and summarise."
TOOL_NAME = "lookup"
TOOL_DESCRIPTION = "Look up a key."
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"key": {"type": "string"}},
    "required": ["key"],
}


def greenroom_tool() -> Any:
    """The ``lookup`` tool as a greenroom tool: async, sleeps 10 ms, parallel-safe."""
    import trio

    from greenroom.protocols.tools import tool

    @tool(parallel=True, name=TOOL_NAME)
    async def lookup(key: str) -> str:
        """Look up a key."""
        await trio.sleep(TOOL_SLEEP_S)
        return f"value-{key}"

    return lookup


def approve_all(_call: Any) -> str:
    return "allow"
