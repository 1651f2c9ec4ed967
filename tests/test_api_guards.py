"""Clear failures at the API's entry points: greenroom under asyncio, and a Claude model
asked for without credentials (never a silent run of another model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trio

from greenroom import ConfigurationError, Host
from greenroom.actors.scripted import Reply, ScriptedProvider, text

TRIO_ONLY = "greenroom runs on trio: use trio.run(...)"
CREDENTIALS = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")


def test_host_open_under_asyncio_says_to_use_trio(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"

    async def main() -> None:
        async with Host.open(data_dir):
            pass

    with pytest.raises(RuntimeError) as caught:
        asyncio.run(main())
    assert str(caught.value) == TRIO_ONLY
    assert not data_dir.exists()  # refused before doing anything


async def test_session_run_from_an_asyncio_loop_says_to_use_trio(tmp_path: Path) -> None:
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(
            provider=ScriptedProvider(Reply(blocks=(text("hi"),))), workspace_dir=tmp_path
        )

        async def in_asyncio() -> None:
            session.run("hi")

        def other_thread() -> str:
            try:
                asyncio.run(in_asyncio())
            except RuntimeError as exc:
                return str(exc)
            return "no error"

        with trio.fail_after(10):
            assert await trio.to_thread.run_sync(other_thread) == TRIO_ONLY
            # the session was not touched: it still runs under trio
            assert (await session.run("hi").result()).text == "hi"


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_credentials")
@pytest.mark.parametrize(
    "request_",
    [
        {"model": "claude-sonnet-4-5"},
        {"provider": "anthropic"},
        {"provider": "anthropic", "model": "claude-haiku-4-5"},
    ],
    ids=["claude-model", "anthropic", "both"],
)
async def test_claude_without_a_key_is_a_configuration_error(
    tmp_path: Path, request_: dict[str, str]
) -> None:
    async with Host.open(tmp_path / "data") as host:
        with pytest.raises(ConfigurationError) as caught:
            await host.create_session(workspace_dir=tmp_path, **request_)
        assert "ANTHROPIC_API_KEY" in str(caught.value)
        assert "provider='scripted'" in str(caught.value)
        assert host.sessions == ()
        assert list((tmp_path / "data" / "sessions").iterdir()) == []


@pytest.mark.usefixtures("no_credentials")
async def test_without_a_key_the_scripted_model_is_still_asked_for_by_name(
    tmp_path: Path,
) -> None:
    """The defaults stay: no model and no key is the scripted model, and so is any model
    with ``provider='scripted'``."""
    async with Host.open(tmp_path / "data") as host:
        default = await host.create_session(workspace_dir=tmp_path)
        named = await host.create_session(
            workspace_dir=tmp_path, provider="scripted", model="claude-sonnet-4-5"
        )
    assert default.settings.provider == named.settings.provider == "scripted"


@pytest.mark.parametrize("variable", CREDENTIALS)
async def test_a_claude_model_with_a_key_chooses_anthropic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "test-key")
    async with Host.open(tmp_path / "data") as host:
        session = await host.create_session(workspace_dir=tmp_path, model="claude-sonnet-4-5")
    assert session.settings.provider == "anthropic"
    assert session.settings.model == "claude-sonnet-4-5"
