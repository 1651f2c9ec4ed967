"""A ``session.json`` edited on disk is held to the bounds a client's settings meet
(R-SEC-1, R-SEC-9): a stored setting out of them is refused when the session is loaded or
forked, with an error that names the file and the setting, and the host's other sessions
go on. The same bounds hold for settings given to ``create_session`` and as load
overrides, so no session is made that could not be loaded again; each setting's
documented "no limit" or "off" value is within them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, open_host

from greenroom.actors.providers.scripted import Reply, ScriptedProvider, text
from greenroom.actors.runtime.errors import ConfigurationError, SessionNotFound
from greenroom.protocols.jsonrpc import parse_settings

EDITS = [
    ("max_image_bytes", 2**62, "out of range"),
    ("tool_result_budget", -(2**60), "out of range"),
    ("max_tokens", 0, "must be at least 1"),
    ("max_turns", -7, "must be at least -1"),
    ("approval_timeout_s", 0.0, "must be greater than 0"),
    ("max_subagents_concurrent", -1, "must be at least 0"),
    ("max_cost_usd", -0.5, "must be at least 0"),
    ("model", "m" * 201, "longer than 200 characters"),
]


def _fine() -> ScriptedProvider:
    return ScriptedProvider(lambda request: Reply(blocks=(text("Fine."),)))


@pytest.mark.parametrize(("field", "value", "problem"), EDITS)
async def test_a_stored_setting_out_of_bounds_is_refused_by_name(
    data_dir: Path, workspace: Path, field: str, value: Any, problem: str
) -> None:
    """The edited session is refused on load and on fork, naming its ``session.json``
    and ``$.settings.<field>`` with what is wrong; the other session loads and runs.
    Before, the value was taken as it stood (an image cap of 2**62 bytes, a task that
    may not produce a token)."""
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            edited = await host.create_session(provider=_fine(), workspace_dir=workspace)
            other = await host.create_session(provider=_fine(), workspace_dir=workspace)
        meta_path = edited.directory / "session.json"
        meta = json.loads(meta_path.read_text("utf-8"))
        meta["settings"][field] = value
        meta_path.write_text(json.dumps(meta), "utf-8")
        async with open_host(data_dir) as host:
            with pytest.raises(SessionNotFound) as refused:
                await host.load_session(edited.id, provider=_fine())
            with pytest.raises(SessionNotFound) as fork_refused:
                await host.fork_session(edited.id)
            assert await host.resume_tasks() == []
            session = await host.load_session(other.id, provider=_fine())
            assert (await session.run("still fine?").result()) is not None
            assert session.trace_path.read_text("utf-8").count('"completed"') == 1
    message = str(refused.value)
    assert str(meta_path) in message and f"$.settings.{field}" in message, message
    assert problem in message, message
    assert "\n" not in message
    assert f"$.settings.{field}" in str(fork_refused.value) and problem in str(fork_refused.value)


async def test_stored_settings_within_bounds_load_as_they_are(
    data_dir: Path, workspace: Path
) -> None:
    """Settings at their bounds, and setting names this version does not know (written
    by another), load as before."""
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            created = await host.create_session(provider=_fine(), workspace_dir=workspace)
        meta_path = created.directory / "session.json"
        meta = json.loads(meta_path.read_text("utf-8"))
        meta["settings"].update(
            max_image_bytes=2**53,
            max_turns=-1,
            max_cost_usd=0,
            approval_timeout_s=None,
            # A long system prompt (a manual, a codebase's guide) is a program's to give.
            system="s" * 150_000,
            a_setting_of_another_version=True,
        )
        meta_path.write_text(json.dumps(meta), "utf-8")
        async with open_host(data_dir) as host:
            session = await host.load_session(created.id, provider=_fine())
            assert (session.settings.max_image_bytes, session.settings.max_cost_usd) == (2**53, 0)
            assert len(session.settings.system or "") == 150_000
        async with open_host(data_dir) as host:
            long_system = "s" * 150_000
            made = await host.create_session(
                provider=_fine(), workspace_dir=workspace, system=long_system
            )
            assert made.settings.system == long_system


DOCUMENTED_OFF = {
    "max_context_length": -1,
    "max_session_turns": 0,
    "loop_repeat_threshold": 0,
    "loop_no_progress_threshold": -1,
    "max_subagents_per_task": -1,
    "subagent_token_budget": -1,
    "max_turns": -1,
}
"""Values the settings' documentation gives as "no limit" or "off"."""


async def test_documented_no_limit_values_are_within_the_bounds(
    data_dir: Path, workspace: Path
) -> None:
    """A session created with them is loaded again with them, and a client may give them
    (the gateway refused -1 for the subagent limits and values <= 0 for the loop guards
    and the context size, which the settings document)."""
    assert parse_settings(dict(DOCUMENTED_OFF)) == DOCUMENTED_OFF
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            created = await host.create_session(
                provider=_fine(), workspace_dir=workspace, **DOCUMENTED_OFF
            )
        async with open_host(data_dir) as host:
            session = await host.load_session(created.id, provider=_fine())
            for name, value in DOCUMENTED_OFF.items():
                assert getattr(session.settings, name) == value, name


@pytest.mark.parametrize(("field", "value", "problem"), EDITS)
async def test_a_setting_out_of_bounds_is_refused_at_creation_and_as_a_load_override(
    data_dir: Path, workspace: Path, field: str, value: Any, problem: str
) -> None:
    """``create_session`` and ``load_session``'s overrides refuse it with
    :class:`ConfigurationError` naming the setting; nothing is created. Before, both took
    it, and the session then stored it."""
    with trio.fail_after(RUN_TIMEOUT_S):
        async with open_host(data_dir) as host:
            with pytest.raises(ConfigurationError) as at_creation:
                await host.create_session(
                    provider=_fine(), workspace_dir=workspace, **{field: value}
                )
            assert await host.list_sessions() == []
            created = await host.create_session(provider=_fine(), workspace_dir=workspace)
            await host.close_session(created.id)
            with pytest.raises(ConfigurationError) as as_override:
                await host.load_session(created.id, provider=_fine(), **{field: value})
    for refused in (at_creation.value, as_override.value):
        assert f"$.settings.{field}" in str(refused) and problem in str(refused), refused
