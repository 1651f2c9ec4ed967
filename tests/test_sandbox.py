"""run_shell confinement (R-SEC-3): an allow-listed environment in every mode, and the
bubblewrap sandbox for real — what the command can and cannot see, write and reach."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type, open_host

import greenroom.actors.tools.builtin as builtin
from greenroom.actors.providers.scripted import Reply, tool_call
from greenroom.actors.tools.builtin import BuiltinToolError, run_shell
from greenroom.actors.tools.sandbox import (
    SandboxStatus,
    sandbox_available,
    sandbox_status,
    shell_environment,
)
from greenroom.protocols.outputs import ToolCallOutput
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.tools import ToolContext

SECRET = "sk-ant-test-secret-0123456789"

STATUS = sandbox_status()
if not STATUS.available:
    print(f"bubblewrap sandbox tests skipped: {STATUS.reason}")
needs_bwrap = pytest.mark.skipif(not STATUS.available, reason=STATUS.reason)


@pytest.fixture
def place(tmp_path: Path) -> dict[str, Path]:
    """A workspace, a scratchpad and a data dir apart from it, and a secret beside them."""
    paths = {
        "workspace": tmp_path / "ws",
        "scratchpad": tmp_path / "data" / "sessions" / "s1" / "scratch",
        "data": tmp_path / "data",
        "outside": tmp_path / "outside",
    }
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
    (paths["outside"] / "secret.txt").write_text("top secret\n")
    (paths["data"] / "serve.token").write_text("token-123\n")
    (paths["data"] / "sessions" / "s1" / "trace_001.jsonl").write_text("{}\n")
    return paths


async def shell(
    place: dict[str, Path], command: str, *, sandbox: Any = "required", network: bool = False,
    workspace: Path | None = None,
) -> str:
    ctx = ToolContext(
        call_id="c1",
        workspace_dir=workspace or place["workspace"],
        scratchpad_dir=place["scratchpad"],
        report_progress=lambda message: None,
        sandbox=sandbox,
        shell_network=network,
        private_dirs=(place["data"],),
    )
    with trio.fail_after(RUN_TIMEOUT_S):
        result: str = await run_shell.function(command=command, ctx=ctx)
    return result


def test_the_environment_is_an_allow_list() -> None:
    host = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "xterm",
        "TZ": "UTC",
        "ANTHROPIC_API_KEY": SECRET,
        "OPENAI_API_KEY": SECRET,
        "GITHUB_TOKEN": SECRET,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "SSH_AUTH_SOCK": "/run/agent.sock",
        "HOME": "/root",
    }
    env = shell_environment(home=Path("/scratch/home"), tmpdir=Path("/tmp"), host_env=host)
    assert env == {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "xterm",
        "TZ": "UTC",
        "HOME": "/scratch/home",
        "TMPDIR": "/tmp",
    }


@pytest.mark.parametrize("mode", ["off", "auto"])
async def test_host_secrets_never_reach_the_command(
    place: dict[str, Path], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    monkeypatch.setenv("GREENROOM_SOME_TOKEN", SECRET)
    result = await shell(place, "env; echo HOME=$HOME", sandbox=mode)
    assert result.startswith("exit code: 0\n")
    assert SECRET not in result
    assert "ANTHROPIC_API_KEY" not in result and "GREENROOM_SOME_TOKEN" not in result
    home = (place["scratchpad"] / "home").resolve()
    assert f"HOME={home}" in result


async def test_required_refuses_to_run_without_a_sandbox(
    place: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = SandboxStatus(available=False, reason="bubblewrap (bwrap) is not installed")
    monkeypatch.setattr(builtin, "sandbox_status", lambda: missing)
    marker = place["workspace"] / "ran"
    with pytest.raises(BuiltinToolError, match="not run: sandbox=required, and bubblewrap"):
        await shell(place, f"touch {marker}", sandbox="required")
    assert not marker.exists()
    # auto runs it unconfined (the environment is still allow-listed).
    assert await shell(place, f"touch {marker}", sandbox="auto") == "exit code: 0\n"
    assert marker.exists()


def test_sandbox_available_agrees_with_the_status() -> None:
    assert sandbox_available() is STATUS.available
    assert STATUS.reason


@needs_bwrap
async def test_files_outside_the_workspace_are_not_there(place: dict[str, Path]) -> None:
    secret = place["outside"] / "secret.txt"
    result = await shell(place, f"cat {secret}; ls {place['outside'].parent}; ls /root /home")
    assert "top secret" not in result
    assert "No such file or directory" in result
    assert "outside" not in result.replace(str(secret), "")


@needs_bwrap
async def test_the_data_dir_is_absent_but_the_scratchpad_is_there(
    place: dict[str, Path],
) -> None:
    data = place["data"]
    result = await shell(
        place,
        f"cat {data}/serve.token; cat {data}/sessions/s1/trace_001.jsonl; ls {data}/sessions/s1;"
        f" echo kept > {place['scratchpad']}/note.txt",
    )
    assert "token-123" not in result and "{}" not in result
    assert result.splitlines()[-1] == "scratch"  # the session's own scratchpad, nothing else
    assert (place["scratchpad"] / "note.txt").read_text() == "kept\n"


@needs_bwrap
async def test_a_data_dir_inside_the_workspace_is_hidden(tmp_path: Path) -> None:
    workspace = tmp_path / "home"
    data = workspace / ".greenroom"
    place = {
        "workspace": workspace,
        "data": data,
        "scratchpad": data / "sessions" / "s1" / "scratch",
    }
    place["scratchpad"].mkdir(parents=True)
    (data / "serve.token").write_text("token-123\n")
    (workspace / "project.txt").write_text("visible\n")
    result = await shell(place, "cat project.txt; cat .greenroom/serve.token; ls -a .greenroom")
    assert "visible" in result and "token-123" not in result
    assert (data / "serve.token").read_text() == "token-123\n"  # hidden, not removed


def _files_outside(tmp_path: Path, workspace: Path) -> list[Path]:
    return sorted(p for p in tmp_path.rglob("*") if not p.is_relative_to(workspace))


@needs_bwrap
async def test_writes_land_only_in_the_workspace(place: dict[str, Path], tmp_path: Path) -> None:
    # Unique names in the system directories, removed should a regression create them.
    system = [f"/usr/greenroom-{os.getpid()}", f"/etc/greenroom-{os.getpid()}"]
    scratch_tmp = f"/tmp/greenroom-{os.getpid()}"  # the sandbox's own /tmp
    before = _files_outside(tmp_path, place["workspace"])
    try:
        result = await shell(
            place,
            f"echo x > {place['outside']}/new.txt; echo x > {system[0]}; echo x > {system[1]};"
            f" echo x > {scratch_tmp} && cat {scratch_tmp}; echo inside > made.txt",
        )
        assert not any(map(os.path.exists, [*system, scratch_tmp]))
    finally:
        for path in [*system, scratch_tmp]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert (place["workspace"] / "made.txt").read_text() == "inside\n"
    after = _files_outside(tmp_path, place["workspace"])
    new = [p for p in after if p not in before and not p.is_relative_to(place["scratchpad"])]
    assert new == []
    assert "Read-only file system" in result or "No such file" in result


@needs_bwrap
async def test_tmp_is_fresh_and_proc_shows_only_the_sandbox(place: dict[str, Path]) -> None:
    result = await shell(place, "ls -A /tmp; echo --; ls /proc | grep -c '^[0-9]'")
    lines = result.splitlines()[1:]
    tmp_entries, processes = lines[: lines.index("--")], lines[-1]
    # Only the mount points of the workspace and scratchpad, when they lie below /tmp.
    mounted = {
        p.resolve().relative_to("/tmp").parts[0]
        for p in (place["workspace"], place["scratchpad"])
        if p.resolve().is_relative_to("/tmp")
    }
    assert set(tmp_entries) == mounted
    assert int(processes) <= 5  # the sandbox's own processes, not the host's


async def _listen() -> tuple[trio.SocketListener, int]:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listener.socket.getsockname()[1]
    return listener, port


@needs_bwrap
async def test_no_network_unless_the_session_allows_it(place: dict[str, Path]) -> None:
    listener, port = await _listen()
    async with listener:
        probe = f"(echo hi > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo reached || echo refused"
        assert (await shell(place, probe)).splitlines()[-1] == "refused"

        async with trio.open_nursery() as nursery:

            async def accept_one() -> None:
                stream = await listener.accept()
                await stream.aclose()

            nursery.start_soon(accept_one)
            result = await shell(place, probe, network=True)
        assert result.splitlines()[-1] == "reached"


@needs_bwrap
async def test_the_command_runs_without_capabilities_in_a_new_session(
    place: dict[str, Path],
) -> None:
    result = await shell(place, "grep CapEff /proc/self/status; ps -o sid=,pid= -p $$")
    assert "CapEff:\t0000000000000000" in result
    sid, _ = result.splitlines()[-1].split()
    # A session led inside the sandbox's PID namespace (an outside leader shows as 0):
    # no terminal of the host to inject input into.
    assert int(sid) > 0


def test_os_can_see_bwrap_or_the_reason_says_why() -> None:
    if STATUS.available:
        assert STATUS.bwrap is not None and os.access(STATUS.bwrap, os.X_OK)
    else:
        assert "bubblewrap" in STATUS.reason or "Linux" in STATUS.reason


@needs_bwrap
@pytest.mark.parametrize("mode", ["required", "off"])
async def test_a_session_passes_its_sandbox_settings_and_hides_its_data_dir(
    tmp_path: Path, providers, mode: str
) -> None:
    """Through a real host: the session's ``sandbox`` setting reaches run_shell, and the
    host's data dir is hidden from a sandboxed command even inside the workspace."""
    workspace = tmp_path / "home"
    workspace.mkdir()
    command = "ls -A .greenroom; ls .greenroom/sessions/*/"
    provider = providers(
        [Reply(blocks=(tool_call("c1", "run_shell", command=command),)), Reply(blocks=())]
    )
    async with open_host(workspace / ".greenroom") as host:
        session = await host.create_session(
            tools=[run_shell],
            provider=provider,
            workspace_dir=workspace,
            settings=SessionSettings(sandbox=mode),
        )
        outputs = await collect(session.run("go", approve=allow_all))
    (output,) = of_type(outputs, ToolCallOutput)
    shown = output.content[0].text  # type: ignore[union-attr]
    if mode == "off":
        assert "usage.sqlite" in shown and "session.json" in shown
    else:
        assert shown.splitlines()[1:] == ["sessions", "scratch"]
