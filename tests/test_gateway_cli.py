"""``greenroom serve`` / ``sessions`` / ``run --session`` for serving safely, as
subprocesses: a mistake in the setup is one clear line and exit code 2, never a
traceback (R-SEC-4, R-SEC-5, R-SEC-1)."""

from __future__ import annotations

import json
import re
import signal
import socket
from pathlib import Path

import pytest
import trio
from test_cli import CLI, TIMEOUT_S, cli_env, greenroom
from test_gateway import Client
from trio_websocket import ConnectionRejected, open_websocket_url

from greenroom.actors.gateway import GatewayLimits

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


def one_line_usage_error(result: object) -> str:
    code = getattr(result, "returncode")  # noqa: B009
    err: str = getattr(result, "stderr")  # noqa: B009
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_bad_tokens_file_line_is_a_usage_error(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# clients\nalice {ALICE}\nbob\n")
    (tmp_path / "home").mkdir()
    result = greenroom(
        tmp_path, "serve", "--port", "0", "--no-console", "--tokens-file", str(tokens),
        "--data-dir", str(tmp_path / "data"), "--workspace", str(tmp_path / "home"),
    )
    line = one_line_usage_error(result)
    assert f"{tokens}:3:" in line and "CLIENT_ID TOKEN" in line


def test_token_file_and_tokens_file_together_are_a_usage_error(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\n")
    (tmp_path / "home").mkdir()
    result = greenroom(
        tmp_path, "serve", "--port", "0", "--no-console", "--tokens-file", str(tokens),
        "--token-file", str(tmp_path / "one"), "--data-dir", str(tmp_path / "data"),
        "--workspace", str(tmp_path / "home"),
    )
    assert "--tokens-file" in one_line_usage_error(result)


def test_a_data_dir_inside_the_workspace_root_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "root" / "ws").mkdir(parents=True)
    result = greenroom(
        tmp_path, "serve", "--port", "0", "--no-console",
        "--data-dir", str(tmp_path / "root" / "data"),
        "--workspace", str(tmp_path / "root" / "ws"),
        "--workspace-root", str(tmp_path / "root"),
    )
    assert "data dir" in one_line_usage_error(result)


def test_serve_flags_are_checked(tmp_path: Path) -> None:
    result = greenroom(tmp_path, "serve", "--max-connections", "0")
    assert result.returncode == 2 and "--max-connections" in result.stderr
    help_text = greenroom(tmp_path, "serve", "--help").stdout
    for flag in ("--tokens-file", "--allow-origin", "--max-connections", "--workspace-root"):
        assert flag in help_text
    for flag in ("--max-connections-per-principal", "--max-sessions-per-principal"):
        assert flag in help_text
        result = greenroom(tmp_path, "serve", flag, "0")
        assert result.returncode == 2 and "must be at least 1" in result.stderr


@pytest.mark.parametrize("origin", ["localhost:3000", "*", "http://app.example/ui", "null"])
def test_an_allowed_origin_that_no_browser_sends_is_a_usage_error(
    origin: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """R-SEC-4: ``--allow-origin localhost:3000`` (no scheme), ``*``, an address with a path
    or ``null`` matched no browser's ``Origin`` and was taken without a word: the page
    meant to be allowed was refused 403 with nothing saying why. Each is refused at start."""
    from greenroom.actors.apps.parser import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--allow-origin", origin])
    assert exited.value.code == 2
    assert "--allow-origin: expected a browser origin" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--allow-origin", "http://localhost:3000"])
    assert args.allow_origin == ["http://localhost:3000"]


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("run", "--max-image-bytes"),
        ("serve", "--max-image-bytes"),
        ("run", "--max-cost-usd"),
        ("serve", "--principal-budget-usd"),
    ],
)
def test_a_number_no_setting_can_hold_is_refused_as_the_flag_is_read(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """R-SEC-9: past 2**53 no session setting means anything, and a session's settings
    are refused past it; such a flag was taken, then every session made with it failed
    (``serve`` started and refused each ``session.create``). It is a usage error at once."""
    from greenroom.actors.apps.parser import LARGEST_NUMBER, build_parser

    extra = ["hi"] if command == "run" else []
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, flag, str(LARGEST_NUMBER * 2), *extra])
    assert exited.value.code == 2
    assert f"{flag}: must be" in capsys.readouterr().err
    args = build_parser().parse_args([command, flag, str(LARGEST_NUMBER), *extra])
    assert LARGEST_NUMBER in vars(args).values()


def test_the_per_principal_flags_default_to_the_gateway_limits() -> None:
    """R-SEC-9: ``serve``'s defaults are :class:`GatewayLimits`' own."""
    from greenroom.actors.apps.parser import build_parser

    args = build_parser().parse_args(["serve"])
    limits = GatewayLimits()
    assert args.max_connections_per_principal == limits.max_connections_per_principal == 64
    assert args.max_sessions_per_principal == limits.max_sessions_per_principal == 1000


async def test_serve_caps_each_principal_as_its_flags_say(tmp_path: Path) -> None:
    """R-SEC-9 end to end: with ``--max-connections-per-principal 1`` alice's second
    connection is refused with HTTP 429 while bob connects; with
    ``--max-sessions-per-principal 1`` her second ``session.create`` answers 429."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    (tmp_path / "ws").mkdir()
    process = await trio.lowlevel.open_process(
        [
            *CLI, "serve", "--port", "0", "--no-console", "--tokens-file", str(tokens),
            "--max-connections-per-principal", "1", "--max-sessions-per-principal", "1",
            "--data-dir", str(tmp_path / "data"), "--workspace", str(tmp_path / "ws"),
        ],
        env=cli_env(tmp_path),
        stderr=-1,
    )
    assert process.stderr is not None
    try:
        with trio.fail_after(TIMEOUT_S):
            seen = b""
            while b"/v1" not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            match = re.search(rb"ws://[\w.:]+/v1", seen)
            assert match
            url = match.group().decode()

            def auth(token: str) -> list[tuple[bytes, bytes]]:
                return [(b"Authorization", f"Bearer {token}".encode())]

            async with open_websocket_url(url, extra_headers=auth(ALICE)) as ws:
                alice = Client(ws)
                await alice.result("session.create")
                refused = await alice.error("session.create")
                assert refused["code"] == 429 and "at most 1" in refused["message"]
                try:
                    async with open_websocket_url(url, extra_headers=auth(ALICE)):
                        raise AssertionError("a second connection of alice was admitted")
                except ConnectionRejected as rejected:
                    assert rejected.status_code == 429
                async with open_websocket_url(url, extra_headers=auth(BOB)) as other:
                    bob = Client(other)
                    await bob.result("session.create")
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_serve_with_a_tokens_file_and_an_allowed_origin(tmp_path: Path) -> None:
    """End to end: two principals from the tokens file; a session of one is invisible
    and forbidden to the other; a browser origin passes only when allowed."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    (tmp_path / "ws").mkdir()
    process = await trio.lowlevel.open_process(
        [
            *CLI, "serve", "--port", "0", "--no-console", "--tokens-file", str(tokens),
            "--allow-origin", "http://app.example:3000", "--data-dir", str(tmp_path / "data"),
            "--workspace", str(tmp_path / "ws"), "--approve", "all",
        ],
        env=cli_env(tmp_path),
        stderr=-1,
    )
    assert process.stderr is not None
    try:
        with trio.fail_after(TIMEOUT_S):
            seen = b""
            while b"/v1" not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            match = re.search(rb"ws://[\w.:]+/v1", seen)
            assert match
            url = match.group().decode()

            def auth(token: str, origin: str | None = None) -> list[tuple[bytes, bytes]]:
                headers = [(b"Authorization", f"Bearer {token}".encode())]
                if origin is not None:
                    headers.append((b"Origin", origin.encode()))
                return headers

            async with open_websocket_url(url, extra_headers=auth(ALICE)) as ws:
                alice = Client(ws)
                sid = (await alice.result("session.create"))["session_id"]
            async with open_websocket_url(
                url, extra_headers=auth(BOB, "http://app.example:3000")
            ) as ws:
                bob = Client(ws)
                assert (await bob.result("session.list")) == {"sessions": []}
                denied = await bob.error("session.subscribe", {"session_id": sid})
                assert denied["code"] == 403
            try:
                async with open_websocket_url(url, extra_headers=auth(BOB, "http://evil.example")):
                    raise AssertionError("a foreign origin was admitted")
            except ConnectionRejected as rejected:
                assert rejected.status_code == 403
            process.send_signal(signal.SIGINT)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_sessions_lists_the_readable_ones_and_names_the_bad_one(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (tmp_path / "ws").mkdir()
    ran = greenroom(
        tmp_path, "run", "--json", "--workspace", str(tmp_path / "ws"), "--data-dir", str(data),
        "hello",
    )
    assert ran.returncode == 0, ran.stderr
    good = json.loads(ran.stdout.splitlines()[0])["session_id"]
    bad_dir = data / "sessions" / "20990101-000000-badbad"
    bad_dir.mkdir()
    (bad_dir / "session.json").write_text('{"settings": 5}')
    listed = greenroom(tmp_path, "sessions", "--data-dir", str(data))
    assert listed.returncode == 0, listed.stderr
    assert good in listed.stdout
    assert "Traceback" not in listed.stderr
    assert "unreadable session 20990101-000000-badbad" in listed.stderr
    assert str(bad_dir / "session.json") in listed.stderr
    as_json = greenroom(tmp_path, "sessions", "--json", "--data-dir", str(data))
    assert [json.loads(line)["session_id"] for line in as_json.stdout.splitlines()] == [good]
    for content in ("[]", '"x"', '{"settings": 5}', '{"settings": {"max_turns": "x"}}'):
        (bad_dir / "session.json").write_text(content)
        resumed = greenroom(
            tmp_path, "run", "--session", "20990101-000000-badbad", "--data-dir", str(data), "hi"
        )
        line = one_line_usage_error(resumed)
        assert "unreadable" in line, content
    # A setting of the wrong type is named, with what is wrong with it.
    named = "bad settings: invalid value for type, expected int @ $.settings.max_turns"
    assert line.endswith(named), line


def _limit_descriptors() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


FD_LIMIT = 320


def _flood(port: int, count: int) -> list[socket.socket]:
    """``count`` TCP connections that never send a handshake."""
    sockets: list[socket.socket] = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        sockets.append(sock)
    return sockets


async def _read_all(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
    while chunk := await stream.receive_some():
        into += chunk


async def test_a_connection_flood_never_starves_a_session_of_descriptors(tmp_path: Path) -> None:
    """R-SEC-4: under a descriptor limit of 320 the server caps its connections below it
    (and says so); 600 half-open connections then wait in the kernel's backlog, and a
    session created and run meanwhile still writes its files and completes."""
    (tmp_path / "ws").mkdir()
    process = await trio.lowlevel.open_process(
        [
            *CLI, "serve", "--port", "0", "--no-console", "--data-dir", str(tmp_path / "data"),
            "--workspace", str(tmp_path / "ws"), "--approve", "all",
        ],
        env=cli_env(tmp_path),
        stderr=-1,
        preexec_fn=_limit_descriptors,
    )
    assert process.stderr is not None
    flood: list[socket.socket] = []
    said = bytearray()
    try:
        with trio.fail_after(TIMEOUT_S):
            seen = b""
            while b"/v1" not in seen:
                chunk = await process.stderr.receive_some()
                assert chunk, f"serve exited early: {seen!r}"
                seen += chunk
            assert re.search(rb"at most \d+ connections \(the file descriptor limit is 320", seen)
            match = re.search(rb"ws://[\w.:]+:(\d+)/v1", seen)
            assert match
            url, port = match.group().decode(), int(match.group(1))
            token = (tmp_path / "data" / "serve.token").read_text().strip()
            headers = [(b"Authorization", f"Bearer {token}".encode())]
            async with trio.open_nursery() as nursery:
                # Read stderr to its end: what serve says under the flood is in the failure.
                nursery.start_soon(_read_all, process.stderr, said)
                async with open_websocket_url(url, extra_headers=headers) as ws:
                    client = Client(ws)
                    flood = await trio.to_thread.run_sync(_flood, port, 600)
                    for _ in range(3):
                        sid = (await client.result("session.create"))["session_id"]
                        await client.result("session.subscribe", {"session_id": sid})
                        await client.result("run", {"session_id": sid, "input": "hello"})
                        outputs = client.take_outputs() + await client.outputs_until("task_end")
                        assert outputs[-1]["status"] == "completed", outputs[-1]
                        traces = list((tmp_path / "data" / "sessions" / sid).glob("trace_*.jsonl"))
                        assert traces and traces[0].read_text().count("\n") >= 2
                process.send_signal(signal.SIGINT)
                assert await process.wait() == 0, bytes(said).decode(errors="replace")
    finally:
        for sock in flood:
            sock.close()
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("flag", ["--approval-timeout", "--drain-grace", "--lease-ttl"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "0"])
def test_seconds_no_timer_can_hold_are_refused_as_the_flag_is_read(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """R-SEC-9: ``float`` reads ``inf`` and ``1e300``, and ``serve --approval-timeout inf``
    started, then refused every ``session.create`` as the client's mistake. Like every
    number flag, seconds past 2**53 (or not a number) are a usage error at once."""
    from greenroom.actors.apps.parser import LARGEST_NUMBER, build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", flag, value])
    assert exited.value.code == 2
    assert f"{flag}: must be more than 0, at most {LARGEST_NUMBER}, got {value}" in (
        capsys.readouterr().err
    )



@pytest.mark.parametrize("value", ["inf", "1e300", "9007199254740992"])  # the last: 2**53
async def test_every_approval_timeout_serve_takes_is_one_its_sessions_take(
    tmp_path: Path, value: str
) -> None:
    """A value ``--approval-timeout`` accepts makes a server whose ``session.create``
    succeeds with it; one no session can hold never starts a server."""
    from test_gateway import BOUND_S, connect, serving

    from greenroom.actors.apps.parser import build_parser

    try:
        args = build_parser().parse_args(["serve", "--approval-timeout", value])
    except SystemExit as exited:
        assert exited.code == 2 and value in ("inf", "1e300")
        return
    with trio.fail_after(BOUND_S):
        async with (
            serving(tmp_path, approval_timeout_s=args.approval_timeout) as server,
            connect(server) as client,
        ):
            answer = await client.call("session.create")
            assert "result" in answer, answer
            session = server.host.get_session(answer["result"]["session_id"])
            assert session.settings.approval_timeout_s == float(value)
