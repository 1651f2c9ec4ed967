"""The garbage collector setting of a host (R-PERF-1): on by default in a process that runs
the collector as CPython starts it, never over a setting the program chose (nor with the
collector off), forced with ``gc_tuning=True``, refused with ``False``; it never outlives
the last host, and a change the program makes meanwhile stays."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from conftest import RUN_TIMEOUT_S

from greenroom import Host
from greenroom.actors.apps.parser import build_parser
from greenroom.actors.gateway import SessionDefaults, run_serve
from greenroom.actors.runtime.gc_tuning import CPYTHON_THRESHOLDS, GC_THRESHOLDS, tuned_gc

USER_SETTING = (1234, 5, 6)


@pytest.fixture
def user_thresholds() -> Iterator[tuple[int, int, int]]:
    """The process runs with a setting of its own, restored after the test."""
    saved = gc.get_threshold()
    gc.set_threshold(*USER_SETTING)
    try:
        yield USER_SETTING
    finally:
        gc.set_threshold(*saved)


def test_the_tuned_setting_differs_from_cpython_defaults() -> None:
    assert GC_THRESHOLDS != (700, 10, 10)
    assert GC_THRESHOLDS[0] > 700


def test_tuned_gc_applies_and_restores(user_thresholds: tuple[int, int, int]) -> None:
    with tuned_gc():
        assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_threshold() == user_thresholds


def test_tuned_gc_restores_after_an_error(user_thresholds: tuple[int, int, int]) -> None:
    with pytest.raises(KeyError), tuned_gc():
        raise KeyError("boom")
    assert gc.get_threshold() == user_thresholds


def test_disabled_tuned_gc_changes_nothing(user_thresholds: tuple[int, int, int]) -> None:
    with tuned_gc(enabled=False):
        assert gc.get_threshold() == user_thresholds
    assert gc.get_threshold() == user_thresholds


def test_overlapping_hosts_restore_only_when_the_last_closes(
    user_thresholds: tuple[int, int, int],
) -> None:
    first = tuned_gc()
    second = tuned_gc()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    # The second host is still open: the setting holds.
    assert gc.get_threshold() == GC_THRESHOLDS
    second.__exit__(None, None, None)
    assert gc.get_threshold() == user_thresholds


@pytest.fixture
def cpython_thresholds() -> Iterator[None]:
    """The process runs the collector as CPython starts it, restored after the test."""
    saved, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(*CPYTHON_THRESHOLDS)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        if not enabled:
            gc.disable()


@pytest.mark.usefixtures("cpython_thresholds")
async def test_a_host_tunes_an_untouched_process_by_default_and_gives_it_back(
    tmp_path: Path,
) -> None:
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(tmp_path / "data") as host:
            assert gc.get_threshold() == GC_THRESHOLDS
            session = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            assert (await session.run("hi").result()).task_end.status == "completed"
        assert gc.get_threshold() == CPYTHON_THRESHOLDS
        async with Host.open(tmp_path / "data", gc_tuning=False):
            assert gc.get_threshold() == CPYTHON_THRESHOLDS


@pytest.mark.usefixtures("cpython_thresholds")
def test_a_disabled_collector_is_left_alone_and_a_change_meanwhile_stays() -> None:
    gc.disable()
    try:
        with tuned_gc(None):
            assert gc.get_threshold() == CPYTHON_THRESHOLDS
    finally:
        gc.enable()
    with tuned_gc(None):
        assert gc.get_threshold() == GC_THRESHOLDS
        gc.set_threshold(*USER_SETTING)  # the program decides while the host is open
    assert gc.get_threshold() == USER_SETTING


async def test_a_host_leaves_a_setting_the_program_chose_alone_by_default(
    tmp_path: Path, user_thresholds: tuple[int, int, int]
) -> None:
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(tmp_path / "data") as host:
            assert gc.get_threshold() == user_thresholds
            session = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            result = await session.run("hi").result()
            assert result.task_end.status == "completed"
            assert gc.get_threshold() == user_thresholds
    assert gc.get_threshold() == user_thresholds


async def test_a_tuned_host_tunes_while_open_and_restores_on_close(
    tmp_path: Path, user_thresholds: tuple[int, int, int]
) -> None:
    with trio.fail_after(RUN_TIMEOUT_S):
        async with Host.open(tmp_path / "data", gc_tuning=True) as host:
            assert gc.get_threshold() == GC_THRESHOLDS
            session = await host.create_session(provider="scripted", workspace_dir=tmp_path)
            result = await session.run("hi").result()
            assert result.task_end.status == "completed"
    assert gc.get_threshold() == user_thresholds


async def test_a_tuned_host_restores_when_its_body_fails(
    tmp_path: Path, user_thresholds: tuple[int, int, int]
) -> None:
    failed = False
    try:
        with trio.fail_after(RUN_TIMEOUT_S):
            async with Host.open(tmp_path, gc_tuning=True):
                raise ValueError("the host's user failed")
    except* ValueError:
        failed = True
    assert failed
    assert gc.get_threshold() == user_thresholds


def test_serve_tunes_gc_by_default_and_can_be_told_not_to() -> None:
    # serve is a process greenroom owns: there the measured saving is the default.
    parser = build_parser()
    assert parser.parse_args(["serve"]).gc_tuning is True
    assert parser.parse_args(["serve", "--gc-tuning"]).gc_tuning is True
    assert parser.parse_args(["serve", "--no-gc-tuning"]).gc_tuning is False


@pytest.mark.parametrize("tuning", [False, True])
async def test_run_serve_opens_its_host_with_the_setting(
    tmp_path: Path, user_thresholds: tuple[int, int, int], tuning: bool
) -> None:
    seen: list[tuple[int, int, int]] = []
    ready = trio.Event()
    (tmp_path / "workspace").mkdir()

    def on_ready(_port: int) -> None:
        seen.append(gc.get_threshold())
        ready.set()

    with trio.fail_after(RUN_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: run_serve(
                    port=0,
                    data_dir=tmp_path / "data",
                    defaults=SessionDefaults(
                        provider="scripted", workspace_dir=tmp_path / "workspace"
                    ),
                    console_port=None,
                    ready=on_ready,
                    gc_tuning=tuning,
                )
            )
            await ready.wait()
            nursery.cancel_scope.cancel()
    assert seen == [GC_THRESHOLDS if tuning else user_thresholds]
    assert gc.get_threshold() == user_thresholds
