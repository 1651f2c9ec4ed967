"""Turning the lean HTTP transport on without code: the ``GREENROOM_LEAN_HTTP`` variable
the provider registry reads, and ``--lean-http`` / ``--no-lean-http`` on the commands that
take provider options (a malformed variable is one line on stderr, exit 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.providers import LEAN_HTTP_VARIABLE, PROVIDERS  # noqa: E402
from greenroom.actors.providers.anthropic import AnthropicProvider  # noqa: E402
from greenroom.protocols.settings import SessionSettings  # noqa: E402
from tests.support.mock_model_server import Reply, Text, open_mock_server  # noqa: E402
from tests.test_cli import greenroom_async, json_lines  # noqa: E402


@pytest.mark.parametrize(
    ("value", "lean"),
    [(None, True), ("1", True), ("on", True), ("TRUE", True), ("0", False), ("off", False)],
)
async def test_the_registry_reads_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str | None, lean: bool
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    if value is None:
        monkeypatch.delenv(LEAN_HTTP_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(LEAN_HTTP_VARIABLE, value)
    provider = PROVIDERS["anthropic"].factory(SessionSettings())
    try:
        assert isinstance(provider, AnthropicProvider)
        assert provider.lean_http is lean
    finally:
        await provider.aclose()


async def test_a_malformed_variable_is_a_usage_error(tmp_path: Path) -> None:
    result = await greenroom_async(
        tmp_path, "run", "--provider", "anthropic", "--base-url", "http://127.0.0.1:9", "hi",
        env={"ANTHROPIC_API_KEY": "k", LEAN_HTTP_VARIABLE: "maybe"},
    )  # fmt: skip
    assert result.returncode == 2
    stderr = result.stderr.decode()
    assert LEAN_HTTP_VARIABLE in stderr and "maybe" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("flag", ["--lean-http", "--no-lean-http"])
async def test_the_flag_decides_over_the_variable(tmp_path: Path, flag: str) -> None:
    async with open_mock_server(Reply([Text("hello there")])) as server:
        result = await greenroom_async(
            tmp_path, "run", "--json", "--provider", "anthropic", "--base-url",
            server.base_url, flag, "hi",
            env={"ANTHROPIC_API_KEY": "k", LEAN_HTTP_VARIABLE: "maybe"},
        )  # fmt: skip
        server.assert_clean()
    assert result.returncode == 0, result.stderr.decode()
    lines = json_lines(result.stdout.decode())
    assert lines[-1]["type"] == "task_end"
    assert lines[-1]["status"] == "completed"
