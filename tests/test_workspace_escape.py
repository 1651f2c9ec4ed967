"""A session's workspace is fixed when the session is created (R-SEC-7).

The reproduction: two sessions on one host, A working in ``root`` and B in ``root/sub``.
A's ``run_shell`` replaces ``sub`` with a symlink — to ``/``, or to the host's data dir —
and B then uses each built-in tool through its workspace path. Before the fix B read and
wrote the whole file system (or the data dir: ``serve.token``, A's prompt in A's trace),
sandboxed or not. Now each call is an error output naming the replaced workspace and
reaches nothing. Also: the identity survives a reload, a workspace that touches the data
dir is refused, and a subagent keeps its parent's workspace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import RUN_TIMEOUT_S, allow_all, collect, of_type, open_host
from test_gateway import connect, serving

import greenroom.actors.gateway.creation as creation
from greenroom.actors.providers.scripted import Reply, text, tool_call
from greenroom.actors.runtime.errors import ConfigurationError
from greenroom.actors.runtime.storage import SessionStore
from greenroom.actors.runtime.subagents import spawn_subagent
from greenroom.actors.tools.builtin import BUILTIN_TOOLS
from greenroom.actors.tools.sandbox import sandbox_status, workspace_guard
from greenroom.actors.tools.workspace import WorkspaceError, identify_workspace
from greenroom.protocols import jsonrpc
from greenroom.protocols.outputs import ToolCallOutput
from greenroom.protocols.settings import SessionSettings

STATUS = sandbox_status()
if not STATUS.available:
    print(f"workspace escape tests in sandbox=required skipped: {STATUS.reason}")
MODES = [
    "off",
    pytest.param(
        "required", marks=pytest.mark.skipif(not STATUS.available, reason=STATUS.reason)
    ),
]

SECRET_PROMPT = "prompt of principal A: launch codes 4711"
REPLACED = "was replaced"


class Place:
    """The files of one reproduction: A's workspace ``root``, B's ``root/sub``, a secret
    outside both, and the host's data dir with a token in it."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "root"
        self.sub = self.root / "sub"
        self.sub.mkdir(parents=True)
        (self.sub / "own.txt").write_text("B's own file\n")
        self.outside = (tmp_path / "outside").resolve()
        self.outside.mkdir()
        self.secret = self.outside / "secret.txt"
        self.secret.write_text("top secret\n")
        self.data = tmp_path / "data"

    @staticmethod
    def from_root(path: Path) -> str:
        """``path`` relative to ``/``: where it is seen through a workspace that became
        a symlink to ``/``."""
        return str(path)[1:]


def attack(place: Place, target: str, tool: str) -> dict[str, Any]:
    """B's call that reaches a secret when its workspace is a symlink to ``target``."""
    if target == "root":
        secret, outside = place.from_root(place.secret), place.from_root(place.outside)
        return {
            "read_file": {"path": secret},
            "list_dir": {"path": outside},
            "search_files": {"pattern": "top secret", "path": outside},
            "write_file": {"path": f"{outside}/pwned.txt", "content": "pwned"},
            "run_shell": {"command": f"cat {secret}; touch {outside}/ran"},
        }[tool]
    return {
        "read_file": {"path": "serve.token"},
        "list_dir": {"path": "."},
        # The pattern does not match itself: B's own trace is in the data dir too.
        "search_files": {"pattern": "launch codes [0-9]+", "path": "."},
        "write_file": {"path": "planted.txt", "content": "pwned"},
        "run_shell": {"command": "cat serve.token; grep -rh 'launch codes [0-9]' sessions"},
    }[tool]


LEAKS = ("top secret", "token-123", "4711", "secret.txt", "serve.token", "sessions/")


async def swap_then_call(
    place: Place, providers: Any, mode: str, target: str, tool: str
) -> ToolCallOutput:
    """Run the reproduction and return B's tool call output."""
    settings = SessionSettings(sandbox=mode)  # type: ignore[arg-type]
    async with open_host(place.data) as host:
        (place.data / "serve.token").write_text("token-123\n")
        link = "/" if target == "root" else str(place.data.resolve())
        a = await host.create_session(
            tools=BUILTIN_TOOLS,
            provider=providers(
                [
                    Reply(
                        blocks=(
                            tool_call("a1", "run_shell", command=f"rm -rf sub && ln -s {link} sub"),
                        )
                    ),
                    Reply(blocks=(text("done"),)),
                ]
            ),
            workspace_dir=place.root,
            settings=settings,
        )
        b = await host.create_session(
            tools=BUILTIN_TOOLS,
            provider=providers(
                [
                    Reply(blocks=(tool_call("b1", tool, **attack(place, target, tool)),)),
                    Reply(blocks=(text("done"),)),
                ]
            ),
            workspace_dir=place.sub,
            settings=settings,
        )
        (swapped,) = of_type(await collect(a.run(SECRET_PROMPT, approve=allow_all)), ToolCallOutput)
        assert not swapped.is_error, swapped
        assert place.sub.is_symlink() and os.readlink(place.sub) == link
        (output,) = of_type(await collect(b.run("go", approve=allow_all)), ToolCallOutput)
    return output


def shown(output: ToolCallOutput) -> str:
    return "".join(getattr(block, "text", "") for block in output.content)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", ["root", "data"])
@pytest.mark.parametrize("tool", [t.name for t in BUILTIN_TOOLS])
async def test_a_workspace_replaced_by_a_symlink_is_refused(
    tmp_path: Path, providers: Any, mode: str, target: str, tool: str
) -> None:
    """R-SEC-7: B's workspace replaced by a symlink to ``/`` or to the data dir: B's call
    is an error output (R-TOOL-4) naming the replacement, and reaches nothing there."""
    place = Place(tmp_path)
    output = await swap_then_call(place, providers, mode, target, tool)
    message = shown(output)
    assert output.is_error and output.status == "error", message
    assert REPLACED in message and "workspace" in message, message
    assert not any(leak in message for leak in LEAKS), message
    assert not (place.outside / "pwned.txt").exists()
    assert not (place.outside / "ran").exists()
    assert not (place.data / "planted.txt").exists()


@pytest.mark.parametrize("mode", MODES)
async def test_another_directory_in_the_workspace_s_place_is_refused(
    tmp_path: Path, providers: Any, mode: str
) -> None:
    """R-SEC-7: not only symlinks: a different directory renamed into the workspace's
    path is not the workspace either."""
    place = Place(tmp_path)
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "decoy.txt").write_text("decoy\n")
    async with open_host(place.data) as host:
        b = await host.create_session(
            tools=BUILTIN_TOOLS,
            provider=providers(
                [
                    Reply(blocks=(tool_call("b1", "list_dir", path="."),)),
                    Reply(blocks=(tool_call("b2", "write_file", path="made", content="x"),)),
                    Reply(blocks=(tool_call("b3", "run_shell", command="ls; touch ran"),)),
                    Reply(blocks=(text("done"),)),
                ]
            ),
            workspace_dir=place.sub,
            settings=SessionSettings(sandbox=mode),  # type: ignore[arg-type]
        )
        place.sub.rename(tmp_path / "moved-away")
        decoy.rename(place.sub)
        outputs = of_type(await collect(b.run("go", approve=allow_all)), ToolCallOutput)
    assert [o.is_error for o in outputs] == [True] * 3
    assert all(REPLACED in shown(o) and "decoy" not in shown(o) for o in outputs)
    assert not (place.sub / "made").exists()
    assert not (place.sub / "ran").exists()


def _stored_identity(data: Path, session_id: str) -> dict[str, Any]:
    meta = json.loads(SessionStore(data).meta_path(session_id).read_text("utf-8"))
    identity: dict[str, Any] = meta["workspace_identity"]
    return identity


async def test_a_reloaded_session_keeps_its_workspace_identity(
    tmp_path: Path, providers: Any
) -> None:
    """R-SEC-7: the identity is in session.json, so a session loaded again — by the same
    host or after a restart — still refuses a directory put in its workspace's place while
    it was not loaded, and still works in its own workspace."""
    place = Place(tmp_path)
    async with open_host(place.data) as host:
        session = await host.create_session(
            tools=BUILTIN_TOOLS, provider="scripted", workspace_dir=place.sub
        )
        sid = session.id
        info = place.sub.stat()
        assert _stored_identity(place.data, sid)["device"] == info.st_dev
        assert _stored_identity(place.data, sid)["inode"] == info.st_ino
        await host.close_session(sid)
        provider = providers(
            [Reply(blocks=(tool_call("c1", "read_file", path="own.txt"),)), Reply(blocks=())]
        )
        reloaded = await host.load_session(sid, tools=BUILTIN_TOOLS, provider=provider)
        (kept,) = of_type(await collect(reloaded.run("go", approve=allow_all)), ToolCallOutput)
        assert not kept.is_error and "B's own file" in shown(kept)
    place.sub.rename(tmp_path / "moved-away")
    place.sub.mkdir()
    (place.sub / "own.txt").write_text("an impostor's file\n")
    async with open_host(place.data) as host:
        provider = providers(
            [Reply(blocks=(tool_call("c2", "read_file", path="own.txt"),)), Reply(blocks=())]
        )
        reloaded = await host.load_session(sid, tools=BUILTIN_TOOLS, provider=provider)
        (refused,) = of_type(await collect(reloaded.run("go", approve=allow_all)), ToolCallOutput)
    assert refused.is_error and REPLACED in shown(refused)
    assert "impostor" not in shown(refused)


async def test_a_session_json_without_identity_takes_it_at_load(
    tmp_path: Path, providers: Any
) -> None:
    """R-SEC-7: a session stored before identities were kept is fixed to the directory
    found at its path when it is loaded; a replacement after that is refused."""
    place = Place(tmp_path)
    async with open_host(place.data) as host:
        session = await host.create_session(provider="scripted", workspace_dir=place.sub)
        sid = session.id
    meta_path = SessionStore(place.data).meta_path(sid)
    meta = json.loads(meta_path.read_text("utf-8"))
    del meta["workspace_identity"]
    meta_path.write_text(json.dumps(meta), "utf-8")
    async with open_host(place.data) as host:
        provider = providers(
            [
                Reply(blocks=(tool_call("c1", "read_file", path="own.txt"),)),
                Reply(blocks=(tool_call("c2", "read_file", path="own.txt"),)),
                Reply(blocks=()),
            ]
        )
        loaded = await host.load_session(sid, tools=BUILTIN_TOOLS, provider=provider)
        assert loaded.workspace_identity is not None
        assert loaded.workspace_identity.inode == place.sub.stat().st_ino

        async def swap_after_first(call: Any) -> str:
            if call.id == "c2":
                place.sub.rename(tmp_path / "moved-away")
                place.sub.symlink_to(place.outside, target_is_directory=True)
            return "allow"

        outputs = of_type(await collect(loaded.run("go", approve=swap_after_first)), ToolCallOutput)
    assert [o.is_error for o in outputs] == [False, True]
    assert REPLACED in shown(outputs[1])


@pytest.mark.parametrize("where", ["is", "lies inside"])
async def test_a_workspace_that_is_or_lies_inside_the_data_dir_is_refused(
    tmp_path: Path, where: str
) -> None:
    """R-SEC-7: the data dir is never visible to a session: a workspace that is it or
    lies inside it is refused when the session is created."""
    data = tmp_path / "data"
    async with open_host(data) as host:
        (data / "inner").mkdir()
        workspace = {"is": data, "lies inside": data / "inner"}[where]
        with pytest.raises(ConfigurationError, match=f"{where} the data dir"):
            await host.create_session(provider="scripted", workspace_dir=workspace)
        assert host.sessions == ()


HOLDS_ATTACKS = [
    ("read_file", {"path": ".greenroom/serve.token"}),
    ("read_file", {"path": "via-link/serve.token"}),
    ("list_dir", {"path": ".greenroom"}),
    ("list_dir", {"path": "."}),
    ("search_files", {"pattern": "launch codes [0-9]+", "path": "."}),
    ("search_files", {"pattern": "token-[0-9]+", "path": "via-link"}),
    ("write_file", {"path": ".greenroom/planted.txt", "content": "pwned"}),
    ("write_file", {"path": "via-link/sessions/planted.txt", "content": "pwned"}),
]


@pytest.mark.parametrize(("tool", "arguments"), HOLDS_ATTACKS)
async def test_the_data_dir_inside_a_workspace_is_hidden_from_the_file_tools(
    tmp_path: Path, providers: Any, tool: str, arguments: dict[str, Any]
) -> None:
    """R-SEC-7: a workspace that holds the data dir (a home directory holding
    ``~/.greenroom``) is allowed, and no file tool reaches the data dir in it — by its
    name or through a symlink — nor shows it in a listing or a search."""
    workspace = tmp_path / "home"
    data = workspace / ".greenroom"
    async with open_host(data) as host:
        (data / "serve.token").write_text("token-123\n")
        (workspace / "project.txt").write_text("visible\n")
        (workspace / "via-link").symlink_to(data, target_is_directory=True)
        other = await host.create_session(provider="scripted", workspace_dir=workspace)
        await collect(other.run(SECRET_PROMPT))
        session = await host.create_session(
            tools=BUILTIN_TOOLS,
            provider=providers(
                [Reply(blocks=(tool_call("c1", tool, **arguments),)), Reply(blocks=())]
            ),
            workspace_dir=workspace,
        )
        (output,) = of_type(await collect(session.run("go", approve=allow_all)), ToolCallOutput)
    message = shown(output)
    assert not any(leak in message for leak in ("token-123", "4711", "sessions/")), message
    if arguments.get("path") != ".":
        assert output.is_error and "data dir" in message, message
    else:
        assert not output.is_error and ".greenroom" not in message, message
        assert "project.txt" in message or message.startswith("no matches"), message
    assert not (data / "planted.txt").exists()
    assert not (data / "sessions" / "planted.txt").exists()


@pytest.mark.parametrize("mode", MODES)
async def test_a_data_dir_moved_within_the_workspace_stays_hidden(
    tmp_path: Path, providers: Any, mode: str
) -> None:
    """R-SEC-7: a workspace holds the data dir two levels down (``home`` holding
    ``alice/.greenroom``). Renaming ``alice`` — which a sandboxed command may do — carried
    the data dir out of sight: the file tools found it by its path no more, and the next
    sandboxed command covered the empty directory made again at the old path, not it:
    other sessions' prompts and the MCP tokens were read. The data dir is hidden by what it
    is, wherever it goes, and no sandboxed command runs while it is not at its path."""
    workspace = tmp_path / "home"
    data = workspace / "alice" / ".greenroom"
    data.mkdir(parents=True)
    moved = workspace / "alice2" / ".greenroom"
    calls = [
        Reply(blocks=(tool_call("c2", "read_file", path="alice2/.greenroom/mcp/oauth.json"),)),
        Reply(blocks=(tool_call("c3", "search_files", pattern="4711", path="alice2"),)),
        Reply(blocks=(tool_call("c4", "list_dir", path="alice2/.greenroom"),)),
        Reply(blocks=(text("done"),)),
    ]
    if mode == "required":  # the model moves it itself, and its shell tries to read it
        calls[:0] = [Reply(blocks=(tool_call("c1", "run_shell", command="mv alice alice2"),))]
        calls[-1:-1] = [
            Reply(blocks=(tool_call("c5", "run_shell", command="cat alice2/.greenroom/mcp/*"),))
        ]
    async with open_host(data) as host:
        (data / "mcp").mkdir()
        (data / "mcp" / "oauth.json").write_text('{"token": "oauth-secret-999"}')
        other = await host.create_session(provider="scripted", workspace_dir=workspace)
        await collect(other.run(SECRET_PROMPT))
        session = await host.create_session(
            tools=BUILTIN_TOOLS, provider=providers(calls), workspace_dir=workspace,
            settings=SessionSettings(sandbox=mode),
        )  # fmt: skip
        if mode == "off":
            (workspace / "alice").rename(workspace / "alice2")
        outputs = of_type(await collect(session.run("go", approve=allow_all)), ToolCallOutput)
        assert moved.is_dir()
        # Put back for the host's close (the scratchpads made an empty one at its path).
        shutil.rmtree(workspace / "alice")
        (workspace / "alice2").rename(workspace / "alice")
    by_call = {o.call_id: shown(o) for o in outputs}
    assert not any("oauth-secret" in m or "sessions/" in m for m in by_call.values()), by_call
    assert "data dir" in by_call["c2"] and "data dir" in by_call["c4"], by_call
    assert by_call["c3"].startswith("no matches"), by_call
    if mode == "required":
        assert "is no longer the directory the host opened" in by_call["c5"], by_call


async def test_a_subagent_keeps_its_parent_s_workspace(tmp_path: Path, providers: Any) -> None:
    """R-SEC-7: a child uses the workspace its parent was created with, not what the
    path names when it is spawned: a parent whose workspace was replaced cannot spawn."""
    place = Place(tmp_path)
    async with open_host(place.data) as host:
        parent = await host.create_session(
            tools=[*BUILTIN_TOOLS, spawn_subagent],
            provider=providers(
                [
                    Reply(blocks=(tool_call("p1", "spawn_subagent", task="read it"),)),
                    Reply(blocks=(text("done"),)),
                ]
            ),
            workspace_dir=place.sub,
        )
        place.sub.rename(tmp_path / "moved-away")
        place.sub.symlink_to("/", target_is_directory=True)
        (output,) = of_type(await collect(parent.run("go", approve=allow_all)), ToolCallOutput)
    assert output.is_error and REPLACED in shown(output), shown(output)


def test_the_sandbox_guard_runs_the_command_only_in_the_verified_directory(
    tmp_path: Path,
) -> None:
    """R-SEC-7: inside the sandbox, the command runs only when the directory bubblewrap
    bound is the one the call verified (compared by device and inode through the
    inherited descriptor), and the descriptor is closed before it runs."""
    verified, other = tmp_path / "verified", tmp_path / "other"
    verified.mkdir()
    other.mkdir()
    fd = os.open(verified, os.O_RDONLY | os.O_DIRECTORY)
    try:
        argv = workspace_guard(fd, f"echo ran; [ -e /proc/$$/fd/{fd} ] && echo leaked")

        def run(where: Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                argv, cwd=where, pass_fds=(fd,), capture_output=True, text=True, check=False
            )

        elsewhere, there = run(other), run(verified)
    finally:
        os.close(fd)
    assert elsewhere.returncode == 125 and elsewhere.stdout == ""
    assert "did not bind the verified workspace" in elsewhere.stderr
    assert there.stdout == "ran\n"


@pytest.mark.skipif(not STATUS.available, reason=STATUS.reason)
async def test_no_descriptor_of_the_host_reaches_a_sandboxed_command(
    tmp_path: Path, providers: Any
) -> None:
    """R-SEC-7: the workspace descriptor bubblewrap binds from is closed before the
    command starts (``..`` from an open directory of the host would lead out of the
    sandbox): the command has stdin, stdout and stderr, nothing else."""
    place = Place(tmp_path)
    async with open_host(place.data) as host:
        session = await host.create_session(
            tools=BUILTIN_TOOLS,
            provider=providers(
                [
                    Reply(blocks=(tool_call("c1", "run_shell", command="ls /proc/$$/fd; true"),)),
                    Reply(blocks=()),
                ]
            ),
            workspace_dir=place.sub,
            settings=SessionSettings(sandbox="required"),
        )
        (output,) = of_type(await collect(session.run("go", approve=allow_all)), ToolCallOutput)
    assert shown(output).split() == ["exit", "code:", "0", "0", "1", "2"], shown(output)


async def test_gateway_images_are_not_confined_to_a_replaced_workspace(tmp_path: Path) -> None:
    """R-SEC-7: a client's image paths are confined to the session's workspace only once
    it is known to be the directory the session was created with: replaced by a symlink
    to ``/``, it would let any file of the host through as an "image"."""
    secret = (tmp_path / "secret.png").resolve()
    secret.write_bytes(b"not for the model")
    with trio.fail_after(RUN_TIMEOUT_S):
        async with serving(tmp_path) as server, connect(server) as client:
            sid = (await client.result("session.create"))["session_id"]
            workspace = server.host.get_session(sid).workspace_dir
            workspace.rename(tmp_path / "moved-away")
            workspace.symlink_to("/", target_is_directory=True)
            image = {"type": "image", "path": Place.from_root(secret)}
            refused = await client.error("run", {"session_id": sid, "input": [image]})
    assert refused["code"] == jsonrpc.INVALID_PARAMS
    assert "$.input" in refused["message"] and REPLACED in refused["message"]


async def test_a_client_workspace_swapped_after_its_check_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-7 (R-SEC-5): ``session.create {workspace}`` checked the client's directory
    under the workspace root, then the session fixed whatever the path named a moment
    later: a directory swapped for a symlink in between (another session's command
    flipping it) gave the client a session working outside the root. The gateway now
    checks the identity it fixes, and a swap after the check fails the call."""
    place = Place(tmp_path / "p")
    real_check = creation.confined_workspace

    def check_then_swap(*args: Any) -> Any:
        checked = real_check(*args)
        sub = place.root / "sub"
        sub.rename(place.root / "moved-away")
        sub.symlink_to(place.outside, target_is_directory=True)
        return checked

    monkeypatch.setattr(creation, "confined_workspace", check_then_swap)
    with trio.fail_after(RUN_TIMEOUT_S):
        async with (
            serving(tmp_path, workspace_root=place.root) as server,
            connect(server) as client,
        ):
            refused = await client.error("session.create", {"workspace": "sub"})
            assert not [
                s for s in server.host.sessions if s.workspace_dir.is_relative_to(place.outside)
            ]
    assert refused["code"] == jsonrpc.INVALID_PARAMS
    assert REPLACED in refused["message"]


def test_a_workspace_swapped_while_it_is_identified_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R-SEC-7: the identity is taken from the directory the resolved path names; it
    was taken by opening that path again, through a symlink swapped in meanwhile, so a
    path checked under a root came with the numbers of a directory outside it."""
    place = Place(tmp_path)
    real_resolve = Path.resolve

    def resolve_then_swap(self: Path, strict: bool = False) -> Path:
        monkeypatch.setattr(Path, "resolve", real_resolve)
        resolved = real_resolve(self, strict=strict)
        place.sub.rename(place.root / "moved-away")
        place.sub.symlink_to(place.outside, target_is_directory=True)
        return resolved

    monkeypatch.setattr(Path, "resolve", resolve_then_swap)
    with pytest.raises(WorkspaceError, match="was replaced while it was opened"):
        identify_workspace(place.sub)


async def test_a_stored_workspace_path_through_a_new_symlink_is_not_taken_at_load(
    tmp_path: Path,
) -> None:
    """R-SEC-7: a session loaded without a usable identity (an old ``session.json``, or
    another boot) takes the directory at its stored path only when no component of that
    path is a symlink now; only the last one was looked at, so a parent directory
    swapped for a symlink fixed the session to a directory outside."""
    place = Place(tmp_path)
    workspace = place.sub / "inner"
    workspace.mkdir()
    (place.outside / "inner").mkdir()
    async with open_host(place.data) as host:
        sid = (await host.create_session(provider="scripted", workspace_dir=workspace)).id
    meta_path = SessionStore(place.data).meta_path(sid)
    meta = json.loads(meta_path.read_text("utf-8"))
    del meta["workspace_identity"]
    meta_path.write_text(json.dumps(meta), "utf-8")
    place.sub.rename(place.root / "moved-away")
    place.sub.symlink_to(place.outside, target_is_directory=True)
    async with open_host(place.data) as host:
        loaded = await host.load_session(sid, tools=BUILTIN_TOOLS, provider="scripted")
        assert loaded.workspace_identity is not None
        assert loaded.workspace_identity.inode != (place.outside / "inner").stat().st_ino
