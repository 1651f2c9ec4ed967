"""``greenroom``'s flags and words, end to end in subprocesses: the prompt as unquoted
words, each subcommand's own usage errors, ``serve --help`` and its start-up line, the
approval vocabulary on screen, the demo's listing, and the shell sandbox flags.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `tests` is not a package on pytest's default sys.path
    sys.path.insert(0, str(ROOT))

from greenroom.actors.apps.demo import SALES, write_demo_workspace  # noqa: E402
from greenroom.actors.apps.parser import build_parser  # noqa: E402
from greenroom.actors.providers.scripted_brain import DEMO_PROMPT  # noqa: E402
from tests.test_cli import CLI, TIMEOUT_S, cli_env, greenroom, json_lines  # noqa: E402

BACKEND_WORDS = re.compile(r"\b(host|session_rule|default)\b")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    directory = tmp_path / "ws"
    write_demo_workspace(directory)
    return directory


def session_meta(data_dir: Path, session_id: str) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(
        (data_dir / "sessions" / session_id / "session.json").read_text(encoding="utf-8")
    )
    return meta


# -- the prompt and usage errors --------------------------------------------------------------


def test_run_joins_unquoted_words_into_the_prompt(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "run", "--json", "summarize", "the", "files")
    assert result.returncode == 0, result.stderr
    lines = json_lines(result.stdout)
    assert lines[0]["type"] == "user_msg"
    assert lines[0]["content"] == [{"type": "text", "text": "summarize the files"}]
    reply = next(line for line in lines if line["type"] == "model_msg")["block"]["text"]
    assert 'You asked: "summarize the files"' in reply


@pytest.mark.parametrize(
    "args",
    [["run", "--bogus", "hi"], ["run", "hi", "--bogus"], ["chat", "--bogus"],
     ["serve", "--bogus"], ["trace", "x", "--bogus"]],
)  # fmt: skip
def test_an_unknown_flag_is_reported_with_the_subcommand_usage(
    tmp_path: Path, args: list[str]
) -> None:
    result = greenroom(tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"usage: greenroom {args[0]} "), result.stderr
    assert f"greenroom {args[0]}: error: unrecognized arguments: --bogus" in result.stderr
    assert result.stdout == ""


# -- serve: help and start-up -------------------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = commands.choices["serve"]
    return parser


def test_serve_help_describes_every_flag_and_its_default(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "Serve the websocket JSON-RPC gateway at ws://HOST:PORT/v1" in text
    for flag, default in [("--host", "127.0.0.1"), ("--port", "8765"), ("--approve", "ask"),
                          ("--approval-timeout", "wait without limit"),
                          ("--sandbox", "auto")]:  # fmt: skip
        assert re.search(rf"{flag}\b.*?\(default: {re.escape(default)}\)", text), flag
    for action in _serve_parser()._actions:
        if not action.option_strings or action.dest == "help" or action.help == argparse.SUPPRESS:
            continue  # SUPPRESS: a flag serve gives itself (its workers'), not a user's
        assert action.help, f"{action.option_strings} has no help"
        assert action.option_strings[0] in text
        takes_value = action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if takes_value:
            assert "default" in action.help, f"{action.option_strings}: no default in help"


async def test_serve_says_what_sessions_get_at_start_up(tmp_path: Path) -> None:
    process = await trio.lowlevel.open_process(
        [*CLI, "serve", "--port", "0", "--no-console", "--no-builtin-tools", "--approve",
         "all", "--data-dir", str(tmp_path / "data")],
        env=cli_env(tmp_path), stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        with trio.fail_after(TIMEOUT_S):
            seen = b""
            while b"sessions: " not in seen or not seen.endswith(b"\n"):
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    line = next(li for li in seen.decode().splitlines() if li.startswith("sessions: "))
    assert "provider scripted" in line
    assert "model scripted" in line
    assert "approval all" in line


# -- approval words -------------------------------------------------------------------------


def test_run_shows_decisions_in_plain_words(tmp_path: Path, workspace: Path) -> None:
    common = ["--workspace", str(workspace), "--data-dir", str(tmp_path / "data"), DEMO_PROMPT]
    denied = greenroom(tmp_path, "run", "--approve", "none", *common)
    assert denied.returncode == 0, denied.stderr
    assert "✗ list_dir denied: no one to ask" in denied.stdout

    asked = subprocess.run(
        [*CLI, "run", "--approve", "ask", *common], cwd=tmp_path, env=cli_env(tmp_path),
        input="y\nn\na\n", capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    decisions = [line.strip() for line in asked.stdout.splitlines() if "✓" in line or "✗" in line]
    assert [d.split(" · ")[0] for d in decisions] == [
        "✓ list_dir allowed by you",
        "✗ read_file denied by you",
        "✓ read_file allowed by you",
        "✓ read_file allowed for this session",
    ]
    for text in (denied.stdout, asked.stdout):
        for line in text.splitlines():
            if "allowed" in line or "denied" in line:
                assert not BACKEND_WORDS.search(line), line

    session_id = asked.stderr.split("session: ", 1)[1].split()[0]
    trace = greenroom(tmp_path, "trace", session_id, "--data-dir", str(tmp_path / "data"))
    shown = [line for line in trace.stdout.splitlines() if "approval_decision" in line]
    assert [line.split(" read_file ")[-1].split(" list_dir ")[-1] for line in shown] == [
        "allowed by you", "denied by you", "allowed by you", "allowed for this session",
    ]  # fmt: skip
    as_json = greenroom(tmp_path, "trace", session_id, "--json", "--data-dir",
                        str(tmp_path / "data"))  # fmt: skip
    by = [r["by"] for r in json_lines(as_json.stdout) if r["type"] == "approval_decision"]
    assert by == ["host", "host", "host", "session_rule"]  # --json keeps the values


def test_calls_nobody_was_asked_about_never_say_allowed_by_you(
    tmp_path: Path, workspace: Path
) -> None:
    """R-APPROVE-1: under ``--approve all`` (run, chat) and in the demo nobody is asked, so a
    decision names what allowed the call; "allowed by you" is kept for a person's answer."""
    data = ["--data-dir", str(tmp_path / "data")]
    run = greenroom(tmp_path, "run", "--approve", "all", "--workspace", str(workspace),
                    *data, DEMO_PROMPT)  # fmt: skip
    demo = greenroom(tmp_path, "demo", "--workspace", str(tmp_path / "demo-ws"), *data)
    demo_all = greenroom(tmp_path, "demo", "--approve", "all", "--workspace",
                         str(tmp_path / "demo-ws"), *data)  # fmt: skip
    chat = greenroom(tmp_path, "chat", "--approve", "all", "--workspace", str(workspace),
                     *data, stdin=DEMO_PROMPT + "\n")  # fmt: skip
    for result, words in (
        (run, "allowed by --approve all"),
        (demo, "allowed by the demo"),
        (demo_all, "allowed by --approve all"),
        (chat, "allowed by --approve all"),
    ):
        assert result.returncode == 0, result.stderr
        decisions = [line.strip() for line in result.stdout.splitlines() if "✓" in line]
        assert decisions, result.stdout
        assert all(f" {words} · " in line for line in decisions), decisions
        assert "by you" not in result.stdout + result.stderr


# -- the demo's listing -----------------------------------------------------------------------


def test_demo_shows_the_whole_short_listing(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "demo", "--workspace", str(tmp_path / "ws"))
    assert result.returncode == 0, result.stderr
    screen = result.stdout.splitlines()
    start = next(i for i, line in enumerate(screen) if "◂ list_dir ok" in line)
    listing = screen[start + 1 : start + 1 + len(SALES) + 1]
    assert sorted(line.split()[0] for line in listing) == sorted([*SALES, "README.txt"])
    assert "more line" not in screen[start + 1 + len(listing)]


# -- the shell sandbox ------------------------------------------------------------------------

UNCONFINED = "run_shell is not confined"


def env_with_path(tmp_path: Path, *, bwrap: bool) -> dict[str, str]:
    """The CLI's environment with a PATH that has (a stand-in) bwrap or has none."""
    bin_dir = tmp_path / ("bin-with-bwrap" if bwrap else "bin-without-bwrap")
    bin_dir.mkdir(exist_ok=True)
    if bwrap:
        fake = bin_dir / "bwrap"
        fake.write_text("#!/bin/sh\nexit 1\n")
        fake.chmod(0o755)
    return {**cli_env(tmp_path), "PATH": str(bin_dir)}


def run_with_env(
    tmp_path: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], cwd=tmp_path, env=env, input="", capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip


def test_run_stores_the_sandbox_flags_in_the_session(tmp_path: Path) -> None:
    data = tmp_path / "data"
    plain = greenroom(tmp_path, "run", "--json", "--data-dir", str(data), "hi")
    flagged = greenroom(tmp_path, "run", "--json", "--sandbox", "required", "--shell-network",
                        "--data-dir", str(data), "hi")  # fmt: skip
    assert plain.returncode == 0 and flagged.returncode == 0, plain.stderr + flagged.stderr
    plain_settings = session_meta(data, json_lines(plain.stdout)[0]["session_id"])["settings"]
    assert (plain_settings["sandbox"], plain_settings["shell_network"]) == ("auto", False)
    flagged_id = json_lines(flagged.stdout)[0]["session_id"]
    settings = session_meta(data, flagged_id)["settings"]
    assert (settings["sandbox"], settings["shell_network"]) == ("required", True)
    # continuing the session keeps them unless a flag says otherwise
    again = greenroom(tmp_path, "run", "--json", "--session", flagged_id, "--no-shell-network",
                      "--data-dir", str(data), "again")  # fmt: skip
    assert again.returncode == 0, again.stderr
    result = greenroom(tmp_path, "run", "--sandbox", "strict", "hi")
    assert result.returncode == 2
    assert "--sandbox" in result.stderr


def test_max_image_bytes_is_a_flag_stored_in_the_session(tmp_path: Path) -> None:
    """R-SEC-8: ``--max-image-bytes N`` sets the session's image limit (5 MiB without it);
    a limit below 1 is a usage error naming the flag."""
    data = tmp_path / "data"
    plain = greenroom(tmp_path, "run", "--json", "--data-dir", str(data), "hi")
    flagged = greenroom(tmp_path, "run", "--json", "--max-image-bytes", "1000",
                        "--data-dir", str(data), "hi")  # fmt: skip
    assert plain.returncode == 0 and flagged.returncode == 0, plain.stderr + flagged.stderr
    for result, limit in ((plain, 5 * 1024 * 1024), (flagged, 1000)):
        session_id = json_lines(result.stdout)[0]["session_id"]
        assert session_meta(data, session_id)["settings"]["max_image_bytes"] == limit
    zero = greenroom(tmp_path, "run", "--max-image-bytes", "0", "hi")
    assert zero.returncode == 2 and "--max-image-bytes" in zero.stderr


def test_chat_stores_the_sandbox_flags_in_the_session(tmp_path: Path) -> None:
    data = tmp_path / "data"
    result = greenroom(tmp_path, "chat", "--sandbox", "off", "--shell-network",
                       "--data-dir", str(data))  # fmt: skip
    assert result.returncode == 0, result.stderr
    session_id = result.stderr.split("session: ", 1)[1].split()[0]
    settings = session_meta(data, session_id)["settings"]
    assert (settings["sandbox"], settings["shell_network"]) == ("off", True)


@pytest.mark.parametrize("command", [["run", "--json", "hi"], ["chat"]])
def test_without_bwrap_start_up_says_once_that_run_shell_is_not_confined(
    tmp_path: Path, command: list[str]
) -> None:
    data = ["--data-dir", str(tmp_path / "data")]
    missing = run_with_env(tmp_path, env_with_path(tmp_path, bwrap=False), *command, *data)
    assert missing.returncode == 0, missing.stderr
    assert missing.stderr.count(UNCONFINED) == 1, missing.stderr
    present = run_with_env(tmp_path, env_with_path(tmp_path, bwrap=True), *command, *data)
    assert present.returncode == 0, present.stderr
    assert UNCONFINED not in present.stderr
    without_shell = run_with_env(tmp_path, env_with_path(tmp_path, bwrap=False), *command,
                                 *data, "--no-builtin-tools")  # fmt: skip
    assert UNCONFINED not in without_shell.stderr
    required = run_with_env(tmp_path, env_with_path(tmp_path, bwrap=False), *command, *data,
                            "--sandbox", "required")  # fmt: skip
    assert "run_shell will refuse every command" in required.stderr



@pytest.mark.parametrize("command", [["run", "hi"], ["serve", "--port", "0", "--no-console"]])
def test_without_bwrap_a_mistake_in_the_setup_is_still_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    """The warning about run_shell comes once a command starts its work: a usage error
    found before that is the one line on stderr, bubblewrap or not (R-SEC-4)."""
    bad = tmp_path / "prices.json"
    bad.write_text("[1]")
    data = ["--data-dir", str(tmp_path / "data")]
    result = run_with_env(
        tmp_path, env_with_path(tmp_path, bwrap=False), *command, *data, "--prices", str(bad)
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "--prices" in line and UNCONFINED not in line

async def test_serve_gives_its_sessions_the_sandbox_flags(tmp_path: Path) -> None:
    from trio_websocket import open_websocket_url

    data = tmp_path / "data"
    env = env_with_path(tmp_path, bwrap=False)
    process = await trio.lowlevel.open_process(
        [*CLI, "serve", "--port", "0", "--no-console", "--sandbox", "off", "--shell-network",
         "--data-dir", str(data)],
        env=env, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        with trio.fail_after(TIMEOUT_S):
            seen = b""
            while b"sessions: " not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            url = re.search(rb"ws://[\w.:]+/v1", seen).group().decode()  # type: ignore[union-attr]
            token = (data / "serve.token").read_text().strip()
            headers = [("Authorization", f"Bearer {token}")]
            async with open_websocket_url(url, extra_headers=headers) as ws:
                request = {"jsonrpc": "2.0", "id": 1, "method": "session.create", "params": {}}
                await ws.send_message(json.dumps(request))
                while True:
                    frame = json.loads(await ws.get_message())
                    if frame.get("id") == 1:
                        break
            session_id = frame["result"]["session_id"]
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    settings = session_meta(data, session_id)["settings"]
    assert (settings["sandbox"], settings["shell_network"]) == ("off", True)
    # --sandbox off asked for it: no warning about a missing bubblewrap
    assert UNCONFINED not in seen.decode()


# -- shared provider limits (R-SHARE-1) -----------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "serve"])
def test_provider_limit_flags_become_the_host_s_limits(command: str) -> None:
    from greenroom import ProviderLimits
    from greenroom.actors.apps.run import provider_limits

    parser = build_parser()
    extra = ["hi"] if command == "run" else []
    given = parser.parse_args(
        [command, "--max-concurrent-requests", "8", "--requests-per-minute", "50", *extra]
    )
    assert provider_limits(given) == ProviderLimits(
        max_concurrent_requests=8, requests_per_minute=50
    )
    assert provider_limits(parser.parse_args([command, *extra])) is None


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [("--max-concurrent-requests", "0", "must be at least 1, got 0"),
     ("--requests-per-minute", "many", "expected a whole number, got 'many'")],
)  # fmt: skip
def test_a_bad_provider_limit_is_a_usage_error_not_a_traceback(
    tmp_path: Path, flag: str, value: str, words: str
) -> None:
    result = greenroom(tmp_path, "run", flag, value, "hi")
    assert result.returncode == 2
    assert f"greenroom run: error: argument {flag}: {words}" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_with_provider_limits_completes_its_task(tmp_path: Path) -> None:
    result = greenroom(
        tmp_path,
        "run",
        "--json",
        "--max-concurrent-requests",
        "1",
        "--requests-per-minute",
        "5",
        "hello",
    )
    assert result.returncode == 0, result.stderr
    assert json_lines(result.stdout)[-1]["status"] == "completed"


async def test_serve_a2a_and_ag_ui_share_the_gateway_s_port(tmp_path: Path) -> None:
    """``serve --a2a --ag-ui``: the start-up lines name the endpoints, which answer on the
    gateway's port with its token (R-PROTO-1, R-PROTO-2)."""
    import httpx

    data = tmp_path / "data"
    process = await trio.lowlevel.open_process(
        [*CLI, "serve", "--port", "0", "--no-console", "--a2a", "--ag-ui", "--approve", "all",
         "--data-dir", str(data)],
        env=cli_env(tmp_path), stderr=subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        with trio.fail_after(TIMEOUT_S):
            seen = b""
            while b"sessions: " not in seen or not seen.endswith(b"\n"):
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            lines = seen.decode().splitlines()
            a2a = next(li for li in lines if li.startswith("a2a: "))
            card_url = a2a.split("agent card: ")[1].rstrip(")")
            ag_ui = next(li for li in lines if li.startswith("ag-ui: ")).split(": ", 1)[1]
            token = (data / "serve.token").read_text().strip()
            headers = {"Authorization": f"Bearer {token}"}

            def ask() -> tuple[int, int, str]:
                card = httpx.get(card_url, headers=headers, timeout=TIMEOUT_S)
                refused = httpx.post(ag_ui, json={}, timeout=TIMEOUT_S)
                return card.status_code, refused.status_code, card.json()["url"]

            card_status, refused_status, a2a_url = await trio.to_thread.run_sync(ask)
            assert (card_status, refused_status) == (200, 401)
            assert a2a_url == a2a.split(" ")[1]
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_serve_a2a_is_refused_with_a_cluster(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "serve", "--a2a", "--nats", "nats://127.0.0.1:1")
    assert result.returncode != 0
    assert "--a2a" in result.stderr and "--nats" in result.stderr
    assert "Traceback" not in result.stderr
